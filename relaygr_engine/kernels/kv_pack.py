"""Copy a set of pages (all layers) to one contiguous buffer and back.

A spill of a prefix to host DRAM, or its transfer to another instance, is then one large copy of the buffer instead
of one small copy per page and layer (each small copy pays a fixed launch/handshake cost).

Buffer layout
-------------
``buffer[L, 2, n * page_size, H, D]`` for ``n = len(page_ids)``: layer ``l``, K (0) or V (1), then the pages' tokens
in ``page_ids`` order, ``page_ids[i]``'s slot ``s`` at token ``i * page_size + s``. Whole pages are copied (slots past
a prefix's last token included). For the pages of one prefix in token order, ``buffer[l, 0, :num_tokens]`` is that
layer's K as a contiguous ``[num_tokens, H, D]`` tensor, and each layer's slice is contiguous, so a reload can be
issued layer by layer. Timestamps (``[num_pages, page_size]`` beside the pages) are small: copy them with
``ts_cache[page_ids]``.

A page's K (or V) is ``page_size * H * D`` contiguous elements both in the cache and in the buffer, so the kernel is
a blocked 1-D copy of ``2 * n`` such runs per layer; one launch per layer (the layers are separate tensors).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import _common as C

__all__ = ["kv_pack", "kv_unpack", "packed_shape"]


@triton.jit(do_not_specialize=["num_sel", "num_work", "num_programs"])  # per copy (see prefix_attention)
def _page_copy_kernel(
    cache_ptr,                              # one layer: [num_pages, 2, PAGE_NUMEL]
    buf_ptr,                                # that layer's slice of the buffer: [2, n, PAGE_NUMEL]
    page_ids_ptr,                           # [n] int64
    num_sel, chunks_per_page, num_work, num_programs, stride_page, stride_kv,
    PAGE_NUMEL: tl.constexpr, BLOCK: tl.constexpr, PACK: tl.constexpr,
):
    pid = tl.program_id(0)
    for work in range(pid, num_work, num_programs):
        run = work // chunks_per_page       # run = kv * n + i: K or V of the i-th selected page
        chunk = work % chunks_per_page
        kv = run // num_sel
        page = tl.load(page_ids_ptr + run % num_sel).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < PAGE_NUMEL
        src = cache_ptr + page * stride_page + kv * stride_kv + offs
        dst = buf_ptr + run.to(tl.int64) * PAGE_NUMEL + offs
        if PACK:
            tl.store(dst, tl.load(src, mask=mask), mask=mask)
        else:
            tl.store(src, tl.load(dst, mask=mask), mask=mask)


BLOCK_DEVICE = 4096
BLOCK_INTERPRETER = 2048


def packed_shape(kv_caches: Sequence[torch.Tensor], num_pages: int) -> tuple[int, ...]:
    """Shape of the buffer holding ``num_pages`` pages of every layer: ``(L, 2, num_pages * page_size, H, D)``."""
    _, _, page_size, h, d = kv_caches[0].shape
    return (len(kv_caches), 2, num_pages * page_size, h, d)


def _check_caches(kv_caches) -> torch.Tensor:
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise ValueError("kv_caches must be a non-empty list of per-layer tensors [num_pages, 2, page_size, H, D], "
                         f"got {C.describe(kv_caches)}")
    first = C.check_tensor("kv_caches[0]", kv_caches[0], ndim=5, dtypes=C.FLOAT_DTYPES)
    if first.shape[1] != 2:
        raise ValueError(f"kv_caches[0] must have shape [num_pages, 2, page_size, H, D], got {list(first.shape)}")
    for i, c in enumerate(kv_caches[1:], 1):
        C.check_tensor(f"kv_caches[{i}]", c, shape=tuple(first.shape), dtypes=(first.dtype,), device=first.device)
    C.check_launchable(first.device, _page_copy_kernel)
    if first.device.type == "cpu" and first.dtype != torch.float32:
        raise ValueError("the CPU interpreter runs fp32 only (numpy has no bf16)")
    return first


def _copy(kv_caches, buffer: torch.Tensor, ids: torch.Tensor, pack: bool, persistent: bool) -> None:
    first = kv_caches[0]
    device = first.device
    n = ids.numel()
    if n == 0:
        return
    page_numel = first[0, 0].numel()
    block = min(BLOCK_INTERPRETER if C.is_interpreted(_page_copy_kernel) else BLOCK_DEVICE, C.next_pow2(page_numel))
    chunks = C.cdiv(page_numel, block)
    num_work = 2 * n * chunks
    programs = C.num_programs(device, num_work, persistent)
    with C.device_guard(device):
        for layer, cache in enumerate(kv_caches):
            _page_copy_kernel[(programs,)](
                cache, buffer[layer], ids, n, chunks, num_work, programs, cache.stride(0), cache.stride(1),
                PAGE_NUMEL=page_numel, BLOCK=block, PACK=pack)


def kv_pack(kv_caches: Sequence[torch.Tensor], page_ids, *, out: Optional[torch.Tensor] = None,
            persistent: bool = False) -> torch.Tensor:
    """Pack pages ``page_ids`` of every layer into one contiguous buffer (layout in the module docstring).

    Parameters
    ----------
    kv_caches : list of Tensor [num_pages, 2, page_size, H, D]
        The layers' caches: one shape, dtype and device.
    page_ids : sequence or 1-D int Tensor [n]
        Pages to copy, in buffer order (a prefix's pages in token order).
    out : Tensor [L, 2, n * page_size, H, D], optional
        Where to write: on the cache device (packed in place), or on another device such as pinned host memory
        (packed on the cache device, then moved by one copy, non-blocking from pinned memory).
    persistent : bool
        One program per core, each looping over chunks.

    Returns
    -------
    Tensor [L, 2, n * page_size, H, D]
        ``out`` if given, else a new tensor on the cache device.
    """
    first = _check_caches(kv_caches)
    ids = C.as_page_ids("page_ids", page_ids, first.shape[0], first.device, unique=False)
    shape = packed_shape(kv_caches, ids.numel())
    if out is not None:
        C.check_tensor("out", out, shape=shape, dtypes=(first.dtype,))
        if out.device != first.device:
            packed = kv_pack(kv_caches, ids, persistent=persistent)
            out.copy_(packed, non_blocking=out.is_pinned())
            return out
    buffer = out if out is not None else torch.empty(shape, dtype=first.dtype, device=first.device)
    _copy(kv_caches, buffer, ids, pack=True, persistent=persistent)
    return buffer


def kv_unpack(buffer: torch.Tensor, kv_caches: Sequence[torch.Tensor], page_ids, *,
              persistent: bool = False) -> None:
    """Scatter a packed buffer back into pages ``page_ids`` of every layer (in place; inverse of :func:`kv_pack`).

    Parameters
    ----------
    buffer : Tensor [L, 2, n * page_size, H, D]
        As :func:`kv_pack` returns; on another device (e.g. host) it is first moved by one copy.
    kv_caches : list of Tensor [num_pages, 2, page_size, H, D]
    page_ids : sequence or 1-D int Tensor [n]
        Destination pages, distinct.
    persistent : bool
    """
    first = _check_caches(kv_caches)
    ids = C.as_page_ids("page_ids", page_ids, first.shape[0], first.device, unique=True)
    C.check_tensor("buffer", buffer, shape=packed_shape(kv_caches, ids.numel()), dtypes=(first.dtype,))
    if buffer.device != first.device:
        buffer = buffer.to(first.device, non_blocking=buffer.is_pinned())
    _copy(kv_caches, buffer, ids, pack=False, persistent=persistent)
