"""OpenAI's n choices computing their prompt once: a choice added with ``fork_of`` takes the first
choice's KV at its last prompt row and samples its first token from the same logits. Every choice
must give exactly what it gives alone (fp32 on CPU is batch-invariant), whatever happens to the
first choice, and nothing may leak."""

from __future__ import annotations

import pytest

from asympd import SamplingParams
from asympd.engine.engine import EngineConfig, LLMEngine, RequestError
from asympd.engine.scheduler import SchedulerConfig
from asympd.model.loader import load_model
from asympd.transfer.prefix_state import PrefixState
from tests.util import random_prompts

PROMPT = random_prompts([53], seed=41)[0]  # three full 16-token blocks and a partial one; W = 16


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return {"full": load_model(tiny_ckpt, "full"), "prefill": load_model(tiny_ckpt, "prefill")}


def make(model, role="colocated", mode="colocated", num_blocks=None, spec=0) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)
    kw = {"num_blocks": num_blocks} if num_blocks else {}
    cfg = EngineConfig(role=role, mode=mode, prefill_semantics="split", scheduler=sched, num_spec_tokens=spec, **kw)
    return LLMEngine(model, cfg)


def run(eng: LLMEngine, limit: int = 500) -> dict[str, list[int]]:
    out = {}
    for _ in range(limit):
        for o in eng.step():
            if o.finished:
                assert o.error is None, o.error
                out[o.request_id] = o.outputs[0].token_ids
        if not eng.has_unfinished_requests():
            assert eng.blocks.num_used_blocks == 0 and eng.blocks.num_free_slots == eng.blocks.max_seqs
            return out
    raise AssertionError("the engine did not finish")


def choices(n: int, seed: int | None = None, max_tokens: int = 6) -> list[SamplingParams]:
    hot = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **{**hot, **({"seed": seed + i} if seed else {})})
            for i in range(n)]  # fmt: skip


def alone(model, params: list[SamplingParams], **kw) -> list[list[int]]:
    """Each choice as a request of its own, on an engine of its own."""
    out, state = [], kw.pop("state", None)
    for p in params:
        eng = make(model, **kw)
        eng.add_request("a", PROMPT, p, prefix_state=state)
        out.append(run(eng)["a"])
    return out


def add_choices(eng: LLMEngine, params: list[SamplingParams], state=None) -> None:
    for i, p in enumerate(params):
        eng.add_request(f"c{i}", PROMPT, p, prefix_state=state, fork_of="c0" if i else None)


@pytest.mark.parametrize("seed", [None, 7])
def test_colocated_choices_compute_the_prompt_once(models, seed):
    params = choices(3, seed)
    eng = make(models["full"])
    add_choices(eng, params)
    assert eng.stats()["waiting"] == 3
    while not eng.requests["c0"].output_token_ids:  # the prompt (split's two phases), then the fork
        eng.step()
    assert eng.counters["prompt_tokens"] == len(PROMPT)  # once, not three times
    assert [len(eng.requests[f"c{i}"].output_token_ids) for i in range(3)] == [1, 1, 1]
    # 53 + 1 (+1 sampled) tokens: 4 blocks each, the first 3 shared
    assert eng.blocks.num_used_blocks == 4 + 2 * 1
    got = run(eng)
    assert [got[f"c{i}"] for i in range(3)] == alone(models["full"], params)


def test_decode_worker_choices_fork_after_the_bounded_prefill_with_drafts(models):
    """Asymmetric D with speculative decoding: the choices share the imported prefix and D's own
    rows, and their drafter windows are seeded from the same rows (seeded draws equal alone)."""
    p = make(models["prefill"], role="prefill", mode="asymmetric")
    p.add_request("x", PROMPT, SamplingParams(max_tokens=1))
    (out,) = [o for o in p.step() if o.finished]
    state = PrefixState.deserialize(out.prefix_state.serialize())
    for params in (choices(3), choices(3, seed=11, max_tokens=8)):
        d = make(models["full"], role="decode", mode="asymmetric", spec=2)
        add_choices(d, params, state)
        got = run(d)
        assert d.counters["prompt_tokens"] == len(PROMPT) - state.split  # D's bounded rows, once
        assert d.counters["spec_steps"] > 0
        assert [got[f"c{i}"] for i in range(3)] == alone(
            models["full"], params, role="decode", mode="asymmetric", spec=2, state=state
        )


def test_choices_run_alone_when_the_first_ends_or_memory_is_short(models):
    params = choices(3, seed=5)
    want = alone(models["full"], params)
    eng = make(models["full"])
    add_choices(eng, params)
    eng.abort_request("c0")  # before its prompt ran: the others compute it themselves
    got = run(eng)
    assert "c0" not in got and [got["c1"], got["c2"]] == want[1:]
    assert eng.counters["prompt_tokens"] == 2 * len(PROMPT)
    # a cache of 5 blocks: the first choice holds 4, the second's fork takes the fifth, so the
    # third computes its prompt later, on its own (its seeded generator restarted)
    eng = make(models["full"], num_blocks=5)
    add_choices(eng, params)
    while not eng.requests["c0"].output_token_ids:
        eng.step()
    assert [eng.requests[f"c{i}"].status.value for i in range(3)] == ["running", "running", "waiting"]
    got = run(eng)
    assert [got[f"c{i}"] for i in range(3)] == want
    eng = make(models["full"])
    add_choices(eng, params)
    eng.abort_request("c1")  # a choice waiting to fork leaves: nothing of it runs
    got = run(eng)
    assert sorted(got) == ["c0", "c2"] and got["c2"] == want[2]


def test_a_fork_of_another_prompt_is_refused(models):
    eng = make(models["full"])
    eng.add_request("c0", PROMPT, choices(1)[0])
    with pytest.raises(RequestError, match="forks from 'c0', whose prompt is another"):
        eng.add_request("c1", PROMPT[:-1], choices(1)[0], fork_of="c0")
    assert "c1" not in eng.requests
    eng.add_request("c1", PROMPT, choices(1)[0], fork_of="gone")  # nothing to fork from: runs alone
    got = run(eng)
    assert got["c0"] == got["c1"]
