"""The calibration's co-run (bench/e2e.py ``co_run``) replaces the equal shares of a shared GPU."""

from __future__ import annotations

from asympd.plan.deployment import Deployment
from asympd.plan.validate import co_run_stretch
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
    before, after = validate_e2e(result), validate_e2e(equal)
    assert after["modes"]["asymmetric"].pop("co_run_stretch") == {"p": 2.0, "d": 2.0}
    assert "co_run_stretch" not in after["modes"]["colocated"]  # one process: nothing shared to measure
    assert json.dumps(after) == json.dumps(before)
