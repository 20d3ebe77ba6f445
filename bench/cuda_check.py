"""The device-run record that the CUDA path agrees with the CPU reference on the tiny checkpoint.

Writes ``cuda_check.json``: per prompt and prefill semantics, the relative error and argmax
agreement of CUDA (bf16, fast paths) logits against the CPU bf16 reference; the same for the FP8
expert / FP8 linear variants; greedy tokens from the asymmetric engine on both devices. The pytest
file ``tests/model/test_cuda.py`` asserts the tolerances; this records the numbers.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import log, record


def run_semantics(model, ids, semantics):
    """Logits of every row of the last phase of ``semantics`` (fp32, on the CPU)."""
    from asympd.engine.modes import colocated_phases
    from asympd.kv.dense import DenseSequenceKV
    from asympd.model.transformer import Chunk, Depth

    kv = DenseSequenceKV(model.cfg, dtype=model.dtype, device=model.device)
    logits = None
    for ph in colocated_phases(model.cfg, len(ids), semantics):
        last = ph.depth is Depth.ALL
        chunk = Chunk(
            kv,
            ids[ph.lo : ph.hi],
            ph.lo,
            ids,
            ph.depth,
            ph.floor,
            ph.encoder_floor,
            ph.write_global,
            logits="all" if last else "none",
        )
        out = model([chunk])
        logits = out.logits[0] if last else logits
    return logits.float().cpu()


def main() -> None:
    from asympd.config import tiny
    from asympd.engine.llm import LLM
    from asympd.engine.sampling import SamplingParams
    from asympd.model.checkpoint import write_checkpoint
    from asympd.model.cuda_ops import accelerate, caps, fast_path_info
    from asympd.model.loader import load_model

    dev = os.environ.get("ASYMPD_CHECK_DEVICE", "cuda")  # "cpu": plumbing check without a GPU
    started = time.time()
    ckpt = Path(tempfile.mkdtemp()) / "tiny"
    write_checkpoint(tiny(), ckpt, seed=0)
    bf, f32 = torch.bfloat16, torch.float32
    refs = {"cpu_fp32": load_model(ckpt, "full"), "cpu_bf16": load_model(ckpt, "full", dtype=bf)}
    variants = {
        "cuda_fp32": load_model(ckpt, "full", device=dev),
        "cuda_bf16": load_model(ckpt, "full", device=dev, dtype=bf),
    }
    if caps(torch.device(dev)).get("scaled_grouped_mm"):
        variants["cuda_bf16_fp8_experts"] = accelerate(load_model(ckpt, "full", device=dev, dtype=bf), experts="fp8")
        variants["cuda_bf16_fp8_experts_linears"] = accelerate(
            load_model(ckpt, "full", device=dev, dtype=bf), experts="fp8", linears="fp8"
        )
    gen = torch.Generator().manual_seed(0)

    rows = []
    for n in (17, 60, 300, 900):
        ids = torch.randint(3, 512, (n,), generator=gen)
        for sem in ("full", "split", "decoder-replay"):
            outs = {name: run_semantics(m, ids, sem) for name, m in {**refs, **variants}.items()}
            for name in ["cpu_bf16", *variants]:
                got = outs[name]
                row = {"n": n, "semantics": sem, "variant": name}
                for rname in refs:
                    ref = outs[rname]
                    row[f"rel_vs_{rname}"] = float((got.double() - ref.double()).norm() / ref.double().norm())
                    row[f"argmax_vs_{rname}"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
                rows.append(row)
                log(
                    f"n={n} {sem:14s} {name:30s} vs fp32 {row['rel_vs_cpu_fp32']:.2e} "
                    f"vs cpu bf16 {row['rel_vs_cpu_bf16']:.2e} argmax vs fp32 {row['argmax_vs_cpu_fp32']:.3f}"
                )
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (20, 150, 300, 700)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine = {}
    for dt in (f32, bf):
        tag = str(dt).removeprefix("torch.")
        for name, d in (("cpu", "cpu"), ("cuda", dev)):
            t0 = time.time()
            llm = LLM(ckpt, mode="asymmetric", device=d, dtype=dt)
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            toks = [o.outputs[0].token_ids for o in outs]
            engine[f"{name}_{tag}"] = {"tokens": toks, "wall_s": round(time.time() - t0, 2)}
        same_prefix = []
        for a, b in zip(engine[f"cpu_{tag}"]["tokens"], engine[f"cuda_{tag}"]["tokens"], strict=True):
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            same_prefix.append(k)
        engine[f"identical_leading_tokens_{tag}"] = same_prefix
    log("engine", engine)

    def worst(variant: str, ref: str) -> float:
        return max(r[f"rel_vs_{ref}"] for r in rows if r["variant"] == variant)

    record(
        "cuda_check" if dev == "cuda" else "cuda_check_smoke",
        {
            "forward": rows,
            "engine_asymmetric_greedy": engine,
            "fast_path": fast_path_info(torch.device(dev)),
            "fp8_report": {k: getattr(v, "fast_path", None) for k, v in variants.items()},
            "max_rel_cuda_fp32_vs_cpu_fp32": worst("cuda_fp32", "cpu_fp32"),
            "max_rel_cuda_bf16_vs_cpu_fp32": worst("cuda_bf16", "cpu_fp32"),
            "max_rel_cpu_bf16_vs_cpu_fp32": worst("cpu_bf16", "cpu_fp32"),
            "max_rel_cuda_bf16_vs_cpu_bf16": worst("cuda_bf16", "cpu_bf16"),
        },
        started,
    )


if __name__ == "__main__":
    main()
