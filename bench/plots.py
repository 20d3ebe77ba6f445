"""The figures of docs/performance.md, drawn only from bench/results/*.json.

``python -m bench.plots`` writes docs/perf_*.png. Each figure's caption in the doc names its file.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
FACTS_S7 = {1: 0.68, 128: 8.08, 1024: 9.22, 1152: 9.28, 2048: 9.61, 4096: 10.67, 8192: 16.97, 16384: 23.17}


def load(name: str) -> dict:
    return json.loads((RES / f"{name}.json").read_text())


def moe() -> None:
    d = load("layers")
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for experts, style in (("bf16", "-"), ("fp8", "--")):
        rows = [r for r in d["moe"] if r["experts"] == experts]
        x = [r["rows"] for r in rows]
        ax[0].plot(x, [r["eager"]["ms"] for r in rows], "o" + style, label=f"{experts} experts, eager")
        gx = [r["rows"] for r in rows if r["graph"]]
        ax[0].plot(
            gx, [r["graph"]["ms"] for r in rows if r["graph"]], "s" + style, label=f"{experts} experts, CUDA graph"
        )
        ax[0].plot(x, [r["floor_ms"] for r in rows], ":", label=f"{experts} floor")
        ax[1].plot(x, [100 * r["floor_fraction"] for r in rows], "o" + style, label=f"{experts} (best of eager/graph)")
    ax[0].plot(list(FACTS_S7), list(FACTS_S7.values()), "k^", label="facts §7 (bf16, same card type)")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("rows (tokens) in the step")
        a.grid(alpha=0.3)
    ax[0].set_yscale("log")
    ax[0].set_ylabel("ms (one MoE layer: 384 experts top-6 + shared)")
    ax[1].set_ylabel("% of floor reached")
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    fig.suptitle("MoE sublayer at true shape, H200 (bench/results/layers.json, section moe)")
    fig.tight_layout()
    fig.savefig(DOCS / "perf_moe.png", dpi=110)


def layers() -> None:
    d = load("layers")
    kinds = list(d["build"]["kinds"])
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    pre0 = sorted((r for r in d["grid"] if r["shape"] == "prefill" and r["start"] == 0), key=lambda r: r["q"])
    dec4k = sorted(
        (r for r in d["grid"] if r["shape"] == "decode" and r["start"] == 4096), key=lambda r: r["n"] * r["q"]
    )
    for kind in kinds:
        pts = [(r["n"] * r["q"], r["kinds"][kind]) for r in dec4k + pre0]
        pts.sort(key=lambda p: p[0])
        ax[0].plot([p[0] for p in pts], [p[1]["ms"] for p in pts], "o-", label=kind)
        ax[1].plot([p[0] for p in pts], [100 * p[1]["floor_fraction"] for p in pts], "o-", label=kind)
    ax[0].set_xscale("log", base=2)
    ax[0].set_yscale("log")
    ax[0].set_xlabel("rows in the step (decode batches at 4K context, then one prefill chunk from 0)")
    ax[0].set_ylabel("layer step ms")
    ax[1].set_xscale("log", base=2)
    ax[1].set_xlabel("rows in the step")
    ax[1].set_ylabel("% of floor")
    for q in (1024, 16384):
        rows = sorted((r for r in d["grid"] if r["shape"] == "prefill" and r["q"] == q), key=lambda r: r["start"])
        for kind in ("enc_src", "dec_src", "enc_reuse"):
            ax[2].plot(
                [r["start"] + q for r in rows], [r["kinds"][kind]["ms"] for r in rows], "o-", label=f"{kind}, {q} rows"
            )
    ax[2].set_xlabel("context at the end of the chunk (tokens)")
    ax[2].set_ylabel("layer step ms")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle("Full layer steps (mHC + attention + MoE) at true shape (bench/results/layers.json, section grid)")
    fig.tight_layout()
    fig.savefig(DOCS / "perf_layers.png", dpi=110)


def p_throughput() -> None:
    d = load("p_throughput")
    rows = d["per_length"]
    labels = [f"{r['n_prompt'] // 1024}K" for r in rows] + ["mix"]
    asym = [r["asymmetric"]["tokens_per_gpu_s"] for r in rows] + [d["mix"]["asymmetric"]["tokens_per_gpu_s"]]
    sym = [r["symmetric"]["tokens_per_gpu_s"] for r in rows] + [d["mix"]["symmetric"]["tokens_per_gpu_s"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], asym, 0.4, label="asymmetric P (L0-19 + L20 KV path on [0, N-W))")
    ax.bar([i + 0.2 for i in x], sym, 0.4, label="symmetric P (decoder-replay on [0, N))")
    for i, (a, s) in enumerate(zip(asym, sym, strict=True)):
        ax.text(i, max(a, s) * 1.02, f"{a / s:.2f}x", ha="center", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("prompt tokens per GPU-second (composed)")
    ax.set_title("P throughput, 40-layer stack composed from measured layer steps (p_throughput.json)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(DOCS / "perf_p_throughput.png", dpi=110)


def d_admission() -> None:
    d = load("d_admission")
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for b in sorted({r["B"] for r in d["steps"]}):
        rows = sorted((r for r in d["steps"] if r["B"] == b), key=lambda r: r["j"])
        ax[0].plot([r["j"] for r in rows], [r["step_ms"] for r in rows], "o-", label=f"B={b} x 4 rows")
        ax[1].plot([r["j"] for r in rows], [r.get("added_pct", 0.0) for r in rows], "o-", label=f"B={b}")
    ax[0].set_xlabel("bounded prefills (128 rows each) admitted in the step")
    ax[0].set_ylabel("D step ms (40 layers + head, one GPU)")
    ax[1].set_xlabel("bounded prefills admitted")
    ax[1].set_ylabel("% added to the decode-only step")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("D admission cost at 8K context, composed from measured layer steps (d_admission.json)")
    fig.tight_layout()
    fig.savefig(DOCS / "perf_d_admission.png", dpi=110)


def admission_policy() -> None:
    d = load("admission_policy")
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["admit-all", "cap-8", "cap-4"]
    for k, sc in enumerate(("poisson", "p_batches")):
        r = d["scenarios"][sc]
        off = -0.2 if k == 0 else 0.2
        ax[0].bar([i + off for i in range(len(names))], [r[n]["itl_ms"]["p99"] for n in names], 0.4, label=sc)
        ax[1].bar([i + off for i in range(len(names))], [r[n]["ttft_ms"]["p99"] / 1e3 for n in names], 0.4, label=sc)
    ax[0].set_ylabel("p99 ITL (ms per decode step, one-GPU-equivalent)")
    ax[1].set_ylabel("p99 TTFT at D (s, one-GPU-equivalent)")
    for a in ax:
        a.set_xticks(range(len(names)), names)
        a.grid(axis="y", alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle("Admission policy on D, simulated with the engine scheduler (admission_policy.json)")
    fig.tight_layout()
    fig.savefig(DOCS / "perf_admission_policy.png", dpi=110)


def main() -> None:
    DOCS.mkdir(exist_ok=True)
    for fn in (moe, layers, p_throughput, d_admission, admission_policy):
        fn()
        print("wrote", fn.__name__)


if __name__ == "__main__":
    main()
