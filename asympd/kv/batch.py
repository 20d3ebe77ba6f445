"""A step's sequences as one batch over the paged cache: what a batched forward reads and writes.

The per-request :class:`~asympd.kv.paged_cache.PagedSequenceKV` is the reference's view: one
sequence, host-side bookkeeping per call. A decode step of hundreds of requests needs the opposite:
every layer touches every sequence's caches with a handful of tensor ops whatever the batch size.
:class:`PagedBatch` holds the step's metadata once, on the device (each segment's slot, first
position, row count, floors and block table; each row's segment and position), and
:class:`BatchRows` is the slice of it one layer runs (deeper layers run a prefix of the rows).

Addressing never leaves the device: window and open-group rows are found by searching the positions
stored in the slots (ascending, oldest first; an imported prefix may leave a gap below the rows
computed here), compressed entries and index keys through the block tables. The host only mirrors
row counts, arithmetically, as :class:`~asympd.kv.paged_cache.PagedKVCache` does (that arithmetic
assumes the rows at and after a step's first position are contiguous, which appends keep true).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import Tensor

from asympd.kv.paged_cache import PagedKVCache
from asympd.kv.spec import GroupKind


@dataclass
class BatchSegment:
    """One sequence's rows in the step (host values)."""

    block_table: Sequence[int]
    slot: int
    start: int
    rows: int
    encoder_floor: int = 0
    floor: int = 0
    write_global: bool = True


class PagedBatch:
    """The step's segments, laid out row after row in the given order."""

    def __init__(self, cache: PagedKVCache, segments: Sequence[BatchSegment], *, width: int | None = None) -> None:
        """``width``: block-table columns (default: the longest table), fixed for a captured step."""
        if not segments:
            raise ValueError("a batch needs at least one segment")
        self.cache, self.device = cache, cache.device
        n = len(segments)
        flat = self._host_layout(segments, width)
        # one host-to-device copy for everything the layers address
        self._flat = d = torch.from_numpy(flat).to(self.device, non_blocking=True)
        total, width = self.num_rows, self.width
        sizes = [n, n, n, n, n + 1, 2 * n, n * width, total, total]
        (self.start, self.rows, self.slot, wg, self.lo, floors_d, table_d, self.row_seg, self.positions) = d.split(
            sizes
        )
        self.write_global = wg.bool()
        self.floors = floors_d.view(2, n)
        self.block_table = table_d.view(n, width)
        self.shared: dict[str, Any] = {}  # per-row selections handed down the stack (rows from 0)
        self._memo: dict[Any, Tensor] = {}
        # A captured step (engine/cuda_graphs.py) replays the device work of its first run, so nothing
        # the layers do may depend on host values that change between steps:
        # - ``max_context`` bounds every segment's start + rows; key counts come from it;
        # - ``fixed_groups``: every segment writes ceil(rows / ratio) compressor groups, those that
        #   did not complete into the cache's scratch block;
        # - ``mirror_log`` (a list): host row-count updates are logged, to be applied per step;
        # - with ``fixed_groups`` set, the layers may not read the segments' host starts or slots
        #   (``BatchRows.host`` refuses): only the layout (rows, write_global) may steer the host.
        self.max_context: int | None = None
        self.fixed_groups = False
        self.mirror_log: list[tuple[Any, int, int, np.ndarray | None]] | None = None

    def _host_layout(self, segments: Sequence[BatchSegment], width: int | None) -> np.ndarray:
        """Set the host arrays and return the flat int64 layout the device copy holds."""
        n = len(segments)
        # one pass over the segments' host values, then whole-array numpy (a step has hundreds of
        # segments, and a graph step lays them out again every step: ``load``)
        fields = (
            (s.start, s.rows, s.slot, s.write_global, s.encoder_floor, s.floor, len(s.block_table)) for s in segments
        )
        cols = np.fromiter(itertools.chain.from_iterable(fields), np.int64, 7 * n).reshape(n, 7)
        self.h_start, self.h_rows, self.h_slot = cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy()
        self.h_wg = cols[:, 3].astype(bool)
        self.h_lo = np.concatenate([[0], np.cumsum(self.h_rows)]).astype(np.int64)
        lengths = cols[:, 6]
        longest = max(1, int(lengths.max()))
        if width is not None and width < longest:
            raise ValueError(f"a block table of {longest} blocks does not fit a batch of width {width}")
        self.width = width = width or longest
        table = np.zeros((n, width), dtype=np.int64)
        # every table's entries at once: row i's first lengths[i] columns, in order
        filled = np.arange(width) < lengths[:, None]
        table[filled] = np.fromiter(itertools.chain.from_iterable(s.block_table for s in segments), np.int64)
        floors = cols[:, 4:6].T
        self.num_rows = total = int(self.h_lo[-1])
        row_seg = np.repeat(np.arange(n, dtype=np.int64), self.h_rows)
        positions = self.h_start[row_seg] + np.arange(total, dtype=np.int64) - self.h_lo[row_seg]
        parts = [self.h_start, self.h_rows, self.h_slot, self.h_wg.astype(np.int64), self.h_lo]
        return np.concatenate([*parts, floors.ravel(), table.ravel(), row_seg, positions])

    def load(self, segments: Sequence[BatchSegment]) -> None:
        """Overwrite the device metadata in place with another step of the same layout (segment
        count, rows per segment, width): what a captured step's replay reads."""
        shape = (len(self.h_rows), self.num_rows, self.width)
        rows, wg = self.h_rows.copy(), self.h_wg.copy()
        flat = self._host_layout(segments, self.width)
        same = np.array_equal(rows, self.h_rows) and np.array_equal(wg, self.h_wg)
        if (len(self.h_rows), self.num_rows, self.width) != shape or not same:
            raise ValueError("load: the new segments do not have this batch's layout")
        self._flat.copy_(torch.from_numpy(flat), non_blocking=True)

    def entry_bound(self, ratio: int, view: BatchRows) -> int:
        """How many compressed entries the view's rows may see at most (a key-count bound)."""
        if self.max_context is not None:
            return self.max_context // ratio
        return int(((view.host("start") + view.host("rows")) // ratio).max())

    def host_index(self, key: Any, make: Any) -> Tensor:
        """A device copy of the host array ``make()``, made once per batch: the layers of a step ask
        for the same index arrays (and a captured step must not copy from the host at all)."""
        if key not in self._memo:
            self._memo[key] = torch.from_numpy(np.ascontiguousarray(make())).to(self.device, non_blocking=True)
        return self._memo[key]

    def rows_view(self, s0: int, s1: int, decoder: bool) -> BatchRows:
        """Segments [s0, s1) with the floors of the layers above the last KV source (``decoder``) or up to it."""
        return BatchRows(self, s0, s1, decoder)


@dataclass
class BatchRows:
    """Segments [s0, s1) of a batch, as one layer runs them. Row indices are relative to the view's
    first row (0 for every full layer: the rows of a deeper layer are a prefix of the step's)."""

    batch: PagedBatch
    s0: int
    s1: int
    decoder: bool

    @property
    def shared(self) -> dict[str, Any]:
        return self.batch.shared

    @cached_property
    def r0(self) -> int:
        return int(self.batch.h_lo[self.s0])

    @cached_property
    def num_rows(self) -> int:
        return int(self.batch.h_lo[self.s1]) - self.r0

    @property
    def device(self) -> torch.device:
        return self.batch.device

    @cached_property
    def positions(self) -> Tensor:
        return self.batch.positions[self.r0 : self.r0 + self.num_rows]

    @cached_property
    def row_seg(self) -> Tensor:
        """Each row's segment, relative to s0."""
        return self.batch.row_seg[self.r0 : self.r0 + self.num_rows] - self.s0

    def seg(self, name: str) -> Tensor:
        """Per-segment metadata of the view: start, rows, slot, lo (relative to the view's rows),
        floor, block_table, write_global."""
        b, sl = self.batch, slice(self.s0, self.s1)
        if name == "lo":
            return b.lo[sl] - self.r0
        if name == "floor":
            return b.floors[int(self.decoder), sl]
        return getattr(b, name)[sl]

    def host(self, name: str) -> np.ndarray:
        b, sl = self.batch, slice(self.s0, self.s1)
        if b.fixed_groups and name in ("start", "slot"):
            # a captured step bakes in what the host decided: it may depend on the layout only
            raise RuntimeError(f"a captured step must not read the segments' host {name!r}")
        return {"start": b.h_start, "rows": b.h_rows, "slot": b.h_slot, "write_global": b.h_wg}[name][sl]

    @staticmethod
    def slot_positions(pos_buf: Tensor, base: Tensor, cap: int) -> Tensor:
        """The stored positions of each segment's slot: [S, cap], -1 = empty."""
        return pos_buf[base.unsqueeze(-1) + torch.arange(cap, device=base.device)]

    # ---- windows -----------------------------------------------------------------------------

    def window_index(self, layer: int, window: int) -> WindowIndex:
        """Where each row's ``window`` fixed slots (slot j = position p - window + 1 + j) come from:
        this step's rows or the rows already in the slot, and which are visible."""
        cache = self.batch.cache
        cap = cache.windows[layer].capacity
        seg = self.row_seg
        pos = self.positions
        start = self.seg("start")[seg].unsqueeze(-1)
        want = pos.unsqueeze(-1) - window + 1 + torch.arange(window, device=self.device)
        base = (self.seg("slot") * cache.window_kv.size(1) + layer) * cap  # flat row of each slot's first row
        j, found = find_positions(self.slot_positions(cache.window_pos.view(-1), base, cap)[seg], want)
        old = base[seg].unsqueeze(-1) + j
        is_new = want >= start
        new = (self.seg("lo")[seg].unsqueeze(-1) + want - start).clamp_min(0)
        visible = (is_new | found) & (want >= self.seg("floor")[seg].unsqueeze(-1)) & (want >= 0)
        return WindowIndex(cache.window_kv.view(-1, cache.window_kv.size(-1)), old, new, is_new, visible)

    def append_window(self, layer: int, kv: Tensor) -> None:
        """Append this view's rows (kv [rows, head_dim]) to every segment's window slot."""
        cache = self.batch.cache
        rows = cache.windows[layer]
        base = (self.seg("slot") * cache.window_kv.size(1) + layer) * rows.capacity
        flat_kv = cache.window_kv.view(-1, cache.window_kv.size(-1))
        self._append(rows, base, [flat_kv], cache.window_pos.view(-1), [kv], None)

    # ---- the compressor's open groups ---------------------------------------------------------

    def pair_base(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(flat kv, flat score, flat positions, each segment's first flat row) of ``pair.layer``."""
        rows = self.batch.cache.pairs[layer]
        kv, score, pos = rows.bufs
        base = self.seg("slot") * rows.capacity
        return kv.view(-1, kv.size(-1)), score.view(-1, score.size(-1)), pos.view(-1), base

    def append_pending(self, layer: int, kv: Tensor, score: Tensor) -> None:
        """Append the raw compressor rows of the segments that write global KV."""
        rows = self.batch.cache.pairs[layer]
        fkv, fscore, fpos, base = self.pair_base(layer)
        wg = self.host("write_global")
        self._append(rows, base, [fkv, fscore], fpos, [kv, score], None if wg.all() else wg)

    def _append(
        self,
        rows: Any,
        base: Tensor,
        bufs: list[Tensor],
        pos_buf: Tensor,
        new: list[Tensor],
        take: np.ndarray | None,
    ) -> None:
        """Each segment's slot (of those ``take`` marks, default all) becomes the newest ``capacity``
        rows of (its stored rows before ``start``) + (its rows of this step): gathered from both,
        then written back whole."""
        cap = rows.capacity
        start, n_rows, lo = self.seg("start"), self.seg("rows"), self.seg("lo")
        j = torch.arange(cap, device=self.device)
        slot_rows = base.unsqueeze(-1) + j  # [S, cap]
        stored = pos_buf[slot_rows]
        kept = ((stored >= 0) & (stored < start.unsqueeze(-1))).sum(-1)
        n_new = torch.clamp(kept + n_rows, max=cap)
        pos_j = (start + n_rows - n_new).unsqueeze(-1) + j  # position held by row j afterwards
        live = j < n_new.unsqueeze(-1)
        from_new = pos_j >= start.unsqueeze(-1)
        src_new = (lo.unsqueeze(-1) + pos_j - start.unsqueeze(-1)).clamp(0, max(self.num_rows - 1, 0))
        src_old = base.unsqueeze(-1) + find_positions(stored, pos_j)[0]
        if take is not None:  # the others keep their slot: write its rows back unchanged
            keep = ~self.batch.host_index(("take", self.s0, self.s1), lambda: take).unsqueeze(-1)
            from_new &= ~keep
            src_old = torch.where(keep, slot_rows, src_old)
            live = torch.where(keep, stored >= 0, live)
            pos_j = torch.where(keep, stored, pos_j)
        for buf, rows_new in zip(bufs, new, strict=True):
            old = buf[src_old.flatten()].view(*src_old.shape, -1)
            fresh = rows_new.to(buf.dtype)[src_new.flatten()].view(*src_new.shape, -1)
            content = torch.where(from_new.unsqueeze(-1), fresh, old)
            buf.index_copy_(0, slot_rows.flatten(), content.flatten(0, 1))
        pos_buf.index_copy_(0, slot_rows.flatten(), torch.where(live, pos_j, -1).flatten())
        self._mirror(rows, take)

    def _mirror(self, rows: Any, taken: np.ndarray | None) -> None:
        """Host row counts after an append, from host values only (rows are contiguous in position)."""
        if self.batch.mirror_log is not None:
            self.batch.mirror_log.append((rows, self.s0, self.s1, taken))
            return
        mirror_rows(rows, self.host("slot"), self.host("start"), self.host("rows"), taken)

    # ---- paged groups ------------------------------------------------------------------------

    def pool_rows(self, name: str, seg: Tensor, entry: Tensor) -> Tensor:
        """Flat pool rows of ``entry`` (any shape) of segments ``seg`` (same shape, relative to s0)."""
        g = self.batch.cache.spec.group(name)
        epb = g.entries_per_block
        table = self.seg("block_table")
        return table[seg, entry.div(epb, rounding_mode="floor")] * epb + entry % epb

    def pool(self, name: str) -> Tensor:
        g = self.batch.cache.spec.group(name)
        return self.batch.cache.pools[name].view(-1, g.width)

    def write_entries(
        self, layer: int, seg: Tensor, entry: Tensor, ckv: Tensor, keys: Tensor, valid: Tensor | None = None
    ) -> None:
        """Store compressed entries and index keys of a KV source (one row per (seg, entry)); rows
        not ``valid`` go to the cache's scratch block."""
        for kind, val in ((GroupKind.COMPRESSED, ckv), (GroupKind.INDEX, keys)):
            name = f"{kind.value}.{layer}"
            pool = self.pool(name)
            rows = self.pool_rows(name, seg, entry)
            if valid is not None:
                scratch = self.batch.cache.scratch_block
                if scratch is None:
                    raise RuntimeError("masked entry writes need a cache built with scratch=True")
                rows = torch.where(valid, rows, scratch * self.batch.cache.spec.group(name).entries_per_block)
            pool.index_copy_(0, rows, val.to(pool.dtype))

    def gather_entries(self, kind: GroupKind, layer: int, seg: Tensor, entry: Tensor) -> Tensor:
        """Entries (clamped at 0; mask them yourself) of a paged group, shaped ``entry.shape + [width]``."""
        name = f"{kind.value}.{layer}"
        rows = self.pool_rows(name, seg, entry.clamp_min(0))
        return self.pool(name)[rows.flatten()].view(*entry.shape, -1)

    def uniform_groups(self) -> list[tuple[int, np.ndarray, Tensor]]:
        """The view's segments grouped by row count (``(rows, segment indices relative to s0, the
        same on the device)``), so the indexer runs one padded batched GEMM per group, not one per
        sequence."""
        n = self.host("rows")
        out = []
        for q in np.unique(n):
            segs = np.flatnonzero(n == q)
            out.append((int(q), segs, self.batch.host_index(("group", self.s0, self.s1, int(q)), lambda s=segs: s)))
        return out

    def take_rows(self, take: np.ndarray) -> Tensor:
        """The view's rows of the segments ``take`` marks, as a device index."""

        def rows() -> np.ndarray:
            lo, n = self.batch.h_lo[self.s0 : self.s1] - self.r0, self.host("rows")
            return np.concatenate([np.arange(a, a + k) for a, k, t in zip(lo, n, take, strict=True) if t])

        return self.batch.host_index(("rows", self.s0, self.s1), rows)


def mirror_rows(rows: Any, slots: np.ndarray, start: np.ndarray, n: np.ndarray, taken: np.ndarray | None) -> None:
    """A slot group's host row counts after each slot got ``n`` rows from position ``start``
    (those ``taken`` marks, default all)."""
    if taken is not None:
        slots, start, n = slots[taken], start[taken], n[taken]
    length, last = rows.length[slots], rows.last[slots]
    dropped = np.clip(last - start + 1, 0, length)
    rows.length[slots] = np.minimum(rows.capacity, length - dropped + n)
    rows.last[slots] = start + n - 1


def find_positions(stored: Tensor, want: Tensor) -> tuple[Tensor, Tensor]:
    """(index, found) of each wanted position in its row of ``stored`` ([k, cap] positions, ascending,
    empty rows -1 at the end; ``want`` [k, n]). A search, not ``p - first``: an imported prefix
    may leave a gap between its rows and the ones computed here."""
    key = torch.where(stored < 0, torch.iinfo(torch.int64).max, stored)
    idx = torch.searchsorted(key, want).clamp_max(key.size(-1) - 1)
    return idx, key.gather(-1, idx) == want


@dataclass
class WindowIndex:
    """Sources of each row's window slots: ``old`` (flat rows of the window cache) where not
    ``is_new``, else ``new`` (rows of this step's kv)."""

    cache_rows: Tensor
    old: Tensor
    new: Tensor
    is_new: Tensor
    visible: Tensor

    def gather(self, kv: Tensor, r0: int, r1: int) -> Tensor:
        """Window keys of rows [r0, r1): [rows, W, head_dim] in kv's dtype."""
        new = kv[self.new[r0:r1].flatten()].view(r1 - r0, -1, kv.size(-1))
        old = self.cache_rows[self.old[r0:r1].flatten()].view_as(new).to(kv.dtype)
        return torch.where(self.is_new[r0:r1].unsqueeze(-1), new, old)
