"""``PrefixAttention``: the one call a ranker makes where its attention was.

A user's model computes ``q, k, v`` as it always did and calls ``o = self.attn(q, k, v, pos_bias=..., ts_bias=...)``.
What runs depends on the forward context (:mod:`relaygr_engine.attention.context`):

* in a relay forward (set by :class:`~relaygr_engine.RelayEngine`), the layer calls one registered op,
  ``relaygr::prefix_attention`` (:mod:`relaygr_engine.attention.op`), which stores the new history rows' K/V in their
  pages and attends over each user's cached prefix with the batch's plan (built once for all layers); a compiler
  sees the op as opaque;
* under :func:`~relaygr_engine.attention.context.batch_context` (training, the oracle, tests), it runs dense
  masked attention over the whole batch with the same masks and formulas, in plain tensor ops on the batch's row tables.

Both paths compile with ``torch.compile(model, fullgraph=True, dynamic=True)``: no graph break, no recompile per
length.

Masks (per user): a history row sees the history rows up to itself (causal); a candidate sees every history row
and itself, never another candidate. Formulas: see :mod:`relaygr_engine.attention.ops`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import AttentionMode, TimeBucket, _positive_int, parse_choice
from .context import ForwardContext, current_context
from ..kernels._common import check_scalar
from .op import relay_attention
from .time_buckets import time_buckets

__all__ = ["PrefixAttention", "find_layers"]


class PrefixAttention(nn.Module):
    """Attention of a GR ranker over ``[history, candidates]`` that the engine can serve from cached prefix pages.

    Parameters
    ----------
    mode : {"hstu", "softmax"}
        ``"hstu"``: ``sum_j SiLU(scale * q.k_j + rab_ij) v_j / hstu_norm`` (pointwise); ``"softmax"``:
        ``softmax_j(scale * q.k_j) v_j``.
    num_heads, head_dim : int
        ``H`` and the width ``D`` of ``q`` and ``k``.
    scale : float
        Multiplies ``q.k`` (typically ``1 / sqrt(head_dim)``).
    hstu_norm : float or "batch", optional
        hstu: the constant the sum over keys is divided by (e.g. the model's maximum sequence length); None = 1.
        ``"batch"``: the batch's longest sequence (its most rows of one user), as models trained with a per-batch
        normaliser do; the dense forward computes it, but such a layer is not prefix-stable
        (:attr:`prefix_stable` is False) and a relay engine refuses it. Must be None for softmax.
    value_dim : int, optional
        Width ``Dv`` of ``v`` and of the output (default ``head_dim``). The cache stores ``max(D, Dv)`` per head.
    time_bucket : {"log2", "ln_0301", "sqrt_60"}
        hstu: how ``ts_bias`` buckets a time difference (:class:`~relaygr_engine.config.TimeBucket`; default
        ``"log2"``).
    bias_needs_time : bool
        hstu: drop ``pos_bias`` too for a batch without timestamps (no relative bias at all, as Meta's research
        HSTU does); default False (``ts_bias`` alone is dropped).

    Notes
    -----
    Called as ``o = attn(q, k, v, pos_bias=None, ts_bias=None)`` with ``q, k [R, H, D]``, ``v [R, H, Dv]`` (the rows of
    the forward's :class:`~relaygr_engine.batch.RelayBatch`); returns ``o [R, H, Dv]``. hstu only: ``pos_bias [P]`` is
    a table indexed by position distance ``pos_q - pos_k`` (clamped to ``P - 1``), ``ts_bias [NB]`` one indexed by
    the ``time_bucket`` of ``t_q - t_k`` (:func:`relaygr_engine.attention.ops.time_buckets`, applied when the batch has
    timestamps). Both are shared across heads and may be parameters of the caller.

    Raises
    ------
    RuntimeError
        Called outside a forward context (use :func:`relaygr_engine.batch_context` or the engine), or in a relay
        forward by a layer the engine did not register (added to the model after the engine was built).
    """

    def __init__(self, mode, num_heads: int, head_dim: int, *, scale: float, hstu_norm: Optional[float] = None,
                 value_dim: Optional[int] = None, time_bucket=TimeBucket.LOG2, bias_needs_time: bool = False) -> None:
        super().__init__()
        self.mode = parse_choice(AttentionMode, mode, "mode")
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.value_dim = self.head_dim if value_dim is None else _positive_int("value_dim", value_dim)
        self.scale = check_scalar("scale", scale)
        if self.mode is AttentionMode.SOFTMAX and hstu_norm is not None:
            raise ValueError(f"hstu_norm applies to mode='hstu' only, got hstu_norm={hstu_norm!r} with mode='softmax'")
        if hstu_norm == "batch":
            self.hstu_norm = None  # per batch: see prefix_stable
        else:
            self.hstu_norm = 1.0 if hstu_norm is None else check_scalar("hstu_norm", hstu_norm, positive=True)
        self.time_bucket = parse_choice(TimeBucket, time_bucket, "time_bucket")
        if not isinstance(bias_needs_time, bool):
            raise ValueError(f"bias_needs_time must be a bool, got {bias_needs_time!r}")
        self.bias_needs_time = bias_needs_time
        if self.mode is AttentionMode.SOFTMAX and self.time_bucket is not TimeBucket.LOG2:
            raise ValueError(f"time_bucket applies to mode='hstu' only, got time_bucket={self.time_bucket.value!r} "
                             "with mode='softmax'")

    @property
    def prefix_stable(self) -> bool:
        """Whether a row's output depends only on the rows it sees (False for ``hstu_norm="batch"``)."""
        return self.hstu_norm is not None

    @property
    def cache_dim(self) -> int:
        """Per-head width of a cached K/V row: ``max(head_dim, value_dim)``."""
        return max(self.head_dim, self.value_dim)

    def extra_repr(self) -> str:
        extra = f", value_dim={self.value_dim}" if self.value_dim != self.head_dim else ""
        norm = ""
        if self.mode is AttentionMode.HSTU:
            norm = ", hstu_norm=batch" if self.hstu_norm is None else f", hstu_norm={self.hstu_norm:g}"
        if self.time_bucket is not TimeBucket.LOG2:
            norm += f", time_bucket={self.time_bucket.value}"
        return f"{self.mode.value}, heads={self.num_heads}, head_dim={self.head_dim}{extra}, scale={self.scale:g}{norm}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_bias: Optional[torch.Tensor] = None,
                ts_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx = current_context()
        if ctx is None:
            raise RuntimeError("PrefixAttention needs the batch it runs on: call the model inside "
                               "`with relaygr_engine.batch_context(batch):` (dense, no cache) or through a "
                               "RelayEngine (relay forward)")
        if ctx.relay:
            return self._relay(ctx, q, k, v, pos_bias, ts_bias)
        batch = ctx.batch
        self._check(q, k, v, pos_bias, ts_bias, batch.item_ids.shape[0])
        if batch.timestamps is None:
            ts_bias = None
            if self.bias_needs_time:
                pos_bias = None
        return self._dense(ctx, q, k, v, pos_bias, ts_bias)

    # ------------------------------------------------------------------------------------------ checks
    def _check(self, q, k, v, pos_bias, ts_bias, rows: int) -> None:
        H, D, Dv = self.num_heads, self.head_dim, self.value_dim
        for name, x, width in (("q", q, D), ("k", k, D), ("v", v, Dv)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape) != (rows, H, width):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must have shape [{rows}, {H}, {width}] (batch rows, heads, width), "
                                 f"got {got}")
        if self.mode is AttentionMode.SOFTMAX and (pos_bias is not None or ts_bias is not None):
            raise ValueError("pos_bias and ts_bias apply to mode='hstu' only; got a bias with mode='softmax'")

    # ------------------------------------------------------------------------------------------ relay forward
    def _relay(self, ctx: ForwardContext, q, k, v, pos_bias, ts_bias) -> torch.Tensor:
        """The paged path: one ``relaygr::prefix_attention`` op (eager calls run its implementation directly)."""
        index = ctx.layer_index.get(id(self))
        if index is None:
            raise RuntimeError("this PrefixAttention is not one of the engine's layers (it was added to the model "
                               "after the RelayEngine was built); build a new engine for the changed model")
        cache = ctx.kv_caches[index]
        if torch.compiler.is_compiling() or type(q) is not torch.Tensor:
            return torch.ops.relaygr.prefix_attention(q, k, v, cache, pos_bias, ts_bias, index)
        return relay_attention(q, k, v, cache, pos_bias, ts_bias, index)

    # ------------------------------------------------------------------------------------------ dense forward
    def _dense(self, ctx: ForwardContext, q, k, v, pos_bias, ts_bias) -> torch.Tensor:
        """Dense masked attention over the whole batch (the oracle's formulas; a row sees only its own user's
        rows), in tensor ops on the batch's row tables: traceable, no per-user loop."""
        batch = ctx.batch
        hidden = _cached(ctx, ("hidden",), lambda: ~_visible(batch))
        s = torch.einsum("ihd,jhd->hij", q, k).mul_(self.scale)
        if self.mode is AttentionMode.SOFTMAX:
            return torch.einsum("hij,jhd->ihd", torch.softmax(s.masked_fill_(hidden, float("-inf")), dim=-1), v)
        if pos_bias is not None:
            n = pos_bias.shape[0]
            s.add_(pos_bias[_cached(ctx, ("distance", n), lambda: _distance(batch.positions, n))])
        if ts_bias is not None:
            n, fn = ts_bias.shape[0], self.time_bucket
            pos = batch.timestamps
            s.add_(ts_bias[_cached(ctx, ("buckets", n, fn), lambda: time_buckets(pos[:, None] - pos[None, :], n, fn))])
        a = F.silu(s, inplace=True).masked_fill_(hidden, 0.0)
        o = torch.einsum("hij,jhd->ihd", a, v)
        if self.hstu_norm is not None:
            return o.div_(self.hstu_norm)
        cu = batch.cu_seqlens
        return o.div_((cu[1:] - cu[:-1]).max().to(o.dtype))  # "batch": the longest user


def _cached(ctx: ForwardContext, key, make):
    value = ctx.dense_cache.get(key)
    if value is None:
        value = ctx.dense_cache[key] = make()
    return value


def _visible(batch) -> torch.Tensor:
    """``[R, R]``: a row sees rows of its own user only; history rows see history rows up to themselves (causal),
    candidates see the history and themselves."""
    seg, cand = batch.segment_ids, batch.is_candidate
    idx = torch.arange(seg.shape[0], device=seg.device)
    causal = (idx[None, :] <= idx[:, None]) | cand[:, None]
    return (seg[:, None] == seg[None, :]) & ((causal & ~cand[None, :]) | (idx[:, None] == idx[None, :]))


def _distance(positions: torch.Tensor, size: int) -> torch.Tensor:
    """``[R, R]`` position distances ``pos_i - pos_j`` clamped to ``[0, size - 1]``."""
    return (positions[:, None] - positions[None, :]).clamp_(0, size - 1)


def find_layers(model: nn.Module) -> list:
    """The :class:`PrefixAttention` modules of ``model`` in registration order."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [m for m in model.modules() if isinstance(m, PrefixAttention)]
