"""The planner's simulator against what was measured.

Two checks. ``validate_e2e`` (``asympd plan --validate``) replays a ``bench/e2e.py`` result: the
same arrivals through the same engines and scheduler, with step times fitted to the result's own
calibration and the result's placement (one GPU: P and D steps queue on it), against the measured
TTFT p50, ITL p50 and goodput. ``validate_admission`` replays ``bench/results/admission_policy.json``
(the D worker on one-GPU-equivalent H200 step times) and checks that the planner's D model
reproduces that benchmark's; it is not a check against a GPU.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from asympd.config import ModelConfig, v41_flash
from asympd.engine import modes
from asympd.engine.graph_sizes import BATCH_SIZES
from asympd.plan.deployment import Deployment, ServingPath
from asympd.plan.gpus import GPUS
from asympd.plan.serving_load import (
    LoneCosts,
    StageLoad,
    batch_gaps,
    batch_rows,
    fit_stage_load,
    in_path,
    p_busy_until,
)
from asympd.plan.simulate import (
    Arrival,
    DecodeEngine,
    DecodeSetup,
    PrefillEngine,
    PrefillSetup,
    SideTask,
    run_decode,
    run_engines,
)
from asympd.plan.step_log import d_prompt_alone_steps, gpu_held, p_fit_steps, timed_to_gpu_end
from asympd.plan.steps import BF16_TABLES, RESULTS_DIR, StepModel, interp, load_results
from asympd.serve.admission import POLICIES, AdmissionPolicy

BENCH_POLICIES = ("admit-all", "cap-4", "cap-8")  # the policies admission_policy.json measured (POLICIES' names)


def bench_arrivals(ap: dict[str, Any], n: int, seed: int = 7) -> list[Arrival]:
    """The benchmark's Poisson stream: same rate, mix and output length (its own seed sequence)."""
    rng = random.Random(seed)
    lengths = [int(k) for k in ap["mix"]]
    weights = list(ap["mix"].values())
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(ap["rate_req_per_s"])
        out.append(Arrival(i, t, rng.choices(lengths, weights=weights)[0], ap["out_len"]))
    return out


def validate_admission(
    requests: int | None = None, policies: tuple[str, ...] = BENCH_POLICIES, results_dir: str | None = None
) -> dict[str, Any]:
    """The planner's D model on the admission benchmark's scenario, per policy, against its numbers."""
    res = load_results(results_dir, BF16_TABLES)  # the tables the benchmark simulated on
    ap = json.loads((Path(results_dir or RESULTS_DIR) / "admission_policy.json").read_text())
    cfg = v41_flash()
    steps = StepModel(res, GPUS["H200"], cfg.dim, cfg.n_activated_experts, cfg.window_size)
    arr = bench_arrivals(ap, requests or ap["requests"])
    out: dict[str, Any] = {"requests": len(arr), "rate_req_per_s": ap["rate_req_per_s"], "policies": {}}
    for name in policies:
        run = run_decode(cfg, steps, DecodeSetup("asymmetric", 1, 1 << 20, 512, POLICIES[name], seed=11), arr)
        ttft = sorted(run.first_token_s[a.index] - a.time_s for a in arr if a.index in run.first_token_s)
        itl = sorted(run.itl_s)

        def p(xs: list[float], q: float) -> float:
            return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3

        bench = ap["scenarios"]["poisson"][name]
        mine = {"itl_p50": p(itl, 50), "itl_p99": p(itl, 99), "ttft_p50": p(ttft, 50), "ttft_p99": p(ttft, 99)}
        ref = {
            "itl_p50": bench["itl_ms"]["p50"],
            "itl_p99": bench["itl_ms"]["p99"],
            "ttft_p50": bench["ttft_ms"]["p50"],
            "ttft_p99": bench["ttft_ms"]["p99"],
        }
        out["policies"][name] = {
            "planner_ms": mine,
            "benchmark_ms": ref,
            "ratio": {k: mine[k] / ref[k] for k in mine},
        }
    return out


# ---- the end-to-end study (bench/e2e.py) ------------------------------------------------------------

TARGET = 0.15  # issue 18: within 15 % of the measured TTFT p50, ITL p50 and goodput
# validate_e2e's ways to split a shared GPU: equal shares; the calibration co-run's measured stretch;
# equal shares of P's per-row work only, its fixed cost taken as host launching (docs/planner.md "v12")
SHARES = ("equal", "co-run", "host-split")
HANDOFF_STREAMS = ("compute", "pack")  # where P's hand-off packs on a GPU (bench/e2e.py's handoff_stream)
METRICS = ("ttft_p50_ms", "itl_p50_ms", "goodput_req_s")


class ValidationError(ValueError):
    """An end-to-end result the validation cannot read."""


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both >= 0; through the origin where x does not vary."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        x = max(xs) or 1.0
        return 0.0, max(0.0, _median([y for _, y in points]) / x)
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


# a stall (not P's cost): a step this many robust deviations (1.4826 x MAD) above P's line and
# over this many times the line's time; two conditions, as P's alone steps cluster at one size
# (the MAD of oos7's was 3 ms: a 2076-row step 1.4x the line was 30 deviations off)
STALL_MADS, STALL_FACTOR = 3.0, 2.0


def stalls(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points of a step line that are stalls, not the line's cost: those above the
    least-squares line through the other points by over ``STALL_MADS`` robust standard deviations
    (the median absolute residual x 1.4826) and over ``STALL_FACTOR`` x that line's time. oos8's P
    spent 1.19 s on a 1201-row step its neighbours ran at 0.2 s, which tripled the line's intercept
    (docs/planner.md, "oos8"). A point inside the others' row range is judged against the line
    through the others: v7a's one 1706-row step of 0.50 s, where a 1792-row one took 0.14, pulled a
    line through all of them to 0.32 s there and hid (docs/planner.md, "v7"); one outside it (the
    fill's 16K-row step, the slope's only long lever) against the line through all, as a line
    through 896-1792-row steps says nothing about 16K rows. Nothing when that would leave the line
    fewer than two row counts."""
    lines = [_line_without(points, i) for i in range(len(points))]
    resid = [y - a - b * x for (x, y), (a, b) in zip(points, lines, strict=True)]
    mad = _median([abs(r) for r in resid])
    out = [
        (x, y)
        for (x, y), r, (a, b) in zip(points, resid, lines, strict=True)
        if r > STALL_MADS * 1.4826 * mad and y > STALL_FACTOR * (a + b * x)
    ]
    if len({pt[0] for pt in points if pt not in out}) < 2:
        return []
    return out


def _line_without(points: list[tuple[float, float]], i: int) -> tuple[float, float]:
    """``stalls``' line to judge point i by: the others' where they bracket its row count, else all."""
    others = points[:i] + points[i + 1 :]
    xs = [x for x, _ in others]
    return _robust_line(others) if xs and min(xs) <= points[i][0] <= max(xs) else _line(points)


def _robust_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Theil-Sen (intercept, slope), both >= 0: the median slope over pairs of distinct row counts,
    the median intercept under it; ``_line`` where fewer than two row counts."""
    slopes = [(y2 - y1) / (x2 - x1) for k, (x1, y1) in enumerate(points) for x2, y2 in points[k + 1 :] if x2 != x1]
    if not slopes:
        return _line(points)
    slope = max(0.0, _median(slopes))
    return max(0.0, _median([y - slope * x for x, y in points])), slope


@dataclass
class MeasuredSteps:
    """``StepModel``'s interface with step times fitted to an end-to-end result's own calibration
    (lone requests and one batch, through the same servers): the planner's simulator then runs on
    the measured machine instead of the H200 tables. Times in ms."""

    p_step_ms: float  # P: fixed cost of a step
    p_row_ms: float  # P: per prompt row
    d_step_ms: float  # D: a decode step of one request
    d_seq_ms: float  # D: per further request in the step
    d_row_ms: float  # D: per bounded-prefill (or colocated prompt) row
    move_ms: float  # P -> D: fixed cost of one prefix move
    move_row_ms: float  # P -> D: per prompt token
    handoff_ms: float = 0.0  # P answering the router once the prefix is ready: prefill_rtt - prefill_s
    ttft_offset_ms: float = 0.0  # client TTFT minus the servers' parts, lone requests (HTTP hops, router)
    d_pre_ms: float = 0.0  # D: fixed cost of a step's prompt-row path
    mix_pre_ms: float | None = None  # D: a mixed step's cost over its decode path (None: the two paths add)
    mix_row_ms: float = 0.0  # D: ... and per prompt row of a mixed step
    move_beside_p_ms: float | None = None  # P -> D while P computes (``fetch_beside_p_ms``); None: not measured
    d_ladder_ms: dict[int, float] | None = None  # D: decode step by batch size (``decode_ladder_ms``); None: the line
    p_window_ms: dict[int, float] | None = None  # P: a step of k window chunks alone (``fit_p_step``); None: the line
    # P: of each step, the host's launching that neither takes nor slows a shared GPU (shares
    # "host-split": the fitted fixed cost, docs/planner.md "v12"); 0: the whole step is GPU work
    p_host_ms: float = 0.0

    def prefill_ms(self, mode: str, chunks: list[tuple[int, int]], gpus: int, windows: int = 0) -> float:
        """A P step: its window chunks alone (``windows``, a symmetric P's CUDA graph) from the
        measured window steps where the calibration logged them, every other step by the line."""
        if windows and self.p_window_ms:
            return window_step_ms(self.p_window_ms, windows)
        rows = sum(r for r, _ in chunks)
        return self.p_step_ms + self.p_row_ms * rows if rows else 0.0

    def decode_ms(self, batch: int, prefill_rows: int, gpus: int) -> float:
        """Each kind of D step at its own price, as the engine runs it: decode rows alone (a CUDA
        graph on a GPU) from the lone requests' gaps and the batch's steady ones; prompt rows alone
        (a D's first-step chunks: a graph too since 684acfe) from the lone requests' first step;
        a step mixing both (eager on a GPU) at the decode path plus what the calibration batch's
        mixed steps cost over it (``fit_admission_steps``). Without that measurement a mixed
        step pays both paths, one after the other. Decode rows: the lone step plus, where the
        calibration measured a ladder (a GPU result), what the graph of the padded batch adds to a
        batch of one (``padded_excess_ms``), else a line in the batch."""
        if not batch:
            decode = 0.0
        elif self.d_ladder_ms:
            decode = self.d_step_ms + padded_excess_ms(self.d_ladder_ms, batch)
        else:
            decode = self.d_step_ms + self.d_seq_ms * (batch - 1)
        if not prefill_rows:
            return decode
        if batch and self.mix_pre_ms is not None:
            return decode + self.mix_pre_ms + self.mix_row_ms * prefill_rows
        return decode + self.d_pre_ms + self.d_row_ms * prefill_rows

    def move_for(self, prompt_len: int) -> float:
        return self.move_ms + self.move_row_ms * prompt_len


def decode_ladder_ms(cal: dict[str, Any], on_gpu: bool) -> dict[int, float] | None:
    """D's decode step (ms) by batch size from the calibration's ladder (bench/e2e.py
    ``decode_ladder``: each size decoding together, read from D's step log); None on a CPU (no CUDA
    graphs pad its batches), without a ladder, or without its batch of one (what the others add to)."""
    ladder = (cal.get("ladder") or {}).get("step_ms") or {}
    table = {int(b): ms for b, ms in ladder.items() if ms is not None}
    return table if on_gpu and 1 in table and len(table) > 1 else None


def padded_excess_ms(table: dict[int, float], batch: int) -> float:
    """What a decode step of ``batch`` requests takes over one of a single request: the ladder's
    step at the CUDA graph's padded size (``BATCH_SIZES``), linear between the measured sizes and
    past the largest along its last two. Over the depth-40 runs a step's time went with the padded
    size, not the batch (docs/planner.md, "The GPU-held P fit out of sample")."""
    size = next((b for b in BATCH_SIZES if b >= batch), batch)
    ms = table[size] if size in table else interp(list(table.items()), size)
    return max(0.0, ms - table[1])


def _d_first_steps(cfg: ModelConfig, mode: str, n: int, semantics: str, budget: int) -> tuple[int, int]:
    """(rows, steps) D runs for a lone request before its first token comes out, chunked as the
    scheduler chunks them (per phase, at most ``budget`` rows a step)."""
    if mode == "colocated":
        phases = modes.colocated_phases(cfg, n, semantics)
    else:
        phases = modes.decode_plan(cfg, n, mode).phases
    rows = sum(p.hi - p.lo for p in phases)
    return rows, sum(-(-(p.hi - p.lo) // budget) for p in phases)


def _steps_and_rows(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(per step, per row) with time = steps * a + rows * b: where every probe ran the same number
    of steps, a line in rows (its intercept shared out over the steps), else least squares."""
    ks = {k for k, _, _ in points}
    if len(ks) == 1:
        intercept, slope = _line([(rows, y) for _, rows, y in points])
        return intercept / ks.pop(), slope
    skk = sum(k * k for k, _, _ in points)
    srr = sum(r * r for _, r, _ in points)
    skr = sum(k * r for k, r, _ in points)
    sky = sum(k * y for k, _, y in points)
    sry = sum(r * y for _, r, y in points)
    det = skk * srr - skr * skr
    if det == 0:
        return 0.0, max(0.0, sry / srr)
    a, b = (sky * srr - sry * skr) / det, (sry * skk - sky * skr) / det
    if b < 0:  # rows cost nothing measurable: all of it per step, refitted
        return max(0.0, sky / skk), 0.0
    if a < 0:
        return 0.0, sry / srr
    return a, b


def first_out_at_launch(cfg: ModelConfig, mode: str, on_gpu: bool = True) -> bool:
    """D's first steps sample nothing (a symmetric D replays rows whose first token P sampled): the
    engine sends P's token when it launches them and their GPU time lands in the first token gap
    (lone decode_first_step_s is a few ms, the first gap a replay plus a decode step). On a CPU
    (``on_gpu`` False) a step computes before it answers."""
    if mode == "colocated" or not on_gpu:
        return False
    phases = modes.decode_plan(cfg, 2 * cfg.window_size, mode).phases
    return bool(phases) and not any(p.sample for p in phases)


def _lone_first_points(
    cfg: ModelConfig, mode: str, cal: dict[str, Any], semantics: str, d_budget: int, d_step_ms: float, on_gpu: bool
) -> list[tuple[int, int, float]]:
    """(steps, rows, ms) of each lone request's first token: prompt-only steps of D's own. Where
    they sample nothing (``first_out_at_launch``) they are the first gap less one decode step
    (``d_step_ms``), else the time from D's add to the first token."""
    at_launch = first_out_at_launch(cfg, mode, on_gpu)
    out = []
    for r in cal["lone"]:
        rows, steps = _d_first_steps(cfg, mode, r["prompt_len"], semantics, d_budget)
        first = r["timings"].get("decode_first_step_s")
        if at_launch:
            first = r["gaps_s"][0] - d_step_ms / 1e3 if r["gaps_s"] else None
        if rows and first is not None:
            out.append((steps, rows, first * 1e3))
    return out


def fit_steps(
    cfg: ModelConfig,
    mode: str,
    cal: dict[str, Any],
    d_budget: int,
    semantics: str,
    p_budget: int = 16384,
    on_gpu: bool = True,
    shared_gpu: bool = False,
    d_share: float = 0.5,
    window_steps: int | None = None,
) -> MeasuredSteps:
    """Step times from the calibration of one deployment (see bench/e2e.py ``calibrate``; P's
    from the co-run's steps at most partly beside D, where it logged two sizes or more: ``fit_p_step``);
    ``on_gpu``: the result ran on a GPU (``first_out_at_launch``); ``shared_gpu``: P computed the
    batch on D's GPU (the batch's gaps are read at D's alone speed where P shared it, D then
    running at ``d_share`` of the GPU: ``Deployment.d_share``); ``window_steps``: P ran its window
    chunks alone, at most that many a step (``fit_p_step``)."""
    lone = cal["lone"]
    gaps = [g for r in lone for g in r["gaps_s"][1:]]  # the first gap can hold a replay or a flush
    d_step = _median(gaps) * 1e3
    batch = cal["batch"]
    steady = [g for r in batch["requests"] for g in r["gaps_s"][2:]]
    d_seq = max(0.0, (_median(steady) * 1e3 - d_step) / max(batch["size"] - 1, 1)) if steady else 0.0
    d_seq = _decode_seq_ms(
        cal, d_step, d_seq, mode != "colocated", shared_gpu, first_out_at_launch(cfg, mode, on_gpu), d_share
    )
    d_pre, d_row = _fixed_or_line(_lone_first_points(cfg, mode, cal, semantics, d_budget, d_step, on_gpu))
    p_step, p_row, p_fit = fit_p_step(cfg, mode, cal, p_budget, on_gpu, window_steps)
    move_points = [
        (r["prompt_len"], r["timings"]["transfer_s"] * 1e3)
        for r in lone
        if mode != "colocated" and r["timings"].get("transfer_s") is not None
    ]
    move, move_row = _line(move_points) if move_points else (0.0, 0.0)
    move_beside = fetch_beside_p_ms(cal) if mode != "colocated" else None
    handoff = [
        (r["timings"]["prefill_rtt_s"] - r["timings"]["prefill_s"]) * 1e3
        for r in lone
        if r["timings"].get("prefill_rtt_s") is not None and r["timings"].get("prefill_s") is not None
    ]
    # P's line timed to its steps' GPU end holds the GPU tail that the lone answers hold too
    tail = p_gpu_tail_ms(cal) if p_fit is not None and "timed" in p_fit else 0.0
    handoff_ms = max(0.0, _median(handoff) - tail)
    return MeasuredSteps(
        p_step,
        p_row,
        d_step,
        d_seq,
        d_row,
        move,
        move_row,
        handoff_ms,
        d_pre_ms=d_pre,
        move_beside_p_ms=move_beside,
        d_ladder_ms=decode_ladder_ms(cal, on_gpu),
        p_window_ms={int(k): ms for k, (_, ms) in p_fit["windows"].items()} if p_fit and "windows" in p_fit else None,
    )


def _steps_json(steps: MeasuredSteps) -> dict[str, Any]:
    """``steps`` as the validation records them (the ladder only where the result measured one, P's
    host part only where the shares took one)."""
    out = asdict(steps)
    for key in ("d_ladder_ms", "p_window_ms"):  # only where the result measured them
        if out[key] is None:
            del out[key]
    if not out["p_host_ms"]:
        del out["p_host_ms"]
    return out


def fetch_beside_p_ms(cal: dict[str, Any]) -> float | None:
    """D's fetch of a prefix while P computes the next prompts, in ms: the median ``transfer_s``
    of the co-run's fill bursts (bench/e2e.py: load-sized prompts sent at once, twice, P's steps
    running while D fetches the prompts finished before them). On a GPU both share, D's unpack
    kernels wait for P's: in the rate runs of oos6-oos8 a fetch overlapping a P step took 19-599
    ms, one with P idle 7-263 ms, mostly under 90 (the lone line's 8-17 ms at these lengths;
    docs/planner.md, "oos8"). None for a result whose co-run kept no fill timings (before 2ab3336)."""
    timings = ((cal.get("co_run") or {}).get("fill") or {}).get("timings") or {}
    fetches = [t["transfer_s"] * 1e3 for phase in timings.values() for t in phase if t.get("transfer_s") is not None]
    return _median(fetches) if fetches else None


def _lone_p_points(cfg: ModelConfig, mode: str, cal: dict[str, Any], p_budget: int) -> list[tuple[int, int, float]]:
    """(steps, rows, ms) of P's compute for each lone request (``prefill_s``), split as P splits it."""
    out = []
    for r in cal["lone"] if mode != "colocated" else []:
        phases = modes.prefill_plan(cfg, r["prompt_len"], mode).phases
        rows = sum(p.hi - p.lo for p in phases)
        if r["timings"].get("prefill_s") is not None and rows > 0:
            steps = sum(-(-(p.hi - p.lo) // p_budget) for p in phases)
            out.append((steps, rows, r["timings"]["prefill_s"] * 1e3))
    return out


P_FIT_CO_RUN = "co-run steps"
P_FIT_LONE = "lone requests"


def gpu_tail_s(timings: dict[str, Any]) -> float | None:
    """One request's P GPU work after its step returned to the host: the wait from the step's end
    to its export's copy, less the copy (``export_s - export_copy_s``; None without ``export_s``).
    An asymmetric or encoder-only P samples nothing and does not wait for its kernels; a symmetric
    P waits for its token, and its tail is ~0."""
    if timings.get("export_s") is None:
        return None
    return max(0.0, timings["export_s"] - (timings.get("export_copy_s") or 0.0))


def p_gpu_tail_ms(cal: dict[str, Any]) -> float:
    """P's GPU tail on the lone requests (``gpu_tail_s``), median ms."""
    tails = [x * 1e3 for r in cal["lone"] if (x := gpu_tail_s(r.get("timings") or {})) is not None]
    return _median(tails)


def _p_log_timed(cal: dict[str, Any], on_gpu: bool) -> bool:
    """Whether P's co-run steps are read as the GPU held them: on a GPU, every step timed to its
    GPU end (``step_log.timed_to_gpu_end``)."""
    log = ((cal.get("co_run") or {}).get("steps") or {}).get("prefill")
    return on_gpu and log is not None and timed_to_gpu_end(log)


def co_run_p_points(cal: dict[str, Any], on_gpu: bool = True) -> list[tuple[int, float, float]] | None:
    """(prompt rows, ms priced alone, fraction D covered) of every P step of the calibration's
    co-run that D's steps covered less than ``P_FIT_MAX_OVERLAP`` of (``step_log.p_fit_steps``);
    None for a result without the co-run's step log (older ones, colocated modes). On a GPU, steps
    timed to their GPU end are read as the GPU held them (``step_log.gpu_held``)."""
    log = ((cal.get("co_run") or {}).get("steps") or {}).get("prefill")
    if log is None:
        return None
    d = cal["co_run"]["steps"].get("decode") or []
    if _p_log_timed(cal, on_gpu):  # the GPU time P's steps held, not their host time
        log = gpu_held(log)
    return [(rows, s * 1e3, f) for rows, s, f in p_fit_steps(log, d)]


def fit_p_step(
    cfg: ModelConfig,
    mode: str,
    cal: dict[str, Any],
    p_budget: int = 16384,
    on_gpu: bool = True,
    window_steps: int | None = None,
) -> tuple[float, float, dict[str, Any] | None]:
    """P's step cost (fixed ms, ms per prompt row) and where it came from. Under load P runs
    multi-prompt steps of 1-16K rows, longer per row than the line through the lone requests (one
    prompt a step, two lengths; docs/planner.md, "P's step from the calibration's alone steps").
    So where the co-run's log has P steps at two or more row counts that D's steps covered less
    than ``P_FIT_MAX_OVERLAP`` of (its fill phase's burst: load-sized steps, up to P's budget), the
    line is a least-squares fit through them (``_line``, each step one point, ``stalls`` left
    out), a step partly beside D priced as if alone by equal shares
    (``step_log.alone_priced``; docs/planner.md, "oos5 and oos6"); otherwise the lone requests'
    fit. The record (None without a co-run step log, so older validations keep their bytes):
    ``source``, ``steps`` and ``rows`` [min, max] of the points fitted, ``beside_d`` (how many of
    them D partly covered), ``stalls`` ([rows, ms] of the steps dropped as stalls) and ``lone_ms``
    (the lone requests' line). ``window_steps``: the P ran its window chunks alone, at most that
    many a step (``SchedulerConfig.one_depth_per_step``: a symmetric P's CUDA graphs since
    4f99bfc); its steps of k x W rows, k up to that many, are then such steps and are not on the
    line: the record's ``windows`` holds their median by k ([steps, ms]), ``MeasuredSteps.p_window_ms``
    prices them. In headline4's co-runs one window alone held the GPU 85-101 ms and four 224-353
    ms, where the line through every step gave 162 and 196 ms (its intercept 151 ms, 135 without
    them), and the simulated P was 1.30-1.37x busier than measured (docs/planner.md, "A symmetric
    P's window steps")."""
    lone_points = _lone_p_points(cfg, mode, cal, p_budget)
    lone = _steps_and_rows(lone_points) if lone_points else (0.0, 0.0)
    points = co_run_p_points(cal, on_gpu) if mode != "colocated" else None
    if points is None:
        return lone[0], lone[1], None
    windows: dict[int, list[float]] = {}
    if window_steps:
        w, line = cfg.window_size, []
        for pt in points:
            k, extra = divmod(pt[0], w)
            if not extra and k <= window_steps:
                windows.setdefault(k, []).append(pt[1])
            else:
                line.append(pt)
        points = line
    if len({rows for rows, _, _ in points}) >= 2:
        stalled = stalls([(float(rows), ms) for rows, ms, _ in points])
        points = [pt for pt in points if (float(pt[0]), pt[1]) not in stalled]
        (p_step, p_row), source = _line([(float(rows), ms) for rows, ms, _ in points]), P_FIT_CO_RUN
        rows = [r for r, _, _ in points]
        beside = sum(f > 0 for _, _, f in points)
    else:
        (p_step, p_row), source = lone, P_FIT_LONE
        rows = [r for _, r, _ in lone_points]
        beside, stalled = 0, []
    record = {
        "source": source,
        "steps": len(rows),
        "rows": [min(rows), max(rows)] if rows else [],
        "beside_d": beside,
        "stalls": [[int(r), ms] for r, ms in stalled],
        "lone_ms": list(lone),
    }
    if windows:
        record["windows"] = {str(k): [len(v), statistics.median(v)] for k, v in sorted(windows.items())}
    if source == P_FIT_CO_RUN and _p_log_timed(cal, on_gpu):
        record["timed"] = "to the GPU end"  # and P's answer starts there (``p_gpu_tail_ms``)
    return p_step, p_row, record


def window_step_ms(table: dict[int, float], windows: int) -> float:
    """A step of ``windows`` window chunks from the measured steps of k chunks: the measured
    median where there is one, else linear between (and past) the nearest sizes, in proportion to
    the one size measured where there is only one."""
    if windows in table:
        return table[windows]
    if len(table) == 1:
        ((k, ms),) = table.items()
        return ms * windows / k
    return max(0.0, interp(list(table.items()), windows))


def _decode_seq_ms(
    cal: dict[str, Any],
    d_step: float,
    fallback: float,
    pd: bool,
    shared_gpu: bool,
    first_at_start: bool,
    d_share: float = 0.5,
) -> float:
    """D's cost per further request in a decode step, read at the batch that was decoding: a line
    through (requests decoding through the gap, gap) over the calibration batch's decode-only gaps
    (no first token inside, no request in the TTFT path: a gap with none of the serving path's
    host work or prompt rows in it), anchored at the lone step at batch 1 (least squares of the
    excess over it against the further requests). Not the batch's size: its
    requests make few tokens (6) and their first tokens come out over a second, so its steady gaps
    run at 3-6 requests, not 8 (true depth, asymmetric: 43 ms at 3-4, 51 at 5, 56 at 6 against a
    lone 32.4 ms; per further request 4.6 ms, where the size read gave 2.7). One step is seen in
    the gap of every request decoding through it, so each batch size gives its median (a stalled
    step counts once, as one step). A colocated prompt runs in several steps of at most the
    admission budget and only the last one gives a first token, so a gap with no first token
    inside can still hold a whole prompt step: for colocated workers the batch's later gaps
    (``gaps_s[2:]``, the old P/D rule) were mostly such gaps, and this rule was theirs first.
    ``shared_gpu``: a gap read at D's alone speed where P computed the batch beside it. None such:
    ``fallback``."""
    rows = batch_rows(cal, pd)
    by_batch: dict[int, list[float]] = {}
    for g in batch_gaps(rows, p_busy_until(rows, shared_gpu) if pd else 0.0, first_at_start):
        if g.in_path == 0 and not g.firsts:
            by_batch.setdefault(g.batch, []).append(g.alone_ms(d_share))
    points = [(b - 1, _median(ms) - d_step) for b, ms in by_batch.items() if b > 1]
    if not points:
        return fallback
    # the model is d_step + d_seq x (batch - 1) with d_step the lone step's: the line is anchored there
    return max(0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points))


def _fixed_or_line(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(per step, per row) for ``_steps_and_rows`` points; one row count: all of it per step."""
    if len({rows for _, rows, _ in points}) == 1:
        return _median([y / k for k, _, y in points]), 0.0
    return _steps_and_rows(points) if points else (0.0, 0.0)


def fit_admission_steps(
    cfg: ModelConfig,
    cal: dict[str, Any],
    steps: MeasuredSteps,
    load: StageLoad,
    dep: Deployment,
    d_budget: int,
    on_gpu: bool = True,
) -> MeasuredSteps:
    """D's steps that take prompt rows. Prompt-only steps come from the co-run's step log where
    it has them at two row counts or more (``co_run_d_prompt_line``). Otherwise, and for mixed
    steps, they come from the calibration batch: a decoding request's token gap in which other
    requests got their first token held their prompt rows. With mixed steps that gap is one mixed
    step: the median step's cost over the decode path (``mix_pre_ms``; at most 4 x W rows, and
    the batch's first admission step is an outlier a row fit would follow). Without (alone-4) it
    is a prompt-only step followed by a decode step: the prompt-only step's cost joins the lone
    first steps' fit (``d_pre_ms``, ``d_row_ms``) as the median per row count. The decode
    path and its host time per request in the TTFT path are the fitted ones; ``shared_gpu``: the
    gaps are read at D's alone speed where P's steps shared the GPU (the simulator shares it
    again). Nothing here reads the rate runs."""
    mode, semantics, policy = dep.mode, dep.colocated_semantics, dep.policy
    logged = co_run_d_prompt_line(cal)  # D's prompt-only steps as its own step log timed them
    if logged is not None:
        steps = replace(steps, d_pre_ms=logged[0], d_row_ms=logged[1])
    rows = batch_rows(cal, dep.pd)
    by_step: dict[tuple[int, ...], list[float]] = {}  # one step, seen in each decoding request's gap
    for g in batch_gaps(rows, p_busy_until(rows, dep.shared_gpu), first_out_at_launch(cfg, mode, on_gpu)):
        if g.firsts:
            excess = g.alone_ms(dep.d_share) - steps.decode_ms(g.batch, 0, 1) - load.step_extra_ms(g.in_path)
            by_step.setdefault(g.firsts, []).append(excess)
    points = []
    for firsts, excess in by_step.items():
        admitted = sum(_d_first_steps(cfg, mode, rows[i][0]["prompt_len"], semantics, d_budget)[0] for i in firsts)
        if admitted:
            points.append((1, min(admitted, d_budget), _median(excess)))
    if not points:
        return steps
    if policy.mixed_steps:  # the median step: the batch's first admission step can carry start-up costs
        return replace(steps, mix_pre_ms=_median([y for _, _, y in points]), mix_row_ms=0.0)
    if logged is not None:
        return steps
    both = _lone_first_points(cfg, mode, cal, semantics, d_budget, steps.d_step_ms, on_gpu) + points
    by_rows: dict[tuple[int, int], list[float]] = {}
    for k, r, y in both:
        by_rows.setdefault((k, r), []).append(y)
    d_pre, d_row = _fixed_or_line([(k, r, _median(ys)) for (k, r), ys in by_rows.items()])
    return replace(steps, d_pre_ms=d_pre, d_row_ms=d_row)


def co_run_d_prompt_line(cal: dict[str, Any]) -> tuple[float, float] | None:
    """D's prompt-only step (fixed ms, ms per row) from the co-run's own step log: the line through
    its prompt-only steps with P idle (``step_log.d_prompt_alone_steps``; the fill phase gives
    128-512 rows), stalls left out (``stalls``). Measured, where the calibration batch's gaps only
    infer it: in oos10 one inferred 256-row step cost 499 ms over the decode path, the logged
    ones 134-160 ms (docs/planner.md, "oos10"). None without the log or with one row count."""
    log = (cal.get("co_run") or {}).get("steps") or {}
    if not log.get("decode") or log.get("prefill") is None:
        return None
    points = [(float(r), s * 1e3) for r, s in d_prompt_alone_steps(log["decode"], log["prefill"])]
    if len({x for x, _ in points}) < 2:
        return None
    stalled = stalls(points)
    return _line([pt for pt in points if pt not in stalled])


@dataclass
class _LoadedSteps:
    """D's steps with the host time that the requests in the TTFT path take from each decode step
    (``extra_ms()``, read when the engine issues the step)."""

    base: MeasuredSteps
    extra_ms: Callable[[], float]

    def decode_ms(self, batch: int, prefill_rows: int, gpus: int) -> float:
        return self.base.decode_ms(batch, prefill_rows, gpus) + (self.extra_ms() if batch else 0.0)


def _decoder(
    cfg: ModelConfig,
    steps: MeasuredSteps,
    dep: Deployment,
    arr: list[Arrival],
    expected: list[Arrival] | None = None,
    outputs_at_launch: bool = True,
) -> DecodeEngine:
    """A D (or colocated) worker as the e2e study runs it: no speculative decoding, the default
    scheduler limits, the result's admission policy (mixed steps or not), P's first token sent
    with D's first output for the request (lone decode_first_step_s is one step, not 0)."""
    from asympd.engine.scheduler import SchedulerConfig

    sc = SchedulerConfig()
    setup = DecodeSetup(
        dep.mode,
        max_num_seqs=sc.max_num_seqs,
        policy=dep.policy,
        seed=dep.seed,
        num_spec=0,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        colocated_semantics=dep.colocated_semantics,
        first_token_with_first_step=True,
        outputs_at_launch=outputs_at_launch,
    )
    return DecodeEngine(cfg, steps, setup, arr, expected=expected)


@dataclass
class Simulated:
    ttft_s: dict[int, float]
    gaps_s: dict[int, list[float]]
    done_s: dict[int, float]
    step_s: dict[str, dict[str, float]] = field(default_factory=dict)  # role: {"compute", "wall"} seconds
    p_queue_s: dict[int, float] = field(default_factory=dict)  # P/D: arrival to P's first step for it
    p_steps: list[tuple[float, float, int]] = field(default_factory=list)  # P/D: P's (issue, end, rows)


def simulate_deployment(
    cfg: ModelConfig,
    steps: MeasuredSteps,
    arrivals: list[Arrival],
    dep: Deployment,
    path: ServingPath,
    load: StageLoad | None = None,
) -> Simulated:
    """The planner's simulator on one measured deployment (``dep``), the workers' default
    scheduler limits; ``dep.shared_gpu``: their steps share one GPU (``run_engines``).
    ``load``: the CPU-side stages' cost per further request in the TTFT path (serving_load.py);
    P's answer, D's fetch and the HTTP hops run beside each other, each at its cost for the
    requests in that path when it starts. ``path.handoff_on_p_stream``: P's answer and the fetch
    wait for P's steps (on a GPU they seal and pack the prefix on P's stream; a CPU has none)."""
    from asympd.engine.scheduler import SchedulerConfig

    mode, replicas, shared_gpu = dep.mode, dep.replicas, dep.shared_gpu
    handoff_on_p_stream = path.handoff_on_p_stream
    load = load or StageLoad()
    hops_n: dict[int, int] = {}  # requests in the TTFT path when the router sends each to D
    if mode == "colocated":
        engines = [_decoder(cfg, steps, dep, arrivals[r::replicas]) for r in range(replicas)]
        run_engines(engines, [0 if shared_gpu else r for r in range(replicas)])
        runs = [e.run for e in engines]
        roles = {"colocated": runs}
        first = {i: t for run in runs for i, t in run.first_token_s.items()}
        spans = [(a.time_s, first.get(a.index)) for a in arrivals]
        hops_n = {a.index: in_path(a.time_s, spans) for a in arrivals}
    else:
        sc = SchedulerConfig()
        p_setup = PrefillSetup(
            mode,
            max_num_seqs=sc.max_num_seqs,
            step_tokens=dep.p_step_tokens,
            one_depth_per_step=dep.p_one_depth,
            max_deepest_chunks=dep.p_deepest_chunks,
        )
        p = PrefillEngine(cfg, steps, p_setup, arrivals)
        d = _decoder(cfg, steps, dep, [], arrivals, path.outputs_at_launch)
        by_index = {a.index: a for a in arrivals}

        def n_at(t: float) -> int:
            return in_path(t, [(a.time_s, d.run.first_token_s.get(a.index)) for a in arrivals])

        def to_d(_: int, i: int, t: float) -> None:
            """P's answer, then the router's hop to D and D's fetch, each at its cost for the
            requests in the TTFT path when it starts. Both seal or pack the prefix with kernels on
            P's stream, so each progresses only while P has no step in progress, sharing the
            stream with the other hand-offs in progress (``SideTask``)."""
            a = by_index[i]

            def fetch(t: float) -> None:
                hops_n[i] = n = n_at(t)
                cost = (steps.move_for(a.prompt_len) + load.extra_ms("fetch", n)) / 1e3
                if steps.move_beside_p_ms is not None and shared_gpu and not handoff_on_p_stream:
                    nxt = p.next_issue()  # P's next step: already running, or when its next prompt arrives
                    if nxt is not None and nxt < t + cost:  # P computes on the GPU while D unpacks
                        cost = steps.move_beside_p_ms / 1e3
                if handoff_on_p_stream:
                    p.hold(SideTask(cost, lambda t: d.push(Arrival(i, t, a.prompt_len, a.output_len))))
                else:
                    d.push(Arrival(i, t + cost, a.prompt_len, a.output_len))

            answer = SideTask((steps.handoff_ms + load.extra_ms("answer", n_at(t))) / 1e3, fetch)
            if handoff_on_p_stream:
                p.hold(answer)
            else:  # beside P's steps, at their own cost
                fetch(t + answer.left)

        if load.d_step_ms:
            d.steps = _LoadedSteps(steps, lambda: load.step_extra_ms(n_at(d.t)))
        run_engines(
            [p, d],
            [0, 0] if shared_gpu else [0, 1],
            to_d,
            {0: dep.p_share_at if dep.p_by_rows else dep.p_share, 1: dep.d_share},
        )
        runs = [d.run]
        roles = {"prefill": [p.run], "decode": [d.run]}
    start = {a.index: a.time_s for a in arrivals}
    out = Simulated({}, {a.index: [] for a in arrivals}, {})
    if "prefill" in roles:
        out.p_queue_s = {i: t - start[i] for i, t in roles["prefill"][0].scheduled_s.items()}
        out.p_steps = roles["prefill"][0].step_log
    out.step_s = {
        role: {"compute": sum(r.busy_s for r in rs), "wall": sum(r.wall_s for r in rs)} for role, rs in roles.items()
    }
    for run in runs:
        for i, t in run.first_token_s.items():
            out.ttft_s[i] = t - start[i] + (steps.ttft_offset_ms + load.extra_ms("hops", hops_n.get(i, 1))) / 1e3
        for g, i in zip(run.itl_s, run.itl_request, strict=True):
            out.gaps_s[i].append(g)
        out.done_s.update(run.done_s)
    return out


def _ttft_offset(cal: dict[str, Any], at_launch: bool = False) -> float:
    """What no engine step holds, measured directly on the lone requests: client TTFT minus the
    servers' own parts (P's round trip as the router saw it, D's fetch, D's add to first token),
    i.e. the client -> router -> D hops and the first chunk's way back. The median, in ms.
    ``at_launch`` (``first_out_at_launch``): D's add to first token is host time before any
    step's end, which the simulator does not hold either, so it stays in the offset."""
    resid = []
    for r in cal["lone"]:
        t = r.get("timings") or {}
        if r.get("ttft_s") is None or t.get("decode_first_step_s") is None:
            continue
        first = 0.0 if at_launch else t["decode_first_step_s"]
        server = (t.get("prefill_rtt_s") or 0.0) + (t.get("transfer_s") or 0.0) + first
        resid.append(r["ttft_s"] - server)
    return _median(resid) * 1e3


@dataclass(frozen=True)
class _Study:
    """What every mode of one e2e result shares: the model, the SLO, D's admission budget, the
    device, and whether the CPU-side stages are priced under load."""

    cfg: ModelConfig
    slo: dict[str, float]
    d_budget: int
    on_gpu: bool  # a GPU: a D step that samples nothing answers at launch
    serving_load: bool = True
    # P's hand-off (the seal, the fetch) packed on P's compute stream, so it advanced only between P's
    # steps: every GPU result before P packed on a stream of its own (the result's ``handoff_stream``);
    # as simulated, and as the calibration ran it (what the serving-load slopes are read with)
    handoff_on_p_stream: bool = False
    measured_on_p_stream: bool = False
    shares: str = "equal"  # a shared GPU's split: one of ``SHARES``
    trace: bool = False  # each row with P's steps, simulated and measured (``validate_e2e``)


def _batch_check(
    cfg: ModelConfig,
    steps: MeasuredSteps,
    m: dict[str, Any],
    dep: Deployment,
    path: ServingPath,
    load: StageLoad | None,
) -> dict:
    """Not fitted, for reading a miss: the calibration batch (every request sent at once)
    simulated, against its client TTFT; and the servers' own parts, lone vs in the batch
    (medians, ms): what a burst does to each."""
    cal = m["calibration"]
    reqs = cal["batch"].get("requests") or []
    if not reqs or any("prompt_len" not in r for r in reqs):
        return {}
    arr = [
        Arrival(i, 0.0, r["prompt_len"], (r.get("usage") or {}).get("completion_tokens") or len(r["gaps_s"]) + 1)
        for i, r in enumerate(reqs)
    ]
    sim = simulate_deployment(cfg, steps, arr, dep, path, load)
    mode = dep.mode

    def parts(rs: list[dict[str, Any]]) -> dict[str, float]:
        t = [r.get("timings") or {} for r in rs]
        out = {"decode_first_step": _median([x["decode_first_step_s"] * 1e3 for x in t if "decode_first_step_s" in x])}
        if mode != "colocated":
            out["prefill"] = _median([x["prefill_s"] * 1e3 for x in t if x.get("prefill_s") is not None])
            out["p_answer"] = _median(
                [(x["prefill_rtt_s"] - x["prefill_s"]) * 1e3 for x in t if x.get("prefill_rtt_s") is not None]
            )
            out["transfer"] = _median([x["transfer_s"] * 1e3 for x in t if x.get("transfer_s") is not None])
        return out

    return {
        "ttft_p50_ms": {
            "measured": _median([r["ttft_s"] * 1e3 for r in reqs if r.get("ttft_s") is not None]),
            "predicted": _median([t * 1e3 for t in sim.ttft_s.values()]),
        },
        "server_parts_p50_ms": {"lone": parts(cal["lone"]), "batch": parts(reqs)},
    }


def co_run_stretch(cal: dict[str, Any], dep: Deployment) -> tuple[float, float] | None:
    """P's and D's measured stretch beside each other (the calibration's ``co_run``, bench/e2e.py),
    for a P/D deployment on one shared GPU. A side the co-run could not read (no step pair) keeps
    the equal share's 2; a stretch below 1 (noise: a step is not faster beside another) reads as 1.
    None (equal shares, the model before the co-run) when the result has no co-run or neither side
    was read."""
    c = cal.get("co_run") or {}
    if not (dep.pd and dep.shared_gpu) or "p" not in c:
        return None
    p, d = c["p"].get("stretch"), c["d"].get("stretch")
    if p is None and d is None:
        return None
    return (max(1.0, p) if p is not None else 2.0, max(1.0, d) if d is not None else 2.0)


def co_run_p_by_rows(cal: dict[str, Any], dep: Deployment) -> tuple[tuple[int, float], ...] | None:
    """P's measured stretch per step size (the co-run's ``p`` ``stretch_by_key``: prompt rows ->
    stretch, below 1 read as 1), by rows, for ``Deployment.p_share_at``; None (``co_run_stretch``'s
    one value at every size) for a result with fewer than two sizes or none (the co-run before its
    fill phase) or where the co-run does not apply."""
    if co_run_stretch(cal, dep) is None:
        return None
    by = cal["co_run"]["p"].get("stretch_by_key") or {}
    if len(by) < 2:
        return None
    return tuple(sorted((int(k), max(1.0, v)) for k, v in by.items()))


def _validate_mode(out: dict[str, Any], m: dict[str, Any], dep: Deployment, study: _Study) -> None:
    """One mode's rows (and fitted steps) into ``out``."""
    mode, cfg, gpu = dep.mode, study.cfg, study.on_gpu
    if "calibration" not in m or not m.get("runs"):
        out["modes"][mode] = {"skipped": (m.get("error") or m.get("skipped") or "no calibration or runs")[-300:]}
        return
    dep = replace(dep, replicas=sum(1 for w in m["workers"].values() if w["role"] == "colocated") or 1)
    path = ServingPath(
        handoff_on_p_stream=study.handoff_on_p_stream,
        outputs_at_launch=gpu,
        first_at_start=first_out_at_launch(cfg, mode, gpu),
    )
    as_measured = replace(path, handoff_on_p_stream=study.measured_on_p_stream)  # how the calibration ran
    cal = m["calibration"]
    measured = co_run_stretch(cal, dep)
    if study.shares == "co-run":
        dep = replace(dep, co_run=measured, p_by_rows=co_run_p_by_rows(cal, dep))
    windows = dep.p_deepest_chunks if dep.p_one_depth else None
    steps = fit_steps(
        cfg,
        mode,
        cal,
        study.d_budget,
        dep.colocated_semantics,
        dep.p_step_tokens,
        gpu,
        dep.shared_gpu,
        dep.d_share,
        windows,
    )
    steps.ttft_offset_ms = _ttft_offset(cal, path.first_at_start)
    if study.shares == "host-split" and dep.shared_gpu:
        steps.p_host_ms = steps.p_step_ms
    p_fit = fit_p_step(cfg, mode, cal, dep.p_step_tokens, gpu, windows)[2]
    load = None
    if study.serving_load:
        lone = LoneCosts(steps.handoff_ms, steps.move_for, steps.ttft_offset_ms, lambda b: steps.decode_ms(b, 0, 1))
        load = fit_stage_load(cal, lone, dep, as_measured)
    steps = fit_admission_steps(cfg, cal, steps, load or StageLoad(), dep, study.d_budget, gpu)
    out["modes"][mode] = {
        **({"co_run_stretch": {"p": dep.co_run[0], "d": dep.co_run[1]}} if dep.co_run else {}),
        **({"co_run_measured": {"p": measured[0], "d": measured[1]}} if measured and not dep.co_run else {}),
        **({"co_run_p_by_rows": [list(x) for x in dep.p_by_rows]} if dep.p_by_rows else {}),
        "steps_ms": _steps_json(steps),
        **({"p_fit": p_fit} if p_fit else {}),
        "serving_load_ms": asdict(load or StageLoad()),
        "batch_check": _batch_check(cfg, steps, m, dep, as_measured, load),
    }
    slo = study.slo
    for run in m["runs"]:
        req = run["requests"]
        ok = [i for i, e in enumerate(req["errors"]) if not e]
        arrivals = [Arrival(i, req["start_times"][i], req["input_lens"][i], req["output_lens"][i]) for i in ok]
        sim = simulate_deployment(cfg, steps, arrivals, dep, path, load)
        ttft = [sim.ttft_s[i] for i in ok if i in sim.ttft_s]
        itl = [g for i in ok for g in sim.gaps_s[i]]
        good = [
            i
            for i in ok
            if i in sim.ttft_s
            and sim.ttft_s[i] * 1e3 <= slo["ttft_ms"]
            and max(sim.gaps_s[i], default=0.0) * 1e3 <= slo["itl_ms"]
        ]
        duration = max(sim.done_s.values(), default=0.0) + steps.ttft_offset_ms / 1e3
        predicted = {
            "ttft_p50_ms": _median(ttft) * 1e3,
            "itl_p50_ms": _median(itl) * 1e3,
            "goodput_req_s": len(good) / duration if duration > 0 else 0.0,
        }
        measured = {
            "ttft_p50_ms": run["median_ttft_ms"],
            "itl_p50_ms": run["median_itl_ms"],
            "goodput_req_s": run["request_goodput"] or 0.0,
        }
        ratio = {k: predicted[k] / measured[k] if measured[k] else math.nan for k in predicted}
        # not validated, for reading a miss: the engines' step seconds (their step-duration counters)
        # (to their GPU end where the workers counted it: bench/e2e.py ``*_busy_with_gpu_s``)
        steps_s = {
            role: {**s, "measured": run.get(f"{role}_busy_with_gpu_s", run.get(f"{role}_busy_s"))}
            for role, s in sim.step_s.items()
        }
        # not validated either: P's queue, where the servers reported it (``prefill_queue_s``, results
        # since the thirtieth session), against the simulated P's
        timings = req.get("asympd_timings") or []
        queued = [
            i
            for i in ok
            if i in sim.p_queue_s and i < len(timings) and (timings[i] or {}).get("prefill_queue_s") is not None
        ]
        p_queue = (
            {
                "measured": _median([timings[i]["prefill_queue_s"] for i in queued]) * 1e3,
                "predicted": _median([sim.p_queue_s[i] for i in queued]) * 1e3,
            }
            if queued
            else None
        )
        out["rows"].append(
            {
                "mode": mode,
                "rate": run["request_rate"],
                "requests": len(ok),
                "measured": measured,
                "predicted": predicted,
                "ratio": ratio,
                "within_target": all(abs(r - 1) <= TARGET for r in ratio.values()),
                "engine_step_s": steps_s,
                # steps that compiled or captured while the rate ran (a stall each, not modelled),
                # by role, where the result records them
                **({"new_shape_steps": run["new_shape_steps"]} if "new_shape_steps" in run else {}),
                **({"p_queue_p50_ms": p_queue} if p_queue else {}),
                **({"p_steps": _p_steps(sim, run, arrivals)} if study.trace and sim.p_steps else {}),
            }
        )


def _p_steps(sim: Simulated, run: dict[str, Any], arrivals: list[Arrival]) -> dict[str, list[list[float]]]:
    """P's steps as simulated and as its step log has them, [start, seconds, prompt rows], times from
    the run's first arrival (bench/e2e.py's timeline and send times share the load's start)."""
    t0 = min(a.time_s for a in arrivals)
    logged = [s for worker in (run.get("timeline") or {}).get("steps", {}).get("prefill", []) for s in worker]
    return {
        "simulated": [[i - t0, e - i, rows] for i, e, rows in sim.p_steps],
        "measured": [[s[0] - t0, s[1], s[2]] for s in gpu_held(logged)],
    }


def parse_exclusions(specs: list[str] | None) -> dict[tuple[str, float], str]:
    """``MODE@RATE=REASON`` strings: rows to report but leave out of the within-target count."""
    out: dict[tuple[str, float], str] = {}
    for spec in specs or []:
        where, _, reason = spec.partition("=")
        mode, _, rate = where.partition("@")
        try:
            key = (mode.strip(), float(rate))
        except ValueError:
            raise ValidationError(f"bad exclusion {spec!r}: expected MODE@RATE=REASON") from None
        if not key[0] or not reason.strip():
            raise ValidationError(f"bad exclusion {spec!r}: expected MODE@RATE=REASON, with a reason")
        out[key] = reason.strip()
    return out


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counted = [r for r in rows if not r.get("excluded")]
    within = {k: sum(1 for r in counted if abs(r["ratio"][k] - 1) <= TARGET) for k in METRICS}
    return {
        "rows": len(rows),
        "counted": len(counted),
        "within": within,
        "all_three": sum(1 for r in counted if r["within_target"]),
    }


def validate_e2e(
    result: dict[str, Any],
    seed: int = 0,
    serving_load: bool = True,
    exclude: dict[tuple[str, float], str] | None = None,
    shares: str = "equal",
    handoff_stream: str | None = None,
    trace: bool = False,
) -> dict[str, Any]:
    """Predicted vs measured TTFT p50, ITL p50 and request goodput for every mode and rate of a
    ``bench/e2e.py`` result, the prediction made on the same arrivals (send times, prompt and
    output lengths as measured) with step times fitted to the result's own calibration.
    ``serving_load=False`` prices the CPU-side stages at their lone cost (for comparison).
    ``exclude``: (mode, rate) rows reported with the reason but left out of the count.
    ``shares``: how P and D split one shared GPU while both have a step in progress: ``equal``
    (the default: half each) or ``co-run`` (the calibration co-run's measured stretch, per P step
    size where measured). Out of sample on the H200, with P's lone fit, equal shares predicted
    better (all three metrics within 15 % in 5 of 12 rows against 3; docs/planner.md), so the
    measured stretch is recorded (``co_run_measured``) but applied only on request; with P fitted
    to the co-run's steps (``fit_p_step``) the six out-of-sample results' 19 rows give 12 equal,
    5 measured.
    ``handoff_stream``: where P's hand-off packs on a GPU, ``compute`` (P's compute stream: it
    advances between P's steps) or ``pack`` (a stream of its own: beside them); None: as the result
    records it (``compute`` for results made before the field), another value: what the same run
    would do with that hand-off. ``trace``: each P/D row also lists P's steps, [issue or start,
    seconds, prompt rows] from the run's first arrival, as simulated and as the P worker's step log
    has them (to its GPU end), for reading a miss step by step (``tools/p_trace.py``)."""
    if shares not in SHARES:
        raise ValidationError(f"shares must be one of {', '.join(SHARES)}, got {shares!r}")
    if handoff_stream not in (None, *HANDOFF_STREAMS):
        raise ValidationError(f"handoff_stream must be one of {', '.join(HANDOFF_STREAMS)}, got {handoff_stream!r}")
    from asympd.engine.scheduler import SchedulerConfig

    try:
        cfg = ModelConfig.from_dict(result["model"]["model_config"])
        slo = result["slo"]
        dp = result["d_policy"]
        policy = AdmissionPolicy(dp["max_new_admissions"], dp["admission_token_budget"], dp.get("mixed_steps", True))
        p_tokens, sem = result["p_step_tokens"], result["colocated_semantics"]
        modes_in = result["modes"]
    except (KeyError, TypeError) as e:
        raise ValidationError(f"not a bench/e2e.py result: missing {e}") from None
    except ValueError as e:  # ConfigError included
        raise ValidationError(f"the result's model_config is invalid: {e}") from None
    d_budget = policy.admission_token_budget or SchedulerConfig().max_num_batched_tokens
    out: dict[str, Any] = {
        "source": {k: result.get(k) for k in ("benchmark", "commit", "source_digest", "utc")},
        "device": (result.get("device") or {}).get("gpu") or "cpu",
        "model_depth": result["model"].get("depth"),
        "slo": slo,
        "d_policy": asdict(policy),
        "target": TARGET,
        "modes": {},
        "rows": [],
    }
    shared = result.get("gpus") == 1  # bench/e2e.py --gpus 1: every worker of a mode on one GPU
    out["placement"] = "shared" if shared else "separate"
    out["shares"] = shares
    on_gpu = out["device"] != "cpu"
    recorded = result.get("handoff_stream", "compute")  # results before the field: the compute stream
    handoff_stream = handoff_stream or recorded
    if "handoff_stream" in result or handoff_stream != recorded:
        out["handoff_stream"] = handoff_stream
    study = _Study(
        cfg,
        slo,
        d_budget,
        on_gpu,
        serving_load=serving_load,
        shares=shares,
        trace=trace,
        handoff_on_p_stream=on_gpu and handoff_stream == "compute",
        measured_on_p_stream=on_gpu and recorded == "compute",
    )
    for mode, m in modes_in.items():
        p_info = next((w for w in (m.get("workers") or {}).values() if w.get("role") == "prefill"), {})
        p_adm = p_info.get("admission") or {}
        dep = Deployment(
            mode,
            policy,
            p_tokens,
            sem,
            shared_gpu=shared,
            seed=seed,
            p_one_depth=bool(p_adm.get("one_depth_per_step")),
            p_deepest_chunks=p_adm.get("max_deepest_chunks"),
        )
        try:
            _validate_mode(out, m, dep, study)
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise ValidationError(f"mode {mode!r} of the result is malformed: {type(e).__name__}: {e}") from None
    exclude = dict(exclude or {})
    for row in out["rows"]:
        reason = exclude.pop((row["mode"], float(row["rate"])), None)
        if reason:
            row["excluded"] = reason
    if exclude:
        names = ", ".join(f"{m}@{r:g}" for m, r in exclude)
        raise ValidationError(f"--validate-exclude names no row of the result: {names}")
    out["summary"] = _summary(out["rows"])
    return out


def _p_fit_note(m: dict[str, Any]) -> str:
    """Where P's line came from, for a mode whose result logged the co-run's steps."""
    f = m.get("p_fit")
    if not f:
        return ""
    rows = f"{f['rows'][0]}-{f['rows'][1]} rows" if f["rows"] else "no rows"
    beside = f", {f['beside_d']} partly beside D" if f.get("beside_d") else ""
    stalled = "".join(f", a {r}-row step of {ms:.0f} ms left out as a stall" for r, ms in f.get("stalls") or [])
    timed = f", timed {f['timed']}" if f.get("timed") else ""
    windows = ", ".join(f"{k}: {ms:.0f} ms ({n})" for k, (n, ms) in (f.get("windows") or {}).items())
    windows = f"; window steps alone by windows a step {windows}" if windows else ""
    return f" ({f['source']}: {f['steps']} steps, {rows}{beside}{stalled}{timed}{windows})"


def ladder_rounds(result: dict[str, Any], **kwargs: Any) -> dict[str, Any] | None:
    """The validation once per decode-ladder round (``bench/e2e.py --ladder-rounds``), each with that
    round's medians in place of the pooled ones, so the table says which rows the calibration's own
    spread decides: one block of a size's steps read 4 ms off another run's, and that entry alone
    moved v15's count from 4 of 6 to 2 (docs/planner.md "v15"). None without two rounds recorded.
    ``kwargs``: as ``validate_e2e``."""
    rounds = 0
    for m in result.get("modes", {}).values():
        by = ((m.get("calibration") or {}).get("ladder") or {}).get("step_ms_by_round") or {}
        rounds = max([rounds, *(len(v) for v in by.values())])
    if rounds < 2:
        return None
    within: dict[tuple[str, float], list[bool]] = {}
    for r in range(rounds):
        alt = json.loads(json.dumps(result))
        for m in alt["modes"].values():
            ladder = (m.get("calibration") or {}).get("ladder") or {}
            by = ladder.get("step_ms_by_round")
            if by:
                ladder["step_ms"] = {b: (v[r] if r < len(v) else None) for b, v in by.items()}
        for row in validate_e2e(alt, **kwargs)["rows"]:
            if not row.get("excluded"):
                within.setdefault((row["mode"], row["rate"]), []).append(bool(row["within_target"]))
    return {
        "rounds": rounds,
        "rows": [{"mode": m, "rate": rate, "within_target": w} for (m, rate), w in within.items()],
        "within_every_round": sum(all(w) for w in within.values()),
        "within_some_round": sum(any(w) for w in within.values()),
    }


def format_validation(v: dict[str, Any]) -> str:
    lines = [
        f"planner vs measured ({v['source'].get('benchmark')}, {v['device']}, depth {v['model_depth']}, "
        f"commit {str(v['source'].get('commit'))[:12]}); SLO TTFT {v['slo']['ttft_ms']:g} ms, "
        f"ITL {v['slo']['itl_ms']:g} ms; target +-{v['target']:.0%}; placement {v.get('placement', 'separate')}"
        f"{', shares ' + v['shares'] if v.get('placement') == 'shared' and 'shares' in v else ''}",
        f"{'mode':<18}{'req/s':>6}{'TTFT p50 ms meas/pred':>24}{'ITL p50 ms meas/pred':>24}"
        f"{'goodput req/s meas/pred':>26}  ok",
    ]
    lines.append("-" * len(lines[-1]))
    for r in v["rows"]:
        m, p, q = r["measured"], r["predicted"], r["ratio"]
        cells = [
            f"{m[k]:>8.1f}/{p[k]:<7.1f}({q[k]:.2f})".rjust(w)
            for k, w in (("ttft_p50_ms", 24), ("itl_p50_ms", 24), ("goodput_req_s", 26))
        ]
        ok = "excl." if r.get("excluded") else "yes" if r["within_target"] else "no"
        lines.append(f"{r['mode']:<18}{r['rate']:>6g}{''.join(cells)}  {ok}")
    sm = v.get("summary")
    if sm:
        w = sm["within"]
        lines.append(
            f"within +-{v['target']:.0%} of {sm['counted']} counted rows: TTFT p50 {w['ttft_p50_ms']}, ITL p50"
            f" {w['itl_p50_ms']}, goodput {w['goodput_req_s']}; all three {sm['all_three']}"
        )
    lr = v.get("ladder_rounds")
    if lr:
        flips = [f"{r['mode']} @ {r['rate']:g}" for r in lr["rows"] if len(set(r["within_target"])) > 1]
        lines.append(
            f"with each of the {lr['rounds']} decode-ladder rounds alone: all three within in every round "
            f"{lr['within_every_round']}, in some round {lr['within_some_round']} rows"
            + (f" (the ladder's spread decides {', '.join(flips)})" if flips else "")
        )
    queues = [(r, r["p_queue_p50_ms"]) for r in v["rows"] if r.get("p_queue_p50_ms")]
    if queues:
        lines.append(
            "P's queue p50 ms, meas/pred (not validated): "
            + ", ".join(f"{r['mode']} @ {r['rate']:g} {q['measured']:.0f}/{q['predicted']:.0f}" for r, q in queues)
        )
    for r in v["rows"]:
        if r.get("excluded"):
            lines.append(f"excluded {r['mode']} at {r['rate']:g} req/s: {r['excluded']}")
        stalled = {role: n for role, n in (r.get("new_shape_steps") or {}).items() if n}
        if stalled:
            what = ", ".join(f"{n:g} {role}" for role, n in stalled.items())
            lines.append(
                f"{r['mode']} at {r['rate']:g} req/s: {what} steps met a new shape (a compile or capture) in the run: "
                "stalls the model does not have"
            )
    for mode, m in v["modes"].items():
        if "skipped" in m:
            lines.append(f"{mode}: skipped ({m['skipped'].strip().splitlines()[-1] if m['skipped'] else ''})")
        else:
            s = m["steps_ms"]
            lines.append(
                f"{mode}: fitted steps (ms) P {s['p_step_ms']:.1f} + {s['p_row_ms']:.4f}/row{_p_fit_note(m)};"
                f" D {s['d_step_ms']:.1f}"
                f" + {s['d_seq_ms']:.2f}/request, prompt rows {s['d_pre_ms']:.1f} + {s['d_row_ms']:.4f}/row;"
                + (
                    f" mixed: decode + {s['mix_pre_ms']:.1f} + {s['mix_row_ms']:.4f}/row;"
                    if s.get("mix_pre_ms") is not None
                    else ""
                )
                + f" move {s['move_ms']:.1f} + {s['move_row_ms']:.5f}/token"
                + (f", {s['move_beside_p_ms']:.1f} beside P" if s.get("move_beside_p_ms") is not None else "")
                + f"; TTFT offset {s['ttft_offset_ms']:.1f}"
            )
            ld = m.get("serving_load_ms")
            if ld:
                lines.append(
                    f"{mode}: per further request in the TTFT path (ms): P's answer {ld['answer_ms']:.2f}, fetch"
                    f" {ld['fetch_ms']:.2f}, hops {ld['hops_ms']:.2f}; D step {ld['d_step_ms']:.2f} per request"
                    f" in the path (batch: {ld['batch_in_path']:.1f} in the path)"
                )
    return "\n".join(lines)


def run_validation(
    path: str,
    as_json: bool = False,
    out: str | None = None,
    exclude: list[str] | None = None,
    shares: str = "equal",
    handoff_stream: str | None = None,
) -> int:
    """``asympd plan --validate RESULT.json``: print (and optionally write) the table; exit 0 when
    every counted row (``exclude``: ``MODE@RATE=REASON``) is within the target, 1 otherwise."""
    excluded = parse_exclusions(exclude)
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValidationError(f"cannot read {path!r}: {e}") from None
    v = validate_e2e(result, exclude=excluded, shares=shares, handoff_stream=handoff_stream)
    band = ladder_rounds(result, exclude=excluded, shares=shares, handoff_stream=handoff_stream)
    if band is not None:
        v["ladder_rounds"] = band
    print(json.dumps(v, indent=2) if as_json else format_validation(v))
    if out:
        Path(out).write_text(json.dumps(v, indent=1) + "\n")
    counted = [r for r in v["rows"] if not r.get("excluded")]
    return 0 if counted and all(r["within_target"] for r in counted) else 1


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        sys.exit(run_validation(sys.argv[1], "--json" in sys.argv))
    print(json.dumps(validate_admission(), indent=2))
