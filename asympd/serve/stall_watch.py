"""What a slow engine step spent its time on, for the log line that reports it.

A serving engine should never stall mid-traffic; when one does, the first question is whether a
kernel was compiled (a Triton specialization seen for the first time costs seconds) or a CUDA graph
was captured. Triton calls ``knobs.runtime.jit_post_compile_hook`` after every compile in the
process (a hit in the on-disk cache included); the watch records those kernels' names and times.
The hook is process-wide, so the watch chains the hook it found and restores it on ``close``.
"""

from __future__ import annotations

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
