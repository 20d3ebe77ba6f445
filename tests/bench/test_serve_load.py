"""``asympd bench serve`` against a real tiny 1P1D deployment (prefill worker, decode worker and router
as processes): the result carries vLLM's field names, the metrics are consistent with each other and
the token counts equal what the servers report; the statistics and arrival processes exactly."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from asympd.bench.serve_load import (
    BenchError,
    BenchRequest,
    RequestResult,
    Slo,
    arrival_offsets,
    random_requests,
    sample_lengths,
    summarize,
)
from asympd.cli import main
from tests.serve.cluster import metrics, one_p_one_d, wait_idle

# the fields `vllm bench serve --save-result` writes that a study reads
VLLM_FIELDS = [
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p99")]


# ---- against a deployment -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    with one_p_one_d(tiny_ckpt, tmp_path_factory.mktemp("bench-serve-logs")) as c:
        yield c


def _bench(tmp_path, url: str, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", url, "--result-file", str(out), "--disable-tqdm", *extra])
    return rc, json.loads(out.read_text())


def test_poisson_load_through_router(cluster, tiny_ckpt, tmp_path, capsys):
    before = metrics(cluster["decode"])["asympd_generation_tokens_total"]
    args = ["--tokenizer", tiny_ckpt, "--num-prompts", "6", "--random-input-len", "24"]
    args += ["--random-output-len", "4", "--random-range-ratio", "0.5", "--request-rate", "20", "--seed", "3"]
    args += ["--goodput", "ttft:60000", "itl:60000", "--plot", str(tmp_path / "lat.png")]
    rc, res = _bench(tmp_path, cluster["router"], *args)
    assert rc == 0, res["errors"]
    assert [k for k in VLLM_FIELDS if k not in res] == []
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert res["completed"] == 6 and res["failed"] == 0 and res["errors"] == [""] * 6
    assert res["model_id"] == tiny_ckpt and res["request_rate"] == 20.0
    assert res["machine"]["cpu_count"] >= 1 and res["command"].startswith("asympd bench serve --base-url")
    # the prompts sent are exactly the dataset's; the server's usage agrees with their lengths
    expected = random_requests(6, 24, 4, 512, ratio=0.5, skip_ids=range(5), seed=3)  # 0-4: special
    assert res["input_lens"] == [r.prompt_len for r in expected]
    assert sum(res["input_lens"]) == res["total_input_tokens"]
    # output tokens: usage as reported, never more than asked, and equal to what D generated
    assert all(1 <= n <= r.output_len for n, r in zip(res["output_lens"], expected, strict=True))
    assert sum(res["output_lens"]) == res["total_output_tokens"]
    wait_idle([cluster["prefill"], cluster["decode"]])
    generated = metrics(cluster["decode"])["asympd_generation_tokens_total"] - before
    assert generated == res["total_output_tokens"] + res["output_lens"][0]  # the test request: request 0 again
    # latencies: TTFT <= E2EL, TTFT + sum(ITL) <= E2EL, aggregates from the per-request lists
    for ttft, itl, e2el in zip(res["ttfts"], res["itls"], res["e2els"], strict=True):
        assert 0 < ttft <= e2el and ttft + sum(itl) <= e2el + 1e-9
    assert res["mean_ttft_ms"] == pytest.approx(np.mean(res["ttfts"]) * 1000)
    assert res["p99_e2el_ms"] == pytest.approx(np.percentile(res["e2els"], 99) * 1000)
    assert res["mean_ttft_ms"] <= res["mean_e2el_ms"]
    assert res["request_goodput"] == pytest.approx(6 / res["duration"])  # a loose SLO: every request
    assert res["request_throughput"] == pytest.approx(6 / res["duration"])
    assert (tmp_path / "lat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the server's TTFT split per request (P's compute and round trip, the fetch, D's first step), and
    # the wall-clock zero of start_times, to line requests up with the workers' step logs
    # (prompts within D's window go "local": D computes them whole, nothing crosses)
    paths = [t["prefill_path"] for t in res["asympd_timings"]]
    assert "remote" in paths and set(paths) <= {"remote", "local"}
    for t, ttft in zip(res["asympd_timings"], res["ttfts"], strict=True):
        assert 0 < t["decode_first_step_s"] < ttft
        if t["prefill_path"] == "remote":
            assert 0 < t["prefill_s"] <= t["prefill_rtt_s"] < ttft and 0 <= t["publish_s"] and 0 < t["transfer_s"]
    assert abs(res["start_wall"] - time.time()) < 120


def test_fixed_concurrency_ignore_eos_and_tight_slo(cluster, tiny_ckpt, tmp_path):
    args = ["--vocab-size", "512", "--num-prompts", "4", "--random-input-len", "20", "--random-output-len", "5"]
    args += ["--max-concurrency", "2", "--ignore-eos", "--goodput", "ttft:0", "--endpoint", "/v1/completions"]
    rc, res = _bench(tmp_path, cluster["router"], *args)
    assert rc == 0, res["errors"]
    assert res["output_lens"] == [5, 5, 5, 5] and res["total_output_tokens"] == 20
    assert res["max_concurrency"] == 2 and res["request_rate"] == "inf"
    assert res["request_goodput"] == 0.0  # no request has a TTFT of 0 ms
    assert all(len(itl) >= 1 for itl in res["itls"])
    tpot = [(e - t) / 4 * 1000 for t, e in zip(res["ttfts"], res["e2els"], strict=True)]
    assert res["mean_tpot_ms"] == pytest.approx(np.mean(tpot))


def test_chat_endpoint(cluster, tiny_ckpt, tmp_path):
    args = ["--tokenizer", tiny_ckpt, "--num-prompts", "2", "--random-input-len", "12"]
    args += ["--random-output-len", "3", "--endpoint", "/v1/chat/completions", "--ignore-eos"]
    rc, res = _bench(tmp_path, cluster["router"], *args)
    assert rc == 0, res["errors"]
    assert res["backend"] == "openai-chat" and res["output_lens"] == [3, 3]
    assert all(n > 12 for n in res["input_lens"])  # the server's count: the chat template adds tokens
    assert all(0 < t <= e for t, e in zip(res["ttfts"], res["e2els"], strict=True))


def test_server_errors_are_recorded(cluster, tmp_path, capsys):
    """A request the server refuses mid-run is recorded with its message (exit 1); one it refuses
    before the run, the test request (as vllm bench serve sends), stops it there (exit 2)."""
    args = ["--vocab-size", "512", "--num-prompts", "3", "--random-input-len", "20", "--random-output-len", "2"]
    args += ["--random-len-dist", "lognormal", "--random-range-ratio", "3", "--seed", "119"]  # 2, 4347, 2 tokens
    rc, res = _bench(tmp_path, cluster["router"], *args)
    assert rc == 1 and res["completed"] == 2 and res["failed"] == 1
    assert res["errors"][0] == res["errors"][2] == "" and res["errors"][1].startswith("HTTP 400"), res["errors"]
    assert "maximum context length" in res["errors"][1]
    capsys.readouterr()
    # a model name the server does not serve: the test request fails with the server's message
    out = tmp_path / "none.json"
    argv = ["bench", "serve", "--base-url", cluster["router"], "--result-file", str(out), "--disable-tqdm"]
    assert main([*argv, *args, "--model", "no-such-model"]) == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith(f"error: the test request to {cluster['router']}/v1/completions failed, so the run was not "
                          "started: HTTP 404") and "no-such-model" in err, err  # fmt: skip
    # --no-test-request (bench/e2e.py's: a run's server work is the schedule's alone): every request fails
    rc, res = _bench(tmp_path, cluster["router"], *args, "--model", "no-such-model", "--no-test-request")
    assert rc == 1 and res["failed"] == 3
    assert all(e.startswith("HTTP 404") and "no-such-model" in e for e in res["errors"]), res["errors"]
    wait_idle([cluster["prefill"], cluster["decode"]])


def test_bad_arguments_exit_2(capsys):
    cases = [
        (["--goodput", "latency:5"], "--goodput takes METRIC:MS with METRIC one of ttft, tpot, itl, e2el"),
        (["--goodput", "ttft:fast"], "'fast' is not a number of milliseconds"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path and --tokenizer"),
        ([], "random prompts need --vocab-size or --tokenizer"),
        (["--vocab-size", "9", "--base-url", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
        (
            ["--vocab-size", "9", "--base-url", "http://127.0.0.1:9", "--model", "m"],
            "the test request to http://127.0.0.1:9",
        ),
    ]
    for extra, message in cases:
        assert main(["bench", "serve", "--disable-tqdm", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err, (extra, err)


# ---- datasets, arrivals, statistics ----------------------------------------------------------------------------


def test_uniform_lengths_cover_the_range_exactly():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 4000, 10, "uniform", 0.3)
    assert set(lens) == set(range(7, 14))
    assert sample_lengths(rng, 5, 10, "uniform", 0.0) == [10] * 5
    with pytest.raises(BenchError, match=r"must be in \[0, 1\)"):
        sample_lengths(rng, 1, 10, "uniform", 1.0)


def test_lognormal_lengths_have_the_median():
    lens = sample_lengths(np.random.default_rng(1), 20001, 100, "lognormal", 0.8)
    assert min(lens) >= 1 and abs(np.median(lens) - 100) <= 3 and max(lens) > 500


def test_random_requests_are_reproducible_and_skip_special_ids():
    a = random_requests(3, 6, 2, 10, prefix_len=2, skip_ids=[0, 1, 2], seed=5)
    assert a == random_requests(3, 6, 2, 10, prefix_len=2, skip_ids=[0, 1, 2], seed=5)
    assert [r.prompt_len for r in a] == [8, 8, 8] and [r.output_len for r in a] == [2, 2, 2]
    assert all(3 <= t < 10 for r in a for t in r.prompt)
    assert a[0].prompt[:2] == a[1].prompt[:2] == a[2].prompt[:2]  # the shared prefix


def test_arrivals_poisson_and_gamma():
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    for burstiness in (1.0, 0.25, 4.0):
        t = np.asarray(arrival_offsets(40001, 10.0, burstiness, seed=7))
        gaps = np.diff(t)
        assert t[0] == 0.0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(0.1, rel=0.03)  # the rate
        # a gamma of shape k has coefficient of variation 1/sqrt(k): Poisson 1, burstier more
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert arrival_offsets(5, 2.0, seed=1) == arrival_offsets(5, 2.0, seed=1) != arrival_offsets(5, 2.0, seed=2)
    with pytest.raises(BenchError, match="--burstiness must be > 0"):
        arrival_offsets(2, 1.0, 0.0)


def _res(ttft, itl, tokens, prompt=10, ok=True):
    latency = ttft + sum(itl)
    return RequestResult(prompt, ok, tokens, ttft, list(itl), latency, error="" if ok else "boom")


def test_summary_exact_values():
    results = [
        _res(0.1, [0.02, 0.04], 3),  # e2el 0.16, tpot 0.03
        _res(0.3, [0.01], 2, prompt=20),  # e2el 0.31, tpot 0.01
        _res(0.2, [], 1),  # one token: no tpot
        _res(9.0, [1.0], 2, ok=False),  # failed: left out
    ]
    s = summarize(results, 2.0, [50, 90], Slo.parse(["ttft:250", "itl:30"]))
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 23.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p90_ttft_ms"] == pytest.approx(280.0)  # linear between 200 and 300
    assert s["mean_tpot_ms"] == pytest.approx(20.0) and s["p50_tpot_ms"] == pytest.approx(20.0)
    assert s["mean_itl_ms"] == pytest.approx(70 / 3) and s["median_itl_ms"] == pytest.approx(20.0)
    assert s["mean_e2el_ms"] == pytest.approx((160 + 310 + 200) / 3)
    # goodput: request 1 breaks the ITL bound (40 ms), request 2 the TTFT bound; only request 3 is good
    assert s["request_goodput"] == 0.5
    assert summarize(results, 2.0)["request_goodput"] is None
    # all three start at 0 and end within the first second: 6 chunks, 3 requests in flight there
    assert s["max_output_tokens_per_s"] == 6.0 and s["max_concurrent_requests"] == 3


def test_goodput_tpot_and_e2el_bounds():
    r = _res(0.1, [0.02, 0.04], 3)
    assert Slo.parse(["tpot:30", "e2el:160"]).met(r)
    assert not Slo.parse(["tpot:29.9"]).met(r)
    assert not Slo.parse(["e2el:159"]).met(r)


def test_chat_needs_text():
    from asympd.bench.serve_load import request_body

    with pytest.raises(BenchError, match="chat endpoint takes text prompts"):
        request_body(BenchRequest([1, 2], 2, 1), "m", True, {})


def _sharegpt_file(tmp_path) -> str:
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "tell me a story about a cat"}]},  # one turn
        {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
    ]
    for i in range(4):
        q = f"question number {i}: why is the sky blue in the afternoon"
        convs.append({"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": q * 2}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return str(path)


def test_sharegpt_requests(tiny_ckpt, tmp_path):
    from asympd.bench.serve_load import load_tokenizer, sharegpt_requests

    tok = load_tokenizer(tiny_ckpt)
    path = _sharegpt_file(tmp_path)
    reqs = sharegpt_requests(path, 4, tok, seed=0)
    assert sorted(r.prompt[16] for r in reqs) == ["0", "1", "2", "3"]  # the short and one-turn ones skipped
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False).ids)
        assert r.output_len == len(tok.encode(r.prompt * 2, add_special_tokens=False).ids)
    assert [r.prompt for r in sharegpt_requests(path, 4, tok, seed=0)] == [r.prompt for r in reqs]
    assert [r.output_len for r in sharegpt_requests(path, 2, tok, output_len=7)] == [7, 7]
    with pytest.raises(BenchError, match="has 4 usable conversations, --num-prompts asks for 5"):
        sharegpt_requests(path, 5, tok)


def test_sharegpt_through_router(cluster, tiny_ckpt, tmp_path):
    args = ["--tokenizer", tiny_ckpt, "--dataset-name", "sharegpt", "--dataset-path", _sharegpt_file(tmp_path)]
    args += ["--num-prompts", "3", "--sharegpt-output-len", "4", "--ignore-eos", "--request-rate", "50"]
    rc, res = _bench(tmp_path, cluster["router"], *args)
    assert rc == 0, res["errors"]
    assert res["dataset_name"] == "sharegpt" and res["output_lens"] == [4, 4, 4]
    # the server counts the prompt text as the tokenizer encodes it
    from asympd.bench.serve_load import load_tokenizer, sharegpt_requests

    sent = sharegpt_requests(args[5], 3, load_tokenizer(tiny_ckpt), output_len=4)
    assert res["input_lens"] == [r.prompt_len for r in sent]


def _sse_client(events: list[str]):
    import httpx

    body = "".join(f"data: {e}\n\n" for e in events).encode()
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200, content=body)))


def _send(events: list[str], chat: bool) -> RequestResult:
    import asyncio

    from asympd.bench.serve_load import send_request

    async def go():
        async with _sse_client(events) as client:
            return await send_request(client, "http://x/v1/chat/completions", {}, 7, chat)

    return asyncio.run(go())


def test_stream_parsing_chat_opener_usage_and_errors():
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    a = json.dumps({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    b = json.dumps({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]})
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    r = _send([role, a, b, usage, "[DONE]"], chat=True)
    assert r.success and r.text == "Hello" and len(r.itl) == 1  # the role-only opener is not the first token
    assert (r.prompt_len, r.output_tokens, r.usage_reported) == (9, 3, True)
    assert 0 < r.ttft <= r.latency
    r = _send([a, json.dumps({"error": {"message": "engine died", "code": 500}}), "[DONE]"], chat=True)
    assert not r.success and r.error == "engine died"
    r = _send(["[1, 2]"], chat=False)
    assert not r.success and r.error == "not a JSON object in the stream: [1, 2]"
    r = _send(["[DONE]"], chat=False)
    assert not r.success and r.error == "the stream ended without output"
    r = _send([json.dumps({"choices": [{"text": "x"}]}), json.dumps({"choices": [{"text": "y"}]})], chat=False)
    assert r.success and r.output_tokens == 2 and not r.usage_reported  # no usage: one token per chunk


def test_the_module_loads_without_torch():
    """serve_load imports nothing from asympd or torch: it runs standalone on a client machine."""
    import subprocess
    import sys

    from asympd.bench import serve_load

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('standalone', {serve_load.__file__!r})\n"
        "m = sys.modules['standalone'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.arrival_offsets(3, float('inf')) == [0.0, 0.0, 0.0]\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
