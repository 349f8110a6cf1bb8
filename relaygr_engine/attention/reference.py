"""The pure-torch reference of :func:`relaygr_engine.attention.ops.paged_prefix_attention` and the custom op around it.

``paged_prefix_attention_torch`` computes the op's semantics (see :mod:`relaygr_engine.attention.ops`) one user at a
time, without padding; it is registered as the ``torch.library`` custom op ``relaygr::paged_prefix_attention`` with a
fake implementation for tracing. The helpers below build its score blocks and HSTU biases.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import quant
from ..config import AttentionMode, KVDtype, TimeBucket
from .time_buckets import _bounds, _bounds_on, time_buckets

# Largest score block (heads x rows x keys) the torch reference materialises at once; bounds its memory at
# ~16 MiB per temporary while keeping matmuls large.
_MAX_BLOCK_ELEMS = 1 << 22
# Most history rows per block: a block computes the keys up to its last row, so smaller blocks skip more of the
# causal upper triangle (a fresh prefill of n tokens computes ~n**2/2 * (1 + block/n) scores) at a small fixed cost
# per block.
_HISTORY_BLOCK_ROWS = 256
_INT64_MIN = -(1 << 63)


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
    """Pure-torch reference of :func:`~relaygr_engine.attention.ops.paged_prefix_attention` (no input validation; see
    that function).

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
