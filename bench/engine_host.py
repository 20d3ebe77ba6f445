"""Host overhead of an engine step: a CPU benchmark (no device), B = 256 requests x (1 + k = 4) rows.

The tiny config (asympd.config.tiny(): hidden sizes of a few dozen) runs ``B`` decoding requests with
``num_spec_tokens = k`` on the CPU. The forward and the drafter's blocks still cost real CPU time
here (1024 rows); what this measures is the engine's Python around them, which grows with the
request count and on the H200 sits between the kernels (docs/performance.md §11): scheduling
(``schedule_ms``), sampling and verification (``sample_ms``), applying results per request
(``apply_ms``), everything outside the forward and drafting (``other_ms``, rollback included: what
engine_steps.json's step_ms - forward_ms - draft_ms is on the GPU), and drafting's host work around
``DSpark.draft`` (``draft_host_ms``). Medians over ``--steps`` steps after warm-up; ``--profile``
adds cProfile's top engine-side functions by cumulative time. Not a GPU figure: compare runs of
this script before and after a change on the same machine.

``--graphs``: the engine takes the CUDA-graph path as on the H200, without capture (the static
path the CPU suite checks: ``DecodeGraphs`` / ``DraftGraphs(capture=False)``, the drafter's with its
Markov loop and, where the tree has it, its seeding of the windows): its host work around the
replays is the H200's; the bodies still run eagerly here, timed apart (``forward_body_ms``,
``draft_body_ms``: a replay there), so ``draft_outside_body_ms`` / ``forward_outside_body_ms`` are
what the H200 runs outside its graphs (host work, and eager kernels such as the seeding without
``seed_rows``). Writes ``engine_host_graphs.json``.

``--smoke``: B = 8, two steps. Writes ``engine_host.json`` (``engine_host_smoke.json``).
"""

from __future__ import annotations

import argparse
import inspect
import io
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# the repository root first, not bench/ itself: its profile.py would shadow the one cProfile imports
sys.path[0] = str(Path(__file__).resolve().parents[1])

import cProfile  # noqa: E402
import pstats  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():  # the Triton kernels under the interpreter, as the CPU suite runs them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import log, record  # noqa: E402


def build(b: int, k: int, ctx: int, graphs: bool = False):
    from asympd.config import tiny
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.sampling import SamplingParams
    from asympd.engine.scheduler import SchedulerConfig
    from asympd.model.loader import build_model
    from bench.common import random_tensors

    cfg = tiny()
    dev = torch.device("cpu")
    model = build_model(cfg, random_tensors(cfg, lambda name: True, dev), "full", dtype=torch.float32, device=dev)
    sc = SchedulerConfig(max_num_seqs=b, max_num_batched_tokens=max(b * ctx, 4096))
    eng = LLMEngine(model, EngineConfig(num_spec_tokens=k, num_blocks=b * ((ctx + 300) // 16 + 3), scheduler=sc))
    eng.config.enable_prefix_caching = False
    if graphs:  # as the engine builds them on CUDA, static path without capture (tests/engine/test_batched_step.py)
        from asympd.engine.cuda_graphs import DecodeGraphs, DraftGraphs

        eng.runner.graphs = DecodeGraphs(model, eng.runner.cache, max_batch=b, capture=False, max_rows=1 + k)
        if k:
            # seed_rows where the tree has it (this script also times trees from before it)
            seeds = {"seed_rows": 1 + k} if "seed_rows" in inspect.signature(DraftGraphs).parameters else {}
            eng.proposer.graphs = DraftGraphs(
                eng.proposer.drafter, eng.runner.cache, max_batch=b, capture=False, num_drafts=k, **seeds
            )
    gen = torch.Generator().manual_seed(b)
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for i in range(b):
        eng.add_request(f"r{i}", torch.randint(3, cfg.vocab_size, (ctx,), generator=gen).tolist(), params)
    while not all(r.output_token_ids for r in eng.requests.values()):
        eng.step()
    for _ in range(2):  # drafting starts
        eng.step()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="B = 8, two steps")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--ctx", type=int, default=256, help="prompt tokens per request (per-request host work can grow with it)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps; top functions in the JSON")
    ap.add_argument("--graphs", action="store_true", help="the CUDA-graph path without capture (static buffers)")
    args = ap.parse_args()
    started = time.time()
    b, steps = (8, 2) if args.smoke else (args.requests, args.steps)
    torch.set_num_threads(1)
    eng = build(b, args.k, ctx=40 if args.smoke else args.ctx, graphs=args.graphs)
    timed = ("forward_ms", "draft_ms", "drafter_ms", "schedule_ms", "sample_ms", "apply_ms")
    parts: dict[str, list[float]] = {key: [] for key in ("step_ms", *timed)}
    acc: dict[str, float] = {}

    def wrap(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def inner(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a, **kw)
            acc[key] = acc.get(key, 0.0) + (time.perf_counter() - t) * 1e3
            return out

        setattr(obj, name, inner)

    wrap(eng.runner, "execute", "forward_ms")
    wrap(eng, "_draft", "draft_ms")
    wrap(eng.proposer.drafter, "draft", "drafter_ms")  # inside _draft: seeding, the blocks, Markov loop
    wrap(eng.scheduler, "schedule", "schedule_ms")
    wrap(eng, "_draw", "sample_ms")  # sampling and verification of the whole step
    wrap(eng, "_apply", "apply_ms")  # per request: accepted tokens, stop checks, outputs
    if args.graphs:  # the static bodies (a replay on the H200): what is outside them is host work there
        timed += ("forward_body_ms", "draft_body_ms")
        parts.update(forward_body_ms=[], draft_body_ms=[])
        for st in eng.runner.graphs.graphs.values():
            wrap(st, "run", "forward_body_ms")
        for st in eng.proposer.graphs.graphs.values() if eng.proposer is not None else ():
            wrap(st, "run", "draft_body_ms")
    prof = cProfile.Profile() if args.profile else None
    for _ in range(steps):
        acc.clear()
        t = time.perf_counter()
        if prof:
            prof.enable()
        eng.step()
        if prof:
            prof.disable()
        parts["step_ms"].append((time.perf_counter() - t) * 1e3)
        for key in timed:
            parts[key].append(acc.get(key, 0.0))
        # outside the forward and drafting: what the H200 run's step_ms - forward_ms - draft_ms measures
        parts.setdefault("other_ms", []).append(parts["step_ms"][-1] - acc["forward_ms"] - acc["draft_ms"])
        # drafting's host work around DSpark.draft: building the draft requests, reading the proposals
        parts.setdefault("draft_host_ms", []).append(acc["draft_ms"] - acc["drafter_ms"])
        if args.graphs:  # around the replays: on the H200, host work and eager kernels (seeding, before seed_rows)
            parts.setdefault("forward_outside_body_ms", []).append(acc["forward_ms"] - acc.get("forward_body_ms", 0))
            parts.setdefault("draft_outside_body_ms", []).append(acc["draft_ms"] - acc.get("draft_body_ms", 0))
    med = {key: round(statistics.median(v), 2) for key, v in parts.items()}
    res: dict[str, Any] = {
        "note": "CPU benchmark of the engine's host overhead (tiny config); not a GPU figure",
        "requests": b,
        "num_spec_tokens": args.k,
        "rows": b * (1 + args.k),
        "context": 40 if args.smoke else args.ctx,
        "steps": steps,
        **med,
        "step_ms_all": [round(x, 2) for x in parts["step_ms"]],
        "running": sum(1 for r in eng.requests.values() if r.output_token_ids),
        "graphs": args.graphs,
    }
    if args.graphs:
        res["decode_graph_stats"] = dict(eng.runner.graphs.stats)
        if eng.proposer is not None:
            res["draft_graph_stats"] = dict(eng.proposer.graphs.stats)
    if prof:
        s = io.StringIO()
        engine_side = r"asympd/(engine|kv)|transformer.py|dspark.py"  # the engine's own Python, not the ops
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(engine_side, 60)
        res["profile_top"] = s.getvalue().splitlines()[:80]
        print(s.getvalue())
    log({k: v for k, v in res.items() if k != "profile_top"})
    name = "engine_host" + ("_graphs" if args.graphs else "")
    record(name + "_smoke" if args.smoke else name, res, started)


if __name__ == "__main__":
    main()
