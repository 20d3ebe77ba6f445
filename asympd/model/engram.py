"""Engram: a hashed n-gram memory written into the residual stream before a layer's attention,
gated per hc copy by how well the looked-up key matches that copy of the stream."""

from __future__ import annotations

import torch

from asympd.config import ModelConfig
from asympd.model.ops import QLinear, sigmoid
from asympd.model.quant import dequant_fp8_rows


class Engram(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], wkv: QLinear):
        super().__init__()
        self.dim, self.hc, self.eps = cfg.dim, cfg.hc_mult, cfg.norm_eps
        # the table stays FP8 as stored (hundreds of millions of rows at real size): rows are
        # dequantized on lookup
        self.table, self.table_scale = w["embed.weight"], w["embed.scale"]
        self.wkv = wkv
        self.qk = w["q_weight"].float() * w["k_weight"].float()  # only ever used as a product

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        flat = hash_ids.reshape(-1)
        rows = dequant_fp8_rows(self.table[flat], self.table_scale[flat]).to(torch.bfloat16)
        return rows.view(*hash_ids.shape, -1)

    def forward(self, h: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """h: [T, hc, D]; hash_ids: [T, n_hash_cols] -> h with the gated value added to each copy."""
        kv = self.wkv(self.lookup(hash_ids).flatten(-2).to(h.dtype))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        hf = h.float()
        # normalised per (token, copy) over dim, not jointly over the copies
        rstd = torch.rsqrt(hf.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (hf * self.qk * key).sum(-1) * rstd * self.dim**-0.5
        gate = sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # signed sqrt
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
