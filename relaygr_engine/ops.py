"""Attention of new rows over a paged prefix KV cache: the one op every cached forward goes through.

``paged_prefix_attention`` takes, for a batch of users, the query/key/value rows that are computed now (each
user's new history tokens, then its candidates) and one layer's paged cache of the users' prefixes, and returns
each row's attention output. Three implementations share one signature:

* the pure-torch reference below (varlen: one user at a time, no padding), registered as the ``torch.library``
  custom op ``relaygr::paged_prefix_attention`` with a fake implementation for tracing (eager calls skip the
  dispatcher and run it directly; traced or compiled calls go through the op);
* the Triton kernel ``relaygr_engine.kernels.prefix_attention.prefix_attention`` (``backend="triton"``), loaded
  on first use;
* ``backend="auto"``: Triton on CUDA/NPU devices, the torch reference elsewhere.

Semantics (user ``b``)
----------------------
``P_b = (pages_b - 1) * page_size + kv_last_page_len[b]`` cached prefix tokens (0 without pages);
``n_b = (cu_seqlens_q[b+1] - cu_seqlens_q[b]) - num_candidates[b]`` new history tokens.

* Positions: prefix token ``j`` -> ``j``; new history token ``i`` -> ``P_b + i``; every candidate -> ``P_b + n_b``.
* Masks: new history token ``i`` sees the ``P_b`` prefix tokens and new history tokens ``0..i`` (causal); a
  candidate sees every prefix and new history token and itself, never another candidate.
* ``mode="softmax"``: ``out_i = softmax_j(scale * q_i.k_j) v_j`` over the visible keys (no bias).
* ``mode="hstu"``: ``out_i = sum_j SiLU(scale * q_i.k_j + rab_ij) v_j / hstu_norm`` over the visible keys, with
  ``rab_ij = pos_bias[min(pos_i - pos_j, len(pos_bias) - 1)] + ts_bias[time_bucket(t_i - t_j)]`` (each term
  only when its table is given). ``t_j`` of a cached token comes from ``ts_cache``, of a new row from ``ts_q``.

Keys of the cached tokens are read from ``kv_cache[page, 0, slot]``, values from ``kv_cache[page, 1, slot]``
(``page = kv_indices[kv_indptr[b] + t // page_size]``, ``slot = t % page_size``; FlashInfer's NHD layout).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import quant
from .config import AttentionBackend, AttentionMode, KVDtype, TimeBucket, parse_choice
from .kernels import _common
from .kernels.reference import time_bucket_ref

__all__ = ["AttentionMode", "TimeBucket", "max_time_buckets", "paged_prefix_attention", "paged_prefix_attention_torch",
           "plan_paged_attention", "time_bucket_bounds", "time_buckets"]

_log = logging.getLogger("relaygr_engine")

# Largest score block (heads x rows x keys) the torch reference materialises at once; bounds its memory at
# ~16 MiB per temporary while keeping matmuls large.
_MAX_BLOCK_ELEMS = 1 << 22
# Most history rows per block: a block computes the keys up to its last row, so smaller blocks skip more of the
# causal upper triangle (a fresh prefill of n tokens computes ~n**2/2 * (1 + block/n) scores) at a small fixed cost
# per block.
_HISTORY_BLOCK_ROWS = 256
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------------------------------- time buckets
# Most buckets a time-bias table may have: bit_length of an int64 is at most 63; the float functions' tables are
# bounded so that the kernel's search over the bucket steps stays short (Meta's STU encoder uses 2049).
MAX_LOG2_BUCKETS = 64
MAX_TIME_BUCKETS = 4096


def max_time_buckets(time_bucket) -> int:
    """Most buckets ``time_bucket`` may have (64 for ``"log2"``, else 4096)."""
    fn = parse_choice(TimeBucket, time_bucket, "time_bucket")
    return MAX_LOG2_BUCKETS if fn is TimeBucket.LOG2 else MAX_TIME_BUCKETS


def check_time_buckets(name: str, num_buckets, time_bucket) -> TimeBucket:
    """Parse ``time_bucket`` and check ``num_buckets`` against it (ValueError naming ``name``); returns the enum."""
    fn = parse_choice(TimeBucket, time_bucket, "time_bucket")
    top = max_time_buckets(fn)
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int) or not 1 <= num_buckets <= top:
        raise ValueError(f"{name} must be in [1, {top}] for time_bucket={fn.value!r}, got {num_buckets!r}")
    return fn


@functools.lru_cache(maxsize=64)
def _bounds(fn: TimeBucket, num_buckets: int) -> tuple[int, ...]:
    if fn is TimeBucket.LOG2:
        return tuple(1 << b for b in range(num_buckets - 1))
    # Smallest d >= 0 whose bucket (the definition, evaluated as published) is >= b, for b = 1 .. NB-1: a binary
    # search per b over [0, 2**62], all b at once. The definition is non-decreasing in d, so the steps are exact.
    want = torch.arange(1, num_buckets, dtype=torch.long)
    lo, hi = torch.zeros_like(want), torch.full_like(want, 1 << 62)
    never = time_bucket_ref(hi, num_buckets + 1, fn) < want
    for _ in range(63):
        mid = lo + (hi - lo) // 2
        ok = time_bucket_ref(mid, num_buckets + 1, fn) >= want
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid + 1)
    return tuple(torch.where(never, torch.full_like(hi, _INT64_MAX), hi).tolist())


@torch.compiler.assume_constant_result
def _bounds_constant(fn: TimeBucket, num_buckets: int) -> tuple[int, ...]:
    """:func:`_bounds`, which a compiler calls while tracing and keeps as a constant (it depends on its arguments
    only)."""
    return _bounds(fn, num_buckets)


@functools.lru_cache(maxsize=64)
def _bounds_on(fn: TimeBucket, num_buckets: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(_bounds(fn, num_buckets), dtype=torch.long, device=device)


def time_bucket_bounds(time_bucket, num_buckets: int, device=None) -> torch.Tensor:
    """The steps of a bucket function: ``bounds[b - 1]`` is the smallest ``d >= 0`` in bucket ``b`` or above.

    ``bucket(d) = #{b : bounds[b] <= d}`` (``|d|`` for ``"ln_0301"``), clamped to ``num_buckets - 1`` by the
    table's length. Buckets no int64 difference reaches get ``2**63 - 1``. Cached per function, size and device.

    Returns
    -------
    LongTensor [num_buckets - 1], non-decreasing.
    """
    fn = check_time_buckets("num_buckets", num_buckets, time_bucket)
    return _bounds_on(fn, num_buckets, torch.device("cpu") if device is None else torch.device(device))


def time_buckets(delta: torch.Tensor, num_buckets: int, time_bucket=TimeBucket.LOG2) -> torch.Tensor:
    """Bucket of a time difference under ``time_bucket`` (:class:`~relaygr_engine.config.TimeBucket`), clamped to
    ``num_buckets - 1``, in exact integers.

    ``"log2"`` (default): ``min(bit_length(max(delta, 0)), num_buckets - 1)``: ``bit_length(0) = 0``,
    ``bit_length(1) = 1``, ``bit_length(2..3) = 2``, ...: bucket ``b >= 1`` holds differences in
    ``[2**(b-1), 2**b)`` seconds; negative differences fall in bucket 0. The other functions count the steps of
    :func:`time_bucket_bounds`, equal to their float32 definitions.

    Parameters
    ----------
    delta : LongTensor [...]
        Time differences (int64, seconds).
    num_buckets : int
        Number of buckets ``NB``: ``[1, 64]`` for ``"log2"``, ``[1, 4096]`` otherwise.
    time_bucket : {"log2", "ln_0301", "sqrt_60"}

    Returns
    -------
    LongTensor [...] in ``[0, num_buckets)``.
    """
    fn = check_time_buckets("num_buckets", num_buckets, time_bucket)
    if delta.dtype != torch.long:
        raise ValueError(f"delta must be int64, got {delta.dtype}")
    if num_buckets == 1:
        return torch.zeros_like(delta)
    if torch.compiler.is_compiling():  # a constant of the graph
        bounds = torch.tensor(_bounds_constant(fn, num_buckets), dtype=torch.long, device=delta.device)
    else:
        bounds = _bounds_on(fn, num_buckets, delta.device)
    return torch.bucketize(delta.abs() if fn.absolute else delta, bounds, right=True)


# ---------------------------------------------------------------------------------------------------- reference
def _pos_toeplitz(pos_bias: torch.Tensor, q0: int, rows: int, nk: int) -> torch.Tensor:
    """``T[i, j] = pos_bias[clamp(q0 + i - j, 0, len(pos_bias) - 1)]``, ``[rows, nk]``.

    The distance matrix of a block of consecutive query positions is Toeplitz, so the table is looked up once per
    diagonal (``rows + nk - 1`` entries) and the matrix is a strided window over that vector (one copy, no gather).
    """
    # fr[a] = pos_bias[clamp(q0 + rows - 1 - a)], a = 0 .. rows + nk - 2 (distances in descending order)
    idx = torch.arange(q0 + rows - 1, q0 - nk, -1, device=pos_bias.device).clamp_(0, pos_bias.numel() - 1)
    fr = pos_bias.index_select(0, idx)
    # W[a, j] = fr[a + j] = pos_bias[clamp(q0 + rows - 1 - a - j)]; row i of T is row rows - 1 - i of W
    return fr.unfold(0, nk, 1).flip(0)


def _time_bias_sorted(ts_bias: torch.Tensor, t_q: torch.Tensor, t_k: torch.Tensor, fn: TimeBucket) -> torch.Tensor:
    """``ts_bias[time_bucket(t_q[i] - t_k[j])]`` ``[rows, nk]`` for non-decreasing key times ``t_k``.

    Along a row the time difference does not increase with ``j``, so its bucket is a run-length sequence of at most
    ``NB`` runs (highest bucket first). ``bucket(d) >= b`` (``b >= 1``) iff ``d >= bounds[b-1]`` iff
    ``t_k[j] <= t_q[i] - bounds[b-1]`` (:func:`time_bucket_bounds`): one ``searchsorted`` per row and bucket gives
    the run lengths, and the matrix is the table's values repeated by them (exact copies, no per-element bucketing
    or gather). Caller guarantees ``t_q - bounds[-1]`` does not overflow, and for an ``absolute`` function that no
    key the rows see is later than the row.
    """
    NB = ts_bias.numel()
    rows, nk = t_q.numel(), t_k.numel()
    if NB == 1:
        return ts_bias.expand(rows, nk).clone()
    thr = t_q[:, None] - _bounds_on(fn, NB, t_q.device)[None, :]            # [rows, NB-1]
    ge = torch.searchsorted(t_k, thr, right=True)                          # keys with bucket >= 1 .. NB-1
    ge = torch.cat([ge.new_full((rows, 1), nk), ge, ge.new_zeros((rows, 1))], dim=1)   # bucket >= 0 .. NB
    runs = (ge[:, :-1] - ge[:, 1:]).flip(1)                               # keys per bucket, NB-1 first
    vals = ts_bias.flip(0).expand(rows, NB).reshape(-1)
    return vals.repeat_interleave(runs.reshape(-1), output_size=rows * nk).view(rows, nk)


def _time_bias(ts_bias: torch.Tensor, t_q: torch.Tensor, t_k: torch.Tensor, keys_sorted: bool,
               fn: TimeBucket) -> torch.Tensor:
    """``ts_bias[time_bucket(t_q[i] - t_k[j])]`` ``[rows, nk]`` (run lengths when ``keys_sorted``, else buckets)."""
    if keys_sorted:
        return _time_bias_sorted(ts_bias, t_q, t_k, fn)
    b = time_buckets(t_q[:, None] - t_k[None, :], ts_bias.numel(), fn)
    return ts_bias.index_select(0, b.view(-1)).view(b.shape)


def _sorted_times(t_rows: torch.Tensor, t_keys: torch.Tensor, n: int, num_buckets: int, fn: TimeBucket) -> bool:
    """Whether the run-length time bias applies: key times non-decreasing, ``t - bounds[-1]`` cannot overflow and,
    for a function of ``|d|``, no candidate (rows ``n..``) is earlier than a key (history rows see earlier keys
    only)."""
    if t_keys.numel() > 1 and not bool((t_keys[1:] >= t_keys[:-1]).all()):
        return False
    if fn.absolute and t_keys.numel() and t_rows.numel() > n and int(t_rows[n:].min()) < int(t_keys[-1]):
        return False
    top = _bounds(fn, num_buckets)[-1] if num_buckets > 1 else 0
    return t_rows.numel() == 0 or int(t_rows.min()) >= _INT64_MIN + top


def _attend_history(qt, kt, vt, out, r0, r1, P, mode, norm, pos_bias, ts_bias, t_rows, t_keys, keys_sorted, fn):
    """History rows ``r0..r1-1`` (causal over prefix + new tokens); writes ``out[r0:r1]`` ``[rows, H, D]``.

    ``qt [H, m, D]`` is already multiplied by ``scale``; ``kt [H, D, P+n]``, ``vt [H, P+n, D]``. Row ``i`` of the
    block (position ``P + r0 + i``) sees keys ``0 .. P + r0 + i``: the keys beyond the block's last row are never
    computed and the rest of the upper triangle is cut with one ``tril``.
    """
    nk = P + r1  # keys visible to the block's last row
    rows = r1 - r0
    s = torch.matmul(qt[:, r0:r1], kt[:, :, :nk])  # [H, rows, nk]
    if mode is AttentionMode.SOFTMAX:
        hidden = torch.ones(rows, nk, dtype=torch.bool, device=s.device).triu_(P + r0 + 1)
        o = torch.matmul(torch.softmax(s.masked_fill_(hidden, float("-inf")), dim=-1), vt[:, :nk])
    else:
        rab = None
        if ts_bias is not None:
            rab = _time_bias(ts_bias, t_rows[r0:r1], t_keys[:nk], keys_sorted, fn)
        if pos_bias is not None:
            toe = _pos_toeplitz(pos_bias, P + r0, rows, nk)
            rab = toe if rab is None else rab.add_(toe)
        if rab is not None:
            s.add_(rab)
        a = F.silu(s, inplace=True).tril_(P + r0)
        o = torch.matmul(a, vt[:, :nk]).div_(norm)
    out[r0:r1] = o.transpose(0, 1)


def _attend_candidates(qt, kt, vt, q, k, v, out, c0, c1, mode, norm, rab, self_bias):
    """Candidate rows ``c0..c1-1``: all prefix + new history keys, plus each row's own key.

    ``qt [H, m, D]`` and ``q [m, H, D]`` are already multiplied by ``scale``; ``rab`` is the candidates' bias over
    the keys (``[nk]`` shared by all, or ``[c1 - c0, nk]``) or None; ``self_bias`` the terms of a candidate's bias
    to itself (distance 0, time bucket 0), added in order.
    """
    s = torch.matmul(qt[:, c0:c1], kt)  # [H, rows, nk]
    s_self = (q[c0:c1] * k[c0:c1]).sum(-1).transpose(0, 1)  # [H, rows]
    v_self = v[c0:c1].transpose(0, 1)  # [H, rows, D]
    if mode is AttentionMode.SOFTMAX:
        p = torch.softmax(torch.cat([s, s_self[..., None]], dim=-1), dim=-1)
        o = torch.matmul(p[..., :-1], vt).add_(p[..., -1:] * v_self)
    else:
        if rab is not None:
            s.add_(rab)
        for term in self_bias:
            s_self = s_self + term
        a = F.silu(s, inplace=True)
        o = torch.matmul(a, vt).add_(F.silu(s_self)[..., None] * v_self).div_(norm)
    out[c0:c1] = o.transpose(0, 1)


def _candidate_bias(nk, n, pos_bias, ts_bias, t_rows, t_keys, keys_sorted, fn):
    """Bias of the candidates (rows ``n..m-1``, all at position ``nk``) over the ``nk`` keys, and to themselves.

    Returns ``(rab, self_bias)``: ``rab`` is ``[nk]`` when every candidate has the same request time (or no time
    bias), else ``[m - n, nk]``, or None; ``self_bias`` is the list of bias terms of a candidate to itself.
    """
    rab, self_bias = None, []
    if pos_bias is not None:  # distance to key j is nk - j (>= 1); to itself 0
        idx = torch.arange(nk, 0, -1, device=pos_bias.device).clamp_(max=pos_bias.numel() - 1)
        rab = pos_bias.index_select(0, idx)
        self_bias.append(pos_bias[0])
    if ts_bias is not None:
        t_c = t_rows[n:]
        if bool((t_c == t_c[0]).all()):
            tb = _time_bias(ts_bias, t_c[:1], t_keys, keys_sorted, fn)[0]
        else:
            tb = _time_bias(ts_bias, t_c, t_keys, keys_sorted, fn)
        rab = tb if rab is None else rab + tb
        self_bias.append(ts_bias[0])
    return rab, self_bias


def paged_prefix_attention_torch(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q,
                                 num_candidates, mode, scale, hstu_norm=1.0, pos_bias=None, ts_bias=None,
                                 ts_cache=None, ts_q=None, time_bucket=TimeBucket.LOG2, kv_dtype=KVDtype.MODEL):
    """Pure-torch reference of :func:`paged_prefix_attention` (no input validation; see that function).

    Users are processed one after another. A user's cached K/V are gathered from its pages in one
    ``index_select`` per tensor into one buffer followed by its new rows' K/V. History rows go in blocks of at most
    ``_HISTORY_BLOCK_ROWS`` rows (and ``_MAX_BLOCK_ELEMS`` scores), each reading only the keys its last row can
    see; all candidates of a user go in one matmul against all its keys (memory permitting). HSTU biases are built
    without per-element gathers: the position bias of a block is a Toeplitz window over one vector; the time bias
    is a run-length expansion when the key timestamps are non-decreasing (the usual case: a behavior history),
    else bucketised per element. Accumulation is in fp32 (fp64 for fp64 inputs).

    Returns
    -------
    Tensor [total_q, H, D], dtype of ``q``.
    """
    mode, fn, kd = AttentionMode(mode), TimeBucket(time_bucket), KVDtype(kv_dtype)
    H, D = q.shape[1], q.shape[2]
    page_size = quant.token_page_size(kd, kv_cache.shape[2], D)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    cu = cu_seqlens_q.tolist()
    indptr = kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    ncand = num_candidates.tolist()
    hstu = mode is AttentionMode.HSTU
    pos_bias = pos_bias.to(acc) if hstu and pos_bias is not None else None
    ts_bias = ts_bias.to(acc) if hstu and ts_bias is not None else None
    qs = q.to(acc) * scale  # scaling q (rows) is cheaper than scaling the scores (rows x keys)
    ka, va = k.to(acc), v.to(acc)
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]  # [num_pages, page_size, H, D] views
    for b in range(len(ncand)):
        r0, r1 = cu[b], cu[b + 1]
        m = r1 - r0
        if m == 0:
            continue
        n = m - ncand[b]
        num_pages = indptr[b + 1] - indptr[b]
        P = (num_pages - 1) * page_size + last[b] if num_pages else 0
        qb, kb, vb = qs[r0:r1], ka[r0:r1], va[r0:r1]
        if num_pages:
            pages = kv_indices[indptr[b]:indptr[b + 1]].long()
            span = max(num_pages * page_size, P + n)
            keys = torch.empty((span, H, D), dtype=acc, device=q.device)
            vals = torch.empty((span, H, D), dtype=acc, device=q.device)
            kp = keys[:num_pages * page_size].view(num_pages, page_size, H, D)
            vp = vals[:num_pages * page_size].view(num_pages, page_size, H, D)
            if kd.quantized:  # 8-bit pages: dequantised once gathered
                kq, vq = quant.load_pages(kv_cache, kd, page_size, pages, acc)
                kp.copy_(kq)
                vp.copy_(vq)
            elif kv_cache.dtype == acc:
                torch.index_select(k_cache, 0, pages, out=kp)
                torch.index_select(v_cache, 0, pages, out=vp)
            else:
                kp.copy_(k_cache.index_select(0, pages))
                vp.copy_(v_cache.index_select(0, pages))
            keys[P:P + n] = kb[:n]  # the new rows follow the prefix (over the last page's unused slots)
            vals[P:P + n] = vb[:n]
            keys, vals = keys[:P + n], vals[:P + n]
        else:
            keys, vals = kb[:n], vb[:n]
        t_rows = t_keys = None
        keys_sorted = False
        if hstu and ts_bias is not None:  # timestamps of the rows [m] and of the keys [P + n]
            t_rows = ts_q[r0:r1]
            if num_pages:
                t_keys = torch.cat([ts_cache.index_select(0, pages).reshape(-1)[:P], t_rows[:n]])
            else:
                t_keys = t_rows[:n]
            keys_sorted = _sorted_times(t_rows, t_keys, n, ts_bias.numel(), fn)
        qt = qb.transpose(0, 1)  # [H, m, D]
        kt = keys.permute(1, 2, 0)  # [H, D, P + n]
        vt = vals.transpose(0, 1)  # [H, P + n, D]
        ob = out[r0:r1]
        mem_rows = max(1, _MAX_BLOCK_ELEMS // (H * max(1, P + n)))
        rows = min(mem_rows, _HISTORY_BLOCK_ROWS)
        for c0 in range(0, n, rows):
            _attend_history(qt, kt, vt, ob, c0, min(n, c0 + rows), P, mode, hstu_norm, pos_bias, ts_bias,
                            t_rows, t_keys, keys_sorted, fn)
        if m > n:
            rab, self_bias = None, []
            if hstu:
                rab, self_bias = _candidate_bias(P + n, n, pos_bias, ts_bias, t_rows, t_keys, keys_sorted, fn)
            for c0 in range(n, m, mem_rows):
                c1 = min(m, c0 + mem_rows)
                blk_rab = rab[c0 - n:c1 - n] if rab is not None and rab.dim() == 2 else rab
                _attend_candidates(qt, kt, vt, qb, kb, vb, ob, c0, c1, mode, hstu_norm, blk_rab, self_bias)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------------- custom op
@torch.library.custom_op("relaygr::paged_prefix_attention", mutates_args=())
def _paged_prefix_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, cu_seqlens_q: torch.Tensor,
    num_candidates: torch.Tensor, mode: str, scale: float, hstu_norm: float, pos_bias: Optional[torch.Tensor],
    ts_bias: Optional[torch.Tensor], ts_cache: Optional[torch.Tensor], ts_q: Optional[torch.Tensor],
    time_bucket: str = "log2", kv_dtype: str = "model",
) -> torch.Tensor:
    return paged_prefix_attention_torch(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q,
                                        num_candidates, mode, scale, hstu_norm, pos_bias, ts_bias, ts_cache, ts_q,
                                        time_bucket, kv_dtype)


@_paged_prefix_attention_op.register_fake
def _(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates, mode, scale,
      hstu_norm, pos_bias, ts_bias, ts_cache, ts_q, time_bucket="log2", kv_dtype="model"):
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------------- validation
def _tensor(name: str, x, dims: int, device: torch.device, dtype=None, floating: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {x.dtype}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} (the device of q), got {x.device}")
    return x


def _check_args(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates, mode,
                scale, hstu_norm, pos_bias, ts_bias, ts_cache, ts_q, *, read_tables: bool = True,
                time_bucket=TimeBucket.LOG2, kv_dtype=KVDtype.MODEL) -> None:
    """Raise ValueError naming the first bad argument (expected vs actual).

    The page table and row layout go through :func:`relaygr_engine.kernels._common.check_page_table`, the check
    the Triton kernel's plan runs too. ``read_tables=False`` skips their values (the one device-to-host read), for
    a caller whose :func:`plan_paged_attention` plan was built from these same tensors and checked them already.
    """
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    _tensor("q", q, 3, dev, floating=True)
    for name, x in (("k", k), ("v", v)):
        _tensor(name, x, 3, dev, dtype=q.dtype)
        if x.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(x.shape)}")
    total, H, D = q.shape
    kd = KVDtype(kv_dtype)
    _tensor("kv_cache", kv_cache, 5, dev, dtype=quant.storage_dtype(kd, q.dtype))
    slots = "page_size" if not kd.quantized else "page_size + ceil(4 * page_size / D)"
    if kv_cache.shape[1] != 2 or tuple(kv_cache.shape[3:]) != (H, D) or kv_cache.shape[2] < 1:
        raise ValueError(f"kv_cache must have shape [num_pages, 2, {slots}, {H}, {D}] (kv_dtype={kd.value!r}), "
                         f"got {tuple(kv_cache.shape)}")
    num_pages, page_size = kv_cache.shape[0], quant.token_page_size(kd, kv_cache.shape[2], D)
    _common.check_page_table(cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len, device=dev,
                             num_pages=num_pages, page_size=page_size, total_q=total, read=read_tables)
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not (isinstance(hstu_norm, (int, float)) and not isinstance(hstu_norm, bool) and math.isfinite(hstu_norm)
            and hstu_norm > 0):
        raise ValueError(f"hstu_norm must be a finite number > 0, got {hstu_norm!r}")
    if mode is AttentionMode.SOFTMAX:
        if pos_bias is not None or ts_bias is not None:
            raise ValueError("pos_bias and ts_bias apply to mode='hstu' only; got a bias with mode='softmax'")
        return
    if pos_bias is not None:
        _tensor("pos_bias", pos_bias, 1, dev, floating=True)
        if pos_bias.numel() < 1:
            raise ValueError("pos_bias must have at least 1 entry, got 0")
    if ts_bias is not None:
        _tensor("ts_bias", ts_bias, 1, dev, floating=True)
        top = max_time_buckets(time_bucket)
        if not 1 <= ts_bias.numel() <= top:
            raise ValueError(f"ts_bias must have 1..{top} entries (time buckets of {TimeBucket(time_bucket).value!r}), "
                             f"got {ts_bias.numel()}")
        if ts_q is None:
            raise ValueError("ts_q (timestamps of the query rows) is required with ts_bias")
        _tensor("ts_q", ts_q, 1, dev, dtype=torch.long)
        if ts_q.numel() != total:
            raise ValueError(f"ts_q must have {total} entries (rows of q), got {ts_q.numel()}")
        if kv_indices.numel():
            if ts_cache is None:
                raise ValueError("ts_cache (timestamps of cached tokens) is required with ts_bias and cached pages")
            _tensor("ts_cache", ts_cache, 2, dev, dtype=torch.long)
            if tuple(ts_cache.shape) != (num_pages, page_size):
                raise ValueError(f"ts_cache must have shape [{num_pages}, {page_size}], got {tuple(ts_cache.shape)}")


# ---------------------------------------------------------------------------------------------------- entry point
def _triton_impl():
    try:
        from .kernels.prefix_attention import prefix_attention
    except ImportError as exc:
        raise ImportError(
            "backend='triton' needs relaygr_engine.kernels.prefix_attention.prefix_attention, which failed to import "
            f"({type(exc).__name__}: {exc}); install Triton or use backend='torch'") from exc
    return prefix_attention


def plan_paged_attention(kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates, *,
                         backend="auto", kv_dtype="model"):
    """The Triton kernel's schedule of one batch, built once for all layers; ``None`` where ``backend`` resolves to
    the torch reference (which needs none).

    Pass the result as ``plan=`` to :func:`paged_prefix_attention` for every layer of the forward: the layers then
    launch without reading anything back from the device. See
    :func:`relaygr_engine.kernels.prefix_attention.plan_prefix_attention`.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if _resolve_backend(backend, kv_cache.device) is not AttentionBackend.TRITON:
        return None
    from .kernels.prefix_attention import plan_prefix_attention
    return plan_prefix_attention(cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len,
                                 kv_cache=kv_cache, kv_dtype=kv_dtype)


def _resolve_backend(backend, device: torch.device) -> AttentionBackend:
    b = parse_choice(AttentionBackend, backend, "backend")
    if b is not AttentionBackend.AUTO:
        return b
    if device.type in ("cuda", "npu"):
        try:
            _triton_impl()
            return AttentionBackend.TRITON
        except ImportError as exc:
            _warn_once(f"backend='auto' on {device.type}: Triton kernel unavailable ({exc}); using the torch reference")
    return AttentionBackend.TORCH


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    _log.warning(message)


def paged_prefix_attention(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates,
                           *, mode, scale, hstu_norm=1.0, pos_bias=None, ts_bias=None, ts_cache=None, ts_q=None,
                           time_bucket="log2", backend="torch", plan=None, kv_dtype="model"):
    """Attention of each user's new history rows and candidates over its cached prefix pages and its new rows.

    See the module docstring for the exact positions, masks and formulas.

    Parameters
    ----------
    q, k, v : Tensor [total_q, H, D]
        Per user, its new history tokens then its candidates, user after user; ``k``/``v`` are those rows' K/V.
    kv_cache : Tensor [num_pages, 2, page_size, H, D]
        One layer's paged cache (index 0 = K, 1 = V); same dtype and device as ``q``. With an 8-bit ``kv_dtype``:
        ``uint8 [num_pages, 2, page_size + S, H, D]``, values and their fp32 scales (:mod:`relaygr_engine.quant`).
    kv_indptr : int32 [B+1]
        Page offsets of each user into ``kv_indices``.
    kv_indices : int32 [nnz]
        Page ids, user after user, in token order.
    kv_last_page_len : int32 [B]
        Tokens in the user's last page (1..page_size); 0 when it has no cached prefix.
    cu_seqlens_q : int32 [B+1]
        Row offsets of each user's segment in ``q``.
    num_candidates : int32 [B]
        The last ``num_candidates[b]`` rows of user ``b``'s segment are candidates.
    mode : {"softmax", "hstu"}
    scale : float
        softmax: logit scale (typically ``1/sqrt(D)``); hstu: ``alpha`` in ``SiLU(alpha * q.k + rab)``.
    hstu_norm : float
        hstu: the sum over keys is divided by this constant (the model's ``max_seq_len``), never by the row length.
    pos_bias : Tensor [P], optional
        hstu: bias by position distance ``q_pos - k_pos`` (clamped to ``P - 1``), shared across heads.
    ts_bias : Tensor [NB], optional
        hstu: bias by :func:`time_buckets` of ``t_q - t_k``, shared across heads. Needs ``ts_q`` and, when any user
        has cached pages, ``ts_cache``.
    ts_cache : LongTensor [num_pages, page_size], optional
        Timestamps of the cached tokens, beside the pages.
    ts_q : LongTensor [total_q], optional
        Timestamps of the query rows (a candidate's is the request time). A user's candidates share one query
        time, as every ``RelayBatch`` builds them: the Triton kernel reads the user's first candidate's (its
        candidate tiles compute the time bias once per key), the torch reference each row's.
    time_bucket : {"log2", "ln_0301", "sqrt_60"}
        hstu: the bucket function of ``ts_bias`` (:class:`~relaygr_engine.config.TimeBucket`; ``NB <= 64`` for
        ``"log2"``, ``<= 4096`` otherwise).
    backend : {"torch", "triton", "auto"}
        ``"torch"``: the pure-torch reference (any device; through the ``relaygr::paged_prefix_attention``
        custom op when traced or compiled, called directly in eager mode);
        ``"triton"``: ``relaygr_engine.kernels.prefix_attention.prefix_attention``; ``"auto"``: Triton on CUDA/NPU
        when it imports, torch otherwise.
    plan : PrefixAttentionPlan, optional
        The batch's Triton schedule from :func:`plan_paged_attention`, reused across layers (Triton backend only;
        the torch reference ignores it).
    kv_dtype : {"model", "fp8_e4m3", "int8"}
        How ``kv_cache`` stores K/V (:class:`~relaygr_engine.config.KVDtype`); cached rows are dequantised on load,
        the new rows ``k``/``v`` attend at full precision.

    Returns
    -------
    Tensor [total_q, H, D]
        dtype of ``q``; accumulation in fp32.

    Raises
    ------
    ValueError
        On a bad shape, dtype (tables must be int32, timestamps int64), device, offset table or choice string.
        Validation reads the small int tables on the host (one sync on GPU).
    ImportError
        ``backend="triton"`` when the Triton kernel module cannot be imported.
    """
    mode = parse_choice(AttentionMode, mode, "mode")
    be = parse_choice(AttentionBackend, backend, "backend")
    fn = parse_choice(TimeBucket, time_bucket, "time_bucket")
    kd = parse_choice(KVDtype, kv_dtype, "kv_dtype")
    _check_args(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates, mode,
                scale, hstu_norm, pos_bias, ts_bias, ts_cache, ts_q, time_bucket=fn, kv_dtype=kd)
    return _dispatch(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates,
                     mode, scale, hstu_norm, pos_bias, ts_bias, ts_cache, ts_q, be, plan=plan, time_bucket=fn,
                     kv_dtype=kd)


def _eager(q: torch.Tensor) -> bool:
    """True for plain eager tensors outside tracing: the custom op's dispatcher layers then add only overhead."""
    return type(q) is torch.Tensor and q.device.type != "meta" and not torch.compiler.is_compiling()


def _dispatch(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates, mode,
              scale, hstu_norm, pos_bias, ts_bias, ts_cache, ts_q, backend, plan=None, time_bucket=TimeBucket.LOG2,
              kv_dtype=KVDtype.MODEL):
    """:func:`paged_prefix_attention` after validation (``mode`` an :class:`AttentionMode`, ``backend`` parsed,
    ``time_bucket`` a :class:`TimeBucket`).

    Callers that already validated the same page table and row layout (e.g. the layers of one forward after the
    first) call this directly. The torch backend runs the reference directly in eager mode (the registered
    ``relaygr::paged_prefix_attention`` op computes the same thing) and goes through the op when traced or
    compiled, so graphs see one opaque op with a fake implementation.
    """
    be = _resolve_backend(backend, q.device)
    if mode is AttentionMode.SOFTMAX or ts_bias is None:
        ts_cache = ts_q = None  # unused: keep them out of the kernels
    if be is AttentionBackend.TRITON:  # the kernel takes dense rows (q/k/v are often views of one projection)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return _triton_impl()(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q,
                              num_candidates, mode=mode.value, scale=float(scale), hstu_norm=float(hstu_norm),
                              pos_bias=pos_bias, ts_bias=ts_bias, ts_cache=ts_cache, ts_q=ts_q, plan=plan,
                              time_bucket=time_bucket.value, kv_dtype=kv_dtype.value)
    if _eager(q):
        return paged_prefix_attention_torch(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                                            cu_seqlens_q, num_candidates, mode, float(scale), float(hstu_norm),
                                            pos_bias, ts_bias, ts_cache, ts_q, time_bucket, kv_dtype)
    return torch.ops.relaygr.paged_prefix_attention(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                                                    cu_seqlens_q, num_candidates, mode.value, float(scale),
                                                    float(hstu_norm), pos_bias, ts_bias, ts_cache, ts_q,
                                                    time_bucket.value, kv_dtype.value)
