"""1P1D in mode asymmetric, every part a real process on loopback: prefill worker, decode worker,
router. Greedy outputs through the router equal the offline ``LLM``; 64 concurrent streams finish;
bad requests get OpenAI-style 4xx; a client leaving frees every block."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from asympd.engine.llm import LLM, load_tokenizer
from asympd.engine.sampling import SamplingParams
from asympd.serve.chat_format import ChatStreamParser, encode_messages
from tests.serve.cluster import fold, metrics, one_p_one_d, read_sse, stream, wait_idle
from tests.util import random_prompts

MAX_TOKENS = 6
# W = 16 in the tiny config: within the window (P skipped), at it, odd and even splits (carry), long
LENGTHS = [5, 16, 17, 30, 41, 90]


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    # warmed as on a GPU (``--warm-up``; a CPU skips it by default): every test here then also
    # checks that the warm-up's throwaway prompts leave what the servers serve unchanged
    with one_p_one_d(tiny_ckpt, tmp_path_factory.mktemp("pd-asym-logs"), "asymmetric", "--warm-up") as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(tiny_ckpt, mode="asymmetric")


@pytest.fixture(scope="module")
def client():
    from tests.serve.cluster import INTERNAL  # the test plays the router: it sends kv_transfer_params

    with httpx.Client(timeout=httpx.Timeout(60, connect=5), headers=INTERNAL) as c:
        yield c


def _greedy(llm: LLM, ids: list[int], n: int = MAX_TOKENS) -> list[int]:
    return (
        llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=n, temperature=0))[0]
        .outputs[0]
        .token_ids
    )


def test_greedy_completions_equal_offline(cluster, offline, client):
    prompts = random_prompts(LENGTHS, seed=1)
    for ids in prompts:
        r = client.post(
            f"{cluster['router']}/v1/completions",
            json={"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert choice["token_ids"] == _greedy(offline, ids), f"prompt of {len(ids)} tokens"
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": len(choice["token_ids"]),
            "total_tokens": len(ids) + len(choice["token_ids"]),
        }
        t = body["asympd_timings"]
        if len(ids) <= 16:  # P has nothing to do: the router skips it
            assert t["prefill_path"] == "local"
        else:
            assert t["prefill_path"] == "remote"
            assert t["transfer_bytes"] > 0 and t["transfer_s"] > 0 and t["prefill_s"] > 0
            assert 0 <= t["prefill_queue_s"] < t["prefill_s"], t  # P's wait for its first step, inside it
            assert 0 <= t["decode_queue_s"] < t["decode_first_step_s"], t  # and D's
            # D's fetch split into its parts (tools/ttft_breakdown.py), each inside the whole
            split = [t["transfer_arrive_s"], t["transfer_unpack_s"], t["transfer_check_s"]]
            assert all(x > 0 for x in split) and sum(split) < t["transfer_s"], t
            # P's wait for its prefix's copy off the device, inside its answer
            assert 0 <= t["export_s"] < t["prefill_rtt_s"] - t["prefill_s"] - t["publish_s"], t
            assert t["export_copy_s"] is None  # timed on a GPU only (a CPU copies as it exports)
            # what crossed is the packed FP4 global KV: far below its fp32 size in P's cache (for a prefix
            # long enough that the KV, not the token ids and the open pair, dominates)
            cfg, s = offline.cfg, len(ids) - 16
            unpacked = sum((s // cfg.ratio(k)) * (cfg.head_dim + cfg.index_head_dim) * 4 for k in cfg.kv_source_layers)
            if s >= 64:
                assert t["transfer_bytes"] < unpacked / 3, (len(ids), t["transfer_bytes"], unpacked)
            assert t["decode_first_step_s"] > 0 and t["ttft_s"] >= t["decode_first_step_s"]
    m = metrics(cluster["router"])
    assert m["asympd_router_prefill_skipped_total"] >= 2


def test_text_prompt_chat_and_stream_equal_offline(cluster, offline, client, tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    prompt = "hello world the of and to in is it that was for on are with as be at by this have from"
    ids = tok.encode(prompt).ids
    want = _greedy(offline, ids)
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    r = client.post(f"{cluster['router']}/v1/completions", json=body).json()
    assert r["choices"][0]["token_ids"] == want
    assert r["choices"][0]["text"] == offline.tokenizer.decode(want)
    s = stream(client, f"{cluster['router']}/v1/completions", body)
    assert s["done"] and not s["errors"] and s["token_ids"] == want
    assert s["text"] == r["choices"][0]["text"] and s["finish_reason"] == "length"
    assert s["timings"]["prefill_path"] == "remote"

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    chat_ids = tok.encode(encode_messages(messages)).ids  # thinking mode, the default
    want = _greedy(offline, chat_ids)
    c = client.post(
        f"{cluster['router']}/v1/chat/completions",
        json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True},
    ).json()
    assert c["object"] == "chat.completion" and c["choices"][0]["token_ids"] == want
    parser = ChatStreamParser(thinking=True, tools=False)
    head, tail = parser.feed(offline.tokenizer.decode(want)), parser.finish()
    assert c["choices"][0]["message"]["content"] == head.content + tail.content
    assert c["choices"][0]["message"]["reasoning"] == head.reasoning + tail.reasoning
    assert c["usage"]["prompt_tokens"] == len(chat_ids)
    s = stream(
        client,
        f"{cluster['router']}/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert s["done"] and s["token_ids"] == want and s["usage"]["completion_tokens"] == len(want)
    assert s["events"][0]["choices"][0]["delta"]["role"] == "assistant"


def test_64_concurrent_streams_complete(cluster):
    prompts = random_prompts([4 + (7 * i) % 60 for i in range(64)], seed=2)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> dict:
        body = {
            "prompt": ids,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        async with client.stream("POST", f"{cluster['router']}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
        return fold(*read_sse(lines))

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5), limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), 150)

    results = asyncio.run(run())
    assert len(results) == 64
    for res in results:
        assert res["done"] and not res["errors"], res
        assert len(res["token_ids"]) == 4 and res["finish_reason"] == "length"
    wait_idle([cluster["prefill"], cluster["decode"]])


BAD = [
    ("empty prompt", {"prompt": ""}, 400, "empty"),
    ("empty token ids", {"prompt": []}, 400, "empty"),
    ("prompt over max_seq_len", {"prompt": [5] * 4100}, 400, "maximum context length"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("unknown model", {"prompt": "hi", "model": "gpt-17"}, 404, "does not exist"),
    ("token id out of range", {"prompt": [1, 2, 100000]}, 400, "out of range"),
]


@pytest.mark.parametrize(("name", "body", "status", "needle"), BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("target", ["router", "decode"])
def test_bad_requests(cluster, client, name, body, status, needle, target):
    r = client.post(f"{cluster[target]}/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and err["type"]


@pytest.mark.parametrize("target", ["router", "decode"])
def test_malformed_json(cluster, client, target):
    for raw in (b'{"prompt": "hi",', b"[1, 2]", b""):
        r = client.post(f"{cluster[target]}/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text


def test_bad_prefix_state(cluster, client):
    """A prefix state that does not belong to the prompt is refused with 400 (and P still frees it)."""
    a, b = random_prompts([40, 40], seed=3)
    p = client.post(
        f"{cluster['prefill']}/v1/completions",
        json={"prompt": a, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert p.status_code == 200, p.text
    kv = p.json()["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["split"] == 40 - 16 and kv["transfer_id"]
    r = client.post(
        f"{cluster['decode']}/v1/completions", json={"prompt": b, "max_tokens": 2, "kv_transfer_params": kv}
    )
    assert r.status_code == 400 and "bad prefix state" in r.json()["error"]["message"], r.text
    r = client.post(
        f"{cluster['decode']}/v1/completions",
        json={"prompt": b, "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}},
    )
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]
    r = client.post(f"{cluster['prefill']}/v1/completions", json={"prompt": b, "max_tokens": 2})
    assert r.status_code == 400 and "prefill worker" in r.json()["error"]["message"]
    wait_idle([cluster["prefill"], cluster["decode"]])


def test_client_disconnect_aborts_everywhere(cluster, client):
    """Leaving a long stream mid-way: D aborts (blocks freed) long before max_tokens would end it."""
    ids = random_prompts([50], seed=4)[0]
    body = {"prompt": ids, "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
    generated = metrics(cluster["decode"])["asympd_generation_tokens_total"]
    with client.stream("POST", f"{cluster['router']}/v1/completions", json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break
    wait_idle([cluster["prefill"], cluster["decode"]], timeout=10)
    # D stopped generating for it: far fewer than the 3000 tokens a request left running would make
    assert 3 <= metrics(cluster["decode"])["asympd_generation_tokens_total"] - generated < 3000
    assert metrics(cluster["router"])["asympd_router_aborts_total"] >= 1


def test_models_health_metrics(cluster, client):
    models = client.get(f"{cluster['router']}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"]
    health = client.get(f"{cluster['router']}/health").json()
    assert health["all_healthy"] and health["mode"] == "asymmetric" and health["window_size"] == 16
    p_info = client.get(f"{cluster['prefill']}/asympd/info").json()
    d_info = client.get(f"{cluster['decode']}/asympd/info").json()
    assert 0 < p_info["resident_bytes"] < d_info["resident_bytes"]
    for info in (p_info, d_info):  # memory beside the weights: layout, KV pool (CPU: no device allocator)
        mem = info["memory"]
        assert mem["weights_layout"] == "dequantized" and mem["weights_bytes"] == info["resident_bytes"]
        assert mem["kv_cache_bytes"] > 0 and mem["device_allocated_bytes"] is None
        assert mem["cuda_graphs"] is None  # CPU: every step eager
    assert p_info["fingerprint"] == d_info["fingerprint"]
    for info in (p_info, d_info):  # --warm-up: one throwaway prompt per size class, from a single row
        assert info["warm_up"]["prompts"] > 10 and info["warm_up"]["rows"][0] == 1, info["warm_up"]
        assert (info["warm_up"]["pieces"], info["warm_up"]["reserved_bytes"]) == (0, None)  # CPU: no graphs
    # D runs its default admission policy (alone-4: capped, unmixed steps); P is never capped
    assert d_info["admission"] == {
        "policy": "alone-4",
        "max_new_admissions": 4,
        "admission_token_budget": 512,
        "mixed_steps": False,
        "one_depth_per_step": False,
        "max_deepest_chunks": None,
    }
    assert p_info["admission"]["policy"] is None and p_info["admission"]["max_new_admissions"] is None
    assert p_info["admission"]["one_depth_per_step"] is False  # an asymmetric P stops below the top layer
    m = metrics(cluster["decode"])
    for name in (
        "asympd_time_to_first_token_seconds_count",
        "asympd_inter_token_latency_seconds_count",
        "asympd_e2e_request_latency_seconds_count",
        "asympd_ttft_transfer_seconds_count",
        "asympd_request_queue_time_seconds_count",
        "asympd_engine_steps_graphed_total",
        "asympd_ttft_decode_first_step_seconds_count",
        "asympd_kv_blocks_total",
        "asympd_spec_decode_num_accepted_tokens_total",
        "asympd_num_preemptions_total",
    ):
        assert name in m, name
    assert m["asympd_ttft_transfer_seconds_count"] > 0
    assert any(k.startswith("asympd_kv_usage_bytes{") for k in m)
    assert any(k.startswith("asympd_transfer_bytes_total{") and v > 0 for k, v in m.items())
    pm = metrics(cluster["prefill"])
    assert pm["asympd_prefill_compute_seconds_count"] > 0


def test_no_worker_holds_a_block_afterwards(cluster):
    wait_idle([cluster["prefill"], cluster["decode"]])
    for proc in cluster["procs"]:
        assert proc.alive(), f"{proc.name} died:\n{proc.log_tail()}"
