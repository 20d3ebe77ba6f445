"""Plain TCP data plane: the fallback when NIXL is not there, and the control channel for NIXL.

Protocol (one TCP connection per fetch, client = D, server = P). Every control message is a
4-byte big-endian length followed by UTF-8 JSON, at most 1 MiB:

    D -> P  {"op": "hello", "version": 1, "fingerprint": fp_D}
    P -> D  {"ok": true, "fingerprint": fp_P}          or {"ok": false, "error": ..., "fingerprint": fp_P}
    D -> P  {"op": "get", "transfer_id": id}
    P -> D  {"ok": true, "header_nbytes": h, "stream_nbytes": n}   then h header bytes, then the
            buffers' bytes back to back in header-table order (n bytes, no padding)
    D -> P  {"op": "ack", "transfer_id": id}
    P -> D  {"ok": true, "released": bool}

A streamed prefix (transfer/stream.py) is read slice by slice on one connection, each ``get_slice``
answered as soon as P has pushed that slice (or refused after ``wait_s``):

    D -> P  {"op": "get_slice", "transfer_id": id, "index": i, "wait_s": t}
    P -> D  {"ok": true, "header_nbytes": h, "stream_nbytes": n, "last": bool}   then as for get

A fingerprint or protocol mismatch ends the connection after P's refusal, and both sides raise or
log a TransferError naming both fingerprints: exchanging state between different models or
numeric formats would silently corrupt D's cache.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .base import Deadline, TransferError, TransferMetrics, TransferRecord, TransferTimeout, Transport
from .base import fingerprint_mismatch as _mismatch
from .lease import LeaseTable, ReleaseFn
from .prefix_state import DTYPES, HANDOFF_STREAM_PRIORITY, PrefixState, PrefixStateError, parse_header, tensor_bytes
from .seal import check_op, op_tag
from .stream import SliceFeed

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_LEN = struct.Struct(">I")
MAX_MESSAGE = 1 << 20
_CHUNK = 4 << 20

# ---- framing ---------------------------------------------------------------------------------------


def _arm(sock: socket.socket, deadline: Deadline | None) -> None:
    """Give the next socket call what is left of the deadline (None: keep the socket's timeout)."""
    if deadline is not None:
        sock.settimeout(deadline.left())


def send_msg(sock: socket.socket, msg: dict[str, Any], deadline: Deadline | None = None) -> None:
    """Send one length-prefixed JSON control message."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise TransferError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    _arm(sock, deadline)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int, deadline: Deadline | None = None) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview, deadline: Deadline | None = None) -> None:
    """Fill ``view`` from the socket; EOF before it is full is a TransferError."""
    view = view.cast("B")
    pos = 0
    while pos < len(view):
        _arm(sock, deadline)
        got = sock.recv_into(view[pos : pos + _CHUNK])
        if got == 0:
            raise TransferError(f"connection closed by peer after {pos} of {len(view)} bytes")
        pos += got


def recv_msg(sock: socket.socket, deadline: Deadline | None = None) -> dict[str, Any]:
    """Receive one control message (a dict)."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if n > MAX_MESSAGE:
        raise TransferError(f"control message of {n} bytes exceeds {MAX_MESSAGE}: not an asympd peer?")
    try:
        msg = json.loads(recv_exact(sock, n, deadline))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TransferError(f"malformed control message: {e}") from None
    if not isinstance(msg, dict):
        raise TransferError(f"malformed control message: {type(msg).__name__}, expected an object")
    return msg


# ---- server side (P) -------------------------------------------------------------------------------

Handler = Callable[[socket.socket, dict[str, Any]], None]


class ControlServer:
    """A threaded TCP server that handshakes each connection (protocol version + fingerprint) and
    then dispatches ``{"op": ...}`` messages to handlers. Runs in background daemon threads."""

    def __init__(
        self,
        host: str,
        port: int,
        fingerprint: str,
        handlers: dict[str, Handler],
        idle_timeout: float = 60.0,
        name: str = "asympd-transfer",
        secret: bytes | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.secret = secret  # when set, every op must carry its tag (seal.op_tag)
        self.handlers = handlers
        self.idle_timeout = idle_timeout
        self.refusals: list[str] = []  # handshake refusals, newest last (for logs/tests/metrics)
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = "?"
        try:
            host, port = conn.getpeername()[:2]
            peer = f"{host}:{port}"
            conn.settimeout(self.idle_timeout)
            if not self._handshake(conn, peer):
                return
            while True:
                try:
                    msg = recv_msg(conn)
                except TransferError:
                    return  # peer closed
                handler = self.handlers.get(str(msg.get("op")))
                if handler is None:
                    send_msg(conn, {"ok": False, "error": f"unknown op {msg.get('op')!r}"})
                    continue
                refused = check_op(self.secret, msg)
                if refused is not None:
                    log.warning("refused transfer peer %s: %s", peer, refused)
                    with self._lock:
                        self.refusals.append(refused)
                    send_msg(conn, {"ok": False, "error": refused})
                    continue
                handler(conn, msg)
        except (OSError, TransferError) as e:
            if not self._closed.is_set():
                log.warning("transfer connection from %s failed: %s", peer, e)
        except Exception:
            log.exception("transfer connection from %s: handler failed", peer)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, peer: str) -> bool:
        hello = recv_msg(conn)
        theirs = str(hello.get("fingerprint"))
        error = None
        if hello.get("op") != "hello":
            error = f"expected hello, got op {hello.get('op')!r}"
        elif hello.get("version") != PROTOCOL_VERSION:
            error = f"protocol version mismatch: local {PROTOCOL_VERSION} != peer {hello.get('version')!r}"
        elif theirs != self.fingerprint:
            error = _mismatch(self.fingerprint, theirs, "server")
        if error is None:
            send_msg(conn, {"ok": True, "fingerprint": self.fingerprint, "version": PROTOCOL_VERSION})
            return True
        log.warning("refused transfer peer %s: %s", peer, error)
        with self._lock:
            self.refusals.append(error)
        send_msg(conn, {"ok": False, "error": error, "fingerprint": self.fingerprint, "version": PROTOCOL_VERSION})
        return False

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)


class PrefixStateServer(ControlServer):
    """P's TCP server: serves registered states by transfer id; each is a lease released on D's ack
    or on expiry (then ``on_release`` runs once, where P frees the cache blocks)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        fingerprint: str = "",
        ttl_s: float = 60.0,
        on_release: ReleaseFn | None = None,
        metrics: TransferMetrics | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.leases = LeaseTable(ttl_s=ttl_s, on_release=on_release)
        self.leases.start_reaper(interval_s=min(1.0, ttl_s / 4))
        self.metrics = metrics or TransferMetrics()
        handlers = {"get": self._get, "ack": self._ack, "get_slice": self._get_slice}
        super().__init__(host, port, fingerprint, handlers, name="asympd-tcp", secret=secret)

    def register(self, transfer_id: str, state: PrefixState, ttl_s: float | None = None) -> None:
        if state.fingerprint != self.fingerprint:
            raise TransferError(_mismatch(self.fingerprint, state.fingerprint, "state registered on server"))
        self.leases.add(transfer_id, state, ttl_s=ttl_s)

    def _get(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        tid = str(msg.get("transfer_id"))
        with self.leases.hold(tid) as state:
            if state is None:
                error = f"unknown transfer id {tid!r} (never published, or already acked or expired)"
                send_msg(conn, {"ok": False, "error": error})
                return
            if isinstance(state, SliceFeed):
                send_msg(conn, {"ok": False, "error": f"transfer {tid!r} is streamed: read it with get_slice"})
                return
            self._send_state(conn, tid, state, {})

    def _send_state(self, conn: socket.socket, tid: str, state: PrefixState, extra: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            header, buffers = state.to_buffers(host=True)
        except PrefixStateError as e:  # e.g. values that cannot be packed: say so, keep the connection
            send_msg(conn, {"ok": False, "error": f"transfer {tid!r} cannot be sent: {e}"})
            return
        stream = sum(b.numel() * b.element_size() for b in buffers)
        send_msg(conn, {"ok": True, "header_nbytes": len(header), "stream_nbytes": stream, **extra})
        conn.sendall(header)
        for b in buffers:
            if b.numel():
                conn.sendall(memoryview(tensor_bytes(b)))
        self.metrics.record(TransferRecord("tcp", "send", tid, stream, time.perf_counter() - t0))

    def _get_slice(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        tid, index, wait_s = str(msg.get("transfer_id")), msg.get("index"), msg.get("wait_s", 30.0)
        if not isinstance(index, int) or index < 0 or not isinstance(wait_s, (int, float)):
            send_msg(conn, {"ok": False, "error": f"bad get_slice: index {index!r}, wait_s {wait_s!r}"})
            return
        with self.leases.hold(tid) as feed:
            if not isinstance(feed, SliceFeed):
                error = f"unknown streamed transfer id {tid!r} (never opened, already acked or expired)"
                send_msg(conn, {"ok": False, "error": error})
                return
            got = feed.wait(index, min(max(float(wait_s), 0.0), self.leases.ttl_s))
            if got is None:
                why = (
                    "the prefill worker dropped the stream (its request ended)"
                    if feed.dropped
                    else "the stream ended before it"
                    if feed.done
                    else f"not pushed within {wait_s:.3g} s"
                )
                send_msg(conn, {"ok": False, "error": f"slice {index} of {tid!r}: {why}"})
                return
            piece, last, tag = got
            self._send_state(conn, tid, piece, {"last": last, **({"state_mac": tag} if tag else {})})

    def _ack(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        send_msg(conn, {"ok": True, "released": self.leases.ack(str(msg.get("transfer_id")))})

    def release(self, transfer_id: str) -> bool:
        """P drops a state (its request was aborted). A streamed one may have a reader waiting for
        its next slice (a D pulling it, holding the lease): it is told at once; without this it
        waited out the slice timeout (120 s), holding a fetch thread on D and a server thread here."""
        feed = self.leases.get(transfer_id)
        released = self.leases.release(transfer_id)
        if released and isinstance(feed, SliceFeed):
            feed.drop()
        return released

    def close(self) -> None:
        super().close()
        self.leases.close()


# ---- client side (D) -------------------------------------------------------------------------------


def connect(host: str, port: int, fingerprint: str, deadline: Deadline) -> socket.socket:
    """Open a control connection and handshake; raises TransferError on refusal."""
    try:
        sock = socket.create_connection((host, port), timeout=deadline.left())
    except TimeoutError:
        raise TransferTimeout(f"connecting to {host}:{port} timed out after {deadline.timeout:.3g} s") from None
    except OSError as e:
        raise TransferError(f"cannot connect to prefill worker at {host}:{port}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        send_msg(sock, {"op": "hello", "version": PROTOCOL_VERSION, "fingerprint": fingerprint}, deadline)
        reply = recv_msg(sock, deadline)
        if not reply.get("ok"):
            theirs = str(reply.get("fingerprint"))
            if theirs != fingerprint:
                raise TransferError(_mismatch(fingerprint, theirs, "client"))
            raise TransferError(f"prefill worker at {host}:{port} refused: {reply.get('error')}")
    except BaseException:
        sock.close()
        raise
    return sock


def request(
    sock: socket.socket, msg: dict[str, Any], deadline: Deadline, where: str, secret: bytes | None = None
) -> dict[str, Any]:
    """One request/reply (tagged with ``secret`` when given); a refusal becomes a TransferError
    naming ``where``."""
    if secret is not None:
        msg = {**msg, "auth": op_tag(secret, str(msg["op"]), str(msg.get("transfer_id")))}
    send_msg(sock, msg, deadline)
    reply = recv_msg(sock, deadline)
    if not reply.get("ok"):
        raise TransferError(f"prefill worker at {where}: {reply.get('error')}")
    return reply


def guarded(fn: Callable[[], Any], deadline: Deadline, where: str) -> Any:
    """Map socket failures to TransferTimeout / TransferError."""
    try:
        return fn()
    except TransferError:
        raise
    except TimeoutError:
        raise TransferTimeout(f"transfer from {where} timed out after {deadline.timeout:.3g} s") from None
    except OSError as e:
        raise TransferError(f"transfer from {where} failed: {e}") from None


def fetch(
    host: str,
    port: int,
    transfer_id: str,
    fingerprint: str,
    timeout: float = 30.0,
    ack: bool = True,
    metrics: TransferMetrics | None = None,
    secret: bytes | None = None,
    *,
    unpack_on: UnpackOn | None = None,
) -> PrefixState:
    """D: pull a prefix state from P's server into fresh CPU tensors (bit-exact; ``unpack_on``: its
    packed KV unpacked there, ``unpack_received``). With ``ack``, P may release it as soon as it is
    here. The caller still runs ``state.validate``."""
    deadline = Deadline(timeout)
    where = f"{host}:{port}"

    def run() -> PrefixState:
        t0 = time.perf_counter()
        sock = connect(host, port, fingerprint, deadline)
        with sock:
            reply = request(sock, {"op": "get", "transfer_id": transfer_id}, deadline, where, secret)
            state, stream = _recv_state(sock, reply, deadline, unpack_on)
            if ack:
                request(sock, {"op": "ack", "transfer_id": transfer_id}, deadline, where, secret)
        if metrics is not None:
            metrics.record(TransferRecord("tcp", "recv", transfer_id, stream, time.perf_counter() - t0))
        return state

    try:
        return guarded(run, deadline, where)
    except TransferError:
        if metrics is not None:
            metrics.failed()
        raise


def _recv_state(
    sock: socket.socket, reply: dict[str, Any], deadline: Deadline, unpack_on: UnpackOn | None = None
) -> tuple[PrefixState, int]:
    """The header and buffers that follow a positive get/get_slice reply: (state, payload bytes);
    ``unpack_on``: where the packed KV is unpacked (``unpack_received``)."""
    raw = recv_exact(sock, int(reply["header_nbytes"]), deadline)
    header = parse_header(raw)
    buffers = [torch.empty(e["shape"], dtype=DTYPES[e["dtype"]]) for e in header["buffers"]]
    stream = sum(b.numel() * b.element_size() for b in buffers)
    if stream != reply["stream_nbytes"]:
        raise TransferError(f"P announced {reply['stream_nbytes']} bytes but its header describes {stream}")
    t0 = time.perf_counter()
    for b in buffers:
        if b.numel():
            recv_into(sock, memoryview(tensor_bytes(b)), deadline)
    t1 = time.perf_counter()
    state = unpack_received(header, buffers, unpack_on)
    state.arrived = (bytes(raw), buffers)  # what the tag is checked over (seal.verify)
    state.receipt = {"arrive_s": t1 - t0, "unpack_s": time.perf_counter() - t1}
    return state, stream


class UnpackOn:
    """Where a receiver unpacks the packed KV it gets: its engine's device, and on a GPU one stream of
    the receiver's own (not the engine's, whose queued step it would wait for; one, so the caching
    allocator keeps one pool for these buffers, not one per stream of torch's pool)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    @functools.cached_property
    def stream(self) -> torch.cuda.Stream | None:
        """Made on the first receipt: a publisher (P) never needs one. High priority: the GPU
        schedules its few small kernels ahead of the pending blocks of the steps in flight."""
        return torch.cuda.Stream(self.device, priority=HANDOFF_STREAM_PRIORITY) if self.device.type == "cuda" else None


def unpack_received(
    header: bytes | dict[str, Any], buffers: list[torch.Tensor], unpack_on: UnpackOn | None = None
) -> PrefixState:
    """A received state, its packed KV unpacked where ``unpack_on`` says (None: the host). On a GPU
    the values are complete on return, and held for the engine's stream (``record_stream``) until
    it is done with them."""
    if unpack_on is None or unpack_on.stream is None:
        return PrefixState.from_buffers(header, buffers, unpack_on.device if unpack_on else None)
    dev, stream = unpack_on.device, unpack_on.stream
    with torch.cuda.stream(stream):
        state = PrefixState.from_buffers(header, buffers, dev)
    stream.synchronize()
    engine = torch.cuda.default_stream(dev)
    for t in (*state.ckv.values(), *state.idx.values()):
        if t.is_cuda:
            t.record_stream(engine)
    return state


def fetch_stream(
    host: str,
    port: int,
    transfer_id: str,
    fingerprint: str,
    timeout: float = 30.0,
    ack: bool = True,
    metrics: TransferMetrics | None = None,
    secret: bytes | None = None,
    with_tags: bool = False,
    *,
    unpack_on: UnpackOn | None = None,
) -> Iterator[PrefixState] | Iterator[tuple[PrefixState, str | None]]:
    """D: the slices of a streamed prefix, each as soon as P has pushed it (``timeout``: the most to
    wait for any one slice), over one connection; acked after the last. The caller checks them
    (engine.LLMEngine.import_slice); ``with_tags``: (slice, the tag P sealed it with) pairs."""
    where = f"{host}:{port}"
    deadline = Deadline(timeout)
    sock = guarded(lambda: connect(host, port, fingerprint, deadline), deadline, where)
    with sock:
        index, last = 0, False
        while not last:
            deadline = Deadline(timeout + 5.0)  # P refuses after wait_s: its answer comes first
            t0 = time.perf_counter()
            msg = {"op": "get_slice", "transfer_id": transfer_id, "index": index, "wait_s": timeout}
            try:
                reply = guarded(lambda m=msg, d=deadline: request(sock, m, d, where, secret), deadline, where)
                piece, nbytes = guarded(lambda r=reply, d=deadline: _recv_state(sock, r, d, unpack_on), deadline, where)
            except TransferError:
                if metrics is not None:
                    metrics.failed()
                raise
            if metrics is not None:
                metrics.record(TransferRecord("tcp", "recv", transfer_id, nbytes, time.perf_counter() - t0))
            last = bool(reply.get("last"))
            index += 1
            yield (piece, reply.get("state_mac")) if with_tags else piece
        if ack:
            guarded(
                lambda: request(sock, {"op": "ack", "transfer_id": transfer_id}, deadline, where, secret),
                deadline,
                where,
            )


def send_ack(
    host: str, port: int, transfer_id: str, fingerprint: str, timeout: float = 10.0, secret: bytes | None = None
) -> bool:
    """D: release a state on P over the control channel; True if P still held it."""
    deadline = Deadline(timeout)
    where = f"{host}:{port}"

    def run() -> bool:
        with connect(host, port, fingerprint, deadline) as sock:
            reply = request(sock, {"op": "ack", "transfer_id": transfer_id}, deadline, where, secret)
            return bool(reply["released"])

    return guarded(run, deadline, where)


# ---- the Transport -----------------------------------------------------------------------------------


class TcpTransport(Transport):
    """Transport over plain TCP. P's server starts on the first ``publish``."""

    name = "tcp"

    def __init__(
        self,
        fingerprint: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        ttl_s: float = 60.0,
        on_release: ReleaseFn | None = None,
        secret: bytes | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """``device``: where D unpacks the packed KV it receives (its engine's device)."""
        super().__init__()
        self.fingerprint = fingerprint
        self.secret = secret
        self.device = device
        self.unpack_on = UnpackOn(device)
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.ttl_s = ttl_s
        self.on_release = on_release
        self.server: PrefixStateServer | None = None
        self._lock = threading.Lock()

    def _server(self) -> PrefixStateServer:
        with self._lock:
            if self.server is None:
                self.server = PrefixStateServer(
                    self.host, self.port, self.fingerprint, self.ttl_s, self.on_release, self.metrics, self.secret
                )
            return self.server

    def publish(self, transfer_id: str, state: PrefixState) -> dict[str, Any]:
        server = self._server()
        server.register(transfer_id, state)
        return {
            "transport": self.name,
            "host": self.advertise_host,
            "port": server.port,
            "transfer_id": transfer_id,
            "nbytes": state.nbytes,
        }

    def open_stream(self, transfer_id: str) -> dict[str, Any]:
        """P: a streamed prefix under ``transfer_id``; push its slices with ``push`` as they are ready.
        The params D needs come back at once, before any slice exists."""
        server = self._server()
        server.leases.add(transfer_id, SliceFeed(self.fingerprint))
        return {
            "transport": self.name,
            "host": self.advertise_host,
            "port": server.port,
            "transfer_id": transfer_id,
            "stream": True,
        }

    def push(self, transfer_id: str, piece: PrefixState, last: bool = False, tag: str | None = None) -> None:
        """P: the next slice of a stream opened with ``open_stream`` (``tag``: its seal, sent with it)."""
        feed = self.server.leases.get(transfer_id) if self.server is not None else None
        if not isinstance(feed, SliceFeed):
            raise TransferError(f"no open stream {transfer_id!r} (never opened, acked or expired)")
        feed.push(piece, last, tag)

    def fetch_stream(
        self,
        params: dict[str, Any],
        fingerprint: str,
        timeout: float = 30.0,
        ack: bool = True,
        with_tags: bool = False,
    ) -> Iterator[PrefixState] | Iterator[tuple[PrefixState, str | None]]:
        """D: the slices of a stream as P pushes them (see ``fetch_stream``)."""
        check_params(params, self.name)
        host, port, tid = params["host"], params["port"], params["transfer_id"]
        return fetch_stream(
            host, port, tid, fingerprint, timeout, ack, self.metrics, self.secret, with_tags, unpack_on=self.unpack_on
        )

    def fetch(self, params: dict[str, Any], fingerprint: str, timeout: float = 30.0, ack: bool = True) -> PrefixState:
        check_params(params, self.name)
        host, port, tid = params["host"], params["port"], params["transfer_id"]
        return fetch(host, port, tid, fingerprint, timeout, ack, self.metrics, self.secret, unpack_on=self.unpack_on)

    def ack(self, params: dict[str, Any], fingerprint: str, timeout: float = 10.0) -> None:
        check_params(params, self.name)
        send_ack(params["host"], params["port"], params["transfer_id"], fingerprint, timeout, self.secret)

    def release(self, transfer_id: str) -> bool:
        return self.server is not None and self.server.release(transfer_id)

    def close(self) -> None:
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None


def check_params(params: dict[str, Any], transport: str) -> None:
    missing = [k for k in ("host", "port", "transfer_id") if k not in params]
    if missing:
        raise TransferError(f"kv_transfer_params lack {', '.join(missing)}")
    if params.get("transport", transport) != transport:
        raise TransferError(f"kv_transfer_params are for transport {params['transport']!r}, not {transport!r}")
