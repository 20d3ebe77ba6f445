"""Mixture of experts: sqrt-softplus routing (the bias picks experts, the unbiased scores weight
them), FP4 routed experts with clamped SwiGLU, and one FP8 shared expert every token takes.

A layer is three steps, each a method, so expert parallelism (``asympd.parallel.ep``) can run the
middle one on another rank: ``route`` (token -> k experts and weights), ``routed`` (each routed
(token, slot) row through its expert, for the contiguous range of experts this module holds) and
``combine_slots`` + ``shared``. The combine adds each token's k slot outputs in ascending expert id
as a chain from +0, which is the order the reference accumulates in and does not depend on which
rank computed which expert: any expert-parallel degree gives the single-rank bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asympd.config import ModelConfig
from asympd.model.ops import linear, sigmoid, stable_elementwise, stable_topk
from asympd.model.quant import fp8_qdq


def swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert: the up branch clamped both sides, the gate branch from above only (from training,
    where the clamps keep FP8/FP4 activations in range). Every GEMM input is FP8-quantized."""
    xq = fp8_qdq(x, 32)
    gate = linear(xq, w1).float()
    up = linear(xq, w3).float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = stable_elementwise(F.silu, gate) * up
    if weights is not None:
        h = weights * h
    return linear(fp8_qdq(h.to(x.dtype), 32), w2)


def expert_range(n_experts: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s experts ``[lo, hi)``: ``[r*E/ep, (r+1)*E/ep)``, rounded down (contiguous
    and ascending in rank, so the owners of ascending experts are ascending ranks)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    return rank * n_experts // world, (rank + 1) * n_experts // world


def combine_slots(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, dim]`` from the slot outputs ``out [T, k, dim]`` of tokens routed to ``ids [T, k]``:
    on CPU each token's slots added in ascending expert id as a chain from +0, the reference's order
    (so where each expert ran does not change a bit); on CUDA one fp32 sum (the GPU path is the
    reference's function up to summation order anyway)."""
    if out.is_cuda:
        return out.sum(1, dtype=torch.float32)
    order = torch.argsort(ids, dim=1, stable=True)
    y = torch.zeros(out.size(0), out.size(-1), dtype=torch.float32, device=out.device)
    tokens = torch.arange(out.size(0), device=out.device)
    for s in range(ids.size(1)):
        y += out[tokens, order[:, s]].float()
    return y


class MoE(torch.nn.Module):
    """``experts=(lo, hi)``: the module holds routed experts ``[lo, hi)`` only (expert parallelism;
    ``w["experts.*"]`` stacked over that range); routing always covers all ``n_experts``."""

    # the reference reads each expert's rows on the host (a loop over experts): no CUDA graph
    syncs_host = True

    def __init__(
        self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], experts: tuple[int, int] | None = None
    ):
        super().__init__()
        self.n_experts, self.topk = cfg.moe_shape(layer)
        self.lo, self.hi = experts or (0, self.n_experts)
        self.score_func, self.route_scale, self.limit = cfg.score_func, cfg.route_scale, cfg.swiglu_limit
        self.gate = w["gate.weight"].float()
        self.bias = w["gate.bias"].float()
        self.bias_vl = w["gate.bias_vl"].float() if "gate.bias_vl" in w else None  # image-span rows
        # routed experts stacked [E, out, in] so a step touches only the experts it routes to
        self.w1, self.w2, self.w3 = w["experts.w1"], w["experts.w2"], w["experts.w3"]
        self.s1, self.s2, self.s3 = w["shared_experts.w1"], w["shared_experts.w2"], w["shared_experts.w3"]

    def route(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]); ties in the biased score go to the lowest id. ``vl``
        ([T] bool): rows inside an image span, whose experts the VL bias picks instead."""
        scores = linear(x.float(), self.gate)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = sigmoid(scores)
        else:
            scores = stable_elementwise(F.softplus, scores).sqrt()
        ids = stable_topk(scores + self.route_bias(vl), self.topk)
        weights = scores.gather(1, ids)
        if self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids

    def route_bias(self, vl: torch.Tensor | None) -> torch.Tensor:
        """The selection bias per row: ``bias``, or ``bias_vl`` on image-span rows ([E] or [T, E])."""
        if vl is None or self.bias_vl is None or not bool(vl.any()):
            return self.bias
        return torch.where(vl.to(self.bias.device).unsqueeze(-1), self.bias_vl, self.bias)

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Slot outputs ``[T, s, dim]`` in x's dtype: ``weights[t, j] * expert_{ids[t, j]}(x[t])``.
        Every id must be one this module holds. Each expert runs once, over its rows in token order:
        the rows the single-rank layer batches for it, wherever the tokens came from."""
        if ids.numel() and (int(ids.min()) < self.lo or int(ids.max()) >= self.hi):
            raise ValueError(f"expert ids outside the experts [{self.lo}, {self.hi}) this module holds")
        out = x.new_zeros(*ids.shape, x.size(-1))
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            j = e - self.lo
            out[rows, slot] = swiglu(x[rows], self.w1[j], self.w3[j], self.w2[j], self.limit, weights[rows, slot, None])
        return out

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert, fp32."""
        return swiglu(x, self.s1, self.s3, self.s2, self.limit).float()

    def forward(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.route(x, vl)
        y = combine_slots(self.routed(x, ids, weights), ids)
        y += self.shared(x)
        return y.to(x.dtype)
