"""Latency model of full-inference ranking, calibrated by measurement.

The model predicts the time of one baseline ranking request (``model.rank_full``: no cache, the whole history and
all candidates computed) from the history length ``L`` and the candidate count ``C``::

    t(L, C) = a + b * n + c * n**2 + d * C * L        (milliseconds, n = L + C)

``b * n`` is the per-token work (projections, MLPs), ``c * n**2`` the attention over the whole sequence and
``d * C * L`` the candidates' attention to the history beyond what ``n**2`` already covers. The coefficients are fit
by non-negative least squares on the relative error of measured points (:func:`calibrate`), so the prediction
never decreases with ``L`` or ``C``, which makes "the longest history the baseline can serve within the SLO" well
defined (:meth:`LatencyModel.max_history_len`).

A profile is a small JSON file (``relaygr calibrate`` writes one) recording the device, the torch version, the model
configuration, the measured points and the coefficients; ``LatencyModel.default("cpu")`` loads the profile that
ships with the package.
"""
from __future__ import annotations

import importlib.resources
import itertools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from .._warn import warn_once
from ..stats import percentile
from . import _checks

__all__ = ["LatencyPoint", "LatencyModel", "calibrate", "fit_coefficients", "PROFILE_FORMAT"]

_log = logging.getLogger("relaygr_engine")

PROFILE_FORMAT = "relaygr-latency-profile"
PROFILE_VERSION = 1
TERMS = ("1", "L+C", "(L+C)^2", "C*L")


@dataclass(frozen=True)
class LatencyPoint:
    """One measured grid point: ``ms`` is the chosen quantile of the repeats of a ``(history_len, num_candidates)``
    request."""

    history_len: int
    num_candidates: int
    ms: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "history_len", _checks.count("history_len", self.history_len))
        object.__setattr__(self, "num_candidates", _checks.count("num_candidates", self.num_candidates))
        object.__setattr__(self, "ms", _checks.number("ms", self.ms, low=0.0))


def _features(L: np.ndarray, C: np.ndarray) -> np.ndarray:
    """Design matrix ``[N, 4]`` of the terms in :data:`TERMS` for lengths ``L [N]`` and candidate counts ``C [N]``."""
    L = np.asarray(L, dtype=np.float64)
    C = np.asarray(C, dtype=np.float64)
    n = L + C
    return np.stack([np.ones_like(n), n, n * n, C * L], axis=1)


def fit_coefficients(points: Sequence[LatencyPoint]) -> tuple[float, float, float, float]:
    """Non-negative least-squares fit of ``(a, b, c, d)`` to measured points, minimizing relative error.

    With four terms the exact non-negative solution is found by enumeration: the optimum is the unconstrained
    least-squares fit on its support, so every subset of terms whose columns are independent is solved and the
    feasible (all >= 0) fit with the smallest residual wins, the one with fewer terms on a tie. A term that the
    grid cannot identify (for example ``C * L`` when every point has the same ``C``) is thereby left at zero.

    Parameters
    ----------
    points : sequence of LatencyPoint
        At least one point.

    Returns
    -------
    tuple of float
        ``(a, b, c, d)`` in milliseconds, all >= 0.
    """
    if len(points) == 0:
        raise ValueError("points must hold at least 1 measured point, got 0")
    X = _features([p.history_len for p in points], [p.num_candidates for p in points])
    y = np.array([p.ms for p in points], dtype=np.float64)
    # Relative error: each row divided by its measurement, so a 2 ms point counts as much as a 100 ms one (the
    # SLO threshold may sit anywhere on the grid). The floor keeps a ~0 ms point from taking all the weight.
    w = 1.0 / np.maximum(y, max(1e-3 * float(y.max()), 1e-9))
    X, y = X * w[:, None], y * w
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale  # column scaling keeps n**2 (~1e6) and 1 comparable for lstsq
    best_coef = np.zeros(4)
    best_res = float(y @ y)
    best_size = 0
    tol = 1e-12 * max(best_res, 1e-300)
    for size in range(1, 5):
        for subset in itertools.combinations(range(4), size):
            A = Xs[:, subset]
            if np.linalg.matrix_rank(A) < size:
                continue
            sol, *_ = np.linalg.lstsq(A, y, rcond=None)
            if np.any(sol < 0):
                continue
            r = y - A @ sol
            res = float(r @ r)
            if res < best_res - tol or (res <= best_res + tol and size < best_size):
                coef = np.zeros(4)
                coef[list(subset)] = sol
                best_coef, best_res, best_size = coef, res, size
    coef = best_coef / scale
    return tuple(float(v) for v in coef)  # type: ignore[return-value]


@dataclass(frozen=True)
class LatencyModel:
    """Predicted full-inference latency ``t(L, C) = a + b*n + c*n**2 + d*C*L`` in ms (``n = L + C``).

    Parameters
    ----------
    a, b, c, d : float
        Coefficients in milliseconds, finite and >= 0 (so the prediction never decreases with ``L`` or ``C``).
    device : str
        Device the points were measured on (``"cpu"``, ``"cuda"``, ...).
    points : tuple of LatencyPoint
        The measurements the coefficients were fit to (empty for a hand-built model).
    meta : dict
        Provenance: torch version, model configuration, threads, quantile, repeats, fit quality.
    """

    a: float
    b: float
    c: float
    d: float = 0.0
    device: str = "unknown"
    points: tuple[LatencyPoint, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "d"):
            object.__setattr__(self, name, _checks.number(name, getattr(self, name), low=0.0))
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty string, got {self.device!r}")
        pts = tuple(self.points)
        for i, p in enumerate(pts):
            if not isinstance(p, LatencyPoint):
                raise ValueError(f"points[{i}] must be a LatencyPoint, got {type(p).__name__}")
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "meta", dict(self.meta))

    # ------------------------------------------------------------------ prediction
    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return (self.a, self.b, self.c, self.d)

    def predict_ms(self, history_len: int, num_candidates: int) -> float:
        """Predicted full-inference latency in ms of one request with ``history_len`` behaviors and
        ``num_candidates`` candidates."""
        L = _checks.count("history_len", history_len)
        C = _checks.count("num_candidates", num_candidates)
        n = L + C
        return self.a + self.b * n + self.c * n * n + self.d * C * L

    def max_history_len(self, budget_ms: float, num_candidates: int) -> Optional[int]:
        """Longest history the baseline serves within ``budget_ms`` with ``num_candidates`` candidates.

        Returns
        -------
        int or None
            The largest ``L >= 0`` with ``predict_ms(L, C) <= budget_ms``; ``-1`` when not even an empty history
            fits; ``None`` when every length fits (the prediction does not grow with ``L``, or so slowly
            that the boundary is past any float, e.g. a subnormal ``b``).
        """
        budget = _checks.number("budget_ms", budget_ms, low=0.0)
        C = _checks.count("num_candidates", num_candidates)
        if self.predict_ms(0, C) > budget:
            return -1
        # In n = L + C: t = (a - d*C^2) + (b + d*C) * n + c * n^2, non-decreasing for n >= C; solve t = budget.
        q0, q1, q2 = self.a - self.d * C * C - budget, self.b + self.d * C, self.c
        if q2 == 0.0 and q1 == 0.0:
            return None
        # Cancellation-free root: n = -2 q0 / (q1 + sqrt(q1^2 - 4 q2 q0)).
        disc = math.sqrt(max(q1 * q1 - 4.0 * q2 * q0, 0.0))
        n = -2.0 * q0 / (q1 + disc) if q1 + disc > 0 else 0.0
        if not math.isfinite(n):
            return None
        # The float root is only an estimate: bracket the exact boundary by galloping, then bisect.
        fits = lambda L: self.predict_ms(L, C) <= budget  # noqa: E731
        lo = min(max(int(math.floor(n)) - C, 0), 1 << 62)
        step = 1
        while lo > 0 and not fits(lo):
            lo, step = max(lo - step, 0), step * 2
        hi, step = lo + 1, 1
        while fits(hi):
            lo, hi, step = hi, hi + step, step * 2
        while hi - lo > 1:  # fits(lo) and not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, points: Sequence[LatencyPoint], *, device: str = "unknown",
            meta: Optional[Mapping[str, Any]] = None) -> "LatencyModel":
        """Fit the coefficients to measured points (:func:`fit_coefficients`) and record the fit quality in
        ``meta["fit"]`` (RMSE in ms and the largest relative error over the points)."""
        pts = tuple(points)
        coef = fit_coefficients(pts)
        pred = _features([p.history_len for p in pts], [p.num_candidates for p in pts]) @ np.array(coef)
        meas = np.array([p.ms for p in pts])
        rel = np.abs(pred - meas) / np.maximum(meas, 1e-9)
        info = dict(meta or {})
        info["fit"] = {"rmse_ms": float(np.sqrt(np.mean((pred - meas) ** 2))), "max_rel_err": float(rel.max())}
        return cls(*coef, device=device, points=pts, meta=info)

    # ------------------------------------------------------------------ profiles
    def to_dict(self) -> dict:
        """The profile as plain JSON-able data."""
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "device": self.device,
            "formula": "t_ms(L, C) = a + b*(L+C) + c*(L+C)^2 + d*C*L",
            "coefficients_ms": {"a": self.a, "b": self.b, "c": self.c, "d": self.d},
            "points": [{"history_len": p.history_len, "num_candidates": p.num_candidates, "ms": p.ms}
                       for p in self.points],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LatencyModel":
        """Inverse of :meth:`to_dict`; ValueError naming the field when the profile is malformed."""
        if not isinstance(data, Mapping):
            raise ValueError(f"profile must be a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"profile format must be {PROFILE_FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version must be {PROFILE_VERSION}, got {data.get('version')!r}")
        coef = data.get("coefficients_ms")
        if not isinstance(coef, Mapping) or not {"a", "b", "c", "d"} <= set(coef):
            raise ValueError(f"coefficients_ms must be an object with keys a, b, c, d, got {coef!r}")
        raw_points = data.get("points", [])
        if not isinstance(raw_points, list):
            raise ValueError(f"points must be a list, got {type(raw_points).__name__}")
        points = []
        for i, p in enumerate(raw_points):
            try:
                points.append(LatencyPoint(p["history_len"], p["num_candidates"], p["ms"]))
            except (KeyError, TypeError):
                raise ValueError(f"points[{i}] must have history_len, num_candidates and ms, got {p!r}") from None
        return cls(coef["a"], coef["b"], coef["c"], coef["d"], device=data.get("device", "unknown"),
                   points=tuple(points), meta=data.get("meta", {}))

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LatencyModel":
        """Read a profile written by :meth:`save` (or ``relaygr calibrate``)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def default(cls, device: str = "cpu") -> "LatencyModel":
        """The profile shipped with the package for ``device``'s type.

        Only a CPU profile ships. Other device types get it too, with one logged warning: an accelerator is faster
        than the CPU, so the CPU profile over-predicts there and the trigger errs toward pre-inferring (still
        capped by its footprint and load bounds). Run ``relaygr calibrate --device DEV`` for a real profile.
        """
        kind = str(device).split(":")[0]
        res = importlib.resources.files("relaygr_engine.data")
        target = res / f"latency_{kind}.json"
        if not target.is_file():
            if kind == "cpu":
                raise FileNotFoundError(f"the shipped CPU latency profile is missing ({target}); reinstall the "
                                        "package or write one with `relaygr calibrate --device cpu`")
            warn_once(_log, ("latency", "profile", kind), "no shipped latency profile for device %r; using the CPU "
                      "profile (run `relaygr calibrate --device %s` for a measured one)", device, device)
            target = res / "latency_cpu.json"
        return cls.from_dict(json.loads(target.read_text(encoding="utf-8")))


def calibrate(fn: Callable[[int, int], Any], lengths: Sequence[int], cand_counts: Sequence[int], repeats: int,
              *, warmup: int = 1, quantile: float = 0.5, timer: Callable[[], float] = time.perf_counter,
              device: str = "unknown", meta: Optional[Mapping[str, Any]] = None) -> LatencyModel:
    """Measure ``fn(L, C)`` over the grid ``lengths x cand_counts`` and fit a :class:`LatencyModel`.

    Repeats run in rounds over the whole grid (not back to back per point), so slow drift of the machine spreads
    over all points instead of biasing a few.

    Parameters
    ----------
    fn : callable
        ``fn(history_len, num_candidates)`` runs one full-inference request and returns when it is done (for an
        accelerator it must synchronize).
    lengths, cand_counts : sequence of int
        Grid of history lengths (>= 0) and candidate counts (>= 1).
    repeats : int
        Timed calls per grid point (>= 1).
    warmup : int
        Untimed calls per grid point before the timed rounds (>= 0).
    quantile : float
        Which quantile of the repeats a point records, in [0, 1]: 0.5 (median) is robust; higher is more
        conservative toward tail latency.
    timer : callable
        Clock in seconds (``time.perf_counter``); tests pass a synthetic one.
    device : str
        Recorded in the profile.
    meta : mapping, optional
        Extra provenance recorded in the profile (model configuration, torch version, ...).

    Returns
    -------
    LatencyModel
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable as fn(history_len, num_candidates), got {type(fn).__name__}")
    Ls = [_checks.count(f"lengths[{i}]", v) for i, v in enumerate(lengths)]
    Cs = [_checks.count(f"cand_counts[{i}]", v, 1) for i, v in enumerate(cand_counts)]
    if not Ls:
        raise ValueError("lengths must hold at least 1 history length, got 0")
    if not Cs:
        raise ValueError("cand_counts must hold at least 1 candidate count, got 0")
    repeats = _checks.count("repeats", repeats, 1)
    warmup = _checks.count("warmup", warmup, 0)
    q = _checks.number("quantile", quantile, low=0.0, high=1.0)
    grid = [(L, C) for L in dict.fromkeys(Ls) for C in dict.fromkeys(Cs)]
    for L, C in grid:
        for _ in range(warmup):
            fn(L, C)
    samples: dict[tuple[int, int], list[float]] = {g: [] for g in grid}
    for _ in range(repeats):
        for L, C in grid:
            t0 = timer()
            fn(L, C)
            samples[(L, C)].append((timer() - t0) * 1e3)
    points = [LatencyPoint(L, C, max(percentile(samples[(L, C)], 100 * q), 0.0)) for L, C in grid]
    info = dict(meta or {})
    info.update(repeats=repeats, warmup=warmup, quantile=q)
    return LatencyModel.fit(points, device=device, meta=info)
