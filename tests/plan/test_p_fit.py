"""P's step cost from the calibration co-run's steps (``validate.fit_p_step``): the line through
every P step D's steps covered less than ``P_FIT_MAX_OVERLAP`` of (a covered part priced at equal
shares), where they ran at two or more row counts; the lone requests' line otherwise, and for
results without a co-run step log."""

from __future__ import annotations

import copy
import json

import pytest

from asympd.config import tiny
from asympd.plan.deployment import Deployment
from asympd.plan.serving_load import StageLoad
from asympd.plan.step_log import (
    ALONE_P,
    BESIDE,
    P_FIT_MAX_OVERLAP,
    alone_priced,
    d_prompt_alone_steps,
    gpu_held,
    overlap,
    p_alone_steps,
    p_fit_steps,
)
from asympd.plan.validate import (
    P_FIT_CO_RUN,
    P_FIT_LONE,
    _line,
    _robust_line,
    co_run_d_prompt_line,
    fit_admission_steps,
    fit_p_step,
    fit_steps,
    stalls,
    validate_e2e,
)
from asympd.serve.admission import POLICIES
from tests.plan.test_validate_e2e import TRUE, calibration
from tools.regen_validations import RESULTS

CFG = tiny()


def co_run_log() -> dict:
    """P's steps [start, seconds, rows, seqs] against D's: alone at 1000 rows (0.2 s, twice) and
    3000 rows (0.4 s); a 2000-row step of 0.32 s D covered 12.5 % of (priced alone at equal shares:
    0.32 x (1 - 0.125 / 2) = 0.3 s); a 2000-row step D covered 40 % of (left out, 0.9 s: it would
    pull the line up); a step with no prompt rows."""
    p = [
        [0.0, 0.2, 1000, 0],
        [1.0, 0.2, 1000, 0],
        [2.0, 0.4, 3000, 0],
        [3.0, 0.32, 2000, 0],  # D's step [3.28, 0.04]: 12.5 % of it
        [4.0, 0.9, 2000, 0],  # D's steps [4.0, 0.18] and [4.72, 0.18]: 40 % of it
        [6.0, 0.05, 0, 2],
    ]
    d = [[3.28, 0.04, 0, 1], [4.0, 0.18, 0, 1], [4.72, 0.18, 0, 1], [5.0, 0.5, 0, 2]]
    return {"steps": {"prefill": p, "decode": d}}


def test_the_alone_rule_is_the_benchmarks():
    """bench/e2e.py reads alone and beside with the planner's helper, not a copy of its own."""
    import bench.e2e as e2e
    import tools.timeline_report as tr

    assert e2e._overlap is overlap and tr._overlap is overlap
    assert (e2e.ALONE_P, e2e.BESIDE, tr.BESIDE) == (ALONE_P, BESIDE, BESIDE) == (0.08, 0.5, 0.5)
    log = co_run_log()["steps"]
    assert [round(overlap(s, log["decode"]), 9) for s in log["prefill"][3:5]] == [0.125, 0.4]
    assert p_alone_steps(log["prefill"], log["decode"]) == [(1000, 0.2), (1000, 0.2), (3000, 0.4)]
    # the benchmark's own stretch reading counts the same steps alone
    got = e2e.co_run_stretch(log["prefill"], log["decode"], e2e.p_key, between=True, alone_below=ALONE_P)
    assert got["steps_alone"] == 3


def test_the_fit_takes_steps_partly_beside_d_priced_alone():
    """Below ``P_FIT_MAX_OVERLAP`` covered a step is a point, its covered part at half speed."""
    log = co_run_log()["steps"]
    got = p_fit_steps(log["prefill"], log["decode"])
    assert [(r, round(s, 9), round(f, 9)) for r, s, f in got] == [
        (1000, 0.2, 0.0), (1000, 0.2, 0.0), (3000, 0.4, 0.0), (2000, 0.3, 0.125),
    ]  # fmt: skip
    assert P_FIT_MAX_OVERLAP == 0.3 and alone_priced(1.0, 0.2) == pytest.approx(0.9)
    assert alone_priced(1.0, 0.2, p_share=0.25) == pytest.approx(0.85)


def test_alone_steps_at_two_sizes_give_p_line():
    """Four points (1000, 200), (1000, 200), (3000, 400), (2000, 300 priced alone) ms: the line
    100 ms + 0.1 ms/row exactly; the 40 %-covered 900 ms step is left out."""
    cal = {**calibration("asymmetric"), "co_run": co_run_log()}
    a, b, record = fit_p_step(CFG, "asymmetric", cal)
    assert (a, b) == pytest.approx((100.0, 0.1))
    assert record["source"] == P_FIT_CO_RUN and record["steps"] == 4 and record["rows"] == [1000, 3000]
    assert record["beside_d"] == 1
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


def test_a_stall_is_left_out_of_p_line():
    """Two more steps on the line (2000 rows 0.3 s, 3000 rows 0.4 s) and a 1500-row step that
    took 2 s (the line gives 0.25 s): 3 robust deviations above the first line and over twice its
    time, so a stall, reported and not fitted: the line stays 100 ms + 0.1 ms/row. A step at 1.5x
    the line is P's cost, whatever its deviations."""
    log = co_run_log()
    log["steps"]["prefill"] += [[7.0, 0.3, 2000, 0], [8.0, 0.4, 3000, 0], [9.0, 2.0, 1500, 0]]
    cal = {**calibration("asymmetric"), "co_run": log}
    a, b, record = fit_p_step(CFG, "asymmetric", cal)
    assert (a, b) == pytest.approx((100.0, 0.1))
    assert record["stalls"] == [[1500, 2000.0]] and record["steps"] == 6 and record["rows"] == [1000, 3000]
    assert stalls([(1000.0, 200.0), (1000.0, 201.0), (3000.0, 400.0), (2000.0, 450.0)]) == []
    assert stalls([(1000.0, 200.0), (3000.0, 400.0)]) == []  # a perfect line: nothing deviates
    log["steps"]["prefill"][-1] = [9.0, 0.375, 1500, 0]  # 1.5 x the line: kept, and it pulls the line
    a, b, record = fit_p_step(CFG, "asymmetric", {**calibration("asymmetric"), "co_run": log})
    assert record["stalls"] == [] and record["steps"] == 7 and a > 100.0


def test_a_stall_is_judged_by_the_line_without_it():
    """v7a's co-run: 896-row steps at ~150 ms, one 1792-row step at 139 ms and one 1706-row step at
    499 ms. A line through all of them passes 1706 rows at ~320 ms, under twice the stall's time, so
    judged by it the stall hid and set the slope (0 + 0.19 ms/row); judged by the line through the
    others (flat at ~150 ms) it is a stall. A point beyond the others' rows (the fill's 16K-row
    step) is still judged by the line through all: the others' line says nothing about it."""
    alone = [(896.0, ms) for ms in (144.0, 154.0, 152.0, 152.0, 150.0, 186.0, 126.0)]
    assert stalls([*alone, (1706.0, 499.0), (1792.0, 139.0)]) == [(1706.0, 499.0)]
    assert stalls([*alone, (1792.0, 139.0), (16384.0, 679.0)]) == []


def test_the_robust_reference_line():
    """``_robust_line`` (Theil-Sen): exact on a line, unmoved by one point far off it where least
    squares is pulled, never negative, and least squares where the rows do not vary."""
    line = [(x, 100.0 + 0.1 * x) for x in (1000.0, 2000.0, 3000.0, 4000.0)]
    assert _robust_line(line) == pytest.approx((100.0, 0.1))
    off = [*line, (2500.0, 2000.0)]
    assert _robust_line(off) == pytest.approx((100.0, 0.1)) and _line(off)[0] > 300.0
    assert _robust_line([(1000.0, 500.0), (2000.0, 100.0)]) == (300.0, 0.0)  # a falling line: flat, at the median
    assert _robust_line([(896.0, 100.0), (896.0, 120.0)]) == _line([(896.0, 100.0), (896.0, 120.0)])


def test_two_stalls_do_not_hide_each_other():
    """v11's asymmetric co-run: 896-row steps at 107-160 ms, the first steps of 1107 and 1706 rows
    at 533 and 457 ms (each a compile of hc_project's finish kernel for a new split count:
    bench/results/first_steps.json), 1792 rows at 186 ms and the fill's 16K-row step at 783 ms.
    Judged by the least-squares line through the others each stall was under twice it, the other
    stall lifting it (the line through every step: 156 ms + 0.039 ms/row); judged by the Theil-Sen
    line through the others (a median of pair slopes, which one point cannot move far) both are."""
    alone = [(896.0, ms) for ms in (117.5, 106.9, 107.5, 111.3, 160.0, 109.2, 112.8)]
    both = [(1107.0, 533.3), (1706.0, 456.8)]
    assert stalls([*alone, *both, (1792.0, 186.3), (16384.0, 782.8)]) == both
    assert stalls([*alone, (1792.0, 186.3), (16384.0, 782.8)]) == []  # the line's own points stay


def test_alone_steps_at_one_size_keep_the_lone_fit():
    log = co_run_log()
    log["steps"]["prefill"] = [s for s in log["steps"]["prefill"] if s[2] in (1000, 0)] + [[4.0, 0.9, 2000, 0]]
    cal = {**calibration("asymmetric"), "co_run": log}
    a, b, record = fit_p_step(CFG, "asymmetric", cal)
    assert (a, b) == pytest.approx((TRUE.p_step_ms, TRUE.p_row_ms))
    rows = [n - CFG.window_size for n in (40, 100)]  # asymmetric P computes all but the last W
    assert record == {"source": P_FIT_LONE, "steps": 4, "rows": rows, "beside_d": 0, "stalls": [], "lone_ms": [a, b]}


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


def test_the_oos3_asymmetric_fit_is_the_line_through_its_co_run_steps():
    """The committed out-of-sample result: 9 P steps of the co-run D covered under 20 % of (5 at
    896 rows, then 1835, 6272 and 12501 alone, and the fill burst's 16384-row step 17 % beside
    D's first step, priced at equal shares), read here independently of ``step_log``."""
    result = json.loads((RESULTS / "e2e_h200x1_depth40_oos3.json").read_text())
    log = result["modes"]["asymmetric"]["calibration"]["co_run"]["steps"]
    points, beside = [], 0
    for start, dur, rows, _ in log["prefill"]:
        covered = sum(max(0.0, min(start + dur, d[0] + d[1]) - max(start, d[0])) for d in log["decode"]) / dur
        if rows > 0 and covered < 0.2:
            points.append((float(rows), dur * 1e3 * (1 - covered / 2)))
            beside += covered > 0
    assert len(points) == 9 and sorted({int(r) for r, _ in points}) == [896, 1835, 6272, 12501, 16384]
    assert beside == 1
    a, b = _least_squares(points)
    assert a > 0 and b > 0  # no term clamped: the plain least-squares line
    v = validate_e2e(result)["modes"]["asymmetric"]
    assert (v["steps_ms"]["p_step_ms"], v["steps_ms"]["p_row_ms"]) == pytest.approx((a, b), rel=1e-9)
    assert (a, b) == pytest.approx((85.0, 0.0988), abs=0.05)
    assert {k: v["p_fit"][k] for k in ("source", "steps", "rows", "beside_d")} == {
        "source": P_FIT_CO_RUN,
        "steps": 9,
        "rows": [896, 16384],
        "beside_d": 1,
    }
    assert v["p_fit"]["lone_ms"] == pytest.approx([62.004, 0.08985], rel=1e-3)  # the lone requests' line


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


def test_d_prompt_steps_come_from_the_co_run_log_alone_and_without_stalls():
    """D's prompt-only steps in the co-run's log with P idle: 128 rows at 90 ms (three), 256 at
    150 (two), 512 at 270, and a 256-row stall of 600 ms (a compile): the line 30 ms + 0.46875
    ms/row. A 512-row step beside P's (500 ms) and a step with decode sequences are not points;
    one row count alone gives no line (the calibration batch's inference stays)."""
    d = [[float(i), s, rows, 0] for i, (s, rows) in enumerate([(0.09, 128)] * 3 + [(0.15, 256)] * 2)]
    d += [[5.0, 0.27, 512, 0], [6.0, 0.6, 256, 0], [7.0, 0.5, 512, 0], [9.0, 0.3, 128, 3]]
    p = [[7.0, 1.0, 2000, 0], [8.5, 0.2, 0, 0]]
    cal = {**calibration("asymmetric"), "co_run": {"steps": {"prefill": p, "decode": d}}}
    assert d_prompt_alone_steps(d, p) == [(128, 0.09)] * 3 + [(256, 0.15)] * 2 + [(512, 0.27), (256, 0.6)]
    assert co_run_d_prompt_line(cal) == pytest.approx((30.0, 0.46875))
    dep = Deployment("asymmetric", POLICIES["alone-4"], p_step_tokens=2048, colocated_semantics="split")
    base = fit_steps(CFG, "asymmetric", cal, d_budget=512, semantics="split")
    steps = fit_admission_steps(CFG, cal, base, StageLoad(), dep, 512)
    assert (steps.d_pre_ms, steps.d_row_ms) == pytest.approx((30.0, 0.46875))
    one = {**cal, "co_run": {"steps": {"prefill": p, "decode": [s for s in d if s[2] == 128]}}}
    assert co_run_d_prompt_line(one) is None
    assert co_run_d_prompt_line(calibration("asymmetric")) is None


def test_steps_timed_to_their_gpu_end_give_the_line_and_the_answer_starts_there():
    """Since the busy clock each logged step carries its seconds to its GPU end. A P that samples
    nothing returns before its GPU work ends, so its line is fitted to the time the GPU held each
    step: from its start, or the step before's GPU end when that came later (the GPU runs them in
    order), to its own GPU end. The line is 100 ms + 0.1 ms/row here, though the host seconds
    (150-350 ms, and 100 ms for a step queued behind the one before) make no line. P's answer then
    starts at the GPU end: the lone requests' tail (``export_s - export_copy_s``, 2 ms) comes off it."""
    p = [
        [0.0, 0.15, 1000, 0, 0.2],
        [1.0, 0.15, 1000, 0, 0.2],
        [2.0, 0.35, 3000, 0, 0.4],
        [3.0, 0.25, 2000, 0, 0.3],
        [3.25, 0.1, 2000, 0, 0.35],  # queued behind the step before: the GPU held it 3.3-3.6 s
    ]
    assert gpu_held(p)[-1] == pytest.approx([3.3, 0.3, 2000, 0])
    cal = {**calibration("asymmetric"), "co_run": {"steps": {"prefill": p, "decode": [[10.0, 0.05, 0, 1]]}}}
    for r in cal["lone"]:
        r["timings"] = {**r["timings"], "export_s": 0.0025, "export_copy_s": 0.0005}
    a, b, record = fit_p_step(CFG, "asymmetric", cal)
    assert (a, b) == pytest.approx((100.0, 0.1)) and record["timed"] == "to the GPU end"
    steps = fit_steps(CFG, "asymmetric", cal, d_budget=512, semantics="split")
    assert steps.handoff_ms == pytest.approx(TRUE.handoff_ms - 2.0)
    # a CPU result (its fifth field is the host's seconds) and a log with host seconds only: the
    # line through the host seconds, the answer as measured
    assert "timed" not in fit_p_step(CFG, "asymmetric", cal, on_gpu=False)[2]
    host = {**cal, "co_run": {"steps": {"prefill": [s[:4] for s in p], "decode": [[10.0, 0.05, 0, 1]]}}}
    assert "timed" not in fit_p_step(CFG, "asymmetric", host)[2]
    assert fit_steps(CFG, "asymmetric", host, d_budget=512, semantics="split").handoff_ms == pytest.approx(
        TRUE.handoff_ms
    )


def test_a_symmetric_p_window_steps_are_priced_apart_from_its_line():
    """A P that ran its window chunks alone (``window_steps``: at most that many a step) logs steps
    of k x W rows that are a CUDA graph's, not the line's: they leave the line and are kept by k.
    A step of more windows than that is a prefix step and stays."""
    w = CFG.window_size
    log = co_run_log()
    log["steps"]["prefill"] += [
        [10.0, 0.05, w, 0],
        [11.0, 0.06, w, 0],
        [12.0, 0.05, w, 0],
        [13.0, 0.15, 4 * w, 0],
        [14.0, 0.1 + 0.0001 * 5 * w, 5 * w, 0],  # five windows' rows: on the line
    ]
    cal = {**calibration("symmetric-split"), "co_run": log}
    a, b, record = fit_p_step(CFG, "symmetric-split", cal, window_steps=4)
    assert (a, b) == pytest.approx((100.0, 0.1))
    assert record["windows"] == {"1": [3, pytest.approx(50.0)], "4": [1, pytest.approx(150.0)]}
    assert record["steps"] == 5 and record["rows"] == [5 * w, 3000]
    steps = fit_steps(CFG, "symmetric-split", cal, d_budget=512, semantics="split", window_steps=4)
    assert steps.p_window_ms == {1: pytest.approx(50.0), 4: pytest.approx(150.0)}
    # a P that mixed its steps (older results, an eager P): every step on the line
    a, b, record = fit_p_step(CFG, "symmetric-split", cal)
    assert "windows" not in record and record["steps"] == 9 and a < 100.0
    assert fit_steps(CFG, "symmetric-split", cal, d_budget=512, semantics="split").p_window_ms is None


def test_the_window_steps_of_a_measured_symmetric_p():
    """headline4 (4f99bfc): both symmetric P reported one_depth_per_step with 4 windows a step, and
    their validations price the window steps from the co-run's; the asymmetric P has none."""
    v = validate_e2e(json.loads((RESULTS / "e2e_h200x1_depth40_headline4_five.json").read_text()))
    for mode in ("symmetric-split", "symmetric-windows"):
        fit = v["modes"][mode]["p_fit"]
        assert set(fit["windows"]) >= {"1", "4"} and fit["rows"][0] > 4 * 128
        assert 80.0 < fit["windows"]["1"][1] < 100.0
    assert "windows" not in v["modes"]["asymmetric"]["p_fit"]
