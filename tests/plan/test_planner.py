"""`asympd plan`: step times carried from the H200 results, the simulator, memory limits, infeasible
targets with the binding constraint named, determinism, and the CLI."""

import json
import math
import re
from dataclasses import asdict

import pytest

from asympd.cli import main
from asympd.config import v41_flash
from asympd.plan.gpus import GPUS, gpu_spec, roofline_factor
from asympd.plan.planner import (
    MAX_GPUS,
    Deployment,
    PlanError,
    Planner,
    PlanRequest,
    _cheapest,
    _why,
    blocks_for,
    kv_room,
    load_traffic,
    parse_dist,
    poisson_arrivals,
    role_memory,
)
from asympd.plan.simulate import Arrival, DecodeSetup, PrefillSetup, run_decode, run_prefill
from asympd.plan.steps import RESULTS_DIR, TABLES, Comm, PlanInputError, StepModel, load_results
from asympd.plan.validate import validate_admission
from asympd.serve.admission import POLICIES, AdmissionPolicy

CFG = v41_flash()


@pytest.fixture(scope="module")
def results():
    return load_results()


def steps_on(results, gpu):
    return StepModel(results, GPUS[gpu], CFG.dim, CFG.n_activated_experts, CFG.window_size)


def request(gpu="B200", rate=2.0, n=60, ttft=8.0, itl=250.0, prompt="1024:0.5,4096:0.5", out="64", **kw):
    arr = poisson_arrivals(parse_dist(prompt, "p"), parse_dist(out, "o"), rate, n, seed=3)
    return PlanRequest(gpu, arr, rate, ttft, itl, **kw)


# ---- step times ------------------------------------------------------------------------------------


def test_roofline_factor_exact():
    h200, b200 = GPUS["H200"], GPUS["B200"]
    assert roofline_factor(2.0, 1.0, h200) == 1.0
    assert roofline_factor(2.0, 1.0, b200) == pytest.approx(4.8 / 8.0)  # bytes-bound: HBM ratio
    assert roofline_factor(1.0, 2.0, b200) == pytest.approx(989.5 / 2250.0)  # FLOP-bound: bf16 ratio
    # bound flips: 1.0 ms of bytes and 0.9 of FLOPs on the H200 -> max(0.6, 0.396) on a B200
    assert roofline_factor(1.0, 0.9, b200) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="unknown GPU 'A100'"):
        gpu_spec("A100")


def test_h200_decode_table_is_the_measured_one(results):
    steps = steps_on(results, "H200")
    for s in results["d_admission"]["steps"]:
        assert steps.decode_ms(s["B"], s["j"] * 128, 1) == pytest.approx(s["step_ms"], rel=1e-9)
    b200 = steps_on(results, "B200")
    for b, j in ((16, 0), (256, 4), (512, 8)):  # every kind moves by a factor in [0.44, 0.6]
        r = b200.decode_ms(b, j * 128, 1) / steps.decode_ms(b, j * 128, 1)
        assert 989.5 / 2250 - 1e-9 <= r <= 0.6 + 1e-9


def test_h200_prefill_cost_is_the_composed_one(results):
    steps = steps_on(results, "H200")
    for row in results["p_throughput"]["per_length"]:
        n = row["n_prompt"]
        for mode, rows in (("asymmetric", n - 128), ("symmetric", n)):
            got = steps.prefill_cost_ms_per_row(mode, n) * rows
            assert got == pytest.approx(row[mode]["ms_per_prompt"], rel=1e-9)
    # a lone 1K prompt costs the measured 896-row chunk, not 1/15 of a packed step (H200: 157 ms
    # against 81 ms a prompt in a full 16K-token step)
    lone = steps.prefill_ms("asymmetric", [(896, 1024)], 1)
    assert lone > 1.5 * results["p_throughput"]["per_length"][0]["asymmetric"]["ms_per_prompt"]
    assert steps.prefill_ms("asymmetric", [], 4) == 0.0


def test_symmetric_split_p_is_composed_from_the_measured_p_steps(results):
    """The strongest symmetric P a user deploys (symmetric-split: the asymmetric P's rows, then
    every layer on the last W) is priced from the same P steps as the other two: the asymmetric P
    per prompt plus W rows of the symmetric P's main layers and its decoder tail. It sits between
    them at every measured length, and its P moves the window rows through 20 more MoE layers."""
    steps = steps_on(results, "H200")
    main, tail = results["p_throughput"]["layer_counts"]["main"], results["p_throughput"]["layer_counts"]["tail"]
    for row in results["p_throughput"]["per_length"]:
        n = row["n_prompt"]
        sym_steps = [s for s in results["layers"]["p_steps"] if s["n_prompt"] == n and s["mode"] == "symmetric"]
        sym_main = sum(c * s["t_main"][k]["ms"] for s in sym_steps for k, c in main["symmetric"].items())
        sym_tail = sum(c * s["t_tail"][k]["ms"] for s in sym_steps if s["t_tail"] for k, c in tail["symmetric"].items())
        sym_rows = sum(ch["n"] * ch["q"] for s in sym_steps for ch in s["main"])
        prompts = sum(s["prompts"] for s in sym_steps)
        want = row["asymmetric"]["ms_per_prompt"] + 128 * sym_main / sym_rows + sym_tail / prompts
        got = steps.prefill_cost_ms_per_row("symmetric-split", n) * n
        assert got == pytest.approx(want, rel=1e-9)
        assert row["asymmetric"]["ms_per_prompt"] < got < row["symmetric"]["ms_per_prompt"]
    for gpus in (2, 4):  # the window rows' extra MoE layers cost all-to-alls under expert parallelism
        split = steps.prefill_ms("symmetric-split", [(4096, 4096)] * 4, gpus)  # a full step: above the floor
        no_window = steps.prefill_cost_ms_per_row("symmetric-split", 4096) * 16384 / gpus
        assert split - no_window == pytest.approx(steps.a2a_ms(16384, gpus, 20 * (1 + 128 / 4096)))


def test_symmetric_windows_ships_the_windows_and_replays_nothing(results):
    """symmetric-windows runs symmetric-split's P, moves every layer's window rows beside the prefix,
    and its D decodes at once: the same P time, a longer move, no replay step in the first gap."""
    planner = Planner(request("B200", modes=("symmetric-split", "symmetric-windows")), results=results)
    per_token, swa = planner.per_token, 40 * 128 * (512 * 2 + 8)  # bf16 rows and int64 positions
    study = json.loads((RESULTS_DIR / "e2e_h200x1_depth40_headline5_five.json").read_text())["modes"]
    moved = {m: study[m]["runs"][0]["transfer_bytes_per_request"] for m in ("symmetric-split", "symmetric-windows")}
    assert moved["symmetric-windows"] - moved["symmetric-split"] == swa  # what the H200 study moved, exactly
    assert planner._move_ms("symmetric-windows", 4096) == pytest.approx(
        planner.steps.transfer_ms(4096 * per_token + swa)
    )
    assert planner._move_ms("symmetric-split", 4096) == pytest.approx(planner.steps.transfer_ms(4096 * per_token))
    split = planner.evaluate("symmetric-split", 1, 2, 1, 2, "cap-4")
    windows = planner.evaluate("symmetric-windows", 1, 2, 1, 2, "cap-4")
    assert windows["p_busy"] == split["p_busy"]
    assert windows["itl_ms"]["p99"] < split["itl_ms"]["p99"]


def test_a_recommendation_names_the_modes_it_ties_with():
    def dep(mode, gpus, goodput):
        return Deployment(
            mode,
            True,
            p_replicas=1,
            p_gpus=1,
            d_replicas=1,
            d_gpus=gpus - 1,
            total_gpus=gpus,
            goodput_tokens_per_s_per_gpu=goodput,
            memory={"p": {"role": "prefill"}},
        )

    best, close, more_gpus = dep("symmetric-windows", 5, 205.0), dep("asymmetric", 5, 204.0), dep("symmetric", 7, 146.0)
    why = _why(best, [close, more_gpus, best])
    assert why["ties"] == ["asymmetric"]
    assert why["why"].startswith("symmetric-windows: 5 GPUs")
    assert "; a tie with asymmetric (the same GPUs, goodput within 2%)" in why["why"]
    assert _why(best, [dep("asymmetric", 5, 190.0), best])["ties"] == []  # 7 % apart: not a tie
    assert _why(None, [close])["ties"] == []


def test_communication_from_the_two_gpu_run(results):
    comm = Comm.from_two_gpu(results["two_gpu"])
    assert comm.link_efficiency == pytest.approx(391.5967722 / 450.0)
    for v in (v for v in results["two_gpu"]["state"].values() if isinstance(v, dict)):  # fit within 15 %
        pred = comm.transfer_latency_s + v["nbytes"] / (comm.transfer_rate_gbps * 1e9)
        assert pred == pytest.approx(v["seconds"], rel=0.15)
    steps = steps_on(results, "H200")
    assert steps.a2a_ms(1024, 1, 40) == 0.0
    per_gpu = 1024 / 4 * 6 * 3 / 4 * 5120 * 3
    want = 40 * (per_gpu / (450e9 * comm.link_efficiency) + 2 * 20e-6) * 1e3
    assert steps.a2a_ms(1024, 4, 40) == pytest.approx(want)


def test_missing_results_are_a_clear_error(tmp_path):
    with pytest.raises(PlanInputError, match=rf"{TABLES['layers']} is missing: the planner needs"):
        load_results(tmp_path)


# ---- the simulator ---------------------------------------------------------------------------------


def test_one_request_exact(results):
    steps = steps_on(results, "H200")
    p = run_prefill(CFG, steps, PrefillSetup("asymmetric", 2, 1000), [Arrival(0, 1.0, 1024, 4)])
    assert p.done_s == {0: pytest.approx(1.0 + steps.prefill_ms("asymmetric", [(896, 1024)], 2) / 1e3)}
    assert p.steps == 1
    short = run_prefill(CFG, steps, PrefillSetup("asymmetric", 2, 1000), [Arrival(0, 1.0, 100, 4)])
    assert short.done_s == {0: 1.0} and short.steps == 0  # N <= W: nothing for P
    cap4 = POLICIES["cap-4"]
    d = run_decode(CFG, steps, DecodeSetup("asymmetric", 4, 1000, 8, cap4), [Arrival(0, 2.0, 1024, 4)])
    first = steps.decode_ms(0, 128, 4) / 1e3
    assert d.first_token_s == {0: pytest.approx(2.0 + first)}  # D's bounded prefill makes the first token
    assert all(g == pytest.approx(steps.decode_ms(1, 0, 4) / 1e3) for g in d.itl_s)
    assert d.done_s[0] == pytest.approx(2.0 + first + len(d.itl_s) * steps.decode_ms(1, 0, 4) / 1e3)
    sym = run_decode(CFG, steps, DecodeSetup("symmetric", 4, 1000, 8, cap4), [Arrival(0, 2.0, 1024, 4)])
    assert sym.first_token_s == {0: 2.0}  # P made it
    assert sym.itl_s[0] == pytest.approx((steps.decode_ms(0, 128, 4) + steps.decode_ms(1, 0, 4)) / 1e3)


def test_kv_blocks_bound_the_decode_batch(results):
    steps = steps_on(results, "H200")
    arr = [Arrival(i, 0.0, 1024, 32) for i in range(12)]
    admit_all = AdmissionPolicy(None, None)
    roomy = run_decode(CFG, steps, DecodeSetup("asymmetric", 4, 10_000, 64, admit_all), arr)
    tight = run_decode(CFG, steps, DecodeSetup("asymmetric", 4, 15, 64, admit_all), arr)  # 5 blocks a request
    assert roomy.max_batch == 12
    assert tight.max_batch <= 3 and len(tight.done_s) == 12


def test_alone_4_runs_prompt_rows_in_steps_of_their_own(results):
    """The planner's D under alone-4 (serve/admission.py) runs the engine's scheduler with mixed
    steps off: no step carries both kinds of rows, and while requests wait and others decode the
    steps take turns; cap-4 mixes them."""
    steps = steps_on(results, "H200")
    arr = [Arrival(0, 0.0, 1024, 16)] + [Arrival(i, 0.02, 1024, 16) for i in range(1, 7)]  # during step 1
    alone = run_decode(CFG, steps, DecodeSetup("asymmetric", 4, 1000, 64, POLICIES["alone-4"], num_spec=0), arr)
    assert alone.step_kinds[:6] == ["prompt", "decode", "prompt", "decode", "prompt", "decode"]
    assert "mixed" not in alone.step_kinds and len(alone.done_s) == 7
    mixed = run_decode(CFG, steps, DecodeSetup("asymmetric", 4, 1000, 64, POLICIES["cap-4"], num_spec=0), arr)
    assert mixed.step_kinds[:3] == ["prompt", "mixed", "mixed"]
    # the planner tries every policy of serve/admission.py, this one included
    planner = Planner(request("H200", modes=("asymmetric",)), results=results)
    a = planner.evaluate("asymmetric", 2, 2, 1, 4, "alone-4")
    c = planner.evaluate("asymmetric", 2, 2, 1, 4, "cap-4")
    assert a["ttft_ms"] != c["ttft_ms"]


def test_simulator_reproduces_the_admission_benchmark():
    out = validate_admission(requests=600, policies=("cap-4",))
    ratio = out["policies"]["cap-4"]["ratio"]
    assert 0.9 < ratio["itl_p50"] < 1.1 and 0.9 < ratio["itl_p99"] < 1.1


# ---- memory -------------------------------------------------------------------------------------------


def test_role_memory_splits_the_released_bytes():
    mem = role_memory(CFG, 10.0)
    assert mem["prefill"].per_gpu_bytes(1) == pytest.approx(149.48e9, rel=0.005)
    assert mem["decode"].per_gpu_bytes(1) == pytest.approx(306.56e9, rel=0.005)
    assert mem["decode"].expert_bytes > 0.9 * mem["decode"].per_gpu_bytes(1)
    assert mem["decode"].per_gpu_bytes(8) == pytest.approx(
        mem["decode"].replicated_bytes + mem["decode"].expert_bytes / 8
    )


@pytest.mark.parametrize(("gpu", "asym", "sym", "decode"), [("H200", 2, 3, 3), ("B200", 1, 2, 2), ("B300", 1, 2, 2)])
def test_gpus_per_replica(results, gpu, asym, sym, decode):
    planner = Planner(request(gpu), results=results)
    assert planner.min_gpus("prefill", 64, 16384) == asym
    assert planner.min_gpus("full", 64, 16384) == sym
    assert planner.min_gpus("decode", 512, 8192) == decode


def test_chosen_deployment_respects_memory(results):
    out = Planner(request("H200", modes=("asymmetric",)), results=results).plan()
    (dep,) = out["deployments"]
    assert dep["feasible"], dep["binding"]
    for side in ("p", "d"):
        m = dep["memory"][side]
        assert m["weights_gb_per_gpu"] + m["kv_room_gb_per_gpu"] + 10.0 == pytest.approx(141.0, abs=0.02)
        assert m["kv_room_gb_per_gpu"] > 0
    mem = role_memory(CFG, 10.0)["decode"]
    room = kv_room(mem, GPUS["H200"], dep["d_gpus"], 10.0)
    assert dep["memory"]["d"]["kv_blocks"] == blocks_for(room, 512, mem, 890.0)


# ---- infeasible targets name what binds -----------------------------------------------------------------


def test_pruned_searches_give_the_plan_every_search_gives(results):
    """Searches that cannot end below the cheapest feasible deployment found are skipped or stopped
    early (``Planner._search_mode``); the plan is the one of every search run to its end."""
    for req in (request("B200"), request("H200", placement="shared")):
        planner = Planner(req, results=results)
        out = planner.plan()
        pruned = 0
        for mode, dep in zip(req.modes, out["deployments"], strict=True):
            searches = planner._searches(mode)
            assert asdict(_cheapest(mode, [planner._search(*s) for s in searches])) == dep
            pruned += len(searches) - len(planner._search_mode(searches))
        assert pruned > 0


def test_shared_placement(results):
    """P replica r on D replica r's GPUs: the pair's GPUs count once, both roles' weights fit on
    them, and D's steps wait for P's (the same 1 + 1 deployment has a longer ITL tail shared)."""
    shared = Planner(request("H200", modes=("asymmetric",), placement="shared"), results=results)
    dep = shared.plan()["deployments"][0]
    assert dep["placement"] == "shared" and dep["feasible"]
    assert (dep["p_gpus"], dep["p_replicas"]) == (dep["d_gpus"], dep["d_replicas"])
    assert dep["total_gpus"] == dep["d_replicas"] * dep["d_gpus"]
    assert dep["memory"]["d"]["shares_gpus"] and dep["memory"]["d"]["kv_blocks"] > 0
    g = dep["d_gpus"]
    apart = Planner(request("H200", modes=("asymmetric",)), results=results)
    itl_shared = shared.evaluate("asymmetric", 1, g, 1, g, "cap-4")["itl_ms"]["p99"]
    itl_apart = apart.evaluate("asymmetric", 1, g, 1, g, "cap-4")["itl_ms"]["p99"]
    assert itl_shared > itl_apart
    with pytest.raises(PlanError, match="placement must be one of separate, shared"):
        Planner(request(placement="mixed"), results=results)


def test_itl_target_below_the_fastest_step(results):
    out = Planner(request("B200", itl=5.0), results=results).plan()
    assert out["recommendation"]["mode"] is None
    for d in out["deployments"]:
        assert not d["feasible"]
        assert d["binding"].startswith("ITL: the fastest decode step")
        assert "exceeds the ITL p99 target 5 ms" in d["binding"]


def test_ttft_target_below_a_lone_long_prompt(results):
    out = Planner(request("H200", prompt="65536", ttft=0.3), results=results).plan()
    for d in out["deployments"]:
        assert d["binding"].startswith("TTFT: a 65536-token prompt alone takes")


def test_a_rate_past_the_largest_deployment_searched_is_infeasible_at_once(results):
    """At 1e9 req/s the capacity starts alone pass MAX_GPUS: each mode is infeasible by scale, named,
    at once (the searches had simulated hundreds of millions of replicas for minutes)."""
    out = Planner(request("H200", rate=1e9), results=results).plan()
    assert out["recommendation"]["mode"] is None
    for d in out["deployments"]:
        assert re.fullmatch(
            r"scale: keeping up with 1e\+09 req/s takes at least \d+ H200 \(P's prompts alone \d+ GPU-seconds a "
            rf"second\), more than the {MAX_GPUS} the planner searches",
            d["binding"],
        ), d["binding"]


def test_memory_binds_when_nothing_fits(results):
    out = Planner(request("H200", reserve_gb=139.0), results=results).plan()
    for d in out["deployments"]:
        assert d["binding"].startswith("memory:")


def test_unplannable_mode_and_bad_input(results):
    with pytest.raises(PlanError, match="mode 'colocated' has no measured prefill-worker step times"):
        Planner(request(modes=("colocated",)), results=results)
    with pytest.raises(PlanError, match="jobs must be >= 0, got -1"):
        Planner(request(), results=results, jobs=-1)
    with pytest.raises(PlanError, match="--prompt-len: expected N or N:weight"):
        parse_dist("1k", "--prompt-len")
    with pytest.raises(PlanError, match="must be positive"):
        parse_dist("1024:0", "--prompt-len")
    with pytest.raises(
        PlanError, match="a request of 1048576 prompt \\+ 64 output tokens exceeds the model's context of 1048576"
    ):
        Planner(request(prompt="1024:0.5,1048576:0.5"), results=results)


def test_traffic_file(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt_len": 1000, "output_len": 10, "t": 0.5}\n{"prompt_len": 300, "output_len": 5, "t": 0.1}\n')
    arr = load_traffic(f, None, 100, 0)
    assert [(a.time_s, a.prompt_len, a.output_len) for a in arr] == [(0.1, 300, 5), (0.5, 1000, 10)]
    f.write_text('{"prompt_len": 1000}\n')
    with pytest.raises(PlanError, match=r"t.jsonl:1: expected"):
        load_traffic(f, 1.0, 100, 0)
    f.write_text('{"prompt_len": 1000, "output_len": 3}\n')
    with pytest.raises(PlanError, match="need --rate"):
        load_traffic(f, None, 100, 0)


# ---- determinism and the CLI ------------------------------------------------------------------------------


ARGS = ["plan", "--gpu", "b200", "--rate", "2", "--prompt-len", "1024:0.5,4096:0.5", "--output-len", "64",
        "--slo-ttft-p99", "8", "--slo-itl-p99", "250", "--requests", "60"]  # fmt: skip


def test_cli_plan_is_deterministic(capsys, tmp_path):
    """The same plan from candidate deployments simulated in two forked processes and in one."""
    assert main([*ARGS, "--json", "--jobs", "2"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*ARGS, "--json", "--jobs", "1", "--plot", str(tmp_path / "p.png")]) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert (tmp_path / "p.png").stat().st_size > 0
    best = first["recommendation"]["mode"]
    assert [d["mode"] for d in first["deployments"]] == [
        "asymmetric",
        "symmetric",
        "symmetric-split",
        "symmetric-windows",
    ]
    assert best in ("asymmetric", "symmetric", "symmetric-split", "symmetric-windows")
    # the measurements the step times rest on: each table of steps.TABLES, its benchmark and commit
    from asympd.plan.steps import RESULTS_DIR, TABLES

    for key, name in TABLES.items():
        table = json.loads((RESULTS_DIR / name).read_text())
        assert first["step_tables"][key] == {"benchmark": table.get("benchmark"), "commit": table["commit"][:12]}
    assert first["step_tables"]["layers"]["benchmark"] == TABLES["layers"].removesuffix(".json")
    dep = next(d for d in first["deployments"] if d["mode"] == best)
    assert dep["ttft_ms"]["p99"] <= 8000 and dep["itl_ms"]["p99"] <= 250
    assert dep["total_gpus"] == dep["p_replicas"] * dep["p_gpus"] + dep["d_replicas"] * dep["d_gpus"]
    assert main(ARGS) == 0
    table = capsys.readouterr().out
    assert table.startswith("B200: 2 req/s, TTFT p99 <= 8 s, ITL p99 <= 250 ms (60 requests simulated)")
    assert f"recommendation: {best}:" in table
    assert not math.isnan(dep["goodput_tokens_per_s_per_gpu"])


def test_cli_builds_the_named_subcommand_alone():
    """`asympd plan` adds only plan's arguments (serve's and bench's imports take seconds): the same
    parse as the whole command line's; the others keep their name."""
    from asympd.cli import COMMANDS, build_parser

    only = build_parser("plan")
    assert vars(only.parse_args([*ARGS, "--json"])) == vars(build_parser().parse_args([*ARGS, "--json"]))
    assert all(name in only.format_help() for name in COMMANDS)


def test_cli_plan_errors(capsys):
    assert main([*ARGS[:-2], "--requests", "60", "--slo-itl-p99", "1"]) == 1  # infeasible: exit 1, table says why
    assert "infeasible: ITL: the fastest decode step" in capsys.readouterr().out
    assert main(["plan", "--gpu", "b200", "--rate", "2", "--prompt-len", "x", "--slo-ttft-p99", "1",
                 "--slo-itl-p99", "1"]) == 2  # fmt: skip
    assert "--prompt-len: expected N or N:weight" in capsys.readouterr().err
    assert main(["plan", "--gpu", "b200", "--slo-ttft-p99", "1", "--slo-itl-p99", "1"]) == 2
    assert "--rate is required" in capsys.readouterr().err
    assert main([*ARGS, "--requests", "100000000000"]) == 2  # it had simply run for days
    assert "--requests must be in [10, 100000]" in capsys.readouterr().err
    assert main([*ARGS, "--placement", "mixed"]) == 2
    assert main([*ARGS, "--reserve-gb", "-3"]) == 2
    assert "invalid choice: 'mixed'" in capsys.readouterr().err


def test_cli_plan_shared_placement(capsys):
    assert main([*ARGS, "--mode", "asymmetric", "--placement", "shared", "--json"]) == 0
    dep = json.loads(capsys.readouterr().out)["deployments"][0]
    assert dep["placement"] == "shared" and dep["p_gpus"] == dep["d_gpus"]
    assert dep["total_gpus"] == dep["d_replicas"] * dep["d_gpus"]


def test_cli_plan_from_a_traffic_file(capsys, tmp_path):
    f = tmp_path / "traffic.jsonl"
    f.write_text("".join(f'{{"prompt_len": {1024 * (1 + i % 4)}, "output_len": 32}}\n' for i in range(40)))
    args = ["plan", "--gpu", "gb300", "--traffic", str(f), "--rate", "1", "--mode", "asymmetric",
            "--slo-ttft-p99", "8", "--slo-itl-p99", "250", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests_simulated"] == 40 and out["gpu"]["name"] == "GB300"
    assert [d["mode"] for d in out["deployments"]] == ["asymmetric"]
    assert out["deployments"][0]["memory"]["p"]["role"] == "prefill"


def test_three_p_replica_sizes_are_tried(results):
    # H200: the prefill role needs 2 GPUs; 2, 3 and 4 are tried. With two sizes the 4-GPU
    # asymmetric P, which the default mix at 4 req/s needs (7 GPUs against 9), was never tried.
    planner = Planner(request("H200", modes=("asymmetric",)), results=results)
    assert sorted({s[1] for s in planner._searches("asymmetric")}) == [2, 3, 4]


def _traffic(tmp_path, name, content: bytes):
    f = tmp_path / name
    f.write_bytes(content)
    return str(f)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rate", "nan"], "--rate must be positive and finite, got nan"),  # was a traceback
        (["--rate", "inf"], "--rate must be positive and finite, got inf"),  # was planned: goodput inf
        (["--slo-ttft-p99", "nan"], "SLOs must be positive"),  # was planned against a NaN target
        (
            ["--prompt-len", "1024:nan"],
            "--prompt-len: lengths and weights must be positive (and finite), got '1024:nan'",
        ),
        (["--output-len", "64:inf"], "--output-len: lengths and weights must be positive (and finite), got '64:inf'"),
        (["--reserve-gb", "inf"], "--reserve-gb must be >= 0 and finite, got inf"),  # was an OverflowError
    ],
)
def test_cli_plan_non_finite_numbers_are_refused(capsys, extra, message):
    assert main([*ARGS, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and captured.out == ""


@pytest.mark.parametrize(
    "content, extra, message",
    [
        (b'{"prompt_len": 9, "output_len": 9}\n', ["--rate", "-3"], "--rate must be positive and finite, got -3.0"),
        (b'{"prompt_len": 9, "output_len": 9, "t": "x"}\n{"prompt_len": 9, "output_len": 9, "t": 1}\n', [],
         '{f}:1: expected {{"prompt_len": N, "output_len": M[, "t": s]}}'),
        (b'{"prompt_len": 9, "output_len": 9, "t": NaN}\n', [],
         '{f}:1: expected {{"prompt_len": N, "output_len": M[, "t": s]}}'),
        (b"\xff\xfe", ["--rate", "1"], "cannot read the traffic file '{f}': 'utf-8' codec can't decode byte 0xff in "
         "position 0: invalid start byte"),
        (None, ["--rate", "1"], "cannot read the traffic file '{f}': [Errno 21] Is a directory: '{f}'"),
    ],
)  # fmt: skip
def test_cli_plan_bad_traffic_files_are_one_line(capsys, tmp_path, content, extra, message):
    """A negative --rate with untimed traffic was planned (goodput -6); a "t" that is not a finite number,
    a directory or a file not UTF-8 were tracebacks."""
    f = str(tmp_path) if content is None else _traffic(tmp_path, "t.jsonl", content)
    args = ["plan", "--gpu", "b200", "--traffic", f, "--slo-ttft-p99", "8", "--slo-itl-p99", "250", *extra]
    assert main(args) == 2
    assert capsys.readouterr().err == f"error: {message.format(f=f)}\n"
