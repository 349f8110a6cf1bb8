"""Block pool model check, for every implementation (C++ and pure Python): a hypothesis state machine drives a pool
through random inserts, lookups, pins, leases, extensions and evictions against a Python model of what it must
hold, checking the pool's invariants after every step."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relaygr_engine._ext import pool_implementations


# ----------------------------------------------------------------------------- stateful model check
class PoolMachine(RuleBasedStateMachine):
    """Random operation sequences against a model of the pool's documented semantics."""

    impl = None  # set by subclasses

    @initialize(num_pages=st.integers(4, 24), page_size=st.sampled_from([1, 2, 4]), frac=st.sampled_from([0.5, 1.0]))
    def setup(self, num_pages, page_size, frac):
        self.page_size = page_size
        self.max_pinned = max(1, int(num_pages * frac))
        self.pool = self.impl(num_pages, page_size, self.max_pinned)
        self.num_pages = num_pages
        self.now = 0.0
        self.seq = 0
        self.fresh = 0
        # key -> dict(ntok, ref, lease: "none" | "live" | "expired", expiry, seq)
        self.entries: dict[tuple[int, int], dict] = {}
        self.lru: list[tuple[int, int]] = []  # evictable keys, oldest first
        self.c = dict(inserts=0, evictions=0, expirations=0, refused_leases=0, hits=0, misses=0, frees=0)

    # -- model helpers
    def pages(self, ntok):
        return -(-ntok // self.page_size)

    def pinned(self, e):
        return e["ref"] > 0 or e["lease"] == "live"

    def pinned_pages(self):
        return sum(self.pages(e["ntok"]) for e in self.entries.values() if self.pinned(e))

    def expire(self):
        due = sorted((e["expiry"], e["seq"], k) for k, e in self.entries.items()
                     if e["lease"] == "live" and e["expiry"] <= self.now)
        for _, _, k in due:
            e = self.entries[k]
            e["lease"] = "expired"
            self.c["expirations"] += 1
            if e["ref"] == 0:
                self.lru.append(k)

    def grant(self, e, expiry):
        self.seq += 1
        e.update(lease="live", expiry=expiry, seq=self.seq)

    def reclaim(self, n):
        free = self.num_pages - sum(self.pages(e["ntok"]) for e in self.entries.values())
        while free < n:
            k = self.lru.pop(0)
            free += self.pages(self.entries.pop(k)["ntok"])
            self.c["evictions"] += 1

    def keys(self):
        return sorted(self.entries)

    # -- rules
    @rule(user=st.integers(0, 3), fp=st.integers(0, 3), ntok=st.integers(1, 30),
          ttl=st.sampled_from([0.0, 0.5, 2.0]))
    def insert(self, user, fp, ntok, ttl):
        key = (user, fp)
        if key in self.entries:
            with pytest.raises(ValueError):
                self.pool.insert(user, fp, ntok, ttl_s=ttl, now=self.now)
            return
        got = self.pool.insert(user, fp, ntok, ttl_s=ttl, now=self.now)
        self.expire()
        n = self.pages(ntok)
        if self.pinned_pages() + n > self.max_pinned:
            assert got is None
            self.c["refused_leases"] += 1
            return
        assert got is not None and len(got) == n
        self.reclaim(n)
        e = dict(ntok=ntok, ref=1, lease="none", expiry=0.0, seq=0)
        if ttl > 0:
            self.grant(e, self.now + ttl)
        self.entries[key] = e
        self.c["inserts"] += 1

    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(self.keys() + [(9, 9)]))
        got = self.pool.pin(*key, now=self.now)
        self.expire()
        if key not in self.entries:
            assert got is None
            self.c["misses"] += 1
            return
        e = self.entries[key]
        assert got is not None and len(got) == self.pages(e["ntok"])
        if not self.pinned(e):
            self.lru.remove(key)
        e["ref"] += 1
        self.c["hits"] += 1

    @precondition(lambda self: any(e["ref"] > 0 for e in self.entries.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from([k for k in self.keys() if self.entries[k]["ref"] > 0]))
        self.pool.unpin(*key, now=self.now)
        self.expire()
        e = self.entries[key]
        e["ref"] -= 1
        if not self.pinned(e):
            self.lru.append(key)

    @precondition(lambda self: self.entries)
    @rule(data=st.data(), ttl=st.sampled_from([0.5, 1.0, 3.0]))
    def lease(self, data, ttl):
        key = data.draw(st.sampled_from(self.keys()))
        ok = self.pool.lease(*key, ttl_s=ttl, now=self.now)
        self.expire()
        e = self.entries[key]
        if self.pinned(e):
            assert ok is True
            self.grant(e, max(self.now + ttl, e["expiry"] if e["lease"] == "live" else 0.0))
        elif self.pinned_pages() + self.pages(e["ntok"]) > self.max_pinned:
            assert ok is False
            self.c["refused_leases"] += 1
        else:
            assert ok is True
            self.lru.remove(key)
            self.grant(e, self.now + ttl)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def release_lease(self, data):
        key = data.draw(st.sampled_from(self.keys()))
        e = self.entries[key]
        if e["lease"] == "none":
            before = self.pool.stats()
            with pytest.raises(ValueError):
                self.pool.release_lease(*key, now=self.now)
            assert self.pool.stats() == before
            return
        got = self.pool.release_lease(*key, now=self.now)
        self.expire()
        live = e["lease"] == "live"
        assert got is live
        e["lease"] = "none"
        if live and e["ref"] == 0:
            self.lru.append(key)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def free(self, data):
        key = data.draw(st.sampled_from(self.keys()))
        e = self.entries[key]
        if self.pinned(e) and not (e["ref"] == 0 and e["lease"] == "live" and e["expiry"] <= self.now):
            with pytest.raises(ValueError):
                self.pool.free(*key, now=self.now)
            self.expire()
            return
        self.pool.free(*key, now=self.now)
        self.expire()
        self.lru.remove(key)
        del self.entries[key]
        self.c["frees"] += 1

    @precondition(lambda self: any(e["ref"] > 0 for e in self.entries.values()))
    @rule(data=st.data(), extra=st.integers(0, 12))
    def extend(self, data, extra):
        key = data.draw(st.sampled_from([k for k in self.keys() if self.entries[k]["ref"] > 0]))
        self.fresh += 1
        new_key = (key[0], 100 + self.fresh)
        e = self.entries[key]
        ntok = e["ntok"] + extra
        got = self.pool.extend(*key, new_key[1], ntok, now=self.now)
        self.expire()
        add = self.pages(ntok) - self.pages(e["ntok"])
        if add > 0 and self.pinned_pages() + add > self.max_pinned:
            assert got is None
            self.c["refused_leases"] += 1
            return
        assert got is not None and len(got) == self.pages(ntok)
        if add > 0:
            self.reclaim(add)
        del self.entries[key]
        e["ntok"] = ntok
        self.entries[new_key] = e
        if e["lease"] == "live":
            self.seq += 1
            e["seq"] = self.seq

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.5]))
    def advance(self, dt):
        self.now += dt

    @rule()
    def expire_now(self):
        n_before = self.c["expirations"]
        got = self.pool.expire(now=self.now)
        self.expire()
        assert got == self.c["expirations"] - n_before

    # -- invariants
    @invariant()
    def matches_model(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        s = self.pool.stats()
        for k, v in self.c.items():
            assert s[k] == v, (k, s[k], v)
        assert s["entries"] == len(self.entries)
        assert sorted((u, f) for u in range(10) for f, _ in self.pool.entries_of(u)) == self.keys()
        # every page is free or in exactly one entry, never handed out twice
        owned = np.concatenate([self.pool.pages_of(*k) for k in self.keys()] or [np.zeros(0, np.int32)])
        assert len(set(owned.tolist())) == owned.size == s["used_pages"]
        assert s["used_pages"] + s["free_pages"] == self.num_pages
        assert s["used_pages"] <= s["peak_used_pages"]
        for k, e in self.entries.items():  # pinned entries survive any pressure, token counts are exact
            assert self.pool.lookup(*k) == e["ntok"]


@pytest.mark.parametrize("impl_name", sorted(pool_implementations()))
def test_pool_state_machine(impl_name):
    machine = type(f"PoolMachine_{impl_name}", (PoolMachine,), {"impl": pool_implementations()[impl_name]})
    machine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
    machine.TestCase().runTest()
