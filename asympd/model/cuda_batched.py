"""One layer step over *uniform groups* of sequences, batched across sequences: the benchmark path.

The engine's attention walks its sequences one by one (each has its own paged cache view), which
is fine for a prefill of a few long prompts and Python-bound for a decode batch of hundreds. This
module computes the same layer for a step whose sequences come in groups of identical shape
(``n`` sequences, ``q`` rows each, starting at the same position with the same window floor) whose
caches are dense tensors ``[n, ...]``. A decode batch at one context length is one group; each
bounded prefill admitted into it is another. Every tensor op then covers the whole group, there is
no host synchronisation, and a step can be captured in a CUDA graph.

The arithmetic is :class:`~asympd.model.transformer.Block`'s (it calls the same modules: mHC, norms,
projections, the MoE) with attention re-expressed for groups; ``tests/model/test_cuda.py`` checks
it against ``Block.forward`` over :class:`~asympd.kv.dense.DenseSequenceKV` caches, layer by layer.
Not modelled: Engram lookups (layers 1 and 14; host-memory tables), window/pending cache appends
(bounded copies of ``q`` rows per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from asympd.model.attention import Attention, rotations
from asympd.model.cuda_ops import fast_candidate_blocks, fast_sparse_attention, fast_topk
from asympd.model.ops import apply_rope, hc_post, hc_pre, ordered_sum, rms_norm
from asympd.model.quant import fp4_qdq, fp8_qdq
from asympd.model.transformer import Block


@dataclass
class Group:
    """``n`` sequences with ``q`` rows each at positions [start, start + q).

    Caches (dense, model dtype unless noted), keyed by layer so several layers may share a tensor:
    ``win[layer]`` [n, W, D]: window rows at positions start-W .. start-1 (positions < 0 or below the
    floor are masked); ``comp[source]`` [n, cap, D] and ``idx[source]`` [n, cap, index_head_dim]:
    compressed entries and index keys (cap >= (start + q) // ratio; entries from start // ratio on
    are written by this step on a source layer); ``pend[source]``: the open compressor group of a
    ratio > 1 source, (kv, score) fp32 [n, start % ratio, D].
    """

    n: int
    q: int
    start: int
    win: dict[int, torch.Tensor]
    comp: dict[int, torch.Tensor]
    idx: dict[int, torch.Tensor]
    pend: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    floor: int = 0  # window floor above the last KV source
    encoder_floor: int = 0  # window floor up to it
    write_global: bool = True
    shared: dict[str, Any] = field(default_factory=dict)  # selections / candidates down the stack

    @property
    def rows(self) -> int:
        return self.n * self.q


def _cat_rows(groups: list[Group], fn) -> torch.Tensor:
    return torch.cat([fn(g) for g in groups])


def group_write_compressed(attn: Attention, g: Group, x: torch.Tensor) -> None:
    """``Attention._write_compressed`` for a group (x: [n*q, dim], the normed layer input)."""
    cfg, r, n, q = attn.cfg, attn.ratio, g.n, g.q
    dev = x.device
    if r == 1:
        latent = rms_norm(attn.comp_wkv(x), attn.comp_norm, cfg.norm_eps).view(n, q, -1)
        first, m = g.start, q
    else:
        xf = x.float()
        kv, score = attn.comp_wkv(xf).view(n, q, -1), attn.comp_wgate(xf).view(n, q, -1)
        open_rows = g.start % r
        if open_rows:
            pk, ps = g.pend[attn.layer]
            kv, score = torch.cat([pk.float(), kv], 1), torch.cat([ps.float(), score], 1)
        m = (g.start + q) // r - g.start // r
        if m == 0:
            return
        kv_g = kv[:, : m * r].unflatten(1, (m, r))
        score_g = score[:, : m * r].unflatten(1, (m, r))
        weights = torch.exp(score_g - score_g.amax(dim=2, keepdim=True))
        pooled = ordered_sum(kv_g * (weights / ordered_sum(weights, 2, keepdim=True)), 2)
        latent = rms_norm(pooled.to(x.dtype), attn.comp_norm, cfg.norm_eps)
        first = g.start // r
    latent = latent.reshape(n * m, -1)
    rot = rotations(attn.freqs, torch.arange(first, first + m, device=dev) * r).repeat(n, 1)
    k = rms_norm(attn.idx_wk(latent), attn.idx_k_norm, cfg.norm_eps)
    k = fp4_qdq(apply_rope(k, rot, cfg.rope_head_dim), 32)
    entries = fp4_qdq(apply_rope(latent, rot, cfg.rope_head_dim), 16, e4m3_scale=True)
    g.idx[attn.layer][:, first : first + m] = k.view(n, m, -1).to(g.idx[attn.layer].dtype)
    g.comp[attn.layer][:, first : first + m] = entries.view(n, m, -1).to(g.comp[attn.layer].dtype)


def _group_select(
    attn: Attention, g: Group, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor, visible: torch.Tensor, n_tot: int
) -> torch.Tensor:
    """``Attention._select`` for a group: [n, q, min(topk, n_tot)] entry ids, -1 unused."""
    cfg, n, q = attn.cfg, g.n, g.q
    hi, hd = cfg.index_n_heads, cfg.index_head_dim
    qi = attn.idx_wq_b(qr).unflatten(-1, (hi, hd))
    qi = fp4_qdq(apply_rope(qi, rot, cfg.rope_head_dim), 32).view(n, q, hi, hd)
    keys = g.idx[attn.source][:, :n_tot].to(qi.dtype)  # [n, n_tot, hd]
    wts = (attn.idx_weights(x) * (hd**-0.5 * hi**-0.5)).view(n, q, hi)
    kk = min(cfg.index_topk, n_tot)
    out = torch.empty(n, q, kk, dtype=torch.long, device=x.device)
    cand_out = None
    if attn.is_candidate_source:
        cand_out = torch.empty(n, q, n_tot, dtype=torch.bool, device=x.device)
    cols = torch.arange(n_tot, device=x.device)
    per_row = hi * n_tot * qi.element_size() * 2
    rows_per_tile = max(1, (1 << 30) // per_row)
    seq_step = max(1, rows_per_tile // q)
    row_step = q if seq_step > 1 else max(1, min(q, rows_per_tile))
    for s0 in range(0, n, seq_step):
        s1 = min(n, s0 + seq_step)
        for r0 in range(0, q, row_step):
            r1 = min(q, r0 + row_step)
            qa = qi[s0:s1, r0:r1].reshape(s1 - s0, (r1 - r0) * hi, hd)
            s = torch.bmm(qa, keys[s0:s1].transpose(1, 2)).relu_()  # [ns, rows*hi, n_tot] model dtype
            s = s.view(s1 - s0, r1 - r0, hi, n_tot).mul_(wts[s0:s1, r0:r1].unsqueeze(-1)).sum(dim=2).float()
            vis = visible[r0:r1].view(1, -1, 1)
            s.masked_fill_(cols >= vis, float("-inf"))
            if cand_out is not None:
                c = fast_candidate_blocks(
                    s.flatten(0, 1),
                    visible[r0:r1].repeat(s1 - s0),
                    cfg.candidate_topk_blocks,
                    cfg.candidate_block_size,
                )
                cand_out[s0:s1, r0:r1] = c.view(s1 - s0, r1 - r0, n_tot)
            elif attn.uses_candidates:
                s.masked_fill_(~g.shared["candidates"][s0:s1, r0:r1], float("-inf"))
            idx = fast_topk(s, kk).sort(dim=-1).values
            out[s0:s1, r0:r1] = torch.where(idx < vis, idx, -1)
    if cand_out is not None:
        g.shared["candidates"] = cand_out
    return out


def _group_core(
    attn: Attention,
    g: Group,
    floor: int,
    x: torch.Tensor,
    qr: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    rot: torch.Tensor,
    row_budget: int,
) -> torch.Tensor:
    cfg, n, qn = attn.cfg, g.n, g.q
    w, d = cfg.window_size, cfg.head_dim
    dev = x.device
    pos = g.start + torch.arange(qn, device=dev)
    all_kv = torch.cat([g.win[attn.layer].to(kv.dtype), kv.view(n, qn, d)], 1)  # positions start-W ..
    want = pos.unsqueeze(-1) - w + 1 + torch.arange(w, device=dev)  # [q, W]
    widx = torch.arange(qn, device=dev).unsqueeze(-1) + 1 + torch.arange(w, device=dev)
    wvalid = (want >= floor) & (want >= 0)
    sel = None
    comp = None
    if attn.ratio:
        r = attn.ratio
        if attn.is_source and g.write_global:
            group_write_compressed(attn, g, x)
        n_tot = (g.start + qn) // r
        visible = (pos + 1) // r
        if attn.is_index_source:
            if n_tot == 0:
                sel = torch.empty(n, qn, 0, dtype=torch.long, device=dev)
            else:
                sel = _group_select(attn, g, x, qr, rot, visible, n_tot)
            g.shared[f"selection.{r}"] = sel
        else:
            sel = g.shared[f"selection.{r}"]
        sel = F.pad(sel, (0, cfg.index_topk - sel.size(-1)), value=-1)
        if n_tot:
            comp = g.comp[attn.source]
    qv = q.view(n, qn, cfg.n_heads, d)
    out = torch.empty(n, qn, cfg.n_heads, d, dtype=q.dtype, device=dev)
    seq_step = max(1, row_budget // qn)
    row_step = qn if seq_step > 1 else min(qn, row_budget)
    for s0 in range(0, n, seq_step):
        s1 = min(n, s0 + seq_step)
        ns = s1 - s0
        for r0 in range(0, qn, row_step):
            r1 = min(qn, r0 + row_step)
            nr = r1 - r0
            keys = all_kv[s0:s1][:, widx[r0:r1]]  # [ns, nr, W, d]
            mask = wvalid[r0:r1].expand(ns, nr, w)
            if sel is not None:
                s = sel[s0:s1, r0:r1]  # [ns, nr, k]
                if comp is None:
                    ent = keys.new_zeros(ns, nr, s.size(-1), d)
                else:
                    cap = comp.size(1)
                    base = (torch.arange(s0, s1, device=dev) * cap).view(-1, 1, 1)
                    ent = comp.view(-1, d)[(base + s.clamp_min(0)).flatten()].view(ns, nr, -1, d).to(keys.dtype)
                keys = torch.cat([keys, ent], dim=2)
                mask = torch.cat([mask, s >= 0], dim=2)
            o = fast_sparse_attention(
                qv[s0:s1, r0:r1].reshape(ns * nr, cfg.n_heads, d),
                keys.reshape(ns * nr, -1, d),
                mask.reshape(ns * nr, -1),
                attn.attn_sink,
                attn.scale,
                attn.round_probs,
            )
            out[s0:s1, r0:r1] = o.view(ns, nr, cfg.n_heads, d)
    return out.view(n * qn, cfg.n_heads, d)


def group_attention(
    attn: Attention, x: torch.Tensor, groups: list[Group], floors: list[int], row_budget: int = 2048
) -> torch.Tensor:
    """``Attention.forward`` for rows laid out group after group, sequence-major within a group."""
    cfg = attn.cfg
    dev = x.device
    positions = _cat_rows(groups, lambda g: (g.start + torch.arange(g.q, device=dev)).repeat(g.n))
    rot = rotations(attn.freqs, positions)
    qr = rms_norm(attn.wq_a(x), attn.q_norm, cfg.norm_eps)
    q = apply_rope(attn.wq_b(qr).unflatten(-1, (cfg.n_heads, cfg.head_dim)), rot, cfg.rope_head_dim)
    kv = rms_norm(attn.wkv(x), attn.kv_norm, cfg.norm_eps)
    kv = fp8_qdq(apply_rope(kv, rot, cfg.rope_head_dim), 32)
    outs, lo = [], 0
    for g, floor in zip(groups, floors, strict=True):
        sl = slice(lo, lo + g.rows)
        outs.append(_group_core(attn, g, floor, x[sl], qr[sl], q[sl], kv[sl], rot[sl], row_budget))
        lo += g.rows
    o = apply_rope(torch.cat(outs), rot, cfg.rope_head_dim, inverse=True)
    o = attn.wo_a.grouped(o.reshape(o.size(0), cfg.o_groups, -1))
    return attn.wo_b(o.flatten(1))


def group_block_forward(
    block: Block, h: torch.Tensor, pre: torch.Tensor, groups: list[Group], kv_path_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Block.forward`` over groups. ``kv_path_only``: the prefill role's last KV source (compress
    the rows into the global KV, nothing else; h and pre come back unchanged)."""
    cfg = block.cfg
    k = cfg.last_kv_source
    floors = [g.encoder_floor if block.layer <= k else g.floor for g in groups]
    if kv_path_only:
        x = block.attn_input(h, pre)
        lo = 0
        for g in groups:
            if g.write_global:
                group_write_compressed(block.attn, g, x[lo : lo + g.rows])
            lo += g.rows
        return h, pre
    residual = h
    attn_pre, attn_post, attn_comb = block._mixes(h, "attn")
    x = group_attention(block.attn, block.attn_input(h, pre), groups, floors)
    h = hc_post(x, residual, attn_post, attn_comb)
    residual = h
    ffn_pre, ffn_post, ffn_comb = block._mixes(h, "ffn")
    x = rms_norm(hc_pre(h, attn_pre), block.ffn_norm, cfg.norm_eps)
    h = hc_post(block.ffn(x), residual, ffn_post, ffn_comb)
    return h, ffn_pre


def random_groups_state(
    cfg,
    specs: list[dict[str, Any]],
    layers: list[int],
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    share_windows: bool = True,
    sources: list[int] | None = None,
) -> list[Group]:
    """Groups with random caches for benchmarking. ``specs``: dicts with n, q, start and optional
    floor/encoder_floor/write_global. One window tensor serves every layer when ``share_windows``
    (timing only: contents do not change the work); compressed/index tensors per KV source
    (``sources``: only those, when given)."""
    device = torch.device(device)
    out = []
    for sp in specs:
        n, q, start = sp["n"], sp["q"], sp["start"]
        w, d = cfg.window_size, cfg.head_dim

        def rnd(*shape, dt=dtype, scale=1.0):
            return (torch.randn(*shape, device=device, dtype=torch.float32, generator=generator) * scale).to(dt)

        shared_win = rnd(n, w, d) if share_windows else None
        win = {layer: shared_win if share_windows else rnd(n, w, d) for layer in layers}
        comp, idx, pend = {}, {}, {}
        for src in cfg.kv_source_layers if sources is None else sources:
            r = cfg.ratio(src)
            cap = max(1, (start + q) // r)
            comp[src] = rnd(n, cap, d)
            idx[src] = rnd(n, cap, cfg.index_head_dim)
            if r > 1 and start % r:
                pend[src] = (rnd(n, start % r, d, dt=torch.float32), rnd(n, start % r, d, dt=torch.float32))
        out.append(
            Group(
                n,
                q,
                start,
                win,
                comp,
                idx,
                pend,
                floor=sp.get("floor", 0),
                encoder_floor=sp.get("encoder_floor", 0),
                write_global=sp.get("write_global", True),
            )
        )
    return out
