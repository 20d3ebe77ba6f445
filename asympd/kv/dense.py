"""A :class:`SequenceKV` on plain tensors, for model unit tests that do not want paging.

Same semantics as :class:`~asympd.kv.paged_cache.PagedSequenceKV` (a test drives both with the same
operations): windows and pending rows keep the same capacities, values are stored in the same dtypes.
Compressed entries grow as written; writes must not leave a gap (a stricter check than paging can do).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from asympd.config import ModelConfig
from asympd.kv.paged_cache import SequenceKV
from asympd.kv.spec import PAIR_DTYPE, KVCacheSpec

_PAIR_DTYPE = getattr(torch, PAIR_DTYPE)  # the spec names dtypes; the pending rows' torch dtype


class DenseSequenceKV(SequenceKV):
    def __init__(
        self,
        cfg: ModelConfig,
        spec_slack: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        # block_size only matters for paging; the smallest valid one keeps the spec checks happy
        block_size = math.lcm(*(cfg.ratio(s) for s in cfg.kv_source_layers))
        self.spec = KVCacheSpec.from_config(cfg, block_size=block_size, spec_slack=spec_slack, dtype=dtype)
        self.device = torch.device(device)
        self.dtype = dtype
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._entries: dict[str, Tensor] = {
            g.name: torch.empty(0, g.width, dtype=dtype, device=self.device) for g in self.spec.paged_groups
        }
        self._window: dict[int, tuple[Tensor, ...]] = {
            layer: (torch.empty(0, cfg.head_dim, dtype=dtype, device=self.device), empty)
            for layer in self.spec.window_layers
        }
        self._pending: dict[int, tuple[Tensor, ...]] = {
            g.layer: (torch.empty(0, g.width, dtype=_PAIR_DTYPE, device=self.device),) * 2 + (empty,)
            for g in self.spec.pair_groups
        }
        self._pending_capacity = {g.layer: g.capacity for g in self.spec.pair_groups}

    # ---- compressed entries ---------------------------------------------------------------------

    def _read(self, name: str, n: int) -> Tensor:
        t = self._entries[name]
        if not 0 <= n <= t.shape[0]:
            raise IndexError(f"{name}: read of {n} entries, {t.shape[0]} written")
        return t[:n].clone()

    def _write(self, name: str, start: int, entries: Tensor) -> None:
        t = self._entries[name]
        if not 0 <= start <= t.shape[0]:
            raise IndexError(f"{name}: write at entry {start} would leave a gap after {t.shape[0]} entries")
        if entries.shape[1:] != t.shape[1:]:
            raise ValueError(f"{name}: entries of shape {tuple(entries.shape)}, expected [k, {t.shape[1]}]")
        new = entries.to(self.device, self.dtype)
        self._entries[name] = torch.cat([t[:start], new, t[start + new.shape[0] :]])

    def read_compressed(self, layer: int, n: int) -> Tensor:
        return self._read(f"ckv.{layer}", n)

    def write_compressed(self, layer: int, start: int, entries: Tensor) -> None:
        self._write(f"ckv.{layer}", start, entries)

    def read_index_keys(self, layer: int, n: int) -> Tensor:
        return self._read(f"idx.{layer}", n)

    def write_index_keys(self, layer: int, start: int, keys: Tensor) -> None:
        self._write(f"idx.{layer}", start, keys)

    # ---- windows and pending rows ---------------------------------------------------------------

    def window(self, layer: int) -> tuple[Tensor, Tensor]:
        kv, pos = self._window[layer]
        return kv, pos

    def append_window(self, layer: int, positions: Tensor, kv: Tensor) -> None:
        new = (kv.to(self.device, self.dtype), positions.to(self.device, torch.int64))
        self._window[layer] = self._append(self._window[layer], new, self.spec.window_capacity)

    def pending(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        kv, score, pos = self._pending[layer]
        return kv, score, pos

    def append_pending(self, layer: int, positions: Tensor, kv: Tensor, score: Tensor) -> None:
        new = (
            kv.to(self.device, _PAIR_DTYPE),
            score.to(self.device, _PAIR_DTYPE),
            positions.to(self.device, torch.int64),
        )
        self._pending[layer] = self._append(self._pending[layer], new, self._pending_capacity[layer])

    @staticmethod
    def _append(old: tuple[Tensor, ...], new: tuple[Tensor, ...], capacity: int) -> tuple[Tensor, ...]:
        """Rows at or after the first new position are replaced; the newest ``capacity`` are kept."""
        if new[-1].numel() == 0:
            return old
        keep = int((old[-1] < new[-1][0]).sum())
        return tuple(torch.cat([o[:keep], n])[-capacity:] for o, n in zip(old, new, strict=True))

    def truncate(self, num_tokens: int) -> None:
        for groups in (self._window, self._pending):
            for layer, rows in groups.items():
                m = int((rows[-1] < num_tokens).sum())
                groups[layer] = tuple(r[:m] for r in rows)
