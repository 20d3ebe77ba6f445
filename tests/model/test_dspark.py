"""The DSpark drafter (mtp.* blocks): loading, window cache, block attention, Markov and confidence
heads, batch/chunk invariance."""

from __future__ import annotations

import pytest
import torch

from asympd.config import tiny
from asympd.kv.dense import DenseSequenceKV
from asympd.model.attention import rotations
from asympd.model.checkpoint import _generate_unit, _units
from asympd.model.dspark import DraftSegment, DSpark
from asympd.model.loader import build_model, load_model
from asympd.model.schema import checkpoint_schema
from asympd.model.transformer import Chunk
from tests.util import random_prompts


@pytest.fixture(scope="module")
def full(tiny_ckpt):
    return load_model(tiny_ckpt, "full")


def greedy(_i: int, logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def prefill(model, ids: list[int], slack: int = 4) -> tuple[DenseSequenceKV, torch.Tensor, int]:
    """(cache, target-layer states of every row, greedy next token) after a full prefill."""
    kv = DenseSequenceKV(model.cfg, spec_slack=slack)
    hist = torch.tensor(ids)
    out = model([Chunk(kv, hist, 0, hist)])
    return kv, out.draft_hidden[0], int(out.logits[0][-1].argmax())


def seg(kv, hidden, lo: int, hi: int, block: int | None, tok: int) -> DraftSegment:
    return DraftSegment(kv, hidden[lo:hi], lo, block, tok)


def test_drafter_is_built_for_the_decoding_roles_only(tiny_ckpt, full):
    assert isinstance(full.drafter, DSpark)
    assert isinstance(load_model(tiny_ckpt, "decode").drafter, DSpark)
    assert getattr(load_model(tiny_ckpt, "prefill"), "drafter", None) is None
    cfg = full.cfg
    blk = full.drafter.blocks[0]
    assert blk.layer == cfg.n_layers and blk.attn.ratio == 0
    assert blk.attn.comp_wkv is None and blk.attn.idx_wq_b is None and blk.engram is None
    assert blk.ffn.n_experts == cfg.dspark_n_routed_experts and blk.ffn.topk == cfg.dspark_n_activated_experts


def test_window_holds_exactly_the_seeded_main_rows(full):
    cfg, d = full.cfg, full.drafter
    ids = random_prompts([20], seed=1)[0]
    kv, hidden, tok = prefill(full, ids)
    d.draft([seg(kv, hidden, 4, 20, 20, tok)], cfg.dspark_block_size, greedy)
    win_kv, win_pos = kv.window(cfg.n_layers)
    assert win_pos.tolist() == list(range(4, 20))  # block rows (20..) are never written
    attn = d.blocks[0].attn
    want = attn._kv(d.main_x(hidden[4:20]), rotations(attn.freqs, torch.arange(4, 20)))
    assert torch.equal(win_kv, want)
    # the target-layer states are the mean over hc copies of each target layer's input, concatenated
    assert hidden.shape == (20, cfg.dim * len(cfg.dspark_target_layer_ids))


def test_block_sees_whole_block_and_exactly_w_main_rows(full, monkeypatch):
    cfg, d = full.cfg, full.drafter
    w = cfg.window_size
    ids = random_prompts([w + 8], seed=2)[0]
    n = len(ids)
    _, hidden, tok = prefill(full, ids)

    def run(lo: int) -> torch.Tensor:
        kv = DenseSequenceKV(cfg, spec_slack=8)
        return d([seg(kv, hidden, lo, n, n, tok)])[1]

    ref = run(n - w)
    assert torch.equal(run(0), ref)  # rows before b - W never reach a draft query
    assert not torch.equal(run(n - w + 1), ref)  # the row at b - W does
    # not causal inside the block: row 0 reads the noise rows after it
    monkeypatch.setattr(d, "noise_token_id", 3)
    assert not torch.equal(run(n - w)[0], ref[0])


def test_markov_head_and_confidence(full):
    cfg, d = full.cfg, full.drafter
    ids = random_prompts([12], seed=3)[0]
    kv, hidden, tok = prefill(full, ids)
    base_kv = DenseSequenceKV(cfg, spec_slack=4)
    x, base = d([seg(base_kv, hidden, 0, 12, 12, tok)])
    k = cfg.dspark_block_size
    out = d.draft([seg(kv, hidden, 0, 12, 12, tok)], k, greedy)
    prev, embeds = tok, []
    for i in range(k):
        e = d.markov_embed[prev].float()
        row = base[i] + d.markov_head @ e  # bias from the previous token's Markov embedding
        assert torch.allclose(out.logits[0, i], row, atol=1e-5)
        assert int(out.tokens[0, i]) == int(out.logits[0, i].argmax())
        embeds.append(e)
        prev = int(out.tokens[0, i])
    conf = torch.stack([d.confidence_proj[0] @ torch.cat([x[i].float(), embeds[i]]) for i in range(k)])
    assert torch.allclose(out.confidence[0], conf, atol=1e-5)


def test_drafts_are_batch_and_chunk_invariant(full):
    cfg, d = full.cfg, full.drafter
    a, b = random_prompts([30, 9], seed=4)
    kv_a, h_a, t_a = prefill(full, a)
    kv_b, h_b, t_b = prefill(full, b)
    k = cfg.dspark_block_size
    alone_a = d.draft([seg(kv_a, h_a, 14, 30, 30, t_a)], k, greedy)
    alone_b = d.draft([seg(kv_b, h_b, 0, 9, 9, t_b)], k, greedy)
    kv_a2, kv_b2, kv_c = (DenseSequenceKV(cfg, spec_slack=4) for _ in range(3))
    # seeding in two chunks, next to a seed-only request, gives the same window and drafts
    d.draft([seg(kv_a2, h_a, 14, 20, None, 0)], k, greedy)
    both = d.draft(
        [seg(kv_c, h_b, 0, 5, None, 0), seg(kv_a2, h_a, 20, 30, 30, t_a), seg(kv_b2, h_b, 0, 9, 9, t_b)], k, greedy
    )
    assert torch.equal(both.logits[0], alone_a.logits[0]) and torch.equal(both.logits[1], alone_b.logits[0])
    assert torch.equal(both.tokens, torch.cat([alone_a.tokens, alone_b.tokens]))
    assert torch.equal(kv_a2.window(cfg.n_layers)[0], kv_a.window(cfg.n_layers)[0])


def test_several_draft_blocks_chain():
    """Two mtp blocks: main_proj on the first, norm/Markov/confidence heads on the last, each block
    with its own window, the pre-mix handed from one to the next."""
    base = tiny()
    cfg = base.replace(
        n_mtp_layers=2, compress_ratios=(*base.compress_ratios, 0), engram_layer_ids=(), engram_num_embeddings=()
    )
    names = [s.name for s in checkpoint_schema(cfg) if s.name.startswith("mtp.")]
    assert "mtp.0.main_proj.weight" in names and "mtp.1.main_proj.weight" not in names
    assert "mtp.1.markov_head.embed.weight" in names and "mtp.0.markov_head.embed.weight" not in names
    tensors = {}
    for unit in _units(checkpoint_schema(cfg)):
        tensors.update({s.name: t for s, t in zip(unit, _generate_unit(cfg, unit, 5), strict=True)})
    model = build_model(cfg, tensors, "decode")
    ids = random_prompts([10], seed=5)[0]
    kv, hidden, tok = prefill(model, ids)
    out = model.drafter.draft([seg(kv, hidden, 0, 10, 10, tok)], cfg.dspark_block_size, greedy)
    assert out.tokens.shape == (1, cfg.dspark_block_size)
    for i in range(2):
        assert kv.window(cfg.n_layers + i)[1].tolist() == list(range(10))
    with pytest.raises(ValueError, match="block size"):
        model.drafter.draft([seg(kv, hidden, 0, 10, 10, tok)], cfg.dspark_block_size + 1, greedy)
