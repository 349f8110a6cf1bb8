"""RelayEngine: cached ranking equals full inference whatever the cache state; leases, fallbacks, bad input."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when it first decorates kernels (see test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import relaygr_engine as rg  # noqa: E402

PAGE = 8
ATOL = 1e-4
KINDS = ("hstu", "softmax")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(attention="hstu", context=0, seed=0):
    cfg = rg.GRModelConfig(attention=attention, num_layers=2, hidden_dim=32, num_heads=2, head_dim=16,
                           num_items=1000, num_actions=4, max_seq_len=128, num_tasks=2, num_time_buckets=16,
                           num_context_tokens=context, context_vocab_size=9 if context else 0)
    return rg.build_ranker(cfg, seed=seed)


def make_engine(model, **kw):
    cfg = dict(page_size=PAGE, num_pages=256, lease_ttl_s=10.0, attention_backend="torch")
    cfg.update(kw.pop("cache", {}))
    return rg.RelayEngine(model, rg.CacheConfig(**cfg), **kw)


def history(L, seed=0, timestamps=True, context=0):
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(
        item_ids=torch.randint(0, 1000, (L,), generator=g),
        action_ids=torch.randint(0, 4, (L,), generator=g),
        timestamps=torch.cumsum(torch.randint(0, 3000, (L,), generator=g), 0) + 1_700_000_000 if timestamps else None,
        context_ids=torch.randint(0, 9, (context,), generator=g) if context else None)


def candidates(C, seed=1):
    return torch.randint(0, 1000, (C,), generator=torch.Generator().manual_seed(seed))


def snapshot(engine, users=(1, 2, 3, 7)):
    return engine.stats(), {u: sorted(engine.pool.entries_of(u)) for u in users}


def assert_exact(res, model, hist, cands, request_time=None):
    want = model.rank_full(hist, cands, request_time=request_time)
    assert res.scores.shape == want.shape
    assert float((res.scores - want).abs().max()) <= ATOL


# ----------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("timestamps", [True, False], ids=["ts", "no_ts"])
@pytest.mark.parametrize("prefix", [1, PAGE - 1, PAGE, PAGE + 1, 4 * PAGE + 3])
def test_cached_ranking_equals_full_inference(attention, timestamps, prefix):
    model = make_model(attention)
    for new in (0, 17):
        for C in (1, 300):
            engine = make_engine(model)
            hist = history(prefix + new, seed=prefix + new, timestamps=timestamps)
            cands = candidates(C)
            ticket = engine.prefill_prefix(7, hist.prefix(prefix), now=0.0)
            assert ticket.admitted and ticket.reason == "admitted" and ticket.num_tokens == prefix
            res = engine.rank_with_prefix(7, hist, cands, ticket=ticket, now=1.0)
            assert res.source == "hbm" and res.cached_tokens == prefix and res.computed_tokens == new + C
            assert_exact(res, model, hist, cands)
            # the new tokens' KV was appended while ranking: the next request reads all of them
            again = engine.rank_with_prefix(7, hist, cands, now=2.0)
            assert again.source == "hbm" and again.cached_tokens == prefix + new
            assert_exact(again, model, hist, cands)


@pytest.mark.parametrize("attention", KINDS)
def test_contextual_tokens_and_request_time(attention):
    model = make_model(attention, context=3)
    engine = make_engine(model)
    hist, cands = history(30, seed=3, context=3), candidates(20)
    ticket = engine.prefill_prefix(1, hist.prefix(12), now=0.0)
    assert ticket.num_tokens == 15
    t_req = int(hist.timestamps[-1]) + 4000
    res = engine.rank_with_prefix(1, hist, cands, ticket=ticket, request_time=t_req, now=1.0)
    assert res.source == "hbm" and res.cached_tokens == 15
    assert_exact(res, model, hist, cands, request_time=t_req)


@pytest.mark.parametrize("attention", KINDS)
def test_miss_recomputes_exactly(attention):
    model = make_model(attention)
    engine = make_engine(model)
    hist, cands = history(40, seed=5), candidates(9)
    res = engine.rank_with_prefix(3, hist, cands)
    assert res.source == "recompute" and res.cached_tokens == 0 and res.computed_tokens == 49
    assert_exact(res, model, hist, cands)
    assert engine.stats()["recomputes"] == 1 and engine.stats()["hbm_hits"] == 0


def test_candidate_independence_through_the_cache():
    model = make_model()
    engine = make_engine(model)
    hist = history(37, seed=9)
    engine.prefill_prefix(2, hist.prefix(30))
    both = candidates(50, seed=4)
    all_scores = engine.rank_with_prefix(2, hist, both).scores
    some = engine.rank_with_prefix(2, hist, both[10:13]).scores
    torch.testing.assert_close(some, all_scores[10:13], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------- batches
@pytest.mark.parametrize("attention", KINDS)
def test_batch_equals_single(attention):
    model = make_model(attention)
    hists = {1: history(45, seed=1), 2: history(20, seed=2, timestamps=False), 3: history(33, seed=3),
             4: history(9, seed=4)}
    prefixes = [(1, 30), (2, PAGE), (3, 33)]  # user 4 is a miss
    requests = [rg.RankRequest(u, h, candidates(5 + u, seed=u)) for u, h in hists.items()]
    requests.append(rg.RankRequest(1, hists[1].prefix(40), candidates(3, seed=9)))  # same entry, shorter history
    single, batch = make_engine(model), make_engine(model)
    t_single = [single.prefill_prefix(u, hists[u].prefix(n)) for u, n in prefixes]
    t_batch = batch.prefill_prefix_batch([(u, hists[u].prefix(n)) for u, n in prefixes])
    assert [(t.admitted, t.reason, t.fingerprint, t.num_tokens) for t in t_single] == \
           [(t.admitted, t.reason, t.fingerprint, t.num_tokens) for t in t_batch]
    want = [single.rank_with_prefix(r.user_id, r.history, r.candidates) for r in requests[:4]]
    got = batch.rank_with_prefix_batch(requests[:4])
    for w, g, r in zip(want, got, requests):
        assert (w.source, w.cached_tokens, w.computed_tokens) == (g.source, g.cached_tokens, g.computed_tokens)
        torch.testing.assert_close(g.scores, w.scores, atol=1e-5, rtol=0)
        assert_exact(g, model, r.history, r.candidates)
    assert [w.source for w in want] == ["hbm", "hbm", "hbm", "recompute"]
    # a fresh batch where two requests read the same entry
    fresh = make_engine(model)
    ticket = fresh.prefill_prefix(1, hists[1].prefix(30))
    first = rg.RankRequest(1, hists[1], requests[0].candidates, ticket)  # ends the lease: the entry may grow
    out = fresh.rank_with_prefix_batch([first, requests[4]])
    for res, r in zip(out, [requests[0], requests[4]]):
        assert res.source == "hbm" and res.cached_tokens == 30
        assert_exact(res, model, r.history, r.candidates)
    assert fresh.match_length(1, hists[1]) == 45  # extended once, with the longest history
    assert fresh.rank_with_prefix_batch([]) == []


def test_prefill_batch_with_duplicates_and_extension():
    model = make_model()
    engine = make_engine(model)
    h = history(60, seed=11)
    tickets = engine.prefill_prefix_batch([(5, h.prefix(20)), (5, h.prefix(20)), (6, h.prefix(7))])
    assert [t.reason for t in tickets] == ["admitted", "already_cached", "admitted"]
    assert tickets[0].fingerprint == tickets[1].fingerprint
    again = engine.prefill_prefix(5, h.prefix(20))
    assert again.admitted and again.reason == "already_cached" and again.computed_tokens == 0
    longer = engine.prefill_prefix(5, h.prefix(50))  # grows the cached 20-token entry: computes 30 tokens
    assert longer.admitted and longer.cached_tokens == 20 and longer.computed_tokens == 30
    assert [n for _, n in engine.pool.entries_of(5)] == [50]
    res = engine.rank_with_prefix(5, h, candidates(11), ticket=longer)
    assert res.cached_tokens == 50
    assert_exact(res, model, h, candidates(11))
    s = engine.stats()
    assert s["prefills"] == 3 and s["prefill_reused_tokens"] == 20 and s["prefill_already_cached"] == 1


@pytest.mark.parametrize("attention", KINDS)
def test_pending_ticket_keeps_its_prefix_when_a_longer_prefill_comes(attention):
    """A user's second pre-infer grows the leased shorter entry; the earlier ranking reads its leading part."""
    model = make_model(attention)
    engine = make_engine(model)
    h = history(70, seed=31)
    first = engine.prefill_prefix(3, h.prefix(20))  # its ranking (20 cached + 16 new tokens) is still to come
    second = engine.prefill_prefix(3, h.prefix(52))  # the user's next request, pre-inferred before that ranking
    assert second.admitted and second.cached_tokens == 20 and second.computed_tokens == 32
    assert [n for _, n in engine.pool.entries_of(3)] == [52]
    early, late = (h.prefix(36), candidates(5)), (h.prefix(68), candidates(6, seed=2))
    r1 = engine.rank_with_prefix(3, *early, ticket=first)
    assert r1.source == "hbm" and r1.cached_tokens == 36 and r1.computed_tokens == 5  # all 36 from the longer entry
    assert_exact(r1, model, *early)
    assert engine.pool.has_lease(3, second.fingerprint)  # the later ticket still holds the grown entry
    r2 = engine.rank_with_prefix(3, *late, ticket=second)
    assert r2.source == "hbm" and r2.cached_tokens == 52
    assert_exact(r2, model, *late)
    s = engine.stats()
    assert s["prefill_computed_tokens"] == 20 + 32 and s["stale_tickets"] == 1 and s["recomputes"] == 0


@pytest.mark.parametrize("attention", KINDS)
def test_leading_part_of_a_longer_entry_is_reused_and_copied(attention):
    """A prefix inside a longer entry is already cached; a history sharing only its front copies that part."""
    model = make_model(attention)
    engine = make_engine(model, extend_on_rank=False)
    h = history(60, seed=33)
    assert engine.prefill_prefix(4, h.prefix(44)).admitted
    inside = engine.prefill_prefix(4, h.prefix(30))
    assert inside.reason == "already_cached" and inside.cached_tokens == 30 and inside.num_tokens == 30
    r = engine.rank_with_prefix(4, h.prefix(30), candidates(3), ticket=inside)
    assert r.source == "hbm" and r.cached_tokens == 30 and r.computed_tokens == 3
    assert_exact(r, model, h.prefix(30), candidates(3))
    # the same first 27 behaviors, then different ones: 27 tokens are copied, the rest computed
    other = rg.Behaviors(torch.cat([h.item_ids[:27], (h.item_ids[27:50] + 1) % 1000]), h.action_ids[:50],
                         h.timestamps[:50])
    t = engine.prefill_prefix(4, other)
    assert t.admitted and t.cached_tokens == 27 and t.computed_tokens == 23
    assert sorted(n for _, n in engine.pool.entries_of(4)) == [44, 50]
    for hist in (other, h.prefix(44)):
        res = engine.rank_with_prefix(4, hist, candidates(7))
        assert res.source == "hbm" and res.computed_tokens == 7
        assert_exact(res, model, hist, candidates(7))
    s = engine.stats()
    assert s["prefill_copies"] == 1 and s["prefill_copied_tokens"] == 27
    assert engine.match_length(4, h) == 44 and engine.match_length(4, h.prefix(10)) == 10


# ----------------------------------------------------------------------------------------------- cache state
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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("attention", KINDS)
def test_triton_backend_through_the_engine(attention):
    """The engine's forward runs unchanged on the Triton kernel (CPU: Triton's interpreter)."""
    from relaygr_engine.kernels import _common
    if not _common.interpreter_active():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import)")
    model = make_model(attention)
    engine = make_engine(model, cache=dict(attention_backend="triton"))
    for ts in (True, False):
        h, cands = history(27, seed=3, timestamps=ts), candidates(5)
        ticket = engine.prefill_prefix(1, h.prefix(12))
        hit = engine.rank_with_prefix(1, h, cands, ticket=ticket)
        miss = engine.rank_with_prefix(2, h, cands)
        assert (hit.source, miss.source) == ("hbm", "recompute")
        assert_exact(hit, model, h, cands)
        assert_exact(miss, model, h, cands)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_forward_plans_once_for_all_layers(monkeypatch):
    """A Triton forward reads its page table back from the device once (one plan), not once per layer, and the op's
    validation does not read it again (the plan's check_page_table call is the only one with read=True)."""
    from relaygr_engine.kernels import _common
    from relaygr_engine.kernels import prefix_attention as pa
    if not _common.interpreter_active():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import)")
    calls, table_reads = [], []
    real, real_check = pa._plan, _common.check_page_table
    monkeypatch.setattr(pa, "_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(_common, "check_page_table",
                        lambda *a, **k: table_reads.append(k.get("read", True)) or real_check(*a, **k))
    model = make_model("hstu")
    assert len(model.layers) == 2
    engine = make_engine(model, cache=dict(attention_backend="triton"))
    h, cands = history(30, seed=4), candidates(6)
    ticket = engine.prefill_prefix(1, h.prefix(20))
    calls.clear()
    table_reads.clear()
    res = engine.rank_with_prefix(1, h, cands, ticket=ticket)
    assert res.source == "hbm" and len(calls) == 1 and table_reads.count(True) == 1
    assert_exact(res, model, h, cands)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_cuda_engine_equals_full_inference(attention, backend):
    """On CUDA in fp32 (the kernel's dots in IEEE fp32, torch's without TF32) a hit, a miss and a batch equal
    ``rank_full`` on the same device; "auto" runs the Triton kernel there."""
    if backend != "torch" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    cfg = make_model(attention).config
    model = rg.build_ranker(cfg, seed=0, device="cuda")
    engine = make_engine(model, cache=dict(device="cuda", attention_backend=backend))
    h, cands = history(100, seed=5), candidates(37).cuda()
    ticket = engine.prefill_prefix(1, h.prefix(61))
    hit = engine.rank_with_prefix(1, h, cands, ticket=ticket)
    miss = engine.rank_with_prefix(2, h, cands)
    assert (hit.source, miss.source) == ("hbm", "recompute") and hit.scores.device.type == "cuda"
    assert_exact(hit, model, h, cands)
    assert_exact(miss, model, h, cands)
    h2 = history(90, seed=6)
    engine.prefill_prefix(3, h2.prefix(40))
    batch = engine.rank_with_prefix_batch([rg.RankRequest(1, h, cands), rg.RankRequest(3, h2, cands[:5])])
    assert_exact(batch[0], model, h, cands)
    assert_exact(batch[1], model, h2, cands[:5])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_hit_path_never_waits_for_the_device(attention, backend):
    """Host histories and candidates, a warmed-up engine: a hit and a batch of hits queue their work with no
    device-to-host synchronisation (``forbid_device_sync``), and their scores are exact."""
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from relaygr_engine.testing import forbid_device_sync

    model = rg.build_ranker(make_model(attention).config, seed=0, device="cuda")
    engine = make_engine(model, cache=dict(device="cuda", attention_backend=backend))
    h, h2, cands = history(100, seed=5), history(90, seed=6), candidates(37)
    t1, t2 = engine.prefill_prefix(1, h.prefix(61)), engine.prefill_prefix(2, h2.prefix(40))
    reqs = [rg.RankRequest(1, h, cands, t1), rg.RankRequest(2, h2, cands[:5], t2)]
    for _ in range(2):  # first calls compile, autotune and fill the allocators
        engine.rank_with_prefix(1, h, cands, ticket=t1)
        engine.rank_with_prefix_batch(reqs)
    torch.cuda.synchronize()
    with forbid_device_sync():
        hit = engine.rank_with_prefix(1, h, cands, ticket=t1)
        batch = engine.rank_with_prefix_batch(reqs)
    assert hit.source == "hbm" and [r.source for r in batch] == ["hbm", "hbm"]
    assert_exact(hit, model, h, cands)
    assert_exact(batch[1], model, h2, cands[:5])
    with pytest.raises(RuntimeError, match="inside forbid_device_sync"):  # the guard itself bites
        with forbid_device_sync():
            torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="synchroniz"):  # implicit waits too (torch's sync debug mode)
        with forbid_device_sync():
            torch.ones(1, device="cuda").item()


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
