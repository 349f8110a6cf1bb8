"""Relay-race inference: pre-infer a user's prefix early, keep its per-layer KV as pages, rank against it later.

``prefill_prefix`` (at retrieval time) computes a user's history KV and stores it in the
:class:`~relaygr_engine.cache.PagedKVCache` under a *lease*, so it stays resident until the ranking request comes.
``rank_with_prefix`` (the ranking stage) reuses the longest cached prefix that is exactly the first tokens of the
request's history, computes only the remaining history tokens and the candidates through
:func:`~relaygr_engine.ops.paged_prefix_attention`, and ends the lease. Whatever the cache holds, the scores equal
the model's full inference (``GRRanker.rank_full``); a miss only costs time (``source="recompute"``).

Prefix identity
---------------
An entry is keyed by ``(user_id, fingerprint)``. The fingerprint of the first ``n`` history tokens is a 64-bit
BLAKE2b hash of the model's :attr:`~relaygr_engine.models.GRRanker.identity` (config + weight bytes; it changes
on ``load_state_dict`` or any in-place weight edit, so KV from other weights is never reused), whether the history
has action ids and timestamps, and the first ``n`` rows of ``GRRanker.token_keys`` (kind, id, action, timestamp of
each token). A request reuses an entry of ``n`` tokens only when the fingerprint of its own first ``n`` tokens is
equal, so a history changed anywhere in the cached part (e.g. at the front) recomputes.

Prefill tickets (``PrefixTicket.reason``)
-----------------------------------------
``"admitted"``
    The KV was computed and stored, leased for ``CacheConfig.lease_ttl_s``. When the user's cached entry was a
    shorter prefix of this history, that entry was *extended* (only the new tokens computed; ``cached_tokens``
    says how many were reused) and re-keyed; a ticket for the shorter entry then becomes stale (harmless).
``"already_cached"``
    This exact prefix was already cached; its lease was renewed (admitted).
``"trigger:<reason>"``
    The trigger declined the pre-inference (not admitted; nothing computed).
``"pool_full"``
    The pages pinned now (other leased prefixes waiting for their ranking, ranking reads) leave no room for this
    prefix within the pinned-page budget (``CacheConfig.max_pinned_fraction``); not admitted. Unpinned entries
    never block a prefill: they are evicted in LRU order.
``"budget"``
    The prefix alone needs more pages than the pinned-page budget allows; it can never be admitted in this pool.

Ranking
-------
A ranking read pins the entry it uses (never refused) and unpins it afterwards. A presented, admitted ticket ends
its lease (the entry stays cached, evictable in LRU order). With ``extend_on_rank`` (default), the new history
tokens' KV computed while ranking is appended to the entry used (``pool.extend``, re-keyed to the longer prefix)
when pages are available and no other lease holds the entry, so the user's next request reuses more.

Trigger
-------
``trigger`` is None (admit every prefill the pool can take) or a
:class:`~relaygr_engine.policy.trigger.SequenceAwareTrigger` (or any object with the same two methods). Before any
page is taken, the engine calls ``decide(history_len=T, num_candidates=None, prefix_pages=ceil(T / page_size),
pinned_pages=..., num_pages=..., now=t, reserve=True)``; ``decision.admit`` and ``decision.reason`` say whether to
pre-infer. An admitted prefill is reported back with ``on_prefill_done(T, now=t)`` once it ends (stored, refused by
the pool or failed), so the trigger's load bound counts only work in flight. The trigger's counters
(``trigger_admits``, ``trigger_declines``, ...) appear in :meth:`RelayEngine.stats`.

DRAM tier (memory-aware expander)
---------------------------------
With ``CacheConfig(dram_bytes > 0)`` the engine keeps a :class:`~relaygr_engine.tiers.HostKVTier`. An entry is
spilled to it as one contiguous copy (:meth:`~relaygr_engine.cache.PagedKVCache.pack`) when it becomes evictable: after the ranking that
read it, or when its pre-infer lease ends unused (checked at the start of every engine call, before anything could
evict it). An entry already in DRAM under the same key is not copied again, and a user's spill replaces its older
(shorter) DRAM entries. A ranking request whose longest matching prefix is only in DRAM reloads it into pages (one
copy, :meth:`~relaygr_engine.cache.PagedKVCache.unpack`) when :class:`~relaygr_engine.tiers.ReloadCostModel` predicts that reloading is
cheaper than recomputing; its result says ``source="dram"``. Engine calls are serialised, so concurrent rankings of
one user cause one reload, and the later ones read the reloaded pages (``source="hbm"``).

Thread safety: every public method holds one engine lock (the pool itself is also thread-safe).
"""
from __future__ import annotations

import hashlib
import math
import operator
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .cache import PagedKVCache
from .config import CacheConfig
from .models import Behaviors, GRRanker
from .tiers import DramEntry, HostKVTier, ReloadCostModel

__all__ = ["PrefixTicket", "RankRequest", "RankResult", "RelayEngine"]

_U64 = 1 << 64


@dataclass(frozen=True)
class PrefixTicket:
    """What ``prefill_prefix`` did; present it to ``rank_with_prefix`` to end the pre-infer lease.

    Attributes
    ----------
    admitted : bool
        The prefix is cached and leased.
    reason : str
        ``"admitted"``, ``"already_cached"``, ``"trigger:<reason>"``, ``"pool_full"`` or ``"budget"`` (see
        :mod:`relaygr_engine.engine`).
    user_id, fingerprint : int
        The cache key of the prefix.
    num_tokens : int
        History tokens in the prefix (contextual tokens + behaviors).
    expires_at : float or None
        Pool-clock time (``time.monotonic()`` seconds, or the ``now`` given) when the lease ends; None if not
        admitted.
    cached_tokens : int
        Tokens whose KV was already cached (reused, not recomputed).
    computed_tokens : int
        Tokens whose KV this prefill computed.
    """

    admitted: bool
    reason: str
    user_id: int
    fingerprint: int
    num_tokens: int
    expires_at: Optional[float]
    cached_tokens: int = 0
    computed_tokens: int = 0


@dataclass(frozen=True, eq=False)
class RankRequest:
    """One ranking request: a user's full current history and candidates.

    ``request_time`` is the candidates' timestamp in seconds (default: the last behavior's timestamp).
    """

    user_id: int
    history: Behaviors
    candidates: torch.Tensor
    ticket: Optional[PrefixTicket] = None
    request_time: Optional[int] = None


@dataclass(frozen=True, eq=False)
class RankResult:
    """Scores of one request and how they were computed.

    Attributes
    ----------
    scores : Tensor [C, num_tasks]
    source : str
        ``"hbm"`` (a prefix was reused from the device cache), ``"dram"`` (a prefix was reloaded from the host
        DRAM tier) or ``"recompute"`` (nothing reusable was cached).
    cached_tokens : int
        History tokens read from the cache.
    computed_tokens : int
        Rows computed now: the remaining history tokens plus the candidates.
    """

    scores: torch.Tensor
    source: str
    cached_tokens: int
    computed_tokens: int


# ------------------------------------------------------------------------------------------ internal records
@dataclass(eq=False)
class _Prep:
    """A validated request."""

    user_id: int
    history: Behaviors
    candidates: Optional[torch.Tensor]
    request_time: Optional[int]
    keys: np.ndarray  # GRRanker.token_keys: [T, 4]
    ticket: Optional[PrefixTicket] = None

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[0]


@dataclass(eq=False)
class _Job:
    """Rows to compute for one request: history tokens ``start..T-1`` (+ candidates) over ``start`` cached ones."""

    prep: _Prep
    start: int
    pages: Optional[np.ndarray]  # the entry's pages (its first ceil(start / page_size) hold the prefix)
    candidates: Optional[torch.Tensor]
    key: Optional[tuple[int, int]] = None  # the pinned entry read (rank) or written (prefill)
    index: int = 0


@dataclass(eq=False)
class _Pin:
    key: tuple[int, int]
    pages: np.ndarray
    num_tokens: int
    broken: bool = False  # its KV could not be completed: free it


def _user_id(value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"user_id must be an integer in [0, 2**64), got {value!r}")
    try:
        u = operator.index(value)
    except TypeError:
        raise ValueError(f"user_id must be an integer in [0, 2**64), got {type(value).__name__}") from None
    if not 0 <= u < _U64:
        raise ValueError(f"user_id must be an integer in [0, 2**64), got {u}")
    return u


def _clock(now) -> float:
    if now is None:
        return time.monotonic()
    try:
        t = float(now)
    except (TypeError, ValueError):
        raise ValueError(f"now must be a finite time in seconds, got {now!r}") from None
    if not math.isfinite(t):
        raise ValueError(f"now must be a finite time in seconds, got {now!r}")
    return t


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class RelayEngine:
    """Relay-race inference for one :class:`~relaygr_engine.models.GRRanker` over a paged prefix-KV cache.

    Parameters
    ----------
    model : GRRanker
        On the cache's device.
    cache_config : CacheConfig, optional
        Where and how the cache lives (default ``CacheConfig()``: CPU, fp32, 4096 pages of 16 tokens).
    trigger : object, optional
        Pre-inference admission hook (see the module docstring); None admits every prefill the pool can take.
    extend_on_rank : bool
        Append the new history tokens' KV to the reused entry after ranking (default True).
    """

    def __init__(self, model: GRRanker, cache_config: Optional[CacheConfig] = None, trigger=None, *,
                 extend_on_rank: bool = True) -> None:
        if not isinstance(model, GRRanker):
            raise ValueError(f"model must be a GRRanker, got {type(model).__name__}")
        cache_config = CacheConfig() if cache_config is None else cache_config
        if not isinstance(cache_config, CacheConfig):
            raise ValueError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
        if not _same_device(model.device, torch.device(cache_config.device)):
            raise ValueError(f"model must be on the cache device {cache_config.device}, got {model.device}")
        if trigger is not None and not all(callable(getattr(trigger, m, None)) for m in ("decide", "on_prefill_done")):
            raise ValueError(f"trigger must be None or have decide(...) and on_prefill_done(...) methods, got "
                             f"{type(trigger).__name__}")
        cfg = model.config
        self.model = model
        self.config = cache_config
        self.trigger = trigger
        self.extend_on_rank = bool(extend_on_rank)
        self.cache = PagedKVCache(cache_config, cfg.num_layers, cfg.num_heads, cfg.head_dim)
        self.pool = self.cache.pool
        self.page_size = self.cache.page_size
        self.dram = (HostKVTier(cache_config.dram_bytes, pin_memory=self.cache.device.type == "cuda")
                     if cache_config.dram_bytes > 0 else None)
        self.expander = ReloadCostModel()
        self._leased: dict[tuple[int, int], float] = {}  # admitted entries -> lease end, to spill unused ones
        self._lock = threading.RLock()
        self._c = dict(rank_requests=0, hbm_hits=0, dram_hits=0, recomputes=0, reloads=0, reload_bytes=0,
                       reloads_declined_cost=0, reloads_refused=0, spills=0, spill_bytes=0, cached_tokens=0,
                       computed_tokens=0, candidates=0, extensions=0, late_tickets=0, stale_tickets=0,
                       prefills=0, prefill_already_cached=0, prefill_declines=0, prefill_declines_trigger=0,
                       prefill_declines_budget=0, prefill_declines_pool_full=0, prefill_computed_tokens=0,
                       prefill_reused_tokens=0)

    def __repr__(self) -> str:
        return (f"RelayEngine(attention={self.model.config.attention.value}, cache={self.cache!r}, "
                f"trigger={type(self.trigger).__name__ if self.trigger else None})")

    # ------------------------------------------------------------------------------------------ public API
    def prefill_prefix(self, user_id: int, history: Behaviors, now: Optional[float] = None) -> PrefixTicket:
        """Pre-infer ``history`` (a user's prefix) and keep its per-layer KV cached under a lease.

        Parameters
        ----------
        user_id : int
            In ``[0, 2**64)``.
        history : Behaviors
            The prefix, oldest first.
        now : float, optional
            Pool-clock time in seconds (default ``time.monotonic()``).

        Returns
        -------
        PrefixTicket

        Raises
        ------
        ValueError
            Bad input (see ``GRRanker.check_inputs``), before any cache state changes.
        """
        return self.prefill_prefix_batch([(user_id, history)], now=now)[0]

    def prefill_prefix_batch(self, items: Sequence[tuple[int, Behaviors]],
                             now: Optional[float] = None) -> list[PrefixTicket]:
        """:meth:`prefill_prefix` for many ``(user_id, history)`` pairs in one varlen forward.

        Equal to calling :meth:`prefill_prefix` on each item in order. Every item is validated before any cache
        state changes.
        """
        preps = []
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"items[{i}] must be a (user_id, history) pair, got {type(item).__name__}")
            preps.append(self._prepare(item[0], item[1]))
        t = _clock(now)
        with self._lock, torch.inference_mode():
            self._spill_expired(t)
            tickets: list[Optional[PrefixTicket]] = [None] * len(preps)
            jobs: list[_Job] = []
            pending: set[tuple[int, int]] = set()  # entries created or extended in this batch (KV not written yet)
            try:
                for i, p in enumerate(preps):
                    tickets[i], job = self._plan_prefill(p, t, pending)
                    if job is not None:
                        job.index = i
                        jobs.append(job)
                        pending.add(job.key)
                outs = self._forward(jobs)
                for job, (_, kv) in zip(jobs, outs):
                    self._write(job.pages, job.prep, job.start, kv)
            except BaseException:
                for job in jobs:
                    self._drop(job.key, t)
                    self._prefill_done(job.prep, t)
                raise
            for job in jobs:
                self._prefill_done(job.prep, t)
                p, fp = job.prep, job.key[1]
                if job.start:  # extended an entry: lease it now (never refused while we hold a reference)
                    self.pool.lease(p.user_id, fp, self.config.lease_ttl_s, now=t)
                self.pool.unpin(p.user_id, fp, now=t)
                T = p.num_tokens
                tickets[job.index] = PrefixTicket(True, "admitted", p.user_id, fp, T, t + self.config.lease_ttl_s,
                                                  cached_tokens=job.start, computed_tokens=T - job.start)
                if self.dram is not None:
                    self._leased[(p.user_id, fp)] = t + self.config.lease_ttl_s
                self._c["prefills"] += 1
                self._c["prefill_computed_tokens"] += T - job.start
                self._c["prefill_reused_tokens"] += job.start
            return tickets

    def rank_with_prefix(self, user_id: int, history: Behaviors, candidates: torch.Tensor,
                         ticket: Optional[PrefixTicket] = None, request_time: Optional[int] = None,
                         now: Optional[float] = None) -> RankResult:
        """Score ``candidates`` for a user, reusing the longest cached prefix of ``history``.

        Parameters
        ----------
        user_id : int
        history : Behaviors
            The user's full current history (the cached prefix, if any, plus newer behaviors).
        candidates : LongTensor [C]
            Candidate item ids (C >= 1).
        ticket : PrefixTicket, optional
            From :meth:`prefill_prefix` for this user; ends its lease.
        request_time : int, optional
            The candidates' timestamp (seconds); defaults to the last behavior's timestamp.
        now : float, optional
            Pool-clock time in seconds (default ``time.monotonic()``).

        Returns
        -------
        RankResult
            ``scores [C, num_tasks]`` equal to ``model.rank_full(history, candidates, request_time)``.

        Raises
        ------
        ValueError
            Bad input, before any cache state changes.
        """
        return self.rank_with_prefix_batch(
            [RankRequest(user_id, history, candidates, ticket, request_time)], now=now)[0]

    def rank_with_prefix_batch(self, requests: Sequence[RankRequest],
                               now: Optional[float] = None) -> list[RankResult]:
        """:meth:`rank_with_prefix` for many requests in one varlen forward (no padding).

        Equal to calling :meth:`rank_with_prefix` on each request in order, except that requests reusing the
        same entry extend it once (with the longest of their histories). Every request is validated before any
        cache state changes.
        """
        preps = []
        for i, r in enumerate(requests):
            if not isinstance(r, RankRequest):
                raise ValueError(f"requests[{i}] must be a RankRequest, got {type(r).__name__}")
            preps.append(self._prepare(r.user_id, r.history, r.candidates, r.request_time, r.ticket, rank=True))
        t = _clock(now)
        with self._lock, torch.inference_mode():
            self._spill_expired(t)
            pins: dict[tuple[int, int], _Pin] = {}
            reloaded: set[tuple[int, int]] = set()  # reloaded from DRAM in this call, first reader not yet served
            jobs = []
            try:
                for p in preps:
                    match = self._match(p, p.num_tokens)
                    if self.dram is not None:
                        dram = self._match(p, p.num_tokens, entries=self.dram.entries_of(p.user_id))
                        if dram is not None and (match is None or dram[1] > match[1]):
                            key = (p.user_id, dram[0])
                            if key not in pins:
                                pages = self._reload(key, dram[1], t)
                                if pages is not None:
                                    pins[key] = _Pin(key, pages, dram[1])
                                    reloaded.add(key)
                            if key in pins:
                                match = dram
                    if match is None:
                        jobs.append(_Job(p, 0, None, p.candidates))
                        continue
                    key = (p.user_id, match[0])
                    if key not in pins:
                        pages = self.pool.pin(*key, now=t)
                        assert pages is not None, key  # matched under the engine lock: it is cached
                        pins[key] = _Pin(key, pages, match[1])
                    jobs.append(_Job(p, match[1], pins[key].pages, p.candidates, key=key))
                outs = self._forward(jobs)
                results = []
                for job, (scores, _) in zip(jobs, outs):
                    T, C = job.prep.num_tokens, job.candidates.numel()
                    source = "recompute" if job.key is None else "hbm"
                    if job.key in reloaded:
                        source = "dram"
                        reloaded.discard(job.key)
                    results.append(RankResult(scores, source, job.start, T - job.start + C))
                    self._c["rank_requests"] += 1
                    self._c[f"{source}_hits" if source != "recompute" else "recomputes"] += 1
                    self._c["cached_tokens"] += job.start
                    self._c["computed_tokens"] += T - job.start + C
                    self._c["candidates"] += C
                ended = set()
                for p in preps:
                    tk = p.ticket
                    if tk is not None and tk.admitted and (tk.user_id, tk.fingerprint) not in ended:
                        ended.add((tk.user_id, tk.fingerprint))
                        self._leased.pop((tk.user_id, tk.fingerprint), None)
                        self._end_lease(tk, t)
                if self.extend_on_rank:
                    for pin in pins.values():
                        self._extend_after_rank(pin, [(j, o) for j, o in zip(jobs, outs) if j.key == pin.key], t)
            finally:
                for pin in pins.values():
                    self.pool.unpin(*pin.key, now=t)
                    if pin.broken:
                        self._drop(pin.key, t, unpin=False)
            for pin in pins.values():  # now evictable unless another ticket's lease holds it: keep a DRAM copy
                if self.dram is not None and not self.pool.has_lease(*pin.key, now=t):
                    self._spill(pin.key, t)
            return results

    def match_length(self, user_id: int, history: Behaviors) -> int:
        """History tokens a ranking request with ``history`` would read from the cache now (0 on a miss).

        Changes nothing (no pin, no LRU touch, no counter).
        """
        p = self._prepare(user_id, history)
        with self._lock:
            m = self._match(p, p.num_tokens)
            return 0 if m is None else m[1]

    def stats(self) -> dict[str, int]:
        """Counters as a flat dict: the engine's, ``evictions``, and every pool stat prefixed ``pool_``.

        ``hbm_hits``/``dram_hits``/``recomputes``: ranking requests that reused a prefix from device memory /
        reloaded it from the DRAM tier / computed from scratch; ``reloads``/``spills`` (and ``*_bytes``): copies
        between the tiers (``reloads_declined_cost``: DRAM hits where recomputing was predicted cheaper);
        ``trigger_*``: the trigger's decisions when one is set; ``cached_tokens``/``computed_tokens``: history tokens read
        / rows computed while ranking; ``extensions``: entries extended after ranking; ``expired_leases``: pre-infer
        leases that ran out before their ranking came; ``late_tickets``: tickets presented after that; ``stale_tickets``: tickets whose entry was gone, re-keyed or
        whose lease was already ended; ``prefills``: admitted pre-inferences that computed KV;
        ``prefill_declines`` (and by cause): not admitted.
        """
        with self._lock:
            s = dict(self._c)
            pool = self.pool.stats()
            s["evictions"] = int(pool["evictions"])
            s.update({f"pool_{k}": int(v) for k, v in pool.items()})
            s["expired_leases"] = int(pool["expirations"])
            if self.dram is not None:
                s.update(self.dram.stats())
            if self.trigger is not None and callable(getattr(self.trigger, "stats", None)):
                s.update({k: v for k, v in self.trigger.stats(now=None).items() if isinstance(v, int)})
            s.setdefault("trigger_admits", 0)
            s.setdefault("trigger_declines", 0)
            return s

    # ------------------------------------------------------------------------------------------ validation
    def _prepare(self, user_id, history, candidates=None, request_time=None, ticket=None,
                 rank: bool = False) -> _Prep:
        u = _user_id(user_id)
        if rank and candidates is None:
            raise ValueError("candidates must be a 1-D int64 tensor of item ids, got None")
        t_req = self.model.check_inputs(history, candidates, request_time)
        if ticket is not None:
            if not isinstance(ticket, PrefixTicket):
                raise ValueError(f"ticket must be a PrefixTicket or None, got {type(ticket).__name__}")
            if ticket.user_id != u:
                raise ValueError(f"ticket is for user_id={ticket.user_id}, but the request is for user_id={u}")
        return _Prep(u, history, candidates, t_req, self.model.token_keys(history), ticket)

    # ------------------------------------------------------------------------------------------ prefix matching
    def _fingerprints(self, p: _Prep, lengths) -> dict[int, int]:
        """Fingerprints of the first ``n`` tokens of ``p`` for each ``n`` in ``lengths``."""
        h = hashlib.blake2b(digest_size=8)
        h.update(self.model.identity.to_bytes(8, "little"))
        h.update(bytes([p.history.action_ids is not None, p.history.timestamps is not None]))
        out, done = {}, 0
        for n in sorted(set(lengths)):
            h.update(p.keys[done:n].tobytes())
            done = n
            out[n] = int.from_bytes(h.copy().digest(), "little")
        return out

    def _fingerprint(self, p: _Prep, n: int) -> int:
        return self._fingerprints(p, [n])[n]

    def _match(self, p: _Prep, max_tokens: int, skip=(), entries=None) -> Optional[tuple[int, int]]:
        """The longest cached ``(fingerprint, num_tokens)`` of the user that is exactly ``p``'s first tokens.

        ``entries`` (default: the pool's entries of the user) lists the candidates, e.g. the DRAM tier's.
        """
        if entries is None:
            entries = self.pool.entries_of(p.user_id)
        entries = [(fp, n) for fp, n in entries if n <= max_tokens and (p.user_id, fp) not in skip]
        if not entries:
            return None
        fps = self._fingerprints(p, [n for _, n in entries])
        hits = [(fp, n) for fp, n in entries if fps[n] == fp]
        return max(hits, key=lambda e: e[1]) if hits else None

    # ------------------------------------------------------------------------------------------ prefill steps
    def _plan_prefill(self, p: _Prep, t: float, pending: set) -> tuple[Optional[PrefixTicket], Optional[_Job]]:
        """Take pages for one prefill: a finished ticket, or a job whose KV the caller computes and writes."""
        T, u = p.num_tokens, p.user_id
        fp = self._fingerprint(p, T)
        ttl = self.config.lease_ttl_s
        if (u, fp) in pending:  # the same prefix earlier in this batch
            return PrefixTicket(True, "already_cached", u, fp, T, t + ttl, cached_tokens=T), None
        if self.pool.lookup(u, fp) is not None:
            if self.pool.lease(u, fp, ttl, now=t):
                self._c["prefill_already_cached"] += 1
                if self.dram is not None:
                    self._leased[(u, fp)] = t + ttl
                return PrefixTicket(True, "already_cached", u, fp, T, t + ttl, cached_tokens=T), None
            return self._decline(p, fp, "pool_full"), None
        match = self._match(p, T - 1, skip=pending)
        start = 0 if match is None else match[1]
        if self.trigger is not None:
            d = self.trigger.decide(history_len=T, num_candidates=None, prefix_pages=-(-T // self.page_size),
                                    pinned_pages=self.pool.num_pinned_pages, num_pages=self.pool.num_pages,
                                    now=t, reserve=True)
            if not d.admit:
                return self._decline(p, fp, f"trigger:{d.reason}"), None
        if match is None:
            pages = self.pool.insert(u, fp, T, ttl_s=ttl, now=t)
        else:  # grow the user's shorter cached prefix in place: only the new tokens are computed
            self.pool.pin(u, match[0], now=t)
            pages = self.pool.extend(u, match[0], fp, T, now=t)
            if pages is None:
                self.pool.unpin(u, match[0], now=t)
        if pages is None:
            self._prefill_done(p, t)
            too_big = -(-T // self.page_size) > self.pool.max_pinned_pages
            return self._decline(p, fp, "budget" if too_big else "pool_full"), None
        return None, _Job(p, start, pages, None, key=(u, fp))

    def _prefill_done(self, p: _Prep, t: float) -> None:
        """Tell the trigger that an admitted prefill ended (its load bound counts work in flight)."""
        if self.trigger is not None:
            self.trigger.on_prefill_done(p.num_tokens, now=t)

    def _decline(self, p: _Prep, fp: int, reason: str) -> PrefixTicket:
        self._c["prefill_declines"] += 1
        cause = "trigger" if reason.startswith("trigger:") else reason
        self._c[f"prefill_declines_{cause}"] += 1
        return PrefixTicket(False, reason, p.user_id, fp, p.num_tokens, None)

    def _drop(self, key: tuple[int, int], t: float, unpin: bool = True) -> None:
        """Remove an entry whose KV is incomplete (error path): end its lease, drop our reference, free it."""
        if self.pool.lookup(*key) is None:
            return
        if unpin:
            self.pool.unpin(*key, now=t)
        if self.pool.has_lease(*key, now=t):
            self.pool.release_lease(*key, now=t)
        try:
            self.pool.free(*key, now=t)
        except ValueError:  # still pinned by another reader: its tokens beyond the valid part are never read
            pass

    # ------------------------------------------------------------------------------------------ rank steps
    def _end_lease(self, ticket: PrefixTicket, t: float) -> None:
        try:
            live = self.pool.release_lease(ticket.user_id, ticket.fingerprint, now=t)
        except (KeyError, ValueError):  # entry gone or re-keyed, or its lease already ended
            self._c["stale_tickets"] += 1
            return
        if not live:
            self._c["late_tickets"] += 1

    def _extend_after_rank(self, pin: _Pin, uses: list, t: float) -> None:
        """Append the new history KV of the longest request that read ``pin`` to its entry."""
        uses = [(j, o) for j, o in uses if j.prep.num_tokens > pin.num_tokens]
        if not uses or self.pool.has_lease(*pin.key, now=t):  # leased for a pending ticket: leave it as is
            return
        job, (_, kv) = max(uses, key=lambda jo: jo[0].prep.num_tokens)
        p, T = job.prep, job.prep.num_tokens
        fp = self._fingerprint(p, T)
        if self.pool.lookup(p.user_id, fp) is not None:
            return
        pages = self.pool.extend(p.user_id, pin.key[1], fp, T, now=t)
        if pages is None:
            return
        pin.key, pin.pages, pin.num_tokens = (p.user_id, fp), pages, T
        try:
            self._write(pages, p, job.start, kv)
        except BaseException:
            pin.broken = True
            raise
        self._c["extensions"] += 1

    # ------------------------------------------------------------------------------------------ DRAM tier
    def _spill(self, key: tuple[int, int], t: float) -> None:
        """Copy an entry to the DRAM tier as one contiguous buffer, unless DRAM already holds this key."""
        num_tokens = self.pool.lookup(*key)
        if num_tokens is None or key in self.dram:
            return
        pages = self.pool.pages_of(*key)
        c = self.cache
        buf = self.dram.alloc((c.num_layers, 2, len(pages) * self.page_size, c.num_heads, c.head_dim), c.dtype)
        c.pack(pages, out=buf)
        entry = DramEntry(key[0], key[1], num_tokens, buf, c.gather_timestamps(pages, num_tokens).cpu())
        if self.cache.device.type == "cuda":
            torch.cuda.current_stream(self.cache.device).synchronize()  # the buffer is complete before reuse
        for fp, _ in self.dram.entries_of(key[0]):  # superseded by the longer prefix of the same user
            self.dram.discard(key[0], fp)
        if self.dram.put(entry):
            self._c["spills"] += 1
            self._c["spill_bytes"] += entry.nbytes

    def _spill_expired(self, t: float) -> None:
        """Spill entries whose pre-infer lease has ended unused (before any insert could evict them)."""
        for key, end in list(self._leased.items()):
            if end <= t:
                del self._leased[key]
                if self.pool.lookup(*key) is not None and not self.pool.has_lease(*key, now=t):
                    self._spill(key, t)

    def _reload(self, key: tuple[int, int], num_tokens: int, t: float) -> Optional[np.ndarray]:
        """Copy a DRAM entry back into pool pages (returned pinned by one reference), or None to recompute."""
        entry = self.dram.get(*key)
        if entry is None:
            return None
        if not self.expander.prefers_reload(num_tokens, entry.nbytes):
            self._c["reloads_declined_cost"] += 1
            return None
        pages = self.pool.insert(key[0], key[1], num_tokens, now=t)
        if pages is None:
            self._c["reloads_refused"] += 1
            return None
        t0 = time.perf_counter()
        try:
            self.cache.unpack(entry.kv, pages)
            self.cache.write_timestamps(pages, entry.timestamps)
            if self.cache.device.type == "cuda":
                torch.cuda.current_stream(self.cache.device).synchronize()
        except BaseException:
            self._drop(key, t)
            raise
        self.expander.observe_reload(entry.nbytes, time.perf_counter() - t0)
        self._c["reloads"] += 1
        self._c["reload_bytes"] += entry.nbytes
        return pages

    # ------------------------------------------------------------------------------------------ compute
    def _write(self, pages: np.ndarray, p: _Prep, start: int, kv) -> None:
        """Store the KV (and timestamps) of history tokens ``start..T-1`` of ``p`` in ``pages``."""
        T = p.num_tokens
        if T == start:
            return
        for layer, (k, v) in enumerate(kv):
            self.cache.write(layer, pages, k, v, start=start)
        ts = self.model.token_timestamps(p.history)
        if ts is not None:
            self.cache.write_timestamps(pages, ts[start:], start=start)

    def _forward(self, jobs: list[_Job]) -> list[tuple[Optional[torch.Tensor], list]]:
        """Run every job's rows in one varlen forward (two when some histories have timestamps and some not).

        Returns, per job, its scores ``[C, num_tasks]`` (None without candidates) and each layer's ``(k, v)``
        ``[T - start, H, D]`` of its history rows.
        """
        out: list = [None] * len(jobs)
        t0 = time.perf_counter()
        rows = sum(j.prep.num_tokens - j.start + (0 if j.candidates is None else j.candidates.numel()) for j in jobs)
        for timed in (False, True):
            group = [i for i, j in enumerate(jobs) if (j.prep.history.timestamps is not None) == timed]
            if group:
                for i, res in zip(group, self._forward_group([jobs[i] for i in group], timed)):
                    out[i] = res
        if self.cache.device.type == "cuda":
            torch.cuda.current_stream(self.cache.device).synchronize()
        self.expander.observe_recompute(rows, time.perf_counter() - t0)
        return out

    def _forward_group(self, jobs: list[_Job], timed: bool):
        model, ps, dev = self.model, self.page_size, self.cache.device
        xs, ts, cu, ncand, indptr, last, indices, cand_rows = [], [], [0], [], [0], [], [], []
        for j in jobs:
            C = 0 if j.candidates is None else j.candidates.numel()
            xs.append(model.embed_rows(j.prep.history, j.start, j.candidates))
            if timed:
                ts.append(model.row_timestamps(j.prep.history, j.start, C, j.prep.request_time))
            cu.append(cu[-1] + j.prep.num_tokens - j.start + C)
            ncand.append(C)
            cand_rows.append(torch.arange(cu[-1] - C, cu[-1]))
            n_pages = -(-j.start // ps)
            indices.append(j.pages[:n_pages] if n_pages else np.zeros(0, dtype=np.int32))
            indptr.append(indptr[-1] + n_pages)
            last.append(j.start - (n_pages - 1) * ps if n_pages else 0)
        i32 = (lambda a: torch.as_tensor(np.asarray(a, dtype=np.int32)).to(dev))
        h, kv = model.forward_paged(
            torch.cat(xs), self.cache.kv, i32(indptr), i32(np.concatenate(indices)), i32(last), i32(cu), i32(ncand),
            ts_q=torch.cat(ts) if timed else None, ts_cache=self.cache.timestamps if timed else None,
            backend=self.config.attention_backend)
        rows = torch.cat(cand_rows).to(h.device)
        scores = model.score(h[rows]) if rows.numel() else None
        results, c0 = [], 0
        for b, j in enumerate(jobs):
            r0, n = cu[b], j.prep.num_tokens - j.start
            s = scores[c0:c0 + ncand[b]] if ncand[b] else None
            c0 += ncand[b]
            results.append((s, [(k[r0:r0 + n], v[r0:r0 + n]) for k, v in kv]))
        return results
