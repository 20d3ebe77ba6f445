"""KV cache: the groups the model needs (spec), block bookkeeping (block_manager), the tensors and the
per-request view (paged_cache), and a dense stand-in for model tests (dense).

Spec and bookkeeping are torch-free and import with the package; the tensor classes import torch,
so they load on first use (the planner runs the engine's ``BlockManager`` without torch)."""

import importlib

from asympd.kv.block_manager import (
    Allocation,
    BlockManager,
    BlockPool,
    CacheFullError,
    KVCacheError,
    RequestTooLargeError,
    hash_block_chain,
)
from asympd.kv.spec import CacheGroup, GroupKind, KVCacheSpec

_TENSOR_CLASSES = {
    "DenseSequenceKV": "asympd.kv.dense",
    "PagedKVCache": "asympd.kv.paged_cache",
    "PagedSequenceKV": "asympd.kv.paged_cache",
    "SequenceKV": "asympd.kv.paged_cache",
}

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


def __getattr__(name: str):
    if name in _TENSOR_CLASSES:
        return getattr(importlib.import_module(_TENSOR_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
