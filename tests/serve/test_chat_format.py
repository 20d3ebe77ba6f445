"""V4.1's conversation format: golden prompt strings (facts §9), the completion parse table, the
streaming parser against the one-shot parse, the OpenAI request knobs and the tokenizer's ids.

The expected strings are spelled out here by hand (the tokens literally, ``｜`` U+FF5C and ``▁``
U+2581), not built with the module's constants, so a wrong constant fails too."""

from __future__ import annotations

import json

import pytest

from asympd.model.tiny_tokenizer import RELEASE_VOCAB_SIZE, build_tiny_tokenizer, special_token_ids
from asympd.serve import protocol as P
from asympd.serve.chat_format import (
    ChatFormatError,
    ChatOptions,
    ChatParseError,
    ChatStreamParser,
    effort_value,
    encode_messages,
    parse_completion,
    render_tool_calls,
)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYS, USR, AST = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"
REM, IMG = "<｜latest_reminder｜>", "<｜deepseek_image｜>"
EFFORT = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
CHAT, THINK = ChatOptions(thinking=False), ChatOptions()


def u(text):
    return {"role": "user", "content": text}


def a(text, reasoning=None, calls=None):
    m = {"role": "assistant", "content": text}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for cid, name, args in calls
        ]
    return m


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_LINE = (
    '{"name":"get_weather","description":"Weather of a city","parameters":{"type":"object",'
    '"properties":{"city":{"type":"string"}},"required":["city"]}}'
)
TOOLS_SECTION = (
    "## Tools\n\nYou may call the functions below. To call them, end your answer with one block of this shape "
    '(one invoke per call, in the order they should run; string="true" marks a value given as plain text, '
    'string="false" a JSON value such as a number, boolean, array or object):\n\n'
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="FUNCTION">\n'
    '<｜DSML｜ parameter name="ARGUMENT" string="true">VALUE</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n\n"
    "Each result comes back in a later user turn as <tool_result>...</tool_result>, in the order of the calls.\n\n"
    "Functions, one JSON schema per line:\n" + WEATHER_LINE
)
TWO_CALLS = (
    "\n\n<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)

# ---- golden prompts ---------------------------------------------------------------------------------

GOLDEN = [
    (  # facts §9's own example
        "chat mode",
        [{"role": "system", "content": "You are a helpful assistant."}, u("hello")],
        CHAT,
        None,
        f"{BOS}{SYS}You are a helpful assistant.{USR}hello{AST}</think>",
    ),
    (
        "thinking mode: the effort line (default high = 75) opens the system block",
        [{"role": "system", "content": "You are a helpful assistant."}, u("hello")],
        THINK,
        None,
        f"{BOS}{SYS}{EFFORT.format(75)}You are a helpful assistant.{USR}hello{AST}<think>",
    ),
    (
        "thinking mode without a system message",
        [u("hello")],
        ChatOptions(reasoning_effort=33),
        None,
        f"{BOS}{SYS}{EFFORT.format(33)}{USR}hello{AST}<think>",
    ),
    (
        "multi-turn thinking: earlier reasoning is dropped",
        [u("q1"), a("a1", "r1"), u("q2"), a("a2", "r2"), u("q3")],
        THINK,
        None,
        f"{BOS}{SYS}{EFFORT.format(75)}{USR}q1{AST}</think>a1{EOS}{USR}q2{AST}</think>a2{EOS}{USR}q3{AST}<think>",
    ),
    (
        "multi-turn thinking with drop_thinking off",
        [u("q1"), a("a1", "r1"), u("q2")],
        ChatOptions(drop_thinking=False),
        None,
        f"{BOS}{SYS}{EFFORT.format(75)}{USR}q1{AST}<think>r1</think>a1{EOS}{USR}q2{AST}<think>",
    ),
    (
        "multi-turn chat mode: reasoning never shown",
        [u("q1"), a("a1", "r1"), u("q2")],
        CHAT,
        None,
        f"{BOS}{USR}q1{AST}</think>a1{EOS}{USR}q2{AST}</think>",
    ),
    (
        "tools: two calls, results sent out of order come back in call order, reasoning kept",
        [
            {"role": "system", "content": "Be brief."},
            u("Weather in Paris and Rome?"),
            a(
                "",
                "Two calls.",
                [("c1", "get_weather", {"city": "Paris"}), ("c2", "get_weather", {"city": "Rome", "days": 2})],
            ),
            {"role": "tool", "tool_call_id": "c2", "content": "sun"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            a("Rain in Paris, sun in Rome.", "Both known."),
            u("Thanks"),
        ],
        ChatOptions(reasoning_effort="max"),
        [WEATHER],
        f"{BOS}{SYS}{EFFORT.format(100)}Be brief.\n\n{TOOLS_SECTION}{USR}Weather in Paris and Rome?"
        f"{AST}<think>Two calls.</think>{TWO_CALLS}{EOS}"
        f"{USR}<tool_result>rain</tool_result>\n\n<tool_result>sun</tool_result>"
        f"{AST}<think>Both known.</think>Rain in Paris, sun in Rome.{EOS}{USR}Thanks{AST}<think>",
    ),
    (
        "tools in chat mode, no system message: the tools section alone",
        [u("Paris?")],
        CHAT,
        [WEATHER],
        f"{BOS}{SYS}{TOOLS_SECTION}{USR}Paris?{AST}</think>",
    ),
    (
        "a tool result and the user's next words merge into one user turn",
        [
            u("go"),
            a("ok", None, [("x", "get_weather", {"city": "Oslo"})]),
            {"role": "tool", "content": "snow"},
            u("and?"),
        ],
        CHAT,
        [WEATHER],
        f"{BOS}{SYS}{TOOLS_SECTION}{USR}go{AST}</think>ok\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Oslo</｜DSML｜ parameter>\n'
        f"</｜DSML｜ invoke>\n</｜DSML｜ calls>{EOS}{USR}<tool_result>snow</tool_result>\n\nand?{AST}</think>",
    ),
    (
        "effort alias low = 50",
        [u("x")],
        ChatOptions.build(reasoning_effort="low"),
        None,
        f"{BOS}{SYS}{EFFORT.format(50)}{USR}x{AST}<think>",
    ),
    (
        "latest reminder (no closing token) and a mid-conversation system message, nothing dropped from them",
        [
            {"role": "system", "content": "S1"},
            u("q1"),
            a("a1", "r1"),
            {"role": "system", "content": "S2"},
            {"role": "latest_reminder", "content": "Date: 2026-11-30, locale fr-FR"},
            u("q2"),
        ],
        THINK,
        None,
        f"{BOS}{SYS}{EFFORT.format(75)}S1{USR}q1{AST}</think>a1{EOS}{SYS}S2"
        f"{REM}Date: 2026-11-30, locale fr-FR{USR}q2{AST}<think>",
    ),
    (
        "a system message last counts like a user turn",
        [u("q1"), a("a1"), {"role": "system", "content": "now in French"}],
        CHAT,
        None,
        f"{BOS}{USR}q1{AST}</think>a1{EOS}{SYS}now in French{AST}</think>",
    ),
    (
        "images: one placeholder per part, joined to text by a blank line",
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "text", "text": "What differs?"},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                ],
            }
        ],
        CHAT,
        None,
        f"{BOS}{USR}{IMG}\n\nWhat differs?\n\n{IMG}{AST}</think>",
    ),
]


@pytest.mark.parametrize(("messages", "options", "tools", "want"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_golden_prompts(messages, options, tools, want):
    assert encode_messages(messages, options, tools) == want


def test_response_format_and_no_generation_prompt():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    want = (
        f"{BOS}{SYS}sys\n\n## Response Format\n\nAnswer with one JSON object, and nothing else, that follows "
        f'this schema:\n{{"type":"object"}}{USR}q{AST}</think>'
    )
    assert encode_messages([{"role": "system", "content": "sys"}, u("q")], CHAT, response_format=fmt) == want
    obj = encode_messages([u("q")], CHAT, response_format={"type": "json_object"})
    assert obj == f"{BOS}{SYS}## Response Format\n\nAnswer with one JSON object and nothing else.{USR}q{AST}</think>"
    assert encode_messages([u("q")], CHAT, response_format={"type": "text"}) == f"{BOS}{USR}q{AST}</think>"
    # a finished conversation (e.g. for training-style scoring): the last assistant turn keeps its reasoning
    done = encode_messages([u("q"), a("ans", "why")], ChatOptions(add_generation_prompt=False))
    assert done == f"{BOS}{SYS}{EFFORT.format(75)}{USR}q{AST}<think>why</think>ans{EOS}"


@pytest.mark.parametrize(
    ("effort", "value"), [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100), ("42", 42)]
)
def test_effort_values(effort, value):
    assert effort_value(effort) == value


BAD_CONVERSATIONS = [
    ([], {}, "at least one message"),
    ([{"role": "developer", "content": "x"}], {}, "unsupported role 'developer'"),
    ([{"role": "tool", "content": "x"}], {}, "must follow an assistant message with tool_calls"),
    ([u("q"), a("", None, [("c1", "f", {})]), {"role": "tool", "tool_call_id": "zz", "content": "r"}], {}, "'zz'"),
    ([u("q"), a("a")], {}, "nothing to generate"),
    ([u([{"type": "audio"}])], {}, "unsupported content part 'audio'"),
    (
        [u("q"), {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}, u("r")],
        {},
        "arguments are not JSON",
    ),
    ([u("q")], {"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ([u("q"), a("", None, [("c", "f", {'a"b': 1})]), u("r")], {}, "cannot hold quotes or newlines: 'a\"b'"),
    ([u("q")], {"response_format": {"type": "yaml"}}, "response_format type 'yaml'"),
]


@pytest.mark.parametrize(("messages", "kw", "needle"), BAD_CONVERSATIONS)
def test_bad_conversations(messages, kw, needle):
    with pytest.raises(ChatFormatError) as e:
        encode_messages(messages, CHAT, **kw)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"reasoning_effort": "medium"}, "'medium' is not an integer 1-100 or one of low, high, max, none"),
        ({"reasoning_effort": 0}, "must be in [1, 100], got 0"),
        ({"reasoning_effort": 101}, "must be in [1, 100], got 101"),
        ({"reasoning_effort": True}, "must be an integer 1-100"),
        ({"reasoning_effort": "none", "thinking": True}, "cannot go with thinking=true"),
        ({"reasoning_effort": 60, "thinking": False}, "thinking mode only"),
        ({"thinking": "yes"}, "thinking must be a boolean"),
        ({"drop_thinking": 1}, "drop_thinking must be a boolean"),
    ],
)
def test_bad_options(kw, needle):
    with pytest.raises(ChatFormatError) as e:
        ChatOptions.build(**kw)
    assert needle in str(e.value)


def test_effort_none_is_chat_mode():
    assert ChatOptions.build(reasoning_effort="none") == CHAT


# ---- the parse table ------------------------------------------------------------------------------


def call(name, args):
    return (name, json.dumps(args, ensure_ascii=False))


PARSE = [
    ("reasoning only (cut by max_tokens)", "I should think", True, ("I should think", "", [])),
    ("content only, chat mode", "Hello there.", False, (None, "Hello there.", [])),
    ("reasoning then content", "Think.</think>Answer.", True, ("Think.", "Answer.", [])),
    ("empty reasoning", "</think>Answer.", True, ("", "Answer.", [])),
    ("chat mode keeps a stray </think> as text", "a</think>b", False, (None, "a</think>b", [])),
    (
        "one call, content before it",
        'Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>",
        False,
        (None, "Checking.", [call("get_weather", {"city": "Paris"})]),
    ),
    (
        "two calls after reasoning, JSON literals",
        "Plan.</think>" + TWO_CALLS,
        True,
        ("Plan.", "", [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Rome", "days": 2})]),
    ),
    (
        "every JSON literal kind, a multi-line string, no parameters",
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="n" string="false">-1.5</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="b" string="false">true</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="z" string="false">null</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="o" string="false">{"k": [1, "é"]}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="s" string="true">line 1\nline "2"</｜DSML｜ parameter>\n'
        '</｜DSML｜ invoke>\n<｜DSML｜ invoke name="g">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n',
        False,
        (
            None,
            "",
            [
                call("f", {"n": -1.5, "b": True, "z": None, "o": {"k": [1, "é"]}, "s": 'line 1\nline "2"'}),
                call("g", {}),
            ],
        ),
    ),
]


@pytest.mark.parametrize(("text", "thinking", "want"), [p[1:] for p in PARSE], ids=[p[0] for p in PARSE])
def test_parse_table(text, thinking, want):
    msg = parse_completion(text, thinking)
    assert (msg.reasoning, msg.content, [(c.name, c.arguments) for c in msg.tool_calls]) == want
    assert len({c.id for c in msg.tool_calls}) == len(msg.tool_calls)


BLOCK = "\n\n<｜DSML｜ calls>\n"
INV = '<｜DSML｜ invoke name="f">\n'
PAR = '<｜DSML｜ parameter name="k" string="true">v</｜DSML｜ parameter>\n'
END = "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
MALFORMED = [
    ("not closed (max_tokens)", BLOCK + INV + PAR, "expected <｜DSML｜ invoke name=...> or </｜DSML｜ calls>"),
    ("no calls end", BLOCK + INV + PAR + "</｜DSML｜ invoke>\n", "expected <｜DSML｜ invoke"),
    ("empty block", BLOCK + "</｜DSML｜ calls>", "a tool block with no invoke"),
    ("V4 spelling without the space", "\n\n<｜DSML｜calls>\n" + INV + PAR + END, "outside a tool block"),
    ("no blank line before the block", "x<｜DSML｜ calls>\n" + INV + PAR + END, "outside a tool block"),
    ("text after the block", BLOCK + INV + PAR + END + " and more", "text after </｜DSML｜ calls>"),
    ("string attribute not true/false", BLOCK + INV + PAR.replace('"true"', '"yes"') + END, "malformed parameter"),
    (
        "parameter not closed",
        BLOCK + INV + '<｜DSML｜ parameter name="k" string="true">v\n' + END,
        "malformed parameter",
    ),
    (
        'string="false" that is not JSON',
        BLOCK + INV + PAR.replace('"true">v', '"false">{v') + END,
        "parameter 'k' of 'f' has string=\"false\" but is not JSON: '{v'",
    ),
    ("parameter given twice", BLOCK + INV + PAR + PAR + END, "parameter 'k' given twice in the call of 'f'"),
    ("invoke without a name", BLOCK + "<｜DSML｜ invoke>\n" + PAR + END, "expected <｜DSML｜ invoke"),
]


@pytest.mark.parametrize(("text", "needle"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_completions_raise(text, needle):
    with pytest.raises(ChatParseError) as e:
        parse_completion(text, thinking=False)
    assert needle in str(e.value)


def test_unknown_tool_name_raises():
    with pytest.raises(ChatParseError, match=r"called 'f', which is not among the tools \(get_weather\)"):
        parse_completion(BLOCK + INV + PAR + END, thinking=False, tool_names={"get_weather"})


def test_rendered_calls_parse_back():
    calls = [("f", {"a": "x y", "b": [1, {"c": None}]}), ("g", {"q": "日本"})]
    msg = parse_completion(render_tool_calls(calls), thinking=False)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == calls


# ---- streaming equals the one-shot parse ----------------------------------------------------------


def _stream(text, thinking, step, tools=True):
    parser = ChatStreamParser(thinking, tools=tools)
    deltas = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    return deltas, parser


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("text", "thinking", "want"), [p[1:] for p in PARSE], ids=[p[0] for p in PARSE])
def test_stream_equals_one_shot(text, thinking, want, step):
    deltas, parser = _stream(text, thinking, step)
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    calls = [(c.name, c.arguments) for d in deltas for c in d.tool_calls]
    assert (reasoning if thinking else None, content, calls) == want and parser.error is None
    # order: no reasoning after content, no content after a tool call; calls only at the end
    kinds = [k for d in deltas for k, v in (("r", d.reasoning), ("c", d.content), ("t", d.tool_calls)) if v]
    assert kinds == sorted(kinds, key="rct".index)
    assert all(not d.tool_calls for d in deltas[:-1])
    # nothing that is part of a marker ever goes out
    assert all("</think" not in d.reasoning and "｜DSML｜" not in d.content for d in deltas)


@pytest.mark.parametrize(("text", "needle"), [m[1:] for m in MALFORMED[:3] + MALFORMED[5:]])
def test_stream_sends_a_malformed_block_as_content(text, needle):
    deltas, parser = _stream(text, False, 3)
    assert "".join(d.content for d in deltas) == text and not any(d.tool_calls for d in deltas)
    assert needle in parser.error


def test_without_tools_a_block_is_content():
    text = "Plan.</think>" + TWO_CALLS
    deltas, parser = _stream(text, True, 5, tools=False)
    assert "".join(d.content for d in deltas) == TWO_CALLS and parser.error is None


# ---- the OpenAI request side --------------------------------------------------------------------------


def _req(**kw):
    return P.parse_request("chat", {"messages": [u("hi")], **kw})


def test_request_knobs():
    think = f"{BOS}{SYS}{EFFORT.format(75)}{USR}hi{AST}<think>"
    assert _req().render_prompt() == think  # vLLM's default: thinking on
    assert _req(reasoning_effort="none").render_prompt() == f"{BOS}{USR}hi{AST}</think>"
    assert _req(chat_template_kwargs={"thinking": False}).render_prompt() == f"{BOS}{USR}hi{AST}</think>"
    assert _req(reasoning_effort="max").render_prompt() == think.replace(": 75 ", ": 100 ")
    # chat_template_kwargs win over the top-level field
    kw = {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": 90}}
    assert _req(**kw).render_prompt() == think.replace(": 75 ", ": 90 ")
    # tools go in with tool_choice auto (the default) and stay out with none
    assert TOOLS_SECTION in _req(tools=[WEATHER]).render_prompt()
    assert "## Tools" not in _req(tools=[WEATHER], tool_choice="none").render_prompt()


@pytest.mark.parametrize(
    ("kw", "param", "needle"),
    [
        (
            {"chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs",
            "unknown key(s) ['enable_thinking']",
        ),
        ({"reasoning_effort": "medium"}, "reasoning_effort", "'medium'"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "needs guided decoding"),
        ({"messages": [{"role": "tool", "content": "r"}]}, "messages", "with tool_calls"),
    ],
)
def test_request_refusals(kw, param, needle):
    with pytest.raises(P.APIError) as e:
        _req(**kw).render_prompt()
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message


def test_chat_output_fields():
    out = _req(tools=[WEATHER]).output()
    text = "Plan.</think>Checking." + TWO_CALLS
    deltas = [out.delta(text[:4], False), out.delta(text[4:20], False), out.delta(text[20:], True)]
    assert deltas[0] == {"reasoning": "Plan", "reasoning_content": "Plan"}
    assert deltas[1] == {"reasoning": ".", "reasoning_content": ".", "content": "Checkin"}
    calls = deltas[2]["tool_calls"]
    assert deltas[2]["content"] == "g." and [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome", "days": 2}]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"

    msg = _req(tools=[WEATHER]).output().message("Plan.</think>" + TWO_CALLS)
    assert msg["content"] is None and msg["reasoning"] == msg["reasoning_content"] == "Plan."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] * 2 and "index" not in msg[
        "tool_calls"
    ][0]
    chat = _req(reasoning_effort="none").output()
    assert chat.message("Hi.") == {"role": "assistant", "content": "Hi.", "reasoning": None, "reasoning_content": None}
    bad = _req(tools=[WEATHER]).output()
    raw = "</think>x" + BLOCK + INV + PAR
    assert bad.message(raw)["content"] == "x" + BLOCK + INV + PAR and "expected" in bad.error


# ---- the tokenizer make-checkpoint writes ----------------------------------------------------------


def test_release_sized_tokenizer_holds_the_released_ids():
    tok = build_tiny_tokenizer(RELEASE_VOCAB_SIZE)
    want = {
        BOS: 0,
        EOS: 1,
        SYS: 128799,
        USR: 128803,
        AST: 128804,
        "<think>": 128821,
        "</think>": 128822,
        "｜DSML｜": 128825,
        REM: 128828,
        "<｜action｜>": 128829,
        "<｜read_url｜>": 128845,
        IMG: 129264,
    }
    assert {t: tok.token_to_id(t) for t in want} == want
    ids = tok.encode(encode_messages([{"role": "system", "content": "S"}, u("hi")], CHAT)).ids
    assert ids[:2] == [0, 128799] and ids[-2:] == [128804, 128822] and 128803 in ids


def test_tiny_tokenizer_layout_and_decoding(tiny_ckpt):
    from asympd.config import tiny
    from asympd.engine.llm import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    ids = special_token_ids(512)
    assert {t: tok.token_to_id(t) for t in ids} == ids
    assert ids[SYS] == tiny().dspark_noise_token_id == 498 and ids[IMG] == tiny().image_token_id == 511
    prompt = encode_messages([u("hello"), a("world", calls=[("c", "f", {"k": 1})]), u("again")], THINK, [WEATHER])
    enc = tok.encode(prompt)
    assert tok.decode(enc.ids, skip_special_tokens=False) == prompt
    for special in (BOS, SYS, USR, AST, EOS, "<think>", "</think>", "｜DSML｜"):
        assert enc.ids.count(ids[special]) == prompt.count(special)
    # decoding (what the server streams) keeps the markers the parser needs and drops BOS/EOS/roles
    completion = "r</think>c" + TWO_CALLS
    out_ids = tok.encode(completion + EOS).ids
    assert tok.decode(out_ids) == completion


def test_server_text_path_token_by_token(tiny_ckpt):
    """The worker's own path: engine outputs one token at a time -> OutputTracker's decoded text
    (think/DSML markers survive decoding, EOS does not) -> ChatOutput's deltas."""
    from asympd.engine.llm import load_tokenizer
    from asympd.engine.request import CompletionOutput, RequestOutput
    from asympd.serve.api_server import OutputTracker

    tok = load_tokenizer(tiny_ckpt)
    ids = tok.encode("Plan: hello world</think>The model" + TWO_CALLS + EOS).ids
    tracker, out, deltas = OutputTracker(tok, [], False, eos_token_id=1), _req(tools=[WEATHER]).output(), []
    for n in range(1, len(ids) + 1):
        last = n == len(ids)
        tracker.update(
            RequestOutput("r", [1], [CompletionOutput(0, ids[:n], "", None, "stop" if last else None)], last)
        )
        deltas.append(out.delta(tracker.delta()[0], tracker.done))
    assert "".join(d.get("reasoning", "") for d in deltas) == "Plan: hello world"
    assert "".join(d.get("content", "") for d in deltas) == "The model"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, {"city": "Paris"}),
        (1, {"city": "Rome", "days": 2}),
    ]
    assert "tool_calls" in deltas[-1] and out.finish_reason(tracker.finish_reason) == "tool_calls"
