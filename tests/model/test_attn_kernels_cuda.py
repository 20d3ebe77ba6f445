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
