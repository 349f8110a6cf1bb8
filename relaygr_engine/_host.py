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

__all__ = ["Arena", "to_device", "ship"]

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
    offsets, total = _layout([0 if t is None else t.numel() * t.element_size() for t in tensors])
    moved = _stage(tensors, offsets, total, device).to(device, non_blocking=device.type == "cuda")
    return [None if t is None else _view(moved, o, t.dtype, t.shape) for t, o in zip(tensors, offsets)]


def _layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offsets of buffers of ``nbytes`` packed at :data:`_ALIGN`, and the total size (at least one unit)."""
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def _nbytes(dtype: torch.dtype, shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return buf[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)


def _stage(tensors, offsets, total: int, device: torch.device) -> torch.Tensor:
    """A host buffer (pinned for CUDA, from torch's caching host allocator) holding ``tensors`` at ``offsets``."""
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, o in zip(tensors, offsets):
        if t is not None and t.numel():
            _view(staging, o, t.dtype, t.shape).copy_(t)
    return staging


class Arena:
    """Device tensors of fixed dtypes and shapes in one buffer, refilled from the host in one copy.

    The static inputs of a captured CUDA graph: the graph reads the views' addresses, each replay refills their
    values (:meth:`fill`: one pinned, non-blocking host-to-device copy; no wait for the device).

    Parameters
    ----------
    specs : sequence of (dtype, shape)
    device : torch.device
    """

    def __init__(self, specs: Sequence[tuple], device: torch.device) -> None:
        self.specs = [(dtype, tuple(shape)) for dtype, shape in specs]
        self.offsets, self.nbytes = _layout([_nbytes(dtype, shape) for dtype, shape in self.specs])
        self.device = torch.device(device)
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views = [_view(self.buffer, o, dtype, shape) for (dtype, shape), o in zip(self.specs, self.offsets)]

    def fill(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors[i]`` into view ``i``: the host tensors in one copy, device ones one by one.

        Raises
        ------
        ValueError
            A tensor whose dtype or shape differs from its view's (before anything is copied).
        """
        if len(tensors) != len(self.views):
            raise ValueError(f"tensors must hold {len(self.views)} entries (one per view), got {len(tensors)}")
        for i, (t, (dtype, shape)) in enumerate(zip(tensors, self.specs)):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"tensors[{i}] must be a {dtype} tensor of shape {list(shape)}, got {got}")
        if self.device.type == "cpu":
            for view, t in zip(self.views, tensors):
                view.copy_(t)
            return
        host = [t if t.device.type == "cpu" else None for t in tensors]
        if any(t is not None for t in host):  # device entries' bytes are rewritten below, on the same stream
            self.buffer.copy_(_stage(host, self.offsets, self.nbytes, self.device),
                              non_blocking=self.device.type == "cuda")
        for view, t in zip(self.views, tensors):
            if t.device.type != "cpu":
                view.copy_(t)
