"""Shared by the engine tests: a small ranker, an engine over it, random histories and the exactness check."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton reads this when it first decorates kernels (see kernel_problems.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import relaygr_engine as rg  # noqa: E402

PAGE = 8
ATOL = 1e-4
KINDS = ("hstu", "softmax")


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
