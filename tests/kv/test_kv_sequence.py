"""PagedSequenceKV and DenseSequenceKV: the same operations give the same reads, and both keep what a
speculative rollback needs."""

import random

import pytest
import torch

from asympd.config import tiny
from asympd.kv import BlockManager, DenseSequenceKV, KVCacheSpec, PagedKVCache, SequenceKV

BS = 4
SLACK = 2


def paged(cfg=None, slack=SLACK, dtype=torch.float32, num_blocks=512, max_seqs=3):
    cfg = cfg or tiny()
    spec = KVCacheSpec.from_config(cfg, block_size=BS, spec_slack=slack, dtype=dtype)
    return spec, BlockManager(spec, num_blocks, max_seqs), PagedKVCache(spec, num_blocks, max_seqs)


class Driver:
    """Plays the model: extends a sequence by k tokens (writing every group the way the model does) or
    rolls it back, on one SequenceKV."""

    def __init__(self, kv: SequenceKV, spec: KVCacheSpec) -> None:
        self.kv, self.spec, self.n = kv, spec, 0

    def extend(self, k: int, g: torch.Generator, grow=None) -> None:
        cfg, n = self.spec.cfg, self.n
        if grow:
            grow(n + k)
        pos = torch.arange(n, n + k)
        for layer in self.spec.kv_source_layers:
            r = cfg.ratio(layer)
            lo, hi = n // r, (n + k) // r
            self.kv.write_compressed(layer, lo, torch.randn(hi - lo, cfg.head_dim, generator=g))
            self.kv.write_index_keys(layer, lo, torch.randn(hi - lo, cfg.index_head_dim, generator=g))
        for layer in self.spec.window_layers:
            self.kv.append_window(layer, pos, torch.randn(k, cfg.head_dim, generator=g))
        for layer in self.spec.pair_layers:
            kv, score = torch.randn(2, k, cfg.head_dim, generator=g)
            self.kv.append_pending(layer, pos, kv, score)
        self.n += k

    def rollback(self, b: int, shrink=None) -> None:
        self.n -= b
        self.kv.truncate(self.n)
        if shrink:
            shrink(self.n)

    def reads(self) -> dict:
        cfg, out = self.spec.cfg, {}
        for layer in self.spec.kv_source_layers:
            out[f"ckv.{layer}"] = self.kv.read_compressed(layer, self.n // cfg.ratio(layer))
            out[f"idx.{layer}"] = self.kv.read_index_keys(layer, self.n // cfg.ratio(layer))
        for layer in self.spec.window_layers:
            out[f"swa.{layer}"] = self.kv.window(layer)
        for layer in self.spec.pair_layers:
            out[f"pair.{layer}"] = self.kv.pending(layer)
        return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = (a[name], b[name]) if isinstance(a[name], tuple) else ((a[name],), (b[name],))
        for u, v in zip(x, y, strict=True):
            assert u.dtype == v.dtype and torch.equal(u, v), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_paged_and_dense_agree_on_random_operations(seed, dtype):
    """Two requests interleave (so their block tables interleave), each mirrored by a dense twin."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    spec, mgr, cache = paged(dtype=dtype)
    cfg = spec.cfg
    pairs = []
    for sid in ("a", "b"):
        alloc = mgr.allocate(sid, 0)
        pk = Driver(cache.view(sid, alloc.block_table, alloc.slot), spec)
        dk = Driver(DenseSequenceKV(cfg, spec_slack=SLACK, dtype=dtype), spec)
        pairs.append((sid, pk, dk))
    for _ in range(40):
        sid, pk, dk = rng.choice(pairs)
        if pk.n and rng.random() < 0.35:
            b = rng.randint(1, min(pk.n, 2 * SLACK + 3))  # also beyond the slack: both must lose the same
            pk.rollback(b, shrink=lambda n, sid=sid: mgr.truncate(sid, n))
            dk.rollback(b)
        elif pk.n and rng.random() < 0.2:  # recompute the last b tokens without truncating first
            b = rng.randint(1, min(pk.n, SLACK))
            pk.n -= b
            dk.n -= b
            seed_state = g.get_state()
            pk.extend(b, g)
            g.set_state(seed_state)
            dk.extend(b, g)
        else:
            k = rng.choice([1, 1, 2, 3, 5, cfg.window_size + SLACK + 3])
            seed_state = g.get_state()
            pk.extend(k, g, grow=lambda n, sid=sid: mgr.grow(sid, n))
            g.set_state(seed_state)
            dk.extend(k, g)
        for _, p, d in pairs:
            assert_same(p.reads(), d.reads())


@pytest.mark.parametrize("impl", ["paged", "dense"])
def test_rollback_restores_open_group_and_full_window(impl):
    """After any step of up to 1 + slack tokens, rolling back by up to slack tokens leaves exactly the
    open group of the shorter sequence and at least window_size window rows."""
    slack, cfg = 3, tiny()
    g = torch.Generator().manual_seed(0)
    if impl == "paged":
        spec, mgr, cache = paged(slack=slack)
        a = mgr.allocate("s", 0)
        kv = cache.view("s", a.block_table, a.slot)
        grow = lambda n: mgr.grow("s", n)  # noqa: E731
        shrink = lambda n: mgr.truncate("s", n)  # noqa: E731
    else:
        spec, grow, shrink = KVCacheSpec.from_config(cfg, block_size=BS, spec_slack=slack), None, None
        kv = DenseSequenceKV(cfg, spec_slack=slack)
    d = Driver(kv, spec)
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # pair layer -> all rows ever (kv, positions)
    rng = random.Random(0)
    for _ in range(30):
        k = rng.randint(1, 1 + slack)
        d.extend(k, g, grow)
        for layer in spec.pair_layers:
            rows, pos = kv.pending(layer)[0], kv.pending(layer)[2]
            old = history.get(layer, (torch.empty(0, cfg.head_dim), torch.empty(0, dtype=torch.int64)))
            history[layer] = (torch.cat([old[0], rows[-k:]]), torch.cat([old[1], pos[-k:]]))
        back = rng.randint(0, min(slack, k))
        d.rollback(back, shrink)
        history = {layer: (h[0][: d.n], h[1][: d.n]) for layer, h in history.items()}
        for layer in spec.pair_layers:
            r = cfg.ratio(layer)
            open_start = d.n // r * r
            rows, _, pos = kv.pending(layer)
            keep = pos >= open_start
            assert torch.equal(pos[keep], torch.arange(open_start, d.n))
            assert torch.equal(rows[keep], history[layer][0][open_start : d.n])
        for layer in spec.window_layers:
            _, pos = kv.window(layer)
            assert len(pos) >= min(d.n, cfg.window_size)
            assert torch.equal(pos, torch.arange(d.n - len(pos), d.n))


def test_cross_block_scatter_and_gather():
    spec, _, cache = paged()
    table = [5, 2, 7]
    layer = 3  # ratio 1: 4 entries per block
    entries = torch.arange(7 * 64, dtype=torch.float32).view(7, 64)
    kv = cache.view("s", table, 0)
    kv.write_compressed(layer, 1, entries)
    pool = cache.pools["ckv.3"]
    assert torch.equal(pool[5, 1:4], entries[0:3])
    assert torch.equal(pool[2, 0:4], entries[3:7])
    assert torch.equal(kv.read_compressed(layer, 8)[1:], entries)
    # ratio-2 source: 2 entries per block
    keys = torch.randn(5, 32)
    kv.write_index_keys(1, 0, keys)
    assert torch.equal(cache.pools["idx.1"][2, 1], keys[3])
    with pytest.raises(IndexError, match="outside"):
        kv.read_compressed(1, 7)  # 3 blocks hold 6 ratio-2 entries
    with pytest.raises(IndexError):
        kv.write_compressed(3, 10, entries[:3])


def test_export_import_between_caches():
    """What the transfer layer does: P exports contiguous entries, D imports them under other blocks."""
    spec, _, p_cache = paged()
    _, _, d_cache = paged()
    p_table, d_table = [3, 0, 9], [1, 4, 2]
    p = p_cache.view("s", p_table, 0)
    g = torch.Generator().manual_seed(1)
    for layer in spec.kv_source_layers:
        n = 11 // spec.cfg.ratio(layer)
        p.write_compressed(layer, 0, torch.randn(n, spec.cfg.head_dim, generator=g))
        p.write_index_keys(layer, 0, torch.randn(n, spec.cfg.index_head_dim, generator=g))
        d_cache.import_compressed(d_table, layer, p_cache.export_compressed(p_table, layer, n))
        d_cache.import_index_keys(d_table, layer, p_cache.export_index_keys(p_table, layer, n))
    d = d_cache.view("s", d_table, 1)
    for layer in spec.kv_source_layers:
        n = 11 // spec.cfg.ratio(layer)
        assert torch.equal(d.read_compressed(layer, n), p.read_compressed(layer, n))
        assert torch.equal(d.read_index_keys(layer, n), p.read_index_keys(layer, n))


def test_view_sees_growth_and_slot_reuse_is_clean():
    spec, mgr, cache = paged(max_seqs=1)
    a = mgr.allocate("a", 2)
    kv = cache.view("a", a.block_table, a.slot)
    kv.append_window(0, torch.arange(2), torch.ones(2, 64))
    kv.append_pending(1, torch.arange(2), torch.ones(2, 64), torch.ones(2, 64))
    mgr.grow("a", 9)  # the view reads the live table
    kv.write_compressed(3, 0, torch.ones(9, 64))
    assert kv.read_compressed(3, 9).sum() == 9 * 64
    assert len(cache.view("a", a.block_table, a.slot).window(0)[1]) == 2  # same owner: kept
    mgr.free("a")
    b = mgr.allocate("b", 1)
    kv_b = cache.view("b", b.block_table, b.slot)
    assert b.slot == a.slot and len(kv_b.window(0)[1]) == 0 and len(kv_b.pending(1)[2]) == 0
    assert (cache.window_pos[b.slot] == -1).all()


def test_dense_rejects_gaps():
    kv = DenseSequenceKV(tiny())
    kv.write_compressed(3, 0, torch.zeros(2, 64))
    with pytest.raises(IndexError, match="gap"):
        kv.write_compressed(3, 3, torch.zeros(1, 64))
    with pytest.raises(IndexError):
        kv.read_compressed(3, 3)


@pytest.mark.parametrize("impl", ["paged", "dense"])
def test_reads_are_snapshots(impl):
    cfg = tiny()
    if impl == "paged":
        _, _, cache = paged()
        kv = cache.view("s", [0], 0)
    else:
        kv = DenseSequenceKV(cfg, spec_slack=SLACK)
    cap = cfg.window_size + SLACK
    kv.append_window(0, torch.arange(cap), torch.randn(cap, 64))
    kv.append_pending(1, torch.arange(3), torch.randn(3, 64), torch.randn(3, 64))
    w, wp = kv.window(0)
    p = kv.pending(1)
    w0, p0 = w.clone(), [t.clone() for t in p]
    kv.append_window(0, torch.arange(cap, cap + 3), torch.randn(3, 64))  # shifts the slot's rows
    kv.append_pending(1, torch.arange(3, 5), torch.randn(2, 64), torch.randn(2, 64))
    kv.truncate(cap)
    assert torch.equal(w, w0) and torch.equal(wp, torch.arange(cap))
    assert all(torch.equal(a, b) for a, b in zip(p, p0, strict=True))


@pytest.mark.parametrize("impl", ["paged", "dense"])
def test_append_replaces_rows_from_its_first_position(impl):
    kv = paged()[2].view("s", [0], 0) if impl == "paged" else DenseSequenceKV(tiny(), spec_slack=SLACK)
    kv.append_window(2, torch.arange(5), torch.zeros(5, 64))
    kv.append_window(2, torch.arange(3, 5), torch.ones(2, 64))  # positions 3, 4 recomputed
    kv.append_window(2, torch.empty(0, dtype=torch.int64), torch.ones(0, 64))
    rows, pos = kv.window(2)
    assert torch.equal(pos, torch.arange(5)) and rows[:3].sum() == 0 and rows[3:].sum() == 2 * 64
    kv.append_pending(1, torch.arange(4), torch.zeros(4, 64), torch.zeros(4, 64))
    kv.append_pending(1, torch.arange(3, 5), torch.ones(2, 64), torch.ones(2, 64))
    p_kv, _, p_pos = kv.pending(1)
    assert torch.equal(p_pos, torch.arange(1, 5)) and p_kv[:2].sum() == 0 and p_kv[2:].sum() == 2 * 64


def test_fresh_view_clears_a_reused_seq_id():
    _, _, cache = paged()
    kv = cache.view("a", [0], 0)
    kv.append_window(0, torch.arange(2), torch.ones(2, 64))
    assert len(cache.view("a", [0], 0).window(0)[1]) == 2
    assert len(cache.view("a", [0], 0, fresh=True).window(0)[1]) == 0


def test_batch_layout_of_ragged_segments():
    """PagedBatch's host layout (built with whole-array numpy): every field per segment, block tables
    of different lengths (one empty) left-aligned and zero-padded, rows and positions in order."""
    from asympd.kv.batch import BatchSegment, PagedBatch

    cache = paged()[2]
    segs = [
        BatchSegment([7, 3, 9], 2, 30, 3, encoder_floor=4, floor=5),
        BatchSegment([], 0, 0, 1, write_global=False),
        BatchSegment([11], 1, 12, 2, floor=8),
    ]
    b = PagedBatch(cache, segs, width=4)
    assert b.width == 4 and b.num_rows == 6
    assert b.h_start.tolist() == [30, 0, 12] and b.h_rows.tolist() == [3, 1, 2] and b.h_slot.tolist() == [2, 0, 1]
    assert b.h_wg.tolist() == [True, False, True] and b.h_lo.tolist() == [0, 3, 4, 6]
    assert b.block_table.tolist() == [[7, 3, 9, 0], [0, 0, 0, 0], [11, 0, 0, 0]]
    assert b.floors.tolist() == [[4, 0, 0], [5, 0, 8]]
    assert b.write_global.tolist() == [True, False, True]
    assert b.row_seg.tolist() == [0, 0, 0, 1, 2, 2] and b.positions.tolist() == [30, 31, 32, 0, 12, 13]
    assert PagedBatch(cache, segs).width == 3  # the longest table by default
    with pytest.raises(ValueError, match="does not fit"):
        PagedBatch(cache, segs, width=2)
