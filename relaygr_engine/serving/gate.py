"""The order in which a replica's requests reach its engine: one at a time, rankings first.

A replica serves rankings and pre-infers with one engine. A plain lock serves them in arrival order, so a ranking
that arrives behind queued pre-infers waits for all of them, and a pre-infer whose ranking has already arrived
still runs (its ranking, sent without the ticket it never got, computes the prefix itself). :class:`EngineGate`
applies the policy of the in-process relay worker (:mod:`relaygr_engine.bench.serving`): a waiting ranking goes
before every waiting pre-infer, and a pre-infer still waiting when a ranking of its user arrives is dropped
(``superseded``) instead of computed. A job that has started is never interrupted.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Iterator

__all__ = ["EngineGate"]


class EngineGate:
    """Admits one engine call at a time: rankings before pre-infers, stale pre-infers dropped.

    Use ``with gate.ranking(user) as waited:`` and ``with gate.prefill(user) as (go, waited):`` around the engine
    call (``waited``: seconds spent waiting; ``go`` False: the pre-infer was superseded, do not run it).
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._busy = False
        self._ranks_waiting = 0
        self._pending: collections.Counter = collections.Counter()   # user -> pre-infers waiting
        self._stale: set = set()                                       # users whose ranking came meanwhile
        self.counters = {"gate_superseded_prefills": 0, "gate_rankings_ahead": 0}

    @contextlib.contextmanager
    def ranking(self, user: int) -> Iterator[float]:
        """Hold the engine for a ranking of ``user``; yields the seconds it waited."""
        start = time.perf_counter()
        with self._cv:
            if self._pending[user]:
                self._stale.add(user)
            if self._pending and any(self._pending.values()):
                self.counters["gate_rankings_ahead"] += 1
            self._ranks_waiting += 1
            try:
                while self._busy:
                    self._cv.wait()
            finally:
                self._ranks_waiting -= 1
            self._busy = True
        try:
            yield time.perf_counter() - start
        finally:
            self._release()

    @contextlib.contextmanager
    def prefill(self, user: int) -> Iterator[tuple[bool, float]]:
        """Hold the engine for a pre-infer of ``user`` once no ranking waits; yields ``(go, seconds waited)``,
        ``go`` False when a ranking of the user arrived while it waited (the engine is then not held)."""
        start = time.perf_counter()
        with self._cv:
            self._pending[user] += 1
            try:
                while self._busy or self._ranks_waiting:
                    self._cv.wait()
            finally:
                self._pending[user] -= 1
                stale = user in self._stale
                if not self._pending[user]:
                    del self._pending[user]
                    self._stale.discard(user)
            go = not stale
            if go:
                self._busy = True
            else:
                self.counters["gate_superseded_prefills"] += 1
        if not go:
            yield False, time.perf_counter() - start
            return
        try:
            yield True, time.perf_counter() - start
        finally:
            self._release()

    def _release(self) -> None:
        with self._cv:
            self._busy = False
            self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return dict(self.counters)
