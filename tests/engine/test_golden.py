"""Every mode and semantics against the committed golden outputs (tests/engine/golden.py says why)."""

from __future__ import annotations

import json

import pytest

from asympd.engine.modes import VARIANTS
from tests.engine import golden
from tests.util import cpu_kernels, for_cpu, random_prompts


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(golden.GOLDEN.read_text())


def test_the_golden_file_describes_this_run(doc):
    assert doc["checkpoint"] == golden.CHECKPOINT
    assert doc["prompts"]["lengths"] == golden.LENGTHS and doc["prompts"]["seed"] == golden.PROMPT_SEED
    assert doc["sampling"]["max_tokens"] == golden.MAX_TOKENS
    assert set(doc["outputs"]) == {golden.variant_name(*v) for v in VARIANTS}
    assert "docs/reference-check.md" in doc["about"] and doc["command"].endswith("tools/make_golden.py")
    for kernels, digests in doc.get("logprobs_sha256_by_cpu", {}).items():
        assert golden.logprob_digests(doc, kernels) is digests and set(digests) == set(doc["outputs"])
    for kernels, tokens in doc.get("token_ids_by_cpu", {}).items():
        assert golden.token_ids(doc, kernels) is tokens and set(tokens) == set(doc["outputs"])
        assert kernels in doc.get("logprobs_sha256_by_cpu", {}), "a family's tokens come with its digests"


def test_every_mode_reproduces_the_golden_tokens_and_logprob_bits(tiny_ckpt, doc):
    """Tokens against the main record (or this CPU family's where it chose otherwise at a near-tie,
    ``golden.token_ids``); log-probability bits against the record for this machine's CPU kernels
    (``golden.logprob_digests``: some of those bits differ between kernel families)."""
    got = golden.compute(tiny_ckpt, random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED))
    hint = f"regenerate ({doc['command']}) only after re-checking against the reference"
    kernels = cpu_kernels()
    tokens = golden.token_ids(doc, kernels)
    if tokens is None:
        pytest.skip(f"no golden tokens for {kernels} CPU kernels: {doc['command']} --add-cpu records them")
    for variant, want in tokens.items():
        assert [o["token_ids"] for o in got[variant]] == want, f"{variant}; {hint}"
    digests = golden.logprob_digests(doc, kernels)
    if digests is None:  # the tokens were checked; say what is missing rather than pass quietly
        pytest.skip(f"no logprob digests for {kernels} CPU kernels: {doc['command']} --add-cpu records them")
    for variant, want in digests.items():
        got_digests = [g["logprobs_sha256"] for g in got[variant]]
        for n, g, w in zip(golden.LENGTHS, got_digests, want, strict=True):
            assert g == w, f"{variant}, N={n}: logprob bits moved; {hint}"


def test_a_cpu_family_reads_its_own_record_else_the_main_one_where_that_fits():
    doc = {"environment": {}, "by_cpu": {"AVX2": "avx2 record"}}
    assert for_cpu(doc, "by_cpu", "main", "AVX2") == "avx2 record"
    assert for_cpu(doc, "by_cpu", "main", "AVX512") == "main"  # the main record's family was not recorded
    doc["environment"]["cpu_kernels"] = "AVX512"
    assert for_cpu(doc, "by_cpu", "main", "AVX512") == "main"
    assert for_cpu(doc, "by_cpu", "main", "DEFAULT") is None  # the test then skips, naming the command
