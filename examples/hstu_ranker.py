"""A user's own HSTU ranker, served by RelayEngine after one change: its attention call became rg.PrefixAttention.

The model below is written the way a recommender team writes one: its own embeddings (items, actions, positions),
its own HSTU block (fused u/v/q/k projection, relative position and time biases, gated output), its own MLP
head with two tasks. Nothing of ``relaygr_engine.models`` is used. The diff that made it servable:

    -        a = self.hstu_attention(q, k, v, mask, rab)          # the team's dense masked attention
    +        a = self.attn(q, k, v, pos_bias=self.pos_bias, ts_bias=self.ts_bias)

and ``forward`` takes a ``rg.RelayBatch`` (rows of many users, flattened) instead of padded ``[B, N]`` tensors.
Run it: ``python examples/hstu_ranker.py`` (trains a few steps on synthetic sessions, then serves them).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import relaygr_engine as rg


class HSTUBlock(nn.Module):
    """``x + W_o(SiLU(u) * LN(A V))``, ``A = SiLU(alpha q.k + rab) / N``; rab = position + time-bucket biases."""

    def __init__(self, dim: int, heads: int, head_dim: int, max_len: int, time_buckets: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.pos_bias = nn.Parameter(torch.randn(max_len + 1) * 0.1)
        self.ts_bias = nn.Parameter(torch.randn(time_buckets) * 0.1)
        self.out_norm = nn.LayerNorm(heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)
        self.attn = rg.PrefixAttention("hstu", heads, head_dim, scale=1.0 / math.sqrt(head_dim),
                                       hstu_norm=float(max_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[0], self.heads, self.head_dim)
        u, v, q, k = self.uvqk(self.norm(x)).chunk(4, dim=-1)
        a = self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape), pos_bias=self.pos_bias,
                      ts_bias=self.ts_bias)
        return x + self.out(F.silu(u) * self.out_norm(a.reshape(x.shape[0], -1)))


class MyHSTURanker(nn.Module):
    """Items and actions in, two task logits (click, like) per candidate out."""

    def __init__(self, num_items: int = 2000, num_actions: int = 4, dim: int = 48, heads: int = 2,
                 head_dim: int = 24, layers: int = 3, max_len: int = 256, time_buckets: int = 24) -> None:
        super().__init__()
        self.item = nn.Embedding(num_items, dim)
        self.action = nn.Embedding(num_actions, dim)
        self.position = nn.Embedding(max_len + 1, dim)
        self.is_target = nn.Parameter(torch.randn(dim) * 0.1)
        self.blocks = nn.ModuleList(HSTUBlock(dim, heads, head_dim, max_len, time_buckets) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, 2))

    def forward(self, batch: rg.RelayBatch) -> torch.Tensor:
        with rg.batch_context(batch):  # lets a plain model(batch) train; inside the engine it does nothing
            x = self.item(batch.item_ids) + self.position(batch.positions)
            if batch.action_ids is not None:
                x = x + self.action(batch.action_ids) * batch.is_behavior[:, None]
            x = x + self.is_target * batch.is_candidate[:, None]
            for block in self.blocks:
                x = block(x)
            return self.head(x[batch.candidate_rows])


def synthetic_history(length: int, seed: int, num_items: int = 2000) -> rg.Behaviors:
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(item_ids=torch.randint(0, num_items, (length,), generator=g),
                        action_ids=torch.randint(0, 4, (length,), generator=g),
                        timestamps=1_700_000_000 + torch.cumsum(torch.randint(1, 4000, (length,), generator=g), 0))


def train_steps(model: nn.Module, steps: int = 3, seed: int = 0) -> float:
    """A few steps of a click objective on synthetic sessions (dense forward, no cache); returns the last loss."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.zeros(())
    for step in range(steps):
        parts = [(synthetic_history(40 + 8 * b, seed=100 * step + b), 0, torch.randint(0, 2000, (6,), generator=g),
                  None) for b in range(4)]
        batch = rg.RelayBatch.from_requests(parts)
        labels = torch.randint(0, 2, (batch.num_candidate_rows, 2), generator=g).float()
        loss = F.binary_cross_entropy_with_logits(model(batch), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def main() -> dict:
    torch.manual_seed(0)
    model = MyHSTURanker()
    loss = train_steps(model)
    engine = rg.RelayEngine(model, rg.CacheConfig(page_size=16, num_pages=512, attention_backend="torch"))
    worst, sources = 0.0, []
    for user in range(4):
        history = synthetic_history(120 + 10 * user, seed=user)
        candidates = torch.randint(0, 2000, (32,), generator=torch.Generator().manual_seed(user))
        ticket = engine.prefill_prefix(user, history.prefix(len(history) - 8))   # at retrieval
        result = engine.rank_with_prefix(user, history, candidates, ticket=ticket)  # at ranking
        with torch.no_grad():
            want = model(rg.RelayBatch.full(history, candidates))
        worst = max(worst, float((result.scores - want).abs().max()))
        sources.append(result.source)
    print(f"hstu example: trained (loss {loss:.3f}), served 4 users from {sorted(set(sources))}, "
          f"max |relay - no-cache| = {worst:.2e}")
    return dict(max_abs_diff=worst, sources=sources, loss=loss)


if __name__ == "__main__":
    main()
