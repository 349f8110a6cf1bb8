"""The public model boundary: PrefixAttention, RelayBatch, the forward context, and engines over any ranker."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import relaygr_engine as rg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def history(L, seed=0, timestamps=True, context=0):
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(item_ids=torch.randint(0, 100, (L,), generator=g),
                        action_ids=torch.randint(0, 3, (L,), generator=g),
                        timestamps=torch.cumsum(torch.randint(0, 900, (L,), generator=g), 0) if timestamps else None,
                        context_ids=torch.arange(context) + 7 if context else None)


class Tiny(nn.Module):
    """The smallest user ranker: embedding, one PrefixAttention, a linear head."""

    def __init__(self, mode="softmax", heads=2, head_dim=8, value_dim=None, out=2):
        super().__init__()
        self.emb = nn.Embedding(100, heads * head_dim)
        self.pos = nn.Embedding(64, heads * head_dim)
        self.qkv = nn.Linear(heads * head_dim, heads * (2 * head_dim + (value_dim or head_dim)))
        self.shape = (heads, head_dim, value_dim or head_dim)
        norm = 64.0 if mode == "hstu" else None
        self.attn = rg.PrefixAttention(mode, heads, head_dim, scale=1 / math.sqrt(head_dim), hstu_norm=norm,
                                       value_dim=value_dim)
        self.head = nn.Linear(heads * (value_dim or head_dim), out)

    def forward(self, batch):
        H, D, Dv = self.shape
        x = self.emb(batch.item_ids) + self.pos(batch.positions)
        q, k, v = self.qkv(x).split([H * D, H * D, H * Dv], dim=-1)
        R = x.shape[0]
        o = self.attn(q.reshape(R, H, D), k.reshape(R, H, D), v.reshape(R, H, Dv))
        return self.head(o.reshape(R, -1)[batch.candidate_rows])


def test_relay_batch_full_layout():
    h = history(5, context=2)
    b = rg.RelayBatch.full(h, torch.tensor([3, 4, 5]), request_time=10**6)
    assert len(b) == 10 and b.num_users == 1 and b.num_candidate_rows == 3 and b.start == (0,)
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 7]
    assert b.is_candidate.tolist() == [False] * 7 + [True] * 3
    assert b.is_context.tolist() == [True] * 2 + [False] * 8
    assert b.item_ids.tolist()[:2] == [7, 8] and b.item_ids.tolist()[7:] == [3, 4, 5]
    ts = h.timestamps.tolist()
    assert b.timestamps.tolist() == [ts[0]] * 2 + ts + [10**6] * 3
    assert b.action_ids.tolist() == [0, 0] + h.action_ids.tolist() + [0, 0, 0]
    assert b.cu_seqlens.tolist() == [0, 10] and b.num_candidates.tolist() == [3]
    assert b.candidate_rows.tolist() == [7, 8, 9] and b.is_behavior.sum() == 5


def test_relay_batch_from_requests_starts_after_the_cached_prefix():
    h = history(6)
    b = rg.RelayBatch.from_requests([(h, 4, torch.tensor([1]), None), (h, 2, None, None)])
    assert b.rows == (3, 4) and b.start == (4, 2) and b.candidates_per_user == (1, 0)
    assert b.positions.tolist() == [4, 5, 6, 2, 3, 4, 5] and b.candidate_rows.tolist() == [2]
    with pytest.raises(ValueError, match="start must be an integer in \\[0, 6\\]"):
        rg.RelayBatch.from_requests([(h, 7, None, None)])
    with pytest.raises(ValueError, match="must have timestamps and action ids like parts\\[0\\]"):
        rg.RelayBatch.from_requests([(h, 0, None, None), (history(3, timestamps=False), 0, None, None)])
    with pytest.raises(ValueError, match="request_time must be an integer"):
        rg.RelayBatch.full(h, torch.tensor([1]), request_time=1.5)


def test_prefix_attention_arguments():
    with pytest.raises(ValueError, match="mode must be one of"):
        rg.PrefixAttention("linear", 2, 8, scale=1.0)
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1, got 0"):
        rg.PrefixAttention("hstu", 0, 8, scale=1.0)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        rg.PrefixAttention("hstu", 2, 8, scale=float("nan"))
    with pytest.raises(ValueError, match="hstu_norm applies to mode='hstu' only"):
        rg.PrefixAttention("softmax", 2, 8, scale=1.0, hstu_norm=4.0)
    with pytest.raises(ValueError, match="hstu_norm must be > 0, got 0"):
        rg.PrefixAttention("hstu", 2, 8, scale=1.0, hstu_norm=0)
    with pytest.raises(ValueError, match="value_dim must be an integer >= 1"):
        rg.PrefixAttention("hstu", 2, 8, scale=1.0, value_dim=-1)
    assert rg.PrefixAttention("hstu", 2, 8, scale=1.0, value_dim=12).cache_dim == 12


def test_prefix_attention_needs_a_context_and_checks_shapes():
    model = Tiny().eval()
    batch = rg.RelayBatch.full(history(6), torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="batch_context"):
        model(batch)
    with rg.batch_context(batch):
        assert model(batch).shape == (2, 2)
        q = torch.zeros(len(batch), 2, 8)
        with pytest.raises(ValueError, match="v must have shape \\[8, 2, 8\\]"):
            model.attn(q, q, q[:, :1])
        with pytest.raises(ValueError, match="pos_bias and ts_bias apply to mode='hstu' only"):
            model.attn(q, q, q, pos_bias=torch.zeros(4))
    cached = rg.RelayBatch.from_requests([(history(6), 3, torch.tensor([1]), None)])
    with pytest.raises(ValueError, match="start every user at position 0"):
        with rg.batch_context(cached):
            pass


@pytest.mark.parametrize("mode", ["softmax", "hstu"])
@pytest.mark.parametrize("value_dim", [None, 5, 13])
def test_any_ranker_is_served_exactly(mode, value_dim):
    """A model that is not a GRRanker and has no check_inputs: every path equals its no-cache forward."""
    from relaygr_engine.testing import check_relay_exact
    model = Tiny(mode, value_dim=value_dim).eval()
    # contextual tokens, and histories with and without timestamps (one forward per kind in a batch)
    hists = [history(11, seed=1), history(20, seed=2, context=2), history(7, seed=3, timestamps=False)]
    assert max(check_relay_exact(model, hists, torch.tensor([3, 9, 4])).values()) <= 1e-4


def test_engine_checks_the_layers_and_the_model_contract():
    class TwoShapes(Tiny):
        def __init__(self):
            super().__init__()
            self.other = rg.PrefixAttention("softmax", 4, 8, scale=1.0)

    with pytest.raises(ValueError, match="layer 1 with 4 heads x 8"):
        rg.RelayEngine(TwoShapes(), rg.CacheConfig(num_pages=16))
    with pytest.raises(ValueError, match="model_version must be a non-empty string"):
        rg.RelayEngine(Tiny(), rg.CacheConfig(num_pages=16), model_version="")

    class WrongOutput(Tiny):
        def forward(self, batch):
            return super().forward(batch)[:1]

    engine = rg.RelayEngine(WrongOutput().eval(), rg.CacheConfig(num_pages=64, page_size=4), store_misses=True)
    with pytest.raises(ValueError, match="model\\(batch\\) must return the candidate rows' scores \\[3, num_tasks\\]"):
        engine.rank_with_prefix(1, history(9), torch.tensor([1, 2, 3]))
    assert engine.pool.entries_of(1) == [] and engine.pool.num_pinned_pages == 0  # the stored miss was freed
    with pytest.raises(ValueError, match="candidates must be a 1-D int64"):
        engine.rank_with_prefix(1, history(9), torch.tensor([[1]]))
    assert engine.stats()["rank_requests"] == 0


def test_a_layer_added_after_the_engine_is_refused():
    model = Tiny().eval()
    engine = rg.RelayEngine(model, rg.CacheConfig(num_pages=64, page_size=4))
    model.attn = rg.PrefixAttention("softmax", 2, 8, scale=0.5)
    with pytest.raises(RuntimeError, match="not one of the engine's layers"):
        engine.rank_with_prefix(1, history(9), torch.tensor([1]))


def test_model_version_is_the_model_identity():
    model = Tiny().eval()
    a = rg.RelayEngine(model, rg.CacheConfig(num_pages=64, page_size=4), model_version="ranker-v7")
    b = rg.RelayEngine(Tiny(out=2).eval(), rg.CacheConfig(num_pages=64, page_size=4), model_version="ranker-v7")
    assert a.model_identity() == b.model_identity()
    c = rg.RelayEngine(model, rg.CacheConfig(num_pages=64, page_size=4))
    before = c.model_identity()
    with torch.no_grad():
        model.head.bias.add_(1.0)  # an in-place edit changes the state-dict identity, not the version
    assert c.model_identity() != before and a.model_identity() == b.model_identity()
    h, cands = history(12), torch.tensor([1, 2])
    t = c.prefill_prefix(1, h.prefix(8))
    with torch.no_grad():
        model.head.weight.mul_(2.0)
    res = c.rank_with_prefix(1, h, cands, ticket=t)  # new weights: the cached prefix is not reused
    assert res.source == "recompute"
