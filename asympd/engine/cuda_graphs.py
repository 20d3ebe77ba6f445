"""Decode steps replayed as CUDA graphs.

At decode sizes a step is bound by kernel launches, not by the GPU: the layer stack of a 16-request
step replays as one graph in a quarter of its eager time (docs/performance.md §11). A step qualifies
when its chunks are alike: every layer, the same rows per request (1 + k verify rows or fewer, up
to ``max_rows``, or exactly a D's W rows of a bounded prefill or replay, ``prefill_rows``), the same
logits (every row, the last or none) and global-KV writes, no image rows, all in one paged cache. Other steps
(prefill chunks, bounded prefills beside decodes) run eagerly; a D whose admission policy keeps
them apart (``SchedulerConfig.mixed_steps`` off) replays both kinds.

A graph replays the device work of the run it was captured from, so that run must not depend on
anything that changes between steps (kv/batch.py: ``PagedBatch.max_context``, ``fixed_groups``,
``mirror_log``). Each graph is keyed by:

- the number of requests, padded up to one of ``BATCH_SIZES`` (as vLLM pads): padding segments
  run on the cache's scratch slot and scratch block, their rows computed and thrown away;
- rows per request, which rows need logits and whether the rows write global KV (a symmetric D's
  replay does not);
- the context bound, a power of two (key counts of the indexer are padded to it; entries past a
  row's visible ones are masked as they are eagerly), and the block-table width (a power of two,
  covering the context bound).

The step's metadata, tokens and Engram rows are copied into the graph's static inputs; the host's
row counts of windows and open groups, updated in Python while a layer runs eagerly, are logged
during capture and applied per step with the step's own values. The outputs (logits, argmax, the
drafter's hidden rows) go to buffers every graph shares, copied out before the next step.

When graphs are built. By default the engine builds them at start-up (``capture_at_startup``, as
vLLM does), so that serving never pays a capture, or a Triton compile of a kernel's first shape,
mid-traffic: every padded batch size, for verify steps of 1 + k rows, decode steps of one and
verify steps of fewer drafts, context bounds shortest first up to the longest sequence the model
and the cache allow, at most ``max_graphs`` of them; the rest (and all, with lazy capture) are
built by the first step of their key: it runs eagerly over the static buffers (its result is the
step's), then is captured. A graph built at start-up comes from a step of padding segments only
(every one on the scratch slot and block; what it writes is thrown away), so it must replay
correctly for any real step of its key: nothing the host decides while the body runs may depend on
a segment's values, only on the key. Where the host looks while it runs:

- the row layout (rows per segment, write_global): ``uniform_groups``, the view's row offsets, the
  compressor groups written per segment (``fixed_groups``: ceil(rows / ratio)), whether some rows
  skip global writes (``take_rows``). Fixed by the key: every segment has the key's rows and
  writes global KV (``key`` takes no other step), and ``PagedBatch.load`` refuses another layout;
- key counts (the indexer's, top-k sizes): ``entry_bound`` from the key's context, never the starts;
- the host row counts of windows and open groups: logged as (object, segments, taken) and applied
  per step from the step's own starts and slots;
- the segments' starts and slots themselves: nowhere. In a batch laid out for a graph
  (``fixed_groups``) ``BatchRows.host`` refuses to read them, so a value-dependent decision fails
  loudly on CPU (the static path without capture, tests/engine/test_batched_step.py) instead of
  being baked into a graph;
- the MoE on CUDA sorts rows by expert on the device with shape-bound block counts
  (``moe_blocks``); the CPU MoE reads the routing on the host, harmless since the CPU never captures.

The drafter's graphs (``DraftGraphs``) have no segment data on the host at all (slots and
positions are device inputs), so each padded size is built at start-up from padding requests too;
they seed the windows with a verify step's accepted rows (1 + k rows per request, padded, with the
slots, first positions and counts as device inputs; the host row counts replayed from the log as
above), replay the blocks, their head and, for steps of greedy requests, the Markov loop that picks
the drafts (``DSpark.markov_greedy``): a greedy verify step's drafting is one copy of the accepted
rows, one replay and one copy of the drafts.

Captures are thread-local (``capture_error_mode="thread_local"``): in a server, other threads (the
prefix transfers) keep using the GPU while the engine's thread captures.

``capture=False`` runs the same static path without graphs (every replay re-runs the layers over
the static buffers): the CPU suite checks the padding, the fixed group writes and the replayed host
bookkeeping against the eager path with it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asympd.engine.graph_sizes import BATCH_SIZES
from asympd.kv.batch import BatchSegment, PagedBatch, mirror_rows
from asympd.kv.paged_cache import PagedKVCache
from asympd.model.dspark import DraftBatch
from asympd.model.transformer import Depth, ForwardOutput

MIN_CONTEXT = 1024
# the row counts a piecewise step is padded to (``PiecewiseGraphs``): a D's mixed steps
PIECE_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# a prefill worker's piece sizes. Above 2048 rows its steps run eagerly: there its kernels, not its
# launches, hold the step (2688 rows at true depth: 158 ms of kernels in a 175 ms step, 896 rows: 72 ms
# in 123-204, bench/results/p_step_anatomy.json). Between 512 and 2048 every 256 rows, not every
# power of two: padded to 2048, a 1107-row step ran 129 ms of kernels against 85 eagerly
# (p_steps_pieces_9516511.json); a P's lone prompts are 1-3K tokens. The buffers are one set at the
# largest size (``PiecewiseGraphs``); each size is 40 more pieces at start-up; a step budget below
# 2048 rows keeps the sizes it can reach (``piece_sizes_for``).
PREFILL_PIECE_ROWS = (16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048)


def piece_sizes_for(budget: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """The piece sizes a step budget of ``budget`` rows can use: those below it and the first at or
    above it (a full step pads to it), so that a small budget neither warms nor holds buffers for
    sizes its steps never reach."""
    below = tuple(s for s in sizes if s < budget)
    above = [s for s in sizes if s >= budget]
    return below + tuple(above[:1])


@dataclass(frozen=True)
class GraphKey:
    segments: int  # requests, padded
    rows: int  # rows per request (1 + drafts)
    logits: str  # "last" | "all" | "none"
    context: int  # bound on start + rows, a power of two
    width: int  # block-table columns, a power of two
    write_global: bool = True  # False: a replay over global KV that P computed


@dataclass(frozen=True)
class PrefillSteps:
    """A D's steps of first-step chunks alone (``rows`` = W each: a bounded prefill, or a symmetric
    D's replay), for up to ``most`` requests: graphs built at start-up beside the decode steps'."""

    rows: int
    most: int
    logits: str = "last"  # "none": the replay of a mode whose P made the first token
    write_global: bool = True


@dataclass
class _Static:
    """One captured step: its static inputs, outputs and what the host replays after it."""

    batch: PagedBatch
    tokens: torch.Tensor
    fetched: dict[int, Any]
    run: Any  # the body: () -> (logits, argmax, the DSpark targets' hidden side by side), shared buffers
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    mirror_log: list[Any] = dataclasses.field(default_factory=list)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _sizes(max_batch: int) -> list[int]:
    """The padded batch sizes captured: ``BATCH_SIZES`` up to the engine's largest batch."""
    return [b for b in BATCH_SIZES if b < max_batch] + [max_batch]


def _check_cache(cache: PagedKVCache, capture: bool) -> None:
    if cache.scratch_block is None:
        raise ValueError("CUDA graphs need a cache built with scratch=True (padding rows go there)")
    if capture and cache.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {cache.device}")


class DecodeGraphs:
    """The CUDA graphs of one model and cache (``capture=False``: the static path, eagerly)."""

    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        *,
        max_batch: int = BATCH_SIZES[-1],
        capture: bool = True,
        piecewise: bool = False,
        max_rows: int | None = None,
        prefill_rows: int | None = None,
        piece_rows: Sequence[int] = PIECE_ROWS,
    ):
        """``piecewise``: the steps that do not qualify run as :class:`PiecewiseGraphs` (else eagerly),
        padded to one of ``piece_rows`` (a prefill worker's: ``PREFILL_PIECE_ROWS``), larger ones eagerly.
        ``max_rows``: the most rows per request of a decode or verify step (the engine's 1 + k; 0 for
        a prefill worker, whose steps never decode);
        ``prefill_rows``: the rows of a D's first step for a request (W; a symmetric P's last phase),
        whose steps alone replay
        too (at true depth one of one request takes 0.105 s as a graph, 0.43 s eagerly). Steps of
        other row counts (prompt chunks that happen to be equal, a prompt shorter than W) run as the
        mixed steps do, not as graphs of their own."""
        _check_cache(cache, capture)
        self.model, self.cache, self.capture = model, cache, capture
        self.max_rows, self.prefill_rows = max_rows, prefill_rows
        self.sizes = _sizes(max_batch)
        self.graphs: dict[GraphKey, _Static] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._out: dict[int, torch.Tensor] = {}  # the steps' outputs (logits, argmax, hidden), shared
        # steps: replayed (or re-run over the static buffers), run eagerly before a capture, not taken
        # startup: graphs built before any request (``capture_all``)
        self.counts = {"captured": 0, "replayed": 0, "first": 0, "eager": 0, "startup": 0}
        self.steps_by_key: collections.Counter[GraphKey] = collections.Counter()  # steps served, per graph
        self.piecewise = PiecewiseGraphs(cache.device, capture=capture, sizes=piece_rows) if piecewise else None

    @property
    def stats(self) -> dict[str, int]:
        """The steps' counts; with pieces, ``captured`` counts them too (one captured while serving
        is a new shape, as a whole-step graph is) and ``blocks`` / ``eager_blocks`` say how many layer
        runs went through them or ran eagerly (steps too large), as :class:`PrefillPieces` reports."""
        if self.piecewise is None:
            return dict(self.counts)
        ps = self.piecewise.stats
        return {**self.counts, "captured": self.counts["captured"] + ps["captured"],
                "blocks": ps["blocks"], "eager_blocks": ps["eager"],
                "piece_buffer_bytes": self.piecewise.buffer_bytes()}  # fmt: skip

    # ---- which steps qualify -------------------------------------------------------------------

    def key(self, ordered: list[Any], segs: list[BatchSegment]) -> GraphKey | None:
        c0 = ordered[0]
        q = len(c0.token_ids)
        if len(ordered) > self.sizes[-1] or c0.logits not in ("last", "all", "none"):
            return None
        if self.max_rows is not None and q > self.max_rows and q != self.prefill_rows:
            return None
        for c in ordered:
            if (
                c.depth is not Depth.ALL
                or c.images is not None
                or c.write_global != c0.write_global
                or len(c.token_ids) != q
                or c.logits != c0.logits
                or getattr(c.kv, "cache", None) is not self.cache
            ):
                return None
        longest = max(len(s.block_table) for s in segs)
        # a table past its rows' bound (at a power-of-two length, the block of the token about to be
        # sampled) takes the next bound, whose graphs start-up built, not a wider graph of its own:
        # a prompt of exactly 1024 tokens made a 0.5-0.8 s capture in its P's or D's first step
        reach = max(max(s.start + s.rows for s in segs), longest * self.cache.spec.block_size)
        context = max(MIN_CONTEXT, _pow2(reach))
        b = self.sizes[bisect.bisect_left(self.sizes, len(ordered))]
        width = self._width(context, longest)
        return GraphKey(b, q, c0.logits, context, width, c0.write_global)

    def _width(self, context: int, longest: int) -> int:
        """Block-table columns: the tables cover the context bound (padded key counts address real,
        masked entries)."""
        return max(_pow2(longest), -(-context // self.cache.spec.block_size))

    def _pad(self, key: GraphKey) -> BatchSegment:
        cache = self.cache
        return BatchSegment(
            [cache.scratch_block] * key.width, cache.scratch_slot, 0, key.rows, write_global=key.write_global
        )

    # ---- graphs built at start-up ------------------------------------------------------------------

    def startup_keys(
        self, rows: Sequence[int], max_tokens: int, prefills: Sequence[PrefillSteps] = ()
    ) -> list[GraphKey]:
        """The keys of every decode step of requests of ``rows`` rows each (1 + k verify rows take
        logits for all, a single row for the last) whose positions stay below ``max_tokens``: shortest
        context first (every request passes through it), then largest batch first (vLLM's order:
        the smaller graphs reuse the pool memory the larger ones left). A step whose block table
        reaches past its rows' bound takes the next bound's key (``key``)."""
        keys = []
        context = MIN_CONTEXT
        while context <= max(MIN_CONTEXT, _pow2(max_tokens)):
            width = self._width(context, -(-context // self.cache.spec.block_size))
            for q in rows:
                keys += [GraphKey(b, q, "all" if q > 1 else "last", context, width) for b in reversed(self.sizes)]
            for p in prefills:  # a D's steps of first-step chunks alone
                top = self.sizes[min(bisect.bisect_left(self.sizes, p.most), len(self.sizes) - 1)]  # padded
                keys += [
                    GraphKey(b, p.rows, p.logits, context, width, p.write_global)
                    for b in reversed(self.sizes)
                    if b <= top
                ]
            context *= 2
        return keys

    @torch.inference_mode()  # as the model's forward, which builds the graphs captured lazily
    def capture_all(self, keys: Sequence[GraphKey]) -> int:
        """Build (and capture) the graphs of ``keys`` now, from steps of padding segments only (on
        the scratch slot and block): no request needed, and what they write is thrown away. Each runs
        once eagerly first (Triton compiles, workspaces). Returns how many were new."""
        like = _engram_like(self.model)
        new = 0
        for key in keys:
            if key in self.graphs:
                continue
            st = self.graphs[key] = self._build(key, [self._pad(key)] * key.segments, like)
            self._eager(st)
            if self.capture:
                self._capture(st)
            new += 1
        self.counts["startup"] += new
        return new

    # ---- a step ----------------------------------------------------------------------------------

    def run(
        self,
        ordered: list[Any],
        order: list[int],
        segs: list[BatchSegment],
        tokens: torch.Tensor,
        fetched: dict[int, Any],
    ) -> Any:
        """The step's ForwardOutput, or None when it does not qualify (the caller runs it eagerly).
        ``segs``: the chunks as batch segments (``transformer.batch_segments``)."""
        key = self.key(ordered, segs)
        if key is None:
            self.counts["eager"] += 1
            return None
        n = len(ordered)
        self.steps_by_key[key] += 1
        padded = segs + [self._pad(key)] * (key.segments - n)
        st = self.graphs.get(key)
        first = st is None
        if first:
            st = self.graphs[key] = self._build(key, padded, fetched)
        else:
            st.batch.load(padded)
        rows = n * key.rows
        st.tokens[:rows].copy_(tokens, non_blocking=True)
        for lid, f in fetched.items():
            if f.stream is not None:  # the side-stream copy lands first; its memory outlives this read
                current = torch.cuda.current_stream(f.rows.device)
                current.wait_stream(f.stream)
                f.rows.record_stream(current)
                f.scales.record_stream(current)
            st.fetched[lid].rows[:rows].copy_(f.rows)
            st.fetched[lid].scales[:rows].copy_(f.scales)
        if first or not self.capture:
            outputs, log = self._eager(st)
            self.counts["first" if first else "replayed"] += 1
        else:
            st.graph.replay()
            outputs, log = st.outputs, st.mirror_log
            self.counts["replayed"] += 1
        b = st.batch
        for rows_obj, s0, s1, taken in log:  # the host row counts, with this step's values
            s1 = min(s1, n)
            if s0 < s1:
                mirror_rows(rows_obj, b.h_slot[s0:s1], b.h_start[s0:s1], b.h_rows[s0:s1], taken)
        result = self._output(ordered, order, key, outputs)
        if first and self.capture:
            self._capture(st)
        return result

    def _build(self, key: GraphKey, padded: list[BatchSegment], fetched: dict[int, Any]) -> _Static:
        model = self.model
        batch = PagedBatch(self.cache, padded, width=key.width)
        batch.max_context, batch.fixed_groups = key.context, True
        total = key.segments * key.rows
        tokens = torch.zeros(total, dtype=torch.long, device=model.device)
        static_fetched = {
            lid: dataclasses.replace(
                f,
                rows=f.rows.new_zeros(total, *f.rows.shape[1:]),
                scales=f.scales.new_zeros(total, *f.scales.shape[1:]),
                stream=None,
            )
            for lid, f in fetched.items()
        }
        offsets = list(range(0, total + 1, key.rows))
        if key.logits == "last":
            wanted = torch.arange(key.rows - 1, total, key.rows, device=model.device)
        elif key.logits == "all":
            wanted = torch.arange(total, device=model.device)
        else:
            wanted = None
        depths = [Depth.ALL] * key.segments

        def body() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            batch.shared.clear()
            h, pre, _ = model._embed(tokens, [], offsets)
            hidden = model._layers(h, pre, depths, offsets, batch, static_fetched, None, None)
            logits = None if wanted is None else model.logits(h, pre, wanted)
            argmax = None if logits is None else logits.argmax(dim=-1)
            outs = (logits, argmax, torch.cat(hidden, dim=-1) if hidden else None)
            return tuple(None if t is None else self._shared_out(i, t) for i, t in enumerate(outs))

        return _Static(batch, tokens, static_fetched, body)

    def _shared_out(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into output buffer ``i``, which every graph shares: a step's outputs are
        copied out before the next step replays, so only the largest step's need memory, not each
        graph's (the logits of a verify step of 64 requests are ~130 MB at the real vocabulary).
        Only a step larger than any before allocates (outside a capture: its eager run comes
        first); the graphs captured earlier keep the smaller buffer."""
        buf = self._out.get(i)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = self._out[i] = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
        out = buf[: t.numel()].view(t.shape)
        out.copy_(t)
        return out

    def _eager(self, st: _Static) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], list[Any]]:
        """Run the static step's layers now (on a side stream before a capture, as torch asks:
        lazily made workspaces must exist before the capture)."""
        st.batch.mirror_log = []
        outputs = _side_stream_run(st.run, self.cache.device) if self.capture else st.run()
        log, st.batch.mirror_log = st.batch.mirror_log, None
        return outputs, log

    def _capture(self, st: _Static) -> None:
        """Record the step's device work. Capturing runs no kernel, so the cache is not touched."""
        torch.cuda.synchronize(self.cache.device)
        st.graph = torch.cuda.CUDAGraph()
        st.batch.mirror_log = []
        with torch.cuda.graph(st.graph, pool=self.pool, capture_error_mode="thread_local"):
            st.outputs = st.run()
        st.mirror_log, st.batch.mirror_log = st.batch.mirror_log, None
        self.counts["captured"] += 1

    def _output(self, ordered: list[Any], order: list[int], key: GraphKey, outputs: Any) -> Any:
        """The step's ForwardOutput from the (static) outputs: copies, since the next replay
        overwrites them."""
        logits, argmax, hidden = outputs
        n = len(ordered)
        per = {"last": 1, "all": key.rows, "none": 0}[key.logits]
        logits = logits[: n * per].clone() if per else None
        ids = argmax[: n * per].tolist() if per else None  # the step's one sync
        out_logits: list[Any] = [None] * n
        out_argmax: list[Any] = [None] * n
        out_hidden: list[Any] = [None] * n
        all_hidden = hidden[: n * key.rows].clone() if hidden is not None else None
        # every request's rows as views from one split each, not two slicing ops per request
        lg = logits.split(per) if per else None
        hid = all_hidden.split(key.rows) if all_hidden is not None else None
        for i in range(n):
            j = order[i]
            if per:
                out_logits[j] = lg[i]
                out_argmax[j] = ids[i * per : (i + 1) * per]
            if hid is not None:
                out_hidden[j] = hid[i]
        return ForwardOutput(out_logits, out_hidden, out_argmax)


@dataclass
class _StaticDraft:
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    run: Any
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, ...] | None = None
    # seeding in the graph (``seed_rows`` = R): each request's accepted rows at rows [i R, i R + count)
    # of ``hidden``, from ``seed_meta`` = (slot, first position, count) per request (the scratch slot
    # and 0 rows for padding requests and for steps seeded eagerly); ``seed_batch`` appends them
    hidden: torch.Tensor | None = None
    seed_meta: torch.Tensor | None = None
    seed_batch: PagedBatch | None = None


class DraftGraphs:
    """The DSpark blocks' forward (model/dspark.py ``blocks_forward``) as CUDA graphs, keyed by the
    drafting request count padded to ``BATCH_SIZES``; with ``num_drafts`` = K > 0, followed by the
    greedy Markov loop of K drafts (``DSpark.markov_greedy``: per draft one bias GEMM and one argmax,
    no host work), whose tokens and confidence a step of greedy requests takes as they are (a request
    wanting fewer drafts keeps a prefix: each draft depends only on the ones before it); a step with
    sampled requests runs the loop eagerly on the graph's base logits instead. With ``seed_rows`` =
    R > 0 the graph first seeds the windows with each request's accepted rows (1 to R of them: a
    verify step's 1 + k rows padded to R, the rows past a request's count computed and never
    written; ``DSpark.seed_static``), so a verify step's drafting is one replay; steps whose seeding
    does not fit (prompt chunks, seed-only requests) seed eagerly and the graph's seeding writes only
    the scratch slot. The blocks only read the cache (windows by position), so padding requests just
    read the scratch slot. ``capture=False``: the static path without graphs (CPU tests)."""

    def __init__(
        self,
        drafter: Any,
        cache: PagedKVCache,
        *,
        max_batch: int = BATCH_SIZES[-1],
        capture: bool = True,
        num_drafts: int = 0,
        seed_rows: int = 0,
    ):
        _check_cache(cache, capture)
        self.drafter, self.cache, self.capture = drafter, cache, capture
        self.num_drafts, self.seed_rows = num_drafts, seed_rows
        self.sizes = _sizes(max_batch)
        self.graphs: dict[int, _StaticDraft] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # markov: drafting steps whose drafts came from the graph's greedy Markov loop
        # seeded: drafting steps whose windows the graph seeded
        self.stats = {"captured": 0, "replayed": 0, "first": 0, "eager": 0, "startup": 0, "markov": 0, "seeded": 0}

    def fits(self, n: int) -> bool:
        """Whether a step of ``n`` drafting requests replays (else it runs eagerly)."""
        return n <= self.sizes[-1]

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: list[int],
        seed: tuple[torch.Tensor, list[int], list[int]] | None = None,
    ) -> tuple[torch.Tensor, ...] | None:
        """(x, logits) of the real rows (views of the static outputs), plus (greedy draft tokens [n, K],
        confidence [n, K]) with ``num_drafts`` = K > 0 (the logits then of each block's first K rows
        only); or None: run it eagerly. ``seed``: (every request's accepted rows [M, n_targets * dim]
        in request order, their first positions, their counts (1..R each)): the graph seeds the
        windows with them first (``seed_rows`` = R); without it the caller seeded them already."""
        n = len(slots)
        if not self.fits(n):
            self.stats["eager"] += 1
            return None
        if seed is not None and not self.seed_rows:
            raise ValueError("this drafter's graphs do not seed the windows (seed_rows=0)")
        b = self.drafter.block_size
        n_pad = self.sizes[bisect.bisect_left(self.sizes, n)]
        st = self.graphs.get(n_pad)
        first = st is None
        if first:
            st = self.graphs[n_pad] = self._build(n_pad)
        st.tokens[: n * b].copy_(tokens, non_blocking=True)
        st.positions[: n * b].copy_(positions, non_blocking=True)
        scratch = self.cache.scratch_slot
        padded = slots + [scratch] * (n_pad - n)
        if st.seed_meta is None:
            st.slots.copy_(torch.tensor(padded, dtype=torch.long), non_blocking=True)
        else:
            seed_slots, starts, counts = (slots, *seed[1:]) if seed is not None else ([], [], [])
            pad = n_pad - len(seed_slots)
            meta = [padded, seed_slots + [scratch] * pad, starts + [0] * pad, counts + [0] * pad]
            st.slots.copy_(torch.tensor(meta[0], dtype=torch.long), non_blocking=True)
            st.seed_meta.copy_(torch.tensor(meta[1:], dtype=torch.long), non_blocking=True)
            if seed is not None:
                hidden, counts_np = seed[0], np.asarray(counts, dtype=np.int64)
                # request i's rows go to rows [i R, i R + count_i) of the static buffer
                first_row = np.repeat(np.arange(n, dtype=np.int64) * self.seed_rows, counts_np)
                within = np.arange(hidden.size(0), dtype=np.int64) - np.repeat(
                    np.cumsum(counts_np) - counts_np, counts_np
                )
                idx = torch.from_numpy(first_row + within).to(self.cache.device, non_blocking=True)
                st.hidden.index_copy_(0, idx, hidden.to(device=st.hidden.device, dtype=st.hidden.dtype))
                self.stats["seeded"] += 1
        if first or not self.capture:
            outputs = _side_stream_run(st.run, self.cache.device) if self.capture else st.run()
            self.stats["first" if first else "replayed"] += 1
        else:
            st.graph.replay()
            outputs = st.outputs
            self.stats["replayed"] += 1
        if first and self.capture:
            self._capture(st)
            # this call's outputs (made on the side stream): copies on the current one
            outputs = tuple(t.clone() for t in outputs)
        if seed is not None:  # the host row counts of the windows, with this step's values
            h_slot, h_start, h_rows = (np.asarray(v, dtype=np.int64) for v in (slots, seed[1], seed[2]))
            for rows_obj, s0, s1, taken in st.seed_batch.mirror_log:
                s1 = min(s1, n)
                if s0 < s1:
                    mirror_rows(rows_obj, h_slot[s0:s1], h_start[s0:s1], h_rows[s0:s1], taken)
        x, logits, *markov = outputs
        per = self.num_drafts or b  # logits rows per request
        return (x[: n * b], logits[: n * per], *(t[:n] for t in markov))

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Build (and capture) every padded size now, from padding requests only (the scratch slot;
        the blocks only read the cache). Returns how many were new."""
        new = 0
        for n_pad in self.sizes:
            if n_pad in self.graphs:
                continue
            st = self.graphs[n_pad] = self._build(n_pad)
            if self.capture:
                _side_stream_run(st.run, self.cache.device)  # warm-up: Triton compiles, workspaces
                self._capture(st)
            else:
                st.run()
            new += 1
        self.stats["startup"] += new
        return new

    def _build(self, n_pad: int) -> _StaticDraft:
        """The static inputs of ``n_pad`` requests, every one a padding request until a step loads its own."""
        dev, b = self.cache.device, self.drafter.block_size
        st = _StaticDraft(
            torch.zeros(n_pad * b, dtype=torch.long, device=dev),
            torch.arange(b, device=dev).repeat(n_pad),
            torch.full((n_pad,), self.cache.scratch_slot, dtype=torch.long, device=dev),
            None,
        )
        batch = DraftBatch([], None, None, slots=st.slots, cache=self.cache, block_pos=st.positions)
        view = None
        if self.seed_rows:
            r, drafter = self.seed_rows, self.drafter
            st.hidden = torch.zeros(n_pad * r, drafter.main_proj.weight.size(1), dtype=drafter.dtype, device=dev)
            st.seed_meta = torch.zeros(3, n_pad, dtype=torch.long, device=dev)
            st.seed_meta[0] = self.cache.scratch_slot
            # the layout (R rows per request) from padding segments; slot, start and rows are the
            # static inputs, so the appends read the step's (BatchRows.seg), the host none of them
            pad = BatchSegment([self.cache.scratch_block], self.cache.scratch_slot, 0, r)
            st.seed_batch = PagedBatch(self.cache, [pad] * n_pad)
            st.seed_batch.slot, st.seed_batch.start, st.seed_batch.rows = st.seed_meta.unbind(0)
            st.seed_batch.mirror_log = []
            view = st.seed_batch.rows_view(0, n_pad, decoder=False)

        def body() -> tuple[torch.Tensor, ...]:
            if view is not None:
                st.seed_batch.mirror_log.clear()  # the appends log their host updates (applied per step)
                self.drafter.seed_static(st.hidden, st.seed_batch.start, self.seed_rows, view)
            # the head on the rows drafts come from only (all of them without num_drafts)
            x, logits = self.drafter.blocks_forward(st.tokens, batch, self.num_drafts or None)
            if not self.num_drafts:
                return x, logits
            first = st.tokens.view(n_pad, b)[:, 0]  # each block's newest token
            return x, logits, *self.drafter.markov_greedy(x, logits, first, self.num_drafts)

        st.run = body
        return st

    def _capture(self, st: _StaticDraft) -> None:
        torch.cuda.synchronize(self.cache.device)
        st.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(st.graph, pool=self.pool, capture_error_mode="thread_local"):
            st.outputs = st.run()
        self.stats["captured"] += 1


def _engram_like(model: Any) -> dict[int, Any]:
    """One looked-up row per Engram layer, as ``Transformer._fetch_engram`` gives a step's: what a
    graph built before any request shapes its static Engram inputs after."""
    hasher = getattr(model, "hasher", None)
    if not model.cfg.engram_layer_ids or hasher is None:
        return {}
    like = {}
    for lid in model.cfg.engram_layer_ids:
        block = model.blocks[lid]
        if block is not None and block.engram is not None:
            like[lid] = block.engram.fetch(torch.zeros(1, hasher.n_hash_cols, dtype=torch.long), model.device)
    return like


@dataclass
class StartupCapture:
    """What ``capture_at_startup`` built, and what it left to be captured when first met."""

    keys: list[GraphKey]  # the decode/verify graphs built
    lazy: list[GraphKey]  # left for later (past ``max_graphs``)
    draft_graphs: int
    seconds: float
    reserved_bytes: int  # device memory the allocator reserved meanwhile: the graphs' pool, workspaces

    def line(self) -> str:
        """The start-up log line."""
        text = f"CUDA graphs at start-up: {len(self.keys)} decode/verify graphs"
        if self.keys:
            sizes, rows = sorted({k.segments for k in self.keys}), sorted({k.rows for k in self.keys})
            ctx = sorted({k.context for k in self.keys})
            text += f" (batch sizes {sizes[0]}-{sizes[-1]}, rows {rows}, contexts {ctx[0]}-{ctx[-1]})"
        text += (
            f" and {self.draft_graphs} drafter graphs in {self.seconds:.1f} s, "
            f"{self.reserved_bytes / 2**20:.0f} MiB reserved on the device"
        )
        if self.lazy:
            ctx = sorted({k.context for k in self.lazy})
            text += f"; {len(self.lazy)} left to capture when first met (contexts {ctx[0]}-{ctx[-1]})"
        return text


def capture_at_startup(
    graphs: DecodeGraphs,
    drafts: DraftGraphs | None,
    rows: Sequence[int],
    max_tokens: int,
    max_graphs: int,
    prefills: Sequence[PrefillSteps] = (),
    max_context: int | None = None,
) -> StartupCapture:
    """Build the decode/verify graphs of the first ``max_graphs`` of ``graphs.startup_keys(rows,
    max_tokens, prefills)`` whose context bound covers no more than ``max_context`` tokens (the rest
    are captured when first met) and every drafter graph."""
    device = graphs.cache.device
    cuda = device.type == "cuda"
    reserved = torch.cuda.memory_reserved(device) if cuda else 0
    t0 = time.perf_counter()
    keys = graphs.startup_keys(rows, max_tokens, prefills)
    bound = max(MIN_CONTEXT, _pow2(max_context)) if max_context is not None else None
    take = [k for k in keys if bound is None or k.context <= bound][:max_graphs]
    lazy = keys[len(take) :]  # shortest contexts come first: what is not taken is the tail
    graphs.capture_all(take)
    n_draft = drafts.capture_all() if drafts is not None else 0
    if cuda:
        torch.cuda.synchronize(device)
    grown = (torch.cuda.memory_reserved(device) - reserved) if cuda else 0
    return StartupCapture(take, lazy, n_draft, time.perf_counter() - t0, grown)


def _side_stream_run(fn: Any, device: torch.device) -> Any:
    """Run ``fn`` on a side stream (torch's advice before a capture: lazily made workspaces must
    exist first), ordered after and before the current stream's work."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream(device).wait_stream(side)
    return out


class _Piece:
    """One captured piece: a function of static input buffers that copies its results into static
    output buffers (so only those persist; its intermediates' pool memory is free for the next)."""

    def __init__(self, fn: Any, outs: list[torch.Tensor], pool: Any, capture: bool, device: torch.device):
        self.fn, self.outs, self.graph = fn, outs, None
        if capture:
            _side_stream_run(self._run, device)  # warm-up: Triton compiles, workspaces
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self._run()

    def _run(self) -> None:
        for buf, t in zip(self.outs, self.fn(), strict=True):
            buf.copy_(t)

    def __call__(self) -> None:
        if self.graph is None:
            self._run()
        else:
            self.graph.replay()


class PrefillPieces:
    """A prefill worker's CUDA graphs when it has no whole-step graph (an asymmetric or encoder-only
    P: no decode step, no window step): its prompt steps run each layer's parts around attention as
    :class:`PiecewiseGraphs`, padded to one of ``sizes`` (larger steps eagerly). A P step of a short
    prompt launches about 5,600 kernels at true depth and the host, not the GPU, sets its time
    (docs/performance.md §12, "A P step's launches"). The same interface as :class:`DecodeGraphs`
    where the engine reads one: ``run`` (no step is a whole-step graph), ``graphs``, ``stats``."""

    def __init__(self, device: torch.device, *, capture: bool = True, sizes: Sequence[int] = PREFILL_PIECE_ROWS):
        self.piecewise = PiecewiseGraphs(device, capture=capture, sizes=sizes)
        self.graphs: dict[GraphKey, _Static] = {}

    @property
    def stats(self) -> dict[str, int]:
        """``captured``: pieces captured (a new one while serving is a new shape); ``blocks``: layer
        runs through pieces; ``eager_blocks``: layer runs of steps too large for them;
        ``piece_buffer_bytes``: their static buffers (``/info``'s memory reports it)."""
        ps = self.piecewise.stats
        return {"captured": ps["captured"], "replayed": 0, "first": 0, "eager": 0,
                "blocks": ps["blocks"], "eager_blocks": ps["eager"],
                "piece_buffer_bytes": self.piecewise.buffer_bytes()}  # fmt: skip

    def run(self, *args: Any) -> None:
        """No whole-step graph: the forward runs its layers, through ``piecewise``."""
        return None


class PiecewiseGraphs:
    """Steps that do not qualify for a whole-step graph (prefill chunks, bounded prefills beside
    decodes) as piecewise graphs, vLLM's way: per layer, everything before attention's cache work
    (the hc mixes, the norm, the q/kv projections) and everything after it (the output projection,
    the hc update, the MoE) is replayed at the step's row count padded to one of ``sizes``; the cache
    work (window and compressed-KV reads and writes, the indexer, the sparse attention) runs eagerly
    on the real rows. The pieces touch no cache, so padding rows only cost their FLOPs. A step of
    more rows than the largest size runs eagerly. The buffers are one set at the largest size, each
    size's pieces reading and writing its first rows (steps replay one at a time on one stream), and
    every layer shares them. ``capture=False``: the same pieces without graphs."""

    def __init__(self, device: torch.device, *, capture: bool = True, sizes: Sequence[int] = PIECE_ROWS):
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"piece sizes must be increasing positive row counts, got {sizes}")
        self.device, self.capture = device, capture
        self.sizes = list(sizes)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._store: dict[str, torch.Tensor] = {}  # each buffer at the largest size
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}  # per size: views of the store's first rows
        self.pieces: dict[tuple[int, str, int], _Piece] = {}
        # pieces captured; layer runs through the pieces; layer runs too large for them (eager)
        self.stats = {"captured": 0, "blocks": 0, "eager": 0}

    def buffer_bytes(self) -> int:
        """Device bytes of the pieces' static buffers: one set at the largest size, whatever sizes
        have run (the graphs' private pool comes on top)."""
        return sum(t.nbytes for t in self._store.values())

    def block(self, block: Any, h: torch.Tensor, pre: torch.Tensor, view: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``block(h, pre, view)`` with its two pieces replayed; returns (h, next pre-mix) of the real rows
        (views of the buffers: copy them out before the next layer)."""
        n = h.size(0)
        if n > self.sizes[-1]:
            self.stats["eager"] += 1
            return block(h, pre, view)
        t = self.sizes[bisect.bisect_left(self.sizes, n)]
        buf = self.buffers.setdefault(t, {})
        if not buf:
            self._bind(buf, t, "h", h)
            self._bind(buf, t, "pre", pre)
            self._bind(buf, t, "pos", view.positions)
        buf["h"][:n].copy_(h)
        buf["pre"][:n].copy_(pre)
        buf["pos"][:n].copy_(view.positions)
        attn = block.attn

        def before() -> list[torch.Tensor]:
            mixes = block._mixes(buf["h"], "attn")
            x = block.attn_input(buf["h"], buf["pre"])
            return [*mixes, x, *attn.project(x, buf["pos"])]

        a = self._piece(
            block.layer, "before", t, before, buf, ("attn_pre", "attn_post", "attn_comb", "x", "rot", "qr", "q", "kv")
        )
        a()
        out = attn.core(*(buf[k][:n] for k in ("x", "rot", "qr", "q", "kv")), view)
        if "o" not in buf:
            self._bind(buf, t, "o", out)
        buf["o"][:n].copy_(out)

        def after() -> list[torch.Tensor]:
            y = attn.output(buf["o"], buf["rot"])
            return list(block.after_attention(y, buf["h"], (buf["attn_pre"], buf["attn_post"], buf["attn_comb"])))

        b = self._piece(block.layer, "after", t, after, buf, ("h_out", "pre_out"))
        b()
        self.stats["blocks"] += 1
        return buf["h_out"][:n], buf["pre_out"][:n]

    def _bind(self, buf: dict[str, torch.Tensor], t: int, name: str, like: torch.Tensor) -> None:
        """``buf[name]``: the first ``t`` rows of the store's buffer ``name``, made (zeros, at
        largest size's rows) in ``like``'s row shape and dtype when first needed."""
        full = self._store.get(name)
        if full is None:
            full = self._store[name] = like.new_zeros(self.sizes[-1], *like.shape[1:])
        buf[name] = full[:t]

    def _piece(
        self, layer: int, name: str, t: int, fn: Any, buf: dict[str, torch.Tensor], outs: tuple[str, ...]
    ) -> _Piece:
        key = (layer, name, t)
        piece = self.pieces.get(key)
        if piece is None:
            if any(k not in buf for k in outs):  # the first layer at this size: buffers shaped like its results
                for k, v in zip(outs, fn(), strict=True):
                    if k not in buf:
                        self._bind(buf, t, k, v)
            piece = self.pieces[key] = _Piece(fn, [buf[k] for k in outs], self.pool, self.capture, self.device)
            self.stats["captured"] += self.capture
        return piece
