"""The checkpoint's quantized formats and the activation quantization the reference applies.

Weights: FP8 e4m3 with one UE8M0 (power-of-two) scale per 32x32 tile; routed experts as packed FP4
(two e2m1 codes per int8 byte, even K element in the low nibble) with one UE8M0 scale per 32 K
elements; Engram tables as FP8 rows with per-32 UE8M0 scales.

Activations (the reference kernels, reproduced elementwise so they are bit-exact):
- ``fp8_qdq``: per-32 FP8 with a power-of-two scale ``2^ceil(log2(amax/448))`` (amax floored at
  1e-4), before every FP8/FP4 GEMM and on the sliding-window KV;
- ``fp4_qdq``: per-32 FP4 with a UE8M0 scale for indexer queries and keys, per-16 FP4 with an E4M3
  scale ``e4m3(amax/6)`` for the compressed main KV.

Every dequantized weight is exact in bf16 (e4m3 and e2m1 carry at most 3 mantissa bits and the
scales are powers of two), so a GEMM on dequantized weights and quantize-dequantized activations
equals the reference's block-scaled GEMM up to summation order.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
FP4_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])  # indexed by the 4-bit code, bit 3 = sign
# round-to-nearest-even boundaries between consecutive magnitudes; an exact tie rounds up only
# when the upper code is even (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0)
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A lookup table on ``device``: the CPU original on CPU, else one cached copy per device (so a
    CUDA graph capture never meets a host-to-device copy after the first call)."""
    if device.type == "cpu":
        return t
    key = (id(t), device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = t.to(device)
    return _ON_DEVICE[key]


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax / qmax)) in fp32, computed on the exponent bits as the kernels do
    (multiplying by the fp32 reciprocal of qmax, not dividing)."""
    x = (amax.float() * torch.tensor(1.0 / qmax, dtype=torch.float32)).contiguous()
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & ((1 << 23) - 1)
    ceil_log2 = exponent - 127 + (mantissa != 0).to(torch.int32)
    return ((ceil_log2 + 127) << 23).view(torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3, round to nearest even, saturating at +-448 like the kernels' satfinite cast
    (explicit: what a plain cast does with out-of-range values differs across torch versions)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> 4-bit e2m1 codes (uint8, bit 3 = sign), round to nearest even."""
    mag = x.abs().unsqueeze(-1)
    mids, tie_up = _on(_E2M1_MIDS, x.device), _on(_E2M1_TIE_UP, x.device)
    code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


# ---- weights ----------------------------------------------------------------------------------


def dequant_fp8_tiles(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e4m3 [R, C] with UE8M0 tiles [ceil(R/b), ceil(C/b)] -> fp32 [R, C]."""
    rows, cols = weight.shape
    s = scale.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * s


def quant_fp8_tiles(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] -> (e4m3 [R, C], UE8M0 [ceil(R/b), ceil(C/b)]), one power-of-two scale per tile."""
    rows, cols = w.shape
    pr, pc = -rows % block, -cols % block
    wp = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
    tiles = wp.unflatten(0, (-1, block)).unflatten(-1, (-1, block))  # [Rb, b, Cb, b]
    s = pow2_scale(tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4), FP8_MAX)
    q = to_e4m3(tiles / s[:, None, :, None]).flatten(2, 3).flatten(0, 1)[:rows, :cols]
    return q.contiguous(), s.to(torch.float8_e8m0fnu)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., K/2] -> fp32 e2m1 values [..., K]; the low nibble holds the even element."""
    b = packed.view(torch.uint8)
    table = _on(FP4_TABLE, b.device)
    vals = torch.stack([table[(b & 0x0F).long()], table[(b >> 4).long()]], dim=-1)
    return vals.flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [..., K] -> int8 [..., K/2] (even element in the low nibble)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().view(torch.int8)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Packed FP4 [N, K/2] with UE8M0 [N, K/block] -> fp32 [N, K]."""
    return unpack_fp4(packed) * scale.float().repeat_interleave(block, -1)


def quant_fp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (packed int8 [N, K/2], UE8M0 [N, K/block])."""
    g = w.float().unflatten(-1, (-1, block))
    s = pow2_scale(g.abs().amax(-1).clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    codes = e2m1_codes((g / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return pack_fp4(codes), s.to(torch.float8_e8m0fnu)


def dequant_fp8_rows(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Engram table rows: e4m3 [R, D] with UE8M0 [R, D/block] -> fp32."""
    return (weight.float().unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)).flatten(-2)


def quant_fp8_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = w.float().unflatten(-1, (-1, block))
    s = pow2_scale(g.abs().amax(-1).clamp_min(1e-4), FP8_MAX)
    return to_e4m3(g / s.unsqueeze(-1)).flatten(-2), s.to(torch.float8_e8m0fnu)


# ---- activations (quantize, then dequantize back: what the next op consumes) -----------------


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per-``block`` FP8 with power-of-two scales, returned dequantized in x's dtype."""
    g = x.float().unflatten(-1, (-1, block))
    s = pow2_scale(g.abs().amax(-1).clamp_min(1e-4), FP8_MAX).unsqueeze(-1)
    return (to_e4m3(g / s).float() * s).flatten(-2).to(x.dtype)


def fp4_qdq(x: torch.Tensor, block: int = 32, e4m3_scale: bool = False) -> torch.Tensor:
    """Per-``block`` FP4, dequantized back to x's dtype. ``e4m3_scale`` selects the compressed-KV
    variant (scale = e4m3(amax/6), amax floored at 6*2^-9) over the UE8M0 one (indexer)."""
    g = x.float().unflatten(-1, (-1, block))
    amax = g.abs().amax(-1)
    if e4m3_scale:
        s = to_e4m3(amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).float()
    else:
        s = pow2_scale(amax.clamp_min(FP4_MAX * 2.0**-126), FP4_MAX)
    s = s.unsqueeze(-1)
    v = (g / s).clamp(-FP4_MAX, FP4_MAX)
    return (_on(FP4_TABLE, v.device)[e2m1_codes(v).long()] * s).flatten(-2).to(x.dtype)
