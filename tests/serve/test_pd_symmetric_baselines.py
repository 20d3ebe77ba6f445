"""The strongest symmetric baselines served for real: P, D and the router as processes in mode
symmetric-split (D replays the last W rows) and symmetric-windows (P ships the windows, D replays
nothing). Greedy outputs through the router equal the offline ``LLM`` in the same mode, P always
runs (no N <= W skip) and the windows make the handover larger."""

from __future__ import annotations

import httpx
import pytest

from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from tests.serve.cluster import one_p_one_d, wait_idle
from tests.util import random_prompts

PROMPTS = random_prompts([6, 16, 40], seed=8)


@pytest.fixture(scope="module", params=["symmetric-split", "symmetric-windows"])
def cluster(request, tiny_ckpt, tmp_path_factory):
    mode = request.param
    with one_p_one_d(tiny_ckpt, tmp_path_factory.mktemp(f"{mode}-logs"), mode, "--transport", "tcp") as c:
        yield {**c, "mode": mode}


def test_greedy_equals_offline(cluster, tiny_ckpt):
    llm = LLM(tiny_ckpt, mode=cluster["mode"])
    params = SamplingParams(max_tokens=5, temperature=0)
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]
    with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as client:
        for ids, w in zip(PROMPTS, want, strict=True):
            body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
            r = client.post(f"{cluster['router']}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"][0]["token_ids"] == w, f"{cluster['mode']}: prompt of {len(ids)} tokens"
            timings = got["asympd_timings"]
            assert timings["prefill_path"] == "remote"  # the symmetric modes never skip P
            assert timings["transfer_bytes"] > 0
    wait_idle([cluster["prefill"], cluster["decode"]])
