"""Split-prefix (flash-decoding style) scheduling for the paged prefix-attention kernel: how many programs share
one tile's keys, and the merge of their partial results.

A ranking computes few query rows (new history tokens and candidates) against a long cached prefix, so one program
per ``BLOCK_M``-row tile and head can leave most of a GPU idle: 384 rows x 4 heads at ``BLOCK_M = 64`` are 24
programs on 132 SMs, each streaming the whole prefix. With ``S`` splits, program ``s`` of a tile streams keys
``[s * L, (s + 1) * L)`` of the tile's keys in order, the cached prefix then the new history rows it sees, and
writes its partial state (below); the split holding the tile's last key also takes the candidates' self term.
Every split so streams about ``L`` keys: the launch's longest program, which its time waits for, is as short as
the split count allows (a split taking all the new history on top of its share of the prefix would be longer by
all of it). The merge of fp32 partials is exact up to fp32 rounding:

* hstu: the sum is pointwise, so ``out = sum_s o_s`` (each split's partial ``o_s`` already divided by ``N``: the
  merge is one reduction);
* softmax: each split stores ``o_s = acc_s / l_s`` (its own normalised output, no larger than the largest value, so a
  16-bit partial cannot overflow) with its running max ``m_s`` and sum ``l_s``: ``M = max_s m_s``,
  ``w_s = 2 ** (m_s - M) l_s``, ``out = sum_s w_s o_s / sum_s w_s`` (log2 domain, as the kernel keeps its running
  max).

The partials are stored in the model's dtype when it is 16-bit (:func:`split_dtype`), else in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _common as C
from ._prefix_config import SPLIT_ALIGN

__all__ = ["pick_splits", "least_waves", "split_layout", "merge_splits", "split_dtype",
           "MIN_SPLIT_KEYS", "MAX_SPLITS", "OVERHEAD_KEYS"]

MIN_SPLIT_KEYS = 256   # keys per split at least: below it a split's fixed cost outweighs the parallelism
MAX_SPLITS = 32
# A portable program's fixed traffic in least_waves' model: a 128-row tile's queries loaded, its partial stored and
# read back by the merge, three [128, D] tiles against a key's two rows (K and V): 192 keys' worth.
OVERHEAD_KEYS = 3 * 128 / 2


def pick_splits(device: torch.device, num_work: int, max_keys: int, splits: Optional[int] = None, *,
                interpreted: bool = False) -> int:
    """Programs per (tile, head): ``splits`` when given (checked), else on CUDA the count of :func:`least_waves`
    for ``num_work`` (tile, head) pairs, one program per SM (an 8-warp config fills an SM's registers; measured:
    ``benchmarks/results/gpu-h100-2026-11-26b/``) and a 128-row tile's fixed traffic (:data:`OVERHEAD_KEYS`): splits
    are added where they cut the time of the launch's last wave, not to fill a count of programs; a batch whose users
    have few keys is never split; 1 elsewhere (and in the interpreter). The rule it replaced (about two programs per
    SM where the tiles leave SMs idle) was 1.16x slower over the bench's shapes and was removed (measured:
    ``benchmarks/results/gpu-h100-2026-11-27/``)."""
    if splits is not None:
        if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits must be an integer in [1, {MAX_SPLITS}], got {splits!r}")
        return splits
    if device.type != "cuda" or interpreted or num_work <= 0:
        return 1
    return least_waves(num_work, C.num_cores(device), max_keys, OVERHEAD_KEYS)


def least_waves(programs_per_split: int, slots: int, max_keys: int, overhead_keys: float) -> int:
    """The split count ``S`` in ``[1, most_splits(max_keys)]`` with the least ``waves(S) x (max_keys / S +
    overhead_keys)``: a launch of ``programs_per_split x S`` programs, ``slots`` at a time (SMs x the programs
    an SM holds), runs ``waves(S) = ceil(programs_per_split x S / slots)`` waves of programs that each stream
    ``max_keys / S`` keys and a fixed ``overhead_keys`` keys' worth (its queries' load, its partial's store and
    the merge's read of it); ties go to fewer splits. At NVIDIA's ranking shape (12 (tile, head) pairs, 132 SMs,
    4096 keys) 11 splits make one wave, where two programs per SM (the former rule's 16) make 1.45, i.e. two."""
    return min(range(1, most_splits(max_keys) + 1),
               key=lambda s: C.cdiv(programs_per_split * s, slots) * (max_keys / s + overhead_keys))


def most_splits(max_keys: int) -> int:
    """The most splits of ``max_keys`` keys (the longest user's) :func:`least_waves` chooses: at least
    :data:`MIN_SPLIT_KEYS` keys each, at most :data:`MAX_SPLITS`; at least 1."""
    return max(1, min(max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


def split_layout(device: torch.device, num_work: int, max_keys: int, block_n: Optional[int] = None,
                 splits: Optional[int] = None, *, target: Optional[int] = None,
                 interpreted: bool = False) -> tuple[int, int]:
    """``(num_splits, split_len)`` of a launch of ``num_work`` (tile, head) pairs: :func:`pick_splits`'s count, and
    the keys per split, ``max_keys`` (the longest user's prefix + new history) over that count rounded up to a
    multiple of every key block (:data:`~relaygr_engine.kernels._prefix_config.SPLIT_ALIGN`, or a fixed
    ``block_n`` above it), so that only a user's last block is masked. A chosen count then drops the splits the
    rounding left without keys (programs that would stream none and only add zeros to the merge); a count given
    as ``splits`` is kept as given; ``target`` (a count chosen by another rule, e.g. the sm_90 kernel's) replaces
    :func:`pick_splits`' where ``splits`` is None, and is trimmed the same way. Without a split, ``split_len``
    covers every key."""
    num_splits = target if splits is None and target else pick_splits(device, num_work, max_keys, splits,
                                                                       interpreted=interpreted)
    keys, align = max(max_keys, 1), max(SPLIT_ALIGN, block_n or 0)
    split_len = C.cdiv(C.cdiv(keys, num_splits), align) * align
    if splits is None:
        num_splits = C.cdiv(keys, split_len)
    return num_splits, split_len


def merge_splits(ws: torch.Tensor, ml: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Merge the kernel's partial states into ``out``, accumulating in fp32: HSTU's in one ``torch.sum``, softmax's
    in one kernel (:mod:`~relaygr_engine.kernels._merge_kernel`; its torch statement:
    :func:`~relaygr_engine.kernels.reference.merge_splits_ref`).

    Parameters
    ----------
    ws : Tensor [S, total_q, H, D], contiguous
        Each split's partial output (fp32, or 16-bit: :func:`split_dtype`): hstu's sum divided by ``N``, softmax's
        divided by its own running sum.
    ml : float32 Tensor [S, total_q, H, 2], contiguous, or None
        softmax: each split's running max (log2 domain) and running sum; None in hstu mode.
    out : Tensor [total_q, H, D]
        Written (any float dtype; rows and heads at any strides, each row's values contiguous).

    Returns
    -------
    ``out``
    """
    if ml is None:
        if ws.dtype == out.dtype:  # one reduction straight into the output (torch accumulates 16-bit sums in fp32)
            return torch.sum(ws, 0, out=out)
        return out.copy_(ws.sum(0, dtype=torch.float32))
    from ._merge_kernel import BLOCK_R, MAX_BLOCK_D, merge_kernel

    num_splits, total_q, num_heads, head_dim = ws.shape
    assert ws.is_contiguous() and ml.is_contiguous() and out.stride(2) == 1, "merge layout"
    num_rows = total_q * num_heads
    block_d = min(max(16, C.next_pow2(head_dim)), MAX_BLOCK_D)
    if num_rows:
        with C.device_guard(out.device):
            merge_kernel[(C.cdiv(num_rows, BLOCK_R), C.cdiv(head_dim, block_d))](
                ws, ml, out, num_rows, num_heads, num_splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                BLOCK_D=block_d, BLOCK_R=BLOCK_R, num_warps=4)
    return out


def split_dtype(dtype: Optional[torch.dtype], model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the split partials are stored in: ``dtype`` when given (fp32, fp16 or bf16; no bf16 in the CPU
    interpreter), else the model's when it is 16-bit (half the bytes of fp32: the partials are the largest buffer a
    split launch writes, and the merge reads, e.g. 11 splits x 384 rows x 4 heads x 256 values a layer at NVIDIA's
    ranking shape: 8.7 MB instead of 17) and fp32 for an fp32 model (its results stay exact to fp32 rounding).
    Either way a split accumulates in fp32 and the merge adds up in fp32: a 16-bit partial adds one rounding of
    the model's precision to each split's share."""
    if dtype is None:
        return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float32
    if dtype not in C.FLOAT_DTYPES:
        raise ValueError(f"split_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    if dtype == torch.bfloat16 and device.type == "cpu":
        raise ValueError("split_dtype=torch.bfloat16 cannot run in the CPU interpreter (numpy has no bf16); use "
                         "torch.float16 or torch.float32")
    return dtype
