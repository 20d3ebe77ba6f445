"""The calibration's co-run (bench/e2e.py ``co_run``) replaces the equal shares of a shared GPU."""

from __future__ import annotations

from asympd.plan.deployment import Deployment
from asympd.plan.validate import co_run_p_by_rows, co_run_stretch
from asympd.serve.admission import POLICIES


def dep(mode: str = "asymmetric", shared: bool = True) -> Deployment:
    return Deployment(mode, POLICIES["alone-4"], 16384, "auto", shared_gpu=shared)


def cal(p: float | None, d: float | None) -> dict:
    return {"co_run": {"p": {"stretch": p}, "d": {"stretch": d}}}


def test_measured_stretch_sets_each_share():
    got = co_run_stretch(cal(2.5, 1.25), dep())
    assert got == (2.5, 1.25)
    measured = Deployment("asymmetric", POLICIES["alone-4"], 16384, "auto", shared_gpu=True, co_run=got)
    assert (measured.p_share, measured.d_share) == (0.4, 0.8)
    assert (dep().p_share, dep().d_share) == (0.5, 0.5)  # not measured: equal shares


def test_a_side_not_read_keeps_the_equal_share_and_noise_below_one_reads_as_one():
    assert co_run_stretch(cal(None, 1.5), dep()) == (2.0, 1.5)
    assert co_run_stretch(cal(0.8, None), dep()) == (1.0, 2.0)


def test_no_co_run_or_nothing_to_share_keeps_the_old_model():
    assert co_run_stretch({}, dep()) is None  # an older result
    assert co_run_stretch(cal(None, None), dep()) is None
    assert co_run_stretch({"co_run": {"skipped": "one process"}}, dep("colocated")) is None
    assert co_run_stretch(cal(2.5, 1.25), dep(shared=False)) is None  # GPUs of their own
    assert co_run_stretch(cal(2.5, 1.25), dep("colocated")) is None


def test_a_co_run_of_equal_shares_is_the_model_before_it():
    """A measured stretch of 2 on both sides is the equal shares: the committed true-depth
    validation comes out the same (only the mode's ``co_run_stretch`` is added)."""
    import copy
    import json

    from asympd.plan.steps import RESULTS_DIR
    from asympd.plan.validate import validate_e2e

    result = json.loads((RESULTS_DIR / "e2e_h200x1_depth40.json").read_text())
    result["modes"] = {k: v for k, v in result["modes"].items() if k in ("asymmetric", "colocated")}
    equal = copy.deepcopy(result)
    for m in equal["modes"].values():
        m["calibration"]["co_run"] = {"p": {"stretch": 2.0}, "d": {"stretch": 2.0}}
    before, after = validate_e2e(result, shares="co-run"), validate_e2e(equal, shares="co-run")
    assert after["modes"]["asymmetric"].pop("co_run_stretch") == {"p": 2.0, "d": 2.0}
    assert "co_run_stretch" not in after["modes"]["colocated"]  # one process: nothing shared to measure
    assert json.dumps(after) == json.dumps(before)


def test_p_stretch_per_step_size_is_read_between_the_measured_sizes():
    """Stretch 1.5 at 1000 rows, 2.5 at 5000: a 3000-row step reads 2.0 (rate 0.5), 2000 rows
    1.75; outside the measured sizes the nearest one's."""
    d = Deployment(
        "asymmetric",
        POLICIES["alone-4"],
        16384,
        "auto",
        shared_gpu=True,
        co_run=(1.8, 1.5),
        p_by_rows=((1000, 1.5), (5000, 2.5)),
    )
    assert [d.p_share_at(r) for r in (3000, 2000, 1000, 5000)] == [0.5, 1 / 1.75, 1 / 1.5, 0.4]
    assert (d.p_share_at(10), d.p_share_at(16384)) == (1 / 1.5, 0.4)
    assert dep().p_share_at(3000) == 0.5 and replace_co_run(1.8).p_share_at(3000) == 1 / 1.8  # one value: every size


def replace_co_run(p: float) -> Deployment:
    return Deployment("asymmetric", POLICIES["alone-4"], 16384, "auto", shared_gpu=True, co_run=(p, 2.0))


def test_the_stretch_per_rows_comes_from_two_sizes_or_more():
    two = {"co_run": {"p": {"stretch": 1.9, "stretch_by_key": {"16384": 2.6, "896": 0.9}}, "d": {"stretch": 1.8}}}
    assert co_run_p_by_rows(two, dep()) == ((896, 1.0), (16384, 2.6))  # by rows; below 1 reads as 1
    one = {"co_run": {"p": {"stretch": 1.73, "stretch_by_key": {"1024": 1.73}}, "d": {"stretch": 1.82}}}
    assert co_run_p_by_rows(one, dep()) is None  # one size: the single value
    assert co_run_p_by_rows(cal(1.73, 1.82), dep()) is None  # a co-run before the fill phase
    assert co_run_p_by_rows({}, dep()) is None
    assert co_run_p_by_rows(two, dep(shared=False)) is None and co_run_p_by_rows(two, dep("colocated")) is None


def test_the_stretch_at_every_size_equal_is_the_single_value():
    """The out-of-sample H200 result (one co-run size, P 1.73): given that stretch at two sizes,
    its validation comes out the same but for the listed sizes; another stretch at the large size
    changes the asymmetric predictions (the per-size reading is used)."""
    import copy
    import json

    from asympd.plan.steps import RESULTS_DIR
    from asympd.plan.validate import validate_e2e

    result = json.loads((RESULTS_DIR / "e2e_h200x1_depth40_oos.json").read_text())
    before = validate_e2e(result, shares="co-run")
    p = result["modes"]["asymmetric"]["calibration"]["co_run"]["p"]
    assert p["keys"] == [896] and "stretch_by_key" not in p  # the co-run before its fill phase
    assert "co_run_p_by_rows" not in before["modes"]["asymmetric"]
    flat, steep = copy.deepcopy(result), copy.deepcopy(result)
    flat["modes"]["asymmetric"]["calibration"]["co_run"]["p"]["stretch_by_key"] = {
        "896": p["stretch"],
        "16384": p["stretch"],
    }
    steep["modes"]["asymmetric"]["calibration"]["co_run"]["p"]["stretch_by_key"] = {"896": p["stretch"], "16384": 3.0}
    after = validate_e2e(flat, shares="co-run")
    assert after["modes"]["asymmetric"].pop("co_run_p_by_rows") == [[896, p["stretch"]], [16384, p["stretch"]]]
    assert json.dumps(after) == json.dumps(before)
    moved = validate_e2e(steep, shares="co-run")
    assert moved["modes"]["asymmetric"]["co_run_p_by_rows"] == [[896, p["stretch"]], [16384, 3.0]]
    assert [r["predicted"] for r in moved["rows"]] != [r["predicted"] for r in before["rows"]]
