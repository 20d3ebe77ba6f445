"""What every data plane shares: errors, the transport interface, and per-transfer metrics.

P publishes a PrefixState under a transfer id and gets back small JSON-able params, which travel
through the router as vLLM's ``kv_transfer_params``; D fetches with those params and acks, and
P releases the state (frees its cache blocks) on the ack or when the lease expires.
"""

from __future__ import annotations

import abc
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from .prefix_state import PrefixState


class TransferError(RuntimeError):
    """A transfer that failed: refused handshake, unknown transfer id, broken connection."""


class TransferTimeout(TransferError):
    """A transfer that did not finish within its timeout."""


def fingerprint_mismatch(local: str, remote: str, side: str) -> str:
    """The one message both sides use, naming both fingerprints."""
    return f"fingerprint mismatch ({side}): local {local!r} != peer {remote!r}; refusing to exchange prefix state"


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer, as /metrics reports it."""

    transport: str
    role: str  # "send" (P) or "recv" (D)
    transfer_id: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferMetrics:
    """Totals plus the last few transfers; thread-safe."""

    def __init__(self, keep: int = 256) -> None:
        self._lock = threading.Lock()
        self.recent: deque[TransferRecord] = deque(maxlen=keep)
        self.transfers = 0
        self.bytes = 0
        self.seconds = 0.0
        self.failures = 0

    def record(self, rec: TransferRecord) -> None:
        with self._lock:
            self.recent.append(rec)
            self.transfers += 1
            self.bytes += rec.nbytes
            self.seconds += rec.seconds

    def failed(self) -> None:
        with self._lock:
            self.failures += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "transfers": self.transfers,
                "bytes": self.bytes,
                "seconds": self.seconds,
                "failures": self.failures,
                "recent": [asdict(r) for r in self.recent],
            }


class Transport(abc.ABC):
    """A data plane for prefix states. One object per worker; P uses ``publish`` and D ``fetch``."""

    name: str = ""

    def __init__(self) -> None:
        self.metrics = TransferMetrics()

    @abc.abstractmethod
    def publish(self, transfer_id: str, state: PrefixState) -> dict[str, Any]:
        """P: hold ``state`` under ``transfer_id`` until acked or expired; return the params D needs."""

    @abc.abstractmethod
    def fetch(self, params: dict[str, Any], fingerprint: str, timeout: float = 30.0, ack: bool = True) -> PrefixState:
        """D: pull the state named by ``params``. With ``ack`` P may free it as soon as it is here."""

    @abc.abstractmethod
    def ack(self, params: dict[str, Any], fingerprint: str, timeout: float = 10.0) -> None:
        """D: tell P it may release the state (when ``fetch`` ran with ack=False)."""

    @abc.abstractmethod
    def release(self, transfer_id: str) -> bool:
        """P: drop a published state now (request aborted); True if it was still held."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving and release every state still held."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Deadline:
    """A wall-clock budget shared by the steps of one transfer."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"timed out after {self.timeout:.3g} s")
        return left
