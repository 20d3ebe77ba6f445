"""Shared fixtures: one tiny random checkpoint per test session, written in the released format."""

from __future__ import annotations

import pytest
import torch

from asympd.config import tiny
from asympd.model.checkpoint import write_checkpoint

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(tiny(), out, seed=0)
    return str(out)
