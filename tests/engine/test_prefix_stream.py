"""Streaming the prefix by chunk: P hands each prefill chunk's finished global KV over as a slice,
D writes each slice into its cache as it arrives and runs once the last one is in. The answers are
the bits of the unstreamed handover; bad slices are refused without touching the request."""

from __future__ import annotations

import pytest
import torch

from asympd import LLM, SamplingParams
from asympd.engine.engine import EngineConfig, RequestError
from asympd.engine.modes import split_point
from asympd.engine.scheduler import SchedulerConfig
from asympd.transfer import PrefixStateError
from tests.util import random_prompts

W = 16
# 7 rows per step: slice boundaries at odd positions inside ratio-2 groups, and at 14, 21, ...
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7)


@pytest.mark.parametrize("policy", ["carry", "align"])
def test_streamed_prefix_gives_the_same_bits(tiny_ckpt, policy):
    lens = [W + 1, W + 8, 2 * W + 3, 61]
    prompts = random_prompts(lens, seed=3)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=-1)
    plain = LLM(tiny_ckpt, "asymmetric", boundary_policy=policy, scheduler=SCHED)
    want = [o.outputs[0] for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM(tiny_ckpt, "asymmetric", boundary_policy=policy, scheduler=SCHED, stream_prefix=True)
    got = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == w.logprobs
    for i, n in enumerate(lens):
        s = split_point(llm.cfg, n, policy)
        if s <= 7:  # P's prefix in one chunk: handed over whole
            assert str(i) not in llm.slices
            continue
        pieces = llm.slices[str(i)]
        assert pieces[0][0] == 0 and pieces[-1][1] == s and len(pieces) > 1
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    bounds = {b for pieces in llm.slices.values() for _, b in pieces[:-1]}
    assert any(b % 2 for b in bounds)  # slices ending inside a ratio-2 group (its open pair stays on P)
    assert llm.engine.blocks.num_used_blocks == 0 and llm.prefill.blocks.num_used_blocks == 0


def test_d_writes_slices_before_p_finishes(tiny_ckpt):
    prompt = random_prompts([80], seed=9)[0]  # split 64: ten chunks of 7 rows on P
    llm = LLM(tiny_ckpt, "asymmetric", scheduler=SCHED, stream_prefix=True, enable_prefix_caching=False)
    llm.add("r", prompt, SamplingParams(max_tokens=2, temperature=0))
    for _ in range(3):
        llm.step()
    assert "r" in llm.prefill.requests  # P is still computing the prefix
    assert llm.slices["r"] == [(0, 7), (7, 14), (14, 21)]
    d_req, p_req = llm.engine.requests["r"], llm.prefill.requests["r"]
    assert d_req.awaiting_import
    d_bt, p_bt = llm.engine.blocks.block_table("r"), llm.prefill.blocks.block_table("r")
    for layer in llm.cfg.kv_source_layers:
        n = 21 // llm.cfg.ratio(layer)
        for group in ("ckv", "idx"):
            d = llm.engine.cache.read_entries(f"{group}.{layer}", d_bt, n)
            p = llm.prefill.cache.read_entries(f"{group}.{layer}", p_bt, n)
            assert torch.equal(d.view(torch.int32), p.view(torch.int32)), (group, layer)
    assert p_req.streamed == 21
    while "r" in llm.engine.requests or "r" in llm.prefill.requests:
        llm.step()
    assert llm.slices["r"][-1] == (63, 64)


def test_bad_slices_are_refused(tiny_ckpt):
    prompt = random_prompts([60], seed=4)[0]
    llm = LLM(tiny_ckpt, "asymmetric", scheduler=SCHED, stream_prefix=True)
    llm.add("r", prompt, SamplingParams(max_tokens=2, temperature=0))
    pieces = []
    for _ in range(3):
        for out in llm.prefill.step():
            pieces.append(out.prefix_state)
    assert [(p.start, p.split) for p in pieces] == [(0, 7), (7, 14), (14, 21)]
    d = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0)
    d.add_request("r", prompt, params, prefix_stream=True)
    with pytest.raises(PrefixStateError, match=r"slice \[7, 14\) does not continue the prefix .* \[0, 0\)"):
        d.import_slice("r", pieces[1])
    assert not d.import_slice("r", pieces[0])
    with pytest.raises(PrefixStateError, match=r"slice \[14, 21\) does not continue the prefix .* \[0, 7\)"):
        d.import_slice("r", pieces[2])
    assert d.requests["r"].imported.upto == 7
    d.add_request("other", prompt[:-1] + [prompt[-1] ^ 1], params, prefix_stream=True)
    with pytest.raises(PrefixStateError, match="made for a different prompt"):
        d.import_slice("other", pieces[0])
    with pytest.raises(RequestError, match="not waiting for a streamed prefix"):
        d.import_slice("nope", pieces[0])
    with pytest.raises(RequestError, match="no prefix to stream"):
        d.add_request("short", prompt[:W], params, prefix_stream=True)
    d.abort_request("r")
    d.abort_request("other")
    assert d.blocks.num_used_blocks == 0


def test_streaming_needs_a_mode_without_windows_or_first_token():
    with pytest.raises(ValueError, match="stream_prefix needs mode asymmetric or encoder-only, not 'symmetric'"):
        EngineConfig(role="prefill", mode="symmetric", stream_prefix=True).validate()
