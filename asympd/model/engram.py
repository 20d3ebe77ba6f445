"""Engram: a hashed n-gram memory written into the residual stream before a layer's attention,
gated per hc copy by how well the looked-up key matches that copy of the stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asympd.config import ModelConfig
from asympd.model.ops import QLinear, sigmoid
from asympd.model.quant import dequant_fp8_rows


@dataclass
class Fetched:
    """Looked-up table rows (FP8 + scales) on the compute device; ``stream``: the copy in flight."""

    rows: torch.Tensor
    scales: torch.Tensor
    stream: Any = None

    def __getitem__(self, rows: slice) -> Fetched:
        return Fetched(self.rows[rows], self.scales[rows], self.stream)


class Engram(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], wkv: QLinear):
        super().__init__()
        self.dim, self.hc, self.eps = cfg.dim, cfg.hc_mult, cfg.norm_eps
        # the table stays FP8 as stored (hundreds of millions of rows at real size): rows are
        # dequantized on lookup
        self.table, self.table_scale = w["embed.weight"], w["embed.scale"]
        self.wkv = wkv
        self.qk = w["q_weight"].float() * w["k_weight"].float()  # only ever used as a product
        self._stream: Any = None  # the host-table copy stream, made on first use

    def fetch(self, hash_ids: torch.Tensor, device: torch.device) -> Fetched:
        """Gather the rows ``hash_ids`` name where the table lives and start moving them to ``device``.
        A table in host memory (the GPU build's, facts: 203 GB at real size) sends only the FP8 rows
        looked up, on a side stream, so the copy overlaps the layers that run before this one."""
        flat = hash_ids.reshape(-1).to(self.table.device)
        rows, scales = self.table.index_select(0, flat), self.table_scale.index_select(0, flat)
        shape = (*hash_ids.shape, -1)
        if rows.device == device:
            return Fetched(rows.view(shape), scales.view(shape), None)
        if device.type != "cuda":
            return Fetched(rows.to(device).view(shape), scales.to(device).view(shape), None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        rows, scales = rows.pin_memory(), scales.pin_memory()
        with torch.cuda.stream(self._stream):
            rows, scales = rows.to(device, non_blocking=True), scales.to(device, non_blocking=True)
        return Fetched(rows.view(shape), scales.view(shape), self._stream)

    def lookup(self, fetched: Fetched) -> torch.Tensor:
        """The fetched rows dequantized: [T, n_hash_cols, head_dim] bf16."""
        if fetched.stream is not None:  # the side-stream copy must land before the rows are read
            current = torch.cuda.current_stream(fetched.rows.device)
            current.wait_stream(fetched.stream)
            fetched.rows.record_stream(current)
            fetched.scales.record_stream(current)
        return dequant_fp8_rows(fetched.rows, fetched.scales).to(torch.bfloat16)

    def forward(
        self, h: torch.Tensor, hash_ids: torch.Tensor | Fetched, text: torch.Tensor | None = None
    ) -> torch.Tensor:
        """h: [T, hc, D]; hash_ids: [T, n_hash_cols] (or their ``fetch``) -> h with the gated value
        added to each copy. ``text`` ([T] bool, optional): False shuts the gate (image-span rows pass
        through unchanged, as in the reference)."""
        if not isinstance(hash_ids, Fetched):
            hash_ids = self.fetch(hash_ids, h.device)
        kv = self.wkv(self.lookup(hash_ids).flatten(-2).to(h.dtype))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        hf = h.float()
        # normalised per (token, copy) over dim, not jointly over the copies
        rstd = torch.rsqrt(hf.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (hf * self.qk * key).sum(-1) * rstd * self.dim**-0.5
        gate = sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # signed sqrt
        if text is not None:
            gate = gate.masked_fill(~text.to(gate.device).unsqueeze(-1), 0)
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
