"""What a measured deployment was, and how its serving path is modelled: the two things that the
e2e validation's fits (serving_load.py) and its simulation (validate.py) both read. Kept apart so
that a new fact about the deployment and a new rule of the serving-path model each change one
object, not every function's argument list."""

from __future__ import annotations

from dataclasses import dataclass

from asympd.serve.admission import AdmissionPolicy


@dataclass(frozen=True)
class Deployment:
    """One measured deployment of a ``bench/e2e.py`` result: 1 P + 1 D, or ``replicas`` colocated
    workers (round-robin), with the result's settings; no speculative decoding."""

    mode: str
    policy: AdmissionPolicy  # D's admission policy (mixed steps or not)
    p_step_tokens: int  # P's prefill token budget per step
    colocated_semantics: str  # how a colocated worker computes a whole prompt
    replicas: int = 1  # colocated workers (P/D: one of each)
    shared_gpu: bool = False  # every worker on one GPU, their steps sharing it
    seed: int = 0  # D's draws
    # how much slower P's and D's steps ran beside each other on the shared GPU than alone (the
    # calibration's co-run, bench/e2e.py ``co_run``); None: not measured, equal shares (2, 2)
    co_run: tuple[float, float] | None = None
    # P's stretch per step size, (rows, stretch) by rows, where the co-run measured more than one
    # size (its fill phase: the load's full-budget steps); None: ``co_run``'s one value at every size
    p_by_rows: tuple[tuple[int, float], ...] | None = None
    # P ran its deepest waiting phase alone (``SchedulerConfig.one_depth_per_step``), as its worker
    # reported (``admission``); results before the field: mixed
    p_one_depth: bool = False
    p_deepest_chunks: int | None = None  # ... at most this many chunks of its deepest phase a step

    @property
    def p_share(self) -> float:
        """P's rate while a D step shares its GPU: 1 / P's measured stretch, else half."""
        return 1.0 / self.co_run[0] if self.co_run else 0.5

    def p_share_at(self, rows: int) -> float:
        """P's rate beside a D step for a P step of ``rows`` prompt rows: 1 / the stretch read
        linearly between the two measured sizes around it (the nearest one's outside them), so a
        loaded P's multi-prompt step is not read at a calibration prompt's stretch."""
        pts = self.p_by_rows
        if not pts:
            return self.p_share
        if rows <= pts[0][0]:
            return 1.0 / pts[0][1]
        for (r0, s0), (r1, s1) in zip(pts, pts[1:], strict=False):
            if rows <= r1:
                return 1.0 / (s0 + (s1 - s0) * (rows - r0) / (r1 - r0))
        return 1.0 / pts[-1][1]

    @property
    def d_share(self) -> float:
        """D's rate while a P step shares its GPU: 1 / D's measured stretch, else half."""
        return 1.0 / self.co_run[1] if self.co_run else 0.5

    @property
    def pd(self) -> bool:
        """A P/D deployment (else colocated workers: no P answer, no fetch)."""
        return self.mode != "colocated"


@dataclass(frozen=True)
class ServingPath:
    """How the serving path is modelled, from what the engine does on the result's device."""

    handoff_on_p_stream: bool = True  # P's answer and the fetch wait for P's steps (a GPU stream; a CPU has none)
    outputs_at_launch: bool = True  # a GPU engine: a D step that samples nothing answers at its launch
    first_at_start: bool = False  # this mode's first token goes out when its step launches (a symmetric replay)
