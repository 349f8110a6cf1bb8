"""Prometheus metrics of a relay engine: one definition of every metric's name, kind and description
(:data:`METRICS`), exported by two backends.

* In a Ray Serve replica (:class:`~relaygr_engine.serving.ray_serve.RelayReplica`) the metrics are
  ``ray.serve.metrics`` objects, which Ray's metrics agent exports in Prometheus format on each node's metrics
  export port (``ray.init(_metrics_export_port=...)`` or ``ray start --metrics-export-port``); Ray prefixes
  every name with ``ray_`` and Serve adds the tags ``deployment``, ``replica`` and ``application``.
* In a process without Ray, :meth:`EngineMetrics.prometheus` registers the same metrics with
  ``prometheus_client`` (serve them with ``prometheus_client.start_http_server`` or read
  ``prometheus_client.generate_latest``).

Counters are exposed with the suffix ``_total`` (``relaygr_engine_rank_requests_total``), histograms as ``_bucket``,
``_sum`` and ``_count``. Recording is cheap and never raises into the request path: engine counters are exported
as the increase of :meth:`RelayEngine.stats <relaygr_engine.RelayEngine.stats>` since the previous call.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["MetricKind", "MetricSpec", "METRICS", "ENGINE_COUNTERS", "LATENCY_BUCKETS_MS", "EngineMetrics",
           "metrics_table"]


class MetricKind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric.

    Parameters
    ----------
    name : str
        The metric's name without the ``_total`` of a counter (Prometheus adds it) or Ray's ``ray_`` prefix.
    kind : MetricKind
    description : str
    tag_keys : tuple of str
        Labels the recorder sets (Serve adds its own in a replica).
    """

    name: str
    kind: MetricKind
    description: str
    tag_keys: tuple[str, ...] = ()


LATENCY_BUCKETS_MS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)

# RelayEngine.stats() key -> description; exported as the counter relaygr_engine_<key>
ENGINE_COUNTERS = {
    "rank_requests": "ranking requests served by the engine",
    "hbm_hits": "rankings that reused a prefix resident in device memory",
    "dram_hits": "rankings that reloaded their prefix from the DRAM tier",
    "recomputes": "rankings that computed their prefix (nothing usable cached)",
    "cached_tokens": "history tokens rankings read from the cache",
    "computed_tokens": "history rows rankings computed",
    "prefills": "admitted pre-inferences that computed KV",
    "prefill_declines": "pre-inferences not admitted (trigger, budget or full pool)",
    "prefill_computed_tokens": "history tokens pre-inferences computed",
    "spills": "prefixes copied from device memory to the DRAM tier",
    "reloads": "prefixes copied back from the DRAM tier",
    "evictions": "cache entries evicted to make room",
    "expired_leases": "pre-infer leases that ran out before their ranking came",
    "stale_tickets": "tickets whose cache entry was gone or re-keyed",
}

METRICS: tuple[MetricSpec, ...] = (
    *(MetricSpec(f"relaygr_engine_{k}", MetricKind.COUNTER, d) for k, d in ENGINE_COUNTERS.items()),
    MetricSpec("relaygr_prefill_requests", MetricKind.COUNTER,
               "pre-infer requests by outcome: admitted, rejected (for the caller to forward), busy (rejected "
               "at once: max_pending_prefills reached), declined (final), superseded (dropped: its user's ranking "
               "arrived while it waited)", ("outcome",)),
    MetricSpec("relaygr_rank_latency_ms", MetricKind.HISTOGRAM,
               "time from a ranking request's arrival at the replica to its scores (ms)"),
    MetricSpec("relaygr_prefill_latency_ms", MetricKind.HISTOGRAM,
               "time from a pre-infer request's arrival at the replica to its reply (ms)"),
    MetricSpec("relaygr_cache_free_pages", MetricKind.GAUGE, "cache pages holding no entry"),
    MetricSpec("relaygr_cache_pinned_pages", MetricKind.GAUGE, "cache pages pinned by leases and readers"),
    MetricSpec("relaygr_inflight_requests", MetricKind.GAUGE, "requests being served by the replica, by kind",
               ("kind",)),
)
_SPECS = {m.name: m for m in METRICS}


def metrics_table() -> str:
    """The metric names, kinds, labels and descriptions as a Markdown table (the documented list)."""
    rows = ["| metric (Prometheus name) | kind | labels | description |", "| --- | --- | --- | --- |"]
    for m in METRICS:
        shown = m.name + ("_total" if m.kind is MetricKind.COUNTER else "")
        rows.append(f"| `{shown}` | {m.kind.value} | {', '.join(m.tag_keys) or '-'} | {m.description} |")
    return "\n".join(rows)


def _ray_metric(spec: MetricSpec):
    from ray.serve import metrics

    if spec.kind is MetricKind.COUNTER:
        return metrics.Counter(spec.name, description=spec.description, tag_keys=spec.tag_keys)
    if spec.kind is MetricKind.GAUGE:
        return metrics.Gauge(spec.name, description=spec.description, tag_keys=spec.tag_keys)
    return metrics.Histogram(spec.name, description=spec.description, boundaries=list(LATENCY_BUCKETS_MS),
                             tag_keys=spec.tag_keys)


class _PrometheusMetric:
    """A ``prometheus_client`` metric behind the ``inc``/``set``/``observe(value, tags=...)`` calls of Ray's."""

    def __init__(self, spec: MetricSpec, registry) -> None:
        import prometheus_client as pc

        if spec.kind is MetricKind.COUNTER:
            self._m = pc.Counter(spec.name, spec.description, spec.tag_keys, registry=registry)
        elif spec.kind is MetricKind.GAUGE:
            self._m = pc.Gauge(spec.name, spec.description, spec.tag_keys, registry=registry)
        else:
            self._m = pc.Histogram(spec.name, spec.description, spec.tag_keys, registry=registry,
                                   buckets=LATENCY_BUCKETS_MS + (float("inf"),))

    def _child(self, tags: Optional[Mapping[str, str]]):
        return self._m.labels(**tags) if tags else self._m

    def inc(self, value: float = 1.0, tags: Optional[Mapping[str, str]] = None) -> None:
        self._child(tags).inc(value)

    def set(self, value: float, tags: Optional[Mapping[str, str]] = None) -> None:
        self._child(tags).set(value)

    def observe(self, value: float, tags: Optional[Mapping[str, str]] = None) -> None:
        self._child(tags).observe(value)


class EngineMetrics:
    """The metrics of :data:`METRICS` for one engine, recorded through Ray Serve or ``prometheus_client``.

    Build with :meth:`ray_serve` (in a Serve replica) or :meth:`prometheus` (any process); call
    :meth:`record_ranking`, :meth:`record_prefill` after each request, and :meth:`record_engine` with
    ``engine.stats()`` (every call exports the increase since the previous one).
    """

    def __init__(self, make) -> None:
        self._m = {spec.name: make(spec) for spec in METRICS}
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def ray_serve(cls) -> "EngineMetrics":
        """Metrics exported by Ray's metrics agent (``ray.serve.metrics``; needs ``relaygr-engine[ray]``)."""
        return cls(_ray_metric)

    @classmethod
    def prometheus(cls, registry=None) -> "EngineMetrics":
        """Metrics registered with ``prometheus_client`` (``registry``: default, the global ``REGISTRY``)."""
        if registry is None:
            import prometheus_client

            registry = prometheus_client.REGISTRY
        return cls(lambda spec: _PrometheusMetric(spec, registry))

    def record_engine(self, stats: Mapping[str, Any]) -> None:
        """Export the increase of the engine counters (:data:`ENGINE_COUNTERS`) since the previous call."""
        with self._lock:
            for key in ENGINE_COUNTERS:
                value = int(stats.get(key, 0))
                delta = value - self._last.get(key, 0)
                self._last[key] = value
                if delta > 0:
                    self._m[f"relaygr_engine_{key}"].inc(float(delta))
            for gauge, key in (("relaygr_cache_free_pages", "pool_free_pages"),
                               ("relaygr_cache_pinned_pages", "pool_pinned_pages")):
                if key in stats:
                    self._m[gauge].set(float(stats[key]))

    def record_ranking(self, latency_s: float) -> None:
        """One ranking answered ``latency_s`` seconds after it arrived (where its prefix came from is in the
        engine counters ``hbm_hits``, ``dram_hits``, ``recomputes``)."""
        self._m["relaygr_rank_latency_ms"].observe(latency_s * 1e3)

    def record_prefill(self, outcome: str, latency_s: float) -> None:
        """One pre-infer request answered with ``outcome`` (``"admitted"``, ``"rejected"``, ``"busy"``,
        ``"declined"`` or ``"superseded"``) ``latency_s`` seconds after it arrived."""
        self._m["relaygr_prefill_requests"].inc(1.0, tags={"outcome": str(outcome)})
        self._m["relaygr_prefill_latency_ms"].observe(latency_s * 1e3)

    def set_inflight(self, kind: str, count: int) -> None:
        """Requests of ``kind`` (``"prefill"`` or ``"rank"``) being served now."""
        self._m["relaygr_inflight_requests"].set(float(count), tags={"kind": kind})
