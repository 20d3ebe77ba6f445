"""The KV tensors, and :class:`SequenceKV`, the per-request view the model reads and writes.

Paged groups (``ckv.L``, ``idx.L``) live in pools ``[num_blocks, entries_per_block, width]``; entry ``e``
of a request is row ``e % entries_per_block`` of block ``block_table[e // entries_per_block]``, so reads
and writes gather/scatter through the block table and cross block boundaries freely.

Windows (``swa.L``) and the compressor's pending rows (``pair.L``) live in request slots. Rows are kept
in append order (positions ascending); beyond the slot's capacity the oldest are dropped. Row counts
and the last position are mirrored on the host, so appends (with host ``positions``) and reads never
wait for the device; truncation, and an append that rewrites stored positions, sync once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from asympd.kv.spec import CacheGroup, GroupKind, KVCacheSpec


class SequenceKV(ABC):
    """One request's KV, as the model sees it. Paged and dense implementations behave identically.

    Compressed entries and index keys are addressed by entry index (position // ratio); the caller
    knows how many exist. Windows and pending rows carry absolute positions, ascending; appending rows
    from position p first drops the stored rows at positions >= p (a recompute replaces them).
    """

    @abstractmethod
    def read_compressed(self, layer: int, n: int) -> Tensor:
        """Entries ``0..n-1`` of ``ckv.layer``: ``[n, head_dim]``."""

    @abstractmethod
    def write_compressed(self, layer: int, start: int, entries: Tensor) -> None:
        """Store ``entries [k, head_dim]`` as entries ``start..start+k-1`` of ``ckv.layer``."""

    @abstractmethod
    def read_index_keys(self, layer: int, n: int) -> Tensor:
        """Entries ``0..n-1`` of ``idx.layer``: ``[n, index_head_dim]``."""

    @abstractmethod
    def write_index_keys(self, layer: int, start: int, keys: Tensor) -> None:
        """Store ``keys [k, index_head_dim]`` as entries ``start..start+k-1`` of ``idx.layer``."""

    @abstractmethod
    def window(self, layer: int) -> tuple[Tensor, Tensor]:
        """``(kv [m, head_dim], positions [m] int64)``, oldest first, ``m <= window capacity``. The
        tensors are snapshots: later appends do not change them."""

    @abstractmethod
    def append_window(self, layer: int, positions: Tensor, kv: Tensor) -> None:
        """Append rows to ``swa.layer``, keeping the most recent ``capacity`` rows."""

    @abstractmethod
    def pending(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Kept raw compressor rows of ``pair.layer``: ``(kv [p, head_dim] f32, score [p, head_dim] f32,
        positions [p])``, oldest first. The open group at length n is the rows at positions >=
        ``n // ratio * ratio``; up to ``ratio + spec_slack`` rows are kept so a rollback can restore it."""

    @abstractmethod
    def append_pending(self, layer: int, positions: Tensor, kv: Tensor, score: Tensor) -> None:
        """Append raw rows to ``pair.layer``, keeping the most recent ``ratio + spec_slack``."""

    @abstractmethod
    def truncate(self, num_tokens: int) -> None:
        """Drop every window and pending row at position >= ``num_tokens``. Compressed entries are not
        touched: their count is implied by the caller's sequence length (blocks are the manager's)."""


def _append_rows(bufs: Sequence[Tensor], rows: Sequence[Tensor], length: int, capacity: int) -> int:
    """Append ``rows`` to the first ``length`` rows of each ``bufs[i]`` (``[capacity, ...]``), keeping
    the most recent ``capacity``; returns the new length."""
    k = rows[0].shape[0]
    if k >= capacity:
        for buf, new in zip(bufs, rows, strict=True):
            buf.copy_(new[k - capacity :])
        return capacity
    if length + k > capacity:  # shift the kept tail to the front
        keep = capacity - k
        for buf in bufs:
            buf[:keep] = buf[length - keep : length].clone()
        length = keep
    for buf, new in zip(bufs, rows, strict=True):
        buf[length : length + k] = new
    return length + k


class _SlotRows:
    """One window or pair group, all slots: ``bufs`` are ``[max_seqs, capacity, ...]`` tensors whose
    last one holds the positions (-1 = empty). Lengths and last positions are mirrored on the host."""

    def __init__(self, bufs: tuple[Tensor, ...], dtypes: tuple[torch.dtype, ...]) -> None:
        self.bufs, self.dtypes = bufs, dtypes
        self.capacity = bufs[0].shape[1]
        self.length = np.zeros(bufs[0].shape[0], dtype=np.int64)
        self.last = np.full(bufs[0].shape[0], -1, dtype=np.int64)

    @property
    def pos(self) -> Tensor:
        return self.bufs[-1]

    def read(self, slot: int) -> tuple[Tensor, ...]:
        n = int(self.length[slot])
        return tuple(b[slot, :n].clone() for b in self.bufs)  # snapshots: later appends shift the slot

    def tail(self, slot: int, lo: int, hi: int) -> tuple[Tensor, ...] | None:
        """Views (not copies) of the slot's rows at positions ``[lo, hi)``, found from the host
        mirror without a device sync; None when the mirror cannot place them (the last stored row
        is not ``hi - 1``). A slot's rows are consecutive positions (appends continue the tail or
        rewrite it; truncation cuts it), so those rows are its last ``min(length, hi - lo)``."""
        n = int(self.length[slot])
        if self.last[slot] != hi - 1:
            return None
        k = min(n, hi - lo)
        return tuple(b[slot, n - k : n] for b in self.bufs)

    def append(self, slot: int, rows: tuple[Tensor, ...]) -> None:
        """``rows`` ends with the positions; stored rows at or after the first new position go first."""
        positions = rows[-1]
        if any(r.shape[0] != positions.shape[0] for r in rows) or rows[0].shape[1:] != self.bufs[0].shape[2:]:
            raise ValueError(f"rows of shapes {[tuple(r.shape) for r in rows]} for a {tuple(self.bufs[0].shape)} group")
        if positions.numel() == 0:
            return
        first, last = int(positions[0]), int(positions[-1])  # free when positions are on the host
        if first <= self.last[slot]:
            self.set_length(slot, int((self.pos[slot, : self.length[slot]] < first).sum()))
        device = self.pos.device
        rows = tuple(r.to(device, dt) for r, dt in zip(rows, self.dtypes, strict=True))
        slot_bufs = [b[slot] for b in self.bufs]
        self.length[slot] = _append_rows(slot_bufs, rows, int(self.length[slot]), self.capacity)
        self.last[slot] = last

    def set_length(self, slot: int, n: int, last: int | None = None) -> None:
        """Keep the first ``n`` rows of the slot; ``last`` is their last position if known."""
        self.pos[slot, n:].fill_(-1)
        self.length[slot] = n
        self.last[slot] = last if last is not None else (int(self.pos[slot, n - 1]) if n else -1)

    def reset(self, slot: int) -> None:
        self.set_length(slot, 0)


class PagedKVCache:
    """Owns every KV tensor of one worker: the paged pools and the request slots."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        max_seqs: int,
        device: torch.device | str = "cpu",
        *,
        scratch: bool = False,
    ) -> None:
        """``scratch``: one more block and slot that no request ever gets (``scratch_block``,
        ``scratch_slot``): a step captured at a padded batch size sends its padding rows' writes
        there, and the writes of compressor groups that did not complete (engine/cuda_graphs.py)."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.max_seqs = max_seqs
        self.device = dev = torch.device(device)
        self.scratch_block = num_blocks if scratch else None
        self.scratch_slot = max_seqs if scratch else None
        n_blocks, n_slots = num_blocks + scratch, max_seqs + scratch
        self.pools: dict[str, Tensor] = {
            g.name: torch.zeros(n_blocks, g.entries_per_block, g.width, dtype=getattr(torch, g.dtype), device=dev)
            for g in spec.paged_groups
        }
        cfg, cap, n_win = spec.cfg, spec.window_capacity, len(spec.window_layers)
        self.window_kv = torch.zeros(n_slots, n_win, cap, cfg.head_dim, dtype=getattr(torch, spec.dtype), device=dev)
        self.window_pos = torch.full((n_slots, n_win, cap), -1, dtype=torch.int64, device=dev)
        self.windows: dict[int, _SlotRows] = {
            layer: _SlotRows((self.window_kv[:, i], self.window_pos[:, i]), (self.window_kv.dtype, torch.int64))
            for i, layer in enumerate(spec.window_layers)
        }
        self.pairs: dict[int, _SlotRows] = {}
        for g in spec.pair_groups:
            kv = torch.zeros(n_slots, g.capacity, g.width, dtype=getattr(torch, g.dtype), device=dev)
            pos = torch.full((n_slots, g.capacity), -1, dtype=torch.int64, device=dev)
            self.pairs[g.layer] = _SlotRows((kv, torch.zeros_like(kv), pos), (kv.dtype, kv.dtype, torch.int64))
        self._slot_owner: list[Any] = [None] * n_slots

    def nbytes(self) -> int:
        tensors = [*self.pools.values(), self.window_kv, self.window_pos]
        tensors += [b for rows in self.pairs.values() for b in rows.bufs]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- request views --------------------------------------------------------------------------

    def view(
        self, seq_id: Any, block_table: Sequence[int] | Tensor, slot: int, *, fresh: bool = False
    ) -> PagedSequenceKV:
        """The request's :class:`SequenceKV`. ``block_table`` may be the manager's live list (it is read
        on every access, so growth is seen). The slot is cleared first when it last served another
        ``seq_id``, or when ``fresh`` (pass it for a new allocation if seq ids can be reused)."""
        if fresh or self._slot_owner[slot] != seq_id:
            self.reset_slot(slot)
            self._slot_owner[slot] = seq_id
        return PagedSequenceKV(self, block_table, slot)

    def reset_slot(self, slot: int) -> None:
        """Empty a slot's windows and pending rows (call when the slot is freed or reassigned)."""
        for rows in (*self.windows.values(), *self.pairs.values()):
            rows.reset(slot)
        self._slot_owner[slot] = None

    def fork_slot(self, src: int, dst: int, owner: Any, block_copies: Sequence[tuple[int, int]] = ()) -> None:
        """Make slot ``dst`` (now ``owner``'s) a copy of slot ``src``, and copy each ``(source,
        destination)`` block of every paged group: a forked request (BlockManager.fork) starts with
        its parent's windows, open compressor rows and partial block."""
        self.window_kv[dst] = self.window_kv[src]  # every window layer's rows at once
        self.window_pos[dst] = self.window_pos[src]
        for rows in self.pairs.values():
            for b in rows.bufs:
                b[dst] = b[src]
        for rows in (*self.windows.values(), *self.pairs.values()):  # the host mirrors
            rows.length[dst], rows.last[dst] = rows.length[src], rows.last[src]
        if block_copies:
            src_blocks = torch.tensor([a for a, _ in block_copies], device=self.device)
            dst_blocks = torch.tensor([b for _, b in block_copies], device=self.device)
            for pool in self.pools.values():
                pool[dst_blocks] = pool[src_blocks]
        self._slot_owner[dst] = owner

    def truncate(self, cuts: Sequence[tuple[int, int]]) -> None:
        """Drop every window and pending row at position >= n, for each ``(slot, n)``; one host sync
        for all of them (a speculative step rolls back many requests at once)."""
        if not cuts:
            return
        slots = torch.tensor([s for s, _ in cuts], device=self.device)
        limit = torch.tensor([n for _, n in cuts], device=self.device).view(-1, 1, 1)
        groups = [*self.windows.values(), *self.pairs.values()]
        pos = [self.window_pos[slots], *(rows.pos[slots].unsqueeze(1) for rows in self.pairs.values())]
        # rows are ascending and empty rows hold -1: kept rows are those with 0 <= pos < n
        kept = [(p >= 0) & (p < limit) for p in pos]
        counts = torch.cat([k.sum(-1) for k in kept], 1)
        lasts = torch.cat([torch.where(k, p, -1).amax(-1) for k, p in zip(kept, pos, strict=True)], 1)
        self.window_pos[slots] = pos[0].masked_fill(pos[0] >= limit, -1)
        for rows, p in zip(self.pairs.values(), pos[1:], strict=True):
            rows.pos[slots] = p.squeeze(1).masked_fill(p.squeeze(1) >= limit.view(-1, 1), -1)
        all_counts, all_lasts = torch.stack([counts, lasts]).cpu().numpy()  # the one sync
        at = np.array([s for s, _ in cuts])
        for j, g in enumerate(groups):  # every slot of a group at once (a slot appears once per step)
            g.length[at], g.last[at] = all_counts[:, j], all_lasts[:, j]

    # ---- paged gather / scatter -----------------------------------------------------------------

    def _rows(self, group: CacheGroup, block_table: Sequence[int] | Tensor, start: int, n: int) -> Tensor:
        """Flat pool row indices of entries ``start..start+n-1``."""
        epb = group.entries_per_block
        capacity = len(block_table) * epb
        if start < 0 or n < 0 or start + n > capacity:
            raise IndexError(
                f"{group.name}: entries [{start}, {start + n}) outside the {capacity} the block table covers"
            )
        table = torch.as_tensor(block_table, dtype=torch.int64).to(self.device, non_blocking=True)
        e = torch.arange(start, start + n, device=self.device)
        return table[e // epb] * epb + e % epb

    def _flat(self, group: CacheGroup) -> Tensor:
        return self.pools[group.name].view(-1, group.width)

    def read_entries(self, name: str, block_table: Sequence[int] | Tensor, n: int, start: int = 0) -> Tensor:
        """Entries ``start..start+n-1`` of paged group ``name`` as one contiguous tensor."""
        g = self.spec.group(name)
        return self._flat(g).index_select(0, self._rows(g, block_table, start, n))

    def write_entries(self, name: str, block_table: Sequence[int] | Tensor, start: int, entries: Tensor) -> None:
        """Store contiguous ``entries`` as entries ``start..`` of paged group ``name``."""
        g = self.spec.group(name)
        if entries.shape[1:] != (g.width,):
            raise ValueError(f"{name}: entries of shape {tuple(entries.shape)}, expected [k, {g.width}]")
        rows = self._rows(g, block_table, start, entries.shape[0])
        flat = self._flat(g)
        flat.index_copy_(0, rows, entries.to(device=self.device, dtype=flat.dtype))

    # transfer helpers: a request's entries out of / into the pools as contiguous tensors

    def export_compressed(self, block_table: Sequence[int] | Tensor, layer: int, n: int) -> Tensor:
        """Entries ``0..n-1`` of ``ckv.layer``, contiguous ``[n, head_dim]``."""
        return self.read_entries(f"{GroupKind.COMPRESSED.value}.{layer}", block_table, n)

    def import_compressed(
        self, block_table: Sequence[int] | Tensor, layer: int, entries: Tensor, start: int = 0
    ) -> None:
        """Write contiguous ``entries`` into ``ckv.layer`` from entry ``start``."""
        self.write_entries(f"{GroupKind.COMPRESSED.value}.{layer}", block_table, start, entries)

    def export_index_keys(self, block_table: Sequence[int] | Tensor, layer: int, n: int) -> Tensor:
        """Entries ``0..n-1`` of ``idx.layer``, contiguous ``[n, index_head_dim]``."""
        return self.read_entries(f"{GroupKind.INDEX.value}.{layer}", block_table, n)

    def import_index_keys(self, block_table: Sequence[int] | Tensor, layer: int, keys: Tensor, start: int = 0) -> None:
        """Write contiguous ``keys`` into ``idx.layer`` from entry ``start``."""
        self.write_entries(f"{GroupKind.INDEX.value}.{layer}", block_table, start, keys)


class PagedSequenceKV(SequenceKV):
    """:class:`SequenceKV` over a :class:`PagedKVCache`: a block table plus a request slot."""

    def __init__(self, cache: PagedKVCache, block_table: Sequence[int] | Tensor, slot: int) -> None:
        self.cache = cache
        self.block_table = block_table
        self.slot = slot

    # ---- paged groups ---------------------------------------------------------------------------

    def read_compressed(self, layer: int, n: int) -> Tensor:
        return self.cache.export_compressed(self.block_table, layer, n)

    def write_compressed(self, layer: int, start: int, entries: Tensor) -> None:
        self.cache.import_compressed(self.block_table, layer, entries, start)

    def read_index_keys(self, layer: int, n: int) -> Tensor:
        return self.cache.export_index_keys(self.block_table, layer, n)

    def write_index_keys(self, layer: int, start: int, keys: Tensor) -> None:
        self.cache.import_index_keys(self.block_table, layer, keys, start)

    # ---- slot groups ----------------------------------------------------------------------------

    def window(self, layer: int) -> tuple[Tensor, Tensor]:
        kv, pos = self.cache.windows[layer].read(self.slot)
        return kv, pos

    def append_window(self, layer: int, positions: Tensor, kv: Tensor) -> None:
        self.cache.windows[layer].append(self.slot, (kv, positions))

    def pending(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        kv, score, pos = self.cache.pairs[layer].read(self.slot)
        return kv, score, pos

    def append_pending(self, layer: int, positions: Tensor, kv: Tensor, score: Tensor) -> None:
        self.cache.pairs[layer].append(self.slot, (kv, score, positions))

    def pending_tail(self, layer: int, lo: int, hi: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """Views of the pending rows at positions ``[lo, hi)`` without a device sync (``_SlotRows.tail``)."""
        return self.cache.pairs[layer].tail(self.slot, lo, hi)

    def window_tail(self, layer: int, lo: int, hi: int) -> tuple[Tensor, Tensor] | None:
        """Views of the window rows at positions ``[lo, hi)`` without a device sync (``_SlotRows.tail``)."""
        return self.cache.windows[layer].tail(self.slot, lo, hi)

    def truncate(self, num_tokens: int) -> None:
        self.cache.truncate([(self.slot, num_tokens)])
