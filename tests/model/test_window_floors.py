"""Each prefill semantics' window floors, checked against a deliberately naive dense implementation.

The engine expresses the semantics as phases, depths and two floors per chunk, and the model picks
a floor per layer; every other test compares two paths through that same code. Here the rule is
written down again from the definitions (README, asympd/model/transformer.py), as dense [N, N]
masks over whole-sequence tensors:

- ``full``: every layer on every row, a row at position i sees window keys (i - W, i];
- ``decoder-replay``: layers <= K on every row with full windows; layers > K only on the last W
  rows, which see window keys >= N - W;
- ``split``: rows [0, s) through layers < K (and K's compressor); rows [s, N) through every layer,
  seeing window keys >= s at *every* layer (s = N - W, moved down to even under ``align``).

The naive forward reuses the model's weights and its non-attention sublayers (mHC, MoE, Engram,
the q/kv projections), but does its own masking, compression and attention, in float64. A
checkpoint with ``index_topk`` above every prompt's compressed length makes the indexer select
every visible entry, so the compressed part is dense too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asympd import LLM, SamplingParams
from asympd.config import tiny
from asympd.model.attention import rotations
from asympd.model.checkpoint import write_checkpoint
from asympd.model.ops import apply_rope, hc_post, hc_pre, linear, rms_norm
from asympd.model.quant import fp4_qdq
from tests.util import random_prompts

# (N, prompt seed): s = N - W = 1 (align: 0), 4, 7 (odd: carry and align differ), 10, 17. The tiny
# model is chaotic (an FP8 code flipped by one rounding grows to ~1e-2): these prompts have no flip.
PROMPTS = [(17, 41), (20, 41), (23, 42), (26, 41), (33, 41)]
CASES = [("full", "carry"), ("decoder-replay", "carry"), ("split", "carry"), ("split", "align")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("dense") / "tiny-topk64"
    write_checkpoint(tiny().replace(index_topk=64), out, seed=0)
    return str(out)


@pytest.fixture(scope="module")
def engines(ckpt) -> dict[tuple[str, str], LLM]:
    return {c: LLM(ckpt, "colocated", c[0], boundary_policy=c[1]) for c in CASES}


def plan(semantics: str, policy: str, n: int, w: int, k: int):
    """(rows computed at a layer [bool N], window floor of each row at a layer [N])."""
    s = max(n - w, 0)
    if policy == "align":
        s -= s % 2  # the tiny model's compressor groups: ratios 2 and 1
    pos = torch.arange(n)

    def rows(layer: int) -> torch.Tensor:
        if semantics == "full" or (semantics == "decoder-replay" and layer <= k):
            return torch.ones(n, dtype=torch.bool)
        if semantics == "decoder-replay":
            return pos >= s
        return pos >= s if layer >= k else torch.ones(n, dtype=torch.bool)  # split; K's compressor: below

    def floors(layer: int) -> torch.Tensor:
        if semantics == "full" or (semantics == "decoder-replay" and layer <= k):
            return torch.zeros(n, dtype=torch.long)
        if semantics == "decoder-replay":
            return torch.full((n,), s)
        return torch.where(pos >= s, s, 0)

    return rows, floors


def dense_attention(attn, x, pos, floors, entries) -> torch.Tensor:
    """One layer's attention over dense masks: window keys (i - W, i] above the row's floor, plus
    every visible compressed entry; the sink joins the softmax denominator."""
    cfg = attn.cfg
    rot, _, q, kv = attn.project(x, pos)
    assert torch.equal(pos, torch.arange(int(pos[0]), int(pos[0]) + len(pos)))
    i, j = pos.unsqueeze(1), pos.unsqueeze(0)
    keys, mask = kv.double(), (j <= i) & (j > i - cfg.window_size) & (j >= floors.unsqueeze(1))
    if entries is not None:
        assert entries.size(0) <= cfg.index_topk  # so the indexer keeps every visible entry
        c = torch.arange(entries.size(0)).unsqueeze(0)
        keys = torch.cat([keys, entries.double()])
        mask = torch.cat([mask, c < (i + 1) // attn.ratio], dim=1)
    logits = torch.einsum("mhd,nd->mhn", q.double(), keys) * attn.scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    top = logits.amax(-1, keepdim=True)
    p = torch.exp(logits - top)
    denom = p.sum(-1, keepdim=True) + torch.exp(attn.attn_sink.double().unsqueeze(-1) - top)
    out = (torch.einsum("mhn,nd->mhd", p, keys) / denom).to(x.dtype)
    o = apply_rope(out, rot, cfg.rope_head_dim, inverse=True).reshape(len(pos), cfg.o_groups, -1)
    wo_a = attn.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
    return attn.wo_b(torch.stack([linear(o[:, g], wo_a[g]) for g in range(cfg.o_groups)], dim=1).flatten(1))


def dense_compress(attn, x) -> torch.Tensor:
    """Compressed entries of every complete group of ``attn.ratio`` rows (x: all rows from 0)."""
    cfg, r = attn.cfg, attn.ratio
    n = x.size(0) // r
    if r == 1:
        latent = rms_norm(attn.comp_wkv(x), attn.comp_norm, cfg.norm_eps)
    else:
        kv = attn.comp_wkv(x.float())[: n * r].unflatten(0, (n, r)).double()
        weights = attn.comp_wgate(x.float())[: n * r].unflatten(0, (n, r)).double().softmax(dim=1)
        latent = rms_norm((kv * weights).sum(1).to(x.dtype), attn.comp_norm, cfg.norm_eps)
    rot = rotations(attn.freqs, torch.arange(n) * r)
    return fp4_qdq(apply_rope(latent, rot, cfg.rope_head_dim), 16, e4m3_scale=True)


def dense_forward(model, ids: list[int], semantics: str, policy: str) -> torch.Tensor:
    """Log-probabilities after the last prompt row. Tensors hold every row; a layer computes only
    its rows (the rest keep stale values no later layer reads: the row sets only shrink)."""
    cfg, n = model.cfg, len(ids)
    k = cfg.last_kv_source
    rows, floors = plan(semantics, policy, n, cfg.window_size, k)
    tokens = torch.tensor(ids)
    h = F.embedding(tokens, model.embed).to(model.dtype).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    pre = torch.zeros(n, cfg.hc_mult)
    pre[:, 0] = 1.0
    hashes = model.hasher.hash_ids(tokens, 0, n)
    entries: dict[int, torch.Tensor] = {}
    for layer in range(cfg.n_layers):
        block, attn = model.blocks[layer], model.blocks[layer].attn
        if block.engram is not None:
            assert layer < k  # every row is still computed
            h = block.engram(h, hashes[:, cfg.engram_layer_ids.index(layer)])
        if attn.ratio and attn.is_source:
            assert layer <= k  # a KV source compresses every row (layer K in split: its KV path)
            entries[layer] = dense_compress(attn, block.attn_input(h, pre))
        idx = rows(layer).nonzero().squeeze(1)
        hr, pr = h[idx], pre[idx]
        x = block.attn_input(hr, pr)
        a_pre, a_post, a_comb = block._mixes(hr, "attn")
        out = dense_attention(attn, x, idx, floors(layer)[idx], entries.get(attn.source) if attn.ratio else None)
        hr = hc_post(out, hr, a_post, a_comb)
        f_pre, f_post, f_comb = block._mixes(hr, "ffn")
        hr = hc_post(block.ffn(rms_norm(hc_pre(hr, a_pre), block.ffn_norm, cfg.norm_eps)), hr, f_post, f_comb)
        h[idx], pre[idx] = hr, f_pre
    x = rms_norm(hc_pre(h[-1:], pre[-1:]), model.norm, cfg.norm_eps)
    return torch.log_softmax(linear(x.float(), model.head)[0].double(), dim=-1)


def engine_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, temperature=0, logprobs=-1))
    return torch.tensor(list(out[0].outputs[0].logprobs[0].values()), dtype=torch.float64)


@pytest.mark.parametrize("n,seed", PROMPTS)
def test_engine_floors_match_the_dense_masks(engines, n, seed):
    ids = random_prompts([n], seed=seed)[0]
    model = engines[CASES[0]].engine.model
    dense = {c: dense_forward(model, ids, *c) for c in CASES}
    for case, llm in engines.items():
        got = engine_logprobs(llm, ids)
        # rounding differences only (float64 here, fp32 fixed-layout chains there; measured < 1.2e-6) ...
        assert (got - dense[case]).abs().max() < 1e-5, case
        # ... far below what a floor moves: another semantics' masks give other numbers (measured > 0.2)
        for other in CASES:
            if not torch.equal(dense[other], dense[case]):
                assert (got - dense[other]).abs().max() > 1e-2, (case, other)
