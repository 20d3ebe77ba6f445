"""Oversized input, numbers out of range, long requests and where keys come from, against the
shared hardened 1P1D deployment (real processes): a 50 MB body is refused in well under a second
by every server while a normal request completes, a prompt too long to fit is refused before it is
tokenized, a non-streamed request far longer than the router's progress timeout completes."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from asympd.serve.http import client_key, default_internal_key_file, internal_key
from tests.serve.cluster import metrics, stream, wait_idle
from tests.serve.hardened import PROGRESS_TIMEOUT
from tests.util import random_prompts

BIG = 50 << 20


def _raw_post(url: str, headers: dict[str, str], chunks, timeout: float = 10.0) -> tuple[int, dict]:
    """POST over a bare socket (the body may be refused while it is still being sent): status, JSON."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        head = [f"POST {u.path} HTTP/1.1", f"Host: {u.hostname}", "Content-Type: application/json"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            for c in chunks:
                s.sendall(c)
        except OSError:
            pass  # the server answered and closed: read what it said
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            got = s.recv(65536)
            if not got:
                break
            data += got
    status = int(data.split(b" ", 2)[1])
    body = data[data.index(b"\r\n\r\n") + 4 :]
    return status, json.loads(body[: _length(data)])


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":")[1])
    return 0


def _declared():
    """The first MB of a body whose Content-Length says 50 MB."""
    yield b'{"prompt": "' + b"a" * (1 << 20)


def _chunked(n: int, piece: int = 1 << 20):
    """A chunked body of ``n`` bytes: no Content-Length to refuse it by."""
    sent = 0
    while sent < n:
        yield f"{piece:x}\r\n".encode() + b"a" * piece + b"\r\n"
        sent += piece
    yield b"0\r\n\r\n"


def test_a_50mb_request_is_refused_fast_everywhere_while_others_complete(hardened):
    dep = hardened
    ids = random_prompts([40], seed=80)[0]
    done: dict = {}

    def normal() -> None:
        r = httpx.post(
            f"{dep.router}/v1/completions",
            json={"prompt": ids, "max_tokens": 8, "temperature": 0},
            headers=dep.auth,
            timeout=60,
        )
        done["status"], done["tokens"] = r.status_code, r.json().get("usage", {}).get("completion_tokens")

    t = threading.Thread(target=normal)
    t.start()
    for url in (dep.router, dep.prefill, dep.decode):
        for headers, body in (
            ({**dep.auth, "Content-Length": str(BIG)}, _declared()),
            ({**dep.auth, "Transfer-Encoding": "chunked"}, _chunked(8 << 20)),
        ):
            t0 = time.perf_counter()
            status, err = _raw_post(f"{url}/v1/completions", headers, body)
            took = time.perf_counter() - t0
            assert status == 413 and "exceeds the limit of 4194304 bytes" in err["error"]["message"], (url, err)
            assert took < 1.0, (url, took)
    t.join(60)
    assert done == {"status": 200, "tokens": 8}
    assert httpx.get(f"{dep.router}/health", timeout=5).json()["all_healthy"]
    wait_idle([dep.prefill, dep.decode])


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(hardened):
    dep = hardened
    text = "hello " * 500_000  # 3 MB: under the body limit, ~25 times what 4096 tokens can hold
    for url in (dep.router, dep.decode):
        for kind, body in (
            ("completions", {"prompt": text, "max_tokens": 2}),
            ("chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
        ):
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/v1/{kind}", json=body, headers=dep.auth, timeout=30)
            took = time.perf_counter() - t0
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert "maximum context length is 4096 tokens" in r.json()["error"]["message"]
            assert took < 1.0, (url, kind, took)


def test_the_router_does_not_forward_a_prompt_that_cannot_fit(hardened):
    dep = hardened
    refused = 'asympd_request_errors_total{status="400"}'
    before = [metrics(u).get(refused, 0) for u in (dep.prefill, dep.decode)]
    for prompt in ([5] * 5000, "hello " * 5000):  # over 4096 tokens, under the character bound
        r = httpx.post(
            f"{dep.router}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=dep.auth, timeout=30
        )
        assert r.status_code == 400 and "your prompt has 5" in r.json()["error"]["message"], r.text
    assert [metrics(u).get(refused, 0) for u in (dep.prefill, dep.decode)] == before  # no worker saw them


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
        (b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
        (b'{"prompt": "hi", "seed": 1180591620717411303424}', "seed"),  # 2**70
        (b'{"prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
        (b'{"prompt": "hi", "repetition_penalty": 0}', "repetition_penalty"),
        (b'{"prompt": "hi", "frequency_penalty": 2.5}', "frequency_penalty"),
        (b'{"prompt": "hi", "max_tokens": 4, "min_tokens": 5}', "min_tokens"),
        (b'{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias"),
    ],
)
def test_numbers_out_of_range_are_400_naming_the_field(hardened, raw, param):
    dep = hardened
    for url in (dep.router, dep.decode):
        r = httpx.post(
            f"{url}/v1/completions", content=raw, headers={**dep.auth, "Content-Type": "application/json"}, timeout=30
        )
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["param"] == param, (url, r.text)


def test_integers_of_thousands_of_digits_are_400_naming_the_field(hardened):
    """Python converts at most 4300 digits of an integer literal, and a max_tokens of 4300 digits
    made the context check's message a longer number than that: both were 500s."""
    dep = hardened
    nines, more = b"9" * 4300, b"9" * 5000
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": '
    long = "integer of 5000 digits is out of range"
    below = "Input should be less than 9223372036854775808"
    for url in (dep.router, dep.decode):
        for kind, raw, param, message in (
            ("completions", b'{"prompt": "hi", "max_tokens": ' + more + b"}", "max_tokens", f"max_tokens: an {long}"),
            ("completions", b'{"prompt": [1, -' + more + b"]}", "prompt", f"prompt: an {long}"),
            ("completions", b'{"prompt": "hi", "max_tokens": ' + nines + b"}", "max_tokens", f"max_tokens: {below}"),
            ("chat/completions", chat + nines + b"}", "max_completion_tokens", f"max_completion_tokens: {below}"),
        ):
            headers = {**dep.auth, "Content-Type": "application/json"}
            r = httpx.post(f"{url}/v1/{kind}", content=raw, headers=headers, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (url, r.text[:300])
            assert r.json()["error"]["message"].endswith(message), (url, r.text[:300])


def test_a_lone_surrogate_is_400_through_the_router_too(hardened):
    """A lone surrogate can be neither tokenized nor forwarded as UTF-8 (both were 500s, the
    router's in re-encoding the body for P): every server refuses it as it parses the body."""
    dep = hardened
    for url in (dep.router, dep.decode):
        for kind, raw, field in (
            ("completions", rb'{"prompt": "x\ud800", "max_tokens": 2}', "prompt"),
            ("chat/completions", rb'{"messages": [{"role": "user", "content": "\udc00"}]}', "messages"),
            ("completions", rb'{"prompt": "x", "user": "\ud83d", "max_tokens": 2}', "user"),
        ):
            headers = {**dep.auth, "Content-Type": "application/json"}
            r = httpx.post(f"{url}/v1/{kind}", content=raw, headers=headers, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (url, r.text)
            assert "lone surrogate" in r.json()["error"]["message"], (url, r.text)


def test_the_router_tokenizes_as_the_workers(hardened):
    """/tokenize and /detokenize through the router are D's answers (the ids a request runs with),
    behind the client key as the API is; a worker's error comes back as it is."""
    dep = hardened
    for body in ({"prompt": "through the router"}, {"messages": [{"role": "user", "content": "hi"}]}):
        via_router = httpx.post(f"{dep.router}/tokenize", json=body, headers=dep.auth)
        at_d = httpx.post(f"{dep.decode}/tokenize", json=body, headers=dep.auth)
        assert via_router.status_code == 200 and via_router.json() == at_d.json(), via_router.text
    ids = via_router.json()["tokens"]
    r = httpx.post(f"{dep.router}/detokenize", json={"tokens": ids}, headers=dep.auth)
    assert r.json() == httpx.post(f"{dep.decode}/detokenize", json={"tokens": ids}, headers=dep.auth).json()
    assert httpx.post(f"{dep.router}/tokenize", json={"prompt": "x"}).status_code == 401
    r = httpx.post(f"{dep.router}/detokenize", json={"tokens": [-1]}, headers=dep.auth)
    assert r.status_code == 400 and r.json()["error"]["message"] == "token ids out of range [0, 512): [-1]"


def test_a_retry_under_the_same_request_id_is_served(hardened):
    """The router used the client's X-Request-Id as the workers' id: after a client left a request,
    the workers refused that id (499, for minutes), and two clients' ids could collide. Now each
    request is the client's id made unique; an id that cannot travel as a header is a 400 (was 500)."""
    dep = hardened
    body = {"prompt": random_prompts([40], seed=82)[0], "max_tokens": 200, "ignore_eos": True}
    headers = {**dep.auth, "X-Request-Id": "retry-1"}
    with httpx.stream("POST", f"{dep.router}/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first token: then the client leaves
    time.sleep(0.5)  # the router's aborts reach the workers
    r = httpx.post(f"{dep.router}/v1/completions", json={**body, "max_tokens": 2}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["id"].startswith("retry-1-") and r.headers["x-request-id"] == r.json()["id"]
    for rid in ("caf\u00e9".encode(), b"a\x01b"):
        r = httpx.post(f"{dep.router}/v1/completions", json=body, headers={**dep.auth, "X-Request-Id": rid})
        assert r.status_code == 400 and r.json()["error"]["message"] == "X-Request-Id must be printable ASCII"
    wait_idle([dep.prefill, dep.decode])


def test_the_router_reads_stream_as_the_workers_do(hardened):
    """``"stream": "false"`` is False to the workers (pydantic's reading) but was True to the router,
    which relayed D's JSON answer as an event stream and appended a 502 error event."""
    dep = hardened
    for value in ("false", "0"):
        body = {"prompt": "hello world", "max_tokens": 2, "stream": value}
        r = httpx.post(f"{dep.router}/v1/completions", json=body, headers=dep.auth, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["usage"]["completion_tokens"] == 2


def test_a_non_streamed_request_is_bounded_by_progress_not_total_time(hardened):
    """The router's progress timeout is PROGRESS_TIMEOUT s (the old fixed total timeout, set low):
    a non-streamed request running several times longer completes, because D sends progress."""
    dep = hardened
    ids = random_prompts([30], seed=81)[0]
    body = {"prompt": ids, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    t0 = time.perf_counter()
    r = httpx.post(f"{dep.router}/v1/completions", json=body, headers=dep.auth, timeout=120)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 200 and len(r.json()["choices"][0]["token_ids"]) == 200
    assert took > 1.5 * PROGRESS_TIMEOUT, f"the request took only {took:.2f} s: it proves nothing"
    # the first 20 tokens streamed are the same; streamed timings count e2e from where ttft starts
    with httpx.Client(timeout=60, headers=dep.auth) as c:
        streamed = stream(c, f"{dep.router}/v1/completions", {**body, "max_tokens": 20})
    assert streamed["token_ids"] == r.json()["choices"][0]["token_ids"][:20]
    t = streamed["timings"]
    assert t["e2e_s"] >= t["ttft_s"] > 0 and t["prefill_path"] == "remote"
    wait_idle([dep.prefill, dep.decode])


def test_a_refusal_on_the_progress_path_keeps_its_status(hardened):
    dep = hardened
    r = httpx.post(
        f"{dep.router}/v1/completions",
        json={"prompt": [1, 2, 99999], "max_tokens": 2},
        headers=dep.auth,
        timeout=30,
    )
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"], r.text


def test_keys_from_files_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYMPD_API_KEY", raising=False)
    monkeypatch.delenv("ASYMPD_INTERNAL_KEY", raising=False)
    assert client_key() is None
    (tmp_path / "k").write_text("sk-file\n")
    assert client_key(key_file=str(tmp_path / "k")) == "sk-file"
    monkeypatch.setenv("ASYMPD_API_KEY", "sk-env")
    assert client_key() == "sk-env"
    with pytest.raises(ValueError, match="not both"):
        client_key("a", str(tmp_path / "k"))
    with pytest.raises(ValueError, match="cannot read the API key"):
        client_key(key_file=str(tmp_path / "missing"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = internal_key()  # created on first use, private to this user, then the same for every process
    path = default_internal_key_file()
    assert path.parent == tmp_path / "cache" / "asympd" and len(first) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert internal_key() == first
    monkeypatch.setenv("ASYMPD_INTERNAL_KEY", "from-env")
    assert internal_key() == b"from-env"
