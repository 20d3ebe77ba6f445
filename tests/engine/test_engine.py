"""The engine through its public interface: admission, preemption, aborts, prefix state hand-off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asympd import LLM, SamplingParams
from asympd.engine.engine import EngineConfig, LLMEngine, RequestError
from asympd.engine.scheduler import SchedulerConfig
from asympd.model.loader import load_model
from asympd.transfer.prefix_state import PrefixState, PrefixStateError
from tests.util import random_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return {"full": load_model(tiny_ckpt, "full"), "prefill": load_model(tiny_ckpt, "prefill")}


def engine(model, role="colocated", mode="colocated", **kw) -> LLMEngine:
    sched = kw.pop("scheduler", SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    return LLMEngine(
        model, EngineConfig(role=role, mode=mode, prefill_semantics=kw.pop("semantics", "split"), scheduler=sched, **kw)
    )


def drain(eng: LLMEngine, limit: int = 2000) -> dict[str, object]:
    done = {}
    for _ in range(limit):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if not eng.has_unfinished_requests():
            return done
    raise AssertionError("engine did not finish")


def handoff(p: LLMEngine, d: LLMEngine, outs, params: dict[str, SamplingParams]) -> None:
    """What the network path does: serialize P's state, rebuild it on D, release P's blocks."""
    for out in outs:
        if out.prefix_state is not None:
            state = PrefixState.deserialize(out.prefix_state.serialize())
            d.add_request(out.request_id, out.prompt_token_ids, params[out.request_id], prefix_state=state)
            p.release_transfer(out.request_id)


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids,params,message",
    [
        ([], GREEDY, "the prompt is empty"),
        ([1, 2, 999], GREEDY, "out of range"),
        ([1, 2.5, True], GREEDY, r"prompt token ids must be integers: \[2.5, True\]"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens must be a positive integer"),
        ([1, 2], SamplingParams(temperature=-1), r"temperature must be in \[0, 3.403e\+38\] \(fp32's largest"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature must be in .* got nan"),
        ([1, 2], SamplingParams(top_p=0), "top_p must be in"),
        ([1] * 4000, SamplingParams(max_tokens=200), "exceeds max_seq_len 4096"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_allocated(models, ids, params, message):
    eng = engine(models["full"])
    with pytest.raises(RequestError, match=message):
        eng.add_request("a", ids, params)
    assert not eng.has_unfinished_requests() and eng.blocks.num_used_blocks == 0


def test_a_request_that_waits_for_a_slot_reports_its_queue_time(models):
    """``RequestOutput.metrics["queue"]``: added to first taken into a step (vLLM's request queue
    time). With one sequence at a time the second request waits out the whole first one, a
    prompt step and three decode steps at least; the first is taken by the first step."""
    eng = engine(models["full"], scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256))
    a, b = random_prompts([20, 20], seed=5)
    eng.add_request("a", a, GREEDY)
    eng.add_request("b", b, GREEDY)
    eng.step()  # a's prompt
    assert eng.requests["a"].scheduled_time is not None and eng.requests["b"].scheduled_time is None
    done = drain(eng)
    qa, qb = done["a"].metrics["queue"], done["b"].metrics["queue"]
    assert 0 <= qa < qb < done["b"].metrics["ttft"], (qa, qb)
    assert qb > done["a"].metrics["e2e"] - qa  # b was taken after a had finished


def test_duplicate_request_id(models):
    eng = engine(models["full"])
    eng.add_request("a", [1, 2, 3], GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request("a", [1, 2, 3], GREEDY)


def test_request_that_can_never_fit_is_refused_and_others_finish(models):
    eng = engine(models["full"], num_blocks=6)  # 6 blocks x 16 tokens
    with pytest.raises(RequestError, match="needs 13 KV blocks but the whole cache has 6"):
        eng.add_request("big", random_prompts([200])[0], GREEDY)
    eng.add_request("small", random_prompts([20])[0], GREEDY)
    assert drain(eng)["small"].outputs[0].finish_reason == "length"
    assert eng.blocks.num_used_blocks == 0


# ---- preemption -----------------------------------------------------------------------------------


def test_preemption_recomputes_to_the_same_tokens(models):
    prompts = random_prompts([30, 40, 50, 35, 45], seed=21)
    params = SamplingParams(max_tokens=20, temperature=0)

    def run(num_blocks):
        eng = engine(models["full"], num_blocks=num_blocks)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        done = drain(eng)
        assert eng.blocks.num_used_blocks == 0
        return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], eng.counters["preemptions"]

    roomy, none = run(256)
    tight, preemptions = run(10)
    assert none == 0 and preemptions > 0
    assert tight == roomy


def test_preemption_and_aborts_on_the_graph_decode_path(models):
    """Decode steps on the CUDA-graph path (run here without capture over its static buffers):
    preemption (slots reset, blocks freed and reallocated), an abort and early stops keep the eager
    engine's tokens, and no block leaks."""
    from asympd.engine.cuda_graphs import DecodeGraphs

    prompts = random_prompts([30, 40, 50, 35, 45, 20], seed=21)
    params = [SamplingParams(max_tokens=20, temperature=0) for _ in prompts]
    params[2] = SamplingParams(max_tokens=7, temperature=0)  # finishes while others decode
    params[4] = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[prompts[4][-1]])

    def run(graphs: bool):
        eng = engine(models["full"], num_blocks=10)
        if graphs:
            eng.runner.graphs = DecodeGraphs(eng.model, eng.cache, capture=False, max_batch=8)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params[i])
        for _ in range(6):
            eng.step()
        eng.abort_request("5")
        done = drain(eng)
        assert eng.blocks.num_used_blocks == 0
        tokens = {k: v.outputs[0].token_ids for k, v in done.items() if k != "5"}
        return tokens, eng.counters["preemptions"], eng.runner.graphs

    want, _, _ = run(False)
    got, preemptions, graphs = run(True)
    assert preemptions > 0 and graphs.stats["replayed"] + graphs.stats["first"] >= 10, graphs.stats
    assert got == want


def test_new_token_ids_report_each_token_once_across_preemptions(models):
    """A symmetric D request's first token comes from P; when D preempts and recomputes the request,
    the tokens it already reported are not reported again (the stream is the concatenation)."""
    prompts = random_prompts([30, 40, 50, 35, 45], seed=23)
    params = SamplingParams(max_tokens=20, temperature=0)
    p = engine(models["full"], role="prefill", mode="symmetric", num_blocks=256)
    d = engine(models["full"], role="decode", mode="symmetric", num_blocks=10)
    for i, prompt in enumerate(prompts):
        p.add_request(str(i), prompt, params)
    for out in drain(p).values():
        state = PrefixState.deserialize(out.prefix_state.serialize())
        first = out.outputs[0].token_ids[0]
        d.add_request(out.request_id, out.prompt_token_ids, params, prefix_state=state, first_token=first)
        p.release_transfer(out.request_id)
    streamed: dict[str, list[int]] = {}
    done = {}
    for _ in range(2000):
        for out in d.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out
        if not d.has_unfinished_requests():
            break
    assert d.counters["preemptions"] > 0
    assert len(done) == len(prompts)
    for rid, out in done.items():
        assert streamed[rid] == out.outputs[0].token_ids, rid


# ---- P -> D hand-off ----------------------------------------------------------------------------


def test_corrupted_or_mismatched_prefix_state_is_rejected_cleanly(models):
    p = engine(models["prefill"], role="prefill", mode="asymmetric")
    d = engine(models["full"], role="decode", mode="asymmetric")
    prompt = random_prompts([41], seed=22)[0]
    p.add_request("x", prompt, GREEDY)
    (out,) = [o for o in drain(p).values()]
    blob = out.prefix_state.serialize()

    corrupted = bytearray(blob)
    corrupted[len(blob) // 2] ^= 0xFF
    with pytest.raises(PrefixStateError):
        PrefixState.deserialize(bytes(corrupted))
    with pytest.raises(PrefixStateError):
        PrefixState.deserialize(blob[: len(blob) - 7])

    state = PrefixState.deserialize(blob)
    foreign = PrefixState.deserialize(blob)
    foreign.fingerprint = "0" * 16
    with pytest.raises(PrefixStateError, match="fingerprint"):
        d.add_request("x", prompt, GREEDY, prefix_state=foreign)
    with pytest.raises(PrefixStateError, match="of the same prompt"):
        d.add_request("x", prompt[:-1] + [prompt[-1] ^ 1], GREEDY, prefix_state=state)
    short = PrefixState.deserialize(blob)
    short.ckv[3] = short.ckv[3][:-1]
    with pytest.raises(PrefixStateError, match=r"ckv\[3\]"):
        d.add_request("x", prompt, GREEDY, prefix_state=short)
    align_d = engine(models["full"], role="decode", mode="asymmetric", boundary_policy="align")
    with pytest.raises(PrefixStateError, match="needs \\[0, 24\\)"):
        align_d.add_request("x", prompt, GREEDY, prefix_state=state)
    for eng in (d, align_d):
        assert not eng.has_unfinished_requests() and eng.blocks.num_used_blocks == 0

    d.add_request("x", prompt, GREEDY, prefix_state=state)  # the intact state still works
    assert drain(d)["x"].outputs[0].finish_reason == "length"
    p.release_transfer("x")
    assert p.blocks.num_used_blocks == 0


def test_aborting_an_exported_prefix_before_d_fetches_it_frees_its_blocks(models):
    """P holds an exported prefix's blocks until D acks it; a client leaving in between aborts it."""
    p = engine(models["prefill"], role="prefill", mode="asymmetric")
    prompt = random_prompts([41], seed=24)[0]
    p.add_request("x", prompt, GREEDY)
    (out,) = drain(p).values()
    assert out.outputs[0].finish_reason == "exported" and out.prefix_state.split == 41 - 16
    assert p.stats()["held_for_transfer"] == 1 and p.blocks.num_used_blocks == 3  # 42 tokens reserved
    p.abort_request("x")
    assert p.stats()["held_for_transfer"] == 0 and p.blocks.num_used_blocks == 0
    p.release_transfer("x")  # the late ack (or lease expiry) is a no-op
    p.add_request("x", prompt, GREEDY)  # and the id is free again
    assert drain(p)["x"].prefix_state.split == 41 - 16
    p.release_transfer("x")
    assert p.blocks.num_used_blocks == 0


def test_prefix_cache_hit_on_import_gives_the_cold_tokens(tiny_ckpt):
    """D keeps imported prefixes cached: a second request sharing the prefix reuses the blocks
    instead of writing them again, and decodes exactly what a cold engine decodes."""
    shared = random_prompts([180], seed=23)[0]
    first, second = shared + [5, 6, 7], shared + [9, 8]
    warm = LLM(tiny_ckpt, "asymmetric")
    warm.generate(prompt_token_ids=[first], sampling_params=GREEDY)
    warm.add("b", second, GREEDY)
    hits = []
    out = None
    while out is None:
        for o in warm.step():
            if o.finished:
                out = o
        req = warm.engine.requests.get("b")
        if req is not None and req.status.value == "running":
            hits.append(req.num_cached_import)
    assert max(hits) == 160  # the 10 full 16-token blocks below s = 182 - 16
    cold = LLM(tiny_ckpt, "asymmetric").generate(prompt_token_ids=[second], sampling_params=GREEDY)[0]
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.engine.blocks.num_used_blocks == 0


def test_requests_on_one_imported_prefix_admitted_together_share_its_blocks(models):
    """OpenAI's n on D: n requests on the one prefix state, admitted in the same step, hold the
    prefix's blocks once (the first writes them, the others hit them at once) and each decodes what
    it decodes alone."""
    prompt = random_prompts([180], seed=31)[0]
    p = engine(models["prefill"], role="prefill", mode="asymmetric")
    p.add_request("x", prompt, GREEDY)
    state = PrefixState.deserialize(drain(p)["x"].prefix_state.serialize())
    assert state.split == 180 - 16  # 10 full 16-token blocks below it

    def run(n: int) -> tuple[dict[str, object], list[int], int]:
        d = engine(models["full"], role="decode", mode="asymmetric")
        for i in range(n):
            d.add_request(f"c{i}", prompt, GREEDY, prefix_state=state)
        d.step()  # all n admitted together
        used = d.blocks.num_used_blocks
        cached = [d.requests[f"c{i}"].num_cached_import for i in range(n)]
        done = drain(d)
        assert d.blocks.num_used_blocks == 0
        return done, cached, used

    alone, _, one = run(1)
    done, cached, three = run(3)
    assert cached == [0, 160, 160]
    assert one == 12 and three == one + 2 * 2  # 181 + 1 rows: 12 blocks, of which 10 are shared
    for i in range(3):
        assert done[f"c{i}"].outputs[0].token_ids == alone["c0"].outputs[0].token_ids


# ---- storms -------------------------------------------------------------------------------------

add = st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 6), st.integers(0, 2**16))
ops = st.lists(
    st.one_of(
        add,
        # a burst of 14-token prompts: each takes one block at admission and a second two tokens
        # later, so the cache fills and a decode step has to preempt
        st.tuples(st.just("burst"), st.integers(4, 8), st.integers(3, 6), st.integers(0, 2**16)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("fetch"), st.integers(1, 3)),  # D fetches the oldest exported prefixes
    ),
    min_size=4,
    max_size=25,
)


def test_request_storm_with_aborts(models):
    """Random arrivals, aborts, steps and fetches over a tight cache. Requests are aborted in every
    state (waiting, running, held by P for a transfer D has not fetched yet), preemptions happen,
    every request not aborted decodes exactly what a calm run decodes, and afterwards no block is in
    use on any engine."""
    calm_engine = engine(models["full"], scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096))
    calm: dict[tuple[tuple[int, ...], int], list[int]] = {}
    seen: dict[str, int] = {"preempted": 0, "waiting": 0, "running": 0, "held": 0}

    def calm_tokens(jobs: list[tuple[tuple[int, ...], int]]) -> None:
        """One roomy engine, the same semantics (asymmetric P/D equals colocated split bit for bit)."""
        todo = {f"c{len(calm) + i}": job for i, job in enumerate(dict.fromkeys(j for j in jobs if j not in calm))}
        for rid, (prompt, n) in todo.items():
            calm_engine.add_request(rid, list(prompt), SamplingParams(max_tokens=n, temperature=0))
        for rid, out in drain(calm_engine).items():
            calm[todo[rid]] = out.outputs[0].token_ids

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(ops=ops, pd=st.booleans())
    def storm(ops, pd):
        if pd:
            p = engine(models["prefill"], role="prefill", mode="asymmetric", num_blocks=8)
            d = engine(models["full"], role="decode", mode="asymmetric", num_blocks=8)
            engines = [p, d]
        else:
            engines = [engine(models["full"], num_blocks=8)]
        jobs: dict[str, tuple[tuple[int, ...], int]] = {}
        params: dict[str, SamplingParams] = {}
        aborted: set[str] = set()
        done: dict[str, list[int]] = {}
        in_transfer: list = []  # P's exported outputs D has not fetched yet

        def fetch(k: int) -> None:
            for out in in_transfer[:k]:
                if out.request_id in p.held:  # an aborted one is gone: nothing to fetch
                    handoff(p, d, [out], params)
            del in_transfer[:k]

        def step_all() -> None:
            for e in engines:
                for out in e.step():
                    assert out.error is None, out.error
                    if pd and e is p:
                        in_transfer.append(out)
                    elif out.finished:
                        done[out.request_id] = out.outputs[0].token_ids

        def add(n: int, max_tokens: int, seed: int) -> None:
            rid = f"r{len(jobs)}"
            prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
            jobs[rid] = (tuple(prompt), max_tokens)
            params[rid] = SamplingParams(max_tokens=max_tokens, temperature=0)
            engines[0].add_request(rid, prompt, params[rid])

        for op in ops:
            if op[0] == "add":
                add(*op[1:])
            elif op[0] == "burst":
                for i in range(op[1]):
                    add(14, op[2], op[3] + i)
            elif op[0] == "abort" and jobs:
                live = [r for r in jobs if r not in done and r not in aborted] or list(jobs)
                rid = live[op[1] % len(live)]
                if rid not in done:
                    aborted.add(rid)
                    for e in engines:
                        if rid in e.held:
                            seen["held"] += 1
                        elif rid in e.requests:
                            seen[e.requests[rid].status.value] += 1
                for e in engines:
                    e.abort_request(rid)
            elif op[0] == "fetch" and pd:
                fetch(op[1])
            else:
                for _ in range(op[1]):
                    step_all()
        for _ in range(3000):
            if not any(e.has_unfinished_requests() for e in engines) and not in_transfer:
                break
            fetch(len(in_transfer))
            step_all()
        for e in engines:
            assert not e.has_unfinished_requests()
            assert e.blocks.num_used_blocks == 0
            assert e.stats()["held_for_transfer"] == 0
        assert set(done) == set(jobs) - aborted
        calm_tokens([jobs[rid] for rid in done])
        assert done == {rid: calm[jobs[rid]] for rid in done}
        seen["preempted"] += any(e.counters["preemptions"] for e in engines)

    storm()
    # the examples exercised what the storm is for (derandomized: the same examples every run)
    assert seen["preempted"] >= 2 and seen["waiting"] > 0 and seen["running"] > 0 and seen["held"] > 0, seen


def test_request_token_reads_equal_the_whole_history():
    """``num_tokens``, ``last_token`` and ``token_slice`` (what the engine reads per request per step
    instead of building ``all_token_ids``) give exactly what the whole list gives, at every split."""
    from asympd.engine.request import Request

    for n_out in (0, 1, 3):
        req = Request("r", [5, 6, 7, 8], SamplingParams(), [])
        req.output_token_ids = [9, 10, 11][:n_out]
        whole = req.all_token_ids
        assert req.num_tokens == len(whole) and req.last_token == whole[-1]
        for extra in (None, [], [20, 21]):
            full = whole + (extra or [])
            for lo in range(len(full) + 1):
                for hi in range(lo, len(full) + 2):
                    assert req.token_slice(lo, hi, extra) == full[lo:hi], (n_out, extra, lo, hi)
