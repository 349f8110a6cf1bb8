"""SLO searches: the largest QPS or history length whose evaluation passes (``P99 <= SLO``).

:func:`search_max` finds the largest ``x`` (a QPS, a history length) whose evaluation passes (``P99 <= SLO``):

1. **sweep**: from ``start`` multiply by ``factor`` while points pass (or divide while they fail) until a pass/fail
   bracket is found, or the range ``[lo, hi]`` ends (status ``"capped"``: even ``hi`` passes; ``"none"``: even
   ``lo`` fails);
2. **bisection** of the bracket until ``fail - pass <= rel_tol * pass`` (or ``step`` for integers).

Every returned value is a measured passing point with a measured failing point above it within the tolerance. The
search assumes latency grows with the searched quantity; timing noise can break that locally, and the bracket then
still holds a measured pass and a measured fail.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["SearchResult", "search_max", "search_steps", "search_lockstep", "slo_throughput"]


@dataclass
class SearchResult:
    """Outcome of :func:`search_max`.

    Attributes
    ----------
    best : float or None
        Largest measured passing value (None when even ``lo`` fails).
    first_fail : float or None
        Smallest measured failing value above ``best`` (None when even ``hi`` passes).
    status : {"ok", "capped", "none", "budget", "deadline"}
        ``"budget"``: ``max_evals`` ran out during the sweep, before a bracket was found. ``"deadline"``: the
        search's ``stop`` said so (a time limit) before it was done; ``best`` and ``first_fail`` are the bracket
        measured so far (either may be None).
    points : list of (x, passed, payload)
        Every evaluation, in evaluation order.
    """

    best: Optional[float]
    first_fail: Optional[float]
    status: str
    points: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"best": self.best, "first_fail": self.first_fail, "status": self.status,
                "evaluated": [x for x, _, _ in self.points], "passed": [bool(p) for _, p, _ in self.points]}


class _Abandoned(Exception):
    """An evaluation was answered None: the search ends with the bracket measured so far."""


def search_max(evaluate: Callable[[float], tuple[bool, Any]], start: float, *, lo: float, hi: float,
               factor: float = 2.0, rel_tol: float = 0.05, integer: bool = False, step: int = 1,
               max_evals: int = 40, first_factor: Optional[float] = None,
               stop: Optional[Callable[[], bool]] = None) -> SearchResult:
    """Largest ``x`` in ``[lo, hi]`` with ``evaluate(x)[0]`` true: a geometric sweep, then bisection.

    Parameters
    ----------
    evaluate : callable
        ``x -> (passed, payload)``; called at most once per distinct ``x``.
    start, lo, hi, factor, rel_tol, integer, step, max_evals, first_factor, stop
        See :func:`search_steps`.
    """
    return search_lockstep({"": (search_steps(start, lo=lo, hi=hi, factor=factor, rel_tol=rel_tol,
                                              integer=integer, step=step, max_evals=max_evals,
                                              first_factor=first_factor, stop=stop), evaluate)})[""]


def search_lockstep(tasks: dict) -> dict:
    """Run several :func:`search_steps` searches with one evaluation of each in turn.

    ``tasks`` maps a name to ``(search_steps generator, evaluate)``. Interleaving spreads slow drift of a shared
    machine over every search instead of biasing the one that happened to run during a busy period.
    Returns the :class:`SearchResult` of each name.
    """
    pending = {}
    results = {}
    for name, (gen, evaluate) in tasks.items():
        try:
            pending[name] = (gen, evaluate, next(gen))
        except StopIteration as e:  # pragma: no cover - a search always evaluates its start
            results[name] = e.value
    while pending:
        for name in list(pending):
            gen, evaluate, x = pending[name]
            try:
                pending[name] = (gen, evaluate, gen.send(evaluate(x)))
            except StopIteration as e:
                results[name] = e.value
                del pending[name]
    return results


def search_steps(start: float, *, lo: float, hi: float, factor: float = 2.0, rel_tol: float = 0.05,
                 integer: bool = False, step: int = 1, max_evals: int = 40, first_factor: Optional[float] = None,
                 stop: Optional[Callable[[], bool]] = None):
    """The search of :func:`search_max` as a generator: yields each ``x`` to evaluate, receives
    ``(passed, payload)``, and returns the :class:`SearchResult` (``StopIteration.value``).

    Parameters
    ----------
    start : float
        First point (clamped into ``[lo, hi]``).
    lo, hi : float
        Search range, ``0 < lo <= hi``.
    factor : float
        Sweep growth factor (> 1).
    rel_tol : float
        Bisection stops when ``fail - pass <= rel_tol * pass`` (> 0; real-valued searches).
    integer : bool
        Search multiples of ``step`` only; bisection stops when ``fail - pass <= step``.
    max_evals : int
        Hard bound on evaluations; the bracket found so far is returned.
    first_factor : float, optional
        The sweep's first step (``1 < first_factor <= factor``), each next one the square of the last, up to
        ``factor``: a start near the answer (a value measured before) brackets it in few evaluations, a start far
        from it still sweeps geometrically. Default: every step ``factor``. An integer search moves at least one
        ``step``.
    stop : callable () -> bool, optional
        Asked before every evaluation (a deadline): once True, the search ends with status ``"deadline"`` and the
        bracket measured so far. An evaluation answered with None instead of ``(passed, payload)`` (one cut
        short) ends it the same way, that value not counted.
    """
    if not (0 < lo <= hi):
        raise ValueError(f"need 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol!r}")
    if integer and (not isinstance(step, int) or step < 1):
        raise ValueError(f"step must be an integer >= 1, got {step!r}")
    if first_factor is not None and not 1 < first_factor <= factor:
        raise ValueError(f"first_factor must be in (1, factor={factor!r}], got {first_factor!r}")
    stop = stop or (lambda: False)
    sweep = [0]  # sweep steps taken

    def grow() -> float:
        f = factor if first_factor is None else min(factor, first_factor ** (2 ** sweep[0]))
        sweep[0] += 1
        return f

    def snap(x: float) -> float:
        x = min(max(x, lo), hi)
        if integer:
            x = max(step, int(round(x / step)) * step)
            x = min(x, int(hi // step) * step) if hi >= step else x
        return x

    points: list = []
    memo: dict[float, bool] = {}

    def ok(x: float):
        if x not in memo:
            got = yield x
            if got is None:
                raise _Abandoned
            passed, payload = got
            memo[x] = bool(passed)
            points.append((x, bool(passed), payload))
        return memo[x]

    def walk():
        x = snap(start)
        if stop():
            return SearchResult(None, None, "deadline", points)
        if (yield from ok(x)):
            good = x
            while True:
                f = grow()
                nx = snap(x * f)
                if integer and nx <= x:
                    nx = snap(x + step)
                if nx <= x:
                    return SearchResult(good, None, "capped", points)
                if len(points) >= max_evals:
                    return SearchResult(good, None, "budget", points)
                if stop():
                    return SearchResult(good, None, "deadline", points)
                if (yield from ok(nx)):
                    good = x = nx
                else:
                    bad = nx
                    break
        else:
            bad = x
            while True:
                f = grow()
                nx = snap(x / f)
                if integer and nx >= x:
                    nx = snap(x - step)
                if nx >= x:
                    return SearchResult(None, bad, "none", points)
                if len(points) >= max_evals:
                    return SearchResult(None, bad, "budget", points)
                if stop():
                    return SearchResult(None, bad, "deadline", points)
                if (yield from ok(nx)):
                    good = nx
                    break
                bad = x = nx
        while len(points) < max_evals:
            if integer:
                if bad - good <= step:
                    break
                mid = snap(good + (bad - good) / 2)
                if mid <= good or mid >= bad:
                    break
            else:
                if bad - good <= rel_tol * good:
                    break
                mid = 0.5 * (good + bad)
            if stop():
                return SearchResult(good, bad, "deadline", points)
            if (yield from ok(mid)):
                good = mid
            else:
                bad = mid
        return SearchResult(good, bad, "ok", points)

    try:
        return (yield from walk())
    except _Abandoned:  # an evaluation answered None (stopped by a deadline): the bracket measured so far
        good = max((x for x, p, _ in points if p), default=None)
        bad = min((x for x, p, _ in points if not p and (good is None or x > good)), default=None)
        return SearchResult(good, bad, "deadline", points)


def slo_throughput(p99_ms_at: Callable[[float], tuple[float, Any]], slo_ms: float, start_qps: float, *,
                   lo: float, hi: float, factor: float = 1.6, rel_tol: float = 0.05,
                   max_evals: int = 30) -> SearchResult:
    """Highest QPS whose P99 latency is within ``slo_ms`` (:func:`search_max` over QPS).

    ``p99_ms_at(qps) -> (p99_ms, payload)``; each point's payload is stored as ``(p99_ms, payload)``.
    """
    def evaluate(q: float):
        p99, payload = p99_ms_at(q)
        return p99 <= slo_ms, (p99, payload)

    return search_max(evaluate, start_qps, lo=lo, hi=hi, factor=factor, rel_tol=rel_tol, max_evals=max_evals)
