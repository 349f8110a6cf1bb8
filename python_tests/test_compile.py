"""Whole compiled rankers: ``torch.compile(model, fullgraph=True, dynamic=True)`` of GRRanker and both example
rankers, served through every engine path, exact against the eager no-cache forward, with no graph break and a
bounded number of graphs over many lengths.

Compiling is slow on a CPU: one compiled model per kind (module scope), small shapes.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

import relaygr_engine as rg
from relaygr_engine.testing import check_relay_exact, no_cache_scores
from example_modules import load_example

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gr_history(n: int, seed: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(item_ids=torch.randint(0, 500, (n,), generator=g),
                        action_ids=torch.randint(0, 4, (n,), generator=g),
                        timestamps=1_700_000_000 + torch.cumsum(torch.randint(1, 5000, (n,), generator=g), 0))


def _kind(name: str):
    """``(eager model, history maker, number of items)`` of one kind of ranker."""
    torch.manual_seed(0)
    if name == "gr_hstu":
        cfg = rg.GRModelConfig(attention="hstu", num_layers=2, hidden_dim=32, num_heads=2, head_dim=16,
                               num_items=500, num_actions=4, max_seq_len=128, num_tasks=2, num_time_buckets=16)
        return rg.build_ranker(cfg, seed=0), _gr_history, 500
    if name == "hstu_example":
        m = load_example("hstu_ranker")
        return m.MyHSTURanker(layers=2).eval(), m.synthetic_history, 2000
    m = load_example("softmax_ranker")
    return m.MySoftmaxRanker().eval(), m.synthetic_history, 3000


@pytest.fixture(scope="module", params=["gr_hstu", "hstu_example", "softmax_example"])
def kind(request):
    model, history, items = _kind(request.param)
    torch._dynamo.reset()
    counters.clear()
    return request.param, model, torch.compile(model, fullgraph=True, dynamic=True), history, items


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def test_compiled_ranker_is_exact_on_every_engine_path_without_graph_breaks(kind):
    name, model, compiled, history, items = kind
    hists = [history(n, seed=i) for i, n in enumerate((11, 18, 25))]
    cands = [torch.randint(0, items, (c,), generator=torch.Generator().manual_seed(c)) for c in (4, 1, 6)]
    with torch.inference_mode():  # the dense forward compiled, against the eager one
        for h, c in zip(hists, cands):
            batch = rg.RelayBatch.full(h, c)
            assert (compiled(batch) - model(batch)).abs().max() <= 1e-4
    report = check_relay_exact(compiled, hists, cands)  # miss, hit, batch, extend, dram: vs the eager forward
    assert set(report) == {"miss", "hit", "batch", "extend", "dram"} and max(report.values()) <= 1e-4, report
    assert _breaks() == 0, dict(counters["graph_break"])
    assert _graphs() <= 8, _graphs()  # dense, prefill, ranking, batch, each with C = 1 specialised at most


def test_compiled_ranker_does_not_recompile_per_length(kind):
    name, model, compiled, history, items = kind
    engine = rg.RelayEngine(compiled, rg.CacheConfig(page_size=4, num_pages=512, attention_backend="torch"))
    c = torch.randint(0, items, (3,), generator=torch.Generator().manual_seed(1))
    for n in (9, 12, 14):  # warm: every kind of forward this test runs, compiled once
        engine.rank_with_prefix(n, history(n, seed=n), c, ticket=engine.prefill_prefix(n, history(n - 2, seed=n)))
        with torch.inference_mode():
            compiled(rg.RelayBatch.full(history(n, seed=n), c))
    before = _graphs()
    for n in range(15, 40, 2):  # 13 new history lengths: prefill, hit, dense
        h = history(n, seed=n)
        ticket = engine.prefill_prefix(n, rg.Behaviors(*(None if x is None else x[:n - 3] for x in
                                                        (h.item_ids, h.action_ids, h.timestamps))))
        res = engine.rank_with_prefix(n, h, c, ticket=ticket)
        assert res.source == "hbm"
        assert (res.scores - no_cache_scores(model, h, c)).abs().max() <= 1e-4
        with torch.inference_mode():
            assert (compiled(rg.RelayBatch.full(h, c)) - no_cache_scores(model, h, c)).abs().max() <= 1e-4
    assert _graphs() == before and _breaks() == 0
    assert engine.stats()["compile_failures"] == 0


def test_engine_compiles_a_model_and_falls_back_eagerly_once(caplog):
    class Breaks(torch.nn.Module):  # reads a host value in its forward: no full graph
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            if batch.item_ids.sum().item() < 0:
                return None
            return self.inner(batch)

    model, history, items = _kind("gr_hstu")
    engine = rg.RelayEngine(Breaks(model), rg.CacheConfig(page_size=4, num_pages=64, attention_backend="torch"),
                            compile_model=True)
    h, c = history(12, seed=3), torch.arange(3)
    with caplog.at_level(logging.WARNING, logger="relaygr_engine"):
        for _ in range(2):
            res = engine.rank_with_prefix(1, h, c)
            assert (res.scores - no_cache_scores(model, h, c)).abs().max() <= 1e-4
    s = engine.stats()
    assert s["compile_failures"] == 1 and s["compile_eager"] == 2
    assert sum("serving forwards eagerly" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="compile_model must be a bool"):
        rg.RelayEngine(model, compile_model="yes")


def test_compiled_training_step_has_no_graph_break():
    model, history, items = _kind("gr_hstu")
    model.train()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    batch = rg.RelayBatch.from_requests([(history(n, seed=n), 0, torch.arange(3), None) for n in (8, 13)])
    loss = compiled(batch).square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(batch).square().mean().backward()
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.allclose(grads[n], p.grad, atol=1e-5), n
    assert _breaks() == 0 and grads
