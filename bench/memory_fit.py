"""The prefill-replica memory fit on H200 / B200 / B300 from ``asympd memory`` (``plan/memory.py``),
with the GPU counts each P role needs: resident weights over (capacity - reserve), rounded up.
Writes ``memory.json``. Computed, not measured (schema bytes; no GPU needed)."""

from __future__ import annotations

import math
import time

from bench.common import record


def main() -> None:
    from asympd.config import v41_flash
    from asympd.plan.memory import memory_report

    started = time.time()
    out = {}
    for ctx in (32768, 65536):
        rep = memory_report(v41_flash(), context_tokens=ctx)
        out[str(ctx)] = rep
    rep = out["32768"]
    weights = {r: rep["roles"][r]["weights_bytes"] for r in rep["roles"]}
    reserve = rep["assumptions"]["reserve_gb"] * 1e9
    gpus_needed = {
        gpu: {
            "asymmetric_P (prefill role)": math.ceil(weights["prefill"] / (g["capacity_bytes"] - reserve)),
            "symmetric_P (full model)": math.ceil(weights["full"] / (g["capacity_bytes"] - reserve)),
        }
        for gpu, g in rep["gpus"].items()
    }
    record(
        "memory",
        {
            "reports_by_context": out,
            "weights_gb": {k: v / 1e9 for k, v in weights.items()},
            "p_weights_ratio_prefill_over_full": weights["prefill"] / weights["full"],
            "gpus_needed_for_weights": gpus_needed,
            "command_equivalent": "asympd memory --config v41-flash --json [--context 65536]",
        },
        started,
    )
    print(gpus_needed, weights["prefill"] / weights["full"])


if __name__ == "__main__":
    main()
