"""Small numerical building blocks shared by the layers: RMSNorm, RoPE with YaRN, the quantized
linear, and mHC (hyper-connection) mixing. Casts follow the reference so that a bf16 run rounds
where it rounds; an fp32 run does the same operations without the intermediate bf16 roundings.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asympd.model import quant
from asympd.model.quant import fp8_qdq

# CPU GEMM picks a different kernel for very short inputs, so a row's result depends on how many
# rows share the call (measured: M in 1-3, 5-7, 9-11 differ from M >= 12). Padding to this many
# rows makes every row's bits independent of the batch it arrives in: P and D, chunked and
# one-shot, solo and batched all compute identical values, so top-k selections never flip.
MIN_GEMM_ROWS = 16

# Fused CUDA kernels register here (asympd/model/cuda_ops.py, after checking them against these
# functions on the device). Only CUDA tensors take them; the CPU path is unchanged.
CUDA_FAST: dict[str, Callable] = {}


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T, batch-invariant per row on CPU (see MIN_GEMM_ROWS)."""
    rows = x.shape[:-1].numel()
    if x.device.type != "cpu" or rows >= MIN_GEMM_ROWS:
        return F.linear(x, weight)
    flat = x.reshape(rows, x.size(-1))
    padded = torch.cat([flat, flat.new_zeros(MIN_GEMM_ROWS - rows, flat.size(1))])
    return F.linear(padded, weight)[:rows].reshape(*x.shape[:-1], weight.size(0))


def linear_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x W^T where the reference multiplies in fp32 (the head, the ratio>1 compressor). Their
    stored weights and a bf16 model's rows are bf16 values, so a bf16 weight (the GPU build holds
    them so, ``loader``) with fp32 accumulation computes the same products at half the bytes and
    the bf16 tensor-core rate; an fp32 weight (CPU, fp32 models) takes the reference's fp32 GEMM, and
    so does a bf16 one off CUDA (torch's fp32-output GEMM is CUDA's)."""
    if weight.dtype == torch.bfloat16 and weight.is_cuda:
        flat = x.reshape(-1, x.size(-1)).to(torch.bfloat16)
        return torch.mm(flat, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], weight.size(0))
    return linear(x.float(), weight.float())


def lm_head(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the rows x (``linear_f32``)."""
    return linear_f32(x, head)


def stable_elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise op so every element takes the vectorized path. ATen computes the last
    ``numel % (2 * vector width)`` elements with scalar code, and its scalar sigmoid/softplus/silu
    differ from the vectorized ones in the last bit (measured), so otherwise an element's value
    would depend on how many rows share the tensor."""
    n = x.numel()
    if x.device.type != "cpu" or n % 64 == 0:
        return fn(x)
    flat = F.pad(x.reshape(-1), (0, 64 - n % 64))
    return fn(flat)[:n].view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return stable_elementwise(torch.sigmoid, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and "rms_norm" in CUDA_FAST:
        return CUDA_FAST["rms_norm"](x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


class QLinear(torch.nn.Module):
    """y = x W^T. A weight stored quantized (FP8 tiles or FP4) is held dequantized -- exactly, the
    formats fit bf16 -- and its input goes through the per-32 FP8 activation quantization the
    reference kernels apply, so the product equals the block-scaled GEMM up to summation order."""

    def __init__(self, weight: torch.Tensor, quantized: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quantized = quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            x = fp8_qdq(x.to(self.weight.dtype), 32)
        return linear(x.to(self.weight.dtype), self.weight)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, G, K]: group g through weight rows [g*N/G, (g+1)*N/G) -> [M, G, N/G] (``wo_a``)."""
        if self.quantized:
            x = fp8_qdq(x.to(self.weight.dtype), 32)
        w = self.weight.view(x.size(1), -1, x.size(-1))
        return torch.stack([linear(x[:, g].to(w.dtype), w[g]) for g in range(x.size(1))], dim=1)


# ---- RoPE -------------------------------------------------------------------------------------


def rope_frequencies(
    rope_dim: int, base: float, original_seq_len: int, factor: float, beta_fast: int, beta_slow: int
) -> torch.Tensor:
    """Per-pair angular frequencies [rope_dim/2]. With original_seq_len > 0 this is YaRN: dimensions
    whose wavelength fits the training context keep their frequency, long ones are divided by
    ``factor``, with a linear ramp between the beta_fast and beta_slow corrections."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:

        def correction_dim(rotations: float) -> float:
            return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        keep = 1 - ramp
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


def apply_rope(
    x: torch.Tensor, rot: torch.Tensor, rope_dim: int, inverse: bool = False, inplace: bool = False
) -> torch.Tensor:
    """Rotate the last ``rope_dim`` dims of x (adjacent pairs as complex numbers). x: [T, ..., D],
    rot: [T, rope_dim/2] (one rotation per row). Returns a new tensor in x's dtype, or x itself
    with its rotated dims overwritten (``inplace``: for a fresh tensor only the caller holds; the
    untouched D - rope_dim dims are then never copied, which at [16K rows, 64 heads, 512] was a
    2 GB concatenation a call)."""
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    c = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
    r = rot.conj() if inverse else rot
    r = r.view(r.size(0), *([1] * (c.dim() - 2)), r.size(-1))
    tail = torch.view_as_real(c * r).flatten(-2).to(x.dtype)
    if inplace:
        x[..., -rope_dim:] = tail
        return x
    return torch.cat([head, tail], dim=-1)


def fp4_qdq(x: torch.Tensor, block: int = 32, e4m3_scale: bool = False) -> torch.Tensor:
    """``quant.fp4_qdq``, through the fused kernel on CUDA where it was verified (same bits)."""
    if x.is_cuda and "fp4_qdq" in CUDA_FAST:
        return CUDA_FAST["fp4_qdq"](x, block, e4m3_scale)
    return quant.fp4_qdq(x, block, e4m3_scale)


def ordered_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over a short dim as a fixed chain of adds. A reduction kernel may vectorize a small
    inner dim differently depending on how many rows surround it; this never does."""
    parts = x.unbind(dim)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out.unsqueeze(dim) if keepdim else out


# ---- mHC --------------------------------------------------------------------------------------


def sinkhorn_split(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split one projection into the pre (collapse), post (expand) and comb (residual mixing)
    coefficients; comb is made doubly stochastic by Sinkhorn. All fp32, reference op order."""
    if mixes.is_cuda and "sinkhorn_split" in CUDA_FAST:
        return CUDA_FAST["sinkhorn_split"](mixes, scale, base, hc, iters, eps)
    m = mixes.float()
    pre = sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / ordered_sum(comb, -1, keepdim=True) + eps
    comb = comb / (ordered_sum(comb, -2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (ordered_sum(comb, -1, keepdim=True) + eps)
        comb = comb / (ordered_sum(comb, -2, keepdim=True) + eps)
    return pre, post, comb


def hc_mixes(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h: [T, hc, D] -> coefficients from one fp32 projection of the flattened, RMS-normalised stream."""
    if h.is_cuda and h.dim() == 3 and "hc_project" in CUDA_FAST:
        return sinkhorn_split(CUDA_FAST["hc_project"](h, fn, norm_eps), scale, base, hc, iters, eps)
    x = h.flatten(-2).float()
    rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return sinkhorn_split(linear(x, fn) * rsqrt, scale, base, hc, iters, eps)


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the hc copies into one sublayer input: [T, hc, D] x [T, hc] -> [T, D]."""
    if h.is_cuda and "hc_pre" in CUDA_FAST:
        return CUDA_FAST["hc_pre"](h, pre)
    return ordered_sum(pre.unsqueeze(-1) * h.float(), -2).to(h.dtype)


def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a sublayer output back to hc copies, mixing the residual through comb:
    out[j] = post[j] * x + sum_i comb[i, j] * residual[i]."""
    if x.is_cuda and "hc_post" in CUDA_FAST:
        return CUDA_FAST["hc_post"](x, residual, post, comb)
    y = post.unsqueeze(-1) * x.unsqueeze(-2) + ordered_sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), -3)
    return y.to(x.dtype)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim; ties go to the lowest index, so every
    batch shape and device selects the same entries (torch.topk leaves tie order unspecified)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
