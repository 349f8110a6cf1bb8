"""The served runs of one ``relaygr bench slo`` seed (:class:`_Bench`): its workloads, one run at a QPS (and base
length), a point's verdict with repeats near the SLO, the points kept on disk, and what each run cost (for the
budget, :mod:`relaygr_engine.bench.slo_budget`).
"""
from __future__ import annotations

import collections
import math
import os
import time
from typing import Optional

import numpy as np

from . import report as rpt
from . import slo_workers
from .common import exceed_count
from .sim import simulate
from .slo_budget import Deadline
from .slo_points import PointLog
from ..workload.build import build_workload
from ..workload.logs import InteractionLog
from ..workload.requests import Workload, WorkloadConfig

__all__ = ["_Bench", "summarize"]

_MAX_REQUESTS_FACTOR = 4  # the measured stream holds this many times --requests (for --min-duration-s)


class _Bench:
    """Everything one seed's runs share: model, latency model, workloads, options, progress bar, the services
    (``pool``: built once per command, reset per run), and under a budget the phase being served, its abort time
    and the cost model the runs feed."""

    def __init__(self, args, log: InteractionLog, model, latency_model, console, timer=time.perf_counter,
                 points: Optional[PointLog] = None, pool: Optional[slo_workers.Pool] = None, cost=None) -> None:
        self.args, self.log, self.model, self.lat, self.console = args, log, model, latency_model, console
        self.timer = timer
        self.points = points  # (finished points, kept on disk: a rerun serves only the others)
        self.pool = pool if pool is not None else slo_workers.Pool(args, model, timer)
        self.cost = cost
        self.phase = "qps"
        self.abort = None     # callable () -> bool: a run still going then is stopped (Deadline)
        self.run_wall: dict = {}   # phase -> wall seconds of the runs served in it
        self.paid: collections.Counter = collections.Counter()  # graphs captured, compile failures: this seed's
        self._workloads: dict = {}

    def workload(self, base_length: Optional[int] = None) -> Workload:
        """The whole stream: warm-up requests, then up to ``_MAX_REQUESTS_FACTOR * --requests`` measured ones."""
        a = self.args
        if base_length not in self._workloads:
            cap = a.max_history if base_length is None else max(a.max_history, a.max_len_hi)
            measured = min(_MAX_REQUESTS_FACTOR * a.requests, self.log.num_eligible() - a.warmup_requests)
            cfg = WorkloadConfig(num_items=self.model.config.num_items, num_actions=self.model.config.num_actions,
                                 num_requests=measured, warmup_requests=a.warmup_requests,
                                 num_candidates=a.candidates, length_scale=a.length_scale,
                                 base_length=base_length, max_history=cap, suffix_tokens=a.suffix_tokens,
                                 trim_tokens=a.trim_tokens or max(1, cap // 4),
                                 pipeline_delay_s=a.pipeline_delay_ms / 1e3, seed=a.seed)
            self._workloads[base_length] = build_workload(self.log, cfg)
        return self._workloads[base_length]

    def at(self, qps: float, base_length: Optional[int] = None) -> Workload:
        """The stream one run at ``qps`` serves: the warm-up, then the first ``max(--requests, --min-duration-s *
        qps)`` measured requests (so every run's measured window lasts long enough for queues to build)."""
        w = self.workload(base_length)
        n = min(len(w.measured), max(self.args.requests, math.ceil(self.args.min_duration_s * qps)))
        return Workload(w.requests[:w.num_warmup + n], w.config, w.info)

    def workers(self, mode: str, trigger: bool = True, requests=()) -> list:
        """Workers of ``mode`` for one run (:meth:`relaygr_engine.bench.slo_workers.Pool.workers`: the mode's
        services reset as freshly built, a new trigger), their tensors prepared."""
        return self.pool.workers(mode, self.lat, trigger=trigger, requests=requests)

    def run(self, mode: str, qps: float, base_length: Optional[int] = None, label: str = "",
            early_stop: bool = False) -> dict:
        """Serve one workload at one QPS in one mode; with ``early_stop``, stop once P99 > SLO is certain.

        Raises :class:`~relaygr_engine.bench.slo_budget.Deadline` where the run was stopped at its abort time."""
        t0 = time.perf_counter()
        w = self.at(qps, base_length)
        workers = self.workers(mode, requests=w.requests)
        self.console.start(f"{mode} {label or f'{qps:.3g} QPS'}", len(w.requests))
        n = len(w.measured)
        stop = None
        if early_stop and not self.args.full_runs:
            stop = (self.args.slo_ms / 1e3, exceed_count(n, 99))   # that many over SLO: P99 > SLO
        res = simulate(workers, w, qps, mode=mode, timer=self.timer, progress=self.console.bar, stop_over=stop,
                       batch=slo_workers.batch_policy(self.args), abort=self.abort)
        wall = time.perf_counter() - t0
        self.run_wall[self.phase] = self.run_wall.get(self.phase, 0.0) + wall
        if res.aborted:
            raise Deadline(f"{mode} at {qps:.3g} QPS stopped at its deadline")
        s = summarize(res)
        for k in ("graph_captures", "prefill_graph_captures", "compile_failures"):
            self.paid[k] += s["engine_stats"].get(k, 0)
        if self.cost is not None:
            warm = 0 if all(getattr(x.service, "stateless", False) for x in workers) else w.num_warmup
            self.cost.observe(mode, self.phase, warm + s["completed"], s["history_len_mean"], wall)
        return s

    def kept(self, kind: str, mode: str, qps: float, base_length: Optional[int], measure):
        """``measure()``'s value for this point, or the value an earlier run of the same settings kept for it;
        a measured value is kept (on disk at once) before it is returned."""
        if self.points is not None:
            got = self.points.get(kind, mode, qps, base_length)
            if got is not None:
                return got
        value = measure()
        if self.points is not None:
            self.points.put(value, kind, mode, qps, base_length)
        return value

    def judge_kept(self, mode: str, qps: float, base_length: Optional[int] = None, label: str = ""):
        """:meth:`judge`, or what an earlier run of the same settings judged at this point."""
        got = self.kept("judge", mode, qps, base_length, lambda: list(self.judge(mode, qps, base_length, label)))
        return bool(got[0]), got[1]

    def judge(self, mode: str, qps: float, base_length: Optional[int] = None, label: str = "") -> tuple[bool, dict]:
        """Whether P99 <= SLO at one point: one run, plus ``--repeats - 1`` more when its P99 lies within
        ``--noise-band`` of the SLO (where timing noise can flip the outcome); the majority of runs decides.

        Returns the verdict and the summary of the run with the median P99, with ``p99_runs_ms`` (every run's
        P99; a run stopped early gives a lower bound) and ``passed_runs``.
        """
        a = self.args
        runs = [self.run(mode, qps, base_length, label, early_stop=True)]
        if a.repeats > 1 and a.slo_ms / (1 + a.noise_band) <= runs[0]["p99_ms"] <= a.slo_ms * (1 + a.noise_band):
            runs += [self.run(mode, qps, base_length, label, early_stop=True) for _ in range(a.repeats - 1)]
        passed = [r["p99_ms"] <= a.slo_ms and not r["stopped_early"] for r in runs]
        ok = 2 * sum(passed) > len(runs)
        order = sorted(range(len(runs)), key=lambda i: (not passed[i], runs[i]["p99_ms"]))
        chosen = dict(runs[order[len(runs) // 2]])
        chosen.update(p99_runs_ms=[r["p99_ms"] for r in runs], passed_runs=int(sum(passed)))
        return ok, chosen


def summarize(res) -> dict:
    """A run's JSON-able summary: latency percentiles, utilization, ranking sources, pre-infers, engine stats."""
    s = rpt.latency_summary(res.latency_s)
    src = res.source_counts()
    n = max(1, len(res.sources))
    s.update({
        "qps": res.qps, "workers": res.workers,
        "utilization": res.work_s / max(res.workers * (res.makespan_s - res.window_start_s), 1e-12),
        "stopped_early": bool(res.stopped_early), "completed": int(len(res.latency_s)),
        "num_requests": int(res.num_requests),
        "mean_service_ms": float(np.mean(res.service_s) * 1e3), "sources": src,
        "work_ms_per_request": res.work_s * 1e3 / max(1, len(res.latency_s)),
        "hit_rates": {k: v / n for k, v in src.items()},
        "prefill": {k: v for k, v in res.prefill.items()}, "wall_s": res.wall_s,
        "history_len_mean": float(np.mean(res.history_len)), "loadavg_1m": _loadavg(),
        "engine_stats": {k: int(v) for k, v in res.engine_stats.items()
                         if isinstance(v, (int, np.integer)) and not isinstance(v, bool)},
    })
    return s


def _loadavg() -> Optional[float]:
    """The machine's 1-minute load average (other processes competing for the CPU), when the OS reports it."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None
