#!/usr/bin/env python3
"""Regenerate tests/engine/golden_tiny.json: the greedy tokens and a hash of the full-vocabulary
log-probabilities of every mode and semantics on the seed-0 tiny checkpoint.

Only regenerate after checking the model against the official reference
(tools/check_against_reference.py, docs/reference-check.md) and saying in the commit why the
numbers moved: the file exists to catch changes nobody meant to make.

    .venv/bin/python tools/make_golden.py            # the whole file, on this machine
    .venv/bin/python tools/make_golden.py --add-cpu  # only this CPU's log-probability digests

Some fp32 log-probability bits depend on the CPU kernels torch dispatches to
(``tests.util.cpu_kernels``), and through the tiny model's FP8/FP4 steps so can a greedy choice
between near-equal tokens. ``--add-cpu`` refuses unless every token equals the file's record or
parts from it at a near-tie (the record's token within ``NEAR_TIE`` nats of this machine's), then
stores this machine's digests under ``logprobs_sha256_by_cpu`` (and its tokens under
``token_ids_by_cpu`` where they part), leaving the rest of the file as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.engine import golden  # noqa: E402
from tests.util import cpu_kernels, random_prompts  # noqa: E402
from tools.golden_common import run_on_tiny, write_golden  # noqa: E402

COMMAND = ".venv/bin/python tools/make_golden.py"


# how far below this machine's choice the main record's token may be where the two part (nats):
# a near-tie a last-bit difference can flip through the tiny model's FP8/FP4 steps; a moved model
# parts at a clear choice
NEAR_TIE = 0.25


def near_tie_parts(outputs: dict, doc: dict) -> list[str]:
    """Where this machine's tokens part from the main record's: each variant and prompt, with the
    step and the margin. Exits unless every parting is at a near-tie (``NEAR_TIE``)."""
    parts = []
    for variant, outs in outputs.items():
        for got, want in zip(outs, doc["outputs"][variant], strict=True):
            a, b = got["token_ids"], want["token_ids"]
            step = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            if step is None:
                continue
            lp = got["logprobs"][step]
            margin = lp[a[step]] - lp[b[step]]
            where = f"{variant}, N={got['n']}, step {step}: {a[step]} over {b[step]} by {margin:.3f} nats"
            if margin > NEAR_TIE:
                sys.exit(f"tokens part from the file's record at a clear choice ({where}): the model moved")
            parts.append(where)
    return parts


def add_cpu(outputs: dict, provenance: dict) -> None:
    doc = json.loads(golden.GOLDEN.read_text())
    parts = near_tie_parts(outputs, doc)
    kernels = cpu_kernels()
    if parts:
        print("near-ties chosen otherwise here:", *parts, sep="\n  ")
        doc.setdefault("token_ids_by_cpu", {})[kernels] = golden.tokens_of(outputs)
    doc.setdefault("logprobs_sha256_by_cpu", {})[kernels] = {
        v: [o["logprobs_sha256"] for o in outs] for v, outs in outputs.items()
    }
    doc.setdefault("logprobs_sha256_by_cpu_made", {})[kernels] = provenance
    write_golden(golden.GOLDEN, doc)
    print(f"recorded the log-probability digests of {kernels} CPU kernels in {golden.GOLDEN}")


def main() -> None:
    prompts = random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED)
    add = "--add-cpu" in sys.argv[1:]
    outputs, provenance = run_on_tiny(golden.CHECKPOINT["seed"], lambda ckpt: golden.compute(ckpt, prompts, add))
    if add:
        add_cpu(outputs, provenance)
        return
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
