"""The step's batched sampler (asympd.engine.sampler): draws match processed_probs, top-k/top-p
masks are exact, seeded requests are batch-invariant, logprobs are log_softmax's own values, and a
step of B sampled requests copies to the host once, whatever B is."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.engine import engine as engine_module
from asympd.engine.sampler import SampleJob, batched_probs, race, rejection_batch, sample_step
from asympd.engine.sampling import adjust_logits, processed_probs
from asympd.engine.scheduler import SchedulerConfig
from tests.engine.test_spec_decode import chi_square_pvalue
from tests.util import random_prompts


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_first_maximum_and_seeded_draws_repeat():
    logits = torch.randn(1, 100, generator=seeded(0))
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [sample_step([SampleJob(logits, params, seeded(7))])[0].tokens for _ in range(2)]
    assert draws[0] == draws[1]
    tie = torch.tensor([[1.0, 3.0, 3.0]])
    assert sample_step([SampleJob(tie, SamplingParams(temperature=0))])[0].tokens == [1]  # no host argmax given
    assert sample_step([SampleJob(tie, SamplingParams(temperature=0), argmax=[2])])[0].tokens == [2]  # taken as is


def test_a_seeded_row_draws_the_same_token_alone_and_in_any_batch():
    rows = torch.randn(6, 300, generator=seeded(1))
    params = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.5, seed=2),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, top_k=3, top_p=0.8, logprobs=2),
        SamplingParams(temperature=1.0, seed=3, logprobs=-1),
    ]

    def jobs(idx):
        return [SampleJob(rows[i : i + 1], params[i], seeded(params[i].seed) if params[i].seed else None) for i in idx]

    together = sample_step(jobs(range(6)))
    for i in (0, 2, 5):
        alone = sample_step(jobs([i]))[0]
        assert alone.tokens == together[i].tokens and alone.logprobs == together[i].logprobs


def test_batched_probs_equal_processed_probs_and_masks_are_exact():
    v = 50
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0.5, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.7),
        SamplingParams(temperature=2.0, top_k=v),
        SamplingParams(temperature=1.0, top_p=0.05),  # only the top token
        SamplingParams(temperature=1.0, top_k=-1, top_p=1.0),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.7, min_p=0.05, top_k=6, top_p=0.9),
        SamplingParams(temperature=1.5, min_p=1.0),  # only the top token
    ]
    logits = torch.randn(len(params), v, generator=seeded(2)) * 2
    got = batched_probs(logits, params)
    for row, p, want in zip(
        got, params, (processed_probs(lg, p) for lg, p in zip(logits, params, strict=True)), strict=True
    ):
        assert torch.equal(row > 0, want > 0), p
        assert torch.allclose(row, want, atol=1e-6)
    # 400 draws per row in one batch: nothing outside a row's support is ever drawn
    reps = 400
    tokens = race(got.repeat(reps, 1), [None] * (reps * len(params))).view(reps, len(params))
    for j, p in enumerate(params):
        allowed = set((got[j] > 0).nonzero().flatten().tolist())
        assert set(tokens[:, j].tolist()) <= allowed, p
        if p.top_k == 1 or p.top_p == 0.05:
            assert set(tokens[:, j].tolist()) == {int(logits[j].argmax())}


@pytest.mark.parametrize("with_seeds", [False, True])
def test_draws_follow_processed_probs(with_seeds):
    """A chi-square test on a 6-token vocabulary: 3000 draws in one batch (unseeded rows share one
    draw from the global generator; seeded rows each use their own)."""
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.5])
    for params in (SamplingParams(temperature=0.9), SamplingParams(temperature=1.4, top_k=4, top_p=0.9)):
        n = 3000
        gens = [seeded(i) if with_seeds else None for i in range(n)]
        tokens = sample_step([SampleJob(logits[None], params, g) for g in gens])
        counts = Counter(d.tokens[0] for d in tokens)
        want = processed_probs(logits, params)
        probs = {t: float(x) for t, x in enumerate(want) if x > 0}
        assert chi_square_pvalue(counts, probs, n) > 1e-3


def test_logprobs_are_log_softmax_values_exactly():
    rows = torch.randn(4, 40, generator=seeded(3)) * 3
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.8, logprobs=3, seed=4),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=0, logprobs=-1),
    ]
    out = sample_step(
        [
            SampleJob(rows[i : i + 1], p, seeded(4) if p.seed else None, [int(rows[i].argmax())])
            for i, p in enumerate(params)
        ]
    )
    for row, p, d in zip(rows, params, out, strict=True):
        lp = torch.log_softmax(row, dim=-1)
        (tok,), (got,) = d.tokens, d.logprobs
        if p.logprobs == -1:
            assert got == {t: float(x) for t, x in enumerate(lp)}
            continue
        top = torch.topk(lp, p.logprobs)
        want = {tok: float(lp[tok]), **{int(i): float(x) for i, x in zip(top.indices, top.values, strict=True)}}
        assert got == want and list(got)[0] == tok  # the sampled token first (vLLM's shape)


def test_rejection_batch_equals_each_request_alone():
    """Four requests with 1..3 drafts verified in one batch accept and emit what each would alone."""
    v, ks = 12, [3, 1, 2, 3]
    p = torch.softmax(torch.randn(len(ks), 4, v, generator=seeded(5)), dim=-1)
    q = torch.softmax(torch.randn(len(ks), 4, v, generator=seeded(6)), dim=-1)
    drafts = torch.randint(0, v, (len(ks), 3), generator=seeded(7))
    for i, k in enumerate(ks):
        q[i, k:] = 0
    batch = rejection_batch(p, q, drafts, ks, [seeded(10 + i) for i in range(len(ks))])
    for i, k in enumerate(ks):
        a, extra = rejection_batch(
            p[i : i + 1, : k + 1], q[i : i + 1, : k + 1], drafts[i : i + 1, :k], [k], [seeded(10 + i)]
        )
        assert (int(batch[0][i]), int(batch[1][i])) == (int(a), int(extra))
    with pytest.raises(ValueError, match="distribution each draft was drawn from"):
        sample_step([SampleJob(p[0], SamplingParams(temperature=1.0), drafts=[1, 2])])


class HostCopies:
    """Counts every way a tensor reaches the host as Python values."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def sorts(jobs: list[SampleJob]) -> int:
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "sort", lambda *a, _sort=torch.sort, **k: calls.append(1) or _sort(*a, **k))
        sample_step(jobs)
    return len(calls)


@pytest.mark.parametrize("b", [2, 9])
def test_a_step_of_sampled_requests_copies_to_the_host_once(b):
    v, k = 64, 2
    logits = torch.randn(b, k + 1, v, generator=seeded(8))
    q = torch.softmax(torch.randn(b, k, v, generator=seeded(9)), dim=-1)
    jobs = [SampleJob(logits[i, -1:], SamplingParams(temperature=0.8, logprobs=5, seed=i), seeded(i)) for i in range(b)]
    jobs += [
        SampleJob(logits[i], SamplingParams(temperature=0.8, top_k=10, logprobs=5), None, None, [1, 2], q[i])
        for i in range(b)
    ]
    jobs += [
        SampleJob(logits[i, -1:], SamplingParams(temperature=0.5, top_p=0.9, top_k=7, logprobs=-1)) for i in range(b)
    ]
    with pytest.MonkeyPatch.context() as mp:
        copies = HostCopies(mp)
        out = sample_step(jobs)
    assert copies.count == 1
    assert sorts(jobs) == 1 and sorts(jobs[:b]) == 0  # one sort for every filtering row, none without
    assert all(len(d.logprobs) == len(d.tokens) for d in out)
    assert [len(d.logprobs[0]) for d in out[-b:]] == [v] * b


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))


def test_the_engine_samples_each_step_with_one_host_copy(llm, monkeypatch):
    """Through LLMEngine.step: the sampler's share of a step is one copy for 1 or 6 requests."""
    counts = []
    real = engine_module.sample_step

    def counting(jobs):
        with pytest.MonkeyPatch.context() as mp:
            copies = HostCopies(mp)
            out = real(jobs)
        counts.append((len(jobs), copies.count))
        return out

    monkeypatch.setattr(engine_module, "sample_step", counting)
    prompts = random_prompts([9, 20, 33, 5, 17, 40], seed=81)
    params = SamplingParams(max_tokens=4, temperature=0.8, logprobs=5, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert {n for n, _ in counts} >= {1, 6} and all(c == 1 for _, c in counts), counts


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(llm):
    prompts = random_prompts([12, 30, 7, 25], seed=82)
    params = [
        SamplingParams(max_tokens=6, temperature=0.9, top_k=20, top_p=0.9, seed=5, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True),  # unseeded
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7, seed=6, presence_penalty=0.5, ignore_eos=True),
    ]
    together = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for i in (0, 3):
        alone = llm.generate(prompt_token_ids=[prompts[i]], sampling_params=[params[i]])[0].outputs[0]
        assert alone.token_ids == together[i].outputs[0].token_ids and len(alone.token_ids) == 6
        assert alone.logprobs == together[i].outputs[0].logprobs
    lps = together[0].outputs[0].logprobs
    assert all(math.isfinite(x) and x <= 0 for d in lps for x in d.values())


def test_sampled_speculation_reports_a_logprob_per_emitted_token(tiny_ckpt):
    """Rejection-sampled verify steps: one logprob dict per emitted token (accepted drafts and the
    extra one), the same alone and in a batch."""
    llm = LLM(tiny_ckpt, num_spec_tokens=3, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    prompts = random_prompts([9, 30, 17], seed=83)
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=7 + i, logprobs=3, ignore_eos=True) for i in range(3)]
    together = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.engine.stats()["spec_steps"] > 0
    for p, sp, got in zip(prompts, params, together, strict=True):
        alone = llm.generate(prompt_token_ids=[p], sampling_params=[sp])[0].outputs[0]
        assert (alone.token_ids, alone.logprobs) == (got.token_ids, got.logprobs)
        assert len(got.logprobs) == len(got.token_ids) == 8
        assert all(list(d)[0] == t and 3 <= len(d) <= 4 for d, t in zip(got.logprobs, got.token_ids, strict=True))


def test_allowed_token_ids_and_bad_words_batched_equal_the_one_row_reference():
    """allowed_token_ids and bad words in a step with other rows: a greedy row takes the argmax of
    adjust_logits (not the raw argmax the model copied: these params adjust the logits), a sampled
    row draws from processed_probs(adjust_logits(...))'s support only, the same token alone and in
    the batch. Bad words: a one-token word is always masked, a longer one's last token where the
    output ends with the rest of it."""
    v = 40
    rows = torch.randn(6, v, generator=seeded(11))
    raw = [3, 3, 20, 21, 7, 30]
    rows[range(6), raw] += 10  # each row's raw argmax
    allowed = [t for t in range(v) if t % 3]
    bad = [[20], [5, 21], [9, 9, 7]]
    cases = [  # (params, output so far)
        (SamplingParams(temperature=0, allowed_token_ids=allowed), [1, 2]),
        (SamplingParams(temperature=0.9, seed=4, allowed_token_ids=allowed, logprobs=2), []),
        (SamplingParams(temperature=0, bad_words_token_ids=bad), [7, 4]),
        (SamplingParams(temperature=0, bad_words_token_ids=bad), [9, 5]),
        (SamplingParams(temperature=1.0, seed=5, bad_words_token_ids=bad, top_k=5), [9, 9]),
        (SamplingParams(temperature=0.7, seed=6), [9, 9]),
    ]

    def job(i, params=None):
        p = params or cases[i][0]
        gen = seeded(p.seed) if p.seed is not None else None
        return SampleJob(rows[i : i + 1], p, gen, argmax=[raw[i]], prompt_ids=[3], output_ids=cases[i][1])

    together = sample_step([job(i) for i in range(6)])
    adjusted = [adjust_logits(rows[i], p, [3], out, None) for i, (p, out) in enumerate(cases)]
    masked = [(x == -math.inf).nonzero().flatten().tolist() for x in adjusted]
    assert masked == [[t for t in range(v) if t % 3 == 0]] * 2 + [[20], [20, 21], [7, 20], []]
    for i in (0, 2, 3):
        assert together[i].tokens == [int(adjusted[i].argmax())] != [raw[i]]
    for i in (1, 4, 5):
        assert sample_step([job(i)])[0].tokens == together[i].tokens
        assert processed_probs(adjusted[i], cases[i][0])[together[i].tokens[0]] > 0
    for i in (1, 4):  # 300 hot unseeded draws each: never a masked token
        p = dataclasses.replace(cases[i][0], seed=None)
        support = set((processed_probs(adjusted[i], p) > 0).nonzero().flatten().tolist())
        assert raw[i] not in support
        assert {d.tokens[0] for d in sample_step([job(i, p) for _ in range(300)])} <= support


def test_speculation_does_not_draft_for_requests_with_adjusted_logits(llm, tiny_ckpt):
    """With speculative decoding on, a request with allowed_token_ids, bad words or logit_bias gets
    no drafts (they would be verified against the raw logits: the first token was adjusted and the
    rest were the raw argmax); its tokens are those of an engine without speculation."""
    spec = LLM(tiny_ckpt, num_spec_tokens=3, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    ids = random_prompts([30], seed=84)[0]
    base = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate(prompt_token_ids=[ids], sampling_params=base)[0].outputs[0].token_ids
    params = [
        dataclasses.replace(base, allowed_token_ids=[t for t in range(3, 512) if t not in plain]),
        dataclasses.replace(base, bad_words_token_ids=[[plain[0], plain[1]], [plain[2]]]),
        dataclasses.replace(base, logit_bias={42: 100}),
        dataclasses.replace(base, temperature=0.8, seed=9, bad_words_token_ids=[[plain[0]]]),
    ]
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[ids] * 4, sampling_params=params)]
    assert want[0] != plain and not set(want[0]) & set(plain) and want[2] == [42] * 6
    assert want[1][:1] == plain[:1] and want[1][1] != plain[1]
    got = [o.outputs[0].token_ids for o in spec.generate(prompt_token_ids=[ids] * 4, sampling_params=params)]
    assert got == want and spec.engine.stats()["spec_steps"] == 0
