"""Authenticating prefix states and data-plane operations with the deployment secret.

A ``PrefixState`` goes into D's KV cache and, through prefix caching, into the answers of later
requests, so D must only take one that P made for *this* request. P seals each state with an
HMAC-SHA256 over the transfer id, the header (metadata, buffer table) and every buffer byte
(the prompt's token ids are one of the buffers); D recomputes it over what arrived and refuses a
mismatch before the state touches its caches. Transfer ids are random, and every control
operation on P's data plane (get, ack) carries a tag only a holder of the secret can compute.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import torch

from .prefix_state import PrefixState, PrefixStateError, tensor_bytes


def new_transfer_id() -> str:
    """Unguessable (128 random bits) and unrelated to the client's request id."""
    return "xfer-" + secrets.token_hex(16)


def seal(secret: bytes, transfer_id: str, state: PrefixState) -> str:
    """The state's tag (hex) for ``transfer_id``: over its wire bytes, as P sends them."""
    return _tag(secret, transfer_id, *state.to_buffers(host=True))


def _tag(secret: bytes, transfer_id: str, header: bytes, buffers: list[torch.Tensor]) -> str:
    mac = hmac.new(secret, b"asympd-prefix-state\0" + transfer_id.encode() + b"\0", hashlib.sha256)
    mac.update(len(header).to_bytes(8, "little") + header)
    for b in buffers:
        data = tensor_bytes(b)
        mac.update(len(data).to_bytes(8, "little"))
        mac.update(memoryview(data))
    return mac.hexdigest()


def verify(secret: bytes, transfer_id: str, state: PrefixState, tag: object, token_ids: list[int]) -> None:
    """Raise PrefixStateError unless ``state`` is what P sealed under ``transfer_id`` for exactly
    this prompt. A received state is checked over the bytes that arrived (``state.arrived``: its
    values were unpacked from them), else over its wire bytes made again."""
    if not isinstance(tag, str) or not tag:
        raise PrefixStateError("the prefix state carries no authentication tag (state_mac)")
    got = _tag(secret, transfer_id, *state.arrived) if state.arrived is not None else seal(secret, transfer_id, state)
    if not hmac.compare_digest(got, tag):
        raise PrefixStateError("the prefix state failed authentication: forged or corrupted in transit")
    if state.token_ids.tolist() != list(token_ids):
        raise PrefixStateError("the prefix state was made for a different prompt than this request's")


def op_tag(secret: bytes, op: str, transfer_id: str) -> str:
    """The tag a data-plane operation on ``transfer_id`` carries."""
    return hmac.new(secret, f"asympd-op\0{op}\0{transfer_id}".encode(), hashlib.sha256).hexdigest()


def check_op(secret: bytes | None, msg: dict) -> str | None:
    """None if ``msg`` may run (no secret configured, or a valid tag), else why not."""
    if secret is None:
        return None
    tag = msg.get("auth")
    want = op_tag(secret, str(msg.get("op")), str(msg.get("transfer_id")))
    if not isinstance(tag, str) or not hmac.compare_digest(tag, want):
        return f"op {msg.get('op')!r} refused: it lacks the deployment's internal credential"
    return None
