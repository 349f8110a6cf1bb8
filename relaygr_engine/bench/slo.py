"""``relaygr bench slo``: relay-race serving vs full inference under a P99 ranking SLO, on a real-log workload.

For each mode (``baseline``: ``model.rank_full`` on the critical path; ``relay``: trigger + HBM prefix cache
(+ DRAM expander); ``relay_no_expander``) on the same request stream (:mod:`relaygr_engine.bench.workload`),
served by one worker on a virtual clock with the real engine's compute (:mod:`relaygr_engine.bench.serving`):

1. **SLO-compliant throughput**: the highest QPS whose P99 ranking latency is within ``--slo-ms``
   (a geometric sweep, then bisection: :func:`relaygr_engine.bench.report.slo_throughput`); every evaluated QPS is
   a point of the latency-vs-QPS curve.
2. **Reference QPS** (``--ref-qps``, default half the baseline's SLO-compliant throughput): P50/P99, cache-tier hit
   rates and trigger decisions of every mode.
3. **Longest history within the SLO** at the reference QPS: each user's first served request carries exactly
   ``L`` history tokens (later ones append), searched over ``L`` in page multiples.

Writes ``report.md``, ``report.json``, ``latency_vs_qps.png`` and ``max_len.png`` to ``--out`` and ends with
``RESULT slo_throughput_ratio=... max_len_ratio=... p99_ms_relay=... p99_ms_baseline=...`` (relay / baseline,
measured in this run).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from typing import Optional

import numpy as np

from . import report as rpt
from .serving import BaselineService, Mode, RelayService, TriggerHook, simulate
from .workload import (InteractionLog, Workload, WorkloadConfig, build_workload, load_profile, read_interactions,
                       synthesize_interactions)

__all__ = ["build_parser", "run", "main", "METHOD"]

METHOD = """\
**Workload.** Every interaction event of the log becomes one ranking request of its user: the history is the
user's earlier behaviors (oldest first), the candidates are the event's own item plus popularity-sampled items, and
a pre-infer signal precedes the ranking request by the retrieval-to-ranking delay. Each user's timeline is
compressed on its own (gap ``g -> floor + g*cap/(g+cap)``, 1 s floor and 30 min cap by default: strictly
increasing, so the order of a user's re-request gaps is kept), users are aligned so that many are active at once,
each at a random point of its history, and the served window is rescaled linearly to the target QPS (the same
stream at every QPS). Item ids are remapped by frequency rank (overflow hashed); ``length_scale`` expands every
real behavior into that many tokens (the behavior plus synthetic companions) because real logs' histories are
short while the engine targets long sequences.

**Serving.** One worker (one engine, one device) serves two queues: ranking (priority) and pre-infer
(deferrable). Nothing sleeps: a virtual clock advances by the measured wall time of each real engine call (the
baseline's `rank_full`, the relay engine's `prefill_prefix` / `rank_with_prefix`, with `now=` the virtual time so
leases expire on the same clock). When the worker is free it takes the oldest ranking request, else the oldest
pre-infer whose ranking has not arrived yet (those whose ranking already arrived are dropped and counted: the
ranking uses what the cache holds or recomputes). Jobs are not preempted; a pre-infer runs as chunks of at most
``chunk_tokens`` tokens (each extending the entry the previous chunk cached), so a ranking waits for one chunk at
most. A ranking's latency is its completion time minus its arrival time, queueing included. The relay trigger
(`SequenceAwareTrigger`, latency model calibrated on this model at start-up) pre-infers only requests whose full
inference is predicted to put the SLO at risk, within its footprint bound.

**Statistics.** P50/P99 are nearest-rank percentiles over all requests of a run. The SLO-compliant throughput is
the highest QPS whose P99 <= SLO, found by a geometric sweep then bisection (each result is a measured passing QPS
with a measured failing QPS just above it); the longest history is searched the same way over page-aligned lengths.
The modes' searches run in lockstep (one evaluation of each mode in turn), so slow drift of a shared machine affects
every mode alike. A run stops as soon as P99 > SLO is certain (enough requests over the SLO); its P99 is then a lower
bound, marked as such. Timings come from the machine the benchmark runs on and carry its noise; every number in one
report comes from one run of the benchmark."""


# ----------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str = "relaygr bench slo", description: Optional[str] = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("workload")
    g.add_argument("--data", help="interaction CSV (.csv/.csv.gz: user_id,item_id,timestamp[,action|rating]); "
                                  "default: a synthetic log from the packaged MovieLens-fitted profile")
    g.add_argument("--profile", help="workload profile JSON to synthesize from (default: the packaged one)")
    g.add_argument("--requests", type=int, default=300, help="ranking requests per run")
    g.add_argument("--candidates", type=int, default=64, help="candidates per ranking request")
    g.add_argument("--length-scale", type=float, default=4.0,
                   help="history tokens per real behavior (real logs are short: MovieLens median 70)")
    g.add_argument("--max-history", type=int, default=512,
                   help="history cap in tokens (oldest dropped) of the throughput workload")
    g.add_argument("--suffix-tokens", type=int, default=16,
                   help="newest history tokens computed at ranking instead of pre-inferred")
    g.add_argument("--pipeline-delay-ms", type=float, default=50.0, help="retrieval-to-ranking delay")
    g.add_argument("--num-items", type=int, default=8192, help="model item vocabulary (ids remapped into it)")
    g.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("serving")
    g.add_argument("--slo-ms", type=float, default=100.0, help="P99 ranking latency objective")
    g.add_argument("--modes", default="baseline,relay",
                   help=f"comma-separated modes from {', '.join(m.value for m in Mode)}")
    g.add_argument("--hbm-mb", type=float, default=64.0, help="device KV cache budget (MiB)")
    g.add_argument("--dram-mb", type=float, default=256.0, help="DRAM expander budget of mode relay (MiB)")
    g.add_argument("--lease-ms", type=float, default=1000.0, help="pre-infer lease (relay window)")
    g.add_argument("--chunk-tokens", type=int, default=256, help="pre-infer chunk (0: whole prefix at once)")
    g.add_argument("--trigger-margin", type=float, default=0.1,
                   help="pre-infer when predicted full inference > margin * SLO")
    g.add_argument("--no-trigger", action="store_true", help="pre-infer every request the cache can take")
    g.add_argument("--device", default="cpu")
    g.add_argument("--threads", type=int, default=1, help="torch intra-op threads (one worker)")
    g = ap.add_argument_group("search")
    g.add_argument("--qps-start", type=float, help="first QPS of the sweep (default: from the calibration)")
    g.add_argument("--ref-qps", type=float, help="QPS of the max-length search and the per-mode details "
                                                 "(default: half the baseline's SLO-compliant throughput)")
    g.add_argument("--rel-tol", type=float, default=0.08, help="QPS bisection tolerance (relative)")
    g.add_argument("--len-step", type=int, default=32, help="history length resolution of the max-length search")
    g.add_argument("--max-len-hi", type=int, default=2048,
                   help="longest history the max-length search tries (the model's max_seq_len is the larger of "
                        "this and --max-history)")
    g.add_argument("--full-runs", action="store_true",
                   help="never stop a run early (by default a run stops once P99 > SLO is certain; its curve "
                        "point is then a lower bound)")
    g.add_argument("--no-max-len", action="store_true", help="skip the max-length search")
    g.add_argument("--quick", action="store_true", help="fewer requests and coarser searches (a few minutes)")
    g = ap.add_argument_group("output")
    g.add_argument("--out", default="reports/slo", help="report directory")
    g.add_argument("--json", help="also write the report JSON here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _apply_quick(args) -> None:
    if args.quick:
        args.requests = min(args.requests, 200)
        args.rel_tol = max(args.rel_tol, 0.15)
        args.len_step = max(args.len_step, 64)


# ----------------------------------------------------------------------------------------------- pieces
def load_log(args) -> tuple[InteractionLog, str]:
    """The interaction log and a one-line description of where it came from."""
    if args.data:
        log = read_interactions(args.data)
        return log, f"CSV {args.data} ({len(log)} events, {log.num_users} users)"
    prof = load_profile(args.profile)
    log = synthesize_interactions(prof, seed=args.seed)
    where = args.profile or "packaged profile"
    return log, (f"synthetic log from the {where} '{prof.get('name')}' (fitted to {prof['num_events']} events of "
                 f"{prof['num_users']} users; {len(log)} events drawn)")


def _model_config(args, num_items: int, num_actions: int):
    from ..models import GRModelConfig

    return GRModelConfig(attention="hstu", num_layers=2, hidden_dim=64, num_heads=2, head_dim=32,
                         num_items=num_items, num_actions=num_actions,
                         max_seq_len=max(args.max_history, args.max_len_hi), num_tasks=2)


def calibrate_latency(model, num_candidates: int, max_len: int, device: str, repeats: int = 3):
    """Fit the trigger's latency model on this model's ``rank_full`` (a few seconds)."""
    import torch

    from ..models import Behaviors
    from ..policy import calibrate

    cfg = model.config
    g = torch.Generator().manual_seed(0)

    def fn(L: int, C: int) -> None:
        L = max(L, 1)
        h = Behaviors(torch.randint(0, cfg.num_items, (L,), generator=g).to(device),
                      torch.randint(0, cfg.num_actions, (L,), generator=g).to(device),
                      torch.arange(L, dtype=torch.long).to(device) * 60)
        model.rank_full(h, torch.randint(0, cfg.num_items, (C,), generator=g).to(device))

    lengths = sorted({min(max_len, x) for x in (32, 128, 256, 384, 512, 768, 1024)})
    return calibrate(fn, lengths, [num_candidates], repeats, warmup=1, quantile=0.75, device=device,
                     meta={"model": "benchmark model", "candidates": num_candidates})


class _Bench:
    """Everything one benchmark run shares: model, latency model, workloads, options, progress bar."""

    def __init__(self, args, log: InteractionLog, model, latency_model, progress) -> None:
        self.args, self.log, self.model, self.lat, self.progress = args, log, model, latency_model, progress
        self._workloads: dict = {}

    def workload(self, base_length: Optional[int] = None) -> Workload:
        a = self.args
        if base_length not in self._workloads:
            cap = a.max_history if base_length is None else max(a.max_history, a.max_len_hi)
            cfg = WorkloadConfig(num_items=self.model.config.num_items, num_actions=self.model.config.num_actions,
                                 num_requests=a.requests, num_candidates=a.candidates, length_scale=a.length_scale,
                                 base_length=base_length, max_history=cap, suffix_tokens=a.suffix_tokens,
                                 pipeline_delay_s=a.pipeline_delay_ms / 1e3, seed=a.seed)
            self._workloads[base_length] = build_workload(self.log, cfg)
        return self._workloads[base_length]

    def service(self, mode: str, trigger: bool = True):
        from ..config import CacheConfig
        from ..engine import RelayEngine
        from ..policy import SequenceAwareTrigger, TriggerConfig

        a = self.args
        if mode == Mode.BASELINE.value:
            return BaselineService(self.model, a.device)
        dram = int(a.dram_mb * 2**20) if mode == Mode.RELAY.value else 0
        cc = CacheConfig(device=a.device, page_size=16, hbm_bytes=int(a.hbm_mb * 2**20),
                         lease_ttl_s=a.lease_ms / 1e3, dram_bytes=dram)
        hook = None
        if trigger and not a.no_trigger:
            hook = TriggerHook(SequenceAwareTrigger(self.lat, TriggerConfig(
                slo_ms=a.slo_ms, margin=a.trigger_margin, expected_candidates=a.candidates)))
        engine = RelayEngine(self.model, cc, trigger=hook)
        return RelayService(engine, hook, chunk_tokens=a.chunk_tokens, device=a.device)

    def run(self, mode: str, qps: float, base_length: Optional[int] = None, label: str = "",
            early_stop: bool = False) -> dict:
        """Serve one workload at one QPS in one mode; with ``early_stop``, stop once P99 > SLO is certain."""
        w = self.workload(base_length)
        svc = self.service(mode)
        svc.prepare(w.requests)
        if self.progress is not None:
            self.progress.set_description(f"{mode} {label or f'{qps:.3g} QPS'}")
        n = len(w)
        stop = None
        if early_stop and not self.args.full_runs:
            stop = (self.args.slo_ms / 1e3, n - math.ceil(0.99 * n) + 1)   # that many over SLO: P99 > SLO
        res = simulate(svc, w, qps, mode=mode, progress=self.progress, stop_over=stop)
        return summarize(res)


def summarize(res) -> dict:
    """A run's JSON-able summary: latency percentiles, utilization, ranking sources, pre-infers, engine stats."""
    s = rpt.latency_summary(res.latency_s)
    src = res.source_counts()
    n = max(1, len(res.sources))
    s.update({
        "qps": res.qps, "utilization": res.busy_s / max(res.makespan_s, 1e-12),
        "stopped_early": bool(res.stopped_early), "completed": int(len(res.latency_s)),
        "num_requests": int(res.num_requests),
        "mean_service_ms": float(np.mean(res.service_s) * 1e3), "sources": src,
        "work_ms_per_request": res.busy_s * 1e3 / max(1, len(res.latency_s)),
        "hit_rates": {k: v / n for k, v in src.items()},
        "prefill": {k: v for k, v in res.prefill.items()}, "wall_s": res.wall_s,
        "history_len_mean": float(np.mean(res.history_len)), "loadavg_1m": _loadavg(),
        "engine_stats": {k: int(v) for k, v in res.engine_stats.items()
                         if isinstance(v, (int, np.integer)) and not isinstance(v, bool)},
    })
    return s


def _loadavg() -> Optional[float]:
    """The machine's 1-minute load average (other processes competing for the CPU), when the OS reports it."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def _say(msg: str) -> None:
    print(msg, flush=True)


def run(args) -> dict:
    """Run the benchmark described by parsed ``args``; return the report dict (also written to ``args.out``)."""
    import torch

    from ..models import build_ranker

    t_start = time.perf_counter()
    load_start = _loadavg()
    _apply_quick(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    valid = [m.value for m in Mode]
    for m in modes:
        if m not in valid:
            raise ValueError(f"--modes entries must be among {', '.join(valid)}, got {m!r}")
    if "baseline" not in modes:
        modes.insert(0, "baseline")
    relay_mode = "relay" if "relay" in modes else next((m for m in modes if m != "baseline"), None)
    if relay_mode is None:
        raise ValueError("--modes needs a relay mode to compare with the baseline")
    torch.set_num_threads(max(1, args.threads))

    log, source = load_log(args)
    num_actions = 6 if log.action_kind != "none" else 1
    model = build_ranker(_model_config(args, num_items=args.num_items, num_actions=num_actions), seed=args.seed,
                         device=args.device)
    _say(f"workload: {source}")
    t0 = time.perf_counter()
    lat = calibrate_latency(model, args.candidates, max(args.max_history, args.max_len_hi), args.device,
                            repeats=5)
    base_max = lat.max_history_len(args.slo_ms, args.candidates)
    _say(f"calibrated full inference on this model in {time.perf_counter() - t0:.1f}s: "
         f"{lat.predict_ms(256, args.candidates):.1f} ms @256, {lat.predict_ms(1024, args.candidates):.1f} ms "
         f"@1024 tokens; longest history within {args.slo_ms:g} ms unloaded ~{base_max}")

    progress = _progress(args)
    bench = _Bench(args, log, model, lat, progress)
    main_wl = bench.workload()
    d = main_wl.describe()
    mean_ms = float(np.mean([lat.predict_ms(int(L), args.candidates) for L in main_wl.history_lengths()]))
    _say(f"served stream: {d['requests']} requests of {d['users']} users, history tokens p50 "
         f"{d['history_len_p50']:.0f} / p90 {d['history_len_p90']:.0f} / max {d['history_len_max']} "
         f"(length scale {args.length_scale:g}, cap {args.max_history}); predicted mean full inference "
         f"{mean_ms:.1f} ms")
    # warm up every mode's code paths (the first calls import, allocate and initialise): relay modes without the
    # trigger so pre-infers, chunk extensions and cached rankings all run
    warm = Workload(main_wl.requests[:24], main_wl.config, main_wl.info)
    for m in modes:
        svc = bench.service(m, trigger=False)
        svc.prepare(warm.requests)
        simulate(svc, warm, 2.0)

    start_qps = args.qps_start or max(0.05, 0.3 * 1e3 / max(mean_ms, 1e-3))
    results: dict = {m: {} for m in modes}
    _say(f"searching each mode's highest QPS with P99 <= {args.slo_ms:g} ms from {start_qps:.3g} QPS "
         f"(modes evaluated in turn)")
    qpoints: dict = {m: {} for m in modes}

    def at_qps(m):
        def evaluate(q):
            s = bench.run(m, q, early_stop=True)
            qpoints[m][q] = s
            _say(f"  {m:<18} {q:8.3g} QPS  p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  busy "
                 f"{s['utilization']:4.0%}  {_verdict(s, args.slo_ms)}")
            return s["p99_ms"] <= args.slo_ms and not s["stopped_early"], None
        return evaluate

    found = rpt.search_lockstep({m: (rpt.search_steps(start_qps, lo=start_qps / 256, hi=start_qps * 256, factor=2.0,
                                                      rel_tol=args.rel_tol, max_evals=14 if args.quick else 20),
                                     at_qps(m)) for m in modes})
    for m in modes:
        results[m]["curve"] = [dict(qpoints[m][q], qps=q) for q in sorted(qpoints[m])]
        results[m]["slo_throughput"] = found[m].to_dict()

    b = results["baseline"]["slo_throughput"]
    ref_qps = args.ref_qps or 0.5 * (b["best"] or start_qps / 2)
    _say(f"reference QPS {ref_qps:.3g}")
    for m in modes:
        s = bench.run(m, ref_qps, label=f"{ref_qps:.3g} QPS (reference)")
        results[m]["at_ref"] = s
        _say(f"  {m:<18} @ref p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms  sources {s['sources']}")

    if not args.no_max_len:
        step = args.len_step
        start_len = max(step, min(args.max_len_hi, (base_max or 256) // step * step))
        _say(f"searching each mode's longest history with P99 <= {args.slo_ms:g} ms at {ref_qps:.3g} QPS")
        lpoints: dict = {m: {} for m in modes}

        def at_len(m):
            def evaluate(L):
                L = int(L)
                s = bench.run(m, ref_qps, base_length=L, label=f"L={L}", early_stop=True)
                lpoints[m][L] = s
                _say(f"  {m:<18} L={L:5d}  p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  "
                     f"{_verdict(s, args.slo_ms)}")
                return s["p99_ms"] <= args.slo_ms and not s["stopped_early"], None
            return evaluate

        found = rpt.search_lockstep({m: (rpt.search_steps(start_len, lo=step, hi=args.max_len_hi, factor=2.0,
                                                          integer=True, step=step,
                                                          max_evals=10 if args.quick else 14), at_len(m))
                                     for m in modes})
        for m in modes:
            results[m]["max_len"] = dict(found[m].to_dict(), curve=[
                {"length": L, "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "sources": s["sources"],
                 "history_len_mean": s["history_len_mean"], "stopped_early": s["stopped_early"],
                 "completed": s["completed"], "num_requests": s["num_requests"]}
                for L, s in sorted(lpoints[m].items())])
    if progress is not None:
        progress.close()

    rel, base = results[relay_mode], results["baseline"]
    tput_ratio = _ratio(rel["slo_throughput"]["best"], base["slo_throughput"]["best"])
    len_ratio = (_ratio(rel["max_len"]["best"], base["max_len"]["best"]) if not args.no_max_len else None)
    result = {"slo_throughput_ratio": tput_ratio, "max_len_ratio": len_ratio,
              "p99_ms_relay": rel["at_ref"]["p99_ms"], "p99_ms_baseline": base["at_ref"]["p99_ms"],
              "slo_ms": args.slo_ms, "ref_qps": ref_qps,
              "slo_qps_relay": rel["slo_throughput"]["best"], "slo_qps_baseline": base["slo_throughput"]["best"]}
    if not args.no_max_len:
        result["max_len_relay"] = rel["max_len"]["best"]
        result["max_len_baseline"] = base["max_len"]["best"]
    line = rpt.result_line(result)
    report = {
        "title": "Relay-race serving vs full inference under a P99 ranking SLO",
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "headline": _headline(results, relay_mode, args, ref_qps, tput_ratio, len_ratio),
        "setup": dict(_setup(args, model, source, main_wl, ref_qps, lat),
                      load_average=f"{_fmt_load(load_start)} at start, {_fmt_load(_loadavg())} at end "
                                   f"(1-minute; {os.cpu_count()} CPUs)"),
        "method": METHOD, "modes": results, "result": result, "result_line": line,
        "notes": _notes(args, results, relay_mode),
        "elapsed_s": time.perf_counter() - t_start,
    }
    report["paths"] = rpt.write_report(report, args.out, json_path=args.json)
    return report


def _fmt_load(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _verdict(s: dict, slo_ms: float) -> str:
    if s["stopped_early"]:
        return f"over SLO (stopped after {s['completed']}/{s['num_requests']} requests)"
    return "ok" if s["p99_ms"] <= slo_ms else "over SLO"


def _ratio(a, b) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


def _headline(results, relay_mode, args, ref_qps, tput_ratio, len_ratio) -> str:
    r, b = results[relay_mode], results["baseline"]
    parts = [f"SLO-compliant throughput (P99 <= {args.slo_ms:g} ms): {relay_mode} "
             f"{_q(r['slo_throughput'])} QPS vs baseline {_q(b['slo_throughput'])} QPS "
             f"(x{rpt._fmt(tput_ratio) if tput_ratio is not None else ' n/a'})."]
    if "max_len" in r:
        parts.append(f"Longest history within the SLO at {ref_qps:.3g} QPS: {relay_mode} "
                     f"{_q(r['max_len'])} vs baseline {_q(b['max_len'])} tokens "
                     f"(x{rpt._fmt(len_ratio) if len_ratio is not None else ' n/a'}).")
    parts.append(f"At {ref_qps:.3g} QPS: P99 {r['at_ref']['p99_ms']:.1f} ms ({relay_mode}) vs "
                 f"{b['at_ref']['p99_ms']:.1f} ms (baseline).")
    return " ".join(parts)


def _q(sr: dict) -> str:
    if sr["best"] is None:
        return "none"
    v = rpt._fmt(sr["best"])
    return v + (" (capped: every tried value passed)" if sr["status"] == "capped" else "")


def _setup(args, model, source, wl, ref_qps, lat) -> dict:
    import torch

    cfg = model.config
    d = wl.describe(qps=ref_qps)
    return {
        "device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model": {"attention": cfg.attention.value, "num_layers": cfg.num_layers, "hidden_dim": cfg.hidden_dim,
                  "num_heads": cfg.num_heads, "head_dim": cfg.head_dim, "num_items": cfg.num_items,
                  "num_actions": cfg.num_actions, "max_seq_len": cfg.max_seq_len},
        "cache": {"page_size": 16, "hbm_mb": args.hbm_mb, "dram_mb_relay": args.dram_mb,
                  "lease_ms": args.lease_ms, "chunk_tokens": args.chunk_tokens},
        "trigger": ("off (every pre-infer the cache can take)" if args.no_trigger else
                    {"kind": "SequenceAwareTrigger", "margin": args.trigger_margin,
                     "latency_model_ms": {"a": lat.a, "b": lat.b, "c": lat.c, "d": lat.d}}),
        "workload_source": source,
        "length": (f"length_scale={args.length_scale:g} tokens per real behavior, cap {args.max_history} tokens; "
                   f"max-length search: base length L per user's first request"),
        "requests": args.requests, "candidates": args.candidates, "pipeline_delay_ms": args.pipeline_delay_ms,
        "suffix_tokens": args.suffix_tokens, "slo_ms": args.slo_ms, "ref_qps": ref_qps, "quick": bool(args.quick),
        "cpu_count": os.cpu_count(),
        "workload": {k: v for k, v in d.items() if not isinstance(v, (dict, list))},
    }


def _notes(args, results, relay_mode) -> list[str]:
    notes = []
    if "relay" in results:
        dram = results["relay"]["at_ref"]["engine_stats"].get("dram_hits", 0)
        if dram == 0:
            notes.append("No ranking read the DRAM tier (dram_hits = 0) in mode relay at the reference QPS.")
    for m, r in results.items():
        for key in ("slo_throughput", "max_len"):
            if key in r and r[key]["status"] != "ok":
                notes.append(f"{m}: {key} search status '{r[key]['status']}' (see the search ranges).")
    return notes


def _progress(args):
    if args.no_progress or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        return None
    return tqdm(total=None, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)


def print_table(report: dict) -> None:
    """The comparison table on stdout."""
    s = report["setup"]
    rows = []
    for m, r in report["modes"].items():
        ml = r.get("max_len", {})
        rows.append((m, _q(r["slo_throughput"]), _q(ml) if ml else "-", f"{r['at_ref']['p50_ms']:.2f}",
                     f"{r['at_ref']['p99_ms']:.2f}", ", ".join(f"{k} {v:.0%}" for k, v in
                                                              sorted(r["at_ref"]["hit_rates"].items()))))
    head = ("mode", f"QPS @P99<={s['slo_ms']:g}ms", f"max len @{s['ref_qps']:.3g}QPS", "p50 ms", "p99 ms",
            "ranking sources @ref")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*head))
    print(fmt.format(*("-" * w for w in widths)))
    for r in rows:
        print(fmt.format(*r))


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    print()
    print(report["headline"])
    print()
    print_table(report)
    print(f"\nreport: {report['paths']['markdown']} (plots: {report['paths'].get('latency_plot')}, "
          f"{report['paths'].get('max_len_plot', '-')}); {report['elapsed_s']:.0f}s")
    print(report["result_line"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
