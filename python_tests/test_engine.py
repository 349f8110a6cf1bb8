"""RelayEngine: cached ranking equals full inference, single and batched, on every backend and device (the
cache's states and bad input: test_engine_state.py)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_helpers import KINDS, PAGE, assert_exact, candidates, history, make_engine, make_model

import relaygr_engine as rg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    from relaygr_engine.kernels import _common, _prefix_plan
    from relaygr_engine.kernels import prefix_attention as pa
    if not _common.interpreter_active():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import)")
    calls, table_reads = [], []
    real, real_check = _prefix_plan._plan, _common.check_page_table
    for module in (pa, _prefix_plan):  # a call planning for itself, and plan_prefix_attention
        monkeypatch.setattr(module, "_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
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
