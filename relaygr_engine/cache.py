"""Device-resident paged prefix-KV storage paired with the block pool."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import quant
from ._ext import PrefixBlockPool
from .config import CacheConfig

__all__ = ["PagedKVCache"]


def _as_index(name: str, pages, num_pages: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(pages) if not isinstance(pages, torch.Tensor) else pages)
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 array of page ids, got {tuple(t.shape)} {t.dtype}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_pages):
        raise IndexError(f"{name} must hold page ids in [0, {num_pages}), got range "
                         f"[{int(t.min())}, {int(t.max())}]")
    return t.to(device=device, dtype=torch.long)


class PagedKVCache:
    """Per-layer paged K/V storage on one device, with a :class:`PrefixBlockPool` managing its pages.

    Layout (FlashInfer / NVIDIA HSTU "NHD"): layer ``l`` is ``kv[l]`` of shape
    ``[num_pages, 2, page_size, num_heads, head_dim]`` (index 0 = K, 1 = V). Token ``t`` of an entry whose pages are
    ``pages`` lives in page ``pages[t // page_size]``, slot ``t % page_size``. ``timestamps`` of shape
    ``[num_pages, page_size]`` (int64) holds each cached token's timestamp beside its KV (for time-aware biases).
    With an 8-bit ``kv_dtype``, ``kv[l]`` is ``uint8 [num_pages, 2, page_size + S, H, D]``: each page's K and V
    sections end in ``S`` slots holding the rows' fp32 scales (:mod:`relaygr_engine.quant`); :meth:`write`
    quantises and :meth:`gather` dequantises.

    Parameters
    ----------
    config : CacheConfig
    num_layers, num_heads, head_dim : int
        The model's attention shape.
    """

    def __init__(self, config: CacheConfig, num_layers: int, num_heads: int, head_dim: int) -> None:
        for name, v in (("num_layers", num_layers), ("num_heads", num_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.config = config
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.page_size = config.page_size
        self.device = torch.device(config.device)
        self.dtype = config.dtype                                   # what K/V are computed and read in
        self.kv_dtype = config.kv_dtype                             # how they are stored
        if self.kv_dtype.quantized and head_dim % quant.SCALE_BYTES:
            raise ValueError(f"kv_dtype={self.kv_dtype.value!r} needs head_dim a multiple of 4 (the fp32 scales "
                             f"stay aligned in the page), got head_dim={head_dim}")
        self.store_dtype = quant.storage_dtype(self.kv_dtype, self.dtype)
        self.num_pages = config.resolve_num_pages(num_layers, num_heads, head_dim)
        self.pool = PrefixBlockPool(self.num_pages, self.page_size, config.max_pinned_pages(self.num_pages))
        shape = quant.layer_shape(self.kv_dtype, self.num_pages, self.page_size, num_heads, head_dim)
        self.slots_per_page = shape[2]                              # page_size, plus the scale slots when 8-bit
        self.kv = [torch.zeros(shape, dtype=self.store_dtype, device=self.device) for _ in range(num_layers)]
        # The same storage as rows ``page * 2 * S + {0: K, S: V} + slot`` (``S = slots_per_page``): views made once,
        # so a layer's gathers and writes add no view op per call.
        self.kv_flat = [t.view(-1, num_heads, head_dim) for t in self.kv]
        self.timestamps = torch.zeros((self.num_pages, self.page_size), dtype=torch.long, device=self.device)
        self.device = self.timestamps.device  # "cuda" -> "cuda:<current>", so device checks compare equal

    @property
    def nbytes(self) -> int:
        """Device bytes held by the KV storage and timestamps."""
        return sum(t.numel() * t.element_size() for t in self.kv) + self.timestamps.numel() * 8

    def __repr__(self) -> str:
        return (f"PagedKVCache(device={self.device}, dtype={self.dtype}, kv_dtype={self.kv_dtype.value}, "
                f"layers={self.num_layers}, "
                f"heads={self.num_heads}, head_dim={self.head_dim}, pages={self.num_pages}x{self.page_size}, "
                f"bytes={self.nbytes}, pool={self.pool.implementation})")

    # ------------------------------------------------------------------ slot arithmetic
    def slots(self, pages, start: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids and in-page offsets of tokens ``start .. start+num_tokens-1`` of an entry.

        Returns
        -------
        page_idx, slot_idx : LongTensor [num_tokens] each, on the cache device.
        """
        p = _as_index("pages", pages, self.num_pages, self.device)
        if start < 0 or num_tokens < 0 or start + num_tokens > p.numel() * self.page_size:
            raise ValueError(f"tokens [{start}, {start + num_tokens}) do not fit in {p.numel()} pages of "
                             f"{self.page_size} tokens")
        t = torch.arange(start, start + num_tokens, device=self.device)
        return p[t // self.page_size], t % self.page_size

    # ------------------------------------------------------------------ writes and reads
    def _check_kv(self, name: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (self.num_heads, self.head_dim):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape [n, {self.num_heads}, {self.head_dim}], got {got}")
        if x.device != self.device:
            raise ValueError(f"{name} must be on {self.device}, got {x.device}")

    def write(self, layer: int, pages, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Store K and V ``[n, H, D]`` of tokens ``start .. start+n-1`` of the entry owning ``pages``."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}), got {layer}")
        self._check_kv("k", k)
        self._check_kv("v", v)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        page_idx, slot_idx = self.slots(pages, start, k.shape[0])
        buf = self.kv[layer]
        if self.kv_dtype.quantized:
            quant.store(buf, self.kv_dtype, self.page_size, page_idx, slot_idx, k, v)
            return
        buf[page_idx, 0, slot_idx] = k.to(self.dtype)
        buf[page_idx, 1, slot_idx] = v.to(self.dtype)

    def write_timestamps(self, pages, timestamps: torch.Tensor, start: int = 0) -> None:
        """Store integer timestamps ``[n]`` of tokens ``start .. start+n-1`` beside their KV (as int64)."""
        ts = torch.as_tensor(timestamps)
        if ts.dim() != 1 or ts.dtype.is_floating_point or ts.dtype.is_complex or ts.dtype == torch.bool:
            raise ValueError(f"timestamps must be a 1-D integer tensor, got {ts.dtype} of shape {tuple(ts.shape)}")
        page_idx, slot_idx = self.slots(pages, start, ts.shape[0])
        self.timestamps[page_idx, slot_idx] = ts.to(device=self.device, dtype=torch.long)

    def gather(self, layer: int, pages, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of the first ``num_tokens`` tokens' K and V, each ``[num_tokens, H, D]``."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be in [0, {self.num_layers}), got {layer}")
        page_idx, slot_idx = self.slots(pages, 0, num_tokens)
        buf = self.kv[layer]
        if self.kv_dtype.quantized:
            vals, sc = quant.values(buf, self.kv_dtype, self.page_size), quant.scales(buf, self.page_size)
            return tuple(quant.dequantize(vals[page_idx, i, slot_idx], sc[page_idx, i, slot_idx], self.dtype)
                         for i in (0, 1))
        return buf[page_idx, 0, slot_idx], buf[page_idx, 1, slot_idx]

    def gather_timestamps(self, pages, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` cached timestamps, int64 ``[num_tokens]``."""
        page_idx, slot_idx = self.slots(pages, 0, num_tokens)
        return self.timestamps[page_idx, slot_idx]

    # ------------------------------------------------------------------ contiguous copies (spill / reload)
    def _use_triton(self) -> bool:
        if self.device.type not in ("cuda", "npu"):
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    def pack(self, pages, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy an entry's pages of every layer into one contiguous buffer.

        Returns
        -------
        Tensor [num_layers, 2, len(pages) * slots_per_page, H, D] of ``store_dtype``
            The stored pages (8-bit values and their scales when quantised): ``out`` when given (it may live in
            pinned host memory: one device-to-host copy), else a new tensor on the cache device. Triton's
            ``kv_pack`` on CUDA/NPU, a torch gather elsewhere.
        """
        p = _as_index("pages", pages, self.num_pages, self.device)
        if self._use_triton():
            from .kernels.kv_pack import kv_pack
            return kv_pack(self.kv, p, out=out)
        from .kernels.reference import kv_pack_ref
        packed = kv_pack_ref(self.kv, p)
        if out is None:
            return packed
        out.copy_(packed)
        return out

    def unpack(self, buffer: torch.Tensor, pages) -> None:
        """Scatter a buffer made by :meth:`pack` (any device) into ``pages`` of every layer: one copy up."""
        p = _as_index("pages", pages, self.num_pages, self.device)
        shape = self.packed_shape(p.numel())
        if tuple(buffer.shape) != shape or buffer.dtype != self.store_dtype:
            raise ValueError(f"buffer must be {self.store_dtype} of shape {list(shape)}, got {buffer.dtype} "
                             f"{list(buffer.shape)}")
        if self._use_triton():
            from .kernels.kv_pack import kv_unpack
            kv_unpack(buffer, self.kv, p)
            return
        from .kernels.reference import kv_unpack_ref
        kv_unpack_ref(buffer.to(self.device, non_blocking=buffer.is_pinned()), self.kv, p)

    def packed_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of :meth:`pack`'s buffer for ``num_pages`` pages (its dtype is ``store_dtype``)."""
        return (self.num_layers, 2, num_pages * self.slots_per_page, self.num_heads, self.head_dim)

    def page_table(self, keys: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``kv_indptr [B+1]``, ``kv_indices [nnz]``, ``kv_last_page_len [B]`` as int32 tensors on the device."""
        indptr, indices, last = self.pool.page_table(keys)
        return tuple(torch.from_numpy(a).to(self.device) for a in (indptr, indices, last))
