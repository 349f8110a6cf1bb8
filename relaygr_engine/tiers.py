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
from typing import Optional

import torch

from .config import check_int

__all__ = ["DramEntry", "HostKVTier", "ReloadCostModel"]

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

    def __post_init__(self) -> None:
        n = check_int("num_tokens", self.num_tokens, 1)
        object.__setattr__(self, "num_tokens", n)
        if not isinstance(self.kv, torch.Tensor) or self.kv.dim() != 5 or self.kv.shape[1] != 2:
            got = tuple(self.kv.shape) if isinstance(self.kv, torch.Tensor) else type(self.kv).__name__
            raise ValueError(f"kv must be a [num_layers, 2, slots, H, D] tensor, got {got}")
        if self.kv.shape[2] < n:
            raise ValueError(f"kv must hold num_tokens={n} token slots, got {self.kv.shape[2]}")
        ts = self.timestamps
        if not isinstance(ts, torch.Tensor) or ts.dtype != torch.long or tuple(ts.shape) != (n,):
            got = f"{tuple(ts.shape)} {ts.dtype}" if isinstance(ts, torch.Tensor) else type(ts).__name__
            raise ValueError(f"timestamps must be int64 of shape ({n},) (num_tokens), got {got}")

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
        self.capacity_bytes = check_int("capacity_bytes", capacity_bytes, 1)
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, int], DramEntry] = OrderedDict()  # oldest first
        self._by_user: dict[int, dict[int, int]] = {}  # user -> fingerprint -> tokens, in the same order
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
        if not isinstance(entry, DramEntry):
            raise ValueError(f"entry must be a DramEntry, got {type(entry).__name__}")
        if entry.kv.device.type != "cpu":
            raise ValueError(f"entry.kv must be a host tensor, got device {entry.kv.device}")
        size = entry.nbytes
        key = (entry.user_id, entry.fingerprint)
        with self._lock:
            if size > self.capacity_bytes:
                self._c["dram_put_refused"] += 1
                return False
            self._remove(key)
            while self._bytes + size > self.capacity_bytes:
                self._remove(next(iter(self._entries)))
                self._c["dram_evictions"] += 1
            self._entries[key] = entry
            self._by_user.setdefault(entry.user_id, {})[entry.fingerprint] = entry.num_tokens
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
                mine = self._by_user[user_id]
                mine[fingerprint] = mine.pop(fingerprint)
                self._c["dram_lookup_hits"] += 1
            return e

    def entries_of(self, user_id: int) -> list[tuple[int, int]]:
        """``[(fingerprint, num_tokens), ...]`` of a user's DRAM entries, least recently used first (a lookup of
        that user's entries only)."""
        with self._lock:
            return list(self._by_user.get(user_id, {}).items())

    def discard(self, user_id: int, fingerprint: int) -> bool:
        """Drop an entry if present; True if it was there."""
        with self._lock:
            return self._remove((user_id, fingerprint)) is not None

    def _remove(self, key: tuple[int, int]) -> Optional[DramEntry]:
        """Drop ``key``'s entry from both indexes (under the lock); the entry, or None."""
        e = self._entries.pop(key, None)
        if e is not None:
            self._bytes -= e.nbytes
            mine = self._by_user[key[0]]
            del mine[key[1]]
            if not mine:
                del self._by_user[key[0]]
        return e

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c, dram_entries=len(self._entries), dram_used_bytes=self._bytes,
                        dram_capacity_bytes=self.capacity_bytes)


class ReloadCostModel:
    """Decides reload-from-DRAM vs recompute from costs measured online on this engine.

    Reload time is predicted as ``bytes / reload_bytes_per_s`` and recompute time as
    ``tokens * recompute_s_per_token``, each an exponentially weighted average of the engine's own measurements
    (reloads it did; forward passes it ran). Until both have been measured, reloading is preferred. The per-token
    recompute cost is averaged over the engine's actual forwards, so for prefixes much longer than typical it
    under-predicts recompute (attention grows quadratically), which errs toward recomputing.

    Parameters
    ----------
    alpha : float
        Weight of each new measurement in (0, 1].
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.reload_bytes_per_s: Optional[float] = None
        self.recompute_s_per_token: Optional[float] = None

    def _mix(self, old: Optional[float], new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def observe_reload(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.reload_bytes_per_s = self._mix(self.reload_bytes_per_s, nbytes / seconds)

    def observe_recompute(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.recompute_s_per_token = self._mix(self.recompute_s_per_token, seconds / tokens)

    def prefers_reload(self, tokens: int, nbytes: int) -> bool:
        """True when reloading ``nbytes`` is predicted faster than recomputing ``tokens`` tokens."""
        if self.reload_bytes_per_s is None or self.recompute_s_per_token is None:
            return True
        return nbytes / self.reload_bytes_per_s < tokens * self.recompute_s_per_token
