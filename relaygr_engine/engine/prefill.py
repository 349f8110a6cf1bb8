"""Prefill planning: the pages a pre-inference writes, grown from, copied from or reloaded into the cache."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .index import PrefixIndex
from .records import Hit, Job, Prepared, PrefixTicket
from .tiers import CacheState

__all__ = ["PrefillPlanner"]


class PrefillPlanner:
    """Takes the pages of one prefill at a time (the module docstring of :mod:`relaygr_engine.engine` lists the
    outcomes), calling the trigger before any page is taken."""

    def __init__(self, state: CacheState, index: PrefixIndex, trigger) -> None:
        self.state, self.index, self.trigger = state, index, trigger

    @property
    def pool(self):
        return self.state.pool

    def plan(self, p: Prepared, t: float, pending: set) -> tuple[Optional[PrefixTicket], Optional[Job]]:
        """A finished ticket, or a job whose KV the caller computes into ``job.write_pages``."""
        T, u, ps = p.num_tokens, p.user_id, self.state.page_size
        # (a cached entry all of whose tokens are p's, e.g. the last chunk of a chunked pre-infer: the fingerprint
        # hashes the tokens after it only)
        grown = self.index.match(p, T)
        fp = self.index.fingerprint(p, T, grown if grown is not None and grown.usable == grown.num_tokens else None)
        ttl = self.state.config.lease_ttl_s
        if (u, fp) in pending:  # the same prefix earlier in this batch
            return PrefixTicket(True, "already_cached", u, fp, T, t + ttl, cached_tokens=T), None
        if self.pool.lookup(u, fp) is not None:
            return self._lease_cached(p, fp, fp, t), None
        match = self.index.match(p, T, skip=pending)
        if match is not None and match.usable == T:  # inside a longer cached entry: nothing to compute
            return self._lease_cached(p, match.fp, fp, t), None
        dram = None
        if self.state.dram is not None:
            d = self.index.match(p, T, skip=pending, entries=self.state.dram.entries_of(u))
            if d is not None and d.usable > (0 if match is None else match.usable) and \
                    self.pool.lookup(u, d.fp) is None:
                dram = d
        if dram is not None and dram.usable == T:  # inside a DRAM entry: reload it, nothing to compute
            if self.state.reload((u, dram.fp), dram.num_tokens, t) is not None:
                self.state.counters.prefill_dram_reloads += 1
                ticket = self._lease_cached(p, dram.fp, fp, t)
                self.pool.unpin(u, dram.fp, now=t)
                return ticket, None
            dram = None
        if self.trigger is not None:
            d = self.trigger.decide(history_len=T, num_candidates=None, prefix_pages=-(-T // ps),
                                    pinned_pages=self.pool.num_pinned_pages, num_pages=self.pool.num_pages,
                                    now=t, reserve=True)
            if not d.admit:
                return self.decline(p, fp, f"trigger:{d.reason}"), None
        pages, start = None, 0
        try:
            if dram is not None:
                pages, start, reloaded = self._from_dram(p, fp, dram, t)
                if reloaded:
                    match = dram  # now in device memory
            if pages is None and match is not None:
                pages, start = self._from_cached(p, fp, match, t)
        except BaseException:
            self.done(p, t)
            raise
        if pages is None:
            pages, start = self.pool.insert(u, fp, T, ttl_s=ttl, now=t), 0
        if pages is None:
            self.done(p, t)
            too_big = -(-T // ps) > self.pool.max_pinned_pages
            return self.decline(p, fp, "budget" if too_big else "pool_full"), None
        self.index.record((u, fp), p, T)
        return None, Job(p, start, pages, None, key=(u, fp), write_pages=pages)

    def done(self, p: Prepared, t: float) -> None:
        """Tell the trigger that an admitted prefill ended (its load bound counts work in flight)."""
        if self.trigger is not None:
            self.trigger.on_prefill_done(p.num_tokens, now=t)

    def decline(self, p: Prepared, fp: int, reason: str) -> PrefixTicket:
        self.state.counters.count_decline(reason)
        return PrefixTicket(False, reason, p.user_id, fp, p.num_tokens, None)

    # ------------------------------------------------------------------------------------------ steps
    def _lease_cached(self, p: Prepared, entry_fp: int, fp: int, t: float) -> PrefixTicket:
        """Lease the cached entry ``entry_fp`` holding all of ``p``'s tokens (``"already_cached"``)."""
        u, T, ttl = p.user_id, p.num_tokens, self.state.config.lease_ttl_s
        if self.pool.lease(u, entry_fp, ttl, now=t):
            self.state.counters.prefill_already_cached += 1
            if self.state.dram is not None:
                self.state.leased[(u, entry_fp)] = t + ttl
            return PrefixTicket(True, "already_cached", u, entry_fp, T, t + ttl, cached_tokens=T)
        return self.decline(p, fp, "pool_full")

    def _from_cached(self, p: Prepared, fp: int, hit: Hit, t: float) -> tuple[Optional[np.ndarray], int]:
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

    def _from_dram(self, p: Prepared, fp: int, hit: Hit, t: float):
        """Reload the DRAM entry ``hit`` and build ``p``'s pages on it (grown in place, or a copy of its shared part).

        Returns ``(pages, start, reloaded)``; ``pages`` None when the pool cannot hold them (the reloaded entry, if
        ``reloaded``, then stays cached and evictable).
        """
        u, T = p.user_id, p.num_tokens
        if self.state.reload((u, hit.fp), hit.num_tokens, t) is None:
            return None, 0, False
        self.state.counters.prefill_dram_reloads += 1
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
            pages = self.pool.insert(u, fp, T, ttl_s=self.state.config.lease_ttl_s, now=t)
            if pages is None:
                return None
            try:
                self.state.copy_pages(src[:-(-n // self.state.page_size)], pages)
            except BaseException:
                self.state.drop((u, fp), t)
                raise
        finally:
            self.pool.unpin(u, src_fp, now=t)
        self.state.counters.prefill_copies += 1
        self.state.counters.prefill_copied_tokens += n
        return pages
