"""The slow-step diagnostics: Triton compiles counted by name, and the log line a stall leaves."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import pytest

from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.serve import async_engine
from asympd.serve.stall_watch import CompileWatch, GCWatch, freeze_start_up_objects

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.runtime.jit import JitFunctionInfo  # noqa: E402


def _compiled(name: str) -> None:
    """What Triton's JIT does after compiling ``name`` (runtime/jit.py ``_call_hook``)."""
    hook = knobs.runtime.jit_post_compile_hook
    hook(
        key=None,
        repr=f"{name}[num_warps=4](x: *fp32)",
        fn=JitFunctionInfo("asympd.model.some_kernels", name, None),
        compile={},
        is_manual_warmup=False,
        already_compiled=False,
    )


def test_compile_watch_names_the_kernels_compiled_since_a_mark_and_chains_the_hook():
    seen = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        watch = CompileWatch()
        _compiled("_moe_kernel")
        mark = watch.mark()
        _compiled("_moe_kernel")
        _compiled("_indexer_kernel")
        _compiled("_moe_kernel")
        assert watch.since(mark) == {"_moe_kernel": 2, "_indexer_kernel": 1}
        assert watch.since(watch.mark()) == {} and watch.total == 4
        assert seen == ["_moe_kernel", "_moe_kernel", "_indexer_kernel", "_moe_kernel"]  # chained
        watch.close()
        _compiled("_after")
        assert watch.total == 4 and seen[-1] == "_after"  # the previous hook is back
    finally:
        knobs.runtime.jit_post_compile_hook = before


def _serve_one(llm: LLM, max_tokens: int) -> None:
    """One 5-token prompt through the server's engine thread (``AsyncEngine``), to its end."""
    aengine = async_engine.AsyncEngine(llm.engine)

    async def one_request() -> None:
        aengine.start()
        try:
            stream = await aengine.add("r0", [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens))
            await stream.result()
        finally:
            aengine.stop()

    asyncio.run(one_request())


def test_a_slow_step_is_logged_with_its_prompt_rows_and_compiles(tiny_ckpt, monkeypatch, caplog):
    monkeypatch.setattr(async_engine, "SLOW_S", -1.0)  # every step counts as slow
    llm = LLM(tiny_ckpt, dtype="float32")
    with caplog.at_level(logging.WARNING, logger=async_engine.__name__):
        _serve_one(llm, max_tokens=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow engine step")]
    assert lines, caplog.text
    assert "5 prompt rows, 1 requests" in lines[0] and "garbage collection in the step: " in lines[0]
    assert lines[0].endswith("Triton compiles in the step: none")


def test_a_quick_step_that_compiled_is_logged_too(tiny_ckpt, monkeypatch, caplog):
    """A compile or capture under a second (D's 0.5-0.9 s stalls in oos9) is still a shape serving
    should have met at start-up: its step leaves a line; a step that compiled nothing does not."""
    llm = LLM(tiny_ckpt, dtype="float32")
    step = llm.engine.step
    calls = []

    def compiling_step():
        calls.append(1)
        if len(calls) == 1:
            _compiled("_first_shape_kernel")
        return step()

    monkeypatch.setattr(llm.engine, "step", compiling_step)
    with caplog.at_level(logging.WARNING, logger=async_engine.__name__):
        _serve_one(llm, max_tokens=3)
    lines = [r.getMessage() for r in caplog.records if "engine step" in r.getMessage()]
    assert len(calls) >= 2 and len(lines) == 1, caplog.text
    assert lines[0].startswith("engine step met a new shape: ") and "5 prompt rows" in lines[0]
    assert lines[0].endswith("Triton compiles in the step: {'_first_shape_kernel': 1}")


def test_the_steps_that_met_a_new_shape_are_counted_in_the_stats(tiny_ckpt, monkeypatch):
    """``AsyncEngine.stats()["new_shapes"]`` (``/asympd/stats``; ``/metrics``:
    ``asympd_engine_steps_new_shape_total``): the serving steps that compiled, by kernel; a
    compile between steps (a command's) is no step's."""
    llm = LLM(tiny_ckpt, dtype="float32")
    step = llm.engine.step
    calls = []

    def compiling_step():
        calls.append(1)
        if len(calls) in (1, 3):
            _compiled("_first_shape_kernel")
            _compiled("_other_kernel")
        return step()

    monkeypatch.setattr(llm.engine, "step", compiling_step)
    aengine = async_engine.AsyncEngine(llm.engine)

    async def serve() -> dict:
        aengine.start()
        try:
            stream = await aengine.add("r0", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
            await stream.result()
            _compiled("_between_steps")
            return (await aengine.stats())["new_shapes"]
        finally:
            aengine.stop()

    got = asyncio.run(serve())
    assert len(calls) >= 3
    assert got == {"steps": 2, "graphs": 0, "compiles": {"_first_shape_kernel": 2, "_other_kernel": 2}}


def test_the_step_log_has_each_step_s_rows_by_wall_clock(tiny_ckpt):
    """``steps_since``: one entry per step that ran rows, [wall start, seconds, prompt rows, decode
    sequences, seconds to the GPU end]: the 5-row prompt's step, then one decoding sequence per step (bench/e2e.py's
    co-run lines up two processes' steps by these)."""
    llm = LLM(tiny_ckpt, dtype="float32")
    aengine = async_engine.AsyncEngine(llm.engine)

    async def one_request() -> float:
        aengine.start()
        try:
            t0 = time.time()
            stream = await aengine.add("r0", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3))
            await stream.result()
            return t0
        finally:
            aengine.stop()

    t0 = asyncio.run(one_request())
    steps = aengine.steps_since(t0)
    assert [(s[2], s[3]) for s in steps][:2] == [(5, 0), (0, 1)]
    assert all((s[2], s[3]) == (0, 1) for s in steps[1:]) and 2 <= len(steps) <= 3
    # and each step's seconds to its GPU end (asympd/serve/busy.py): on a CPU, the host's
    assert all(len(s) == 5 and s[4] == pytest.approx(s[1], abs=1e-9) for s in steps)
    assert all(s[1] > 0 for s in steps) and [s[0] for s in steps] == sorted(s[0] for s in steps)
    assert aengine.steps_since(steps[-1][0] + 1e-3) == []


def test_gc_watch_times_collections_since_a_mark_and_freezing_empties_the_oldest_generation():
    watch = GCWatch()
    try:
        mark = watch.mark()
        gc.collect()
        gc.collect(0)
        got = watch.since(mark)
        assert got["all"] == 2 and got["gen2"] == 1 and got["ms"] > 0
        assert watch.since(watch.mark()) == {"ms": 0.0, "gen2": 0, "all": 0}
    finally:
        watch.close()
    assert watch._callback not in gc.callbacks
    try:
        assert freeze_start_up_objects() == gc.get_freeze_count() > 0
        assert gc.get_count()[2] == 0 and len(gc.get_objects(2)) == 0  # nothing left for a full pass to walk
    finally:
        gc.unfreeze()
