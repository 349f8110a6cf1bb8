"""Client of the Serve app: rejection-based forwarding of pre-infers and failover of rankings.

:class:`RelayClient` wraps the app's ``DeploymentHandle`` (from :func:`~relaygr_engine.serving.ray_serve.run` or
``serve.get_app_handle``). It is synchronous and thread-safe: a load generator or benchmark calls it from many
threads (it must not be called inside an asyncio event loop, e.g. from another deployment).

Pre-infer (P/D-Serve's on-demand forwarding upon rejection): the pre-infer goes out with route key ``u;prefill``;
a replica that cannot take it replies ``rejected`` at once, and the client sends it again with that replica in the
key's ``skip`` list, so the router offers it to the user's next replica, until one takes it, the router has no
replica left, or ``deadline_s`` passes. The outcome is a :class:`~relaygr_engine.policy.affinity.ForwardResult`
(where it landed, attempts, rejections, expired). A pre-infer that does not land costs the ranking only time.

Ranking: with an admitted ticket, route key ``u;at=R`` pins the ranking to replica ``R`` (its cached prefix). When
``R`` has died the router places the user anew and that replica computes the prefix: scores stay exact and the
caller sees no error. A ranking interrupted by a replica failure is sent again (``R`` skipped), until
``failover_timeout_s``. Counters: ``reroutes`` (rankings whose ticket's replica did not serve them),
``recomputes_after_failure`` (of those, the ones that recomputed the prefix), ``resends`` and ``replica_failures``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
from ray.exceptions import RayActorError

from ..models import Behaviors
from ..policy import _checks
from ..policy.affinity import ForwardResult
from . import wire
from .route_key import RouteKey, parse_user_id

__all__ = ["RelayClient", "PrefillReply", "RankReply"]

_FAILURES = (RayActorError,)  # the replica died or became unreachable (ActorDiedError, ActorUnavailableError)


@dataclass(frozen=True)
class PrefillReply:
    """Outcome of :meth:`RelayClient.prefill`.

    Attributes
    ----------
    user_id : int
    admitted : bool
        The prefix is cached on ``replica`` under a lease.
    reason : str or None
        The last replica's reason (``"admitted"``, ``"already_cached"``, ``"pool_full"``, ``"trigger:..."``,
        ``"replica:busy"``, ...); None when no replica answered.
    replica : str or None
        Where the pre-infer landed (admitted, or declined for good); None when every replica tried rejected it,
        the deadline passed or the replicas failed.
    ticket : dict or None
        The JSON ticket (with ``"replica"``) to present to :meth:`RelayClient.rank`.
    forward : ForwardResult
        Attempts, rejecting replicas, expiry.
    cached_tokens, computed_tokens : int
    """

    user_id: int
    admitted: bool
    reason: Optional[str]
    replica: Optional[str]
    ticket: Optional[dict]
    forward: ForwardResult
    cached_tokens: int = 0
    computed_tokens: int = 0


@dataclass(frozen=True, eq=False)
class RankReply:
    """Outcome of :meth:`RelayClient.rank`.

    Attributes
    ----------
    scores : Tensor [C, num_tasks]
        float32, on the CPU.
    source : str
        ``"hbm"``, ``"dram"`` or ``"recompute"`` (on ``replica``).
    cached_tokens, computed_tokens : int
    replica : str
        The replica that scored it.
    rerouted : bool
        A ticket was given but its replica did not serve the ranking (it failed or left).
    sends : int
        Times the ranking was sent (1 + resends after replica failures).
    """

    scores: torch.Tensor
    source: str
    cached_tokens: int
    computed_tokens: int
    replica: str
    rerouted: bool = False
    sends: int = 1


class RelayClient:
    """Pre-infer and rank through the Serve app's handle, with forwarding and failover.

    Parameters
    ----------
    handle : ray.serve.handle.DeploymentHandle
        The app's handle (its ingress is the :class:`~relaygr_engine.serving.ray_serve.RelayReplica` deployment).
    forward_deadline_s : float
        Default time budget (> 0) of a pre-infer's forwarding: no attempt starts after it.
    failover_timeout_s : float
        How long (> 0) a request is re-sent after replica failures before the failure is raised.
    retry_backoff_s : float
        Pause (>= 0) before re-sending after a failure (Serve needs a moment to drop a dead replica).
    clock : callable
        Seconds clock (``time.monotonic``).
    prefill_handle : DeploymentHandle, optional
        Where pre-infers go when they have a pool of their own (disaggregated serving,
        :mod:`relaygr_engine.serving.disaggregated`); default: ``handle``.
    """

    def __init__(self, handle, *, forward_deadline_s: float = 1.0, failover_timeout_s: float = 60.0,
                 retry_backoff_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 prefill_handle=None) -> None:
        self._handle = handle
        self._prefill_handle = handle if prefill_handle is None else prefill_handle
        self._forward_deadline_s = _checks.number("forward_deadline_s", forward_deadline_s, low=0.0,
                                                  low_open=True)
        self._failover_s = _checks.number("failover_timeout_s", failover_timeout_s, low=0.0, low_open=True)
        self._backoff_s = _checks.number("retry_backoff_s", retry_backoff_s, low=0.0)
        self._clock = clock
        self._lock = threading.Lock()
        self._c = {"prefills": 0, "prefill_admitted": 0, "prefill_forwarded": 0, "prefill_rejections": 0,
                   "prefill_not_landed": 0, "prefill_expired": 0, "ranks": 0, "rank_ticket_hits": 0,
                   "rank_hbm": 0, "rank_dram": 0, "rank_recompute": 0, "reroutes": 0, "recomputes_after_failure": 0,
                   "resends": 0, "replica_failures": 0}

    # ------------------------------------------------------------------------------------------ plumbing
    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._c[k] += v

    def _send(self, method: str, key: RouteKey, *args: Any) -> dict:
        handle = self._prefill_handle if method == "prefill" else self._handle
        h = handle.options(method_name=method, session_id=key.encode())
        return h.remote(*args).result()

    def _at(self, method: str, replica: str) -> dict:
        r = self._send(method, RouteKey(0, at=replica))
        if r.get("replica") != replica:
            raise KeyError(f"replica {replica!r} is not serving (the request went to {r.get('replica')!r})")
        return r

    # ------------------------------------------------------------------------------------------ API
    def prefill(self, user_id, history: Behaviors, *, deadline_s: Optional[float] = None,
                max_attempts: Optional[int] = None) -> PrefillReply:
        """Pre-infer ``history`` for the user on its replica, forwarded past replicas that reject it.

        Raises ValueError on bad input (from the replica or here); replica failures only end the forwarding.
        """
        u = parse_user_id(user_id)
        budget = self._forward_deadline_s if deadline_s is None else _checks.number(
            "deadline_s", deadline_s, low=0.0, low_open=True)
        if max_attempts is not None:
            max_attempts = _checks.count("max_attempts", max_attempts, 1)
        body = {"user_id": u, **wire.behaviors_to_json(history)}
        deadline = self._clock() + budget
        skip: list[str] = []
        reply, landed, expired, attempts, failures = None, None, False, 0, 0
        while True:
            if self._clock() >= deadline:
                expired = True
                break
            if max_attempts is not None and attempts >= max_attempts:
                break
            try:
                r = self._send("prefill", RouteKey(u, prefill=True, skip=tuple(skip)), body)
            except _FAILURES:
                failures += 1
                time.sleep(self._backoff_s)
                continue
            attempts += 1
            reply = r
            if not r["rejected"]:
                landed = r["replica"]
                break
            if r["replica"] in skip:  # the router had no replica left to offer it to
                break
            skip.append(r["replica"])
        fwd = ForwardResult(replica=landed, value=reply if landed is not None else None, attempts=attempts,
                            rejected=tuple(skip), expired=expired and landed is None)
        admitted = landed is not None and bool(reply["admitted"])
        self._count(prefills=1, prefill_admitted=int(admitted), prefill_forwarded=int(bool(skip)),
                    prefill_rejections=len(skip), prefill_not_landed=int(landed is None),
                    prefill_expired=int(fwd.expired), replica_failures=failures, resends=failures)
        return PrefillReply(user_id=u, admitted=admitted, reason=None if reply is None else reply["reason"],
                            replica=landed, ticket=reply["ticket"] if admitted else None, forward=fwd,
                            cached_tokens=int(reply["cached_tokens"]) if admitted else 0,
                            computed_tokens=int(reply["computed_tokens"]) if admitted else 0)

    def rank(self, user_id, history: Behaviors, candidates: torch.Tensor,
             ticket: Union[PrefillReply, Mapping, None] = None, request_time: Optional[int] = None) -> RankReply:
        """Score ``candidates``; with an admitted ticket, on the replica holding the prefix while it lives.

        Exact scores whatever happened to the prefix (the serving replica recomputes what it lacks). Raises
        ValueError on bad input, and the replica failure when none served it within ``failover_timeout_s``.
        """
        u = parse_user_id(user_id)
        if isinstance(ticket, PrefillReply):
            ticket = ticket.ticket
        if ticket is not None and not isinstance(ticket, Mapping):
            raise ValueError(f"ticket must be a PrefillReply, a JSON ticket dict or None, got {type(ticket).__name__}")
        if not isinstance(candidates, torch.Tensor):
            raise ValueError(f"candidates must be a 1-D int64 tensor, got {type(candidates).__name__}")
        body = {"user_id": u, **wire.behaviors_to_json(history), "candidates": candidates.detach().cpu().tolist()}
        if request_time is not None:
            body["request_time"] = _checks.count("request_time", request_time)
        home = None
        if ticket is not None and ticket.get("admitted"):
            body["ticket"] = dict(ticket)
            home = ticket.get("replica")
        key = RouteKey(u, at=home)
        end = self._clock() + self._failover_s
        sends = 0
        while True:
            sends += 1
            try:
                r = self._send("rank", key, body)
                break
            except _FAILURES:
                self._count(replica_failures=1, resends=1)
                if self._clock() >= end:
                    raise
                # the replica died while serving it: when it was the ticket's, re-route the user past it
                skip = key.skip + ((key.at,) if key.at is not None else ())
                key = RouteKey(u, skip=skip)
                time.sleep(self._backoff_s)
        rerouted = home is not None and r["replica"] != home
        self._count(ranks=1, rank_ticket_hits=int(home is not None and not rerouted), reroutes=int(rerouted),
                    recomputes_after_failure=int(rerouted and r["source"] == "recompute"),
                    **{f"rank_{r['source']}": 1})
        return RankReply(scores=torch.tensor(r["scores"], dtype=torch.float32), source=r["source"],
                         cached_tokens=int(r["cached_tokens"]), computed_tokens=int(r["computed_tokens"]),
                         replica=r["replica"], rerouted=rerouted, sends=sends)

    def replica_stats(self, replica: str) -> dict:
        """Engine and replica counters of one replica (routed there by id; KeyError if it is gone)."""
        return self._at("stats", replica)

    def describe(self, replica: str) -> dict:
        """Id, actor name (namespace ``serve``), pid and device of one replica."""
        return self._at("describe", replica)

    def stats(self) -> dict:
        """The client's counters: ``prefills``, ``prefill_admitted``, ``prefill_forwarded`` (needed more than one
        replica), ``prefill_rejections``, ``prefill_not_landed``, ``prefill_expired``, ``ranks``,
        ``rank_ticket_hits``, ``rank_hbm`` / ``rank_dram`` / ``rank_recompute`` (by source), ``reroutes``,
        ``recomputes_after_failure``, ``resends``, ``replica_failures``."""
        with self._lock:
            return dict(self._c)
