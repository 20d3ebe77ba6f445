"""Where a layer step's time goes: the torch profiler's kernels for the layer steps of issue 15's
cells (the same specs and blocks as ``bench/layers.py``'s ``kernels`` section: packed MXFP4 experts,
the fused indexer and attention), each kernel put in a class (MoE GEMMs, indexer, attention,
dense GEMMs, ...) so a layer's time reads as a sum of its parts; and the attention GEMM in the ways
torch can run it.

``python3 -m bench.profile [--cells 0,1,2] [--kinds swa,enc_src,...]`` writes ``profile_layers.json``;
``--smoke`` runs the tiny config on CPU (CPU kernels, no attention GEMMs) and writes
``profile_layers_smoke.json``.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import torch

from bench.common import log, record, time_cuda

# kernel name pattern -> class; the first match wins (lower-cased names)
KERNEL_CLASSES = (
    ("moe_gemm", r"moe|mxfp4|_gluon|grouped_mm|scaled_grouped"),
    ("indexer", r"_score|_select|indexer|_radix|_blockmax|_candidates|histogram"),
    ("attention", r"sparse_attn|_attn_|flash"),
    ("fp8_quant", r"fp8_qdq|qdq|quant|_codes32|swiglu"),
    ("hc_mix", r"hc_pre|hc_post|hc_project|sinkhorn"),
    ("dense_gemm", r"gemm|_fp8_tile|cutlass|xmma|nvjet|sm90_|cublas|ampere_|splitk|mm_|aten::(mm|bmm|addmm|linear)$"),
    ("sort_scan", r"sort|scan|cumsum|topk|radix|index_put|scatter|gather|index_select|nonzero"),
    ("norm_rope", r"norm|rope|polar|rsqrt"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|copy|fill|cat|softmax|exp|where"),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, pat in KERNEL_CLASSES:
        if re.search(pat, low):
            return cls
    return "other"


def top_kernels(fn, device: torch.device, n: int = 30) -> dict[str, Any]:
    """One profiled call of ``fn`` (after a warm one): its kernels by device time, and per class."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0.0)
        else:  # the CPU smoke: leaf ops' own time stands in for kernels
            t = e.self_cpu_time_total
        if t:
            rows.append({"name": e.key[:160], "class": kernel_class(e.key), "calls": e.count, "device_ms": t / 1e3})
    rows.sort(key=lambda r: -r["device_ms"])
    total = sum(r["device_ms"] for r in rows)
    by_class: dict[str, float] = {}
    for r in rows:
        by_class[r["class"]] = by_class.get(r["class"], 0.0) + r["device_ms"]
    classes = {k: round(v, 4) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])}
    return {"total_device_ms": total, "classes": classes, "kernels": rows[:n]}


def attention_gemms() -> list[dict[str, Any]]:
    """logits = q [m, 64, 512] x keys^T [m, 512, n] for one 2048-row chunk, four ways."""
    out = []
    dev = torch.device("cuda")
    for n_keys in (128, 640):
        m = 2048
        q = torch.randn(m, 64, 512, device=dev).to(torch.bfloat16)
        k = torch.randn(m, n_keys, 512, device=dev).to(torch.bfloat16)
        kt = k.transpose(1, 2)
        flops = 2 * m * 64 * 512 * n_keys
        kc = kt.contiguous()
        ways = {
            "bmm_bf16_out_f32": lambda q=q, kt=kt: torch.bmm(q, kt, out_dtype=torch.float32),
            "bmm_bf16_out_bf16": lambda q=q, kt=kt: torch.bmm(q, kt),
            "bmm_bf16_contig_keysT_out_f32": lambda q=q, kc=kc: torch.bmm(q, kc, out_dtype=torch.float32),
        }
        qf, kf = q.float(), kt.float()

        def tf32(qf=qf, kf=kf):
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return torch.bmm(qf, kf)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False

        ways["bmm_fp32_inputs_tf32"] = tf32
        ways["bmm_fp32_inputs_fp32"] = lambda qf=qf, kf=kf: torch.bmm(qf, kf)
        for name, fn in ways.items():
            try:
                t = time_cuda(fn, iters=10, warmup=2)
                out.append({"keys": n_keys, "way": name, "ms": t["ms"], "TFLOPs": flops / (t["ms"] * 1e-3) / 1e12})
            except Exception as e:
                out.append({"keys": n_keys, "way": name, "error": str(e)[:200]})
            log(out[-1])
    return out


def main() -> None:
    from asympd.config import tiny, v41_flash
    from bench.common import step_block as group_block_forward
    from bench.layers import K_SPEC, Steps, Timer, build, layer_kinds, step_inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU")
    ap.add_argument("--cells", default=None, help="indices into the cells (default all)")
    ap.add_argument("--kinds", default="swa,enc_src,enc_reuse,dec_src,dec_reidx,dec_reuse")
    ap.add_argument("--no-gemms", action="store_true", help="skip the attention GEMM comparison")
    ap.add_argument("--out", default=None, help="result name (default profile_layers[_smoke])")
    args = ap.parse_args()
    started = time.time()
    if args.smoke:
        cfg, device, experts = tiny(), torch.device("cpu"), "bf16"
        cells = [(1, 16, 32), (1, 64, 64), (4, 1 + K_SPEC, 64)]
    else:
        cfg, device, experts = v41_flash(), torch.device("cuda"), "mxfp4"
        # bench/layers.py's kernels section: prefill 4K and 16K rows at 16K and 48K, decode 128 x 4 at 64K
        cells = [(1, 4096, 16384), (1, 16384, 49152), (128, 1 + K_SPEC, 65536), (1, 4096, 49152)]
    if args.cells:
        cells = [cells[int(i)] for i in args.cells.split(",")]
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(layer_kinds(cfg))
    if unknown:
        raise SystemExit(f"unknown layer kinds {sorted(unknown)}; known: {sorted(layer_kinds(cfg))}")
    name = args.out or ("profile_layers_smoke" if args.smoke else "profile_layers")
    res: dict[str, Any] = {"config": "tiny" if args.smoke else "v41-flash", "block_experts": experts}
    if device.type == "cuda" and not args.no_gemms:
        res["attention_gemms"] = attention_gemms()
    built, _ = build(cfg, device, (experts,), experts)
    steps = Steps(cfg, built, Timer(device), None, device)
    blocks = built["blocks"]
    res["profiles"] = []
    with torch.inference_mode():
        for n, q, start in cells:
            groups = steps.groups([dict(n=n, q=q, start=start)])
            h, pre = step_inputs(cfg, groups.rows, device, steps.gen)
            for src in ("enc_src", "dec_src"):  # the reuse and re-index layers read their selections
                group_block_forward(blocks[src], h, pre, groups)
            for kind in kinds:
                prof = top_kernels(lambda b=blocks[kind], g=groups, h=h, p=pre: group_block_forward(b, h, p, g), device)
                res["profiles"].append({"n": n, "q": q, "start": start, "kind": kind, **prof})
                log(f"n={n} q={q} start={start} {kind}: {prof['total_device_ms']:.2f} ms", prof["classes"])
                record(name, res, started)
            del groups, h, pre
            if device.type == "cuda":
                torch.cuda.empty_cache()
    record(name, res, started)


if __name__ == "__main__":
    main()
