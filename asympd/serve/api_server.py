"""The worker server: one engine (colocated, prefill or decode role) behind an OpenAI-compatible API.

Roles (see ``asympd.engine.modes`` for who computes what):

* ``colocated`` serves requests end to end.
* ``prefill`` (P) takes a request carrying ``kv_transfer_params: {"do_remote_decode": true}`` (the
  router adds it), runs it to the exported ``PrefixState``, publishes that through the transport
  under a lease (the engine's blocks are freed by ``release_transfer`` when D acks or the lease
  expires) and answers with ``kv_transfer_params`` telling D where to fetch it (plus the first
  token in mode symmetric).
* ``decode`` (D) takes the same body with P's ``kv_transfer_params`` (``do_remote_prefill``),
  fetches and validates the state (the transport handshakes on the model fingerprint), acks, and
  streams. When the prefill path failed (P unreachable, fetch refused or timed out, or the router
  reports ``prefill_failed``) the policy ``recompute`` adds the request without a prefix (the
  engine computes it) and ``fail`` answers 503.

Every response carries ``asympd_timings``: the TTFT split into prefill compute, transfer and D's
first step. Bad input never reaches the engine thread as an exception: it becomes a 4xx.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asympd.dist import launch_ep
from asympd.engine import modes
from asympd.engine.engine import EngineConfig, LLMEngine, RequestError
from asympd.engine.llm import eos_id, load_tokenizer
from asympd.engine.request import RequestOutput
from asympd.engine.sampling import SamplingParams
from asympd.engine.scheduler import SchedulerConfig
from asympd.model.dtypes import DTYPES, resolve_dtype
from asympd.model.loader import load_model
from asympd.serve import protocol as P
from asympd.serve.async_engine import Aborted, AsyncEngine, EngineDeadError, Failed, RequestStream
from asympd.serve.metrics import CONTENT_TYPE, ServerMetrics
from asympd.transfer import PrefixStateError, TransferError, Transport, make_transport

log = logging.getLogger("asympd.serve")

# mode symmetric: P's first-token logprobs go into D's engine where it accepts them (newer engines);
# otherwise OutputTracker puts them in front of D's own
_ENGINE_TAKES_FIRST_LOGPROBS = "first_token_logprobs" in inspect.signature(LLMEngine.add_request).parameters


@dataclass
class ServeConfig:
    """What ``asympd serve`` was asked for (the CLI flags, one to one)."""

    checkpoint: str
    role: str = "colocated"
    mode: str | None = None  # None: colocated for the colocated role, asymmetric otherwise
    prefill_semantics: str = "full"
    boundary_policy: str = "carry"
    transport: str | None = None  # None: NIXL, falling back to TCP (with a warning) where it cannot run
    on_prefill_failure: str = "recompute"
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # bf16 on CUDA, fp32 on CPU
    block_size: int = 16
    kv_cache_bytes: int = 64 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_new_admissions: int | None = None  # Sarathi-style cap on admissions per step
    admission_token_budget: int | None = None  # prompt rows per step
    num_spec_tokens: int = 0  # DSpark drafts per request per step on a decoding engine
    enable_prefix_caching: bool = True
    transfer_timeout: float = 10.0  # D: the whole fetch of one prefix state
    transfer_ttl: float = 120.0  # P: how long an unacked prefix state keeps its blocks
    transfer_host: str | None = None  # P: data-plane bind address (default: host)
    transfer_port: int = 0
    advertise_host: str | None = None  # P: address D should connect to (default: the bind address)
    threads: int | None = None
    ep: int = 1  # expert-parallel ranks (one process each, started by this worker); docs/parallel.md
    tp: int = 1  # only 1: attention is replicated

    def resolve(self) -> ServeConfig:
        if self.tp != 1:
            raise ValueError("tensor parallel attention is not implemented: attention is replicated; use --ep")
        if self.ep < 1:
            raise ValueError(f"--ep must be >= 1, got {self.ep}")
        if self.mode is None:
            self.mode = modes.default_mode(self.role)
        modes.check_role_mode(self.role, self.mode)
        if self.on_prefill_failure not in ("recompute", "fail"):
            raise ValueError(f"unknown --on-prefill-failure {self.on_prefill_failure!r}: recompute or fail")
        if self.transport not in (None, "nixl", "tcp", "auto"):
            raise ValueError(f"unknown transport {self.transport!r}: nixl, tcp or auto")
        if self.dtype == "auto":
            self.dtype = str(resolve_dtype("auto", self.device)).removeprefix("torch.")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: auto, {', '.join(DTYPES)}")
        return self


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it: its cleanup aborts the
    engine request). Non-streaming handlers need this; Starlette only watches streaming ones."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    raise ClientDisconnected()


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close``, even when the client left before the
    body generator ever started (then the generator's own ``finally`` never runs)."""

    def __init__(self, content: AsyncIterator[Any], on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


class OutputTracker:
    """Cumulative engine outputs -> what to send: incremental detokenization (a token ending in a
    partial UTF-8 sequence waits for the next one), stop strings on the text (with the text that
    could still become a stop string held back), and logprobs aligned to the new tokens."""

    def __init__(
        self,
        tokenizer: Any,
        stops: list[str],
        include_stop: bool,
        eos_token_id: int | None = None,
        first_logprobs: dict[int, float] | None = None,
    ) -> None:
        self.tokenizer, self.eos = tokenizer, eos_token_id
        self.stops, self.include_stop = stops, include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.first_logprobs = first_logprobs  # symmetric D: P sampled the first token
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.text = ""
        self._prefix = self._read = 0
        self.sent_text = self.sent_tokens = self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.stopped_by_string = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def update(self, out: RequestOutput) -> None:
        """Take the newest cumulative output of the request."""
        comp = out.outputs[0]
        new = comp.token_ids[len(self.token_ids) :]
        if comp.logprobs is not None:
            lps = list(comp.logprobs)
            if self.first_logprobs is not None and len(lps) < len(comp.token_ids):
                lps = [self.first_logprobs] + lps  # the engine did not carry P's entry itself
            self.logprobs = lps[: len(comp.token_ids)]
        if self.stopped_by_string:
            return
        self.token_ids.extend(new)
        before = len(self.text)
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        full = self._decode(self.token_ids[self._prefix :])
        if len(full) > len(prefix_text) and (not full.endswith("\ufffd") or out.finished):
            self.text += full[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.token_ids)
        if out.finished:
            self.finish_reason = comp.finish_reason
            last = comp.token_ids[-1] if comp.token_ids else None
            if comp.finish_reason == "stop" and last is not None and last != self.eos:
                self.stop_reason = last
        if self.stops and len(self.text) > before:
            self._check_stops(max(0, before - self.hold))

    def _check_stops(self, start: int) -> None:
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return
        i, s = min(hits)
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.finish_reason, self.stop_reason, self.stopped_by_string = "stop", s, True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def delta(self) -> tuple[str, list[int], list[dict[int, float]]]:
        """New text (minus a possible stop-string start, unless done), tokens and logprobs."""
        upto = len(self.text) if self.done or not self.stops else max(self.sent_text, len(self.text) - self.hold)
        text = self.text[self.sent_text : upto]
        toks = self.token_ids[self.sent_tokens :]
        lps = self.logprobs[self.sent_logprobs : len(self.token_ids)]
        self.sent_text, self.sent_tokens = upto, len(self.token_ids)
        self.sent_logprobs += len(lps)
        return text, toks, lps


class WorkerServer:
    """Everything one worker process holds: model, engine thread, transport(s), metrics."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg.resolve()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tokenizer = load_tokenizer(cfg.checkpoint)
        self.model_name = cfg.served_model_name or cfg.checkpoint
        model_role = modes.model_role(cfg.role, cfg.mode)
        self.ep = None  # expert parallel: ranks 1..ep-1 load while this process does (asympd.dist)
        if cfg.ep > 1:
            self.ep = launch_ep(model_role, cfg.checkpoint, cfg.ep, cfg.device, cfg.dtype, cfg.threads)
        model = load_model(cfg.checkpoint, model_role, cfg.device, DTYPES[cfg.dtype])
        engine_cfg = EngineConfig(
            role=cfg.role,
            mode=cfg.mode,
            prefill_semantics=cfg.prefill_semantics,
            boundary_policy=cfg.boundary_policy,
            block_size=cfg.block_size,
            kv_cache_bytes=cfg.kv_cache_bytes,
            enable_prefix_caching=cfg.enable_prefix_caching,
            eos_token_id=eos_id(self.tokenizer),
            num_spec_tokens=0 if cfg.role == "prefill" else cfg.num_spec_tokens,
            scheduler=SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_new_admissions=cfg.max_new_admissions,
                admission_token_budget=cfg.admission_token_budget,
            ),
        )
        self.engine = LLMEngine(model, engine_cfg)
        if self.ep is not None:
            self.ep.attach(self.engine)  # shards this rank's experts: resident bytes are rank 0's
        self.resident_bytes = model.resident_bytes()
        self.model_cfg = self.engine.cfg
        self.fingerprint = self.engine.fingerprint
        self.aengine = AsyncEngine(self.engine)
        self.metrics = ServerMetrics(
            static={"role": cfg.role, "mode": cfg.mode, "model": self.model_name, "resident_bytes": self.resident_bytes}
        )
        self.transport: Transport | None = None  # P: publishes
        self.fetchers: dict[str, Transport] = {}  # D: one per transport name P advertises
        self._fetchers_lock = threading.Lock()
        self.fetch_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="asympd-fetch")
        self.transport_name = "none"
        if cfg.role == "prefill":
            self.transport = self._make_transport(cfg.transport, for_publish=True)
            self.transport_name = self.transport.name
        elif cfg.role == "decode":
            t = self._make_transport(cfg.transport, for_publish=False)
            self.fetchers[t.name] = t
            self.transport_name = t.name
        self.port = cfg.port
        # ids aborted recently: a request that arrives after its own abort (the router gave up on a
        # slow P and aborted it before P even read the request) is refused instead of being run
        self._aborted: OrderedDict[str, float] = OrderedDict()

    def mark_aborted(self, rid: str) -> None:
        now = time.monotonic()
        self._aborted[rid] = now
        while self._aborted and (len(self._aborted) > 10000 or next(iter(self._aborted.values())) < now - 300):
            self._aborted.popitem(last=False)

    # ---- transports ----------------------------------------------------------------------------------

    def _make_transport(self, name: str | None, for_publish: bool) -> Transport:
        options: dict[str, Any] = {"device": self.cfg.device}
        if for_publish:
            options.update(
                host=self.cfg.transfer_host or self.cfg.host,
                port=self.cfg.transfer_port,
                advertise_host=self.cfg.advertise_host,
                ttl_s=self.cfg.transfer_ttl,
                on_release=self._on_release,
            )
        try:
            return make_transport(name or "nixl", self.fingerprint, **options)
        except TransferError as e:
            if name is not None:  # asked for explicitly: do not silently degrade
                raise
            log.warning("NIXL cannot run here (%s): using the TCP transport", e)
            return make_transport("tcp", self.fingerprint, **options)

    def _on_release(self, transfer_id: str, _state: Any, reason: str) -> None:
        """Lease released (D acked, it expired, or P closed): free the engine's blocks."""
        if reason == "expired":
            log.warning("prefix state %s expired before the decode worker fetched it", transfer_id)
        self.aengine.release_transfer(transfer_id)

    def _fetcher(self, name: str) -> Transport:
        """D's transport for what P advertised, made on first use (fetch threads share it)."""
        with self._fetchers_lock:
            if name not in self.fetchers:
                try:
                    self.fetchers[name] = make_transport(name, self.fingerprint, device=self.cfg.device)
                except ValueError as e:
                    raise P.APIError(f"bad kv_transfer_params: {e}", param="kv_transfer_params") from None
            return self.fetchers[name]

    def transfer_snapshots(self) -> dict[str, dict[str, Any]]:
        with self._fetchers_lock:
            ts = list(self.fetchers.values()) + ([self.transport] if self.transport else [])
        return {t.name: t.metrics.snapshot() for t in ts}

    # ---- lifetime ------------------------------------------------------------------------------------

    async def startup(self) -> None:
        self.aengine.start()

    async def shutdown(self) -> None:
        with self._fetchers_lock:
            transports = [self.transport, *self.fetchers.values()]
        for t in transports:
            if t is not None:
                try:
                    t.close()
                except Exception:
                    log.exception("closing transport %s", t.name)
        self.aengine.stop()
        if self.ep is not None:
            self.ep.close()
        self.fetch_pool.shutdown(wait=False, cancel_futures=True)

    def info(self) -> dict[str, Any]:
        c, m = self.cfg, self.model_cfg
        return {
            "role": c.role,
            "mode": c.mode,
            "prefill_semantics": c.prefill_semantics,
            "boundary_policy": c.boundary_policy,
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "window_size": m.window_size,
            "max_seq_len": m.max_seq_len,
            "vocab_size": m.vocab_size,
            "resident_bytes": self.resident_bytes,
            "transport": self.transport_name,
            "on_prefill_failure": c.on_prefill_failure,
            "device": c.device,
            "dtype": c.dtype,
            "has_tokenizer": self.tokenizer is not None,
            "ep": c.ep,
            "ep_pids": self.ep.group.pids() if self.ep is not None else [],
        }

    # ---- request parsing -----------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        check_bearer(request, self.cfg.api_key)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise P.APIError("this checkpoint has no tokenizer.json: send the prompt as token ids", param="prompt")
        return self.tokenizer.encode(text).ids

    def prompt_ids(self, kind: str, req: P.CompletionRequest | P.ChatCompletionRequest) -> list[int]:
        if kind == "chat":
            assert isinstance(req, P.ChatCompletionRequest)
            return self._encode(req.render_prompt())  # V4.1's format (chat_format.py)
        assert isinstance(req, P.CompletionRequest)
        prompt = req.single_prompt()
        ids = self._encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise P.APIError("the prompt is empty", param="prompt")
        return ids

    def check_model(self, req: P.CompletionRequest | P.ChatCompletionRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise P.APIError(f"The model `{req.model}` does not exist.", 404, param="model")

    def check_length(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.model_cfg.max_seq_len
        if len(ids) >= limit:
            raise P.APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(ids)} tokens. Please reduce the length of the prompt.",
                param="prompt",
            )
        if len(ids) + params.max_tokens > limit:
            raise P.APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} "
                "for the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
            )

    # ---- the endpoints -------------------------------------------------------------------------------

    async def handle(self, kind: str, request: Request) -> Response:
        t_arrival = time.perf_counter()
        self.check_auth(request)
        body = P.parse_json_body(await request.body())
        req = P.parse_request(kind, body)
        self.check_model(req)
        ids = self.prompt_ids(kind, req)
        params = req.sampling_params(len(ids), self.model_cfg.max_seq_len)
        self.check_length(ids, params)
        req.stop_strings()  # validated before anything is queued
        rid = request.headers.get("x-request-id") or P.new_id(kind)
        if rid in self._aborted:
            raise P.APIError(f"request {rid} was aborted", 499)
        kv = req.kv_transfer_params
        if self.cfg.role == "prefill":
            return await self.prefill(kind, req, request, rid, ids, params, t_arrival)
        if kv is not None and kv.get("do_remote_decode"):
            raise P.APIError(
                f"this is a {self.cfg.role} worker: do_remote_decode needs a prefill worker", param="kv_transfer_params"
            )
        return await self.generate(kind, req, request, rid, ids, params, t_arrival)

    async def _add(self, rid: str, ids: list[int], params: SamplingParams, **kw: Any) -> RequestStream:
        try:
            return await self.aengine.add(rid, ids, params, **kw)
        except PrefixStateError as e:
            raise P.APIError(f"bad prefix state: {e}", param="kv_transfer_params") from None
        except RequestError as e:
            raise P.APIError(str(e)) from None
        except EngineDeadError as e:
            raise P.APIError(str(e), 503) from None

    # ---- prefill worker ------------------------------------------------------------------------------

    async def prefill(
        self, kind: str, req: Any, request: Request, rid: str, ids: list[int], params: SamplingParams, t_arrival: float
    ) -> Response:
        kv = req.kv_transfer_params or {}
        if not kv.get("do_remote_decode"):
            raise P.APIError(
                "this is a prefill worker: send requests to the router, or set "
                'kv_transfer_params={"do_remote_decode": true}',
                param="kv_transfer_params",
            )
        t_add = time.perf_counter()
        stream = await self._add(rid, ids, params)
        out = await until_disconnect(request, stream.result())
        if isinstance(out, Aborted):
            raise P.APIError("the request was aborted", 499)
        if isinstance(out, Failed):
            raise P.APIError(out.message, 500)
        if out.error or out.prefix_state is None:
            raise P.APIError(out.error or "the prefill produced no prefix state", 400 if out.error else 500)
        prefill_s = time.perf_counter() - t_add
        self.metrics.prefill_compute.observe(prefill_s)
        state = out.prefix_state
        t_pub = time.perf_counter()
        assert self.transport is not None
        try:
            published = self.transport.publish(rid, state)
        except Exception as e:
            self.aengine.release_transfer(rid)
            log.exception("publishing prefix state %s failed", rid)
            raise P.APIError(f"publishing the prefix state failed: {e}", 500) from None
        publish_s = time.perf_counter() - t_pub
        if await request.is_disconnected() or rid in self._aborted:  # nobody will fetch it: free it now
            self.transport.release(rid)
            raise ClientDisconnected()
        comp = out.outputs[0]
        kv_out: dict[str, Any] = {
            **published,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "mode": self.cfg.mode,
            "split": state.split,
            "num_prompt_tokens": len(ids),
            "fingerprint": self.fingerprint,
            "prefill_s": prefill_s,
            "publish_s": publish_s,
        }
        if comp.token_ids:  # symmetric: P sampled the first token
            kv_out["first_token"] = comp.token_ids[0]
            if comp.logprobs:
                kv_out["first_token_logprobs"] = {str(t): lp for t, lp in comp.logprobs[0].items()}
        body = P.response_envelope(kind, rid, self.model_name)
        empty = {"text": ""} if kind == "completion" else {"message": {"role": "assistant", "content": ""}}
        body["choices"] = [{"index": 0, **empty, "logprobs": None, "finish_reason": "length"}]
        body["usage"] = P.usage(len(ids), len(comp.token_ids))
        body["kv_transfer_params"] = kv_out
        body["asympd_timings"] = {
            "prefill_s": prefill_s,
            "publish_s": publish_s,
            "prefill_total_s": time.perf_counter() - t_arrival,
        }
        return JSONResponse(body)

    # ---- decode / colocated worker -------------------------------------------------------------------

    async def fetch_prefix(self, kv: dict[str, Any], ids: list[int], timings: dict[str, Any]) -> tuple[Any, Any, Any]:
        """P's prefix state for this request, or None under ``recompute`` when the prefill path failed.
        Returns (state, first_token, first_token_logprobs)."""
        failure = kv.get("prefill_failed")
        timings["prefill_s"] = kv.get("prefill_s")
        timings["prefill_rtt_s"] = kv.get("prefill_rtt_s")
        if failure is None:
            missing = [k for k in ("host", "port", "transfer_id") if k not in kv]
            if missing:
                raise P.APIError(f"bad kv_transfer_params: missing {', '.join(missing)}", param="kv_transfer_params")
            try:
                first = kv.get("first_token")
                first = None if first is None else int(first)
                lps = kv.get("first_token_logprobs")
                lps = None if lps is None else {int(t): float(v) for t, v in dict(lps).items()}
            except (TypeError, ValueError) as e:
                raise P.APIError(f"bad kv_transfer_params: first token: {e}", param="kv_transfer_params") from None
            t0 = time.perf_counter()

            def fetch() -> Any:
                fetcher = self._fetcher(str(kv.get("transport", "tcp")))
                state = fetcher.fetch(kv, self.fingerprint, timeout=self.cfg.transfer_timeout, ack=True)
                state.validate(self.model_cfg, self.fingerprint)
                return state

            try:
                state = await asyncio.get_running_loop().run_in_executor(self.fetch_pool, fetch)
            except (PrefixStateError, P.APIError) as e:
                if isinstance(e, P.APIError):
                    raise
                raise P.APIError(f"bad prefix state: {e}", param="kv_transfer_params") from None
            except (TypeError, ValueError, KeyError) as e:  # e.g. a port that is not a number
                raise P.APIError(
                    f"bad kv_transfer_params: {type(e).__name__}: {e}", param="kv_transfer_params"
                ) from None
            except TransferError as e:  # refused, unreachable, timed out, or NIXL missing here
                failure = f"fetching the prefix state from {kv.get('host')}:{kv.get('port')} failed: {e}"
                timings["transfer_s"] = time.perf_counter() - t0
            else:
                timings["transfer_s"] = time.perf_counter() - t0
                timings["transfer_bytes"] = state.nbytes
                self.metrics.ttft_transfer.observe(timings["transfer_s"])
                if timings["prefill_s"] is not None:
                    self.metrics.ttft_prefill.observe(float(timings["prefill_s"]))
                timings["prefill_path"] = "remote"
                return state, first, lps
        reason = "prefill_failed" if kv.get("prefill_failed") else "fetch_failed"
        self.metrics.prefill_fallbacks.labels(reason).inc()
        timings["fallback_reason"] = failure
        if self.cfg.on_prefill_failure == "fail":
            raise P.APIError(
                f"the prefill path failed and this decode worker runs --on-prefill-failure=fail: {failure}", 503
            )
        log.warning("recomputing the prefix here: %s", failure)
        timings["prefill_path"] = "recompute"
        return None, None, None

    async def generate(
        self, kind: str, req: Any, request: Request, rid: str, ids: list[int], params: SamplingParams, t_arrival: float
    ) -> Response:
        timings: dict[str, Any] = {"prefill_path": "local"}
        kv = req.kv_transfer_params
        state = first = first_lps = None
        if self.cfg.role == "decode" and kv is not None and kv.get("do_remote_prefill"):
            state, first, first_lps = await until_disconnect(request, self.fetch_prefix(kv, ids, timings))
        tracker = OutputTracker(
            self.tokenizer,
            req.stop_strings(),
            req.include_stop_str_in_output,
            self.engine.config.eos_token_id,
            first_lps if state is not None else None,
        )
        kw: dict[str, Any] = {"prefix_state": state, "first_token": first}
        if first_lps is not None and _ENGINE_TAKES_FIRST_LOGPROBS:
            kw["first_token_logprobs"] = first_lps
        t_add = time.perf_counter()
        stream = await self._add(rid, ids, params, **kw)
        chat = req.output() if kind == "chat" else None
        ctx = _Ctx(kind, req, rid, ids, t_arrival, t_add, timings, tracker, int(time.time()), chat)
        if req.stream:

            async def close() -> None:
                stream.close()  # a no-op once the request finished

            return GuardedStreamingResponse(
                self._stream(ctx, stream), close, media_type="text/event-stream", headers={"X-Request-Id": rid}
            )
        return await until_disconnect(request, self._collect(ctx, stream))

    async def _outputs(self, ctx: _Ctx, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The engine outputs of a request, with timing and stop-string bookkeeping; raises APIError
        if the engine failed or aborted it."""
        last_t: float | None = None
        gaps: list[float] = []
        try:
            async for item in stream:
                if isinstance(item, Aborted):
                    raise P.APIError("the request was aborted", 499)
                if isinstance(item, Failed):
                    raise P.APIError(item.message, 500)
                if item.error:
                    raise P.APIError(item.error, 400 if not item.outputs[0].token_ids else 500)
                now = time.perf_counter()
                if item.outputs[0].token_ids:
                    if last_t is None:
                        self._first_token(ctx, now)
                    else:
                        gaps.append(now - last_t)
                    last_t = now
                ctx.tracker.update(item)
                if item.finished or ctx.tracker.done:
                    ctx.timings["e2e_s"] = now - ctx.t_arrival
                    self.metrics.e2e.observe(ctx.timings["e2e_s"])
                    self.metrics.finished(item.metrics, ctx.tracker.finish_reason, gaps)
                yield item
                if ctx.tracker.done:
                    return  # a stop string: leaving the stream aborts the engine request
        finally:
            stream.close()

    def _first_token(self, ctx: _Ctx, now: float) -> None:
        t = ctx.timings
        t["decode_first_step_s"] = now - ctx.t_add
        t["ttft_s"] = (t.get("prefill_rtt_s") or 0.0) + (now - ctx.t_arrival)
        self.metrics.ttft.observe(now - ctx.t_arrival)
        self.metrics.ttft_decode.observe(t["decode_first_step_s"])

    def _choice(
        self,
        ctx: _Ctx,
        text: str,
        toks: list[int],
        lps: list[dict[int, float]],
        final: bool,
        stream: bool,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        tr, req = ctx.tracker, ctx.req
        choice: dict[str, Any] = {"index": 0}
        tok_text = self._token_text
        finish = tr.finish_reason
        if ctx.kind == "completion":
            choice["text"] = text
            choice["logprobs"] = (
                P.completion_logprobs(lps, toks, tok_text, text_offset, req.logprobs)
                if req.logprobs is not None
                else None
            )
        else:
            assert ctx.chat is not None  # reasoning / content / tool calls parsed from the text
            if stream:
                choice["delta"] = ctx.chat.delta(text, final)
            else:
                choice["message"] = ctx.chat.message(text)
            if final and ctx.chat.error:
                log.warning("request %s: malformed tool block sent as content: %s", ctx.rid, ctx.chat.error)
            choice["logprobs"] = P.chat_logprobs(lps, toks, tok_text, req.top_logprobs or 0) if req.logprobs else None
            finish = ctx.chat.finish_reason(finish)  # "tool_calls" when the model called tools
        choice["finish_reason"] = finish if final else None
        choice["stop_reason"] = tr.stop_reason if final else None
        if req.return_token_ids:
            choice["token_ids"] = toks
        return choice

    def _token_text(self, tok: int) -> str:
        return self.tokenizer.decode([tok], skip_special_tokens=False) if self.tokenizer is not None else ""

    async def _collect(self, ctx: _Ctx, stream: RequestStream) -> Response:
        async for _ in self._outputs(ctx, stream):
            pass
        tr = ctx.tracker
        text, toks, lps = tr.delta()
        body = P.response_envelope(ctx.kind, ctx.rid, self.model_name, ctx.created)
        body["choices"] = [self._choice(ctx, text, toks, lps, final=True, stream=False)]
        body["usage"] = P.usage(len(ctx.ids), len(tr.token_ids))
        if ctx.req.return_token_ids:
            body["prompt_token_ids"] = ctx.ids
        body["asympd_timings"] = ctx.timings
        return JSONResponse(body, headers={"X-Request-Id": ctx.rid})

    async def _stream(self, ctx: _Ctx, stream: RequestStream) -> AsyncIterator[str]:
        tr, req = ctx.tracker, ctx.req

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = P.response_envelope(ctx.kind, ctx.rid, self.model_name, ctx.created, chunk=True)
            body["choices"] = choices
            body.update(extra)
            return f"data: {json.dumps(body)}\n\n"

        offset = 0
        first_chunk = True
        try:
            if ctx.kind == "chat":
                first = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield chunk([first], **({"prompt_token_ids": ctx.ids} if req.return_token_ids else {}))
            async for _ in self._outputs(ctx, stream):
                text, toks, lps = tr.delta()
                wants_tokens = req.return_token_ids or (req.logprobs not in (None, False))
                if not (text or tr.done or (toks and wants_tokens)):
                    continue  # text held back (a partial character or a possible stop string)
                extra: dict[str, Any] = {}
                if tr.done:
                    extra["asympd_timings"] = ctx.timings
                if ctx.kind == "completion" and req.return_token_ids and first_chunk:
                    extra["prompt_token_ids"] = ctx.ids
                first_chunk = False
                yield chunk(
                    [self._choice(ctx, text, toks, lps, final=tr.done, stream=True, text_offset=offset)], **extra
                )
                offset += len(text)
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=P.usage(len(ctx.ids), len(tr.token_ids)), asympd_timings=ctx.timings)
        except P.APIError as e:
            self.metrics.request_errors.labels(str(e.status)).inc()
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # never leave a stream hanging without a word
            log.exception("stream %s failed", ctx.rid)
            yield f"data: {json.dumps(P.error_body(f'internal error: {e}', 500))}\n\n"
        yield "data: [DONE]\n\n"


@dataclass
class _Ctx:
    kind: str
    req: Any
    rid: str
    ids: list[int]
    t_arrival: float
    t_add: float
    timings: dict[str, Any]
    tracker: OutputTracker
    created: int
    chat: P.ChatOutput | None = None


def check_bearer(request: Request, key: str) -> None:
    """``Authorization: Bearer <key>`` or a 401."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise P.APIError("Unauthorized: a valid API key is required (Authorization: Bearer <key>)", 401)


def install_error_handlers(app: FastAPI, metrics_errors: Any = None) -> None:
    """OpenAI-style JSON for every refusal, including Starlette's own 404/405."""

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
        if metrics_errors is not None:
            metrics_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, e: ClientDisconnected) -> JSONResponse:
        return P.error_response("client disconnected", 499)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return P.error_response(str(e.detail), e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return P.error_response(f"internal error: {type(e).__name__}: {e}", 500)


def build_app(server: WorkerServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.startup()
        c = server.cfg
        print(
            f"asympd {c.role} worker (mode {c.mode}, transport {server.transport_name}) ready on "
            f"http://{c.host}:{server.port}",
            flush=True,
        )
        try:
            yield
        finally:
            await server.shutdown()

    app = FastAPI(title="asympd worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, server.metrics.request_errors)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle("completion", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.handle("chat", request)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.check_auth(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "asympd",
                        "root": server.cfg.checkpoint,
                        "parent": None,
                        "max_model_len": server.model_cfg.max_seq_len,
                        "asympd": {
                            "role": server.cfg.role,
                            "mode": server.cfg.mode,
                            "resident_bytes": server.resident_bytes,
                        },
                    }
                ],
            }
        )

    @app.get("/health")
    async def health() -> Response:
        if not server.aengine.alive:
            return P.error_response(f"engine is not running: {server.aengine.error}", 503)
        return JSONResponse({"status": "ok", "role": server.cfg.role, "mode": server.cfg.mode})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await server.aengine.call(lambda e: e.stats(), timeout=5)
        except Exception:
            stats = None
        return Response(server.metrics.render(stats, server.transfer_snapshots()), media_type=CONTENT_TYPE)

    @app.get("/asympd/info")
    async def info() -> JSONResponse:
        return JSONResponse(server.info())

    @app.get("/asympd/stats")
    async def stats() -> JSONResponse:
        try:
            engine = await server.aengine.call(lambda e: e.stats(), timeout=5)
        except Exception as e:
            raise P.APIError(f"engine did not answer: {e}", 503) from None
        transfers = server.transfer_snapshots()
        for snap in transfers.values():
            snap.pop("recent", None)
        return JSONResponse({**server.info(), "engine": engine, "transfers": transfers})

    @app.get("/asympd/tokenizer.json")
    async def tokenizer() -> Response:
        path = Path(server.cfg.checkpoint) / "tokenizer.json"
        if not path.exists():
            raise P.APIError("this checkpoint has no tokenizer.json", 404)
        return FileResponse(path, media_type="application/json")

    @app.post("/asympd/abort")
    async def abort(request: Request) -> JSONResponse:
        """Abort a request wherever it is (the router calls this when its client leaves). On a
        prefill worker this also drops a published prefix state, freeing its blocks."""
        server.check_auth(request)
        body = P.parse_json_body(await request.body())
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise P.APIError("request_id (a string) is required", param="request_id")
        server.mark_aborted(rid)
        server.aengine.abort(rid)
        released = server.transport.release(rid) if server.transport is not None else False
        return JSONResponse({"request_id": rid, "aborted": True, "released_transfer": bool(released)})

    return app


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied call is noise


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so port 0 gives an ephemeral port we can print."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_app(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    import uvicorn

    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=30
    )
    uvicorn.Server(config).run(sockets=[sock])


def serve(cfg: ServeConfig, log_level: str = "info") -> None:
    """Load, bind, serve until SIGINT/SIGTERM."""
    setup_logging(log_level)
    server = WorkerServer(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    server.port = sock.getsockname()[1]
    run_app(build_app(server), sock, log_level)
