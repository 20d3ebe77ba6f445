"""Triton GEMMs on the release's weight formats, so weights stay packed on the device.

- ``fp8_tile_gemm``: ``y = a @ W^T`` with W e4m3 ``[N, K]`` and one UE8M0 scale per 32x32 tile (the
  attention matrices, the shared expert, Engram's ``wkv``). Decode sizes (<= 256 rows, CUDA) take
  the transposed ``_fp8_tile_swap_kernel`` (expanded weights as wgmma's register operand, split K
  reduced in the same launch); ``config={"swap_ab": False}`` keeps the first kernel;
- ``mxfp4_moe_gemm``: the routed experts. Rows arrive sorted by expert; row r multiplies
  ``W[expert(r)]`` packed e2m1 ``[E, N, K/2]`` with one UE8M0 scale per 32 K elements, its bytes permuted
  once at load (``repack_fp4``) so each 16-byte load meets two contiguous halves of the activations.
  ``config={"swap_ab": True}`` selects a transposed variant for decode-sized M-blocks
  (``_mxfp4_moe_swap_kernel``: expanded weights as wgmma's register operand, the scale applied
  after the dot, a cheaper decode; the CUDA default in bf16 for M-blocks of <= 32 rows since measured).
  ``config={"fp8": True}`` runs that transposed tile on FP8 tensor cores (``_mxfp4_moe_fp8_kernel``:
  e2m1 expanded to e4m3 in registers, the activations' own e4m3 codes, one FP8 wgmma per 32-K scale
  block rescaled in fp32; docs/moe_fp8.md); off by default until timed on the device.
  ``config={"scaled": True}`` / ``{"scaled_swap": True}`` hand the e2m1 upcast to Triton's
  ``tl.dot_scaled`` (``_mxfp4_moe_scaled_kernel``; the swap form makes the weight the left operand,
  as Triton's own Hopper MoE kernels do; docs/moe_dot_scaled.md); CUDA only, off by default until
  timed on the device.
  Every MXFP4 kernel also reads the experts tiled (``tile_fp4``, ``packed.TILE_N``: the same bytes
  as ``[E, N/BN, K/32, BN, 16]``), so one program's 32-K step is one contiguous run of whole lines.

The bf16 kernels expand the weight tile in registers to the activation dtype and run one dot with fp32
accumulation. The expansion is exact (e4m3 and e2m1 values times a power of two fit bf16), and the
activations arrive already through the reference's per-32 FP8 quantize-dequantize, so the result is
the reference's block-scaled GEMM up to summation order.

Why bf16 dots on expanded weights rather than FP8 tensor cores: the reference's activation scales
are per 32 K elements, so an FP8 dot would have to be rescaled every 32 K (one wgmma K-step);
expanding in registers keeps one long dot. The FP8 kernel pays that rescale (2 fp32 instructions
per accumulator element per 32 K) for a shorter decode and half the MMA instructions; which wins
where is the device's to say (docs/moe_fp8.md). Decode-sized steps read the release's 1 B (FP8) / 0.53 B
(FP4) per weight instead of bf16's 2 B, but today the instructions that expand FP4 bound them rather
than the bytes; large prefill chunks run at the bf16 tensor-core rate (docs/performance.md §9).

Small-M steps split K over several programs (``split_k``) so even a 512-row matrix fills the chip;
the partial sums are added in a fixed order afterwards (deterministic, no atomics).
With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (how the CPU test suite checks them).
"""

from __future__ import annotations

import torch

from asympd.model import moe_gluon as MG
from asympd.model.fp4_ptx import FP4_LUT_PAIRS

try:  # Triton ships with CUDA builds of torch; on CPU-only installs it is optional (tests use it)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None

AVAILABLE = triton is not None


def _dot_f32(a: torch.Tensor) -> bool:
    """fp32 dots (IEEE) for fp32 activations, and on CPU: the interpreter's bf16 dot is wrong
    (Triton 3.6 with numpy 2.4); bf16 products are exact in fp32, so the function is the same."""
    return a.dtype == torch.float32 or not a.is_cuda


if AVAILABLE:

    @triton.jit
    def _ue8m0(s):
        """UE8M0 bytes -> fp32 powers of two (2^(s - 127))."""
        return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_halves(p, scale):
        """Packed bytes (int32, sign-extended) -> (low-nibble, high-nibble) e2m1 values times
        ``scale``. The 3 magnitude bits go straight to fp32 exponent/mantissa bits 24..22, which
        reads as 2^(e-127) * (1 + m/2) (e = 0: the subnormal m/2 * 2^-126, exactly e2m1's own
        subnormal); times 2^126 that is the e2m1 value. Four integer ops and two exact multiplies
        a value (2^126 * scale itself can overflow fp32, so they stay two)."""
        lo = (((p & 7) << 22) | ((p & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37 * scale
        hi = (((p & 0x70) << 18) | ((p & 0x80) << 24)).to(tl.float32, bitcast=True) * 8.507059173023462e37 * scale
        return lo, hi

    # e2m1 -> bf16 by table lookup, four packed bytes per 32-bit lane (the Marlin approach): PRMT picks,
    # for each byte's 3-bit magnitude, the high and the low byte of its bf16 value from an 8-entry
    # table held in two immediates; two more PRMTs interleave them into bf16 pairs, and the sign bits
    # are moved to bit 15 of each half. About 4 instructions a value (the bit-building path: ~8).
    # Outputs: $0,$1 the four low-nibble values (elements j), $2,$3 the high-nibble ones (j + 16).
    _FP4_LUT_NIBBLES = """
        and.b32 x, {w}, 0x07070707;
        shr.u32 y, x, 4;
        or.b32 y, x, y;
        prmt.b32 sel, y, z, 0x4420;
        prmt.b32 hb, th0, th1, sel;
        prmt.b32 lb, tl0, tl1, sel;
        and.b32 s, {w}, 0x08080808;
        prmt.b32 t, s, z, 0x4140;
        shl.b32 t, t, 12;
        prmt.b32 {o0}, lb, hb, 0x5140;
        or.b32 {o0}, {o0}, t;
        prmt.b32 t, s, z, 0x4342;
        shl.b32 t, t, 12;
        prmt.b32 {o1}, lb, hb, 0x7362;
        or.b32 {o1}, {o1}, t;
    """
    _FP4_LUT_ASM = tl.constexpr(
        "{ .reg .b32 x, y, sel, hb, lb, s, t, w, z, th0, th1, tl0, tl1;\n"
        "mov.b32 z, 0; mov.b32 th0, 0x3F3F3F00; mov.b32 th1, 0x40404040;\n"
        "mov.b32 tl0, 0xC0800000; mov.b32 tl1, 0xC0804000;\n"
        + _FP4_LUT_NIBBLES.format(w="$4", o0="$0", o1="$1")
        + "shr.u32 w, $4, 4;\n"
        + _FP4_LUT_NIBBLES.format(w="w", o0="$2", o1="$3")
        + "}"
    )

    @triton.jit
    def _fp4_lut(p):
        """Packed bytes (int8, kernel order) -> (low-nibble, high-nibble) e2m1 values in bf16 (CUDA only)."""
        return tl.inline_asm_elementwise(
            _FP4_LUT_ASM, "=r,=r,=r,=r,r", [p], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )

    @triton.jit
    def _fp8_tile_gemm_kernel(
        a_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        M,
        N,
        s_am,
        s_ag,
        s_wn,
        s_sn,
        s_ys,
        s_ym,
        s_yg,
        n_per_group,
        K: tl.constexpr,
        K_PER_SPLIT: tl.constexpr,
        DOT_F32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] tile of group ``program_id(2) // splits``'s output, summed over one
        K split. Groups: weight rows [g*n_per_group, (g+1)*n_per_group) take input group g."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        splits: tl.constexpr = (K + K_PER_SPLIT - 1) // K_PER_SPLIT
        g = tl.program_id(2) // splits
        split = tl.program_id(2) % splits
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        wrows = g * n_per_group + cols
        rmask = rows < M
        r64 = rows.to(tl.int64)
        w64 = wrows.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = split * K_PER_SPLIT
        kk = tl.arange(0, 32)
        cmask = cols < n_per_group
        for k32 in range(0, K_PER_SPLIT, 32):  # one UE8M0 tile column per step: a row scale, no reshape
            k0 = k_lo + k32
            ks = k0 + kk
            kmask = ks < K
            a_ptrs = a_ptr + r64[:, None] * s_am + g * s_ag + ks[None, :]
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + w64[:, None] * s_wn + ks[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            sc = _ue8m0(tl.load(s_ptr + (w64 // 32) * s_sn + k0 // 32, mask=cmask & (k0 < K), other=0))
            wv = w.to(tl.float32) * sc[:, None]  # exact: e4m3 times a power of two
            if DOT_F32:
                acc = tl.dot(a.to(tl.float32), tl.trans(wv), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(wv.to(a.dtype)), acc)
        out = y_ptr + split * s_ys + r64[:, None] * s_ym + g * s_yg + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < n_per_group))

    # ---- FP8-tile GEMM, decode regime (transposed tile; its own section: the MXFP4 kernels below are
    # edited separately) ------------------------------------------------------------------------------

    @triton.jit
    def _fp8_tile_swap_kernel(
        a_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        part_ptr,
        cnt_ptr,
        M,
        s_am,
        s_ag,
        s_wn,
        s_sn,
        s_ym,
        s_yg,
        n_per_group,
        KB_PER_SPLIT: tl.constexpr,
        SPLITS: tl.constexpr,
        UNROLL: tl.constexpr,
        DOT_F32: tl.constexpr,
        SCALE_AFTER: tl.constexpr,
        K_ORDER: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """``_fp8_tile_gemm_kernel``'s tile computed transposed for few rows (the FP8-tile counterpart
        of ``_mxfp4_moe_swap_kernel``): ``acc^T [BLOCK_N, BLOCK_M] += W [BLOCK_N, 32] @ a^T [32,
        BLOCK_M]``, one dot per 32-K tile column. The e4m3 weights are expanded to the activations'
        dtype in registers (exact) and are the dot's first operand, which wgmma reads from registers;
        only the few activation rows go through shared memory. The activations arrive through the
        reference's per-32 quantize-dequantize, so their per-(row, 32-K) scale is already in their
        (exact) values. ``SCALE_AFTER``: each weight row's tile scale multiplies the K = 32 dot's fp32
        result (BLOCK_M / 32 FMAs a weight) instead of the expanded weights (one multiply a weight).
        ``K_ORDER``: K permuted within each 32-K tile column (weights and activations alike, so the
        dot is unchanged): the thread that loads bytes 8c..8c+7 of a weight row holds exactly the
        columns wgmma's register fragment wants from it (2c, 2c+1, +8, +16, +24: column 8i + 2c + t
        is element 8c + 2i + t), so the weights leave shared memory in 8-byte reads instead of
        2-byte ones; the activations are then read in 4-byte pairs.

        The hot loop in sm_90a SASS (Triton 3.6's ptxas, offline: K 5120, BLOCK_N 128, UNROLL 2, 4
        warps, 64 weights a thread an iteration), instructions a weight: BLOCK_M 16: 5.02, with
        ``K_ORDER`` 4.42 (of which 2.1 the e4m3 -> bf16 conversion: F2F, F2FP, PRMT), the scale on
        the weights 4.95; BLOCK_M 32: 5.52 / 5.23 / 5.19; BLOCK_M 64: 6.50 / 6.59 / 5.78 (247
        registers with the scale after the dot, 128 without). The first kernel: 7.9 (BLOCK_M 16,
        BLOCK_N 64). Hence the defaults: the scale after the dot for BLOCK_M <= 16, ``K_ORDER`` for
        BLOCK_M <= 32; the device's timings decide (``bench/formats.py`` ``linears``).

        Rows past M read row M - 1 and weight rows past the group read its last row, and splits cover
        whole unrolled steps, so the loop carries no masks; only the store is masked.

        ``SPLITS`` > 1 (split K, for the small-N matrices to fill the chip): every split writes its
        fp32 partial tile to ``part_ptr``, then takes a ticket from the tile's counter; the one that
        draws the last ticket adds the ``SPLITS`` partials in split order (the same order whichever
        program it is: deterministic), writes the output and resets the counter for the next call.
        One launch, no separate reduction kernel (which costs about as much as these GEMMs' floors)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        g = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        src = tl.minimum(rows, M - 1).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < n_per_group
        wrows = (g * n_per_group + tl.minimum(cols, n_per_group - 1)).to(tl.int64)
        kk = tl.arange(0, 32)
        kb_lo = split * KB_PER_SPLIT
        w_ptrs = w_ptr + wrows[:, None] * s_wn + kb_lo * 32 + kk[None, :]
        s_ptrs = s_ptr + (wrows // 32) * s_sn + kb_lo
        if K_ORDER:  # see K_ORDER above: the activations read in the permuted K order
            ka = (kk % 8 // 2) * 8 + (kk // 8) * 2 + kk % 2
        else:
            ka = kk
        a_ptrs = a_ptr + src[:, None] * s_am + g * s_ag + kb_lo * 32 + ka[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb0 in range(0, KB_PER_SPLIT, UNROLL):
            for u in tl.static_range(UNROLL):
                kb = kb0 + u
                w = tl.load(w_ptrs + kb * 32)
                if K_ORDER:
                    w = w.reshape(BLOCK_N, 4, 4, 2).permute(0, 2, 1, 3).reshape(BLOCK_N, 32)
                sc = _ue8m0(tl.load(s_ptrs + kb))[:, None]
                a_k = tl.load(a_ptrs + kb * 32)
                if SCALE_AFTER:
                    if DOT_F32:
                        t = tl.dot(w.to(tl.float32), tl.trans(a_k.to(tl.float32)), input_precision="ieee")
                    else:
                        t = tl.dot(w.to(a_k.dtype), tl.trans(a_k))
                    acc += t * sc
                elif DOT_F32:
                    wv = w.to(tl.float32) * sc
                    acc = tl.dot(wv, tl.trans(a_k.to(tl.float32)), acc, input_precision="ieee")
                else:
                    wv = (w.to(tl.float32) * sc).to(a_k.dtype)  # exact: e4m3 times a power of two
                    acc = tl.dot(wv, tl.trans(a_k), acc)
        out_mask = rmask[None, :] & cmask[:, None]
        out = y_ptr + rows.to(tl.int64)[None, :] * s_ym + g * s_yg + cols[:, None]
        if SPLITS == 1:
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tile = (tl.program_id(2) // SPLITS * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
            p_offs = rows.to(tl.int64)[None, :] * (tl.num_programs(1) * BLOCK_N) + cols[:, None]
            p_base = part_ptr + (g * SPLITS).to(tl.int64) * M * tl.num_programs(1) * BLOCK_N
            p_step = M * tl.num_programs(1) * BLOCK_N
            tl.store(p_base + split * p_step + p_offs, acc, mask=rmask[None, :])
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLITS - 1:  # the last split of this tile: reduce in split order
                tot = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                # four partials' loads in flight at once, added in split order
                p_ptrs = p_base + p_offs
                pm = rmask[None, :]
                CG: tl.constexpr = ".cg"  # from L2: the other programs wrote them
                for s0 in range(0, SPLITS, 4):
                    p0 = tl.load(p_ptrs + s0 * p_step, mask=pm, other=0.0, cache_modifier=CG)
                    p1 = tl.load(p_ptrs + (s0 + 1) * p_step, mask=pm & (s0 + 1 < SPLITS), other=0.0, cache_modifier=CG)
                    p2 = tl.load(p_ptrs + (s0 + 2) * p_step, mask=pm & (s0 + 2 < SPLITS), other=0.0, cache_modifier=CG)
                    p3 = tl.load(p_ptrs + (s0 + 3) * p_step, mask=pm & (s0 + 3 < SPLITS), other=0.0, cache_modifier=CG)
                    tot = (((tot + p0) + p1) + p2) + p3
                tl.store(out, tot.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _tile_bases(w_ptr, s_ptr, e, pid_n, s_we, s_wt, s_wn, s_se, s_st, s_sn, BLOCK_N: tl.constexpr):
        """Per weight row of an N-block: the address of its first packed byte and first scale, for
        either layout (``tile_fp4``): rows [E, N, K/2] (``s_wt`` = BLOCK_N rows) or tiles [E, N/BN,
        K/32, BN, 16] (``s_wn`` = 16). The K step (``W_STEP``/``S_STEP``) is the caller's constexpr."""
        nl = tl.arange(0, BLOCK_N).to(tl.int64)
        e64 = e.to(tl.int64)
        t64 = pid_n.to(tl.int64)
        return w_ptr + e64 * s_we + t64 * s_wt + nl * s_wn, s_ptr + e64 * s_se + t64 * s_st + nl * s_sn

    @triton.jit
    def _mxfp4_moe_kernel(
        a_ptr,
        a_rows_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        block_expert_ptr,
        block_row0_ptr,
        block_row1_ptr,
        N,
        s_am,
        s_we,
        s_wt,
        s_wn,
        s_se,
        s_st,
        s_sn,
        s_ys,
        s_ym,
        K: tl.constexpr,
        KB_PER_SPLIT: tl.constexpr,
        UNROLL: tl.constexpr,
        N_EXPERTS: tl.constexpr,
        GATHER: tl.constexpr,
        W_STEP: tl.constexpr,
        S_STEP: tl.constexpr,
        DOT_F32: tl.constexpr,
        LUT: tl.constexpr,
        LUT_PAIRS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Output rows [row0, row1) of one expert's M-block (rows sorted by expert), columns of one
        N-block. Blocks past the last real one carry expert id N_EXPERTS and return at once.
        ``LUT_PAIRS``: the table decode of ``_FP4_LUT_PAIRS_ASM`` instead of ``_FP4_LUT_ASM`` (the
        same values; 342 instead of 466 SASS instructions a loop iteration, see the swap kernel)."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_b)
        if e >= N_EXPERTS:
            return
        row0 = tl.load(block_row0_ptr + pid_b)
        row1 = tl.load(block_row1_ptr + pid_b)
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row1
        if GATHER:
            src = tl.load(a_rows_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_base, s_base = _tile_bases(w_ptr, s_ptr, e, pid_n, s_we, s_wt, s_wn, s_se, s_st, s_sn, BLOCK_N)
        w_base = w_base[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kk = tl.arange(0, 16)
        kb_lo = tl.program_id(2) * KB_PER_SPLIT
        for kb0 in range(0, KB_PER_SPLIT, UNROLL):
            for u in tl.static_range(UNROLL):  # one 32-element scale block: 16 bytes of every row
                kb = kb_lo + kb0 + u
                live = kb < K // 32
                p = tl.load(w_base + kb * W_STEP + kk[None, :], mask=cmask[:, None] & live, other=0)
                sc = _ue8m0(tl.load(s_base + kb * S_STEP, mask=cmask & live, other=0))[:, None]
                if LUT:  # elements kb*32 + j and kb*32 + 16 + j (see repack_fp4)
                    if LUT_PAIRS:
                        lo, hi = _fp4_lut_pairs(p)
                    else:
                        lo, hi = _fp4_lut(p)
                    lo, hi = lo * sc.to(tl.bfloat16), hi * sc.to(tl.bfloat16)
                else:
                    lo, hi = _fp4_halves(p.to(tl.int32), sc)
                a_row = a_ptr + src[:, None] * s_am + kb * 32 + kk[None, :]
                a_lo = tl.load(a_row, mask=rmask[:, None] & live, other=0.0)
                a_hi = tl.load(a_row + 16, mask=rmask[:, None] & live, other=0.0)
                if DOT_F32:
                    acc = tl.dot(a_lo.to(tl.float32), tl.trans(lo), acc, input_precision="ieee")
                    acc = tl.dot(a_hi.to(tl.float32), tl.trans(hi), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a_lo, tl.trans(lo.to(a_lo.dtype)), acc)
                    acc = tl.dot(a_hi, tl.trans(hi.to(a_hi.dtype)), acc)
        y_ptr += tl.program_id(2) * s_ys
        out = y_ptr + rows.to(tl.int64)[:, None] * s_ym + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    # e2m1 -> bf16 for the swapped kernel, unscaled (its scale is applied after the dot): 15
    # instructions per 4 packed bytes (8 values) instead of the table above's 31. The magnitudes
    # of all 8 nibbles serve as PRMT selectors as they lie (q & 0x77777777: byte i = low | high << 4),
    # so one lookup yields the high (or low) bf16 bytes of four values; a sign-replicating PRMT
    # turns each nibble's sign bit into a byte mask that one LOP3 merges into the high bytes; four
    # PRMTs interleave low and high bytes into bf16 pairs. Elementwise like ``_fp4_lut``: $0,$1 the
    # four low-nibble values, $2,$3 the high-nibble ones (checked against every byte on CPU by an
    # emulation of these instructions, tests/model/test_packed.py).
    _FP4_LUT_PAIRS_ASM = tl.constexpr(FP4_LUT_PAIRS)

    @triton.jit
    def _fp4_lut_pairs(p):
        """Packed bytes (int8, kernel order) -> (low-nibble, high-nibble) e2m1 values in bf16, unscaled (CUDA only)."""
        return tl.inline_asm_elementwise(
            _FP4_LUT_PAIRS_ASM, "=r,=r,=r,=r,r", [p], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )

    @triton.jit
    def _mma_k_order(lo, hi, R: tl.constexpr):
        """Halves [R, 16] of one 32-element block (``lo[:, j]`` = element j, ``hi[:, j]`` = element
        j + 16) -> [R, 32] with column 16h + 8i + 2c + t = element 16h + 4c + 2i + t.

        A permutation of K (the weights and the activations take the same one, so the dot is
        unchanged) chosen so that the lane owning bytes 4c..4c+3 of a row in the weight's load holds
        exactly what the MMA fragment wants from it: columns 2c, 2c+1 (+8, +16, +24), as bf16 pairs
        in the order the decode packs them. Triton then keeps the decoded values in the registers
        the MMA reads instead of moving them between lanes."""
        x = tl.join(lo.reshape(R, 4, 2, 2), hi.reshape(R, 4, 2, 2))  # [R, c, i, t, h]
        return x.permute(0, 4, 2, 1, 3).reshape(R, 32)

    @triton.jit
    def _block_rows_unmasked(
        pid_b, block_row0_ptr, block_row1_ptr, a_rows_ptr, BLOCK_M: tl.constexpr, GATHER: tl.constexpr
    ):
        """An M-block's sorted rows, which of them are real, and the activation row each reads: rows
        past the block read a real row (so the transposed kernels' loops need no masks); their
        columns are never stored."""
        row0 = tl.load(block_row0_ptr + pid_b)
        row1 = tl.load(block_row1_ptr + pid_b)
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row1
        if GATHER:
            src = tl.load(a_rows_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            src = tl.minimum(rows, row1 - 1).to(tl.int64)
        return rows, rmask, src

    @triton.jit
    def _mxfp4_moe_swap_kernel(
        a_ptr,
        a_rows_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        block_expert_ptr,
        block_row0_ptr,
        block_row1_ptr,
        N,
        s_am,
        s_we,
        s_wt,
        s_wn,
        s_se,
        s_st,
        s_sn,
        s_ys,
        s_ym,
        K: tl.constexpr,
        KB_PER_SPLIT: tl.constexpr,
        UNROLL: tl.constexpr,
        N_EXPERTS: tl.constexpr,
        GATHER: tl.constexpr,
        W_STEP: tl.constexpr,
        S_STEP: tl.constexpr,
        EVEN_N: tl.constexpr,
        DOT_F32: tl.constexpr,
        LUT: tl.constexpr,
        SCALE_AFTER: tl.constexpr,
        WIDE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The same tile as ``_mxfp4_moe_kernel``, computed transposed for few rows per expert
        (``config={"swap_ab": True}``): ``acc^T [BLOCK_N, BLOCK_M] += W [BLOCK_N, 32] @ a^T [32,
        BLOCK_M]``, one dot per 32-element scale block (K = 32: two wgmma K-steps). The expanded
        weights are the dot's first operand, which Hopper's wgmma reads from registers (M = BLOCK_N,
        a multiple of 64; BLOCK_M = 16 or 8 is wgmma's N), so they are not staged through shared
        memory; only the few activation rows are (the B operand, loaded straight into shared memory
        in the permuted K order of ``_mma_k_order``). Splits cover whole unrolled steps, so the loop
        carries no masks.

        ``SCALE_AFTER``: the block's UE8M0 scale multiplies the dot's [BLOCK_N, BLOCK_M] result
        (BLOCK_M / 32 fp32 FMAs per weight) instead of every expanded weight (one bf16 multiply
        per weight, which ptxas pairs into HMUL2: 0.5). The count it was chosen by: instructions in
        the hot loop of the sm_90a SASS, compiled offline (``ASYMPD_BENCH_SASS=1 python
        bench/formats.py``: Triton 3.6 and its ptxas; K 5120, BLOCK_N 128, UNROLL 2, 4 warps: 64
        weights a thread an iteration):

        ================================  ===============  ===============
        kernel                            BLOCK_M = 16     BLOCK_M = 32
        ================================  ===============  ===============
        ``_mxfp4_moe_kernel`` (current)   466 (7.3 / w)    532 (8.3 / w)
        the same, ``lut_pairs``           342 (5.3 / w)    424 (6.6 / w)
        swap_ab, scale after the dot      299 (4.7 / w)    341 (5.3 / w)
        swap_ab, scale per weight         313 (4.9 / w)    321 (5.0 / w)
        ================================  ===============  ===============

        so the scale goes after the dot for BLOCK_M <= 16 and on the weights above. Of the 299: 120
        decode (``_FP4_LUT_PAIRS_ASM``, 15 a packed word), ~30 copies of its table constant that
        ptxas rematerializes, 32 FMAs, 16 PRMTs that pack the loaded bytes (two rows' pairs) for
        the decode, the rest loads, scales, wgmma, loop. UNROLL 4: 534 per 128 weights (4.2 / w),
        126 registers.

        After the ncu profile (bench/results/ncu_moe_0c746c4.txt: 59 % excess global sectors, 5
        programs an SM at 83 registers, waits on shared memory and barriers), the same offline
        count for the variants it suggested (BLOCK_M 16 / 32; r: registers; programs an SM from
        registers rounded to 8 a thread):

        ==================================  ==========================  ==========================
        variant                             BLOCK_M = 16                BLOCK_M = 32
        ==================================  ==========================  ==========================
        as above (rows layout)              299, 83 r (5 an SM)         341, 127 r
        tiled weights (``tile_fp4``)        302, 76 r (6 an SM)         340, 126 r
        tiled, ``maxnreg`` 72               314, 72 r (7 an SM), no     (96: 17 spill loads)
                                            spills
        ``wide`` (one dot a step), tiled    322, 95 r (5 an SM)         338, 116 r
        ==================================  ==========================  ==========================

        The loads behind them: each thread's weight load is one row's 16 bytes (LDGSTS.128); in the
        row layout a warp's 32 rows lie 2.5 KB apart, half a sector each (the profile's excess
        sectors), tiled they are 512 contiguous bytes, and a step's scales are 128 consecutive
        bytes instead of a byte a row. ``wide`` stages one activation tile per step (3 barriers a
        step instead of 4, still cp.async) for 20 more instructions and 19 more registers (scales
        on the weights, HMUL2): which wins is the device's to say."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_b)
        if e >= N_EXPERTS:
            return
        rows, rmask, src = _block_rows_unmasked(pid_b, block_row0_ptr, block_row1_ptr, a_rows_ptr, BLOCK_M, GATHER)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        kk = tl.arange(0, 16)
        w_ptrs, s_ptrs = _tile_bases(w_ptr, s_ptr, e, pid_n, s_we, s_wt, s_wn, s_se, s_st, s_sn, BLOCK_N)
        w_ptrs = w_ptrs[:, None] + kk[None, :]
        KW: tl.constexpr = 32 * UNROLL if WIDE else 32  # K of one dot
        kc = tl.arange(0, KW)  # see _mma_k_order: each 16-element half permuted within itself
        k_elem = (kc // 16) * 16 + ((kc // 2) % 4) * 4 + ((kc // 8) % 2) * 2 + kc % 2
        a_ptrs = a_ptr + src[:, None] * s_am + k_elem[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        kb_lo = tl.program_id(2) * KB_PER_SPLIT
        uu = tl.arange(0, UNROLL)
        for kb0 in range(0, KB_PER_SPLIT, UNROLL):  # splits divide K exactly (see the wrapper): no masks
            if SCALE_AFTER or WIDE:  # the step's scales in one load (one layout conversion, not UNROLL)
                s_step = _ue8m0(
                    tl.load(s_ptrs[:, None] + (kb_lo + kb0 + uu[None, :]) * S_STEP, mask=cmask[:, None], other=0)
                )
            if WIDE:  # the whole step as one dot: one activation tile staged per UNROLL blocks
                kbw = kb_lo + kb0
                pw = w_ptrs[:, None, :] + (kbw + uu)[None, :, None] * W_STEP  # [BLOCK_N, UNROLL, 16]
                if EVEN_N:
                    p = tl.load(pw)
                else:
                    p = tl.load(pw, mask=cmask[:, None, None], other=0)
                if LUT:
                    lo, hi = _fp4_lut_pairs(p)
                    sc = s_step.to(tl.bfloat16)[:, :, None]
                    lo, hi = lo * sc, hi * sc
                else:
                    lo, hi = _fp4_halves(p.to(tl.int32), s_step[:, :, None])
                x = tl.join(lo.reshape(BLOCK_N, UNROLL, 4, 2, 2), hi.reshape(BLOCK_N, UNROLL, 4, 2, 2))
                w = x.permute(0, 1, 5, 3, 2, 4).reshape(BLOCK_N, KW)  # _mma_k_order per block
                a_k = tl.load(a_ptrs + kbw * 32)
                if DOT_F32:
                    acc = tl.dot(w.to(tl.float32), tl.trans(a_k.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w.to(a_k.dtype), tl.trans(a_k), acc)
            else:
                for u in tl.static_range(UNROLL):
                    kb = kb_lo + kb0 + u
                    if EVEN_N:
                        p = tl.load(w_ptrs + kb * W_STEP)
                    else:
                        p = tl.load(w_ptrs + kb * W_STEP, mask=cmask[:, None], other=0)
                    if SCALE_AFTER:
                        sc = tl.sum(tl.where(uu[None, :] == u, s_step, 0.0), axis=1)[:, None]  # column u, exact
                    else:
                        sc = _ue8m0(tl.load(s_ptrs + kb * S_STEP, mask=cmask, other=0))[:, None]
                    a_k = tl.load(a_ptrs + kb * 32)
                    if LUT:
                        lo, hi = _fp4_lut_pairs(p)
                        if not SCALE_AFTER:
                            lo, hi = lo * sc.to(tl.bfloat16), hi * sc.to(tl.bfloat16)
                    elif SCALE_AFTER:
                        lo, hi = _fp4_halves(p.to(tl.int32), 1.0)
                    else:
                        lo, hi = _fp4_halves(p.to(tl.int32), sc)
                    w = _mma_k_order(lo, hi, BLOCK_N)
                    if SCALE_AFTER:
                        if DOT_F32:
                            t = tl.dot(w.to(tl.float32), tl.trans(a_k.to(tl.float32)), input_precision="ieee")
                        else:
                            t = tl.dot(w.to(a_k.dtype), tl.trans(a_k))
                        acc += t * sc
                    elif DOT_F32:
                        acc = tl.dot(w.to(tl.float32), tl.trans(a_k.to(tl.float32)), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(w.to(a_k.dtype), tl.trans(a_k), acc)
        y_ptr += tl.program_id(2) * s_ys
        out = y_ptr + rows.to(tl.int64)[None, :] * s_ym + cols[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[None, :] & cmask[:, None])

    # e2m1 -> e4m3 for the FP8 kernel: the 3 magnitude bits (e1 e0 m) placed at e4m3's bits [4:2]
    # and the sign at bit 7 read as the e2m1 value times 2^-6 for every code (e4m3's exponent bias
    # is 7, e2m1's 1; e2m1's subnormal 0.5 lands on e4m3's subnormal 2^-7), so the 2^6 goes into
    # the scale. Six instructions per packed word (8 values), no table: with sg = the sign bits,
    # LOP3 "(a & 0x1C) | (b & ~0x1C)" (LUT 0xE4) merges the shifted magnitudes and the shifted
    # signs in one go (the other bits of b are zero or fall inside the mask). In the kernel's byte
    # order (``repack_fp4``: byte j = elements j, j + 16) the low nibbles of a lane's 4 bytes are
    # 4 consecutive K elements and the high nibbles the 4 elements 16 further: exactly the two
    # registers of FP8 wgmma's A fragment (m64nNk32: columns 4c..4c+3 and 4c+16..4c+19), so no
    # K permutation is needed. $0 = the four low-nibble values, $1 = the four high-nibble ones.
    _FP4_E4M3_ASM = tl.constexpr(
        "{ .reg .b32 sg, al, ah, bl;\n"
        "and.b32 sg, $2, 0x88888888;\n"
        "shl.b32 al, $2, 2;\n"
        "shr.b32 ah, $2, 2;\n"
        "shl.b32 bl, sg, 4;\n"
        "lop3.b32 $0, al, bl, 0x1C1C1C1C, 0xE4;\n"
        "lop3.b32 $1, ah, sg, 0x1C1C1C1C, 0xE4;\n"
        "}"
    )

    @triton.jit
    def _fp4_e4m3(p, ASM: tl.constexpr):
        """Packed bytes (int8, kernel order) -> (low-nibble, high-nibble) values as e4m3 codes of
        the e2m1 value times 2^-6 (exact). ``ASM``: the PTX above (CUDA); otherwise the same bits
        by Triton integer ops (the interpreter)."""
        if ASM:
            return tl.inline_asm_elementwise(
                _FP4_E4M3_ASM, "=r,=r,r", [p], dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4
            )
        b = p.to(tl.int32) & 0xFF
        lo = ((b & 7) << 2) | ((b & 8) << 4)
        hi = ((b >> 2) & 0x1C) | (b & 0x80)
        return lo.to(tl.uint8).to(tl.float8e4nv, bitcast=True), hi.to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def _fp8_codes32_kernel(x_ptr, c_ptr, s_ptr, n_blocks, BLOCKS: tl.constexpr):
        """``BLOCKS`` 32-element blocks of the flattened activations -> their e4m3 codes and fp32
        scales, as ``quant.fp8_qdq`` computes them: amax floored at 1e-4, times fp32(1/448),
        rounded up to a power of two on the exponent bits; the division by it is a multiply by
        its exact reciprocal (built on the bits too). One launch instead of torch's dozen."""
        blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        bmask = blk < n_blocks
        offs = blk.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :]
        x = tl.load(x_ptr + offs, mask=bmask[:, None], other=0.0).to(tl.float32)
        q = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) * (1.0 / 448.0)
        bits = q.to(tl.int32, bitcast=True)
        c = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # biased ceil(log2)
        scale = (c << 23).to(tl.float32, bitcast=True)
        inv = ((254 - c) << 23).to(tl.float32, bitcast=True)
        codes = tl.clamp(x * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
        tl.store(c_ptr + offs, codes, mask=bmask[:, None])
        tl.store(s_ptr + blk, scale, mask=bmask)

    @triton.jit
    def _mxfp4_moe_fp8_kernel(
        a_ptr,
        as_ptr,
        a_rows_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        block_expert_ptr,
        block_row0_ptr,
        block_row1_ptr,
        N,
        s_am,
        s_asm,
        s_we,
        s_wt,
        s_wn,
        s_se,
        s_st,
        s_sn,
        s_ys,
        s_ym,
        K: tl.constexpr,
        KB_PER_SPLIT: tl.constexpr,
        UNROLL: tl.constexpr,
        N_EXPERTS: tl.constexpr,
        GATHER: tl.constexpr,
        W_STEP: tl.constexpr,
        S_STEP: tl.constexpr,
        EVEN_N: tl.constexpr,
        ASM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The swap-AB tile of ``_mxfp4_moe_swap_kernel`` on FP8 tensor cores (``config={"fp8":
        True}``): ``t [BLOCK_N, BLOCK_M] = W8 [BLOCK_N, 32] @ a8^T [32, BLOCK_M]``, one FP8 wgmma
        K step per 32-element scale block, with W8 the weights expanded to e4m3 in registers (wgmma's
        A operand) and a8 the activations' e4m3 codes (``a_ptr``, per-32 power-of-two scales in
        ``as_ptr``: the reference's own FP8 quantization, so every product is exact); then ``acc +=
        t * (2^6 w_scale[n] * a_scale[m])`` in fp32. Against the bf16 swap kernel: the decode is 6
        instructions a packed word instead of 15 plus the PRMTs that packed bf16 pairs, one MMA a
        block instead of two, and no K permutation; the price is the outer product of the two
        scales (one FMUL per accumulator element a block beside the FMA).

        Hot-loop counts in sm_90a SASS, compiled offline as in the swap kernel's table
        (``ASYMPD_BENCH_SASS=1 python bench/formats.py``: Triton 3.6 and its ptxas; K 5120,
        BLOCK_N 128, 4 warps; no spills in any):

        ===========================  ====================  ====================  ==================
        kernel                       BLOCK_M 16, UNROLL 2  BLOCK_M 32, UNROLL 2  BLOCK_M 16, UNR. 4
        ===========================  ====================  ====================  ==================
        swap_ab (bf16, scale after)  299 (4.67 / w), 83 r  341 (5.33 / w), 127 r 534 (4.17 / w)
        this kernel                  222 (3.47 / w), 77 r  286 (4.47 / w), 125 r 400 (3.12 / w), 80 r
        ===========================  ====================  ====================  ==================

        (w: weights a thread an iteration, 64 at UNROLL 2; r: registers.) Of the 222: 66 the
        scaling (32 FMUL for the scale outer product, 32 FFMA into the accumulator, 2 more), ~60 the
        decode (LOP3, SHF, IMAD.SHL: 6 a packed word), 4 QGMMA.64x16x32 with A from registers (two
        m64 tiles, two blocks), ~25 the scale vectors' layout conversion through shared memory
        (4 STS, 8 BAR, LDS), the rest loads and loop. No PRMT, no HMUL2. If issue-bound, 1.35x the
        bf16 swap kernel at BLOCK_M 16 (1.50x unrolled 4x against its own unroll 4), 1.19x at 32.
        BLOCK_M 8 is not an FP8 wgmma in Triton 3.6 (it falls back to mma.sync through f16
        conversions, 491 instructions): correct, but not for the device.

        Prefill-sized M-blocks (8 warps, UNROLL 2, 32 weights a thread): BLOCK_M 64: 266 (126 r),
        BLOCK_M 128: 395 (246 r, no spills), of which 257 the rescale. The rescale is 2 fp32
        instructions per accumulator element per 32 K, i.e. 1/64 cycle of an SM's issue against
        the FP8 MMA's 32 MACs / 4096 a cycle = 1/128: twice the MMA's own time whatever the tile.
        At BLOCK_M 128: 3160 warp instructions (790 issue cycles) per 1 M MACs (256 tensor
        cycles), so at best 32 % of the FP8 peak, ~45 % of the measured FP8 GEMM rate the floor
        uses, with perfect overlap: it cannot reach 50 % of the floor at 16K rows, but it is ~3x
        the first kernel's 13 %, so it is timed there too (bench/formats.py)."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_b)
        if e >= N_EXPERTS:
            return
        rows, rmask, src = _block_rows_unmasked(pid_b, block_row0_ptr, block_row1_ptr, a_rows_ptr, BLOCK_M, GATHER)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        kk = tl.arange(0, 16)
        w_ptrs, s_ptrs = _tile_bases(w_ptr, s_ptr, e, pid_n, s_we, s_wt, s_wn, s_se, s_st, s_sn, BLOCK_N)
        w_ptrs = w_ptrs[:, None] + kk[None, :]
        a_ptrs = a_ptr + src[:, None] * s_am + tl.arange(0, 32)[None, :]
        as_ptrs = as_ptr + src * s_asm
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        kb_lo = tl.program_id(2) * KB_PER_SPLIT
        uu = tl.arange(0, UNROLL)
        for kb0 in range(0, KB_PER_SPLIT, UNROLL):  # splits divide K exactly (see the wrapper): no masks
            kbs = kb_lo + kb0 + uu
            # the step's scales in one load each; 2^6 undoes the decode's 2^-6 (exact)
            ws_step = _ue8m0(tl.load(s_ptrs[:, None] + kbs[None, :] * S_STEP, mask=cmask[:, None], other=0)) * 64.0
            as_step = tl.load(as_ptrs[:, None] + kbs[None, :])
            for u in tl.static_range(UNROLL):
                kb = kb_lo + kb0 + u
                if EVEN_N:
                    p = tl.load(w_ptrs + kb * W_STEP)
                else:
                    p = tl.load(w_ptrs + kb * W_STEP, mask=cmask[:, None], other=0)
                ws = tl.sum(tl.where(uu[None, :] == u, ws_step, 0.0), axis=1)  # column u, exact
                sa = tl.sum(tl.where(uu[None, :] == u, as_step, 0.0), axis=1)
                a_k = tl.load(a_ptrs + kb * 32)
                lo, hi = _fp4_e4m3(p, ASM)
                w = tl.join(lo, hi).permute(0, 2, 1).reshape(BLOCK_N, 32)  # column 16h + j = element 16h + j
                t = tl.dot(w, tl.trans(a_k))
                acc += t * (ws[:, None] * sa[None, :])
        y_ptr += tl.program_id(2) * s_ys
        out = y_ptr + rows.to(tl.int64)[None, :] * s_ym + cols[:, None]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[None, :] & cmask[:, None])

    @triton.jit
    def _fp4_natural_order(p, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
        """Kernel-order packed bytes [BLOCK_N, UNROLL, 16] (``repack_fp4``: byte j of a 32-element
        block = elements j, j + 16) -> the release's order [BLOCK_N, 16 UNROLL] uint8 (byte i =
        elements 2i low, 2i + 1 high), the order ``tl.dot_scaled`` reads e2m1 in. Bytes 2i and 2i + 1
        of a block give natural bytes i (their low nibbles) and 8 + i (their high nibbles): four
        integer ops per two bytes, within the 16 bytes one thread loads, so no data crosses lanes."""
        q = p.to(tl.uint8, bitcast=True).reshape(BLOCK_N, UNROLL, 8, 2)
        ev, od = tl.split(q)  # [BLOCK_N, UNROLL, 8]: bytes 2i and 2i + 1
        lo = (ev & 0x0F) | (od << 4).to(tl.uint8)  # elements 2i, 2i + 1 (< 16)
        hi = (ev >> 4) | (od & 0xF0)  # elements 16 + 2i, 17 + 2i
        return tl.join(lo, hi).permute(0, 1, 3, 2).reshape(BLOCK_N, UNROLL * 16)

    @triton.jit
    def _e2m1_stand_in(q, s, R: tl.constexpr, UNROLL: tl.constexpr):
        """What ``tl.dot_scaled`` makes of an e2m1 operand, for the interpreter (which has no
        dot_scaled): packed bytes [R, 16 UNROLL] in the release's order (low nibble first) and UE8M0
        scales [R, UNROLL] -> fp32 values [R, 32 UNROLL] (value times 2^(s - 127), per 32 along K)."""
        lo, hi = _fp4_halves(q.to(tl.int32), 1.0)
        v = tl.join(lo, hi).reshape(R, UNROLL, 32) * _ue8m0(s)[:, :, None]
        return v.reshape(R, UNROLL * 32)

    @triton.jit
    def _mxfp4_moe_scaled_kernel(
        a_ptr,
        a_rows_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        block_expert_ptr,
        block_row0_ptr,
        block_row1_ptr,
        N,
        s_am,
        s_we,
        s_wt,
        s_wn,
        s_se,
        s_st,
        s_sn,
        s_ys,
        s_ym,
        K: tl.constexpr,
        KB_PER_SPLIT: tl.constexpr,
        UNROLL: tl.constexpr,
        N_EXPERTS: tl.constexpr,
        GATHER: tl.constexpr,
        W_STEP: tl.constexpr,
        S_STEP: tl.constexpr,
        EVEN_N: tl.constexpr,
        SWAP: tl.constexpr,
        NATURAL: tl.constexpr,
        STAND_IN: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """The MoE tile on Triton's ``tl.dot_scaled`` (``config={"scaled": True}`` /
        ``{"scaled_swap": True}``): Triton upcasts the packed e2m1 weights and applies their UE8M0
        scales itself, in the MMA operand's layout, instead of the hand expansion of the other
        kernels (whose ncu profile blames shared-memory bank conflicts and a barrier per K step).
        One dot a step of UNROLL scale blocks (K = 32 UNROLL); the activations (bf16, already FP8
        quantize-dequantized) go in as "bf16" with no scale.

        ``SWAP`` (decode): ``acc^T [BLOCK_N, BLOCK_M] += W [BLOCK_N, K] @ a^T``, the weight as the
        left operand so its upcast feeds wgmma's register operand (how Triton's own MoE kernels
        take MXFP4 weights on Hopper); otherwise ``acc [BLOCK_M, BLOCK_N] += a @ W^T`` (the weight
        upcast into shared memory, wgmma's B operand).

        dot_scaled reads e2m1 in the release's nibble order (low nibble = even K element); the
        weights are held in the kernel order of ``repack_fp4``, so ``_fp4_natural_order`` restores
        the release's bytes in registers: 4 integer ops per 2 bytes, but in sm_90a SASS (K 5120, BN
        128, BM 16, UNROLL 2, 4 warps) 660 loop instructions against 503 with ``NATURAL`` (weights
        given in the release's order, ``unrepack_fp4`` at load): the shuffled bytes no longer match
        the MMA operand's layout and make a round trip through shared memory (41 STS instead of 9),
        and Triton's own upcast of bytes in that layout (kWidth 1: PRMT and SEL a value) is ~7.9
        instructions a weight, against the swap kernel's 4.7 (bench/results/formats_sass.json); which
        is faster is the device's to say. ``STAND_IN``: the interpreter's replacement for dot_scaled (the same values,
        ``_e2m1_stand_in`` then an fp32 dot), how the CPU suite checks the addressing, the order and
        the scales; never on the device. Rows and splits as in the swap kernel: no masks in the loop."""
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_b)
        if e >= N_EXPERTS:
            return
        rows, rmask, src = _block_rows_unmasked(pid_b, block_row0_ptr, block_row1_ptr, a_rows_ptr, BLOCK_M, GATHER)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        w_ptrs, s_ptrs = _tile_bases(w_ptr, s_ptr, e, pid_n, s_we, s_wt, s_wn, s_se, s_st, s_sn, BLOCK_N)
        uu = tl.arange(0, UNROLL)
        w_ptrs = w_ptrs[:, None, None] + uu[None, :, None] * W_STEP + tl.arange(0, 16)[None, None, :]
        s_ptrs = s_ptrs[:, None] + uu[None, :] * S_STEP
        a_ptrs = a_ptr + src[:, None] * s_am + tl.arange(0, 32 * UNROLL)[None, :]
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kb_lo = tl.program_id(2) * KB_PER_SPLIT
        for kb0 in range(0, KB_PER_SPLIT, UNROLL):  # splits divide K exactly (see the wrapper): no masks
            kb = kb_lo + kb0
            if EVEN_N:
                p = tl.load(w_ptrs + kb * W_STEP)
            else:
                p = tl.load(w_ptrs + kb * W_STEP, mask=cmask[:, None, None], other=0)
            sc = tl.load(s_ptrs + kb * S_STEP, mask=cmask[:, None], other=0)  # uint8 [BLOCK_N, UNROLL]
            if NATURAL:  # the bytes already in the release's order (``unrepack_fp4`` at load)
                w = p.to(tl.uint8, bitcast=True).reshape(BLOCK_N, UNROLL * 16)
            else:
                w = _fp4_natural_order(p, BLOCK_N, UNROLL)  # uint8 [BLOCK_N, 16 UNROLL]
            a_k = tl.load(a_ptrs + kb * 32)  # [BLOCK_M, 32 UNROLL]
            if STAND_IN:
                wv = _e2m1_stand_in(w, sc, BLOCK_N, UNROLL)
                if SWAP:
                    acc = tl.dot(wv, tl.trans(a_k.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a_k.to(tl.float32), tl.trans(wv), acc, input_precision="ieee")
            elif SWAP:
                acc = tl.dot_scaled(w, sc, "e2m1", tl.trans(a_k), None, "bf16", acc)
            else:
                acc = tl.dot_scaled(a_k, None, "bf16", tl.trans(w), sc, "e2m1", acc)
        y_ptr += tl.program_id(2) * s_ys
        if SWAP:
            out = y_ptr + rows.to(tl.int64)[None, :] * s_ym + cols[:, None]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[None, :] & cmask[:, None])
        else:
            out = y_ptr + rows.to(tl.int64)[:, None] * s_ym + cols[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# process-wide overrides of ``mxfp4_moe_gemm``'s config defaults (e.g. ``{"fp8": True}``): how a
# test or a benchmark runs the whole model on one kernel variant; empty in the product
MOE_DEFAULTS: dict = {}
# the smallest M-block that ``mxfp4_moe_gemm`` gives the Gluon wgmma kernel (``moe_gluon``) by
# default, where it applies (Hopper, tiled weights, bf16): every block, since the whole MoE sublayer
# measured 1.09x at one row, 1.27-1.34x at 16-2048 and 1.59-1.69x at 4K-16K against the Triton
# kernels (bench/results/layers_wgmma_d7fcdad.json vs layers_triton_d7fcdad.json, one device call)
WGMMA_MIN_BLOCK_M = 16


def _block_m(rows_per_group: float) -> int:
    for bm in (16, 32, 64):
        if rows_per_group <= bm:
            return bm
    return 128


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# process-wide overrides of ``fp8_tile_gemm``'s config defaults (e.g. ``{"swap_ab": True}``): how a
# test or a benchmark runs the whole model on one FP8-tile kernel; empty in the product
FP8_DEFAULTS: dict = {}
# the largest row count the transposed FP8-tile kernel takes by default (on CUDA). 0: opt-in only,
# since on the H200 it measured slower than the first kernel at most decode sizes (0.5-1.25x,
# bench/results/formats_linears.json); ``SWAP_VARIANT_ROWS`` is where the benchmark times it
FP8_SWAP_MAX_ROWS = 0
SWAP_VARIANT_ROWS = 256
# split-K tickets of the transposed FP8-tile kernel, one zeroed int32 counter per output tile, per
# (device, stream): the kernel leaves them zero, so a buffer is reused (and graph replays work); a
# stream of its own keeps concurrent GEMMs on other streams from sharing a counter
_TICKETS: dict[tuple, torch.Tensor] = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


def _swap_splits(n_steps: int, tiles: int, sms: int, cap: int = 16) -> int:
    """Splits of K for the transposed FP8-tile kernel. Fewer than two output tiles per SM: the
    fewest splits that give four programs per SM (several resident at once keep enough loads in
    flight), else the most allowed; each split a divisor of the unrolled steps (whole steps, no
    masks), >= 2 steps long, and at most ``cap`` of them (the last program of a tile reads every
    partial: its reduction's latency grows with the count)."""
    if tiles >= 2 * sms:
        return 1
    want = -(-4 * sms // max(1, tiles))
    ok = [d for d in range(1, min(cap, n_steps // 2) + 1) if n_steps % d == 0] or [1]
    return min((d for d in ok if d >= want), default=max(ok))


def _fp8_tile_swap(
    a3: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, n: int, groups: int, cfg: dict
) -> torch.Tensor:
    """Launch ``_fp8_tile_swap_kernel`` (see ``fp8_tile_gemm``); returns [M, groups, n]."""
    m, _, k = a3.shape
    if k % 32:
        raise ValueError(f"fp8_tile_gemm: the transposed kernel needs K a multiple of 32, got {k}")
    n_kb = k // 32
    unroll = cfg.get("unroll", 2 if n_kb % 2 == 0 else 1)
    if n_kb % unroll:
        raise ValueError(f"fp8_tile_gemm: unroll {unroll} does not divide the {n_kb} tile columns of K")
    bm = cfg.get("block_m", min(_block_m(m), 64))
    bn = cfg.get("block_n", 128)
    grid_mn = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    tiles = grid_mn[0] * grid_mn[1] * groups
    n_steps = n_kb // unroll
    split = cfg.get("split_k") or _swap_splits(n_steps, tiles, _sms(a3.device))
    split = max(d for d in range(1, min(split, n_steps) + 1) if n_steps % d == 0)  # whole steps per split
    y = torch.empty(m, groups, n, dtype=a3.dtype, device=a3.device)
    part, cnt = y, y  # unused without split K
    if split > 1:
        part = torch.empty(groups * split * m * grid_mn[1] * bn, dtype=torch.float32, device=a3.device)
        cnt = _tickets(a3.device, tiles)
    _fp8_tile_swap_kernel[(grid_mn[0], grid_mn[1], groups * split)](
        a3,
        weight,
        s,
        y,
        part,
        cnt,
        m,
        a3.stride(0),
        a3.stride(1),
        weight.stride(0),
        s.stride(0),
        y.stride(0),
        y.stride(1),
        n,
        KB_PER_SPLIT=n_kb // split,
        SPLITS=split,
        UNROLL=unroll,
        DOT_F32=_dot_f32(a3),
        SCALE_AFTER=cfg.get("scale_after", bm <= 16),
        K_ORDER=cfg.get("k_order", bm <= 32),
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3) if a3.is_cuda else 1,
    )
    return y


def fp8_tile_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    groups: int = 1,
    split_k: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``a @ dequant(weight, scale)^T`` in a's dtype, fp32 accumulation.

    a: [M, K] (or [M, groups, K] with ``groups`` > 1: group g uses weight rows [g*N/groups, ...));
    weight: e4m3 [N, K]; scale: UE8M0 (``float8_e8m0fnu`` or uint8) [ceil(N/32), ceil(K/32)].
    Returns [M, N] (or [M, groups, N/groups]).

    config (all optional): ``swap_ab`` (the transposed decode-regime kernel ``_fp8_tile_swap_kernel``;
    default on CUDA for M <= ``FP8_SWAP_MAX_ROWS``, K a multiple of 32) with its ``block_m``,
    ``block_n``, ``unroll``, ``scale_after`` (default ``block_m <= 16``), ``k_order`` (default
    ``block_m <= 32``), ``split_k`` (also the argument; rounded down to a divisor of the unrolled
    K steps; its partials reduced inside the one launch), ``num_warps``, ``num_stages``; otherwise
    the first kernel's ``block_m``, ``block_n``, ``num_warps``, ``num_stages``.
    ``FP8_DEFAULTS`` (module level) overrides the defaults process-wide."""
    if a.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"fp8_tile_gemm: activations must be bf16/fp16/fp32, got {a.dtype}")
    n_total, k = weight.shape
    if n_total % groups:
        raise ValueError(f"fp8_tile_gemm: {n_total} weight rows do not split into {groups} groups")
    n = n_total // groups
    if groups > 1 and n % 32:
        raise ValueError("fp8_tile_gemm: grouped weights need group sizes that are multiples of 32")
    a3 = a.reshape(-1, groups, k) if groups > 1 else a.reshape(-1, 1, k)
    if a3.stride(-1) != 1:
        a3 = a3.contiguous()
    m = a3.size(0)
    cfg = {**FP8_DEFAULTS, **(config or {})}
    if cfg.get("swap_ab", a.is_cuda and m <= FP8_SWAP_MAX_ROWS and k % 32 == 0):
        cfg = {"split_k": split_k, **cfg} if split_k is not None else cfg
        return _fp8_tile_swap(a3, weight, scale.view(torch.uint8), n, groups, cfg).reshape(*a.shape[:-1], n)
    bm = cfg.get("block_m", _block_m(m))
    # defaults from the sweep in bench/results/formats_sweep.json (H200)
    bn = cfg.get("block_n", 64 if m <= 16 else 128)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn) * groups
    if split_k is None:
        split_k = max(1, min(triton.cdiv(k, 512), (2 * _sms(a.device)) // max(1, tiles)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), 32) * 32
    splits = triton.cdiv(k, k_per_split)
    out_dtype = a.dtype if splits == 1 else torch.float32
    y = torch.empty(splits, m, groups, n, dtype=out_dtype, device=a.device)
    s = scale.view(torch.uint8)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), groups * splits)
    _fp8_tile_gemm_kernel[grid](
        a3,
        weight,
        s,
        y,
        m,
        n,
        a3.stride(0),
        a3.stride(1),
        weight.stride(0),
        s.stride(0),
        y.stride(0),
        y.stride(1),
        y.stride(2),
        n,
        K=k,
        K_PER_SPLIT=k_per_split,
        DOT_F32=_dot_f32(a),
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=cfg.get("num_warps", 8 if 16 < m <= 64 else 4),
        num_stages=cfg.get("num_stages", 3 if a.dtype == torch.float32 else 5) if a.is_cuda else 1,
    )
    y = y[0] if splits == 1 else y.sum(0).to(a.dtype)  # fixed-order sum: deterministic
    return y.reshape(*a.shape[:-1], n)


def repack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Released FP4 bytes (element 2j in the low nibble of byte j) -> the kernel's order: within
    each 32-element block, byte j holds elements j (low nibble) and j + 16 (high nibble), so a
    16-byte load yields two contiguous 16-element halves that meet contiguous activations. The same
    bytes, permuted; ``unpack_fp4(unrepack_fp4(p))`` restores the release's values."""
    b = packed.view(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # release order: element k
    blocks = codes.unflatten(-1, (-1, 2, 16))  # [..., K/32, half, j]
    return (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).flatten(-2).contiguous().view(torch.int8)


def unrepack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_fp4``: kernel order -> the release's byte order."""
    b = packed.view(torch.uint8).unflatten(-1, (-1, 16))
    codes = torch.cat([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # element k in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().view(torch.int8)


def tile_fp4(weight: torch.Tensor, scale: torch.Tensor, block_n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-order codes ``[E, N, K/2]`` and scales ``[E, N, K/32]`` -> the tiled layout: codes
    ``[E, N/BN, K/32, BN, 16]``, scales ``[E, N/BN, K/32, BN]``. The same bytes, permuted, so that
    what one program of ``mxfp4_moe_gemm`` reads per 32-K step (BN rows x 16 bytes, BN scales) is
    one contiguous run: full 128-byte lines instead of half-sectors of rows 2.5 KB apart, and the
    scales one byte apart instead of a sector each (the ncu profile's excess sectors)."""
    e, n, half_k = weight.shape
    if n % block_n or half_k % 16:
        raise ValueError(f"tile_fp4: N = {n} is not a multiple of {block_n}, or K = {2 * half_k} of 32")
    w = weight.reshape(e, n // block_n, block_n, half_k // 16, 16).permute(0, 1, 3, 2, 4).contiguous()
    s = scale.reshape(e, n // block_n, block_n, half_k // 16).permute(0, 1, 3, 2).contiguous()
    return w, s


def untile_fp4(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``tile_fp4`` (any leading dims before the last four / three)."""
    *lead, t, kb, bn, _ = weight.shape
    w = weight.transpose(-3, -2).reshape(*lead, t * bn, kb * 16)
    s = scale.transpose(-2, -1).reshape(*lead, t * bn, kb)
    return w, s


def moe_blocks(
    expert_ids: torch.Tensor, n_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort routed rows by expert and cut each expert's rows into M-blocks, all on the device.

    expert_ids: [R] (a row's expert). Returns (order [R]: sorted row -> original row, block_expert,
    block_row0, block_row1 [max_blocks]); unused blocks carry expert ``n_experts``. The block count
    is bounded by shapes alone (no host synchronisation; graph-capturable)."""
    r = expert_ids.numel()
    device = expert_ids.device
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=device).scatter_add_(
        0, expert_ids, torch.ones_like(expert_ids)
    )  # no host sync (bincount syncs)
    ends = counts.cumsum(0)
    starts = ends - counts
    nblk = (counts + block_m - 1) // block_m
    cum = nblk.cumsum(0)
    max_blocks = min(n_experts, r) + -(-r // block_m)  # each non-empty expert wastes < one block
    b = torch.arange(max_blocks, device=device)
    e = torch.searchsorted(cum, b, right=True)
    valid = e < n_experts
    ec = e.clamp_max(n_experts - 1)
    first_block = cum[ec] - nblk[ec]
    row0 = starts[ec] + (b - first_block) * block_m
    row1 = torch.minimum(row0 + block_m, ends[ec])
    block_expert = torch.where(valid, e, n_experts).to(torch.int32)
    return order, block_expert, row0.to(torch.int32), row1.to(torch.int32)


def fp8_codes32(a: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations -> (e4m3 codes [*, K], fp32 power-of-two scales [*, K/32]): the reference's
    per-32 FP8 quantization (``quant.fp8_qdq``) stopped before the dequantize, for the FP8 kernel.
    On activations that already went through ``fp8_qdq`` (what the MoE feeds) it is exact:
    ``codes * scale`` gives back ``a`` bit for bit, since re-quantizing a quantized block picks a
    scale no larger than the first, under which every value is still an e4m3 code. On CUDA (or
    with ``kernel``, how the CPU suite checks it) one Triton kernel; torch ops otherwise."""
    if a.is_cuda or kernel:
        x = a.contiguous()
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(*x.shape[:-1], x.size(-1) // 32, dtype=torch.float32, device=x.device)
        n_blocks = s.numel()
        _fp8_codes32_kernel[(triton.cdiv(n_blocks, 64),)](x, codes, s, n_blocks, BLOCKS=64)
        return codes, s
    from asympd.model.quant import FP8_MAX, pow2_scale

    g = a.float().unflatten(-1, (-1, 32))
    s = pow2_scale(g.abs().amax(-1).clamp_min(1e-4), FP8_MAX)
    codes = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(-2), s


def takes_wgmma(a: torch.Tensor, weight: torch.Tensor, block_m: int, config: dict | None = None) -> bool:
    """Whether ``mxfp4_moe_gemm`` runs these operands on the Gluon kernel (``moe_gluon``)."""
    cfg = {**MOE_DEFAULTS, **(config or {})}
    return bool(cfg.get("wgmma", block_m >= WGMMA_MIN_BLOCK_M)) and MG.applies(a, weight, block_m)


def mxfp4_moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: int,
    block_m: int,
    a_rows: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Grouped GEMM over expert-sorted rows: ``y[r] = a[a_rows[r]] @ dequant(W[e(r)])^T``.

    a: [*, K] activations (bf16/fp32; already FP8-quantize-dequantized); weight: int8 [E, N, K/2] in
    the kernel's nibble order (``repack_fp4``); scale: UE8M0 [E, N, K/32]; blocks: (block_expert,
    block_row0, block_row1) from ``moe_blocks`` made with the same ``block_m``; ``a_rows`` maps
    sorted rows to rows of ``a`` (None: identity).
    config (all optional): ``block_n``, ``unroll``, ``split``, ``num_warps``, ``num_stages``,
    ``lut`` (the PRMT decode; default on CUDA in bf16), ``lut_pairs`` (its shorter form, which the
    transposed kernel always uses; default off); ``swap_ab`` (the transposed decode-regime
    kernel, default on CUDA in bf16 for M-blocks of <= 32 rows) with ``scale_after`` (default
    ``block_m <= 16``); ``fp8`` (the same transposed tile on FP8 tensor cores,
    ``_mxfp4_moe_fp8_kernel``: the activations re-quantized to their e4m3 codes, exact; default
    off until measured); ``scaled`` (``_mxfp4_moe_scaled_kernel``: Triton's ``tl.dot_scaled`` upcasts
    the e2m1 weights and their scales itself; bf16 activations, CUDA only, off by default) and
    ``scaled_swap`` (the same with the weight as the left operand, the decode regime);
    ``natural`` (with those: weight holds the bytes in the release's nibble order, ``unrepack_fp4`` of
    the kernel order or of its tiles, so the kernel skips restoring it in registers);
    ``dot_scaled_stand_in`` (tests only: the interpreter's stand-in for dot_scaled, see the kernel);
    the transposed and scaled kernels' ``unroll`` must divide K/32 and their ``split``
    is rounded down to a divisor of the unrolled steps. ``wide`` (transposed bf16 kernel): the whole
    unrolled step as one dot, scales on the weights; ``maxnreg``: a register cap (CUDA). weight and
    scale may instead be tiled (``tile_fp4``: 5-D / 4-D), read as whole lines; ``block_n`` is then
    the tile. ``wgmma``: the Gluon kernel of ``moe_gluon`` where it applies (Hopper, tiled weights,
    bf16, M-blocks of 16-128 rows; FP4 expanded into wgmma's register operand), with its
    ``wgmma_config``; default for M-blocks of at least ``WGMMA_MIN_BLOCK_M`` rows. ``MOE_DEFAULTS``
    (module level) overrides the defaults process-wide (tests and benchmarks run the model on one variant with it).
    Returns [rows, N] in a's dtype."""
    cfg = {**MOE_DEFAULTS, **(config or {})}
    if takes_wgmma(a, weight, block_m, config):
        return MG.mxfp4_moe_gemm_wgmma(a, weight, scale, blocks, rows, block_m, a_rows, cfg.get("wgmma_config"))
    if weight.dim() == 5:  # tiled (``tile_fp4``): the N-block is the tile
        n_experts, n_tiles, n_kb, bn, _ = weight.shape
        n, k = n_tiles * bn, n_kb * 32
        if cfg.get("block_n", bn) != bn:
            raise ValueError(f"mxfp4_moe_gemm: weights tiled by {bn} rows, block_n {cfg['block_n']}")
    else:
        n_experts, n, half_k = weight.shape
        k = half_k * 2
        # the sweep's best at 16, 512 and 16384 rows (formats_sweep.json)
        bn = cfg.get("block_n", 128)
    if k % 32:
        raise ValueError(f"mxfp4_moe_gemm: K = {k} is not a multiple of the 32-element scale block")
    if a.size(-1) != k:
        raise ValueError(f"mxfp4_moe_gemm: activations have {a.size(-1)} columns, weights {k}")
    if a.stride(-1) != 1:
        a = a.contiguous()
    s = scale.view(torch.uint8)
    block_expert, row0, row1 = blocks
    n_blocks = triton.cdiv(n, bn)
    n_kb = k // 32
    unroll = cfg.get("unroll", 2 if n_kb % 2 == 0 else 1)
    # the transposed kernel measured 1.11-1.18x the other from 16 to 2048 rows on the H200
    # (bench/results/formats_moe_variants.json); larger M-blocks (prefill chunks) keep the other
    swap_ab = cfg.get("swap_ab", a.is_cuda and a.dtype == torch.bfloat16 and block_m <= 32)
    fp8 = cfg.get("fp8", False)  # FP8 tensor cores (docs/moe_fp8.md); off until the device measures it
    # Triton's tl.dot_scaled (``_mxfp4_moe_scaled_kernel``); off until the device measures it
    scaled_swap = cfg.get("scaled_swap", False)
    scaled = cfg.get("scaled", False) or scaled_swap
    stand_in = cfg.get("dot_scaled_stand_in", False)
    natural = cfg.get("natural", False)  # the weights in the release's nibble order (unrepack_fp4)
    if natural and not scaled:
        raise ValueError("mxfp4_moe_gemm: only the tl.dot_scaled variants read the release's nibble order")
    if scaled and not (a.is_cuda or stand_in):
        raise RuntimeError(
            "mxfp4_moe_gemm: the tl.dot_scaled variants (config 'scaled' / 'scaled_swap') run on CUDA only "
            f"(Triton's interpreter has no dot_scaled); the activations are on {a.device}"
        )
    if scaled and a.dtype != torch.bfloat16:
        raise TypeError(f"mxfp4_moe_gemm: the tl.dot_scaled variants take bf16 activations, got {a.dtype}")
    # few rows (decode): split K so the few experts' weights stream through every SM
    busy = (min(n_experts, rows) + triton.cdiv(rows, block_m)) * n_blocks
    split = cfg.get("split", max(1, min(n_kb // (8 * unroll), (4 * _sms(a.device)) // max(1, busy))))
    if swap_ab or fp8 or scaled:  # whole splits of whole unrolled steps, so its loop needs no masks
        if n_kb % unroll:
            raise ValueError(f"mxfp4_moe_gemm: unroll {unroll} does not divide the {n_kb} scale blocks of K")
        split = max(d for d in range(1, min(split, n_kb // unroll) + 1) if (n_kb // unroll) % d == 0)
    kb_per_split = triton.cdiv(triton.cdiv(n_kb, split), unroll) * unroll
    split = triton.cdiv(n_kb, kb_per_split)
    y = torch.empty(split, rows, n, dtype=a.dtype if split == 1 else torch.float32, device=a.device)
    grid = (block_expert.numel(), n_blocks, split)
    args = (a, a_rows if a_rows is not None else row0, weight, s, y, block_expert, row0, row1, n, a.stride(0))
    if weight.dim() == 5:  # (expert, tile, row, K step) strides of either layout; see _tile_bases
        w_str, w_step = (weight.stride(0), weight.stride(1), weight.stride(3)), weight.stride(2)
        s_str, s_step = (s.stride(0), s.stride(1), s.stride(3)), s.stride(2)
    else:
        w_str, w_step = (weight.stride(0), bn * weight.stride(1), weight.stride(1)), 16 * weight.stride(2)
        s_str, s_step = (s.stride(0), bn * s.stride(1), s.stride(1)), s.stride(2)
    args += (*w_str, *s_str, y.stride(0), y.stride(1))
    lut = cfg.get("lut", a.is_cuda and a.dtype == torch.bfloat16)
    common = dict(K=k, KB_PER_SPLIT=kb_per_split, UNROLL=unroll, N_EXPERTS=n_experts, GATHER=a_rows is not None)
    common.update(W_STEP=w_step, S_STEP=s_step)
    common.update(DOT_F32=_dot_f32(a), LUT=lut, BLOCK_M=block_m, BLOCK_N=bn)
    launch = {"maxnreg": cfg["maxnreg"]} if a.is_cuda and cfg.get("maxnreg") else {}
    if scaled:
        _mxfp4_moe_scaled_kernel[grid](
            *args,
            **{k_: v for k_, v in common.items() if k_ not in ("DOT_F32", "LUT")},
            EVEN_N=n % bn == 0,
            SWAP=scaled_swap,
            NATURAL=natural,
            STAND_IN=stand_in,
            num_warps=cfg.get("num_warps", 4 if block_m <= 64 else 8),
            num_stages=cfg.get("num_stages", 3) if a.is_cuda else 1,
            **launch,
        )
    elif fp8:
        codes, a_scale = fp8_codes32(a)
        _mxfp4_moe_fp8_kernel[grid](
            codes,
            a_scale,
            *args[1:9],
            codes.stride(0),
            a_scale.stride(0),
            *args[10:],
            **{k_: v for k_, v in common.items() if k_ not in ("DOT_F32", "LUT")},
            EVEN_N=n % bn == 0,
            ASM=a.is_cuda,
            num_warps=cfg.get("num_warps", 4 if block_m <= 32 else 8),  # 8: the [128, BM] accumulator
            num_stages=cfg.get("num_stages", 3) if a.is_cuda else 1,
            **launch,
        )
    elif swap_ab:
        wide = cfg.get("wide", False)
        _mxfp4_moe_swap_kernel[grid](
            *args,
            **common,
            EVEN_N=n % bn == 0,
            SCALE_AFTER=cfg.get("scale_after", block_m <= 16) and not wide,
            WIDE=wide,
            num_warps=cfg.get("num_warps", 4),
            num_stages=cfg.get("num_stages", 3) if a.is_cuda else 1,
            **launch,
        )
    else:
        _mxfp4_moe_kernel[grid](
            *args,
            **common,
            LUT_PAIRS=cfg.get("lut_pairs", False),
            num_warps=cfg.get("num_warps", 4 if block_m <= 64 else 8),
            num_stages=cfg.get("num_stages", 3) if a.is_cuda else 1,
            **launch,
        )
    if split == 1:
        return y[0]
    # rows no block covers stay unwritten in every split; they are never read (every routed row is
    # in a block), and the fixed-order sum keeps the result deterministic
    return y.sum(0).to(a.dtype)
