"""PrefixState: layout, bit-exact round trips, the receiver's validation, corrupted blobs."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

from asympd.config import tiny, v41_flash
from asympd.transfer import FORMAT_VERSION, PrefixState, PrefixStateError, model_fingerprint
from asympd.transfer.prefix_state import BLOB_MAGIC, expected_buffers, parse_header
from tests.transfer.transfer_peer import CHECKPOINT, fingerprint, make_state

CFG = tiny()  # KV sources: layer 1 (ratio 2), layer 3 (ratio 1); head_dim 64, index_head_dim 32


# ---- layout ----------------------------------------------------------------------------------------


def test_layout_follows_the_config_for_odd_and_even_splits():
    odd = make_state(21, 37)
    assert {n: tuple(t.shape) for n, t in odd.named_buffers().items()} == {
        "ckv.1": (10, 64),
        "ckv.3": (21, 64),
        "idx.1": (10, 32),
        "idx.3": (21, 32),
        "pair_kv.1": (1, 64),
        "pair_score.1": (1, 64),
        "token_ids": (37,),
    }
    assert odd.pair_kv[1].dtype == torch.float32 and odd.ckv[1].dtype == torch.bfloat16
    even = make_state(20, 36)
    assert not even.pair_kv and not even.pair_score


def test_layout_of_the_released_model():
    cfg = v41_flash()
    s = 10_001
    spec = expected_buffers(cfg, s, s + 128, "bfloat16")
    for layer in (2, 8, 14):
        assert spec[f"ckv.{layer}"] == ("bfloat16", (5000, 512))
        assert spec[f"idx.{layer}"] == ("bfloat16", (5000, 128))
        assert spec[f"pair_kv.{layer}"] == ("float32", (1, 512))
        assert spec[f"pair_score.{layer}"] == ("float32", (1, 512))
    assert spec["ckv.20"] == ("bfloat16", (s, 512)) and spec["idx.20"] == ("bfloat16", (s, 128))
    assert "pair_kv.20" not in spec  # ratio 1 has no open group
    assert spec["token_ids"] == ("int64", (s + 128,))


def test_fingerprint_is_short_stable_and_sensitive():
    fp = model_fingerprint(CFG, CHECKPOINT, "bfloat16")
    assert len(fp) == 16 and set(fp) <= set("0123456789abcdef")
    assert fp == model_fingerprint(tiny(), CHECKPOINT, torch.bfloat16)
    assert fp != model_fingerprint(CFG, "other-ckpt", "bfloat16")
    assert fp != model_fingerprint(CFG, CHECKPOINT, "float8_e4m3fn")
    assert fp != model_fingerprint(CFG.replace(index_head_dim=16), CHECKPOINT, "bfloat16")
    assert fp == model_fingerprint(CFG.replace(max_seq_len=8192), CHECKPOINT, "bfloat16")  # a runtime limit


# ---- round trips -----------------------------------------------------------------------------------

CASES = [(21, 37), (20, 36), (1, 17), (0, 5), (0, 0), (33, 33)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize(("split", "n"), CASES)
def test_serialize_round_trip_is_bit_exact(dtype, split, n):
    state = make_state(split, n, dtype, seed=split + n)
    blob = state.serialize()
    assert blob[:8] == BLOB_MAGIC
    back = PrefixState.deserialize(blob)
    assert back.equal(state)
    back.validate(CFG, fingerprint(dtype))
    for name, t in back.named_buffers().items():  # same bytes, and a private writable copy
        assert torch.equal(t.view(torch.uint8), state.named_buffers()[name].view(torch.uint8))
        t.view(torch.uint8).fill_(0)
    assert PrefixState.deserialize(bytearray(blob)).equal(state)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(("split", "n"), CASES)
def test_buffers_round_trip_is_bit_exact(dtype, split, n):
    state = make_state(split, n, dtype, seed=7)
    header, buffers = state.to_buffers()
    assert all(b.is_contiguous() for b in buffers)
    table = json.loads(header)
    assert table["version"] == FORMAT_VERSION and table["metadata"]["split"] == split
    assert [e["name"] for e in table["buffers"]] == list(state.named_buffers())
    for e, b in zip(table["buffers"], buffers, strict=True):
        assert e["nbytes"] == b.numel() * b.element_size() and e["shape"] == list(b.shape)
        assert e["offset"] % 64 == 0
    assert PrefixState.from_buffers(header, buffers).equal(state)
    # a receiver that allocated raw bytes from the header
    raw = [b.reshape(-1).view(torch.uint8).clone() for b in buffers]
    assert PrefixState.from_buffers(header, raw).equal(state)
    assert PrefixState.from_buffers(parse_header(header), buffers).equal(state)


def test_nan_and_inf_bit_patterns_survive():
    state = make_state(20, 36, "float32")
    state.ckv[3][0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    state.ckv[3].view(torch.int32)[1, 0] = 0x7FC00123  # a NaN with a payload
    back = PrefixState.deserialize(state.serialize())
    assert back.ckv[3].view(torch.int32)[1, 0] == 0x7FC00123
    assert back.equal(state)


# ---- validation ------------------------------------------------------------------------------------


def _odd() -> PrefixState:
    return make_state(21, 37)


def _set(attr, value):
    def apply(s):
        setattr(s, attr, value)

    return apply


def _tokens(t):
    def apply(s):
        s.token_ids = t
        s.num_prompt_tokens = t.numel()

    return apply


BAD = {
    "version": (_set("version", 3), "unsupported format version 3 (this build reads version 2)"),
    "fingerprint": (_set("fingerprint", "deadbeefdeadbeef"), "fingerprint mismatch: state has 'deadbeefdeadbeef'"),
    "dtype name": (_set("dtype", "int64"), "dtype 'int64' is not a cache dtype"),
    "mode": (_set("mode", ""), "mode must be a non-empty name"),
    "policy": (_set("boundary_policy", ""), "boundary_policy must be a non-empty name"),
    "negative split": (_set("split", -1), "split -1 is negative"),
    "token count": (_set("num_prompt_tokens", 40), "token_ids has shape (37,), expected (40,) (num_prompt_tokens)"),
    "tokens < split": (_tokens(torch.arange(10)), "num_prompt_tokens 10 is smaller than split 21"),
    "token dtype": (_tokens(torch.arange(37, dtype=torch.int32)), "token_ids dtype is int32, expected int64"),
    "token range": (_tokens(torch.full((37,), 512)), "token_ids hold ids outside the vocabulary [0, 512)"),
    "token 2-d": (_tokens(torch.zeros(37, 1, dtype=torch.int64)), "token_ids has shape (37, 1), expected (37,)"),
    "beyond max_seq_len": (
        _tokens(torch.zeros(5000, dtype=torch.int64)),
        "num_prompt_tokens 5000 exceeds max_seq_len 4096",
    ),
    "missing ckv layer": (lambda s: s.ckv.pop(3), "ckv has layers [1], expected [1, 3]"),
    "extra idx layer": (lambda s: s.idx.__setitem__(2, s.idx[1]), "idx has layers [1, 2, 3], expected [1, 3]"),
    "missing pair": (lambda s: s.pair_kv.pop(1), "pair_kv has layers [], expected [1] (split 21: an open group"),
    "pair for ratio 1": (lambda s: s.pair_score.__setitem__(3, s.pair_score[1]), "pair_score has layers [1, 3]"),
    "ckv rows": (
        lambda s: s.ckv.__setitem__(1, s.ckv[1][:-1]),
        "ckv[1] has shape (9, 64), expected (10, 64) (rows = split 21 // ratio 2, width = head_dim)",
    ),
    "ratio-1 rows": (lambda s: s.ckv.__setitem__(3, s.ckv[3][:10]), "ckv[3] has shape (10, 64), expected (21, 64)"),
    "idx width": (
        lambda s: s.idx.__setitem__(3, s.idx[3][:, :16]),
        "idx[3] has shape (21, 16), expected (21, 32) (rows = split 21 // ratio 1, width = index_head_dim)",
    ),
    "pair rows": (
        lambda s: s.pair_score.__setitem__(1, torch.zeros(2, 64)),
        "pair_score[1] has shape (2, 64), expected (1, 64) (rows = split 21 % ratio 2",
    ),
    "ckv dtype": (lambda s: s.ckv.__setitem__(1, s.ckv[1].half()), "ckv[1] dtype is float16, expected bfloat16"),
    "pair dtype": (
        lambda s: s.pair_kv.__setitem__(1, s.pair_kv[1].bfloat16()),
        "pair_kv[1] dtype is bfloat16, expected float32",
    ),
}


def test_valid_state_passes():
    _odd().validate(CFG, fingerprint())


@pytest.mark.parametrize("case", list(BAD))
def test_validation_names_what_is_wrong(case):
    mutate, message = BAD[case]
    state = _odd()
    mutate(state)
    with pytest.raises(PrefixStateError) as err:
        state.validate(CFG, fingerprint())
    assert message in str(err.value)


def test_validation_rejects_a_state_for_another_model_or_format():
    state = _odd()
    with pytest.raises(PrefixStateError, match="fingerprint mismatch"):
        state.validate(CFG, fingerprint("float8_e4m3fn"))
    with pytest.raises(PrefixStateError, match=r"ckv has layers \[1, 3\], expected \[2, 8, 14, 20\]"):
        state.validate(v41_flash(), state.fingerprint)  # right fingerprint string, wrong schema


def test_unknown_dtype_is_refused_at_construction():
    with pytest.raises(PrefixStateError, match="dtype 'fp8' is not supported"):
        PrefixState.allocate(CFG, 4, range(8), fingerprint="x", dtype="fp8")


# ---- corrupted blobs and headers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def blob() -> bytes:
    return make_state(21, 37).serialize()


def _header_end(blob: bytes) -> int:
    prefix = struct.calcsize("<8sIIIQI")
    return prefix + struct.unpack_from("<I", blob, 12)[0]


def test_every_truncation_is_refused(blob):
    for n in [*range(0, _header_end(blob) + 8), *range(_header_end(blob) + 8, len(blob), 97), len(blob) - 1]:
        with pytest.raises(PrefixStateError):
            PrefixState.deserialize(blob[:n])


def test_every_flipped_prefix_or_header_byte_is_refused(blob):
    for i in range(_header_end(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x20
        with pytest.raises(PrefixStateError):
            PrefixState.deserialize(bytes(bad))


def test_flipped_payload_bytes_are_refused(blob):
    for i in range(_header_end(blob), len(blob), 61):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(PrefixStateError, match="payload checksum mismatch"):
            PrefixState.deserialize(bytes(bad))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b"NOTASTAT" + b[8:], "bad magic b'NOTASTAT'"),
        (lambda b: b[:8] + struct.pack("<I", 9) + b[12:], "unsupported format version 9"),
        (lambda b: b + b"\0", "oversized payload"),
        (lambda b: b[:-64], "truncated payload"),
        (lambda b: b[:20], "truncated blob"),
        (lambda b: b"", "truncated blob"),
        (lambda b: b[:16] + b"\x10\x00\x00\x00" + b[20:], "header checksum mismatch"),
    ],
)
def test_corruption_messages(blob, mutate, message):
    with pytest.raises(PrefixStateError, match=message.replace("(", r"\(")):
        PrefixState.deserialize(mutate(blob))


def test_random_garbage_is_refused():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 31, 32, 33, 100, 5000):
        junk = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy().tobytes()
        for data in (junk, BLOB_MAGIC + junk):
            with pytest.raises(PrefixStateError):
                PrefixState.deserialize(data)


def _edit_header(fn):
    state = make_state(21, 37)
    header, buffers = state.to_buffers()
    parsed = json.loads(header)
    fn(parsed, buffers)
    return json.dumps(parsed).encode(), buffers


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h, b: h.update(magic="nope"), "bad header magic 'nope'"),
        (lambda h, b: h.update(version=0), "unsupported format version 0"),
        (lambda h, b: h.pop("buffers"), "malformed header: KeyError"),
        (lambda h, b: h["metadata"].update(split="21"), "metadata split is '21'"),
        (lambda h, b: h["buffers"][0].update(dtype="complex64"), "unknown dtype 'complex64'"),
        (lambda h, b: h["buffers"][0].update(nbytes=1), "buffer ckv.1 says 1 bytes, its shape needs 1280"),
        (lambda h, b: h["buffers"][0].update(offset=1 << 30), "overruns the payload"),
        (lambda h, b: h["buffers"][0].update(name="kv.1"), "unknown buffer name 'kv.1'"),
        (lambda h, b: h["buffers"][1].update(name="ckv.1"), "buffer ckv.1 listed twice"),
        (lambda h, b: h["buffers"].pop(), "no token_ids buffer"),
        (lambda h, b: b.pop(), "header lists 7 buffers, got 6"),
        (lambda h, b: b.__setitem__(0, b[0][:-1]), "buffer ckv.1 has 1152 bytes, header says 1280"),
        (lambda h, b: b.__setitem__(0, b[0].view(torch.float16)), "buffer ckv.1 is float16, header says bfloat16"),
    ],
)
def test_from_buffers_refuses_inconsistent_input(edit, message):
    header, buffers = _edit_header(edit)
    with pytest.raises(PrefixStateError, match=message.replace("(", r"\(")):
        PrefixState.from_buffers(header, buffers)


def test_from_buffers_refuses_non_json():
    _, buffers = make_state(4, 8).to_buffers()
    for junk in (b"\xff\xfe", b"{", b"[1,2]", b"null"):
        with pytest.raises(PrefixStateError):
            PrefixState.from_buffers(junk, buffers)


# ---- shipped windows (mode symmetric-windows) -------------------------------------------------------


def _with_windows(n: int = 37, rows: int = 17) -> PrefixState:
    """A state at split n (symmetric P exports [0, N)) carrying every layer's last ``rows`` window rows."""
    state = make_state(n, n)
    gen = torch.Generator().manual_seed(5)
    for layer in range(CFG.n_layers):
        state.swa_kv[layer] = torch.randn(rows, CFG.head_dim, generator=gen).bfloat16()
        state.swa_pos[layer] = torch.arange(n - rows, n)
    return state


def test_windows_round_trip_and_cost_exactly_their_bytes():
    state = _with_windows()
    state.validate(CFG, fingerprint())
    back = PrefixState.deserialize(state.serialize())
    assert back.equal(state) and sorted(back.swa_kv) == list(range(CFG.n_layers))
    assert state.nbytes - make_state(37, 37).nbytes == CFG.n_layers * 17 * (CFG.head_dim * 2 + 8)
    header, buffers = state.to_buffers()
    assert PrefixState.from_buffers(header, buffers).equal(state)


WINDOW_BAD = {
    "missing layer": (
        lambda s: s.swa_kv.pop(4),
        "swa_kv has layers [0, 1, 2, 3, 5, 6], expected [0, 1, 2, 3, 4, 5, 6]",
    ),
    "positions without rows": (lambda s: s.swa_pos.pop(0), "swa_pos has layers [1, 2, 3, 4, 5, 6]"),
    "dtype": (
        lambda s: s.swa_kv.__setitem__(2, s.swa_kv[2].float()),
        "swa_kv[2] is (17, 64) torch.float32, expected (rows, 64) bfloat16",
    ),
    "row count": (
        lambda s: s.swa_pos.__setitem__(1, s.swa_pos[1][1:]),
        "swa_pos[1] is (16,) torch.int64, expected (17,) int64",
    ),
    "not ending at the prompt": (
        lambda s: s.swa_pos.__setitem__(3, s.swa_pos[3] - 1),
        "swa_pos[3] must ascend strictly within [0, 37) and end at 36",
    ),
    "too short": (
        lambda s: (s.swa_kv.__setitem__(6, s.swa_kv[6][-8:]), s.swa_pos.__setitem__(6, s.swa_pos[6][-8:])),
        "swa_kv[6] does not hold the last 16 prompt rows",
    ),
}


@pytest.mark.parametrize("case", list(WINDOW_BAD))
def test_window_validation_names_what_is_wrong(case):
    mutate, message = WINDOW_BAD[case]
    state = _with_windows()
    mutate(state)
    with pytest.raises(PrefixStateError) as err:
        state.validate(CFG, fingerprint())
    assert message in str(err.value)


# ---- image rows (docs/vision.md) ------------------------------------------------------------------


def _with_images(state: PrefixState, spans: list[tuple[int, int]], pos: list[int]) -> PrefixState:
    """The state's prompt with image-token spans [(start, length)] and rows at ``pos``."""
    state.token_ids[state.token_ids == CFG.image_token_id] = 5  # no stray image token outside spans
    for start, length in spans:
        state.token_ids[start : start + length] = CFG.image_token_id
    state.image_spans = torch.tensor(spans, dtype=torch.int64).reshape(-1, 2)
    state.image_pos = torch.tensor(pos, dtype=torch.int64)
    state.image_rows = torch.randn(len(pos), CFG.dim).to(torch.bfloat16)
    return state


def test_image_rows_round_trip_bit_exact_and_are_validated():
    fp = fingerprint("bfloat16")
    state = _with_images(make_state(21, 37), [(3, 8), (18, 10)], list(range(21, 28)))
    state.validate(CFG, fp)
    back = PrefixState.deserialize(state.serialize())
    assert back.equal(state) and back.image_pos.tolist() == list(range(21, 28))
    assert torch.equal(back.image_rows.view(torch.int16), state.image_rows.view(torch.int16))
    bad = {
        "overlaps another": lambda s: setattr(s, "image_spans", torch.tensor([[3, 8], [10, 10]])),
        "do not match the prompt's image token": lambda s: setattr(s, "image_spans", torch.tensor([[3, 8]])),
        "inside the image spans": lambda s: setattr(s, "image_pos", torch.arange(29, 36)),
        "expected (7, 128) bfloat16": lambda s: setattr(s, "image_rows", s.image_rows.float()),
        "non-finite": lambda s: s.image_rows.__setitem__((0, 0), float("nan")),
        "travel together": lambda s: setattr(s, "image_rows", None),
    }
    for needle, corrupt in bad.items():
        s = PrefixState.deserialize(state.serialize())
        corrupt(s)
        with pytest.raises(PrefixStateError, match=re.escape(needle)):
            s.validate(CFG, fp)
