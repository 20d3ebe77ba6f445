"""bench/export_overlap.py (does P's prefix export stall its steps?) runs end to end on CPU
(``--smoke``): both export paths finish the same prompts in the same steps and export the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_export_overlap_smoke(tmp_path):
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/export_overlap.py", "--smoke"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    r = json.loads((tmp_path / "export_overlap_smoke.json").read_text())
    (case,) = r["cases"]
    side, inline = case["side_stream"], case["inline"]
    assert case["prompts"] == 4 and side["steps"] == inline["steps"] >= 1
    assert side["bytes"] == inline["bytes"] == case["export_bytes"] > 0
    assert r["d2h_pinned_GBps"] is None and "hidden" not in case  # no copy engine on CPU: no floor claimed
