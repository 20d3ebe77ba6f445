"""Rank functions for ``torch.multiprocessing.spawn`` in the EP tests (importable by the children;
not a test module)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from asympd.model.loader import load_model
from asympd.parallel.ep import EPMoE, exchange, expert_range, shard_moe


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def moe_rank(rank: int, world: int, init_method: str, ckpt: str, cases: list[tuple[str, tuple[str, ...], int]]) -> None:
    """For each (weight layout, dtypes, n_layers): the first ``n_layers`` MoE layers of the tiny
    model, loaded with this rank's experts only, give the single-rank output bit for bit, on every
    rank, by all-to-all and by the all-reduce baseline, for a few batch sizes (fewer rows than ranks
    included)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        check_exchange(rank, world)
        for weights, dtypes, n_layers in cases:
            _check_layers(rank, world, ckpt, weights, dtypes, n_layers)
    finally:
        dist.destroy_process_group()


def _check_layers(rank: int, world: int, ckpt: str, weights: str, dtypes: tuple[str, ...], n_layers: int) -> None:
    for name in dtypes:
        dtype = getattr(torch, name)
        single = load_model(ckpt, "full", "cpu", dtype, weights)
        moes = [b.ffn for b in single.blocks if b is not None and b.ffn is not None][:n_layers]
        assert all(m.topk >= 3 for m in moes)  # with 2 experts any combine order gives the same sum
        g = torch.Generator().manual_seed(7)
        inputs = [torch.randn(t, single.cfg.dim, generator=g).to(dtype) for t in (1, 5, 37)]
        want = [[m(x) for x in inputs] for m in moes]
        model = load_model(ckpt, "full", "cpu", dtype, weights, ep=(rank, world))
        assert shard_moe(model, rank, world) == len([b for b in single.blocks if b is not None and b.ffn])
        assert (model.drafter is not None) == (rank == 0)  # the drafter lives on rank 0 only
        for i, block in enumerate([b for b in model.blocks if b is not None and b.ffn is not None][:n_layers]):
            ep = block.ffn
            assert isinstance(ep, EPMoE) and type(ep.moe) is type(moes[i])
            lo, hi = expert_range(moes[i].n_experts, rank, world)
            assert (ep.lo, ep.hi) == (lo, hi)
            held = ep.moe.w1.shape[0] if ep.moe.w1 is not None else ep.moe.w13.n_experts
            assert held == hi - lo  # only this rank's experts are held
            for comm in ("alltoall", "allreduce"):
                ep.comm = comm
                for x, y in zip(inputs, want[i], strict=True):
                    got = ep(x)
                    assert got.dtype == y.dtype
                    assert torch.equal(bits(got), bits(y)), (
                        f"{weights}, layer {block.layer}, {x.shape[0]} rows, {name}, {comm}"
                    )


def check_exchange(rank: int, world: int) -> None:
    """``exchange`` delivers rows grouped by source in rank order, uneven and empty splits included,
    and the reply with swapped counts brings every row back where it started."""
    # rank r sends (r + d) % 3 rows to rank d, each row [r, d, i]
    counts = torch.tensor([(rank + d) % 3 for d in range(world)])
    send = torch.tensor([[rank, d, i] for d in range(world) for i in range((rank + d) % 3)], dtype=torch.int64)
    recv, rc = exchange(send.reshape(-1, 3), counts)
    assert rc.tolist() == [(s + rank) % 3 for s in range(world)]
    assert recv.tolist() == [[s, rank, i] for s in range(world) for i in range((s + rank) % 3)]
    back, _ = exchange(recv, rc, recv_counts=counts)
    assert torch.equal(back, send.reshape(-1, 3))
    with pytest.raises(ValueError, match="add up to"):
        exchange(send.reshape(-1, 3)[1:], counts)
