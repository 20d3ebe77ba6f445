"""``tools/beside_p.py``: D's decode steps beside P's in a committed one-GPU result, exact counts."""

from __future__ import annotations

import json
import subprocess
import sys

from tools.beside_p import report
from tools.regen_validations import RESULTS

ROOT = RESULTS.parents[1]


def test_the_v10_runs_put_the_2_req_s_gaps_on_either_side_of_one_half():
    table = report(json.loads((RESULTS / "e2e_h200x1_depth40_v10_two.json").read_text()))
    assert set(table) == {"asymmetric", "symmetric-split"}
    asym, split = table["asymmetric"][-1], table["symmetric-split"][-1]
    assert (asym["rate"], asym["steps_beside_p"], asym["decode_steps"]) == (2.0, 48, 137)
    assert (split["rate"], split["steps_beside_p"], split["decode_steps"]) == (2.0, 67, 127)
    # the p50 follows the side more tokens came out on: asymmetric's in the alone size, split's beside
    assert asym["tokens_beside_p_fraction"] < 0.5 < split["tokens_beside_p_fraction"]
    assert abs(asym["itl_p50_ms"] - asym["alone_step_p50_ms"]) < abs(asym["itl_p50_ms"] - asym["beside_step_p50_ms"])
    assert abs(split["itl_p50_ms"] - split["beside_step_p50_ms"]) < 1.0


def test_it_writes_what_it_printed(tmp_path):
    out = tmp_path / "t.json"
    src = RESULTS / "e2e_h200x1_depth40_v10_two.json"
    p = subprocess.run(
        [sys.executable, "tools/beside_p.py", str(src), "--json", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert "asymmetric" in p.stdout and json.loads(out.read_text())["modes"] == report(json.loads(src.read_text()))
