"""The measurements of ``relaygr bench loadgen``: where queries are served (:class:`InProcessTarget`,
:class:`HTTPTarget`), one judged LoadGen point, and the searches of each mode's SLO-compliant throughput.

A point is one LoadGen Server run (:func:`~relaygr_engine.bench.loadgen_sut.run_point`) of the stream ``bench slo``
serves at that QPS (:meth:`relaygr_engine.bench.slo_run._Bench.at`: its warm-up, then ``max(--requests,
--min-duration-s x QPS)`` measured requests, the same count LoadGen issues). It passes when LoadGen's performance
constraint holds (its 99th percentile latency within SLO + delay) and every query was answered without error;
LoadGen's own verdict (``Result is``, with early stopping) is kept beside it. A point whose ranking P99 lies
within ``--noise-band`` of the SLO is run ``--repeats`` times and the majority decides, as in ``bench slo``.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
from typing import Optional

import numpy as np

from . import report as rpt
from . import slo_workers
from .loadgen_server import InProcessDriver
from .loadgen_sut import Order, PointSettings, run_point
from .sim import simulate
from .slo_run import _loadavg
from ..workload.requests import Workload

__all__ = ["InProcessTarget", "HTTPTarget", "summarize", "judge", "search", "start_qps"]


class InProcessTarget:
    """Queries served in this process by a fresh worker of the mode (:class:`InProcessDriver`), its cache first
    warmed by the run's warm-up requests on the virtual clock (exactly as ``bench slo`` serves them)."""

    name = "in_process"

    def __init__(self, bench, out_dir: str, order: Order) -> None:
        self.bench, self.out_dir, self.order = bench, out_dir, Order(order)
        self.runs = 0

    def point(self, mode: str, qps: float) -> dict:
        a = self.bench.args
        w = self.bench.at(qps)
        W, reqs = w.num_warmup, w.measured
        workers = self.bench.workers(mode, requests=w.requests)
        service, now0 = workers[0].service, 0.0
        if W and not getattr(service, "stateless", False):
            warm = Workload([dataclasses.replace(r, warmup=False) for r in w.requests[:W]], w.config, w.info)
            now0 = simulate(workers, warm, qps, timer=self.bench.timer,
                            batch=slo_workers.batch_policy(a)).makespan_s
        settings = _settings(a, qps, len(reqs), self.order)
        self.runs += 1
        where = os.path.join(self.out_dir, f"{mode}-{qps:.4g}qps-{self.runs}")
        results, log = run_point(lambda answered: InProcessDriver(
            service, reqs, a.pipeline_delay_ms / 1e3, answered, slo_workers.batch_policy(a), now0), settings, where)
        return summarize(results, log, a, qps, where)


class HTTPTarget:
    """Queries sent to a running ``relaygr serve`` (:class:`~relaygr_engine.bench.loadgen_http.HTTPDriver`): modes
    ``baseline`` (full inference on the replica) and ``relay``. Every run renames its users (a fresh set for the
    server) and, in relay mode, first serves its warm-up requests closed-loop; a sample of each run's scores is
    compared with full inference on this process's copy of the model."""

    name = "http"

    def __init__(self, bench, client, out_dir: str, order: Order, threads: int = 64, check_every: int = 10) -> None:
        self.bench, self.client, self.out_dir, self.order = bench, client, out_dir, Order(order)
        self.threads, self.check_every = threads, check_every
        self.runs = 0

    def point(self, mode: str, qps: float) -> dict:
        from .loadgen_http import HTTPDriver, max_abs_diff, warm_up

        a = self.bench.args
        w = self.bench.at(qps)
        self.runs += 1
        offset = self.runs << 40     # this run's users are new to the server
        relay = mode != "baseline"
        if relay:
            warm_up(self.client, w.requests[:w.num_warmup], offset)
        before = self.client.stats()
        made = []

        def make(answered):
            made.append(HTTPDriver(self.client, w.measured, a.pipeline_delay_ms / 1e3, relay, answered, offset,
                                   self.threads, self.check_every))
            return made[0]

        where = os.path.join(self.out_dir, f"{mode}-{qps:.4g}qps-{self.runs}")
        results, log = run_point(make, _settings(a, qps, len(w.measured), self.order), where)
        s = summarize(results, log, a, qps, where)
        after = self.client.stats()
        s["client"] = {k: after[k] - before.get(k, 0) for k in after}
        s["server_timing_p50_ms"] = {k: float(np.median(v)) for k, v in made[0].stages.items() if v}
        s["checked"] = len(made[0].kept)
        s["max_abs_diff"] = max_abs_diff(made[0], self.bench.model, a.device)
        return s


def _settings(a, qps: float, n: int, order: Order) -> PointSettings:
    return PointSettings(qps=qps, num_queries=n, bound_ms=a.slo_ms + a.pipeline_delay_ms, order=order, seed=a.seed)


def summarize(results: dict, log, a, qps: float, where: str) -> dict:
    """A point's JSON-able summary: LoadGen's results, the rankings' latency percentiles (answered queries,
    ``done - due``), answered and failed queries, ranking sources, pre-infers, and whether it passed."""
    lat = log.ranking_latency_s()
    s = rpt.latency_summary(lat) if lat.size else {"n": 0}
    answered = int(log.answered.sum())
    issued = int((~np.isnan(log.issue)).sum())
    delay = a.pipeline_delay_ms
    s.update(qps=qps, queries=log.n, issued=issued, answered=answered, errors=len(log.error),
             first_errors=dict(list(log.error.items())[:3]), loadgen=results, logs=where,
             loadgen_ranking_p99_ms=None if results["target_ms"] is None else results["target_ms"] - delay,
             sources=dict(collections.Counter(log.source[k] for k in np.flatnonzero(log.answered))),
             had_ticket_share=float(log.had_ticket.mean()) if log.n else 0.0, prefill=dict(log.prefill),
             issue_span_s=float(np.nanmax(log.issue) - np.nanmin(log.issue)) if issued else 0.0,
             jobs=dict(log.jobs), loadavg_1m=_loadavg())
    if log.jobs["cpu_s"] > 0:
        s["jobs"]["wall_per_cpu"] = log.jobs["wall_s"] / log.jobs["cpu_s"]
    s["passed"] = bool(results["perf_constraints_met"] and results["min_queries_met"] and not log.error
                       and answered == log.n == issued)
    return s


def judge(target, mode: str, qps: float, a, say=print) -> tuple[bool, dict]:
    """Run the point; rerun it ``--repeats`` times in all when LoadGen's ranking P99 lies within ``--noise-band`` of
    the SLO; the majority decides. Returns ``(passed, the median run's summary with every run's P99)``."""
    runs = [target.point(mode, qps)]
    p99 = runs[0]["loadgen_ranking_p99_ms"]
    if a.repeats > 1 and p99 is not None and a.slo_ms / (1 + a.noise_band) <= p99 <= a.slo_ms * (1 + a.noise_band):
        runs += [target.point(mode, qps) for _ in range(a.repeats - 1)]
    passed = [r["passed"] for r in runs]
    ok = 2 * sum(passed) > len(runs)
    order = sorted(range(len(runs)), key=lambda i: (not passed[i], runs[i]["loadgen_ranking_p99_ms"] or math.inf))
    chosen = dict(runs[order[len(runs) // 2]])
    chosen.update(p99_runs_ms=[r["loadgen_ranking_p99_ms"] for r in runs], passed_runs=int(sum(passed)),
                  runs=[{k: r.get(k) for k in _RUN_KEYS} for r in runs])
    say(f"  {target.name:<10} {mode:<9} {qps:8.3g} QPS  LoadGen p99 {_ms(chosen['loadgen']['target_ms'])} "
        f"(ranking {_ms(chosen['loadgen_ranking_p99_ms'])}, own {_ms(chosen.get('p99_ms'))})  "
        f"{chosen['loadgen']['validity']}  {'ok' if ok else 'over SLO'}"
        + (f" ({sum(passed)}/{len(runs)} runs pass)" if len(runs) > 1 else "")
        + (f"  ERRORS {chosen['errors']}" if chosen["errors"] else "")
        + (f"  jobs wall/CPU x{chosen['jobs']['wall_per_cpu']:.2f}" if "wall_per_cpu" in chosen["jobs"] else ""))
    return ok, chosen


_RUN_KEYS = ("queries", "answered", "errors", "checked", "max_abs_diff", "client", "passed", "logs")


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


def start_qps(bench, known: Optional[dict] = None) -> dict:
    """Each mode's first QPS: ``known[mode]`` (e.g. the virtual clock's SLO-compliant QPS), else ``--qps-start``,
    else ``bench slo``'s rule (0.3 x the rate one worker serves the predicted mean full inference)."""
    a = bench.args
    w = bench.at(0.0)
    mean_ms = float(np.mean([bench.lat.predict_ms(int(L), a.candidates) for L in w.history_lengths()[w.num_warmup:]]))
    default = a.qps_start or max(0.05, 0.3 * a.workers * 1e3 / max(mean_ms, 1e-3))
    return {m: (known or {}).get(m) or default for m in a.modes}


def search(target, modes: list, starts: dict, a, say=print) -> dict:
    """Each mode's SLO-compliant throughput on ``target``: ``bench slo``'s sweep and bisection, the modes in
    lockstep, no lower than ``--requests / --max-run-s`` QPS (a run lasts its queries over its QPS: status
    ``none`` when even that fails). Returns ``{mode: {"slo_throughput": SearchResult dict, "curve": [point
    summaries]}}``."""
    curves: dict = {m: {} for m in modes}

    def at(m):
        def evaluate(q):
            ok, s = judge(target, m, q, a, say)
            curves[m][q] = s
            return ok, None
        return evaluate

    floor = a.requests / a.max_run_s   # below it a run would last longer than --max-run-s
    found = rpt.search_lockstep({m: (rpt.search_steps(max(starts[m], floor), lo=max(starts[m] / 256, floor),
                                                      hi=max(starts[m], floor) * 256, factor=2.0, rel_tol=a.rel_tol,
                                                      max_evals=14 if a.quick else 20), at(m)) for m in modes})
    return {m: {"slo_throughput": found[m].to_dict(), "curve": [dict(curves[m][q], qps=q) for q in sorted(curves[m])]}
            for m in modes}
