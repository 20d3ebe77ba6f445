"""A small but real byte-level BPE ``tokenizer.json`` for synthetic checkpoints.

Built by hand (no training, no network) so it is byte-for-byte deterministic: V4.1's special
tokens at their released ids (or, in a vocab too small for those, at the top; see
``special_token_ids``), the 256 byte-level symbols, then merges spelling out a fixed word list in several
case/space variants ("hello", " hello", "Hello", " Hello", "HELLO"). The variants normalise alike,
so the Engram compressed token map genuinely collapses ids, as it does on the released tokenizer.
Byte-level pre-tokenisation and decoding make every text round-trip.
"""

from __future__ import annotations

import json
from pathlib import Path

# V4.1's special tokens and their ids in the released tokenizer (facts §9). `<｜System｜>` is reported
# at the id of the DSpark noise token; the release's tokenizer.json could not be read to confirm it.
RELEASE_VOCAB_SIZE = 129280
RELEASE_SPECIAL_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜▁pad▁｜>": 2,
    "<｜System｜>": 128799,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
    "<｜latest_reminder｜>": 128828,
    "<｜action｜>": 128829,
    "<｜query｜>": 128830,
    "<｜authority｜>": 128831,
    "<｜domain｜>": 128832,
    "<｜title｜>": 128836,
    "<｜read_url｜>": 128845,
    "<｜deepseek_image｜>": 129264,
}
SPECIAL_TOKENS = tuple(RELEASE_SPECIAL_IDS)
# Markers a completion carries and the chat parser reads: like the thinking and tool tokens of
# DeepSeek's earlier tokenizers, they are added tokens that decoding keeps (not "special").
KEPT_ON_DECODE = frozenset({"<think>", "</think>", "｜DSML｜"})


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Where each special token sits: the released ids when the vocab is the release's size (or
    larger); in a smaller vocab BOS/EOS/pad keep 0-2 and the others take the top ids in the
    released order (so `<｜System｜>` is the lowest of them, as in the release)."""
    if vocab_size >= RELEASE_VOCAB_SIZE:
        return dict(RELEASE_SPECIAL_IDS)
    high = [t for t, i in RELEASE_SPECIAL_IDS.items() if i > 2]
    ids = {t: i for t, i in RELEASE_SPECIAL_IDS.items() if i <= 2}
    ids.update({t: vocab_size - len(high) + k for k, t in enumerate(high)})
    return ids


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
    specials = special_token_ids(vocab_size)
    ordinary: list[str] = []
    seen: set[str] = set()
    merges: list[tuple[str, str]] = []
    room = vocab_size - len(specials)

    def add(tok: str) -> None:
        if tok not in seen:
            seen.add(tok)
            ordinary.append(tok)

    for tok in _byte_alphabet():
        add(tok)
    if len(ordinary) > room:
        raise ValueError(f"vocab_size {vocab_size} is below the {len(specials) + 256} special and byte tokens")

    def merge(left: str, right: str) -> None:
        if len(ordinary) < room and left + right not in seen:
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
    frontier = list(ordinary)
    i = 0
    while len(ordinary) < room:
        base = frontier[i]
        i += 1
        for ch in "abcdefghijklmnopqrstuvwxyz":
            if len(ordinary) >= room:
                break
            if base + ch not in seen:
                merges.append((base, ch))
                add(base + ch)
                frontier.append(base + ch)
    # ordinary tokens fill the ids the special tokens leave free, in order
    taken = set(specials.values())
    free = (i for i in range(vocab_size) if i not in taken)
    vocab = {**specials, **{tok: next(free) for tok in ordinary}}
    return vocab, merges


def build_tiny_tokenizer(vocab_size: int):
    """A ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _vocab_and_merges(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS if t in KEPT_ON_DECODE])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS if t not in KEPT_ON_DECODE]
    )
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
