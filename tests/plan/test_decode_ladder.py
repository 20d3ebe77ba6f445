"""D's decode step by batch size from the calibration's ladder (bench/e2e.py ``decode_ladder``;
``validate.decode_ladder_ms``, ``padded_excess_ms``): on a GPU a decode step replays the CUDA graph of
its padded batch, so a GPU result that measured the ladder prices its decode steps at the padded
size; a result without one, or a CPU result, keeps the line in the batch."""

from __future__ import annotations

import copy
import json

import pytest

from asympd.config import tiny
from asympd.plan.validate import decode_ladder_ms, fit_steps, padded_excess_ms, validate_e2e
from tests.plan.test_validate_e2e import calibration
from tools.regen_validations import RESULTS

CFG = tiny()
# the staircase the depth-40 runs' step logs showed (ms at padded sizes 1 / 2 / 4 / 8 / 16)
LADDER = {"1": 38.0, "2": 43.0, "4": 49.0, "8": 58.0, "16": 66.0}


def test_a_step_costs_what_its_padded_batch_adds_to_one_request():
    table = {int(b): ms for b, ms in LADDER.items()}
    assert padded_excess_ms(table, 1) == 0.0
    assert padded_excess_ms(table, 3) == padded_excess_ms(table, 4) == 11.0  # both replay the graph of 4
    assert padded_excess_ms(table, 5) == padded_excess_ms(table, 8) == 20.0
    assert padded_excess_ms(table, 9) == 28.0  # padded to 16
    # past the largest measured size, along its last two (8 -> 16: +1 ms a padded request): 24 -> 36 ms
    assert padded_excess_ms(table, 20) == pytest.approx(36.0)
    # between measured sizes, linear in the padded size: 4 -> 8 missing here, 8 at 49 + 9 x 4 / 4
    assert padded_excess_ms({1: 38.0, 4: 49.0, 16: 66.0}, 7) == pytest.approx(49.0 + 17.0 * 4 / 12 - 38.0)


def test_the_ladder_is_read_only_where_it_can_price_a_step():
    cal = {**calibration("asymmetric"), "ladder": {"step_ms": {**LADDER, "32": None}}}
    assert decode_ladder_ms(cal, on_gpu=True) == {1: 38.0, 2: 43.0, 4: 49.0, 8: 58.0, 16: 66.0}
    assert decode_ladder_ms(cal, on_gpu=False) is None  # a CPU pads no batch
    assert decode_ladder_ms(calibration("asymmetric"), on_gpu=True) is None  # no ladder: the line
    no_base = {**cal, "ladder": {"step_ms": {"2": 43.0, "4": 49.0}}}
    assert decode_ladder_ms(no_base, on_gpu=True) is None  # nothing to add the sizes to


def test_fitted_decode_steps_follow_the_ladder_over_the_lone_step():
    """The lone step (from the lone requests' gaps) stays the base; the ladder gives what a larger
    batch adds. Without the ladder, the line through the calibration batch's gaps."""
    cal = calibration("asymmetric")
    line = fit_steps(CFG, "asymmetric", cal, d_budget=512, semantics="split")
    laddered = fit_steps(CFG, "asymmetric", {**cal, "ladder": {"step_ms": LADDER}}, d_budget=512, semantics="split")
    assert line.d_ladder_ms is None and laddered.d_ladder_ms is not None
    assert laddered.decode_ms(1, 0, 1) == line.decode_ms(1, 0, 1) == line.d_step_ms
    assert laddered.decode_ms(9, 0, 1) == pytest.approx(line.d_step_ms + 28.0)
    assert line.decode_ms(9, 0, 1) == pytest.approx(line.d_step_ms + 8 * line.d_seq_ms)
    # a step with prompt rows adds their path to the decode path, either way
    extra = line.d_pre_ms + 16 * line.d_row_ms
    assert laddered.decode_ms(9, 16, 1) == pytest.approx(laddered.decode_ms(9, 0, 1) + extra)


def test_a_result_with_a_ladder_records_it_and_predicts_with_it():
    """Through ``validate_e2e`` on a committed GPU result given a ladder: the validation records the
    table, and its decode steps cost what the ladder says (a flatter ladder, a shorter ITL);
    without one the result validates exactly as committed."""
    result = json.loads((RESULTS / "e2e_h200x1_depth40_oos13.json").read_text())
    committed = json.loads((RESULTS / "e2e_h200x1_depth40_oos13_validation.json").read_text())
    assert "d_ladder_ms" not in committed["modes"]["asymmetric"]["steps_ms"]
    assert validate_e2e(result)["rows"] == committed["rows"]
    flat = copy.deepcopy(result)
    lone = committed["modes"]["asymmetric"]["steps_ms"]["d_step_ms"]
    flat["modes"]["asymmetric"]["calibration"]["ladder"] = {"step_ms": {str(b): lone for b in (1, 2, 4, 8, 16)}}
    v = validate_e2e(flat)
    assert v["modes"]["asymmetric"]["steps_ms"]["d_ladder_ms"] == {b: lone for b in (1, 2, 4, 8, 16)}
    assert "d_ladder_ms" not in v["modes"]["encoder-only"]["steps_ms"]
    for got, want in zip(v["rows"], committed["rows"], strict=True):
        if got["mode"] == "asymmetric":  # every decode step at the lone step's price: shorter gaps
            assert got["predicted"]["itl_p50_ms"] < want["predicted"]["itl_p50_ms"]
        else:
            assert got == want
