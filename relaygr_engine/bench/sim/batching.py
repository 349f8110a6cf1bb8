"""Queues and batching: which queued rankings one worker call serves together.

Continuous batching of rankings: when a worker is free it takes the oldest queued ranking and, behind it, more
queued rankings in arrival order, up to ``max_batch`` requests and ``max_tokens`` tokens (each request counts its
history plus its candidates: the rows a ranking without a cache computes, which bounds the rows a cached one
does). It never waits for a batch to fill: a batch is what is queued when the worker is free, so batching costs
no latency at low load and amortises per-call overhead under load. The batch runs as one call (the engine's
``rank_with_prefix_batch``: one varlen forward, no padding).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

from ...config import _positive_int
from ...policy import _checks

__all__ = ["BatchPolicy"]


@dataclass(frozen=True)
class BatchPolicy:
    """How many queued rankings one call serves.

    Parameters
    ----------
    max_batch : int
        Requests per call (>= 1; 1: one at a time).
    max_tokens : int
        Token budget of a call (>= 0; 0: no bound). The first request is always taken, whatever its size.
    """

    max_batch: int = 1
    max_tokens: int = 0

    def __post_init__(self) -> None:
        _positive_int("max_batch", self.max_batch)
        _checks.count("max_tokens", self.max_tokens)

    def take(self, queue: collections.deque, tokens: Callable[[int], int]) -> list[int]:
        """Pop the next batch off ``queue`` (oldest first; it must not be empty); ``tokens(i)`` sizes request ``i``."""
        batch = [queue.popleft()]
        used = tokens(batch[0])
        while queue and len(batch) < self.max_batch:
            more = tokens(queue[0])
            if self.max_tokens and used + more > self.max_tokens:
                break
            batch.append(queue.popleft())
            used += more
        return batch
