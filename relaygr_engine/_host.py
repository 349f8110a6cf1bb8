"""Host tensors to the device: no op on the CPU, one pinned non-blocking copy elsewhere.

The hot path builds its index tables and batch rows on the host. On a CUDA device a plain ``tensor.to(device)``
from pageable memory synchronises the stream; here every copy is staged in pinned memory from torch's caching host
allocator (which keeps a block until the copies reading it have finished) and issued non-blocking, so building a
batch never waits for the device.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["to_device", "ship"]

_ALIGN = 16  # bytes: every dtype's alignment


def to_device(a, dtype: np.dtype, device: torch.device) -> torch.Tensor:
    """``a`` (array-like) as a contiguous ``dtype`` tensor on ``device``.

    On the CPU the tensor shares the numpy array's memory (``torch.from_numpy``: no copy, no dispatched op); on
    another device it is one pinned, non-blocking host-to-device copy.
    """
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
    return t if device.type == "cpu" else ship([t], device)[0]


def ship(tensors: Sequence[Optional[torch.Tensor]], device: torch.device) -> list[Optional[torch.Tensor]]:
    """Host tensors on ``device``, in one host-to-device copy (None entries stay None).

    Parameters
    ----------
    tensors : sequence of Tensor or None
        CPU tensors of any dtypes and shapes.
    device : torch.device

    Returns
    -------
    list of Tensor or None
        Each input's values on ``device`` (same dtype and shape); on the CPU the inputs themselves.
    """
    if device.type == "cpu":
        return list(tensors)
    sizes, offsets, total = [], [], 0
    for t in tensors:
        n = 0 if t is None else t.numel() * t.element_size()
        offsets.append(total)
        sizes.append(n)
        total += -(-n // _ALIGN) * _ALIGN
    pin = device.type == "cuda"
    staging = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    for t, o, n in zip(tensors, offsets, sizes):
        if n:
            staging[o:o + n].view(t.dtype).view(t.shape).copy_(t)
    moved = staging.to(device, non_blocking=pin)
    return [None if t is None else moved[o:o + n].view(t.dtype).view(t.shape)
            for t, o, n in zip(tensors, offsets, sizes)]
