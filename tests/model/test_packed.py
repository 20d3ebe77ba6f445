"""Weights kept as released (asympd/model/packed.py, gemm_kernels.py) against the dequantized reference.

The Triton kernels run here under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on
machines without a GPU); on the device the same tests run compiled. Activations are drawn through
the reference's FP8 quantization, as the model feeds them.
"""

from __future__ import annotations

import pytest
import torch

gemm = pytest.importorskip("asympd.model.gemm_kernels")
if not gemm.AVAILABLE:
    pytest.skip("Triton is not installed", allow_module_level=True)

import asympd  # noqa: E402
from asympd.model.loader import load_model  # noqa: E402
from asympd.model.packed import FP8TileLinear  # noqa: E402
from asympd.model.quant import dequant_fp4, dequant_fp8_tiles, fp8_qdq, quant_fp4, quant_fp8_tiles  # noqa: E402
from asympd.plan.memory import memory_report  # noqa: E402
from tests.util import random_prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # tiles of very different magnitudes, so a scale applied to the wrong tile shows
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)
    q, s = quant_fp8_tiles(w)
    return q.to(DEVICE), s.to(DEVICE), dequant_fp8_tiles(q, s).to(DEVICE)


@pytest.mark.parametrize("m,n,k", [(1, 96, 160), (3, 64, 256), (40, 160, 96)])
@pytest.mark.parametrize("split_k", [None, 2])
def test_fp8_tile_gemm_equals_dequantized_gemm(m, n, k, split_k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    q, s, wd = _fp8_weight(n, k, g)
    a = fp8_qdq(torch.randn(m, k, generator=g), 32).to(DEVICE)
    y = torch.full((m, n), float("nan"), device=DEVICE)
    y = gemm.fp8_tile_gemm(a, q, s, split_k=split_k)
    assert torch.isfinite(y).all()
    ref = a.double() @ wd.double().t()
    assert rel(y, ref) < 1e-6  # fp32: equal up to summation order
    yb = gemm.fp8_tile_gemm(a.bfloat16(), q, s, split_k=split_k)
    assert yb.dtype == torch.bfloat16
    # bf16 operands are exact in fp32: the output is the exact product rounded once (one ulp of slack
    # for the summation order)
    assert torch.allclose(yb.double(), ref.bfloat16().double(), rtol=2**-7, atol=0)


def test_fp8_tile_gemm_grouped_takes_each_group_through_its_rows():
    g = torch.Generator().manual_seed(5)
    q, s, wd = _fp8_weight(128, 64, g)
    x = fp8_qdq(torch.randn(7, 2, 64, generator=g), 32).to(DEVICE)
    y = gemm.fp8_tile_gemm(x, q, s, groups=2)
    ref = torch.stack([x[:, i].double() @ wd[i * 64 : (i + 1) * 64].double().t() for i in range(2)], dim=1)
    assert y.shape == (7, 2, 64) and rel(y, ref) < 1e-6


@pytest.mark.parametrize(
    "m,n,k,groups,config",
    [
        (1, 96, 160, 1, {}),  # one row; 96 columns: a partial column block (clamped loads, masked store)
        (3, 64, 256, 1, {"split_k": 4}),  # split K: the last program reduces in split order
        (2, 64, 448, 1, {"split_k": 7, "unroll": 2}),  # 7 splits: a partial chunk of 4 in the reduction
        (7, 256, 128, 2, {"split_k": 2}),  # grouped (wo_a's form), split
        (7, 256, 128, 2, {"scale_after": False, "k_order": False}),  # grouped, the scale on the weights
        (9, 64, 128, 1, {"k_order": False, "split_k": 2}),  # K in its own order
        (40, 64, 128, 1, {"k_order": True, "scale_after": False}),  # 64-row M-block, permuted K
        (5, 128, 192, 1, {"split_k": 3, "block_n": 64, "unroll": 1}),  # 6 steps in 3 splits
        (40, 160, 96, 1, {"scale_after": True}),  # 40 rows: M-blocks of 64, the scale after the dot
        (21, 96, 256, 1, {"block_m": 16, "split_k": 2}),  # two M-blocks, the second partial
    ],
)
def test_fp8_tile_swap_ab_equals_the_dequantized_gemm(m, n, k, groups, config):
    """The transposed decode-regime FP8-tile kernel against the float64 GEMM on the dequantized
    weights and against the first kernel: fp32 equal up to summation order, bf16 the exact product
    rounded once (one ulp for the order)."""
    g = torch.Generator().manual_seed(m * 100 + n + k + groups)
    q, s, wd = _fp8_weight(n, k, g)
    shape = (m, groups, k) if groups > 1 else (m, k)
    a = fp8_qdq(torch.randn(*shape, generator=g), 32).to(DEVICE)
    if groups > 1:
        w3 = wd.double().view(groups, n // groups, k)
        ref = torch.stack([a[:, i].double() @ w3[i].t() for i in range(groups)], dim=1)
    else:
        ref = a.double() @ wd.double().t()
    cfg = {"swap_ab": True, **config}
    y = gemm.fp8_tile_gemm(a, q, s, groups=groups, config=cfg)
    old = gemm.fp8_tile_gemm(a, q, s, groups=groups, config={"swap_ab": False})
    assert y.shape == old.shape == ref.shape and y.dtype == torch.float32
    assert rel(y, ref) < 1e-6 and rel(y, old) < 1e-6
    assert torch.equal(gemm.fp8_tile_gemm(a, q, s, groups=groups, config=cfg), y)  # deterministic
    yb = gemm.fp8_tile_gemm(a.bfloat16(), q, s, groups=groups, config=cfg)
    assert yb.dtype == torch.bfloat16
    assert torch.allclose(yb.double(), ref.bfloat16().double(), rtol=2**-7, atol=0)
    # split K leaves every ticket counter at zero for the next call (and for CUDA graph replays)
    assert all(int(t.abs().sum()) == 0 for t in gemm._TICKETS.values())


def test_fp8_tile_swap_ab_splits_k_to_fill_the_chip():
    """Four programs per SM where the tiles are fewer than two per SM, whole unrolled steps per
    split, at least two steps each, at most 16 splits (132 SMs)."""
    assert gemm._swap_splits(80, 4, 132) == 16  # wkv 512x5120 at one row: 4 column blocks, capped
    assert gemm._swap_splits(20, 256, 132) == 4  # wq_b 32768x1280: 256 blocks, 1024 programs
    assert gemm._swap_splits(8, 64, 132) == 4  # wo_a: 8 groups x 8 column blocks, K 512: 4 steps of 2
    assert gemm._swap_splits(128, 40, 132) == 16  # wo_b 5120x8192: 40 blocks want 14 -> 16
    assert gemm._swap_splits(80, 300, 132) == 1  # enough tiles
    assert gemm._swap_splits(3, 1, 132) == 1  # 3 steps: no split leaves two steps each


def test_fp8_tile_gemm_picks_the_transposed_kernel_by_rows(monkeypatch):
    """On CUDA the transposed kernel for M <= FP8_SWAP_MAX_ROWS (0 in the product: opt-in; set here
    to test the rule); ``FP8_DEFAULTS`` and ``config`` select either kernel anywhere (on CPU the
    default is the first kernel)."""
    assert gemm.FP8_SWAP_MAX_ROWS == 0
    monkeypatch.setattr(gemm, "FP8_SWAP_MAX_ROWS", 16)
    calls = []
    real = gemm._fp8_tile_swap
    monkeypatch.setattr(gemm, "_fp8_tile_swap", lambda *args: calls.append(args[0].shape) or real(*args))
    g = torch.Generator().manual_seed(8)
    q, s, _ = _fp8_weight(64, 96, g)
    a = fp8_qdq(torch.randn(5, 96, generator=g), 32).to(DEVICE)
    big = fp8_qdq(torch.randn(gemm.FP8_SWAP_MAX_ROWS + 1, 96, generator=g), 32).to(DEVICE)
    gemm.fp8_tile_gemm(a, q, s)
    gemm.fp8_tile_gemm(big, q, s)
    assert calls == ([(5, 1, 96)] if DEVICE == "cuda" else [])
    calls.clear()
    monkeypatch.setattr(gemm, "FP8_DEFAULTS", {"swap_ab": True})
    gemm.fp8_tile_gemm(a, q, s)
    gemm.fp8_tile_gemm(a, q, s, config={"swap_ab": False})
    assert calls == [(5, 1, 96)]


def test_fp8_tile_linear_quantizes_its_input_like_the_reference():
    g = torch.Generator().manual_seed(6)
    q, s, wd = _fp8_weight(64, 96, g)
    x = torch.randn(5, 96, generator=g).to(DEVICE)
    lin = FP8TileLinear(q, s, quantized=True, dtype=torch.float32)
    assert rel(lin(x), fp8_qdq(x, 32).double() @ wd.double().t()) < 1e-6
    assert torch.equal(lin.dequantized(), wd)


def _moe_problem(rows: int, n: int, block_m: int, seed: int, magnitude: bool = False):
    """Five experts of very different magnitudes, top-2 routing; returns the GEMM's operands and
    the float64 reference of every sorted row (``magnitude``: of |a| @ |W|^T, the sum of the
    terms' magnitudes, instead)."""
    g = torch.Generator().manual_seed(seed)
    n_exp, k, topk = 5, 256, 2
    packed, scales = zip(*(quant_fp4(torch.randn(n, k, generator=g) * 10.0**e) for e in range(-2, 3)), strict=True)
    w = gemm.repack_fp4(torch.stack(packed)).to(DEVICE)
    assert torch.equal(gemm.unrepack_fp4(w.cpu()), torch.stack(packed))
    sc = torch.stack([s.view(torch.uint8) for s in scales]).to(DEVICE)
    wd = torch.stack([dequant_fp4(p, s) for p, s in zip(packed, scales, strict=True)]).to(DEVICE)
    x = fp8_qdq(torch.randn(rows, k, generator=g), 32).to(DEVICE)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:topk] for _ in range(rows)]).to(DEVICE)
    flat = ids.reshape(-1)
    order, *blocks = gemm.moe_blocks(flat, n_exp, block_m)
    assert torch.equal(flat[order], flat.sort(stable=True).values)
    token = order // topk
    if magnitude:
        x, wd = x.abs(), wd.abs()
    ref = torch.stack([x[token[i]].double() @ wd[flat[order[i]]].double().t() for i in range(flat.numel())])
    return x, w, sc, blocks, token, ref


@pytest.mark.parametrize("cfg", [{}, {"lut_pairs": True}, {"swap_ab": True}], ids=["current", "lut_pairs", "swap_ab"])
@pytest.mark.parametrize("rows,block_m", [(1, 16), (7, 16), (50, 32)])
def test_mxfp4_moe_gemm_equals_per_expert_gemm(rows, block_m, cfg):
    if cfg.get("lut_pairs") and DEVICE == "cpu":
        pytest.skip("the table decodes run on CUDA only (emulated here by test_fp4_table_decodes_...)")
    x, w, sc, blocks, token, ref = _moe_problem(rows, 96, block_m, seed=rows)
    r = token.numel()
    y = gemm.mxfp4_moe_gemm(x, w, sc, blocks, r, block_m, a_rows=token, config=cfg)
    assert rel(y, ref) < 1e-6
    # the second GEMM's form: rows already sorted, no gather
    y2 = gemm.mxfp4_moe_gemm(x[token], w, sc, blocks, r, block_m, config=cfg)
    assert torch.equal(y2, y)
    # bf16 (on CUDA: the PRMT table decode): the exact product rounded once, one ulp for the order
    yb = gemm.mxfp4_moe_gemm(x.bfloat16(), w, sc, blocks, r, block_m, a_rows=token, config=cfg)
    assert torch.allclose(yb.double(), ref.bfloat16().double(), rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    "n,block_m,config",
    [
        (96, 16, {"split": 2}),  # split K; 96 columns: a partial column block (masked loads)
        (128, 16, {"scale_after": False, "block_n": 64}),  # per-weight scales; whole column blocks
        (128, 8, {"unroll": 1, "split": 3}),  # wgmma's narrowest N; 3 splits of 8 blocks -> 2 of 4
        (96, 32, {"scale_after": True, "unroll": 4}),
    ],
)
def test_mxfp4_moe_swap_ab_equals_the_current_kernel(n, block_m, config):
    """The transposed decode-regime kernel against the current one on the same operands, gathered
    and not, split and not: equal up to summation order (fp32 to 1e-6, bf16 within one ulp)."""
    x, w, sc, blocks, token, ref = _moe_problem(13, n, block_m, seed=n + block_m)
    r, swapped = token.numel(), {"swap_ab": True, **config}
    cur = gemm.mxfp4_moe_gemm(x, w, sc, blocks, r, block_m, a_rows=token, config={"split": config.get("split", 1)})
    for xs, rows in ((x, token), (x[token], None)):
        new = gemm.mxfp4_moe_gemm(xs, w, sc, blocks, r, block_m, a_rows=rows, config=swapped)
        assert new.shape == cur.shape == (r, n) and rel(new, cur) < 1e-6 and rel(new, ref) < 1e-6
        yb = gemm.mxfp4_moe_gemm(xs.bfloat16(), w, sc, blocks, r, block_m, a_rows=rows, config=swapped)
        assert torch.allclose(yb.double(), ref.bfloat16().double(), rtol=2**-7, atol=0)


def test_mxfp4_moe_swap_ab_rejects_an_unroll_that_does_not_divide_k():
    x, w, sc, blocks, token, _ = _moe_problem(3, 96, 16, seed=1)
    with pytest.raises(ValueError, match="unroll 3 does not divide the 8 scale blocks of K"):
        gemm.mxfp4_moe_gemm(x, w, sc, blocks, token.numel(), 16, a_rows=token, config={"swap_ab": True, "unroll": 3})


def _probe_words() -> list[tuple[list[int], int]]:
    """256 packed words (with their four bytes) that put every byte value at every byte position."""
    out = []
    for b in range(256):
        byte = [b, (7 * b + 1) % 256, (13 * b + 5) % 256, (29 * b + 11) % 256]
        out.append((byte, byte[0] | byte[1] << 8 | byte[2] << 16 | byte[3] << 24))
    return out


def _run_ptx(asm: str, word: int, inp: str = "$4", operands: dict[str, int] | None = None) -> list[int]:
    """Evaluate a straight-line PTX decode (mov/and/or/shl/shr/mul/prmt/lop3 on .b32) for one packed
    input word in ``inp`` ($4; $2 for the two-output FP8 decode) and ``operands`` (e.g. $5, $6);
    returns $0..$3 (or $0, $1). The CPU cannot run the inline assembly, so this checks its logic."""
    regs: dict[str, int] = {inp: word, **(operands or {})}
    for stmt in asm.strip().strip("{}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *src = (a.strip() for a in args.split(","))
        v = [regs[a] if a in regs else int(a, 0) for a in src]
        name = op.split(".")[0]
        if name == "mov":
            out = v[0]
        elif name == "and":
            out = v[0] & v[1]
        elif name == "or":
            out = v[0] | v[1]
        elif name == "shl":
            out = (v[0] << v[1]) & 0xFFFFFFFF
        elif name == "shr":
            out = v[0] >> v[1]
        elif name == "mul":  # mul.lo: the low 32 bits, mul.hi: the high
            out = (v[0] * v[1]) >> 32 if ".hi" in op else (v[0] * v[1]) & 0xFFFFFFFF
        elif name == "lop3":  # bit i of the result: bit (a_i << 2 | b_i << 1 | c_i) of the table
            idx = [(v[0] >> i & 1) << 2 | (v[1] >> i & 1) << 1 | (v[2] >> i & 1) for i in range(32)]
            out = sum((v[3] >> j & 1) << i for i, j in enumerate(idx))
        elif name == "prmt":  # bytes {b, a}; per selector nibble: 3 bits pick a byte, bit 3 replicates its sign
            pool, out = v[0] | v[1] << 32, 0
            for i in range(4):
                sel = v[2] >> 4 * i & 0xF
                byte = pool >> 8 * (sel & 7) & 0xFF
                out |= (0xFF * (byte >> 7) if sel & 8 else byte) << 8 * i
        else:
            raise AssertionError(f"unexpected PTX: {stmt}")
        regs[dst] = out
    return [regs[f"${i}"] for i in range(int(inp[1:]))]


@pytest.mark.parametrize("name", ["_FP4_LUT_ASM", "_FP4_LUT_PAIRS_ASM"])
def test_fp4_table_decodes_give_every_e2m1_value_in_bf16(name):
    """Both inline-PTX decodes (run on CUDA only) produce, for every byte value at every byte
    position, the bf16 bits of both nibbles' e2m1 values, packed as Triton's ``pack=4`` expects:
    $0 = (low nibble of byte 0, of byte 1), $1 = (bytes 2, 3), $2/$3 the same for high nibbles."""
    from asympd.model.quant import FP4_TABLE

    bits = [int(b) & 0xFFFF for b in FP4_TABLE.bfloat16().view(torch.int16)]
    asm = getattr(gemm, name).value
    for byte, word in _probe_words():
        lo = [bits[x & 15] for x in byte]
        hi = [bits[x >> 4] for x in byte]
        want = [lo[0] | lo[1] << 16, lo[2] | lo[3] << 16, hi[0] | hi[1] << 16, hi[2] | hi[3] << 16]
        assert _run_ptx(asm, word) == want, (name, byte)


def test_fp4_exponent_decode_gives_every_e2m1_value_times_2_pow_minus_126():
    """The Gluon kernel's table-free decode (``fp4_ptx.FP4_EXP_PAIRS``, CUDA only): for every byte
    value at every byte position, $0..$3 hold bf16 bits that read as the e2m1 values times 2^-126
    (0.5 as bf16's subnormal 2^-127), nibbles paired (0, 4), (2, 6), (1, 5), (3, 7)."""
    from asympd.model.fp4_ptx import FP4_EXP_MULS, FP4_EXP_PAIRS
    from asympd.model.quant import FP4_TABLE

    muls = {"$5": FP4_EXP_MULS[0], "$6": FP4_EXP_MULS[1]}
    for byte, word in _probe_words():
        nib = [word >> 4 * i & 15 for i in range(8)]
        out = _run_ptx(FP4_EXP_PAIRS, word, operands=muls)
        halves = torch.tensor([r >> 16 * h & 0xFFFF for r in out for h in (0, 1)], dtype=torch.int32)
        got = halves.to(torch.int16).view(torch.bfloat16).double() * 2.0**126  # int16 wraps: the same bits
        want = torch.stack([FP4_TABLE[nib[i]].double() for pair in ((0, 4), (2, 6), (1, 5), (3, 7)) for i in pair])
        assert torch.equal(got, want), byte


def test_fp4_split_decode_equals_the_exponent_decode_on_its_layout():
    """``fp4_ptx.FP4_SPLIT_PAIRS`` on a word permuted by ``split_layout`` gives FP4_EXP_PAIRS's
    four outputs on the original word, bit for bit, for every byte value at every byte position
    (and ``split_layout`` moves every bit somewhere: a permutation)."""
    from asympd.model.fp4_ptx import FP4_EXP_MULS, FP4_EXP_PAIRS, FP4_SPLIT_MULS, FP4_SPLIT_PAIRS, split_layout

    exp_muls = {"$5": FP4_EXP_MULS[0], "$6": FP4_EXP_MULS[1]}
    split_muls = {f"${5 + i}": m for i, m in enumerate(FP4_SPLIT_MULS)}
    words = [word for _, word in _probe_words()]
    moved = split_layout(torch.tensor(words, dtype=torch.int64)).tolist()
    for word, new in zip(words, moved, strict=True):
        assert bin(new).count("1") == bin(word).count("1")
        want = _run_ptx(FP4_EXP_PAIRS, word, operands=exp_muls)
        assert _run_ptx(FP4_SPLIT_PAIRS, new, operands=split_muls) == want, hex(word)
    as_int32 = split_layout(torch.tensor(words, dtype=torch.int64).to(torch.int32))  # the kernel's words
    assert (as_int32.to(torch.int64) & 0xFFFFFFFF).tolist() == moved
    single = split_layout(torch.tensor([1 << i for i in range(32)], dtype=torch.int64)).tolist()
    assert sorted(single) == [1 << i for i in range(32)]


def test_split_bytes_permutes_each_threads_word_and_inverts():
    """``split_bytes`` moves the bits of each 4 consecutive bytes (one kernel thread's word, little
    endian) as ``split_layout`` moves a word's, and ``inverse`` gives the bytes back."""
    from asympd.model.fp4_ptx import split_bytes, split_layout

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(-128, 128, (3, 2, 5, 8, 16), dtype=torch.int8, generator=g)
    moved = split_bytes(packed, chunk=7)  # chunks that cut rows: the words are independent
    assert moved.shape == packed.shape and moved.dtype == torch.int8
    word = [int(b) & 0xFF for b in packed[1, 0, 2, 3, 4:8]]
    word = word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24
    got = [int(b) & 0xFF for b in moved[1, 0, 2, 3, 4:8]]
    assert got[0] | got[1] << 8 | got[2] << 16 | got[3] << 24 == split_layout(torch.tensor(word)).item()
    assert torch.equal(split_bytes(moved, inverse=True), packed)
    assert not torch.equal(moved, packed)
    with pytest.raises(ValueError, match="split_bytes: int8 bytes in words of 4"):
        split_bytes(packed[..., :6])


def test_lop3_emulation_follows_ptx_truth_tables():
    """The emulator's LOP3 against the function the table 0xE4 names, (a & c) | (b & ~c)."""
    a, b, c = 0x12345678, 0x9ABCDEF0, 0x1C1C1C1C
    asm = f"{{ lop3.b32 $0, $1, {b}, {c}, 0xE4; }}"
    assert _run_ptx(asm, a, inp="$1") == [(a & c) | (b & ~c & 0xFFFFFFFF)]


def test_fp4_e4m3_decode_gives_every_e2m1_value_times_2_pow_minus_6():
    """e2m1's magnitude bits at e4m3's bits [4:2] and its sign at bit 7 read, as e4m3, the e2m1
    value times 2^-6 for all 16 codes (0.5, e2m1's subnormal, included); and the inline PTX of
    the FP8 kernel (CUDA only) produces those bytes for every byte value at every byte position:
    $0 = the four low nibbles' codes (bytes 0..3), $1 = the high nibbles'."""
    from asympd.model.quant import FP4_TABLE

    codes = torch.tensor([((c & 7) << 2) | ((c & 8) << 4) for c in range(16)], dtype=torch.uint8)
    assert torch.equal(codes.view(torch.float8_e4m3fn).float(), FP4_TABLE * 2.0**-6)
    asm = gemm._FP4_E4M3_ASM.value
    for byte, word in _probe_words():
        want = [sum(int(codes[x >> 4 * h & 15]) << 8 * i for i, x in enumerate(byte)) for h in (0, 1)]
        assert _run_ptx(asm, word, inp="$2") == want, byte


def test_fp8_codes32_is_exact_on_quantized_activations():
    """Re-quantizing the reference's quantize-dequantized activations gives codes whose product
    with the scales is the input bit for bit (fp32 and bf16), including blocks whose amax rounded
    up to the next power of two (449 -> 448 x 2 -> scale 1 on the second pass) and tiny blocks."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-6, 3, 6).unsqueeze(1)
    x[0, :32] = torch.linspace(-449.0, 449.0, 32)
    x[1, 32:64] = 1e-9
    for dt in (torch.float32, torch.bfloat16):
        xq = fp8_qdq(x.to(dt), 32).to(DEVICE)
        codes, s = gemm.fp8_codes32(xq)
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == xq.shape and s.shape == (6, 8)
        back = (codes.float().unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)
        assert torch.equal(back.to(dt), xq) and torch.equal(back, xq.float())
        assert torch.equal(torch.log2(s), torch.log2(s).round())  # powers of two
        # the Triton kernel (what CUDA runs) gives the same codes and scales; on raw input too on
        # CUDA (the interpreter's fp32 -> e4m3 cast does not round across a binade: 1.95 -> 1.0)
        for inp in (xq, x.to(dt).to(DEVICE)) if DEVICE == "cuda" else (xq,):
            c_ref, s_ref = gemm.fp8_codes32(inp.cpu())
            c_k, s_k = gemm.fp8_codes32(inp, kernel=True)
            assert torch.equal(c_k.cpu().view(torch.uint8), c_ref.view(torch.uint8)) and torch.equal(s_k.cpu(), s_ref)


@pytest.mark.parametrize(
    "rows,n,block_m,config",
    [
        (1, 96, 16, {}),  # one row; a partial column block (masked weight loads)
        (13, 128, 16, {"split": 2}),  # split K, whole column blocks
        (50, 96, 32, {"unroll": 4}),
        (13, 128, 32, {"unroll": 1, "split": 3, "block_n": 64}),  # 3 splits of 8 blocks -> 2 of 4
    ],
)
def test_mxfp4_moe_fp8_equals_the_reference(rows, n, block_m, config):
    """The FP8 tensor-core kernel against the float64 GEMM on the dequantized weights, gathered
    and not. On CPU (the interpreter's FP8 dot is exact in fp32) to 1e-6 like the others. On CUDA
    the FP8 wgmma adds one K = 32 block's products with less than fp32's precision inside the
    instruction (Hopper keeps ~14 bits after aligning to the largest term): every output within
    2^-8 of the sum of its terms' magnitudes (32 terms, each off by at most 2^-13 of the largest),
    and 1e-3 in norm; a wrong code, sign or scale is off by O(1)."""
    x, w, sc, blocks, token, ref = _moe_problem(rows, n, block_m, seed=rows + n)
    _, _, _, _, _, mag = _moe_problem(rows, n, block_m, seed=rows + n, magnitude=True)
    r, cfg = token.numel(), {"fp8": True, **config}
    exact = DEVICE == "cpu"
    for xs, a_rows in ((x, token), (x[token], None)):
        y = gemm.mxfp4_moe_gemm(xs, w, sc, blocks, r, block_m, a_rows=a_rows, config=cfg)
        assert y.shape == (r, n) and y.dtype == torch.float32
        assert rel(y, ref) < (1e-6 if exact else 1e-3)
        assert ((y.double() - ref).abs() <= (1e-6 if exact else 2**-8) * mag + 1e-30).all()
        yb = gemm.mxfp4_moe_gemm(xs.bfloat16(), w, sc, blocks, r, block_m, a_rows=a_rows, config=cfg)
        assert yb.dtype == torch.bfloat16
        # bf16 output: the fp32 result rounded once (one ulp for the order)
        assert ((yb.double() - ref).abs() <= 2**-7 * ref.abs() + (0 if exact else 2**-8) * mag).all()


_VARIANTS = {
    "current": {},
    "swap_ab": {"swap_ab": True},
    "swap_ab_per_weight": {"swap_ab": True, "scale_after": False},
    "fp8": {"fp8": True},
}
# The tiled layout changes only the weight and scale addressing (strides, W_STEP/S_STEP; the kernels'
# code is the same), which the K split's offset enters and the M-block does not: every kernel variant
# split and not, and every M-block size (16 to 128) in some variant, not their cross product (20 cases
# of ~5 s each under the interpreter; these 9 take the same branches).
_TILED_CASES = [
    ("current", 7, 16, 1),
    ("current", 50, 32, 2),
    ("current", 90, 128, None),
    ("swap_ab", 1, 16, None),  # scale_after (block_m <= 16)
    ("swap_ab", 7, 16, 2),  # split
    ("swap_ab_per_weight", 7, 16, 1),
    ("swap_ab_per_weight", 50, 32, 2),  # also the default above block_m 16
    ("fp8", 90, 64, 1),
    ("fp8", 50, 32, 2),
]


@pytest.mark.parametrize(
    "rows,block_m,split,cfg",
    [pytest.param(r, bm, sp, _VARIANTS[v], id=f"{r}-{bm}-{sp}-{v}") for v, r, bm, sp in _TILED_CASES],
)
def test_tiled_experts_give_the_row_layouts_result(rows, block_m, split, cfg):
    """``tile_fp4`` holds the same bytes in contiguous [tile, K step] runs; every kernel reads it
    to the bit-identical result of the row layout (same products, same order), gathered or not,
    split or not, every M-block size."""
    x, w, sc, blocks, token, ref = _moe_problem(rows, 96, block_m, seed=rows + block_m)
    wt, st = gemm.tile_fp4(w, sc, 32)
    assert wt.shape == (5, 3, 8, 32, 16) and st.shape == (5, 3, 8, 32)
    assert wt.numel() == w.numel() and st.numel() == sc.numel()  # no extra bytes
    assert torch.equal(wt[2, 1, 3, 5], w[2, 32 + 5, 3 * 16 : 4 * 16]) and st[2, 1, 3, 5] == sc[2, 37, 3]
    wb, sb = gemm.untile_fp4(wt, st)
    assert torch.equal(wb, w) and torch.equal(sb, sc)
    r, conf = token.numel(), {**cfg, "block_n": 32} | ({"split": split} if split else {})
    for xs, a_rows in ((x, token), (x[token], None)):
        for dt in (torch.float32, torch.bfloat16):
            y_rows = gemm.mxfp4_moe_gemm(xs.to(dt), w, sc, blocks, r, block_m, a_rows=a_rows, config=conf)
            y = gemm.mxfp4_moe_gemm(xs.to(dt), wt, st, blocks, r, block_m, a_rows=a_rows, config=conf)
            assert y.shape == (r, 96) and y.dtype == dt and torch.equal(y, y_rows)
            if dt == torch.float32:  # and the reference (the FP8 MMA's in-block sum: its own test's bounds)
                assert rel(y, ref) < (1e-3 if cfg.get("fp8") and DEVICE != "cpu" else 1e-6)
    with pytest.raises(ValueError, match="tiled by 32"):
        gemm.mxfp4_moe_gemm(x, wt, st, blocks, r, block_m, a_rows=token, config={**cfg, "block_n": 64})


@pytest.mark.parametrize(
    "n,block_m,config",
    [
        (96, 16, {}),  # partial column block (masked loads)
        (128, 16, {"split": 2, "unroll": 4}),
        (128, 8, {"unroll": 1, "split": 3}),
        (96, 32, {"unroll": 4, "tile": 32}),  # tiled weights
    ],
)
def test_mxfp4_moe_swap_ab_wide_equals_the_reference(n, block_m, config):
    """``wide``: the whole unrolled step (UNROLL scale blocks, each scaled per weight) as one dot,
    so one activation tile is staged per step: the same products in another order (fp32 to 1e-6,
    bf16 within one ulp of the exact product), gathered or not."""
    x, w, sc, blocks, token, ref = _moe_problem(13, n, block_m, seed=n + 3 * block_m)
    config = dict(config)
    if tile := config.pop("tile", None):
        w, sc = gemm.tile_fp4(w, sc, tile)
        config["block_n"] = tile
    r, cfg = token.numel(), {"swap_ab": True, "wide": True, **config}
    for xs, a_rows in ((x, token), (x[token], None)):
        y = gemm.mxfp4_moe_gemm(xs, w, sc, blocks, r, block_m, a_rows=a_rows, config=cfg)
        assert y.shape == (r, n) and rel(y, ref) < 1e-6
        yb = gemm.mxfp4_moe_gemm(xs.bfloat16(), w, sc, blocks, r, block_m, a_rows=a_rows, config=cfg)
        assert torch.allclose(yb.double(), ref.bfloat16().double(), rtol=2**-7, atol=0)


_SCALED = {
    "scaled": {"scaled": True},
    "scaled_swap": {"scaled_swap": True},
    "scaled_natural": {"scaled": True, "natural": True},
    "scaled_swap_natural": {"scaled_swap": True, "natural": True},
}


def _natural(w: torch.Tensor, cfg: dict) -> torch.Tensor:
    """The weight operand a config reads: with ``natural``, the release's nibble order."""
    return gemm.unrepack_fp4(w) if cfg.get("natural") else w


@pytest.mark.skipif(DEVICE != "cuda", reason="tl.dot_scaled runs on CUDA only (Triton's interpreter has none)")
@pytest.mark.parametrize("variant", ["scaled", "scaled_swap"])
@pytest.mark.parametrize(
    "rows,block_m,tile",
    [(1, 16, None), (16, 16, 32), (300, 32, None), (300, 128, 32), (2500, 128, None), (2500, 64, 32)],
)
def test_mxfp4_moe_scaled_equals_the_default_kernel(variant, rows, block_m, tile):
    """The tl.dot_scaled kernel (Triton's own e2m1 upcast, the weights' nibbles restored to the
    release's order in registers) against the default kernel on the same bf16 operands, gathered and
    not, split K and not, the row layout and the tiled one, the weights' bytes in the kernel's order
    or (``natural``) the release's: both the exact product rounded once to
    bf16 up to fp32 summation order (within one bf16 ulp of the float64 reference each, so within
    two of each other), and no worse on the whole than that rounding."""
    x, w, sc, blocks, token, ref = _moe_problem(rows, 96, block_m, seed=rows + block_m)
    conf = {}
    if tile:
        w, sc = gemm.tile_fp4(w, sc, tile)
        conf["block_n"] = tile
    r, xb = token.numel(), x.bfloat16()
    for split in (1, 2):
        cur = gemm.mxfp4_moe_gemm(xb, w, sc, blocks, r, block_m, a_rows=token, config={**conf, "split": split})
        for xs, a_rows in ((xb, token), (xb[token], None)):
            cfg = {**_SCALED[variant], **conf, "split": split}
            y = gemm.mxfp4_moe_gemm(xs, _natural(w, cfg), sc, blocks, r, block_m, a_rows=a_rows, config=cfg)
            assert y.shape == (r, 96) and y.dtype == torch.bfloat16
            assert torch.allclose(y.double(), ref.bfloat16().double(), rtol=2**-7, atol=0)
            assert torch.allclose(y.double(), cur.double(), rtol=2**-6, atol=0)
            assert rel(y, ref) < 4e-3
        # the release's nibble order (no shuffle in registers): the same values into the same dots
        cfg = {**_SCALED[f"{variant}_natural"], **conf, "split": split}
        yn = gemm.mxfp4_moe_gemm(xb, _natural(w, cfg), sc, blocks, r, block_m, a_rows=token, config=cfg)
        assert torch.allclose(yn.double(), ref.bfloat16().double(), rtol=2**-7, atol=0) and rel(yn, ref) < 4e-3


@pytest.mark.parametrize("variant", list(_SCALED))
@pytest.mark.parametrize(
    "rows,block_m,config",
    [(7, 16, {}), (13, 16, {"split": 2, "block_n": 64}), (50, 32, {"unroll": 4}), (13, 8, {"unroll": 1, "split": 3})],
)
def test_mxfp4_moe_scaled_stand_in_equals_the_reference(variant, rows, block_m, config):
    """What the dot_scaled kernel does around the dot (the weights' nibbles back in the release's
    order, the scale blocks, the gather, M-blocks, whole splits, partial column blocks), checked on
    CPU with the interpreter's stand-in for tl.dot_scaled (its documented semantics: low nibble =
    even K element, one UE8M0 scale per 32 along K): the exact product rounded once to bf16, up to
    fp32 summation order. A wrong nibble or scale order is off by O(1). ``natural``: the weights
    given in the release's order read to the same bits."""
    n = 128 if config.get("block_n") == 64 else 96
    x, w, sc, blocks, token, ref = _moe_problem(rows, n, block_m, seed=rows + 7 * block_m)
    r, xb = token.numel(), x.bfloat16()
    cfg = {**_SCALED[variant], **config, "dot_scaled_stand_in": True}
    for xs, a_rows in ((xb, token), (xb[token], None)):
        y = gemm.mxfp4_moe_gemm(xs, _natural(w, cfg), sc, blocks, r, block_m, a_rows=a_rows, config=cfg)
        assert y.shape == (r, n) and y.dtype == torch.bfloat16
        assert torch.allclose(y.double(), ref.bfloat16().double(), rtol=2**-7, atol=0) and rel(y, ref) < 4e-3
    if cfg.get("natural"):  # the kernel order, restored in registers: the same bits
        kernel_order = {**cfg, "natural": False}
        assert torch.equal(y, gemm.mxfp4_moe_gemm(xs, w, sc, blocks, r, block_m, a_rows=a_rows, config=kernel_order))
    wt, st = gemm.tile_fp4(w, sc, 32)  # the tiled layout: the same result
    cfg_t = {**cfg, "block_n": 32}
    yt = gemm.mxfp4_moe_gemm(xb, _natural(wt, cfg), st, blocks, r, block_m, a_rows=token, config=cfg_t)
    y_rows = gemm.mxfp4_moe_gemm(xb, _natural(w, cfg), sc, blocks, r, block_m, a_rows=token, config=cfg_t)
    assert torch.equal(yt, y_rows)


@pytest.mark.parametrize("variant", ["scaled", "scaled_swap"])
def test_mxfp4_moe_scaled_without_cuda_raises(variant):
    """Requesting a dot_scaled variant on CPU tensors is a clear error, not the interpreter's
    missing-attribute failure; fp32 activations (dot_scaled takes bf16) are one too, and so is the
    release's nibble order for a kernel that reads only its own."""
    x, w, sc, blocks, token, _ = _moe_problem(3, 96, 16, seed=4)
    x, w, sc, token = x.cpu(), w.cpu(), sc.cpu(), token.cpu()
    blocks = [b.cpu() for b in blocks]
    with pytest.raises(RuntimeError, match="tl.dot_scaled variants .* run on CUDA only .* on cpu"):
        gemm.mxfp4_moe_gemm(x.bfloat16(), w, sc, blocks, token.numel(), 16, a_rows=token, config=_SCALED[variant])
    if DEVICE == "cuda":
        x, w, sc, token, blocks = x.cuda(), w.cuda(), sc.cuda(), token.cuda(), [b.cuda() for b in blocks]
    with pytest.raises(TypeError, match="take bf16 activations, got torch.float32"):
        cfg = {**_SCALED[variant], "dot_scaled_stand_in": True}
        gemm.mxfp4_moe_gemm(x, w, sc, blocks, token.numel(), 16, a_rows=token, config=cfg)
    with pytest.raises(ValueError, match="only the tl.dot_scaled variants read the release's nibble order"):
        gemm.mxfp4_moe_gemm(x, w, sc, blocks, token.numel(), 16, a_rows=token, config={"natural": True})


def test_moe_defaults_select_the_variant_process_wide(monkeypatch):
    """``MOE_DEFAULTS`` is how the model runs on one kernel variant: an explicit config still wins."""
    x, w, sc, blocks, token, ref = _moe_problem(7, 96, 16, seed=2)
    r = token.numel()
    calls = []
    real = gemm.fp8_codes32
    monkeypatch.setattr(gemm, "fp8_codes32", lambda a: calls.append(a.shape) or real(a))
    monkeypatch.setattr(gemm, "MOE_DEFAULTS", {"fp8": True})
    y = gemm.mxfp4_moe_gemm(x, w, sc, blocks, r, 16, a_rows=token)
    assert calls == [x.shape] and rel(y, ref) < (1e-6 if DEVICE == "cpu" else 1e-3)
    gemm.mxfp4_moe_gemm(x, w, sc, blocks, r, 16, a_rows=token, config={"fp8": False})
    assert calls == [x.shape]


def test_moe_blocks_cover_every_row_once():
    ids = torch.tensor([3, 0, 3, 3, 1, 3, 0, 3, 3], device=DEVICE)
    order, expert, row0, row1 = gemm.moe_blocks(ids, 4, 2)
    real = expert < 4
    spans = sorted((int(a), int(b), int(e)) for a, b, e in zip(row0[real], row1[real], expert[real], strict=True))
    # expert 0: rows 0-1; expert 1: row 2; expert 3: rows 3..8 in blocks of 2
    assert spans == [(0, 2, 0), (2, 3, 1), (3, 5, 3), (5, 7, 3), (7, 9, 3)]
    assert int((~real).sum()) == len(expert) - 5


def test_packed_role_holds_the_released_bytes(tiny_ckpt):
    """The packed build holds exactly the released-format bytes ``asympd memory`` counts, plus the
    deliberate copies the reference also makes: the LM head (on CPU; a bf16 GPU model keeps it bf16)
    and the drafter's heads in fp32, the
    router gate in fp32 (and its bf16 twin for the fp32-output GEMM), the ratio>1 compressors in
    fp32 (on CPU; a bf16 GPU model keeps them bf16 too, ``ops.linear_f32``), and each attention's
    RoPE frequencies, a few bytes. At V4.1-Flash size
    these add 0.14 % (decode role on a GPU; 0.57 % with the fp32 head) and 0.13 % (prefill role)."""
    cfg = asympd.config.tiny()
    # the Engram tables are resident only on CPU: a GPU build keeps them in host memory
    report = memory_report(cfg, engram_on_gpu=DEVICE == "cpu")["roles"]
    for role in ("prefill", "decode"):
        model = load_model(tiny_ckpt, role, device=DEVICE, dtype=torch.bfloat16, weights="packed", vision=False)
        assert model.weights == "packed"
        layers = [b.layer for b in model.blocks if b is not None and b.ffn is not None]
        extra = sum(cfg.moe_shape(layer)[0] * cfg.dim * 4 for layer in layers)  # gate: fp32 + bf16 copy
        if DEVICE == "cpu":  # the ratio>1 compressors' fp32 weights (wkv, wgate): bf16 on a bf16 GPU model
            extra += sum(2 * cfg.head_dim * cfg.dim * 2 for layer in cfg.kv_source_layers if cfg.ratio(layer) > 1)
        attns = [b for b in model.blocks if b is not None]
        attns += list(model.drafter.blocks) if model.head is not None else []
        extra += len(attns) * cfg.rope_head_dim // 2 * 4  # each attention's RoPE frequencies (fp32)
        if model.head is not None:
            extra += cfg.vocab_size * cfg.dim * 2 if model.head.dtype == torch.float32 else 0  # bf16 on CUDA
            drafts = model.drafter.blocks
            extra += sum(cfg.moe_shape(b.layer)[0] * cfg.dim * 4 for b in drafts)
            # the drafter's Markov and confidence heads are held in fp32 like the LM head
            extra += (model.drafter.markov_head.numel() + model.drafter.confidence_proj.numel()) * 2
        assert model.resident_bytes() == report[role]["resident_bytes"] + extra, role
        # packed-experts (the CUDA default) expands only the FP8 matrices to bf16
        fp8 = [m for m in _modules(model) if isinstance(m, FP8TileLinear)]
        expanded = sum(m.weight.numel() - m.scale.numel() for m in fp8)
        mixed = load_model(tiny_ckpt, role, device=DEVICE, dtype=torch.bfloat16, weights="packed-experts", vision=False)
        assert fp8 and not any(isinstance(m, FP8TileLinear) for m in _modules(mixed))
        assert mixed.resident_bytes() == model.resident_bytes() + expanded, role


def _modules(model):
    mods = [m for b in model.blocks if b is not None for m in b.modules()]
    return mods + (list(model.drafter.modules()) if getattr(model, "drafter", None) is not None else [])


def test_weights_layout_names():
    from asympd.model.loader import resolve_weights

    assert resolve_weights("auto", torch.device("cpu")).name == "dequantized"
    assert resolve_weights("packed-experts", torch.device("cpu")).experts
    assert not resolve_weights("reference", torch.device("cuda")).kernels  # what expert parallelism shards
    with pytest.raises(
        ValueError, match="weights must be auto or one of dequantized, packed-experts, packed, reference"
    ):
        resolve_weights("fp4", torch.device("cpu"))


@pytest.mark.parametrize(
    "mode,weights,moe,fp8",
    [
        ("colocated", "packed", {}, {}),
        ("asymmetric", "packed", {}, {}),
        ("asymmetric", "packed-experts", {}, {}),
        # the transposed FP8-tile kernel (the CUDA default for <= 256 rows) on every FP8 matrix
        ("asymmetric", "packed", {}, {"swap_ab": True}),
        # not the opt-in FP8 variant ({"fp8": True}): on the H200 it gave another first token on one
        # prompt (bench/results/test_packed_fp8_cuda_b118c33.log): FP8 wgmma does not add a 32-K block
        # in full fp32, and this fp32 check allows summation order only; its GEMM tests bound its error
    ],
    ids=["colocated-packed", "asymmetric-packed", "asymmetric-packed-experts", "asymmetric-packed-fp8-swap"],
)
def test_packed_weights_give_the_reference_tokens(tiny_ckpt, mode, weights, moe, fp8, monkeypatch):
    """Greedy tokens and logprobs in fp32 with packed weights against the same device's dequantized
    weights (on CPU: the reference; on CUDA the rest of the path is the same kernels, so this isolates
    the packing; tests/model/test_cuda.py compares CUDA with the CPU reference). The two sum in
    different orders, and the tiny random model turns a last-bit difference into another token
    whenever it moves a value across an FP8/FP4 quantization step (docs/performance.md §1 measures that
    sensitivity; seen here: one prompt of six whose prefill moves its logprobs by 0.08, and on some
    CPUs flips its first token, whose two candidates the reference puts 0.017 nats apart): so the
    first token of every prompt must match or be the reference's runner-up within 0.1 nats, and at
    least 5 of the 6 prompts must match in every token and every logprob to 1e-4. A wrong kernel
    changes nearly all of them. ``moe``: the expert GEMMs' kernel variant
    (``gemm_kernels.MOE_DEFAULTS``) for the packed model; ``fp8``: the FP8-tile GEMMs'
    (``gemm_kernels.FP8_DEFAULTS``)."""
    prompts = random_prompts([40, 9, 21, 64, 17, 100], seed=3)
    sp = asympd.SamplingParams(max_tokens=5, temperature=0, logprobs=2)
    outs = {}
    swaps = []
    real_swap = gemm._fp8_tile_swap
    monkeypatch.setattr(gemm, "_fp8_tile_swap", lambda *args: swaps.append(args[0].shape) or real_swap(*args))
    for name in ("dequantized", weights):
        monkeypatch.setattr(gemm, "MOE_DEFAULTS", moe if name == weights else {})
        monkeypatch.setattr(gemm, "FP8_DEFAULTS", fp8 if name == weights else {})
        llm = asympd.LLM(tiny_ckpt, mode=mode, device=DEVICE, dtype=torch.float32, weights=name)
        outs[name] = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    # the transposed FP8-tile kernel ran every FP8 matrix exactly where it was asked for
    assert bool(swaps) == fp8.get("swap_ab", False)
    agree = 0
    for ref, got in zip(outs["dequantized"], outs[weights], strict=True):
        a, b = ref.outputs[0], got.outputs[0]
        if a.token_ids[0] != b.token_ids[0]:  # only a near-tie may flip: the runner-up within 0.1 nats
            first = a.logprobs[0]
            assert first[a.token_ids[0]] - first.get(b.token_ids[0], -1e9) < 0.1, (first, b.token_ids[0])
        close = all(
            la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)
            for la, lb in zip(a.logprobs, b.logprobs, strict=True)
        )
        agree += a.token_ids == b.token_ids and close
    assert agree >= 5, agree


def test_tiled_experts_hold_the_same_bytes_and_give_the_same_tokens(tiny_ckpt, monkeypatch):
    """``packed.TILE_N``: the loader stacks the experts in the tiled layout. The model then holds
    the same bytes (the same ``resident_bytes()``, each operand the row layout's permuted) and, since
    every kernel reads it to the bit-identical result, generates the same tokens and logprobs."""
    import asympd.model.packed as packed_mod

    def experts(model):
        return [
            e
            for m in _modules(model)
            for e in (getattr(m, "w13", None), getattr(m, "w2f", None))
            if isinstance(e, packed_mod.PackedExperts)
        ]

    prompts = random_prompts([40, 9, 21], seed=5)
    sp = asympd.SamplingParams(max_tokens=4, temperature=0, logprobs=2)
    built, outs = {}, {}
    for tile in (0, 128):
        monkeypatch.setattr(packed_mod, "TILE_N", tile)
        built[tile] = load_model(
            tiny_ckpt, "decode", device=DEVICE, dtype=torch.float32, weights="packed", vision=False
        )
        llm = asympd.LLM(tiny_ckpt, mode="colocated", device=DEVICE, dtype=torch.float32, weights="packed")
        outs[tile] = [
            (o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        ]
    rows, tiled = experts(built[0]), experts(built[128])
    assert rows and len(rows) == len(tiled)
    assert all(e.weight.dim() == 3 for e in rows) and all(e.weight.dim() == 5 for e in tiled)
    for r, t in zip(rows, tiled, strict=True):
        assert (r.nbytes(), r.in_features) == (t.nbytes(), t.in_features)
        w, s = gemm.untile_fp4(t.weight, t.scale)
        assert torch.equal(w, r.weight) and torch.equal(s, r.scale)
        assert torch.equal(t.dequantized(1), r.dequantized(1))
    assert built[128].resident_bytes() == built[0].resident_bytes()
    assert outs[128] == outs[0]


def test_moe_block_m_follows_the_measured_sweep():
    # V4.1's 384 experts, top-6: the fastest M-block measured at each step size (moe_blockm_ac1eaf7,
    # layers_v4, moe_subtiles_gemms): 16 rows up to 512 tokens, 32 at 1024-1152, 64 at 2048-3072,
    # then 128
    from asympd.model.packed import moe_block_m

    got = {t: moe_block_m(6 * t, 384) for t in (1, 256, 512, 1024, 1152, 1536, 2048, 3072, 4096, 8192, 16384)}
    want = {1: 16, 256: 16, 512: 16, 1024: 32, 1152: 32, 1536: 32, 2048: 64, 3072: 64, 4096: 128, 8192: 128}
    assert got == want | {16384: 128}


def test_packed_experts_ask_for_the_table_free_decode_only_where_their_scales_allow(monkeypatch):
    """``PackedExperts`` checks its scales once (every one <= 128: the decode's multiplier 2^(s - 1)
    must be a bf16) and, while ``packed.EXPONENT_DECODE`` is on, asks the Gluon kernel for the
    table-free decode under any config the caller gives; the caller's own choice wins."""
    from asympd.model import packed as packed_mod

    w = torch.zeros(2, 128, 32, dtype=torch.int8)
    small = packed_mod.PackedExperts(w, torch.full((2, 128, 2), 128, dtype=torch.uint8))
    large = packed_mod.PackedExperts(w, torch.full((2, 128, 2), 120, dtype=torch.uint8))
    large.scale[1, 5, 1] = 129
    large = packed_mod.PackedExperts(large.weight, large.scale)
    assert small.exponent_decode and not large.exponent_decode
    assert small.tiled(128).exponent_decode  # kept when tiled (the same bytes)
    seen = []
    monkeypatch.setattr(packed_mod.G, "mxfp4_moe_gemm", lambda *a: seen.append(a[-1]))
    monkeypatch.setattr(packed_mod, "EXPONENT_DECODE", True)
    small.matmul(None, (), 0, 16, None)
    small.matmul(None, (), 0, 16, None, {"wgmma_config": {"exponent_decode": False, "stages": 3}})
    large.matmul(None, (), 0, 16, None, {"wgmma": True})
    monkeypatch.setattr(packed_mod, "EXPONENT_DECODE", False)
    small.matmul(None, (), 0, 16, None)
    assert seen == [
        {"wgmma_config": {"exponent_decode": True}},
        {"wgmma_config": {"exponent_decode": False, "stages": 3}},
        {"wgmma": True},
        {},
    ]


def test_split_layout_experts_hold_the_same_values_and_give_any_kernel_the_same_product(monkeypatch):
    """``PackedExperts.split_layout`` permutes the bytes for the Gluon kernel's split decode: the
    same values (``dequantized``), the same bytes counted; the Gluon kernel is asked for
    ``split_layout`` where it takes the operands, and any other kernel (here Triton's, interpreted)
    reads the usual bytes back: the same product, bit for bit. Experts it cannot take are refused."""
    from asympd.model import packed as packed_mod

    g = torch.Generator().manual_seed(11)
    n_exp, n, k, topk, rows = 3, 128, 64, 2, 9
    parts = [quant_fp4(torch.randn(n, k, generator=g)) for _ in range(n_exp)]
    usual = packed_mod.PackedExperts.stack(parts, torch.device(DEVICE), tile_n=128, split=False)
    split = packed_mod.PackedExperts.stack(parts, torch.device(DEVICE), tile_n=128, split=True)
    assert split.split and not usual.split and split.exponent_decode
    assert not torch.equal(split.weight, usual.weight) and torch.equal(split.usual_weight(), usual.weight)
    assert split.nbytes() == usual.nbytes() and torch.equal(split.scale, usual.scale)
    for e in range(n_exp):
        assert torch.equal(split.dequantized(e), usual.dequantized(e))
    x = fp8_qdq(torch.randn(rows, k, generator=g), 32).to(DEVICE)
    flat = torch.stack([torch.randperm(n_exp, generator=g)[:topk] for _ in range(rows)]).reshape(-1).to(DEVICE)
    order, *blocks = gemm.moe_blocks(flat, n_exp, 16)
    got = split.matmul(x, tuple(blocks), flat.numel(), 16, order // topk)
    assert torch.equal(got, usual.matmul(x, tuple(blocks), flat.numel(), 16, order // topk))
    seen = []
    monkeypatch.setattr(packed_mod.G, "takes_wgmma", lambda *a: True)
    monkeypatch.setattr(packed_mod.G, "mxfp4_moe_gemm", lambda *a: seen.append((a[1], a[-1])))
    split.matmul(x, tuple(blocks), flat.numel(), 16, None, {"wgmma_config": {"stages": 3}})
    assert seen[0][0] is split.weight and seen[0][1] == {"wgmma_config": {"split_layout": True, "stages": 3}}
    with pytest.raises(ValueError, match="already split"):
        split.split_layout()
    with pytest.raises(ValueError, match="tiled experts the exponent decode takes"):
        packed_mod.PackedExperts.stack(parts, torch.device(DEVICE), tile_n=0, split=True)
    large = packed_mod.PackedExperts(usual.weight, usual.scale.clone().fill_(129))
    with pytest.raises(ValueError, match="tiled experts the exponent decode takes"):
        large.split_layout()
    assert not packed_mod.PackedExperts.stack(parts, torch.device("cpu")).split  # the default: Hopper only
