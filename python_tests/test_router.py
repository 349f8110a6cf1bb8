"""Affinity-aware router: rendezvous hashing, bounded load, ticket affinity, rejection-based forwarding."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr_engine.policy import (AffinityRouter, ForwardResult, load_cap, order_bounded, pick_bounded,
                                   rank_replicas, replica_weight)

USERS = range(20_000)
ids = st.one_of(st.integers(0, 2 ** 64 - 1), st.text(min_size=1, max_size=12))
replica_sets = st.lists(st.one_of(st.integers(0, 1000), st.text(min_size=1, max_size=8)), min_size=1, max_size=12,
                        unique_by=lambda r: (type(r), r))


def owners(router, users=USERS):
    return {u: router.route(u) for u in users}


# ---------------------------------------------------------------------------------------------------- hashing
def test_weight_is_a_stable_64_bit_hash():
    # Pinned values: the same user maps to the same replica in every process and release (no hash() salt).
    assert replica_weight(7, "replica-0") == 7057632572272113005
    assert replica_weight("user-7", 3) == 13460619734629959800
    assert 0 <= replica_weight(2 ** 64 - 1, b"r") < 2 ** 64
    # Type-tagged: the int 1 and the string "1" are different ids.
    assert replica_weight(1, 1) != replica_weight("1", 1) != replica_weight(1, "1")


@settings(max_examples=200, deadline=None)
@given(user=ids, replicas=replica_sets, seed=st.randoms(use_true_random=False))
def test_ranking_is_a_pure_function_of_user_and_replica_set(user, replicas, seed):
    shuffled = list(replicas)
    seed.shuffle(shuffled)
    ranked = rank_replicas(user, replicas)
    assert ranked == rank_replicas(user, shuffled)
    assert sorted(map(repr, ranked)) == sorted(map(repr, replicas))
    weights = [replica_weight(user, r) for r in ranked]
    assert weights == sorted(weights, reverse=True)


@settings(max_examples=100, deadline=None)
@given(user=ids, replicas=replica_sets, load=st.integers(0, 50))
def test_same_user_same_replica_when_loads_are_balanced(user, replicas, load):
    router = AffinityRouter(replicas)
    home = rank_replicas(user, replicas)[0]
    assert router.route(user) == home
    assert router.route(user, inflight={r: load for r in replicas}) == home
    assert router.route(user, inflight={}) == home
    assert AffinityRouter(list(reversed(replicas))).route(user) == home


def test_users_spread_evenly():
    n = 8
    counts = np.bincount(list(owners(AffinityRouter(range(n))).values()), minlength=n)
    # Binomial(20000, 1/8): sd ~ 47; 6 sd = 280.
    assert np.all(np.abs(counts - len(USERS) / n) < 280), counts


def test_removing_a_replica_moves_only_its_users():
    router = AffinityRouter([f"r{i}" for i in range(8)])
    before = owners(router)
    router.remove_replica("r3")
    after = owners(router)
    moved = {u for u in USERS if before[u] != after[u]}
    assert moved == {u for u in USERS if before[u] == "r3"}
    assert moved and all(after[u] != "r3" for u in USERS)


@settings(max_examples=25, deadline=None)
@given(replicas=replica_sets.filter(lambda r: len(r) >= 2), pick=st.integers(0, 11))
def test_removing_any_replica_moves_only_its_users(replicas, pick):
    router = AffinityRouter(replicas)
    gone = replicas[pick % len(replicas)]
    users = range(300)
    before = owners(router, users)
    router.remove_replica(gone)
    after = owners(router, users)
    assert all(after[u] == before[u] for u in users if before[u] != gone)


def test_adding_a_replica_moves_about_one_in_n_plus_one_users():
    n = 8
    router = AffinityRouter(range(n))
    before = owners(router)
    router.add_replica(n)
    after = owners(router)
    moved = [u for u in USERS if before[u] != after[u]]
    assert all(after[u] == n for u in moved)  # users only move to the new replica
    # Binomial(20000, 1/9): expected 2222, sd ~ 44; the bound is 9 sd.
    assert abs(len(moved) - len(USERS) / (n + 1)) < 400, len(moved)


# ---------------------------------------------------------------------------------------------------- bounded load
def test_load_cap_counts_the_request_being_placed():
    assert load_cap(0, 4, 1.25) == 1          # all idle: everyone may take one
    assert load_cap(7, 4, 1.0) == 2           # 8 requests over 4 replicas
    assert load_cap(9, 10, 1.1) == 2          # ceil(1.1 * 10 / 10) = ceil(1.1), not 1.1000000000000001 -> 2
    assert load_cap(99, 10, 1.1) == 11        # exactly 11.0, not rounded up to 12


def test_order_bounded_puts_over_cap_replicas_last_in_rank_order():
    ranked = ["a", "b", "c", "d"]
    inflight = {"a": 5, "b": 0, "c": 5, "d": 0}   # total 10: cap ceil(1.0 * 11 / 4) = 3
    assert order_bounded(ranked, inflight, 1.0) == ["b", "d", "a", "c"]
    assert pick_bounded(ranked, inflight, 1.0) == "b"
    assert order_bounded(ranked, None, 1.0) == ranked
    assert pick_bounded(ranked, {"a": 1, "zz": 100}, 4.0) == "a"  # cap ceil(4 * 2 / 4) = 2; "zz" is ignored
    with pytest.raises(IndexError):
        pick_bounded([], {}, 1.25)


@settings(max_examples=30, deadline=None)
@given(load_factor=st.floats(1.0, 3.0), n=st.integers(1, 10), seed=st.integers(0, 2 ** 32 - 1))
def test_skewed_arrivals_never_exceed_the_load_bound(load_factor, n, seed):
    rng = np.random.default_rng(seed)
    router = AffinityRouter(range(n), load_factor=load_factor)
    users = rng.zipf(1.3, size=400) % 50  # a few users send most requests
    inflight = {r: 0 for r in range(n)}
    for k, u in enumerate(users):
        total = sum(inflight.values())
        r = router.route(int(u), inflight=inflight)
        inflight[r] += 1
        assert inflight[r] <= math.ceil(load_factor * (total + 1) / n - 1e-9)
        if k % 3 == 2:  # some requests finish, so loads also fall
            busy = [x for x in inflight if inflight[x] > 0]
            inflight[busy[int(rng.integers(len(busy)))]] -= 1
    s = router.stats()
    assert s["router_routes"] == len(users)


def test_hot_user_spills_to_its_next_ranked_replicas():
    router = AffinityRouter(range(4), load_factor=1.0)
    ranked = router.ranked(42)
    inflight = {r: 0 for r in range(4)}
    placed = []
    for _ in range(8):
        r = router.route(42, inflight=inflight)
        inflight[r] += 1
        placed.append(r)
    assert placed[:4] == ranked          # 1.0 x mean: each replica takes one before anyone takes two
    assert sorted(inflight.values()) == [2, 2, 2, 2]
    assert router.stats()["router_load_skips"] > 0


# ---------------------------------------------------------------------------------------------------- tickets
def test_route_ranking_prefers_the_live_ticket_replica():
    router = AffinityRouter(["a", "b", "c"])
    home = router.route(9)
    other = next(r for r in router.replicas if r != home)
    # The prefix landed elsewhere (forwarded on rejection): ranking follows the ticket, even when it is busy.
    assert router.route_ranking(9, ticket_replica=other, inflight={other: 100}) == other
    router.remove_replica(other)
    assert router.route_ranking(9, ticket_replica=other) == home   # dead replica: routed anew, recomputes
    assert router.route_ranking(9) == home
    s = router.stats()
    assert (s["router_ticket_hits"], s["router_ticket_misses"]) == (1, 1)


# ---------------------------------------------------------------------------------------------------- forwarding
def test_rejected_preinfers_forward_to_the_next_ranked_replica():
    router = AffinityRouter(range(6))
    ranked = router.ranked("u1")
    full = set(ranked[:2])
    tried = []

    def attempt(r):
        tried.append(r)
        return None if r in full else ("ticket", r)

    res = router.forward("u1", attempt, deadline_s=10.0)
    assert res == ForwardResult(replica=ranked[2], value=("ticket", ranked[2]), attempts=3,
                                rejected=tuple(ranked[:2]), expired=False)
    assert res.landed and tried == ranked[:3]
    s = router.stats()
    assert (s["router_forwards"], s["router_forward_landed"], s["router_forward_rejections"]) == (1, 1, 2)


def test_forward_follows_the_bounded_order_and_max_attempts():
    router = AffinityRouter(range(4), load_factor=1.0)
    ranked = router.ranked(5)
    inflight = {ranked[0]: 3}  # total 3: cap ceil(4 / 4) = 1, the home replica is over it
    res = router.forward(5, lambda r: r, deadline_s=1.0, inflight=inflight)
    assert res.replica == ranked[1]
    res = router.forward(5, lambda r: None, deadline_s=1.0, max_attempts=2)
    assert (res.replica, res.attempts, res.rejected, res.expired) == (None, 2, tuple(ranked[:2]), False)
    assert router.stats()["router_forward_exhausted"] == 1


def test_forward_respects_the_deadline():
    router = AffinityRouter(range(8))
    clock = [100.0]
    starts = []

    def attempt(r):
        starts.append(clock[0])
        clock[0] += 0.25  # each rejection takes 0.25 s
        return None

    res = router.forward(1, attempt, deadline_s=1.0, clock=lambda: clock[0])
    assert starts == [100.0, 100.25, 100.5, 100.75]       # no attempt starts at or past 101.0
    assert (res.replica, res.attempts, res.expired) == (None, 4, True)
    assert res.rejected == tuple(router.ranked(1)[:4])
    assert router.stats()["router_forward_expired"] == 1


# ---------------------------------------------------------------------------------------------------- misuse
@pytest.mark.parametrize("call, exc, match", [
    (lambda: AffinityRouter([1], load_factor=0.9), ValueError, "load_factor"),
    (lambda: AffinityRouter([1, 1]), ValueError, "replica 1 is already"),
    (lambda: AffinityRouter([1.5]), ValueError, "replica must be an int, str or bytes"),
    (lambda: AffinityRouter([1]).route(2.5), ValueError, "user_id must be an int, str or bytes"),
    (lambda: AffinityRouter([1]).route(True), ValueError, "user_id"),
    (lambda: AffinityRouter([]).route(1), IndexError, "no replicas"),
    (lambda: AffinityRouter([1]).remove_replica(2), KeyError, "replica 2 is not routed to"),
    (lambda: AffinityRouter([1]).route(1, inflight={1: -1}), ValueError, "inflight\\[1\\]"),
    (lambda: AffinityRouter([1]).forward(1, lambda r: r, deadline_s=0), ValueError, "deadline_s"),
    (lambda: AffinityRouter([1]).forward(1, lambda r: r, deadline_s=1, max_attempts=0), ValueError,
     "max_attempts"),
    (lambda: AffinityRouter([1]).forward(1, None, deadline_s=1), ValueError, "attempt"),
    (lambda: rank_replicas(1, ["a", "a"]), ValueError, "distinct"),
    (lambda: load_cap(-1, 2, 1.0), ValueError, "total_inflight"),
    (lambda: load_cap(0, 0, 1.0), ValueError, "num_replicas"),
])
def test_misuse_raises_naming_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_replica_set_changes_while_routing():
    router = AffinityRouter(range(4))
    errors = []

    def churn():
        for _ in range(300):
            router.add_replica("extra")
            router.remove_replica("extra")

    def route():
        try:
            for u in range(3000):
                assert router.route(u) in (0, 1, 2, 3, "extra")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn), threading.Thread(target=route), threading.Thread(target=route)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert router.replicas == (0, 1, 2, 3)
    assert router.stats()["router_routes"] == 6000
