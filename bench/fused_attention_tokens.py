"""Where the fused sparse attention's greedy tokens part from the gathered path's on CUDA (fp32, the
tiny random checkpoint): each attention path eagerly and with CUDA graphs, same prompts. Eager
fused = eager gathered but graphs differ points at the replay; eager paths already differing at
per-call errors below 1e-5 points at the random model's sensitivity (a value crossing an FP8/FP4
quantizer step). At each first difference it records the reference run's top-2 logprob gap there: a
gap of ~1e-5 or less says the two paths chose between near-tied tokens (sensitivity); a gap of
whole nats says one path computed something else. Writes ``fused_attention_tokens.json``.

    python3 bench/fused_attention_tokens.py
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asympd import LLM, SamplingParams  # noqa: E402
from asympd.config import tiny  # noqa: E402
from asympd.model.checkpoint import write_checkpoint  # noqa: E402
from asympd.model.cuda_ops import CUDA_KERNELS  # noqa: E402
from bench.common import log, record  # noqa: E402
from tests.util import random_prompts  # noqa: E402

LENGTHS = [20, 40, 90, 150, 300]  # tests/engine/test_cuda_engine.py's prompts


def tokens(ckpt: str, mode: str, spec: int, fused: bool, eager: bool) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's greedy tokens and, per position, the gap between its top two logprobs."""
    llm = LLM(
        ckpt,
        mode,
        "split" if mode == "colocated" else "full",
        device="cuda",
        dtype=torch.float32,
        num_spec_tokens=spec,
        enforce_eager=eager,
        cuda_graph_capture="lazy",
    )
    for e in (llm.prefill, llm.engine):
        for block in [] if e is None else e.runner.model.blocks:
            if getattr(block, "attn", None) is not None:
                block.attn.kernels = dataclasses.replace(CUDA_KERNELS, fused_attention=fused)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompt_token_ids=random_prompts(LENGTHS, seed=41), sampling_params=params)
    gaps = [[top2_gap(lp) for lp in o.outputs[0].logprobs] for o in outs]
    return [o.outputs[0].token_ids for o in outs], gaps


def top2_gap(logprobs: dict[int, float]) -> float:
    best = sorted(logprobs.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [
        next((i for i, (x, y) in enumerate(zip(s, t, strict=True)) if x != y), None) for s, t in zip(a, b, strict=True)
    ]


def main() -> None:
    started = time.time()
    out: dict = {"cases": []}
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(Path(d) / "tiny")
        write_checkpoint(tiny(), ckpt, seed=0)
        for mode, spec in (("colocated", 2), ("asymmetric", 0)):
            runs, gaps = {}, {}
            for f in (False, True):
                for e in (True, False):
                    name = f"{'fused' if f else 'gathered'}_{'eager' if e else 'graphs'}"
                    runs[name], gaps[name] = tokens(ckpt, mode, spec, f, e)
            ref = runs["gathered_eager"]
            case = {"mode": mode, "spec": spec, "tokens": runs, "top2_gaps": gaps}
            case["first_difference_vs_gathered_eager"] = {k: first_difference(ref, v) for k, v in runs.items()}
            case["reference_top2_gap_at_difference"] = {
                k: [None if i is None else gaps["gathered_eager"][p][i] for p, i in enumerate(firsts)]
                for k, firsts in case["first_difference_vs_gathered_eager"].items()
            }
            out["cases"].append(case)
            log(mode, spec, case["first_difference_vs_gathered_eager"], case["reference_top2_gap_at_difference"])
    record("fused_attention_tokens", out, started)


if __name__ == "__main__":
    main()
