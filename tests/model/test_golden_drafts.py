"""The DSpark drafter against its committed golden drafts (golden_drafts.py says why), and the
drafter's state checked at every decode position: restarting from a one-shot prefill there gives
the same drafts, bit for bit, as having decoded up to it."""

from __future__ import annotations

import json

import pytest
import torch

from asympd.kv.dense import DenseSequenceKV
from asympd.model.dspark import Draft, DraftSegment
from asympd.model.loader import load_model
from asympd.model.transformer import Chunk
from tests.model import golden_drafts as golden
from tests.util import cpu_kernels, random_prompts


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(golden.GOLDEN.read_text())


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(golden.LENGTHS, seed=golden.PROMPT_SEED)


def test_the_golden_file_describes_this_run(doc):
    assert doc["checkpoint"] == golden.CHECKPOINT
    assert doc["prompts"]["lengths"] == golden.LENGTHS and doc["prompts"]["seed"] == golden.PROMPT_SEED
    assert doc["steps"] == golden.STEPS and set(doc["outputs"]) == set(golden.DTYPES)
    for kernels, runs in doc.get("bfloat16_by_cpu", {}).items():
        assert golden.bf16_record(doc, kernels) is runs
        assert [r["n"] for r in runs] == golden.LENGTHS
    for kernels, runs in doc.get("float32_by_cpu", {}).items():
        assert golden.fp32_record(doc, kernels) is runs
        assert golden.tokens_and_drafts(runs) == golden.tokens_and_drafts(doc["outputs"]["float32"])
    assert doc["command"].endswith("tools/make_golden_drafts.py") and "docs/reference-check.md" in doc["about"]
    for runs in doc["outputs"].values():
        assert [r["n"] for r in runs] == golden.LENGTHS
        assert all(len(r["drafts"]) == golden.STEPS == len(r["target_tokens"]) for r in runs)


def test_drafts_reproduce_the_golden_tokens_and_logit_bits(tiny_ckpt, doc, prompts):
    """Each dtype against the record for this machine's CPU kernels (``golden.fp32_record``,
    ``golden.bf16_record``); every family's fp32 tokens and drafts are the main record's."""
    got = golden.compute(tiny_ckpt, prompts)
    hint = f"regenerate ({doc['command']}) only after re-checking against the reference"
    kernels = cpu_kernels()
    main = golden.tokens_and_drafts(doc["outputs"]["float32"])
    assert golden.tokens_and_drafts(got["float32"]) == main, f"fp32 tokens or drafts moved; {hint}"
    for dtype, want in (("float32", golden.fp32_record(doc, kernels)), ("bfloat16", golden.bf16_record(doc, kernels))):
        if want is None:  # say what is missing rather than pass quietly
            pytest.skip(f"no {dtype} golden drafts for {kernels} CPU kernels: {doc['command']} --add-cpu records them")
        for g, w in zip(got[dtype], want, strict=True):
            assert g["target_tokens"] == w["target_tokens"], f"{dtype}, N={w['n']}: the target moved; {hint}"
            assert g["drafts"] == w["drafts"], f"{dtype}, N={w['n']}: drafts moved; {hint}"
            assert g["logits_sha256"] == w["logits_sha256"], f"{dtype}, N={w['n']}: draft logit bits moved; {hint}"
            assert g["confidence_sha256"] == w["confidence_sha256"], f"{dtype}, N={w['n']}: confidence moved; {hint}"


def test_the_golden_drafts_are_not_trivial(doc):
    """A drafter stuck on one token, or one that ignores its input, would still be reproducible."""
    for runs in doc["outputs"].values():
        blocks = [tuple(b) for r in runs for b in r["drafts"]]
        assert len(set(blocks)) > len(blocks) // 2
        assert len({t for b in blocks for t in b}) > 20


@pytest.mark.parametrize("dtype", list(golden.DTYPES))
def test_drafting_from_a_fresh_prefill_at_every_position_matches_the_decoded_state(tiny_ckpt, prompts, dtype):
    """The resynchronised check of tools/check_against_reference.py, ours against ours: at each
    position the drafter seeded by a one-shot prefill drafts exactly what it drafts after decoding
    there step by step (windows of main rows written by prefill and by decode agree bitwise)."""
    model = load_model(tiny_ckpt, "full", dtype=golden.DTYPES[dtype])
    prompt = prompts[1]
    decoded: list[Draft] = []
    run = golden.drafts_along_decode(model, prompt, golden.STEPS, keep=decoded)
    hist = prompt + run["target_tokens"]
    n = len(prompt)
    for i, p in enumerate(range(n, n + golden.STEPS)):
        kv = DenseSequenceKV(model.cfg, dtype=model.dtype)
        ids = torch.tensor(hist[:p])
        out = model([Chunk(kv, ids, 0, ids)])
        assert int(out.logits[0][-1].argmax()) == hist[p]
        fresh = model.drafter.draft(
            [DraftSegment(kv, out.draft_hidden[0], 0, p, hist[p])], model.cfg.dspark_block_size, golden.greedy
        )
        assert fresh.tokens[0].tolist() == run["drafts"][i]
        assert torch.equal(fresh.logits, decoded[i].logits), f"position {p}"
        assert torch.equal(fresh.confidence, decoded[i].confidence), f"position {p}"
