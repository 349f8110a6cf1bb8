"""Helpers shared by the benchmarks: the RESULT line and JSON output, timing, and the percentile
(:func:`relaygr_engine.stats.percentile`) re-exported."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..results import emit_result, environment  # noqa: F401 (re-exported)
from ..stats import _rank, percentile  # noqa: F401 (re-exported: the package's one percentile)

__all__ = ["environment", "emit_result", "percentile", "exceed_count", "synthetic_history"]


def synthetic_history(L: int, num_items: int, seed: int, device="cpu"):
    """The benchmarks' random history of ``L`` behaviors: item ids in ``[0, num_items)``, 4 action kinds,
    timestamps from 1.7e9 s rising by 0-600 s a step (one generator seeded with ``seed``; on ``device``)."""
    from ..behaviors import Behaviors

    g = torch.Generator().manual_seed(seed)
    return Behaviors(item_ids=torch.randint(0, num_items, (L,), generator=g),
                     action_ids=torch.randint(0, 4, (L,), generator=g),
                     timestamps=torch.cumsum(torch.randint(0, 600, (L,), generator=g), 0) + 1_700_000_000).to(device)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # pragma: no cover - needs an Ascend host
        torch.npu.synchronize()  # type: ignore[attr-defined]


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, *, warmup: int = 0,
                timer: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` calls (after ``warmup`` untimed ones) on ``timer``;
    the device's work is synchronised before and after each timed call (:func:`sync`)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = timer()
        fn()
        sync(device)
        samples.append(timer() - t0)
    return float(percentile(samples, 50))


def exceed_count(n: int, q: float) -> int:
    """Fewest of ``n`` samples above a threshold that make :func:`percentile` ``q`` exceed it, whatever the others.

    ``P_q >= x[floor(h)]`` (``h`` as in :func:`percentile`), and ``x[floor(h)]`` exceeds the threshold exactly when
    ``n - floor(h)`` samples do; with fewer, the other samples can keep ``P_q`` at or below it.

    Parameters
    ----------
    n : int
        Samples in all (>= 1).
    q : float
        Percent in [0, 100].

    Returns
    -------
    int in ``[1, n]``
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q <= 100:
        raise ValueError(f"q must be a percent in [0, 100], got {q!r}")
    return n - int(np.floor(_rank(n, q)))
