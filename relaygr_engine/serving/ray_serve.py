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
import time
from typing import Any, Mapping, Optional

import torch

from ..engine import RankRequest, RankResult
from ..policy import _checks
from . import http_ingress, wire
from .chunked_prefill import WholePrefixTrigger, chunk_targets
from .gate import EngineGate
from .metrics import EngineMetrics
from .prefix_store import PrefixStore
from .ratio_policy import LoadWindow
from .replica_spec import ReplicaSpec
from .route_key import parse_user_id

__all__ = ["ReplicaSpec", "RelayReplica", "build_app", "run", "DEPLOYMENT_NAME"]

DEPLOYMENT_NAME = "RelayReplica"


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

    Engine calls go one at a time through the replica's :class:`~relaygr_engine.serving.gate.EngineGate`
    (rankings before pre-infers, a pre-infer superseded by its user's ranking dropped). Pre-infers run in a worker
    thread, so the replica's event loop stays free to answer routing-stats polls and to reject pre-infers at once;
    a ranking that presents this replica's ticket (its prefix cached: a short call) and finds the engine free runs
    in the event loop's thread (no hop to a worker: about 0.5 ms less on the shared 2-core VM), every other one in
    a worker thread. The prefixes of its leased tickets are kept (:mod:`~relaygr_engine.serving.prefix_store`)
    for rankings that send only the behaviors after them. Inside a Serve replica every request is also recorded in
    the Prometheus metrics of :mod:`~relaygr_engine.serving.metrics`.
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
        self.gate = EngineGate()
        self.prefixes = PrefixStore(spec.max_kept_prefixes)
        self.load = LoadWindow()
        self._c = {"replica_prefill_requests": 0, "replica_prefill_rejections": 0, "replica_busy_rejections": 0,
                   "replica_rank_requests": 0, "replica_foreign_tickets": 0, "replica_delta_rankings": 0,
                   "replica_full_inference_rankings": 0}

    def _parse(self, body) -> tuple:
        if not isinstance(body, Mapping):
            raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
        return parse_user_id(body.get("user_id")), wire.behaviors_from_json(body, self.device, self.max_history)

    def _ranking(self, user: int, fn, *args) -> tuple:
        """``fn(*args)`` on the engine once the gate admits the ranking, then the engine's counters exported (with
        metrics), in the calling (worker) thread; ``(result, seconds waited, seconds in the engine)``."""
        with self.gate.ranking(user) as waited:
            t0 = time.perf_counter()
            out = fn(*args)
            engine_s = time.perf_counter() - t0
        self._export_engine()
        return out, waited, engine_s

    def _ranking_now(self, fn, *args) -> tuple:
        """``fn(*args)`` on the engine the gate gave this ranking (:meth:`EngineGate.try_ranking`), in the event
        loop's thread; the counters are exported by a worker thread, off the reply's path."""
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        finally:
            self.gate.release()
        engine_s = time.perf_counter() - t0
        asyncio.get_running_loop().run_in_executor(None, self._export_engine)
        return out, 0.0, engine_s

    def _export_engine(self) -> None:
        if self.metrics is not None:
            self.metrics.record_engine(self.engine.stats())

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
    async def prefill(self, body: Mapping[str, Any], timing: Optional[dict] = None) -> dict:
        """Pre-infer the history of ``body`` (see :mod:`~relaygr_engine.serving.wire`); the reply's ``rejected``
        asks the caller to forward it. ``timing`` (optional) receives the seconds of each stage."""
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
        parsed = time.perf_counter()
        try:
            ticket, waited, engine_s = await asyncio.to_thread(self._prefill_chunks, user, history)
        finally:
            self._inflight_prefills -= 1
        if ticket is None:  # its ranking arrived first: the ranking computes what it needs
            self._record("prefill", started, "superseded")
            return wire.prefill_reply(None, self.replica_id, user, reason="superseded")
        self.load.prefilled(waited)
        if ticket.admitted:
            self.prefixes.keep(ticket, history, time.monotonic())
        reply = wire.prefill_reply(ticket, self.replica_id, user)
        if reply["rejected"]:
            self._c["replica_prefill_rejections"] += 1
        self._record("prefill", started, "admitted" if reply["admitted"] else
                     "rejected" if reply["rejected"] else "declined")
        _timed(timing, parse=parsed - started, queue=waited, engine=engine_s)
        return reply

    def _prefill_chunks(self, user: int, history) -> tuple:
        """Pre-infer ``history`` in chunks of ``spec.prefill_chunk_tokens`` (one call when 0), each through the
        gate, in the calling (worker) thread; ``(last ticket or None when superseded, seconds waited, seconds in
        the engine)``. The engine's counters are exported once, at the end."""
        chunk, trig = self.spec.prefill_chunk_tokens, self.engine.trigger
        cached = self.engine.match_length(user, history) - history.num_context_tokens if chunk else 0
        whole = trig.open(history.num_tokens) if isinstance(trig, WholePrefixTrigger) else None
        ticket, waited, engine_s = None, 0.0, 0.0
        try:
            for n in chunk_targets(cached, len(history), chunk):
                part = history if n == len(history) else history.prefix(n)
                with self.gate.prefill(user) as (go, w):
                    waited += w
                    if not go:   # its ranking arrived before this chunk
                        return None, waited, engine_s
                    t0 = time.perf_counter()
                    ticket = self._prefill_one(user, part, whole)
                    engine_s += time.perf_counter() - t0
                if not ticket.admitted:
                    break
        finally:
            if whole is not None:
                trig.close(whole)
            self._export_engine()
        return ticket, waited, engine_s

    def _prefill_one(self, user: int, history, whole):
        if whole is None:
            return self.engine.prefill_prefix(user, history)
        with self.engine.trigger.chunk(whole):
            return self.engine.prefill_prefix(user, history)

    async def rank(self, body: Mapping[str, Any], timing: Optional[dict] = None) -> dict:
        """Score the candidates of ``body`` over the longest prefix this replica holds (exact either way); with
        ``"full_inference": true`` by full inference, the cache neither read nor written (an A/B baseline).

        Raises :class:`~relaygr_engine.serving.wire.NeedFullHistory` (HTTP 409) for a ranking by difference whose
        prefix this replica does not hold, before anything changes."""
        started = time.perf_counter()
        user, sent = self._parse(body)
        cands = wire.candidates_from_json(body, self.device, self.limits.max_candidates)
        encoding = wire.encoding_of(body)
        ref = wire.prefix_ref_from_json(body)
        ticket = self._ticket(body)
        t_req = body.get("request_time")
        if t_req is not None:
            t_req = _checks.count("request_time", t_req)
        full = body.get("full_inference", False)
        if not isinstance(full, bool) or (full and (ref is not None or body.get("ticket") is not None)):
            raise ValueError(f"full_inference must be true or false, and true without a ticket or prefix, got "
                             f"{full!r}")
        history = sent if ref is None else self._rebuild(ticket, ref, sent)
        self._c["replica_rank_requests"] += 1
        self._inflight_ranks += 1
        parsed = time.perf_counter()
        try:
            if full:
                self._c["replica_full_inference_rankings"] += 1
                fn, args = self._full_inference, (history, cands, t_req)
            else:
                fn, args = self.engine.rank_with_prefix_batch, ([RankRequest(user, history, cands, ticket, t_req)],)
            # a ranking on a prefix this replica holds (a ticket of its own) is short: when the engine is free it
            # runs here, without a hop to a worker thread; one that may compute a whole history does not block the
            # event loop
            if ticket is not None and self.gate.try_ranking(user):
                out, waited, engine_s = self._ranking_now(fn, *args)
            else:
                out, waited, engine_s = await asyncio.to_thread(self._ranking, user, fn, *args)
            res = out[0]
        finally:
            self._inflight_ranks -= 1
        if ticket is not None:
            self.prefixes.forget(ticket)
        self.load.ranked(waited, time.perf_counter() - started, self.spec.slo_ms / 1e3,
                         missed_ticket=ticket is not None and res.source == "recompute")
        self._record("rank", started)
        _timed(timing, parse=parsed - started, queue=waited, engine=engine_s)
        return wire.rank_reply(res, self.replica_id, ticket is not None, encoding)

    def _ticket(self, body: Mapping[str, Any]):
        """The request's admitted ticket of this replica, or None (none sent, not admitted, or another replica's)."""
        if body.get("ticket") is None:
            return None
        ticket, issuer = wire.ticket_from_json(body["ticket"])
        if issuer != self.replica_id:  # issued elsewhere (the user was re-routed): it names no entry here
            self._c["replica_foreign_tickets"] += 1
            return None
        return ticket if ticket.admitted else None

    def _rebuild(self, ticket, ref: tuple, sent):
        """The whole history of a ranking by difference (NeedFullHistory when this replica lacks its prefix)."""
        if ticket is None:
            raise wire.NeedFullHistory("the ranking's ticket names no prefix of this replica: send the whole "
                                       "history", "unknown_ticket")
        history = self.prefixes.rebuild(ticket, ref[0], ref[1], sent, time.monotonic())
        if len(history) > self.max_history:
            raise ValueError(f"the history must hold at most max_history={self.max_history} behaviors, got "
                             f"{len(history)}")
        self._c["replica_delta_rankings"] += 1
        return history

    def _full_inference(self, history, candidates, request_time) -> list:
        """Full inference without the cache (``model.rank_uncached``), as a one-element result list."""
        with torch.inference_mode():
            scores = self.engine.model.rank_uncached(history, candidates, request_time=request_time)
        return [RankResult(scores=scores, source="full", cached_tokens=0, computed_tokens=history.num_tokens)]

    async def stats(self) -> dict:
        """The engine's counters (:meth:`RelayEngine.stats`), the replica's, its gate's and prefix store's, and its
        id."""
        s = await asyncio.to_thread(self.engine.stats)
        s.update(self._c, **self.gate.stats(), **self.prefixes.stats())
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

    async def __call__(self, request):
        """``POST .../prefill``, ``POST .../rank``, ``GET .../stats`` (:mod:`~relaygr_engine.serving.http_ingress`)."""
        return await http_ingress.handle(self, request)


def _timed(timing: Optional[dict], **stages: float) -> None:
    if timing is not None:
        timing.update(stages)


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
