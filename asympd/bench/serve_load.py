"""``asympd bench serve``: a load generator for any OpenAI-compatible endpoint.

It drives asympd's router the same way it drives vLLM or SGLang, so the numbers compare: random
prompts (token ids, exact lengths) or a ShareGPT-format file; requests sent on a Poisson or gamma
("bursty") arrival process, or at a fixed concurrency; every response streamed and timed on the
client. The result JSON uses the field names ``vllm bench serve`` writes (``mean_ttft_ms``,
``p99_itl_ms``, ``request_goodput``, ``input_lens``, ``itls``, ...) plus the command, machine and
commit, so results from either tool can be read by the same scripts.

Definitions (as vLLM's): TTFT is send to the first chunk that carries output; ITL the gaps between
later output chunks (one chunk may hold several tokens); TPOT = (E2EL - TTFT) / (output tokens - 1)
for requests with more than one output token; E2EL send to the end of the stream. Output token
counts come from the ``usage`` the server reports (``stream_options.include_usage``). A request
meets the goodput SLOs when each given metric is within its bound; for ``itl`` that is every gap of
the request (its largest ITL), for the others the request's own value.

No torch here: the load generator runs beside servers and must stay light.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# ShareGPT filters (vLLM's): too short to be a real turn, or too long for a 2K-context benchmark
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class BenchError(ValueError):
    """Bad benchmark input (arguments, dataset, endpoint): reported as one line."""


# ---- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: token ids (exact length) or text, and the output length asked for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def sample_lengths(rng: np.random.Generator, n: int, mean: int, dist: str, ratio: float) -> list[int]:
    """``n`` lengths >= 1 around ``mean``.

    ``uniform``: integers in [mean(1-ratio), mean(1+ratio)] (vLLM's range ratio; 0 = fixed).
    ``lognormal``: median ``mean``, log-space sigma ``ratio`` (a long right tail, as real prompts have).
    """
    if mean < 1:
        raise BenchError(f"a mean length must be >= 1, got {mean}")
    if ratio < 0:
        raise BenchError(f"a length ratio must be >= 0, got {ratio}")
    if dist == "uniform":
        if ratio >= 1:
            raise BenchError(f"--random-range-ratio must be in [0, 1) for uniform lengths, got {ratio}")
        lo, hi = max(1, math.floor(mean * (1 - ratio))), math.ceil(mean * (1 + ratio))
        return rng.integers(lo, hi + 1, size=n).tolist()
    if dist == "lognormal":
        draws = rng.lognormal(math.log(mean), ratio, size=n)
        return np.maximum(1, np.rint(draws)).astype(int).tolist()
    raise BenchError(f"unknown length distribution {dist!r}: expected uniform or lognormal")


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    *,
    dist: str = "uniform",
    ratio: float = 0.0,
    prefix_len: int = 0,
    skip_ids: Sequence[int] = (),
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random token ids (none of ``skip_ids``), with ``prefix_len`` ids shared by all."""
    if num < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {num}")
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(skip_ids), dtype=np.int64))
    if allowed.size == 0:
        raise BenchError(f"no token ids to sample: vocab size {vocab_size}, {len(skip_ids)} excluded")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num, input_len, dist, ratio)
    out_lens = sample_lengths(rng, num, output_len, dist, ratio)
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    out = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        ids = prefix + rng.choice(allowed, size=n_in).tolist()
        out.append(BenchRequest(ids, len(ids), n_out))
    return out


def sharegpt_requests(path: str, num: int, tokenizer: Any, output_len: int | None = None, seed: int = 0):
    """The first human turn of each conversation as the prompt, the reply's length as max_tokens.

    Conversations shuffled with ``seed``; those too short or too long are skipped (vLLM's filters,
    the length ones only when the reply sets the output length)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot read ShareGPT file {path!r}: {e}") from None
    if not isinstance(data, list):
        raise BenchError(f"{path!r}: expected a JSON list of conversations")
    convs = [
        c["conversations"]
        for c in data
        if isinstance(c, dict) and isinstance(c.get("conversations"), list) and len(c["conversations"]) >= 2
    ]
    random.Random(seed).shuffle(convs)
    out: list[BenchRequest] = []
    for conv in convs:
        if len(out) == num:
            break
        prompt, reply = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
        n_out = output_len or len(tokenizer.encode(reply, add_special_tokens=False).ids)
        if n_in < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN:
            continue
        if output_len is None and (n_in > SHAREGPT_MAX_PROMPT_LEN or n_in + n_out > SHAREGPT_MAX_TOTAL_LEN):
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
    if len(out) < num:
        raise BenchError(f"{path!r} has {len(out)} usable conversations, --num-prompts asks for {num}")
    return out


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``num`` requests.

    Gaps are gamma-distributed with mean 1/rate and shape ``burstiness``: 1 is a Poisson process,
    < 1 burstier, > 1 more even. The first request goes at 0; ``rate`` inf sends all at once."""
    if num < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {num}")
    if not rate > 0:
        raise BenchError(f"--request-rate must be > 0 (inf: all at once), got {rate}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# ---- one request --------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0
    text: str = ""
    error: str = ""
    usage_reported: bool = False
    timings: dict[str, Any] = field(default_factory=dict)  # the server's ``asympd_timings``, if it sends them


def request_body(req: BenchRequest, model: str, chat: bool, args_extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        **args_extra,
    }
    if chat:
        if not isinstance(req.prompt, str):
            raise BenchError("the chat endpoint takes text prompts: pass --tokenizer to decode random ids")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_output(choice: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """(text, whether the chunk carries output): a chat role-only opener carries none."""
    text = ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""
    return text, bool(text or choice.get("token_ids") or choice.get("finish_reason"))


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt_len: int, chat: bool
) -> RequestResult:
    """POST one streaming request and time its chunks; failures are recorded, never raised."""
    res = RequestResult(prompt_len=prompt_len)
    chunks, texts = 0, []
    t0 = time.perf_counter()
    res.start = t0
    last = t0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {raw[:500]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if not isinstance(ev, dict):
                    res.error = f"not a JSON object in the stream: {data[:200]}"
                    return res
                if "error" in ev:
                    err = ev["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return res
                now = time.perf_counter()
                for choice in ev.get("choices") or []:
                    text, carries = _chunk_output(choice, chat)
                    if not carries:
                        continue
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
                    texts.append(text)
                res.timings = ev.get("asympd_timings") or res.timings
                usage = ev.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens", 0))
                    res.prompt_len = int(usage.get("prompt_tokens", prompt_len))
                    res.usage_reported = True
        res.latency = time.perf_counter() - t0
        res.text = "".join(texts)
        if chunks == 0:
            res.error = "the stream ended without output"
            return res
        if not res.usage_reported:
            res.output_tokens = chunks  # a lower bound: a chunk may carry several tokens
        res.success = True
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---- statistics -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    """Goodput bounds in milliseconds, per metric (``ttft``, ``tpot``, ``itl``, ``e2el``)."""

    bounds_ms: dict[str, float]

    @staticmethod
    def parse(items: Sequence[str]) -> Slo:
        bounds: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise BenchError(
                    f"--goodput takes METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}; got {item!r}"
                )
            try:
                ms = float(value)
            except ValueError:
                raise BenchError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
            if ms < 0:
                raise BenchError(f"--goodput {item!r}: a bound must be >= 0")
            bounds[name] = ms
        return Slo(bounds)

    def met(self, r: RequestResult) -> bool:
        values = {
            "ttft": r.ttft,
            "tpot": _tpot(r) or 0.0,
            "itl": max(r.itl, default=0.0),
            "e2el": r.latency,
        }
        return all(values[m] * 1000.0 <= ms for m, ms in self.bounds_ms.items())


def _tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (50, 90, 99),
    slo: Slo | None = None,
) -> dict[str, Any]:
    """vLLM's aggregate fields over the successful requests (latencies in ms, percentiles linear)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := _tpot(r)) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": (sum(slo.met(r) for r in ok) / duration if duration > 0 else 0.0) if slo else None,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    out.update(peaks(ok))
    for metric in PERCENTILE_METRICS:
        xs = np.asarray(series[metric] or [0.0]) * 1000.0
        out[f"mean_{metric}_ms"] = float(np.mean(xs))
        out[f"median_{metric}_ms"] = float(np.median(xs))
        out[f"std_{metric}_ms"] = float(np.std(xs))
        for p in percentiles:
            out[f"p{_pct_name(p)}_{metric}_ms"] = float(np.percentile(xs, p))
    return out


def peaks(ok: Sequence[RequestResult]) -> dict[str, float]:
    """The busiest whole second of the run: output chunks received in it (vLLM's
    ``max_output_tokens_per_s``, one chunk counted as one token) and requests in flight."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in ok)
    chunks = np.concatenate([r.start - t0 + r.ttft + np.cumsum([0.0, *r.itl]) for r in ok])
    seconds = int(max(r.start - t0 + r.latency for r in ok)) + 1
    per_s = np.bincount(chunks.astype(int), minlength=seconds)
    live = [sum(int(r.start - t0) <= s <= int(r.start - t0 + r.latency) for r in ok) for s in range(seconds)]
    return {"max_output_tokens_per_s": float(per_s.max()), "max_concurrent_requests": max(live)}


def per_request_fields(results: Sequence[RequestResult], t_start: float) -> dict[str, Any]:
    """vLLM's per-request lists (seconds), plus the send times and E2ELs the plot needs."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency if r.success else 0.0 for r in results],
        "start_times": [r.start - t_start for r in results],
        "generated_texts": [r.text for r in results],
        "errors": [r.error for r in results],
        "asympd_timings": [r.timings for r in results],
    }


# ---- the run ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the endpoint, e.g. http://127.0.0.1:8000/v1/completions
    model: str
    chat: bool = False
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 6 * 3600.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    progress: bool = True


def _client(cfg: LoadConfig, limits: httpx.Limits | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    return httpx.AsyncClient(timeout=timeout, headers=headers, **({"limits": limits} if limits else {}))


async def run_load(cfg: LoadConfig, requests: Sequence[BenchRequest]) -> tuple[list[RequestResult], float, float]:
    """Send every request on its arrival time (and within the concurrency cap); results in order."""
    from tqdm.asyncio import tqdm

    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {cfg.max_concurrency}")
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    bodies = [request_body(r, cfg.model, cfg.chat, cfg.extra_body) for r in requests]
    limit = cfg.max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    bar = tqdm(total=len(requests), disable=not cfg.progress, unit="req", file=sys.stderr)
    async with _client(cfg, httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as client:
        t_start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, t_start + offsets[i] - time.perf_counter()))
            async with sem:
                res = await send_request(client, cfg.url, bodies[i], requests[i].prompt_len, cfg.chat)
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - t_start
    bar.close()
    return list(results), duration, t_start


async def test_request(cfg: LoadConfig, request: BenchRequest) -> None:
    """One request before the run, as ``vllm bench serve`` sends: a server that cannot answer it is
    one clear error now, not N failures after the whole schedule."""
    async with _client(cfg) as client:
        body = request_body(request, cfg.model, cfg.chat, cfg.extra_body)
        res = await send_request(client, cfg.url, body, request.prompt_len, cfg.chat)
    if not res.success:
        raise BenchError(f"the test request to {cfg.url} failed, so the run was not started: {res.error}")


def machine_info() -> dict[str, Any]:
    """Where the client ran (and the GPUs it can see, if ``nvidia-smi`` answers)."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        info["gpus"] = [line.strip() for line in q.stdout.splitlines() if line.strip()] if q.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        info["gpus"] = []
    return info


def git_commit() -> str | None:
    """The asympd checkout's HEAD (``+dirty`` with uncommitted changes), or None outside git."""
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def plot_latencies(result: dict[str, Any], path: str) -> None:
    """TTFT and E2EL against send time, ITL and TPOT histograms: one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib (pip install matplotlib)") from None
    ok = [i for i, e in enumerate(result["errors"]) if not e]
    starts = [result["start_times"][i] for i in ok]
    tpots = [
        (result["e2els"][i] - result["ttfts"][i]) * 1e3 / (result["output_lens"][i] - 1)
        for i in ok
        if result["output_lens"][i] > 1
    ]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].scatter(starts, [result["ttfts"][i] * 1e3 for i in ok], s=6)
    ax[0, 0].set(xlabel="send time (s)", ylabel="TTFT (ms)", title="time to first token")
    ax[0, 1].scatter(starts, [result["e2els"][i] * 1e3 for i in ok], s=6)
    ax[0, 1].set(xlabel="send time (s)", ylabel="E2EL (ms)", title="end-to-end latency")
    ax[1, 0].hist([x * 1e3 for i in ok for x in result["itls"][i]] or [0.0], bins=50)
    ax[1, 0].set(xlabel="ITL (ms)", ylabel="count", title="inter-token latency")
    ax[1, 1].hist(tpots or [0.0], bins=50)
    ax[1, 1].set(xlabel="TPOT (ms)", ylabel="requests", title="time per output token")
    rate = result["request_rate"]
    fig.suptitle(f"{result['model_id']} @ {rate} req/s, {result['completed']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server (router) address")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name sent (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or a checkpoint directory holding one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=("random", "sharegpt"))
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="uniform: +-ratio; lognormal: sigma")
    p.add_argument("--random-len-dist", default="uniform", choices=("uniform", "lognormal"))
    p.add_argument("--random-prefix-len", type=int, default=0, help="token ids shared by every prompt")
    p.add_argument("--vocab-size", type=int, default=None, help="random ids below this (default: the tokenizer's)")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed max_tokens instead of the reply's")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM and SGLang honour it)")
    p.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="merged into every request body, e.g. '{\"return_token_ids\": true}' (one chunk per token on asympd)",
    )
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="SLOs, e.g. ttft:500 itl:50")
    p.add_argument("--metric-percentiles", default="90,99", help="comma-separated, besides the median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds for one request")
    p.add_argument("--result-file", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a latency plot here (needs matplotlib)")
    p.add_argument("--label", default=None, help="free text stored in the result")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--no-test-request",
        action="store_true",
        help="start the schedule at once (default: send the first request once before it, as vllm bench serve "
        "does, and stop with its error if it fails)",
    )


def load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception type
        raise BenchError(f"cannot load a tokenizer from {path!r}: {e}") from None


def _resolve_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base_url}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"GET {base_url}/v1/models answered {r.status_code}: {r.text[:200]}")
    models = r.json().get("data") or []
    if not models:
        raise BenchError(f"{base_url}/v1/models lists no model: pass --model")
    return str(models[0]["id"])


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    if args.dataset_name == "sharegpt":
        if not args.dataset_path or tokenizer is None:
            raise BenchError("--dataset-name sharegpt needs --dataset-path and --tokenizer (for the lengths)")
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.sharegpt_output_len, args.seed)
    vocab = args.vocab_size or (tokenizer.get_vocab_size() if tokenizer is not None else None)
    if vocab is None:
        raise BenchError("random prompts need --vocab-size or --tokenizer")
    skip = list(tokenizer.get_added_tokens_decoder()) if tokenizer is not None else []
    reqs = random_requests(
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        vocab,
        dist=args.random_len_dist,
        ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        skip_ids=skip,
        seed=args.seed,
    )
    if args.endpoint.endswith("chat/completions"):  # chat takes text: decode (lengths then come from usage)
        if tokenizer is None:
            raise BenchError("random prompts on the chat endpoint need --tokenizer (to make text)")
        reqs = [BenchRequest(tokenizer.decode(r.prompt), r.prompt_len, r.output_len) for r in reqs]
    return reqs


def format_summary(result: dict[str, Any], percentiles: Sequence[float]) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{result['completed']}",
        f"{'Failed requests:':<40}{result['failed']}",
        f"{'Benchmark duration (s):':<40}{result['duration']:.2f}",
        f"{'Total input tokens:':<40}{result['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{result['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{result['request_throughput']:.2f}",
    ]
    if result["request_goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{result['request_goodput']:.2f}")
    lines += [
        f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{result['total_token_throughput']:.2f}",
    ]
    for metric, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        lines.append(f"{'-' * 20}{title}{'-' * (30 - len(title))}")
        lines.append(f"{f'Mean {title} (ms):':<40}{result[f'mean_{metric}_ms']:.2f}")
        lines.append(f"{f'Median {title} (ms):':<40}{result[f'median_{metric}_ms']:.2f}")
        for p in percentiles:
            lines.append(f"{f'P{_pct_name(p)} {title} (ms):':<40}{result[f'p{_pct_name(p)}_{metric}_ms']:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def command_line(args: argparse.Namespace) -> str:
    """The effective command, every option spelled out (defaults included), so a result can be rerun."""
    words = ["asympd", "bench", "serve"]
    for name, value in vars(args).items():
        if name in ("command", "bench_command") or value is None or value is False or callable(value):
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    """The ``asympd bench serve`` command: 0 when every request completed, 1 when some failed."""
    try:
        percentiles = sorted({float(x) for x in args.metric_percentiles.split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"--metric-percentiles takes numbers, got {args.metric_percentiles!r}") from None
    if any(not 0 < p < 100 for p in percentiles):
        raise BenchError(f"--metric-percentiles must lie in (0, 100), got {args.metric_percentiles!r}")
    slo = Slo.parse(args.goodput) if args.goodput else None
    if args.endpoint not in ("/v1/completions", "/v1/chat/completions"):
        raise BenchError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {args.endpoint!r}")
    if not args.request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    base = args.base_url.rstrip("/")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    requests = build_requests(args, tokenizer)
    model = args.model or _resolve_model(base, args.api_key)
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    if args.extra_body:
        try:
            more = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise BenchError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(more, dict):
            raise BenchError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
        extra.update(more)
    cfg = LoadConfig(
        url=base + args.endpoint,
        model=model,
        chat=args.endpoint.endswith("chat/completions"),
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout_s=args.request_timeout,
        extra_body=extra,
        api_key=args.api_key,
        progress=not args.disable_tqdm,
    )
    if not args.no_test_request:
        asyncio.run(test_request(cfg, requests[0]))
    results, duration, t_start = asyncio.run(run_load(cfg, requests))
    result: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        # wall-clock time of start_times' zero: lines the requests up with the workers' step logs
        "start_wall": time.time() - (time.perf_counter() - t_start),
        "command": command_line(args),
        "machine": machine_info(),
        "commit": git_commit(),
        "label": args.label,
        "backend": "openai-chat" if cfg.chat else "openai",
        "base_url": base,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "goodput": slo.bounds_ms if slo else None,
        "metric_percentiles": percentiles,
        **summarize(results, duration, [50, *percentiles], slo),
        **per_request_fields(results, t_start),
    }
    print(format_summary(result, percentiles))
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot_latencies(result, args.plot)
    failed = [e for e in result["errors"] if e]
    if failed:
        print(f"{len(failed)} of {len(results)} requests failed; first: {failed[0]}", file=sys.stderr)
    return 1 if failed else 0
