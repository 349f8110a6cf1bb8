"""A user's own softmax-transformer ranker (SASRec/BERT4Rec-style, causal), served by RelayEngine.

Written as a team would: item + action + position embeddings, pre-LN transformer blocks with their own q/k/v
projection and feed-forward, a multi-task MLP head over the candidate rows. The diff that made it servable:

    -        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)   # [B, H, N, D], padded
    +        a = self.attn(q, k, v)                                        # [R, H, D], rows of a RelayBatch

Its value heads are wider than its query/key heads (``value_dim``), which the cache supports. Run it:
``python examples/softmax_ranker.py``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import relaygr_engine as rg


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, value_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.value_dim = heads, head_dim, value_dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qk = nn.Linear(dim, 2 * heads * head_dim)
        self.v = nn.Linear(dim, heads * value_dim)
        self.o = nn.Linear(heads * value_dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attn = rg.PrefixAttention("softmax", heads, head_dim, scale=1.0 / math.sqrt(head_dim),
                                       value_dim=value_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        R = x.shape[0]
        h = self.ln1(x)
        q, k = self.qk(h).view(R, 2, self.heads, self.head_dim).unbind(1)
        v = self.v(h).view(R, self.heads, self.value_dim)
        x = x + self.o(self.attn(q, k, v).reshape(R, -1))
        return x + self.ffn(self.ln2(x))


class MySoftmaxRanker(nn.Module):
    def __init__(self, num_items: int = 3000, num_actions: int = 5, dim: int = 64, heads: int = 4,
                 head_dim: int = 16, value_dim: int = 24, layers: int = 2, max_len: int = 512,
                 tasks: int = 3) -> None:
        super().__init__()
        self.item = nn.Embedding(num_items, dim)
        self.action = nn.Embedding(num_actions, dim)
        self.position = nn.Embedding(max_len + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, head_dim, value_dim) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, tasks))

    def forward(self, batch: rg.RelayBatch) -> torch.Tensor:
        with rg.batch_context(batch):
            x = self.item(batch.item_ids) + self.position(batch.positions)
            if batch.action_ids is not None:
                x = x + self.action(batch.action_ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x[batch.candidate_rows])


def synthetic_history(length: int, seed: int, num_items: int = 3000) -> rg.Behaviors:
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(item_ids=torch.randint(0, num_items, (length,), generator=g),
                        action_ids=torch.randint(0, 5, (length,), generator=g))


def main() -> dict:
    torch.manual_seed(0)
    model = MySoftmaxRanker().eval()
    engine = rg.RelayEngine(model, rg.CacheConfig(page_size=16, num_pages=512, attention_backend="torch"))
    histories = {user: synthetic_history(150 + 7 * user, seed=user) for user in range(6)}
    engine.prefill_prefix_batch([(u, h.prefix(len(h) - 5)) for u, h in histories.items()])
    cands = {u: torch.randint(0, 3000, (20,), generator=torch.Generator().manual_seed(u)) for u in histories}
    results = engine.rank_with_prefix_batch([rg.RankRequest(u, h, cands[u]) for u, h in histories.items()])
    worst = 0.0
    with torch.no_grad():
        for (u, h), res in zip(histories.items(), results):
            worst = max(worst, float((res.scores - model(rg.RelayBatch.full(h, cands[u]))).abs().max()))
    print(f"softmax example: ranked {len(results)} users in one batch from "
          f"{sorted({r.source for r in results})}, max |relay - no-cache| = {worst:.2e}")
    return dict(max_abs_diff=worst, sources=[r.source for r in results])


if __name__ == "__main__":
    main()
