"""The prefix-attention kernel's inner ``@triton.jit`` helpers (:mod:`relaygr_engine.kernels._prefix_kernel` holds
the kernel): a tile's bias for a key block (from the bias table or computed), the weights of one key block folded
into the running state (:func:`_attend`: HSTU's SiLU or the online softmax), and one block of cached keys read from
the pages (:func:`_page_block`) or of new rows from ``k``/``v`` (:func:`_load_rows`)."""
from __future__ import annotations

import triton
import triton.language as tl

from ._bias import _rel_bias


# ------------------------------------------------------------------------------------------------ biases
@triton.jit
def _silu_bias(bias, FAST_SILU: tl.constexpr):
    """A bias computed in the kernel, in the units :func:`_attend` takes: halved with ``FAST_SILU`` (the bias table
    is built halved, so its reads need nothing)."""
    if FAST_SILU:
        return bias * 0.5
    return bias


@triton.jit
def _row_bias(q_pos, k_pos, t_q, t_k, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr, num_pos, num_ts_bounds,
              HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr,
              TS_TABLE: tl.constexpr, TS_ABS: tl.constexpr, FAST_SILU: tl.constexpr):
    """A history tile's bias ``[BLOCK_M, BLOCK_N]`` for rows at ``q_pos``/``t_q`` ``[BLOCK_M, 1]`` and a key block
    at ``k_pos``/``t_k`` ``[BLOCK_N]``, in the units :func:`_attend` takes (:func:`_silu_bias`)."""
    return _silu_bias(_rel_bias(q_pos, k_pos[None, :], t_q, t_k[None, :], pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr,
                                num_pos, num_ts_bounds, HAS_POS, HAS_TS, TS_BITS, TS_STEPS, TS_TABLE, TS_ABS),
                      FAST_SILU)


@triton.jit
def _table_bias(tb_ptr, k_pos, offs_m, stride_tb, CAND_TILES: tl.constexpr):
    """A tile's bias for the keys in columns ``k_pos [BLOCK_N]`` of the bias table
    (:mod:`relaygr_engine.kernels._bias_table`: a cached key's column is its index, a new history key's is
    ``history_column(P) + i``): a candidate tile's ``[1, BLOCK_N]`` from its user's row ``tb_ptr``, a history
    tile's ``[BLOCK_M, BLOCK_N]`` from its rows ``tb_ptr + offs_m * stride_tb``. No mask: a row is ``BLOCK_N - 1``
    entries wider than any user's columns (:func:`~relaygr_engine.kernels._bias_table.table_width`), so a block's
    columns past the user's keys (hidden by the caller) read finite values of the same row."""
    if CAND_TILES:
        return tl.load(tb_ptr + k_pos[None, :])
    else:
        return tl.load(tb_ptr + offs_m[:, None] * stride_tb + k_pos[None, :])


# ------------------------------------------------------------------------------------------------ key blocks
@triton.jit
def _tanh_approx(x):
    """``tanh(x)`` in one special-function instruction (PTX ``tanh.approx.f32``, sm_75+; relative error about
    2^-11): CUDA only."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _attend(acc, m_i, l_i, s, v, bias, visible, scale, qk_scale, v_scale,
            HSTU: tl.constexpr, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
            V_SCALED: tl.constexpr, FAST_SILU: tl.constexpr):
    """One key block's scores ``s = q @ k.T`` ``[BLOCK_M, N]`` and values ``v [N, BLOCK_D]`` into the running state:
    ``acc [BLOCK_M, BLOCK_D]``, softmax's ``m_i``/``l_i [BLOCK_M]``; with ``V_SCALED`` value ``j`` is
    ``v_scale[j] * v[j]`` (8-bit pages: the scale rides on the weights). (The caller computes the bias after the
    score product, so that its loads and integer work overlap the tensor cores.)

    HSTU's ``SiLU(x) = x * sigmoid(x)`` takes, per score, an exp2 and a reciprocal (two special-function
    instructions, whose unit runs at 1/16 of the tensor cores' rate per element on sm_90, and a division's range
    checks); with ``FAST_SILU`` (CUDA, 16-bit inputs) it is ``h + h * tanh(h)`` with ``h = x / 2``: one
    approximate tanh and two FMAs (absolute error about ``|x| * 2^-12``, an eighth of the rounding of a 16-bit
    weight of that size). ``bias`` then comes halved (:func:`_silu_bias`)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    if HSTU:
        if FAST_SILU:
            if HAS_BIAS:
                h = s * (0.5 * scale) + bias
            else:
                h = s * (0.5 * scale)
            p = h + h * _tanh_approx(h)
        else:
            if HAS_BIAS:
                s = s * scale + bias
            else:
                s = s * scale
            p = tl.fdiv(s, 1.0 + tl.exp2(s * -LOG2E))  # SiLU: s * sigmoid(s), one approximate reciprocal
        if MASKED:
            p = tl.where(visible, p, 0.0)
        if V_SCALED:
            p = p * v_scale[None, :]
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        s = s * qk_scale
        if MASKED:
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_SCALED:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _page_ids(kv_indices_ptr, page_lo, start, hi, offs_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page of cached tokens ``start + offs_n`` (``start`` a multiple of ``BLOCK_N``): one scalar when
    ``BLOCK_N`` divides the page, else one per token; tokens ``>= hi`` (a block past the chunk) read page 0."""
    if PAGE_SIZE % BLOCK_N == 0:
        return tl.load(kv_indices_ptr + page_lo + start // PAGE_SIZE, mask=start < hi, other=0).to(tl.int64)
    else:
        kpos = start + offs_n
        return tl.load(kv_indices_ptr + page_lo + kpos // PAGE_SIZE, mask=kpos < hi, other=0).to(tl.int64)


@triton.jit
def _load_pages(kv_ptr, kv_desc, ts_cache_ptr, page, start, hi, offs_n, offs_d, offs_v, head, head_off,
                stride_page, stride_kv, stride_slot, stride_ts_page,
                PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                V_SPLITS: tl.constexpr, HAS_TS: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr):
    """K ``[BLOCK_N, BLOCK_D]``, V's value columns ``offs_v`` ``[BLOCK_N, BLOCK_D // V_SPLITS]`` and (``HAS_TS``)
    timestamps ``[BLOCK_N]`` of cached tokens ``start + offs_n`` in ``page`` (:func:`_page_ids`); with ``MASKED``
    those ``>= hi`` read as zeros. With ``TMA`` (a full block, within one page, all value columns) K and V are two
    tensor-descriptor loads: ``kv_desc`` sees the pages as rows ``[pages * 2 * PAGE_SIZE, H * D]`` (K of page ``p``
    from row ``2 p PAGE_SIZE``, its V ``PAGE_SIZE`` rows on)."""
    kpos = start + offs_n
    if PAGE_SIZE % BLOCK_N == 0:
        slot = start % PAGE_SIZE + offs_n
    else:
        slot = kpos % PAGE_SIZE
    row = head_off + page * stride_page + slot * stride_slot
    off = row[:, None] + offs_d[None, :]
    v_off = stride_kv + row[:, None] + offs_v[None, :]
    if TMA:
        tl.static_assert(PAGE_SIZE % BLOCK_N == 0 and BLOCK_D == HEAD_DIM and V_SPLITS == 1 and not MASKED)
        k_row = (page * (2 * PAGE_SIZE) + start % PAGE_SIZE).to(tl.int32)
        k = kv_desc.load([k_row, head * HEAD_DIM])
        v = kv_desc.load([k_row + PAGE_SIZE, head * HEAD_DIM])
    elif MASKED:
        k_ok = (kpos < hi)[:, None]
        k = tl.load(kv_ptr + off, mask=k_ok & (offs_d < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(kv_ptr + v_off, mask=k_ok & (offs_v < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(kv_ptr + off, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(kv_ptr + v_off, mask=(offs_v < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(kv_ptr + off)
        v = tl.load(kv_ptr + v_off)
    t_k = kpos  # stands in when HAS_TS is off (never read)
    if HAS_TS:
        if MASKED:
            t_k = tl.load(ts_cache_ptr + page * stride_ts_page + slot, mask=kpos < hi, other=0)
        else:
            t_k = tl.load(ts_cache_ptr + page * stride_ts_page + slot)
    return k, v, t_k


@triton.jit
def _page_scales(kvs_ptr, page, start, hi, offs_n, head, num_heads, stride_page, stride_kv, stride_slot,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """8-bit pages: the fp32 scales ``[BLOCK_N]`` of K and of V of cached tokens ``start + offs_n`` (the page's
    K section holds ``PAGE_SIZE`` value rows, then the scales slot-major ``[PAGE_SIZE, H]``; byte strides, all
    multiples of 4)."""
    if PAGE_SIZE % BLOCK_N == 0:
        slot = start % PAGE_SIZE + offs_n
    else:
        slot = (start + offs_n) % PAGE_SIZE
    at = ((page * stride_page + PAGE_SIZE * stride_slot) >> 2) + slot * num_heads + head
    if MASKED:
        ok = start + offs_n < hi
        return (tl.load(kvs_ptr + at, mask=ok, other=0.0),
                tl.load(kvs_ptr + (stride_kv >> 2) + at, mask=ok, other=0.0))
    return tl.load(kvs_ptr + at), tl.load(kvs_ptr + (stride_kv >> 2) + at)


@triton.jit
def _load_rows(k_ptr, v_ptr, ts_q_ptr, rows, ok, offs_d, offs_v, k_head, v_head, stride_kt, stride_vt,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TS: tl.constexpr, MASKED: tl.constexpr):
    """K ``[R, BLOCK_D]``, V's value columns ``offs_v`` ``[R, BLOCK_DV]`` and timestamps ``[R]`` of batch rows
    ``rows`` (int64; with ``MASKED``, rows not ``ok`` read as zeros)."""
    k_off = k_head + rows[:, None] * stride_kt + offs_d[None, :]
    v_off = v_head + rows[:, None] * stride_vt + offs_v[None, :]
    if MASKED or BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptr + k_off, mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_ptr + v_off, mask=ok[:, None] & (offs_v < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(k_ptr + k_off)
        v = tl.load(v_ptr + v_off)
    t_k = rows  # stands in when HAS_TS is off (never read)
    if HAS_TS:
        t_k = tl.load(ts_q_ptr + rows, mask=ok, other=0)
    return k, v, t_k


@triton.jit
def _page_block(acc, m_i, l_i, q, q_pos, t_q, page, start, hi, offs_m, offs_n, offs_d, offs_v, head, head_off,
                num_heads,
                kv_ptr, kv_desc, kvs_ptr, ts_cache_ptr, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr, tb_ptr, num_pos,
                num_ts_bounds, stride_page, stride_kv, stride_slot, stride_ts_page, stride_tb, scale, qk_scale,
                PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                V_SPLITS: tl.constexpr, CAND_TILES: tl.constexpr, HSTU: tl.constexpr, HAS_POS: tl.constexpr,
                HAS_TS: tl.constexpr,
                TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr, TS_TABLE: tl.constexpr, TS_ABS: tl.constexpr,
                TABLE: tl.constexpr, DOT_PRECISION: tl.constexpr, KV8: tl.constexpr, FAST_SILU: tl.constexpr,
                TMA: tl.constexpr, MASKED: tl.constexpr):
    """One block of cached keys ``start + offs_n`` (in ``page``) into the running state; with ``MASKED`` the keys
    ``>= hi`` are hidden (the user's last block). With ``TABLE`` the tile reads its bias from the bias table at
    ``tb_ptr`` (:func:`_table_bias`), so it needs no key timestamps."""
    BIAS: tl.constexpr = HAS_POS or HAS_TS
    KEY_TS: tl.constexpr = HAS_TS and not TABLE
    PAGE_TMA: tl.constexpr = TMA and not MASKED  # (a masked block reads through pointers)
    k, v, t_k = _load_pages(kv_ptr, kv_desc, ts_cache_ptr, page, start, hi, offs_n, offs_d, offs_v, head, head_off,
                            stride_page, stride_kv, stride_slot, stride_ts_page, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D,
                            V_SPLITS, KEY_TS, PAGE_TMA, MASKED)
    vs = 0.0
    if KV8:  # dequantised on load: the K scales ride on the scores, the V scales on the weights
        ks, vs = _page_scales(kvs_ptr, page, start, hi, offs_n, head, num_heads, stride_page, stride_kv, stride_slot,
                              PAGE_SIZE, BLOCK_N, MASKED)
        k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if KV8:
        s = s * ks[None, :]
    bias = 0.0
    if BIAS:
        if TABLE:
            bias = _table_bias(tb_ptr, start + offs_n, offs_m, stride_tb, CAND_TILES)
        else:
            bias = _row_bias(q_pos, start + offs_n, t_q, t_k, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr, num_pos,
                             num_ts_bounds, HAS_POS, HAS_TS, TS_BITS, TS_STEPS, TS_TABLE, TS_ABS, FAST_SILU)
    visible = (start + offs_n < hi)[None, :] if MASKED else 0
    return _attend(acc, m_i, l_i, s, v, bias, visible, scale, qk_scale, vs, HSTU, BIAS, MASKED, DOT_PRECISION, KV8,
                   FAST_SILU)
