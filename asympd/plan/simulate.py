"""Discrete-event runs of the engine's own ``Scheduler`` and ``BlockManager`` with modelled step times.

Nothing here reimplements scheduling: each step asks the real scheduler what to run (FCFS, decode
rows first, admission cap and token budget, blocks reserved at admission, preemption when blocks run
out), takes its duration from ``StepModel`` and advances the requests as the engine would. A
prefill-worker replica exports a request when its last P phase is done; a decode-worker replica
makes 1-4 tokens per decode step (speculative decoding, mean 2.8).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from asympd.config import ModelConfig
from asympd.engine import modes
from asympd.engine.request import Request, Status
from asympd.engine.sampling import SamplingParams
from asympd.engine.scheduler import Scheduler, SchedulerConfig
from asympd.kv.block_manager import BlockManager
from asympd.kv.spec import KVCacheSpec
from asympd.plan.steps import P_STEP_TOKENS, StepModel

ACCEPT = ((1, 0.10), (2, 0.25), (3, 0.40), (4, 0.25))  # tokens per decode step (docs/model.md §6), mean 2.8
ACCEPT_TOKENS = [n for n, _ in ACCEPT]
ACCEPT_CUM = list(itertools.accumulate(w for _, w in ACCEPT))
NUM_SPEC = 3
BLOCK_SIZE = 256


@dataclass(frozen=True)
class Arrival:
    index: int
    time_s: float
    prompt_len: int
    output_len: int


@dataclass
class ReplicaRun:
    """What one replica did: per-request times (seconds) and what bounded it."""

    done_s: dict[int, float] = field(default_factory=dict)  # P: export time; D: finish time
    first_token_s: dict[int, float] = field(default_factory=dict)
    itl_s: list[float] = field(default_factory=list)
    itl_request: list[int] = field(default_factory=list)  # whose gap each itl_s entry is
    mean_itl_s: dict[int, float] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    steps: int = 0
    busy_s: float = 0.0
    max_batch: int = 0
    preemptions: int = 0


class _SimRequest(Request):
    """A request compared by identity, as the scheduler means it: the dataclass equality compares
    every field and dominates a long simulation."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def all_token_ids(self) -> range:  # only its length is read; the list copy dominated long prompts
        return range(len(self.prompt_token_ids) + len(self.output_token_ids))


def _scheduler(
    cfg: ModelConfig, sc: SchedulerConfig, num_blocks: int, arrivals: list[Arrival], num_spec: int = NUM_SPEC
) -> Scheduler:
    # blocks beyond what every request at once could hold never bind: leave them out (same result, faster)
    demand = sum(-(-(a.prompt_len + a.output_len + 1 + num_spec) // BLOCK_SIZE) for a in arrivals)
    num_blocks = min(num_blocks, demand + 1)
    spec = KVCacheSpec.from_config(cfg, block_size=BLOCK_SIZE, spec_slack=num_spec)
    blocks = BlockManager(spec, num_blocks=num_blocks, max_seqs=sc.max_num_seqs, enable_prefix_caching=False)
    return Scheduler(sc, blocks)


def run_prefill(
    cfg: ModelConfig,
    steps: StepModel,
    mode: str,
    gpus: int,
    num_blocks: int,
    arrivals: list[Arrival],
    max_num_seqs: int = 64,
    step_tokens: int = P_STEP_TOKENS,
) -> ReplicaRun:
    """One P replica: prompts packed up to the step budget (16K tokens, as measured), exported when done."""
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=step_tokens)
    sched = _scheduler(cfg, sc, num_blocks, arrivals)
    run = ReplicaRun()
    pending = sorted(arrivals, key=lambda a: (a.time_s, a.index))
    lengths: dict[str, int] = {}
    t, i = 0.0, 0
    while i < len(pending) or sched.has_work:
        while i < len(pending) and pending[i].time_s <= t:
            a = pending[i]
            i += 1
            if modes.skips_prefill(mode, a.prompt_len, cfg.window_size):
                run.done_s[a.index] = a.time_s  # N <= W: P has nothing to compute
                continue
            plan = modes.prefill_plan(cfg, a.prompt_len, mode)
            req = _SimRequest(
                str(a.index),
                [0] * a.prompt_len,
                SamplingParams(max_tokens=1),
                plan.phases,
                sample_after_prompt=False,
                arrival_time=a.time_s,
            )
            lengths[req.request_id] = a.prompt_len
            sched.add(req)
        if not sched.has_work:
            if i >= len(pending):
                break
            t = pending[i].time_s
            continue
        out = sched.schedule()
        for req, why in out.failed:
            run.failed[int(req.request_id)] = why
        if not out.chunks:
            if sched.has_work and i >= len(pending):
                raise RuntimeError("prefill scheduler made no progress")  # cannot happen: blocks are freed
            t = pending[i].time_s if i < len(pending) else t
            continue
        dt = steps.prefill_ms(mode, [(c.num_rows, lengths[c.request.request_id]) for c in out.chunks], gpus) / 1e3
        t += dt
        run.steps += 1
        run.busy_s += dt
        run.max_batch = max(run.max_batch, len(out.chunks))
        run.preemptions += len(out.preempted)
        for c in out.chunks:
            req = c.request
            req.cursor = c.hi
            if req.cursor == c.phase.hi:
                req.phase_index += 1
            if not req.in_prompt:
                run.done_s[int(req.request_id)] = t
                req.status = Status.FINISHED_EXPORTED
                sched.remove(req)
    return run


def run_decode(
    cfg: ModelConfig,
    steps: StepModel,
    mode: str,
    gpus: int,
    num_blocks: int,
    arrivals: list[Arrival],
    max_num_seqs: int,
    max_new_admissions: int | None,
    admission_token_budget: int | None,
    seed: int,
    *,
    num_spec: int = NUM_SPEC,
    max_num_batched_tokens: int | None = None,
    colocated_semantics: str = "full",
) -> ReplicaRun:
    """One D replica: requests arrive with their prefix at ``time_s``; D admits them under the
    policy, runs their bounded prefill (asymmetric: the first token) and decodes ``output_len``.

    ``num_spec`` 0 is a worker without speculative decoding (one token per step); mode
    ``colocated`` is a colocated worker computing whole prompts (``colocated_semantics``)."""
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens
        or max(max_num_seqs * (1 + num_spec), 2048) + (admission_token_budget or 2048),
        max_new_admissions=max_new_admissions,
        admission_token_budget=admission_token_budget,
        num_spec_tokens=num_spec,
    )
    sched = _scheduler(cfg, sc, num_blocks, arrivals, num_spec)
    rng = random.Random(seed)
    run = ReplicaRun()
    pending = sorted(arrivals, key=lambda a: (a.time_s, a.index))
    info: dict[str, Arrival] = {}
    last: dict[str, float] = {}
    gaps: dict[str, list[float]] = {}
    t, i = 0.0, 0
    while i < len(pending) or sched.has_work:
        while i < len(pending) and pending[i].time_s <= t:
            a = pending[i]
            i += 1
            if mode == "colocated":
                plan = modes.DecodePlan(0, modes.colocated_phases(cfg, a.prompt_len, colocated_semantics), False)
            else:
                plan = modes.decode_plan(cfg, a.prompt_len, mode)
            rid = str(a.index)
            req = _SimRequest(
                rid, [0] * a.prompt_len, SamplingParams(max_tokens=a.output_len), plan.phases, arrival_time=a.time_s
            )
            req.spec_enabled = num_spec > 0
            req.spec_draft = [0] * num_spec
            if plan.first_token_from_prefill:  # the first token came from P with the prefix
                req.output_token_ids.append(0)
                run.first_token_s[a.index] = a.time_s
                last[rid] = a.time_s
            info[rid] = a
            gaps[rid] = []
            sched.add(req)
        if not sched.has_work:
            if i >= len(pending):
                break
            t = pending[i].time_s
            continue
        out = sched.schedule()
        for req, why in out.failed:
            run.failed[int(req.request_id)] = why
        run.preemptions += len(out.preempted)
        dec = [c for c in out.chunks if c.phase is None]
        rows = sum(c.num_rows for c in out.chunks if c.phase is not None)
        if not out.chunks:
            if any(r.status is Status.RUNNING and not r.in_prompt for r in sched.running):
                continue  # admitted with nothing to compute (symmetric-windows): decodes next step
            t = pending[i].time_s if i < len(pending) else t
            if i >= len(pending) and sched.has_work:
                raise RuntimeError("decode scheduler made no progress")
            continue
        dt = steps.decode_ms(len(dec), rows, gpus) / 1e3
        t += dt
        run.steps += 1
        run.busy_s += dt
        run.max_batch = max(run.max_batch, len(dec))
        for c in out.chunks:
            req = c.request
            if req.status is not Status.RUNNING:
                continue
            rid = req.request_id
            a = info[rid]
            if c.phase is not None:
                req.cursor = c.hi
                if req.cursor == c.phase.hi:
                    req.phase_index += 1
                    if not req.in_prompt and c.phase.sample and len(req.output_token_ids) == 0:
                        req.output_token_ids.append(0)
                        run.first_token_s[a.index] = t
                        last[rid] = t
                continue
            k = rng.choices(ACCEPT_TOKENS, cum_weights=ACCEPT_CUM)[0] if num_spec else 1
            k = min(k, a.output_len - len(req.output_token_ids))
            req.output_token_ids.extend([0] * k)
            gaps[rid].append(t - last[rid])
            run.itl_s.append(t - last[rid])
            run.itl_request.append(a.index)
            last[rid] = t
            if len(req.output_token_ids) >= a.output_len:
                req.status = Status.FINISHED_LENGTH
                sched.remove(req)
                run.done_s[a.index] = t
                g = gaps[rid]
                run.mean_itl_s[a.index] = sum(g) / len(g) if g else 0.0
    return run
