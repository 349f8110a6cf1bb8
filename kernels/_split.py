"""Split-prefix (flash-decoding style) scheduling for the paged prefix-attention kernel: how many programs share
one tile's cached prefix, and the merge of their partial results.

A ranking computes few query rows (new history tokens and candidates) against a long cached prefix, so one program
per ``BLOCK_M``-row tile and head can leave most of a GPU idle: 384 rows x 4 heads at ``BLOCK_M = 64`` are 24
programs on 132 SMs, each streaming the whole prefix. With ``S`` splits, program ``s`` of a tile streams the prefix
chunk ``[s * L, (s + 1) * L)`` and writes its un-normalised partial state; split 0 also takes the self term and the
new history rows. The merge is exact up to fp32 rounding:

* hstu: the sum is pointwise, so ``out = sum_s acc_s / N``;
* softmax: ``M = max_s m_s``, ``w_s = 2 ** (m_s - M)``, ``out = sum_s w_s acc_s / sum_s w_s l_s`` (log2 domain, as
  the kernel keeps its running max).

The merge is one launch (:func:`merge_splits`) that reads each partial once and writes the output in its dtype; its
torch reference is :func:`~relaygr_engine.kernels.reference.merge_splits_ref`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _common as C

__all__ = ["pick_splits", "merge_splits", "merge_splits_kernel", "MIN_SPLIT_KEYS", "MAX_SPLITS"]

MIN_SPLIT_KEYS = 256   # keys per split at least: below it a split's fixed cost outweighs the parallelism
MAX_SPLITS = 32


def pick_splits(device: torch.device, num_work: int, max_prefix_len: int, splits: Optional[int] = None, *,
                interpreted: bool = False) -> int:
    """Programs per (tile, head): ``splits`` when given (checked), else on CUDA enough to give every SM about two
    programs, with at least :data:`MIN_SPLIT_KEYS` cached keys each (so a batch with no or short cached prefixes,
    a prefill or a no-cache forward, is never split); 1 elsewhere (and in the interpreter)."""
    if splits is not None:
        if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits must be an integer in [1, {MAX_SPLITS}], got {splits!r}")
        return splits
    if device.type != "cuda" or interpreted or num_work <= 0:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    cores = C._num_cores("cuda", index)
    if num_work >= cores:
        return 1
    return max(1, min(C.cdiv(2 * cores, num_work), max_prefix_len // MIN_SPLIT_KEYS, MAX_SPLITS))


MERGE_BLOCK_R = 16   # (row, head) pairs per merge program


@triton.jit(do_not_specialize=["num_splits", "num_rows", "num_heads"])  # per batch: never a new binary
def merge_splits_kernel(ws_ptr, ml_ptr, out_ptr, num_splits, num_rows, num_heads, stride_ot, stride_oh, inv_norm,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                        SOFTMAX: tl.constexpr):
    """Merge ``BLOCK_R`` (row, head) pairs' partial states: ``ws`` [S, R, D] and (softmax) ``ml`` [S, R, 2], both
    fp32 contiguous with ``R = total_q * H``, into ``out`` (rows ``r // H``, heads ``r % H``, its own strides)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < num_rows
    ok = r_ok[:, None] & (d < HEAD_DIM)[None, :]
    part = r.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    step = num_rows.to(tl.int64) * HEAD_DIM                 # one split's partial sums
    num = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    if SOFTMAX:
        top = tl.full([BLOCK_R], -float("inf"), dtype=tl.float32)
        for s in range(num_splits):                         # the largest running max of the splits
            top = tl.maximum(top, tl.load(ml_ptr + (s * num_rows + r).to(tl.int64) * 2, mask=r_ok, other=0.0))
        den = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s in range(num_splits):
            at = (s * num_rows + r).to(tl.int64) * 2
            w = tl.exp2(tl.load(ml_ptr + at, mask=r_ok, other=0.0) - top)
            den += w * tl.load(ml_ptr + at + 1, mask=r_ok, other=0.0)
            num += w[:, None] * tl.load(ws_ptr + s * step + part, mask=ok, other=0.0)
        res = num / tl.where(den > 0, den, 1.0)[:, None]
    else:
        for s in range(num_splits):
            num += tl.load(ws_ptr + s * step + part, mask=ok, other=0.0)
        res = num * inv_norm
    o = (r // num_heads).to(tl.int64)[:, None] * stride_ot + (r % num_heads)[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o, res.to(out_ptr.dtype.element_ty), mask=ok)


def merge_splits(out: torch.Tensor, ws: torch.Tensor, ml: Optional[torch.Tensor], inv_norm: float) -> torch.Tensor:
    """Merge the prefix kernel's partial states into ``out`` (one launch).

    Parameters
    ----------
    out : Tensor [total_q, H, D]
        The attention output (any float dtype; its last dim contiguous).
    ws : float32 Tensor [S, total_q, H, D], contiguous
        Un-normalised partial sums of each split.
    ml : float32 Tensor [S, total_q, H, 2], contiguous, or None
        softmax: each split's running max (log2 domain) and running sum; None in hstu mode.
    inv_norm : float
        hstu: ``1 / N``.

    Returns
    -------
    ``out``
    """
    num_splits, total_q, num_heads, head_dim = ws.shape
    assert out.shape == (total_q, num_heads, head_dim) and out.stride(2) == 1 and ws.is_contiguous()
    assert ml is None or (ml.shape == (num_splits, total_q, num_heads, 2) and ml.is_contiguous())
    rows = total_q * num_heads
    if rows == 0:
        return out
    with C.device_guard(out.device):
        merge_splits_kernel[(C.cdiv(rows, MERGE_BLOCK_R),)](
            ws, ws if ml is None else ml, out, num_splits, rows, num_heads, out.stride(0), out.stride(1), inv_norm,
            HEAD_DIM=head_dim, BLOCK_D=max(16, C.next_pow2(head_dim)), BLOCK_R=MERGE_BLOCK_R, SOFTMAX=ml is not None)
    return out
