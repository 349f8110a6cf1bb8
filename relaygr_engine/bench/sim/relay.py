"""The relay policy: pre-infer the prefix at the signal (in chunks), rank against the cache."""
from __future__ import annotations

from typing import Any, Optional

from ...workload.requests import Request
from .services import PrefillOutcome, RankOutcome, _sync, _Tensors

__all__ = ["TriggerHook", "AdmitAll", "RelayService"]


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

    def reset(self, trigger) -> None:
        """Start afresh with ``trigger`` (a new run: no request, decision or reservation carried over)."""
        self.trigger = trigger
        self._req, self._now, self._decision = None, 0.0, None
        self.reserved = {}

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


class AdmitAll:
    """A trigger that admits every pre-infer (a :class:`TriggerHook`'s trigger while a run warms code paths up)."""

    def decide(self, **kwargs):
        from ...policy import TriggerDecision

        return TriggerDecision(True, "at_risk", 0.0)

    def on_prefill_done(self, tokens: int, now: Optional[float] = None) -> None:
        pass

    def stats(self, now: Optional[float] = None) -> dict:
        return {}


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

    def reset(self, trigger=None) -> None:
        """Serve a new run as a freshly built service would: the engine emptied (:meth:`RelayEngine.reset`: its
        compiled model and captured graphs kept), the trigger hook given ``trigger`` (a new one per run), no
        tickets, chunks or request tensors kept."""
        self.engine.reset()
        if self.hook is not None:
            self.hook.reset(trigger if trigger is not None else self.hook.trigger)
        self._t = _Tensors(self._t.device)
        self._tickets, self._done, self._now = {}, {}, 0.0

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
        return self.rank_batch([req], now)[0]

    def rank_batch(self, reqs: list[Request], now: float) -> list[RankOutcome]:
        """Rank ``reqs`` in one varlen forward (``engine.rank_with_prefix_batch``), each with its ticket."""
        import torch

        from ...engine import RankRequest

        self._now = now
        batch = []
        for req in reqs:
            hist, cands = self._t.get(req)
            batch.append(RankRequest(req.user_id, hist, cands, self._tickets.pop(req.index, None), req.request_ts))
        with torch.inference_mode():
            results = self.engine.rank_with_prefix_batch(batch, now=now)
        _sync(results[-1].scores)
        return [RankOutcome(str(r.source), int(r.cached_tokens), int(r.computed_tokens)) for r in results]

    def export(self, req: Request, now: float):
        """Pack the request's pre-inferred prefix for another worker (``engine.export_prefix``), ending its lease
        here; None when it has no admitted ticket or the entry is gone."""
        ticket = self._tickets.pop(req.index, None)
        if ticket is None:
            return None
        hist, _ = self._t.get(req)
        packed = self.engine.export_prefix(ticket, hist.prefix(ticket.num_tokens), now=now)
        _sync(None)
        return packed

    def receive(self, req: Request, packed, now: float) -> PrefillOutcome:
        """Store the request's prefix shipped by a pre-infer worker (``engine.import_prefix``); its ticket goes to
        the ranking."""
        hist, _ = self._t.get(req)
        self._now = now
        ticket = self.engine.import_prefix(hist.prefix(packed.num_tokens), packed, now=now)
        _sync(None)
        if ticket.admitted:
            self._tickets[req.index] = ticket
        return PrefillOutcome(ticket.admitted, ticket.reason)

    def stats(self) -> dict:
        s = dict(self.engine.stats())      # includes the trigger's counters when the engine has one
        if self.hook is not None:
            s.update(self.hook.stats(self._now))
        return s
