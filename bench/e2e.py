"""End to end through real servers: one deployment per mode, the same traffic, one JSON (issue 16).

For each mode -- asymmetric, symmetric-split and symmetric-windows (the strongest symmetric
baselines), encoder-only, colocated -- the script starts the product's own processes (``asympd
serve --role prefill|decode|colocated`` and ``asympd router``, through ``asympd.serve.procs``), then

1. calibrates: a few lone requests and one batch through the router, streamed, with the servers'
   ``asympd_timings`` (P compute, transfer, D's first step) and the client's token gaps -- the
   step times ``asympd plan --validate`` feeds the planner's simulator (docs/planner.md);
2. drives the router with ``asympd bench serve`` (a subprocess: the product's load generator) at
   each request rate: random prompts of one length distribution, Poisson arrivals, the same seed
   for every mode, goodput under the stated SLOs;
3. reads every worker's ``/metrics`` before and after each rate (P's computed prompt rows, prefix
   bytes and seconds moved) and ``/asympd/info`` (memory per role).

Model. GPU (default): V4.1-Flash at true width and reduced depth -- the 3 layers of
``bench/p_throughput.py`` (a ratio-2 KV/index source like L2, the last KV source K like L20 with
the candidate pool, a ratio-1 reuse layer like L21; no Engram, no draft blocks) -- written in the
released format (shards, index, both config layouts, tokenizer files) with each tensor drawn on
the GPU in its storage format (``bench.common.random_tensors``); every layer holds its own experts
(7.2 GB each on disk and on the GPU: true bytes per layer). ``--depth 40``: the real 40-layer
schedule (``true_depth``: Engram layers 1 and 14 with tables of 4.8M rows, no draft blocks), every
layer's routed experts layer 0's, stored and held once (asympd/model/shared_experts.py; the servers
get ``--benchmark-shared-experts``). ``--tiny``: the tiny checkpoint, on CPU.

Placement. Two GPUs: P on GPU 0, D on GPU 1 (``CUDA_VISIBLE_DEVICES`` per process), colocated one
worker per GPU behind the router, so every mode uses both. One GPU: everything on it.

    python bench/e2e.py [--tiny | --depth 40] [--modes asymmetric,colocated] [--rates 2,4,8] [--name N]
    python bench/e2e.py --merge part1.json part2.json -o e2e_h200x1.json

One device call is at most 600 s, so the five modes run as ``--modes`` subsets of one command,
each its own JSON; ``--merge`` checks that the parts are one study (commit, model, traffic,
settings, GPU) and recomputes the headline: asymmetric / the strongest symmetric baseline per rate.
A mode or rate starts only if its predicted time (``predict_mode_s``) ends before ``--budget-s``;
each mode's wall time is printed and recorded.

Writes ``e2e_tiny.json`` / ``e2e_h200x{1,2}[_depth40].json`` (``--name``) to ``$ASYMPD_OUT`` or
``bench/results`` after each rate, so a later failure keeps the earlier ones. The servers need
fastapi, uvicorn, httpx, prometheus-client, tokenizers and tqdm where they run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from asympd.engine.engine import CUDA_GRAPH_MODES  # noqa: E402
from asympd.plan.step_log import ALONE_P, BESIDE  # noqa: E402
from asympd.plan.step_log import overlap as _overlap  # noqa: E402
from asympd.serve.admission import POLICIES, default_policy  # noqa: E402
from bench.common import ROOT, log, record  # noqa: E402

MODES = ("asymmetric", "symmetric-split", "symmetric-windows", "encoder-only", "colocated")
SYMMETRIC = ("symmetric-split", "symmetric-windows")  # the baselines the headline divides by (the strongest)
NEEDED = ("fastapi", "starlette", "pydantic", "uvicorn", "httpx", "prometheus_client", "tokenizers", "tqdm")
SUMMARY_FIELDS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
)
PER_REQUEST = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "e2els", "errors", "asympd_timings")


# ---- settings -------------------------------------------------------------------------------------


def defaults(tiny: bool, depth: int = 3) -> dict[str, Any]:
    """Traffic and server settings per scale (each overridable on the command line). ``step_s``:
    the decode step the time budget assumes (``predict_rate_s``); ``startup_s``: a deployment's
    start before one has been measured (the 3-layer H200 run: 18-111 s, symmetric P the slowest)."""
    if tiny:
        return dict(
            rates="4,8",
            num_prompts=8,
            input_len=40,
            output_len=6,
            range_ratio=0.5,
            slo_ttft_ms=3000.0,
            slo_itl_ms=1000.0,
            calib_tokens=10,
            calib_batch=6,
            ladder="1,2",
            ladder_tokens=4,
            kv_cache_gb=0.0625,
            p_step_tokens=2048,
            start_timeout=120.0,
            budget_s=1800.0,
            step_s=0.05,
            startup_s=20.0,
            warmup_prompts=0,
        )
    if depth == 40:  # graphed 40-layer decode ~0.1-0.2 s; a step admitting bounded prefills (eager) ~0.6 s
        return dict(
            rates="0.5,1,2",
            num_prompts=16,
            input_len=2048,
            output_len=32,
            range_ratio=0.5,
            slo_ttft_ms=5000.0,
            slo_itl_ms=600.0,
            calib_tokens=6,
            calib_batch=8,
            ladder="1,2,4,8,16",
            ladder_tokens=24,
            kv_cache_gb=8.0,
            p_step_tokens=16384,
            start_timeout=400.0,
            budget_s=520.0,
            step_s=0.15,
            startup_s=150.0,
            warmup_prompts=4,
        )
    return dict(
        rates="2,4,8",
        num_prompts=32,
        input_len=2048,
        output_len=64,
        range_ratio=0.5,
        slo_ttft_ms=2000.0,
        slo_itl_ms=100.0,
        calib_tokens=24,
        calib_batch=16,
        ladder="1,2,4,8,16",
        ladder_tokens=24,
        kv_cache_gb=8.0,
        p_step_tokens=16384,
        start_timeout=300.0,
        budget_s=520.0,  # a device call is <= 600 s: nothing starts that is predicted to end after this
        step_s=0.05,
        startup_s=120.0,
        warmup_prompts=16,
    )


def reduced_v41():
    """V4.1-Flash widths, 3 layers (bench/p_throughput.py's reduced model), no vision."""
    from bench.p_throughput import reduced_config

    return reduced_config().replace(max_seq_len=1 << 16)


ENGRAM_VOCAB = 200_000  # --depth 40: 4.8M rows per Engram table instead of 384M (2.5 GB, not 203 GB)


def true_depth(base=None, engram_vocab: int = ENGRAM_VOCAB):
    """V4.1-Flash's own layer schedule (default ``v41_flash()``: 40 layers, their compress ratios,
    KV/index sources, candidate pool and Engram layers 1 and 14) at its widths, without draft blocks
    or vision, and with Engram tables of fewer rows: the released 203 GB cannot live in the device
    machine's 128 GiB host memory. A lookup still moves the same bytes (one row per hash head); only
    the hash modulus is smaller."""
    from asympd.config import v41_flash
    from asympd.model.engram_hash import engram_num_embeddings

    base = base or v41_flash()
    cfg = base.replace(
        vision_n_layers=0,
        n_mtp_layers=0,
        compress_ratios=base.compress_ratios[: base.n_layers],
        max_seq_len=1 << 16,
        engram_vocab_size=engram_vocab,
    )
    return cfg.replace(engram_num_embeddings=engram_num_embeddings(cfg))


# ---- the checkpoint ---------------------------------------------------------------------------------


def write_on_device(cfg, out: Path, device: torch.device, seed: int = 0, shared_experts: bool = False) -> Path:
    """``write_checkpoint``'s file set and layout, each shard's tensors drawn on ``device`` in their
    storage formats (drawing 22 GB of FP4 codes on the CPU takes minutes; on a GPU, seconds).
    ``shared_experts``: layer 0's routed experts only, and the marker that makes the loader give
    them to every layer (asympd/model/shared_experts.py; ``--depth 40``)."""
    from asympd.model import checkpoint as ck
    from asympd.model.engram_hash import compressed_token_map
    from asympd.model.schema import checkpoint_schema
    from asympd.model.shared_experts import is_aliased, write_marker
    from asympd.model.tiny_tokenizer import write_tiny_tokenizer
    from asympd.release_config import write_config_files
    from bench.common import random_tensors

    out.mkdir(parents=True, exist_ok=False)
    tok = write_tiny_tokenizer(out / ck.TOKENIZER_FILE, cfg.vocab_size)
    if cfg.engram_layer_ids:  # the hash multipliers derive from the tokenizer's compressed vocabulary
        cfg = cfg.replace(engram_compressed_vocab_size=compressed_token_map(tok)[1])
    write_config_files(cfg, out)
    ck._write_tokenizer_files(out)
    specs = [s for s in checkpoint_schema(cfg) if not (shared_experts and is_aliased(s.name, 0))]
    shards = ck._plan_shards(ck._units(specs), ck.DEFAULT_SHARD_BYTES)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        specs = [s for unit in shard for s in unit]
        names = {s.name for s in specs}
        header, offsets = ck._header(specs)
        tensors = random_tensors(cfg, names.__contains__, device, seed)
        fname = ck._shard_name(i, len(shards))
        with open(out / fname, "wb") as f:
            f.write(header)
            for s in sorted(specs, key=lambda s: offsets[s.name]):
                t = tensors.pop(s.name)
                assert t.shape == s.shape and t.dtype == ck.torch_dtype(s.dtype), s.name
                f.seek(len(header) + offsets[s.name])
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()))
                weight_map[s.name] = fname
                total += s.nbytes
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / ck.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if shared_experts:
        write_marker(out, 0)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the servers need the memory this process cached
    return out


def make_checkpoint(args: argparse.Namespace, work: Path) -> tuple[str, dict[str, Any]]:
    from asympd.config import tiny
    from asympd.model.checkpoint import load_config, write_checkpoint
    from asympd.model.shared_experts import MARKER

    t = time.perf_counter()
    if args.checkpoint:
        path = Path(args.checkpoint)
        how = "given (--checkpoint)"
    elif args.tiny:
        path = write_checkpoint(tiny(), work / "ckpt", seed=0, verbose=False)
        how = "asympd make-checkpoint --config tiny (write_checkpoint)"
    else:
        cfg = true_depth() if args.depth == 40 else reduced_v41()
        path = write_on_device(cfg, work / "ckpt", torch.device("cuda"), shared_experts=args.depth == 40)
        how = "bench/e2e.py write_on_device: released layout, tensors drawn on the GPU"
    args.shared_experts = (path / MARKER).is_file()  # the workers must be told (--benchmark-shared-experts)
    cfg = load_config(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if args.shared_experts:
        storage = "every layer's routed experts are layer 0's, stored and held once (shared_experts.py)"
    else:
        storage = "each layer its own experts (no sharing): true bytes per layer"
    info = {
        "checkpoint": "tiny" if args.tiny else f"v41-flash widths, {'true' if args.depth == 40 else 'reduced'} depth",
        "depth": cfg.n_layers,
        "mtp_layers": cfg.n_mtp_layers,
        "kv_source_layers": list(cfg.kv_source_layers),
        "last_kv_source": cfg.last_kv_source,
        "dim": cfg.dim,
        "n_routed_experts": cfg.n_routed_experts,
        "expert_storage": storage,
        "engram_layers": list(cfg.engram_layer_ids),
        "engram_table_rows": list(cfg.engram_num_embeddings),
        "engram_rows_note": "reduced from ~384M per table (203 GB: more than the host's 128 GiB); same bytes "
        "per lookup, smaller hash modulus"
        if args.depth == 40
        else None,
        "checkpoint_bytes": size,
        "written_by": how,
        "write_s": round(time.perf_counter() - t, 1),
        "model_config": cfg.to_dict(),
    }
    return str(path), info


# ---- deployments ------------------------------------------------------------------------------------


def worker_args(args: argparse.Namespace, role: str, mode: str, ckpt: str) -> list[str]:
    a = ["serve", "--role", role, "--mode", mode, "--checkpoint", ckpt, "--port", "0", "--log-level", "warning"]
    a += ["--kv-cache-bytes", str(int(args.kv_cache_gb * 2**30))]
    if args.gpus:
        a += ["--device", "cuda"]
    else:
        a += ["--threads", "1"]
    if role == "prefill":
        a += ["--max-num-batched-tokens", str(args.p_step_tokens)]
        if args.p_cuda_graph_mode is not None:  # else the worker's default (piecewise prompt steps)
            a += ["--cuda-graph-mode", args.p_cuda_graph_mode]
    else:  # D and colocated: the admission policy under test (default: each role's, serve/admission.py)
        a += ["--admission-policy", args.policy or default_policy(role)]
        if args.gpus and args.len_dist == "uniform":  # graphs at start-up for the contexts the traffic reaches
            longest = math.ceil(args.input_len * (1 + args.range_ratio)) + math.ceil(
                args.output_len * (1 + args.range_ratio)
            )
            a += ["--max-seq-len-to-capture", str(longest)]
    if args.shared_experts:
        a += ["--benchmark-shared-experts"]
    if role == "colocated":
        a += ["--prefill-semantics", args.colocated_semantics]
    return a


def python_path() -> str:
    """The repo first, then whatever the caller had (carried wheels on the device image)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


class Deployment:
    """The processes of one mode: P and D (or colocated workers) and the router."""

    def __init__(self, args: argparse.Namespace, mode: str, ckpt: str, logs: Path):
        from asympd.serve.procs import ServerProcess

        self.mode, self.args = mode, args
        self.env = base = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path()}
        if not args.gpus:
            base["OMP_NUM_THREADS"] = "1"

        def env(gpu: int) -> dict[str, str]:
            return {**base, "CUDA_VISIBLE_DEVICES": str(gpu)} if args.gpus else base

        tag = mode.replace("-", "_")
        if mode == "colocated":
            n = max(1, args.gpus)
            self.placement = {f"colocated{g}": f"gpu {g}" if args.gpus else "cpu" for g in range(n)}
            self.workers = [
                ServerProcess(f"{tag}_colocated{g}", worker_args(args, "colocated", mode, ckpt), logs, env(g))
                for g in range(n)
            ]
            self.roles = ["colocated"] * n
        else:
            p_gpu, d_gpu = (0, 1) if args.gpus >= 2 else (0, 0)
            self.placement = {
                "prefill": f"gpu {p_gpu}" if args.gpus else "cpu",
                "decode": f"gpu {d_gpu}" if args.gpus else "cpu",
            }
            self.workers = [
                ServerProcess(f"{tag}_prefill", worker_args(args, "prefill", mode, ckpt), logs, env(p_gpu)),
                ServerProcess(f"{tag}_decode", worker_args(args, "decode", mode, ckpt), logs, env(d_gpu)),
            ]
            self.roles = ["prefill", "decode"]
        self.logs = logs
        self.router = None
        self.urls: list[str] = []
        self.url = ""

    def start(self) -> float:
        from asympd.serve.procs import ServerProcess, stop_all

        t = time.perf_counter()
        try:
            for w in self.workers:
                w.start()
            self.urls = [w.wait_ready(self.args.start_timeout) for w in self.workers]
            prefill = [u for u, r in zip(self.urls, self.roles, strict=True) if r == "prefill"]
            decode = [u for u, r in zip(self.urls, self.roles, strict=True) if r != "prefill"]
            ra = ["router", "--decode", *decode, "--port", "0", "--log-level", "warning", "--health-interval", "0.3"]
            if prefill:
                ra += ["--prefill", *prefill]
            ra += ["--prefill-timeout", "600", "--stream-idle-timeout", "600"]
            self.router = ServerProcess(f"{self.mode.replace('-', '_')}_router", ra, self.logs, self.env)
            self.router.start()
            self.url = self.router.wait_ready(60.0)
            wait_healthy(self.url)
        except BaseException:
            stop_all([*self.workers, *([self.router] if self.router else [])])
            raise
        return time.perf_counter() - t

    def stop(self) -> None:
        from asympd.serve.procs import stop_all

        stop_all([*self.workers, *([self.router] if self.router else [])])

    def log_warnings(self, n: int = 50) -> dict[str, list[str]]:
        """Each process's last ``n`` WARNING and ERROR lines."""
        out = {}
        for w in [*self.workers, *([self.router] if self.router else [])]:
            lines = w.log_tail(100_000).splitlines()
            out[w.name] = [line for line in lines if " WARNING " in line or " ERROR " in line][-n:]
        return out

    def log_tails(self) -> dict[str, str]:
        return {w.name: w.log_tail(15) for w in [*self.workers, *([self.router] if self.router else [])]}


def wait_healthy(url: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            body = httpx.get(f"{url}/health", timeout=5).json()
            if body.get("all_healthy") and body.get("tokenizer"):
                return
            last = body
        except (httpx.HTTPError, ValueError) as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"router {url} not healthy after {timeout} s: {last!r}")


def scrape(url: str) -> dict[str, float]:
    """Every sample of a worker's /metrics, summed over labels by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def worker_info(url: str) -> dict[str, Any]:
    info = httpx.get(f"{url}/asympd/info", timeout=30).json()
    keep = (
        "role",
        "mode",
        "prefill_semantics",
        "device",
        "dtype",
        "transport",
        "resident_bytes",
        "memory",
        "warm_up",
        "admission",
    )
    return {k: info.get(k) for k in keep}


# ---- calibration --------------------------------------------------------------------------------------


async def _one(
    client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int, on_first: Callable[[], None] | None = None
) -> dict[str, Any]:
    """One streamed completion: client TTFT and per-chunk gaps, the server's timings and usage;
    ``on_first()`` when its first token arrives."""
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,  # every step's token comes as its own chunk
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first, last, gaps, timings, usage = None, None, [], {}, {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"calibration request: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"calibration request failed: {ev['error']}")
            now = time.perf_counter()
            for c in ev.get("choices") or []:
                n = len(c.get("token_ids") or [])
                if not n:
                    continue
                if first is None:
                    first = now - t0
                    if on_first is not None:
                        on_first()
                else:
                    gaps.append(now - last)
                last = now
            timings = ev.get("asympd_timings") or timings
            usage = ev.get("usage") or usage
    return {"prompt_len": len(ids), "ttft_s": first, "gaps_s": gaps, "timings": timings, "usage": usage}


def calibrate(url: str, lengths: list[int], tokens: int, batch: int, vocab: int, seed: int) -> dict[str, Any]:
    """Lone requests at each length (three each: the fits take medians), then ``batch`` requests
    at once at the shortest length."""
    import numpy as np

    rng = np.random.default_rng(seed + 1000)

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, size=n).tolist()

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
            # warm-up: the first CUDA calls and Triton compilations of these shapes stay out of the fits
            for n in lengths:
                await _one(client, url, ids(n), 2)
            await asyncio.gather(*(_one(client, url, ids(lengths[0]), 2) for _ in range(batch)))
            lone = []
            for n in lengths:
                for _ in range(3):
                    lone.append(await _one(client, url, ids(n), tokens))
            together = await asyncio.gather(*(_one(client, url, ids(lengths[0]), tokens) for _ in range(batch)))
        return {"lone": lone, "batch": {"size": batch, "requests": list(together)}}

    return asyncio.run(go())


# the ladder's prompts are at most this long: its requests decode while P admits the others, so its
# cost grows with P's time per prompt (at 6K-token prompts a size of 16 would decode ~1000 tokens)
LADDER_MAX_PROMPT = 2048


def ladder_tokens(tokens: int, size: int, lone: list[dict[str, Any]], length: int) -> int:
    """Output tokens for each of ``size`` requests sent at once, so that all of them decode together
    for about ``tokens`` steps: the first admitted keeps decoding while P computes the other
    ``size - 1`` prompts, each about the lone TTFT at ``length`` (``lone``: the calibration's lone
    requests, at the nearest length measured, scaled to ``length``), doubled as P shares the GPU with
    D's decodes, a step each lone gap. headline4 sent 24 tokens to every size and logged no step of
    8 or 16 decodes in 3 of its 5 modes: the first requests had finished before the last were
    admitted."""
    timed = [r for r in lone if r.get("ttft_s")]
    gaps = [g for r in lone for g in r["gaps_s"][1:]]
    if size <= 1 or not timed or not gaps or statistics.median(gaps) <= 0:
        return tokens
    near = min({r["prompt_len"] for r in timed}, key=lambda n: abs(n - length))
    ttft = statistics.median(r["ttft_s"] for r in timed if r["prompt_len"] == near) * length / near
    return tokens + math.ceil(2 * (size - 1) * ttft / statistics.median(gaps))


def decode_ladder(
    url: str,
    workers: dict[str, str],
    length: int,
    sizes: list[int],
    tokens: int,
    vocab: int,
    seed: int,
    lone: list[dict[str, Any]] | None = None,
    rounds: int = 2,
) -> dict[str, Any]:
    """D's decode steps at each of ``sizes`` requests decoding together: ``b`` requests of
    ``length`` tokens sent at once, ``ladder_tokens`` output tokens each (from ``tokens`` and the
    calibration's ``lone`` requests), then D's step log read for its
    steps of exactly ``b`` decodes and no prompt row, P's steps covering less than ``ALONE_P`` of
    each (``workers``: role -> worker URL). Why: on a GPU a decode step replays the CUDA graph of
    its padded batch, and over the depth-40 runs its time went up in steps of that size and
    flattened past 8, where the planner's line, fitted to the calibration batch at 3-6 requests,
    over-predicted at 7-12 requests (median 1.12x; docs/planner.md, "The GPU-held P fit out of
    sample"). asympd.plan.validate prices a GPU result's decode steps from these medians.
    ``rounds``: the sizes are run that many times, ascending then descending, and each size's median
    is taken over all its steps: one block of a size's steps read up to 5 ms off another run's
    (v14 against v15, the same traffic: 34.0 against 37.9 ms at 4 decodes, tools/fit_swap.py), and
    that one entry moved a validated ITL p50 by 12 %; ``step_ms_by_round`` shows a shifted block."""
    import numpy as np

    rng = np.random.default_rng(seed + 3000)
    spans: list[tuple[int, int, float, float]] = []  # (round, size, start, end)
    outputs = {b: ladder_tokens(tokens, b, lone or [], length) for b in sizes}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
            for r in range(rounds):
                for b in sizes if r % 2 == 0 else sizes[::-1]:
                    t0 = time.time()
                    ids = [rng.integers(3, vocab, size=length).tolist() for _ in range(b)]
                    await asyncio.gather(*(_one(client, url, x, outputs[b]) for x in ids))
                    spans.append((r, b, t0, time.time()))

    since = time.time()
    asyncio.run(go())
    d_steps = fetch_steps(workers.get("decode") or workers["colocated"], since)
    p_steps = fetch_steps(workers["prefill"], since) if "prefill" in workers else []
    steps: dict[str, list[float]] = {str(b): [] for b in sizes}
    by_round: dict[str, list[float | None]] = {str(b): [] for b in sizes}
    for _r, b, t0, t1 in spans:
        mine = [s for s in d_steps if t0 <= s[0] < t1 and s[2] == 0 and s[3] == b]
        block = [s[1] * 1e3 for s in mine if _overlap(s, p_steps) < ALONE_P]
        steps[str(b)] += block
        by_round[str(b)].append(statistics.median(block) if block else None)
    return {
        "prompt_len": length,
        "tokens": tokens,
        "rounds": rounds,
        "tokens_by_size": {str(b): n for b, n in outputs.items()},
        "step_ms": {b: statistics.median(ms) if ms else None for b, ms in steps.items()},
        "step_ms_by_round": by_round,
        "steps_ms": steps,
    }


# ---- co-run: P's and D's steps beside each other ---------------------------------------------------------


# BESIDE, ALONE_P and _overlap live in the planner (asympd/plan/step_log.py), which reads P's alone
# steps by the same rule
def _stretch(dt: float, alone: float, f: float) -> float | None:
    """The slowdown ``s`` of a step while it shared the GPU, as the simulator shares it: the step
    took ``dt``, ran beside the other process for the fraction ``f`` of it at 1/s of its alone
    speed and alone for the rest, and costs ``alone`` by itself: alone = dt(1-f) + dt f / s."""
    left = alone - dt * (1.0 - f)
    return dt * f / left if left > 0 else None


def co_run_stretch(
    mine: list[list], other: list[list], key: Callable[[list], Any], between: bool = False, alone_below: float = 0.0
) -> dict[str, Any]:
    """How much slower this process's steps ran beside the other process's steps than alone.

    ``mine``/``other``: step logs ([wall start, seconds, prompt rows, decode sequences], from
    ``/asympd/steps``); ``key``: which steps are alike (P: the prompt rows; D: the batch of a
    decode-only step; None: not compared). A step is alone when no step of the other process
    overlaps it (or covers less than ``alone_below`` of it), beside when they cover at least
    ``BESIDE`` of it; each beside step's stretch is
    read against the median alone step of the same key (``_stretch``). ``between`` (numeric keys:
    P's rows): a beside key with no alone step is read against the line between the nearest alone
    keys below and above it (a burst's steps need not split the same way twice). ``stretch``: the
    median over all pairs, None without one; ``stretch_by_key``: the median per key (P: per step
    size, what the validation interpolates over rows)."""
    alone: dict[Any, list[float]] = {}
    beside: list[tuple[Any, float, float]] = []
    for s in mine:
        k = key(s)
        if k is None:
            continue
        f = _overlap(s, other)
        if f == 0.0 or f < alone_below:
            alone.setdefault(k, []).append(s[1])
        elif f >= BESIDE:
            beside.append((k, s[1], f))
    ref = {k: statistics.median(v) for k, v in alone.items()}

    def alone_s(k: Any) -> float | None:
        if k in ref:
            return ref[k]
        lo = max((j for j in ref if j < k), default=None) if between else None
        hi = min((j for j in ref if j > k), default=None) if between else None
        if lo is None or hi is None:
            return None
        return ref[lo] + (ref[hi] - ref[lo]) * (k - lo) / (hi - lo)

    ratios: dict[Any, list[float]] = {}
    for k, dt, f in beside:
        a = alone_s(k)
        r = _stretch(dt, a, f) if a is not None else None
        if r is not None:
            ratios.setdefault(k, []).append(r)
    keys = sorted(ratios)
    every = [r for v in ratios.values() for r in v]
    return {
        "stretch": statistics.median(every) if every else None,
        "steps_beside": len(every),
        "steps_alone": sum(len(v) for v in alone.values()),
        "keys": keys,
        "stretch_by_key": {str(k): statistics.median(ratios[k]) for k in keys},
        # per key, for reading: the median step alone and beside (seconds), and how much of it was covered
        "by_key": {
            str(k): {
                "alone_s": alone_s(k),
                "beside_s": statistics.median([dt for j, dt, _ in beside if j == k]),
                "covered": statistics.median([f for j, _, f in beside if j == k]),
            }
            for k in keys
        },
    }


def p_key(s: list) -> int | None:
    """P's steps are alike at the same prompt rows."""
    return s[2] if s[2] > 0 else None


def d_key(s: list) -> int | None:
    """D's decode-only steps are alike at the same batch (a step with prompt rows is not compared)."""
    return s[3] if s[2] == 0 and s[3] > 0 else None


def fill_lengths(rng: Any, rows: int, mean: int, dist: str, ratio: float) -> list[int]:
    """Prompt lengths from the traffic's distribution that sum to ``rows`` tokens exactly (the last
    one cut to fit; P computes each less what its mode leaves to D): sent at once, they make P run
    steps of its whole ``--p-step-tokens`` budget, as several queued prompts do under load."""
    from asympd.bench.serve_load import sample_lengths

    out: list[int] = []
    while sum(out) < rows:
        out += sample_lengths(rng, 1, mean, dist, ratio)
    out[-1] -= sum(out) - rows
    return out


def load_decoders(rate: float, output_len: int, step_s: float | Callable[[int], float], most: int) -> int:
    """The decode batch a rate keeps in flight (Little's law): ``rate`` x a request's life on D
    (``output_len`` steps of ``step_s``), at least 1, at most ``most``. ``step_s`` may be the step
    time at a batch size (``measured_step``): then the batch is the fixed point n = ceil(rate x
    output_len x step(n)), found from n = 1 upwards (a step grows with its batch)."""
    if not callable(step_s):
        return max(1, min(most, math.ceil(rate * output_len * step_s)))
    n = 1
    for _ in range(most):
        m = load_decoders(rate, output_len, step_s(n), most)
        if m <= n:
            return n
        n = m
    return n


def _steady_gaps(requests: list[dict[str, Any]]) -> list[float]:
    """The gaps of requests sent together that start once every one of them has its first token:
    D then decodes the whole batch, with no admission of theirs between its steps (earlier gaps
    hold the later requests' bounded prefills). All gaps but each first one if none start so late."""
    firsts = [r["ttft_s"] for r in requests if r.get("ttft_s") is not None]
    if not firsts:
        return []
    steady, start = [], max(firsts)
    for r in requests:
        t = r.get("ttft_s") or 0.0
        for g in r.get("gaps_s") or []:
            if t >= start:
                steady.append(g)
            t += g
    return steady or [g for r in requests for g in (r.get("gaps_s") or [])[1:]]


def measured_step(cal: dict[str, Any]) -> Callable[[int], float] | None:
    """D's decode step at a batch of n, from the calibration's token gaps (the first gap of each
    request left out: it can hold the request's own admission): the lone requests' median at 1,
    the batch's median at its size once all of it decodes (``_steady_gaps``), linear between and
    beyond. None without gaps. The co-run's decode batch comes from this, not from ``--step-s``
    (the time budget's conservative guess: at true depth 0.15 s where the calibration measures
    ~0.04 s, which sized the co-run's batch at 8 where the rates keep 1-4 decoding)."""
    lone = [g for r in cal.get("lone", []) for g in (r.get("gaps_s") or [])[1:]]
    if not lone:
        return None
    s1 = statistics.median(lone)
    batch = cal.get("batch", {})
    size = batch.get("size", 1)
    together = _steady_gaps(batch.get("requests", []))
    slope = (statistics.median(together) - s1) / (size - 1) if together and size > 1 else 0.0
    return lambda n: s1 + max(0.0, slope) * (n - 1)


def co_run(
    url: str,
    workers: dict[str, str],
    length: int,
    prompts: int,
    decoders: int,
    tokens: int,
    vocab: int,
    seed: int,
    fill: tuple[list[int], int] | None = None,
    mid: list[int] | None = None,
) -> dict[str, Any]:
    """P's steps and D's steps alone and beside each other, on the same servers.

    ``prompts`` requests of ``length`` tokens one after another (P's steps alone: D has nothing
    to decode while P computes), then ``decoders`` requests of ``tokens`` output tokens and, once
    all of them decode, the same number of prompts again (P's steps beside D's decoding, D's
    decode steps beside P's steps and alone between them); the decoders are cancelled when the
    prompts are done. ``fill`` (lengths, decoders): then the load's step sizes: those prompts sent
    at once (P's full-budget steps alone), the decoders (the batch the rates keep in flight) and,
    once all decode, the same lengths at once again. ``mid`` (lengths, with ``fill``): first those
    prompts at once, alone: P steps of a few thousand rows between the lone prompts' and the full
    budget's, where the 2 req/s runs' steps were and P's line had no point (docs/planner.md, "v8 and
    v9"; the record's ``fill`` ``mid``). ``workers``: role -> worker URL (``prefill``
    and ``decode``). Why: P and D on one GPU without MPS are time-sliced by the driver, and what
    each loses beside the other is measured here, not assumed (asympd.plan.validate reads
    ``p``/``d`` ``stretch``, and P's ``stretch_by_key`` over rows)."""
    import numpy as np

    rng = np.random.default_rng(seed + 2000)

    def ids(n: int = length) -> list[int]:
        return rng.integers(3, vocab, size=n).tolist()

    async def beside(client: httpx.AsyncClient, n: int, send: Callable[[], Any]) -> tuple[int, list[str]]:
        """``n`` decoders started; once all of them decode, ``send()``; then they are cancelled."""
        started = asyncio.Event()
        seen = [0]

        def first() -> None:
            seen[0] += 1
            if seen[0] == n:
                started.set()

        busy = [asyncio.ensure_future(_one(client, url, ids(), tokens, first)) for _ in range(n)]
        await asyncio.wait([asyncio.ensure_future(started.wait()), *busy], return_when=asyncio.FIRST_COMPLETED)
        await send()
        still = sum(not b.done() for b in busy)
        for b in busy:
            b.cancel()
        ends = await asyncio.gather(*busy, return_exceptions=True)
        return still, [repr(e)[:300] for e in ends if isinstance(e, Exception)]  # (a cancel is no Exception)

    async def go() -> tuple[float, int, list[str], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:

            async def one_by_one() -> None:
                for _ in range(prompts):
                    await _one(client, url, ids(), 2)

            await one_by_one()
            t_mid = time.time()
            still, failed = await beside(client, decoders, one_by_one)
            load: dict[str, Any] = {}
            if fill is not None:
                lengths, n = fill

                timed: dict[str, list[dict[str, Any]]] = {"alone": [], "beside": []}

                def burst(phase: str) -> Callable[[], Any]:
                    async def send() -> None:  # the servers' timings of each request (its hand-off beside P)
                        done = await asyncio.gather(*(_one(client, url, ids(k), 2) for k in lengths))
                        timed[phase] = [r["timings"] for r in done]

                    return send

                await asyncio.sleep(0.2)  # the cancelled decoders' aborts reach D: P's burst runs alone
                load = {}
                if mid:
                    load["mid"] = {"prompt_lens": mid, "rows": sum(mid), "t": time.time()}
                    await asyncio.gather(*(_one(client, url, ids(k), 2) for k in mid))
                load |= {"prompt_lens": lengths, "rows": sum(lengths), "decoders": n, "t_alone": time.time()}
                await burst("alone")()
                load["t_beside"] = time.time()
                load["decoders_running_at_end"], load["decoders_failed"] = await beside(client, n, burst("beside"))
                load["timings"] = timed
            return t_mid, still, failed, load

    t0 = time.time()
    t_mid, still, failed, load = asyncio.run(go())
    time.sleep(0.2)  # the cancelled requests' aborts reach D
    p_steps, d_steps = fetch_steps(workers["prefill"], t0), fetch_steps(workers["decode"], t0)
    return {
        "prompt_len": length,
        "prompts": prompts,
        "decoders": decoders,
        "decode_tokens": tokens,
        "decoders_running_at_end": still,  # fewer than ``decoders``: D stopped decoding before the prompts ended
        "decoders_failed": failed,
        "t_mid": t_mid,
        **({"fill": load} if load else {}),
        "p": co_run_stretch(p_steps, d_steps, p_key, between=True, alone_below=ALONE_P),
        "d": co_run_stretch([s for s in d_steps if s[0] >= t_mid], p_steps, d_key),
        "steps": {"prefill": p_steps, "decode": d_steps},
    }


# ---- one load run ---------------------------------------------------------------------------------------


def bench_serve(args: argparse.Namespace, url: str, ckpt: str, rate: float, path: Path, label: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asympd.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--tokenizer",
        ckpt,
        "--num-prompts",
        str(args.num_prompts),
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-range-ratio",
        str(args.range_ratio),
        "--random-len-dist",
        args.len_dist,
        "--request-rate",
        str(rate),
        "--goodput",
        f"ttft:{args.slo_ttft_ms:g}",
        f"itl:{args.slo_itl_ms:g}",
        "--ignore-eos",
        "--extra-body",
        '{"return_token_ids": true}',  # one chunk per token: ITL is per engine step, never two merged
        "--seed",
        str(args.seed),
        "--result-file",
        str(path),
        "--label",
        label,
        "--disable-tqdm",
        "--no-test-request",  # the servers' work a run counts is the schedule's alone
    ]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    env = {**os.environ, "PYTHONPATH": python_path()}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    if not path.is_file():
        raise RuntimeError(f"asympd bench serve wrote no result (exit {p.returncode}): {p.stderr[-1500:]}")
    res = json.loads(path.read_text())
    res["bench_exit_status"] = p.returncode
    res["bench_command"] = " ".join(cmd[3:]).replace(sys.executable, "python")
    return res


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def run_rate(args, dep: Deployment, ckpt: str, rate: float, work: Path) -> dict[str, Any]:
    before = [scrape(u) for u in dep.urls]
    res = bench_serve(args, dep.url, ckpt, rate, work / f"{dep.mode}_{rate:g}.json", f"{dep.mode}@{rate:g}")
    after = [scrape(u) for u in dep.urls]
    out: dict[str, Any] = {"request_rate": rate, "bench_exit_status": res["bench_exit_status"]}
    out.update({k: res.get(k) for k in SUMMARY_FIELDS})
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            out[f"{stat}_{metric}_ms"] = res.get(f"{stat}_{metric}_ms")
    dur = res["duration"] or float("nan")

    def moved(name: str, role: str | None = None) -> float:
        """How much a counter rose over the run, summed over the workers of ``role`` (None: all)."""
        return sum(
            a.get(name, 0.0) - b.get(name, 0.0)
            for b, a, r in zip(before, after, dep.roles, strict=True)
            if role is None or r == role
        )

    p_side = "prefill" if "prefill" in dep.roles else "colocated"
    out["prompt_tokens_per_s"] = res["total_input_tokens"] / dur
    out["p_prompt_rows_computed"] = moved("asympd_prompt_tokens_total", p_side)
    out["p_prompt_rows_per_s"] = out["p_prompt_rows_computed"] / dur
    out["p_prompt_rows_per_gpu_s"] = out["p_prompt_rows_per_s"] / dep.roles.count(p_side)
    if p_side == "prefill":
        out["d_prompt_rows_computed"] = moved("asympd_prompt_tokens_total", "decode")
    n_tr = moved("asympd_transfers_total", "decode")
    out["transfers"] = n_tr
    out["transfer_bytes_total"] = moved("asympd_transfer_bytes_total", "decode")
    out["transfer_bytes_per_request"] = out["transfer_bytes_total"] / n_tr if n_tr else 0.0
    out["transfer_s_per_request"] = moved("asympd_transfer_seconds_total", "decode") / n_tr if n_tr else 0.0
    out["preemptions"] = moved("asympd_num_preemptions_total")
    # serving steps that compiled a kernel or captured a graph (a stall each), by role; None from
    # workers that do not report it
    if all("asympd_engine_steps_new_shape_total" in a for a in after):
        out["new_shape_steps"] = {r: moved("asympd_engine_steps_new_shape_total", r) for r in sorted(set(dep.roles))}
    # busy time: the sum of engine step durations on the host (what the planner's step times are),
    # and the wall time with a step in flight on the host or the GPU (asympd/serve/busy.py), which
    # counts the GPU work a P step leaves queued; prompt tokens per second of P's compute use the
    # second where the workers report it (results before it have the host time only)
    gpu_counted = all("asympd_engine_busy_seconds_total" in a for a in after)
    for role in sorted(set(dep.roles)):
        busy = moved("asympd_engine_step_seconds_sum", role)
        out[f"{role}_busy_s"] = busy
        out[f"{role}_busy_fraction"] = busy / dur / dep.roles.count(role)
        if gpu_counted:
            out[f"{role}_busy_with_gpu_s"] = moved("asympd_engine_busy_seconds_total", role)
    p_busy = out[f"{p_side}_busy_with_gpu_s" if gpu_counted else f"{p_side}_busy_s"]
    out["p_busy_basis"] = "host and gpu" if gpu_counted else "host steps"
    out["prompt_tokens_per_p_busy_s"] = res["total_input_tokens"] / p_busy if p_busy else None
    gpus = max(1, args.gpus) if args.gpus else 1
    out["gpus"] = gpus
    out["request_goodput_per_gpu"] = (res.get("request_goodput") or 0.0) / gpus
    out["output_throughput_per_gpu"] = res["output_throughput"] / gpus
    out["requests"] = {k: res.get(k) for k in PER_REQUEST}
    out["timeline"] = timeline(dep, res.get("start_wall"))
    out["bench_command"] = res["bench_command"]
    return out


def timeline(dep: Deployment, start_wall: float | None) -> dict[str, Any] | None:
    """Every worker's engine steps during the run ([start, seconds, prompt rows, decode sequences,
    seconds to the GPU end], start relative to the requests' ``start_times`` zero), so a planner
    miss can be read request by request against what P and D were doing (the hand-off beside P's
    steps: docs/planner.md)."""
    if start_wall is None:
        return None
    steps = {}
    for url, role in zip(dep.urls, dep.roles, strict=True):
        got = fetch_steps(url, start_wall - 1.0)
        steps.setdefault(role, []).append([[s[0] - start_wall, *s[1:]] for s in got])
    return {"start_wall": start_wall, "steps": steps}


def fetch_steps(url: str, since: float, settle_s: float = 2.0) -> list[list[float]]:
    """A worker's step log from wall time ``since``, once every step has its seconds to its GPU
    end (a fifth field: a P step's GPU work can outlast its host step by ~0.1 s,
    asympd/serve/busy.py), or after ``settle_s``, whichever comes first."""
    deadline = time.time() + settle_s
    while True:
        got = httpx.get(f"{url}/asympd/steps", params={"since": since}, timeout=30).json()["steps"]
        if all(len(s) > 4 for s in got) or time.time() > deadline:
            return got
        time.sleep(0.05)


def predict_rate_s(args: argparse.Namespace, rate: float) -> float:
    """Seconds one rate takes: the arrivals, then the last request's output at ``step_s`` a step
    (1.5x: batching), plus the /metrics scrapes and the load generator's start."""
    return args.num_prompts / rate + 1.5 * args.output_len * args.step_s + 4.0


def predict_mode_s(args: argparse.Namespace, seen: list[dict[str, Any]]) -> float:
    """Seconds one more mode takes: the slowest start and calibration measured so far (or the
    scale's guess), plus every rate."""
    startup = max([m["startup_s"] for m in seen if "startup_s" in m] or [args.startup_s])
    cals = [m["calibration"] for m in seen if "calibration" in m]
    calib = max([c["wall_s"] + c.get("co_run", {}).get("wall_s", 0.0) for c in cals] or [15.0])  # co-run after it
    warm = max([m["warmup"]["wall_s"] for m in seen if "warmup" in m] or [15.0 if args.warmup_prompts else 0.0])
    return startup + calib + warm + sum(predict_rate_s(args, r) for r in args.rate_list)


def _fill_rows(args: argparse.Namespace) -> int:
    """The co-run fill's rows a burst step (``--co-run-fill-rows``, default P's step budget)."""
    return args.p_step_tokens if args.co_run_fill_rows is None else args.co_run_fill_rows


def _burst_lengths(args: argparse.Namespace, rows: int, salt: int) -> list[int]:
    """Prompt lengths of the traffic's distribution filling twice ``rows`` (P's first step takes the
    prompts that arrived first, its second the rest), from a generator of their own (``salt``)."""
    import numpy as np

    rng = np.random.default_rng(args.seed + salt)
    return fill_lengths(rng, 2 * rows, args.input_len, args.len_dist, args.range_ratio)


def co_run_mid(args: argparse.Namespace) -> list[int] | None:
    """The co-run's mid-size burst: prompt lengths filling twice ``--co-run-mid-rows`` (default: a
    quarter of P's step budget); None when it or the fill is off."""
    rows = args.p_step_tokens // 4 if args.co_run_mid_rows is None else args.co_run_mid_rows
    if rows <= 0 or _fill_rows(args) <= 0:
        return None
    return _burst_lengths(args, rows, 4000)


def co_run_fill(args: argparse.Namespace, step: Callable[[int], float] | None = None) -> tuple[list[int], int] | None:
    """The co-run's fill phase from the traffic: prompt lengths filling twice ``--co-run-fill-rows``
    (default: P's step budget: the burst's first step holds the prompts that arrived first, its
    second one a whole budget) and the decode batch the highest rate keeps in flight
    (``load_decoders`` at the calibration's measured decode ``step``, else at ``--step-s``; at most
    ``--co-run-max-decoders``); None when off."""
    rows = _fill_rows(args)
    if rows <= 0:
        return None
    lengths = _burst_lengths(args, rows, 3000)
    return lengths, load_decoders(max(args.rate_list), args.output_len, step or args.step_s, args.co_run_max_decoders)


def run_mode(args, mode: str, ckpt: str, vocab: int, work: Path, out: dict[str, Any], save) -> None:
    """One deployment into ``out``: start, calibrate, each rate (``save()`` after each), stop."""
    dep = Deployment(args, mode, ckpt, work)
    out["placement"] = dep.placement
    t_mode = time.perf_counter()
    try:
        out["startup_s"] = round(dep.start(), 1)
        out["workers"] = {w.name: worker_info(u) for w, u in zip(dep.workers, dep.urls, strict=True)}
        out["worker_commands"] = {w.name: " ".join(["asympd", *w.argv[3:]]) for w in dep.workers}
        lo = max(1, math.floor(args.input_len * (1 - args.range_ratio)))
        hi = math.ceil(args.input_len * (1 + args.range_ratio))
        t = time.perf_counter()
        out["calibration"] = calibrate(dep.url, sorted({lo, hi}), args.calib_tokens, args.calib_batch, vocab, args.seed)
        urls = dict(zip(dep.roles, dep.urls, strict=True))
        sizes = [int(b) for b in args.ladder.split(",") if b.strip()]
        if sizes and args.ladder_tokens:
            out["calibration"]["ladder"] = ladder = decode_ladder(
                dep.url,
                urls,
                min(lo, LADDER_MAX_PROMPT),
                sizes,
                args.ladder_tokens,
                vocab,
                args.seed,
                out["calibration"]["lone"],
                args.ladder_rounds,
            )
            log(f"{mode} decode ladder (ms): " + ", ".join(f"{b}: {v:.1f}" for b, v in ladder["step_ms"].items() if v))
        out["calibration"]["wall_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        if args.co_run_prompts and {"prefill", "decode"} <= urls.keys():
            step = measured_step(out["calibration"])
            fill = co_run_fill(args, step)
            out["calibration"]["co_run"] = co_run(
                dep.url,
                urls,
                lo,
                args.co_run_prompts,
                args.co_run_decoders,
                args.co_run_tokens,
                vocab,
                args.seed,
                fill,
                co_run_mid(args),
            )
            out["calibration"]["co_run"]["wall_s"] = round(time.perf_counter() - t, 1)
            c = out["calibration"]["co_run"]
            if fill is not None and step is not None:  # the decode step the fill's batch was sized at
                c["fill"]["decode_step_s"] = step(fill[1])
            by_rows = ", ".join(f"{k} rows {v:.2f}" for k, v in c["p"]["stretch_by_key"].items())
            log(
                f"{mode} co-run: P stretch {c['p']['stretch']} ({c['p']['steps_beside']} steps: {by_rows}), "
                f"D stretch {c['d']['stretch']} ({c['d']['steps_beside']} steps), {c['wall_s']} s"
            )
        elif args.co_run_prompts:  # colocated: one engine in one process, its P and D steps never overlap
            out["calibration"]["co_run"] = {"skipped": "one process: its prompt and decode steps never run at once"}
        if args.warmup_prompts:
            # one discarded run at the highest rate with other prompts (no prefix-cache hits later):
            # Triton compiles and the CUDA-graph captures of the batch sizes it meets happen here,
            # not in the first mode's measurements (the compile cache then serves the later modes)
            t = time.perf_counter()
            warm = argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_prompts, "seed": args.seed + 1000})
            res = bench_serve(warm, dep.url, ckpt, max(args.rate_list), work / f"{mode}_warmup.json", f"{mode}@warmup")
            out["warmup"] = {"prompts": args.warmup_prompts, "wall_s": round(time.perf_counter() - t, 1)}
            out["warmup"]["median_ttft_ms"] = res.get("median_ttft_ms")
        out["runs"] = []
        for rate in args.rate_list:
            if time.time() + predict_rate_s(args, rate) > args.deadline:
                out.setdefault("skipped_rates", []).append(rate)
                log(f"{mode} @ {rate:g} req/s: skipped (predicted {predict_rate_s(args, rate):.0f} s, past --budget-s)")
                continue
            t_rate = time.perf_counter()
            r = run_rate(args, dep, ckpt, rate, work)
            r["wall_s"] = round(time.perf_counter() - t_rate, 1)
            r["predicted_wall_s"] = round(predict_rate_s(args, rate), 1)
            out["runs"].append(r)
            save()
            log(
                f"{mode} @ {rate:g} req/s: {r['completed']} done, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                f"ITL p50 {r['median_itl_ms']:.1f} ms, goodput {r['request_goodput']:.2f} req/s, "
                f"{r['transfer_bytes_per_request'] / 1e3:.0f} kB moved per request"
                + "".join(
                    f", {n:g} {who} steps met a new shape" for who, n in r.get("new_shape_steps", {}).items() if n
                )
            )
        # each worker's CUDA graph counters once the mode is done (``workers`` holds them at start-up,
        # before any step): whether its steps replayed graphs under load, e.g. a symmetric P's windows
        out["graphs_after"] = {
            w.name: (worker_info(u).get("memory") or {}).get("cuda_graphs")
            for w, u in zip(dep.workers, dep.urls, strict=True)
        }
    except Exception:
        out["error"] = traceback.format_exc(limit=8)
        out["logs"] = dep.log_tails()
        log(f"{mode} failed:\n{out['error']}")
    finally:
        out["log_warnings"] = dep.log_warnings()  # slow engine steps among them (asympd.serve.async_engine)
        dep.stop()
        out["wall_s"] = round(time.perf_counter() - t_mode, 1)
        rates = ", ".join(f"{r['request_rate']:g}: {r['wall_s']:.0f} s" for r in out.get("runs", []))
        log(
            f"{mode}: {out['wall_s']:.0f} s wall (startup {out.get('startup_s', '-')} s, calibration "
            f"{out.get('calibration', {}).get('wall_s', '-')} s, rates {rates or '-'})"
        )


# ---- main -------------------------------------------------------------------------------------------------


def headline(modes: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per mode and rate: the numbers a table needs."""
    rows = []
    for mode, m in modes.items():
        for r in m.get("runs", []):
            rows.append(
                {
                    "mode": mode,
                    "rate": r["request_rate"],
                    "ttft_p50_ms": r["median_ttft_ms"],
                    "ttft_p99_ms": r["p99_ttft_ms"],
                    "itl_p50_ms": r["median_itl_ms"],
                    "itl_p99_ms": r["p99_itl_ms"],
                    "tpot_p50_ms": r["median_tpot_ms"],
                    "goodput_req_per_s_per_gpu": r["request_goodput_per_gpu"],
                    "p_prompt_rows_per_gpu_s": r["p_prompt_rows_per_gpu_s"],
                    "prompt_tokens_per_p_busy_s": r["prompt_tokens_per_p_busy_s"],
                    "transfer_bytes_per_request": r["transfer_bytes_per_request"],
                }
            )
    return rows


RATIO_KEYS = ("prompt_tokens_per_p_busy_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
              "goodput_req_per_s_per_gpu")  # fmt: skip


def ratios(rows: list[dict[str, Any]], base: str = "symmetric-split") -> list[dict[str, Any]]:
    """Asymmetric / ``base`` (the strongest symmetric baseline) per rate, measured in the same run."""
    by = {(r["mode"], r["rate"]): r for r in rows}
    out = []
    for (mode, rate), a in sorted(by.items()):
        b = by.get((base, rate))
        if mode != "asymmetric" or b is None:
            continue
        q = {k: a[k] / b[k] if a.get(k) and b.get(k) else None for k in RATIO_KEYS}
        out.append({"rate": rate, "over": base, **q})
    return out


LOWER_IS_BETTER = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def over_strongest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Asymmetric / the strongest symmetric baseline, per rate and metric: the best value either
    symmetric variant reached at that rate (lowest latency, highest throughput), and which one it was.
    The most favourable comparison for the baseline, so a ratio that still favours asymmetric holds
    against both. A rate without asymmetric or without any symmetric run has no row."""
    by = {(r["mode"], r["rate"]): r for r in rows}
    out = []
    for rate in sorted({r["rate"] for r in rows if r["mode"] == "asymmetric"}):
        a = by[("asymmetric", rate)]
        base = [by[(m, rate)] for m in SYMMETRIC if (m, rate) in by]
        if not base:
            continue
        row: dict[str, Any] = {"rate": rate, "baselines": [b["mode"] for b in base]}
        for k in RATIO_KEYS:
            vals = [b for b in base if b.get(k)]
            if not vals or not a.get(k):
                row[k], row[f"{k}_over"] = None, None
                continue
            best = (min if k in LOWER_IS_BETTER else max)(vals, key=lambda b: b[k])
            row[k], row[f"{k}_over"] = a[k] / best[k], best["mode"]
        out.append(row)
    return out


def summarize(data: dict[str, Any]) -> None:
    """The per-rate table and both ratio tables, recomputed from ``data["modes"]``."""
    data["headline"] = headline(data["modes"])
    data["asymmetric_over_symmetric_split"] = ratios(data["headline"])
    data["asymmetric_over_strongest_symmetric"] = over_strongest(data["headline"])


# ---- merging parts ----------------------------------------------------------------------------------------

# what must agree for parts to be one study (the model, the traffic, the deployment settings, the code:
# its serving digest, so parts run at commits that differ only outside asympd/ and bench/ or in the
# planner merge; results from before that field compare the whole source digest)
SAME = ("gpus", "placement", "traffic", "slo", "d_policy", "p_step_tokens",
        "colocated_semantics", "kv_cache_gb_per_worker")  # fmt: skip
SAME_MODEL = ("checkpoint", "depth", "expert_storage", "model_config")


class MergeError(ValueError):
    """Parts that cannot be one study: different code, model, traffic or settings, or a mode twice."""


def merge(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One result from the ``(file, result)`` parts of a study split over device calls (``--modes``
    subsets of the same command): modes united, the headline and its ratios recomputed across parts."""
    if len(parts) < 2:
        raise MergeError("--merge needs at least two parts")
    first_file, first = parts[0]
    for f, part in parts:
        if not isinstance(part, dict) or not isinstance(part.get("modes"), dict) or "model" not in part:
            raise MergeError(f"{f}: not a bench/e2e.py result")
    code = "serving_digest" if all("serving_digest" in p for _, p in parts) else "source_digest"
    for f, part in parts[1:]:
        for k in (code, *SAME):
            if part.get(k) != first.get(k):
                raise MergeError(f"{f} differs from {first_file} in {k!r}: {part.get(k)!r} != {first.get(k)!r}")
        for k in SAME_MODEL:
            if part["model"].get(k) != first["model"].get(k):
                raise MergeError(f"{f} differs from {first_file} in the model's {k!r}")
        gpu, gpu0 = (part.get("device") or {}).get("gpu"), (first.get("device") or {}).get("gpu")
        if gpu != gpu0:
            raise MergeError(f"{f} ran on {gpu!r}, {first_file} on {gpu0!r}")
    modes: dict[str, Any] = {}
    for f, part in parts:
        for mode, m in part["modes"].items():
            if "skipped" in m:
                continue  # another part may have run it
            if mode in modes:
                raise MergeError(f"mode {mode!r} is in two parts (the second: {f})")
            modes[mode] = {**m, "part": f}
    merged = {k: v for k, v in first.items() if k not in ("modes", "command", "utc", "wall_s")}
    commits = sorted({str(p.get("commit")) for _, p in parts})
    merged["commit"] = commits[0] if len(commits) == 1 else ",".join(commits)
    merged["parts"] = [
        {
            "file": f,
            "commit": p.get("commit"),
            "command": p.get("command"),
            "utc": p.get("utc"),
            "wall_s": p.get("wall_s"),
            "modes": list(p["modes"]),
        }
        for f, p in parts
    ]
    merged["modes"] = {m: modes[m] for m in MODES if m in modes}
    summarize(merged)
    return merged


def merge_files(paths: list[str], out: str) -> Path:
    parts = []
    for p in paths:
        try:
            parts.append((Path(p).name, json.loads(Path(p).read_text())))
        except (OSError, ValueError) as e:
            raise MergeError(f"{p}: cannot read a JSON result: {e}") from e
    merged = merge(parts)
    merged["benchmark"] = Path(out).stem
    merged["merged_by"] = "python bench/e2e.py --merge " + " ".join(paths) + f" -o {out}"
    merged["utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(out).write_text(json.dumps(merged, indent=1, default=str))
    return Path(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint on CPU")
    ap.add_argument("--depth", type=int, default=3, choices=(3, 40), help="40: the true layer schedule, shared experts")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rates", default=None, help="request rates, req/s (Poisson), comma-separated")
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (bench serve)")
    ap.add_argument("--num-prompts", type=int, default=None, help="per rate")
    ap.add_argument("--input-len", type=int, default=None, help="mean prompt length")
    ap.add_argument("--output-len", type=int, default=None, help="mean output length")
    ap.add_argument("--range-ratio", type=float, default=None, help="uniform: +-ratio; lognormal: sigma")
    ap.add_argument("--len-dist", default="uniform", choices=("uniform", "lognormal"))
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-itl-ms", type=float, default=None)
    ap.add_argument(
        "--policy",
        default=None,
        choices=list(POLICIES),
        help="D and colocated admission (default: asympd serve's, by role: alone-4 on D, cap-4 colocated)",
    )
    ap.add_argument("--colocated-semantics", default="split", choices=("full", "decoder-replay", "split"))
    ap.add_argument("--calib-tokens", type=int, default=None)
    ap.add_argument("--calib-batch", type=int, default=None)
    ap.add_argument(
        "--ladder",
        default=None,
        help="calibration: D's decode steps at these batch sizes, each decoding together (the CUDA graphs' padded "
        "sizes; empty: off)",
    )
    ap.add_argument(
        "--ladder-rounds",
        type=int,
        default=2,
        help="calibration: run the ladder's sizes this many times, ascending then descending (one block of a "
        "size's steps can read a few ms off: docs/planner.md)",
    )
    ap.add_argument(
        "--ladder-tokens",
        type=int,
        default=None,
        help="the steps each ladder size decodes together (its requests' outputs add what P takes to admit them all)",
    )
    ap.add_argument(
        "--co-run-prompts",
        type=int,
        default=3,
        help="calibration: prompts sent alone and again beside D's decoding, to measure how P and D slow "
        "each other on a shared GPU (0: off)",
    )
    ap.add_argument("--co-run-decoders", type=int, default=4, help="co-run: requests D keeps decoding")
    ap.add_argument("--co-run-tokens", type=int, default=200, help="co-run: their output tokens (cancelled when done)")
    ap.add_argument(
        "--co-run-fill-rows",
        type=int,
        default=None,
        help="co-run: then prompts of the traffic's lengths filling twice this many rows sent at once, alone and "
        "beside the rates' decode batch: P's stretch at the load's step size (default: --p-step-tokens; 0: off)",
    )
    ap.add_argument(
        "--co-run-mid-rows",
        type=int,
        default=None,
        help="co-run fill: first prompts filling twice this many rows sent at once, alone: P's steps between "
        "one prompt and the whole budget (default: a quarter of --p-step-tokens; 0: off)",
    )
    ap.add_argument(
        "--co-run-max-decoders",
        type=int,
        default=32,
        help="co-run fill: the most requests D keeps decoding (the batch: the highest rate x output_len x D's "
        "calibrated step)",
    )
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="paged KV pool per worker")
    ap.add_argument("--p-step-tokens", type=int, default=None, help="P's max_num_batched_tokens")
    ap.add_argument(
        "--p-cuda-graph-mode",
        default=None,
        choices=CUDA_GRAPH_MODES,
        help="P's --cuda-graph-mode (default: the prefill worker's, full_and_piecewise; full: eager prompt steps)",
    )
    ap.add_argument("--gpus", type=int, default=None, help="default: 0 with --tiny, else min(2, visible GPUs)")
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint instead of writing one")
    ap.add_argument("--start-timeout", type=float, default=None)
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds for one bench serve run")
    ap.add_argument("--budget-s", type=float, default=None, help="no mode or rate starts after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup-prompts", type=int, default=None, help="per mode, a discarded run first (default 16 on a GPU, 0 tiny)"
    )
    ap.add_argument("--step-s", type=float, default=None, help="decode step the time budget assumes")
    ap.add_argument("--startup-s", type=float, default=None, help="deployment start assumed before one is measured")
    ap.add_argument("--name", default=None, help="result name (default e2e_tiny / e2e_h200x{gpus}[_depth40])")
    ap.add_argument("--merge", nargs="+", metavar="PART", help="merge part results (one run split over calls)")
    ap.add_argument("-o", "--out", default=None, help="--merge: the merged JSON's path")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs -o OUT.json")
        return args
    if args.tiny and args.depth != 3:
        ap.error("--depth 40 is the true-width model on a GPU; --tiny has its own 7-layer schedule")
    for k, v in defaults(args.tiny, args.depth).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.gpus is None:
        args.gpus = 0 if args.tiny else min(2, torch.cuda.device_count())
    if not args.tiny and args.gpus == 0:
        ap.error("no GPU visible: the true-width run needs one (or pass --tiny)")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {', '.join(bad)}: choose from {', '.join(MODES)}")
    args.rate_list = [float(x) for x in args.rates.split(",") if x.strip()]
    if not args.rate_list or any(not r > 0 for r in args.rate_list):
        ap.error(f"--rates must be positive numbers, got {args.rates!r}")
    if args.name is None:
        args.name = "e2e_tiny" if args.tiny else f"e2e_h200x{args.gpus}" + ("_depth40" if args.depth == 40 else "")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        try:
            path = merge_files(args.merge, args.out)
        except MergeError as e:
            log(f"cannot merge: {e}")
            return 2
        data = json.loads(path.read_text())
        log(f"wrote {path}: modes {', '.join(data['modes'])}")
        for r in data["asymmetric_over_strongest_symmetric"]:
            q = {k: r[k] if r[k] is not None else float("nan") for k in RATIO_KEYS}
            log(
                f"  {r['rate']:g} req/s: P tokens per busy s x{q['prompt_tokens_per_p_busy_s']:.2f}, "
                f"ITL p99 x{q['itl_p99_ms']:.2f}, goodput per GPU x{q['goodput_req_per_s_per_gpu']:.2f}"
            )
        return 0
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        log(f"missing Python packages for the servers: {', '.join(missing)}")
        return 2
    # SIGTERM (a device call's time limit, kill PID) unwinds: servers stopped, load generator killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    args.deadline = started + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="asympd_e2e_"))
    try:
        ckpt, model = make_checkpoint(args, work)
        gb = model["checkpoint_bytes"] / 1e9
        log(f"checkpoint {ckpt}: depth {model['depth']}, {gb:.2f} GB, written in {model['write_s']} s")
        vocab = model["model_config"]["vocab_size"]
        lo = max(1, math.floor(args.input_len * (1 - args.range_ratio)))
        d_policy = args.policy or default_policy("decode")
        data: dict[str, Any] = {
            "model": model,
            "placement": (
                "cpu, one process per worker"
                if not args.gpus
                else "P on GPU 0, D on GPU 1; colocated: one worker per GPU"
                if args.gpus >= 2
                else "P, D and colocated on GPU 0"
            ),
            "gpus": args.gpus,
            "traffic": {
                "dataset": "random token ids",
                "input_len": args.input_len,
                "output_len": args.output_len,
                "range_ratio": args.range_ratio,
                "len_dist": args.len_dist,
                "arrivals": "Poisson",
                "rates": args.rate_list,
                "max_concurrency": args.max_concurrency,
                "num_prompts_per_rate": args.num_prompts,
                "seed": args.seed,
                "shortest_prompt": lo,
            },
            "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms, "goodput": "every ITL of a request"},
            "d_policy": {
                "name": d_policy,
                "max_new_admissions": POLICIES[d_policy].max_new_admissions,
                "admission_token_budget": POLICIES[d_policy].admission_token_budget,
                "mixed_steps": POLICIES[d_policy].mixed_steps,
                "colocated": args.policy or default_policy("colocated"),
            },
            "p_step_tokens": args.p_step_tokens,
            "colocated_semantics": args.colocated_semantics,
            "kv_cache_gb_per_worker": args.kv_cache_gb,
            # where P packs and copies its hand-off on a GPU: a stream of its own since this field
            # exists ("pack"), before on the compute stream, between P's steps (what --validate models)
            "handoff_stream": "pack",
            "modes": {},
        }

        def save() -> Path:
            summarize(data)
            return record(args.name, data, started)

        for mode in args.mode_list:
            want = predict_mode_s(args, list(data["modes"].values()))
            if time.time() + want > args.deadline:
                data["modes"][mode] = {"skipped": f"predicted {want:.0f} s would end past --budget-s {args.budget_s:g}"}
                log(f"{mode}: skipped (predicted {want:.0f} s, past --budget-s {args.budget_s:g})")
                continue
            data["modes"][mode] = {}
            run_mode(args, mode, ckpt, vocab, work, data["modes"][mode], save)
            save()
        log(f"wrote {save()}")
        return 1 if any("error" in m or "skipped" in m for m in data["modes"].values()) else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
