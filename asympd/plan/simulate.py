"""Discrete-event runs of the engine's own ``Scheduler`` and ``BlockManager`` with modelled step times.

Nothing here reimplements scheduling: each step asks the real scheduler what to run (FCFS, decode
rows first, admission cap and token budget, blocks reserved at admission, preemption when blocks run
out), takes its duration from ``StepModel`` and advances the requests as the engine would. A
prefill-worker replica exports a request when its last P phase is done; a decode-worker replica
makes 1-4 tokens per decode step (speculative decoding, mean 2.8). Each replica is an engine that
issues its next step when the previous one ends; ``run_engines`` runs each GPU as a processor
shared by the steps in progress on it: engines placed on the same GPU (P and D sharing it) run their
steps side by side, each at an equal share of the GPU (the processes' kernels interleave, as the
GPU's time-slicing between contexts does), instead of one waiting for the other.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from asympd.config import ModelConfig
from asympd.engine import modes
from asympd.engine.request import Request, Status
from asympd.engine.sampling_params import SamplingParams
from asympd.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from asympd.kv.block_manager import BlockManager
from asympd.kv.spec import KVCacheSpec
from asympd.model.depth import Depth
from asympd.plan.steps import P_STEP_TOKENS, StepModel
from asympd.serve.admission import AdmissionPolicy

ACCEPT = ((1, 0.10), (2, 0.25), (3, 0.40), (4, 0.25))  # tokens per decode step (docs/model.md §6), mean 2.8
ACCEPT_TOKENS = [n for n, _ in ACCEPT]
ACCEPT_CUM = list(itertools.accumulate(w for _, w in ACCEPT))
NUM_SPEC = 3
BLOCK_SIZE = 256
_RUNNING = Status.RUNNING  # read per request per step: ``Status.RUNNING`` goes through ``EnumType.__getattr__``


@dataclass(frozen=True)
class Arrival:
    index: int
    time_s: float
    prompt_len: int
    output_len: int


@dataclass
class SideTask:
    """Work an engine's process does for a request between its steps, on its own GPU stream: the
    prefill worker's hand-off (sealing the prefix, packing it for D's fetch) runs kernels and
    synchronises on the stream its steps run on, so it progresses only while that engine has no
    step in progress, and the engine's side tasks share that one stream: k of them in progress
    each advance at 1/k (several requests' hand-offs serialise on P's stream; the calibration
    batch's seven hand-offs after P's step take what seven lone ones in a row take). ``left``:
    seconds of work left (alone on the stream); ``done(t)`` runs when it is over."""

    left: float
    done: Callable[[float], None]


@dataclass
class ReplicaRun:
    """What one replica did: per-request times (seconds) and what bounded it."""

    done_s: dict[int, float] = field(default_factory=dict)  # P: export time; D: finish time
    scheduled_s: dict[int, float] = field(default_factory=dict)  # P: its first step's issue (the queue's end)
    step_log: list[tuple[float, float, int]] = field(default_factory=list)  # P: (issue, end, rows) a step
    first_token_s: dict[int, float] = field(default_factory=dict)
    itl_s: list[float] = field(default_factory=list)
    itl_request: list[int] = field(default_factory=list)  # whose gap each itl_s entry is
    mean_itl_s: dict[int, float] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    steps: int = 0
    busy_s: float = 0.0  # its steps' own durations
    wall_s: float = 0.0  # issue to end of each step: with a shared GPU, the wait for it too
    max_batch: int = 0
    preemptions: int = 0
    step_kinds: list[str] = field(default_factory=list)  # D: "decode", "prompt" or "mixed", per step


@dataclass(frozen=True)
class PrefillSetup:
    """A P replica: its mode, GPUs (= EP degree), KV blocks and step limits."""

    mode: str
    gpus: int = 1
    num_blocks: int = 1 << 24
    max_num_seqs: int = 64
    step_tokens: int = P_STEP_TOKENS  # the prefill token budget the P measurements used
    # its deepest waiting phase alone (``SchedulerConfig.one_depth_per_step``), at most
    # ``max_deepest_chunks`` of it a step; None: as today's engine runs this mode's P (a symmetric P's
    # window steps on one GPU: ``modes.p_window_phase``, ``modes.p_window_batch``; under EP, mixed)
    one_depth_per_step: bool | None = None
    max_deepest_chunks: int | None = None


@dataclass(frozen=True)
class DecodeSetup:
    """A D (or colocated) replica: mode, GPUs, KV blocks, scheduler limits and admission policy.

    ``num_spec`` 0 is a worker without speculative decoding (one token per step); mode
    ``colocated`` computes whole prompts (``colocated_semantics``); ``first_token_with_first_step``:
    P's first token reaches the client with D's first output for the request (the server's
    behaviour), not when the prefix arrives."""

    mode: str
    gpus: int = 1
    num_blocks: int = 1 << 24
    max_num_seqs: int = 64
    policy: AdmissionPolicy = AdmissionPolicy(None, None)
    seed: int = 0
    num_spec: int = NUM_SPEC
    max_num_batched_tokens: int | None = None  # None: room for a full decode step plus the admissions
    colocated_semantics: str = "full"
    first_token_with_first_step: bool = False
    outputs_at_launch: bool = False  # a GPU engine: a step that samples nothing answers at its launch

    def scheduler_config(self) -> SchedulerConfig:
        """The engine's own scheduler settings for this replica (the policy's caps and step mixing)."""
        p = self.policy
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens
            or max(self.max_num_seqs * (1 + self.num_spec), 2048) + (p.admission_token_budget or 2048),
            max_new_admissions=p.max_new_admissions,
            admission_token_budget=p.admission_token_budget,
            num_spec_tokens=self.num_spec,
            mixed_steps=p.mixed_steps,
        )


class _SimRequest(Request):
    """A request as the simulator makes it: only lengths of its token lists are read."""

    @property
    def all_token_ids(self) -> range:  # only its length is read; the list copy dominated long prompts
        return range(len(self.prompt_token_ids) + len(self.output_token_ids))


class _DecodeRequest(_SimRequest):
    """A D replica's request, carrying what the simulator records of it (attributes, not dictionaries
    by request id, on the per-token path). Set by ``DecodeEngine.add``."""

    arrival: Arrival
    last_out: float | None = None  # when its last output reached the client (None: none yet)
    gaps: list[float]  # between its outputs, in order


def accepted_tokens(rng: random.Random, batch: int = 1024) -> Iterator[int]:
    """Tokens per decode step (``ACCEPT``), drawn from ``rng`` ``batch`` at a time: ``choices`` with
    ``k`` draws reads the generator as ``k`` calls of one draw do, so the sequence is the same."""
    while True:
        yield from rng.choices(ACCEPT_TOKENS, cum_weights=ACCEPT_CUM, k=batch)


def _prompt(n: int) -> bytes:
    """A prompt of ``n`` tokens for a simulated request: only its length is read (the scheduler counts
    positions; prefix caching, which would hash the ids, is off), so ``n`` zero bytes rather than a
    list of ``n`` ints (0.5 MB to build and free for a 64K-token prompt)."""
    return bytes(n)


def _scheduler(
    cfg: ModelConfig, sc: SchedulerConfig, num_blocks: int, arrivals: list[Arrival], num_spec: int = NUM_SPEC
) -> Scheduler:
    # blocks beyond what every request at once could hold never bind: leave them out (same result, faster)
    demand = sum(-(-(a.prompt_len + a.output_len + 1 + num_spec) // BLOCK_SIZE) for a in arrivals)
    num_blocks = min(num_blocks, demand + 1)
    spec = KVCacheSpec.from_config(cfg, block_size=BLOCK_SIZE, spec_slack=num_spec)
    blocks = BlockManager(spec, num_blocks=num_blocks, max_seqs=sc.max_num_seqs, enable_prefix_caching=False)
    return Scheduler(sc, blocks)


class _Engine:
    """One engine replica as the simulator drives it: it issues its next step when the previous one
    ends (or, idle, when a request arrives); the driver decides how fast the step runs on its GPU.

    ``issue`` asks the real scheduler for the step at the issue time and returns its duration alone
    on the GPU (None when nothing ran); ``finish`` applies the step at its end time. ``exports``
    collects (request index, time) of requests handed on (P: the prefix is ready)."""

    def __init__(self, sched: Scheduler, arrivals: list[Arrival]):
        self.sched = sched
        self.run = ReplicaRun()
        self.exports: list[tuple[int, float]] = []
        self.t = 0.0
        self._pending = [(a.time_s, a.index, a) for a in arrivals]
        heapq.heapify(self._pending)
        self._stalled = False  # the scheduler had work but ran nothing: wait for an arrival
        self._dt = 0.0
        self._chunks: list[ScheduledChunk] = []  # the step in progress (or the last one)
        self.side: list[SideTask] = []  # progress only while no step of this engine is in progress
        # of the step last issued, the seconds the host spends launching it before its GPU work,
        # which neither takes nor slows the GPU (``run_engines``; 0: all of it is GPU work)
        self.host_s = 0.0

    def hold(self, task: SideTask) -> None:
        """Queue work that needs this engine's stream between its steps (``SideTask``)."""
        self.side.append(task)

    def push(self, a: Arrival) -> None:
        heapq.heappush(self._pending, (a.time_s, a.index, a))

    def next_issue(self) -> float | None:
        if self.sched.has_work and not self._stalled:
            return self.t
        if self._pending:
            return max(self.t, self._pending[0][0])
        return None

    @property
    def has_work(self) -> bool:
        return self.sched.has_work or bool(self._pending) or bool(self.side)

    @property
    def step_rows(self) -> int:
        """Rows of the step last issued (0 before the first)."""
        return sum(c.num_rows for c in self._chunks)

    def _admit_until(self, t: float) -> None:
        while self._pending and self._pending[0][0] <= t:
            self._stalled = False
            self.add(heapq.heappop(self._pending)[2])

    def add(self, a: Arrival) -> None:
        raise NotImplementedError

    def issue(self, at: float) -> float | None:
        raise NotImplementedError

    def finish(self, end: float) -> None:
        raise NotImplementedError


class PrefillEngine(_Engine):
    """One P replica: prompts packed up to the step budget (16K tokens, as measured), exported when done."""

    def __init__(self, cfg: ModelConfig, steps: StepModel, setup: PrefillSetup, arrivals: list[Arrival]):
        one_depth, cap = setup.one_depth_per_step, setup.max_deepest_chunks
        if one_depth is None:  # as the engine sets it: a P replaying its window graphs, so not under EP
            # (an --ep worker runs eagerly, with mixed steps: LLMEngine, SchedulerConfig.one_depth_per_step)
            cap = None
            if setup.gpus == 1:
                cap = modes.p_window_batch(cfg, setup.mode, setup.step_tokens, setup.max_num_seqs)
            one_depth = cap is not None
        sc = SchedulerConfig(
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.step_tokens,
            one_depth_per_step=one_depth,
            max_deepest_chunks=cap,
        )
        super().__init__(_scheduler(cfg, sc, setup.num_blocks, arrivals), arrivals)
        self.cfg, self.steps, self.mode, self.gpus = cfg, steps, setup.mode, setup.gpus
        self._lengths: dict[str, int] = {}
        self._issued = 0.0  # when the step last issued was issued

    def add(self, a: Arrival) -> None:
        if modes.skips_prefill(self.mode, a.prompt_len, self.cfg.window_size):
            self.run.done_s[a.index] = a.time_s  # N <= W: P has nothing to compute
            self.exports.append((a.index, a.time_s))
            return
        plan = modes.prefill_plan(self.cfg, a.prompt_len, self.mode)
        req = _SimRequest(
            str(a.index),
            _prompt(a.prompt_len),
            SamplingParams(max_tokens=1),
            plan.phases,
            sample_after_prompt=False,
            arrival_time=a.time_s,
        )
        self._lengths[req.request_id] = a.prompt_len
        self.sched.add(req)

    def issue(self, at: float) -> float | None:
        self.t = at
        self._admit_until(at)
        if not self.sched.has_work:
            return None
        out = self.sched.schedule()
        for req, why in out.failed:
            self.run.failed[int(req.request_id)] = why
        if not out.chunks:
            if self.sched.has_work and not self._pending:
                raise RuntimeError("prefill scheduler made no progress")  # cannot happen: blocks are freed
            self._stalled = True
            return None
        self._chunks = out.chunks
        self._issued = at
        for c in out.chunks:
            self.run.scheduled_s.setdefault(int(c.request.request_id), at)
        self.run.max_batch = max(self.run.max_batch, len(out.chunks))
        self.run.preemptions += len(out.preempted)
        chunks = [(c.num_rows, self._lengths[c.request.request_id]) for c in out.chunks]
        # a symmetric P's step of window chunks alone (one_depth_per_step): a CUDA graph on a GPU,
        # which a measured model may price apart from its prefix steps (``MeasuredSteps.p_window_ms``)
        deep = sum(c.phase.depth is Depth.ALL for c in out.chunks)
        windows = deep if deep == len(out.chunks) and self.sched.config.one_depth_per_step else 0
        self._dt = self.steps.prefill_ms(self.mode, chunks, self.gpus, windows=windows) / 1e3
        # a launch-bound eager step's host part (``MeasuredSteps.p_host_ms``; a window step is a graph)
        self.host_s = 0.0 if windows else min(getattr(self.steps, "p_host_ms", 0.0) / 1e3, self._dt)
        return self._dt

    def finish(self, end: float) -> None:
        self.t = end
        self.run.steps += 1
        self.run.busy_s += self._dt
        self.run.step_log.append((self._issued, end, self.step_rows))
        for c in self._chunks:
            req = c.request
            req.cursor = c.hi
            if req.cursor == c.phase.hi:
                req.phase_index += 1
            if not req.in_prompt:
                self.run.done_s[int(req.request_id)] = end
                self.exports.append((int(req.request_id), end))
                req.status = Status.FINISHED_EXPORTED
                self.sched.remove(req)


class DecodeEngine(_Engine):
    """One D replica: requests arrive with their prefix at ``time_s``; D admits them under the
    policy, runs their bounded prefill (asymmetric: the first token) and decodes ``output_len``.
    ``expected``: every request that will arrive (pushed later), for sizing the block pool."""

    def __init__(
        self,
        cfg: ModelConfig,
        steps: StepModel,
        setup: DecodeSetup,
        arrivals: list[Arrival],
        expected: list[Arrival] | None = None,
    ):
        sched = _scheduler(cfg, setup.scheduler_config(), setup.num_blocks, expected or arrivals, setup.num_spec)
        super().__init__(sched, arrivals)
        self.cfg, self.steps, self.mode, self.gpus = cfg, steps, setup.mode, setup.gpus
        self.num_spec, self.semantics = setup.num_spec, setup.colocated_semantics
        self._accepted = accepted_tokens(random.Random(setup.seed))
        self._late_first = setup.first_token_with_first_step
        self._at_launch = setup.outputs_at_launch
        self._unsent: dict[str, _DecodeRequest] = {}  # P's first token, held until D first outputs the request
        self._out_with_step: list[str] = []  # held first tokens that the step in progress outputs at its end

    def add(self, a: Arrival) -> None:
        if self.mode == "colocated":
            plan = modes.DecodePlan(0, modes.colocated_phases(self.cfg, a.prompt_len, self.semantics), False)
        else:
            plan = modes.decode_plan(self.cfg, a.prompt_len, self.mode)
        rid = str(a.index)
        req = _DecodeRequest(
            rid, _prompt(a.prompt_len), SamplingParams(max_tokens=a.output_len), plan.phases, arrival_time=a.time_s
        )
        req.arrival, req.gaps = a, []
        req.spec_enabled = self.num_spec > 0
        req.spec_draft = [0] * self.num_spec
        if plan.first_token_from_prefill:  # the first token came from P with the prefix
            req.output_token_ids.append(0)
            if self._late_first:
                self._unsent[rid] = req
            else:
                self._first_out(req, a.time_s)
        self.sched.add(req)

    def _first_out(self, req: _DecodeRequest, t: float) -> None:
        """The request's first token reaches the client at ``t``."""
        self.run.first_token_s[req.arrival.index] = t
        req.last_out = t

    def issue(self, at: float) -> float | None:
        self.t = at
        self._admit_until(at)
        if not self.sched.has_work:
            return None
        out = self.sched.schedule()
        for req, why in out.failed:
            self.run.failed[int(req.request_id)] = why
        self.run.preemptions += len(out.preempted)
        # admitted with nothing to compute (symmetric-windows): the engine outputs P's token from the
        # step that admits it, so it goes out when that step's outputs do (``_out_with_step``)
        bare = [rid for rid, req in self._unsent.items() if req.status is _RUNNING and not req.in_prompt]
        answers_now = not out.chunks or (
            self._at_launch and not any(c.phase is None or c.phase.sample for c in out.chunks)
        )
        for rid in bare:
            if answers_now:
                self._first_out(self._unsent.pop(rid), at)
        self._out_with_step = [] if answers_now else bare
        if not out.chunks:
            if any(r.status is _RUNNING and not r.in_prompt for r in self.sched.running):
                return None  # admitted with nothing to compute (symmetric-windows): decodes next step
            self._stalled = True
            return None
        dec = rows = 0  # decoding requests, prompt rows
        for c in out.chunks:
            if c.phase is None:
                dec += 1
            else:
                rows += c.num_rows
        if self._at_launch and not dec and not any(c.phase.sample for c in out.chunks):
            self._launched(out.chunks, at)
        self._chunks = out.chunks
        self.run.max_batch = max(self.run.max_batch, dec)
        self.run.step_kinds.append("mixed" if dec and rows else "decode" if dec else "prompt")
        self._dt = self.steps.decode_ms(dec, rows, self.gpus) / 1e3
        return self._dt

    def _launched(self, chunks: list, at: float) -> None:
        """A step that samples nothing (prompt rows only, none of them a sampling row: a symmetric
        D's replay) needs no result from the GPU, so the engine hands out its outputs when it has
        launched it, not when the GPU is done: P's held first token of a request whose prompt the
        step completes goes out at the step's start; the step's GPU time lands in its next gap."""
        for c in chunks:
            req = c.request
            last = req.phase_index == len(req.phases) - 1 and c.hi == c.phase.hi
            if last and self._unsent.pop(req.request_id, None) is not None:
                self._first_out(req, at)

    def finish(self, end: float) -> None:
        t, run = end, self.run
        self.t = end
        run.steps += 1
        run.busy_s += self._dt
        for rid in self._out_with_step:  # before the step's tokens: its own decode token follows at once
            if (held := self._unsent.pop(rid, None)) is not None:
                self._first_out(held, t)
        self._out_with_step = []
        for c in self._chunks:
            req = c.request
            if req.status is not _RUNNING:
                continue
            if self._unsent and self._unsent.pop(req.request_id, None) is not None:
                self._first_out(req, t)
            if c.phase is not None:
                req.cursor = c.hi
                if req.cursor == c.phase.hi:
                    req.phase_index += 1
                    if not req.in_prompt and c.phase.sample and len(req.output_token_ids) == 0:
                        req.output_token_ids.append(0)
                        self._first_out(req, t)
                continue
            a = req.arrival
            k = next(self._accepted) if self.num_spec else 1
            k = min(k, a.output_len - len(req.output_token_ids))
            req.output_token_ids.extend([0] * k)
            # a token that goes out with the held first one follows it at once: a gap of ~0 (the client sees two chunks)
            gap = t - req.last_out
            req.gaps.append(gap)
            run.itl_s.append(gap)
            run.itl_request.append(a.index)
            req.last_out = t
            if len(req.output_token_ids) >= a.output_len:
                req.status = Status.FINISHED_LENGTH
                self.sched.remove(req)
                run.done_s[a.index] = t
                run.mean_itl_s[a.index] = sum(req.gaps) / len(req.gaps) if req.gaps else 0.0


@dataclass
class _Step:
    """A step in progress: its engine, GPU, issue time and the work left, in seconds alone: ``host``
    of launching first (at full speed, off the GPU), then ``left`` of GPU work."""

    engine: int
    gpu: int
    issued: float
    left: float
    host: float = 0.0


def gpu_share(n: int) -> float:
    """The rate of each of ``n`` steps in progress on one GPU: equal shares. Without MPS a GPU
    time-slices the contexts of the processes that have work queued, so two processes' steps
    (P's and D's) each get about half of the GPU's time while both are in progress, and one alone
    gets all of it."""
    return 1.0 / max(n, 1)


def gpu_shares(steps: list[_Step], pair: dict[int, float] | None = None) -> dict[int, float]:
    """Each step's rate, by engine: ``gpu_share`` of the steps in progress on its GPU, or, for an
    engine in ``pair`` whose step shares its GPU with exactly one other step, ``pair[engine]``
    (the rate measured beside the other process: bench/e2e.py's co-run)."""
    count: dict[int, int] = {}
    for s in steps:
        count[s.gpu] = count.get(s.gpu, 0) + 1
    pair = pair or {}
    return {s.engine: pair.get(s.engine, 0.5) if count[s.gpu] == 2 else gpu_share(count[s.gpu]) for s in steps}


def run_engines(
    engines: list[_Engine],
    gpu_of: list[int],
    on_export: Callable[[int, int, float], None] | None = None,
    pair: dict[int, float | Callable[[int], float]] | None = None,
) -> None:
    """Drive engines to completion; engines with the same ``gpu_of`` share one GPU.

    A GPU is a processor shared by the steps in progress on it (``gpu_shares``): a step starts
    when its engine issues it and runs at its share of the GPU, which changes whenever a step on
    that GPU starts or ends; it ends when its work (its duration alone) is done. Engines on GPUs of
    their own never slow each other. Events run in time order (a step's end before an issue at the
    same time), which keeps every arrival an engine sees in time order. ``on_export(engine,
    request index, time)`` hands on what an engine exported. ``pair``: the measured rates of
    engines whose step shares a GPU with one other step (``gpu_shares``; default equal shares); a
    callable one is read at each step's issue with its prompt rows (P: ``Deployment.p_share_at``).
    A step's host part (``_Engine.host_s``) runs first at full speed and is not on the GPU: it
    neither takes a share nor slows the steps beside it."""
    now = 0.0
    active: dict[int, _Step] = {}
    pair = pair or {}
    beside: dict[int, float] = {k: v for k, v in pair.items() if not callable(v)}

    def drain(k: int) -> None:
        e = engines[k]
        while e.exports:
            i, t = e.exports.pop(0)
            if on_export is not None:
                on_export(k, i, t)

    while True:
        rate = gpu_shares([s for s in active.values() if s.host <= 0], beside)
        ending: tuple[float, int] | None = None
        for k, s in active.items():
            t = now + (s.host if s.host > 0 else s.left / rate[k])  # its host part's end, or its end
            if ending is None or t < ending[0]:
                ending = (t, k)
        for k, e in enumerate(engines):  # side work of an engine with no step in progress, sharing its stream
            if k not in active and e.side:
                t = now + min(task.left for task in e.side) * len(e.side)
                if ending is None or t < ending[0]:
                    ending = (t, -1 - k)
        issuing: tuple[float, int] | None = None
        for k, e in enumerate(engines):
            at = None if k in active else e.next_issue()
            if at is not None and (issuing is None or at < issuing[0]):
                issuing = (max(at, now), k)
        if ending is None and issuing is None:
            break
        t, k = ending if ending is not None and (issuing is None or ending[0] <= issuing[0]) else issuing
        host_ends = k in active and active[k].host > 0  # the event is step k's host part ending
        for s in active.values():
            if s.host > 0:
                h = s.host - (t - now)
                s.host = h if h > 1e-12 else 0.0  # over: its GPU part runs from here
            else:
                s.left = max(0.0, s.left - (t - now) * rate[s.engine])
        for j, e in enumerate(engines):
            if j not in active:
                for task in e.side:
                    task.left = max(0.0, task.left - (t - now) / len(e.side))
        now = t
        if k < 0:  # side work done (all of it that is due now, in the order it was queued)
            e = engines[-1 - k]
            due = [task for task in e.side if task.left <= 1e-12]
            e.side = [task for task in e.side if task.left > 1e-12]
            for task in due:
                task.done(now)
            continue
        if host_ends and active[k].left > 1e-12:
            continue
        if k in active:
            s = active.pop(k)
            engines[k].run.wall_s += now - s.issued
            engines[k].finish(now)
            drain(k)
            continue
        dt = engines[k].issue(now)
        drain(k)
        if dt is not None:
            host = engines[k].host_s
            active[k] = _Step(k, gpu_of[k], now, dt - host, host)
            if callable(pair.get(k)):
                beside[k] = pair[k](getattr(engines[k], "step_rows", 0))
    stuck = [k for k, e in enumerate(engines) if e.has_work]
    if stuck:
        raise RuntimeError(f"engine {stuck[0]}'s scheduler made no progress")


def run_alone(e: _Engine) -> None:
    """``run_engines([e], [0])`` for an engine on GPUs of its own and with no side work, without the
    bookkeeping of shared GPUs: each step has the whole GPU from its issue to its end (the same
    times, event for event; the planner simulates thousands of steps a replica)."""
    now = 0.0
    while (at := e.next_issue()) is not None:
        now = max(at, now)
        dt = e.issue(now)
        e.exports.clear()
        if dt is not None:
            issued, now = now, now + dt
            e.run.wall_s += now - issued
            e.finish(now)
            e.exports.clear()
    if e.has_work:
        raise RuntimeError("engine 0's scheduler made no progress")


def run_prefill(cfg: ModelConfig, steps: StepModel, setup: PrefillSetup, arrivals: list[Arrival]) -> ReplicaRun:
    """One P replica on GPUs of its own (see ``PrefillEngine``)."""
    e = PrefillEngine(cfg, steps, setup, arrivals)
    run_alone(e)
    return e.run


def run_decode(cfg: ModelConfig, steps: StepModel, setup: DecodeSetup, arrivals: list[Arrival]) -> ReplicaRun:
    """One D replica on GPUs of its own (see ``DecodeEngine``)."""
    e = DecodeEngine(cfg, steps, setup, arrivals)
    run_alone(e)
    return e.run
