"""Ranking steps: pin the longest cached prefix of each request, end presented leases, and take the pages a
ranking's new history K/V is kept in (extension of the entry read, or a stored miss) before the forward."""
from __future__ import annotations

from .index import PrefixIndex
from .records import Hit, Job, Pin, Prepared
from .tiers import CacheState

__all__ = ["RankPlanner"]


class RankPlanner:
    """The per-request steps of :meth:`relaygr_engine.RelayEngine.rank_with_prefix_batch` around its forward."""

    def __init__(self, state: CacheState, index: PrefixIndex) -> None:
        self.state, self.index = state, index

    def job(self, p: Prepared, pins: dict, reloaded: set, t: float) -> Job:
        """Pin the longest cached prefix of ``p`` (reloading it from DRAM when that holds more) and make its job."""
        match = self.index.match(p, p.num_tokens)
        if self.state.dram is not None:
            # (a DRAM entry of n tokens shares at most n with the request: only longer ones than the device match
            # can beat it, so only those are compared)
            floor = 0 if match is None else match.usable
            longer = [(fp, n) for fp, n in self.state.dram.entries_of(p.user_id) if n > floor]
            dram = self.index.match(p, p.num_tokens, entries=longer)  # (None when there is none)
            if dram is not None and (match is None or dram.usable > match.usable):
                key = (p.user_id, dram.fp)
                if key not in pins and self.state.pool.lookup(*key) is None:
                    pages = self.state.reload(key, dram.num_tokens, t, layered=True)
                    if pages is not None:
                        pins[key] = Pin(key, pages, dram.num_tokens)
                        reloaded.add(key)
                if key in pins:
                    match = dram
        if match is None:
            return Job(p, 0, None, p.candidates)
        key = (p.user_id, match.fp)
        if key not in pins:
            pages = self.state.pool.pin(*key, now=t)
            assert pages is not None, key  # matched under the engine lock: it is cached
            pins[key] = Pin(key, pages, match.num_tokens)
        return Job(p, match.usable, pins[key].pages, p.candidates, key=key)

    def end_tickets(self, preps: list[Prepared], t: float) -> None:
        """End the lease of every admitted ticket presented (once per entry)."""
        c, ended = self.state.counters, set()
        for p in preps:
            tk = p.ticket
            if tk is None or not tk.admitted or (tk.user_id, tk.fingerprint) in ended:
                continue
            ended.add((tk.user_id, tk.fingerprint))
            self.state.leased.pop((tk.user_id, tk.fingerprint), None)
            try:
                live = self.state.pool.release_lease(tk.user_id, tk.fingerprint, now=t)
            except (KeyError, ValueError):  # entry gone or re-keyed, or its lease already ended
                c.stale_tickets += 1
                continue
            if not live:
                c.late_tickets += 1

    def plan_extension(self, pin: Pin, jobs: list[Job], t: float) -> bool:
        """Grow ``pin``'s entry by the new history of the longest request that read all of it; the layers write it.

        An entry used in part, or leased for a pending ticket, is never grown.
        """
        uses = [j for j in jobs if j.key == pin.key and j.start == pin.num_tokens < j.prep.num_tokens]
        if not uses or self.state.pool.has_lease(*pin.key, now=t):
            return False
        job = max(uses, key=lambda j: j.prep.num_tokens)
        p, T = job.prep, job.prep.num_tokens
        base = Hit(pin.key[1], pin.num_tokens, pin.num_tokens)  # all of it is p's: hash the new tokens only
        fp = self.index.fingerprint(p, T, base)
        if self.state.pool.lookup(p.user_id, fp) is not None:
            return False
        pages = self.state.pool.extend(p.user_id, pin.key[1], fp, T, now=t)
        if pages is None:
            return False
        pin.key, pin.pages, pin.num_tokens = (p.user_id, fp), pages, T
        self.index.record(pin.key, p, T, base)
        job.write_pages = pages
        return True

    def plan_stores(self, jobs: list[Job], t: float) -> list:
        """New pinned entries for the longest history of each user that found nothing cached; their keys."""
        misses: dict = {}
        for j in jobs:
            if j.key is None and j.prep.num_tokens > misses.get(j.prep.user_id, (0, None))[0]:
                misses[j.prep.user_id] = (j.prep.num_tokens, j)
        stored = []
        for T, j in misses.values():
            u, fp = j.prep.user_id, self.index.fingerprint(j.prep, T)
            if self.state.pool.lookup(u, fp) is not None:
                continue
            pages = self.state.pool.insert(u, fp, T, now=t)
            if pages is None:
                continue
            j.write_pages = pages
            self.index.record((u, fp), j.prep, T)
            stored.append((u, fp))
        return stored
