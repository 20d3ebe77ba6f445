"""The released weight formats on the GPU: packed MXFP4 experts and FP8-tile linears against the
bf16 path they replace, each as a fraction of its floor, in one device call.

Floors count the bytes the release format needs (FP4 experts 0.53 B/weight, FP8 matrices 1.001
B/weight, plus activations read and written once) over the copy bandwidth measured in this run,
and the FLOPs over the FP8 dense GEMM rate measured in this run; the larger is the floor. The bf16
variant's own floor (2 B/weight, bf16 rate) is reported beside it, and the gain as one ratio.

    python bench/formats.py              # on the device; writes bench/results/formats.json
    ASYMPD_BENCH_MOE_VARIANTS=1 python bench/formats.py   # MXFP4 kernel variants side by side ->
                                                          # bench/results/formats_moe_variants.json
    ASYMPD_BENCH_SASS=1 python bench/formats.py           # no GPU: the MXFP4 kernels' SASS loop counts
    ASYMPD_BENCH_MOE_VARIANTS=1 python bench/formats.py --smoke   # the variants mode on CPU, tiny config
    ASYMPD_BENCH_ONLY=linears python bench/formats.py     # the FP8-tile kernels (first, transposed)
                                                          # vs bf16 -> bench/results/formats_linears.json
    ASYMPD_BENCH_ONLY=linears python bench/formats.py --smoke     # the same on CPU, small matrices

The FP8-tile linears (``linears``) are timed through each kernel of ``fp8_tile_gemm`` (the first one,
the transposed decode-regime one and its variants) beside cuBLAS on the bf16 expansion. Their floor is
the bytes alone at decode sizes (e4m3 weights + UE8M0 tiles + bf16 activations in and out), which for
the small matrices (1-7 MB) is 0.3-2 us: about what one kernel launch costs. So each row also carries
``launch_ms`` (an empty Triton kernel, timed the same way: graph replays, per call) and
``launch_bound`` (the floor is below it): there no single-kernel GEMM can reach the floor, and
``frac_of_floor_plus_launch`` is the fair fraction.

What is timed is the product's code: ``FastMoE`` as the loader builds it (``FastMoE.packed``) and
``gemm_kernels.fp8_tile_gemm``, the kernel behind ``FP8TileLinear``. Timings are medians of CUDA
event times; "graph" numbers replay one captured call (kernel time without launch gaps), "eager"
numbers are what an uncaptured step pays.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # on CPU through the Triton interpreter: plumbing only
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.config import v41_flash  # noqa: E402
from asympd.model import gemm_kernels as G  # noqa: E402
from asympd.model.cuda_ops import FastMoE  # noqa: E402
from asympd.model.packed import FP8TileLinear, PackedExperts  # noqa: E402
from asympd.model.quant import dequant_fp8_tiles, fp8_qdq, quant_fp8_tiles  # noqa: E402
from bench.common import ceilings, log, record, time_cuda  # noqa: E402

if G.AVAILABLE:
    import triton  # noqa: E402

    @triton.jit
    def _empty_kernel(x_ptr):
        """Does nothing: what a launch alone costs (``_launch_ms``)."""
        pass


DEV = torch.device("cuda")
BF = torch.bfloat16
ROWS_SWEEP = (16, 512, 16384)
FP8_SWEEP = (("wq_b", 32768, 1280), ("wo_b", 5120, 8192), ("wq_a", 1280, 5120))
MOE_ROWS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
MOE_VARIANT_ROWS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# the MXFP4 GEMMs' kernel configs timed side by side (gemm_kernels.mxfp4_moe_gemm): the default
# kernels (``current`` runs the transposed ``swap_ab`` kernel for M-blocks <= 32 rows on CUDA, the
# first kernel above), and the experts in the tiled layout
# (``tiled``: gemm_kernels.tile_fp4, one contiguous run per program and 32-K step instead of
# half-sectors of rows 2.5 KB apart), alone, capped at 72 registers (7 programs an SM instead of
# 6; no spills offline), and with the whole unrolled step as one dot (``wide``: one activation
# tile staged per two scale blocks); the FP8 kernel on both layouts. ``tiled`` is the bench's key
# (the layout is the operand's), not a kernel config. Earlier variants (``lut_pairs``, unroll 4)
# are in formats_moe_variants.json at 75972d4 / b118c33.
MOE_VARIANTS = {
    "current": {},
    "swap_ab_tiled": {"swap_ab": True, "tiled": True},
    "swap_ab_tiled_r72": {"swap_ab": True, "tiled": True, "maxnreg": 72},
    "swap_ab_wide_tiled": {"swap_ab": True, "wide": True, "tiled": True},
    "fp8": {"fp8": True},
    "fp8_tiled": {"fp8": True, "tiled": True},
}
# above 2048 rows (M-blocks of 64 and 128 rows: prefill chunks) only these are timed: the default
# (the first kernel there) on both layouts, with the shorter decode (offline at BM 128, 8 warps:
# 232 instead of 290 loop instructions), and the transposed kernel with 8 warps (the expanded
# weights stay in registers instead of going through shared memory, 64 2-byte STS an iteration at
# BM 64: the profile's mio_throttle; offline 6.9 / 7.4 instructions a weight against 8.3 / 9.1,
# 90 / 134 registers). The FP8 kernel there was measured at b118c33 (0.95-1.04x).
MOE_LARGE_VARIANTS = ("current", "current_tiled", "current_tiled_lut_pairs", "swap_ab_tiled_w8")
MOE_VARIANTS["current_tiled"] = {"tiled": True}
MOE_VARIANTS["current_tiled_lut_pairs"] = {"tiled": True, "lut_pairs": True}
MOE_VARIANTS["swap_ab_tiled_w8"] = {"swap_ab": True, "tiled": True, "num_warps": 8}
# Triton's tl.dot_scaled (gemm_kernels._mxfp4_moe_scaled_kernel: Triton upcasts the e2m1 weights in
# the MMA operand's layout), on the product's (tiled) layout, timed at every size beside ``current``:
# ``scaled_swap`` the weight as wgmma's register operand (decode), ``scaled`` the activations as A
# (prefill). CUDA only (the interpreter has no dot_scaled): skipped by --smoke.
MOE_VARIANTS["scaled_swap"] = {"scaled_swap": True, "tiled": True}
MOE_VARIANTS["scaled"] = {"scaled": True, "tiled": True}
# the same reading the experts in the release's nibble order (``natural``: unrepack_fp4 of the tiles,
# a layout the loader could build instead), so no shuffle in registers before the upcast
MOE_VARIANTS["scaled_swap_natural"] = {"scaled_swap": True, "tiled": True, "natural": True}
MOE_VARIANTS["scaled_natural"] = {"scaled": True, "tiled": True, "natural": True}
MOE_EVERY_SIZE = ("current", "scaled_swap", "scaled", "scaled_swap_natural", "scaled_natural")
LINEAR_ROWS = [1, 16, 64, 256, 1024]
# (name, out, in, groups): the FP8-stored matrices of one V4.1 layer (attention, indexer, shared expert)
LINEARS = [
    ("wq_a", 1280, 5120, 1),
    ("wq_b", 32768, 1280, 1),
    ("wkv", 512, 5120, 1),
    ("wo_a", 8192, 4096, 8),
    ("wo_b", 5120, 8192, 1),
    ("idx_wq_b", 4096, 1280, 1),
    ("shared_w13", 4608, 5120, 1),
    ("shared_w2", 5120, 2304, 1),
]


def _time(fn, **kw) -> dict:
    """``time_cuda`` on the device; on CPU (``--smoke``) one call's wall time, for the plumbing."""
    if DEV.type == "cpu":
        t0 = time.perf_counter()
        fn()
        return {"ms": (time.perf_counter() - t0) * 1e3, "mode": "cpu-wall"}
    return time_cuda(fn, **kw)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_fp4_experts(n_exp: int, n: int, k: int, g: torch.Generator) -> PackedExperts:
    """Random codes (every e2m1 value) with UE8M0 scales around 2^-7, the magnitude of N(0, 0.02)
    weights' per-32 block maxima over FP4's 6."""
    w = torch.randint(-128, 128, (n_exp, n, k // 2), dtype=torch.int8, device=DEV, generator=g)
    s = torch.randint(118, 123, (n_exp, n, k // 32), dtype=torch.uint8, device=DEV, generator=g)
    return PackedExperts(w, s)


def random_fp8(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_fp8_tiles(torch.randn(n, k, device=DEV, generator=g) * 0.02)


def dequant_experts(p: PackedExperts) -> torch.Tensor:
    out = torch.empty(p.weight.size(0), p.weight.size(1), p.weight.size(2) * 2, dtype=BF, device=DEV)
    for e in range(p.weight.size(0)):
        out[e] = p.dequantized(e).to(BF)
    return out


def build_moes(cfg, g: torch.Generator) -> tuple[FastMoE, FastMoE]:
    """One V4.1 MoE layer twice over the same weights: packed (as the loader builds it on CUDA) and
    dequantized to bf16 (the path it replaces)."""
    n_exp, d, inter = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim
    gate_w = (torch.randn(n_exp, d, device=DEV, generator=g) * 0.02).to(BF).float()
    gate = {"weight": gate_w, "bias": torch.randn(n_exp, device=DEV, generator=g) * 1e-3}
    w13 = random_fp4_experts(n_exp, 2 * inter, d, g)
    w2 = random_fp4_experts(n_exp, d, inter, g)
    q13, s13 = random_fp8(2 * inter, d, g)
    q2, s2 = random_fp8(d, inter, g)
    packed = FastMoE.packed(
        cfg,
        0,
        gate,
        w13,
        w2,
        FP8TileLinear(q13, s13, quantized=False, dtype=BF),
        FP8TileLinear(q2, s2, quantized=False, dtype=BF),
    )
    bf16 = FastMoE.packed(cfg, 0, gate, w13, w2, packed.s13, packed.s2)
    bf16.w13, bf16.w2f = dequant_experts(w13), dequant_experts(w2)
    for name, (q, s) in (("s13", (q13, s13)), ("s2", (q2, s2))):
        bf16._modules.pop(name)  # the packed twin registered them as submodules
        setattr(bf16, name, dequant_fp8_tiles(q, s).to(BF))
    bf16.experts = "bf16"
    return packed, bf16


def moe_floor(cfg, rows: int, touched: int, ceil: dict, bytes_per_weight: float, rate: float) -> dict:
    per_expert = 3 * cfg.dim * cfg.moe_inter_dim
    wbytes = (touched + 1) * per_expert * bytes_per_weight + cfg.n_routed_experts * cfg.dim * 2  # + shared, gate
    act = rows * cfg.dim * 2 * 2
    flops = rows * (cfg.n_activated_experts + 1) * per_expert * 2 + rows * cfg.dim * cfg.n_routed_experts * 2
    t_bytes = (wbytes + act) / (ceil["copy_TBps"] * 1e12) * 1e3
    t_flops = flops / (rate * 1e12) * 1e3
    return {"floor_ms": max(t_bytes, t_flops), "bytes_ms": t_bytes, "flops_ms": t_flops, "bytes": wbytes + act}


FP4_BYTES = 0.5 + 1 / 32  # packed codes + one UE8M0 per 32
FP8_BYTES = 1 + 1 / 1024  # e4m3 + one UE8M0 per 32x32 tile


def bench_moe(cfg, ceil: dict, g: torch.Generator) -> list[dict]:
    packed, bf16 = build_moes(cfg, g)
    log(f"moe layer built: packed {packed.w13.nbytes() + packed.w2f.nbytes():.3e} B of experts")
    fp8_rate = ceil.get("fp8_gemm_TFLOPs", ceil["bf16_gemm_TFLOPs"])
    out = []
    for rows in MOE_ROWS:
        x = torch.randn(rows, cfg.dim, device=DEV, generator=g).to(BF)
        _, ids = packed.route(x)
        touched = int(torch.unique(ids).numel())
        ref, got = bf16(x), packed(x)
        err = rel(got, ref)
        row = {"rows": rows, "experts_touched": touched, "rel_err_vs_bf16": err}
        for name, moe, bpw, rate in (("mxfp4", packed, FP4_BYTES, fp8_rate), ("bf16", bf16, 2.0, None)):
            fl = moe_floor(cfg, rows, touched, ceil, bpw, rate or ceil["bf16_gemm_TFLOPs"])
            eager = time_cuda(lambda m=moe, x=x: m(x), iters=10, warmup=2)
            graph = time_cuda(lambda m=moe, x=x: m(x), iters=10, warmup=1, graph=True)
            row[name] = {
                "eager_ms": eager["ms"],
                "graph_ms": graph["ms"],
                "graph_mode": graph["mode"],
                **fl,
                "frac_of_floor": fl["floor_ms"] / graph["ms"],
            }
        # the packed path against the release-format floor (FP8 rate), as the issue counts it
        row["mxfp4_frac_of_release_floor"] = row["mxfp4"]["frac_of_floor"]
        row["speedup_vs_bf16"] = row["bf16"]["graph_ms"] / row["mxfp4"]["graph_ms"]
        out.append(row)
        log(
            f"moe rows {rows:6d} touched {touched:3d} | mxfp4 {row['mxfp4']['graph_ms']:8.3f} ms "
            f"({100 * row['mxfp4']['frac_of_floor']:5.1f}% floor) | bf16 {row['bf16']['graph_ms']:8.3f} ms "
            f"({100 * row['bf16']['frac_of_floor']:5.1f}% own floor) | x{row['speedup_vs_bf16']:.2f} | err {err:.1e}"
        )
        del x
    del packed, bf16
    torch.cuda.empty_cache()
    return out


class _Configured:
    """A ``PackedExperts`` whose GEMMs run with one kernel config: how one ``FastMoE`` is timed
    per variant without touching the model code."""

    def __init__(self, experts: PackedExperts, config: dict):
        self.experts, self.config = experts, config

    def __getattr__(self, name: str):
        return getattr(self.experts, name)

    def matmul(self, a, blocks, rows, block_m, a_rows, config=None):
        return self.experts.matmul(a, blocks, rows, block_m, a_rows, self.config)


def _gemm_floor(touched: int, rows: int, n: int, k: int, ceil: dict, fp8_rate: float) -> float:
    """One expert GEMM's floor (ms): the touched experts' FP4 bytes over the copy rate, or its
    FLOPs at the FP8 rate."""
    t_bytes = touched * n * k * FP4_BYTES / (ceil["copy_TBps"] * 1e12)
    return max(t_bytes, 2 * rows * n * k / (fp8_rate * 1e12)) * 1e3


def bench_moe_variants(cfg, ceil: dict, g: torch.Generator) -> list[dict]:
    """The MXFP4 kernel variants (``MOE_VARIANTS``) in one run at decode sizes: the whole MoE
    sublayer (graph replays) against its release-format floor, and each expert GEMM alone against
    its own floor (the touched experts' FP4 bytes over the copy rate, or its FLOPs at the FP8
    rate), with every variant's speed-up over ``current`` and its error against the bf16 path."""
    from asympd.model.packed import moe_block_m

    packed, bf16 = build_moes(cfg, g)
    w13, w2 = packed.w13, packed.w2f
    # the tiled layout's copies of the same experts (the product holds one layout: packed.TILE_N)
    tiled = {False: (w13, w2), True: (w13.tiled(), w2.tiled())}
    natural: dict[int, tuple[PackedExperts, PackedExperts]] = {}  # release nibble order, by layout
    fp8_rate = ceil.get("fp8_gemm_TFLOPs", ceil["bf16_gemm_TFLOPs"])
    n_exp, k_top, d, inter = cfg.n_routed_experts, cfg.n_activated_experts, cfg.dim, cfg.moe_inter_dim
    out = []
    for rows in MOE_VARIANT_ROWS:
        x = torch.randn(rows, d, device=DEV, generator=g).to(BF)
        _, ids = packed.route(x)
        flat = ids.reshape(-1)
        touched = int(torch.unique(flat).numel())
        bm = moe_block_m(flat.numel(), n_exp)
        order, *blocks = G.moe_blocks(flat, n_exp, bm)
        token, r = order // k_top, flat.numel()
        xq = fp8_qdq(x.float(), 32).to(BF)
        h = fp8_qdq(torch.randn(r, inter, device=DEV, generator=g), 32).to(BF)
        ref = bf16(x)
        floor = moe_floor(cfg, rows, touched, ceil, FP4_BYTES, fp8_rate)["floor_ms"]
        f13, f2 = (_gemm_floor(touched, r, n, k, ceil, fp8_rate) for n, k in ((2 * inter, d), (d, inter)))
        row: dict = {"rows": rows, "experts_touched": touched, "block_m": bm, "moe_floor_ms": floor}
        row.update({"w13_floor_ms": f13, "w2_floor_ms": f2})
        # bf16 beside them (the path the packed one replaces), against its own floor, so every
        # variant's gain over it is one ratio
        bf_ms = _time(lambda m=bf16, x=x: m(x), iters=10, warmup=1, graph=True)["ms"]
        bf_floor = moe_floor(cfg, rows, touched, ceil, 2.0, ceil["bf16_gemm_TFLOPs"])["floor_ms"]
        row["bf16"] = {"moe_graph_ms": bf_ms, "frac_of_own_floor": bf_floor / bf_ms, "own_floor_ms": bf_floor}
        row["bf16"]["frac_of_release_floor"] = floor / bf_ms
        large = set(MOE_LARGE_VARIANTS)
        every = set(MOE_EVERY_SIZE)
        names = [v for v in MOE_VARIANTS if v in every or (v in large if rows > 2048 else v not in large)]
        first = None
        for name in names:
            conf = dict(MOE_VARIANTS[name])
            e13, e2 = tiled[conf.pop("tiled", False)]
            if DEV.type != "cuda" and (conf.get("scaled") or conf.get("scaled_swap")):
                row[name] = {"config": MOE_VARIANTS[name], "skipped": "tl.dot_scaled runs on CUDA only"}
                continue
            if conf.get("natural"):  # the same tiles, each 16-byte block in the release's nibble order
                if id(e13) not in natural:  # built once, on first use (CUDA only: skipped above on CPU)
                    natural[id(e13)] = tuple(PackedExperts(G.unrepack_fp4(e.weight), e.scale) for e in (e13, e2))
                e13, e2 = natural[id(e13)]
            packed.w13, packed.w2f = _Configured(e13, conf), _Configured(e2, conf)
            try:
                y = packed(x)
                first = y if first is None else first
                timed = _time(lambda m=packed, x=x: m(x), iters=10, warmup=1, graph=True)
                moe = timed["ms"]
                t13 = _time(
                    lambda c=conf, b=blocks, t=token, a=xq, r=r, bm=bm, w=e13: w.matmul(a, b, r, bm, t, c),
                    iters=10,
                    warmup=1,
                    graph=True,
                )["ms"]
                t2 = _time(
                    lambda c=conf, b=blocks, a=h, r=r, bm=bm, w=e2: w.matmul(a, b, r, bm, None, c),
                    iters=10,
                    warmup=1,
                    graph=True,
                )["ms"]
                row[name] = {
                    "config": MOE_VARIANTS[name],
                    "mode": timed["mode"],
                    "moe_graph_ms": moe,
                    "moe_frac_of_release_floor": floor / moe,
                    "w13_ms": t13,
                    "w13_frac_of_floor": f13 / t13,
                    "w2_ms": t2,
                    "w2_frac_of_floor": f2 / t2,
                    "rel_err_vs_bf16": rel(y, ref),
                    "rel_err_vs_current": rel(y, first),
                    "speedup_vs_bf16": bf_ms / moe,
                }
            except Exception as ex:  # a variant that does not compile or run: keep the others
                row[name] = {"config": MOE_VARIANTS[name], "error": f"{type(ex).__name__}: {str(ex)[:300]}"}
        packed.w13, packed.w2f = w13, w2
        cur = row["current"]
        log(
            f"moe variants rows {rows:5d} bm {bm:3d} touched {touched:3d} | bf16               moe {bf_ms:.3f} ms "
            f"({100 * floor / bf_ms:4.1f}% release floor, {100 * bf_floor / bf_ms:4.1f}% own floor)"
        )
        for name in names:
            v = row[name]
            if name != "current" and "moe_graph_ms" in v and "moe_graph_ms" in cur:
                keys = {"moe": "moe_graph_ms", "w13": "w13_ms", "w2": "w2_ms"}
                row[f"{name}_speedup"] = {k: cur[ms] / v[ms] for k, ms in keys.items()}
            log(
                f"moe variants rows {rows:5d} bm {bm:3d} touched {touched:3d} | {name:18s} "
                + (
                    v.get("error", f"skipped: {v.get('skipped')}")
                    if "moe_graph_ms" not in v
                    else f"moe {v['moe_graph_ms']:.3f} ms ({100 * v['moe_frac_of_release_floor']:4.1f}% floor) | "
                    f"w13 {v['w13_ms']:.3f} ms ({100 * v['w13_frac_of_floor']:4.1f}%) | "
                    f"w2 {v['w2_ms']:.3f} ms ({100 * v['w2_frac_of_floor']:4.1f}%) | err {v['rel_err_vs_bf16']:.1e} | "
                    f"x{v['speedup_vs_bf16']:.2f} vs bf16"
                )
            )
        out.append(row)
        del x, h
    del packed, bf16, tiled, natural
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return out


def fp8_accumulation_error(k: int, g: torch.Generator, rows: int = 64, n: int = 512) -> dict:
    """What the FP8 wgmma's accumulation inside a K = 32 block costs, at V4.1's K = 5120: the FP8
    kernel and the current one (fp32 activations and output, IEEE fp32 dots) against the float64
    GEMM on the dequantized weights, on 4 random experts of ``n`` rows (as the MoE benchmark draws
    them) and ``rows`` quantized random rows; the error of every output as a fraction of the sum of its terms'
    magnitudes (|a| @ |W|^T), and in norm."""
    from asympd.model.packed import moe_block_m

    w = random_fp4_experts(4, n, k, g)
    wd = torch.stack([w.dequantized(e) for e in range(4)]).double()
    x = fp8_qdq(torch.randn(rows, k, device=DEV, generator=g), 32)
    ids = torch.randint(0, 4, (rows,), device=DEV, generator=g)
    bm = moe_block_m(rows, 4)
    order, *blocks = G.moe_blocks(ids, 4, bm)
    e = ids[order]
    ref = torch.einsum("rk,rnk->rn", x[order].double(), wd[e])
    mag = torch.einsum("rk,rnk->rn", x[order].double().abs(), wd[e].abs())
    out = {"rows": rows, "n": n, "k": k, "block_m": bm}
    for name, conf in (("current", {"swap_ab": False}), ("fp8", {"fp8": True})):
        y = w.matmul(x, blocks, rows, bm, order, conf).double()
        err = (y - ref).abs()
        out[name] = {"max_err_over_magnitude": float((err / mag.clamp_min(1e-30)).max()), "rel_norm": rel(y, ref)}
    log(f"fp8 accumulation at K {k}: {out}")
    return out


# the FP8-tile kernels timed side by side (``gemm_kernels.fp8_tile_gemm`` configs): the first kernel,
# the transposed decode-regime one at its defaults, and (at <= 16 rows, where its default applies the
# tile scale after the dot) the same with the scale on the expanded weights, and the transposed one
# without the K permutation (``k_order``, its default at <= 32 rows), and with 64-row weight tiles
# (twice the programs, half the splits: the other side of the split-K trade) at <= 64 rows
LINEAR_KERNELS = {
    "old": {"swap_ab": False},
    "swap": {"swap_ab": True},
    "swap_scale_w": {"swap_ab": True, "scale_after": False},
    "swap_k_natural": {"swap_ab": True, "k_order": False},
    "swap_bn64": {"swap_ab": True, "block_n": 64},
}


def _launch_ms(copies: int) -> float:
    """What one launch alone costs, timed like the GEMMs: ``copies`` launches of an empty Triton
    kernel captured in one graph, per launch."""
    x = torch.zeros(1, device=DEV)

    def run(x=x):
        for _ in range(copies):
            _empty_kernel[(1,)](x)

    return _time(run, iters=10, warmup=2, graph=True)["ms"] / copies


def _linear_row(name, n, k_in, groups, m, ceil, fp8_rate) -> dict:
    """The floors of one FP8-tile GEMM: bytes (e4m3 weights + UE8M0 tiles + bf16 activations in
    and out) over the copy rate measured in this run, FLOPs over the FP8 (bf16) GEMM rate; the
    bf16 path's with 2 B a weight."""
    k = k_in // groups
    wbytes = n * k
    act = m * k_in * 2 + m * n * 2
    flops = 2 * m * n * k
    bw = ceil["copy_TBps"] * 1e12
    row = {"name": name, "out": n, "in": k_in, "groups": groups, "rows": m}
    row["fp8_bytes"] = wbytes * FP8_BYTES + act
    row["fp8_bytes_floor_ms"] = row["fp8_bytes"] / bw * 1e3
    row["fp8_flops_floor_ms"] = flops / (fp8_rate * 1e12) * 1e3
    row["fp8_floor_ms"] = max(row["fp8_bytes_floor_ms"], row["fp8_flops_floor_ms"])
    row["bf16_floor_ms"] = max((wbytes * 2 + act) / bw, flops / (ceil["bf16_gemm_TFLOPs"] * 1e12)) * 1e3
    return row


def bench_linears(ceil: dict, g: torch.Generator) -> list[dict]:
    """The FP8-stored matrices of a layer through each FP8-tile kernel (``LINEAR_KERNELS``; the
    transposed ones at <= ``SWAP_VARIANT_ROWS`` rows) and through cuBLAS on the bf16 expansion,
    each against its floor. Every call is timed as graph replays of ``copies`` calls over rotated
    weight copies (past the L2), per call; the cost of one launch alone (an empty kernel timed the
    same way) is reported beside it, and ``launch_bound`` says where the floor is below it (the
    small matrices: their floor is then out of any one-kernel GEMM's reach)."""
    fp8_rate = ceil.get("fp8_gemm_TFLOPs", ceil["bf16_gemm_TFLOPs"])
    out = []
    launch: dict[int, float] = {}
    for name, n, k_in, groups in LINEARS:
        k = k_in // groups if groups > 1 else k_in
        q, s = random_fp8(n, k, g)
        wd = dequant_fp8_tiles(q, s).to(BF)
        copies = max(1, min(32, math.ceil((256 << 20) / (n * k))))  # rotate past the 60 MB L2
        if DEV.type == "cpu":
            copies = 1
        qs = [(q.clone(), s.clone(), wd.clone()) for _ in range(copies)]
        if copies not in launch:
            launch[copies] = _launch_ms(copies)
        for m in LINEAR_ROWS:
            shape = (m, groups, k) if groups > 1 else (m, k)
            x = fp8_qdq(torch.randn(*shape, device=DEV, generator=g), 32).to(BF)
            if groups > 1:
                w3 = wd.view(groups, n // groups, -1)
                ref = torch.stack([x[:, i] @ w3[i].t() for i in range(groups)], 1)
            else:
                ref = x @ wd.t()
            row = _linear_row(name, n, k_in, groups, m, ceil, fp8_rate)
            row["launch_ms"] = launch[copies]
            row["launch_bound"] = row["fp8_floor_ms"] < row["launch_ms"]
            row["copies"] = copies
            kernels = [v for v in LINEAR_KERNELS if v == "old" or m <= G.SWAP_VARIANT_ROWS]
            limit = {"swap_scale_w": 16, "swap_k_natural": 32, "swap_bn64": 64}
            kernels = [v for v in kernels if m <= limit.get(v, m)]
            for kern in kernels:
                conf = LINEAR_KERNELS[kern]
                try:
                    y = G.fp8_tile_gemm(x, q, s, groups=groups, config=conf)

                    def run(x=x, qs=qs, groups=groups, conf=conf):
                        for qq, ss, _ in qs:
                            G.fp8_tile_gemm(x, qq, ss, groups=groups, config=conf)

                    ms = _time(run, iters=10, warmup=2, graph=True)["ms"] / copies
                    row[kern] = {
                        "config": conf,
                        "ms": ms,
                        "frac_of_floor": row["fp8_floor_ms"] / ms,
                        "frac_of_floor_plus_launch": (row["fp8_floor_ms"] + row["launch_ms"]) / ms,
                        "rel_err_vs_bf16": rel(y, ref),
                    }
                except Exception as ex:  # a variant that does not compile or run: keep the others
                    row[kern] = {"config": conf, "error": f"{type(ex).__name__}: {str(ex)[:300]}"}

            def run_bf16(x=x, qs=qs, groups=groups, n=n):
                for _, _, ww in qs:
                    if groups > 1:
                        w3 = ww.view(groups, n // groups, -1)
                        torch.bmm(x.transpose(0, 1), w3.transpose(1, 2))
                    else:
                        F.linear(x, ww)

            def run_dequant(x=x, qs=qs, groups=groups, n=n, k=k):
                # the large-M alternative: expand to a bf16 scratch, then cuBLAS
                for qq, ss, _ in qs:
                    wb = (qq.to(BF).view(n // 32, 32, k // 32, 32) * ss.float().to(BF)[:, None, :, None]).view(n, k)
                    if groups > 1:
                        torch.bmm(x.transpose(0, 1), wb.view(groups, n // groups, -1).transpose(1, 2))
                    else:
                        F.linear(x, wb)

            tb = _time(run_bf16, iters=10, warmup=2, graph=True)["ms"] / copies
            row["bf16"] = {"ms": tb, "frac_of_own_floor": row["bf16_floor_ms"] / tb}
            row["bf16"]["frac_of_fp8_floor"] = row["fp8_floor_ms"] / tb
            row["dequant_then_cublas_ms"] = _time(run_dequant, iters=10, warmup=2, graph=True)["ms"] / copies
            timed = [v for v in kernels if "ms" in row[v]]
            for v in timed:  # the gain over the bf16 path, as one ratio
                row[v]["speedup_vs_bf16"] = tb / row[v]["ms"]
            if timed:
                best = min(timed, key=lambda v: row[v]["ms"])
                row["best_fp8"] = best
                row["best_fp8_speedup_vs_bf16"] = tb / row[best]["ms"]
                row["best_fp8_frac_of_floor"] = row[best]["frac_of_floor"]
            if "ms" in row.get("swap", {}) and "ms" in row["old"]:
                row["swap_speedup_vs_old"] = row["old"]["ms"] / row["swap"]["ms"]
            out.append(row)
            cells = " | ".join(
                f"{v} {row[v]['ms'] * 1e3:7.1f} us ({100 * row[v]['frac_of_floor']:5.1f}%, "
                f"err {row[v]['rel_err_vs_bf16']:.0e})"
                if "ms" in row[v]
                else f"{v} {row[v]['error']}"
                for v in kernels
            )
            bound = " (launch-bound)" if row["launch_bound"] else ""
            log(
                f"{name:10s} rows {m:5d} | floor {row['fp8_floor_ms'] * 1e3:6.2f} us "
                f"launch {row['launch_ms'] * 1e3:5.2f} us{bound} | {cells} | bf16 {tb * 1e3:7.1f} us "
                f"({100 * row['bf16']['frac_of_own_floor']:5.1f}% own) | "
                f"dq+cublas {row['dequant_then_cublas_ms'] * 1e3:7.1f} us"
            )
        del qs
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return out


def bench_lm_head(cfg, ceil: dict, g: torch.Generator) -> list[dict]:
    """The LM head as the reference holds it (fp32) and as a bf16 GPU model holds it (the stored bf16
    values, fp32 accumulation: ``ops.lm_head``), over the rows that need logits."""
    from asympd.model.ops import lm_head

    head16 = (torch.randn(cfg.vocab_size, cfg.dim, device=DEV, generator=g) * 0.02).to(BF)
    head32 = head16.float()
    out = []
    for rows in (1, 64, 256, 1024):
        x = torch.randn(rows, cfg.dim, device=DEV, generator=g).to(BF)
        ref = lm_head(x.float(), head32)
        got = lm_head(x, head16)
        t32 = time_cuda(lambda x=x: lm_head(x.float(), head32), iters=10, warmup=2, graph=True)["ms"]
        t16 = time_cuda(lambda x=x: lm_head(x, head16), iters=10, warmup=2, graph=True)["ms"]
        floor16 = (
            max(
                head16.numel() * 2 / (ceil["copy_TBps"] * 1e12),
                2 * rows * head16.numel() / (ceil["bf16_gemm_TFLOPs"] * 1e12),
            )
            * 1e3
        )
        row = {
            "rows": rows,
            "fp32_ms": t32,
            "bf16_fp32acc_ms": t16,
            "speedup": t32 / t16,
            "bf16_frac_of_floor": floor16 / t16,
            "rel_err": rel(got, ref),
        }
        out.append(row)
        log(
            f"lm_head rows {rows:5d} | fp32 {t32:.3f} ms | bf16+fp32 acc {t16:.3f} ms "
            f"({100 * floor16 / t16:.0f}% floor) | x{t32 / t16:.1f} | err {row['rel_err']:.1e}"
        )
    return out


def bench_engram(cfg, g: torch.Generator) -> list[dict]:
    """Host-table lookups as the packed build does them: gather the FP8 rows on the host, copy them
    to the GPU. A 20M-row table (5 GB; the real ones have 384M rows) keeps the gather out of caches."""
    from asympd.model.engram import Engram

    rows_tab = 20_000_000
    d = cfg.engram_head_dim
    table = torch.randint(0, 120, (rows_tab, d), dtype=torch.uint8).view(torch.float8_e4m3fn).pin_memory()
    scale = torch.full((rows_tab, d // 32), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu).pin_memory()
    n_cols = cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1)
    e = Engram.__new__(Engram)
    torch.nn.Module.__init__(e)
    e.table, e.table_scale, e._stream = table, scale, None
    out = []
    for tokens in (1, 256, 4096, 16384):
        ids = torch.randint(0, rows_tab, (tokens, n_cols))
        t0 = time.perf_counter()
        for _ in range(3):
            f = e.fetch(ids, DEV)
            e.lookup(f)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 3 * 1e3
        mb = tokens * n_cols * (d + d // 32) / 1e6
        out.append({"tokens": tokens, "rows": tokens * n_cols, "MB": mb, "fetch_and_dequant_ms": ms})
        log(f"engram host lookup: {tokens:6d} tokens, {mb:7.1f} MB -> {ms:7.2f} ms (host gather + H2D + dequant)")
    return out


def _timed(fn) -> float | str:
    try:
        return time_cuda(fn, iters=10, warmup=2, graph=True)["ms"]
    except Exception as ex:  # a config that does not compile (shared memory, registers)
        return f"{type(ex).__name__}: {str(ex)[:80]}"


def sweep(cfg, ceil: dict, g: torch.Generator) -> dict:
    """Kernel configurations around the defaults, timed in this run (the next kernel round's data):
    the MoE gate/up GEMM over all 384 experts and two FP8 matrices, at decode and prefill sizes."""
    import itertools

    from asympd.model.packed import moe_block_m

    out: dict = {"moe_w13": [], "fp8": []}
    n_exp, d, inter, k = cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim, cfg.n_activated_experts
    w13 = random_fp4_experts(n_exp, 2 * inter, d, g)
    for rows in ROWS_SWEEP:
        x = fp8_qdq(torch.randn(rows, d, device=DEV, generator=g), 32).to(BF)
        ids = torch.stack([torch.randperm(n_exp, device=DEV, generator=g)[:k] for _ in range(rows)]).reshape(-1)
        n_routed = ids.numel()
        touched = int(torch.unique(ids).numel())
        floor = touched * 2 * inter * d * FP4_BYTES / (ceil["copy_TBps"] * 1e12) * 1e3
        floor = max(floor, rows * k * 2 * inter * d * 2 / (ceil.get("fp8_gemm_TFLOPs", 1000) * 1e12) * 1e3)
        bm0 = moe_block_m(ids.numel(), n_exp)
        configs = [{}]
        for bn, nw, st, un in itertools.product((64, 128), (4, 8), (3, 4), (2, 4)):
            configs.append({"block_n": bn, "num_warps": nw, "num_stages": st, "unroll": un})
        if rows <= 512:
            configs += [{"split": sp} for sp in (1, 2, 4, 8)]
        for bm in sorted({bm0, min(128, 2 * bm0)}):
            order, *blocks = G.moe_blocks(ids, n_exp, bm)
            token = order // k
            for c in configs:
                t = _timed(
                    lambda c=c, blocks=blocks, token=token, bm=bm, x=x, r=n_routed: w13.matmul(
                        x, blocks, r, bm, token, c
                    )
                )
                rec = {"rows": rows, "block_m": bm, **c, "ms": t, "floor_ms": floor}
                if isinstance(t, float):
                    rec["frac_of_floor"] = floor / t
                out["moe_w13"].append(rec)
        best = min(
            (r for r in out["moe_w13"] if r["rows"] == rows and isinstance(r["ms"], float)), key=lambda r: r["ms"]
        )
        log(f"sweep moe w13 rows {rows}: default {out['moe_w13'][-len(configs)]['ms']} ms; best {best}")
    for name, n, kk in FP8_SWEEP:
        q, sc = random_fp8(n, kk, g)
        for m in (1, 64, 1024):
            x = fp8_qdq(torch.randn(m, kk, device=DEV, generator=g), 32).to(BF)
            floor = (
                max(
                    (n * kk * FP8_BYTES + m * (kk + n) * 2) / (ceil["copy_TBps"] * 1e12),
                    2 * m * n * kk / (ceil.get("fp8_gemm_TFLOPs", 1000) * 1e12),
                )
                * 1e3
            )
            configs = [{}] + [
                {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": st}
                for bm, bn, nw, st in itertools.product(
                    (16 if m <= 16 else 64, 128) if m > 1 else (16,), (64, 128), (4, 8), (3, 5)
                )
            ]
            for c in configs:
                for split in (None, 1):
                    if split == 1 and not c:
                        continue
                    t = _timed(
                        lambda c=c, split=split, x=x, q=q, sc=sc: G.fp8_tile_gemm(x, q, sc, split_k=split, config=c)
                    )
                    rec = {"name": name, "rows": m, **c, "split_k": split, "ms": t, "floor_ms": floor}
                    if isinstance(t, float):
                        rec["frac_of_floor"] = floor / t
                    out["fp8"].append(rec)
            cases = [r for r in out["fp8"] if r["name"] == name and r["rows"] == m and isinstance(r["ms"], float)]
            best = min(cases, key=lambda r: r["ms"])
            log(f"sweep fp8 {name} rows {m}: default {cases[0]['ms']:.4f} ms; best {best}")
    return out


def _loop_instructions(sass: str) -> int:
    """Instructions between the label and the branch of the longest backward jump: the hot loop."""
    return len(_loop_opcodes(sass))


def _loop_opcodes(sass: str, modifiers: bool = False) -> list[str]:
    """The hot loop's opcodes (without modifiers unless asked), in order: see ``_loop_instructions``."""
    import re

    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    loops = [
        (labels[m.group(1)], i)
        for i, ln in enumerate(lines)
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", ln)) and labels.get(m.group(1), i) < i
    ]
    start, end = max(loops, key=lambda t: t[1] - t[0])
    ops = []
    for ln in lines[start : end + 1]:
        if m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln):
            ops.append(m.group(1) if modifiers else m.group(1).split(".")[0])
    return ops


def sass_counts() -> list[dict]:
    """The MXFP4 kernels' hot-loop instruction counts in sm_90a SASS, compiled offline with the
    ptxas and nvdisasm Triton ships (no GPU needed): the numbers the variants were designed with
    (``ASYMPD_BENCH_SASS=1 python bench/formats.py``, run without TRITON_INTERPRET). Shapes of the
    V4.1 gate/up GEMM: K = 5120, 128 weight rows and 16 or 32 activation rows a program, 4 warps,
    unrolled twice (64 weights a thread an iteration) unless said; every pointer and stride
    divisible by 16, as the JIT specializes them at true shapes."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ints = ["N", "s_am", "s_we", "s_wt", "s_wn", "s_se", "s_st", "s_sn", "s_ys", "s_ym"]
    sig = {"a_ptr": "*bf16", "a_rows_ptr": "*i64", "w_ptr": "*i8", "s_ptr": "*u8", "y_ptr": "*bf16"}
    sig |= {"block_expert_ptr": "*i32", "block_row0_ptr": "*i32", "block_row1_ptr": "*i32"} | dict.fromkeys(ints, "i32")
    # the FP8 kernel: e4m3 activation codes and their fp32 scales instead of bf16 activations
    sig8 = {**sig, "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "s_asm": "i32"}
    # the K step of the row layout (16 bytes, 1 scale); ``tiled`` cases: tile_fp4's (BN x 16, BN)
    rows_step, tiled = dict(W_STEP=16, S_STEP=1), dict(W_STEP=128 * 16, S_STEP=128)
    base = dict(K=5120, KB_PER_SPLIT=32, N_EXPERTS=384, GATHER=True, DOT_F32=False, LUT=True, BLOCK_N=128)
    base8 = dict(K=5120, KB_PER_SPLIT=32, N_EXPERTS=384, GATHER=True, ASM=True, BLOCK_N=128, EVEN_N=True)
    base, base8 = base | rows_step, base8 | rows_step
    swap = dict(UNROLL=2, EVEN_N=True, SCALE_AFTER=True, WIDE=False)
    cases = []
    for bm in (16, 32):
        cases += [
            ("current", G._mxfp4_moe_kernel, dict(UNROLL=2, BLOCK_M=bm, LUT_PAIRS=False)),
            ("current_lut_pairs", G._mxfp4_moe_kernel, dict(UNROLL=2, BLOCK_M=bm, LUT_PAIRS=True)),
            (
                "swap_ab_scale_after",
                G._mxfp4_moe_swap_kernel,
                dict(UNROLL=2, BLOCK_M=bm, EVEN_N=True, SCALE_AFTER=True, WIDE=False),
            ),
            (
                "swap_ab_scale_per_weight",
                G._mxfp4_moe_swap_kernel,
                dict(UNROLL=2, BLOCK_M=bm, EVEN_N=True, SCALE_AFTER=False, WIDE=False),
            ),
            ("swap_ab_tiled", G._mxfp4_moe_swap_kernel, swap | tiled | dict(BLOCK_M=bm)),
            ("swap_ab_wide", G._mxfp4_moe_swap_kernel, swap | dict(BLOCK_M=bm, SCALE_AFTER=False, WIDE=True)),
            (
                "swap_ab_wide_tiled",
                G._mxfp4_moe_swap_kernel,
                swap | tiled | dict(BLOCK_M=bm, SCALE_AFTER=False, WIDE=True),
            ),
            ("swap_ab_tiled_r72", G._mxfp4_moe_swap_kernel, swap | tiled | dict(BLOCK_M=bm, maxnreg=72)),
            ("fp8", G._mxfp4_moe_fp8_kernel, dict(UNROLL=2, BLOCK_M=bm)),
        ]
    cases.append(("swap_ab_unroll4", G._mxfp4_moe_swap_kernel, swap | dict(UNROLL=4, BLOCK_M=16)))
    cases.append(
        (
            "swap_ab_wide_tiled_unroll4",
            G._mxfp4_moe_swap_kernel,
            swap | tiled | dict(UNROLL=4, BLOCK_M=16, SCALE_AFTER=False, WIDE=True),
        )
    )
    # prefill-sized M-blocks: the first kernel as the wrapper launches it there (8 warps at 128)
    for bm, warps in ((64, 4), (128, 8)):
        first = dict(UNROLL=2, BLOCK_M=bm, LUT_PAIRS=False, num_warps=warps)
        cases += [("current", G._mxfp4_moe_kernel, first), ("current_tiled", G._mxfp4_moe_kernel, first | tiled)]
        cases.append(("current_tiled_lut_pairs", G._mxfp4_moe_kernel, first | tiled | dict(LUT_PAIRS=True)))
        w8 = swap | tiled | dict(BLOCK_M=bm, SCALE_AFTER=False, num_warps=8)
        cases.append(("swap_ab_tiled_w8", G._mxfp4_moe_swap_kernel, w8))
    cases.append(("fp8_unroll4", G._mxfp4_moe_fp8_kernel, dict(UNROLL=4, BLOCK_M=16)))
    # prefill-sized M-blocks: the FP8 kernel as the wrapper launches it there (8 warps)
    cases += [("fp8", G._mxfp4_moe_fp8_kernel, dict(UNROLL=2, BLOCK_M=bm, num_warps=8)) for bm in (64, 128)]
    # the tl.dot_scaled kernel (Triton's own e2m1 upcast) on the tiled layout, as the wrapper launches it
    for bm in (16, 32, 64, 128):
        sc = dict(UNROLL=2, BLOCK_M=bm, num_warps=4 if bm <= 64 else 8) | tiled
        cases += [("scaled_swap", G._mxfp4_moe_scaled_kernel, sc | dict(SWAP=True))]
        cases += [("scaled", G._mxfp4_moe_scaled_kernel, sc | dict(SWAP=False))]
        cases += [("scaled_swap_natural", G._mxfp4_moe_scaled_kernel, sc | dict(SWAP=True, NATURAL=True))]
        cases += [("scaled_natural", G._mxfp4_moe_scaled_kernel, sc | dict(SWAP=False, NATURAL=True))]
    out = []
    for name, fn, consts in cases:
        consts = dict(consts)
        warps, maxnreg = consts.pop("num_warps", 4), consts.pop("maxnreg", None)
        fp8 = fn is G._mxfp4_moe_fp8_kernel
        if fn is G._mxfp4_moe_scaled_kernel:  # bf16 activations, no ASM / LUT / DOT_F32
            consts = {**{c: v for c, v in base8.items() if c != "ASM"}, "STAND_IN": False, "NATURAL": False, **consts}
        else:
            consts = {**(base8 if fp8 else base), **consts}
        sig_fn = {a: t for a, t in (sig8 if fp8 else sig).items() if a in fn.arg_names}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig_fn}
        src = ASTSource(fn, {**sig_fn, **dict.fromkeys(consts, "constexpr")}, consts, attrs)
        k = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 3, "maxnreg": maxnreg}
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([tools / "nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
            usage = subprocess.run([tools / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        ops = _loop_opcodes(sass)
        n = len(ops)
        weights = consts["UNROLL"] * consts["BLOCK_N"] * 32 // (32 * warps)
        regs = int(usage.split("REG:")[1].split()[0])
        spill = int(usage.split("LOCAL:")[1].split()[0]) if "LOCAL:" in usage else None  # local memory: spills
        row = {"kernel": name, "block_m": consts["BLOCK_M"], "unroll": consts["UNROLL"], "num_warps": warps}
        row["tiled"], row["maxnreg"] = consts["W_STEP"] != 16, maxnreg
        row["registers"] = regs
        row |= {"local_bytes": spill, "loop_instructions": n, "weights_per_thread": weights, "per_weight": n / weights}
        row["loop_opcodes"] = dict(sorted(((o, ops.count(o)) for o in set(ops)), key=lambda t: -t[1]))
        # the memory side with its widths (LDG.E.128 vs .U8: what coalescing and vectorizing change)
        mem = _loop_opcodes(sass, modifiers=True)
        mem = [o for o in mem if o.split(".")[0] in ("LDG", "LDS", "STS", "LDSM", "BAR", "LDGSTS")]
        row["loop_memory_ops"] = dict(sorted(((o, mem.count(o)) for o in set(mem)), key=lambda t: -t[1]))
        out.append(row)
        log(
            f"sass {name:26s} BM {consts['BLOCK_M']:3d} unroll {consts['UNROLL']} warps {warps} | "
            f"{n:4d} instructions / {weights} weights = {n / weights:.2f} | {regs} registers, {spill} B local | "
            + " ".join(f"{o} {c}" for o, c in list(row["loop_opcodes"].items())[:12])
        )
    return out


def main() -> None:
    started = time.time()
    if os.environ.get("ASYMPD_BENCH_SASS", "0") == "1":  # offline, no GPU
        record("formats_sass", {"sass": sass_counts()}, started)
        return
    global DEV, MOE_VARIANT_ROWS, LINEARS, LINEAR_ROWS
    smoke = "--smoke" in sys.argv
    only = os.environ.get("ASYMPD_BENCH_ONLY")  # a comma list of sections, e.g. lm_head
    if smoke:  # CPU, tiny config, made-up ceilings: checks that every path runs, measures nothing
        if os.environ.get("ASYMPD_BENCH_MOE_VARIANTS", "0") != "1" and only != "linears":
            raise SystemExit(
                "--smoke covers the MoE-variants mode (ASYMPD_BENCH_MOE_VARIANTS=1) and ASYMPD_BENCH_ONLY=linears"
            )
        from asympd.config import tiny

        DEV, MOE_VARIANT_ROWS = torch.device("cpu"), [1, 64, 2500]  # 2500: M-blocks of 128 rows
        # small matrices of each form (plain, split K, grouped, a partial column block), rows on both
        # sides of SWAP_VARIANT_ROWS
        LINEARS = [("wq_a", 128, 512, 1), ("wkv", 96, 256, 1), ("wo_a", 256, 512, 4)]
        LINEAR_ROWS = [1, 16, 40, G.SWAP_VARIANT_ROWS + 1]
    torch.manual_seed(0)
    g = torch.Generator(device=DEV).manual_seed(0)
    cfg = tiny() if smoke else v41_flash()
    ceil = {"copy_TBps": 1.0, "bf16_gemm_TFLOPs": 1.0, "fp8_gemm_TFLOPs": 2.0, "smoke": True} if smoke else ceilings()
    log(f"ceilings: {ceil}")
    data = {"ceilings": ceil, "notes": __doc__}
    sections = (
        ("moe", lambda: bench_moe(cfg, ceil, g)),
        ("linears", lambda: bench_linears(ceil, g)),
        ("lm_head", lambda: bench_lm_head(cfg, ceil, g)),
    )
    name = "formats"
    if os.environ.get("ASYMPD_BENCH_SWEEP", "0") == "1":
        sections = (("sweep", lambda: sweep(cfg, ceil, g)),)
    if os.environ.get("ASYMPD_BENCH_ENGRAM", "1") == "1":
        sections += (("engram_host_lookup", lambda: bench_engram(cfg, g)),)
    if os.environ.get("ASYMPD_BENCH_MOE_VARIANTS", "0") == "1":  # alone, in its own file: formats.json stays whole
        sections = (
            ("fp8_accumulation", lambda: fp8_accumulation_error(cfg.dim, g)),
            ("moe_variants", lambda: bench_moe_variants(cfg, ceil, g)),
        )
        name = "formats_moe_variants_smoke" if smoke else "formats_moe_variants"
    if only:  # its own file (formats.json stays whole): formats_<sections>.json
        sections = tuple(s for s in sections if s[0] in only.split(","))
        name = f"{name}_{'_'.join(sorted(only.split(',')))}" + ("_smoke" if smoke else "")
    for key, fn in sections:
        try:
            data[key] = fn()
        except Exception as ex:  # keep what the other sections measured
            import traceback

            traceback.print_exc()
            data[key + "_error"] = f"{type(ex).__name__}: {ex}"
        record(name, data, started)
    log(f"wrote {name}.json in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
