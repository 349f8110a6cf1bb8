"""RelayEngine under every cache state: stale, leased, declined, evicted, extended prefixes fall back exactly;
constructor checks; bad input raises before any state changes."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_exact, candidates, history, make_engine, make_model, snapshot

import relaygr_engine as rg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------- cache state
def test_token_keys_are_kind_id_action_time_rows_every_entry_written(monkeypatch):
    """``Behaviors.token_keys``: ``(0, context id, -1, first behavior's time)`` per contextual token, then ``(1, item,
    action or -1, time or 0)`` per behavior, with and without each optional field; built in uninitialised memory,
    so it runs here with that memory full of a sentinel (an entry left unwritten would show)."""
    import numpy as np

    from relaygr_engine import behaviors

    class Sentinel:  # numpy, except that empty arrays come filled with a value no key holds
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(shape, dtype=float):
            return np.full(shape, -12345, dtype=dtype)

    monkeypatch.setattr(behaviors, "np", Sentinel())
    items, acts, times, ctx = torch.tensor([5, 6, 7]), torch.tensor([1, 0, 3]), torch.tensor([60, 70, 90]), \
        torch.tensor([40, 41])
    for a, t, c in [(a, t, c) for a in (None, acts) for t in (None, times) for c in (None, ctx)]:
        keys = rg.Behaviors(items, a, t, c).token_keys()
        want = [[0, int(x), -1, 0 if t is None else 60] for x in ([] if c is None else c)]
        want += [[1, int(items[i]), -1 if a is None else int(a[i]), 0 if t is None else int(t[i])] for i in range(3)]
        assert keys.dtype == np.int64 and keys.tolist() == want, (a, t, c)


def test_stale_prefix_recomputes():
    model = make_model()
    engine = make_engine(model, extend_on_rank=False)
    h = history(40, seed=12)
    engine.prefill_prefix(7, h.prefix(32))
    cands = candidates(6)
    changed_item = rg.Behaviors(torch.cat([h.item_ids[:1] + 1, h.item_ids[1:]]), h.action_ids, h.timestamps)
    changed_action = rg.Behaviors(h.item_ids, torch.cat([(h.action_ids[:1] + 1) % 4, h.action_ids[1:]]),
                                  h.timestamps)
    changed_time = rg.Behaviors(h.item_ids, h.action_ids, torch.cat([h.timestamps[:1] - 1, h.timestamps[1:]]))
    no_time = rg.Behaviors(h.item_ids, h.action_ids)
    for hist in (changed_item, changed_action, changed_time, no_time):
        res = engine.rank_with_prefix(7, hist, cands)
        assert res.source == "recompute"
        assert_exact(res, model, hist, cands)
    assert engine.rank_with_prefix(7, h, cands).source == "hbm"
    model.load_state_dict(make_model(seed=5).state_dict())  # new weights: the cached KV is stale
    res = engine.rank_with_prefix(7, h, cands)
    assert res.source == "recompute"
    assert_exact(res, model, h, cands)


def test_ticket_ends_the_lease_and_expired_leases_are_counted():
    model = make_model()
    engine = make_engine(model, cache=dict(lease_ttl_s=5.0))
    h = history(30, seed=13)
    t1 = engine.prefill_prefix(1, h.prefix(24), now=100.0)
    assert t1.expires_at == 105.0 and engine.pool.has_lease(1, t1.fingerprint, now=100.0)
    res = engine.rank_with_prefix(1, h.prefix(24), candidates(4), ticket=t1, now=101.0)
    assert res.source == "hbm"
    assert not engine.pool.has_lease(1, t1.fingerprint, now=101.0)
    assert engine.pool.lookup(1, t1.fingerprint) == 24  # still cached, now evictable
    t2 = engine.prefill_prefix(2, h.prefix(16), now=100.0)
    res = engine.rank_with_prefix(2, h.prefix(16), candidates(4), ticket=t2, now=200.0)  # lease ran out
    assert res.source == "hbm"
    assert_exact(res, model, h.prefix(16), candidates(4))
    engine.rank_with_prefix(2, h.prefix(16), candidates(4), ticket=t2, now=201.0)  # presented twice
    s = engine.stats()
    assert s["expired_leases"] == 1 and s["late_tickets"] == 1 and s["stale_tickets"] == 1 and s["hbm_hits"] == 3


class Decline:
    def __init__(self, reason):
        self.reason, self.calls = reason, []

    def decide(self, **kw):
        self.calls.append(kw)
        return type("Decision", (), dict(admit=False, reason=self.reason))()

    def on_prefill_done(self, tokens, now=None):
        raise AssertionError("a declined prefill never reports done")


def test_trigger_decline_and_pool_refusals_fall_back_exactly():
    model = make_model()
    h, cands = history(50, seed=14), candidates(7)
    trigger = Decline("busy")
    engine = make_engine(model, trigger=trigger)
    t = engine.prefill_prefix(1, h.prefix(40))
    assert not t.admitted and t.reason == "trigger:busy" and t.expires_at is None
    call = trigger.calls[0]
    assert call["history_len"] == 40 and call["prefix_pages"] == 5 and call["num_candidates"] is None
    assert call["pinned_pages"] == 0 and call["num_pages"] == engine.pool.num_pages and call["reserve"]
    assert engine.pool.entries_of(1) == []
    res = engine.rank_with_prefix(1, h, cands, ticket=t)
    assert res.source == "recompute"
    assert_exact(res, model, h, cands)
    # 40 tokens need 5 pages of 8: more than the 4 pages that may ever be pinned
    budget = make_engine(model, cache=dict(num_pages=8, max_pinned_fraction=0.5))
    t = budget.prefill_prefix(1, h.prefix(40))
    assert not t.admitted and t.reason == "budget"
    assert_exact(budget.rank_with_prefix(1, h, cands, ticket=t), model, h, cands)
    # two leased 5-page prefixes do not fit in 8 pinnable pages at once; after the first ranking they do
    full = make_engine(model, cache=dict(num_pages=8, max_pinned_fraction=1.0))
    first = full.prefill_prefix(1, h.prefix(40))
    t = full.prefill_prefix(2, h.prefix(40))
    assert first.admitted and not t.admitted and t.reason == "pool_full"
    assert_exact(full.rank_with_prefix(2, h, cands, ticket=t), model, h, cands)
    assert full.rank_with_prefix(1, h.prefix(40), cands, ticket=first).source == "hbm"
    assert full.prefill_prefix(2, h.prefix(40)).admitted  # evicts user 1's unpinned entry
    s = full.stats()
    assert s["prefill_declines"] == 1 and s["prefill_declines_pool_full"] == 1 and s["prefills"] == 2
    assert s["evictions"] == 1


def test_evicted_prefix_recomputes_exactly():
    model = make_model()
    engine = make_engine(model, cache=dict(num_pages=12, max_pinned_fraction=1.0, lease_ttl_s=1.0))
    hists = {u: history(40, seed=u) for u in range(1, 5)}
    for u, h in hists.items():  # 5 pages each: the third and fourth users evict the first and second
        assert engine.prefill_prefix(u, h, now=10.0 * u).admitted
    s = engine.stats()
    assert s["evictions"] == 2 and s["pool_evictions"] == 2
    for u, h in hists.items():
        res = engine.rank_with_prefix(u, h, candidates(3), now=100.0)
        assert res.source == ("recompute" if u <= 2 else "hbm")
        assert_exact(res, model, h, candidates(3))
    expected = {"hbm_hits", "dram_hits", "recomputes", "evictions", "expired_leases", "prefills",
                "prefill_declines", "pool_entries", "pool_free_pages"}
    assert expected <= set(engine.stats())
    assert engine.stats()["dram_hits"] == 0


def test_store_misses_keeps_a_recomputed_history_for_the_next_request():
    model = make_model()
    h = history(50, seed=41)
    plain = make_engine(model)
    assert plain.rank_with_prefix(6, h.prefix(30), candidates(4)).source == "recompute"
    assert plain.pool.entries_of(6) == [] and plain.stats()["stored_on_rank"] == 0
    engine = make_engine(model, store_misses=True)
    first = engine.rank_with_prefix_batch([rg.RankRequest(6, h.prefix(24), candidates(4)),
                                           rg.RankRequest(6, h.prefix(30), candidates(4))])
    assert [r.source for r in first] == ["recompute", "recompute"]
    assert engine.pool.entries_of(6) == [(engine.pool.entries_of(6)[0][0], 30)]  # the longest history, once
    res = engine.rank_with_prefix(6, h, candidates(5))
    assert res.source == "hbm" and res.cached_tokens == 30
    assert_exact(res, model, h, candidates(5))
    assert engine.stats()["stored_on_rank"] == 1


def test_extension_keeps_following_the_history():
    model = make_model()
    engine = make_engine(model)
    h = history(90, seed=21)
    ticket = engine.prefill_prefix(4, h.prefix(10))
    for L in (13, 13, 29, 64, 90):
        res = engine.rank_with_prefix(4, h.prefix(L), candidates(5, seed=L), ticket=ticket)
        ticket = None
        assert res.source == "hbm"
        assert_exact(res, model, h.prefix(L), candidates(5, seed=L))
        assert engine.match_length(4, h.prefix(L)) == L
    assert engine.stats()["extensions"] == 4
    assert len(engine.pool.entries_of(4)) == 1
    # an entry leased for a ticket not yet presented is left as it is (the ticket can still end its lease)
    other = engine.prefill_prefix(5, h.prefix(10))
    assert engine.rank_with_prefix(5, h.prefix(20), candidates(2)).cached_tokens == 10
    assert engine.match_length(5, h.prefix(20)) == 10
    engine.rank_with_prefix(5, h.prefix(20), candidates(2), ticket=other)
    assert engine.match_length(5, h.prefix(20)) == 20


def test_engine_constructor_checks():
    model = make_model()
    with pytest.raises(ValueError, match="model must be a torch.nn.Module, got object"):
        rg.RelayEngine(object(), rg.CacheConfig())
    with pytest.raises(ValueError, match="at least one relaygr_engine.PrefixAttention layer.*TransformerEncoder"):
        layer = torch.nn.TransformerEncoderLayer(16, 2, batch_first=True)
        rg.RelayEngine(torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), rg.CacheConfig())
    with pytest.raises(ValueError, match="trigger must be None or have decide"):
        rg.RelayEngine(model, rg.CacheConfig(num_pages=8), trigger=object())
    engine = rg.RelayEngine(model, rg.CacheConfig(num_pages=8))
    assert engine.cache.kv[0].shape == (8, 2, 16, 2, 16) and "RelayEngine" in repr(engine)


# ----------------------------------------------------------------------------------------------- bad input
def _bad_requests(h, cands, ticket):
    other = rg.PrefixTicket(True, "admitted", 99, ticket.fingerprint, 10, 1.0)
    return [
        (dict(history=rg.Behaviors(h.item_ids + 1000, h.action_ids, h.timestamps)), "history.item_ids"),
        (dict(history=rg.Behaviors(h.item_ids, h.action_ids - 1, h.timestamps)), "history.action_ids"),
        (dict(history=rg.Behaviors(torch.zeros(129, dtype=torch.long))), "max_seq_len=128"),
        (dict(candidates=cands[:0]), "at least one item id"),
        (dict(candidates=cands.view(2, -1)), "candidates must be a 1-D int64"),
        (dict(candidates=cands.float()), "candidates must be a 1-D int64"),
        (dict(candidates=cands + 1000), "candidates must be in"),
        (dict(candidates=None), "candidates must be a 1-D int64"),
        (dict(request_time=float("nan")), "request_time must be an integer"),
        (dict(request_time=-1), r"request_time must be an integer time in seconds in \[0, 2\*\*63\)"),
        (dict(history=rg.Behaviors(h.item_ids, h.action_ids, h.timestamps - h.timestamps[-1] - 1)),
         "history.timestamps must be times in seconds >= 0"),
        (dict(ticket=other), "ticket is for user_id=99"),
        (dict(ticket="t"), "ticket must be a PrefixTicket"),
        (dict(user_id=-1), "user_id must be an integer in"),
        (dict(user_id=1 << 64), "user_id must be an integer in"),
        (dict(user_id=True), "user_id must be an integer in"),
        (dict(now=float("inf")), "now must be a finite number"),
        (dict(now=10 ** 400), "now must be a number"),
    ]


def test_bad_input_raises_before_any_state_change():
    model = make_model()
    engine = make_engine(model)
    h = history(30, seed=3)
    ticket = engine.prefill_prefix(7, h.prefix(20))
    cands = candidates(8)
    before = snapshot(engine)
    for change, match in _bad_requests(h, cands, ticket):
        kw = dict(user_id=7, history=h, candidates=cands, ticket=ticket)
        kw.update(change)
        with pytest.raises(ValueError, match=match):
            engine.rank_with_prefix(**kw)
        assert snapshot(engine) == before, change
        if "now" in change:
            continue
        good = rg.RankRequest(7, h, cands, ticket)  # a bad request anywhere in a batch rejects all of it
        with pytest.raises(ValueError, match=match):
            engine.rank_with_prefix_batch([good, rg.RankRequest(**{k: v for k, v in kw.items()})])
        assert snapshot(engine) == before, change
    with pytest.raises(ValueError, match="requests\\[0\\] must be a RankRequest"):
        engine.rank_with_prefix_batch([(7, h, cands)])
    for hist, match in [(rg.Behaviors(h.item_ids[:0]), "at least one behavior"),
                        (rg.Behaviors(h.item_ids + 5000), "history.item_ids"), ("x", "must be a Behaviors")]:
        with pytest.raises(ValueError, match=match):
            engine.prefill_prefix(7, hist)
        with pytest.raises(ValueError, match=match):
            engine.prefill_prefix_batch([(8, h), (7, hist)])
        assert snapshot(engine) == before
    with pytest.raises(ValueError, match="items\\[0\\] must be a \\(user_id, history\\) pair"):
        engine.prefill_prefix_batch([h])
    with pytest.raises(ValueError, match="now must be a finite number"):
        engine.prefill_prefix(7, h, now=float("nan"))
    assert snapshot(engine) == before
    # the request that was refused works unchanged afterwards
    assert_exact(engine.rank_with_prefix(7, h, cands, ticket=ticket), model, h, cands)
