"""One run of ``relaygr bench slo`` (:func:`run`): the workload, the latency calibration, the served runs
(:class:`_Bench`) and the searches of each mode's SLO-compliant throughput and longest history, into the report.

The options come checked from :mod:`relaygr_engine.bench.slo`; :mod:`relaygr_engine.bench.slo_output` words the
results.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import time
from typing import Optional

import numpy as np

from . import report as rpt
from . import slo_setup, slo_workers
from .slo_points import PointLog
from .common import exceed_count
from .sim import cpu_timer_valid, service_clock, simulate
from .slo_output import (METHOD, Console, _fmt_load, _headline, _notes, _prefill_line, _ratio, _verdict,
                         _wants_progress)
from ..workload.build import build_workload
from ..workload.logs import InteractionLog, read_interactions
from ..workload.profiles import load_profile, synthesize_interactions
from ..workload.requests import Workload, WorkloadConfig

_MAX_REQUESTS_FACTOR = 4  # the measured stream holds this many times --requests (for --min-duration-s)


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


def calibrate_latency(baseline, num_candidates: int, max_len: int, device: str, repeats: int = 3,
                      timer=time.perf_counter):
    """Fit the trigger's latency model on the baseline's full inference of this model (seconds to a few minutes).

    ``baseline`` is a :class:`~relaygr_engine.bench.sim.BaselineService` built as the baseline's workers are
    (implementation, CUDA graphs, compilation): the trigger predicts what a ranking without a cache costs as the
    baseline serves it. ``timer`` is the benchmark's service-time clock.
    """
    import torch

    from ..models import Behaviors
    from ..policy import calibrate

    cfg = baseline.model.config
    g = torch.Generator().manual_seed(0)

    def fn(L: int, C: int) -> None:
        L = max(L, 1)
        h = Behaviors(torch.randint(0, cfg.num_items, (L,), generator=g).to(device),
                      torch.randint(0, cfg.num_actions, (L,), generator=g).to(device),
                      torch.arange(L, dtype=torch.long).to(device) * 60)
        baseline.score(h, torch.randint(0, cfg.num_items, (C,), generator=g).to(device))

    grid = (32, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
    grid += tuple(4096 << k for k in range(1, max(0, (max_len - 1) // 4096).bit_length() + 1))  # production lengths
    lengths = sorted({min(max_len, x) for x in grid})
    meta = {"model": "benchmark model", "candidates": num_candidates, "baseline": baseline.impl.value,
            "cuda_graphs": baseline.cuda_graphs, "compiled": baseline.compile_model}
    return calibrate(fn, lengths, [num_candidates], repeats, warmup=1, quantile=0.75, timer=timer, device=device,
                     meta=meta)


def _cpu_timer_ok(args) -> bool:
    """Whether the thread's CPU time is a job's service time: the compute runs on this thread."""
    return cpu_timer_valid(args.device, args.threads)


def _timer(args):
    """The service-time clock ``--timer`` names (``auto``: thread CPU time on one CPU thread, else wall)."""
    assert args.timer != "cpu" or _cpu_timer_ok(args), "check_args refuses --timer cpu here"
    return service_clock(args.device, args.threads, args.timer)


class _Bench:
    """Everything one benchmark run shares: model, latency model, workloads, options, progress bar."""

    def __init__(self, args, log: InteractionLog, model, latency_model, console: "Console",
                 timer=time.perf_counter, points: Optional[PointLog] = None) -> None:
        self.args, self.log, self.model, self.lat, self.console = args, log, model, latency_model, console
        self.timer = timer
        self.points = points  # (finished points, kept on disk: a rerun serves only the others)
        self._workloads: dict = {}

    def workload(self, base_length: Optional[int] = None) -> Workload:
        """The whole stream: warm-up requests, then up to ``_MAX_REQUESTS_FACTOR * --requests`` measured ones."""
        a = self.args
        if base_length not in self._workloads:
            cap = a.max_history if base_length is None else max(a.max_history, a.max_len_hi)
            measured = min(_MAX_REQUESTS_FACTOR * a.requests, self.log.num_eligible() - a.warmup_requests)
            cfg = WorkloadConfig(num_items=self.model.config.num_items, num_actions=self.model.config.num_actions,
                                 num_requests=measured, warmup_requests=a.warmup_requests,
                                 num_candidates=a.candidates, length_scale=a.length_scale,
                                 base_length=base_length, max_history=cap, suffix_tokens=a.suffix_tokens,
                                 trim_tokens=a.trim_tokens or max(1, cap // 4),
                                 pipeline_delay_s=a.pipeline_delay_ms / 1e3, seed=a.seed)
            self._workloads[base_length] = build_workload(self.log, cfg)
        return self._workloads[base_length]

    def at(self, qps: float, base_length: Optional[int] = None) -> Workload:
        """The stream one run at ``qps`` serves: the warm-up, then the first ``max(--requests, --min-duration-s *
        qps)`` measured requests (so every run's measured window lasts long enough for queues to build)."""
        w = self.workload(base_length)
        n = min(len(w.measured), max(self.args.requests, math.ceil(self.args.min_duration_s * qps)))
        return Workload(w.requests[:w.num_warmup + n], w.config, w.info)

    def workers(self, mode: str, trigger: bool = True, requests=()) -> list:
        """Fresh workers of ``mode`` (:func:`relaygr_engine.bench.slo_workers.build`), their tensors prepared."""
        workers = slo_workers.build(self, mode, trigger)
        for w in workers:
            w.service.prepare(requests)
        return workers

    def run(self, mode: str, qps: float, base_length: Optional[int] = None, label: str = "",
            early_stop: bool = False) -> dict:
        """Serve one workload at one QPS in one mode; with ``early_stop``, stop once P99 > SLO is certain."""
        w = self.at(qps, base_length)
        workers = self.workers(mode, requests=w.requests)
        self.console.start(f"{mode} {label or f'{qps:.3g} QPS'}", len(w.requests))
        n = len(w.measured)
        stop = None
        if early_stop and not self.args.full_runs:
            stop = (self.args.slo_ms / 1e3, exceed_count(n, 99))   # that many over SLO: P99 > SLO
        res = simulate(workers, w, qps, mode=mode, timer=self.timer, progress=self.console.bar, stop_over=stop,
                       batch=slo_workers.batch_policy(self.args))
        return summarize(res)

    def kept(self, kind: str, mode: str, qps: float, base_length: Optional[int], measure):
        """``measure()``'s value for this point, or the value an earlier run of the same settings kept for it;
        a measured value is kept (on disk at once) before it is returned."""
        if self.points is not None:
            got = self.points.get(kind, mode, qps, base_length)
            if got is not None:
                return got
        value = measure()
        if self.points is not None:
            self.points.put(value, kind, mode, qps, base_length)
        return value

    def judge_kept(self, mode: str, qps: float, base_length: Optional[int] = None, label: str = ""):
        """:meth:`judge`, or what an earlier run of the same settings judged at this point."""
        got = self.kept("judge", mode, qps, base_length, lambda: list(self.judge(mode, qps, base_length, label)))
        return bool(got[0]), got[1]

    def judge(self, mode: str, qps: float, base_length: Optional[int] = None, label: str = "") -> tuple[bool, dict]:
        """Whether P99 <= SLO at one point: one run, plus ``--repeats - 1`` more when its P99 lies within
        ``--noise-band`` of the SLO (where timing noise can flip the outcome); the majority of runs decides.

        Returns the verdict and the summary of the run with the median P99, with ``p99_runs_ms`` (every run's
        P99; a run stopped early gives a lower bound) and ``passed_runs``.
        """
        a = self.args
        runs = [self.run(mode, qps, base_length, label, early_stop=True)]
        if a.repeats > 1 and a.slo_ms / (1 + a.noise_band) <= runs[0]["p99_ms"] <= a.slo_ms * (1 + a.noise_band):
            runs += [self.run(mode, qps, base_length, label, early_stop=True) for _ in range(a.repeats - 1)]
        passed = [r["p99_ms"] <= a.slo_ms and not r["stopped_early"] for r in runs]
        ok = 2 * sum(passed) > len(runs)
        order = sorted(range(len(runs)), key=lambda i: (not passed[i], runs[i]["p99_ms"]))
        chosen = dict(runs[order[len(runs) // 2]])
        chosen.update(p99_runs_ms=[r["p99_ms"] for r in runs], passed_runs=int(sum(passed)))
        return ok, chosen


def summarize(res) -> dict:
    """A run's JSON-able summary: latency percentiles, utilization, ranking sources, pre-infers, engine stats."""
    s = rpt.latency_summary(res.latency_s)
    src = res.source_counts()
    n = max(1, len(res.sources))
    s.update({
        "qps": res.qps, "workers": res.workers,
        "utilization": res.work_s / max(res.workers * (res.makespan_s - res.window_start_s), 1e-12),
        "stopped_early": bool(res.stopped_early), "completed": int(len(res.latency_s)),
        "num_requests": int(res.num_requests),
        "mean_service_ms": float(np.mean(res.service_s) * 1e3), "sources": src,
        "work_ms_per_request": res.work_s * 1e3 / max(1, len(res.latency_s)),
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


def run(args, log: InteractionLog, source: str) -> dict:
    """Run the benchmark described by ``args`` (checked by :func:`prepare`) on the interaction ``log`` (described
    by ``source``); return the report dict, written to ``args.out``."""
    import torch

    t_start = time.perf_counter()
    load_start = _loadavg()
    modes = list(args.modes)
    relay_mode = "relay" if "relay" in modes else next(m for m in modes if m != "baseline")
    disagg_ps = slo_workers.check(args)  # checked by check_args
    modes = slo_workers.modes(modes, disagg_ps)
    torch.set_num_threads(args.threads)
    out = Console(_wants_progress(args))

    num_actions = 6 if log.action_kind != "none" else 1
    model = slo_setup.build_model(args, num_items=args.num_items, num_actions=num_actions)
    out.say(f"model: {args.model}: {args.shape.describe()}; HBM budget {args.hbm_mb:g} MiB "
            f"({int(args.hbm_mb * 2**20) // args.shape.kv_bytes_per_token} tokens), CUDA graphs "
            f"{'on' if args.cuda_graphs else 'off'}, compiled {'yes' if args.compile else 'no'} (both sides)")
    out.say(f"workload: {source}")
    t0 = time.perf_counter()
    timer, timer_name = _timer(args)
    points = PointLog(args.out, _settings(args), resume=args.resume)  # (checked by check_args: settings agree)
    resumed = points.latency is not None
    if resumed:  # a run cut short: its calibration, so the searches walk the same points
        from ..policy import LatencyModel

        lat = LatencyModel.from_dict(points.latency)
        out.say(f"resuming {points.path}: {len(points)} points measured before, the calibration kept")
    else:
        lat = calibrate_latency(slo_workers.baseline(model, args), args.candidates,
                                max(args.max_history, args.max_len_hi), args.device, repeats=5, timer=timer)
        points.start(lat.to_dict())
    base_max = lat.max_history_len(args.slo_ms, args.candidates)
    out.say(f"service times: {timer_name}; baseline full inference: {args.baseline} "
         f"({'model.rank_uncached' if args.baseline == 'paged' else 'model.rank_full'})")
    how = "kept from the run resumed" if resumed else f"on this model in {time.perf_counter() - t0:.1f}s"
    out.say(f"calibrated full inference {how}: "
         + ", ".join(f"{lat.predict_ms(L, args.candidates):.1f} ms @{L}" for L in (256, 1024, 2048))
         + f" tokens; longest history within {args.slo_ms:g} ms unloaded ~{base_max}")

    bench = _Bench(args, log, model, lat, out, timer, points)
    main_wl = bench.at(0.0)  # warm-up + the --requests measured requests every run serves at least
    d = main_wl.describe()
    mean_ms = float(np.mean([lat.predict_ms(int(L), args.candidates)
                             for L in main_wl.history_lengths()[main_wl.num_warmup:]]))
    out.say(f"served stream: {d['warmup_requests']} warm-up + {d['requests']} measured requests (more at high QPS: "
         f">= {args.min_duration_s:g} s each run) of {d['users']} users, history tokens p50 "
         f"{d['history_len_p50']:.0f} / p90 {d['history_len_p90']:.0f} / max {d['history_len_max']} "
         f"(length scale {args.length_scale:g}, cap {args.max_history}); predicted mean full inference "
         f"{mean_ms:.1f} ms")
    # warm up every mode's code paths (the first calls import, allocate and initialise): relay modes without the
    # trigger so pre-infers, chunk extensions and cached rankings all run
    warm = Workload([dataclasses.replace(r, warmup=False) for r in main_wl.requests[:24]], main_wl.config,
                    main_wl.info)
    for m in modes:
        simulate(bench.workers(m, trigger=False, requests=warm.requests), warm, 2.0,
                 batch=slo_workers.batch_policy(args))

    start_qps = args.qps_start or max(0.05, 0.3 * args.workers * 1e3 / max(mean_ms, 1e-3))
    results: dict = {m: {} for m in modes}
    out.say(f"searching each mode's highest QPS with P99 <= {args.slo_ms:g} ms from {start_qps:.3g} QPS "
         f"(modes evaluated in turn)")
    qpoints: dict = {m: {} for m in modes}

    def at_qps(m):
        def evaluate(q):
            ok, s = bench.judge_kept(m, q)
            qpoints[m][q] = s
            out.say(f"  {m:<18} {q:8.3g} QPS  p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  busy "
                 f"{s['utilization']:4.0%}  {_verdict(s, args.slo_ms, ok)}")
            return ok, None
        return evaluate

    found = rpt.search_lockstep({m: (rpt.search_steps(start_qps, lo=start_qps / 256, hi=start_qps * 256, factor=2.0,
                                                      rel_tol=args.rel_tol, max_evals=14 if args.quick else 20),
                                     at_qps(m)) for m in modes})
    for m in modes:
        results[m]["curve"] = [dict(qpoints[m][q], qps=q) for q in sorted(qpoints[m])]
        results[m]["slo_throughput"] = found[m].to_dict()

    b = results["baseline"]["slo_throughput"]
    ref_qps = args.ref_qps or 0.5 * (b["best"] or start_qps / 2)
    out.say(f"reference QPS {ref_qps:.3g}")
    for m in modes:
        s = bench.kept("run", m, ref_qps, None, lambda: bench.run(m, ref_qps, label=f"{ref_qps:.3g} QPS (reference)"))
        results[m]["at_ref"] = s
        out.say(f"  {m:<18} @ref p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms  busy {s['utilization']:.0%}  "
             f"work {s['work_ms_per_request']:.1f} ms/request  sources {s['sources']}")
        if m != "baseline":
            out.say("  " + " " * 18 + " " + _prefill_line(s))

    if not args.no_max_len:
        step = args.len_step
        start_len = max(step, min(args.max_len_hi, (base_max or 256) // step * step))
        out.say(f"searching each mode's longest history with P99 <= {args.slo_ms:g} ms at {ref_qps:.3g} QPS")
        lpoints: dict = {m: {} for m in modes}

        def at_len(m):
            def evaluate(L):
                L = int(L)
                ok, s = bench.judge_kept(m, ref_qps, base_length=L, label=f"L={L}")
                lpoints[m][L] = s
                out.say(f"  {m:<18} L={L:5d}  p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  "
                     f"{_verdict(s, args.slo_ms, ok)}")
                return ok, None
            return evaluate

        found = rpt.search_lockstep({m: (rpt.search_steps(start_len, lo=step, hi=args.max_len_hi, factor=2.0,
                                                          integer=True, step=step,
                                                          max_evals=8 if args.quick else 14), at_len(m))
                                     for m in modes})
        for m in modes:
            results[m]["max_len"] = dict(found[m].to_dict(), curve=[
                {"length": L, "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "sources": s["sources"],
                 "history_len_mean": s["history_len_mean"], "stopped_early": s["stopped_early"],
                 "completed": s["completed"], "num_requests": s["num_requests"],
                 "p99_runs_ms": s.get("p99_runs_ms", []), "passed_runs": s.get("passed_runs")}
                for L, s in sorted(lpoints[m].items())])
    out.close()

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
    # Capacity at the reference QPS: the cache's pages, the prefixes resident when the run ended, the share of
    # rankings that found their prefix in device memory.
    es = rel["at_ref"]["engine_stats"]
    result.update(hbm_pages=es.get("pool_num_pages"), resident_prefixes=es.get("pool_entries"),
                  hbm_hit_rate=rel["at_ref"]["hit_rates"].get("hbm", 0.0), kv_bits=es.get("kv_bits"))
    line = rpt.result_line(result)
    report = {
        "title": "Relay-race serving vs full inference under a P99 ranking SLO",
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "headline": _headline(results, relay_mode, args, ref_qps, tput_ratio, len_ratio),
        "setup": dict(_setup(args, model, source, main_wl, ref_qps, lat),
                      load_average=f"{_fmt_load(load_start)} at start, {_fmt_load(_loadavg())} at end "
                                   f"(1-minute; {os.cpu_count()} CPUs)"),
        "settings": _settings(args),
        "method": METHOD, "modes": results, "result": result, "result_line": line,
        "notes": _notes(args, results, relay_mode),
        "elapsed_s": time.perf_counter() - t_start,
    }
    if disagg_ps:
        cx = slo_workers.crossover(results, relay_mode, disagg_ps, args.workers)
        report["crossover"] = cx
        report["sections"] = [("Co-located vs disaggregated (same workers, same trace)",
                               slo_workers.crossover_markdown(cx))]
    report["paths"] = rpt.write_report(report, args.out, json_path=args.json, plots=not args.no_plots)
    if disagg_ps and not args.no_plots:  # after the report, so nothing measured is lost to a plotting failure
        report["paths"]["crossover_plot"] = os.path.join(args.out, "crossover.png")
        slo_workers.plot_crossover(cx, report["paths"]["crossover_plot"])
    return report


# Options that name where a run writes or how it shows progress, not what it measures.
_OUTPUT_OPTIONS = ("seeds", "out", "json", "no_plots", "no_progress", "resume")


def _settings(args) -> dict:
    """Every option of the run as resolved (defaults filled), but its output ones: two runs with equal settings
    measured the same thing (seeds of one summary may differ in ``seed`` only)."""
    kept = {k: v for k, v in sorted(vars(args).items()) if k not in _OUTPUT_OPTIONS}
    return json.loads(json.dumps(kept, default=str))


def _setup(args, model, source, wl, ref_qps, lat) -> dict:
    import torch

    cfg = model.config
    d = wl.describe(qps=ref_qps)
    extra = slo_setup.describe(args)
    return {
        "device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "baseline": (f"{args.baseline}: " + ("model.rank_uncached (the engine's attention op, no cache)"
                                             if args.baseline == "paged" else "model.rank_full (dense oracle)")),
        "service_time_clock": _timer(args)[1],
        "model": dict({"attention": cfg.attention.value, "num_layers": cfg.num_layers, "hidden_dim": cfg.hidden_dim,
                       "num_heads": cfg.num_heads, "head_dim": cfg.head_dim, "num_items": cfg.num_items,
                       "num_actions": cfg.num_actions, "max_seq_len": cfg.max_seq_len}, **extra["model"]),
        "execution": extra["execution"],
        "cache": {"page_size": args.page_size, "hbm_mb": args.hbm_mb, "kv_dtype": args.kv_dtype,
                  "dram_mb_relay": args.dram_mb,
                  "lease_ms": args.lease_ms, "chunk_tokens": args.chunk_tokens,
                  "store_misses": not args.no_store_misses, "cuda_graphs": args.cuda_graphs},
        "trigger": ("off (every pre-infer the cache can take)" if args.no_trigger else
                    {"kind": "SequenceAwareTrigger", "margin": args.trigger_margin,
                     "latency_model_ms": {"a": lat.a, "b": lat.b, "c": lat.c, "d": lat.d}}),
        "workload_source": source,
        "length": (f"length_scale={args.length_scale:g} tokens per real behavior, cap {args.max_history} tokens "
                   f"(oldest dropped in blocks of {args.trim_tokens or max(1, args.max_history // 4)}); max-length "
                   f"search: base length L per user's first request, up to {args.max_len_hi}"),
        "repeats": (f"a point whose P99 is within {args.noise_band:.0%} of the SLO is run {args.repeats} times; the "
                    f"majority decides" if args.repeats > 1 else "one run per point"),
        "workers": {"K": args.workers, "max_batch": args.max_batch, "batch_tokens": args.batch_tokens,
                    "disaggregate": args.disaggregate or "-"},
        "requests": args.requests, "warmup_requests": args.warmup_requests, "candidates": args.candidates,
        "pipeline_delay_ms": args.pipeline_delay_ms,
        "suffix_tokens": args.suffix_tokens, "slo_ms": args.slo_ms, "ref_qps": ref_qps, "quick": bool(args.quick),
        "cpu_count": os.cpu_count(),
        "workload": {k: v for k, v in d.items() if not isinstance(v, (dict, list))},
    }
