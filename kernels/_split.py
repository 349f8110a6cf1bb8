"""Split-prefix (flash-decoding style) scheduling for the paged prefix-attention kernel: how many programs share
one tile's cached prefix, and the merge of their partial results.

A ranking computes few query rows (new history tokens and candidates) against a long cached prefix, so one program
per ``BLOCK_M``-row tile and head can leave most of a GPU idle: 384 rows x 4 heads at ``BLOCK_M = 64`` are 24
programs on 132 SMs, each streaming the whole prefix. With ``S`` splits, program ``s`` of a tile streams the prefix
chunk ``[s * L, (s + 1) * L)`` and writes its un-normalised partial state; split 0 also takes the self term and the
new history rows. The merge is exact up to fp32 rounding:

* hstu: the sum is pointwise, so ``out = sum_s acc_s`` (each split's partial already divided by ``N``: the merge
  is one reduction);
* softmax: ``M = max_s m_s``, ``w_s = 2 ** (m_s - M)``, ``out = sum_s w_s acc_s / sum_s w_s l_s`` (log2 domain, as
  the kernel keeps its running max).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _common as C

__all__ = ["pick_splits", "merge_splits", "MIN_SPLIT_KEYS", "MAX_SPLITS"]

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
