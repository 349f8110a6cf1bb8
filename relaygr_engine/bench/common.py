"""Helpers shared by the benchmarks: the RESULT line and JSON output, and the one percentile definition."""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

__all__ = ["environment", "emit_result", "percentile", "exceed_count", "synthetic_history"]


def environment(device: str = "cpu") -> dict[str, Any]:
    """What a result was measured on: device name, versions, date and git commit (when in a checkout)."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{platform.processor() or platform.machine()} CPU"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"device": str(dev), "device_name": name, "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "date": datetime.date.today().isoformat(), "commit": commit}


def synthetic_history(L: int, num_items: int, seed: int, device="cpu"):
    """The benchmarks' random history of ``L`` behaviors: item ids in ``[0, num_items)``, 4 action kinds,
    timestamps from 1.7e9 s rising by 0-600 s a step (one generator seeded with ``seed``; on ``device``)."""
    from ..behaviors import Behaviors

    g = torch.Generator().manual_seed(seed)
    return Behaviors(item_ids=torch.randint(0, num_items, (L,), generator=g),
                     action_ids=torch.randint(0, 4, (L,), generator=g),
                     timestamps=torch.cumsum(torch.randint(0, 600, (L,), generator=g), 0) + 1_700_000_000).to(device)


def _rank(n: int, q):
    """Fractional 0-based rank ``h = q / 100 * (n - 1)`` of percentile ``q`` among ``n`` sorted values."""
    return np.asarray(q, dtype=np.float64) / 100.0 * (n - 1)


def percentile(values, q):
    """Percentile ``q`` of ``values``: the one definition behind every P50/P90/P99/median the benchmarks report.

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


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v).replace(" ", "_")


def emit_result(result: dict[str, Any], json_path: Optional[str] = None, extra: Optional[dict] = None) -> str:
    """Print the one ``RESULT key=value ...`` line (last line of every benchmark) and optionally write JSON."""
    line = "RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in result.items())
    if json_path:
        payload = {"result": result, **(extra or {})}
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(line, flush=True)
    return line
