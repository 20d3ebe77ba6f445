"""The prefill worker's prefix export, off the step's critical path.

When P finishes a prefix, the runner gathers the request's compressed KV, index keys, open
compressor rows (and windows, image rows) out of the cache. On CUDA that copy runs on a side stream
that first waits for the step's compute (an event), and lands in pinned host buffers, so the host
never synchronises: ``export_prefix`` returns a :class:`PendingExport` at once and the next step is
enqueued behind it while the copy engine drains. Whoever reads the bytes (the hand-off to a
transport, the offline ``LLM``) calls ``wait()`` first, off the engine's thread; and so that no
reader can forget, the state's own accessors (``named_buffers``, hence ``to_buffers``, ``serialize``,
``to``) wait too (``PrefixState.pending``). Under the ``fp4`` wire format the gathered KV stays on
the device, where ``to_buffers`` packs it (once, on the exporter's ``pack_stream``, so the hand-off
never queues behind P's next steps); the wait covers that gather too.

Block lifetime: the copy reads the request's cache blocks and slot after the step that wrote them.
Until it has completed (``ready()``), the engine must not free those blocks, or a later step could
reuse and overwrite them under the copy: ``LLMEngine`` parks such a request and frees its blocks at
the first step after ``ready()``.

On CPU there is no stream: the same calls copy synchronously and every export is ready when it
returns, with exactly the bytes a plain copy gives.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from asympd.transfer.prefix_state import HANDOFF_STREAM_PRIORITY, PrefixState

MIN_CLASS = 4 << 10  # smallest pinned buffer: open compressor pairs are a few KB


class _Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class PinnedPool:
    """Pinned host buffers reused across exports, in power-of-two size classes.

    Why a pool: pinning (cudaHostAlloc) costs far more than the copy it serves and serialises with
    the device, so pinning per request would bring back the stall the side stream removes; and only
    pinned memory lets a device->host copy run asynchronously. Why bounded: pinned pages are taken
    from the OS and never swapped, so a burst of long prompts must not keep gigabytes pinned: at most
    ``max_idle_bytes`` of idle buffers are kept, the rest are dropped when returned. A buffer goes
    back to the pool when its transfer is done (``PendingExport.release``), not before: a transport
    may still be reading it. Without CUDA (``pin=False``) nothing is pooled: plain tensors.
    """

    def __init__(self, max_idle_bytes: int = 256 << 20, pin: bool = True) -> None:
        self.max_idle_bytes, self.pin = max_idle_bytes, pin
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()  # returned from transport threads, taken by the engine's
        self.idle_bytes = 0
        self.counters = {"allocated": 0, "reused": 0, "dropped": 0}

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(MIN_CLASS, 1 << max(nbytes - 1, 0).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of at least ``nbytes``."""
        if not self.pin:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = self.size_class(nbytes)
        with self._lock:
            if self._idle[size]:
                self.idle_bytes -= size
                self.counters["reused"] += 1
                return self._idle[size].pop()
            self.counters["allocated"] += 1
        return self._alloc(size)

    def _alloc(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back; kept for reuse while the idle bytes stay under the bound."""
        if not self.pin:
            return
        size = buf.numel()
        with self._lock:
            if self.idle_bytes + size <= self.max_idle_bytes:
                self._idle[size].append(buf)
                self.idle_bytes += size
            else:
                self.counters["dropped"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"idle_bytes": self.idle_bytes, **self.counters}


class PendingExport:
    """A prefix state whose copy may still be in flight. ``state``'s host buffers are only valid
    after ``wait()`` (or once ``ready()``); they return to the pool at ``release()``."""

    def __init__(
        self,
        state: PrefixState,
        done: _Event | None,
        buffers: list[torch.Tensor],
        pool: PinnedPool,
        kept: list[torch.Tensor] | None = None,
        started: _Event | None = None,
    ) -> None:
        self.state, self.done, self.started = state, done, started
        self._buffers, self._pool, self._kept = buffers, pool, kept or []

    def ready(self) -> bool:
        """True once the copy has completed (never blocks)."""
        return self.done is None or self.done.query()

    def wait(self) -> PrefixState:
        """Block until the copy has completed; the state, safe to read."""
        if self.done is not None:
            self.done.synchronize()
        for t in self._kept:  # made on the side stream, read next on the caller's: not reused before
            t.record_stream(torch.cuda.current_stream(t.device))
        self.state.pending = None  # done: later reads need no wait (and the state no longer pins this)
        return self.state

    def copy_s(self) -> float | None:
        """Seconds on the GPU from the end of the compute the export waited for to the end of its
        copy, once the copy is done (None on CPU, or before). A reader's wait beyond it is P's step
        itself still computing: the server reports both (``export_s``, ``export_copy_s``)."""
        if self.done is None or self.started is None or not self.done.query():
            return None
        return self.started.elapsed_time(self.done) / 1e3

    def release(self) -> None:
        """The transfer is done: give the host buffers back (after the copy, should it still run)."""
        buffers, self._buffers = self._buffers, []
        if self.state.pending is not None:
            self.wait()
        for b in buffers:
            self._pool.release(b)


class ExportCopy:
    """One export being assembled: ``host`` / ``keep`` the tensors inside ``with copy:`` (the side
    stream, ordered after everything already enqueued on the compute stream), then ``finish``."""

    def __init__(self, exporter: PrefixExporter) -> None:
        self.exporter = exporter
        self.stream = exporter.stream
        self.buffers: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []
        self.started: torch.cuda.Event | None = None  # the compute stream at the copy's start (timed)

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.stream.device)
        if self.started is None:
            self.started = torch.cuda.Event(enable_timing=True)
        self.started.record(compute)
        self.stream.wait_event(self.started)  # after the step's compute
        with torch.cuda.stream(self.stream):
            yield

    def __enter__(self) -> ExportCopy:
        self._ctx = self._on_stream()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (into a pooled pinned buffer on CUDA, asynchronous)."""
        nbytes = t.numel() * t.element_size()
        buf = self.exporter.pool.acquire(nbytes)
        self.buffers.append(buf)
        out = buf[:nbytes].view(t.dtype).view(t.shape)
        if t.is_cuda and self.stream is not None:
            t.record_stream(self.stream)  # a tensor made on another stream: not reused before the copy ran
        out.copy_(t, non_blocking=t.is_cuda and self.stream is not None)
        return out

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` stays where it is (fp4: packed on the device when the transport serializes)."""
        if t.is_cuda and self.stream is not None:
            self.kept.append(t)
        return t

    def finish(self, state: PrefixState) -> PendingExport:
        done = self.exporter.completion()
        pending = PendingExport(state, done, self.buffers, self.exporter.pool, self.kept, self.started)
        if done is not None:
            state.pending = pending  # a consumer that reads the bytes without wait() waits all the same
        return pending


class PrefixExporter:
    """Owns the side stream and the pinned pool of one engine (``ModelRunner.exporter``)."""

    def __init__(self, device: torch.device | str, max_idle_bytes: int = 256 << 20, side_stream: bool = True) -> None:
        """``side_stream=False``: copy synchronously on the current stream, as on CPU."""
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and side_stream else None
        # the hand-off's own stream: packing the wire format and copying it to the host there waits
        # for nothing but that work (not the next step's compute, not the next export's copy), and
        # at high priority its small kernels go ahead of the pending blocks of the step in flight
        self.pack_stream = (
            torch.cuda.Stream(device, priority=HANDOFF_STREAM_PRIORITY) if self.stream is not None else None
        )
        self.pool = PinnedPool(max_idle_bytes, pin=self.stream is not None)

    def begin(self) -> ExportCopy:
        return ExportCopy(self)

    def completion(self) -> _Event | None:
        """What a copy's completion is read from: an event recorded on the side stream after its
        copies; None without a stream (the copy is done when it returns)."""
        if self.stream is None:
            return None
        done = torch.cuda.Event(enable_timing=True)  # timed against the copy's start (``copy_s``)
        done.record(self.stream)
        return done
