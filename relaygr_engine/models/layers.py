"""HSTU and softmax-transformer layers built on :class:`~relaygr_engine.layer.PrefixAttention`.

Each layer is ``project`` (rows -> q, k, v), its ``attn`` (a ``PrefixAttention``: the paged op in a relay forward,
dense masked attention otherwise), then ``finish`` (attention output -> new rows). The K and V that ``project``
returns for a history token are what the prefix cache stores for that layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layer import PrefixAttention
from .config import GRModelConfig

__all__ = ["HSTULayer", "SoftmaxLayer", "make_layer"]


class HSTULayer(nn.Module):
    """HSTU layer: ``x + W_o(SiLU(u) * LN(A V))`` with ``A = SiLU(alpha q.k + rab) / N`` under the mask.

    ``[u | v | q | k] = uvqk(LN(x))`` (each ``num_heads * head_dim`` wide, in that order); ``rab`` is
    ``rel_pos_bias[distance] + time_bias[bucket(t_q - t_k)]`` shared across heads; ``N = max_seq_len``.
    """

    def __init__(self, config: GRModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.alpha, self.norm = config.attention_scale, config.hstu_norm
        width = config.num_heads * config.head_dim
        self.input_norm = nn.LayerNorm(config.hidden_dim)
        self.uvqk = nn.Linear(config.hidden_dim, 4 * width)
        self.rel_pos_bias = nn.Parameter(torch.zeros(config.max_seq_len + 1))
        self.time_bias = nn.Parameter(torch.zeros(config.num_time_buckets))
        self.output_norm = nn.LayerNorm(width)
        self.out_proj = nn.Linear(width, config.hidden_dim)
        self.attn = PrefixAttention("hstu", config.num_heads, config.head_dim, scale=self.alpha, hstu_norm=self.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x [R, hidden]`` of the running forward's batch -> ``[R, hidden]``."""
        q, k, v, u = self.project(x)
        return self.finish(x, self.attn(q, k, v, pos_bias=self.rel_pos_bias, ts_bias=self.time_bias), u)

    def project(self, x: torch.Tensor):
        """Rows ``x [T, hidden]`` -> ``q, k, v [T, H, D]`` and ``SiLU(u) [T, H*D]`` (kept for :meth:`finish`)."""
        shape = (x.shape[0], self.num_heads, self.head_dim)
        u, v, q, k = self.uvqk(self.input_norm(x)).chunk(4, dim=-1)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape), F.silu(u)

    def finish(self, x: torch.Tensor, o: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Residual update from the attention output ``o [T, H, D]``; returns ``[T, hidden]``."""
        return x + self.out_proj(u * self.output_norm(o.reshape(o.shape[0], -1)))


class SoftmaxLayer(nn.Module):
    """Pre-LN transformer layer: ``x += W_o(softmax-attn(LN(x)))``, then ``x += FFN(LN(x))`` (GELU)."""

    def __init__(self, config: GRModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.scale = config.attention_scale
        width = config.num_heads * config.head_dim
        self.attn_norm = nn.LayerNorm(config.hidden_dim)
        self.qkv = nn.Linear(config.hidden_dim, 3 * width)
        self.out_proj = nn.Linear(width, config.hidden_dim)
        self.ffn_norm = nn.LayerNorm(config.hidden_dim)
        self.ffn_in = nn.Linear(config.hidden_dim, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.hidden_dim)
        self.attn = PrefixAttention("softmax", config.num_heads, config.head_dim, scale=self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x [R, hidden]`` of the running forward's batch -> ``[R, hidden]``."""
        q, k, v, _ = self.project(x)
        return self.finish(x, self.attn(q, k, v))

    def project(self, x: torch.Tensor):
        """Rows ``x [T, hidden]`` -> ``q, k, v [T, H, D]`` (and None: nothing kept for :meth:`finish`)."""
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape), None

    def finish(self, x: torch.Tensor, o: torch.Tensor, aux=None) -> torch.Tensor:
        """Residual attention update from ``o [T, H, D]`` then the feed-forward block; returns ``[T, hidden]``."""
        x = x + self.out_proj(o.reshape(o.shape[0], -1))
        return x + self.ffn_out(F.gelu(self.ffn_in(self.ffn_norm(x))))


def make_layer(config: GRModelConfig) -> nn.Module:
    """The layer class that ``config.attention`` names."""
    return HSTULayer(config) if config.attention.value == "hstu" else SoftmaxLayer(config)
