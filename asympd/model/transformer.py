"""DeepSeek-V4.1: embed -> hc copies -> blocks (mHC around attention and MoE) -> collapse -> head.

A forward takes a ragged batch of ``Chunk``s, one per sequence, each a run of consecutive rows at
known positions. How deep a chunk goes and what its windows may see is how the three prefill
semantics are expressed (K = the last KV source layer):

- ``full``: every chunk at ``Depth.ALL``, floors 0.
- ``decoder-replay``: rows [0, N-W) at ``Depth.THROUGH_SOURCE`` (layers <= K); rows [N-W, N) at
  ``Depth.ALL`` with ``floor = N-W`` for the layers above K.
- ``split`` (what asymmetric P/D computes): rows [0, s) at ``Depth.ENCODER_KV`` (layers < K plus
  K's KV path); rows [s, N) at ``Depth.ALL`` with every layer's floor at s
  (``encoder_floor = floor = s``).

The rows of a chunk deeper in the stack are kept first, so the rows active at any layer are a
prefix of the batch.

Image rows (docs/vision.md) arrive as ``ChunkImages``: their embeddings replace the token
embeddings before layer 0, their MoE routing uses ``gate.bias_vl``, and Engram neither reads them
into an n-gram nor writes into them (the reference's token mask).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asympd.config import ModelConfig
from asympd.kv.batch import BatchSegment, PagedBatch
from asympd.kv.paged_cache import PagedKVCache
from asympd.model.attention import Attention, SegmentView, SequenceKV
from asympd.model.depth import Depth
from asympd.model.engram import Engram
from asympd.model.moe import MoE
from asympd.model.ops import hc_mixes, hc_post, hc_pre, lm_head, rms_norm


@dataclass
class ChunkImages:
    """The image rows of a chunk: which of its rows an image fills, with what, and which positions of
    the history are text (Engram n-grams stop at image rows)."""

    text: torch.Tensor  # [len(history)] bool, False inside image spans
    rows: torch.Tensor  # [k] int64, chunk-relative rows that take an image embedding
    embeds: torch.Tensor  # [k, dim] those embeddings (model dtype)


@dataclass
class Chunk:
    kv: SequenceKV
    token_ids: torch.Tensor  # [q] the rows' tokens
    start: int  # position of the first row
    history: torch.Tensor | None  # the sequence's ids up to start + q (Engram looks back; else unused)
    depth: Depth = Depth.ALL
    floor: int = 0  # window floor for layers above K
    encoder_floor: int = 0  # window floor for layers up to K
    write_global: bool = True  # False: compressed KV/index keys for these rows already exist
    logits: str = "last"  # "last" | "all" | "none"
    images: ChunkImages | None = None  # rows inside image spans, if any
    # history[0] is the id at this position: a decode step passes only the n-gram look-back, not
    # the whole sequence (0 with images: their text mask covers the whole history)
    history_start: int = 0

    def __post_init__(self) -> None:
        if self.logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be last/all/none, got {self.logits!r}")


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor | None]  # per chunk, fp32 [rows, vocab]
    draft_hidden: list[torch.Tensor | None]  # per chunk, [rows, n_targets * dim] (DSpark input)
    # per chunk, each logits row's argmax (first maximum), fetched with one host copy for the step
    argmax: list[list[int] | None] = dataclasses.field(default_factory=list)


class Block(torch.nn.Module):
    """One layer. Each sublayer's mHC mixes produce the collapse coefficients of the *next*
    sublayer: attention collapses with what the previous FFN computed, the FFN with what this
    attention computed, and the FFN's own pre-mix goes to the next layer."""

    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, Any]):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn_norm, self.ffn_norm = w.get("attn_norm"), w.get("ffn_norm")
        self.hc = {
            k: w.get(k)
            for k in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale")
        }
        self.attn: Attention = w["attn"]
        self.ffn: MoE | None = w.get("ffn")
        self.engram: Engram | None = w.get("engram")

    def _mixes(self, h: torch.Tensor, sub: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        return hc_mixes(
            h,
            self.hc[f"hc_{sub}_fn"],
            self.hc[f"hc_{sub}_scale"],
            self.hc[f"hc_{sub}_base"],
            c.hc_mult,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.norm_eps,
        )

    def attn_input(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return rms_norm(hc_pre(h, pre), self.attn_norm, self.cfg.norm_eps)

    def forward(
        self, h: torch.Tensor, pre: torch.Tensor, segs: list[SegmentView], vl: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``vl`` ([rows] bool, optional): image-span rows, routed with the VL gate bias."""
        mixes = self._mixes(h, "attn")
        x = self.attn(self.attn_input(h, pre), segs)
        return self.after_attention(x, h, mixes, vl)

    def after_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        mixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        vl: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output ``x`` into the hc copies, then the FFN sublayer: (h, next pre-mix)."""
        attn_pre, attn_post, attn_comb = mixes
        h = hc_post(x, residual, attn_post, attn_comb)
        residual = h
        ffn_pre, ffn_post, ffn_comb = self._mixes(h, "ffn")
        x = rms_norm(hc_pre(h, attn_pre), self.ffn_norm, self.cfg.norm_eps)
        h = hc_post(self.ffn(x) if vl is None else self.ffn(x, vl), residual, ffn_post, ffn_comb)
        return h, ffn_pre


def batch_segments(ordered: list[Chunk]) -> list[BatchSegment] | None:
    """The step's chunks as :class:`PagedBatch` segments, or None unless every chunk is a view of
    the same paged cache."""
    views = [c.kv for c in ordered]
    caches = {id(getattr(v, "cache", None)) for v in views}  # duck-typed: EP's mirrored views pass
    if len(caches) != 1 or not isinstance(getattr(views[0], "cache", None), PagedKVCache):
        return None
    return [
        BatchSegment(v.block_table, v.slot, c.start, len(c.token_ids), c.encoder_floor, c.floor, c.write_global)
        for c, v in zip(ordered, views, strict=True)
    ]


class Transformer(torch.nn.Module):
    """The backbone of one role. The prefill role holds layers below K as blocks and layer K as a
    KV path only; it cannot run ``Depth.THROUGH_SOURCE`` or ``Depth.ALL`` rows."""

    def __init__(
        self,
        cfg: ModelConfig,
        role: str,
        embed: torch.Tensor,
        blocks: list[Block | None],
        norm: torch.Tensor | None,
        head: torch.Tensor | None,
        hasher: Any | None,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.cfg, self.role, self.dtype = cfg, role, dtype
        self.embed = embed
        self.blocks = blocks
        self.norm, self.head = norm, head
        self.hasher = hasher
        self.vision: Any = None  # a VisionTower when loaded with the vision tensors (loader.build_model)
        self.max_depth = Depth.ENCODER_KV if role == "prefill" else Depth.ALL
        # True: a step whose chunks all live in one paged cache runs each layer once over all of
        # them (kv/batch.py); False: the per-sequence reference path (also used for other caches)
        self.batched = True

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def _layers_run(self, depth: Depth) -> tuple[int, bool]:
        """(number of full layers this depth runs, whether it runs K's KV path alone after them)."""
        k = self.cfg.last_kv_source
        if depth is Depth.ENCODER_KV:
            return k, True
        if depth is Depth.THROUGH_SOURCE:
            return k + 1, False
        return self.cfg.n_layers, False

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], graphs: Any = None) -> ForwardOutput:
        """``graphs``: a :class:`~asympd.engine.cuda_graphs.DecodeGraphs` for this cache; the steps it
        takes (decode and verify) are replayed as CUDA graphs."""
        if not chunks:
            return ForwardOutput([], [], [])
        for c in chunks:
            if c.depth > self.max_depth:
                raise ValueError(f"the {self.role} role cannot run rows at depth {c.depth.name}")
            if len(c.token_ids) == 0:
                raise ValueError("a chunk needs at least one row")
        order = sorted(range(len(chunks)), key=lambda i: -chunks[i].depth)  # stable: deepest first
        ordered = [chunks[i] for i in order]
        offsets = [0]
        for c in ordered:
            offsets.append(offsets[-1] + len(c.token_ids))
        tokens = torch.cat([c.token_ids for c in ordered]).to(self.device)
        fetched = self._fetch_engram(ordered)
        segs = batch_segments(ordered) if self.batched else None
        if graphs is not None and segs is not None:
            out = graphs.run(ordered, order, segs, tokens, fetched)
            if out is not None:
                return out
        h, pre, vl = self._embed(tokens, ordered, offsets)
        batch = None if segs is None else PagedBatch(ordered[0].kv.cache, segs)
        pieces = getattr(graphs, "piecewise", None) if batch is not None and vl is None else None
        hidden = self._layers(h, pre, [c.depth for c in ordered], offsets, batch, fetched, vl, ordered, pieces)

        logits: list[torch.Tensor | None] = [None] * len(chunks)
        argmax: list[list[int] | None] = [None] * len(chunks)
        draft_hidden: list[torch.Tensor | None] = [None] * len(chunks)
        wanted: list[tuple[int, range]] = []  # (chunk, its rows that need logits)
        n_all = sum(c.depth is Depth.ALL for c in ordered)
        all_hidden = torch.cat(hidden, dim=-1) if hidden else None
        for i, c in enumerate(ordered):
            if all_hidden is not None and i < n_all:  # every Depth.ALL row: the drafter is seeded from them
                draft_hidden[order[i]] = all_hidden[offsets[i] : offsets[i + 1]]
            if c.depth is Depth.ALL and c.logits != "none":
                lo = offsets[i + 1] - 1 if c.logits == "last" else offsets[i]
                wanted.append((i, range(lo, offsets[i + 1])))
        if wanted:  # one head GEMM for the whole step (rows are batch-invariant on CPU too, see linear)
            rows = torch.tensor([r for _, rr in wanted for r in rr], device=self.device)
            head = self.logits(h, pre, rows)
            sizes = [len(rr) for _, rr in wanted]
            ids = head.argmax(dim=-1).tolist()  # the step's one sync: greedy tokens for every row
            at = 0
            for (i, _), lg, n in zip(wanted, head.split(sizes), sizes, strict=True):
                logits[order[i]], argmax[order[i]] = lg, ids[at : at + n]
                at += n
        return ForwardOutput(logits, draft_hidden, argmax)

    def _fetch_engram(self, ordered: list[Chunk]) -> dict[int, Any]:
        """Each Engram layer's looked-up rows, in flight to the device (hashed on the host; a
        host-memory table's copy overlaps the layers before it)."""
        cfg = self.cfg
        if not cfg.engram_layer_ids or self.hasher is None:
            return {}
        if any(c.history is None for c in ordered):
            raise ValueError("this model has Engram layers: every chunk needs its history")
        hashes = self.hasher.hash_many(
            [
                (c.history, c.history_start, c.start, len(c.token_ids), None if c.images is None else c.images.text)
                for c in ordered
            ]
        )
        fetched: dict[int, Any] = {}
        for e, lid in enumerate(cfg.engram_layer_ids):
            if self.blocks[lid] is not None and self.blocks[lid].engram is not None:
                fetched[lid] = self.blocks[lid].engram.fetch(hashes[:, e], self.device)
        return fetched

    def _embed(
        self, tokens: torch.Tensor, ordered: list[Chunk], offsets: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the hc copies of every row's embedding [rows, hc, dim], the first collapse's mix, the
        image-span rows or None)."""
        cfg = self.cfg
        h = F.embedding(tokens, self.embed).to(self.dtype)
        vl = None  # [rows] bool: image-span rows
        if any(c.images is not None for c in ordered):
            vl = torch.zeros(h.size(0), dtype=torch.bool, device=self.device)
            for i, c in enumerate(ordered):
                if c.images is not None:
                    h[offsets[i] + c.images.rows.to(self.device)] = c.images.embeds.to(self.device, self.dtype)
                    vl[offsets[i] : offsets[i + 1]] = ~c.images.text[c.start : c.start + len(c.token_ids)]
        h = h.unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = torch.zeros(h.size(0), cfg.hc_mult, dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0  # the first collapse just takes copy 0
        return h, pre, vl

    def _layers(
        self,
        h: torch.Tensor,
        pre: torch.Tensor,
        depths: list[Depth],
        offsets: list[int],
        batch: PagedBatch | None,
        fetched: dict[int, Any],
        vl: torch.Tensor | None,
        ordered: list[Chunk] | None,
        pieces: Any = None,
    ) -> list[torch.Tensor]:
        """Run the stack in place over ``h``/``pre`` (rows ordered deepest first); returns the DSpark
        targets' hidden states of the Depth.ALL rows. Without ``batch`` each chunk of ``ordered`` is
        its own segment (the per-sequence reference path). ``pieces``: a
        :class:`~asympd.engine.cuda_graphs.PiecewiseGraphs` that runs the full layers."""
        cfg = self.cfg
        shared: list[dict[str, Any]] = [{} for _ in depths]
        targets = {lid: i for i, lid in enumerate(cfg.dspark_target_layer_ids)} if cfg.dspark_block_size else {}
        hidden: list[torch.Tensor] = []  # per target layer, [rows_all, dim]
        rows_all = offsets[sum(d is Depth.ALL for d in depths)]
        k = cfg.last_kv_source
        runs = [self._layers_run(d) for d in depths]
        deeper = [-n for n, _ in runs]  # ascending: chunks are ordered deepest first
        kv_path_only = [i for i, r in enumerate(runs) if r == (k, True)]
        for layer in range(cfg.n_layers):
            full = range(bisect.bisect_left(deeper, -layer))  # the chunks that run this layer in full
            path = kv_path_only if layer == k else []
            if not full and not path:
                break
            block = self.blocks[layer]
            n_full = offsets[full[-1] + 1] if full else 0
            n_rows = offsets[(path or full)[-1] + 1]
            if layer in fetched:
                text = None if vl is None else ~vl[:n_rows]
                h[:n_rows] = block.engram(h[:n_rows], fetched[layer][:n_rows], text)
            if layer in targets and rows_all:  # one op for every Depth.ALL row (a prefix of the batch)
                hidden.append(h[:rows_all].float().mean(dim=1).to(self.dtype))

            def view(i: int, layer: int = layer) -> SegmentView:
                c = ordered[i]
                return SegmentView(
                    c.kv,
                    offsets[i],
                    offsets[i + 1],
                    c.start,
                    c.encoder_floor if layer <= k else c.floor,
                    c.write_global,
                    shared[i],
                    self.device,
                )

            if full:
                segs = batch.rows_view(0, len(full), decoder=layer > k) if batch else [view(i) for i in full]
                rows_vl = None if vl is None else vl[:n_full]
                if pieces is not None:
                    h[:n_full], pre[:n_full] = pieces.block(block, h[:n_full], pre[:n_full], segs)
                else:
                    h[:n_full], pre[:n_full] = block(h[:n_full], pre[:n_full], segs, rows_vl)
            if path:
                lo = offsets[path[0]]
                x = block.attn_input(h[lo:n_rows], pre[lo:n_rows])
                if batch:
                    block.attn.kv_path(x, batch.rows_view(path[0], path[-1] + 1, decoder=False))
                else:
                    segs = [view(i) for i in path]
                    for s in segs:
                        s.lo, s.hi = s.lo - lo, s.hi - lo
                    block.attn.kv_path(x, segs)
        return hidden

    def logits(self, h: torch.Tensor, pre: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits of ``rows`` of the final hidden state."""
        x = rms_norm(hc_pre(h[rows], pre[rows]), self.norm, self.cfg.norm_eps)
        return lm_head(x, self.head)

    def resident_bytes(self) -> int:
        """Bytes of every weight this role holds on its device (Engram tables only where they are on it:
        the packed GPU build keeps them in host memory)."""
        seen: set[int] = set()
        total = 0

        def visit(obj: Any) -> None:
            nonlocal total
            if isinstance(obj, torch.Tensor):
                if id(obj) not in seen and obj.device == self.device:
                    seen.add(id(obj))
                    total += obj.numel() * obj.element_size()
            elif isinstance(obj, torch.nn.Module):
                for v in vars(obj).values():
                    visit(v)
                for v in obj._parameters.values():
                    visit(v)
                for v in obj._buffers.values():
                    visit(v)
                for v in obj._modules.values():
                    visit(v)
            elif isinstance(obj, dict):
                for v in obj.values():
                    visit(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    visit(v)
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                visit(vars(obj))

        visit(self)
        return total
