"""Affinity-aware routing: a user's pre-inference and ranking land on the same replica.

The pre-inferred prefix lives on one replica, so the ranking request must reach that replica, and the choice has to
be made early (at retrieval, before the ranking instance is otherwise known). Routing is therefore a pure function
of the user id: rendezvous (highest-random-weight) hashing ranks the replicas per user by a stable 64-bit hash of
``(user_id, replica_id)``; the user's home is the top-ranked replica. Removing a replica moves only the users it
owned; adding one moves about ``1/(N+1)`` of them.

Bounded load (consistent hashing with bounded loads, Mirrokni et al.): a replica is skipped for the user's
next-ranked one when placing the request would take it above ``ceil(load_factor * mean)``, the mean in-flight count
per replica counting the request being placed. With ``load_factor >= 1`` some replica is always under the cap.

Rejection-based forwarding (P/D-Serve): instead of trusting periodic queue reports, the router offers a pre-infer to
the user's replicas in rank order; a replica that cannot take it (pool or load bound) rejects at once and the next
one is tried, until one accepts or the deadline passes. The result records where the prefix landed; the ticket the
pre-infer returns then carries that replica to the ranking request (:meth:`AffinityRouter.route_ranking`).

The ranking logic is plain functions (:func:`rank_replicas`, :func:`order_bounded`, :func:`pick_bounded`) so the
Ray Serve request router uses the same code.
"""
from __future__ import annotations

import hashlib
import math
import operator
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from . import _checks

__all__ = ["replica_weight", "rank_replicas", "load_cap", "order_bounded", "pick_bounded", "ForwardResult",
           "AffinityRouter"]


def _encode(name: str, value) -> bytes:
    """Type-tagged bytes of an id: equal ids of one type hash alike in every process (no ``hash()`` salt)."""
    if isinstance(value, str):
        return b"s" + value.encode("utf-8")
    if isinstance(value, bytes):
        return b"b" + value
    if not isinstance(value, bool):
        try:
            return b"i" + str(operator.index(value)).encode("ascii")
        except TypeError:
            pass
    raise ValueError(f"{name} must be an int, str or bytes, got {type(value).__name__} {value!r}")


def _weight(user: bytes, replica: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(len(user).to_bytes(4, "little"))  # length prefix: (user, replica) pairs never collide by concatenation
    h.update(user)
    h.update(replica)
    return int.from_bytes(h.digest(), "little")


def replica_weight(user_id, replica_id) -> int:
    """Stable 64-bit rendezvous weight of ``replica_id`` for ``user_id`` (blake2b; ids are ints, strs or bytes)."""
    return _weight(_encode("user_id", user_id), _encode("replica_id", replica_id))


def rank_replicas(user_id, replica_ids: Iterable) -> list:
    """The user's replicas, most preferred first (highest rendezvous weight; ties by the encoded id).

    Raises ValueError on a duplicate replica id.
    """
    u = _encode("user_id", user_id)
    keyed = []
    seen = set()
    for r in replica_ids:
        rb = _encode("replica_id", r)
        if rb in seen:
            raise ValueError(f"replica_ids must be distinct, got {r!r} twice")
        seen.add(rb)
        keyed.append((-_weight(u, rb), rb, r))
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [r for _, _, r in keyed]


def load_cap(total_inflight: int, num_replicas: int, load_factor: float) -> int:
    """Most requests a replica may hold once the next one is placed: ``ceil(load_factor * (total + 1) / n)``."""
    total = _checks.count("total_inflight", total_inflight)
    n = _checks.count("num_replicas", num_replicas, 1)
    c = _checks.number("load_factor", load_factor, low=1.0)
    # The small slack keeps a product like 1.1 * 10 / 10 = 1.1000000000000001 from rounding an exact cap up.
    return max(1, math.ceil(c * (total + 1) / n - 1e-9))


def _inflight_of(ranked: Sequence, inflight: Mapping) -> list[int]:
    out = []
    for r in ranked:
        v = inflight.get(r, 0)
        out.append(_checks.count(f"inflight[{r!r}]", v))
    return out


def order_bounded(ranked: Sequence, inflight: Optional[Mapping], load_factor: float) -> list:
    """``ranked`` reordered for bounded load: the replicas under the cap in rank order, then those at or over it.

    Parameters
    ----------
    ranked : sequence
        Replica ids in the user's preference order (:func:`rank_replicas`).
    inflight : mapping or None
        In-flight requests per replica id (missing ids count 0; ids not in ``ranked`` are ignored). None: no load
        information, ``ranked`` is returned as is.
    load_factor : float
        >= 1; the cap is :func:`load_cap` of the in-flight total over ``ranked``.
    """
    load_factor = _checks.number("load_factor", load_factor, low=1.0)
    ranked = list(ranked)
    if inflight is None or not ranked:
        return ranked
    loads = _inflight_of(ranked, inflight)
    cap = load_cap(sum(loads), len(ranked), load_factor)
    under = [r for r, n in zip(ranked, loads) if n + 1 <= cap]
    over = [r for r, n in zip(ranked, loads) if n + 1 > cap]
    return under + over


def pick_bounded(ranked: Sequence, inflight: Optional[Mapping], load_factor: float):
    """The first replica of ``ranked`` whose load stays within the cap after taking one more request.

    Raises IndexError when ``ranked`` is empty.
    """
    if len(ranked) == 0:
        raise IndexError("ranked must hold at least 1 replica, got 0")
    order = order_bounded(ranked, inflight, load_factor)
    if inflight is not None:
        assert inflight.get(order[0], 0) + 1 <= load_cap(sum(inflight.get(r, 0) for r in ranked), len(ranked),
                                                         load_factor), "some replica is always under the cap"
    return order[0]


@dataclass(frozen=True)
class ForwardResult:
    """Outcome of :meth:`AffinityRouter.forward`.

    Attributes
    ----------
    replica : replica id or None
        Where the request landed; None when every replica tried rejected it or the deadline passed.
    value : Any
        What the accepting replica's ``attempt`` returned (None when it did not land).
    attempts : int
        Replicas offered the request.
    rejected : tuple
        Replicas that rejected it, in the order tried.
    expired : bool
        The deadline passed before a replica accepted.
    """

    replica: Any
    value: Any
    attempts: int
    rejected: tuple
    expired: bool = False

    @property
    def landed(self) -> bool:
        return self.replica is not None


class AffinityRouter:
    """Rendezvous routing by user id with bounded load, ticket affinity and rejection-based forwarding.

    Thread-safe: the replica set may change while requests route.

    Parameters
    ----------
    replicas : iterable
        Replica ids (ints, strs or bytes), distinct.
    load_factor : float
        >= 1 (default 1.25): a replica is skipped when taking the request would put it above
        ``ceil(load_factor * mean in-flight)``.
    """

    def __init__(self, replicas: Iterable = (), load_factor: float = 1.25) -> None:
        self._load_factor = _checks.number("load_factor", load_factor, low=1.0)
        self._lock = threading.Lock()
        self._replicas: dict = {}  # replica id -> None, in insertion order
        for r in replicas:
            self.add_replica(r)
        self._c = {"router_routes": 0, "router_load_skips": 0, "router_ticket_hits": 0, "router_ticket_misses": 0,
                   "router_forwards": 0, "router_forward_landed": 0, "router_forward_rejections": 0,
                   "router_forward_expired": 0, "router_forward_exhausted": 0}

    # ------------------------------------------------------------------ replica set
    @property
    def load_factor(self) -> float:
        return self._load_factor

    @property
    def replicas(self) -> tuple:
        with self._lock:
            return tuple(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def __contains__(self, replica) -> bool:
        return replica in self._replicas

    def add_replica(self, replica) -> None:
        """Add a replica; ValueError if it is already there."""
        _encode("replica", replica)
        with self._lock:
            if replica in self._replicas:
                raise ValueError(f"replica {replica!r} is already routed to")
            self._replicas[replica] = None

    def remove_replica(self, replica) -> None:
        """Remove a replica; KeyError if it is not there. Only the users it owned move."""
        with self._lock:
            if replica not in self._replicas:
                raise KeyError(f"replica {replica!r} is not routed to (replicas: {list(self._replicas)!r})")
            del self._replicas[replica]

    # ------------------------------------------------------------------ routing
    def ranked(self, user_id) -> list:
        """The live replicas in the user's preference order."""
        return rank_replicas(user_id, self.replicas)

    def route(self, user_id, inflight: Optional[Mapping] = None):
        """The user's replica: the top-ranked one, or with ``inflight`` given, the first within the load cap.

        Raises IndexError when the router has no replicas.
        """
        ranked = self.ranked(user_id)
        if not ranked:
            raise IndexError("route: the router has no replicas")
        choice = pick_bounded(ranked, inflight, self._load_factor)
        with self._lock:
            self._c["router_routes"] += 1
            if choice != ranked[0]:
                self._c["router_load_skips"] += 1
        return choice

    def route_ranking(self, user_id, ticket_replica=None, inflight: Optional[Mapping] = None):
        """Replica for a ranking request: the ticket's replica (where the prefix is cached) while it is alive,
        whatever its load; otherwise the user is routed anew (:meth:`route`) and that replica recomputes."""
        if ticket_replica is not None:
            with self._lock:
                alive = ticket_replica in self._replicas
                self._c["router_ticket_hits" if alive else "router_ticket_misses"] += 1
            if alive:
                return ticket_replica
        return self.route(user_id, inflight)

    def forward(self, user_id, attempt: Callable[[Any], Any], deadline_s: float, *,
                inflight: Optional[Mapping] = None, max_attempts: Optional[int] = None,
                clock: Callable[[], float] = time.monotonic) -> ForwardResult:
        """Offer a request to the user's replicas in (bounded) rank order until one accepts.

        Parameters
        ----------
        user_id : int, str or bytes
        attempt : callable
            ``attempt(replica)`` submits the request to ``replica`` and returns its reply, or None when the replica
            rejects it (pool or load bound). Exceptions propagate.
        deadline_s : float
            Time budget in seconds (> 0) from the call: no attempt starts after it.
        inflight : mapping, optional
            In-flight counts per replica for the bounded order (:func:`order_bounded`).
        max_attempts : int, optional
            Try at most this many replicas (>= 1); default all, each at most once.
        clock : callable
            Seconds clock (``time.monotonic``); tests pass a synthetic one.

        Returns
        -------
        ForwardResult
        """
        if not callable(attempt):
            raise ValueError(f"attempt must be callable as attempt(replica), got {type(attempt).__name__}")
        budget = _checks.number("deadline_s", deadline_s, low=0.0, low_open=True)
        if max_attempts is not None:
            max_attempts = _checks.count("max_attempts", max_attempts, 1)
        order = order_bounded(self.ranked(user_id), inflight, self._load_factor)
        if max_attempts is not None:
            order = order[:max_attempts]
        deadline = clock() + budget
        rejected: list = []
        landed, value, expired = None, None, False
        for r in order:
            if clock() >= deadline:
                expired = True
                break
            reply = attempt(r)
            if reply is None:
                rejected.append(r)
                continue
            landed, value = r, reply
            break
        with self._lock:
            c = self._c
            c["router_forwards"] += 1
            c["router_forward_rejections"] += len(rejected)
            if landed is not None:
                c["router_forward_landed"] += 1
            elif expired:
                c["router_forward_expired"] += 1
            else:
                c["router_forward_exhausted"] += 1
        attempts = len(rejected) + (landed is not None)
        return ForwardResult(replica=landed, value=value, attempts=attempts, rejected=tuple(rejected),
                             expired=expired)

    def stats(self) -> dict:
        """Counters: routes, load skips, ticket hits/misses, forwards (landed, rejections, expired, exhausted)."""
        with self._lock:
            out = dict(self._c)
            out["router_replicas"] = len(self._replicas)
        return out

    def __repr__(self) -> str:
        return f"AffinityRouter(replicas={list(self.replicas)!r}, load_factor={self._load_factor})"
