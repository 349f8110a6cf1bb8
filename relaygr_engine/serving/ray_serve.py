"""Relay-race inference on Ray Serve: replicas that each hold a :class:`~relaygr_engine.RelayEngine`.

Needs the optional extra ``relaygr-engine[ray]`` (``ray[serve]==2.60.0``). ::

    from relaygr_engine.serving.ray_serve import ReplicaSpec, run
    from relaygr_engine.serving.client import RelayClient

    spec = ReplicaSpec(model=rg.GRModelConfig(...), seed=0, cache=rg.CacheConfig(num_pages=4096))
    handle = run(spec, num_replicas=2)              # on the Ray cluster ray.init() connected to
    client = RelayClient(handle)
    pre = client.prefill(user_id=7, history=hist_prefix)      # pre-infer, forwarded on rejection
    res = client.rank(user_id=7, history=hist, candidates=cands, ticket=pre)   # same replica: source "hbm"

Each replica (:class:`RelayReplica`) builds its model from a :class:`ReplicaSpec` (a ``GRModelConfig`` with a seed
or a ``state_dict`` file, a ``CacheConfig``, optionally a ``TriggerConfig``), and serves

* ``prefill(body)`` / ``POST /prefill`` and ``rank(body)`` / ``POST /rank``: JSON in and out
  (:mod:`relaygr_engine.serving.wire`);
* ``stats()`` / ``GET /stats``: the engine's counters plus the replica's;
* Prometheus metrics through ``ray.serve.metrics`` (:mod:`relaygr_engine.serving.metrics`: engine counters,
  request latency histograms, cache gauges), which Ray's metrics agent exports on each node's metrics port;
* ``record_autoscaling_stats()``: the replica's load window (rankings within ``ReplicaSpec.slo_ms``, queueing,
  late prefixes) for Serve's autoscaling and the live ratio policy (:mod:`relaygr_engine.serving.ratio_policy`);
* ``record_routing_stats()``: what the request router reads (free, evictable and pinned pages, in-flight
  pre-infers and rankings, whether it can take a pre-infer now).

Requests are placed by :class:`~relaygr_engine.serving.request_router.RelayRequestRouter` from the request's route key (the
Serve session id; HTTP header ``x-session-id``; see :mod:`relaygr_engine.serving.route_key`).

A pre-infer is rejected at once, without waiting for the engine, while the replica's pending pre-infers are at
``ReplicaSpec.max_pending_prefills`` (no local queue, as in P/D-Serve); otherwise the engine's trigger and pool
decide, and a decline that another replica could take (:data:`~relaygr_engine.serving.wire.REJECT_REASONS`) is
reported as a rejection for the caller to forward.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Any, Mapping, Optional, Union

import torch

from ..config import CacheConfig
from ..engine import RankRequest, RelayEngine
from ..models import GRModelConfig, build_ranker
from ..policy import _checks
from ..policy.latency import LatencyModel
from ..policy.trigger import SequenceAwareTrigger, TriggerConfig
from . import wire
from .metrics import EngineMetrics
from .ratio_policy import LoadWindow
from .route_key import parse_user_id

__all__ = ["ReplicaSpec", "RelayReplica", "build_app", "run", "DEPLOYMENT_NAME"]

DEPLOYMENT_NAME = "RelayReplica"


def _from(cls, name: str, value):
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"{name} has unknown fields {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**value)
    raise ValueError(f"{name} must be a {cls.__name__} or a dict of its fields, got {type(value).__name__}")


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds.

    Parameters
    ----------
    model : GRModelConfig or dict
    seed : int
        ``build_ranker`` seed (the weights when no ``state_dict_path`` is given).
    state_dict_path : str, optional
        A ``torch.save``-d ``state_dict`` loaded into the model (a path every node can read).
    cache : CacheConfig or dict
        The replica's cache; its ``device`` is where the model runs.
    trigger : TriggerConfig or dict, optional
        Pre-inference admission (:class:`~relaygr_engine.policy.trigger.SequenceAwareTrigger`); None admits every
        pre-infer the pool can take.
    latency_profile : str, optional
        The trigger's latency profile (``relaygr calibrate``); default: the profile shipped for the device type.
    torch_threads : int
        ``torch.set_num_threads`` in the replica (>= 1).
    max_pending_prefills : int, optional
        Pre-infers a replica holds at once (queued or running, >= 1); one more is rejected immediately. None: no
        bound.
    slo_ms : float
        The ranking latency objective (> 0) a replica measures its rankings against (time in the replica), for
        the live ratio policy (:mod:`~relaygr_engine.serving.ratio_policy`).
    limits : RequestLimits or dict
        What one request may hold (body bytes, JSON nesting, candidates, history entries), checked before it is
        parsed into tensors (:class:`~relaygr_engine.serving.wire.RequestLimits`; default: its defaults, with the
        history bounded by the model's ``max_seq_len``).
    """

    model: Union[GRModelConfig, dict]
    seed: int = 0
    state_dict_path: Optional[str] = None
    cache: Union[CacheConfig, dict] = CacheConfig()
    trigger: Union[TriggerConfig, dict, None] = None
    latency_profile: Optional[str] = None
    torch_threads: int = 1
    max_pending_prefills: Optional[int] = None
    slo_ms: float = 100.0
    limits: Union[wire.RequestLimits, dict] = wire.RequestLimits()

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _from(GRModelConfig, "model", self.model))
        object.__setattr__(self, "limits", _from(wire.RequestLimits, "limits", self.limits))
        object.__setattr__(self, "cache", _from(CacheConfig, "cache", self.cache))
        if self.trigger is not None:
            object.__setattr__(self, "trigger", _from(TriggerConfig, "trigger", self.trigger))
        _checks.count("seed", self.seed)
        _checks.count("torch_threads", self.torch_threads, 1)
        if self.max_pending_prefills is not None:
            _checks.count("max_pending_prefills", self.max_pending_prefills, 1)
        object.__setattr__(self, "slo_ms", _checks.number("slo_ms", self.slo_ms, low=0.0, low_open=True))
        for name in ("state_dict_path", "latency_profile"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path or None, got {type(v).__name__}")

    def to_json(self) -> dict:
        """The spec as JSON-ready fields (``ReplicaSpec(**spec.to_json())`` builds it again), e.g. for the
        arguments of a Serve config."""
        def plain(v):
            if is_dataclass(v):
                return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
            if isinstance(v, Enum):
                return v.value
            if isinstance(v, torch.dtype):
                return str(v).removeprefix("torch.")
            return os.fspath(v) if isinstance(v, os.PathLike) else v

        return plain(self)

    def build_engine(self) -> RelayEngine:
        """The model (seeded, or loaded from ``state_dict_path``), its trigger and engine, on the cache device."""
        device = self.cache.device
        model = build_ranker(self.model, seed=self.seed, device=device)
        if self.state_dict_path is not None:
            model.load_state_dict(torch.load(self.state_dict_path, map_location=device, weights_only=True))
        trigger = None
        if self.trigger is not None:
            lat = (LatencyModel.load(self.latency_profile) if self.latency_profile is not None
                   else LatencyModel.default(device))
            trigger = SequenceAwareTrigger(lat, self.trigger)
        return RelayEngine(model, self.cache, trigger)


def _replica_identity() -> tuple[str, Optional[str]]:
    """This replica's Serve ``unique_id`` and actor name, or a local id outside Serve."""
    serve = sys.modules.get("ray.serve")  # imported in every Serve replica; absent: plainly not in one
    if serve is not None:
        try:
            rid = serve.get_replica_context().replica_id
            return rid.unique_id, rid.to_full_id_str()
        except Exception:  # RayServeException: ray.serve is imported, but this is not a replica
            pass
    return f"local{os.getpid()}", None


class RelayReplica:
    """One Serve replica: a :class:`~relaygr_engine.RelayEngine` behind JSON methods and HTTP endpoints.

    Engine calls run in a worker thread (the engine serialises them under its lock), so the replica's event loop
    stays free to answer routing-stats polls and to reject pre-infers at once. Inside a Serve replica every
    request is also recorded in the Prometheus metrics of :mod:`~relaygr_engine.serving.metrics`.
    """

    def __init__(self, spec: ReplicaSpec) -> None:
        if not isinstance(spec, ReplicaSpec):
            raise ValueError(f"spec must be a ReplicaSpec, got {type(spec).__name__}")
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self.engine = spec.build_engine()
        self.device = torch.device(spec.cache.device)
        self.limits = spec.limits
        self.max_history = spec.limits.max_history or spec.model.max_seq_len
        self.replica_id, self.actor_name = _replica_identity()
        self.metrics = EngineMetrics.ray_serve() if self.actor_name is not None else None
        self._inflight_prefills = 0
        self._inflight_ranks = 0
        self._serial = threading.Lock()  # requests reach the engine one at a time; the wait before it is measured
        self.load = LoadWindow()
        self._c = {"replica_prefill_requests": 0, "replica_prefill_rejections": 0, "replica_busy_rejections": 0,
                   "replica_rank_requests": 0, "replica_foreign_tickets": 0}

    def _parse(self, body) -> tuple:
        if not isinstance(body, Mapping):
            raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
        return parse_user_id(body.get("user_id")), wire.behaviors_from_json(body, self.device, self.max_history)

    def _engine_call(self, since: float, fn, *args) -> tuple:
        """``fn(*args)`` on the engine once the replica's earlier engine calls are done, then (with metrics) its
        counters exported, in the calling thread; returns ``(result, seconds queued since `since`)``."""
        with self._serial:
            waited = time.perf_counter() - since
            out = fn(*args)
            if self.metrics is not None:
                self.metrics.record_engine(self.engine.stats())
        return out, waited

    def _record(self, kind: str, started: float, outcome: Optional[str] = None) -> None:
        """A request of ``kind`` answered: its latency and the in-flight gauge into the metrics."""
        if self.metrics is None:
            return
        latency = time.perf_counter() - started
        if kind == "prefill":
            self.metrics.record_prefill(outcome, latency)
            self.metrics.set_inflight("prefill", self._inflight_prefills)
        else:
            self.metrics.record_ranking(latency)
            self.metrics.set_inflight("rank", self._inflight_ranks)

    # ---------------------------------------------------------------------------------------- handle methods
    async def prefill(self, body: Mapping[str, Any]) -> dict:
        """Pre-infer the history of ``body`` (see :mod:`~relaygr_engine.serving.wire`); the reply's ``rejected``
        asks the caller to forward it."""
        started = time.perf_counter()
        user, history = self._parse(body)
        self._c["replica_prefill_requests"] += 1
        bound = self.spec.max_pending_prefills
        if bound is not None and self._inflight_prefills >= bound:
            self._c["replica_prefill_rejections"] += 1
            self._c["replica_busy_rejections"] += 1
            self._record("prefill", started, "busy")
            return wire.prefill_reply(None, self.replica_id, user, reason="replica:busy")
        self._inflight_prefills += 1
        try:
            ticket, waited = await asyncio.to_thread(self._engine_call, started, self.engine.prefill_prefix, user,
                                                     history)
        finally:
            self._inflight_prefills -= 1
        self.load.prefilled(waited)
        reply = wire.prefill_reply(ticket, self.replica_id, user)
        if reply["rejected"]:
            self._c["replica_prefill_rejections"] += 1
        self._record("prefill", started, "admitted" if reply["admitted"] else
                     "rejected" if reply["rejected"] else "declined")
        return reply

    async def rank(self, body: Mapping[str, Any]) -> dict:
        """Score the candidates of ``body`` over the longest prefix this replica holds (exact either way)."""
        started = time.perf_counter()
        user, history = self._parse(body)
        cands = wire.candidates_from_json(body, self.device, self.limits.max_candidates)
        ticket = None
        if body.get("ticket") is not None:
            ticket, issuer = wire.ticket_from_json(body["ticket"])
            if issuer != self.replica_id:  # issued elsewhere (the user was re-routed): it names no entry here
                self._c["replica_foreign_tickets"] += 1
                ticket = None
            elif not ticket.admitted:
                ticket = None
        t_req = body.get("request_time")
        if t_req is not None:
            t_req = _checks.count("request_time", t_req)
        req = RankRequest(user, history, cands, ticket, t_req)
        self._c["replica_rank_requests"] += 1
        self._inflight_ranks += 1
        try:
            out, waited = await asyncio.to_thread(self._engine_call, started, self.engine.rank_with_prefix_batch,
                                                  [req])
            res = out[0]
        finally:
            self._inflight_ranks -= 1
        self.load.ranked(waited, time.perf_counter() - started, self.spec.slo_ms / 1e3,
                         missed_ticket=ticket is not None and res.source == "recompute")
        self._record("rank", started)
        return wire.rank_reply(res, self.replica_id, ticket is not None)

    async def stats(self) -> dict:
        """The engine's counters (:meth:`RelayEngine.stats`), the replica's, and its id."""
        s = await asyncio.to_thread(self.engine.stats)
        s.update(self._c)
        s["replica"] = self.replica_id
        return s

    async def describe(self) -> dict:
        """The replica's id, actor name (namespace ``serve``), process id and device."""
        return {"replica": self.replica_id, "actor_name": self.actor_name, "pid": os.getpid(),
                "device": str(self.device)}

    async def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics: the :class:`~relaygr_engine.serving.ratio_policy.LoadWindow` since
        the last call (collected only when the deployment autoscales; read by
        :class:`~relaygr_engine.serving.ratio_policy.PoolRatioPolicy`)."""
        return self.load.take()

    def record_routing_stats(self) -> dict:
        """What the request router reads (polled by Serve every ``request_routing_stats_period_s``)."""
        pool = self.engine.pool
        pinned, budget = pool.num_pinned_pages, pool.max_pinned_pages
        bound = self.spec.max_pending_prefills
        busy = bound is not None and self._inflight_prefills >= bound
        return {"replica": self.replica_id, "num_pages": pool.num_pages, "free_pages": pool.num_free_pages,
                "evictable_pages": pool.num_evictable_pages, "pinned_pages": pinned, "max_pinned_pages": budget,
                "inflight_prefills": self._inflight_prefills, "inflight_ranks": self._inflight_ranks,
                "accepts_prefill": (pinned < budget) and not busy}

    # ---------------------------------------------------------------------------------------- HTTP
    async def _read_json(self, request) -> Any:
        """The request's JSON body, within ``spec.limits``: a declared or streamed size past ``max_body_bytes``
        stops the read (:class:`~relaygr_engine.serving.wire.RequestTooLarge`)."""
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise ValueError(f"Content-Length must be a byte count, got {declared!r}")
            self.limits.check_body_size(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            self.limits.check_body_size(size)
            chunks.append(chunk)
        return wire.parse_body(b"".join(chunks), self.limits)

    async def __call__(self, request):
        """``POST .../prefill``, ``POST .../rank`` (JSON bodies), ``GET .../stats``; errors are JSON
        ``{"error": ...}`` with status 413 (body past ``max_body_bytes``), 400 (other bad input, limits included)
        or 404 (unknown path)."""
        from starlette.responses import JSONResponse

        endpoint = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        try:
            if endpoint == "stats" and request.method == "GET":
                return JSONResponse(await self.stats())
            if endpoint in ("prefill", "rank") and request.method == "POST":
                body = await self._read_json(request)
                return JSONResponse(await (self.prefill(body) if endpoint == "prefill" else self.rank(body)))
        except ValueError as e:
            status = 413 if isinstance(e, wire.RequestTooLarge) else 400
            return JSONResponse({"error": str(e), "replica": self.replica_id}, status_code=status)
        return JSONResponse({"error": f"unknown endpoint {request.method} {request.url.path}; valid: POST /prefill, "
                                      "POST /rank, GET /stats"}, status_code=404)


def build_app(spec: ReplicaSpec, *, num_replicas: int = 2, num_cpus: float = 1.0, num_gpus: float = 0.0,
              load_factor: float = 1.25, stats_period_s: float = 0.5, max_ongoing_requests: int = 32,
              name: str = DEPLOYMENT_NAME):
    """The Serve application: ``num_replicas`` :class:`RelayReplica` s behind the affinity request router.

    Parameters
    ----------
    spec : ReplicaSpec
    num_replicas : int
        >= 1.
    num_cpus, num_gpus : float
        Ray resources of each replica (``num_gpus=1`` for a CUDA cache device).
    load_factor : float
        >= 1: the router's bounded-load factor (:func:`~relaygr_engine.policy.affinity.order_bounded`).
    stats_period_s : float
        How often Serve polls ``record_routing_stats`` (> 0).
    max_ongoing_requests : int
        Requests a replica holds at once (Serve's bound; a full replica is passed over, except by a ranking with
        a ticket, which waits for it).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .request_router import RelayRequestRouter

    if not isinstance(spec, ReplicaSpec):
        raise ValueError(f"spec must be a ReplicaSpec, got {type(spec).__name__}")
    _checks.count("num_replicas", num_replicas, 1)
    _checks.count("max_ongoing_requests", max_ongoing_requests, 1)
    _checks.number("num_cpus", num_cpus, low=0.0)
    _checks.number("num_gpus", num_gpus, low=0.0)
    _checks.number("load_factor", load_factor, low=1.0)
    _checks.number("stats_period_s", stats_period_s, low=0.0, low_open=True)
    router = RequestRouterConfig(request_router_class=RelayRequestRouter,
                                 request_router_kwargs={"load_factor": float(load_factor)},
                                 request_routing_stats_period_s=stats_period_s,
                                 request_routing_stats_timeout_s=max(10.0, 4 * stats_period_s))
    deployment = serve.deployment(RelayReplica, name=name).options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests, request_router_config=router,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus})
    return deployment.bind(spec)


def run(spec: ReplicaSpec, *, app_name: str = "relaygr", route_prefix: str = "/", host: str = "127.0.0.1",
        port: int = 8000, **app_options):
    """Deploy :func:`build_app` on the Ray cluster ``ray.init`` connected to and return its DeploymentHandle.

    HTTP is served at ``http://{host}:{port}{route_prefix}`` (``prefill``, ``rank``, ``stats``) when Serve starts
    here; a Serve instance already running on the cluster keeps its own HTTP options.
    """
    from ray import serve

    serve.start(http_options={"host": host, "port": int(port)})
    return serve.run(build_app(spec, **app_options), name=app_name, route_prefix=route_prefix)
