"""Pieces of the serving stack without any server: chat prompt tokens, incremental detokenization
with stop strings, the router's worker picking, request validation."""

from __future__ import annotations

import re

import pytest

from asympd.engine.llm import load_tokenizer
from asympd.engine.request import CompletionOutput, RequestOutput
from asympd.engine.sampling_params import sampling_defaults
from asympd.serve import protocol as P
from asympd.serve.chat_format import ASSISTANT, BOS, END_THINK, USER, ChatOptions, encode_messages
from asympd.serve.detokenize import OutputTracker
from asympd.serve.router import Router, RouterConfig


def test_chat_prompt_special_tokens_are_single_tokens(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    ids = tok.encode(encode_messages([{"role": "user", "content": "hello"}], ChatOptions(thinking=False))).ids
    assert ids[:2] == [tok.token_to_id(BOS), tok.token_to_id(USER)]
    assert ids[-2:] == [tok.token_to_id(ASSISTANT), tok.token_to_id(END_THINK)]


def _out(tokens: list[int], finished: bool = False, reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", [1], [CompletionOutput(0, list(tokens), "", None, reason)], finished)


def test_tracker_streams_what_a_full_decode_gives(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    ids = tok.encode("hello world, the model — ünïcödé ✓ prefill decode").ids
    tr = OutputTracker(tok, [], False)
    pieces = []
    for i in range(1, len(ids) + 1):
        tr.update(_out(ids[:i], finished=i == len(ids), reason="length" if i == len(ids) else None))
        pieces.append(tr.delta()[0])
        assert "\ufffd" not in pieces[-1]  # a partial UTF-8 sequence waits for its next token
    assert "".join(pieces) == tok.decode(ids)


def test_tracker_stop_string_across_tokens_is_held_back_and_cut(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    ids = tok.encode("hello world and more words").ids
    tr = OutputTracker(tok, ["d and m"], False)
    sent = []
    for i in range(1, len(ids) + 1):
        tr.update(_out(ids[:i]))
        sent.append(tr.delta()[0])
        if tr.done:
            break
    assert tr.done and tr.finish_reason == "stop" and tr.stop_reason == "d and m"
    assert "".join(sent) == "hello worl"  # nothing of the stop string ever went out
    tr2 = OutputTracker(tok, ["d and m"], True)
    for i in range(1, len(ids) + 1):
        tr2.update(_out(ids[:i]))
        if tr2.done:
            break
    assert tr2.text == "hello world and m"


def test_tracker_stop_reason_for_stop_token_not_eos(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    tr = OutputTracker(tok, [], False, eos_token_id=1)
    tr.update(_out([300, 301], finished=True, reason="stop"))
    assert tr.stop_reason == 301
    tr = OutputTracker(tok, [], False, eos_token_id=1)
    tr.update(_out([300, 1], finished=True, reason="stop"))
    assert tr.stop_reason is None  # EOS: OpenAI's plain "stop"


def test_router_picks_least_loaded_healthy_worker_and_alternates_ties():
    r = Router(RouterConfig(prefill=["http://p1", "http://p2", "http://p3"], decode=["http://d1"]))
    p1, p2, p3 = r.prefill
    for w in r.prefill:
        w.healthy = True
    p1.outstanding_tokens, p2.outstanding_tokens, p3.outstanding_tokens = 50, 10, 10
    picks = {r.pick(r.prefill).url for _ in range(4)}
    assert picks == {"http://p2", "http://p3"}  # ties alternate, the loaded one waits
    p2.healthy = False
    assert {r.pick(r.prefill).url for _ in range(4)} == {"http://p3"}
    assert r.pick(r.prefill, exclude={"http://p3"}).url == "http://p1"
    for w in r.prefill:
        w.healthy = False
    assert r.pick(r.prefill) is None


def test_router_refuses_workers_of_another_mode_or_model():
    r = Router(RouterConfig(prefill=["http://p"], decode=["http://d"], mode="asymmetric"))
    p, d = r.prefill[0], r.decode[0]
    p.info = {"role": "prefill", "mode": "asymmetric", "fingerprint": "aaa"}
    assert r._mismatch(p) is None
    d.info = {"role": "decode", "mode": "symmetric", "fingerprint": "aaa"}
    assert "mode" in r._mismatch(d)
    d.info = {"role": "decode", "mode": "asymmetric", "fingerprint": "bbb"}
    assert "fingerprint" in r._mismatch(d)
    d.info = {"role": "prefill", "mode": "asymmetric", "fingerprint": "aaa"}
    assert "role" in r._mismatch(d)


def test_router_counts_tokens_like_the_workers(tiny_ckpt):
    r = Router(RouterConfig(decode=["http://d"], checkpoint=tiny_ckpt))
    tok = load_tokenizer(tiny_ckpt)
    assert r.window == 16
    assert r.count_tokens("completion", {"prompt": "hello world"}) == len(tok.encode("hello world").ids)
    assert r.count_tokens("completion", {"prompt": [1, 2, 3]}) == 3
    msgs = [{"role": "user", "content": "hello"}]
    assert r.count_tokens("chat", {"messages": msgs}) == len(tok.encode(encode_messages(msgs)).ids)
    assert r.count_tokens("completion", {"prompt": 12}) is None  # malformed: the worker will say why


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "top_k": -5}, "top_k"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_sampling_validation_messages(body, needle):
    req = P.parse_request("completion", body)
    with pytest.raises(P.APIError, match=needle):
        req.single_prompt()
        req.sampling_params(1, 100)


def test_n_choices_cap_modes_ids_and_seeds():
    """OpenAI's n: 1..16, refused (naming n) above and where P samples the first token; choice i's
    engine id and seed (seed + i, vLLM's, wrapped into 64 bits)."""
    assert P.parse_request("completion", {"prompt": "x", "n": 16}).n == 16
    for n in (0, 17):
        with pytest.raises(P.APIError, match=rf"^n must be in \[1, 16\], got {n}$") as e:
            P.parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "n": n})
        assert e.value.param == "n"
    for mode in ("colocated", "asymmetric", "encoder-only", None):
        P.check_n_for_mode(16, mode)
    for mode in ("symmetric", "symmetric-split", "symmetric-windows"):
        P.check_n_for_mode(1, mode)
        with pytest.raises(P.APIError, match=f"^n=3 is not supported in mode {mode}: its prefill worker") as e:
            P.check_n_for_mode(3, mode)
        assert e.value.param == "n" and e.value.status == 400
    assert P.choice_ids("r", 1) == ["r"] and P.choice_ids("r", 3) == ["r/0", "r/1", "r/2"]
    assert [P.choice_seed(7, i) for i in range(3)] == [7, 8, 9] and P.choice_seed(None, 2) is None
    assert P.choice_seed(2**64 - 1, 1) == 0 and P.choice_seed(-1, 1) == 0


def test_generation_config_defaults_fill_what_a_request_leaves_out():
    """vLLM's --generation-config auto: the sampling keys of generation_config.json are the defaults
    of a request's omitted fields (max_new_tokens the default max_tokens); the request's own win."""
    gen = {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_new_tokens": 7, "do_sample": True, "eos_token_id": 1}
    defaults = sampling_defaults(gen)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_tokens": 7}
    got = P.parse_request("completion", {"prompt": "x"}).sampling_params(1, 100, defaults)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.max_tokens) == (0.6, 0.95, -1, 0.0, 7)
    own = {"prompt": "x", "temperature": 0, "top_p": 1.0, "max_tokens": 3}
    got = P.parse_request("completion", own).sampling_params(1, 100, defaults)
    assert (got.temperature, got.top_p, got.max_tokens) == (0, 1.0, 3)
    chat = P.parse_request("chat", {"messages": [{"role": "user", "content": "x"}]})
    assert chat.sampling_params(90, 100, defaults).max_tokens == 7
    assert chat.sampling_params(96, 100, defaults).max_tokens == 4  # the room the context leaves
    assert chat.sampling_params(96, 100).max_tokens == 4 and chat.sampling_params(96, 100).temperature == 1.0
    with pytest.raises(ValueError, match=r"^generation_config.json: top_p must be in \(0, 1\], got 2$"):
        sampling_defaults({"top_p": 2})


def test_error_body_shape():
    e = P.APIError("nope", 404, param="model")
    assert e.body() == {"error": {"message": "nope", "type": "NotFoundError", "param": "model", "code": 404}}
    with pytest.raises(P.APIError, match="malformed JSON"):
        P.parse_json_body(b"{")


def test_a_body_refuses_lone_surrogates_wherever_they_are():
    # a surrogate pair is a character (JSON's way to escape one past U+FFFF); only a lone half is refused
    assert P.parse_json_body(rb'{"prompt": "caf\u00e9 \ud83d\ude00"}') == {"prompt": "caf\u00e9 \U0001f600"}
    for raw, param, char in (
        (rb'{"prompt": "\ud800"}', "prompt", "D800"),
        (rb'{"logit_bias": {"\udfff": 1}}', "logit_bias", "DFFF"),  # a key
        (rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud83d"}]}]}', "messages", "D83D"),
    ):
        with pytest.raises(P.APIError) as e:
            P.parse_json_body(raw)
        assert (e.value.param, e.value.message) == (param, f"{param}: a lone surrogate (U+{char}) is not valid Unicode")


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"decode": []}, "give at least one --decode worker URL"),
        ({"decode": ["d:8000"]}, "--decode 'd:8000' is not an http(s)://host:port URL"),
        ({"prefill": ["ftp://p"]}, "--prefill 'ftp://p' is not an http(s)://host:port URL"),
        ({"prefill": ["http://p"], "mode": "colocated"}, "--mode colocated routes to colocated workers"),
        ({"health_interval": 0}, "--health-interval must be a positive number of seconds, got 0"),
        ({"stream_idle_timeout": -1.0}, "--progress-timeout must be a positive number of seconds"),
        ({"max_body_bytes": 0}, "--max-body-bytes must be at least 1024, got 0"),
    ],
)
def test_router_settings_it_cannot_run_with_are_refused(kw, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        Router(RouterConfig(**{"decode": ["http://d"], **kw}))


def test_an_address_that_cannot_be_had_is_a_bind_error():
    import socket

    from asympd.serve.http import BindError, bind_socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    try:
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            bind_socket("127.0.0.1", port)
    finally:
        held.close()
    with pytest.raises(BindError, match="port 70000 is out of range: ports are 0-65535"):
        bind_socket("127.0.0.1", 70000)
    sock = bind_socket("127.0.0.1", 0)  # a free one
    assert sock.getsockname()[1] > 0
    sock.close()


def test_worker_metrics_export_engine_speculation_stats():
    from asympd.serve.metrics import ServerMetrics

    m = ServerMetrics({"role": "decode"})
    stats = {
        "running": 1,
        "waiting": 0,
        "kv_blocks_used": 3,
        "num_spec_tokens": 3,
        "spec_steps": 10,
        "spec_acceptance_rate": 0.25,
        "spec_mean_accepted_length": 1.75,
    }
    text = m.render(stats, {}).decode()
    assert "asympd_spec_decode_num_spec_tokens 3.0" in text
    assert "asympd_spec_decode_acceptance_rate 0.25" in text
    assert "asympd_spec_decode_mean_accepted_length 1.75" in text
    assert "asympd_kv_blocks_used 3.0" in text


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("cuda", "bfloat16")])
def test_serve_dtype_auto_fits_the_device(device, dtype, monkeypatch):
    import torch

    from asympd.serve.api_server import ServeConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve() checks there is one
    assert ServeConfig(checkpoint="unused", device=device).resolve().dtype == dtype
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        ServeConfig(checkpoint="unused", dtype="fp8").resolve()
