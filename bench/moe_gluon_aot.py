"""The Gluon MXFP4 expert GEMM (asympd/model/moe_gluon.py) compiled for Hopper on a CPU machine:
registers, shared memory and the hot loop's instructions per configuration, the count its design
is judged by before device time is spent (bench/attn_kernels_aot.py does the compiling).

Usage: ``python -m bench.moe_gluon_aot [--out moe_gluon_aot]`` (no GPU).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from triton.experimental.gluon._runtime import GluonASTSource

from asympd.model import moe_gluon as MG
from bench.attn_kernels_aot import compile_report
from bench.common import log, record

ARGS = [
    ("a_ptr", "*bf16"), ("a_rows_ptr", "*i64"), ("w_ptr", "*i8"), ("s_ptr", "*u8"), ("lut_ptr", "*i32"),
    ("y_ptr", "*bf16"), ("block_expert_ptr", "*i32"), ("block_row0_ptr", "*i32"), ("block_row1_ptr", "*i32"),
    ("N", "i32"), ("n_tiles", "i32"), ("n_blocks", "i32"),
    ("s_am", "i32"), ("s_we", "i64"), ("s_wt", "i32"), ("s_se", "i32"), ("s_st", "i32"), ("s_ym", "i32"),
]  # fmt: skip
ALIGNED = {"N", "s_am", "s_we", "s_wt", "s_se", "s_st", "s_ym"}
SHAPES = ((128, 4, 8), (128, 5, 8), (64, 4, 8), (32, 4, 8), (16, 4, 4))  # (T, stages, warps)
CONFIGS = [(t, s, w, a) for a in (True, False) for t, s, w in SHAPES]  # a: through shared memory
CONFIGS += [(t, s, w, False, 5120, True, True) for t, s, w in SHAPES]  # the table-free decode
CONFIGS += [(t, s, w, False, 5120, True, True, True) for t, s, w in SHAPES]  # its split-layout form
# the warp-specialized form with an expanding partition: (T, its warps)
WS_SMEM_A = ((16, 4), (32, 8), (64, 8), (64, 4), (128, 8), (128, 4))  # (and each with the split decode)


def report(
    block_t: int,
    stages: int,
    warps: int,
    a_smem: bool = True,
    k: int = 5120,
    gather: bool = True,
    exp: bool = False,
    split: bool = False,
    sub_tiles: int = 1,
    w_tiles: int = 1,
    overlap: bool = False,
    maxnreg: int | None = None,
) -> dict[str, Any]:
    """One launch of the w13 GEMM at V4.1's shapes (K 5120, 128-row tiles: 2 KB a 32-K step);
    ``exp``: the table-free decode, ``split`` its split-layout form, ``w_tiles`` weight tiles a program."""
    cons = dict(K=k, N_EXPERTS=384, GATHER=gather, W_STEP=2048, S_STEP=128)
    cons |= dict(BLOCK_T=block_t, STAGES=stages, A_SMEM=a_smem, LUT_REGS=True, TILES_INNER=True)
    cons |= dict(EXP_DECODE=exp or split, SPLIT=split, SUB_T=block_t // sub_tiles, W_TILES=w_tiles, OVERLAP=overlap)
    cons |= dict(num_warps=warps)
    row: dict[str, Any] = {"block_t": block_t, "stages": stages, "num_warps": warps, "a_smem": a_smem}
    row |= {"exponent_decode": exp or split, "split_layout": split, "sub_tiles": sub_tiles, "w_tiles": w_tiles}
    row |= {"overlap": overlap, "maxnreg": maxnreg}
    row |= {"k": k, "gather": gather}
    try:
        row |= compile_report(
            MG._mxfp4_moe_wgmma_kernel, ARGS, cons, warps, maxnreg=maxnreg, aligned=ALIGNED, source=GluonASTSource
        )
    except Exception as e:  # keep going: the report says which config failed
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def report_ws(
    block_t: int, stages: int = 4, k: int = 5120, smem_a: bool = False, decode_warps: int = 4, split: bool = False
) -> dict[str, Any]:
    """The warp-specialized form (``moe_gluon_ws``) of the same launch, at its launch registers
    (``smem_a``: with the expanding partition of ``decode_warps`` warps, ``SMEM_A``; ``split``: its
    split-layout decode)."""
    from asympd.model import moe_gluon_ws as WS

    if smem_a:
        maxnreg, mma_regs, decode_regs = WS.SMEM_A_REGISTERS[decode_warps]
    else:
        (maxnreg, mma_regs), decode_regs = WS.REGISTERS[block_t], 0
    cons = dict(K=k, N_EXPERTS=384, GATHER=True, W_STEP=2048, S_STEP=128, BLOCK_T=block_t, STAGES=stages)
    cons |= dict(TILES_INNER=True, MMA_REGS=mma_regs, num_warps=4, SMEM_A=smem_a, DECODE_REGS=decode_regs)
    cons |= dict(DECODE_WARPS=decode_warps, EXP_DECODE=split, SPLIT=split)
    row: dict[str, Any] = {"block_t": block_t, "stages": stages, "warp_specialized": True, "maxnreg": maxnreg}
    row |= {"smem_a": smem_a, "decode_warps": decode_warps if smem_a else None, "split_layout": split}
    try:
        row |= compile_report(
            WS._mxfp4_moe_ws_kernel, ARGS, cons, 4, maxnreg=maxnreg, aligned=ALIGNED, source=GluonASTSource
        )
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_gluon_aot")
    ap.add_argument("--ws-smem-a-only", action="store_true", help="only the expanding-partition form's rows")
    args = ap.parse_args()
    if args.ws_smem_a_only:
        started = time.time()
        rows = [report_ws(t, smem_a=True, decode_warps=w, split=sp) for sp in (False, True) for t, w in WS_SMEM_A]
        for row in rows:
            log(row)
        record(args.out, {"target": "sm_90", "rows": rows}, started)
        return
    started = time.time()
    rows = []
    for cfg in CONFIGS:
        rows.append(report(*cfg))
        log(rows[-1])
    for block_t in (64, 128):
        rows.append(report_ws(block_t))
        log(rows[-1])
    for split in (False, True):
        for block_t, decode_warps in WS_SMEM_A:
            rows.append(report_ws(block_t, smem_a=True, decode_warps=decode_warps, split=split))
            log(rows[-1])
    record(args.out, {"target": "sm_90", "rows": rows}, started)


if __name__ == "__main__":
    main()
