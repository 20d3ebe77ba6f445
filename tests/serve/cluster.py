"""Helpers for the serving tests: workers and routers as real processes (or a router in a thread),
SSE reading, Prometheus scraping, bounded waits. Not a test module."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from asympd.serve.http import INTERNAL_HEADER, internal_key, internal_token
from asympd.serve.procs import ServerProcess, stop_all

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# what the router sends workers: tests that play the router (kv_transfer_params, abort) send it too
INTERNAL = {INTERNAL_HEADER: internal_token(internal_key())}


def worker(name: str, ckpt: str, role: str, mode: str, log_dir: Any, *extra: str) -> ServerProcess:
    args = [
        "serve",
        "--role",
        role,
        "--mode",
        mode,
        "--checkpoint",
        ckpt,
        "--port",
        "0",
        "--threads",
        "1",
        "--log-level",
        "warning",
        *extra,
    ]
    return ServerProcess(name, args, log_dir, ENV)


def router_proc(name: str, prefill: list[str], decode: list[str], log_dir: Any, *extra: str) -> ServerProcess:
    args = ["router", "--decode", *decode, "--port", "0", "--log-level", "warning", "--health-interval", "0.3", *extra]
    if prefill:
        args += ["--prefill", *prefill]
    return ServerProcess(name, args, log_dir, ENV)


def start_all(procs: list[ServerProcess], timeout: float = 90.0) -> list[str]:
    """Start every process at once (they load in parallel), then wait for each; on failure stop all."""
    try:
        for p in procs:
            p.start()
        return [p.wait_ready(timeout) for p in procs]
    except BaseException:
        stop_all(procs)
        raise


@contextlib.contextmanager
def one_p_one_d(ckpt: str, log_dir: Any, mode: str = "asymmetric", *worker_args: str) -> Iterator[dict[str, Any]]:
    """A prefill worker, a decode worker and a router as real processes (stopped on exit):
    {"router", "prefill", "decode": URLs, "procs": the processes}."""
    p = worker("prefill", ckpt, "prefill", mode, log_dir, *worker_args)
    d = worker("decode", ckpt, "decode", mode, log_dir, *worker_args)
    p_url, d_url = start_all([p, d])
    r = router_proc("router", [p_url], [d_url], log_dir)
    procs = [p, d, r]
    try:
        (url,) = start_all([r])
        wait_router(url)
        yield {"router": url, "prefill": p_url, "decode": d_url, "procs": procs}
    finally:
        stop_all(procs)


class ThreadServer:
    """A FastAPI app on uvicorn in a daemon thread (routers: no engine, so no reason for a process)."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        import uvicorn

        from asympd.serve.api_server import bind_socket

        self.sock = bind_socket(host, 0)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)

    def start(self, timeout: float = 20.0) -> ThreadServer:
        self.thread.start()
        wait_for(lambda: self.server.started, timeout, "in-thread server start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            last = cond()
        except (httpx.HTTPError, OSError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    raise TimeoutError(f"{what}: not true after {timeout} s (last: {last!r})")


def wait_router(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """Until the router sees every worker healthy (and has the tokenizer)."""

    def ok() -> dict[str, Any] | None:
        body = httpx.get(f"{url}/health", timeout=2).json()
        return body if body.get("all_healthy") and body.get("tokenizer") else None

    return wait_for(ok, timeout, f"router {url} healthy")


def metrics(url: str) -> dict[str, float]:
    """``name{k="v",...}`` -> value for every sample of ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def idle(url: str) -> bool:
    m = metrics(url)
    return (
        m.get("asympd_kv_blocks_used") == 0
        and m.get("asympd_num_requests_held_for_transfer") == 0
        and m.get("asympd_num_requests_running") == 0
        and m.get("asympd_num_requests_waiting") == 0
    )


def wait_idle(urls: list[str], timeout: float = 15.0) -> None:
    """Every worker holds no block and no request (what is left after all requests ended)."""
    for u in urls:
        wait_for(lambda u=u: idle(u), timeout, f"worker {u} idle (no KV blocks held)")


def read_sse(lines: Any) -> tuple[list[dict[str, Any]], bool]:
    """Parsed ``data:`` events and whether the stream ended with ``[DONE]``."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        events.append(json.loads(line[6:]))
    return events, done


def stream(client: httpx.Client, url: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """POST a streaming request; the events folded into one result (text, token ids, timings)."""
    with client.stream("POST", url, json={**body, "stream": True}, **kw) as r:
        assert r.status_code == 200, r.read()
        events, done = read_sse(r.iter_lines())
    return fold(events, done)


def fold(events: list[dict[str, Any]], done: bool) -> dict[str, Any]:
    text, toks, finish, timings, usage, errors = [], [], None, None, None, []
    for ev in events:
        if "error" in ev:
            errors.append(ev["error"])
            continue
        for c in ev["choices"]:
            text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
            toks += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
        timings = ev.get("asympd_timings") or timings
        usage = ev.get("usage") or usage
    return {
        "text": "".join(text),
        "token_ids": toks,
        "finish_reason": finish,
        "timings": timings,
        "usage": usage,
        "errors": errors,
        "done": done,
        "events": events,
    }
