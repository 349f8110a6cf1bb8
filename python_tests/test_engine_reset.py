"""``RelayEngine.reset``: afterwards the engine serves as a freshly built one does (the SLO benchmark reuses one
engine per worker across its runs), and nothing of the earlier calls is left: no entry in either tier, no lease, no
prefix record, no learned cost, every counter at zero, the page memory zeroed; what is paid once stays."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import candidates, history, make_engine, make_model

from relaygr_engine.tiers import ReloadCostModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_OPTIONS = dict(cache=dict(num_pages=40, dram_bytes=1 << 20), store_misses=True)


def _scenario(engine):
    """Pre-infers, rankings with and without their tickets, extensions, stored misses, evictions, leases ending
    unused, spills and DRAM reloads on a small pool and an explicit clock: what each call reported, and the stats."""
    longs = {u: history(120, seed=u) for u in (1, 2, 3, 4)}
    out, t = [], 0.0
    for i, (u, L) in enumerate([(1, 40), (2, 48), (3, 56), (1, 64), (4, 72), (2, 80), (3, 88), (1, 96), (4, 104),
                                (2, 112), (5, 24), (3, 96)]):
        h = longs.get(u, longs[1]).prefix(L)
        ticket = engine.prefill_prefix(u, h.prefix(L - 8), now=t)
        res = engine.rank_with_prefix(u, h, candidates(5, seed=i), ticket=ticket if i % 3 else None, now=t + 1.0)
        out.append(((ticket.reason, ticket.cached_tokens, res.source, res.cached_tokens), res.scores))
        t += 7.0  # a 10 s lease whose ranking came without its ticket ends unused
    for i, u in enumerate((9, 8, 1, 2, 3, 4)):  # rankings alone: misses stored, prefixes evicted to DRAM reloaded
        res = engine.rank_with_prefix(u, longs.get(u, history(100, seed=u)), candidates(5, seed=20 + i), now=t)
        out.append(((res.source, res.cached_tokens), res.scores))
        t += 1.0
    return out, engine.stats()


def test_a_reset_engine_keeps_nothing_and_serves_as_a_fresh_one(monkeypatch):
    # the expander's reload-or-recompute choice reads measured times: fixed here so both engines decide alike
    monkeypatch.setattr(ReloadCostModel, "prefers_reload", lambda self, tokens, nbytes: True)
    model = make_model()
    want, want_stats = _scenario(make_engine(model, **_OPTIONS))
    for key in ("evictions", "spills", "dram_hits", "extensions", "stored_on_rank", "expired_leases", "hbm_hits"):
        assert want_stats[key] > 0, key  # the scenario leaves every kind of state behind

    engine = make_engine(model, **_OPTIONS)
    counters, runner = engine.state.counters, engine.runner
    _scenario(engine)
    assert engine.expander.recompute_s_per_token is not None and len(engine.dram) > 0
    engine.reset()
    fresh = make_engine(model, **_OPTIONS)
    assert engine.stats() == fresh.stats() and engine.pool.stats() == fresh.pool.stats()
    assert engine.pool.num_free_pages == engine.pool.num_pages and len(engine.pool) == 0
    assert len(engine.dram) == 0 and engine.dram.stats() == fresh.dram.stats()
    assert engine.index._records == {} and len(engine.state.leased) == 0
    assert engine.index.pool is engine.pool and engine.index.dram is engine.dram
    assert engine.state.pool is engine.pool and engine.state.dram is engine.dram
    assert engine.expander.reload_bytes_per_s is None and engine.expander.recompute_s_per_token is None
    assert all(not t.any() for t in engine.cache.kv) and not engine.cache.timestamps.any()
    assert engine.state.counters is counters and engine.runner is runner  # held by graphs and the compiled model

    got, got_stats = _scenario(engine)
    assert got_stats == want_stats
    for (g, g_scores), (w, w_scores) in zip(got, want):
        assert g == w and torch.equal(g_scores, w_scores)
