"""One MLPerf LoadGen run (Server scenario, performance only) against a driver: :func:`run_point`.

LoadGen (``mlperf_loadgen``, the extra ``relaygr-engine[loadgen]``) issues ``num_queries`` queries at Poisson
arrival times of mean rate ``qps``, each on its own schedule, and measures each query's latency from its scheduled
time to its completion. The System Under Test hands every query to a driver
(:class:`~relaygr_engine.bench.loadgen_server.InProcessDriver` or
:class:`~relaygr_engine.bench.loadgen_http.HTTPDriver`); the driver answers it once the query's *ranking* is done,
so the latency LoadGen judges is the pipeline delay plus the ranking's latency, against the bound SLO + delay at
the 99th percentile.

Which request a query serves: with :class:`Order` ``stream`` (default) the ``k``-th query issued serves the run's
``k``-th request, so a user's requests keep their order in the log (a user's next request extends the history of
its previous one); with ``loadgen`` LoadGen's sample index picks it (each request issued once, in LoadGen's random
order: ``performance_issue_unique``).

LoadGen writes ``mlperf_log_summary.txt`` and ``mlperf_log_detail.txt`` into the point's directory;
:func:`read_detail` reads the detail log's results (``result_validity``, the percentiles, early stopping, ...).
"""
from __future__ import annotations

import enum
import itertools
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import check_int
from ..policy import _checks

__all__ = ["Order", "PointSettings", "run_point", "read_detail", "LOG_FILES"]

LOG_FILES = ("mlperf_log_summary.txt", "mlperf_log_detail.txt")
_lock = threading.Lock()   # LoadGen keeps global state: one test at a time in a process


class Order(str, enum.Enum):
    """Which request a LoadGen query serves."""

    STREAM = "stream"      # the k-th query issued serves the run's k-th request (the log's order)
    LOADGEN = "loadgen"    # LoadGen's sample index picks it (each once, in LoadGen's order)


@dataclass(frozen=True)
class PointSettings:
    """One LoadGen Server run.

    Parameters
    ----------
    qps : float
        Target QPS (> 0).
    num_queries : int
        Queries issued (>= 1): LoadGen's ``min_query_count`` with ``min_duration_ms`` 0, so exactly this many.
    bound_ms : float
        Latency bound (> 0) of the target percentile: SLO + pipeline delay.
    percentile : float
        Target latency percentile in (0, 1).
    order : Order
    seed : int
        LoadGen's schedule and sample-index seeds.
    """

    qps: float
    num_queries: int
    bound_ms: float
    percentile: float = 0.99
    order: Order = Order.STREAM
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "qps", _checks.number("qps", self.qps, low=0.0, low_open=True))
        object.__setattr__(self, "num_queries", check_int("num_queries", self.num_queries, 1))
        object.__setattr__(self, "bound_ms", _checks.number("bound_ms", self.bound_ms, low=0.0, low_open=True))
        object.__setattr__(self, "percentile", _checks.number("percentile", self.percentile, low=0.0, high=1.0,
                                                              low_open=True, high_open=True))
        object.__setattr__(self, "order", Order(self.order))
        check_int("seed", self.seed)


def _test_settings(lg, s: PointSettings):
    ts = lg.TestSettings()
    ts.scenario = lg.TestScenario.Server
    ts.mode = lg.TestMode.PerformanceOnly
    ts.server_target_qps = float(s.qps)
    ts.server_target_latency_ns = int(round(s.bound_ms * 1e6))
    ts.server_target_latency_percentile = float(s.percentile)
    ts.min_duration_ms = 0
    ts.min_query_count = s.num_queries
    ts.max_query_count = 0
    ts.performance_issue_unique = s.order is Order.LOADGEN
    ts.schedule_rng_seed = ts.sample_index_rng_seed = ts.qsl_rng_seed = int(s.seed)
    return ts


def run_point(make_driver: Callable, settings: PointSettings, out_dir) -> tuple[dict, object]:
    """Run LoadGen against a fresh driver; ``(results of the detail log, the driver's QueryLog)``.

    Parameters
    ----------
    make_driver : callable
        ``make_driver(answered) -> driver`` with ``submit(k, tag)`` and ``close() -> QueryLog``; ``answered(tag)``
        completes a query to LoadGen.
    settings : PointSettings
    out_dir : path
        Where LoadGen's summary and detail logs go (created; its trace and accuracy logs are removed).
    """
    import mlperf_loadgen as lg

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = settings.num_queries

    def answered(tag) -> None:
        lg.QuerySamplesComplete([lg.QuerySampleResponse(tag, 0, 0)])

    with _lock:
        driver = make_driver(answered)
        order = itertools.count()

        def issue(samples) -> None:
            for s in samples:
                driver.submit(next(order) if settings.order is Order.STREAM else int(s.index), s.id)

        log_out = lg.LogOutputSettings()
        log_out.outdir = str(out)
        log_out.copy_summary_to_stdout = False
        log_settings = lg.LogSettings()
        log_settings.log_output = log_out
        log_settings.enable_trace = False
        sut = lg.ConstructSUT(issue, lambda: None)
        qsl = lg.ConstructQSL(n, n, lambda samples: None, lambda samples: None)
        try:
            lg.StartTestWithLogSettings(sut, qsl, _test_settings(lg, settings), log_settings, "")
        finally:
            lg.DestroyQSL(qsl)
            lg.DestroySUT(sut)
        log = driver.close()
    for name in ("mlperf_log_trace.json", "mlperf_log_accuracy.json"):
        (out / name).unlink(missing_ok=True)
    return read_detail(out / "mlperf_log_detail.txt", settings.percentile), log


def read_detail(path, percentile: float = 0.99) -> dict:
    """The results of a LoadGen detail log: ``validity``, ``perf_constraints_met``, ``early_stopping_met``,
    ``min_queries_met``, ``min_duration_met``, ``query_count``, ``overlatency_count``, ``completed_qps``,
    ``scheduled_qps``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``target_ms`` (the ``percentile``'s), ``mean_ms``,
    ``max_ms``, ``errors`` (LoadGen's own error count), ``early_stopping`` (its verdict, text)."""
    values = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith(":::MLLOG "):
                rec = json.loads(line[len(":::MLLOG "):])
                values[rec["key"]] = rec["value"]

    def ms(key: str):
        v = values.get(key)
        return None if v is None else float(v) / 1e6

    target = f"result_{percentile * 100:.2f}_percentile_latency_ns"
    return {
        "validity": values.get("result_validity"), "perf_constraints_met": values.get("result_perf_constraints_met"),
        "early_stopping_met": values.get("early_stopping_met"), "min_queries_met": values.get("result_min_queries_met"),
        "min_duration_met": values.get("result_min_duration_met"), "query_count": values.get("result_query_count"),
        "overlatency_count": values.get("result_overlatency_query_count"),
        "completed_qps": values.get("result_completed_samples_per_sec"),
        "scheduled_qps": values.get("result_scheduled_samples_per_sec"),
        "p50_ms": ms("result_50.00_percentile_latency_ns"), "p90_ms": ms("result_90.00_percentile_latency_ns"),
        "p99_ms": ms("result_99.00_percentile_latency_ns"), "target_ms": ms(target),
        "mean_ms": ms("result_mean_latency_ns"), "max_ms": ms("result_max_latency_ns"),
        "errors": int(values.get("num_errors", 0) or 0), "early_stopping": values.get("early_stopping_result"),
    }

