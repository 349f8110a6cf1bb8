"""Argument checks of :func:`relaygr_engine.attention.ops.paged_prefix_attention`: each raises ValueError naming the
first bad argument (expected vs actual)."""
from __future__ import annotations

import math

import torch

from .. import quant
from ..config import AttentionMode, KVDtype, TimeBucket
from ..kernels import _common
from .time_buckets import max_time_buckets


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
    a caller whose :func:`~relaygr_engine.attention.ops.plan_paged_attention` plan was built from these same tensors and
    checked them already.
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

