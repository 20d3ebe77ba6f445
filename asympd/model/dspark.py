"""DSpark, DeepSeek-V4.1-Flash's own drafter: the ``mtp.*`` blocks of the checkpoint.

What the reference inference code defines (``DSparkAttention``, ``DSparkBlock``,
``DSparkMarkovHead``, ``DSparkConfidenceHead``, ``Transformer.forward_spec`` in DeepSeek's
``inference/model.py``, revision dba1be0a), restated for ragged batches:

- **main rows.** The target model hands over, per position, the mean over the hc copies of the
  *input* of each ``dspark_target_layer_ids`` layer, concatenated (``ForwardOutput.draft_hidden``).
  ``mtp.0.main_proj`` + ``mtp.0.main_norm`` turn that into ``main_x``; every draft block projects
  ``main_x`` with its own ``wkv``/``kv_norm`` (RoPE at the row's position, FP8 activation rounding,
  exactly as a window row of the backbone) into its **window cache**: the sliding window of
  ``window_size`` main rows (``swa.{n_layers + i}``). Only accepted positions are ever written there.
- **the block.** ``dspark_block_size`` rows at positions ``b .. b+B-1``, where ``b`` is the position
  of the newest token (the last real one, not yet seen by the target). Inputs: that token, then
  ``dspark_noise_token_id`` for the other rows, through the shared embedding. Every block query
  attends to the ``window_size`` main rows before ``b`` *and to all block rows* (not causal inside
  the block), with the layer's attention sink. Block rows are never written to any cache.
- **blocks.** Backbone-shaped mHC blocks (ratio 0: no compressor, indexer or Engram) with their own
  MoE sizes; the first starts from the identity pre-mix, each hands its FFN pre-mix to the next.
- **head.** The last block's ``norm`` and the shared LM head give base logits per block row. The
  **Markov head** then runs sequentially: row ``i`` gets the bias ``head_m(embed_m(token_i))`` of the
  token before it (the real token for row 0, then the drafts), and draft ``i+1`` is sampled from the
  biased row. The **confidence head** is ``proj([x_i, embed_m(token_i)])``, a logit per draft (x_i the
  collapsed, un-normed block output). The reference computes it but never thresholds it (nothing in
  it calls ``forward_spec``); the engine exposes an optional threshold on ``sigmoid(confidence)``.

Numerics reuse the backbone's batch-invariant ops (``linear``, ``rms_norm``, ``sparse_attention``,
fixed per-query key layouts), so a request drafts the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asympd.config import ModelConfig
from asympd.kv.batch import BatchRows, BatchSegment, PagedBatch, find_positions
from asympd.kv.paged_cache import PagedKVCache, PagedSequenceKV
from asympd.model.attention import Attention, SequenceKV, rotations
from asympd.model.ops import QLinear, apply_rope, hc_pre, linear, lm_head, rms_norm
from asympd.model.quant import fp8_qdq
from asympd.model.transformer import Block


@dataclass
class DraftSegment:
    """One request in a draft forward.

    ``main_hidden`` rows (target-layer states of accepted positions ``main_start ..``) are appended to
    every draft block's window; ``block_start`` (or None: seed the windows only) is the position of the
    newest token ``first_token``, where the block of ``dspark_block_size`` rows begins."""

    kv: SequenceKV
    main_hidden: torch.Tensor | None  # [m, n_targets * dim]
    main_start: int
    block_start: int | None = None
    first_token: int = 0
    # filled by DSpark.forward: rows of this segment in the flattened main / block batches
    main_lo: int = 0
    main_hi: int = 0
    lo: int = 0
    hi: int = 0


@dataclass
class DraftBatch:
    """What one draft forward hands down the blocks (through ``Block.forward``'s ``segs``)."""

    segments: list[DraftSegment]
    main_x: torch.Tensor | None  # [M, dim]: every segment's main rows, flattened
    main_pos: torch.Tensor | None  # [M]
    # when every segment's cache is a view of one paged cache: the main rows as one batch (those
    # segments that have any) and the drafting segments' slots, so no layer loops over sequences
    main_batch: BatchRows | None = None
    slots: torch.Tensor | None = None
    cache: PagedKVCache | None = None
    block_pos: torch.Tensor | None = None  # [n * block_size] positions of the drafting segments' block rows

    @property
    def drafting(self) -> list[DraftSegment]:
        return [s for s in self.segments if s.block_start is not None]


@dataclass
class Draft:
    """Per drafting segment, in order: the draft tokens, the (Markov-biased) logits each was sampled
    from, and the confidence logits."""

    tokens: torch.Tensor  # [n, k] int64
    # [n, k, vocab] fp32; None where the drafter's graph drew greedy drafts (the engine reads no logits
    # of greedy drafts, and keeping them would hold a [n, k, vocab] buffer per captured size)
    logits: torch.Tensor | None
    confidence: torch.Tensor  # [n, k] fp32


class DSparkAttention(Attention):
    """A draft block's attention: window of main rows + the whole block, ratio 0."""

    def __init__(self, cfg: ModelConfig, layer: int, w: dict, round_probs: bool):
        super().__init__(cfg, layer, w, round_probs)
        if self.ratio:
            raise ValueError(f"draft block {layer} has compress ratio {self.ratio}; DSpark blocks are window-only")

    def _kv(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        kv = rms_norm(self.wkv(x), self.kv_norm, self.cfg.norm_eps)
        return fp8_qdq(apply_rope(kv, rot, self.cfg.rope_head_dim), 32)

    def append_main(self, batch: DraftBatch) -> None:
        """Write each segment's main rows into this block's window cache."""
        if batch.main_x is None:
            return
        kv = self._kv(batch.main_x, rotations(self.freqs, batch.main_pos))
        if batch.main_batch is not None:
            batch.main_batch.append_window(self.layer, kv)
            return
        for seg in batch.segments:
            rows = slice(seg.main_lo, seg.main_hi)
            if seg.main_hi > seg.main_lo:
                seg.kv.append_window(self.layer, batch.main_pos[rows], kv[rows])

    def _window(self, seg: DraftSegment, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``window_size`` main rows before the block as fixed slots (slot j = position b-W+j)."""
        w = self.cfg.window_size
        kv, pos = seg.kv.window(self.layer)
        want = seg.block_start - w + torch.arange(w, device=like.device)
        if pos.numel() == 0:
            return like.new_zeros(w, like.size(-1)), torch.zeros(w, dtype=torch.bool, device=like.device)
        pos = pos.to(like.device)
        idx = torch.searchsorted(pos, want).clamp_max(pos.numel() - 1)
        valid = (pos[idx] == want) & (want >= 0)
        return kv.to(device=like.device, dtype=like.dtype)[idx], valid

    def forward(self, x: torch.Tensor, batch: DraftBatch) -> torch.Tensor:  # type: ignore[override]
        cfg = self.cfg
        positions = batch.block_pos
        rot = rotations(self.freqs, positions)
        qr = rms_norm(self.wq_a(x), self.q_norm, cfg.norm_eps)
        q = apply_rope(self.wq_b(qr).unflatten(-1, (cfg.n_heads, cfg.head_dim)), rot, cfg.rope_head_dim)
        kv = self._kv(x, rot)
        if batch.slots is not None:  # one slot per drafting segment
            o = self._attend_batched(q, kv, positions.view(batch.slots.numel(), -1)[:, 0], batch)
            o = apply_rope(o, rot, cfg.rope_head_dim, inverse=True)
            o = self.wo_a.grouped(o.reshape(o.size(0), cfg.o_groups, -1))
            return self.wo_b(o.flatten(1))
        outs = []
        for seg in batch.drafting:
            n = seg.hi - seg.lo
            win_kv, win_valid = self._window(seg, kv)
            keys = torch.cat([win_kv, kv[seg.lo : seg.hi]]).unsqueeze(0).expand(n, -1, -1)
            mask = torch.cat([win_valid, win_valid.new_ones(n)]).unsqueeze(0).expand(n, -1)
            outs.append(
                self.kernels.sparse_attention(
                    q[seg.lo : seg.hi], keys, mask, self.attn_sink, self.scale, self.round_probs
                )
            )
        o = apply_rope(torch.cat(outs), rot, cfg.rope_head_dim, inverse=True)
        o = self.wo_a.grouped(o.reshape(o.size(0), cfg.o_groups, -1))
        return self.wo_b(o.flatten(1))

    def _attend_batched(
        self, q: torch.Tensor, kv: torch.Tensor, block_start: torch.Tensor, batch: DraftBatch
    ) -> torch.Tensor:
        """``forward``'s attention for every drafting segment at once: each block row sees the W main
        rows before its block (found by position in the segment's window slot) and the whole block."""
        w, n = self.cfg.window_size, block_start.numel()
        cache = batch.cache
        cap = cache.windows[self.layer].capacity
        base = (batch.slots * cache.window_kv.size(1) + self.layer) * cap
        want = block_start.unsqueeze(-1) - w + torch.arange(w, device=q.device)
        idx, found = find_positions(BatchRows.slot_positions(cache.window_pos.view(-1), base, cap), want)
        win = cache.window_kv.view(-1, cache.window_kv.size(-1))[(base.unsqueeze(-1) + idx).flatten()]
        block = kv.view(n, -1, kv.size(-1))
        b = block.size(1)
        keys = torch.cat([win.view(n, w, -1).to(kv.dtype), block], dim=1)
        mask = torch.cat([found & (want >= 0), found.new_ones(n, b)], dim=1)
        keys = keys.unsqueeze(1).expand(n, b, *keys.shape[1:]).reshape(n * b, *keys.shape[1:])
        mask = mask.unsqueeze(1).expand(n, b, -1).reshape(n * b, -1)
        return self.kernels.sparse_attention(q, keys, mask, self.attn_sink, self.scale, self.round_probs)


class DSpark(torch.nn.Module):
    """The draft blocks plus what they share with the target (embedding, LM head)."""

    def __init__(
        self,
        cfg: ModelConfig,
        blocks: list[Block],
        main_proj: QLinear,
        main_norm: torch.Tensor,
        norm: torch.Tensor,
        markov_embed: torch.Tensor,  # [vocab, rank]
        markov_head: torch.Tensor,  # [vocab, rank], fp32
        confidence_proj: torch.Tensor,  # [1, dim + rank], fp32
        embed: torch.Tensor,  # the target's
        head: torch.Tensor,  # the target's (fp32, or bf16 on a bf16 GPU model: ops.lm_head)
        dtype: torch.dtype,
    ):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.blocks = torch.nn.ModuleList(blocks)
        self.main_proj, self.main_norm, self.norm = main_proj, main_norm, norm
        self.markov_embed, self.markov_head, self.confidence_proj = markov_embed, markov_head, confidence_proj
        self.embed, self.head = embed, head
        self.block_size = cfg.dspark_block_size
        self.noise_token_id = cfg.dspark_noise_token_id

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # ---- the pieces ---------------------------------------------------------------------------

    def main_x(self, main_hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.main_proj(main_hidden.to(self.dtype)), self.main_norm, self.cfg.norm_eps)

    def markov(self, prev_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logit bias [n, vocab] fp32, Markov embedding [n, rank]) of the tokens before the drafts."""
        emb = F.embedding(prev_tokens.to(self.device), self.markov_embed)
        return linear(emb.float(), self.markov_head), emb

    def confidence(self, x: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """Confidence logits [..., k] from the collapsed block outputs and the Markov embeddings."""
        cat = torch.cat([x, markov_embed.to(x.dtype)], dim=-1).float()
        return linear(cat, self.confidence_proj).squeeze(-1)

    # ---- forward ------------------------------------------------------------------------------

    def markov_greedy(
        self, x: torch.Tensor, logits: torch.Tensor, first: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``draft``'s Markov loop for greedy rows, all on the device with no host work (so the
        drafter's graph replays it): k drafts per block from its base logits ``[n * B, vocab]`` and
        first tokens ``[n]``, as (tokens [n, k], confidence [n, k]). Each draft is the argmax of its
        base row plus the Markov bias of the token before it, exactly as ``draft`` computes it."""
        n, b = first.numel(), self.block_size
        base = logits.view(n, -1, logits.size(-1))  # every block row's, or the first k's (head_rows)
        prev, drafts, embeds = first, [], []
        for i in range(k):
            bias, emb = self.markov(prev)
            prev = (base[:, i] + bias).argmax(dim=-1)
            drafts.append(prev)
            embeds.append(emb)
        confidence = self.confidence(x.view(n, b, -1)[:, :k], torch.stack(embeds, dim=1))
        return torch.stack(drafts, dim=1), confidence

    def seed_static(self, hidden: torch.Tensor, start: torch.Tensor, rows: int, view: BatchRows) -> None:
        """Seed the windows from a fixed layout, with no host work (the drafter's graph runs it):
        request i's accepted rows at rows ``[i rows, i rows + count_i)`` of ``hidden`` (the counts,
        starts and slots are ``view``'s device metadata; rows past a count are computed and never
        written). Every op is row-wise and batch-invariant, so each row's window entry has the bits
        the eager seeding (``forward``) gives it."""
        pos = (start.unsqueeze(-1) + torch.arange(rows, device=start.device)).flatten()
        batch = DraftBatch([], self.main_x(hidden), pos, main_batch=view)
        for block in self.blocks:
            block.attn.append_main(batch)

    def _seeds_in_graph(self, segments: list[DraftSegment], graphs: Any) -> bool:
        """Whether ``graphs`` seeds this step's windows: every segment drafts, seeds 1..R rows and is
        a plain view of the graphs' cache (a verify step's accepted rows)."""
        r = getattr(graphs, "seed_rows", 0)
        if not r or not graphs.fits(len(segments)):
            return False
        cache, paged = graphs.cache, PagedSequenceKV
        return all(
            s.block_start is not None
            and s.main_hidden is not None
            and 0 < s.main_hidden.shape[0] <= r
            and type(s.kv) is paged
            and s.kv.cache is cache
            for s in segments
        )

    @torch.inference_mode()
    def forward(self, segments: list[DraftSegment], graphs: Any = None) -> tuple[torch.Tensor, ...] | None:
        """Seed every segment's windows with its main rows, then run the blocks of the drafting ones.
        Returns (collapsed block outputs [R, dim], base logits [R, vocab] fp32), R = block rows of the
        drafting segments in order, or None when no segment drafts. ``graphs``: a
        :class:`~asympd.engine.cuda_graphs.DraftGraphs`, which replays the blocks' part as a CUDA
        graph (the outputs are then its static buffers: use them before the next draft), with its
        greedy Markov loop (``markov_greedy``) where it has one: then two more outputs, its greedy
        draft tokens [n, K] and confidence [n, K]."""
        dev = self.device
        if graphs is not None and segments and self._seeds_in_graph(segments, graphs):
            rows = [s.main_hidden for s in segments]
            tokens_t, positions = self._block_rows(segments)
            seed = (torch.cat(rows), [s.main_start for s in segments], [h.shape[0] for h in rows])
            return graphs.run(tokens_t, positions, [s.kv.slot for s in segments], seed)
        hidden, starts, counts, m = [], [], [], 0
        for s in segments:
            rows = 0 if s.main_hidden is None else s.main_hidden.size(0)
            s.main_lo, s.main_hi = m, m + rows
            m += rows
            if rows:
                hidden.append(s.main_hidden)
                starts.append(s.main_start)
                counts.append(rows)
        main_pos = None
        if counts:  # every segment's positions from one host tensor, not one small tensor per request
            first = torch.tensor(starts, dtype=torch.long).repeat_interleave(torch.tensor(counts))
            offsets = torch.arange(m) - torch.tensor([0, *counts[:-1]]).cumsum(0).repeat_interleave(
                torch.tensor(counts)
            )
            main_pos = (first + offsets).to(dev, non_blocking=True)
        batch = DraftBatch(segments, self.main_x(torch.cat(hidden).to(dev)) if hidden else None, main_pos)
        self._batch_caches(batch)
        for block in self.blocks:
            block.attn.append_main(batch)
        drafting = batch.drafting
        if not drafting:
            return None
        tokens_t, positions = self._block_rows(drafting)
        if graphs is not None and batch.slots is not None:
            out = graphs.run(tokens_t, positions, [s.kv.slot for s in drafting])
            if out is not None:
                return out
        batch.block_pos = positions.to(dev, non_blocking=True)
        return self.blocks_forward(tokens_t.to(dev, non_blocking=True), batch)

    def _block_rows(self, drafting: list[DraftSegment]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, positions) of the drafting segments' block rows, on the host: each block is its
        newest token, then the noise token, at positions ``block_start ..``."""
        b = self.block_size
        tokens = torch.full((len(drafting), b), self.noise_token_id, dtype=torch.long)
        tokens[:, 0] = torch.tensor([s.first_token for s in drafting], dtype=torch.long)
        starts = torch.tensor([s.block_start for s in drafting], dtype=torch.long)
        for i, s in enumerate(drafting):
            s.lo, s.hi = i * b, (i + 1) * b
        return tokens.flatten(), (starts.unsqueeze(-1) + torch.arange(b)).flatten()

    def blocks_forward(
        self, tokens: torch.Tensor, batch: DraftBatch, head_rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft blocks over the drafting segments' block rows (their windows already seeded):
        (collapsed outputs [R, dim], base logits [R, vocab] fp32). ``head_rows``: the head only on
        each block's first that many rows (the rows drafts come from), logits [n * head_rows, vocab]:
        at B = 256 and k = 3 the head's GEMM is 3/5 of every row's. No host work: graph-capturable."""
        cfg = self.cfg
        h = F.embedding(tokens, self.embed).to(self.dtype)
        h = h.unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = torch.zeros(h.size(0), cfg.hc_mult, dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0
        for block in self.blocks:
            h, pre = block(h, pre, batch)
        x = hc_pre(h, pre)
        rows = (
            x if head_rows is None else x.view(-1, self.block_size, x.size(-1))[:, :head_rows].reshape(-1, x.size(-1))
        )
        logits = lm_head(rms_norm(rows, self.norm, cfg.norm_eps), self.head)
        return x, logits

    @staticmethod
    def _batch_caches(batch: DraftBatch) -> None:
        """Address every segment's window slots at once when they all live in one paged cache. Only
        plain paged views qualify: writes through any other view (EP's mirrored ones, which replay
        the drafter's writes on the other ranks) must go through it."""
        views = [s.kv for s in batch.segments]
        cache = views[0].cache if views and type(views[0]) is PagedSequenceKV else None
        if cache is None or any(type(v) is not PagedSequenceKV or v.cache is not cache for v in views):
            return
        batch.cache = cache
        with_rows = [s for s in batch.segments if s.main_hi > s.main_lo]
        if with_rows:
            segs = [BatchSegment(s.kv.block_table, s.kv.slot, s.main_start, s.main_hi - s.main_lo) for s in with_rows]
            batch.main_batch = PagedBatch(cache, segs).rows_view(0, len(segs), decoder=False)
        slots = [s.kv.slot for s in batch.drafting]
        batch.slots = torch.tensor(slots, dtype=torch.int64).to(cache.device, non_blocking=True) if slots else None

    @torch.inference_mode()
    def draft(
        self,
        segments: list[DraftSegment],
        num_drafts: int,
        sample: Callable[[int, torch.Tensor], torch.Tensor],
        graphs: Any = None,
        greedy: bool = False,
    ) -> Draft | None:
        """Seed, run the blocks, then draft ``num_drafts`` (<= block size) tokens per drafting segment
        through the Markov head: ``sample(i, logits [n, vocab]) -> tokens [n]`` picks draft ``i+1``
        of every drafting segment from its biased row ``i``. ``greedy``: ``sample`` takes the argmax
        of every row, so a drafter graph that runs the Markov loop itself may stand in for it (the
        draft's ``logits`` are then None)."""
        if not 0 <= num_drafts <= self.block_size:
            raise ValueError(f"num_drafts={num_drafts} must be within the DSpark block size {self.block_size}")
        out = self.forward(segments, graphs)
        if out is None:
            return None
        n, b = len([s for s in segments if s.block_start is not None]), self.block_size
        if greedy and num_drafts and len(out) == 4 and out[2].size(1) >= num_drafts:
            # the drafter's graph ran the greedy Markov loop already (DraftGraphs' num_drafts)
            graphs.stats["markov"] += 1
            return Draft(out[2][:, :num_drafts], None, out[3][:, :num_drafts])
        x, logits = out[:2]
        # the logits: of every block row, or of the first ones only (a drafter graph's head_rows)
        x, logits = x.view(n, b, -1)[:, :num_drafts], logits.view(n, -1, logits.size(-1))[:, :num_drafts].clone()
        prev = torch.tensor([s.first_token for s in segments if s.block_start is not None], device=self.device)
        drafts, embeds = [], []
        for i in range(num_drafts):
            bias, emb = self.markov(prev)
            logits[:, i] = logits[:, i] + bias
            prev = sample(i, logits[:, i]).to(self.device)
            drafts.append(prev)
            embeds.append(emb)
        if not drafts:
            empty = torch.empty(n, 0, device=self.device)
            return Draft(empty.long(), logits, empty)
        confidence = self.confidence(x, torch.stack(embeds, dim=1))
        return Draft(torch.stack(drafts, dim=1), logits, confidence)
