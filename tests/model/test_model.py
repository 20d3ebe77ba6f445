"""The model through its public forward: semantics, roles, incremental decoding."""

from __future__ import annotations

import pytest
import torch

from asympd.engine.modes import colocated_phases
from asympd.kv.dense import DenseSequenceKV
from asympd.model.loader import load_model
from asympd.model.transformer import Chunk, Depth
from tests.util import random_prompts


@pytest.fixture(scope="module")
def full(tiny_ckpt):
    return load_model(tiny_ckpt, "full")


@pytest.fixture(scope="module")
def prefill(tiny_ckpt):
    return load_model(tiny_ckpt, "prefill")


def run_phases(model, ids: list[int], semantics: str, chunk: int | None = None) -> torch.Tensor:
    """Prompt logits of the last row under a prefill semantics (optionally chunked)."""
    kv = DenseSequenceKV(model.cfg)
    hist = torch.tensor(ids)
    logits = None
    for ph in colocated_phases(model.cfg, len(ids), semantics):
        step = chunk or (ph.hi - ph.lo)
        for lo in range(ph.lo, ph.hi, step):
            hi = min(lo + step, ph.hi)
            last = hi == ph.hi and ph.depth is Depth.ALL
            out = model(
                [
                    Chunk(
                        kv,
                        hist[lo:hi],
                        lo,
                        hist,
                        ph.depth,
                        ph.floor,
                        ph.encoder_floor,
                        ph.write_global,
                        logits="last" if last else "none",
                    )
                ]
            )
            logits = out.logits[0] if last else logits
    return logits[-1]


@pytest.mark.parametrize("semantics", ["full", "decoder-replay", "split"])
def test_each_semantics_runs_and_is_not_degenerate(full, semantics):
    ids = random_prompts([40])[0]
    logits = run_phases(full, ids, semantics)
    assert logits.shape == (full.cfg.vocab_size,)
    assert torch.isfinite(logits).all()
    probs = logits.softmax(-1)
    assert probs.max() > 3 / full.cfg.vocab_size  # far from uniform
    assert logits.std() > 0.1


def test_semantics_agree_within_one_window_and_differ_beyond(full):
    short = random_prompts([full.cfg.window_size], seed=1)[0]
    ref = run_phases(full, short, "full")
    for sem in ("decoder-replay", "split"):
        assert torch.equal(run_phases(full, short, sem), ref), sem
    long = random_prompts([60], seed=2)[0]
    ref = run_phases(full, long, "full")
    assert not torch.allclose(run_phases(full, long, "split"), ref, atol=1e-3)
    assert not torch.allclose(run_phases(full, long, "decoder-replay"), ref, atol=1e-3)


def test_prefill_role_kv_bit_identical_to_full_model(full, prefill):
    cfg = full.cfg
    ids = random_prompts([45], seed=3)[0]
    s = len(ids) - cfg.window_size
    hist = torch.tensor(ids)
    kv_p, kv_f = DenseSequenceKV(cfg), DenseSequenceKV(cfg)
    prefill([Chunk(kv_p, hist[:s], 0, hist, Depth.ENCODER_KV, logits="none")])
    full([Chunk(kv_f, hist[:s], 0, hist, Depth.ALL, logits="none")])
    for layer in cfg.kv_source_layers:
        n = s // cfg.ratio(layer)
        assert torch.equal(kv_p.read_compressed(layer, n), kv_f.read_compressed(layer, n))
        assert torch.equal(kv_p.read_index_keys(layer, n), kv_f.read_index_keys(layer, n))
    assert prefill.resident_bytes() < full.resident_bytes() * 0.75


def test_prefill_role_refuses_decoder_rows(prefill):
    ids = torch.tensor(random_prompts([5])[0])
    with pytest.raises(ValueError, match="prefill role cannot run rows at depth ALL"):
        prefill([Chunk(DenseSequenceKV(prefill.cfg), ids, 0, ids)])


def test_incremental_decoding_matches_one_shot_prefill(full):
    """Under `full` a token decoded one at a time sees exactly what it sees in a one-shot prefill;
    the model is batch-invariant, so in fp32 the two agree bit for bit."""
    ids = random_prompts([50], seed=4)[0]
    hist = torch.tensor(ids)
    one_shot = full([Chunk(DenseSequenceKV(full.cfg), hist, 0, hist, logits="all")]).logits[0]
    kv = DenseSequenceKV(full.cfg)
    full([Chunk(kv, hist[:20], 0, hist, logits="none")])
    steps = [full([Chunk(kv, hist[i : i + 1], i, hist)]).logits[0][-1] for i in range(20, 50)]
    inc = torch.stack(steps)
    assert torch.equal(inc, one_shot[20:])


def test_chunked_prefill_matches_one_shot_bit_for_bit(full):
    ids = random_prompts([300], seed=5)[0]
    for sem in ("full", "split", "decoder-replay"):
        a = run_phases(full, ids, sem)
        for chunk in (7, 50, 128):
            assert torch.equal(a, run_phases(full, ids, sem, chunk=chunk)), (sem, chunk)


def test_ragged_batch_matches_single_sequences(full):
    """Rows of different sequences at different depths in one forward give each sequence what it
    gets alone."""
    cfg = full.cfg
    a, b = (torch.tensor(x) for x in random_prompts([30, 9], seed=6))
    alone = [full([Chunk(DenseSequenceKV(cfg), x, 0, x)]).logits[0][-1] for x in (a, b)]
    kv_a, kv_b, kv_c = DenseSequenceKV(cfg), DenseSequenceKV(cfg), DenseSequenceKV(cfg)
    c = torch.tensor(random_prompts([25], seed=7)[0])
    out = full([Chunk(kv_c, c, 0, c, Depth.ENCODER_KV, logits="none"), Chunk(kv_a, a, 0, a), Chunk(kv_b, b, 0, b)])
    assert out.logits[0] is None
    assert torch.equal(out.logits[1][-1], alone[0])
    assert torch.equal(out.logits[2][-1], alone[1])


def test_bf16_close_to_fp32(tiny_ckpt, full):
    # On random tiny weights one prompt's cosine is a draw from roughly 0.5-0.99 (any change of the
    # tokenizer or Engram tables re-rolls it); the median over 16 prompts is stable (~0.93).
    bf = load_model(tiny_ckpt, "full", dtype=torch.bfloat16)
    cos = []
    for seed in range(8, 24):
        ids = torch.tensor(random_prompts([30], seed=seed)[0])
        x32 = full([Chunk(DenseSequenceKV(full.cfg), ids, 0, ids)]).logits[0][-1]
        x16 = bf([Chunk(DenseSequenceKV(bf.cfg, dtype=torch.bfloat16), ids, 0, ids)]).logits[0][-1]
        cos.append(torch.nn.functional.cosine_similarity(x32, x16.float(), dim=0).item())
    assert sorted(cos)[len(cos) // 2] > 0.9, cos
