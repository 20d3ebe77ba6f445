"""The Engram n-gram hash: which table rows each position of a sequence reads.

Everything here is a pure function of the config, the tokenizer and the token history, so prefill
and decode workers (and any chunking of a prompt) compute identical hash ids without handing any
hash state over: the decode worker only needs the prompt's token ids (docs/model.md §3).

The recipe follows the released reference (``inference/engram.py``):
- every (layer, n-gram size, head) owns a prime-sized bucket range; primes are drawn in order,
  starting above ``engram_vocab_size - 1`` for every n-gram size, never reused (so ranges differ);
  a layer's table holds the concatenation of its ranges;
- token ids are first collapsed through a *compressed* map (tokens that normalise alike share an
  id), then each position is hashed with the ``max_ngram_size - 1`` tokens before it, pad-filled
  before the sequence start;
- the (i+1)-gram hash is the XOR of ``token * multiplier`` over its tokens, reduced modulo the
  bucket prime; multipliers come from ``numpy.random.default_rng(10007 * layer_id)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from asympd.config import ModelConfig

# Deterministic Miller-Rabin: these bases decide every n < 3.3e24 (Sorenson & Webster, 2015).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Exact primality for any n below 3.3e24 (far beyond any table size)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg: ModelConfig) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket moduli, indexed [engram layer][n-gram size - 2][head].

    Each n-gram size restarts its search just above ``engram_vocab_size - 1``, skipping primes
    already handed out, so all ranges of all layers are distinct primes."""
    seen: set[int] = set()
    layers = []
    for _ in cfg.engram_layer_ids:
        per_ngram = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            heads, current = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current += 1
                while current in seen or not is_prime(current):
                    current += 1
                seen.add(current)
                heads.append(current)
            per_ngram.append(tuple(heads))
        layers.append(tuple(per_ngram))
    return tuple(layers)


def engram_num_embeddings(cfg: ModelConfig) -> tuple[int, ...]:
    """Rows of each Engram layer's table: the sum of its bucket ranges."""
    return tuple(sum(sum(per_ngram) for per_ngram in layer) for layer in engram_primes(cfg))


def hash_multipliers(cfg: ModelConfig, compressed_vocab_size: int) -> torch.Tensor:
    """int64 [n_engram_layers, max_ngram_size]: odd multipliers, one per look-back distance.

    Bounded by ``int64_max // compressed_vocab_size`` so ``token * multiplier`` never overflows
    (tokens are compressed ids, below ``compressed_vocab_size``)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in cfg.engram_layer_ids:
        rng = np.random.default_rng(10007 * layer_id)
        values = rng.integers(low=0, high=bound, size=(cfg.engram_max_ngram_size,), dtype=np.int64)
        rows.append(torch.from_numpy(values * 2 + 1))
    return torch.stack(rows)


def compressed_token_map(tokenizer_json_path: str | Path) -> tuple[list[int], int]:
    """Collapse token ids whose decoded text normalises alike (case, accents, surrounding
    whitespace): returns (lookup by token id, number of distinct compressed ids).

    The compressed size feeds every hash multiplier, so it must match the config's
    ``engram_compressed_vocab_size`` exactly."""
    from tokenizers import Regex, Tokenizer, normalizers

    tokenizer = Tokenizer.from_file(str(tokenizer_json_path))
    # A private-use sentinel keeps a token that is exactly one space from stripping to "" and
    # merging with unrelated empty-normalising tokens.
    sentinel = "\ue000"
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    # len(HF fast tokenizer) counts added tokens too
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    lookup = [0] * n_tokens
    for token_id in range(n_tokens):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            # a lone UTF-8 fragment decodes to U+FFFD: keep it distinct by its raw token string
            key = tokenizer.id_to_token(token_id)
        else:
            normalized = normalizer.normalize_str(text)
            key = normalized or text
        lookup[token_id] = keys.setdefault(key, len(keys))
    return lookup, len(keys)


class NgramHasher:
    """Hash ids of the n-grams ending at each position, from the full token history.

    Stateless on purpose: any chunking of a prompt, and a decode worker that only received the
    prompt's token ids, compute the same ids as one single-shot prefill."""

    def __init__(self, cfg: ModelConfig, token_map: list[int] | torch.Tensor):
        self.max_ngram = cfg.engram_max_ngram_size
        self.n_layers = len(cfg.engram_layer_ids)
        self.n_heads = cfg.engram_n_heads
        self.token_map = torch.as_tensor(token_map, dtype=torch.int64)
        compressed_size = int(self.token_map.max()) + 1 if self.token_map.numel() else 0
        # every multiplier derives from this size: a mismatch would silently rehash every table
        if compressed_size != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"token map has {compressed_size} compressed ids, config says engram_compressed_vocab_size"
                f" = {cfg.engram_compressed_vocab_size}"
            )
        self.pad_id = int(self.token_map[cfg.engram_pad_id])
        primes = engram_primes(cfg)
        self.primes = torch.tensor(primes, dtype=torch.int64)  # [layers, ngram-1, heads]
        flat = self.primes.flatten(1)
        # each (n-gram, head) range starts where the previous one ends in the layer's table
        self.offsets = torch.cumsum(flat, dim=1) - flat  # [layers, (ngram-1) * heads]
        self.multipliers = hash_multipliers(cfg, cfg.engram_compressed_vocab_size)  # [layers, ngram]

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def hash_ids(
        self,
        token_ids: torch.Tensor,
        start: int,
        count: int,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int64 [count, n_engram_layers, n_hash_cols]: table rows for positions start..start+count-1.

        ``token_ids`` is the sequence's whole history (at least start+count ids). ``token_mask``
        ([L] bool, optional) marks tokens that take part in n-grams; look-back stops at a masked
        token (an image span) as it stops at the sequence start, filling with the pad id."""
        return self.hash_many([(token_ids, 0, start, count, token_mask)])

    def hash_many(self, items: Sequence[tuple[torch.Tensor, int, int, int, torch.Tensor | None]]) -> torch.Tensor:
        """``hash_ids`` of several sequences at once, rows concatenated in order: one set of tensor
        ops for a whole step, not one per request. Each item is ``(ids, first, start, count, mask)``:
        ``ids`` (and ``mask``, if any) hold the sequence's tokens from position ``first`` on, which
        must include the ``max_ngram - 1`` before ``start`` (or begin at 0)."""
        n = self.max_ngram
        parts, alive_parts, rows = [], [], []
        for ids, first, start, count, mask in items:
            ids = ids.reshape(-1)
            if start < 0 or count < 0 or start + count > first + ids.numel():
                raise ValueError(
                    f"positions [{start}, {start + count}) outside a history of {first + ids.numel()} tokens"
                )
            if first > max(0, start - (n - 1)):
                raise ValueError(f"the history from position {first} lacks the {n - 1} tokens before {start}")
            lo = max(0, start - (n - 1))  # only the look-back and the rows themselves are read
            ids = ids[lo - first : start + count - first]
            parts.append(ids.to(torch.int64))
            alive = mask.reshape(-1)[lo - first : start + count - first].bool() if mask is not None else None
            alive_parts.append(torch.ones(ids.numel(), dtype=torch.bool) if alive is None else alive)
            rows.append((lo, start, count, ids.numel()))
        if not rows:
            return torch.empty(0, self.n_layers, self.n_hash_cols, dtype=torch.int64)
        compressed = self.token_map[torch.cat(parts)]
        alive = torch.cat(alive_parts)
        first, start, count, length = (torch.tensor(c, dtype=torch.int64) for c in zip(*rows, strict=True))
        base = torch.cumsum(length, 0) - length  # each sequence's first id in the flat arrays
        seq = torch.repeat_interleave(torch.arange(len(rows)), count)
        row_in_seq = torch.arange(seq.numel()) - (torch.cumsum(count, 0) - count)[seq]
        positions = start[seq] + row_in_seq
        tokens, blocked = [], torch.zeros(positions.numel(), dtype=torch.bool)
        for shift in range(n):
            # the token `shift` back, clamped into the sequence's history (blocked rows ignore it)
            idx = base[seq] + ((positions - shift).clamp_min(0) - first[seq]).clamp_min(0)
            blocked = blocked | (positions < shift) | ~alive[idx]
            tokens.append(torch.where(blocked, self.pad_id, compressed[idx]))
        toks = torch.stack(tokens, dim=-1)  # [rows, ngram]
        products = toks[:, None, :] * self.multipliers  # [rows, layers, ngram]
        rolling, cols = products[..., 0], []
        for i in range(1, n):
            rolling = rolling ^ products[..., i]
            cols.append(rolling[..., None] % self.primes[:, i - 1])  # [rows, layers, heads]
        return torch.cat(cols, dim=-1) + self.offsets
