"""V4.1 chat through the router with the official ``openai`` client, mode asymmetric, every part a
real process: a tool-calling round trip (streamed and not) and thinking-mode answers with the
reasoning field.

The tiny checkpoint's weights are random, so its completions are random text: what is checked is
that (1) every worker rendered the exact prompt ``encode_messages`` gives (the router returns D's
prompt ids; P and D already refuse to disagree), and (2) what the server returns -- reasoning,
content, tool calls, finish reason, streamed or not -- is exactly what the parser makes of the
token ids the model really generated. The parser's handling of real tool blocks is pinned on
fixed strings in test_chat_format.py. A random model cannot call tools, so the second turn's
history carries the calls a real model would have made (a client may send any history)."""

from __future__ import annotations

import json

import openai
import pytest

from asympd.engine.llm import load_tokenizer
from asympd.serve.chat_format import ChatOptions, ChatStreamParser, encode_messages
from tests.serve.cluster import one_p_one_d
from tests.serve.test_chat_format import WEATHER


@pytest.fixture(scope="module")
def cluster(tiny_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("chat-tools-logs")
    with one_p_one_d(tiny_ckpt, logs, "asymmetric", "--served-model-name", "tiny") as c:
        yield c["router"]


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def _expected(tok, token_ids, thinking, tools):
    """What the parser makes of the generated ids (the server's text is ``tok.decode``)."""
    parser = ChatStreamParser(thinking, {"get_weather"} if tools else None, tools=tools)
    head, tail = parser.feed(tok.decode(token_ids)), parser.finish()
    calls = [(c.name, json.loads(c.arguments)) for c in head.tool_calls + tail.tool_calls]
    return head.reasoning + tail.reasoning if thinking else None, head.content + tail.content, calls


def _ask(client, messages, **kw):
    """One greedy request, non-streamed and streamed: (fields, token ids, prompt ids) of each."""
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0, extra_body=extra, **kw
    )
    msg, choice = r.choices[0].message, r.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]
    once = (msg.model_extra["reasoning"], msg.content or "", calls, choice.finish_reason)

    reasoning, content, scalls, finish, toks, kinds = [], [], [], None, [], []
    prompt_ids = None
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0, extra_body=extra, stream=True, **kw
    ):
        prompt_ids = chunk.model_extra.get("prompt_token_ids") or prompt_ids
        for c in chunk.choices:
            d = c.delta
            extra_d = d.model_extra or {}
            if extra_d.get("reasoning"):
                assert extra_d["reasoning_content"] == extra_d["reasoning"]
                reasoning.append(extra_d["reasoning"])
                kinds.append("r")
            if d.content:
                content.append(d.content)
                kinds.append("c")
            for tc in d.tool_calls or []:
                scalls.append((tc.function.name, json.loads(tc.function.arguments)))
                kinds.append("t")
            toks += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
    assert kinds == sorted(kinds, key="rct".index), "reasoning, then content, then tool calls"
    streamed = ("".join(reasoning) if once[0] is not None else None, "".join(content), scalls, finish)
    assert toks == choice.model_extra["token_ids"] and prompt_ids == r.model_extra["prompt_token_ids"]
    assert streamed == once
    return once, choice.model_extra["token_ids"], r.model_extra["prompt_token_ids"]


def test_tool_calling_round_trip(client, tok):
    messages = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "What is the weather in Paris and in Rome?"},
    ]
    (reasoning, content, calls, finish), ids, prompt = _ask(client, messages, tools=[WEATHER])
    assert prompt == tok.encode(encode_messages(messages, ChatOptions(), [WEATHER])).ids
    assert (reasoning, content, calls) == _expected(tok, ids, True, True)
    assert finish == ("tool_calls" if calls else "length" if len(ids) == 16 else "stop")

    # the calls come back, then their results (out of order), in chat mode this time
    messages.append(
        {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        }
    )
    messages += [
        {"role": "tool", "tool_call_id": "c2", "content": "sunny, 24 C"},
        {"role": "tool", "tool_call_id": "c1", "content": "rain, 12 C"},
    ]
    kw = {"tools": [WEATHER], "extra_body": {"chat_template_kwargs": {"thinking": False}}}
    (reasoning, content, calls, finish), ids, prompt = _ask(client, messages, **kw)
    text = encode_messages(messages, ChatOptions(thinking=False), [WEATHER])
    assert prompt == tok.encode(text).ids
    assert text.index("<tool_result>rain, 12 C</tool_result>") < text.index("<tool_result>sunny, 24 C</tool_result>")
    assert '<｜DSML｜ invoke name="get_weather">' in tok.decode(prompt, skip_special_tokens=False)
    assert reasoning is None and (reasoning, content, calls) == _expected(tok, ids, False, True)


@pytest.mark.parametrize("effort", ["high", "max", 20])
def test_thinking_answer_has_the_reasoning_field(client, tok, effort):
    messages = [{"role": "user", "content": "hello world, what is the model made of?"}]
    (reasoning, content, calls, _), ids, prompt = _ask(client, messages, reasoning_effort=effort)
    assert prompt == tok.encode(encode_messages(messages, ChatOptions.build(reasoning_effort=effort))).ids
    assert (reasoning, content, calls) == _expected(tok, ids, True, False)
    assert isinstance(reasoning, str) and reasoning  # thinking mode: the completion opens with reasoning


def test_bad_chat_requests_are_refused(client):
    for kw, needle in (
        ({"reasoning_effort": "medium"}, "reasoning_effort 'medium'"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, "enable_thinking"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kw)
        assert needle in str(e.value)
