"""The paged prefix-attention kernel (``@triton.jit`` code; its inner helpers are in
:mod:`relaygr_engine.kernels._prefix_blocks`, its configs in :mod:`relaygr_engine.kernels._prefix_config`, the launcher
in :mod:`relaygr_engine.kernels.prefix_attention`).

A launch serves one kind of tile of a varlen batch (``CAND_TILES``): a tile is ``BLOCK_M`` consecutive query rows of
one user and one head, all new history rows or all candidates, never both. A program takes one tile (or, with a
persistent grid, loops over tiles) and one chunk of its user's cached prefix (split-prefix scheduling; the whole
prefix without it), and streams keys in blocks of ``BLOCK_N``:

1. the cached prefix from the pages: a block's page id is read once (one scalar when ``BLOCK_N`` divides the page,
   else one per key), its K and V rows are one contiguous run of ``HEAD_DIM`` each (NHD pages); full blocks run
   without masks, only the user's last block is masked;
2. the user's new history K/V rows (from ``k``/``v``): every one for a candidate tile, causal for a history tile;
3. candidate tiles: the rows' own K/V, as a block whose only visible entries are the diagonal (a candidate sees
   itself, never another candidate).

With split-prefix scheduling (``SPLIT``) program ``s`` of a tile takes keys ``[s * split_len, (s + 1) * split_len)``
of its keys in that order, the cached prefix followed by the new history (so the work is even: no split also takes
all the new history), and the self term goes with the split holding the tile's last key.

Candidate tiles share everything but the key: every candidate of a user has position ``P + n`` and the request time,
so HSTU's relative bias ``pos_bias[min(P + n - j, NP - 1)] + ts_bias[bucket(t_c - t_j)]`` is one value per (user,
key), computed once per layer into a table (:mod:`relaygr_engine.kernels._bias_table`) that a candidate tile reads as
one ``[BLOCK_N]`` load per key block (no key timestamps). History tiles (few rows, causal) read their rows of the
same table (``HIST_TABLE``: one contiguous ``[BLOCK_M, BLOCK_N]`` load per key block) when the launcher built them,
else compute the bias per (row, key) (:mod:`relaygr_engine.kernels._bias`).

With ``V_SPLITS > 1``, ``V_SPLITS`` programs (grid axis 1) share a tile: each computes all its scores (from every
column of q and K) and ``BLOCK_D / V_SPLITS`` of its output columns (of V), so its accumulator takes that many times
fewer registers, which bound a tile at head dim 256, for scores computed ``V_SPLITS`` times. With ``M_SPLITS > 1``
the tile's rows are shared the same way (``BLOCK_M / M_SPLITS`` each, nothing computed twice): a 128-row tile as two
programs of one warp group each.

On sm_90 a tile's full cached key blocks may go to the warp-specialised kernel of
:mod:`relaygr_engine.kernels._hopper` instead (HSTU or softmax; each split's partial merges as any): this kernel then
runs with ``SKIP_FULL`` (one program per tile and head), from the user's last partial block of ``SKIP_FULL`` keys on:
that block, the new history rows the tile sees and a candidate's own key, as one more split partial of its own.

Modes: softmax (online softmax in fp32, ``exp2`` with the scale folded in) and hstu (``SiLU(alpha * q.k + rab) / N``,
pointwise: no running max). The portable path uses only pointer arithmetic with masks (no block pointers or tensor
descriptors), so the same source runs through triton-ascend and Triton's CPU interpreter. Beside it, on sm_90+,
``TMA`` reads a full key block's K and V with two tensor-descriptor loads (the Hopper copy engine: no per-thread
addresses); the autotuner picks per variant between the two (:mod:`relaygr_engine.kernels._prefix_config`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._bias import _rel_bias
from ._bias_table import history_column
from ._merge_kernel import NO_KEY_MAX
from ._prefix_blocks import _attend, _load_rows, _page_block, _page_ids, _row_bias, _silu_bias, _table_bias

# Integer arguments that change from batch to batch. Triton specialises an int argument on its value being 1 or a
# multiple of 16 by default, so each new combination would compile a new binary (about a second, paid by the
# ranking that meets it); these are passed as plain values.
# (``stride_tb``, the bias table's row stride, is specialised: always a multiple of 16 entries (or 0 without a
# table), it compiles one binary, which knows a history tile's rows of the table load as 16-byte vectors.)
BATCH_ARGS = ["num_work", "num_programs", "num_splits", "split_len", "total_q"]


# ------------------------------------------------------------------------------------------------ kernel
@triton.jit(do_not_specialize=BATCH_ARGS)
def prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,                     # [total_q, H, D]
    kv_ptr, kvs_ptr,                                  # [num_pages, 2, PAGE_SIZE (+ scale slots), H, D]; KV8: fp32
    kv_desc,                                          # TMA: a tensor descriptor of kv_ptr's rows (else None)
    kv_indptr_ptr, kv_indices_ptr, kv_last_ptr,       # paged layout (int32)
    cu_q_ptr, num_cand_ptr,                           # query layout (int32)
    tile_user_ptr, tile_row_ptr,                      # [num_tiles] (int32): user and first segment row of a tile
    pos_bias_ptr, ts_bias_ptr, ts_cache_ptr, ts_q_ptr, ts_bounds_ptr,
    bias_table_ptr,                                   # TABLE: [rows, stride_tb] fp32 (kernels._bias_table)
    ws_ptr, ml_ptr,                                   # SPLIT: partial outputs [S, total_q, H, D] (fp32, fp16 or
                                                      # bf16), softmax's running max and sum [S, total_q, H, 2] fp32
    num_heads, num_work, num_programs, num_splits, split_len, total_q,
    num_pos, num_ts_bounds, stride_ts_page, stride_tb,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_page, stride_kv, stride_slot, stride_head,
    scale, inv_norm,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAND_TILES: tl.constexpr,
    HSTU: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr,
    TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr, TS_TABLE: tl.constexpr, TS_ABS: tl.constexpr,
    HIST_TABLE: tl.constexpr, DOT_PRECISION: tl.constexpr, PERSISTENT: tl.constexpr, SPLIT: tl.constexpr,
    KV8: tl.constexpr, FAST_SILU: tl.constexpr, TMA: tl.constexpr,
    V_SPLITS: tl.constexpr,                           # programs sharing a tile's value columns (grid axis 1)
    M_SPLITS: tl.constexpr,                           # programs sharing a tile's rows (grid axis 1)
    TMA_READS: tl.constexpr, V_SPLITS_PICK: tl.constexpr,  # (read by the autotuner's pruning only: _prefix_config)
    SKIP_FULL: tl.constexpr = 0,                      # > 0: the cached keys below P // SKIP_FULL * SKIP_FULL
                                                      # are another kernel's (kernels._hopper)
):
    LOG2E: tl.constexpr = 1.4426950408889634
    BIAS: tl.constexpr = HAS_POS or HAS_TS
    TABLE: tl.constexpr = BIAS and (CAND_TILES or HIST_TABLE)  # the bias comes from the bias table
    BLOCK_DV: tl.constexpr = BLOCK_D // V_SPLITS          # value columns of this program
    SUB_M: tl.constexpr = BLOCK_M // M_SPLITS              # rows of this program
    tl.static_assert(not (TMA and KV8))  # 8-bit pages read through pointers
    pid = tl.program_id(0)
    v_part = 0                                              # which value columns of the tile (grid axis 1) ...
    if V_SPLITS > 1:
        v_part = tl.program_id(1) % V_SPLITS
    m_part = 0                                              # ... and which of its rows
    if M_SPLITS > 1:
        m_part = tl.program_id(1) // V_SPLITS
    offs_m = tl.arange(0, SUB_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)                          # q and k: every column (the scores need them all)
    d_ok = offs_d < HEAD_DIM
    if V_SPLITS == 1:  # (one program per tile: V's addresses are K's, shifted by stride_kv)
        offs_v = offs_d
    else:              # v, the output: this program's columns
        offs_v = v_part * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v_ok = offs_v < HEAD_DIM
    qk_scale = scale * LOG2E
    if PERSISTENT:
        work_end = num_work
        work_step = num_programs
    else:
        # One tile per program: a single-trip loop the compiler removes, so nothing is hoisted out of it and kept
        # live across the key loops.
        work_end = pid + 1
        work_step = 1

    for work in range(pid, work_end, work_step):
        split = work % num_splits                               # which share of the tile's keys (0 without SPLIT)
        tile = work // num_splits // num_heads
        head = work // num_splits % num_heads
        user = tl.load(tile_user_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile) + m_part * SUB_M  # this program's first row
        q_start = tl.load(cu_q_ptr + user)
        seqlen = tl.load(cu_q_ptr + user + 1) - q_start
        n_hist = seqlen - tl.load(num_cand_ptr + user)
        page_lo = tl.load(kv_indptr_ptr + user)
        n_pages = tl.load(kv_indptr_ptr + user + 1) - page_lo
        prefix_len = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + tl.load(kv_last_ptr + user), 0)

        rows = row0 + offs_m                                    # rows of the user's segment
        row_end = seqlen if CAND_TILES else n_hist
        live = row0 < row_end                                   # else a padding tile: no key is read
        row_ok = rows < row_end
        # The tile's rows of the bias table: its user's row (candidates), this program's rows of the tile's BLOCK_M
        # (history).
        tb_row = user if CAND_TILES else tile * BLOCK_M + m_part * SUB_M
        tb_ptr = bias_table_ptr + tb_row.to(tl.int64) * stride_tb
        if CAND_TILES:
            q_pos = prefix_len + n_hist                         # every candidate's position
        else:
            q_pos = (prefix_len + rows)[:, None]
        t_q = 0                                                 # (a tile with TABLE needs no query time)
        if HAS_TS and not TABLE:
            t_q = tl.load(ts_q_ptr + q_start + rows, mask=row_ok, other=0)[:, None]
        g_rows = (q_start + rows).to(tl.int64)                  # rows of q/k/v/out
        q = tl.load(q_ptr + g_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.zeros([SUB_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([SUB_M], NO_KEY_MAX, dtype=tl.float32)   # softmax: running max of log2-scaled logits
        l_i = tl.zeros([SUB_M], dtype=tl.float32)             # softmax: running sum of exp2(logit - m_i)

        # This split's keys [lo, lo + split_len) of the tile's: the cached prefix, then the new history rows it sees.
        lo = tl.multiple_of(split * split_len, 16)  # split_len is a multiple of every BLOCK_N (SPLIT_ALIGN)
        first = 0  # the first of the tile's keys this launch takes
        if SKIP_FULL:  # (one program per tile: from the user's last partial block of SKIP_FULL keys on)
            first = prefix_len // SKIP_FULL * SKIP_FULL
            lo = tl.multiple_of(first, 16)
        # 1. Its part [lo, hi) of the cached prefix: full blocks unmasked, then the user's last block.
        hi = tl.where(live, tl.minimum(lo + split_len, prefix_len), lo)
        full_hi = tl.maximum(lo, lo + (hi - lo) // BLOCK_N * BLOCK_N)
        # The page ids run one block ahead (loop-carried), so their load's latency hides behind a block's work.
        head_off = head * stride_head
        page = _page_ids(kv_indices_ptr, page_lo, lo, hi, offs_n, PAGE_SIZE, BLOCK_N)
        for start in range(lo, full_hi, BLOCK_N):
            page_next = _page_ids(kv_indices_ptr, page_lo, start + BLOCK_N, hi, offs_n, PAGE_SIZE, BLOCK_N)
            acc, m_i, l_i = _page_block(
                acc, m_i, l_i, q, q_pos, t_q, page, start, hi, offs_m, offs_n, offs_d, offs_v, head, head_off,
                num_heads, kv_ptr, kv_desc, kvs_ptr, ts_cache_ptr, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr, tb_ptr,
                num_pos, num_ts_bounds, stride_page, stride_kv, stride_slot, stride_ts_page, stride_tb, scale, qk_scale,
                PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, V_SPLITS, CAND_TILES, HSTU, HAS_POS, HAS_TS, TS_BITS, TS_STEPS,
                TS_TABLE, TS_ABS, TABLE, DOT_PRECISION, KV8, FAST_SILU, TMA, False)
            page = page_next
        if full_hi < hi:  # the user's last, partial block (its page id came with the loop)
            acc, m_i, l_i = _page_block(
                acc, m_i, l_i, q, q_pos, t_q, page, full_hi, hi, offs_m, offs_n, offs_d, offs_v, head, head_off,
                num_heads, kv_ptr, kv_desc, kvs_ptr, ts_cache_ptr, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr, tb_ptr,
                num_pos, num_ts_bounds, stride_page, stride_kv, stride_slot, stride_ts_page, stride_tb, scale, qk_scale,
                PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, V_SPLITS, CAND_TILES, HSTU, HAS_POS, HAS_TS, TS_BITS, TS_STEPS,
                TS_TABLE, TS_ABS, TABLE, DOT_PRECISION, KV8, FAST_SILU, TMA, True)

        # 2. Its part [n_lo, n_hi) of the new history rows the tile sees: all of them for candidates, up to its last
        # row for a history tile (causal). (New history is short next to the prefix: every block is masked.)
        # (Computed here, not before the prefix loop, and without SPLIT the whole range: nothing more is live across
        # the loops, whose registers run out at head dim 256.)
        n_end = n_hist if CAND_TILES else tl.minimum(row0 + SUB_M, n_hist)
        n_end = tl.where(live, n_end, 0)
        n_lo = 0
        n_hi = n_end
        if SPLIT:
            n_lo = tl.maximum(lo - prefix_len, 0)
            n_hi = tl.minimum(lo + split_len - prefix_len, n_end)
        k_head = head * stride_kh
        v_head = head * stride_vh
        for start in range(n_lo, n_hi, BLOCK_N):
            idx = start + offs_n
            k_ok = idx < n_hi
            k, v, t_k = _load_rows(k_ptr, v_ptr, ts_q_ptr, (q_start + idx).to(tl.int64), k_ok, offs_d, offs_v,
                                   k_head, v_head, stride_kt, stride_vt, HEAD_DIM, BLOCK_D,
                                   HAS_TS and not TABLE, True)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            bias = 0.0
            if TABLE:
                bias = _table_bias(tb_ptr, history_column(prefix_len) + idx, offs_m, stride_tb, CAND_TILES)
            elif BIAS:
                bias = _row_bias(q_pos, prefix_len + idx, t_q, t_k, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr,
                                 num_pos, num_ts_bounds, HAS_POS, HAS_TS, TS_BITS, TS_STEPS, TS_TABLE, TS_ABS,
                                 FAST_SILU)
            if CAND_TILES:
                visible = k_ok[None, :]
            else:
                visible = k_ok[None, :] & (idx[None, :] <= rows[:, None])
            acc, m_i, l_i = _attend(acc, m_i, l_i, s, v, bias, visible, scale, qk_scale, 0.0, HSTU, BIAS, True,
                                    DOT_PRECISION, False, FAST_SILU)

        # 3. Candidates see themselves: their own rows as a key block whose diagonal only is visible (in the split
        # holding the tile's last key, the shortest when the keys do not divide evenly; with no key of its own to
        # take, e.g. SKIP_FULL's where the prefix is whole blocks and there is no new history, the first split).
        if CAND_TILES:
            here = live
            if SPLIT:
                last = tl.maximum(prefix_len + n_end - 1, first)  # (the splits cover every key: one of them holds it)
                here = live & (lo <= last) & (last < lo + split_len)
            if here:
                k, v, t_k = _load_rows(k_ptr, v_ptr, ts_q_ptr, g_rows, row_ok, offs_d, offs_v, k_head, v_head,
                                       stride_kt, stride_vt, HEAD_DIM, BLOCK_D, False, True)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                bias = 0.0
                if BIAS:  # distance 0, time difference 0: one scalar
                    t_0 = q_start.to(tl.int64) * 0
                    bias = _silu_bias(_rel_bias(q_pos, q_pos, t_0, t_0, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr,
                                                num_pos, num_ts_bounds, HAS_POS, HAS_TS, TS_BITS, TS_STEPS,
                                                TS_TABLE, TS_ABS), FAST_SILU)
                visible = (offs_m[:, None] == offs_m[None, :]) & row_ok[None, :]
                acc, m_i, l_i = _attend(acc, m_i, l_i, s, v, bias, visible, scale, qk_scale, 0.0, HSTU, BIAS,
                                        True, DOT_PRECISION, False, FAST_SILU)

        # The tile's output, or a split's partial (merge_splits adds hstu's up and weighs softmax's by their running
        # max and sum): hstu's over N, softmax's over its running sum (so that a 16-bit partial cannot overflow).
        if HSTU:
            out = acc * inv_norm
        else:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if SPLIT:
            ws_rows = ((split * total_q + q_start + rows) * num_heads + head).to(tl.int64)  # (< 2**31: launcher)
            tl.store(ws_ptr + ws_rows[:, None] * HEAD_DIM + offs_v[None, :], out.to(ws_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & v_ok[None, :])
            if not HSTU:
                if v_part == 0:  # (every value split holds the same m_i and l_i: the first stores them)
                    tl.store(ml_ptr + ws_rows * 2, m_i, mask=row_ok)
                    tl.store(ml_ptr + ws_rows * 2 + 1, l_i, mask=row_ok)
        else:
            tl.store(out_ptr + g_rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
