"""The trust boundaries of a 1P1D deployment (real processes, docs/serving.md "security model"):
internal parameters and routes need the internal credential, the client key opens only the public
API, transfer ids are random, D refuses a forged, corrupted or replayed prefix state before it
touches its caches, a process without the internal key can neither fetch, ack nor make P publish
a state, and every listener is on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI, Request

from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.serve.http import INTERNAL_HEADER, internal_token
from asympd.serve.router import Router, RouterConfig, build_router_app
from asympd.transfer import TcpTransport, TransferError
from asympd.transfer.seal import seal
from tests.serve.cluster import ThreadServer, metrics, wait_for, wait_idle
from tests.util import random_prompts

W = 16  # the tiny checkpoint's window: prompts longer than this go through P


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(tiny_ckpt, mode="asymmetric")


def _want(offline, ids, n=4):
    return offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=n, temperature=0))[0]


def _prefill(dep, ids, rid="req-client-chosen"):
    """Play the router towards P: the prefix state published for ``ids``, and its params."""
    r = httpx.post(
        f"{dep.prefill}/v1/completions",
        json={"prompt": ids, "max_tokens": 4, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}},
        headers={**dep.internal, "X-Request-Id": rid},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _decode(dep, ids, kv):
    return httpx.post(
        f"{dep.decode}/v1/completions",
        json={"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True, "kv_transfer_params": kv},
        headers=dep.internal,
        timeout=60,
    )


def _fingerprint(dep):
    return httpx.get(f"{dep.decode}/asympd/info", headers=dep.internal, timeout=5).json()["fingerprint"]


def _router_tokens(dep, ids):
    r = httpx.post(
        f"{dep.router}/v1/completions",
        json={"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
        headers=dep.auth,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_client_key_opens_only_the_public_api(hardened):
    dep = hardened
    ids = random_prompts([40], seed=70)[0]
    body = {"prompt": ids, "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True, "host": "10.9.9.9"}}
    # the key is the router's; its Authorization does not reach the workers, which accept the router's credential
    assert httpx.post(f"{dep.router}/v1/completions", json=body, timeout=60).status_code == 401
    r = httpx.post(f"{dep.router}/v1/completions", json=body, headers=dep.auth, timeout=60)
    assert r.status_code == 200, r.text  # the client's kv_transfer_params were dropped, not followed
    assert r.json()["asympd_timings"]["prefill_path"] == "remote"
    # with the client key, a client still cannot use the internal parameters or routes of a worker
    for url in (dep.decode, dep.prefill):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=dep.auth, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["param"] == "kv_transfer_params", r.text
        r = httpx.post(f"{url}/asympd/abort", json={"request_id": "x"}, headers=dep.auth, timeout=30)
        assert r.status_code == 403 and "internal credential" in r.json()["error"]["message"]
    p_body = {"prompt": ids, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    assert httpx.post(f"{dep.prefill}/v1/completions", json=p_body, timeout=30).status_code == 403  # no publish
    # the fingerprint is no longer served to whoever asks
    assert "fingerprint" not in httpx.get(f"{dep.decode}/asympd/info", timeout=5).json()
    assert len(_fingerprint(dep)) == 16
    wait_idle([dep.prefill, dep.decode])


def test_transfer_ids_are_random_and_the_data_plane_needs_the_key(hardened, offline):
    dep = hardened
    ids = random_prompts([45], seed=71)[0]
    kv = _prefill(dep, ids, rid="guessable-id")
    assert kv["transfer_id"].startswith("xfer-") and "guessable" not in kv["transfer_id"]
    assert len(kv["transfer_id"]) >= 5 + 32
    fp = _fingerprint(dep)
    for secret in (None, b"not-the-deployment-key"):
        with TcpTransport(fp, secret=secret) as thief:
            with pytest.raises(TransferError, match="lacks the deployment's internal credential"):
                thief.fetch(kv, fp, timeout=10)
            with pytest.raises(TransferError, match="lacks the deployment's internal credential"):
                thief.ack(kv, fp, timeout=10)
    # the state is still held for D: the honest path is untouched
    r = _decode(dep, ids, kv)
    assert r.status_code == 200, r.text
    assert r.json()["asympd_timings"]["prefill_path"] == "remote"
    assert r.json()["choices"][0]["token_ids"] == _want(offline, ids).outputs[0].token_ids
    wait_idle([dep.prefill, dep.decode])


def _republish(dep, kv, tamper, tag_secret=None):
    """Fetch P's state (as D would), tamper with it and serve it from this process under the same
    transfer id; the kv_transfer_params that point D there."""
    fp = _fingerprint(dep)
    with TcpTransport(fp, secret=dep.secret) as honest:
        state = honest.fetch(kv, fp, timeout=10, ack=True)  # P frees its copy
    tamper(state)
    state.kv_format = "unpacked"  # a forger picks any wire format D reads: arbitrary floats ship unpacked
    evil = TcpTransport(fp)  # answers anyone
    params = evil.publish(kv["transfer_id"], state)
    out = {**kv, "host": params["host"], "port": params["port"]}
    if tag_secret is not None:
        out["state_mac"] = seal(tag_secret, kv["transfer_id"], state)
    return evil, out


def _random_floats(state):
    for t in list(state.ckv.values()) + list(state.idx.values()):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(7)).to(t.dtype))


def _flip_one(state):
    t = next(iter(state.ckv.values()))
    t.view(-1)[0] += 1.0


@pytest.mark.parametrize(
    ("case", "tamper", "tag_secret", "why"),
    [
        ("forged", _random_floats, b"attacker-key", "failed authentication"),
        ("forged-untagged", _random_floats, None, "no authentication tag"),
        ("corrupted", _flip_one, None, "failed authentication"),
    ],
)
def test_decode_refuses_a_bad_state_and_caches_nothing(hardened, offline, case, tamper, tag_secret, why):
    dep = hardened
    ids = random_prompts([50], seed=72)[0]
    refusals = metrics(dep.decode).get("asympd_prefix_state_refusals_total", 0)
    kv = _prefill(dep, ids)
    evil, bad = _republish(dep, kv, tamper, tag_secret)
    if case == "forged-untagged":
        bad.pop("state_mac")
    with evil:
        r = _decode(dep, ids, bad)
    assert r.status_code == 400, r.text
    assert why in r.json()["error"]["message"] and r.json()["error"]["param"] == "kv_transfer_params"
    assert metrics(dep.decode)["asympd_prefix_state_refusals_total"] == refusals + 1
    wait_idle([dep.prefill, dep.decode])
    # nothing of it reached D's prefix cache: the same prompt through the router gives the right tokens
    for _ in range(2):
        assert _router_tokens(dep, ids) == _want(offline, ids).outputs[0].token_ids


def test_decode_refuses_a_replayed_state(hardened, offline):
    dep = hardened
    ids = random_prompts([48], seed=73)[0]
    kv = _prefill(dep, ids)
    assert _decode(dep, ids, kv).status_code == 200
    r = _decode(dep, ids, kv)
    assert r.status_code == 400 and "replayed" in r.json()["error"]["message"], r.text
    # and a state made for another prompt is refused too (bound to the request's token ids)
    other = random_prompts([48], seed=74)[0]
    kv2 = _prefill(dep, ids)
    r = _decode(dep, other, kv2)
    assert r.status_code == 400 and "bad prefix state" in r.json()["error"]["message"], r.text
    httpx.post(f"{dep.prefill}/asympd/abort", json={"request_id": "req-client-chosen"}, headers=dep.internal)
    wait_idle([dep.prefill, dep.decode])


def _listeners(pid: int) -> list[str]:
    """host:port of every listening TCP socket process ``pid`` holds (what ``ss -ltnp`` shows)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                addr, port = f[1].split(":")
                out.append(f"{_addr(addr, width)}:{int(port, 16)}")
    return out


def _addr(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    if width == 8:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    return ":".join(b"".join(words).hex()[i : i + 4] for i in range(0, 32, 4))


def test_every_listener_is_on_loopback(hardened):
    dep = hardened
    _router_tokens(dep, random_prompts([40], seed=75)[0])  # P's data plane starts with its first publish
    seen = {}
    for proc in dep.procs:
        seen[proc.name] = _listeners(proc.pid)
    assert all(seen.values()), seen
    assert len(seen["h-prefill"]) == 2  # HTTP + the transfer control server
    for name, addrs in seen.items():
        assert all(a.startswith("127.0.0.1:") for a in addrs), (name, addrs)


def test_ep_rendezvous_store_listens_on_loopback():
    from asympd.parallel.launch import bound_store

    store, sock = bound_store("127.0.0.1", 1)
    store.set("k", "v")
    assert store.get("k") == b"v"
    mine = [a for a in _listeners(os.getpid()) if a.endswith(f":{sock.getsockname()[1]}")]
    assert mine == [f"127.0.0.1:{sock.getsockname()[1]}"]  # torch's own socket would listen on every interface
    sock.close()


def test_the_router_sends_workers_its_credential_never_the_clients(monkeypatch):
    """A stand-in decode worker records what the router sends it."""
    monkeypatch.setenv("ASYMPD_INTERNAL_KEY", "deployment-secret")
    seen: list = []
    d = FastAPI()

    @d.get("/health")
    async def health():
        return {"status": "ok"}

    @d.get("/asympd/info")
    async def info(request: Request):
        seen.append(("info", dict(request.headers)))
        return {"role": "decode", "mode": "asymmetric", "fingerprint": "f", "window_size": 16, "model": "m"}

    @d.post("/v1/completions")
    async def completions(request: Request):
        seen.append(("completions", dict(request.headers), await request.json()))
        return {"id": "x", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}

    ds = ThreadServer(d).start()
    rs = ThreadServer(build_router_app(Router(RouterConfig(decode=[ds.url], api_key="sk-c", health_interval=0.2))))
    try:
        rs.start()
        wait_for(lambda: httpx.get(f"{rs.url}/health", timeout=2).json()["all_healthy"], 20, "the stand-in is healthy")
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True, "host": "evil"}}
        r = httpx.post(f"{rs.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-c"}, timeout=20)
        assert r.status_code == 200, r.text
    finally:
        rs.stop()
        ds.stop()
    _, headers, sent = next(s for s in seen if s[0] == "completions")
    assert "authorization" not in headers
    assert headers[INTERNAL_HEADER] == internal_token(b"deployment-secret") != "deployment-secret"
    assert sent["kv_transfer_params"].get("host") != "evil"  # the router's own marker, not the client's
    assert all(s[1][INTERNAL_HEADER] == internal_token(b"deployment-secret") for s in seen if s[0] == "info")
