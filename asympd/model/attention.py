"""Latent sparse attention of one layer: a sliding window of raw KV plus, on compressed layers,
the top-k entries of the shared compressed KV, chosen by the lightning indexer.

Rows arrive flattened across sequences (ragged q_len); each sequence's rows are one ``SegmentView``
that carries its cache view and the bounds of what it may see:
- the window floor: rows replayed from a boundary b see window keys only at positions >= b
  (bounded replay), by design not bit-identical to full windows;
- ``write_global``: False when the compressed KV and index keys of these rows already exist (a
  replay on D in the symmetric and encoder-only modes), so nothing global is rewritten.

The compressed entry j of a ratio-r source pools positions [j*r, (j+1)*r) and is rotated at
position j*r; a query at position i sees entries 0 .. (i+1)//r - 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from asympd.config import ModelConfig
from asympd.kv.batch import BatchRows, WindowIndex, find_positions
from asympd.kv.spec import GroupKind
from asympd.model.ops import (
    QLinear,
    apply_rope,
    fp4_qdq,
    linear_f32,
    ordered_sum,
    rms_norm,
    rope_frequencies,
    stable_topk,
)
from asympd.model.quant import fp8_qdq


class SequenceKV(Protocol):
    """What a layer reads and writes of one sequence's caches (kv/ implements it, paged)."""

    def read_compressed(self, layer: int, n: int) -> torch.Tensor: ...
    def write_compressed(self, layer: int, start: int, entries: torch.Tensor) -> None: ...
    def read_index_keys(self, layer: int, n: int) -> torch.Tensor: ...
    def write_index_keys(self, layer: int, start: int, keys: torch.Tensor) -> None: ...
    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def append_window(self, layer: int, positions: torch.Tensor, kv: torch.Tensor) -> None: ...
    def pending(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def append_pending(self, layer: int, positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor) -> None: ...


@dataclass
class SegmentView:
    """One sequence's rows inside a layer's flattened batch."""

    kv: SequenceKV
    lo: int  # first row in the layer's batch
    hi: int  # one past the last row
    start: int  # absolute position of row `lo`
    floor: int = 0  # window keys below this position are invisible
    write_global: bool = True
    shared: dict[str, Any] = field(default_factory=dict)  # selections/candidates handed down the stack
    device: torch.device = torch.device("cpu")

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.hi - self.lo, device=self.device)


def rotations(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of the rotation table for these positions, computed exactly as the table would be."""
    angles = positions.float().unsqueeze(-1) * freqs.to(positions.device).unsqueeze(0)
    return torch.polar(torch.ones_like(angles), angles)


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    round_probs: bool,
) -> torch.Tensor:
    """Single-latent attention (K = V) with an attention sink. q [m, h, d]; keys [m, n, d] gathered
    per query; key_mask [m, n] (False = not visible). The sink joins the softmax denominator only.
    A row with nothing visible returns zeros. ``round_probs`` rounds probabilities to bf16 before
    the value product, as the reference kernel does in a bf16 run."""
    logits = torch.einsum("mhd,mnd->mhn", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~key_mask.unsqueeze(1), float("-inf"))
    top = logits.amax(dim=-1).clamp_min(-1e30)
    p = torch.exp(logits - top.unsqueeze(-1))
    denom = p.sum(-1) + torch.exp(sink.float() - top)
    if round_probs:
        p = p.to(torch.bfloat16).float()
    out = torch.einsum("mhn,mnd->mhd", p, keys.float()) / denom.unsqueeze(-1)
    return out.to(q.dtype)


def select_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int, topk=stable_topk
) -> torch.Tensor:
    """Level one of the two-level top-k: per query keep the ``topk_blocks`` blocks of ``block``
    positions with the best entry. The block holding the query's newest visible entry is always
    kept. Returns a bool mask shaped like scores [m, n]. ``topk`` must break ties like
    ``stable_topk`` (the CUDA path passes its radix version)."""
    n = scores.size(-1)
    padded = F.pad(scores, (0, -n % block), value=float("-inf"))
    block_scores = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    nb = block_scores.size(-1)
    newest = (visible - 1).div(block, rounding_mode="floor")
    pinned = torch.arange(nb, device=scores.device) == newest.unsqueeze(-1)
    block_scores = block_scores.masked_fill(pinned, float("inf"))
    top = topk(block_scores, min(topk_blocks, nb))
    keep = torch.zeros_like(block_scores, dtype=torch.bool)
    keep.scatter_(-1, top, block_scores.gather(-1, top) > float("-inf"))
    # each block's verdict repeated over its positions (expand: no host sync, graph-capturable)
    return keep.unsqueeze(-1).expand(*keep.shape, block).flatten(-2)[..., :n]


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_h weights[..., m, h] * relu(q[..., m, h, :] . keys[..., n, :]) -> fp32 [..., m, n]: per-head
    scores in the model dtype, weighted and summed in it, as the reference. q [..., m, h, d],
    keys [..., n, d] with the same leading dims (none: one sequence's rows)."""
    *lead, m, h, d = q.shape
    s = torch.matmul(q.reshape(*lead, m * h, d), keys.transpose(-1, -2)).relu()
    return (s.view(*lead, m, h, -1) * weights.unsqueeze(-1)).sum(dim=-2).float()


@dataclass(frozen=True)
class AttentionKernels:
    """The device-specific pieces of attention (the model's math is the same on every device):
    the reference's functions by default, the CUDA ones from ``cuda_ops.CUDA_KERNELS``."""

    sparse_attention: Callable[..., torch.Tensor] = sparse_attention
    topk: Callable[[torch.Tensor, int], torch.Tensor] = stable_topk
    indexer_scores: Callable[..., torch.Tensor] = indexer_scores
    row_chunk: int = 2048  # query rows per gathered-key tile
    score_bytes: int = 1 << 30  # indexer score tile budget
    fused_indexer: bool = False  # the batched path scores and selects in one kernel (attn_kernels.py)
    # the batched path attends in one kernel reading the ring buffer, this step's rows and the pool in
    # place (attn_kernels.sparse_attention_paged), instead of gathering keys per row tile
    fused_attention: bool = False


REFERENCE_KERNELS = AttentionKernels()


class Attention(torch.nn.Module):
    kernels: AttentionKernels = REFERENCE_KERNELS

    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, Any], round_probs: bool):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.ratio(layer)
        self.source = cfg.kv_source_of(layer)
        self.is_source = self.source == layer
        self.is_index_source = layer < cfg.n_layers and layer in cfg.index_source_layers
        self.is_candidate_source = cfg.has_candidates and layer == cfg.candidate_source_layer
        self.uses_candidates = cfg.has_candidates and self.is_index_source and cfg.candidate_source_layer < layer
        self.round_probs = round_probs
        self.scale = cfg.head_dim**-0.5
        # window-only layers keep plain RoPE; compressed layers use their own theta with YaRN
        if self.ratio:
            theta, orig = cfg.compress_rope_theta, cfg.original_seq_len
        else:
            theta, orig = cfg.rope_theta, 0
        self.freqs = rope_frequencies(cfg.rope_head_dim, theta, orig, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
        self.attn_sink = w.get("attn_sink")
        self.wq_a, self.wq_b, self.wkv = w.get("wq_a"), w.get("wq_b"), w.get("wkv")
        self.q_norm, self.kv_norm = w.get("q_norm"), w.get("kv_norm")
        self.wo_a, self.wo_b = w.get("wo_a"), w.get("wo_b")
        self.comp_wkv, self.comp_wgate, self.comp_norm = (
            w.get("compressor.wkv"),
            w.get("compressor.wgate"),
            w.get("compressor.norm"),
        )
        self.idx_wq_b, self.idx_weights = w.get("indexer.wq_b"), w.get("indexer.weights_proj")
        self.idx_wk, self.idx_k_norm = w.get("indexer.wk"), w.get("indexer.k_norm")

    # ---- the KV path: all the prefill worker runs of the last KV source ------------------------

    def kv_path(self, x: torch.Tensor, segs: list[SegmentView] | BatchRows) -> None:
        """Compress these rows into the shared KV and index keys (x: the normed layer input)."""
        if isinstance(segs, BatchRows):
            return self._write_compressed_batched(segs, x)
        for seg in segs:
            if seg.write_global:
                self._write_compressed(seg, x[seg.lo : seg.hi])

    def _write_compressed(self, seg: SegmentView, x: torch.Tensor) -> None:
        cfg, r, positions = self.cfg, self.ratio, seg.positions
        if r == 1:
            latent = rms_norm(self.comp_wkv(x), self.comp_norm, cfg.norm_eps)
            first = seg.start
        else:
            kv, score = linear_f32(x, self.comp_wkv.weight), linear_f32(x, self.comp_wgate.weight)
            hist_kv, hist_score, hist_pos = seg.kv.pending(self.layer)
            group_start = (seg.start // r) * r
            open_rows = (hist_pos >= group_start) & (hist_pos < seg.start)
            if int(open_rows.sum()) != seg.start - group_start:
                raise RuntimeError(
                    f"layer {self.layer}: compressor needs the open group's {seg.start - group_start} rows "
                    f"before position {seg.start}, cache holds {int(open_rows.sum())}"
                )
            all_kv = torch.cat([hist_kv[open_rows].float(), kv])
            all_score = torch.cat([hist_score[open_rows].float(), score])
            seg.kv.append_pending(self.layer, positions, kv, score)
            n_groups = (seg.start + len(positions)) // r - seg.start // r
            if n_groups == 0:
                return
            kv_g = all_kv[: n_groups * r].unflatten(0, (n_groups, r))
            score_g = all_score[: n_groups * r].unflatten(0, (n_groups, r))
            weights = torch.exp(score_g - score_g.amax(dim=1, keepdim=True))  # softmax over the group
            pooled = ordered_sum(kv_g * (weights / ordered_sum(weights, 1, keepdim=True)), 1)
            latent = rms_norm(pooled.to(x.dtype), self.comp_norm, cfg.norm_eps)
            first = seg.start // r
        if latent.size(0) == 0:
            return
        rot = rotations(self.freqs, torch.arange(first, first + latent.size(0), device=latent.device) * r)
        # index keys come from the latent before RoPE, then get their own rotation and FP4
        k = rms_norm(self.idx_wk(latent), self.idx_k_norm, cfg.norm_eps)
        k = fp4_qdq(apply_rope(k, rot, cfg.rope_head_dim), 32)
        seg.kv.write_index_keys(self.layer, first, k)
        entries = fp4_qdq(apply_rope(latent, rot, cfg.rope_head_dim), 16, e4m3_scale=True)
        seg.kv.write_compressed(self.layer, first, entries)

    # ---- the indexer -------------------------------------------------------------------------

    def _select(
        self, seg: SegmentView, x: torch.Tensor, qr: torch.Tensor, visible: torch.Tensor, n: int
    ) -> torch.Tensor:
        """Top-k compressed entries per query ([m, k] int64, -1 = unused slot)."""
        cfg = self.cfg
        m = x.size(0)
        if n == 0:
            return torch.empty(m, 0, dtype=torch.long, device=x.device)
        rot = rotations(self.freqs, seg.positions)
        q = self.idx_wq_b(qr).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q = fp4_qdq(apply_rope(q, rot, cfg.rope_head_dim), 32)
        keys = seg.kv.read_index_keys(self.source, n).to(q.dtype)
        weights = self.idx_weights(x) * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        scores = self.kernels.indexer_scores(q, keys, weights)
        scores = scores.masked_fill(torch.arange(n, device=scores.device) >= visible.unsqueeze(-1), float("-inf"))
        if self.is_candidate_source:
            seg.shared["candidates"] = select_candidate_blocks(
                scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size, topk=self.kernels.topk
            )
        elif self.uses_candidates:
            scores = scores.masked_fill(~seg.shared["candidates"], float("-inf"))
        idx = self.kernels.topk(scores, min(cfg.index_topk, n)).sort(dim=-1).values
        return torch.where(idx < visible.unsqueeze(-1), idx, -1)

    # ---- the full layer ----------------------------------------------------------------------

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(rotations, q latent, rotated queries, rotated FP8-rounded window KV) of every row."""
        cfg = self.cfg
        rot = rotations(self.freqs, positions)
        qr = rms_norm(self.wq_a(x), self.q_norm, cfg.norm_eps)
        q = self.wq_b(qr).unflatten(-1, (cfg.n_heads, cfg.head_dim))
        q = apply_rope(q, rot, cfg.rope_head_dim, inplace=True)
        kv = rms_norm(self.wkv(x), self.kv_norm, cfg.norm_eps)
        kv = fp8_qdq(apply_rope(kv, rot, cfg.rope_head_dim), 32)
        return rot, qr, q, kv

    def forward(self, x: torch.Tensor, segs: list[SegmentView] | BatchRows) -> torch.Tensor:
        if isinstance(segs, BatchRows):
            return self._forward_batched(x, segs)
        rot, qr, q, kv = self.project(x, torch.cat([s.positions for s in segs]))
        outs = []
        for seg in segs:
            sl = slice(seg.lo, seg.hi)
            keys, mask = self._window_keys(seg, kv[sl])
            if self.ratio:
                if self.is_source and seg.write_global:
                    self._write_compressed(seg, x[sl])
                entries, valid = self._compressed_keys(seg, x[sl], qr[sl])
                keys, mask = torch.cat([keys, entries.to(keys.dtype)], dim=1), torch.cat([mask, valid], dim=1)
            outs.append(self.kernels.sparse_attention(q[sl], keys, mask, self.attn_sink, self.scale, self.round_probs))
        return self.output(torch.cat(outs), rot)

    def output(self, out: torch.Tensor, rot: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """The attention output [rows, heads, head_dim] un-rotated and projected back to dim
        (``inplace``: ``out`` is a fresh tensor the caller drops, un-rotated where it lies)."""
        cfg = self.cfg
        o = apply_rope(out, rot, cfg.rope_head_dim, inverse=True, inplace=inplace)
        # wo_a is block-diagonal over output groups: each group projects only its own heads
        o = self.wo_a.grouped(o.reshape(o.size(0), cfg.o_groups, -1))
        return self.wo_b(o.flatten(1))

    def _window_keys(self, seg: SegmentView, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's window as W fixed slots (slot j holds position i-W+1+j), so a query's
        reductions run over the same layout however its rows were chunked or batched. Appends
        these rows to the window cache."""
        w = self.cfg.window_size
        pos = seg.positions
        prev_kv, prev_pos = seg.kv.window(self.layer)
        keep = prev_pos < seg.start  # rows being recomputed replace the old ones
        all_kv = torch.cat([prev_kv[keep].to(kv.dtype), kv])
        all_pos = torch.cat([prev_pos[keep].to(pos.device), pos])
        seg.kv.append_window(self.layer, seg.positions, kv)
        want = pos.unsqueeze(-1) - w + 1 + torch.arange(w, device=kv.device)
        idx = torch.searchsorted(all_pos, want).clamp_max(all_pos.numel() - 1)
        valid = (all_pos[idx] == want) & (want >= seg.floor) & (want >= 0)
        return all_kv[idx], valid

    def selection(
        self, seg: SegmentView, x: torch.Tensor, qr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the selected compressed entries per query, ``index_topk`` fixed slots with -1 for unused
        ones; the entries they index, None while there are none). Index sources select with
        ``_select``; the layers after them reuse the latest selection."""
        pos = seg.positions
        n = (seg.start + len(pos)) // self.ratio
        if self.is_index_source:
            sel = self._select(seg, x, qr, (pos + 1) // self.ratio, n)
            seg.shared[f"selection.{self.ratio}"] = sel
        else:
            sel = seg.shared[f"selection.{self.ratio}"]
        sel = F.pad(sel, (0, self.cfg.index_topk - sel.size(1)), value=-1)
        return sel, (seg.kv.read_compressed(self.source, n) if n else None)

    def _compressed_keys(
        self, seg: SegmentView, x: torch.Tensor, qr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected entries gathered per query, and which slots are real."""
        sel, entries = self.selection(seg, x, qr)
        if entries is None:
            return x.new_zeros(*sel.shape, self.cfg.head_dim), torch.zeros_like(sel, dtype=torch.bool)
        return entries[sel.clamp_min(0)], sel >= 0

    # ---- the batched path: every sequence of a step at once, straight from the paged caches ------

    def _forward_batched(self, x: torch.Tensor, view: BatchRows) -> torch.Tensor:
        """``forward`` for a whole step: the same per-row math (each query's window as W fixed slots,
        then its ``index_topk`` selected entries), with no loop over sequences."""
        rot, qr, q, kv = self.project(x, view.positions)
        return self.output(self.core(x, rot, qr, q, kv, view), rot, inplace=True)

    def core(
        self, x: torch.Tensor, rot: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, view: BatchRows
    ) -> torch.Tensor:
        """The part of the batched forward that reads and writes the caches (between ``project`` and
        ``output``): [rows, heads, head_dim], still rotated. Piecewise CUDA graphs run it eagerly."""
        cfg = self.cfg
        win = view.window_index(self.layer, cfg.window_size)
        sel = None
        if self.ratio:
            if self.is_source:
                self._write_compressed_batched(view, x)
            sel = self._selection_batched(view, x, qr, rot)
        attend = self._attend_fused if self.kernels.fused_attention else self._attend_gathered
        out = attend(q, kv, win, sel, view)
        view.append_window(self.layer, kv)  # after the reads: the slots are rewritten in place
        return out

    def _attend_gathered(
        self, q: torch.Tensor, kv: torch.Tensor, win: WindowIndex, sel: torch.Tensor | None, view: BatchRows
    ) -> torch.Tensor:
        """``core``'s attention with each row tile's keys gathered ([rows, W + k, d]), then
        ``kernels.sparse_attention``: the reference's arrangement."""
        out = torch.empty_like(q)
        step = self.kernels.row_chunk
        for r0 in range(0, q.size(0), step):
            r1 = min(q.size(0), r0 + step)
            keys, mask = win.gather(kv, r0, r1), win.visible[r0:r1]
            if sel is not None:
                s = sel[r0:r1]
                seg = view.row_seg[r0:r1].unsqueeze(-1).expand_as(s)
                ent = view.gather_entries(GroupKind.COMPRESSED, self.source, seg, s).to(keys.dtype)
                keys, mask = torch.cat([keys, ent], dim=1), torch.cat([mask, s >= 0], dim=1)
            out[r0:r1] = self.kernels.sparse_attention(
                q[r0:r1], keys, mask, self.attn_sink, self.scale, self.round_probs
            )
        return out

    def _attend_fused(
        self, q: torch.Tensor, kv: torch.Tensor, win: WindowIndex, sel: torch.Tensor | None, view: BatchRows
    ) -> torch.Tensor:
        """``core``'s attention in one kernel launch (Gluon on Hopper, else Triton:
        ``attn_kernels.sparse_attention_paged``): the same keys per row (its W window slots, then
        its selected entries; the sink) read in place -- window slots from the ring buffer or from
        this step's ``kv`` (encoded as one index, -2 - row for the latter), entries from the pool
        through the block tables. Device ops only: a captured step captures it."""
        from asympd.model import attn_kernels

        widx = torch.where(win.visible, torch.where(win.is_new, -2 - win.new, win.old), -1)
        if sel is None:  # a window-only layer: no entries (a one-row pool stands in, never read)
            sel = torch.empty(q.size(0), 0, dtype=torch.long, device=q.device)
            pool = win.cache_rows.new_zeros(1, 1, q.size(-1))
        else:
            pool = view.batch.cache.pools[f"{GroupKind.COMPRESSED.value}.{self.source}"]
        return attn_kernels.sparse_attention_paged(
            q, win.cache_rows, widx, sel, pool, view.seg("block_table"), self.attn_sink, self.scale,
            self.round_probs, row_seq=view.row_seg, window_new=kv,
        )  # fmt: skip

    def _write_compressed_batched(self, view: BatchRows, x: torch.Tensor) -> None:
        """``_write_compressed`` for every segment that writes global KV."""
        cfg, r = self.cfg, self.ratio
        wg = view.host("write_global")
        if not wg.any():
            return
        valid = None
        if r == 1:
            rows = None if wg.all() else view.take_rows(wg)
            xs = x if rows is None else x[rows]
            latent = rms_norm(self.comp_wkv(xs), self.comp_norm, cfg.norm_eps)
            seg = view.row_seg if rows is None else view.row_seg[rows]
            entry = view.positions if rows is None else view.positions[rows]
        else:
            kv, score = linear_f32(x, self.comp_wkv.weight), linear_f32(x, self.comp_wgate.weight)
            groups = self._written_groups(view)
            latent = None
            if groups is not None:
                seg, entry, valid = groups
                kv_g, score_g = self._group_rows(view, kv, score, seg, entry)
                weights = torch.exp(score_g - score_g.amax(dim=1, keepdim=True))  # softmax over the group
                pooled = ordered_sum(kv_g * (weights / ordered_sum(weights, 1, keepdim=True)), 1)
                latent = rms_norm(pooled.to(x.dtype), self.comp_norm, cfg.norm_eps)
            view.append_pending(self.layer, kv, score)  # after the reads of the open groups
            if latent is None:
                return
        rot = rotations(self.freqs, entry * r)
        k = rms_norm(self.idx_wk(latent), self.idx_k_norm, cfg.norm_eps)
        k = fp4_qdq(apply_rope(k, rot, cfg.rope_head_dim), 32)
        entries = fp4_qdq(apply_rope(latent, rot, cfg.rope_head_dim), 16, e4m3_scale=True)
        view.write_entries(self.layer, seg, entry, entries, k, valid)

    def _written_groups(self, view: BatchRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(segment, entry, valid) of the compressor groups the step writes, or None if none: each
        group it completes in a segment that writes global KV (``valid`` None: all are). In a
        captured step (``fixed_groups``) the same shape whatever the positions: ceil(rows / ratio)
        groups per segment from its first open one, those not completed marked not ``valid``."""
        r = self.ratio
        if view.batch.fixed_groups:
            n_groups = -(-int(view.host("rows").max()) // r)
            n_seg = view.s1 - view.s0
            seg = torch.arange(n_seg, device=view.device).repeat_interleave(n_groups)
            start, rows = view.seg("start")[seg], view.seg("rows")[seg]
            entry = start // r + torch.arange(n_groups, device=view.device).repeat(n_seg)
            return seg, entry, ((entry + 1) * r <= start + rows) & view.seg("write_global")[seg]
        wg, start, n_rows = view.host("write_global"), view.host("start"), view.host("rows")
        groups = np.where(wg, (start + n_rows) // r - start // r, 0)
        if not groups.sum():
            return None

        def groups_of() -> np.ndarray:  # (segment, entry) of each group the step completes
            seg_h = np.repeat(np.arange(len(groups)), groups)
            first = np.concatenate([[0], np.cumsum(groups)[:-1]])
            return np.stack([seg_h, start[seg_h] // r + np.arange(len(seg_h)) - first[seg_h]])

        seg, entry = view.batch.host_index(("groups", view.s0, view.s1, r), groups_of)
        return seg, entry, None

    def _group_rows(
        self, view: BatchRows, kv: torch.Tensor, score: torch.Tensor, seg: torch.Tensor, entry: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw (kv, score) rows of each completed group [G, ratio, head_dim], fp32: positions
        from the segment's start are this step's rows, earlier ones the slot's pending rows."""
        r = self.ratio
        pos = entry.unsqueeze(-1) * r + torch.arange(r, device=kv.device)
        start = view.seg("start")[seg].unsqueeze(-1)
        fresh = pos >= start
        # clamped: a group the step does not complete (fixed_groups) reads past the segment's rows
        new = (view.seg("lo")[seg].unsqueeze(-1) + pos - start).clamp(0, max(kv.size(0) - 1, 0))
        fkv, fscore, fpos, base = view.pair_base(self.layer)
        stored = view.slot_positions(fpos, base, view.batch.cache.pairs[self.layer].capacity)
        old = base[seg].unsqueeze(-1) + find_positions(stored[seg], pos)[0]
        pick = fresh.unsqueeze(-1)

        def rows(fresh_rows: torch.Tensor, kept_rows: torch.Tensor) -> torch.Tensor:
            a = fresh_rows[new.flatten()].view(*new.shape, -1)
            return torch.where(pick, a, kept_rows[old.flatten()].view_as(a).float())

        return rows(kv, fkv), rows(score, fscore)

    def _selection_batched(self, view: BatchRows, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """``selection`` for every row: [rows, index_topk] entry ids, -1 unused. Segments with the
        same row count are scored together against their index keys padded to the longest."""
        cfg, r = self.cfg, self.ratio
        key = f"selection.{r}"
        m = x.size(0)
        if not self.is_index_source:
            return view.shared[key][:m]
        hi, hd = cfg.index_n_heads, cfg.index_head_dim
        qi = self.idx_wq_b(qr).unflatten(-1, (hi, hd))
        qi = fp4_qdq(apply_rope(qi, rot, cfg.rope_head_dim, inplace=True), 32)
        wts = self.idx_weights(x) * (hd**-0.5 * hi**-0.5)
        visible = (view.positions + 1) // r
        kern = self.kernels
        if kern.fused_indexer:
            out = self._select_fused(view, qi, wts, visible, view.batch.entry_bound(r, view))
            view.shared[key] = out
            return out
        out = torch.full((m, cfg.index_topk), -1, dtype=torch.long, device=x.device)
        for q, segs_h, segs in view.uniform_groups():
            if view.batch.max_context is not None:  # a captured step: the key's bound
                n = view.batch.entry_bound(r, view)
            else:  # the longest of this group's segments
                n = int(((view.host("start") + view.host("rows"))[segs_h] // r).max())
            if n == 0:
                continue
            rows = view.seg("lo")[segs].unsqueeze(-1) + torch.arange(q, device=x.device)  # [ns, q]
            cols = torch.arange(n, device=x.device)
            keys = view.gather_entries(
                GroupKind.INDEX, self.source, segs.unsqueeze(-1).expand(-1, n), cols.expand(len(segs_h), n)
            ).to(qi.dtype)
            kk = min(cfg.index_topk, n)
            cand = None
            if self.is_candidate_source:
                cand = torch.empty(len(segs_h), q, n, dtype=torch.bool, device=x.device)
            per_row = hi * n * qi.element_size() * 2
            tile = max(1, kern.score_bytes // per_row)
            seg_step = max(1, tile // q)
            row_step = q if seg_step > 1 else min(q, tile)
            for s0 in range(0, len(segs_h), seg_step):
                s1 = min(len(segs_h), s0 + seg_step)
                for a in range(0, q, row_step):
                    b = min(q, a + row_step)
                    rr = rows[s0:s1, a:b]
                    s = kern.indexer_scores(qi[rr], keys[s0:s1], wts[rr])  # [ns, rows, n]
                    vis = visible[rr]
                    s.masked_fill_(cols >= vis.unsqueeze(-1), float("-inf"))
                    if cand is not None:
                        c = select_candidate_blocks(
                            s.flatten(0, 1),
                            vis.flatten(),
                            cfg.candidate_topk_blocks,
                            cfg.candidate_block_size,
                            topk=kern.topk,
                        )
                        cand[s0:s1, a:b] = c.view(s1 - s0, b - a, n)
                    elif self.uses_candidates:
                        s.masked_fill_(~view.shared[f"candidates.{q}"][s0:s1, a:b, :n], float("-inf"))
                    idx = kern.topk(s, kk).sort(dim=-1).values
                    out[rr.flatten(), :kk] = torch.where(idx < vis.unsqueeze(-1), idx, -1).flatten(0, 1)
            if cand is not None:
                view.shared[f"candidates.{q}"] = cand
        view.shared[key] = out
        return out

    def _select_fused(
        self, view: BatchRows, qi: torch.Tensor, wts: torch.Tensor, visible: torch.Tensor, n_max: int
    ) -> torch.Tensor:
        """``_selection_batched`` in Triton kernels (``attn_kernels.indexer_topk``): every row scored
        against its own sequence's index keys straight from the paged pool, one 16-bit key per
        entry (no per-head scores), then each row's top-k by radix select; the candidate pool
        travels down as a block mask."""
        from asympd.model import attn_kernels

        cfg = self.cfg
        pool = view.batch.cache.pools[f"{GroupKind.INDEX.value}.{self.source}"]
        tables, seqs = view.seg("block_table"), view.row_seg
        if self.is_candidate_source:
            sel, cand = attn_kernels.indexer_topk_candidates(
                qi, wts, pool, tables, visible, cfg.index_topk, cfg.candidate_topk_blocks,
                cfg.candidate_block_size, row_seq=seqs, max_entries=n_max,
            )  # fmt: skip
            view.shared["candidates.blocks"] = cand
            return sel
        cand = view.shared["candidates.blocks"][: qi.size(0)] if self.uses_candidates else None
        return attn_kernels.indexer_topk(
            qi, wts, pool, tables, visible, cfg.index_topk, row_seq=seqs, candidates=cand,
            candidate_block=cfg.candidate_block_size if cand is not None else 1, max_entries=n_max,
        )  # fmt: skip


def make_attention_weights(w: dict[str, torch.Tensor], quantized: set[str]) -> dict[str, Any]:
    """Wrap a layer's attention tensors: matrices in QLinear (FP8 ones quantize their input),
    norms and the sink as plain tensors. ``wo_a`` is applied as a grouped einsum on its dequantized
    bf16 weight without activation quantization, as the reference does."""
    out: dict[str, Any] = {}
    for name, t in w.items():
        if t.dim() == 2 and not name.endswith("norm"):
            out[name] = QLinear(t, quantized=name in quantized and name != "wo_a")
        else:
            out[name] = t
    return out
