"""Sarathi-style admission: new work per step is capped so running decodes keep their pace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from asympd import SamplingParams
from asympd.engine.engine import EngineConfig, LLMEngine
from asympd.engine.runner import ModelRunner
from asympd.engine.scheduler import SchedulerConfig
from asympd.model.loader import load_model
from tests.util import random_prompts


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, "full")


def make(model, **sched) -> LLMEngine:
    sched_cfg = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 256, **sched})
    return LLMEngine(model, EngineConfig(scheduler=sched_cfg))


def test_admission_cap_admits_one_request_per_step(model):
    eng = make(model, max_new_admissions=1)
    for i, p in enumerate(random_prompts([10, 12, 14, 16], seed=51)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0))
    running = []
    for _ in range(4):
        eng.step()
        running.append(eng.stats()["running"])
    assert running == [1, 2, 3, 4]


def test_prompt_token_budget_chunks_new_prefills_while_decodes_run(model):
    eng = make(model, admission_token_budget=16)
    eng.add_request("running", random_prompts([8], seed=52)[0], SamplingParams(max_tokens=20, temperature=0))
    eng.step()  # its prompt fits the budget: first token sampled
    eng.add_request("long", random_prompts([100], seed=53)[0], SamplingParams(max_tokens=2, temperature=0))
    tokens_per_step, cursors = [], []
    for _ in range(6):
        outs = {o.request_id: o for o in eng.step()}
        tokens_per_step.append(len(outs["running"].new_token_ids) if "running" in outs else 0)
        cursors.append(eng.requests["long"].cursor)
    assert tokens_per_step == [1] * 6  # the running decode advanced every step
    assert cursors == [16, 32, 48, 64, 80, 96]  # the new prompt was fed 16 rows per step, not 100 at once


def test_unmixed_steps_take_turns_and_give_the_mixed_tokens(model):
    """``mixed_steps=False`` (the ``alone-4`` policy): a step carries prompt rows or decode rows,
    never both, taking turns while both wait; the tokens are the mixed engine's (rows are
    batch-invariant on CPU)."""
    results = {}
    for mixed in (True, False):
        eng = make(model, admission_token_budget=16, mixed_steps=mixed)
        eng.add_request("running", random_prompts([8], seed=52)[0], SamplingParams(max_tokens=20, temperature=0))
        eng.step()
        eng.add_request("long", random_prompts([100], seed=53)[0], SamplingParams(max_tokens=4, temperature=0))
        pattern, tokens = [], {"running": [], "long": []}
        while eng.has_unfinished_requests():
            outs = {o.request_id: o for o in eng.step()}
            for rid, o in outs.items():
                tokens[rid] += o.new_token_ids
            long = eng.requests.get("long")
            ran = len(outs["running"].new_token_ids) if "running" in outs else 0
            pattern.append((ran, long.cursor if long is not None else None))
        results[mixed] = pattern, tokens
    (mixed_pattern, mixed_tokens), (alone_pattern, alone_tokens) = results[True], results[False]
    assert alone_tokens == mixed_tokens
    assert mixed_pattern[:3] == [(1, 16), (1, 32), (1, 48)]
    assert alone_pattern[:6] == [(1, 0), (0, 16), (1, 16), (0, 32), (1, 32), (0, 48)]  # turns: decode, prompt, ...
    assert len(alone_pattern) > len(mixed_pattern)


def test_unmixed_steps_run_decodes_when_no_prompt_rows_can_go(model):
    """A prompt turn that schedules no rows (here: the only waiting request cannot be admitted,
    the sequence cap is reached) runs the decodes instead of an empty step."""
    eng = make(model, mixed_steps=False, max_num_seqs=1)
    eng.add_request("a", random_prompts([8], seed=54)[0], SamplingParams(max_tokens=3, temperature=0))
    eng.add_request("b", random_prompts([8], seed=55)[0], SamplingParams(max_tokens=3, temperature=0))
    per_step = []
    while eng.has_unfinished_requests():
        per_step.append(sorted((o.request_id, len(o.new_token_ids)) for o in eng.step() if o.new_token_ids))
    assert per_step == [[("a", 1)], [("a", 1)], [("a", 1)], [("b", 1)], [("b", 1)], [("b", 1)]]


def test_unmixed_steps_keep_the_tokens_of_asymmetric_pd_with_speculation(tiny_ckpt):
    """Asymmetric P->D with DSpark drafts: unmixed steps (the decode worker's default policy) give
    the greedy tokens of mixed ones; only the step composition differs."""
    from asympd import LLM

    def tokens(mixed: bool) -> list[list[int]]:
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, mixed_steps=mixed)
        llm = LLM(tiny_ckpt, "asymmetric", scheduler=sched, num_spec_tokens=2)
        outs = llm.generate(
            prompt_token_ids=random_prompts([12, 30, 45, 70], seed=56),
            sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        )
        return [o.outputs[0].token_ids for o in outs]

    mixed = tokens(True)
    assert tokens(False) == mixed
    assert all(len(t) == 8 for t in mixed)


def _record_steps(monkeypatch, what: Callable[[Any], Any]) -> list[list[Any]]:
    """Every step's chunks, each as ``what(chunk)``, in the order the runner gets them."""
    steps: list[list[Any]] = []
    execute = ModelRunner.execute

    def recording(self, chunks, wants):
        steps.append([what(c) for c in chunks])
        return execute(self, chunks, wants)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return steps


def test_a_symmetric_p_runs_its_window_chunks_first_and_alone(model, monkeypatch):
    """A symmetric P's scheduler (``one_depth_per_step``, set by the engine) runs the chunks of the
    deepest phase its requests in progress wait at, alone: a request's window (its last W rows
    through every layer, which then replay a CUDA graph) goes before other prefixes and with no
    admission beside it, and finishes that request's prompt. An asymmetric P keeps mixing."""
    steps = _record_steps(monkeypatch, lambda c: (c.request.request_id, c.hi - c.lo, c.phase.depth.name))
    for mode in ("symmetric-split", "asymmetric"):
        sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32)
        eng = LLMEngine(model, EngineConfig(role="prefill", mode=mode, scheduler=sched))
        assert eng.scheduler.config.one_depth_per_step == (mode == "symmetric-split")
        for rid, p in zip("ab", random_prompts([40, 100], seed=54), strict=True):
            eng.add_request(rid, p, SamplingParams(max_tokens=1, temperature=0))
        steps.clear()
        while eng.has_unfinished_requests():
            eng.step()
        if mode == "symmetric-split":  # tiny: W = 16; a's prefix is 24 rows, b's 84
            assert steps == [
                [("a", 24, "ENCODER_KV"), ("b", 8, "ENCODER_KV")],
                [("a", 16, "ALL")],  # a's window first and alone: b's prefix waits a step
                [("b", 32, "ENCODER_KV")],
                [("b", 32, "ENCODER_KV")],
                [("b", 12, "ENCODER_KV")],
                [("b", 16, "ALL")],
            ]
        else:  # P stops at the split point: prefixes only, mixed as before
            assert steps[0] == [("a", 24, "ENCODER_KV"), ("b", 8, "ENCODER_KV")]


def test_a_symmetric_p_steps_hold_as_many_windows_as_its_graphs(model, monkeypatch):
    """Windows ready together go in steps of at most ``modes.P_WINDOW_GRAPH_BATCH`` (4), the
    largest batch the P's graphs replay; the rest take the next step."""
    steps = _record_steps(monkeypatch, lambda c: c.hi - c.lo)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
    eng = LLMEngine(model, EngineConfig(role="prefill", mode="symmetric-windows", scheduler=sched))
    assert eng.scheduler.config.max_deepest_chunks == 4
    for i, p in enumerate(random_prompts([40] * 6, seed=55)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=1, temperature=0))
    while eng.has_unfinished_requests():
        eng.step()
    assert steps == [[24] * 6, [16] * 4, [16] * 2]  # six prefixes, then the windows: 4 and 2
