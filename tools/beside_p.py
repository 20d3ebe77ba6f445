"""How much of D's decoding ran beside P's steps in each rate run of a one-GPU e2e result, from the
workers' step logs: why a token gap's p50 on a shared GPU jumps between two values.

A decode step alone and one beside a P step differ by about 2x, so the ITL p50 is the alone size
while fewer than about half of the tokens come out beside P and the beside size after. The
planner's 2 req/s misses sit at that edge (docs/planner.md, "v10"). Per mode and rate: P's busy
fraction (the GPU time its steps held over D's span), the decode steps and the tokens beside P (a
step counts as beside when P's steps covered at least ``step_log.BESIDE`` of it), the median step
alone and beside, and the measured ITL p50.

    python tools/beside_p.py bench/results/e2e_h200x1_depth40_v10_two.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.plan.step_log import BESIDE, gpu_held, overlap  # noqa: E402  (the planner's reading of the logs)


def beside_p(run: dict[str, Any]) -> dict[str, Any] | None:
    """The run's decode steps read against P's (None without both step logs)."""
    steps = run.get("timeline", {}).get("steps", {})
    p = gpu_held([s for worker in steps.get("prefill", []) for s in worker])
    d = [s for worker in steps.get("decode", []) for s in worker if s[2] == 0 and s[3] > 0]  # decode only
    if not p or not d:
        return None
    span = max(s[0] + s[1] for s in d) - min(s[0] for s in d)
    by = [overlap(s, p) >= BESIDE for s in d]
    alone = [s[1] * 1e3 for s, b in zip(d, by, strict=True) if not b]
    beside = [s[1] * 1e3 for s, b in zip(d, by, strict=True) if b]
    tokens = sum(s[3] for s in d)
    return {
        "rate": run["request_rate"],
        "p_busy_fraction": sum(s[1] for s in p) / span if span > 0 else 0.0,
        "decode_steps": len(d),
        "steps_beside_p": len(beside),
        "tokens_beside_p_fraction": sum(s[3] for s, b in zip(d, by, strict=True) if b) / tokens,
        "alone_step_p50_ms": statistics.median(alone) if alone else None,
        "beside_step_p50_ms": statistics.median(beside) if beside else None,
        "itl_p50_ms": run["median_itl_ms"],
    }


def report(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every P/D mode's rate runs (``beside_p``); modes without step logs are left out."""
    out: dict[str, list[dict[str, Any]]] = {}
    for mode, m in result.get("modes", {}).items():
        rows = [r for run in m.get("runs", []) if (r := beside_p(run)) is not None]
        if rows:
            out[mode] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench/e2e.py result (one GPU, P and D sharing it)")
    ap.add_argument("--json", default=None, help="write the table here too")
    args = ap.parse_args()
    table = report(json.loads(Path(args.result).read_text()))
    print("mode               req/s  P busy  decode steps beside P  tokens beside P  step p50 alone/beside ms  ITL p50")
    for mode, rows in table.items():
        for r in rows:
            steps = f"{r['steps_beside_p']}/{r['decode_steps']}"
            pair = f"{r['alone_step_p50_ms'] or 0:.1f} / {r['beside_step_p50_ms'] or 0:.1f}"
            print(
                f"{mode:<18} {r['rate']:>5g}  {r['p_busy_fraction']:6.2f}  {steps:>21}  "
                f"{r['tokens_beside_p_fraction']:15.2f}  {pair:>24}  {r['itl_p50_ms']:7.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"source": args.result, "modes": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
