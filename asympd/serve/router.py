"""The router: the one address clients need in front of xPyD prefill and decode workers.

Per request: pick a prefill worker (P) by load, send it the client's body plus
``kv_transfer_params={"do_remote_decode": true}``, then send the body plus P's returned
``kv_transfer_params`` to a decode worker (D) and relay D's answer (SSE streams byte for byte).

* Asymmetric mode, prompt of N <= W tokens: P has nothing to compute, so it is skipped and D
  prefills the whole prompt. The router counts tokens with the checkpoint's tokenizer.json and
  chat template: from ``--checkpoint DIR`` if given, else fetched once from a healthy worker
  (``GET /asympd/tokenizer.json``, window size from ``GET /asympd/info``). Until it has them,
  every request goes through P (always correct, only slower).
* Load = outstanding tokens (prompt on P; prompt + max_tokens on D) of requests in flight; the
  least loaded healthy worker wins, ties round-robin.
* Workers are health-checked (``GET /health``) every ``health_interval`` seconds; a failing one
  (or one that refuses connections) gets no traffic until it passes again. Workers whose mode or
  model fingerprint disagree with the rest are not used.
* P failing (5xx, timeout, connection refused with no other P left): D is still called, with
  ``kv_transfer_params={"do_remote_prefill": true, "prefill_failed": reason}``; D's
  ``--on-prefill-failure`` decides (recompute, or 503). A 4xx from P goes back to the client.
* D dying mid-stream: the client gets an SSE error event, then ``[DONE]``; before the stream
  starts: a 502 (or the next D when the connection was refused).
* The client leaving: the router stops relaying (which cancels D's stream) and calls
  ``POST /asympd/abort`` on P and D, so their engines abort the request and free its blocks.
* Trust: clients authenticate with the client key; the router talks to the workers with the
  internal credential only (the client's ``Authorization`` never reaches a worker), and drops any
  ``kv_transfer_params`` a client sent.
* Long requests are bounded by progress, not total time: D streams tokens (or, for a non-streamed
  request, a byte of whitespace as tokens come), and ``stream_idle_timeout`` is the longest wait
  for its next bytes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from asympd.engine import modes
from asympd.serve import protocol as P
from asympd.serve.http import (
    DEFAULT_MAX_BODY_BYTES,
    INTERNAL_HEADER,
    ClientDisconnected,
    GuardedStreamingResponse,
    bind_socket,
    check_bearer,
    check_body_limit,
    client_key,
    install_error_handlers,
    internal_key,
    internal_token,
    listen_url,
    read_body,
    run_app,
    setup_logging,
    unique_request_id,
    until_disconnect,
)
from asympd.serve.metrics import CONTENT_TYPE, RouterMetrics

log = logging.getLogger("asympd.router")

PROGRESS_HEADER = "X-Asympd-Progress"  # asks D for progress bytes on a non-streamed request


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str | None = None  # None: whatever the workers report
    checkpoint: str | None = None
    api_key: str | None = None  # argv is visible in `ps`: prefer api_key_file or $ASYMPD_API_KEY
    api_key_file: str | None = None
    internal_key_file: str | None = None  # None: $ASYMPD_INTERNAL_KEY, else the per-user key file
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    health_interval: float = 1.0
    connect_timeout: float = 2.0
    prefill_timeout: float = 60.0  # the whole prefill call
    stream_idle_timeout: float = 60.0  # progress timeout: longest wait for D's next bytes, streamed or not
    abort_timeout: float = 2.0


@dataclass
class Worker:
    url: str
    kind: str  # "prefill" | "decode"
    healthy: bool = False
    checked: bool = False
    reason: str = "not checked yet"
    info: dict[str, Any] = field(default_factory=dict)
    outstanding_tokens: int = 0
    inflight: int = 0

    def state(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "kind": self.kind,
            "healthy": self.healthy,
            "reason": self.reason,
            "outstanding_tokens": self.outstanding_tokens,
            "inflight": self.inflight,
            "role": self.info.get("role"),
            "mode": self.info.get("mode"),
        }


def _check_config(cfg: RouterConfig) -> None:
    """What the router cannot run with, as ValueErrors the command line prints."""
    if not cfg.decode:
        raise ValueError("give at least one --decode worker URL")
    if cfg.mode is not None and cfg.mode not in modes.MODES:
        raise ValueError(f"unknown mode {cfg.mode!r}")
    if cfg.mode == "colocated" and cfg.prefill:
        raise ValueError("--mode colocated routes to colocated workers (--decode) only: drop --prefill")
    for flag, urls in (("--prefill", cfg.prefill), ("--decode", cfg.decode)):
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{flag} {url!r} is not an http(s)://host:port URL")
    for flag, seconds in (
        ("--health-interval", cfg.health_interval),
        ("--prefill-timeout", cfg.prefill_timeout),
        ("--progress-timeout", cfg.stream_idle_timeout),
        ("connect_timeout", cfg.connect_timeout),
        ("abort_timeout", cfg.abort_timeout),
    ):
        if not seconds > 0:
            raise ValueError(f"{flag} must be a positive number of seconds, got {seconds}")
    check_body_limit(cfg.max_body_bytes)


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        _check_config(cfg)
        if cfg.mode in modes.PD_MODES and not cfg.prefill:
            log.warning("mode %s without --prefill workers: every request is prefilled on a decode worker", cfg.mode)
        self.cfg = cfg
        self.api_key = client_key(cfg.api_key, cfg.api_key_file)
        self.internal = {INTERNAL_HEADER: internal_token(internal_key(cfg.internal_key_file))}
        self.max_token_chars = 1
        self.prefill = [Worker(u.rstrip("/"), "prefill") for u in cfg.prefill]
        self.decode = [Worker(u.rstrip("/"), "decode") for u in cfg.decode]
        self.metrics = RouterMetrics()
        self.metrics.workers.workers = self.prefill + self.decode
        self.tokenizer: Any = None
        self.window: int | None = None
        self.max_seq_len: int | None = None
        self.model_names: set[str] = set()
        self.fingerprint: str | None = None
        self._rr = {"prefill": itertools.count(), "decode": itertools.count()}  # one per pool: ties alternate
        self._health_task: asyncio.Task | None = None
        self._abort_tasks: set[asyncio.Task] = set()
        self.client: httpx.AsyncClient | None = None
        if cfg.checkpoint:
            self._load_checkpoint_meta(cfg.checkpoint)

    # ---- tokenizer and window --------------------------------------------------------------------------

    def _load_checkpoint_meta(self, checkpoint: str) -> None:
        from asympd.engine.llm import load_tokenizer
        from asympd.model.checkpoint import load_config

        cfg = load_config(checkpoint)
        self.window, self.max_seq_len = cfg.window_size, cfg.max_seq_len
        self._set_tokenizer(load_tokenizer(checkpoint))

    def _set_tokenizer(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None:  # one character per byte in a byte-level vocabulary: a bound on text per token
            self.max_token_chars = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)

    async def _fetch_meta(self, w: Worker) -> None:
        """Window size and tokenizer from a worker, once (unless --checkpoint gave them)."""
        assert self.client is not None
        if self.window is None:
            self.window, self.max_seq_len = w.info.get("window_size"), w.info.get("max_seq_len")
        if self.tokenizer is None and w.info.get("has_tokenizer"):
            from tokenizers import Tokenizer

            r = await self.client.get(f"{w.url}/asympd/tokenizer.json", timeout=10, headers=self.internal)
            r.raise_for_status()
            self._set_tokenizer(Tokenizer.from_str(r.text))
            log.info("tokenizer and window (%s) from %s", self.window, w.url)

    @property
    def mode(self) -> str | None:
        if self.cfg.mode is not None:
            return self.cfg.mode
        modes = {w.info.get("mode") for w in self.decode if w.info}
        return modes.pop() if len(modes) == 1 else None

    def count_tokens(self, kind: str, body: dict[str, Any]) -> int | None:
        """Prompt tokens exactly as the workers will count them, or None if unknown yet. Blocking
        (tokenizes): the handler runs it in a thread. A text too long to fit is refused unread."""
        try:
            req = (
                P.ChatCompletionRequest.model_validate(body)
                if kind == "chat"
                else P.CompletionRequest.model_validate(body)
            )
        except ValueError:
            return None  # let the worker produce the precise 4xx
        return self._count(req)

    def _count(self, req: P.CompletionRequest | P.ChatCompletionRequest) -> int | None:
        """``count_tokens`` of a parsed request: after ``truncate_prompt_tokens``, as the workers
        truncate (a text too long to fit is refused unread only where the request does not truncate)."""
        if self.tokenizer is None:
            return None
        bounded = req.truncate_prompt_tokens is None
        try:
            if isinstance(req, P.ChatCompletionRequest):
                if bounded:
                    self._check_chars(req.text_chars())  # before templating
                ids = self.tokenizer.encode(req.render_prompt()).ids
            else:
                prompt = req.single_prompt()
                if isinstance(prompt, str) and bounded:
                    self._check_chars(len(prompt))
                ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else prompt
            return len(req.truncate(ids))
        except ValueError:
            return None  # let the worker produce the precise 4xx
        except P.APIError as e:
            if e.status == 400 and e.param == "prompt" and "maximum context length" in e.message:
                raise
            return None

    def _check_chars(self, n: int) -> None:
        if self.max_seq_len is not None and n > self.max_seq_len * self.max_token_chars:
            raise P.APIError(
                f"This model's maximum context length is {self.max_seq_len} tokens. However, your prompt has "
                f"{n} characters, more than that many tokens can hold. Please reduce the length of the prompt.",
                param="prompt",
            )

    # ---- health --------------------------------------------------------------------------------------

    async def check(self, w: Worker) -> None:
        assert self.client is not None
        try:
            r = await self.client.get(f"{w.url}/health", timeout=self.cfg.connect_timeout)
            if r.status_code != 200:
                raise RuntimeError(f"/health answered {r.status_code}")
            if not w.info or not w.healthy:  # (re)read on the way up: a restarted worker may differ
                info = await self.client.get(
                    f"{w.url}/asympd/info", timeout=self.cfg.connect_timeout, headers=self.internal
                )
                info.raise_for_status()
                w.info = info.json()
                self.model_names.add(w.info.get("model"))
                await self._fetch_meta(w)
            problem = self._mismatch(w)
            if problem:
                raise RuntimeError(problem)
            if not w.healthy:
                log.info("%s worker %s is healthy", w.kind, w.url)
            w.healthy, w.reason = True, "ok"
        except Exception as e:
            if w.healthy or not w.checked:
                log.warning("%s worker %s is unhealthy: %s", w.kind, w.url, e)
            w.healthy, w.reason = False, f"{type(e).__name__}: {e}"
        w.checked = True

    def _mismatch(self, w: Worker) -> str | None:
        mode, wmode = self.cfg.mode or self.mode, w.info.get("mode")
        if mode is not None and wmode != mode:
            return f"worker runs mode {wmode!r}, the router {mode!r}"
        want_role = "prefill" if w.kind == "prefill" else ("colocated" if wmode == "colocated" else "decode")
        if w.info.get("role") != want_role:
            return f"worker has role {w.info.get('role')!r}, expected {want_role!r}"
        fp = w.info.get("fingerprint")
        if self.fingerprint is None:
            self.fingerprint = fp
        elif fp != self.fingerprint:
            return f"model fingerprint {fp} differs from the other workers' {self.fingerprint}"
        return None

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(w) for w in self.prefill + self.decode))
            await asyncio.sleep(self.cfg.health_interval)

    async def startup(self) -> None:
        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(self.cfg.prefill_timeout, connect=self.cfg.connect_timeout)
        )
        self._health_task = asyncio.create_task(self._health_loop())

    async def shutdown(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._abort_tasks:
            await asyncio.wait(self._abort_tasks, timeout=self.cfg.abort_timeout)
        if self.client is not None:
            await self.client.aclose()

    # ---- picking -------------------------------------------------------------------------------------

    def pick(self, workers: list[Worker], exclude: set[str] = frozenset()) -> Worker | None:  # type: ignore[assignment]
        live = [w for w in workers if w.healthy and w.url not in exclude]
        if not live:
            return None
        least = min(w.outstanding_tokens for w in live)
        tied = [w for w in live if w.outstanding_tokens == least]
        return tied[next(self._rr[tied[0].kind]) % len(tied)]

    # ---- requests ------------------------------------------------------------------------------------

    def _headers(self, request: Request, rid: str) -> dict[str, str]:
        """To a worker: the internal credential, never the client's Authorization."""
        return {"X-Request-Id": rid, "Content-Type": "application/json", **self.internal}

    def _abort_everywhere(
        self, rid: str, workers: list[Worker], headers: dict[str, str], client_left: bool = True
    ) -> None:
        """Fire-and-forget ``/asympd/abort`` on every worker that saw the request."""
        if client_left:
            self.metrics.aborts.inc()

        async def one(w: Worker) -> None:
            try:
                assert self.client is not None
                await self.client.post(
                    f"{w.url}/asympd/abort", json={"request_id": rid}, headers=headers, timeout=self.cfg.abort_timeout
                )
            except Exception as e:
                log.info("abort of %s on %s failed: %s", rid, w.url, e)

        for w in workers:
            task = asyncio.create_task(one(w))
            self._abort_tasks.add(task)
            task.add_done_callback(self._abort_tasks.discard)

    async def handle(self, kind: str, request: Request) -> Response:
        t0 = time.perf_counter()
        if self.api_key is not None:
            check_bearer(request, self.api_key)
        body = P.parse_json_body(await read_body(request, self.cfg.max_body_bytes))
        body.pop("kv_transfer_params", None)  # internal: a client does not get to set it
        # read as the workers read it, or D answers a "stream": "false" with JSON the router relays as SSE
        parsed = await asyncio.to_thread(P.parse_request, kind, body)  # off the loop: a big body
        body["stream"] = parsed.stream
        P.check_n_for_mode(parsed.n, self.mode)  # refused before P computes anything (the workers check too)
        model = body.get("model")
        if isinstance(model, str) and self.model_names and model not in self.model_names:  # else the workers' 400
            raise P.APIError(f"The model `{model}` does not exist.", 404, param="model")
        # the id the workers know this request by: the client's X-Request-Id made unique, so that a retry
        # under that id never meets an earlier request's abort (a worker refuses an aborted id for
        # minutes) and two clients' ids never collide
        rid = unique_request_id(request, kind)
        headers = self._headers(request, rid)
        path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        n = await asyncio.to_thread(self._count, parsed)
        if n is not None and self.max_seq_len is not None and n >= self.max_seq_len:  # never forward what cannot fit
            raise P.APIError(
                f"This model's maximum context length is {self.max_seq_len} tokens. However, your prompt has "
                f"{n} tokens. Please reduce the length of the prompt.",
                param="prompt",
            )
        max_tokens = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) else 16
        max_tokens *= parsed.n  # D generates each of the n choices
        load = n if n is not None else max(len(json.dumps(body)) // 4, 1)
        if not any(w.healthy for w in self.decode):  # refused before P computes a prefix no D can take
            self.metrics.requests.labels("no_decode_worker").inc()
            raise P.APIError("no healthy decode worker", 503)
        mode = self.mode
        touched: list[Worker] = []
        kv: dict[str, Any] | None = None
        try:
            if mode != "colocated" and (self.prefill or mode in modes.PD_MODES):
                if n is not None and self.window is not None and modes.skips_prefill(mode, n, self.window):
                    self.metrics.prefill_skipped.inc()
                else:
                    kv, early = await until_disconnect(request, self._prefill(path, body, headers, load, touched, rid))
                    if early is not None:
                        return early
            resp = await self._decode(kind, path, body, headers, load + max_tokens, kv, touched, request, t0, rid)
        except ClientDisconnected:
            self._abort_everywhere(rid, touched, headers)
            raise
        except P.APIError:  # no D took it: drop P's published prefix now rather than at lease expiry
            self._abort_everywhere(rid, [w for w in touched if w.kind == "prefill"], headers, client_left=False)
            raise
        if resp.status_code != 200:
            self._abort_everywhere(rid, [w for w in touched if w.kind == "prefill"], headers, client_left=False)
        return resp

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str], load: int, touched: list[Worker], rid: str
    ) -> tuple[dict[str, Any], Response | None]:
        """P's kv_transfer_params (or a prefill_failed marker), or a response to return as is (4xx)."""
        assert self.client is not None
        tried: set[str] = set()
        reason = "no healthy prefill worker"
        p_body = {
            **body,
            "stream": False,
            "stream_options": None,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        while True:
            w = self.pick(self.prefill, tried)
            if w is None:
                break
            tried.add(w.url)
            touched.append(w)
            w.outstanding_tokens += load
            w.inflight += 1
            t0 = time.perf_counter()
            try:
                r = await self.client.post(
                    f"{w.url}{path}",
                    json=p_body,
                    headers=headers,
                    timeout=httpx.Timeout(self.cfg.prefill_timeout, connect=self.cfg.connect_timeout),
                )
            except httpx.ConnectError as e:  # never reached P: mark it down and try the next one
                w.healthy, w.reason = False, f"connection refused: {e}"
                reason = f"prefill worker {w.url} unreachable: {e}"
                self.metrics.prefill_failures.labels("unreachable").inc()
                continue
            except httpx.TimeoutException:
                reason = f"prefill worker {w.url} did not answer within {self.cfg.prefill_timeout} s"
                self.metrics.prefill_failures.labels("timeout").inc()
                self._abort_everywhere(rid, [w], headers, client_left=False)  # it may still finish: free it
                break
            except httpx.HTTPError as e:
                reason = f"prefill worker {w.url} failed: {type(e).__name__}: {e}"
                self.metrics.prefill_failures.labels("error").inc()
                self._abort_everywhere(rid, [w], headers, client_left=False)
                break
            finally:
                w.outstanding_tokens -= load
                w.inflight -= 1
            rtt = time.perf_counter() - t0
            self.metrics.prefill_rtt.observe(rtt)
            if 400 <= r.status_code < 500 and r.status_code != 499:
                return {}, Response(r.content, status_code=r.status_code, media_type="application/json")
            if r.status_code != 200:
                reason = f"prefill worker {w.url} answered {r.status_code}: {r.text[:300]}"
                self.metrics.prefill_failures.labels(f"http_{r.status_code}").inc()
                break
            try:
                kv = dict(r.json()["kv_transfer_params"])
            except (ValueError, KeyError, TypeError):
                reason = f"prefill worker {w.url} answered without kv_transfer_params"
                self.metrics.prefill_failures.labels("bad_response").inc()
                break
            kv.update(do_remote_prefill=True, do_remote_decode=False, prefill_rtt_s=rtt, prefill_url=w.url)
            return kv, None
        log.warning("prefill failed: %s", reason)
        return {"do_remote_prefill": True, "do_remote_decode": False, "prefill_failed": reason}, None

    async def _decode(
        self,
        kind: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        load: int,
        kv: dict[str, Any] | None,
        touched: list[Worker],
        request: Request,
        t0: float,
        rid: str,
    ) -> Response:
        assert self.client is not None
        d_body = dict(body)
        if kv is not None:
            d_body["kv_transfer_params"] = kv
        else:
            d_body.pop("kv_transfer_params", None)
        stream = bool(body.get("stream"))
        tried: set[str] = set()
        while True:
            w = self.pick(self.decode, tried)
            if w is None:
                self.metrics.requests.labels("no_decode_worker").inc()
                raise P.APIError("no healthy decode worker", 503)
            tried.add(w.url)
            touched.append(w)
            w.outstanding_tokens += load
            w.inflight += 1
            released = False

            def release(w: Worker = w) -> None:
                nonlocal released
                if not released:
                    released = True
                    w.outstanding_tokens -= load
                    w.inflight -= 1

            timeout = httpx.Timeout(self.cfg.stream_idle_timeout, connect=self.cfg.connect_timeout)
            h = headers if stream else {**headers, PROGRESS_HEADER: "1"}
            try:
                req = self.client.build_request("POST", f"{w.url}{path}", json=d_body, headers=h, timeout=timeout)
                resp = await until_disconnect(request, self.client.send(req, stream=True))
            except httpx.ConnectError as e:
                release()
                w.healthy, w.reason = False, f"connection refused: {e}"
                continue  # D never saw it: the prefix state is still on P, try the next D
            except (httpx.HTTPError, ClientDisconnected) as e:
                release()
                if isinstance(e, ClientDisconnected):
                    raise
                self.metrics.requests.labels("decode_error").inc()
                raise P.APIError(f"decode worker {w.url} failed: {type(e).__name__}: {e}", 502) from None
            except BaseException:
                release()
                raise
            if resp.status_code != 200 or not stream:
                try:
                    content = await until_disconnect(request, resp.aread())
                except httpx.HTTPError as e:
                    self.metrics.requests.labels("decode_error").inc()
                    raise P.APIError(
                        f"decode worker {w.url} failed mid-response: {type(e).__name__}: {e}", 502
                    ) from None
                finally:
                    release()
                    await resp.aclose()
                status = _status_of(resp.status_code, content)
                self._finished(status, t0, ttft=None)
                return Response(
                    content.lstrip(), status_code=status, media_type="application/json", headers={"X-Request-Id": rid}
                )
            relay = _Relay(self, resp, w, release, t0, rid, headers, touched)
            return GuardedStreamingResponse(
                relay.body(), relay.close, media_type="text/event-stream", headers={"X-Request-Id": rid}
            )

    def _finished(self, status: int, t0: float, ttft: float | None) -> None:
        self.metrics.requests.labels("ok" if status == 200 else f"http_{status}").inc()
        if status == 200:
            self.metrics.e2e.observe(time.perf_counter() - t0)
            if ttft is not None:
                self.metrics.ttft.observe(ttft)

    # ---- read-only endpoints ---------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        ok = any(w.healthy for w in self.decode)
        return (200 if ok else 503), {
            "status": "ok" if ok else "no healthy decode worker",
            "mode": self.mode,
            "all_healthy": all(w.healthy for w in self.prefill + self.decode),
            "tokenizer": self.tokenizer is not None,
            "window_size": self.window,
            "workers": [w.state() for w in self.prefill + self.decode],
        }

    async def tokenizer_route(self, request: Request, path: str) -> Response:
        """``/tokenize`` and ``/detokenize``, answered by a healthy decode worker: the prompt ids a
        request runs with are the workers' (serve/tokenize.py)."""
        assert self.client is not None
        if self.api_key is not None:
            check_bearer(request, self.api_key)
        body = await read_body(request, self.cfg.max_body_bytes)
        headers = {**self._headers(request, uuid.uuid4().hex), "content-type": "application/json"}
        for w in [w for w in self.decode if w.healthy]:
            try:
                r = await self.client.post(
                    f"{w.url}{path}",
                    content=body,
                    headers=headers,
                    timeout=httpx.Timeout(60, connect=self.cfg.connect_timeout),
                )
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        raise P.APIError("no healthy decode worker to tokenize with", 503)

    async def models(self, request: Request) -> dict[str, Any]:
        assert self.client is not None
        for w in [w for w in self.decode if w.healthy]:
            try:
                r = await self.client.get(
                    f"{w.url}/v1/models",
                    headers=self._headers(request, uuid.uuid4().hex),
                    timeout=self.cfg.connect_timeout,
                )
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                continue
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "owned_by": "asympd"} for m in sorted(self.model_names)],
        }


def build_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.startup()
        print(
            f"asympd router (mode {router.cfg.mode or 'from workers'}, {len(router.prefill)}P"
            f"{len(router.decode)}D) ready on {listen_url(router.cfg.host, router.cfg.port)}",
            flush=True,
        )
        try:
            yield
        finally:
            await router.shutdown()

    app = FastAPI(title="asympd router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle("completion", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle("chat", request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.tokenizer_route(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.tokenizer_route(request, "/detokenize")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        if router.api_key is not None:
            check_bearer(request, router.api_key)
        return JSONResponse(await router.models(request))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = router.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    return app


def run_router(cfg: RouterConfig, log_level: str = "info") -> None:
    setup_logging(log_level)
    router = Router(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    cfg.port = sock.getsockname()[1]
    run_app(build_router_app(router), sock, log_level)


def _status_of(status: int, content: bytes) -> int:
    """D answers a non-streamed request with progress whitespace and then its body, so a failure
    after the status line went out is an error body under 200: give it back its own status."""
    if status != 200 or not content.lstrip().startswith(b'{"error"'):
        return status
    try:
        code = json.loads(content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return 502
    return code if isinstance(code, int) and 400 <= code < 600 else 502


class _Relay:
    """D's SSE bytes to the client; an error event if D dies; aborts everywhere if the client leaves
    (``close`` runs in every case, also when the body never started)."""

    def __init__(
        self,
        router: Router,
        resp: httpx.Response,
        w: Worker,
        release: Any,
        t0: float,
        rid: str,
        headers: dict[str, str],
        touched: list[Worker],
    ) -> None:
        self.router, self.resp, self.w, self.release = router, resp, w, release
        self.t0, self.rid, self.headers, self.touched = t0, rid, headers, touched
        self.ended = False  # D's stream was relayed to its end (or its failure reported)
        self.closed = False

    async def body(self) -> AsyncIterator[bytes]:
        first: float | None = None
        done = False
        tail = b""  # [DONE] may straddle two reads
        try:
            async for chunk in self.resp.aiter_raw():
                if first is None and b"data:" in chunk:
                    first = time.perf_counter() - self.t0
                tail = tail[-16:] + chunk
                done = done or b"data: [DONE]" in tail
                yield chunk
            if not done:
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            self.ended = True
            self.router._finished(200, self.t0, first)
        except httpx.HTTPError as e:
            self.ended = True
            self.router.metrics.requests.labels("decode_died").inc()
            msg = f"decode worker {self.w.url} failed mid-stream: {type(e).__name__}: {e}"
            log.warning("%s (request %s)", msg, self.rid)
            yield f"data: {json.dumps(P.error_body(msg, 502))}\n\ndata: [DONE]\n\n".encode()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.ended:  # the client left: stop the request everywhere
            self.router._abort_everywhere(self.rid, self.touched, self.headers)
        self.release()
        await self.resp.aclose()
