"""HTTP plumbing the workers and the router share: credentials, body limits, disconnect handling,
error bodies, binding. Imports no torch, so the router stays a light process.

Two trust domains (docs/serving.md, "security model"):

* the **client key** guards the public API (``/v1/*``); clients know it.
* the **internal key** is the deployment's secret: the router sends it to the workers
  (``X-Asympd-Internal``), it opens the internal parameters and routes (``kv_transfer_params``,
  ``/asympd/abort``, ``/asympd/info``), and it signs the data plane (transfer ops and every
  ``PrefixState``). Clients never see it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from asympd.serve import protocol as P

log = logging.getLogger("asympd.serve")

INTERNAL_HEADER = "x-asympd-internal"
API_KEY_ENV = "ASYMPD_API_KEY"
INTERNAL_KEY_ENV = "ASYMPD_INTERNAL_KEY"
DEFAULT_MAX_BODY_BYTES = 4 << 20


def listen_url(host: str, port: int) -> str:
    """The URL a server bound to ``host`` prints (procs.py connects to it): an empty host binds
    every interface, written 0.0.0.0 as vLLM does (``http://:PORT`` was no URL); IPv6 in brackets."""
    host = host or "0.0.0.0"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def check_body_limit(max_body_bytes: int) -> None:
    """A request body limit a server can run with (serve and router share it)."""
    if max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {max_body_bytes}")


def default_internal_key_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asympd" / "internal.key"


def _read_key(path: str | Path, what: str) -> str:
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the {what} from {path}: {e}") from None
    if not key:
        raise ValueError(f"the {what} file {path} is empty")
    return key


def client_key(key: str | None = None, key_file: str | None = None) -> str | None:
    """The client API key: ``key`` (argv, visible in ``ps``), else ``key_file``, else $ASYMPD_API_KEY;
    None means the public API is open."""
    if key is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        return _read_key(key_file, "API key")
    if key:
        log.warning(
            "the API key was given on the command line, where `ps` shows it: prefer a key file or $%s", API_KEY_ENV
        )
        return key
    return os.environ.get(API_KEY_ENV) or None


def internal_key(key_file: str | None = None) -> bytes:
    """The deployment secret: ``key_file``, else $ASYMPD_INTERNAL_KEY, else a per-user file
    (created with 32 random bytes and mode 0600 on first use), which every process of one user on
    one host shares: a localhost deployment needs no setup and other users cannot read it."""
    if key_file is not None:
        return _read_key(key_file, "internal key").encode()
    env = os.environ.get(INTERNAL_KEY_ENV)
    if env:
        return env.encode()
    path = default_internal_key_file()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # atomic; the first process to get here wins, the others read its key
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return _read_key(path, "internal key").encode()


def internal_token(secret: bytes) -> str:
    """What the router sends in ``X-Asympd-Internal``: derived, so the raw secret never travels."""
    return hmac.new(secret, b"asympd-internal-http", hashlib.sha256).hexdigest()


def has_internal(request: Request, secret: bytes) -> bool:
    given = request.headers.get(INTERNAL_HEADER, "")
    return bool(given) and secrets.compare_digest(given.encode(), internal_token(secret).encode())


def require_internal(request: Request, secret: bytes, what: str) -> None:
    if not has_internal(request, secret):
        raise P.APIError(f"{what} is internal: it needs the deployment's internal credential", 403)


def check_bearer(request: Request, key: str) -> None:
    """``Authorization: Bearer <key>`` or a 401."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise P.APIError("Unauthorized: a valid API key is required (Authorization: Bearer <key>)", 401)


def client_request_id(request: Request) -> str | None:
    """The client's ``X-Request-Id``, or a 400 where it is not printable ASCII (the router sends it
    on to the workers as a header, where nothing else can travel)."""
    rid = request.headers.get("x-request-id")
    if rid and not (rid.isascii() and rid.isprintable()):
        raise P.APIError("X-Request-Id must be printable ASCII", param="X-Request-Id")
    return rid or None


def unique_request_id(request: Request, kind: str) -> str:
    """The id a client's request runs under: its ``X-Request-Id`` made unique (``ID-`` and 8 hex
    digits), so that two clients' ids never collide and a retry under the same id never meets the
    earlier request, still running or aborted; a new id where there is none."""
    rid = client_request_id(request)
    return f"{rid}-{uuid.uuid4().hex[:8]}" if rid else P.new_id(kind)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (by Content-Length before
    reading anything, else while streaming it in): an oversized body is never held whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise P.APIError(f"the request body ({int(declared)} bytes) exceeds the limit of {limit} bytes", 413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise P.APIError(f"the request body exceeds the limit of {limit} bytes", 413)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left halfway through its body: nobody to answer, nothing to log
        raise ClientDisconnected() from None
    return b"".join(chunks)


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it: its cleanup aborts the
    engine request). Non-streaming handlers need this; Starlette only watches streaming ones."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    raise ClientDisconnected()


class GuardedStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs ``on_close``, even when the client left before the
    body generator ever started (then the generator's own ``finally`` never runs)."""

    def __init__(self, content: AsyncIterator[Any], on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def install_error_handlers(app: FastAPI, metrics_errors: Any = None) -> None:
    """OpenAI-style JSON for every refusal, including Starlette's own 404/405."""

    @app.exception_handler(P.APIError)
    async def _api_error(_: Request, e: P.APIError) -> JSONResponse:
        if metrics_errors is not None:
            metrics_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, e: ClientDisconnected) -> JSONResponse:
        return P.error_response("client disconnected", 499)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return P.error_response(str(e.detail), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _query(_: Request, e: RequestValidationError) -> JSONResponse:  # a query parameter's type
        err = (e.errors() or [{}])[0]
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "query")
        return P.error_response(f"{where}: {err.get('msg', 'invalid')}", 400, param=where or None)

    app.add_middleware(_InternalErrors, metrics_errors=metrics_errors)


class _InternalErrors:
    """The last resort for a bug in a route: log it and answer 500 in the API's JSON, keeping the
    connection. Starlette's own last resort answers and then re-raises, and uvicorn then closes the
    connection under a response that did not say so: a pooled client (the router's) that sent its
    next request on it met an empty read or a reset."""

    def __init__(self, app: Any, metrics_errors: Any = None) -> None:
        self.app = app
        self.metrics_errors = metrics_errors

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            if started:  # a response under way (a stream): all that is left is to cut it
                raise
            log.exception("unhandled error")
            if self.metrics_errors is not None:
                self.metrics_errors.labels("500").inc()
            await P.error_response(f"internal error: {type(e).__name__}: {e}", 500)(scope, receive, send)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied call is noise


class BindError(ValueError):
    """The address to listen on cannot be had (in use, not this host's, out of range)."""


def check_port(port: int, flag: str = "port") -> None:
    """A port one can listen on (``serve`` checks its two before loading the model)."""
    if not 0 <= port <= 65535:
        raise BindError(f"{flag} {port} is out of range: ports are 0-65535 (0: a free one)")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so port 0 gives an ephemeral port we can print."""
    check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run_app(app: FastAPI, sock: socket.socket, log_level: str = "info") -> None:
    import uvicorn

    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, timeout_graceful_shutdown=5, timeout_keep_alive=30
    )
    uvicorn.Server(config).run(sockets=[sock])
