# ruff: noqa: E501
"""Markdown tables for docs/performance.md, printed from bench/results/*.json (``python -m bench.report``)."""

from __future__ import annotations

import json
from pathlib import Path

RES = Path(__file__).resolve().parents[1] / "bench" / "results"
S7 = {1: 0.68, 128: 8.08, 1024: 9.22, 1152: 9.28, 2048: 9.61, 4096: 10.67, 8192: 16.97, 16384: 23.17}


def load(name):
    return json.loads((RES / f"{name}.json").read_text())


def main() -> None:
    d = load("layers")
    c = d["ceilings"]
    print(
        f"ceilings: copy {c['copy_TBps']:.2f} TB/s, bf16 GEMM {c['bf16_gemm_TFLOPs']:.0f} TFLOP/s, "
        f"fp8 GEMM {c['fp8_gemm_TFLOPs']:.0f} TFLOP/s, fp32 GEMM {c['fp32_gemm_TFLOPs']:.0f} TFLOP/s\n"
    )
    u = {(r["experts"], r["rows"]): r for r in load("layers_unfused")["moe"]}
    print(
        "| rows | facts §7 bf16 | bf16 unfused (run 1) | bf16 eager | bf16 graph | % floor | fp8 eager | fp8 graph | % floor | experts touched |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["experts"], r["rows"]): r for r in d["moe"]}
    for rows in sorted({r["rows"] for r in d["moe"]}):
        b, f = by[("bf16", rows)], by[("fp8", rows)]
        ub = u.get(("bf16", rows))

        def g(r):
            return f"{r['graph']['ms']:.2f}" if r["graph"] else "–"

        print(
            f"| {rows} | {S7.get(rows, '–')} | {ub['eager']['ms']:.2f} | {b['eager']['ms']:.2f} | {g(b)} | "
            f"{100 * b['floor_fraction']:.0f} | {f['eager']['ms']:.2f} | {g(f)} | {100 * f['floor_fraction']:.0f} | "
            f"{b['experts_touched']} |"
        )
    print()
    for rows in (128, 2048, 16384):
        b, f = by[("bf16", rows)], by[("fp8", rows)]
        print(
            f"gemm-only {rows}: bf16 {b['gemm_only']['ms']:.2f} ms of {min(b['eager']['ms'], (b['graph'] or b['eager'])['ms']):.2f}; fp8 {f['gemm_only']['ms']:.2f} of {min(f['eager']['ms'], (f['graph'] or f['eager'])['ms']):.2f}"
        )
    print("\nlayer grid (ms, % of floor)")
    kinds = list(d["build"]["kinds"])
    print("| step | rows | context | " + " | ".join(kinds) + " |")
    print("|---|---|---|" + "---|" * len(kinds))
    for r in d["grid"]:
        shape = f"decode B={r['n']}x{r['q']}" if r["shape"] == "decode" else "prefill chunk"
        cells = " | ".join(f"{r['kinds'][k]['ms']:.1f} ({100 * r['kinds'][k]['floor_fraction']:.0f}%)" for k in kinds)
        print(f"| {shape} | {r['n'] * r['q']} | {r['start']} | {cells} |")
    print(
        "\nstack checks:",
        [
            (s["specs"], round(s["stack"]["ms"], 2), round(s["sum_alone_ms"], 2), round(s["ratio"], 3))
            for s in d["stack"]
        ],
    )
    print("variants:")
    for v in d["variants"]:
        print(
            " ",
            v["rows"],
            {
                k: (round(v[k]["ms"], 2), round(v[k]["rel_err_vs_bf16"], 4))
                for k in ("bf16", "fp8_experts", "fp8_experts_linears")
            },
        )
    print("head:", [(h["rows"], round(h["fp32_ms"], 2), round(h.get("bf16_f32out_ms", 0), 2)) for h in d["head"]])
    p = load("p_throughput")
    print("\n| prompt | asym ms/prompt | asym tok/GPU-s | sym ms/prompt | sym tok/GPU-s | asym/sym |")
    print("|---|---|---|---|---|---|")
    for r in p["per_length"]:
        a, s = r["asymmetric"], r["symmetric"]
        print(
            f"| {r['n_prompt']} | {a['ms_per_prompt']:.0f} | {a['tokens_per_gpu_s']:.0f} | {s['ms_per_prompt']:.0f} | {s['tokens_per_gpu_s']:.0f} | {r['asym_over_sym']:.2f} |"
        )
    m = p["mix"]
    print(
        f"| mix {m['weights']} | | {m['asymmetric']['tokens_per_gpu_s']:.0f} | | {m['symmetric']['tokens_per_gpu_s']:.0f} | {m['asym_over_sym']:.2f} |"
    )
    print("\n| prompt | mode | e2e tok/s (3-layer engine) | composed tok/s | e2e/composed |")
    print("|---|---|---|---|---|")
    for r in p["reduced_check"]:
        print(
            f"| {r['n_prompt']} | {r['mode']} | {r['e2e_tokens_per_s']:.0f} | {r['composed_tokens_per_s']:.0f} | {r['e2e_over_composed']:.2f} |"
        )
    e = load("p_e2e")
    print(
        "\ne2e split:",
        [(r["mode"], r["n_prompt"], round(r["wall_s"] * 1e3), r["forward_ms"], r["export_ms"]) for r in e["runs"]],
    )
    da = load("d_admission")
    print("\n| B (x4 rows) | j=0 step ms | +1 | +2 | +4 | +8 | ms per prefill (j=1..8) |")
    print("|---|---|---|---|---|---|---|")
    for b in sorted({r["B"] for r in da["steps"]}):
        rows = {r["j"]: r for r in da["steps"] if r["B"] == b}
        cells = " | ".join(f"{rows[j]['step_ms']:.0f} (+{rows[j]['added_pct']:.1f}%)" for j in (1, 2, 4, 8))
        per = [round(rows[j]["added_ms_per_prefill"], 1) for j in (1, 2, 4, 8)]
        print(f"| {b} | {rows[0]['step_ms']:.0f} | {cells} | {per} |")
    ap = load("admission_policy")
    print(
        f"\nadmission sim: rate {ap['rate_req_per_s']:.2f} req/s, out {ap['out_len']}, target batch {ap['target_concurrency']}"
    )
    print(
        "| arrivals | policy | ITL p50 | ITL p99 | p99 / decode-only step | TTFT p50 | TTFT p99 | mean batch | prefills/step (mean, max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for sc, v in ap["scenarios"].items():
        for name, r in v.items():
            print(
                f"| {sc} | {name} | {r['itl_ms']['p50']:.0f} | {r['itl_ms']['p99']:.0f} | {r['p99_itl_over_decode_only']:.2f} | "
                f"{r['ttft_ms']['p50'] / 1e3:.1f} s | {r['ttft_ms']['p99'] / 1e3:.1f} s | {r['mean_batch']:.0f} | "
                f"{r['mean_prefills_per_step']:.2f}, {r['max_prefills_in_step']:.0f} |"
            )
    mem = load("memory")
    print("\nmemory:", mem["weights_gb"], mem["p_weights_ratio_prefill_over_full"], mem["gpus_needed_for_weights"])
    cc = load("cuda_check")
    print(
        "\ncuda_check:",
        {k: round(v, 4) for k, v in cc.items() if k.startswith("max_")},
        cc["engine_asymmetric_greedy"]["identical_leading_tokens_float32"],
        cc["engine_asymmetric_greedy"]["identical_leading_tokens_bfloat16"],
    )
    print(
        "fp8 variant rel vs cpu fp32 / cpu bf16 (max):",
        max(r["rel_vs_cpu_fp32"] for r in cc["forward"] if r["variant"] == "cuda_bf16_fp8_experts"),
        max(r["rel_vs_cpu_fp32"] for r in cc["forward"] if r["variant"] == "cuda_bf16_fp8_experts_linears"),
    )
    cs = load("cpu_sensitivity")
    print(
        "cpu sensitivity max (1e-6):",
        cs["max_rel_eps_1e-6"],
        "max (1e-7):",
        max(r["rel"] for r in cs["rows"] if r["eps"] == 1e-7),
    )


if __name__ == "__main__":
    main()
