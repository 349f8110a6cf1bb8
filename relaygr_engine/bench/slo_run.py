"""One run of ``relaygr bench slo`` (:func:`run`): the workload, the latency calibration, the served runs
(:class:`~relaygr_engine.bench.slo_bench._Bench`) and the searches of each mode's SLO-compliant throughput and
longest history, into the report.

The options come checked from :mod:`relaygr_engine.bench.slo`; :mod:`relaygr_engine.bench.slo_output` words the
results; what the seeds of one command share (model, calibration, services, budget) is
:mod:`relaygr_engine.bench.slo_shared`.
"""
from __future__ import annotations

import datetime
import json
import os
import time

import numpy as np

from . import report as rpt
from . import slo_cost, slo_setup, slo_workers
from .sim import cpu_timer_valid, service_clock
from .slo_bench import _Bench, _loadavg, summarize  # noqa: F401 (the served runs; re-exported)
from .slo_budget import Deadline
from .slo_output import METHOD, Console, _fmt_load, _headline, _notes, _prefill_line, _ratio, _verdict, \
    _wants_progress, budget_markdown
from .slo_points import PointLog
from .slo_shared import calibrate_latency  # noqa: F401 (re-exported)
from ..workload.logs import InteractionLog, read_interactions
from ..workload.profiles import load_profile, synthesize_interactions


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


def _cpu_timer_ok(args) -> bool:
    """Whether the thread's CPU time is a job's service time: the compute runs on this thread."""
    return cpu_timer_valid(args.device, args.threads)


def _timer(args):
    """The service-time clock ``--timer`` names (``auto``: thread CPU time on one CPU thread, else wall)."""
    assert args.timer != "cpu" or _cpu_timer_ok(args), "check_args refuses --timer cpu here"
    return service_clock(args.device, args.threads, args.timer)


def run(args, log: InteractionLog, source: str, shared=None) -> dict:
    """Run the benchmark described by ``args`` (checked by :func:`prepare`) on the interaction ``log`` (described
    by ``source``); return the report dict, written to ``args.out``.

    ``shared``: what the seeds of one command share (:class:`~relaygr_engine.bench.slo_shared.Shared`: model,
    calibration, services, budget and plan); default: this run's own. Raises
    :class:`~relaygr_engine.bench.slo_budget.Deadline` where a budget left no time for the reference runs, and
    :class:`~relaygr_engine.bench.slo_budget.BudgetTooSmall` where it cannot reach the quick resolution."""
    import torch

    from .slo_shared import Shared

    shared = shared if shared is not None else Shared(args)
    t_start = time.perf_counter()
    load_start = _loadavg()
    modes = list(args.modes)
    relay_mode = "relay" if "relay" in modes else next(m for m in modes if m != "baseline")
    disagg_ps = slo_workers.check(args)  # checked by check_args
    modes = slo_workers.modes(modes, disagg_ps)
    torch.set_num_threads(args.threads)
    out = Console(_wants_progress(args))

    num_actions = 6 if log.action_kind != "none" else 1
    model = shared.model(args, num_actions)
    out.say(f"model: {args.model}: {args.shape.describe()}; HBM budget {args.hbm_mb:g} MiB "
            f"({int(args.hbm_mb * 2**20) // args.shape.kv_bytes_per_token} tokens), CUDA graphs "
            f"{'on' if args.cuda_graphs else 'off'}, compiled {'yes' if args.compile else 'no'} (both sides)")
    out.say(f"workload: {source}")
    timer, timer_name = _timer(args)
    points = PointLog(args.out, _settings(args, kept=True), resume=args.resume)  # (check_args: settings agree)
    shared.stream(args, log, model, timer, modes, points)   # the served stream's shape, for a budget's checks
    pool = shared.pool(args, model, timer)
    builds_before = dict(pool.builds)
    lat, how = shared.calibrate(args, model, timer, points.latency, check=shared.early_check(args))
    points.start(lat.to_dict())
    base_max = lat.max_history_len(args.slo_ms, args.candidates)
    out.say(f"service times: {timer_name}; baseline full inference: {args.baseline} "
            f"({'model.rank_uncached' if args.baseline == 'paged' else 'model.rank_full'})")
    out.say(f"calibrated full inference {how}: "
            + ", ".join(f"{lat.predict_ms(L, args.candidates):.1f} ms @{L}" for L in (256, 1024, 2048))
            + f" tokens; longest history within {args.slo_ms:g} ms unloaded ~{base_max}")

    shape = shared.prepare_seed(args, log, model, lat, out, timer, modes, points)   # (budget: plan applied)
    seed_t0 = time.perf_counter()
    bench = _Bench(args, log, model, lat, out, timer, points, pool, cost=shared.cost)
    main_wl = bench.at(0.0)  # warm-up + the --requests measured requests every run serves at least
    d = main_wl.describe()
    mean_ms = float(np.mean([lat.predict_ms(int(L), args.candidates)
                             for L in main_wl.history_lengths()[main_wl.num_warmup:]]))
    out.say(f"served stream: {d['warmup_requests']} warm-up + {d['requests']} measured requests (more at high QPS: "
            f">= {args.min_duration_s:g} s each run) of {d['users']} users, history tokens p50 "
            f"{d['history_len_p50']:.0f} / p90 {d['history_len_p90']:.0f} / max {d['history_len_max']} "
            f"(length scale {args.length_scale:g}, cap {args.max_history}); predicted mean full inference "
            f"{mean_ms:.1f} ms")
    workload_s = time.perf_counter() - seed_t0
    budgeted = shared.budget is not None
    prior = (shared.prior() or {}) if budgeted else {}
    capacity = args.workers * 1e3 / max(mean_ms, 1e-3)
    start_qps = args.qps_start or max(0.05, 0.3 * capacity)
    near = None if args.qps_start or not budgeted else slo_cost.expected(
        "qps", modes, slo_cost.BASE_UTILIZATION * capacity, prior.get("qps"), args.rel_tol)
    results: dict = {m: {} for m in modes}
    out.say(f"searching each mode's highest QPS with P99 <= {args.slo_ms:g} ms from "
            + (f"{start_qps:.3g} QPS" if not near else ", ".join(f"{m} {v:.3g}" for m, (v, _) in near.items())
               + (" (the earlier seeds' answers)" if prior.get("qps") else " QPS (expected)"))
            + " (modes evaluated in turn)")
    qpoints: dict = {m: {} for m in modes}
    stop = shared.phase(bench, "qps", shape)

    def at_qps(m):
        def evaluate(q):
            try:
                ok, s = bench.judge_kept(m, q)
            except Deadline:
                out.say(f"  {m:<18} {q:8.3g} QPS  stopped at the phase's deadline (not kept)")
                return None
            qpoints[m][q] = s
            out.say(f"  {m:<18} {q:8.3g} QPS  p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  busy "
                    f"{s['utilization']:4.0%}  {_verdict(s, args.slo_ms, ok)}")
            return ok, None
        return evaluate

    searches = slo_cost.qps_searches(modes, start_qps, args.rel_tol, 14 if args.quick else 20, near)
    found = rpt.search_lockstep({m: (rpt.search_steps(**kw, stop=stop), at_qps(m)) for m, kw in searches.items()})
    for m in modes:
        results[m]["curve"] = [dict(qpoints[m][q], qps=q) for q in sorted(qpoints[m])]
        results[m]["slo_throughput"] = found[m].to_dict()

    b = results["baseline"]["slo_throughput"]
    ref_qps = args.ref_qps or 0.5 * (b["best"] or start_qps / 2)
    out.say(f"reference QPS {ref_qps:.3g}")
    shared.phase(bench, "ref", shape)
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
        near = None
        if budgeted:
            near = slo_cost.expected("len", modes, slo_cost.start_length(
                lat, args.candidates, ref_qps, shape.growth, step, args.max_len_hi, args.workers), prior.get("len"),
                step)
        out.say(f"searching each mode's longest history with P99 <= {args.slo_ms:g} ms at {ref_qps:.3g} QPS"
                + ("" if not near else " from " + ", ".join(f"{m} {int(v)}" for m, (v, _) in near.items())))
        lpoints: dict = {m: {} for m in modes}
        stop = shared.phase(bench, "len", shape)

        def at_len(m):
            def evaluate(L):
                L = int(L)
                try:
                    ok, s = bench.judge_kept(m, ref_qps, base_length=L, label=f"L={L}")
                except Deadline:
                    out.say(f"  {m:<18} L={L:5d}  stopped at the phase's deadline (not kept)")
                    return None
                lpoints[m][L] = s
                out.say(f"  {m:<18} L={L:5d}  p50 {s['p50_ms']:8.2f} ms  p99 {s['p99_ms']:8.2f} ms  "
                        f"{_verdict(s, args.slo_ms, ok)}")
                return ok, None
            return evaluate

        searches = slo_cost.length_searches(modes, start_len, step, args.max_len_hi, 8 if args.quick else 14, near)
        found = rpt.search_lockstep({m: (rpt.search_steps(**kw, stop=stop), at_len(m))
                                     for m, kw in searches.items()})
        for m in modes:
            results[m]["max_len"] = dict(found[m].to_dict(), curve=[
                {"length": L, "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"], "sources": s["sources"],
                 "history_len_mean": s["history_len_mean"], "stopped_early": s["stopped_early"],
                 "completed": s["completed"], "num_requests": s["num_requests"],
                 "p99_runs_ms": s.get("p99_runs_ms", []), "passed_runs": s.get("passed_runs")}
                for L, s in sorted(lpoints[m].items())])
    shared.phase(bench, "done", shape)
    out.close()
    shared.remember(results)

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
    budget = shared.record(bench, results, workload_s, pool, builds_before)
    line = rpt.result_line(dict(result, **shared.result_fields()))
    report = {
        "title": "Relay-race serving vs full inference under a P99 ranking SLO",
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "headline": _headline(results, relay_mode, args, ref_qps, tput_ratio, len_ratio),
        "setup": dict(_setup(args, model, source, main_wl, ref_qps, lat),
                      load_average=f"{_fmt_load(load_start)} at start, {_fmt_load(_loadavg())} at end "
                                   f"(1-minute; {os.cpu_count()} CPUs)", sharing=shared.sharing),
        "settings": _settings(args),
        "method": METHOD, "modes": results, "result": result, "result_line": line,
        "notes": _notes(args, results, relay_mode),
        "elapsed_s": time.perf_counter() - t_start,
    }
    sections = []
    if budget is not None:
        report["budget"] = budget
        sections.append(("Budget (--budget-s)", budget_markdown(budget)))
    if disagg_ps:
        cx = slo_workers.crossover(results, relay_mode, disagg_ps, args.workers)
        report["crossover"] = cx
        sections.append(("Co-located vs disaggregated (same workers, same trace)", slo_workers.crossover_markdown(cx)))
    if sections:
        report["sections"] = sections
    t_write = time.perf_counter()
    report["paths"] = rpt.write_report(report, args.out, json_path=args.json, plots=not args.no_plots)
    if disagg_ps and not args.no_plots:  # after the report, so nothing measured is lost to a plotting failure
        report["paths"]["crossover_plot"] = os.path.join(args.out, "crossover.png")
        slo_workers.plot_crossover(cx, report["paths"]["crossover_plot"])
    shared.wrote(time.perf_counter() - t_write)
    return report


# Options that name where a run writes or how it shows progress, not what it measures.
_OUTPUT_OPTIONS = ("seeds", "out", "json", "no_plots", "no_progress", "resume", "budget_s",
                   "usable_events")  # (the last: the log's size, known after the settings are checked)


def _settings(args, kept: bool = False) -> dict:
    """Every option of the run as resolved (defaults filled), but its output ones: two runs with equal settings
    measured the same thing (seeds of one summary may differ in ``seed`` only). ``kept``: as a points file
    records them, the options a budget plans (``args.planned``) as None (the plan is kept beside them)."""
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in _OUTPUT_OPTIONS}
    if kept:
        settings.update({k: None for k in getattr(args, "planned", None) or ()})
    return json.loads(json.dumps(settings, default=str))


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
