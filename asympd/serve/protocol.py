"""OpenAI-compatible request bodies, response builders and errors (vLLM's shapes, its users are ours).

Requests are parsed with pydantic but validated by hand into ``SamplingParams`` so every refusal
carries a message a person can act on. Unknown fields are ignored, as vLLM does. Fields beyond
OpenAI's follow vLLM's names: ``top_k``, ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``return_token_ids``, ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, ``priority``, ``kv_transfer_params``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asympd.engine import modes
from asympd.engine.sampling_params import SamplingParams, SamplingParamsError  # torch-free: the router parses too
from asympd.serve.chat_format import ChatDelta, ChatFormatError, ChatOptions, ChatStreamParser, encode_messages

# ---- errors -----------------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "BadRequestError",
    422: "BadRequestError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class APIError(Exception):
    """Raised anywhere in a handler; becomes ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw.strip():
        raise APIError("the request body is empty: expected a JSON object")
    try:
        body = json.loads(raw, parse_constant=_NonFinite, parse_float=_finite_float, parse_int=_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(f"malformed JSON in the request body: {e}") from None
    except RecursionError:
        raise APIError("malformed JSON in the request body: nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        bad = _find_invalid(value)
        if bad is not None:
            raise APIError(f"{key}: {bad}", param=key)
    return body


class _NonFinite(str):
    """NaN, Infinity or a literal too large for a float: kept as a marker to name its field."""


def _finite_float(text: str) -> float | _NonFinite:
    x = float(text)
    return x if math.isfinite(x) else _NonFinite(text)


class _LongInt(str):
    """An integer literal with more digits than Python converts (``sys.get_int_max_str_digits``)."""


def _int(text: str) -> int | _LongInt:
    try:
        return int(text)
    except ValueError:  # over 4300 digits: a marker, to name its field
        return _LongInt(text)


def _find_invalid(v: Any) -> str | None:
    """What is wrong with the first value JSON parsed but no field can take: a non-finite number,
    an integer of thousands of digits, or a string (value or key) holding a lone surrogate, which
    JSON can escape ("\\ud800") but no UTF-8 text (a tokenizer's input, a forwarded body) can hold."""
    if isinstance(v, _NonFinite):
        return f"{v} is not a finite number"
    if isinstance(v, _LongInt):
        return f"an integer of {len(v.lstrip('-'))} digits is out of range"
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"a lone surrogate (U+{ord(v[e.start]):04X}) is not valid Unicode"
        return None
    children = [*v.keys(), *v.values()] if isinstance(v, dict) else v if isinstance(v, list) else ()
    return next((b for c in children if (b := _find_invalid(c)) is not None), None)


def _validation_param(e: ValidationError) -> str | None:
    errors = e.errors()
    loc = errors[0].get("loc", ()) if errors else ()
    return str(loc[0]) if loc else None


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts)


# ---- request bodies ---------------------------------------------------------------------------------


MAX_N = 16  # choices of one prompt per request (OpenAI's n): each is an engine request of its own
# a choice's engine request id: the request's own for n=1, ``{id}/{index}`` for n > 1 (an abort of the
# request's id aborts every choice's)
CHOICE_ID_SEP = "/"


def choice_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}{CHOICE_ID_SEP}{i}" for i in range(n)]


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: the request's + index (vLLM's), wrapped into the 64 bits a seed takes."""
    if seed is None:
        return None
    s = seed + index
    return s - 2**64 if s >= 2**64 else s


def check_n_for_mode(n: int, mode: str | None) -> None:
    """n > 1 where the prefill worker samples the first token: every choice would begin with that
    same token, which is not n independent samples; refused."""
    if n > 1 and mode in modes.FIRST_TOKEN_FROM_PREFILL:
        raise APIError(
            f"n={n} is not supported in mode {mode}: its prefill worker samples the first token, so every "
            f"choice would begin with that same token (not {n} independent samples); send {n} requests, or "
            "deploy mode asymmetric or encoder-only",
            param="n",
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)


class _Common(BaseModel):
    """Fields both endpoints share. NaN and infinities are refused for every number."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, lt=2**63)  # a count the context check can still print
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a torch generator takes
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    priority: int = 0  # vLLM's: only 0 here (first come, first served)
    best_of: int | None = None
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens in the text
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise APIError("stop strings must be non-empty", param="stop")
        return stops

    def truncate(self, ids: list[int]) -> list[int]:
        """The prompt the request runs with: its last ``truncate_prompt_tokens`` tokens (vLLM's)."""
        k = self.truncate_prompt_tokens
        return ids if k is None or len(ids) <= k else ids[-k:]

    def _sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        defaults: Mapping[str, Any],
        bad_words_token_ids: list[list[int]] | None,
    ) -> SamplingParams:
        """``defaults`` (``sampling_defaults``) for the fields the request leaves out;
        ``bad_words_token_ids``: ``bad_words`` tokenized (``tokenize_bad_words``)."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        if self.best_of not in (None, 1):
            raise APIError(f"best_of={self.best_of} is not supported: only 1", param="best_of")
        if self.prompt_logprobs is not None:
            raise APIError(
                "prompt_logprobs is not supported: a disaggregated decode worker never computes the prompt's logits",
                param="prompt_logprobs",
            )
        bias: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
        if max_tokens is None or max_tokens <= 0:
            raise APIError(f"max_tokens must be a positive integer, got {max_tokens}", param="max_tokens")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1) or -1,  # 0 and -1: no limit
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=bias,
            min_tokens=self.min_tokens,
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            bad_words_token_ids=list(bad_words_token_ids or []),
        )
        try:
            params.validate()
        except SamplingParamsError as e:
            raise APIError(str(e), param=e.param if e.param in type(self).model_fields else None) from None
        return params


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        """One prompt per request: a string or token ids (a one-element batch is accepted)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(
                    f"batched prompts ({len(p)}) are not supported: send one request per prompt", param="prompt"
                )
            p = p[0]
        if self.echo and self.logprobs is not None:
            raise APIError(
                "echo with logprobs needs prompt logprobs, which a disaggregated decode worker never computes",
                param="echo",
            )
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        return p

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_seq_len: int,
        defaults: Mapping[str, Any] | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise APIError(f"logprobs must be in [0, 20], got {self.logprobs}", param="logprobs")
        defaults = defaults or {}
        n = self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens", 16)
        return self._sampling(n, self.logprobs, defaults, bad_words_token_ids)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


CHAT_TEMPLATE_KWARGS = ("thinking", "reasoning_effort", "drop_thinking")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, lt=2**63)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def text_chars(self) -> int:
        """Characters of text the messages carry: what the router and the workers bound before
        rendering, so a request too long to fit is refused unread (the body limit bounds the rest)."""
        n = 0
        for m in self.messages:
            if isinstance(m.content, str):
                n += len(m.content)
            elif isinstance(m.content, list):
                n += sum(len(str(p.get("text") or "")) for p in m.content if isinstance(p, dict))
            n += len(m.reasoning_content or "") + len(m.reasoning or "")
        return n

    def chat_options(self) -> ChatOptions:
        """vLLM's knobs: ``chat_template_kwargs`` (thinking, reasoning_effort, drop_thinking) over the
        top-level ``reasoning_effort``."""
        kw = dict(self.chat_template_kwargs or {})
        unknown = sorted(set(kw) - set(CHAT_TEMPLATE_KWARGS))
        if unknown:
            raise APIError(
                f"chat_template_kwargs: unknown key(s) {unknown}: accepted are {', '.join(CHAT_TEMPLATE_KWARGS)}",
                param="chat_template_kwargs",
            )
        top_level_effort = "reasoning_effort" not in kw
        kw.setdefault("reasoning_effort", self.reasoning_effort)
        try:
            return ChatOptions.build(add_generation_prompt=self.add_generation_prompt, **kw)
        except ChatFormatError as e:
            effort = str(e).startswith("reasoning_effort") and top_level_effort
            raise APIError(str(e), param="reasoning_effort" if effort else "chat_template_kwargs") from None

    def tools_enabled(self) -> bool:
        """Whether tools go into the prompt and tool calls are parsed (``tool_choice`` auto or none)."""
        choice = self.tool_choice
        if choice not in (None, "auto", "none"):
            raise APIError(
                f"tool_choice {choice!r} is not supported (it needs guided decoding): use auto or none",
                param="tool_choice",
            )
        return bool(self.tools) and choice != "none"

    def render_prompt(self) -> str:
        """The V4.1 prompt text; every worker and the router render a request the same way."""
        options = self.chat_options()
        messages = self.message_dicts()  # image parts render as <｜deepseek_image｜> (serve/vision_inputs.py)
        try:
            return encode_messages(
                messages, options, self.tools if self.tools_enabled() else None, self.response_format
            )
        except ChatFormatError as e:  # the field the message names (tools[i]: ..., response_format ...)
            field = next((f for f in ("tools", "response_format") if str(e).startswith(f)), "messages")
            raise APIError(str(e), param=field) from None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def output(self) -> ChatOutput:
        """The parser of this request's completion into OpenAI message / delta fields."""
        names = {t.get("function", {}).get("name") for t in self.tools or []} if self.tools_enabled() else None
        return ChatOutput(ChatStreamParser(self.chat_options().thinking, names, tools=self.tools_enabled()))

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_seq_len: int,
        defaults: Mapping[str, Any] | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> SamplingParams:
        defaults = defaults or {}
        n = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if n is None:  # vLLM: whatever room the context leaves, at most the generation config's
            n = max(min(max_seq_len - num_prompt_tokens, defaults.get("max_tokens", max_seq_len)), 1)
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return self._sampling(n, (self.top_logprobs or 0) if self.logprobs else None, defaults, bad_words_token_ids)


# vLLM's extensions whose effect a client relies on and this server does not have: refused by name,
# where any other unknown field is ignored (a client asking for JSON must not get free text silently)
UNSUPPORTED = {
    "use_beam_search": "beam search",
    **{f: "guided decoding" for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "structured_outputs": "guided decoding",
    "logits_processors": "custom logits processors",
}


def parse_request(kind: str, body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise APIError(f"{name} is not supported: this server has no {what}", param=name)
    if kind == "completion" and body.get("response_format") not in (None, {"type": "text"}):
        raise APIError("response_format is for chat completions here", param="response_format")
    if kind != "completion" and body.get("chat_template") is not None:  # vLLM's default refuses it too
        raise APIError(
            "chat_template is not supported: this server renders the model's own conversation format",
            param="chat_template",
        )
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise APIError(_validation_message(e), param=_validation_param(e)) from None
    if not 1 <= req.n <= MAX_N:  # here, so the router refuses it too
        raise APIError(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.stream_options is not None and not req.stream:  # as vLLM
        raise APIError("stream_options is only allowed with stream: true", param="stream_options")
    if req.priority != 0:  # vLLM refuses it unless priority scheduling is on; this server has none
        raise APIError(
            f"priority={req.priority} is not supported: requests are scheduled first come, first served "
            "(no priority scheduling); send 0 or leave it out",
            param="priority",
        )
    k = req.truncate_prompt_tokens
    if k is not None and k < 1:  # here, so the router counts the prompt the workers run
        raise APIError(f"truncate_prompt_tokens must be a positive integer, got {k}", param="truncate_prompt_tokens")
    return req


def tokenize_bad_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's ``bad_words`` as token id sequences: each word (leading whitespace stripped) as it
    tokenizes alone, and with a leading space where that gives as many tokens, the first another
    (the word inside a text). Blocking (tokenizes)."""
    if tokenizer is None:
        raise APIError("bad_words needs this checkpoint's tokenizer.json (it has none)", param="bad_words")
    out: list[list[int]] = []
    for i, word in enumerate(words):
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False).ids
        if not bare:
            raise APIError(f"bad_words[{i}] is empty: {word!r} tokenizes to no token", param="bad_words")
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


# ---- responses --------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    entries: list[dict[int, float]], tokens: list[int], token_text, text_offset: int, top_n: int
) -> dict[str, Any]:
    """OpenAI's legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for tok, entry in zip(tokens, entries, strict=False):
        s = token_text(tok)
        out["tokens"].append(s)
        out["token_logprobs"].append(entry.get(tok))
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[: max(top_n, 1)] if top_n else []
        out["top_logprobs"].append({token_text(t): lp for t, lp in ranked} if top_n else None)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(entries: list[dict[int, float]], tokens: list[int], token_text, top_n: int) -> dict[str, Any]:
    """OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tok, entry in zip(tokens, entries, strict=False):
        s = token_text(tok)
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n] if top_n else []
        content.append(
            {
                "token": s,
                "logprob": entry.get(tok),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())} for t, lp in ranked
                ],
            }
        )
    return {"content": content}


def response_envelope(
    kind: str, request_id: str, model: str, created: int | None = None, chunk: bool = False
) -> dict[str, Any]:
    obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}[kind]
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model}


class ChatOutput:
    """One chat request's completion as OpenAI fields: ``reasoning`` (and its alias
    ``reasoning_content``), ``content``, ``tool_calls``; streamed in that order. A malformed tool
    block is sent as content (the request still succeeds); the parse error is logged by the caller."""

    def __init__(self, parser: ChatStreamParser) -> None:
        self.parser = parser
        self.thinking = parser.phase == "reasoning"
        self.reasoning, self.content = "", ""
        self.tool_calls: list[dict[str, Any]] = []

    def _take(self, text: str, final: bool) -> ChatDelta:
        d = self.parser.feed(text)
        if final:
            last = self.parser.finish()
            d.reasoning, d.content = d.reasoning + last.reasoning, d.content + last.content
            d.tool_calls += last.tool_calls
        self.reasoning += d.reasoning
        self.content += d.content
        self.tool_calls += [c.openai(len(self.tool_calls) + k) for k, c in enumerate(d.tool_calls)]
        return d

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """A stream chunk's ``delta`` for the next piece of completion text."""
        start = len(self.tool_calls)
        d = self._take(text, final)
        out: dict[str, Any] = {}
        if d.reasoning:
            out["reasoning"] = out["reasoning_content"] = d.reasoning
        if d.content or (not out and not final):
            out["content"] = d.content
        if d.tool_calls:
            out["tool_calls"] = self.tool_calls[start:]
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole completion as a response ``message``."""
        self._take(text, final=True)
        reasoning = self.reasoning if self.thinking else None
        msg: dict[str, Any] = {"role": "assistant", "content": self.content, "reasoning": reasoning}
        msg["reasoning_content"] = reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.tool_calls]
            if not self.content.strip():
                msg["content"] = None
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.tool_calls and reason == "stop" else reason

    @property
    def error(self) -> str | None:
        return self.parser.error
