"""The streamed P -> D hand-off on the HTTP path (``asympd serve --role prefill --stream-prefix``).

The router is unchanged: it sends P the request, then D the request with P's answer. What changes
is when P answers. A streaming P queues the request, opens a prefix stream on its transport and
answers the router at once with the stream's address (``kv_transfer_params.stream``), so the
router reaches D while P computes. P then pushes each slice of global KV as its chunked prefill
finishes it (``push_slices``). D queues the request as waiting for a streamed prefix, pulls the
slices over one connection and the engine writes each into the request's blocks as it arrives
(``pull_slices``); the request runs once the last slice is in. So the transfer overlaps P's compute
and only the last slice is left on the TTFT path.

Failure: P drops the stream when its request fails or is aborted, so D's next pull fails at once.
A stream none of which came (P died or dropped it before D's first pull) is a failed prefill:
``--on-prefill-failure recompute`` computes the prefix on D (nothing of it is in D's blocks yet). A
stream that breaks off after a slice (or a slice that fails authentication or validation) fails
D's request with a message: there is no recompute fallback once D has begun importing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from asympd.engine import modes
from asympd.engine.sampling import SamplingParams
from asympd.serve import protocol as P
from asympd.serve.async_engine import Aborted, Failed, RequestStream
from asympd.transfer import TransferError
from asympd.transfer.prefix_state import PrefixStateError

if TYPE_CHECKING:
    from asympd.serve.api_server import WorkerServer

log = logging.getLogger("asympd.serve")


def streams(server: WorkerServer, n: int) -> bool:
    """Whether this prefill worker streams the prefix of an ``n``-token prompt (there is one)."""
    c = server.cfg.engine
    return c.stream_prefix and modes.prefill_plan(server.model_cfg, n, c.mode, c.boundary_policy).export_upto > 0


def is_streamed(kv: dict[str, Any] | None) -> bool:
    """Whether D's ``kv_transfer_params`` name a streamed prefix (and the prefill did not fail)."""
    return bool(kv and kv.get("do_remote_prefill") and kv.get("stream") and not kv.get("prefill_failed"))


# ---- P -----------------------------------------------------------------------------------------------


async def answer_early(
    server: WorkerServer,
    kind: str,
    rid: str,
    ids: list[int],
    params: SamplingParams,
    t_arrival: float,
    images: list[Any] | None = None,
) -> JSONResponse:
    """Queue the prefill, open its stream and answer the router with the stream's params now."""
    t_add = time.perf_counter()
    stream = await server._add(rid, ids, params, **({"images": images} if images else {}))
    try:
        published = server.handoff.open_stream(rid)
    except Exception as e:
        stream.close()
        log.exception("opening the prefix stream of %s failed", rid)
        raise P.APIError(f"opening the prefix stream failed: {e}", 500) from None
    task = asyncio.create_task(push_slices(server, rid, stream, t_add))
    server.background.add(task)
    task.add_done_callback(server.background.discard)
    c = server.cfg.engine
    kv_out = {
        **published,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "mode": c.mode,
        "split": modes.prefill_plan(server.model_cfg, len(ids), c.mode, c.boundary_policy).export_upto,
        "num_prompt_tokens": len(ids),
    }
    body = P.response_envelope(kind, rid, server.model_name)
    empty = {"text": ""} if kind == "completion" else {"message": {"role": "assistant", "content": ""}}
    body["choices"] = [{"index": 0, **empty, "logprobs": None, "finish_reason": "length"}]
    body["usage"] = P.usage(len(ids), 0)
    body["kv_transfer_params"] = kv_out
    body["asympd_timings"] = {"prefill_total_s": time.perf_counter() - t_arrival}
    return JSONResponse(body)


async def push_slices(server: WorkerServer, rid: str, stream: RequestStream, t_add: float) -> None:
    """Hand each slice the engine exports to the stream (packing and sealing off the event loop);
    drop the stream if the request ends any other way."""
    try:
        async for item in stream:
            if isinstance(item, (Aborted, Failed)) or item.error:
                why = item.reason if isinstance(item, Aborted) else getattr(item, "message", None) or item.error
                log.warning("prefill of %s ended before its prefix was streamed: %s", rid, why)
                break
            if item.prefix_state is not None:
                await server.off_loop(lambda i=item: server.handoff.push(rid, i.exported_state(), i.finished))
            if item.finished:
                server.metrics.prefill_compute.observe(time.perf_counter() - t_add)
                return
    except TransferError as e:  # the stream is gone: aborted (the client left), expired, or D dropped it
        log.warning("streaming the prefix of %s stopped: %s", rid, e)
    except Exception:
        log.exception("streaming the prefix of %s failed", rid)
    finally:
        stream.close()
    server.handoff.release(rid)  # D's next pull fails at once instead of waiting


# ---- D -----------------------------------------------------------------------------------------------


def start_pull(server: WorkerServer, rid: str, kv: dict[str, Any], ids: list[int], timings: dict[str, Any]) -> None:
    """Pull the slices of ``rid``'s streamed prefix in the background (its request is queued)."""
    timings["prefill_rtt_s"] = kv.get("prefill_rtt_s")  # the router's P call: part of the TTFT
    task = asyncio.create_task(pull_slices(server, rid, kv, ids, timings))
    server.background.add(task)
    task.add_done_callback(server.background.discard)


async def pull_slices(
    server: WorkerServer, rid: str, kv: dict[str, Any], ids: list[int], timings: dict[str, Any]
) -> None:
    """Fetch each slice as P pushes it (on the hand-off's threads) and import it on the engine
    thread; a failure fails the request with the reason."""
    loop = asyncio.get_running_loop()
    pieces = server.handoff.fetch_slices(kv, ids)
    t0 = time.perf_counter()
    timings.update(prefill_path="remote-stream", stream_slices=0, transfer_bytes=0)
    try:
        while True:
            piece = await loop.run_in_executor(server.handoff.pool, next, pieces, None)
            if piece is None:
                break
            # before the import: the request may run (and answer) as soon as the last slice is in
            timings["transfer_s"] = time.perf_counter() - t0  # until this slice arrived; overlaps P's compute
            timings["stream_slices"] += 1
            timings["transfer_bytes"] += piece.wire_nbytes
            await server.aengine.call(lambda e, p=piece: e.import_slice(rid, p))
    except Exception as e:
        pieces.close()
        # P frees the stream now, not when its lease expires; in the background: an unreachable P
        # must not hold up this request's answer
        task = asyncio.ensure_future(loop.run_in_executor(server.handoff.pool, server.handoff.abandon_stream, kv))
        server.background.add(task)
        task.add_done_callback(server.background.discard)
        why = f"the streamed prefix from the prefill worker failed: {type(e).__name__}: {e}"
        forged = isinstance(e, PrefixStateError)  # as a whole state's: a 400, never a fallback
        if not forged and not timings["stream_slices"] and server.handoff.on_prefill_failure == "recompute":
            # nothing of it came (P died or dropped it first): nothing imported, so compute it here
            with contextlib.suppress(Exception):
                if await server.aengine.call(lambda eng: eng.compute_streamed_prefix_here(rid)):
                    log.warning("recomputing the prefix here: %s", why)
                    server.metrics.prefill_fallbacks.labels("stream_failed").inc()
                    timings.update(prefill_path="recompute", fallback_reason=why)
                    return
        if forged:
            server.metrics.prefix_state_refusals.inc()
            status = 400
        else:  # the prefill path failed (handoff.receive's 503 for a whole state)
            status = 503
            if server.handoff.on_prefill_failure == "fail":
                why = f"the prefill path failed and this decode worker runs --on-prefill-failure=fail: {why}"
        log.warning("streamed prefix of %s failed: %s", rid, e)
        server.aengine.fail(rid, why, status)
        return
    server.metrics.ttft_transfer.observe(time.perf_counter() - t0)
