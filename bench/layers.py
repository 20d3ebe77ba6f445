"""Layer step times at true V4.1-Flash shapes on one GPU, beside their floors.

One process builds, on the GPU from the checkpoint schema, the attention of one layer of each kind
the 40-layer stack has, and ONE MoE shared by all of them: by default as the CUDA build holds it
(``--experts mxfp4``: the 384 experts packed as released, ``loader.LAYOUTS["packed-experts"]``), with
the same experts dequantized to bf16 (and as FP8 where the GPU has the scaled grouped GEMM) timed
beside it in ``moe``; ``--experts bf16`` gives the layers the bf16 experts, as the tables of
2026-11-29 (``layers.json``) were measured. Then, each section timed with CUDA events (CUDA graphs for small
steps), every number beside its floor (max of FLOPs / GEMM rate and bytes / copy bandwidth, both
ceilings measured at the start of the same run):

- ``moe``: the MoE sublayer alone vs rows per step, bf16 and FP8 experts (docs/model.md §6's table);
- ``grid``: a full layer step (mHC, attention, MoE) of each kind vs rows and context length;
- ``p_steps``: the steps a prefill worker runs for 1K/4K/16K/64K prompts, asymmetric and symmetric;
- ``d_steps``: decode batches of B requests x (1 + k) rows with j bounded prefills of W rows;
- ``stack``: several different layers in one graph vs the sum of their single-layer times (the
  composition check at layer level);
- ``head``: the LM head for the rows that need logits;
- ``kernels``: issue 15's cells (prefill chunks of 4K / 16K rows at 16K / 48K context, decode of
  128 x 4 rows at 64K) with each layer kind timed twice in the same run, with the fused kernels'
  earlier defaults (indexer version 4, attention version 2) and with today's (``kernel_speedup``).

Usage (device): ``python bench/layers.py --out layers_packed`` (writes layers_packed.json, the
planner's tables). ``--smoke``: the tiny config on
CPU, to check the plumbing.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch

from bench.common import (
    attention_work,
    ceilings,
    floor_ms,
    log,
    moe_work,
    random_tensors,
    record,
    time_cuda,
)

W = 128
K_SPEC = 3  # draft tokens per decode step (DSpark block 5 proposes up to 4; 3 is the usual setting)


def layer_kinds(cfg) -> dict[str, int]:
    """One representative layer of each kind, by the schedule."""
    k = cfg.last_kv_source
    L = range(cfg.n_layers)
    kinds = {
        "swa": next(i for i in L if cfg.ratio(i) == 0),
        "enc_src": next(i for i in L if i < k and cfg.ratio(i) > 1 and i in cfg.kv_source_layers),
        "enc_reuse": next(i for i in L if i < k and cfg.ratio(i) > 1 and i not in cfg.index_source_layers),
        "dec_src": k,
        "dec_reidx": next(i for i in L if i > k and i in cfg.index_source_layers),
        "dec_reuse": next(i for i in L if i > k and i not in cfg.index_source_layers),
    }
    return kinds


def kind_of(cfg, layer: int) -> str:
    k = cfg.last_kv_source
    if cfg.ratio(layer) == 0:
        return "swa"
    if layer < k:
        return "enc_src" if layer in cfg.kv_source_layers or layer in cfg.index_source_layers else "enc_reuse"
    if layer == k:
        return "dec_src"
    return "dec_reidx" if layer in cfg.index_source_layers else "dec_reuse"


def kind_counts(cfg) -> dict[str, int]:
    out: dict[str, int] = {}
    for layer in range(cfg.n_layers):
        out[kind_of(cfg, layer)] = out.get(kind_of(cfg, layer), 0) + 1
    return out


def build(
    cfg, device: torch.device, experts_modes: tuple[str, ...], block_experts: str = "bf16"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Blocks of each kind (sharing one MoE, ``block_experts``) and the MoE variants."""
    from asympd.model.cuda_ops import CUDA_KERNELS, FastMoE
    from asympd.model.loader import LAYOUTS, _attention, _moe, _Reader
    from asympd.model.transformer import Block

    kinds = layer_kinds(cfg)
    moe_layer = kinds["enc_src"]
    wanted = tuple(f"layers.{i}." for i in set(kinds.values()))

    def keep(name: str) -> bool:
        if not name.startswith(wanted) or ".engram." in name or name.endswith("bias_vl"):
            return False
        if ".ffn." in name and not name.startswith(f"layers.{moe_layer}."):
            return False
        return True

    t0 = time.time()
    tensors = random_tensors(cfg, keep, device)
    r = _Reader(tensors, torch.bfloat16, device, LAYOUTS["dequantized"])
    variants: dict[str, Any] = {}
    if "mxfp4" in experts_modes:  # the same stored experts, read as the CUDA build reads them
        packed = _Reader(tensors, torch.bfloat16, device, LAYOUTS["packed-experts"])
        variants["mxfp4"] = _moe(cfg, moe_layer, packed, f"layers.{moe_layer}.ffn.")
    moe = _moe(cfg, moe_layer, r, f"layers.{moe_layer}.ffn.")
    for name in [n for n in tensors if ".ffn.experts." in n]:
        del tensors[name]
    if "fp8" in experts_modes:
        m8 = copy.copy(moe)
        m8.__class__ = FastMoE
        m8.convert("fp8")
        variants["fp8"] = m8
    moe.__class__ = FastMoE
    moe.convert("bf16")
    variants["bf16"] = moe
    blocks = {}
    for kind, layer in kinds.items():
        p = f"layers.{layer}."
        attn = _attention(cfg, layer, r, p + "attn.", True)
        if device.type == "cuda":  # the CPU smoke keeps the reference's (the fused ones are Triton's)
            attn.kernels = CUDA_KERNELS
        attn.freqs = attn.freqs.to(device)
        w: dict[str, Any] = {
            "attn_norm": r.vector(p + "attn_norm.weight"),
            "ffn_norm": r.vector(p + "ffn_norm.weight"),
            "attn": attn,
            "ffn": variants[block_experts],
        }
        for sub in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                w[f"hc_{sub}_{part}"] = r.vector(f"{p}hc_{sub}_{part}", torch.float32)
        blocks[kind] = Block(cfg, layer, w)
    del tensors
    # the same switches accelerate() makes for a loaded model: fused-kernel dispatch and the
    # activation-quantizing linears (FastMoE and the attention kernels were set above)
    from asympd.model.cuda_ops import FastQLinear, install_kernels, kernels_enabled
    from asympd.model.ops import CUDA_FAST, QLinear

    for block in blocks.values():
        for mod in block.modules():
            if type(mod) is QLinear:
                mod.__class__ = FastQLinear
    if device.type == "cuda":
        install_kernels(device)
        torch.cuda.empty_cache()
    info = {
        "kinds": kinds,
        "block_experts": block_experts,
        "kind_counts": kind_counts(cfg),
        "build_s": round(time.time() - t0, 1),
        "fp8_inexact_expert_rows": getattr(variants.get("fp8"), "inexact_rows", None),
        "expert_rows_total": cfg.n_routed_experts * (3 * cfg.moe_inter_dim + cfg.dim),
        "kernels": kernels_enabled(device),
        "ops_dispatch": sorted(CUDA_FAST),
    }
    return {"blocks": blocks, "moe": variants, "block_experts": block_experts}, info


def variant_block(base, moe, fp8_linears: bool):
    """A shallow copy of ``base`` with another MoE and, optionally, FP8 attention matrices."""
    from asympd.model.cuda_ops import FP8Linear

    b = copy.copy(base)
    b._modules = dict(base._modules)
    b.ffn = moe
    if fp8_linears:
        a = copy.copy(base.attn)
        a._modules = dict(base.attn._modules)
        for name in ("wq_a", "wq_b", "wkv", "wo_b", "idx_wq_b"):
            lin = getattr(a, name, None)
            if lin is not None and getattr(lin, "quantized", False):
                setattr(a, name, FP8Linear(lin))
        b.attn = a
    return b


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn, *, graph: bool, iters: int = 8, warmup: int = 2) -> dict[str, Any]:
        if self.device.type == "cuda":
            return time_cuda(fn, iters=iters, warmup=warmup, graph=graph)
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(max(1, iters // 4)):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        ts.sort()
        return {"ms": ts[len(ts) // 2], "mode": "cpu", "iters": len(ts)}


def step_inputs(cfg, rows: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.randn(rows, cfg.hc_mult, cfg.dim, device=device, generator=gen).to(torch.bfloat16)
    pre = torch.softmax(torch.randn(rows, cfg.hc_mult, device=device, generator=gen), -1)
    return h, pre


class Steps:
    """Times kinds of layer over group specs, preparing the shared selections they read."""

    def __init__(self, cfg, built, timer: Timer, ceil: dict | None, device):
        self.cfg, self.built, self.timer, self.ceil, self.device = cfg, built, timer, ceil, device
        self.gen = torch.Generator(device=device).manual_seed(1)
        self.kinds = layer_kinds(cfg)

    def groups(self, specs):
        from bench.common import StepState

        return StepState(self.cfg, specs, torch.bfloat16, self.device, self.gen)

    def run(self, specs, kinds: list[str], *, kv_path: bool = False, graph: bool | None = None, iters: int = 6):
        """{kind: timing}. Index sources run once first so reuse layers find their selections."""
        from bench.common import step_block as group_block_forward

        cfg, blocks = self.cfg, self.built["blocks"]
        groups = self.groups(specs)
        rows = groups.rows
        h, pre = step_inputs(cfg, rows, self.device, self.gen)
        with torch.inference_mode():
            need = set()
            if not kv_path and "enc_reuse" in kinds:
                need.add("enc_src")  # its selection
            if not kv_path and ("dec_reuse" in kinds or "dec_reidx" in kinds):
                need.add("dec_src")  # its selection and candidate pool
            for kind in ("enc_src", "dec_src"):
                if kind in need:
                    group_block_forward(blocks[kind], h, pre, groups)
            out = {}
            big = rows >= 2048
            for kind in kinds:
                block = blocks[kind]
                fn = lambda b=block, h=h, pre=pre, g=groups: group_block_forward(b, h, pre, g, kv_path_only=kv_path)  # noqa: E731
                t = self.timer(fn, graph=(not big) if graph is None else graph, iters=iters if not big else 4)
                t["rows"] = rows
                if self.ceil is not None:
                    gspecs = [dict(n=g["n"], q=g["q"], start=g["start"]) for g in groups.specs]
                    layer = self.kinds[kind]
                    if kv_path:
                        work = {"flops": 2 * rows * cfg.dim * cfg.head_dim, "bytes": rows * cfg.dim * 2 * 2}
                    else:
                        a = attention_work(cfg, layer, gspecs)
                        m = moe_work(cfg, rows, self.built["block_experts"])
                        work = {"flops": a["flops"] + m["flops"], "bytes": a["bytes"] + m["bytes"]}
                    f = floor_ms(work, self.ceil)
                    t.update(work)
                    t.update(f)
                    t["floor_fraction"] = f["floor_ms"] / t["ms"]
                out[kind] = t
        del groups, h, pre
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return out

    def stack(self, specs, kinds: list[str], iters: int = 6) -> dict[str, Any]:
        """The listed kinds run back to back in one timed call vs the sum of each alone."""
        from bench.common import step_block as group_block_forward

        cfg, blocks = self.cfg, self.built["blocks"]
        groups = self.groups(specs)
        rows = groups.rows
        h, pre = step_inputs(cfg, rows, self.device, self.gen)
        with torch.inference_mode():

            def fn():
                x, p = h, pre
                for kind in kinds:
                    x, p = group_block_forward(blocks[kind], x, p, groups)
                return x

            t = self.timer(fn, graph=rows < 2048, iters=iters)
        return t


def section_moe(cfg, built, timer, ceil, device, rows_list):
    out = []
    gen = torch.Generator(device=device).manual_seed(2)
    for experts, moe in built["moe"].items():
        for rows in rows_list:
            x = torch.randn(rows, cfg.dim, device=device, generator=gen).to(torch.bfloat16)
            with torch.inference_mode():
                touched = int(torch.unique(moe.route(x)[1]).numel())
                e = timer(lambda m=moe, x=x: m(x), graph=False, iters=8)
                g = timer(lambda m=moe, x=x: m(x), graph=True, iters=8) if rows <= 2048 else None
            work = moe_work(cfg, rows, experts, touched)
            # the FP8 rate for the formats the release stores (issue 11's floor), bf16's for bf16
            fp8_rate = experts in ("fp8", "mxfp4") and ceil and "fp8_gemm_TFLOPs" in ceil
            rate = "fp8_gemm_TFLOPs" if fp8_rate else "bf16_gemm_TFLOPs"
            row = {"experts": experts, "rows": rows, "eager": e, "graph": g, **work}
            if ceil:
                f = floor_ms(work, ceil, rate)
                row.update(f)
                best = min(e["ms"], g["ms"] if g else e["ms"])
                row["best_ms"] = best
                row["floor_fraction"] = f["floor_ms"] / best
            if rows in (128, 2048, 16384) and device.type == "cuda" and experts != "mxfp4":
                row["gemm_only"] = gemm_only(moe, x, timer)
            out.append(row)
            log(
                f"moe {experts:4s} rows {rows:6d}: eager {e['ms']:.3f} ms"
                + (f", graph {g['ms']:.3f} ms ({g['mode']})" if g else "")
                + (
                    f", floor {row.get('floor_ms', 0):.3f} ms, {row.get('floor_fraction', 0) * 100:.0f}%"
                    if ceil
                    else ""
                )
                + f", experts touched {touched}"
            )
    return out


def gemm_only(moe, x, timer) -> dict[str, Any]:
    """The two routed grouped GEMMs alone (same routing), to split MoE time into GEMM and the rest."""
    with torch.inference_mode():
        _, ids = moe.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // moe.topk
        counts = torch.zeros(moe.w13.size(0), dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        if moe.experts == "fp8":
            from asympd.model.cuda_ops import rowwise_fp8

            a, sa = rowwise_fp8(x[token])
            h, sh = rowwise_fp8(torch.randn(a.size(0), moe.inter, device=x.device))

            def fn():
                moe._grouped(a, moe.w13, offs, sa, moe.w13_scale)
                moe._grouped(h, moe.w2f, offs, sh, moe.w2_scale)
        else:
            a = x[token]
            h = torch.randn(a.size(0), moe.inter, device=x.device).to(torch.bfloat16)

            def fn():
                moe._grouped(a, moe.w13, offs)
                moe._grouped(h, moe.w2f, offs)

        return timer(fn, graph=False, iters=8)


def p_specs(n_prompt: int, mode: str, budget: int = 16384, w: int = W) -> list[dict[str, Any]]:
    """The steps a prefill worker runs for prompts of ``n_prompt`` tokens at a token budget (whole
    prompts packed per step; a longer prompt in budget-sized chunks). Each: the main groups (layers
    up to K, or K's KV path) and, symmetric only, the tail groups for the layers above K."""
    s = n_prompt - w
    rows_main = s if mode == "asymmetric" else n_prompt
    steps = []
    if rows_main <= budget:
        n = max(1, budget // rows_main)
        tail = [dict(n=n, q=w, start=s, floor=s)] if mode == "symmetric" else []
        steps.append({"main": [dict(n=n, q=rows_main, start=0)], "tail": tail, "prompts": n})
    else:
        for lo in range(0, rows_main, budget):
            q = min(budget, rows_main - lo)
            last = lo + q == rows_main
            tail = [dict(n=1, q=w, start=s, floor=s)] if mode == "symmetric" and last else []
            steps.append({"main": [dict(n=1, q=q, start=lo)], "tail": tail, "prompts": 1 if last else 0})
    return steps


def _set_by_block(ap, flag: str, spec: str, table: dict[int, int], allowed: tuple[int, ...], what: str) -> dict:
    """``BLOCK_M:VALUE,...`` from the command line into one of moe_gluon's tables by M-block (in
    place: the build reads them at launch); the table as the result records it."""
    from asympd.model.moe_gluon import BLOCK_MS

    for item in filter(None, spec.split(",")):
        block_m, value = (int(v) for v in item.split(":"))
        if block_m not in table or value not in allowed:
            ap.error(f"{flag}: M-blocks {BLOCK_MS} and {what}, got {item}")
        table[block_m] = value
    return {str(bm): v for bm, v in table.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU: plumbing only")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop starting sections after this")
    ap.add_argument("--sections", default="moe,variants,head,d_steps,p_steps,stack,grid,kernels,glue")
    ap.add_argument(
        "--experts",
        choices=("mxfp4", "bf16"),
        default="mxfp4",
        help="the MoE the layers run: mxfp4 = packed as released (the CUDA default); bf16 = dequantized",
    )
    ap.add_argument("--out", default=None, help="result name (default layers, layers_smoke with --smoke)")
    ap.add_argument(
        "--wgmma-min-block-m",
        type=int,
        default=None,
        help="the smallest M-block the Gluon MXFP4 kernel takes (gemm_kernels.WGMMA_MIN_BLOCK_M; default: the build's)",
    )
    ap.add_argument(
        "--kernels-before",
        default="4,2",
        help="the kernels section's baseline: indexer version, attention version (default 4,2)",
    )
    ap.add_argument(
        "--kernels-now", default="", help="the kernels section's other side (default: the build's versions)"
    )
    ap.add_argument("--glue-cells", default="", help="the glue section's cells to run (indices: 0 4K, 1 16K, 2 decode)")
    ap.add_argument(
        "--exponent-decode",
        type=int,
        choices=(0, 1),
        default=None,
        help="the Gluon expert GEMM's table-free FP4 decode (packed.EXPONENT_DECODE; default: the build's)",
    )
    ap.add_argument(
        "--split-layout",
        type=int,
        choices=(0, 1),
        default=None,
        help="hold the experts' bytes in the split decode's layout (packed.SPLIT_LAYOUT; default: the build's)",
    )
    ap.add_argument(
        "--moe-warps",
        default="",
        help="the Gluon expert GEMM's warps by M-block with the table-free decode, e.g. 64:4,128:4 "
        "(moe_gluon.NUM_WARPS; default: the build's)",
    )
    ap.add_argument(
        "--moe-sub-tiles",
        default="",
        help="the Gluon expert GEMM's sub-tiles by M-block, e.g. 64:4,128:4 (moe_gluon.SUB_TILES; default: build's)",
    )
    ap.add_argument(
        "--moe-w-tiles",
        default="",
        help="the Gluon expert GEMM's weight tiles a program by M-block, e.g. 32:2,64:2 (moe_gluon.W_TILES; "
        "default: the build's)",
    )
    ap.add_argument(
        "--moe-overlap",
        type=int,
        choices=(0, 1),
        default=None,
        help="the Gluon expert GEMM's overlapped steps (moe_gluon.OVERLAP; default: the build's)",
    )
    ap.add_argument(
        "--moe-block-fill",
        default="",
        help="M-blocks by rows an expert, e.g. 16:12,32:24,64:64 (packed.MOE_BLOCK_M_FILL; default: the build's)",
    )
    args = ap.parse_args()
    started = time.time()
    sections = args.sections.split(",")
    from asympd.model import gemm_kernels

    if args.wgmma_min_block_m is not None:
        gemm_kernels.WGMMA_MIN_BLOCK_M = args.wgmma_min_block_m
    from asympd.model import packed

    if args.exponent_decode is not None:
        packed.EXPONENT_DECODE = bool(args.exponent_decode)
    if args.split_layout is not None:
        packed.SPLIT_LAYOUT = bool(args.split_layout)
    from asympd.config import tiny, v41_flash

    if args.smoke:
        cfg, device = tiny(), torch.device("cpu")
        block_experts = "bf16"  # the packed kernels are Triton's: CPU runs them only interpreted
        experts_modes: tuple[str, ...] = ("bf16",)
    else:
        cfg, device = v41_flash(), torch.device("cuda")
        block_experts = args.experts
        experts_modes = ("mxfp4", "bf16", "fp8") if block_experts == "mxfp4" else ("bf16", "fp8")
    res: dict[str, Any] = {"config": "tiny" if args.smoke else "v41-flash", "W": W, "k_spec": K_SPEC}
    res["wgmma_min_block_m"] = gemm_kernels.WGMMA_MIN_BLOCK_M
    res["exponent_decode"] = packed.EXPONENT_DECODE
    res["split_layout"] = packed.SPLIT_LAYOUT and packed.EXPONENT_DECODE
    from asympd.model import moe_gluon

    res["moe_warps"] = _set_by_block(
        ap, "--moe-warps", args.moe_warps, moe_gluon.NUM_WARPS[True], (4, 8), "4 or 8 warps"
    )
    res["moe_sub_tiles"] = _set_by_block(
        ap, "--moe-sub-tiles", args.moe_sub_tiles, moe_gluon.SUB_TILES, (1, 2, 4), "1, 2 or 4 sub-tiles"
    )
    res["moe_w_tiles"] = _set_by_block(ap, "--moe-w-tiles", args.moe_w_tiles, moe_gluon.W_TILES, (1, 2), "1 or 2 tiles")
    if args.moe_overlap is not None:
        moe_gluon.OVERLAP = bool(args.moe_overlap)
    res["moe_overlap"] = moe_gluon.OVERLAP
    if args.moe_block_fill:
        fill = tuple(tuple(int(v) for v in item.split(":")) for item in args.moe_block_fill.split(","))
        if any(len(f) != 2 or f[0] not in moe_gluon.BLOCK_MS for f in fill):
            ap.error(f"--moe-block-fill: BLOCK_M:ROWS pairs, M-blocks {moe_gluon.BLOCK_MS}")
        packed.MOE_BLOCK_M_FILL = fill
    res["moe_block_fill"] = [list(f) for f in packed.MOE_BLOCK_M_FILL]
    name = args.out or ("layers_smoke" if args.smoke else "layers")
    ceil = None
    if device.type == "cuda":
        from asympd.model.cuda_ops import caps

        ceil = ceilings()
        res["ceilings"] = ceil
        res["caps"] = caps(device)
        log("ceilings", ceil, "caps", res["caps"])
        if not res["caps"].get("scaled_grouped_mm"):
            experts_modes = tuple(m for m in experts_modes if m != "fp8")
    if device.type == "cuda":
        from bench.common import ensure_e8m0

        res["e8m0_cast"] = ensure_e8m0(device)
    built, info = build(cfg, device, experts_modes, block_experts)
    res["build"] = info
    log("built", info)
    record(name, res, started)
    timer = Timer(device)
    steps = Steps(cfg, built, timer, ceil, device)
    kinds_all = list(layer_kinds(cfg))
    small = args.smoke

    def over() -> bool:
        return time.time() - started > args.budget_s

    def save():
        record(name, res, started)

    def guarded(section, fn):
        if section not in sections:
            return
        if over():
            res.setdefault("skipped", []).append(section)
            return
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # keep going: later sections still report
            import traceback

            res.setdefault("errors", {})[section] = traceback.format_exc()[-3000:]
            log(f"section {section} failed: {e}")
        res.setdefault("section_s", {})[section] = round(time.time() - t0, 1)
        save()

    # -- MoE alone (docs/model.md §6) ------------------------------------------------------------------
    moe_rows = [1, 16, 64] if small else [1, 16, 64, 128, 256, 512, 1024, 1152, 2048, 4096, 8192, 16384]
    guarded("moe", lambda: res.__setitem__("moe", section_moe(cfg, built, timer, ceil, device, moe_rows)))

    # -- full layers vs rows and context -----------------------------------------------------------
    def grid():
        rows = []
        pre_q = [16, 64] if small else [128, 1024, 4096, 16384]
        pre_start = [0, 64] if small else [0, 16384, 49152]
        for q in pre_q:
            for start in pre_start:
                if over():
                    res.setdefault("skipped", []).append(f"grid prefill q={q} start={start}")
                    continue
                t = steps.run([dict(n=1, q=q, start=start)], kinds_all)
                rows.append({"shape": "prefill", "n": 1, "q": q, "start": start, "kinds": t})
                log(f"grid prefill q={q} start={start}: " + ", ".join(f"{k} {v['ms']:.2f}" for k, v in t.items()))
        dec_b = [1, 4] if small else [1, 16, 64, 256, 512]
        dec_ctx = [32, 64] if small else [4096, 16384, 65536]
        for b in dec_b:
            for ctx in dec_ctx:
                if b * ctx > (1 << 23) or over():
                    continue
                q = 1 if b == 1 else 1 + K_SPEC
                t = steps.run([dict(n=b, q=q, start=ctx)], kinds_all)
                rows.append({"shape": "decode", "n": b, "q": q, "start": ctx, "kinds": t})
                log(f"grid decode B={b} q={q} ctx={ctx}: " + ", ".join(f"{k} {v['ms']:.2f}" for k, v in t.items()))
        res["grid"] = rows

    guarded("grid", grid)

    # -- issue 15's cells: the fused kernels' earlier defaults against today's, same run ------------
    def kernels():
        from asympd.model import attn_kernels

        now = default = (attn_kernels.INDEXER_VERSION, attn_kernels.ATTENTION_VERSION)
        before = tuple(int(v) for v in args.kernels_before.split(","))
        now = tuple(int(v) for v in args.kernels_now.split(",")) if args.kernels_now else now
        variants = {"before": before, "now": now}
        res["kernels_versions"] = {k: {"indexer": i, "attention": a} for k, (i, a) in variants.items()}
        cells = [
            (1, q, start)
            for q in ((16, 64) if small else (4096, 16384))
            for start in ((32, 64) if small else (16384, 49152))
        ]
        cells.append((4, 1 + K_SPEC, 64) if small else (128, 1 + K_SPEC, 65536))
        rows = []
        try:
            for n, q, start in cells:
                if over():
                    res.setdefault("skipped", []).append(f"kernels n={n} q={q} start={start}")
                    continue
                row: dict[str, Any] = {"n": n, "q": q, "start": start}
                for tag, (iv, av) in variants.items():
                    attn_kernels.INDEXER_VERSION, attn_kernels.ATTENTION_VERSION = iv, av
                    row[tag] = steps.run([dict(n=n, q=q, start=start)], kinds_all)
                row["kernel_speedup"] = {k: row["before"][k]["ms"] / row["now"][k]["ms"] for k in row["now"]}
                rows.append(row)
                log(
                    f"kernels n={n} q={q} start={start}: "
                    + ", ".join(
                        f"{k} {row['before'][k]['ms']:.2f} -> {v['ms']:.2f} ms ({v.get('floor_fraction', 0):.0%})"
                        for k, v in row["now"].items()
                    )
                )
        finally:
            attn_kernels.INDEXER_VERSION, attn_kernels.ATTENTION_VERSION = default
        res["kernels"] = rows

    guarded("kernels", kernels)

    # -- the fused glue kernels (cuda_kernels: fp4_qdq, hc_project, rms_norm) off and on, same run: the
    # torch forms, the installed set (cuda_ops.GLUE_KERNELS), and each kernel alone -------------------
    def glue():
        from asympd.model import cuda_kernels as CK
        from asympd.model import ops
        from asympd.model.cuda_ops import caps

        names = ("fp4_qdq", "hc_project", "rms_norm")
        installed = {n: ops.CUDA_FAST[n] for n in names if n in ops.CUDA_FAST}
        passed = {n: getattr(CK, n) for n in names if caps(device).get(f"triton_{n}")}
        probed = caps(device)  # FastMoE reads moe_combine's probe from here
        combine = bool(probed.get("triton_moe_combine"))
        res["glue_kernels"] = sorted(installed) + (["moe_combine"] if combine else [])
        # each variant: the ops kernels installed, and whether FastMoE takes the fused combine
        variants: dict[str, tuple[dict[str, Any], bool]] = {"torch": ({}, False), "fused": (installed, combine)}
        variants |= {f"only_{n}": ({n: f}, False) for n, f in passed.items()}
        if combine:
            variants |= {"only_moe_combine": ({}, True), "fused_without_moe_combine": (installed, False)}
        start = 64 if small else 49152
        cells = [(1, q, start) for q in ((16, 64) if small else (4096, 16384))]
        cells.append((4, 1 + K_SPEC, 64) if small else (128, 1 + K_SPEC, 65536))
        if args.glue_cells:  # some of them, in the order given
            cells = [cells[int(i)] for i in args.glue_cells.split(",")]
        rows = []
        try:
            for n, q, at in cells:
                if over():
                    res.setdefault("skipped", []).append(f"glue n={n} q={q} start={at}")
                    continue
                row: dict[str, Any] = {"n": n, "q": q, "start": at}
                for tag, (kernels, with_combine) in variants.items():
                    for name in names:
                        ops.CUDA_FAST.pop(name, None)
                    ops.CUDA_FAST.update(kernels)
                    probed["triton_moe_combine"] = with_combine
                    row[tag] = steps.run([dict(n=n, q=q, start=at)], kinds_all)
                row["speedup"] = {k: row["torch"][k]["ms"] / row["fused"][k]["ms"] for k in row["fused"]}
                rows.append(row)
                log(
                    f"glue n={n} q={q} start={at}: "
                    + ", ".join(
                        f"{k} {row['torch'][k]['ms']:.2f} -> {v['ms']:.2f} ms ({v.get('floor_fraction', 0):.0%})"
                        for k, v in row["fused"].items()
                    )
                )
                for tag in variants:
                    if tag not in ("torch", "fused"):
                        log(f"  {tag}: " + ", ".join(f"{k} {v['ms']:.2f}" for k, v in row[tag].items()))
        finally:
            for name in names:
                ops.CUDA_FAST.pop(name, None)
            ops.CUDA_FAST.update(installed)
            probed["triton_moe_combine"] = combine
        res["glue"] = rows

    guarded("glue", glue)

    # -- prefill-worker steps ------------------------------------------------------------------------
    def p_steps():
        out = []
        lengths = [48, 100] if small else [1024, 4096, 16384, 65536]
        enc = ["swa", "enc_src", "enc_reuse"]
        for n_prompt in lengths:
            for mode in ("asymmetric", "symmetric"):
                for i, st in enumerate(p_specs(n_prompt, mode, budget=64 if small else 16384, w=cfg.window_size)):
                    if over():
                        res.setdefault("skipped", []).append(f"p_steps {n_prompt} {mode} {i}")
                        continue
                    main = steps.run(st["main"], enc + (["dec_src"] if mode == "symmetric" else []))
                    if mode == "asymmetric":
                        main["dec_src_kv_path"] = steps.run(st["main"], ["dec_src"], kv_path=True)["dec_src"]
                    tail = steps.run(st["tail"], ["dec_reidx", "dec_reuse"]) if st["tail"] else {}
                    out.append({"n_prompt": n_prompt, "mode": mode, "step": i, **st, "t_main": main, "t_tail": tail})
                    log(
                        f"p {mode} N={n_prompt} step {i}: "
                        + ", ".join(f"{k} {v['ms']:.2f}" for k, v in {**main, **tail}.items())
                    )
        res["p_steps"] = out

    guarded("p_steps", p_steps)

    # -- decode-worker steps with admitted bounded prefills ------------------------------------------
    def d_steps():
        out = []
        ctx = 64 if small else 8192
        bs = [2, 4] if small else [16, 64, 128, 256, 512]
        js = [0, 1, 2] if small else [0, 1, 2, 4, 8]
        w = cfg.window_size
        s = ctx - w
        for b in bs:
            for j in js:
                if over():
                    res.setdefault("skipped", []).append(f"d_steps B={b} j={j}")
                    continue
                specs = [dict(n=b, q=1 + K_SPEC, start=ctx)]
                if j:
                    specs.append(dict(n=j, q=w, start=s, floor=s, encoder_floor=s))
                t = steps.run(specs, kinds_all, graph=True)
                out.append({"B": b, "q": 1 + K_SPEC, "ctx": ctx, "j": j, "prefill_start": s, "kinds": t})
                log(f"d B={b} j={j}: " + ", ".join(f"{k} {v['ms']:.2f}" for k, v in t.items()))
        res["d_steps"] = out

    guarded("d_steps", d_steps)

    # -- composition check ------------------------------------------------------------------------
    def stack():
        out = []
        cases = (
            [[dict(n=4, q=4, start=64)]]
            if small
            else [
                [
                    dict(n=64, q=1 + K_SPEC, start=8192),
                    dict(n=2, q=W, start=8192 - W, floor=8192 - W, encoder_floor=8192 - W),
                ],
                [dict(n=1, q=4096, start=16384)],
            ]
        )
        for specs in cases:
            alone = steps.run(specs, kinds_all)
            together = steps.stack(specs, kinds_all)
            total = sum(v["ms"] for v in alone.values())
            out.append(
                {
                    "specs": specs,
                    "alone": alone,
                    "stack": together,
                    "sum_alone_ms": total,
                    "ratio": together["ms"] / total,
                }
            )
            log(f"stack {specs}: together {together['ms']:.2f} ms vs sum {total:.2f} ms")
        res["stack"] = out

    guarded("stack", stack)

    # -- FP8 variants of one layer kind: speed and deviation from the bf16 path ------------------------
    def variants():
        from bench.common import step_block as group_block_forward

        if "fp8" not in built["moe"]:
            if not small:
                res["variants"] = {"skipped": "no FP8 grouped GEMM on this device"}
                return
            built["moe"]["fp8"] = built["moe"]["bf16"]  # smoke: plumbing only
        base = built["blocks"]["dec_reuse"]
        blocks = {"bf16": base, "fp8_experts": variant_block(base, built["moe"]["fp8"], False)}
        blocks["fp8_experts_linears"] = variant_block(base, built["moe"]["fp8"], True)
        out = []
        cases = (
            [[dict(n=4, q=4, start=64)]]
            if small
            else [
                [dict(n=64, q=1 + K_SPEC, start=8192)],
                [dict(n=1, q=1024, start=0)],
                [dict(n=1, q=16384, start=0)],
            ]
        )
        for specs in cases:
            groups = steps.groups(specs)
            rows = groups.rows
            h, pre = step_inputs(cfg, rows, device, steps.gen)
            row = {"specs": specs, "rows": rows}
            with torch.inference_mode():
                group_block_forward(built["blocks"]["dec_src"], h, pre, groups)  # selections
                ref = group_block_forward(base, h, pre, groups)[0].float()
                for name, b in blocks.items():
                    y = group_block_forward(b, h, pre, groups)[0].float()
                    t = timer(lambda b=b, g=groups, h=h, p=pre: group_block_forward(b, h, p, g), graph=rows < 2048)
                    row[name] = {
                        "ms": t["ms"],
                        "mode": t["mode"],
                        "rel_err_vs_bf16": float((y - ref).norm() / ref.norm()),
                    }
            out.append(row)
            log("variants", row)
        res["variants"] = out

    guarded("variants", variants)

    # -- LM head ------------------------------------------------------------------------------------
    def head():
        out = []
        head_w = torch.randn(cfg.vocab_size, cfg.dim, device=device).to(torch.bfloat16)
        head_f = head_w.float()
        for rows in [1, 64, 512, 2048] if not small else [1, 8]:
            x = torch.randn(rows, cfg.dim, device=device).to(torch.bfloat16)
            t32 = timer(lambda x=x: torch.nn.functional.linear(x.float(), head_f), graph=False)
            row = {"rows": rows, "fp32_ms": t32["ms"]}
            if device.type == "cuda":
                from asympd.model.cuda_ops import caps

                if caps(device).get("mm_out_f32"):
                    row["bf16_f32out_ms"] = timer(
                        lambda x=x: torch.mm(x, head_w.t(), out_dtype=torch.float32), graph=False
                    )["ms"]
            out.append(row)
        res["head"] = out

    guarded("head", head)
    from bench.common import _GRAPH_BROKEN

    res["graph_failures"] = _GRAPH_BROKEN[:3]
    res["total_s"] = round(time.time() - started, 1)
    save()
    log("done in", res["total_s"], "s")


if __name__ == "__main__":
    main()
