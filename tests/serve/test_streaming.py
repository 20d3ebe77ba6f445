"""``asympd serve --role prefill --stream-prefix`` through real processes: P answers the router at
once and pushes the prefix by chunk while it computes, D imports each slice as it arrives. The tokens
equal those of a P that hands the state over whole (same decode worker), for completions, SSE and
chat; D reports the slices; a stream none of which can be read is computed on D (recompute) and
leaves no block held anywhere."""

from __future__ import annotations

import httpx
import pytest

from asympd.serve.procs import stop_all
from tests.serve.cluster import INTERNAL, router_proc, start_all, stream, wait_idle, wait_router, worker
from tests.util import random_prompts

W, CHUNK = 16, 16  # the tiny preset's window; P's prefill chunk (--max-num-batched-tokens)
# N <= W (the router skips P), split 1 (one slice), 29 (odd: the open pair), 74 and 184 (many slices)
LENGTHS = [5, W + 1, 45, 90, 200]


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("stream-logs")
    chunk = ["--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "4"]
    p_stream = worker("p-stream", tiny_ckpt, "prefill", "asymmetric", logs, "--stream-prefix", *chunk)
    p_whole = worker("p-whole", tiny_ckpt, "prefill", "asymmetric", logs, *chunk)
    d = worker("d", tiny_ckpt, "decode", "asymmetric", logs)
    d_fail = worker("d-fail", tiny_ckpt, "decode", "asymmetric", logs, "--on-prefill-failure", "fail")
    procs = [p_stream, p_whole, d, d_fail]
    try:
        ups, upw, ud, udf = start_all(procs)
        routers = [router_proc(f"router-{n}", [u], [ud], logs) for n, u in (("stream", ups), ("whole", upw))]
        procs += routers
        rs, rw = start_all(routers)
        wait_router(rs)
        wait_router(rw)
        urls = {"p_stream": ups, "p_whole": upw, "decode": ud, "decode_fail": udf}
        yield {"stream": rs, "whole": rw, **urls, "logs": logs}
    finally:
        stop_all(procs)


def test_streamed_tokens_equal_whole_handover(cluster):
    for ids in random_prompts(LENGTHS, seed=43):
        body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
        got = {k: httpx.post(f"{cluster[k]}/v1/completions", json=body, timeout=60).json() for k in ("stream", "whole")}
        s, w = got["stream"], got["whole"]
        assert s["choices"][0]["token_ids"] == w["choices"][0]["token_ids"], len(ids)
        assert len(s["choices"][0]["token_ids"]) == 5
        t = s["asympd_timings"]
        if len(ids) <= W:
            assert t["prefill_path"] == "local"
            continue
        split = len(ids) - W
        assert t["prefill_path"] == "remote-stream"
        assert t["stream_slices"] == -(-split // CHUNK)  # one slice per prefill chunk
        # the same packed global KV crossed, in slices (each with its own header and open pair)
        assert t["transfer_bytes"] >= w["asympd_timings"]["transfer_bytes"] - 8 * len(ids)
        if split >= 8 * CHUNK:  # P answered the router before computing, D pulled while P computed
            assert t["prefill_rtt_s"] < t["transfer_s"], t
    wait_idle([cluster["p_stream"], cluster["decode"]])


def test_streamed_sse_and_chat_equal_whole(cluster):
    ids = random_prompts([120], seed=44)[0]
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    with httpx.Client(timeout=60) as c:
        s, w = (stream(c, f"{cluster[k]}/v1/completions", body) for k in ("stream", "whole"))
        assert s["token_ids"] == w["token_ids"] and len(s["token_ids"]) == 6 and s["done"]
        assert s["timings"]["prefill_path"] == "remote-stream"
        chat = {"messages": [{"role": "user", "content": "stream the prefix " * 12}], "max_tokens": 4}
        chat["temperature"] = 0
        a, b = (c.post(f"{cluster[k]}/v1/chat/completions", json=chat).json() for k in ("stream", "whole"))
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
    wait_idle([cluster["p_stream"], cluster["decode"]])


def test_a_stream_that_never_came_is_computed_here(cluster):
    """D given a streamed transfer it cannot read from the start (P never opened it, dropped it or
    died before D's first pull): nothing of the prefix is in D's blocks, so D computes it itself
    (``--on-prefill-failure recompute``), the tokens the real stream gives. It was a 500 naming the
    stream: a prefill worker killed mid-traffic cost the requests it streamed (tools/soak.py)."""
    ids = random_prompts([60], seed=45)[0]
    r = httpx.post(
        f"{cluster['p_stream']}/v1/completions",
        json={"prompt": ids, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}},
        headers=INTERNAL,
        timeout=30,
    )
    kv = r.json()["kv_transfer_params"]
    assert kv["stream"] is True and kv["split"] == 60 - W
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "return_token_ids": True}

    def decode(params):
        return httpx.post(
            f"{cluster['decode']}/v1/completions",
            json={**body, "kv_transfer_params": params},
            headers=INTERNAL,
            timeout=30,
        )

    here = decode({**kv, "transfer_id": "xfer-" + "0" * 32})
    assert here.status_code == 200, here.text
    t = here.json()["asympd_timings"]
    assert t["prefill_path"] == "recompute" and "unknown streamed transfer id" in t["fallback_reason"]
    streamed = decode(kv)  # the real stream, twice: the second is a replay
    assert streamed.status_code == 200, streamed.text
    assert streamed.json()["asympd_timings"]["prefill_path"] == "remote-stream"
    assert streamed.json()["choices"][0]["token_ids"] == here.json()["choices"][0]["token_ids"]
    r = decode(kv)
    assert r.status_code == 400 and "already used" in r.json()["error"]["message"]
    wait_idle([cluster["p_stream"], cluster["decode"]])


def _open_stream(cluster, ids: list[int]) -> dict:
    r = httpx.post(
        f"{cluster['p_stream']}/v1/completions",
        json={"prompt": ids, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}},
        headers=INTERNAL,
        timeout=30,
    )
    return r.json()["kv_transfer_params"]


def test_a_failed_stream_is_a_503_under_fail_and_another_prompts_stream_a_400(cluster):
    """As for a whole state (``handoff.receive``): a prefill path that failed is a 503 on a decode
    worker that runs ``--on-prefill-failure fail`` (it was a 500), and a stream made for another
    prompt is a 400 under either policy, never computed here instead."""
    ids = random_prompts([60], seed=47)[0]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0}

    def decode(url: str, params: dict, prompt: list[int] = ids) -> httpx.Response:
        json = {**body, "prompt": prompt, "kv_transfer_params": params}
        return httpx.post(f"{cluster[url]}/v1/completions", json=json, headers=INTERNAL, timeout=30)

    kv = _open_stream(cluster, ids)
    r = decode("decode_fail", {**kv, "transfer_id": "xfer-" + "0" * 32})
    assert r.status_code == 503, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("the prefill path failed and this decode worker runs --on-prefill-failure=fail: ")
    assert "unknown streamed transfer id" in msg
    other = [ids[0] % 100 + 3, *ids[1:]]  # one token changed: another prompt of the same length
    for url in ("decode", "decode_fail"):
        r = decode(url, _open_stream(cluster, ids), prompt=other)
        assert r.status_code == 400, r.text
        assert "made for a different prompt" in r.json()["error"]["message"]
    assert decode("decode_fail", kv).status_code == 200  # the stream itself was fine
    wait_idle([cluster["p_stream"], cluster["decode"], cluster["decode_fail"]])


def test_n_choices_through_a_streaming_prefill_worker_equal_whole(cluster):
    """n > 1 takes the whole state even from a --stream-prefix P (D's n requests import one state),
    but P's engine still sliced the prefix, and the server handed D only the last slice: a prompt of
    more than one prefill chunk was a 400 "made for a different prompt"."""
    ids = random_prompts([90], seed=46)[0]  # split 74: five chunks of 16
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "n": 2, "return_token_ids": True}
    got = {k: httpx.post(f"{cluster[k]}/v1/completions", json=body, timeout=60) for k in ("stream", "whole")}
    assert got["stream"].status_code == 200, got["stream"].text
    s, w = got["stream"].json(), got["whole"].json()
    assert [c["token_ids"] for c in s["choices"]] == [c["token_ids"] for c in w["choices"]]
    assert s["asympd_timings"]["prefill_path"] == "remote" and s["usage"]["completion_tokens"] == 8
    wait_idle([cluster["p_stream"], cluster["decode"]])


def test_an_image_through_a_streaming_prefill_worker_is_seen(cluster):
    """A --stream-prefix P answered early without the request's images, and D queued the streamed
    request without them: the image parts were ignored (two different images, the same tokens)."""
    from tests.serve.test_vision_serve import data_url, png

    outs = {}
    for seed in (1, 2):
        content = [
            {"type": "text", "text": "Compare these two pictures of the harbour at dawn, please."},
            {"type": "image_url", "image_url": {"url": data_url(png(16, 16, seed=seed))}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": data_url(png(40, 24, seed=seed + 10))}},
            {"type": "text", "text": "ok"},
        ]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
        body["return_token_ids"] = True
        got = {k: httpx.post(f"{cluster[k]}/v1/chat/completions", json=body, timeout=60) for k in ("stream", "whole")}
        assert got["stream"].status_code == 200, got["stream"].text
        s, w = got["stream"].json(), got["whole"].json()
        assert s["asympd_timings"]["prefill_path"] == "remote-stream"
        assert s["choices"][0]["token_ids"] == w["choices"][0]["token_ids"], seed
        outs[seed] = s["choices"][0]["token_ids"]
    assert outs[1] != outs[2]
    wait_idle([cluster["p_stream"], cluster["decode"]])


def test_clients_leaving_streamed_requests_do_not_stall_the_decode_worker(cluster):
    """A client leaving while D waited for a slice P had not pushed: P dropped the stream, but the
    reader on P's data plane waited out its 120 s for that slice, holding one of D's 16 fetch
    threads. Twenty such clients stalled every later request with a remote prefix for two minutes."""
    import asyncio

    prompts = random_prompts([200] * 20, seed=47)

    async def leave(c: httpx.AsyncClient, ids: list[int]) -> None:
        body = {"prompt": ids, "max_tokens": 4, "stream": True}
        async with c.stream("POST", f"{cluster['stream']}/v1/completions", json=body) as r:
            assert r.status_code == 200  # D answered: its pull of the slices has started; the client leaves

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            await asyncio.gather(*(leave(c, ids) for ids in prompts))

    asyncio.run(main())
    ids = random_prompts([90], seed=48)[0]
    for n in (1, 2):  # a streamed prefix, and a whole one (n > 1): both fetched on D's fetch threads
        body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "n": n}
        r = httpx.post(f"{cluster['stream']}/v1/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
    wait_idle([cluster["p_stream"], cluster["decode"]])
    # a slice pushed after its stream was dropped is a warning, not a traceback
    assert "Traceback" not in (cluster["logs"] / "p-stream.log").read_text()
