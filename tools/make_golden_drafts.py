#!/usr/bin/env python3
"""Regenerate tests/model/golden_drafts.json: the DSpark drafts (and digests of their logits and
confidence logits) along a greedy decode of the seed-0 tiny checkpoint, in fp32 and bf16.

Only regenerate after checking the drafter against the official reference
(tools/check_against_reference.py, docs/reference-check.md, "DSpark drafts") and saying in the
commit why the numbers moved: the file exists to catch changes nobody meant to make.

    .venv/bin/python tools/make_golden_drafts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.model import golden_drafts as golden  # noqa: E402
from tests.util import random_prompts  # noqa: E402
from tools.golden_common import run_on_tiny, write_golden  # noqa: E402

COMMAND = ".venv/bin/python tools/make_golden_drafts.py"


def main() -> None:
    prompts = random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED)
    outputs, provenance = run_on_tiny(golden.CHECKPOINT["seed"], lambda ckpt: golden.compute(ckpt, prompts))
    doc = {
        "about": (
            "Absolute anchors for tests/model/test_golden_drafts.py: the DSpark drafter's greedy drafts along "
            "a greedy decode (a block after the prefill, then one after every decode step), with sha256 "
            "digests of the Markov-biased draft logits and the confidence logits (fp32 bytes). Made by the "
            "drafter that tools/check_against_reference.py compared with the reference's forward_spec, as "
            "documented in docs/reference-check.md. Regenerate only after re-checking against the reference."
        ),
        "command": COMMAND,
        **provenance,
        "checkpoint": golden.CHECKPOINT,
        "prompts": {"lengths": golden.LENGTHS, "seed": golden.PROMPT_SEED, "helper": "tests.util.random_prompts"},
        "steps": golden.STEPS,
        "tie_rule": "greedy: first maximum of each Markov-biased row (torch.argmax), as the reference's sample()",
        "outputs": outputs,
    }
    write_golden(golden.GOLDEN, doc)
    print(f"wrote {golden.GOLDEN} ({len(outputs)} dtypes x {len(golden.LENGTHS)} prompts x {golden.STEPS} blocks)")


if __name__ == "__main__":
    main()
