"""Softmax's split merge as one kernel: each split's partial output read once, the merged output written once.

The split-prefix launches (and the sm_90 kernel beside the portable one) leave ``S`` partial outputs
``ws [S, total_q, H, D]``, each normalised by its own running sum, with each split's running max and sum
``ml [S, total_q, H, 2]``. A program here merges ``BLOCK_R`` of the ``total_q x H`` rows and ``BLOCK_D`` of their
value columns over all splits in fp32, weighing split ``s`` by ``2^(m_s - M) l_s`` (``M`` the rows' largest
``m_s``), and stores them in ``out``'s dtype and strides. In torch the same merge takes eight kernels and an fp32
temporary twice the partials' size (:func:`~relaygr_engine.kernels.reference.merge_splits_ref`). HSTU's merge
stays one ``torch.sum`` (:func:`~relaygr_engine.kernels._split.merge_splits`): a one-launch Triton merge of its
partials measured slower on an H100 at NVIDIA's ranking shape (16 us against 10, 96 programs each waiting on its
loads split after split), hence the grid here also over value columns.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_kernel", "BLOCK_R", "MAX_BLOCK_D", "NO_KEY_MAX"]

BLOCK_R = 16      # (row, head) pairs a program
MAX_BLOCK_D = 64  # value columns a program: more programs than rows alone give (a ranking has few rows)
# Softmax's running max before any key (log2 domain), in every kernel that keeps one: a split partial that saw no
# key is (NO_KEY_MAX, 0) and weighs nothing here, beside any split that saw one (2^(NO_KEY_MAX - M) is 0).
NO_KEY_MAX = tl.constexpr(-1.0e30)


@triton.jit(do_not_specialize=["num_rows", "num_splits"])  # (a new batch size compiles nothing)
def merge_kernel(
    ws_ptr,                                   # partials [S, total_q, H, D] (contiguous; fp32, fp16 or bf16)
    ml_ptr,                                   # running max (log2 domain) and sum [S, total_q, H, 2] fp32
    out_ptr,                                  # [total_q, H, D] at strides (stride_ot, stride_oh, 1)
    num_rows, num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (row, head) pairs
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    top = tl.full([BLOCK_R], NO_KEY_MAX, dtype=tl.float32)
    for split in range(num_splits):
        top = tl.maximum(top, tl.load(ml_ptr + (split * num_rows + rows).to(tl.int64) * 2, mask=row_ok,
                                      other=NO_KEY_MAX))
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    for split in range(num_splits):
        at = (split * num_rows + rows).to(tl.int64)  # (S x rows < 2**31: the launcher's bound)
        w = tl.exp2(tl.load(ml_ptr + at * 2, mask=row_ok, other=NO_KEY_MAX) - top) \
            * tl.load(ml_ptr + at * 2 + 1, mask=row_ok, other=0.0)
        den += w
        part = tl.load(ws_ptr + at[:, None] * HEAD_DIM + offs_d[None, :], mask=ok, other=0.0)
        acc += w[:, None] * part.to(tl.float32)
    acc = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    token = (rows // num_heads).to(tl.int64)
    dst = out_ptr + (token * stride_ot + (rows % num_heads) * stride_oh)[:, None] + offs_d[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok)
