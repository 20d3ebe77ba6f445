"""The engine vs its kernels: a step of the real ``LLMEngine`` against the same step's layers alone.

One device call. A true-width V4.1 model of reduced depth (bench/p_throughput.py's three layers: a
ratio-2 index source like L2, the last KV source with the candidate pool like L20, a ratio-1 reuse
layer like L21; plus one DSpark draft block), every layer's experts aliasing one store so bytes and
FLOPs per layer stay real. Weights in the CUDA default layout (MXFP4 experts packed).

For each case the engine is driven to the step's shape, then steps are timed end to end (host wall
clock around ``engine.step()``, synchronised: scheduling, the forward, sampling, drafting, rollback,
output bookkeeping). Decode steps run as the engine runs them by default on CUDA (replayed CUDA
graphs, engine/cuda_graphs.py) and, in the same run, with ``enforce_eager`` (``eager_*`` fields); the
steps admitting bounded prefills as the engine runs them by default (whole-step graphs for the
decode steps, the mixed step eager), with piecewise graphs for the mixed step
(``full_and_piecewise_*``) and all eager (``eager_*``).
In the same run the step's layers are timed alone on a ``PagedBatch`` of the
same shape (``bench.common.StepState`` + ``step_block``: the engine's own layer path, CUDA events,
eager like the engine) plus the LM head on the rows that need logits, and, for the steps that draft
(k > 0), the drafting alone (``time_drafter``: seeding the draft windows with 1 + k accepted rows per
request, the DSpark block with its head on every block row, the k-position Markov loop; ``draft_*_ms``).
The ratio engine ÷ layers (``engine_over_layers``, ``sum_ms`` = target layers + head + drafting) is
what the engine adds on top of its kernels (target ≤ 1.2); ``engine_over_target_layers`` divides by the
target's layers and head only (``target_sum_ms``, the ratio before the drafter was counted). The
per-sequence reference path (``model.batched = False``) is timed on the small decode cases in the
same run for the speed-up.

Cases: decode of B = 16 / 64 / 256 requests × (1 + k) rows, k = 0 and 3, at ~1K context; a decode
step of 64 requests (k = 0) on the decode worker of asymmetric P/D admitting 1 and 4 bounded prefills
(W rows each, prefix imported from the prefill worker), mixed (cap-4) and unmixed (alone-4, the
decode worker's default: the bounded prefills alone, a graph, then the decode step); colocated
prefill of 32 × 1K and 2 × 16K prompts (one step each at a 32K-token budget).

``--smoke``: the tiny config on CPU (plumbing only). Writes ``engine_steps.json``.

``--indexer``: the same cases with the fused indexer's version 4 and version 5 (the default): the
engine's own batched path selecting with each, ``v5_speedup`` = v4 ÷ v5 step time. Writes
``engine_steps_indexer.json``.

``--attention-versions``: the same cases with the fused attention's version 2 and version 3 (the
default), ``v3_speedup`` = v2 ÷ v3 step time. Writes ``engine_steps_attention_v3.json``.

``--attention``: only the fused-attention comparison (issue 15): decode B = 64 (k = 0) and B = 256
(k = 3) at ~1K context (a row attends to W + index_topk keys whatever the context beyond that), and
the two colocated prefills, each run twice in the same process, with the batched path's fused
sparse attention kernel (``AttentionKernels.fused_attention``, the CUDA default) and with the
gathered path it replaced; step, forward and per-layer times of both, ``fused_speedup`` = gathered
÷ fused step time. Writes ``engine_steps_attention.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():  # the fused kernels on CPU: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import StepState, log, record, step_block

LAZY = {"cuda_graph_capture": "lazy"}  # an engine per case: its graphs come from its own warm-up steps

K_SPEC = 3


def config(smoke: bool):
    from asympd.config import tiny, v41_flash

    base = tiny() if smoke else v41_flash()
    return base.replace(
        n_layers=3,
        n_mtp_layers=1,
        compress_ratios=(2, 1, 1, 0),
        kv_source_layers=(0, 1),
        index_source_layers=(0, 1),
        candidate_source_layer=1,
        engram_layer_ids=(),
        engram_num_embeddings=(),
        dspark_target_layer_ids=(0, 1, 2),
        vision_n_layers=0,
        max_seq_len=1 << 16,
    )


def tensors_for(cfg, device):
    from bench.common import random_tensors

    def keep(name: str) -> bool:  # layers 1.. alias layer 0's experts (same bytes, one copy)
        return not (name.startswith("layers.") and ".ffn.experts." in name and not name.startswith("layers.0."))

    t = random_tensors(cfg, keep, device)
    for name in [n for n in t if n.startswith("layers.0.ffn.experts.")]:
        for layer in range(1, cfg.n_layers):
            t[name.replace("layers.0.", f"layers.{layer}.", 1)] = t[name]
    return t


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Timed:
    """Wall time of the engine's step and of its parts (forward, drafting), synchronised."""

    def __init__(self, eng, device):
        self.eng, self.device = eng, device
        self.parts: dict[str, float] = {}
        for obj, name, key in ((eng.runner, "execute", "forward_ms"), (eng, "_draft", "draft_ms")):
            setattr(obj, name, self._wrap(getattr(obj, name), key))

    def _wrap(self, fn, key):
        def inner(*a, **k):
            sync(self.device)
            t = time.perf_counter()
            out = fn(*a, **k)
            sync(self.device)
            self.parts[key] = self.parts.get(key, 0.0) + (time.perf_counter() - t) * 1e3
            return out

        return inner

    def step(self) -> dict[str, float]:
        self.parts = {}
        sync(self.device)
        t = time.perf_counter()
        self.eng.step()
        sync(self.device)
        return {"step_ms": (time.perf_counter() - t) * 1e3, **self.parts}

    def close(self) -> None:
        self.eng.runner.__dict__.pop("execute", None)
        self.eng.__dict__.pop("_draft", None)


def median_parts(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: round(statistics.median(r.get(k, 0.0) for r in rows), 3) for k in keys}


def time_drafter(model, state: StepState, k: int, timed) -> dict[str, float]:
    """The drafting a speculative step does, alone, through the engine's own calls on the step's
    cache (each of ``state``'s requests drafts; eager, like the layers): seeding the draft blocks'
    windows with 1 + k accepted rows per request (``DSpark.forward`` with no block), the blocks'
    forward with their head on each block's first k rows (``blocks_forward(..., head_rows=k)`` on a
    slot-addressed ``DraftBatch``, what ``DraftGraphs`` replays), and the Markov loop of k positions
    (one bias GEMM and one argmax each, greedy; inside the drafter's graph in the engine)."""
    from asympd.model.dspark import DraftBatch, DraftSegment

    drafter, cfg, dev = model.drafter, model.cfg, state.cache.device
    segs = state.segments
    n, b = len(segs), drafter.block_size
    width = len(cfg.dspark_target_layer_ids) * cfg.dim
    g = torch.Generator(device=dev).manual_seed(5)
    hidden = torch.randn(n, 1 + k, width, generator=g, device=dev).to(model.dtype)
    views = [state.cache.view(i, s.block_table, s.slot) for i, s in enumerate(segs)]

    def seed():
        # the rows a verify step accepted, appended at the same positions each time (rewritten in place)
        drafter.forward([DraftSegment(v, hidden[i], s.start) for i, (v, s) in enumerate(zip(views, segs, strict=True))])

    starts = torch.tensor([s.start + 1 for s in segs], device=dev)
    batch = DraftBatch([], None, None, slots=torch.tensor([s.slot for s in segs], device=dev), cache=state.cache)
    batch.block_pos = (starts.unsqueeze(-1) + torch.arange(b, device=dev)).flatten()
    tokens = torch.randint(3, cfg.vocab_size, (n * b,), generator=g, device=dev)
    logits = torch.randn(n, k, cfg.vocab_size, generator=g, device=dev)
    prev0 = tokens.view(n, b)[:, 0]

    def markov():
        prev = prev0
        for i in range(k):
            bias, _ = drafter.markov(prev)
            prev = (logits[:, i] + bias).argmax(-1)

    out = {
        "draft_seed_ms": timed(seed),
        "draft_blocks_ms": timed(lambda: drafter.blocks_forward(tokens, batch, k)),
        "draft_markov_ms": timed(markov),
    }
    out = {key: round(v, 3) for key, v in out.items()}
    out["draft_sum_ms"] = round(sum(out.values()), 3)
    return out


def time_layers(model, specs, logit_rows: int, device, reps: int, draft_k: int = 0) -> dict[str, Any]:
    """The step's layers alone: each layer over a PagedBatch of the same shape, plus the head, plus
    (``draft_k`` > 0) the drafting the step does (``time_drafter``). ``sum_ms`` counts all of it;
    ``target_sum_ms`` the target's layers and head only."""
    from asympd.model.ops import lm_head

    cfg = model.cfg
    g = torch.Generator(device=device).manual_seed(3)
    state = StepState(cfg, specs, model.dtype, device, g)
    h = torch.randn(state.rows, cfg.hc_mult, cfg.dim, generator=g, device=device).to(model.dtype)
    pre = torch.softmax(torch.randn(state.rows, cfg.hc_mult, generator=g, device=device), -1)
    x = torch.randn(logit_rows, cfg.dim, generator=g, device=device).to(model.dtype)

    def timed(fn) -> float:
        for _ in range(2):
            fn()
        out = []
        for _ in range(reps):
            sync(device)
            t = time.perf_counter()
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b))
            else:
                fn()
                out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)

    per_layer = []
    with torch.inference_mode():
        for layer in range(cfg.n_layers):
            block = model.blocks[layer]
            per_layer.append(timed(lambda b=block: step_block(b, h, pre, state)))
        head = timed(lambda: lm_head(x, model.head)) if logit_rows else 0.0
        drafter = time_drafter(model, state, draft_k, timed) if draft_k else {}
    target = sum(per_layer) + head
    out = {"layers_ms": [round(t, 3) for t in per_layer], "head_ms": round(head, 3)}
    out["target_sum_ms"] = round(target, 3)
    out.update(drafter)
    out["sum_ms"] = round(out["target_sum_ms"] + drafter.get("draft_sum_ms", 0.0), 3)
    if device.type == "cuda" and state.rows <= 4096:
        # the same layers back to back, eager and as one CUDA-graph replay: what graphs would take off
        from bench.common import time_cuda

        def stack():
            x, p = h, pre
            for layer in range(cfg.n_layers):
                x, p = step_block(model.blocks[layer], x, p, state)
            return x

        with torch.inference_mode():
            eager = time_cuda(stack, iters=reps)
            graph = time_cuda(stack, iters=reps, graph=True)
        out.update(stack_eager_ms=round(eager["ms"], 3), stack_graph_ms=round(graph["ms"], 3), graph_mode=graph["mode"])
        if "graph_error" in graph:
            out["graph_error"] = graph["graph_error"]
    return out


def decode_case(
    model, cfg, device, b: int, k: int, ctx: int, steps: int, batched: bool = True, eager: bool = False
) -> dict[str, Any]:
    """``eager``: the engine with ``enforce_eager`` (no CUDA graphs; they are on by default on CUDA)."""
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.sampling import SamplingParams
    from asympd.engine.scheduler import SchedulerConfig

    model.batched = batched
    sc = SchedulerConfig(max_num_seqs=b, max_num_batched_tokens=max(b * (1 + k), 32768))
    kv_bytes = int(b * (ctx + 64 + steps * (k + 1)) * 3500 * 1.3) + (64 << 20)
    ecfg = EngineConfig(num_spec_tokens=k, kv_cache_bytes=kv_bytes, scheduler=sc, enforce_eager=eager, **LAZY)
    eng = LLMEngine(model, ecfg)
    eng.config.enable_prefix_caching = False
    gen = torch.Generator().manual_seed(b * 10 + k)
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for i in range(b):
        eng.add_request(f"d{i}", torch.randint(3, cfg.vocab_size, (ctx,), generator=gen).tolist(), params)
    t = Timed(eng, device)
    guard = 0
    while any(r.in_prompt for r in eng.requests.values()) or not all(r.output_token_ids for r in eng.requests.values()):
        t.step()
        guard += 1
        assert guard < 1000
    for _ in range(2):  # first decode steps (drafting starts)
        t.step()
    rows = [t.step() for _ in range(steps)]
    t.close()
    out = {"case": f"decode B={b} k={k}", "requests": b, "rows": b * (1 + k), "context": ctx, "batched": batched}
    out.update(median_parts(rows))
    graphs = eng.runner.graphs
    out["cuda_graphs"] = None if graphs is None else dict(graphs.stats, shapes=len(graphs.graphs))
    drafts = getattr(eng.proposer, "graphs", None)  # seeded: drafting steps whose windows the graph seeded
    if drafts is not None:
        out["draft_graphs"] = dict(drafts.stats, seed_rows=getattr(drafts, "seed_rows", 0))
    out["step_ms_all"] = [round(r["step_ms"], 2) for r in rows]
    del eng
    gc.collect()
    return out


def admission_case(
    models,
    cfg,
    device,
    b: int,
    admit: int,
    ctx: int,
    prompt: int,
    reps: int,
    graphs: str = "full",
    mixed: bool = True,
) -> dict[str, Any]:
    """D (asymmetric, k = 0) decoding ``b`` requests, then a step that also admits ``admit`` requests
    whose prefix P computed: their bounded prefill of W rows runs in that step. ``graphs``: D's
    ``cuda_graph_mode``, or "eager" (``enforce_eager``). ``mixed`` False (the decode worker's default
    policy, alone-4): the bounded prefills run in a step of their own (a graph), the decodes in the
    next (``decode_after_step_ms``)."""
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.sampling import SamplingParams
    from asympd.engine.scheduler import SchedulerConfig
    from asympd.transfer.prefix_state import PrefixState

    p_model, d_model = models
    sc = SchedulerConfig(max_num_seqs=b + admit * reps + 4, max_num_batched_tokens=32768, mixed_steps=mixed)
    per_tok = 3500 * 1.3
    kv = int((b * (ctx + 64) + admit * reps * (prompt + 64)) * per_tok) + (64 << 20)
    mode = {"enforce_eager": True} if graphs == "eager" else {"cuda_graph_mode": graphs, **LAZY}
    d = LLMEngine(d_model, EngineConfig(role="decode", mode="asymmetric", kv_cache_bytes=kv, scheduler=sc, **mode))
    p = LLMEngine(
        p_model,
        EngineConfig(
            role="prefill",
            mode="asymmetric",
            kv_cache_bytes=int(prompt * per_tok * 2) + (64 << 20),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32768),
        ),
    )
    d.config.enable_prefix_caching = p.config.enable_prefix_caching = False
    gen = torch.Generator().manual_seed(77 + admit)
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)

    def exported(rid: str, n: int) -> tuple[list[int], PrefixState]:
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()
        p.add_request(rid, ids, params)
        while True:
            for o in p.step():
                if o.finished:
                    state = o.prefix_state
                    p.release_transfer(rid)
                    return ids, PrefixState.deserialize(state.serialize())

    for i in range(b):
        ids, st = exported(f"base{i}", ctx)
        d.add_request(f"base{i}", ids, params, prefix_state=st)
    t = Timed(d, device)
    while not all(r.output_token_ids for r in d.requests.values()):
        t.step()
    t.step()
    plain, admitting, after = [], [], []
    for r in range(reps):
        staged = [exported(f"new{r}.{j}", prompt) for j in range(admit)]
        plain.append(t.step())
        for j, (ids, st) in enumerate(staged):
            d.add_request(f"new{r}.{j}", ids, params, prefix_state=st)
        admitting.append(t.step())
        if not mixed:
            after.append(t.step())
    t.close()
    out = {
        "case": f"decode B={b} + {admit} bounded prefills" + ("" if mixed else ", unmixed"),
        "requests": b if mixed else 0,
        "admitted": admit,
        "rows": (b if mixed else 0) + admit * cfg.window_size,
        "context": ctx,
        "prompt": prompt,
    }
    out.update(median_parts(admitting))
    out["decode_only_step_ms"] = median_parts(plain)["step_ms"]
    if after:
        out["decode_after_step_ms"] = median_parts(after)["step_ms"]
    gc.collect()
    return out


def prefill_case(model, cfg, device, count: int, n: int, reps: int) -> dict[str, Any]:
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.sampling import SamplingParams
    from asympd.engine.scheduler import SchedulerConfig

    sc = SchedulerConfig(max_num_seqs=count, max_num_batched_tokens=count * n)
    kv = int(count * (n + 64) * 3500 * 1.3) + (64 << 20)
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=kv, scheduler=sc, **LAZY))
    eng.config.enable_prefix_caching = False
    gen = torch.Generator().manual_seed(n + count)
    t = Timed(eng, device)
    rows = []
    for r in range(reps + 1):
        for i in range(count):
            ids = torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()
            eng.add_request(f"p{r}.{i}", ids, SamplingParams(max_tokens=1, temperature=0))
        res = t.step()  # the whole batch of prompts in one step (and their first tokens)
        while eng.has_unfinished_requests():
            eng.step()
        if r:  # the first is warm-up
            rows.append(res)
    t.close()
    out = {"case": f"prefill {count} x {n}", "requests": count, "rows": count * n}
    out.update(median_parts(rows))
    out["tokens_per_s"] = round(count * n / (out["step_ms"] / 1e3))
    del eng
    gc.collect()
    return out


def window_case(models, cfg, device, n: int, reps: int) -> dict[str, Any]:
    """The same W-row chunk through every layer, at the end of an ``n``-token prompt, as each role runs
    it: a symmetric P's window step (symmetric-windows: its prefix step first, then the window alone,
    a CUDA graph on a GPU) and an asymmetric D's first step (P's prefix imported, the bounded prefill
    alone, a graph). In headline4 both held the GPU 85-101 ms at 1-3K-token prompts (the P's host
    time also waits for its prefix step's GPU tail; docs/performance.md §10, "Thirteenth
    session"); this times both by prompt length, past 3K too, in one process, each step beside
    its forward alone."""
    from asympd.engine.engine import EngineConfig, LLMEngine
    from asympd.engine.sampling import SamplingParams
    from asympd.engine.scheduler import SchedulerConfig
    from asympd.transfer.prefix_state import PrefixState

    full, p_model, d_model = models
    kv = int((n + 64) * 3500 * 1.3 * (reps + 1)) + (64 << 20)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32768)
    gen = torch.Generator().manual_seed(n)
    one = SamplingParams(max_tokens=1, temperature=0)

    def prompt() -> list[int]:
        return torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()

    sym = LLMEngine(
        full, EngineConfig(role="prefill", mode="symmetric-windows", kv_cache_bytes=kv, scheduler=sc, **LAZY)
    )
    t = Timed(sym, device)
    prefix, window = [], []
    for r in range(reps + 1):  # the first is warm-up (a lazy capture)
        sym.add_request(f"s{r}", prompt(), one)
        steps = []
        while sym.has_unfinished_requests():
            steps.append(t.step())
        sym.release_transfer(f"s{r}")  # P held its blocks for D's fetch
        if r:
            prefix.append(steps[0])
            window.append(steps[-1])
    t.close()
    sym_graphs = sym.runner.graphs
    sym_stats = None if sym_graphs is None else dict(sym_graphs.stats, shapes=len(sym_graphs.graphs))
    del sym
    gc.collect()

    p = LLMEngine(p_model, EngineConfig(role="prefill", mode="asymmetric", kv_cache_bytes=kv, scheduler=sc))
    d = LLMEngine(d_model, EngineConfig(role="decode", mode="asymmetric", kv_cache_bytes=kv, scheduler=sc, **LAZY))
    p.config.enable_prefix_caching = d.config.enable_prefix_caching = False
    t = Timed(d, device)
    first = []
    for r in range(reps + 1):
        ids = prompt()
        p.add_request(f"a{r}", ids, one)
        state = None
        while state is None:
            for o in p.step():
                if o.finished:
                    state = PrefixState.deserialize(o.prefix_state.serialize())
                    p.release_transfer(f"a{r}")
        d.add_request(f"a{r}", ids, one, prefix_state=state)
        row = t.step()  # the bounded prefill alone: the first token comes out of it
        while d.has_unfinished_requests():
            d.step()
        if r:
            first.append(row)
    t.close()
    d_graphs = d.runner.graphs
    d_stats = None if d_graphs is None else dict(d_graphs.stats, shapes=len(d_graphs.graphs))
    del p, d
    gc.collect()
    out = {"case": f"window step at a {n}-token prompt", "prompt": n, "rows": cfg.window_size}
    # the forward alone beside each step: what the step adds around it (P exports its prefix in
    # its window step, D samples) is the difference
    for key, rows in (("symmetric_p_prefix", prefix), ("symmetric_p_window", window), ("asymmetric_d_first", first)):
        med = median_parts(rows)
        out[f"{key}_step_ms"], out[f"{key}_forward_ms"] = med["step_ms"], med.get("forward_ms", 0.0)
    out["p_over_d"] = round(out["symmetric_p_window_step_ms"] / out["asymmetric_d_first_step_ms"], 3)
    out["symmetric_p_cuda_graphs"], out["asymmetric_d_cuda_graphs"] = sym_stats, d_stats
    return out


def set_fused_attention(model, on: bool) -> None:
    """Switch the batched path's attention between the fused kernel and the gathered path."""
    for block in model.blocks:
        if block is not None:
            block.attn.kernels = dataclasses.replace(block.attn.kernels, fused_attention=on)


def ab_cases(full, cfg, device, smoke: bool, res: dict[str, Any], started: float, name: str, variants) -> None:
    """Every case under each of two variants (``(tag, switch)``: ``switch()`` sets the model up),
    same process; ``<new>_speedup`` = the first variant's step time ÷ the second's."""
    ctx, steps, reps = (96, 3, 1) if smoke else (1024, 8, 2)
    name = f"{name}_smoke" if smoke else name
    decodes = ((2, 0), (4, K_SPEC)) if smoke else ((64, 0), (256, K_SPEC))
    prefills = ((4, 48), (2, 100)) if smoke else ((32, 1024), (2, 16384))
    cases = [("decode", b, k) for b, k in decodes] + [("prefill", c, n) for c, n in prefills]
    for kind, a, b in cases:
        row: dict[str, Any] = {}
        for tag, switch in variants:
            switch()
            if kind == "decode":
                case = decode_case(full, cfg, device, a, b, ctx, steps)
                specs, logit_rows, draft_k = [dict(n=a, q=1 + b, start=ctx + 2)], a * (1 + b), b
            else:
                case = prefill_case(full, cfg, device, a, b, reps)
                specs, logit_rows, draft_k = [dict(n=a, q=b, start=0)], a, 0
            iso = time_layers(full, specs, logit_rows, device, reps=3 if smoke else 10, draft_k=draft_k)
            row["case"] = case["case"]
            row[f"{tag}_step_ms"] = case["step_ms"]
            row[f"{tag}_forward_ms"] = case.get("forward_ms")
            row[f"{tag}_layers_ms"] = iso["layers_ms"]
            if "cuda_graphs" in case:
                row[f"{tag}_cuda_graphs"] = case["cuda_graphs"]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        (old, _), (new, _) = variants
        row[f"{new}_speedup"] = round(row[f"{old}_step_ms"] / row[f"{new}_step_ms"], 3)
        res["cases"].append(row)
        log(row)
        record(name, res, started)


def attention_cases(full, cfg, device, smoke: bool, res: dict[str, Any], started: float) -> None:
    """``--attention``: every case with the gathered path, then the fused kernel, same process."""
    variants = [(tag, lambda on=on: set_fused_attention(full, on)) for tag, on in (("gathered", 0), ("fused", 1))]
    ab_cases(full, cfg, device, smoke, res, started, "engine_steps_attention", variants)
    set_fused_attention(full, full.blocks[0].attn.kernels.fused_indexer)


def version_cases(
    full, cfg, device, smoke: bool, res: dict[str, Any], started: float, knob: str, old: int, new: int, name: str
) -> None:
    """Every case with ``attn_kernels.<knob>`` at ``old``, then at ``new``, same process."""
    from asympd.model import attn_kernels

    default = getattr(attn_kernels, knob)

    def use(version: int):
        return lambda: setattr(attn_kernels, knob, version)

    try:
        ab_cases(full, cfg, device, smoke, res, started, name, [(f"v{old}", use(old)), (f"v{new}", use(new))])
    finally:
        setattr(attn_kernels, knob, default)


def main() -> None:
    from asympd.model.loader import build_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU: plumbing only")
    ap.add_argument("--attention", action="store_true", help="only the fused vs gathered attention comparison")
    ap.add_argument("--indexer", action="store_true", help="only the fused indexer's version 4 vs 5 comparison")
    ap.add_argument(
        "--attention-versions", action="store_true", help="only the fused attention's version 2 vs 3 comparison"
    )
    ap.add_argument(
        "--windows", action="store_true", help="only the window step: a symmetric P's against a D's first step"
    )
    args = ap.parse_args()
    started = time.time()
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    cfg = config(smoke)
    w = cfg.window_size
    t0 = time.time()
    tensors = tensors_for(cfg, device)
    full = build_model(cfg, tensors, "full", dtype=dtype, device=device)
    res: dict[str, Any] = {
        "config": "reduced 3 layers + 1 DSpark block at V4.1 widths" if not smoke else "tiny (smoke)",
        "layers": {"0": "ratio-2 index source", "1": "last KV source, candidate pool", "2": "ratio-1 reuse"},
        "build_s": round(time.time() - t0, 1),
        "cases": [],
    }
    if args.attention:
        attention_cases(full, cfg, device, smoke, res, started)
        return
    if args.indexer:  # the fused indexer's version 4 vs 5
        version_cases(full, cfg, device, smoke, res, started, "INDEXER_VERSION", 4, 5, "engine_steps_indexer")
        return
    if args.attention_versions:  # the fused attention's version 2 vs 3
        version_cases(full, cfg, device, smoke, res, started, "ATTENTION_VERSION", 2, 3, "engine_steps_attention_v3")
        return
    if args.windows:
        name = "engine_steps_windows_smoke" if smoke else "engine_steps_windows"
        roles = (full, *(build_model(cfg, tensors, r, dtype=dtype, device=device) for r in ("prefill", "decode")))
        for n in (2 * w, 6 * w) if smoke else (1024, 4096, 16384):
            res["cases"].append(window_case(roles, cfg, device, n, reps=2 if smoke else 5))
            log(res["cases"][-1])
            record(name, res, started)
        return
    ctx = 96 if smoke else 1024
    steps = 3 if smoke else 8
    decode_b = [2, 4] if smoke else [16, 64, 256]
    name = "engine_steps_smoke" if smoke else "engine_steps"

    def add(case: dict[str, Any], specs, logit_rows: int, draft_k: int = 0) -> None:
        iso = time_layers(full, specs, logit_rows, device, reps=3 if smoke else 10, draft_k=draft_k)
        case.update(iso)
        case["engine_over_layers"] = round(case["step_ms"] / iso["sum_ms"], 3)
        case["engine_over_target_layers"] = round(case["step_ms"] / iso["target_sum_ms"], 3)
        case["forward_over_layers"] = round(case.get("forward_ms", 0.0) / iso["sum_ms"], 3)
        res["cases"].append(case)
        log({k: v for k, v in case.items() if k not in ("step_ms_all",)})
        record(name, res, started)  # after every case: a run cut short still leaves what it measured

    for k in (0, K_SPEC):
        for b in decode_b:
            case = decode_case(full, cfg, device, b, k, ctx, steps)
            if device.type == "cuda":  # the same steps without CUDA graphs, same run
                eager = decode_case(full, cfg, device, b, k, ctx, steps, eager=True)
                parts = ("step_ms", "forward_ms", "draft_ms")
                case.update({f"eager_{key}": eager[key] for key in parts if key in eager})
                case["graph_speedup"] = round(eager["step_ms"] / case["step_ms"], 2)
            start = ctx + 2  # about where the timed steps run
            add(case, [dict(n=b, q=1 + k, start=start)], b * (1 + k), draft_k=k)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    # the per-sequence path it replaced, same run (small batches: it is slow)
    for b in decode_b[:2]:
        ref = decode_case(full, cfg, device, b, 0, ctx, 3, batched=False)
        new = next(c for c in res["cases"] if c["case"] == f"decode B={b} k=0")
        res.setdefault("per_sequence_path", []).append(
            {
                "case": ref["case"],
                "step_ms": ref["step_ms"],
                "batched_step_ms": new["step_ms"],
                "speedup": round(ref["step_ms"] / new["step_ms"], 2),
            }
        )
        log(res["per_sequence_path"][-1])
    full.batched = True
    # the decode worker admitting bounded prefills (its prefix from the prefill worker)
    p_model = build_model(cfg, tensors, "prefill", dtype=dtype, device=device)
    d_model = build_model(cfg, tensors, "decode", dtype=dtype, device=device)
    prompt = 3 * w if smoke else 4096
    b = 4 if smoke else 64
    for admit in (1, 4):
        case = admission_case((p_model, d_model), cfg, device, b, admit, ctx, prompt, reps=2 if smoke else 4)
        if device.type == "cuda":  # the mixed step with piecewise graphs, and all eager: same run
            for other in ("full_and_piecewise", "eager"):
                o = admission_case((p_model, d_model), cfg, device, b, admit, ctx, prompt, reps=4, graphs=other)
                case[f"{other}_step_ms"], case[f"{other}_decode_only_step_ms"] = o["step_ms"], o["decode_only_step_ms"]
        bounded = dict(n=admit, q=w, start=prompt - w, floor=prompt - w, encoder_floor=prompt - w)
        add(case, [dict(n=b, q=1, start=ctx + 3), bounded], b + admit)
    for admit in (1, 4):  # alone-4: the bounded prefills in a step of their own, the decodes in the next
        case = admission_case(
            (p_model, d_model), cfg, device, b, admit, ctx, prompt, reps=2 if smoke else 4, mixed=False
        )
        add(case, [dict(n=admit, q=w, start=prompt - w, floor=prompt - w, encoder_floor=prompt - w)], admit)
    del p_model, d_model
    gc.collect()
    # colocated prefill, one step per batch of prompts
    for count, n in ((4, 48), (2, 100)) if smoke else ((32, 1024), (2, 16384)):
        case = prefill_case(full, cfg, device, count, n, reps=1 if smoke else 2)
        add(case, [dict(n=count, q=n, start=0)], count)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        res["max_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    record(name, res, started)


if __name__ == "__main__":
    main()
