"""Block bookkeeping for the paged KV groups: reference counts, prefix caching, request slots.

Pure Python, no tensors (modelled on vLLM v1's ``BlockPool``/``KVCacheManager`` and nano-vllm's
``BlockManager``). One block id covers ``block_size`` tokens in *every* paged group, so a request has a
single block table. Window and pair state is per request and lives in one of ``max_seqs`` slots.

Prefix caching: a full block is identified by a hash chain (parent hash, the block's token ids,
``extra_key``). Once the caller has written a block's KV it calls :meth:`BlockManager.commit_cached`,
which registers the hash; later requests with the same chain share the block (refcount > 1). A cached
block whose refcount falls to 0 stays findable until it is evicted, least recently released first.

Every public mutation checks first and then acts, so an error leaves the state unchanged.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asympd.kv.spec import KVCacheSpec

_ROOT_HASH = int.from_bytes(hashlib.sha256(b"asympd.kv prefix cache v1").digest()[:16], "little")


class KVCacheError(RuntimeError):
    """Base class of the cache's errors."""


class CacheFullError(KVCacheError):
    """Not enough free blocks or request slots *now*: wait for requests to finish, or preempt."""


class RequestTooLargeError(KVCacheError):
    """The request needs more blocks than the whole pool has: it can never run, reject it."""


# ---- hashing --------------------------------------------------------------------------------------


def hash_block_chain(
    token_ids: Sequence[int], block_size: int, extra_key: Any = None, parent: int | None = None
) -> list[int]:
    """Hashes of the full blocks of ``token_ids``; block i's hash covers its parent's hash, its tokens
    and ``extra_key``. ``parent`` continues a chain (the hash of the block before ``token_ids[0]``).

    128 bits of sha256 over little-endian int64 token ids and ``repr(extra_key)``: the same across
    processes and machines (so P and D agree), given an ``extra_key`` with a stable repr (None, str,
    int, tuples of those).
    """
    tokens = np.asarray(token_ids, dtype="<i8")
    key = repr(extra_key).encode()
    h = _ROOT_HASH if parent is None else parent
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        d = hashlib.sha256(h.to_bytes(16, "little"))
        d.update(tokens[i * block_size : (i + 1) * block_size].tobytes())
        d.update(key)
        h = int.from_bytes(d.digest()[:16], "little")
        out.append(h)
    return out


# ---- block pool -----------------------------------------------------------------------------------


class BlockPool:
    """Free blocks, reference counts, and the hash -> block map of cached full blocks.

    Free blocks are of two kinds: never-cached ones (handed out first) and cached ones with refcount 0
    (kept in LRU order, evicted only when no never-cached block is left).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # refcount 0, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, cached; first = LRU
        self._cached: dict[int, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take (never-cached plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash[block]

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def eviction_order(self) -> list[int]:
        """Cached free blocks, the next to be evicted first."""
        return list(self._evictable)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with refcount 1; evicts least recently released cached blocks if needed."""
        if n > self.num_free:
            raise CacheFullError(f"need {n} free blocks, have {self.num_free}")
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._uncache(block)
            self._refcount[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each (cached) block, reviving it if it was free."""
        for block in blocks:
            if self._refcount[block] == 0:
                del self._evictable[block]
            self._refcount[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, in order: the first released is the first evicted."""
        for block in blocks:
            assert self._refcount[block] > 0, f"block {block} released more often than taken"
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def register(self, block: int, block_hash: int) -> bool:
        """Make ``block`` findable under ``block_hash``. False if the hash is already taken (a twin
        block computed concurrently: keep the first, this one stays private) or the block is hashed."""
        if block_hash in self._cached or self._hash[block] is not None:
            return False
        self._hash[block] = block_hash
        self._cached[block_hash] = block
        return True

    def uncache(self, block: int) -> None:
        """Forget ``block``'s hash (its owner is about to overwrite it)."""
        assert self._refcount[block] > 0
        self._uncache(block)

    def _uncache(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None


# ---- manager --------------------------------------------------------------------------------------


@dataclass
class Allocation:
    """What :meth:`BlockManager.allocate` hands out. ``block_table`` is the live table: ``grow`` and
    ``truncate`` update it in place."""

    seq_id: Any
    slot: int
    block_table: list[int]
    num_cached_tokens: int  # leading tokens whose paged KV is already present (whole blocks)


@dataclass
class _Seq:
    slot: int
    num_tokens: int
    blocks: list[int]
    hashes: list[int]  # hash chain of the leading full blocks (computed so far)
    num_committed: int  # leading blocks already handled by prefix caching (hit or registered)


class BlockManager:
    """Per-request block tables and slots over one :class:`BlockPool`. Errors: :class:`CacheFullError`
    (wait or preempt), :class:`RequestTooLargeError` (reject); both leave the state unchanged."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, max_seqs: int, enable_prefix_caching: bool = True) -> None:
        if max_seqs <= 0:
            raise ValueError(f"max_seqs must be positive, got {max_seqs}")
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = BlockPool(num_blocks)
        self.max_seqs = max_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self._free_slots: list[int] = list(range(max_seqs))[::-1]  # pop() hands out the lowest first
        self._seqs: dict[Any, _Seq] = {}

    # ---- queries --------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live request (cached free blocks do not count)."""
        return self.pool.num_used

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def __contains__(self, seq_id: Any) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Any) -> list[int]:
        return self._seqs[seq_id].blocks

    def slot(self, seq_id: Any) -> int:
        return self._seqs[seq_id].slot

    def num_tokens(self, seq_id: Any) -> int:
        return self._seqs[seq_id].num_tokens

    def usage(self) -> dict[str, int]:
        """Bytes in use per group: referenced blocks for paged groups, occupied slots for the others."""
        used_slots = self.max_seqs - len(self._free_slots)
        return {
            g.name: self.num_used_blocks * g.bytes_per_block if g.paged else used_slots * g.bytes_per_slot
            for g in self.spec.groups
        }

    def hash_blocks(self, token_ids: Sequence[int], extra_key: Any = None) -> list[int]:
        return hash_block_chain(token_ids, self.block_size, extra_key)

    def can_allocate(
        self, num_tokens: int, token_ids: Sequence[int] | None = None, cacheable_tokens: int = 0, extra_key: Any = None
    ) -> bool:
        """Would :meth:`allocate` succeed now? Without ``token_ids`` prefix hits are not counted."""
        if not self._free_slots:
            return False
        try:
            self._plan(num_tokens, token_ids, cacheable_tokens, extra_key, seq_id=None)
        except KVCacheError:
            return False
        return True

    # ---- lifecycle ------------------------------------------------------------------------------

    def allocate(
        self,
        seq_id: Any,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        cacheable_tokens: int = 0,
        extra_key: Any = None,
    ) -> Allocation:
        """Blocks for ``num_tokens`` tokens plus a request slot, reusing cached blocks for the leading
        full blocks of ``token_ids[:cacheable_tokens]``. The caller bounds ``cacheable_tokens`` to tokens
        whose KV does not depend on how they were computed (e.g. below a bounded-replay boundary)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        hashes, hits, num_new = self._plan(num_tokens, token_ids, cacheable_tokens, extra_key, seq_id)
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_seqs} request slots are in use")
        self.pool.touch(hits)
        blocks = hits + self.pool.allocate(num_new)
        seq = _Seq(self._free_slots.pop(), num_tokens, blocks, hashes, len(hits))
        self._seqs[seq_id] = seq
        return Allocation(seq_id, seq.slot, seq.blocks, len(hits) * self.block_size)

    def grow(self, seq_id: Any, new_num_tokens: int) -> list[int]:
        """Extend the sequence to ``new_num_tokens``; returns the blocks appended to its table."""
        seq = self._seqs[seq_id]
        if new_num_tokens < seq.num_tokens:
            raise ValueError(f"grow to {new_num_tokens} < current {seq.num_tokens} tokens; use truncate")
        need = self.spec.blocks_for_tokens(new_num_tokens)
        if need <= len(seq.blocks):  # within its blocks (most decode steps)
            seq.num_tokens = new_num_tokens
            return []
        if need > self.num_blocks:
            raise RequestTooLargeError(self._too_large(seq_id, new_num_tokens, need))
        new = self.pool.allocate(need - len(seq.blocks))  # raises CacheFullError before changing anything
        seq.blocks.extend(new)
        seq.num_tokens = new_num_tokens
        return new

    def truncate(self, seq_id: Any, num_tokens: int) -> None:
        """Shrink the sequence to ``num_tokens`` (rejected speculative tokens), releasing blocks past
        the end. Cutting into a block that other requests share would let this one overwrite their KV:
        that is refused. A cached block only this request holds is quietly un-cached."""
        seq = self._seqs[seq_id]
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"truncate to {num_tokens}: sequence {seq_id!r} has {seq.num_tokens} tokens")
        keep = self.spec.blocks_for_tokens(num_tokens)
        partial = keep - 1 if num_tokens % self.block_size else None
        if partial is not None and self.pool.block_hash(seq.blocks[partial]) is not None:
            if self.pool.refcount(seq.blocks[partial]) > 1:
                raise ValueError(
                    f"truncating {seq_id!r} to {num_tokens} tokens would make shared cached block "
                    f"{seq.blocks[partial]} writable"
                )
            self.pool.uncache(seq.blocks[partial])
        dropped = seq.blocks[keep:]
        del seq.blocks[keep:]
        self.pool.release(dropped[::-1])
        full = num_tokens // self.block_size
        del seq.hashes[full:]
        seq.num_committed = min(seq.num_committed, full)
        seq.num_tokens = num_tokens

    def commit_cached(self, seq_id: Any, token_ids: Sequence[int], cacheable_tokens: int, extra_key: Any = None) -> int:
        """Register the newly full blocks within ``token_ids[:cacheable_tokens]`` (their KV is written)
        so later requests can hit them. Returns how many blocks were newly registered."""
        if not self.enable_prefix_caching:
            return 0
        seq = self._seqs[seq_id]
        full = min(cacheable_tokens, len(token_ids), seq.num_tokens) // self.block_size
        if full <= seq.num_committed:
            return 0
        if len(seq.hashes) < full:  # extend the chain from the last known block
            done, bs = len(seq.hashes), self.block_size
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += hash_block_chain(token_ids[done * bs : full * bs], bs, extra_key, parent)
        registered = 0
        for i in range(seq.num_committed, full):
            registered += self.pool.register(seq.blocks[i], seq.hashes[i])
        seq.num_committed = full
        return registered

    def fork(self, parent_id: Any, child_id: Any, num_tokens: int, shared_tokens: int) -> list[tuple[int, int]]:
        """Give ``child_id`` the parent's KV for its first ``shared_tokens`` positions (OpenAI's n
        choices of one prompt): the parent's full blocks there are shared (one more reference each),
        its partial block is copied into a fresh one, and fresh blocks follow up to ``num_tokens``.
        Returns the ``(source, destination)`` block copies the caller makes; checks first."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        parent = self._seqs[parent_id]
        if not 0 < shared_tokens <= min(num_tokens, parent.num_tokens):
            raise ValueError(f"cannot share {shared_tokens} of {parent_id!r}'s {parent.num_tokens} tokens")
        need = self.spec.blocks_for_tokens(num_tokens)
        if need > self.num_blocks:
            raise RequestTooLargeError(self._too_large(child_id, num_tokens, need))
        full = shared_tokens // self.block_size
        if need - full > self.num_free_blocks:
            raise CacheFullError(f"need {need - full} new blocks ({full} shared), have {self.num_free_blocks} free")
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_seqs} request slots are in use")
        shared = parent.blocks[:full]
        self.pool.touch(shared)
        fresh = self.pool.allocate(need - full)
        self._seqs[child_id] = _Seq(self._free_slots.pop(), num_tokens, shared + fresh, [], 0)
        return [(parent.blocks[full], fresh[0])] if shared_tokens % self.block_size else []

    def free(self, seq_id: Any) -> None:
        """Release the request's blocks (tail first, so its prefix is evicted last) and its slot."""
        seq = self._seqs.pop(seq_id)
        self.pool.release(seq.blocks[::-1])
        self._free_slots.append(seq.slot)

    # ---- helpers --------------------------------------------------------------------------------

    def _plan(
        self,
        num_tokens: int,
        token_ids: Sequence[int] | None,
        cacheable_tokens: int,
        extra_key: Any,
        seq_id: Any,
    ) -> tuple[list[int], list[int], int]:
        """(hash chain, cached blocks hit, new blocks needed); raises if the allocation cannot happen."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        need = self.spec.blocks_for_tokens(num_tokens)
        if need > self.num_blocks:
            raise RequestTooLargeError(self._too_large(seq_id, num_tokens, need))
        hashes: list[int] = []
        hits: list[int] = []
        if self.enable_prefix_caching and cacheable_tokens > 0:
            if token_ids is None:
                raise ValueError("cacheable_tokens > 0 needs token_ids")
            n = min(cacheable_tokens, num_tokens, len(token_ids))
            hashes = self.hash_blocks(token_ids[: n - n % self.block_size], extra_key)
            for h in hashes:
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append(block)
        revived = sum(1 for b in hits if self.pool.refcount(b) == 0)  # hits that are free now
        num_new = need - len(hits)
        if num_new > self.num_free_blocks - revived:
            raise CacheFullError(
                f"need {num_new} new blocks ({len(hits)} cached), have {self.num_free_blocks - revived} free"
            )
        return hashes, hits, num_new

    def _too_large(self, seq_id: Any, num_tokens: int, need: int) -> str:
        who = "request" if seq_id is None else f"request {seq_id!r}"
        return (
            f"{who} needs {need} KV blocks ({num_tokens} tokens at block_size {self.block_size}) but the "
            f"whole pool has {self.num_blocks}: it can never be scheduled; reject it or give the KV cache "
            f"more memory"
        )
