"""A small but real byte-level BPE ``tokenizer.json`` for synthetic checkpoints.

Built by hand (no training, no network) so it is byte-for-byte deterministic: special tokens at
fixed low ids, the 256 byte-level symbols, then merges spelling out a fixed word list in several
case/space variants ("hello", " hello", "Hello", " Hello", "HELLO"). The variants normalise alike,
so the Engram compressed token map genuinely collapses ids, as it does on the released tokenizer.
Byte-level pre-tokenisation and decoding make every text round-trip.
"""

from __future__ import annotations

import json
from pathlib import Path

# DeepSeek's special tokens at the same low ids (0 = BOS, 1 = EOS, 2 = pad = engram_pad_id)
SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
)

WORDS = (
    "hello world the of and to in is it that was for on are with as be at by this have from or one had not but "
    "what all were when we there can an your which their said if do will each about how up out them "
    "then she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long little "
    "very after words called just where most know model token prefill decode serve"
).split()


def _byte_alphabet() -> list[str]:
    """The GPT-2 byte-to-unicode table (what ``pre_tokenizers.ByteLevel.alphabet()`` holds), in
    byte order so ids are fixed."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _vocab_and_merges(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []

    def add(tok: str) -> None:
        vocab.setdefault(tok, len(vocab))

    for tok in (*SPECIAL_TOKENS, *_byte_alphabet()):
        add(tok)
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(vocab)} special and byte tokens")

    def merge(left: str, right: str) -> None:
        if len(vocab) < vocab_size and left + right not in vocab:
            merges.append((left, right))
            add(left + right)

    def spell(word: str) -> None:
        """Merge left to right, so every prefix of ``word`` becomes a token."""
        for end in range(2, len(word) + 1):
            merge(word[: end - 1], word[end - 1])

    space = "Ġ"  # byte-level symbol for " "
    for word in WORDS:
        for variant in (word, word.capitalize()):
            spell(variant)
            merge(space, variant)  # " hello" = " " + "hello", so encoding reaches it
        spell(word.upper())
    # Larger vocabularies (a v41-sized synthetic checkpoint): keep extending existing tokens by one
    # lowercase letter, breadth first, until the vocab is full.
    frontier = [t for t in vocab if t not in SPECIAL_TOKENS]
    i = 0
    while len(vocab) < vocab_size:
        base = frontier[i]
        i += 1
        for ch in "abcdefghijklmnopqrstuvwxyz":
            if len(vocab) >= vocab_size:
                break
            if base + ch not in vocab:
                merges.append((base, ch))
                add(base + ch)
                frontier.append(base + ch)
    return vocab, merges


def build_tiny_tokenizer(vocab_size: int):
    """A ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _vocab_and_merges(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != vocab_size:
        raise AssertionError(f"built a tokenizer of {n} ids, wanted {vocab_size}")
    return tok


def write_tiny_tokenizer(path: str | Path, vocab_size: int) -> Path:
    """Write ``tokenizer.json`` (``path`` may be the file or its directory); returns the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    tok = build_tiny_tokenizer(vocab_size)
    # re-serialise with sorted keys so the bytes do not depend on dict order inside the library
    path.write_text(json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1, sort_keys=True) + "\n")
    return path
