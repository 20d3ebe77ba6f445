"""2P1D in mode encoder-only, workers and router in threads of this process (TCP data plane), the
router behind an API key: load spreads over both prefill workers, greedy outputs equal the offline
``LLM`` in the same mode, and nothing stays allocated."""

from __future__ import annotations

import httpx
import pytest

from asympd.engine.engine import EngineConfig
from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.serve.api_server import ServeConfig, WorkerServer, build_app
from asympd.serve.router import Router, RouterConfig, build_router_app
from tests.serve.cluster import ThreadServer, metrics, stream, wait_idle, wait_router
from tests.util import random_prompts

KEY = "router-key"


@pytest.fixture(scope="module")
def cluster(tiny_ckpt):
    started: list[ThreadServer] = []
    try:
        urls = {}
        for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d", "decode")):
            ws = WorkerServer(
                ServeConfig(
                    checkpoint=tiny_ckpt,
                    engine=EngineConfig(role=role, mode="encoder-only"),
                    transport="tcp",
                    port=0,
                    served_model_name="tiny",
                )
            )
            ts = ThreadServer(build_app(ws))
            ws.port = int(ts.url.rsplit(":", 1)[1])
            started.append(ts.start())
            urls[name] = ts.url
        router = Router(
            RouterConfig(prefill=[urls["p1"], urls["p2"]], decode=[urls["d"]], api_key=KEY, health_interval=0.3)
        )
        rs = ThreadServer(build_router_app(router)).start()
        started.append(rs)
        wait_router(rs.url)
        yield {**urls, "router": rs.url}
    finally:
        for ts in reversed(started):
            ts.stop()


def test_api_key_on_the_router(cluster):
    body = {"prompt": "hello", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.post(f"{cluster['router']}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{cluster['router']}/v1/models", timeout=5).status_code == 401
    assert httpx.get(f"{cluster['router']}/health", timeout=5).status_code == 200  # probes need no key
    r = httpx.post(
        f"{cluster['router']}/v1/completions", json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200, r.text


def test_two_prefill_workers_share_the_load_and_match_offline(cluster, tiny_ckpt):
    llm = LLM(tiny_ckpt, mode="encoder-only")
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        for i, ids in enumerate(random_prompts([5, 16, 30, 50, 33, 21], seed=21)):
            want = (
                llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=4, temperature=0))[0]
                .outputs[0]
                .token_ids
            )
            body = {"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
            if i % 2:
                got = stream(c, f"{cluster['router']}/v1/completions", body)["token_ids"]
            else:
                r = c.post(f"{cluster['router']}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["asympd_timings"]["prefill_path"] == "remote"  # encoder-only never skips P
                got = r.json()["choices"][0]["token_ids"]
            assert got == want, f"prompt of {len(ids)} tokens"
    counts = [metrics(cluster[p])["asympd_prefill_compute_seconds_count"] for p in ("p1", "p2")]
    assert all(n >= 1 for n in counts) and sum(counts) >= 6, counts
    wait_idle([cluster["p1"], cluster["p2"], cluster["d"]])
