"""The HSTU relative bias every candidate of a user sees, once per layer: a ``[B, K]`` table of key vectors.

All candidates of user ``b`` sit at position ``T_b = P_b + n_b`` (its cached prefix plus new history) and share the
request time ``t_b``, so the bias a candidate adds to its score with key ``j < T_b``,
``pos_bias[min(T_b - j, NP - 1)] + ts_bias[bucket(t_b - t_j)]``, depends on the user and the key only. This kernel
computes it once per (user, key) and layer; the candidate tiles of the prefix-attention kernel
(:mod:`relaygr_engine.kernels._prefix_kernel`) read it as one ``[BLOCK_N]`` load per key block, instead of every
(head, candidate tile) program recomputing it from the keys' timestamps. History tiles (a bias per row and key)
still compute theirs. Portable Triton (plain pointers and masks), as the attention kernel.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common as C
from ._bias import _rel_bias

__all__ = ["candidate_bias", "cand_bias_kernel"]

BLOCK = 256  # keys per program


@triton.jit(do_not_specialize=["stride_row"])
def cand_bias_kernel(
    out_ptr,                                          # [B, stride_row] fp32: row b holds user b's keys 0 .. T_b - 1
    kv_indptr_ptr, kv_indices_ptr, kv_last_ptr, cu_q_ptr, num_cand_ptr,
    pos_bias_ptr, ts_bias_ptr, ts_cache_ptr, ts_q_ptr, ts_bounds_ptr,
    num_pos, num_ts_bounds, stride_ts_page, stride_row,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr,
    TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr, TS_TABLE: tl.constexpr, TS_ABS: tl.constexpr,
):
    user = tl.program_id(0)
    keys = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    q_start = tl.load(cu_q_ptr + user)
    seqlen = tl.load(cu_q_ptr + user + 1) - q_start
    n_cand = tl.load(num_cand_ptr + user)
    n_hist = seqlen - n_cand
    page_lo = tl.load(kv_indptr_ptr + user)
    n_pages = tl.load(kv_indptr_ptr + user + 1) - page_lo
    prefix_len = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + tl.load(kv_last_ptr + user), 0)
    q_pos = prefix_len + n_hist
    ok = keys < tl.where(n_cand > 0, q_pos, 0)          # users without candidates need no row
    cached = keys < prefix_len
    t_q = 0
    t_k = keys
    if HAS_TS:
        t_q = tl.load(ts_q_ptr + q_start + n_hist, mask=n_cand > 0, other=0)
        page = tl.load(kv_indices_ptr + page_lo + keys // PAGE_SIZE, mask=ok & cached, other=0).to(tl.int64)
        t_cached = tl.load(ts_cache_ptr + page * stride_ts_page + keys % PAGE_SIZE, mask=ok & cached, other=0)
        t_new = tl.load(ts_q_ptr + q_start + (keys - prefix_len), mask=ok & (keys >= prefix_len), other=0)
        t_k = tl.where(cached, t_cached, t_new)
    bias = _rel_bias(q_pos, keys, t_q, t_k, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr, num_pos, num_ts_bounds,
                     HAS_POS, HAS_TS, TS_BITS, TS_STEPS, TS_TABLE, TS_ABS)
    tl.store(out_ptr + user.to(tl.int64) * stride_row + keys, bias, mask=ok)


def candidate_bias(batch: int, max_key_len: int, tables: tuple, biases: tuple, ts: tuple, *, page_size: int,
                   ts_bits: int, ts_steps: int, ts_table: bool, ts_abs: bool, device: torch.device
                   ) -> Optional[torch.Tensor]:
    """The candidates' bias of every user and key for one layer (None when no user has keys).

    Parameters
    ----------
    batch, max_key_len : int
        Users, and a bound on any user's prefix + new history (a plan's ``max_key_len``).
    tables : tuple of int32 Tensors
        ``(kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates)``.
    biases : (Tensor or None, Tensor or None)
        ``pos_bias``/``ts_bias`` as fp32 (None: that term is off).
    ts : (Tensor, Tensor, Tensor)
        ``ts_cache``, ``ts_q`` and the bucket steps (stand-ins where ``ts_bias`` is None or the term does not need
        them).

    Returns
    -------
    Tensor [batch, max_key_len] fp32 or None
        Row ``b``: user ``b``'s keys ``0 .. T_b - 1`` (the rest is not written).
    """
    if batch == 0 or max_key_len == 0:
        return None
    pos_bias, ts_bias = biases
    ts_cache, ts_q, ts_bounds = ts
    out = torch.empty((batch, max_key_len), dtype=torch.float32, device=device)
    grid = (batch, C.cdiv(max_key_len, BLOCK))
    with C.device_guard(device):  # an absent table's pointer is the other table (never read: its flag is off)
        cand_bias_kernel[grid](out, *tables, ts_bias if pos_bias is None else pos_bias,
                               pos_bias if ts_bias is None else ts_bias, ts_cache, ts_q, ts_bounds,
                               1 if pos_bias is None else pos_bias.numel(), ts_bounds.numel() if ts_table else 0,
                               ts_cache.stride(0) if ts_cache.dim() == 2 else 0, max_key_len,
                               PAGE_SIZE=page_size, BLOCK=BLOCK, HAS_POS=pos_bias is not None,
                               HAS_TS=ts_bias is not None, TS_BITS=ts_bits, TS_STEPS=ts_steps, TS_TABLE=ts_table,
                               TS_ABS=ts_abs)
    return out
