"""Absolute anchors: what every mode and semantics outputs on a fixed tiny checkpoint.

Every other numerics test is differential (two paths that share the same code must agree); these
pin the numbers themselves, so a bug both sides share (a top-k tie rule, a window floor) still
shows. ``tools/make_golden.py`` writes ``golden_tiny.json`` with ``outputs``; test_golden.py
recomputes it and compares. Not a test module.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from asympd import LLM, SamplingParams
from asympd.engine.modes import VARIANTS
from tests.util import for_cpu

GOLDEN = Path(__file__).with_name("golden_tiny.json")
CHECKPOINT = {"config": "tiny", "seed": 0}  # write_checkpoint(tiny(), out, seed=0), as tests/conftest.py
# N <= W, N = W + 1 (odd split), even split, long ones past the compressed top-k and candidate pool
LENGTHS = [5, 17, 24, 33, 50, 100]
PROMPT_SEED = 31
MAX_TOKENS = 6
HASHED_STEPS = 3  # full-vocabulary log-probabilities of the first steps go into the hash


def variant_name(mode: str, semantics: str, policy: str) -> str:
    return f"{mode}/{semantics}/{policy}" if mode == "colocated" else f"{mode}/{policy}"


def logprobs_digest(steps: list[dict[int, float]]) -> str:
    """sha256 of the fp32 bytes of each step's log-probabilities, in vocabulary order."""
    h = hashlib.sha256()
    for lp in steps:
        assert list(lp) == list(range(len(lp))), "expected the whole vocabulary"
        h.update(torch.tensor(list(lp.values()), dtype=torch.float32).numpy().tobytes())
    return h.hexdigest()


def logprob_digests(doc: dict, kernels: str) -> dict[str, list[str]] | None:
    """Each variant's per-prompt log-probability digests recorded for CPU kernel family ``kernels``
    (``tests.util.for_cpu``): on an AVX2 machine every token equals the main record (made on an
    earlier development machine, whose family was not recorded) but some fp32 log-probability bits
    do not."""
    main = {v: [o["logprobs_sha256"] for o in outs] for v, outs in doc["outputs"].items()}
    return for_cpu(doc, "logprobs_sha256_by_cpu", main, kernels)


def tokens_of(outputs: dict[str, list[dict]]) -> dict[str, list[list[int]]]:
    """Each variant's greedy tokens, per prompt, from ``compute``'s outputs (or a record's)."""
    return {v: [o["token_ids"] for o in outs] for v, outs in outputs.items()}


def token_ids(doc: dict, kernels: str) -> dict[str, list[list[int]]] | None:
    """Each variant's greedy tokens for CPU kernel family ``kernels``: the main record's, or where a
    family chose otherwise at a near-tie (``tools/make_golden.py --add-cpu`` checks that it was one),
    that family's own."""
    return for_cpu(doc, "token_ids_by_cpu", tokens_of(doc["outputs"]), kernels)


def compute(checkpoint: str, prompts: list[list[int]], keep_logprobs: bool = False) -> dict[str, list[dict]]:
    """Greedy outputs of every deployment variant (fp32, the engine's default); ``keep_logprobs``
    adds every step's whole-vocabulary log-probabilities (``logprobs``, for the tools)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=-1)
    out: dict[str, list[dict]] = {}
    for mode, semantics, policy in VARIANTS:
        llm = LLM(checkpoint, mode, semantics, boundary_policy=policy)
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        out[variant_name(mode, semantics, policy)] = [
            {
                "n": len(p),
                "token_ids": r.outputs[0].token_ids,
                "logprobs_sha256": logprobs_digest(r.outputs[0].logprobs[:HASHED_STEPS]),
                **({"logprobs": r.outputs[0].logprobs} if keep_logprobs else {}),
            }
            for p, r in zip(prompts, results, strict=True)
        ]
    return out
