"""Sampling parameters and the mode plans (who computes which rows), exactly."""

from __future__ import annotations

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.config import tiny
from asympd.engine.modes import Phase, colocated_phases, decode_plan, prefill_plan, split_point
from asympd.engine.sampling import processed_probs
from asympd.model.transformer import Depth
from tests.util import random_prompts

CFG = tiny()  # window 16, ratio-2 and ratio-1 KV sources


def test_processed_probs_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_processed_probs_min_p_filters_the_tempered_distribution():
    """vLLM's min-p: tokens under min_p x the top probability go, measured after temperature."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, min_p=0.5))  # under 0.25 goes
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, min_p=0.29))  # 0.15 stays, 0.05 goes
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # at temperature 2 the probabilities go as sqrt(p): 0.15 is 0.55 of the top one, 0.05 0.32
    p = processed_probs(logits, SamplingParams(temperature=2.0, min_p=0.5))
    kept = torch.tensor([0.5, 0.3, 0.15, 0.0]).sqrt()
    assert torch.allclose(p, kept / kept.sum())
    assert torch.equal(processed_probs(logits, SamplingParams(min_p=0.0)), processed_probs(logits, SamplingParams()))


def test_stop_tokens_max_tokens_and_logprobs_through_the_engine(tiny_ckpt):
    llm = LLM(tiny_ckpt)
    prompt = random_prompts([25], seed=31)[0]
    full = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, temperature=0))[0]
    toks = full.outputs[0].token_ids
    assert len(toks) == 8 and full.outputs[0].finish_reason == "length"
    stop_at = toks[3]
    first = toks.index(stop_at)
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_at], logprobs=-1),
    )[0]
    assert out.outputs[0].token_ids == toks[: first + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert all(len(d) == CFG.vocab_size for d in out.outputs[0].logprobs)
    assert len(out.outputs[0].logprobs) == first + 1


# ---- mode plans ------------------------------------------------------------------------------------


def test_split_point_and_boundary_policies():
    assert split_point(CFG, 10, "carry") == 0  # N <= W: P does nothing
    assert split_point(CFG, 37, "carry") == 21
    assert split_point(CFG, 37, "align") == 20  # moved to a compressor group boundary; D takes W + 1 rows
    with pytest.raises(ValueError, match="unknown boundary policy"):
        split_point(CFG, 37, "round")


def test_plans_say_who_computes_what():
    n, w = 40, CFG.window_size
    assert colocated_phases(CFG, n, "full") == [Phase(0, 40, Depth.ALL)]
    assert colocated_phases(CFG, n, "decoder-replay") == [
        Phase(0, 24, Depth.THROUGH_SOURCE, sample=False),
        Phase(24, 40, Depth.ALL, floor=24),
    ]
    assert colocated_phases(CFG, n, "split") == [
        Phase(0, 24, Depth.ENCODER_KV, sample=False),
        Phase(24, 40, Depth.ALL, floor=24, encoder_floor=24),
    ]
    p, d = prefill_plan(CFG, n, "asymmetric"), decode_plan(CFG, n, "asymmetric")
    assert (p.export_upto, p.samples_first_token, d.import_upto) == (n - w, False, n - w)
    assert d.phases == [Phase(24, 40, Depth.ALL, floor=24, encoder_floor=24)]
    p, d = prefill_plan(CFG, n, "encoder-only"), decode_plan(CFG, n, "encoder-only")
    assert p.phases == [Phase(0, 40, Depth.ENCODER_KV, sample=False)] and d.import_upto == n
    assert d.phases == [Phase(24, 40, Depth.ALL, floor=24, encoder_floor=24, write_global=False)]
    p, d = prefill_plan(CFG, n, "symmetric"), decode_plan(CFG, n, "symmetric")
    assert p.samples_first_token and d.first_token_from_prefill and not d.phases[0].sample
    assert prefill_plan(CFG, 10, "asymmetric").phases == []
    # the strongest symmetric baselines: P computes split semantics and samples; D replays [s, N) or nothing
    for mode in ("symmetric-split", "symmetric-windows"):
        p, d = prefill_plan(CFG, n, mode), decode_plan(CFG, n, mode)
        assert p.phases == colocated_phases(CFG, n, "split") and p.export_upto == n == d.import_upto
        assert p.samples_first_token and d.first_token_from_prefill
        assert p.exports_windows == d.imports_windows == (mode == "symmetric-windows")
    assert decode_plan(CFG, n, "symmetric-split").phases == [
        Phase(24, 40, Depth.ALL, floor=24, encoder_floor=24, write_global=False, sample=False)
    ]
    assert decode_plan(CFG, n, "symmetric-windows").phases == []
    assert prefill_plan(CFG, 10, "symmetric-split").phases == [Phase(0, 10, Depth.ALL)]


def test_mode_facts_in_one_place():
    from asympd import cli
    from asympd.engine import modes

    table = {
        (r, m): modes.model_role(r, m)
        for r in modes.ROLES
        for m in modes.MODES
        if (r == "colocated") == (m == "colocated")
    }
    assert table == {
        ("colocated", "colocated"): "full",
        ("prefill", "symmetric"): "full",
        ("prefill", "encoder-only"): "prefill",
        ("prefill", "asymmetric"): "prefill",
        ("decode", "symmetric"): "decode",
        ("decode", "encoder-only"): "decode",
        ("decode", "asymmetric"): "decode",
        ("prefill", "symmetric-split"): "full",
        ("prefill", "symmetric-windows"): "full",
        ("decode", "symmetric-split"): "decode",
        ("decode", "symmetric-windows"): "decode",
    }
    for role, mode, message in [
        ("decode", "colocated", "role 'decode' cannot run mode 'colocated'"),
        ("colocated", "asymmetric", "role 'colocated' cannot run mode 'asymmetric'"),
        ("router", "asymmetric", "unknown role 'router'"),
        ("decode", "disaggregated", "unknown mode 'disaggregated'"),
    ]:
        with pytest.raises(ValueError, match=message):
            modes.check_role_mode(role, mode)
    w = CFG.window_size
    assert [modes.skips_prefill(m, n, w) for m in modes.PD_MODES for n in (w, w + 1)] == [False] * 4 + [True, False] + [
        False
    ] * 4
    assert [modes.default_mode(r) for r in modes.ROLES] == ["colocated", "asymmetric", "asymmetric"]
    serve = cli.build_parser().parse_args(["serve", "--checkpoint", "x"])
    assert (serve.role, serve.mode) == ("colocated", None)
    with pytest.raises(cli.UsageError, match="invalid choice: 'split'"):
        cli.build_parser().parse_args(["serve", "--checkpoint", "x", "--mode", "split"])
