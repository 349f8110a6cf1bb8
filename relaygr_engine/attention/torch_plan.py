"""The torch backend's plan for a relay forward: per-batch index tables that make each layer's attention a few
batched ops (padded users), instead of a per-user loop that rebuilds masks and biases in every layer.

Built on the host from the engine's own page table (no device read), once per forward; every layer reuses it.
Users are padded to ``M`` rows and ``K`` keys; a user's keys are its cached tokens, then its new rows (history,
then candidates), so a candidate's own key is among them and the mask admits it alone of the candidates.
Semantics are those of :func:`relaygr_engine.attention.ops.paged_prefix_attention` (the reference it is tested against).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import quant
from .._host import ship, to_device
from ..config import AttentionMode, KVDtype, TimeBucket
from .time_buckets import time_buckets

__all__ = ["MAX_PADDED_SCORES", "MAX_ROWS_X_KEYS", "TorchPlan", "build_torch_plan", "fits", "compiled_core",
           "planned_attention"]

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
    kv_slots : LongTensor [2 * S]
        Row of each cached token's K, then of each cached token's V, in a layer's cache viewed as
        ``[num_pages * 2 * page_size, H, D]``.
    kvidx : LongTensor [2 * B * K]
        Each padded key's row, then each padded value's row, in ``cat(cached K and V [2 S], new K [R], new V [R])``
        (padding: 0, masked out).
    qidx : LongTensor [B * M]
        Each padded query's batch row (padding: 0).
    out_idx : LongTensor [R]
        Each batch row's place in the padded ``[B * M]`` output.
    visible, hidden : BoolTensor [B, 1, M, K]
        Which padded (row, key) pairs attend (``[1, M, K]`` for one user), and the others.
    dist : LongTensor [B, 1, M, K]
        Position distance ``pos_q - pos_k`` (>= 0 where visible).
    t_q, t_k : LongTensor [B, 1, M, 1] and [B, 1, 1, K], optional
        Query and key times (the time-bias tables).
    mask_values : Tensor [2]
        ``[0, -BIG]``: the additive mask the HSTU bias gather ends with (``silu(-BIG)`` is exactly 0).
    scale_rows : LongTensor [2 * S], optional
        8-bit caches: the row of each cached K, then V, token's scales ``[H]`` in the layer's bytes viewed as fp32
        ``[-1, H]`` (:mod:`relaygr_engine.quant`: a section's scales follow its ``page_size`` value rows).
    """

    B: int
    M: int
    K: int
    kv_slots: torch.Tensor
    kvidx: torch.Tensor
    qidx: torch.Tensor
    out_idx: torch.Tensor
    visible: torch.Tensor
    hidden: torch.Tensor
    dist: torch.Tensor
    mask_values: torch.Tensor
    t_q: Optional[torch.Tensor] = None
    t_k: Optional[torch.Tensor] = None
    scale_rows: Optional[torch.Tensor] = None
    _cache: dict = field(default_factory=dict)

    def bias_index(self, pos_size: int, ts_size: int, time_bucket: TimeBucket = TimeBucket.LOG2,
                   outer: bool = False) -> torch.Tensor:
        """``[n, B, 1, M, K]`` (``[B, 1, M, K]`` for ``n = 1``) indices into
        ``cat(pos table [pos_size], time table [ts_size], mask_values)``.

        One row per table in use (``pos_size``/``ts_size`` 0: not used; none used: one row that only masks): the
        clamped position distance, the ``time_bucket`` bucket (offset by ``pos_size``), and ``-BIG`` wherever a key
        is hidden, so that ``table[index].sum(0)`` is the whole additive bias and mask of a layer in one gather.

        ``outer`` (both tables used): one row instead, into ``cat(outer sum [pos_size * ts_size], mask_values)``
        (:func:`bias_table`): ``distance * ts_size + bucket``, so one gather needs no sum.
        """
        key = (pos_size, ts_size, time_bucket, outer)
        idx = self._cache.get(key)
        if idx is not None:
            return idx
        if outer:
            idx = self.dist.clamp(0, pos_size - 1).mul_(ts_size).add_(time_buckets(self.t_q - self.t_k, ts_size,
                                                                                    time_bucket))
            idx = idx.masked_fill_(self.hidden, pos_size * ts_size + 1)
            self._cache[key] = idx = idx.view(1, self.M, self.K) if self.B == 1 else idx
            return idx
        rows = []
        if pos_size:
            rows.append(self.dist.clamp(0, pos_size - 1))
        if ts_size:
            rows.append(time_buckets(self.t_q - self.t_k, ts_size, time_bucket) + pos_size)
        zero = pos_size + ts_size  # index of mask_values[0]
        if not rows:
            rows.append(torch.full_like(self.dist, zero))
        idx = (torch.stack(rows) if len(rows) > 1 else rows[0]).masked_fill_(self.hidden, zero + 1)
        if self.B == 1:  # one user: [n, 1, M, K], which broadcasts over the heads of a 3-D product
            idx = idx.view(*idx.shape[:-4], 1, self.M, self.K)
        self._cache[key] = idx
        return idx


# Additive mask of a hidden (row, key) in the HSTU plan path: finite, so silu(x - BIG) = (x - BIG) * sigmoid(x - BIG)
# is exactly -0.0 for any finite score x of fp32/fp64 magnitude (the sigmoid underflows to 0).
_MASK_BIG = 1e30


def _tensors(arrays: list, device: torch.device) -> list:
    """Host arrays as tensors on ``device``: views on the CPU, one copy elsewhere
    (:func:`relaygr_engine._host.ship`)."""
    return ship([torch.from_numpy(np.ascontiguousarray(a)) for a in arrays], device)


@functools.lru_cache(maxsize=8)
def _mask_values(device: torch.device) -> torch.Tensor:
    return torch.tensor([0.0, -_MASK_BIG], device=device)


def fits(rows: Sequence[int], prefix_lens: Sequence[int], num_heads: int) -> bool:
    """Whether a batch (each user's rows and cached tokens) takes the plan path: some rows, at most
    :data:`MAX_ROWS_X_KEYS` padded (row, key) pairs per user and :data:`MAX_PADDED_SCORES` padded scores."""
    M = max(rows, default=0)
    K = max((p + m for p, m in zip(prefix_lens, rows)), default=0)
    return bool(len(rows) and M and M * K <= MAX_ROWS_X_KEYS and len(rows) * num_heads * M * K <= MAX_PADDED_SCORES)


def build_torch_plan(rows: Sequence[int], num_candidates: Sequence[int], prefix_lens: Sequence[int],
                     prefix_pages: Sequence[np.ndarray], page_size: int, num_heads: int, device: torch.device,
                     ts_rows: Optional[torch.Tensor] = None, ts_cache: Optional[torch.Tensor] = None,
                     slots_per_page: Optional[int] = None, head_dim: int = 0) -> Optional[TorchPlan]:
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
    slots_per_page, head_dim : int, optional
        An 8-bit cache: slots of a page's K (or V) section in the layer tensor (``page_size`` value rows, then the
        scales), and the head dim; the plan then also indexes the rows' scales (``scale_rows``).
    """
    if not fits(rows, prefix_lens, num_heads):
        return None
    B, M = len(rows), max(rows)
    K = max(p + m for p, m in zip(prefix_lens, rows))
    mPC = np.array([rows, prefix_lens, num_candidates], np.int64)                            # [3, B]: one copy
    m, P = mPC[0][:, None], mPC[1][:, None]                                                   # [B, 1]
    n = m - mPC[2][:, None]                                                                   # history rows
    S, R = int(mPC[1].sum()), int(mPC[0].sum())
    s0, r0 = np.cumsum(mPC[1]) - mPC[1], np.cumsum(mPC[0]) - mPC[0]                           # [B]
    # Cached token t of user b: page prefix_pages[b][t // page_size], slot t % page_size (users' tokens in order).
    if B == 1:
        t = np.arange(S)
        page = np.asarray(prefix_pages[0], np.int64)[t // page_size] if S else t
    else:
        t = np.arange(S) - np.repeat(s0, mPC[1])
        lens = np.fromiter((len(x) for x in prefix_pages), np.int64, B)
        page_of = np.concatenate(prefix_pages).astype(np.int64, copy=False) if S else np.zeros(0, np.int64)
        page = page_of[np.repeat(np.cumsum(lens) - lens, mPC[1]) + t // page_size] if S else t
    slot = t % page_size
    stride = slots_per_page or page_size
    k_slots = page * (2 * stride) + slot
    i, j = np.arange(M)[None, :], np.arange(K)[None, :]                                       # [1, M], [1, K]
    # Key j of user b in cat(cached K [S], cached V [S], new K [R], new V [R]): cached token j (j < P) at s0 + j,
    # else new row r0 + j - P at 2 S + r0 + j - P; its value S (cached) or R (new) rows further; padding 0.
    cached, valid = j < P, j < P + m
    kk = np.where(valid, j + np.where(cached, s0[:, None], 2 * S + r0[:, None] - P), 0)
    kvidx = np.concatenate([kk, np.where(valid, kk + np.where(cached, S, R), 0)]).reshape(-1)
    row = i < m                                                                              # [B, M]
    qidx = np.where(row, r0[:, None] + i, 0)
    out_idx = (np.arange(B)[:, None] * M + i)[row]
    # Row i (i < m) sees keys j < P + min(i + 1, n) (history: causal; candidate: the whole history) and its own
    # key P + i (a candidate sees itself, no other candidate); padded rows see nothing.
    own = P + i                                                                              # [B, M]
    visible = ((j[:, None, :] < (P + np.minimum(i + 1, n))[..., None]) | (j[:, None, :] == own[..., None]))
    visible &= row[..., None]                                                                # [B, M, K]
    dist = (P + np.minimum(i, n))[:, :, None] - np.minimum(j, P + n)[:, None, :]              # pos_q - pos_k
    shape = (1, M, K) if B == 1 else (B, 1, M, K)  # one user: broadcast over the heads of 3-D products
    plan = TorchPlan(B, M, K, *_tensors([np.concatenate([k_slots, k_slots + stride]), kvidx, qidx.reshape(-1),
                                         out_idx, visible.reshape(shape), ~visible[:, None], dist[:, None]], device),
                     _mask_values(device))
    if slots_per_page is not None:  # fp32 rows of H: a section is slots * D / 4 of them, its scales after ps * D / 4
        per = slots_per_page * head_dim // 4
        sc = page * (2 * per) + page_size * head_dim // 4 + slot
        plan.scale_rows = to_device(np.concatenate([sc, sc + per]), np.int64, device)
    if ts_rows is not None:
        kidx = np.where(valid & ~cached, kk - S, kk).reshape(-1)  # the key's row in cat(cached times, row times)
        if device.type == "cpu":  # tiny gathers: numpy on the host (no tensor op)
            rows_t = ts_rows.numpy()
            t_cached = ts_cache.numpy().reshape(-1)[page * page_size + slot] if S else rows_t[:0]
            t_keys = np.concatenate([t_cached, rows_t])[kidx]
            plan.t_q, plan.t_k = _tensors([rows_t[qidx].reshape(B, 1, M, 1), t_keys.reshape(B, 1, 1, K)], device)
        else:
            t_cached = ts_cache.view(-1)[to_device(page * page_size + slot, np.int64, device)] if S else ts_rows[:0]
            t_keys = torch.cat([t_cached, ts_rows]).index_select(0, to_device(kidx, np.int64, device))
            plan.t_q = ts_rows.index_select(0, plan.qidx).view(B, 1, M, 1)
            plan.t_k = t_keys.view(B, 1, 1, K)
    return plan


def planned_attention(plan: TorchPlan, q, k, v, flat_cache, mode: AttentionMode, scale: float, hstu_norm: float,
                      pos_bias=None, ts_bias=None, time_bucket: TimeBucket = TimeBucket.LOG2,
                      compiled: bool = False, kv_dtype: KVDtype = KVDtype.MODEL) -> torch.Tensor:
    """One layer's attention over ``plan``: ``q, k, v [R, H, D]``, ``flat_cache [num_pages * 2 * page_size, H, D]``
    (a layer's ``[num_pages, 2, page_size, H, D]`` cache viewed flat); ``time_bucket`` buckets ``ts_bias``
    (:func:`relaygr_engine.attention.ops.time_buckets`).

    ``compiled`` runs the tensor work through ``torch.compile`` (dynamic shapes; see :func:`compiled_core`).
    An 8-bit cache (``kv_dtype``; the plan built with its ``slots_per_page``) is gathered and dequantised first.
    Returns ``[R, H, D]`` in ``q``'s dtype (computed in it; fp32 rows give fp32 accumulation).
    """
    core = compiled_core() if compiled else _core
    shape = (plan.B, plan.M, plan.K)
    kv_slots = plan.kv_slots
    if kv_dtype.quantized:  # the cached rows, gathered and dequantised (the core then gathers nothing)
        vals = flat_cache.index_select(0, kv_slots).view(quant.value_dtype(kv_dtype))
        scales = flat_cache.view(-1).view(torch.float32).view(-1, q.shape[1]).index_select(0, plan.scale_rows)
        flat_cache, kv_slots = quant.dequantize(vals, scales, q.dtype), None
    if mode is AttentionMode.SOFTMAX:
        return core(q, k, v, flat_cache, kv_slots, plan.kvidx, plan.qidx, plan.out_idx, shape, scale,
                    mask=plan.visible)
    P, NB = (0 if t is None else t.numel() for t in (pos_bias, ts_bias))
    outer = 0 < P * NB <= MAX_OUTER_BIAS
    idx = plan.bias_index(P, NB, time_bucket, outer)
    return core(q, k, v, flat_cache, kv_slots, plan.kvidx, plan.qidx, plan.out_idx, shape, scale,
                bias_table=bias_table(pos_bias, ts_bias, plan.mask_values, outer), bias_index=idx,
                hstu_norm=hstu_norm)


# Largest outer-sum bias table (position distances x time buckets) a layer keeps: 64 Ki entries (256 KiB in fp32).
MAX_OUTER_BIAS = 1 << 16
_TABLES: dict = {}  # (id(pos), id(ts), outer) -> (pos, ts, their versions, table)


def _version(t: Optional[torch.Tensor]) -> Optional[int]:
    """The tensor's version counter (0 for None; None for an inference tensor, which has none)."""
    if t is None:
        return 0
    return None if t.is_inference() else t._version


def bias_table(pos_bias: Optional[torch.Tensor], ts_bias: Optional[torch.Tensor], mask_values: torch.Tensor,
               outer: bool) -> torch.Tensor:
    """The table a layer's :meth:`TorchPlan.bias_index` indexes: ``cat(pos_bias, ts_bias, mask_values)``, or with
    ``outer`` ``cat((pos_bias[:, None] + ts_bias[None, :]).flatten(), mask_values)`` (each entry the same single
    fp32 sum the gather-and-sum computes).

    Kept across forwards while both tables are the same tensors at the same version (a parameter edited in place
    or replaced makes a new one); tables without a version counter (inference tensors) are rebuilt every call.
    """
    key = (id(pos_bias), id(ts_bias), outer)
    versions = (_version(pos_bias), _version(ts_bias))
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is pos_bias and hit[1] is ts_bias and hit[2] == versions:
        return hit[3]
    if outer:
        table = torch.cat([(pos_bias[:, None] + ts_bias[None, :]).view(-1), mask_values])
    else:
        table = torch.cat([*(t for t in (pos_bias, ts_bias) if t is not None), mask_values])
    if None not in versions:
        if len(_TABLES) >= 256:
            _TABLES.clear()
        _TABLES[key] = (pos_bias, ts_bias, versions, table)
    return table


def _core(q, k, v, flat_cache, kv_slots, kvidx, qidx, out_idx, shape: tuple[int, int, int], scale: float, *,
          mask=None, bias_table=None, bias_index=None, hstu_norm: float = 1.0) -> torch.Tensor:
    """The tensor work of :func:`planned_attention` (index tables as in :class:`TorchPlan`): softmax under ``mask``
    when given, else HSTU with the additive ``bias_table[bias_index]`` (summed over its first dim when 5-D)."""
    B, M, K = shape
    H, D = q.shape[1], q.shape[2]
    cached = flat_cache if kv_slots is None else flat_cache.index_select(0, kv_slots)  # None: gathered already
    kv = torch.cat([cached, k, v]).index_select(0, kvidx)
    if B == 1:  # one user: its rows are the padded rows (no gather), 3-D products over the heads
        keys, vals = kv.view(2, K, H, D).transpose(1, 2).unbind(0)                # [H, K, D] each
        qp = q.transpose(0, 1)                                                   # [H, M, D]
        if mask is not None:
            o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, scale=scale)
        else:  # the bias add and the normaliser ride on the two baddbmm
            bias = bias_table[bias_index]
            if bias.dim() == 4:
                bias = bias.sum(0)                                               # [1, M, K]
            a = F.silu(torch.baddbmm(bias, qp, keys.transpose(1, 2), alpha=scale), inplace=True)
            zero = q.new_zeros(()) if torch.compiler.is_compiling() else _zero(q.device, q.dtype)
            o = torch.baddbmm(zero, a, vals, beta=0.0, alpha=1.0 / hstu_norm)
        return o.transpose(0, 1)
    keys, vals = kv.view(2, B, K, H, D).transpose(2, 3).unbind(0)              # [B, H, K, D] each
    qp = q.index_select(0, qidx).view(B, M, H, D).transpose(1, 2)              # [B, H, M, D]
    if mask is not None:
        o = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, scale=scale)
    else:
        bias = bias_table[bias_index]  # the cat promoted the tables' dtypes
        if bias.dim() == 5:
            bias = bias.sum(0)                                                   # [B, 1, M, K]
        a = F.silu(torch.add(bias, torch.matmul(qp, keys.transpose(2, 3)), alpha=scale), inplace=True)
        o = torch.matmul(a, vals).div_(hstu_norm)                                # [B, H, M, D]
    return o.transpose(1, 2).reshape(B * M, H, D).index_select(0, out_idx)


@functools.lru_cache(maxsize=8)
def _zero(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((), device=device, dtype=dtype)


@functools.cache
def compiled_core():
    """:func:`_core` through ``torch.compile(dynamic=True)`` (made once per process; each new combination of
    dtype, mode and single/batched compiles on first use, about a minute on a CPU)."""
    return torch.compile(_core, dynamic=True)
