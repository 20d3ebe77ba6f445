import copy
import subprocess
import sys

import pytest

from asympd.config import tiny
from asympd.kv import BlockManager, CacheFullError, KVCacheSpec, RequestTooLargeError, hash_block_chain

BS = 4


def make(num_blocks: int = 8, max_seqs: int = 4, caching: bool = True) -> BlockManager:
    spec = KVCacheSpec.from_config(tiny(), block_size=BS, spec_slack=2)
    return BlockManager(spec, num_blocks=num_blocks, max_seqs=max_seqs, enable_prefix_caching=caching)


def state(m: BlockManager) -> dict:
    return copy.deepcopy({"pool": vars(m.pool), "slots": m._free_slots, "seqs": m._seqs})


# ---- hashing ---------------------------------------------------------------------------------------


def test_hash_chain_full_blocks_only_and_chained():
    toks = list(range(10))
    h = hash_block_chain(toks, BS)
    assert len(h) == 2  # 10 tokens -> 2 full blocks
    assert h == hash_block_chain(toks[:8], BS)
    assert hash_block_chain([99] + toks[1:], BS)[1] != h[1]  # block 1's hash depends on block 0
    assert hash_block_chain(toks, BS, extra_key="lora-a") != h
    assert hash_block_chain(toks, BS, extra_key=None) == h
    assert hash_block_chain(toks[4:], BS, parent=h[0]) == h[1:]  # chains continue


def test_hash_is_stable_across_processes():
    code = "from asympd.kv import hash_block_chain; print(hash_block_chain(list(range(8)), 4, ('x', 1)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(hash_block_chain(list(range(8)), 4, ("x", 1)))


# ---- allocation ------------------------------------------------------------------------------------


def test_allocate_counts_blocks_and_slots():
    m = make()
    a = m.allocate("a", 9)
    assert a.block_table == [0, 1, 2] and a.slot == 0 and a.num_cached_tokens == 0
    b = m.allocate("b", 4)
    assert b.block_table == [3] and b.slot == 1
    c = m.allocate("c", 0)  # slot only
    assert c.block_table == [] and c.slot == 2
    assert m.num_used_blocks == 4 and m.num_free_blocks == 4 and m.num_free_slots == 1
    assert all(m.pool.refcount(x) == 1 for x in range(4))
    with pytest.raises(ValueError, match="already allocated"):
        m.allocate("a", 1)
    for s in "abc":
        m.free(s)
    assert m.num_used_blocks == 0 and m.num_free_slots == 4


def test_prefix_hit_shares_blocks():
    m = make()
    toks = list(range(10))
    a = m.allocate("a", 10, toks, cacheable_tokens=10)
    assert a.num_cached_tokens == 0
    assert m.commit_cached("a", toks, cacheable_tokens=10) == 2  # two full blocks
    b = m.allocate("b", 10, toks, cacheable_tokens=10)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [m.pool.refcount(x) for x in a.block_table] == [2, 2, 1]
    assert m.num_used_blocks == 4
    # cacheable_tokens bounds the lookup
    c = m.allocate("c", 10, toks, cacheable_tokens=7)
    assert c.num_cached_tokens == 4
    assert m.pool.refcount(a.block_table[0]) == 3


def test_prefix_miss_on_extra_key_and_divergent_tokens():
    m = make()
    toks = list(range(8))
    m.allocate("a", 8, toks, 8, extra_key="x")
    m.commit_cached("a", toks, 8, extra_key="x")
    assert m.allocate("b", 8, toks, 8, extra_key="y").num_cached_tokens == 0
    assert m.allocate("c", 8, toks, 8).num_cached_tokens == 0  # None is another key
    assert m.allocate("d", 8, toks[:4] + [7, 7, 7, 7], 8, extra_key="x").num_cached_tokens == 4


def test_uncommitted_blocks_are_not_hit_and_caching_can_be_disabled():
    m = make()
    toks = list(range(8))
    m.allocate("a", 8, toks, 8)
    assert m.allocate("b", 8, toks, 8).num_cached_tokens == 0  # a never committed
    off = make(caching=False)
    off.allocate("a", 8, toks, 8)
    assert off.commit_cached("a", toks, 8) == 0
    assert off.allocate("b", 8, toks, 8).num_cached_tokens == 0
    assert off.pool.num_cached == 0


def test_commit_is_incremental_and_twins_stay_private():
    m = make()
    toks = list(range(12))
    m.allocate("a", 6, toks, 12)
    assert m.commit_cached("a", toks, 12) == 1  # only 6 tokens allocated: one full block
    m.grow("a", 12)
    assert m.commit_cached("a", toks, 12) == 2
    assert m.commit_cached("a", toks, 12) == 0
    # b computed the same blocks before a committed: its twins stay uncached, a's copies are the hits
    m2 = make()
    m2.allocate("a", 8, toks, 8)
    m2.allocate("b", 8, toks, 8)
    assert m2.commit_cached("a", toks, 8) == 2
    assert m2.commit_cached("b", toks, 8) == 0
    assert m2.allocate("c", 8, toks, 8).block_table == m2.block_table("a")


def test_freed_cached_blocks_stay_reusable():
    m = make()
    toks = list(range(8))
    a = m.allocate("a", 8, toks, 8)
    m.commit_cached("a", toks, 8)
    table = list(a.block_table)
    m.free("a")
    assert m.num_used_blocks == 0 and m.num_free_blocks == 8 and m.pool.num_cached == 2
    b = m.allocate("b", 8, toks, 8)
    assert b.num_cached_tokens == 8 and b.block_table == table
    assert m.num_used_blocks == 2


def test_lru_eviction_order():
    m = make(num_blocks=6)
    ta, tb = [1] * 8, [2] * 8
    for sid, t in (("a", ta), ("b", tb)):
        m.allocate(sid, 8, t, 8)
        m.commit_cached(sid, t, 8)
    a_blocks, b_blocks = list(m.block_table("a")), list(m.block_table("b"))
    m.free("a")
    m.free("b")
    # tails go first, and a was released before b
    assert m.pool.eviction_order() == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    m.allocate("x", 8)  # two never-cached blocks are handed out before anything is evicted
    assert m.pool.num_cached == 4
    m.allocate("y", 4)  # evicts a's tail
    assert m.block_table("y") == [a_blocks[1]]
    assert m.pool.eviction_order() == [a_blocks[0], b_blocks[1], b_blocks[0]]
    assert m.allocate("z", 8, ta, 8).num_cached_tokens == 4  # a's head survived
    # the hit revived a's head (it left the queue); the one new block evicted b's tail
    assert m.block_table("z") == [a_blocks[0], b_blocks[1]]
    assert m.pool.eviction_order() == [b_blocks[0]]


def test_revived_hits_count_against_free_blocks():
    m = make(num_blocks=3)
    toks = [5] * 8
    m.allocate("a", 8, toks, 8)
    m.commit_cached("a", toks, 8)
    m.free("a")
    # 12 tokens = 3 blocks: 2 cached hits (free now, revived) + 1 new
    assert m.can_allocate(12, toks + [1] * 4, 12)
    assert m.allocate("b", 12, toks + [1] * 4, 12).num_cached_tokens == 8
    assert m.num_free_blocks == 0


def test_cache_full_leaves_state_unchanged():
    m = make(num_blocks=4, max_seqs=2)
    toks = list(range(8))
    m.allocate("a", 8, toks, 8)
    m.commit_cached("a", toks, 8)
    before = state(m)
    assert not m.can_allocate(12)  # 3 new blocks, 2 free
    with pytest.raises(CacheFullError):
        m.allocate("b", 12)
    assert state(m) == before
    assert m.can_allocate(12, toks + [0] * 4, 12)  # 2 hits + 1 new block fits
    m.allocate("b", 12, toks + [0] * 4, 12)
    m.free("b")
    before = state(m)
    with pytest.raises(CacheFullError):
        m.allocate("c", 16, [9] * 16, 16)
    assert state(m) == before
    m.allocate("c", 4)
    before = state(m)
    with pytest.raises(CacheFullError):
        m.grow("c", 16)
    assert state(m) == before
    with pytest.raises(CacheFullError, match="slots"):
        m.allocate("d", 0)
    assert state(m) == before
    assert not m.can_allocate(0)


def test_request_too_large_is_distinct():
    m = make(num_blocks=4)
    with pytest.raises(RequestTooLargeError, match=r"needs 5 KV blocks \(17 tokens.*whole pool has 4.*never"):
        m.allocate("big", 17)
    assert not issubclass(RequestTooLargeError, CacheFullError)
    m.allocate("a", 4)
    before = state(m)
    with pytest.raises(RequestTooLargeError, match="'a'"):
        m.grow("a", 17)
    assert state(m) == before
    assert not m.can_allocate(17)


def test_grow_and_truncate():
    m = make()
    a = m.allocate("a", 3)
    assert m.grow("a", 4) == [] and a.block_table == [0]
    assert m.grow("a", 9) == [1, 2] and a.block_table == [0, 1, 2]  # live table
    with pytest.raises(ValueError):
        m.grow("a", 8)
    m.truncate("a", 5)
    assert a.block_table == [0, 1] and m.num_tokens("a") == 5 and m.pool.refcount(2) == 0
    m.truncate("a", 4)
    assert a.block_table == [0]
    with pytest.raises(ValueError):
        m.truncate("a", 5)
    m.truncate("a", 0)
    assert a.block_table == [] and m.num_used_blocks == 0
    m.free("a")
    assert m.num_free_slots == 4


def test_truncate_into_cached_blocks():
    m = make()
    toks = list(range(12))
    a = m.allocate("a", 12, toks, 12)
    m.commit_cached("a", toks, 12)
    # a private cached block cut to a partial one is un-cached (a will overwrite it)
    m.truncate("a", 10)
    assert m.pool.block_hash(a.block_table[2]) is None and m.pool.num_cached == 2
    m.grow("a", 12)
    assert m.commit_cached("a", toks, 12) == 1  # recommitting registers it again
    # cut at a boundary: the released full block stays cached
    m.truncate("a", 8)
    assert m.pool.num_cached == 3
    # a shared cached block must not become writable
    m.allocate("b", 8, toks, 8)
    before = state(m)
    with pytest.raises(ValueError, match="shared cached block"):
        m.truncate("a", 6)
    assert state(m) == before


def test_usage_bytes():
    m = make(num_blocks=8, max_seqs=4)
    spec = m.spec
    assert all(v == 0 for v in m.usage().values())
    m.allocate("a", 9)
    m.allocate("b", 1)
    u = m.usage()
    assert set(u) == {g.name for g in spec.groups}
    assert u["ckv.1"] == 4 * 2 * 64 * 4  # 4 blocks x 2 entries x head_dim 64 x fp32
    assert u["idx.3"] == 4 * 4 * 32 * 4
    assert u["swa.0"] == 2 * (16 + 2) * (64 * 4 + 8)
    assert u["pair.1"] == 2 * (2 + 2) * (2 * 64 * 4 + 8)
    assert sum(v for k, v in u.items() if k[:3] in ("ckv", "idx")) == 4 * spec.bytes_per_block
    m.free("a")
    m.free("b")
    assert sum(m.usage().values()) == 0 and m.num_used_blocks == 0
