"""Prefix identity and longest-common-prefix matching over a user's cached entries.

A ranking's lookup compares the request's raw token arrays (item ids, actions, times, contextual ids) with copies
the index keeps of each entry's tokens, at memory-compare speed, and builds no token keys: the comparison is
exact, row for row the comparison of :meth:`Behaviors.token_keys` rows it stands for (:func:`common_tokens`). A
fingerprint of a longer history that extends a recorded entry (a ranking's extension, a chunked pre-infer) hashes
only the new tokens' key rows, from the hash state the record kept after its own tokens.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..behaviors import Behaviors
from .records import Hit, Key, Prepared

__all__ = ["EntryTokens", "PrefixIndex", "common_tokens"]


@dataclass(frozen=True, eq=False)
class EntryTokens:
    """Copies of the raw data of a history's first ``n`` tokens (what a cached entry holds), as bytes: a request's
    arrays compare with them in one copy and one memory compare each.

    Attributes
    ----------
    n, num_context : int
        Tokens kept, and the history's contextual tokens ``U`` (its first ``min(U, n)`` tokens are contextual).
    context : bytes of int64 [min(U, n)] or None
    items, actions, times : bytes of int64 [n - min(U, n)] (``actions``/``times`` None without them)
    ts0 : int
        The history's first behavior's time (its contextual tokens' time; 0 without timestamps).
    """

    n: int
    num_context: int
    context: Optional[bytes]
    items: bytes
    actions: Optional[bytes]
    times: Optional[bytes]
    ts0: int

    @classmethod
    def of(cls, history: Behaviors, n: int) -> "EntryTokens":
        items, actions, times, context = history.arrays()
        U = history.num_context_tokens
        u, b = min(U, n), n - min(U, n)
        cut = (lambda a, k: None if a is None else np.ascontiguousarray(a[:k], dtype=np.int64).tobytes())
        return cls(n, U, cut(context, u), cut(items, b), cut(actions, b), cut(times, b),
                   int(times[0]) if times is not None and len(times) else 0)


def _agree(kept: bytes, a: np.ndarray, m: int) -> int:
    """Leading entries of ``a[:m]`` equal to the int64 entries ``kept`` holds (at least ``m``): one copy and a
    memory compare when all are."""
    mine = a[:m].tobytes()
    if mine == (kept if len(kept) == len(mine) else kept[:len(mine)]):
        return m
    return int(np.flatnonzero(np.frombuffer(kept, np.int64, m) != a[:m])[0])


def common_tokens(e: EntryTokens, history: Behaviors, k: int) -> int:
    """Leading tokens (at most ``k <= min(e.n, T)``) whose :meth:`Behaviors.token_keys` rows agree between the
    entry ``e`` and ``history`` (of the same presence of action ids and timestamps).

    Row ``t < U`` is ``(0, context[t], -1, ts0)``, row ``U + i`` is ``(1, item[i], action[i] or -1, time[i] or
    0)``: contextual rows agree where the ids do and ``ts0`` does; where the two ``U`` differ, row ``min(U)`` has
    kinds 0 and 1; behavior rows agree where the item, action and time arrays do.
    """
    items, actions, times, context = history.arrays()
    U, Ue = history.num_context_tokens, e.num_context
    u = min(U, Ue, k)
    if u:
        if times is not None and e.ts0 != int(times[0]):
            return 0
        d = _agree(e.context, context, u)
        if d < u:
            return d
    if U != Ue:
        return min(U, Ue, k)
    m = k - U
    if m <= 0:
        return k
    for kept, theirs in ((e.items, items), (e.actions, actions), (e.times, times)):
        if kept is not None and m:
            m = _agree(kept, theirs, m)
    return U + m


@dataclass(frozen=True, eq=False)
class _Record:
    """What the index keeps of an entry: the model identity and flags it was computed under, its tokens, and the
    fingerprint's hash state after them (to extend it by new tokens only)."""

    identity: int
    flags: bytes
    tokens: EntryTokens
    state: object  # hashlib.blake2b after identity, flags and the n tokens' key rows


class _Held:
    """:meth:`PrefixIndex.held`'s context (a class: cheaper to enter than a generator's)."""

    __slots__ = ("index", "outer")

    def __init__(self, index: "PrefixIndex") -> None:
        self.index = index

    def __enter__(self) -> int:
        index = self.index
        self.outer = outer = index._held
        index._held = held = index.identity() if outer is None else outer
        return held

    def __exit__(self, *exc) -> bool:
        self.index._held = self.outer
        return False


class PrefixIndex:
    """Fingerprints of history prefixes, and the tokens of every cached entry (device or DRAM).

    The fingerprint of the first ``n`` tokens hashes the model identity, whether the history has action ids and
    timestamps, and the first ``n`` rows of :meth:`Behaviors.token_keys`. The index keeps each entry's tokens, so a
    request can reuse the *longest common prefix* of its history and any entry of its user.

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
        self._records: dict[int, dict[int, _Record]] = {}  # user -> fingerprint -> record, entries of either tier
        self._prune_at = 1024
        self._held: Optional[int] = None  # the identity read once for the engine call running now

    def reset(self, pool, dram) -> None:
        """Forget every entry's record and follow the tiers ``pool`` and ``dram`` (an emptied cache)."""
        self.pool, self.dram = pool, dram
        self._records.clear()
        self._prune_at = 1024

    def held(self) -> "_Held":
        """Read the model identity once for one engine call (under the engine lock; a context manager): every
        fingerprint and match inside uses that value instead of reading the weights' counters per request."""
        return _Held(self)

    def current(self) -> int:
        """The model identity: the held one inside :meth:`held`, else read now."""
        return self.identity() if self._held is None else self._held

    @staticmethod
    def flags(p: Prepared) -> bytes:
        return bytes([p.history.action_ids is not None, p.history.timestamps is not None])

    def _state(self, p: Prepared, n: int, base: Optional[Hit] = None):
        """The fingerprint's hash state after ``p``'s first ``n`` tokens: from ``base``'s record when ``base`` is a
        recorded entry all of whose tokens are ``p``'s (its rows then are not hashed again), else from the start."""
        ident = self.current()
        memo = p.__dict__.setdefault("_states", {})  # (identity, n) -> state, of this request (never updated)
        h = memo.get((ident, n))
        if h is not None:
            return h
        rec = None if base is None else self._records.get(p.user_id, {}).get(base.fp)
        if rec is not None and base.usable == base.num_tokens == rec.tokens.n <= n and rec.identity == ident \
                and rec.flags == self.flags(p):
            h, done = rec.state.copy(), rec.tokens.n
        else:
            h, done = hashlib.blake2b(digest_size=8), 0
            h.update(ident.to_bytes(8, "little"))
            h.update(self.flags(p))
        if n > done:
            h.update(p.key_rows(done, n).tobytes())
        memo[(ident, n)] = h
        return h

    def fingerprints(self, p: Prepared, lengths) -> dict[int, int]:
        """Fingerprints of the first ``n`` tokens of ``p`` for each ``n`` in ``lengths``."""
        h = hashlib.blake2b(digest_size=8)
        h.update(self.current().to_bytes(8, "little"))
        h.update(self.flags(p))
        out, done = {}, 0
        for n in sorted(set(lengths)):
            h.update(p.key_rows(done, n).tobytes())
            done = n
            out[n] = int.from_bytes(h.copy().digest(), "little")
        return out

    def fingerprint(self, p: Prepared, n: int, base: Optional[Hit] = None) -> int:
        """The fingerprint of ``p``'s first ``n`` tokens; ``base``: a hit of ``p`` on a recorded entry whose tokens
        all are ``p``'s (only the tokens after it are hashed; the value is the same)."""
        return int.from_bytes(self._state(p, n, base).digest(), "little")

    def _live(self, u: int, fp: int) -> bool:
        return self.pool.lookup(u, fp) is not None or (self.dram is not None and (u, fp) in self.dram)

    def record(self, key: Key, p: Prepared, n: int, base: Optional[Hit] = None) -> None:
        """Remember that the first ``n`` tokens of the new or re-keyed entry ``key`` are ``p``'s first ``n``
        (``base``: as for :meth:`fingerprint`).

        Records of entries that neither tier holds any more are dropped for the user here, and for every user now
        and then.
        """
        u, fp = key
        recs = self._records.setdefault(u, {})
        for old in [f for f in recs if f != fp and not self._live(u, f)]:
            del recs[old]
        recs[fp] = _Record(self.current(), self.flags(p), EntryTokens.of(p.history, n), self._state(p, n, base))
        if len(self._records) > self._prune_at:
            for user in [v for v in self._records if v != u]:
                kept = {f: r for f, r in self._records[user].items() if self._live(user, f)}
                if kept:
                    self._records[user] = kept
                else:
                    del self._records[user]
            self._prune_at = max(1024, 2 * len(self._records))

    def _common(self, p: Prepared, fp: int, n: int, limit: int, identity: int) -> Optional[int]:
        """Leading tokens (``<= min(n, limit)``) that the user's entry ``fp`` of ``n`` tokens shares with ``p``.

        None when the entry has no record (then only the exact fingerprint of its ``n`` tokens can match).
        """
        rec = self._records.get(p.user_id, {}).get(fp)
        if rec is None:
            return None
        if rec.identity != identity or rec.flags != self.flags(p):
            return 0
        return common_tokens(rec.tokens, p.history, min(n, limit, rec.tokens.n, p.num_tokens))

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
