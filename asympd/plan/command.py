"""Arguments and output of `asympd plan` (the CLI entry lives in asympd/cli.py)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from asympd.plan.gpus import GPUS
from asympd.plan.memory import DEFAULT_RESERVE_GB
from asympd.plan.planner import (
    PLACEMENTS,
    PlanError,
    Planner,
    PlanRequest,
    format_plan,
    load_traffic,
    parse_dist,
    poisson_arrivals,
)
from asympd.plan.steps import PLANNED_MODES
from asympd.plan.validate import HANDOFF_STREAMS, SHARES

DEFAULT_PROMPT = "1024:0.4,4096:0.3,16384:0.2,65536:0.1"  # the mix of docs/performance.md


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="H200", type=str.upper, choices=list(GPUS))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--traffic", help='JSON lines {"prompt_len": N, "output_len": M[, "t": s]}')
    src.add_argument("--prompt-len", default=DEFAULT_PROMPT, help="N or N:weight,N:weight,... (tokens)")
    p.add_argument("--output-len", default="256", help="N or N:weight,... (tokens)")
    p.add_argument("--rate", type=float, help="requests/s (Poisson); required without a timed --traffic")
    p.add_argument("--slo-ttft-p99", type=float, help="seconds (required unless --validate)")
    p.add_argument("--slo-itl-p99", type=float, help="ms between a request's steps (required unless --validate)")
    p.add_argument("--mode", default="all", help=f"all | {' | '.join(PLANNED_MODES)}")
    p.add_argument(
        "--placement",
        default="separate",
        choices=PLACEMENTS,
        help="separate: P and D replicas on GPUs of their own; shared: each P replica on a D replica's GPUs",
    )
    p.add_argument("--requests", type=int, default=300, help="requests simulated")
    p.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB)
    p.add_argument("--results", default=None, help="bench results directory (default: bench/results)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="processes planning the modes at once (default 0: one per CPU, at most one a mode; the plan is the same)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="write a PNG of GPUs and goodput per mode here")
    p.add_argument(
        "--validate",
        default=None,
        metavar="RESULT.json",
        help="instead of planning: the prediction for a bench/e2e.py result's deployments against its measurements",
    )
    p.add_argument("--validate-out", default=None, metavar="JSON", help="with --validate: write the table here too")
    p.add_argument(
        "--validate-shares",
        choices=SHARES,
        default="equal",
        help="with --validate: a shared GPU split equally (default), at the calibration co-run's measured "
        "stretch, or equally with P's fixed step cost taken as host launching off the GPU (host-split)",
    )
    p.add_argument(
        "--validate-handoff-stream",
        choices=HANDOFF_STREAMS,
        default=None,
        help="with --validate: where P's hand-off packs on a GPU (default: as the result records it; the other"
        " value predicts the same run with the other hand-off)",
    )
    p.add_argument(
        "--validate-exclude",
        action="append",
        default=[],
        metavar="MODE@RATE=REASON",
        help="with --validate: report this row but leave it out of the within-target count (repeatable)",
    )


MAX_REQUESTS = 100_000  # ~600 simulated a second per mode on a CPU core: minutes, not days


def build_request(args: argparse.Namespace) -> PlanRequest:
    missing = [f for f in ("slo_ttft_p99", "slo_itl_p99") if getattr(args, f) is None]
    if missing:
        raise PlanError(f"--{missing[0].replace('_', '-')} is required (unless --validate)")
    if not 10 <= args.requests <= MAX_REQUESTS:
        raise PlanError(
            f"--requests must be in [10, {MAX_REQUESTS}] (every candidate deployment simulates them all), "
            f"got {args.requests}"
        )
    if not 0 <= args.reserve_gb < math.inf:
        raise PlanError(f"--reserve-gb must be >= 0 and finite, got {args.reserve_gb}")
    if args.rate is not None and not 0 < args.rate < math.inf:
        raise PlanError(f"--rate must be positive and finite, got {args.rate}")
    modes = PLANNED_MODES if args.mode == "all" else tuple(m.strip() for m in args.mode.split(","))
    if args.traffic:
        arrivals = load_traffic(args.traffic, args.rate, args.requests, args.seed)
        span = arrivals[-1].time_s - arrivals[0].time_s
        rate = args.rate or ((len(arrivals) - 1) / span if span > 0 else float(len(arrivals)))
    else:
        if args.rate is None:
            raise PlanError("--rate is required with --prompt-len/--output-len")
        prompt = parse_dist(args.prompt_len, "--prompt-len")
        output = parse_dist(args.output_len, "--output-len")
        arrivals = poisson_arrivals(prompt, output, args.rate, args.requests, args.seed)
        rate = args.rate
    return PlanRequest(
        args.gpu,
        arrivals,
        rate,
        args.slo_ttft_p99,
        args.slo_itl_p99,
        modes,
        reserve_gb=args.reserve_gb,
        seed=args.seed,
        placement=args.placement,
    )


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deps = result["deployments"]
    names = [d["mode"] for d in deps]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    p_gpus = [d["p_replicas"] * d["p_gpus"] if d["feasible"] else 0 for d in deps]
    d_gpus = [d["d_replicas"] * d["d_gpus"] if d["feasible"] else 0 for d in deps]
    a.bar(names, p_gpus, color="tab:orange", label="P")
    a.bar(names, d_gpus, bottom=p_gpus, color="tab:blue", label="D")
    a.set_ylabel("GPUs (0 = infeasible)")
    a.legend()
    b.bar(names, [d["goodput_tokens_per_s_per_gpu"] if d["feasible"] else 0 for d in deps], color="tab:green")
    b.set_ylabel("goodput, output tokens/s per GPU")
    fig.suptitle(
        f"{result['gpu']['name']}, {result['rate_req_per_s']:g} req/s, TTFT p99 <= "
        f"{result['slo']['ttft_p99_s']:g} s, ITL p99 <= {result['slo']['itl_p99_ms']:g} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.validate:
        from asympd.plan.validate import run_validation

        return run_validation(
            args.validate,
            args.json,
            args.validate_out,
            args.validate_exclude,
            args.validate_shares,
            args.validate_handoff_stream,
        )
    result = Planner(build_request(args), results_dir=args.results, jobs=args.jobs).plan()
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0 if result["recommendation"]["mode"] else 1
