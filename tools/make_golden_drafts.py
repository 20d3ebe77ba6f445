#!/usr/bin/env python3
"""Regenerate tests/model/golden_drafts.json: the DSpark drafts (and digests of their logits and
confidence logits) along a greedy decode of the seed-0 tiny checkpoint, in fp32 and bf16.

Only regenerate after checking the drafter against the official reference
(tools/check_against_reference.py, docs/reference-check.md, "DSpark drafts") and saying in the
commit why the numbers moved: the file exists to catch changes nobody meant to make.

    .venv/bin/python tools/make_golden_drafts.py            # the whole file, on this machine
    .venv/bin/python tools/make_golden_drafts.py --add-cpu  # only this CPU's record

bf16 results depend on the CPU kernels torch dispatches to (``tests.util.cpu_kernels``); fp32
results matched the main record on AVX2 but not on an AVX512 machine with AMX (the same tokens and
drafts, other logit bits). ``--add-cpu`` computes both, refuses unless the fp32 tokens and drafts
equal the file's record (so the model has not moved), and stores this machine's bf16 drafts under
``bfloat16_by_cpu`` (and its fp32 bits under ``float32_by_cpu`` where they differ), leaving the rest
of the file as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.model import golden_drafts as golden  # noqa: E402
from tests.util import cpu_kernels, random_prompts  # noqa: E402
from tools.golden_common import run_on_tiny, write_golden  # noqa: E402

COMMAND = ".venv/bin/python tools/make_golden_drafts.py"


def add_cpu(outputs: dict, provenance: dict) -> None:
    doc = json.loads(golden.GOLDEN.read_text())
    if golden.tokens_and_drafts(outputs["float32"]) != golden.tokens_and_drafts(doc["outputs"]["float32"]):
        sys.exit("fp32 tokens or drafts differ from the file's record: the model moved; regenerate the whole file")
    kernels = cpu_kernels()
    if outputs["float32"] != doc["outputs"]["float32"]:  # the same drafts from other logit bits
        doc.setdefault("float32_by_cpu", {})[kernels] = outputs["float32"]
    doc.setdefault("bfloat16_by_cpu", {})[kernels] = outputs["bfloat16"]
    doc.setdefault("bfloat16_by_cpu_made", {})[kernels] = provenance
    write_golden(golden.GOLDEN, doc)
    print(f"recorded the bf16 drafts of {kernels} CPU kernels in {golden.GOLDEN}")


def main() -> None:
    prompts = random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED)
    outputs, provenance = run_on_tiny(golden.CHECKPOINT["seed"], lambda ckpt: golden.compute(ckpt, prompts))
    if "--add-cpu" in sys.argv[1:]:
        add_cpu(outputs, provenance)
        return
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
