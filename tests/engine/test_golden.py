"""Every mode and semantics against the committed golden outputs (tests/engine/golden.py says why)."""

from __future__ import annotations

import json

import pytest

from asympd.engine.modes import VARIANTS
from tests.engine import golden
from tests.util import random_prompts


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(golden.GOLDEN.read_text())


def test_the_golden_file_describes_this_run(doc):
    assert doc["checkpoint"] == golden.CHECKPOINT
    assert doc["prompts"]["lengths"] == golden.LENGTHS and doc["prompts"]["seed"] == golden.PROMPT_SEED
    assert doc["sampling"]["max_tokens"] == golden.MAX_TOKENS
    assert set(doc["outputs"]) == {golden.variant_name(*v) for v in VARIANTS}
    assert "docs/reference-check.md" in doc["about"] and doc["command"].endswith("tools/make_golden.py")


def test_every_mode_reproduces_the_golden_tokens_and_logprob_bits(tiny_ckpt, doc):
    got = golden.compute(tiny_ckpt, random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED))
    hint = f"regenerate ({doc['command']}) only after re-checking against the reference"
    for variant, want in doc["outputs"].items():
        assert [o["token_ids"] for o in got[variant]] == [o["token_ids"] for o in want], f"{variant}; {hint}"
    for variant, want in doc["outputs"].items():
        for g, w in zip(got[variant], want, strict=True):
            assert g["logprobs_sha256"] == w["logprobs_sha256"], f"{variant}, N={w['n']}: logprob bits moved; {hint}"
