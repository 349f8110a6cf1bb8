"""In-process serving in real time for ``relaygr bench loadgen``: one worker thread, the virtual clock's policy.

A LoadGen query is a user's request arriving at retrieval. :class:`InProcessDriver` takes it at once
(:meth:`~InProcessDriver.submit`): in a relay mode its pre-infer signal joins the pre-infer queue then, and its
ranking request joins the ranking queue ``delay_s`` later (the pipeline delay); the baseline has only the ranking.
One worker thread serves both queues with the policy of the virtual-clock worker
(:mod:`relaygr_engine.bench.sim`), on the wall clock:

1. a waiting ranking goes first (a batch of queued rankings with ``BatchPolicy``);
2. otherwise, pre-infers whose ranking is due are dropped (a started, chunked one is cut short), and the oldest
   other pre-infer runs one chunk;
3. with both queues empty the worker sleeps until the next ranking is due or a query arrives.

Jobs really run (the services of :mod:`relaygr_engine.bench.sim`, unchanged) and are never preempted; time
passes on its own, so a ranking's latency is its completion minus its due time with every wait counted (queueing,
a running pre-infer, the interpreter, other processes on the machine). The engines' clock (leases, the trigger's
window) is ``now0`` plus the wall seconds since the driver started.
"""
from __future__ import annotations

import collections
import heapq
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from .sim import BatchPolicy
from ..workload.requests import Request

__all__ = ["QueryLog", "InProcessDriver"]


@dataclass
class QueryLog:
    """What happened to each query of a run, indexed like the run's requests (seconds on ``time.perf_counter``).

    ``issue``: the query reached the driver (its retrieval time); ``due``: its ranking request arrived
    (``issue + delay``); ``start`` / ``done``: its ranking started / was answered; ``source``: where the ranking's
    prefix came from; ``had_ticket``: its pre-infer had completed; ``error``: what failed (the query was still
    answered to LoadGen, so that the run ends). Unissued queries keep NaN times. ``jobs``: the wall and thread CPU
    seconds of the in-process worker's jobs (their ratio is how much other threads and processes stretched them).
    """

    n: int
    issue: np.ndarray = field(init=False)
    due: np.ndarray = field(init=False)
    start: np.ndarray = field(init=False)
    done: np.ndarray = field(init=False)
    source: list = field(init=False)
    had_ticket: np.ndarray = field(init=False)
    error: dict = field(default_factory=dict)
    prefill: dict = field(default_factory=collections.Counter)
    jobs: dict = field(default_factory=lambda: {"wall_s": 0.0, "cpu_s": 0.0, "count": 0})

    def __post_init__(self) -> None:
        self.issue, self.due, self.start, self.done = (np.full(self.n, np.nan) for _ in range(4))
        self.source = [""] * self.n
        self.had_ticket = np.zeros(self.n, dtype=bool)

    def arrive(self, k: int, t: float, delay_s: float) -> None:
        """Query ``k`` issued at ``t``, its ranking due ``delay_s`` later; ValueError for a query out of range or
        issued before (the caller holds the driver's lock)."""
        if not 0 <= k < self.n or not np.isnan(self.issue[k]):
            raise ValueError(f"k must be an unissued query in [0, {self.n}), got {k}")
        self.issue[k], self.due[k] = t, t + delay_s

    @property
    def answered(self) -> np.ndarray:
        """Queries whose ranking was answered without error."""
        ok = ~np.isnan(self.done)
        ok[list(self.error)] = False
        return ok

    def ranking_latency_s(self) -> np.ndarray:
        """``done - due`` of the answered queries (issue order)."""
        m = self.answered
        return self.done[m] - self.due[m]


class InProcessDriver:
    """Serve a run's queries in real time with one worker thread (see the module doc).

    Parameters
    ----------
    service : Service
        A fresh (or warmed) service of :mod:`relaygr_engine.bench.sim` for the mode.
    requests : sequence of Request
        The run's requests; query ``k`` serves ``requests[k]``.
    delay_s : float
        Retrieval-to-ranking delay (>= 0).
    answered : callable
        ``answered(tag)`` once query ``tag``'s ranking is done (LoadGen's ``QuerySamplesComplete``).
    batch : BatchPolicy
    now0 : float
        The engines' clock when the driver starts (after a warm-up on the virtual clock, its end).
    clock : callable
        Wall seconds (``time.perf_counter``).
    """

    def __init__(self, service, requests: Sequence[Request], delay_s: float, answered: Callable[[object], None],
                 batch: Optional[BatchPolicy] = None, now0: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        self.service, self.requests, self.delay_s, self.answered = service, list(requests), float(delay_s), answered
        self.batch = batch or BatchPolicy()
        self.relay = bool(getattr(service, "wants_prefill", False))
        self.clock = clock
        self.log = QueryLog(len(self.requests))
        self._cv = threading.Condition()
        self._due: list = []                       # (due time, k) of rankings not yet arrived
        self._rank_q: collections.deque = collections.deque()
        self._pre_q: collections.deque = collections.deque()
        self._started = np.zeros(len(self.requests), dtype=bool)
        self._prefilled = np.zeros(len(self.requests), dtype=bool)
        self._tags: dict = {}
        self._pending = 0
        self._stop = False
        self._t0 = clock()
        self._now0 = float(now0)
        self._thread = threading.Thread(target=self._loop, name="relaygr-loadgen-worker", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """The engines' clock: ``now0`` + wall seconds since the driver started."""
        return self._now0 + (self.clock() - self._t0)

    def submit(self, k: int, tag) -> None:
        """Query ``k`` arrives now (called from LoadGen's issue thread: returns at once)."""
        t = self.clock()
        with self._cv:
            self.log.arrive(k, t, self.delay_s)
            self._tags[k] = tag
            self._pending += 1
            if self.relay:
                self._pre_q.append(k)
                self.log.prefill["signals"] += 1
            heapq.heappush(self._due, (t + self.delay_s, k))
            self._cv.notify()

    def close(self, timeout_s: float = 600.0) -> QueryLog:
        """Wait until every submitted query is answered, stop the worker; the run's :class:`QueryLog`."""
        end = self.clock() + timeout_s
        with self._cv:
            while self._pending and self.clock() < end:
                self._cv.wait(timeout=1.0)
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=60.0)
        if self._pending:
            raise RuntimeError(f"{self._pending} queries were not answered within {timeout_s:g} s")
        self.log.prefill = dict(self.log.prefill)
        return self.log

    # ------------------------------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cv:
                job = self._next_job()
                if job is None:
                    return
            kind, ks = job
            if kind == "rank":
                self._rank(ks)
            else:
                self._prefill(ks[0])

    def _next_job(self):
        """Under the lock: the next ``("rank", [k...])`` or ``("prefill", [k])``, waiting for one; None to stop."""
        while True:
            now = self.clock()
            while self._due and self._due[0][0] <= now:
                self._rank_q.append(heapq.heappop(self._due)[1])
            if self._rank_q:
                size = lambda k: self.requests[k].history_len + int(self.requests[k].candidates.shape[0])  # noqa: E731
                return "rank", self.batch.take(self._rank_q, size)
            self._drop_stale(now)
            if self._pre_q:
                return "prefill", [self._pre_q.popleft()]
            if self._stop and not self._pending:
                return None
            self._cv.wait(timeout=None if not self._due else max(0.0, self._due[0][0] - now))

    def _drop_stale(self, now: float) -> None:
        while self._pre_q and self.log.due[self._pre_q[0]] <= now:
            k = self._pre_q.popleft()
            if self._started[k]:
                self.log.prefill["cut_short"] += 1
                self._call(k, self.service.cancel, self.requests[k], self.now())
            else:
                self.log.prefill["dropped_stale"] += 1

    def _prefill(self, k: int) -> None:
        if not self._started[k]:
            self._started[k] = True
            self.log.prefill["started"] += 1
        t0 = self.clock()
        out = self._call(k, self.service.prefill, self.requests[k], self.now())
        self.log.prefill["chunks"] += 1
        self.log.prefill["service_s"] += self.clock() - t0
        if out is None:
            return
        with self._cv:
            if out.remaining:
                self._pre_q.appendleft(k)   # the next chunk, unless its ranking comes first
            elif out.admitted:
                self._prefilled[k] = True
                self.log.prefill["admitted"] += 1
            else:
                self.log.prefill[f"refused:{out.reason or 'unspecified'}"] += 1

    def _rank(self, ks: list) -> None:
        reqs = [self.requests[k] for k in ks]
        t0 = self.clock()
        for k in ks:
            self.log.start[k], self.log.had_ticket[k] = t0, self._prefilled[k]
        now = self.now()
        fn = (lambda: [self.service.rank(reqs[0], now)]) if len(ks) == 1 else \
            (lambda: self.service.rank_batch(reqs, now))
        outs = self._call(ks[0], fn)
        t1 = self.clock()
        for i, k in enumerate(ks):
            self.log.done[k] = t1
            if outs is None:
                self.log.error.setdefault(k, self.log.error.get(ks[0], "failed"))
            else:
                self.log.source[k] = outs[i].source
        with self._cv:
            self._pending -= len(ks)
            tags = [self._tags.pop(k) for k in ks]
            self._cv.notify_all()
        for tag in tags:
            self.answered(tag)

    def _call(self, k: int, fn, *args):
        """``fn(*args)``, its wall and thread CPU time counted; an exception is recorded against query ``k`` (the
        run goes on, the query still ends)."""
        w0, c0 = self.clock(), time.thread_time()
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - recorded and reported after the run, never lost
            self.log.error[k] = f"{type(e).__name__}: {e}"
            return None
        finally:
            jobs = self.log.jobs
            jobs["wall_s"] += self.clock() - w0
            jobs["cpu_s"] += time.thread_time() - c0
            jobs["count"] += 1
