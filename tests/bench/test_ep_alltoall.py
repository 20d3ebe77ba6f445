"""bench/ep_alltoall.py runs on CPU (gloo, tiny config) and records what the device run will."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ep_alltoall_bench_runs_on_cpu(tmp_path):
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "bench/ep_alltoall.py", "--tiny", "--world", "2", "--tokens", "1,9", "--iters", "1"]
    subprocess.run([*cmd, "--weights", "dequantized"], cwd=ROOT, env=env, check=True, timeout=300)
    r = json.loads((tmp_path / "ep_alltoall_tiny.json").read_text())
    assert (r["world"], r["backend"], r["topk"], r["experts_per_rank"]) == (2, "gloo", 3, 4)
    assert [row["tokens"] for row in r["rows"]] == [1, 9]
    for row in r["rows"]:
        assert row["outputs_equal"]  # both schemes add the same values in the same order
        t = row["tokens"]
        # the dense all-reduce's ring volume: 2 (W-1)/W of T x k x dim fp32
        assert row["allreduce"]["wire_bytes"] == t * 3 * 128 * 4
        assert row["alltoall"]["layer_ms"] > 0 and row["allreduce"]["comm_ms"] > 0
    assert r["rows"][1]["alltoall"]["wire_bytes"] < r["rows"][1]["allreduce"]["wire_bytes"]
