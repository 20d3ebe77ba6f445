"""The MXFP4 expert GEMMs at prefill sizes: the kernels beside bf16's grouped GEMM.

At 4-16K tokens a step the MoE is FLOP-bound, and the register-expanding Triton kernel runs 1.6-2.0x
slower than bf16 experts (docs/performance.md §9). This times both GEMMs of one V4.1 MoE layer
(384 experts, top-6 random routing): w13 (N = 2 x 2304, K = 5120, the token rows gathered) and w2
(N = 5120, K = 2304, rows already sorted by expert), in the tiled layout the CUDA build holds, with
the Triton kernel (``wgmma: False``), the Gluon wgmma kernel (``asympd/model/moe_gluon.py``) in a
few configurations, and ``torch._grouped_mm`` on the same experts in bf16 with the same routing;
``--block-ms`` times M-blocks other than the product's choice (``packed.moe_block_m``), each with its
floor (the touched experts' MXFP4 bytes at the measured copy rate, or the FLOPs at the FP8 rate).
Every variant's output is compared with the Triton kernel's (relative error; the products are the
same, only the order of the sum may differ) and, on 2 experts' rows, with fp32 math on the
dequantized experts. ``--sweep``: the sixteenth session's tile sweep of the Triton kernel instead.
Writes ``moe_prefill[_...].json`` (``--out``).

Usage (device): ``python3 -m bench.moe_prefill [--tokens 2048,4096,8192,16384] [--block-ms 16,32,64]
[--variants triton,gluon] [--out NAME]``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch

from bench.common import ceilings, log, record, time_cuda

N_EXP, TOPK, N13, K = 384, 6, 2 * 2304, 5120
N2, K2 = 5120, 2304
WGMMA_CONFIGS = [
    {},
    {"tiles_inner": True},
    {"tiles_inner": False},
    {"lut_registers": False, "tiles_inner": False},  # the nineteenth session's kernel
    {"a_smem": True},
    {"stages": 5},
    {"num_warps": 4},
    {"num_warps": 4, "stages": 3},
    {"warp_specialized": True},
    {"warp_specialized": True, "stages": 6},
    {"warp_specialized": True, "a_smem": True},  # an expanding partition, both wgmma operands in shared memory
    {"warp_specialized": True, "a_smem": True, "num_warps": 4},  # ... of 4 warps (the default: 8 from 32-row blocks)
    {"warp_specialized": True, "a_smem": True, "split_layout": True},  # ... with the split-layout decode
    {"exponent_decode": True},
    {"exponent_decode": True, "num_warps": 4},
    {"exponent_decode": True, "num_warps": 4, "stages": 3},
    {"exponent_decode": True, "num_warps": 4, "stages": 6},
    {"exponent_decode": True, "stages": 6},
    {"exponent_decode": True, "maxnreg": 64},
    {"exponent_decode": True, "maxnreg": 80},
    {"exponent_decode": True, "maxnreg": 96},
    {"exponent_decode": True, "sub_tiles": 1},  # the twenty-fifth session's kernel (its 16/32-row default)
    {"exponent_decode": True, "sub_tiles": 1, "num_warps": 8},  # ... and its 64/128-row default
    {"split_layout": True},  # the weights' bytes in fp4_ptx.split_layout (the experts are permuted for it)
    {"split_layout": True, "num_warps": 8},
    {"split_layout": True, "num_warps": 4},
    {"split_layout": True, "sub_tiles": 1},
    {"split_layout": True, "sub_tiles": 2},
    {"split_layout": True, "sub_tiles": 4},
    {"split_layout": True, "sub_tiles": 4, "num_warps": 4},
    {"split_layout": True, "w_tiles": 2},  # two weight tiles a program: the activation rows copied once
    {"split_layout": True, "w_tiles": 2, "num_warps": 8},  # ... a warp group a tile
    # at 64-row blocks: 126 registers and no spill under the cap (142 without), two programs an SM
    {"split_layout": True, "w_tiles": 2, "num_warps": 8, "maxnreg": 128},
    {"split_layout": True, "overlap": True},  # step i + 1 decoded while step i's wgmmas run
    {"split_layout": True, "tiles_inner": True},
    {"split_layout": True, "tiles_inner": False},
]


def configs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "default"}]
    for bm in (128, 256):
        for stages in (2, 3):
            for unroll in (1, 2):
                out.append({"block_m": bm, "num_warps": 8, "num_stages": stages, "unroll": unroll})
    for stages in (2, 3):
        out.append({"layout": "rows", "block_m": 128, "block_n": 256, "num_warps": 8, "num_stages": stages})
    return out


def _experts(n: int, k: int, dev: torch.device, g: torch.Generator):
    """Random MXFP4 experts (kernel order, tiled) and the same in bf16 (exact)."""
    from asympd.model import gemm_kernels as G
    from asympd.model.quant import dequant_fp4

    w = torch.randint(-128, 128, (N_EXP, n, k // 2), dtype=torch.int8, device=dev, generator=g)
    s = torch.randint(118, 123, (N_EXP, n, k // 32), dtype=torch.uint8, device=dev, generator=g)
    dense = torch.empty(N_EXP, n, k, dtype=torch.bfloat16, device=dev)
    for e0 in range(0, N_EXP, 32):
        codes, scales = G.unrepack_fp4(w[e0 : e0 + 32]), s[e0 : e0 + 32].view(torch.float8_e8m0fnu)
        dense[e0 : e0 + 32] = dequant_fp4(codes, scales).to(torch.bfloat16)
    return (w, s), G.tile_fp4(w, s, 128), dense


def _fp32_check(y: torch.Tensor, xs: torch.Tensor, dense: torch.Tensor, counts: torch.Tensor) -> float:
    """Max |error| / max |ref| over the rows of the first two non-empty experts (sorted order)."""
    starts = torch.cumsum(counts, 0) - counts
    worst = 0.0
    for e in [int(i) for i in torch.nonzero(counts).flatten()[:2]]:
        r0, r1 = int(starts[e]), int(starts[e] + counts[e])
        ref = xs[r0:r1].float() @ dense[e].float().T
        worst = max(worst, float((y[r0:r1].float() - ref).abs().max() / ref.abs().max()))
    return worst


def gemm_floor(rows: int, touched: int, n: int, k: int, ceil: dict[str, Any]) -> dict[str, float]:
    """The fewest milliseconds one expert GEMM can take: the touched experts' packed bytes and
    scales, the activations read and the output written at the copy rate, or its FLOPs at the FP8
    rate (the release format's, docs/performance.md §9)."""
    nbytes = touched * n * k * 0.53125 + rows * k * 2 + rows * n * 2
    flops = 2.0 * rows * n * k
    bytes_ms = nbytes / (ceil["copy_TBps"] * 1e12) * 1e3
    flops_ms = flops / (ceil.get("fp8_gemm_TFLOPs", ceil["bf16_gemm_TFLOPs"]) * 1e12) * 1e3
    return {"floor_ms": max(bytes_ms, flops_ms), "bytes_ms": bytes_ms, "flops_ms": flops_ms}


def _alias(cfg: dict[str, Any]) -> str:
    """gluon, gluon:a_smem, gluon:tiles_inner=False, ... (a key alone where its value is True)."""
    return ":".join(["gluon", *(k if v is True else f"{k}={v}" for k, v in cfg.items())])


def _variants(names: str) -> list[tuple[str, dict[str, Any]]]:
    """The variants to time: ``all``, or names among ``triton``, ``gluon`` (the default
    configuration) and ``gluon:KEY[=VALUE]...`` (``_alias``, e.g. ``gluon:a_smem``, ``gluon:tiles_inner=False``)."""
    out = [("triton", {"wgmma": False}, "triton")]
    out += [(f"wgmma{c}", {"wgmma": True, "wgmma_config": c}, _alias(c)) for c in WGMMA_CONFIGS]
    want = None if names == "all" else set(names.split(","))
    return [(n, c) for n, c, alias in out if want is None or alias in want]


def gemm_cells(args: argparse.Namespace, started: float) -> dict[str, Any]:
    from asympd.model import gemm_kernels as G
    from asympd.model.fp4_ptx import split_bytes
    from asympd.model.packed import moe_block_m

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"w13": (N13, K, True), "w2": (N2, K2, False)}
    experts = {name: _experts(n, k, dev, g) for name, (n, k, _) in shapes.items()}
    split: dict[str, torch.Tensor] = {}  # each shape's tiled bytes in the split layout, made on first use
    res: dict[str, Any] = {"shapes": {n: {"n": v[0], "k": v[1], "gather": v[2]} for n, v in shapes.items()}}
    ceil = ceilings()
    res |= {"experts": N_EXP, "topk": TOPK, "ceilings": ceil, "cells": []}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        ids = torch.rand(tokens, N_EXP, device=dev, generator=g).topk(TOPK, dim=-1).indices
        flat = ids.reshape(-1)
        rows = flat.numel()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=N_EXP)
        offs = counts.cumsum(0).to(torch.int32)
        touched = int((counts > 0).sum())
        block_ms = [int(b) for b in args.block_ms.split(",")] if args.block_ms else [moe_block_m(rows, N_EXP)]
        for name, (n, k, gather) in shapes.items():
            _, (wt, st), dense = experts[name]
            x = (torch.randn(tokens if gather else rows, k, device=dev, generator=g) * 0.5).to(torch.bfloat16)
            a_rows = order // TOPK if gather else None
            xs = x[a_rows] if gather else x
            flops = 2.0 * rows * n * k
            floor = gemm_floor(rows, touched, n, k, ceil)
            wd = dense.transpose(-2, -1)
            bf16 = time_cuda(lambda xs=xs, wd=wd, offs=offs: torch._grouped_mm(xs, wd, offs=offs), iters=6)
            bf16 |= {"tflops": flops / bf16["ms"] / 1e9}
            for bm in block_ms:
                if time.time() - started > args.budget_s:
                    res["cells"].append({"tokens": tokens, "gemm": name, "block_m": bm, "skipped": "budget"})
                    continue
                cell: dict[str, Any] = {"tokens": tokens, "gemm": name, "rows": rows, "block_m": bm, "flops": flops}
                cell |= {"default_block_m": moe_block_m(rows, N_EXP), "experts_touched": touched, **floor}
                cell["bf16_grouped_mm"] = bf16
                blocks = tuple(G.moe_blocks(flat, N_EXP, bm)[1:])
                ref = None
                for vname, cfg in _variants(args.variants):
                    row: dict[str, Any] = {"variant": vname}
                    try:
                        wk = wt
                        if cfg.get("wgmma_config", {}).get("split_layout"):
                            wk = split.setdefault(name, split_bytes(wt))
                        fn = partial(G.mxfp4_moe_gemm, x, wk, st, blocks, rows, bm, a_rows=a_rows, config=cfg)
                        y = fn()
                        ref = y.float() if ref is None else ref
                        row["rel_err_vs_first"] = float((y.float() - ref).norm() / ref.norm())
                        row["max_err_vs_fp32"] = _fp32_check(y, xs, dense, counts)
                        t = time_cuda(fn, iters=6)
                        row |= t | {"tflops": flops / t["ms"] / 1e9, "over_bf16": bf16["ms"] / t["ms"]}
                        row["fraction_of_floor"] = floor["floor_ms"] / t["ms"]
                    except Exception as e:  # a configuration that does not compile or fit: say so, go on
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    cell[vname] = row
                    log(f"{tokens} tokens {name} (BM {bm}) {vname}: {row}")
                log(f"{tokens} tokens {name}: bf16 grouped GEMM {bf16}, floor {floor}")
                res["cells"].append(cell)
                torch.cuda.empty_cache()
        record(args.out, res, started)
    return res


def sweep(args: argparse.Namespace, started: float) -> None:
    from asympd.model import gemm_kernels as G
    from asympd.model.packed import moe_block_m

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    (w, s), tiled, dense = _experts(N13, K, dev, g)
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
        record(args.out, res, started)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting cells after this")
    ap.add_argument("--tokens", default="2048,4096,8192,16384")
    ap.add_argument("--block-ms", default=None, help="M-blocks to time (default: the product's choice)")
    ap.add_argument("--variants", default="all", help="all, or triton, gluon, gluon:KEY (_variants)")
    ap.add_argument("--sweep", action="store_true", help="the Triton kernel's tile sweep (sixteenth session)")
    ap.add_argument("--out", default=None, help="result name (default moe_prefill_wgmma, or moe_prefill with --sweep)")
    args = ap.parse_args()
    args.out = args.out or ("moe_prefill" if args.sweep else "moe_prefill_wgmma")
    started = time.time()
    (sweep if args.sweep else gemm_cells)(args, started)
    log("done in", round(time.time() - started, 1), "s")


if __name__ == "__main__":
    main()
