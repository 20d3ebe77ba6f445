"""A prefill worker whose prefixes run over N context-parallel ranks (``asympd serve --role prefill
--cp N``).

Rank 0 is the server process, ranks 1..N-1 are started by it (``launch.RankGroup``, as for EP).
Per request rank 0 broadcasts the job (prompt, split, format) on the control group, then every rank
runs ``cp.cp_prefill`` on its slice of [0, split); rank 0 computes the *last* slice, so the process
that publishes the PrefixState is the one that exports it, and no state crosses between ranks. The
state is byte for byte what one rank exports (tests/parallel/test_cp.py), so D is unchanged.

One prefix runs over the group at a time: CP exists to cut one long prompt's TTFT (each rank
computes one slice, the layers overlap as a wavefront); throughput comes from more P replicas. A
prefix shorter than the group runs on rank 0 alone.

The engine is the part of ``LLMEngine``'s interface the server drives (``add_request``, ``step``,
``abort_request``, ``release_transfer``, ``stats``), and on CUDA it warms up as that engine does,
one throwaway prefix per slice-size class (``warm_up``). It has no paged cache: a prefix's KV lives in
the ranks' dense sequence caches while it is computed, then only in the exported state, which the
transport holds until D acks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch.distributed as dist

from asympd.engine import modes
from asympd.engine.engine import EngineConfig, RequestError, check_prompt, checkpoint_id
from asympd.engine.request import CompletionOutput, RequestOutput, Status
from asympd.engine.sampling import SamplingParams
from asympd.engine.warm_up import WARM_UP_ID, WarmUp, prompt_len, warm_up_ids, warm_up_rows
from asympd.model.transformer import Transformer
from asympd.parallel.cp import cp_prefill, local_prefill
from asympd.parallel.executor import ExecutorBroken
from asympd.parallel.launch import RankGroup
from asympd.transfer.prefix_state import model_fingerprint

log = logging.getLogger("asympd.engine")

CP_MODES = ("asymmetric", "encoder-only")  # P computes only layers < K and K's KV path on its rows


def check_cp(cp: int, role: str, mode: str) -> None:
    """ValueError unless a worker of ``role`` in ``mode`` can split its prefix over ``cp`` ranks."""
    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}")
    if cp == 1:
        return
    if role != "prefill":
        raise ValueError(f"--cp {cp} splits a prefill worker's prefix over ranks: it needs --role prefill, not {role}")
    if mode not in CP_MODES:
        raise ValueError(
            f"--cp {cp}: context parallelism runs a prefill worker that computes only the KV source layers "
            f"(mode {' or '.join(CP_MODES)}); mode {mode} has no such prefill worker"
        )


class CPPrefillEngine:
    """Rank 0's engine of a context-parallel prefill worker; ``close`` stops the other ranks."""

    def __init__(self, model: Transformer, config: EngineConfig, group: RankGroup) -> None:
        check_cp(group.world_size, config.role, config.mode)
        config.validate()
        if config.stream_prefix:
            raise ValueError("a context-parallel prefill worker exports its prefix whole: no --stream-prefix")
        self.model, self.cfg, self.config, self.group = model, model.cfg, config, group
        self.world = group.world_size
        self.order = [*range(1, self.world), 0]  # rank 0 computes the last slice and exports
        self.fingerprint = model_fingerprint(self.cfg, checkpoint_id(getattr(model, "checkpoint", None)), model.dtype)
        self.cache = None  # no paged KV pool (module docstring)
        self.waiting: deque[tuple[str, list[int], float]] = deque()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0}
        self.broken = False  # a prefix failed half-way: the ranks may be out of step
        self.closed = False
        if not group.joined:
            group.join()
        self.warm_up_report: WarmUp | None = self.warm_up() if config.warms_up(model.device) else None

    def warm_up(self) -> WarmUp:
        """One throwaway prefix per slice-size class before serving, so that Triton compiles at
        start-up, not mid-traffic (engine/warm_up.py says why). Every rank computes its slice in one
        forward, so the classes are the slice's rows: each ``warm_up_rows`` size up to P's step
        budget (``max_num_batched_tokens``), as long as the context allows. Slices longer than the
        budget are not warmed. The counters are put back; nothing is exported."""
        t0, counters, done = time.perf_counter(), dict(self.counters), []
        budget = min(self.config.scheduler.max_num_batched_tokens, (self.cfg.max_seq_len - 1) // self.world)
        for rows in warm_up_rows(max(1, budget)):
            split = rows * self.world  # near-equal slices of ``rows`` rows each
            n = prompt_len(split, self.cfg.window_size, self._split_of)
            if n is None:
                continue
            try:
                self.add_request(f"{WARM_UP_ID}{rows}", warm_up_ids(n, rows, self.cfg.vocab_size))
            except RequestError as e:  # a prompt this worker refuses: nothing to warm at this size
                log.debug("warm-up skips %d rows: %s", rows, e)
                continue
            self.step()
            done.append(rows)
        self.counters.update(counters)
        report = WarmUp(tuple(done), time.perf_counter() - t0)
        log.info("context-parallel %s", report.line())
        return report

    def _split_of(self, n: int) -> int | None:
        """The rows this worker computes of an ``n``-token prompt (None past the context)."""
        if n >= self.cfg.max_seq_len:
            return None
        return modes.prefill_plan(self.cfg, n, self.config.mode, self.config.boundary_policy).export_upto

    # ---- requests ------------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None, **kwargs: Any
    ) -> None:
        """Queue a prompt; bad input raises RequestError before anything runs."""
        if kwargs:
            raise RequestError(f"a context-parallel prefill worker takes prompts only, not {', '.join(kwargs)}")
        if self.broken or self.closed:
            raise RequestError("the context-parallel group is out of step or closed: restart this prefill worker")
        ids = list(prompt_token_ids)
        if any(r == request_id for r, _, _ in self.waiting):
            raise RequestError(f"request id {request_id!r} is already in use")
        check_prompt(self.cfg, ids, params or SamplingParams())
        self.waiting.append((request_id, ids, time.monotonic()))

    def abort_request(self, request_id: str) -> None:
        """Drop a queued request (one being computed finishes its step first)."""
        self.waiting = deque(w for w in self.waiting if w[0] != request_id)

    def release_transfer(self, request_id: str) -> None:
        """Nothing to free: the exported state is the transport's."""

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    # ---- the loop ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Compute the oldest queued prefix over the group and hand out its PrefixState."""
        if not self.waiting:
            return []
        rid, ids, arrival = self.waiting.popleft()
        self.counters["steps"] += 1
        c = self.config
        split = modes.prefill_plan(self.cfg, len(ids), c.mode, c.boundary_policy).export_upto
        job = {
            "token_ids": ids,
            "split": split,
            "fingerprint": self.fingerprint,
            "mode": c.mode,
            "boundary_policy": c.boundary_policy,
            "kv_format": c.kv_wire_format,
        }
        if split >= self.world:
            if self.broken or self.closed:
                raise ExecutorBroken("the context-parallel group is out of step or closed")
            self.broken = True  # until every rank is through this prefix
            dist.broadcast_object_list([("prefill", job, self.order)], src=0, group=self.group.control)
            state = cp_prefill(self.model, order=self.order, **job)
            self.broken = False
        else:
            state = local_prefill(self.model, **job)
        self.counters["prompt_tokens"] += split
        done = time.monotonic()
        out = RequestOutput(
            request_id=rid,
            prompt_token_ids=ids,
            outputs=[CompletionOutput(0, [], "", None, Status.FINISHED_EXPORTED.value)],
            finished=True,
            metrics={"arrival_time": arrival, "num_preemptions": 0, "e2e": done - arrival},
        )
        out.prefix_state = state
        return [out]

    def stats(self) -> dict[str, Any]:
        return {"running": 0, "waiting": len(self.waiting), "held_for_transfer": 0, "cp": self.world, **self.counters}

    def close(self) -> None:
        """Stop the other ranks (``stop`` when they are in step, a kill otherwise). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.group.joined and not self.broken:
            try:
                dist.broadcast_object_list([("stop",)], src=0, group=self.group.control)
            except Exception:
                self.broken = True
        if self.broken or not self.group.joined:
            self.group.kill()
        else:
            self.group.close()


def serve_cp_rank(model: Transformer, control: Any) -> None:
    """A non-zero rank's loop: run its slice of each prefix rank 0 announces, until ``stop``."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        kind, *rest = box[0]
        if kind == "stop":
            return
        if kind != "prefill":
            raise RuntimeError(f"unknown message {kind!r}")
        job, order = rest
        cp_prefill(model, order=order, **job)


def launch_cp(
    checkpoint: str,
    cp: int,
    device: str = "cpu",
    dtype: str = "float32",
    threads: int | None = None,
    weights: str = "auto",
) -> RankGroup:
    """Start ranks 1..cp-1 of a context-parallel prefill worker (they load while the caller loads
    its own model); then ``CPPrefillEngine(model, config, group)``."""
    from asympd.parallel.launch import RankSpec

    return RankGroup(cp, RankSpec(checkpoint, "prefill", device, dtype, threads, parallel="cp", weights=weights))
