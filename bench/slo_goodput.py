"""Goodput of an end-to-end result under other SLOs, from its recorded per-request TTFTs and ITLs.

``bench/e2e.py`` measures goodput under one SLO, but its JSON keeps every request's TTFT and token
gaps, so the same runs can be read under tighter targets without another device call. This is post
hoc: the deployments were not tuned for these targets. The definition is the run's own: requests
whose TTFT and every ITL meet the targets, per second of the run, per GPU.

    python bench/slo_goodput.py bench/results/e2e_h200x1_depth40.json --slo 2000:200 --slo 3000:150

Writes ``<result>_slo_goodput.json`` beside the other results (``bench/common.py`` ``record``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log, record  # noqa: E402


def met(run: dict[str, Any], ttft_ms: float, itl_ms: float) -> int:
    """Requests of one rate run whose TTFT and every inter-token gap meet the targets."""
    q = run["requests"]
    return sum(
        1
        for ttft, itls, err in zip(q["ttfts"], q["itls"], q["errors"], strict=True)
        if not err and ttft * 1e3 <= ttft_ms and max(itls, default=0.0) * 1e3 <= itl_ms
    )


def slo_goodput(result: dict[str, Any], slos: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Per SLO, mode and rate: requests that met it and goodput in requests/s per GPU."""
    rows = []
    for ttft_ms, itl_ms in slos:
        for mode, m in result["modes"].items():
            for run in m.get("runs", []):
                n = met(run, ttft_ms, itl_ms)
                rows.append(
                    {
                        "slo_ttft_ms": ttft_ms,
                        "slo_itl_ms": itl_ms,
                        "mode": mode,
                        "rate": run["request_rate"],
                        "met": n,
                        "requests": run["completed"] + run["failed"],
                        "goodput_req_per_s_per_gpu": n / run["duration"] / max(1, run["gpus"]),
                    }
                )
    return rows


def parse_slo(text: str) -> tuple[float, float]:
    try:
        ttft, itl = (float(v) for v in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"an SLO is TTFT_MS:ITL_MS, got {text!r}") from e
    return ttft, itl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a bench/e2e.py result JSON")
    ap.add_argument("--slo", type=parse_slo, action="append", required=True, help="TTFT_MS:ITL_MS (repeatable)")
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    rows = slo_goodput(result, args.slo)
    for r in rows:
        log(
            f"TTFT <= {r['slo_ttft_ms']:g} ms, ITL <= {r['slo_itl_ms']:g} ms: {r['mode']} @ {r['rate']:g} req/s "
            f"{r['met']}/{r['requests']} met, {r['goodput_req_per_s_per_gpu']:.2f} req/s per GPU"
        )
    source = {"file": args.result.name, "commit": result.get("commit"), "device": result.get("device")}
    record(f"{args.result.stem}_slo_goodput", {"source": source, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
