"""P's steps in one rate run of a ``bench/e2e.py`` result, as the planner simulated them beside the
P worker's own step log: where a prediction's miss comes from, step by step (docs/planner.md, "v13
and v14": v14's symmetric-split TTFT at 2 req/s came from one prefix step early in the first burst).

    python tools/p_trace.py bench/results/e2e_h200x1_depth40_v14_two.json symmetric-split@2 [--shares S]

Times are seconds from the run's first arrival; the measured steps run to their GPU end
(``step_log.gpu_held``); rows are the step's prompt rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.plan.validate import SHARES, validate_e2e  # noqa: E402


def trace(result: dict, mode: str, rate: float, shares: str = "equal") -> dict:
    """The validation row of ``mode`` at ``rate`` with its ``p_steps`` (ValueError if there is none)."""
    if mode not in result.get("modes", {}):
        raise ValueError(f"no mode {mode!r} in the result: {', '.join(result.get('modes', {}))}")
    one = {**result, "modes": {mode: result["modes"][mode]}}
    rows = [r for r in validate_e2e(one, shares=shares, trace=True)["rows"] if r["rate"] == rate]
    if not rows or "p_steps" not in rows[0]:
        raise ValueError(f"no P/D rate run of {mode} at {rate:g} req/s")
    return rows[0]


def format_trace(row: dict) -> str:
    sim, meas = row["p_steps"]["simulated"], row["p_steps"]["measured"]
    lines = [
        f"{row['mode']} @ {row['rate']:g} req/s: TTFT p50 {row['measured']['ttft_p50_ms']:.0f} ms measured, "
        f"{row['predicted']['ttft_p50_ms']:.0f} predicted; P steps {len(meas)} measured, {len(sim)} simulated",
        f"{'simulated: start':>17} {'s':>7} {'rows':>6}   {'measured: start':>16} {'s':>7} {'rows':>6}",
    ]
    for s, m in itertools.zip_longest(sim, meas):
        left = f"{s[0]:17.3f} {s[1]:7.3f} {s[2]:6d}" if s else " " * 32
        right = f"{m[0]:16.3f} {m[1]:7.3f} {m[2]:6d}" if m else ""
        lines.append(f"{left}   {right}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench/e2e.py result (P and D)")
    ap.add_argument("row", metavar="MODE@RATE", help="e.g. symmetric-split@2")
    ap.add_argument("--shares", default="equal", choices=SHARES)
    args = ap.parse_args(argv)
    mode, _, rate = args.row.partition("@")
    try:
        row = trace(json.loads(Path(args.result).read_text()), mode, float(rate), args.shares)
    except ValueError as e:
        print(f"p_trace: {e}", file=sys.stderr)
        return 2
    print(format_trace(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
