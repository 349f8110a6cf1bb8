"""Open-loop serving of a ranking request stream by one device worker, on a virtual clock.

Method
------
One worker (one engine instance, one device) serves two queues: **ranking** (priority) and **pre-infer**
(deferrable). Every request of the workload brings two events: its pre-infer signal at ``arrival - pipeline_delay``
(retrieval knows the user before ranking does) and its ranking request at ``arrival``. Arrivals are open-loop at the
target QPS (:meth:`Workload.arrivals`).

Nothing sleeps. The worker is emulated with a virtual clock ``t``:

1. every event with time ``<= t`` joins its queue;
2. if a ranking request waits, the worker takes the oldest one; otherwise it first drops every queued pre-infer
   whose ranking request has already arrived (counted as ``dropped_stale``: that ranking recomputes, or uses what
   the cache holds) and takes the oldest remaining pre-infer; with both queues empty ``t`` jumps to the next event;
3. the job really runs (the real engine call, given ``now=t`` so cache leases expire on the same clock) and its
   measured duration advances ``t`` (``timer``: wall time, or :func:`cpu_timer`, the thread's CPU time, which
   on a shared CPU machine measures the job's own compute without the time other processes take). Jobs are not
   preempted: a ranking that arrives while a pre-infer runs waits for it.

A ranking request's latency is its completion time minus its arrival time, so queueing behind other rankings and
behind a running pre-infer is counted in full, without any idle waiting: a run costs only the compute it does.

Warm-up
-------
A workload's warm-up requests (:attr:`Workload.num_warmup`, the first ones) are served the same way but not
measured: they leave the caches as a continuously running server would have them. The measured window opens once
every warm-up ranking is served: if the worker is still busy then (a cold start costs more than the steady state),
the measured requests' times are shifted later by that much, so the measured requests never queue behind the
warm-up. A service with ``stateless = True`` (the baseline) skips its warm-up requests: with that rule they could
not change its measured latencies.

Services
--------
A *service* adapts one mode to the loop: ``rank(req, now) -> RankOutcome`` and ``prefill(req, now) ->
PrefillOutcome`` (both do the real work), ``wants_prefill`` (False for the baseline), ``stats()``.
:class:`BaselineService` runs ``model.rank_full`` on the critical path; :class:`RelayService` runs
``engine.prefill_prefix`` for pre-infers and ``engine.rank_with_prefix`` (with the request's ticket when its
pre-infer completed) for rankings.
"""
from __future__ import annotations

import collections
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from .workload import Request, Workload

__all__ = ["Mode", "BaselineImpl", "RankOutcome", "PrefillOutcome", "Service", "BaselineService", "RelayService",
           "RunResult", "simulate", "to_behaviors", "cpu_timer"]


class Mode(str, enum.Enum):
    """Serving modes compared on the same request stream."""

    BASELINE = "baseline"                      # full inference on the critical path (model.rank_full)
    RELAY = "relay"                            # trigger + HBM prefix cache + DRAM expander
    RELAY_NO_EXPANDER = "relay_no_expander"    # trigger + HBM prefix cache, no DRAM tier


@dataclass(frozen=True)
class RankOutcome:
    """What a ranking call reports: where its prefix came from and the tokens cached vs computed."""

    source: str                 # "full" (baseline), "hbm", "dram" or "recompute"
    cached_tokens: int = 0
    computed_tokens: int = 0


@dataclass(frozen=True)
class PrefillOutcome:
    """What a pre-infer call reports: admitted (its prefix part is cached and leased) or not, and why.

    ``remaining``: a chunk was cached and more of the prefix is left (the worker calls again unless the ranking
    request arrives first).
    """

    admitted: bool
    reason: str = ""
    remaining: bool = False


class Service(Protocol):
    """One serving mode as the worker sees it."""

    wants_prefill: bool

    def rank(self, req: Request, now: float) -> RankOutcome: ...

    def prefill(self, req: Request, now: float) -> PrefillOutcome: ...

    def cancel(self, req: Request, now: float) -> None: ...

    def stats(self) -> dict: ...


# ----------------------------------------------------------------------------------------------- adapters
def to_behaviors(req: Request, length: Optional[int] = None, device: str = "cpu"):
    """The request's history (or its first ``length`` tokens) as ``relaygr_engine.Behaviors`` on ``device``."""
    import torch

    from ..models import Behaviors

    n = req.history_len if length is None else length
    return Behaviors(item_ids=torch.from_numpy(np.ascontiguousarray(req.item_ids[:n])).to(device),
                     action_ids=torch.from_numpy(np.ascontiguousarray(req.action_ids[:n])).to(device),
                     timestamps=torch.from_numpy(np.ascontiguousarray(req.timestamps[:n])).to(device))


class _Tensors:
    """Tensors of each request (history, candidates), built once so conversions stay off the measured path."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._cache: dict[int, tuple] = {}

    def prepare(self, requests) -> None:
        import torch

        for r in requests:
            if id(r) not in self._cache:
                self._cache[id(r)] = (to_behaviors(r, device=self.device),
                                      torch.from_numpy(np.ascontiguousarray(r.candidates)).to(self.device))

    def get(self, req: Request) -> tuple:
        if id(req) not in self._cache:
            self.prepare([req])
        return self._cache[id(req)]


class BaselineImpl(str, enum.Enum):
    """How the baseline runs full inference."""

    PAGED = "paged"    # model.rank_uncached: the engine's attention op with an empty prefix (same kernels as relay)
    DENSE = "dense"    # model.rank_full: dense masked N x N attention (the oracle)


class BaselineService:
    """Full inference on the critical path, no pre-infer.

    ``impl="paged"`` (default) runs ``model.rank_uncached``: the same attention kernels as the relay engine with no
    cached prefix, so the comparison isolates the cache. ``impl="dense"`` runs ``model.rank_full`` (the dense
    oracle, several times slower on long histories: a baseline that would flatter the cache).
    """

    wants_prefill = False
    stateless = True  # no state carries from one request to the next: warm-up requests need not run

    def __init__(self, model, device: str = "cpu", impl: str = "paged") -> None:
        from ..config import parse_choice

        self.model = model
        self.impl = parse_choice(BaselineImpl, impl, "impl")
        self._rank = model.rank_uncached if self.impl is BaselineImpl.PAGED else model.rank_full
        self._t = _Tensors(device)

    def prepare(self, requests) -> None:
        self._t.prepare(requests)

    def rank(self, req: Request, now: float) -> RankOutcome:
        import torch

        hist, cands = self._t.get(req)
        with torch.inference_mode():
            scores = self._rank(hist, cands, request_time=req.request_ts)
        _sync(scores)
        return RankOutcome("full", 0, req.history_len + int(cands.shape[0]))

    def prefill(self, req: Request, now: float) -> PrefillOutcome:
        raise AssertionError("the baseline never pre-infers")

    def stats(self) -> dict:
        return {}


class TriggerHook:
    """Wraps a :class:`~relaygr_engine.policy.SequenceAwareTrigger` so that a chunked pre-infer is decided once.

    ``RelayEngine`` asks its trigger ``decide(history_len=T, ..., now=t, reserve=True)`` on every prefill call and
    reports ``on_prefill_done(T, now=t)`` after it. A chunked pre-infer of one request is several calls on growing
    prefixes, and judging each chunk by its own length would call the first chunks "not at risk". The hook therefore
    decides once per request, on the request's whole history (what its ranking would cost without a cache), its
    candidates and the pages of its whole prefix, reserves those tokens with the trigger, repeats that decision for
    the request's later chunks, and reports the pre-infer done once, when the service says it is over (completed,
    refused, or cut short by its ranking).
    """

    def __init__(self, trigger) -> None:
        self.trigger = trigger
        self.page_size = 1                       # set by RelayService to its engine's page size
        self._req: Optional[Request] = None
        self._now = 0.0
        self._decision = None
        self.reserved: dict[int, int] = {}       # request index -> tokens reserved with the trigger

    def begin(self, req: Request, now: float) -> None:
        """Called by the service before each prefill call of ``req``."""
        if self._req is not req:
            self._req, self._decision = req, None
        self._now = now

    def decide(self, *, history_len: int, num_candidates=None, prefix_pages: int, pinned_pages: int,
               num_pages: int, now: Optional[float] = None, reserve: bool = False):
        if self._decision is not None:
            return self._decision
        req = self._req
        assert req is not None, "TriggerHook.begin was not called before the engine's prefill"
        d = self.trigger.decide(history_len=req.history_len, num_candidates=int(req.candidates.shape[0]),
                                prefix_pages=-(-req.prefix_len // self.page_size), pinned_pages=pinned_pages,
                                num_pages=num_pages, now=self._now if now is None else now, reserve=True)
        if d.admit:
            self.reserved[req.index] = req.history_len      # what decide(reserve=True) counted
        self._decision = d
        return d

    def on_prefill_done(self, tokens: int, now: Optional[float] = None) -> None:
        """The engine's per-call report; the request's reservation is released by :meth:`finish` instead."""

    def finish(self, req: Request, now: float) -> None:
        """The request's pre-infer is over (done, refused, or cut short by its ranking)."""
        tokens = self.reserved.pop(req.index, None)
        if tokens is not None:
            self.trigger.on_prefill_done(tokens, now=now)

    def stats(self, now: Optional[float] = None) -> dict:
        return self.trigger.stats(now=self._now if now is None else now)


class RelayService:
    """Relay-race serving on a ``RelayEngine``: pre-infer the prefix at the signal, rank against the cache.

    A pre-infer runs as chunks of at most ``chunk_tokens`` new tokens (0: one call), each a ``prefill_prefix`` call
    on a longer prefix that extends the entry the previous chunk cached, so a ranking request waits for one chunk at
    most and uses whatever part is done (the engine reuses the longest cached prefix). The first chunk starts at
    what the cache already holds for the user (``engine.match_length``). The newest admitted ticket is passed to the
    request's ranking, which ends its lease; a ranking without one calls ``rank_with_prefix`` without a ticket.

    Parameters
    ----------
    engine : RelayEngine
    trigger_hook : TriggerHook, optional
        The hook the engine was built with (so the service can feed it the request and the virtual time).
    chunk_tokens : int
        Largest chunk of a pre-infer (0: the whole prefix at once).
    """

    wants_prefill = True

    def __init__(self, engine, trigger_hook: Optional[TriggerHook] = None, chunk_tokens: int = 0,
                 device: str = "cpu") -> None:
        if not isinstance(chunk_tokens, int) or chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be an integer >= 0, got {chunk_tokens!r}")
        self.engine = engine
        self.hook = trigger_hook
        if trigger_hook is not None:
            if getattr(engine, "trigger", None) is not trigger_hook:
                raise ValueError("trigger_hook must be the trigger the engine was built with")
            trigger_hook.page_size = int(engine.page_size)
        self.chunk_tokens = chunk_tokens
        self._t = _Tensors(device)
        self._tickets: dict[int, Any] = {}
        self._done: dict[int, int] = {}           # request index -> prefix tokens cached so far
        self._now = 0.0

    def prepare(self, requests) -> None:
        self._t.prepare(requests)

    def prefill(self, req: Request, now: float) -> PrefillOutcome:
        import torch

        hist, _ = self._t.get(req)
        self._now = now
        P = req.prefix_len
        if P == 0:
            return PrefillOutcome(False, "empty_prefix")
        if req.index not in self._done:
            self._done[req.index] = self.engine.match_length(req.user_id, hist.prefix(P))
        target = P if self.chunk_tokens == 0 else min(P, max(self._done[req.index], 0) + self.chunk_tokens)
        if self.hook is not None:
            self.hook.begin(req, now)
        with torch.inference_mode():
            ticket = self.engine.prefill_prefix(user_id=req.user_id, history=hist.prefix(target), now=now)
        _sync(None)
        if not ticket.admitted:
            self.cancel(req, now)
            return PrefillOutcome(False, ticket.reason)
        self._tickets[req.index] = ticket
        self._done[req.index] = target
        if target < P:
            return PrefillOutcome(True, ticket.reason, remaining=True)
        self._finish(req, now)
        return PrefillOutcome(True, ticket.reason)

    def cancel(self, req: Request, now: float) -> None:
        """The request's pre-infer ends early (refused, or its ranking arrived)."""
        self._finish(req, now)

    def _finish(self, req: Request, now: float) -> None:
        self._done.pop(req.index, None)
        if self.hook is not None:
            self.hook.finish(req, now)

    def rank(self, req: Request, now: float) -> RankOutcome:
        import torch

        hist, cands = self._t.get(req)
        self._now = now
        ticket = self._tickets.pop(req.index, None)
        with torch.inference_mode():
            res = self.engine.rank_with_prefix(user_id=req.user_id, history=hist, candidates=cands,
                                               ticket=ticket, request_time=req.request_ts, now=now)
        _sync(res.scores)
        return RankOutcome(str(res.source), int(res.cached_tokens), int(res.computed_tokens))

    def stats(self) -> dict:
        s = dict(self.engine.stats())      # includes the trigger's counters when the engine has one
        if self.hook is not None:
            s.update(self.hook.stats(self._now))
        return s


def cpu_timer() -> float:
    """CPU time of the calling thread (s): a job's service time free of other processes' load on a shared machine.

    Valid as a service-time clock when the job's compute runs on the calling thread (CPU device, one intra-op
    thread); accelerator work or extra threads are not counted, use ``time.perf_counter`` there.
    """
    return time.thread_time()


def _sync(t) -> None:
    """Wait for queued device work so the measured duration covers it (no-op on CPU)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------- the loop
@dataclass
class RunResult:
    """One open-loop run of one mode at one QPS.

    Per-request arrays are indexed like ``workload.measured`` (arrival order, warm-up requests left out); times are
    virtual seconds with the first pre-infer signal at 0 (the first ranking arrives at ``pipeline_delay_s``). A run
    stopped early (``stopped_early``) holds only the first measured requests, of ``num_requests``. ``prefill``
    counts the measured requests' pre-infers and ``work_s`` is the time of their jobs (rankings and pre-infers),
    from ``window_start_s`` (the first measured event) on; ``engine_stats`` and ``busy_s`` cover the whole run.
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

    @property
    def latency_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s.max())

    def source_counts(self) -> dict[str, int]:
        return dict(collections.Counter(self.sources))


def simulate(service: Service, workload: Workload, qps: float, *, mode: str = "",
             timer: Callable[[], float] = time.perf_counter, progress=None,
             stop_over: Optional[tuple[float, int]] = None) -> RunResult:
    """Serve ``workload`` at ``qps`` with one worker on a virtual clock (see the module doc).

    Parameters
    ----------
    service : Service
        A fresh service (its cache state is part of the run).
    workload : Workload
    qps : float
        Target mean arrival rate (> 0).
    mode : str
        Label stored in the result.
    timer : callable
        Wall clock whose differences are the jobs' durations (tests pass a deterministic fake).
    progress : object with ``update(n)``, optional
        Advanced by one per completed ranking request.
    stop_over : (threshold_s, count), optional
        Stop once ``count`` measured ranking requests took longer than ``threshold_s`` (the outcome of a pass/fail question
        such as "P99 <= SLO" is then certain). The result then holds the requests served so far (rankings are
        served in arrival order, so they are the first ones) and ``stopped_early`` is True.

    Returns
    -------
    RunResult
        ``prefill`` counts: ``signals``; ``started`` pre-infers; ``chunks`` run; ``admitted`` (fully cached before
        the ranking); ``refused`` by reason; ``dropped_stale`` (never started: the ranking had arrived);
        ``cut_short`` (started, the ranking arrived before the last chunk); ``service_s`` spent in pre-infers.
    """
    reqs = workload.requests
    n = len(reqs)
    W = workload.num_warmup
    if n == W:
        raise ValueError("workload has no measured requests")
    delay = workload.config.pipeline_delay_s
    arr = workload.arrivals(qps) + delay          # first signal at virtual time 0
    sig = arr - delay
    relay = bool(service.wants_prefill)
    cancel = getattr(service, "cancel", None)

    start = np.zeros(n)
    finish = np.zeros(n)
    service_s = np.zeros(n)
    cached = np.zeros(n, dtype=np.int64)
    computed = np.zeros(n, dtype=np.int64)
    had_ticket = np.zeros(n, dtype=bool)
    sources = [""] * n
    done_prefill = np.zeros(n, dtype=bool)
    started = np.zeros(n, dtype=bool)
    pf = {"signals": n - W if relay else 0, "started": 0, "chunks": 0, "admitted": 0, "dropped_stale": 0,
          "cut_short": 0, "service_s": 0.0, "refused": collections.Counter()}

    rank_q: collections.deque[int] = collections.deque()
    pre_q: collections.deque[int] = collections.deque()
    skip = W if getattr(service, "stateless", False) else 0   # a stateless service needs no warm-up
    i_sig = skip if relay else n
    i_arr = skip
    served = skip
    opened = W == skip                           # the measured window is open (its events may be queued)
    busy = 0.0
    work = 0.0                                   # time spent on the measured requests' jobs
    t = 0.0 if relay else float(arr[0])
    wall0 = time.perf_counter()
    over = 0
    stopped = False
    if skip and n > W:
        t = float(sig[W] if relay else arr[W])
    while served < n:
        if not opened and served >= W:          # warm-up rankings all served: open the measured window, delayed
            shift = max(0.0, t - float(sig[W] if relay else arr[W]))   # until the worker is free if need be
            arr[W:] += shift
            sig[W:] += shift
            opened = True
        lim = n if opened else W
        while i_sig < lim and sig[i_sig] <= t:
            pre_q.append(i_sig)
            i_sig += 1
        while i_arr < lim and arr[i_arr] <= t:
            rank_q.append(i_arr)
            i_arr += 1
        if rank_q:
            i = rank_q.popleft()
            had_ticket[i] = done_prefill[i]
            t0 = timer()
            out = service.rank(reqs[i], t)
            d = timer() - t0
            start[i], finish[i], service_s[i] = t, t + d, d
            sources[i], cached[i], computed[i] = out.source, out.cached_tokens, out.computed_tokens
            t += d
            busy += d
            work += d if i >= W else 0.0
            served += 1
            if progress is not None:
                progress.update(1)
            if stop_over is not None and i >= W and t - arr[i] > stop_over[0]:
                over += 1
                if over >= stop_over[1] and served < n:
                    stopped = True
                    break
            continue
        while pre_q and arr[pre_q[0]] <= t:      # its ranking already arrived (and, with priority, was served)
            j = pre_q.popleft()
            if started[j]:
                pf["cut_short"] += j >= W
                if cancel is not None:
                    cancel(reqs[j], t)
            else:
                pf["dropped_stale"] += j >= W
        if pre_q:
            i = pre_q.popleft()
            m = i >= W                           # counted (a measured request's pre-infer)
            if not started[i]:
                started[i] = True
                pf["started"] += m
            t0 = timer()
            out = service.prefill(reqs[i], t)
            d = timer() - t0
            pf["chunks"] += m
            pf["service_s"] += d if m else 0.0
            work += d if m else 0.0
            if out.remaining:
                pre_q.appendleft(i)              # continue with the next chunk unless a ranking comes first
            elif out.admitted:
                pf["admitted"] += m
                done_prefill[i] = True
            elif m:
                pf["refused"][out.reason or "unspecified"] += 1
            t += d
            busy += d
            continue
        nxt = min(sig[i_sig] if i_sig < lim else math.inf, arr[i_arr] if i_arr < lim else math.inf)
        assert math.isfinite(nxt), "no pending event while requests remain unserved"
        t = max(t, float(nxt))
    for j in pre_q:                              # every ranking is served: what is left is stale
        pf["cut_short" if started[j] else "dropped_stale"] += j >= W
        if started[j] and cancel is not None:
            cancel(reqs[j], t)
    pf["dropped_stale"] += n - max(i_sig, W) if relay else 0
    pf["refused"] = dict(pf["refused"])
    k = max(served, W)                           # rankings are served in arrival order: requests 0..served-1
    m = slice(W, k)                              # the measured ones among them
    return RunResult(mode=mode or type(service).__name__, qps=float(qps), arrival_s=arr[m], start_s=start[m],
                     finish_s=finish[m], service_s=service_s[m], history_len=workload.history_lengths()[m],
                     cached_tokens=cached[m], computed_tokens=computed[m], sources=sources[m],
                     had_ticket=had_ticket[m], prefill=pf, engine_stats=service.stats(), busy_s=busy, work_s=work,
                     window_start_s=float(sig[W] if relay else arr[W]) if W < n else 0.0,
                     wall_s=time.perf_counter() - wall0, stopped_early=stopped, num_requests=n - W)
