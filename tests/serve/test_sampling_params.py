"""vLLM's sampling parameters: presence / frequency / repetition penalties, logit_bias, min_tokens,
allowed_token_ids, bad words (against distributions computed by hand), the engine sampling from the
adjusted logits, and the HTTP surface through the hardened 1P1D deployment (the same tokens as the
offline LLM; n choices; truncate_prompt_tokens; n over the cap, best_of, prompt logprobs, priority
refused with 400 naming the field; echo)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams, adjust_logits, processed_probs
from tests.serve.cluster import metrics, stream, wait_idle
from tests.util import random_prompts

LOGITS = torch.tensor([2.0, 1.0, -1.0, 0.5, -3.0])


def _softmax(xs: list[float]) -> list[float]:
    m = max(x for x in xs if x != -math.inf)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    return [v / sum(e) for v in e]


def test_penalties_and_bias_by_hand():
    p = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={2: 3.0, 4: -1.0}
    )
    # prompt [1, 4], output [0, 0, 3]; bias first: x2 = -1 + 3 = 2, x4 = -3 - 1 = -4
    # repetition (prompt or output: 0, 1, 3, 4): positive / 2, negative * 2 -> x0 1, x1 0.5, x3 0.25, x4 -8
    # frequency 0.5 x count (0: 2, 3: 1), presence 0.25 once -> x0 1 - 1 - .25, x3 .25 - .5 - .25
    want = [-0.25, 0.5, 2.0, -0.5, -8.0]
    got = adjust_logits(LOGITS, p, [1, 4], [0, 0, 3], eos=None)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert processed_probs(got, SamplingParams(temperature=1.0)).tolist() == pytest.approx(_softmax(want), abs=1e-6)
    half = processed_probs(got, SamplingParams(temperature=0.5, top_k=2))
    assert half.tolist() == pytest.approx(_softmax([-math.inf, 1.0, 4.0, -math.inf, -math.inf]), abs=1e-6)
    assert LOGITS.tolist() == [2.0, 1.0, -1.0, 0.5, -3.0]  # the model's logits are left alone (raw logprobs)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    p = SamplingParams(min_tokens=4, stop_token_ids=[1])
    masked = adjust_logits(LOGITS, p, [2], [0, 0, 0], eos=3)
    assert masked.tolist() == [2.0, -math.inf, -1.0, -math.inf, -3.0]
    assert processed_probs(masked, SamplingParams()).tolist() == pytest.approx(
        _softmax([2.0, -math.inf, -1.0, -math.inf, -3.0]), abs=1e-6
    )
    assert adjust_logits(LOGITS, p, [2], [0, 0, 0, 0], eos=3).tolist() == LOGITS.tolist()
    ignore = SamplingParams(min_tokens=4, ignore_eos=True)
    assert adjust_logits(LOGITS, ignore, [2], [], eos=3).tolist() == LOGITS.tolist()  # nothing to mask


def test_allowed_token_ids_and_bad_words_by_hand():
    inf = math.inf
    allowed = SamplingParams(allowed_token_ids=[1, 3], logit_bias={3: 1.0, 4: 100.0})
    assert adjust_logits(LOGITS, allowed, [], [], eos=None).tolist() == [-inf, 1.0, -inf, 1.5, -inf]
    # one token: always; longer: the last token where the output (not the prompt) ends with the rest
    bad = SamplingParams(bad_words_token_ids=[[4], [0, 2], [1, 1, 3], [0, 0, 1]])
    assert adjust_logits(LOGITS, bad, [0, 0], [], eos=None).tolist() == [2.0, 1.0, -1.0, 0.5, -inf]
    assert adjust_logits(LOGITS, bad, [], [2, 1, 0], eos=None).tolist() == [2.0, 1.0, -inf, 0.5, -inf]
    assert adjust_logits(LOGITS, bad, [], [0, 1, 1], eos=None).tolist() == [2.0, 1.0, -1.0, -inf, -inf]


def test_bad_words_tokenize_as_vllms(tiny_ckpt):
    """Each word with its leading whitespace stripped, and with one leading space where that gives as
    many tokens, the first another (" BU" and " what" are a space token more: left out)."""
    from tokenizers import Tokenizer

    from asympd.serve.protocol import tokenize_bad_words

    tok = Tokenizer.from_file(f"{tiny_ckpt}/tokenizer.json")
    words = ["Hello World", "BU", "  what"]
    assert tokenize_bad_words(tok, words) == [[267, 282], [268, 282], [455], [457, 386]]
    assert [tok.encode(w, add_special_tokens=False).ids for w in (" BU", " what")] == [[35, 455], [35, 457, 386]]


def test_no_adjustment_is_the_identity():
    assert adjust_logits(LOGITS, SamplingParams(), [1], [1, 1], eos=0) is LOGITS


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
        ({"logit_bias": {1: 101.0}}, "logit_bias values must be in"),
        ({"min_p": 1.5}, "min_p must be in"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [3, 512]}, r"allowed_token_ids out of range \[0, 512\): \[512\]"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids must hold non-empty"),
        ({"bad_words_token_ids": [[1, -1]]}, r"bad_words_token_ids out of range \[0, 512\): \[-1\]"),
    ],
)
def test_validation(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw).validate(vocab_size=512)
    with pytest.raises(ValueError, match="logit_bias token ids out of range"):
        SamplingParams(logit_bias={512: 1.0}).validate(vocab_size=512)


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(tiny_ckpt, mode="asymmetric")


def test_the_engine_samples_from_the_penalized_logits(offline):
    """Greedy with (negative: repeat) frequency + presence penalties: each token is the argmax of the raw logprobs the
    engine reports minus the penalties computed by hand from the tokens before it."""
    ids = random_prompts([30], seed=90)[0]
    p = SamplingParams(
        max_tokens=12, temperature=0, logprobs=-1, ignore_eos=True, frequency_penalty=-1.5, presence_penalty=-2.0
    )
    out = offline.generate(prompt_token_ids=[ids], sampling_params=p)[0].outputs[0]
    plain = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=12, temperature=0))
    assert out.token_ids != plain[0].outputs[0].token_ids  # the penalties changed something
    for i, tok in enumerate(out.token_ids):
        lp = torch.tensor([out.logprobs[i][t] for t in range(len(out.logprobs[i]))])
        counts = torch.bincount(torch.tensor(out.token_ids[:i], dtype=torch.long), minlength=lp.numel()).float()
        assert tok == int(torch.argmax(lp + 1.5 * counts + 2.0 * (counts > 0).float()))


def _post(dep, body, kind="completions"):
    return httpx.post(f"{dep.router}/v1/{kind}", json=body, headers=dep.auth, timeout=60)


def test_http_penalties_match_offline(hardened, offline):
    ids = random_prompts([40], seed=91)[0]
    knobs = {"presence_penalty": 0.7, "frequency_penalty": 0.3, "repetition_penalty": 1.3, "logit_bias": {"7": 2.5}}
    for temperature, seed in ((0.0, None), (0.8, 1234)):
        body = {"prompt": ids, "max_tokens": 8, "temperature": temperature, "seed": seed, "return_token_ids": True}
        r = _post(hardened, {**body, **knobs, "ignore_eos": True})
        assert r.status_code == 200, r.text
        p = SamplingParams(
            max_tokens=8,
            temperature=temperature,
            seed=seed,
            ignore_eos=True,
            presence_penalty=0.7,
            frequency_penalty=0.3,
            repetition_penalty=1.3,
            logit_bias={7: 2.5},
        )
        want = offline.generate(prompt_token_ids=[ids], sampling_params=p)[0].outputs[0].token_ids
        assert r.json()["choices"][0]["token_ids"] == want


def test_http_logit_bias_and_min_tokens(hardened):
    dep = hardened
    ids = random_prompts([40], seed=92)[0]
    r = _post(
        dep, {"prompt": ids, "max_tokens": 5, "temperature": 0, "logit_bias": {"42": 100}, "return_token_ids": True}
    )
    assert r.json()["choices"][0]["token_ids"] == [42] * 5
    first = _post(dep, {"prompt": ids, "max_tokens": 1, "temperature": 0, "return_token_ids": True}).json()
    tok = first["choices"][0]["token_ids"][0]
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "stop_token_ids": [tok], "return_token_ids": True}
    assert _post(dep, body).json()["choices"][0]["token_ids"] == [tok]  # stops at once
    held = _post(dep, {**body, "min_tokens": 3}).json()["choices"][0]
    assert len(held["token_ids"]) >= 3 and tok not in held["token_ids"][:3]
    wait_idle([dep.prefill, dep.decode])


def _error(r: httpx.Response, message: str, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": message, "type": "BadRequestError", "param": param, "code": 400}


def test_http_allowed_token_ids(hardened, offline):
    """vLLM's allowed_token_ids: only those tokens are sampled, greedy or seeded (through the router,
    P and D: the offline engine's tokens); out of range or empty, a 400 naming the field. It was
    ignored: the plain tokens came."""
    ids = random_prompts([40], seed=99)[0]
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = _post(hardened, body).json()["choices"][0]["token_ids"]
    allowed = [t for t in range(3, 512) if t not in plain]
    for temperature, seed in ((0.0, None), (0.8, 5)):
        r = _post(hardened, {**body, "temperature": temperature, "seed": seed, "allowed_token_ids": allowed})
        got = r.json()["choices"][0]["token_ids"]
        p = SamplingParams(max_tokens=6, temperature=temperature, seed=seed, ignore_eos=True, allowed_token_ids=allowed)
        assert got == offline.generate(prompt_token_ids=[ids], sampling_params=p)[0].outputs[0].token_ids
        assert len(got) == 6 and not set(got) & set(plain)
    _error(
        _post(hardened, {**body, "allowed_token_ids": [5, 512]}),
        "allowed_token_ids out of range [0, 512): [512]",
        "allowed_token_ids",
    )
    _error(
        _post(hardened, {**body, "allowed_token_ids": []}),
        "allowed_token_ids must not be empty: it would leave no token to sample",
        "allowed_token_ids",
    )


def test_http_bad_words(hardened, offline):
    """vLLM's bad_words, tokenized by the server: with logit_bias forcing "Hello" (267), the word
    "HelloHello" ([267, 267], and [268, 267] for " HelloHello") masks 267 only right after a 267, so
    the greedy tokens alternate; "Hello" masks 267 and " Hello" (268) always. The offline engine's
    tokens given those sequences. It was ignored: 267 every time."""
    body = {"prompt": random_prompts([40], seed=94)[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body |= {"logit_bias": {"267": 100}, "return_token_ids": True}
    assert _post(hardened, body).json()["choices"][0]["token_ids"] == [267] * 6
    for words, seqs in ((["HelloHello"], [[267, 267], [268, 267]]), (["Hello"], [[267], [268]])):
        got = _post(hardened, {**body, "bad_words": words}).json()["choices"][0]["token_ids"]
        p = SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, logit_bias={267: 100}, bad_words_token_ids=seqs
        )
        assert got == offline.generate(prompt_token_ids=[body["prompt"]], sampling_params=p)[0].outputs[0].token_ids
        if len(seqs[0]) == 2:
            assert got[::2] == [267] * 3 and 267 not in got[1::2]
        else:
            assert not {267, 268} & set(got)
    _error(
        _post(hardened, {**body, "bad_words": ["x", " "]}),
        "bad_words[1] is empty: ' ' tokenizes to no token",
        "bad_words",
    )


def test_http_truncate_prompt_tokens(hardened, tiny_ckpt):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, before the context-length check
    (a prompt over max_seq_len 4096, or a text over what 4096 tokens can hold, is served), for chat
    too; usage counts the truncated prompt. The router counts the truncated prompt as the workers
    do: k over W goes through P, k <= W (16) skips P. echo of token ids: the kept ones (vLLM's). It
    was ignored (the long prompt a 400)."""
    from tokenizers import Tokenizer

    ids = random_prompts([4100], seed=100)[0]
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    for k, path in ((40, "remote"), (12, "local")):
        got = _post(hardened, {**body, "prompt": ids, "truncate_prompt_tokens": k})
        assert got.status_code == 200, got.text
        want = _post(hardened, {**body, "prompt": ids[-k:]}).json()
        got = got.json()
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["prompt_token_ids"] == ids[-k:] and got["usage"] == want["usage"]
        assert got["usage"]["prompt_tokens"] == k and got["asympd_timings"]["prefill_path"] == path
    tok = Tokenizer.from_file(f"{tiny_ckpt}/tokenizer.json")
    echo = _post(hardened, {**body, "prompt": ids, "truncate_prompt_tokens": 12, "echo": True}).json()
    assert echo["choices"][0]["text"] == tok.decode(ids[-12:]) + tok.decode(want["choices"][0]["token_ids"])
    text = "hello world " * 8000  # 96,000 characters: over 4096 x the longest token's 21
    tail = tok.encode(text).ids[-30:]
    got = _post(hardened, {**body, "prompt": text, "truncate_prompt_tokens": 30}).json()
    want = _post(hardened, {**body, "prompt": tail}).json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"] and got["prompt_token_ids"] == tail
    chat = {**body, "messages": [{"role": "user", "content": "hello world the model " * 10}]}
    full = _post(hardened, chat, "chat/completions").json()["prompt_token_ids"]
    got = _post(hardened, {**chat, "truncate_prompt_tokens": 24}, "chat/completions").json()
    want = _post(hardened, {**body, "prompt": full[-24:]}).json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["usage"]["prompt_tokens"] == 24 < len(full)
    _error(
        _post(hardened, {**body, "prompt": ids[:40], "truncate_prompt_tokens": 0}),
        "truncate_prompt_tokens must be a positive integer, got 0",
        "truncate_prompt_tokens",
    )


def test_http_priority_logits_processors_and_chat_template_are_refused_by_name(hardened):
    """vLLM refuses a nonzero priority unless priority scheduling is on: this server schedules first
    come, first served (0 is accepted); logits_processors (custom code) are not available; a
    request's own chat_template (vLLM takes one only behind a trust flag). All were ignored."""
    body = {"prompt": random_prompts([40], seed=101)[0], "max_tokens": 2, "temperature": 0}
    assert _post(hardened, {**body, "priority": 0}).status_code == 200
    _error(
        _post(hardened, {**body, "priority": -1}),
        "priority=-1 is not supported: requests are scheduled first come, first served (no priority "
        "scheduling); send 0 or leave it out",
        "priority",
    )
    _error(
        _post(hardened, {**body, "logits_processors": ["my.module.Processor"]}, "chat/completions"),
        "logits_processors is not supported: this server has no custom logits processors",
        "logits_processors",
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _error(
        _post(hardened, {**chat, "chat_template": "{{ messages }}"}, "chat/completions"),
        "chat_template is not supported: this server renders the model's own conversation format",
        "chat_template",
    )


def test_http_skip_special_tokens(hardened):
    """vLLM's skip_special_tokens: special tokens are left out of the text by default, kept with
    False (through the router, P and D; it was ignored, the text always without them)."""
    from asympd.model.tiny_tokenizer import SPECIAL_TOKENS

    body = {"prompt": random_prompts([40], seed=96)[0], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    body |= {"logit_bias": {"0": 100}, "return_token_ids": True}  # BOS, a special token, twice
    default = _post(hardened, body).json()["choices"][0]
    assert default["token_ids"] == [0, 0] and default["text"] == ""
    kept = _post(hardened, {**body, "skip_special_tokens": False}).json()["choices"][0]
    assert kept["text"] == SPECIAL_TOKENS[0] * 2
    wait_idle([hardened.prefill, hardened.decode])


def test_http_a_tiny_temperature_samples_at_vllms_floor(hardened):
    """Dividing the logits by a temperature under ~1e-37 overflowed them: every token was 0, the
    draw of a NaN distribution. Such a temperature samples at 0.01 now, as vLLM's; a repetition
    penalty that small (it divides the logits too) is refused, and so is a temperature past fp32's
    largest value."""
    ids = random_prompts([40], seed=93)[0]
    body = {"prompt": ids, "max_tokens": 4, "seed": 7, "ignore_eos": True, "return_token_ids": True}
    floor = _post(hardened, {**body, "temperature": 0.01}).json()["choices"][0]["token_ids"]
    assert floor != [0, 0, 0, 0]
    for t in (1e-40, 5e-324):
        assert _post(hardened, {**body, "temperature": t}).json()["choices"][0]["token_ids"] == floor
    r = _post(hardened, {**body, "repetition_penalty": 1e-40})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "repetition_penalty must be in [1e-4, 1e4], got 1e-40"
    # past fp32's largest the divisor was inf: a token min_tokens masks had logit -inf / inf = NaN
    r = _post(hardened, {**body, "temperature": 1e39, "min_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": "temperature must be in [0, 3.403e+38] (fp32's largest), got 1e+39",
        "type": "BadRequestError",
        "param": "temperature",
        "code": 400,
    }
    big = _post(hardened, {**body, "temperature": 3e38, "min_tokens": 2})
    assert big.status_code == 200, big.text


def test_http_min_p_filters_what_d_samples(hardened):
    """min_p keeps the tokens whose probability is at least min_p x the most likely one's (vLLM's
    filter, on the tempered distribution): at 1 only the most likely token is left, so a hot seeded
    draw through the router, P and D gives the greedy tokens; it was ignored (a hot draw)."""
    ids = random_prompts([40], seed=95)[0]
    body = {"prompt": ids, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    greedy = _post(hardened, {**body, "temperature": 0}).json()["choices"][0]["token_ids"]
    hot = {**body, "temperature": 5.0, "seed": 3}
    assert _post(hardened, hot).json()["choices"][0]["token_ids"] != greedy  # the draw is hot without it
    assert _post(hardened, {**hot, "min_p": 1.0}).json()["choices"][0]["token_ids"] == greedy
    r = _post(hardened, {**body, "min_p": -0.1})
    assert r.status_code == 400 and r.json()["error"] == {
        **r.json()["error"],
        "message": "min_p must be in [0, 1], got -0.1",
        "param": "min_p",
    }, r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 17}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"model": 5}, "model"),  # the router's 404 "The model `5` does not exist" was misleading
        ({"model": ["tiny"]}, "model"),  # the router's 500 (a list looked up in a set)
    ],
)
def test_http_refused_parameters_name_the_field(hardened, body, param):
    r = _post(hardened, {"prompt": "hello world", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if param == "model":
        assert r.json()["error"]["message"] == "invalid request: model: Input should be a valid string"


def test_http_echo(hardened):
    dep = hardened
    body = {"prompt": "hello world the model", "max_tokens": 3, "temperature": 0, "echo": True}
    full = _post(dep, body).json()["choices"][0]["text"]
    plain = _post(dep, {**body, "echo": False}).json()["choices"][0]["text"]
    assert full == "hello world the model" + plain
    with httpx.Client(timeout=60, headers=dep.auth) as c:
        assert stream(c, f"{dep.router}/v1/completions", body)["text"] == full


def test_http_n_choices_through_p_and_d(hardened, offline):
    """n through the router in mode asymmetric: P runs the prompt once, D runs n requests on the one
    prefix state, computing its rows once (the others fork). Greedy: n equal choices, the offline
    engine's tokens; seeded: choice i is the request of n=1 seeded seed + i; streamed: the chunks
    fold per index into the same choices."""
    dep = hardened
    ids = random_prompts([40], seed=97)[0]  # over the window: P computes a prefix, D imports it
    want = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=5, temperature=0))
    want = want[0].outputs[0].token_ids
    body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    before = metrics(dep.decode)
    r = _post(dep, {**body, "n": 3})
    assert r.status_code == 200, r.text
    after = metrics(dep.decode)
    # D computes its rows [24, 40) once: choices 1 and 2 fork from choice 0 at its last row (they
    # import nothing, so only choice 0 looked its prefix up in the prefix cache)
    delta = {k: after[k] - before[k] for k in after if k.startswith(("asympd_prefix_cache", "asympd_prompt_tokens"))}
    assert delta == {
        "asympd_prefix_cache_queries_total": 24,
        "asympd_prefix_cache_hits_total": 0,
        "asympd_prompt_tokens_total": 16,
    }
    got = r.json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2] and all(c["token_ids"] == want for c in got["choices"])
    assert got["usage"] == {"prompt_tokens": 40, "completion_tokens": 15, "total_tokens": 55}
    assert got["asympd_timings"]["prefill_path"] == "remote"
    hot = {**body, "temperature": 1.0, "seed": 2**64 - 1}  # choice 1: seed + 1 wraps to 0
    singles = [_post(dep, {**hot, "seed": s}).json()["choices"][0]["token_ids"] for s in (2**64 - 1, 0)]
    assert singles[0] != singles[1]
    r = _post(dep, {**hot, "n": 2}).json()
    assert [c["token_ids"] for c in r["choices"]] == singles
    with httpx.Client(timeout=60, headers=dep.auth) as c:
        s = stream(c, f"{dep.router}/v1/completions", {**hot, "n": 2, "stream_options": {"include_usage": True}})
    assert s["done"] and not s["errors"] and s["usage"] == r["usage"]
    for i, choice in enumerate(r["choices"]):
        chunks = [ch for ev in s["events"] for ch in ev["choices"] if ch["index"] == i]
        assert "".join(ch["text"] for ch in chunks) == choice["text"]
        assert [t for ch in chunks for t in ch["token_ids"]] == choice["token_ids"]
    wait_idle([dep.prefill, dep.decode])


def test_http_a_client_leaving_an_n_stream_frees_p_and_d(hardened):
    dep = hardened
    before = metrics(dep.decode)["asympd_generation_tokens_total"]
    body = {"prompt": random_prompts([40], seed=98)[0], "max_tokens": 3000, "ignore_eos": True, "n": 2}
    seen: set[int] = set()
    with httpx.stream(
        "POST", f"{dep.router}/v1/completions", json={**body, "stream": True}, headers=dep.auth, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if seen == {0, 1}:
                break
    wait_idle([dep.prefill, dep.decode], timeout=10)  # 2 x 3000 tokens would take far longer
    assert metrics(dep.decode)["asympd_generation_tokens_total"] - before < 1000
