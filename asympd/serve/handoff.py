"""The P -> D hand-off of a worker: publish (P), fetch + authenticate + validate (D), and the
fallback when the prefill path failed. The server, the tests and (through ``transfer.seal``) the
offline ``LLM`` move prefix states the same way.

P publishes each state under a random transfer id, sealed with the deployment secret
(``state_mac`` travels in ``kv_transfer_params``, which only the router, holding the internal
credential, can pass on to D). D refuses a state whose tag, prompt or shape is wrong, or whose
transfer id it already took (a replay), before the engine sees it.

Streamed (P's ``--stream-prefix``): P opens a stream and answers the router at once; it pushes each
slice as its chunked prefill finishes it, sealed under (transfer id, slice index), and the tag
travels with the slice on the data plane. D queues the request, pulls the slices while P computes,
checks each tag before the engine imports the slice, and the request runs when the last is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from asympd.config import ModelConfig
from asympd.serve import protocol as P
from asympd.transfer import PrefixState, PrefixStateError, TransferError, Transport, make_transport
from asympd.transfer.seal import new_transfer_id, seal, verify

log = logging.getLogger("asympd.serve")
# D: the most an ack that gives up a stream may take (best effort: P's lease frees it anyway)
ABANDON_ACK_S = 2.0
# D: the most it waits for one slice of a streamed prefix: P's queue and one prefill chunk come first
# (P's lease TTL bounds the whole stream)
STREAM_WAIT_S = 120.0


def slice_id(transfer_id: str, index: int) -> str:
    """What slice ``index`` of a streamed transfer is sealed under: a slice cannot be replayed at
    another index or in another transfer."""
    return f"{transfer_id}#{index}"


@dataclass
class Received:
    """What D takes from P: the state (None: compute the prefix here) and, in mode symmetric,
    the first token P sampled with its logprobs."""

    state: PrefixState | None = None
    first_token: int | None = None
    first_logprobs: dict[int, float] | None = None


class Handoff:
    """One worker's side of the data plane. ``release`` is called with the engine's request id
    when P may free a published state (acked, expired, aborted)."""

    def __init__(
        self,
        role: str,
        fingerprint: str,
        model_cfg: ModelConfig,
        secret: bytes,
        transport: str | None,
        options: dict[str, Any],
        release: Callable[[str], None],
        transfer_timeout: float = 10.0,
        on_prefill_failure: str = "recompute",
    ) -> None:
        self.role, self.fingerprint, self.model_cfg, self.secret = role, fingerprint, model_cfg, secret
        self.options, self.release_engine = options, release
        self.transfer_timeout, self.on_prefill_failure = transfer_timeout, on_prefill_failure
        self.publisher: Transport | None = None
        self.fetchers: dict[str, Transport] = {}  # D: one per transport name P advertises
        self._lock = threading.Lock()
        self._tid_of: dict[str, str] = {}  # P: request id -> transfer id of its published state
        self._rid_of: dict[str, str] = {}
        self._pushed: dict[str, int] = {}  # P: transfer id of a stream -> slices pushed so far
        self._taken: OrderedDict[str, None] = OrderedDict()  # D: transfer ids already fetched
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="asympd-fetch")
        self.name = "none"
        if role == "prefill":
            self.publisher = self._make(transport, publish=True)
            self.name = self.publisher.name
        elif role == "decode":
            t = self._make(transport, publish=False)
            self.fetchers[t.name] = t
            self.name = t.name

    def _make(self, name: str | None, publish: bool) -> Transport:
        # host: NIXL keeps UCX on loopback when the worker's transfer address is loopback
        options = {"device": self.options.get("device", "cpu"), "host": self.options["host"], "secret": self.secret}
        if publish:
            options.update(self.options, on_release=self._on_release, secret=self.secret)
        try:
            return make_transport(name or "nixl", self.fingerprint, **options)
        except TransferError as e:
            if name is not None:  # asked for explicitly: do not silently degrade
                raise
            log.warning("NIXL cannot run here (%s): using the TCP transport", e)
            return make_transport("tcp", self.fingerprint, **options)

    # ---- P -------------------------------------------------------------------------------------------

    def publish(self, rid: str, state: PrefixState) -> dict[str, Any]:
        """Hold ``state`` for D; the params D needs (transfer id, address, tag)."""
        assert self.publisher is not None
        tid = new_transfer_id()
        tag = seal(self.secret, tid, state)
        with self._lock:
            self._tid_of[rid], self._rid_of[tid] = tid, rid
        try:
            params = self.publisher.publish(tid, state)
        except BaseException:
            self._forget(tid)
            raise
        return {**params, "state_mac": tag}

    def open_stream(self, rid: str) -> dict[str, Any]:
        """Open a streamed prefix for request ``rid`` (transfer/stream.py); the params D needs exist
        before any slice does, so P can answer the router at once and D fetch while P computes."""
        assert self.publisher is not None
        if not hasattr(self.publisher, "open_stream"):
            raise TransferError(f"the {self.publisher.name} transport cannot stream a prefix: use --transport tcp")
        tid = new_transfer_id()
        with self._lock:
            self._tid_of[rid], self._rid_of[tid] = tid, rid
            self._pushed[tid] = 0
        try:
            return self.publisher.open_stream(tid)
        except BaseException:
            self._forget(tid)
            raise

    def push(self, rid: str, piece: PrefixState, last: bool) -> None:
        """The next slice of ``rid``'s stream, sealed as slice ``index`` of its transfer."""
        with self._lock:
            tid = self._tid_of.get(rid)
            index = self._pushed.get(tid, 0) if tid is not None else 0
            if tid is not None:
                self._pushed[tid] = index + 1
        if tid is None:
            raise TransferError(f"request {rid} has no open prefix stream (released, expired or aborted)")
        self.publisher.push(tid, piece, last, tag=seal(self.secret, slice_id(tid, index), piece))

    def _forget(self, tid: str) -> str | None:
        with self._lock:
            rid = self._rid_of.pop(tid, None)
            self._pushed.pop(tid, None)
            if rid is not None:
                self._tid_of.pop(rid, None)
        return rid

    def _on_release(self, tid: str, _state: Any, reason: str) -> None:
        """Lease released (D acked, it expired, or P closed): free the engine's blocks."""
        rid = self._forget(tid)
        if reason == "expired":
            log.warning("prefix state of %s expired before the decode worker fetched it", rid)
        if rid is not None:
            self.release_engine(rid)

    def release(self, rid: str) -> bool:
        """Drop the state published for request ``rid`` now; True if it was still held."""
        with self._lock:
            tid = self._tid_of.get(rid)
        return self.publisher is not None and tid is not None and self.publisher.release(tid)

    # ---- D -------------------------------------------------------------------------------------------

    def _fetcher(self, name: str) -> Transport:
        """D's transport for what P advertised, made on first use (fetch threads share it)."""
        with self._lock:
            if name not in self.fetchers:
                try:
                    self.fetchers[name] = make_transport(
                        name,
                        self.fingerprint,
                        device=self.options.get("device", "cpu"),
                        host=self.options["host"],
                        secret=self.secret,
                    )
                except ValueError as e:
                    raise P.APIError(f"bad kv_transfer_params: {e}", param="kv_transfer_params") from None
            return self.fetchers[name]

    def _take(self, tid: str) -> None:
        with self._lock:
            if tid in self._taken:
                raise PrefixStateError(f"transfer {tid} was already used: a replayed prefix state")
            self._taken[tid] = None
            while len(self._taken) > 100_000:
                self._taken.popitem(last=False)

    def fetch(self, kv: dict[str, Any], ids: list[int]) -> PrefixState:
        """Blocking: pull, authenticate and validate the state ``kv`` names for prompt ``ids``."""
        tid = str(kv["transfer_id"])
        self._take(tid)
        state = self._fetcher(str(kv.get("transport", "tcp"))).fetch(
            kv, self.fingerprint, timeout=self.transfer_timeout, ack=True
        )
        t0 = time.perf_counter()
        verify(self.secret, tid, state, kv.get("state_mac"), ids)
        state.validate(self.model_cfg, self.fingerprint)
        state.receipt["check_s"] = time.perf_counter() - t0
        return state

    def check_stream(self, kv: dict[str, Any]) -> None:
        """D, before it queues a streamed request: the params name a stream it may take (once)."""
        missing = [k for k in ("host", "port", "transfer_id") if k not in kv]
        if missing:
            raise P.APIError(f"bad kv_transfer_params: missing {', '.join(missing)}", param="kv_transfer_params")
        try:
            self._take(str(kv["transfer_id"]))
        except PrefixStateError as e:
            raise P.APIError(f"bad prefix state: {e}", param="kv_transfer_params") from None

    def abandon_stream(self, kv: dict[str, Any]) -> None:
        """Blocking, D, best effort: tell P to free a stream this worker will not read to its end (a
        bad slice, a failed pull), as the ack after its last slice would; else P holds its blocks
        until the lease expires. P already gone is no error here."""
        with contextlib.suppress(TransferError, P.APIError, OSError, KeyError, ValueError):
            self._fetcher(str(kv.get("transport", "tcp"))).ack(kv, self.fingerprint, timeout=ABANDON_ACK_S)

    def fetch_slices(self, kv: dict[str, Any], ids: list[int]) -> Iterator[PrefixState]:
        """Blocking, D: the authenticated slices of the stream ``kv`` names, each as P pushes it
        (the engine checks their order and shape as it imports them); acked after the last."""
        tid = str(kv["transfer_id"])
        fetcher = self._fetcher(str(kv.get("transport", "tcp")))
        if not hasattr(fetcher, "fetch_stream"):
            raise TransferError(f"the {fetcher.name} transport cannot stream a prefix")
        pieces = fetcher.fetch_stream(kv, self.fingerprint, timeout=STREAM_WAIT_S, ack=True, with_tags=True)
        for index, (piece, tag) in enumerate(pieces):
            verify(self.secret, slice_id(tid, index), piece, tag, ids if piece.start == 0 else [])
            yield piece

    async def receive(self, kv: dict[str, Any], ids: list[int], timings: dict[str, Any], metrics: Any) -> Received:
        """P's prefix for this request, or an empty ``Received`` under ``recompute`` when the prefill
        path failed (``fail``: a 503). A bad or forged state is a 400, never a fallback."""
        failure = kv.get("prefill_failed")
        timings["prefill_s"] = kv.get("prefill_s")
        timings["prefill_queue_s"] = kv.get("prefill_queue_s")  # of prefill_s: waiting for P's first step
        timings["prefill_rtt_s"] = kv.get("prefill_rtt_s")
        timings["publish_s"] = kv.get("publish_s")
        timings["export_s"] = kv.get("export_s")
        timings["export_copy_s"] = kv.get("export_copy_s")
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
            try:
                state = await asyncio.get_running_loop().run_in_executor(self.pool, self.fetch, kv, ids)
            except PrefixStateError as e:
                metrics.prefix_state_refusals.inc()
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
                timings["transfer_bytes"] = state.wire_nbytes  # as it crossed (FP4 global KV by default)
                for part, secs in state.receipt.items():  # arrive_s, unpack_s, check_s where measured
                    timings[f"transfer_{part}"] = secs
                metrics.ttft_transfer.observe(timings["transfer_s"])
                if timings["prefill_s"] is not None:
                    metrics.ttft_prefill.observe(float(timings["prefill_s"]))
                timings["prefill_path"] = "remote"
                return Received(state, first, lps)
        reason = "prefill_failed" if kv.get("prefill_failed") else "fetch_failed"
        metrics.prefill_fallbacks.labels(reason).inc()
        timings["fallback_reason"] = failure
        if self.on_prefill_failure == "fail":
            raise P.APIError(
                f"the prefill path failed and this decode worker runs --on-prefill-failure=fail: {failure}", 503
            )
        log.warning("recomputing the prefix here: %s", failure)
        timings["prefill_path"] = "recompute"
        return Received()

    # ---- both ----------------------------------------------------------------------------------------

    def transports(self) -> list[Transport]:
        with self._lock:
            return list(self.fetchers.values()) + ([self.publisher] if self.publisher else [])

    def snapshots(self) -> dict[str, dict[str, Any]]:
        return {t.name: t.metrics.snapshot() for t in self.transports()}

    def close(self) -> None:
        for t in self.transports():
            try:
                t.close()
            except Exception:
                log.exception("closing transport %s", t.name)
        self.pool.shutdown(wait=False, cancel_futures=True)
