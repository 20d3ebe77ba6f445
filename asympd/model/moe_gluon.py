"""The MXFP4 expert GEMM for prefill-sized M-blocks on Hopper, written in Gluon (issue 11).

Why a second kernel: at 4K-16K tokens a step the MoE is compute-bound, and the Triton kernels of
``gemm_kernels`` run the expansion of FP4 to bf16 and the MMA one after the other in the same warps
(Triton waits on every wgmma whose operand comes from registers), so the tensor cores idle while the
weights are decoded: 28 % of the dense bf16 rate at 16K tokens (docs/performance.md §9). In Gluon
the kernel states its register layouts, copies, fences and waits itself: the weights decode straight
into the MMA's register fragment, the copies run ahead in a ring, and, where the expansion goes
through a shared tile (``a_smem``), the next step's expansion overlaps this step's wgmmas. Measured
on the H200 it is 1.27-1.69x the Triton kernels on the whole MoE sublayer (§9, "The expert GEMM in
Gluon").

Two hazards the device found, kept here for whoever edits it: ``cp.async`` writes reach wgmma (the
async proxy) only after each writer's ``fence_async_shared`` *and then* a barrier; and an
asynchronous wgmma reads its register operand until it is waited for, which
``warpgroup_mma_wait(deps=...)`` does not protect (it keeps the bf16 values live, not the packed
registers the wgmma reads), so the register form retires each step before the next expansion.

The tile is the transposed one of ``_mxfp4_moe_swap_kernel``: ``acc^T [128 weight rows, T tokens]
+= W [128, 64] @ a^T [64, T]``, weights as wgmma's register operand (expanded from FP4 by the PRMT
table, never staged through shared memory), the T tokens' activations as its shared-memory operand
(cp.async, a ring of ``STAGES`` K-steps). Each thread loads exactly the packed bytes its MMA fragment
needs (4 contiguous bytes of a row per 32-element block, in the tiled layout a warp reads 128
contiguous bytes a load): for that the K order inside each 16-element half is permuted the same way
on both operands (``k_order``; the dot is unchanged), the activations once a call on the host side.

What bounds it (ncu, §9 "What bounds the Gluon kernel"): at 16-row blocks instruction issue, most
of it the FP4 decode, which every M-block repeats for every weight; hence the decode's table is
held in registers (as immediates ptxas copied it into registers before every lookup). At 16K-token
steps the activation rows' traffic: an M-block's weight tiles are launched together there
(``tiles_inner``) so that its rows are read from L2, not DRAM, once per tile.

Gluon does not run under Triton's interpreter: the CPU suite compiles this kernel for sm_90
(tests/model/test_moe_gluon.py) and the device tests check its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asympd.model.fp4_ptx import (
    FP4_EXP_MULS,
    FP4_EXP_PAIRS,
    FP4_LUT_PAIRS,
    FP4_LUT_PAIRS_TABLE_IN,
    FP4_LUT_TABLE,
    FP4_SPLIT_MULS,
    FP4_SPLIT_PAIRS,
)

try:  # the core must import with torch alone (no Triton: no kernels)
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

AVAILABLE = triton is not None
BLOCK_W = 128  # weight rows a program: the tiled layout's tile (``gemm_kernels.tile_fp4``)
BLOCK_K = 64  # K a pipeline step: two scale blocks, four wgmma K-steps


def k_order(a: torch.Tensor) -> torch.Tensor:
    """Activations [*, K] -> the kernel's K order: inside each 16-element half, position
    8i + 2c + t holds element 4c + 2i + t (``gemm_kernels._mma_k_order``), so that the weight bytes
    4c..4c+3 a lane loads decode into exactly the columns its wgmma fragment holds."""
    return a.unflatten(-1, (-1, 4, 2, 2)).transpose(-3, -2).flatten(-4).contiguous()


def k_order_exp(a: torch.Tensor) -> torch.Tensor:
    """Activations [*, K] -> the K order of the table-free decode (``exponent_decode``): inside each
    16-element half, position 8i + 2c + t holds element 4c + i + 2t (the decode pairs the nibbles
    of a lane's four bytes as (0, 2) and (1, 3) where the table decode pairs (0, 1) and (2, 3))."""
    return a.unflatten(-1, (-1, 4, 2, 2)).permute(*range(a.dim()), -1, -3, -2).flatten(-4).contiguous()


def k_order_pairs(a: torch.Tensor) -> torch.Tensor:
    """Activations [*, K] -> the K order of a shared tile the table-free decode stored
    (``_decode_to_smem`` with ``EXP``): in each group of 4, position 2i + t holds element i + 2t
    (the middle two swapped), as the decode packs a lane's nibbles (0, 2) and (1, 3)."""
    return a.unflatten(-1, (-1, 2, 2)).transpose(-1, -2).flatten(-3).contiguous()


# the lanes of a step's packed bytes [2 blocks, rows, 16 bytes] (a lane holds 4 bytes of a row):
# as the wgmma A fragment takes them (lanes 0-1 the 4-byte groups, 2-4 the rows), or, for a decode
# that stores the expanded tile to shared memory, with the second pair of groups on lane 4. A lane
# stores 8 bytes and a half-warp's 16 stores are one 128-byte wavefront at best; in the fragment
# order they are 4 rows of two 16-byte chunks, which the 128-byte swizzle leaves in 4 chunks, half
# the banks (2 wavefronts each; the device counted 4.4 a store, ncu_ws_smem_*_a11d352.txt); in the
# store order, 8 rows of one chunk, which it spreads over all 8 (one).
FRAGMENT_LANES = [[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
STORE_LANES = [[0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 0, 8]]

# the largest UE8M0 weight scale the table-free decode takes: its multiplier 2^(s - 1) must be a
# bf16 (every checkpoint's expert scales are far below: 128 is a block max of 12)
EXP_DECODE_MAX_SCALE = 128


if AVAILABLE:
    _BW = gl.constexpr(BLOCK_W)
    _BK = gl.constexpr(BLOCK_K)
    _LUT_PAIRS = gl.constexpr(FP4_LUT_PAIRS)
    _LUT_PAIRS_IN = gl.constexpr(FP4_LUT_PAIRS_TABLE_IN)
    _EXP_PAIRS = gl.constexpr(FP4_EXP_PAIRS)
    _SPLIT_PAIRS = gl.constexpr(FP4_SPLIT_PAIRS)
    _FRAGMENT_LANES = gl.constexpr(FRAGMENT_LANES)
    _STORE_LANES = gl.constexpr(STORE_LANES)
    # a read of four packed operand registers that ptxas can neither drop nor move above the wgmma
    # wait before it: a shared-memory store under a predicate it cannot prove false (``_pin``)
    _PIN = gl.constexpr(
        "{ .reg .pred p; setp.ne.s32 p, $6, 0; @p st.shared.v4.b32 [$6], {$2, $3, $4, $5}; "
        "mov.b32 $0, 0; mov.b32 $1, 0; }"
    )
    _PIN_ARGS = gl.constexpr("=r,=r" + ",r" * 12)  # out: 8 int8; in: 8 bf16 (4 words), 8 int32

    @gluon.jit
    def _k16(x, layout: gl.constexpr):
        """One block's half [128, 16] (column 4c + 2i + t: nibble of byte 4c + 2i + t) -> the wgmma
        register operand of one K = 16 step, column 8i + 2c + t. Only whole registers move (each
        holds the t = 0, 1 pair the decode packed): a renaming, no data movement."""
        rows: gl.constexpr = x.shape[0]
        x = x.reshape([rows, 4, 2, 2]).permute((0, 2, 1, 3)).reshape([rows, 16])
        return gl.convert_layout(x, layout)

    @gluon.jit
    def _lut_operand(lut_ptr, p_l: gl.constexpr, EXP: gl.constexpr = False, SPLIT: gl.constexpr = False):
        """The decode's table as a [2, 128, 16] int32 operand whose four consecutive elements (one
        decode's $5-$8) are the table's four words (``EXP``: the table-free decode's multipliers,
        words 4-7 of ``_lut``; ``SPLIT``: its split-layout form's, words 8-11). Loaded once, they
        stay in four registers; as immediates ptxas kept them in uniform registers and copied them
        into vector registers before every lookup (~30 moves a K-step at 16-row blocks,
        docs/performance.md §9)."""
        j = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, p_l)))[None, None, :] % 4
        j = gl.full(p_l.shape, 0, gl.int32, p_l) + j
        base = lut_ptr + 8 if SPLIT else (lut_ptr + 4 if EXP else lut_ptr)
        t0, t1 = gl.load(base), gl.load(base + 1)
        t2, t3 = gl.load(base + 2), gl.load(base + 3)
        return gl.where(j == 0, t0, gl.where(j == 1, t1, gl.where(j == 2, t2, t3)))

    @gluon.jit
    def _expand(p, sc, lut, LUT_REGS: gl.constexpr, EXP: gl.constexpr = False, SPLIT: gl.constexpr = False):
        """Packed bytes [2 blocks, rows, 16] (kernel order) and their UE8M0 scales [2, rows] -> per
        block the low- and high-nibble values, scaled (bf16, exact): [rows, 16] each, column j
        = element j (low) or 16 + j (high) of the block, in the order the decode packs them.
        ``LUT_REGS``: the table from ``lut`` (registers), else immediates in the PTX; ``EXP``: no
        table (``fp4_ptx.FP4_EXP_PAIRS``, its multipliers from ``lut``: the values times 2^-126,
        so the scale is 2^(s - 1), which bf16 holds for s <= 128; columns 4c..4c+3 hold elements
        4c + (0, 2, 1, 3)); ``SPLIT``: the same values from the bytes in ``fp4_ptx.split_layout``
        (``fp4_ptx.FP4_SPLIT_PAIRS``, fewer ALU instructions)."""
        if EXP:
            lo, hi = gl.inline_asm_elementwise(
                _SPLIT_PAIRS if SPLIT else _EXP_PAIRS,
                "=r,=r,=r,=r,r,r,r,r,r",
                [p, lut],
                dtype=(gl.bfloat16, gl.bfloat16),
                is_pure=True,
                pack=4,
            )
            sc = ((sc.to(gl.int16) + 126) << 7).to(gl.bfloat16, bitcast=True)[:, :, None]  # 2^(s-1)
        else:
            if LUT_REGS:
                lo, hi = gl.inline_asm_elementwise(
                    _LUT_PAIRS_IN,
                    "=r,=r,=r,=r,r,r,r,r,r",
                    [p, lut],
                    dtype=(gl.bfloat16, gl.bfloat16),
                    is_pure=True,
                    pack=4,
                )
            else:
                lo, hi = gl.inline_asm_elementwise(
                    _LUT_PAIRS, "=r,=r,=r,=r,r", [p], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4
                )
            sc = (sc.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True)[:, :, None]  # 2^(s-127), bits s << 7
        lo0, lo1 = (lo * sc).permute((1, 2, 0)).split()
        hi0, hi1 = (hi * sc).permute((1, 2, 0)).split()
        return lo0, hi0, lo1, hi1

    @gluon.jit
    def _decode_to_smem(w_stage, s_stage, a_dst, lut, p_l: gl.constexpr, LUT_REGS: gl.constexpr,
                        EXP: gl.constexpr = False, SPLIT: gl.constexpr = False):  # fmt: skip
        """One step's weights, expanded into the [128, 64] shared tile wgmma reads (each lane
        stores its 4 consecutive columns of a row, 8 bytes): K in order with the table decode, each
        4 columns in the order 0, 2, 1, 3 with ``EXP`` / ``SPLIT`` (``k_order_pairs``)."""
        lo0, hi0, lo1, hi1 = _expand(w_stage.load(p_l), s_stage.load(gl.SliceLayout(2, p_l)), lut, LUT_REGS, EXP, SPLIT)
        a_dst.slice(0, 16, dim=1).store(lo0)
        a_dst.slice(16, 16, dim=1).store(hi0)
        a_dst.slice(32, 16, dim=1).store(lo1)
        a_dst.slice(48, 16, dim=1).store(hi1)

    @gluon.jit
    def _issue_step(j, stage, x_smem, x_src, w_smem, w_src, s_smem, s_src, W_STEP: gl.constexpr, S_STEP: gl.constexpr):
        """Copy K-step ``j``'s activations, packed bytes and scales into ring stage ``stage``: one
        commit group."""
        async_copy.async_copy_global_to_shared(x_smem.index(stage), x_src + j * _BK)
        async_copy.async_copy_global_to_shared(w_smem.index(stage), w_src + j * 2 * W_STEP)
        async_copy.async_copy_global_to_shared(s_smem.index(stage), s_src + j * 2 * S_STEP)
        async_copy.commit_group()

    @gluon.jit
    def _advance(i, n_steps: gl.constexpr, STAGES: gl.constexpr, x_smem, x_src, w_smem, w_src, s_smem, s_src,
                 W_STEP: gl.constexpr, S_STEP: gl.constexpr):  # fmt: skip
        """The top of K-step ``i``: its copies have landed (everyone's, handed to the async proxy
        that wgmma reads through: each writer fences, then the barrier), every warp group has
        retired the wgmmas of step i - 2, and that step's ring stage is refilled with step i +
        STAGES - 2 (past the end: step 0 again, into a stage nothing reads any more)."""
        async_copy.wait_group(STAGES - 3)
        fence_async_shared()
        gl.thread_barrier()
        ahead = i + STAGES - 2
        _issue_step(ahead % n_steps, ahead % STAGES, x_smem, x_src, w_smem, w_src, s_smem, s_src, W_STEP, S_STEP)

    @gluon.jit
    def _mma_rows(acc, a0, a1, a2, a3, x, j: gl.constexpr, SUB_T: gl.constexpr):
        """One step's four K = 16 weight operands times sub-tile ``j``'s activation rows (rows
        j * SUB_T .. of the step's [BLOCK_T, 64] shared tile), asynchronous."""
        xs = x.slice(j * SUB_T, SUB_T, dim=0)
        acc = warpgroup_mma(a0, xs.slice(0, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a1, xs.slice(16, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a2, xs.slice(32, 16, dim=1).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(a3, xs.slice(48, 16, dim=1).permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _store_rows(acc, out, j: gl.constexpr, SUB_T: gl.constexpr, num_warps: gl.constexpr):
        """acc^T [BW weight rows, SUB_T tokens] of sub-tile ``j`` -> y (rows past the block masked)."""
        y_ptr, s_ym, N, pid_n, row0, row1 = out
        bw: gl.constexpr = acc.shape[0]
        out_l: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
        val = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_l)
        on = pid_n * bw + gl.arange(0, bw, layout=gl.SliceLayout(1, out_l))
        ot = row0 + j * SUB_T + gl.arange(0, SUB_T, layout=gl.SliceLayout(0, out_l))
        optrs = y_ptr + ot.to(gl.int64)[None, :] * s_ym + on[:, None]
        gl.store(optrs, val, mask=(ot < row1)[None, :] & (on < N)[:, None])

    @gluon.jit
    def _pin(a0, a1, a2, a3, never):
        """Keep a step's register operands live (unmodified) past the wait that retires their wgmmas:
        the wgmma reads bf16 pairs packed into 32-bit registers that nothing after it reads, so ptxas
        would give them to the next step's decode and retire the wgmmas before it; a store of them
        under ``never`` (a runtime zero) after the wait keeps them. ``never`` is an int32 tensor of
        the operands' layout."""
        gl.inline_asm_elementwise(
            _PIN, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [a0, never], dtype=gl.int8, is_pure=False, pack=8
        )
        gl.inline_asm_elementwise(
            _PIN, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [a1, never], dtype=gl.int8, is_pure=False, pack=8
        )
        gl.inline_asm_elementwise(
            _PIN, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [a2, never], dtype=gl.int8, is_pure=False, pack=8
        )
        gl.inline_asm_elementwise(
            _PIN, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [a3, never], dtype=gl.int8, is_pure=False, pack=8
        )

    @gluon.jit
    def _operands(w_smem, s_smem, stage, lut, p_l: gl.constexpr, a_op_l: gl.constexpr, LUT_REGS: gl.constexpr,
                  EXP_DECODE: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
        """Ring stage ``stage``'s weights decoded into the four K = 16 register operands of a step."""
        lo0, hi0, lo1, hi1 = _expand(
            w_smem.index(stage).load(p_l), s_smem.index(stage).load(gl.SliceLayout(2, p_l)), lut, LUT_REGS,
            EXP_DECODE, SPLIT,
        )  # fmt: skip
        return _k16(lo0, a_op_l), _k16(hi0, a_op_l), _k16(lo1, a_op_l), _k16(hi1, a_op_l)

    @gluon.jit
    def _issue(ACTIVE: gl.constexpr, acc0, acc1, acc2, acc3, a0, a1, a2, a3, x, SUB_T: gl.constexpr):
        """One step's wgmmas on the first ``ACTIVE`` sub-tiles, asynchronous (the others returned as
        given)."""
        acc0 = _mma_rows(acc0, a0, a1, a2, a3, x, 0, SUB_T)
        if ACTIVE > 1:
            acc1 = _mma_rows(acc1, a0, a1, a2, a3, x, 1, SUB_T)
        if ACTIVE > 2:
            acc2 = _mma_rows(acc2, a0, a1, a2, a3, x, 2, SUB_T)
        if ACTIVE > 3:
            acc3 = _mma_rows(acc3, a0, a1, a2, a3, x, 3, SUB_T)
        return acc0, acc1, acc2, acc3

    @gluon.jit
    def _retire(ACTIVE: gl.constexpr, PENDING: gl.constexpr, acc0, acc1, acc2, acc3):
        """Wait until at most ``PENDING`` wgmma groups are in flight (the accumulators of inactive
        sub-tiles pass through)."""
        if ACTIVE == 1:
            acc0 = warpgroup_mma_wait(PENDING, deps=[acc0])
        if ACTIVE == 2:
            acc0, acc1 = warpgroup_mma_wait(PENDING, deps=[acc0, acc1])
        if ACTIVE == 3:
            acc0, acc1, acc2 = warpgroup_mma_wait(PENDING, deps=[acc0, acc1, acc2])
        if ACTIVE == 4:
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(PENDING, deps=[acc0, acc1, acc2, acc3])
        return acc0, acc1, acc2, acc3

    @gluon.jit
    def _next_step(ACTIVE: gl.constexpr, i, acc0, acc1, acc2, acc3, a0, a1, a2, a3, pin, ring, lut,
                   n_steps: gl.constexpr, STAGES: gl.constexpr, W_STEP: gl.constexpr, S_STEP: gl.constexpr,
                   p_l: gl.constexpr, a_op_l: gl.constexpr, LUT_REGS: gl.constexpr, EXP_DECODE: gl.constexpr,
                   SPLIT: gl.constexpr, SUB_T: gl.constexpr):  # fmt: skip
        """Step ``i`` decoded and issued while step i - 1's wgmmas (operands ``a*``) run, then step
        i - 1 retired and its operands read once more (``_pin``); returns the accumulators and step
        i's operands."""
        x_smem, x_src, w_smem, w_src, s_smem, s_src = ring
        _advance(i, n_steps, STAGES, x_smem, x_src, w_smem, w_src, s_smem, s_src, W_STEP, S_STEP)
        n0, n1, n2, n3 = _operands(w_smem, s_smem, i % STAGES, lut, p_l, a_op_l, LUT_REGS, EXP_DECODE, SPLIT)
        acc0, acc1, acc2, acc3 = _issue(ACTIVE, acc0, acc1, acc2, acc3, n0, n1, n2, n3, x_smem.index(i % STAGES), SUB_T)
        acc0, acc1, acc2, acc3 = _retire(ACTIVE, 4 * ACTIVE, acc0, acc1, acc2, acc3)  # step i - 1 done
        _pin(a0, a1, a2, a3, pin)
        return acc0, acc1, acc2, acc3, n0, n1, n2, n3

    @gluon.jit
    def _register_form(ACTIVE: gl.constexpr, ring, lut, out, n_steps: gl.constexpr, STAGES: gl.constexpr,
                       W_STEP: gl.constexpr, S_STEP: gl.constexpr, p_l: gl.constexpr, LUT_REGS: gl.constexpr,
                       EXP_DECODE: gl.constexpr, SPLIT: gl.constexpr, SUB_T: gl.constexpr,
                       num_warps: gl.constexpr, OVERLAP: gl.constexpr = False, never=0):  # fmt: skip
        """The K loop with the expanded weights as wgmma's register operand on the first ``ACTIVE``
        SUB_T-row sub-tiles of the block; then the store. Serial (the default): each step's wgmmas
        retired before the next step expands into the same registers (inside a step the K = 16
        slices' decode and wgmmas overlap; across steps other programs on the SM fill in).
        ``OVERLAP``: the next step decoded and issued while this one's wgmmas run (``_next_step``)."""
        x_smem, x_src, w_smem, w_src, s_smem, s_src = ring
        bw: gl.constexpr = p_l.shape[1]
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, SUB_T, 16]
        )
        a_op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        acc0 = gl.zeros([bw, SUB_T], gl.float32, acc_l)
        if ACTIVE > 1:
            acc1 = gl.zeros([bw, SUB_T], gl.float32, acc_l)
        if ACTIVE > 2:
            acc2 = gl.zeros([bw, SUB_T], gl.float32, acc_l)
        if ACTIVE > 3:
            acc3 = gl.zeros([bw, SUB_T], gl.float32, acc_l)
        if ACTIVE == 1:
            acc1, acc2, acc3 = acc0, acc0, acc0  # placeholders: never issued, never stored
        if ACTIVE == 2:
            acc2, acc3 = acc0, acc0
        if ACTIVE == 3:
            acc3 = acc0
        if OVERLAP:
            # step i + 1 decoded and issued while step i's wgmmas run: the wgmmas of both steps chain on
            # the accumulators, the wait leaves one step's groups outstanding, and step i's operands
            # are read again after it (``_pin``), so ptxas gives step i + 1's decode other registers
            pin = gl.full([bw, 16], 0, gl.int32, a_op_l) + never
            _advance(0, n_steps, STAGES, x_smem, x_src, w_smem, w_src, s_smem, s_src, W_STEP, S_STEP)
            a0, a1, a2, a3 = _operands(w_smem, s_smem, 0, lut, p_l, a_op_l, LUT_REGS, EXP_DECODE, SPLIT)
            acc0, acc1, acc2, acc3 = _issue(ACTIVE, acc0, acc1, acc2, acc3, a0, a1, a2, a3, x_smem.index(0), SUB_T)
            acc0, acc1, acc2, acc3 = _retire(ACTIVE, 4 * ACTIVE, acc0, acc1, acc2, acc3)  # (waits for nothing)
            # two steps an iteration, the operand sets alternating (a loop-carried set would be
            # copied back each step: 32 moves at 16-row blocks)
            for i in range(0, n_steps - 2, 2):
                acc0, acc1, acc2, acc3, n0, n1, n2, n3 = _next_step(
                    ACTIVE, i + 1, acc0, acc1, acc2, acc3, a0, a1, a2, a3, pin, ring, lut, n_steps, STAGES, W_STEP,
                    S_STEP, p_l, a_op_l, LUT_REGS, EXP_DECODE, SPLIT, SUB_T,
                )  # fmt: skip
                acc0, acc1, acc2, acc3, a0, a1, a2, a3 = _next_step(
                    ACTIVE, i + 2, acc0, acc1, acc2, acc3, n0, n1, n2, n3, pin, ring, lut, n_steps, STAGES, W_STEP,
                    S_STEP, p_l, a_op_l, LUT_REGS, EXP_DECODE, SPLIT, SUB_T,
                )  # fmt: skip
            if n_steps % 2 == 0:  # the last step
                acc0, acc1, acc2, acc3, a0, a1, a2, a3 = _next_step(
                    ACTIVE, n_steps - 1, acc0, acc1, acc2, acc3, a0, a1, a2, a3, pin, ring, lut, n_steps, STAGES,
                    W_STEP, S_STEP, p_l, a_op_l, LUT_REGS, EXP_DECODE, SPLIT, SUB_T,
                )  # fmt: skip
            acc0, acc1, acc2, acc3 = _retire(ACTIVE, 0, acc0, acc1, acc2, acc3)
        else:
            for i in range(n_steps):
                _advance(i, n_steps, STAGES, x_smem, x_src, w_smem, w_src, s_smem, s_src, W_STEP, S_STEP)
                a0, a1, a2, a3 = _operands(w_smem, s_smem, i % STAGES, lut, p_l, a_op_l, LUT_REGS, EXP_DECODE, SPLIT)
                acc0, acc1, acc2, acc3 = _issue(ACTIVE, acc0, acc1, acc2, acc3, a0, a1, a2, a3,
                                                x_smem.index(i % STAGES), SUB_T)  # fmt: skip
                acc0, acc1, acc2, acc3 = _retire(ACTIVE, 0, acc0, acc1, acc2, acc3)
        async_copy.wait_group(0)
        gl.thread_barrier()  # every warp group's wgmmas and copies done: the ring's memory is free
        _store_rows(acc0, out, 0, SUB_T, num_warps)
        if ACTIVE > 1:
            _store_rows(acc1, out, 1, SUB_T, num_warps)
        if ACTIVE > 2:
            _store_rows(acc2, out, 2, SUB_T, num_warps)
        if ACTIVE > 3:
            _store_rows(acc3, out, 3, SUB_T, num_warps)

    @gluon.jit(do_not_specialize=["n_blocks"])  # one compile for every step size
    def _mxfp4_moe_wgmma_kernel(
        a_ptr,
        a_rows_ptr,
        w_ptr,
        s_ptr,
        lut_ptr,
        y_ptr,
        block_expert_ptr,
        block_row0_ptr,
        block_row1_ptr,
        N,
        n_tiles,
        n_blocks,
        s_am,
        s_we,
        s_wt,
        s_se,
        s_st,
        s_ym,
        K: gl.constexpr,
        N_EXPERTS: gl.constexpr,
        GATHER: gl.constexpr,
        W_STEP: gl.constexpr,
        S_STEP: gl.constexpr,
        BLOCK_T: gl.constexpr,
        SUB_T: gl.constexpr,
        STAGES: gl.constexpr,
        A_SMEM: gl.constexpr,
        LUT_REGS: gl.constexpr,
        EXP_DECODE: gl.constexpr,
        SPLIT: gl.constexpr,
        TILES_INNER: gl.constexpr,
        W_TILES: gl.constexpr,
        num_warps: gl.constexpr,
        OVERLAP: gl.constexpr = False,
    ):
        # W_TILES neighbouring 128-row weight tiles a program (n_tiles counts programs, not tiles):
        # the block's activation rows are copied once for all of them
        BW: gl.constexpr = _BW * W_TILES
        # the weight tiles of one M-block are neighbours in launch order: the programs running at
        # once share their block's activation rows in L2 (and an expert's next block follows
        # n_tiles programs later, its weight tiles still in L2). Blocks outermost read every
        # block's rows from DRAM once per weight tile: 36 GB of w13 at 16K tokens (ncu: L2 hit
        # rate 24 %, 3.3 TB/s of DRAM), docs/performance.md §9.
        if TILES_INNER:
            pid_n = gl.program_id(0) % n_tiles
            pid_b = gl.program_id(0) // n_tiles
        else:
            pid_b = gl.program_id(0) % n_blocks
            pid_n = gl.program_id(0) // n_blocks
        e = gl.load(block_expert_ptr + pid_b)
        if e >= N_EXPERTS:
            return
        row0 = gl.load(block_row0_ptr + pid_b)
        row1 = gl.load(block_row1_ptr + pid_b)

        # the accumulator [128 weight rows, T tokens]: num_warps / 4 warp groups of 64 rows
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_T, 16]
        )
        # a step's packed bytes [2 blocks, 128 rows, 16 bytes] in registers: the lane of row group
        # g and column c holds bytes 4c..4c+3 of rows g and g + 8 of both blocks (the A fragment's
        # columns), four consecutive registers a decode
        # (rows past the warps' 64 or 128 in registers: each a further wgmma of 64 rows a warp group)
        warp_rows: gl.constexpr = [[0, 16, 0], [0, 32, 0], [0, 64, 0]] if num_warps == 8 else [[0, 16, 0], [0, 32, 0]]
        reg_rows: gl.constexpr = ([] if num_warps == 8 else [[0, 64, 0]]) + ([[0, 128, 0]] if W_TILES == 2 else [])
        p_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0], [1, 0, 0]] + reg_rows,
            lane_bases=_STORE_LANES if A_SMEM else _FRAGMENT_LANES,
            warp_bases=warp_rows,
            block_bases=[],
            shape=[2, BW, 16],
        )
        # copies: activation rows [T, 64] bf16, 8 lanes a 128-byte row; packed bytes one 16-byte
        # row of a block a thread; scales 4 bytes a thread
        x_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        wc_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [2, num_warps // 2, 1], [2, 1, 0])
        sc_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps // 2, 2], [1, 0])
        x_smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, _BK], gl.bfloat16)
        a_smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BW, _BK], gl.bfloat16)
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

        # the block's tokens: rows past the block read a real row (never stored)
        t = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, x_l))
        rows = gl.minimum(row0 + t, row1 - 1)
        if GATHER:
            src = gl.load(a_rows_ptr + rows).to(gl.int64)
        else:
            src = rows.to(gl.int64)
        kx = gl.arange(0, _BK, layout=gl.SliceLayout(0, x_l))
        x_src = a_ptr + src[:, None] * s_am + kx[None, :]
        # this tile's packed bytes and scales (tiled layout: [E, N/128, K/32, 128, 16] / [.., 128])
        wb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, wc_l)))
        wr = gl.arange(0, BW, layout=gl.SliceLayout(0, gl.SliceLayout(2, wc_l)))
        wj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, wc_l)))
        w_row = (pid_n * W_TILES + wr // _BW).to(gl.int64) * s_wt + (wr % _BW) * 16  # tile, then row in it
        w_src = w_ptr + e.to(gl.int64) * s_we + wb[:, None, None] * W_STEP + w_row[None, :, None] + wj[None, None, :]
        sb = gl.arange(0, 2, layout=gl.SliceLayout(1, sc_l))
        sr = gl.arange(0, BW, layout=gl.SliceLayout(0, sc_l))
        s_row = (pid_n * W_TILES + sr // _BW).to(gl.int64) * s_st + sr % _BW
        s_src = s_ptr + e.to(gl.int64) * s_se + sb[:, None] * S_STEP + s_row[None, :]

        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, _BK], x_smem_l)
        w_smem = gl.allocate_shared_memory(gl.int8, [STAGES, 2, BW, 16], plain3)
        s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 2, BW], plain2)

        n_steps: gl.constexpr = K // _BK
        for j in gl.static_range(STAGES - 2):  # the ring's first steps in flight (past the end: step 0)
            _issue_step(j % n_steps, j, x_smem, x_src, w_smem, w_src, s_smem, s_src, W_STEP, S_STEP)
        lut = _lut_operand(lut_ptr, p_l, EXP_DECODE, SPLIT)
        out = (y_ptr, s_ym, N, pid_n, row0, row1)
        ring = (x_smem, x_src, w_smem, w_src, s_smem, s_src)
        if A_SMEM:
            # the expanded weights go through a double-buffered shared tile, so the wgmmas of step i
            # run while step i + 1 is expanded (an asynchronous wgmma's register operand cannot be
            # kept from reuse: Gluon's ``deps`` holds the bf16 values, not the packed registers the
            # wgmma reads, and the device showed them overwritten)
            acc = gl.zeros([_BW, BLOCK_T], gl.float32, acc_l)
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _BW, _BK], a_smem_l)
            async_copy.wait_group(STAGES - 3)
            gl.thread_barrier()
            _decode_to_smem(w_smem.index(0), s_smem.index(0), a_smem.index(0), lut, p_l, LUT_REGS)
            for i in range(n_steps):
                # (and A(i), stored by everyone at the end of the last step: the fence covers it too)
                _advance(i, n_steps, STAGES, x_smem, x_src, w_smem, w_src, s_smem, s_src, W_STEP, S_STEP)
                x = x_smem.index(i % STAGES).permute((1, 0))
                acc = warpgroup_mma(a_smem.index(i % 2), x, acc, is_async=True)
                # this warp group's wgmmas of step i - 1 are done: its rows of the other A buffer
                # are free (each warp group stores and reads only its own 64 rows)
                acc = warpgroup_mma_wait(1, deps=[acc])
                async_copy.wait_group(STAGES - 3)  # step i + 1 landed (this thread's copies)
                gl.thread_barrier()
                nj = (i + 1) % STAGES
                _decode_to_smem(w_smem.index(nj), s_smem.index(nj), a_smem.index((i + 1) % 2), lut, p_l, LUT_REGS)
            acc = warpgroup_mma_wait(0, deps=[acc])
            async_copy.wait_group(0)
            gl.thread_barrier()  # every warp group's wgmmas and copies done: the ring's memory is free
            _store_rows(acc, out, 0, BLOCK_T, num_warps)
        else:
            # the register form, on as many of the block's SUB_T-row sub-tiles as it has rows: one
            # compiled loop a count, chosen once a program (the M-block decodes each weight once,
            # its wgmmas cover its rows to SUB_T, not to BLOCK_T)
            n_sub = (row1 - row0 + SUB_T - 1) // SUB_T
            never = (row1 < row0).to(gl.int32)  # a zero ptxas cannot fold (``_pin``)
            if BLOCK_T == SUB_T:
                _register_form(1, ring, lut, out, n_steps, STAGES, W_STEP, S_STEP, p_l,
                               LUT_REGS, EXP_DECODE, SPLIT, SUB_T, num_warps, OVERLAP, never)  # fmt: skip
            elif n_sub == 1:
                _register_form(1, ring, lut, out, n_steps, STAGES, W_STEP, S_STEP, p_l,
                               LUT_REGS, EXP_DECODE, SPLIT, SUB_T, num_warps, OVERLAP, never)  # fmt: skip
            elif n_sub == 2:
                _register_form(2, ring, lut, out, n_steps, STAGES, W_STEP, S_STEP, p_l,
                               LUT_REGS, EXP_DECODE, SPLIT, SUB_T, num_warps, OVERLAP, never)  # fmt: skip
            else:
                if BLOCK_T == 4 * SUB_T:
                    if n_sub == 3:
                        _register_form(3, ring, lut, out, n_steps, STAGES, W_STEP, S_STEP, p_l,
                                       LUT_REGS, EXP_DECODE, SPLIT, SUB_T, num_warps, OVERLAP, never)  # fmt: skip
                    else:
                        _register_form(4, ring, lut, out, n_steps, STAGES, W_STEP, S_STEP, p_l,
                                       LUT_REGS, EXP_DECODE, SPLIT, SUB_T, num_warps, OVERLAP, never)  # fmt: skip


BLOCK_MS = (16, 32, 64, 128)
# the keys ``mxfp4_moe_gemm_wgmma``'s config takes
CONFIG_KEYS = frozenset(
    ("a_smem", "stages", "num_warps", "lut_registers", "tiles_inner", "warp_specialized", "exponent_decode")
    + ("maxnreg", "split_layout", "sub_tiles", "w_tiles", "overlap")
)
# the register form's steps overlapped (``overlap``; no wait retires every wgmma inside its loop,
# test_it_compiles_for_hopper_with_the_designed_hot_loop): correct on the device and slower, 0.58x
# at 64-row blocks, 0.91-0.94x at 16-32, 0.96-1.03x at 128 (its registers cost programs an SM;
# layers_ov_*.json, docs/performance.md §9), so off
OVERLAP = False
# 128-row weight tiles a program of the register form by M-block (``w_tiles``; a GEMM whose tiles
# it does not divide takes 1): two copy the block's activation rows once for both (the kernel is not
# bound by that traffic: at 4096 tokens it reads 7.8 instead of 9.3 GB from DRAM and takes the same
# time, ncu_order_*_4096_cb808e3.txt; what it saves is half the programs' fixed work). On the MoE
# sublayer, two runs interleaved in one call (bench/results/layers_wt_*.json): 1.08x at 2048 rows,
# 1.03-1.06x at 8K-16K, 0.99-1.04x at 4096, the same at 512-1152; at 64-row blocks with one warp
# group (w2 1.15x, w13 1.00x: moe_wtiles.json), at 128 with one a tile (8 warps, below): the same
# loop a thread as one tile's, so the same registers (4 warps on two tiles spill there). At 32-row
# blocks neither form gained (0.93x on the sublayer with 8 warps)
W_TILES = {16: 1, 32: 1, 64: 2, 128: 2}
# warps a program by M-block, with the table-free decode (True) and the table (False). With the
# table-free decode one warp group at 32-row blocks too: 1.06-1.17x per GEMM (bench/results/
# moe_blockm_exp.json), 1.04-1.08x on every 1024-row layer cell (layers_v9.json); at 64 and 128,
# whole blocks, one warp group 0.99-1.16x two (moe_split_subtiles_gemms.json, 2048-16K tokens)
# (128: 8 warps for the two weight tiles of ``W_TILES``, a warp group each)
NUM_WARPS = {True: {16: 4, 32: 4, 64: 4, 128: 8}, False: {16: 4, 32: 8, 64: 8, 128: 8}}
# the expanding partition's warps by M-block (``warp_specialized`` with ``a_smem``): 8 where a block
# has the rows to keep them busy, by the count alone (132 instructions a step a thread against 224
# with 4; docs/performance.md §9 "An expanding partition"), not yet measured
WS_DECODE_WARPS = {16: 4, 32: 8, 64: 8, 128: 8}
# sub-tiles of the register form's wgmmas by M-block (``sub_tiles``; 1: the whole block). Measured
# in one run with the split decode (bench/results/moe_split_subtiles_gemms.json): 16-row blocks in
# two 8-row sub-tiles 1.01-1.09x at 16-256 tokens (most experts there have a row or two); 64-row
# blocks in four 1.00-1.12x at 1024-2048 tokens (half-full blocks) but 0.90-0.98x at 4096-16K (full
# ones: a wgmma of N = 16 runs below the tensor cores' rate); 128-row blocks in four of 32 rows
# 0.99-1.10x. The block fill (``packed.MOE_BLOCK_M_FILL``) keeps 64-row blocks to the half-full range.
SUB_TILES = {16: 2, 32: 2, 64: 4, 128: 4}


def tiles_inner(rows: int) -> bool:
    """Whether to launch an M-block's weight tiles together for ``rows`` routed rows. Measured in one
    run (bench/results/moe_prefill_tiles_b492c4e.json): at 16K tokens (98K rows) 1.15-1.27x the
    blocks-innermost order, at 8K tokens (49K rows) 0.88-0.92x, at 4K and below the same."""
    return rows >= 64 * 1024


_LUTS: dict[torch.device, torch.Tensor] = {}  # a constant a device, made once


def _lut(device: torch.device) -> torch.Tensor:
    """The decode table's four words, the table-free decode's two multipliers (two words of
    padding) and its split-layout form's four on ``device`` (int32: the words' bits). Made by fill kernels,
    not a host copy, so that a first call inside a CUDA-graph capture works (that tensor is the
    graph's and is not kept)."""
    if device in _LUTS:
        return _LUTS[device]
    words = [w - (1 << 32) if w >= 1 << 31 else w for w in (*FP4_LUT_TABLE, *FP4_EXP_MULS, 0, 0, *FP4_SPLIT_MULS)]
    lut = torch.cat([torch.full((1,), w, dtype=torch.int32, device=device) for w in words])
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _LUTS[device] = lut
    return lut


def _unsupported(a: torch.Tensor, weight: torch.Tensor, block_m: int) -> Exception | None:
    """Why ``mxfp4_moe_gemm_wgmma`` cannot take these operands (None: it can)."""
    if not AVAILABLE or not a.is_cuda or torch.cuda.get_device_capability(a.device)[0] != 9:
        return RuntimeError("mxfp4_moe_gemm_wgmma: a Hopper (sm_90) kernel; it needs Triton and an sm_90 GPU")
    if weight.dim() != 5 or weight.size(3) != BLOCK_W:
        return ValueError(f"mxfp4_moe_gemm_wgmma: weights must be tiled by {BLOCK_W} rows (tile_fp4)")
    if a.dtype != torch.bfloat16:
        return TypeError(f"mxfp4_moe_gemm_wgmma: bf16 activations only, got {a.dtype}")
    k = weight.size(2) * 32
    if k % BLOCK_K or a.size(-1) != k:
        return ValueError(f"mxfp4_moe_gemm_wgmma: K = {k} (activations {a.size(-1)}) must be a multiple of {BLOCK_K}")
    if block_m not in BLOCK_MS:
        return ValueError(f"mxfp4_moe_gemm_wgmma: M-blocks of {BLOCK_MS} rows, got {block_m}")
    return None


def applies(a: torch.Tensor, weight: torch.Tensor, block_m: int) -> bool:
    """Whether ``mxfp4_moe_gemm_wgmma`` takes these operands (else the Triton kernels do)."""
    return _unsupported(a, weight, block_m) is None


def mxfp4_moe_gemm_wgmma(
    a: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: int,
    block_m: int,
    a_rows: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``gemm_kernels.mxfp4_moe_gemm`` for tiled weights (``tile_fp4``, 128-row tiles), bf16
    activations and M-blocks of 16-128 rows, on Hopper. config: ``a_smem`` (True: the expanded
    weights through shared memory, overlapped with the previous step's wgmmas; default False: as the
    register operand, each step's wgmmas retired before the next), ``stages`` (the copy ring,
    default 4), ``num_warps`` (4 or 8; default ``NUM_WARPS``), ``lut_registers`` (default True: the
    decode's table held in registers; False: as immediates), ``tiles_inner`` (True: an M-block's
    weight tiles launched together; False: the M-blocks innermost; default ``tiles_inner(rows)``);
    both False is the nineteenth session's kernel, kept to measure against; ``warp_specialized``
    (``moe_gluon_ws``: a copy partition and two MMA partitions on mbarriers; the register operand,
    or with ``a_smem`` an expanding partition of ``num_warps`` warps that stores the bf16 weights
    for wgmmas reading both operands from shared memory; else ``num_warps`` does not apply);
    ``exponent_decode``
    (the register form with the table-free decode, ``fp4_ptx.FP4_EXP_PAIRS``: the caller vouches
    that every scale is at most ``EXP_DECODE_MAX_SCALE``, as ``packed.PackedExperts`` checks once
    at load); ``maxnreg`` (a register cap a thread: more programs an SM, ptxas spilling past it);
    ``split_layout`` (the
    weights' bytes in ``fp4_ptx.split_layout``, decoded by FP4_SPLIT_PAIRS: the exponent decode's
    values from 5 ALU instructions a word instead of 9; implies ``exponent_decode``). Returns
    [rows, N] bf16; ``sub_tiles`` (1, 2 or 4: the register form's wgmmas on the M-block's rows in
    that many sub-tiles, as many issued as the block has rows: a large M-block decodes each weight
    once and multiplies its rows rounded up to a sub-tile, not to the block); ``w_tiles`` (1 or 2:
    the register form's 128-row weight tiles a program, default ``W_TILES``; two copy the block's
    activation rows once for 256 weight rows: half the copies, programs and epilogue starts);
    ``overlap`` (the register form: step i + 1 decoded and issued while step i's wgmmas run, two
    operand sets; correct, and slower on the H200: ``OVERLAP``)."""
    err = _unsupported(a, weight, block_m)
    if err is not None:
        raise err
    n_experts, n_tiles, n_kb, _, _ = weight.shape
    n, k = n_tiles * BLOCK_W, n_kb * 32
    lc = launch_config(block_m, n_tiles, rows, config)
    # the register operand needs the K permutation its decode produces, a shared tile its store's
    if lc.a_smem:
        x = k_order_pairs(a) if lc.exponent_decode else a.contiguous()
    else:
        x = k_order_exp(a) if lc.exponent_decode else k_order(a)
    s = scale.view(torch.uint8)
    block_expert, row0, row1 = blocks
    y = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    args = (x, a_rows if a_rows is not None else row0, weight, s, _lut(a.device), y, block_expert, row0, row1, n,
            n_tiles // lc.w_tiles, block_expert.numel(), x.stride(0), weight.stride(0), weight.stride(1), s.stride(0),
            s.stride(1), y.stride(0))  # fmt: skip
    common = dict(K=k, N_EXPERTS=n_experts, GATHER=a_rows is not None, W_STEP=weight.stride(2), S_STEP=s.stride(2))
    common |= dict(BLOCK_T=block_m, STAGES=lc.stages, TILES_INNER=lc.tiles_inner)
    grid = (block_expert.numel() * (n_tiles // lc.w_tiles),)
    if lc.warp_specialized:
        from asympd.model import moe_gluon_ws

        decode = dict(EXP_DECODE=lc.exponent_decode, SPLIT=lc.split_layout) if lc.a_smem else {}
        moe_gluon_ws.launch(grid, args, common | decode, smem_a=lc.a_smem, decode_warps=lc.num_warps)
        return y
    _mxfp4_moe_wgmma_kernel[grid](
        *args,
        **common,
        A_SMEM=lc.a_smem,
        SUB_T=block_m // lc.sub_tiles,
        LUT_REGS=lc.lut_registers,
        EXP_DECODE=lc.exponent_decode,
        SPLIT=lc.split_layout,
        W_TILES=lc.w_tiles,
        OVERLAP=lc.overlap,
        num_warps=lc.num_warps,
        **({"maxnreg": lc.maxnreg} if lc.maxnreg else {}),
    )
    return y


@dataclass(frozen=True)
class LaunchConfig:
    """What one launch of the kernel runs: ``mxfp4_moe_gemm_wgmma``'s config with the defaults
    filled in for an M-block size and a GEMM's weight tiles (``launch_config``)."""

    num_warps: int
    sub_tiles: int
    w_tiles: int
    stages: int
    tiles_inner: bool
    exponent_decode: bool
    split_layout: bool
    a_smem: bool
    warp_specialized: bool
    lut_registers: bool
    overlap: bool
    maxnreg: int | None


def launch_config(block_m: int, n_tiles: int, rows: int, config: dict | None = None) -> LaunchConfig:
    """``config`` (``mxfp4_moe_gemm_wgmma``'s keys) resolved for M-blocks of ``block_m`` rows, a
    GEMM of ``n_tiles`` 128-row weight tiles and ``rows`` routed rows; ValueError names what a
    launch cannot take. Apart from the kernel, so that the defaults and refusals are checked without
    a GPU."""
    cfg = config or {}
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"mxfp4_moe_gemm_wgmma: unknown config keys {sorted(unknown)}")
    if block_m not in BLOCK_MS:
        raise ValueError(f"mxfp4_moe_gemm_wgmma: M-blocks of {BLOCK_MS} rows, got {block_m}")
    # the register operand measured faster in 11 of 12 cells, 1.1-1.6x the shared tile at 256-8192
    # tokens (bench/results/moe_prefill_wgmma_fa9c0d9.json)
    a_smem = cfg.get("a_smem", False)
    ws = cfg.get("warp_specialized", False)
    split = cfg.get("split_layout", False)
    exp = cfg.get("exponent_decode", False) or split
    warps = cfg.get("num_warps", WS_DECODE_WARPS[block_m] if ws and a_smem else NUM_WARPS[exp][block_m])
    if block_m < 4 * warps:
        raise ValueError(f"mxfp4_moe_gemm_wgmma: {warps} warps copy {4 * warps} rows a pass; M-block {block_m}")
    if exp and (a_smem != ws):
        raise ValueError(
            "mxfp4_moe_gemm_wgmma: exponent_decode is the register form's and the expanding partition's "
            "(not a_smem or warp_specialized alone)"
        )
    register_form = not (a_smem or ws)
    w_tiles = cfg.get("w_tiles", W_TILES[block_m] if register_form and n_tiles % W_TILES[block_m] == 0 else 1)
    overlap = cfg.get("overlap", OVERLAP and register_form)
    if overlap and not register_form:
        raise ValueError("mxfp4_moe_gemm_wgmma: overlap is the register form's (not a_smem, warp_specialized)")
    if w_tiles not in (1, 2) or n_tiles % w_tiles or (w_tiles > 1 and not register_form):
        raise ValueError(
            f"mxfp4_moe_gemm_wgmma: {w_tiles} weight tiles a program of {n_tiles}: 1, or 2 dividing them, "
            "in the register form"
        )
    n_sub = cfg.get("sub_tiles", 1 if not register_form else SUB_TILES[block_m])
    sub_t = block_m // max(n_sub, 1)
    if n_sub not in (1, 2, 4) or sub_t < max(8, 2 * warps) or (n_sub > 1 and a_smem):
        raise ValueError(
            f"mxfp4_moe_gemm_wgmma: {n_sub} sub-tiles of an M-block of {block_m} rows ({warps} warps): "
            f"1, 2 or 4, of at least {max(8, 2 * warps)} rows, in the register form"
        )
    return LaunchConfig(
        num_warps=warps,
        sub_tiles=n_sub,
        w_tiles=w_tiles,
        stages=cfg.get("stages", 4),
        tiles_inner=cfg.get("tiles_inner", tiles_inner(rows)),
        exponent_decode=exp,
        split_layout=split,
        a_smem=a_smem,
        warp_specialized=ws,
        lut_registers=cfg.get("lut_registers", True),
        overlap=bool(overlap),
        maxnreg=cfg.get("maxnreg"),
    )
