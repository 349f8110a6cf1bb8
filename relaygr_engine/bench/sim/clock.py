"""The open-loop serving loop on a virtual clock shared by one or more workers, and its result.

See :mod:`relaygr_engine.bench.sim` for the method. :func:`simulate` takes one service (one co-located worker,
as before) or a list of :class:`~.workers.Worker`; the loop always advances the worker that is free first, so
every job starts at a time no other worker has passed, and each job really runs and is timed.
"""
from __future__ import annotations

import collections
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ...workload.requests import Workload
from .batching import BatchPolicy
from .services import Service
from .workers import Role, Worker, place

__all__ = ["RunResult", "simulate"]


@dataclass
class RunResult:
    """One open-loop run of one mode at one QPS.

    Per-request arrays are indexed like ``workload.measured`` (arrival order, warm-up requests left out); times are
    virtual seconds with the first pre-infer signal at 0 (the first ranking arrives at ``pipeline_delay_s``). A run
    stopped early (``stopped_early``) holds only the first measured requests, of ``num_requests``. ``prefill``
    counts the measured requests' pre-infers and ``work_s`` is the time of their jobs (rankings and pre-infers),
    from ``window_start_s`` (the first measured event) on; ``engine_stats`` (summed over workers) and ``busy_s``
    cover the whole run. ``workers``: devices that served the run (utilization is ``work_s`` over their time).
    """

    mode: str
    qps: float
    arrival_s: np.ndarray
    start_s: np.ndarray
    finish_s: np.ndarray
    service_s: np.ndarray
    history_len: np.ndarray
    cached_tokens: np.ndarray
    computed_tokens: np.ndarray
    sources: list[str]
    had_ticket: np.ndarray
    prefill: dict = field(default_factory=dict)
    engine_stats: dict = field(default_factory=dict)
    busy_s: float = 0.0
    work_s: float = 0.0
    window_start_s: float = 0.0
    wall_s: float = 0.0
    stopped_early: bool = False
    num_requests: int = 0
    workers: int = 1
    aborted: bool = False

    @property
    def latency_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max())

    def source_counts(self) -> dict[str, int]:
        return dict(collections.Counter(self.sources))



class _Loop:
    """State of one run (see :func:`simulate`); each method is one kind of step of a worker."""

    def __init__(self, workers: list[Worker], workload: Workload, qps: float, timer, progress, stop_over,
                 batch: BatchPolicy) -> None:
        self.workers, self.timer, self.progress, self.stop_over, self.batch = workers, timer, progress, stop_over, batch
        self.reqs = reqs = workload.requests
        self.n, self.W = n, W = len(reqs), workload.num_warmup
        delay = workload.config.pipeline_delay_s
        self.arr = workload.arrivals(qps) + delay            # first signal at virtual time 0
        self.sig = self.arr - delay
        self.relay = any(w.role.prefills and w.service.wants_prefill for w in workers)
        self.pre_at, self.rank_at = place(workers, reqs, self.relay)
        self.tokens = [r.history_len + int(r.candidates.shape[0]) for r in reqs]
        self.start, self.finish, self.service_s = np.zeros(n), np.zeros(n), np.zeros(n)
        self.cached, self.computed = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        self.had_ticket, self.done_prefill = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        self.started, self.ranked = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
        self.sources = [""] * n
        self.pf = {"signals": n - W if self.relay else 0, "started": 0, "chunks": 0, "admitted": 0,
                   "dropped_stale": 0, "cut_short": 0, "service_s": 0.0, "refused": collections.Counter()}
        self.tx = {"transfers": 0, "transfer_bytes": 0, "pack_s": 0.0, "copy_s": 0.0, "unpack_s": 0.0,
                   "late": 0, "refused": 0}
        skip = W if all(getattr(w.service, "stateless", False) for w in workers) else 0   # needs no warm-up
        self.i_sig = skip if self.relay else n
        self.i_arr = skip
        self.served = skip
        self.opened = W == skip                  # the measured window is open (its events may be queued)
        self.work = 0.0                          # time spent on the measured requests' jobs
        self.over = 0
        self.stopped = False
        t0 = float(self.sig[W] if self.relay else self.arr[W]) if skip and n > W else (
            0.0 if self.relay else float(self.arr[0]))
        for w in workers:
            w.t, w.idle, w.busy_s = t0, False, 0.0

    # ------------------------------------------------------------------------------------------ events
    def first_event(self) -> float:
        return float(self.sig[self.W] if self.relay else self.arr[self.W])

    def admit(self, t: float) -> None:
        """Open the measured window when the warm-up is served; queue every event up to ``t``."""
        W = self.W
        if not self.opened and self.served >= W:   # delay the measured requests until the worker is free
            shift = max(0.0, t - self.first_event())
            self.arr[W:] += shift
            self.sig[W:] += shift
            self.opened = True
            for w in self.workers:               # idle ones wait for events the window now opens
                if w.idle:
                    w.t = min(w.t, t)
        lim = self.n if self.opened else W
        while self.i_sig < lim and self.sig[self.i_sig] <= t:
            self.workers[self.pre_at[self.i_sig]].pre_q.append(self.i_sig)
            self.i_sig += 1
        while self.i_arr < lim and self.arr[self.i_arr] <= t:
            self.workers[self.rank_at[self.i_arr]].rank_q.append(self.i_arr)
            self.i_arr += 1

    def next_event(self, w: Worker) -> float:
        lim = self.n if self.opened else self.W
        nxt = min(self.sig[self.i_sig] if self.i_sig < lim else math.inf,
                  self.arr[self.i_arr] if self.i_arr < lim else math.inf)
        return min(float(nxt), w.inbox[0][0] if w.inbox else math.inf)

    def timed(self, fn, *args):
        t0 = self.timer()
        out = fn(*args)
        return out, self.timer() - t0

    def busy(self, w: Worker, d: float, measured: bool) -> None:
        w.t += d
        w.busy_s += d
        self.work += d if measured else 0.0

    # ------------------------------------------------------------------------------------------ steps
    def step(self, w: Worker) -> None:
        """One decision of the free worker ``w`` at its time: a shipped prefix, a ranking batch, a pre-infer, or
        idle until the next event."""
        t = w.t
        w.idle = False
        if w.inbox and w.inbox[0][0] <= t:
            self.receive(w, t)
        elif w.rank_q:
            self.rank(w, t)
        else:
            self.drop_stale(w, t)
            if w.pre_q:
                self.prefill(w, t)
            else:
                w.t, w.idle = max(t, self.next_event(w)), True   # inf: nothing more comes to it

    def rank(self, w: Worker, t: float) -> None:
        batch = self.batch.take(w.rank_q, self.tokens.__getitem__)
        for i in batch:
            self.had_ticket[i] = self.done_prefill[i]
        if len(batch) == 1:
            outs, d = self.timed(lambda: [w.service.rank(self.reqs[batch[0]], t)])
        else:
            outs, d = self.timed(w.service.rank_batch, [self.reqs[i] for i in batch], t)
        assert len(outs) == len(batch)
        measured = [i for i in batch if i >= self.W]
        self.busy(w, d, False)
        self.work += d * len(measured) / len(batch)
        for i, out in zip(batch, outs):
            self.start[i], self.finish[i], self.service_s[i] = t, t + d, d
            self.sources[i], self.cached[i], self.computed[i] = out.source, out.cached_tokens, out.computed_tokens
            self.ranked[i] = True
            self.served += 1
            if self.progress is not None:
                self.progress.update(1)
            if self.stop_over is not None and i >= self.W and t + d - self.arr[i] > self.stop_over[0]:
                self.over += 1
        if self.stop_over is not None and self.over >= self.stop_over[1] and self.served < self.n:
            self.stopped = True

    def drop_stale(self, w: Worker, t: float) -> None:
        """Drop queued pre-infers whose ranking already arrived (a running one is cut short)."""
        cancel = getattr(w.service, "cancel", None)
        while w.pre_q and self.arr[w.pre_q[0]] <= t:
            j = w.pre_q.popleft()
            if self.started[j]:
                self.pf["cut_short"] += j >= self.W
                if cancel is not None:
                    cancel(self.reqs[j], t)
            else:
                self.pf["dropped_stale"] += j >= self.W

    def prefill(self, w: Worker, t: float) -> None:
        i = w.pre_q.popleft()
        m = i >= self.W                          # counted (a measured request's pre-infer)
        if not self.started[i]:
            self.started[i] = True
            self.pf["started"] += m
        out, d = self.timed(w.service.prefill, self.reqs[i], t)
        self.pf["chunks"] += m
        self.pf["service_s"] += d if m else 0.0
        if out.remaining:
            w.pre_q.appendleft(i)                # continue with the next chunk unless a ranking comes first
        elif out.admitted and out.payload is None:
            self.pf["admitted"] += m
            self.done_prefill[i] = True
        elif out.admitted:
            self.ship(w, i, out, t + d)
        elif m:
            self.pf["refused"][out.reason or "unspecified"] += 1
        self.busy(w, d, m)

    def ship(self, w: Worker, i: int, out, t_done: float) -> None:
        """Copy the packed prefix towards the request's ranking worker; it arrives after the measured copy."""
        payload, copy_s = self.timed(w.service.ship, out.payload)
        dst = self.workers[self.rank_at[i]]
        arrival = t_done + copy_s
        heapq.heappush(dst.inbox, (arrival, i, payload))
        if dst.idle:
            dst.t = min(dst.t, arrival)
        if i >= self.W:
            self.tx["transfers"] += 1
            self.tx["transfer_bytes"] += int(payload.nbytes)
            self.tx["pack_s"] += out.pack_s
            self.tx["copy_s"] += copy_s

    def receive(self, w: Worker, t: float) -> None:
        _, i, payload = heapq.heappop(w.inbox)
        m = i >= self.W
        if self.ranked[i]:
            self.tx["late"] += m                 # its ranking came first (and recomputed)
            return
        out, d = self.timed(w.service.receive, self.reqs[i], payload, t)
        self.busy(w, d, m)
        if m:
            self.tx["unpack_s"] += d
        if out.admitted:
            self.done_prefill[i] = True
            self.pf["admitted"] += m
        elif m:
            self.tx["refused"] += 1
            self.pf["refused"][out.reason or "unspecified"] += 1


def as_workers(service: Union[Service, Sequence[Worker]]) -> list[Worker]:
    """One service as one co-located worker, or the workers given."""
    if isinstance(service, (list, tuple)):
        if not service or not all(isinstance(w, Worker) for w in service):
            raise ValueError(f"workers must be a non-empty list of Worker, got {service!r}")
        return list(service)
    return [Worker(service, Role.BOTH)]


# Stats that describe a worker's setup rather than count its work: merged as the workers' common value (None where
# they differ), never summed.
_SETUP_STATS = ("kv_bits",)


def _merged_stats(workers: list[Worker]) -> dict:
    """The workers' service stats, counts summed and setup values (:data:`_SETUP_STATS`) kept (one worker: its stats
    as they are)."""
    if len(workers) == 1:
        return workers[0].service.stats()
    out: dict = {}
    for w in workers:
        for k, v in w.service.stats().items():
            if k in _SETUP_STATS:
                out[k] = v if out.get(k, v) == v else None
            elif isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def simulate(service: Union[Service, Sequence[Worker]], workload: Workload, qps: float, *, mode: str = "",
             timer: Callable[[], float] = time.perf_counter, progress=None,
             stop_over: Optional[tuple[float, int]] = None, batch: Optional[BatchPolicy] = None,
             abort: Optional[Callable[[], bool]] = None) -> RunResult:
    """Serve ``workload`` at ``qps`` with workers on a virtual clock (see the package doc).

    Parameters
    ----------
    service : Service or list of Worker
        A fresh service (one co-located worker), or fresh workers (their cache state is part of the run): built
        for the run, or reset (``service.reset()``: the same state as built, compiled code and graphs kept).
    workload : Workload
    qps : float
        Target mean arrival rate (> 0).
    mode : str
        Label stored in the result.
    timer : callable
        Clock whose differences are the jobs' durations (tests pass a deterministic fake).
    progress : object with ``update(n)``, optional
        Advanced by one per completed ranking request.
    stop_over : (threshold_s, count), optional
        Stop once ``count`` measured ranking requests took longer than ``threshold_s`` (the outcome of a pass/fail
        question such as "P99 <= SLO" is then certain). The result then holds the measured requests served so far
        and ``stopped_early`` is True.
    batch : BatchPolicy, optional
        How many queued rankings a worker serves per call (default: one).
    abort : callable () -> bool, optional
        Asked before every step (a wall-clock deadline): once it returns True the run ends where it is, with
        ``aborted`` True; such a result holds what was served and answers nothing (its caller discards it).

    Returns
    -------
    RunResult
        ``prefill`` counts: ``signals``; ``started`` pre-infers; ``chunks`` run; ``admitted`` (fully cached before
        the ranking, on the ranking's worker); ``refused`` by reason; ``dropped_stale`` (never started: the ranking
        had arrived); ``cut_short`` (started, the ranking arrived before the last chunk); ``service_s`` spent in
        pre-infers; with a disaggregated pre-infer pool also ``transfer``: ``transfers``, ``transfer_bytes``,
        ``pack_s`` / ``copy_s`` / ``unpack_s`` (summed), ``late`` (arrived after the ranking), ``refused`` (the
        ranking worker had no room).
    """
    workers = as_workers(service)
    if workload.num_warmup == len(workload.requests):
        raise ValueError("workload has no measured requests")
    loop = _Loop(workers, workload, qps, timer, progress, stop_over, batch or BatchPolicy())
    wall0 = time.perf_counter()
    aborted = False
    while loop.served < loop.n and not loop.stopped:
        if abort is not None and abort():
            aborted = True
            break
        w = min(workers, key=lambda v: v.t)
        assert math.isfinite(w.t), "no pending event while requests remain unserved"
        loop.admit(w.t)
        loop.step(w)
    res = _result(loop, workers, workload, qps, mode or type(workers[0].service).__name__,
                  time.perf_counter() - wall0)
    res.aborted = aborted
    return res


def _result(loop: _Loop, workers: list[Worker], workload: Workload, qps: float, mode: str, wall: float) -> RunResult:
    W, n, pf = loop.W, loop.n, loop.pf
    for w in workers:                            # every ranking is served: what is left is stale
        loop.tx["late"] += sum(j >= W for _, j, _ in w.inbox)
        cancel = getattr(w.service, "cancel", None)
        for j in w.pre_q:
            pf["cut_short" if loop.started[j] else "dropped_stale"] += j >= W
            if loop.started[j] and cancel is not None:
                cancel(loop.reqs[j], w.t)
    pf["dropped_stale"] += n - max(loop.i_sig, W) if loop.relay else 0
    pf["refused"] = dict(pf["refused"])
    if any(w.role is Role.PREFILL for w in workers):
        pf["transfer"] = dict(loop.tx)
    m = np.flatnonzero(loop.ranked[W:]) + W      # the measured requests served (all of them unless stopped)
    return RunResult(mode=mode, qps=float(qps), arrival_s=loop.arr[m], start_s=loop.start[m],
                     finish_s=loop.finish[m], service_s=loop.service_s[m],
                     history_len=workload.history_lengths()[m], cached_tokens=loop.cached[m],
                     computed_tokens=loop.computed[m], sources=[loop.sources[i] for i in m],
                     had_ticket=loop.had_ticket[m], prefill=pf, engine_stats=_merged_stats(workers),
                     busy_s=sum(w.busy_s for w in workers), work_s=loop.work,
                     window_start_s=loop.first_event() if W < n else 0.0, wall_s=wall,
                     stopped_early=loop.stopped, num_requests=n - W, workers=len(workers))
