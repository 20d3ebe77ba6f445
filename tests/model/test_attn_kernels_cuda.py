"""The fused indexer compiled on a GPU: contexts of every length reuse one compiled kernel.

Triton specializes integer arguments on the values 1 and multiples of 16; the indexer's table width,
candidate-block count and block-maxima columns follow the context, so without ``do_not_specialize``
a server compiled the kernel again (seconds each, at true depth tens of seconds per step) the first
time a context crossed such a value mid-traffic (docs/performance.md §10)."""

from __future__ import annotations

import pytest
import torch

from asympd.model import attn_kernels as AK

pytestmark = pytest.mark.skipif(not (AK.AVAILABLE and torch.cuda.is_available()), reason="needs a CUDA GPU")


def _select(entries: int, g: torch.Generator) -> None:
    """A candidate source and a re-index layer over one sequence of ``entries`` index keys."""
    dev = torch.device("cuda")
    heads, hd, k, epb, block, topk_blocks, rows = 8, 32, 16, 16, 4, 3, 4
    nblocks = -(-entries // epb)
    pool = torch.randn(nblocks + 2, epb, hd, generator=g).to(dev)
    tables = torch.randperm(nblocks + 2, generator=g)[:nblocks].to(dev, torch.int32).unsqueeze(0)
    q = torch.randn(rows, heads, hd, generator=g).to(dev)
    w = torch.randn(rows, heads, generator=g).to(dev)
    vis = torch.full((rows,), entries, dtype=torch.int32, device=dev)
    sel, cand = AK.indexer_topk_candidates(q, w, pool, tables, vis, k, topk_blocks, block, max_entries=entries)
    AK.indexer_topk(q, w, pool, tables, vis, k, candidates=cand, candidate_block=block, max_entries=entries)
    torch.cuda.synchronize()
    assert sel.shape == (rows, k)


def test_the_indexer_compiles_once_for_every_context_length():
    from asympd.serve.stall_watch import CompileWatch

    g = torch.Generator().manual_seed(0)
    watch = CompileWatch()
    try:
        _select(40, g)  # table width 3, 10 block maxima: the first compile of each kernel
        first = watch.mark()
        # table widths 1, 16, 17, 64; candidate blocks and block maxima 1 ... 256
        for entries in (16, 4, 256, 272, 1024):
            _select(entries, g)
        assert watch.since(first) == {}
    finally:
        watch.close()


def _ternary(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Values in {-1, 0, 1}: per-head scores are integers (exact in bf16 up to 256), weighted ones
    multiples of 1/8 below 2**11, so every partial head sum is exact in fp32 and the bf16 roundings
    alone decide the scores: no summation order can change a selection. Ties are common."""
    return torch.randint(-1, 2, shape, generator=g).float()


@pytest.mark.parametrize(
    ("epb", "splits", "version"),
    [(256, None, 3), (256, 3, 3), (16, 1, 3), (256, None, 4), (256, 2, 4), (16, 1, 4), (256, None, 5), (16, None, 5)],
)
def test_indexer_v3_on_the_gpu_selects_the_reference(epb, splits, version):
    """Version 3 compiled (packed bf16x2 relu and weighting, block-contiguous key tiles where epb is
    a multiple of the tile, entries split over programs) against the bf16 reference of
    ``Attention._select`` and against version 2: the same entries, ties to the lowest index; the
    candidate pool and a re-index layer within it too. Version 4 (the same kernel in 64-entry tiles
    under ptxas's 128-register cap, a few values spilled) must select the same."""
    from asympd.model.attention import select_candidate_blocks
    from asympd.model.ops import stable_topk

    g = torch.Generator().manual_seed(1)
    dev = torch.device("cuda")
    heads, hd, k, block, topk_blocks, n, rows = 32, 128, 512, 8, 64, 5000, 4
    keys = _ternary(g, n, hd)
    keys[::7] = keys[3]  # ties
    nblocks = -(-n // epb)
    pool = torch.zeros(nblocks + 2, epb, hd)
    order = torch.randperm(nblocks + 2, generator=g)[:nblocks]
    for b in range(nblocks):
        chunk = keys[b * epb : (b + 1) * epb]
        pool[order[b], : chunk.size(0)] = chunk
    pool, tables = pool.to(dev, torch.bfloat16), order.to(dev, torch.int32).unsqueeze(0)
    q = _ternary(g, rows, heads, hd).to(dev, torch.bfloat16)
    w = (torch.randint(-16, 17, (rows, heads), generator=g).float() / 8).to(dev, torch.bfloat16)
    vis = torch.tensor([n, n - 1, 4000, 700], dtype=torch.int32, device=dev)
    kb = keys.to(dev, torch.bfloat16)
    scores = (torch.einsum("mhd,nd->mhn", q, kb).relu() * w.unsqueeze(-1)).sum(dim=1).float()
    scores = scores.masked_fill(torch.arange(n, device=dev) >= vis.unsqueeze(-1), float("-inf"))
    want = stable_topk(scores, k).sort(dim=-1).values
    want = torch.where(want < vis.unsqueeze(-1), want, -1)
    sel, cand = AK.indexer_topk_candidates(
        q, w, pool, tables, vis, k, topk_blocks, block, max_entries=n, version=version, splits=splits
    )
    assert torch.equal(sel, want)
    if version == 5:  # the select pass's other launches: 4-bit digits, the next chunk loaded early
        for select in ({"digit": 4}, {"prefetch": True}, {"chunk": 1024, "num_warps": 4, "prefetch": True}):
            kw = dict(max_entries=n, version=5, select=select)
            assert torch.equal(AK.indexer_topk(q, w, pool, tables, vis, k, **kw), want)
    want_cand = select_candidate_blocks(scores, vis, topk_blocks, block)
    assert torch.equal(cand.repeat_interleave(block, 1)[:, :n], want_cand)
    sel2, cand2 = AK.indexer_topk_candidates(q, w, pool, tables, vis, k, topk_blocks, block, max_entries=n, version=2)
    assert torch.equal(sel2, sel) and torch.equal(cand2, cand)
    q2 = _ternary(g, rows, heads, hd).to(dev, torch.bfloat16)
    re3 = AK.indexer_topk(
        q2, w, pool, tables, vis, k, candidates=cand, candidate_block=block, version=version, splits=splits
    )
    re2 = AK.indexer_topk(q2, w, pool, tables, vis, k, candidates=cand, candidate_block=block, version=2)
    assert torch.equal(re3, re2)
    s2 = (torch.einsum("mhd,nd->mhn", q2, kb).relu() * w.unsqueeze(-1)).sum(dim=1).float()
    s2 = s2.masked_fill((torch.arange(n, device=dev) >= vis.unsqueeze(-1)) | ~want_cand, float("-inf"))
    want2 = stable_topk(s2, k).sort(dim=-1).values
    assert torch.equal(re3, torch.where(want2 < vis.unsqueeze(-1), want2, -1))


@pytest.mark.parametrize("version", [3, 5], ids=["v3", "v5_gluon"])
@pytest.mark.parametrize(("win", "k"), [(128, 512), (100, 200), (128, 0)], ids=["true", "ragged", "window_only"])
@pytest.mark.parametrize(("rows_per_seq", "n_seqs"), [(4, 64), (512, 2)])
def test_fused_attention_two_window_sources_at_true_shapes(rows_per_seq, n_seqs, win, k, version):
    """The engine's fused attention call at V4.1's shapes (64 heads x 512, window 128, top-512, bf16,
    probabilities rounded): window slots from a ring buffer and this step's rows, entries from a
    shuffled pool, against ``fast_sparse_attention`` (the gathered CUDA path) on the same keys; a row
    that sees nothing gives zeros; then captured in a CUDA graph and replayed on new inputs: equal
    to the eager call. Also key counts off the 64-key tile (a ragged last tile) and a window-only
    layer (no entries). Version 3 and version 5 (the Gluon kernel, sm_90 only, the default there:
    the same bits as asking for it)."""
    if version == 5 and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("attention version 5 is a Hopper kernel")
    from asympd.model.cuda_ops import fast_sparse_attention

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    h, d, epb, n_ent = 64, 512, 64, 4096
    rows = rows_per_seq * n_seqs
    q = torch.randn(rows, h, d, generator=g, device=dev).to(bf)
    ring = torch.randn(n_seqs * 160, d, generator=g, device=dev).to(bf)
    new = torch.randn(rows, d, generator=g, device=dev).to(bf)
    nb = n_ent // epb
    pool = torch.randn(n_seqs * nb + 3, epb, d, generator=g, device=dev).to(bf)
    tables = torch.randperm(n_seqs * nb + 3, device=dev)[: n_seqs * nb].view(n_seqs, nb).to(torch.int32)
    row_seq = torch.arange(n_seqs, device=dev).repeat_interleave(rows_per_seq)
    sink = torch.randn(h, generator=g, device=dev)

    def inputs():
        widx = torch.randint(0, ring.size(0), (rows, win), generator=g, device=dev)
        fresh = torch.rand(rows, win, generator=g, device=dev) < 0.3
        widx = torch.where(fresh, -2 - torch.randint(0, rows, (rows, win), generator=g, device=dev), widx)
        widx[torch.rand(rows, win, generator=g, device=dev) < 0.1] = -1
        sel = torch.rand(rows, n_ent, generator=g, device=dev).argsort(-1)[:, :k].sort(-1).values
        sel[torch.rand(rows, k, generator=g, device=dev) < 0.1] = -1
        return widx, sel

    def fused(widx, sel):
        return AK.sparse_attention_paged(
            q, ring, widx, sel, pool, tables, sink, d**-0.5, True, row_seq=row_seq, window_new=new, version=version
        )

    widx, sel = inputs()
    got = fused(widx, sel)
    wkeys = torch.where((widx <= -2).unsqueeze(-1), new[(-2 - widx).clamp_min(0)], ring[widx.clamp_min(0)])
    blk = tables.long()[row_seq.unsqueeze(-1), sel.clamp_min(0) // epb]
    ent = pool.view(-1, d)[blk * epb + sel.clamp_min(0) % epb]
    want = fast_sparse_attention(
        q, torch.cat([wkeys, ent], 1), torch.cat([widx != -1, sel >= 0], 1), sink, d**-0.5, True
    )
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 1e-2, rel  # bf16 probabilities rounded against the running max (measured ~2e-3)
    if version == 5:
        default = AK.sparse_attention_paged(
            q, ring, widx, sel, pool, tables, sink, d**-0.5, True, row_seq=row_seq, window_new=new
        )
        assert torch.equal(default, got)
    hidden_w, hidden_s = widx.clone(), sel.clone()
    hidden_w[0], hidden_s[0] = -1, -1
    assert torch.equal(fused(hidden_w, hidden_s)[0], torch.zeros_like(q[0]))
    static_w, static_s = widx.clone(), sel.clone()
    fused(static_w, static_s)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(static_w, static_s)
    widx2, sel2 = inputs()
    static_w.copy_(widx2)
    static_s.copy_(sel2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused(widx2, sel2))
