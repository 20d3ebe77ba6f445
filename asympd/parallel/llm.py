"""``ParallelLLM``: the offline ``LLM`` with one of its engines expert-parallel over ``ep`` ranks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from asympd.engine import modes
from asympd.engine.llm import LLM
from asympd.engine.warm_up import warm_up
from asympd.model.dtypes import resolve_dtype
from asympd.model.loader import load_model
from asympd.parallel.executor import DistributedExecutor
from asympd.parallel.launch import RankGroup, RankSpec

SHARDS = ("decode", "prefill")


def model_role(mode: str, shard: str) -> str:
    """The model role the sharded engine loads (what ``LLM`` loads for it)."""
    if shard not in SHARDS:
        raise ValueError(f"shard must be one of {', '.join(SHARDS)}, got {shard!r}")
    if mode == "colocated" and shard == "prefill":
        raise ValueError("the colocated mode has a single engine: shard='decode'")
    return modes.model_role("colocated" if mode == "colocated" else shard, mode)


class ParallelLLM(LLM):
    """``LLM(checkpoint, mode, ...)`` whose engine ``shard`` ("decode": the colocated engine or D;
    "prefill": P) runs with ``ep``-way expert parallelism. Ranks 1..ep-1 are child processes;
    the other engine (P/D modes) stays on rank 0, unsharded. One per process at a time (it owns
    the process group): call ``close`` or use it as a context manager."""

    def __init__(
        self,
        checkpoint: str | Path,
        mode: str = "colocated",
        prefill_semantics: str = "full",
        *,
        ep: int = 2,
        shard: str = "decode",
        device: str = "cpu",
        dtype: torch.dtype | str = "auto",
        **kwargs: Any,
    ):
        role = model_role(mode, shard)
        dtype = resolve_dtype(dtype, device)
        self.executor: DistributedExecutor | None = None
        self.ep = ep
        self.sharded_engine = shard if mode != "colocated" else "colocated"
        if ep == 1:
            super().__init__(checkpoint, mode, prefill_semantics, device=device, dtype=dtype, **kwargs)
            return
        weights = kwargs.get("weights", "auto")
        spec = RankSpec(str(checkpoint), role, device, str(dtype).removeprefix("torch."), weights=weights)
        self.executor = DistributedExecutor(RankGroup(ep, spec))  # children load while we do
        kwargs["enforce_eager"] = True  # no CUDA graphs across ranks (attach): none built at start-up
        want = kwargs.get("warm_up")
        kwargs["warm_up"] = False  # rank 0 holds its own experts only until attached: warm up after
        try:
            super().__init__(checkpoint, mode, prefill_semantics, device=device, dtype=dtype, **kwargs)
            self.executor.attach(self.prefill if shard == "prefill" else self.engine)
            for eng in (e for e in (self.prefill, self.engine) if e is not None):
                if replace(eng.config, warm_up=want).warms_up(eng.model.device):
                    eng.warm_up_report = warm_up(eng)
        except BaseException:
            self.executor.close()
            raise

    def _load_model(
        self, engine_role: str, checkpoint: str | Path, role: str, device: str, dtype: torch.dtype, weights: str
    ):
        """Rank 0's share of the sharded engine's model (its experts only); the other engine whole."""
        ep = (0, self.ep) if self.ep > 1 and engine_role == self.sharded_engine else None
        return load_model(checkpoint, role, device, dtype, weights, ep=ep)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()

    def __enter__(self) -> ParallelLLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
