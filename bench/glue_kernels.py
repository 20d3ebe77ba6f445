"""The mHC projection kernel (``cuda_kernels.hc_project``) and the MoE's combine
(``cuda_kernels.moe_combine``) alone, at V4.1-Flash's shapes, against their torch forms and their
bytes floors, in one run (hc_project also over its launch arguments).

What it computes per row: the four residual streams flattened ([rows, 4 x 4096] bf16) times the fp32
``hc_*_fn`` [24, 16384], scaled by the row's reciprocal RMS. The floor is the bytes it must move
(the streams once, fn once, the fp32 output) at the copy rate measured in the same run; its FLOPs
(0.8 MFLOP a row) are noise beside them. Every variant's output is compared with the torch form's
(relative error; the kernel's products are exact, only the summation order differs).

The combine: per token, its 6 routed slots' rows gathered from the expert-sorted GEMM output and
summed with the shared expert's row in fp32, one rounding to bf16; the torch form is what
``FastMoE`` ran before (``index_select`` of every slot row, an fp32 sum, the shared row upcast and
added, a cast). Floor: the slot rows and the shared row read once, the output written once.

    python -m bench.glue_kernels            # on the GPU, ~1 minute; JSON to bench/results/
    python -m bench.glue_kernels --smoke    # tiny rows on CPU through the Triton interpreter
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from asympd.model import cuda_kernels as CK  # noqa: E402
from bench.common import ceilings, log, record, time_cuda  # noqa: E402

HC, DIM, MIX = 4, 4096, 24  # V4.1-Flash: hc_mult, dim, (2 + hc) * hc mixes
TOPK = 6  # routed experts a token
NORM_EPS = 1e-6
# launch arguments tried beside the default (block_t None: the default's choice by rows)
VARIANTS: list[dict[str, Any]] = [
    {"block_t": 16}, {"block_t": 32}, {"block_t": 64}, {"block_t": 128, "num_warps": 8},
    {"block_t": 64, "block_k": 64}, {"block_t": 64, "block_k": 256}, {"block_t": 64, "num_warps": 8},
    {"block_t": 64, "num_stages": 2}, {"block_t": 64, "num_stages": 4}, {"block_t": 32, "num_stages": 4},
    {"block_t": 16, "block_k": 256}, {"block_t": 16, "num_stages": 4}, {"splits": 1}, {"block_t": 64, "splits": 1},
    {"block_t": 128, "num_warps": 8, "splits": 1}, {"block_t": 128, "num_warps": 4},
]  # fmt: skip


def torch_form(h: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """``ops.hc_mixes``'s projection as the torch ops compute it (the kernel's reference)."""
    x = h.flatten(-2).float()
    return torch.nn.functional.linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORM_EPS)


def combine_torch(rows: torch.Tensor, inv: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The combine as ``FastMoE`` ran it before ``moe_combine`` (``combine_slots`` on CUDA)."""
    t = shared.size(0)
    y = rows.index_select(0, inv).view(t, TOPK, -1).sum(1, dtype=torch.float32)
    return (y + shared.float()).to(shared.dtype)


def combine_cells(rows_list: list[int], dim: int, device, gen, ceil, timed) -> list[dict[str, Any]]:
    cells = []
    for t in rows_list:
        rows = torch.randn(t * TOPK, dim, generator=gen, device=device).to(torch.bfloat16)
        inv = torch.randperm(t * TOPK, generator=gen, device=device)
        shared = torch.randn(t, dim, generator=gen, device=device).to(torch.bfloat16)
        want = combine_torch(rows, inv, shared)
        got = CK.moe_combine(rows, inv, TOPK, shared)
        nbytes = (rows.numel() + 2 * shared.numel()) * 2 + inv.numel() * 8
        floor_ms = nbytes / (ceil["copy_TBps"] * 1e9) if ceil else None
        cell: dict[str, Any] = {"tokens": t, "bytes": nbytes, "floor_ms": floor_ms}
        cell["torch"] = timed(lambda r=rows, i=inv, s=shared: combine_torch(r, i, s))
        cell["kernel"] = timed(lambda r=rows, i=inv, s=shared: CK.moe_combine(r, i, TOPK, s))
        cell["rel_err"] = float((got.float() - want.float()).norm() / want.float().norm())
        cell["speedup"] = cell["torch"]["ms"] / cell["kernel"]["ms"]
        if floor_ms:
            cell["kernel"]["floor_fraction"] = floor_ms / cell["kernel"]["ms"]
        log(
            f"moe_combine tokens={t}: torch {cell['torch']['ms']:.3f} ms, kernel {cell['kernel']['ms']:.3f} ms"
            + (f" (floor {floor_ms:.3f} ms)" if floor_ms else "")
        )
        cells.append(cell)
    return cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny rows on CPU: plumbing only")
    ap.add_argument("--rows", default="", help="comma-separated row counts (default 512,1024,4096,16384)")
    ap.add_argument("--out", default="", help="the JSON's name under bench/results/ (default glue_kernels)")
    args = ap.parse_args()
    started = time.time()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dim = DIM if cuda else 64
    rows_list = [int(r) for r in args.rows.split(",") if r] or ([512, 1024, 4096, 16384] if cuda else [16, 40])
    variants = VARIANTS if cuda else VARIANTS[:2]
    name = args.out or ("glue_kernels" if cuda else "glue_kernels_smoke")
    res: dict[str, Any] = {"shape": {"hc": HC, "dim": dim, "mix": MIX}, "variants": variants, "cells": []}
    ceil = ceilings() if cuda else None
    res["ceilings"] = ceil
    gen = torch.Generator(device=device).manual_seed(0)
    fn = torch.randn(MIX, HC * dim, generator=gen, device=device) * (HC * dim) ** -0.5

    def timed(f) -> dict[str, Any]:
        if cuda:
            return time_cuda(f, iters=10, warmup=2, graph=True)
        t = time.perf_counter()
        f()
        return {"ms": (time.perf_counter() - t) * 1e3, "mode": "cpu"}

    for rows in rows_list:
        h = torch.randn(rows, HC, dim, generator=gen, device=device).to(torch.bfloat16)
        want = torch_form(h, fn)
        nbytes = h.numel() * 2 + fn.numel() * 4 + want.numel() * 4
        floor_ms = nbytes / (ceil["copy_TBps"] * 1e9) if ceil else None
        cell: dict[str, Any] = {"rows": rows, "bytes": nbytes, "floor_ms": floor_ms}
        cell["torch"] = timed(lambda h=h: torch_form(h, fn))
        for tag, kw in [("default", {}), *((str(v), v) for v in variants)]:
            try:
                got = CK.hc_project(h, fn, NORM_EPS, **kw)
                t = timed(lambda h=h, kw=kw: CK.hc_project(h, fn, NORM_EPS, **kw))
            except Exception as e:  # a launch that does not compile or fit: say so, keep going
                cell.setdefault("errors", {})[tag] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            t["rel_err"] = float((got - want).norm() / want.norm())
            if floor_ms:
                t["floor_fraction"] = floor_ms / t["ms"]
            cell.setdefault("kernel", {})[tag] = t
        best = min(cell.get("kernel", {}).items(), key=lambda kv: kv[1]["ms"], default=None)
        if best:
            cell["best"] = best[0]
            log(
                f"hc_project rows={rows}: torch {cell['torch']['ms']:.3f} ms, default "
                f"{cell['kernel']['default']['ms']:.3f} ms, best {best[0]} {best[1]['ms']:.3f} ms"
                + (f" (floor {floor_ms:.3f} ms)" if floor_ms else "")
            )
        res["cells"].append(cell)
        record(name, res, started)
    combine_rows = [512, 4096, 16384] if cuda else [5, 9]
    res["moe_combine"] = combine_cells(combine_rows, dim, device, gen, ceil, timed)
    log("wrote", record(name, res, started))


if __name__ == "__main__":
    main()
