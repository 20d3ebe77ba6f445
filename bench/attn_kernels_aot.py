"""Compile the fused attention kernels (asympd/model/attn_kernels.py) for Hopper (sm_90) on any
machine, no GPU needed: registers, spills (stack bytes), shared memory, whether the GEMMs became
wgmma, and the compile time, for the configs bench/attn_kernels.py sweeps at true V4.1 shapes; for
the indexer also the hot loop's instructions, barriers and spill loads/stores per warp and tile.
Uses the ptxas and cuobjdump that Triton's wheel carries. A quick check before spending device time.

    TRITON_CACHE_DIR=$(mktemp -d) python -m bench.attn_kernels_aot   # JSON to bench/results/
    ... -m bench.attn_kernels_aot --versions 3,4 --no-attention --jobs 2   # the indexer's last two
(a fresh cache, or the compile times are cache hits). A run limited by the flags records the same
file: name a partial run's file with ``--out`` to keep the full run's JSON.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from asympd.config import v41_flash
from asympd.model import attn_kernels as AK
from bench.common import log, record

TARGET = GPUTarget("cuda", 90, 32)

INDEXER_ARGS = [
    ("q_ptr", "*bf16"), ("w_ptr", "*bf16"), ("kpool_ptr", "*bf16"), ("tables_ptr", "*i32"), ("row_seq_ptr", "*i32"),
    ("tile_row0_ptr", "*i64"), ("tile_rows_ptr", "*i32"), ("vis_ptr", "*i32"), ("cand_ptr", "*u8"),
    ("bmax_ptr", "*fp32"), ("buf_ptr", "*i64"), ("out_ptr", "*i64"), ("s_qr", "i32"), ("s_qh", "i32"),
    ("s_wr", "i32"), ("s_kb", "i32"), ("s_ke", "i32"), ("s_ts", "i32"), ("s_cr", "i32"), ("s_br", "i32"),
    ("n_bmax", "i32"), ("EPB", "i32"), ("K", "i32"),
]  # fmt: skip
# version 3 also takes each row's buffer counter (claimed by atomics) after out_ptr
INDEXER_V3_ARGS = INDEXER_ARGS[:12] + [("cnt_ptr", "*i32")] + INDEXER_ARGS[12:]
ATTN_ARGS = [
    ("q_ptr", "*bf16"), ("win_ptr", "*bf16"), ("new_ptr", "*bf16"), ("widx_ptr", "*i64"), ("sel_ptr", "*i64"),
    ("pool_ptr", "*bf16"), ("tables_ptr", "*i32"), ("row_seq_ptr", "*i32"), ("sink_ptr", "*fp32"),
    ("out_ptr", "*bf16"), ("s_qr", "i32"), ("s_qh", "i32"), ("s_wn", "i32"), ("s_nn", "i32"), ("s_wir", "i32"),
    ("s_sr", "i32"), ("s_pb", "i32"), ("s_pe", "i32"), ("s_ts", "i32"), ("s_or", "i32"), ("s_oh", "i32"),
    ("NH", "i32"), ("EPB", "i32"), ("scale", "fp32"),
]  # fmt: skip
# attention version 5 (Gluon) takes the pool offsets resolved: no tables, row map or block shape
GLUON_ATTN_ARGS = {n for n, _ in ATTN_ARGS} - {"tables_ptr", "row_seq_ptr", "s_pb", "s_pe", "s_ts", "EPB"}


# integer arguments a launch at true shapes passes as multiples of 16 (strides of 128-wide rows,
# 256-entry blocks, k = 512): the JIT specializes them, and pointers, as 16-divisible, which
# decides whether loads become cp.async (pipelined) and how many registers the kernel takes
ALIGNED = {"s_qr", "s_qh", "s_wr", "s_kb", "s_ke", "s_ts", "EPB", "K", "s_wn", "s_nn", "s_wir", "s_sr", "s_pb",
           "s_pe", "s_or", "s_oh", "NH"}  # fmt: skip


def hot_loop(sass: str) -> dict[str, int]:
    """The innermost loop holding the tile GEMM (the smallest backward branch's body with an
    HGMMA / HMMA): its instructions and block barriers per warp and pass (a branch inside counts
    whole: an upper bound on the path taken)."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] | None = None
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in where:
            body = [x for _, x in ins[where[int(m.group(1), 16)] : i + 1]]
            if any("GMMA" in x or "HMMA" in x for x in body) and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        return {}
    ops = [x.split()[1] if x.startswith("@") else x.split()[0] for x in best]
    return {
        "hot_loop_instructions": len(best),
        "hot_loop_wgmma": sum(o.startswith("HGMMA") for o in ops),
        "hot_loop_prmt": ops.count("PRMT"),
        "hot_loop_lop3": sum(o.startswith("LOP3") for o in ops),
        "hot_loop_sts": sum(o.startswith("STS") for o in ops),
        "hot_loop_barriers": sum("BAR.SYNC" in x for x in best),
        # waits for the loop's wgmmas: all of them (0 groups left in flight) or some
        "hot_loop_full_waits": sum(bool(re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b", x)) for x in best),
        "hot_loop_partial_waits": sum(bool(re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[1-9a-f]", x)) for x in best),
        # register copies (of constants or uniform values) the loop pays each pass
        "hot_loop_moves": sum(bool(re.match(r"(IMAD\.(U32|MOV\.U32)\s+R\d+, RZ, RZ,|MOV\s)", x.strip())) for x in best),
        # spills the loop pays each pass (local-memory loads and stores), not just somewhere
        "hot_loop_spill_ops": sum(bool(re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b", x.strip())) for x in best),
    }


def compile_report(
    fn,
    args: list[tuple[str, str]],
    constexprs: dict[str, Any],
    num_warps: int,
    maxnreg: int | None = None,
    num_stages: int | None = None,
    aligned: set[str] = ALIGNED,
    source: type = ASTSource,
) -> dict[str, Any]:
    """Compile ``fn`` for sm_90 and count what matters in its PTX and SASS. ``aligned``: the
    integer arguments a true launch passes as multiples of 16; ``source``: ``GluonASTSource`` for
    a Gluon kernel."""
    sig = dict(args) | {name: "constexpr" for name in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(args) if t.startswith("*") or n in aligned}
    t0 = time.time()
    options: dict[str, Any] = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    options |= {"num_stages": num_stages} if num_stages else {}
    k = triton.compile(source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                       options=options)  # fmt: skip
    out: dict[str, Any] = {"compile_s": round(time.time() - t0, 1), "shared_bytes": k.metadata.shared}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    for field in usage.split():
        name, _, value = field.partition(":")
        if name in ("REG", "STACK", "LOCAL") and value.isdigit():
            out[name.lower()] = int(value)
    ptx = k.asm["ptx"]
    out["wgmma"] = ptx.count("wgmma.mma_async")
    out["mma_sync"] = ptx.count("mma.sync")
    out["cp_async"] = k.asm["ttgir"].count("async_copy_global_to_local")  # pipelined loads
    out["scalar_b16_loads"] = ptx.count("ld.global.b16")  # two bytes a load: an unaligned (unhinted) gather
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        out |= hot_loop(subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout)
    return out


# (version, rows per tile, entries per tile, Triton's sort, warps, maxnreg). Version 4 is version
# 3's kernel at its own launch: 4 rows and 64 entries a tile, ptxas capped at V4_MAXNREG registers;
# 8 rows a tile under the cap is reported too (it spills inside the tile loop: why v4 takes 4)
INDEXER_CONFIGS = [
    (1, 4, 128, False, 8, None), (2, 4, 128, False, 8, None), (2, 8, 64, False, 8, None),
    (3, 4, 128, False, 8, None), (3, 8, 64, False, 8, None), (4, 4, AK.V4_BLOCK_N, False, 8, AK.V4_MAXNREG),
    (4, 8, AK.V4_BLOCK_N, False, 8, AK.V4_MAXNREG),
]  # fmt: skip
INDEXER_KINDS = {"index": (False, 0), "cand_source": (False, -1), "reindex": (True, 0)}  # -1: L20's block


def indexer_row(kind: str, config: tuple) -> dict[str, Any]:
    """One indexer config's compile report (a process of its own when ``--jobs`` > 1)."""
    cfg = v41_flash()
    version, bm, bn, tl_sort, warps, maxnreg = config
    cand, bmax = INDEXER_KINDS[kind]
    bmax = cfg.candidate_block_size if bmax < 0 else bmax
    kp = 1 << max(4, (cfg.index_topk - 1).bit_length())
    cons = dict(
        H=cfg.index_n_heads, D=cfg.index_head_dim, BM=bm, BN=bn, KP=kp, LOG_BM=bm.bit_length() - 1,
        LOG_KP=kp.bit_length() - 1, HAS_CAND=cand, CAND_BLOCK=cfg.candidate_block_size, BMAX=bmax,
        ROUND_BF16=True, DOT_F32=False, TL_SORT=tl_sort, PIPELINE=True,
    )  # fmt: skip
    fn, args = AK._indexer_topk_kernel, INDEXER_ARGS
    if version == 2:
        cons["NSLICE"] = AK.NSLICE
        fn = AK._indexer_topk_kernel_v2
    if version >= 3:  # as a launch at true shapes: 256-entry blocks, bf16 throughout
        cons |= dict(NSLICE=AK.NSLICE, IN_BLOCK=True, BF16X2=True)
        fn, args = AK._indexer_topk_kernel_v3, INDEXER_V3_ARGS
    row = {"kernel": "indexer_topk", "version": version, "kind": kind, "rows_per_tile": bm, "block_n": bn,
           "tl_sort": tl_sort, "num_warps": warps, "maxnreg": maxnreg}  # fmt: skip
    try:
        row |= compile_report(fn, args, cons, warps, maxnreg)
    except Exception as e:  # keep going: the report says which config failed
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def attention_gluon_row() -> dict[str, Any]:
    """Attention version 5 (``attn_gluon``, Gluon) compiled as the engine launches it at true shapes."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from asympd.model import attn_gluon

    cfg = v41_flash()
    args = [(n, t) for n, t in ATTN_ARGS if n in GLUON_ATTN_ARGS]
    cons = dict(W=cfg.window_size, KSEL=cfg.index_topk, D=cfg.head_dim, TWO_WIN=True, ALIGN=8)
    row: dict[str, Any] = {"kernel": "sparse_attention_paged", "version": 5, "block_h": 64, "block_n": 64}
    try:
        row |= compile_report(
            attn_gluon._sparse_attn_gluon_kernel, args, cons | {"num_warps": attn_gluon.NUM_WARPS},
            attn_gluon.NUM_WARPS, source=GluonASTSource,
        )  # fmt: skip
    except Exception as e:  # keep going: the report says it failed
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def attention_row(version: int, block_h: int, block_n: int, num_stages: int, num_warps: int = 8) -> dict[str, Any]:
    """One attention launch's compile report, as the engine launches it at true shapes: two window
    sources (ring buffer and this step's rows), a bf16 pool, 16-byte-aligned offsets for version 3."""
    cfg = v41_flash()
    cons = dict(W=cfg.window_size, KSEL=cfg.index_topk, D=cfg.head_dim, BH=block_h, BN=block_n, ROUND_PROBS=True,
                DOT_F32=False, SEL_OFFSETS=version >= 2, TWO_WIN=True, ALIGN=8 if version == 3 else 1,
                ACC_IN_DOT=version == 3)  # fmt: skip
    row = {"kernel": "sparse_attention_paged", "version": version, "block_h": block_h, "block_n": block_n,
           "num_stages": num_stages, "num_warps": num_warps}  # fmt: skip
    try:
        row |= compile_report(AK._sparse_attn_kernel, ATTN_ARGS, cons, num_warps, num_stages=num_stages)
    except Exception as e:  # keep going: the report says which config failed
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", default="1,2,3,4", help="indexer versions to compile")
    ap.add_argument("--no-attention", action="store_true", help="the indexer only")
    ap.add_argument("--jobs", type=int, default=1, help="compiles at once (processes; compile_s then overlaps)")
    ap.add_argument("--out", default="attn_kernels_aot", help="the JSON's name under bench/results/")
    args = ap.parse_args()
    started = time.time()
    versions = {int(v) for v in args.versions.split(",") if v}
    todo = [(kind, c) for kind in INDEXER_KINDS for c in INDEXER_CONFIGS if c[0] in versions]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows: list[dict[str, Any]] = []
        for row in pool.map(indexer_row, *zip(*todo, strict=True)):
            rows.append(row)
            log(row)
    if args.no_attention:
        todo_attn: tuple = ()
    else:
        # each version's default, then version 3's launches bench/attn_kernels.py sweeps
        # (and 64-key tiles, which do not fit: the shared memory they ask for, the spills at one stage)
        todo_attn = ((1, 16, 32, 3, 8), (2, 64, 16, 3, 8), (3, 64, 16, 3, 8), (3, 64, 16, 2, 8), (3, 64, 32, 2, 8),
                     (3, 64, 32, 3, 8), (3, 64, 64, 2, 8), (3, 64, 64, 1, 8))  # fmt: skip
    for version, bh, bn, stages, warps in todo_attn:
        rows.append(attention_row(version, bh, bn, stages, warps))
        log(rows[-1])
    if todo_attn:
        rows.append(attention_gluon_row())
        log(rows[-1])
    log("wrote", record(args.out, {"target": "sm_90", "triton": triton.__version__, "kernels": rows}, started))


if __name__ == "__main__":
    main()
