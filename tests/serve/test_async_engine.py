"""The server's engine thread outlives a bug anywhere on it: in a command it runs for a handler
(an abort, a release) or in the bookkeeping after a step, as it already did in a step. Before, either
ended the thread and every later request was refused (docs/notes.md, thirty-second session)."""

from __future__ import annotations

import asyncio
import logging

from asympd.engine.llm import LLM
from asympd.engine.sampling import SamplingParams
from asympd.serve import async_engine
from asympd.serve.async_engine import AsyncEngine, Failed

PROMPT = [5, 6, 7, 8, 9]
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _once(fn, error: Exception):
    """``fn`` that raises ``error`` on its first call only."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return fn(*args, **kwargs)

    return wrapped


def within(awaitable, seconds: float = 30.0):
    """Fail, never hang, should the engine thread be gone."""
    return asyncio.wait_for(awaitable, seconds)


def test_a_failing_abort_or_release_keeps_the_engine_serving(tiny_ckpt, monkeypatch, caplog):
    llm = LLM(tiny_ckpt, dtype="float32")
    engine = llm.engine
    want = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].outputs[0].token_ids
    monkeypatch.setattr(engine, "abort_request", _once(engine.abort_request, RuntimeError("abort bug")))
    monkeypatch.setattr(engine, "release_transfer", _once(engine.release_transfer, KeyError("release bug")))
    aengine = AsyncEngine(engine)

    async def serve() -> tuple:
        aengine.start()
        try:
            slow = await within(aengine.add("a", PROMPT, SamplingParams(max_tokens=4000, ignore_eos=True)))
            aengine.abort("a")  # the engine's abort raises: the stream is failed, the thread lives
            aborted = await within(slow.result())
            aengine.release_transfer("nothing")  # raises too
            done = await within((await within(aengine.add("b", PROMPT, PARAMS))).result())
            aengine.abort("a")  # the second call works: a's blocks come back
            stats = await within(aengine.stats())
            return aborted, done, stats, aengine.alive
        finally:
            aengine.stop()

    with caplog.at_level(logging.ERROR, logger=async_engine.__name__):
        aborted, done, stats, alive = asyncio.run(serve())
    assert isinstance(aborted, Failed) and aborted.message == "abort failed: RuntimeError: abort bug"
    assert done.outputs[0].token_ids == want and alive
    assert "engine command 'abort' failed" in caplog.text and "engine command 'release' failed" in caplog.text
    assert engine.blocks.num_used_blocks == 0 and not engine.has_unfinished_requests(), stats


def test_a_failing_step_bookkeeping_still_delivers_the_steps_outputs(tiny_ckpt, caplog):
    llm = LLM(tiny_ckpt, dtype="float32")
    want = llm.generate(prompt_token_ids=[PROMPT], sampling_params=PARAMS)[0].outputs[0].token_ids
    aengine = AsyncEngine(llm.engine)

    async def serve() -> list:
        aengine.start()
        try:
            await aengine.stats()  # the thread has made its busy clock
            aengine.busy.step_done = _once(aengine.busy.step_done, ZeroDivisionError("clock bug"))
            first = await within((await within(aengine.add("a", PROMPT, PARAMS))).result())
            second = await within((await within(aengine.add("b", PROMPT, PARAMS))).result())
            return [first.outputs[0].token_ids, second.outputs[0].token_ids, aengine.alive]
        finally:
            aengine.stop()

    with caplog.at_level(logging.ERROR, logger=async_engine.__name__):
        got = asyncio.run(serve())
    assert got == [want, want, True]
    assert "bookkeeping after an engine step failed" in caplog.text
