"""HSTU's relative bias once per layer into a table of rows of key biases, read by the prefix-attention kernel.

A row holds the bias of one query position and time against each key ``j`` of its user,
``pos_bias[min(q_pos - j, NP - 1)] + ts_bias[bucket(t_q - t_j)]``:

- **candidate rows**, one per user: all candidates of user ``b`` sit at position ``T_b = P_b + n_b`` (its cached
  prefix plus new history) and share the request time, so one row serves every candidate and every head;
- **history rows**, one per row of each history tile (``BLOCK_M`` per tile, the tile table's order): new history
  row ``i`` at position ``P_b + i`` and its own time. They are optional: the launcher builds them when they fit a
  size budget (:data:`HIST_BIAS_TABLE_BYTES`); without them history tiles compute their bias in the kernel.

The attention kernel (:mod:`relaygr_engine.kernels._prefix_kernel`) then reads a bias as one load per key block (a
``[BLOCK_N]`` vector for a candidate tile, a ``[BLOCK_M, BLOCK_N]`` tile of contiguous rows for a history tile),
with no key timestamps and no bucket arithmetic, instead of every (head, tile) program recomputing it. A row covers
a user's cached keys from column 0 and its new history keys from the next multiple of 16 (:func:`history_column`),
so both start 16-byte aligned, and a key block more than the longest user needs (:func:`table_width`), so readers
load without masks; other entries (and rows of padding tiles) are 0. Portable Triton (plain pointers and masks), as
the attention kernel.

The entries' position indices and time buckets depend on the batch only (its positions and times), the tables'
values on the layer: with a batch's plan the first layer's launch also stores the index (``INDEX = 1``: each entry
``(position index << BUCKET_BITS) | bucket``, -1 outside a user's keys) and the later layers' launches read it
(``INDEX = 2``): an index load and two gathers per entry, no page table, key timestamps or bucket arithmetic.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common as C
from ._bias import _gather_bias, _rel_index

__all__ = ["HIST_BIAS_TABLE_BYTES", "bias_table", "bias_table_kernel", "hist_rows_fit", "history_column",
           "history_rows", "rows_fit", "table_width"]

BLOCK = 256  # columns per program
# A row's width, and the column of a user's first new history key, are multiples of this many entries (64 bytes):
# rows load as 16-byte vectors, from the cached keys and from the new history keys.
ROW_ALIGN = tl.constexpr(16)


# History rows are built when they take at most this many bytes: 32 MiB, so the table stays in an H100/H200's 50 MB
# L2 cache beside the K/V stream while every head and split reads it (a relay ranking's few new history rows against
# a long prefix: e.g. 128 rows x 4096 keys = 2 MiB per user). Above it (full inference of long sequences: a table
# quadratic in the length) history tiles compute the bias in the kernel.
HIST_BIAS_TABLE_BYTES = 32 << 20


def history_rows(hist_tiles: Optional[torch.Tensor], block_m: int) -> int:
    """Table rows of the history tiles ``hist_tiles`` (int32 ``[2, n]``, None for none) of ``block_m`` rows."""
    return 0 if hist_tiles is None else hist_tiles.shape[1] * block_m


def hist_rows_fit(hist_tiles: torch.Tensor, block_m: int, max_key_len: int, block_n: int,
                  budget: Optional[int] = None) -> bool:
    """Whether the rows of the history tiles ``hist_tiles`` fit ``budget`` bytes (None:
    :data:`HIST_BIAS_TABLE_BYTES`)."""
    rows = history_rows(hist_tiles, block_m)
    return rows > 0 and rows_fit(rows, max_key_len, block_n, budget)


def rows_fit(rows: int, max_key_len: int, block_n: int, budget: Optional[int] = None) -> bool:
    """Whether ``rows`` rows of the table (fp32 entries, :func:`table_width` per row) take at most ``budget`` bytes
    (None: :data:`HIST_BIAS_TABLE_BYTES`)."""
    return rows * table_width(max_key_len, block_n) * 4 <= (HIST_BIAS_TABLE_BYTES if budget is None else budget)


def table_width(max_key_len: int, block_n: int) -> int:
    """Entries per row: ``max_key_len`` keys, up to ``ROW_ALIGN - 1`` columns between a user's cached and new keys,
    and ``block_n - 1`` more (a reader's last key block may run past its user's keys and needs no mask), rounded up
    to :data:`ROW_ALIGN`."""
    align = ROW_ALIGN.value
    return C.cdiv(max_key_len + align - 1 + block_n - 1, align) * align


@triton.jit
def history_column(prefix_len):
    """The column of a user's first new history key: its cached prefix length rounded up to :data:`ROW_ALIGN`
    (its cached keys are columns ``0 .. prefix_len``, those between are 0)."""
    return (prefix_len + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN


@triton.jit(do_not_specialize=["num_user_rows", "stride_row"])
def bias_table_kernel(
    out_ptr,                                          # [rows, stride_row] fp32
    idx_ptr,                                          # INDEX: [rows, stride_row] int32, packed entries or -1
    kv_indptr_ptr, kv_indices_ptr, kv_last_ptr, cu_q_ptr, num_cand_ptr,
    tile_user_ptr, tile_row_ptr,                      # the history tiles (int32 [n])
    pos_bias_ptr, ts_bias_ptr, ts_cache_ptr, ts_q_ptr, ts_bounds_ptr,
    num_user_rows, num_pos, num_ts_bounds, stride_ts_page, stride_row, scale,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TS: tl.constexpr, TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr, TS_TABLE: tl.constexpr,
    TS_ABS: tl.constexpr,
    INDEX: tl.constexpr,                              # 0: compute; 1: compute, also store the index; 2: read it
    BUCKET_BITS: tl.constexpr,                        # INDEX: an entry is (position index << BUCKET_BITS) | bucket
):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if INDEX == 2:  # the batch's index, built by an earlier layer: two gathers, no metadata, no key timestamps
        idx = tl.load(idx_ptr + r.to(tl.int64) * stride_row + cols, mask=cols < stride_row, other=-1)
        ok = idx >= 0
        bias = _gather_bias(tl.where(ok, idx >> BUCKET_BITS, 0), tl.where(ok, idx & ((1 << BUCKET_BITS) - 1), 0),
                            pos_bias_ptr, ts_bias_ptr, HAS_POS, HAS_TS)
    else:
        hist = r >= num_user_rows
        t = tl.maximum(r - num_user_rows, 0)               # history rows: row t % BLOCK_M of tile t // BLOCK_M
        user = tl.where(hist, tl.load(tile_user_ptr + t // BLOCK_M, mask=hist, other=0), r)
        q_start = tl.load(cu_q_ptr + user)
        seqlen = tl.load(cu_q_ptr + user + 1) - q_start
        n_hist = seqlen - tl.load(num_cand_ptr + user)
        seg_row = tl.where(hist, tl.load(tile_row_ptr + t // BLOCK_M, mask=hist, other=0) + t % BLOCK_M, n_hist)
        page_lo = tl.load(kv_indptr_ptr + user)
        n_pages = tl.load(kv_indptr_ptr + user + 1) - page_lo
        prefix_len = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + tl.load(kv_last_ptr + user), 0)
        live = seg_row < tl.where(hist, n_hist, seqlen)    # a candidate row needs a candidate; padding rows are 0
        q_pos = prefix_len + seg_row
        # Columns: the cached keys, 0-filled columns up to a multiple of 16, then the new history keys.
        hist_col = history_column(prefix_len)
        cached = cols < prefix_len
        keys = tl.where(cols < hist_col, cols, prefix_len + (cols - hist_col))
        ok = (cached | (cols >= hist_col)) & (keys < tl.where(live, prefix_len + n_hist, 0))
        t_q = 0
        t_k = keys
        if HAS_TS:
            t_q = tl.load(ts_q_ptr + q_start + seg_row, mask=live, other=0)
            page = tl.load(kv_indices_ptr + page_lo + keys // PAGE_SIZE, mask=ok & cached, other=0).to(tl.int64)
            t_cached = tl.load(ts_cache_ptr + page * stride_ts_page + keys % PAGE_SIZE, mask=ok & cached, other=0)
            t_new = tl.load(ts_q_ptr + q_start + (keys - prefix_len), mask=ok & (keys >= prefix_len), other=0)
            t_k = tl.where(cached, t_cached, t_new)
        p, b = _rel_index(q_pos, keys, t_q, t_k, ts_bounds_ptr, num_pos, num_ts_bounds, HAS_POS, HAS_TS, TS_BITS,
                          TS_STEPS, TS_TABLE, TS_ABS)
        bias = _gather_bias(p, b, pos_bias_ptr, ts_bias_ptr, HAS_POS, HAS_TS)
        if INDEX == 1:
            tl.store(idx_ptr + r.to(tl.int64) * stride_row + cols, tl.where(ok, (p << BUCKET_BITS) | b, -1),
                     mask=cols < stride_row)
    tl.store(out_ptr + r.to(tl.int64) * stride_row + cols, tl.where(ok, bias * scale, 0.0), mask=cols < stride_row)


def bias_table(user_rows: int, hist_tiles: Optional[torch.Tensor], block_m: int, max_key_len: int, block_n: int,
               tables: tuple, biases: tuple, ts: tuple, *, page_size: int, ts_bits: int, ts_steps: int,
               ts_table: bool, ts_abs: bool, device: torch.device, scale: float = 1.0,
               index: Optional[dict] = None, index_key: tuple = (),
               index_tensors: tuple = ()) -> Optional[torch.Tensor]:
    """One layer's bias table: ``user_rows`` candidate rows, then ``block_m`` history rows per history tile.

    Parameters
    ----------
    user_rows : int
        Candidate rows: the batch size ``B`` (row ``b`` is user ``b``'s), or 0 (no candidate tile).
    hist_tiles : int32 Tensor [2, n], optional
        The history tiles (a plan's ``hist_tiles``: user and first segment row of each) whose rows to add; None
        for none.
    block_m : int
        Rows per history tile.
    max_key_len : int
        A bound on any user's prefix + new history (a plan's ``max_key_len``).
    block_n : int
        The largest key block a reader may use (:func:`table_width`).
    tables : tuple of int32 Tensors
        ``(kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates)``.
    biases : (Tensor or None, Tensor or None)
        ``pos_bias``/``ts_bias``, contiguous, fp32/fp16/bf16 (read widened to fp32; None: that term is off).
    ts : (Tensor, Tensor, Tensor)
        ``ts_cache``, ``ts_q`` and the bucket steps (stand-ins where ``ts_bias`` is None or the term does not need
        them).
    scale : float
        Every entry is the bias times this (the attention kernel's fast SiLU takes half of it).
    index : dict, optional
        A batch's store for its bias index (a plan's ``bias_index``): each entry's position index and time bucket,
        which depend on the batch's positions and times, not on a layer's tables. The first call stores it there
        beside its table; a later call with the same ``index_key``, sizes and ``index_tensors`` (the same objects)
        builds its table from it: two gathers per entry instead of the page table, the key timestamps and the
        bucket. None: computed every call.
    index_key : tuple
        What else the index depends on (the time bucket function).
    index_tensors : tuple of Tensors
        The tensors the index was read from that the plan does not hold (the timestamps): matched by identity.

    Returns
    -------
    Tensor [user_rows + n * block_m, table_width(max_key_len, block_n)] fp32, or None when it would be empty
    """
    hist_rows = history_rows(hist_tiles, block_m)
    rows = user_rows + hist_rows
    if rows == 0 or max_key_len == 0:
        return None
    pos_bias, ts_bias = biases
    ts_cache, ts_q, ts_bounds = ts
    tiles = (hist_tiles[0], hist_tiles[1]) if hist_rows else (tables[3], tables[3])  # stand-ins: never read
    width = table_width(max_key_len, block_n)
    out = torch.empty((rows, width), dtype=torch.float32, device=device)
    num_pos = 1 if pos_bias is None else pos_bias.numel()
    bits = 1 if ts_bias is None else max(1, (ts_bias.numel() - 1).bit_length())
    mode, idx = 0, out  # (a stand-in: never read or written without INDEX)
    if index is not None and num_pos << bits <= 2 ** 31:  # an entry packs into a non-negative int32
        key = (index_key, rows, width, user_rows, block_m, page_size, num_pos, bits, pos_bias is None, ts_bias is None)
        got = index.get("entry")
        if got is not None and got[0] == key and all(r() is t for r, t in zip(got[1], index_tensors)):
            mode, idx = 2, got[2]
        else:
            mode, idx = 1, torch.empty((rows, width), dtype=torch.int32, device=device)
            index["entry"] = (key, [weakref.ref(t) for t in index_tensors], idx)
    grid = (rows, C.cdiv(width, BLOCK))
    with C.device_guard(device):  # an absent table's pointer is the other table (never read: its flag is off)
        bias_table_kernel[grid](out, idx, *tables, *tiles, ts_bias if pos_bias is None else pos_bias,
                                pos_bias if ts_bias is None else ts_bias, ts_cache, ts_q, ts_bounds, user_rows,
                                num_pos, ts_bounds.numel() if ts_table else 0,
                                ts_cache.stride(0) if ts_cache.dim() == 2 else 0, width, scale,
                                PAGE_SIZE=page_size, BLOCK=BLOCK, BLOCK_M=block_m, HAS_POS=pos_bias is not None,
                                HAS_TS=ts_bias is not None, TS_BITS=ts_bits, TS_STEPS=ts_steps, TS_TABLE=ts_table,
                                TS_ABS=ts_abs, INDEX=mode, BUCKET_BITS=bits if mode else 1)
    return out
