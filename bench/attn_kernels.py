"""The fused indexer and sparse attention kernels (asympd/model/attn_kernels.py) against today's
unfused CUDA functions (cuda_ops.indexer_scores + fast_topk, fast_sparse_attention over gathered
keys, arranged as the per-sequence path ran them), at true V4.1-Flash shapes, in one run.

Cells: prefill chunks of 4K and 16K rows ending at 16K and 48K context (one sequence), decode of
256 sequences x 4 rows at 64K context. Kinds: ``index_r2`` (the ratio-2 index sources L2/8/14),
``cand_source`` (L20: top-k plus the candidate blocks), ``reindex`` (L24/28/32/36: top-k within
the pool), ``attention`` (every compressed layer: window 128 + top-512 entries).

Floors count what the kernels must move: FLOPs of the scores / the two attention products over the
visible entries, and the bytes of queries, weights, the distinct keys read (each sequence's index
keys once; the window rows and the distinct selected entries once), and the outputs; against the
H200's datasheet rates (4.8 TB/s, 989 TFLOP/s bf16 dense) and against ceilings measured in the same
run. Agreement: rows whose selections are identical and the mean overlap (bf16 scores tie often,
and the two sum the heads in different orders), and the attention outputs' relative error.

Attention is also timed as the engine's batched path runs it today (``batched``: every row at
once, entries gathered through the block tables, ``fast_sparse_attention`` per row tile), the
strongest unfused baseline; ``speedup_vs_batched`` compares the fused kernel with it. The indexer's
"today" in the engine is the fused kernel itself (version 3): ``speedup_v3_over_v2`` and
``speedup_v4_over_v3`` (version 4: version 3's kernel in 64-entry tiles held to 128 registers a
thread, two blocks per SM), ``speedup_v5_over_v4`` (version 5: a score pass writing 16-bit radix
keys, then a radix select per row; ``kernels_ms`` splits its time between the two). ``--versions``
picks the indexer versions timed (each one's defaults; selections checked equal to the default
version's: ``v4_equals_v5``). The attention's versions 1-3 are timed in every cell, with version
3's other launches (``speedup_v3_over_v2``; ``kernels_ms`` and ``kernel_floor_fraction``: the
kernel alone, without the wrapper's offset resolution and launches).

    python -m bench.attn_kernels            # on the GPU, < 3 minutes; JSON to bench/results/
    python -m bench.attn_kernels --smoke    # tiny config on CPU through the Triton interpreter
    python -m bench.attn_kernels --no-sweep --no-attention --versions 3,4 --cells 0,2,1 --out attn_kernels_v4
        # version 3 against 4: decode, then prefill 16K @ 48K, then 4K @ 16K (the budget cuts the last)
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from asympd.model import attn_kernels as AK  # noqa: E402
from asympd.model import cuda_ops  # noqa: E402
from asympd.model.attention import select_candidate_blocks  # noqa: E402
from asympd.model.quant import fp4_qdq  # noqa: E402
from bench.common import ceilings, log, record, time_cuda  # noqa: E402

# version 5's select pass: the next chunk loaded early, 4-bit digits (four histograms of cheaper
# ballots instead of two), smaller chunks at more blocks per SM
V5_SELECTS = [
    {"digit": 8, "chunk": 4096, "num_warps": 8, "prefetch": False},  # the first default
    {"digit": 8, "chunk": 4096, "num_warps": 8}, {"digit": 8, "prefetch": False}, {"prefetch": False},
    {"chunk": 2048, "num_warps": 4, "digit": 8},
]  # fmt: skip
# version 5 (the Gluon kernel, attn_gluon.py, Hopper only; the default there since
# attn_kernels_attn6.json), timed beside version 3 by number. Measured slower than version 3 and not
# repeated: version 3 at 16 warps and with Triton's automatic warp specialization
# (attn_kernels_attn4.json), a version 4 splitting the output's head dim over two programs
# (attn_kernels_attn5.json, since removed)
ATTN_EXPERIMENTS = [{"version": 5}]
PEAK = {"TBps": 4.8, "TFLOPs": 989.0}  # H200 datasheet (/work/.library/device/H200.md)
BLOCK_TOKENS = 256  # positions per KV block: 256 entries at ratio 1, 128 at ratio 2


def timer(device: torch.device):
    def run(fn, iters: int) -> dict[str, Any]:
        if device.type == "cuda":
            return time_cuda(fn, iters=iters, warmup=1)
        fn()
        t = time.perf_counter()
        fn()
        return {"ms": (time.perf_counter() - t) * 1e3, "mode": "cpu", "iters": 1}

    return run


class Cell:
    """One batch of query rows over paged caches: S sequences of ``ctx`` tokens, ``q`` rows each
    at the sequence's last positions. Index keys and compressed entries live in pools of shuffled
    blocks sized for ratio 1; ratio-2 kinds read the first ctx/2 entries of the same pools."""

    def __init__(self, cfg, seqs: int, q: int, ctx: int, device: torch.device, gen: torch.Generator):
        self.cfg, self.seqs, self.q, self.ctx, self.device = cfg, seqs, q, ctx, device
        self.rows = seqs * q
        self.epb = BLOCK_TOKENS
        nb = -(-ctx // self.epb)
        order = torch.randperm(seqs * nb, device=device, generator=gen)
        self.tables = order.view(seqs, nb).to(torch.int32)
        dt = torch.bfloat16
        hd, d = cfg.index_head_dim, cfg.head_dim
        self.idx_pool = torch.empty(seqs * nb, self.epb, hd, device=device, dtype=dt)
        for b0 in range(0, seqs * nb, 1024):  # FP4-rounded keys, a slab at a time (fp32 temporaries)
            part = self.idx_pool[b0 : b0 + 1024]
            part.copy_(fp4_qdq(torch.randn(part.shape, device=device, generator=gen), 32))
        self.ckv_pool = torch.randn(seqs * nb, self.epb, d, device=device, generator=gen, dtype=dt) * 0.5
        self.row_seq = torch.arange(seqs, device=device).repeat_interleave(q).to(torch.int32)
        self.pos = (ctx - q + torch.arange(q, device=device)).repeat(seqs)
        h, ih = cfg.n_heads, cfg.index_n_heads
        self.qi = fp4_qdq(torch.randn(self.rows, ih, hd, device=device, generator=gen), 32).to(dt)
        self.w = (torch.randn(self.rows, ih, device=device, generator=gen) * (hd**-0.5 * ih**-0.5)).to(dt)
        self.qa = (torch.randn(self.rows, h, d, device=device, generator=gen) * 0.05).to(dt)
        self.sink = torch.randn(h, device=device, generator=gen)
        # each sequence's window: its last ctx positions' raw rows (q + W - 1 of them), flattened
        w = cfg.window_size
        self.win_rows = q + w - 1
        self.window_kv = torch.randn(seqs * self.win_rows, d, device=device, generator=gen, dtype=dt) * 0.5
        slot = torch.arange(q, device=device)[:, None] + torch.arange(w, device=device)[None, :]
        base = (torch.arange(seqs, device=device) * self.win_rows).repeat_interleave(q)[:, None]
        wpos = self.pos[:, None] - w + 1 + torch.arange(w, device=device)[None, :]
        self.window_idx = torch.where(wpos >= 0, base + slot.repeat(seqs, 1), -1)

    def visible(self, r: int) -> torch.Tensor:
        return (self.pos + 1) // r

    def keys_of(self, pool: torch.Tensor, s: int, n: int) -> torch.Tensor:
        """``read_index_keys`` / ``read_compressed``: a sequence's first n entries, contiguous."""
        e = torch.arange(n, device=self.device)
        rows = self.tables[s].long()[e // self.epb] * self.epb + e % self.epb
        return pool.view(-1, pool.size(-1)).index_select(0, rows)


# ---- the unfused path (per-sequence loops over the CUDA_KERNELS functions) -----------------------------


def unfused_select(cell: Cell, r: int, kind: str, cand: list[torch.Tensor] | None):
    cfg, out, cands = cell.cfg, [], []
    k = cfg.index_topk
    vis_all = cell.visible(r)
    for s in range(cell.seqs):
        sl = slice(s * cell.q, (s + 1) * cell.q)
        n = cell.ctx // r
        keys = cell.keys_of(cell.idx_pool, s, n)
        qi, wts, vis = cell.qi[sl], cell.w[sl], vis_all[sl]
        m = qi.size(0)
        kk = min(k, n)
        sel = torch.empty(m, kk, dtype=torch.long, device=cell.device)
        cmask = torch.empty(m, n, dtype=torch.bool, device=cell.device) if kind == "cand_source" else None
        step = max(1, min(m, cuda_ops.CUDA_KERNELS.score_bytes // (cfg.index_n_heads * n * 2 * 2)))
        cols = torch.arange(n, device=cell.device)
        for r0 in range(0, m, step):
            r1 = min(m, r0 + step)
            v = vis[r0:r1]
            sc = cuda_ops.indexer_scores(qi[r0:r1], keys, wts[r0:r1])
            sc.masked_fill_(cols >= v.unsqueeze(-1), float("-inf"))
            if cmask is not None:
                cmask[r0:r1] = select_candidate_blocks(
                    sc, v, cfg.candidate_topk_blocks, cfg.candidate_block_size, topk=cuda_ops.fast_topk
                )
            elif cand is not None:
                sc.masked_fill_(~cand[s][r0:r1], float("-inf"))
            idx = cuda_ops.fast_topk(sc, kk).sort(dim=-1).values
            sel[r0:r1] = torch.where(idx < v.unsqueeze(-1), idx, -1)
        out.append(sel)
        cands.append(cmask)
    return torch.cat(out), cands


def unfused_attention(cell: Cell, r: int, sel: torch.Tensor) -> torch.Tensor:
    cfg, outs = cell.cfg, []
    chunk = cuda_ops.CUDA_KERNELS.row_chunk
    scale = cfg.head_dim**-0.5
    for s in range(cell.seqs):
        lo = s * cell.q
        entries = cell.keys_of(cell.ckv_pool, s, cell.ctx // r)
        for r0 in range(lo, lo + cell.q, chunk):
            r1 = min(lo + cell.q, r0 + chunk)
            widx = cell.window_idx[r0:r1]
            keys, mask = cell.window_kv[widx.clamp_min(0)], widx >= 0
            sl = sel[r0:r1]
            keys = torch.cat([keys, entries[sl.clamp_min(0)]], dim=1)
            mask = torch.cat([mask, sl >= 0], dim=1)
            outs.append(cuda_ops.fast_sparse_attention(cell.qa[r0:r1], keys, mask, cell.sink, scale, True))
    return torch.cat(outs)


def batched_attention(cell: Cell, r: int, sel: torch.Tensor) -> torch.Tensor:
    """What the engine's batched path runs today (``Attention.core``): every row of the step at
    once in tiles of ``row_chunk`` rows, window rows and selected entries gathered straight through
    the block tables, then one ``fast_sparse_attention`` per tile: the strongest unfused baseline."""
    cfg, outs = cell.cfg, []
    chunk = cuda_ops.CUDA_KERNELS.row_chunk
    flat = cell.ckv_pool.view(-1, cell.ckv_pool.size(-1))
    for r0 in range(0, cell.rows, chunk):
        r1 = min(cell.rows, r0 + chunk)
        widx, sl = cell.window_idx[r0:r1], sel[r0:r1]
        e = sl.clamp_min(0)
        blocks = cell.tables[cell.row_seq[r0:r1].long()].long().gather(1, e // cell.epb)
        keys = torch.cat([cell.window_kv[widx.clamp_min(0)], flat[blocks * cell.epb + e % cell.epb]], dim=1)
        mask = torch.cat([widx >= 0, sl >= 0], dim=1)
        outs.append(cuda_ops.fast_sparse_attention(cell.qa[r0:r1], keys, mask, cell.sink, cfg.head_dim**-0.5, True))
    return torch.cat(outs)


# ---- the fused kernels --------------------------------------------------------------------------


def fused_select(cell: Cell, r: int, kind: str, cand_blocks: torch.Tensor | None, **kw):
    cfg, k = cell.cfg, cell.cfg.index_topk
    args = (cell.qi, cell.w, cell.idx_pool, cell.tables, cell.visible(r), k)
    if kind == "cand_source":
        return AK.indexer_topk_candidates(
            *args, cfg.candidate_topk_blocks, cfg.candidate_block_size, row_seq=cell.row_seq, max_entries=cell.ctx, **kw
        )
    if cand_blocks is not None:
        sel = AK.indexer_topk(
            *args, row_seq=cell.row_seq, candidates=cand_blocks, candidate_block=cfg.candidate_block_size, **kw
        )
    else:
        sel = AK.indexer_topk(*args, row_seq=cell.row_seq, **kw)
    return sel, None


def fused_attention(cell: Cell, sel: torch.Tensor, **kw) -> torch.Tensor:
    return AK.sparse_attention_paged(
        cell.qa, cell.window_kv, cell.window_idx, sel, cell.ckv_pool, cell.tables, cell.sink,
        cell.cfg.head_dim**-0.5, True, row_seq=cell.row_seq, **kw,
    )  # fmt: skip


# ---- floors and agreement -------------------------------------------------------------------------


def floors(flops: float, nbytes: float, ceil: dict[str, Any] | None) -> dict[str, float]:
    out = {
        "flops": flops,
        "bytes": nbytes,
        "floor_ms": max(flops / (PEAK["TFLOPs"] * 1e12), nbytes / (PEAK["TBps"] * 1e12)) * 1e3,
    }
    if ceil:
        out["floor_measured_ms"] = (
            max(flops / (ceil["bf16_gemm_TFLOPs"] * 1e12), nbytes / (ceil["copy_TBps"] * 1e12)) * 1e3
        )
    return out


def index_work(cell: Cell, r: int, kind: str, ceil) -> dict[str, float]:
    cfg = cell.cfg
    vis = cell.visible(r).double()
    h, hd, k = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    flops = float(vis.sum()) * h * hd * 2
    n = cell.ctx // r
    nbytes = cell.rows * h * (hd + 1) * 2 + cell.seqs * n * hd * 2 + cell.rows * k * 8
    if kind == "cand_source":  # block maxima out and back, the candidate mask
        nb = -(-n // cfg.candidate_block_size)
        nbytes += cell.rows * nb * (4 * 2 + 1)
    if kind == "reindex":
        nbytes += cell.rows * (-(-n // cfg.candidate_block_size))
    return floors(flops, nbytes, ceil)


def attention_work(cell: Cell, sel: torch.Tensor, ceil) -> dict[str, float]:
    cfg = cell.cfg
    h, d = cfg.n_heads, cfg.head_dim
    keys = float((cell.window_idx >= 0).sum() + (sel >= 0).sum())
    flops = keys * h * d * 2 * 2
    distinct = 0
    for s in range(cell.seqs):
        part = sel[s * cell.q : (s + 1) * cell.q]
        distinct += int(torch.unique(part[part >= 0]).numel())
    nbytes = cell.rows * h * d * 2 * 2 + (cell.window_kv.size(0) + distinct) * d * 2
    return floors(flops, nbytes, ceil)


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Selections ([rows, k], ascending then -1): identical rows, mean overlap of the valid ones."""
    big = torch.iinfo(torch.int64).max
    a2, b2 = torch.where(a < 0, big, a), torch.where(b < 0, big, b)
    pos = torch.searchsorted(b2, a2).clamp_max(b2.size(1) - 1)
    common = ((b2.gather(1, pos) == a2) & (a >= 0)).sum(1).double()
    valid = (b >= 0).sum(1).clamp_min(1).double()
    return {
        "rows_identical": float((a == b).all(1).double().mean()),
        "mean_overlap": float((common / valid).mean()),
        "valid_slots_equal": bool(torch.equal((a >= 0).sum(1), (b >= 0).sum(1))),
    }


# ---- the run --------------------------------------------------------------------------------------


def run_cell(
    cell: Cell,
    run,
    ceil,
    res: dict[str, Any],
    iters: int,
    sweep: bool,
    versions: tuple[int, ...] = (2, 3, 4),
    attention: bool = True,
    index: bool = True,
) -> None:
    cfg = cell.cfg
    out: dict[str, Any] = {}
    # index_r2: the ratio-2 index sources
    for kind, r in (("index_r2", 2), ("cand_source", 1), ("reindex", 1)) if index else ():
        row: dict[str, Any] = index_work(cell, r, kind, ceil)
        cand_e = cand_b = None
        if kind == "reindex":
            _, cand_e = unfused_select(cell, 1, "cand_source", None)
            cand_b = torch.cat([c[:, :: cfg.candidate_block_size] for c in cand_e])
        ref, ref_cand = unfused_select(cell, r, kind, cand_e)
        got, got_cand = fused_select(cell, r, kind, cand_b)
        row["agree"] = agreement(got, ref)
        base = AK.INDEXER_VERSION  # ``got``: the default version's selection; every version timed must equal it
        for v in versions:
            if v != base:
                try:
                    same: bool | str = torch.equal(fused_select(cell, r, kind, cand_b, version=v)[0], got)
                except Exception as e:  # a version that does not compile here: the timing loop says so too
                    same = f"{type(e).__name__}: {str(e)[:200]}"
                row["agree"][f"v{min(v, base)}_equals_v{max(v, base)}"] = same
        if kind == "cand_source":
            expanded = got_cand.repeat_interleave(cfg.candidate_block_size, 1)
            want = torch.cat(ref_cand)
            row["agree"]["candidate_rows_identical"] = float(
                (expanded[:, : want.size(1)] == want).all(1).double().mean()
            )
        row["unfused"] = run(lambda r=r, kind=kind, ce=cand_e: unfused_select(cell, r, kind, ce), iters)
        # the chosen versions' defaults in every cell (old against new in one run); in decode also
        # versions 3 and 4 with each row tile's entries split over 2 programs (256 tiles fill the
        # resident blocks, so neither default splits there: whether splitting pays anyway), and
        # version 4 without its register cap (64-entry tiles at one block per SM: what the tile
        # size alone does, apart from the second block)
        configs: list[dict[str, Any]] = [{"version": v} for v in versions]
        if cell.q <= 16:
            configs += [{"version": v, "splits": 2} for v in versions if v in (3, 4)]
            if 4 in versions:
                configs.append({"version": 4, "maxnreg": 0})
        if 5 in versions:  # version 5's select launches, then its score tilings
            configs += [{"version": 5, "select": sel} for sel in V5_SELECTS]
            if cell.q <= 16:
                configs += [{"version": 5, "num_warps": 4}, {"version": 5, "block_n": 128}]
            else:
                configs += [{"version": 5, "rows_per_tile": 4}]
        if sweep:  # then other tilings; Triton's sort as the fallback should the bitonic one fail
            configs += [{"version": 1}, {"version": 3, "rows_per_tile": 4}, {"version": 3, "rows_per_tile": 8},
                        {"version": 3, "block_n": 64}, {"version": 3, "block_n": 128},
                        {"version": 3, "num_warps": 4, "block_n": 64}, {"version": 3, "splits": 4},
                        {"version": 1, "sort_impl": "triton"}]  # fmt: skip
        for kw in configs:
            try:
                t = run(lambda r=r, kind=kind, cb=cand_b, kw=kw: fused_select(cell, r, kind, cb, **kw), iters)
            except Exception as e:  # a config that does not compile or fit: say so, keep going
                row.setdefault("config_errors", {})[str(kw)] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            t["config"] = kw
            # every config selects what the default does (splits, tiles, register caps included)
            t["selections_equal_default"] = bool(torch.equal(fused_select(cell, r, kind, cand_b, **kw)[0], got))
            if kw.get("version") == 5 and cell.device.type == "cuda":  # its two passes, apart
                t["kernels_ms"] = kernel_times(lambda r=r, k=kind, cb=cand_b, kw=kw: fused_select(cell, r, k, cb, **kw))
            row.setdefault("fused_configs", []).append(t)
        pick_best(row)
        finish(row)
        out[kind] = row
        log(cell_name(cell), kind, summary(row))
    if not attention:  # the indexer's kinds only (--no-attention)
        res["cells"][cell_name(cell)] = out
        return
    # attention over the ratio-1 selection (every compressed layer moves the same work)
    ref_sel, _ = unfused_select(cell, 1, "index_r2", None)
    row = attention_work(cell, ref_sel, ceil)
    want = unfused_attention(cell, 1, ref_sel).float()
    got = fused_attention(cell, ref_sel).float()
    got_v1 = fused_attention(cell, ref_sel, version=1).float()
    got_v2 = fused_attention(cell, ref_sel, version=2).float()
    row["agree"] = {
        "rel_err": float((got - want).norm() / want.norm()),
        "rel_err_v1": float((got_v1 - want).norm() / want.norm()),
        "rel_err_v2": float((got_v2 - want).norm() / want.norm()),
        # the default (version 5 on Hopper since 212f12c, else 3; results before it: v3_vs_v2)
        "rel_err_default_vs_v2": float((got - got_v2).norm() / got_v2.norm()),
    }
    batched = batched_attention(cell, 1, ref_sel).float()
    row["agree"]["batched_rel_err"] = float((batched - want).norm() / want.norm())
    row["unfused"] = run(lambda: unfused_attention(cell, 1, ref_sel), iters)
    row["batched"] = run(lambda: batched_attention(cell, 1, ref_sel), iters)
    configs = [{"version": 1}, {"version": 2}, {"version": 3}]
    # version 3's other launches (its default: 32-key tiles, two stages in flight)
    configs += [{"version": 3, "block_n": bn, "num_stages": st} for bn, st in ((16, 2), (16, 3), (32, 3))]
    configs += ATTN_EXPERIMENTS
    if sweep:
        configs += [{"version": 1, "block_h": bh, "block_n": bn} for bh in (32, 64) for bn in (16, 32)]
        configs += [{"version": 2, "block_n": 32}, {"version": 2, "block_h": 32, "block_n": 32}]
    for kw in configs:
        try:
            t = run(lambda kw=kw: fused_attention(cell, ref_sel, **kw), iters)
        except Exception as e:
            row.setdefault("config_errors", {})[str(kw)] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        t["config"] = kw
        got_kw = fused_attention(cell, ref_sel, **kw).float()  # every launch's output against the reference
        t["rel_err"] = float((got_kw - want).norm() / want.norm())
        if kw.get("version", 0) >= 2 and cell.device.type == "cuda":  # the kernel apart from the wrapper's work
            t["kernels_ms"] = kernel_times(lambda kw=kw: fused_attention(cell, ref_sel, **kw))
            attn = sum(ms for name, ms in t["kernels_ms"].items() if "_sparse_attn" in name)  # v5's too
            t["kernel_floor_fraction"] = row["floor_ms"] / attn if attn else None
        row.setdefault("fused_configs", []).append(t)
    pick_best(row)
    finish(row)
    out["attention"] = row
    log(cell_name(cell), "attention", summary(row))
    res["cells"][cell_name(cell)] = out


def profile_cell(cell: Cell) -> None:
    """Each default kernel once, after one warm-up launch each (compiles stay out of the profile):
    under ``ncu -k regex:... --launch-skip 1 --launch-count 1`` this is one launch per kernel."""
    cfg = cell.cfg
    _, cand_e = unfused_select(cell, 1, "cand_source", None)
    cand_b = torch.cat([c[:, :: cfg.candidate_block_size] for c in cand_e])
    for _ in range(2):
        sel, _ = fused_select(cell, 2, "index_r2", None)
        fused_select(cell, 1, "cand_source", None)
        fused_select(cell, 1, "reindex", cand_b)
        fused_attention(cell, sel)
    if cell.device.type == "cuda":
        torch.cuda.synchronize()
    log(cell_name(cell), "profiled")


def kernel_times(fn) -> dict[str, float]:
    """One call under the profiler, after a warm one: GPU time per kernel name (ms), summed."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        ms = ev.self_device_time_total / 1e3
        if ms > 0:
            out[ev.key[:60]] = round(out.get(ev.key[:60], 0.0) + ms, 4)
    return out


def pick_best(row: dict[str, Any]) -> None:
    """``fused``: the fastest config; ``fused_v1`` .. ``fused_v3``: each version's defaults (the
    first config timed of each), their floor fractions, and each version's speed-up over the one
    before it in the same run (the indexer times v2 and v3 in every cell, v1 in the sweep;
    attention has v1 to v3)."""
    timed = row.get("fused_configs", [])
    row["fused"] = min(timed, key=lambda t: t["ms"], default=None)
    for v in (1, 2, 3, 4, 5):
        first = next((t for t in timed if t["config"].get("version") == v), None)
        if first is not None:
            row[f"fused_v{v}"] = first
            row[f"floor_fraction_v{v}"] = row["floor_ms"] / first["ms"]
    for old, new in ((1, 2), (2, 3), (3, 4), (4, 5)):
        if f"fused_v{old}" in row and f"fused_v{new}" in row:
            row[f"speedup_v{new}_over_v{old}"] = row[f"fused_v{old}"]["ms"] / row[f"fused_v{new}"]["ms"]


def finish(row: dict[str, Any]) -> None:
    if row.get("fused"):
        row["speedup"] = row["unfused"]["ms"] / row["fused"]["ms"]
        row["floor_fraction_fused"] = row["floor_ms"] / row["fused"]["ms"]
    row["floor_fraction_unfused"] = row["floor_ms"] / row["unfused"]["ms"]
    if row.get("fused") and row.get("batched"):  # against the engine's own batched path (attention)
        row["speedup_vs_batched"] = row["batched"]["ms"] / row["fused"]["ms"]


def summary(row: dict[str, Any]) -> str:
    f = row.get("fused") or {}
    return (
        f"fused {f.get('ms', float('nan')):.3f} ms ({row.get('floor_fraction_fused', 0) * 100:.0f}% of floor) "
        f"unfused {row['unfused']['ms']:.3f} ms ({row['floor_fraction_unfused'] * 100:.0f}%) "
        f"floor {row['floor_ms']:.3f} ms speedup {row.get('speedup', 0):.2f}x "
        f"v2/v1 {row.get('speedup_v2_over_v1', 0):.2f}x v3/v2 {row.get('speedup_v3_over_v2', 0):.2f}x "
        f"v4/v3 {row.get('speedup_v4_over_v3', 0):.2f}x v5/v4 {row.get('speedup_v5_over_v4', 0):.2f}x "
        + "".join(
            f"v{v} {row[f'fused_v{v}']['ms']:.3f} ms ({row[f'floor_fraction_v{v}'] * 100:.0f}%) "
            for v in (2, 3, 4, 5)
            if f"fused_v{v}" in row
        )
        + (f"batched {row['batched']['ms']:.3f} ms ({row['speedup_vs_batched']:.2f}x) " if "batched" in row else "")
        + f"agree {row['agree']}"
        + (
            f" configs_select_equal {all(t['selections_equal_default'] for t in row['fused_configs'])}"
            if row.get("fused_configs") and "selections_equal_default" in row["fused_configs"][0]
            else ""
        )
    )


def cell_name(cell: Cell) -> str:
    kind = "decode" if cell.q <= 16 else "prefill"
    return f"{kind}_{cell.seqs}x{cell.q}_ctx{cell.ctx}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU: plumbing only")
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no new cell after this")
    ap.add_argument("--no-sweep", action="store_true", help="default kernel configs only")
    ap.add_argument("--cells", default="", help="comma-separated cell indices to run, in that order (default: all)")
    ap.add_argument("--versions", default="2,3,4", help="indexer versions timed, each at its defaults")
    ap.add_argument("--no-attention", action="store_true", help="the indexer's kinds only")
    ap.add_argument("--attention-only", action="store_true", help="the attention only (no indexer kinds)")
    ap.add_argument("--out", default="", help="the JSON's name under bench/results/ (default attn_kernels)")
    ap.add_argument(
        "--profile", action="store_true", help="one launch of each default fused kernel per cell (for ncu); no JSON"
    )
    args = ap.parse_args()
    started = time.time()
    from asympd.config import tiny, v41_flash

    if args.smoke:
        cfg, device = tiny(), torch.device("cpu")
        cells = [(3, 2, 40), (1, 24, 48)]
        iters = 1
    else:
        cfg, device = v41_flash(), torch.device("cuda")
        # decode first (cheap), then the prefill cells by importance
        cells = [(256, 4, 65536), (1, 4096, 16384), (1, 16384, 49152), (1, 4096, 49152), (1, 16384, 16384)]
        iters = 3
    name = args.out or ("attn_kernels_smoke" if args.smoke else "attn_kernels")
    res: dict[str, Any] = {"config": "tiny" if args.smoke else "v41-flash", "peak": PEAK, "cells": {}}
    ceil = None
    if device.type == "cuda":
        ceil = ceilings()
        res["ceilings"] = ceil
        log("ceilings", ceil)
    run = timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    # the cells asked for, in the order given (the budget cuts the last ones first)
    order = [int(c) for c in args.cells.split(",") if c] or list(range(len(cells)))
    order = [i for i in order if i < len(cells)]  # --smoke has two cells: the GPU command runs as is
    for i in order:
        seqs, q, ctx = cells[i]
        if args.profile:
            profile_cell(Cell(cfg, seqs, q, ctx, device, gen))
            continue
        if time.time() - started > args.budget_s:
            res.setdefault("skipped", []).append([seqs, q, ctx])
            continue
        t0 = time.time()
        try:
            cell = Cell(cfg, seqs, q, ctx, device, gen)
            versions = tuple(int(v) for v in args.versions.split(",") if v)
            sweep = not args.no_sweep and i == 0
            run_cell(
                cell, run, ceil, res, iters, sweep, versions=versions, attention=not args.no_attention,
                index=not args.attention_only,
            )  # fmt: skip
            del cell
        except Exception as e:  # keep going: later cells still report
            res.setdefault("errors", {})[f"{seqs}x{q}@{ctx}"] = traceback.format_exc()[-3000:]
            log(f"cell {seqs}x{q}@{ctx} failed: {e}")
        res.setdefault("cell_s", {})[f"{seqs}x{q}@{ctx}"] = round(time.time() - t0, 1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        record(name, res, started)
    if args.profile:
        return
    path = record(name, res, started)
    log("wrote", path)


if __name__ == "__main__":
    main()
