"""Weights held on the device as the release stores them.

The CPU reference holds every weight dequantized (exact, 2-4x the bytes). On a GPU that makes the
prefill role ~550 GB instead of 149.5 GB, so the GPU build keeps the stored formats and runs the
GEMMs of ``gemm_kernels`` on them:

- ``FP8TileLinear``: e4m3 ``[N, K]`` + one UE8M0 scale per 32x32 tile (1.001 B per weight);
- routed experts (``PackedExperts``): packed e2m1 ``[E, N, K/2]`` + one UE8M0 scale per 32 K elements
  (0.53 B per weight), w1 and w3 stacked into one ``[E, 2I, K/2]`` operand.

Each computes what the dequantized module computes (same activation quantization, same output
rounding), up to the order of the fp32 accumulation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from asympd.model import gemm_kernels as G
from asympd.model import moe_gluon as MG
from asympd.model.fp4_ptx import split_bytes
from asympd.model.quant import dequant_fp4, dequant_fp8_tiles, fp8_qdq


def activation_qdq(x: torch.Tensor) -> torch.Tensor:
    """The reference's per-32 FP8 activation quantization (fused kernel on CUDA where verified)."""
    if x.is_cuda:
        from asympd.model.cuda_ops import qdq32

        return qdq32(x)
    return fp8_qdq(x, 32)


class FP8TileLinear(torch.nn.Module):
    """y = x W^T with W kept as e4m3 + 32x32 UE8M0 tiles. ``quantized``: the input goes through the
    reference's per-32 FP8 quantization first (every FP8 GEMM but ``wo_a``'s)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, quantized: bool, dtype: torch.dtype):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8TileLinear needs an e4m3 weight, got {weight.dtype}")
        self.weight, self.scale = weight, scale.view(torch.uint8)
        self.quantized, self.dtype = quantized, dtype
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.quantized:
            x = activation_qdq(x)
        return G.fp8_tile_gemm(x, self.weight, self.scale)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, G, K]: group g through weight rows [g*N/G, (g+1)*N/G) -> [M, G, N/G]."""
        x = x.to(self.dtype)
        if self.quantized:
            x = activation_qdq(x)
        return G.fp8_tile_gemm(x, self.weight, self.scale, groups=x.size(1))

    def dequantized(self) -> torch.Tensor:
        return dequant_fp8_tiles(self.weight, self.scale.view(torch.float8_e8m0fnu)).to(self.dtype)


# N rows per tile of the experts' tiled layout (``gemm_kernels.tile_fp4``: each 32-K step of a
# 128-row block one contiguous 2 KB run) that ``PackedExperts.stack`` builds; 0 keeps the row
# layout [E, N, K/2]; None (the default): 128 on CUDA, where it measured 1.01-1.09x the row layout
# at 16-2048 rows (0.98x at one), 1.11-1.21x at 4K-16K (bench/results/formats_moe_variants_tiled.json), the row
# layout elsewhere (the interpreter tests choose a layout explicitly).
TILE_N: int | None = None

# Whether the Gluon expert GEMM runs its table-free FP4 decode (``moe_gluon`` ``exponent_decode``)
# on experts whose scales allow it (every UE8M0 scale <= ``moe_gluon.EXP_DECODE_MAX_SCALE``,
# checked once when the operand is built).
EXPONENT_DECODE = True

# Whether ``PackedExperts.stack`` holds the bytes in ``fp4_ptx.split_layout`` where the Gluon kernel
# will read them (Hopper, tiled, the exponent decode on): its FP4_SPLIT_PAIRS decode takes 5 ALU
# instructions a packed word instead of 9 (docs/performance.md §9). Any other kernel reads the usual
# layout from a temporary copy (``PackedExperts.matmul``): meant for fp32 test builds only.
SPLIT_LAYOUT = True

log = logging.getLogger(__name__)


@dataclass
class PackedExperts:
    """One projection of every routed expert: int8 ``[E, N, K/2]`` codes in the kernel's nibble order
    (``gemm_kernels.repack_fp4``: the release's bytes, permuted within each 32-element block), UE8M0
    ``[E, N, K/32]``; or the same bytes tiled (``gemm_kernels.tile_fp4``: ``[E, N/BN, K/32, BN, 16]``
    and ``[E, N/BN, K/32, BN]``), which the kernels read as whole lines."""

    weight: torch.Tensor
    scale: torch.Tensor
    # every scale small enough for the table-free decode (set from the scales when built)
    exponent_decode: bool = False
    # the bytes are in ``fp4_ptx.split_layout`` (the Gluon kernel's ``split_layout``)
    split: bool = False

    def __post_init__(self) -> None:
        scales = self.scale.view(torch.uint8)
        self.exponent_decode = bool(scales.numel()) and int(scales.max()) <= MG.EXP_DECODE_MAX_SCALE
        if self.split and not (self.exponent_decode and self.weight.dim() == 5):
            raise ValueError("PackedExperts: the split layout is for tiled experts the exponent decode takes")

    @classmethod
    def stack(
        cls,
        parts: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        tile_n: int | None = None,
        split: bool | None = None,
    ) -> PackedExperts:
        """Per-expert (packed, scale) pairs in the release's layout -> one operand (w1|w3 pairs are
        concatenated along N), tiled by ``tile_n`` rows (default ``TILE_N``, which see; 0: the row
        layout), its bytes in the split layout where ``split`` (default: ``SPLIT_LAYOUT`` on an sm_90
        GPU with the Gluon kernel, when tiled and the exponent decode takes the scales)."""
        w = G.repack_fp4(torch.stack([p for p, _ in parts]).to(device))
        s = torch.stack([s.view(torch.uint8) for _, s in parts]).to(device)
        out = cls(w, s)
        if tile_n is None:
            tile_n = TILE_N if TILE_N is not None else (128 if w.is_cuda else 0)
        out = out.tiled(tile_n) if tile_n else out
        if split is None:
            hopper = w.is_cuda and MG.AVAILABLE and torch.cuda.get_device_capability(w.device)[0] == 9
            split = SPLIT_LAYOUT and EXPONENT_DECODE and hopper and out.exponent_decode and bool(tile_n)
        return out.split_layout() if split else out

    def tiled(self, tile_n: int = 128) -> PackedExperts:
        """The same bytes in the tiled layout (a new operand; the row layout's tensors can be freed)."""
        if self.weight.dim() == 5:
            raise ValueError("PackedExperts.tiled: already tiled")
        return PackedExperts(*G.tile_fp4(self.weight, self.scale, tile_n))

    def split_layout(self) -> PackedExperts:
        """The same values with the bytes in ``fp4_ptx.split_layout`` (a new operand; tiled experts
        whose scales the exponent decode takes)."""
        if self.split:
            raise ValueError("PackedExperts.split_layout: already split")
        if not (self.exponent_decode and self.weight.dim() == 5):
            raise ValueError("PackedExperts.split_layout: tiled experts the exponent decode takes")
        return PackedExperts(split_bytes(self.weight), self.scale, split=True)

    def usual_weight(self) -> torch.Tensor:
        """The bytes in the layout every kernel reads (a new tensor where the split layout holds them)."""
        return split_bytes(self.weight, inverse=True) if self.split else self.weight

    @property
    def n_experts(self) -> int:
        return self.weight.size(0)

    @property
    def in_features(self) -> int:
        return self.scale.size(-2 if self.weight.dim() == 5 else -1) * 32

    def dequantized(self, expert: int) -> torch.Tensor:
        w = self.weight[expert]
        s = self.scale[expert]
        if self.split:
            w = split_bytes(w, inverse=True)
        if w.dim() == 4:
            w, s = G.untile_fp4(w, s)
        return dequant_fp4(G.unrepack_fp4(w), s.view(torch.float8_e8m0fnu))

    def matmul(
        self,
        a: torch.Tensor,
        blocks: tuple[torch.Tensor, ...],
        rows: int,
        block_m: int,
        a_rows: torch.Tensor | None,
        config: dict | None = None,
    ) -> torch.Tensor:
        config = dict(config or {})
        exp = EXPONENT_DECODE and self.exponent_decode
        weight = self.weight
        if self.split and exp and G.takes_wgmma(a, weight, block_m, config):
            config["wgmma_config"] = {"split_layout": True, **config.get("wgmma_config", {})}
            return G.mxfp4_moe_gemm(a, weight, self.scale, blocks, rows, block_m, a_rows, config)
        if self.split:  # another kernel (fp32 activations, a Triton config): the usual bytes, copied
            if not getattr(self, "_warned", False):
                log.warning("split-layout experts read by a kernel other than the Gluon one: a copy a call")
                self._warned = True
            weight = self.usual_weight()
        if exp:
            config["wgmma_config"] = {"exponent_decode": True, **config.get("wgmma_config", {})}
        return G.mxfp4_moe_gemm(a, weight, self.scale, blocks, rows, block_m, a_rows, config)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel()


# The smallest M-block for an average of up to this many rows an expert. An expert's rows vary
# around the average, and one row past a block reads its weights again, so small blocks are chosen
# only while they are well under full on average. Measured with the Gluon kernel (bench/results/
# moe_blockm_ac1eaf7.json, layers_v4.json): 16-row blocks are the fastest at 8 rows an expert,
# 32-row blocks at 16 and 18 (1.08-1.09x 16-row ones at 16; 1.29x 64-row ones at 18, the MoE
# sublayer at 1152 tokens), 64-row blocks at 32 (1.11-1.14x 32-row ones) and 64 (1.06-1.07x
# 128-row ones). The limits between are the midpoints of the measured averages. Since the kernel
# multiplies only the sub-tiles a block has rows in (``moe_gluon.SUB_TILES``), a larger block costs
# little past its rows: 128-row blocks were 1.02-1.06x 64-row ones at 64 an expert (4096 tokens,
# moe_split_subtiles_gemms.json), 64-row ones still 1.25-1.55x 128-row ones at 32; the last limit
# is 48.
MOE_BLOCK_M_FILL = ((16, 12), (32, 24), (64, 48))


def moe_block_m(rows: int, n_experts: int) -> int:
    """M-block of the expert GEMMs for ``rows`` routed rows (from the average rows an expert)."""
    avg = rows / n_experts
    for bm, up_to in MOE_BLOCK_M_FILL:
        if avg <= up_to:
            return bm
    return 128
