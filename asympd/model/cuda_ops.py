"""CUDA fast paths of the same model: the functions the CPU reference computes, arranged for a GPU.

The loader builds these modules directly for a CUDA device (``FastQLinear``, ``FastMoE``, and
attention's ``CUDA_KERNELS``; ``packed.py`` for the packed layouts). ``accelerate(model)`` converts an already built
reference model in place, for tests and benchmarks that compare the two on one device. The CPU path
is never touched (CPU stays the numerical reference).

What changes, and what it costs in numerics (``docs/performance.md`` has the measurements):

- Routed experts (``FastMoE``): one grouped GEMM per projection over every expert at once
  (``torch._grouped_mm``; w1 and w3 fused into one [E, 2I, D] operand), tokens sorted by expert on
  the device, no host synchronisation, so a step can be captured in a CUDA graph. Weights are held
  in bf16 by default: the FP4 values dequantize to bf16 exactly (2 B/param instead of the
  checkpoint's 0.56, i.e. 3.6x the bytes a decode step streams). The per-32 FP8 activation
  quantization of the reference is kept, so the function is the reference's up to summation order.
- ``experts="fp8"``: FP4 experts re-expressed as FP8 e4m3 with one fp32 scale per output row
  (``torch._scaled_grouped_mm``, rowwise scales, Hopper). The weight conversion is *exact* whenever
  a row's per-32 UE8M0 scales span at most 14 binades (checked and counted at conversion: e2m1
  values times a power of two shifted by <= 14 binades stay representable in e4m3, subnormals
  included). Activations are quantized per token (rowwise) instead of per 32 elements, which is
  not the reference's rounding: a small, measured deviation. Half the bytes of bf16 experts.
- ``linears="fp8"``: the FP8 attention/shared-expert matrices as e4m3 with per-row scales through
  ``torch._scaled_mm`` (rowwise). The 32x32 tile scales do not map onto rowwise scaling, so the
  weights are requantized (lossy for tiles far below their row's largest tile) and activations
  are quantized per token. Off by default; measured in ``bench/layers.py``.
- Attention (``CUDA_KERNELS``: the same ``Attention`` class with other kernels): the indexer's
  top-k is a radix ``torch.topk`` instead of a full stable sort (identical except for exact score
  ties at the k-th place, which the packed key below also decides by lowest index); the latent
  attention is two batched GEMMs in bf16 with fp32 outputs (``bmm(..., out_dtype=float32)``: bf16
  operands are exact in fp32, so the products are the reference's). The engine's batched path
  instead runs the fused indexer of ``attn_kernels.py`` (``fused_indexer``). The fused sparse
  attention (``fused_attention``: keys read in place from the ring buffer, this step's rows and the
  pool; probabilities rounded to bf16 against the running max, FlashMLA's order) is the default
  (steps 1.08-1.21x faster, ``bench/engine_steps.py --attention``); the gathered path stays as its
  check (``dataclasses.replace(CUDA_KERNELS, fused_attention=False)``). In fp32 both are ~6-7e-7
  from the float64 value per call, yet the tiny random checkpoint's greedy tokens part between them
  on 2 of 5 prompts: a random 1e-6 error on the gathered path's output parts the same ones
  (``bench/fused_attention_tokens.py``), so token equality across attention paths is no test there;
  the engine's fp32 token tests compare runs on the same path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from asympd.model import attn_kernels, ops
from asympd.model import cuda_kernels as K
from asympd.model.attention import AttentionKernels
from asympd.model.gemm_kernels import moe_blocks
from asympd.model.moe import MoE, combine_slots
from asympd.model.ops import QLinear, linear, stable_elementwise
from asympd.model.packed import FP8TileLinear, PackedExperts, moe_block_m
from asympd.model.quant import FP8_MAX, fp8_qdq, pow2_scale
from asympd.model.quant import fp4_qdq as quant_fp4_qdq

# ---- capability probes (run once per device, outside any graph capture) ------------------------

_CAPS: dict[str, Any] = {}


def caps(device: torch.device) -> dict[str, bool]:
    """Which fast kernels this torch build offers on ``device`` (probed on tiny inputs once; "cuda"
    and "cuda:<current>" are one device, one probe and one dict)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key in _CAPS:
        return _CAPS[key]
    out: dict[str, bool] = {}
    bf = torch.bfloat16
    a = torch.randn(2, 32, 16, device=device, dtype=bf)
    b = torch.randn(2, 16, 8, device=device, dtype=bf)
    try:
        r = torch.bmm(a, b, out_dtype=torch.float32)
        out["bmm_out_f32"] = r.dtype == torch.float32
    except Exception:
        out["bmm_out_f32"] = False
    try:
        r = torch.mm(a[0], b[0], out_dtype=torch.float32)
        out["mm_out_f32"] = r.dtype == torch.float32
    except Exception:
        out["mm_out_f32"] = False
    x = torch.randn(64, 32, device=device, dtype=bf)
    w = torch.randn(4, 48, 32, device=device, dtype=bf)
    # uneven groups, one empty: what routing produces
    bounds = [5, 5, 37, 64]
    offs = torch.tensor(bounds, device=device, dtype=torch.int32)

    def per_group(xx, ww):
        lo, parts = 0, []
        for i, hi in enumerate(bounds):
            parts.append(xx[lo:hi].float() @ ww[i].float().t())
            lo = hi
        return torch.cat(parts)

    try:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        out["grouped_mm"] = bool(torch.allclose(y.float(), per_group(x, w), rtol=2e-2, atol=2e-2))
    except Exception:
        out["grouped_mm"] = False
    try:
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn)
        y = torch._scaled_grouped_mm(
            x8,
            w8.transpose(-2, -1),
            torch.ones(64, device=device),
            torch.ones(4, 48, device=device),
            offs=offs,
            out_dtype=bf,
        )
        out["scaled_grouped_mm"] = bool(torch.allclose(y.float(), per_group(x8, w8), rtol=2e-2, atol=2e-2))
    except Exception:
        out["scaled_grouped_mm"] = False
    try:
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w[0].to(torch.float8_e4m3fn)
        y = torch._scaled_mm(
            x8, w8.t(), scale_a=torch.ones(64, 1, device=device), scale_b=torch.ones(1, 48, device=device), out_dtype=bf
        )
        out["scaled_mm_rowwise"] = bool(torch.allclose(y.float(), x8.float() @ w8.float().t(), rtol=2e-2, atol=2e-2))
    except Exception:
        out["scaled_mm_rowwise"] = False
    out.update(_probe_kernels(device))
    _CAPS[key] = out
    return out


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Finite, and within ``tol`` of ``b`` in relative norm (a probe's acceptance)."""
    a, b = a.float(), b.float()
    return bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm().clamp_min(1e-30)) < tol


def _probe_kernels(device: torch.device) -> dict[str, bool]:
    """Each fused Triton kernel against the torch function it replaces, on random data."""
    out = {
        "triton_fp8_qdq": False,
        "triton_swiglu_qdq": False,
        "triton_hc_pre": False,
        "triton_hc_post": False,
        "triton_sinkhorn": False,
        "triton_fp4_qdq": False,
        "triton_hc_project": False,
        "triton_rms_norm": False,
        "triton_moe_combine": False,
    }
    if device.type != "cuda" or not K.AVAILABLE:
        return out
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    try:
        scale = torch.logspace(-4, 3, 5120, device=device)
        ok = True
        for dt in (bf, torch.float32):
            x = (torch.randn(77, 5120, device=device, generator=g) * scale).to(dt)
            ok &= torch.equal(K.fp8_qdq(x), fp8_qdq(x, 32))
        out["triton_fp8_qdq"] = bool(ok)
    except Exception:
        pass
    try:
        gu = (torch.randn(333, 2 * 2304, device=device, generator=g) * 4).to(bf)
        w = torch.rand(333, device=device, generator=g)
        inter = 2304
        gate, up = gu[:, :inter].float(), gu[:, inter:].float().clamp(-10.0, 10.0)
        ref = fp8_qdq((w[:, None] * (F.silu(gate.clamp(max=10.0)) * up)).to(bf), 32)
        out["triton_swiglu_qdq"] = _close(K.swiglu_qdq(gu, w, 10.0, bf), ref, 2e-2)
    except Exception:
        pass
    try:
        h = torch.randn(97, 4, 5120, device=device, generator=g).to(bf)
        pre = torch.softmax(torch.randn(97, 4, device=device, generator=g), -1)
        ref = ops.ordered_sum(pre.unsqueeze(-1) * h.float(), -2).to(bf)
        out["triton_hc_pre"] = _close(K.hc_pre(h, pre), ref, 1e-2)
        x = torch.randn(97, 5120, device=device, generator=g).to(bf)
        post = torch.rand(97, 4, device=device, generator=g) * 2
        comb = torch.softmax(torch.randn(97, 4, 4, device=device, generator=g), -1)
        y = post.unsqueeze(-1) * x.unsqueeze(-2) + ops.ordered_sum(comb.unsqueeze(-1) * h.unsqueeze(-2), -3)
        out["triton_hc_post"] = _close(K.hc_post(x, h, post, comb), y.to(bf), 1e-2)
    except Exception:
        pass
    try:
        m = torch.randn(1000, 24, device=device, generator=g) * 3
        scale = torch.tensor([0.5, 0.7, 1.3], device=device)
        base = torch.randn(24, device=device, generator=g)
        ok = True
        for a, b in zip(K.sinkhorn_split(m, scale, base, 4, 20, 1e-6), _sinkhorn_torch(m, scale, base), strict=True):
            ok &= _close(a, b, 1e-5)
        out["triton_sinkhorn"] = bool(ok)
    except Exception:
        pass
    out.update(probe_glue_kernels(device, g))
    return out


def probe_glue_kernels(device: torch.device, g: torch.Generator | None = None) -> dict[str, bool]:
    """fp4_qdq (bit-exact), hc_project and rms_norm (fp32 summation order) against ``quant`` and
    ``ops``'s torch forms. Also runs on CPU under Triton's interpreter (the CPU tests call it)."""
    out = {"triton_fp4_qdq": False, "triton_hc_project": False, "triton_rms_norm": False, "triton_moe_combine": False}
    if not K.AVAILABLE:
        return out
    g = g or torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    try:
        scale = torch.logspace(-12, 3, 512, device=device)
        x = torch.randn(37, 512, device=device, generator=g) * scale
        x[0, :64] = 0.0
        x[1, :32] = -0.0  # the sign of zero is kept (code 8)
        x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, device=device)  # ties
        ok = True
        for dt in (bf, torch.float32):
            xd = x.to(dt)
            for block, e4m3 in ((32, False), (16, True)):
                a, b = K.fp4_qdq(xd, block, e4m3), quant_fp4_qdq(xd, block, e4m3)
                ok &= bool(torch.equal(a.view(torch.int16 if dt == bf else torch.int32),
                                       b.view(torch.int16 if dt == bf else torch.int32)))  # fmt: skip
        out["triton_fp4_qdq"] = bool(ok)
    except Exception:
        pass
    try:
        ok = True
        for rows, d in ((77, 640), (2056, 256)):  # both row tiles (16 and 64), a partial one each
            h = torch.randn(rows, 4, d, device=device, generator=g).to(bf)
            fn = torch.randn(24, 4 * d, device=device, generator=g) * 0.01
            x = h.flatten(-2).double()
            ref = (x @ fn.double().t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-20)
            ok &= _close(K.hc_project(h, fn, 1e-20), ref, 1e-5)
        out["triton_hc_project"] = bool(ok)
    except Exception:
        pass
    try:
        ok = True
        for d, dt in ((5120, bf), (512, bf), (1280, torch.float32)):
            x = torch.randn(33, d, device=device, generator=g).to(dt) * 3
            w = torch.rand(d, device=device, generator=g).to(dt) + 0.5
            xf = x.double()
            ref = (w.double() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6))).to(dt)
            ok &= _close(K.rms_norm(x, w, 1e-6), ref, 1e-2 if dt == bf else 1e-6)
        out["triton_rms_norm"] = bool(ok)
    except Exception:
        pass
    try:
        t, k, d = 77, 6, 1280  # a partial column block
        rows = torch.randn(t * k, d, device=device, generator=g).to(bf)
        inv = torch.randperm(t * k, device=device, generator=g)
        shared = torch.randn(t, d, device=device, generator=g).to(bf)
        ref = (rows.double()[inv].view(t, k, d).sum(1) + shared.double()).to(bf)
        out["triton_moe_combine"] = _close(K.moe_combine(rows, inv, k, shared), ref, 1e-3)
    except Exception:
        pass
    return out


def _sinkhorn_torch(m, scale, base):
    """ops.sinkhorn_split without the CUDA dispatch (the probe's reference)."""
    fast = ops.CUDA_FAST.pop("sinkhorn_split", None)
    try:
        return ops.sinkhorn_split(m, scale, base, 4, 20, 1e-6)
    finally:
        if fast is not None:
            ops.CUDA_FAST["sinkhorn_split"] = fast


def kernels_enabled(device: torch.device) -> dict[str, bool]:
    c = caps(device)
    return {k: v for k, v in c.items() if k.startswith("triton_")}


# the glue kernels installed when their probe passes (docs/performance.md §12, "The glue between the
# kernels"; each measured alone against the torch forms, bench/layers.py's glue section)
GLUE_KERNELS = ("fp4_qdq", "hc_project", "rms_norm")  # (moe_combine: FastMoE asks caps itself)


def install_kernels(device: torch.device) -> None:
    """Register the fused mHC kernels that passed their check with ``ops`` (CUDA tensors only)."""
    c = caps(device)
    if c.get("triton_hc_pre"):
        ops.CUDA_FAST["hc_pre"] = K.hc_pre
    if c.get("triton_hc_post"):
        ops.CUDA_FAST["hc_post"] = K.hc_post
    if c.get("triton_sinkhorn"):
        ops.CUDA_FAST["sinkhorn_split"] = K.sinkhorn_split
    for name in GLUE_KERNELS:
        if c.get(f"triton_{name}"):
            ops.CUDA_FAST[name] = getattr(K, name)


def qdq32(x: torch.Tensor) -> torch.Tensor:
    """quant.fp8_qdq(x, 32), through the fused kernel where it was verified."""
    if x.is_cuda and caps(x.device).get("triton_fp8_qdq"):
        return K.fp8_qdq(x)
    return fp8_qdq(x, 32)


class FastQLinear(QLinear):
    """QLinear whose activation quantization is the fused kernel on CUDA (same values)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            x = qdq32(x.to(self.weight.dtype))
        return linear(x.to(self.weight.dtype), self.weight)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """The groups as one batched GEMM (``QLinear.grouped``'s function)."""
        if self.quantized:
            x = qdq32(x.to(self.weight.dtype))
        w = self.weight.view(x.size(1), -1, x.size(-1))
        return torch.bmm(x.to(w.dtype).transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 products and output; bf16 operands stay bf16 where the GPU allows it."""
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and caps(a.device).get("bmm_out_f32"):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def fast_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim (order unspecified), ties to the lowest index
    exactly as the reference's stable sort. On CUDA a radix select over one int64 key per entry:
    the float's order-preserving bits above, the reversed index below (so equal scores, common
    after the indexer's relu, are decided like the stable sort); the stable sort elsewhere."""
    if scores.is_cuda:
        n = scores.size(-1)
        bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0 and +0 are one value
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
        idx = torch.arange(n - 1, -1, -1, device=scores.device, dtype=torch.int64)
        key = (ordered.to(torch.int64) << 32) | idx
        return n - 1 - (torch.topk(key, k, dim=-1, sorted=False).values & 0xFFFFFFFF)
    from asympd.model.ops import stable_topk

    return stable_topk(scores, k)


# ---- FP8 helpers ------------------------------------------------------------------------------


def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scale [M]) with x ~= q * scale per row."""
    amax = x.float().abs().amax(-1).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def weight_rows_to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Dequantized weights [..., N, K] -> (e4m3, fp32 power-of-two scale per row [..., N], rows not
    exactly representable). Exact for FP4 rows whose block scales span <= 14 binades."""
    amax = w.float().abs().amax(-1).clamp_min(1e-30)
    s = pow2_scale(amax, FP8_MAX)
    q = (w.float() / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    inexact = int((q.float() * s.unsqueeze(-1) != w.float()).any(-1).sum())
    return q, s, inexact


class FP8Linear(QLinear):
    """A QLinear whose weight is held as e4m3 with one scale per output row; the input is
    quantized per row and the product runs on FP8 tensor cores (``torch._scaled_mm``)."""

    def __init__(self, lin: QLinear):
        w = lin.weight.data
        q, s, inexact = weight_rows_to_fp8(w)
        super().__init__(q, lin.quantized)
        self.w_scale = s.float().view(1, -1)
        self.out_dtype = w.dtype if w.dtype != torch.float32 else torch.bfloat16
        self.inexact_rows = inexact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        xq, xs = rowwise_fp8(flat)
        y = torch._scaled_mm(
            xq, self.weight.t(), scale_a=xs.view(-1, 1), scale_b=self.w_scale, out_dtype=self.out_dtype
        )
        return y.reshape(*shape[:-1], -1)


# ---- MoE --------------------------------------------------------------------------------------


class FastMoE(MoE):
    """Routed experts as grouped GEMMs over expert-sorted tokens; the shared expert as before.

    ``experts``: ``mxfp4`` (as released, the loader's default on CUDA: ``packed.PackedExperts`` and
    the MXFP4 grouped GEMM), ``bf16`` (dequantized, ``torch._grouped_mm``) or ``fp8`` (rowwise).
    ``routed`` is the same grouped GEMM over any contiguous expert range ``[lo, hi)``, so an
    expert-parallel rank (``asympd.parallel.ep``) runs its received rows through it too."""

    experts = "bf16"
    inexact_rows = 0

    @property
    def syncs_host(self) -> bool:
        """Whether the routed experts read expert bounds on the host (the per-expert GEMM loop of
        fp32 or pre-grouped-GEMM builds): a step through them cannot be captured as a CUDA graph."""
        if getattr(self, "w13", None) is None:
            return True
        if self.experts in ("mxfp4", "fp8"):
            return False
        return not (self.w13.dtype == torch.bfloat16 and caps(self.w13.device).get("grouped_mm"))

    @classmethod
    def packed(
        cls,
        cfg: Any,
        layer: int,
        gate: dict[str, torch.Tensor],
        w13: PackedExperts,
        w2: PackedExperts,
        s13: FP8TileLinear | torch.Tensor,
        s2: FP8TileLinear | torch.Tensor,
        experts: tuple[int, int] | None = None,
    ) -> FastMoE:
        """Routed experts as stored (MXFP4); the shared expert as FP8 tiles or dequantized (``s13``
        holds w1 and w3 stacked; the MoE quantizes its input once for both). ``experts=(lo, hi)``:
        ``w13``/``w2`` hold those experts only (expert parallelism)."""
        moe = cls.__new__(cls)
        torch.nn.Module.__init__(moe)
        moe.n_experts, moe.topk = cfg.moe_shape(layer)
        moe.lo, moe.hi = experts or (0, moe.n_experts)
        if w13.n_experts != moe.hi - moe.lo:
            raise ValueError(f"{w13.n_experts} packed experts for the range [{moe.lo}, {moe.hi})")
        moe.score_func, moe.route_scale, moe.limit = cfg.score_func, cfg.route_scale, cfg.swiglu_limit
        moe.gate, moe.bias = gate["weight"], gate["bias"]
        moe.bias_vl = gate.get("bias_vl")  # vision: image-span rows route with it (MoE.route_bias)
        moe.w1 = moe.w2 = moe.w3 = moe.s1 = moe.s3 = None
        moe.w13, moe.w2f, moe.s13, moe.s2 = w13, w2, s13, s2
        moe.inter = w2.in_features
        moe.shared_inter = s2.in_features if isinstance(s2, FP8TileLinear) else s2.size(1)
        moe.experts = "mxfp4"
        moe.gate_bf16 = (
            gate["weight"].to(torch.bfloat16)
            if torch.equal(gate["weight"].to(torch.bfloat16).float(), gate["weight"])
            else None
        )
        return moe

    def convert(self, experts: str = "bf16", chunk: int = 32) -> None:
        """Build the fused operands from the reference's stacked [E, out, in] weights, freeing them."""
        if getattr(self, "w13", None) is not None:
            return
        n = self.w1.size(0)
        self.inter = self.w1.size(1)
        if experts == "fp8":
            w13, s13, w2, s2, bad = [], [], [], [], 0
            for e0 in range(0, n, chunk):
                q, s, i1 = weight_rows_to_fp8(torch.cat([self.w1[e0 : e0 + chunk], self.w3[e0 : e0 + chunk]], 1))
                w13.append(q)
                s13.append(s.float())
                q, s, i2 = weight_rows_to_fp8(self.w2[e0 : e0 + chunk])
                w2.append(q)
                s2.append(s.float())
                bad += i1 + i2
            self.w13, self.w13_scale = torch.cat(w13), torch.cat(s13)
            self.w2f, self.w2_scale = torch.cat(w2), torch.cat(s2)
            self.inexact_rows = bad
        else:
            self.w13 = torch.cat([self.w1, self.w3], 1).contiguous()
            self.w2f = self.w2.contiguous()
        self.experts = experts
        self.w1 = self.w3 = self.w2 = None
        self.s13 = torch.cat([self.s1, self.s3], 0).contiguous()  # shared expert gate|up in one GEMM
        self.shared_inter = self.s1.size(0)
        # the router's operands are bf16 values held in fp32: bf16 GEMM with fp32 output is exact
        self.gate_bf16 = (
            self.gate.to(torch.bfloat16) if torch.equal(self.gate.to(torch.bfloat16).float(), self.gate) else None
        )

    def reconvert(self, experts: str, chunk: int = 32) -> None:
        """bf16 -> fp8 experts in place (the bf16 values are the exact FP4 dequantization)."""
        if experts == self.experts:
            return
        if not (self.experts == "bf16" and experts == "fp8"):
            raise ValueError(f"cannot convert {self.experts} experts to {experts}")
        w13, s13, w2, s2, bad = [], [], [], [], 0
        for e0 in range(0, self.w13.size(0), chunk):
            q, sc, i1 = weight_rows_to_fp8(self.w13[e0 : e0 + chunk])
            w13.append(q)
            s13.append(sc.float())
            q, sc, i2 = weight_rows_to_fp8(self.w2f[e0 : e0 + chunk])
            w2.append(q)
            s2.append(sc.float())
            bad += i1 + i2
        self.w13 = self.w2f = None
        self.w13, self.w13_scale = torch.cat(w13), torch.cat(s13)
        self.w2f, self.w2_scale = torch.cat(w2), torch.cat(s2)
        self.inexact_rows, self.experts = bad, experts

    def route(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gate_bf16 is not None and x.dtype == torch.bfloat16 and caps(x.device).get("mm_out_f32"):
            scores = torch.mm(x, self.gate_bf16.t(), out_dtype=torch.float32)
        else:
            scores = linear(x.float(), self.gate)
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = torch.sigmoid(scores)
        else:
            scores = stable_elementwise(F.softplus, scores).sqrt()
        ids = fast_topk(scores + self.route_bias(vl), self.topk)  # vision: bias_vl on image rows (CPU-untested)
        weights = scores.gather(1, ids)
        if self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids

    def _grouped(self, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale_a=None, scale_w=None):
        if scale_a is not None:
            return torch._scaled_grouped_mm(
                a, w.transpose(-2, -1), scale_a, scale_w, offs=offs, out_dtype=torch.bfloat16
            )
        if a.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and caps(a.device).get("grouped_mm"):
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        # portable fallback (CPU tests, old torch): one GEMM per expert, host-side bounds
        out = a.new_empty(a.size(0), w.size(1))
        lo = 0
        for e, hi in enumerate(offs.tolist()):
            if hi > lo:
                out[lo:hi] = linear(a[lo:hi], w[e])
            lo = hi
        return out

    def forward(self, x: torch.Tensor, vl: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(self, "w13", None) is None:
            return super().forward(x, vl)
        weights, ids = self.route(x, vl)
        xq = self._quantize(x)  # the routed experts' and the shared expert's input
        if ids.numel() and caps(x.device).get("triton_moe_combine"):
            # the slots summed straight from the expert-sorted rows, the shared row added, one rounding
            rows, inv = self._routed_rows(x, xq, ids, weights)
            return K.moe_combine(rows, inv, ids.size(1), self.shared(x, xq, fp32=False).to(x.dtype))
        y = combine_slots(self.routed(x, ids, weights, xq), ids)
        return (y + self.shared(x, xq)).to(x.dtype)

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        return qdq32(x if self.experts == "mxfp4" else x.to(self.s13.dtype))

    def routed(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, xq: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``MoE.routed`` as grouped GEMMs: slot outputs ``[T, s, dim]`` for ids in ``[lo, hi)``
        (not checked: no host synchronisation); ``xq`` is ``_quantize(x)`` where the caller has it."""
        if getattr(self, "w13", None) is None:
            return super().routed(x, ids, weights)
        if ids.numel() == 0:  # an expert-parallel rank that received no rows
            return x.new_zeros(*ids.shape, x.size(-1))
        if xq is None:
            xq = self._quantize(x)
        out, inv = self._routed_rows(x, xq, ids, weights)
        return out.index_select(0, inv).view(*ids.shape, -1)

    def _routed_rows(
        self, x: torch.Tensor, xq: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slots' outputs in expert-sorted order [T * k, dim], inv): slot s of token t is row
        inv[t * k + s]."""
        if self.experts == "mxfp4":
            return self._routed_mxfp4(x, xq, ids, weights)
        k, n_exp = ids.size(1), self.w13.size(0)
        flat = ids.reshape(-1) - self.lo
        order = torch.argsort(flat, stable=True)  # by expert, then by token: the reference's order
        token = order // k
        counts = torch.zeros(n_exp, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        w_sorted = weights.reshape(-1)[order]
        inter = self.inter
        fused = self._fused(x)
        if self.experts == "fp8":
            x8, xs = rowwise_fp8(x)
            gu = self._grouped(x8[token], self.w13, offs, xs[token], self.w13_scale)
        else:
            gu = self._grouped(xq.to(self.w13.dtype)[token], self.w13, offs)
        if self.experts == "fp8":
            h = self._swiglu_f32(gu, inter) * w_sorted.unsqueeze(-1)
            hq, hs = rowwise_fp8(h)
            out = self._grouped(hq, self.w2f, offs, hs, self.w2_scale)
        elif fused and gu.dtype == torch.bfloat16:
            out = self._grouped(K.swiglu_qdq(gu, w_sorted, self.limit, torch.bfloat16), self.w2f, offs)
        else:
            h = self._swiglu_f32(gu, inter) * w_sorted.unsqueeze(-1)
            out = self._grouped(qdq32(h.to(self.w2f.dtype)), self.w2f, offs)
        # slot s of token t sits at position inv[t * k + s] of the expert-sorted rows
        return out, torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))

    def shared(self, x: torch.Tensor, xq: torch.Tensor | None = None, fp32: bool = True) -> torch.Tensor:
        """The shared expert of ``x`` (already quantized: ``xq``), fp32 (``fp32=False``: as its
        second GEMM returns it)."""
        if getattr(self, "w13", None) is None:
            y = super().shared(x)
            return y if fp32 else y.to(x.dtype)
        if xq is None:
            xq = self._quantize(x)
        sg = _mm(xq, self.s13)
        if self._fused(x) and sg.dtype == torch.bfloat16:
            hs = K.swiglu_qdq(sg, None, self.limit, sg.dtype)
        else:
            hs = qdq32(self._swiglu_f32(sg, self.shared_inter).to(sg.dtype))
        y = _mm(hs, self.s2)
        return y.float() if fp32 else y

    def _routed_mxfp4(
        self, x: torch.Tensor, xq: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_routed_rows`` straight from the packed FP4 operands: rows sorted by expert and cut
        into M-blocks on the device; the GEMMs expand FP4 in registers (``gemm_kernels``)."""
        k = ids.size(1)
        flat = ids.reshape(-1) - self.lo
        n_exp = self.w13.n_experts
        bm = moe_block_m(flat.numel(), n_exp)
        order, *blocks = moe_blocks(flat, n_exp, bm)
        gu = self.w13.matmul(xq, blocks, flat.numel(), bm, a_rows=order // k)
        w_sorted = weights.reshape(-1)[order]
        if self._fused(x):
            h = K.swiglu_qdq(gu, w_sorted, self.limit, torch.bfloat16)
        else:
            h = qdq32((self._swiglu_f32(gu, self.inter) * w_sorted.unsqueeze(-1)).to(x.dtype))
        out = self.w2f.matmul(h, blocks, flat.numel(), bm, a_rows=None)
        return out, torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))

    @staticmethod
    def _fused(x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == torch.bfloat16 and bool(caps(x.device).get("triton_swiglu_qdq"))

    def _swiglu_f32(self, gu: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = gu[:, :inter].float(), gu[:, inter:].float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        return stable_elementwise(F.silu, gate) * up


def _mm(x: torch.Tensor, w: torch.Tensor | FP8TileLinear) -> torch.Tensor:
    """x @ w^T for a dequantized weight or a packed one (input already quantized)."""
    return w(x) if isinstance(w, FP8TileLinear) else linear(x, w)


def _to_fast_moe(moe: MoE, experts: str) -> FastMoE:
    moe.__class__ = FastMoE
    moe.convert(experts)
    return moe


# ---- attention --------------------------------------------------------------------------------


def fast_sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, key_mask: torch.Tensor, sink: torch.Tensor, scale: float, round_probs: bool
) -> torch.Tensor:
    """``attention.sparse_attention`` as two batched GEMMs: q [m, h, d], keys [m, n, d] (K = V)."""
    logits = bmm_f32(q, keys.transpose(1, 2)) * scale  # [m, h, n]
    logits.masked_fill_(~key_mask.unsqueeze(1), float("-inf"))
    top = logits.amax(dim=-1).clamp_min(-1e30)
    p = torch.exp(logits.sub_(top.unsqueeze(-1)))
    denom = p.sum(-1) + torch.exp(sink.float() - top)
    if round_probs and keys.dtype == torch.bfloat16:
        out = bmm_f32(p.to(torch.bfloat16), keys)
    else:
        if round_probs:
            p = p.to(torch.bfloat16).float()
        out = torch.bmm(p, keys.float())
    return (out / denom.unsqueeze(-1)).to(q.dtype)


def indexer_scores(qi: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``attention.indexer_scores`` with the elementwise passes in place (one score tensor, not three)."""
    *lead, m, h, d = qi.shape
    s = torch.matmul(qi.reshape(*lead, m * h, d), keys.transpose(-1, -2)).relu_()
    return s.view(*lead, m, h, -1).mul_(w.unsqueeze(-1)).sum(dim=-2).float()


CUDA_KERNELS = AttentionKernels(
    sparse_attention=fast_sparse_attention,
    topk=fast_topk,
    indexer_scores=indexer_scores,
    fused_indexer=attn_kernels.AVAILABLE,
    fused_attention=attn_kernels.AVAILABLE,
)


# ---- conversion -------------------------------------------------------------------------------


def accelerate(model: Any, *, experts: str | None = None, linears: str = "bf16") -> Any:
    """Switch a built model to the fast paths in place (idempotent). ``experts``: bf16 | fp8, or
    None to keep what the loader built (packed MXFP4 experts stay packed, dequantized ones become
    bf16 grouped operands); ``linears``: bf16 | fp8 (rowwise FP8 for dequantized FP8-stored matrices;
    packed ``FP8TileLinear`` ones are left as they are). Returns the model."""
    if experts not in (None, "bf16", "fp8") or linears not in ("bf16", "fp8"):
        raise ValueError("experts must be None, 'bf16' or 'fp8' and linears 'bf16' or 'fp8'")
    device = model.device
    caps(device)
    install_kernels(device)
    blocks = list(model.blocks)
    drafter = getattr(model, "drafter", None)
    if drafter is not None:
        blocks += list(getattr(drafter, "blocks", []))
    report = {"experts": experts or "bf16", "linears": linears, "inexact_expert_rows": 0, "inexact_linear_rows": 0}
    for block in blocks:
        if block is None:
            continue
        for mod in block.modules():
            if type(mod) is QLinear:
                mod.__class__ = FastQLinear
        attn = block.attn
        attn.kernels = CUDA_KERNELS
        attn.freqs = attn.freqs.to(device)
        if linears == "fp8":
            for name in ("wq_a", "wq_b", "wkv", "wo_b", "idx_wq_b"):
                lin = getattr(attn, name, None)
                if isinstance(lin, QLinear) and lin.quantized and not isinstance(lin, FP8Linear):
                    fl = FP8Linear(lin)
                    report["inexact_linear_rows"] += fl.inexact_rows
                    setattr(attn, name, fl)
        ffn = block.ffn
        if ffn is not None and isinstance(ffn, MoE):
            if experts == "fp8" and not caps(device).get("scaled_grouped_mm"):
                raise RuntimeError("experts='fp8' needs torch._scaled_grouped_mm on this device")
            if not isinstance(ffn, FastMoE):
                _to_fast_moe(ffn, experts or "bf16")
            elif experts is not None:
                ffn.reconvert(experts)
            report["experts"] = ffn.experts
            report["inexact_expert_rows"] += ffn.inexact_rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model.fast_path = report
    return model


def fast_path_info(device: torch.device) -> dict[str, Any]:
    return {
        "caps": caps(device),
        "torch": torch.__version__,
        "row_chunk": CUDA_KERNELS.row_chunk,
        "ops_fast": sorted(ops.CUDA_FAST),
    }


__all__ = [
    "CUDA_KERNELS",
    "FP8Linear",
    "FastMoE",
    "accelerate",
    "bmm_f32",
    "caps",
    "fast_sparse_attention",
    "fast_topk",
    "indexer_scores",
]
