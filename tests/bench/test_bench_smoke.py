"""bench/engine_steps.py (the engine against its own layers) runs end to end on CPU (``--smoke``, the
tiny config), so a change to the engine cannot leave it broken until the next device call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _smoke(script: str, out: Path) -> None:
    env = {**os.environ, "ASYMPD_OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, script, "--smoke"], cwd=ROOT, env=env, check=True, timeout=600)


def test_engine_steps_smoke(tmp_path):
    _smoke("bench/engine_steps.py", tmp_path)
    r = json.loads((tmp_path / "engine_steps_smoke.json").read_text())
    names = [c["case"] for c in r["cases"]]
    assert names == [
        "decode B=2 k=0", "decode B=4 k=0", "decode B=2 k=3", "decode B=4 k=3",
        "decode B=4 + 1 bounded prefills", "decode B=4 + 4 bounded prefills",
        "decode B=4 + 1 bounded prefills, unmixed", "decode B=4 + 4 bounded prefills, unmixed",
        "prefill 4 x 48", "prefill 2 x 100",
    ]  # fmt: skip
    for c in r["cases"]:
        assert len(c["layers_ms"]) == 3 and c["step_ms"] > 0 and c["sum_ms"] > 0
        assert c["engine_over_layers"] == round(c["step_ms"] / c["sum_ms"], 3)
    assert [c["draft_ms"] > 0 for c in r["cases"] if "k=3" in c["case"]] == [True, True]
    parts = ("draft_seed_ms", "draft_blocks_ms", "draft_markov_ms")
    for c in r["cases"]:  # the denominator counts the drafting a speculative step does, and only there
        assert c["engine_over_target_layers"] == round(c["step_ms"] / c["target_sum_ms"], 3)
        if "k=3" in c["case"]:
            assert all(c[p] > 0 for p in parts) and c["draft_sum_ms"] == round(sum(c[p] for p in parts), 3)
            assert c["sum_ms"] == round(c["target_sum_ms"] + c["draft_sum_ms"], 3)
        else:
            assert "draft_sum_ms" not in c and c["sum_ms"] == c["target_sum_ms"]
    unmixed = [c for c in r["cases"] if c["case"].endswith("unmixed")]  # the admission step alone, then decodes
    assert [(c["requests"], c["rows"]) for c in unmixed] == [(0, 16), (0, 64)]
    assert all(c["decode_after_step_ms"] > 0 for c in unmixed)
    assert [p["case"] for p in r["per_sequence_path"]] == ["decode B=2 k=0", "decode B=4 k=0"]


def test_engine_steps_windows_smoke(tmp_path):
    """bench/engine_steps.py --windows: a symmetric P's window step (its prefix step, then the
    window alone; a CUDA graph on a GPU, eager here) and an asymmetric D's first step of the same
    prompt, by prompt length."""
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/engine_steps.py", "--smoke", "--windows"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    r = json.loads((tmp_path / "engine_steps_windows_smoke.json").read_text())
    assert [c["prompt"] for c in r["cases"]] == [32, 96]  # tiny: W = 16
    for c in r["cases"]:
        assert c["rows"] == 16
        for key in ("symmetric_p_prefix", "symmetric_p_window", "asymmetric_d_first"):
            assert c[f"{key}_step_ms"] > c[f"{key}_forward_ms"] > 0, c
        assert c["p_over_d"] == round(c["symmetric_p_window_step_ms"] / c["asymmetric_d_first_step_ms"], 3)


def test_engine_host_graphs_smoke(tmp_path):
    """bench/engine_host.py --graphs: the engine's CUDA-graph path without capture on CPU; every
    drafting step after the first verify ones replays the drafter's static path and seeds the windows
    there (``DraftGraphs.seed_rows``), every verify step replays the decode graphs' static path."""
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/engine_host.py", "--smoke", "--graphs"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=600)
    r = json.loads((tmp_path / "engine_host_graphs_smoke.json").read_text())
    assert r["graphs"] is True and r["requests"] == 8 and r["running"] == 8 and len(r["step_ms_all"]) == 2
    draft, decode = r["draft_graph_stats"], r["decode_graph_stats"]
    # the two timed steps (after the warm-up's) are verify steps of all 8 requests, seeded in the graph
    assert draft["seeded"] >= 2 and draft["markov"] >= 2 and draft["eager"] == 0, draft
    assert decode["replayed"] >= 2, decode
    keys = ("step_ms", "forward_ms", "draft_ms", "drafter_ms", "other_ms", "draft_host_ms", "draft_body_ms")
    for key in (*keys, "forward_body_ms", "draft_outside_body_ms", "forward_outside_body_ms"):
        assert r[key] > 0, key


def test_formats_moe_variants_smoke(tmp_path):
    """bench/formats.py's MoE-variants mode (what the device runs for the FP8 expert GEMM) on CPU:
    every variant at every row count, bf16 beside them, only the default and the FP8 kernel above
    2048 rows, the tl.dot_scaled ones at every size but skipped (the interpreter has no dot_scaled),
    and the FP8 accumulation check (exact in fp32 here: the interpreter's FP8 dot)."""
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["ASYMPD_BENCH_MOE_VARIANTS"] = "1"
    subprocess.run([sys.executable, "bench/formats.py", "--smoke"], cwd=ROOT, env=env, check=True, timeout=600)
    r = json.loads((tmp_path / "formats_moe_variants_smoke.json").read_text())
    acc = r["fp8_accumulation"]
    assert acc["k"] == 128 and all(acc[v]["max_err_over_magnitude"] < 1e-6 for v in ("current", "fp8"))
    rows = r["moe_variants"]
    # 64 rows: 16 an expert on average, 32-row blocks (packed.MOE_BLOCK_M_FILL)
    assert [x["rows"] for x in rows] == [1, 64, 2500] and [x["block_m"] for x in rows] == [16, 32, 128]
    small_set = {"current", "swap_ab_tiled", "swap_ab_tiled_r72", "swap_ab_wide_tiled", "fp8", "fp8_tiled"}
    large_set = {"current", "current_tiled", "current_tiled_lut_pairs", "swap_ab_tiled_w8"}
    scaled = {"scaled", "scaled_swap", "scaled_natural", "scaled_swap_natural"}
    every = small_set | large_set | scaled
    for x in rows:
        assert x["bf16"]["moe_graph_ms"] > 0
        want = small_set if x["rows"] <= 2048 else large_set
        assert {v for v in every if v in x} == want | scaled
        for v in scaled:
            assert x[v]["skipped"] == "tl.dot_scaled runs on CUDA only" and f"{v}_speedup" not in x
        for v in want:
            assert "error" not in x[v], x[v]
            # the same function up to summation order (fp32 dots on CPU) as the current kernel
            assert x[v]["rel_err_vs_current"] < 1e-2 and x[v]["speedup_vs_bf16"] > 0


def test_formats_linears_smoke(tmp_path):
    """bench/formats.py's FP8-tile linears (what the device runs for the transposed kernel) on CPU:
    every kernel variant where it applies (the transposed ones at <= SWAP_VARIANT_ROWS rows), bf16
    beside them, the floors and the launch cost in every row, each variant the same function."""
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["ASYMPD_BENCH_ONLY"] = "linears"
    subprocess.run([sys.executable, "bench/formats.py", "--smoke"], cwd=ROOT, env=env, check=True, timeout=600)
    r = json.loads((tmp_path / "formats_linears_smoke.json").read_text())
    rows = r["linears"]
    assert [(x["name"], x["rows"]) for x in rows] == [
        (name, m) for name in ("wq_a", "wkv", "wo_a") for m in (1, 16, 40, 257)
    ]
    expect = {
        1: {"old", "swap", "swap_scale_w", "swap_k_natural", "swap_bn64"},
        16: {"old", "swap", "swap_scale_w", "swap_k_natural", "swap_bn64"},
        40: {"old", "swap", "swap_bn64"},
        257: {"old"},
    }
    every = {"old", "swap", "swap_scale_w", "swap_k_natural", "swap_bn64"}
    for x in rows:
        assert {v for v in every if v in x} == expect[x["rows"]], x
        for v in expect[x["rows"]]:
            assert "error" not in x[v], x[v]
            # bf16 outputs against cuBLAS-style bf16 (x @ W^T rounded once): rounding only
            assert x[v]["rel_err_vs_bf16"] < 1e-2 and x[v]["ms"] > 0
            assert x[v]["speedup_vs_bf16"] == x["bf16"]["ms"] / x[v]["ms"]
        assert x["bf16"]["ms"] > 0 and x["launch_ms"] > 0 and isinstance(x["launch_bound"], bool)
        wbytes = x["out"] * x["in"] // x["groups"]
        assert x["fp8_bytes"] == wbytes * (1 + 1 / 1024) + x["rows"] * (x["in"] + x["out"]) * 2
        assert x["fp8_floor_ms"] == max(x["fp8_bytes_floor_ms"], x["fp8_flops_floor_ms"])
        assert x["best_fp8"] in expect[x["rows"]]


def test_handoff_smoke(tmp_path):
    """bench/handoff.py: P's wire and D's receipt through a real TCP transport, old and new check."""
    _smoke("bench/handoff.py", tmp_path)
    r = json.loads((tmp_path / "handoff_smoke.json").read_text())
    assert r["config"] == "tiny" and [row["prompt_tokens"] for row in r["rows"]] == [200, 1000]
    for row in r["rows"]:
        assert row["split"] == row["prompt_tokens"] - 16 and row["wire_bytes"] > 0
        for k in ("p_wire_s", "p_old_pack_s", "d_recv_s", "d_verify_s", "d_verify_repack_s", "hmac_floor_s"):
            assert row[k] > 0, k
        assert row["d_total_s"] == round(row["d_recv_s"] + row["d_verify_s"], 6)
        assert row["d_total_old_s"] == round(row["d_recv_s"] + row["d_verify_repack_s"], 6)


def test_gil_contention_smoke(tmp_path):
    """bench/gil_contention.py: fetches beside a stepping engine in one process, per switch interval,
    and the interval the process had is given back."""
    _smoke("bench/gil_contention.py", tmp_path)
    r = json.loads((tmp_path / "gil_contention_smoke.json").read_text())
    assert [row["switch_interval_ms"] for row in r["rows"]] == [5.0, 0.5]
    for row in r["rows"]:
        assert row["fetch_idle_ms"] > 0 and row["fetch_busy_ms"] > 0 and row["steps_per_s_alone"] > 0
        assert row["fetch_busy_over_idle"] == round(row["fetch_busy_ms"] / row["fetch_idle_ms"], 2)


def test_layers_smoke(tmp_path):
    """bench/layers.py (the planner's layer tables) on the tiny config: every section runs (it had
    stopped running on CPU when the fused indexer became the CUDA kernels' default, unnoticed until
    the next device call) and the steps the composers read are there."""
    env = {**os.environ, "ASYMPD_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "bench.layers", "--smoke"], cwd=ROOT, env=env, check=True, timeout=600)
    r = json.loads((tmp_path / "layers_smoke.json").read_text())
    assert "errors" not in r and "skipped" not in r, (r.get("errors"), r.get("skipped"))
    assert r["build"]["block_experts"] == "bf16"  # the packed kernels are Triton's: CPU keeps bf16
    assert [(m["experts"], m["rows"]) for m in r["moe"]] == [("bf16", 1), ("bf16", 16), ("bf16", 64)]
    kinds = {"swa", "enc_src", "enc_reuse", "dec_src", "dec_reidx", "dec_reuse"}
    assert {(s["B"], s["j"]) for s in r["d_steps"]} == {(b, j) for b in (2, 4) for j in (0, 1, 2)}
    assert all(set(s["kinds"]) == kinds for s in r["d_steps"])
    assert {(s["n_prompt"], s["mode"]) for s in r["p_steps"]} == {
        (n, m) for n in (48, 100) for m in ("asymmetric", "symmetric")
    }
    # issue 15's cells, each kind under the fused kernels' earlier defaults and today's (on CPU the
    # reference path runs either way: the plumbing only)
    assert [(c["n"], c["q"], c["start"]) for c in r["kernels"]] == [(1, 16, 32), (1, 16, 64), (1, 64, 32),
                                                                     (1, 64, 64), (4, 4, 64)]  # fmt: skip
    assert all(set(c["kernel_speedup"]) == kinds == set(c["before"]) for c in r["kernels"])
    assert r["kernels_versions"]["before"] == {"indexer": 4, "attention": 2}
    # the glue kernels off and on (none is installed on CPU: the plumbing only)
    assert [(c["n"], c["q"], c["start"]) for c in r["glue"]] == [(1, 16, 64), (1, 64, 64), (4, 4, 64)]
    assert r["glue_kernels"] == [] and all(set(c["speedup"]) == kinds == set(c["torch"]) for c in r["glue"])
    for s in r["p_steps"]:  # the asymmetric P runs L20's KV path alone; the symmetric one L20 and a tail
        assert ("dec_src_kv_path" in s["t_main"]) == (s["mode"] == "asymmetric")
        assert bool(s["t_tail"]) == (s["mode"] == "symmetric" and s["prompts"] > 0)


def test_profile_layers_smoke(tmp_path):
    """bench/profile.py: every cell's every layer kind profiled, its kernels put in classes whose
    times add up to the profiled total."""
    _smoke("bench/profile.py", tmp_path)
    r = json.loads((tmp_path / "profile_layers_smoke.json").read_text())
    kinds = ["swa", "enc_src", "enc_reuse", "dec_src", "dec_reidx", "dec_reuse"]
    cells = [(1, 16, 32), (1, 64, 64), (4, 4, 64)]
    assert [(p["n"], p["q"], p["start"], p["kind"]) for p in r["profiles"]] == [(*c, k) for c in cells for k in kinds]
    for p in r["profiles"]:
        assert p["total_device_ms"] > 0 and p["kernels"]
        assert abs(sum(p["classes"].values()) - p["total_device_ms"]) < 1e-3 * p["total_device_ms"] + 1e-3


def test_kernel_classes():
    from bench.profile import kernel_class

    assert kernel_class("_mxfp4_moe_wgmma_kernel") == "moe_gemm"
    assert kernel_class("_indexer_scores_kernel_v5") == kernel_class("_radix_select_kernel") == "indexer"
    assert kernel_class("_sparse_attn_kernel") == "attention"
    assert kernel_class("_fp8_tile_gemm_kernel") == kernel_class("_fp8_tile_swap_kernel") == "dense_gemm"
    assert kernel_class("_swiglu_qdq_kernel") == kernel_class("_fp8_qdq_kernel") == "fp8_quant"
    assert kernel_class("_hc_pre_kernel") == kernel_class("_sinkhorn_kernel") == "hc_mix"
    assert kernel_class("_hc_project_kernel") == kernel_class("_hc_project_finish") == "hc_mix"
    assert kernel_class("_rms_norm_kernel") == "norm_rope"
    assert kernel_class("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "dense_gemm"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert kernel_class("something_new") == "other"


def test_glue_kernels_smoke(tmp_path):
    """bench/glue_kernels.py: the default and each variant's hc_project timed at every row count,
    each within summation-order error of the torch form; the MoE combine beside its torch form."""
    _smoke("bench/glue_kernels.py", tmp_path)
    r = json.loads((tmp_path / "glue_kernels_smoke.json").read_text())
    assert [c["rows"] for c in r["cells"]] == [16, 40]
    for c in r["cells"]:
        assert set(c["kernel"]) == {"default", *map(str, r["variants"])} and "errors" not in c
        assert all(k["rel_err"] < 1e-5 for k in c["kernel"].values())
    assert [c["tokens"] for c in r["moe_combine"]] == [5, 9]
    assert all(c["rel_err"] < 1e-2 and c["kernel"]["ms"] > 0 for c in r["moe_combine"])
