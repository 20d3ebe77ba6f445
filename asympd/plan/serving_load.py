"""The serving path's CPU-side stages under concurrency, from one end-to-end calibration.

A lone request measures what P's answer to the router, D's fetch of the prefix and the HTTP hops
cost when nothing else runs. Under concurrency they slow down: the router, P and D each serve them
from one event loop, a small thread pool and one GIL, shared with every other request between its
arrival and its first token (intake, publishing, fetching and importing a prefix). So each stage
is priced as its lone cost plus a fixed cost per further request in that path when the stage
starts: ``lone + per_request * (n - 1)``. ``per_request`` is a least-squares line through the
calibration batch (every request sent at once, each stage's duration measured by the servers),
with ``n`` counted on the batch's own timeline exactly as the simulator counts it. A lone request
(n = 1) pays its lone cost; the batch's requests pay what the batch measured. Nothing here is
fitted to the rate runs that the validation checks.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asympd.plan.deployment import Deployment, ServingPath


@dataclass(frozen=True)
class StageLoad:
    """Extra ms per further request in the TTFT path, per CPU-side stage (0: a lone cost only):
    ``answer`` P's answer to the router, ``fetch`` D's fetch of the prefix, ``hops`` client ->
    router -> D and the first chunk back."""

    answer_ms: float = 0.0
    fetch_ms: float = 0.0
    hops_ms: float = 0.0
    d_step_ms: float = 0.0  # a D decode step, per request in the TTFT path (none of the step's own)
    batch_in_path: float = 0.0  # mean n over the batch's stage starts (what the slopes were read at)

    def extra_ms(self, stage: str, n: int) -> float:
        """A stage's extra cost when it starts with ``n`` requests in the TTFT path, itself included."""
        return getattr(self, f"{stage}_ms") * max(n - 1, 0)

    def step_extra_ms(self, n: int) -> float:
        """A D decode step's extra host time with ``n`` requests in the TTFT path beside it."""
        return self.d_step_ms * n


def in_path(t: float, spans: Sequence[tuple[float, float | None]]) -> int:
    """Requests between arrival and first token at ``t``: arrived at or before ``t``, first token
    after ``t`` (None: not out yet)."""
    return sum(1 for a, f in spans if a <= t and (f is None or f > t))


def _slope(points: list[tuple[int, float]]) -> float:
    """Least squares of y = k * (n - 1) through the origin, k >= 0."""
    sxx = sum((n - 1) ** 2 for n, _ in points)
    sxy = sum((n - 1) * y for n, y in points)
    return max(0.0, sxy / sxx) if sxx else 0.0


EPS_S = 3e-3  # one step's outputs for different requests reach the client this far apart at most (measured: 5 ms)


@dataclass(frozen=True)
class BatchGap:
    """One token gap of a calibration batch request, on the batch's own timeline."""

    ms: float
    batch: int  # requests decoding through the whole gap (the gap's own request included)
    in_path: int  # requests without their first token at the gap's start
    firsts: tuple[int, ...]  # the batch requests (indices into the rows) whose first token came inside it
    p_overlap_ms: float = 0.0  # how much of it P's steps ran beside it (a shared GPU, P busy with the batch)
    end_s: float = 0.0  # when it ended, on the batch's timeline: one step ends every gap it is seen in

    def same_step(self, other: BatchGap) -> bool:
        """Two requests' gaps that one step ended (its outputs reach the client within ``EPS_S``)."""
        return abs(self.end_s - other.end_s) <= EPS_S

    def alone_ms(self, share: float) -> float:
        """The gap as D alone would have run it: during the overlap D ran at ``share`` of the GPU."""
        return self.ms - self.p_overlap_ms * (1.0 - share)


def batch_rows(cal: dict[str, Any], pd: bool) -> list[tuple[dict, dict]]:
    """The calibration batch's requests with the servers' timings the fits read: (request, timings)."""
    rows = []
    for r in (cal.get("batch") or {}).get("requests") or []:
        t = r.get("timings") or {}
        if r.get("ttft_s") is None or t.get("ttft_s") is None or "prompt_len" not in r:
            continue
        if pd and any(t.get(k) is None for k in ("prefill_s", "prefill_rtt_s", "transfer_s")):
            continue
        rows.append((r, t))
    return rows


def batch_gaps(rows: list[tuple[dict, dict]], p_busy_s: float = 0.0, first_at_start: bool = False) -> list[BatchGap]:
    """Every token gap of the batch's requests (``batch_rows``): its length, the batch decoding
    through it, the requests in the TTFT path at its start, and whose first token came inside it
    (a step of the gap ran their prompt rows). All on the client's timeline (the batch is sent at
    once: a first token at its TTFT, later tokens after its gaps), where one step's tokens for
    different requests arrive within a few ms (the servers' first-token times sit up to ~25 ms
    off the client's gaps), so a first token is put in the gap whose end is nearest to it.
    ``p_busy_s``: P computes the batch's prompts until then, on D's GPU (0: a GPU of its own).
    ``first_at_start``: a first token goes out when its step is launched (a symmetric D's replay,
    ``validate.first_out_at_launch``), so it belongs to the gap whose start is nearest to it."""
    first = [r["ttft_s"] for r, _ in rows]
    ends = [f + sum(r["gaps_s"]) for f, (r, _) in zip(first, rows, strict=True)]
    out = []
    for f0, (r, _) in zip(first, rows, strict=True):
        times = list(itertools.accumulate(r["gaps_s"], initial=f0))
        for k, g in enumerate(r["gaps_s"], start=1):
            s, e = times[k - 1], times[k]
            eps = min(EPS_S, g / 2)
            # a first token belongs to the step whose output for this request reached the client nearest to it
            if first_at_start:  # the nearest start: this gap's, not the one before or after it
                before = (s - times[k - 2]) / 2 if k >= 2 else g / 2
                inside = tuple(i for i, f in enumerate(first) if s - min(g / 2, before) < f <= s + g / 2)
            else:  # the nearest end
                after = (times[k + 1] - e) / 2 if k + 1 < len(times) else g / 2
                inside = tuple(i for i, f in enumerate(first) if s + g / 2 < f <= e + min(g / 2, after))
            batch = sum(1 for f, end in zip(first, ends, strict=True) if f <= s + eps and end >= e - eps)
            overlap = max(0.0, min(e, p_busy_s) - s) * 1e3
            n = sum(1 for f in first if f > s + eps)
            out.append(BatchGap(g * 1e3, max(batch, 1), n, inside, overlap, e))
    return out


def p_blocked_s(start: float, end: float, p_end: float) -> float:
    """How long a hand-off stage of the batch [start, end] waited for P's steps: P's answer and
    the fetch seal and pack the prefix on P's stream, so they wait while P computes the batch
    (from 0 to ``p_end``); the simulator makes them wait the same way (``SideTask``)."""
    return max(0.0, min(end, p_end) - start)


def _handoff_stages(rows: list[tuple[dict, dict]]) -> list[tuple[float, float]]:
    """The batch's hand-off stages on P's stream, on the router's timeline: each request's answer
    (P done to P's answer at the router) and fetch (that to the prefix at D)."""
    out = []
    for _, t in rows:
        out.append((t["prefill_s"], t["prefill_rtt_s"]))
        out.append((t["prefill_rtt_s"], t["prefill_rtt_s"] + t["transfer_s"]))
    return out


def _stream_work_s(start: float, end: float, p_end: float, stream: list[tuple[float, float]]) -> float:
    """A hand-off stage's own work in [start, end]: the time P's stream gave it. While P computes the
    batch (to ``p_end``) it waits (``p_blocked_s``); after, it shares the stream with the other
    hand-off stages in progress (``stream``: each stage's span; none: the stream is its own), as
    the simulator's side work shares it (``simulate.run_engines``): c stages each get 1/c."""
    if not stream:
        return end - start - p_blocked_s(start, end, p_end)
    cuts = sorted({start, end, *(x for s, e in stream for x in (s, e) if start < x < end)})
    if start < p_end < end:
        cuts = sorted({*cuts, p_end})
    work = 0.0
    for a, b in itertools.pairwise(cuts):
        m = (a + b) / 2
        if m < p_end:
            continue
        c = sum(1 for s, e in stream if s <= m < e)
        work += (b - a) / max(c, 1)
    return work


def p_busy_until(rows: list[tuple[dict, dict]], shared_gpu: bool) -> float:
    """When P, sharing D's GPU, finished the batch's prompts (sent at once: P busy from 0); 0 apart."""
    return max((t["prefill_s"] for _, t in rows if t.get("prefill_s") is not None), default=0.0) if shared_gpu else 0.0


def _step_points(
    rows: list[tuple[dict, dict]],
    decode_ms: Callable[[int], float],
    p_busy_s: float,
    first_at_start: bool,
    d_share: float = 0.5,
) -> list[tuple[int, float]]:
    """(requests in the TTFT path at the step's start, excess ms over ``decode_ms(batch)``) for the
    batch's decode-only steps: a token gap in which no request got its first token (such a step also
    ran prompt rows), the batch the requests decoding through the whole gap, read at D's alone
    speed where P's steps shared the GPU (D at ``d_share`` of it, as the simulator shares it
    again). One step is seen in the gap of every request decoding through it: it counts once
    (``BatchGap.same_step``)."""
    steps: list[BatchGap] = []
    for g in batch_gaps(rows, p_busy_s, first_at_start):
        if not g.firsts and not any(g.same_step(s) for s in steps):
            steps.append(g)
    return [(g.in_path, g.alone_ms(d_share) - decode_ms(g.batch)) for g in steps]


def recurring_per_request(points: list[tuple[int, float]]) -> float:
    """The cost per request in the TTFT path that recurs in D's steps: the median over the steps
    with requests in the path of each step's excess per such request (>= 0; none: 0). A cost per
    request in the path (the host work of their fetches and imports, on D's engine thread between
    its steps) is paid by every step that has them beside it, so the median step shows it; a
    one-off stall of D's engine thread (a compile, a capture, a slow import: what
    ``asympd.serve.stall_watch`` names when it passes 1 s) is one step, which a least-squares
    line through the origin would spread over every step (symmetric-split at true depth: one
    ~820 ms step at 5 in the path read as 57 ms per request per step; its other two steps with
    requests in the path cost 0.7-0.8 ms per request)."""
    rates = [y / n for n, y in points if n > 0]
    return max(0.0, statistics.median(rates)) if rates else 0.0


@dataclass(frozen=True)
class LoneCosts:
    """A lone request's costs (ms), as fitted from the lone requests: what each slope is read over."""

    answer_ms: float  # P's answer to the router
    fetch_ms: Callable[[int], float]  # D's fetch of a prefix of so many tokens (the lone move)
    hops_ms: float  # client -> router -> D and the first chunk back
    decode_ms: Callable[[int], float] | None = None  # D's decode step at a batch size (None: no per-step term)


def fit_stage_load(cal: dict[str, Any], lone: LoneCosts, dep: Deployment, path: ServingPath) -> StageLoad:
    """The per-request slopes from the calibration batch, over the ``lone`` costs. ``dep.pd``: a
    P/D deployment (else colocated: the hops only). The batch's requests are sent at once (t = 0)
    and its server timings share the router's origin, so a stage's start is: P's answer, P's
    ``prefill_s`` (P done); D's fetch and the router's hop to D, P's answer reaching the router
    (``prefill_rtt_s``; colocated: 0). With ``path.handoff_on_p_stream`` P's answer and the fetch
    are read without the time they waited for P's steps (``p_blocked_s``). ``lone.decode_ms``:
    D's fitted decode step, for D's per-step term (P/D only: it stands for the prefix fetches and
    imports beside D's steps; a colocated worker's prompt phases hide in token gaps that show no
    first token). ``dep.shared_gpu``: P ran on D's GPU (its steps beside D's while it computed the
    batch). ``path.first_at_start``: see ``batch_gaps``."""
    pd = dep.pd
    rows = batch_rows(cal, pd)
    if not rows:
        return StageLoad()
    spans = [(0.0, t["ttft_s"]) for _, t in rows]
    p_end = p_busy_until(rows, path.handoff_on_p_stream)  # P computes the batch's prompts until then
    stream = _handoff_stages(rows) if pd and path.handoff_on_p_stream else []
    answer, fetch, hops, starts = [], [], [], []
    for r, t in rows:
        hops_n = in_path(t["prefill_rtt_s"] if pd else 0.0, spans)
        hops.append((hops_n, (r["ttft_s"] - t["ttft_s"]) * 1e3 - lone.hops_ms))
        starts.append(hops_n)
        if pd:
            n = in_path(t["prefill_s"], spans)
            s, e = t["prefill_s"], t["prefill_rtt_s"]
            answer.append((n, _stream_work_s(s, e, p_end, stream) * 1e3 - lone.answer_ms))
            s, e = e, e + t["transfer_s"]
            fetch.append((hops_n, _stream_work_s(s, e, p_end, stream) * 1e3 - lone.fetch_ms(r["prompt_len"])))
            starts.append(n)
    step = (
        _step_points(rows, lone.decode_ms, p_busy_until(rows, dep.shared_gpu), path.first_at_start, dep.d_share)
        if pd and lone.decode_ms is not None
        else []
    )
    return StageLoad(
        answer_ms=_slope(answer) if pd else 0.0,
        fetch_ms=_slope(fetch) if pd else 0.0,
        hops_ms=_slope(hops),
        d_step_ms=recurring_per_request(step),
        batch_in_path=sum(starts) / len(starts),
    )
