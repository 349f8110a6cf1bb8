"""Prefix KV transfer between engines: pack a pre-inferred prefix on one engine, unpack it into another's pages.

Disaggregated serving pre-infers on one instance and ranks on another. The sender packs all layers of the prefix
into one contiguous buffer (:meth:`~relaygr_engine.cache.PagedKVCache.pack`: offsets follow from the token count,
layers, heads and head dim, so one large copy moves it instead of one per page); the receiver scatters it into
pages of its own pool under a lease (:meth:`~relaygr_engine.cache.PagedKVCache.unpack`), after which a ranking
reads it as a device-cache hit. The receiver recomputes the prefix fingerprint from the history it is given, so a
buffer made by another model or for another history is refused before any state changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .records import Prepared, PrefixTicket
from .tiers import CacheState

__all__ = ["PackedPrefix", "pack_entry", "check_packed", "unpack_entry", "store_packed"]


@dataclass(frozen=True, eq=False)
class PackedPrefix:
    """One user's prefix KV of every layer in one contiguous buffer.

    Attributes
    ----------
    user_id, fingerprint : int
        The key of the prefix (the fingerprint of its ``num_tokens`` tokens under the sender's model).
    num_tokens : int
        History tokens in the prefix.
    page_size : int
        Tokens per page of the sender's cache (the receiver's must match).
    kv : Tensor [num_layers, 2, ceil(num_tokens / page_size) * page_size, H, D]
        Packed K/V (the tail of the last page is padding).
    timestamps : Tensor [num_tokens]
        int64 token timestamps stored beside the KV.
    """

    user_id: int
    fingerprint: int
    num_tokens: int
    page_size: int
    kv: torch.Tensor
    timestamps: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes moved: the KV buffer and the timestamps."""
        return self.kv.numel() * self.kv.element_size() + self.timestamps.numel() * self.timestamps.element_size()

    def to(self, device) -> "PackedPrefix":
        """A copy on ``device`` (one copy of each buffer; the host side of a transfer)."""
        return PackedPrefix(self.user_id, self.fingerprint, self.num_tokens, self.page_size,
                            self.kv.to(device, copy=True), self.timestamps.to(device, copy=True))


def pack_entry(state: CacheState, fingerprint: int, ticket: PrefixTicket, t: float) -> Optional[PackedPrefix]:
    """Pack the first ``ticket.num_tokens`` tokens of the entry an admitted ``ticket`` names, then end its lease.

    ``fingerprint`` is that of those tokens (the entry may be a longer one holding them). The entry stays cached
    and evictable at the sender, so a later pre-infer of the user extends it. None when the entry is gone (its
    lease ran out and it was evicted).
    """
    u, efp, T = ticket.user_id, ticket.fingerprint, ticket.num_tokens
    pages = state.pool.pin(u, efp, now=t)
    if pages is None:
        return None
    try:
        used = pages[:-(-T // state.page_size)]
        kv = state.cache.pack(used)
        ts = state.cache.gather_timestamps(used, T).clone()
        state.sync()
    finally:
        state.pool.unpin(u, efp, now=t)
    state.pool.release_lease(u, efp, now=t)
    state.leased.pop((u, efp), None)
    packed = PackedPrefix(u, fingerprint, T, state.page_size, kv, ts)
    state.counters.exports += 1
    state.counters.export_bytes += packed.nbytes
    return packed


def check_packed(state: CacheState, packed: PackedPrefix, p: Prepared, fingerprint: int) -> None:
    """ValueError unless ``packed`` fits this cache and is ``p``'s prefix under this model (no state changes)."""
    if not isinstance(packed, PackedPrefix):
        raise ValueError(f"packed must be a PackedPrefix, got {type(packed).__name__}")
    if packed.user_id != p.user_id or packed.num_tokens != p.num_tokens:
        raise ValueError(f"packed is user {packed.user_id}'s {packed.num_tokens}-token prefix, but the history is "
                         f"user {p.user_id}'s with {p.num_tokens} tokens")
    if packed.page_size != state.page_size:
        raise ValueError(f"packed.page_size must be this cache's page size {state.page_size}, got "
                         f"{packed.page_size}")
    c = state.cache
    shape = c.packed_shape(-(-packed.num_tokens // c.page_size))
    if tuple(packed.kv.shape) != shape or packed.kv.dtype != c.store_dtype:
        raise ValueError(f"packed.kv must be {c.store_dtype} of shape {list(shape)} (kv_dtype={c.kv_dtype.value!r}), "
                         f"got {packed.kv.dtype} {list(packed.kv.shape)}")
    if tuple(packed.timestamps.shape) != (packed.num_tokens,):
        raise ValueError(f"packed.timestamps must have shape [{packed.num_tokens}], got "
                         f"{list(packed.timestamps.shape)}")
    if packed.fingerprint != fingerprint:
        raise ValueError("packed.fingerprint differs from this engine's fingerprint of the history: the buffer was "
                         "made by another model (or weights) or for another history")


def unpack_entry(state: CacheState, packed: PackedPrefix, t: float):
    """Scatter a checked ``packed`` into a new leased entry ``(user, packed.fingerprint)``.

    Returns the entry's pages (unpinned, ``np.ndarray``), or None when the pool cannot hold it now. Raises what the
    copy raises, after freeing the entry.
    """
    u, fp, T = packed.user_id, packed.fingerprint, packed.num_tokens
    pages = state.pool.insert(u, fp, T, ttl_s=state.config.lease_ttl_s, now=t)
    if pages is None:
        return None
    try:
        state.cache.unpack(packed.kv, pages)
        state.cache.write_timestamps(pages, packed.timestamps)
        state.sync()
    except BaseException:
        state.drop((u, fp), t)
        raise
    state.pool.unpin(u, fp, now=t)
    c = state.counters
    c.imports += 1
    c.import_bytes += packed.nbytes
    return pages


def store_packed(state: CacheState, index, planner, p: Prepared, packed: PackedPrefix, t: float) -> PrefixTicket:
    """Lease the cached prefix when this cache holds all of ``p`` (``"already_cached"``), else unpack a checked
    ``packed`` into a new leased entry (``"admitted"``), or decline (``"pool_full"`` / ``"budget"``).

    ``index`` is the engine's :class:`~.index.PrefixIndex`, ``planner`` its :class:`~.prefill.PrefillPlanner`.
    """
    c, ttl = state.counters, state.config.lease_ttl_s
    T, u, fp = p.num_tokens, p.user_id, packed.fingerprint
    hit = index.match(p, T)
    if hit is not None and hit.usable == T:
        ticket = planner._lease_cached(p, hit.fp, fp, t)
        c.imports_already_cached += int(ticket.admitted)
        return ticket
    if unpack_entry(state, packed, t) is None:
        c.imports_refused += 1
        too_big = -(-T // state.page_size) > state.pool.max_pinned_pages
        return PrefixTicket(False, "budget" if too_big else "pool_full", u, fp, T, None)
    index.record((u, fp), p, T)
    if state.dram is not None:
        state.leased[(u, fp)] = t + ttl
    return PrefixTicket(True, "admitted", u, fp, T, t + ttl, cached_tokens=T)
