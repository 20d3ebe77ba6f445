"""Shared by the transfer tests: deterministic prefix states, and a prefill worker (P) process.

Not a test module: spawned children import it by name, so it must stay importable on its own.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import torch

from asympd.config import tiny
from asympd.transfer import PrefixState, model_fingerprint

CHECKPOINT = "test-ckpt@0"


def fingerprint(dtype: str = "bfloat16") -> str:
    return model_fingerprint(tiny(), CHECKPOINT, dtype)


def make_state(split: int, n_tokens: int, dtype: str = "bfloat16", seed: int = 0) -> PrefixState:
    """A tiny-config state with random bits in every buffer (NaN and inf patterns included), so a
    bit-exact comparison catches any byte moved, dropped or converted."""
    cfg = tiny()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (n_tokens,), generator=gen)
    state = PrefixState.allocate(cfg, split, tokens, fingerprint=fingerprint(dtype), dtype=dtype)
    for name, t in state.named_buffers().items():
        if name != "token_ids":
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return state


def prefill_worker(conn: Any, transports: list[str], ttl_s: float) -> None:
    """P: one transport per name, all with the tiny fingerprint; answers commands on ``conn``:
    ("publish", transport, transfer_id, split, n_tokens, dtype, seed) -> params,
    ("refusals", transport) -> list of handshake refusals, ("released",) -> [(id, reason)],
    ("stop",) -> None. Any exception is sent back as ("error", traceback)."""
    from asympd.transfer import make_transport

    released: list[tuple[str, str]] = []
    made = {
        name: make_transport(name, fingerprint(), ttl_s=ttl_s, on_release=lambda t, s, r: released.append((t, r)))
        for name in transports
    }
    conn.send(("ready", sorted(made)))
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "publish":
                    name, tid, split, n, dtype, seed = args
                    state = make_state(split, n, dtype, seed)
                    conn.send(("ok", made[name].publish(tid, state)))
                elif cmd == "refusals":
                    conn.send(("ok", list(made[args[0]].server.refusals)))
                elif cmd == "released":
                    conn.send(("ok", list(released)))
                elif cmd == "stop":
                    break
                else:
                    conn.send(("error", f"unknown command {cmd}"))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for t in made.values():
            t.close()
        conn.send(("stopped", list(released)))


class PeerProcess:
    """Drives a spawned prefill_worker from the test process (which plays D)."""

    def __init__(self, transports: list[str], ttl_s: float = 30.0, start_timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_worker, args=(child, transports, ttl_s), daemon=True)
        self.proc.start()
        if not self.conn.poll(start_timeout):
            self.proc.kill()
            raise RuntimeError("prefill worker did not start")
        tag, self.transports = self.conn.recv()
        assert tag == "ready"

    def call(self, *cmd: Any, timeout: float = 20.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"prefill worker did not answer {cmd[0]}")
        tag, value = self.conn.recv()
        if tag != "ok":
            raise RuntimeError(f"prefill worker: {value}")
        return value

    def stop(self) -> list[tuple[str, str]]:
        released: list[tuple[str, str]] = []
        try:
            self.conn.send(("stop",))
            if self.conn.poll(10):
                _, released = self.conn.recv()
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
        return released
