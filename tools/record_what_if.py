"""A planner rule's what-if over the record: every row of docs/performance.md §10's validation table
(the cumulative "N of 115"), each re-validated from its own result with this tree, and counted
within 15 % on TTFT p50, ITL p50, goodput and all three. A candidate rule is applied by
monkeypatching ``asympd.plan.validate`` in ``RULES``; ``base`` is the tree as it is. Extra results
(``--extra``: e.g. a run made after the table) are counted separately, every row. The table keeps
each run's ratios as first predicted (v7's asymmetric rows before the rules v7 prompted), so ``base``
re-validated is 71 of 115 where the table says 70.

    python tools/record_what_if.py [--rules base,RULE...] [--extra v15_two] [--rows]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asympd.engine.graph_sizes import BATCH_SIZES
from asympd.plan import validate as V
from asympd.plan.step_log import ALONE_P, gpu_held, overlap

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PREFIX = "e2e_h200x1_depth40_"
HEADER = "| result (commit, seed) | mode @ req/s | TTFT p50 measured, ms |"


def table_rows() -> list[tuple[str, str, float, int, bool]]:
    """(run name, mode, rate, measured TTFT p50 ms, all three within) of each row of the table."""
    lines = (ROOT / "docs" / "performance.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    out = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        c = [x.strip() for x in line.strip("|").split("|")]
        mode, rate = c[1].split(" @ ")
        out.append((c[0].split(" (")[0], mode, float(rate), int(c[2]), c[6] == "yes"))
    return out


def _source(run: str, mode: str, rate: float, ttft: int) -> Path:
    """The committed validation holding the row: the run's own file where it has the row, else
    another of the run's (a merged or part result) whose row measured the same TTFT p50."""
    names = [run, f"{run}_two"] + sorted(
        p.name[len(PREFIX) : -len("_validation.json")] for p in RESULTS.glob(f"{PREFIX}{run}*_validation.json")
    )
    for name in names:
        path = RESULTS / f"{PREFIX}{name}_validation.json"
        if not path.exists():
            continue
        rows = json.loads(path.read_text())["rows"]
        if any(r["mode"] == mode and r["rate"] == rate and round(r["measured"]["ttft_p50_ms"]) == ttft for r in rows):
            return path
    raise LookupError(f"no validation holds {run} {mode}@{rate:g}")


def validate(path: Path) -> dict[str, Any]:
    """``path``'s source re-validated as ``tools/regen_validations.py`` does (its exclusions, shares,
    hand-off)."""
    old = json.loads(path.read_text())
    exclude = [f"{r['mode']}@{r['rate']:g}={r['excluded']}" for r in old["rows"] if r.get("excluded")]
    source = path.with_name(path.name.split("_validation")[0] + ".json")
    return V.validate_e2e(
        json.loads(source.read_text()),
        exclude=V.parse_exclusions(exclude),
        shares=old.get("shares", "equal"),
        handoff_stream=old.get("handoff_stream"),
    )


# ---- candidate rules: each a context of monkeypatches ------------------------------------------------


def _pad(b: int) -> int:
    return next((x for x in BATCH_SIZES if x >= b), b)


def co_run_decode_steps(cal: dict[str, Any]) -> dict[int, list[float]]:
    """D's decode-only steps of the calibration's co-run that P's steps covered less than ALONE_P of,
    read as the GPU held them (a symmetric D's replay returns at launch), ms by padded batch."""
    log = (cal.get("co_run") or {}).get("steps") or {}
    d, p = log.get("decode") or [], log.get("prefill") or []
    held_p = gpu_held(p)
    out: dict[int, list[float]] = {}
    for s in gpu_held(d):
        if s[2] == 0 and s[3] > 0 and overlap(s, held_p) < ALONE_P:
            out.setdefault(_pad(int(s[3])), []).append(s[1] * 1e3)
    return out


def _ladder_pooled(cal: dict[str, Any], on_gpu: bool) -> dict[int, float] | None:
    """The ladder's steps and the co-run's alone decode steps pooled per padded size, the median."""
    base = ORIG["decode_ladder_ms"](cal, on_gpu)
    if base is None:
        return None
    steps = {int(b): list(ms) for b, ms in cal["ladder"]["steps_ms"].items() if ms}
    for b, ms in co_run_decode_steps(cal).items():
        if b in steps:
            steps[b] += ms
    return {b: statistics.median(steps[b]) if b in steps else ms for b, ms in base.items()}


def _ladder_two_sources(cal: dict[str, Any], on_gpu: bool) -> dict[int, float] | None:
    """Per padded size the mean of the ladder's median and the co-run's (where it has 5 steps or
    more there): two independent readings, each phase's level shift halved."""
    base = ORIG["decode_ladder_ms"](cal, on_gpu)
    if base is None:
        return None
    co = co_run_decode_steps(cal)
    return {b: (ms + statistics.median(co[b])) / 2 if len(co.get(b, [])) >= 5 else ms for b, ms in base.items()}


def _ladder_co_run_first(cal: dict[str, Any], on_gpu: bool) -> dict[int, float] | None:
    """The co-run's alone decode steps' median where it has 5 or more at a padded size (1 kept from
    the ladder: the excess is read over it), the ladder's elsewhere."""
    base = ORIG["decode_ladder_ms"](cal, on_gpu)
    if base is None:
        return None
    co = co_run_decode_steps(cal)
    return {b: statistics.median(co[b]) if b > 1 and len(co.get(b, [])) >= 5 else ms for b, ms in base.items()}


def _ladder_concave(cal: dict[str, Any], on_gpu: bool) -> dict[int, float] | None:
    """The ladder with each inner size's median capped at the chord between its neighbours (linear in
    batch size, never below the smaller neighbour): a phase-level rise at one size not seen at the
    next is read as noise."""
    base = ORIG["decode_ladder_ms"](cal, on_gpu)
    if base is None:
        return None
    ks = sorted(base)
    out = dict(base)
    for i in range(1, len(ks) - 1):
        a, b, c = ks[i - 1], ks[i], ks[i + 1]
        chord = base[a] + (base[c] - base[a]) * (b - a) / (c - a)
        out[b] = min(base[b], max(chord, base[a]))
    return out


def _no_ladder(cal: dict[str, Any], on_gpu: bool) -> dict[int, float] | None:
    return None


ORIG: dict[str, Callable[..., Any]] = {"decode_ladder_ms": V.decode_ladder_ms}
RULES: dict[str, dict[str, Callable[..., Any]]] = {
    "base": {},
    "ladder+co-run pooled": {"decode_ladder_ms": _ladder_pooled},
    "ladder|co-run mean": {"decode_ladder_ms": _ladder_two_sources},
    "co-run over ladder": {"decode_ladder_ms": _ladder_co_run_first},
    "ladder chord-capped": {"decode_ladder_ms": _ladder_concave},
    "no ladder (d_seq line)": {"decode_ladder_ms": _no_ladder},
}


def count(rule: str, rows: list[tuple[str, str, float, int, bool]], show: bool = False) -> dict[str, int]:
    patches = RULES[rule]
    for name, fn in patches.items():
        setattr(V, name, fn)
    try:
        cache: dict[Path, dict[str, Any]] = {}
        n = {"rows": 0, "ttft": 0, "itl": 0, "goodput": 0, "all": 0}
        for run, mode, rate, ttft, _ in rows:
            path = _source(run, mode, rate, ttft) if not run.startswith("@") else Path(run[1:])
            v = cache[path] = cache.get(path) or validate(path)
            r = next(r for r in v["rows"] if r["mode"] == mode and r["rate"] == rate)
            ok = {k: abs(r["ratio"][k] - 1) <= V.TARGET for k in ("ttft_p50_ms", "itl_p50_ms", "goodput_req_s")}
            n["rows"] += 1
            n["ttft"] += ok["ttft_p50_ms"]
            n["itl"] += ok["itl_p50_ms"]
            n["goodput"] += ok["goodput_req_s"]
            n["all"] += all(ok.values())
            if show:
                ratio = " ".join(f"{r['ratio'][k]:.2f}" for k in ("ttft_p50_ms", "itl_p50_ms", "goodput_req_s"))
                print(
                    f"  {rule:24s} {run.split('/')[-1][:28]:28s} {mode:18s} {rate:5g}  {ratio}  "
                    f"{'yes' if all(ok.values()) else 'no'}"
                )
        return n
    finally:
        for name in patches:
            setattr(V, name, ORIG[name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--extra", default="v15_two", help="runs after the table, comma-separated ('' for none)")
    ap.add_argument("--rows", action="store_true", help="print every row that a rule moves across 15 %")
    args = ap.parse_args()
    rows = table_rows()
    extra = []
    for name in filter(None, args.extra.split(",")):
        path = RESULTS / f"{PREFIX}{name}_validation.json"
        extra += [(f"@{path}", r["mode"], r["rate"], 0, False) for r in json.loads(path.read_text())["rows"]]
    print(f"table: {len(rows)} rows, {sum(r[4] for r in rows)} within on all three as committed")
    for rule in args.rules.split(","):
        n, e = count(rule, rows, args.rows), count(rule, extra, args.rows) if extra else None
        more = f"; {args.extra}: all three {e['all']} of {e['rows']} (TTFT {e['ttft']}, ITL {e['itl']})" if e else ""
        print(
            f"{rule:24s} table: all three {n['all']} of {n['rows']} (TTFT {n['ttft']}, ITL {n['itl']}, "
            f"goodput {n['goodput']}){more}"
        )


if __name__ == "__main__":
    main()
