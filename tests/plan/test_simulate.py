"""The simulator's GPU model: engines that share a GPU run their steps one at a time, in the order
they issue them; engines on GPUs of their own never wait for each other. Hand-computed timelines."""

from __future__ import annotations

import pytest

from asympd.config import tiny
from asympd.plan.simulate import Arrival, DecodeEngine, PrefillEngine, run_engines

CFG = tiny()  # window 16: a 40-token prompt is 24 rows for P, 16 for D


class FlatSteps:
    """Every P step 30 ms, every D step 10 ms (decode rows, prompt rows or both)."""

    def prefill_ms(self, mode: str, chunks: list[tuple[int, int]], gpus: int) -> float:
        return 30.0

    def decode_ms(self, batch: int, prefill_rows: int, gpus: int) -> float:
        return 10.0


def engines() -> tuple[PrefillEngine, DecodeEngine]:
    steps = FlatSteps()
    p = PrefillEngine(CFG, steps, "asymmetric", 1, 1000, [Arrival(1, 0.015, 40, 5)])
    d = DecodeEngine(CFG, steps, "asymmetric", 1, 1000, [Arrival(0, 0.0, 40, 5)], 8, None, None, seed=0, num_spec=0)
    return p, d


def ms(xs: list[float]) -> list[float]:
    return [x * 1e3 for x in xs]


def test_separate_gpus_do_not_interact():
    p, d = engines()
    run_engines([p, d], [0, 1])
    assert p.run.done_s[1] * 1e3 == pytest.approx(15 + 30)
    # D: prompt step [0, 10] makes the first token, then a token every 10 ms
    assert d.run.first_token_s[0] * 1e3 == pytest.approx(10)
    assert ms(d.run.itl_s) == pytest.approx([10, 10, 10, 10])


def test_shared_gpu_serialises_p_and_d_steps():
    """D [0, 10], D [10, 20]; P issued at 15 starts when the GPU frees, [20, 50]; D's next step,
    issued at 20, waits for it: [50, 60], then [60, 70], [70, 80]. The gap over P's step is 40 ms
    and P's export moves from 45 to 50 ms."""
    p, d = engines()
    exported: list[tuple[int, int, float]] = []
    run_engines([p, d], [0, 0], lambda k, i, t: exported.append((k, i, round(t * 1e3, 6))))
    assert exported == [(0, 1, 50.0)]
    assert d.run.first_token_s[0] * 1e3 == pytest.approx(10)
    assert ms(d.run.itl_s) == pytest.approx([10, 40, 10, 10])
    assert d.run.done_s[0] * 1e3 == pytest.approx(80)
    assert (p.run.busy_s, d.run.busy_s) == pytest.approx((0.030, 0.050))  # compute only, not the wait


def test_exports_reach_the_decode_engine_in_time_order():
    """P's export pushed into D at export + 5 ms: D, idle, issues the request's prompt step then."""
    p, _ = engines()
    d2 = DecodeEngine(CFG, FlatSteps(), "asymmetric", 1, 1000, [], 8, None, None, seed=0, num_spec=0,
                      expected=[Arrival(1, 0.0, 40, 2)])  # fmt: skip

    def hand(_: int, i: int, t: float) -> None:
        d2.push(Arrival(i, t + 0.005, 40, 2))

    run_engines([p, d2], [0, 0], hand)
    # P alone on the GPU: [15, 45]; D's prompt step [50, 60], its decode [60, 70]
    assert d2.run.first_token_s[1] * 1e3 == pytest.approx(60)
    assert d2.run.done_s[1] * 1e3 == pytest.approx(70)
