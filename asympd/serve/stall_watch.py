"""What a slow engine step spent its time on, for the log line that reports it.

A serving engine should never stall mid-traffic; when one does, the first question is whether a
kernel was compiled (a Triton specialization seen for the first time costs seconds) or a CUDA graph
was captured, or the host paused in Python's garbage collector. Triton calls
``knobs.runtime.jit_post_compile_hook`` after every compile in the process (a hit in the on-disk
cache included); the watch records those kernels' names and times. The hook is process-wide, so the
watch chains the hook it found and restores it on ``close``. ``GCWatch`` times the collector's
pauses the same way (``gc.callbacks``).
"""

from __future__ import annotations

import gc
import threading
import time
from collections import Counter
from typing import Any

try:
    from triton import knobs as _knobs
except ImportError:  # the core runs without Triton
    _knobs = None


class CompileWatch:
    """Counts Triton compiles; ``since(mark)`` names those after a mark (``mark()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[float, str]] = []
        self._previous: Any = None
        self._installed = False
        if _knobs is not None:
            self._previous = _knobs.runtime.jit_post_compile_hook
            _knobs.runtime.jit_post_compile_hook = self._hook
            self._installed = True

    def _hook(self, *args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        with self._lock:
            self._events.append((time.perf_counter(), name))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def mark(self) -> int:
        with self._lock:
            return len(self._events)

    def since(self, mark: int) -> dict[str, int]:
        """Kernels compiled since ``mark``, by name."""
        with self._lock:
            return dict(Counter(name for _, name in self._events[mark:]))

    @property
    def total(self) -> int:
        with self._lock:
            return len(self._events)

    def close(self) -> None:
        if self._installed and _knobs.runtime.jit_post_compile_hook == self._hook:
            _knobs.runtime.jit_post_compile_hook = self._previous
        self._installed = False


class GCWatch:
    """Python's cyclic garbage collections and their pauses; ``since(mark)`` sums those after a
    mark. A collection of the oldest generation walks every tracked object (a true-depth model's
    modules, tensors and CUDA-graph pieces), during which the host launches nothing: a stall no
    kernel explains. Running totals, not a list of events: a serving process collects its youngest
    generation many times a second, for days. ``gc.callbacks`` is process-wide; ``close`` removes
    the watch's own."""

    def __init__(self) -> None:
        # (seconds paused, oldest-generation collections, all collections): replaced whole, one
        # collection at a time (the collector is never reentered), so readers need no lock, and a
        # lock taken inside a collection could deadlock a thread that held it when one began
        self._totals = (0.0, 0, 0)
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        s, gen2, n = self._totals
        self._totals = (s + time.perf_counter() - self._started, gen2 + (info["generation"] == 2), n + 1)

    def mark(self) -> tuple[float, int, int]:
        return self._totals

    def since(self, mark: tuple[float, int, int]) -> dict[str, float]:
        """``{"ms": pause, "gen2": oldest-generation collections, "all": collections}`` since ``mark``."""
        s, gen2, n = self._totals
        return {"ms": round(1e3 * (s - mark[0]), 3), "gen2": gen2 - mark[1], "all": n - mark[2]}

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def freeze_start_up_objects() -> int:
    """Move everything start-up made (the model, the caches, the CUDA graphs) out of the collector's
    reach, as vLLM does after its start-up: later collections walk only what serving allocates.
    Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
