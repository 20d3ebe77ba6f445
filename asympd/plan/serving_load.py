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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


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


def _step_points(rows: list[tuple[dict, dict]], decode_ms: Callable[[int], float]) -> list[tuple[int, float]]:
    """(requests in the TTFT path at the step's start, excess ms over ``decode_ms(batch)``) for the
    batch's decode-only steps: a token gap in which no request got its first token (such a step also
    ran prompt rows), the batch the requests decoding through the whole gap."""
    first = [t["ttft_s"] for _, t in rows]
    ends = [f + sum(r["gaps_s"]) for f, (r, _) in zip(first, rows, strict=True)]
    eps = 1e-4  # one step's outputs reach the server a little apart
    out = []
    for f0, (r, _) in zip(first, rows, strict=True):
        s = f0
        for g in r["gaps_s"]:
            e = s + g
            if not any(s + eps < f <= e + eps for f in first):
                batch = sum(1 for f, end in zip(first, ends, strict=True) if f <= s + eps and end >= e - eps)
                out.append((sum(1 for f in first if f > s + eps), g * 1e3 - decode_ms(max(batch, 1))))
            s = e
    return out


def fit_stage_load(
    cal: dict[str, Any],
    pd: bool,
    lone_answer_ms: float,
    fetch_ms: Callable[[int], float],
    lone_hops_ms: float,
    decode_ms: Callable[[int], float] | None = None,
) -> StageLoad:
    """The per-request slopes from the calibration batch; lone costs as fitted from the lone
    requests (``fetch_ms(prompt_len)``: the lone move). ``pd``: a P/D deployment (else colocated:
    the hops only). The batch's requests are sent at once (t = 0) and its server timings share the
    router's origin, so a stage's start is: P's answer, P's ``prefill_s`` (P done); D's fetch and the
    router's hop to D, P's answer reaching the router (``prefill_rtt_s``; colocated: 0).
    ``decode_ms(batch)``: D's fitted decode step, for D's per-step term (P/D only: it stands for
    the prefix fetches and imports beside D's steps; a colocated worker's prompt phases hide in
    token gaps that show no first token)."""
    reqs = (cal.get("batch") or {}).get("requests") or []
    rows = []
    for r in reqs:
        t = r.get("timings") or {}
        if r.get("ttft_s") is None or t.get("ttft_s") is None or "prompt_len" not in r:
            continue
        if pd and any(t.get(k) is None for k in ("prefill_s", "prefill_rtt_s", "transfer_s")):
            continue
        rows.append((r, t))
    if not rows:
        return StageLoad()
    spans = [(0.0, t["ttft_s"]) for _, t in rows]
    answer, fetch, hops, starts = [], [], [], []
    for r, t in rows:
        hops_n = in_path(t["prefill_rtt_s"] if pd else 0.0, spans)
        hops.append((hops_n, (r["ttft_s"] - t["ttft_s"]) * 1e3 - lone_hops_ms))
        starts.append(hops_n)
        if pd:
            n = in_path(t["prefill_s"], spans)
            answer.append((n, (t["prefill_rtt_s"] - t["prefill_s"]) * 1e3 - lone_answer_ms))
            fetch.append((hops_n, t["transfer_s"] * 1e3 - fetch_ms(r["prompt_len"])))
            starts.append(n)
    step = _step_points(rows, decode_ms) if pd and decode_ms is not None else []
    return StageLoad(
        answer_ms=_slope(answer) if pd else 0.0,
        fetch_ms=_slope(fetch) if pd else 0.0,
        hops_ms=_slope(hops),
        d_step_ms=_slope([(n + 1, y) for n, y in step]),
        batch_in_path=sum(starts) / len(starts),
    )
