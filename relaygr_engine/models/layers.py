"""HSTU and softmax-transformer layers built on :class:`~relaygr_engine.attention.layer.PrefixAttention`.

Each layer is ``project`` (rows -> q, k, v), its ``attn`` (a ``PrefixAttention``: the paged op in a relay forward,
dense masked attention otherwise), then ``finish`` (attention output -> new rows). The K and V that ``project``
returns for a history token are what the prefix cache stores for that layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.layer import PrefixAttention
from .config import GRModelConfig, HSTUActivation, HSTUOutput, HSTUOutputNorm

__all__ = ["HSTULayer", "SoftmaxLayer", "make_layer"]


class HSTULayer(nn.Module):
    """HSTU layer: ``x + W_o(y)`` with ``A = SiLU(alpha q.k + rab) / N`` under the mask and ``a = A V``.

    ``[u | v | q | k] = uvqk(LN(x))`` (widths ``H*Dv, H*Dv, H*D, H*D`` in that order); SiLU on ``u``
    (``hstu_activation="silu_u"``) or on all four (``"silu_uvqk"``); ``rab`` is
    ``rel_pos_bias[distance] + time_bias[time_bucket(t_q - t_k)]`` shared across heads (no ``rab`` at all for a
    request without timestamps when ``rab_without_time`` is False); ``N = hstu_norm``. ``y = u * norm(a)``
    (``hstu_output="gated"``) or ``concat(u, a, u * norm(a))`` (``"concat_ux"``), ``norm`` a LayerNorm over
    ``H*Dv`` or a per-head group norm (``hstu_output_norm``).
    """

    def __init__(self, config: GRModelConfig) -> None:
        super().__init__()
        H, D, Dv = config.num_heads, config.head_dim, config.value_dim
        self.num_heads, self.head_dim, self.value_dim = H, D, Dv
        self.alpha, self.norm = config.attention_scale, config.hstu_norm
        self.silu_all = config.hstu_activation is HSTUActivation.SILU_UVQK
        self.concat = config.hstu_output is HSTUOutput.CONCAT_UX
        self.group_norm = config.hstu_output_norm is HSTUOutputNorm.GROUP
        self.rab_without_time = config.rab_without_time
        self.widths = [H * Dv, H * Dv, H * D, H * D]
        self.input_norm = nn.LayerNorm(config.hidden_dim, eps=config.norm_eps)
        self.uvqk = nn.Linear(config.hidden_dim, sum(self.widths))
        self.rel_pos_bias = nn.Parameter(torch.zeros(config.max_seq_len + 1))
        self.time_bias = nn.Parameter(torch.zeros(config.num_time_buckets))
        self.output_norm = (nn.GroupNorm(H, H, eps=config.norm_eps) if self.group_norm
                            else nn.LayerNorm(H * Dv, eps=config.norm_eps))
        self.out_proj = nn.Linear(H * Dv * (3 if self.concat else 1), config.hidden_dim)
        self.attn = PrefixAttention("hstu", H, D, scale=self.alpha, hstu_norm=self.norm, value_dim=Dv,
                                    time_bucket=config.time_bucket, bias_needs_time=not config.rab_without_time)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x [R, hidden]`` of the running forward's batch -> ``[R, hidden]``."""
        q, k, v, u = self.project(x)
        return self.finish(x, self.attn(q, k, v, pos_bias=self.rel_pos_bias, ts_bias=self.time_bias), u)

    def project(self, x: torch.Tensor):
        """Rows ``x [T, hidden]`` -> ``q, k [T, H, D]``, ``v [T, H, Dv]`` and ``u [T, H*Dv]`` after its activation
        (kept for :meth:`finish`)."""
        T, H = x.shape[0], self.num_heads
        uvqk = self.uvqk(self.input_norm(x))
        if self.silu_all:
            uvqk = F.silu(uvqk)
        u, v, q, k = uvqk.split(self.widths, dim=-1)
        if not self.silu_all:
            u = F.silu(u)
        return (q.reshape(T, H, self.head_dim), k.reshape(T, H, self.head_dim), v.reshape(T, H, self.value_dim),
                u)

    def finish(self, x: torch.Tensor, o: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Residual update from the attention output ``o [T, H, Dv]``; returns ``[T, hidden]``."""
        a = o.reshape(o.shape[0], -1)
        n = self.output_norm(o).reshape(a.shape) if self.group_norm else self.output_norm(a)
        y = u * n
        if self.concat:
            y = torch.cat([u, a, y], dim=-1)
        return x + self.out_proj(y)


class SoftmaxLayer(nn.Module):
    """Pre-LN transformer layer: ``x += W_o(softmax-attn(LN(x)))``, then ``x += FFN(LN(x))`` (GELU).

    ``[q | k | v] = qkv(LN(x))`` with widths ``H*D, H*D, H*Dv``.
    """

    def __init__(self, config: GRModelConfig) -> None:
        super().__init__()
        H, D, Dv = config.num_heads, config.head_dim, config.value_dim
        self.num_heads, self.head_dim, self.value_dim = H, D, Dv
        self.scale = config.attention_scale
        self.widths = [H * D, H * D, H * Dv]
        self.attn_norm = nn.LayerNorm(config.hidden_dim, eps=config.norm_eps)
        self.qkv = nn.Linear(config.hidden_dim, sum(self.widths))
        self.out_proj = nn.Linear(H * Dv, config.hidden_dim)
        self.ffn_norm = nn.LayerNorm(config.hidden_dim, eps=config.norm_eps)
        self.ffn_in = nn.Linear(config.hidden_dim, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.hidden_dim)
        self.attn = PrefixAttention("softmax", H, D, scale=self.scale, value_dim=Dv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``x [R, hidden]`` of the running forward's batch -> ``[R, hidden]``."""
        q, k, v, _ = self.project(x)
        return self.finish(x, self.attn(q, k, v))

    def project(self, x: torch.Tensor):
        """Rows ``x [T, hidden]`` -> ``q, k [T, H, D]``, ``v [T, H, Dv]`` (and None: nothing kept for
        :meth:`finish`)."""
        T, H = x.shape[0], self.num_heads
        q, k, v = self.qkv(self.attn_norm(x)).split(self.widths, dim=-1)
        return q.reshape(T, H, self.head_dim), k.reshape(T, H, self.head_dim), v.reshape(T, H, self.value_dim), None

    def finish(self, x: torch.Tensor, o: torch.Tensor, aux=None) -> torch.Tensor:
        """Residual attention update from ``o [T, H, Dv]`` then the feed-forward block; returns ``[T, hidden]``."""
        x = x + self.out_proj(o.reshape(o.shape[0], -1))
        return x + self.ffn_out(F.gelu(self.ffn_in(self.ffn_norm(x))))


def make_layer(config: GRModelConfig) -> nn.Module:
    """The layer class that ``config.attention`` names."""
    return HSTULayer(config) if config.attention.value == "hstu" else SoftmaxLayer(config)
