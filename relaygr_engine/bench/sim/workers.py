"""Workers sharing one virtual clock, and where each request's pre-infer and ranking go.

A :class:`Worker` is one device with its own service (its own engine and cache) and a :class:`Role`: ``both``
(co-located: pre-infers and rankings on the same device, rankings first), ``prefill`` (pre-infers only: the
disaggregated pre-infer pool) or ``rank`` (rankings only, plus the prefixes the pre-infer pool ships to it).
A user's pre-infer goes to its rendezvous-first worker among those that pre-infer, and its ranking to its
rendezvous-first worker among those that rank (:func:`~relaygr_engine.policy.affinity.rank_replicas`), so with
co-located workers both land on the same one, as the affinity router places them.
"""
from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...policy.affinity import rank_replicas
from ...workload.requests import Request
from .services import Service

__all__ = ["Role", "Worker", "place"]


class Role(str, enum.Enum):
    """What a worker serves."""

    BOTH = "both"          # pre-infers and rankings (co-located)
    PREFILL = "prefill"    # pre-infers only (disaggregated pre-infer pool)
    RANK = "rank"          # rankings only (disaggregated ranking pool)

    @property
    def prefills(self) -> bool:
        return self is not Role.RANK

    @property
    def ranks(self) -> bool:
        return self is not Role.PREFILL


@dataclass(eq=False)
class Worker:
    """One device on the shared virtual clock.

    ``t`` is when the worker is next free (``idle``: a wake-up time, lowered when work arrives sooner); the
    queues hold request indices; ``inbox`` holds shipped prefixes as ``(arrival time, request index, payload)``.
    """

    service: Service
    role: Role = Role.BOTH
    t: float = 0.0
    idle: bool = False
    busy_s: float = 0.0
    rank_q: collections.deque = field(default_factory=collections.deque)
    pre_q: collections.deque = field(default_factory=collections.deque)
    inbox: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.role = Role(self.role)


def place(workers: Sequence[Worker], requests: Sequence[Request], pre_infer: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each request's pre-infer worker (-1 when ``pre_infer`` is False) and ranking worker, as index arrays."""
    pre_ids = [i for i, w in enumerate(workers) if w.role.prefills]
    rank_ids = [i for i, w in enumerate(workers) if w.role.ranks]
    if not rank_ids:
        raise ValueError(f"workers must include one that ranks, got roles {[w.role.value for w in workers]}")
    if pre_infer and not pre_ids:
        raise ValueError("a pre-inferring service needs a worker that pre-infers")
    pre_at = np.full(len(requests), -1, dtype=np.int64)
    rank_at = np.zeros(len(requests), dtype=np.int64)
    home: dict = {}
    for k, r in enumerate(requests):
        if r.user_id not in home:
            home[r.user_id] = (rank_replicas(r.user_id, pre_ids)[0] if pre_infer else -1,
                               rank_replicas(r.user_id, rank_ids)[0])
        pre_at[k], rank_at[k] = home[r.user_id]
    return pre_at, rank_at
