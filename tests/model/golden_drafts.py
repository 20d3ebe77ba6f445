"""Absolute anchors for the DSpark drafter: the drafts our model makes on a fixed tiny checkpoint.

Greedy equality with and without speculation holds for any drafter, good or bad, so it cannot catch
a drafter that drifts from the reference's. These numbers were made by the code that
tools/check_against_reference.py compares with the reference's ``forward_spec`` (bf16: the same
drafts at every checked position where both sides had the same target states; see
docs/reference-check.md); ``tools/make_golden_drafts.py`` writes ``golden_drafts.json``,
test_golden_drafts.py recomputes it. Not a test module.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from asympd.kv.dense import DenseSequenceKV
from asympd.model.dspark import Draft, DraftSegment
from asympd.model.loader import load_model
from asympd.model.transformer import Chunk
from tests.util import for_cpu

GOLDEN = Path(__file__).with_name("golden_drafts.json")
CHECKPOINT = {"config": "tiny", "seed": 0}  # write_checkpoint(tiny(), out, seed=0), as tests/conftest.py
# 1 token; N = W + 1 with an odd ratio-2 split; past the compressed top-k and the window wrap
LENGTHS = [1, 17, 40]
PROMPT_SEED = 20
STEPS = 8  # draft blocks per prompt: one after the prefill, then one after each decode step
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tokens_and_drafts(runs: list[dict[str, Any]]) -> list[tuple[list[int], list[list[int]]]]:
    """What a record says, without its bits: each prompt's target tokens and drafts (every CPU
    family must agree on these in fp32)."""
    return [(r["target_tokens"], r["drafts"]) for r in runs]


def fp32_record(doc: dict[str, Any], kernels: str) -> list[dict[str, Any]] | None:
    """The fp32 drafts recorded for CPU kernel family ``kernels``: the main record, except on a family
    whose logit bits differ (an AVX512 machine with AMX: the same tokens and drafts, other bits), where
    ``tools/make_golden_drafts.py --add-cpu`` stored its own after checking the tokens and drafts."""
    return for_cpu(doc, "float32_by_cpu", doc["outputs"]["float32"], kernels)


def bf16_record(doc: dict[str, Any], kernels: str) -> list[dict[str, Any]] | None:
    """The bf16 drafts recorded for CPU kernel family ``kernels`` (``tests.util.for_cpu``). On an AVX2
    machine the fp32 drafts are the main record's bits (made on an earlier development machine, whose
    family was not recorded) but the N = 40 prompt's bf16 drafts are not, so bf16 is recorded per
    family. (Forcing torch's unvectorized kernels, ``ATEN_CPU_CAPABILITY=default``, moves fp32's
    logit bits too.)"""
    return for_cpu(doc, "bfloat16_by_cpu", doc["outputs"]["bfloat16"], kernels)


def greedy(_i: int, logits: torch.Tensor) -> torch.Tensor:
    """First maximum of each Markov-biased row: the reference's ``sample`` at temperature 0."""
    return logits.argmax(-1)


def drafts_along_decode(model: Any, prompt: list[int], steps: int, keep: list[Draft] | None = None) -> dict[str, Any]:
    """Prefill, then ``steps`` rounds of: draft the block at the newest token's position, decode that
    token (greedy) and move on. Returns the target's tokens, every block's drafts, and sha256 digests
    of the drafts' logits and confidence logits (fp32 bytes, in order); ``keep`` collects the Drafts."""
    kv = DenseSequenceKV(model.cfg, dtype=model.dtype, spec_slack=model.cfg.dspark_block_size)
    hist = list(prompt)
    n = len(prompt)
    out = model([Chunk(kv, torch.tensor(hist), 0, torch.tensor(hist))])
    main, main_start = out.draft_hidden[0], 0
    tok = int(out.logits[0][-1].argmax())
    drafts: list[list[int]] = []
    h_logits, h_conf = hashlib.sha256(), hashlib.sha256()
    for p in range(n, n + steps):
        hist.append(tok)
        seg = DraftSegment(kv, main, main_start, p, tok)
        d = model.drafter.draft([seg], model.cfg.dspark_block_size, greedy)
        if keep is not None:
            keep.append(d)
        drafts.append(d.tokens[0].tolist())
        h_logits.update(d.logits[0].float().contiguous().numpy().tobytes())
        h_conf.update(d.confidence[0].float().contiguous().numpy().tobytes())
        ids = torch.tensor(hist)
        out = model([Chunk(kv, ids[p : p + 1], p, ids)])
        main, main_start = out.draft_hidden[0], p
        tok = int(out.logits[0][-1].argmax())
    return {
        "n": n,
        "target_tokens": hist[n:],
        "drafts": drafts,
        "logits_sha256": h_logits.hexdigest(),
        "confidence_sha256": h_conf.hexdigest(),
    }


def compute(ckpt: str, prompts: list[list[int]]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name, dtype in DTYPES.items():
        model = load_model(ckpt, "full", dtype=dtype)
        out[name] = [drafts_along_decode(model, p, STEPS) for p in prompts]
    return out
