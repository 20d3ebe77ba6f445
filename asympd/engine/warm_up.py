"""Start-up warm-up of the eager prompt path: one throwaway prompt per shape class before serving.

D's decode and verify steps replay CUDA graphs built at start-up (``cuda_graphs.capture_at_startup``),
so serving never compiles them. Prompt steps run eagerly, and their Triton kernels take a new
variant, which means a compile, the first time a step's row count meets one:

- a new expert block size (``packed.moe_block_m``: at V4.1's 384 experts and 6 per token, prompt
  steps of 1024, 2048 and 4096 rows are the edges);
- a new split of K for the expert GEMMs (a few rows a step);
- an integer argument that newly does or does not divide by 16 (Triton specialises on it).

A constexpr that follows the rows more finely than that cannot be warmed this way: ``hc_project``'s
split count was one (a compile in the first step of 1107, 1706, 1792 and 3001 rows after this
warm-up, bench/results/first_steps.json) and is an argument now; ``bench/first_steps.py`` checks a
warmed-up P engine for any such step, and ``/metrics`` counts them in serving
(``asympd_engine_steps_new_shape_total``).

At true depth each such compile stalled a step 0.7-1.4 s mid-traffic, and a stalled step costs the
ITL SLO of every request decoding through it (docs/planner.md, "oos9"). So the engine runs one
prompt at each power of two up to its step budget, one at one row more, and one at the budget,
before it takes a request. vLLM does the same with its profile and compile-size runs. The prompts
are ordinary requests through the engine's own ``add_request`` and ``step``, with nothing cached
(no import, so no prefix-cache entry). Each is aborted, or released once exported, as soon as its
prompt is done, and the counters are put back, so that the metrics count served work only.
A prompt of a CUDA graph's shape (1 + k rows or fewer, or W on a D) takes a graph of one request,
captured here rather than by the first served step of that shape; with piecewise graphs for
prompt steps (``cuda_graph_mode`` full_and_piecewise) a prompt of each piece size's rows captures
that size's pieces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from asympd.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from asympd.engine.engine import LLMEngine

log = logging.getLogger("asympd.engine")

WARM_UP_ID = "__asympd_warm_up_"


@dataclass(frozen=True)
class WarmUp:
    """What ``warm_up`` ran: the prompt rows of each throwaway prompt, and the seconds it took;
    the piecewise graphs' pieces it built (a P's prompt steps: each size's, captured on CUDA) and
    the device memory the allocator reserved meanwhile (their pool and buffers, the steps'
    workspaces; None off CUDA), so that the start-up log says what the warm-up cost."""

    rows: tuple[int, ...]
    seconds: float
    pieces: int = 0
    reserved_bytes: int | None = None

    def line(self) -> str:
        sizes = f"{self.rows[0]}-{self.rows[-1]}" if self.rows else "none"
        text = f"warm-up: {len(self.rows)} prompts of {sizes} prompt rows in {self.seconds:.1f} s"
        if self.pieces:
            text += f", {self.pieces} piecewise graph pieces built"
        if self.reserved_bytes is not None:
            text += f", {self.reserved_bytes / 2**20:.0f} MiB more reserved on the device"
        return text


def warm_up_rows(budget: int, pieces: Sequence[int] = ()) -> list[int]:
    """The prompt rows to warm: every power of two up to ``budget``, each one row more (an odd
    count: the other side of Triton's divisibility specialisation), ``budget`` itself, and each
    piecewise graph size up to it (``pieces``: a step of that many rows captures that size's
    pieces here, not mid-traffic)."""
    if budget < 1:
        raise ValueError(f"the step budget must be positive, got {budget}")
    powers = [1 << i for i in range(budget.bit_length()) if 1 << i <= budget]
    return sorted({*powers, *(p + 1 for p in powers if p + 1 <= budget), budget, *(r for r in pieces if r <= budget)})


def warm_up_ids(n: int, rows: int, vocab: int) -> list[int]:
    """A throwaway prompt of ``n`` tokens, spread over the vocabulary (and so over the experts) as
    text is, different for each size."""
    return [(7919 * i + rows) % vocab for i in range(n)]


def prompt_len(rows: int, window: int, rows_of: Callable[[int], int | None]) -> int | None:
    """A prompt length for which ``rows_of`` (prompt length -> rows computed, None where refused)
    gives ``rows``, or None where none does. Every role and mode computes either all of a prompt's
    rows or all but its last W (asymmetric P), so the length is ``rows`` or ``rows + W``."""
    return next((n for n in (rows, rows + window) if rows_of(n) == rows), None)


def _rows_of(engine: LLMEngine, n: int) -> int | None:
    try:
        req = engine._plan_request(WARM_UP_ID, [0] * n, SamplingParams(max_tokens=1), None, None)
    except ValueError:
        return None
    return sum(p.hi - p.lo for p in req.phases)


def warm_up(engine: LLMEngine) -> WarmUp:
    """Run ``warm_up_rows`` prompts through ``engine`` (idle, before serving). Sizes the cache or
    the context cannot hold are skipped. Returns what ran."""
    if engine.requests or engine.held:
        raise RuntimeError("warm-up runs on an idle engine, before it serves")
    t0 = time.perf_counter()
    device = engine.cache.device
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else None
    counters = dict(engine.counters)
    graphs = getattr(engine.runner, "graphs", None)
    piecewise = getattr(graphs, "piecewise", None)
    pieces_before = len(piecewise.pieces) if piecewise is not None else 0
    counts = getattr(graphs, "counts", None)  # DecodeGraphs' step counts (PrefillPieces counts no steps)
    graph_steps = {k: counts[k] for k in ("replayed", "first", "eager")} if counts is not None else {}
    done: list[int] = []
    vocab = engine.cfg.vocab_size
    pieces = piecewise.sizes if piecewise is not None else ()
    for rows in warm_up_rows(engine.config.scheduler.max_num_batched_tokens, pieces):
        n = prompt_len(rows, engine.cfg.window_size, lambda n: _rows_of(engine, n))
        if n is None:
            continue
        rid = f"{WARM_UP_ID}{rows}"
        ids = warm_up_ids(n, rows, vocab)
        try:
            engine.add_request(rid, ids, SamplingParams(max_tokens=1, ignore_eos=True))
        except ValueError as e:  # larger than the cache or the context: nothing to warm at this size
            log.debug("warm-up skips %d rows: %s", rows, e)
            continue
        for _ in range(n + 8):  # every step computes a row of it at least: this never runs out
            if rid not in engine.requests or not engine.requests[rid].in_prompt:
                break
            engine.step()
        else:
            raise RuntimeError(f"warm-up: the {rows}-row prompt made no progress in {n + 8} steps")
        engine.abort_request(rid)  # a colocated or D prompt: done, or one token in
        engine.release_transfer(rid)  # a P prompt: exported and held
        done.append(rows)
    for req in list(engine.draining.values()):  # exports still copying out of the blocks
        for e in req.exports:
            e.wait()
        engine._free(req)
    engine.counters.update(counters)
    if counts is not None:  # the steps ran eagerly: not served steps either (graphs built stay counted)
        counts.update(graph_steps)
    grown = None
    if reserved is not None:
        torch.cuda.synchronize(device)
        grown = torch.cuda.memory_reserved(device) - reserved
    built = len(piecewise.pieces) - pieces_before if piecewise is not None else 0
    report = WarmUp(tuple(done), time.perf_counter() - t0, built, grown)
    log.info(report.line())
    return report
