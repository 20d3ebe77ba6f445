"""How P's steps stretched beside D's during an e2e result's rate runs, from their timelines
(``bench/e2e.py`` keeps every worker's steps per run since the seventh session): each P step's
duration over its lone time (the lone requests' line of the mode's own calibration; the planner's
own P line, from the co-run's steps where logged, is printed beside it), grouped by the
largest decode batch D ran beside it, and the simulated vs measured busy time. This is the reading
the planner's shared-GPU model misses (docs/planner.md, "Plan7 on the GPU"): the calibration co-run
measured P beside a different D than the load's. For a P that ran its window chunks alone (a
symmetric P since 4f99bfc), also those steps by prompt length, with the line through them, beside a
D's first step of the same phase from the lone requests (``window_steps``).

    python tools/timeline_report.py bench/results/e2e_h200x1_depth40_oos3.json [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.plan.step_log import BESIDE, gpu_held, timed_to_gpu_end  # noqa: E402  (BESIDE: the co-run's reading)
from asympd.plan.step_log import overlap as _overlap  # noqa: E402
from asympd.plan.validate import _line as least_squares  # noqa: E402
from asympd.plan.validate import validate_e2e  # noqa: E402


def _flat(logged: list) -> list[list]:
    """Steps from a timeline (one list per worker, maybe empty) or a co-run log (one list of steps)."""
    per_worker = bool(logged) and (not logged[0] or isinstance(logged[0][0], list))
    return [s for worker in logged for s in worker] if per_worker else list(logged)


def _line(points: list[tuple[float, float]]) -> list[float] | None:
    """The planner's least-squares line [intercept, slope]; None under two distinct x."""
    return list(least_squares(points)) if len({x for x, _ in points}) >= 2 else None


def p_steps_beside(run: dict[str, Any], lone_ms: Any) -> list[dict[str, Any]]:
    """Every P step of a run's timeline: rows, seconds, its stretch over ``lone_ms(rows)``, how much
    of it D's steps covered and the largest decode batch among them (0: D idle)."""
    tl = run.get("timeline") or {}
    steps = tl.get("steps", {})
    p_all = _flat(steps.get("prefill", []))
    if timed_to_gpu_end(p_all):  # as the planner reads them: the time the GPU held each step
        p_all = [s for worker in steps["prefill"] for s in gpu_held(worker)]
    d_all = _flat(steps.get("decode", []))
    out = []
    for step in p_all:
        start, dur, rows = step[:3]
        if rows <= 0 or dur <= 0:
            continue
        beside = [d for d in d_all if d[0] < start + dur and d[0] + d[1] > start]
        out.append(
            {
                "rows": rows,
                "s": dur,
                "stretch": dur * 1e3 / lone_ms(rows),
                "covered": _overlap(step, beside),
                "d_batch": max((d[3] for d in beside), default=0),
            }
        )
    return out


def window_steps(m: dict[str, Any], window: int) -> dict[str, Any] | None:
    """A symmetric P's steps of one window (``window`` rows) that no D step overlapped, nor the P
    step before them (the prompt's prefix: its rows + W are the prompt's length), from the co-run
    and every rate run, as the GPU held them (``gpu_held``) and by host time, with the line through
    each in the prompt length. None for a P that did not run its windows alone. Why both: a
    prefix step samples nothing and returns before its GPU work ends, so the window step after it
    waits for that tail in host time. headline4: host 85-153 ms, growing ~0.03 ms a prompt token;
    as the GPU held them 85-101 ms, flat, like an asymmetric D's first step (``d_first_steps``)."""
    p_info = next((w for w in (m.get("workers") or {}).values() if w.get("role") == "prefill"), {})
    if not (p_info.get("admission") or {}).get("one_depth_per_step"):
        return None
    logs = [(m["calibration"].get("co_run") or {}).get("steps") or {}]
    logs += [(r.get("timeline") or {}).get("steps") or {} for r in m.get("runs", [])]
    points = []
    for log in logs:
        p, d = sorted(_flat(log.get("prefill") or [])), _flat(log.get("decode") or [])
        held = gpu_held(p)  # as the GPU held them where timed to its end, else the host times
        for i in range(1, len(p)):
            before, step = p[i - 1], p[i]
            if step[2] == window and before[2] > window and _overlap(step, d) == 0 and _overlap(before, d) == 0:
                points.append((before[2] + window, held[i][1] * 1e3, step[1] * 1e3))
    points.sort()
    return {
        "steps": [[n, round(g, 3), round(h, 3)] for n, g, h in points],  # [prompt, GPU-held ms, host ms]
        "line_ms": _line([(n, g) for n, g, _ in points]),
        "host_line_ms": _line([(n, h) for n, _, h in points]),
    }


def d_first_steps(m: dict[str, Any]) -> list[list[float]]:
    """[prompt length, ms] of a D's first step for each lone request of the calibration."""
    return [
        [r["prompt_len"], round(r["timings"]["decode_first_step_s"] * 1e3, 3)]
        for r in m["calibration"]["lone"]
        if (r.get("timings") or {}).get("decode_first_step_s") is not None
    ]


def report(result: dict[str, Any]) -> dict[str, Any]:
    """Per mode with P and D apart on one GPU: the P steps' stretch by D's batch beside them, the
    co-run's measured stretch, and each rate's simulated vs measured P and D busy seconds."""
    v = validate_e2e(result)
    out: dict[str, Any] = {"benchmark": result.get("benchmark"), "commit": result.get("commit"), "modes": {}}
    for mode, m in result["modes"].items():
        vm = v["modes"].get(mode, {})
        fit = vm.get("steps_ms")
        runs = [r for r in m.get("runs", []) if r.get("timeline")]
        if not fit or not runs or mode == "colocated":
            continue
        # the lone requests' line, whichever line the planner used (``p_fit``: it fits P to the
        # co-run's steps where the result logged them)
        lone_fit = (vm.get("p_fit") or {}).get("lone_ms") or [fit["p_step_ms"], fit["p_row_ms"]]

        def lone_ms(rows: int, fit: list[float] = lone_fit) -> float:
            return fit[0] + fit[1] * rows

        steps = [s for r in runs for s in p_steps_beside(r, lone_ms)]
        by_batch: dict[str, dict[str, Any]] = {}
        groups = [("alone", [s for s in steps if s["covered"] < BESIDE])]
        groups += [
            (str(b), [s for s in steps if s["covered"] >= BESIDE and s["d_batch"] == b])
            for b in sorted({s["d_batch"] for s in steps if s["covered"] >= BESIDE})
        ]
        for key, sel in groups:
            if sel:
                by_batch[key] = {
                    "steps": len(sel),
                    "median_stretch": statistics.median(s["stretch"] for s in sel),
                    "rows": [min(s["rows"] for s in sel), max(s["rows"] for s in sel)],
                }
        busy = [
            {
                "rate": row["rate"],
                **{
                    f"{role}_sim_over_measured": s["wall"] / s["measured"]
                    for role, s in row["engine_step_s"].items()
                    if s.get("measured")
                },
            }
            for row in v["rows"]
            if row["mode"] == mode
        ]
        w = ((result.get("model") or {}).get("model_config") or {}).get("window_size")
        windows = window_steps(m, w) if w else None
        out["modes"][mode] = {
            **({"window_steps": windows} if windows else {}),
            **({"d_first_steps": d_first_steps(m)} if mode == "asymmetric" else {}),
            "p_lone_fit_ms": lone_fit,
            "p_planner_fit_ms": [fit["p_step_ms"], fit["p_row_ms"]],
            "p_fit": vm.get("p_fit"),
            "co_run_measured": v["modes"][mode].get("co_run_measured"),
            "p_stretch_by_d_batch": by_batch,
            "busy": busy,
        }
    return out


def format_report(r: dict[str, Any]) -> str:
    lines = [f"P beside D in the rate runs of {r['benchmark']} (commit {r['commit']})"]
    for mode, m in r["modes"].items():
        co = m["co_run_measured"] or {}
        lines.append(
            f"{mode}: P alone fit {m['p_lone_fit_ms'][0]:.1f} ms + {m['p_lone_fit_ms'][1]:.4f} ms/row; "
            f"co-run measured P {co.get('p', float('nan')):.2f}, D {co.get('d', float('nan')):.2f}"
        )
        pf = m["p_fit"] or {}
        lines.append(
            f"  planner's P fit: {m['p_planner_fit_ms'][0]:.1f} ms + {m['p_planner_fit_ms'][1]:.4f} ms/row"
            f" ({pf.get('source', 'lone requests')})"
        )
        for key, b in m["p_stretch_by_d_batch"].items():
            label = "alone" if key == "alone" else f"beside a decode batch of {key}"
            lines.append(
                f"  {label:28s} {b['steps']:3d} steps, {b['rows'][0]}-{b['rows'][1]} rows: "
                f"median stretch {b['median_stretch']:.2f}"
            )
        for row in m["busy"]:
            parts = ", ".join(f"{k.split('_')[0]} {v:.2f}" for k, v in row.items() if k != "rate")
            lines.append(f"  {row['rate']:g} req/s: simulated / measured busy time: {parts}")
        if "d_first_steps" in m:
            pts = ", ".join(f"{n}: {ms:.1f}" for n, ms in m["d_first_steps"])
            lines.append(f"  D's first step alone by prompt tokens (ms; lone requests): {pts}")
        if "window_steps" in m:
            ws = m["window_steps"]
            for key, at, label in (("line_ms", 1, "as the GPU held them"), ("host_line_ms", 2, "host time")):
                line = ws[key]
                fit = f"{line[0]:.1f} ms + {line[1]:.4f} ms/prompt token" if line else "one length only"
                pts = ", ".join(f"{s[0]}: {s[at]:.0f}" for s in ws["steps"])
                lines.append(f"  window steps alone, {label} ({len(ws['steps'])}; {fit}): {pts}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench/e2e.py result with timelines (seventh session on)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        result = json.loads(Path(args.result).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"cannot read {args.result!r}: {e}", file=sys.stderr)
        return 2
    r = report(result)
    if not r["modes"]:
        print(f"{args.result}: no P/D mode with a timeline (results before the seventh session have none)")
        return 1
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
