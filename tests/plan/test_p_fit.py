"""P's step cost from the calibration co-run's alone steps (``validate.fit_p_step``): the line
through every P step D's steps covered less than ``ALONE_P`` of, where they ran at two or more
row counts; the lone requests' line otherwise, and for results without a co-run step log."""

from __future__ import annotations

import copy
import json

import pytest

from asympd.config import tiny
from asympd.plan.step_log import ALONE_P, BESIDE, overlap, p_alone_steps
from asympd.plan.validate import P_FIT_CO_RUN, P_FIT_LONE, fit_p_step, fit_steps, validate_e2e
from tests.plan.test_validate_e2e import TRUE, calibration
from tools.regen_validations import RESULTS

CFG = tiny()


def co_run_log() -> dict:
    """P's steps [start, seconds, rows, seqs] against D's: alone at 1000 rows (0.2 s, twice) and
    3000 rows (0.4 s); a 2000-row step D covered 5 % of (alone: 0.3 s); a 2000-row step D covered
    10 % of (not alone, 0.9 s: it would pull the line up); a step with no prompt rows."""
    p = [
        [0.0, 0.2, 1000, 0],
        [1.0, 0.2, 1000, 0],
        [2.0, 0.4, 3000, 0],
        [3.0, 0.3, 2000, 0],  # D's step [3.285, 0.015]: 5 % of it
        [4.0, 0.9, 2000, 0],  # D's steps [4.0, 0.045] and [4.855, 0.045]: 10 % of it
        [6.0, 0.05, 0, 2],
    ]
    d = [[3.285, 0.015, 0, 1], [4.0, 0.045, 0, 1], [4.855, 0.045, 0, 1], [5.0, 0.5, 0, 2]]
    return {"steps": {"prefill": p, "decode": d}}


def test_the_alone_rule_is_the_benchmarks():
    """bench/e2e.py reads alone and beside with the planner's helper, not a copy of its own."""
    import bench.e2e as e2e
    import tools.timeline_report as tr

    assert e2e._overlap is overlap and tr._overlap is overlap
    assert (e2e.ALONE_P, e2e.BESIDE, tr.BESIDE) == (ALONE_P, BESIDE, BESIDE) == (0.08, 0.5, 0.5)
    log = co_run_log()["steps"]
    assert [round(overlap(s, log["decode"]), 9) for s in log["prefill"][3:5]] == [0.05, 0.1]
    assert p_alone_steps(log["prefill"], log["decode"]) == [(1000, 0.2), (1000, 0.2), (3000, 0.4), (2000, 0.3)]
    # the benchmark's own stretch reading counts the same steps alone
    got = e2e.co_run_stretch(log["prefill"], log["decode"], e2e.p_key, between=True, alone_below=ALONE_P)
    assert got["steps_alone"] == 4


def test_alone_steps_at_two_sizes_give_p_line():
    """Four alone points (1000, 200), (1000, 200), (3000, 400), (2000, 300) ms: the line
    100 ms + 0.1 ms/row exactly; the 10 %-covered 900 ms step is left out."""
    cal = {**calibration("asymmetric"), "co_run": co_run_log()}
    a, b, record = fit_p_step(CFG, "asymmetric", cal)
    assert (a, b) == pytest.approx((100.0, 0.1))
    assert record["source"] == P_FIT_CO_RUN and record["steps"] == 4 and record["rows"] == [1000, 3000]
    assert record["lone_ms"] == pytest.approx([TRUE.p_step_ms, TRUE.p_row_ms])  # the lone requests' line
    steps = fit_steps(CFG, "asymmetric", cal, d_budget=512, semantics="split")
    assert (steps.p_step_ms, steps.p_row_ms) == pytest.approx((100.0, 0.1))
    # everything else still from the lone requests and the batch
    before = fit_steps(CFG, "asymmetric", calibration("asymmetric"), d_budget=512, semantics="split")
    assert (steps.d_step_ms, steps.move_ms, steps.move_row_ms, steps.handoff_ms) == (
        before.d_step_ms,
        before.move_ms,
        before.move_row_ms,
        before.handoff_ms,
    )


def test_alone_steps_at_one_size_keep_the_lone_fit():
    log = co_run_log()
    log["steps"]["prefill"] = [s for s in log["steps"]["prefill"] if s[2] in (1000, 0)] + [[4.0, 0.9, 2000, 0]]
    cal = {**calibration("asymmetric"), "co_run": log}
    a, b, record = fit_p_step(CFG, "asymmetric", cal)
    assert (a, b) == pytest.approx((TRUE.p_step_ms, TRUE.p_row_ms))
    rows = [n - CFG.window_size for n in (40, 100)]  # asymmetric P computes all but the last W
    assert record == {"source": P_FIT_LONE, "steps": 4, "rows": rows, "lone_ms": [a, b]}


def test_no_co_run_step_log_is_the_lone_fit_with_no_record():
    for cal in (
        calibration("asymmetric"),
        {**calibration("asymmetric"), "co_run": {"p": {"stretch": 2.0}, "d": {"stretch": 2.0}}},
        {**calibration("asymmetric"), "co_run": {"skipped": "one process"}},
    ):
        a, b, record = fit_p_step(CFG, "asymmetric", cal)
        assert (a, b) == pytest.approx((TRUE.p_step_ms, TRUE.p_row_ms)) and record is None
    cal = {**calibration("colocated"), "co_run": co_run_log()}  # no P: nothing to fit
    assert fit_p_step(CFG, "colocated", cal) == (0.0, 0.0, None)


def _least_squares(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def test_the_oos3_asymmetric_fit_is_the_line_through_its_alone_steps():
    """The committed out-of-sample result: 8 alone P steps of the co-run (5 at 896 rows, then
    1835, 6272 and 12501 from the fill burst), read here independently of ``step_log``."""
    result = json.loads((RESULTS / "e2e_h200x1_depth40_oos3.json").read_text())
    log = result["modes"]["asymmetric"]["calibration"]["co_run"]["steps"]
    alone = []
    for start, dur, rows, _ in log["prefill"]:
        covered = sum(max(0.0, min(start + dur, d[0] + d[1]) - max(start, d[0])) for d in log["decode"])
        if rows > 0 and covered / dur < 0.08:
            alone.append((float(rows), dur * 1e3))
    assert len(alone) == 8 and sorted({int(r) for r, _ in alone}) == [896, 1835, 6272, 12501]
    a, b = _least_squares(alone)
    assert a > 0 and b > 0  # no term clamped: the plain least-squares line
    v = validate_e2e(result)["modes"]["asymmetric"]
    assert (v["steps_ms"]["p_step_ms"], v["steps_ms"]["p_row_ms"]) == pytest.approx((a, b), rel=1e-9)
    assert (a, b) == pytest.approx((77.7, 0.1026), abs=0.05)
    assert {k: v["p_fit"][k] for k in ("source", "steps", "rows")} == {
        "source": P_FIT_CO_RUN,
        "steps": 8,
        "rows": [896, 12501],
    }
    assert v["p_fit"]["lone_ms"] == pytest.approx([62.004, 0.08985], rel=1e-3)  # the fit before


def test_a_result_without_the_co_run_log_validates_as_before():
    """The log alone decides: the oos3 result with its co-run steps removed is priced by the
    lone requests and records no ``p_fit``."""
    result = json.loads((RESULTS / "e2e_h200x1_depth40_oos3.json").read_text())
    bare = copy.deepcopy(result)
    for m in bare["modes"].values():
        (m.get("calibration") or {}).get("co_run", {}).pop("steps", None)
    v = validate_e2e(bare)["modes"]["asymmetric"]
    assert "p_fit" not in v
    assert [v["steps_ms"]["p_step_ms"], v["steps_ms"]["p_row_ms"]] == pytest.approx([62.004, 0.08985], rel=1e-3)
