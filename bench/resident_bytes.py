"""GPU memory a role really allocates for its weights, against ``asympd memory``'s released-format
figure, at true V4.1 widths (a reduced depth: the full model does not fit one H200).

For each role and weight layout: random tensors of the role's checkpoint schema in storage formats
are generated on the GPU, the loader builds the model from them (``build_model``), the tensors it
did not keep are freed, and ``torch.cuda.memory_allocated`` is read. Writes ``resident_bytes.json``.

    python3 bench/resident_bytes.py
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd.model.loader import build_model  # noqa: E402
from asympd.model.schema import role_schema  # noqa: E402
from asympd.plan.memory import memory_report  # noqa: E402
from bench.common import log, random_tensors, record  # noqa: E402
from bench.p_throughput import reduced_config  # noqa: E402

DEV = torch.device("cuda")


def main() -> None:
    started = time.time()
    cfg = reduced_config()
    report = memory_report(cfg)["roles"]
    rows = []
    for role in ("prefill", "decode"):
        names = {s.name for s in role_schema(cfg, role)}
        # dequantized decode (three bf16 MoE layers, 27 GB each, plus the conversion's transient) would not
        # fit beside the generated tensors: the prefill role (one MoE layer) shows that layout's size
        layouts = ("packed", "packed-experts", "dequantized") if role == "prefill" else ("packed", "packed-experts")
        for weights in layouts:
            gc.collect()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(DEV)
            tensors = random_tensors(cfg, names.__contains__, DEV)
            model = build_model(cfg, tensors, role, dtype=torch.bfloat16, device=DEV, weights=weights)
            del tensors
            gc.collect()
            torch.cuda.empty_cache()
            allocated = torch.cuda.memory_allocated(DEV) - base
            want = report[role]["resident_bytes"]
            row = {
                "role": role,
                "weights": weights,
                "allocated_bytes": allocated,
                "model_resident_bytes": model.resident_bytes(),
                "released_format_bytes": want,
                "allocated_over_released": allocated / want,
            }
            rows.append(row)
            log(
                f"{role:8s} {weights:15s} allocated {allocated / 1e9:7.3f} GB | resident_bytes() "
                f"{row['model_resident_bytes'] / 1e9:7.3f} GB | asympd memory {want / 1e9:7.3f} GB | "
                f"x{row['allocated_over_released']:.4f}"
            )
            del model
    record(
        "resident_bytes",
        {"config": "bench.p_throughput.reduced_config(): V4.1 widths, 3 layers", "rows": rows},
        started,
    )


if __name__ == "__main__":
    main()
