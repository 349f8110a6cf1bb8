"""The same LoadGen queries sent to a running ``relaygr serve`` over HTTP: :class:`HTTPDriver`.

A query is a user's request arriving at retrieval. In a relay mode the driver sends its pre-infer at once
(``POST /prefill``, forwarded past replicas that reject it) and its ranking ``delay_s`` later (``POST /rank``): with
the ticket when the pre-infer's reply has come back by then (the ranking then goes to the ticket's replica and by
difference, :class:`~relaygr_engine.serving.http_client.RelayHTTPClient`), else without one (the replica drops the
pre-infer if it is still waiting, and the ranking uses whatever prefix the replica holds). The baseline sends only
the ranking, with ``"full_inference": true`` (``model.rank_uncached`` on the replica, the cache untouched). A query
is answered to LoadGen when its ranking's reply has arrived; the requests run on a pool of client threads, a
ranking's thread sleeping until it is due and sending it itself.

Users are renamed per run (``user_id + user_offset``) so that every run meets a server whose cache holds none of
its users' prefixes, as a fresh in-process worker does; :func:`warm_up` then serves the run's warm-up requests
(closed loop: pre-infer, then rank) so the cache reaches its steady state before LoadGen starts.

Exactness: the scores of every ``check_every``-th query are kept (:attr:`HTTPDriver.kept`) for a comparison with
full inference after the run.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from .loadgen_server import QueryLog
from .sim import to_behaviors
from ..workload.requests import Request

__all__ = ["HTTPDriver", "warm_up", "max_abs_diff"]


def _inputs(req: Request, user_offset: int) -> tuple:
    import torch

    return (req.user_id + user_offset, to_behaviors(req),
            torch.from_numpy(np.ascontiguousarray(req.candidates)), int(req.request_ts))


def warm_up(client, requests: Sequence[Request], user_offset: int) -> None:
    """Serve ``requests`` one after another, pre-infer then ranking with its ticket (the server's cache then holds
    what a server that had served them would)."""
    for req in requests:
        user, hist, cands, t_req = _inputs(req, user_offset)
        pre = client.prefill(user, hist.prefix(req.prefix_len)) if req.prefix_len else None
        client.rank(user, hist, cands, pre, request_time=t_req)


class HTTPDriver:
    """Send a run's queries to ``relaygr serve`` (see the module doc); the interface of
    :class:`~relaygr_engine.bench.loadgen_server.InProcessDriver`.

    Parameters
    ----------
    client : RelayHTTPClient
    requests : sequence of Request
        Query ``k`` serves ``requests[k]``.
    delay_s : float
        Retrieval-to-ranking delay (>= 0).
    relay : bool
        Pre-infer at the query and rank with the ticket (else: ranking by full inference only).
    answered : callable
        ``answered(tag)`` once query ``tag``'s ranking reply has arrived.
    user_offset : int
        Added to every user id.
    threads : int
        Client threads (>= 1): each query holds one from its arrival to its ranking's reply (sleeping until the
        ranking is due), a relay query one more for its pre-infer, so QPS x (delay + latency) at least.
    check_every : int
        Keep the scores of every this many-th query (0: none).
    """

    def __init__(self, client, requests: Sequence[Request], delay_s: float, relay: bool,
                 answered: Callable[[object], None], user_offset: int = 0, threads: int = 64,
                 check_every: int = 10, clock: Callable[[], float] = time.perf_counter) -> None:
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.client, self.requests, self.delay_s, self.relay = client, list(requests), float(delay_s), bool(relay)
        self.answered, self.user_offset, self.check_every, self.clock = answered, user_offset, check_every, clock
        self.log = QueryLog(len(self.requests))
        self.kept: dict = {}                        # k -> scores of the checked queries
        self.stages: dict = collections.defaultdict(list)   # Server-Timing stage -> ms of each ranking
        self._inputs = [_inputs(r, user_offset) for r in self.requests]
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="relaygr-http")
        self._tickets: dict = {}
        self._cv = threading.Condition()
        self._pending = 0

    def submit(self, k: int, tag) -> None:
        """Query ``k`` arrives now (returns at once)."""
        t = self.clock()
        with self._cv:
            self.log.arrive(k, t, self.delay_s)
            self._pending += 1
        if self.relay and self.requests[k].prefix_len:
            self._count("signals")
            self._pool.submit(self._prefill, k)
        self._pool.submit(self._rank_when_due, k, tag)

    def _count(self, *keys: str) -> None:
        with self._cv:
            for key in keys:
                self.log.prefill[key] += 1

    def close(self, timeout_s: float = 600.0) -> QueryLog:
        """Wait until every submitted query is answered; the run's :class:`QueryLog`."""
        end = self.clock() + timeout_s
        with self._cv:
            while self._pending and self.clock() < end:
                self._cv.wait(timeout=1.0)
        self._pool.shutdown(wait=True)
        if self._pending:
            raise RuntimeError(f"{self._pending} queries were not answered within {timeout_s:g} s")
        self.log.prefill = dict(self.log.prefill)
        return self.log

    # ------------------------------------------------------------------------------------------ threads
    def _rank_when_due(self, k: int, tag) -> None:
        """Sleep until the ranking is due, then send it from this thread (no hand-over at the due time)."""
        wait = self.log.due[k] - self.clock()
        if wait > 0:
            time.sleep(wait)
        self._rank(k, tag)

    def _prefill(self, k: int) -> None:
        user, hist, _, _ = self._inputs[k]
        try:
            reply = self.client.prefill(user, hist.prefix(self.requests[k].prefix_len))
        except Exception as e:  # noqa: BLE001 - a failed pre-infer costs its ranking only time; counted
            self._count("failed", f"error:{type(e).__name__}")
            return
        with self._cv:
            if np.isnan(self.log.start[k]):          # its ranking has not been sent yet
                self._tickets[k] = reply
            else:
                self.log.prefill["late"] += 1
        self._count("admitted" if reply.admitted else f"refused:{reply.reason}")

    def _rank(self, k: int, tag) -> None:
        user, hist, cands, t_req = self._inputs[k]
        with self._cv:
            self.log.start[k] = self.clock()
            ticket = self._tickets.pop(k, None)
        self.log.had_ticket[k] = ticket is not None and ticket.admitted
        try:
            reply = self.client.rank(user, hist, cands, ticket, request_time=t_req, full_inference=not self.relay)
            self.log.source[k] = reply.source
            with self._cv:
                for stage, ms in reply.timing.items():
                    self.stages[stage].append(ms)
                if self.check_every and k % self.check_every == 0:
                    self.kept[k] = reply.scores
        except Exception as e:  # noqa: BLE001 - recorded and reported after the run, never lost
            self.log.error[k] = f"{type(e).__name__}: {e}"
        finally:
            self.log.done[k] = self.clock()
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()
            self.answered(tag)

    def expected(self, model, k: int, device: str = "cpu"):
        """Full inference of query ``k`` on ``model`` (``rank_uncached``), float32 ``[C, num_tasks]``."""
        import torch

        _, hist, cands, t_req = self._inputs[k]
        with torch.inference_mode():
            return model.rank_uncached(hist.to(device), cands.to(device), request_time=t_req).float().cpu()


def max_abs_diff(driver: HTTPDriver, model, device: str = "cpu") -> Optional[float]:
    """Largest absolute difference between the kept scores and full inference (None when none were kept)."""
    diffs = [float((s - driver.expected(model, k, device)).abs().max()) for k, s in driver.kept.items()]
    return max(diffs) if diffs else None
