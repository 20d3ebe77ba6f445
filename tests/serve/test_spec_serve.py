"""A worker with speculative decoding on: same greedy text as without, acceptance in /metrics."""

from __future__ import annotations

import httpx

from asympd import LLM, SamplingParams
from asympd.serve.procs import stop_all
from tests.serve.cluster import start_all, worker
from tests.util import random_prompts


def test_spec_worker_matches_offline_and_reports_acceptance(tiny_ckpt, tmp_path):
    proc = worker("colocated", tiny_ckpt, "colocated", "colocated", tmp_path, "--num-spec-tokens", "3")
    (url,) = start_all([proc])
    try:
        offline = LLM(tiny_ckpt, mode="colocated")
        with httpx.Client(timeout=60) as c:
            for ids in random_prompts([4, 30], seed=61):
                want = offline.generate(
                    prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=6, temperature=0)
                )[0]
                r = c.post(
                    f"{url}/v1/completions",
                    json={
                        "model": tiny_ckpt,
                        "prompt": ids,
                        "max_tokens": 6,
                        "temperature": 0,
                        "return_token_ids": True,
                    },
                )
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want.outputs[0].text
            metrics = c.get(f"{url}/metrics").text
        assert "asympd_spec_decode_num_spec_tokens 3.0" in metrics
        assert "asympd_spec_decode_mean_accepted_length" in metrics
        assert "asympd_kv_blocks_used 0.0" in metrics
    finally:
        stop_all([proc])
