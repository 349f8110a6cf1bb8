"""The engine with its policies: DRAM expander (spill / reload) and the sequence-aware trigger."""
from __future__ import annotations

import threading

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.policy import LatencyModel, SequenceAwareTrigger, TriggerConfig

PAGE = 8
ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    cfg = rg.GRModelConfig(attention="hstu", num_layers=2, hidden_dim=32, num_heads=2, head_dim=16,
                           num_items=1000, num_actions=4, max_seq_len=128, num_tasks=2, num_time_buckets=16)
    return rg.build_ranker(cfg, seed=0)


def engine_for(model, trigger=None, **cache):
    cfg = dict(page_size=PAGE, num_pages=12, max_pinned_fraction=1.0, lease_ttl_s=5.0, attention_backend="torch",
               dram_bytes=1 << 24)
    cfg.update(cache)
    return rg.RelayEngine(model, rg.CacheConfig(**cfg), trigger=trigger, extend_on_rank=False)


def history(L, seed):
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(item_ids=torch.randint(0, 1000, (L,), generator=g),
                        action_ids=torch.randint(0, 4, (L,), generator=g),
                        timestamps=torch.cumsum(torch.randint(0, 3000, (L,), generator=g), 0) + 1_700_000_000)


CANDS = torch.randint(0, 1000, (9,), generator=torch.Generator().manual_seed(5))


def assert_exact(res, model, hist):
    assert float((res.scores - model.rank_full(hist, CANDS)).abs().max()) <= ATOL


def relay(engine, user, hist, now):
    ticket = engine.prefill_prefix(user, hist, now=now)
    assert ticket.admitted
    return engine.rank_with_prefix(user, hist, CANDS, ticket=ticket, now=now + 0.05)


def test_evicted_prefix_comes_back_from_dram_exactly(model):
    engine = engine_for(model)
    hists = {u: history(40, seed=u) for u in (1, 2, 3)}  # 5 pages each; the pool holds 12
    for i, (u, h) in enumerate(hists.items()):
        assert relay(engine, u, h, now=float(i)).source == "hbm"
    assert engine.pool.entries_of(1) == []  # user 3 evicted user 1 from device memory
    s = engine.stats()
    assert s["spills"] == 3 and s["evictions"] == 1 and s["dram_entries"] == 3
    longer = rg.Behaviors(item_ids=torch.cat([hists[1].item_ids, torch.tensor([3, 4, 5])]),
                          action_ids=torch.cat([hists[1].action_ids, torch.tensor([0, 1, 2])]),
                          timestamps=torch.cat([hists[1].timestamps, hists[1].timestamps[-1:] + 10 + torch.arange(3)]))
    res = engine.rank_with_prefix(1, longer, CANDS, now=10.0)
    assert res.source == "dram" and res.cached_tokens == 40 and res.computed_tokens == 3 + CANDS.numel()
    assert_exact(res, model, longer)
    s = engine.stats()
    assert s["dram_hits"] == 1 and s["reloads"] == 1 and s["reload_bytes"] > 0 and s["recomputes"] == 0
    res = engine.rank_with_prefix(1, longer, CANDS, now=11.0)  # back in device memory now
    assert res.source == "hbm"
    assert_exact(res, model, longer)


def test_a_ranking_compares_only_dram_entries_longer_than_its_device_match(model, monkeypatch):
    """With the prefix on the device and its copy in DRAM (as long), a ranking compares the request's tokens with
    the device entry only: a DRAM entry can share at most its own length, so no shorter or equal one can beat the
    device match (with no device match every DRAM entry is compared: the DRAM-hit tests above)."""
    from relaygr_engine.engine import index

    engine = engine_for(model)
    h = history(40, seed=3)
    relay(engine, 1, h.prefix(32), now=0.0)  # on the device, and spilled to DRAM once unleased and unpinned
    assert engine.dram.entries_of(1) and engine.pool.entries_of(1)
    compared = []
    real = index.PrefixIndex._common
    monkeypatch.setattr(index.PrefixIndex, "_common", lambda self, p, fp, n, *a: compared.append(n) or real(
        self, p, fp, n, *a))
    res = engine.rank_with_prefix(1, h, CANDS, now=1.0)
    assert res.source == "hbm" and res.cached_tokens == 32 and compared == [32]  # the device entry only
    assert_exact(res, model, h)


def test_prefill_of_a_longer_prefix_reloads_the_dram_copy_and_computes_only_new_tokens(model):
    engine = engine_for(model)
    long1 = history(60, seed=1)
    h1 = long1.prefix(40)
    for i, (u, h) in enumerate(((1, h1), (2, history(40, seed=2)), (3, history(40, seed=3)))):
        assert relay(engine, u, h, now=float(i)).source == "hbm"
    assert engine.pool.entries_of(1) == []  # evicted from device memory, kept in DRAM
    ticket = engine.prefill_prefix(1, long1.prefix(52), now=10.0)
    assert ticket.admitted and ticket.cached_tokens == 40 and ticket.computed_tokens == 12
    s = engine.stats()
    assert s["prefill_dram_reloads"] == 1 and s["reloads"] == 1
    res = engine.rank_with_prefix(1, long1, CANDS, ticket=ticket, now=10.05)
    assert res.source == "hbm" and res.cached_tokens == 52
    assert_exact(res, model, long1)


def test_concurrent_rankings_share_one_reload_and_do_not_respill(model):
    engine = engine_for(model)
    hists = {u: history(40, seed=10 + u) for u in (1, 2, 3)}
    for i, (u, h) in enumerate(hists.items()):
        relay(engine, u, h, now=float(i))
    assert engine.pool.entries_of(1) == []
    spills = engine.stats()["spills"]
    results, errors = [], []

    def rank():
        try:
            results.append(engine.rank_with_prefix(1, hists[1], CANDS, now=10.0))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(r.source for r in results) == ["dram"] + ["hbm"] * 7
    for r in results:
        assert_exact(r, model, hists[1])
    s = engine.stats()
    assert s["reloads"] == 1 and s["dram_hits"] == 1 and s["hbm_hits"] == 3 + 7
    assert s["spills"] == spills, "a reloaded entry was copied to DRAM again while its DRAM copy is valid"


def test_lease_ending_unused_spills_before_eviction(model):
    engine = engine_for(model)
    h = history(40, seed=21)
    assert engine.prefill_prefix(1, h, now=0.0).admitted  # the ranking never comes
    assert engine.stats()["spills"] == 0
    other = history(40, seed=22)
    relay(engine, 2, other, now=6.0)  # lease of user 1 ran out at 5.0: spilled at this call's start
    s = engine.stats()
    assert s["expired_leases"] == 1 and s["spills"] == 2
    relay(engine, 3, history(40, seed=23), now=7.0)  # evicts user 1
    assert engine.pool.entries_of(1) == []
    res = engine.rank_with_prefix(1, h, CANDS, now=8.0)
    assert res.source == "dram"
    assert_exact(res, model, h)


def test_reload_declined_when_recompute_is_predicted_cheaper(model):
    engine = engine_for(model)
    hists = {u: history(40, seed=30 + u) for u in (1, 2, 3)}
    for i, (u, h) in enumerate(hists.items()):
        relay(engine, u, h, now=float(i))
    engine.expander.reload_bytes_per_s = 1.0  # a reload would take ages
    res = engine.rank_with_prefix(1, hists[1], CANDS, now=10.0)
    assert res.source == "recompute"
    assert_exact(res, model, hists[1])
    s = engine.stats()
    assert s["reloads_declined_cost"] == 1 and s["reloads"] == 0


def test_dram_tier_off_by_default(model):
    engine = engine_for(model, dram_bytes=0)
    assert engine.dram is None
    hists = {u: history(40, seed=40 + u) for u in (1, 2, 3)}
    for i, (u, h) in enumerate(hists.items()):
        relay(engine, u, h, now=float(i))
    res = engine.rank_with_prefix(1, hists[1], CANDS, now=10.0)
    assert res.source == "recompute"
    assert_exact(res, model, hists[1])
    assert engine.stats()["spills"] == 0


def test_trigger_declining_still_ranks_exactly(model):
    never = SequenceAwareTrigger(LatencyModel(a=1.0, b=0.0, c=0.0), TriggerConfig(slo_ms=50.0))
    engine = engine_for(model, trigger=never)
    h = history(40, seed=51)
    ticket = engine.prefill_prefix(1, h, now=0.0)
    assert not ticket.admitted and ticket.reason == "trigger:not_at_risk"
    res = engine.rank_with_prefix(1, h, CANDS, ticket=ticket, now=0.05)
    assert res.source == "recompute"
    assert_exact(res, model, h)
    s = engine.stats()
    assert s["trigger_declines"] == 1 and s["trigger_admits"] == 0 and s["trigger_declines_not_at_risk"] == 1
    assert s["prefill_declines_trigger"] == 1 and s["recomputes"] == 1


def test_trigger_admits_at_risk_prefixes_and_bounds_footprint(model):
    at_risk = SequenceAwareTrigger(LatencyModel(a=100.0, b=0.0, c=0.0),
                                   TriggerConfig(slo_ms=50.0, max_footprint_fraction=0.5))
    engine = engine_for(model, trigger=at_risk)
    first = engine.prefill_prefix(1, history(40, seed=61), now=0.0)  # 5 pinned pages of 12
    assert first.admitted
    second = engine.prefill_prefix(2, history(40, seed=62), now=0.0)  # 5 + 5 > 6: footprint bound
    assert not second.admitted and second.reason == "trigger:footprint"
    s = engine.stats()
    assert s["trigger_admits"] == 1 and s["trigger_declines_footprint"] == 1
    assert s["trigger_inflight_prefills"] == 0, "the engine reports admitted prefills as done"
    assert engine.rank_with_prefix(1, history(40, seed=61), CANDS, ticket=first, now=0.1).source == "hbm"
