"""The serving modes as the worker sees them: outcomes, the service protocol, the request tensors, the baseline.

A *service* adapts one mode to the worker loop (:mod:`.clock`): ``rank(req, now) -> RankOutcome`` and
``prefill(req, now) -> PrefillOutcome`` (both do the real work), ``wants_prefill`` (False for the baseline),
``stats()``. :class:`BaselineService` runs full inference on the critical path; the relay service is in
:mod:`.relay`.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from ...workload.requests import Request

__all__ = ["Mode", "BaselineImpl", "RankOutcome", "PrefillOutcome", "Service", "BaselineService", "to_behaviors",
           "cpu_timer", "cpu_timer_valid", "service_clock"]


class Mode(str, enum.Enum):
    """Serving modes compared on the same request stream."""

    BASELINE = "baseline"                      # full inference on the critical path (model.rank_full)
    RELAY = "relay"                            # trigger + HBM prefix cache + DRAM expander
    RELAY_NO_EXPANDER = "relay_no_expander"    # trigger + HBM prefix cache, no DRAM tier


@dataclass(frozen=True)
class RankOutcome:
    """What a ranking call reports: where its prefix came from and the tokens cached vs computed."""

    source: str                 # "full" (baseline), "hbm", "dram" or "recompute"
    cached_tokens: int = 0
    computed_tokens: int = 0


@dataclass(frozen=True)
class PrefillOutcome:
    """What a pre-infer call reports: admitted (its prefix part is cached and leased) or not, and why.

    ``remaining``: a chunk was cached and more of the prefix is left (the worker calls again unless the ranking
    request arrives first). ``payload``: the packed prefix a pre-infer-only worker ships to the ranking worker
    (``service.ship(payload)`` copies it there), with ``pack_s`` the measured time its packing took.
    """

    admitted: bool
    reason: str = ""
    remaining: bool = False
    payload: Any = None
    pack_s: float = 0.0


class Service(Protocol):
    """One serving mode as the worker sees it."""

    wants_prefill: bool

    def rank(self, req: Request, now: float) -> RankOutcome: ...

    def prefill(self, req: Request, now: float) -> PrefillOutcome: ...

    def cancel(self, req: Request, now: float) -> None: ...

    def stats(self) -> dict: ...


# ----------------------------------------------------------------------------------------------- adapters
def to_behaviors(req: Request, length: Optional[int] = None, device: str = "cpu"):
    """The request's history (or its first ``length`` tokens) as ``relaygr_engine.Behaviors`` on ``device``."""
    import torch

    from ...models import Behaviors

    n = req.history_len if length is None else length
    return Behaviors(item_ids=torch.from_numpy(np.ascontiguousarray(req.item_ids[:n])).to(device),
                     action_ids=torch.from_numpy(np.ascontiguousarray(req.action_ids[:n])).to(device),
                     timestamps=torch.from_numpy(np.ascontiguousarray(req.timestamps[:n])).to(device))


class _Tensors:
    """Tensors of each request (history, candidates), built once so conversions stay off the measured path."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._cache: dict[int, tuple] = {}

    def prepare(self, requests) -> None:
        import torch

        for r in requests:
            if id(r) not in self._cache:
                self._cache[id(r)] = (to_behaviors(r, device=self.device),
                                      torch.from_numpy(np.ascontiguousarray(r.candidates)).to(self.device))

    def get(self, req: Request) -> tuple:
        if id(req) not in self._cache:
            self.prepare([req])
        return self._cache[id(req)]


class BaselineImpl(str, enum.Enum):
    """How the baseline runs full inference."""

    PAGED = "paged"    # model.rank_uncached: the engine's attention op with an empty prefix (same kernels as relay)
    DENSE = "dense"    # model.rank_full: dense masked N x N attention (the oracle)


class BaselineService:
    """Full inference on the critical path, no pre-infer.

    ``impl="paged"`` (default) runs ``model.rank_uncached``: the same attention kernels as the relay engine with no
    cached prefix, so the comparison isolates the cache. ``impl="dense"`` runs ``model.rank_full`` (the dense
    oracle, several times slower on long histories: a baseline that would flatter the cache).
    """

    wants_prefill = False
    stateless = True  # no state carries from one request to the next: warm-up requests need not run

    def __init__(self, model, device: str = "cpu", impl: str = "paged", cuda_graphs: bool = False,
                 compile_model: bool = False, page_size: int = 16) -> None:
        from ...config import check_int, parse_choice

        self.model = model
        self.impl = parse_choice(BaselineImpl, impl, "impl")
        for name, on in (("cuda_graphs", cuda_graphs), ("compile_model", compile_model)):
            if on and self.impl is not BaselineImpl.PAGED:
                raise ValueError(f"{name} applies to impl='paged', got impl={self.impl.value!r}")
        self.cuda_graphs, self.compile_model = cuda_graphs, compile_model
        self.page_size = check_int("page_size", page_size, 1)
        self._rank = model.rank_uncached if self.impl is BaselineImpl.PAGED else model.rank_full
        if cuda_graphs or compile_model:  # through the cache-less engine, graphed / compiled like the relay's
            self._rank = (lambda h, c, request_time:
                          self._uncached().rank_with_prefix(0, h, c, request_time=request_time).scores)
        self._t = _Tensors(device)
        self._engine = None

    def prepare(self, requests) -> None:
        self._t.prepare(requests)

    def reset(self, trigger=None) -> None:
        """Serve a new run as a freshly built service would (its cache-less engine's counters zeroed, graphs and
        compiled model kept; no request tensors kept). ``trigger``: unused (the baseline never pre-infers)."""
        if self._engine is not None:
            self._engine.reset()
        self._t = _Tensors(self._t.device)

    def rank(self, req: Request, now: float) -> RankOutcome:
        hist, cands = self._t.get(req)
        self.score(hist, cands, request_time=req.request_ts)
        return RankOutcome("full", 0, req.history_len + int(cands.shape[0]))

    def score(self, history, candidates, request_time: Optional[int] = None):
        """Full inference of one request's tensors as :meth:`rank` serves it (same implementation, graphs and
        compilation), finished on the device: ``[C, num_tasks]`` scores. The latency model is calibrated on it."""
        import torch

        with torch.inference_mode():
            scores = self._rank(history, candidates, request_time=request_time)
        _sync(scores)
        return scores

    def rank_batch(self, reqs: list[Request], now: float) -> list[RankOutcome]:
        """Full inference of ``reqs`` in one varlen forward: a cache-less engine's batch (every prefix computed).

        The paged implementation only; ValueError for ``impl="dense"`` (one request per call).
        """
        import torch

        from ...engine import RankRequest

        if self.impl is not BaselineImpl.PAGED:
            raise ValueError(f"a batched baseline needs impl='paged', got impl={self.impl.value!r}")
        batch = [RankRequest(r.user_id, *self._t.get(r), None, r.request_ts) for r in reqs]
        with torch.inference_mode():
            results = self._uncached().rank_with_prefix_batch(batch, now=now)
        _sync(results[-1].scores)
        return [RankOutcome("full", 0, r.history_len + int(r.candidates.shape[0])) for r in reqs]

    def _uncached(self):
        """An engine that caches nothing (one page, no stores, no extensions): batched full inference."""
        if self._engine is None:
            from ...config import CacheConfig
            from ...engine import RelayEngine

            dtype = next(self.model.parameters()).dtype
            cache = CacheConfig(device=self._t.device, page_size=self.page_size, num_pages=1, dtype=dtype)
            self._engine = RelayEngine(self.model, cache, extend_on_rank=False, store_misses=False,
                                       cuda_graphs=self.cuda_graphs, compile_model=self.compile_model)
        return self._engine

    def prefill(self, req: Request, now: float) -> PrefillOutcome:
        raise AssertionError("the baseline never pre-infers")

    def stats(self) -> dict:
        """The cache-less engine's counters (graph and compile ones among them) once it exists, else nothing."""
        return {} if self._engine is None else dict(self._engine.stats())


def cpu_timer() -> float:
    """CPU time of the calling thread (s): a job's service time free of other processes' load on a shared machine.

    Valid as a service-time clock when the job's compute runs on the calling thread (CPU device, one intra-op
    thread); accelerator work or extra threads are not counted, use ``time.perf_counter`` there.
    """
    return time.thread_time()


def cpu_timer_valid(device, threads: int) -> bool:
    """Whether :func:`cpu_timer` measures a job's service time: the compute runs on the calling thread (a CPU
    ``device``, one intra-op thread)."""
    return str(device).startswith("cpu") and threads == 1


def service_clock(device, threads: int, choice: str = "auto"):
    """The service-time clock and its name: ``choice`` ``"cpu"`` (:func:`cpu_timer`; the caller has checked
    :func:`cpu_timer_valid`), ``"wall"`` (``time.perf_counter``) or ``"auto"`` (thread CPU time where it is valid,
    else wall time)."""
    if choice == "cpu" or (choice == "auto" and cpu_timer_valid(device, threads)):
        return cpu_timer, "thread CPU time"
    return time.perf_counter, "wall time (perf_counter)"


def _sync(t) -> None:
    """Wait for queued device work so the measured duration covers it (no-op on CPU)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
