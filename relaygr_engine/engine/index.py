"""Prefix identity and longest-common-prefix matching over a user's cached entries."""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import numpy as np

from .records import Hit, Key, Prepared

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Fingerprints of history prefixes, and the token keys of every cached entry (device or DRAM).

    The fingerprint of the first ``n`` tokens hashes the model identity, whether the history has action ids and
    timestamps, and the first ``n`` rows of :meth:`Behaviors.token_keys`. The index keeps each entry's token rows,
    so a request can reuse the *longest common prefix* of its history and any entry of its user.

    Parameters
    ----------
    pool : PrefixBlockPool
        The device tier (``lookup``, ``entries_of``).
    dram : HostKVTier or None
        The DRAM tier (``in``, ``entries_of``).
    identity : callable () -> int
        The model identity now (changes when the weights change).
    """

    def __init__(self, pool, dram, identity: Callable[[], int]) -> None:
        self.pool, self.dram, self.identity = pool, dram, identity
        # user -> fingerprint -> (model identity, flags, token keys) of each entry of either tier
        self._entry_keys: dict[int, dict[int, tuple]] = {}
        self._prune_at = 1024
        self._held: Optional[int] = None  # the identity read once for the engine call running now

    def reset(self, pool, dram) -> None:
        """Forget every entry's record and follow the tiers ``pool`` and ``dram`` (an emptied cache)."""
        self.pool, self.dram = pool, dram
        self._entry_keys.clear()
        self._prune_at = 1024

    @contextmanager
    def held(self) -> Iterator[int]:
        """Read the model identity once for one engine call (under the engine lock): every fingerprint and match
        inside uses that value instead of rehashing the weights' versions per request."""
        outer = self._held
        self._held = self.identity() if outer is None else outer
        try:
            yield self._held
        finally:
            self._held = outer

    def current(self) -> int:
        """The model identity: the held one inside :meth:`held`, else read now."""
        return self.identity() if self._held is None else self._held

    @staticmethod
    def flags(p: Prepared) -> bytes:
        return bytes([p.history.action_ids is not None, p.history.timestamps is not None])

    def fingerprints(self, p: Prepared, lengths) -> dict[int, int]:
        """Fingerprints of the first ``n`` tokens of ``p`` for each ``n`` in ``lengths``."""
        h = hashlib.blake2b(digest_size=8)
        h.update(self.current().to_bytes(8, "little"))
        h.update(self.flags(p))
        out, done = {}, 0
        for n in sorted(set(lengths)):
            h.update(p.keys[done:n].tobytes())
            done = n
            out[n] = int.from_bytes(h.copy().digest(), "little")
        return out

    def fingerprint(self, p: Prepared, n: int) -> int:
        return self.fingerprints(p, [n])[n]

    def _live(self, u: int, fp: int) -> bool:
        return self.pool.lookup(u, fp) is not None or (self.dram is not None and (u, fp) in self.dram)

    def record(self, key: Key, p: Prepared, n: int) -> None:
        """Remember that the first ``n`` tokens of the new or re-keyed entry ``key`` are ``p``'s first ``n``.

        Records of entries that neither tier holds any more are dropped for the user here, and for every user now
        and then.
        """
        u, fp = key
        recs = self._entry_keys.setdefault(u, {})
        for old in [f for f in recs if f != fp and not self._live(u, f)]:
            del recs[old]
        recs[fp] = (self.current(), self.flags(p), p.keys[:n])
        if len(self._entry_keys) > self._prune_at:
            for user in [v for v in self._entry_keys if v != u]:
                kept = {f: r for f, r in self._entry_keys[user].items() if self._live(user, f)}
                if kept:
                    self._entry_keys[user] = kept
                else:
                    del self._entry_keys[user]
            self._prune_at = max(1024, 2 * len(self._entry_keys))

    def _common(self, p: Prepared, fp: int, n: int, limit: int, identity: int) -> Optional[int]:
        """Leading tokens (``<= min(n, limit)``) that the user's entry ``fp`` of ``n`` tokens shares with ``p``.

        None when the entry has no record (then only the exact fingerprint of its ``n`` tokens can match).
        """
        rec = self._entry_keys.get(p.user_id, {}).get(fp)
        if rec is None:
            return None
        ident, flags, ek = rec
        if ident != identity or flags != self.flags(p):
            return 0
        k = min(n, limit, ek.shape[0], p.num_tokens)
        if np.array_equal(ek[:k], p.keys[:k]):
            return k
        diff = np.flatnonzero((ek[:k] != p.keys[:k]).any(axis=1))
        return k if diff.size == 0 else int(diff[0])

    def match(self, p: Prepared, max_tokens: int, skip=(), entries=None) -> Optional[Hit]:
        """The user's cached entry sharing the most leading tokens with ``p`` (at most ``max_tokens``), or None.

        ``entries`` (default: the pool's entries of the user) lists the candidates, e.g. the DRAM tier's. A hit
        may use only the leading part of a longer entry (``usable < num_tokens``): the KV of a token depends on the
        tokens before it only, so any prefix of a cached entry is exact. Ties prefer the shorter entry.
        """
        u = p.user_id
        if entries is None:
            entries = self.pool.entries_of(u)
        entries = [(fp, n) for fp, n in entries if (u, fp) not in skip]
        if not entries:
            return None
        identity = self.current()
        best = None
        for fp, n in entries:
            m = self._common(p, fp, n, max_tokens, identity)
            if m is None:  # no record: exact prefix only
                m = n if n <= min(max_tokens, p.num_tokens) and self.fingerprint(p, n) == fp else 0
            if m > 0 and (best is None or m > best.usable or (m == best.usable and n < best.num_tokens)):
                best = Hit(fp, n, m)
        return best
