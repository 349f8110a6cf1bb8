"""``PrefixAttention``: the one call a ranker makes where its attention was.

A user's model computes ``q, k, v`` as it always did and calls ``o = self.attn(q, k, v, pos_bias=..., ts_bias=...)``.
What runs depends on the forward context (:mod:`relaygr_engine.context`):

* in a relay forward (set by :class:`~relaygr_engine.RelayEngine`), the layer stores the new history rows' K/V in
  their pages and runs :func:`~relaygr_engine.ops.paged_prefix_attention` over each user's cached prefix, with the
  batch's plan built once for all layers;
* under :func:`~relaygr_engine.context.batch_context` (training, the oracle, tests), it runs dense masked attention
  over the batch with the same masks and formulas.

Masks (per user): a history row sees the history rows up to itself (causal); a candidate sees every history row
and itself, never another candidate. Formulas: see :mod:`relaygr_engine.ops`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import AttentionBackend, TimeBucket, _positive_int, parse_choice
from .context import ForwardContext, current_context
from .kernels._common import check_scalar
from .ops import AttentionMode, _check_args, _dispatch, time_buckets
from .torch_plan import planned_attention

__all__ = ["PrefixAttention"]


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

    Notes
    -----
    Called as ``o = attn(q, k, v, pos_bias=None, ts_bias=None)`` with ``q, k [R, H, D]``, ``v [R, H, Dv]`` (the rows of the
    forward's :class:`~relaygr_engine.batch.RelayBatch`); returns ``o [R, H, Dv]``. hstu only: ``pos_bias [P]`` is
    a table indexed by position distance ``pos_q - pos_k`` (clamped to ``P - 1``), ``ts_bias [NB]`` one indexed by
    the ``time_bucket`` of ``t_q - t_k`` (:func:`relaygr_engine.ops.time_buckets`, applied when the batch has
    timestamps). Both are shared across heads and may be parameters of the caller.

    Raises
    ------
    RuntimeError
        Called outside a forward context (use :func:`relaygr_engine.batch_context` or the engine), or in a relay
        forward by a layer the engine did not register (added to the model after the engine was built).
    """

    def __init__(self, mode, num_heads: int, head_dim: int, *, scale: float, hstu_norm: Optional[float] = None,
                 value_dim: Optional[int] = None, time_bucket=TimeBucket.LOG2) -> None:
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
        self._check(q, k, v, pos_bias, ts_bias, len(ctx.batch))
        if ctx.batch.timestamps is None:
            ts_bias = None
        if ctx.paged is None:
            return self._dense(ctx, q, k, v, pos_bias, ts_bias)
        return self._paged(ctx, q, k, v, pos_bias, ts_bias)

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
    def _paged(self, ctx: ForwardContext, q, k, v, pos_bias, ts_bias) -> torch.Tensor:
        st, batch = ctx.paged, ctx.batch
        if not self.prefix_stable:
            raise ValueError("hstu_norm='batch' is not prefix-stable: this layer runs the dense forward only "
                             "(a relay forward divides by a constant normaliser)")
        index = ctx.layer_index.get(id(self))
        if index is None:
            raise RuntimeError("this PrefixAttention is not one of the engine's layers (it was added to the model "
                               "after the RelayEngine was built); build a new engine for the changed model")
        cache = st.kv_caches[index]
        out_dtype, Dc = q.dtype, cache.shape[-1]
        if Dc != self.head_dim:  # zero columns change no dot product
            q, k = F.pad(q, (0, Dc - self.head_dim)), F.pad(k, (0, Dc - self.head_dim))
        if Dc != self.value_dim:
            v = F.pad(v, (0, Dc - self.value_dim))
        if q.dtype != cache.dtype:
            q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
        if st.write_rows is not None:
            self._write(st, index, k, v, len(batch))
        ts_q = batch.timestamps if ts_bias is not None else None
        ts_cache = st.ts_cache if ts_bias is not None else None
        args = (q, k, v, cache, st.kv_indptr, st.kv_indices, st.kv_last_page_len, batch.cu_seqlens,
                batch.num_candidates, self.mode, self.scale, self.hstu_norm, pos_bias, ts_bias, ts_cache, ts_q)
        if not st.validated:  # the first layer checks; a plan (when set) was built from checked tables already
            _check_args(*args, read_tables=st.plan is None and st.torch_plan is None, time_bucket=self.time_bucket)
            st.validated = True
        if st.torch_plan is not None and q.dtype in (torch.float32, torch.float64):
            o = planned_attention(st.torch_plan, q, k, v, st.flat(index), self.mode, self.scale, self.hstu_norm,
                                  pos_bias, ts_bias, self.time_bucket, compiled=st.compiled)
        else:
            o = _dispatch(*args, st.backend, plan=st.plan, time_bucket=self.time_bucket)
        if Dc != self.value_dim:
            o = o[..., :self.value_dim]
        return o if o.dtype == out_dtype else o.to(out_dtype)

    @staticmethod
    def _write(st, index: int, k: torch.Tensor, v: torch.Tensor, rows: int) -> None:
        """Store the K/V of the batch rows the engine is keeping in layer ``index``'s pages."""
        cache = st.kv_caches[index]
        if st.backend is AttentionBackend.TRITON:
            from .kernels.kv_write import kv_write
            kv_write(cache, k.contiguous(), v.contiguous(), st.slot_mapping(rows, cache.shape[2]), check_slots=False)
            return
        flat, dst = st.flat(index), st.write_kv_rows
        flat.index_copy_(0, dst, k.index_select(0, st.write_rows))
        flat.index_copy_(0, dst + cache.shape[2], v.index_select(0, st.write_rows))

    # ------------------------------------------------------------------------------------------ dense forward
    def _dense(self, ctx: ForwardContext, q, k, v, pos_bias, ts_bias) -> torch.Tensor:
        batch = ctx.batch
        out = q.new_empty(q.shape[:2] + (self.value_dim,))
        r0 = 0
        for b, (m, C) in enumerate(zip(batch.rows, batch.candidates_per_user)):
            r1 = r0 + m
            out[r0:r1] = self._dense_user(ctx, b, r0, r1, C, q[r0:r1], k[r0:r1], v[r0:r1], pos_bias, ts_bias)
            r0 = r1
        return out

    def _dense_user(self, ctx, b, r0, r1, C, q, k, v, pos_bias, ts_bias) -> torch.Tensor:
        """Dense masked attention over one user's rows ``[m, H, *]`` (the oracle's formulas)."""
        visible = _visible(ctx, b, r1 - r0, C, q.device)
        s = torch.einsum("ihd,jhd->hij", q, k).mul_(self.scale)
        if self.mode is AttentionMode.SOFTMAX:
            return torch.einsum("hij,jhd->ihd", torch.softmax(s.masked_fill_(~visible, float("-inf")), dim=-1), v)
        if pos_bias is not None:
            s.add_(pos_bias[_distance(ctx, b, r0, r1, pos_bias.numel())])
        if ts_bias is not None:
            s.add_(ts_bias[_buckets(ctx, b, r0, r1, ts_bias.numel(), self.time_bucket)])
        a = F.silu(s, inplace=True).masked_fill_(~visible, 0.0)
        norm = self.hstu_norm if self.hstu_norm is not None else float(max(ctx.batch.rows))
        return torch.einsum("hij,jhd->ihd", a, v).div_(norm)


def _cached(ctx: ForwardContext, key, make):
    value = ctx.dense_cache.get(key)
    if value is None:
        value = ctx.dense_cache[key] = make()
    return value


def _visible(ctx, b: int, m: int, C: int, device) -> torch.Tensor:
    """``[m, m]``: history rows see history rows up to themselves; candidates see the history and themselves."""
    def make():
        n = m - C
        idx = torch.arange(m, device=device)
        vis = (idx[None, :] < n) & ((idx[None, :] <= idx[:, None]) | (idx[:, None] >= n))
        return vis.fill_diagonal_(True)
    return _cached(ctx, ("visible", b), make)


def _distance(ctx, b: int, r0: int, r1: int, size: int) -> torch.Tensor:
    """``[m, m]`` position distances ``pos_i - pos_j`` clamped to ``[0, size - 1]``."""
    def make():
        pos = ctx.batch.positions[r0:r1]
        return (pos[:, None] - pos[None, :]).clamp_(0, size - 1)
    return _cached(ctx, ("distance", b, size), make)


def _buckets(ctx, b: int, r0: int, r1: int, num_buckets: int, time_bucket: TimeBucket) -> torch.Tensor:
    """``[m, m]`` time buckets of ``t_i - t_j``."""
    def make():
        ts = ctx.batch.timestamps[r0:r1]
        return time_buckets(ts[:, None] - ts[None, :], num_buckets, time_bucket)
    return _cached(ctx, ("buckets", b, num_buckets, time_bucket), make)
