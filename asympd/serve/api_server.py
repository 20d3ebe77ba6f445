"""The worker server: one engine (colocated, prefill or decode role) behind an OpenAI-compatible API.

Roles (see ``asympd.engine.modes`` for who computes what):

* ``colocated`` serves requests end to end.
* ``prefill`` (P) takes a request carrying ``kv_transfer_params: {"do_remote_decode": true}`` (the
  router adds it), runs it to the exported ``PrefixState`` and publishes it (``handoff.py``:
  random transfer id, sealed with the deployment secret, held under a lease).
* ``decode`` (D) takes the same body with P's ``kv_transfer_params``, fetches, authenticates and
  validates the state, and streams; when the prefill path failed the policy ``recompute`` computes
  the prefix here and ``fail`` answers 503.

``kv_transfer_params`` and ``/asympd/abort`` need the internal credential (``http.py``); the
public API needs the client key when one is set. Bodies are bounded, prompts are measured before
they are tokenized, and (de)tokenization runs off the event loop. Every response carries
``asympd_timings``: the TTFT split into prefill compute, transfer and D's first step. Bad input
never reaches the engine thread as an exception: it becomes a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from asympd.engine import modes
from asympd.engine.engine import LLMEngine, RequestError
from asympd.engine.images import ImageLimits
from asympd.engine.llm import eos_id, load_sampling_defaults, load_tokenizer
from asympd.engine.request import RequestOutput
from asympd.engine.sampling import SamplingParams
from asympd.engine.warm_up import warm_up
from asympd.model.loader import load_model
from asympd.parallel import launch_ep
from asympd.parallel.cp_engine import CPPrefillEngine, launch_cp
from asympd.serve import protocol as P
from asympd.serve import streaming
from asympd.serve.async_engine import Aborted, AsyncEngine, EngineDeadError, Failed, RequestStream
from asympd.serve.config import ServeConfig
from asympd.serve.detokenize import OutputTracker
from asympd.serve.handoff import Handoff
from asympd.serve.http import (
    ClientDisconnected,
    GuardedStreamingResponse,
    bind_socket,
    check_bearer,
    client_key,
    client_request_id,
    has_internal,
    internal_key,
    read_body,
    require_internal,
    run_app,
    setup_logging,
    unique_request_id,
    until_disconnect,
)
from asympd.serve.metrics import ServerMetrics
from asympd.serve.routes import build_app
from asympd.serve.stall_watch import freeze_start_up_objects
from asympd.serve.tokenize import detokenize, tokenize
from asympd.serve.vision_inputs import request_images
from asympd.transfer import PrefixStateError

log = logging.getLogger("asympd.serve")

# mode symmetric: P's first-token logprobs go into D's engine where it accepts them (newer engines);
# otherwise OutputTracker puts them in front of D's own
_ENGINE_TAKES_FIRST_LOGPROBS = "first_token_logprobs" in inspect.signature(LLMEngine.add_request).parameters
# the router asks for this on non-streamed requests: D then sends a byte of whitespace (valid before
# JSON) as tokens come, so the router can bound the request by progress instead of total time
PROGRESS_HEADER = "x-asympd-progress"
PROGRESS_EVERY_S = 0.25
T = TypeVar("T")


class WorkerServer:
    """Everything one worker process holds: model, engine thread, hand-off, metrics."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg.resolve()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.api_key = client_key(cfg.api_key, cfg.api_key_file)
        self.secret = internal_key(cfg.internal_key_file)
        self.tokenizer = load_tokenizer(cfg.checkpoint)
        self.model_name = cfg.served_model_name or cfg.checkpoint
        self.sampling_defaults = load_sampling_defaults(cfg.checkpoint, cfg.generation_config)
        if self.sampling_defaults:
            log.info(
                "sampling defaults from generation_config.json (--generation-config %s): %s (a request's own "
                "values win; --generation-config vllm leaves them out)",
                cfg.generation_config,
                self.sampling_defaults,
            )
        model_role = modes.model_role(cfg.role, cfg.mode)
        self.ep = None  # expert parallel: ranks 1..ep-1 load while this process does (asympd.parallel)
        if cfg.ep > 1:
            self.ep = launch_ep(model_role, cfg.checkpoint, cfg.ep, cfg.device, cfg.dtype, cfg.threads, cfg.weights)
        cp = launch_cp(cfg.checkpoint, cfg.cp, cfg.device, cfg.dtype, cfg.threads, cfg.weights) if cfg.cp > 1 else None
        ep = (0, cfg.ep) if cfg.ep > 1 else None  # rank 0 reads its own experts only
        shared = cfg.benchmark_shared_experts  # benchmark checkpoints only (asympd/model/shared_experts.py)
        model = load_model(cfg.checkpoint, model_role, cfg.device, cfg.dtype, cfg.weights, ep=ep, shared_experts=shared)
        cfg.engine.eos_token_id = eos_id(self.tokenizer)
        # rank 0 of an expert-parallel worker computes its share of the experts only once the other
        # ranks are attached: its warm-up waits until then
        deferred = self.ep is not None and cfg.engine.warms_up(model.device)
        engine_cfg = dataclasses.replace(cfg.engine, warm_up=False) if deferred else cfg.engine
        self.engine: Any = LLMEngine(model, engine_cfg) if cp is None else CPPrefillEngine(model, cfg.engine, cp)
        if self.ep is not None:
            self.ep.attach(self.engine)  # resident bytes are rank 0's
            if deferred:
                self.engine.warm_up_report = warm_up(self.engine)
        self.resident_bytes = model.resident_bytes()
        self.model_cfg = self.engine.cfg
        self.fingerprint = self.engine.fingerprint
        self.max_prompt_chars = self.model_cfg.max_seq_len * _max_token_chars(self.tokenizer)
        self.metrics = ServerMetrics(
            static={"role": cfg.role, "mode": cfg.mode, "model": self.model_name, "resident_bytes": self.resident_bytes}
        )
        self.aengine = AsyncEngine(self.engine, on_step=lambda dt, _outputs: self.metrics.step.observe(dt))
        self.text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="asympd-text")
        self.handoff = Handoff(
            cfg.role,
            self.fingerprint,
            self.model_cfg,
            self.secret,
            cfg.transport or ("tcp" if cfg.engine.stream_prefix else None),  # NIXL has no stream op
            {
                "device": cfg.device,
                "host": cfg.transfer_host or cfg.host,
                "port": cfg.transfer_port,
                "advertise_host": cfg.advertise_host,
                "ttl_s": cfg.transfer_ttl,
            },
            self.aengine.release_transfer,
            cfg.transfer_timeout,
            cfg.on_prefill_failure,
        )
        self.port = cfg.port
        # ids aborted recently: a request that arrives after its own abort (the router gave up on a
        # slow P and aborted it before P even read the request) is refused instead of being run
        self._aborted: OrderedDict[str, float] = OrderedDict()
        self.background: set[asyncio.Task] = set()  # streamed prefixes being pushed (P) or pulled (D)

    @property
    def transport_name(self) -> str:
        return self.handoff.name

    def mark_aborted(self, rid: str) -> None:
        now = time.monotonic()
        self._aborted[rid] = now
        while self._aborted and (len(self._aborted) > 10000 or next(iter(self._aborted.values())) < now - 300):
            self._aborted.popitem(last=False)

    def transfer_snapshots(self) -> dict[str, dict[str, Any]]:
        return self.handoff.snapshots()

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """CPU work of one request (tokenizing, detokenizing) without stalling the other requests."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)

    # ---- lifetime ------------------------------------------------------------------------------------

    async def startup(self) -> None:
        # start-up's objects (the model, caches, graphs) out of the collector's reach, as vLLM
        # does, so a full collection while serving walks only what serving made. Not a measured
        # gain: no collection ran inside any P step of bench/first_steps.py with or without it
        # (first_steps_gc_*.json); the slow-step log line reports any that does
        frozen = freeze_start_up_objects()
        log.info("froze %d start-up objects out of the garbage collector", frozen)
        self.aengine.start()

    async def shutdown(self) -> None:
        self.handoff.close()
        self.aengine.stop()
        if self.ep is not None:
            self.ep.close()
        if isinstance(self.engine, CPPrefillEngine):
            self.engine.close()
        self.text_pool.shutdown(wait=False, cancel_futures=True)

    def info(self, internal: bool = True) -> dict[str, Any]:
        """What the router needs to check a worker; the fingerprint only for internal callers."""
        c, m = self.cfg, self.model_cfg
        out = {
            "role": c.role,
            "mode": c.mode,
            "prefill_semantics": c.engine.prefill_semantics,
            "boundary_policy": c.engine.boundary_policy,
            "admission": self.admission(),
            "model": self.model_name,
            "window_size": m.window_size,
            "max_seq_len": m.max_seq_len,
            "vocab_size": m.vocab_size,
            "resident_bytes": self.resident_bytes,
            "transport": self.transport_name,
            "on_prefill_failure": c.on_prefill_failure,
            "device": c.device,
            "dtype": c.dtype,
            "has_tokenizer": self.tokenizer is not None,
            "sampling_defaults": self.sampling_defaults,
            "ep": c.ep,
            "ep_pids": self.ep.group.pids() if self.ep is not None else [],
            "cp": c.cp,
            "cp_pids": self.engine.group.pids() if isinstance(self.engine, CPPrefillEngine) else [],
            "memory": self.memory(),
            "warm_up": self.warm_up(),
        }
        if internal:
            out["fingerprint"] = self.fingerprint
        return out

    def warm_up(self) -> dict[str, Any] | None:
        """What the engine's start-up warm-up ran (engine/warm_up.py); None where it did not run."""
        report = getattr(self.engine, "warm_up_report", None)
        if report is None:
            return None
        rows = [min(report.rows), max(report.rows)] if report.rows else []
        return {
            "prompts": len(report.rows),
            "rows": rows,
            "seconds": round(report.seconds, 3),
            "pieces": report.pieces,
            "reserved_bytes": report.reserved_bytes,
        }

    def admission(self) -> dict[str, Any]:
        """How new requests join this worker's steps (serve/admission.py): the policy and what it set."""
        s = self.cfg.engine.scheduler
        return {
            "policy": self.cfg.admission_policy if self.cfg.role != "prefill" else None,
            "max_new_admissions": s.max_new_admissions,
            "admission_token_budget": s.admission_token_budget,
            "mixed_steps": s.mixed_steps,
            "one_depth_per_step": s.one_depth_per_step,
            "max_deepest_chunks": s.max_deepest_chunks,
        }

    def memory(self) -> dict[str, Any]:
        """Device memory beside the weights: the weight layout and bytes, the KV pool, and on a GPU what
        the allocator holds in all (weights + KV + workspace + the CUDA graphs' pool), with the
        decode-step shapes captured so far."""
        device = torch.device(self.cfg.device)
        graphs = getattr(getattr(self.engine, "runner", None), "graphs", None)
        return {
            "weights_layout": getattr(self.engine.model, "weights", None),
            "weights_bytes": self.resident_bytes,
            "kv_cache_bytes": self.engine.cache.nbytes() if self.engine.cache is not None else 0,
            "device_allocated_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
            "cuda_graphs": None if graphs is None else {"shapes": len(graphs.graphs), **graphs.stats},
        }

    # ---- request parsing -----------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        """The client key, unless the caller holds the internal credential (the router)."""
        if self.api_key is None or has_internal(request, self.secret):
            return
        check_bearer(request, self.api_key)

    def _encode(self, text: str, bounded: bool = True) -> list[int]:
        """``bounded``: refuse a text too long to fit unread (not when the request truncates it)."""
        if self.tokenizer is None:
            raise P.APIError("this checkpoint has no tokenizer.json: send the prompt as token ids", param="prompt")
        if bounded:
            self._check_chars(len(text))
        return self.tokenizer.encode(text).ids

    def _check_chars(self, n: int) -> None:
        """A text of ``n`` characters cannot fit whatever it tokenizes to: refuse it unread."""
        if n > self.max_prompt_chars:
            raise P.APIError(
                f"This model's maximum context length is {self.model_cfg.max_seq_len} tokens. However, your "
                f"prompt has {n} characters, more than that many tokens can hold. Please reduce the length of "
                "the prompt.",
                param="prompt",
            )

    def prompt_ids(self, kind: str, req: P.CompletionRequest | P.ChatCompletionRequest) -> list[int]:
        """Blocking (tokenizes): call through ``off_loop``. Untruncated (``truncate_prompt_tokens``
        applies after the images' spans are expanded); a text too long to fit is refused unread
        unless the request truncates it."""
        bounded = req.truncate_prompt_tokens is None
        if kind == "chat":
            assert isinstance(req, P.ChatCompletionRequest)
            if bounded:
                self._check_chars(req.text_chars())  # before templating
            return self._encode(req.render_prompt(), bounded)  # V4.1's format (chat_format.py)
        assert isinstance(req, P.CompletionRequest)
        prompt = req.single_prompt()
        ids = self._encode(prompt, bounded) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise P.APIError("the prompt is empty", param="prompt")
        return ids

    async def tokenizer_route(self, request: Request, detokenizing: bool) -> JSONResponse:
        """vLLM's ``/tokenize`` and ``/detokenize`` (serve/tokenize.py)."""
        self.check_auth(request)
        body = P.parse_json_body(await read_body(request, self.cfg.max_body_bytes))
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise P.APIError(f"The model `{model}` does not exist.", 404, param="model")
        if detokenizing:
            return JSONResponse(await self.off_loop(detokenize, self.tokenizer, body))
        max_len = self.model_cfg.max_seq_len
        return JSONResponse(await self.off_loop(tokenize, self.tokenizer, body, max_len, self.prompt_ids))

    @staticmethod
    def truncate(req: P.CompletionRequest | P.ChatCompletionRequest, ids: list[int], images: list[Any]) -> list[int]:
        """``truncate_prompt_tokens``: the prompt's last k tokens, before the length check (the router
        counts the same); a cut through a prompt with images (whose spans must stay whole) is refused."""
        kept = req.truncate(ids)
        if images and len(kept) < len(ids):
            raise P.APIError(
                f"truncate_prompt_tokens={req.truncate_prompt_tokens} would cut a prompt with images "
                f"({len(ids)} tokens): an image's span cannot be cut",
                param="truncate_prompt_tokens",
            )
        return kept

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
        body = P.parse_json_body(await read_body(request, self.cfg.max_body_bytes))
        req = P.parse_request(kind, body)
        internal = has_internal(request, self.secret)
        if req.kv_transfer_params is not None and not internal:
            raise P.APIError(
                "kv_transfer_params is internal: only the router (with the deployment's internal credential) "
                "may send it",
                403,
                param="kv_transfer_params",
            )
        self.check_model(req)
        P.check_n_for_mode(req.n, self.cfg.mode)
        ids = await self.off_loop(self.prompt_ids, kind, req)
        images: list[Any] = []
        if kind == "chat":  # vision: decode image parts, expand their placeholders (serve/vision_inputs.py)
            limits = ImageLimits(self.cfg.max_images, self.cfg.max_image_bytes, allow_http=self.cfg.allow_image_urls)
            ids, images = await self.off_loop(request_images, req.message_dicts(), ids, self.model_cfg, limits)
        ids = self.truncate(req, ids, images)
        bad_words = await self.off_loop(P.tokenize_bad_words, self.tokenizer, req.bad_words) if req.bad_words else []
        params = req.sampling_params(len(ids), self.model_cfg.max_seq_len, self.sampling_defaults, bad_words)
        self.check_length(ids, params)
        req.stop_strings()  # validated before anything is queued
        # the router's id is unique already (and its aborts name it); a client's own X-Request-Id is made
        # unique as the router makes it: two clients' ids, or a retry under the id of a request still
        # running here, would otherwise meet in the engine (400 "already in use")
        rid = (client_request_id(request) or P.new_id(kind)) if internal else unique_request_id(request, kind)
        if rid in self._aborted:
            raise P.APIError(f"request {rid} was aborted", 499)
        kv = req.kv_transfer_params
        if self.cfg.role == "prefill":
            return await self.prefill(kind, req, request, rid, ids, params, t_arrival, images)
        if kv is not None and kv.get("do_remote_decode"):
            raise P.APIError(
                f"this is a {self.cfg.role} worker: do_remote_decode needs a prefill worker", param="kv_transfer_params"
            )
        progress = internal and PROGRESS_HEADER in request.headers
        return await self.generate(kind, req, request, rid, ids, params, t_arrival, progress, images)

    async def _add(self, rid: str, ids: list[int], params: SamplingParams, **kw: Any) -> RequestStream:
        (stream,) = await self._add_together([(rid, ids, params, kw)])
        return stream

    async def _add_together(
        self, requests: list[tuple[str, list[int], SamplingParams, dict[str, Any]]]
    ) -> list[RequestStream]:
        try:
            return await self.aengine.add_together(requests)
        except PrefixStateError as e:
            raise P.APIError(f"bad prefix state: {e}", param="kv_transfer_params") from None
        except RequestError as e:
            raise P.APIError(str(e), param=e.param) from None
        except EngineDeadError as e:
            raise P.APIError(str(e), 503) from None

    # ---- prefill worker ------------------------------------------------------------------------------

    async def prefill(
        self,
        kind: str,
        req: Any,
        request: Request,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        t_arrival: float,
        images: list[Any] | None = None,
    ) -> Response:
        kv = req.kv_transfer_params or {}
        if not kv.get("do_remote_decode"):
            raise P.APIError(
                "this is a prefill worker: send requests to the router, or set "
                'kv_transfer_params={"do_remote_decode": true}',
                param="kv_transfer_params",
            )
        # answer now, push the prefix as it is computed; D imports a streamed prefix into one request,
        # so n > 1 (D's n requests import one state) takes the whole state
        if req.n == 1 and streaming.streams(self, len(ids)):
            return await streaming.answer_early(self, kind, rid, ids, params, t_arrival, images)
        t_add = time.perf_counter()
        kw: dict[str, Any] = {"images": images} if images else {}
        if self.cfg.engine.stream_prefix:  # not streamed (n > 1): the prefix in one piece, not its last slice
            kw["whole_prefix"] = True
        stream = await self._add(rid, ids, params, **kw)
        out = await until_disconnect(request, stream.result())
        if isinstance(out, Aborted):
            raise P.APIError("the request was aborted", 499)
        if isinstance(out, Failed):
            raise P.APIError(out.message, out.status)
        if out.error or out.prefix_state is None:
            raise P.APIError(out.error or "the prefill produced no prefix state", 400 if out.error else 500)
        t_done = time.perf_counter()
        prefill_s = t_done - t_add
        self.metrics.prefill_compute.observe(prefill_s)
        queue_s = out.metrics.get("queue")  # of prefill_s, the wait for P's first step
        if queue_s is not None:
            self.metrics.queue.observe(queue_s)
        state = await self.off_loop(out.exported_state)  # its copy off the device may still run
        t_pub = time.perf_counter()
        export_s = t_pub - t_done  # waiting for that copy (engine/export.py), on the TTFT path
        # of which the copy itself on the GPU (None on CPU); the rest is P's step still computing
        export_copy_s = out.prefix_export.copy_s() if out.prefix_export is not None else None
        try:
            published = await self.off_loop(self.handoff.publish, rid, state)
        except Exception as e:
            self.aengine.release_transfer(rid)
            log.exception("publishing prefix state %s failed", rid)
            raise P.APIError(f"publishing the prefix state failed: {e}", 500) from None
        publish_s = time.perf_counter() - t_pub
        if await request.is_disconnected() or rid in self._aborted:  # nobody will fetch it: free it now
            self.handoff.release(rid)
            raise ClientDisconnected()
        comp = out.outputs[0]
        kv_out: dict[str, Any] = {
            **published,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "mode": self.cfg.mode,
            "split": state.split,
            "num_prompt_tokens": len(ids),
            "prefill_s": prefill_s,
            "prefill_queue_s": queue_s,
            "export_s": export_s,
            "export_copy_s": export_copy_s,
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
            "prefill_queue_s": queue_s,
            "export_s": export_s,
            "export_copy_s": export_copy_s,
            "publish_s": publish_s,
            "prefill_total_s": time.perf_counter() - t_arrival,
        }
        return JSONResponse(body)

    # ---- decode / colocated worker -------------------------------------------------------------------

    async def generate(
        self,
        kind: str,
        req: Any,
        request: Request,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        t_arrival: float,
        progress: bool = False,
        images: list[Any] | None = None,
    ) -> Response:
        timings: dict[str, Any] = {"prefill_path": "local"}
        kv = req.kv_transfer_params
        got = None
        streamed = self.cfg.role == "decode" and streaming.is_streamed(kv)
        if streamed and req.n > 1:  # P streams a prefix only for n=1 (prefill above)
            raise P.APIError("a streamed prefix state is imported by one request: n must be 1", param="n")
        if streamed:
            self.handoff.check_stream(kv)
        elif self.cfg.role == "decode" and kv is not None and kv.get("do_remote_prefill"):
            got = await until_disconnect(request, self.handoff.receive(kv, ids, timings, self.metrics))
        state = got.state if got is not None else None
        kw: dict[str, Any] = {"prefix_state": state, "first_token": got.first_token if state is not None else None}
        if images:
            kw["images"] = images
        if state is not None and got.first_logprobs is not None and _ENGINE_TAKES_FIRST_LOGPROBS:
            kw["first_token_logprobs"] = got.first_logprobs
        if streamed:  # the slices come later (streaming.start_pull); the images are the request's still
            kw = {"prefix_stream": True, **({"images": images} if images else {})}
        t_add = time.perf_counter()
        # n choices: n engine requests of the same prompt (and the same imported prefix state), the
        # others forked from the first at its last prompt row (the prompt computed once, its blocks
        # shared), choice i seeded with seed + i; the request's id aborts them all (abort)
        crids = P.choice_ids(rid, req.n)
        streams = await self._add_together(
            [(crids[0], ids, params, kw)]
            + [
                (
                    crid,
                    ids,
                    dataclasses.replace(params, seed=P.choice_seed(params.seed, i)),
                    {**kw, "fork_of": crids[0]},
                )
                for i, crid in enumerate(crids[1:], 1)
            ]
        )
        if streamed:
            streaming.start_pull(self, rid, kv, ids, timings)
        created = int(time.time())
        ctxs = [
            _Ctx(kind, req, rid, ids, t_arrival, t_add, timings, self._tracker(req, params, got), created, chat, i)
            for i, chat in enumerate(req.output() if kind == "chat" else None for _ in streams)
        ]
        if req.stream or progress:

            async def close() -> None:
                for s in streams:
                    s.close()  # a no-op once the request finished

            if not req.stream:
                return GuardedStreamingResponse(
                    self._collect_with_progress(ctxs, streams),
                    close,
                    media_type="application/json",
                    headers={"X-Request-Id": rid},
                )
            return GuardedStreamingResponse(
                self._stream(ctxs, streams), close, media_type="text/event-stream", headers={"X-Request-Id": rid}
            )
        return await until_disconnect(request, self._collect(ctxs, streams))

    def _tracker(self, req: Any, params: SamplingParams, got: Any) -> OutputTracker:
        return OutputTracker(
            self.tokenizer,
            req.stop_strings(),
            req.include_stop_str_in_output,
            self.engine.config.eos_token_id,
            got.first_logprobs if got is not None and got.state is not None else None,
            min_tokens=params.min_tokens,
            skip_special_tokens=req.skip_special_tokens,
        )

    async def _merged(self, ctxs: list[_Ctx], streams: list[RequestStream]) -> AsyncIterator[int]:
        """The choices' outputs as they come (``_outputs`` each): the index of the choice an output
        advanced, in lock step (a choice's next output waits until the caller has read its
        tracker). A choice that fails ends them all; leaving early closes every stream (aborts)."""
        if len(ctxs) == 1:
            async for _ in self._outputs(ctxs[0], streams[0]):
                yield 0
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for _ in self._outputs(ctxs[i], streams[i]):
                    read = loop.create_future()
                    await queue.put((i, read))
                    await read
            except Exception as e:
                await queue.put((i, e))
            else:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(ctxs))]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i
                    item.set_result(None)
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()

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
                    raise P.APIError(item.message, item.status)
                if item.error:
                    raise P.APIError(item.error, 400 if not item.outputs[0].token_ids else 500)
                now = time.perf_counter()
                if item.outputs[0].token_ids:
                    if last_t is None:
                        self._first_token(ctx, now, item.metrics.get("queue"))
                    else:
                        gaps.append(now - last_t)
                    last_t = now
                await self.off_loop(ctx.tracker.update, item)
                if item.finished or ctx.tracker.done:
                    # from the same origin as ttft_s (the router's prefill round trip included)
                    ctx.timings["e2e_s"] = (ctx.timings.get("prefill_rtt_s") or 0.0) + (now - ctx.t_arrival)
                    self.metrics.e2e.observe(now - ctx.t_arrival)
                    self.metrics.finished(item.metrics, ctx.tracker.finish_reason, gaps)
                yield item
                if ctx.tracker.done:
                    return  # a stop string: leaving the stream aborts the engine request
        finally:
            stream.close()

    def _first_token(self, ctx: _Ctx, now: float, queue_s: float | None) -> None:
        t = ctx.timings
        if "ttft_s" in t:  # n > 1: the first choice's first token is the request's
            return
        t["decode_first_step_s"] = now - ctx.t_add
        t["decode_queue_s"] = queue_s  # of decode_first_step_s, the wait for the engine's first step
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
        choice: dict[str, Any] = {"index": ctx.index}
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

    def _echo(self, ctx: _Ctx) -> str:
        """completions ``echo``: the prompt's text in front of the completion."""
        if ctx.kind != "completion" or not getattr(ctx.req, "echo", False):
            return ""
        prompt = ctx.req.single_prompt()
        if isinstance(prompt, str):
            return prompt  # as sent, truncated or not (vLLM does the same)
        return self.tokenizer.decode(ctx.ids) if self.tokenizer is not None else ""  # token ids: as run (vLLM's)

    def _final_body(self, ctxs: list[_Ctx]) -> dict[str, Any]:
        ctx = ctxs[0]
        body = P.response_envelope(ctx.kind, ctx.rid, self.model_name, ctx.created)
        body["choices"] = []
        for c in ctxs:
            text, toks, lps = c.tracker.delta()
            body["choices"].append(self._choice(c, self._echo(c) + text, toks, lps, final=True, stream=False))
        body["usage"] = _usage(ctxs)
        if ctx.req.return_token_ids:
            body["prompt_token_ids"] = ctx.ids
        body["asympd_timings"] = ctx.timings
        return body

    async def _collect(self, ctxs: list[_Ctx], streams: list[RequestStream]) -> Response:
        async for _ in self._merged(ctxs, streams):
            pass
        return JSONResponse(await self.off_loop(self._final_body, ctxs), headers={"X-Request-Id": ctxs[0].rid})

    async def _collect_with_progress(self, ctxs: list[_Ctx], streams: list[RequestStream]) -> AsyncIterator[bytes]:
        """A non-streamed answer for the router: whitespace as tokens come (progress), then the JSON
        body; a failure after the status line went out is the error body, which the router maps
        back to its status."""
        last = time.monotonic()
        try:
            async with contextlib.aclosing(self._merged(ctxs, streams)) as outputs:
                async for _ in outputs:
                    if time.monotonic() - last >= PROGRESS_EVERY_S:
                        last = time.monotonic()
                        yield b" "
            body = await self.off_loop(self._final_body, ctxs)
        except P.APIError as e:
            self.metrics.request_errors.labels(str(e.status)).inc()
            body = e.body()
        except Exception as e:
            log.exception("request %s failed", ctxs[0].rid)
            body = P.error_body(f"internal error: {e}", 500)
        yield json.dumps(body).encode()

    async def _stream(self, ctxs: list[_Ctx], streams: list[RequestStream]) -> AsyncIterator[str]:
        """SSE chunks; with n > 1 the choices' chunks interleave as their tokens come, each choice
        carrying its ``index`` (as vLLM)."""
        ctx0 = ctxs[0]
        req = ctx0.req
        options = req.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = P.response_envelope(ctx0.kind, ctx0.rid, self.model_name, ctx0.created, chunk=True)
            body["choices"] = choices
            if continuous:
                body["usage"] = _usage(ctxs)
            body.update(extra)
            return f"data: {json.dumps(body)}\n\n"

        offsets = [0] * len(ctxs)
        first_chunk = True
        try:
            if ctx0.kind == "chat":
                for ctx in ctxs:
                    first = {
                        "index": ctx.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    ids = {"prompt_token_ids": ctx.ids} if req.return_token_ids and ctx.index == 0 else {}
                    yield chunk([first], **ids)
            for ctx in ctxs:
                echo = self._echo(ctx)
                if echo:
                    yield chunk([{"index": ctx.index, "text": echo, "logprobs": None, "finish_reason": None}])
            # closed here, not when collected, when the client leaves: its choices' tasks end with it
            async with contextlib.aclosing(self._merged(ctxs, streams)) as outputs:
                async for i in outputs:
                    ctx = ctxs[i]
                    tr = ctx.tracker
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
                    choice = self._choice(ctx, text, toks, lps, final=tr.done, stream=True, text_offset=offsets[i])
                    yield chunk([choice], **extra)
                    offsets[i] += len(text)
            if options is not None and options.include_usage:
                yield chunk([], usage=_usage(ctxs), asympd_timings=ctx0.timings)
        except P.APIError as e:
            self.metrics.request_errors.labels(str(e.status)).inc()
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # never leave a stream hanging without a word
            log.exception("stream %s failed", ctx0.rid)
            yield f"data: {json.dumps(P.error_body(f'internal error: {e}', 500))}\n\n"
        yield "data: [DONE]\n\n"

    # ---- internal routes -----------------------------------------------------------------------------

    async def abort(self, request: Request) -> JSONResponse:
        """Abort a request wherever it is (the router calls this when its client leaves). On a
        prefill worker this also drops a published prefix state, freeing its blocks."""
        require_internal(request, self.secret, "/asympd/abort")
        body = P.parse_json_body(await read_body(request, self.cfg.max_body_bytes))
        rid = body.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise P.APIError("request_id (a string) is required", param="request_id")
        self.mark_aborted(rid)
        self.aengine.abort(rid)
        for crid in P.choice_ids(rid, P.MAX_N):  # the choices of an n > 1 request (a no-op for unknown ids)
            self.aengine.abort(crid)
        released = self.handoff.release(rid)
        return JSONResponse({"request_id": rid, "aborted": True, "released_transfer": bool(released)})


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
    index: int = 0  # the choice's (OpenAI's n)


def _usage(ctxs: list[_Ctx]) -> dict[str, int]:
    """The prompt once, the choices' completion tokens summed (OpenAI's usage for n choices)."""
    return P.usage(len(ctxs[0].ids), sum(len(c.tracker.token_ids) for c in ctxs))


def _max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for (byte-level vocabularies spell one
    character per byte), so a prompt longer than max_seq_len times this cannot fit."""
    if tokenizer is None:
        return 1
    return max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def serve(cfg: ServeConfig, log_level: str = "info") -> None:
    """Load, bind, serve until SIGINT/SIGTERM."""
    setup_logging(log_level)
    server = WorkerServer(cfg)
    sock = bind_socket(cfg.host, cfg.port)
    server.port = sock.getsockname()[1]
    run_app(build_app(server), sock, log_level)
