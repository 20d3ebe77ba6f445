"""Random storms of allocate/grow/commit/truncate/free against a simulated device.

The simulation writes, for every token a request computes, what its KV depends on (extra_key and the
whole token prefix) into the block the manager assigned. It checks that a prefix hit only ever returns
blocks holding exactly this request's prefix, that nobody writes into a block another request shares or
that the cache can hand out, that failed calls change nothing, and that freeing everything leaves no
block or slot in use.
"""

import copy
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from asympd.config import tiny
from asympd.kv import BlockManager, CacheFullError, KVCacheSpec, RequestTooLargeError

BS = 4
NUM_BLOCKS = 12
MAX_SEQS = 4
BASES = [
    list(range(1, 40)),
    list(range(1, 7)) + [50] * 33,  # shares 1 full block with base 0
    [60, 61] * 20,
]

seq_ids = st.integers(0, 4)
ops = st.one_of(
    st.tuples(
        st.just("alloc"),
        seq_ids,
        st.integers(0, 3),
        st.integers(0, 24),
        st.integers(0, 8),
        st.sampled_from([None, "x"]),
    ),
    st.tuples(st.just("alloc+commit"), seq_ids, st.integers(0, 3), st.integers(0, 24), st.integers(0, 8), st.none()),
    st.tuples(st.just("grow"), seq_ids, st.integers(0, 9)),
    st.tuples(st.just("commit"), seq_ids),
    st.tuples(st.just("truncate"), seq_ids, st.integers(0, 6)),
    st.tuples(st.just("rollback"), seq_ids, st.integers(1, 3), st.integers(1, 4)),  # speculative step
    st.tuples(st.just("free"), seq_ids),
)


class Sim:
    def __init__(self) -> None:
        spec = KVCacheSpec.from_config(tiny(), block_size=BS, spec_slack=2)
        self.m = BlockManager(spec, NUM_BLOCKS, MAX_SEQS)
        self.tokens: dict[int, list[int]] = {}
        self.key: dict[int, object] = {}
        self.device: dict[tuple[int, int], tuple] = {}  # (block, offset) -> (extra_key, prefix)

    def write(self, sid: int, start: int, end: int) -> None:
        table, toks = self.m.block_table(sid), self.tokens[sid]
        for p in range(start, end):
            block = table[p // BS]
            assert self.m.pool.refcount(block) == 1, "write into a shared block"
            assert self.m.pool.block_hash(block) is None, "write into a cached block"
            self.device[block, p % BS] = (self.key[sid], tuple(toks[: p + 1]))

    def snapshot(self) -> dict:
        return copy.deepcopy({"pool": vars(self.m.pool), "slots": self.m._free_slots, "seqs": self.m._seqs})

    def step(self, op: tuple) -> None:
        kind, sid = op[0], op[1]
        if kind == "alloc+commit":
            self.step(("alloc", *op[1:]))
            kind = "commit"
        if kind == "rollback":
            self.step(("truncate", sid, op[2]))
            kind, op = "grow", ("grow", sid, op[3])
        if kind != "alloc" and sid not in self.m:
            return
        before = self.snapshot()
        try:
            if kind == "alloc":
                if sid in self.m:
                    return
                _, _, base, length, uncached, key = op
                toks = BASES[base % len(BASES)][:length] if base < 3 else [9] * length
                a = self.m.allocate(sid, length, toks, max(0, length - uncached), key)
                self.tokens[sid], self.key[sid] = toks, key
                for i in range(a.num_cached_tokens // BS):  # hits hold exactly our prefix
                    for o in range(BS):
                        p = i * BS + o
                        assert self.device[a.block_table[i], o] == (key, tuple(toks[: p + 1]))
                self.write(sid, a.num_cached_tokens, length)
            elif kind == "grow":
                old = self.m.num_tokens(sid)
                new_toks = self.tokens[sid][:old] + [70 + op[2] % 3] * op[2]
                self.m.grow(sid, old + op[2])
                self.tokens[sid] = new_toks
                self.write(sid, old, old + op[2])
            elif kind == "commit":
                self.m.commit_cached(sid, self.tokens[sid], len(self.tokens[sid]), self.key[sid])
            elif kind == "truncate":
                n = max(0, self.m.num_tokens(sid) - op[2])
                self.m.truncate(sid, n)
                del self.tokens[sid][n:]
            elif kind == "free":
                self.m.free(sid)
                del self.tokens[sid]
        except (CacheFullError, RequestTooLargeError, ValueError) as e:
            if isinstance(e, ValueError):
                assert "shared cached block" in str(e)
            assert self.snapshot() == before, f"{type(e).__name__} changed the state"
        self.check()

    def check(self) -> None:
        m, pool = self.m, self.m.pool
        refs = [0] * NUM_BLOCKS
        for sid, toks in self.tokens.items():
            table = m.block_table(sid)
            assert m.num_tokens(sid) == len(toks)
            assert len(table) == math.ceil(len(toks) / BS)
            for b in table:
                refs[b] += 1
        assert refs == [pool.refcount(b) for b in range(NUM_BLOCKS)]
        assert m.num_used_blocks == sum(r > 0 for r in refs)
        assert m.num_used_blocks + m.num_free_blocks == NUM_BLOCKS
        for h, b in pool._cached.items():
            assert pool.block_hash(b) == h
        slots = [m.slot(s) for s in self.tokens]
        assert len(set(slots)) == len(slots) and m.num_free_slots == MAX_SEQS - len(slots)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, min_size=5, max_size=60))
def test_random_storms_end_clean(storm):
    sim = Sim()
    for op in storm:
        sim.step(op)
    for sid in list(sim.tokens):
        sim.m.free(sid)
        del sim.tokens[sid]
        sim.check()
    assert sim.m.num_used_blocks == 0
    assert sim.m.num_free_slots == MAX_SEQS
    assert sum(sim.m.usage().values()) == 0
