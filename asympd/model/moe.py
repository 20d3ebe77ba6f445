"""Mixture of experts: sqrt-softplus routing (the bias picks experts, the unbiased scores weight
them), FP4 routed experts with clamped SwiGLU, and one FP8 shared expert every token takes."""

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


class MoE(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor]):
        super().__init__()
        self.n_experts, self.topk = cfg.moe_shape(layer)
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

    def forward(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.route(x, vl)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():  # ascending: the reference's accumulation order
            rows, slot = torch.where(ids == e)
            y[rows] += swiglu(
                x[rows], self.w1[e], self.w3[e], self.w2[e], self.limit, weights[rows, slot, None]
            ).float()
        y += swiglu(x, self.s1, self.s3, self.s2, self.limit).float()
        return y.to(x.dtype)
