"""One scheduler, many ranks: rank 0 runs the whole ``LLMEngine``; the other ranks replay its
forwards and cache writes so that every rank's KV cache stays identical.

Rank 0 installs two proxies into an already-built engine (no engine code changes):

- ``engine.runner.model`` becomes a :class:`_ModelProxy`. Each forward first broadcasts its plan
  (per chunk: request id, block table, slot, token ids, start, history, depth, floors,
  ``write_global``), then runs rank 0's own forward. The workers run the same forward on their own
  caches; the MoE layers meet in their ``all_reduce``.
- ``engine.cache`` / ``engine.runner.cache`` become a :class:`_CacheProxy` that forwards every read
  to the real ``PagedKVCache`` and records every write made outside a forward: ``reset_slot``,
  ``import_compressed`` / ``import_index_keys`` (prefix import), ``fork_slot`` (n choices), slot
  claims by ``view``, and writes through the views it hands out (``append_pending`` of an imported
  open pair, ``truncate`` after a speculative rollback, the DSpark drafter's window appends).

Recorded writes are queued and go out, in order, with the next forward's plan: one control message
per step. Their tensors travel separately, packed into one byte buffer broadcast on the data-plane
group (NCCL on GPUs: device to device), not pickled. Block tables are host state of rank 0's
``BlockManager``; only the tables a message needs travel with it.

What stays on rank 0 only: the scheduler, the block manager, sampling, prefix-state export (reads),
and the DSpark drafter (its writes are mirrored, its forward is not).

Failure: if anything raises between the plan going out and the forward returning, the ranks may
have stopped at different collectives; the executor is then ``broken``: further forwards raise and
``close`` kills the workers instead of sending them ``stop``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from asympd.kv.paged_cache import PagedKVCache, PagedSequenceKV
from asympd.model.transformer import Chunk, Transformer
from asympd.parallel.ep import shard_moe
from asympd.parallel.launch import RankGroup

CACHE_WRITES = frozenset(
    {"reset_slot", "import_compressed", "import_index_keys", "write_entries", "truncate", "fork_slot"}
)
VIEW_WRITES = frozenset({"append_window", "append_pending", "write_compressed", "write_index_keys", "truncate"})


class ExecutorBroken(RuntimeError):
    """The ranks may be out of step (a forward failed half-way): the worker must be restarted."""


@dataclasses.dataclass(frozen=True)
class _TensorRef:
    """A tensor argument of a message: its bytes are at ``offset`` of the step's tensor buffer."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


ALIGN = 64  # tensor offsets in the step buffer: a byte slice can be viewed as any dtype


def _table(block_table: Sequence[int] | torch.Tensor) -> list[int]:
    return [int(b) for b in block_table]


def _map_call(op: tuple, fn: Any) -> tuple:
    """``op`` with ``fn`` applied to its call arguments (the last two fields of cache/view ops)."""
    if op[0] not in ("cache", "view"):
        return op
    *head, args, kwargs = op
    return (*head, tuple(fn(a) for a in args), {k: fn(v) for k, v in kwargs.items()})


class _Outbox:
    """Rank 0's side of the message stream: writes queue here, a forward or ``stop`` sends them."""

    def __init__(self, control: Any, device: torch.device):
        self.control, self.device = control, device
        self.ops: list[tuple] = []
        self.tensors: list[tuple[_TensorRef, torch.Tensor]] = []
        self.nbytes = 0

    def _ref(self, a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        t = a.detach().clone()  # snapshot: the caller may reuse its buffer before the next send
        ref = _TensorRef(self.nbytes, t.numel() * t.element_size(), tuple(t.shape), t.dtype)
        self.tensors.append((ref, t))
        self.nbytes += -(-ref.nbytes // ALIGN) * ALIGN
        return ref

    def record(self, op: tuple) -> None:
        """Queue one write; its tensors are replaced by references into the step buffer."""
        self.ops.append(_map_call(op, self._ref))

    def send(self, last: tuple) -> None:
        """Broadcast the queued ops plus ``last`` (a forward or stop), then the tensor bytes."""
        msg = (self.ops + [last], self.nbytes)
        tensors, nbytes = self.tensors, self.nbytes
        self.ops, self.tensors, self.nbytes = [], [], 0
        dist.broadcast_object_list([msg], src=0, group=self.control)
        if tensors:
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            for ref, t in tensors:
                flat[ref.offset : ref.offset + ref.nbytes] = t.to(self.device).reshape(-1).view(torch.uint8)
            dist.broadcast(flat, src=0)


class _MirroredView:
    """A view rank 0 hands out: reads go to the real view, writes are also recorded."""

    def __init__(self, inner: PagedSequenceKV, executor: DistributedExecutor):
        self._inner, self._ex = inner, executor

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in VIEW_WRITES:
            return attr

        def write(*args: Any, **kwargs: Any) -> Any:
            with self._ex.lock:
                self._ex.record(("view", _table(self._inner.block_table), self._inner.slot, name, args, kwargs))
                return attr(*args, **kwargs)

        return write


class _CacheProxy:
    """Stands in for the engine's ``PagedKVCache`` on rank 0."""

    def __init__(self, cache: PagedKVCache, executor: DistributedExecutor):
        self._cache, self._ex = cache, executor

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cache, name)
        if name not in CACHE_WRITES:
            return attr

        def write(*args: Any, **kwargs: Any) -> Any:
            with self._ex.lock:
                self._ex.record(("cache", name, args, kwargs))
                return attr(*args, **kwargs)

        return write

    def view(self, seq_id: Any, block_table: Any, slot: int, *, fresh: bool = False) -> _MirroredView:
        """A view may reassign (and clear) the slot: the workers do the same claim in order."""
        with self._ex.lock:
            self._ex.record(("claim", seq_id, slot, fresh))
            return _MirroredView(self._cache.view(seq_id, block_table, slot, fresh=fresh), self._ex)


class _ModelProxy:
    """Stands in for ``engine.runner.model`` on rank 0: every forward is broadcast first."""

    def __init__(self, model: Transformer, executor: DistributedExecutor):
        self._model, self._ex = model, executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, chunks: list[Chunk]) -> Any:
        return self._ex.forward(self._model, chunks)


def _plan(c: Chunk) -> dict[str, Any]:
    """A chunk as the workers rebuild it: every field but the view, plus where the view points."""
    kv = c.kv._inner if isinstance(c.kv, _MirroredView) else c.kv
    if not isinstance(kv, PagedSequenceKV):
        raise TypeError(f"a distributed forward needs paged views, got {type(kv).__name__}")
    plan = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "kv"}
    plan = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in plan.items()}
    if c.images is not None:  # image rows cross to the other ranks on the host, like the token ids
        plan["images"] = dataclasses.replace(
            c.images, text=c.images.text.cpu(), rows=c.images.rows.cpu(), embeds=c.images.embeds.cpu()
        )
    plan["kv"] = (_table(kv.block_table), kv.slot)
    return plan


class DistributedExecutor:
    """Rank 0's handle on an expert-parallel engine: attach to an ``LLMEngine``, then use the
    engine as usual; ``close`` stops the other ranks."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.lock = threading.RLock()  # one message at a time (engine thread vs close)
        self.outbox: _Outbox | None = None
        self.engine: Any = None
        self.broken = False
        self.closed = False

    def attach(self, engine: Any) -> Any:
        """Shard rank 0's model, wait for the other ranks, tell them the cache layout, install the
        proxies. Returns the engine."""
        model = engine.model
        shard_moe(model, 0, self.group.world_size)
        if not self.group.joined:
            self.group.join()
        self.outbox = _Outbox(self.group.control, self.group.device)
        cache: PagedKVCache = engine.cache
        hello = ("hello", model.role, cache.spec, cache.num_blocks, cache.max_seqs, cache.scratch_block is not None)
        with self.lock:
            self._send(hello)
        proxy = _CacheProxy(cache, self)
        engine.cache = proxy
        engine.runner.cache = proxy
        engine.runner.model = _ModelProxy(engine.runner.model, self)
        # CUDA graphs replay rank 0's work alone; the ranks' forwards meet in collectives every step
        engine.runner.graphs = None
        if getattr(engine.proposer, "graphs", None) is not None:
            engine.proposer.graphs = None
        self.engine = engine
        return engine

    # ---- rank 0 side of the protocol ----------------------------------------------------------------

    def record(self, op: tuple) -> None:
        """Queue a cache write made outside a forward (under ``lock``)."""
        self._check()
        assert self.outbox is not None
        self.outbox.record(op)

    def forward(self, model: Transformer, chunks: list[Chunk]) -> Any:
        with self.lock:
            self._check()
            plans = [_plan(c) for c in chunks]
            local = [dataclasses.replace(c, kv=c.kv._inner) if isinstance(c.kv, _MirroredView) else c for c in chunks]
            self.broken = True  # until both the broadcast and the forward's collectives are through
            self._send(("forward", plans))
            out = model(local)
            self.broken = False
            return out

    def cache_digests(self) -> list[str]:
        """A digest of every rank's KV cache (rank order), after the queued writes: all equal
        when the mirroring is right. For tests and debugging."""
        with self.lock:
            self._check()
            self._send(("digest",))
            out: list[Any] = [None] * self.group.world_size
            dist.gather_object(cache_digest(self.engine.cache._cache), out, dst=0, group=self.group.control)
            return out

    def _send(self, last: tuple) -> None:
        assert self.outbox is not None
        self.outbox.send(last)

    def _check(self) -> None:
        if self.closed:
            raise ExecutorBroken("the expert-parallel worker is closed")
        if self.broken:
            raise ExecutorBroken("a distributed forward failed half-way: the ranks may be out of step")

    def close(self) -> None:
        """Stop the other ranks (``stop`` if the ranks are in step, a kill otherwise). Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.group.joined and not self.broken and self.outbox is not None:
                try:
                    self.outbox.send(("stop",))
                except Exception:
                    self.broken = True
            if self.broken or not self.group.joined:
                self.group.kill()
            else:
                self.group.close()

    def __enter__(self) -> DistributedExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def cache_digest(cache: PagedKVCache) -> str:
    """sha256 of every KV tensor, the host-side row counts and the slot owners."""
    h = hashlib.sha256()
    tensors = [*cache.pools.values(), cache.window_kv, cache.window_pos]
    tensors += [b for rows in cache.pairs.values() for b in rows.bufs]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for rows in (*cache.windows.values(), *cache.pairs.values()):
        h.update(rows.length.tobytes() + rows.last.tobytes())
    h.update(repr(cache._slot_owner).encode())
    return h.hexdigest()


# ---- worker side ----------------------------------------------------------------------------------------


def _receive(control: Any, device: torch.device) -> list[tuple]:
    """One message: its ops, with every ``_TensorRef`` replaced by the tensor it names."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    ops, nbytes = box[0]
    if not nbytes:
        return ops
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(flat, src=0)

    def resolve(a: Any) -> Any:
        if not isinstance(a, _TensorRef):
            return a
        return flat[a.offset : a.offset + a.nbytes].view(a.dtype).reshape(a.shape)

    return [_map_call(op, resolve) for op in ops]


def serve_rank(model: Transformer, control: Any, device: torch.device) -> None:
    """A worker rank's loop: apply rank 0's messages to this rank's cache until ``stop``."""
    cache: PagedKVCache | None = None
    while True:
        for op in _receive(control, device):
            kind = op[0]
            if kind == "stop":
                return
            if kind == "hello":
                _, role, spec, num_blocks, max_seqs, scratch = op
                if role != model.role or spec.cfg != model.cfg:
                    raise RuntimeError(f"rank 0 runs a {role} model of another config than this rank's {model.role}")
                cache = PagedKVCache(spec, num_blocks, max_seqs, device=device, scratch=scratch)
                continue
            assert cache is not None, "a message before hello"
            if kind == "claim":
                _, seq_id, slot, fresh = op
                cache.view(seq_id, [], slot, fresh=fresh)
            elif kind == "cache":
                _, name, args, kwargs = op
                getattr(cache, name)(*args, **kwargs)
            elif kind == "view":
                _, table, slot, name, args, kwargs = op
                getattr(PagedSequenceKV(cache, table, slot), name)(*args, **kwargs)
            elif kind == "digest":
                dist.gather_object(cache_digest(cache), None, dst=0, group=control)
            elif kind == "forward":
                chunks = []
                for p in op[1]:
                    table, slot = p.pop("kv")
                    chunks.append(Chunk(kv=PagedSequenceKV(cache, table, slot), **{**p, "logits": "none"}))
                model(chunks)
            else:
                raise RuntimeError(f"unknown message {kind!r}")
