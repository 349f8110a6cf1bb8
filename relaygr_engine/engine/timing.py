"""Timing device work without waiting for it (the expander's cost estimates on the ranking hot path)."""
from __future__ import annotations

import collections
import time
from typing import Any, NamedTuple

import torch

__all__ = ["LazyTimer"]


class _Mark(NamedTuple):
    start: Any           # host seconds, or a recorded torch.cuda.Event
    work: int            # what the span processed (tokens, bytes)


class LazyTimer:
    """Durations of spans of device work, read without synchronising.

    On the CPU a span is timed by the host clock and is ready at once. On CUDA, :meth:`start` and :meth:`stop`
    record timing events on the current stream, and a span is ready once its end event has completed, found by
    polling (``Event.query``) at later calls; nothing waits for the device. At most ``max_pending`` spans wait
    (the oldest are dropped: they are estimates, not results).

    Parameters
    ----------
    device : torch.device
    max_pending : int
    """

    def __init__(self, device: torch.device, max_pending: int = 64) -> None:
        self.cuda = device.type == "cuda"
        self.pending: collections.deque = collections.deque(maxlen=max_pending)

    def start(self, work: int) -> _Mark:
        """Begin a span that processes ``work`` units."""
        if not self.cuda:
            return _Mark(time.perf_counter(), work)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return _Mark(ev, work)

    def stop(self, mark: _Mark) -> list[tuple[int, float]]:
        """End ``mark``'s span; return ``(work, seconds)`` of every span now complete (this one on the CPU)."""
        if not self.cuda:
            return [(mark.work, time.perf_counter() - mark.start)]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((mark, end))
        done = []
        while self.pending and self.pending[0][1].query():
            m, e = self.pending.popleft()
            done.append((m.work, m.start.elapsed_time(e) / 1e3))
        return done
