"""Pure-Python prefix-KV block pool.

This is the reference semantics of ``relaygr_engine._C.PrefixBlockPool`` (the C++ core in ``csrc/``) and the
fallback that ``relaygr_engine._ext`` loads when the extension is missing or ``RELAYGR_PUREPYTHON=1``. Both
implementations expose the same methods, return the same kinds of values and raise the same exceptions; the test
suite runs every pool test against both.

Model
-----
* The pool owns ``num_pages`` page ids ``0 .. num_pages-1``; a page holds ``page_size`` tokens of KV.
* An *entry* is one cached prefix, keyed by ``(user_id, fingerprint)`` (two unsigned 64-bit integers); it owns an
  ordered list of ``ceil(num_tokens / page_size)`` pages.
* An entry is *pinned* while its reference count is positive (``insert`` and ``pin`` take a reference, ``unpin``
  drops it) or while it holds a live *lease* (``insert(ttl_s=...)`` or ``lease``; it lasts ``ttl_s`` seconds
  unless ``release_lease`` ends it first). A pinned entry is never evicted or freed.
* Unpinned entries are *evictable* in least-recently-used order; ``insert`` and ``extend`` evict them as needed.
* ``max_pinned_pages`` bounds the pages held by pinned entries. ``insert``, ``lease`` and ``extend`` that would
  cross it are refused by returning ``None``/``False``; ``pin`` of a cached entry is never refused (a ranking read
  must not fail once the prefix is there).
* Capacity pressure is a return value (``None``/``False``); misuse raises ``ValueError`` or ``KeyError`` and leaves
  the pool unchanged.
* Time is ``time.monotonic()`` seconds (the same clock as C++ ``std::chrono::steady_clock`` on Linux) unless a
  method is given ``now=`` explicitly, which tests use for determinism.
"""
from __future__ import annotations

import heapq
import math
import operator
import threading
import time
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np

__all__ = ["PrefixBlockPool"]

_U64 = 1 << 64
_NO_LEASE, _LIVE_LEASE, _EXPIRED_LEASE = 0, 1, 2


class _Entry:
    __slots__ = ("user_id", "fingerprint", "num_tokens", "pages", "ref", "lease", "expiry", "lease_seq")

    def __init__(self, user_id: int, fingerprint: int, num_tokens: int, pages: list[int]) -> None:
        self.user_id = user_id
        self.fingerprint = fingerprint
        self.num_tokens = num_tokens
        self.pages = pages
        self.ref = 0
        self.lease = _NO_LEASE
        self.expiry = 0.0
        self.lease_seq = 0  # invalidates stale heap records when a lease is renewed or released

    def pinned(self) -> bool:
        return self.ref > 0 or self.lease == _LIVE_LEASE


def _u64(name: str, value) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {type(value).__name__}") from None
    if not 0 <= v < _U64:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {v}")
    return v


def _count(name: str, value, minimum: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v}")
    return v


def _seconds(name: str, value, positive: bool) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")
    return v


def _now(now) -> float:
    if now is None:
        return time.monotonic()
    v = float(now)
    if not math.isfinite(v):
        raise ValueError(f"now must be a finite time in seconds, got {now!r}")
    return v


class PrefixBlockPool:
    """Paged pool of cached user prefixes with leases, LRU eviction and a pinned-page budget.

    Parameters
    ----------
    num_pages : int
        Number of preallocated pages (>= 1).
    page_size : int
        Tokens per page (>= 1).
    max_pinned_pages : int, optional
        Upper bound on pages held by pinned entries, in ``[1, num_pages]``; defaults to ``num_pages``.
    """

    implementation = "python"

    def __init__(self, num_pages: int, page_size: int, max_pinned_pages: Optional[int] = None) -> None:
        self._num_pages = _count("num_pages", num_pages, 1)
        self._page_size = _count("page_size", page_size, 1)
        if self._num_pages >= 1 << 31:
            raise ValueError(f"num_pages must be < 2**31 (page ids are int32), got {self._num_pages}")
        if self._page_size >= 1 << 31:
            raise ValueError(f"page_size must be < 2**31 (kv_last_page_len is int32), got {self._page_size}")
        if max_pinned_pages is None:
            max_pinned_pages = self._num_pages
        self._max_pinned = _count("max_pinned_pages", max_pinned_pages, 1)
        if self._max_pinned > self._num_pages:
            raise ValueError(
                f"max_pinned_pages must be <= num_pages ({self._num_pages}), got {self._max_pinned}")
        self._lock = threading.RLock()
        # Free pages as a stack: the most recently freed page is reused first (warm in caches).
        self._free: list[int] = list(range(self._num_pages - 1, -1, -1))
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._by_user: dict[int, dict[int, None]] = {}  # user -> ordered set of fingerprints
        self._lru: OrderedDict[tuple[int, int], None] = OrderedDict()  # evictable entries, oldest first
        self._evictable_pages = 0
        self._pinned_pages = 0
        self._heap: list[tuple[float, int, int, int]] = []  # (expiry, lease_seq, user, fingerprint)
        self._live_leases = 0
        self._seq = 0
        self._c = dict(inserts=0, allocations=0, evictions=0, evicted_pages=0, expirations=0,
                       refused_leases=0, refused_inserts=0, hits=0, misses=0, frees=0, leases=0,
                       extends=0, peak_used_pages=0)

    # ------------------------------------------------------------------ properties
    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def max_pinned_pages(self) -> int:
        return self._max_pinned

    @property
    def num_free_pages(self) -> int:
        """Pages owned by no entry."""
        return len(self._free)

    @property
    def num_evictable_pages(self) -> int:
        """Pages owned by unpinned entries (reclaimable by eviction)."""
        return self._evictable_pages

    @property
    def num_pinned_pages(self) -> int:
        """Pages owned by pinned entries."""
        return self._pinned_pages

    @property
    def num_used_pages(self) -> int:
        return self._num_pages - len(self._free)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        user_id, fingerprint = key
        return (_u64("user_id", user_id), _u64("fingerprint", fingerprint)) in self._entries

    def __repr__(self) -> str:
        return (f"PrefixBlockPool(implementation={self.implementation!r}, num_pages={self._num_pages}, "
                f"page_size={self._page_size}, max_pinned_pages={self._max_pinned}, "
                f"entries={len(self._entries)}, used_pages={self.num_used_pages})")

    # ------------------------------------------------------------------ helpers (lock held)
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._page_size)

    def _get(self, user_id, fingerprint) -> _Entry:
        key = (_u64("user_id", user_id), _u64("fingerprint", fingerprint))
        e = self._entries.get(key)
        if e is None:
            raise KeyError(f"no cached entry for (user_id={key[0]}, fingerprint={key[1]})")
        return e

    def _make_evictable(self, e: _Entry) -> None:
        self._pinned_pages -= len(e.pages)
        self._evictable_pages += len(e.pages)
        self._lru[(e.user_id, e.fingerprint)] = None

    def _make_pinned(self, e: _Entry) -> None:
        del self._lru[(e.user_id, e.fingerprint)]
        self._evictable_pages -= len(e.pages)
        self._pinned_pages += len(e.pages)

    def _expire(self, now: float) -> int:
        n = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            record = heapq.heappop(heap)
            if not self._record_live(record):
                continue  # stale record: entry gone, lease released or renewed
            e = self._entries[(record[2], record[3])]
            e.lease = _EXPIRED_LEASE
            self._live_leases -= 1
            n += 1
            if e.ref == 0:
                self._make_evictable(e)
        self._c["expirations"] += n
        return n

    def _set_lease(self, e: _Entry, expiry: float) -> None:
        self._seq += 1
        if e.lease != _LIVE_LEASE:
            self._live_leases += 1
        e.lease = _LIVE_LEASE
        e.expiry = expiry
        e.lease_seq = self._seq
        heapq.heappush(self._heap, (expiry, self._seq, e.user_id, e.fingerprint))
        self._c["leases"] += 1
        # Renewals and releases leave stale records behind; drop them once they outnumber the live ones.
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live_leases:
            self._heap = [r for r in self._heap if self._record_live(r)]
            heapq.heapify(self._heap)

    def _record_live(self, record: tuple[float, int, int, int]) -> bool:
        """Whether a lease-heap record still names a live lease (not released, renewed or gone)."""
        e = self._entries.get((record[2], record[3]))
        return e is not None and e.lease == _LIVE_LEASE and e.lease_seq == record[1]

    def _reclaim(self, n: int) -> Optional[list[int]]:
        """Take ``n`` pages, evicting LRU entries as needed; None (and no change) if impossible."""
        if len(self._free) + self._evictable_pages < n:
            return None
        while len(self._free) < n:
            key, _ = self._lru.popitem(last=False)
            e = self._entries.pop(key)
            self._drop_user_index(e)
            self._evictable_pages -= len(e.pages)
            self._free.extend(reversed(e.pages))
            self._c["evictions"] += 1
            self._c["evicted_pages"] += len(e.pages)
        pages = [self._free.pop() for _ in range(n)]
        self._c["allocations"] += n
        used = self._num_pages - len(self._free)
        if used > self._c["peak_used_pages"]:
            self._c["peak_used_pages"] = used
        return pages

    def _drop_user_index(self, e: _Entry) -> None:
        fps = self._by_user[e.user_id]
        del fps[e.fingerprint]
        if not fps:
            del self._by_user[e.user_id]

    @staticmethod
    def _array(pages: list[int]) -> np.ndarray:
        return np.asarray(pages, dtype=np.int32)

    # ------------------------------------------------------------------ public API
    def insert(self, user_id: int, fingerprint: int, num_tokens: int, ttl_s: float = 0.0,
               now: Optional[float] = None) -> Optional[np.ndarray]:
        """Create an entry for a prefix of ``num_tokens`` tokens and return its pages.

        The new entry is pinned by one reference (the caller writes its KV, then calls ``unpin``) and, when
        ``ttl_s > 0``, holds a lease for ``ttl_s`` seconds. LRU entries are evicted as needed.

        Returns
        -------
        numpy.ndarray of int32, shape [ceil(num_tokens / page_size)], or None
            The entry's page ids in token order; None when the pages cannot be had (counted as
            ``refused_inserts``) or the pinned-page budget would be exceeded (counted as ``refused_leases``).
            On None nothing changed.
        """
        u = _u64("user_id", user_id)
        f = _u64("fingerprint", fingerprint)
        n_tok = _count("num_tokens", num_tokens, 1)
        ttl = _seconds("ttl_s", ttl_s, positive=False)
        t = _now(now)
        with self._lock:
            if (u, f) in self._entries:
                raise ValueError(f"(user_id={u}, fingerprint={f}) is already cached; free() or extend() it")
            self._expire(t)
            n = self._pages_for(n_tok)
            if self._pinned_pages + n > self._max_pinned:
                self._c["refused_leases"] += 1
                return None
            pages = self._reclaim(n)
            if pages is None:
                self._c["refused_inserts"] += 1
                return None
            e = _Entry(u, f, n_tok, pages)
            e.ref = 1
            self._entries[(u, f)] = e
            self._by_user.setdefault(u, {})[f] = None
            self._pinned_pages += n
            if ttl > 0:
                self._set_lease(e, t + ttl)
            self._c["inserts"] += 1
            return self._array(pages)

    def extend(self, user_id: int, fingerprint: int, new_fingerprint: int, num_tokens: int,
               now: Optional[float] = None) -> Optional[np.ndarray]:
        """Grow a pinned entry to ``num_tokens`` tokens and re-key it to ``new_fingerprint``.

        The caller must hold a reference (``insert`` or ``pin``) while it writes the new tokens' KV.

        Returns
        -------
        numpy.ndarray of int32 or None
            All of the entry's pages in token order; None when the extra pages cannot be had or would cross the
            pinned-page budget (nothing changed).
        """
        nf = _u64("new_fingerprint", new_fingerprint)
        n_tok = _count("num_tokens", num_tokens, 1)
        t = _now(now)
        with self._lock:
            e = self._get(user_id, fingerprint)
            if e.ref == 0:
                raise ValueError(f"extend needs the entry pinned by the caller (ref count >= 1), got ref count 0 "
                                 f"for (user_id={e.user_id}, fingerprint={e.fingerprint})")
            if n_tok < e.num_tokens:
                raise ValueError(f"num_tokens must be >= the entry's {e.num_tokens} tokens, got {n_tok}")
            if nf != e.fingerprint and (e.user_id, nf) in self._entries:
                raise ValueError(f"(user_id={e.user_id}, fingerprint={nf}) is already cached")
            self._expire(t)
            extra = self._pages_for(n_tok) - len(e.pages)
            if extra > 0:
                if self._pinned_pages + extra > self._max_pinned:
                    self._c["refused_leases"] += 1
                    return None
                pages = self._reclaim(extra)
                if pages is None:
                    self._c["refused_inserts"] += 1
                    return None
                e.pages.extend(pages)
                self._pinned_pages += extra
            if nf != e.fingerprint:
                del self._entries[(e.user_id, e.fingerprint)]
                self._drop_user_index(e)
                e.fingerprint = nf
                self._entries[(e.user_id, nf)] = e
                self._by_user.setdefault(e.user_id, {})[nf] = None
                if e.lease == _LIVE_LEASE:  # move the heap record to the new key
                    self._set_lease(e, e.expiry)
                    self._c["leases"] -= 1
            e.num_tokens = n_tok
            self._c["extends"] += 1
            return self._array(e.pages)

    def pin(self, user_id: int, fingerprint: int, now: Optional[float] = None) -> Optional[np.ndarray]:
        """Take a reference on a cached entry (a ranking read); return its pages, or None on a miss."""
        u = _u64("user_id", user_id)
        f = _u64("fingerprint", fingerprint)
        t = _now(now)
        with self._lock:
            self._expire(t)
            e = self._entries.get((u, f))
            if e is None:
                self._c["misses"] += 1
                return None
            if not e.pinned():
                self._make_pinned(e)
            e.ref += 1
            self._c["hits"] += 1
            return self._array(e.pages)

    def unpin(self, user_id: int, fingerprint: int, now: Optional[float] = None) -> None:
        """Drop a reference taken by ``insert`` or ``pin``; the entry becomes most-recently-used."""
        t = _now(now)
        with self._lock:
            e = self._get(user_id, fingerprint)
            if e.ref == 0:
                raise ValueError(f"unpin of (user_id={e.user_id}, fingerprint={e.fingerprint}) which has "
                                 f"ref count 0 (expected >= 1)")
            self._expire(t)
            e.ref -= 1
            if not e.pinned():
                self._make_evictable(e)

    def lease(self, user_id: int, fingerprint: int, ttl_s: float, now: Optional[float] = None) -> bool:
        """Pin a cached entry for ``ttl_s`` seconds (or extend its lease). False if over the pinned budget."""
        ttl = _seconds("ttl_s", ttl_s, positive=True)
        t = _now(now)
        with self._lock:
            e = self._get(user_id, fingerprint)
            self._expire(t)
            if e.pinned():
                self._set_lease(e, max(t + ttl, e.expiry if e.lease == _LIVE_LEASE else t + ttl))
                return True
            if self._pinned_pages + len(e.pages) > self._max_pinned:
                self._c["refused_leases"] += 1
                return False
            self._make_pinned(e)
            self._set_lease(e, t + ttl)
            return True

    def release_lease(self, user_id: int, fingerprint: int, now: Optional[float] = None) -> bool:
        """End an entry's lease.

        Returns True when a live lease ended, False when it had already expired (the expiry is counted).
        Raises ValueError when the entry has no lease to end (never leased, or already released).
        """
        t = _now(now)
        with self._lock:
            e = self._get(user_id, fingerprint)
            if e.lease == _NO_LEASE:
                raise ValueError(f"release_lease of (user_id={e.user_id}, fingerprint={e.fingerprint}) which "
                                 f"holds no lease (never leased or already released)")
            self._expire(t)
            live = e.lease == _LIVE_LEASE
            self._live_leases -= live
            e.lease = _NO_LEASE
            self._seq += 1
            e.lease_seq = self._seq  # orphan the heap record
            if live and e.ref == 0:
                self._make_evictable(e)
            return live

    def has_lease(self, user_id: int, fingerprint: int, now: Optional[float] = None) -> bool:
        """True while the entry holds a live lease."""
        t = _now(now)
        with self._lock:
            e = self._get(user_id, fingerprint)
            self._expire(t)
            return e.lease == _LIVE_LEASE

    def free(self, user_id: int, fingerprint: int, now: Optional[float] = None) -> None:
        """Drop an unpinned entry and return its pages to the free list."""
        t = _now(now)
        with self._lock:
            e = self._get(user_id, fingerprint)
            self._expire(t)
            if e.pinned():
                raise ValueError(f"free of pinned (user_id={e.user_id}, fingerprint={e.fingerprint}): ref count "
                                 f"{e.ref}, lease live={e.lease == _LIVE_LEASE} (expected unpinned)")
            del self._lru[(e.user_id, e.fingerprint)]
            del self._entries[(e.user_id, e.fingerprint)]
            self._drop_user_index(e)
            self._evictable_pages -= len(e.pages)
            self._free.extend(reversed(e.pages))
            self._c["frees"] += 1

    def expire(self, now: Optional[float] = None) -> int:
        """Expire leases whose deadline has passed; return how many expired."""
        t = _now(now)
        with self._lock:
            return self._expire(t)

    def lookup(self, user_id: int, fingerprint: int) -> Optional[int]:
        """The cached entry's token count, or None. Does not touch LRU order or counters."""
        key = (_u64("user_id", user_id), _u64("fingerprint", fingerprint))
        with self._lock:
            e = self._entries.get(key)
            return None if e is None else e.num_tokens

    def entries_of(self, user_id: int) -> list[tuple[int, int]]:
        """``[(fingerprint, num_tokens), ...]`` of a user's cached entries, oldest insert first."""
        u = _u64("user_id", user_id)
        with self._lock:
            fps = self._by_user.get(u, {})
            return [(f, self._entries[(u, f)].num_tokens) for f in fps]

    def pages_of(self, user_id: int, fingerprint: int) -> np.ndarray:
        """The entry's page ids (int32) in token order. KeyError if not cached."""
        with self._lock:
            return self._array(self._get(user_id, fingerprint).pages)

    def page_table(self, keys: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Paged-KV page table of a batch of entries (FlashInfer / NVIDIA HSTU layout).

        Parameters
        ----------
        keys : sequence of (user_id, fingerprint), length B

        Returns
        -------
        kv_indptr : int32 [B+1]
            Offsets into ``kv_indices``.
        kv_indices : int32 [nnz]
            Page ids, entry after entry, in token order.
        kv_last_page_len : int32 [B]
            Tokens in each entry's last page, in ``1 .. page_size``.
        """
        with self._lock:
            entries = [self._get(u, f) for u, f in keys]
            indptr = np.zeros(len(entries) + 1, dtype=np.int32)
            last = np.empty(len(entries), dtype=np.int32)
            for i, e in enumerate(entries):
                indptr[i + 1] = indptr[i] + len(e.pages)
                last[i] = e.num_tokens - (len(e.pages) - 1) * self._page_size
            indices = np.empty(int(indptr[-1]), dtype=np.int32)
            for i, e in enumerate(entries):
                indices[indptr[i]:indptr[i + 1]] = e.pages
            return indptr, indices, last

    def stats(self) -> dict[str, int]:
        """Counters and gauges as a flat dict of ints."""
        with self._lock:
            s = dict(self._c)
            s.update(entries=len(self._entries), free_pages=len(self._free), used_pages=self.num_used_pages,
                     pinned_pages=self._pinned_pages, evictable_pages=self._evictable_pages,
                     num_pages=self._num_pages, max_pinned_pages=self._max_pinned)
            return s

    def check_invariants(self) -> None:
        """Assert the pool's internal invariants (tests and debugging); raises AssertionError."""
        with self._lock:
            owner = {}
            pinned = evictable = 0
            for key, e in self._entries.items():
                assert key == (e.user_id, e.fingerprint), key
                assert len(e.pages) == self._pages_for(e.num_tokens), (key, len(e.pages), e.num_tokens)
                assert e.fingerprint in self._by_user.get(e.user_id, {}), key
                for p in e.pages:
                    assert 0 <= p < self._num_pages and p not in owner, (key, p)
                    owner[p] = key
                if e.pinned():
                    pinned += len(e.pages)
                    assert key not in self._lru, key
                else:
                    evictable += len(e.pages)
                    assert key in self._lru, key
            assert len(self._lru) == sum(1 for e in self._entries.values() if not e.pinned())
            assert sum(len(v) for v in self._by_user.values()) == len(self._entries)
            free = set(self._free)
            assert len(free) == len(self._free), "page on the free list twice"
            assert not free & owner.keys(), "page both free and owned"
            assert len(free) + len(owner) == self._num_pages, "page lost"
            assert pinned == self._pinned_pages and evictable == self._evictable_pages
            live = sum(1 for e in self._entries.values() if e.lease == _LIVE_LEASE)
            assert live == self._live_leases, (live, self._live_leases)
            assert sum(1 for r in self._heap if self._record_live(r)) == live, "live lease without a heap record"
