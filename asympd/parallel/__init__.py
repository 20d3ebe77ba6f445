"""Multi-rank workers: expert parallelism for the MoE layers, attention replicated on every rank.

Why EP + replicated attention (not tensor parallel attention): V4.1-Flash attention is MQA over
one 512-d latent shared by all 64 heads (K = V). Splitting the heads across ranks (TP) would still
need the whole latent on every rank, so the KV cache -- the thing that limits batch size -- would
be replicated anyway, and only the small attention weights (0.127 GB of a 7.39 GB layer) would be
split. The weight that does not fit is the routed experts (7.22 GB per layer, 98%), and EP splits
exactly that. DeepSeek's own deployments run data-parallel attention + EP. What is here is the
degenerate DP-attention with one request group: every rank runs attention over the same requests
(identical caches), and the ranks meet only in each MoE layer. True DP attention (each rank's own
requests) is the next step and is not done; the MoE layer already takes "my tokens" and dispatches
them to the experts' owners by all-to-all.

- :mod:`asympd.parallel.ep`: ``EPMoE`` / ``shard_moe`` (all-to-all dispatch/combine, bit-identical to
  the single-rank MoE), ``rank_tensors`` (the checkpoint tensors a rank reads);
- :mod:`asympd.parallel.launch`: rank 0 starts ranks 1..N-1 itself; gloo on CPU, NCCL on CUDA;
- :mod:`asympd.parallel.executor`: one scheduler on rank 0, step plans broadcast to the other ranks;
- :mod:`asympd.parallel.worker`: the non-zero ranks' process;
- :mod:`asympd.parallel.llm`: ``ParallelLLM``, the offline entry point.

``docs/parallel.md`` has the design, the memory per rank and what is not done.
"""

from __future__ import annotations

from asympd.parallel.ep import EPMoE, ep_resident_gb, exchange, expert_range, rank_tensors, shard_moe
from asympd.parallel.executor import DistributedExecutor, ExecutorBroken
from asympd.parallel.launch import RankGroup, RankSpec

__all__ = [
    "DistributedExecutor",
    "EPMoE",
    "ExecutorBroken",
    "ParallelLLM",
    "RankGroup",
    "RankSpec",
    "ep_resident_gb",
    "exchange",
    "expert_range",
    "launch_ep",
    "rank_tensors",
    "shard_moe",
]


def launch_ep(
    engine_role: str,
    checkpoint: str,
    ep: int,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    weights: str = "auto",
) -> DistributedExecutor:
    """Start ranks 1..ep-1 of a worker whose model has role ``engine_role`` (they load while the
    caller builds its own model, ``load_model(..., ep=(0, ep))``, and engine); then
    ``executor.attach(engine)``."""
    spec = RankSpec(checkpoint, engine_role, device, dtype, threads, weights=weights)
    return DistributedExecutor(RankGroup(ep, spec))


def __getattr__(name: str):  # ParallelLLM pulls in the engine; import it on first use
    if name == "ParallelLLM":
        from asympd.parallel.llm import ParallelLLM

        return ParallelLLM
    raise AttributeError(name)
