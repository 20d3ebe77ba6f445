"""Sparse latent attention on Hopper in Gluon (issue 15): attention version 5, the default wherever
it takes the operands (1.4-1.7x version 3 on the H200, docs/performance.md §12).

Why a second kernel: version 3 (Triton, ``attn_kernels._sparse_attn_kernel``) runs at 16-17 % of its
floor at 16K rows, and Nsight Compute calls it latency-bound (docs/performance.md §12): one 8-warp
block an SM, 0.28 instructions issued a cycle, 825 instructions a warp a 32-key tile, and Triton
cannot take 64-key tiles there without spilling. Here the kernel states its own tiles and stages:
one query row a program (64 heads x D), the queries and a two-stage ring of 64-key tiles in shared
memory, filled by ``cp.async`` gathers of the window's rows and of the selected entries; the logits
[64 heads, 64 keys] as one wgmma with each warp group taking half the keys, the value product with
each warp group taking half the head dim, the probabilities handed over through shared memory. Per
64 keys that is one accumulator rescale (version 3: two) and no register spills.

Numerics are version 3's: bf16 operands with fp32 accumulation, invisible keys at -inf, the running
max starting at -1e30 (the reference's clamp), probabilities rounded to bf16 for the value product
while their fp32 sum is kept, the sink in the denominator; a row that sees nothing gives zeros.

Gluon does not run under Triton's interpreter: the CPU suite compiles this kernel for sm_90
(tests/bench/test_attn_kernels_aot.py) and the device tests compare it with version 3
(tests/model/test_attn_kernels_cuda.py).
"""

from __future__ import annotations

import torch

try:  # the core must import with torch alone (no Triton: no kernels)
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

AVAILABLE = triton is not None
BLOCK_H = 64  # heads a program: one wgmma M
BLOCK_N = 64  # keys a tile
NUM_WARPS = 8  # two warp groups


if AVAILABLE:

    @gluon.jit
    def _key_rows(t, row, widx_ptr, sel_ptr, win_ptr, new_ptr, pool_ptr, s_wn, s_nn, s_wir, s_sr,
                  W: gl.constexpr, KSEL: gl.constexpr, BN: gl.constexpr, TWO_WIN: gl.constexpr,
                  ALIGN: gl.constexpr, layout: gl.constexpr):  # fmt: skip
        """Tile t's key rows [BN] in ``layout``: (first element's pointer, visible). Slots below W
        are window slots (ring buffer row >= 0, this step's row -2 - i with ``TWO_WIN``, -1 hidden),
        the rest selected entries as pool element offsets (-1 unused)."""
        j = t * BN + gl.arange(0, BN, layout=layout)
        is_win = j < W
        wi = gl.load(widx_ptr + row * s_wir + j, mask=is_win, other=-1).to(gl.int64)
        e = gl.load(sel_ptr + row * s_sr + (j - W), mask=(j >= W) & (j < W + KSEL), other=-1).to(gl.int64)
        if TWO_WIN:
            win_ok = (wi >= 0) | (wi <= -2)
            win_row = gl.where(wi >= 0, win_ptr + gl.maximum(wi, 0) * s_wn, new_ptr + gl.maximum(-2 - wi, 0) * s_nn)
        else:
            win_ok = wi >= 0
            win_row = win_ptr + gl.maximum(wi, 0) * s_wn
        off = gl.where(e >= 0, e, 0)
        if ALIGN > 1:  # every offset a multiple of ALIGN elements: 16-byte copies (version 3's hint)
            off = gl.multiple_of(off, ALIGN)
        ptr = gl.where(is_win, win_row, pool_ptr + off)
        return ptr, gl.where(is_win, win_ok, e >= 0)

    @gluon.jit
    def _sparse_attn_gluon_kernel(
        q_ptr,
        win_ptr,
        new_ptr,
        widx_ptr,
        sel_ptr,
        pool_ptr,
        sink_ptr,
        out_ptr,
        s_qr,
        s_qh,
        s_wn,
        s_nn,
        s_wir,
        s_sr,
        s_or,
        s_oh,
        NH,
        scale,
        W: gl.constexpr,
        KSEL: gl.constexpr,
        D: gl.constexpr,
        TWO_WIN: gl.constexpr,
        ALIGN: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BH: gl.constexpr = 64
        BN: gl.constexpr = 64
        N_TILES: gl.constexpr = (W + KSEL + BN - 1) // BN  # a ragged last tile: its tail masked
        row = gl.program_id(0).to(gl.int64)
        # logits [64 heads, 64 keys]: each warp group half the keys; output [64, D]: half the dims
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16]
        )
        # copies: 16 bytes a lane, a warp 256 elements of one row a pass
        cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, D], gl.bfloat16)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], q_sl)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, D], k_sl)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], p_sl)

        d = gl.arange(0, D, layout=gl.SliceLayout(0, cp_l))
        hq = gl.arange(0, BH, layout=gl.SliceLayout(1, cp_l))
        q_src = q_ptr + row * s_qr + hq.to(gl.int64)[:, None] * s_qh + d[None, :]
        async_copy.async_copy_global_to_shared(q_smem, q_src, mask=(hq < NH)[:, None])
        for t in gl.static_range(2):  # the ring's first two tiles (the queries ride with tile 0)
            ptr, ok0 = _key_rows(t, row, widx_ptr, sel_ptr, win_ptr, new_ptr, pool_ptr, s_wn, s_nn, s_wir, s_sr,
                                W, KSEL, BN, TWO_WIN, ALIGN, gl.SliceLayout(1, cp_l))  # fmt: skip
            async_copy.async_copy_global_to_shared(k_smem.index(t), ptr[:, None] + d[None, :], mask=ok0[:, None])
            async_copy.commit_group()

        m_i = gl.full([BH], -1e30, gl.float32, layout=gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BH], gl.float32, layout=gl.SliceLayout(1, s_l))
        acc = gl.zeros([BH, D], gl.float32, o_l)
        for t in range(N_TILES):
            stage = t % 2
            # tile t has landed (t + 1 may still be in flight), handed to wgmma's async proxy: each
            # writer fences, then the barrier (moe_gluon's first hazard)
            async_copy.wait_group(1)
            fence_async_shared()
            gl.thread_barrier()
            kt = k_smem.index(stage)
            s = warpgroup_mma(q_smem, kt.permute((1, 0)), gl.zeros([BH, BN], gl.float32, s_l))
            _, visible = _key_rows(t, row, widx_ptr, sel_ptr, win_ptr, new_ptr, pool_ptr, s_wn, s_nn, s_wir, s_sr,
                              W, KSEL, BN, TWO_WIN, ALIGN, gl.SliceLayout(0, s_l))  # fmt: skip
            logits = gl.where(visible[None, :], s * scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(logits, axis=1))
            alpha = gl.exp(m_i - m_new)
            p = gl.exp(logits - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            acc = warpgroup_mma(p_smem, kt, acc)
            gl.thread_barrier()  # every warp group is done with this stage and with p_smem
            if t + 2 < N_TILES:
                nxt, ok2 = _key_rows(t + 2, row, widx_ptr, sel_ptr, win_ptr, new_ptr, pool_ptr, s_wn, s_nn, s_wir,
                                     s_sr, W, KSEL, BN, TWO_WIN, ALIGN, gl.SliceLayout(1, cp_l))  # fmt: skip
                async_copy.async_copy_global_to_shared(kt, nxt[:, None] + d[None, :], mask=ok2[:, None])
            async_copy.commit_group()  # (empty past the end: wait_group(1) keeps counting tiles)
        async_copy.wait_group(0)

        ho = gl.arange(0, BH, layout=gl.SliceLayout(1, o_l))
        do = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
        sink = gl.load(sink_ptr + ho, mask=ho < NH, other=0.0)
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_l))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
        out = acc / (l_o + gl.exp(sink - m_o))[:, None]
        o_dst = out_ptr + row * s_or + ho.to(gl.int64)[:, None] * s_oh + do[None, :]
        gl.store(o_dst, out.to(out_ptr.dtype.element_ty), mask=(ho < NH)[:, None])


def unsupported(q: torch.Tensor, window_kv: torch.Tensor, window_new: torch.Tensor | None, pool: torch.Tensor,
                round_probs: bool) -> str | None:  # fmt: skip
    """Why version 5 cannot take these operands (None: it can)."""
    if not AVAILABLE or not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "a Hopper (sm_90) kernel: it needs Triton and an sm_90 GPU"
    tensors = [q, window_kv, pool] + ([window_new] if window_new is not None else [])
    if any(t.dtype != torch.bfloat16 for t in tensors) or not round_probs:
        return "bf16 queries, keys and probabilities only"
    # every row it copies starts on 16 bytes (cp.async copies 16 bytes at a time here)
    if any(t.data_ptr() % 16 or any(st % 8 for st in t.stride()[:-1]) or t.stride(-1) != 1 for t in tensors):
        return "rows of queries and keys starting on 16-byte boundaries"
    if q.size(1) > BLOCK_H or q.size(2) not in (256, 512):
        return f"at most {BLOCK_H} heads of 256 or 512 dims, got {q.size(1)} x {q.size(2)}"
    return None


def sparse_attention_gluon(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    widx: torch.Tensor,
    offsets: torch.Tensor,
    pool: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    window_new: torch.Tensor | None,
    align: int,
) -> torch.Tensor:
    """``attn_kernels.sparse_attention_paged``'s version 5 once its wrapper has resolved the
    selected entries to pool element offsets (``offsets``, -1 unused) and checked ``unsupported``."""
    out = torch.empty_like(q)
    new = window_kv if window_new is None else window_new
    _sparse_attn_gluon_kernel[(q.size(0),)](
        q, window_kv, new, widx, offsets, pool, sink, out,
        q.stride(0), q.stride(1), window_kv.stride(0), new.stride(0), widx.stride(0), offsets.stride(0),
        out.stride(0), out.stride(1), q.size(1), float(scale),
        W=widx.size(1), KSEL=offsets.size(1), D=q.size(2), TWO_WIN=window_new is not None, ALIGN=align,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
