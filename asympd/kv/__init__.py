"""KV cache: the groups the model needs (spec), block bookkeeping (block_manager), the tensors and the
per-request view (paged_cache), and a dense stand-in for model tests (dense)."""

from asympd.kv.block_manager import (
    Allocation,
    BlockManager,
    BlockPool,
    CacheFullError,
    KVCacheError,
    RequestTooLargeError,
    hash_block_chain,
)
from asympd.kv.dense import DenseSequenceKV
from asympd.kv.paged_cache import PagedKVCache, PagedSequenceKV, SequenceKV
from asympd.kv.spec import CacheGroup, GroupKind, KVCacheSpec

__all__ = [
    "Allocation",
    "BlockManager",
    "BlockPool",
    "CacheFullError",
    "CacheGroup",
    "DenseSequenceKV",
    "GroupKind",
    "KVCacheError",
    "KVCacheSpec",
    "PagedKVCache",
    "PagedSequenceKV",
    "RequestTooLargeError",
    "SequenceKV",
    "hash_block_chain",
]
