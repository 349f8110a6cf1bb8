"""Block pool behaviour, for every implementation (C++ and pure Python); its model check is in test_pool_model.py."""
from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from relaygr_engine._ext import CppPrefixBlockPool


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
