"""What the searches of ``relaygr bench slo`` evaluate, and what that costs in wall time (for ``--budget-s``).

The searches' parameters live here, for the run (:mod:`relaygr_engine.bench.slo_run`) and for the planner
(:mod:`relaygr_engine.bench.slo_budget`) alike: :func:`qps_searches` and :func:`length_searches` give each mode's
:func:`~relaygr_engine.bench.search.search_steps` arguments. Without a budget they are what they always were (a
geometric sweep by 2 from ``--qps-start`` or 30% of the calibrated capacity, from the unloaded longest history).
A budgeted run starts where the answers are expected: the baseline's throughput near its calibrated capacity and
its longest history near the length that loads it at the reference QPS (small first steps, as the calibration
predicts it), and from the second seed on every mode at what the earlier seeds measured (a step of the
tolerance each way brackets it again in two evaluations when it did not move). Every result keeps its meaning: a
measured passing value with a measured failing one within the tolerance above it.

:class:`CostModel` predicts a run's wall time from the latency model (the baseline's service time per request at
the stream's mean history length), the wall time one second of service time takes here (measured by the
calibration: other processes, Python), and a per-mode factor learned from the runs measured so far.
:func:`predict_seed` walks the searches against assumed answers (the same generators the run uses) and adds up
their runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .search import search_steps

__all__ = ["qps_searches", "length_searches", "expected", "start_length", "CostModel", "SeedShape", "predict_seed",
           "measured_requests"]

_MAX_REQUESTS_FACTOR = 4       # a run serves at most this many times --requests measured requests
BASE_UTILIZATION = 0.9         # the baseline's SLO-compliant QPS over its calibrated capacity, as expected
LOAD_AT_REF = 0.9              # the baseline's longest history loads its worker this much at the reference QPS
RELAY_QPS_PRIOR = 2.5          # a relay mode's SLO-compliant QPS over the baseline's, before one is measured
RELAY_LEN_PRIOR = 1.5          # the same for the longest history
FAIL_SHARE = {"qps": 0.4, "len": 0.25}  # of a failing run's measured requests, served before it stops (P99 > SLO)
MISS = 0.2                     # a prediction assumes the answers 20% above where the searches start
REPEAT_BAND = {"qps": (0.9, 1.35), "len": (0.92, 1.15)}  # values (over the answer) whose P99 is near the SLO
CACHED_SHARE = 0.8             # a lower bound's relay-mode request: its cached prefix makes it cheaper than a full
                               # inference (0.77-0.88 of it measured on a CPU, warm-up and cold users included)


def measured_requests(requests: int, min_duration_s: float, qps: float) -> int:
    """Measured requests a run at ``qps`` serves: ``max(requests, min_duration_s * qps)``, at most 4x."""
    return min(_MAX_REQUESTS_FACTOR * requests, max(requests, math.ceil(min_duration_s * qps)))


def qps_searches(modes, start: float, rel_tol: float, max_evals: int, near: Optional[dict] = None) -> dict:
    """Each mode's ``search_steps`` arguments for its highest QPS within the SLO.

    ``start``: the first QPS (``--qps-start``, else 30% of the calibrated capacity), swept by 2. ``near``: mode ->
    ``(value, first_factor)``, a value expected near the mode's answer (:func:`expected`): its search starts there
    with small first steps.
    """
    out = {}
    for m in modes:
        x, f = (near or {}).get(m) or (start, None)
        out[m] = dict(start=x, lo=x / 256, hi=x * 256, factor=2.0, rel_tol=rel_tol, max_evals=max_evals,
                      first_factor=f)
    return out


def length_searches(modes, start: int, step: int, hi: int, max_evals: int, near: Optional[dict] = None) -> dict:
    """Each mode's ``search_steps`` arguments for its longest history within the SLO (multiples of ``step`` up
    to ``hi``); ``near`` as for :func:`qps_searches`."""
    out = {}
    for m in modes:
        x, f = (near or {}).get(m) or (start, None)
        out[m] = dict(start=int(x), lo=step, hi=hi, factor=2.0, integer=True, step=step, max_evals=max_evals,
                      first_factor=f)
    return out


def expected(kind: str, modes, baseline: float, prior: Optional[dict], tol: float) -> dict:
    """Where a budgeted run's searches of ``kind`` (``"qps"``, ``"len"``) start: mode -> ``(value,
    first_factor)``. From the earlier seeds' answers (``prior``, mode -> value) with a first step of the tolerance
    (``tol``: the relative one, or the length step); else from the calibration's estimate of the baseline's answer
    (``baseline``), the relay modes' at :data:`RELAY_QPS_PRIOR` / :data:`RELAY_LEN_PRIOR` times it, with first
    steps of 25%."""
    ratio = RELAY_QPS_PRIOR if kind == "qps" else RELAY_LEN_PRIOR
    out = {}
    for m in modes:
        if prior and prior.get(m):
            v = prior[m]
            # (a step of the tolerance, a hair under: the bracket it makes must pass the bisection's test exactly)
            out[m] = (v, 1.0 + (tol * (1 - 1e-6) if kind == "qps" else tol / max(v, tol)))
        else:
            out[m] = (baseline * (1.0 if m == "baseline" else ratio), 1.25)
    return out


def start_length(latency_model, candidates: int, ref_qps: float, growth: float, step: int, hi: int,
                 workers: int = 1) -> int:
    """The budgeted length search's start: the base length whose requests (``growth`` tokens longer on average)
    load the baseline's workers :data:`LOAD_AT_REF` at ``ref_qps``, in multiples of ``step`` within
    ``[step, hi]``."""
    budget_ms = 1e3 * LOAD_AT_REF * workers / max(ref_qps, 1e-9)
    L = latency_model.max_history_len(budget_ms, candidates)
    L = hi if L is None else max(0, L - int(growth))
    return int(min(hi // step * step, max(step, L // step * step)))


class CostModel:
    """Predicted wall seconds of a run: ``requests served x baseline service time at their mean length x
    wall_per_service x factor(mode, phase)``.

    Parameters
    ----------
    latency_model : LatencyModel
        The baseline's full-inference time per request (the service-time clock's milliseconds).
    candidates : int
    wall_per_service : float
        Wall seconds one second of service time takes (the calibration's measured ratio, >= 1 on a shared CPU).

    The factor of a mode and phase (``"qps"``, ``"ref"``, ``"len"``) starts at ``priors.get(mode, 1)`` and
    follows what the runs measured (:meth:`observe`): their wall time over the base prediction, with one run's
    worth of the prior.
    """

    def __init__(self, latency_model, candidates: int, wall_per_service: float = 1.0,
                 priors: Optional[dict] = None) -> None:
        if not wall_per_service > 0:
            raise ValueError(f"wall_per_service must be > 0, got {wall_per_service!r}")
        self.lat, self.candidates, self.wall_per_service = latency_model, candidates, float(wall_per_service)
        self.priors = dict(priors or {})
        self._sums: dict = {}      # (mode, phase) -> [wall, base, runs]

    def base_s(self, served: float, mean_len: float) -> float:
        """The base prediction: ``served`` requests of ``mean_len`` history tokens at the calibrated cost."""
        return self.wall_per_service * served * self.lat.predict_ms(int(mean_len), self.candidates) / 1e3

    def factor(self, mode: str, phase: str) -> float:
        """What this mode's runs in this phase took over their base prediction (else the mode's other phases,
        else every mode's), pulled towards 1 by one run's worth."""
        start = self.priors.get(mode, 1.0)
        for keys in ([(mode, phase)], [k for k in self._sums if k[0] == mode], list(self._sums)):
            got = [self._sums[k] for k in keys if k in self._sums]
            if got:
                wall, base, runs = (sum(g[i] for g in got) for i in range(3))
                prior = base / runs
                return (wall + start * prior) / (base + prior)
        return start

    def run_s(self, mode: str, phase: str, served: float, mean_len: float) -> float:
        """Predicted wall seconds of one run."""
        return self.base_s(served, mean_len) * self.factor(mode, phase)

    def observe(self, mode: str, phase: str, served: float, mean_len: float, wall_s: float) -> None:
        """A measured run: ``served`` requests (warm-up included) of ``mean_len`` tokens took ``wall_s``."""
        base = self.base_s(served, mean_len)
        if base > 0 and wall_s >= 0:
            s = self._sums.setdefault((mode, phase), [0.0, 0.0, 0])
            s[0] += wall_s
            s[1] += base
            s[2] += 1

    def to_dict(self) -> dict:
        return {"wall_per_service": self.wall_per_service,
                "factors": {f"{m}/{p}": round(self.factor(m, p), 3) for m, p in self._sums}}


@dataclass
class SeedShape:
    """What one seed's searches look like, for :func:`predict_seed`.

    ``mean_len``: the served stream's mean history tokens; ``growth``: how much longer than the base length the
    max-length stream's requests are on average; ``capacity``: the baseline's requests per second at
    ``mean_len`` (workers / service time); ``prior``: ``{"qps": {mode: value}, "len": {mode: value}}`` of earlier
    seeds (None: the first seed).
    """

    modes: list
    candidates: int
    workers: int
    mean_len: float
    growth: float
    capacity: float
    max_len_hi: int
    max_evals: tuple = (20, 14)
    no_max_len: bool = False
    qps_start: Optional[float] = None
    ref_qps: Optional[float] = None
    prior: Optional[dict] = None


def _walk(kwargs: dict, answer: float) -> list:
    """The values a search with ``kwargs`` evaluates when exactly those ``<= answer`` pass."""
    gen = search_steps(**kwargs)
    seen = []
    try:
        x = next(gen)
        while True:
            seen.append(x)
            x = gen.send((x <= answer, None))
    except StopIteration:
        return seen


def predict_seed(cost: CostModel, values: dict, shape: SeedShape, later: bool = False, miss: float = MISS) -> dict:
    """Predicted wall seconds of one seed's phases (``qps``, ``ref``, ``len``, and their ``total``) and its
    ``runs`` (``runs_<phase>`` in each), at the settings ``values`` (``requests``, ``warmup_requests``,
    ``min_duration_s``, ``rel_tol``, ``len_step``, ``repeats``).

    The searches are walked against assumed answers: ``shape.prior`` (earlier seeds' answers), else the
    baseline's from the calibration (:data:`BASE_UTILIZATION` of its capacity; the length loading it
    :data:`LOAD_AT_REF` at the reference QPS) and the relay modes' as multiples of those, each ``miss`` above where
    its search starts (half that for an earlier seed's answer). ``later``: a seed after the first, whose searches
    start at the earlier seeds' answers (assumed where none is known yet). With ``miss=0`` and a cost model of
    ``wall_per_service=1`` and no runs observed, a lower bound: every answer where expected, no other process.
    """
    R, W = values["requests"], values["warmup_requests"]
    tol, step, repeats = values["rel_tol"], values["len_step"], values["repeats"]
    out = {"qps": 0.0, "ref": 0.0, "len": 0.0, "runs": 0, "runs_qps": 0, "runs_ref": 0, "runs_len": 0}

    def add(phase: str, mode: str, passed: bool, near: bool, measured: int, mean_len: float) -> None:
        n = measured if passed else FAIL_SHARE[phase] * measured
        runs = repeats if repeats > 1 and near else 1
        warm = 0 if mode == "baseline" else W
        out[phase] += runs * cost.run_s(mode, phase, warm + n, mean_len)
        out["runs"] += runs
        out[f"runs_{phase}"] += runs

    def walk(phase: str, searches: dict, answers: dict, measured, mean_len) -> None:
        lo, hi = REPEAT_BAND[phase]
        for m, kw in searches.items():
            a = answers[m]
            for x in _walk(kw, a):
                add(phase, m, x <= a, lo * a <= x <= hi * a, measured(x), mean_len(x))

    prior = shape.prior or {}

    def starts(kind: str, estimate: float, tol_: float) -> tuple[dict, dict]:
        """Where the searches start, and the answers assumed: a little off (:data:`MISS`)."""
        known = prior.get(kind)
        if not known and later:  # a later seed starts where the first one ended
            known = {m: v * (1 + miss) for m, (v, _) in expected(kind, shape.modes, estimate, None, tol_).items()}
        near = expected(kind, shape.modes, estimate, known, tol_)
        return near, {m: v * (1 + (miss / 2 if known else miss)) for m, (v, _) in near.items()}

    near, qa = starts("qps", BASE_UTILIZATION * shape.capacity, tol)
    walk("qps", qps_searches(shape.modes, shape.qps_start or 0.0, tol, shape.max_evals[0],
                             None if shape.qps_start else near), qa,
         lambda q: measured_requests(R, values["min_duration_s"], q), lambda q: shape.mean_len)
    ref = shape.ref_qps or 0.5 * qa["baseline"]
    n_ref = measured_requests(R, values["min_duration_s"], ref)
    for m in shape.modes:
        add("ref", m, True, False, n_ref, shape.mean_len)
    if not shape.no_max_len:
        L0 = start_length(cost.lat, shape.candidates, ref, shape.growth, step, shape.max_len_hi, shape.workers)
        near, la = starts("len", L0, step)
        la = {m: min(shape.max_len_hi, v) for m, v in la.items()}
        walk("len", length_searches(shape.modes, L0, step, shape.max_len_hi, shape.max_evals[1], near), la,
             lambda L: n_ref, lambda L: L + shape.growth)
    out["total"] = out["qps"] + out["ref"] + out["len"]
    return out
