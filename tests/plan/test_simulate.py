"""The simulator's GPU model: steps in progress on one GPU share it equally (processor sharing);
engines on GPUs of their own never slow each other. Hand-computed timelines."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from asympd.config import tiny, v41_flash
from asympd.plan.gpus import GPUS
from asympd.plan.simulate import (
    ACCEPT_CUM,
    ACCEPT_TOKENS,
    Arrival,
    DecodeEngine,
    DecodeSetup,
    PrefillEngine,
    PrefillSetup,
    accepted_tokens,
    run_alone,
    run_engines,
)
from asympd.plan.steps import StepModel, load_results
from asympd.plan.validate import MeasuredSteps, window_step_ms
from asympd.serve.admission import POLICIES

CFG = tiny()  # window 16: a 40-token prompt is 24 rows for P, 16 for D
D_SETUP = DecodeSetup("asymmetric", 1, 1000, 8, num_spec=0)


class FlatSteps:
    """Every P step 30 ms, every D step 10 ms (decode rows, prompt rows or both)."""

    def prefill_ms(self, mode: str, chunks: list[tuple[int, int]], gpus: int, windows: int = 0) -> float:
        return 30.0

    def decode_ms(self, batch: int, prefill_rows: int, gpus: int) -> float:
        return 10.0


def engines() -> tuple[PrefillEngine, DecodeEngine]:
    steps = FlatSteps()
    p = PrefillEngine(CFG, steps, PrefillSetup("asymmetric", 1, 1000), [Arrival(1, 0.015, 40, 5)])
    d = DecodeEngine(CFG, steps, D_SETUP, [Arrival(0, 0.0, 40, 5)])
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


def test_shared_gpu_is_shared_by_the_steps_in_progress():
    """D [0, 10] (prompt), then a decode step issued at 10; P's 30 ms step issued at 15 shares the
    GPU with it: D's 5 ms left take 10 (ends 25). D's next steps each run beside P at half speed:
    [25, 45], [45, 65]; P, with 5 ms left at 65, ends at 75; D's last step ran 5 ms of its 10 by
    then and ends at 80. Gaps 15, 20, 20, 15; the GPU did 80 ms of work in 80 ms."""
    p, d = engines()
    exported: list[tuple[int, int, float]] = []
    run_engines([p, d], [0, 0], lambda k, i, t: exported.append((k, i, round(t * 1e3, 6))))
    assert exported == [(0, 1, 75.0)]
    assert d.run.first_token_s[0] * 1e3 == pytest.approx(10)
    assert ms(d.run.itl_s) == pytest.approx([15, 20, 20, 15])
    assert d.run.done_s[0] * 1e3 == pytest.approx(80)
    assert (p.run.busy_s, d.run.busy_s) == pytest.approx((0.030, 0.050))  # compute alone, not stretched
    assert (p.run.wall_s, d.run.wall_s) == pytest.approx((0.060, 0.080))  # issue to end


def test_a_steps_host_part_neither_takes_nor_slows_the_gpu():
    """As above, but 20 ms of P's 30 are host launching (``p_host_ms``): P issued at 15 launches
    until 35 off the GPU, so D's steps [10, 20] and [20, 30] run alone; at 35 P's 10 ms of GPU work
    join D's step issued at 30 (5 ms left): both at half speed, D's ends at 45, P has 5 ms left,
    which beside D's next step end at 55; that step, 5 ms done by then, ends at 60. Gaps 10, 10,
    15, 15: P's fixed cost as host time delays D less than as GPU work (15, 20, 20, 15)."""

    class HostSteps(FlatSteps):
        p_host_ms = 20.0

    steps = HostSteps()
    p = PrefillEngine(CFG, steps, PrefillSetup("asymmetric", 1, 1000), [Arrival(1, 0.015, 40, 5)])
    d = DecodeEngine(CFG, steps, D_SETUP, [Arrival(0, 0.0, 40, 5)])
    exported: list[tuple[int, int, float]] = []
    run_engines([p, d], [0, 0], lambda k, i, t: exported.append((k, i, round(t * 1e3, 6))))
    assert exported == [(0, 1, 55.0)]
    assert ms(d.run.itl_s) == pytest.approx([10, 10, 15, 15])
    assert (p.run.busy_s, p.run.wall_s) == pytest.approx((0.030, 0.040))
    run_alone(p2 := PrefillEngine(CFG, steps, PrefillSetup("asymmetric", 1, 1000), [Arrival(1, 0.015, 40, 5)]))
    assert p2.run.done_s[1] * 1e3 == pytest.approx(15 + 30)  # alone: host and GPU parts in a row, as before


def test_gpu_shares_are_equal():
    from asympd.plan.simulate import gpu_share

    assert [gpu_share(n) for n in (1, 2, 4)] == [1.0, 0.5, 0.25]


def test_exports_reach_the_decode_engine_in_time_order():
    """P's export pushed into D at export + 5 ms: D, idle, issues the request's prompt step then."""
    p, _ = engines()
    d2 = DecodeEngine(CFG, FlatSteps(), D_SETUP, [], expected=[Arrival(1, 0.0, 40, 2)])

    def hand(_: int, i: int, t: float) -> None:
        d2.push(Arrival(i, t + 0.005, 40, 2))

    run_engines([p, d2], [0, 0], hand)
    # P alone on the GPU: [15, 45]; D's prompt step [50, 60], its decode [60, 70]
    assert d2.run.first_token_s[1] * 1e3 == pytest.approx(60)
    assert d2.run.done_s[1] * 1e3 == pytest.approx(70)


def test_side_work_progresses_only_between_the_engines_steps():
    """P (GPU of its own) runs request 1's 30 ms step [15, 45]. Side work of 20 ms queued on P at
    0 runs while P is idle [0, 15], stops while the step is in progress and ends at 45 + 5 = 50;
    side work of 5 ms queued on D at 0 waits for D's steps (prompt [0, 10], decodes to 50): 55."""
    from asympd.plan.simulate import SideTask

    p, d = engines()
    done: dict[str, float] = {}
    p.hold(SideTask(0.020, lambda t: done.setdefault("p", t)))
    d.hold(SideTask(0.005, lambda t: done.setdefault("d", t)))
    run_engines([p, d], [0, 1])
    assert done["p"] * 1e3 == pytest.approx(50)
    assert done["d"] * 1e3 == pytest.approx(55)
    assert p.run.done_s[1] * 1e3 == pytest.approx(45)  # the side work never slows the steps


def test_side_tasks_of_one_engine_share_its_stream():
    """Hand-offs queued on one P share its stream. Two of 10 ms on an idle P: each at half speed,
    both end at 20 ms (not 10). With a third of 5 ms: three at 1/3 until it ends at 15, then two
    at 1/2 with 5 ms left each: 25. With P's 30 ms step for request 1 issued at 15: both at 1/2
    for [0, 15] (2.5 ms left each), stopped during the step [15, 45], then 2.5 ms each at 1/2: 50."""
    from asympd.plan.simulate import SideTask

    def run(p: PrefillEngine, lengths_ms: list[float]) -> list[float]:
        done: dict[int, float] = {}
        for k, s in enumerate(lengths_ms):
            p.hold(SideTask(s / 1e3, lambda t, k=k: done.setdefault(k, t)))
        run_engines([p], [0])
        return [done[k] * 1e3 for k in range(len(lengths_ms))]

    def idle() -> PrefillEngine:
        return PrefillEngine(CFG, FlatSteps(), PrefillSetup("asymmetric", 1, 1000), [])

    assert run(idle(), [10, 10]) == pytest.approx([20, 20])
    assert run(idle(), [10, 10, 5]) == pytest.approx([25, 25, 15])
    assert run(engines()[0], [10, 10]) == pytest.approx([50, 50])


def test_measured_shares_replace_the_equal_ones():
    """The case above with the co-run's measured rates: P keeps its whole speed beside D (stretch
    1), D runs at half (stretch 2). D's 5 ms left at 15 take 10 (ends 25) while P does 10 of its
    30; D's next step [25, 45] does its 10 ms at half speed while P does its last 20: both end at
    45. D's last two steps run alone: [45, 55], [55, 65]. Gaps 15, 20, 10, 10."""
    p, d = engines()
    run_engines([p, d], [0, 0], pair={0: 1.0, 1: 0.5})
    assert ms(d.run.itl_s) == pytest.approx([15, 20, 10, 10])
    assert d.run.done_s[0] * 1e3 == pytest.approx(65)
    assert (p.run.wall_s, d.run.wall_s) == pytest.approx((0.030, 0.065))


def test_a_measured_pair_per_step_size_is_read_at_the_step_rows():
    """P's rate beside D given per step size (``Deployment.p_share_at``): read once per P step,
    at its prompt rows (the 40-token prompt is 24 rows for P). Rate 1 at 24 rows is the case
    above, to the millisecond; the same callable at other rows would give another timeline."""
    seen: list[int] = []

    def p_rate(rows: int) -> float:
        seen.append(rows)
        return 1.0 if rows == 24 else 0.25

    p, d = engines()
    run_engines([p, d], [0, 0], pair={0: p_rate, 1: 0.5})
    assert seen == [24]
    assert ms(d.run.itl_s) == pytest.approx([15, 20, 10, 10])
    assert (p.run.wall_s, d.run.wall_s) == pytest.approx((0.030, 0.065))
    p, d = engines()
    run_engines([p, d], [0, 0], pair={0: lambda rows: 0.5, 1: 0.5})  # equal shares: the shared-GPU case
    assert ms(d.run.itl_s) == pytest.approx([15, 20, 20, 15])


def test_gpu_shares_take_a_measured_pair_only_for_two_steps():
    from asympd.plan.simulate import _Step, gpu_shares

    two = [_Step(0, 0, 0.0, 1.0), _Step(1, 0, 0.0, 1.0)]
    assert gpu_shares(two) == {0: 0.5, 1: 0.5}
    assert gpu_shares(two, {0: 0.8, 1: 0.4}) == {0: 0.8, 1: 0.4}
    apart = [_Step(0, 0, 0.0, 1.0), _Step(1, 1, 0.0, 1.0)]
    assert gpu_shares(apart, {0: 0.8, 1: 0.4}) == {0: 1.0, 1: 1.0}  # alone on its GPU: all of it
    three = [*two, _Step(2, 0, 0.0, 1.0)]
    assert gpu_shares(three, {0: 0.8, 1: 0.4}) == {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}


def test_a_symmetric_p_runs_its_windows_alone_as_the_engine_does():
    """A simulated P schedules as today's engine does (``modes.p_window_phase``): a symmetric P runs
    its deepest waiting phase alone, so a window (16 rows on tiny) and another prompt's prefix take
    two steps; an asymmetric P mixes. A validation sets it from what the measured P reported."""
    arrivals = [Arrival(0, 0.0, 40, 5), Arrival(1, 0.0, 100, 5)]

    def steps(mode: str, one_depth: bool | None = None, gpus: int = 1) -> list[int]:
        setup = PrefillSetup(mode, gpus, 1000, max_num_seqs=8, step_tokens=32, one_depth_per_step=one_depth)
        p = PrefillEngine(CFG, FlatSteps(), setup, arrivals)
        rows, t = [], 0.0
        while (dt := p.issue(t)) is not None:
            rows.append(p.step_rows)
            t += dt
            p.finish(t)
        return rows

    assert steps("symmetric-split") == [32, 16, 32, 32, 12, 16]  # as the engine's (test_admission.py)
    assert steps("symmetric-split", one_depth=False) == [32, 32, 32, 28, 16]  # a's window beside b's prefix
    assert steps("symmetric-split", gpus=2) == [32, 32, 32, 28, 16]  # an --ep P runs eagerly: mixed steps
    assert steps("asymmetric") == [32, 32, 32, 12]  # P stops at the split point: prefixes only


def test_a_symmetric_p_prices_its_window_steps_apart():
    """The simulated P tells its step model how many window chunks a step runs alone
    (``windows``), and only for a P that runs them alone: a measured model prices those from the
    window steps it logged (``MeasuredSteps.p_window_ms``), the prefix steps by its line."""
    arrivals = [Arrival(0, 0.0, 40, 5), Arrival(1, 0.0, 100, 5)]

    class Recording(FlatSteps):
        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def prefill_ms(self, mode: str, chunks: list[tuple[int, int]], gpus: int, windows: int = 0) -> float:
            self.calls.append((sum(r for r, _ in chunks), windows))
            return 30.0

    def calls(mode: str, one_depth: bool | None = None) -> list[tuple[int, int]]:
        steps = Recording()
        setup = PrefillSetup(mode, 1, 1000, max_num_seqs=8, step_tokens=32, one_depth_per_step=one_depth)
        p = PrefillEngine(CFG, steps, setup, arrivals)
        t = 0.0
        while (dt := p.issue(t)) is not None:
            t += dt
            p.finish(t)
        return steps.calls

    assert calls("symmetric-split") == [(32, 0), (16, 1), (32, 0), (32, 0), (12, 0), (16, 1)]
    assert calls("symmetric-split", one_depth=False) == [(32, 0), (32, 0), (32, 0), (28, 0), (16, 0)]
    assert calls("asymmetric") == [(32, 0), (32, 0), (32, 0), (12, 0)]

    measured = MeasuredSteps(100.0, 0.1, 10.0, 1.0, 0.5, 5.0, 0.01, p_window_ms={1: 40.0, 4: 100.0})
    assert measured.prefill_ms("symmetric-split", [(16, 40)], 1, windows=1) == 40.0
    assert measured.prefill_ms("symmetric-split", [(16, 40)] * 2, 1, windows=2) == pytest.approx(60.0)
    assert measured.prefill_ms("symmetric-split", [(16, 40)], 1) == pytest.approx(101.6)  # the line
    assert replace(measured, p_window_ms=None).prefill_ms("symmetric-split", [(16, 40)], 1, windows=1) == 101.6
    assert window_step_ms({2: 50.0}, 3) == 75.0 and window_step_ms({1: 40.0, 4: 100.0}, 6) == 140.0


# ---- one engine alone, and the accepted-token draws ----------------------------------------------


def test_accepted_tokens_are_the_draws_of_one_choices_call_a_step():
    """Drawn ``batch`` at a time, the tokens a decode step accepts are the sequence that one
    ``rng.choices`` call per step gives: the simulation's draws do not depend on the batching."""
    rng = random.Random(7)
    one_a_step = [rng.choices(ACCEPT_TOKENS, cum_weights=ACCEPT_CUM)[0] for _ in range(2500)]
    assert list(itertools.islice(accepted_tokens(random.Random(7), batch=1024), 2500)) == one_a_step


@pytest.mark.parametrize(
    ("mode", "num_blocks", "policy", "late_first", "at_launch"),
    [
        ("asymmetric", 1 << 20, "cap-4", False, False),
        ("asymmetric", 40, "cap-4", False, False),  # blocks run out: preemptions
        ("symmetric", 1 << 20, "alone-4", True, True),
        ("symmetric-windows", 60, "cap-8", True, False),
    ],
)
def test_run_alone_times_every_event_as_run_engines_does(mode, num_blocks, policy, late_first, at_launch):
    """``run_decode`` and ``run_prefill`` drive their engine with ``run_alone``: the same run, to the
    bit, as ``run_engines`` gives one engine on a GPU of its own (measured step times, not round)."""
    cfg = v41_flash()
    steps = StepModel(load_results(), GPUS["B200"], cfg.dim, cfg.n_activated_experts, cfg.window_size)
    rng = random.Random(5)
    t, arrivals = 0.0, []
    for i in range(40):
        t += rng.expovariate(20.0)
        arrivals.append(Arrival(i, t, rng.choice((200, 1000, 1500, 4000)), rng.randint(1, 300)))
    setup = DecodeSetup(
        mode,
        2,
        num_blocks,
        16,
        POLICIES[policy],
        seed=3,
        first_token_with_first_step=late_first,
        outputs_at_launch=at_launch,
    )
    alone, shared = (DecodeEngine(cfg, steps, setup, arrivals) for _ in range(2))
    run_alone(alone)
    run_engines([shared], [0])
    assert alone.run == shared.run
    if num_blocks == 40:
        assert alone.run.preemptions > 0
    p_alone, p_shared = (PrefillEngine(cfg, steps, PrefillSetup(mode, 1, 400), arrivals) for _ in range(2))
    run_alone(p_alone)
    run_engines([p_shared], [0])
    assert p_alone.run == p_shared.run
