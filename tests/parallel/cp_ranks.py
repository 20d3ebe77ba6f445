"""Rank function for ``torch.multiprocessing.spawn`` in the context-parallel tests (importable by
the children; not a test module)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from asympd.model.loader import load_model
from asympd.parallel.cp import cp_prefill


def cp_rank(rank: int, world: int, init_method: str, ckpt: str, cases: list, fingerprint: str, out: str) -> None:
    """Run every case (prompt, split, bounds, chunk, order) over ``world`` gloo ranks; the rank of the
    last slice writes each exported PrefixState, serialized, to ``out/<world>-<case>.bin``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        model = load_model(ckpt, "prefill", "cpu", torch.float32)
        for i, (ids, split, bounds, chunk, order) in enumerate(cases):
            state = cp_prefill(model, ids, split, fingerprint=fingerprint, bounds=bounds, chunk=chunk, order=order)
            assert (state is not None) == (rank == (order or range(world))[-1])
            if state is not None:
                Path(out, f"{world}-{i}.bin").write_bytes(state.serialize())
    finally:
        dist.destroy_process_group()
