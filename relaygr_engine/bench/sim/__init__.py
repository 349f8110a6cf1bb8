"""Open-loop serving of a ranking request stream by device workers, on a virtual clock.

Method
------
One worker (one engine instance, one device) serves two queues: **ranking** (priority) and **pre-infer**
(deferrable). Every request of the workload brings two events: its pre-infer signal at ``arrival - pipeline_delay``
(retrieval knows the user before ranking does) and its ranking request at ``arrival``. Arrivals are open-loop at the
target QPS (:meth:`Workload.arrivals`).

Nothing sleeps. The worker is emulated with a virtual clock ``t``:

1. every event with time ``<= t`` joins its queue;
2. if a ranking request waits, the worker takes the oldest one; otherwise it first drops every queued pre-infer
   whose ranking request has already arrived (counted as ``dropped_stale``: that ranking recomputes, or uses what
   the cache holds) and takes the oldest remaining pre-infer; with both queues empty ``t`` jumps to the next event;
3. the job really runs (the real engine call, given ``now=t`` so cache leases expire on the same clock) and its
   measured duration advances ``t`` (``timer``: wall time, or :func:`cpu_timer`, the thread's CPU time, which
   on a shared CPU machine measures the job's own compute without the time other processes take). Jobs are not
   preempted: a ranking that arrives while a pre-infer runs waits for it.

A ranking request's latency is its completion time minus its arrival time, so queueing behind other rankings and
behind a running pre-infer is counted in full, without any idle waiting: a run costs only the compute it does.

Warm-up
-------
A workload's warm-up requests (:attr:`Workload.num_warmup`, the first ones) are served the same way but not
measured: they leave the caches as a continuously running server would have them. The measured window opens once
every warm-up ranking is served: if the worker is still busy then (a cold start costs more than the steady state),
the measured requests' times are shifted later by that much, so the measured requests never queue behind the
warm-up. A service with ``stateless = True`` (the baseline) skips its warm-up requests: with that rule they could
not change its measured latencies.

Services
--------
A *service* adapts one mode to the loop: ``rank(req, now) -> RankOutcome`` and ``prefill(req, now) ->
PrefillOutcome`` (both do the real work), ``wants_prefill`` (False for the baseline), ``stats()``.
:class:`BaselineService` runs ``model.rank_full`` on the critical path; :class:`RelayService` runs
``engine.prefill_prefix`` for pre-infers and ``engine.rank_with_prefix`` (with the request's ticket when its
pre-infer completed) for rankings.

Several workers
---------------
``simulate`` also takes a list of :class:`Worker` (:mod:`.workers`): K devices, each with its own service and
cache, share the virtual clock; the loop always advances the worker that is free first. A user's pre-infer and
ranking go to its rendezvous-first worker (co-located), or to its pre-infer worker and its ranking worker when the
pool is disaggregated (:mod:`.disaggregate`: the packed prefix is shipped, and the measured pack + copy + unpack
is charged to the transfer). Rankings are batched continuously (:mod:`.batching`): a free worker serves what is
queued, up to a batch size and a token budget, as one ``rank_with_prefix_batch`` call.

Modules
-------
:mod:`.services` (outcomes, the service protocol, request tensors, the baseline), :mod:`.relay` (the relay policy
and its trigger hook), :mod:`.disaggregate` (pre-infer-only workers and the transfer), :mod:`.workers` (workers,
roles, placement), :mod:`.batching` (continuous batching), :mod:`.clock` (the loop and :class:`RunResult`).
"""
from __future__ import annotations

from .batching import BatchPolicy
from .clock import RunResult, simulate
from .disaggregate import PreInferService, disaggregated_workers
from .relay import AdmitAll, RelayService, TriggerHook
from .services import (BaselineImpl, BaselineService, Mode, PrefillOutcome, RankOutcome, Service, cpu_timer,
                       cpu_timer_valid, service_clock, to_behaviors)
from .workers import Role, Worker

__all__ = ["Mode", "BaselineImpl", "RankOutcome", "PrefillOutcome", "Service", "BaselineService", "RelayService",
           "TriggerHook", "AdmitAll", "RunResult", "simulate", "to_behaviors", "cpu_timer", "cpu_timer_valid",
           "service_clock", "BatchPolicy", "Role", "Worker",
           "PreInferService", "disaggregated_workers"]
