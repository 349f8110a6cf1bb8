"""Pre-infers in chunks on a replica, so that a ranking waits for one chunk at most.

A pre-infer of a long prefix is one long engine call; a ranking that arrives meanwhile waits for all of it (the
engine gate never interrupts a call). With ``ReplicaSpec.prefill_chunk_tokens = N`` a replica pre-infers a
prefix as calls on growing prefixes of at most ``N`` new tokens each (each extends the entry the previous one
cached), passing the gate before every chunk: a waiting ranking goes between two chunks, and the rest of a
pre-infer whose user's ranking has arrived is dropped (the ranking reads what the chunks cached). This is the
chunking of the in-process relay worker (``bench slo --chunk-tokens``).

The engine asks its trigger about every prefill call. :class:`WholePrefixTrigger` wraps the replica's trigger so
that the chunks of one pre-infer are judged once, on the whole prefix (what its ranking would cost without a
cache), with the whole prefix's pages reserved until the pre-infer ends; a prefill call outside a chunked
pre-infer is passed through unchanged.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

__all__ = ["WholePrefixTrigger", "chunk_targets"]


def chunk_targets(cached: int, length: int, chunk: int) -> list[int]:
    """The prefix lengths (behaviors) of a chunked pre-infer: from ``cached`` behaviors already held, steps of at
    most ``chunk`` up to ``length`` (``chunk`` 0: one call)."""
    if chunk <= 0 or length <= 0:
        return [length]
    start = min(max(cached, 0), length)
    return list(range(start + chunk, length, chunk)) + [length]


class _Whole:
    """One chunked pre-infer: its whole length and the decision made on it."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.decision = None


class WholePrefixTrigger:
    """The replica's trigger, deciding once per chunked pre-infer on the whole prefix (see the module doc).

    Parameters
    ----------
    trigger : SequenceAwareTrigger
        What decides (``decide``, ``on_prefill_done``, ``stats``); every other attribute is the trigger's.
    page_size : int
        The cache's page size (the whole prefix's pages are what is reserved).
    """

    def __init__(self, trigger, page_size: int) -> None:
        self.trigger, self.page_size = trigger, int(page_size)
        self._current: Optional[_Whole] = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.trigger, name)

    def open(self, num_tokens: int) -> _Whole:
        """Begin a chunked pre-infer of ``num_tokens`` tokens."""
        return _Whole(int(num_tokens))

    @contextlib.contextmanager
    def chunk(self, whole: _Whole) -> Iterator[None]:
        """Around one chunk's engine call (the engine runs one call at a time)."""
        with self._lock:
            self._current = whole
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def close(self, whole: _Whole, now: Optional[float] = None) -> None:
        """The chunked pre-infer is over (done, declined or cut short): its reservation is released."""
        if whole.decision is not None and whole.decision.admit:
            self.trigger.on_prefill_done(whole.num_tokens, now=now)

    def decide(self, *, history_len: int, num_candidates=None, prefix_pages: int, pinned_pages: int, num_pages: int,
               now: Optional[float] = None, reserve: bool = False):
        whole = self._current
        if whole is None:
            return self.trigger.decide(history_len=history_len, num_candidates=num_candidates,
                                       prefix_pages=prefix_pages, pinned_pages=pinned_pages, num_pages=num_pages,
                                       now=now, reserve=reserve)
        if whole.decision is None:
            whole.decision = self.trigger.decide(history_len=whole.num_tokens, num_candidates=num_candidates,
                                                 prefix_pages=-(-whole.num_tokens // self.page_size),
                                                 pinned_pages=pinned_pages, num_pages=num_pages, now=now,
                                                 reserve=True)
        return whole.decision

    def on_prefill_done(self, tokens: int, now: Optional[float] = None) -> None:
        if self._current is None:   # a chunk's end is reported once, by close()
            self.trigger.on_prefill_done(tokens, now=now)
