"""Engram hash layout, multipliers, token map and the stateless hasher."""

import json

import numpy as np
import pytest
import torch

from asympd.config import tiny, v41_flash
from asympd.model.engram_hash import (
    NgramHasher,
    compressed_token_map,
    engram_num_embeddings,
    engram_primes,
    hash_multipliers,
    is_prime,
)
from asympd.model.tiny_tokenizer import SPECIAL_TOKENS, special_token_ids, write_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer_path(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 512)


def _sieve(n):
    flags = np.ones(n, dtype=bool)
    flags[:2] = False
    for i in range(2, int(n**0.5) + 1):
        if flags[i]:
            flags[i * i :: i] = False
    return flags


def test_is_prime_matches_sieve():
    flags = _sieve(20000)
    assert [is_prime(i) for i in range(20000)] == flags.tolist()


def test_is_prime_large_and_pseudoprimes():
    assert is_prime(2**61 - 1) and is_prime(16000057) and is_prime(1_000_000_007)
    # Carmichael numbers and strong pseudoprimes to small bases must be rejected
    for n in (561, 41041, 3215031751, 2152302898747, 3474749660383, 341550071728321, 3825123056546413051):
        assert not is_prime(n), n
    assert not is_prime((2**31 - 1) * (2**61 - 1))


def test_tiny_primes_by_hand():
    # n-gram sizes restart just above engram_vocab_size - 1 = 96 and skip primes already taken
    assert engram_primes(tiny()) == (
        ((97, 101), (103, 107), (109, 113)),
        ((127, 131), (137, 139), (149, 151)),
    )


def test_released_primes_consistent_with_config_json():
    cfg = v41_flash()
    primes = engram_primes(cfg)
    flat = [p for layer in primes for per_ngram in layer for p in per_ngram]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8
    assert all(p > cfg.engram_vocab_size - 1 and is_prime(p) for p in flat)
    assert primes[0][0][0] == 16000057  # the first prime above 16,000,000
    # every prime between 16e6 and the largest handed out is used: they are drawn in order
    assert flat == sorted(flat)
    assert all(not is_prime(n) for n in range(cfg.engram_vocab_size, flat[-1]) if n not in flat)
    # the released table sizes are exactly the summed bucket ranges
    assert engram_num_embeddings(cfg) == (384006168, 384016682) == cfg.engram_num_embeddings


def test_tiny_preset_literals_recomputed(tiny_tokenizer_path):
    cfg = tiny()
    assert engram_num_embeddings(cfg) == cfg.engram_num_embeddings == (630, 834)
    _, size = compressed_token_map(tiny_tokenizer_path)
    assert size == cfg.engram_compressed_vocab_size


def test_hash_multipliers_odd_bounded_deterministic():
    cfg = v41_flash()
    m = hash_multipliers(cfg, 99092)
    assert m.shape == (2, 4) and m.dtype == torch.int64
    assert bool((m % 2 == 1).all())
    # token * multiplier must not overflow int64 for any compressed id
    assert bool((m < np.iinfo(np.int64).max // 99092).all())
    assert torch.equal(m, hash_multipliers(cfg, 99092))
    assert m[0].tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    # seeded by layer id: a different layer set gives different rows
    assert not torch.equal(m[0], m[1])
    small = hash_multipliers(tiny(), 303)
    assert small.shape == (2, 4) and bool((small % 2 == 1).all())


def test_tokenizer_round_trip_and_size(tiny_tokenizer_path, tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_tokenizer_path))
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    for text in ("hello world", "Hello, WORLD! the model serves tokens.", "naïve café 日本"):
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("hello world").tokens == ["hello", "Ġworld"]
    for special, i in special_token_ids(512).items():
        assert tok.token_to_id(special) == i
    # deterministic bytes
    again = write_tiny_tokenizer(tmp_path / "tokenizer.json", 512)
    assert again.read_bytes() == tiny_tokenizer_path.read_bytes()
    assert json.loads(again.read_text())["model"]["type"] == "BPE"


def test_token_map_collapses_case_and_space(tiny_tokenizer_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_tokenizer_path))
    lookup, size = compressed_token_map(tiny_tokenizer_path)
    assert len(lookup) == 512 and size < 512 and max(lookup) == size - 1
    ids = [tok.token_to_id(t) for t in ("hello", "Ġhello", "Hello", "ĠHello", "HELLO")]
    assert None not in ids and len({lookup[i] for i in ids}) == 1
    assert lookup[tok.token_to_id("a")] == lookup[tok.token_to_id("A")]
    assert lookup[tok.token_to_id("hello")] != lookup[tok.token_to_id("world")]
    # special tokens keep their own ids; a lone space keeps its own (not merged with "")
    special_ids = special_token_ids(512).values()
    assert len({lookup[i] for i in special_ids}) == len(SPECIAL_TOKENS)
    assert lookup[tok.token_to_id("Ġ")] not in {lookup[i] for i in special_ids}
    # partial UTF-8 bytes are keyed by their raw token, so they stay distinct
    high = [tok.token_to_id(c) for c in ("Ã", "Â")]
    assert lookup[high[0]] != lookup[high[1]]


def _reference_hash(cfg, token_map, tokens, mask=None):
    """A slow, literal transcription of the reference recipe, one position at a time."""
    primes = engram_primes(cfg)
    mult = hash_multipliers(cfg, cfg.engram_compressed_vocab_size).tolist()
    pad = token_map[cfg.engram_pad_id]
    n = cfg.engram_max_ngram_size
    out = []
    for pos in range(len(tokens)):
        window, blocked = [], False
        for shift in range(n):
            src = pos - shift
            blocked = blocked or src < 0 or (mask is not None and not mask[src])
            window.append(pad if blocked else token_map[tokens[src]])
        rows = []
        for layer, layer_primes in enumerate(primes):
            flat = [p for per_ngram in layer_primes for p in per_ngram]
            offsets = [sum(flat[:j]) for j in range(len(flat))]
            cols, rolling = [], window[0] * mult[layer][0]
            for i in range(1, n):
                rolling ^= window[i] * mult[layer][i]
                cols.extend(rolling % p for p in layer_primes[i - 1])
            rows.append([c + o for c, o in zip(cols, offsets, strict=True)])
        out.append(rows)
    return torch.tensor(out, dtype=torch.int64)


@pytest.fixture(scope="module")
def tiny_hasher(tiny_tokenizer_path):
    lookup, _ = compressed_token_map(tiny_tokenizer_path)
    return tiny(), lookup, NgramHasher(tiny(), lookup)


def test_hasher_matches_reference_single_chunk(tiny_hasher):
    cfg, lookup, hasher = tiny_hasher
    tokens = torch.randint(0, 512, (50,), generator=torch.Generator().manual_seed(0))
    got = hasher.hash_ids(tokens, 0, 50)
    assert got.shape == (50, 2, cfg.n_hash_cols) == (50, 2, 6)
    assert torch.equal(got, _reference_hash(cfg, lookup, tokens.tolist()))
    # every column lands inside its own prime range of its layer's table
    for layer, rows in enumerate(cfg.engram_num_embeddings):
        flat = [p for per_ngram in engram_primes(cfg)[layer] for p in per_ngram]
        lo = torch.tensor([sum(flat[:j]) for j in range(6)])
        assert bool((got[:, layer] >= lo).all()) and bool((got[:, layer] < lo + torch.tensor(flat)).all())
        assert int(got[:, layer].max()) < rows


def test_hasher_pads_before_position_zero(tiny_hasher):
    cfg, lookup, hasher = tiny_hasher
    tokens = torch.tensor([7, 7, 7, 7, 7])
    got = hasher.hash_ids(tokens, 0, 5)
    # positions >= 3 see four real 7s; position 0 sees (7, pad, pad, pad): different rows
    assert torch.equal(got[3], got[4]) and not torch.equal(got[0], got[3])
    # a history of pads hashes like the sequence start
    padded = torch.tensor([cfg.engram_pad_id] * 3 + [7])
    assert torch.equal(hasher.hash_ids(padded, 3, 1)[0], got[0])


def test_hasher_chunking_invariance(tiny_hasher):
    cfg, lookup, hasher = tiny_hasher
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 512, (97,), generator=gen)
    whole = hasher.hash_ids(tokens, 0, 97)
    for cuts in ([1, 2, 3], [5, 40, 41], [96], list(range(1, 97, 7))):
        bounds = [0, *cuts, 97]
        parts = [hasher.hash_ids(tokens, a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]
        assert torch.equal(torch.cat(parts), whole)
    # a decode step sees only its own history: extending the sequence does not change earlier ids
    longer = torch.cat([tokens, torch.tensor([1, 2, 3])])
    assert torch.equal(hasher.hash_ids(longer, 0, 97), whole)
    assert torch.equal(hasher.hash_ids(longer, 97, 3), _reference_hash(cfg, lookup, longer.tolist())[97:])


def test_hasher_token_mask_blocks_lookback(tiny_hasher):
    cfg, lookup, hasher = tiny_hasher
    tokens = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(30, dtype=torch.bool)
    mask[10:13] = False
    got = torch.cat([hasher.hash_ids(tokens, a, 10, mask) for a in (0, 10, 20)])
    assert torch.equal(got, _reference_hash(cfg, lookup, tokens.tolist(), mask.tolist()))


def test_hasher_rejects_mismatched_compressed_size(tiny_tokenizer_path):
    lookup, size = compressed_token_map(tiny_tokenizer_path)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher(tiny().replace(engram_compressed_vocab_size=size + 1), lookup)


def test_hasher_rejects_out_of_range(tiny_hasher):
    _, _, hasher = tiny_hasher
    with pytest.raises(ValueError):
        hasher.hash_ids(torch.arange(5), 3, 4)


def test_tokenizer_sizes(tmp_path):
    from tokenizers import Tokenizer

    with pytest.raises(ValueError, match="below"):
        write_tiny_tokenizer(tmp_path / "a.json", 100)
    big = Tokenizer.from_file(str(write_tiny_tokenizer(tmp_path / "b.json", 2000)))
    assert big.get_vocab_size(with_added_tokens=True) == 2000
    assert big.decode(big.encode("prefill and decode").ids) == "prefill and decode"


def test_hash_many_equals_each_sequence_hashed_alone(tiny_hasher):
    """A step hashes all its sequences at once from each one's look-back tail only (what the runner
    sends): the rows equal hashing each whole history alone, masks and sequence starts included."""
    cfg, lookup, hasher = tiny_hasher
    gen = torch.Generator().manual_seed(5)
    n_back = cfg.engram_max_ngram_size - 1
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in (1, 2, 9, 40, 41)]
    masks = [None, None, torch.rand(9, generator=gen) > 0.3, None, torch.rand(41, generator=gen) > 0.2]
    items, want = [], []
    for ids, mask, (start, count) in zip(seqs, masks, [(0, 1), (1, 1), (4, 5), (36, 4), (0, 41)], strict=True):
        first = max(0, start - n_back)
        tail_mask = None if mask is None else mask[first:]
        items.append((ids[first:], first, start, count, tail_mask))
        want.append(hasher.hash_ids(ids, start, count, mask))
    assert torch.equal(hasher.hash_many(items), torch.cat(want))
    with pytest.raises(ValueError, match=f"lacks the {n_back} tokens before 10"):
        hasher.hash_many([(seqs[3][8:], 8, 10, 1, None)])
    with pytest.raises(ValueError, match=r"positions \[40, 42\) outside a history of 41 tokens"):
        hasher.hash_many([(seqs[4], 0, 40, 2, None)])
    assert hasher.hash_many([]).shape == (0, 2, cfg.n_hash_cols)
