"""Estimate, for an e2e result made before the workers counted it, the GPU time P's steps left
queued after their host code returned, and what it does to prompt tokens per P-busy second.

A prefill worker that samples nothing returns from a step before its GPU work ends; until the
busy clock (asympd/serve/busy.py) the results timed P's host steps only. Each P step's GPU tail is
taken as the run's median ``export_s - export_copy_s`` (the wait from the step's return to its
export's copy, less the copy), and counted up to the next P step's start (past it the next step's
host time covers it). Results with ``p_busy_basis`` "host and gpu" need no estimate: their figure
is printed as measured.

    python tools/p_busy_tail.py bench/results/e2e_h200x1_depth40_headline2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.plan.validate import gpu_tail_s  # noqa: E402  (one reading of the tail, the planner's)


def tail_s(run: dict[str, Any]) -> tuple[float, float] | None:
    """(the median tail per step, the seconds of it the host steps left out), or None where the
    run has no P steps or no export timings."""
    lags = [x for t in run["requests"].get("asympd_timings", []) if t and (x := gpu_tail_s(t)) is not None]
    steps = sorted(s for worker in run.get("timeline", {}).get("steps", {}).get("prefill", []) for s in worker)
    if not lags or not steps:
        return None
    lag = statistics.median(lags)
    left_out = 0.0
    for (t0, dt, *_), nxt in zip(steps, [*steps[1:], None], strict=True):
        room = lag if nxt is None else max(0.0, nxt[0] - (t0 + dt))
        left_out += min(lag, room)
    return lag, left_out


def report(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    rows = []
    for mode, m in data["modes"].items():
        for run in m.get("runs", []):
            if "prefill_busy_s" not in run:
                continue
            host = run["prefill_busy_s"]
            measured = run.get("prefill_busy_with_gpu_s")
            est = tail_s(run)
            busy = measured if measured is not None else host + (est[1] if est else 0.0)
            rows.append(
                {
                    "mode": mode,
                    "rate": run["request_rate"],
                    "host_busy_s": host,
                    "tail_per_step_ms": None if est is None else est[0] * 1e3,
                    "busy_s": busy,
                    "basis": "measured" if measured is not None else ("estimated" if est else "host only"),
                    "tokens_per_host_busy_s": run["total_input_tokens"] / host,
                    "tokens_per_busy_s": run["total_input_tokens"] / busy,
                }
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.results:
        rows = report(path)
        print(f"P's busy time with its GPU tail: {path.name}")
        print(
            f"{'mode@rate':<26}{'host busy s':>12}{'tail/step ms':>14}{'busy s':>9}  {'basis':<10}"
            f"{'tok/host-busy s':>16}{'tok/busy s':>12}"
        )
        for r in rows:
            tail = "-" if r["tail_per_step_ms"] is None else f"{r['tail_per_step_ms']:.1f}"
            name = f"{r['mode']}@{r['rate']:g}"
            print(
                f"{name:<26}{r['host_busy_s']:>12.2f}{tail:>14}{r['busy_s']:>9.2f}  {r['basis']:<10}"
                f"{r['tokens_per_host_busy_s']:>16.0f}{r['tokens_per_busy_s']:>12.0f}"
            )
        by = {(r["mode"], r["rate"]): r for r in rows}
        for (mode, rate), r in by.items():
            if mode != "asymmetric":
                continue
            base = [b for (m, q), b in by.items() if q == rate and m.startswith("symmetric")]
            if base:
                best = max(base, key=lambda b: b["tokens_per_busy_s"])
                host_best = max(b["tokens_per_host_busy_s"] for b in base)
                print(
                    f"asymmetric / best symmetric @ {rate:g}: {r['tokens_per_busy_s'] / best['tokens_per_busy_s']:.2f} "
                    f"(host steps alone: {r['tokens_per_host_busy_s'] / host_best:.2f})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
