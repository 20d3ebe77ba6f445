"""How much the CPU fp32 reference moves under a rounding-level perturbation of its input, on the
prompts of ``bench/cuda_check.py``: the yardstick for the CUDA-vs-CPU fp32 differences recorded there.

The model's FP8/FP4 activation quantizers are step functions; a 1e-7..1e-6 relative change (what a
different summation order produces) occasionally crosses a step, and the small random model
amplifies the jump. Writes ``cpu_sensitivity.json`` (CPU only).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench.common import log, record


def main() -> None:
    from asympd.config import tiny
    from asympd.model.checkpoint import write_checkpoint
    from asympd.model.loader import load_model
    from bench.cuda_check import run_semantics

    started = time.time()
    ckpt = Path(tempfile.mkdtemp()) / "tiny"
    write_checkpoint(tiny(), ckpt, seed=0)
    model = load_model(ckpt, "full")
    gen = torch.Generator().manual_seed(0)  # the same prompts as cuda_check
    rows = []
    emb = model.embed
    for n in (17, 60, 300, 900):
        ids = torch.randint(3, 512, (n,), generator=gen)
        for sem in ("full", "split", "decoder-replay"):
            model.embed = emb
            base = run_semantics(model, ids, sem)
            for eps in (1e-7, 1e-6):
                for seed in range(3):
                    g = torch.Generator().manual_seed(seed)
                    model.embed = emb * (1 + eps * torch.randn(emb.shape, generator=g))
                    got = run_semantics(model, ids, sem)
                    r = float((got.double() - base.double()).norm() / base.double().norm())
                    rows.append({"n": n, "semantics": sem, "eps": eps, "seed": seed, "rel": r})
                    log(rows[-1])
    model.embed = emb
    record(
        "cpu_sensitivity",
        {"rows": rows, "max_rel_eps_1e-6": max(r["rel"] for r in rows if r["eps"] == 1e-6)},
        started,
    )


if __name__ == "__main__":
    main()
