"""A soak probe of a whole serving deployment under concurrent, mixed and adversarial traffic, and a
check that it comes back to a clean state afterwards.

    python tools/soak.py --deploy 1p1d --duration 90 --concurrency 24 --out /tmp/soak-1p1d.json
    python tools/soak.py --deploy colocated --worker-arg=--prefill-semantics --worker-arg=split \
        --compare /tmp/soak-1p1d.json        # asymmetric P/D equals colocated/split to the bit
    python tools/soak.py --deploy 2p1d --prefill-arg=--stream-prefix
    python tools/soak.py --deploy 1p2d --worker-arg=--num-blocks --worker-arg=300   # KV pressure
    python tools/soak.py --deploy 1p1d --decode-arg=--num-spec-tokens --decode-arg=3 --compare /tmp/soak-1p1d.json
    python tools/soak.py --deploy 1p1d --mode symmetric-split --compare /tmp/soak-1p1d.json
    python tools/soak.py --deploy 1p2d --kill decode1@20 --restart-after 5      # failure handling
    python tools/soak.py --url http://127.0.0.1:8000 --duration 60      # a deployment already running

``--deploy 1p1d|1p2d|2p1d|colocated`` starts the processes itself (P/D workers of ``--mode``,
asymmetric by default, and a router, or one colocated worker with no router) on ``--checkpoint``
(default: a tiny random one written into a temporary folder), over ``--transport tcp``, warm-up
off, and stops them at the end; ``--worker-arg`` goes to every worker, ``--prefill-arg`` /
``--decode-arg`` to the P / D ones, ``--router-arg`` to the router. ``--url`` drives a deployment
someone else started (then give ``--log-dir`` for the log scan).

``--kill NAME@S`` SIGKILLs one process (``prefill0``, ``decode1``, ...) S seconds into the traffic;
``--restart-after T`` starts it again on its port T seconds later. docs/serving.md "Failure
policies" says what must happen: a dead P costs no request (another P, or D's recompute, serves
it), a dead D fails only the requests it had in flight, each with the router's 502 (JSON, or an SSE
error event and ``[DONE]``); the surviving workers come back idle, and a restarted one gets traffic
again from the router (it must have run engine steps by the end).

For ``--duration`` seconds ``--concurrency`` clients each send one request after another through
the given address, a random mix (seeded by ``--seed``): completions and chat, streamed or not, n in
1..4 (now and then 8 or 16), prompt lengths from 1 token to the end of the context (many around the
window W = 16 of the tiny model, max_tokens sometimes exactly what the context leaves), random
max_tokens, greedy / seeded / hot sampling, penalties, min_tokens, stop strings, logprobs, echo;
bad fields that must get their 4xx; clients that close the connection mid-stream, mid-request or
halfway through sending the body; client timeouts; slow readers; and X-Request-Id values that
several requests share at once. The modes whose P samples the first token (symmetric*) refuse
n > 1 by name: there most requests get n = 1 and the others must get that 400.

Checked per request: the status is the expected one (no 5xx, no reset connection, no hang past
``--request-timeout``), streams end with ``[DONE]`` and carry no error event, non-streamed bodies
are JSON with one choice per index, each with a finish reason; usage sums (``prompt_tokens`` equal
to ``/tokenize``'s count on the same input, ``completion_tokens`` the sum of the choices' tokens);
one logprob per token (the best of the top ones for greedy without penalties); no stop string in
the text (unless min_tokens held it back); echo puts the prompt first. Across requests: greedy
requests of the same input return the same tokens (a shorter ``max_tokens`` a prefix of a longer
one) and the same text for the same tokens, streamed or not; seeded ones the same tokens for the
same (seed + choice index). Afterwards: within ``--idle-timeout`` seconds every worker reports no
running, waiting or held request and no KV block in use, the router no outstanding load; no
process died; no log holds a traceback or an ERROR line.

The JSON summary (``--out``) holds the counts by outcome, every problem found (with the request),
the slowest requests, the idle metrics, the workers' error and fallback counters, the log findings
and the greedy results (``--compare`` another run's summary: the greedy tokens of inputs both ran
must agree). Exit status 0 when nothing was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.serve.procs import ServerProcess, stop_all  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
DEPLOYS = {"1p1d": (1, 1), "1p2d": (1, 2), "2p1d": (2, 1), "colocated": (0, 1)}
WORDS = (
    "the of and to in is was for that with on as by at from his her an be this are which or had not "
    "prefill decode window cache token block router worker stream state transfer expert model layer"
).split()
STOPS = ["e", "th", " ", "\n", "in", "A", "the", ".", "zz", "ing"]
DUP_IDS = ["dup-a", "dup-b", "dup-c"]
IDLE_GAUGES = (
    "asympd_num_requests_running",
    "asympd_num_requests_waiting",
    "asympd_kv_blocks_used",
    "asympd_num_requests_held_for_transfer",
)
LOG_BAD = re.compile(r"Traceback|\bERROR\b|CRITICAL|Exception in")
PD_MODES = ("asymmetric", "symmetric", "symmetric-split", "symmetric-windows", "encoder-only")
FIRST_TOKEN_FROM_PREFILL = ("symmetric", "symmetric-split", "symmetric-windows")  # they refuse n > 1


# ---- the deployment ---------------------------------------------------------------------------------


@dataclass
class Deployment:
    """The processes ``--deploy`` started (start order) and the arguments each was started with."""

    url: str
    procs: list[ServerProcess]
    argv: dict[str, list[str]]

    def proc(self, name: str) -> ServerProcess:
        matches = [p for p in self.procs if p.name == name]
        if not matches:
            raise SystemExit(f"no process {name!r} (there are {', '.join(p.name for p in self.procs)})")
        return matches[-1]

    def restart(self, name: str, log_dir: str) -> ServerProcess:
        """Start ``name`` again, on the port it had (``name.restarted.log``)."""
        old = self.proc(name)
        assert old.url is not None
        port = old.url.rsplit(":", 1)[1]
        args = list(self.argv[name])
        args[args.index("--port") + 1] = port
        p = ServerProcess(name, args, log_dir, ENV)
        p.log_path = Path(log_dir) / f"{name}.restarted.log"
        self.procs.append(p.start())
        p.wait_ready(120)
        return p


def start_deployment(
    kind: str,
    ckpt: str,
    log_dir: str,
    mode: str,
    transport: str,
    extra: list[str],
    p_extra: list[str],
    d_extra: list[str],
    r_extra: list[str],
) -> Deployment:
    """Start the processes of ``kind``: ``extra`` for every worker, ``p_extra`` / ``d_extra`` for
    the prefill / decode ones, ``r_extra`` for the router."""
    n_p, n_d = DEPLOYS[kind]
    common = ["--checkpoint", ckpt, "--port", "0", "--threads", "1", "--log-level", "warning", "--no-warm-up"]
    dep = Deployment("", [], {})

    def start(name: str, args: list[str]) -> ServerProcess:
        dep.argv[name] = args
        p = ServerProcess(name, args, log_dir, ENV).start()
        dep.procs.append(p)
        return p

    try:
        if kind == "colocated":
            dep.url = start("colocated", ["serve", *common, *extra]).wait_ready(120)
            return dep
        pd = ["--mode", mode, "--transport", transport, *common, *extra]
        for i in range(n_p):
            start(f"prefill{i}", ["serve", "--role", "prefill", *pd, *p_extra])
        for i in range(n_d):
            start(f"decode{i}", ["serve", "--role", "decode", *pd, *d_extra])
        urls = [p.wait_ready(300) for p in dep.procs]
        args = ["router", "--prefill", *urls[:n_p], "--decode", *urls[n_p:], "--port", "0", "--log-level", "warning"]
        dep.url = start("router", [*args, *r_extra]).wait_ready(60)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                h = httpx.get(f"{dep.url}/health", timeout=2).json()
                if h.get("all_healthy") and h.get("tokenizer"):
                    return dep
            time.sleep(0.2)
        raise TimeoutError("the router did not see every worker healthy within 60 s")
    except BaseException:
        stop_all(dep.procs)
        raise


def worker_urls(url: str) -> tuple[list[str], bool]:
    """The workers behind ``url`` (a router's, from its /health) and whether ``url`` is a router."""
    h = httpx.get(f"{url}/health", timeout=5).json()
    if "workers" in h:
        return [w["url"] for w in h["workers"]], True
    return [url], False


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ---- requests ---------------------------------------------------------------------------------------


@dataclass
class Spec:
    """One request to send and what to expect of it."""

    kind: str  # completion | chat
    body: dict[str, Any] | None  # None: ``raw`` is sent as is
    action: str = "normal"  # normal | disconnect_stream | cancel | timeout | partial_body | slow_reader
    expect: str = "ok"  # ok | 4xx (any 400-level answer; ``status`` pins one)
    status: int | None = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    label: str = ""
    delay: float = 0.0  # cancel / timeout: when; slow_reader: a pause before reading each event
    read_events: int = 0  # disconnect_stream: events read first


@dataclass
class Result:
    spec: Spec
    outcome: str
    status: int | None = None
    seconds: float = 0.0
    detail: str = ""
    choices: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)  # a chat's reasoning and content, NUL between
    logprobs: dict[int, list[tuple[float | None, float | None]]] = field(default_factory=dict)  # (sampled, best)
    usage: dict[str, Any] | None = None
    prefill_path: str | None = None
    t_start: float = 0.0  # time.monotonic()


class Mix:
    """Random requests over a fixed pool of prompts (reused, so that identical greedy and seeded
    inputs meet each other under different batches)."""

    def __init__(
        self,
        rng: random.Random,
        model: str,
        window: int,
        max_len: int,
        vocab: int,
        pool_seed: int = 0,
        mode: str = "asymmetric",
    ) -> None:
        self.model, self.window, self.max_len, self.vocab = model, window, max_len, vocab
        self.refuses_n = mode in FIRST_TOKEN_FROM_PREFILL  # n > 1: a 400 naming the mode
        # the prompts from their own seed: runs with different traffic seeds still share inputs (--compare)
        traffic, self.rng = rng, random.Random(pool_seed)
        rng = self.rng
        w = window
        lengths = [1, 2, 3, w - 2, w - 1, w, w + 1, w + 2, 2 * w - 1, 2 * w, 2 * w + 1, 40, 64, 100, 257, 600]
        self.id_prompts = [[rng.randrange(2, vocab - 20) for _ in range(n)] for n in lengths for _ in range(2)]
        self.long_ids = [[rng.randrange(2, vocab - 20) for _ in range(n)] for n in (max_len - 64, max_len - 8)]
        self.text_prompts = [self._words(n) for n in list(range(1, 14)) + [20, 30, 60, 150]]
        self.chats = [[{"role": "user", "content": self._words(n)}] for n in (1, 2, 4, 8, 12, 40)] + [
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": self._words(6)},
                {"role": "assistant", "content": self._words(3)},
                {"role": "user", "content": self._words(5)},
            ]
        ]
        self.rng = traffic

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def pick(self) -> Spec:
        r = self.rng.random()
        if r < 0.12:
            return self.bad()
        spec = self.good()
        r = self.rng.random()
        stream = bool(spec.body and spec.body.get("stream"))
        if r < 0.10 and stream:
            spec.action, spec.read_events = "disconnect_stream", self.rng.choice([0, 1, 2, 3, 5, 8])
        elif r < 0.16:
            spec.action, spec.delay = "cancel", self.rng.uniform(0.0, 1.5)
        elif r < 0.20:
            spec.action, spec.delay = "timeout", self.rng.uniform(0.01, 1.0)
        elif r < 0.23:
            spec.action = "partial_body"
        elif r < 0.28 and stream:
            spec.action, spec.delay = "slow_reader", self.rng.uniform(0.01, 0.1)
        if self.rng.random() < 0.2:
            spec.headers["X-Request-Id"] = self.rng.choice(DUP_IDS)
        return spec

    def sampling(self, body: dict[str, Any]) -> str:
        rng = self.rng
        s = rng.random()
        if s < 0.45:
            body["temperature"] = 0
            how = "greedy"
        elif s < 0.75:
            body["temperature"] = rng.choice([0.5, 0.8, 1.0])
            body["seed"] = rng.randrange(0, 50)
            how = "seeded"
        else:
            body["temperature"] = rng.choice([1.5, 2.0, 5.0])
            how = "hot"
        if how != "greedy" and rng.random() < 0.4:
            body["top_p"] = rng.choice([0.5, 0.9])
        if how != "greedy" and rng.random() < 0.3:
            body["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.25:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
        if rng.random() < 0.1:
            body["ignore_eos"] = True
        if rng.random() < 0.1:
            body["repetition_penalty"] = rng.choice([0.9, 1.2])
        if rng.random() < 0.1:
            body["frequency_penalty"] = rng.choice([-1.0, 1.0])
        return how

    def good(self) -> Spec:
        rng = self.rng
        chat = rng.random() < 0.35
        body: dict[str, Any] = {"model": self.model}
        if chat:
            body["messages"] = rng.choice(self.chats)
            thinking = rng.random() < 0.8
            if not thinking or rng.random() < 0.3:
                body["chat_template_kwargs"] = {"thinking": thinking}
            if thinking and rng.random() < 0.3:
                body["reasoning_effort"] = rng.choice(["low", "high", 10])
        else:
            r = rng.random()
            if r < 0.04:
                body["prompt"] = rng.choice(self.long_ids)
            elif r < 0.6:
                body["prompt"] = rng.choice(self.id_prompts)
            else:
                body["prompt"] = rng.choice(self.text_prompts)
        how = self.sampling(body)
        body["n"] = rng.choice([1, 1, 1, 2, 3, 4]) if rng.random() > 0.03 else rng.choice([8, 16])
        if self.refuses_n and body["n"] > 1 and rng.random() < 0.8:
            body["n"] = 1  # mostly requests it serves; the rest check the 400
        plen = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 200
        room = self.max_len - plen
        body["max_tokens"] = min(rng.choice([1, 2, 5, 8, 16, 24, 32]), room)
        if room < 64 and rng.random() < 0.5:
            body["max_tokens"] = room  # exactly to the end of the context
        if rng.random() < 0.1:
            body["min_tokens"] = rng.randint(1, body["max_tokens"])
        if chat and rng.random() < 0.2:
            body["max_completion_tokens"] = body.pop("max_tokens")
        body["stream"] = rng.random() < 0.5
        if body["stream"] and rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.2}
        if rng.random() < 0.85:
            body["return_token_ids"] = True
        if rng.random() < 0.25:
            if chat:
                body["logprobs"] = True
                body["top_logprobs"] = rng.randint(0, 5)
            else:
                body["logprobs"] = rng.randint(0, 5)
        elif not chat and rng.random() < 0.1:
            body["echo"] = True
        if body["n"] > 1 and self.refuses_n:
            return Spec("chat" if chat else "completion", body, expect="4xx", status=400, label="n>1 in mode")
        return Spec("chat" if chat else "completion", body, label=how)

    def bad(self) -> Spec:
        rng = self.rng
        base: dict[str, Any] = {"model": self.model, "prompt": rng.choice(self.text_prompts), "max_tokens": 4}
        ids = rng.choice(self.id_prompts)
        cases: list[tuple[str, dict[str, Any] | bytes, int | None]] = [
            ("n=17", {**base, "n": 17}, 400),
            ("n=0", {**base, "n": 0}, 400),
            ("best_of", {**base, "best_of": 2}, 400),
            ("negative temperature", {**base, "temperature": -1}, 400),
            ("huge temperature", {**base, "temperature": 1e39}, 400),
            ("max_tokens=0", {**base, "max_tokens": 0}, 400),
            ("empty prompt", {**base, "prompt": ""}, 400),
            ("empty ids", {**base, "prompt": []}, 400),
            ("echo+logprobs", {**base, "echo": True, "logprobs": 1}, 400),
            ("suffix", {**base, "suffix": "x"}, 400),
            ("batched", {**base, "prompt": ["a", "b"]}, 400),
            ("guided_json", {**base, "guided_json": {"type": "object"}}, 400),
            ("seed 2**64", {**base, "seed": 2**64}, 400),
            ("prompt at context", {**base, "prompt": [5] * self.max_len}, 400),
            ("over context", {**base, "prompt": ids, "max_tokens": self.max_len - len(ids) + 1}, 400),
            ("stream_options w/o stream", {**base, "stream_options": {"include_usage": True}}, 400),
            ("logprobs 21", {**base, "logprobs": 21}, 400),
            ("unknown model", {**base, "model": "nope"}, 404),
            ("stop empty", {**base, "stop": [""]}, 400),
            ("logit_bias key", {**base, "logit_bias": {"abc": 1}}, 400),
            ("token out of range", {**base, "prompt": [self.vocab + 5, 3]}, 400),
            ("negative token", {**base, "prompt": [3, -1]}, 400),
            ("frequency_penalty 3", {**base, "frequency_penalty": 3}, 400),
            ("top_p 0", {**base, "top_p": 0}, 400),
            ("stream as list", {**base, "stream": [1]}, 400),
            ("malformed JSON", b'{"prompt": "abc", ', 400),
            ("NaN", b'{"prompt": "abc", "temperature": NaN}', 400),
            ("lone surrogate", b'{"prompt": "ab\\ud800c", "max_tokens": 2}', 400),
            ("not an object", b'["prompt"]', 400),
            ("chat: empty messages", {"model": self.model, "messages": []}, 400),
            ("chat: developer", {"model": self.model, "messages": [{"role": "developer", "content": "x"}]}, 400),
            (
                "chat: tool_choice required",
                {"model": self.model, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
                400,
            ),
            (
                "chat: top_logprobs w/o logprobs",
                {"model": self.model, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                400,
            ),
            (
                "chat: unknown template kwarg",
                {"model": self.model, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"q": 1}},
                400,
            ),
        ]
        label, body, status = rng.choice(cases)
        kind = "chat" if label.startswith("chat:") else "completion"
        if isinstance(body, dict) and rng.random() < 0.5:
            body = {**body, "stream": True} if label not in ("stream as list", "stream_options w/o stream") else body
        if isinstance(body, bytes):
            return Spec(kind, None, expect="4xx", status=status, raw=body, label=label)
        return Spec(kind, body, expect="4xx", status=status, label=label)


# ---- sending and checking ---------------------------------------------------------------------------


def _path(kind: str) -> str:
    return "/v1/completions" if kind == "completion" else "/v1/chat/completions"


def _choice_tokens(c: dict[str, Any]) -> list[int] | None:
    return c.get("token_ids")


def _text(kind: str, c: dict[str, Any]) -> str:
    """A non-streamed choice's text (a chat's ``reasoning|content``)."""
    if kind == "completion":
        return c.get("text") or ""
    m = c.get("message") or {}
    return f"{m.get('reasoning') or ''}\0{m.get('content') or ''}"


def _logprobs(kind: str, lp: dict[str, Any] | None) -> list[tuple[float | None, float | None]]:
    """(the sampled token's logprob, the best of the top ones) per token."""
    if not lp:
        return []
    if kind == "completion":
        tops = lp.get("top_logprobs") or [None] * len(lp.get("token_logprobs") or [])
        return [(x, max(t.values()) if t else None) for x, t in zip(lp.get("token_logprobs") or [], tops, strict=False)]
    return [
        (e.get("logprob"), max((t["logprob"] for t in e.get("top_logprobs") or []), default=None))
        for e in lp.get("content") or []
    ]


PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias")


def check_choices(spec: Spec, res: Result) -> str | None:
    """Per choice: logprobs (one per token, a number, the best for greedy without penalties: logprobs
    are the model's raw ones), stop strings (never in the text, unless min_tokens held them back),
    echo (the prompt first)."""
    assert spec.body is not None
    b = spec.body
    wants_lp = b.get("logprobs") is not None and b.get("logprobs") is not False
    stops = [] if b.get("min_tokens") else b.get("stop") or []
    raw_argmax = spec.label == "greedy" and not any(b.get(k) for k in PENALTIES)
    for i, text in list(res.texts.items()):
        toks = res.choices.get(i)
        lps = res.logprobs.get(i, [])
        if wants_lp:
            if toks is not None and len(lps) != len(toks):
                return f"choice {i}: {len(lps)} logprobs for {len(toks)} tokens"
            for k, (x, best) in enumerate(lps):
                if not isinstance(x, (int, float)) or x > 1e-6:
                    return f"choice {i}: token {k}'s logprob is {x!r}"
                if raw_argmax and best is not None and x < best - 1e-4:
                    return f"choice {i}: greedy token {k} has logprob {x} under the best {best}"
        elif lps:
            return f"choice {i}: logprobs that were not asked for"
        body_text = text
        if b.get("echo") and spec.kind == "completion":
            p = b["prompt"]
            if isinstance(p, str):
                if not text.startswith(p):
                    return f"choice {i}: echo without the prompt first: {text[:80]!r}"
                body_text = text[len(p) :]
            else:  # the prompt's ids decoded in front: not compared
                res.texts.pop(i)
                continue
        res.texts[i] = body_text  # echo's prompt left out: compared across requests
        parts = body_text.split("\0", 1)
        if not b.get("include_stop_str_in_output"):
            for st in stops:
                if any(st in part for part in parts):
                    return f"choice {i}: stop string {st!r} in the text {body_text[:120]!r}"
    return None


def check_body(spec: Spec, body: dict[str, Any], res: Result) -> str | None:
    """A non-streamed 200's problems (None if none); fills ``res``."""
    want_n = spec.body.get("n", 1) if spec.body else 1
    choices = body.get("choices")
    if not isinstance(choices, list) or sorted(c.get("index") for c in choices) != list(range(want_n)):
        return f"choices' indices {[c.get('index') for c in choices or []]} for n={want_n}"
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length", "tool_calls"):
            return f"choice {c.get('index')} finish_reason {c.get('finish_reason')!r}"
        res.finish[c["index"]] = c["finish_reason"]
        toks = _choice_tokens(c)
        if toks is not None:
            res.choices[c["index"]] = toks
        res.texts[c["index"]] = _text(spec.kind, c)
        res.logprobs[c["index"]] = _logprobs(spec.kind, c.get("logprobs"))
    res.usage = body.get("usage")
    res.prefill_path = (body.get("asympd_timings") or {}).get("prefill_path")
    return check_usage(spec, res) or check_choices(spec, res)


def check_usage(spec: Spec, res: Result) -> str | None:
    u = res.usage
    assert spec.body is not None
    if u is None:
        return None if spec.body.get("stream") else "no usage"
    if u.get("total_tokens") != u.get("prompt_tokens", 0) + u.get("completion_tokens", 0):
        return f"usage total {u}"
    want_n = spec.body.get("n", 1)
    max_t = spec.body.get("max_tokens") or spec.body.get("max_completion_tokens")
    if spec.body.get("return_token_ids"):
        if len(res.choices) != want_n:
            return f"token ids for {sorted(res.choices)} of n={want_n}"
        total = sum(len(t) for t in res.choices.values())
        if u.get("completion_tokens") != total:
            return f"completion_tokens {u.get('completion_tokens')} != {total} summed over the choices"
        for i, t in res.choices.items():
            if max_t is not None and len(t) > max_t:
                return f"choice {i}: {len(t)} tokens > max_tokens {max_t}"
            if max_t is not None and res.finish.get(i) == "length" and len(t) != max_t:
                return f"choice {i}: finish_reason length after {len(t)} of max_tokens {max_t}"
    elif max_t is not None and u.get("completion_tokens", 0) > want_n * max_t:
        return f"completion_tokens {u.get('completion_tokens')} > n * max_tokens"
    return None


async def read_stream(spec: Spec, r: httpx.Response, res: Result) -> str | None:
    """A 200 stream's problems (None if none); fills ``res``. Reads it whole."""
    assert spec.body is not None
    done, errors, events = False, [], 0
    toks: dict[int, list[int]] = defaultdict(list)
    reasoning: dict[int, str] = defaultdict(str)
    texts: dict[int, str] = defaultdict(str)
    lps: dict[int, list] = defaultdict(list)
    buf = ""
    async for line in r.aiter_lines():
        buf = line
        if not line.startswith("data: "):
            continue
        if done:
            return "data after [DONE]"
        if spec.action == "slow_reader":
            await asyncio.sleep(spec.delay)
        if line == "data: [DONE]":
            done = True
            continue
        try:
            ev = json.loads(line[6:])
        except ValueError:
            return f"an event that is not JSON: {line[:200]!r}"
        events += 1
        if "error" in ev:
            errors.append(ev["error"])
            continue
        for c in ev.get("choices") or []:
            i = c["index"]
            if i in res.finish:
                return f"choice {i}: a chunk after its finish_reason"
            toks[i] += c.get("token_ids") or []
            if spec.kind == "completion":
                texts[i] += c.get("text") or ""
            else:
                d = c.get("delta") or {}
                reasoning[i] += d.get("reasoning") or ""
                texts[i] += d.get("content") or ""
            lps[i] += _logprobs(spec.kind, c.get("logprobs"))
            if c.get("finish_reason") is not None:
                res.finish[i] = c["finish_reason"]
        if ev.get("usage") and not ev.get("choices"):
            res.usage = ev["usage"]
        if ev.get("asympd_timings"):
            res.prefill_path = ev["asympd_timings"].get("prefill_path")
    if not done:
        return f"the stream ended without [DONE] after {events} events (last line {buf[:100]!r})"
    if errors:
        return f"error event: {errors[0]}"
    want_n = spec.body.get("n", 1)
    if sorted(res.finish) != list(range(want_n)):
        return f"finish reasons for {sorted(res.finish)} of n={want_n}"
    if spec.body.get("return_token_ids"):
        res.choices = {i: toks.get(i, []) for i in range(want_n)}
    for i in range(want_n):
        res.texts[i] = texts[i] if spec.kind == "completion" else f"{reasoning[i]}\0{texts[i]}"
        res.logprobs[i] = lps[i]
    if spec.body.get("stream_options", {}).get("include_usage") and res.usage is None:
        return "include_usage without a usage chunk"
    return check_usage(spec, res) or check_choices(spec, res)


def _bad_status(spec: Spec, status: int, text: str) -> str | None:
    if spec.expect == "4xx":
        if spec.status is not None and status != spec.status:
            return f"expected {spec.status}, got {status}: {text[:300]}"
        if not 400 <= status < 500:
            return f"expected a 4xx, got {status}: {text[:300]}"
        try:
            err = json.loads(text)["error"]
            assert err["code"] == status and err["message"]
        except Exception:
            return f"a {status} without the error shape: {text[:300]}"
        return None
    if status != 200:
        return f"status {status}: {text[:300]}"
    return None


async def send(client: httpx.AsyncClient, url: str, spec: Spec, timeout: float) -> Result:
    t0 = time.perf_counter()
    res = Result(spec, "ok", t_start=time.monotonic())
    content = spec.raw if spec.raw is not None else json.dumps(spec.body).encode()
    headers = {"Content-Type": "application/json", **spec.headers}
    target = url + _path(spec.kind)
    stream = bool(spec.body and spec.body.get("stream") is True)
    try:
        if spec.action == "partial_body":
            await partial_body(target, content, headers)
            res.outcome = "client_partial_body"
        elif spec.action == "cancel":
            task = asyncio.ensure_future(_whole(client, target, content, headers, timeout, spec, res, stream))
            try:
                await asyncio.wait_for(asyncio.shield(task), spec.delay)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                res.outcome = "client_cancel"
            else:
                pass  # finished before the cancel: checked as a normal request
        elif spec.action == "timeout":
            t = httpx.Timeout(spec.delay, connect=5)
            try:
                await _whole(client, target, content, headers, t, spec, res, stream)
            except httpx.TimeoutException:
                res.outcome = "client_timeout"
        elif spec.action == "disconnect_stream":
            async with client.stream("POST", target, content=content, headers=headers, timeout=timeout) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    problem = _bad_status(spec, r.status_code, (await r.aread()).decode(errors="replace"))
                    res.outcome, res.detail = ("expected_4xx", "") if not problem else ("bad_status", problem)
                    if problem and r.status_code >= 500:
                        res.outcome = "server_error"
                else:
                    n = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            n += 1
                        if n >= spec.read_events:
                            break
                    res.outcome = "client_disconnect_stream"
        else:
            await _whole(client, target, content, headers, timeout, spec, res, stream)
    except httpx.TimeoutException as e:
        res.outcome, res.detail = "hang", f"{type(e).__name__} after {time.perf_counter() - t0:.1f} s"
    except httpx.HTTPError as e:
        res.outcome, res.detail = "connection_error", f"{type(e).__name__}: {e}"
    except Exception as e:
        res.outcome, res.detail = "driver_error", f"{type(e).__name__}: {e}"
    res.seconds = time.perf_counter() - t0
    return res


async def _whole(
    client: httpx.AsyncClient,
    target: str,
    content: bytes,
    headers: dict[str, str],
    timeout: Any,
    spec: Spec,
    res: Result,
    stream: bool,
) -> None:
    async with client.stream("POST", target, content=content, headers=headers, timeout=timeout) as r:
        res.status = r.status_code
        if r.status_code != 200 or not stream:
            text = (await r.aread()).decode(errors="replace")
            problem = _bad_status(spec, r.status_code, text)
            if problem:
                res.outcome, res.detail = ("server_error" if r.status_code >= 500 else "bad_status"), problem
                return
            if spec.expect == "4xx":
                res.outcome = "expected_4xx"
                return
            if stream:
                res.outcome, res.detail = "bad_status", "a stream answered 200 without SSE"
                return
            if "text/event-stream" in r.headers.get("content-type", ""):
                res.outcome, res.detail = "bad_body", "SSE for a non-streamed request"
                return
            try:
                body = json.loads(text)
            except ValueError:
                res.outcome, res.detail = "bad_body", f"not JSON: {text[:300]!r}"
                return
            problem = check_body(spec, body, res)
        else:
            if spec.expect == "4xx":
                res.outcome, res.detail = "bad_status", "a bad request answered 200"
                return
            problem = await read_stream(spec, r, res)
        if problem:
            res.outcome, res.detail = "bad_body", problem


async def partial_body(target: str, content: bytes, headers: dict[str, str]) -> None:
    """Headers and part of the body on a raw connection, then close it."""
    u = httpx.URL(target)
    reader, writer = await asyncio.open_connection(u.host, u.port)
    head = [f"POST {u.raw_path.decode()} HTTP/1.1", f"Host: {u.host}:{u.port}", f"Content-Length: {len(content)}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + content[: max(len(content) // 2, 1) - 1])
    with contextlib.suppress(Exception):
        await writer.drain()
        await asyncio.sleep(random.uniform(0, 0.2))
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


# ---- cross-request checks ---------------------------------------------------------------------------


def _canon(spec: Spec, drop: tuple[str, ...]) -> str:
    assert spec.body is not None
    body = {k: v for k, v in spec.body.items() if k not in drop}
    return json.dumps([spec.kind, body], sort_keys=True)


VIEW_ONLY = ("stream", "stream_options", "n", "logprobs", "top_logprobs", "return_token_ids", "model", "echo")


def determinism(
    results: list[Result], apart: tuple[str, ...] = ()
) -> tuple[list[dict[str, Any]], dict[str, list[int]], int]:
    """Greedy: one token sequence per input (a shorter max_tokens a prefix of a longer one); seeded:
    one per input and seed + choice index; the answers of a ``prefill_path`` in ``apart`` are
    compared among themselves only. Problems, the greedy sequences, and how many inputs were met
    more than once."""
    groups: dict[str, list[tuple[list[int], str | None, int, Result, str | None]]] = defaultdict(list)
    for r in results:
        if r.outcome != "ok" or not r.choices or r.spec.body is None:
            continue
        b = r.spec.body
        max_t = b.get("max_tokens") or b.get("max_completion_tokens")
        drop = (*VIEW_ONLY, "max_tokens", "max_completion_tokens", "seed")
        path = f"[{r.prefill_path}]" if r.prefill_path in apart else ""
        if r.spec.label == "greedy":
            key = f"greedy{path} " + _canon(r.spec, drop)
            for i, toks in r.choices.items():
                groups[key].append((toks, r.finish.get(i), max_t, r, r.texts.get(i)))
        elif r.spec.label == "seeded":
            for i, toks in r.choices.items():
                key = f"seed{path} {b['seed'] + i} " + _canon(r.spec, drop)
                groups[key].append((toks, r.finish.get(i), max_t, r, r.texts.get(i)))
    problems, greedy, repeated = [], {}, 0
    for key, items in groups.items():
        if len(items) > 1:
            repeated += 1
        items.sort(key=lambda x: len(x[0]))
        longest = items[-1][0]
        if key.startswith("greedy"):
            greedy[key] = longest
        texts: dict[tuple[int, ...], set[str]] = defaultdict(set)
        for toks, _, max_t, _, text in items:
            if text is not None:
                texts[(max_t, *toks)].add(text)
        for same, seen in texts.items():
            if len(seen) > 1:
                problems.append({"key": key[:300], "tokens": list(same[1:]), "texts": sorted(seen)})
        for toks, finish, max_t, r, _ in items:
            ok = longest[: len(toks)] == toks and (finish == "length" or len(toks) == len(longest))
            if not ok:
                problems.append(
                    {
                        "key": key[:300],
                        "tokens": toks,
                        "finish": finish,
                        "max_tokens": max_t,
                        "longest": longest,
                        "prefill_path": r.prefill_path,
                        "paths": sorted({str(x[3].prefill_path) for x in items}),
                    }
                )
    return problems, greedy, repeated


def tokenize_key(spec: Spec) -> tuple[str, dict[str, Any]] | None:
    assert spec.body is not None
    if spec.kind == "completion":
        p = spec.body["prompt"]
        return (None, None) if isinstance(p, list) else (json.dumps(p), {"prompt": p})  # type: ignore[return-value]
    keys = ("messages", "chat_template_kwargs", "reasoning_effort", "tools", "tool_choice", "response_format")
    body = {k: spec.body[k] for k in keys if k in spec.body}
    return json.dumps(body, sort_keys=True), body


async def check_prompt_counts(client: httpx.AsyncClient, url: str, results: list[Result]) -> list[dict[str, Any]]:
    """``usage.prompt_tokens`` against /tokenize (or the ids' count) for every answer with usage."""
    problems, cache = [], {}
    for r in results:
        if r.outcome != "ok" or r.usage is None or r.spec.body is None:
            continue
        key, body = tokenize_key(r.spec)
        if key is None:
            want = len(r.spec.body["prompt"])
        else:
            if key not in cache:
                t = await client.post(f"{url}/tokenize", json=body, timeout=30)
                cache[key] = t.json()["count"] if t.status_code == 200 else f"tokenize {t.status_code}: {t.text}"
            want = cache[key]
        if r.usage.get("prompt_tokens") != want:
            problems.append({"body": r.spec.body, "usage": r.usage, "tokenize": want})
    return problems


# ---- a worker killed mid-traffic (--kill NAME@S, --restart-after S) ---------------------------------


@dataclass
class Kill:
    name: str
    at: float  # seconds into the traffic
    url: str = ""
    t: float | None = None  # time.monotonic() of the SIGKILL
    in_flight: dict[str, int] = field(default_factory=dict)  # the outcomes of the requests in flight then
    restarted_s: float | None = None  # SIGKILL to ready again
    routed_s: float | None = None  # SIGKILL to the router seeing it healthy again
    events: list[str] = field(default_factory=list)


def parse_kill(text: str) -> Kill:
    name, _, at = text.partition("@")
    return Kill(name, float(at or 10))


async def chaos(kill: Kill, dep: Deployment, log_dir: str, restart_after: float | None, t0: float) -> None:
    """SIGKILL one process ``kill.at`` seconds into the traffic; with ``restart_after``, start it
    again on its port that much later and wait until the router routes to it again."""
    p = dep.proc(kill.name)
    kill.url = p.url or ""
    await asyncio.sleep(max(0.0, t0 + kill.at - time.monotonic()))
    assert p.proc is not None
    p.proc.kill()
    kill.t = time.monotonic()
    kill.events.append(f"{kill.t - t0:.1f} s: SIGKILL {kill.name} ({p.pid})")
    if restart_after is None:
        return
    await asyncio.sleep(restart_after)
    await asyncio.to_thread(p.proc.wait, 10)
    new = await asyncio.to_thread(dep.restart, kill.name, log_dir)
    kill.restarted_s = time.monotonic() - kill.t
    kill.events.append(f"{time.monotonic() - t0:.1f} s: {kill.name} ready again on {new.url} ({new.pid})")
    async with httpx.AsyncClient() as c:
        for _ in range(240):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                h = (await c.get(f"{dep.url}/health", timeout=2)).json()
                if any(w["url"] == kill.url and w.get("healthy") for w in h["workers"]):
                    kill.routed_s = time.monotonic() - kill.t
                    kill.events.append(f"{time.monotonic() - t0:.1f} s: the router sees {kill.name} healthy")
                    return
            await asyncio.sleep(0.25)


def excuse_killed(results: list[Result], kill: Kill) -> None:
    """docs/serving.md "Failure policies": a decode worker dying mid-request ends that request with
    the router's 502 (JSON, or an SSE error event and ``[DONE]``); only requests in flight at the
    SIGKILL may; while no decode worker is left, the router answers 503 "no healthy decode worker".
    A prefill worker's death is covered by the fallbacks, but for a prefix it was streaming
    (``--stream-prefix``): D fails that request with a 503 naming the broken stream; and a D that
    runs ``--on-prefill-failure fail`` answers 503 (its message names the policy) to what met the
    router while the only P was down."""
    if kill.t is None:
        return
    back = kill.t + kill.routed_s if kill.routed_s is not None else float("inf")
    for r in results:
        in_flight = r.t_start <= kill.t <= r.t_start + r.seconds
        down = r.t_start + r.seconds >= kill.t and r.t_start <= back  # it met the router without the worker
        if r.outcome == "server_error" and "no healthy decode worker" in r.detail and down:
            r.outcome = "no_decode_worker_503"
        said_502 = r.detail.startswith("status 502") or (r.detail.startswith("error event") and "502" in r.detail)
        if in_flight and kill.name.startswith("decode") and r.outcome in ("server_error", "bad_body") and said_502:
            r.outcome = "killed_in_flight_502"
        stream_broke = "the streamed prefix from the prefill worker failed" in r.detail
        if in_flight and kill.name.startswith("prefill") and r.outcome in ("server_error", "bad_body") and stream_broke:
            r.outcome = "killed_stream_503"
        under_fail = "status 503" in r.detail and "runs --on-prefill-failure=fail" in r.detail
        if down and kill.name.startswith("prefill") and r.outcome == "server_error" and under_fail:
            r.outcome = "prefill_down_503_under_fail"
        if in_flight:
            kill.in_flight[r.outcome] = kill.in_flight.get(r.outcome, 0) + 1


# ---- the run ----------------------------------------------------------------------------------------


async def soak(
    args: argparse.Namespace, url: str, dep: Deployment | None = None, log_dir: str | None = None
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 4, max_keepalive_connections=args.concurrency * 2)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(args.request_timeout, connect=10)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        tk = (await client.post(f"{url}/tokenize", json={"prompt": "a"})).json()
        max_len = tk["max_model_len"]
        workers, is_router = worker_urls(url)
        info = httpx.get(f"{workers[-1]}/asympd/info", timeout=5).json()
        mode = info.get("mode", "")
        mix = Mix(rng, model, info["window_size"], max_len, info["vocab_size"], args.pool_seed, mode)
        results: list[Result] = []
        end = time.monotonic() + args.duration
        in_flight = Counter()

        async def client_loop(i: int) -> None:
            while time.monotonic() < end:
                spec = mix.pick()
                in_flight["now"] += 1
                in_flight["max"] = max(in_flight["max"], in_flight["now"])
                try:
                    results.append(await send(client, url, spec, args.request_timeout))
                finally:
                    in_flight["now"] -= 1

        t0 = time.monotonic()
        kill = parse_kill(args.kill) if args.kill else None
        jobs = [client_loop(i) for i in range(args.concurrency)]
        if kill is not None:
            assert dep is not None and log_dir is not None, "--kill needs --deploy"
            jobs.append(chaos(kill, dep, log_dir, args.restart_after, t0))
        await asyncio.gather(*jobs)
        traffic_s = time.monotonic() - t0
        gone = {kill.url} if kill is not None and kill.restarted_s is None else set()
        workers = [w for w in workers if w not in gone]
        if kill is not None:
            excuse_killed(results, kill)

        # back to idle: every worker, and the router's own bookkeeping
        t_idle, idle, last = time.monotonic(), False, {}
        while time.monotonic() - t_idle < args.idle_timeout:
            last = {w: {k: v for k, v in scrape(w).items() if k in IDLE_GAUGES} for w in workers}
            idle = all(v == 0 for m in last.values() for v in m.values()) and all(
                len(m) == len(IDLE_GAUGES) for m in last.values()
            )
            if idle:
                break
            await asyncio.sleep(0.25)
        idle_after = time.monotonic() - t_idle
        router_state: dict[str, Any] = {}
        if is_router:
            h = (await client.get(f"{url}/health")).json()
            router_state = {
                w["url"]: {"outstanding_tokens": w["outstanding_tokens"], "inflight": w["inflight"]}
                for w in h["workers"]
            }
        counters = {}
        for w in workers:
            m = scrape(w)
            counters[w] = {
                k: v
                for k, v in m.items()
                if v
                and not k.endswith("_created")
                and k.startswith(
                    (
                        "asympd_request_errors_total",
                        "asympd_num_preemptions_total",
                        "asympd_prefill_fallbacks_total",
                        "asympd_transfer_failures_total",
                        "asympd_request_total",
                        "asympd_kv_blocks_total",
                        "asympd_prefix_cache_hits_total",
                        "asympd_spec_decode_num_",
                        "asympd_transfers_total",
                    )
                )
            }
        restarted: dict[str, Any] = {}
        if kill is not None and kill.restarted_s is not None:  # the router sent the restarted worker work again
            steps = scrape(kill.url).get("asympd_engine_steps_total", 0)
            routed = bool(steps) and kill.routed_s is not None
            restarted = {"url": kill.url, "engine_steps": steps, "routed_again": routed}
        prompt_problems = await check_prompt_counts(client, url, results)
        router_metrics = scrape(url) if is_router else {}

    # mode symmetric's recompute is colocated decoder-replay, not what its P/D pair computes (docs/serving.md)
    det_problems, greedy, repeated = determinism(results, ("recompute",) if mode == "symmetric" else ())
    outcomes = Counter(r.outcome for r in results)
    bad = [r for r in results if r.outcome in ("bad_status", "bad_body", "server_error", "connection_error", "hang")]
    bad += [r for r in results if r.outcome == "driver_error"]
    labels = Counter(f"{r.spec.label}:{r.outcome}" for r in results if r.spec.expect == "4xx")
    return {
        "url": url,
        "seed": args.seed,
        "duration_s": round(traffic_s, 1),
        "concurrency": args.concurrency,
        "max_in_flight": in_flight["max"],
        "requests": len(results),
        "outcomes": dict(outcomes),
        "by_kind": dict(
            Counter(
                f"{r.spec.kind}/{'stream' if r.spec.body and r.spec.body.get('stream') else 'json'}" for r in results
            )
        ),
        "sampling": dict(Counter(r.spec.label for r in results if r.spec.expect == "ok")),
        "prefill_paths": dict(Counter(str(r.prefill_path) for r in results if r.outcome == "ok")),
        "bad_requests": dict(labels),
        "latency_s": _quantiles([r.seconds for r in results if r.outcome == "ok" and r.spec.action != "slow_reader"]),
        "slowest": [
            {
                "seconds": round(r.seconds, 1),
                "outcome": r.outcome,
                "action": r.spec.action,
                "prefill_path": r.prefill_path,
                "body": {
                    k: (f"<{len(v)}>" if k in ("prompt", "messages") else v) for k, v in (r.spec.body or {}).items()
                },
            }
            for r in sorted(results, key=lambda r: -r.seconds)[:5]
        ],
        "problems": [
            {
                "outcome": r.outcome,
                "detail": r.detail,
                "label": r.spec.label,
                "action": r.spec.action,
                "headers": r.spec.headers,
                "body": r.spec.body if r.spec.raw is None else r.spec.raw.decode(),
                "seconds": round(r.seconds, 2),
            }
            for r in bad
        ],
        "determinism_inputs_repeated": repeated,
        "determinism_problems": det_problems,
        "prompt_count_problems": prompt_problems,
        "idle": idle,
        "idle_after_s": round(idle_after, 2),
        "idle_metrics": last,
        "router_workers": router_state,
        "worker_counters": counters,
        "router_requests": {
            k: v for k, v in router_metrics.items() if k.startswith(("asympd_router_requests", "asympd_router_ab"))
        },
        "kill": None if kill is None else {k: v for k, v in vars(kill).items() if k != "t"},
        "restarted": restarted,
        "greedy": greedy,
    }


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    return {f"p{q}": round(xs[min(int(len(xs) * q / 100), len(xs) - 1)], 3) for q in (50, 90, 99, 100)}


def scan_logs(log_dir: str | None) -> dict[str, list[str]]:
    if not log_dir:
        return {}
    out = {}
    for p in sorted(Path(log_dir).glob("*.log")):
        lines = p.read_text(errors="replace").splitlines()
        hits = [f"{i + 1}: {ln[:300]}" for i, ln in enumerate(lines) if LOG_BAD.search(ln)]
        if hits:
            out[p.name] = hits[:50]
    return out


def compare(summary: dict[str, Any], other_path: str) -> list[dict[str, Any]]:
    other = json.loads(Path(other_path).read_text()).get("greedy", {})
    out = []
    for key, toks in summary["greedy"].items():
        if key in other:
            a, b = toks, other[key]
            n = min(len(a), len(b))
            if a[:n] != b[:n]:
                out.append({"key": key[:300], "here": a, "there": b})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running deployment's address (router or worker)")
    where.add_argument("--deploy", choices=sorted(DEPLOYS), help="start this deployment here")
    ap.add_argument("--checkpoint", help="with --deploy (default: a tiny random one, written to a temp folder)")
    ap.add_argument("--mode", default="asymmetric", choices=PD_MODES, help="the P/D workers' (--deploy)")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "nixl", "auto"])
    ap.add_argument("--worker-arg", action="append", default=[], help="one more argument for every worker")
    ap.add_argument("--prefill-arg", action="append", default=[], help="one more for prefill workers (--stream-prefix)")
    ap.add_argument("--decode-arg", action="append", default=[], help="one more for decode workers (--num-spec-tokens)")
    ap.add_argument("--router-arg", action="append", default=[], help="one more for the router")
    ap.add_argument("--kill", metavar="NAME@S", help="SIGKILL NAME (prefill0, decode1, ...) S s into the traffic")
    ap.add_argument("--restart-after", type=float, help="with --kill: start it again on its port this much later")
    ap.add_argument("--log-dir", help="where the processes log (--deploy: default a temp folder; kept)")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of traffic")
    ap.add_argument("--concurrency", type=int, default=24, help="clients, each with one request in flight")
    ap.add_argument("--seed", type=int, default=0, help="the traffic's")
    ap.add_argument("--pool-seed", type=int, default=0, help="the prompts' (keep it to --compare runs)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="longer than this is a hang")
    ap.add_argument("--idle-timeout", type=float, default=15.0, help="seconds for the workers to come back idle")
    ap.add_argument("--compare", help="another run's summary: greedy tokens of inputs both ran must agree")
    ap.add_argument("--out", help="the JSON summary (default: stdout only)")
    args = ap.parse_args(argv)

    dep: Deployment | None = None
    log_dir = args.log_dir
    if args.deploy:
        log_dir = log_dir or tempfile.mkdtemp(prefix=f"asympd-soak-{args.deploy}-")
        ckpt = args.checkpoint
        if ckpt is None:
            from asympd.config import tiny
            from asympd.model.checkpoint import write_checkpoint

            ckpt = str(Path(tempfile.mkdtemp(prefix="asympd-soak-ckpt-")) / "tiny")
            write_checkpoint(tiny(), ckpt, seed=0)
        dep = start_deployment(
            args.deploy,
            ckpt,
            log_dir,
            args.mode,
            args.transport,
            args.worker_arg,
            args.prefill_arg,
            args.decode_arg,
            args.router_arg,
        )
        url = dep.url
        print(f"{args.deploy} on {url}; logs in {log_dir}", flush=True)
    else:
        url = args.url.rstrip("/")
    try:
        summary = asyncio.run(soak(args, url, dep, log_dir))
        summary["deploy"] = args.deploy
        summary["mode"] = args.mode if args.deploy != "colocated" else None
        procs = dep.procs if dep else []
        killed = [p for p in procs if args.kill and p.name == parse_kill(args.kill).name][:1]  # not its restart
        dead = [p for p in procs if not p.alive() and p not in killed]
        summary["processes_dead"] = [f"{p.name} ({p.proc.returncode})" for p in dead]
    finally:
        stop_all(dep.procs if dep else [])
    summary["log_findings"] = scan_logs(log_dir)
    summary["log_dir"] = log_dir
    if args.compare:
        summary["compare_problems"] = compare(summary, args.compare)
        other = json.loads(Path(args.compare).read_text()).get("greedy", {})
        summary["compared_inputs"] = len(set(summary["greedy"]) & set(other))
    clean = (
        not summary["problems"]
        and not summary["determinism_problems"]
        and not summary["prompt_count_problems"]
        and summary["idle"]
        and not summary["processes_dead"]
        and not summary["log_findings"]
        and not summary.get("compare_problems")
        and all(v == {"outstanding_tokens": 0, "inflight": 0} for v in summary["router_workers"].values())
        and (args.restart_after is None or summary["restarted"].get("routed_again"))
    )
    summary["clean"] = clean
    text = json.dumps(summary, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    short = {k: v for k, v in summary.items() if k not in ("greedy", "problems")}
    short["problems"] = summary["problems"][:10]
    print(json.dumps(short, indent=1, default=str)[:20000])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
