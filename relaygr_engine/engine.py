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
each token). Beside each entry the engine keeps those token rows (with the identity and flags), so a request reuses
the *longest common prefix* of its history and any entry of the user: all of a shorter entry, or the leading part
of a longer one (the KV of a token depends only on the tokens before it, so any prefix of a cached entry is
exact). A history changed anywhere in the cached part (e.g. at the front) shares nothing there and recomputes.

Prefill tickets (``PrefixTicket.reason``)
-----------------------------------------
``"admitted"``
    The KV was computed and stored, leased for ``CacheConfig.lease_ttl_s``; ``cached_tokens`` says how many
    leading tokens were reused from the user's cached entries. When a cached entry is wholly a prefix of this
    history it is *extended* in place and re-keyed (only the new tokens are computed); a pending ticket of the
    shorter prefix then goes stale (harmless: its ranking still reads its prefix, the leading part of the grown
    entry, whose lease this prefill took over). When this history shares only the leading part of an entry, a new
    entry starts with a device copy of that part (memory bandwidth only; ``prefill_copies``).
``"already_cached"``
    This prefix was already cached, as an entry or the leading part of a longer one (possibly reloaded from the
    DRAM tier); that entry's lease was renewed (admitted) and the ticket names it.
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
its lease (the entry stays cached, evictable in LRU order). The history KV a ranking computes can be kept, so the
user's next request reuses more: with ``extend_on_rank`` (default) the new tokens are appended to the entry used
(``pool.extend``, re-keyed to the longer prefix) when pages are available and no other lease holds the entry;
with ``store_misses`` a ranking that found nothing cached stores its whole history as a new evictable entry
(``stored_on_rank``) when pages are available (evicting in LRU order).

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
cheaper than recomputing; its result says ``source="dram"``. A prefill does the same: when DRAM holds a longer
prefix of its history than device memory, that prefix is reloaded and only the newer tokens are computed
(``prefill_dram_reloads``). Engine calls are serialised, so concurrent rankings of
one user cause one reload, and the later ones read the reloaded pages (``source="hbm"``).

Thread safety: every public method holds one engine lock (the pool itself is also thread-safe).
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from .cache import PagedKVCache
from .config import CacheConfig
from .models import Behaviors, GRRanker
from .policy._checks import user_id as _user_id
from .tiers import DramEntry, HostKVTier, ReloadCostModel

__all__ = ["PrefixTicket", "RankRequest", "RankResult", "RelayEngine"]



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


class _Hit(NamedTuple):
    """A cached entry ``(user, fp)`` of ``num_tokens`` tokens whose first ``usable`` tokens are the request's."""

    fp: int
    num_tokens: int
    usable: int


@dataclass(eq=False)
class _Pin:
    key: tuple[int, int]
    pages: np.ndarray
    num_tokens: int
    broken: bool = False  # its KV could not be completed: free it


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
    store_misses : bool
        Keep the history KV of a ranking that found nothing cached as a new evictable entry (default False: it
        may evict the least recently used entry; relay serving under load turns it on so that the cache keeps
        up when pre-inferences are dropped).
    """

    def __init__(self, model: GRRanker, cache_config: Optional[CacheConfig] = None, trigger=None, *,
                 extend_on_rank: bool = True, store_misses: bool = False) -> None:
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
        self.store_misses = bool(store_misses)
        self.cache = PagedKVCache(cache_config, cfg.num_layers, cfg.num_heads, cfg.head_dim)
        self.pool = self.cache.pool
        self.page_size = self.cache.page_size
        self.dram = (HostKVTier(cache_config.dram_bytes, pin_memory=self.cache.device.type == "cuda")
                     if cache_config.dram_bytes > 0 else None)
        self.expander = ReloadCostModel()
        self._leased: dict[tuple[int, int], float] = {}  # admitted entries -> lease end, to spill unused ones
        # user -> fingerprint -> (model identity, flags, token keys) of each entry (device or DRAM): lets a request
        # reuse the leading part of a longer entry
        self._entry_keys: dict[int, dict[int, tuple]] = {}
        self._prune_at = 1024
        self._lock = threading.RLock()
        self._c = dict(rank_requests=0, hbm_hits=0, dram_hits=0, recomputes=0, reloads=0, reload_bytes=0,
                       reloads_declined_cost=0, reloads_refused=0, spills=0, spill_bytes=0, cached_tokens=0,
                       computed_tokens=0, candidates=0, extensions=0, late_tickets=0, stale_tickets=0,
                       prefills=0, prefill_already_cached=0, prefill_declines=0, prefill_declines_trigger=0,
                       prefill_declines_budget=0, prefill_declines_pool_full=0, prefill_computed_tokens=0,
                       prefill_reused_tokens=0, prefill_copies=0, prefill_copied_tokens=0,
                       prefill_dram_reloads=0, stored_on_rank=0)

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
                        if dram is not None and (match is None or dram.usable > match.usable):
                            key = (p.user_id, dram.fp)
                            if key not in pins and self.pool.lookup(*key) is None:
                                pages = self._reload(key, dram.num_tokens, t)
                                if pages is not None:
                                    pins[key] = _Pin(key, pages, dram.num_tokens)
                                    reloaded.add(key)
                            if key in pins:
                                match = dram
                    if match is None:
                        jobs.append(_Job(p, 0, None, p.candidates))
                        continue
                    key = (p.user_id, match.fp)
                    if key not in pins:
                        pages = self.pool.pin(*key, now=t)
                        assert pages is not None, key  # matched under the engine lock: it is cached
                        pins[key] = _Pin(key, pages, match.num_tokens)
                    jobs.append(_Job(p, match.usable, pins[key].pages, p.candidates, key=key))
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
                stored = []
                if self.extend_on_rank:
                    for pin in pins.values():
                        self._extend_after_rank(pin, [(j, o) for j, o in zip(jobs, outs) if j.key == pin.key], t)
                if self.store_misses:
                    misses = {}
                    for j, o in zip(jobs, outs):  # the longest history of each user that found nothing cached
                        if j.key is None and j.prep.num_tokens > misses.get(j.prep.user_id, (0, None))[0]:
                            misses[j.prep.user_id] = (j.prep.num_tokens, (j, o))
                    for _, (j, (_, kv)) in misses.values():
                        key = self._store_after_rank(j.prep, kv, t)
                        if key is not None:
                            stored.append(key)
            finally:
                for pin in pins.values():
                    self.pool.unpin(*pin.key, now=t)
                    if pin.broken:
                        self._drop(pin.key, t, unpin=False)
            # now evictable unless another ticket's lease holds them: keep a DRAM copy
            for key in [pin.key for pin in pins.values()] + stored:
                if self.dram is not None and not self.pool.has_lease(*key, now=t):
                    self._spill(key, t)
            return results

    def match_length(self, user_id: int, history: Behaviors) -> int:
        """History tokens a ranking request with ``history`` would read from the cache now (0 on a miss).

        Changes nothing (no pin, no LRU touch, no counter).
        """
        p = self._prepare(user_id, history)
        with self._lock:
            m = self._match(p, p.num_tokens)
            return 0 if m is None else m.usable

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
        h.update(self._flags(p))
        out, done = {}, 0
        for n in sorted(set(lengths)):
            h.update(p.keys[done:n].tobytes())
            done = n
            out[n] = int.from_bytes(h.copy().digest(), "little")
        return out

    def _fingerprint(self, p: _Prep, n: int) -> int:
        return self._fingerprints(p, [n])[n]

    @staticmethod
    def _flags(p: _Prep) -> bytes:
        return bytes([p.history.action_ids is not None, p.history.timestamps is not None])

    def _record(self, key: tuple[int, int], p: _Prep, n: int) -> None:
        """Remember the token keys of a new or re-keyed entry: its first ``n`` tokens are ``p``'s first ``n``.

        The record lets a request reuse any leading part of the entry (:meth:`_match`); records of entries that
        neither tier holds any more are dropped for the user here, and for every user now and then.
        """
        u, fp = key
        recs = self._entry_keys.setdefault(u, {})
        for old in [f for f in recs if f != fp and self.pool.lookup(u, f) is None
                    and (self.dram is None or (u, f) not in self.dram)]:
            del recs[old]
        recs[fp] = (self.model.identity, self._flags(p), p.keys[:n])
        if len(self._entry_keys) > self._prune_at:
            for user in [v for v in self._entry_keys if v != u]:
                live = {f for f, _ in self.pool.entries_of(user)}
                if self.dram is not None:
                    live |= {f for f, _ in self.dram.entries_of(user)}
                kept = {f: r for f, r in self._entry_keys[user].items() if f in live}
                if kept:
                    self._entry_keys[user] = kept
                else:
                    del self._entry_keys[user]
            self._prune_at = max(1024, 2 * len(self._entry_keys))

    def _common(self, p: _Prep, fp: int, n: int, limit: int, identity: int) -> Optional[int]:
        """Leading tokens (``<= min(n, limit)``) that the user's entry ``fp`` of ``n`` tokens shares with ``p``.

        None when the entry has no record (then only the exact fingerprint of its ``n`` tokens can match).
        """
        rec = self._entry_keys.get(p.user_id, {}).get(fp)
        if rec is None:
            return None
        ident, flags, ek = rec
        if ident != identity or flags != self._flags(p):
            return 0
        k = min(n, limit, ek.shape[0], p.num_tokens)
        diff = np.flatnonzero((ek[:k] != p.keys[:k]).any(axis=1))
        return k if diff.size == 0 else int(diff[0])

    def _match(self, p: _Prep, max_tokens: int, skip=(), entries=None) -> Optional[_Hit]:
        """The user's cached entry sharing the most leading tokens with ``p`` (at most ``max_tokens``), or None.

        ``entries`` (default: the pool's entries of the user) lists the candidates, e.g. the DRAM tier's. A hit
        may use only the leading part of a longer entry (``usable < num_tokens``): the KV of a token depends on the
        tokens before it only, so any prefix of a cached entry is exact. Ties prefer the shorter entry.
        """
        u = p.user_id
        if entries is None:
            entries = self.pool.entries_of(u)
        entries = [(fp, n) for fp, n in entries if (u, fp) not in skip]
        if not entries:
            return None
        identity = self.model.identity
        best = None
        for fp, n in entries:
            m = self._common(p, fp, n, max_tokens, identity)
            if m is None:  # no record: exact prefix only
                m = n if n <= min(max_tokens, p.num_tokens) and self._fingerprint(p, n) == fp else 0
            if m > 0 and (best is None or m > best.usable or (m == best.usable and n < best.num_tokens)):
                best = _Hit(fp, n, m)
        return best

    # ------------------------------------------------------------------------------------------ prefill steps
    def _plan_prefill(self, p: _Prep, t: float, pending: set) -> tuple[Optional[PrefixTicket], Optional[_Job]]:
        """Take pages for one prefill: a finished ticket, or a job whose KV the caller computes and writes."""
        T, u = p.num_tokens, p.user_id
        fp = self._fingerprint(p, T)
        ttl = self.config.lease_ttl_s
        if (u, fp) in pending:  # the same prefix earlier in this batch
            return PrefixTicket(True, "already_cached", u, fp, T, t + ttl, cached_tokens=T), None
        if self.pool.lookup(u, fp) is not None:
            return self._lease_cached(p, fp, fp, t), None
        match = self._match(p, T, skip=pending)
        if match is not None and match.usable == T:  # inside a longer cached entry: nothing to compute
            return self._lease_cached(p, match.fp, fp, t), None
        dram = None
        if self.dram is not None:
            d = self._match(p, T, skip=pending, entries=self.dram.entries_of(u))
            if d is not None and d.usable > (0 if match is None else match.usable) and \
                    self.pool.lookup(u, d.fp) is None:
                dram = d
        if dram is not None and dram.usable == T:  # inside a DRAM entry: reload it, nothing to compute
            if self._reload((u, dram.fp), dram.num_tokens, t) is not None:
                self._c["prefill_dram_reloads"] += 1
                ticket = self._lease_cached(p, dram.fp, fp, t)
                self.pool.unpin(u, dram.fp, now=t)
                return ticket, None
            dram = None
        if self.trigger is not None:
            d = self.trigger.decide(history_len=T, num_candidates=None, prefix_pages=-(-T // self.page_size),
                                    pinned_pages=self.pool.num_pinned_pages, num_pages=self.pool.num_pages,
                                    now=t, reserve=True)
            if not d.admit:
                return self._decline(p, fp, f"trigger:{d.reason}"), None
        pages, start = None, 0
        try:
            if dram is not None:
                pages, start, reloaded = self._prefill_from_dram(p, fp, dram, t)
                if reloaded:
                    match = dram  # now in device memory
            if pages is None and match is not None:
                pages, start = self._prefill_from_cached(p, fp, match, t)
        except BaseException:
            self._prefill_done(p, t)
            raise
        if pages is None:
            pages, start = self.pool.insert(u, fp, T, ttl_s=ttl, now=t), 0
        if pages is None:
            self._prefill_done(p, t)
            too_big = -(-T // self.page_size) > self.pool.max_pinned_pages
            return self._decline(p, fp, "budget" if too_big else "pool_full"), None
        self._record((u, fp), p, T)
        return None, _Job(p, start, pages, None, key=(u, fp))

    def _lease_cached(self, p: _Prep, entry_fp: int, fp: int, t: float) -> PrefixTicket:
        """Lease the cached entry ``entry_fp`` holding all of ``p``'s tokens (``"already_cached"``)."""
        u, T, ttl = p.user_id, p.num_tokens, self.config.lease_ttl_s
        if self.pool.lease(u, entry_fp, ttl, now=t):
            self._c["prefill_already_cached"] += 1
            if self.dram is not None:
                self._leased[(u, entry_fp)] = t + ttl
            return PrefixTicket(True, "already_cached", u, entry_fp, T, t + ttl, cached_tokens=T)
        return self._decline(p, fp, "pool_full")

    def _prefill_from_cached(self, p: _Prep, fp: int, hit: _Hit, t: float) -> tuple[Optional[np.ndarray], int]:
        """Pages for ``p`` whose first ``hit.usable`` tokens are the device entry ``hit``'s.

        When all of the entry is ``p``'s prefix it is grown in place and re-keyed (a pending ticket of the shorter
        prefix keeps its hit: its ranking reads the leading part of the grown entry). When ``p`` shares only part
        of it, a new entry starts with a device copy of the shared part.
        """
        if hit.usable == hit.num_tokens:
            return self._grow(p.user_id, hit.fp, fp, p.num_tokens, t), hit.usable
        return self._insert_copy(p.user_id, fp, p.num_tokens, hit.fp, hit.usable, t), hit.usable

    def _grow(self, u: int, entry_fp: int, fp: int, T: int, t: float) -> Optional[np.ndarray]:
        """Extend the cached entry to ``T`` tokens and re-key it to ``fp`` (pinned by one reference), or None."""
        self.pool.pin(u, entry_fp, now=t)
        pages = self.pool.extend(u, entry_fp, fp, T, now=t)
        if pages is None:
            self.pool.unpin(u, entry_fp, now=t)
        return pages

    def _prefill_from_dram(self, p: _Prep, fp: int, hit: _Hit, t: float):
        """Reload the DRAM entry ``hit`` and build ``p``'s pages on it (grown in place, or a copy of its shared part).

        Returns ``(pages, start, reloaded)``; ``pages`` None when the pool cannot hold them (the reloaded entry, if
        ``reloaded``, then stays cached and evictable).
        """
        u, T = p.user_id, p.num_tokens
        if self._reload((u, hit.fp), hit.num_tokens, t) is None:
            return None, 0, False
        self._c["prefill_dram_reloads"] += 1
        if hit.usable == hit.num_tokens:  # all of it is p's prefix: grow it (our reload holds a reference)
            pages = self.pool.extend(u, hit.fp, fp, T, now=t)
            if pages is not None:
                return pages, hit.usable, True
        else:
            pages = self._insert_copy(u, fp, T, hit.fp, hit.usable, t)
        self.pool.unpin(u, hit.fp, now=t)
        return pages, hit.usable, True

    def _insert_copy(self, u: int, fp: int, T: int, src_fp: int, n: int, t: float) -> Optional[np.ndarray]:
        """A new leased entry of ``T`` tokens whose first ``n`` tokens are copied from the entry ``src_fp``.

        Returns its pages (pinned by one reference, like ``pool.insert``), or None when the pool cannot hold it.
        The copy is page-granular (the source's last copied page whole; the new tokens overwrite its tail).
        """
        src = self.pool.pin(u, src_fp, now=t)  # held while copying: never evicted by the insert below
        assert src is not None, (u, src_fp)
        try:
            pages = self.pool.insert(u, fp, T, ttl_s=self.config.lease_ttl_s, now=t)
            if pages is None:
                return None
            try:
                self._copy_pages(src[:-(-n // self.page_size)], pages)
            except BaseException:
                self._drop((u, fp), t)
                raise
        finally:
            self.pool.unpin(u, src_fp, now=t)
        self._c["prefill_copies"] += 1
        self._c["prefill_copied_tokens"] += n
        return pages

    def _copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the K/V of every layer and the timestamps of pages ``src`` into the first ``len(src)`` of ``dst``."""
        dev = self.cache.device
        s = torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64)).to(dev)
        d = torch.from_numpy(np.ascontiguousarray(dst[:len(src)], dtype=np.int64)).to(dev)
        for buf in self.cache.kv:
            buf.index_copy_(0, d, buf.index_select(0, s))
        self.cache.timestamps.index_copy_(0, d, self.cache.timestamps.index_select(0, s))

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
        # requests that read all of the entry and have newer tokens (an entry used in part is never grown)
        uses = [(j, o) for j, o in uses if j.start == pin.num_tokens < j.prep.num_tokens]
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
        self._record(pin.key, p, T)
        try:
            self._write(pages, p, job.start, kv)
        except BaseException:
            pin.broken = True
            raise
        self._c["extensions"] += 1

    def _store_after_rank(self, p: _Prep, kv, t: float) -> Optional[tuple[int, int]]:
        """Keep the history KV a ranking computed with nothing cached as a new (evictable) entry; its key or None."""
        u, T = p.user_id, p.num_tokens
        fp = self._fingerprint(p, T)
        if self.pool.lookup(u, fp) is not None:
            return None
        pages = self.pool.insert(u, fp, T, now=t)
        if pages is None:
            return None
        try:
            self._write(pages, p, 0, kv)
        except BaseException:
            self._drop((u, fp), t)
            raise
        self._record((u, fp), p, T)
        self.pool.unpin(u, fp, now=t)
        self._c["stored_on_rank"] += 1
        return u, fp

    # ------------------------------------------------------------------------------------------ DRAM tier
    def _spill(self, key: tuple[int, int], t: float) -> None:
        """Copy an entry to the DRAM tier as one contiguous buffer, unless DRAM already holds this key."""
        num_tokens = self.pool.lookup(*key)
        if num_tokens is None or key in self.dram:
            return
        pages = self.pool.pages_of(*key)
        c = self.cache
        buf = self.dram.alloc((c.num_layers, 2, len(pages) * self.page_size, c.num_heads, c.head_dim), c.dtype)
        if c.device.type == "cpu" and buf.device.type == "cpu" and buf.is_contiguous():
            # one gather per layer and K/V straight into the buffer (the generic pack makes several copies)
            ids = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
            view = buf.view(c.num_layers, 2, len(pages), self.page_size, c.num_heads, c.head_dim)
            for layer, kv in enumerate(c.kv):
                for i in (0, 1):
                    torch.index_select(kv[:, i], 0, ids, out=view[layer, i])
        else:
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
