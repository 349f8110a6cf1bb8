"""The disaggregated policy: a pre-infer pool that ships packed prefixes to a ranking pool.

Of K workers, P pre-infer only (:class:`PreInferService` on a :class:`~.relay.RelayService` with the trigger) and
K - P rank only (a :class:`~.relay.RelayService` each, receiving prefixes). A pre-infer job computes the user's
prefix (the pre-infer worker's own cache keeps it, so the user's next pre-infer computes only new tokens), packs
all layers into one contiguous buffer (``engine.export_prefix``) and ends there; the buffer is then copied
(:meth:`PreInferService.ship`: a plain copy into a new buffer, standing for the link between devices) and, when it
arrives, the ranking worker unpacks it into its pages under a lease (``engine.import_prefix``) before its next
ranking batch. The measured pack, copy and unpack times are charged to the transfer: the prefix is usable only
after all three, the pack and unpack also occupy their devices. A ranking that comes before its prefix computes
it (exact, counted as ``late``).
"""
from __future__ import annotations

import time
from typing import Callable

from ...workload.requests import Request
from .relay import RelayService
from .services import PrefillOutcome
from .workers import Role, Worker

__all__ = ["PreInferService", "disaggregated_workers"]


class PreInferService:
    """A pre-infer-only worker: pre-infer the whole prefix, then pack it for the request's ranking worker.

    Parameters
    ----------
    relay : RelayService
        On this worker's engine (``chunk_tokens`` 0: nothing to yield to), with its trigger hook.
    timer : callable
        The loop's service-time clock, to report the pack time inside the job.
    """

    wants_prefill = True

    def __init__(self, relay: RelayService, timer: Callable[[], float] = time.perf_counter) -> None:
        if relay.chunk_tokens != 0:
            raise ValueError(f"a pre-infer-only worker pre-infers whole prefixes: relay.chunk_tokens must be 0, got "
                             f"{relay.chunk_tokens}")
        self.relay, self.timer = relay, timer

    def prepare(self, requests) -> None:
        self.relay.prepare(requests)

    def reset(self, trigger=None) -> None:
        """A new run (:meth:`RelayService.reset`)."""
        self.relay.reset(trigger)

    def prefill(self, req: Request, now: float) -> PrefillOutcome:
        out = self.relay.prefill(req, now)
        if not out.admitted:
            return out
        t0 = self.timer()
        packed = self.relay.export(req, now)
        pack_s = self.timer() - t0
        if packed is None:
            return PrefillOutcome(False, "evicted_before_pack")
        return PrefillOutcome(True, out.reason, payload=packed, pack_s=pack_s)

    def ship(self, packed):
        """The copy a transfer makes: the packed prefix into new buffers (host memory here)."""
        return packed.to("cpu")

    def cancel(self, req: Request, now: float) -> None:
        self.relay.cancel(req, now)

    def stats(self) -> dict:
        return self.relay.stats()


def disaggregated_workers(prefill: list[PreInferService], rank: list[RelayService]) -> list[Worker]:
    """The workers of a disaggregated deployment: the pre-infer pool, then the ranking pool."""
    if not prefill or not rank:
        raise ValueError(f"a disaggregated deployment needs >= 1 pre-infer and >= 1 ranking worker, got "
                         f"{len(prefill)} and {len(rank)}")
    return [Worker(s, Role.PREFILL) for s in prefill] + [Worker(s, Role.RANK) for s in rank]
