"""One 1P1D deployment as real processes, set up as docs/serving.md's security model says: a
client key from a file on the router and on D, the internal key from the environment, a short
progress timeout on the router. Shared (session scope) by test_security, test_limits and
test_sampling_params. Not a test module."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import pytest

from asympd.serve.http import INTERNAL_HEADER, internal_token
from asympd.serve.procs import ServerProcess, stop_all
from tests.serve.cluster import ENV, router_proc, start_all, wait_router, worker

PROGRESS_TIMEOUT = 1.5  # the router's --progress-timeout: seconds without a byte from D


@dataclass
class Deployment:
    router: str
    prefill: str
    decode: str
    client_key: str
    secret: bytes
    procs: list[ServerProcess]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.client_key}"}

    @property
    def internal(self) -> dict[str, str]:
        return {INTERNAL_HEADER: internal_token(self.secret)}


@pytest.fixture(scope="session")
def hardened(tiny_ckpt, tmp_path_factory) -> Deployment:
    logs = tmp_path_factory.mktemp("hardened-logs")
    key, secret = "sk-client-" + secrets.token_hex(8), secrets.token_hex(32)
    key_file = logs / "client.key"
    key_file.write_text(key + "\n")
    env = {**ENV, "ASYMPD_INTERNAL_KEY": secret}
    p = worker("h-prefill", tiny_ckpt, "prefill", "asymmetric", logs, "--transport", "tcp")
    d = worker(
        "h-decode", tiny_ckpt, "decode", "asymmetric", logs, "--transport", "tcp", "--api-key-file", str(key_file)
    )
    for proc in (p, d):
        proc.env.update(env)
    procs = [p, d]
    try:
        p_url, d_url = start_all(procs)
        r = router_proc(
            "h-router",
            [p_url],
            [d_url],
            logs,
            "--api-key-file",
            str(key_file),
            "--progress-timeout",
            str(PROGRESS_TIMEOUT),
        )
        r.env.update(env)
        procs.append(r)
        (url,) = start_all([r])
        wait_router(url)
        yield Deployment(url, p_url, d_url, key, secret.encode(), procs)
    finally:
        stop_all(procs)
