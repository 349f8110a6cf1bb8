"""The histories of a replica's leased prefixes, so that a ranking presenting a ticket may send only what is new.

A pre-infer ships the user's prefix; its ranking, a pipeline delay later, ships the same prefix again plus a few
newer behaviors. :class:`PrefixStore` keeps, for every admitted ticket of the replica whose lease is running, the
prefix it was computed from and its :func:`~relaygr_engine.serving.wire.history_digest`. A ranking by difference
(``"prefix": {"num_tokens", "digest"}`` with only the newer behaviors, :mod:`~relaygr_engine.serving.wire`) is
rebuilt from it: :meth:`PrefixStore.rebuild` concatenates the kept prefix and the sent behaviors after checking the
digest, so the engine sees exactly the history the caller holds. A ticket the store does not know (its lease ran
out, the replica restarted, another replica issued it) or a digest that differs raises
:class:`~relaygr_engine.serving.wire.NeedFullHistory` before anything changes: the caller sends the whole history.

Memory is bounded: an entry lives while its lease does (dropped when a ranking presents the ticket, or at
``expires_at``), leases pin cache pages, and the store holds at most ``max_entries`` prefixes (the oldest go
first), each at most the replica's ``max_history`` behaviors.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ..engine import PrefixTicket
from ..models import Behaviors
from ..policy import _checks
from .wire import NeedFullHistory, history_digest

__all__ = ["PrefixStore"]


@dataclass(frozen=True)
class _Kept:
    history: Behaviors
    digest: str
    expires_at: Optional[float]


class PrefixStore:
    """The prefixes of a replica's leased tickets, keyed by ``(user_id, fingerprint)``.

    Parameters
    ----------
    max_entries : int
        Most prefixes kept at once (>= 0; 0 keeps none); past it the oldest is dropped (its ranking then resends
        in full).
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = _checks.count("max_entries", max_entries)
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counters = {"prefix_store_kept": 0, "prefix_store_rebuilt": 0, "prefix_store_unknown": 0,
                         "prefix_store_mismatch": 0, "prefix_store_dropped": 0}

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, ticket: PrefixTicket, history: Behaviors, now: float) -> None:
        """Remember the prefix ``history`` of an admitted ``ticket`` (its ``num_tokens`` tokens) until its lease
        ends; entries whose lease ran out by ``now`` are dropped first."""
        if not ticket.admitted or history.num_tokens != ticket.num_tokens:
            return
        kept = _Kept(history.to("cpu"), history_digest(history), ticket.expires_at)
        with self._lock:
            self._expire(now)
            key = (ticket.user_id, ticket.fingerprint)
            self._kept.pop(key, None)
            self._kept[key] = kept
            self.counters["prefix_store_kept"] += 1
            while len(self._kept) > self.max_entries:
                self._kept.popitem(last=False)
                self.counters["prefix_store_dropped"] += 1

    def forget(self, ticket: PrefixTicket) -> None:
        """Drop the ticket's prefix (its lease ended: a ranking presented it)."""
        with self._lock:
            self._kept.pop((ticket.user_id, ticket.fingerprint), None)

    def rebuild(self, ticket: PrefixTicket, num_tokens: int, digest: str, suffix: Behaviors,
                now: float) -> Behaviors:
        """The whole history of a ranking by difference: the kept prefix of ``ticket`` followed by ``suffix`` (the
        behaviors after it, on the suffix's device).

        Raises
        ------
        NeedFullHistory
            The ticket's prefix is not kept here (``"unknown_ticket"``) or differs from what the caller holds
            (``"digest_mismatch"``: another ``num_tokens`` or ``digest``).
        ValueError
            ``suffix`` lacks a field the prefix has (action ids, timestamps) or has one it lacks.
        """
        with self._lock:
            self._expire(now)
            kept = self._kept.get((ticket.user_id, ticket.fingerprint))
            if kept is None:
                self.counters["prefix_store_unknown"] += 1
                raise NeedFullHistory("this replica holds no prefix for the ticket (its lease ended or another "
                                      "replica issued it): send the whole history", "unknown_ticket")
            if num_tokens != kept.history.num_tokens or digest != kept.digest:
                self.counters["prefix_store_mismatch"] += 1
                raise NeedFullHistory(f"the prefix sent ({num_tokens} tokens, digest {digest}) is not the ticket's "
                                      f"({kept.history.num_tokens} tokens, digest {kept.digest}): send the whole "
                                      "history", "digest_mismatch")
        full = _concat(kept.history, suffix)
        with self._lock:
            self.counters["prefix_store_rebuilt"] += 1
        return full

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, prefix_store_entries=len(self._kept))

    def _expire(self, now: float) -> None:
        gone = [k for k, v in self._kept.items() if v.expires_at is not None and v.expires_at <= now]
        for k in gone:
            del self._kept[k]


def _concat(prefix: Behaviors, suffix: Behaviors) -> Behaviors:
    """``prefix`` then ``suffix``'s behaviors (the prefix's contextual tokens kept), on the suffix's device."""
    dev = suffix.item_ids.device
    fields = {}
    for name in ("item_ids", "action_ids", "timestamps"):
        a, b = getattr(prefix, name), getattr(suffix, name)
        if (a is None) != (b is None):
            have = "has" if a is not None else "lacks"
            raise ValueError(f"{name}: the ticket's prefix {have} them, so the behaviors after it must "
                             f"{'' if a is not None else 'not '}have them too")
        if a is not None:
            fields[name] = torch.cat([a.to(dev), b])
    ctx = None if prefix.context_ids is None else prefix.context_ids.to(dev)
    return Behaviors(**fields, context_ids=ctx)
