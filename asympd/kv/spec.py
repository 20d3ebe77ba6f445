"""Which KV cache groups DeepSeek-V4.1-Flash needs, and how many bytes each one costs.

Everything is derived from :class:`~asympd.config.ModelConfig` (docs/model.md §2, §4):

- ``ckv.L`` / ``idx.L`` for every KV source ``L``: the compressed main KV (``head_dim`` wide) and the
  indexer keys (``index_head_dim`` wide), one entry per ``ratio(L)`` tokens. These grow with the
  sequence, so they are *paged*: one block covers ``block_size`` tokens, i.e. ``block_size // ratio(L)``
  entries of each group, and one block id indexes every paged group's pool. They are a pure function
  of the token prefix, so they are prefix-cacheable.
- ``swa.L`` for every layer, draft blocks included (ids ``n_layers + i``): the sliding window, a bounded
  per-request slot of ``window_size + spec_slack`` rows (the slack lets a rejected speculative step
  roll back and still leave a full window), each row with its absolute position.
- ``pair.L`` for every KV source with ratio > 1: the compressor's open group, raw fp32 (kv, score)
  rows of ``head_dim`` for positions not yet pooled. ``ratio + spec_slack`` rows of history are kept so
  that truncating the sequence by up to ``spec_slack`` tokens restores the exact open group.

Windows and pairs are per-request state, not prefix-cacheable: they live in request slots.

Dtypes are torch's names ("bfloat16"), as prefix states write them: the spec is torch-free (the
planner sizes caches and runs the engine's ``BlockManager`` without torch), and the tensors' owners
(``paged_cache``, ``dense``) turn a name into the torch dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from asympd.config import ModelConfig

if TYPE_CHECKING:
    import torch

POSITION_BYTES = 8  # int64 absolute position stored with every window/pair row
PAIR_DTYPE = "float32"  # the compressor accumulates in fp32 (docs/model.md §3)
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch's name of a cache dtype ("bfloat16" for ``torch.bfloat16``), accepting names too."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported cache dtype {dtype}; expected one of {', '.join(ITEMSIZE)}")
    return name


class GroupKind(StrEnum):
    COMPRESSED = "ckv"
    INDEX = "idx"
    WINDOW = "swa"
    PAIR = "pair"


@dataclass(frozen=True)
class CacheGroup:
    """One cache group. Paged groups use ``entries_per_block``; slot groups use ``capacity``."""

    kind: GroupKind
    layer: int
    width: int  # elements per entry / row
    dtype: str  # torch's name: "float32", "bfloat16", ...
    ratio: int = 1  # tokens per entry (paged groups)
    entries_per_block: int = 0  # paged groups only
    capacity: int = 0  # rows per request slot (window / pair groups only)

    @property
    def name(self) -> str:
        return f"{self.kind.value}.{self.layer}"

    @property
    def paged(self) -> bool:
        return self.kind in (GroupKind.COMPRESSED, GroupKind.INDEX)

    @property
    def element_size(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block of this paged group occupies in its pool (0 for slot groups)."""
        return self.entries_per_block * self.width * self.element_size if self.paged else 0

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one request slot of this window/pair group occupies (0 for paged groups)."""
        if self.kind is GroupKind.WINDOW:
            return self.capacity * (self.width * self.element_size + POSITION_BYTES)
        if self.kind is GroupKind.PAIR:  # kv and score rows
            return self.capacity * (2 * self.width * self.element_size + POSITION_BYTES)
        return 0


@dataclass(frozen=True)
class KVCacheSpec:
    cfg: ModelConfig
    block_size: int
    spec_slack: int
    dtype: str  # of the compressed entries, index keys and windows (pairs: PAIR_DTYPE)
    groups: tuple[CacheGroup, ...]

    @classmethod
    def from_config(
        cls,
        cfg: ModelConfig,
        block_size: int = 16,
        spec_slack: int = 0,
        dtype: torch.dtype | str = "float32",
    ) -> KVCacheSpec:
        dtype = dtype_name(dtype)
        sources = tuple(sorted(cfg.kv_source_layers))
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if spec_slack < 0:
            raise ValueError(f"spec_slack must be >= 0, got {spec_slack}")
        bad = [s for s in sources if block_size % cfg.ratio(s)]
        if bad:
            ratios = sorted({cfg.ratio(s) for s in sources})
            raise ValueError(f"block_size {block_size} must be a multiple of every KV-source ratio {ratios}")
        groups: list[CacheGroup] = []
        for layer in sources:
            r = cfg.ratio(layer)
            for kind, width in ((GroupKind.COMPRESSED, cfg.head_dim), (GroupKind.INDEX, cfg.index_head_dim)):
                groups.append(CacheGroup(kind, layer, width, dtype, ratio=r, entries_per_block=block_size // r))
        for layer in range(cfg.n_total_layers):
            groups.append(
                CacheGroup(GroupKind.WINDOW, layer, cfg.head_dim, dtype, capacity=cfg.window_size + spec_slack)
            )
        for layer in sources:
            r = cfg.ratio(layer)
            if r > 1:
                groups.append(
                    CacheGroup(GroupKind.PAIR, layer, cfg.head_dim, PAIR_DTYPE, ratio=r, capacity=r + spec_slack)
                )
        return cls(cfg, block_size, spec_slack, dtype, tuple(groups))

    # ---- groups ---------------------------------------------------------------------------------

    @property
    def paged_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.paged)

    @property
    def window_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.WINDOW)

    @property
    def pair_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.kind is GroupKind.PAIR)

    @property
    def kv_source_layers(self) -> tuple[int, ...]:
        return tuple(g.layer for g in self.groups if g.kind is GroupKind.COMPRESSED)

    @property
    def window_layers(self) -> tuple[int, ...]:
        return tuple(g.layer for g in self.window_groups)

    @property
    def pair_layers(self) -> tuple[int, ...]:
        return tuple(g.layer for g in self.pair_groups)

    @property
    def window_capacity(self) -> int:
        return self.cfg.window_size + self.spec_slack

    def group(self, name: str) -> CacheGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no cache group {name!r}; groups: {', '.join(g.name for g in self.groups)}")

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """One block id across every paged group."""
        return sum(g.bytes_per_block for g in self.paged_groups)

    @property
    def bytes_per_slot(self) -> int:
        """One request slot across every window and pair group."""
        return sum(g.bytes_per_slot for g in self.groups if not g.paged)

    def bytes_per_token(self) -> float:
        """Paged bytes one token of context costs (windows and pairs are per request, not per token)."""
        return self.bytes_per_block / self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_blocks_for_budget(self, budget_bytes: int, max_seqs: int = 0) -> int:
        """How many blocks fit in ``budget_bytes`` after reserving ``max_seqs`` request slots."""
        left = budget_bytes - max_seqs * self.bytes_per_slot
        return max(0, left // self.bytes_per_block)
