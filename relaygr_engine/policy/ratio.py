"""The pre-infer : ranking ratio of disaggregated serving, from measured service rates, adjusted online.

Offline (P/D-Serve): a pool of ``n`` instances each finishing ``b`` requests per ``T`` seconds serves ``n * b / T``
requests per second, and the two pools are balanced when ``n_p * b_p / T_p ~= n_d * b_d / T_d``. For relay serving
only the share ``s`` of requests that the trigger pre-infers reaches the pre-infer pool, so the balance is
``n_p * b_p / T_p ~= s * n_d * b_d / T_d``; :func:`split` solves it for ``n_p + n_d = total`` (each pool >= 1).

Online: :class:`RatioController` watches each window's measurements (the ranking pool's SLO attainment and
queueing, the pre-infer pool's queueing and the share of prefixes that arrived after their ranking) and moves one
instance between the pools when one side is plainly the bottleneck for ``patience`` windows in a row.

On Ray Serve the split acts through each pool's autoscaling configuration (:func:`autoscaling_config`): the
autoscaler keeps each pool near its share, and scales it with its own load within bounds around it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from . import _checks

__all__ = ["ServiceRates", "split", "WindowStats", "RatioController", "autoscaling_config"]


@dataclass(frozen=True)
class ServiceRates:
    """Measured service of each pool.

    Parameters
    ----------
    prefill_s, rank_s : float
        Mean time (> 0) of one pre-infer call (``T_p``) and one ranking call (``T_d``), in seconds.
    prefill_batch, rank_batch : float
        Mean requests per call (>= 1): ``b_p``, ``b_d``.
    prefill_share : float
        Share of requests pre-inferred (in [0, 1]; the trigger's admission rate).
    """

    prefill_s: float
    rank_s: float
    prefill_batch: float = 1.0
    rank_batch: float = 1.0
    prefill_share: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill_s", "rank_s"):
            _checks.number(name, getattr(self, name), low=0.0, low_open=True)
        for name in ("prefill_batch", "rank_batch"):
            _checks.number(name, getattr(self, name), low=1.0)
        _checks.number("prefill_share", self.prefill_share, low=0.0, high=1.0)

    @property
    def prefill_rate(self) -> float:
        """Pre-infers per second of one instance (``b_p / T_p``)."""
        return self.prefill_batch / self.prefill_s

    @property
    def rank_rate(self) -> float:
        """Rankings per second of one instance (``b_d / T_d``)."""
        return self.rank_batch / self.rank_s


def split(total: int, rates: ServiceRates) -> tuple[int, int]:
    """``(n_p, n_d)`` with ``n_p + n_d = total`` (>= 2) and each >= 1 closest to the balance (module doc).

    Of the integer splits, the one whose slower pool sustains the most requests per second.
    """
    _checks.count("total", total, 2)

    def capacity(n_p: int) -> float:
        pre = math.inf if rates.prefill_share == 0 else n_p * rates.prefill_rate / rates.prefill_share
        return min(pre, (total - n_p) * rates.rank_rate)

    n_p = max(range(1, total), key=lambda p: (capacity(p), -p))
    return n_p, total - n_p


@dataclass(frozen=True)
class WindowStats:
    """One window's measurements.

    Parameters
    ----------
    slo_attainment : float
        Share of rankings within the SLO, in [0, 1].
    rank_wait_s, prefill_wait_s : float
        Mean queueing (>= 0) before a ranking / a pre-infer started.
    late_share : float
        Share of shipped prefixes that arrived after their ranking (or never), in [0, 1].
    """

    slo_attainment: float
    rank_wait_s: float
    prefill_wait_s: float
    late_share: float

    def __post_init__(self) -> None:
        _checks.number("slo_attainment", self.slo_attainment, low=0.0, high=1.0)
        _checks.number("rank_wait_s", self.rank_wait_s, low=0.0)
        _checks.number("prefill_wait_s", self.prefill_wait_s, low=0.0)
        _checks.number("late_share", self.late_share, low=0.0, high=1.0)


class RatioController:
    """Moves one instance between the pools when a window says one side is the bottleneck.

    Parameters
    ----------
    total : int
        Instances of both pools (>= 2).
    rates : ServiceRates
        The offline measurement: the starting split is :func:`split`.
    target_attainment : float
        SLO attainment (in (0, 1]) below which the ranking pool is short of instances, unless the pre-infer pool
        is the cause (prefixes late: ``late_share > max_late_share``).
    max_late_share : float
        Share of late prefixes (in [0, 1]) above which the pre-infer pool is short of instances.
    patience : int
        Windows (>= 1) in a row that must agree before a move.
    """

    def __init__(self, total: int, rates: ServiceRates, *, target_attainment: float = 0.99,
                 max_late_share: float = 0.1, patience: int = 2) -> None:
        self.n_p, self.n_d = split(total, rates)
        self.target = _checks.number("target_attainment", target_attainment, low=0.0, high=1.0, low_open=True)
        self.max_late = _checks.number("max_late_share", max_late_share, low=0.0, high=1.0)
        self.patience = _checks.count("patience", patience, 1)
        self._want: Optional[int] = None
        self._streak = 0

    @classmethod
    def starting_at(cls, prefill: int, rank: int, **options) -> "RatioController":
        """A controller whose starting split is ``(prefill, rank)`` (each >= 1), e.g. the pools as deployed;
        ``options`` are the constructor's keywords."""
        _checks.count("prefill", prefill, 1)
        _checks.count("rank", rank, 1)
        c = cls(prefill + rank, ServiceRates(prefill_s=1.0, rank_s=1.0), **options)
        c.n_p, c.n_d = prefill, rank
        return c

    @property
    def split(self) -> tuple[int, int]:
        return self.n_p, self.n_d

    def _direction(self, w: WindowStats) -> int:
        """+1: one more pre-infer instance; -1: one more ranking instance; 0: keep."""
        if w.late_share > self.max_late and w.prefill_wait_s >= w.rank_wait_s:
            return +1 if self.n_d > 1 else 0
        if w.slo_attainment < self.target and w.rank_wait_s > w.prefill_wait_s:
            return -1 if self.n_p > 1 else 0
        return 0

    def observe(self, window: WindowStats) -> Optional[tuple[int, int]]:
        """Feed one window; returns the new ``(n_p, n_d)`` when it changes, else None."""
        if not isinstance(window, WindowStats):
            raise ValueError(f"window must be a WindowStats, got {type(window).__name__}")
        d = self._direction(window)
        if d == 0 or d != self._want:
            self._want, self._streak = (d or None), (1 if d else 0)
        else:
            self._streak += 1
        if d == 0 or self._streak < self.patience:
            return None
        self.n_p, self.n_d = self.n_p + d, self.n_d - d
        self._want, self._streak = None, 0
        return self.split


def autoscaling_config(replicas: int, per_replica_rate: float, *, slack: int = 1,
                       target_ongoing_requests: Optional[float] = None) -> dict:
    """A Serve ``autoscaling_config`` keeping a pool near ``replicas`` (within ``slack``, never below 1).

    ``target_ongoing_requests`` defaults to one second's worth of work divided down to the requests a replica
    finishes in 100 ms (``max(1, 0.1 * per_replica_rate)``): a replica above it asks for more replicas.
    """
    _checks.count("replicas", replicas, 1)
    _checks.number("per_replica_rate", per_replica_rate, low=0.0, low_open=True)
    _checks.count("slack", slack)
    target = (max(1.0, 0.1 * per_replica_rate) if target_ongoing_requests is None else
              _checks.number("target_ongoing_requests", target_ongoing_requests, low=0.0, low_open=True))
    return {"min_replicas": max(1, replicas - slack), "max_replicas": replicas + slack,
            "initial_replicas": replicas, "target_ongoing_requests": float(target)}
