"""One worker on a virtual clock: the open-loop serving loop and its result (see :mod:`relaygr_engine.bench.serving`)."""
from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..workload import Workload
from .services import Service

__all__ = ["RunResult", "simulate"]


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
