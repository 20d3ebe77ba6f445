"""P's table of exported prefix states.

P must keep a state's cache blocks until D has them, but must not keep them forever if D never
comes (crashed, request cancelled). Each export is a lease: released when D acks or when it
expires, and the release callback (where P frees its blocks) runs exactly once either way. A lease
that is being read (``hold``) does not expire under the reader (a later reaper pass expires it if
D still has not acked); an ack during a read takes effect when the read ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ReleaseFn = Callable[[str, Any, str], None]  # (transfer_id, value, reason: "ack" | "expired" | "closed" | "released")


@dataclass
class _Lease:
    value: Any
    deadline: float
    on_release: ReleaseFn | None
    holders: int = 0
    pending: str | None = None  # a release reason waiting for the last holder


class LeaseTable:
    """Thread-safe transfer id -> exported value, with expiry and exactly-once release."""

    def __init__(
        self,
        ttl_s: float = 60.0,
        on_release: ReleaseFn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.on_release = on_release
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self.released = {"ack": 0, "expired": 0, "closed": 0, "released": 0}

    def add(
        self, transfer_id: str, value: Any, ttl_s: float | None = None, on_release: ReleaseFn | None = None
    ) -> None:
        """Export ``value``; ``on_release`` overrides the table's callback for this lease."""
        with self._lock:
            if transfer_id in self._leases:
                raise ValueError(f"transfer id {transfer_id!r} is already leased")
            ttl = self.ttl_s if ttl_s is None else ttl_s
            self._leases[transfer_id] = _Lease(value, self.clock() + ttl, on_release)

    def get(self, transfer_id: str) -> Any | None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            return None if lease is None or lease.pending else lease.value

    @contextlib.contextmanager
    def hold(self, transfer_id: str) -> Iterator[Any | None]:
        """Use a leased value without it being released underneath; yields None if not leased."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.pending:
                lease = None
            else:
                lease.holders += 1
        try:
            yield None if lease is None else lease.value
        finally:
            if lease is not None:
                with self._lock:
                    lease.holders -= 1
                    done = lease.holders == 0 and lease.pending is not None
                    if done:
                        self._leases.pop(transfer_id, None)
                if done:
                    self._call(transfer_id, lease, lease.pending)

    def ack(self, transfer_id: str) -> bool:
        """D has the state: release it. False if it was not held (unknown, already released)."""
        return self._release(transfer_id, "ack")

    def release(self, transfer_id: str) -> bool:
        """P drops it itself (request aborted)."""
        return self._release(transfer_id, "released")

    def expire(self, now: float | None = None) -> list[str]:
        """Release every lease past its deadline at ``now``; returns their ids."""
        now = self.clock() if now is None else now
        with self._lock:
            ids = [
                tid
                for tid, lease in self._leases.items()
                if lease.deadline <= now and not lease.pending and not lease.holders
            ]
        return [tid for tid in ids if self._release(tid, "expired", skip_held=True)]

    def close(self) -> None:
        """Stop the reaper and release everything still held."""
        self.stop_reaper()
        with self._lock:
            ids = list(self._leases)
        for tid in ids:
            self._release(tid, "closed")

    def _release(self, transfer_id: str, reason: str, skip_held: bool = False) -> bool:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.pending or (skip_held and lease.holders):
                return False
            if lease.holders:
                lease.pending = reason  # the last holder releases it
                return True
            del self._leases[transfer_id]
        self._call(transfer_id, lease, reason)
        return True

    def _call(self, transfer_id: str, lease: _Lease, reason: str) -> None:
        with self._lock:
            self.released[reason] += 1
        fn = lease.on_release or self.on_release
        if fn is None:
            return
        try:
            fn(transfer_id, lease.value, reason)
        except Exception:  # a failing callback must not kill the reaper or the server thread
            log.exception("release callback for transfer %s (%s) failed", transfer_id, reason)

    # ---- background reaper -----------------------------------------------------------------------

    def start_reaper(self, interval_s: float = 1.0) -> None:
        """Call ``expire`` every ``interval_s`` seconds in a daemon thread."""
        if self._reaper is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.expire()

        self._reaper = threading.Thread(target=loop, name="lease-reaper", daemon=True)
        self._reaper.start()

    def stop_reaper(self) -> None:
        if self._reaper is not None:
            self._stop.set()
            self._reaper.join()
            self._reaper = None

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if not lease.pending)

    def __contains__(self, transfer_id: object) -> bool:
        return self.get(transfer_id) is not None  # type: ignore[arg-type]
