"""HostKVTier (DRAM tier) and SingleFlight."""
from __future__ import annotations

import pytest
import torch

from relaygr_engine.tiers import DramEntry, HostKVTier, ReloadCostModel


def _entry(user, fp, tokens, layers=2, heads=2, dim=4):
    kv = torch.randn(layers, 2, tokens, heads, dim)
    return DramEntry(user, fp, tokens, kv, torch.arange(tokens))


def test_put_get_lru_and_budget():
    one = _entry(0, 0, 8).nbytes
    tier = HostKVTier(capacity_bytes=3 * one)
    for u in range(3):
        assert tier.put(_entry(u, 0, 8))
    assert tier.get(0, 0) is not None  # user 0 becomes most recent: LRU order 1, 2, 0
    assert tier.put(_entry(3, 0, 8))
    assert (1, 0) not in tier and (0, 0) in tier and (2, 0) in tier
    assert tier.used_bytes == 3 * one
    s = tier.stats()
    assert s["dram_evictions"] == 1 and s["dram_entries"] == 3 and s["dram_lookup_hits"] == 1
    assert tier.get(1, 0) is None and tier.stats()["dram_lookups"] == 2


def test_replacing_a_key_does_not_double_count():
    tier = HostKVTier(capacity_bytes=1 << 20)
    tier.put(_entry(1, 1, 8))
    tier.put(_entry(1, 1, 8))
    assert len(tier) == 1 and tier.used_bytes == _entry(1, 1, 8).nbytes
    assert tier.entries_of(1) == [(1, 8)]
    assert tier.discard(1, 1) and not tier.discard(1, 1) and tier.used_bytes == 0


def test_entries_of_a_user_follow_puts_lookups_evictions_and_discards():
    """A user's entries, least recently used first, through every change of the tier (kept per user: a lookup does
    not walk the other users' entries)."""
    one = _entry(0, 0, 8).nbytes
    tier = HostKVTier(capacity_bytes=5 * one)
    for fp in (1, 2, 3):
        assert tier.put(_entry(7, fp, 8))
    assert tier.put(_entry(8, 1, 8)) and tier.put(_entry(8, 2, 8))
    assert tier.entries_of(7) == [(1, 8), (2, 8), (3, 8)] and tier.entries_of(9) == []
    assert tier.get(7, 1) is not None                         # now the user's most recent
    assert tier.entries_of(7) == [(2, 8), (3, 8), (1, 8)]
    assert tier.put(_entry(9, 1, 8))                          # evicts the tier's oldest: (7, 2)
    assert tier.entries_of(7) == [(3, 8), (1, 8)] and tier.entries_of(9) == [(1, 8)]
    assert tier.put(_entry(7, 3, 4))                          # replaced: fewer tokens, most recent
    assert tier.entries_of(7) == [(1, 8), (3, 4)]
    assert tier.discard(8, 1) and tier.discard(8, 2) and tier.entries_of(8) == []
    assert 8 not in tier._by_user and sorted(tier._by_user) == [7, 9]


def test_entry_larger_than_budget_is_refused():
    tier = HostKVTier(capacity_bytes=100)
    assert not tier.put(_entry(1, 1, 64))
    assert len(tier) == 0 and tier.stats()["dram_put_refused"] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostKVTier(0)
    if torch.cuda.is_available():
        tier = HostKVTier(1 << 20)
        e = DramEntry(1, 1, 4, torch.zeros(1, 2, 4, 1, 1, device="cuda"), torch.zeros(4, dtype=torch.long))
        with pytest.raises(ValueError, match="host tensor"):
            tier.put(e)


def test_reload_cost_model_prefers_the_cheaper_path():
    m = ReloadCostModel(alpha=1.0)
    assert m.prefers_reload(100, 1 << 30)  # nothing measured yet: reload
    m.observe_reload(1_000_000, 0.001)  # 1 GB/s
    m.observe_recompute(1000, 0.010)  # 10 us per token
    assert m.prefers_reload(tokens=1000, nbytes=1_000_000)  # 1 ms reload < 10 ms recompute
    assert not m.prefers_reload(tokens=10, nbytes=1_000_000)  # 1 ms reload > 0.1 ms recompute
    with pytest.raises(ValueError, match="alpha"):
        ReloadCostModel(alpha=0)
