"""End to end through real servers: one deployment per mode, the same traffic, one JSON (issue 16).

For each mode -- asymmetric, symmetric-split (the strongest symmetric baseline), symmetric-windows,
colocated -- the script starts the product's own processes (``asympd serve --role prefill|decode|
colocated`` and ``asympd router``, through ``asympd.serve.procs``), then

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
(7.2 GB each on disk and on the GPU: true bytes per layer). ``--tiny``: the tiny checkpoint
(``asympd make-checkpoint --config tiny``), on CPU.

Placement. Two GPUs: P on GPU 0, D on GPU 1 (``CUDA_VISIBLE_DEVICES`` per process), colocated one
worker per GPU behind the router, so every mode uses both. One GPU: everything on it.

    python bench/e2e.py [--tiny] [--modes asymmetric,colocated] [--rates 2,4,8] [--num-prompts 48]

Writes ``e2e_tiny.json`` / ``e2e_h200x{1,2}.json`` (``--name``) to ``$ASYMPD_OUT`` or
``bench/results`` after each mode, so a later failure keeps the earlier modes. The servers need
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
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.common import ROOT, log, record  # noqa: E402

MODES = ("asymmetric", "symmetric-split", "symmetric-windows", "colocated")
NEEDED = ("fastapi", "starlette", "pydantic", "uvicorn", "httpx", "prometheus_client", "tokenizers", "tqdm")
POLICIES = {"cap-4": (4, 512), "cap-8": (8, 1024), "admit-all": (None, None)}  # asympd.plan.planner.POLICIES
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
PER_REQUEST = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "e2els", "errors")


# ---- settings -------------------------------------------------------------------------------------


def defaults(tiny: bool) -> dict[str, Any]:
    """Traffic and server settings per scale (each overridable on the command line)."""
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
            kv_cache_gb=0.0625,
            p_step_tokens=2048,
            start_timeout=120.0,
            budget_s=1800.0,
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
        kv_cache_gb=8.0,
        p_step_tokens=16384,
        start_timeout=300.0,
        budget_s=450.0,  # a device call is <= 8 minutes: no new mode or rate starts after this
    )


def reduced_v41():
    """V4.1-Flash widths, 3 layers (bench/p_throughput.py's reduced model), no vision."""
    from bench.p_throughput import reduced_config

    return reduced_config().replace(max_seq_len=1 << 16)


# ---- the checkpoint ---------------------------------------------------------------------------------


def write_on_device(cfg, out: Path, device: torch.device, seed: int = 0) -> Path:
    """``write_checkpoint``'s file set and layout, each shard's tensors drawn on ``device`` in their
    storage formats (drawing 22 GB of FP4 codes on the CPU takes minutes; on a GPU, seconds)."""
    from asympd.model import checkpoint as ck
    from asympd.model.schema import checkpoint_schema
    from asympd.model.tiny_tokenizer import write_tiny_tokenizer
    from asympd.release_config import write_config_files
    from bench.common import random_tensors

    if cfg.engram_layer_ids:
        raise ValueError("write_on_device writes no Engram tables: use asympd make-checkpoint")
    out.mkdir(parents=True, exist_ok=False)
    write_tiny_tokenizer(out / ck.TOKENIZER_FILE, cfg.vocab_size)
    write_config_files(cfg, out)
    ck._write_tokenizer_files(out)
    shards = ck._plan_shards(ck._units(checkpoint_schema(cfg)), ck.DEFAULT_SHARD_BYTES)
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
                assert t.shape == s.shape and t.dtype == s.dtype, s.name
                f.seek(len(header) + offsets[s.name])
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()))
                weight_map[s.name] = fname
                total += s.nbytes
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / ck.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the servers need the memory this process cached
    return out


def make_checkpoint(args: argparse.Namespace, work: Path) -> tuple[str, dict[str, Any]]:
    from asympd.config import tiny
    from asympd.model.checkpoint import load_config, write_checkpoint

    t = time.perf_counter()
    if args.checkpoint:
        path = Path(args.checkpoint)
        how = "given (--checkpoint)"
    elif args.tiny:
        path = write_checkpoint(tiny(), work / "ckpt", seed=0, verbose=False)
        how = "asympd make-checkpoint --config tiny (write_checkpoint)"
    else:
        path = write_on_device(reduced_v41(), work / "ckpt", torch.device("cuda"))
        how = "bench/e2e.py write_on_device: released layout, tensors drawn on the GPU"
    cfg = load_config(path)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    info = {
        "checkpoint": "tiny" if args.tiny else "v41-flash widths, reduced depth",
        "depth": cfg.n_layers,
        "mtp_layers": cfg.n_mtp_layers,
        "kv_source_layers": list(cfg.kv_source_layers),
        "last_kv_source": cfg.last_kv_source,
        "dim": cfg.dim,
        "n_routed_experts": cfg.n_routed_experts,
        "expert_storage": "each layer its own experts (no sharing): true bytes per layer",
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
    cap, budget = POLICIES[args.policy]
    if role == "prefill":
        a += ["--max-num-batched-tokens", str(args.p_step_tokens)]
    else:  # D and colocated: the admission policy under test
        if cap is not None:
            a += ["--max-new-admissions", str(cap), "--admission-token-budget", str(budget)]
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
    keep = ("role", "mode", "prefill_semantics", "device", "dtype", "transport", "resident_bytes", "memory")
    return {k: info.get(k) for k in keep}


# ---- calibration --------------------------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: client TTFT and per-chunk gaps, the server's timings and usage."""
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
    # busy time (the sum of engine step durations): prompt tokens per second of P's compute
    for role in sorted(set(dep.roles)):
        busy = moved("asympd_engine_step_seconds_sum", role)
        out[f"{role}_busy_s"] = busy
        out[f"{role}_busy_fraction"] = busy / dur / dep.roles.count(role)
    p_busy = out[f"{p_side}_busy_s"]
    out["prompt_tokens_per_p_busy_s"] = res["total_input_tokens"] / p_busy if p_busy else None
    gpus = max(1, args.gpus) if args.gpus else 1
    out["gpus"] = gpus
    out["request_goodput_per_gpu"] = (res.get("request_goodput") or 0.0) / gpus
    out["output_throughput_per_gpu"] = res["output_throughput"] / gpus
    out["requests"] = {k: res.get(k) for k in PER_REQUEST}
    out["bench_command"] = res["bench_command"]
    return out


def run_mode(args, mode: str, ckpt: str, vocab: int, work: Path, out: dict[str, Any], save) -> None:
    """One deployment into ``out``: start, calibrate, each rate (``save()`` after each), stop."""
    dep = Deployment(args, mode, ckpt, work)
    out["placement"] = dep.placement
    try:
        out["startup_s"] = round(dep.start(), 1)
        out["workers"] = {w.name: worker_info(u) for w, u in zip(dep.workers, dep.urls, strict=True)}
        out["worker_commands"] = {w.name: " ".join(["asympd", *w.argv[3:]]) for w in dep.workers}
        lo = max(1, math.floor(args.input_len * (1 - args.range_ratio)))
        hi = math.ceil(args.input_len * (1 + args.range_ratio))
        t = time.perf_counter()
        out["calibration"] = calibrate(dep.url, sorted({lo, hi}), args.calib_tokens, args.calib_batch, vocab, args.seed)
        out["calibration"]["wall_s"] = round(time.perf_counter() - t, 1)
        out["runs"] = []
        for rate in args.rate_list:
            if time.time() > args.deadline:
                out.setdefault("skipped_rates", []).append(rate)
                log(f"{mode} @ {rate:g} req/s: skipped (--budget-s {args.budget_s:g} spent)")
                continue
            r = run_rate(args, dep, ckpt, rate, work)
            out["runs"].append(r)
            save()
            log(
                f"{mode} @ {rate:g} req/s: {r['completed']} done, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
                f"ITL p50 {r['median_itl_ms']:.1f} ms, goodput {r['request_goodput']:.2f} req/s, "
                f"{r['transfer_bytes_per_request'] / 1e3:.0f} kB moved per request"
            )
    except Exception:
        out["error"] = traceback.format_exc(limit=8)
        out["logs"] = dep.log_tails()
        log(f"{mode} failed:\n{out['error']}")
    finally:
        dep.stop()


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint on CPU")
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
    ap.add_argument("--policy", default="cap-4", choices=list(POLICIES), help="D (and colocated) admission")
    ap.add_argument("--colocated-semantics", default="split", choices=("full", "decoder-replay", "split"))
    ap.add_argument("--calib-tokens", type=int, default=None)
    ap.add_argument("--calib-batch", type=int, default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="paged KV pool per worker")
    ap.add_argument("--p-step-tokens", type=int, default=None, help="P's max_num_batched_tokens")
    ap.add_argument("--gpus", type=int, default=None, help="default: 0 with --tiny, else min(2, visible GPUs)")
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint instead of writing one")
    ap.add_argument("--start-timeout", type=float, default=None)
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds for one bench serve run")
    ap.add_argument("--budget-s", type=float, default=None, help="no mode or rate starts after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="result name (default e2e_tiny / e2e_h200x{gpus})")
    args = ap.parse_args(argv)
    for k, v in defaults(args.tiny).items():
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
        args.name = "e2e_tiny" if args.tiny else f"e2e_h200x{args.gpus}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
                "name": args.policy,
                "max_new_admissions": POLICIES[args.policy][0],
                "admission_token_budget": POLICIES[args.policy][1],
            },
            "p_step_tokens": args.p_step_tokens,
            "colocated_semantics": args.colocated_semantics,
            "kv_cache_gb_per_worker": args.kv_cache_gb,
            "modes": {},
        }

        def save() -> Path:
            data["headline"] = headline(data["modes"])
            data["asymmetric_over_symmetric_split"] = ratios(data["headline"])
            return record(args.name, data, started)

        for mode in args.mode_list:
            if time.time() > args.deadline:
                data["modes"][mode] = {"skipped": f"--budget-s {args.budget_s:g} spent before it started"}
                log(f"{mode}: skipped (--budget-s {args.budget_s:g} spent)")
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
