"""Where each request's time to first token went, per mode and rate of a ``bench/e2e.py`` result, from
the servers' own timings (``requests.asympd_timings``, kept since the seventh session); given a second
result, the same for it and the ratio of each part (second / first).

The parts of a P/D request's TTFT (the client's clock; every part a server measured itself):

- ``p``: P's prefill, from its add to the prefix ready (queue and compute: ``prefill_s``);
- ``publish``: P sealing and registering the prefix (``publish_s``; packing it is in here);
- ``answer``: the rest of P's round trip as the router saw it (HTTP, JSON:
  ``prefill_rtt_s - prefill_s - publish_s``);
- ``fetch``: D pulling the prefix from P and checking it (``transfer_s``);
- ``d``: D's add to its first token (its queue and the bounded prefill: ``decode_first_step_s``);
- ``other``: the client's TTFT less all of the above (the router's hops, D's HTTP).

Results since the ninth session also split ``fetch`` as D timed it (``FETCH_PARTS``): ``arrive``
(the bytes arriving: the socket, or the NIXL read), ``unpack`` (the packed KV to values, on D's
GPU where it has one) and ``check`` (the tag and ``PrefixState.validate``); the rest of ``fetch``
is the connection, the request and the ack. They also split ``answer``: ``export`` (P waiting
for its prefix's copy off the device after the prefill, ``export_s``) and the rest (HTTP, JSON).
Results since the thirtieth session split ``p`` and ``d`` too: ``queue`` (the request waiting for
the engine's first step, ``prefill_queue_s`` / ``decode_queue_s``) and ``compute`` (the rest: its
steps, and the steps of others that it shares or waits between).

What it is for: reading a change of the hand-off (docs/prefix-transfer.md §1) or of P's steps
off two runs at the same rates, part by part, instead of off TTFT alone.

    python tools/ttft_breakdown.py bench/results/e2e_h200x1_depth40_oos3.json [NEW.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

PARTS = ("p", "publish", "answer", "fetch", "d", "other")
FETCH_PARTS = ("arrive", "unpack", "check")


def parts(timings: dict[str, Any], ttft_s: float) -> dict[str, float] | None:
    """One request's TTFT split in seconds; None for a request that did not go through P and D."""
    need = ("prefill_s", "prefill_rtt_s", "publish_s", "transfer_s", "decode_first_step_s")
    if timings.get("prefill_path") != "remote" or any(timings.get(k) is None for k in need):
        return None
    t = {k: float(timings[k]) for k in need}
    out = {
        "p": t["prefill_s"],
        "publish": t["publish_s"],
        "answer": t["prefill_rtt_s"] - t["prefill_s"] - t["publish_s"],
        "fetch": t["transfer_s"],
        "d": t["decode_first_step_s"],
    }
    out["other"] = ttft_s - t["prefill_rtt_s"] - t["transfer_s"] - t["decode_first_step_s"]
    return out


def fetch_parts(timings: dict[str, Any]) -> dict[str, float] | None:
    """D's fetch of one request split (seconds), where its server timed the parts."""
    got = {k: timings.get(f"transfer_{k}_s") for k in FETCH_PARTS}
    return None if any(v is None for v in got.values()) else {k: float(v) for k, v in got.items()}


def breakdown(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"MODE@RATE": {"requests": n, "ttft": {p50, p90}, PART: {p50, p90}}}`` in seconds, for every
    rate run whose requests kept their timings."""
    out: dict[str, dict[str, Any]] = {}
    for mode, m in result.get("modes", {}).items():
        for run in m.get("runs", []):
            req = run.get("requests", {})
            timings = req.get("asympd_timings")
            if not timings:
                continue
            split = [
                (t, ttft, p)
                for t, ttft, err in zip(timings, req["ttfts"], req["errors"], strict=True)
                if not err and t and (p := parts(t, ttft)) is not None
            ]
            if not split:
                continue
            row: dict[str, Any] = {"requests": len(split), "ttft": _pcts([ttft for _, ttft, _ in split])}
            for k in PARTS:
                row[k] = _pcts([p[k] for _, _, p in split])
            fetched = [f for t in timings if t and (f := fetch_parts(t)) is not None]
            if fetched:
                row["fetch_split"] = {k: _pcts([f[k] for f in fetched]) for k in FETCH_PARTS}
            for part, key in (("p", "prefill_queue_s"), ("d", "decode_queue_s")):
                queued = [(t[key], p[part]) for t, _, p in split if t.get(key) is not None]
                if queued:
                    row[f"{part}_split"] = {
                        "queue": _pcts([q for q, _ in queued]),
                        "compute": _pcts([x - q for q, x in queued]),
                    }
            answered = [(t["export_s"], p["answer"], t) for t, _, p in split if t.get("export_s") is not None]
            if answered:
                row["answer_split"] = {
                    "export": _pcts([e for e, _, _ in answered]),
                    "rest": _pcts([a - e for e, a, _ in answered]),
                }
                # of the export, the copy itself on P's GPU (timed since the tenth session; the rest
                # of the export is P's step still computing when the server asked for the bytes)
                copies = [t["export_copy_s"] for _, _, t in answered if t.get("export_copy_s") is not None]
                if copies:
                    row["answer_split"]["export copy"] = _pcts(copies)
            out[f"{mode}@{run['request_rate']:g}"] = row
    return out


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))]}


def format_table(name: str, rows: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]] | None = None) -> str:
    head = f"{'mode@rate':24} {'n':>3} " + " ".join(f"{k + ' p50':>12}" for k in ("ttft", *PARTS))
    lines = [f"TTFT parts, ms (p50; p90 in --json): {name}", head, "-" * len(head)]
    for key, row in rows.items():
        cells = []
        for k in ("ttft", *PARTS):
            v = row[k]["p50"] * 1e3
            ref = (base or {}).get(key, {}).get(k)
            cells.append(f"{v:7.0f} ({v / (ref['p50'] * 1e3):.2f})" if ref and ref["p50"] > 0 else f"{v:12.0f}")
        lines.append(f"{key:24} {row['requests']:>3} " + " ".join(f"{c:>12}" for c in cells))
    if not rows:
        lines.append(
            "no rate run kept the servers' timings (requests.asympd_timings: results since the seventh session)"
        )
    if base:
        lines.append("(in brackets: this result's p50 over the first's, same mode and rate)")
    split = {key: row["fetch_split"] for key, row in rows.items() if "fetch_split" in row}
    if split:
        lines.append("D's fetch split, ms (p50): " + ", ".join(FETCH_PARTS))
        for key, f in split.items():
            lines.append(f"{key:24} " + " ".join(f"{f[k]['p50'] * 1e3:12.1f}" for k in FETCH_PARTS))
    for part, who in (("p", "P"), ("d", "D")):
        split = {key: row[f"{part}_split"] for key, row in rows.items() if f"{part}_split" in row}
        if split:
            lines.append(f"{who}'s part split, ms (p50): queue, compute")
            for key, f in split.items():
                lines.append(f"{key:24} " + " ".join(f"{f[k]['p50'] * 1e3:12.1f}" for k in ("queue", "compute")))
    split = {key: row["answer_split"] for key, row in rows.items() if "answer_split" in row}
    if split:
        cols = [k for k in ("export", "export copy", "rest") if any(k in f for f in split.values())]
        lines.append("P's answer split, ms (p50): " + ", ".join(cols))
        for key, f in split.items():
            lines.append(f"{key:24} " + " ".join(f"{f[k]['p50'] * 1e3:12.1f}" if k in f else " " * 12 for k in cols))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", metavar="RESULT.json", help="one result, or a first and a second")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if len(args.results) > 2:
        ap.error("give one result, or two to compare")
    loaded = [(p, json.loads(Path(p).read_text())) for p in args.results]
    tables = [(p, breakdown(r)) for p, r in loaded]
    if args.json:
        print(json.dumps({p: t for p, t in tables}, indent=1))
        return 0
    base = None
    for path, rows in tables:
        print(format_table(Path(path).name, rows, base))
        base = rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
