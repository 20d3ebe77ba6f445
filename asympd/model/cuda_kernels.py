"""Fused elementwise kernels (Triton) for the CUDA path: one pass where the reference's torch code
makes five to twenty. Each computes the reference function of the same name:

- ``fp8_qdq``: per-32 FP8 activation quantize-dequantize (``quant.fp8_qdq``), bit-exact by
  construction (power-of-two scales from the exponent bits, round-to-nearest-even e4m3);
- ``swiglu_qdq``: the routed/shared expert middle: clamp, silu(gate) * up, times the routing weight,
  rounded to bf16, then ``fp8_qdq`` (``moe.swiglu`` between its two GEMMs);
- ``hc_pre`` / ``hc_post``: the mHC collapse and expand (``ops.hc_pre`` / ``ops.hc_post``) without the
  [T, hc, hc, D] fp32 intermediate the broadcast form materialises;
- ``fp4_qdq``: per-32 (UE8M0 scale) and per-16 (E4M3 scale) FP4 quantize-dequantize
  (``quant.fp4_qdq``), bit-exact: the torch form compares every value with 7 thresholds in a
  [..., 7] boolean tensor and sums it as int64 (at 16K rows of index queries, 8 ms a layer);
- ``hc_project``: the mHC mixes' projection, ``linear(h.float(), fn) * rsqrt(mean(h^2) + eps)``
  (``ops.hc_mixes``), one pass over the bf16 streams instead of an fp32 copy, a square, a mean and an
  fp32 GEMM (4.1-4.4 ms less a layer at 16K rows, measured);
- ``rms_norm``: ``ops.rms_norm`` in one pass a row;
- ``moe_combine``: the MoE's output, each token's routed slots read straight from the expert-sorted
  GEMM output and summed in fp32, plus the shared expert's, rounded once (``FastMoE.forward``: one
  pass instead of a gather of every slot row, an fp32 sum, an upcast, an add and a cast).

``cuda_ops.caps`` checks every kernel against the torch reference on the device before it is
used (exact equality for fp8_qdq and fp4_qdq, rounding tolerance for the others, where the compiler may
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


if AVAILABLE:

    @triton.jit
    def _round_e4m3(a):
        """Positive fp32 (<= 448) to the nearest e4m3 value, ties to even, in fp32 arithmetic that is
        exact everywhere (Triton's interpreter casts to float8 without rounding to nearest even)."""
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        qe = tl.maximum(e, -6) - 3  # the e4m3 quantum's exponent: 3 mantissa bits, subnormal below 2^-6
        k = a * ((127 - qe) << 23).to(tl.float32, bitcast=True)  # a / quantum, exact
        kf = tl.floor(k)
        frac = k - kf
        up = (frac > 0.5) | ((frac == 0.5) & ((kf.to(tl.int32) & 1) == 1))
        return (kf + up.to(tl.float32)) * ((qe + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_qdq_kernel(
        x_ptr,
        y_ptr,
        M,
        K,
        sx,
        sy,
        GROUP: tl.constexpr,
        E4M3_SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        r64 = rows.to(tl.int64)
        g = tl.load(x_ptr + r64[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g3 = tl.reshape(g, (BLOCK_M, BLOCK_K // GROUP, GROUP))
        amax = tl.max(tl.abs(g3), axis=2)
        if E4M3_SCALE:  # e4m3(amax / 6), amax floored at 6 * 2^-9; IEEE division as torch's
            a = tl.maximum(amax, 6.0 * 2.0**-9)
            s = tl.math.div_rn(a, tl.full(a.shape, 6.0, tl.float32))
            s = _round_e4m3(tl.minimum(s, 448.0))
            v = tl.math.div_rn(g3, tl.broadcast_to(s[:, :, None], g3.shape))
        else:  # 2^ceil(log2(amax / 6)) from the exponent bits, amax floored at 6 * 2^-126
            t = tl.maximum(amax, 6.0 * 2.0**-126) * (1.0 / 6.0)
            bits = t.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            s = ((e + 127) << 23).to(tl.float32, bitcast=True)
            v = g3 / s[:, :, None]  # a power of two: exact
        v = tl.minimum(tl.maximum(v, -6.0), 6.0)
        mag = tl.abs(v)
        # round to the nearest e2m1 magnitude, ties to the even code (quant.e2m1_codes' thresholds)
        q = tl.where(mag > 0.25, 0.5, 0.0)
        q = tl.where(mag >= 0.75, 1.0, q)
        q = tl.where(mag > 1.25, 1.5, q)
        q = tl.where(mag >= 1.75, 2.0, q)
        q = tl.where(mag > 2.5, 3.0, q)
        q = tl.where(mag >= 3.5, 4.0, q)
        q = tl.where(mag > 5.0, 6.0, q)
        # the sign bit: -0.0 and tiny negatives give -0.0, as the table's code 8 (Triton's unary minus
        # is 0 - q, which would give +0.0: a multiply keeps the sign)
        neg = v.to(tl.int32, bitcast=True) < 0
        y = tl.where(neg, q * -1.0, q) * s[:, :, None]
        y = tl.reshape(y, (BLOCK_M, BLOCK_K))
        tl.store(y_ptr + r64[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _hc_project_tile(h_ptr, fn_ptr, acc, sq, t64, tm, n, k0, K, N, BLOCK_K: tl.constexpr, BF16X3: tl.constexpr):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(h_ptr + t64[:, None] * K + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        w = tl.load(fn_ptr + n[:, None] * K + k[None, :], mask=(n[:, None] < N) & km[None, :], other=0.0)
        if BF16X3:  # bf16 rows: fp32 weights as hi + mid + lo bf16 parts (exact), three tensor-core dots
            w1 = w.to(tl.bfloat16)
            r = w - w1.to(tl.float32)
            w2 = r.to(tl.bfloat16)
            w3 = (r - w2.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(x, tl.trans(w1), acc)
            acc = tl.dot(x, tl.trans(w2), acc)
            acc = tl.dot(x, tl.trans(w3), acc)
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        xf = x.to(tl.float32)
        return acc, sq + tl.sum(xf * xf, axis=1)

    @triton.jit
    def _hc_project_kernel(
        h_ptr,
        fn_ptr,
        part_ptr,
        sq_ptr,
        T,
        K,
        N,
        K_PER_SPLIT,
        BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BF16X3: tl.constexpr,
        PIPELINE: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        split = tl.program_id(1)
        n = tl.arange(0, BLOCK_N)
        tm = t < T
        t64 = t.to(tl.int64)
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        k_lo = split * K_PER_SPLIT
        if PIPELINE:  # a counted loop: Triton pipelines the loads
            for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
                acc, sq = _hc_project_tile(h_ptr, fn_ptr, acc, sq, t64, tm, n, k0, K, N, BLOCK_K, BF16X3)
        else:  # the interpreter cannot take a tensor as a range bound
            k0 = k_lo
            while k0 < k_lo + K_PER_SPLIT:
                acc, sq = _hc_project_tile(h_ptr, fn_ptr, acc, sq, t64, tm, n, k0, K, N, BLOCK_K, BF16X3)
                k0 += BLOCK_K
        base = split.to(tl.int64) * T
        tl.store(part_ptr + (base + t64)[:, None] * BLOCK_N + n[None, :], acc, mask=tm[:, None])
        tl.store(sq_ptr + base + t64, sq, mask=tm)

    # SPLITS follows the step's rows (``hc_project``: 2-16 at 1-16K rows on an H200): as a constexpr
    # each new count was a compile mid-traffic that the start-up warm-up's sizes missed (0.5 s a
    # step at true depth, bench/results/first_steps.json). An argument it is one kernel for all, and
    # the loop stays unrolled to MAX_SPLITS with the splits past SPLITS masked off, so every load is
    # issued at once (a loop to SPLITS serialised them: 2-6 us more a call, glue_hc_finish_new.json)
    @triton.jit(do_not_specialize=("SPLITS",))
    def _hc_project_finish(
        part_ptr, sq_ptr, y_ptr, T, K, N, eps, SPLITS, MAX_SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """The splits' partial sums added in a fixed order (the same bits every run), then the scale."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        n = tl.arange(0, BLOCK_N)
        tm = t < T
        t64 = t.to(tl.int64)
        acc = tl.load(part_ptr + t64[:, None] * BLOCK_N + n[None, :], mask=tm[:, None], other=0.0)
        sq = tl.load(sq_ptr + t64, mask=tm, other=0.0)
        for s in tl.static_range(1, MAX_SPLITS):
            ms = tm & (s < SPLITS)
            acc += tl.load(part_ptr + (s * T + t64)[:, None] * BLOCK_N + n[None, :], mask=ms[:, None], other=0.0)
            sq += tl.load(sq_ptr + s * T + t64, mask=ms, other=0.0)
        r = tl.math.rsqrt(sq / K + eps)
        tl.store(y_ptr + t64[:, None] * N + n[None, :], acc * r[:, None], mask=tm[:, None] & (n[None, :] < N))

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, sx, sy, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_ptr + row * sx + d, mask=m, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + d, (w * (x * r)).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _moe_combine_kernel(
        out_ptr, inv_ptr, shared_ptr, y_ptr, D, s_o, s_s, s_y, K: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        """Token t: sum over its slots s (ascending, from +0) of row inv[t * K + s] of ``out``, plus
        its shared-expert row, in fp32; one rounding to y's dtype."""
        t = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        m = d < D
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for s in tl.static_range(K):
            r = tl.load(inv_ptr + t * K + s).to(tl.int64)
            acc += tl.load(out_ptr + r * s_o + d, mask=m, other=0.0).to(tl.float32)
        acc += tl.load(shared_ptr + t * s_s + d, mask=m, other=0.0).to(tl.float32)
        if y_ptr.dtype.element_ty == tl.bfloat16:  # round to nearest even on the bits (the interpreter's
            u = acc.to(tl.uint32, bitcast=True)  # cast truncates; the device's cvt.rn gives the same)
            u = u + 0x7FFF + ((u >> 16) & 1)
            tl.store(y_ptr + t * s_y + d, (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
        else:
            tl.store(y_ptr + t * s_y + d, acc.to(y_ptr.dtype.element_ty), mask=m)


def fp4_qdq(x: torch.Tensor, block: int = 32, e4m3_scale: bool = False) -> torch.Tensor:
    """``quant.fp4_qdq`` of the last dim (a multiple of ``block``), output in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    bm, bk = 16, 128
    grid = (triton.cdiv(m, bm), triton.cdiv(k, bk))
    _fp4_qdq_kernel[grid](
        x2, y, m, k, x2.stride(0), y.stride(0), GROUP=block, E4M3_SCALE=e4m3_scale, BLOCK_M=bm, BLOCK_K=bk
    )
    return y.view(shape)


MAX_HC_SPLITS = 16  # hc_project's K splits at most (its finish kernel is unrolled to this)


def hc_project(
    h: torch.Tensor,
    fn: torch.Tensor,
    norm_eps: float,
    splits: int | None = None,
    *,
    block_t: int | None = None,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """h [T, hc, D], fn [N, hc * D] fp32 -> fp32 [T, N]: the projection of the flattened streams
    scaled by their reciprocal RMS (``ops.hc_mixes`` before ``sinkhorn_split``). bf16 streams on
    CUDA take the tensor cores with fn split into three bf16 parts (each product exact in fp32, as in
    the fp32 GEMM); the K dim is split across programs when the rows alone fill too few SMs, and the
    partial sums are added in a fixed order (deterministic). The launch arguments are
    ``bench/glue_kernels.py``'s sweep (the defaults: the measured best)."""
    t = h.size(0)
    h2 = h.reshape(t, h.size(1) * h.size(2))
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    k, n = h2.size(1), fn.size(0)
    y = torch.empty((t, n), dtype=torch.float32, device=h.device)
    if t == 0:
        return y
    # 64-row tiles of 64-wide K steps: within 4 % of the best launch at 512-16384 rows, 1.35-2.4x the
    # earlier rule (16-row tiles below 2048 rows, K steps of 128) at 512-4096 rows (glue_kernels.json)
    bt, bk = block_t or 64, block_k
    bn = max(16, triton.next_power_of_2(n))
    n_t = triton.cdiv(t, bt)
    if splits is None:
        sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 1
        splits = max(1, min(MAX_HC_SPLITS, triton.cdiv(2 * sms, n_t)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, t, bn), dtype=torch.float32, device=h.device)
    sq = torch.empty((splits, t), dtype=torch.float32, device=h.device)
    fn = fn.float().contiguous()
    bf16x3 = h.is_cuda and h.dtype == torch.bfloat16  # (the interpreter's bf16 dot is not exact)
    launch = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    _hc_project_kernel[(n_t, splits)](
        h2, fn, part, sq, t, k, n, k_per_split, BLOCK_T=bt, BLOCK_K=bk, BLOCK_N=bn, BF16X3=bf16x3, PIPELINE=h.is_cuda,
        **launch,
    )  # fmt: skip
    finish = (triton.cdiv(t, 64),)
    if splits > MAX_HC_SPLITS:
        raise ValueError(f"hc_project: at most {MAX_HC_SPLITS} splits of K, got {splits}")
    _hc_project_finish[finish](
        part, sq, y, t, k, n, float(norm_eps), splits, MAX_SPLITS=MAX_HC_SPLITS, BLOCK_T=64, BLOCK_N=bn
    )
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.rms_norm`` over the last dim, one program a row, output in x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, d = x2.shape
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m:
        _rms_norm_kernel[(m,)](
            x2, weight.contiguous(), y, d, x2.stride(0), y.stride(0), float(eps), BLOCK_D=triton.next_power_of_2(d)
        )
    return y.view(shape)


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


def moe_combine(out: torch.Tensor, inv: torch.Tensor, k: int, shared: torch.Tensor) -> torch.Tensor:
    """out [T * k, D]: the routed slots' outputs in expert-sorted order, slot s of token t at row
    inv[t * k + s]; shared [T, D] -> [T, D] in shared's dtype: ``(out[inv].view(T, k, D).sum(1) +
    shared).to(shared.dtype)`` in fp32, without the gathered copy."""
    t, d = shared.shape
    if out.stride(-1) != 1 or shared.stride(-1) != 1:
        raise ValueError("moe_combine: rows must be contiguous")
    y = torch.empty_like(shared)
    if t == 0:
        return y
    bd = min(1024, triton.next_power_of_2(d))
    _moe_combine_kernel[(t, triton.cdiv(d, bd))](
        out, inv.contiguous(), shared, y, d, out.stride(0), shared.stride(0), y.stride(0), K=k, BLOCK_D=bd
    )
    return y
