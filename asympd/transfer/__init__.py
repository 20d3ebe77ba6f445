"""Moving a prefix state from the prefill worker P to the decode worker D (see prefix_state.py)."""

from .base import TransferError, TransferMetrics, TransferRecord, TransferTimeout, Transport
from .lease import LeaseTable
from .nixl_transport import NixlTransport, NixlUnavailable, nixl_available
from .prefix_state import FORMAT_VERSION, PrefixState, PrefixStateError, model_fingerprint
from .tcp import PrefixStateServer, TcpTransport, fetch
from .transport import make_transport

__all__ = [
    "FORMAT_VERSION",
    "LeaseTable",
    "NixlTransport",
    "NixlUnavailable",
    "PrefixState",
    "PrefixStateError",
    "PrefixStateServer",
    "TcpTransport",
    "TransferError",
    "TransferMetrics",
    "TransferRecord",
    "TransferTimeout",
    "Transport",
    "fetch",
    "make_transport",
    "model_fingerprint",
    "nixl_available",
]
