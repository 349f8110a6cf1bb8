"""Layer-wise DRAM onload: a ranking's DRAM hit is copied back layer by layer, each layer waiting for its own.

A DRAM entry holds a prefix's K/V of every layer in one contiguous host buffer (:mod:`relaygr_engine.tiers`).
Copied back whole before the forward, a hit costs the whole prefix's copy on the critical path. Here the copy of
layer ``l`` goes on a side stream and records event ``l``; the forward runs on the compute stream, and each layer's
attention op (:func:`relaygr_engine.attention.op.relay_attention`) first waits for event ``l`` (:func:`wait_layer`), so
layer ``l + 1``'s pages are copied while layer ``l`` computes and a hit costs about one layer's copy. The events
are created with ``external=True``: captured in a CUDA graph, each wait becomes an event-wait node, so a replayed
forward waits on the copies of the hit it serves as well.

On a CPU there is no asynchronous copy; a stand-in keeps each layer's copy until that layer's attention asks for
it (the same order of copies and waits, so the CPU tests check that no layer reads pages its copy has not yet
filled).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import numpy as np
import torch

__all__ = ["LayerOnload", "wait_layer"]

_current = threading.local()


def wait_layer(layer: int) -> None:
    """Wait (on the compute stream) for the running forward's copies of ``layer``'s pages; nothing outside an
    engine's ranking forward. Called by each layer's attention op before it reads or writes its pages."""
    onload = getattr(_current, "onload", None)
    if onload is not None:
        onload.wait(layer)


class LayerOnload:
    """The layer-wise copies of one engine's cache (see the module docstring).

    Parameters
    ----------
    cache : PagedKVCache
        The device pages the copies fill (``cache.kv[l]``: ``[num_pages, 2, page_size, H, D]``).
    """

    def __init__(self, cache) -> None:
        self.cache = cache
        self.num_layers = len(cache.kv)
        self.stream = self.events = None
        self._queued: list[list] = [[] for _ in range(self.num_layers)]  # the CPU stand-in's copies not made yet
        if cache.device.type == "cuda":
            self.stream = torch.cuda.Stream(cache.device)
            self.events = [torch.cuda.Event(external=True) for _ in range(self.num_layers)]
            for ev in self.events:  # a wait on an event never recorded: complete from the start
                ev.record(self.stream)
        self.copies = 0  # layer copies issued

    # ------------------------------------------------------------------------------------------ issue
    def copy(self, buffer: torch.Tensor, pages, timestamps: torch.Tensor) -> None:
        """Copy a packed entry into ``pages``: its timestamps now (every layer reads them), its K/V layer by layer.

        Parameters
        ----------
        buffer : Tensor
            Packed K/V ``[num_layers, 2, len(pages) * page_size, H, D]`` (host memory, pinned on CUDA), as
            ``PagedKVCache.pack`` makes it.
        pages : array of int
            The destination pages.
        timestamps : Tensor
            int64 ``[num_tokens]``.

        Raises
        ------
        ValueError
            ``buffer`` does not fit the cache; nothing copied.
        """
        c = self.cache
        ids = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
        n = ids.numel()
        shape = c.packed_shape(n)
        if tuple(buffer.shape) != shape or buffer.dtype != c.store_dtype:
            raise ValueError(f"buffer must be {c.store_dtype} of shape {list(shape)}, got {buffer.dtype} "
                             f"{list(buffer.shape)}")
        ids = ids.to(c.device, non_blocking=True)
        c.write_timestamps(pages, timestamps)
        if self.stream is None:
            for layer in range(self.num_layers):
                self._queued[layer].append((buffer[layer], ids))
            self.copies += self.num_layers
            return
        self.stream.wait_stream(torch.cuda.current_stream(c.device))  # pages earlier forwards still read
        ids.record_stream(self.stream)  # made on the compute stream, read on the side stream
        with torch.cuda.stream(self.stream):
            for layer in range(self.num_layers):
                self._copy(layer, buffer[layer], ids)
                self.events[layer].record(self.stream)
        self.copies += self.num_layers

    def _copy(self, layer: int, src: torch.Tensor, ids: torch.Tensor) -> None:
        """Scatter one layer's packed K/V ``src [2, n * page_size, H, D]`` into pages ``ids`` of ``cache.kv[layer]``."""
        c, n = self.cache, ids.numel()
        src = src.to(c.device, non_blocking=src.is_pinned())
        c.kv[layer].index_copy_(0, ids, src.view(2, n, c.slots_per_page, c.num_heads, c.head_dim).transpose(0, 1))

    # ------------------------------------------------------------------------------------------ wait
    def wait(self, layer: int) -> None:
        """Make the compute stream wait for the copies of layer ``layer`` issued so far."""
        if self.stream is None:
            for j in range(layer + 1):
                self._drain(j)
            return
        torch.cuda.current_stream(self.cache.device).wait_event(self.events[layer])

    def join(self) -> None:
        """Make the compute stream wait for every copy issued so far (before pages are used outside a forward)."""
        if self.stream is None:
            for j in range(self.num_layers):
                self._drain(j)
            return
        torch.cuda.current_stream(self.cache.device).wait_stream(self.stream)

    def _drain(self, layer: int) -> None:
        queued, self._queued[layer] = self._queued[layer], []
        for src, ids in queued:
            self._copy(layer, src, ids)

    @property
    def pending(self) -> int:
        """Layer copies the CPU stand-in has not made yet (0 on CUDA, where the stream makes them)."""
        return sum(len(q) for q in self._queued)

    @contextlib.contextmanager
    def forward(self) -> Iterator["LayerOnload"]:
        """The scope of one engine forward: each layer's attention op waits for its own layer's copies
        (:func:`wait_layer`); on leaving, the compute stream waits for every copy."""
        prev: Optional[LayerOnload] = getattr(_current, "onload", None)
        _current.onload = self
        try:
            yield self
        finally:
            _current.onload = prev
            self.join()
