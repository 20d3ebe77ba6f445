"""The MXFP4 expert GEMM at prefill sizes: kernel configurations beside bf16's grouped GEMM.

At 8-16K tokens a step the MoE is FLOP-bound, and the register-expanding kernel runs 1.6-2.0x
slower than bf16 experts (docs/performance.md §9). The sweep of the first sessions
(``formats_sweep.json``) tried M-blocks of 128 rows only; here the w13 GEMM of one V4.1 MoE layer
(384 experts, N = 2 x 2304, K = 5120, top-6 random routing) runs at 8192 and 16384 tokens with
M-blocks of 128 and 256 rows, 2 or 3 stages and 1 or 2 scale blocks a loop step, in the tiled
layout the CUDA build holds (and the row layout at N-blocks of 256), against ``torch._grouped_mm``
on the same experts in bf16 and the same routing. Every configuration's output is compared with
the default configuration's (relative error; the products are the same, only the order of the sum
may differ). Writes ``moe_prefill.json``.

Usage (device): ``python3 -m bench.moe_prefill [--budget-s 300]``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch

from bench.common import ceilings, log, record, time_cuda

N_EXP, TOPK, N13, K = 384, 6, 2 * 2304, 5120


def configs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "default"}]
    for bm in (128, 256):
        for stages in (2, 3):
            for unroll in (1, 2):
                out.append({"block_m": bm, "num_warps": 8, "num_stages": stages, "unroll": unroll})
    for stages in (2, 3):
        out.append({"layout": "rows", "block_m": 128, "block_n": 256, "num_warps": 8, "num_stages": stages})
    return out


def main() -> None:
    from asympd.model import gemm_kernels as G
    from asympd.model.packed import moe_block_m
    from asympd.model.quant import dequant_fp4

    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting configurations after this")
    ap.add_argument("--tokens", default="8192,16384")
    args = ap.parse_args()
    started = time.time()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randint(-128, 128, (N_EXP, N13, K // 2), dtype=torch.int8, device=dev, generator=g)
    s = torch.randint(118, 123, (N_EXP, N13, K // 32), dtype=torch.uint8, device=dev, generator=g)
    tiled = G.tile_fp4(w, s, 128)
    dense = torch.empty(N_EXP, N13, K, dtype=torch.bfloat16, device=dev)
    for e0 in range(0, N_EXP, 32):  # the same experts in bf16 (exact), for the grouped GEMM
        codes, scales = G.unrepack_fp4(w[e0 : e0 + 32]), s[e0 : e0 + 32].view(torch.float8_e8m0fnu)
        dense[e0 : e0 + 32] = dequant_fp4(codes, scales).to(torch.bfloat16)
    ceil = ceilings()
    res: dict[str, Any] = {"shape": {"experts": N_EXP, "topk": TOPK, "n": N13, "k": K}, "ceilings": ceil, "cells": []}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = (torch.randn(tokens, K, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        ids = torch.rand(tokens, N_EXP, device=dev, generator=g).topk(TOPK, dim=-1).indices
        flat = ids.reshape(-1)
        rows = flat.numel()
        flops = 2.0 * rows * N13 * K
        order = torch.argsort(flat, stable=True)
        a_rows = order // TOPK
        counts = torch.bincount(flat, minlength=N_EXP)
        offs = counts.cumsum(0).to(torch.int32)
        xs = x[a_rows]
        t = time_cuda(lambda xs=xs, offs=offs: torch._grouped_mm(xs, dense.transpose(-2, -1), offs=offs), iters=6)
        cell: dict[str, Any] = {"tokens": tokens, "rows": rows, "flops": flops, "bf16_grouped_mm": t}
        cell["bf16_tflops"] = flops / t["ms"] / 1e9
        log(f"{tokens} tokens: bf16 grouped GEMM {t['ms']:.2f} ms ({cell['bf16_tflops']:.0f} TFLOP/s)")
        ref = None
        cell["mxfp4"] = []
        for cfg in configs():
            if time.time() - started > args.budget_s:
                cell["mxfp4"].append({**cfg, "skipped": "budget"})
                continue
            cfg = dict(cfg)
            name = cfg.pop("name", None)
            layout = cfg.pop("layout", "tiled")
            bm = cfg.pop("block_m", moe_block_m(rows, N_EXP))
            weight, scale = tiled if layout == "tiled" else (w, s)
            blocks = tuple(G.moe_blocks(flat, N_EXP, bm)[1:])
            row = {"name": name, "layout": layout, "block_m": bm, **cfg}
            try:
                fn = partial(G.mxfp4_moe_gemm, x, weight, scale, blocks, rows, bm, a_rows=a_rows, config=cfg or None)
                y = fn()
                if ref is None:
                    ref = y.float()
                row["rel_err_vs_default"] = float((y.float() - ref).norm() / ref.norm())
                t = time_cuda(fn, iters=6)
                row.update(t)
                row["tflops"] = flops / t["ms"] / 1e9
                row["over_bf16"] = cell["bf16_grouped_mm"]["ms"] / t["ms"]
                log(f"  {row}")
            except Exception as e:  # a configuration that does not compile or fit: say so, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  {row}")
            cell["mxfp4"].append(row)
            torch.cuda.empty_cache()
        res["cells"].append(cell)
        record("moe_prefill", res, started)
    log("done in", round(time.time() - started, 1), "s")


if __name__ == "__main__":
    main()
