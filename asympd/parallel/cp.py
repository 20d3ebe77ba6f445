"""Context parallelism for P's prefix: N ranks split [0, s) into consecutive slices.

Rank r computes its slice [lo_r, hi_r) through layers < K and K's KV path. What its rows need of
earlier positions, layer by layer, comes from rank r-1, which forwards everything earlier ranks
sent it together with its own rows:

- the sliding window of layer l (the rows before lo_r that a window can reach),
- the open compressor group of layer l at lo_r (its raw kv and score rows),
- for a KV source layer l, every compressed main KV entry and index key before its slice (the
  sparse attention and the indexer of layer l and of the layers reading l's entries see them all).

The exchange is a wavefront: rank r enters layer l once rank r-1 has finished it, so rank r-1 runs
layer l+1 while rank r runs layer l; with L layers and N ranks a prefix takes about (L + N - 1)
slice-layers instead of N * L. The hooks sit in the sequence's cache (``CPSequenceKV``): the model
code is the single-rank code, and a rank's first touch of layer l's state (its window, its open
group, its entries) is where it receives layer l. After the last layer the last rank holds the
whole global KV of [0, s) and the open groups at s: its export is the PrefixState, byte for byte
what one rank exports (the model is bit-exact under any chunking of the rows).

A rank computing its slice in several chunks receives in its first chunk and sends in its last.
Slice r need not be process rank r: ``order`` names the ranks in slice order (a server puts its own
rank 0 last, so the process that publishes is the one that exports). The exchanged tensors live on
the ranks' devices (gloo on CPU, NCCL between GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from asympd.config import ModelConfig
from asympd.kv.dense import DenseSequenceKV
from asympd.model.transformer import Chunk, Depth, Transformer
from asympd.transfer.prefix_state import PrefixState


def slice_bounds(split: int, world: int) -> list[int]:
    """N + 1 boundaries of near-equal consecutive slices of [0, split)."""
    if world < 1 or split < world:
        raise ValueError(f"context parallelism over {world} ranks needs a prefix of at least {world} rows, not {split}")
    return [split * r // world for r in range(world + 1)]


class CPSequenceKV(DenseSequenceKV):
    """One rank's cache of one sequence, receiving layer l from the previous rank on its first touch
    of layer l and sending layer l to the next when it moves past it (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        position: int,
        world: int,
        peers: tuple[int | None, int | None] = (None, None),
        group=None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(cfg, dtype=dtype, device=device)
        self.cfg, self.position, self.world, self.group = cfg, position, world, group
        self.prev, self.next = peers  # the ranks (in ``group``) of slices position - 1 and + 1
        self.last_layer = cfg.last_kv_source
        self.current = -1  # the layer this forward is in
        self.recv = self.send = False

    # ---- one forward -----------------------------------------------------------------------------

    def begin(self, recv: bool, send: bool) -> None:
        """Before a forward: whether it receives (the slice's first chunk) and sends (its last)."""
        self.current = -1
        self.recv, self.send = recv and self.position > 0, send and self.position < self.world - 1

    def end(self) -> None:
        """After a forward: send what is left, through the last layer."""
        self._advance(self.last_layer + 1)

    def _advance(self, layer: int) -> None:
        while self.current < layer:
            if self.current >= 0 and self.send:
                self._send(self.current)
            self.current += 1
            if self.current <= self.last_layer and self.recv:
                self._recv(self.current)

    # ---- the exchange ------------------------------------------------------------------------------

    def _parts(self, layer: int) -> list[Tensor]:
        kv, pos = super().window(layer)
        parts = [kv, pos]
        if layer in self._pending:
            parts += list(super().pending(layer))
        if layer in self.cfg.kv_source_layers:
            parts += [self._entries[f"ckv.{layer}"], self._entries[f"idx.{layer}"]]
        return parts

    def _send(self, layer: int) -> None:
        parts = self._parts(layer)
        rows = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64, device=self.device)
        dist.send(rows, group=self.group, group_dst=self.next)
        for p in parts:
            if p.numel():
                dist.send(p.contiguous(), group=self.group, group_dst=self.next)

    def _recv(self, layer: int) -> None:
        like = self._parts(layer)
        rows = torch.empty(len(like), dtype=torch.int64, device=self.device)
        dist.recv(rows, group=self.group, group_src=self.prev)
        got = []
        for p, n in zip(like, rows.tolist(), strict=True):
            t = torch.empty((n, *p.shape[1:]), dtype=p.dtype, device=p.device)
            if n:
                dist.recv(t, group=self.group, group_src=self.prev)
            got.append(t)
        kv, pos, *rest = got
        super().append_window(layer, pos, kv)
        if layer in self._pending:
            pkv, pscore, ppos, *rest = rest
            super().append_pending(layer, ppos, pkv, pscore)
        if layer in self.cfg.kv_source_layers:
            ckv, idx = rest
            self._entries[f"ckv.{layer}"], self._entries[f"idx.{layer}"] = ckv, idx

    # ---- SequenceKV: a layer's own state is touched first by that layer ---------------------------

    def window(self, layer: int) -> tuple[Tensor, Tensor]:
        self._advance(layer)
        return super().window(layer)

    def append_window(self, layer: int, positions: Tensor, kv: Tensor) -> None:
        self._advance(layer)
        super().append_window(layer, positions, kv)

    def pending(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        self._advance(layer)
        return super().pending(layer)

    def append_pending(self, layer: int, positions: Tensor, kv: Tensor, score: Tensor) -> None:
        self._advance(layer)
        super().append_pending(layer, positions, kv, score)

    def write_compressed(self, layer: int, start: int, entries: Tensor) -> None:
        self._advance(layer)
        super().write_compressed(layer, start, entries)

    def write_index_keys(self, layer: int, start: int, keys: Tensor) -> None:
        self._advance(layer)
        super().write_index_keys(layer, start, keys)


def cp_prefill(
    model: Transformer,
    token_ids: Sequence[int],
    split: int,
    *,
    fingerprint: str,
    bounds: Sequence[int] | None = None,
    chunk: int | None = None,
    mode: str = "asymmetric",
    boundary_policy: str = "carry",
    kv_format: str = "fp4",
    group=None,
    order: Sequence[int] | None = None,
) -> PrefixState | None:
    """This rank's part of P's prefix [0, ``split``) of ``token_ids``; the rank of the last slice
    returns the PrefixState (the others None). ``bounds``: the N + 1 slice boundaries (default:
    near-equal); ``chunk``: the most rows per forward within a slice (default: the whole slice);
    ``order``: the ranks of ``group`` in slice order (default: rank r computes slice r)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    order = list(order) if order is not None else list(range(world))
    if sorted(order) != list(range(world)):
        raise ValueError(f"slice order {order} must name each of the {world} ranks once")
    bounds = list(bounds) if bounds is not None else slice_bounds(split, world)
    if (
        len(bounds) != world + 1
        or bounds[0] != 0
        or bounds[-1] != split
        or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise ValueError(f"slice bounds {bounds} must rise strictly from 0 to split {split} over {world} ranks")
    position = order.index(rank)
    peers = (order[position - 1] if position else None, order[position + 1] if position + 1 < world else None)
    kv = CPSequenceKV(model.cfg, model.dtype, position, world, peers, group, model.device)
    history = torch.as_tensor(list(token_ids), dtype=torch.long)
    _compute(model, kv, history, bounds[position], bounds[position + 1], chunk)
    if position != world - 1:
        return None
    return export(kv, model.cfg, history, split, fingerprint, mode, boundary_policy, kv_format)


def local_prefill(
    model: Transformer,
    token_ids: Sequence[int],
    split: int,
    *,
    fingerprint: str,
    chunk: int | None = None,
    mode: str = "asymmetric",
    boundary_policy: str = "carry",
    kv_format: str = "fp4",
) -> PrefixState:
    """P's prefix on this rank alone (a prefix shorter than the CP group, or none at all)."""
    kv = CPSequenceKV(model.cfg, model.dtype, 0, 1, device=model.device)
    history = torch.as_tensor(list(token_ids), dtype=torch.long)
    if split:
        _compute(model, kv, history, 0, split, chunk)
    return export(kv, model.cfg, history, split, fingerprint, mode, boundary_policy, kv_format)


def _compute(model: Transformer, kv: CPSequenceKV, history: Tensor, lo: int, hi: int, chunk: int | None) -> None:
    step = chunk or hi - lo
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        kv.begin(recv=a == lo, send=b == hi)
        model([Chunk(kv, history[a:b], a, history, Depth.ENCODER_KV, logits="none")])
        kv.end()


def export(
    kv: DenseSequenceKV,
    cfg: ModelConfig,
    token_ids: Tensor,
    split: int,
    fingerprint: str,
    mode: str,
    boundary_policy: str,
    kv_format: str,
) -> PrefixState:
    """The global KV of [0, split) and the open groups at split, as the engine's runner exports them."""
    ckv, idx, pair_kv, pair_score = {}, {}, {}, {}
    for layer in cfg.kv_source_layers:
        r = cfg.ratio(layer)
        n = split // r
        ckv[layer], idx[layer] = kv.read_compressed(layer, n), kv.read_index_keys(layer, n)
        if r > 1 and split % r:
            pkv, pscore, pos = DenseSequenceKV.pending(kv, layer)
            keep = (pos >= n * r) & (pos < split)
            pair_kv[layer], pair_score[layer] = pkv[keep].float().clone(), pscore[keep].float().clone()
    return PrefixState(
        split=split,
        token_ids=token_ids.clone(),
        ckv=ckv,
        idx=idx,
        pair_kv=pair_kv,
        pair_score=pair_score,
        fingerprint=fingerprint,
        dtype=str(kv.dtype).removeprefix("torch."),
        boundary_policy=boundary_policy,
        mode=mode,
        kv_format=kv_format,
    )
