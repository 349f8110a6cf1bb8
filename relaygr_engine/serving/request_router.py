"""The Serve request router: a user's pre-infer and ranking land on the same replica.

:class:`RelayRequestRouter` reads the request's route key (its Serve session id, see
:mod:`relaygr_engine.serving.route_key`) and offers the request to replicas in :func:`route_order`: rendezvous order of
the user (the same :func:`~relaygr_engine.policy.affinity.rank_replicas` as the in-process ``AffinityRouter``), with
bounded load from the replicas' reported stats (``record_routing_stats``), pre-infers passing over replicas that
report they cannot take one, and a ranking with a ticket pinned to the ticket's replica while it is alive.

Each replica is its own tier of :meth:`choose_replicas`, so Serve tries them strictly in that order (a replica at
``max_ongoing_requests`` is passed over) and backs off before trying the order again. A replica that dies leaves the
candidate set: its users fall to their next replica (rendezvous moves no one else), and their rankings recompute
there.

Routers run in every process that holds a handle (the HTTP proxy, drivers); they are stateless apart from the
replica set, so all of them place a user alike. The module is imported on those processes by name
(``relaygr_engine.serving.request_router``): the package must be installed there.
"""
from __future__ import annotations

import logging
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..policy import _checks
from .route_key import RouteKey, route_order

__all__ = ["RelayRequestRouter"]

_log = logging.getLogger(__name__)


class RelayRequestRouter(RequestRouter):
    """Affinity request router (rendezvous + bounded load) over replica-reported stats.

    ``request_router_kwargs``: ``load_factor`` (float >= 1, default 1.25).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._load_factor = 1.25
        self._warned_keys = False

    def initialize_state(self, load_factor: float = 1.25, **kwargs) -> None:
        if kwargs:
            raise ValueError(f"RelayRequestRouter takes only load_factor, got {sorted(kwargs)}")
        self._load_factor = _checks.number("load_factor", load_factor, low=1.0)

    def _key(self, pending_request: Optional[PendingRequest]) -> Optional[RouteKey]:
        sid = "" if pending_request is None else pending_request.metadata.session_id
        if not sid:
            return None
        try:
            return RouteKey.parse(sid)
        except ValueError as e:
            if not self._warned_keys:
                self._warned_keys = True
                _log.warning("requests without a valid route key are routed without affinity: %s", e)
            return None

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # sleep between passes over the order
        key = self._key(pending_request)
        if key is None:  # no route key: any replica, shortest queue first
            return [list(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        stats = {rid: r.routing_stats for rid, r in by_id.items()}
        order = route_order(key, list(by_id), stats, self._load_factor)
        return [[by_id[rid]] for rid in order]
