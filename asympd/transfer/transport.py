"""Pick a data plane by name: the engine and servers only see the ``Transport`` interface."""

from __future__ import annotations

from typing import Any

from .base import Transport
from .nixl_transport import NixlTransport, nixl_available
from .tcp import TcpTransport

TRANSPORTS = ("nixl", "tcp", "auto")


def make_transport(name: str, fingerprint: str, **options: Any) -> Transport:
    """A transport for this worker. ``options`` go to the class (host, port, advertise_host,
    ttl_s, on_release, device: where D unpacks what it receives; NIXL also agent_name, backends).
    "auto" is NIXL where it imports, TCP elsewhere."""
    if name == "auto":
        name = "nixl" if nixl_available() else "tcp"
    if name == "nixl":
        return NixlTransport(fingerprint, **options)
    if name == "tcp":
        for key in ("agent_name", "backends", "poll_interval_s"):
            options.pop(key, None)  # NIXL-only knobs: the same options dict works for both
        return TcpTransport(fingerprint, **options)
    raise ValueError(f"unknown transport {name!r} (expected one of {', '.join(TRANSPORTS)})")
