"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a request's prompt ids exactly as this
deployment computes them (a completion's ``prompt``, or a chat's ``messages`` through V4.1's
format), so that a client can count tokens against ``max_model_len`` before it sends. Workers answer
them; the router has a decode worker answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asympd.serve import protocol as P

PromptIds = Callable[[str, "P.CompletionRequest | P.ChatCompletionRequest"], list[int]]


def tokenize(tokenizer: Any, body: dict[str, Any], max_model_len: int, prompt_ids: PromptIds) -> dict:
    """``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` when asked) for a body holding
    ``prompt`` (a completion's) or ``messages`` (a chat's, with its template options), through the
    worker's own ``prompt_ids`` (what a request of that body runs with). Blocking."""
    if tokenizer is None:
        raise P.APIError("no tokenizer: this checkpoint has no tokenizer.json", 503)
    want_strs = body.get("return_token_strs", False)
    if not isinstance(want_strs, bool):
        raise P.APIError(f"return_token_strs must be a boolean, got {want_strs!r}", param="return_token_strs")
    request = {k: v for k, v in body.items() if k != "return_token_strs"}
    if ("prompt" in request) == ("messages" in request):
        raise P.APIError("give either prompt (a completion's) or messages (a chat's)", param="prompt")
    kind = "chat" if "messages" in request else "completion"
    req = P.parse_request(kind, request)
    if isinstance(req, P.ChatCompletionRequest):
        images = (p.get("type") == "image_url" for m in req.messages if isinstance(m.content, list) for p in m.content)
        if any(images):
            raise P.APIError("tokenize counts text: an image's span depends on its size", param="messages")
    elif not isinstance(req.single_prompt(), str):
        raise P.APIError("prompt must be text (token ids are their own count)", param="prompt")
    ids = req.truncate(prompt_ids(kind, req))  # truncate_prompt_tokens, as a request runs
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if want_strs:
        out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return out


def detokenize(tokenizer: Any, body: dict[str, Any]) -> dict:
    """``{"prompt"}``: the text of ``tokens`` (special tokens kept, as vLLM's). Blocking."""
    if tokenizer is None:
        raise P.APIError("no tokenizer: this checkpoint has no tokenizer.json", 503)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise P.APIError("tokens must be a list of token ids", param="tokens")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise P.APIError(f"token ids out of range [0, {vocab_size}): {bad[:8]}", param="tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}
