"""The torch backend's plan for a relay forward: per-batch index tables that make each layer's attention a few
batched ops (padded users), instead of a per-user loop that rebuilds masks and biases in every layer.

Built on the host from the engine's own page table (no device read), once per forward; every layer reuses it.
Users are padded to ``M`` rows and ``K`` keys; a user's keys are its cached tokens, then its new rows (history,
then candidates), so a candidate's own key is among them and the mask admits it alone of the candidates.
Semantics are those of :func:`relaygr_engine.ops.paged_prefix_attention` (the reference it is tested against).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .config import AttentionMode, TimeBucket
from .ops import time_buckets

__all__ = ["MAX_PADDED_SCORES", "MAX_ROWS_X_KEYS", "TorchPlan", "build_torch_plan", "planned_attention"]

# Largest padded score tensor (users x heads x rows x keys) the plan path materialises; larger batches (long
# prefills) take the blockwise reference, which bounds its temporaries.
MAX_PADDED_SCORES = 1 << 23
# Most padded (row, key) pairs per user: past it the per-element bias gathers and masked work of the padded path
# cost more than the blockwise reference's per-user loop saves (measured on the CPU: at 16 rows x 17 keys the plan
# path is ~2x faster per call, at 80 x 1088 ~30% slower), so the plan is for the fixed-cost regime.
MAX_ROWS_X_KEYS = 8192


@dataclass(eq=False)
class TorchPlan:
    """Index tables of one batch (``B`` users padded to ``M`` rows and ``K`` keys; ``R`` rows, ``S`` cached tokens).

    Attributes
    ----------
    k_slots : LongTensor [S]
        Row of each cached token's K in a layer's cache viewed as ``[num_pages * 2 * page_size, H, D]`` (V is
        ``page_size`` rows further).
    kidx : LongTensor [B * K]
        Each padded key's row in ``cat(cached K [S], new rows [R])`` (padding: 0, masked out).
    qidx : LongTensor [B * M]
        Each padded query's batch row (padding: 0).
    out_idx : LongTensor [R]
        Each batch row's place in the padded ``[B * M]`` output.
    visible : BoolTensor [B, 1, M, K]
    hidden : BoolTensor [B, 1, M, K]
        ``~visible``.
    """

    B: int
    M: int
    K: int
    page_size: int
    k_slots: torch.Tensor
    kidx: torch.Tensor
    qidx: torch.Tensor
    out_idx: torch.Tensor
    visible: torch.Tensor
    hidden: torch.Tensor
    dist: torch.Tensor  # [B, 1, M, K] position distance pos_q - pos_k (>= 0 where visible)
    t_q: Optional[torch.Tensor] = None  # [B, 1, M, 1] query times
    t_k: Optional[torch.Tensor] = None  # [B, 1, 1, K] key times
    _cache: dict = field(default_factory=dict)

    def distance(self, size: int) -> torch.Tensor:
        """``dist`` clamped to ``[0, size - 1]`` (a position-bias table of ``size`` entries)."""
        d = self._cache.get(("dist", size))
        if d is None:
            d = self._cache[("dist", size)] = self.dist.clamp(0, size - 1)
        return d

    def buckets(self, num_buckets: int, time_bucket: TimeBucket = TimeBucket.LOG2) -> torch.Tensor:
        """Time bucket of ``t_q - t_k`` for every padded (row, key)."""
        b = self._cache.get(("ts", num_buckets, time_bucket))
        if b is None:
            b = self._cache[("ts", num_buckets, time_bucket)] = time_buckets(self.t_q - self.t_k, num_buckets,
                                                                             time_bucket)
        return b


def build_torch_plan(rows: Sequence[int], num_candidates: Sequence[int], prefix_lens: Sequence[int],
                     prefix_pages: Sequence[np.ndarray], page_size: int, num_heads: int, device: torch.device,
                     ts_rows: Optional[torch.Tensor] = None,
                     ts_cache: Optional[torch.Tensor] = None) -> Optional[TorchPlan]:
    """The plan of a batch, or None (use the blockwise reference) when a user's padded rows x keys would exceed
    :data:`MAX_ROWS_X_KEYS` or the padded scores :data:`MAX_PADDED_SCORES`.

    Parameters
    ----------
    rows, num_candidates, prefix_lens : sequence of int, length B
        Each user's rows in the batch, candidates among them, and cached tokens ``P_b``.
    prefix_pages : sequence of int arrays
        Each user's pages holding its cached tokens (token ``t`` in page ``t // page_size``).
    ts_rows : LongTensor [R], optional
        Row timestamps (turns on the time-bias tables); ``ts_cache [num_pages, page_size]`` the cached tokens'.
    """
    B = len(rows)
    M = max(rows, default=0)
    K = max((p + m for p, m in zip(prefix_lens, rows)), default=0)
    if B == 0 or M == 0 or M * K > MAX_ROWS_X_KEYS or B * num_heads * M * K > MAX_PADDED_SCORES:
        return None
    S = int(sum(prefix_lens))
    k_slots, kidx, qidx = np.zeros(S, np.int64), np.zeros((B, K), np.int64), np.zeros((B, M), np.int64)
    out_idx = np.zeros(sum(rows), np.int64)
    visible = np.zeros((B, M, K), bool)
    pos_q, pos_k = np.zeros((B, M), np.int64), np.zeros((B, K), np.int64)
    s0 = r0 = 0
    for b, (m, C, P, pages) in enumerate(zip(rows, num_candidates, prefix_lens, prefix_pages)):
        n = m - C
        t = np.arange(P)
        k_slots[s0:s0 + P] = np.asarray(pages, np.int64)[t // page_size] * 2 * page_size + t % page_size
        kidx[b, :P] = s0 + t
        kidx[b, P:P + m] = S + r0 + np.arange(m)
        qidx[b, :m] = r0 + np.arange(m)
        out_idx[r0:r0 + m] = b * M + np.arange(m)
        i = np.arange(m)[:, None]
        j = np.arange(P + m)[None, :]
        hist = (j <= P + i) & (i < n)                        # history rows: causal over prefix + new history
        cand = (i >= n) & ((j < P + n) | (j == P + i))        # candidates: the history and themselves
        visible[b, :m, :P + m] = hist | cand
        pos_q[b, :m] = P + np.minimum(np.arange(m), n)
        pos_k[b, :P + m] = np.minimum(np.arange(P + m), P + n)
        s0 += P
        r0 += m
    as_t = (lambda a: torch.from_numpy(a).to(device))
    vis = as_t(visible)[:, None]
    plan = TorchPlan(B, M, K, page_size, as_t(k_slots), as_t(kidx.reshape(-1)), as_t(qidx.reshape(-1)),
                     as_t(out_idx), vis, ~vis, as_t(pos_q[:, :, None] - pos_k[:, None, :])[:, None])
    if ts_rows is not None:
        t_cached = ts_cache.view(-1)[as_t(k_slots // (2 * page_size) * page_size + k_slots % page_size)] \
            if S else ts_rows[:0]
        t_keys = torch.cat([t_cached, ts_rows]).index_select(0, plan.kidx)
        plan.t_q = ts_rows.index_select(0, plan.qidx).view(B, 1, M, 1)
        plan.t_k = t_keys.view(B, 1, 1, K)
    return plan


def planned_attention(plan: TorchPlan, q, k, v, kv_cache, mode: AttentionMode, scale: float, hstu_norm: float,
                      pos_bias=None, ts_bias=None, time_bucket: TimeBucket = TimeBucket.LOG2) -> torch.Tensor:
    """One layer's attention over ``plan``: ``q, k, v [R, H, D]``, ``kv_cache [num_pages, 2, page_size, H, D]``;
    ``time_bucket`` buckets ``ts_bias`` (:func:`relaygr_engine.ops.time_buckets`).

    Returns ``[R, H, D]`` in ``q``'s dtype (computed in it; fp32 rows give fp32 accumulation).
    """
    B, M, K = plan.B, plan.M, plan.K
    H, D = q.shape[1], q.shape[2]
    flat = kv_cache.view(-1, H, D)
    keys = torch.cat([flat.index_select(0, plan.k_slots), k]).index_select(0, plan.kidx).view(B, K, H, D)
    vals = torch.cat([flat.index_select(0, plan.k_slots + plan.page_size), v]).index_select(0, plan.kidx)
    qp = q.index_select(0, plan.qidx).view(B, M, H, D).transpose(1, 2)
    s = torch.matmul(qp, keys.permute(0, 2, 3, 1)).mul_(scale)               # [B, H, M, K]
    if mode is AttentionMode.SOFTMAX:
        a = torch.softmax(s.masked_fill_(plan.hidden, float("-inf")), dim=-1)
    else:
        if pos_bias is not None:
            s.add_(pos_bias[plan.distance(pos_bias.numel())])
        if ts_bias is not None:
            s.add_(ts_bias[plan.buckets(ts_bias.numel(), time_bucket)])
        a = F.silu(s, inplace=True).masked_fill_(plan.hidden, 0.0)
    o = torch.matmul(a, vals.view(B, K, H, D).transpose(1, 2))                 # [B, H, M, D]
    if mode is AttentionMode.HSTU:
        o.div_(hstu_norm)
    return o.transpose(1, 2).reshape(B * M, H, D).index_select(0, plan.out_idx)
