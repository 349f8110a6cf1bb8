"""Server-local DRAM tier for prefix KV (the memory-aware expander's storage).

An entry is one prefix's KV for all layers packed into one contiguous host buffer (see
:func:`relaygr_engine.kernels.kv_pack.kv_pack`), so a spill is one device-to-host copy and a reload one
host-to-device copy, never one per page. On CUDA the buffers are pinned host memory, so copies run at full PCIe speed
and can be asynchronous.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, TypeVar

import torch

__all__ = ["DramEntry", "HostKVTier", "SingleFlight"]

T = TypeVar("T")


@dataclass(frozen=True)
class DramEntry:
    """One prefix held in DRAM.

    Attributes
    ----------
    num_tokens : int
    kv : Tensor
        Packed KV of all layers, ``[num_layers, 2, num_pages * page_size, H, D]`` on the host.
    timestamps : Tensor
        int64 ``[num_tokens]``.
    """

    user_id: int
    fingerprint: int
    num_tokens: int
    kv: torch.Tensor
    timestamps: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.timestamps.numel() * 8


class HostKVTier:
    """LRU store of packed prefix KV in host memory under a byte budget.

    Parameters
    ----------
    capacity_bytes : int
        Budget (> 0). An entry larger than the whole budget is refused (``put`` returns False).
    pin_memory : bool
        Allocate page-locked buffers (use on CUDA for fast, asynchronous copies).
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an integer > 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, int], DramEntry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._c = dict(dram_puts=0, dram_put_refused=0, dram_evictions=0, dram_lookups=0, dram_lookup_hits=0,
                       dram_bytes_in=0)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return tuple(key) in self._entries

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty host buffer to pack into (pinned when the tier pins memory)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)

    def put(self, entry: DramEntry) -> bool:
        """Store ``entry`` (replacing an older copy of the same key), evicting LRU entries to fit.

        Returns False, and stores nothing, when the entry alone exceeds the budget.
        """
        if entry.kv.device.type != "cpu":
            raise ValueError(f"entry.kv must be a host tensor, got device {entry.kv.device}")
        size = entry.nbytes
        key = (entry.user_id, entry.fingerprint)
        with self._lock:
            if size > self.capacity_bytes:
                self._c["dram_put_refused"] += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._bytes + size > self.capacity_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                self._c["dram_evictions"] += 1
            self._entries[key] = entry
            self._bytes += size
            self._c["dram_puts"] += 1
            self._c["dram_bytes_in"] += size
            return True

    def get(self, user_id: int, fingerprint: int) -> Optional[DramEntry]:
        """The entry (now most recently used), or None."""
        with self._lock:
            self._c["dram_lookups"] += 1
            e = self._entries.get((user_id, fingerprint))
            if e is not None:
                self._entries.move_to_end((user_id, fingerprint))
                self._c["dram_lookup_hits"] += 1
            return e

    def entries_of(self, user_id: int) -> list[tuple[int, int]]:
        """``[(fingerprint, num_tokens), ...]`` of a user's DRAM entries."""
        with self._lock:
            return [(f, e.num_tokens) for (u, f), e in self._entries.items() if u == user_id]

    def discard(self, user_id: int, fingerprint: int) -> bool:
        """Drop an entry if present; True if it was there."""
        with self._lock:
            e = self._entries.pop((user_id, fingerprint), None)
            if e is not None:
                self._bytes -= e.nbytes
            return e is not None

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c, dram_entries=len(self._entries), dram_used_bytes=self._bytes,
                        dram_capacity_bytes=self.capacity_bytes)


class SingleFlight:
    """Run one call per key at a time; concurrent callers of the same key wait and share its result.

    Used so that N concurrent rankings of a user whose prefix is only in DRAM cause exactly one reload.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Hashable, "_Call"] = {}

    def do(self, key: Hashable, fn: Callable[[], T]) -> tuple[T, bool]:
        """Return ``(fn's result, True)`` for the caller that ran it, ``(shared result, False)`` for waiters.

        An exception raised by ``fn`` reaches every caller of that flight.
        """
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if leader:
                call = self._calls[key] = _Call()
            call.callers += 1
        if not leader:
            call.done.wait()
            if call.error is not None:
                raise call.error
            return call.value, False
        try:
            call.value = fn()
        except BaseException as exc:
            call.error = exc
            raise
        finally:
            with self._lock:
                del self._calls[key]
            call.done.set()
        return call.value, True

    def callers(self, key: Hashable) -> int:
        """How many callers are attached to the flight of ``key`` now (0 when none runs)."""
        with self._lock:
            call = self._calls.get(key)
            return 0 if call is None else call.callers


class _Call:
    __slots__ = ("done", "value", "error", "callers")

    def __init__(self) -> None:
        self.callers = 0
        self.done = threading.Event()
        self.value = None
        self.error: Optional[BaseException] = None
