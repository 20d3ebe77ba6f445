"""Fused elementwise kernels (Triton) for the CUDA path: one pass where the reference's torch code
makes five to twenty. Each computes the reference function of the same name:

- ``fp8_qdq``: per-32 FP8 activation quantize-dequantize (``quant.fp8_qdq``), bit-exact by
  construction (power-of-two scales from the exponent bits, round-to-nearest-even e4m3);
- ``swiglu_qdq``: the routed/shared expert middle: clamp, silu(gate) * up, times the routing weight,
  rounded to bf16, then ``fp8_qdq`` (``moe.swiglu`` between its two GEMMs);
- ``hc_pre`` / ``hc_post``: the mHC collapse and expand (``ops.hc_pre`` / ``ops.hc_post``) without the
  [T, hc, hc, D] fp32 intermediate the broadcast form materialises.

``cuda_ops.caps`` checks every kernel against the torch reference on the device before it is
used (exact equality for fp8_qdq, bf16 rounding tolerance for the others, where the compiler may
contract a multiply-add); a kernel that fails or does not compile is simply not used.
"""

from __future__ import annotations

import torch

try:  # Triton is present wherever torch has CUDA; absent on CPU-only installs
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None

AVAILABLE = triton is not None

if AVAILABLE:

    @triton.jit
    def _qdq32(g, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """[BM, BK] fp32 -> per-32 FP8 quantize-dequantize, fp32."""
        g3 = tl.reshape(g, (BLOCK_M, BLOCK_K // 32, 32))
        amax = tl.maximum(tl.max(tl.abs(g3), axis=2), 1e-4)
        t = amax * (1.0 / 448.0)
        bits = t.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = ((e + 127) << 23).to(tl.float32, bitcast=True)
        q = g3 / s[:, :, None]
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        q = q.to(tl.float8e4nv).to(tl.float32) * s[:, :, None]
        return tl.reshape(q, (BLOCK_M, BLOCK_K))

    @triton.jit
    def _fp8_qdq_kernel(x_ptr, y_ptr, M, K, sx, sy, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        r64 = rows.to(tl.int64)
        g = tl.load(x_ptr + r64[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = _qdq32(g, BLOCK_M, BLOCK_K)
        tl.store(y_ptr + r64[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_qdq_kernel(
        gu_ptr,
        w_ptr,
        y_ptr,
        M,
        INTER,
        sg,
        sy,
        limit,
        HAS_LIMIT: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < M) & (cols[None, :] < INTER)
        r64 = rows.to(tl.int64)
        base = gu_ptr + r64[:, None] * sg + cols[None, :]
        gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + INTER, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        h = (gate / (1.0 + tl.exp(-gate))) * up
        if HAS_W:
            w = tl.load(w_ptr + rows, mask=rows < M, other=0.0)
            h = w[:, None] * h
        h = h.to(tl.bfloat16).to(tl.float32)
        y = _qdq32(h, BLOCK_M, BLOCK_K)
        tl.store(y_ptr + r64[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _hc_pre_kernel(h_ptr, p_ptr, y_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = d < D
        acc = tl.load(p_ptr + t * HC) * tl.load(h_ptr + t * HC * D + d, mask=m, other=0.0).to(tl.float32)
        for i in tl.static_range(1, HC):
            acc = acc + tl.load(p_ptr + t * HC + i) * tl.load(h_ptr + (t * HC + i) * D + d, mask=m, other=0.0).to(
                tl.float32
            )
        tl.store(y_ptr + t * D + d, acc.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _hc_post_kernel(x_ptr, r_ptr, post_ptr, comb_ptr, y_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = d < D
        xv = tl.load(x_ptr + t * D + d, mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(HC):
            acc = tl.load(comb_ptr + t * HC * HC + j) * tl.load(r_ptr + t * HC * D + d, mask=m, other=0.0).to(
                tl.float32
            )
            for i in tl.static_range(1, HC):
                c = tl.load(comb_ptr + t * HC * HC + i * HC + j)
                acc = acc + c * tl.load(r_ptr + (t * HC + i) * D + d, mask=m, other=0.0).to(tl.float32)
            y = tl.load(post_ptr + t * HC + j) * xv + acc
            tl.store(y_ptr + (t * HC + j) * D + d, y.to(y_ptr.dtype.element_ty), mask=m)


if AVAILABLE:

    @triton.jit
    def _sinkhorn_kernel(
        m_ptr,
        scale_ptr,
        base_ptr,
        pre_ptr,
        post_ptr,
        comb_ptr,
        T,
        eps,
        HC: tl.constexpr,
        ITERS: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        W: tl.constexpr = (2 + HC) * HC
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        t64 = t.to(tl.int64)
        c = tl.arange(0, HC)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        m2 = tm[:, None]
        pre = tl.load(m_ptr + t64[:, None] * W + c[None, :], mask=m2, other=0.0) * s0 + tl.load(base_ptr + c)[None, :]
        pre = 1.0 / (1.0 + tl.exp(-pre)) + eps
        post = tl.load(m_ptr + t64[:, None] * W + HC + c[None, :], mask=m2, other=0.0) * s1
        post = 2.0 * (1.0 / (1.0 + tl.exp(-(post + tl.load(base_ptr + HC + c)[None, :]))))
        ij = c[:, None] * HC + c[None, :]  # [HC, HC], row-major (i, j)
        m3 = tm[:, None, None]
        comb = tl.load(m_ptr + t64[:, None, None] * W + 2 * HC + ij[None, :, :], mask=m3, other=0.0) * s2
        comb = comb + tl.load(base_ptr + 2 * HC + ij)[None, :, :]
        comb = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])
        comb = comb / tl.sum(comb, axis=2)[:, :, None] + eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        tl.store(pre_ptr + t64[:, None] * HC + c[None, :], pre, mask=m2)
        tl.store(post_ptr + t64[:, None] * HC + c[None, :], post, mask=m2)
        tl.store(comb_ptr + t64[:, None, None] * (HC * HC) + ij[None, :, :], comb, mask=m3)


def sinkhorn_split(mixes, scale, base, hc: int, iters: int, eps: float):
    """``ops.sinkhorn_split`` in one kernel: mixes [..., (2 + hc) * hc] -> (pre, post, comb) fp32."""
    lead = mixes.shape[:-1]
    m = mixes.float().reshape(-1, mixes.size(-1)).contiguous()
    t = m.size(0)
    pre = torch.empty((t, hc), dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty((t, hc, hc), dtype=torch.float32, device=m.device)
    bt = 64
    _sinkhorn_kernel[(triton.cdiv(t, bt),)](
        m,
        scale.float().contiguous(),
        base.float().contiguous(),
        pre,
        post,
        comb,
        t,
        float(eps),
        HC=hc,
        ITERS=iters,
        BLOCK_T=bt,
    )
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


def fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """Per-32 FP8 QDQ of the last dim (a multiple of 32), output in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    bm, bk = 16, 256
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _fp8_qdq_kernel[grid](x2, y, m, k, x2.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_K=bk)
    return y.view(shape)


def swiglu_qdq(gu: torch.Tensor, weights: torch.Tensor | None, limit: float, out_dtype: torch.dtype) -> torch.Tensor:
    """gu [M, 2I] (gate | up) -> fp8_qdq(bf16(weights * silu(clamp gate) * clamp up)) [M, I]."""
    m, two_i = gu.shape
    inter = two_i // 2
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    y = torch.empty((m, inter), dtype=out_dtype, device=gu.device)
    bm, bk = 16, 256
    grid = (triton.cdiv(m, bm), triton.cdiv(inter, bk))
    w = weights.reshape(-1).float().contiguous() if weights is not None else gu
    _swiglu_qdq_kernel[grid](
        gu,
        w,
        y,
        m,
        inter,
        gu.stride(0),
        y.stride(0),
        float(limit),
        HAS_LIMIT=limit > 0,
        HAS_W=weights is not None,
        BLOCK_M=bm,
        BLOCK_K=bk,
    )
    return y


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    t, hc, d = h.shape
    h, pre = h.contiguous(), pre.float().contiguous()
    y = torch.empty((t, d), dtype=h.dtype, device=h.device)
    bd = 1024
    _hc_pre_kernel[(t, triton.cdiv(d, bd))](h, pre, y, d, HC=hc, BLOCK_D=bd)
    return y


def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    t, hc, d = residual.shape
    x, residual = x.contiguous(), residual.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    y = torch.empty((t, hc, d), dtype=x.dtype, device=x.device)
    bd = 1024
    _hc_post_kernel[(t, triton.cdiv(d, bd))](x, residual, post, comb, y, d, HC=hc, BLOCK_D=bd)
    return y
