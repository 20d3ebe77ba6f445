"""tools/timeline_report.py on the committed H200 result whose rate runs kept timelines (oos3): P's
steps stretched over their calibrated lone time, by the decode batch D ran beside them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.regen_validations import RESULTS
from tools.timeline_report import p_steps_beside, report


def test_p_steps_are_read_against_the_lone_fit_and_the_d_steps_beside():
    run = {
        "timeline": {
            "steps": {
                "prefill": [[[0.0, 0.2, 1000, 0], [1.0, 0.4, 1000, 0], [2.0, 0.1, 0, 0]]],
                "decode": [[[1.0, 0.1, 0, 2], [1.1, 0.1, 0, 3], [0.19, 0.05, 0, 1]]],
            }
        }
    }
    got = p_steps_beside(run, lambda rows: 0.1 * rows)  # 100 ms lone at 1000 rows
    assert [round(s["stretch"], 6) for s in got] == [2.0, 4.0]  # the 0-row step is no prompt step
    assert [round(s["covered"], 6) for s in got] == [0.05, 0.5] and [s["d_batch"] for s in got] == [1, 3]


def test_the_oos3_rate_runs():
    r = report(json.loads((RESULTS / "e2e_h200x1_depth40_oos3.json").read_text()))
    a = r["modes"]["asymmetric"]
    assert a["p_lone_fit_ms"] == pytest.approx([62.004, 0.08985], rel=1e-3)
    by = a["p_stretch_by_d_batch"]
    assert by["alone"]["steps"] == 7 and by["alone"]["median_stretch"] == pytest.approx(1.26, abs=0.01)
    assert by["1"]["steps"] == 8 and by["1"]["median_stretch"] == pytest.approx(2.06, abs=0.01)
    assert [b["rate"] for b in a["busy"]] == [0.75, 1.5]
    assert set(r["modes"]) == {"asymmetric", "encoder-only"}


def test_a_result_without_timelines_says_so():
    p = subprocess.run(
        [sys.executable, "tools/timeline_report.py", str(RESULTS / "e2e_h200x1_depth40_oos2.json")],
        capture_output=True,
        text=True,
        cwd=RESULTS.parents[1],
    )
    assert p.returncode == 1 and "no P/D mode with a timeline" in p.stdout


def test_a_symmetric_p_window_steps_by_prompt_length():
    """headline4 (4f99bfc): each symmetric P's window steps alone, by prompt length. In host time
    they grow ~0.03 ms a prompt token: the prefix step before them returns before its GPU work
    ends, and the window step waits for that tail. As the GPU held them they are flat, 85-101 ms,
    like an asymmetric D's first step of the same phase (85-101 ms)."""
    r = report(json.loads((RESULTS / "e2e_h200x1_depth40_headline4_five.json").read_text()))
    split, windows = r["modes"]["symmetric-split"]["window_steps"], r["modes"]["symmetric-windows"]["window_steps"]
    assert (len(split["steps"]), len(windows["steps"])) == (17, 16)
    assert split["host_line_ms"] == pytest.approx([61.2, 0.0316], rel=0.01)
    assert windows["host_line_ms"] == pytest.approx([60.4, 0.0336], rel=0.01)
    for ws in (split, windows):
        assert all(84 < held <= 101.5 for _, held, _ in ws["steps"])  # host: up to 153 ms
        assert abs(ws["line_ms"][1]) < 0.005  # flat: under 5 ms per 1K tokens
    d = r["modes"]["asymmetric"]["d_first_steps"]
    assert sorted({n for n, _ in d}) == [1024, 3072] and all(85 < ms < 101 for _, ms in d)
    assert "window_steps" not in r["modes"]["asymmetric"]  # its P stops at the split: no window steps
