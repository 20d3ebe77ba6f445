"""Failure paths, with real worker processes (TCP data plane) and routers in threads:

* a prefill worker whose transfer endpoint hangs (a socket that never answers), or that the router
  reports as failed: ``recompute`` completes the request on D, ``fail`` answers 503;
* P stopped (SIGSTOP) while requests are routed to it, then resumed: recompute / 503, then P is
  used again once it passes /health;
* P killed (SIGKILL) with requests in flight: every request still completes (recomputed on D where
  P had not handed it over) with the tokens of the offline engine;
* D killed mid-stream: the client gets an error event, not a hang;
* afterwards no surviving worker holds a KV block.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.serve.procs import stop_all
from asympd.serve.router import Router, RouterConfig, build_router_app
from tests.serve.cluster import (
    ThreadServer,
    metrics,
    read_sse,
    start_all,
    stream,
    wait_for,
    wait_idle,
    wait_router,
    worker,
)
from tests.util import random_prompts

TRANSFER_TIMEOUT = 1.5
PREFILL_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("failure-logs")
    tcp = ("--transport", "tcp", "--transfer-timeout", str(TRANSFER_TIMEOUT))
    p = worker("prefill", tiny_ckpt, "prefill", "asymmetric", logs, *tcp, "--transfer-ttl", "5")
    d_rec = worker("decode-recompute", tiny_ckpt, "decode", "asymmetric", logs, *tcp)
    d_fail = worker("decode-fail", tiny_ckpt, "decode", "asymmetric", logs, *tcp, "--on-prefill-failure", "fail")
    procs = [p, d_rec, d_fail]
    p_url, rec_url, fail_url = start_all(procs)
    routers = []
    try:
        for d_url in (rec_url, fail_url):
            cfg = RouterConfig(
                prefill=[p_url],
                decode=[d_url],
                health_interval=0.3,
                connect_timeout=1.0,
                prefill_timeout=PREFILL_TIMEOUT,
                stream_idle_timeout=20,
            )
            routers.append(ThreadServer(build_router_app(Router(cfg))).start())
        for r in routers:
            wait_router(r.url)
        yield {
            "p": p,
            "prefill": p_url,
            "recompute": rec_url,
            "fail": fail_url,
            "d_fail": d_fail,
            "router_recompute": routers[0].url,
            "router_fail": routers[1].url,
        }
    finally:
        for r in routers:
            r.stop()
        stop_all(procs)


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(tiny_ckpt, mode="asymmetric")


@pytest.fixture(scope="module")
def client():
    from tests.serve.cluster import INTERNAL  # the test plays the router: it sends kv_transfer_params

    with httpx.Client(timeout=httpx.Timeout(60, connect=5), headers=INTERNAL) as c:
        yield c


@pytest.fixture
def silent_port():
    """A 'prefill worker' whose transfer endpoint accepts connections and never answers."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
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
    t.join(2)
    for c in conns:
        c.close()
    srv.close()


def _greedy(llm: LLM, ids: list[int], n: int) -> list[int]:
    return (
        llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=n, temperature=0))[0]
        .outputs[0]
        .token_ids
    )


def test_no_prefill_work_while_no_decode_worker_is_healthy(cluster):
    """With every D down the router refuses at once (503): P computed the prefix first and then
    saw it dropped (the soak's kill runs: ~160 wasted prefills while the only D was down)."""
    with socket.socket() as s:  # a decode worker that is not there
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    router = Router(RouterConfig(prefill=[cluster["prefill"]], decode=[dead], health_interval=0.2, connect_timeout=1.0))
    srv = ThreadServer(build_router_app(router)).start()
    try:
        wait_for(lambda: router.prefill[0].healthy and router.decode[0].checked, 10, "the router's first checks")
        before = metrics(cluster["prefill"])["asympd_prompt_tokens_total"]
        body = {"prompt": random_prompts([60], seed=3)[0], "max_tokens": 2}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"] == "no healthy decode worker", r.text
        assert metrics(cluster["prefill"])["asympd_prompt_tokens_total"] == before
    finally:
        srv.stop()


def test_hung_transfer_endpoint(cluster, client, offline, silent_port):
    ids = random_prompts([40], seed=11)[0]
    kv = {
        "do_remote_prefill": True,
        "transport": "tcp",
        "host": "127.0.0.1",
        "port": silent_port,
        "transfer_id": "never-answered",
    }
    body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True, "kv_transfer_params": kv}
    t0 = time.monotonic()
    r = client.post(f"{cluster['recompute']}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["asympd_timings"]["prefill_path"] == "recompute"
    assert "timed out" in out["asympd_timings"]["fallback_reason"]
    assert out["choices"][0]["token_ids"] == _greedy(offline, ids, 5)
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT + 10

    r = client.post(f"{cluster['fail']}/v1/completions", json=body)
    assert r.status_code == 503
    msg = r.json()["error"]["message"]
    assert "--on-prefill-failure=fail" in msg and "timed out" in msg


def test_router_reported_prefill_failure(cluster, client, offline):
    ids = random_prompts([30], seed=12)[0]
    body = {
        "prompt": ids,
        "max_tokens": 3,
        "temperature": 0,
        "return_token_ids": True,
        "kv_transfer_params": {"do_remote_prefill": True, "prefill_failed": "P is gone"},
    }
    r = client.post(f"{cluster['recompute']}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    timings = r.json()["asympd_timings"]
    assert timings["prefill_path"] == "recompute" and "P is gone" in timings["fallback_reason"]
    assert r.json()["choices"][0]["token_ids"] == _greedy(offline, ids, 3)
    r = client.post(f"{cluster['fail']}/v1/completions", json=body)
    assert r.status_code == 503 and "P is gone" in r.json()["error"]["message"]


def _post_many(url: str, prompts: list[list[int]], n: int = 4) -> list[httpx.Response]:
    def one(ids: list[int]) -> httpx.Response:
        return httpx.post(
            f"{url}/v1/completions",
            timeout=60,
            json={"prompt": ids, "max_tokens": n, "temperature": 0, "return_token_ids": True},
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_stopped_prefill_worker_then_resumed(cluster, client, offline):
    url_rec, url_fail = cluster["router_recompute"], cluster["router_fail"]
    ids = random_prompts([35], seed=13)[0]
    ok = client.post(f"{url_rec}/v1/completions", json={"prompt": ids, "max_tokens": 2}).json()
    assert ok["asympd_timings"]["prefill_path"] == "remote"

    cluster["p"].signal(signal.SIGSTOP)
    try:
        prompts = random_prompts([30, 45, 60], seed=14)
        with ThreadPoolExecutor(2) as pool:
            fut_rec = pool.submit(_post_many, url_rec, prompts)
            fut_fail = pool.submit(_post_many, url_fail, prompts[:1])
            rec, fail = fut_rec.result(timeout=60), fut_fail.result(timeout=60)
        for ids, r in zip(prompts, rec, strict=True):
            assert r.status_code == 200, r.text
            assert r.json()["asympd_timings"]["prefill_path"] == "recompute"
            assert r.json()["choices"][0]["token_ids"] == _greedy(offline, ids, 4)
        assert fail[0].status_code == 503 and "prefill" in fail[0].json()["error"]["message"]
        health = client.get(f"{url_rec}/health").json()
        assert [w["healthy"] for w in health["workers"] if w["kind"] == "prefill"] == [False]
    finally:
        cluster["p"].signal(signal.SIGCONT)

    wait_router(url_rec)  # P passes /health again: it gets traffic again
    again = client.post(f"{url_rec}/v1/completions", json={"prompt": ids, "max_tokens": 2}).json()
    assert again["asympd_timings"]["prefill_path"] == "remote"
    # what the stopped P accepted was aborted by the router, or expires (--transfer-ttl 5)
    wait_idle([cluster["prefill"], cluster["recompute"], cluster["fail"]], timeout=20)


def test_killed_prefill_worker_mid_flight(cluster, offline):
    url = cluster["router_recompute"]
    prompts = random_prompts([40 + 5 * i for i in range(8)], seed=15)

    def one(ids: list[int]) -> dict:
        with httpx.Client(timeout=60) as c:
            return stream(
                c, f"{url}/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
            )

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, ids) for ids in prompts]
        wait_for(
            lambda: httpx.get(f"{cluster['prefill']}/asympd/stats", timeout=2).json()["engine"]["steps"] > 0,
            20,
            "P started working",
        )
        cluster["p"].signal(signal.SIGKILL)
        results = [f.result(timeout=60) for f in futures]
    assert not cluster["p"].alive()
    paths = [res["timings"]["prefill_path"] for res in results]
    for ids, res in zip(prompts, results, strict=True):
        assert res["done"] and not res["errors"], res
        # whichever path a request took, D (batched with the others) decodes what one engine does alone
        assert res["token_ids"] == _greedy(offline, ids, 4)
        if res["timings"]["prefill_path"] == "recompute":
            assert res["timings"]["fallback_reason"], res["timings"]
    # P died with work in flight: what it had not handed over, D recomputed
    assert set(paths) <= {"remote", "recompute"} and "recompute" in paths, paths
    # with P gone for good: recompute keeps serving, fail refuses (prompt > W needs P)
    long_prompt = {"prompt": prompts[0], "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=long_prompt, timeout=30)
    assert r.status_code == 200 and r.json()["asympd_timings"]["prefill_path"] == "recompute", r.text
    assert r.json()["choices"][0]["token_ids"] == _greedy(offline, prompts[0], 2)
    r = httpx.post(f"{cluster['router_fail']}/v1/completions", json=long_prompt, timeout=30)
    assert r.status_code == 503, r.text
    wait_idle([cluster["recompute"], cluster["fail"]])


def test_decode_worker_dying_mid_stream(cluster):
    """A prompt within the window needs no P (asymmetric): D serves it; kill D mid-stream."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
    lines: list[str] = []
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{cluster['router_fail']}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                cluster["d_fail"].signal(signal.SIGKILL)
    events, done = read_sse(lines)
    assert done and "error" in events[-1], events[-3:]
    assert events[-1]["error"]["code"] == 502 and "mid-stream" in events[-1]["error"]["message"]
    with httpx.Client(timeout=30) as c:  # then the router stops routing to it
        wait_for(lambda: c.get(f"{cluster['router_fail']}/health").status_code == 503, 10, "router sees D dead")
        r = c.post(f"{cluster['router_fail']}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503 and "no healthy decode worker" in r.json()["error"]["message"]
