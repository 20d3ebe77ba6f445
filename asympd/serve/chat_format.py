"""DeepSeek-V4.1's conversation format: messages -> prompt text, completion text -> message.

V4.1 ships no Jinja template, only a Python encoder and parser; this module is our own writing of
the format the facts sheet describes (``/work/shared/v41-facts.md`` §9). A prompt is::

    BOS [<｜System｜>[Reasoning Effort line\\n\\n]system text[\\n\\n## Tools ...][\\n\\n## Response Format ...]]
        <｜User｜>user text (consecutive user / tool-result messages merged, joined by a blank line)
        <｜Assistant｜><think>reasoning</think>content[DSML tool block]EOS     (a kept earlier turn)
        <｜Assistant｜></think>content[DSML tool block]EOS                    (chat mode or dropped reasoning)
        <｜System｜>a later system message     <｜latest_reminder｜>a reminder (no closing token)
        <｜Assistant｜><think>       (thinking mode)   or   <｜Assistant｜></think>   (chat mode)

A completion is ``[reasoning</think>]content[\\n\\n<｜DSML｜ calls>...</｜DSML｜ calls>]`` (EOS is a
special token, gone after decoding). :class:`ChatStreamParser` turns it into reasoning, content
and OpenAI tool calls, incrementally, so a streamed answer and a collected one are the same
parse; :func:`parse_completion` is the strict one-shot form (malformed tool blocks raise
:class:`ChatParseError`, never yield a partial call).

Pure Python on purpose (no torch): the router renders prompts too, and the prefill worker, the
decode worker and the router must produce identical ids for one request.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"

CALLS_START = f"\n\n<{DSML} calls>"
CALLS_END = f"</{DSML} calls>"

ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
# the release's aliases; "none" turns thinking off (vLLM's reading of reasoning_effort)
EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = 75

TOOLS_HEADER = f"""## Tools

You may call the functions below. To call them, end your answer with one block of this shape \
(one invoke per call, in the order they should run; string="true" marks a value given as plain \
text, string="false" a JSON value such as a number, boolean, array or object):

<{DSML} calls>
<{DSML} invoke name="FUNCTION">
<{DSML} parameter name="ARGUMENT" string="true">VALUE</{DSML} parameter>
</{DSML} invoke>
</{DSML} calls>

Each result comes back in a later user turn as <tool_result>...</tool_result>, in the order of the calls.

Functions, one JSON schema per line:"""


class ChatFormatError(ValueError):
    """A conversation or option the V4.1 format cannot express (maps to HTTP 400)."""


class ChatParseError(ValueError):
    """A completion whose tool block does not follow the DSML grammar."""


@dataclass(frozen=True)
class ChatOptions:
    """How to render: ``thinking`` picks the generation header; ``reasoning_effort`` (thinking only)
    is 1-100 or an alias; ``drop_thinking`` drops earlier turns' reasoning unless tools are in play."""

    thinking: bool = True
    reasoning_effort: int | str | None = None
    drop_thinking: bool = True
    add_generation_prompt: bool = True

    @classmethod
    def build(
        cls,
        thinking: Any = None,
        reasoning_effort: Any = None,
        drop_thinking: Any = None,
        add_generation_prompt: bool = True,
    ) -> ChatOptions:
        """Options from request fields, validated; ``reasoning_effort="none"`` means chat mode."""
        if thinking is not None and not isinstance(thinking, bool):
            raise ChatFormatError(f"thinking must be a boolean, got {thinking!r}")
        if drop_thinking is not None and not isinstance(drop_thinking, bool):
            raise ChatFormatError(f"drop_thinking must be a boolean, got {drop_thinking!r}")
        if reasoning_effort == "none":
            if thinking:
                raise ChatFormatError('reasoning_effort "none" turns thinking off: it cannot go with thinking=true')
            thinking, reasoning_effort = False, None
        if reasoning_effort is not None:
            effort_value(reasoning_effort)  # validate now
            if thinking is False:
                raise ChatFormatError(
                    "reasoning_effort applies to thinking mode only: it cannot go with thinking=false"
                )
        return cls(
            thinking=True if thinking is None else thinking,
            reasoning_effort=reasoning_effort,
            drop_thinking=True if drop_thinking is None else drop_thinking,
            add_generation_prompt=add_generation_prompt,
        )


def effort_value(effort: int | str | None) -> int:
    """The rendered 1-100 effort (the release's aliases: low 50, high 75, max 100; default 75)."""
    if effort is None:
        return DEFAULT_EFFORT
    if isinstance(effort, bool) or not isinstance(effort, (int, str)):
        raise ChatFormatError(f"reasoning_effort must be an integer 1-100 or one of low, high, max, got {effort!r}")
    if isinstance(effort, str):
        if effort in EFFORT_ALIASES:
            return EFFORT_ALIASES[effort]
        if not effort.isdigit():
            raise ChatFormatError(
                f"reasoning_effort {effort!r} is not an integer 1-100 or one of {', '.join(EFFORT_ALIASES)}, none"
            )
        effort = int(effort)
    if not 1 <= effort <= 100:
        raise ChatFormatError(f"reasoning_effort must be in [1, 100], got {effort}")
    return effort


# ---- encoder ----------------------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or parts (text / image) joined by a blank line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ChatFormatError(f"{where}: content must be a string or a list of parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}: a text part needs its text as a string")
            parts.append(part["text"])
        elif kind in ("image_url", "image"):
            parts.append(IMAGE)
        else:
            raise ChatFormatError(f"{where}: unsupported content part {kind!r}: expected text or image_url")
    return "\n\n".join(parts)


def _arguments(call: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatFormatError(f"{where}: a tool call needs function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{where}: tool call {fn['name']!r} arguments are not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}: tool call {fn['name']!r} arguments must be a JSON object")
    return fn["name"], args


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The DSML block that calls ``(name, arguments)`` in order (what the model writes)."""
    out = [CALLS_START, "\n"]
    for name, args in calls:
        bad = [n for n in (name, *args) if not isinstance(n, str) or '"' in n or "\n" in n]
        if bad:
            raise ChatFormatError(f"tool call names and argument names cannot hold quotes or newlines: {bad[0]!r}")
        out.append(f'<{DSML} invoke name="{name}">\n')
        for key, value in args.items():
            if isinstance(value, str):
                out.append(f'<{DSML} parameter name="{key}" string="true">{value}</{DSML} parameter>\n')
            else:
                text = json.dumps(value, ensure_ascii=False)
                out.append(f'<{DSML} parameter name="{key}" string="false">{text}</{DSML} parameter>\n')
        out.append(f"</{DSML} invoke>\n")
    out.append(CALLS_END)
    return "".join(out)


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The ``## Tools`` section: instructions, then one compact JSON function schema per line."""
    lines = [TOOLS_HEADER]
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (isinstance(tool, Mapping) and tool.get("type", "function") != "function") or not isinstance(fn, Mapping):
            raise ChatFormatError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatFormatError(f"tools[{i}]: function.name is required")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ChatFormatError(f"tools[{i}]: function.parameters must be a JSON object (a JSON Schema)")
        lines.append(json.dumps(dict(fn), ensure_ascii=False, separators=(",", ":")))
    return "\n".join(lines)


def render_response_format(response_format: Mapping[str, Any] | None) -> str:
    """A ``## Response Format`` section for ``json_object`` / ``json_schema`` (empty for text)."""
    if response_format is None:
        return ""
    kind = response_format.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return "## Response Format\n\nAnswer with one JSON object and nothing else."
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ChatFormatError("response_format json_schema needs json_schema.schema")
        schema = json.dumps(spec["schema"], ensure_ascii=False, separators=(",", ":"))
        return (
            f"## Response Format\n\nAnswer with one JSON object, and nothing else, that follows this schema:\n{schema}"
        )
    raise ChatFormatError(f"response_format type {kind!r} is not one of text, json_object, json_schema")


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    options: ChatOptions = ChatOptions(),
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: Mapping[str, Any] | None = None,
) -> str:
    """Render OpenAI-shaped messages (dicts) as one V4.1 prompt string (see the module docstring).

    The string is tokenized without adding special tokens: BOS is already in it."""
    if not messages:
        raise ChatFormatError("messages must hold at least one message")
    msgs = [dict(m) for m in messages]
    for i, m in enumerate(msgs):
        if m.get("role") not in ROLES:
            raise ChatFormatError(
                f"messages[{i}]: unsupported role {m.get('role')!r}: expected one of {', '.join(ROLES)}"
            )
    has_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs)
    if msgs[-1]["role"] == "assistant" and options.add_generation_prompt:
        raise ChatFormatError("the last message is the assistant's: nothing to generate (add_generation_prompt)")
    last_user = max((i for i, m in enumerate(msgs) if m["role"] != "assistant"), default=-1)

    out = [BOS]
    # the leading system block: effort line, system messages, tools, response format
    lead = []
    start = 0
    while start < len(msgs) and msgs[start]["role"] == "system":
        lead.append(_content_text(msgs[start].get("content"), f"messages[{start}]"))
        start += 1
    head = []
    if options.thinking:
        effort = effort_value(options.reasoning_effort)
        head.append(
            f"Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
        )
    sections = ["\n\n".join(lead)] if lead else []
    if tools:
        sections.append(render_tools(tools))
    fmt = render_response_format(response_format)
    if fmt:
        sections.append(fmt)
    if head or sections:
        out += [SYSTEM, *head, "\n\n".join(sections)]

    calls_by_id: dict[str, int] = {}  # the last assistant turn's tool call ids, in call order
    n_calls = 0  # how many calls the last assistant turn made
    pending_results: list[tuple[int, int, str]] = []  # (call order, arrival, text)
    user_parts: list[str] = []

    def flush_user() -> None:
        if pending_results:
            user_parts.extend(t for _, _, t in sorted(pending_results))
            pending_results.clear()
        if user_parts:
            out.extend([USER, "\n\n".join(user_parts)])
            user_parts.clear()

    for i in range(start, len(msgs)):
        m, where = msgs[i], f"messages[{i}]"
        role = m["role"]
        if role == "user":
            if pending_results:  # results first: they answer the calls that came before this text
                user_parts.extend(t for _, _, t in sorted(pending_results))
                pending_results.clear()
            user_parts.append(_content_text(m.get("content"), where))
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not n_calls:
                raise ChatFormatError(f"{where}: a tool result must follow an assistant message with tool_calls")
            if cid is not None and cid not in calls_by_id:
                raise ChatFormatError(f"{where}: tool_call_id {cid!r} answers no call of the previous assistant turn")
            order = calls_by_id[cid] if cid is not None else len(calls_by_id)  # unnamed: after the named
            text = _content_text(m.get("content"), where)
            pending_results.append((order, i, f"<tool_result>{text}</tool_result>"))
        elif role in ("system", "latest_reminder"):
            flush_user()
            token = SYSTEM if role == "system" else LATEST_REMINDER
            out.extend([token, _content_text(m.get("content"), where)])
        else:  # assistant
            flush_user()
            reasoning = m.get("reasoning_content", m.get("reasoning")) or ""
            keep = options.thinking and (has_tools or not options.drop_thinking or i > last_user)
            out.append(ASSISTANT)
            out.append(f"{THINK}{reasoning}{END_THINK}" if keep else END_THINK)
            out.append(_content_text(m.get("content"), where))
            calls = [_arguments(c, where) for c in m.get("tool_calls") or []]
            n_calls = len(calls)
            calls_by_id = {c.get("id"): k for k, c in enumerate(m.get("tool_calls") or []) if c.get("id")}
            if calls:
                out.append(render_tool_calls(calls))
            out.append(EOS)
    flush_user()
    if options.add_generation_prompt:
        out += [ASSISTANT, THINK if options.thinking else END_THINK]
    return "".join(out)


# ---- parser -----------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class ChatDelta:
    """What a piece of completion adds: reasoning, then content, then whole tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


_INVOKE = re.compile(rf'<{DSML} invoke name="([^"\n]+)">\n((?:.|\n)*?)</{DSML} invoke>\n')
_PARAM = re.compile(rf'<{DSML} parameter name="([^"\n]+)" string="(true|false)">((?:.|\n)*?)</{DSML} parameter>\n')


def _tail_hold(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that could start ``marker`` (held back while streaming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_block(block: str, tool_names: set[str] | None = None) -> list[ToolCall]:
    """``<｜DSML｜ calls>\\n...</｜DSML｜ calls>`` (without the leading blank line) -> calls, or raise."""
    head = f"<{DSML} calls>\n"
    if not block.startswith(head):
        raise ChatParseError(f"a tool block must start with {head!r}")
    pos, calls = len(head), []
    while not block.startswith(CALLS_END, pos):
        m = _INVOKE.match(block, pos)
        if m is None:
            raise ChatParseError(
                f"expected <{DSML} invoke name=...> or {CALLS_END} at offset {pos}: {block[pos : pos + 40]!r}"
            )
        name, body = m.group(1), m.group(2)
        if tool_names is not None and name not in tool_names:
            raise ChatParseError(
                f"the model called {name!r}, which is not among the tools ({', '.join(sorted(tool_names))})"
            )
        args: dict[str, Any] = {}
        p = 0
        while p < len(body):
            pm = _PARAM.match(body, p)
            if pm is None:
                raise ChatParseError(f"malformed parameter in the call of {name!r}: {body[p : p + 40]!r}")
            key, is_str, value = pm.groups()
            if key in args:
                raise ChatParseError(f"parameter {key!r} given twice in the call of {name!r}")
            if is_str == "true":
                args[key] = value
            else:
                try:
                    args[key] = json.loads(value)
                except json.JSONDecodeError:
                    raise ChatParseError(
                        f'parameter {key!r} of {name!r} has string="false" but is not JSON: {value!r}'
                    ) from None
            p = pm.end()
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        pos = m.end()
    rest = block[pos + len(CALLS_END) :]
    if rest.strip():  # the release's format has only EOS after the block
        raise ChatParseError(f"text after {CALLS_END}: {rest[:40]!r}")
    if not calls:
        raise ChatParseError("a tool block with no invoke")
    return calls


class ChatStreamParser:
    """Completion text in pieces -> :class:`ChatDelta` s. Text that could still turn into ``</think>``
    or the tool block's start is held back; tool calls come out whole at the end, once the block
    is known to be valid, so a stream never carries half a call and equals the one-shot parse.
    ``tools=False`` (no tools in the request): a DSML block is plain content."""

    def __init__(self, thinking: bool, tool_names: set[str] | None = None, tools: bool = True) -> None:
        self.phase = "reasoning" if thinking else "content"
        self.tool_names, self.tools = tool_names, tools
        self.text = ""
        self.sent = 0  # text up to here is emitted (or consumed as a marker)
        self.error: str | None = None

    def feed(self, piece: str) -> ChatDelta:
        self.text += piece
        delta = ChatDelta()
        if self.phase == "reasoning":
            end = self.text.find(END_THINK, self.sent)
            if end < 0:
                upto = len(self.text) - _tail_hold(self.text[self.sent :], END_THINK)
                delta.reasoning, self.sent = self.text[self.sent : upto], upto
                return delta
            delta.reasoning = self.text[self.sent : end]
            self.sent, self.phase = end + len(END_THINK), "content"
        if self.phase == "content":
            start = self.text.find(CALLS_START, self.sent) if self.tools else -1
            if start < 0:
                upto = len(self.text) - (_tail_hold(self.text[self.sent :], CALLS_START) if self.tools else 0)
                delta.content, self.sent = self.text[self.sent : upto], upto
                return delta
            delta.content = self.text[self.sent : start]
            self.sent, self.phase = start, "tools"
        return delta  # in the tool block: nothing goes out until finish()

    def finish(self, strict: bool = False) -> ChatDelta:
        """The end of the completion: flush what was held back and parse the tool block (only now,
        as text after it would make it malformed). A malformed block raises with ``strict``;
        otherwise its raw text becomes content and :attr:`error` says why."""
        delta = ChatDelta()
        rest, self.sent = self.text[self.sent :], len(self.text)
        if self.phase == "reasoning":
            delta.reasoning = rest
        elif self.phase == "content":
            delta.content = rest
        elif self.phase == "tools":
            try:
                delta.tool_calls = parse_tool_block(rest[2:], self.tool_names)  # past the blank line
            except ChatParseError as e:
                if strict:
                    raise
                self.error, delta.content = str(e), rest
        self.phase = "done"
        return delta


def parse_completion(text: str, thinking: bool, tool_names: set[str] | None = None) -> ParsedMessage:
    """The message a completion holds (strict: a malformed tool block raises :class:`ChatParseError`).
    ``reasoning`` is None in chat mode."""
    parser = ChatStreamParser(thinking, tool_names)
    first = parser.feed(text)
    last = parser.finish(strict=True)
    if DSML in first.content + last.content:
        raise ChatParseError(f"a {DSML} token outside a tool block (which must start with {CALLS_START!r})")
    return ParsedMessage(
        reasoning=first.reasoning + last.reasoning if thinking else None,
        content=first.content + last.content,
        tool_calls=last.tool_calls,
    )
