#!/usr/bin/env python3
"""Regenerate tests/model/golden_drafts.json: the DSpark drafts (and digests of their logits and
confidence logits) along a greedy decode of the seed-0 tiny checkpoint, in fp32 and bf16.

Only regenerate after checking the drafter against the official reference
(tools/check_against_reference.py, docs/reference-check.md, "DSpark drafts") and saying in the
commit why the numbers moved: the file exists to catch changes nobody meant to make.

    .venv/bin/python tools/make_golden_drafts.py
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asympd.config import tiny  # noqa: E402
from asympd.model.checkpoint import write_checkpoint  # noqa: E402
from tests.model import golden_drafts as golden  # noqa: E402
from tests.util import random_prompts  # noqa: E402

COMMAND = ".venv/bin/python tools/make_golden_drafts.py"


def main() -> None:
    torch.set_num_threads(1)  # as the tests run: fp32 summation order follows the thread count
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "tiny"
        write_checkpoint(tiny(), ckpt, seed=golden.CHECKPOINT["seed"])
        outputs = golden.compute(str(ckpt), random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED))
    doc = {
        "about": (
            "Absolute anchors for tests/model/test_golden_drafts.py: the DSpark drafter's greedy drafts along "
            "a greedy decode (a block after the prefill, then one after every decode step), with sha256 "
            "digests of the Markov-biased draft logits and the confidence logits (fp32 bytes). Made by the "
            "drafter that tools/check_against_reference.py compared with the reference's forward_spec, as "
            "documented in docs/reference-check.md. Regenerate only after re-checking against the reference."
        ),
        "command": COMMAND,
        "made_at_commit": commit,
        "environment": {"torch": torch.__version__, "machine": platform.machine(), "threads": 1},
        "checkpoint": golden.CHECKPOINT,
        "prompts": {"lengths": golden.LENGTHS, "seed": golden.PROMPT_SEED, "helper": "tests.util.random_prompts"},
        "steps": golden.STEPS,
        "tie_rule": "greedy: first maximum of each Markov-biased row (torch.argmax), as the reference's sample()",
        "outputs": outputs,
    }
    text = json.dumps(doc, indent=1)
    text = re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group())), text)  # int lists on one line
    golden.GOLDEN.write_text(text + "\n")
    print(f"wrote {golden.GOLDEN} ({len(outputs)} dtypes x {len(golden.LENGTHS)} prompts x {golden.STEPS} blocks)")


if __name__ == "__main__":
    main()
