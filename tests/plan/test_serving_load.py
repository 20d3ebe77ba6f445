"""The CPU-side stages' load model: its slopes recovered exactly from a calibration batch made by a
known load, a lone request at its lone cost, and the batch's requests delayed as the batch says."""

from __future__ import annotations

import pytest

from asympd.plan.deployment import Deployment, ServingPath
from asympd.plan.serving_load import LoneCosts, StageLoad, batch_rows, fit_stage_load, in_path
from asympd.serve.admission import POLICIES

LONE_ANSWER, LONE_HOPS = 3.0, 7.0
KNOWN = StageLoad(answer_ms=2.0, fetch_ms=1.5, hops_ms=0.5)


def fetch_lone(prompt_len: int) -> float:
    return 2.0 + 0.01 * prompt_len


PD = Deployment("asymmetric", POLICIES["cap-4"], p_step_tokens=2048, colocated_semantics="split")
COLOCATED = Deployment("colocated", POLICIES["cap-4"], p_step_tokens=2048, colocated_semantics="split")


def batch_request(
    prefill_s: float, n_answer: int, n_fetch: int, first_s: float, prompt_len: int = 100, wait_s: float = 0.0
) -> dict:
    """One batch request's servers' timings, each stage at KNOWN's cost for its n (seconds); P's
    answer first waits ``wait_s`` for P's step in progress."""
    answer = wait_s + (LONE_ANSWER + KNOWN.extra_ms("answer", n_answer)) / 1e3
    fetch = (fetch_lone(prompt_len) + KNOWN.extra_ms("fetch", n_fetch)) / 1e3
    hops = (LONE_HOPS + KNOWN.extra_ms("hops", n_fetch)) / 1e3
    timings = {"prefill_s": prefill_s, "prefill_rtt_s": prefill_s + answer, "transfer_s": fetch, "ttft_s": first_s}
    return {"prompt_len": prompt_len, "ttft_s": first_s + hops, "gaps_s": [], "timings": timings}


def test_in_path_counts_arrived_requests_without_a_first_token():
    spans = [(0.0, 0.5), (0.1, None), (0.3, 0.4), (0.6, 0.9)]
    assert [in_path(t, spans) for t in (0.0, 0.2, 0.35, 0.4, 0.5, 0.7)] == [1, 2, 3, 2, 1, 2]


def test_fit_recovers_a_known_load():
    """Four requests sent at once, their stages apart (no P stream: a CPU); P is done with them at
    300/320/340/360 ms, each answer takes 9 ms with all 4 in the TTFT path; the fetches and the
    hops start when the answer is in, also with 4 in the path; first tokens from 400 ms on."""
    prefill = [0.30, 0.32, 0.34, 0.36]
    reqs = [batch_request(p, 4, 4, 0.4 + 0.05 * i) for i, p in enumerate(prefill)]
    cal = {"batch": {"size": 4, "requests": reqs}}
    apart = ServingPath(handoff_on_p_stream=False)  # stages beside each other at full speed (a CPU)
    got = fit_stage_load(cal, LoneCosts(LONE_ANSWER, fetch_lone, LONE_HOPS), PD, apart)
    assert (got.answer_ms, got.fetch_ms, got.hops_ms, got.d_step_ms) == pytest.approx((2.0, 1.5, 0.5, 0.0))
    assert got.batch_in_path == pytest.approx(4.0)
    # colocated: no P answer and no fetch; the router's hop starts at arrival, with all 4 in the path
    got = fit_stage_load(cal, LoneCosts(0.0, fetch_lone, LONE_HOPS), COLOCATED, ServingPath())
    assert (got.answer_ms, got.fetch_ms, got.hops_ms) == pytest.approx((0.0, 0.0, 0.5))


def test_p_blocked_is_the_overlap_with_p_computing_the_batch():
    from asympd.plan.serving_load import p_blocked_s

    assert [p_blocked_s(s, e, 0.5) for s, e in ((0.1, 0.3), (0.4, 0.9), (0.6, 0.7))] == pytest.approx([0.2, 0.1, 0])


def test_lone_costs_and_the_batch_as_measured():
    """n = 1 (a lone request) pays the lone cost; 16 at once pay 15 further requests' worth."""
    load = StageLoad(answer_ms=11.5, fetch_ms=6.5, hops_ms=1.5)
    assert [load.extra_ms(s, 1) for s in ("answer", "fetch", "hops")] == [0.0, 0.0, 0.0]
    assert [load.extra_ms(s, 16) for s in ("answer", "fetch", "hops")] == [172.5, 97.5, 22.5]
    assert load.extra_ms("answer", 0) == 0.0  # never below the lone cost


def test_d_step_cost_from_decode_only_gaps():
    """Request 0 decodes alone while request 1 is in the TTFT path: its steps take 4 ms over
    D's one-request step (20 ms); the step that gives request 1 its first token also runs prompt
    rows and is left out; then both decode at 25 ms with nobody in the path."""
    r0 = {"prompt_len": 100, "ttft_s": 0.05, "gaps_s": [0.024] * 6 + [0.056, 0.025, 0.025]}
    r0["timings"] = {"prefill_s": 0.01, "prefill_rtt_s": 0.013, "transfer_s": 0.003, "ttft_s": 0.05}
    r1 = {"prompt_len": 100, "ttft_s": 0.25, "gaps_s": [0.025, 0.025]}
    r1["timings"] = {"prefill_s": 0.01, "prefill_rtt_s": 0.013, "transfer_s": 0.003, "ttft_s": 0.25}
    cal = {"batch": {"size": 2, "requests": [r0, r1]}}
    got = fit_stage_load(cal, LoneCosts(3.0, fetch_lone, 0.0, lambda b: 20.0 + 5.0 * (b - 1)), PD, ServingPath())
    assert got.d_step_ms == pytest.approx(4.0)
    assert got.step_extra_ms(0) == 0.0 and got.step_extra_ms(3) == pytest.approx(12.0)
    # colocated workers: no per-step term (their prompt phases hide in gaps without a first token)
    colocated = fit_stage_load(cal, LoneCosts(0.0, fetch_lone, 0.0, lambda b: 20.0), COLOCATED, ServingPath())
    assert colocated.d_step_ms == 0.0


def test_a_batch_without_server_timings_gives_no_load():
    cal = {"batch": {"size": 3, "requests": [{"gaps_s": [0.1]} for _ in range(3)]}}
    assert fit_stage_load(cal, LoneCosts(3.0, fetch_lone, 7.0), PD, ServingPath()) == StageLoad()
    assert fit_stage_load({"lone": []}, LoneCosts(3.0, fetch_lone, 7.0), PD, ServingPath()) == StageLoad()


def test_hand_offs_sharing_p_stream_are_read_as_their_own_work():
    """Two requests whose prefixes P finished together at 100 ms; their answers ran together on P's
    stream [100, 106] (3 ms of work each, at half speed), then their fetches [106, 118] (6 ms each,
    at half speed). Read as the stream's share they are their lone costs: no load per further
    request (read as wall time, they would say 3 and 6 ms per further request)."""

    def req(first_s: float) -> dict:
        t = {"prefill_s": 0.1, "prefill_rtt_s": 0.106, "transfer_s": 0.012, "ttft_s": first_s}
        return {"prompt_len": 400, "ttft_s": first_s + LONE_HOPS / 1e3, "gaps_s": [], "timings": t}

    cal = {"batch": {"size": 2, "requests": [req(0.13), req(0.13)]}}
    lone = LoneCosts(LONE_ANSWER, fetch_lone, LONE_HOPS)
    shared = fit_stage_load(cal, lone, PD, ServingPath(handoff_on_p_stream=True))
    assert (shared.answer_ms, shared.fetch_ms) == pytest.approx((0.0, 0.0))
    apart = fit_stage_load(cal, lone, PD, ServingPath(handoff_on_p_stream=False))
    assert (apart.answer_ms, apart.fetch_ms) == pytest.approx((3.0, 6.0))


def test_a_one_off_stall_is_not_read_as_a_cost_per_request_in_the_path():
    """D's step term is what recurs: request 0 decodes alone at 20 ms a step with request 1 in the
    TTFT path, 2 ms over the lone step in two steps and 902 ms in one (a stall of D's engine
    thread, seen once); the median step's excess per request in the path is 2 ms, where a line
    through the origin gave (2 + 2 + 902) / 3 = 302 ms. A step seen in two requests' gaps counts once."""
    from asympd.plan.serving_load import _step_points, recurring_per_request

    r0 = {"prompt_len": 100, "ttft_s": 0.05, "gaps_s": [0.022, 0.922, 0.022, 0.040, 0.025, 0.025]}
    r0["timings"] = {"prefill_s": 0.01, "prefill_rtt_s": 0.013, "transfer_s": 0.003, "ttft_s": 0.05}
    r1 = {"prompt_len": 100, "ttft_s": 1.056, "gaps_s": [0.025, 0.025]}
    r1["timings"] = {"prefill_s": 0.01, "prefill_rtt_s": 0.013, "transfer_s": 0.003, "ttft_s": 1.056}
    cal = {"batch": {"size": 2, "requests": [r0, r1]}}
    rows = batch_rows(cal, True)
    points = _step_points(rows, lambda b: 20.0 + 5.0 * (b - 1), 0.0, False)
    # three steps with request 1 in the path, then two shared by both requests, each counted once
    assert [n for n, _ in points] == [1, 1, 1, 0, 0]
    assert [y for _, y in points] == pytest.approx([2.0, 902.0, 2.0, 0.0, 0.0])
    assert recurring_per_request(points) == pytest.approx(2.0)
    got = fit_stage_load(cal, LoneCosts(3.0, fetch_lone, 0.0, lambda b: 20.0 + 5.0 * (b - 1)), PD, ServingPath())
    assert got.d_step_ms == pytest.approx(2.0)
    assert recurring_per_request([(2, 6.0), (4, 4.0), (0, 50.0)]) == pytest.approx(2.0)  # per request: 3, 1
    assert recurring_per_request([(0, 5.0)]) == 0.0 and recurring_per_request([(3, -6.0)]) == 0.0
