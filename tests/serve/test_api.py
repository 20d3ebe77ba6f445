"""The OpenAI surface of one colocated worker process (with an API key): schemas, sampling options,
stop strings, logprobs, usage, errors, and a client leaving mid-stream."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.serve.http import INTERNAL_HEADER, internal_key, internal_token
from asympd.serve.procs import stop_all
from tests.serve.cluster import metrics, start_all, stream, wait_idle, worker
from tests.util import random_prompts

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url(tiny_ckpt, tmp_path_factory):
    proc = worker(
        "colocated",
        tiny_ckpt,
        "colocated",
        "colocated",
        tmp_path_factory.mktemp("api-logs"),
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny",
    )
    (u,) = start_all([proc])
    try:
        yield u
    finally:
        stop_all([proc])


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=httpx.Timeout(60, connect=5), headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(tiny_ckpt, mode="colocated")


def test_greedy_equals_offline_and_usage(url, client, offline):
    for ids in random_prompts([3, 20, 45], seed=5):
        want = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=5, temperature=0))[0]
        r = client.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
        c = body["choices"][0]
        assert c["token_ids"] == want.outputs[0].token_ids
        assert c["text"] == offline.tokenizer.decode(want.outputs[0].token_ids)
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": len(c["token_ids"]),
            "total_tokens": len(ids) + len(c["token_ids"]),
        }
        assert body["prompt_token_ids"] == ids and body["asympd_timings"]["prefill_path"] == "local"


def test_stream_matches_non_stream(url, client):
    body = {"prompt": "hello world the of", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    full = client.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    s = stream(client, f"{url}/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert s["done"] and not s["errors"]
    assert s["text"] == full["text"] and s["token_ids"] == full["token_ids"]
    assert s["usage"]["completion_tokens"] == len(full["token_ids"])
    assert s["events"][-1]["choices"] == []  # the usage chunk, as OpenAI sends it
    assert all(ev["object"] == "text_completion" for ev in s["events"])
    assert all("usage" not in ev for ev in s["events"][:-1])
    # vLLM's continuous_usage_stats: every chunk carries the usage so far, the last one the total
    options = {"include_usage": True, "continuous_usage_stats": True}
    c = stream(client, f"{url}/v1/completions", {**body, "stream_options": options})
    done = [ev["usage"]["completion_tokens"] for ev in c["events"]]
    assert c["token_ids"] == full["token_ids"] and done == sorted(done) and done[-1] == len(full["token_ids"])
    assert all(ev["usage"]["prompt_tokens"] == s["usage"]["prompt_tokens"] for ev in c["events"])
    assert [len(ev["choices"][0]["token_ids"]) for ev in c["events"][:-1]] == [
        b - a for a, b in zip([0, *done[:-2]], done[:-1], strict=True)
    ]  # each chunk's count includes its own tokens


def test_stop_strings_and_stop_token_ids(url, client):
    base = {"prompt": [7, 8, 9, 10], "max_tokens": 12, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    full = client.post(f"{url}/v1/completions", json=base).json()["choices"][0]
    text = full["text"]
    starts = [i for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2]]
    assert starts, text
    stop = text[starts[0] : starts[0] + 2]
    cut = text.index(stop)
    r = client.post(f"{url}/v1/completions", json={**base, "stop": [stop, "never-there"]}).json()["choices"][0]
    assert r["text"] == full["text"][:cut] and r["finish_reason"] == "stop" and r["stop_reason"] == stop
    r = client.post(f"{url}/v1/completions", json={**base, "stop": stop, "include_stop_str_in_output": True}).json()
    assert r["choices"][0]["text"] == full["text"][: cut + len(stop)]
    s = stream(client, f"{url}/v1/completions", {**base, "stop": [stop]})
    assert s["text"] == full["text"][:cut] and s["finish_reason"] == "stop"
    tok = full["token_ids"][3]
    r = client.post(f"{url}/v1/completions", json={**base, "stop_token_ids": [tok]}).json()["choices"][0]
    first = full["token_ids"].index(tok)
    assert r["token_ids"] == full["token_ids"][: first + 1] and r["finish_reason"] == "stop"
    assert r["stop_reason"] == tok
    wait_idle([url])


def test_seed_temperature_top_p_top_k(url, client):
    body = {
        "prompt": "hello",
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 1234,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    a = client.post(f"{url}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    b = client.post(f"{url}/v1/completions", json=body).json()["choices"][0]["token_ids"]
    c = client.post(f"{url}/v1/completions", json={**body, "seed": 99}).json()["choices"][0]["token_ids"]
    assert a == b and len(a) == 8
    assert a != c  # 8 tokens from a 512-token vocabulary: a collision is practically impossible


def test_logprobs(url, client):
    r = client.post(
        f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": 4, "temperature": 0, "logprobs": 3}
    ).json()["choices"][0]
    lp = r["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    for logprob, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen token is the most likely
    c = client.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()["choices"][0]
    content = c["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)


def test_chat_schema(url, client):
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ],
        "max_completion_tokens": 3,
        "temperature": 0,
    }
    r = client.post(f"{url}/v1/chat/completions", json=body).json()
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert r["choices"][0]["message"]["role"] == "assistant" and r["usage"]["completion_tokens"] <= 3
    s = stream(client, f"{url}/v1/chat/completions", body)
    assert s["done"] and all(ev["object"] == "chat.completion.chunk" for ev in s["events"])
    assert s["text"] == r["choices"][0]["message"]["content"]


def test_busy_seconds_on_a_cpu_are_the_step_seconds(url, client):
    """``asympd_engine_busy_seconds`` counts the GPU work a step leaves queued (asympd/serve/busy.py);
    on a CPU nothing is left queued, so it is the steps' own time."""
    r = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
    assert r.status_code == 200, r.text
    wait_idle([url])
    m = metrics(url)
    assert m["asympd_engine_step_seconds_sum"] > 0
    assert m["asympd_engine_busy_seconds_total"] == pytest.approx(m["asympd_engine_step_seconds_sum"], rel=1e-6)
    # nothing to compile or capture on a CPU: no serving step met a new shape
    assert m["asympd_engine_steps_new_shape_total"] == 0
    assert client.get(f"{url}/asympd/stats").json()["engine"]["new_shapes"] == {"steps": 0, "graphs": 0, "compiles": {}}


def test_models_health_metrics_need_no_key_but_v1_does(url, client):
    assert httpx.get(f"{url}/health").status_code == 200
    assert "asympd_kv_blocks_used" in httpx.get(f"{url}/metrics").text
    models = client.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["asympd"]["resident_bytes"] > 0
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            r = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": "hi"})
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["type"] == "AuthenticationError"


BAD = [
    ("completions", {"prompt": ""}, 400, "empty"),
    ("completions", {"prompt": []}, 400, "empty"),
    ("completions", {"prompt": [3] * 5000}, 400, "maximum context length"),
    ("completions", {"prompt": "hi", "max_tokens": 4095}, 400, "maximum context length"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "model": "other"}, 404, "does not exist"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n must be in [1, 16], got 17"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n must be in [1, 16], got 0"),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 2}, 400, "best_of=2 is not supported"),
    ("completions", {"prompt": ["a", "b"]}, 400, "batched"),
    ("completions", {"prompt": [1, 2, 99999]}, 400, "out of range"),
    ("completions", {"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": {"not": "a prompt"}}, 400, "prompt"),
    # vLLM extensions a client relies on are refused by name, not ignored (other unknown fields are)
    (
        "completions",
        {"prompt": "hi", "use_beam_search": True},
        400,
        "use_beam_search is not supported: this server has no beam search",
    ),
    (
        "completions",
        {"prompt": "hi", "guided_json": {"type": "object"}},
        400,
        "guided_json is not supported: this server has no guided decoding",
    ),
    (
        "completions",
        {"prompt": "hi", "response_format": {"type": "json_object"}},
        400,
        "response_format is for chat completions here",
    ),
    (
        "completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options is only allowed with stream: true",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "a+"}},
        400,
        "structured_outputs is not supported",
    ),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_calls"),
    ("chat/completions", {"messages": [{"role": "developer", "content": "x"}]}, 400, "role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "image_url.url"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "text as a string"),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "tools": [{"function": {"name": "f", "parameters": "{}"}}],
        },
        400,
        "tools[0]: function.parameters must be a JSON object (a JSON Schema)",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD)
def test_bad_requests(url, client, path, body, status, needle):
    r = client.post(f"{url}/v1/{path}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["code"] == status and err["type"].endswith("Error")


HI = [{"role": "user", "content": "hi"}]


def test_a_generation_config_sets_the_defaults_a_request_leaves_out(tiny_ckpt, tmp_path, offline):
    """``--generation-config FOLDER`` (vLLM's flag; ``auto``, the default, reads the checkpoint's):
    a request without temperature or max_tokens takes the file's (greedy, 3 tokens), its own win."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 3, "eos_token_id": 1}')
    proc = worker("gen-config", tiny_ckpt, "colocated", "colocated", tmp_path, "--generation-config", str(tmp_path))
    (u,) = start_all([proc])
    try:
        ids = random_prompts([30], seed=61)[0]
        want = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=5, temperature=0))
        want = want[0].outputs[0].token_ids
        with httpx.Client(timeout=60) as c:
            assert c.get(f"{u}/asympd/info").json()["sampling_defaults"] == {"temperature": 0.0, "max_tokens": 3}
            body = {"prompt": ids, "return_token_ids": True, "ignore_eos": True}
            r = c.post(f"{u}/v1/completions", json=body)
            assert r.json()["choices"][0]["token_ids"] == want[:3], r.text
            r = c.post(f"{u}/v1/completions", json={**body, "max_tokens": 5})
            assert r.json()["choices"][0]["token_ids"] == want
            r = c.post(f"{u}/v1/completions", json={**body, "temperature": 5.0, "seed": 1})
            assert r.json()["choices"][0]["token_ids"] != want[:3]  # hot, the request's own
    finally:
        stop_all([proc])
    # the offline LLM the same way (vLLM's LLM(generation_config=...)): generate without parameters
    llm = LLM(tiny_ckpt, mode="colocated", generation_config=str(tmp_path))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    assert llm.generate(prompt_token_ids=[ids])[0].outputs[0].token_ids == want[:3]
    assert offline.get_default_sampling_params() == SamplingParams()  # the tiny checkpoint's file sets none


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"reasoning_effort": "ultra"}}, "chat_template_kwargs"),
        ({"reasoning_effort": "ultra"}, "reasoning_effort"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ],
)
def test_a_chat_refusal_names_the_field_at_fault(url, client, extra, param):
    r = client.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_engine_s_refusals_name_the_field_at_fault(url, client):
    """The engine's own checks (ids against the vocabulary) name the field too (they had param null)."""
    for extra, param, message in (
        ({"prompt": [1, 99999]}, "prompt", "prompt token ids out of range [0, 512): [99999]"),
        (
            {"prompt": "hi", "stop_token_ids": [99999]},
            "stop_token_ids",
            "stop_token_ids out of range [0, 512): [99999]",
        ),
        (
            {"prompt": "hi", "logit_bias": {"99999": 1}},
            "logit_bias",
            "logit_bias token ids out of range [0, 512): [99999]",
        ),
    ):
        r = client.post(f"{url}/v1/completions", json={"max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": message, "type": "BadRequestError", "param": param, "code": 400
        }, r.text  # fmt: skip


def test_tokenize_gives_the_ids_a_request_runs_with(url, client):
    """vLLM's /tokenize and /detokenize: a completion's prompt and a chat's messages tokenize to the
    prompt ids the server then runs (``prompt_token_ids``, usage), and back to text."""
    for kind, part in (("completions", {"prompt": "hello world, tokens"}), ("chat/completions", {"messages": HI})):
        tok = client.post(f"{url}/tokenize", json={**part, "return_token_strs": True}).json()
        ran = client.post(f"{url}/v1/{kind}", json={**part, "max_tokens": 1, "return_token_ids": True}).json()
        assert tok["tokens"] == ran["prompt_token_ids"] and tok["count"] == ran["usage"]["prompt_tokens"], (tok, ran)
        assert tok["max_model_len"] == 4096 and len(tok["token_strs"]) == tok["count"]
        text = client.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
        assert client.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"] == tok["tokens"]
    assert client.post(f"{url}/tokenize", json={"prompt": "x", "model": "tiny"}).status_code == 200
    for path, body, status, message in (
        ("tokenize", {}, 400, "give either prompt (a completion's) or messages (a chat's)"),
        (
            "tokenize",
            {"prompt": "x", "messages": HI},
            400,
            "give either prompt (a completion's) or messages (a chat's)",
        ),
        ("tokenize", {"prompt": [1, 2]}, 400, "prompt must be text (token ids are their own count)"),
        ("tokenize", {"prompt": "x", "model": "other"}, 404, "The model `other` does not exist."),
        ("detokenize", {"tokens": [1, 99999]}, 400, "token ids out of range [0, 512): [99999]"),
        ("detokenize", {"tokens": "1 2"}, 400, "tokens must be a list of token ids"),
    ):
        r = client.post(f"{url}/{path}", json=body)
        assert r.status_code == status and r.json()["error"]["message"] == message, (path, body, r.text)
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401  # the API key holds here too


def test_malformed_bodies_and_unknown_paths(url, client):
    for raw in (b"{", b'"just a string"', b"", b"\xff\xfe"):
        r = client.post(f"{url}/v1/completions", content=raw)
        assert r.status_code == 400 and "error" in r.json(), r.text
    r = client.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.get(f"{url}/asympd/steps", params={"since": "yesterday"})  # a query parameter of the wrong type
    assert r.status_code == 400 and r.json()["error"]["param"] == "since", r.text
    assert httpx.get(f"{url}/health").status_code == 200  # still serving


def test_a_lone_surrogate_is_a_400_naming_the_field(url, client):
    """JSON can escape a lone surrogate, which no UTF-8 tokenizer takes (it was a 500)."""
    for path, raw, field, char in (
        ("completions", r'{"prompt": "x\ud800y"}', "prompt", "D800"),
        ("chat/completions", r'{"messages": [{"role": "user", "content": "\udc00"}]}', "messages", "DC00"),
    ):
        r = client.post(f"{url}/v1/{path}", content=raw.encode(), headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field, r.text
        assert err["message"] == f"{field}: a lone surrogate (U+{char}) is not valid Unicode", err


def test_client_leaving_a_stream_frees_its_blocks(url, client):
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "ignore_eos": True, "temperature": 0}
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    wait_idle([url], timeout=10)  # 3000 tokens would take far longer than this
    assert metrics(url)["asympd_generation_tokens_total"] < 3000


def test_abort_endpoint(url, client):
    internal = {INTERNAL_HEADER: internal_token(internal_key())}  # abort is internal (the router's)
    r = client.post(f"{url}/asympd/abort", json={"request_id": "nope"}, headers=internal)
    assert r.status_code == 200 and r.json()["aborted"]
    assert httpx.post(f"{url}/asympd/abort", json={"request_id": "x"}).status_code == 403
    assert client.post(f"{url}/asympd/abort", json={"request_id": "x"}).status_code == 403  # the client key
    assert client.post(f"{url}/asympd/abort", json={}, headers=internal).status_code == 400


def test_step_log_endpoint(url, client):
    """``GET /asympd/steps?since=T``: the worker's steps from wall time T (bench/e2e.py's co-run)."""
    import time

    wait_idle([url], timeout=10)
    t0 = time.time()
    r = client.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    steps = httpx.get(f"{url}/asympd/steps", params={"since": t0}).json()["steps"]
    assert [(s[2], s[3]) for s in steps][:2] == [(4, 0), (0, 1)] and len(steps) == 2
    assert all(s[0] >= t0 and s[1] > 0 for s in steps)
    # the seconds to the step's GPU end: on a CPU nothing is left queued, so the host's seconds
    assert all(len(s) == 5 and s[4] == pytest.approx(s[1], abs=1e-9) for s in steps)
    assert httpx.get(f"{url}/asympd/steps", params={"since": time.time() + 60}).json() == {"steps": []}


def by_index(events: list[dict]) -> dict[int, dict]:
    """A stream's chunks folded per choice index: text (or content), token ids, finish reason."""
    out: dict[int, dict] = {}
    for ev in events:
        for c in ev["choices"]:
            got = out.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None})
            got["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            got["token_ids"] += c.get("token_ids") or []
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
    return out


def test_n_greedy_choices_equal_offline_and_usage_sums(url, client, offline):
    """OpenAI's n: greedy gives n equal choices, each the offline engine's tokens; the prompt is
    counted once in the usage, the choices' tokens summed."""
    ids = random_prompts([20], seed=71)[0]
    want = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=5, temperature=0))
    want = want[0].outputs[0].token_ids
    body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True, "n": 3, "logprobs": 1}
    r = client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == want and c["text"] == offline.tokenizer.decode(want) for c in got["choices"])
    assert all(len(c["logprobs"]["token_logprobs"]) == 5 for c in got["choices"])
    assert len({str(c["logprobs"]) for c in got["choices"]}) == 1  # greedy: the same logprobs too
    total = 3 * len(want)
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": total, "total_tokens": len(ids) + total}
    assert got["prompt_token_ids"] == ids


def test_n_seeded_choices_are_single_requests_seeded_seed_plus_index(url, client):
    """Choice i of a seeded request draws with seed + i (vLLM's): the same tokens as a request of
    n=1 with that seed; streamed, the chunks carry their choice's index and fold into the same
    choices, then one usage chunk."""
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 1.0, "seed": 41, "return_token_ids": True}
    body["ignore_eos"] = True
    singles = [client.post(f"{url}/v1/completions", json={**body, "seed": s}).json()["choices"][0] for s in (41, 42)]
    assert singles[0]["token_ids"] != singles[1]["token_ids"]
    r = client.post(f"{url}/v1/completions", json={**body, "n": 2}).json()
    for c, single in zip(r["choices"], singles, strict=True):
        assert (c["text"], c["token_ids"], c["finish_reason"]) == (
            single["text"], single["token_ids"], single["finish_reason"]
        )  # fmt: skip
    s = stream(client, f"{url}/v1/completions", {**body, "n": 2, "stream_options": {"include_usage": True}})
    assert s["done"] and not s["errors"]
    per = by_index(s["events"])
    assert sorted(per) == [0, 1]
    order = [c["index"] for ev in s["events"] for c in ev["choices"]]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # interleaved, as the tokens come
    for i, c in enumerate(r["choices"]):
        assert per[i] == {"text": c["text"], "token_ids": c["token_ids"], "finish_reason": c["finish_reason"]}
    assert s["events"][-1]["choices"] == [] and s["events"][-1]["usage"] == r["usage"]
    assert r["usage"]["completion_tokens"] == 12
    # chat: one role chunk per choice, then the content deltas of each
    chat = {"messages": HI, "max_tokens": 4, "temperature": 1.0, "seed": 5, "n": 2, "ignore_eos": True}
    whole = client.post(f"{url}/v1/chat/completions", json=chat).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    s = stream(client, f"{url}/v1/chat/completions", chat)
    roles = [ev["choices"][0]["index"] for ev in s["events"] if "role" in ev["choices"][0]["delta"]]
    assert roles == [0, 1]
    per = by_index(s["events"])
    assert [per[i]["text"] for i in (0, 1)] == [c["message"]["content"] for c in whole["choices"]]
    wait_idle([url])


def test_client_leaving_an_n_stream_aborts_every_choice(url, client):
    before = metrics(url)["asympd_generation_tokens_total"]
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "ignore_eos": True, "temperature": 0, "n": 2}
    seen = set()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if seen == {0, 1}:
                break
    wait_idle([url], timeout=10)  # 2 x 3000 tokens would take far longer than this
    assert metrics(url)["asympd_generation_tokens_total"] - before < 1000
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        client.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    wait_idle([url], timeout=10)
    assert metrics(url)["asympd_generation_tokens_total"] - before < 2000


def test_a_client_s_request_id_is_made_unique_on_a_worker(url, client):
    """A worker reached directly (no router) ran a request under the client's X-Request-Id as it came:
    a second request under an id still running (two clients' ids, or a retry after a client
    timeout whose abort had not landed yet) was a 400 "already in use". Now it is made unique, as
    the router makes it."""
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "same"}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator would close the stream (and abort the request)
        first = next(line for line in lines if line.startswith("data: {"))
        again = client.post(f"{url}/v1/completions", json={**body, "max_tokens": 2, "stream": False}, headers=headers)
        assert again.status_code == 200, again.text
        nxt = next(line for line in lines if line.startswith("data: "))
        assert nxt.startswith('data: {"id": "same-'), nxt  # the first request still runs
    ids = {json.loads(first[6:])["id"], again.json()["id"]}
    assert len(ids) == 2 and all(i.startswith("same-") for i in ids), ids
    assert again.headers["x-request-id"] == again.json()["id"]
    wait_idle([url], timeout=10)


def test_a_client_leaving_halfway_through_its_body_is_no_500(url):
    """The body's read met the client's disconnect: Starlette's ClientDisconnect reached the last
    resort, which logged a traceback and counted a 500, for a client that left."""
    import socket

    before = metrics(url).get('asympd_request_errors_total{status="500"}', 0)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            s.sendall(f"{head}Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            s.sendall(body[:10])  # and leaves
    time.sleep(0.5)  # the server meets the disconnect
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text  # still serving
    assert metrics(url).get('asympd_request_errors_total{status="500"}', 0) == before
