"""A prefix state streamed in slices, so that its transfer overlaps P's chunked prefill.

P exports, after each prefill chunk, the slice of the global KV that chunk finished: a
``PrefixState`` with ``start`` = where the previous slice ended and ``split`` = where this one ends
(entries ``[start // r, split // r)`` of every KV source, plus the open compressor pair at ``split``).
The slice that ends at the request's split is the last one; only its open pair matters to D. The
first slice (``start`` 0) carries the prompt's token ids, later ones none.

D keeps a ``PrefixStream`` per request: it checks each slice as it arrives (in order, same prompt,
same model) and the engine writes it into the request's blocks at once (engine.LLMEngine.import_slice).
On a transport, P pushes slices into a ``SliceFeed`` and D pulls them one by one as they are pushed
(tcp.TcpTransport.open_stream / push / fetch_stream).
"""

from __future__ import annotations

import threading

import torch

from ..config import ModelConfig
from .prefix_state import PrefixState, PrefixStateError

_SAME = ("fingerprint", "dtype", "mode", "boundary_policy", "num_prompt_tokens")


class PrefixStream:
    """D's side of one streamed prefix: the slices received so far, checked, in order."""

    def __init__(self, cfg: ModelConfig, fingerprint: str, split: int, token_ids: list[int]) -> None:
        self.cfg, self.fingerprint = cfg, fingerprint
        self.split = split  # where the last slice must end
        self.token_ids = list(token_ids)
        self.slices: list[PrefixState] = []

    @property
    def upto(self) -> int:
        """Prefix positions received so far."""
        return self.slices[-1].split if self.slices else 0

    @property
    def complete(self) -> bool:
        return self.upto == self.split and bool(self.slices)

    def add(self, piece: PrefixState) -> None:
        """Take the next slice; a slice out of order, past the split or of another prompt or model
        is a PrefixStateError and changes nothing."""
        piece.validate(self.cfg, self.fingerprint)
        if self.complete:
            raise PrefixStateError(f"the prefix [0, {self.split}) is already complete; got another slice")
        if piece.start != self.upto:
            raise PrefixStateError(
                f"slice [{piece.start}, {piece.split}) does not continue the prefix received so far [0, {self.upto})"
            )
        if piece.split > self.split or (piece.split == piece.start and piece.split != self.split):
            raise PrefixStateError(f"slice [{piece.start}, {piece.split}) is empty or ends past split {self.split}")
        if piece.num_prompt_tokens != len(self.token_ids):
            raise PrefixStateError(
                f"slice is of a {piece.num_prompt_tokens}-token prompt, this request has {len(self.token_ids)}"
            )
        if piece.start == 0 and piece.token_ids.tolist() != self.token_ids:
            raise PrefixStateError("the prefix state was made for a different prompt than this request's")
        if self.slices:
            first = self.slices[0]
            for key in _SAME:
                if getattr(piece, key) != getattr(first, key):
                    raise PrefixStateError(f"slice {key} {getattr(piece, key)!r} differs from the first slice's")
        if piece.swa_kv:
            raise PrefixStateError("a streamed prefix carries no windows")
        if piece.image_spans is not None and piece.split != self.split:
            raise PrefixStateError("image rows travel in the slice that ends at the split")
        self.slices.append(piece)

    def state(self) -> PrefixState:
        """The whole prefix state the slices make (for a complete stream)."""
        if not self.complete:
            raise PrefixStateError(f"the prefix is incomplete: [0, {self.upto}) of [0, {self.split})")
        return concat(self.slices)


def concat(slices: list[PrefixState]) -> PrefixState:
    """Consecutive slices -> one state from the first's start to the last's split (the last's open
    pair and image rows, the first's token ids)."""
    first, last = slices[0], slices[-1]
    return PrefixState(
        split=last.split,
        token_ids=first.token_ids,
        ckv={layer: torch.cat([s.ckv[layer] for s in slices]) for layer in first.ckv},
        idx={layer: torch.cat([s.idx[layer] for s in slices]) for layer in first.idx},
        pair_kv=dict(last.pair_kv),
        pair_score=dict(last.pair_score),
        fingerprint=first.fingerprint,
        dtype=first.dtype,
        boundary_policy=first.boundary_policy,
        mode=first.mode,
        num_prompt_tokens=first.num_prompt_tokens,
        kv_format=first.kv_format,
        start=first.start,
        image_spans=last.image_spans,
        image_pos=last.image_pos,
        image_rows=last.image_rows,
    )


class SliceFeed:
    """P's side of a streamed prefix on a transport: the slices pushed so far, in order; a reader
    waits for the next one. Thread-safe (P's engine pushes, the server's threads read)."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.slices: list[PrefixState] = []
        self.tags: list[str | None] = []  # each slice's authentication tag (transfer.seal), if sealed
        self.done = False  # the last slice is in
        self.dropped = False  # P dropped the stream (its request ended): no slice will come
        self._cv = threading.Condition()

    def push(self, piece: PrefixState, last: bool = False, tag: str | None = None) -> None:
        with self._cv:
            if self.done:
                raise PrefixStateError("the stream already ended with its last slice")
            if piece.fingerprint != self.fingerprint:
                raise PrefixStateError(f"slice fingerprint {piece.fingerprint!r} is not {self.fingerprint!r}")
            upto = self.slices[-1].split if self.slices else 0
            if piece.start != upto:
                raise PrefixStateError(f"slice [{piece.start}, {piece.split}) does not continue [0, {upto})")
            self.slices.append(piece)
            self.tags.append(tag)
            self.done = last
            self._cv.notify_all()

    def drop(self) -> None:
        """P gave the stream up (its request was aborted or failed): wake the readers now, rather
        than have each wait out its timeout for a slice that will never be pushed."""
        with self._cv:
            self.dropped = True
            self._cv.notify_all()

    def wait(self, index: int, timeout: float) -> tuple[PrefixState, bool, str | None] | None:
        """Slice ``index``, whether it is the last, and its tag; or None if it is not pushed within
        ``timeout`` (or never will be: the stream ended before it, or was dropped)."""
        with self._cv:
            self._cv.wait_for(lambda: len(self.slices) > index or self.done or self.dropped, timeout)
            if len(self.slices) <= index or self.dropped:
                return None
            return self.slices[index], self.done and index == len(self.slices) - 1, self.tags[index]

    @property
    def nbytes(self) -> int:
        with self._cv:
            return sum(s.nbytes for s in self.slices)
