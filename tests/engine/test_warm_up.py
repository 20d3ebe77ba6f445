"""The start-up warm-up (engine/warm_up.py): which prompt sizes it runs, that it leaves the engine
as it found it (no request, block, held export or counted token), and that what the engine serves
afterwards is bit for bit what a cold engine serves."""

from __future__ import annotations

import pytest
import torch

from asympd.engine.engine import EngineConfig, LLMEngine
from asympd.engine.sampling import SamplingParams
from asympd.engine.scheduler import SchedulerConfig
from asympd.engine.warm_up import warm_up, warm_up_rows
from asympd.model.loader import load_model
from asympd.transfer.prefix_state import PrefixState
from tests.engine.test_engine import drain, handoff
from tests.util import random_prompts

GREEDY = SamplingParams(max_tokens=5, temperature=0)


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return {"full": load_model(tiny_ckpt, "full"), "prefill": load_model(tiny_ckpt, "prefill")}


def engine(model, role: str, mode: str, warm: bool | None, **kw) -> LLMEngine:
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96)
    return LLMEngine(model, EngineConfig(role=role, mode=mode, scheduler=sched, warm_up=warm, **kw))


def test_the_sizes_are_the_powers_of_two_one_row_more_and_the_budget():
    assert warm_up_rows(96) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 96]
    assert warm_up_rows(1) == [1]
    assert warm_up_rows(16384)[-3:] == [8192, 8193, 16384]
    # piecewise graph sizes up to the budget too (a P's every 256 rows from 512 to 2048)
    with_pieces = warm_up_rows(2048, (768, 1024, 1280, 4096))
    assert [r for r in with_pieces if r not in warm_up_rows(2048)] == [768, 1280]  # 4096: past the budget
    assert with_pieces == sorted(with_pieces)
    with pytest.raises(ValueError, match="the step budget must be positive, got 0"):
        warm_up_rows(0)


@pytest.mark.parametrize(
    "role,mode,model,stream", [("colocated", "colocated", "full", False), ("prefill", "asymmetric", "prefill", False),
                               ("prefill", "asymmetric", "prefill", True), ("decode", "asymmetric", "full", False)],
)  # fmt: skip
def test_warm_up_leaves_the_engine_as_it_found_it(models, role, mode, model, stream):
    """Every size runs (the tiny context holds them all), as one prompt step each: the prefill
    worker's prompts are 16 tokens (W) longer than their rows, the others' as long. A prefill
    worker that streams its prefix in slices leaves none of them held either."""
    eng = engine(models[model], role, mode, warm=True, stream_prefix=stream)
    report = eng.warm_up_report
    assert report.rows == tuple(warm_up_rows(96)) and report.seconds > 0
    stats = eng.stats()
    assert (stats["running"], stats["waiting"], stats["held_for_transfer"], stats["exports_draining"]) == (0,) * 4
    assert eng.blocks.num_used_blocks == 0 and not eng.requests and not eng.held
    assert {k: stats[k] for k in ("prompt_tokens", "generation_tokens", "steps", "preemptions")} == dict.fromkeys(
        ("prompt_tokens", "generation_tokens", "steps", "preemptions"), 0
    )
    assert stats["warm_up_prompts"] == 14
    assert engine(models[model], role, mode, warm=None).warm_up_report is None  # CPU: off by default
    eng.add_request("busy", random_prompts([30], seed=1)[0], GREEDY)
    with pytest.raises(RuntimeError, match="warm-up runs on an idle engine"):
        warm_up(eng)


def test_a_p_with_piecewise_graphs_warms_every_piece_size(models):
    """With its prompt steps as piecewise graphs (here their static path, without capture) a P's
    warm-up runs a prompt at each piece size, so every size's pieces exist before serving."""
    from asympd.engine.cuda_graphs import PrefillPieces

    eng = engine(models["prefill"], "prefill", "asymmetric", warm=False)
    eng.runner.graphs = PrefillPieces(torch.device("cpu"), capture=False, sizes=(8, 24, 48, 96))
    report = warm_up(eng)
    assert report.rows == tuple(warm_up_rows(96, (8, 24, 48, 96))) and {24, 48} <= set(report.rows)
    # every piece comes from the warm-up: two a layer (around attention) at each of the four sizes
    n_layers = len({layer for layer, _, _ in eng.runner.graphs.piecewise.pieces})
    assert report.pieces == len(eng.runner.graphs.piecewise.pieces) == 2 * 4 * n_layers > 0
    assert report.reserved_bytes is None  # CPU: no device allocator to read
    assert report.line().endswith(f" s, {report.pieces} piecewise graph pieces built")
    assert {t for _, _, t in eng.runner.graphs.piecewise.pieces} == {8, 24, 48, 96}
    assert eng.stats()["steps"] == 0 and not eng.requests and not eng.held
    # every size reads and writes the first rows of one buffer set at the largest: 96 rows' worth
    views = eng.runner.graphs.piecewise.buffers
    assert set(views) == {8, 24, 48, 96} and set(views[8]) == set(views[96])
    size_bytes = {t: sum(v.nbytes for v in views[t].values()) for t in views}
    assert eng.runner.graphs.stats["piece_buffer_bytes"] == size_bytes[96] == 12 * size_bytes[8] > 0


def test_a_symmetric_ps_warm_up_steps_are_not_counted_as_served_graph_steps(models):
    """A symmetric P's window steps in the warm-up build their graphs (here their static path,
    without capture) before serving; the steps themselves are not served steps, so the counts the
    server reports (a step that builds a graph is a new shape) read as before it."""
    eng = engine(models["full"], "prefill", "symmetric-split", warm=False)
    eng.runner.graphs = eng.make_graphs(capture=False)  # with its prompt pieces: a P's default mode
    before = eng.runner.graphs.stats
    assert eng.runner.graphs.piecewise is not None and before["first"] == 0
    warm_up(eng)
    after = eng.runner.graphs.stats
    assert eng.runner.graphs.graphs, "the window steps built their graphs"
    assert {k: after[k] for k in ("replayed", "first", "eager")} == {
        k: before[k] for k in ("replayed", "first", "eager")
    }
    assert after["blocks"] > 0  # the prompt chunks ran through the pieces


def test_a_warmed_engine_serves_what_a_cold_one_serves(models):
    """Colocated tokens, and P's exported prefix bytes and D's tokens from them, equal a cold
    engine's."""
    prompts = random_prompts([40, 77, 130], seed=5)
    params = {str(i): GREEDY for i in range(len(prompts))}
    got = {}
    for warm in (False, True):
        col = engine(models["full"], "colocated", "colocated", warm)
        p = engine(models["prefill"], "prefill", "asymmetric", warm)
        d = engine(models["full"], "decode", "asymmetric", warm)
        for i, ids in enumerate(prompts):
            col.add_request(str(i), ids, GREEDY)
            p.add_request(str(i), ids, GREEDY)
        tokens = {k: v.outputs[0].token_ids for k, v in drain(col).items()}
        exported = drain(p)
        wires = {k: v.prefix_state.serialize() for k, v in exported.items()}
        handoff(p, d, exported.values(), params)
        pd_tokens = {k: v.outputs[0].token_ids for k, v in drain(d).items()}
        got[warm] = (tokens, wires, pd_tokens)
        assert p.blocks.num_used_blocks == 0
    assert got[True] == got[False]
    assert all(len(t) == 5 for t in got[True][0].values())
    assert PrefixState.deserialize(got[True][1]["2"]).split == 130 - 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("role,mode,model", [("prefill", "asymmetric", "prefill"), ("colocated", "colocated", "full")])
def test_on_a_gpu_the_warmed_engine_compiles_nothing_while_serving(tiny_ckpt, role, mode, model):
    """The point of it: after the warm-up (on by default on CUDA), prompts of other lengths than
    the warm-up's, in batches, meet no Triton kernel variant for the first time. Run on the
    device (bench/results/cuda_tests_*.log); the names of what compiled are in the failure."""
    from asympd.serve.stall_watch import CompileWatch

    m = load_model(tiny_ckpt, model, device="cuda", dtype=torch.bfloat16)
    watch = CompileWatch()
    try:
        eng = LLMEngine(m, EngineConfig(role=role, mode=mode, scheduler=SchedulerConfig(max_num_batched_tokens=512)))
        # what it ran (whether it compiled anything depends on what this process compiled before)
        assert eng.warm_up_report is not None and eng.warm_up_report.rows == tuple(warm_up_rows(512))
        mark = watch.mark()
        for batch, seed in (([37, 250, 61], 11), ([300, 151], 12), ([500], 13), ([23, 29, 31, 100, 47], 14)):
            for i, ids in enumerate(random_prompts(batch, seed=seed)):
                eng.add_request(f"{seed}-{i}", ids, GREEDY)
            outs = drain(eng)
            for k in outs:
                eng.release_transfer(k)
        assert watch.since(mark) == {}
    finally:
        watch.close()


def test_the_serve_flags_leave_it_to_the_device_or_force_it():
    """``asympd serve``: no flag keeps the engine's default (on a CUDA device), ``--warm-up``
    forces it on (a CPU too), ``--no-warm-up`` off."""
    import argparse

    from asympd.serve.config import add_serve_arguments, serve_config_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    flags = ([], ["--warm-up"], ["--no-warm-up"])
    got = [serve_config_from_args(p.parse_args(["--checkpoint", "c", *a])).engine.warm_up for a in flags]
    assert got == [None, True, False]
