"""TCP and NIXL data planes between two real processes on loopback (P spawned, this process is D),
plus the failure paths: fingerprint mismatch, unknown id, timeouts, expiry, NIXL missing."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from asympd.config import tiny
from asympd.transfer import (
    NixlUnavailable,
    PrefixStateServer,
    TransferError,
    TransferTimeout,
    make_transport,
    nixl_available,
)
from asympd.transfer import nixl_transport as nixl_mod
from asympd.transfer import tcp as tcp_mod
from tests.transfer.transfer_peer import PeerProcess, fingerprint, make_state

CFG = tiny()
FP = fingerprint()
OTHER_FP = fingerprint("float32")  # same model, other numeric format: must be refused


def _nixl_skip_reason() -> str | None:
    if not nixl_available():
        return f"NIXL does not import here: {nixl_mod._nixl_error}"
    try:
        make_transport("nixl", FP).close()
    except NixlUnavailable as e:
        return f"NIXL imports but cannot run here: {e}"
    return None


NIXL_SKIP = _nixl_skip_reason()
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP)))]


@pytest.fixture(scope="module")
def peer():
    p = PeerProcess(["tcp"] + (["nixl"] if NIXL_SKIP is None else []))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def decoders():
    made = {"tcp": make_transport("tcp", FP)}
    if NIXL_SKIP is None:
        made["nixl"] = make_transport("nixl", FP)
    yield made
    for t in made.values():
        t.close()


def _wait_released(peer: PeerProcess, tid: str, timeout: float = 5.0) -> list[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        reasons = [why for t, why in peer.call("released") if t == tid]
        if reasons:
            time.sleep(0.05)  # a second release would show up here
            return [why for t, why in peer.call("released") if t == tid]
        time.sleep(0.01)
    return []


# ---- between two processes -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize(("split", "n"), [(21, 37), (20, 36), (0, 5)])
def test_fetch_between_processes_is_bit_exact_and_acks(peer, decoders, name, split, n):
    tid = f"{name}-{split}-{n}"
    params = peer.call("publish", name, tid, split, n, "bfloat16", split)
    assert json.loads(json.dumps(params)) == params  # travels through the router as kv_transfer_params
    assert params["transport"] == name and params["transfer_id"] == tid
    d = decoders[name]
    before = d.metrics.snapshot()["bytes"]
    state = d.fetch(params, FP, timeout=10)
    state.validate(CFG, FP)
    assert state.equal(make_state(split, n, "bfloat16", split))
    assert d.metrics.snapshot()["bytes"] - before == state.nbytes
    assert _wait_released(peer, tid) == ["ack"]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_fetch_without_ack_then_explicit_ack(peer, decoders, name):
    tid = f"{name}-late-ack"
    params = peer.call("publish", name, tid, 9, 25, "bfloat16", 3)
    state = decoders[name].fetch(params, FP, timeout=10, ack=False)
    assert state.equal(make_state(9, 25, "bfloat16", 3))
    time.sleep(0.1)
    assert [t for t, _ in peer.call("released") if t == tid] == []
    decoders[name].ack(params, FP, timeout=5)
    assert _wait_released(peer, tid) == ["ack"]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_fingerprint_mismatch_is_refused_on_both_sides(peer, name):
    params = peer.call("publish", name, f"{name}-mismatch", 21, 37, "bfloat16", 0)
    wrong = make_transport(name, OTHER_FP)
    try:
        with pytest.raises(TransferError) as err:
            wrong.fetch(params, OTHER_FP, timeout=5)
    finally:
        wrong.close()
    message = str(err.value)
    assert "fingerprint mismatch" in message and FP in message and OTHER_FP in message
    refusals = peer.call("refusals", name)
    assert any(FP in r and OTHER_FP in r and "fingerprint mismatch" in r for r in refusals)
    assert [t for t, _ in peer.call("released") if t == f"{name}-mismatch"] == []  # still held for the right D


@pytest.mark.parametrize("name", TRANSPORTS)
def test_unknown_transfer_id(peer, decoders, name):
    params = peer.call("publish", name, f"{name}-known", 4, 8, "bfloat16", 0)
    with pytest.raises(TransferError, match="unknown transfer id 'nope'"):
        decoders[name].fetch({**params, "transfer_id": "nope"}, FP, timeout=5)


@pytest.mark.parametrize("name", TRANSPORTS)
def test_publish_refuses_a_state_of_another_fingerprint(peer, name):
    with pytest.raises(RuntimeError, match="fingerprint mismatch"):
        peer.call("publish", name, f"{name}-fp32", 4, 8, "float32", 0)


# ---- in one process: failure paths ---------------------------------------------------------------------


@pytest.fixture
def silent_server():
    """Accepts connections and never answers: what a hung P looks like."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for c in conns:
        c.close()
    srv.close()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_hung_peer_times_out(silent_server, decoders, name):
    params = {"transport": name, "host": "127.0.0.1", "port": silent_server, "transfer_id": "x", "agent_name": "p"}
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="timed out"):
        decoders[name].fetch(params, FP, timeout=0.3)
    assert time.monotonic() - t0 < 3


def test_closed_port_is_a_transfer_error_not_a_timeout():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(TransferError, match="cannot connect") as err:
        tcp_mod.fetch("127.0.0.1", port, "x", FP, timeout=2)
    assert not isinstance(err.value, TransferTimeout)


def test_tcp_server_lease_expires_and_releases_once():
    released = []
    server = PrefixStateServer("127.0.0.1", 0, FP, ttl_s=0.2, on_release=lambda t, s, why: released.append((t, why)))
    try:
        server.register("old", make_state(4, 8))
        deadline = time.monotonic() + 5
        while not released and time.monotonic() < deadline:
            time.sleep(0.02)
        assert released == [("old", "expired")]
        with pytest.raises(TransferError, match="unknown transfer id 'old'"):
            tcp_mod.fetch("127.0.0.1", server.port, "old", FP, timeout=5)
    finally:
        server.close()
    assert released == [("old", "expired")]


def test_tcp_fetch_records_metrics_on_both_sides():
    p, d = make_transport("tcp", FP), make_transport("tcp", FP)
    try:
        state = make_state(21, 37)
        got = d.fetch(p.publish("m", state), FP, timeout=5)
        assert got.equal(state)
        recv, send = d.metrics.snapshot(), p.metrics.snapshot()
        assert recv["transfers"] == 1 and recv["bytes"] == state.nbytes and recv["seconds"] > 0
        assert send["transfers"] == 1 and send["bytes"] == state.nbytes
        assert recv["recent"][0]["role"] == "recv" and send["recent"][0]["role"] == "send"
        assert p.release("m") is False  # already acked
    finally:
        p.close()
        d.close()


def test_params_for_another_transport_are_refused(decoders):
    with pytest.raises(TransferError, match="for transport 'nixl', not 'tcp'"):
        decoders["tcp"].fetch({"transport": "nixl", "host": "h", "port": 1, "transfer_id": "x"}, FP)
    with pytest.raises(TransferError, match="lack port"):
        decoders["tcp"].fetch({"host": "h", "transfer_id": "x"}, FP)


def test_make_transport_names():
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        make_transport("rdma", FP)
    t = make_transport("auto", FP, device="cpu")
    try:
        assert t.name == ("nixl" if NIXL_SKIP is None else "tcp")
    finally:
        t.close()


def test_missing_nixl_is_importable_but_refused_on_use(monkeypatch):
    monkeypatch.setattr(nixl_mod, "_nixl", None)
    monkeypatch.setattr(nixl_mod, "_nixl_error", "nixl: ModuleNotFoundError: No module named 'nixl'")
    assert nixl_mod.nixl_available() is False
    with pytest.raises(NixlUnavailable, match="NIXL is not available .*use the 'tcp' transport"):
        make_transport("nixl", FP)
    t = make_transport("auto", FP)
    try:
        assert t.name == "tcp"
    finally:
        t.close()
