"""Asymmetric P -> D, and both strongest symmetric baselines (symmetric-split: D replays the last W
rows; symmetric-windows: P ships the windows, D replays nothing), produce exactly the bits of
colocated `split` (fp32): the same tokens and the same full-vocabulary log-probabilities at every
step, with requests joining while others run."""

from __future__ import annotations

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.engine.modes import split_point
from asympd.engine.request import CompletionOutput
from asympd.engine.scheduler import SchedulerConfig
from tests.util import random_prompts

W = 16  # the tiny preset's window


def lengths() -> list[int]:
    return [1, W - 1, W, W + 1, W + 2, 2 * W + 1, 1000, 1001]


def run_staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[CompletionOutput]:
    """Half the prompts first; the rest join two steps later, while the first ones are running."""
    done: dict[str, CompletionOutput] = {}
    half = len(prompts) // 2
    for i, p in enumerate(prompts[:half]):
        llm.add(f"r{i}", p, params)
    for _ in range(2):
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    for i, p in enumerate(prompts[half:], start=half):
        llm.add(f"r{i}", p, params)
    for _ in range(500):
        for out in llm.step():
            assert out.error is None, out.error
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if len(done) == len(prompts):
            break
    assert len(done) == len(prompts)
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("policy", ["carry", "align"])
def test_pd_modes_equal_colocated_split(tiny_ckpt, policy):
    prompts = random_prompts(lengths(), seed=11)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=-1)  # -1: the whole vocabulary
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)
    colo = LLM(tiny_ckpt, "colocated", "split", boundary_policy=policy, scheduler=sched)
    want = run_staggered(colo, prompts, params)
    assert colo.engine.blocks.num_used_blocks == 0
    for mode in ("asymmetric", "symmetric-split", "symmetric-windows"):
        llm = LLM(tiny_ckpt, mode, boundary_policy=policy, scheduler=sched)
        got = run_staggered(llm, prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], mode
        for n, g, w in zip(lengths(), got, want, strict=True):
            assert len(g.logprobs) == len(w.logprobs) == 6
            for step, (lg, lw) in enumerate(zip(g.logprobs, w.logprobs, strict=True)):
                assert len(lg) == len(lw) == 512
                # bits, not closeness: one rounding of the imported KV anywhere shows up here
                a, b = torch.tensor(list(lg.values())), torch.tensor(list(lw.values()))
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"{mode}: N={n}, step {step}"
        for engine in (llm.prefill, llm.engine):
            assert engine.blocks.num_used_blocks == 0, mode


def test_symmetric_baselines_work_and_bytes(tiny_ckpt):
    """symmetric-split's D replays min(N, W) rows per prompt, symmetric-windows' D none; the windows
    cost exactly their rows (cache dtype) and positions (int64) per model layer, beyond the global KV."""
    cfg = LLM(tiny_ckpt, "colocated").cfg
    prompts = random_prompts([5, W, 3 * W + 1, 200], seed=14)
    params = SamplingParams(max_tokens=3, temperature=0)
    runs = {m: LLM(tiny_ckpt, m) for m in ("symmetric-split", "symmetric-windows")}
    outs = {m: llm.generate(prompt_token_ids=prompts, sampling_params=params) for m, llm in runs.items()}
    assert [o.outputs[0].token_ids for o in outs["symmetric-split"]] == [
        o.outputs[0].token_ids for o in outs["symmetric-windows"]
    ]
    n_rows = sum(len(p) for p in prompts)
    replayed = sum(min(len(p), W) for p in prompts)
    for m, llm in runs.items():
        assert llm.prefill.stats()["prompt_tokens"] == n_rows  # P: every prompt row, as asymmetric P + D
        assert llm.engine.stats()["prompt_tokens"] == (replayed if m == "symmetric-split" else 0)
    # the extra bytes: the last min(N, W) rows of every layer's window
    for o_split, o_win, p in zip(outs["symmetric-split"], outs["symmetric-windows"], prompts, strict=True):
        rows = min(len(p), W)
        want = cfg.n_layers * rows * (cfg.head_dim * 4 + 8)  # fp32 cache here
        got = runs["symmetric-windows"].transfer_bytes[o_win.request_id]
        base = runs["symmetric-split"].transfer_bytes[o_split.request_id]
        header_and_padding = 2 * 64 * cfg.n_layers + 400
        assert want <= got - base <= want + header_and_padding, len(p)


@pytest.mark.parametrize(
    "mode,semantics",
    [
        ("colocated", "full"),
        ("colocated", "decoder-replay"),
        ("colocated", "split"),
        ("asymmetric", "full"),
        ("symmetric", "full"),
        ("encoder-only", "full"),
        ("symmetric-split", "full"),
        ("symmetric-windows", "full"),
    ],
)
def test_every_mode_is_deterministic_under_a_seed(tiny_ckpt, mode, semantics):
    prompts = random_prompts([5, 40, 70], seed=12)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    runs = [
        [
            o.outputs[0].token_ids
            for o in LLM(tiny_ckpt, mode, semantics).generate(prompt_token_ids=prompts, sampling_params=params)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert all(len(t) == 8 for t in runs[0])


def test_symmetric_matches_colocated_decoder_replay_first_token(tiny_ckpt):
    """P in symmetric mode runs decoder-replay and samples the first token itself."""
    prompts = random_prompts([3, 30, 90], seed=13)
    params = SamplingParams(max_tokens=1, temperature=0)
    sym = LLM(tiny_ckpt, "symmetric").generate(prompt_token_ids=prompts, sampling_params=params)
    rep = LLM(tiny_ckpt, "colocated", "decoder-replay").generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in sym] == [o.outputs[0].token_ids for o in rep]


def _after_prefill(llm: LLM, rid: str, ids: list[int]):
    """Step until the decoding engine has sampled the first token (its cache then holds the prompt)."""
    llm.add(rid, ids, SamplingParams(max_tokens=2, temperature=0))
    for _ in range(100):
        llm.step()
        req = llm.engine.requests.get(rid)
        if req is not None and req.output_token_ids:
            return req
    raise AssertionError(f"{rid} never reached its first token")


def _cache_bits(llm: LLM, req, s: int) -> dict[str, torch.Tensor]:
    """Every cache entry the request's later steps can read, as raw bits: each KV source's
    compressed KV, index keys and open compressor group, and every layer's window rows from s on
    (colocated split also keeps window rows below s, which its floors never let anyone see)."""
    cfg, view, n = llm.cfg, llm.engine.runner.view(req), len(req.prompt_token_ids)

    def bits(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        return t.view(torch.int32) if t.dtype == torch.float32 else t

    out = {}
    for layer in cfg.kv_source_layers:
        r = cfg.ratio(layer)
        out[f"ckv.{layer}"] = bits(view.read_compressed(layer, n // r))
        out[f"idx.{layer}"] = bits(view.read_index_keys(layer, n // r))
        if r > 1:  # ratio 1 has no open group
            kv, score, pos = view.pending(layer)
            keep = pos >= n // r * r
            out[f"pair.{layer}"] = torch.cat([bits(kv[keep]), bits(score[keep]), pos[keep, None].int()], 1)
    for layer in range(cfg.n_layers):
        kv, pos = view.window(layer)
        keep = pos >= s
        out[f"swa.{layer}"] = torch.cat([bits(kv[keep]), pos[keep, None].int()], 1)
    return out


@pytest.mark.parametrize("policy", ["carry", "align"])
def test_decode_worker_cache_equals_colocated_split_bit_for_bit(tiny_ckpt, policy):
    """After D's bounded prefill its cache holds the bits colocated `split` computes: the imported
    prefix [0, s) as well as what D wrote. (Logprobs alone can miss a tiny error in the imported KV:
    the FP8 quantization of the attention output absorbs most last-bit changes.)"""
    colo = LLM(tiny_ckpt, "colocated", "split", boundary_policy=policy)
    asym = LLM(tiny_ckpt, "asymmetric", boundary_policy=policy)
    for i, ids in enumerate(random_prompts([W + 1, W + 2, 2 * W + 1, 100], seed=14)):
        s = split_point(asym.cfg, len(ids), policy)
        want = _cache_bits(colo, _after_prefill(colo, f"r{i}", ids), s)
        got = _cache_bits(asym, _after_prefill(asym, f"r{i}", ids), s)
        assert want.keys() == got.keys()
        for name in want:
            assert want[name].numel() > 0 or name.startswith("pair"), (len(ids), name)
            assert torch.equal(got[name], want[name]), f"N={len(ids)}: {name}"
