"""Shared fixtures: one tiny random checkpoint per test session, written in the released format."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels (asympd/model/gemm_kernels.py) run under Triton's interpreter, so
# the CPU suite checks them too; this must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from asympd.config import tiny
from asympd.model.checkpoint import write_checkpoint

# One thread: results are then independent of the machine (fp32 summation order follows the thread
# count), and on a busy 2-core machine extra threads only contend (the suite runs 8-30x slower).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(tiny(), out, seed=0)
    return str(out)
