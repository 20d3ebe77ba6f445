"""The checkpoint's quantized formats against hand-computed values."""

import pytest
import torch

from asympd.model.quant import (
    E2M1_VALUES,
    dequant_fp4,
    dequant_fp8_rows,
    dequant_fp8_tiles,
    e2m1_codes,
    fp4_qdq,
    fp8_qdq,
    pack_fp4,
    pow2_scale,
    quant_fp4,
    quant_fp8_rows,
    quant_fp8_tiles,
    to_e4m3,
    unpack_fp4,
)


def test_pow2_scale_is_ceil_log2():
    amax = torch.tensor([448.0, 449.0, 896.0, 1.0, 224.0, 6.0, 3.0])
    got = pow2_scale(amax, 448.0)
    # 448/448 = 1 -> 2^0; 449/448 just above 1 -> 2^1; 1/448 = 2^-8.8 -> 2^-8; 224/448 = 2^-1
    assert got.tolist() == [1.0, 2.0, 2.0, 2.0**-8, 0.5, 2.0**-6, 2.0**-7]
    assert pow2_scale(torch.tensor([3.0, 6.0, 6.5]), 6.0).tolist() == [0.5, 1.0, 2.0]


@pytest.mark.parametrize(
    "value, code",
    [
        (0.0, 0),
        (0.5, 1),
        (1.0, 2),
        (1.5, 3),
        (2.0, 4),
        (3.0, 5),
        (4.0, 6),
        (6.0, 7),
        # exact ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
        # 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0
        (0.25, 0),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),
        # off-tie values round to nearest
        (0.3, 1),
        (1.3, 3),
        (2.6, 5),
        (5.1, 7),
        # sign in bit 3
        (-0.5, 9),
        (-0.75, 10),
        (-6.0, 15),
    ],
)
def test_e2m1_codes(value, code):
    assert e2m1_codes(torch.tensor([value])).item() == code


def test_e2m1_table_and_negative_zero():
    assert unpack_fp4(torch.tensor([0x10, 0x98, 0xF7], dtype=torch.uint8).view(torch.int8)).tolist() == [
        0.0,
        0.5,
        -0.0,
        -0.5,
        6.0,
        -6.0,
    ]
    assert e2m1_codes(torch.tensor([-0.0])).item() == 8


def test_pack_nibble_order_even_element_low():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x43]]
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, 1.5, 2.0]]


def test_quant_fp4_hand_example():
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([3.0, -1.5, 0.75])
    w[0, 5] = 1.2  # /0.5 = 2.4 -> 2.0 -> 1.0
    packed, scale = quant_fp4(w)
    # amax 3 -> scale 2^ceil(log2(3/6)) = 0.5; w/s = [6, -3, 1.5] -> codes [7, 8|5, 3]
    assert scale.shape == (1, 1) and scale.dtype == torch.float8_e8m0fnu
    assert scale.view(torch.uint8).item() == 127 - 1
    b = packed.view(torch.uint8)[0].tolist()
    assert b[0] == 7 | (13 << 4) and b[1] == 3
    assert b[2] == 4 << 4  # element 5 (odd) in the high nibble: code 4 = 2.0
    assert dequant_fp4(packed, scale)[0, :6].tolist() == [3.0, -1.5, 0.75, 0.0, 0.0, 1.0]


def test_fp4_round_trip_on_grid():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 64), generator=gen, dtype=torch.uint8)
    codes[:, 0] = 7  # each 32-block holds a +-6 so the scale is exactly 2^k
    codes[:, 32] = 15
    exps = torch.tensor([[-3.0, 2.0], [0.0, -7.0], [5.0, 1.0], [-1.0, 0.0]])
    values = unpack_fp4(pack_fp4(codes)) * torch.pow(2.0, exps).repeat_interleave(32, 1)
    packed, scale = quant_fp4(values)
    assert torch.equal(scale.float(), torch.pow(2.0, exps))
    assert torch.equal(dequant_fp4(packed, scale), values)


def test_e4m3_round_to_nearest_even_and_saturation():
    x = torch.tensor([17.0, 19.0, 0.55, 448.0, 449.0, 1000.0, -1e6])
    # [16, 32) steps by 2: 17 ties to 16 (even mantissa), 19 to 20; 0.55 -> 0.5625 (step 1/16)
    assert to_e4m3(x).float().tolist() == [16.0, 20.0, 0.5625, 448.0, 448.0, 448.0, -448.0]


def test_fp8_tile_scales():
    w = torch.zeros(40, 33)
    w[0, 0] = 1.0  # tile (0, 0): amax 1 -> 2^ceil(log2(1/448)) = 2^-8
    w[5, 32] = -448.0  # tile (0, 1): amax 448 -> 2^0
    w[33, 3] = 449.0  # tile (1, 0): amax 449 -> 2^1
    # tile (1, 1) all zero: amax floored at 1e-4 -> 2^ceil(log2(1e-4/448)) = 2^-22
    q, s = quant_fp8_tiles(w)
    assert q.shape == (40, 33) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (2, 2) and s.dtype == torch.float8_e8m0fnu
    assert s.float().tolist() == [[2.0**-8, 1.0], [2.0, 2.0**-22]]
    assert q[0, 0].float().item() == 256.0 and q[5, 32].float().item() == -448.0
    assert q[33, 3].float().item() == 224.0  # 449 / 2 = 224.5 -> 224 (step 16 above 128: 224 = 7 * 32)
    deq = dequant_fp8_tiles(q, s)
    assert deq[0, 0].item() == 1.0 and deq[5, 32].item() == -448.0 and deq[33, 3].item() == 448.0


def test_fp8_tiles_round_trip_on_grid():
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (64, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # drop NaN encodings
    grid = raw.view(torch.float8_e4m3fn).float()
    for r in (0, 32):
        for c in (0, 32):
            grid[r, c] = 448.0  # tile amax exactly 448 * 2^k
    exps = torch.tensor([[-4.0, 3.0], [0.0, -10.0]])
    w = grid * torch.pow(2.0, exps).repeat_interleave(32, 0).repeat_interleave(32, 1)
    q, s = quant_fp8_tiles(w)
    assert torch.equal(s.float(), torch.pow(2.0, exps))
    assert torch.equal(dequant_fp8_tiles(q, s), w)


def test_fp8_rows():
    w = torch.zeros(2, 64)
    w[0, 0], w[0, 40], w[1, 63] = 3.0, 0.25, -448.0
    q, s = quant_fp8_rows(w)
    # row 0: block 0 amax 3 -> 2^ceil(log2(3/448)) = 2^-7; block 1 amax 0.25 -> 2^-10
    assert s.shape == (2, 2) and s.float().tolist() == [[2.0**-7, 2.0**-10], [2.0**-22, 1.0]]
    assert q[0, 0].float().item() == 384.0 and q[0, 40].float().item() == 256.0
    assert torch.equal(dequant_fp8_rows(q, s), w)


def test_fp8_qdq_per_32_blocks():
    x = torch.zeros(64)
    x[0], x[1], x[2] = 1.0, 0.3, -0.017  # block amax 1 -> scale 2^-8
    x[32] = 1000.0  # block amax 1000 -> 2^ceil(log2(1000/448)) = 4
    x[33] = 17.0
    y = fp8_qdq(x)
    # 0.3 * 256 = 76.8 -> 80 (step 8 in [64, 128)); -0.017 * 256 = -4.352 -> -4.5 (step 0.5 in [4, 8))
    assert y[:3].tolist() == [1.0, 80 / 256, -4.5 / 256]
    # 1000 / 4 = 250 -> 256 (step 16 in [128, 256)); 17 / 4 = 4.25 ties between 4 and 4.5 -> 4 (even)
    assert y[32].item() == 1024.0 and y[33].item() == 16.0
    assert y.dtype == x.dtype


def test_fp4_qdq_ue8m0_variant():
    x = torch.zeros(32)
    x[0], x[1], x[2] = 3.3, -0.8, 0.25
    y = fp4_qdq(x)
    # amax 3.3 -> scale 2^ceil(log2(3.3/6)) = 1: 3.3 -> 3, -0.8 -> -1 (nearest), 0.25 -> 0 (tie to even)
    assert y[:3].tolist() == [3.0, -1.0, 0.0]


def test_fp4_qdq_e4m3_scaled_variant():
    x = torch.zeros(32)
    x[0], x[1] = 3.3, 1.0  # block 0 (16 wide): scale e4m3(3.3 / 6 = 0.55) = 0.5625
    x[16] = 6.0  # block 1: scale e4m3(1) = 1
    x[17] = 2.5  # tie between 2 and 3 -> 2
    y = fp4_qdq(x, block=16, e4m3_scale=True)
    s = 0.5625
    # 3.3 / s = 5.87 -> 6 ; 1.0 / s = 1.78 -> 2
    assert y[0].item() == 6 * s and y[1].item() == 2 * s
    assert y[16].item() == 6.0 and y[17].item() == 2.0
    # an all-zero block keeps a nonzero scale (amax floored at 6 * 2^-9) and returns zeros
    assert fp4_qdq(torch.zeros(16), block=16, e4m3_scale=True).tolist() == [0.0] * 16


def test_e2m1_values_constant():
    assert E2M1_VALUES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
