"""Host tensors to the device: no op on the CPU, one pinned non-blocking copy elsewhere.

The hot path builds its index tables and batch rows on the host. On a CUDA device a plain ``tensor.to(device)``
from pageable memory synchronises the stream; here every copy is staged in pinned memory from torch's caching host
allocator (which keeps a block until the copies reading it have finished) and issued non-blocking, so building a
batch never waits for the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["Arena", "to_device", "ship"]

_ALIGN = 16  # bytes: every dtype's alignment
_NUMPY = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
          torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
          torch.float64: np.float64}  # the dtypes staged with numpy writes


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
    return math.prod(shape) * dtype.itemsize


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    return buf[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)


def _host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of host memory to copy to ``device`` from: pinned for CUDA (torch's caching host allocator keeps
    a block until the copies reading it have finished)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _stage(tensors, offsets, total: int, device: torch.device) -> torch.Tensor:
    """A host buffer (:func:`_host_buffer`) holding ``tensors`` at ``offsets``: numpy copies (no dispatched tensor
    op) for the dtypes numpy has."""
    staging = _host_buffer(total, device)
    raw = staging.numpy()
    for t, o in zip(tensors, offsets):
        if t is None or not t.numel():
            continue
        dtype = _NUMPY.get(t.dtype)
        if dtype is None or t.device.type != "cpu":  # (no numpy twin; or not host memory, against the contract)
            _view(staging, o, t.dtype, t.shape).copy_(t)
        else:
            np.ndarray(t.shape, dtype, raw, o)[...] = (t.detach() if t.requires_grad else t).numpy()
    return staging


class Arena:
    """Device tensors of fixed dtypes and shapes in one buffer, refilled from the host in one copy.

    The static inputs of a captured CUDA graph: the graph reads the views' addresses, each replay refills their
    values: written with numpy into a host buffer laid out as the arena (:meth:`stage`), then one pinned,
    non-blocking host-to-device copy (:meth:`load`; no wait for the device). The arena keeps up to :attr:`KEEP`
    such buffers with their numpy views and hands one out again once its copy has completed (on CUDA an event
    recorded after the copy says so; elsewhere the copy is done when :meth:`load` returns): a refill neither
    allocates nor builds views, and never writes a buffer that a pending copy still reads.

    Parameters
    ----------
    specs : sequence of (dtype, shape)
    device : torch.device
    """

    KEEP = 4  # host buffers kept for reuse (past them, buffers in flight at once are fresh ones, not kept)

    def __init__(self, specs: Sequence[tuple], device: torch.device) -> None:
        self.specs = [(dtype, tuple(shape)) for dtype, shape in specs]
        self.offsets, self.nbytes = _layout([_nbytes(dtype, shape) for dtype, shape in self.specs])
        self.device = torch.device(device)
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views = [_view(self.buffer, o, dtype, shape) for (dtype, shape), o in zip(self.specs, self.offsets)]
        self._host_layout = [(o, _NUMPY[dtype], shape) for (dtype, shape), o in zip(self.specs, self.offsets)]
        self._kept: list[_Staging] = []

    def span(self, first: int, last: int) -> tuple[int, int]:
        """The bytes ``[lo, hi)`` of a staging buffer (and of :attr:`buffer`) holding entries ``first .. last``
        (and the alignment bytes between them): a caller may keep a copy of them and put it back in one copy."""
        if not 0 <= first <= last < len(self.specs):
            raise ValueError(f"first and last must be entries with 0 <= first <= last < {len(self.specs)}, got "
                             f"{first} and {last}")
        dtype, shape = self.specs[last]
        return self.offsets[first], self.offsets[last] + _nbytes(dtype, shape)

    def stage(self) -> tuple[torch.Tensor, list[np.ndarray]]:
        """A host buffer (:func:`_host_buffer`) laid out as the arena, and numpy views of its entries: write the
        next values into the views, then :meth:`load` the buffer. It is a kept one whose last copy has completed,
        else a new one.

        Returns
        -------
        staging : uint8 Tensor [nbytes] on the host
        arrays : list of numpy arrays
            Entry ``i`` of ``staging``, of the arena's dtype and shape ``i`` (their values: whatever is there).
        """
        for kept in self._kept:
            if kept.state == _COPYING and (kept.event is None or kept.event.query()):
                kept.state = _FREE
            if kept.state == _FREE:
                kept.state = _OUT
                return kept.buffer, kept.arrays
        staging = _host_buffer(self.nbytes, self.device)
        raw = staging.numpy()
        arrays = [np.ndarray(shape, dtype, raw, offset) for offset, dtype, shape in self._host_layout]
        if len(self._kept) < self.KEEP:
            self._kept.append(_Staging(staging, arrays, _OUT))
        return staging, arrays

    def load(self, staging: torch.Tensor) -> None:
        """Copy a buffer from :meth:`stage` into the arena: one non-blocking host-to-device copy (no wait for the
        device); a kept buffer is handed out again once the copy has read it."""
        assert staging.shape == self.buffer.shape and staging.device.type == "cpu", (staging.shape, self.nbytes)
        cuda = self.device.type == "cuda"
        self.buffer.copy_(staging, non_blocking=cuda)
        kept = next((k for k in self._kept if k.buffer is staging), None)
        if kept is None:
            return
        if cuda:
            if kept.event is None:
                kept.event = torch.cuda.Event()
            kept.event.record(torch.cuda.current_stream(self.device))
        kept.state = _COPYING


_OUT, _COPYING, _FREE = "out", "copying", "free"


@dataclass(eq=False)
class _Staging:
    """A host buffer an :class:`Arena` keeps, its numpy views, and where it stands: handed out by
    :meth:`Arena.stage` and not loaded yet (``_OUT``), loaded (``_COPYING``: free once ``event`` has completed,
    at once without one), or ``_FREE``. One handed out and never loaded (its fill raised) stays out: the arena
    then keeps one fewer to reuse."""

    buffer: torch.Tensor
    arrays: list
    state: str
    event: Optional[object] = None
