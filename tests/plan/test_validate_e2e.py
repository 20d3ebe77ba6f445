"""The e2e validation's step model: fitted exactly from a calibration made by a known model, the
simulator's timeline for one lone request equal to that model's arithmetic, and ``validate_e2e``
on a small synthetic bench/e2e.py result (one GPU: P and D share it)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from asympd.config import tiny
from asympd.engine.modes import split_point
from asympd.plan.deployment import Deployment, ServingPath
from asympd.plan.serving_load import StageLoad
from asympd.plan.simulate import Arrival
from asympd.plan.validate import (
    MeasuredSteps,
    ValidationError,
    first_out_at_launch,
    fit_admission_steps,
    fit_steps,
    format_validation,
    run_validation,
    simulate_deployment,
    validate_e2e,
)
from asympd.serve.admission import POLICIES, AdmissionPolicy

CFG = tiny()  # window 16
TRUE = MeasuredSteps(p_step_ms=10.0, p_row_ms=0.25, d_step_ms=20.0, d_seq_ms=5.0, d_row_ms=0.5, move_ms=2.0,
                     move_row_ms=0.125, handoff_ms=3.0, d_pre_ms=6.0)  # fmt: skip
HTTP_MS = 7.0  # client TTFT minus the servers' parts


def dep(mode: str) -> Deployment:
    """One deployment of ``mode`` as the e2e study runs it (cap-4, a GPU each)."""
    return Deployment(mode, POLICIES["cap-4"], p_step_tokens=2048, colocated_semantics="split")


def calibration(mode: str) -> dict:
    """What bench/e2e.py would record from servers whose steps follow TRUE exactly."""
    lone = []
    for n in (40, 100, 40, 100):
        p_rows = n - CFG.window_size if mode == "asymmetric" else n
        d_rows = n if mode == "colocated" else n - split_point(CFG, n, "carry")  # symmetric-split: the replay
        steps = 2 if mode == "colocated" else 1  # colocated split semantics: [0, N - W) and [N - W, N)
        first = steps * TRUE.d_pre_ms + TRUE.d_row_ms * d_rows  # prompt-only steps: no decode path
        gaps = [0.001, 0.02, 0.02, 0.02]
        if mode == "symmetric-split":  # the replay samples nothing: P's token goes out at its launch
            gaps[0] = (first + TRUE.d_step_ms) / 1e3  # the replay's GPU time and a decode step
            first = 0.0
        timings = {"decode_first_step_s": first / 1e3}
        server = first
        if mode != "colocated":
            p_steps = 1 if mode == "asymmetric" else 2  # symmetric P: [0, N - W), then [N - W, N)
            prefill = p_steps * TRUE.p_step_ms + TRUE.p_row_ms * p_rows
            timings["prefill_s"] = prefill / 1e3
            timings["prefill_rtt_s"] = (prefill + TRUE.handoff_ms) / 1e3
            timings["transfer_s"] = TRUE.move_for(n) / 1e3
            server += prefill + TRUE.handoff_ms + TRUE.move_for(n)
        ttft = (server + HTTP_MS) / 1e3
        lone.append({"prompt_len": n, "ttft_s": ttft, "gaps_s": gaps, "timings": timings})
    batch = {"size": 3, "requests": [{"gaps_s": [0.1, 0.1, 0.03, 0.03]} for _ in range(3)]}
    return {"lone": lone, "batch": batch}


def test_fit_recovers_the_steps():
    for mode in ("asymmetric", "symmetric-split"):
        got = fit_steps(CFG, mode, calibration(mode), d_budget=512, semantics="split")
        for k in ("p_step_ms", "p_row_ms", "d_step_ms", "d_seq_ms", "move_ms", "move_row_ms", "handoff_ms"):
            assert getattr(got, k) == pytest.approx(getattr(TRUE, k)), (mode, k)
        # D's own rows are always the last W: one row count, so all of it is the step's fixed cost
        assert (got.d_pre_ms, got.d_row_ms) == pytest.approx((TRUE.d_pre_ms + TRUE.d_row_ms * CFG.window_size, 0.0))
    # colocated: the prompt runs in two phases (split semantics), each a step of its own
    got = fit_steps(CFG, "colocated", calibration("colocated"), d_budget=512, semantics="split")
    assert got.p_step_ms == got.p_row_ms == got.move_ms == got.move_row_ms == got.handoff_ms == 0.0
    assert (got.d_step_ms, got.d_seq_ms, got.d_pre_ms, got.d_row_ms) == pytest.approx(
        (TRUE.d_step_ms, TRUE.d_seq_ms, TRUE.d_pre_ms, TRUE.d_row_ms)
    )


def test_step_paths_add():
    """A D step pays the decode path only with decode rows and the prompt path only with prompt rows."""
    assert TRUE.decode_ms(0, 100, 1) == 6.0 + 50.0
    assert TRUE.decode_ms(3, 0, 1) == 20.0 + 10.0
    assert TRUE.decode_ms(3, 100, 1) == 20.0 + 10.0 + 6.0 + 50.0


def test_lone_request_timeline():
    steps = MeasuredSteps(**{**TRUE.__dict__, "ttft_offset_ms": 7.0})
    n, out = 100, 4
    sim = simulate_deployment(CFG, steps, [Arrival(0, 1.0, n, out)], dep("asymmetric"), ServingPath())
    s = split_point(CFG, n, "carry")
    p = TRUE.p_step_ms + TRUE.p_row_ms * s
    d_first = TRUE.d_pre_ms + TRUE.d_row_ms * (n - s)
    assert sim.ttft_s[0] * 1e3 == pytest.approx(p + TRUE.handoff_ms + TRUE.move_for(n) + d_first + 7.0)
    assert [g * 1e3 for g in sim.gaps_s[0]] == pytest.approx([TRUE.d_step_ms] * (out - 1))
    # symmetric-windows: P makes the first token; nothing to replay, so under cap-4 the step that admits
    # the request has nothing to run and D sends the token at once
    sim = simulate_deployment(CFG, steps, [Arrival(0, 0.0, n, out)], dep("symmetric-windows"), ServingPath())
    p = 2 * TRUE.p_step_ms + TRUE.p_row_ms * n  # P runs [0, N - W) and [N - W, N) as two steps
    assert sim.ttft_s[0] * 1e3 == pytest.approx(p + TRUE.handoff_ms + TRUE.move_for(n) + 7.0)
    assert len(sim.gaps_s[0]) == out - 1
    # ... unless the admitting step decodes it too (alone-4: with no prompt rows to run, the step
    # that admits it is a decode step with it in): both tokens go out at that step's end, ~0 apart
    alone_4 = replace(dep("symmetric-windows"), policy=POLICIES["alone-4"])
    sim = simulate_deployment(CFG, steps, [Arrival(0, 0.0, n, out)], alone_4, ServingPath())
    assert sim.ttft_s[0] * 1e3 == pytest.approx(p + TRUE.handoff_ms + TRUE.move_for(n) + TRUE.d_step_ms + 7.0)
    assert [g * 1e3 for g in sim.gaps_s[0]] == pytest.approx([0.0] + [TRUE.d_step_ms] * (out - 2))
    # symmetric-split: the replay samples nothing, so the server sends P's first token when it
    # launches the replay; the replay's time is in the first gap, with the first decode step
    sim = simulate_deployment(CFG, steps, [Arrival(0, 0.0, n, out)], dep("symmetric-split"), ServingPath())
    p = 2 * TRUE.p_step_ms + TRUE.p_row_ms * n
    replay = TRUE.d_pre_ms + TRUE.d_row_ms * (n - s)
    assert sim.ttft_s[0] * 1e3 == pytest.approx(p + TRUE.handoff_ms + TRUE.move_for(n) + 7.0)
    gaps = [replay + TRUE.d_step_ms] + [TRUE.d_step_ms] * (out - 2)
    assert [g * 1e3 for g in sim.gaps_s[0]] == pytest.approx(gaps)


def test_exports_run_beside_each_other_at_their_loaded_cost():
    """Two prompts finishing in one P step: P's answers and D's fetches run beside each other on
    P's stream, sharing it (each at half speed), each at its lone cost plus the load's cost per
    further request in the TTFT path (here 2 requests): both answers end at 2 x 7 ms, both fetches
    2 x 3.5 ms later."""
    steps = MeasuredSteps(**{**TRUE.__dict__, "move_row_ms": 0.0, "ttft_offset_ms": 7.0})  # every move 2 ms
    load = StageLoad(answer_ms=4.0, fetch_ms=1.5, hops_ms=0.5, d_step_ms=100.0)
    n = 40
    two = [Arrival(0, 0.0, n, 2), Arrival(1, 0.0, n, 2)]
    s = split_point(CFG, n, "carry")
    p_done = TRUE.p_step_ms + TRUE.p_row_ms * 2 * s  # one step for both
    at_d = p_done + 2 * (3.0 + 4.0) + 2 * (2.0 + 1.5)  # both at D together: one prompt step for both
    first = at_d + TRUE.d_pre_ms + TRUE.d_row_ms * 2 * (n - s) + 7.0 + 0.5
    sim = simulate_deployment(CFG, steps, two, dep("asymmetric"), ServingPath(), load)
    assert [sim.ttft_s[0] * 1e3, sim.ttft_s[1] * 1e3] == pytest.approx([first, first])
    # the decode step that follows has nobody in the TTFT path beside it: no extra host time
    assert [g * 1e3 for g in sim.gaps_s[0]] == pytest.approx([TRUE.d_step_ms + TRUE.d_seq_ms])
    # without a load the same two requests pay the lone costs only
    sim = simulate_deployment(CFG, steps, two, dep("asymmetric"), ServingPath())
    assert sim.ttft_s[0] * 1e3 == pytest.approx(first - 2 * 4.0 - 2 * 1.5 - 0.5)


def test_a_constant_hop_before_p_changes_no_ttft_or_gap():
    """The simulation has no clock of its own: every arrival a constant later (the client -> router
    -> P hop, 54 ms in v14's trace) moves every step with it, so adding that hop before P instead of
    to TTFT at the end (the offset) would change no TTFT or gap; only a hop that grows with load
    could, and the fitted one is 0.3-2 ms a further request (docs/planner.md "v13 and v14")."""
    steps = MeasuredSteps(**{**TRUE.__dict__, "ttft_offset_ms": 7.0})
    load = StageLoad(answer_ms=4.0, fetch_ms=1.5, hops_ms=0.5, d_step_ms=0.2)
    requests = [(0.0, 40, 5), (0.004, 100, 3), (0.011, 60, 6), (0.05, 40, 2), (0.052, 100, 4)]  # time, prompt, out
    for mode in ("asymmetric", "symmetric-split"):
        runs = [
            simulate_deployment(
                CFG, steps, [Arrival(i, t + hop, n, o) for i, (t, n, o) in enumerate(requests)],
                replace(dep(mode), shared_gpu=True), ServingPath(), load,
            )
            for hop in (0.0, 0.054)
        ]  # fmt: skip
        assert runs[0].ttft_s == pytest.approx(runs[1].ttft_s, abs=1e-9)
        for i, gaps in runs[0].gaps_s.items():
            assert gaps == pytest.approx(runs[1].gaps_s[i], abs=1e-9)
        assert len(runs[0].ttft_s) == len(requests)


def test_v14_s_predictions_do_not_move_with_every_arrival_54_ms_later():
    """docs/planner.md "The hop before P", on the record: v14's two modes validated as measured and
    with every start time 54 ms and 1 s later give the same TTFT p50 and ITL p50 on all six rows."""
    from tools.regen_validations import RESULTS

    src = json.loads((RESULTS / "e2e_h200x1_depth40_v14_two.json").read_text())

    def rows(shift: float) -> list[tuple]:
        shifted = json.loads(json.dumps(src))
        for m in shifted["modes"].values():
            for run in m.get("runs", []):
                run["requests"]["start_times"] = [t + shift for t in run["requests"]["start_times"]]
        v = validate_e2e(shifted)
        return [(r["mode"], r["rate"], r["predicted"]["ttft_p50_ms"], r["predicted"]["itl_p50_ms"]) for r in v["rows"]]

    base = rows(0.0)
    assert len(base) == 6
    for shift in (0.054, 1.0):
        assert [(m, r, pytest.approx(t, abs=1e-6), pytest.approx(i, abs=1e-6)) for m, r, t, i in base] == rows(shift)


def test_each_ladder_round_alone_says_which_rows_the_calibration_decides():
    """``ladder_rounds`` (``asympd plan --validate`` when the result has ``step_ms_by_round``): v15
    with two rounds, its own ladder and v14's (the same traffic, docs/planner.md "v15"), each
    round's validation is the one that ladder gives alone, and the rows they disagree on are named."""
    from asympd.plan.validate import format_validation, ladder_rounds
    from tools.regen_validations import RESULTS

    v15 = json.loads((RESULTS / "e2e_h200x1_depth40_v15_two.json").read_text())
    v14 = json.loads((RESULTS / "e2e_h200x1_depth40_v14_two.json").read_text())
    assert ladder_rounds(v15) is None  # one round: nothing to compare
    with_v14 = json.loads(json.dumps(v15))
    for mode, m in v15["modes"].items():
        ladder, other = m["calibration"]["ladder"], v14["modes"][mode]["calibration"]["ladder"]["step_ms"]
        ladder["step_ms_by_round"] = {b: [ms, other[b]] for b, ms in ladder["step_ms"].items()}
        with_v14["modes"][mode]["calibration"]["ladder"]["step_ms"] = other
    band = ladder_rounds(v15)
    alone = [validate_e2e(v15)["rows"], validate_e2e(with_v14)["rows"]]
    assert [r["within_target"] for r in band["rows"]] == [
        [a["within_target"], b["within_target"]] for a, b in zip(*alone, strict=True)
    ]
    assert (band["rounds"], band["within_every_round"], band["within_some_round"]) == (2, 2, 4)
    v = {**validate_e2e(v15), "ladder_rounds": band}
    assert (
        "with each of the 2 decode-ladder rounds alone: all three within in every round 2, in some round 4 rows "
        "(the ladder's spread decides asymmetric @ 0.5, symmetric-split @ 1)"
    ) in format_validation(v)


def e2e_result(gpus: int) -> dict:
    """A bench/e2e.py result of one asymmetric deployment, one rate run of two requests."""
    return {
        "benchmark": "e2e_synthetic",
        "commit": "0" * 12,
        "gpus": gpus,
        "model": {"depth": CFG.n_layers, "model_config": CFG.to_dict()},
        "slo": {"ttft_ms": 1000.0, "itl_ms": 100.0},
        "d_policy": {"max_new_admissions": 4, "admission_token_budget": 512},
        "p_step_tokens": 2048,
        "colocated_semantics": "split",
        "modes": {
            "asymmetric": {
                "workers": {"p": {"role": "prefill"}, "d": {"role": "decode"}},
                "calibration": calibration("asymmetric"),
                "runs": [
                    {
                        "request_rate": 2.0,
                        "median_ttft_ms": 100.0,
                        "median_itl_ms": 20.0,
                        "request_goodput": 2.0,
                        "requests": {
                            "start_times": [0.0, 0.01],
                            "input_lens": [40, 40],
                            "output_lens": [3, 3],
                            "errors": ["", ""],
                        },
                    }
                ],
            }
        },
    }


def test_validate_a_synthetic_result(tmp_path):
    """Two requests 10 ms apart on one GPU, every step hand-computed (ms): P steps 16, P's answer 3,
    the move 7, D's prompt step 14 (the fitted one: one row count), decode 20 + 5 per further request.
    P [0, 16] req 0; P's step for req 1 from 16; req 0 at D at 16 + 3 + 7 = 26: its prompt step and
    P's step share the GPU, P's 6 ms left end at 38, D's 8 left at 46 (req 0's first token); req 1
    at D at 38 + 3 + 7 = 48; D's next step (issued at 46) decodes req 0 alone: [46, 66]; then req 0's
    decode with req 1's prompt [66, 100]; then req 1 decodes [100, 120], [120, 140]."""
    v = validate_e2e(e2e_result(gpus=1))
    assert v["placement"] == "shared"
    steps = v["modes"]["asymmetric"]["steps_ms"]
    assert steps["ttft_offset_ms"] == pytest.approx(HTTP_MS)
    assert steps["d_pre_ms"] == pytest.approx(14.0)
    assert steps["mix_pre_ms"] is None  # the batch has no admission steps to read: a mixed step pays both paths
    row = v["rows"][0]
    ttfts = [46 + HTTP_MS, 100 - 10 + HTTP_MS]
    assert row["predicted"]["ttft_p50_ms"] == pytest.approx(sum(ttfts) / 2)
    assert row["predicted"]["itl_p50_ms"] == pytest.approx(20.0)  # gaps 20, 34 | 20, 20
    assert row["measured"] == {"ttft_p50_ms": 100.0, "itl_p50_ms": 20.0, "goodput_req_s": 2.0}
    assert row["ratio"]["itl_p50_ms"] == pytest.approx(1.0)
    assert row["engine_step_s"]["prefill"]["wall"] == pytest.approx(0.016 + 0.022)  # req 1's step stretched by 6 ms
    # two GPUs: P and D apart. Req 0's prompt step [26, 40]; D's decode [40, 60] misses req 1
    # (at D at 42); then req 0's decode with req 1's prompt [60, 94]: TTFTs 40 and 84, plus HTTP
    apart = validate_e2e(e2e_result(gpus=2))
    assert apart["placement"] == "separate"
    assert apart["rows"][0]["predicted"]["ttft_p50_ms"] == pytest.approx((40 + 84) / 2 + HTTP_MS)
    assert "e2e_synthetic" in format_validation(v)
    path, out = tmp_path / "r.json", tmp_path / "v.json"
    path.write_text(json.dumps(e2e_result(gpus=1)))
    assert run_validation(str(path), out=str(out)) == 1  # TTFT 75 ms predicted vs 100 measured: out of 15 %
    assert json.loads(out.read_text())["rows"][0]["predicted"] == row["predicted"]


def test_p_s_queue_is_reported_beside_the_rows_where_the_servers_timed_it():
    """Results since the thirtieth session carry each request's wait for P's first step
    (``prefill_queue_s``); the row reports its p50 beside the simulated P's, not validated. The
    synthetic timeline above: req 0 taken by P at once, req 1 (at 10) by P's step from 16: 0 and 6
    ms, p50 3; measured 1 and 9, p50 5."""
    res = e2e_result(gpus=1)
    assert "p_queue_p50_ms" not in validate_e2e(res)["rows"][0]  # no timings: nothing to compare
    timings = [{"prefill_queue_s": 0.001}, {"prefill_queue_s": 0.009}]
    res["modes"]["asymmetric"]["runs"][0]["requests"]["asympd_timings"] = timings
    v = validate_e2e(res)
    assert v["rows"][0]["p_queue_p50_ms"] == {"measured": pytest.approx(5.0), "predicted": pytest.approx(3.0)}
    assert "P's queue p50 ms, meas/pred (not validated): asymmetric @ 2 5/3" in format_validation(v)
    assert v["rows"][0]["predicted"] == validate_e2e(e2e_result(gpus=1))["rows"][0]["predicted"]


def test_a_traced_row_lists_p_s_steps_simulated_and_logged():
    """``trace=True``: the synthetic timeline above, P's steps [0, 16] and [16, 38] (req 1's stretched
    by D's prompt step), beside the P worker's step log read to each step's GPU end (its second step
    starts on the host at 17 and ends on the GPU at 37). Rows without ``trace`` carry none."""
    res = e2e_result(gpus=1)
    res["modes"]["asymmetric"]["runs"][0]["timeline"] = {
        "start_wall": 1e9,
        "steps": {"prefill": [[[0.001, 0.015, 24, 0, 0.016], [0.017, 0.01, 24, 0, 0.02]]]},
    }
    row = validate_e2e(res, trace=True)["rows"][0]
    approx = pytest.approx
    assert row["p_steps"]["simulated"] == [[0.0, approx(0.016), 24], [approx(0.016), approx(0.022), 24]]
    assert row["p_steps"]["measured"] == [[0.001, pytest.approx(0.016), 24], [0.017, pytest.approx(0.02), 24]]
    assert "p_steps" not in validate_e2e(res)["rows"][0]
    from tools.p_trace import format_trace, trace

    traced = trace(res, "asymmetric", 2.0)
    assert traced["p_steps"] == row["p_steps"]
    assert format_trace(traced).splitlines()[0] == (
        "asymmetric @ 2 req/s: TTFT p50 100 ms measured, 75 predicted; P steps 2 measured, 2 simulated"
    )
    with pytest.raises(ValueError, match="no P/D rate run of asymmetric at 1 req/s"):
        trace(res, "asymmetric", 1.0)
    with pytest.raises(ValueError, match="no mode 'colocated' in the result: asymmetric"):
        trace(res, "colocated", 2.0)


def test_a_fetch_while_p_computes_costs_what_the_fill_bursts_measured():
    """The synthetic result with the co-run's fill timings (D's fetches of 10, 20, 20 and 30 ms
    while P computed a burst: median 20). On one GPU, req 0's fetch starts at 19, during P's step
    for req 1 [16, 32]: 20 ms, at D at 39; req 1's starts at 35 with P idle: the lone 7 ms, at D at
    42. D's prompt step for req 0 [39, 53] (first token), then req 0's decode with req 1's prompt
    [53, 87]: TTFTs 53 and 87 - 10, plus HTTP. On two GPUs nothing changes (no P kernels beside D's)."""
    fill = {"alone": [{"transfer_s": 0.010}, {"transfer_s": 0.020}], "beside": [{"transfer_s": 0.020}, {}]}
    fill["beside"].append({"transfer_s": 0.030})
    for gpus, ttfts in ((1, [53, 77]), (2, [40, 84])):
        res = e2e_result(gpus=gpus)
        res["modes"]["asymmetric"]["calibration"]["co_run"] = {"fill": {"timings": fill}}
        v = validate_e2e(res)
        assert v["modes"]["asymmetric"]["steps_ms"]["move_beside_p_ms"] == pytest.approx(20.0)
        assert v["rows"][0]["predicted"]["ttft_p50_ms"] == pytest.approx(sum(ttfts) / 2 + HTTP_MS)
    assert validate_e2e(e2e_result(gpus=1))["modes"]["asymmetric"]["steps_ms"]["move_beside_p_ms"] is None


def test_on_a_gpu_the_hand_off_waits_for_p_steps():
    """The same two requests, the result made on a GPU: P's answer seals the prefix on P's stream,
    so it waits for P's step in progress, on a GPU of P's own too (ms). P [0, 16] req 0, then P's
    step for req 1 [16, 32] (D idle: P alone on the GPU); both answers [32, 38] and both fetches
    [38, 52], two at a time on P's stream (3 and 7 ms each alone); D's prompt step for both
    [52, 66] (first tokens); then both decode, 25 ms a step."""
    ttfts = [66 + HTTP_MS, 66 - 10 + HTTP_MS]
    for gpus in (1, 2):
        res = {**e2e_result(gpus=gpus), "device": {"gpu": "NVIDIA H200"}}
        row = validate_e2e(res)["rows"][0]
        assert row["predicted"]["ttft_p50_ms"] == pytest.approx(sum(ttfts) / 2)
        assert row["predicted"]["itl_p50_ms"] == pytest.approx(25.0)
        assert row["engine_step_s"]["prefill"]["wall"] == pytest.approx(0.032)  # D idle: nothing shared
    # since P packs its hand-off on a stream of its own (a result's handoff_stream "pack"), the answer
    # and the fetch run beside P's steps at their own cost, as on a CPU: req 0 at D at 16 + 3 + 7
    for gpus in (1, 2):
        res = {**e2e_result(gpus=gpus), "device": {"gpu": "NVIDIA H200"}, "handoff_stream": "pack"}
        v = validate_e2e(res)
        assert v["handoff_stream"] == "pack" and "handoff_stream" not in validate_e2e(e2e_result(gpus=gpus))
        assert v["rows"][0]["predicted"] == validate_e2e(e2e_result(gpus=gpus))["rows"][0]["predicted"]
        # the same prediction for a run measured with the old hand-off, asked what the new one would do
        old = {**e2e_result(gpus=gpus), "device": {"gpu": "NVIDIA H200"}}
        what_if = validate_e2e(old, handoff_stream="pack")
        assert what_if["handoff_stream"] == "pack" and what_if["rows"][0]["predicted"] == v["rows"][0]["predicted"]
    with pytest.raises(ValidationError, match="handoff_stream must be one of compute, pack, got 'side'"):
        validate_e2e(old, handoff_stream="side")


def test_malformed_result_is_a_typed_error():
    bad = e2e_result(gpus=1)
    del bad["slo"]
    with pytest.raises(ValidationError, match="missing 'slo'"):
        validate_e2e(bad)
    bad = e2e_result(gpus=1)
    del bad["modes"]["asymmetric"]["calibration"]["lone"][0]["prompt_len"]
    with pytest.raises(ValidationError, match="mode 'asymmetric' of the result is malformed"):
        validate_e2e(bad)


# ---- a result at true depth (bench/e2e.py --depth 40), every mode ------------------------------------


def depth40_result() -> dict:
    """bench/e2e.py --depth 40's shape: V4.1's 40-layer schedule with Engram (``true_depth``), one
    GPU, all five modes, lone calibration requests of one length (so every fit is exact) and one
    rate run of one such request."""
    from bench.e2e import true_depth

    cfg = true_depth()

    def request(mode: str) -> dict:
        t = {"decode_first_step_s": 0.6, "ttft_s": 0.6}
        if mode != "colocated":
            t.update(prefill_s=2.0, prefill_rtt_s=2.03, transfer_s=0.06, ttft_s=2.69)
        server = t.get("prefill_rtt_s", 0.0) + t.get("transfer_s", 0.0) + t["decode_first_step_s"]
        return {"prompt_len": 1024, "ttft_s": server + 0.01, "gaps_s": [0.2, 0.15, 0.15], "timings": t}

    def run() -> dict:
        one = {"start_times": [0.0], "input_lens": [1024], "output_lens": [5], "errors": [""]}
        return {"request_rate": 0.5, "median_ttft_ms": 2700.0, "median_itl_ms": 150.0, "request_goodput": 0.2,
                "requests": one}  # fmt: skip

    pd = {"p": {"role": "prefill"}, "d": {"role": "decode"}}
    modes = {}
    for mode in ("asymmetric", "symmetric-split", "symmetric-windows", "encoder-only", "colocated"):
        cal = {"lone": [request(mode) for _ in range(3)], "batch": {"size": 4, "requests": [request(mode)] * 4}}
        workers = {"c": {"role": "colocated"}} if mode == "colocated" else pd
        modes[mode] = {"workers": workers, "calibration": cal, "runs": [run()]}
    return {
        "benchmark": "e2e_h200x1_depth40",
        "commit": "0" * 12,
        "gpus": 1,
        "model": {"depth": cfg.n_layers, "model_config": cfg.to_dict()},
        "slo": {"ttft_ms": 5000.0, "itl_ms": 600.0},
        "d_policy": {"max_new_admissions": 4, "admission_token_budget": 512},
        "p_step_tokens": 16384,
        "colocated_semantics": "split",
        "modes": modes,
    }


def test_validate_a_depth40_result_in_every_mode():
    """A lone request replays to its own calibration (ms): P 2000 (asymmetric and encoder-only: one
    step of N - W rows; the symmetric modes: two phases of 1000), P's answer 30, the move 60, D's
    first token 600 (symmetric-windows: none, P's token goes out when D admits the request), the
    hops 10; colocated: its three prompt steps (896 rows at 512 a step, then the last W) 600 + 10.
    Its decode gaps are the lone steps (150); the batch adds nothing (no load: same as lone)."""
    v = validate_e2e(depth40_result())
    assert v["model_depth"] == 40 and v["placement"] == "shared"
    want = {"asymmetric": 2700.0, "symmetric-split": 2700.0, "encoder-only": 2700.0, "symmetric-windows": 2100.0,
            "colocated": 610.0}  # fmt: skip
    assert {r["mode"]: r["predicted"]["ttft_p50_ms"] for r in v["rows"]} == pytest.approx(want)
    assert [r["predicted"]["itl_p50_ms"] for r in v["rows"]] == pytest.approx([150.0] * 5)
    for mode, m in v["modes"].items():
        load = m["serving_load_ms"]
        assert (load["answer_ms"], load["fetch_ms"]) == pytest.approx((0.0, 0.0), abs=1e-9), mode
    assert "depth 40" in format_validation(v)


def test_excluded_rows_are_reported_but_not_counted(tmp_path):
    path, out = tmp_path / "r.json", tmp_path / "v.json"
    path.write_text(json.dumps(e2e_result(gpus=1)))
    assert run_validation(str(path)) == 1  # the one row misses (TTFT)
    assert run_validation(str(path), out=str(out), exclude=["asymmetric@2=D stalled 6 s"]) == 1  # nothing counted
    v = json.loads(out.read_text())
    assert v["rows"][0]["excluded"] == "D stalled 6 s"
    assert v["summary"] == {
        "rows": 1,
        "counted": 0,
        "within": {"ttft_p50_ms": 0, "itl_p50_ms": 0, "goodput_req_s": 0},
        "all_three": 0,
    }
    assert "excluded asymmetric at 2 req/s: D stalled 6 s" in format_validation(v)
    assert validate_e2e(e2e_result(gpus=1))["summary"]["within"] == {
        "ttft_p50_ms": 0,  # 75 ms predicted vs 100 measured
        "itl_p50_ms": 1,  # 20 vs 20
        "goodput_req_s": 0,  # 2 requests done in 0.147 s: 13.6 req/s vs 2 measured
    }
    for bad, msg in (("asymmetric@2", "with a reason"), ("asymmetric@x=r", "MODE@RATE"), ("asymmetric@8=r", "no row")):
        with pytest.raises(ValidationError, match=msg):
            run_validation(str(path), exclude=[bad])


def test_the_committed_h200_validation_is_what_the_code_gives():
    """bench/results/e2e_h200x1_validation.json (tabled in docs/performance.md §10) is this code's
    output on e2e_h200x1.json. Its 16-request calibration batch's hand-offs, read as their share of
    P's stream, are their lone costs: no P answer or fetch load per further request is left (read
    as wall time they were 8.5 and 6.6 ms in the asymmetric mode); the hops' and D steps' remain.
    ``serving_load=False`` prices every stage at its lone cost."""
    from asympd.plan.steps import RESULTS_DIR

    result = json.loads((RESULTS_DIR / "e2e_h200x1.json").read_text())
    v = validate_e2e(result)
    assert json.loads(json.dumps(v)) == json.loads((RESULTS_DIR / "e2e_h200x1_validation.json").read_text())
    assert v["summary"]["within"] == {"ttft_p50_ms": 1, "itl_p50_ms": 5, "goodput_req_s": 6}
    assert all(
        (m["serving_load_ms"]["answer_ms"], m["serving_load_ms"]["fetch_ms"]) == (0, 0) for m in v["modes"].values()
    )
    assert v["modes"]["symmetric-split"]["serving_load_ms"]["hops_ms"] > 1.0
    lone = validate_e2e(result, serving_load=False)
    assert all(
        m["serving_load_ms"]["hops_ms"] == m["serving_load_ms"]["d_step_ms"] == 0.0 for m in lone["modes"].values()
    )


def admission_calibration() -> dict:
    """TRUE's lone requests, and a batch of three (asymmetric, D rows W = 16 each): request 0 decodes
    alone (20 ms gaps) until requests 1 and 2 get their first token at 132 ms, at the end of a 42 ms
    gap of request 0's; then all three decode at 30 ms (20 + 5 per further request), and the last
    two, once request 0 is done, at 25 ms."""
    cal = calibration("asymmetric")
    t = {"prefill_s": 0.01, "prefill_rtt_s": 0.013, "transfer_s": 0.003}
    r0 = {"prompt_len": 40, "ttft_s": 0.05, "gaps_s": [0.02, 0.02, 0.042, 0.03, 0.03], "timings": {**t, "ttft_s": 0.05}}
    later = [
        {"prompt_len": 40, "ttft_s": 0.132, "gaps_s": [0.03, 0.03, 0.025], "timings": {**t, "ttft_s": 0.132}}
        for _ in range(2)
    ]
    cal["batch"] = {"size": 3, "requests": [r0, *later]}
    return cal


def test_steps_with_prompt_rows_from_the_calibration_batch():
    """The batch's gap in which requests 1 and 2 got their first token held their 32 prompt rows.
    Mixed steps (cap-4): it is one mixed step, 42 = decode(1) 20 + 22. Unmixed (alone-4): a
    prompt-only step of 32 rows (22) and a decode step (20); with the lone first steps (16 rows,
    14 ms) the prompt-only line is 6 + 0.5 per row, TRUE's own."""
    cal = admission_calibration()
    steps = fit_steps(CFG, "asymmetric", cal, d_budget=512, semantics="split")
    assert (steps.d_step_ms, steps.d_seq_ms, steps.d_pre_ms) == pytest.approx((20.0, 5.0, 14.0))
    mixed = fit_admission_steps(CFG, cal, steps, StageLoad(), dep("asymmetric"), 512)
    assert (mixed.mix_pre_ms, mixed.d_pre_ms) == pytest.approx((22.0, 14.0))
    assert mixed.decode_ms(2, 32, 1) == pytest.approx(25.0 + 22.0)  # mixed: decode path + the batch's excess
    assert mixed.decode_ms(0, 32, 1) == pytest.approx(14.0)  # prompt rows alone: the lone first step
    alone_4 = replace(dep("asymmetric"), policy=POLICIES["alone-4"])
    alone = fit_admission_steps(CFG, cal, steps, StageLoad(), alone_4, 512)
    assert (alone.d_pre_ms, alone.d_row_ms, alone.mix_pre_ms) == pytest.approx((6.0, 0.5, None))
    # on a shared GPU P computed the batch until 10 ms, before any of its gaps: nothing to take off
    shared = fit_admission_steps(CFG, cal, steps, StageLoad(), replace(dep("asymmetric"), shared_gpu=True), 512)
    assert shared.mix_pre_ms == pytest.approx(22.0)  # P was done (10 ms) before that gap began


def test_the_result_policy_selects_mixed_steps():
    """A result whose d_policy says mixed_steps False (alone-4) is simulated with unmixed steps."""
    res = e2e_result(gpus=1)
    res["modes"]["asymmetric"]["calibration"] = admission_calibration()
    res["d_policy"] = {"name": "alone-4", "max_new_admissions": 4, "admission_token_budget": 512, "mixed_steps": False}
    v = validate_e2e(res)
    assert v["d_policy"] == {"max_new_admissions": 4, "admission_token_budget": 512, "mixed_steps": False}
    s = v["modes"]["asymmetric"]["steps_ms"]
    assert (s["d_pre_ms"], s["d_row_ms"], s["mix_pre_ms"]) == pytest.approx((6.0, 0.5, None))
    res["d_policy"] = {"max_new_admissions": 4, "admission_token_budget": 512}  # older results: mixed
    assert validate_e2e(res)["d_policy"] == {**AdmissionPolicy(4, 512).__dict__}


def test_colocated_decode_steps_from_gaps_past_every_prompt():
    """Colocated batch of two: request 1's prompt runs in steps taking turns with request 0's
    decode steps (gaps of 100 ms, no first token inside), its first token at 450 ms; then both
    decode at 25 ms. Only gaps that start with both past their prompt price a decode step: with
    the lone 20 ms step, 5 ms per further request (the batch's later gaps would say 42.5)."""
    cal = calibration("colocated")
    r0 = {"prompt_len": 40, "ttft_s": 0.05, "gaps_s": [0.1] * 4 + [0.025] * 2, "timings": {"ttft_s": 0.05}}
    r1 = {"prompt_len": 40, "ttft_s": 0.45, "gaps_s": [0.025] * 2, "timings": {"ttft_s": 0.45}}
    cal["batch"] = {"size": 2, "requests": [r0, r1]}
    got = fit_steps(CFG, "colocated", cal, d_budget=512, semantics="split")
    assert (got.d_step_ms, got.d_seq_ms) == pytest.approx((20.0, 5.0))


def test_symmetric_split_first_tokens_belong_to_the_gap_they_start():
    """A symmetric D's replay samples nothing: P's token goes out at its launch, at the start of
    the gap that holds the replay (here request 1's, at 100 ms, the start of request 0's 60 ms gap);
    read by the nearest start it is that gap, by the nearest end the one before."""
    from asympd.plan.serving_load import batch_gaps

    r0 = {"prompt_len": 40, "ttft_s": 0.04, "gaps_s": [0.03, 0.03, 0.06, 0.03], "timings": {}}
    r1 = {"prompt_len": 40, "ttft_s": 0.101, "gaps_s": [0.06, 0.03], "timings": {}}
    rows = [(r0, r0["timings"]), (r1, r1["timings"])]
    at_start = [g.firsts for g in batch_gaps(rows, first_at_start=True)[:4]]
    at_end = [g.firsts for g in batch_gaps(rows)[:4]]
    assert at_start == [(0,), (), (1,), ()]  # request 0's own first token starts its first gap
    assert at_end == [(), (1,), (), ()]
    assert first_out_at_launch(CFG, "symmetric-split") and not first_out_at_launch(CFG, "symmetric-split", False)
    assert not any(first_out_at_launch(CFG, m) for m in ("asymmetric", "encoder-only", "symmetric-windows"))


def test_decode_cost_per_request_read_at_the_batch_decoding_through_the_gap():
    """P/D batch of three sent at once, 6 tokens each: request 0 decodes alone (20 ms gaps, no one
    else past P yet, two in the TTFT path), then with request 1 (30 ms gaps), then all three
    (40 ms). With the lone 20 ms step the decode-only gaps with no request in the TTFT path say
    10 ms per further request (batch 2: 30, batch 3: 40); the batch's size read of its later
    gaps (the old rule: their median over the batch less one) says (40 - 20) / 2 = 10 only because
    the median gap ran at batch 3; request 0's 20 ms gaps had two requests in the TTFT path."""
    cal = calibration("asymmetric")
    t = {"prefill_s": 0.01, "prefill_rtt_s": 0.013, "transfer_s": 0.005, "decode_first_step_s": 0.01}
    r0 = {"prompt_len": 40, "ttft_s": 0.02, "gaps_s": [0.02, 0.02, 0.03, 0.03, 0.04], "timings": t}
    r1 = {"prompt_len": 40, "ttft_s": 0.061, "gaps_s": [0.03, 0.03, 0.04, 0.04, 0.04], "timings": t}
    r2 = {"prompt_len": 40, "ttft_s": 0.121, "gaps_s": [0.04] * 5, "timings": t}
    cal["batch"] = {"size": 3, "requests": [r0, r1, r2]}
    got = fit_steps(CFG, "asymmetric", cal, d_budget=512, semantics="split")
    assert (got.d_step_ms, got.d_seq_ms) == pytest.approx((20.0, 10.0))
    # through the simulator: a decode step of three requests costs the lone step plus two of them
    assert got.decode_ms(3, 0, 1) == pytest.approx(40.0)


def test_a_measured_co_run_replaces_the_equal_shares():
    """The synthetic result above with a co-run that measured P at full speed beside D (stretch 1)
    and D at half (stretch 2). Req 0 at D at 26 with P's step for req 1 6 ms from its end: P ends
    at 32, D's prompt step did 3 of its 14 by then and ends at 43 (req 0's first token). The
    hand-off of req 1 runs on P's idle stream: at D at 32 + 3 + 7 = 42, before D's next step, so
    that step (43) decodes req 0 beside req 1's prompt: 20 + 14, ending at 77 (req 1's first
    token, TTFT 67). Without a co-run nothing changes (the test above)."""
    res = e2e_result(gpus=1)
    res["modes"]["asymmetric"]["calibration"]["co_run"] = {"p": {"stretch": 1.0}, "d": {"stretch": 2.0}}
    v = validate_e2e(res, shares="co-run")
    assert v["modes"]["asymmetric"]["co_run_stretch"] == {"p": 1.0, "d": 2.0} and v["shares"] == "co-run"
    assert v["rows"][0]["predicted"]["ttft_p50_ms"] == pytest.approx((43 + 67) / 2 + HTTP_MS)
    assert v["rows"][0]["engine_step_s"]["prefill"]["wall"] == pytest.approx(0.016 + 0.016)  # not stretched
    assert "co_run_stretch" not in validate_e2e(e2e_result(gpus=1))["modes"]["asymmetric"]
    # by default the shares stay equal: the measured stretch is recorded, the prediction is the one
    # without a co-run (out of sample equal shares predicted better: docs/planner.md)
    default, without = validate_e2e(res), validate_e2e(e2e_result(gpus=1))
    assert default["shares"] == "equal" and "co_run_stretch" not in default["modes"]["asymmetric"]
    assert default["modes"]["asymmetric"].pop("co_run_measured") == {"p": 1.0, "d": 2.0}
    assert default == without
    with pytest.raises(ValidationError, match="shares must be one of equal, co-run, host-split, got 'half'"):
        validate_e2e(res, shares="half")


def test_host_split_shares_take_p_s_fixed_cost_off_a_shared_gpu():
    """``shares="host-split"``: on a shared GPU P's fitted fixed cost is simulated as host launching,
    off the GPU (``p_host_ms``; the timeline is test_simulate's); on GPUs of their own nothing changes."""
    shared = e2e_result(gpus=1)
    equal, host = validate_e2e(shared), validate_e2e(shared, shares="host-split")
    steps = host["modes"]["asymmetric"]["steps_ms"]
    assert host["shares"] == "host-split" and steps["p_host_ms"] == steps["p_step_ms"] == 10.0
    assert "p_host_ms" not in equal["modes"]["asymmetric"]["steps_ms"]  # (older validations' bytes)
    apart = validate_e2e(e2e_result(gpus=2), shares="host-split")
    assert "p_host_ms" not in apart["modes"]["asymmetric"]["steps_ms"]
    assert apart["rows"] == validate_e2e(e2e_result(gpus=2))["rows"]


def test_the_simulated_p_schedules_as_the_measured_p_reported():
    """A P worker reports whether it ran its deepest waiting phase alone (``admission``'s
    ``one_depth_per_step``: a symmetric P since its window steps replay graphs); the validation's
    simulated P does the same. Results before the field ran mixed steps and validate as committed."""
    from asympd.plan.steps import RESULTS_DIR

    result = json.loads((RESULTS_DIR / "e2e_h200x1_depth40_headline3b.json").read_text())
    committed = json.loads((RESULTS_DIR / "e2e_h200x1_depth40_headline3b_validation.json").read_text())
    assert validate_e2e(result)["rows"] == committed["rows"]
    for w in result["modes"]["symmetric-split"]["workers"].values():
        if w["role"] == "prefill":
            w["admission"] = {"one_depth_per_step": True}
    rows = validate_e2e(result)["rows"]
    split = [(g, w) for g, w in zip(rows, committed["rows"], strict=True) if g["mode"] == "symmetric-split"]
    # at 1 and 2 req/s P's queue holds windows and prefixes at once: apart, they take more steps
    assert [g["predicted"]["ttft_p50_ms"] > w["predicted"]["ttft_p50_ms"] for g, w in split[1:]] == [True, True]
    assert [g for g in rows if g["mode"] == "colocated"] == [w for w in committed["rows"] if w["mode"] == "colocated"]
