"""``bench/e2e.py --tiny``: real P, D, colocated and router processes driven by ``asympd bench serve``;
the JSON carries every field a study reads, the counters agree exactly with the traffic, and
``asympd plan --validate`` reads it. Also the checkpoint writer the GPU run uses."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asympd.config import tiny
from asympd.engine.modes import split_point
from asympd.plan.validate import ValidationError, format_validation, validate_e2e

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.e2e import ladder_tokens, write_on_device  # noqa: E402
from bench.p_throughput import reduced_config  # noqa: E402

MODES = ("asymmetric", "encoder-only", "colocated")
PROMPTS = 4
FILL_ROWS = 200  # the co-run's fill phase at a fraction of the tiny P budget (2048): the suite stays fast
MID_ROWS = 60  # and its mid-size burst before it
LATENCY = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p90", "p99")]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("e2e")
    cmd = [sys.executable, "bench/e2e.py", "--tiny", "--modes", ",".join(MODES), "--rates", "20"]
    cmd += ["--num-prompts", str(PROMPTS), "--calib-batch", "2", "--calib-tokens", "4"]
    cmd += ["--co-run-fill-rows", str(FILL_ROWS), "--co-run-mid-rows", str(MID_ROWS)]
    env = {**os.environ, "ASYMPD_OUT": str(out), "OMP_NUM_THREADS": "1", "ASYMPD_COMMIT": "test-commit"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "e2e_tiny.json").read_text())


def test_result_fields_and_counts(result):
    assert result["benchmark"] == "e2e_tiny" and result["commit"] == "test-commit"
    assert result["command"].split()[1:3] == ["bench/e2e.py", "--tiny"]
    assert result["source_digest"] and "torch" in result["device"]
    assert result["model"]["depth"] == 7 and result["model"]["checkpoint"] == "tiny"
    assert result["handoff_stream"] == "pack"  # P's hand-off off its compute stream (what --validate reads)
    assert set(result["modes"]) == set(MODES)
    window = tiny().window_size
    for mode, m in result["modes"].items():
        assert "error" not in m, m.get("error")
        assert m["calibration"]["lone"] and m["calibration"]["batch"]["size"] == 2
        # the decode ladder (tiny: 1 and 2 requests decoding together), from D's own step log
        ladder = m["calibration"]["ladder"]
        assert ladder["tokens"] == 4 and set(ladder["step_ms"]) == {"1", "2"}, ladder
        assert all(ms and ms > 0 for ms in ladder["step_ms"].values()), ladder
        assert all(len(ladder["steps_ms"][b]) >= 2 for b in ("1", "2")), ladder
        # two rounds (1, 2 then 2, 1): each size's median over both, each round's beside it
        assert ladder["rounds"] == 2 and all(len(ladder["step_ms_by_round"][b]) == 2 for b in ("1", "2")), ladder
        assert set(m["graphs_after"]) == set(m["workers"])  # each worker's graph counters after the rates
        lone, length = m["calibration"]["lone"], ladder["prompt_len"]
        assert ladder["tokens_by_size"] == {"1": 4, "2": ladder_tokens(4, 2, lone, length)}, ladder
        assert {w["role"] for w in m["workers"].values()} == ({"colocated"} if mode == "colocated" else
                                                               {"prefill", "decode"})  # fmt: skip
        assert all(w["memory"]["weights_bytes"] > 0 for w in m["workers"].values())
        (run,) = m["runs"]
        assert run["request_rate"] == 20 and run["completed"] == PROMPTS and run["failed"] == 0
        assert all(isinstance(run[k], float) for k in LATENCY)
        req = run["requests"]
        lens = req["input_lens"]
        assert run["total_input_tokens"] == sum(lens) and run["total_output_tokens"] == sum(req["output_lens"])
        for ttft, e2el, itls, n_out in zip(req["ttfts"], req["e2els"], req["itls"], req["output_lens"], strict=True):
            assert 0 < ttft <= e2el and len(itls) == n_out - 1  # one chunk per token (return_token_ids)
        assert run["request_goodput"] is not None and run["request_goodput"] <= run["request_throughput"]
        assert math.isclose(run["request_goodput_per_gpu"], run["request_goodput"])
        side = "colocated" if mode == "colocated" else "prefill"  # busy time from the step histogram
        assert 0 < run[f"{side}_busy_s"] and 0 < run[f"{side}_busy_fraction"] <= 1
        # P's busy time counts the GPU work its steps leave queued; a CPU leaves none, so it is the
        # step histogram's time here
        assert run["p_busy_basis"] == "host and gpu"
        assert run[f"{side}_busy_with_gpu_s"] == pytest.approx(run[f"{side}_busy_s"], rel=1e-6)
        assert run["prompt_tokens_per_p_busy_s"] == pytest.approx(sum(lens) / run[f"{side}_busy_with_gpu_s"])
        # no serving step compiled or captured anything (a CPU has neither), per role
        assert run["new_shape_steps"] == {r: 0.0 for r in {w["role"] for w in m["workers"].values()}}
        # every worker's steps during the run, on the requests' clock: they cover the run's prompts
        tl = run["timeline"]
        assert set(tl["steps"]) == {w["role"] for w in m["workers"].values()}
        p_steps = [st for worker in tl["steps"][side] for st in worker]
        assert sum(st[2] for st in p_steps) >= run["p_prompt_rows_computed"]
        assert all(-1.0 <= st[0] <= run["duration"] + 5 and st[1] > 0 for st in p_steps)
        assert len(req["asympd_timings"]) == PROMPTS
        split = [split_point(tiny(), n, "carry") for n in lens]
        if mode == "asymmetric":  # P computes [0, N - W), D the rest; one prefix moved per request
            assert run["p_prompt_rows_computed"] == sum(split)
            assert run["d_prompt_rows_computed"] == sum(n - s for n, s in zip(lens, split, strict=True))
            assert run["transfers"] == sum(n > window for n in lens) and run["transfer_bytes_per_request"] > 0
        elif mode == "encoder-only":  # P computes every row, D replays the last W; every prefix moved
            assert run["p_prompt_rows_computed"] == sum(lens)
            assert run["d_prompt_rows_computed"] == sum(min(n, window) for n in lens)
            assert run["transfers"] == PROMPTS and run["transfer_bytes_per_request"] > 0
        else:
            assert run["p_prompt_rows_computed"] == sum(lens) and run["transfers"] == 0
    assert {(r["mode"], r["rate"]) for r in result["headline"]} == {(m, 20) for m in MODES}
    assert result["asymmetric_over_strongest_symmetric"] == []  # no symmetric mode in this run
    for m in result["modes"].values():  # per-mode wall time and the prediction the budget used
        assert m["wall_s"] >= m["startup_s"] + m["calibration"]["wall_s"] and m["runs"][0]["predicted_wall_s"] > 0


def test_validate_reads_the_result(result, tmp_path):
    v = validate_e2e(result)
    assert {(r["mode"], r["rate"]) for r in v["rows"]} == {(m, 20) for m in MODES}
    for r in v["rows"]:
        assert r["requests"] == PROMPTS
        for k in ("ttft_p50_ms", "itl_p50_ms", "goodput_req_s"):
            assert r["predicted"][k] > 0 and r["measured"][k] > 0
            assert r["ratio"][k] == pytest.approx(r["predicted"][k] / r["measured"][k])
        assert r["within_target"] == all(abs(q - 1) <= 0.15 for q in r["ratio"].values())
        roles = {"colocated"} if r["mode"] == "colocated" else {"prefill", "decode"}
        assert set(r["new_shape_steps"]) == roles, r  # the run's roles, each counted
    steps = v["modes"]["asymmetric"]["steps_ms"]
    assert steps["d_step_ms"] > 0 and steps["p_step_ms"] + steps["p_row_ms"] > 0
    # a run whose steps compiled says so under the table (a CPU run has none: no line)
    assert "met a new shape" not in format_validation(v)
    stalled = copy.deepcopy(result)
    stalled["modes"]["asymmetric"]["runs"][0]["new_shape_steps"] = {"decode": 0.0, "prefill": 2.0}
    assert "asymmetric at 20 req/s: 2 prefill steps met a new shape (a compile or capture) in the run" in (
        format_validation(validate_e2e(stalled))
    )
    assert v["modes"]["colocated"]["steps_ms"]["move_ms"] == 0
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "v.json"
    cmd = [sys.executable, "-m", "asympd.cli", "plan", "--validate", str(path), "--validate-out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode in (0, 1), p.stderr
    assert "planner vs measured" in p.stdout and "asymmetric" in p.stdout
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(v["rows"]))
    assert json.loads(out.read_text())["handoff_stream"] == "pack"  # as the result records it
    p = subprocess.run([*cmd, "--validate-handoff-stream", "compute"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode in (0, 1), p.stderr
    assert json.loads(out.read_text())["handoff_stream"] == "compute"  # asked: the old hand-off (no GPU here)
    with pytest.raises(ValidationError, match="not a bench/e2e.py result"):
        validate_e2e({"modes": {}})
    broken = {**result, "modes": {"asymmetric": {**result["modes"]["asymmetric"], "workers": None}}}
    with pytest.raises(ValidationError, match="mode 'asymmetric' of the result is malformed"):
        validate_e2e(broken)


def test_write_on_device_is_the_released_layout(tmp_path):
    """The GPU run's writer, on the CPU at tiny width: the loader reads every role from it."""
    from asympd.model.checkpoint import load_config
    from asympd.model.loader import load_model

    cfg = reduced_config(tiny().replace(max_seq_len=4096))
    path = write_on_device(cfg, tmp_path / "ckpt", torch.device("cpu"))
    assert load_config(path) == cfg
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in path.glob("*.safetensors")}
    for role in ("prefill", "full"):
        model = load_model(str(path), role, "cpu", torch.float32)
        assert model.resident_bytes() > 0


def test_write_on_device_true_depth_shared_experts(tmp_path):
    """``--depth 40``'s writer on the tiny schedule (Engram layers included): layer 0's experts only,
    the marker, and a checkpoint the servers load only with --benchmark-shared-experts."""
    from asympd.model.checkpoint import CheckpointError, load_config
    from asympd.model.loader import load_model
    from asympd.model.shared_experts import MARKER
    from bench.e2e import true_depth

    cfg = true_depth(tiny(), engram_vocab=tiny().engram_vocab_size)
    assert cfg.n_mtp_layers == 0 and cfg.engram_layer_ids == tiny().engram_layer_ids
    assert cfg.engram_num_embeddings == tiny().engram_num_embeddings  # rows follow engram_vocab_size
    path = write_on_device(cfg, tmp_path / "ckpt", torch.device("cpu"), shared_experts=True)
    assert (path / MARKER).is_file() and load_config(path).n_layers == cfg.n_layers
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.0.ffn.experts.0.w1.weight" in names and "layers.1.ffn.experts.0.w1.weight" not in names
    with pytest.raises(CheckpointError, match="benchmark checkpoint"):
        load_model(str(path), "full", "cpu", torch.float32)
    for role in ("prefill", "full"):
        model = load_model(str(path), role, "cpu", torch.float32, shared_experts=True)
        assert model.hasher is not None and model.blocks[1].ffn.w1 is model.blocks[0].ffn.w1


# ---- merging parts of a study split over device calls (no servers: hand-made parts) ----------------


def _run(rate: float, tput: float, itl99: float, goodput: float) -> dict:
    return {
        "request_rate": rate,
        "median_ttft_ms": 200.0,
        "p99_ttft_ms": 400.0,
        "median_itl_ms": itl99 / 2,
        "p99_itl_ms": itl99,
        "median_tpot_ms": itl99 / 2,
        "request_goodput_per_gpu": goodput,
        "p_prompt_rows_per_gpu_s": tput,
        "prompt_tokens_per_p_busy_s": tput,
        "transfer_bytes_per_request": 1000.0,
    }


def _part(modes: dict[str, list[dict]], **over) -> dict:
    return {
        "benchmark": "e2e_h200x1_part",
        "commit": "abc1234",
        "source_digest": "d1",
        "command": "python bench/e2e.py --gpus 1 --modes ...",
        "device": {"gpu": "NVIDIA H200"},
        "utc": "2026-12-01T06:00:00Z",
        "wall_s": 500.0,
        "gpus": 1,
        "placement": "P, D and colocated on GPU 0",
        "model": {"checkpoint": "v41", "depth": 3, "expert_storage": "own", "model_config": {"n_layers": 3}},
        "traffic": {"rates": [2.0, 4.0], "num_prompts_per_rate": 32},
        "slo": {"ttft_ms": 2000.0, "itl_ms": 100.0},
        "d_policy": {"name": "cap-4"},
        "p_step_tokens": 16384,
        "colocated_semantics": "split",
        "kv_cache_gb_per_worker": 8.0,
        "modes": {m: {"runs": runs} for m, runs in modes.items()},
        **over,
    }


PART1 = _part(
    {
        "asymmetric": [_run(2, 1200, 50, 1.5), _run(4, 2400, 80, 2.8)],
        "symmetric-split": [_run(2, 1000, 40, 1.4), _run(4, 2000, 90, 2.0)],
    }
)
PART2 = _part(
    {
        "symmetric-windows": [_run(2, 1100, 60, 1.2), _run(4, 1600, 70, 2.5)],
        "encoder-only": [_run(2, 900, 45, 1.3), _run(4, 1900, 85, 2.4)],
        "colocated": [_run(2, 800, 55, 1.4)],
    }
)
PART2["modes"]["asymmetric"] = {"skipped": "predicted 200 s would end past --budget-s 520"}


def test_merge_recomputes_the_ratios_over_the_strongest_symmetric(tmp_path):
    from bench.e2e import merge

    merged = merge([("part1.json", PART1), ("part2.json", PART2)])
    assert list(merged["modes"]) == ["asymmetric", "symmetric-split", "symmetric-windows", "encoder-only", "colocated"]
    assert merged["modes"]["colocated"]["part"] == "part2.json" and merged["commit"] == "abc1234"
    assert [p["file"] for p in merged["parts"]] == ["part1.json", "part2.json"]
    assert len(merged["headline"]) == 9
    r2, r4 = merged["asymmetric_over_strongest_symmetric"]
    assert r2["rate"] == 2 and r2["baselines"] == ["symmetric-split", "symmetric-windows"]
    # per metric, the better symmetric variant: higher throughput / goodput, lower latency
    assert (r2["prompt_tokens_per_p_busy_s"], r2["prompt_tokens_per_p_busy_s_over"]) == (
        1200 / 1100,
        "symmetric-windows",
    )
    assert (r2["itl_p99_ms"], r2["itl_p99_ms_over"]) == (50 / 40, "symmetric-split")
    assert (r2["goodput_req_per_s_per_gpu"], r2["goodput_req_per_s_per_gpu_over"]) == (1.5 / 1.4, "symmetric-split")
    assert (r4["prompt_tokens_per_p_busy_s"], r4["itl_p99_ms"], r4["goodput_req_per_s_per_gpu"]) == (
        2400 / 2000,
        80 / 70,
        2.8 / 2.5,
    )
    assert r4["itl_p99_ms_over"] == "symmetric-windows"
    (s2, s4) = merged["asymmetric_over_symmetric_split"]
    assert (s2["itl_p99_ms"], s4["goodput_req_per_s_per_gpu"]) == (50 / 40, 2.8 / 2.0)


def test_merge_refuses_parts_of_different_studies(tmp_path):
    from bench.e2e import MergeError, merge

    with pytest.raises(MergeError, match="part2.json differs from part1.json in 'source_digest': 'zzz' != "):
        merge([("part1.json", PART1), ("part2.json", {**PART2, "source_digest": "zzz"})])
    # the code is the source digest: a docs-only commit between the parts still merges, both commits kept
    merged = merge([("part1.json", PART1), ("part2.json", {**PART2, "commit": "def5678"})])
    assert merged["commit"] == "abc1234,def5678"
    assert [p["commit"] for p in merged["parts"]] == ["abc1234", "def5678"]
    other = {**PART2, "traffic": {"rates": [2.0, 4.0], "num_prompts_per_rate": 16}}
    with pytest.raises(MergeError, match="differs from part1.json in 'traffic'"):
        merge([("part1.json", PART1), ("part2.json", other)])
    deeper = {**PART2, "model": {**PART2["model"], "depth": 40}}
    with pytest.raises(MergeError, match="differs from part1.json in the model's 'depth'"):
        merge([("part1.json", PART1), ("part2.json", deeper)])
    with pytest.raises(MergeError, match="mode 'asymmetric' is in two parts"):
        merge([("part1.json", PART1), ("again.json", PART1)])
    with pytest.raises(MergeError, match="x.json: not a bench/e2e.py result"):
        merge([("part1.json", PART1), ("x.json", {"modes": []})])


def test_merge_compares_the_serving_digest_where_both_parts_have_it():
    """Parts that differ only in planner code (source digests apart, serving digests equal) are one
    study; a different serving digest is not; a part without the field compares source digests."""
    from bench.e2e import MergeError, merge

    a = {**PART1, "serving_digest": "s1"}
    merged = merge([("part1.json", a), ("part2.json", {**PART2, "source_digest": "zzz", "serving_digest": "s1"})])
    assert merged["serving_digest"] == "s1" and len(merged["modes"]) == 5
    with pytest.raises(MergeError, match="part2.json differs from part1.json in 'serving_digest': 's2' != 's1'"):
        merge([("part1.json", a), ("part2.json", {**PART2, "serving_digest": "s2"})])
    with pytest.raises(MergeError, match="in 'source_digest'"):
        merge([("part1.json", a), ("part2.json", {**PART2, "source_digest": "zzz"})])


def test_the_serving_digest_leaves_the_planner_out(tmp_path):
    """A change under asympd/plan moves the source digest only; one anywhere else moves both."""
    from bench.common import serving_digest, source_digest

    for rel, text in (("asympd/engine/x.py", "a = 1\n"), ("asympd/plan/y.py", "b = 1\n"), ("bench/z.py", "c = 1\n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    before = source_digest(tmp_path), serving_digest(tmp_path)
    (tmp_path / "asympd/plan/y.py").write_text("b = 2\n")
    after_plan = source_digest(tmp_path), serving_digest(tmp_path)
    assert after_plan[0] != before[0] and after_plan[1] == before[1]
    (tmp_path / "asympd/engine/x.py").write_text("a = 2\n")
    after_engine = source_digest(tmp_path), serving_digest(tmp_path)
    assert after_engine[0] != after_plan[0] and after_engine[1] != after_plan[1]


def test_merge_command(tmp_path):
    a, b, out = tmp_path / "p1.json", tmp_path / "p2.json", tmp_path / "e2e_h200x1.json"
    a.write_text(json.dumps(PART1))
    b.write_text(json.dumps(PART2))
    cmd = [sys.executable, "bench/e2e.py", "--merge", str(a), str(b), "-o", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    merged = json.loads(out.read_text())
    assert merged["benchmark"] == "e2e_h200x1" and merged["merged_by"].startswith("python bench/e2e.py --merge")
    assert "2 req/s: P tokens per busy s x1.09, ITL p99 x1.25, goodput per GPU x1.07" in p.stdout
    b.write_text(json.dumps({**PART2, "source_digest": "other"}))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cannot merge: p2.json differs from p1.json in 'source_digest'" in p.stdout


def test_co_run_stretch_pairs_steps_beside_with_steps_alone():
    """P's steps of 100 rows: alone 0.5 s (two of them), beside D's steps 1.0 s (covered whole):
    stretch 2. One half covered (f = 0.5) for 0.75 s: alone part 0.375 s, so the shared half did
    0.125 s of work in 0.375 s: stretch 3. A step of other rows has no alone pair; a step a tenth
    covered is neither."""
    from bench.e2e import co_run_stretch, d_key, p_key

    d = [[10.0, 1.0, 0, 4], [20.0, 0.375, 0, 4], [30.0, 0.1, 0, 4]]
    p = [[0.0, 0.5, 100, 0], [2.0, 0.5, 100, 0], [10.0, 1.0, 100, 0], [19.625, 0.75, 100, 0]]
    p += [[10.0, 1.0, 300, 0], [29.1, 1.0, 100, 0]]
    got = co_run_stretch(p, d, p_key)
    by_key = {"100": {"alone_s": 0.5, "beside_s": 0.875, "covered": 0.75}}
    want = {"stretch": 2.5, "steps_beside": 2, "steps_alone": 2, "keys": [100], "stretch_by_key": {"100": 2.5}}
    assert got == {**want, "by_key": by_key}
    assert d_key([0.0, 0.1, 0, 4]) == 4 and d_key([0.0, 0.1, 16, 4]) is None and p_key([0.0, 0.1, 0, 4]) is None
    empty = {"stretch": None, "steps_beside": 0, "steps_alone": 0, "keys": [], "stretch_by_key": {}, "by_key": {}}
    assert co_run_stretch([], d, p_key) == empty


def test_the_fill_phase_reads_each_step_size_between_the_alone_ones():
    """P alone: 100 rows 0.5 s, 300 rows 1.5 s, and a 500-row step of 2.0 s that D's import
    covered 5 % of (under ``ALONE_P``: alone). Beside a whole-covering D step: 200 rows in 2.0 s
    (alone read between 100 and 300 rows: 1.0 s, stretch 2) and 500 rows in 6.0 s (stretch 3).
    Without ``between``/``alone_below`` neither size has a pair."""
    from bench.e2e import ALONE_P, co_run_stretch, p_key

    p = [[0.0, 0.5, 100, 0], [2.0, 1.5, 300, 0], [5.0, 2.0, 500, 0], [10.0, 2.0, 200, 0], [20.0, 6.0, 500, 0]]
    d = [[5.0, 0.1, 0, 2], [10.0, 2.0, 0, 8], [20.0, 6.0, 0, 8]]
    got = co_run_stretch(p, d, p_key, between=True, alone_below=ALONE_P)
    assert got == {
        "stretch": 2.5,
        "steps_beside": 2,
        "steps_alone": 3,
        "keys": [200, 500],
        "stretch_by_key": {"200": 2.0, "500": 3.0},
        "by_key": {
            "200": {"alone_s": 1.0, "beside_s": 2.0, "covered": 1.0},
            "500": {"alone_s": 2.0, "beside_s": 6.0, "covered": 1.0},
        },
    }
    assert co_run_stretch(p, d, p_key)["keys"] == [] and co_run_stretch(p, d, p_key)["steps_alone"] == 2
    assert co_run_stretch(p, d, p_key, between=True)["keys"] == [200]  # 500 rows: nothing alone above it


def test_the_fill_phase_follows_the_traffic():
    """Prompts of the traffic's lengths filling the rows exactly (the last cut to fit); the decode
    batch of the highest rate (Little's law: rate x output_len x step_s), 1 to the cap."""
    import numpy as np

    from bench.e2e import fill_lengths, load_decoders

    got = fill_lengths(np.random.default_rng(7), 16384, 2048, "uniform", 0.5)
    assert sum(got) == 16384 and all(1024 <= n <= 3072 for n in got[:-1]) and 1 <= got[-1] <= 3072
    assert got == fill_lengths(np.random.default_rng(7), 16384, 2048, "uniform", 0.5)  # the seed's draw
    assert fill_lengths(np.random.default_rng(7), 100, 40, "uniform", 0.0) == [40, 40, 20]
    assert [load_decoders(1.5, 32, 0.15, 32), load_decoders(20, 6, 0.05, 32)] == [8, 6]  # depth 40 oos2; tiny
    assert [load_decoders(10, 32, 0.15, 32), load_decoders(0.01, 32, 0.15, 32)] == [32, 1]


def test_the_co_run_batch_follows_the_calibrated_decode_step():
    """Little's law at D's measured step (the lone requests' gaps, first gap of each left out; the
    batch's once all of it decodes): the oos3 calibration's 37.4 ms alone and 56.7 ms at 8 (57 here)
    give 2 decoders at 1.5 req/s x 32
    tokens (the rate runs kept 1-4), where the budget's 0.15 s gave 8; 1 at 0.75 req/s."""
    from bench.e2e import _steady_gaps, load_decoders, measured_step

    # the batch's gaps count from the moment all of it decodes: request 0's first gap (0.2 s, from
    # 0.1 to 0.3) held request 1's admission; from 0.3 on both decode
    batch = [{"ttft_s": 0.1, "gaps_s": [0.2, 0.057, 0.057]}, {"ttft_s": 0.3, "gaps_s": [0.057, 0.057]}]
    lone = [{"gaps_s": [0.9, 0.0374, 0.0374]}, {"gaps_s": [0.5, 0.0374]}]
    cal = {"lone": lone, "batch": {"size": 8, "requests": batch}}
    assert _steady_gaps(batch) == [0.057] * 4
    none_late = [{"ttft_s": 0.1, "gaps_s": [0.2, 0.05]}, {"ttft_s": 9.0, "gaps_s": []}]
    assert _steady_gaps(none_late) == [0.05]  # then every gap but each first one
    step = measured_step(cal)
    assert step(1) == pytest.approx(0.0374) and step(8) == pytest.approx(0.057)
    assert step(2) == pytest.approx(0.0374 + 0.0196 / 7)
    assert load_decoders(1.5, 32, step, 32) == 2 and load_decoders(0.75, 32, step, 32) == 1
    assert load_decoders(1.5, 32, 0.15, 32) == 8
    # the fixed point climbs with the step: at 4 req/s ceil(128 x 0.0374) = 5, ceil(128 x step(5)) = 7,
    # ceil(128 x step(7)) = 7; at 10 req/s it climbs to the cap
    assert load_decoders(4, 32, step, 32) == 7 and load_decoders(10, 32, step, 32) == 32
    assert load_decoders(10, 32, step, 12) == 12
    assert measured_step({"lone": [{"gaps_s": [0.5]}]}) is None  # no gap past the first
    flat = measured_step({"lone": [{"gaps_s": [0.5, 0.04]}], "batch": {"size": 1, "requests": []}})
    assert flat(1) == flat(16) == pytest.approx(0.04)


def test_co_run_is_recorded_per_mode(result):
    """The tiny run's co-run: both workers' step logs, the P side read against alone steps of the
    same rows; colocated says why it has none."""
    from bench.e2e import load_decoders, measured_step

    for mode in ("asymmetric", "encoder-only"):
        c = result["modes"][mode]["calibration"]["co_run"]
        assert c["prompts"] == 3 and c["decoders"] == 4 and c["decoders_failed"] == []
        assert c["steps"]["prefill"] and c["steps"]["decode"]
        # [start, seconds, prompt rows, sequences, seconds to the GPU end: on a CPU the host's]
        steps = c["steps"]["prefill"] + c["steps"]["decode"]
        assert all(len(s) == 5 and s[1] > 0 and s[4] == pytest.approx(s[1], abs=1e-9) for s in steps)
        assert c["p"]["steps_alone"] >= 3  # the three prompts sent alone
        assert set(c["p"]) == {"stretch", "steps_beside", "steps_alone", "keys", "stretch_by_key", "by_key"}
        assert set(c["p"]["stretch_by_key"]) == {str(k) for k in c["p"]["keys"]}
        f = c["fill"]  # the load's step size: prompts filling --co-run-fill-rows, beside the rate's batch
        assert f["rows"] == sum(f["prompt_lens"]) == 2 * FILL_ROWS and f["decoders_failed"] == []
        step = measured_step(result["modes"][mode]["calibration"])  # the batch at the calibrated step
        assert f["decoders"] == load_decoders(20, 6, step, 32) and f["decode_step_s"] == step(f["decoders"])
        assert any(s[2] > 40 for s in c["steps"]["prefill"] if s[0] >= f["t_alone"])  # steps of several prompts
        # the mid-size burst first, alone: P's steps between its start and the fill's
        mid = f["mid"]
        assert mid["rows"] == sum(mid["prompt_lens"]) == 2 * MID_ROWS and mid["t"] < f["t_alone"]
        assert sum(s[2] for s in c["steps"]["prefill"] if mid["t"] <= s[0] < f["t_alone"]) > 0
        # each burst request's hand-off as the servers timed it (D's fetch beside P's next prompts)
        for phase in ("alone", "beside"):
            got = f["timings"][phase]
            assert len(got) == len(f["prompt_lens"]) and all(t["transfer_unpack_s"] > 0 for t in got), phase
    assert "skipped" in result["modes"]["colocated"]["calibration"]["co_run"]


def test_the_co_runs_mid_burst_fills_twice_a_quarter_of_p_s_budget_by_default():
    import argparse

    from bench.e2e import co_run_mid

    args = argparse.Namespace(p_step_tokens=16384, co_run_fill_rows=None, co_run_mid_rows=None, seed=0)
    args.input_len, args.len_dist, args.range_ratio = 2048, "uniform", 0.5
    lengths = co_run_mid(args)
    assert sum(lengths) == 2 * 4096 and all(0 < n <= 3072 for n in lengths)
    assert co_run_mid(args) == lengths  # seeded: the same prompts in every mode
    args.co_run_mid_rows = 1000
    assert sum(co_run_mid(args)) == 2000
    args.co_run_mid_rows = 0
    assert co_run_mid(args) is None  # off
    args.co_run_mid_rows, args.co_run_fill_rows = None, 0
    assert co_run_mid(args) is None  # part of the fill phase: off with it


def test_p_takes_its_own_cuda_graph_mode_and_d_does_not():
    from bench.e2e import parse_args, worker_args

    args = parse_args(["--tiny", "--rates", "1", "--p-cuda-graph-mode", "full_and_piecewise"])
    plain = parse_args(["--tiny", "--rates", "1"])
    args.shared_experts = plain.shared_experts = False  # (set where the checkpoint is made)
    p = worker_args(args, "prefill", "asymmetric", "ckpt")
    assert p[p.index("--cuda-graph-mode") + 1] == "full_and_piecewise"
    assert "--cuda-graph-mode" not in worker_args(args, "decode", "asymmetric", "ckpt")
    assert "--cuda-graph-mode" not in worker_args(plain, "prefill", "asymmetric", "ckpt")  # the worker's default
    eager = parse_args(["--tiny", "--rates", "1", "--p-cuda-graph-mode", "full"])
    eager.shared_experts = False
    p = worker_args(eager, "prefill", "asymmetric", "ckpt")
    assert p[p.index("--cuda-graph-mode") + 1] == "full"  # asked: P's prompt steps eager
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--rates", "1", "--p-cuda-graph-mode", "piecewise"])


def test_the_time_budget_counts_the_co_run():
    """One more mode: the slowest start, calibration plus co-run, warm-up, and each rate (16 prompts
    at 2 req/s: 8 s, 1.5 x 32 x 0.1 s, 4 s)."""
    import argparse

    from bench.e2e import predict_mode_s

    args = argparse.Namespace(startup_s=150.0, num_prompts=16, output_len=32, step_s=0.1, rate_list=[2.0])
    args.warmup_prompts = 4
    seen = [
        {"startup_s": 100.0, "calibration": {"wall_s": 20.0, "co_run": {"wall_s": 9.0}}, "warmup": {"wall_s": 12.0}},
        {"startup_s": 90.0, "calibration": {"wall_s": 25.0, "co_run": {"skipped": "one process"}}},
    ]
    assert predict_mode_s(args, seen) == pytest.approx(100 + 29 + 12 + 8 + 4.8 + 4)


def test_ladder_requests_decode_past_the_last_admission():
    """Each of b requests sent at once outputs the ladder's steps plus what P takes to admit the
    other b - 1 (the lone TTFT at that length, doubled for the shared GPU) in lone decode gaps."""
    lone = [
        {"prompt_len": 1024, "ttft_s": 0.4, "gaps_s": [0.1, 0.04, 0.04]},
        {"prompt_len": 1024, "ttft_s": 0.5, "gaps_s": [0.1, 0.04]},
        {"prompt_len": 4096, "ttft_s": 2.0, "gaps_s": [0.1, 0.04]},
    ]
    assert ladder_tokens(24, 1, lone, 1024) == 24
    assert ladder_tokens(24, 2, lone, 1024) == 47  # 24 + ceil(2 x 1 x 0.45 / 0.04)
    assert ladder_tokens(24, 16, lone, 1024) == 362  # 24 + ceil(2 x 15 x 0.45 / 0.04)
    assert ladder_tokens(24, 16, [], 1024) == 24  # nothing measured: as before
    # a length not measured: the nearest measured one, scaled (2048 from 1024: 0.9 s a prompt)
    assert ladder_tokens(24, 2, lone, 2048) == 69  # 24 + ceil(2 x 1 x 0.9 / 0.04)
