"""Device time of one call, for the kernel benchmarks.

A call of the paged prefix-attention kernel costs its host side too (argument checks, the autotuner's lookup, the
launch): about a millisecond in Python, more than the kernel takes on a GPU at the shapes a ranking runs. Events
recorded around one eager call then measure the host, not the kernel. :func:`device_seconds` therefore times CUDA
calls as the engine runs them in production: captured once in a CUDA graph and replayed, each timed replay after a
write of a buffer larger than the L2 cache (so every replay reads its K/V from HBM, as a layer of a ranking does,
and the GPU is busy while the host enqueues the replay). Calls that cannot be captured (they read the device from
the host) are timed eagerly, and say so.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ..engine.graphs import reset_rng_after_failed_capture
from .common import median_time, percentile, sync

__all__ = ["device_seconds"]

log = logging.getLogger(__name__)

_FLUSH_BYTES = 256 << 20        # larger than any GPU's L2 cache (H100: 50 MB, H200: 60 MB)
_flush: dict = {}


def _flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _flush:
        _flush[key] = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device=device)
    return _flush[key]


def _capture(fn: Callable[[], object], device: torch.device):
    """``fn`` captured in a CUDA graph, or None (logged) where it cannot be."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:  # a host read of device memory, or an op that refuses capture
        log.warning("timing eagerly: the call cannot be captured in a CUDA graph (%s)", str(exc).splitlines()[0])
        reset_rng_after_failed_capture(device)
        sync(device)
        return None
    return graph


def device_seconds(fn: Callable[[], object], device: torch.device, warmup: int, iters: int, *,
                   graph: bool = True) -> float:
    """Median seconds of ``fn`` over ``iters`` timed runs after ``warmup`` runs.

    On CUDA with ``graph`` (the default) ``fn`` is captured once after the warm-up and its replays are timed, each
    between two events after an L2 flush: the time of the GPU work alone. Without ``graph``, or where ``fn`` cannot
    be captured, each eager call is timed between events, its host time included. Elsewhere: wall time of each call
    between synchronisations (:func:`~relaygr_engine.bench.common.median_time`).
    """
    if device.type != "cuda":
        return median_time(fn, device, iters, warmup=warmup)
    for _ in range(warmup):
        fn()
    sync(device)
    captured = _capture(fn, device) if graph else None
    run = captured.replay if captured is not None else fn
    flush = _flush_buffer(device)
    events = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        events.append((start, end))
    sync(device)
    times = [s.elapsed_time(e) / 1e3 for s, e in events]
    del captured
    return percentile(times, 50)
