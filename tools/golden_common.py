"""What the golden-file tools share: the seed-0 tiny checkpoint in a temporary folder, one torch
thread (the tests' fp32 summation order), provenance, and the JSON layout (integer lists on one line)."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asympd.config import tiny
from asympd.model.checkpoint import write_checkpoint
from tests.util import cpu_kernels


def run_on_tiny(seed: int, compute: Callable[[str], Any]) -> tuple[Any, dict[str, Any]]:
    """``compute(checkpoint_dir)`` on a fresh tiny checkpoint; returns its result and the provenance."""
    torch.set_num_threads(1)  # as the tests run: fp32 summation order follows the thread count
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "tiny"
        write_checkpoint(tiny(), ckpt, seed=seed)
        out = compute(str(ckpt))
    env = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": 1,
        "cpu_kernels": cpu_kernels(),  # some bits depend on it (tests.util.for_cpu)
    }
    return out, {"made_at_commit": commit, "environment": env}


def write_golden(path: Path, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # int lists on one line
    path.write_text(text + "\n")
