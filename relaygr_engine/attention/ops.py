"""Attention of new rows over a paged prefix KV cache: the one op every cached forward goes through.

``paged_prefix_attention`` takes, for a batch of users, the query/key/value rows that are computed now (each
user's new history tokens, then its candidates) and one layer's paged cache of the users' prefixes, and returns
each row's attention output. Three implementations share one signature:

* the pure-torch reference (:mod:`relaygr_engine.attention.reference`; varlen: one user at a time, no padding),
  registered as the ``torch.library`` custom op ``relaygr::paged_prefix_attention`` with a fake implementation for
  tracing (eager calls skip the dispatcher and run it directly; traced or compiled calls go through the op);
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

import logging

import torch

from .. import quant
from .._warn import warn_once
from .checks import _check_args
from ..kernels._common import with_dense_rows
from ..config import AttentionBackend, AttentionMode, KVDtype, TimeBucket, parse_choice
from .reference import paged_prefix_attention_torch
from .time_buckets import (MAX_LOG2_BUCKETS, MAX_TIME_BUCKETS, check_time_buckets,  # noqa: F401 (re-exported)
                             max_time_buckets, time_bucket_bounds, time_buckets)

__all__ = ["AttentionMode", "TimeBucket", "max_time_buckets", "paged_prefix_attention", "paged_prefix_attention_torch",
           "plan_paged_attention", "time_bucket_bounds", "time_buckets"]

_log = logging.getLogger("relaygr_engine")


# ---------------------------------------------------------------------------------------------------- entry point
def _triton_impl():
    try:
        from ..kernels.prefix_attention import prefix_attention
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
    from ..kernels.prefix_attention import plan_prefix_attention
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
            warn_once(_log, ("ops", "auto-backend", device.type), "backend='auto' on %s: Triton kernel unavailable "
                      "(%s); using the torch reference", device.type, exc)
    return AttentionBackend.TORCH


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
    if be is AttentionBackend.TRITON and kv_dtype.quantized and not quant.kernel_runs(q.device):
        warn_once(_log, ("ops", "kv8-torch", q.device.type), "kv_dtype=%r on %s: attention reads the 8-bit pages "
                  "through the torch path (the Triton kernel's 8-bit read is off there until it passes on a GPU: "
                  "relaygr_engine.quant.kernel_runs)", kv_dtype.value, q.device.type)
        be = AttentionBackend.TORCH
    if mode is AttentionMode.SOFTMAX or ts_bias is None:
        ts_cache = ts_q = None  # unused: keep them out of the kernels
    if be is AttentionBackend.TRITON:  # the kernel takes dense rows at any stride: views of one projection as they are
        q, k, v = map(with_dense_rows, (q, k, v))
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
