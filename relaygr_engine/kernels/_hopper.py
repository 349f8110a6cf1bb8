"""Prefix attention on Hopper (sm_90), warp-specialised, in Gluon: a tile's rows against the full key blocks of its
user's cached prefix, HSTU or softmax.

Beside the portable kernel (:mod:`relaygr_engine.kernels._prefix_kernel`), which runs everywhere (the interpreter,
triton-ascend) and takes every other case, this kernel takes the bulk of a ranking's work on sm_90: the **full** key
blocks of the cached prefix, ``[0, P // BLOCK_N * BLOCK_N)``, which every row of a tile sees (candidates and new
history rows alike: the cached keys precede them all), so they need no mask. HSTU's bias comes from the bias
table: for a candidate tile one row (all of a user's candidates share a query position and time), one ``[BLOCK_N]``
load per key block; for a history tile one row per query row. Triton's portable kernel keeps both warp groups of a
tile in lock step (three CTA barriers per key block, the QK product waited on before SiLU); here each program is
one warp group of 64 rows and one loader warp:

- the **loader** (1 warp, few registers) streams a key block's K and V rows of one head through TMA (one copy each:
  a block lies in one page, NHD pages make its rows one strided box) into two rings of ``STAGES`` buffers, K's and
  V's, each buffer guarded by a pair of mbarriers (filled / free), reading the page table as it goes;
- the **compute** warp group multiplies ``q`` (shared memory) by the block's K (``wgmma``, asynchronous), turns the
  scores into weights, multiplies them by V into its fp32 accumulator, and frees each buffer once its product is
  done, without a CTA barrier: two or three programs on one SM (``maxnreg`` sized for it) interleave their
  tensor-core and special-function phases. HSTU: ``SiLU(h) = h + h tanh(h)`` with ``h = s * scale / 2 + bias / 2``
  (one ``tanh.approx``); softmax: FlashAttention's online softmax in the log2 domain (one ``ex2.approx`` a score;
  the accumulator rescaled in registers only when a row's running max grows by a factor of more than 2^8).

The rest of a tile's keys (the prefix's last partial block, the new history rows, a candidate's own key) is the
portable kernel's (``SKIP_FULL``): it writes them as one more split partial, slot ``S`` of the partials, while this
kernel's programs write slots ``0 .. S-1``, one split each; the two launches share nothing, and the split merge
(:mod:`relaygr_engine.kernels._split`) combines all ``S + 1`` as it combines any splits: HSTU's partial is
``acc / N`` (the sum is pointwise), softmax's ``acc / l`` with its running max and sum ``(m, l)``.

Gluon has no CPU interpreter: the kernel is compiled for sm_90 offline in the tests (registers, spills, shared
memory), and checked against the torch reference on a GPU only (``python_tests/test_hopper.py``).

Opt-in (:mod:`relaygr_engine.kernels._hopper_launch`): right on an H100 and an H200, faster than the portable
kernel on the long HSTU shapes (geomean 0.2988 vs 0.3483 ms, ``benchmarks/results/gpu-h200-2026-11-26b/``) but
not in a ranking (1.65 vs 1.30 ms, ``benchmarks/results/gpu-h100-2026-11-26/``). Its key loop runs one block after
the other: a loop overlapping block ``i``'s SiLU with block ``i + 1``'s QK product (FlashAttention-3's order) was
right but slower (a ranking layer 0.066 vs 0.058 ms, ``benchmarks/results/gpu-h200-2026-11-26/``; the long HSTU
shapes 0.3658 vs 0.2988 ms geomean, ``benchmarks/results/gpu-h200-2026-11-26b/``) and was removed.
"""
from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._merge_kernel import NO_KEY_MAX

# TMA's global-to-shared copy: ``async_load`` in Triton 3.7+, ``async_copy_global_to_shared`` before (3.6, the GPU
# machines' Triton; removed since)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

SUB_M = gl.constexpr(64)  # rows of a program: one warp group's wgmma height
# Softmax rescales its accumulator and sum only when some row's running max grows by more than this (log2 domain):
# until then the weights 2^(x - m) stay below 2^8 (bf16 keeps their relative precision; fp32 sums stay far from
# overflow), and a block skips the rescale's D / 2 multiplies a thread (a third of the loop's code at head dim 256).
# The stored (m, l) pair merges the same.
RESCALE_AT = gl.constexpr(8.0)
LOADER_REGS = gl.constexpr(24)  # registers per thread of the loader warp (the minimum: it holds a few scalars)


@gluon.jit
def _work(pid, tile_user_ptr, tile_row_ptr, cu_q_ptr, num_cand_ptr, kv_indptr_ptr, kv_last_ptr, num_heads,
          num_splits, split_len, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, M_PARTS: gl.constexpr,
          CAND_TILES: gl.constexpr):
    """What program ``pid`` computes: its split, head, first row of the bias table, first row (of the user's
    segment) and the end of its tile kind's rows, the user's first row of q and page-table entry, and its key
    blocks ``[lo, lo + n_blocks * BLOCK_N)`` (full blocks of the cached prefix, none for a padding tile). The
    loader and the compute partition both call it."""
    split = pid % num_splits
    rest = pid // num_splits
    head = rest % num_heads
    rest = rest // num_heads
    tile = rest // M_PARTS
    user = gl.load(tile_user_ptr + tile)
    row0 = gl.load(tile_row_ptr + tile) + (rest % M_PARTS) * SUB_M
    q_start = gl.load(cu_q_ptr + user)
    seqlen = gl.load(cu_q_ptr + user + 1) - q_start
    if CAND_TILES:  # candidates: rows up to the segment's end, one table row per user
        row_end = seqlen
        tb_row0 = user
    else:           # history tiles: the new history rows, a table row per tile row
        row_end = seqlen - gl.load(num_cand_ptr + user)
        tb_row0 = tile * (M_PARTS * SUB_M) + (rest % M_PARTS) * SUB_M
    page_lo = gl.load(kv_indptr_ptr + user)
    n_pages = gl.load(kv_indptr_ptr + user + 1) - page_lo
    last = gl.load(kv_last_ptr + user)
    prefix_len = gl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + last, 0)
    full = prefix_len // BLOCK_N * BLOCK_N
    lo = gl.multiple_of(split * split_len, 16)  # (split_len: a multiple of every key block, SPLIT_ALIGN)
    hi = gl.where(row0 < row_end, gl.minimum(lo + split_len, full), lo)
    n_blocks = gl.maximum(hi - lo, 0) // BLOCK_N
    return split, head, tb_row0, row0, row_end, q_start, page_lo, lo, n_blocks


@gluon.jit
def _load_blocks(kv_desc, kv_indices_ptr, k_bufs, v_bufs, bars, page_lo, lo, n_blocks, head,
                 PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: key block ``i``'s K rows of ``head`` into K's ring buffer ``i % STAGES`` once it is free,
    then its V rows into V's, each signalling its ``ready`` barrier when all its copies land: one box per page the
    block spans (a block of ``BLOCK_N`` keys lies in one page, or spans ``BLOCK_N / PAGE_SIZE`` whole pages).
    ``bars`` holds the rings' barriers (:func:`_bar`)."""
    PIECE: gl.constexpr = kv_desc.block_shape[0]  # rows a copy: min(BLOCK_N, PAGE_SIZE)
    for i in range(n_blocks):
        stage = i % STAGES
        for which in gl.static_range(2):  # K (0), then V (1)
            bufs = k_bufs if which == 0 else v_bufs
            mbarrier.wait(_bar(bars, FREE, which, stage, STAGES), ((i // STAGES) & 1) ^ 1)  # (new: freed once)
            bar = _bar(bars, READY, which, stage, STAGES)
            mbarrier.expect(bar, BLOCK_N * HEAD_DIM * kv_desc.dtype.primitive_bitwidth // 8)
            for j in gl.static_range(BLOCK_N // PIECE):
                start = lo + i * BLOCK_N + j * PIECE
                page = gl.load(kv_indices_ptr + page_lo + start // PAGE_SIZE)
                row = page * (2 * PAGE_SIZE) + start % PAGE_SIZE + which * PAGE_SIZE  # in [pages * 2 * P, H * D]
                _tma_load(kv_desc, [row, head * HEAD_DIM], bar, bufs.index(stage).slice(j * PIECE, PIECE))


READY = gl.constexpr(0)  # a buffer's copies have landed
FREE = gl.constexpr(1)   # a buffer's product is done: the loader may refill it


@gluon.jit
def _bar(bars, kind: gl.constexpr, which: gl.constexpr, stage, STAGES: gl.constexpr):
    """The mbarrier of ``kind`` (READY or FREE) of ring ``which`` (0: K, 1: V), buffer ``stage``: ``bars`` is
    ``[4 * STAGES, 1]``, ring-major."""
    return bars.index((kind * 2 + which) * STAGES + stage)


@gluon.jit
def _qk(q_smem, k_bufs, bars, s0, i, STAGES: gl.constexpr):
    """Issue block ``i``'s QK product (asynchronous) once its K has landed."""
    stage = i % STAGES
    mbarrier.wait(_bar(bars, READY, 0, stage, STAGES), (i // STAGES) & 1)
    return warpgroup_mma(q_smem, k_bufs.index(stage).permute((1, 0)), s0, use_acc=False, is_async=True)


@gluon.jit
def _pv(p, v_bufs, bars, acc0, acc1, i, STAGES: gl.constexpr, PART: gl.constexpr, O_PARTS: gl.constexpr):
    """Issue block ``i``'s P.V product into the accumulators (asynchronous, one group per accumulator) once its V
    has landed."""
    stage = i % STAGES
    mbarrier.wait(_bar(bars, READY, 1, stage, STAGES), (i // STAGES) & 1)
    v = v_bufs.index(stage)
    if O_PARTS == 1:
        acc0 = warpgroup_mma(p, v, acc0, is_async=True)
    else:
        acc0 = warpgroup_mma(p, v.slice(0, PART, dim=1), acc0, is_async=True)
        acc1 = warpgroup_mma(p, v.slice(PART, PART, dim=1), acc1, is_async=True)
    return acc0, acc1


@gluon.jit
def _bias(tb, at, ok, HAS_BIAS: gl.constexpr):
    """A block's halved biases from the bias table (a candidate tile's one row ``[BLOCK_N]``, a history tile's one a
    query row ``[64, BLOCK_N]``) at column ``at``, zeros unless ``ok``; 0 without biases."""
    if HAS_BIAS:
        return gl.load(tb + at, mask=ok, other=0.0)
    else:
        return 0.0


@gluon.jit
def _hstu_weights(s, bias, scale, HAS_BIAS: gl.constexpr, CAND_TILES: gl.constexpr):
    """HSTU's weights of a block's scores ``s``: ``SiLU(h) = h + h tanh(h)`` of ``h = s scale / 2 + bias / 2`` (the
    table's biases come halved: :func:`_bias`)."""
    h = s * (scale * 0.5)
    if HAS_BIAS:
        if CAND_TILES:
            h = h + gl.expand_dims(bias, 0)
        else:
            h = h + bias
    return h + h * _tanh(h)


@gluon.jit
def _tanh(x):
    """``tanh(x)`` in one special-function instruction (PTX ``tanh.approx.f32``)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _attend_blocks(q_smem, k_bufs, v_bufs, bars, tb_ptr, tb_row0, stride_tb, ws_ptr, ml_ptr, lo, n_blocks,
                   scale, inv_norm, split, head, num_heads, total_q, q_start, row0, row_end,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, HSTU: gl.constexpr,
                   HAS_BIAS: gl.constexpr, CAND_TILES: gl.constexpr, S_LAYOUT: gl.constexpr,
                   O_LAYOUT: gl.constexpr, O_PARTS: gl.constexpr):
    """The compute warp group: the key blocks' weighted values in fp32, stored as this split's partial ``[64, D]``
    of the head. HSTU: ``sum_j SiLU(q.k_j scale + bias_j) v_j``, ``SiLU`` as ``h + h tanh(h)`` of ``h`` halved
    (the table's biases come halved). Softmax: ``sum_j 2^(x_j - m) v_j`` with ``x_j = q.k_j scale log2(e)``, the
    running max ``m`` and sum ``l`` of each row (FlashAttention's online softmax; ``m`` moves, and the accumulator
    with it, only when a row's max has grown by more than ``RESCALE_AT``: one test for the warp group a block).
    (The store is here, inside the partition's raised register budget: the accumulator alone is 128 registers a
    thread at head dim 256.)"""
    PART: gl.constexpr = HEAD_DIM // O_PARTS  # value columns per accumulator (one wgmma's N: at most 128 here)
    LOG2E: gl.constexpr = 1.4426950408889634
    acc0 = gl.zeros([SUB_M, PART], gl.float32, O_LAYOUT)
    acc1 = gl.zeros([SUB_M, PART], gl.float32, O_LAYOUT)  # (O_PARTS == 2 only)
    s0 = gl.zeros([SUB_M, BLOCK_N], gl.float32, S_LAYOUT)
    row_layout: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    m_i = gl.full([SUB_M], NO_KEY_MAX, gl.float32, row_layout)  # softmax: running max of the log2-scaled scores
    l_i = gl.zeros([SUB_M], gl.float32, row_layout)          # softmax: running sum of 2^(x - m_i)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    # The bias table: a candidate tile's one row (its user's), a history tile's 64 rows (one per query row).
    if CAND_TILES:
        tb = tb_ptr + tb_row0.to(gl.int64) * stride_tb + offs_n                                    # [BN]
    else:
        tb_rows = tb_row0 + gl.arange(0, SUB_M, layout=row_layout)
        tb = tb_ptr + gl.expand_dims(tb_rows.to(gl.int64) * stride_tb, 1) + gl.expand_dims(offs_n, 0)  # [64, BN]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    # one block after the other: its QK product, its weights, its P.V product (softmax's rescale reads the
    # accumulator)
    for i in range(n_blocks):
        s = _qk(q_smem, k_bufs, bars, s0, i, STAGES)
        bias = _bias(tb, lo + i * BLOCK_N, True, HAS_BIAS)  # (loaded while the product runs)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(_bar(bars, FREE, 0, i % STAGES, STAGES), count=1)
        if HSTU:
            p = _hstu_weights(s, bias, scale, HAS_BIAS, CAND_TILES)
        else:
            x = s * (scale * LOG2E)
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
            if gl.max(m_new - m_i, axis=0) > RESCALE_AT:  # (else every row's weights stay below 2^RESCALE_AT)
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha
                m_i = m_new
                alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
                acc0 = acc0 * alpha_o
                if O_PARTS == 2:
                    acc1 = acc1 * alpha_o
            p = gl.exp2(x - gl.expand_dims(m_i, 1))
            l_i = l_i + gl.sum(p, axis=1)
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc0, acc1 = _pv(p, v_bufs, bars, acc0, acc1, i, STAGES, PART, O_PARTS)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        mbarrier.arrive(_bar(bars, FREE, 1, i % STAGES, STAGES), count=1)

    # The partial: HSTU's over N, softmax's over its running sum (the split merge weighs it by m_i and l_i).
    if HSTU:
        norm = gl.full([SUB_M], inv_norm, gl.float32, gl.SliceLayout(1, O_LAYOUT))
    else:
        norm = gl.convert_layout(1.0 / gl.where(l_i > 0.0, l_i, 1.0), gl.SliceLayout(1, O_LAYOUT))
    ws_rows = ((split * total_q + q_start + row0 + gl.arange(0, SUB_M, layout=row_layout)) * num_heads
               + head).to(gl.int64)
    _store_part(acc0, norm, ws_ptr, ws_rows, row0, row_end, 0, HEAD_DIM, O_LAYOUT)
    if O_PARTS == 2:
        _store_part(acc1, norm, ws_ptr, ws_rows, row0, row_end, PART, HEAD_DIM, O_LAYOUT)
    if not HSTU:
        ok = row0 + gl.arange(0, SUB_M, layout=row_layout) < row_end
        gl.store(ml_ptr + ws_rows * 2, m_i, mask=ok)
        gl.store(ml_ptr + ws_rows * 2 + 1, l_i, mask=ok)


@gluon.jit
def _store_part(acc, norm, ws_ptr, ws_rows, row0, row_end, col0, HEAD_DIM: gl.constexpr, O_LAYOUT: gl.constexpr):
    """Columns ``[col0, col0 + PART)`` of this split's partial ``[64, D]``: ``acc * norm`` (a factor per row) at
    rows ``ws_rows`` of the partials ``[S + 1, total_q, H, D]`` (flattened over their first three dims)."""
    om = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, O_LAYOUT))
    od = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, O_LAYOUT))
    rows = gl.convert_layout(ws_rows, gl.SliceLayout(1, O_LAYOUT))
    ptrs = ws_ptr + gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(od, 0)
    out = acc * gl.expand_dims(norm, 1)
    gl.store(ptrs, out.to(ws_ptr.dtype.element_ty), mask=gl.expand_dims(row0 + om < row_end, 1))


# Integer arguments that change from batch to batch, passed as plain values (as the portable kernel's BATCH_ARGS):
# a new ranking length compiles no new binary.
BATCH_ARGS = ["num_splits", "split_len", "total_q"]


@gluon.jit(do_not_specialize=BATCH_ARGS)
def hopper_kernel(
    q_ptr,                                            # queries [total_q, H, D] (strides stride_qt, stride_qh)
    ws_ptr, ml_ptr,                                   # split partials [S + 1, total_q, H, D], softmax's (m, l) [.., 2]
    kv_desc, kv_indices_ptr, kv_indptr_ptr, kv_last_ptr, cu_q_ptr, num_cand_ptr,
    tile_user_ptr, tile_row_ptr,                      # the tiles (int32 [n]) of one kind (CAND_TILES)
    tb_ptr,                                           # HAS_BIAS: the bias table's rows of that kind [.., stride_tb]
    num_heads, num_splits, split_len, total_q, stride_qt, stride_qh, stride_tb, scale, inv_norm,
    HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HSTU: gl.constexpr, HAS_BIAS: gl.constexpr, CAND_TILES: gl.constexpr,
    M_PARTS: gl.constexpr,                            # programs per tile: its rows in parts of 64
    Q_LAYOUT: gl.constexpr, Q_SMEM: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
    O_PARTS: gl.constexpr,                            # accumulators of D / O_PARTS value columns (2 above D = 128)
):
    pid = gl.program_id(0)
    split, head, tb_row0, row0, row_end, q_start, page_lo, lo, n_blocks = _work(
        pid, tile_user_ptr, tile_row_ptr, cu_q_ptr, num_cand_ptr, kv_indptr_ptr, kv_last_ptr, num_heads, num_splits,
        split_len, PAGE_SIZE, BLOCK_N, M_PARTS, CAND_TILES)

    # q's 64 rows of this head into shared memory (rows past the tile kind's are zeros; not stored)
    qm = gl.arange(0, SUB_M, layout=gl.SliceLayout(1, Q_LAYOUT))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, Q_LAYOUT))
    q_rows = (q_start + row0 + qm).to(gl.int64)
    q = gl.load(q_ptr + gl.expand_dims(q_rows * stride_qt + head * stride_qh, 1) + gl.expand_dims(qd, 0),
                mask=gl.expand_dims(row0 + qm < row_end, 1), other=0.0)
    q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [SUB_M, HEAD_DIM], Q_SMEM)
    q_smem.store(q)
    k_bufs = gl.allocate_shared_memory(kv_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_desc.layout)
    v_bufs = gl.allocate_shared_memory(kv_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [4 * STAGES, 1], mbarrier.MBarrierLayout())  # (_bar)
    for b in gl.static_range(4 * STAGES):
        mbarrier.init(bars.index(b), count=1)
    fence_async_shared()  # q's store and the barriers' init before the async proxy (wgmma, TMA) reads them

    gl.warp_specialize([
        (_attend_blocks, (q_smem, k_bufs, v_bufs, bars, tb_ptr, tb_row0, stride_tb, ws_ptr, ml_ptr, lo,
                          n_blocks, scale, inv_norm, split, head, num_heads, total_q, q_start, row0, row_end,
                          BLOCK_N, HEAD_DIM, STAGES, HSTU, HAS_BIAS, CAND_TILES, S_LAYOUT, O_LAYOUT, O_PARTS)),
        (_load_blocks, (kv_desc, kv_indices_ptr, k_bufs, v_bufs, bars, page_lo, lo, n_blocks, head,
                        PAGE_SIZE, BLOCK_N, HEAD_DIM, STAGES)),
    ], [1], [LOADER_REGS])
    for b in gl.static_range(4 * STAGES):
        mbarrier.invalidate(bars.index(b))


# ------------------------------------------------------------------------------------------------ configs
# Per head dim: (BLOCK_N, STAGES, MAXNREG). A program is 8 warps (the compute warp group and the loader's, of which
# one warp runs), so MAXNREG x 256 registers each; the loader drops to LOADER_REGS and the compute group takes the
# rest (up to 232 at 128). Sized for several programs per SM (registers and shared memory, sm_90: 64K registers,
# 227 KB): head dim 64 three (80 registers, 57 KB), 128 two (128, 82 KB), 256 two (128, 98 KB: 32-key blocks).
# Static figures (``python -m benchmarks.tools.ptxas --hopper``): no spill at these with Triton 3.6 or 3.9.
CONFIGS = {64: (64, 3, 80), 128: (64, 2, 128), 256: (32, 2, 128)}


@functools.lru_cache(maxsize=None)  # (built once per shape: a launch passes them every call)
def layouts(head_dim: int, block_n: int, dtype=gl.bfloat16) -> dict:
    """The kernel's layout constexprs for ``head_dim`` and ``block_n``: q's load (16-byte vectors along a row),
    its shared-memory tile (the wgmma operand's swizzle), and the wgmma accumulators of the scores ``[64, BN]`` and
    the output ``[64, D]`` (one warp group, instruction height 16)."""
    cols = min(32, head_dim // 8)
    return dict(Q_LAYOUT=gl.BlockedLayout([1, 8], [32 // cols, cols], [4, 1], [1, 0]),
                Q_SMEM=gl.NVMMASharedLayout.get_default_for([SUB_M, head_dim], dtype),
                S_LAYOUT=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16]),
                O_LAYOUT=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, min(head_dim, 128), 16]),
                O_PARTS=max(1, head_dim // 128))


@functools.lru_cache(maxsize=None)
def kv_layout(head_dim: int, block_n: int, dtype=gl.bfloat16):
    """The shared-memory layout of a key block's K or V ``[block_n, head_dim]`` (TMA's destination, wgmma's B)."""
    return gl.NVMMASharedLayout.get_default_for([block_n, head_dim], dtype)

