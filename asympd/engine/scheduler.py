"""The scheduler decides; it never touches tensors.

Each step mixes, under one token budget: decode rows of running requests first (their inter-token
latency is what admission must protect), then the next chunk of prompts already in progress, then
new admissions, FCFS, at most ``max_new_admissions`` per step and at most
``admission_token_budget`` new prompt rows per step (Sarathi-style). With ``mixed_steps`` off a step
carries prompt rows or decode rows, never both, taking turns while both wait (SGLang's default,
without ``--enable-mixed-chunk``): on a GPU the decode steps and a D's steps of bounded prefills
alone then replay CUDA graphs, where a mixed step runs eagerly (docs/performance.md §10).

Blocks for a request's whole prompt are reserved at admission, so a prefill in progress never stalls
on memory; a decode that cannot grow preempts the most recently admitted request, which is
recomputed later. A request that could never fit, even alone, fails with a clear error instead of
waiting forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from asympd.engine.modes import Phase
from asympd.engine.request import Request, Status
from asympd.kv.block_manager import BlockManager, CacheFullError, RequestTooLargeError
from asympd.model.depth import Depth

# read per running request per step: a module constant, where ``Status.RUNNING`` goes through
# ``EnumType.__getattr__`` at each read (Python 3.11)
_RUNNING = Status.RUNNING


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # rows per step, all kinds together
    max_new_admissions: int | None = None  # new requests admitted per step; None = no cap
    admission_token_budget: int | None = None  # prompt rows per step for prefills; None = the step budget
    num_spec_tokens: int = 0
    mixed_steps: bool = True  # False: prompt rows and decode rows in separate steps, taking turns
    # True: a step's prompt chunks of requests in progress all run at one depth, the deepest they
    # wait at (a symmetric P's window chunks, every layer, before other prefixes, and no admission
    # beside them): those come alone and replay CUDA graphs, and each finishes its request's prompt
    one_depth_per_step: bool = False
    # with one_depth_per_step: a step at the deepest depth (ALL: a symmetric P's windows) holds at most
    # this many chunks (the batch its graphs replay); the rest take the next step. None: no cap
    max_deepest_chunks: int | None = None

    def validate(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        for name in ("max_new_admissions", "admission_token_budget", "max_deepest_chunks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:  # below 1 nothing is ever admitted
                raise ValueError(f"{name} must be positive (or unset: no cap), got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs * (1 + self.num_spec_tokens):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one decode step of "
                f"max_num_seqs={self.max_num_seqs} requests x {1 + self.num_spec_tokens} rows"
            )


@dataclass(slots=True)  # a few per request per step: slots make them cheaper to make and to free
class ScheduledChunk:
    request: Request
    lo: int  # first row (position)
    hi: int  # one past the last row
    phase: Phase | None  # None: decode rows

    @property
    def num_rows(self) -> int:
        return self.hi - self.lo


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # newly allocated: import their prefix first
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(c.num_rows for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, prefix_cache_key: str = ""):
        config.validate()
        self.config = config
        self.blocks = blocks
        self.prefix_cache_key = prefix_cache_key
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._last_had_prompt = False  # without mixed steps: whose turn is next

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request, free: bool = True) -> None:
        """Forget a finished or aborted request and free its blocks (unless ``free`` is False: the
        engine frees them once nothing reads them any more)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free and request.request_id in self.blocks:
            self.blocks.free(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r.status is _RUNNING for r in self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.mixed_steps:
            budget = self._decodes(out, budget, run=True)
            self._prompts(out, budget)
        elif self._prompt_turn():
            self._decodes(out, budget, run=False)  # their next rows' blocks first, as in a mixed step
            self._prompts(out, budget)
            if not out.chunks:  # nothing to prefill (admissions waiting for memory or for their prefix)
                self._decodes(out, budget, run=True)
        else:
            self._decodes(out, budget, run=True)
        self._last_had_prompt = any(c.phase is not None for c in out.chunks)
        return out

    def _prompt_turn(self) -> bool:
        """Without mixed steps: prompt rows go next unless the last step had them and decodes wait."""
        return not self._last_had_prompt or not any(self._decoding(r) for r in self.running)

    @staticmethod
    def _decoding(req: Request) -> bool:
        return not req.in_prompt and req.status is _RUNNING

    def _decodes(self, out: SchedulerOutput, budget: int, run: bool) -> int:
        """Decode rows of the running requests, preempting the newest admissions when blocks run out
        (``run`` False: only make room for them). Returns the budget left."""
        # ``_decoding``, inlined (it runs per request per step); a request this loop preempts is
        # WAITING again (``reset_for_recompute``), so it is skipped without a set of the preempted
        for req in list(self.running):
            if req.status is not _RUNNING or req.in_prompt:
                continue
            rows = 1 + len(req.spec_draft) if req.spec_enabled else 1  # [newest token, drafts]
            pos = req.num_tokens - 1
            if not self._grow(req, pos + rows, out) or not run:
                continue
            out.chunks.append(ScheduledChunk(req, pos, pos + rows, None))
            budget -= rows
        return budget

    def _prompts(self, out: SchedulerOutput, budget: int) -> None:
        """The next chunk of prompts in progress, then new admissions (FCFS, capped), within
        ``budget`` rows (what the step's decodes left) and the admission token budget."""
        prompt_budget = self.config.admission_token_budget or self.config.max_num_batched_tokens
        ready = [r for r in self.running if r.in_prompt and r.status is _RUNNING and not r.awaiting_import]
        depth = max((r.phases[r.phase_index].depth for r in ready), default=None)
        if not self.config.one_depth_per_step:
            depth = None  # any depth joins the step
        cap = self.config.max_deepest_chunks if depth is Depth.ALL else None
        for req in ready:
            if budget <= 0 or prompt_budget <= 0 or (cap is not None and len(out.chunks) >= cap):
                break
            if depth is None or req.phases[req.phase_index].depth == depth:
                n = self._prompt_chunk(req, min(budget, prompt_budget), out)
                budget -= n
                prompt_budget -= n
        admitted = 0
        while self.waiting and budget > 0 and prompt_budget > 0 and len(self.running) < self.config.max_num_seqs:
            if self.config.max_new_admissions is not None and admitted >= self.config.max_new_admissions:
                break
            req = self.waiting[0]
            if depth is not None and (cap is not None or (req.phases and req.phases[0].depth != depth)):
                break  # FCFS: a later step takes it (a step of windows stays one a graph replays)
            verdict = self._admit(req, out)
            if verdict == "wait":
                break
            self.waiting.popleft()
            if verdict == "failed":
                continue
            admitted += 1
            if req.in_prompt and not req.awaiting_import:
                n = self._prompt_chunk(req, min(budget, prompt_budget), out)
                budget -= n
                prompt_budget -= n

    def _prompt_chunk(self, req: Request, limit: int, out: SchedulerOutput) -> int:
        phase = req.phases[req.phase_index]
        hi = min(phase.hi, req.cursor + limit)
        out.chunks.append(ScheduledChunk(req, req.cursor, hi, phase))
        return hi - req.cursor

    def _admit(self, req: Request, out: SchedulerOutput) -> str:
        """Reserve blocks for the whole prompt (and what was already generated, after a
        preemption) plus the first decode step: "admitted", "wait" or "failed"."""
        need = req.num_tokens + 1 + self.config.num_spec_tokens
        cacheable = req.import_len if req.imported is not None else 0
        key = self.prefix_cache_key + req.cache_salt
        try:
            alloc = self.blocks.allocate(
                req.request_id, need, token_ids=req.prompt_token_ids, cacheable_tokens=cacheable, extra_key=key
            )
        except RequestTooLargeError as e:
            req.status = Status.FINISHED_ERROR
            out.failed.append((req, str(e)))
            return "failed"
        except CacheFullError:
            return "wait"
        req.num_cached_import = alloc.num_cached_tokens
        if cacheable and not req.awaiting_import:
            # the engine writes an admitted request's whole import before the step's forward reads
            # any block (LLMEngine.step: runner.prepare), so its blocks are the prefix's from now on:
            # a request on the same prefix admitted later in this step (OpenAI's n choices) shares
            # them instead of writing a copy of its own
            self.blocks.commit_cached(req.request_id, req.prompt_token_ids, cacheable, extra_key=key)
        req.status = Status.RUNNING
        req.phase_index = 0
        req.cursor = req.phases[0].lo if req.phases else 0
        self.running.append(req)
        out.admitted.append(req)
        return "admitted"

    def _grow(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Make room for ``num_tokens`` positions of ``req``, preempting newer requests if needed.
        Returns False if ``req`` itself was preempted or failed."""
        if num_tokens <= self.blocks.num_tokens(req.request_id):
            return True
        while True:
            try:
                self.blocks.grow(req.request_id, num_tokens)
                return True
            except RequestTooLargeError as e:
                self.running.remove(req)
                self.blocks.free(req.request_id)
                req.status = Status.FINISHED_ERROR
                out.failed.append((req, str(e)))
                return False
            except CacheFullError:
                victim = self.running[-1]
                self.running.remove(victim)
                self.blocks.free(victim.request_id)
                victim.reset_for_recompute()
                self.waiting.appendleft(victim)
                out.preempted.append(victim)
                out.chunks = [c for c in out.chunks if c.request is not victim]
                if victim is req:
                    return False
