"""The MXFP4 expert GEMM split by role (issue 11): ``moe_gluon``'s register-operand kernel as a
copy partition and two MMA partitions on mbarriers, with no block barrier between them.

Why: Nsight Compute on the one-role kernel at 4096 tokens, 64-row M-blocks (docs/performance.md
§9, ``bench/results/ncu_moe_gluon_bm64_4k.txt``) has the tensor pipe busy 48.7 % of the time and the
ALU (the FP4 expansion) 47.5 %: the two add up to the whole kernel, so they ran one after the
other, although three programs share each SM. Every K-step there ends in a block barrier and a
memory barrier, and each warp group retires its wgmmas before it expands the next step. Here each
warp group waits only for its own stage of the copy ring, so one group can expand while the
other's wgmmas run.

``SMEM_A`` (config ``warp_specialized`` with ``a_smem``): the expansion moves to a partition of its
own, which stores each step's bf16 weights into a shared tile (a ring of two), and the two MMA
partitions issue their wgmmas with both operands in shared memory. The profiles of both register
forms (one role, and split by role as above) add the tensor pipe's and the ALU's busy time to the
whole kernel (§9, "The profile, a warp-specialized form…"): a warp whose wgmma reads registers does
not expand while it runs. Here the warps that expand issue no wgmma and the warps that issue wgmmas
expand nothing; the price is the tile's stores (16 KB a step) and one more mbarrier hand-off.
On the H200 that price won: correct, and 0.41-0.72x the register form (one program an SM, each
step's hand-offs exposed; docs/performance.md §9, "An expanding partition of its own"). It stays
a tested configuration, not a default.

No ``from __future__ import annotations`` here: Gluon's aggregates read their annotations as types.
"""

from asympd.model import moe_gluon as MG

try:  # the core must import with torch alone (no Triton: no kernels)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import constexpr_function
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.language.core import _aggregate as aggregate
except ImportError:  # pragma: no cover - exercised where Triton is absent
    gluon = None

AVAILABLE = gluon is not None and MG.AVAILABLE

if AVAILABLE:
    _BW = gl.constexpr(MG.BLOCK_W)
    _BK = gl.constexpr(MG.BLOCK_K)
    _expand, _k16, _lut_operand = MG._expand, MG._k16, MG._lut_operand

    class _WsArgs:
        """What every partition of ``_mxfp4_moe_ws_kernel`` reads (worker partitions take no
        distributed tensors: scalars, pointers and shared-memory descriptors only)."""

        a_ptr: gl.tensor
        a_rows_ptr: gl.tensor
        w_ptr: gl.tensor
        s_ptr: gl.tensor
        lut_ptr: gl.tensor
        y_ptr: gl.tensor
        e: gl.tensor
        pid_n: gl.tensor
        row0: gl.tensor
        row1: gl.tensor
        N: gl.tensor
        s_am: gl.tensor
        s_we: gl.tensor
        s_wt: gl.tensor
        s_se: gl.tensor
        s_st: gl.tensor
        s_ym: gl.tensor
        x_smem: gl.shared_memory_descriptor
        w_smem: gl.shared_memory_descriptor
        s_smem: gl.shared_memory_descriptor
        full: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        K: gl.constexpr
        GATHER: gl.constexpr
        W_STEP: gl.constexpr
        S_STEP: gl.constexpr
        BLOCK_T: gl.constexpr
        STAGES: gl.constexpr
        EXP: gl.constexpr
        SPLIT: gl.constexpr

        @constexpr_function
        def __init__(self, *values):
            # the fields in the order they are declared
            assert len(values) == len(_WS_FIELDS)
            for i in range(len(values)):
                name = _WS_FIELDS[i][0]
                const = _WS_FIELDS[i][1] is gl.constexpr
                setattr(self, name, gl.constexpr(values[i]) if const else values[i])

    _WS_FIELDS = tuple(_WsArgs.__annotations__.items())  # read before ``aggregate`` hides them
    _WsArgs = aggregate(_WsArgs)

    @gluon.jit
    def _ws_load(p):
        """The copy partition (4 warps): K-step j's activation rows, packed bytes and scales into
        ring stage j % STAGES once both MMA partitions have released it; each thread's copies
        arrive on the stage's ``full`` barrier when they land (cp.async.mbarrier.arrive.noinc)."""
        x_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        wc_l: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 32, 1], [2, 2, 1], [2, 1, 0])
        sc_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [2, 2], [1, 0])
        t = gl.arange(0, p.BLOCK_T, layout=gl.SliceLayout(1, x_l))
        rows = gl.minimum(p.row0 + t, p.row1 - 1)
        if p.GATHER:
            src = gl.load(p.a_rows_ptr + rows).to(gl.int64)
        else:
            src = rows.to(gl.int64)
        kx = gl.arange(0, _BK, layout=gl.SliceLayout(0, x_l))
        x_src = p.a_ptr + src[:, None] * p.s_am + kx[None, :]
        wb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, wc_l)))
        wr = gl.arange(0, _BW, layout=gl.SliceLayout(0, gl.SliceLayout(2, wc_l)))
        wj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, wc_l)))
        w_src = (p.w_ptr + p.e.to(gl.int64) * p.s_we + p.pid_n.to(gl.int64) * p.s_wt
                 + wb[:, None, None] * p.W_STEP + wr[None, :, None] * 16 + wj[None, None, :])  # fmt: skip
        sb = gl.arange(0, 2, layout=gl.SliceLayout(1, sc_l))
        sr = gl.arange(0, _BW, layout=gl.SliceLayout(0, sc_l))
        s_src = (
            p.s_ptr + p.e.to(gl.int64) * p.s_se + p.pid_n.to(gl.int64) * p.s_st + sb[:, None] * p.S_STEP + sr[None, :]
        )
        n_steps: gl.constexpr = p.K // _BK
        for j in range(n_steps):
            stage = j % p.STAGES
            mbarrier.wait(p.empty.index(stage), ((j // p.STAGES) & 1) ^ 1)  # a fresh barrier: passes
            async_copy.async_copy_global_to_shared(p.x_smem.index(stage), x_src + j * _BK)
            async_copy.async_copy_global_to_shared(p.w_smem.index(stage), w_src + j * 2 * p.W_STEP)
            async_copy.async_copy_global_to_shared(p.s_smem.index(stage), s_src + j * 2 * p.S_STEP)
            async_copy.mbarrier_arrive(p.full.index(stage), increment_count=False)

    @gluon.jit
    def _ws_store(p, acc, HALF: gl.constexpr):
        """An MMA partition's acc^T [64 weight rows, BLOCK_T tokens] -> y (rows past the block masked)."""
        out_l: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        out = gl.convert_layout(acc.to(p.y_ptr.dtype.element_ty), out_l)
        on = p.pid_n * _BW + 64 * HALF + gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
        ot = p.row0 + gl.arange(0, p.BLOCK_T, layout=gl.SliceLayout(0, out_l))
        optrs = p.y_ptr + ot.to(gl.int64)[None, :] * p.s_ym + on[:, None]
        gl.store(optrs, out, mask=(ot < p.row1)[None, :] & (on < p.N)[:, None])

    @gluon.jit
    def _ws_mma(p, HALF: gl.constexpr):
        """One MMA partition (one warp group): weight rows [64 HALF, 64 HALF + 64) of the tile. A
        K-step: wait for its stage, expand the packed bytes into the wgmma register operand,
        four wgmmas, retire them, release the stage. Nothing here waits on the other warp group,
        so one group's expansion can run under the other's wgmmas."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_T, 16]
        )
        a_op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        p_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0], [1, 0, 0]],
            lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=[[0, 16, 0], [0, 32, 0]],
            block_bases=[],
            shape=[2, 64, 16],
        )
        lut = _lut_operand(p.lut_ptr, p_l)
        acc = gl.zeros([64, p.BLOCK_T], gl.float32, acc_l)
        n_steps: gl.constexpr = p.K // _BK
        for i in range(n_steps):
            stage = i % p.STAGES
            mbarrier.wait(p.full.index(stage), (i // p.STAGES) & 1)
            fence_async_shared()  # the copies' (generic proxy) writes, before wgmma reads them
            w = p.w_smem.index(stage).slice(64 * HALF, 64, dim=1).load(p_l)
            sc = p.s_smem.index(stage).slice(64 * HALF, 64, dim=1).load(gl.SliceLayout(2, p_l))
            lo0, hi0, lo1, hi1 = _expand(w, sc, lut, True)
            x = p.x_smem.index(stage)
            acc = warpgroup_mma(_k16(lo0, a_op_l), x.slice(0, 16, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(_k16(hi0, a_op_l), x.slice(16, 16, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(_k16(lo1, a_op_l), x.slice(32, 16, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(_k16(hi1, a_op_l), x.slice(48, 16, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            # the wgmmas (which every warp of the group issued, after its loads) are done: the
            # stage is free for this group
            mbarrier.arrive(p.empty.index(stage))
        _ws_store(p, acc, HALF)

    @gluon.jit
    def _ws_mma_lo(p):
        _ws_mma(p, 0)

    @gluon.jit
    def _ws_mma_hi(p):
        _ws_mma(p, 1)

    @gluon.jit
    def _ws_smem_decode(p, a_smem, a_full, a_empty, WARPS: gl.constexpr):
        """The expanding partition (``WARPS`` 4 or 8 warps over the 128 weight rows): K-step i's
        packed bytes and scales from its ring stage into the bf16 tile ``a_smem[i % A]`` (K in
        order, as ``a_smem``'s form stores it) once both MMA partitions have released that tile;
        the tile's writes handed to the async proxy (the fence), then ``a_full``; the packed bytes'
        stage released at once. ``p.EXP`` / ``p.SPLIT``: the table-free decode (from the split
        layout's bytes), which stores each 4 columns in the order 0, 2, 1, 3 (``moe_gluon.k_order_pairs``)."""
        warp_rows: gl.constexpr = [[0, 16, 0], [0, 32, 0], [0, 64, 0]] if WARPS == 8 else [[0, 16, 0], [0, 32, 0]]
        p_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0], [1, 0, 0]] + ([] if WARPS == 8 else [[0, 64, 0]]),
            lane_bases=MG._STORE_LANES,
            warp_bases=warp_rows,
            block_bases=[],
            shape=[2, 128, 16],
        )
        lut = _lut_operand(p.lut_ptr, p_l, p.EXP, p.SPLIT)
        a_stages: gl.constexpr = a_smem.shape[0]
        n_steps: gl.constexpr = p.K // _BK
        for i in range(n_steps):
            stage = i % p.STAGES
            tile = i % a_stages
            mbarrier.wait(p.full.index(stage), (i // p.STAGES) & 1)
            mbarrier.wait(a_empty.index(tile), ((i // a_stages) & 1) ^ 1)  # a fresh barrier: passes
            w, s = p.w_smem.index(stage), p.s_smem.index(stage)
            MG._decode_to_smem(w, s, a_smem.index(tile), lut, p_l, True, p.EXP, p.SPLIT)
            fence_async_shared()  # the tile's stores (generic proxy), before wgmma reads them
            mbarrier.arrive(a_full.index(tile))  # (after a barrier of this partition's warps)
            mbarrier.arrive(p.empty.index(stage))

    @gluon.jit
    def _ws_smem_mma(p, a_smem, a_full, a_empty, HALF: gl.constexpr):
        """One MMA partition (one warp group) of the ``SMEM_A`` form: weight rows [64 HALF, 64 HALF +
        64) of the tile, both wgmma operands from shared memory. Step i's wgmmas are issued, then
        step i - 1's retired (one group left in flight) and its expanded tile and ring stage
        released; so the expansion of step i + 1 runs while step i's wgmmas do."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, p.BLOCK_T, 16]
        )
        acc = gl.zeros([64, p.BLOCK_T], gl.float32, acc_l)
        a_stages: gl.constexpr = a_smem.shape[0]
        n_steps: gl.constexpr = p.K // _BK
        for i in range(n_steps):
            stage = i % p.STAGES
            tile = i % a_stages
            mbarrier.wait(p.full.index(stage), (i // p.STAGES) & 1)
            mbarrier.wait(a_full.index(tile), (i // a_stages) & 1)
            fence_async_shared()  # the copies' writes, before wgmma reads them
            a = a_smem.index(tile).slice(64 * HALF, 64, dim=0)
            acc = warpgroup_mma(a, p.x_smem.index(stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # step i - 1's wgmmas done
            prev = gl.maximum(i - 1, 0)
            mbarrier.arrive(a_empty.index(prev % a_stages), pred=i > 0)
            mbarrier.arrive(p.empty.index(prev % p.STAGES), pred=i > 0)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _ws_store(p, acc, HALF)

    @gluon.jit
    def _ws_smem_mma_lo(p, a_smem, a_full, a_empty):
        _ws_smem_mma(p, a_smem, a_full, a_empty, 0)

    @gluon.jit
    def _ws_smem_mma_hi(p, a_smem, a_full, a_empty):
        _ws_smem_mma(p, a_smem, a_full, a_empty, 1)

    @gluon.jit
    def _ws_smem_decode4(p, a_smem, a_full, a_empty):
        _ws_smem_decode(p, a_smem, a_full, a_empty, 4)

    @gluon.jit
    def _ws_smem_decode8(p, a_smem, a_full, a_empty):
        _ws_smem_decode(p, a_smem, a_full, a_empty, 8)

    @gluon.jit(do_not_specialize=["n_blocks"])
    def _mxfp4_moe_ws_kernel(
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
        STAGES: gl.constexpr,
        TILES_INNER: gl.constexpr,
        MMA_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        SMEM_A: gl.constexpr = False,
        DECODE_REGS: gl.constexpr = 0,
        DECODE_WARPS: gl.constexpr = 4,
        EXP_DECODE: gl.constexpr = False,
        SPLIT: gl.constexpr = False,
    ):
        """``_mxfp4_moe_wgmma_kernel``'s register form split by role: a copy partition filling a
        ring of stages on mbarriers, and two MMA partitions (one warp group, 64 weight rows each)
        that never meet at a block barrier. Measured against the one-role kernel because the
        profile of that kernel (docs/performance.md §9) shows its expansion (ALU) and its wgmmas
        (tensor pipe) running one after the other."""
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
        x_smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, _BK], gl.bfloat16)
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_T, _BK], x_smem_l)
        w_smem = gl.allocate_shared_memory(gl.int8, [STAGES, 2, _BW, 16], plain3)
        s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 2, _BW], plain2)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=128)  # one arrival a copy thread (noinc)
            # one a warp group (and, with SMEM_A, one from the expanding partition)
            mbarrier.init(empty.index(i), count=3 if SMEM_A else 2)
        p = _WsArgs(a_ptr, a_rows_ptr, w_ptr, s_ptr, lut_ptr, y_ptr, e, pid_n, row0, row1, N, s_am, s_we, s_wt,
                    s_se, s_st, s_ym, x_smem, w_smem, s_smem, full, empty, K, GATHER, W_STEP, S_STEP, BLOCK_T,
                    STAGES, EXP_DECODE, SPLIT)  # fmt: skip
        if SMEM_A:
            a_smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BW, _BK], gl.bfloat16)
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, _BW, _BK], a_smem_l)
            a_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            a_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(a_full.index(i), count=1)  # the expanding partition
                mbarrier.init(a_empty.index(i), count=2)  # one a warp group
            a = (p, a_smem, a_full, a_empty)
            if DECODE_WARPS == 8:
                gl.warp_specialize(
                    [(_ws_smem_mma_lo, a), (_ws_smem_mma_hi, a), (_ws_load, (p,)), (_ws_smem_decode8, a)],
                    [4, 4, 8],
                    [MMA_REGS, 40, DECODE_REGS],
                )
            else:
                gl.warp_specialize(
                    [(_ws_smem_mma_lo, a), (_ws_smem_mma_hi, a), (_ws_load, (p,)), (_ws_smem_decode4, a)],
                    [4, 4, 4],
                    [MMA_REGS, 40, DECODE_REGS],
                )
        else:
            gl.warp_specialize([(_ws_mma_lo, (p,)), (_ws_mma_hi, (p,)), (_ws_load, (p,))], [4, 4], [MMA_REGS, 40])


# (launch registers a thread, the MMA partitions' registers) by M-block: the launch's figure sets
# the occupancy (12 warps a program: 80 -> two programs an SM), the copy partition keeps 40 and the
# first MMA partition (the default one) gets what the other two leave
REGISTERS = {16: (80, 96), 32: (80, 96), 64: (80, 96), 128: (104, 136)}


# the ``SMEM_A`` form's (launch, second MMA partition's, expanding partition's) registers a thread
# by the expanding partition's warps, every M-block: one program an SM (16 warps at 128 registers,
# 20 at 96); compiled offline with nothing spilled, not yet run on a device
SMEM_A_REGISTERS = {4: (128, 152, 104), 8: (96, 152, 80)}


def launch(grid: tuple[int], args: tuple, constexprs: dict, smem_a: bool = False, decode_warps: int = 4) -> None:
    """``_mxfp4_moe_ws_kernel`` with ``moe_gluon.mxfp4_moe_gemm_wgmma``'s arguments (the
    register-operand form's, activations in ``k_order``; ``smem_a``: the expanded weights through
    shared memory by ``decode_warps`` warps of their own, activations in K order)."""
    if smem_a:
        maxnreg, mma_regs, decode_regs = SMEM_A_REGISTERS[decode_warps]
        _mxfp4_moe_ws_kernel[grid](*args, **constexprs, MMA_REGS=mma_regs, num_warps=4, maxnreg=maxnreg,
                                   SMEM_A=True, DECODE_REGS=decode_regs, DECODE_WARPS=decode_warps)  # fmt: skip
        return
    maxnreg, mma_regs = REGISTERS[constexprs["BLOCK_T"]]
    _mxfp4_moe_ws_kernel[grid](*args, **constexprs, MMA_REGS=mma_regs, num_warps=4, maxnreg=maxnreg)
