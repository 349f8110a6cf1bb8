"""Workers of ``relaygr bench slo``: ``--workers K``, continuous batching, and disaggregated pre-infer pools.

Every mode is served by the same K workers (devices) on the same trace. ``baseline``: K workers of full inference;
``relay`` / ``relay_no_expander``: K co-located relay workers (each pre-infers and ranks its users); ``disagg_pP``
(one per P of ``--disaggregate``): P workers pre-infer only and ship packed prefixes to the K - P that rank
(:mod:`relaygr_engine.bench.sim.disaggregate`). Rankings are batched continuously up to ``--max-batch``
requests and ``--batch-tokens`` tokens. The crossover compares each P with the co-located relay at the same K:
SLO-compliant throughput, the longest history within the SLO, and the smallest P from which disaggregation is at
least as good, beside the P that the ratio policy (:mod:`relaygr_engine.policy.ratio`) derives from the
co-located run's measured service rates.

Each mode's services are built once per command and reset before every run (:class:`Pool`): a run starts from
empty caches and zeroed counters as on freshly built workers, while compiled code and captured graphs survive.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import time
from pathlib import Path
from typing import Optional

from ..policy.ratio import ServiceRates, split
from .sim import (AdmitAll, BaselineService, BatchPolicy, Mode, PreInferService, RelayService, Role,
                      TriggerHook, Worker, disaggregated_workers)

__all__ = ["add_arguments", "check", "modes", "baseline", "build", "Pool", "batch_policy", "crossover",
           "crossover_markdown", "plot_crossover"]

_DISAGG = re.compile(r"^disagg_p(\d+)$")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("workers")
    g.add_argument("--workers", type=int, default=1, help="devices serving the stream (K), each with its own cache")
    g.add_argument("--max-batch", type=int, default=1, help="rankings per call (continuous batching; 1: none)")
    g.add_argument("--batch-tokens", type=int, default=0,
                   help="token budget of a ranking batch (history + candidates; 0: no bound)")
    g.add_argument("--disaggregate", default="",
                   help="comma-separated P values (or 'all' = 1..K-1): add mode disagg_pP, P of the K workers "
                        "pre-infer only and ship packed prefixes to the K-P that rank")


def check(args) -> list[int]:
    """Validate the worker options (ValueError naming the option); returns the P values."""
    if not isinstance(args.workers, int) or args.workers < 1:
        raise ValueError(f"--workers must be an integer >= 1, got {args.workers!r}")
    BatchPolicy(args.max_batch, args.batch_tokens)  # validates both
    if args.max_batch > 1 and args.baseline != "paged":
        raise ValueError(f"--max-batch > 1 needs --baseline paged (the dense oracle ranks one request per call), "
                         f"got --baseline {args.baseline}")
    text = str(args.disaggregate or "").strip()
    if not text:
        return []
    K = args.workers
    if text == "all":
        ps = list(range(1, K))
    else:
        try:
            ps = sorted({int(p) for p in text.split(",") if p.strip()})
        except ValueError:
            raise ValueError(f"--disaggregate must be 'all' or comma-separated integers, got {text!r}") from None
    if not ps or min(ps) < 1 or max(ps) > K - 1:
        raise ValueError(f"--disaggregate values must lie in [1, --workers - 1] = [1, {K - 1}], got {text!r}")
    return ps


def modes(base: list[str], ps: list[int]) -> list[str]:
    """The modes to compare: ``base`` and one ``disagg_pP`` per P."""
    return list(base) + [f"disagg_p{p}" for p in ps]


def disagg_p(mode: str) -> Optional[int]:
    """P of a ``disagg_pP`` mode, else None."""
    m = _DISAGG.match(mode)
    return int(m.group(1)) if m else None


def batch_policy(args) -> BatchPolicy:
    return BatchPolicy(args.max_batch, args.batch_tokens)


def _relay(args, model, dram_mb: float, hooked: bool, chunk_tokens: int, store_misses: bool) -> RelayService:
    """One relay worker's service: its own engine and cache, with a trigger hook when ``hooked`` (its trigger is
    given per run, :meth:`Pool.workers`)."""
    from ..config import CacheConfig
    from ..engine import RelayEngine

    a = args
    cc = CacheConfig(device=a.device, page_size=a.page_size, dtype=a.shape.torch_dtype,
                     hbm_bytes=int(a.hbm_mb * 2**20), lease_ttl_s=a.lease_ms / 1e3, dram_bytes=int(dram_mb * 2**20),
                     kv_dtype=a.kv_dtype)
    hook = TriggerHook(AdmitAll()) if hooked and not a.no_trigger else None
    engine = RelayEngine(model, cc, trigger=hook, store_misses=store_misses, cuda_graphs=a.cuda_graphs,
                         compile_model=a.compile)
    return RelayService(engine, hook, chunk_tokens=chunk_tokens, device=a.device)


def baseline(model, a) -> BaselineService:
    """One baseline worker's service for the options ``a``: full inference as ``--baseline`` says, graphed and
    compiled as the relay is (``--cuda-graphs``, ``--compile``). Its latency is what the trigger is calibrated on."""
    return BaselineService(model, a.device, impl=a.baseline, cuda_graphs=a.cuda_graphs, compile_model=a.compile,
                           page_size=a.page_size)


def build(args, model, mode: str, timer=None) -> list[tuple]:
    """The services of one mode's workers, with their roles (see the module doc); relay services with a trigger
    hook where the mode pre-infers through the trigger."""
    a, K = args, args.workers
    store = not a.no_store_misses
    if mode == Mode.BASELINE.value:
        return [(baseline(model, a), Role.BOTH) for _ in range(K)]
    P = disagg_p(mode)
    if P is None:
        dram = a.dram_mb if mode == Mode.RELAY.value else 0.0
        return [(_relay(a, model, dram, True, a.chunk_tokens, store), Role.BOTH) for _ in range(K)]
    clock = timer if timer is not None else time.perf_counter
    pre = [PreInferService(_relay(a, model, 0.0, True, 0, store), timer=clock) for _ in range(P)]
    rank = [_relay(a, model, a.dram_mb, False, 0, store) for _ in range(K - P)]
    return [(w.service, w.role) for w in disaggregated_workers(pre, rank)]


def _footprint(args, mode: str) -> tuple[int, int]:
    """Device and host bytes the caches of one mode's workers hold (the baseline's one-page caches: none)."""
    if mode == Mode.BASELINE.value:
        return 0, 0
    mb = 2**20
    P = disagg_p(mode)
    relays = args.workers
    dram = (args.dram_mb if mode == Mode.RELAY.value else 0.0) * args.workers if P is None else \
        args.dram_mb * (args.workers - P)
    return int(args.hbm_mb * mb) * relays, int(dram * mb)


def _memory(device: str) -> tuple[int, int]:
    """The device's memory and the host's, in bytes (host: what the OS reports, else unbounded)."""
    import os

    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        host = 1 << 62
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory, host
    return host, host


class Pool:
    """Each mode's services, built once and reset before every run, so that what a service pays once (the compiled
    model, captured CUDA graphs, allocated pages) is paid once per command instead of once per run.

    :meth:`workers` resets the mode's services (``service.reset(trigger)``: each engine's cache emptied and its
    counters zeroed, :meth:`relaygr_engine.RelayEngine.reset`; the trigger hooks given a new trigger) and wraps them
    in new :class:`Worker` objects (idle, empty queues), so every run starts as on freshly built workers. The
    services of the modes used longest ago are dropped (and built again when next needed) where keeping every
    mode's caches would pass ``share`` of the device's (or host's) memory.

    Parameters
    ----------
    args : argparse.Namespace
        The benchmark's options (checked).
    model : nn.Module
        The ranker every service serves.
    timer : callable
        The service-time clock (a disaggregated pre-infer worker times its packing with it).
    share : float
        Of the device's memory (and of the host's), what the kept caches may hold together.
    """

    def __init__(self, args, model, timer=None, share: float = 0.6) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.args, self.model, self.timer = args, model, timer
        self._services: collections.OrderedDict = collections.OrderedDict()   # mode -> [(service, role)]
        self.builds: collections.Counter = collections.Counter()             # mode -> times built
        self.runs: collections.Counter = collections.Counter()               # mode -> runs served
        device, host = _memory(args.device)
        self._limit = (share * device, share * host)

    def services(self, mode: str) -> list[tuple]:
        """The mode's ``(service, role)`` pairs, built if needed (dropping the least recently used modes' services
        while the caches would not fit)."""
        if mode in self._services:
            self._services.move_to_end(mode)
            return self._services[mode]
        need = _footprint(self.args, mode)
        while self._services and any(sum(_footprint(self.args, m)[i] for m in self._services) + need[i] >
                                     self._limit[i] for i in (0, 1)):
            self._services.popitem(last=False)
            _release(self.args.device)
        self._services[mode] = build(self.args, self.model, mode, timer=self.timer)
        self.builds[mode] += 1
        return self._services[mode]

    def baseline_service(self) -> BaselineService:
        """The first baseline worker's service (what the latency model is calibrated on), reset."""
        service = self.services(Mode.BASELINE.value)[0][0]
        service.reset()
        return service

    def workers(self, mode: str, latency_model, trigger: bool = True, requests=()) -> list[Worker]:
        """Workers of ``mode`` for one run: its services reset, relay hooks with a new
        :class:`~relaygr_engine.policy.SequenceAwareTrigger` on ``latency_model`` (``trigger=False``: one that
        admits every pre-infer, for the code-path warm-up), their request tensors prepared."""
        from ..policy import SequenceAwareTrigger, TriggerConfig

        a = self.args
        out = []
        for service, role in self.services(mode):
            new = None
            if _hooked(service):
                new = SequenceAwareTrigger(latency_model, TriggerConfig(
                    slo_ms=a.slo_ms, margin=a.trigger_margin, expected_candidates=a.candidates)) if trigger \
                    else AdmitAll()
            service.reset(new)
            service.prepare(requests)
            out.append(Worker(service, role))
        self.runs[mode] += 1
        return out


def _hooked(service) -> bool:
    relay = getattr(service, "relay", service)
    return getattr(relay, "hook", None) is not None


def _release(device: str) -> None:
    """Hand the device memory of dropped services back (CUDA's caching allocator)."""
    import gc

    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def crossover(results: dict, colocated: str, ps: list[int], workers: int) -> dict:
    """Each P against the co-located mode at the same K: QPS and history ratios, and the crossover P."""
    def best(m, key):
        r = results[m].get(key)
        return None if not r else r["best"]

    base_q, base_l = best(colocated, "slo_throughput"), best(colocated, "max_len")
    rows = []
    for p in ps:
        m = f"disagg_p{p}"
        q, L = best(m, "slo_throughput"), best(m, "max_len")
        rows.append({"P": p, "R": workers - p, "mode": m, "slo_qps": q, "max_len": L,
                     "qps_vs_colocated": None if q is None or not base_q else q / base_q,
                     "len_vs_colocated": None if L is None or not base_l else L / base_l})
    wins = [r["P"] for r in rows if r["qps_vs_colocated"] is not None and r["qps_vs_colocated"] >= 1.0]
    rates = measured_rates(results[colocated].get("at_ref", {}))
    return {"workers": workers, "colocated": colocated, "colocated_slo_qps": base_q, "colocated_max_len": base_l,
            "rows": rows, "crossover_p": min(wins) if wins else None,
            "policy_p": None if rates is None or workers < 2 else split(workers, rates)[0],
            "rates": None if rates is None else dataclasses.asdict(rates)}


def measured_rates(summary: dict) -> Optional[ServiceRates]:
    """Per-request service rates of a co-located relay run (``summarize``'s dict): a pre-infer's mean time, a
    ranking's (its share of the worker time), and the share of requests pre-inferred; None without data."""
    pf, n = summary.get("prefill", {}), summary.get("completed", 0)
    ran = pf.get("started", 0) - sum(pf.get("refused", {}).values())   # pre-infers that computed a prefix
    signals = pf.get("signals", 0)
    if not n or ran <= 0 or not signals:
        return None
    prefill_s = pf["service_s"] / ran
    rank_s = (summary["work_ms_per_request"] * 1e-3 * n - pf["service_s"]) / n
    if prefill_s <= 0 or rank_s <= 0:
        return None
    return ServiceRates(prefill_s=prefill_s, rank_s=rank_s, prefill_share=min(1.0, ran / signals))


def crossover_markdown(cx: dict) -> str:
    """The crossover section of the report."""
    from .report import _fmt as fmt, _table

    def _fmt(v):
        return "-" if v is None else fmt(v)

    rows = [[r["P"], r["R"], _fmt(r["slo_qps"]), _fmt(r["qps_vs_colocated"]), _fmt(r["max_len"]),
             _fmt(r["len_vs_colocated"])] for r in cx["rows"]]
    rows.insert(0, ["0 (co-located)", cx["workers"], _fmt(cx["colocated_slo_qps"]), "1", _fmt(cx["colocated_max_len"]),
                    "1"])
    where = (f"Disaggregation matches or beats co-location from P = {cx['crossover_p']} pre-infer workers of "
             f"{cx['workers']}." if cx["crossover_p"] is not None else
             f"Disaggregation does not reach the co-located SLO-compliant throughput at any P of {cx['workers']} "
             f"workers here.")
    policy = ("" if cx.get("policy_p") is None else
              f"The ratio policy (n_p b_p / T_p ~= s n_d b_d / T_d from the co-located run's measured service "
              f"rates at the reference QPS: {_rates(cx['rates'])}) picks P = {cx['policy_p']} of {cx['workers']}.")
    return "\n".join([_table(["P (pre-infer)", "R (ranking)", "SLO-compliant QPS", "vs co-located", "max history",
                              "vs co-located"], rows), "", where, "", policy, "", "![crossover](crossover.png)", ""])


def _rates(r: dict) -> str:
    return (f"T_p {r['prefill_s'] * 1e3:.1f} ms per pre-infer, T_d {r['rank_s'] * 1e3:.1f} ms per ranking, "
            f"s = {r['prefill_share']:.2f}")


def plot_crossover(cx: dict, path) -> Path:
    """SLO-compliant QPS per P, the co-located value as a line."""
    from .report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ps = [r["P"] for r in cx["rows"]]
    ax.bar([str(p) for p in ps], [r["slo_qps"] or 0 for r in cx["rows"]], color="C2", label="disaggregated")
    if cx["colocated_slo_qps"]:
        ax.axhline(cx["colocated_slo_qps"], color="C1", linestyle="--", label="co-located")
    ax.set_xlabel(f"pre-infer workers P of K = {cx['workers']}")
    ax.set_ylabel("SLO-compliant QPS")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
