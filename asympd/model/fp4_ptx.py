"""PTX shared by the Triton and Gluon MXFP4 kernels (gemm_kernels, moe_gluon): e2m1 -> bf16 by PRMT
table lookup, four packed bytes -> $0,$1 the low-nibble values (pairs), $2,$3 the high-nibble ones
(see ``gemm_kernels`` for how it works)."""

import torch

# the lookup's four table words: bf16 high bytes (th0, th1) and low bytes (tl0, tl1) of the eight
# magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_LUT_TABLE = (0x3F3F3F00, 0x40404040, 0xC0800000, 0xC0804000)

_DECODE = (
    "and.b32 m, $4, 0x77777777;\n"
    "shr.u32 n, m, 16;\n"
    "prmt.b32 h0, th0, th1, m;\n"
    "prmt.b32 l0, tl0, tl1, m;\n"
    "prmt.b32 h1, th0, th1, n;\n"
    "prmt.b32 l1, tl0, tl1, n;\n"
    "shl.b32 u, $4, 4;\n"
    "prmt.b32 s0, u, $4, 0xD9C8;\n"
    "prmt.b32 s1, u, $4, 0xFBEA;\n"
    "and.b32 s0, s0, 0x80808080;\n"
    "or.b32 h0, h0, s0;\n"
    "and.b32 s1, s1, 0x80808080;\n"
    "or.b32 h1, h1, s1;\n"
    "prmt.b32 $0, l0, h0, 0x6240;\n"
    "prmt.b32 $1, l1, h1, 0x6240;\n"
    "prmt.b32 $2, l0, h0, 0x7351;\n"
    "prmt.b32 $3, l1, h1, 0x7351;\n"
    "}"
)
FP4_LUT_PAIRS = (
    "{ .reg .b32 m, n, u, h0, l0, h1, l1, s0, s1, th0, th1, tl0, tl1;\n"
    + "".join(f"mov.b32 {r}, 0x{v:08X};\n" for r, v in zip(("th0", "th1", "tl0", "tl1"), FP4_LUT_TABLE, strict=True))
    + _DECODE
)
# the same decode with the table as operands $5-$8 (registers the kernel loads once): where the
# table is an immediate, ptxas keeps it in uniform registers and copies it into vector registers
# before every lookup (PRMT reads its table from vector registers), ~30 moves a K-step
FP4_LUT_PAIRS_TABLE_IN = "{ .reg .b32 m, n, u, h0, l0, h1, l1, s0, s1;\n" + _DECODE.replace(
    "th0, th1", "$5, $6"
).replace("tl0, tl1", "$7, $8")

# e2m1 -> bf16 without a table (the Gluon kernel's ``exponent_decode``): an e2m1 code s e1 e0 m put
# at bf16's bits 15 (sign) and 8..6 (e1 e0 in the exponent field's two lowest bits, m the
# mantissa's top bit) reads as the e2m1 value times 2^-126 for all 16 codes: for e >= 1 the
# exponent is e - 127 against e2m1's e - 1, for e = 0 the mantissa bit is bf16's subnormal 2^-127
# against e2m1's 0.5. The scale multiply that follows then takes 2^(s - 1) instead of 2^(s - 127).
# A multiply by 2^6 + 2^12 puts two copies of a nibble (at bits 0..3 of a half-word) at bits 6..9
# and 12..15, and the mask keeps the magnitude of the first and the sign of the second: three
# instructions a register, the nibbles paired i with i + 4 (so the kernel's K order differs from
# the table decode's). Inputs: $4 the four packed bytes, $5 and $6 the multipliers (FP4_EXP_MULS,
# from registers: as immediates ptxas turns half the multiplies into LEAs, which issue on the
# ALU pipe with the rest of the decode, where IMAD issues on the FMA pipe); outputs $0 = (nibble
# 0, 4), $1 = (2, 6), $2 = (1, 5), $3 = (3, 7): the low nibbles' pairs first, as in FP4_LUT_PAIRS.
FP4_EXP_MULS = (0x1040, 0x104)
FP4_EXP_PAIRS = (
    "{ .reg .b32 a, b, c, d, f;\n"
    "and.b32 a, $4, 0x000F000F;\n"
    "mul.lo.u32 a, a, $5;\n"
    "and.b32 $0, a, 0x81C081C0;\n"
    "and.b32 b, $4, 0x00F000F0;\n"
    "mul.lo.u32 b, b, $6;\n"
    "and.b32 $2, b, 0x81C081C0;\n"
    "shr.b32 c, $4, 8;\n"
    "and.b32 d, c, 0x000F000F;\n"
    "mul.lo.u32 d, d, $5;\n"
    "and.b32 $1, d, 0x81C081C0;\n"
    "and.b32 f, c, 0x00F000F0;\n"
    "mul.lo.u32 f, f, $6;\n"
    "and.b32 $3, f, 0x81C081C0;\n"
    "}"
)

# The same values from fewer ALU instructions (the Gluon kernel's ``split_layout``): the
# decode above spends 8 LOP3s and a shift a packed word on the ALU pipe, the busiest one in the
# expert GEMM at 1-2K tokens (docs/performance.md §9). With the word's 32 bits permuted once at
# load, each of FP4_EXP_PAIRS's outputs can be a shift and a mask: output o takes its value bits
# (m, e0, e1, s) of each half-word from FP4_SPLIT_POS[o], output 0 already in place (a mask), 1 and
# 2 shifted left by 3 and 6 (multiplies: the FMA pipe), 3 shifted right by 8 (mul.hi) and spread by
# 2 + 2^6 + 2^12 after isolating its bits. 5 LOP3s a word instead of 8 + 1 shift; the same 4
# multiplies. Inputs: $4 the word in this layout (``split_layout``), $5..$8 FP4_SPLIT_MULS; outputs
# as FP4_EXP_PAIRS's, bit for bit.
FP4_SPLIT_POS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (13, 14, 10, 11))
FP4_EXP_NIBBLE = (0, 8, 4, 12)  # where FP4_EXP_PAIRS's output o finds its nibble in a half-word
FP4_SPLIT_MULS = (8, 64, 1 << 24, 0x1042)
FP4_SPLIT_PAIRS = (
    "{ .reg .b32 a, b, c;\n"
    "and.b32 $0, $4, 0x81C081C0;\n"
    "mul.lo.u32 a, $4, $5;\n"
    "and.b32 $1, a, 0x81C081C0;\n"
    "mul.lo.u32 b, $4, $6;\n"
    "and.b32 $2, b, 0x81C081C0;\n"
    "mul.hi.u32 c, $4, $7;\n"
    "and.b32 c, c, 0x006C006C;\n"
    "mul.lo.u32 c, c, $8;\n"
    "and.b32 $3, c, 0x81C081C0;\n"
    "}"
)


def _move_bits(words: torch.Tensor, inverse: bool) -> torch.Tensor:
    out = torch.zeros_like(words)
    for nibble, pos in zip(FP4_EXP_NIBBLE, FP4_SPLIT_POS, strict=True):
        for half in (0, 16):
            for bit, p in enumerate(pos):
                src, dst = nibble + half + bit, p + half
                if inverse:
                    src, dst = dst, src
                out |= ((words >> src) & 1) << dst
    return out


def split_layout(words: torch.Tensor) -> torch.Tensor:
    """Packed words (int32 or int64, FP4_EXP_PAIRS's layout) -> the same bits in FP4_SPLIT_PAIRS's
    layout."""
    return _move_bits(words, inverse=False)


def unsplit_layout(words: torch.Tensor) -> torch.Tensor:
    """``split_layout``'s inverse."""
    return _move_bits(words, inverse=True)


def split_bytes(packed: torch.Tensor, inverse: bool = False, chunk: int = 1 << 24) -> torch.Tensor:
    """Packed FP4 bytes (int8, the last dim a multiple of 4: each 4 bytes one decode's word, as a
    kernel thread loads them) -> a new tensor in FP4_SPLIT_PAIRS's layout (``inverse``: back), in
    chunks of ``chunk`` words so that the temporaries stay small beside a layer's experts."""
    if packed.dtype != torch.int8 or packed.size(-1) % 4:
        raise ValueError(f"split_bytes: int8 bytes in words of 4, got {packed.dtype} {tuple(packed.shape)}")
    words = packed.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(words)
    for w0 in range(0, words.numel(), chunk):
        out[w0 : w0 + chunk] = _move_bits(words[w0 : w0 + chunk], inverse)
    return out.view(torch.int8).reshape(packed.shape)
