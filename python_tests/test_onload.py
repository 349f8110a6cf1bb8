"""Layer-wise DRAM onload (:mod:`relaygr_engine.onload`): a ranking's DRAM hit copied back layer by layer, each
layer's attention waiting for its own pages. On the CPU the stand-in makes each layer's copy when its layer asks,
so these tests check the order of copies and waits and that every path stays exact; on a GPU the side stream and
its events (eagerly and in CUDA graphs)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.onload import LayerOnload

from test_expander import CANDS, assert_exact, engine_for, history, model, relay  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _longer(h, n=3):
    return rg.Behaviors(item_ids=torch.cat([h.item_ids, torch.arange(n) + 3]),
                        action_ids=torch.cat([h.action_ids, torch.arange(n) % 4]),
                        timestamps=torch.cat([h.timestamps, h.timestamps[-1:] + 10 + torch.arange(n)]))


def _evict_to_dram(engine, model, users=(1, 2, 3), L=40):
    """Three users' 40-token prefixes through a 12-page pool: user 1's only copy ends in DRAM."""
    hists = {u: history(L, seed=u) for u in users}
    for i, (u, h) in enumerate(hists.items()):
        assert relay(engine, u, h, now=float(i)).source == "hbm"
    assert engine.pool.entries_of(1) == [] and engine.dram.entries_of(1)
    return hists


def test_onload_mode_is_checked_and_resolved_per_device():
    with pytest.raises(ValueError, match="onload must be one of 'auto', 'serial', 'layer', got 'lazy'"):
        rg.CacheConfig(onload="lazy")
    assert not rg.CacheConfig().layered_onload and rg.CacheConfig(onload="layer").layered_onload
    assert rg.CacheConfig(device="cuda", onload="auto").layered_onload
    assert not rg.CacheConfig(device="cuda", onload="serial").layered_onload


def test_the_stand_in_copies_each_layer_when_its_layer_waits(model):
    engine = engine_for(model, onload="serial")
    cache = engine.cache
    src = [torch.randn_like(kv) for kv in cache.kv]
    pages = np.array([3, 5, 7])
    for kv, s in zip(cache.kv, src):
        kv[pages] = s[pages]
    packed = cache.pack(pages)
    ts = torch.arange(3 * PAGE_TOKENS) + 1_700_000_000
    for kv in cache.kv:
        kv.zero_()
    onload = LayerOnload(cache)
    with pytest.raises(ValueError, match=r"buffer must be torch.float32 of shape \[2, 2, 16, 2, 16\]"):
        onload.copy(packed, pages[:2], ts[:16])
    assert onload.pending == 0 and not cache.timestamps.any()            # nothing copied
    onload.copy(packed, pages, ts)
    assert onload.pending == 2 and not any(kv.any() for kv in cache.kv)   # K/V: not yet
    assert torch.equal(cache.gather_timestamps(pages, 3 * PAGE_TOKENS), ts)  # timestamps: at once
    onload.wait(0)
    assert torch.equal(cache.kv[0][pages], src[0][pages]) and not cache.kv[1].any() and onload.pending == 1
    onload.join()
    assert torch.equal(cache.kv[1][pages], src[1][pages]) and onload.pending == 0


PAGE_TOKENS = 8  # test_expander's page size


def test_a_dram_hit_is_copied_layer_by_layer_during_the_forward_and_stays_exact(model, monkeypatch):
    """Layer l's pages are copied when layer l's attention starts (the later layers' copies still pending), and the
    ranking, its extension of the reloaded entry and the next HBM hit on it are exact; same scores as serial."""
    engine, serial = engine_for(model, onload="layer"), engine_for(model, onload="serial")
    hists = _evict_to_dram(engine, model)
    _evict_to_dram(serial, model)
    seen = []
    real = LayerOnload.wait
    monkeypatch.setattr(LayerOnload, "wait", lambda self, layer: (seen.append((layer, self.pending)),
                                                                  real(self, layer))[-1])
    longer = _longer(hists[1])
    res = engine.rank_with_prefix(1, longer, CANDS, now=10.0)
    assert res.source == "dram" and res.cached_tokens == 40
    assert seen == [(0, 2), (1, 1)]                         # one layer's copy before each layer, no more
    assert engine.state.onload.pending == 0
    assert_exact(res, model, longer)
    s = engine.stats()
    assert s["layered_reloads"] == 1 and s["reloads"] == 1 and s["dram_hits"] == 1
    ref = serial.rank_with_prefix(1, longer, CANDS, now=10.0)
    assert ref.source == "dram" and serial.stats()["layered_reloads"] == 0
    assert torch.equal(res.scores, ref.scores)
    again = engine.rank_with_prefix(1, longer, CANDS, now=11.0)
    assert again.source == "hbm"
    assert_exact(again, model, longer)


def test_two_dram_hits_in_one_batch_and_a_prefill_reload_stay_exact(model):
    engine = engine_for(model, onload="layer")
    hists = {u: history(40, seed=u) for u in (1, 2, 3, 4)}
    for i, (u, h) in enumerate(hists.items()):
        relay(engine, u, h, now=float(i))
    on_dram = [u for u in hists if not engine.pool.entries_of(u) and engine.dram.entries_of(u)]
    assert len(on_dram) >= 2
    u1, u2 = on_dram[:2]
    batch = engine.rank_with_prefix_batch([rg.RankRequest(u1, _longer(hists[u1]), CANDS),
                                           rg.RankRequest(u2, hists[u2], CANDS)], now=10.0)
    assert [r.source for r in batch] == ["dram", "dram"] and engine.stats()["layered_reloads"] == 2
    assert_exact(batch[0], model, _longer(hists[u1]))
    assert_exact(batch[1], model, hists[u2])
    for key in [(u, fp) for u in (u1, u2) for fp, _ in engine.pool.entries_of(u)]:
        engine.pool.free(*key)
    t = engine.prefill_prefix(u2, _longer(hists[u2], 9), now=12.0)  # a pre-infer's reload: whole, before its forward
    assert t.admitted and t.cached_tokens == 40 and engine.stats()["layered_reloads"] == 2
    res = engine.rank_with_prefix(u2, _longer(hists[u2], 9), CANDS, ticket=t, now=12.1)
    assert res.source == "hbm"
    assert_exact(res, model, _longer(hists[u2], 9))


def test_a_failed_forward_leaves_no_copy_behind(model, monkeypatch):
    engine = engine_for(model, onload="layer")
    hists = _evict_to_dram(engine, model)

    def broken(jobs):
        raise RuntimeError("injected forward failure")

    monkeypatch.setattr(engine.runner, "run", broken)
    with pytest.raises(RuntimeError, match="injected"):
        engine.rank_with_prefix(1, hists[1], CANDS, now=10.0)
    assert engine.state.onload.pending == 0
    monkeypatch.undo()
    res = engine.rank_with_prefix(1, hists[1], CANDS, now=11.0)
    assert res.source in ("hbm", "dram")
    assert_exact(res, model, hists[1])


# ----------------------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_layerwise_onload_is_exact_eagerly_and_in_graphs(graphs):
    """fp32 on CUDA: DRAM hits copied on the side stream, waited per layer (as event-wait nodes in a captured
    graph), exact; a replay serving a later DRAM hit waits on that hit's copies."""
    cfg = rg.GRModelConfig(attention="hstu", num_layers=3, hidden_dim=32, num_heads=2, head_dim=16,
                           num_items=1000, num_actions=4, max_seq_len=256, num_tasks=2, num_time_buckets=16)
    m = rg.build_ranker(cfg, seed=0, device="cuda")
    engine = rg.RelayEngine(m, rg.CacheConfig(device="cuda", page_size=16, num_pages=12, max_pinned_fraction=1.0,
                                              lease_ttl_s=5.0, attention_backend="triton", dram_bytes=1 << 26),
                            extend_on_rank=False, cuda_graphs=graphs)
    assert engine.state.onload is not None and engine.state.onload.stream is not None
    cands = CANDS.cuda()
    hists = {u: history(60, seed=u).to("cuda") for u in range(1, 6)}      # 4 pages each; the pool holds 12
    for i, (u, h) in enumerate(hists.items()):
        t = engine.prefill_prefix(u, h, now=float(i))
        engine.rank_with_prefix(u, h, cands, ticket=t, now=float(i) + 0.05)
    hits = 0
    for i, u in enumerate((1, 2)):
        res = engine.rank_with_prefix(u, hists[u], cands, now=20.0 + i)
        hits += res.source == "dram"
        assert float((res.scores - m.rank_full(hists[u], cands)).abs().max()) <= 1e-4
    s = engine.stats()
    assert hits == 2 and s["layered_reloads"] == 2
    if graphs:
        assert s["graph_replays"] >= 1 and s["graph_failures"] == 0
