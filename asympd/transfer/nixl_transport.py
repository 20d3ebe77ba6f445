"""NIXL data plane (UCX backend): D RDMA-reads the prefix state straight out of P's memory.

Host memory (DRAM) on CPU workers, device memory (VRAM) on GPU workers, whichever the tensors are.
The wheel ``nixl-cu12`` installs the module ``nixl_cu12`` (``import nixl`` only works where the
``nixl`` meta-package is installed), so the module is looked up under each name.

Flow, per transfer (control messages are small JSON over the TCP control channel of ``tcp.py``,
with the same handshake: protocol version + model fingerprint, refused on mismatch):

  P  publish: ``register_memory`` the state's buffers; keep them leased; hand out
     {host, port, transfer_id, agent_name}.
  D  -> P ``{"op": "nixl_get", transfer_id}``; P -> D the JSON header, P's partial agent metadata
     (these registrations + connection info, base64) and one (addr, len, dev) descriptor per
     non-empty buffer.
  D  ``add_remote_agent``; allocates receive tensors from the header; ``register_memory``s them;
     ``prep_xfer_dlist`` both sides; ``make_prepped_xfer("READ", ..., notif_msg=ack)``;
     ``transfer``; polls ``check_xfer_state`` until DONE; releases handles, deregisters.
  P  a poller thread sees the ack notification (``get_new_notifs``) and releases the lease:
     deregisters the buffers and runs ``on_release`` (frees its cache blocks). An unacked lease
     expires. D can also ack over the control channel (``ack``).
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .base import Deadline, TransferError, TransferRecord, TransferTimeout, Transport
from .base import fingerprint_mismatch as _mismatch
from .lease import LeaseTable, ReleaseFn
from .prefix_state import DTYPES, PrefixState, parse_header
from .seal import op_tag
from .tcp import ControlServer, check_params, connect, guarded, request, send_msg

log = logging.getLogger(__name__)

NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")  # meta-package first, then the CUDA-suffixed wheels
ACK_PREFIX = b"asympd-ack:"
_nixl: ModuleType | None = None
_nixl_error: str | None = None


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _load() -> ModuleType | None:
    global _nixl, _nixl_error
    if _nixl is not None or _nixl_error is not None:
        return _nixl
    errors = []
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken native library
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
            _nixl = mod
            return mod
        errors.append(f"{name}: has no nixl_agent")
    _nixl_error = "; ".join(errors)
    return None


def nixl_available() -> bool:
    """True if a NIXL Python module imports here (it may still lack a working UCX plugin)."""
    return _load() is not None


def nixl_module_name() -> str | None:
    mod = _load()
    return None if mod is None else mod.__name__


class NixlUnavailable(TransferError):
    """NIXL was asked for but cannot be used in this environment."""


def _require() -> ModuleType:
    mod = _load()
    if mod is None:
        raise NixlUnavailable(
            f"NIXL is not available ({_nixl_error}); install nixl-cu12 (pip install 'asympd[nixl]') "
            "or use the 'tcp' transport"
        )
    return mod


def _mem(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


def _descs(tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size(), _mem(t)[1]) for t in tensors]


@dataclass
class _Export:
    """A published state and what NIXL needs to serve it."""

    state: PrefixState
    header: bytes
    buffers: list[torch.Tensor]  # kept alive: NIXL holds raw pointers into them
    indices: list[int]  # which buffers are non-empty (registered)
    mem_type: str
    reg: Any  # nixlRegDList, or None when there is nothing to register
    metadata: bytes
    served_at: float = 0.0


class NixlTransport(Transport):
    """Transport over NIXL; a worker creates one agent. P's control server and notification poller
    start on the first ``publish``; D receives into tensors on ``device``."""

    name = "nixl"

    def __init__(
        self,
        fingerprint: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        ttl_s: float = 60.0,
        on_release: ReleaseFn | None = None,
        device: torch.device | str = "cpu",
        agent_name: str | None = None,
        backends: tuple[str, ...] = ("UCX",),
        poll_interval_s: float = 0.002,
        progress_thread: bool = False,
        secret: bytes | None = None,
    ) -> None:
        super().__init__()
        nixl = _require()
        self.fingerprint = fingerprint
        self.secret = secret
        if is_loopback(host):
            # UCX's own listeners bind every network interface unless told otherwise; a worker bound
            # to loopback keeps its data plane there too (shared memory / CUDA IPC are unaffected)
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.ttl_s = ttl_s
        self.on_release = on_release
        self.device = torch.device(device)
        self.backends = list(backends)
        self.poll_interval_s = poll_interval_s
        self.agent_name = agent_name or f"asympd-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # No progress thread by default: NIXL's busy-polls a core even when idle (measured: 2 s of
        # CPU in 3 s for a bare agent), which on a small CPU host slows decode several-fold. Progress
        # is driven instead by the reader polling check_xfer_state and P's notification poller.
        config = nixl.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=self.backends,
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,  # server, poller and fetches share it
        )
        try:
            self.agent = nixl.nixl_agent(self.agent_name, config)
        except Exception as e:
            raise NixlUnavailable(f"cannot create a NIXL agent: {e}") from e
        missing = [b for b in self.backends if b not in self.agent.backends]
        if missing:
            raise NixlUnavailable(
                f"NIXL backend(s) {missing} failed to start (plugins: {self.agent.get_plugin_list()})"
            )
        self.server: ControlServer | None = None
        self.leases: LeaseTable | None = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # ---- P side --------------------------------------------------------------------------------------

    def _start_server(self) -> ControlServer:
        with self._lock:
            if self.server is None:
                self.leases = LeaseTable(ttl_s=self.ttl_s, on_release=self._released)
                self.leases.start_reaper(interval_s=min(1.0, self.ttl_s / 4))
                handlers = {"nixl_get": self._serve_get, "ack": self._serve_ack}
                self.server = ControlServer(
                    self.host, self.port, self.fingerprint, handlers, name="asympd-nixl", secret=self.secret
                )
                self._poller = threading.Thread(target=self._poll_notifs, name="asympd-nixl-notifs", daemon=True)
                self._poller.start()
            return self.server

    def publish(self, transfer_id: str, state: PrefixState) -> dict[str, Any]:
        if state.fingerprint != self.fingerprint:
            raise TransferError(_mismatch(self.fingerprint, state.fingerprint, "state published on server"))
        server = self._start_server()
        header, buffers = state.to_buffers()
        # one descriptor list has one memory type: follow the cache (token ids may sit on the host)
        device = next((b.device for b in buffers if b.is_cuda), torch.device("cpu"))
        buffers = [b.to(device) for b in buffers]
        indices = [i for i, b in enumerate(buffers) if b.numel()]
        registered = [buffers[i] for i in indices]
        reg, metadata = None, b""
        if registered:
            reg = self.agent.register_memory(registered, backends=self.backends)
            metadata = self.agent.get_partial_agent_metadata(reg, True, self.backends)
        mem_type = _mem(buffers[0])[0] if buffers else "DRAM"
        export = _Export(state, header, buffers, indices, mem_type, reg, metadata)
        try:
            assert self.leases is not None
            self.leases.add(transfer_id, export)
        except BaseException:
            if reg is not None:
                self.agent.deregister_memory(reg, backends=self.backends)
            raise
        return {
            "transport": self.name,
            "host": self.advertise_host,
            "port": server.port,
            "transfer_id": transfer_id,
            "agent_name": self.agent_name,
            "nbytes": state.nbytes,
        }

    def _serve_get(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        assert self.leases is not None
        tid = str(msg.get("transfer_id"))
        with self.leases.hold(tid) as export:
            if export is None:
                error = f"unknown transfer id {tid!r} (never published, or already acked or expired)"
                send_msg(conn, {"ok": False, "error": error})
                return
            export.served_at = time.perf_counter()
            send_msg(
                conn,
                {
                    "ok": True,
                    "header": export.header.decode(),
                    "agent_name": self.agent_name,
                    "agent_metadata": base64.b64encode(export.metadata).decode(),
                    "mem_type": export.mem_type,
                    "indices": export.indices,
                    "descs": [list(d) for d in _descs([export.buffers[i] for i in export.indices])],
                },
            )

    def _serve_ack(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        assert self.leases is not None
        send_msg(conn, {"ok": True, "released": self.leases.ack(str(msg.get("transfer_id")))})

    def _poll_notifs(self) -> None:
        """D's READ carries an ack notification; releasing on it is what frees P's blocks early."""
        while not self._stop.wait(self.poll_interval_s):
            try:
                notifs = self.agent.get_new_notifs()
            except Exception:
                log.exception("NIXL notification poll failed")
                continue
            for messages in notifs.values():
                for m in messages:
                    if m.startswith(ACK_PREFIX) and self.leases is not None:
                        tid, _, tag = m[len(ACK_PREFIX) :].decode(errors="replace").partition(":")
                        if self.secret is None or tag == op_tag(self.secret, "ack", tid):
                            self.leases.ack(tid)

    def _released(self, transfer_id: str, export: _Export, reason: str) -> None:
        if export.reg is not None:
            try:
                self.agent.deregister_memory(export.reg, backends=self.backends)
            except Exception:
                log.exception("deregistering transfer %s failed", transfer_id)
        if reason == "ack" and export.served_at:
            nbytes = sum(export.buffers[i].numel() * export.buffers[i].element_size() for i in export.indices)
            self.metrics.record(
                TransferRecord(self.name, "send", transfer_id, nbytes, time.perf_counter() - export.served_at)
            )
        if self.on_release is not None:
            self.on_release(transfer_id, export.state, reason)

    def release(self, transfer_id: str) -> bool:
        return self.leases is not None and self.leases.release(transfer_id)

    # ---- D side --------------------------------------------------------------------------------------

    def fetch(self, params: dict[str, Any], fingerprint: str, timeout: float = 30.0, ack: bool = True) -> PrefixState:
        check_params(params, self.name)
        deadline = Deadline(timeout)
        where = f"{params['host']}:{params['port']}"
        tid = str(params["transfer_id"])

        def control() -> dict[str, Any]:
            with connect(params["host"], params["port"], fingerprint, deadline) as sock:
                return request(sock, {"op": "nixl_get", "transfer_id": tid}, deadline, where, self.secret)

        try:
            t0 = time.perf_counter()
            reply = guarded(control, deadline, where)
            header = parse_header(reply["header"].encode())
            buffers = [torch.empty(e["shape"], dtype=DTYPES[e["dtype"]], device=self.device) for e in header["buffers"]]
            t1 = time.perf_counter()
            nbytes = self._read(reply, buffers, tid, ack, deadline)
            arrive_s = time.perf_counter() - t1
            if ack and not reply["indices"]:  # nothing was read, so no notification carried the ack
                self.ack(params, fingerprint, deadline.left())
            self.metrics.record(TransferRecord(self.name, "recv", tid, nbytes, time.perf_counter() - t0))
        except TransferError:
            self.metrics.failed()
            raise
        t1 = time.perf_counter()
        state = PrefixState.from_buffers(header, buffers)
        state.receipt = {"arrive_s": arrive_s, "unpack_s": time.perf_counter() - t1}
        return state

    def _read(
        self,
        reply: dict[str, Any],
        buffers: list[torch.Tensor],
        tid: str,
        ack: bool,
        deadline: Deadline,
    ) -> int:
        """RDMA-read P's registered buffers into ours; returns the bytes read."""
        indices, descs = reply["indices"], [tuple(int(x) for x in d) for d in reply["descs"]]
        if not indices:
            return 0
        local = [buffers[i] for i in indices]
        sizes = [t.numel() * t.element_size() for t in local]
        if [d[1] for d in descs] != sizes:
            raise TransferError(f"transfer {tid}: P's descriptors do not match its header")
        remote = self.agent.add_remote_agent(base64.b64decode(reply["agent_metadata"]))
        remote = remote.decode() if isinstance(remote, bytes) else str(remote)
        if remote != reply["agent_name"]:
            raise TransferError(f"transfer {tid}: metadata names agent {remote!r}, P said {reply['agent_name']!r}")
        reg = self.agent.register_memory(local, backends=self.backends)
        handles: list[Any] = []
        try:
            local_dl = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(local), _mem(local[0])[0], self.backends)
            handles.append(local_dl)
            remote_dl = self.agent.prep_xfer_dlist(remote, descs, reply["mem_type"], self.backends)
            handles.append(remote_dl)
            order = list(range(len(indices)))
            tag = op_tag(self.secret, "ack", tid) if self.secret is not None else ""
            notif = ACK_PREFIX + f"{tid}:{tag}".encode() if ack else b""
            xfer = self.agent.make_prepped_xfer("READ", local_dl, order, remote_dl, order, notif, self.backends)
            handles.insert(0, xfer)  # released first: a live transfer is aborted by its release
            state = self.agent.transfer(xfer)
            while state == "PROC":
                if time.monotonic() > deadline.end:
                    raise TransferTimeout(
                        f"NIXL READ of transfer {tid} from {remote} timed out after {deadline.timeout:.3g} s"
                    )
                time.sleep(5e-5)
                state = self.agent.check_xfer_state(xfer)
            if state != "DONE":
                raise TransferError(f"NIXL READ of transfer {tid} from {remote} failed (state {state})")
        finally:
            for h in handles:
                try:
                    h.release()
                except Exception as e:  # an aborted transfer may refuse; NIXL retries at agent teardown
                    log.warning("releasing NIXL handle for transfer %s: %s", tid, e)
            self.agent.deregister_memory(reg, backends=self.backends)
        return sum(d[1] for d in descs)

    def ack(self, params: dict[str, Any], fingerprint: str, timeout: float = 10.0) -> None:
        check_params(params, self.name)
        deadline = Deadline(timeout)
        where = f"{params['host']}:{params['port']}"

        def run() -> None:
            with connect(params["host"], params["port"], fingerprint, deadline) as sock:
                request(sock, {"op": "ack", "transfer_id": params["transfer_id"]}, deadline, where, self.secret)

        guarded(run, deadline, where)

    # ---- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
            self._poller = None
        with self._lock:
            if self.server is not None:
                self.server.close()
                self.server = None
            if self.leases is not None:
                self.leases.close()  # deregisters what is still held, runs on_release("closed")
