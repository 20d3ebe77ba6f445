#!/usr/bin/env python3
"""Regenerate tests/engine/golden_tiny.json: the greedy tokens and a hash of the full-vocabulary
log-probabilities of every mode and semantics on the seed-0 tiny checkpoint.

Only regenerate after checking the model against the official reference
(tools/check_against_reference.py, docs/reference-check.md) and saying in the commit why the
numbers moved: the file exists to catch changes nobody meant to make.

    .venv/bin/python tools/make_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.engine import golden  # noqa: E402
from tests.util import random_prompts  # noqa: E402
from tools.golden_common import run_on_tiny, write_golden  # noqa: E402

COMMAND = ".venv/bin/python tools/make_golden.py"


def main() -> None:
    prompts = random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED)
    outputs, provenance = run_on_tiny(golden.CHECKPOINT["seed"], lambda ckpt: golden.compute(ckpt, prompts))
    doc = {
        "about": (
            "Absolute anchors for tests/engine/test_golden.py. Produced by the CPU model (fp32, one torch "
            "thread) that was checked against the official DeepSeek-V4.1-Flash reference inference code as "
            "documented in docs/reference-check.md (tools/check_against_reference.py: with the reference's "
            "two non-numerical differences removed, bf16 prefill bit-identical at every layer for 28 of 30 "
            "prompts). Regenerate only after re-checking against the reference."
        ),
        "command": COMMAND,
        **provenance,
        "checkpoint": golden.CHECKPOINT,
        "prompts": {"lengths": golden.LENGTHS, "seed": golden.PROMPT_SEED, "helper": "tests.util.random_prompts"},
        "sampling": {"max_tokens": golden.MAX_TOKENS, "temperature": 0, "logprobs": -1},
        "logprobs_sha256": f"sha256, fp32 whole-vocabulary log-probabilities of steps 0..{golden.HASHED_STEPS - 1}",
        "outputs": outputs,
    }
    write_golden(golden.GOLDEN, doc)
    print(f"wrote {golden.GOLDEN} ({len(outputs)} variants x {len(golden.LENGTHS)} prompts)")


if __name__ == "__main__":
    main()
