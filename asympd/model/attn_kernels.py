"""Fused Triton kernels for the lightning indexer and the sparse latent attention, reading the
paged caches in place. Pure functions: the engine's batched path calls them; the CPU reference
(``attention.Attention._select``, ``attention.sparse_attention``) defines what they compute.

Rows are query rows flattened across sequences. Paged pools are ``[num_blocks, epb, width]`` as in
``kv/paged_cache.py``: entry ``e`` of a sequence is row ``e % epb`` of block ``table[e // epb]``.
Sequences are named by ``row_seq [rows]`` (int, which row of ``block_tables [S, max_blocks]`` a row
reads; rows of one sequence must be contiguous; ``None`` = every row reads ``block_tables[0]``).
One table per sequence rather than per row lets a program score several rows of one sequence
against one key tile (the indexer's GEMM has ``rows_per_tile * heads`` rows instead of ``heads``).

``indexer_topk(q, w, key_pool, block_tables, n_visible, k, *, row_seq=None, candidates=None,
candidate_block=1, block_max=0, rows_per_tile=None, block_n=None, version=None) -> sel [rows, k] int64`` (or
``(sel, block_scores)`` when ``block_max``):
    q [rows, H, hd] (already FP4-rounded), w [rows, H] (head weights with their scale folded in),
    key_pool [num_blocks, epb, hd]. score(row, e) = sum_h w * relu(q_h . key_e) for e <
    n_visible[row]; the k best per row, ties to the lowest entry index, as ``ops.stable_topk``
    (a 64-bit key: the score's order-preserving bits above, the reversed index below).
    ``sel`` holds the chosen entries ascending, then -1 in unused slots: ``Attention._select``'s
    output padded to k. ``candidates`` [rows, >= ceil(n / candidate_block)] bool restricts a
    re-index layer to the candidate pool (other entries score -inf, as the reference masks them).
    ``block_max`` > 0 also returns the max score of every ``block_max`` entries [rows,
    ceil(max n_visible / block_max)] fp32 (-inf beyond a row's visible entries), from the same pass.
    Nothing of size [rows, entries] is written except those block maxima (1/block of it).
    How: a program takes ``rows_per_tile`` rows of one sequence and walks the entries in tiles of
    ``block_n``: one GEMM ([rows x H, hd] x [hd, block_n]), relu, the head weights, the sum over
    heads, then each score becomes its key. Keys above the row's threshold (the smallest of its
    running top-k) are appended to a per-row buffer of k slots in global memory (L2-resident);
    only when a buffer would overflow, and once at the end, is it sorted (bitonic) and merged into
    the running top-k (best descending vs buffer ascending: the elementwise max is bitonic, one
    bitonic merge sorts it). With scores in no particular order a row merges about
    ln(n / k) + 1 times instead of once per tile. That is version 1; version 2 differs in three
    ways: the GEMM is keys x queries^T ([block_n, hd] x
    [hd, rows x H]) so a row's head sum is within a warp (in version 1 the heads run down the
    MMA's M across warps and the sum goes through shared memory); the running top-k sits in
    scratch beside the buffer (L2) instead of registers; and the buffer holds ``NSLICE`` x k
    slots, the tiles between merges a counted loop bounded by the buffer's room, so that loop has
    no barrier and Triton pipelines the key tiles (cp.async); version 1's merge check with its
    barriers inside the loop stopped that. On CUDA it also takes 8 rows per tile where
    sequences average 8 rows or more (prefill), reading each key tile once per 8 rows. Version 3
    is version 2 with the per-tile work cut (sm_90 SASS of the
    decode tile: 1396 -> 578 instructions per warp, 16 -> 8 barriers): a tile inside one cache
    block (epb a multiple of block_n, as at true shapes) is one table load plus loop-invariant
    offsets; relu and the head weights in packed bf16x2 (the same roundings); the threshold test
    on the scores' 32 order bits in the GEMM's entry-major layout, takers claiming buffer slots by
    atomic adds on per-row counters (no transpose, cumsum or cross-warp reduction per tile; the
    merge sorts the slots, so their order does not matter); and, where the row tiles leave SMs
    idle (few sequences), each tile's entries split over programs whose top-k keys the wrapper
    merges (exact: a key holds its entry index, no two are equal). Version 5 (the default) is
    two kernels: the score pass (version 3's tile, nothing else) writes each visible entry's score
    as a 16-bit radix key (32-bit for fp32 inputs), then a program per row finds its k-th best key
    digit by digit (histograms) and takes the winners in entry order -- the [rows, entries] keys
    are written, 1/64 of the per-head bf16 scores the unfused path writes.
    bf16 inputs follow the reference's bf16 roundings (per-head score, weighted score, the sum);
    fp32 inputs compute in fp32 (IEEE dots).
``indexer_topk_candidates(..., k, topk_blocks, block, *, max_entries=None) -> (sel, cand)``:
    the candidate source (L20): its own top-k, and its pool as a block mask cand [rows, nb] bool:
    ``attention.select_candidate_blocks`` at block level (the newest visible block pinned) on the
    kernel's block maxima. Re-index layers pass cand with ``candidate_block=block``.
``sparse_attention_paged(q, window_kv, window_idx, sel, ckv_pool, block_tables, sink, scale,
round_probs, *, row_seq=None, window_new=None, block_h=None, block_n=None, version=None) -> [rows, h, d]`` in q's dtype:
    q [rows, h, d]; window_kv [n_w, d] with window_idx [rows, W] (row of window_kv, -1 = not
    visible; the batched path's window index with -1 where not visible); sel [rows, k] entry ids
    of ckv_pool [num_blocks, epb, d] (-1 = unused). Online softmax (K = V) over the window rows then
    the selected entries, read straight from the pool through the block table (``window_new``: a
    second window tensor, this step's rows, named by window_idx -2 - i); the sink joins the
    denominator; a row with nothing visible gives zeros. fp32 logits; with ``round_probs`` the
    probabilities go to bf16 before the value product, as in the reference, except that each is
    rounded relative to the running max rather than the final one (FlashMLA's order): a rescale by
    a power-of-e factor after rounding, within about one bf16 ulp of the reference's value. One
    program per (row, ``block_h`` heads), keys in tiles of ``block_n`` rows. ``version`` 1: 16
    heads x 32 keys; 2: all heads of a row (up to 64) x 16 keys, the selected entries resolved to
    pool offsets by the wrapper; 3: version 2 with 16-byte pipelined entry loads and 32-key tiles;
    5 (``ATTENTION_VERSION``, where its operands allow, else 3): the Gluon kernel of ``attn_gluon``.

With ``TRITON_INTERPRET=1`` both run on CPU tensors (the tests); dots are then fp32 (the
interpreter's bf16 dot is wrong, see ``gemm_kernels._dot_f32``).
"""

from __future__ import annotations

from typing import Any

import torch

from asympd.model.attention import select_candidate_blocks
from asympd.model.gemm_kernels import _dot_f32

try:  # Triton ships with CUDA builds of torch; on CPU-only installs it is optional (tests use it)
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None

AVAILABLE = triton is not None

if AVAILABLE:
    # Arguments whose values follow the context (block-table width, candidate blocks, block-maxima
    # columns): Triton would otherwise compile a new specialization when one turns 1 or a multiple of
    # 16, and an indexer compile takes seconds -- a stall mid-traffic (docs/performance.md §10).
    _VARYING = ("s_ts", "s_cr", "s_br", "n_bmax")

    @triton.jit
    def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
        """0 / 1 along the j-th innermost axis of a [2] * n_dims hypercube."""
        return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)

    @triton.jit
    def _compare_swap(h, flip, i: tl.constexpr, n_dims: tl.constexpr):
        """Order the pairs along the i-th innermost axis: ascending, descending where ``flip``.
        Min and max over a size-2 axis (the interpreter runs those natively, unlike xor-sums)."""
        lo = tl.min(h, axis=n_dims - 1 - i, keep_dims=True)
        hi = tl.max(h, axis=n_dims - 1 - i, keep_dims=True)
        return tl.where((_indicator(n_dims, i) ^ flip) != 0, hi, lo)

    @triton.jit
    def _bitonic(x, LOG_ROWS: tl.constexpr, LOG_N: tl.constexpr, DESC: tl.constexpr, MERGE_ONLY: tl.constexpr):
        """Sort each row of x [2**LOG_ROWS, 2**LOG_N]. ``MERGE_ONLY``: the rows are already bitonic
        (LOG_N compare-swap rounds instead of LOG_N * (LOG_N + 1) / 2)."""
        n_dims: tl.constexpr = LOG_ROWS + LOG_N
        h = tl.reshape(x, [2] * n_dims)
        if not MERGE_ONLY:
            for stage in tl.static_range(1, LOG_N):
                flip = _indicator(n_dims, stage)  # alternate directions: bitonic runs of 2**(stage + 1)
                for i in tl.static_range(stage):
                    h = _compare_swap(h, flip, stage - 1 - i, n_dims)
        for i in tl.static_range(LOG_N):
            h = _compare_swap(h, DESC, LOG_N - 1 - i, n_dims)
        return tl.reshape(h, x.shape)

    @triton.jit
    def _score_keys(
        q,
        w,
        kpool_ptr,
        table_ptr,
        vis,
        cand_ptr,
        s_cr,
        rows,
        rmask,
        e0,
        n_max,
        s_kb,
        s_ke,
        EPB,
        H: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        HAS_CAND: tl.constexpr,
        CAND_BLOCK: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Scores of entries e0 .. e0+BN-1 for the tile's BM rows: ([BM, BN] fp32 with -inf on
        masked candidates, [BM, BN] visible)."""
        e = e0 + tl.arange(0, BN)
        emask = e < n_max
        blk = tl.load(table_ptr + e // EPB, mask=emask, other=0).to(tl.int64)
        d = tl.arange(0, D)
        kp = kpool_ptr + blk[:, None] * s_kb + (e % EPB).to(tl.int64)[:, None] * s_ke + d[None, :]
        keys = tl.load(kp, mask=emask[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys.to(q.dtype)))
        if ROUND_BF16:
            s = s.to(tl.bfloat16).to(tl.float32)
        s = tl.maximum(s, 0.0) * w[:, None]
        if ROUND_BF16:
            s = s.to(tl.bfloat16).to(tl.float32)
        s = tl.sum(tl.reshape(s, (BM, H, BN)), axis=1)
        if ROUND_BF16:
            s = s.to(tl.bfloat16).to(tl.float32)
        visible = rmask[:, None] & (e[None, :] < vis[:, None])
        if HAS_CAND:
            c = tl.load(
                cand_ptr + rows.to(tl.int64)[:, None] * s_cr + (e // CAND_BLOCK)[None, :], mask=visible, other=0
            )
            s = tl.where(c != 0, s, float("-inf"))
        return s, visible

    @triton.jit
    def _keys_of(s, visible, e0, BN: tl.constexpr):
        """Scores -> int64 keys ordered as the stable descending sort (score, then lower index).
        Invisible entries get -2**63 + 1, below every real key (-inf's is about -2**63 + 2**55)."""
        e = e0 + tl.arange(0, BN)
        s = tl.where(s == 0.0, 0.0, s)  # -0 and +0 are one value
        bits = s.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - e).to(tl.int64)[None, :]
        return tl.where(visible, key, -9223372036854775807)

    @triton.jit
    def _store_block_max(
        s, visible, bmax_ptr, rows, rmask, e0, s_br, n_bmax, BM: tl.constexpr, BN: tl.constexpr, BMAX: tl.constexpr
    ):
        """Max score of each BMAX entries (-inf where none is visible)."""
        NB: tl.constexpr = BN // BMAX
        bm = tl.max(tl.reshape(tl.where(visible, s, float("-inf")), (BM, NB, BMAX)), axis=2)
        b = e0 // BMAX + tl.arange(0, NB)
        tl.store(
            bmax_ptr + rows.to(tl.int64)[:, None] * s_br + b[None, :], bm, mask=rmask[:, None] & (b[None, :] < n_bmax)
        )

    @triton.jit
    def _scan_tile(
        best, thresh, cnt, bufp, q, w, kpool_ptr, table_ptr, vis, cand_ptr, bmax_ptr, s_cr, s_br, n_bmax, rows,
        rmask, e0, n_max, s_kb, s_ke, EPB, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        KP: tl.constexpr, LOG_BM: tl.constexpr, LOG_KP: tl.constexpr, HAS_CAND: tl.constexpr,
        CAND_BLOCK: tl.constexpr, BMAX: tl.constexpr, ROUND_BF16: tl.constexpr, DOT_F32: tl.constexpr,
        TL_SORT: tl.constexpr,
    ):  # fmt: skip
        """Score entries e0 .. e0+BN-1; keys above the row's threshold join its candidate buffer
        (KP slots in global memory, L2-resident); a buffer that would overflow, and the last one
        (the scan runs one all-invisible tile past n_max), is merged into the running top-KP."""
        s, v = _score_keys(
            q, w, kpool_ptr, table_ptr, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke, EPB,
            H, D, BM, BN, HAS_CAND, CAND_BLOCK, ROUND_BF16, DOT_F32,
        )  # fmt: skip
        if BMAX > 0:  # block maxima of the candidate source, from the same scores
            _store_block_max(s, v, bmax_ptr, rows, rmask, e0, s_br, n_bmax, BM, BN, BMAX)
        keys = _keys_of(s, v, e0, BN)
        take = keys > thresh[:, None]
        n_take = tl.sum(take.to(tl.int32), axis=1)
        if (tl.max(cnt + n_take, axis=0) > KP) | (e0 >= n_max):
            tl.debug_barrier()  # the buffer's stores are visible to every thread
            j = tl.arange(0, KP)
            cand = tl.load(bufp + j[None, :], mask=j[None, :] < cnt[:, None], other=-9223372036854775807)
            tl.debug_barrier()  # read before anyone refills it
            if TL_SORT:  # Triton's own sort (xor-sum compare-swaps, full sorts): the fallback
                cand = tl.sort(cand, dim=1, descending=False)
                best = tl.sort(tl.maximum(best, cand), dim=1, descending=True)
            else:
                # best descending against the candidates ascending: the elementwise max holds the
                # KP best of both (a bitonic sequence), so one bitonic merge sorts it
                cand = _bitonic(cand, LOG_BM, LOG_KP, 0, False)
                best = _bitonic(tl.maximum(best, cand), LOG_BM, LOG_KP, 1, True)
            thresh = tl.min(best, axis=1)  # keys at or below it can no longer enter
            cnt = tl.zeros_like(cnt)
            take = keys > thresh[:, None]
            n_take = tl.sum(take.to(tl.int32), axis=1)
        pos = cnt[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
        tl.store(bufp + pos, keys, mask=take)
        return best, thresh, cnt + n_take

    @triton.jit(do_not_specialize=_VARYING)
    def _indexer_topk_kernel(
        q_ptr,
        w_ptr,
        kpool_ptr,
        tables_ptr,
        row_seq_ptr,
        tile_row0_ptr,
        tile_rows_ptr,
        vis_ptr,
        cand_ptr,
        bmax_ptr,
        buf_ptr,
        out_ptr,
        s_qr,
        s_qh,
        s_wr,
        s_kb,
        s_ke,
        s_ts,
        s_cr,
        s_br,
        n_bmax,
        EPB,
        K,
        H: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        KP: tl.constexpr,
        LOG_BM: tl.constexpr,
        LOG_KP: tl.constexpr,
        HAS_CAND: tl.constexpr,
        CAND_BLOCK: tl.constexpr,
        BMAX: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr,
        TL_SORT: tl.constexpr,
        PIPELINE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        row0, nrows, rows, rmask, vis, n_max = _row_tile(tile_row0_ptr, tile_rows_ptr, vis_ptr, tile, BM)
        r = tl.arange(0, BM)
        seq = tl.load(row_seq_ptr + row0).to(tl.int64)
        table_ptr = tables_ptr + seq * s_ts
        # queries as one [BM * H, D] operand: every head of every row against the same keys
        mh = tl.arange(0, BM * H)
        qrow = row0 + mh // H
        qmask = (mh // H) < nrows
        d = tl.arange(0, D)
        q = tl.load(
            q_ptr + qrow.to(tl.int64)[:, None] * s_qr + (mh % H)[:, None] * s_qh + d[None, :],
            mask=qmask[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + qrow.to(tl.int64) * s_wr + mh % H, mask=qmask, other=0.0).to(tl.float32)
        best = tl.full((BM, KP), -9223372036854775807, tl.int64)  # sorted descending
        thresh = tl.full((BM,), -9223372036854775807, tl.int64)
        cnt = tl.zeros((BM,), tl.int32)
        bufp = buf_ptr + tile.to(tl.int64) * (BM * KP) + r[:, None] * KP
        if PIPELINE:  # a counted loop, so Triton pipelines the key loads
            for e0 in range(0, n_max + BN, BN):
                best, thresh, cnt = _scan_tile(
                    best, thresh, cnt, bufp, q, w, kpool_ptr, table_ptr, vis, cand_ptr, bmax_ptr, s_cr, s_br, n_bmax,
                    rows, rmask, e0, n_max, s_kb, s_ke, EPB, H, D, BM, BN, KP, LOG_BM, LOG_KP, HAS_CAND, CAND_BLOCK,
                    BMAX, ROUND_BF16, DOT_F32, TL_SORT,
                )  # fmt: skip
        else:  # the interpreter cannot take a tensor as a range bound
            e0 = 0
            while e0 < n_max + BN:
                best, thresh, cnt = _scan_tile(
                    best, thresh, cnt, bufp, q, w, kpool_ptr, table_ptr, vis, cand_ptr, bmax_ptr, s_cr, s_br, n_bmax,
                    rows, rmask, e0, n_max, s_kb, s_ke, EPB, H, D, BM, BN, KP, LOG_BM, LOG_KP, HAS_CAND, CAND_BLOCK,
                    BMAX, ROUND_BF16, DOT_F32, TL_SORT,
                )  # fmt: skip
                e0 += BN
        # the first K keys are the selection; the wrapper sorts their indices (a [rows, K] sort)
        j = tl.arange(0, KP)
        real = (best > -9223372036854775807) & (j[None, :] < K)
        idx = tl.where(real, 0x7FFFFFFF - (best & 0x7FFFFFFF), 0x7FFFFFFF)
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * K + j[None, :],
            idx,
            mask=rmask[:, None] & (j[None, :] < K),
        )

    # ---- version 2 of the indexer: the GEMM transposed (entries x (row, head)), so the head sum is
    # within a warp; the running top-k lives next to the candidate buffer (L2), not in registers ----

    @triton.jit
    def _score_keys_t(
        qt,
        wt,
        kpool_ptr,
        table_ptr,
        vis,
        cand_ptr,
        s_cr,
        rows,
        rmask,
        e0,
        n_max,
        s_kb,
        s_ke,
        EPB,
        H: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        HAS_CAND: tl.constexpr,
        CAND_BLOCK: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """``_score_keys`` with the key tile as the GEMM's M: keys [BN, D] x qt [D, BM * H] ->
        [BN, BM * H]. In the MMA layout a thread holds consecutive columns, so the sum over a row's
        H heads is in registers and among the 4 lanes of a quad, not across warps through shared
        memory; only the [BN, BM] result is transposed. The wgmma M (64) is the key tile, so BM can
        be small (decode: the rows of one request) without padding."""
        e = e0 + tl.arange(0, BN)
        emask = e < n_max
        blk = tl.load(table_ptr + e // EPB, mask=emask, other=0).to(tl.int64)
        d = tl.arange(0, D)
        kp = kpool_ptr + blk[:, None] * s_kb + (e % EPB).to(tl.int64)[:, None] * s_ke + d[None, :]
        keys = tl.load(kp, mask=emask[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(keys.to(tl.float32), qt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(keys.to(qt.dtype), qt)
        if ROUND_BF16:
            s = s.to(tl.bfloat16).to(tl.float32)
        s = tl.maximum(s, 0.0) * wt[None, :]
        if ROUND_BF16:
            s = s.to(tl.bfloat16).to(tl.float32)
        s = tl.trans(tl.sum(tl.reshape(s, (BN, BM, H)), axis=2))
        if ROUND_BF16:
            s = s.to(tl.bfloat16).to(tl.float32)
        visible = rmask[:, None] & (e[None, :] < vis[:, None])
        if HAS_CAND:
            c = tl.load(
                cand_ptr + rows.to(tl.int64)[:, None] * s_cr + (e // CAND_BLOCK)[None, :], mask=visible, other=0
            )
            s = tl.where(c != 0, s, float("-inf"))
        return s, visible

    @triton.jit
    def _merge_scratch(
        bestp, bufp, cnt, KP: tl.constexpr, NSLICE: tl.constexpr, LOG_BM: tl.constexpr, LOG_KP: tl.constexpr,
        TL_SORT: tl.constexpr,
    ):  # fmt: skip
        """Merge each row's buffered keys (``cnt`` of NSLICE * KP slots) into its running top-KP,
        both in scratch, a KP slice at a time (empty slices skipped): the new threshold (the
        smallest kept key)."""
        tl.debug_barrier()  # the buffer's stores are visible to every thread
        j = tl.arange(0, KP)
        best = tl.load(bestp + j[None, :])
        for i in range(NSLICE):  # a loop, not unrolled: one copy of the sort to compile
            if tl.max(cnt, axis=0) > i * KP:
                slot = i * KP + j
                cand = tl.load(bufp + slot[None, :], mask=slot[None, :] < cnt[:, None], other=-9223372036854775807)
                if TL_SORT:
                    cand = tl.sort(cand, dim=1, descending=False)
                    best = tl.sort(tl.maximum(best, cand), dim=1, descending=True)
                else:  # best descending against the candidates ascending: one bitonic merge sorts the max
                    cand = _bitonic(cand, LOG_BM, LOG_KP, 0, False)
                    best = _bitonic(tl.maximum(best, cand), LOG_BM, LOG_KP, 1, True)
        tl.debug_barrier()  # read before anyone refills the buffer
        tl.store(bestp + j[None, :], best)
        return tl.min(best, axis=1)

    @triton.jit
    def _scan_tile_v2(
        thresh, cnt, bufp, qt, wt, kpool_ptr, table_ptr, vis, cand_ptr, bmax_ptr, s_cr, s_br, n_bmax, rows, rmask,
        e0, n_max, s_kb, s_ke, EPB, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        HAS_CAND: tl.constexpr, CAND_BLOCK: tl.constexpr, BMAX: tl.constexpr, ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """Score one tile; keys above the row's threshold are appended to its buffer. No merge and
        no barrier here: the caller bounds a run of tiles by the buffer's room, so the loop over
        them is a plain counted loop that Triton software-pipelines (cp.async key tiles)."""
        s, v = _score_keys_t(
            qt, wt, kpool_ptr, table_ptr, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke, EPB,
            H, D, BM, BN, HAS_CAND, CAND_BLOCK, ROUND_BF16, DOT_F32,
        )  # fmt: skip
        if BMAX > 0:
            _store_block_max(s, v, bmax_ptr, rows, rmask, e0, s_br, n_bmax, BM, BN, BMAX)
        keys = _keys_of(s, v, e0, BN)
        take = keys > thresh[:, None]
        pos = cnt[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
        tl.store(bufp + pos, keys, mask=take)
        return cnt + tl.sum(take.to(tl.int32), axis=1)

    @triton.jit
    def _row_tile(tile_row0_ptr, tile_rows_ptr, vis_ptr, tile, BM: tl.constexpr):
        """A row tile's first row, row count, rows, their mask, visible counts and the largest."""
        row0 = tl.load(tile_row0_ptr + tile)
        nrows = tl.load(tile_rows_ptr + tile)
        r = tl.arange(0, BM)
        rows = row0 + r
        rmask = r < nrows
        vis = tl.load(vis_ptr + rows, mask=rmask, other=0).to(tl.int32)
        return row0, nrows, rows, rmask, vis, tl.max(vis, axis=0)

    @triton.jit
    def _query_tile(
        q_ptr, w_ptr, row0, nrows, s_qr, s_qh, s_wr, s_ke, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr, BF16X2: tl.constexpr,
    ):  # fmt: skip
        """A row tile's queries as the GEMM's right operand qt [D, BM * H], their head weights wt
        [BM * H] (bf16 kept for the packed epilogue) and a key tile's offsets koff [BN, D]."""
        mh = tl.arange(0, BM * H)
        qrow = row0 + mh // H
        qmask = (mh // H) < nrows
        d = tl.arange(0, D)
        qt = tl.load(
            q_ptr + qrow.to(tl.int64)[None, :] * s_qr + (mh % H)[None, :] * s_qh + d[:, None],
            mask=qmask[None, :],
            other=0.0,
        )
        wt = tl.load(w_ptr + qrow.to(tl.int64) * s_wr + mh % H, mask=qmask, other=0.0)
        if not BF16X2:
            wt = wt.to(tl.float32)
        koff = tl.arange(0, BN)[:, None] * s_ke + d[None, :]
        return qt, wt, koff

    @triton.jit(do_not_specialize=_VARYING)
    def _indexer_topk_kernel_v2(
        q_ptr,
        w_ptr,
        kpool_ptr,
        tables_ptr,
        row_seq_ptr,
        tile_row0_ptr,
        tile_rows_ptr,
        vis_ptr,
        cand_ptr,
        bmax_ptr,
        buf_ptr,
        out_ptr,
        s_qr,
        s_qh,
        s_wr,
        s_kb,
        s_ke,
        s_ts,
        s_cr,
        s_br,
        n_bmax,
        EPB,
        K,
        H: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        KP: tl.constexpr,
        LOG_BM: tl.constexpr,
        LOG_KP: tl.constexpr,
        HAS_CAND: tl.constexpr,
        CAND_BLOCK: tl.constexpr,
        BMAX: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr,
        TL_SORT: tl.constexpr,
        PIPELINE: tl.constexpr,
        NSLICE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        row0, nrows, rows, rmask, vis, n_max = _row_tile(tile_row0_ptr, tile_rows_ptr, vis_ptr, tile, BM)
        r = tl.arange(0, BM)
        seq = tl.load(row_seq_ptr + row0).to(tl.int64)
        table_ptr = tables_ptr + seq * s_ts
        # queries as the GEMM's B operand [D, BM * H], loaded transposed once
        qt, wt, _ = _query_tile(q_ptr, w_ptr, row0, nrows, s_qr, s_qh, s_wr, s_ke, H, D, BM, BN, False)
        # scratch per row: the running top-k [KP] (descending), then its candidate buffer [NSLICE * KP]
        CB: tl.constexpr = NSLICE * KP
        bestp = buf_ptr + (tile.to(tl.int64) * BM + r[:, None]) * (KP + CB)
        bufp = bestp + KP
        tl.store(bestp + tl.arange(0, KP)[None, :], tl.full((BM, KP), -9223372036854775807, tl.int64))
        thresh = tl.full((BM,), -9223372036854775807, tl.int64)
        cnt = tl.zeros((BM,), tl.int32)
        e0 = 0
        while e0 < n_max:
            room = (CB - tl.max(cnt, axis=0)) // BN  # tiles that cannot overflow any row's buffer
            if room == 0:
                thresh = _merge_scratch(bestp, bufp, cnt, KP, NSLICE, LOG_BM, LOG_KP, TL_SORT)
                cnt = tl.zeros_like(cnt)
                room = CB // BN
            e1 = tl.minimum(e0 + room * BN, n_max)
            if PIPELINE:  # a counted loop without barriers: Triton pipelines the key loads
                for e in range(e0, e1, BN):
                    cnt = _scan_tile_v2(
                        thresh, cnt, bufp, qt, wt, kpool_ptr, table_ptr, vis, cand_ptr, bmax_ptr, s_cr, s_br, n_bmax,
                        rows, rmask, e, n_max, s_kb, s_ke, EPB, H, D, BM, BN, HAS_CAND, CAND_BLOCK, BMAX,
                        ROUND_BF16, DOT_F32,
                    )  # fmt: skip
            else:  # the interpreter cannot take a tensor as a range bound
                e = e0
                while e < e1:
                    cnt = _scan_tile_v2(
                        thresh, cnt, bufp, qt, wt, kpool_ptr, table_ptr, vis, cand_ptr, bmax_ptr, s_cr, s_br, n_bmax,
                        rows, rmask, e, n_max, s_kb, s_ke, EPB, H, D, BM, BN, HAS_CAND, CAND_BLOCK, BMAX,
                        ROUND_BF16, DOT_F32,
                    )  # fmt: skip
                    e += BN
            e0 = e1
        _merge_scratch(bestp, bufp, cnt, KP, NSLICE, LOG_BM, LOG_KP, TL_SORT)
        tl.debug_barrier()  # the last merge's stores
        j = tl.arange(0, KP)
        best = tl.load(bestp + j[None, :])
        real = (best > -9223372036854775807) & (j[None, :] < K)
        idx = tl.where(real, 0x7FFFFFFF - (best & 0x7FFFFFFF), 0x7FFFFFFF)
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * K + j[None, :],
            idx,
            mask=rmask[:, None] & (j[None, :] < K),
        )

    # ---- version 3 of the indexer: version 2's transposed GEMM and scratch top-k, plus (1) a key
    # tile inside one cache block is one scalar table load and a hoisted offset tile, not a
    # per-entry division, gather and 64-bit address; (2) relu and head weights in packed bf16x2;
    # (3) the threshold test on the scores' 32 order bits where the GEMM leaves them (entry-major),
    # takers claiming buffer slots by atomics instead of a transpose and a cumsum; (4) a row tile's
    # entries split over the grid's second axis where tiles alone leave SMs idle, merged by the
    # wrapper ----

    @triton.jit
    def _relu_weight_bf16x2(s, w):
        """bf16(relu(bf16(s)) * w) for fp32 s and bf16 w, two at a time in packed bf16 (sm_90's
        ``mul.rn.bf16x2``): 3 instructions and 2 unpacks per pair instead of 2 conversions, 2
        widenings, a max and a multiply per element. The same roundings as the fp32 path (a product
        of two bf16 values is exact in fp32, so rounding it once is what ``mul.rn.bf16x2`` does)."""
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 p, z;
            cvt.rn.bf16x2.f32 p, $3, $2;
            mov.b32 z, 0;
            max.bf16x2 p, p, z;
            mul.rn.bf16x2 p, p, $4;
            shl.b32 $0, p, 16;
            and.b32 $1, p, 0xFFFF0000;
            }""",
            "=r,=r,r,r,r",
            [s, w],
            dtype=tl.float32,
            is_pure=True,
            pack=2,
        )

    @triton.jit
    def _score_keys_v3(
        qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke, EPB,
        H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_CAND: tl.constexpr,
        CAND_BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr, DOT_F32: tl.constexpr, IN_BLOCK: tl.constexpr,
        BF16X2: tl.constexpr,
    ):  # fmt: skip
        """``_score_keys_t``; with ``IN_BLOCK`` (EPB a multiple of BN) the tile's BN entries are
        consecutive rows of one cache block: one table load, the block's base plus ``koff``
        [BN, D] (loop-invariant), no mask (rows past n_max are in the block and masked below)."""
        e = e0 + tl.arange(0, BN)
        if IN_BLOCK:
            blk = tl.load(table_ptr + e0 // EPB).to(tl.int64)
            keys = tl.load(kpool_ptr + blk * s_kb + (e0 % EPB).to(tl.int64) * s_ke + koff)
        else:
            emask = e < n_max
            blk = tl.load(table_ptr + e // EPB, mask=emask, other=0).to(tl.int64)
            d = tl.arange(0, D)
            kp = kpool_ptr + blk[:, None] * s_kb + (e % EPB).to(tl.int64)[:, None] * s_ke + d[None, :]
            keys = tl.load(kp, mask=emask[:, None], other=0.0)
        if DOT_F32:
            s = tl.dot(keys.to(tl.float32), qt.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(keys.to(qt.dtype), qt)
        if BF16X2:  # wt is bf16 here
            s = _relu_weight_bf16x2(s, tl.broadcast_to(wt[None, :], (BN, BM * H)))
        else:
            if ROUND_BF16:
                s = s.to(tl.bfloat16).to(tl.float32)
            s = tl.maximum(s, 0.0) * wt[None, :]
            if ROUND_BF16:
                s = s.to(tl.bfloat16).to(tl.float32)
        s = tl.sum(tl.reshape(s, (BN, BM, H)), axis=2)  # entry-major [BN, BM]: no transpose
        if ROUND_BF16:
            s = s.to(tl.bfloat16).to(tl.float32)
        visible = rmask[None, :] & (e[:, None] < vis[None, :])
        if HAS_CAND:
            c = tl.load(
                cand_ptr + rows.to(tl.int64)[None, :] * s_cr + (e // CAND_BLOCK)[:, None], mask=visible, other=0
            )
            s = tl.where(c != 0, s, float("-inf"))
        return s, visible

    @triton.jit
    def _store_block_max_t(
        s, visible, bmax_ptr, rows, rmask, e0, s_br, n_bmax, BM: tl.constexpr, BN: tl.constexpr, BMAX: tl.constexpr
    ):
        """``_store_block_max`` of entry-major scores [BN, BM]."""
        NB: tl.constexpr = BN // BMAX
        bm = tl.max(tl.reshape(tl.where(visible, s, float("-inf")), (NB, BMAX, BM)), axis=1)
        b = e0 // BMAX + tl.arange(0, NB)
        tl.store(
            bmax_ptr + rows.to(tl.int64)[None, :] * s_br + b[:, None], bm, mask=rmask[None, :] & (b[:, None] < n_bmax)
        )

    @triton.jit
    def _scan_tile_v3(
        thr_hi, cntp, bufp, qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, bmax_ptr, s_cr, s_br, n_bmax, rows,
        rmask, e0, n_max, s_kb, s_ke, EPB, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        HAS_CAND: tl.constexpr, CAND_BLOCK: tl.constexpr, BMAX: tl.constexpr, ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr, IN_BLOCK: tl.constexpr, BF16X2: tl.constexpr,
    ):  # fmt: skip
        """Score one tile (entry-major [BN, BM], as the GEMM leaves it); entries above their row's
        threshold claim buffer slots with an atomic add on the row's counter and store their keys.
        The test is on the 32 order bits alone: the threshold key's entry was merged from an earlier
        tile, so it has a lower index and an equal score cannot beat it (exactly ``key > thresh``).
        No transpose, no cumsum, no reduction across warps: the slots' order is whatever the atomics
        give, and the merge sorts them (the selection does not depend on it)."""
        s, v = _score_keys_v3(
            qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke, EPB,
            H, D, BM, BN, HAS_CAND, CAND_BLOCK, ROUND_BF16, DOT_F32, IN_BLOCK, BF16X2,
        )  # fmt: skip
        if BMAX > 0:
            _store_block_max_t(s, v, bmax_ptr, rows, rmask, e0, s_br, n_bmax, BM, BN, BMAX)
        s = tl.where(s == 0.0, 0.0, s)  # -0 and +0 are one value
        bits = s.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        take = v & (ordered > thr_hi[None, :])
        e = e0 + tl.arange(0, BN)
        key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - e).to(tl.int64)[:, None]
        ones = tl.full((BN, BM), 1, tl.int32)
        pos = tl.atomic_add(cntp[None, :] + tl.zeros((BN, BM), tl.int32), ones, mask=take, sem="relaxed")
        tl.store(bufp[None, :] + pos, key, mask=take)

    @triton.jit(do_not_specialize=_VARYING)
    def _indexer_topk_kernel_v3(
        q_ptr,
        w_ptr,
        kpool_ptr,
        tables_ptr,
        row_seq_ptr,
        tile_row0_ptr,
        tile_rows_ptr,
        vis_ptr,
        cand_ptr,
        bmax_ptr,
        buf_ptr,
        out_ptr,
        cnt_ptr,
        s_qr,
        s_qh,
        s_wr,
        s_kb,
        s_ke,
        s_ts,
        s_cr,
        s_br,
        n_bmax,
        EPB,
        K,
        H: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        KP: tl.constexpr,
        LOG_BM: tl.constexpr,
        LOG_KP: tl.constexpr,
        HAS_CAND: tl.constexpr,
        CAND_BLOCK: tl.constexpr,
        BMAX: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr,
        TL_SORT: tl.constexpr,
        PIPELINE: tl.constexpr,
        NSLICE: tl.constexpr,
        IN_BLOCK: tl.constexpr,
        BF16X2: tl.constexpr,
    ):
        """Program (tile, split): the tile's rows over the split's share of the entries (whole
        tiles of BN); writes the split's running top-KP as keys, out [rows, splits, KP]. The splits
        are the grid's second axis, not a constant: one compiled kernel for every split count."""
        tile = tl.program_id(0)
        split = tl.program_id(1)
        NSPLIT = tl.num_programs(1)
        row0, nrows, rows, rmask, vis, n_max = _row_tile(tile_row0_ptr, tile_rows_ptr, vis_ptr, tile, BM)
        r = tl.arange(0, BM)
        seq = tl.load(row_seq_ptr + row0).to(tl.int64)
        table_ptr = tables_ptr + seq * s_ts
        qt, wt, koff = _query_tile(q_ptr, w_ptr, row0, nrows, s_qr, s_qh, s_wr, s_ke, H, D, BM, BN, BF16X2)
        CB: tl.constexpr = NSLICE * KP
        slot = (tile.to(tl.int64) * NSPLIT + split) * BM + r
        bestp = buf_ptr + slot[:, None] * (KP + CB)
        bufp = bestp + KP
        bufr = buf_ptr + slot * (KP + CB) + KP  # the buffers again, one pointer per row
        cntp = cnt_ptr + slot  # each row's buffer count, claimed by atomics
        tl.store(bestp + tl.arange(0, KP)[None, :], tl.full((BM, KP), -9223372036854775807, tl.int64))
        tl.store(cntp, tl.zeros((BM,), tl.int32))
        thr_hi = tl.full((BM,), -2147483648, tl.int32)  # the empty top-k's threshold: every entry enters
        # this split's entries: a whole number of tiles
        share = tl.cdiv(tl.cdiv(n_max, NSPLIT), BN) * BN
        e0 = split * share
        e_end = tl.minimum(e0 + share, n_max)
        while e0 < e_end:
            tl.debug_barrier()  # the last run's atomics are done
            cnt = tl.load(cntp, volatile=True)  # from L2: the counts the atomics left
            room = (CB - tl.max(cnt, axis=0)) // BN  # tiles that cannot overflow any row's buffer
            if room == 0:
                thresh = _merge_scratch(bestp, bufp, cnt, KP, NSLICE, LOG_BM, LOG_KP, TL_SORT)
                thr_hi = (thresh >> 32).to(tl.int32)
                tl.store(cntp, tl.zeros((BM,), tl.int32))
                tl.debug_barrier()  # counters reset before the next run's atomics
                room = CB // BN
            e1 = tl.minimum(e0 + room * BN, e_end)
            if PIPELINE:  # a counted loop without barriers: Triton pipelines the key loads
                for e in range(e0, e1, BN):
                    _scan_tile_v3(
                        thr_hi, cntp, bufr, qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, bmax_ptr, s_cr, s_br,
                        n_bmax, rows, rmask, e, n_max, s_kb, s_ke, EPB, H, D, BM, BN, HAS_CAND, CAND_BLOCK, BMAX,
                        ROUND_BF16, DOT_F32, IN_BLOCK, BF16X2,
                    )  # fmt: skip
            else:  # the interpreter cannot take a tensor as a range bound
                e = e0
                while e < e1:
                    _scan_tile_v3(
                        thr_hi, cntp, bufr, qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, bmax_ptr, s_cr, s_br,
                        n_bmax, rows, rmask, e, n_max, s_kb, s_ke, EPB, H, D, BM, BN, HAS_CAND, CAND_BLOCK, BMAX,
                        ROUND_BF16, DOT_F32, IN_BLOCK, BF16X2,
                    )  # fmt: skip
                    e += BN
            e0 = e1
        tl.debug_barrier()
        _merge_scratch(bestp, bufp, tl.load(cntp, volatile=True), KP, NSLICE, LOG_BM, LOG_KP, TL_SORT)
        tl.debug_barrier()  # the last merge's stores
        j = tl.arange(0, KP)
        best = tl.load(bestp + j[None, :])
        tl.store(out_ptr + ((rows.to(tl.int64) * NSPLIT + split) * KP)[:, None] + j[None, :], best, mask=rmask[:, None])

    # ---- version 5: scores then select (two kernels) ----
    # The score pass is a streaming GEMM with its epilogue (relu, head weights, head sum) and nothing
    # else: no running top-k, no merges, no barriers, programs over (row tile, entry chunk) so every
    # SM has work. It writes one radix key per (row, entry) -- 2 bytes where the reference rounds the
    # score to bf16, 4 in fp32: 1/64 (1/32) of the per-head score tensor the unfused path writes.
    # The select pass finds each row's k-th best key by radix (a histogram per digit) and compacts
    # the winners in entry order: ascending output, ties at the threshold to the lowest entries.
    # The candidate source's block pool is the same select over its block maxima. Measured against
    # version 4 in docs/performance.md §12 ("Version 5").

    @triton.jit
    def _radix_key(s, KEY_BITS: tl.constexpr):
        """The score's bits mapped so unsigned order is float order (-0 = +0); the top 16 bits when
        the scores are bf16 values (their low 16 bits are zero, so nothing is lost)."""
        s = tl.where(s == 0.0, 0.0, s)
        b = s.to(tl.int32, bitcast=True)
        u = b ^ ((b >> 31) | -2147483648)  # negative: all bits flipped; positive: the sign bit set
        if KEY_BITS == 16:
            key = (u >> 16).to(tl.int16)
        else:
            key = u
        return key

    @triton.jit
    def _score_tile_v5(
        qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke, EPB, keyp,
        bmax_ptr, s_br, n_bmax, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        HAS_CAND: tl.constexpr, CAND_BLOCK: tl.constexpr, BMAX: tl.constexpr, ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr, IN_BLOCK: tl.constexpr, BF16X2: tl.constexpr, KEY_BITS: tl.constexpr,
    ):  # fmt: skip
        """One key tile: its radix keys where visible, and the candidate source's block maxima."""
        s, v = _score_keys_v3(
            qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke,
            EPB, H, D, BM, BN, HAS_CAND, CAND_BLOCK, ROUND_BF16, DOT_F32, IN_BLOCK, BF16X2,
        )  # fmt: skip
        if BMAX > 0:
            _store_block_max_t(s, v, bmax_ptr, rows, rmask, e0, s_br, n_bmax, BM, BN, BMAX)
        e = e0 + tl.arange(0, BN)
        tl.store(keyp + e[:, None], _radix_key(s, KEY_BITS), mask=v)

    @triton.jit(do_not_specialize=_VARYING)
    def _indexer_scores_kernel_v5(
        q_ptr, w_ptr, kpool_ptr, tables_ptr, row_seq_ptr, tile_row0_ptr, tile_rows_ptr, vis_ptr, cand_ptr,
        bmax_ptr, key_ptr, s_qr, s_qh, s_wr, s_kb, s_ke, s_ts, s_cr, s_br, n_bmax, s_kr, EPB,
        H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CHUNK: tl.constexpr,
        HAS_CAND: tl.constexpr, CAND_BLOCK: tl.constexpr, BMAX: tl.constexpr, ROUND_BF16: tl.constexpr,
        DOT_F32: tl.constexpr, IN_BLOCK: tl.constexpr, BF16X2: tl.constexpr, KEY_BITS: tl.constexpr,
        PIPELINE: tl.constexpr,
    ):  # fmt: skip
        """Program (row tile, chunk of CHUNK entries): the tile's radix keys [rows, entries] for
        visible entries, and the block maxima (candidate source) of its chunk."""
        row0, nrows, rows, rmask, vis, n_max = _row_tile(tile_row0_ptr, tile_rows_ptr, vis_ptr, tl.program_id(0), BM)
        e_lo = tl.program_id(1) * CHUNK
        e_hi = tl.minimum(e_lo + CHUNK, n_max)
        if e_lo < e_hi:
            seq = tl.load(row_seq_ptr + row0).to(tl.int64)
            table_ptr = tables_ptr + seq * s_ts
            qt, wt, koff = _query_tile(q_ptr, w_ptr, row0, nrows, s_qr, s_qh, s_wr, s_ke, H, D, BM, BN, BF16X2)
            keyp = key_ptr + rows.to(tl.int64)[None, :] * s_kr
            if PIPELINE:
                for e0 in range(e_lo, e_hi, BN):
                    _score_tile_v5(
                        qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke,
                        EPB, keyp, bmax_ptr, s_br, n_bmax, H, D, BM, BN, HAS_CAND, CAND_BLOCK, BMAX, ROUND_BF16,
                        DOT_F32, IN_BLOCK, BF16X2, KEY_BITS,
                    )  # fmt: skip
            else:  # the interpreter cannot take a tensor as a range bound
                e0 = e_lo
                while e0 < e_hi:
                    _score_tile_v5(
                        qt, wt, kpool_ptr, table_ptr, koff, vis, cand_ptr, s_cr, rows, rmask, e0, n_max, s_kb, s_ke,
                        EPB, keyp, bmax_ptr, s_br, n_bmax, H, D, BM, BN, HAS_CAND, CAND_BLOCK, BMAX, ROUND_BF16,
                        DOT_F32, IN_BLOCK, BF16X2, KEY_BITS,
                    )  # fmt: skip
                    e0 += BN

    @triton.jit
    def _load_radix_keys(ptr, e, n, KEY_BITS: tl.constexpr, FLOAT_KEYS: tl.constexpr, PIN: tl.constexpr):
        """Keys of entries e < n as unsigned ints: stored radix keys, or (``FLOAT_KEYS``) fp32 scores
        mapped here; ``PIN``: the last entry's key is the largest possible (always selected)."""
        m = e < n
        if FLOAT_KEYS:
            x = _radix_key(tl.load(ptr + e, mask=m, other=0.0), KEY_BITS)
        else:
            x = tl.load(ptr + e, mask=m, other=0)
        if KEY_BITS == 16:
            u = x.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            u = x.to(tl.uint32, bitcast=True)
        if PIN:
            u = tl.where(e == n - 1, tl.full(u.shape, (1 << KEY_BITS) - 1, tl.uint32), u)
        return u

    @triton.jit
    def _first_keys(rp, lane, n, KEY_BITS: tl.constexpr, FLOAT_KEYS: tl.constexpr, PIN: tl.constexpr,
                    PREFETCH: tl.constexpr):  # fmt: skip
        """What a pass's loop starts from: the first chunk's keys when prefetching, else nothing."""
        if PREFETCH:
            u = _load_radix_keys(rp, lane, n, KEY_BITS, FLOAT_KEYS, PIN)
        else:
            u = tl.zeros(lane.shape, tl.uint32)
        return u

    @triton.jit
    def _chunk_keys(
        rp, u, e, n, KEY_BITS: tl.constexpr, FLOAT_KEYS: tl.constexpr, PIN: tl.constexpr, PREFETCH: tl.constexpr,
        CHUNK: tl.constexpr,
    ):  # fmt: skip
        """(the keys of entries e, what the next chunk starts from): with ``PREFETCH`` the keys
        loaded a chunk early and the next chunk's load issued now, before this chunk's work."""
        if PREFETCH:
            keys = u
            u = _load_radix_keys(rp, e + CHUNK, n, KEY_BITS, FLOAT_KEYS, PIN)
        else:
            keys = _load_radix_keys(rp, e, n, KEY_BITS, FLOAT_KEYS, PIN)
        return keys, u

    @triton.jit
    def _digit_hist(u, e, n, thresh, p: tl.constexpr, KEY_BITS: tl.constexpr, DIGIT: tl.constexpr):
        """Histogram of digit p (from the top) over the keys u at entries e < n that match
        ``thresh`` in the digits above it."""
        shift: tl.constexpr = KEY_BITS - DIGIT * (p + 1)
        m = e < n
        if p > 0:
            m = m & ((u >> (shift + DIGIT)) == thresh)
        return tl.histogram(((u >> shift) & ((1 << DIGIT) - 1)).to(tl.int32), 1 << DIGIT, mask=m)

    @triton.jit
    def _take_chunk(u, e, op, n, thresh, need, taken, ties, MASK: tl.constexpr, KEY_BITS: tl.constexpr):
        """The winners among keys u at entries e (above the threshold, or equal to it while ties are
        needed): their entry ids at the next output slots, in entry order, or (``MASK``) a 1 at
        their own entries, for those scoring above -inf (``select_candidate_blocks``'s rule)."""
        m = e < n
        eq = (m & (u == thresh)).to(tl.int32)
        take = (m & (u > thresh)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) - eq < need))
        t32 = take.to(tl.int32)
        if MASK:
            ninf = _radix_key(tl.full((1,), float("-inf"), tl.float32), KEY_BITS)
            if KEY_BITS == 16:
                floor = ninf.to(tl.uint16, bitcast=True).to(tl.uint32)
            else:
                floor = ninf.to(tl.uint32, bitcast=True)
            tl.store(op + e, tl.full((1,), 1, tl.uint8), mask=take & (u > floor))
        else:
            tl.store(op + taken + tl.cumsum(t32, axis=0) - t32, e.to(tl.int64), mask=take)
        return taken + tl.sum(t32, axis=0), ties + tl.sum(eq, axis=0)

    @triton.jit(do_not_specialize=("K",))
    def _radix_select_kernel(
        key_ptr, vis_ptr, out_ptr, s_kr, s_or, K, KEY_BITS: tl.constexpr, DIGIT: tl.constexpr, CHUNK: tl.constexpr,
        KP: tl.constexpr, PREFETCH: tl.constexpr, FLOAT_KEYS: tl.constexpr = False, PIN: tl.constexpr = False,
        MASK: tl.constexpr = False,
    ):  # fmt: skip
        """Program per row: the k best of its n visible keys, written as entry ids ascending, -1
        after them. Radix select from the top digit: a histogram of the digits among the keys that
        share the threshold's digits found so far, then the digit where the count from the top
        reaches what is still needed. Then one pass in entry order takes every key above the
        threshold and the first ``need`` equal to it (the reference's lowest-index tie-break).
        Each pass is a chain of chunk loads that Triton does not pipeline (no dot consumes them),
        so ``PREFETCH`` issues the next chunk's load before this chunk's work. The candidate source's
        blocks take the same select (``FLOAT_KEYS``, ``PIN``, ``MASK``: ``_load_radix_keys``,
        ``_take_chunk``)."""
        row = tl.program_id(0)
        n = tl.load(vis_ptr + row)
        rp = key_ptr + row.to(tl.int64) * s_kr
        op = out_ptr + row.to(tl.int64) * s_or
        NBINS: tl.constexpr = 1 << DIGIT
        bins = tl.arange(0, NBINS)
        lane = tl.arange(0, CHUNK)
        thresh = (n * 0).to(tl.uint32)  # n <= K: every key is >= 0 and the first K of them are taken
        need = K + n * 0
        if n > K:
            for p in tl.static_range(KEY_BITS // DIGIT):
                hist = tl.zeros((NBINS,), tl.int32)
                u = _first_keys(rp, lane, n, KEY_BITS, FLOAT_KEYS, PIN, PREFETCH)
                c = n * 0
                while c < n:
                    e = c + lane
                    keys, u = _chunk_keys(rp, u, e, n, KEY_BITS, FLOAT_KEYS, PIN, PREFETCH, CHUNK)
                    hist += _digit_hist(keys, e, n, thresh, p, KEY_BITS, DIGIT)
                    c += CHUNK
                at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with digit >= b
                digit = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1
                need -= tl.sum(tl.where(bins == digit, at_least - hist, 0), axis=0)  # those above it
                thresh = (thresh << DIGIT) | digit.to(tl.uint32)
        taken = n * 0
        ties = n * 0
        u = _first_keys(rp, lane, n, KEY_BITS, FLOAT_KEYS, PIN, PREFETCH)
        c = n * 0
        while c < n:
            e = c + lane
            keys, u = _chunk_keys(rp, u, e, n, KEY_BITS, FLOAT_KEYS, PIN, PREFETCH, CHUNK)
            taken, ties = _take_chunk(keys, e, op, n, thresh, need, taken, ties, MASK, KEY_BITS)
            c += CHUNK
        if not MASK:
            j0 = taken * 0
            while j0 < K:  # -1 in the slots after the winners
                j = j0 + tl.arange(0, KP)
                tl.store(op + j, tl.full((KP,), -1, tl.int64), mask=(j >= taken) & (j < K))
                j0 += KP

    @triton.jit
    def _attend(
        q,
        kv,
        valid,
        m,
        lsum,
        acc,
        scale,
        ROUND_PROBS: tl.constexpr,
        DOT_F32: tl.constexpr,
        ACC_IN_DOT: tl.constexpr,
    ):
        """One online-softmax step over a key tile kv [BN, D] (K = V). ``ACC_IN_DOT`` (version 3):
        the rescaled accumulator is the value product's accumulator (wgmma adds into it) instead of
        a separate add of a fresh [BH, D] product."""
        if DOT_F32:
            logits = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(kv))
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logits - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if ROUND_PROBS and not DOT_F32:  # bf16 probabilities and values, fp32 accumulation
            if ACC_IN_DOT:
                return m_new, lsum, tl.dot(p.to(tl.bfloat16), kv, acc)
            return m_new, lsum, acc + tl.dot(p.to(tl.bfloat16), kv)
        if ROUND_PROBS:
            p = p.to(tl.bfloat16).to(tl.float32)
        if ACC_IN_DOT:
            return m_new, lsum, tl.dot(p, kv.to(tl.float32), acc, input_precision="ieee")
        return m_new, lsum, acc + tl.dot(p, kv.to(tl.float32), input_precision="ieee")

    @triton.jit
    def _window_tile(win_ptr, new_ptr, wi, s_wn, s_nn, d, kt: tl.constexpr, TWO_WIN: tl.constexpr):
        """The window slots ``wi`` [BN] at columns d: (keys [BN, len(d)] in ``kt``, visible [BN])."""
        if TWO_WIN:
            old = wi >= 0
            fresh = wi <= -2
            ko = tl.load(win_ptr + wi[:, None] * s_wn + d[None, :], mask=old[:, None], other=0.0)
            kn = tl.load(new_ptr + (-2 - wi)[:, None] * s_nn + d[None, :], mask=fresh[:, None], other=0.0)
            return tl.where(fresh[:, None], kn.to(kt), ko.to(kt)), old | fresh
        valid = wi >= 0
        return tl.load(win_ptr + wi[:, None] * s_wn + d[None, :], mask=valid[:, None], other=0.0), valid

    @triton.jit(do_not_specialize=("s_ts",))  # the table width follows the context (as _VARYING)
    def _sparse_attn_kernel(
        q_ptr,
        win_ptr,
        new_ptr,
        widx_ptr,
        sel_ptr,
        pool_ptr,
        tables_ptr,
        row_seq_ptr,
        sink_ptr,
        out_ptr,
        s_qr,
        s_qh,
        s_wn,
        s_nn,
        s_wir,
        s_sr,
        s_pb,
        s_pe,
        s_ts,
        s_or,
        s_oh,
        NH,
        EPB,
        scale,
        W: tl.constexpr,
        KSEL: tl.constexpr,
        D: tl.constexpr,
        BH: tl.constexpr,
        BN: tl.constexpr,
        ROUND_PROBS: tl.constexpr,
        DOT_F32: tl.constexpr,
        SEL_OFFSETS: tl.constexpr = False,
        TWO_WIN: tl.constexpr = False,
        ALIGN: tl.constexpr = 1,
        ACC_IN_DOT: tl.constexpr = False,
        WS: tl.constexpr = False,
    ):
        """``SEL_OFFSETS`` (version 2): sel holds each entry's element offset in the pool (the
        wrapper resolved the block table), so a key tile is one dependent load after its index
        load instead of two. ``ALIGN`` (version 3): those offsets are multiples of ALIGN elements
        (16 bytes), which the compiler cannot know of loaded values: without the hint the entry
        tiles load two bytes at a time and synchronously (sm_90 PTX: ``ld.global.b16``, no
        ``cp.async`` in the entry loop), with it as 16-byte ``cp.async`` pipelined like the window's.
        ``TWO_WIN``: window slots come from two tensors, the ring buffer
        (``win_ptr``, index >= 0) and this step's rows (``new_ptr``, index -2 - i), each loaded
        in its own dtype and cast to the pool's (fp32 with ``DOT_F32``), so neither is copied.
        ``WS``: Triton's automatic warp specialization of both key loops (an experiment: loads,
        products and softmax in separate warps; measured no faster)."""
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        hmask = h < NH
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * s_qr + h[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0)
        m = tl.full((BH,), -1e30, tl.float32)  # the reference clamps the max at -1e30
        lsum = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, D), tl.float32)
        n = tl.arange(0, BN)
        kt = tl.float32 if DOT_F32 else pool_ptr.dtype.element_ty
        for j0 in tl.range(0, W, BN, warp_specialize=WS):  # W, KSEL the model's: constant bounds, pipelined
            j = j0 + n
            wi = tl.load(widx_ptr + row * s_wir + j, mask=j < W, other=-1).to(tl.int64)
            kv, valid = _window_tile(win_ptr, new_ptr, wi, s_wn, s_nn, d, kt, TWO_WIN)
            m, lsum, acc = _attend(q, kv, valid, m, lsum, acc, scale, ROUND_PROBS, DOT_F32, ACC_IN_DOT)
        table_ptr = tables_ptr + tl.load(row_seq_ptr + row).to(tl.int64) * s_ts
        for j0 in tl.range(0, KSEL, BN, warp_specialize=WS):
            j = j0 + n
            e = tl.load(sel_ptr + row * s_sr + j, mask=j < KSEL, other=-1).to(tl.int64)
            valid = e >= 0
            if SEL_OFFSETS:
                off = e
                if ALIGN > 1:  # every offset is a multiple of ALIGN elements: 16-byte loads, pipelined
                    off = tl.multiple_of(tl.where(valid, off, 0), ALIGN)
            else:
                blk = tl.load(table_ptr + e // EPB, mask=valid, other=0).to(tl.int64)
                off = blk * s_pb + (e % EPB) * s_pe
            kv = tl.load(pool_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            m, lsum, acc = _attend(q, kv, valid, m, lsum, acc, scale, ROUND_PROBS, DOT_F32, ACC_IN_DOT)
        sink = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
        out = acc / (lsum + tl.exp(sink - m))[:, None]
        tl.store(
            out_ptr + row * s_or + h[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=hmask[:, None]
        )


INDEXER_VERSION = 5  # indexer_topk's default kernel: scores, then a radix select (1-4: the earlier ones)
# sparse_attention_paged's default: version 5 (attn_gluon) where it takes the operands (Hopper, bf16,
# rounded probabilities), else ATTENTION_FALLBACK (1, 2: the earlier tilings and loads)
ATTENTION_VERSION = 5
ATTENTION_FALLBACK = 3
NSLICE = 2  # indexer v2/v3: candidate buffer of NSLICE * k slots per row (runs of tiles between merges)
# indexer version 4: version 3's kernel with 64-entry key tiles and ptxas held to 128 registers a
# thread, so two 8-warp blocks share an SM (v3: ~240 registers, one block, latency exposed). Offline
# sm_90 (bench/attn_kernels_aot.py): 128 registers, a few spilled outside the hot loop, none inside
V4_BLOCK_N = 64
V4_MAXNREG = 128
V4_BLOCKS_PER_SM = 2  # what 128 registers x 256 threads allow (65536 a SM); shared memory fits three


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _default_rows_per_tile(version: int, cuda: bool, rows: int, n_seqs: int) -> int:
    """Rows of one sequence per program. Under the interpreter 16 (fewer programs run faster). On
    CUDA, version 1 takes 4; version 2 takes 8 where sequences average 8 rows or more (prefill
    chunks: twice the reuse of each key tile, same accumulator size as 4 x 128 entries) and 4
    otherwise (decode and verify rows: a tile never spans two requests, so 8 would idle half).
    Version 4 takes 4 everywhere: its 64 x 256 score tile at 8 rows does not fit 128 registers."""
    if not cuda:
        return 16
    if version in (1, 4):  # version 4: 8 rows under its 128-register cap spill inside the tile loop
        return 4
    return 8 if rows >= 8 * max(1, n_seqs) else 4


def _default_splits(cuda: bool, tiles: int, entries: int, kp: int, device: torch.device, blocks_per_sm: int = 1) -> int:
    """Programs per row tile in versions 3 and 4 (each over a share of the entries): enough to
    fill every resident block slot where the row tiles alone do not (decode of fewer sequences
    than slots), while each share keeps at least 8 * kp entries (below that a split's own top-k is
    most of what it reads). ``entries`` is a bound known without a sync. At one block per SM
    (version 3) a program per SM, rounded up; at two (version 4) rounded down, since a split that
    adds a partial wave costs more than the slots it fills (decode 256 x 4 rows: 256 tiles in 264
    slots stays one split, one wave)."""
    if not cuda or tiles <= 0:
        return 1
    slots = torch.cuda.get_device_properties(device).multi_processor_count * blocks_per_sm
    want = -(-slots // tiles) if blocks_per_sm == 1 else slots // tiles
    return max(1, min(want, entries // (8 * kp), 16))


def _row_seq(row_seq: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    if row_seq is None:
        return torch.zeros(rows, dtype=torch.int32, device=device)
    if row_seq.shape != (rows,):
        raise ValueError(f"row_seq of shape {tuple(row_seq.shape)} for {rows} rows")
    return row_seq.to(device=device, dtype=torch.int32).contiguous()


def row_tiles(row_seq: torch.Tensor, n_seqs: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of at most ``bm`` consecutive rows of one sequence: (first row [T], rows [T]), T an
    upper bound known without a device sync (spare tiles have 0 rows and do nothing)."""
    rows = row_seq.numel()
    dev = row_seq.device
    r = torch.arange(rows, device=dev)
    new = torch.ones(rows, dtype=torch.bool, device=dev)
    new[1:] = row_seq[1:] != row_seq[:-1]
    seg_start = torch.cummax(torch.where(new, r, 0), 0).values
    start = (r - seg_start) % bm == 0
    tile_id = torch.cumsum(start, 0) - 1
    n_tiles = max(1, min(rows, -(-rows // bm) + n_seqs))
    row0 = torch.zeros(n_tiles, dtype=torch.int64, device=dev)
    row0.scatter_reduce_(0, tile_id, r, "amin", include_self=False)
    count = torch.zeros(n_tiles, dtype=torch.int32, device=dev)
    count.scatter_add_(0, tile_id, torch.ones(rows, dtype=torch.int32, device=dev))
    return row0, count


V5_CHUNK = 2048  # entries per score program: few enough programs to reuse each query tile, enough to fill SMs
V5_WORKSPACE = 1 << 30  # bytes of radix keys at once; larger batches go in groups of rows
# the select pass's launch: bits a radix digit, keys a chunk, warps, the next chunk loaded early.
# The best of six on the H200 (bench/results/attn_kernels_v5c.json): 7-12 % less select time than
# 8-bit digits over 4096-key chunks at 8 warps in prefill, the same in decode
V5_SELECT = {"digit": 4, "chunk": 1024, "num_warps": 4, "prefetch": True}


def _select_v5(
    q: torch.Tensor,
    w: torch.Tensor,
    key_pool: torch.Tensor,
    tables: torch.Tensor,
    seqs: torch.Tensor,
    vis: torch.Tensor,
    cand: torch.Tensor,
    bmax: torch.Tensor,
    n_bmax: int,
    out: torch.Tensor,
    k: int,
    bm: int,
    bn: int,
    bound: int,
    *,
    has_cand: bool,
    candidate_block: int,
    block_max: int,
    dot_f32: bool,
    num_warps: int,
    select: dict[str, Any] | None,
) -> None:
    """Version 5 into ``out`` (and ``bmax``): the score pass writes radix keys [rows, bound] for a
    group of rows, the select pass reduces each row to its k entries. Groups of rows bound the
    workspace (a 16K-row prefill chunk at 64K entries would otherwise hold 2 GB of keys)."""
    rows = q.size(0)
    round_bf16 = q.dtype == torch.bfloat16
    key_bits = 16 if round_bf16 and not dot_f32 else 32
    key_dtype = torch.int16 if key_bits == 16 else torch.int32
    width = -(-max(1, bound) // 64) * 64  # aligned rows; one specialization of the row stride
    group = max(1, min(rows, V5_WORKSPACE // (width * key_dtype.itemsize)))
    keys = torch.empty(group, width, dtype=key_dtype, device=q.device)
    bf16x2 = q.is_cuda and q.dtype == w.dtype == key_pool.dtype == torch.bfloat16 and not dot_f32
    chunk = max(bn, V5_CHUNK) if q.is_cuda else max(bn, 64)
    sel = V5_SELECT | (select or {})
    kp = max(16, min(1024, _next_pow2(k)))
    # a row's keys end at its stride: entries past the caller's bound are not scored (never past
    # the row, whatever a wrong ``max_entries`` says)
    vis = vis.clamp(max=width)
    for r0 in range(0, rows, group):
        r1 = min(rows, r0 + group)
        row0, count = row_tiles(seqs[r0:r1], tables.size(0), bm)
        cand_g = cand[r0:r1] if has_cand else cand
        _indexer_scores_kernel_v5[(row0.numel(), -(-width // chunk))](
            q[r0:r1], w[r0:r1], key_pool, tables, seqs[r0:r1], row0, count, vis[r0:r1], cand_g,
            bmax[r0:r1] if block_max else bmax, keys, q.stride(0), q.stride(1), w.stride(0), key_pool.stride(0),
            key_pool.stride(1), tables.stride(0), cand.stride(0), bmax.stride(0) if block_max else 0, n_bmax,
            keys.stride(0), key_pool.size(1),
            H=q.size(1), D=q.size(2), BM=bm, BN=bn, CHUNK=chunk, HAS_CAND=has_cand, CAND_BLOCK=candidate_block,
            BMAX=block_max, ROUND_BF16=round_bf16, DOT_F32=dot_f32, IN_BLOCK=key_pool.size(1) % bn == 0,
            BF16X2=bf16x2, KEY_BITS=key_bits, PIPELINE=q.is_cuda, num_warps=num_warps,
        )  # fmt: skip
        _radix_select_kernel[(r1 - r0,)](
            keys, vis[r0:r1], out[r0:r1], keys.stride(0), out.stride(0), k,
            KEY_BITS=key_bits, DIGIT=sel["digit"], CHUNK=sel["chunk"] if q.is_cuda else 64, KP=kp,
            PREFETCH=sel["prefetch"], num_warps=sel["num_warps"] if q.is_cuda else 1,
        )  # fmt: skip


def indexer_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    key_pool: torch.Tensor,
    block_tables: torch.Tensor,
    n_visible: torch.Tensor,
    k: int,
    *,
    row_seq: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    candidate_block: int = 1,
    block_max: int = 0,
    max_entries: int | None = None,
    rows_per_tile: int | None = None,
    sort_impl: str = "bitonic",
    block_n: int | None = None,
    num_warps: int = 8,
    version: int | None = None,
    splits: int | None = None,
    maxnreg: int | None = None,
    select: dict[str, Any] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The k best index entries per row (module docstring has the contract). ``rows_per_tile``: rows
    of one sequence scored per program (a power of two; default 4 on CUDA, where the GEMM then
    has 4 * H rows, and 16 under the interpreter, where fewer programs run faster). ``sort_impl``:
    ``bitonic`` (this module's sort: a full sort of each merge tile, then one bitonic merge) or
    ``triton`` (``tl.sort`` twice; same result, kept as a fallback and for comparison).
    ``block_n``: entries scored per step (default 128, 64 for version 2 with 8 rows per tile).
    ``max_entries``: a bound on n_visible the caller knows (its sequences' entry counts), so the
    block maxima (and version 5's key rows, 64-aligned) are sized without a sync; version 5 scores
    no entry past that aligned bound. ``version``: the kernel (``INDEXER_VERSION`` by
    default; 1 = the first one, kept so benchmarks time both in one run). Version 2 computes the
    scores as keys x queries^T (the head sum stays within a warp), keeps the running top-k in
    scratch rather than registers and, on CUDA, takes 8 rows per tile where sequences have that
    many (prefill: each key tile read once per 8 rows instead of 4). Version 3
    is version 2 with a block-contiguous key tile, the append path behind a uniform branch, and
    each row tile's entries split over ``splits`` programs (default: enough for one program per
    SM on CUDA, 1 under the interpreter), their top-k keys merged here (exact: keys are unique).
    Version 4 is version 3's kernel sized for two blocks per SM: by default 4 rows and 64 entries
    a tile, ``maxnreg`` (ptxas's register cap per thread; CUDA only, the interpreter has none; 0
    for no cap) ``V4_MAXNREG``, and splits counted against two resident blocks per SM. Version 5
    scores in one kernel and selects in another (the v5 section's comment); ``select`` overrides
    ``V5_SELECT``'s launch of the select pass."""
    version = INDEXER_VERSION if version is None else version
    if version not in (1, 2, 3, 4, 5):
        raise ValueError(f"version must be 1 to 5, got {version!r}")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be positive, got {splits}")
    if splits is not None and version not in (3, 4):
        raise ValueError(f"splits is for versions 3 and 4, got version {version}")
    if maxnreg is not None and version not in (3, 4):
        raise ValueError(f"maxnreg is for versions 3 and 4, got version {version}")
    if select is not None and (version != 5 or set(select) - set(V5_SELECT)):
        raise ValueError(f"select is for version 5 and takes {sorted(V5_SELECT)}, got {select!r}")
    if select is not None:
        launch = V5_SELECT | select
        chunk, warps = launch["chunk"], launch["num_warps"]
        if launch["digit"] not in (2, 4, 8) or chunk < 16 or chunk & (chunk - 1) or warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"select needs digit 2, 4 or 8, a power-of-two chunk >= 16 and 1-16 warps (a power of two), "
                f"got {launch}"
            )
    if sort_impl not in ("bitonic", "triton"):
        raise ValueError(f"sort_impl must be 'bitonic' or 'triton', got {sort_impl!r}")
    rows, n_heads, hd = q.shape
    if w.shape != (rows, n_heads):
        raise ValueError(f"w of shape {tuple(w.shape)}, expected {(rows, n_heads)}")
    if key_pool.dim() != 3 or key_pool.size(-1) != hd:
        raise ValueError(f"key_pool of shape {tuple(key_pool.shape)}, expected [blocks, epb, {hd}]")
    if hd & (hd - 1) or n_heads & (n_heads - 1):
        raise ValueError("index heads and head dim must be powers of two")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if n_visible.shape != (rows,) or block_tables.dim() != 2:
        raise ValueError(
            f"n_visible {tuple(n_visible.shape)} / block_tables {tuple(block_tables.shape)}: "
            f"expected [{rows}] / [S, blocks]"
        )
    dev = q.device
    seqs = _row_seq(row_seq, rows, dev)
    tables = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    bm = rows_per_tile or _default_rows_per_tile(version, q.is_cuda, rows, tables.size(0))
    if bm & (bm - 1):
        raise ValueError(f"rows_per_tile must be a power of two, got {bm}")
    if block_n is None:
        # version 5: 128-entry tiles at 4 rows (decode: 7-20 % faster score passes than 64 on the
        # H200, attn_kernels_v5b..e), 64 at 8 rows (prefill: 128 was 1.2x slower)
        block_n = V4_BLOCK_N if version == 4 or (version >= 2 and bm >= 8) else 128
    if version == 4 and maxnreg is None:
        maxnreg = V4_MAXNREG
    kp = max(16, _next_pow2(k))
    bn = min(kp, block_n)
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if block_max and (block_max & (block_max - 1) or block_max > bn):
        raise ValueError(f"block_max must be a power of two <= {bn}, got {block_max}")
    if candidates is not None and (candidates.dim() != 2 or candidates.size(0) != rows):
        raise ValueError(f"candidates of shape {tuple(candidates.shape)}, expected [{rows}, blocks]")
    vis = n_visible.to(device=dev, dtype=torch.int32).contiguous()
    q = q.contiguous()
    w = w.contiguous()
    if key_pool.stride(-1) != 1:
        key_pool = key_pool.contiguous()
    dot_f32 = _dot_f32(q) or q.dtype != key_pool.dtype
    out = torch.empty(rows, k, dtype=torch.int64, device=dev)
    n_bmax = 0
    bmax = out
    if block_max:
        # sized from the caller's bound, else one sync (the candidate source runs once a step)
        n = max_entries if max_entries is not None else (int(vis.max()) if rows else 0)
        n_bmax = -(-n // block_max)
        # rows 16-aligned in storage: the select kernel reads them with a row stride that stays a
        # multiple of 16 whatever the context (Triton would compile anew when one turns 1 or 16k)
        bmax = torch.full((rows, -(-n_bmax // 16) * 16), float("-inf"), dtype=torch.float32, device=dev)[:, :n_bmax]
    cand = out
    if candidates is not None:
        cand = candidates.to(device=dev, dtype=torch.uint8).contiguous()
    if rows and version == 5:
        bound = max_entries if max_entries is not None else tables.size(1) * key_pool.size(1)
        _select_v5(
            q, w, key_pool, tables, seqs, vis, cand, bmax, n_bmax, out, k, bm, bn, bound,
            has_cand=candidates is not None, candidate_block=candidate_block, block_max=block_max,
            dot_f32=dot_f32, num_warps=num_warps, select=select,
        )  # fmt: skip
        return (out, bmax) if block_max else out
    if rows and version >= 3:
        row0, count = row_tiles(seqs, tables.size(0), bm)
        bound = max_entries if max_entries is not None else tables.size(1) * key_pool.size(1)
        per_sm = V4_BLOCKS_PER_SM if version == 4 else 1
        ns = splits or _default_splits(q.is_cuda, -(-rows // bm), bound, kp, dev, per_sm)
        # ptxas's register cap: a compile option (part of the kernel's cache key); the interpreter has none
        opts = {"maxnreg": maxnreg} if maxnreg and q.is_cuda else {}  # 0: no cap
        buf = torch.empty(row0.numel(), ns, bm, kp + NSLICE * kp, dtype=torch.int64, device=dev)
        keys = torch.empty(rows, ns, kp, dtype=torch.int64, device=dev)
        counts = torch.empty(row0.numel() * ns * bm, dtype=torch.int32, device=dev)
        _indexer_topk_kernel_v3[(row0.numel(), ns)](
            q, w, key_pool, tables, seqs, row0, count, vis, cand, bmax, buf, keys, counts,
            q.stride(0), q.stride(1), w.stride(0), key_pool.stride(0), key_pool.stride(1), tables.stride(0),
            cand.stride(0), bmax.stride(0) if block_max else 0, n_bmax, key_pool.size(1), k,
            H=n_heads, D=hd, BM=bm, BN=bn, KP=kp, LOG_BM=bm.bit_length() - 1, LOG_KP=kp.bit_length() - 1,
            HAS_CAND=candidates is not None, CAND_BLOCK=candidate_block, BMAX=block_max,
            ROUND_BF16=q.dtype == torch.bfloat16, DOT_F32=dot_f32, TL_SORT=sort_impl == "triton",
            PIPELINE=q.is_cuda, NSLICE=NSLICE, IN_BLOCK=key_pool.size(1) % bn == 0,
            BF16X2=q.is_cuda and q.dtype == w.dtype == key_pool.dtype == torch.bfloat16 and not dot_f32,
            num_warps=num_warps,
            **opts,
        )  # fmt: skip
        # the k best keys of the splits' (each sorted descending; keys are unique, ties cannot occur)
        best = keys[:, 0, :k] if ns == 1 else keys.view(rows, ns * kp).topk(k, dim=1, sorted=False).values
        out = torch.where(best > -9223372036854775807, 0x7FFFFFFF - (best & 0x7FFFFFFF), 0x7FFFFFFF)
    elif rows:
        row0, count = row_tiles(seqs, tables.size(0), bm)
        # candidate buffers (version 2: each after its tile's running top-k)
        slots = kp if version == 1 else kp + NSLICE * kp  # v2: the running top-k before the buffer
        buf = torch.empty(row0.numel(), bm, slots, dtype=torch.int64, device=dev)
        kernel = _indexer_topk_kernel if version == 1 else _indexer_topk_kernel_v2
        extra = {} if version == 1 else {"NSLICE": NSLICE}
        kernel[(row0.numel(),)](
            q, w, key_pool, tables, seqs, row0, count, vis, cand, bmax, buf, out,
            q.stride(0), q.stride(1), w.stride(0), key_pool.stride(0), key_pool.stride(1), tables.stride(0),
            cand.stride(0), bmax.stride(0) if block_max else 0, n_bmax, key_pool.size(1), k,
            H=n_heads, D=hd, BM=bm, BN=bn, KP=kp, LOG_BM=bm.bit_length() - 1, LOG_KP=kp.bit_length() - 1,
            HAS_CAND=candidates is not None, CAND_BLOCK=candidate_block, BMAX=block_max,
            ROUND_BF16=q.dtype == torch.bfloat16, DOT_F32=dot_f32, TL_SORT=sort_impl == "triton",
            PIPELINE=q.is_cuda,
            num_warps=num_warps,
            **extra,
        )  # fmt: skip
    out = out.sort(dim=1).values
    out.masked_fill_(out == 0x7FFFFFFF, -1)
    return (out, bmax) if block_max else out


def indexer_topk_candidates(
    q: torch.Tensor,
    w: torch.Tensor,
    key_pool: torch.Tensor,
    block_tables: torch.Tensor,
    n_visible: torch.Tensor,
    k: int,
    topk_blocks: int,
    block: int,
    *,
    row_seq: torch.Tensor | None = None,
    max_entries: int | None = None,
    rows_per_tile: int | None = None,
    sort_impl: str = "bitonic",
    block_n: int | None = None,
    version: int | None = None,
    splits: int | None = None,
    num_warps: int = 8,
    maxnreg: int | None = None,
    select: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate source's selection and its candidate pool as a block mask [rows, nb]: the
    ``topk_blocks`` blocks of ``block`` entries with the best entry, the newest visible block
    always kept (``select_candidate_blocks`` on the kernel's block maxima; version 5 runs that rule
    in its own select kernel instead of torch's top-k)."""
    from asympd.model.cuda_ops import fast_topk  # radix on CUDA, the stable sort elsewhere

    sel, bmax = indexer_topk(
        q,
        w,
        key_pool,
        block_tables,
        n_visible,
        k,
        row_seq=row_seq,
        block_max=block,
        max_entries=max_entries,
        rows_per_tile=rows_per_tile,
        sort_impl=sort_impl,
        block_n=block_n,
        version=version,
        splits=splits,
        num_warps=num_warps,
        maxnreg=maxnreg,
        select=select,
    )
    vis_blocks = (n_visible.to(bmax.device, torch.int64) + block - 1).div(block, rounding_mode="floor")
    if bmax.size(1) == 0:
        return sel, torch.zeros_like(bmax, dtype=torch.bool)
    if (INDEXER_VERSION if version is None else version) == 5:  # v5's select kernel picks the blocks too
        cand = torch.zeros(bmax.size(0), bmax.stride(0), dtype=torch.uint8, device=bmax.device)[:, : bmax.size(1)]
        sel_launch = V5_SELECT | (select or {})
        bf16 = q.dtype == torch.bfloat16 and not (_dot_f32(q) or q.dtype != key_pool.dtype)
        _radix_select_kernel[(bmax.size(0),)](
            bmax, vis_blocks.to(torch.int32), cand, bmax.stride(0), cand.stride(0), topk_blocks,
            KEY_BITS=16 if bf16 else 32, DIGIT=sel_launch["digit"], CHUNK=sel_launch["chunk"] if q.is_cuda else 64,
            KP=16, PREFETCH=sel_launch["prefetch"], FLOAT_KEYS=True, PIN=True, MASK=True,
            num_warps=sel_launch["num_warps"] if q.is_cuda else 1,
        )  # fmt: skip
        return sel, cand.view(torch.bool)
    return sel, select_candidate_blocks(bmax, vis_blocks, topk_blocks, 1, topk=fast_topk)


def sparse_attention_paged(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_idx: torch.Tensor,
    sel: torch.Tensor,
    ckv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    round_probs: bool,
    *,
    row_seq: torch.Tensor | None = None,
    window_new: torch.Tensor | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    version: int | None = None,
    warp_specialize: bool = False,
) -> torch.Tensor:
    """Sparse latent attention over window rows and selected pool entries (module docstring).
    ``version`` (``ATTENTION_VERSION`` by default): 1 = 16 heads x 32 keys per program, the
    table looked up in the kernel; 2 = every head of a row in one program (up to 64: each key tile
    read once per row, not once per 16 heads, and a wgmma-sized M) over 16-key tiles, entries
    resolved to pool offsets before the launch (one dependent load fewer per tile); 3 = version 2
    with the entry tiles loaded 16 bytes at a time and pipelined (the offsets declared 16-byte
    multiples, checked here on the pool's strides and address), the accumulator rescaled
    inside the value product, and 32-key tiles two stages deep; 5 = the Gluon kernel of
    ``attn_gluon`` (Hopper, bf16, rounded probabilities, 64-key tiles: 1.4-1.7x version 3, §12).
    Left at None, version 5 runs where it takes the operands and ``ATTENTION_FALLBACK`` elsewhere;
    asked for by number, a version that cannot take them raises. (Version 4, the head dim's output
    split over two programs a row, measured slower everywhere and was removed: §12.)
    ``window_new`` [n_new, d]: a second window source, the engine's own case (its window slots are
    either earlier rows in the slot's ring buffer, ``window_kv``, or rows of this step, not yet
    appended): then ``window_idx`` -2 - i names row i of ``window_new`` (>= 0 still a row of
    ``window_kv``, -1 not visible), and neither tensor is copied or converted (a ring buffer of
    every slot and layer may be large; the kernel casts what it loads)."""
    asked = version is not None
    version = ATTENTION_VERSION if version is None else version
    if version not in (1, 2, 3, 5):
        raise ValueError(f"version must be 1, 2, 3 or 5, got {version!r}")
    rows, n_heads, d = q.shape
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if window_kv.dim() != 2 or window_kv.size(-1) != d or ckv_pool.dim() != 3 or ckv_pool.size(-1) != d:
        raise ValueError(
            f"window_kv {tuple(window_kv.shape)} / ckv_pool {tuple(ckv_pool.shape)} do not match head_dim {d}"
        )
    if window_idx.dim() != 2 or window_idx.size(0) != rows or sel.dim() != 2 or sel.size(0) != rows:
        raise ValueError(f"window_idx {tuple(window_idx.shape)} / sel {tuple(sel.shape)} for {rows} rows")
    if window_idx.is_floating_point() or sel.is_floating_point() or block_tables.dim() != 2:
        raise ValueError("window_idx and sel must be integer tensors and block_tables [S, blocks]")
    dev = q.device
    out = torch.empty_like(q)
    if rows == 0:
        return out
    seqs = _row_seq(row_seq, rows, dev)
    tables = block_tables.to(device=dev, dtype=torch.int32).contiguous()
    q = q.contiguous()
    widx, sel = window_idx.contiguous(), sel.contiguous()
    if window_kv.stride(-1) != 1:
        window_kv = window_kv.contiguous()
    if ckv_pool.stride(-1) != 1:
        ckv_pool = ckv_pool.contiguous()
    kv_dtype = ckv_pool.dtype
    mixed = False
    if window_new is not None:
        if window_new.dim() != 2 or window_new.size(-1) != d:
            raise ValueError(f"window_new {tuple(window_new.shape)} does not match head_dim {d}")
        if window_new.stride(-1) != 1:
            window_new = window_new.contiguous()
        mixed = window_kv.dtype != kv_dtype or window_new.dtype != kv_dtype
    elif window_kv.dtype != kv_dtype:
        window_kv = window_kv.to(kv_dtype)
    dot_f32 = _dot_f32(q) or kv_dtype != torch.bfloat16 or q.dtype != kv_dtype or not round_probs or mixed
    if version == 5:
        from asympd.model import attn_gluon

        why = attn_gluon.unsupported(q, window_kv, window_new, ckv_pool, round_probs)
        if why is not None and asked:
            raise ValueError(f"attention version 5: {why}")
        version = 5 if why is None else ATTENTION_FALLBACK
    if block_h is None:
        block_h = 16 if version == 1 else max(16, min(64, _next_pow2(n_heads)))
    if block_n is None:  # version 3 at 32 keys a tile: 1.3-1.6x its 16 (attn_kernels_attn3.json)
        block_n = 32 if version != 2 or d < 256 else 16
    if num_stages is None and version == 3 and d >= 256:
        num_stages = 2  # two tiles of 32 x 512 in flight: three fit but measured no faster
    if version >= 2:
        sel = _pool_offsets(sel, tables, seqs, ckv_pool)
    align = _pool_alignment(ckv_pool) if version >= 3 else 1
    if version == 5:
        return attn_gluon.sparse_attention_gluon(
            q, window_kv, widx, sel, ckv_pool, sink.float().contiguous(), scale, window_new, align
        )
    grid = (rows, triton.cdiv(n_heads, block_h))
    new = window_kv if window_new is None else window_new
    _sparse_attn_kernel[grid](
        q, window_kv, new, widx, sel, ckv_pool, tables, seqs, sink.float().contiguous(), out,
        q.stride(0), q.stride(1), window_kv.stride(0), new.stride(0), widx.stride(0), sel.stride(0),
        ckv_pool.stride(0), ckv_pool.stride(1), tables.stride(0), out.stride(0), out.stride(1),
        n_heads, ckv_pool.size(1), float(scale), W=widx.size(1), KSEL=sel.size(1),
        D=d, BH=block_h, BN=block_n, ROUND_PROBS=bool(round_probs), DOT_F32=dot_f32,
        SEL_OFFSETS=version >= 2, TWO_WIN=window_new is not None, ALIGN=align, ACC_IN_DOT=version == 3,
        WS=warp_specialize,
        num_warps=num_warps or (4 if d <= 128 else 8), **({"num_stages": num_stages} if num_stages else {}),
    )  # fmt: skip
    return out


def _pool_alignment(pool: torch.Tensor) -> int:
    """The element multiple every row offset of ``pool`` is (16 bytes' worth), or 1 where its
    address or strides break that."""
    elems = 16 // pool.element_size()
    aligned = pool.data_ptr() % 16 == 0 and pool.stride(0) % elems == 0 and pool.stride(1) % elems == 0
    return elems if aligned and elems > 1 else 1


def _pool_offsets(sel: torch.Tensor, tables: torch.Tensor, seqs: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """Entry ids [rows, k] -> element offsets of their rows in ``pool`` (-1 stays -1). Block
    indices past a table's end are clamped (a wrong entry id reads a wrong row, never out of the
    table)."""
    e = sel.long()
    if tables.size(1) == 0:
        return torch.full_like(e, -1)
    blk_i = (e.clamp_min(0) // pool.size(1)).clamp_max(tables.size(1) - 1)
    blk = tables.long()[seqs.long()[:, None], blk_i]
    off = blk * pool.stride(0) + (e.clamp_min(0) % pool.size(1)) * pool.stride(1)
    return torch.where(e >= 0, off, -1).contiguous()


__all__ = ["AVAILABLE", "indexer_topk", "indexer_topk_candidates", "row_tiles", "sparse_attention_paged"]
