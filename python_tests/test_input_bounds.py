"""Edges of the engine's inputs and bookkeeping: computed scores are never lost, times whose differences cannot be
represented are refused, records and configs are validated when built, and the pure-Python pool's lease heap stays
bounded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import relaygr_engine as rg
from relaygr_engine._ext import PyPrefixBlockPool
from relaygr_engine.tiers import DramEntry, HostKVTier

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = rg.GRModelConfig(attention="hstu", num_layers=2, hidden_dim=32, num_heads=2, head_dim=16, num_items=1000,
                       num_actions=4, max_seq_len=128, num_tasks=2, num_time_buckets=16)


def history(L: int, seed: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(item_ids=torch.randint(0, 1000, (L,), generator=g),
                        action_ids=torch.randint(0, 4, (L,), generator=g),
                        timestamps=torch.cumsum(torch.randint(0, 3000, (L,), generator=g), 0) + 1_700_000_000)


def max_diff(scores: torch.Tensor, want: torch.Tensor) -> float:
    return float((scores - want).abs().max())


def test_stored_misses_that_evict_each_other_keep_every_ranking():
    """Three 12-token misses in a 8-page pool of 4 tokens: each stored miss (3 pages, DRAM copy on) evicts the one
    before it; every ranking still returns its exact scores and is counted once."""
    model = rg.build_ranker(CFG, seed=0)
    engine = rg.RelayEngine(model, rg.CacheConfig(num_pages=8, page_size=4, dram_bytes=1 << 20), store_misses=True)
    cands = torch.randint(0, 1000, (5,), generator=torch.Generator().manual_seed(1))
    hists = {u: history(12, u) for u in (1, 2, 3)}
    results = engine.rank_with_prefix_batch([rg.RankRequest(u, hists[u], cands) for u in (1, 2, 3)], now=0.0)
    assert [r.source for r in results] == ["recompute"] * 3
    for u, r in zip((1, 2, 3), results):
        assert max_diff(r.scores, model.rank_full(hists[u], cands)) <= 1e-4
    s = engine.stats()
    assert s["rank_requests"] == 3 and s["recomputes"] == 3
    engine.pool.check_invariants()
    again = engine.rank_with_prefix_batch([rg.RankRequest(u, hists[u], cands) for u in (1, 2, 3)], now=1.0)
    for u, r in zip((1, 2, 3), again):
        assert max_diff(r.scores, model.rank_full(hists[u], cands)) <= 1e-4


@pytest.mark.parametrize("num_candidates", [5, 300], ids=["torch-plan", "blockwise"])
def test_widest_time_span_is_exact_on_every_attention_path(num_candidates):
    """Times in [0, 2**63): the span 2**63 - 1 is representable and every path buckets it the same way."""
    model = rg.build_ranker(CFG, seed=0)
    h = rg.Behaviors(item_ids=torch.tensor([1, 2, 3]), action_ids=torch.tensor([0, 1, 2]),
                     timestamps=torch.tensor([0, 1 << 62, (1 << 63) - 1]))
    cands = torch.randint(0, 1000, (num_candidates,), generator=torch.Generator().manual_seed(2))
    engine = rg.RelayEngine(model, rg.CacheConfig(page_size=4, num_pages=64, attention_backend="torch"))
    want = model.rank_full(h, cands)
    assert max_diff(engine.rank_with_prefix(1, h, cands, now=0.0).scores, want) <= 1e-4
    assert max_diff(model.rank_uncached(h, cands), want) <= 1e-4
    for t_req in (0, (1 << 63) - 1):  # candidates at either end of the span
        got = engine.rank_with_prefix(1, h, cands, request_time=t_req, now=1.0).scores
        assert max_diff(got, model.rank_full(h, cands, request_time=t_req)) <= 1e-4


def test_times_whose_differences_overflow_are_refused_everywhere():
    model = rg.build_ranker(CFG, seed=0)
    engine = rg.RelayEngine(model, rg.CacheConfig(page_size=4, num_pages=64))
    h = rg.Behaviors(item_ids=torch.tensor([1, 2, 3]), action_ids=torch.tensor([0, 1, 2]),
                     timestamps=torch.tensor([-(1 << 62), 0, 1 << 62]))
    cands = torch.tensor([4, 5])
    for call in (lambda: engine.rank_with_prefix(1, h, cands), lambda: engine.prefill_prefix(1, h),
                 lambda: model.rank_full(h, cands)):
        with pytest.raises(ValueError, match="history.timestamps must be times in seconds >= 0"):
            call()
    ok = history(4, 0)
    with pytest.raises(ValueError, match=r"request_time must be an integer time in seconds in \[0, 2\*\*63\)"):
        engine.rank_with_prefix(1, ok, cands, request_time=-5)
    assert engine.stats()["rank_requests"] == 0 and len(engine.pool) == 0


@pytest.mark.parametrize("change, match", [
    (dict(fingerprint=[1]), "fingerprint must be an integer in"),
    (dict(fingerprint=1 << 64), "fingerprint must be an integer in"),
    (dict(user_id="1"), "user_id must be an integer in"),
    (dict(admitted=1), "admitted must be a bool"),
    (dict(reason=None), "reason must be a str"),
    (dict(num_tokens=-1), "num_tokens must be an integer >= 0"),
    (dict(num_tokens=2.5), "num_tokens must be an integer >= 0"),
    (dict(expires_at=float("nan")), "expires_at must be a finite number"),
    (dict(cached_tokens=True), "cached_tokens must be an integer >= 0"),
])
def test_ticket_fields_are_checked_when_built(change, match):
    fields = dict(admitted=True, reason="admitted", user_id=1, fingerprint=1, num_tokens=20, expires_at=0.0)
    fields.update(change)
    with pytest.raises(ValueError, match=match):
        rg.PrefixTicket(**fields)
    t = rg.PrefixTicket(True, "admitted", np.uint64(1), np.int64(7), np.int32(20), np.float32(0.5))
    assert [type(v) for v in (t.user_id, t.fingerprint, t.num_tokens, t.expires_at)] == [int, int, int, float]


def test_configs_take_numpy_integers_and_refuse_bools():
    c = rg.CacheConfig(num_pages=np.int64(8), page_size=np.int32(4), dram_bytes=np.uint32(64), lease_ttl_s=np.int64(2))
    assert (c.num_pages, c.page_size, c.dram_bytes, c.lease_ttl_s) == (8, 4, 64, 2.0)
    assert all(type(v) is int for v in (c.num_pages, c.page_size, c.dram_bytes))
    m = rg.GRModelConfig(num_layers=np.int64(1), hidden_dim=np.int16(32), num_context_tokens=np.uint8(0))
    assert type(m.num_layers) is int and type(m.hidden_dim) is int and m.ffn_dim == 128
    assert HostKVTier(np.int64(100)).capacity_bytes == 100
    for kw in (dict(lease_ttl_s=True), dict(max_pinned_fraction=True), dict(dram_bytes=True), dict(num_pages=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            rg.CacheConfig(**kw)
    with pytest.raises(ValueError, match="num_layers"):
        rg.GRModelConfig(num_layers=True)
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostKVTier(True)


def test_cached_timestamps_must_be_integers():
    cache = rg.PagedKVCache(rg.CacheConfig(page_size=4, num_pages=4), 1, 1, 2)
    pages = np.array([0, 1], dtype=np.int32)
    for bad in (torch.tensor([1.7, 2.0]), torch.tensor([float("nan"), 1.0]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match="timestamps must be a 1-D integer tensor"):
            cache.write_timestamps(pages, bad)
    cache.write_timestamps(pages, torch.tensor([5, 6], dtype=torch.int32), start=3)
    assert cache.gather_timestamps(pages, 5)[3:].tolist() == [5, 6]


def test_dram_entries_agree_with_their_data():
    kv = torch.zeros(1, 2, 8, 1, 2)
    with pytest.raises(ValueError, match=r"timestamps must be int64 of shape \(5,\)"):
        DramEntry(1, 1, 5, kv, torch.arange(4))
    with pytest.raises(ValueError, match="kv must hold num_tokens=9 token slots"):
        DramEntry(1, 1, 9, kv, torch.arange(9))
    with pytest.raises(ValueError, match="kv must be a"):
        DramEntry(1, 1, 4, kv[0], torch.arange(4))
    with pytest.raises(ValueError, match="num_tokens"):
        DramEntry(1, 1, 0, kv, torch.arange(0))
    tier = HostKVTier(1 << 20)
    with pytest.raises(ValueError, match="entry must be a DramEntry"):
        tier.put((1, 1, 4, kv, torch.arange(4)))
    assert tier.put(DramEntry(1, 1, 8, kv, torch.arange(8))) and len(tier) == 1


def test_python_pool_compacts_released_lease_records():
    pool = PyPrefixBlockPool(num_pages=64, page_size=4)
    for u in range(8):
        pool.insert(u, 1, 4, now=0.0)
        pool.unpin(u, 1, now=0.0)
    for i in range(20_000):
        u = i % 8
        assert pool.lease(u, 1, ttl_s=1e9, now=float(i))
        pool.release_lease(u, 1, now=float(i))
    assert len(pool._heap) <= 64
    assert pool.lease(3, 1, ttl_s=5.0, now=30_000.0)  # a live lease survives compaction and still expires
    others = [0, 1, 2, 4, 5, 6, 7]
    for i in range(200):  # churn on the other entries compacts the heap again
        u = others[i % len(others)]
        pool.lease(u, 1, ttl_s=1e9, now=30_000.0)
        pool.release_lease(u, 1, now=30_000.0)
    assert len(pool._heap) <= 64
    pool.check_invariants()
    assert pool.has_lease(3, 1, now=30_004.0) and not pool.has_lease(3, 1, now=30_005.0)


def test_engine_leases_find_ended_ones_in_end_order_and_stay_bounded():
    from relaygr_engine.engine.tiers import Leases

    leases = Leases()
    leases[(1, 10)], leases[(2, 20)], leases[(3, 30)] = 5.0, 3.0, 9.0
    leases[(1, 10)] = 8.0                                    # renewed: its old end no longer counts
    assert leases.pop((3, 30)) == 9.0 and (3, 30) not in leases
    assert leases.due(4.0) == [(2, 20)] and leases.due(7.9) == [] and len(leases) == 1
    leases[(4, 40)] = 8.0
    assert leases.due(100.0) == [(1, 10), (4, 40)] and len(leases) == 0 and leases.due(1e9) == []
    for i in range(20_000):                                 # tickets presented before their lease ends
        leases[(i % 8, i)] = 1e9 + i
        leases.pop((i % 8, i))
    leases[(9, 9)] = 50.0
    assert len(leases._heap) <= 2 * len(leases) + 64 + 1
    assert leases.due(49.0) == [] and leases.due(50.0) == [(9, 9)]
