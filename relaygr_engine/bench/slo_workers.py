"""Workers of ``relaygr bench slo``: ``--workers K``, continuous batching, and disaggregated pre-infer pools.

Every mode is served by the same K workers (devices) on the same trace. ``baseline``: K workers of full inference;
``relay`` / ``relay_no_expander``: K co-located relay workers (each pre-infers and ranks its users); ``disagg_pP``
(one per P of ``--disaggregate``): P workers pre-infer only and ship packed prefixes to the K - P that rank
(:mod:`relaygr_engine.bench.sim.disaggregate`). Rankings are batched continuously up to ``--max-batch``
requests and ``--batch-tokens`` tokens. The crossover compares each P with the co-located relay at the same K:
SLO-compliant throughput, the longest history within the SLO, and the smallest P from which disaggregation is at
least as good, beside the P that the ratio policy (:mod:`relaygr_engine.policy.ratio`) derives from the
co-located run's measured service rates.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Optional

from ..policy.ratio import ServiceRates, split
from .sim import (BaselineService, BatchPolicy, Mode, PreInferService, RelayService, Role, TriggerHook,
                      Worker, disaggregated_workers)

__all__ = ["add_arguments", "check", "modes", "baseline", "build", "batch_policy", "crossover", "crossover_markdown",
           "plot_crossover"]

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


def _relay(bench, dram_mb: float, trigger: bool, chunk_tokens: int, store_misses: bool) -> RelayService:
    """One relay worker's service: its own engine and cache (and trigger hook when ``trigger``)."""
    from ..config import CacheConfig
    from ..engine import RelayEngine
    from ..policy import SequenceAwareTrigger, TriggerConfig

    a = bench.args
    cc = CacheConfig(device=a.device, page_size=a.page_size, dtype=a.shape.torch_dtype,
                     hbm_bytes=int(a.hbm_mb * 2**20), lease_ttl_s=a.lease_ms / 1e3, dram_bytes=int(dram_mb * 2**20),
                     kv_dtype=a.kv_dtype)
    hook = None
    if trigger and not a.no_trigger:
        hook = TriggerHook(SequenceAwareTrigger(bench.lat, TriggerConfig(
            slo_ms=a.slo_ms, margin=a.trigger_margin, expected_candidates=a.candidates)))
    engine = RelayEngine(bench.model, cc, trigger=hook, store_misses=store_misses, cuda_graphs=a.cuda_graphs,
                         compile_model=a.compile)
    return RelayService(engine, hook, chunk_tokens=chunk_tokens, device=a.device)


def baseline(model, a) -> BaselineService:
    """One baseline worker's service for the options ``a``: full inference as ``--baseline`` says, graphed and
    compiled as the relay is (``--cuda-graphs``, ``--compile``). Its latency is what the trigger is calibrated on."""
    return BaselineService(model, a.device, impl=a.baseline, cuda_graphs=a.cuda_graphs, compile_model=a.compile,
                           page_size=a.page_size)


def build(bench, mode: str, trigger: bool = True) -> list[Worker]:
    """Fresh workers of one mode (see the module doc)."""
    a, K = bench.args, bench.args.workers
    store = not a.no_store_misses
    if mode == Mode.BASELINE.value:
        return [Worker(baseline(bench.model, a)) for _ in range(K)]
    P = disagg_p(mode)
    if P is None:
        dram = a.dram_mb if mode == Mode.RELAY.value else 0.0
        return [Worker(_relay(bench, dram, trigger, a.chunk_tokens, store), Role.BOTH) for _ in range(K)]
    pre = [PreInferService(_relay(bench, 0.0, trigger, 0, store), timer=bench.timer) for _ in range(P)]
    rank = [_relay(bench, a.dram_mb, False, 0, store) for _ in range(K - P)]
    return disaggregated_workers(pre, rank)


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
