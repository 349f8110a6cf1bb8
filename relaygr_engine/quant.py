"""8-bit K/V pages: the one definition of the quantised cache format (:class:`~relaygr_engine.config.KVDtype`).

A quantised layer is one ``uint8`` tensor ``[num_pages, 2, page_size + S, H, D]``. In each page, K (index 0) and V
(index 1) each hold ``page_size`` rows of ``D`` 8-bit values (slot ``t``, head ``h`` at ``[.., t, h, :]``, as in the
model-dtype layout), followed by ``S = ceil(4 * page_size / D)`` slots whose bytes hold the rows' fp32 scales,
slot-major (``[page_size, H]``). The scales live inside the page, so every copy that moves pages (DRAM spill and
reload, packing for a transfer, layer-wise onload) moves them with the values, the page budget counts them, and each
row of values still starts on a ``D``-byte boundary (16-byte aligned loads for ``D % 16 == 0``).

Scales are per token and head, not per page: a page fills over several requests (a prefix grows by extension), so a
page-wide scale fixed by its first tokens would clip later ones, or the page would have to be re-quantised; a row's
own scale needs neither and bounds each value's error by its own row's step. The cost is 4 bytes per row (1.6% at
head dim 256, 12.5% at 32).

* ``int8``: ``scale = amax / 127``, ``q = floor(x / scale + 0.5)`` in ``[-127, 127]`` (error <= scale / 2);
* ``fp8_e4m3``: ``scale = amax / 448``, ``q = x / scale`` rounded to e4m3 (relative error <= 2**-4).

A row of zeros has scale 1. The Triton kernel reads the same format (``KV8`` in
``relaygr_engine/kernels/_prefix_kernel.py``).
"""
from __future__ import annotations

import functools

import torch

from .config import SCALE_BYTES, KVDtype, env_flag, layer_shape, scale_slots, storage_dtype  # noqa: F401

__all__ = ["KERNEL_ENV", "QMAX", "SCALE_BYTES", "dequantize", "kernel_runs", "layer_shape", "load_pages", "quantize",
           "quantize_pages", "scale_slots", "scales", "storage_dtype", "store", "token_page_size", "value_dtype",
           "values"]

QMAX = {KVDtype.INT8: 127.0, KVDtype.FP8_E4M3: 448.0}  # the largest 8-bit magnitude used
KERNEL_ENV = "RELAYGR_KV8_KERNEL"


def kernel_runs(device: torch.device) -> bool:
    """Whether the Triton prefix-attention kernel reads 8-bit pages on ``device``: everywhere but CUDA (the
    interpreter runs int8 exactly), and on CUDA only with ``RELAYGR_KV8_KERNEL=1`` until the CUDA 8-bit tests pass
    on a GPU (``docs/kvquant.md``, "8-bit read on CUDA"). Where it does not, 8-bit pages attend through the torch
    path (:func:`relaygr_engine.attention.ops.paged_prefix_attention` says so once); the Triton KV write quantises them
    either way."""
    if device.type != "cuda":
        return True
    return env_flag(KERNEL_ENV)


def value_dtype(kv_dtype: KVDtype) -> torch.dtype:
    """The torch dtype of the 8-bit values (``int8`` or ``float8_e4m3fn``)."""
    return torch.int8 if kv_dtype is KVDtype.INT8 else torch.float8_e4m3fn


@functools.lru_cache(maxsize=256)
def token_page_size(kv_dtype: KVDtype, slots: int, head_dim: int) -> int:
    """The page size (tokens) of a layer tensor whose K/V sections have ``slots`` slots (the inverse of
    :func:`layer_shape`'s third dimension; ``page_size + ceil(4 * page_size / D)`` grows strictly)."""
    if not kv_dtype.quantized:
        return slots
    for page_size in range(slots, 0, -1):
        if page_size + scale_slots(kv_dtype, page_size, head_dim) == slots:
            return page_size
    raise ValueError(f"a {kv_dtype.value} cache with head_dim={head_dim} has no page size giving {slots} slots")


def values(layer: torch.Tensor, kv_dtype: KVDtype, page_size: int) -> torch.Tensor:
    """The 8-bit values of a quantised layer: a view ``[num_pages, 2, page_size, H, D]``."""
    return layer[:, :, :page_size].view(value_dtype(kv_dtype))


def scales(layer: torch.Tensor, page_size: int) -> torch.Tensor:
    """The fp32 scales of a quantised layer: a view ``[num_pages, 2, page_size, H]``."""
    P, _, slots, H, D = layer.shape
    start = page_size * H * D
    return layer.view(P, 2, slots * H * D)[:, :, start:start + SCALE_BYTES * page_size * H].view(
        torch.float32).view(P, 2, page_size, H)


def quantize(x: torch.Tensor, kv_dtype: KVDtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., D]`` (any float dtype) as 8-bit values ``[..., D]`` and fp32 scales ``[...]``."""
    qmax = QMAX[kv_dtype]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if kv_dtype is KVDtype.INT8:
        q = torch.floor(xf / scale + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = (xf / scale).clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """8-bit values ``[..., D]`` and their scales ``[...]`` as ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def store(layer: torch.Tensor, kv_dtype: KVDtype, page_size: int, pages: torch.Tensor, slots: torch.Tensor,
          k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantise rows ``k, v [n, H, D]`` into tokens (``pages[i]``, ``slots[i]``) of a quantised layer."""
    vals, sc = values(layer, kv_dtype, page_size), scales(layer, page_size)
    for i, x in ((0, k), (1, v)):
        q, s = quantize(x, kv_dtype)
        vals[pages, i, slots] = q
        sc[pages, i, slots] = s


def load_pages(layer: torch.Tensor, kv_dtype: KVDtype, page_size: int, pages: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole pages of a quantised layer, dequantised: ``[len(pages), page_size, H, D]`` each."""
    vals = values(layer, kv_dtype, page_size).index_select(0, pages)
    sc = scales(layer, page_size).index_select(0, pages)
    return dequantize(vals[:, 0], sc[:, 0], dtype), dequantize(vals[:, 1], sc[:, 1], dtype)


def quantize_pages(kv_cache: torch.Tensor, kv_dtype: KVDtype) -> torch.Tensor:
    """A whole layer ``kv_cache [num_pages, 2, page_size, H, D]`` in the model's dtype as a quantised layer (every
    slot of every page)."""
    P, _, ps, H, D = kv_cache.shape
    layer = torch.zeros(layer_shape(kv_dtype, P, ps, H, D), dtype=torch.uint8, device=kv_cache.device)
    ids = torch.arange(P * ps, device=kv_cache.device)
    store(layer, kv_dtype, ps, ids // ps, ids % ps, kv_cache[:, 0].reshape(-1, H, D), kv_cache[:, 1].reshape(-1, H, D))
    return layer
