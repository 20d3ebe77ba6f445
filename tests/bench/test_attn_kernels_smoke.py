"""``bench/attn_kernels.py --smoke --attention-only`` end to end on CPU (Triton's interpreter): every
launch runs and is checked against the reference, the default is version 3 off Hopper (the bits
of version 2 there: the interpreter's dots are fp32), and version 5, asked for by number, is
recorded as a launch that cannot run here rather than failing the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_attention_smoke_times_every_launch_and_records_what_cannot_run(tmp_path):
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "bench.attn_kernels", "--smoke", "--no-sweep", "--attention-only"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    res = json.loads((tmp_path / "attn_kernels_smoke.json").read_text())
    assert sorted(res["cells"]) == ["decode_3x2_ctx40", "prefill_1x24_ctx48"]
    for cell in res["cells"].values():
        att = cell["attention"]
        assert att["agree"]["rel_err"] < 2e-2 and att["agree"]["rel_err_default_vs_v2"] == 0.0
        why = "a Hopper (sm_90) kernel: it needs Triton and an sm_90 GPU"
        assert att["config_errors"] == {"{'version': 5}": f"ValueError: attention version 5: {why}"}
        configs = [f["config"] for f in att["fused_configs"]]
        assert configs[:3] == [{"version": 1}, {"version": 2}, {"version": 3}] and len(configs) == 6
        assert all(f["rel_err"] == pytest.approx(att["agree"]["rel_err"], rel=0.05) for f in att["fused_configs"])
