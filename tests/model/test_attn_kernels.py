"""The fused indexer and sparse attention kernels (asympd/model/attn_kernels.py) against the CPU
reference, through the Triton interpreter on tiny shapes, keys in shuffled paged pools."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asympd.model import attn_kernels as AK
from asympd.model.attention import select_candidate_blocks, sparse_attention
from asympd.model.ops import stable_topk
from asympd.model.quant import fp4_qdq

pytestmark = [
    pytest.mark.skipif(not AK.AVAILABLE, reason="needs triton"),
    # CPU tensors through Triton's interpreter (tests/conftest.py sets it where there is no GPU); on a
    # GPU machine bench/attn_kernels.py checks the compiled kernels against the unfused path
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests: CPU only"),
]

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fp4_grid(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Signed e2m1 values: every product and sum of the tests' sizes is exact in fp32, so scores do
    not depend on summation order and ties are common."""
    v = E2M1[torch.randint(0, 8, shape, generator=g)]
    return torch.where(torch.rand(shape, generator=g) < 0.5, -v, v)


def paged(entries: list[torch.Tensor], epb: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's entries [n_s, width] in a shared pool of shuffled blocks: (pool, tables)."""
    need = [-(-e.size(0) // epb) for e in entries]
    total = sum(need) + 3  # spare blocks hold garbage a wrong read would pick up
    order = torch.randperm(total, generator=g)
    width = entries[0].size(1)
    pool = torch.randn(total, epb, width, generator=g) * 100
    tables = torch.zeros(len(entries), max(need), dtype=torch.int32)
    used = 0
    for s, e in enumerate(entries):
        blocks = order[used : used + need[s]]
        used += need[s]
        tables[s, : need[s]] = blocks.to(torch.int32)
        for i in range(e.size(0)):
            pool[blocks[i // epb], i % epb] = e[i]
    return pool, tables


def ref_select(q, w, keys, visible, k, cand=None):
    """``Attention._select`` on given inputs (fp32): the selection padded to k with -1, the scores."""
    n = keys.size(0)
    scores = torch.einsum("mhd,nd->mhn", q, keys).relu()
    scores = (scores * w.unsqueeze(-1)).sum(dim=1).float()
    scores = scores.masked_fill(torch.arange(n) >= visible.unsqueeze(-1), float("-inf"))
    if cand is not None:
        scores = scores.masked_fill(~cand, float("-inf"))
    idx = stable_topk(scores, min(k, n)).sort(dim=-1).values
    idx = torch.where(idx < visible.unsqueeze(-1), idx, -1)
    return F.pad(idx, (0, k - idx.size(1)), value=-1), scores


def segments(g, lens_rows, heads, hd, values):
    """Per sequence (entries n, rows m, first visible count): keys, q, w, causal visible counts."""
    out = []
    for n, m, v0 in lens_rows:
        keys = values(g, n, hd)
        q = values(g, m, heads, hd)
        w = torch.randint(-16, 17, (m, heads), generator=g).float() / 8
        vis = torch.clamp(torch.arange(v0, v0 + m), max=n)
        out.append((keys, q, w, vis))
    return out


@pytest.fixture(params=[1, 2, 3, 4, 5], ids=["v1", "v2", "v3", "v4", "v5"])
def kernel_version(request, monkeypatch):
    """Every kernel version: the earlier ones stay selectable so benchmarks time old against new
    (attention has versions 1 to 3; the indexer's versions 4 and 5 run beside attention's 3)."""
    monkeypatch.setattr(AK, "INDEXER_VERSION", request.param)
    monkeypatch.setattr(AK, "ATTENTION_VERSION", min(request.param, 3))
    return request.param


@pytest.fixture(params=[1, 2, 3], ids=["v1", "v2", "v3"])
def attention_version(request, monkeypatch):
    """The attention kernel's versions."""
    monkeypatch.setattr(AK, "ATTENTION_VERSION", request.param)
    return request.param


@pytest.mark.parametrize("values", ["grid", "fp4"])
def test_indexer_topk_matches_reference(values, kernel_version):
    g = torch.Generator().manual_seed(1)
    heads, hd, k, epb = 4, 32, 8, 4
    if values == "grid":
        gen = fp4_grid
    else:  # the release's FP4 rounding of Gaussian data: real scales, sums need not be exact

        def gen(g, *shape):
            return fp4_qdq(torch.randn(*shape, generator=g), 32)

    segs = segments(g, [(37, 9, 28), (5, 3, 2), (70, 6, 0)], heads, hd, gen)
    pool, tables = paged([s[0] for s in segs], epb, g)
    q = torch.cat([s[1] for s in segs])
    w = torch.cat([s[2] for s in segs])
    vis = torch.cat([s[3] for s in segs])
    row_seq = torch.cat([torch.full((s[1].size(0),), i) for i, s in enumerate(segs)])
    got = AK.indexer_topk(q, w, pool, tables, vis, k, row_seq=row_seq)
    want = torch.cat([ref_select(s[1], s[2], s[0], s[3], k)[0] for s in segs])
    assert got.dtype == torch.int64 and got.shape == (q.size(0), k)
    assert torch.equal(got, want)
    # rows with fewer visible entries than k end in -1; a row seeing nothing selects nothing
    assert (got[9 + 3 + 0] == -1).all() and got[9, :2].tolist() == [0, 1] and (got[9, 2:] == -1).all()


def test_indexer_topk_ties_go_to_the_lowest_index(kernel_version):
    g = torch.Generator().manual_seed(2)
    heads, hd, k, epb, n, m = 4, 32, 8, 8, 150, 5
    keys = fp4_grid(g, n, hd)
    keys[::3] = keys[0]  # every third entry scores exactly like entry 0
    keys[40:60] = 0  # a run of zero scores
    q = fp4_grid(g, m, heads, hd)
    q[1] = 0  # a row where every score is 0: entries 0..k-1
    w = torch.randint(-16, 17, (m, heads), generator=g).float() / 8
    w[2] = -1  # a row where every score is <= 0: the zeros win, lowest first
    vis = torch.tensor([150, 150, 150, 97, 64])
    pool, tables = paged([keys], epb, g)
    got = AK.indexer_topk(q, w, pool, tables, vis, k, rows_per_tile=4)  # the CUDA default
    want, scores = ref_select(q, w, keys, vis, k)
    assert torch.equal(got, want)
    assert got[1].tolist() == list(range(k))
    # the tie at the k-th place is real in the crafted rows
    kth = scores.sort(dim=-1, descending=True).values[:, k - 1 : k + 1]
    assert (kth[:, 0] == kth[:, 1]).any()
    # k above the 64-wide merge tile: a full 512-wide state
    want100 = ref_select(q, w, keys, vis, 100)[0]
    assert torch.equal(AK.indexer_topk(q, w, pool, tables, vis, 100), want100)
    # many small score tiles buffered between merges
    assert torch.equal(AK.indexer_topk(q, w, pool, tables, vis, 100, block_n=16), want100)
    # 8 rows per tile (version 2's CUDA default for prefill) and 64-entry tiles
    assert torch.equal(AK.indexer_topk(q, w, pool, tables, vis, 100, rows_per_tile=8, block_n=64), want100)
    # Triton's own sort, the fallback, selects the same (two rows: it is slow in the interpreter)
    got = AK.indexer_topk(q[:2], w[:2], pool, tables, vis[:2], k, rows_per_tile=2, sort_impl="triton")
    assert torch.equal(got, want[:2])


def test_indexer_versions_agree_in_bf16():
    """bf16 inputs take the reference's bf16 roundings (per-head score, weighted score, the sum) in
    both kernels; on e2m1 values every sum is exact, so the two select the same entries."""
    g = torch.Generator().manual_seed(6)
    heads, hd, epb = 4, 32, 8
    segs = segments(g, [(90, 6, 60), (33, 3, 30)], heads, hd, fp4_grid)
    pool, tables = paged([s[0] for s in segs], epb, g)
    q, w = torch.cat([s[1] for s in segs]).bfloat16(), torch.cat([s[2] for s in segs]).bfloat16()
    vis = torch.cat([s[3] for s in segs])
    row_seq = torch.tensor([0] * 6 + [1] * 3)
    args = (q, w, pool.bfloat16(), tables, vis, 16)
    v1 = AK.indexer_topk(*args, row_seq=row_seq, version=1)
    assert torch.equal(AK.indexer_topk(*args, row_seq=row_seq, version=2), v1)
    assert torch.equal(AK.indexer_topk(*args, row_seq=row_seq, version=2, rows_per_tile=4, block_n=16), v1)
    assert torch.equal(AK.indexer_topk(*args, row_seq=row_seq, version=3, splits=2), v1)
    assert torch.equal(AK.indexer_topk(*args, row_seq=row_seq, version=4, splits=2), v1)
    assert torch.equal(AK.indexer_topk(*args, row_seq=row_seq, version=4, rows_per_tile=4, maxnreg=128), v1)
    assert torch.equal(AK.indexer_topk(*args, row_seq=row_seq, version=5), v1)  # 16-bit radix keys
    want = torch.cat([ref_select(s[1].float(), s[2].float(), s[0], s[3], 16)[0] for s in segs])
    assert torch.equal(v1, want)


@pytest.mark.parametrize(("epb", "splits", "version"), [(16, 1, 3), (32, 3, 3), (64, 2, 4)])
def test_indexer_v3_block_tiles_and_splits(epb, splits, version):
    """Version 3's own paths: key tiles inside one cache block (epb a multiple of the 16-entry
    tile: one table load per tile, no per-entry gather) and a row tile's entries split over
    programs whose top-k keys the wrapper merges; ties, the candidate pool and the re-index
    layer included, each equal to the reference. Version 4 (the same kernel at its own defaults)
    with k = 40: 64-entry key tiles inside 64-entry blocks, a 64-wide top-k state."""
    g = torch.Generator().manual_seed(7)
    heads, hd, block, topk_blocks = 4, 32, 4, 3
    k = 8 if version == 3 else 40
    segs = segments(g, [(150, 5, 146), (45, 3, 40)], heads, hd, fp4_grid)
    segs[0][0][::3] = segs[0][0][0]  # every third entry ties with entry 0
    segs[0][0][60:90] = 0  # a run of zero scores
    segs[0][1][1] = 0  # a row whose scores are all 0: entries 0 .. k-1
    pool, tables = paged([s[0] for s in segs], epb, g)
    q, w = torch.cat([s[1] for s in segs]), torch.cat([s[2] for s in segs])
    vis = torch.cat([s[3] for s in segs])
    row_seq = torch.tensor([0] * 5 + [1] * 3)
    kw = dict(row_seq=row_seq, rows_per_tile=4, version=version, splits=splits)
    if version == 3:
        kw["block_n"] = 16
    sel, cand = AK.indexer_topk_candidates(q, w, pool, tables, vis, k, topk_blocks, block, **kw)
    q2 = fp4_grid(g, q.size(0), heads, hd)
    sel2 = AK.indexer_topk(q2, w, pool, tables, vis, k, candidates=cand, candidate_block=block, **kw)
    lo = 0
    for keys, qs, ws, v in segs:
        m, n = qs.size(0), keys.size(0)
        want, scores = ref_select(qs, ws, keys, v, k)
        assert torch.equal(sel[lo : lo + m], want)
        want_cand = select_candidate_blocks(scores, v, topk_blocks, block)
        got_cand = cand[lo : lo + m].repeat_interleave(block, 1)[:, :n]
        assert torch.equal(got_cand, want_cand[:, : got_cand.size(1)])
        want2, _ = ref_select(q2[lo : lo + m], ws, keys, v, k, cand=want_cand)
        assert torch.equal(sel2[lo : lo + m], want2)
        lo += m
    assert sel[1].tolist() == list(range(k))
    kth = ref_select(segs[0][1], segs[0][2], segs[0][0], segs[0][3], k)[1].sort(dim=-1, descending=True).values
    assert (kth[:, k - 1] == kth[:, k]).any()  # a tie at the k-th place is real


def test_indexer_v5_radix_select(monkeypatch):
    """Version 5's own paths: the select pass's chunks (64 entries under the interpreter) with the
    threshold's ties spread over several of them, scores of both signs and -inf (outside the
    candidate pool), rows with fewer entries than k and none, 16- and 32-bit keys, and the rows
    split into groups when their keys would exceed the workspace -- each equal to the reference."""
    g = torch.Generator().manual_seed(9)
    heads, hd, k, epb = 4, 32, 24, 16
    segs = segments(g, [(300, 6, 200), (20, 3, 18), (150, 4, 0)], heads, hd, fp4_grid)
    segs[0][0][::4] = segs[0][0][1]  # 75 entries tie with entry 1 across every 64-entry chunk
    segs[0][0][100:250] = 0  # and a run of zero scores across three chunks (row 2's best: all <= 0)
    pool, tables = paged([s[0] for s in segs], epb, g)
    q, w = torch.cat([s[1] for s in segs]), torch.cat([s[2] for s in segs])
    w[2] = -w[2].abs()  # a row whose scores are all <= 0
    vis = torch.cat([s[3] for s in segs])
    row_seq = torch.tensor([0] * 6 + [1] * 3 + [2] * 4)
    cand = torch.rand(q.size(0), 300, generator=g) < 0.3
    want, want_c = [], []
    lo = 0
    for keys, qs, _, v in segs:
        m = qs.size(0)
        ws = w[lo : lo + m]
        want.append(ref_select(qs, ws, keys, v, k)[0])
        want_c.append(ref_select(qs, ws, keys, v, k, cand=cand[lo : lo + m, : keys.size(0)])[0])
        lo += m
    want, want_c = torch.cat(want), torch.cat(want_c)
    scores = ref_select(segs[0][1], w[:6], segs[0][0], segs[0][3], k)[1]
    kth = scores.sort(dim=-1, descending=True).values
    assert kth[2, k - 1] == kth[2, k] == 0  # a tie at the k-th place is real
    args = (q, w, pool, tables, vis, k)
    # all rows at once, then two rows a group; the select pass's launches (4-bit digits: four
    # histogram passes over 16-bit keys, eight over 32-bit ones; the next chunk loaded early)
    for workspace, select in ((1 << 30, None), (300 * 4 * 2, None), (1 << 30, {"digit": 4, "prefetch": True})):
        monkeypatch.setattr(AK, "V5_WORKSPACE", workspace)
        kw = dict(row_seq=row_seq, version=5, select=select)
        assert torch.equal(AK.indexer_topk(*args, **kw), want)
        assert torch.equal(AK.indexer_topk(*args, candidates=cand, **kw), want_c)
    assert (want[9:13] == -1).sum() > 0 and (want[6:9, 20:] == -1).all()  # short rows end in -1
    # bf16 inputs: 16-bit keys, the reference's bf16 roundings; e2m1 values keep every sum exact
    qb, wb, pb = q.bfloat16(), w.bfloat16(), pool.bfloat16()
    v1 = AK.indexer_topk(qb, wb, pb, tables, vis, k, row_seq=row_seq, version=1)
    assert torch.equal(AK.indexer_topk(qb, wb, pb, tables, vis, k, row_seq=row_seq, version=5), v1)
    fast = {"digit": 4, "prefetch": True}
    assert torch.equal(AK.indexer_topk(qb, wb, pb, tables, vis, k, row_seq=row_seq, version=5, select=fast), v1)
    # a bound below the visible entries (a caller's error): nothing past the 64-aligned key row is
    # scored or read, the selection is the one over the first 64 entries
    got = AK.indexer_topk(q, w, pool, tables, vis, k, row_seq=row_seq, version=5, max_entries=40)
    lo, want64 = 0, []
    for keys, qs, _, v in segs:
        want64.append(ref_select(qs, w[lo : lo + qs.size(0)], keys, v.clamp(max=64), k)[0])
        lo += qs.size(0)
    assert torch.equal(got, torch.cat(want64))
    # the candidate pool from v5's select kernel (16-bit keys of the block maxima, the newest
    # visible block pinned) against torch's block top-k after version 1
    for version in (1, 5):
        got = AK.indexer_topk_candidates(qb, wb, pb, tables, vis, k, 5, 4, row_seq=row_seq, version=version)
        if version == 1:
            want_pool = got
    assert torch.equal(got[0], want_pool[0]) and torch.equal(got[1], want_pool[1])
    assert (got[1].sum(1) == torch.clamp((vis + 3) // 4, max=5)).all()  # every visible block up to 5


def test_candidate_source_and_reindex_layer(kernel_version):
    """L20 picks its top-k and the candidate blocks; a re-index layer chooses within them."""
    g = torch.Generator().manual_seed(3)
    heads, hd, k, epb, block, topk_blocks = 4, 32, 8, 8, 4, 3
    segs = segments(g, [(61, 7, 40), (23, 4, 9)], heads, hd, fp4_grid)
    pool, tables = paged([s[0] for s in segs], epb, g)
    q = torch.cat([s[1] for s in segs])
    w = torch.cat([s[2] for s in segs])
    vis = torch.cat([s[3] for s in segs])
    row_seq = torch.cat([torch.full((s[1].size(0),), i) for i, s in enumerate(segs)])
    sel, cand = AK.indexer_topk_candidates(q, w, pool, tables, vis, k, topk_blocks, block, row_seq=row_seq)
    assert cand.size(1) == -(-int(vis.max()) // block)
    # sized from the caller's entry count instead (no sync): the same selection and pool, wider
    sel_n, cand_n = AK.indexer_topk_candidates(
        q, w, pool, tables, vis, k, topk_blocks, block, row_seq=row_seq, max_entries=61
    )
    assert torch.equal(sel_n, sel) and cand_n.size(1) == 16 and torch.equal(cand_n[:, : cand.size(1)], cand)
    assert not cand_n[:, cand.size(1) :].any()
    q2 = fp4_grid(g, q.size(0), heads, hd)  # the re-index layer's own queries
    sel2 = AK.indexer_topk(q2, w, pool, tables, vis, k, row_seq=row_seq, candidates=cand, candidate_block=block)
    lo = 0
    for keys, qs, ws, v in segs:
        m, n = qs.size(0), keys.size(0)
        want, scores = ref_select(qs, ws, keys, v, k)
        want_cand = select_candidate_blocks(scores, v, topk_blocks, block)  # [m, n] per entry
        assert torch.equal(sel[lo : lo + m], want)
        got_cand = cand[lo : lo + m].repeat_interleave(block, 1)[:, :n]
        assert torch.equal(got_cand, want_cand[:, : got_cand.size(1)])
        assert not want_cand[:, got_cand.size(1) :].any()
        want2, _ = ref_select(q2[lo : lo + m], ws, keys, v, k, cand=want_cand)
        assert torch.equal(sel2[lo : lo + m], want2)
        lo += m
    # the pool is the newest block plus topk_blocks - 1 others wherever there are more blocks
    assert (cand.sum(1) <= topk_blocks).all() and cand.sum(1).max() == topk_blocks


def test_indexer_bad_input():
    q = torch.zeros(2, 4, 32)
    pool, tables = torch.zeros(3, 4, 32), torch.zeros(1, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="w of shape"):
        AK.indexer_topk(q, torch.zeros(2, 3), pool, tables, torch.tensor([1, 2]), 8)
    with pytest.raises(ValueError, match="key_pool"):
        AK.indexer_topk(q, torch.zeros(2, 4), torch.zeros(3, 4, 16), tables, torch.tensor([1, 2]), 8)
    with pytest.raises(ValueError, match="k must be positive"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match="n_visible"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2, 3]), 8)
    with pytest.raises(ValueError, match="rows_per_tile"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, rows_per_tile=3)
    with pytest.raises(ValueError, match="row_seq"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, row_seq=torch.zeros(3))
    with pytest.raises(ValueError, match="version must be 1 to 5, got 6"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, version=6)
    with pytest.raises(ValueError, match="maxnreg is for versions 3 and 4, got version 2"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, version=2, maxnreg=128)
    with pytest.raises(ValueError, match="select needs digit 2, 4 or 8"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, version=5, select={"digit": 3})
    with pytest.raises(ValueError, match="a power-of-two chunk"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, version=5, select={"chunk": 1000})
    with pytest.raises(ValueError, match="select is for version 5"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, version=5, select={"bits": 4})
    with pytest.raises(ValueError, match="splits must be positive"):
        AK.indexer_topk(q, torch.zeros(2, 4), pool, tables, torch.tensor([1, 2]), 8, splits=0)
    qa, win = torch.zeros(2, 4, 64), torch.zeros(5, 64)
    ckv, sink = torch.zeros(3, 4, 64), torch.zeros(4)
    with pytest.raises(ValueError, match="for 2 rows"):
        AK.sparse_attention_paged(qa, win, torch.zeros(3, 16), torch.zeros(2, 8), ckv, tables, sink, 0.1, False)
    with pytest.raises(ValueError, match="version must be 1, 2, 3 or 5, got 0"):
        AK.sparse_attention_paged(
            qa, win, torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long), ckv, tables, sink,
            0.1, False, version=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="integer tensors"):
        AK.sparse_attention_paged(qa, win, torch.zeros(2, 16), torch.zeros(2, 8), ckv, tables, sink, 0.1, False)
    with pytest.raises(ValueError, match="head_dim"):
        AK.sparse_attention_paged(
            qa, win, torch.zeros(2, 16), torch.zeros(2, 8), ckv[..., :32], tables, sink, 0.1, False
        )


def test_attention_version_5_says_why_it_cannot_run_here():
    """Version 5 is a Gluon kernel for Hopper: asked for elsewhere (or on fp32 operands), a clear
    error; the default falls back to version 3 there."""
    g = torch.Generator().manual_seed(3)
    q, win, pool = torch.randn(2, 4, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(3, 4, 64)
    widx, sel = torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long)
    tables, sink = torch.zeros(1, 3, dtype=torch.int32), torch.zeros(4)
    with pytest.raises(ValueError, match="attention version 5: (a Hopper|bf16 queries)"):
        AK.sparse_attention_paged(q, win, widx, sel, pool, tables, sink, 0.1, True, version=5)
    # the default asks for nothing: version 5 where it can run, else the fallback, the same bits
    assert AK.ATTENTION_VERSION == 5 and AK.ATTENTION_FALLBACK == 3
    default = AK.sparse_attention_paged(q, win, widx, sel, pool, tables, sink, 0.1, True)
    assert torch.equal(default, AK.sparse_attention_paged(q, win, widx, sel, pool, tables, sink, 0.1, True, version=3))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(sink + 1e30): the empty row
@pytest.mark.parametrize("round_probs", [False, True])
def test_sparse_attention_paged_matches_reference(round_probs, attention_version):
    """fp32 throughout; tolerance 1e-5 relative (summation order and the online rescaling; with
    round_probs the bf16 rounding happens against the running max: 1e-2)."""
    g = torch.Generator().manual_seed(4)
    h, d, win, k, epb = 4, 64, 16, 8, 4
    ns, ms = [30, 9], [5, 3]
    entries = [torch.randn(n, d, generator=g) for n in ns]
    pool, tables = paged(entries, epb, g)
    rows = sum(ms)
    q = torch.randn(rows, h, d, generator=g)
    window_kv = torch.randn(40, d, generator=g)
    widx = torch.randint(0, 40, (rows, win), generator=g)
    widx[torch.rand(rows, win, generator=g) < 0.3] = -1
    row_seq = torch.tensor([0] * ms[0] + [1] * ms[1])
    sel = torch.stack([torch.randperm(ns[int(s)], generator=g)[:k] for s in row_seq])
    sel[torch.rand(rows, k, generator=g) < 0.25] = -1
    sel[5] = -1  # a row that sees window rows only
    widx[6], sel[6] = -1, -1  # a row that sees nothing: zeros
    sink = torch.randn(h, generator=g)
    scale = d**-0.5
    got = AK.sparse_attention_paged(q, window_kv, widx, sel, pool, tables, sink, scale, round_probs, row_seq=row_seq)
    ent = torch.stack([entries[int(s)][sel[i].clamp_min(0)] for i, s in enumerate(row_seq)])
    keys = torch.cat([window_kv[widx.clamp_min(0)], ent], dim=1)
    mask = torch.cat([widx >= 0, sel >= 0], dim=1)
    want = sparse_attention(q, keys, mask, sink, scale, round_probs)
    tol = 1e-2 if round_probs else 1e-5
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).norm() / want.norm()) < tol
    assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    assert torch.equal(got[6], torch.zeros(h, d))


@pytest.mark.parametrize("ring_dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_paged_reads_two_window_sources(ring_dtype, attention_version):
    """``window_new``: window slots from a ring buffer (index >= 0) and from this step's rows
    (-2 - i), -1 hidden, as the engine's batched path names them. Equals the reference over the
    same keys gathered (the ring buffer's values upcast, as the gathered path does) within 1e-5;
    a window-only call (no entries, a one-row pool) too; the ring buffer is not copied."""
    g = torch.Generator().manual_seed(6)
    h, d, win, k, epb = 4, 64, 16, 8, 4
    ns, ms = [21, 12], [6, 4]
    entries = [torch.randn(n, d, generator=g) for n in ns]
    pool, tables = paged(entries, epb, g)
    rows = sum(ms)
    q = torch.randn(rows, h, d, generator=g)
    ring = torch.randn(50, d, generator=g).to(ring_dtype)
    new = torch.randn(rows, d, generator=g)
    widx = torch.randint(0, 50, (rows, win), generator=g)
    fresh = torch.rand(rows, win, generator=g) < 0.4
    widx = torch.where(fresh, -2 - torch.randint(0, rows, (rows, win), generator=g), widx)
    widx[torch.rand(rows, win, generator=g) < 0.2] = -1
    widx[3] = -2 - torch.arange(win) % rows  # a row whose window is all this step's rows
    widx[4] = torch.arange(win)  # ... all the ring buffer's
    row_seq = torch.tensor([0] * ms[0] + [1] * ms[1])
    sel = torch.stack([torch.randperm(ns[int(s)], generator=g)[:k] for s in row_seq])
    sel[torch.rand(rows, k, generator=g) < 0.25] = -1
    sink = torch.randn(h, generator=g)
    scale = d**-0.5
    seen = []
    original = torch.Tensor.to
    with pytest.MonkeyPatch.context() as mp:  # the ring buffer is never converted (at true shape it is large)
        mp.setattr(torch.Tensor, "to", lambda t, *a, **kw: seen.append(t.shape) or original(t, *a, **kw))
        got = AK.sparse_attention_paged(
            q, ring, widx, sel, pool, tables, sink, scale, False, row_seq=row_seq, window_new=new
        )
    assert ring.shape not in seen
    wkeys = torch.where((widx <= -2).unsqueeze(-1), new[(-2 - widx).clamp_min(0)], ring[widx.clamp_min(0)].float())
    ent = torch.stack([entries[int(s)][sel[i].clamp_min(0)] for i, s in enumerate(row_seq)])
    for got_i, keys, mask in (
        (got, torch.cat([wkeys, ent], dim=1), torch.cat([widx != -1, sel >= 0], dim=1)),
        (
            AK.sparse_attention_paged(
                q,
                ring,
                widx,
                sel[:, :0],
                pool.new_zeros(1, 1, d),
                tables,
                sink,
                scale,
                False,
                row_seq=row_seq,
                window_new=new,
            ),  # fmt: skip
            wkeys,
            widx != -1,
        ),
    ):
        want = sparse_attention(q, keys, mask, sink, scale, False)
        assert got_i.shape == want.shape and got_i.dtype == want.dtype
        err = (got_i - want).abs().flatten(1).amax(1) / want.abs().flatten(1).amax(1)
        assert float(err.max()) < 1e-5
    with pytest.raises(ValueError, match="window_new"):
        AK.sparse_attention_paged(q, ring, widx, sel, pool, tables, sink, scale, False, window_new=new[:, :32])


def test_sparse_attention_v3_declares_aligned_offsets_only_where_they_are():
    """Version 3 tells the compiler every entry offset is a 16-byte multiple: true of a pool whose
    address and strides are (as the engine allocates it), false of a view one element in, where
    the wrapper must fall back to unhinted loads and still give version 2's result."""
    g = torch.Generator().manual_seed(8)
    h, d, epb, rows = 4, 64, 4, 3
    pool = torch.randn(6, epb, d, generator=g)
    assert AK._pool_alignment(pool) == 4 and AK._pool_alignment(pool.to(torch.bfloat16)) == 8
    shifted = torch.randn(6 * epb * d + 1, generator=g)[1:].view(6, epb, d)
    shifted.copy_(pool)
    assert AK._pool_alignment(shifted) == 1  # 4 bytes past an aligned allocation
    assert AK._pool_alignment(torch.randn(6, epb, d + 2, generator=g)[..., :d]) == 1  # strides of d + 2
    tables = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32)
    q, win = torch.randn(rows, h, d, generator=g), torch.randn(7, d, generator=g)
    widx = torch.randint(-1, 7, (rows, 8), generator=g)
    sel = torch.tensor([[0, 3, 9, -1], [1, 2, 11, 4], [6, -1, -1, 10]])
    row_seq = torch.tensor([0, 1, 1])
    args = (win, widx, sel)
    tail = (tables, torch.randn(h, generator=g), d**-0.5, False)
    v2 = AK.sparse_attention_paged(q, *args, pool, *tail, row_seq=row_seq, version=2)
    for p in (pool, shifted):
        got = AK.sparse_attention_paged(q, *args, p, *tail, row_seq=row_seq, version=3)
        torch.testing.assert_close(got, v2, rtol=1e-5, atol=1e-6)


def test_indexer_on_the_tiny_checkpoint(tiny_ckpt, monkeypatch, kernel_version):
    """Every index layer of a tiny-checkpoint prefill and decode step (fp32, paged KV through a
    shuffled block table): the kernel selects exactly what ``Attention._select`` does, the candidate
    source's pool included; re-index layers get the reference's candidates."""
    from asympd.kv import KVCacheSpec, PagedKVCache
    from asympd.model.attention import Attention, rotations
    from asympd.model.loader import load_model
    from asympd.model.ops import apply_rope
    from asympd.model.transformer import Chunk

    model = load_model(tiny_ckpt, "full", dtype=torch.float32)
    model.batched = False  # the per-sequence path: its _select is the reference each selection is checked against
    cfg = model.cfg
    spec = KVCacheSpec.from_config(cfg, block_size=8, spec_slack=0, dtype=torch.float32)
    cache = PagedKVCache(spec, num_blocks=16, max_seqs=1)
    table = [11, 3, 14, 0, 7, 9, 2, 5]
    kv = cache.view("a", table, slot=0)
    calls = []
    original = Attention._select

    def checked(self, seg, x, qr, visible, n):
        sel = original(self, seg, x, qr, visible, n)
        rot = rotations(self.freqs, seg.positions)
        q = self.idx_wq_b(qr).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q = fp4_qdq(apply_rope(q, rot, cfg.rope_head_dim), 32)
        w = self.idx_weights(x) * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        pool = cache.pools[f"idx.{self.source}"]
        tables = torch.tensor([table], dtype=torch.int32)
        k = cfg.index_topk
        want = F.pad(sel, (0, k - sel.size(1)), value=-1)
        if self.is_candidate_source:
            got, cand = AK.indexer_topk_candidates(
                q, w, pool, tables, visible, k, cfg.candidate_topk_blocks, cfg.candidate_block_size
            )
            expanded = cand.repeat_interleave(cfg.candidate_block_size, 1)[:, :n]
            assert torch.equal(expanded, seg.shared["candidates"][:, : expanded.size(1)])
        elif self.uses_candidates:
            got = AK.indexer_topk(q, w, pool, tables, visible, k, candidates=seg.shared["candidates"])
        else:
            got = AK.indexer_topk(q, w, pool, tables, visible, k)
        assert torch.equal(got, want), f"layer {self.layer}"
        calls.append((self.layer, x.size(0), n))
        return sel

    monkeypatch.setattr(Attention, "_select", checked)
    ids = torch.randint(0, cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(5))
    model([Chunk(kv, ids[:40], 0, ids)])
    model([Chunk(kv, ids[40:], 40, ids)])
    layers = {layer for layer, _, _ in calls}
    assert cfg.candidate_source_layer in layers and any(layer > cfg.candidate_source_layer for layer in layers)
    assert (cfg.candidate_source_layer, 40, 40) in calls and (cfg.candidate_source_layer, 1, 41) in calls


def test_row_tiles_cover_each_sequence_without_straddling():
    row_seq = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    row0, count = AK.row_tiles(row_seq, n_seqs=3, bm=4)
    assert row0.numel() == 4 + 3  # a bound known without a sync; spare tiles are empty
    tiles = [(int(a), int(c)) for a, c in zip(row0, count, strict=True) if c > 0]
    assert tiles == [(0, 4), (4, 2), (6, 1), (7, 4), (11, 4), (15, 1)]


def test_default_splits_fill_the_resident_blocks(monkeypatch):
    """Version 3 (one block per SM) rounds the programs per row tile up to give every SM one;
    version 4 (two per SM) rounds down, so 256 decode tiles stay one wave on 132 SMs; both keep
    at least 8 * kp entries a split and at most 16 splits."""
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    dev = torch.device("cpu")
    assert AK._default_splits(True, 256, 65536, 512, dev) == 1
    assert AK._default_splits(True, 256, 65536, 512, dev, blocks_per_sm=2) == 1
    assert AK._default_splits(True, 64, 65536, 512, dev) == 3
    assert AK._default_splits(True, 64, 65536, 512, dev, blocks_per_sm=2) == 4
    assert AK._default_splits(True, 8, 65536, 512, dev, blocks_per_sm=2) == 16
    assert AK._default_splits(True, 8, 16384, 512, dev, blocks_per_sm=2) == 4  # 8 * kp entries a split
    assert AK._default_splits(False, 8, 65536, 512, dev, blocks_per_sm=2) == 1  # the interpreter
