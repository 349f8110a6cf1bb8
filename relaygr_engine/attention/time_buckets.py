"""Time buckets of the HSTU time bias: the bucket functions, their integer steps and the size checks of a table.

``time_buckets`` maps a time difference to its bucket in exact integers under each
:class:`~relaygr_engine.config.TimeBucket` function; ``time_bucket_bounds`` gives the steps it counts, which the
torch reference (:mod:`relaygr_engine.attention.reference`) and the Triton kernel search. The names are re-exported
by :mod:`relaygr_engine.attention.ops`.
"""
from __future__ import annotations

import functools

import torch

from ..config import TimeBucket, parse_choice
from ..kernels.reference import time_bucket_ref

_INT64_MAX = (1 << 63) - 1

# Most buckets a time-bias table may have: bit_length of an int64 is at most 63; the float functions' tables are
# bounded so that the kernel's search over the bucket steps stays short (Meta's STU encoder uses 2049).
MAX_LOG2_BUCKETS = 64
MAX_TIME_BUCKETS = 4096


def max_time_buckets(time_bucket) -> int:
    """Most buckets ``time_bucket`` may have (64 for ``"log2"``, else 4096)."""
    fn = parse_choice(TimeBucket, time_bucket, "time_bucket")
    return MAX_LOG2_BUCKETS if fn is TimeBucket.LOG2 else MAX_TIME_BUCKETS


def check_time_buckets(name: str, num_buckets, time_bucket) -> TimeBucket:
    """Parse ``time_bucket`` and check ``num_buckets`` against it (ValueError naming ``name``); returns the enum."""
    fn = parse_choice(TimeBucket, time_bucket, "time_bucket")
    top = max_time_buckets(fn)
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or not 1 <= num_buckets <= top:
        raise ValueError(f"{name} must be in [1, {top}] for time_bucket={fn.value!r}, got {num_buckets!r}")
    return fn


@functools.lru_cache(maxsize=64)
def _bounds(fn: TimeBucket, num_buckets: int) -> tuple[int, ...]:
    if fn is TimeBucket.LOG2:
        return tuple(1 << b for b in range(num_buckets - 1))
    # Smallest d >= 0 whose bucket (the definition, evaluated as published) is >= b, for b = 1 .. NB-1: a binary
    # search per b over [0, 2**62], all b at once. The definition is non-decreasing in d, so the steps are exact.
    want = torch.arange(1, num_buckets, dtype=torch.long)
    lo, hi = torch.zeros_like(want), torch.full_like(want, 1 << 62)
    never = time_bucket_ref(hi, num_buckets + 1, fn) < want
    for _ in range(63):
        mid = lo + (hi - lo) // 2
        ok = time_bucket_ref(mid, num_buckets + 1, fn) >= want
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid + 1)
    return tuple(torch.where(never, torch.full_like(hi, _INT64_MAX), hi).tolist())


@torch.compiler.assume_constant_result
def _bounds_constant(fn: TimeBucket, num_buckets: int) -> tuple[int, ...]:
    """:func:`_bounds`, which a compiler calls while tracing and keeps as a constant (it depends on its arguments
    only)."""
    return _bounds(fn, num_buckets)


@functools.lru_cache(maxsize=64)
def _bounds_on(fn: TimeBucket, num_buckets: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(_bounds(fn, num_buckets), dtype=torch.long, device=device)


def time_bucket_bounds(time_bucket, num_buckets: int, device=None) -> torch.Tensor:
    """The steps of a bucket function: ``bounds[b - 1]`` is the smallest ``d >= 0`` in bucket ``b`` or above.

    ``bucket(d) = #{b : bounds[b] <= d}`` (``|d|`` for ``"ln_0301"``), clamped to ``num_buckets - 1`` by the
    table's length. Buckets no int64 difference reaches get ``2**63 - 1``. Cached per function, size and device.

    Returns
    -------
    LongTensor [num_buckets - 1], non-decreasing.
    """
    fn = check_time_buckets("num_buckets", num_buckets, time_bucket)
    return _bounds_on(fn, num_buckets, torch.device("cpu") if device is None else torch.device(device))


def time_buckets(delta: torch.Tensor, num_buckets: int, time_bucket=TimeBucket.LOG2) -> torch.Tensor:
    """Bucket of a time difference under ``time_bucket`` (:class:`~relaygr_engine.config.TimeBucket`), clamped to
    ``num_buckets - 1``, in exact integers.

    ``"log2"`` (default): ``min(bit_length(max(delta, 0)), num_buckets - 1)``: ``bit_length(0) = 0``,
    ``bit_length(1) = 1``, ``bit_length(2..3) = 2``, ...: bucket ``b >= 1`` holds differences in
    ``[2**(b-1), 2**b)`` seconds; negative differences fall in bucket 0. The other functions count the steps of
    :func:`time_bucket_bounds`, equal to their float32 definitions.

    Parameters
    ----------
    delta : LongTensor [...]
        Time differences (int64, seconds).
    num_buckets : int
        Number of buckets ``NB``: ``[1, 64]`` for ``"log2"``, ``[1, 4096]`` otherwise.
    time_bucket : {"log2", "ln_0301", "sqrt_60"}

    Returns
    -------
    LongTensor [...] in ``[0, num_buckets)``.
    """
    fn = check_time_buckets("num_buckets", num_buckets, time_bucket)
    if delta.dtype != torch.long:
        raise ValueError(f"delta must be int64, got {delta.dtype}")
    if num_buckets == 1:
        return torch.zeros_like(delta)
    if torch.compiler.is_compiling():  # a constant of the graph
        bounds = torch.tensor(_bounds_constant(fn, num_buckets), dtype=torch.long, device=delta.device)
    else:
        bounds = _bounds_on(fn, num_buckets, delta.device)
    return torch.bucketize(delta.abs() if fn.absolute else delta, bounds, right=True)

