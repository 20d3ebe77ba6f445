"""Rank functions for ``torch.multiprocessing.spawn`` in the EP tests (importable by the children;
not a test module)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from asympd.model.loader import load_model
from asympd.parallel.ep import EPMoE, expert_range, shard_moe


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def moe_rank(rank: int, world: int, init_method: str, ckpt: str) -> None:
    """Every MoE layer of the tiny model: the EP output equals the single-rank output bit for bit,
    on every rank, for fp32 and bf16 activations and a few batch sizes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(ckpt, "full", "cpu", dtype)
            moes = [b.ffn for b in model.blocks if b is not None and b.ffn is not None]
            assert all(m.topk >= 3 for m in moes)  # with 2 experts any combine order gives the same sum
            g = torch.Generator().manual_seed(7)
            inputs = [torch.randn(t, model.cfg.dim, generator=g).to(dtype) for t in (1, 5, 37)]
            want = [[m(x) for x in inputs] for m in moes]  # before sharding: the single-rank MoE
            assert shard_moe(model, rank, world) == len(moes)
            for i, block in enumerate(b for b in model.blocks if b is not None and b.ffn is not None):
                ep = block.ffn
                assert isinstance(ep, EPMoE)
                lo, hi = expert_range(moes[i].n_experts, rank, world)
                assert ep.moe.w1.shape[0] == hi - lo  # only this rank's experts are held
                for x, y in zip(inputs, want[i], strict=True):
                    got = ep(x)
                    assert got.dtype == y.dtype
                    assert torch.equal(bits(got), bits(y)), f"layer {block.layer}, {x.shape[0]} rows, {dtype}"
    finally:
        dist.destroy_process_group()
