"""The one percentile definition behind every P50/P90/P99/median the package reports (the trigger's calibration,
the workload statistics, the benchmarks)."""
from __future__ import annotations

import numpy as np

__all__ = ["percentile"]


def _rank(n: int, q):
    """Fractional 0-based rank ``h = q / 100 * (n - 1)`` of percentile ``q`` among ``n`` sorted values."""
    return np.asarray(q, dtype=np.float64) / 100.0 * (n - 1)


def percentile(values, q):
    """Percentile ``q`` of ``values``: the one definition behind every P50/P90/P99/median reported.

    Linear interpolation between the closest ranks (numpy's default ``method="linear"``): with the ``n`` values
    sorted, ``x[0] <= ... <= x[n-1]``, and ``h = q / 100 * (n - 1)``,
    ``P_q = x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])``. ``P_0`` is the minimum, ``P_50`` the
    median, ``P_100`` the maximum; ``P_99`` of 100 values lies 1% of the way from the 99th smallest to the largest.

    Parameters
    ----------
    values : array_like
        The samples (any shape, flattened): at least one, no NaN.
    q : float or sequence of float
        Percent(s), each in [0, 100].

    Returns
    -------
    float, or ndarray of float64 (one per entry of a sequence ``q``)

    Raises
    ------
    ValueError
        ``values`` empty, non-numeric or holding NaN; ``q`` not numbers in [0, 100].
    """
    try:
        x = np.asarray(values, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise ValueError(f"values must be numbers, got {type(values).__name__}") from None
    if x.size == 0:
        raise ValueError("values must hold at least one sample, got none")
    if np.isnan(x).any():
        raise ValueError(f"values must not hold NaN, got {int(np.isnan(x).sum())} of {x.size}")
    try:
        qs = np.asarray(q, dtype=np.float64)
    except (TypeError, ValueError):
        qs = None
    if qs is None or qs.ndim > 1 or not bool(np.all((qs >= 0) & (qs <= 100))):  # NaN fails too
        raise ValueError(f"q must be a percent in [0, 100] (or a sequence of them), got {q!r}")
    h = _rank(x.size, qs)
    x.sort()
    lo = np.floor(h).astype(np.int64)
    hi = np.minimum(lo + 1, x.size - 1)
    out = x[lo] + (h - lo) * (x[hi] - x[lo])
    return float(out) if out.ndim == 0 else out
