"""Expert parallelism for the MoE layers: each rank holds a contiguous slice of every layer's routed
experts; the gate and the shared expert stay replicated.

Exactness: the single-rank :class:`~asympd.model.moe.MoE` adds each token's expert outputs into an
fp32 zero row in ascending expert id. :class:`EPMoE` reproduces those bits. Every rank computes its
own experts over exactly the rows the single-rank code would batch for them (so each expert output
is the same tensor), writes them into a dense ``[T, k, dim]`` fp32 contribution tensor at the
(token, slot) positions it owns and leaves the rest 0; one ``all_reduce(SUM)`` then has exactly one
non-zero term per entry, which is exact. The k slots of a token are finally added in ascending
expert id as a fixed chain starting from zeros (``0 + a == a``), then the shared expert, which is
the single-rank order term for term.

The price is communication: ``T * k * dim`` fp32 per layer instead of the ``T * dim`` a combine by
all-to-all moves. It keeps every rank's output identical to the reference bit for bit, which is what
the tests pin; a token all-to-all dispatch/combine (DeepEP style) is the fast path to add on GPUs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from asympd.config import ModelConfig
from asympd.model.moe import MoE, swiglu
from asympd.model.schema import role_schema


def expert_range(n_experts: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s experts ``[lo, hi)``: ``[r*E/ep, (r+1)*E/ep)``, rounded down."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    return rank * n_experts // world, (rank + 1) * n_experts // world


class EPMoE(torch.nn.Module):
    """Wraps a built :class:`MoE` whose routed experts are cut down to this rank's slice. Routing
    (``MoE.route``) and the expert math (``swiglu``) are the single-rank code's own."""

    def __init__(self, moe: MoE, rank: int, world: int, group: Any = None):
        super().__init__()
        if not all(isinstance(w, torch.Tensor) for w in (moe.w1, moe.w2, moe.w3)):
            raise ValueError(f"{type(moe).__name__} holds no stacked expert weights: shard before a fast path")
        self.lo, self.hi = expert_range(moe.n_experts, rank, world)
        # clone: a slice view would keep the whole stacked tensor (every expert) alive
        moe.w1, moe.w2, moe.w3 = (w[self.lo : self.hi].clone() for w in (moe.w1, moe.w2, moe.w3))
        self.moe, self.rank, self.world, self.group = moe, rank, world, group

    def forward(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        m = self.moe
        weights, ids = m.route(x, vl)
        t, k = ids.shape
        contrib = torch.zeros(t, k, x.shape[-1], dtype=torch.float32, device=x.device)
        local = ids[(ids >= self.lo) & (ids < self.hi)]
        for e in torch.unique(local).tolist():  # the same rows per expert as the single-rank loop
            rows, slot = torch.where(ids == e)
            j = e - self.lo
            contrib[rows, slot] = swiglu(x[rows], m.w1[j], m.w3[j], m.w2[j], m.limit, weights[rows, slot, None]).float()
        dist.all_reduce(contrib, group=self.group)  # one non-zero term per entry: exact
        order = torch.argsort(ids, dim=1, stable=True)  # each token's slots in ascending expert id
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        tokens = torch.arange(t, device=x.device)
        for s in range(k):
            y += contrib[tokens, order[:, s]]
        y += swiglu(x, m.s1, m.s3, m.s2, m.limit).float()
        return y.to(x.dtype)


def shard_moe(model: Any, rank: int, world: int, group: Any = None) -> int:
    """Replace every backbone block's MoE by an :class:`EPMoE` holding experts
    ``expert_range(E, rank, world)``; the other experts' weights are dropped. The DSpark draft
    blocks are left whole (they run on rank 0 only). Idempotent; returns the layers sharded."""
    n = 0
    for block in model.blocks:
        ffn = getattr(block, "ffn", None) if block is not None else None
        if isinstance(ffn, MoE):
            block.ffn = EPMoE(ffn, rank, world, group)
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
