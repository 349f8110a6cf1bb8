"""The engine's cache state (device pages, DRAM tier, counters) and its page-level steps: drop, copy, spill,
reload."""
from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..cache import PagedKVCache
from ..config import CacheConfig
from ..onload import LayerOnload
from ..tiers import DramEntry, HostKVTier, ReloadCostModel
from .records import EngineCounters, Key

__all__ = ["CacheState", "Leases"]

_log = logging.getLogger("relaygr_engine")
_TRANSFER_ERRORS = (RuntimeError, MemoryError)  # a failed copy or allocation (torch's out-of-memory included)


class Leases:
    """Admitted entries -> lease end, with the ends in a heap: :meth:`due` finds the ended leases in time
    logarithmic in the leases held, not a scan of them all on every engine call.

    A mapping of ``Key -> float`` (set, ``pop``, ``in``, ``len``); a renewed or popped lease leaves its old
    heap record behind, skipped when it comes due, and the heap is rebuilt once it holds twice the live leases.
    """

    def __init__(self) -> None:
        self._end: dict = {}
        self._heap: list = []  # (end, order, key) records, some stale
        self._order = itertools.count()

    def __setitem__(self, key: Key, end: float) -> None:
        self._end[key] = end
        heapq.heappush(self._heap, (end, next(self._order), key))
        if len(self._heap) > 2 * len(self._end) + 64:
            self._heap = [(e, next(self._order), k) for k, e in self._end.items()]
            heapq.heapify(self._heap)

    def pop(self, key: Key, default=None):
        return self._end.pop(key, default)

    def __contains__(self, key) -> bool:
        return key in self._end

    def __len__(self) -> int:
        return len(self._end)

    def due(self, t: float) -> list:
        """Remove and return the keys whose lease ended by ``t`` (earliest end first)."""
        out = []
        while self._heap and self._heap[0][0] <= t:
            end, _, key = heapq.heappop(self._heap)
            if self._end.get(key) == end:
                del self._end[key]
                out.append(key)
        return out


@dataclass(eq=False)
class CacheState:
    """What the engine's steps share: the paged cache and its pool, the DRAM tier, the counters.

    Attributes
    ----------
    leased : Leases
        Admitted entries -> lease end, so that an entry whose lease ends unused is spilled to DRAM in time.
    onload : LayerOnload or None
        Layer-wise copies of rankings' DRAM hits (``config.layered_onload`` with a DRAM tier), else None.
    """

    config: CacheConfig
    cache: PagedKVCache
    dram: Optional[HostKVTier]
    expander: ReloadCostModel = field(default_factory=ReloadCostModel)
    counters: EngineCounters = field(default_factory=EngineCounters)
    leased: Leases = field(default_factory=Leases)
    onload: Optional[LayerOnload] = None

    @classmethod
    def build(cls, config: CacheConfig, num_layers: int, num_heads: int, head_dim: int) -> "CacheState":
        cache = PagedKVCache(config, num_layers, num_heads, head_dim)
        dram = (HostKVTier(config.dram_bytes, pin_memory=cache.device.type == "cuda")
                if config.dram_bytes > 0 else None)
        onload = LayerOnload(cache) if dram is not None and config.layered_onload else None
        return cls(config, cache, dram, onload=onload)

    def reset(self) -> None:
        """Empty the cache as a fresh engine's is, in place: a new pool (every page free, its counters at zero),
        the page memory and timestamps zeroed, an empty DRAM tier, no leases, the expander's costs unlearned, the
        counters zeroed. The tensors stay where they are (captured CUDA graphs keep reading them) and so do the
        objects that hold this state."""
        self.join_onload()
        self.sync()
        c = self.cache
        c.pool = type(c.pool)(c.num_pages, c.page_size, c.pool.max_pinned_pages)
        for t in c.kv:
            t.zero_()
        c.timestamps.zero_()
        if self.dram is not None:
            self.dram = HostKVTier(self.dram.capacity_bytes, pin_memory=self.dram.pin_memory)
        self.expander = ReloadCostModel(self.expander.alpha)
        self.leased = Leases()
        for f in dataclasses.fields(self.counters):
            setattr(self.counters, f.name, f.default)
        if self.onload is not None:
            self.onload.copies = 0
        self.sync()

    @property
    def pool(self):
        return self.cache.pool

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA), so host-side timings and buffers are complete."""
        if self.cache.device.type == "cuda":
            torch.cuda.current_stream(self.cache.device).synchronize()

    # ------------------------------------------------------------------------------------------ device pages
    def drop(self, key: Key, t: float, unpin: bool = True) -> None:
        """Remove an entry whose KV is incomplete (error path): end its lease, drop our reference, free it."""
        pool = self.pool
        if pool.lookup(*key) is None:
            return
        if unpin:
            pool.unpin(*key, now=t)
        if pool.has_lease(*key, now=t):
            pool.release_lease(*key, now=t)
        try:
            pool.free(*key, now=t)
        except ValueError:  # still pinned by another reader: its tokens beyond the valid part are never read
            pass

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the K/V of every layer and the timestamps of pages ``src`` into the first ``len(src)`` of ``dst``."""
        self.join_onload()
        dev = self.cache.device
        s = torch.from_numpy(np.ascontiguousarray(src, dtype=np.int64)).to(dev)
        d = torch.from_numpy(np.ascontiguousarray(dst[:len(src)], dtype=np.int64)).to(dev)
        for buf in self.cache.kv:
            buf.index_copy_(0, d, buf.index_select(0, s))
        self.cache.timestamps.index_copy_(0, d, self.cache.timestamps.index_select(0, s))

    # ------------------------------------------------------------------------------------------ DRAM tier
    def _transfer_failed(self, what: str, exc: BaseException) -> None:
        """Count a failed spill or reload (the caller goes on without it); warn the first time."""
        name = f"{what}_failures"
        if getattr(self.counters, name) == 0:
            _log.warning("relaygr_engine: a DRAM %s failed (%s: %s); going on without it (counted as %s)", what,
                         type(exc).__name__, exc, name)
        setattr(self.counters, name, getattr(self.counters, name) + 1)

    def spill(self, key: Key) -> None:
        """Copy an entry to the DRAM tier as one contiguous buffer, unless DRAM already holds this key.

        A failed copy keeps no DRAM entry and is counted (``spill_failures``): the prefix stays in device memory.
        """
        num_tokens = self.pool.lookup(*key)
        if num_tokens is None or key in self.dram:
            return
        try:
            entry = self._pack(key, num_tokens)
        except _TRANSFER_ERRORS as e:
            self._transfer_failed("spill", e)
            return
        for fp, _ in self.dram.entries_of(key[0]):  # superseded by the longer prefix of the same user
            self.dram.discard(key[0], fp)
        if self.dram.put(entry):
            self.counters.spills += 1
            self.counters.spill_bytes += entry.nbytes

    def _pack(self, key: Key, num_tokens: int) -> DramEntry:
        """A DRAM entry holding a copy of the cached entry ``key`` of ``num_tokens`` tokens."""
        pages = self.pool.pages_of(*key)
        c = self.cache
        self.join_onload()
        buf = self.dram.alloc(c.packed_shape(len(pages)), c.store_dtype)
        if c.device.type == "cpu" and buf.device.type == "cpu" and buf.is_contiguous():
            # one gather per layer and K/V straight into the buffer (the generic pack makes several copies)
            ids = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
            view = buf.view(c.num_layers, 2, len(pages), c.slots_per_page, c.num_heads, c.head_dim)
            for layer, kv in enumerate(c.kv):
                for i in (0, 1):
                    torch.index_select(kv[:, i], 0, ids, out=view[layer, i])
        else:
            c.pack(pages, out=buf)
        entry = DramEntry(key[0], key[1], num_tokens, buf, c.gather_timestamps(pages, num_tokens).cpu())
        self.sync()  # the buffer is complete before reuse
        return entry

    def spill_if_evictable(self, key: Key, t: float) -> None:
        """Keep a DRAM copy of an entry that is cached and no lease holds (it may be evicted from now on)."""
        if self.dram is not None and self.pool.lookup(*key) is not None and not self.pool.has_lease(*key, now=t):
            self.spill(key)

    def spill_expired(self, t: float) -> None:
        """Spill entries whose pre-infer lease has ended unused (before any insert could evict them)."""
        for key in self.leased.due(t):
            self.spill_if_evictable(key, t)

    def onload_scope(self):
        """The scope of a ranking forward that may read layer-wise reloads (:meth:`LayerOnload.forward`)."""
        return contextlib.nullcontext() if self.onload is None else self.onload.forward()

    def join_onload(self) -> None:
        """Order every layer-wise copy issued so far before later work on the compute stream (no host wait)."""
        if self.onload is not None:
            self.onload.join()

    def reload(self, key: Key, num_tokens: int, t: float, layered: bool = False) -> Optional[np.ndarray]:
        """Copy a DRAM entry back into pool pages (returned pinned by one reference), or None to recompute.

        With ``layered`` (a ranking's hit, read by the forward that follows inside ``onload.forward()``) and
        layer-wise onload on, the copy is only issued (:meth:`LayerOnload.copy`): each layer of the forward waits
        for its own pages. Otherwise every layer is copied before this returns. A failed copy frees the pages,
        drops the DRAM entry and is counted (``reload_failures``): None.
        """
        entry = self.dram.get(*key)
        if entry is None:
            return None
        if not self.expander.prefers_reload(num_tokens, entry.nbytes):
            self.counters.reloads_declined_cost += 1
            return None
        pages = self.pool.insert(key[0], key[1], num_tokens, now=t)
        if pages is None:
            self.counters.reloads_refused += 1
            return None
        layered = layered and self.onload is not None
        t0 = time.perf_counter()
        try:
            if layered:
                self.onload.copy(entry.kv, pages, entry.timestamps)
            else:
                self.join_onload()
                self.cache.unpack(entry.kv, pages)
                self.cache.write_timestamps(pages, entry.timestamps)
                self.sync()
        except _TRANSFER_ERRORS as e:
            self.drop(key, t)
            self.dram.discard(*key)
            self._transfer_failed("reload", e)
            return None
        except BaseException:
            self.drop(key, t)
            raise
        if not layered:  # a layered copy's time is not known without waiting for it
            self.expander.observe_reload(entry.nbytes, time.perf_counter() - t0)
        self.counters.layered_reloads += int(layered)
        self.counters.reloads += 1
        self.counters.reload_bytes += entry.nbytes
        return pages
