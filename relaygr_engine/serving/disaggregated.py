"""Disaggregated relay serving on Ray Serve: a pre-infer pool and a ranking pool as two deployments.

::

    from relaygr_engine.serving.disaggregated import run_disaggregated
    rank, prefill = run_disaggregated(spec, prefill_replicas=1, rank_replicas=2)
    client = RelayClient(rank, prefill_handle=prefill)
    pre = client.prefill(7, hist_prefix)       # computed on a pre-infer replica, handed to 7's ranking replica
    res = client.rank(7, hist, cands, ticket=pre)   # that ranking replica: source "hbm"

A pre-infer replica (:class:`PrefillReplica`) computes the user's prefix KV on its engine (its trigger decides;
its cache keeps the prefix, evictable, so the user's next pre-infer computes only new tokens), packs all layers
into one contiguous buffer (``RelayEngine.export_prefix``) and puts it in Ray's object store (``ray.put``: on one
node readers map it without a copy, across nodes Ray's object transfer moves it). It then hands the reference to
the ranking replica the affinity router picks for the user (``receive``, route key ``u;prefill``); that replica
(:class:`RankReplica`) fetches the buffer and unpacks it into its pages under a lease
(``RelayEngine.import_prefix``), so the user's ranking reads it as a device-cache hit. Buffers stay on the host:
a CUDA cache packs on the device and moves the buffer to host memory first (Ray's GPU tensor transports serve actor
methods, not Serve handles).

Both pools reject when full: a pre-infer replica at ``max_pending_prefills`` rejects at once (the client forwards
down the user's pre-infer replicas until its deadline, as in co-located serving), and a ranking replica whose
leases cannot hold the prefix, or that is at its bound of pending hand-overs, rejects the hand-over (the pre-infer
replica forwards it down the user's ranking replicas until ``handover_deadline_s``). A prefix that lands nowhere,
or whose buffer is lost (its pre-infer replica died), is not admitted: the ranking computes it, exact, and the
replicas count it (``handover_failed``, ``receive_failed``).

The ranking pool is the HTTP ingress (``POST /rank``, ``GET /stats``; ``POST /prefill`` is passed on to the
pre-infer pool). :func:`build_disaggregated_app` takes each pool's Serve autoscaling config
(:mod:`relaygr_engine.policy.ratio` derives them from measured service rates).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping, Optional

from ..policy import _checks
from . import wire
from .ray_serve import RelayReplica, ReplicaSpec
from .route_key import RouteKey

__all__ = ["PrefillReplica", "RankReplica", "build_disaggregated_app", "run_disaggregated", "pool_autoscaling",
           "app_from_args", "PREFILL_DEPLOYMENT", "RANK_DEPLOYMENT", "BUILDER_PATH"]

PREFILL_DEPLOYMENT = "RelayPrefill"
RANK_DEPLOYMENT = "RelayRank"
BUILDER_PATH = "relaygr_engine.serving.disaggregated:app_from_args"


class _OnNode:
    """Adds the Ray node to a replica's ``describe``."""

    async def describe(self) -> dict:
        """:meth:`RelayReplica.describe` plus the Ray node it runs on."""
        import ray
        return dict(await super().describe(), node_id=ray.get_runtime_context().get_node_id())


class RankReplica(_OnNode, RelayReplica):
    """A ranking-pool replica: a :class:`~relaygr_engine.serving.ray_serve.RelayReplica` that also receives
    prefixes packed by the pre-infer pool.

    Parameters
    ----------
    spec : ReplicaSpec
        Its ``max_pending_prefills`` bounds the hand-overs it holds at once.
    prefill_handle : DeploymentHandle, optional
        The pre-infer pool, for HTTP ``POST /prefill`` on this ingress.
    """

    def __init__(self, spec: ReplicaSpec, prefill_handle=None) -> None:
        super().__init__(spec)
        self._prefill_handle = prefill_handle
        self._c.update(replica_receives=0, replica_receive_rejections=0, receive_failed=0)

    async def receive(self, body: Mapping[str, Any]) -> dict:
        """Store a prefix a pre-infer replica packed: ``body`` has the user, the prefix's behaviors and ``kv``,
        a one-element list holding the ObjectRef of its :class:`~relaygr_engine.engine.transfer.PackedPrefix`.
        The reply is a pre-infer reply (:func:`~relaygr_engine.serving.wire.prefill_reply`) naming this replica."""
        import ray

        user, history = self._parse(body)
        refs = body.get("kv")
        if not (isinstance(refs, list) and len(refs) == 1 and isinstance(refs[0], ray.ObjectRef)):
            raise ValueError(f"kv must be a one-element list holding an ObjectRef, got {type(refs).__name__}")
        self._c["replica_receives"] += 1
        bound = self.spec.max_pending_prefills
        if bound is not None and self._inflight_prefills >= bound:
            self._c["replica_receive_rejections"] += 1
            return wire.prefill_reply(None, self.replica_id, user, reason="replica:busy")
        self._inflight_prefills += 1
        try:
            try:
                packed = await refs[0]
            except ray.exceptions.RayError:  # the buffer is gone (its owner, the pre-infer replica, died)
                self._c["receive_failed"] += 1
                return wire.prefill_reply(None, self.replica_id, user, reason="transfer_failed")
            ticket = await asyncio.to_thread(self.engine.import_prefix, history, packed)
        finally:
            self._inflight_prefills -= 1
        if ticket.admitted:
            self.prefixes.keep(ticket, history, time.monotonic())
        reply = wire.prefill_reply(ticket, self.replica_id, user)
        if reply["rejected"]:
            self._c["replica_receive_rejections"] += 1
        return reply

    async def prefill(self, body: Mapping[str, Any], timing: Optional[dict] = None) -> dict:
        """HTTP ``POST /prefill`` on the ingress: passed on to the pre-infer pool (one attempt; the client
        forwards)."""
        if self._prefill_handle is None:
            return await super().prefill(body, timing)
        user, _ = self._parse(body)
        key = RouteKey(user, prefill=True)
        return await self._prefill_handle.options(method_name="prefill", session_id=key.encode()).remote(dict(body))


class PrefillReplica(_OnNode, RelayReplica):
    """A pre-infer-pool replica: pre-infer (as a :class:`~relaygr_engine.serving.ray_serve.RelayReplica`, with its
    bound and trigger), pack, and hand the buffer to the user's ranking replica.

    Parameters
    ----------
    spec : ReplicaSpec
        The engine (with its trigger) and ``max_pending_prefills``.
    rank_deployment, app_name : str
        Where the ranking pool is (its handle is looked up on first use).
    handover_deadline_s : float
        How long (> 0) a hand-over is forwarded down the user's ranking replicas.
    """

    def __init__(self, spec: ReplicaSpec, rank_deployment: str = RANK_DEPLOYMENT, app_name: str = "relaygr",
                 handover_deadline_s: float = 1.0) -> None:
        self.deadline_s = _checks.number("handover_deadline_s", handover_deadline_s, low=0.0, low_open=True)
        super().__init__(spec)
        self._rank_name, self._app = rank_deployment, app_name
        self._rank = None
        self._c.update(handovers=0, handover_forwarded=0, handover_failed=0, handover_bytes=0)

    def _rank_handle(self):
        if self._rank is None:
            from ray import serve
            self._rank = serve.get_deployment_handle(self._rank_name, app_name=self._app)
        return self._rank

    async def prefill(self, body: Mapping[str, Any], timing: Optional[dict] = None) -> dict:
        """Pre-infer ``body``'s history and hand it to the user's ranking replica; the reply's ``ticket`` names
        that replica, ``rejected`` asks the caller to forward to another pre-infer replica."""
        reply = await super().prefill(body, timing)
        if not reply["admitted"]:
            return reply
        user, history = self._parse(body)
        ticket, _ = wire.ticket_from_json(reply["ticket"])
        packed = await asyncio.to_thread(self.engine.export_prefix, ticket, history)
        if packed is None:  # evicted since: nothing to ship (the ranking computes it)
            return wire.prefill_reply(None, self.replica_id, user, reason="evicted_before_pack")
        return await self._hand_over(user, body, packed)

    async def rank(self, body: Mapping[str, Any], timing: Optional[dict] = None) -> dict:
        raise ValueError("the pre-infer pool does not rank: send rankings to the ranking pool")

    async def _hand_over(self, user: int, body: Mapping[str, Any], packed) -> dict:
        import ray

        ref = ray.put(packed.to("cpu") if packed.kv.device.type != "cpu" else packed)
        msg = {"user_id": user, **{k: body[k] for k in ("item_ids", "action_ids", "timestamps", "context_ids")
                                   if body.get(k) is not None}, "kv": [ref]}
        self._c["handovers"] += 1
        self._c["handover_bytes"] += packed.nbytes
        end, skip, reply = time.monotonic() + self.deadline_s, [], None
        while time.monotonic() < end:
            key = RouteKey(user, prefill=True, skip=tuple(skip))
            r = await self._rank_handle().options(method_name="receive", session_id=key.encode()).remote(msg)
            if not r["rejected"]:
                reply = r
                break
            if r["replica"] in skip:  # no ranking replica left to offer it to
                break
            skip.append(r["replica"])
        self._c["handover_forwarded"] += int(bool(skip))
        self.load.handed_over(landed=reply is not None and reply["admitted"])
        if reply is None or not reply["admitted"]:
            self._c["handover_failed"] += 1
            reason = "rank_pool_full" if reply is None else reply["reason"]
            return dict(wire.prefill_reply(None, self.replica_id, user, reason=reason), rejected=False)
        return dict(reply, replica=self.replica_id, rank_replica=reply["replica"])


def pool_autoscaling(total: int, rates, *, slack: int = 1) -> tuple[dict, dict]:
    """Each pool's Serve ``autoscaling_config`` from measured service rates: the split of ``total`` replicas that
    balances the pools (:func:`relaygr_engine.policy.ratio.split`), each pool free to move ``slack`` around it.

    Returns ``(pre-infer pool config, ranking pool config)`` for :func:`build_disaggregated_app`. To move replicas
    between the pools online from live measurements, deploy with ``run_disaggregated(..., ratio_control={...})``
    instead (:mod:`~relaygr_engine.serving.ratio_policy`).
    """
    from ..policy.ratio import autoscaling_config, split

    n_p, n_d = split(total, rates)
    return (autoscaling_config(n_p, rates.prefill_rate, slack=slack),
            autoscaling_config(n_d, rates.rank_rate, slack=slack))


def build_disaggregated_app(spec: ReplicaSpec, *, prefill_replicas: int = 1, rank_replicas: int = 2,
                            app_name: str = "relaygr", num_cpus: float = 1.0, num_gpus: float = 0.0,
                            prefill_resources: Optional[dict] = None, rank_resources: Optional[dict] = None,
                            prefill_autoscaling: Optional[dict] = None, rank_autoscaling: Optional[dict] = None,
                            load_factor: float = 1.25, stats_period_s: float = 0.5, max_ongoing_requests: int = 32,
                            handover_deadline_s: float = 1.0):
    """The Serve application: the ranking pool (ingress) and the pre-infer pool, each behind the affinity router.

    ``*_resources``: custom Ray resources of each pool's replicas (e.g. to place the pools on different nodes);
    ``*_autoscaling``: a Serve ``autoscaling_config`` dict for the pool (then its replica count is the
    autoscaler's, starting from ``*_replicas``).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .request_router import RelayRequestRouter

    if not isinstance(spec, ReplicaSpec):
        raise ValueError(f"spec must be a ReplicaSpec, got {type(spec).__name__}")
    _checks.count("prefill_replicas", prefill_replicas, 1)
    _checks.count("rank_replicas", rank_replicas, 1)
    _checks.count("max_ongoing_requests", max_ongoing_requests, 1)
    _checks.number("load_factor", load_factor, low=1.0)
    _checks.number("stats_period_s", stats_period_s, low=0.0, low_open=True)
    for name, value in (("prefill_resources", prefill_resources), ("rank_resources", rank_resources),
                        ("prefill_autoscaling", prefill_autoscaling), ("rank_autoscaling", rank_autoscaling)):
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a dict or None, got {type(value).__name__}")
    router = RequestRouterConfig(request_router_class=RelayRequestRouter,
                                 request_router_kwargs={"load_factor": float(load_factor)},
                                 request_routing_stats_period_s=stats_period_s,
                                 request_routing_stats_timeout_s=max(10.0, 4 * stats_period_s))

    def pool(cls, name, replicas, resources, autoscaling):
        opts = dict(max_ongoing_requests=max_ongoing_requests, request_router_config=router,
                    ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus,
                                       "resources": dict(resources or {})})
        if autoscaling is not None:
            opts["autoscaling_config"] = dict({"initial_replicas": replicas}, **autoscaling)
        else:
            opts["num_replicas"] = replicas
        return serve.deployment(cls, name=name).options(**opts)

    prefill = pool(PrefillReplica, PREFILL_DEPLOYMENT, prefill_replicas, prefill_resources, prefill_autoscaling)
    rank = pool(RankReplica, RANK_DEPLOYMENT, rank_replicas, rank_resources, rank_autoscaling)
    return rank.bind(spec, prefill.bind(spec, RANK_DEPLOYMENT, app_name, handover_deadline_s))


def app_from_args(args: Mapping[str, Any]):
    """Serve application builder for configs (import path :data:`BUILDER_PATH`): ``args`` holds ``spec``
    (:meth:`ReplicaSpec.to_json` fields) and ``options`` (keywords of :func:`build_disaggregated_app`)."""
    if not isinstance(args, Mapping) or not isinstance(args.get("spec"), Mapping):
        raise ValueError(f"args must be a dict with a 'spec' dict, got {args!r}")
    return build_disaggregated_app(ReplicaSpec(**args["spec"]), **dict(args.get("options") or {}))


def run_disaggregated(spec: ReplicaSpec, *, app_name: str = "relaygr", route_prefix: str = "/",
                      host: str = "127.0.0.1", port: int = 8000, ratio_control: Optional[Mapping[str, Any]] = None,
                      deploy_timeout_s: float = 300.0, **app_options):
    """Deploy :func:`build_disaggregated_app`; returns ``(ranking pool handle, pre-infer pool handle)``.

    ``ratio_control``: keywords of :class:`~relaygr_engine.serving.ratio_policy.PoolRatioPolicy` (``{}`` for its
    defaults): the live ratio policy then moves replicas between the pools (each pool's autoscaling config
    defaults to :func:`~relaygr_engine.serving.ratio_policy.pool_autoscaling_config`). Serve takes such a policy
    from a config only, so the app is then deployed from a Serve config, as ``serve deploy`` would: like it, this
    replaces the other apps on the cluster that were deployed from a config.
    """
    from ray import serve

    if ratio_control is None:  # bad options raise before Serve starts
        app = build_disaggregated_app(spec, app_name=app_name, **app_options)
        deploy = lambda: serve.run(app, name=app_name, route_prefix=route_prefix)  # noqa: E731
    else:
        deploy = _config_deploy(spec, app_name, route_prefix, ratio_control, deploy_timeout_s, app_options)
    serve.start(http_options={"host": host, "port": int(port)})
    return deploy(), serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name=app_name)


def _config_deploy(spec: ReplicaSpec, app_name: str, route_prefix: str, ratio_control: Mapping[str, Any],
                   timeout_s: float, app_options: dict):
    """Check everything, then return the function that deploys the app from a Serve config with the live ratio
    policy and waits (up to ``timeout_s``) until it runs."""
    import json

    from .ratio_policy import POLICY_PATH, PoolRatioPolicy, pool_autoscaling_config

    if not isinstance(ratio_control, Mapping):
        raise ValueError(f"ratio_control must be a dict of PoolRatioPolicy keywords, got "
                         f"{type(ratio_control).__name__}")
    _checks.number("deploy_timeout_s", timeout_s, low=0.0, low_open=True)
    kwargs = dict({"prefill_deployment": PREFILL_DEPLOYMENT, "rank_deployment": RANK_DEPLOYMENT}, **ratio_control)
    policy = PoolRatioPolicy.from_options(kwargs)  # checks the keywords
    options = dict(app_options, app_name=app_name)
    build_disaggregated_app(spec, **options)  # every option checked before Serve starts
    n_p, n_d = options.get("prefill_replicas", 1), options.get("rank_replicas", 2)
    for pool, n in (("prefill", n_p), ("rank", n_d)):
        if options.get(f"{pool}_autoscaling") is None:
            options[f"{pool}_autoscaling"] = pool_autoscaling_config(n, n_p + n_d, window_s=policy.window_s)
    args = {"spec": spec.to_json(), "options": options}
    try:
        json.dumps([args, kwargs])
    except (TypeError, ValueError) as e:
        raise ValueError(f"with ratio_control the spec and options go into a Serve config and must be JSON: {e}") \
            from None

    def deploy():
        from ray import serve
        from ray.serve._private.api import serve_start  # the client that `serve deploy` and `serve run` use
        from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

        app = ServeApplicationSchema(name=app_name, route_prefix=route_prefix, import_path=BUILDER_PATH, args=args,
                                     autoscaling_policy={"policy_function": POLICY_PATH, "policy_kwargs": kwargs})
        serve_start().deploy_apps(ServeDeploySchema(applications=[app]))
        end = time.monotonic() + timeout_s
        while True:
            status = serve.status().applications.get(app_name)
            if status is not None and status.status == "RUNNING":
                return serve.get_app_handle(app_name)
            if status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"Serve could not deploy {app_name!r}: {status.message}")
            if time.monotonic() > end:
                raise TimeoutError(f"{app_name!r} was not running after {timeout_s:g} s "
                                   f"({status.status if status else 'not listed'})")
            time.sleep(0.25)

    return deploy
