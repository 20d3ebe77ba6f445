"""Speculative decoding with the DSpark drafter on the decoding engine.

- greedy outputs with speculation equal those without, token for token, in every mode, with requests
  joining and leaving mid-flight (drafts from DSpark, and from an oracle that makes acceptance of
  0..k drafts happen often: the random-weight DSpark almost never gets a draft accepted);
- after every step the caches hold exactly the accepted tokens, and the dead entries a rollback
  leaves behind are never read (poisoned with NaN, outputs unchanged);
- rejection sampling keeps the target distribution: a chi-square test of the sampler on a synthetic
  Markov chain, and one end to end on a 16-token model.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.config import ModelConfig, tiny
from asympd.engine import engine as engine_module
from asympd.engine.engine import EngineConfig, LLMEngine
from asympd.engine.modes import VARIANTS
from asympd.engine.request import Status
from asympd.engine.sampling import processed_probs
from asympd.engine.scheduler import SchedulerConfig
from asympd.engine.spec_decode import Proposal, greedy_accept, rejection_sample
from asympd.kv.dense import DenseSequenceKV
from asympd.kv.spec import KVCacheSpec
from asympd.model.attention import rotations
from asympd.model.checkpoint import _generate_unit, _units
from asympd.model.loader import build_model
from asympd.model.schema import checkpoint_schema
from asympd.model.transformer import Chunk
from tests.util import random_prompts

W = 16  # the tiny preset's window
N_SAMPLES = 768  # requests in the end-to-end statistical test
K = 3  # its DSpark block size: the most drafts a step can verify
SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
MODES = [v for v in VARIANTS if v[0] != "symmetric-windows"]  # D computes no row there: no drafting (below)
LENGTHS = [1, W, W + 1, 2 * W + 1, 45]
MAX_TOKENS = [10, 4, 11, 6, 8]  # requests leave at different steps


class Oracle:
    """Drafts the reference continuation with one token spoiled per step at a rotating index, so
    every accepted length 0..k occurs. Still runs DSpark (seeding its windows, drafting) first."""

    def __init__(self, inner, reference: dict[tuple[int, ...], list[int]]):
        self.inner, self.reference, self.calls = inner, reference, 0
        self.first_draft: dict[str, int] = {}  # request -> output length when it first drafted

    def __call__(self, items):
        self.inner(items)
        out = []
        for it in items:
            self.calls += 1
            req = it.request
            if it.num_drafts:
                # the drafter's window holds the W accepted positions before the block, in every mode
                pos = it.kv.window(tiny().n_layers)[1]
                b = it.block_start
                assert pos[pos >= b - W].tolist() == list(range(max(0, b - W), b))
                self.first_draft.setdefault(req.request_id, len(req.output_token_ids))
            ref, n = self.reference[tuple(req.prompt_token_ids)], len(req.output_token_ids)
            toks = [ref[n + j] if n + j < len(ref) else 5 for j in range(it.num_drafts)]
            bad = self.calls % (it.num_drafts + 2)
            if bad < len(toks):
                toks[bad] = (toks[bad] + 1) % 512
            out.append(Proposal(toks))
        return out


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Half the prompts first, the rest two steps later while the first ones run."""
    done: dict[str, list[int]] = {}
    half = len(prompts) // 2

    def step():
        for out in llm.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                assert out.metrics["spec_proposed"] >= out.metrics["spec_accepted"]

    for i in range(half):
        llm.add(f"r{i}", prompts[i], params[i])
    step()
    step()
    for i in range(half, len(prompts)):
        llm.add(f"r{i}", prompts[i], params[i])
    for _ in range(300):
        if len(done) == len(prompts):
            break
        step()
    assert len(done) == len(prompts)
    return done


def greedy_params(stop: list[int] | None = None) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0, stop_token_ids=stop or []) for m in MAX_TOKENS]


@functools.cache
def baseline(ckpt: str, mode: str, semantics: str, policy: str) -> dict[str, list[int]]:
    llm = LLM(ckpt, mode, semantics, boundary_policy=policy, scheduler=SCHED)
    return run(llm, random_prompts(LENGTHS, seed=21), greedy_params())


def spec_llm(ckpt: str, mode: str, semantics: str, policy: str, oracle: bool = True, **kw) -> LLM:
    llm = LLM(ckpt, mode, semantics, boundary_policy=policy, scheduler=SCHED, num_spec_tokens=K, **kw)
    if oracle:
        prompts = random_prompts(LENGTHS, seed=21)
        want = baseline(ckpt, mode, semantics, policy)
        ref = {tuple(p): want[f"r{i}"] for i, p in enumerate(prompts)}
        llm.engine.proposer = Oracle(llm.engine.proposer, ref)
    return llm


def accepted_lengths(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return s["spec_proposed"], s["spec_accepted"], s["spec_steps"]


# ---- greedy: token for token -------------------------------------------------------------------------


@pytest.mark.parametrize("mode,semantics,policy", MODES)
def test_greedy_with_speculation_equals_without(tiny_ckpt, mode, semantics, policy):
    want = baseline(tiny_ckpt, mode, semantics, policy)
    llm = spec_llm(tiny_ckpt, mode, semantics, policy)
    got = run(llm, random_prompts(LENGTHS, seed=21), greedy_params())
    assert got == want
    # speculation from the first decode step on, for every request
    assert llm.engine.proposer.first_draft == {f"r{i}": 1 for i in range(len(LENGTHS))}
    proposed, accepted, steps = accepted_lengths(llm)
    assert 0 < accepted < proposed and steps > 0
    assert llm.engine.blocks.num_used_blocks == 0
    assert llm.engine.stats()["generation_tokens"] == sum(len(t) for t in got.values()) - (
        len(got) if mode.startswith("symmetric") else 0  # P sampled the first tokens
    )
    if llm.prefill is not None:
        assert llm.prefill.num_spec_tokens == 0 and llm.prefill.proposer is None
        assert llm.prefill.stats()["generation_tokens"] == (len(got) if mode.startswith("symmetric") else 0)


@pytest.mark.parametrize("mode", ["colocated", "asymmetric"])
def test_greedy_with_the_dspark_drafter_equals_without(tiny_ckpt, mode):
    want = baseline(tiny_ckpt, mode, "full", "carry")
    llm = spec_llm(tiny_ckpt, mode, "full", "carry", oracle=False)
    assert run(llm, random_prompts(LENGTHS, seed=21), greedy_params()) == want
    proposed, accepted, steps = accepted_lengths(llm)
    assert proposed > 0 and steps > 0  # drafts from the first decode step on, every request


def test_stop_token_inside_accepted_drafts(tiny_ckpt):
    want = baseline(tiny_ckpt, "colocated", "full", "carry")
    stop = want["r4"][4]
    llm = spec_llm(tiny_ckpt, "colocated", "full", "carry")
    got = run(llm, random_prompts(LENGTHS, seed=21), greedy_params([stop]))
    for rid, toks in want.items():
        cut = toks.index(stop) + 1 if stop in toks else len(toks)
        assert got[rid] == toks[:cut], rid


def test_preemption_with_speculation(tiny_ckpt):
    prompts = random_prompts([40, 33, 20, 50], seed=22)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (24, 20, 24, 6)]
    block_bytes = KVCacheSpec.from_config(tiny(), block_size=16).bytes_per_block
    kw = dict(scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), kv_cache_bytes=8 * block_bytes)
    want = run(LLM(tiny_ckpt, **kw), prompts, params)
    llm = LLM(tiny_ckpt, num_spec_tokens=K, **kw)
    ref = {tuple(p): want[f"r{i}"] for i, p in enumerate(prompts)}
    llm.engine.proposer = Oracle(llm.engine.proposer, ref)
    assert run(llm, prompts, params) == want
    assert llm.engine.stats()["preemptions"] > 0


# ---- caches --------------------------------------------------------------------------------------------


def snapshot(eng: LLMEngine, req) -> dict:
    """What a later step can see of a request's caches, at its accepted length."""
    cfg, keep = eng.cfg, len(req.all_token_ids) - 1
    view = eng.runner.view(req)
    snap: dict = {"keep": keep}
    for layer in range(cfg.n_layers):
        kv, pos = view.window(layer)
        assert int(pos.max()) < keep
        sel = pos >= keep - W
        snap[f"swa.{layer}"] = (pos[sel], kv[sel])
    for layer in eng.spec.pair_layers:
        kv, score, pos = view.pending(layer)
        assert pos.numel() == 0 or int(pos.max()) < keep
        r = cfg.ratio(layer)
        sel = pos >= keep // r * r
        snap[f"pair.{layer}"] = (pos[sel], kv[sel], score[sel])
    for layer in cfg.kv_source_layers:
        n = keep // cfg.ratio(layer)
        snap[f"ckv.{layer}"] = (view.read_compressed(layer, n),)
        snap[f"idx.{layer}"] = (view.read_index_keys(layer, n),)
    return snap


def test_caches_hold_exactly_the_accepted_tokens(tiny_ckpt):
    prompts = random_prompts([3, 21, 37], seed=23)
    params = SamplingParams(max_tokens=14, temperature=0)
    plain = LLM(tiny_ckpt, scheduler=SCHED).engine
    want: dict[tuple[str, int], dict] = {}
    for i, p in enumerate(prompts):
        plain.add_request(f"r{i}", p, params)
    refs: dict[tuple[int, ...], list[int]] = {}
    while plain.has_unfinished_requests():
        for out in plain.step():
            if out.finished:
                refs[tuple(out.prompt_token_ids)] = out.outputs[0].token_ids
        for req in plain.scheduler.running:
            if not req.in_prompt:
                want[req.request_id, len(req.all_token_ids) - 1] = snapshot(plain, req)

    llm = LLM(tiny_ckpt, scheduler=SCHED, num_spec_tokens=K)
    eng = llm.engine
    eng.proposer = Oracle(eng.proposer, refs)
    model, drafter = eng.model, eng.model.drafter
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    checked = 0
    while eng.has_unfinished_requests():
        verified = {r.request_id for r in eng.scheduler.running if r.spec_draft}
        eng.step()
        for req in eng.scheduler.running:
            if req.in_prompt:
                continue
            got = snapshot(eng, req)
            keep = got["keep"]
            ref = want[req.request_id, keep]
            for name, tensors in ref.items():
                if name != "keep":
                    assert all(torch.equal(a, b) for a, b in zip(got[name], tensors, strict=True)), (name, keep)
            if req.request_id in verified:
                assert eng.blocks.num_tokens(req.request_id) == keep  # blocks cover the accepted positions only
            # the drafter's windows: main rows of the last W accepted positions, nothing else
            ids = torch.tensor(req.all_token_ids[:keep])
            hidden = model([Chunk(DenseSequenceKV(eng.cfg), ids, 0, ids, logits="none")]).draft_hidden[0]
            lo = max(0, keep - W)
            for block in drafter.blocks:
                kv, pos = eng.runner.view(req).window(block.layer)
                assert int(pos.max()) == keep - 1
                sel = pos >= lo
                assert pos[sel].tolist() == list(range(lo, keep))
                main = block.attn._kv(drafter.main_x(hidden[lo:]), rotations(block.attn.freqs, torch.arange(lo, keep)))
                assert torch.equal(kv[sel], main)
            checked += 1
    assert checked > 10
    proposed, accepted, _ = accepted_lengths(llm)
    assert 0 < accepted < proposed


@pytest.mark.parametrize("mode,semantics,policy", [("colocated", "split", "carry"), ("asymmetric", "full", "carry")])
def test_rejected_rows_are_never_read(tiny_ckpt, monkeypatch, mode, semantics, policy):
    """After every rollback the compressed entries and index keys past the accepted length (dead,
    but still in the kept blocks) become NaN: any read of one would spoil the outputs."""
    original = engine_module.rollback
    poisoned = []

    def rollback_and_poison(cache, blocks, cuts):
        original(cache, blocks, cuts)
        cfg = cache.spec.cfg
        for seq_id, num_tokens, _ in cuts:
            table = blocks.block_table(seq_id)
            for layer in cfg.kv_source_layers:
                for name in (f"ckv.{layer}", f"idx.{layer}"):
                    g = cache.spec.group(name)
                    start, cap = num_tokens // g.ratio, len(table) * g.entries_per_block
                    if cap > start:
                        cache.write_entries(name, table, start, torch.full((cap - start, g.width), math.nan))
                        poisoned.append(cap - start)

    monkeypatch.setattr(engine_module, "rollback", rollback_and_poison)
    want = baseline(tiny_ckpt, mode, semantics, policy)
    assert run(spec_llm(tiny_ckpt, mode, semantics, policy), random_prompts(LENGTHS, seed=21), greedy_params()) == want
    assert sum(poisoned) > 0


# ---- configuration and visibility ----------------------------------------------------------------------


def test_configuration_and_stats(tiny_ckpt):
    from asympd.model.loader import load_model

    full = load_model(tiny_ckpt, "full")
    with pytest.raises(ValueError, match="block size"):
        LLMEngine(full, EngineConfig(num_spec_tokens=K + 1))
    p = LLMEngine(load_model(tiny_ckpt, "prefill"), EngineConfig(role="prefill", mode="asymmetric", num_spec_tokens=1))
    assert p.num_spec_tokens == 0 and p.proposer is None  # a prefill worker never drafts
    no_drafter = load_model(tiny_ckpt, "decode")
    no_drafter.drafter = None
    with pytest.raises(ValueError, match="draft blocks"):
        LLMEngine(no_drafter, EngineConfig(role="decode", mode="asymmetric", num_spec_tokens=1))
    with pytest.raises(ValueError, match="not supported in mode symmetric-windows: D computes no prompt row"):
        LLMEngine(full, EngineConfig(role="decode", mode="symmetric-windows", num_spec_tokens=1))
    eng = LLMEngine(full, EngineConfig(num_spec_tokens=2, scheduler=SCHED))
    assert eng.config.scheduler.num_spec_tokens == 2 and eng.spec.spec_slack == 3
    stats = eng.stats()
    for key in ("spec_proposed", "spec_accepted", "spec_steps", "spec_acceptance_rate", "spec_mean_accepted_length"):
        assert key in stats
    assert stats["num_spec_tokens"] == 2
    prompts = random_prompts([5, 30], seed=24)
    # a threshold of 1 cuts every draft (sigmoid < 1); 0 keeps them all
    for threshold, drafts in ((1.0, False), (0.0, True)):
        llm = LLM(tiny_ckpt, num_spec_tokens=2, spec_confidence_threshold=threshold)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=6, temperature=0))
        assert (outs[0].metrics["spec_proposed"] > 0) == drafts
        assert llm.engine.stats()["spec_proposed"] == sum(o.metrics["spec_proposed"] for o in outs)


def test_seeded_sampling_with_speculation_is_batch_invariant(tiny_ckpt):
    prompts = random_prompts([9, 30, 17], seed=25)
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=7 + i) for i in range(3)]
    llm = LLM(tiny_ckpt, num_spec_tokens=K, scheduler=SCHED)
    together = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    alone = [
        llm.generate(prompt_token_ids=[p], sampling_params=[sp])[0].outputs[0].token_ids
        for p, sp in zip(prompts, params, strict=True)
    ]
    assert together == alone


# ---- rejection sampling keeps the target distribution ----------------------------------------------------


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson's test; cells expected below 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for key, p in probs.items():
        e = n * p
        if e < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    assert sum(counts.values()) == n and not set(counts) - set(probs), "a sample outside the support"
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_rejection_sampler_keeps_a_markov_chain_exact():
    """Target P and drafter Q are Markov chains over 3 tokens (each with zeros where the other is
    positive); speculative generation of 3 tokens with k = 2 must draw sequences from P exactly."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.6, 0.4], [0.7, 0.0, 0.3]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.0, 0.8], [0.3, 0.3, 0.4], [0.1, 0.8, 0.1]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    n, length, counts, accepted = 6000, 3, Counter(), Counter()
    for _ in range(n):
        seq = [0]
        while len(seq) <= length:
            k = min(2, length - len(seq))
            drafts, qs, prev = [], [], seq[-1]
            for _ in range(k):
                d = int(torch.multinomial(q[prev], 1, generator=gen))
                drafts.append(d)
                qs.append(q[prev])
                prev = d
            target = p[[seq[-1], *drafts]]
            toks, a = rejection_sample(target, torch.stack(qs) if qs else q[:0], drafts, gen)
            accepted[a] += 1
            seq += toks
        counts[tuple(seq[1 : length + 1])] += 1
    exact = {(a, b, c): float(p[0, a] * p[a, b] * p[b, c]) for a in range(3) for b in range(3) for c in range(3)}
    assert chi_square_pvalue(counts, {k: v for k, v in exact.items() if v > 0}, n) > 1e-3
    assert accepted[0] and accepted[1] and accepted[2]  # every accepted length happened


def test_verification_edge_cases():
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.1, 0.9, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(p, p[:1], [1], gen) == ([1, 2], 1)  # q == p: always accepted
    onehot = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for _ in range(20):  # p(d) = 0: always rejected, and the residual is p itself
        assert rejection_sample(onehot, torch.tensor([[1.0, 0.0, 0.0]]), [0], gen) == ([1], 0)
    logits = torch.tensor([[0.0, 2.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert greedy_accept(logits, [1, 0]) == ([1, 0, 2], 2)  # ties go to the first maximum
    assert greedy_accept(logits, [2, 0]) == ([1], 0)
    assert greedy_accept(logits[:1], []) == ([1], 0)


def small_model():
    """16 tokens, two layers (window-only, then a ratio-1 KV source), one draft block: small enough
    that a thousand requests decode in seconds."""
    cfg = ModelConfig(
        vocab_size=16,
        dim=64,
        moe_inter_dim=32,
        n_layers=2,
        n_mtp_layers=1,
        n_heads=2,
        head_dim=32,
        rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        window_size=8,
        n_routed_experts=4,
        n_activated_experts=2,
        compress_ratios=(0, 1, 0),
        kv_source_layers=(1,),
        index_source_layers=(1,),
        index_n_heads=2,
        index_head_dim=32,
        index_topk=4,
        candidate_source_layer=-1,
        original_seq_len=64,
        rope_factor=4.0,
        engram_layer_ids=(),
        engram_num_embeddings=(),
        dspark_block_size=2,
        dspark_noise_token_id=15,
        dspark_target_layer_ids=(0, 1),
        dspark_markov_rank=16,
        dspark_n_routed_experts=4,
        dspark_n_activated_experts=2,
        max_seq_len=64,
    )
    tensors = {}
    for unit in _units(checkpoint_schema(cfg)):
        tensors.update({s.name: t for s, t in zip(unit, _generate_unit(cfg, unit, 1), strict=True)})
    return build_model(cfg, tensors, "full")


def test_sampling_with_speculation_matches_the_target_distribution():
    """768 seeded requests of one prompt, 4 tokens each, 2 drafts per step. The first token comes
    from the prefill; the second and third go through rejection sampling (first and second draft
    position) or the bonus draw. Compared with the exact distribution from target forwards."""
    model = small_model()
    params = SamplingParams(max_tokens=4, temperature=1.3)
    prompt = [3, 9, 4, 12, 7]
    n = N_SAMPLES
    eng = LLMEngine(
        model,
        EngineConfig(
            block_size=2, num_spec_tokens=2, scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048)
        ),
    )
    for i in range(n):
        eng.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=1.3, seed=i))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert all(o.finished and o.outputs[0].finish_reason == Status.FINISHED_LENGTH.value for o in outs)
    seqs = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    stats = eng.stats()
    assert 0 < stats["spec_accepted"] < stats["spec_proposed"]
    assert any(o.metrics["spec_accepted"] == 2 and o.metrics["spec_steps"] == 1 for o in outs)

    # exact P(t1), P(t2 | t1), P(t3 | t1, t2): all prefixes in one ragged forward each
    v = model.cfg.vocab_size

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        chunks = [Chunk(DenseSequenceKV(model.cfg), torch.tensor(x), 0, torch.tensor(x)) for x in prefixes]
        return torch.stack([processed_probs(lg[-1], params) for lg in model(chunks).logits]).double()

    p1 = next_probs([prompt])[0]
    p2 = next_probs([[*prompt, a] for a in range(v)])
    p3 = next_probs([[*prompt, a, b] for a in range(v) for b in range(v)]).view(v, v, v)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    pairs12 = {(a, b): float(joint[a, b].sum()) for a in range(v) for b in range(v)}
    pairs23 = {(b, c): float(joint[:, b, c].sum()) for b in range(v) for c in range(v)}
    third = {c: float(joint[:, :, c].sum()) for c in range(v)}
    for counts, probs in (
        (Counter(s[:2] for s in seqs), pairs12),
        (Counter(s[1:] for s in seqs), pairs23),
        (Counter(s[2] for s in seqs), third),
    ):
        assert chi_square_pvalue(counts, {k: x for k, x in probs.items() if x > 0}, n) > 1e-3
