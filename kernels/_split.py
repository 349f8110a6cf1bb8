"""Split-prefix (flash-decoding style) scheduling for the paged prefix-attention kernel: how many programs share
one tile's keys, and the merge of their partial results.

A ranking computes few query rows (new history tokens and candidates) against a long cached prefix, so one program
per ``BLOCK_M``-row tile and head can leave most of a GPU idle: 384 rows x 4 heads at ``BLOCK_M = 64`` are 24
programs on 132 SMs, each streaming the whole prefix. With ``S`` splits, program ``s`` of a tile streams keys
``[s * L, (s + 1) * L)`` of the tile's keys in order, the cached prefix then the new history rows it sees, and
writes its un-normalised partial state; the split holding the tile's last key also takes the candidates' self term.
Every split so streams about ``L`` keys: the launch's longest program, which its time waits for, is as short as
the split count allows (a split taking all the new history on top of its share of the prefix would be longer by
all of it). The merge is exact up to fp32 rounding:

* hstu: the sum is pointwise, so ``out = sum_s acc_s`` (each split's partial already divided by ``N``: the merge
  is one reduction);
* softmax: ``M = max_s m_s``, ``w_s = 2 ** (m_s - M)``, ``out = sum_s w_s acc_s / sum_s w_s l_s`` (log2 domain, as
  the kernel keeps its running max).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _common as C
from ._prefix_config import SPLIT_ALIGN

__all__ = ["pick_splits", "split_layout", "merge_splits", "MIN_SPLIT_KEYS", "MAX_SPLITS"]

MIN_SPLIT_KEYS = 256   # keys per split at least: below it a split's fixed cost outweighs the parallelism
MAX_SPLITS = 32


def pick_splits(device: torch.device, num_work: int, max_keys: int, splits: Optional[int] = None, *,
                interpreted: bool = False) -> int:
    """Programs per (tile, head): ``splits`` when given (checked), else on CUDA enough to give every SM about two
    programs, with at least :data:`MIN_SPLIT_KEYS` keys each of the longest user's ``max_keys`` (cached prefix and
    new history), so a batch whose users have few keys is never split; 1 elsewhere (and in the interpreter)."""
    if splits is not None:
        if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits must be an integer in [1, {MAX_SPLITS}], got {splits!r}")
        return splits
    if device.type != "cuda" or interpreted or num_work <= 0:
        return 1
    cores = C.num_cores(device)
    if num_work >= cores:
        return 1
    return max(1, min(C.cdiv(2 * cores, num_work), max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


def split_layout(device: torch.device, num_work: int, max_keys: int, block_n: Optional[int] = None,
                 splits: Optional[int] = None, *, interpreted: bool = False) -> tuple[int, int]:
    """``(num_splits, split_len)`` of a launch of ``num_work`` (tile, head) pairs: :func:`pick_splits`'s count, and
    the keys per split, ``max_keys`` (the longest user's prefix + new history) over that count rounded up to a
    multiple of every key block (:data:`~relaygr_engine.kernels._prefix_config.SPLIT_ALIGN`, or a fixed
    ``block_n`` above it), so that only a user's last block is masked. A chosen count then drops the splits the
    rounding left without keys (programs that would stream none and only add zeros to the merge); a count given
    as ``splits`` is kept as given. Without a split, ``split_len`` covers every key."""
    num_splits = pick_splits(device, num_work, max_keys, splits, interpreted=interpreted)
    keys, align = max(max_keys, 1), max(SPLIT_ALIGN, block_n or 0)
    split_len = C.cdiv(C.cdiv(keys, num_splits), align) * align
    if splits is None:
        num_splits = C.cdiv(keys, split_len)
    return num_splits, split_len


def merge_splits(ws: torch.Tensor, ml: Optional[torch.Tensor]) -> torch.Tensor:
    """Merge the kernel's partial states.

    Parameters
    ----------
    ws : float32 Tensor [S, total_q, H, D]
        Each split's partial sum: hstu's divided by ``N``, softmax's un-normalised.
    ml : float32 Tensor [S, total_q, H, 2], or None
        softmax: each split's running max (log2 domain) and running sum; None in hstu mode.

    Returns
    -------
    float32 Tensor [total_q, H, D]
    """
    if ml is None:
        return ws.sum(0)
    m, l = ml[..., 0], ml[..., 1]
    w = torch.exp2(m - m.amax(0))                        # [S, total_q, H]
    den = (w * l).sum(0)
    num = (w.unsqueeze(-1) * ws).sum(0)
    return num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1)
