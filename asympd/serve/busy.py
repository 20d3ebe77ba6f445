"""How long a worker is busy, counting the GPU work its steps leave queued.

A step returns to the host once its kernels are queued. An engine that samples nothing (a prefill
worker) never waits for them, so its host step time leaves out the tail its GPU is still computing:
at true depth 50-100 ms after steps of 0.2-0.7 s, which is P's ``export_s`` under load
(docs/performance.md §10). A P/D comparison of prompt tokens per busy second built on host time
alone then flatters the worker that does not sample. ``BusyClock`` counts each step from its start
on the host to the later of its host end and its GPU end, and merges steps that overlap: the wall
time during which the worker had a step in flight on either side.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

ANCHOR_EVERY_S = 60.0  # re-read the GPU clock against the host's this often (drift is ppm)


class BusyClock:
    """Busy seconds of one engine, host and GPU together; single-threaded (the engine thread)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.total = 0.0
        self._covered = float("-inf")  # host-clock end of what is counted
        self._pending: deque[tuple[float, float, torch.cuda.Event, Callable[[float], None] | None]] = deque()
        dev = torch.device(device) if device is not None else None
        self._device = dev if dev is not None and dev.type == "cuda" else None
        self._t_ref = 0.0
        self._ref: torch.cuda.Event | None = None
        if self._device is not None:
            try:
                self._anchor()
            except RuntimeError as e:
                self._host_only(e)

    @property
    def pending(self) -> bool:
        """Steps whose GPU work has not been seen to end yet (poll again soon)."""
        return bool(self._pending)

    def step_done(self, start: float, end: float, on_end: Callable[[float], None] | None = None) -> None:
        """A step ran on the host from ``start`` to ``end`` (``time.perf_counter``); call it right
        after the step returns, on the thread that queued the step's kernels. ``on_end`` gets the
        step's seconds from its start to its host or GPU end, whichever is later, once known."""
        if self._device is not None:
            try:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(self._device))
            except RuntimeError as e:
                self._host_only(e)
            else:
                self._pending.append((start, end, ev, on_end))
                return
        self._done(start, end, on_end)

    def poll(self) -> float:
        """Count the steps whose GPU work has ended (never waits). Returns the busy seconds."""
        try:
            while self._pending and self._pending[0][2].query():
                start, end, ev, on_end = self._pending[0]
                gpu_end = self._t_ref + self._ref.elapsed_time(ev) / 1e3
                self._pending.popleft()
                self._done(start, max(end, gpu_end), on_end)
            if self._device is not None and not self._pending and time.perf_counter() - self._t_ref > ANCHOR_EVERY_S:
                self._anchor()
        except RuntimeError as e:
            self._host_only(e)
        return self.total

    def count(self, start: float, end: float) -> None:
        """Count the interval ``[start, end]`` (host clock), less what is counted already. Steps
        come in start order, so what overlaps is the tail of the ones before."""
        lo = max(start, self._covered)
        if end > lo:
            self.total += end - lo
        self._covered = max(self._covered, end)

    def _done(self, start: float, end: float, on_end: Callable[[float], None] | None) -> None:
        self.count(start, end)
        if on_end is not None:
            on_end(end - start)

    def _host_only(self, error: Exception) -> None:
        """A CUDA event failed: a metric must not stop serving. Count host times from here on
        (the steps in flight at their host ends) and say so once."""
        log.warning("busy clock: timing the GPU failed (%s); busy time counts host step times from here on", error)
        self._device = None
        while self._pending:
            start, end, _, on_end = self._pending.popleft()
            self._done(start, end, on_end)

    def _anchor(self) -> None:
        """Tie the GPU's event clock to the host's: an event on the compute stream, waited for (the
        stream has no step in flight then), read against ``perf_counter`` as it completes."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self._device))
        ev.synchronize()
        self._ref, self._t_ref = ev, time.perf_counter()
