"""Route keys and the replica order of one request (pure Python: no Ray import).

A request reaches a replica through Serve's request router (:mod:`relaygr_engine.serving.request_router`), which sees only
the request's *session id*: the handle's ``options(session_id=...)``, or for HTTP the ``x-session-id`` header
(Serve's session header; ``RAY_SERVE_SESSION_ID_HEADER_KEY`` renames it). The session id is a *route key*::

    7                       ranking of user 7 without a ticket: the user's replicas, bounded load
    7;prefill               pre-infer of user 7: the same order, replicas that cannot take a pre-infer last
    7;prefill;skip=ab,cd    pre-infer forwarded past replicas ab and cd (they rejected it)
    7;at=ab                 ranking with a ticket from replica ab: only ab while it is alive

Fields after the user id are separated by ``;`` and may come in any order. Replica ids are Serve's replica
``unique_id`` strings; every reply of a replica names its id, and an admitted pre-infer's reply carries the route
key of its ranking (``route_key``).

:func:`route_order` turns a key, the live replicas and their reported stats into the order in which the router
offers the request; it ranks with :func:`relaygr_engine.policy.affinity.rank_replicas` and bounds load with
:func:`relaygr_engine.policy.affinity.order_bounded`, the code the in-process :class:`AffinityRouter` uses, so both
place a user on the same replica.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..policy import _checks
from ..policy.affinity import order_bounded, rank_replicas

__all__ = ["RouteKey", "route_order", "accepts_prefill", "parse_user_id", "SESSION_HEADER"]

SESSION_HEADER = "x-session-id"
"""Serve's default session-id header (``RAY_SERVE_SESSION_ID_HEADER_KEY`` renames it); it carries the route key."""



def parse_user_id(value) -> int:
    """A user id: an int in [0, 2**64) or its decimal string; ValueError otherwise."""
    if isinstance(value, str):
        value = value.strip()
        if not value.isdigit():
            raise ValueError(f"user_id must be a decimal integer in [0, 2**64), got {value!r}")
        value = int(value)
    return _checks.user_id(value)


def _replica(name: str, value) -> str:
    if not isinstance(value, str) or not value or not all(c.isalnum() or c in "-_" for c in value):
        raise ValueError(f"{name} must be a replica id (letters, digits, '-', '_'), got {value!r}")
    return value


@dataclass(frozen=True)
class RouteKey:
    """Where a request should go: the user, its kind, a pinned replica and replicas to pass over.

    Parameters
    ----------
    user_id : int
        In ``[0, 2**64)``.
    prefill : bool
        A pre-infer (the router puts replicas that report they cannot take one last).
    at : str, optional
        The replica holding the user's pre-inferred prefix (the ticket's): the request goes there while it is
        alive, whatever its load.
    skip : tuple of str
        Replicas that rejected this request or failed while serving it; offered only when no other is left.
    """

    user_id: int
    prefill: bool = False
    at: Optional[str] = None
    skip: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "user_id", parse_user_id(self.user_id))
        if not isinstance(self.prefill, bool):
            raise ValueError(f"prefill must be a bool, got {self.prefill!r}")
        if self.at is not None:
            _replica("at", self.at)
        skip = tuple(self.skip)
        for i, r in enumerate(skip):
            _replica(f"skip[{i}]", r)
        object.__setattr__(self, "skip", tuple(dict.fromkeys(skip)))

    def encode(self) -> str:
        """The key as a session id string (see the module docstring)."""
        parts = [str(self.user_id)]
        if self.prefill:
            parts.append("prefill")
        if self.at is not None:
            parts.append(f"at={self.at}")
        if self.skip:
            parts.append("skip=" + ",".join(self.skip))
        return ";".join(parts)

    def __str__(self) -> str:
        return self.encode()

    @classmethod
    def parse(cls, text: str) -> "RouteKey":
        """Inverse of :meth:`encode`; ValueError naming the bad field."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"route key must be a non-empty string like '7;prefill', got {text!r}")
        head, *fields = text.split(";")
        prefill, at, skip = False, None, ()
        for f in fields:
            f = f.strip()
            if f == "prefill":
                prefill = True
            elif f.startswith("at="):
                at = f[3:]
            elif f.startswith("skip="):
                skip = tuple(s for s in f[5:].split(",") if s)
            elif f:
                raise ValueError(f"route key field must be 'prefill', 'at=REPLICA' or 'skip=R1,R2', got {f!r} "
                                 f"in {text!r}")
        return cls(parse_user_id(head), prefill=prefill, at=at, skip=skip)


def accepts_prefill(stats: Optional[Mapping]) -> bool:
    """Whether a replica's reported stats say it can take a pre-infer (unknown stats: assume it can)."""
    if not stats:
        return True
    return bool(stats.get("accepts_prefill", True))


def _load(stats: Optional[Mapping], prefill: bool) -> int:
    if not stats:
        return 0
    n = int(stats.get("inflight_prefills", 0))
    return n if prefill else n + int(stats.get("inflight_ranks", 0))


def route_order(key: RouteKey, replicas: Sequence[str], stats: Mapping[str, Mapping],
                load_factor: float = 1.25) -> list[str]:
    """The replicas to offer a request to, in order (Serve tries them one by one).

    Parameters
    ----------
    key : RouteKey
    replicas : sequence of str
        Live replica ids.
    stats : mapping
        Replica id -> its last reported routing stats (see ``RelayReplica.record_routing_stats``); missing ids
        count as idle and able to take a pre-infer.
    load_factor : float
        >= 1, the bounded-load factor of :func:`~relaygr_engine.policy.affinity.order_bounded`.

    Returns
    -------
    list of str
        ``[key.at]`` when that replica is live and not skipped. Otherwise the user's rendezvous order over the
        replicas not skipped (all of them when every one is skipped), reordered for bounded load: in-flight
        pre-infers for a pre-infer, all in-flight requests for a ranking; a pre-infer also moves replicas whose
        stats say they cannot take it to the end.
    """
    live = list(replicas)
    if key.at is not None and key.at in live and key.at not in key.skip:
        return [key.at]
    pool = [r for r in live if r not in key.skip] or live
    ranked = rank_replicas(key.user_id, pool)
    order = order_bounded(ranked, {r: _load(stats.get(r), key.prefill) for r in ranked}, load_factor)
    if key.prefill:
        ok = [r for r in order if accepts_prefill(stats.get(r))]
        order = ok + [r for r in order if r not in ok]
    return order
