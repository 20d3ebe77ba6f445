"""bench/engine_steps.py (the engine against its own layers) runs end to end on CPU (``--smoke``, the
tiny config), so a change to the engine cannot leave it broken until the next device call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _smoke(script: str, out: Path) -> None:
    env = {**os.environ, "ASYMPD_OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, script, "--smoke"], cwd=ROOT, env=env, check=True, timeout=600)


def test_engine_steps_smoke(tmp_path):
    _smoke("bench/engine_steps.py", tmp_path)
    r = json.loads((tmp_path / "engine_steps_smoke.json").read_text())
    names = [c["case"] for c in r["cases"]]
    assert names == [
        "decode B=2 k=0", "decode B=4 k=0", "decode B=2 k=3", "decode B=4 k=3",
        "decode B=4 + 1 bounded prefills", "decode B=4 + 4 bounded prefills",
        "decode B=4 + 1 bounded prefills, unmixed", "decode B=4 + 4 bounded prefills, unmixed",
        "prefill 4 x 48", "prefill 2 x 100",
    ]  # fmt: skip
    for c in r["cases"]:
        assert len(c["layers_ms"]) == 3 and c["step_ms"] > 0 and c["sum_ms"] > 0
        assert c["engine_over_layers"] == round(c["step_ms"] / c["sum_ms"], 3)
    assert [c["draft_ms"] > 0 for c in r["cases"] if "k=3" in c["case"]] == [True, True]
    parts = ("draft_seed_ms", "draft_blocks_ms", "draft_markov_ms")
    for c in r["cases"]:  # the denominator counts the drafting a speculative step does, and only there
        assert c["engine_over_target_layers"] == round(c["step_ms"] / c["target_sum_ms"], 3)
        if "k=3" in c["case"]:
            assert all(c[p] > 0 for p in parts) and c["draft_sum_ms"] == round(sum(c[p] for p in parts), 3)
            assert c["sum_ms"] == round(c["target_sum_ms"] + c["draft_sum_ms"], 3)
        else:
            assert "draft_sum_ms" not in c and c["sum_ms"] == c["target_sum_ms"]
    unmixed = [c for c in r["cases"] if c["case"].endswith("unmixed")]  # the admission step alone, then decodes
    assert [(c["requests"], c["rows"]) for c in unmixed] == [(0, 16), (0, 64)]
    assert all(c["decode_after_step_ms"] > 0 for c in unmixed)
    assert [p["case"] for p in r["per_sequence_path"]] == ["decode B=2 k=0", "decode B=4 k=0"]
