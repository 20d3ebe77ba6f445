"""Sarathi-style admission: new work per step is capped so running decodes keep their pace."""

from __future__ import annotations

import pytest

from asympd import SamplingParams
from asympd.engine.engine import EngineConfig, LLMEngine
from asympd.engine.scheduler import SchedulerConfig
from asympd.model.loader import load_model
from tests.util import random_prompts


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load_model(tiny_ckpt, "full")


def make(model, **sched) -> LLMEngine:
    sched_cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, **sched)
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
