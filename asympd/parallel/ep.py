"""Expert parallelism for the MoE layers: each rank holds a contiguous slice of every layer's routed
experts (and reads only those from the checkpoint); the gate and the shared expert stay replicated.

One layer, ``comm="alltoall"`` (the default), per rank:

1. the rank takes its share of the tokens, ``token_range(T, rank, world)`` (attention is replicated
   today, so every rank holds all T rows; with DP attention the share is simply its own tokens);
2. routes them (``MoE.route``) and sorts the (token, slot) pairs by expert: owners are contiguous
   expert ranges, so the sorted rows are grouped by destination rank;
3. **dispatch**: one ``all_to_all_single`` (``exchange``) of a byte row per pair: the activation row
   in the model dtype, then the expert id (int32) and routing weight (fp32);
4. the owner runs what it received through ``MoE.routed``, the same routed-expert function the
   single-rank layer uses (on CUDA the packed MXFP4 grouped GEMM);
5. **combine**: the slot outputs go back the same way (``exchange`` with the counts swapped); the
   source adds each token's k slots in ascending expert id (``combine_slots``) and the shared expert;
6. an all-gather of the ``[T/world, dim]`` outputs gives every rank all T rows again (the step that
   disappears with DP attention).

Exactness: each expert runs over exactly the rows the single-rank layer batches for it, in token
order (sources are ascending token ranges and the receiver groups rows by source rank), the slot
outputs cross in the model dtype they were produced in (bf16 or fp32: exact), and the combine adds
them in the single-rank order from +0. On CPU any EP degree gives the single-rank bits.

``comm="allreduce"`` is the previous scheme, kept as the baseline ``bench/ep_alltoall.py`` measures:
every rank routes all T tokens, writes its experts' outputs into a dense fp32 ``[T, k, dim]``
tensor, zeros elsewhere, and one ``all_reduce`` (one non-zero term per entry: exact) sums them.
``docs/parallel.md`` has the bytes each moves.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from asympd.config import ModelConfig
from asympd.model.moe import MoE, combine_slots, expert_range
from asympd.model.schema import role_schema

COMMS = ("alltoall", "allreduce")
_EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.")
# torch >= 2.13 renamed all_gather_into_tensor (the old name warns); the device image has 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

token_range = expert_range  # a rank's share of T tokens: the same contiguous split


def rank_tensors(cfg: ModelConfig, rank: int, world: int) -> Callable[[str], bool]:
    """Which checkpoint tensors rank ``rank`` of ``world`` reads: every backbone tensor but the
    routed experts outside its ``expert_range``; the drafter (``mtp.*``) on rank 0 only."""

    def keep(name: str) -> bool:
        if name.startswith("mtp."):
            return rank == 0
        m = _EXPERT_TENSOR.match(name)
        if m is None:
            return True
        lo, hi = expert_range(cfg.moe_shape(int(m.group(1)))[0], rank, world)
        return lo <= int(m.group(2)) < hi

    return keep


def exchange(
    send: torch.Tensor, send_counts: torch.Tensor, group: Any = None, recv_counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-to-all of rows: the first ``send_counts[0]`` rows of ``send`` go to rank 0, the next
    ``send_counts[1]`` to rank 1, ... Returns the rows received, grouped by source rank in rank
    order, and how many came from each. ``recv_counts`` is exchanged first (one small all-to-all)
    unless given (a reply retracing a dispatch). Counts are int64 on ``send``'s device; split sizes
    are host arguments, so this synchronises with the device once.

    One code path for both backends: NCCL's ``all_to_all_single`` on GPUs, and gloo's on CPU (gloo
    implements it for CPU tensors, uneven splits included)."""
    if recv_counts is None:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    if sum(sc) != send.size(0):
        raise ValueError(f"send_counts add up to {sum(sc)} rows, the tensor has {send.size(0)}")
    recv = send.new_empty(sum(rc), *send.shape[1:])
    dist.all_to_all_single(recv, send.contiguous(), rc, sc, group=group)
    return recv, recv_counts


def _pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One byte row per routed pair: x's row as stored, the expert id (int32), the weight (fp32)."""
    meta = torch.stack([ids.to(torch.int32), weights.float().view(torch.int32)], dim=1)
    return torch.cat([x.contiguous().view(torch.uint8), meta.view(torch.uint8)], dim=1)


def _unpack(rows: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = dim * dtype.itemsize
    x = rows[:, :n].contiguous().view(dtype)
    meta = rows[:, n:].contiguous().view(torch.int32)
    return x, meta[:, 0].long(), meta[:, 1].contiguous().view(torch.float32)


def wire_bytes(dim: int, topk: int, tokens: int, world: int, comm: str, itemsize: int = 2) -> float:
    """Bytes one rank sends per layer for ``tokens`` rows under uniform routing (a pair stays on
    its rank with probability 1/world). ``allreduce``: a ring all-reduce of fp32 ``[T, k, dim]``;
    ``alltoall``: dispatch (row + 8 B of id and weight) and combine of the rank's T/world tokens'
    remote pairs, plus the all-gather of its T/world output rows to the other ranks."""
    remote = (world - 1) / world
    if comm == "allreduce":
        return 2 * remote * tokens * topk * dim * 4
    if comm != "alltoall":
        raise ValueError(f"comm must be one of {', '.join(COMMS)}, got {comm!r}")
    share = tokens / world
    return share * topk * remote * (2 * dim * itemsize + 8) + share * dim * itemsize * (world - 1)


class EPMoE(torch.nn.Module):
    """Wraps a :class:`MoE` (or ``FastMoE``) that holds this rank's experts only (built by
    ``load_model(..., ep=(rank, world))``). Routing, the expert math and the shared expert are the
    wrapped module's own methods."""

    def __init__(self, moe: MoE, rank: int, world: int, group: Any = None, comm: str = "alltoall"):
        super().__init__()
        lo, hi = expert_range(moe.n_experts, rank, world)
        if (moe.lo, moe.hi) != (lo, hi):
            raise ValueError(
                f"rank {rank} of {world} owns experts [{lo}, {hi}) but the MoE holds [{moe.lo}, {moe.hi}): "
                f"load the model with load_model(..., ep=({rank}, {world}))"
            )
        if comm not in COMMS:
            raise ValueError(f"comm must be one of {', '.join(COMMS)}, got {comm!r}")
        self.moe, self.rank, self.world, self.group, self.comm = moe, rank, world, group, comm
        self.comm_timer: CommTimer | None = None  # set to time this layer's collectives (benchmarks)
        # first expert of every rank, then E: searchsorted over sorted ids cuts them by owner
        self.register_buffer(
            "bounds",
            torch.tensor(
                [expert_range(moe.n_experts, r, world)[0] for r in range(world)] + [moe.n_experts],
                device=moe.gate.device,
            ),
            persistent=False,
        )

    @property
    def lo(self) -> int:
        return self.moe.lo

    @property
    def hi(self) -> int:
        return self.moe.hi

    def _span(self, kind: str) -> contextlib.AbstractContextManager:
        return self.comm_timer.span(kind) if self.comm_timer is not None else contextlib.nullcontext()

    def forward(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        """``vl``: image-span rows (they route with the VL gate bias)."""
        with self._span("layer"):
            if self.comm == "allreduce":
                return self._forward_allreduce(x, vl)
            a, b = token_range(x.size(0), self.rank, self.world)
            return self.gather(self.local(x[a:b], None if vl is None else vl[a:b]), x.size(0))

    def local(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        """The layer for this rank's own tokens ``x`` (steps 2-5 above): every rank calls it at
        once, each with its own tokens. Returns ``[len(x), dim]`` in x's dtype."""
        m, dim = self.moe, x.size(-1)
        if x.size(0):
            weights, ids = m.route(x, vl)
        else:  # fewer rows than ranks: this rank only serves its experts (no empty kernel launches)
            ids = torch.empty(0, m.topk, dtype=torch.long, device=x.device)
            weights = torch.empty(0, m.topk, dtype=torch.float32, device=x.device)
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, then (token, slot): grouped by owner
        sorted_ids = flat[order]
        counts = torch.searchsorted(sorted_ids, self.bounds).diff()
        payload = _pack(x[order // k], sorted_ids, weights.reshape(-1)[order])
        with self._span("dispatch"):
            recv, recv_counts = exchange(payload, counts, self.group)
        rx, rids, rw = _unpack(recv, dim, x.dtype)
        out = m.routed(rx, rids.unsqueeze(1), rw.unsqueeze(1)).squeeze(1)
        with self._span("combine"):
            back, _ = exchange(out, recv_counts, self.group, recv_counts=counts)
        slots = torch.empty_like(back)
        slots[order] = back
        y = combine_slots(slots.view(t, k, dim), ids)
        return (y + m.shared(x)).to(x.dtype) if t else y.to(x.dtype)

    def gather(self, y: torch.Tensor, t: int) -> torch.Tensor:
        """Every rank's ``local`` rows -> all ``t`` rows on every rank (shares padded to one size)."""
        n = -(-t // self.world)
        buf = y.new_zeros(n, y.size(-1))
        buf[: y.size(0)] = y
        out = y.new_empty(self.world * n, y.size(-1))
        with self._span("gather"):
            _all_gather(out, buf, group=self.group)
        shares = (token_range(t, r, self.world) for r in range(self.world))
        return torch.cat([out[r * n : r * n + hi - lo] for r, (lo, hi) in enumerate(shares)])

    def _forward_allreduce(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        m = self.moe
        weights, ids = m.route(x, vl)
        rows, slot = torch.where((ids >= m.lo) & (ids < m.hi))  # token order: each expert's single-rank rows
        contrib = torch.zeros(*ids.shape, x.size(-1), dtype=torch.float32, device=x.device)
        contrib[rows, slot] = m.routed(x[rows], ids[rows, slot, None], weights[rows, slot, None])[:, 0].float()
        with self._span("allreduce"):
            dist.all_reduce(contrib, group=self.group)  # one non-zero term per entry: exact
        return (combine_slots(contrib, ids) + m.shared(x)).to(x.dtype)


class CommTimer:
    """Times the collectives of EP MoE layers (``EPMoE.comm_timer``; one timer may serve every layer
    of a rank): ``dispatch`` (the count exchange and the rows out), ``combine`` (the slot outputs
    back), ``gather`` (the all-gather of the outputs), ``allreduce`` (the baseline scheme), and
    ``layer`` (the whole EP MoE layer, expert GEMMs included). On CUDA, events around the calls on
    the current stream: device time, so a collective's time includes waiting for the slowest rank to
    arrive (skew and load imbalance count as communication). On CPU, wall time (gloo's collectives
    return when done). Nothing synchronises until ``collect``."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._spans: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._spans.append((kind, start, end))

    def collect(self) -> dict[str, dict[str, float]]:
        """Per kind, the calls and their total ms since the last ``collect`` (synchronises the device)."""
        if self.cuda and self._spans:
            torch.cuda.synchronize()
        out: dict[str, dict[str, float]] = {}
        for kind, start, end in self._spans:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
            row = out.setdefault(kind, {"calls": 0, "ms": 0.0})
            row["calls"] += 1
            row["ms"] += ms
        self._spans = []
        return out


def shard_moe(model: Any, rank: int, world: int, group: Any = None, comm: str = "alltoall") -> int:
    """Wrap every backbone block's MoE (built with this rank's experts) in an :class:`EPMoE`. The
    DSpark draft blocks are left whole (they run on rank 0 only). Idempotent; returns the layers
    wrapped."""
    n = 0
    for block in model.blocks:
        ffn = getattr(block, "ffn", None) if block is not None else None
        if isinstance(ffn, MoE):
            block.ffn = EPMoE(ffn, rank, world, group, comm)
            n += 1
    return n


def ep_resident_gb(cfg: ModelConfig, role: str, ep: int) -> dict[str, float]:
    """Weights one rank holds with ``ep``-way expert parallelism, in the released storage formats
    (decimal GB; Engram tables and vision excluded: they live in host memory / are not served).
    Rank 0 also holds the DSpark draft blocks (roles with a head); the other ranks drop them."""
    total = routed = draft = 0
    for s in role_schema(cfg, role):
        if s.part.value in ("engram_tables", "vision"):
            continue
        total += s.nbytes
        if s.name.startswith("layers.") and ".ffn.experts." in s.name:
            routed += s.nbytes
        if s.name.startswith("mtp."):
            draft += s.nbytes
    per_rank_experts = routed * (1 - 1 / ep)
    return {
        "single_rank_gb": total / 1e9,
        "routed_experts_gb": routed / 1e9,
        "rank0_gb": (total - per_rank_experts) / 1e9,
        "other_rank_gb": (total - per_rank_experts - draft) / 1e9,
    }
