"""An asyncio front for ``LLMEngine``: one background thread owns the engine.

The engine is not thread-safe, so every ``add_request`` / ``abort_request`` / ``release_transfer``
/ ``step`` / ``stats`` call runs on that thread, fed by a queue. Handlers on the event loop get an
async iterator of ``RequestOutput`` per request; leaving it early (client gone, stop string hit)
aborts the request in the engine so its blocks are freed. Transport threads (the lease reaper, the
NIXL notification poller) may call ``release_transfer`` directly: it only enqueues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from asympd.engine.engine import LLMEngine
from asympd.engine.request import RequestOutput
from asympd.engine.sampling import SamplingParams
from asympd.serve.busy import BusyClock
from asympd.serve.stall_watch import CompileWatch, GCWatch

log = logging.getLogger(__name__)
SLOW_S = 1.0  # a step (or a batch of commands) slower than this is logged
BUSY_POLL_S = 0.005  # idle, with a step's GPU work still running: how often to look for its end
STEP_LOG = 4096  # engine steps kept for ``steps_since`` (the co-run calibration reads a few hundred)

_STOP = object()


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or crashed): requests cannot be served."""


@dataclass
class Aborted:
    """Delivered to a stream whose request was aborted from elsewhere (``abort`` endpoint)."""

    reason: str


@dataclass
class Failed:
    """Delivered to every stream when ``step`` raised: the engine dropped the request; or to one
    stream another part of the server failed (``fail``), with the HTTP status it answers."""

    message: str
    status: int = 500


class RequestStream:
    """What one handler reads: engine outputs for one request, in order, ending with a finished
    output, an ``Aborted`` or a ``Failed``."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue[RequestOutput | Aborted | Failed] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput | Aborted | Failed]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput | Aborted | Failed]:
        try:
            while True:
                item = await self.queue.get()
                if not isinstance(item, RequestOutput) or item.finished:
                    self.finished = True
                yield item
                if self.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Leaving before the end (client gone, stop string hit) aborts the request: frees its blocks."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def result(self) -> RequestOutput | Aborted | Failed:
        """The last item (the finished output), for callers that do not stream."""
        last: Any = None
        async for item in self:
            last = item
        return last


def _graphs(engine):
    """The engine's CUDA graphs (None on CPU, eager, or a CP engine, which has no runner)."""
    return getattr(getattr(engine, "runner", None), "graphs", None)


class _StepStart(NamedTuple):
    """What the engine thread notes before a step, to account for the step after it."""

    wall: float  # time.time()
    t: float  # time.perf_counter()
    prompt_tokens: int
    captured: int | None  # CUDA graphs captured so far
    compiles: int  # CompileWatch's mark
    collections: tuple[float, int, int]  # GCWatch's mark
    requests: int | None  # in the engine as the step began (a CP engine, one queued prompt a step: None)

    @classmethod
    def of(cls, engine, compiles: CompileWatch, collector: GCWatch) -> _StepStart:
        graphs = _graphs(engine)
        captured = None if graphs is None else graphs.stats.get("captured")
        marks = compiles.mark(), collector.mark()
        requests = len(engine.requests) if hasattr(engine, "requests") else None
        return cls(time.time(), time.perf_counter(), engine.counters["prompt_tokens"], captured, *marks, requests)


class AsyncEngine:
    """Runs ``LLMEngine`` in a daemon thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[float, list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # set under the lock once the thread drains its queue for the last time: a command put
        # after that would wait forever, so ``_submit`` refuses it instead
        self._closed = False
        self._submit_lock = threading.Lock()
        self.error: str | None = None
        # [wall-clock start, seconds, prompt rows, decode sequences, once known seconds to the GPU end]
        # of the last STEP_LOG steps: another process's steps on the same GPU line up with these by
        # wall clock (bench/e2e.py co-run)
        self._steps: deque[list[float]] = deque(maxlen=STEP_LOG)
        self._steps_lock = threading.Lock()
        # busy seconds, host and GPU (``busy.BusyClock``); the engine thread makes it and reads it
        self.busy = BusyClock()
        # serving steps that met a shape start-up had not (a Triton compile or a CUDA-graph capture
        # inside the step): each one a stall mid-traffic, 0.5 s a compile at true depth
        # (bench/results/first_steps.json); counted here so /asympd/stats and /metrics show them
        self._new_shapes = {"steps": 0, "graphs": 0, "compiles": Counter()}

    def new_shapes(self) -> dict[str, Any]:
        """Serving steps that compiled a Triton kernel or captured a CUDA graph so far: ``steps``,
        ``graphs`` (those captured) and ``compiles`` (the kernels compiled, by name); any thread."""
        with self._steps_lock:
            return {**self._new_shapes, "compiles": dict(self._new_shapes["compiles"])}

    def steps_since(self, t: float) -> list[list[float]]:
        """The logged steps that started at or after wall-clock time ``t`` (any thread): [start,
        seconds, prompt rows, decode sequences], and once known the seconds to the step's GPU end
        (``busy.BusyClock``: a step that samples nothing returns before its GPU work ends)."""
        with self._steps_lock:
            return [list(s) for s in self._steps if s[0] >= t]

    def _logger(self, entry: list[float]) -> Callable[[float], None]:
        def add(seconds: float) -> None:
            with self._steps_lock:
                entry.append(seconds)

        return add

    # ---- lifetime ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="asympd-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._cmds.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the event-loop side -----------------------------------------------------------------------

    async def add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any
    ) -> RequestStream:
        """Queue a request; ``kwargs`` go to ``add_request`` (prefix_state, first_token, ...).
        Raises what ``add_request`` raises (RequestError, PrefixStateError)."""
        (stream,) = await self.add_together([(request_id, prompt_token_ids, params, kwargs)])
        return stream

    async def add_together(
        self, requests: list[tuple[str, list[int], SamplingParams, dict[str, Any]]]
    ) -> list[RequestStream]:
        """Queue ``(request_id, prompt_token_ids, params, kwargs)`` requests between two engine
        steps (OpenAI's n choices: the others fork from the first at its last prompt row, which no
        step may reach before they are in); all or none: a refusal takes back those added."""
        streams = [RequestStream(self, rid) for rid, *_ in requests]
        await self._submit(("add", requests, streams))
        return streams

    async def call(self, fn: Callable[[LLMEngine], Any], timeout: float = 10.0) -> Any:
        """Run ``fn(engine)`` on the engine thread and return its result (stats, for /metrics)."""
        return await asyncio.wait_for(self._submit(("call", fn)), timeout)

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The engine's ``stats()``, its busy seconds, host and GPU (``busy_seconds``), and the
        serving steps that met a new shape (``new_shapes``), read on the engine thread."""
        return await self.call(
            lambda e: {**e.stats(), "busy_seconds": self.busy.poll(), "new_shapes": self.new_shapes()}, timeout
        )

    def abort(self, request_id: str) -> None:
        """Thread-safe: abort a request wherever it is (waiting, running, held for transfer)."""
        self._cmds.put(("abort", request_id))

    def fail(self, request_id: str, message: str, status: int = 500) -> None:
        """Thread-safe: abort a request and end its stream with ``Failed(message, status)`` (a
        streamed prefix that broke off)."""
        self._cmds.put(("fail", request_id, message, status))

    def release_transfer(self, request_id: str) -> None:
        """Thread-safe: a prefill worker's exported prefix was acked or expired; free its blocks."""
        self._cmds.put(("release", request_id))

    def _submit(self, cmd: tuple) -> asyncio.Future:
        with self._submit_lock:
            if not self.alive or self._closed:
                raise EngineDeadError(f"the engine is not running{': ' + self.error if self.error else ''}")
            assert self._loop is not None
            fut = self._loop.create_future()
            self._cmds.put((*cmd, fut))
            return fut

    # ---- the engine thread -------------------------------------------------------------------------

    def _deliver(self, stream: RequestStream, item: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _resolve(self, fut: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        def set_() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(set_)
        except RuntimeError:
            pass

    def _handle(self, cmd: tuple) -> bool:
        """Apply one command; False on the stop sentinel."""
        if cmd is _STOP:
            return False
        op = cmd[0]
        if op == "add":
            _, requests, streams, fut = cmd
            added: list[str] = []
            try:
                for rid, ids, params, kwargs in requests:
                    self.engine.add_request(rid, ids, params, **kwargs)
                    added.append(rid)
            except Exception as e:
                for rid in added:
                    self.engine.abort_request(rid)
                self._resolve(fut, error=e)
            else:
                for (rid, *_), stream in zip(requests, streams, strict=True):
                    self._streams[rid] = stream
                self._resolve(fut, streams)
        elif op == "abort":
            rid = cmd[1]
            self.engine.abort_request(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._deliver(stream, Aborted("aborted"))
        elif op == "fail":
            _, rid, message, status = cmd
            self.engine.abort_request(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._deliver(stream, Failed(message, status))
        elif op == "release":
            self.engine.release_transfer(cmd[1])
        elif op == "call":
            _, fn, fut = cmd
            try:
                self._resolve(fut, fn(self.engine))
            except Exception as e:
                self._resolve(fut, error=e)
        return True

    def _run(self) -> None:
        engine = self.engine
        idle_wait = 0.0  # how long to wait for a command before the next step
        compiles, collector = CompileWatch(), GCWatch()
        try:
            # made here: its events go on this thread's stream, the one the steps queue on
            self.busy = BusyClock(getattr(getattr(engine, "model", None), "device", None))
            while True:
                self.busy.poll()
                # nothing to step: block until a command comes (or, while a step's GPU work is
                # still running, wake to count its end)
                if engine.has_unfinished_requests():
                    timeout = idle_wait
                else:
                    timeout = BUSY_POLL_S if self.busy.pending else None
                try:
                    cmd = self._cmds.get(timeout=timeout) if timeout != 0.0 else self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
                if cmd is not None:
                    t_cmd = time.perf_counter()
                    try:
                        while True:
                            if not self._handle_safely(cmd):
                                return
                            cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        pass
                    if (d := time.perf_counter() - t_cmd) > SLOW_S:
                        log.warning("slow commands: %.2f s handling requests between steps", d)
                if not engine.has_unfinished_requests():
                    continue
                before = engine.counters["prompt_tokens"] + engine.counters["generation_tokens"]
                start = _StepStart.of(engine, compiles, collector)
                try:
                    outputs = engine.step()
                except Exception as e:  # a bug in a step: fail what is in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    continue
                dt = time.perf_counter() - start.t
                try:  # the step's outputs are delivered below whatever its bookkeeping meets
                    self._account(engine, start, dt, len(outputs), compiles, collector)
                except Exception:
                    log.exception("bookkeeping after an engine step failed (its outputs are delivered)")
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    if stream is not None:
                        self._deliver(stream, out)
                if self.on_step is not None:
                    try:
                        self.on_step(dt, outputs)
                    except Exception:
                        log.exception("on_step hook failed")
                progressed = outputs or engine.counters["prompt_tokens"] + engine.counters["generation_tokens"] > before
                # nothing could run (e.g. every request waits for blocks): wait for a command briefly
                idle_wait = 0.0 if progressed else 0.005
        except BaseException as e:
            self.error = f"{type(e).__name__}: {e}"
            log.exception("engine thread died")
            self._fail_all(f"engine thread died: {self.error}")
            raise
        finally:
            compiles.close()
            collector.close()
            self._drain_on_exit()

    def _handle_safely(self, cmd: tuple) -> bool:
        """``_handle``, but an engine call that raises (an abort or a release meeting a bug) is
        logged and the waiting stream failed: it must not end the thread that serves every request."""
        try:
            return self._handle(cmd)
        except Exception as e:
            log.exception("engine command %r failed", cmd[0])
            if cmd[0] in ("abort", "fail") and (stream := self._streams.pop(cmd[1], None)) is not None:
                self._deliver(stream, Failed(f"{cmd[0]} failed: {type(e).__name__}: {e}"))
            return True

    def _account(
        self, engine, start: _StepStart, dt: float, n_out: int, compiles: CompileWatch, collector: GCWatch
    ) -> None:
        """Log the step (``steps_since``, the busy clock) and say so if it stalled or met a new shape."""
        new_compiles, gc = compiles.since(start.compiles), collector.since(start.collections)
        graphs = _graphs(engine)
        prompt_rows = engine.counters["prompt_tokens"] - start.prompt_tokens
        rows = getattr(engine, "last_step", None) or (prompt_rows, 0)
        logged = None
        if rows[0] or rows[1]:  # not the empty steps of an engine waiting on held transfers
            logged = [start.wall, dt, int(rows[0]), int(rows[1])]
            with self._steps_lock:
                self._steps.append(logged)
        self.busy.step_done(start.t, start.t + dt, None if logged is None else self._logger(logged))
        new_graphs = None if graphs is None else graphs.stats.get("captured", 0) - (start.captured or 0)
        if new_compiles or new_graphs:
            with self._steps_lock:
                self._new_shapes["steps"] += 1
                self._new_shapes["graphs"] += new_graphs or 0
                self._new_shapes["compiles"].update(new_compiles)
        # a stall worth a line in the log (a compile, a capture, a slow import); and any step
        # that compiled or captured, however short: a shape serving should have met at start-up
        if dt > SLOW_S or new_compiles or new_graphs:
            log.warning(
                "%s: %.2f s, %d outputs, %d prompt rows, %d requests; "
                "graphs captured in the step: %s (%s); garbage collection in the step: %.1f ms (%d of the "
                "oldest generation); Triton compiles in the step: %s",
                "slow engine step" if dt > SLOW_S else "engine step met a new shape",
                dt,
                n_out,
                prompt_rows,
                n_out if start.requests is None else start.requests,  # before the step: P's finished leave in it
                new_graphs,
                None if graphs is None else graphs.stats,
                gc["ms"],
                gc["gen2"],
                new_compiles or "none",
            )

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s after a failed step", rid)
            self._deliver(stream, Failed(message))
        self._streams.clear()

    def _drain_on_exit(self) -> None:
        """Nobody may wait forever on a stopped engine."""
        for stream in self._streams.values():
            self._deliver(stream, Failed("the engine stopped"))
        self._streams.clear()
        with self._submit_lock:
            self._closed = True  # no command after this one's drain waits on a future
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd is not _STOP and cmd[0] in ("add", "call"):
                self._resolve(cmd[-1], error=EngineDeadError("the engine stopped"))
