"""1P1D in mode symmetric over the TCP transport, every part a real process: P samples the first
token and hands it over with the prefix; greedy outputs through the router equal the offline
``LLM`` in the same mode, and the first token's logprobs survive the hop."""

from __future__ import annotations

import httpx
import pytest

from asympd.config import tiny
from asympd.engine import modes
from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.serve.procs import stop_all
from tests.serve.cluster import INTERNAL, router_proc, start_all, stream, wait_idle, wait_router, worker
from tests.util import random_prompts


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-sym-logs")
    p = worker("prefill", tiny_ckpt, "prefill", "symmetric", logs, "--transport", "tcp")
    d = worker("decode", tiny_ckpt, "decode", "symmetric", logs, "--transport", "tcp")
    p_url, d_url = start_all([p, d])
    r = router_proc("router", [p_url], [d_url], logs, "--mode", "symmetric", "--checkpoint", tiny_ckpt)
    try:
        (url,) = start_all([r])
        wait_router(url)
        yield {"router": url, "prefill": p_url, "decode": d_url}
    finally:
        stop_all([p, d, r])


def test_greedy_equals_offline_symmetric(cluster, tiny_ckpt):
    llm = LLM(tiny_ckpt, mode="symmetric")
    with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as client:
        for ids in random_prompts([6, 16, 25, 60], seed=7):
            want = (
                llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=5, temperature=0))[0]
                .outputs[0]
                .token_ids
            )
            body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
            r = client.post(f"{cluster['router']}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"][0]["token_ids"] == want, f"prompt of {len(ids)} tokens"
            assert got["asympd_timings"]["prefill_path"] == "remote"  # symmetric never skips P
            assert got["asympd_timings"]["transfer_bytes"] > 0
            s = stream(client, f"{cluster['router']}/v1/completions", body)
            assert s["done"] and s["token_ids"] == want

        # max_tokens=1: the only token is P's
        one = client.post(
            f"{cluster['router']}/v1/completions",
            json={"prompt": ids, "max_tokens": 1, "temperature": 0, "return_token_ids": True},
        ).json()
        assert one["choices"][0]["token_ids"] == want[:1] and one["choices"][0]["finish_reason"] == "length"

        lp = client.post(
            f"{cluster['router']}/v1/completions",
            json={"prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 1},
        ).json()
        logprobs = lp["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == 4 and all(x is not None for x in logprobs["token_logprobs"])
    wait_idle([cluster["prefill"], cluster["decode"]])


def test_n_is_refused_where_p_samples_the_first_token(cluster):
    """Every choice would begin with P's one first token: n > 1 is a 400 naming n, from the router
    (before P computes anything) and from each worker alike; n=1 is served."""
    assert {m for m in modes.PD_MODES if modes.decode_plan(tiny(), 40, m).first_token_from_prefill} == set(
        modes.FIRST_TOKEN_FROM_PREFILL
    )
    message = (
        "n=2 is not supported in mode symmetric: its prefill worker samples the first token, so every choice "
        "would begin with that same token (not 2 independent samples); send 2 requests, or deploy mode "
        "asymmetric or encoder-only"
    )
    body = {"prompt": random_prompts([30], seed=8)[0], "max_tokens": 2, "n": 2}
    for url, headers in (
        (cluster["router"], {}),
        (cluster["prefill"], INTERNAL),
        (cluster["decode"], INTERNAL),
    ):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"] == {
            "message": message, "type": "BadRequestError", "param": "n", "code": 400
        }, (url, r.text)  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
    r = httpx.post(f"{cluster['router']}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == message
    r = httpx.post(f"{cluster['router']}/v1/completions", json={**body, "n": 1}, timeout=30)
    assert r.status_code == 200, r.text
    wait_idle([cluster["prefill"], cluster["decode"]])
