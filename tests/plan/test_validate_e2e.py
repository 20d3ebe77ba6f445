"""The e2e validation's step model: fitted exactly from a calibration made by a known model, and
the simulator's timeline for one lone request equal to that model's arithmetic."""

from __future__ import annotations

import pytest

from asympd.config import tiny
from asympd.engine.modes import split_point
from asympd.plan.simulate import Arrival
from asympd.plan.validate import MeasuredSteps, fit_steps, simulate_deployment

CFG = tiny()  # window 16
TRUE = MeasuredSteps(p_step_ms=10.0, p_row_ms=0.25, d_step_ms=20.0, d_seq_ms=5.0, d_row_ms=0.5, move_ms=2.0,
                     move_row_ms=0.125)  # fmt: skip


def calibration(mode: str) -> dict:
    """What bench/e2e.py would record from servers whose steps follow TRUE exactly."""
    lone = []
    for n in (40, 100, 40, 100):
        p_rows = n - CFG.window_size if mode == "asymmetric" else n
        d_rows = n if mode == "colocated" else n - split_point(CFG, n, "carry")  # symmetric-split: the replay
        steps = 2 if mode == "colocated" else 1  # colocated split semantics: [0, N - W) and [N - W, N)
        first = steps * TRUE.d_step_ms + TRUE.d_row_ms * d_rows
        timings = {"decode_first_step_s": first / 1e3}
        if mode != "colocated":
            p_steps = 1 if mode == "asymmetric" else 2  # symmetric P: [0, N - W), then [N - W, N)
            timings["prefill_s"] = (p_steps * TRUE.p_step_ms + TRUE.p_row_ms * p_rows) / 1e3
            timings["transfer_s"] = TRUE.move_for(n) / 1e3
        lone.append({"prompt_len": n, "ttft_s": 0.5, "gaps_s": [0.001, 0.02, 0.02, 0.02], "timings": timings})
    batch = {"size": 3, "requests": [{"gaps_s": [0.1, 0.1, 0.03, 0.03]} for _ in range(3)]}
    return {"lone": lone, "batch": batch}


def test_fit_recovers_the_steps():
    got = fit_steps(CFG, "asymmetric", calibration("asymmetric"), d_budget=512, semantics="split")
    for k in ("p_step_ms", "p_row_ms", "d_step_ms", "d_seq_ms", "d_row_ms", "move_ms", "move_row_ms"):
        assert getattr(got, k) == pytest.approx(getattr(TRUE, k)), k
    got = fit_steps(CFG, "symmetric-split", calibration("symmetric-split"), d_budget=512, semantics="split")
    for k in ("p_step_ms", "p_row_ms", "d_step_ms", "d_seq_ms", "d_row_ms", "move_ms", "move_row_ms"):
        assert getattr(got, k) == pytest.approx(getattr(TRUE, k)), k
    # colocated: the prompt runs in two phases (split semantics), each a step of its own
    got = fit_steps(CFG, "colocated", calibration("colocated"), d_budget=512, semantics="split")
    assert got.p_step_ms == got.p_row_ms == got.move_ms == got.move_row_ms == 0.0
    assert (got.d_step_ms, got.d_seq_ms, got.d_row_ms) == pytest.approx((TRUE.d_step_ms, TRUE.d_seq_ms, TRUE.d_row_ms))


def test_lone_request_timeline():
    steps = MeasuredSteps(**{**TRUE.__dict__, "ttft_offset_ms": 7.0})
    n, out = 100, 4
    sim = simulate_deployment(
        CFG, "asymmetric", steps, [Arrival(0, 1.0, n, out)], replicas=1, p_step_tokens=2048,
        policy=(4, 512), colocated_semantics="split",
    )  # fmt: skip
    s = split_point(CFG, n, "carry")
    p = TRUE.p_step_ms + TRUE.p_row_ms * s
    d_first = TRUE.d_step_ms + TRUE.d_row_ms * (n - s)
    assert sim.ttft_s[0] * 1e3 == pytest.approx(p + TRUE.move_for(n) + d_first + 7.0)
    assert [g * 1e3 for g in sim.gaps_s[0]] == pytest.approx([TRUE.d_step_ms] * (out - 1))
    # symmetric-windows: P makes the first token, D imports the windows and only decodes
    sim = simulate_deployment(
        CFG, "symmetric-windows", steps, [Arrival(0, 0.0, n, out)], replicas=1, p_step_tokens=2048,
        policy=(4, 512), colocated_semantics="split",
    )  # fmt: skip
    p = 2 * TRUE.p_step_ms + TRUE.p_row_ms * n  # P runs [0, N - W) and [N - W, N) as two steps
    assert sim.ttft_s[0] * 1e3 == pytest.approx(p + TRUE.move_for(n) + 7.0)
    assert len(sim.gaps_s[0]) == out - 1
