"""Block pool behaviour, for every implementation (C++ and pure Python)."""
from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from relaygr_engine._ext import CppPrefixBlockPool, pool_implementations


# ----------------------------------------------------------------------------- plain behaviour
def test_insert_returns_pinned_pages_in_token_order(pool_cls):
    pool = pool_cls(num_pages=8, page_size=4)
    pages = pool.insert(1, 10, num_tokens=9, now=0.0)
    assert pages.dtype == np.int32 and pages.shape == (3,)
    assert len(set(pages.tolist())) == 3
    assert pool.num_pinned_pages == 3 and pool.num_free_pages == 5
    assert pool.lookup(1, 10) == 9 and (1, 10) in pool and len(pool) == 1
    np.testing.assert_array_equal(pool.pages_of(1, 10), pages)
    pool.unpin(1, 10, now=0.0)
    assert pool.num_pinned_pages == 0 and pool.num_evictable_pages == 3
    pool.check_invariants()


def test_lru_eviction_order_and_pinned_survival(pool_cls):
    pool = pool_cls(num_pages=6, page_size=2)
    for user in range(3):  # three 2-page entries fill the pool
        pool.insert(user, 0, 4, now=0.0)
    for user in (1, 0, 2):  # unpin order = LRU order: 1 oldest
        pool.unpin(user, 0, now=0.0)
    assert pool.pin(0, 0, now=0.0) is not None  # pinned: must survive
    pool.unpin(0, 0, now=0.0)  # ...and now most recently used: order 1, 2, 0
    assert pool.insert(9, 0, 3, now=0.0) is not None  # needs 2 pages: evicts user 1
    assert (1, 0) not in pool and (2, 0) in pool and (0, 0) in pool
    pool.pin(2, 0, now=0.0)
    assert pool.insert(8, 0, 4, now=0.0) is not None  # user 2 is pinned: evicts user 0
    assert (0, 0) not in pool and (2, 0) in pool
    assert pool.stats()["evictions"] == 2 and pool.stats()["evicted_pages"] == 4
    pool.check_invariants()


def test_capacity_pressure_is_a_value_and_changes_nothing(pool_cls):
    pool = pool_cls(num_pages=4, page_size=2, max_pinned_pages=4)
    pool.insert(1, 1, 6, now=0.0)  # 3 pages pinned
    before = pool.stats()
    assert pool.insert(2, 2, 4, now=0.0) is None  # needs 2, only 1 unpinned page
    after = pool.stats()
    assert after.pop("refused_leases") == before.pop("refused_leases") + 1
    assert after == before
    pool.check_invariants()


def test_pinned_budget_refuses_leases_but_not_reads(pool_cls):
    pool = pool_cls(num_pages=10, page_size=1, max_pinned_pages=4)
    assert pool.insert(1, 1, 3, ttl_s=5.0, now=0.0) is not None
    pool.unpin(1, 1, now=0.0)  # still pinned by its lease
    assert pool.insert(2, 2, 2, ttl_s=5.0, now=0.0) is None  # 3 + 2 > 4
    assert pool.insert(3, 3, 1, now=0.0) is not None  # 3 + 1 <= 4
    pool.unpin(3, 3, now=0.0)
    assert pool.lease(3, 3, ttl_s=1.0, now=0.0)  # 4 pinned
    assert pool.release_lease(1, 1, now=0.0) is True  # 1 pinned
    assert pool.insert(4, 4, 2, now=0.0) is not None
    pool.unpin(4, 4, now=0.0)
    # 1 page pinned (user 3); a ranking read of user 4 is never refused even past the budget
    assert pool.lease(1, 1, ttl_s=1.0, now=0.0)  # 1 + 3 = 4
    assert pool.pin(4, 4, now=0.0) is not None
    assert pool.num_pinned_pages == 6
    assert pool.lease(1, 1, 1.0, now=0.0) is True  # already leased: extends, takes no new pages
    assert pool.stats()["refused_leases"] == 1
    pool.check_invariants()


def test_lease_expiry_unpins_and_release_semantics(pool_cls):
    pool = pool_cls(num_pages=4, page_size=4)
    pool.insert(1, 1, 4, ttl_s=1.0, now=0.0)
    pool.unpin(1, 1, now=0.0)
    assert pool.has_lease(1, 1, now=0.5)
    assert pool.num_pinned_pages == 1
    assert pool.expire(now=1.0) == 1  # deadline reached
    assert not pool.has_lease(1, 1, now=1.0)
    assert pool.num_pinned_pages == 0 and pool.stats()["expirations"] == 1
    assert pool.release_lease(1, 1, now=1.0) is False  # expired before the ranking came
    with pytest.raises(ValueError, match="no lease"):
        pool.release_lease(1, 1, now=1.0)  # double release
    assert pool.lease(1, 1, ttl_s=2.0, now=1.0)
    assert pool.release_lease(1, 1, now=1.5) is True
    assert pool.num_pinned_pages == 0
    pool.check_invariants()


def test_lease_renewal_keeps_the_later_deadline(pool_cls):
    pool = pool_cls(num_pages=4, page_size=4)
    pool.insert(1, 1, 4, ttl_s=5.0, now=0.0)
    pool.unpin(1, 1, now=0.0)
    assert pool.lease(1, 1, ttl_s=1.0, now=1.0)  # shorter renewal does not cut the lease
    assert pool.expire(now=3.0) == 0 and pool.has_lease(1, 1, now=3.0)
    assert pool.lease(1, 1, ttl_s=10.0, now=4.0)
    assert pool.expire(now=6.0) == 0
    assert pool.expire(now=14.0) == 1


def test_extend_grows_and_rekeys(pool_cls):
    pool = pool_cls(num_pages=8, page_size=4)
    first = pool.insert(5, 100, 6, ttl_s=3.0, now=0.0)
    grown = pool.extend(5, 100, 101, num_tokens=13, now=0.0)
    assert grown.shape == (4,)
    np.testing.assert_array_equal(grown[:2], first)
    assert (5, 100) not in pool and pool.lookup(5, 101) == 13
    assert pool.entries_of(5) == [(101, 13)]
    assert pool.has_lease(5, 101, now=1.0)  # the lease moved with the key
    pool.unpin(5, 101, now=0.0)
    with pytest.raises(ValueError, match="pinned by the caller"):
        pool.extend(5, 101, 102, 20, now=0.0)
    pool.check_invariants()


def test_page_table_layout(pool_cls):
    pool = pool_cls(num_pages=16, page_size=4)
    a = pool.insert(1, 1, 4, now=0.0)
    b = pool.insert(2, 2, 9, now=0.0)
    c = pool.insert(3, 3, 1, now=0.0)
    indptr, indices, last = pool.page_table([(2, 2), (1, 1), (3, 3)])
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    np.testing.assert_array_equal(indptr, [0, 3, 4, 5])
    np.testing.assert_array_equal(indices, np.concatenate([b, a, c]))
    np.testing.assert_array_equal(last, [1, 4, 1])
    indptr, indices, last = pool.page_table([])
    assert indptr.tolist() == [0] and indices.size == 0 and last.size == 0


def test_entries_of_lists_a_users_prefixes(pool_cls):
    pool = pool_cls(num_pages=16, page_size=4)
    pool.insert(7, 1, 3, now=0.0)
    pool.insert(7, 2, 8, now=0.0)
    pool.insert(8, 1, 3, now=0.0)
    assert pool.entries_of(7) == [(1, 3), (2, 8)]
    assert pool.entries_of(9) == []
    pool.unpin(7, 1, now=0.0)
    pool.free(7, 1, now=0.0)
    assert pool.entries_of(7) == [(2, 8)]


def test_large_ids_round_trip(pool_cls):
    pool = pool_cls(num_pages=4, page_size=4)
    big = 2**64 - 1
    pool.insert(big, big, 1, now=0.0)
    assert pool.entries_of(big) == [(big, 1)]
    assert pool.lookup(big, big) == 1


# ----------------------------------------------------------------------------- misuse
def _assert_unchanged(pool, fn, exc, match):
    before = pool.stats()
    with pytest.raises(exc, match=match):
        fn()
    assert pool.stats() == before
    pool.check_invariants()


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_pages=0, page_size=4), "num_pages"),
    (dict(num_pages=-3, page_size=4), "num_pages"),
    (dict(num_pages=4, page_size=0), "page_size"),
    (dict(num_pages=4, page_size=4, max_pinned_pages=5), "max_pinned_pages"),
    (dict(num_pages=4, page_size=4, max_pinned_pages=0), "max_pinned_pages"),
    (dict(num_pages="4", page_size=4), "num_pages"),
    (dict(num_pages=4.0, page_size=4), "num_pages"),
])
def test_constructor_rejects_bad_arguments(pool_cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pool_cls(**kwargs)


def test_bad_arguments_raise_and_leave_the_pool_unchanged(pool_cls):
    pool = pool_cls(num_pages=8, page_size=4)
    pool.insert(1, 1, 4, ttl_s=1.0, now=0.0)  # pinned by ref and lease
    pool.insert(2, 2, 4, now=0.0)
    pool.unpin(2, 2, now=0.0)  # unpinned, no lease
    pool.insert(1, 3, 4, now=0.0)
    pool.unpin(1, 3, now=0.0)  # a second prefix of user 1
    cases = [
        (lambda: pool.insert(-1, 1, 4, now=0.0), ValueError, "user_id"),
        (lambda: pool.insert(2**64, 1, 4, now=0.0), ValueError, "user_id"),
        (lambda: pool.insert(3, -5, 4, now=0.0), ValueError, "fingerprint"),
        (lambda: pool.insert(3, 3, 0, now=0.0), ValueError, "num_tokens"),
        (lambda: pool.insert(3, 3, -2, now=0.0), ValueError, "num_tokens"),
        (lambda: pool.insert(3, 3, 4, ttl_s=-1.0, now=0.0), ValueError, "ttl_s"),
        (lambda: pool.insert(3, 3, 4, ttl_s=float("nan"), now=0.0), ValueError, "ttl_s"),
        (lambda: pool.insert(3, 3, 4, now=float("inf")), ValueError, "now"),
        (lambda: pool.insert(1, 1, 4, now=0.0), ValueError, "already cached"),
        (lambda: pool.insert("a", 3, 4, now=0.0), ValueError, "user_id"),
        (lambda: pool.pin(1, -1, now=0.0), ValueError, "fingerprint"),
        (lambda: pool.unpin(9, 9, now=0.0), KeyError, "user_id=9"),
        (lambda: pool.unpin(2, 2, now=0.0), ValueError, "ref count"),
        (lambda: pool.lease(9, 9, 1.0, now=0.0), KeyError, "user_id=9"),
        (lambda: pool.lease(2, 2, 0.0, now=0.0), ValueError, "ttl_s"),
        (lambda: pool.release_lease(2, 2, now=0.0), ValueError, "no lease"),
        (lambda: pool.release_lease(9, 9, now=0.0), KeyError, "user_id=9"),
        (lambda: pool.free(1, 1, now=0.0), ValueError, "pinned"),
        (lambda: pool.free(9, 9, now=0.0), KeyError, "user_id=9"),
        (lambda: pool.extend(9, 9, 10, 8, now=0.0), KeyError, "user_id=9"),
        (lambda: pool.extend(1, 1, 10, 3, now=0.0), ValueError, "num_tokens"),
        (lambda: pool.extend(1, 1, 3, 8, now=0.0), ValueError, "already cached"),
        (lambda: pool.extend(2, 2, 10, 8, now=0.0), ValueError, "pinned by the caller"),
        (lambda: pool.pages_of(9, 9), KeyError, "user_id=9"),
        (lambda: pool.page_table([(1, 1), (9, 9)]), KeyError, "user_id=9"),
        (lambda: pool.has_lease(9, 9, now=0.0), KeyError, "user_id=9"),
    ]
    for fn, exc, match in cases:
        _assert_unchanged(pool, fn, exc, match)


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


UNINITIALISED = """
import relaygr_engine._C as C
P = C.PrefixBlockPool
p = P.__new__(P)
calls = [lambda: p.num_pages, lambda: p.num_free_pages, lambda: p.num_pinned_pages, lambda: len(p), lambda: repr(p),
         lambda: (1, 2) in p, p.stats, p.check_invariants, lambda: p.insert(1, 2, 3), lambda: p.pin(1, 2),
         lambda: P.stats(object()), lambda: P.num_pages.fget(3)]
for i, call in enumerate(calls):
    try:
        call()
        print(i, "returned")
    except TypeError as e:
        print(i, "TypeError", e)
"""


@pytest.mark.skipif(CppPrefixBlockPool is None, reason="the C++ extension relaygr_engine._C is not built")
def test_cpp_pool_without_init_refuses_every_member():
    """``PrefixBlockPool.__new__`` leaves no C++ pool behind: every member raises TypeError (in a child process,
    so that a crash or a hang fails this test instead of ending the run)."""
    done = subprocess.run([sys.executable, "-c", UNINITIALISED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 12 and all(" TypeError " in line for line in lines), done.stdout
    assert sum("__init__() was not called" in line for line in lines) == 10
    assert all("needs a PrefixBlockPool" in line for line in lines[10:])


# ----------------------------------------------------------------------------- threads
def test_threaded_stress_keeps_invariants(pool_cls):
    pool = pool_cls(num_pages=64, page_size=4, max_pinned_pages=48)
    stop = time.monotonic() + 2.0
    errors: list[BaseException] = []
    refused = [0]

    def rounds():  # 2 s, and at least 200 rounds per thread however the machine schedules them
        n = 0
        while n < 200 or time.monotonic() < stop:
            n += 1
            yield n

    def prefill(seed):
        rng = random.Random(seed)
        for _ in rounds():
            user, fp = rng.randrange(40), rng.randrange(3)
            try:
                pages = pool.insert(user, fp, rng.randint(1, 24), ttl_s=rng.choice([0.0, 0.002, 0.01]))
            except ValueError:
                continue  # already cached by another thread
            if pages is None:
                refused[0] += 1
                continue
            pool.unpin(user, fp)

    def rank(seed):
        rng = random.Random(seed)
        for _ in rounds():
            user = rng.randrange(40)
            for fp, ntok in pool.entries_of(user):
                pages = pool.pin(user, fp)
                if pages is None:
                    continue  # evicted between listing and pinning
                assert len(pages) == -(-ntok // 4) or pool.lookup(user, fp) is not None
                try:
                    pool.release_lease(user, fp)
                except ValueError:
                    pass  # no lease (never leased, or another ranking ended it)
                pool.unpin(user, fp)

    def churn(seed):
        rng = random.Random(seed)
        for _ in rounds():
            pool.expire()
            user = rng.randrange(40)
            for fp, _ in pool.entries_of(user):
                try:
                    pool.free(user, fp)
                except (ValueError, KeyError):
                    pass  # pinned right now, or already gone
            pool.check_invariants()

    def guard(fn, seed):
        def run():
            try:
                fn(seed)
            except BaseException as exc:  # surfaced below
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guard(f, i)) for i, f in enumerate([prefill, prefill, rank, rank, churn])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    pool.expire(now=time.monotonic() + 3600)
    pool.check_invariants()
    s = pool.stats()
    assert s["pinned_pages"] == 0, "a reference or lease leaked"
    assert s["used_pages"] + s["free_pages"] == 64
    assert s["inserts"] > 0 and s["hits"] > 0
