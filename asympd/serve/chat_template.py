"""The chat template: DeepSeek's conversation format, kept deliberately simple.

Rendered text (special tokens are DeepSeek's, which tokenizer.json knows as single tokens)::

    <｜begin▁of▁sentence｜>{system messages, joined by blank lines}
    <｜User｜>{user}<｜Assistant｜>{assistant}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜>                                  <- generation prompt

(no newlines in the real output: the lines above are broken for reading). This is the shape of
DeepSeek-V3's template without tools or "thinking" markers. System messages may appear anywhere;
they are collected at the front, as DeepSeek's template does. Roles other than system, user and
assistant are refused. With ``add_generation_prompt`` (the default) the text ends with
``<｜Assistant｜>`` unless the last message is already the assistant's (then it is continued:
no end-of-sentence token is added after it).

Why a fixed template rather than a Jinja one from the checkpoint: the prefill and decode workers
and the router must all tokenize a conversation to the same ids (the decode worker refuses a
prefix state whose prompt ids differ), and one small Python function is easy to keep identical.
Special-token strings typed by a user are tokenized as special tokens, as in vLLM's default.
"""

from __future__ import annotations

from collections.abc import Iterable

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """A conversation the template cannot render (maps to HTTP 400)."""


def apply_chat_template(messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """Render ``(role, text)`` pairs as one prompt string (see the module docstring)."""
    messages = list(messages)
    if not messages:
        raise ChatTemplateError("messages must hold at least one message")
    bad = sorted({role for role, _ in messages if role not in ROLES})
    if bad:
        raise ChatTemplateError(f"unsupported message role(s) {bad}: expected one of {', '.join(ROLES)}")
    system = "\n\n".join(text for role, text in messages if role == "system")
    turns = [(role, text) for role, text in messages if role != "system"]
    out = [BOS, system]
    for i, (role, text) in enumerate(turns):
        if role == "user":
            out += [USER, text]
        else:
            last = i == len(turns) - 1
            out += [ASSISTANT, text]
            if not (last and add_generation_prompt):
                out.append(EOS)
    if add_generation_prompt and (not turns or turns[-1][0] != "assistant"):
        out.append(ASSISTANT)
    return "".join(out)
