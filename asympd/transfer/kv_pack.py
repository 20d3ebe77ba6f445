"""The released cache formats on the wire: compressed main KV as NVFP4, indexer keys as MXFP4.

Every compressed KV entry and index key in the cache has already been through ``fp4_qdq`` (model/
quant.py): per 16 values an E4M3 scale times e2m1 codes for the main KV, per 32 a UE8M0 (power of
two) scale for the index keys. So the stored values are ``code * scale`` exactly, and packing them
back into codes + scales is lossless: unpacking gives the same bits (±0 included).

The scale is not stored in the cache, so packing recovers one: a group's largest magnitude is
``c * s`` for some e2m1 magnitude c, so the candidate scales are ``amax / c``; the first candidate
that is representable and puts every value of the group on the grid is taken. Any such scale
reproduces the values exactly, which is all the receiver needs. Values that are not on the grid
(a cache that was written some other way) raise ``KVPackError`` instead of being rounded.

Layouts (per entry of width d): codes uint8 [d/2], even element in the low nibble (as the checkpoint
packs FP4); scales [d/16] float8_e4m3fn (main KV) or [d/32] float8_e8m0fnu (index keys). For
V4.1-Flash (head_dim 512, index_head_dim 128) that is 256 + 32 = 288 B and 64 + 4 = 68 B per entry.

Both directions are torch ops on the tensor's own device (the lookup tables follow it): on a GPU, P
packs in device memory and only the packed buffers, 3.6x smaller than bf16, cross PCIe to the host
(or go to NIXL as device memory); a receiver holding the buffers on a GPU unpacks there. The only
host synchronizations are the per-pass "which blocks are left" and the error checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asympd.config import ModelConfig
from asympd.model.quant import E2M1_VALUES, FP4_TABLE, _on, pack_fp4, unpack_fp4

try:  # Triton ships with CUDA builds of torch; on CPU-only installs it is optional (tests use it)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None


class KVPackError(ValueError):
    """Values that are not on the FP4 grid, or packed buffers that do not describe valid ones."""


@dataclass(frozen=True)
class FP4Format:
    """One released FP4 cache format: the block length and the scale dtype."""

    name: str
    block: int
    scale_dtype: torch.dtype
    zero_scale: float  # the scale the quantizer gives an all-zero block (its amax floor / 6)

    def scale_ok(self, s: torch.Tensor) -> torch.Tensor:
        """Which fp32 scales this format stores exactly (positive, finite, representable)."""
        back = s.to(self.scale_dtype).float()
        return (back == s) & (s > 0) & torch.isfinite(s)

    def bytes_per_entry(self, width: int) -> int:
        return width // 2 + width // self.block


NVFP4 = FP4Format("nvfp4", 16, torch.float8_e4m3fn, 2.0**-9)  # compressed main KV
MXFP4 = FP4Format("mxfp4", 32, torch.float8_e8m0fnu, 2.0**-126)  # indexer keys
# the magnitudes a block's amax can have, largest first: the natural scale (amax = 6 s) is tried first
_CANDIDATES = E2M1_VALUES[1:].flip(0).tolist()


def pack(values: torch.Tensor, fmt: FP4Format) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] cache values -> (codes uint8 [n, d/2], scales [n, d/block]) on ``values``' device;
    lossless or KVPackError."""
    codes, scales, ok = pack_unchecked(values, fmt)
    bad = (~ok).nonzero()
    if bad.numel():
        row, group = divmod(int(bad[0]), values.size(1) // fmt.block)
        raise KVPackError(
            f"row {row}, values {group * fmt.block}..{(group + 1) * fmt.block - 1} are not on the {fmt.name} grid"
            " (not a quantized cache entry): it cannot be packed losslessly"
        )
    return codes, scales


def pack_unchecked(values: torch.Tensor, fmt: FP4Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack`` without the refusal: also ``ok`` (bool, one per block of ``fmt.block`` values in
    row-major order), False where a block is off the grid (its codes and scale are then garbage).

    One host synchronisation whatever the size (which blocks the natural scale missed; ``pack``
    adds one for the refusal), where the search it replaces synchronised once per candidate: on a
    GPU each of those waited for every kernel queued before it. Every block takes the natural scale
    amax / 6 in one pass (an all-zero block the quantizer's floor); the blocks it does not
    reproduce (most MXFP4 blocks, whose power-of-two scale is rarely amax / 6; NVFP4 blocks whose
    E4M3 rounding moved the scale) try the other candidates side by side and take the first exact
    one: the scale the one-candidate-at-a-time search takes, with the same division."""
    n, d = values.shape
    if d % fmt.block:
        raise KVPackError(f"width {d} is not a multiple of the {fmt.name} block {fmt.block}")
    g = values.detach().float().reshape(-1, fmt.block)  # [n * G, b]
    amax = g.abs().amax(-1)
    table, grid = _on(FP4_TABLE, g.device), _on(E2M1_VALUES, g.device)
    scale = torch.where(amax == 0, torch.full_like(amax, fmt.zero_scale), amax / _CANDIDATES[0])
    codes, ok = _try_scales(g, scale, fmt, table, grid)
    todo = (~ok).nonzero().squeeze(1)
    if todo.numel():
        gt, at = g[todo].unsqueeze(1), amax[todo]  # [m, 1, b], [m]
        s = torch.stack([at / c for c in _CANDIDATES[1:]], -1)  # [m, C], each as the search divides
        cand, fits = _try_scales(gt, s, fmt, table, grid)  # [m, C, b], [m, C]
        first = fits.to(torch.uint8).argmax(-1, keepdim=True)  # the first exact candidate (argmax: first max)
        scale[todo] = s.gather(1, first).squeeze(1)
        codes[todo] = cand.gather(1, first.unsqueeze(-1).expand(-1, 1, fmt.block)).squeeze(1)
        ok[todo] = fits.any(-1)
    codes, scale = codes.reshape(n, d), scale.reshape(n, d // fmt.block)
    return pack_fp4(codes).view(torch.uint8), scale.to(fmt.scale_dtype), ok


def _try_scales(
    g: torch.Tensor, s: torch.Tensor, fmt: FP4Format, table: torch.Tensor, grid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of blocks ``g`` [..., b] at scales ``s`` [...] (broadcast), and whether the scale is
    one the format stores and reproduces every value bit for bit."""
    cand = _grid_codes(g / s.unsqueeze(-1), grid)
    exact = (table[cand.long()] * s.unsqueeze(-1)).view(torch.int32) == g.view(torch.int32)
    return cand, fmt.scale_ok(s) & exact.all(-1)


def _grid_codes(q: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of values expected exactly on the grid: a magnitude's code is its index in the
    sorted grid (a value off the grid gets a wrong code, which the caller's exactness check sees).
    Cheaper than rounding (``e2m1_codes``), which the quantizer needs and packing does not."""
    code = torch.searchsorted(grid, q.abs().contiguous()).clamp_max(grid.numel() - 1)
    return code.to(torch.uint8) | (torch.signbit(q).to(torch.uint8) << 3)


def unpack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: FP4Format,
    dtype: torch.dtype = torch.float32,
    checked: bool = False,
    kernel: bool | None = None,
) -> torch.Tensor:
    """(codes uint8 [n, d/2], scales [n, d/block]) -> values [n, d] in ``dtype`` on their device;
    malformed input is KVPackError. ``checked``: the caller already ran ``check_scales`` (on the
    host, where the bytes arrived: no device sync here). ``kernel`` (default: on CUDA): one Triton
    launch (``_unpack_kernel``) instead of a dozen torch ops; a receiver on a GPU shares it with
    the steps in flight, and each of its kernels waits its turn there. Both give the same bits."""
    if codes.dim() != 2 or scales.dim() != 2:
        raise KVPackError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} must be 2-D")
    if scales.dtype != fmt.scale_dtype:
        raise KVPackError(f"scales are {scales.dtype}, {fmt.name} keeps them in {fmt.scale_dtype}")
    n, half = codes.shape
    if scales.size(0) != n or half * 2 != scales.size(1) * fmt.block:
        raise KVPackError(
            f"codes {tuple(codes.shape)} do not match scales {tuple(scales.shape)}: {fmt.name} has one scale"
            f" per {fmt.block} values ({half * 2 // fmt.block if half * 2 % fmt.block == 0 else 'a fraction'}"
            f" per row here)"
        )
    s = scales.float()
    if not checked:
        check_scales(s, fmt)
    if kernel is None:
        kernel = codes.is_cuda and triton is not None
    if kernel:
        return _unpack_launch(codes, s, fmt, dtype)
    vals = unpack_fp4(codes.contiguous()).unflatten(-1, (-1, fmt.block))
    return (vals * s.unsqueeze(-1)).flatten(-2).to(dtype)


def check_scales(scales: torch.Tensor, fmt: FP4Format) -> None:
    """KVPackError naming the first scale (row, block) that is not positive, finite and stored
    exactly by ``fmt``; ``scales`` as fp32 [n, d/block] (one host sync where they live)."""
    bad = ~fmt.scale_ok(scales.float())
    if bad.any():
        row, group = (int(i) for i in bad.nonzero()[0])
        value = scales[row, group].item()
        raise KVPackError(f"scale of row {row}, block {group} is {value}: not a positive finite scale")


def _unpack_launch(codes: torch.Tensor, scales: torch.Tensor, fmt: FP4Format, dtype: torch.dtype) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("kv_pack.unpack(kernel=True) needs Triton")
    n, half = codes.shape
    out = torch.empty(n, 2 * half, dtype=dtype, device=codes.device)
    total = out.numel()
    if total:
        block = 1024
        _unpack_kernel[(triton.cdiv(total, block),)](
            codes.contiguous(), scales.contiguous(), out, total, WIDTH=2 * half, GROUP=fmt.block, BLOCK=block
        )
    return out


if triton is not None:

    @triton.jit
    def _unpack_kernel(
        codes_ptr, scales_ptr, out_ptr, total, WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One output value per lane: its nibble (the low one holds the even element), the e2m1
        magnitude from the exponent and mantissa bits, the sign (code 8 is -0), times its
        block's fp32 scale, in fp32 (exact: at most 7 significant bits), then the output dtype."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        row = offs // WIDTH
        col = offs % WIDTH
        byte = tl.load(codes_ptr + row * (WIDTH // 2) + col // 2, mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((col % 2) * 4)) & 0xF
        e = (nib >> 1) & 3
        m = (nib & 1).to(tl.float32)
        sub = m * 0.5  # e = 0: 0 or 0.5
        norm = (1.0 + 0.5 * m) * tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0))  # 1, 1.5, 2, 3, 4, 6
        mag = tl.where(e == 0, sub, norm)
        val = mag * (1.0 - 2.0 * (nib >> 3).to(tl.float32))
        scale = tl.load(scales_ptr + row * (WIDTH // GROUP) + col // GROUP, mask=mask, other=0.0)
        tl.store(out_ptr + offs, (val * scale).to(out_ptr.dtype.element_ty), mask=mask)


def wire_bytes_per_token(cfg: ModelConfig, kv_format: str, dtype_size: int = 2) -> float:
    """Bytes of global KV (main KV + index keys over every KV source) one prompt token puts on the
    wire: ``fp4`` in the released formats, ``unpacked`` at ``dtype_size`` bytes per value."""
    total = 0.0
    for layer in cfg.kv_source_layers:
        per_token = 1 / cfg.ratio(layer)
        if kv_format == "fp4":
            total += per_token * (NVFP4.bytes_per_entry(cfg.head_dim) + MXFP4.bytes_per_entry(cfg.index_head_dim))
        elif kv_format == "unpacked":
            total += per_token * (cfg.head_dim + cfg.index_head_dim) * dtype_size
        else:
            raise ValueError(f"unknown kv format {kv_format!r}")
    return total
