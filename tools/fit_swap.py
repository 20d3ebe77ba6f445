"""Which fitted quantity moves a validation: swap one group of another result's fitted step pieces
(or its rate runs' arrivals) into a result's validation, mode by mode, and print the rows' predicted
TTFT p50 / ITL p50 (ms) for each swap. Both results must hold the same modes (e.g. v14 and v15, the
same traffic). Nothing here changes a rule: the swap is made where ``validate_e2e`` hands the fitted
steps to the simulator (``simulate_deployment``).

    python tools/fit_swap.py bench/results/e2e_h200x1_depth40_v15_two.json \
        bench/results/e2e_h200x1_depth40_v14_two.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from asympd.plan import validate as V

# groups of MeasuredSteps fields (and the StageLoad, the arrivals) swapped together
GROUPS: dict[str, tuple[str, ...]] = {
    "P line": ("p_step_ms", "p_row_ms"),
    "P windows": ("p_window_ms",),
    "D decode (lone step, ladder, seq)": ("d_step_ms", "d_ladder_ms", "d_seq_ms"),
    "D ladder only": ("d_ladder_ms",),
    "D lone step only": ("d_step_ms",),
    "D prompt rows": ("d_pre_ms", "d_row_ms", "mix_pre_ms", "mix_row_ms"),
    "move (line, beside P)": ("move_ms", "move_row_ms", "move_beside_p_ms"),
    "P answer (handoff)": ("handoff_ms",),
    "TTFT offset": ("ttft_offset_ms",),
    "serving load": ("@load",),
    "arrivals": ("@arrivals",),
}


def _capture(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per mode: the steps and load the rows are simulated with, and each rate's arrivals."""
    seen: dict[str, dict[str, Any]] = {}
    orig = V.simulate_deployment

    def spy(cfg, steps, arrivals, dep, path, load=None):  # noqa: ANN001, ANN202
        s = seen.setdefault(dep.mode, {"arrivals": []})
        s["steps"], s["load"] = steps, load
        s["arrivals"].append(arrivals)  # the batch check's first, then each rate's
        return orig(cfg, steps, arrivals, dep, path, load)

    V.simulate_deployment = spy
    try:
        V.validate_e2e(result)
    finally:
        V.simulate_deployment = orig
    return seen


def swapped(result: dict[str, Any], donor: dict[str, dict[str, Any]], fields: tuple[str, ...]) -> dict[str, Any]:
    """``result``'s validation with ``fields`` of each mode's fitted steps taken from ``donor``
    (``_capture``'s record of another result): "@load" the serving-load slopes, "@arrivals" each
    rate run's arrivals (the k-th simulate call of the mode gets the donor's k-th)."""
    orig = V.simulate_deployment
    calls: dict[str, int] = {}

    def swap(cfg, steps, arrivals, dep, path, load=None):  # noqa: ANN001, ANN202
        d = donor[dep.mode]
        k = calls[dep.mode] = calls.get(dep.mode, -1) + 1
        plain = [f for f in fields if not f.startswith("@")]
        if plain:
            steps = replace(steps, **{f: getattr(d["steps"], f) for f in plain})
        if "@load" in fields:
            load = d["load"]
        if "@arrivals" in fields and k < len(d["arrivals"]):
            arrivals = d["arrivals"][k]
        return orig(cfg, steps, arrivals, dep, path, load)

    V.simulate_deployment = swap
    try:
        return V.validate_e2e(result)
    finally:
        V.simulate_deployment = orig


def _cells(v: dict[str, Any]) -> list[str]:
    return [f"{r['predicted']['ttft_p50_ms']:6.0f}/{r['predicted']['itl_p50_ms']:4.1f}" for r in v["rows"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="the result validated")
    ap.add_argument("donor", type=Path, help="the result whose fitted pieces are swapped in")
    args = ap.parse_args()
    res, don = json.loads(args.result.read_text()), json.loads(args.donor.read_text())
    donor = _capture(don)
    base = V.validate_e2e(res)
    heads = [f"{r['mode'][:5]}@{r['rate']:g}" for r in base["rows"]]
    print(f"{'swapped in from ' + args.donor.stem:36s} " + " ".join(f"{h:>11s}" for h in heads) + "  all3")
    meas = [f"{r['measured']['ttft_p50_ms']:6.0f}/{r['measured']['itl_p50_ms']:4.1f}" for r in base["rows"]]
    print(f"{'measured (' + args.result.stem[-8:] + ')':36s} " + " ".join(meas))
    print(f"{'none (as validated)':36s} " + " ".join(_cells(base)) + f"  {base['summary']['all_three']}")
    for name, fields in GROUPS.items():
        v = swapped(res, donor, fields)
        print(f"{name:36s} " + " ".join(_cells(v)) + f"  {v['summary']['all_three']}")
    v = swapped(res, donor, tuple(f for fs in GROUPS.values() for f in fs if f != "@arrivals"))
    print(f"{'every fitted piece':36s} " + " ".join(_cells(v)) + f"  {v['summary']['all_three']}")
    dv = V.validate_e2e(don)
    print(f"{'donor as validated':36s} " + " ".join(_cells(dv)) + f"  {dv['summary']['all_three']}")


if __name__ == "__main__":
    main()
