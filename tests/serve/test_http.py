"""The HTTP plumbing every server shares (asympd/serve/http.py), on a small app of its own."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter

from asympd.serve.http import install_error_handlers


@pytest.fixture(scope="module")
def buggy() -> Iterator[tuple[int, CollectorRegistry]]:
    """A server whose one route has a bug: what a route's unforeseen exception looks like outside."""
    registry = CollectorRegistry()
    errors = Counter("errors", "by status", ["status"], registry=registry)
    app = FastAPI()
    install_error_handlers(app, errors)

    @app.post("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    @app.get("/fine")
    async def fine() -> dict[str, int]:
        return {"fine": 1}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    yield port, registry
    server.should_exit = True
    thread.join(10)


def _response(conn: socket.socket) -> tuple[str, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = conn.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return status, headers, body


def test_a_bug_in_a_route_is_a_json_500_and_the_connection_stays_usable(buggy):
    """Starlette's last resort answered and re-raised, and uvicorn then closed the connection under
    a response that did not say so: the router's pooled client met a reset on its next request."""
    port, registry = buggy
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /bug HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
        status, headers, body = _response(conn)
        assert status == "HTTP/1.1 500 Internal Server Error" and headers.get("connection") != "close"
        assert json.loads(body) == {
            "error": {
                "message": "internal error: RuntimeError: a bug",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
        conn.sendall(b"GET /fine HTTP/1.1\r\nHost: t\r\n\r\n")  # the same connection
        status, _, body = _response(conn)
        assert status == "HTTP/1.1 200 OK" and json.loads(body) == {"fine": 1}
    assert registry.get_sample_value("errors_total", {"status": "500"}) == 1
