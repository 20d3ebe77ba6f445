"""tools/p_busy_tail.py: the GPU tail P's host steps leave out, counted up to the next step."""

from __future__ import annotations

import pytest

from tools.p_busy_tail import report, tail_s
from tools.regen_validations import RESULTS


def test_a_tail_counts_up_to_the_next_step_and_whole_after_the_last():
    run = {
        "requests": {"asympd_timings": [{"export_s": 0.060, "export_copy_s": 0.010}, {"export_s": 0.050}]},
        # steps at 0-0.3 s, 0.32-0.5 s (20 ms of room: the tail runs into it), 2.0-2.2 s (idle before)
        "timeline": {"steps": {"prefill": [[[2.0, 0.2, 900, 0], [0.0, 0.3, 1000, 0], [0.32, 0.18, 800, 0]]]}},
    }
    lag, left_out = tail_s(run)
    assert lag == pytest.approx(0.050)  # median of 50 and 50 ms
    assert left_out == pytest.approx(0.020 + 0.050 + 0.050)
    assert tail_s({"requests": {}, "timeline": run["timeline"]}) is None


def test_the_headline2_run_p_ratio_falls_with_the_tail_counted():
    rows = {(r["mode"], r["rate"]): r for r in report(RESULTS / "e2e_h200x1_depth40_headline2.json")}
    asym, sym = rows[("asymmetric", 1.0)], rows[("symmetric-windows", 1.0)]
    assert asym["basis"] == sym["basis"] == "estimated"
    assert sym["busy_s"] == sym["host_busy_s"]  # symmetric P samples its token: it waits for its GPU
    assert asym["busy_s"] > asym["host_busy_s"] * 1.05
    assert asym["tokens_per_busy_s"] / sym["tokens_per_busy_s"] == pytest.approx(1.41, abs=0.01)
    assert asym["tokens_per_host_busy_s"] / sym["tokens_per_host_busy_s"] == pytest.approx(1.53, abs=0.01)
