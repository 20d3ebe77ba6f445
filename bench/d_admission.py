"""Decode-worker admission cost: the step time of a decode batch of B requests x (1 + k) rows with
j bounded prefills of W = 128 rows admitted into the same step.

Composed (anywhere) from the per-layer step times ``bench/layers.py`` measured on the GPU for
exactly these steps (``layers.json`` section ``d_steps``: each layer kind timed with the decode
group and the j prefill groups in one step, CUDA-graph replays), times the number of layers of
each kind in the 40-layer stack, plus the LM head for the rows that need logits (section ``head``).
Writes ``d_admission.json``. Not included: the DSpark draft pass, Engram lookups, sampling.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from asympd.plan.steps import interp  # one piecewise-linear rule for the bench and the planner
from bench.common import log, out_dir, record

D_COUNTS = {"swa": 2, "enc_src": 3, "enc_reuse": 15, "dec_src": 1, "dec_reidx": 4, "dec_reuse": 15}


def head_ms(layers: dict[str, Any], rows: int) -> float:
    pts = []
    for h in layers.get("head", []):
        t = h.get("bf16_f32out_ms", h["fp32_ms"])
        pts.append((h["rows"], t))
    return max(0.0, interp(pts, rows)) if pts else 0.0


def compose(layers: dict[str, Any], counts: dict[str, int] | None = None) -> dict[str, Any]:
    counts = counts or D_COUNTS
    rows = []
    for d in layers["d_steps"]:
        per_kind = {k: v["ms"] for k, v in d["kinds"].items()}
        layers_ms = sum(c * per_kind[k] for k, c in counts.items())
        logits_rows = d["B"] * d["q"] + d["j"]
        hm = head_ms(layers, logits_rows)
        rows.append(
            {
                "B": d["B"],
                "q": d["q"],
                "ctx": d["ctx"],
                "j": d["j"],
                "decode_rows": d["B"] * d["q"],
                "prefill_rows": d["j"] * 128,
                "layers_ms": layers_ms,
                "head_ms": hm,
                "step_ms": layers_ms + hm,
                "per_kind_ms": per_kind,
                "graph_modes": sorted({v.get("mode", "?") for v in d["kinds"].values()}),
            }
        )
    base = {r["B"]: r["step_ms"] for r in rows if r["j"] == 0}
    for r in rows:
        b = base.get(r["B"])
        if b and r["j"]:
            r["added_ms"] = r["step_ms"] - b
            r["added_pct"] = 100 * (r["step_ms"] / b - 1)
            r["added_ms_per_prefill"] = r["added_ms"] / r["j"]
    return {"steps": rows, "layer_counts": counts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None, help="result name (default: the script's, _smoke with --smoke)")
    args = ap.parse_args()
    started = time.time()
    d = out_dir()
    layers = json.loads(open(args.layers or d / ("layers_smoke.json" if args.smoke else "layers.json")).read())
    res = compose(layers)
    res["inputs"] = {"layers": layers.get("source_digest"), "layers_device": layers.get("device", {}).get("gpu")}
    record(args.out or ("d_admission_smoke" if args.smoke else "d_admission"), res, started)
    for r in res["steps"]:
        log(
            f"B={r['B']:4d} j={r['j']}: step {r['step_ms']:.2f} ms"
            + (f" (+{r['added_pct']:.1f}%, {r['added_ms_per_prefill']:.2f} ms/prefill)" if r.get("added_ms") else "")
        )


if __name__ == "__main__":
    main()
