"""Sealing prefix states and data-plane operations with the deployment secret (transfer/seal.py):
any changed byte, another transfer id, another prompt or another key fails; a TCP plane with a
secret serves only tagged operations."""

from __future__ import annotations

import json

import pytest
import torch

from asympd.transfer import PrefixStateError, TcpTransport, TransferError, kv_pack
from asympd.transfer.seal import new_transfer_id, op_tag, seal, verify
from tests.transfer.test_kv_pack import packed_state
from tests.transfer.transfer_peer import fingerprint, make_state

KEY = b"k" * 32


def test_a_sealed_state_verifies_and_nothing_else_does():
    state = make_state(split=6, n_tokens=20, seed=1)
    tid = new_transfer_id()
    tag = seal(KEY, tid, state)
    ids = state.token_ids.tolist()
    verify(KEY, tid, state, tag, ids)
    assert tid.startswith("xfer-") and len(tid) == 37 and new_transfer_id() != tid
    with pytest.raises(PrefixStateError, match="failed authentication"):
        verify(b"other" * 8, tid, state, tag, ids)
    with pytest.raises(PrefixStateError, match="failed authentication"):
        verify(KEY, new_transfer_id(), state, tag, ids)
    with pytest.raises(PrefixStateError, match="no authentication tag"):
        verify(KEY, tid, state, None, ids)
    with pytest.raises(PrefixStateError, match="different prompt"):
        verify(KEY, tid, state, tag, ids[:-1] + [(ids[-1] + 1) % 512])
    for tamper in (_flip_a_kv_bit, _change_an_index_key, _change_the_metadata, _change_a_token):
        other = make_state(split=6, n_tokens=20, seed=1)
        assert seal(KEY, tid, other) == tag  # deterministic over the same bytes
        tamper(other)
        with pytest.raises(PrefixStateError):
            verify(KEY, tid, other, tag, ids)


def _flip_a_kv_bit(s):
    next(iter(s.ckv.values())).view(-1).view(torch.uint8)[0] ^= 1


def _change_an_index_key(s):
    next(iter(s.idx.values())).view(-1)[-1] = 0.5


def _change_the_metadata(s):
    s.boundary_policy = "align"  # in the header


def _change_a_token(s):
    s.token_ids[0] = (int(s.token_ids[0]) + 1) % 512


def test_tcp_plane_with_a_secret_serves_only_tagged_ops():
    fp = fingerprint()
    state = make_state(split=6, n_tokens=20, seed=2)
    with TcpTransport(fp, secret=KEY) as p, TcpTransport(fp, secret=KEY) as d, TcpTransport(fp) as thief:
        params = p.publish("xfer-1", state)
        with pytest.raises(TransferError, match="lacks the deployment's internal credential"):
            thief.fetch(params, fp, timeout=5)
        with pytest.raises(TransferError, match="lacks the deployment's internal credential"):
            thief.ack(params, fp, timeout=5)
        assert p.server is not None and len(p.server.refusals) == 2
        assert d.fetch(params, fp, timeout=5, ack=True).equal(state)
    assert op_tag(KEY, "get", "a") != op_tag(KEY, "ack", "a") != op_tag(KEY, "get", "b")


def test_a_received_state_is_checked_over_the_bytes_that_arrived(monkeypatch):
    """D authenticates what arrived over TCP (``state.arrived``), from which its values were
    unpacked, without packing them again (several times the unpacking's CPU time); a flipped byte
    of what arrived, or another key, still fails."""
    state = packed_state()
    ids = state.token_ids.tolist()
    tag = seal(KEY, "xfer-1", state)
    with TcpTransport(fingerprint(), secret=KEY) as p, TcpTransport(fingerprint(), secret=KEY) as d:
        params = p.publish("xfer-1", state)
        got = d.fetch(params, fingerprint(), timeout=5, ack=True)

    def no_pack(*_args):
        raise AssertionError("D packed the received state again")

    monkeypatch.setattr(kv_pack, "pack", no_pack)
    verify(KEY, "xfer-1", got, tag, ids)
    assert got.equal(state) and got.arrived is not None
    with pytest.raises(PrefixStateError, match="failed authentication"):
        verify(b"other" * 8, "xfer-1", got, tag, ids)
    header, buffers = got.arrived
    codes = [b for b, e in zip(buffers, json.loads(header)["buffers"], strict=True) if e["name"] == "ckv.1"][0]
    codes.view(-1)[0] ^= 1
    with pytest.raises(PrefixStateError, match="failed authentication"):
        verify(KEY, "xfer-1", got, tag, ids)
