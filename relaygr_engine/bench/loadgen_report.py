"""One run of ``relaygr bench loadgen`` (:func:`run`): the model and its calibration, the targets' searches and
reference points, the comparison with the virtual clock, and the report (``report.json``, ``report.md``, the
RESULT line)."""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Optional

import numpy as np

from . import report as rpt
from . import slo_setup, slo_workers
from .loadgen_run import HTTPTarget, InProcessTarget, judge, search, start_qps
from .loadgen_text import write
from .sim import simulate
from .slo_output import Console
from .slo_run import _Bench, _loadavg, _timer, calibrate_latency
from ..workload.requests import Workload

__all__ = ["calibration", "run"]

HTTP_MODES = ("baseline", "relay")


def calibration(args, log) -> tuple:
    """``(latency profile path, model, LatencyModel)``: ``--latency-profile``, or a calibration on this model's
    baseline (as ``bench slo`` makes it), saved to ``--out``/latency_profile.json."""
    import torch

    from ..policy import LatencyModel

    torch.set_num_threads(args.threads)
    model = slo_setup.build_model(args, num_items=args.num_items, num_actions=6 if log.action_kind != "none" else 1)
    if args.latency_profile:
        return args.latency_profile, model, LatencyModel.load(args.latency_profile)
    lat = calibrate_latency(slo_workers.baseline(model, args), args.candidates, max(args.max_history, args.max_len_hi),
                            args.device, repeats=5, timer=_timer(args)[0])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "latency_profile.json")
    lat.save(path)
    return path, model, lat


def _warm_paths(bench, modes) -> None:
    """Run every mode's code paths once (first calls import, allocate, initialise), as ``bench slo`` does."""
    w = bench.at(0.0)
    warm = Workload([dataclasses.replace(r, warmup=False) for r in w.requests[:24]], w.config, w.info)
    for m in modes:
        simulate(bench.workers(m, trigger=False, requests=warm.requests), warm, 2.0,
                 batch=slo_workers.batch_policy(bench.args))


def _http_client(args):
    from ..serving.http_client import RelayHTTPClient

    return RelayHTTPClient(args.url, encoding=args.http_encoding, by_difference=not args.no_by_difference,
                           inline_max_bytes=args.inline_max_bytes)


def _vclock_best(vclock: Optional[dict]) -> dict:
    if not vclock:
        return {}
    return {m: r["slo_throughput"]["best"] for m, r in vclock["modes"].items() if r.get("slo_throughput")}


def run(args, log, source: str, vclock: Optional[dict]) -> dict:
    """Measure every target (see :mod:`relaygr_engine.bench.loadgen`); the report dict, written to ``--out``."""
    t_start, load_start = time.perf_counter(), _loadavg()
    out = Console(False)
    profile, model, lat = calibration(args, log)
    bench = _Bench(args, log, model, lat, out, _timer(args)[0])
    _warm_paths(bench, args.modes)
    targets = []
    if not args.no_in_process:
        targets.append((InProcessTarget(bench, os.path.join(args.out, "loadgen", "in_process"), args.order),
                        list(args.modes)))
    if args.url:
        from .loadgen_http import warm_up

        client = _http_client(args)
        w = bench.at(0.0)
        warm_up(client, w.requests[:24], 1 << 60)
        for r in w.requests[:8]:
            client.rank(r.user_id + (1 << 60), *_tensors(r), full_inference=True)
        targets.append((HTTPTarget(bench, client, os.path.join(args.out, "loadgen", "http"), args.order,
                                   args.http_threads, args.check_every), [m for m in args.modes if m in HTTP_MODES]))
    known = _vclock_best(vclock)
    ref_qps = args.target_qps or args.ref_qps or (vclock or {}).get("result", {}).get("ref_qps")
    results: dict = {}
    for target, modes in targets:
        out.say(f"{target.name}: " + (f"one LoadGen run per mode at {args.target_qps:g} QPS" if args.target_qps else
                                      f"each mode's highest QPS with LoadGen P99 <= {args.slo_ms:g} + "
                                      f"{args.pipeline_delay_ms:g} ms (SLO + pipeline delay)"))
        if args.target_qps:
            res = {m: {"at_ref": judge(target, m, args.target_qps, args, out.say)[1]} for m in modes}
        else:
            res = search(target, modes, start_qps(bench, known), args, out.say)
            if ref_qps is None:
                ref_qps = 0.5 * (res["baseline"]["slo_throughput"]["best"] or args.qps_start or 1.0)
            for m in modes:
                res[m]["at_ref"] = target.point(m, ref_qps)
                out.say(f"  {target.name:<10} {m:<9} @ref {ref_qps:.3g} QPS  ranking p50 "
                        f"{res[m]['at_ref'].get('p50_ms', float('nan')):.1f} ms  p99 "
                        f"{res[m]['at_ref'].get('p99_ms', float('nan')):.1f} ms")
        if args.url and not args.no_in_process and "relay" in modes:  # the serving path's own cost: both targets
            res["relay"]["at_low"] = target.point("relay", args.low_qps)
        results[target.name] = res
    result = _result(args, results, vclock, ref_qps)
    report = {"title": "Relay-race serving vs full inference under MLPerf LoadGen (Server scenario), real time",
              "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "setup": _setup(args, model, source, profile, load_start),
              "targets": results, "vclock": _vclock_summary(vclock), "result": result,
              "result_line": rpt.result_line(result), "elapsed_s": time.perf_counter() - t_start}
    report["headline"] = _headline(result, args)
    report["paths"] = write(report, args.out)
    return report


def _tensors(req) -> tuple:
    import torch

    from .sim import to_behaviors

    return to_behaviors(req), torch.from_numpy(np.ascontiguousarray(req.candidates))


def _best(res: dict, mode: str) -> Optional[float]:
    r = res.get(mode, {})
    if "slo_throughput" in r:
        return r["slo_throughput"]["best"]
    return None


def _ratio(a, b) -> Optional[float]:
    return None if a is None or not b else a / b


def _result(args, results: dict, vclock: Optional[dict], ref_qps) -> dict:
    """The RESULT values (None where a target or mode did not run)."""
    inp, http = results.get("in_process", {}), results.get("http", {})
    main = inp or http
    v = (vclock or {}).get("result", {})
    r = {"loadgen_slo_throughput_ratio": _ratio(_best(main, "relay"), _best(main, "baseline")),
         "vclock_slo_throughput_ratio": v.get("slo_throughput_ratio"),
         "slo_qps_relay": _best(main, "relay"), "slo_qps_baseline": _best(main, "baseline"),
         "vclock_slo_qps_relay": v.get("slo_qps_relay"), "vclock_slo_qps_baseline": v.get("slo_qps_baseline"),
         "ref_qps": ref_qps,
         "p99_ms_relay": main.get("relay", {}).get("at_ref", {}).get("loadgen_ranking_p99_ms"),
         "p99_ms_baseline": main.get("baseline", {}).get("at_ref", {}).get("loadgen_ranking_p99_ms"),
         "vclock_p99_ms_relay": v.get("p99_ms_relay"), "vclock_p99_ms_baseline": v.get("p99_ms_baseline"),
         "slo_ms": args.slo_ms, "pipeline_delay_ms": args.pipeline_delay_ms}
    if http:
        points = [p for m in http.values() for p in _points(m)]
        low_h, low_i = http.get("relay", {}).get("at_low", {}), inp.get("relay", {}).get("at_low", {})
        diffs = [p["max_abs_diff"] for p in points if p.get("max_abs_diff") is not None]
        r.update(http_slo_qps_relay=_best(http, "relay"), http_slo_qps_baseline=_best(http, "baseline"),
                 http_slo_throughput_ratio=_ratio(_best(http, "relay"), _best(http, "baseline")),
                 http_vs_in_process_relay=_ratio(_best(http, "relay"), _best(inp, "relay")),
                 http_p99_ms_relay=http.get("relay", {}).get("at_ref", {}).get("loadgen_ranking_p99_ms"),
                 http_low_qps=args.low_qps, http_p50_ms_low=low_h.get("p50_ms"),
                 in_process_p50_ms_low=low_i.get("p50_ms"),
                 serving_path_ms=None if not (low_h and low_i) else low_h["p50_ms"] - low_i["p50_ms"],
                 http_queries=sum(p["queries"] for p in points),
                 http_queries_lost=sum(p["queries"] - p["answered"] for p in points),
                 http_checked=sum(p.get("checked") or 0 for p in points),
                 http_max_abs_diff=max(diffs) if diffs else None,
                 http_full_resends=sum((p.get("client") or {}).get("rank_full_resends", 0) for p in points))
    return r


def _points(mode_result: dict) -> list:
    """Every LoadGen run of a mode (each judged point's repeats included)."""
    out = [run for p in mode_result.get("curve", []) for run in p.get("runs", [p])]
    for k in ("at_ref", "at_low"):
        if k in mode_result:
            out += mode_result[k].get("runs", [mode_result[k]])
    return out


def _headline(r: dict, args) -> str:
    def f(v, unit=""):
        return "n/a" if v is None else f"{v:.4g}{unit}"

    text = (f"Under MLPerf LoadGen (Server, P99 <= {args.slo_ms:g} ms SLO + {args.pipeline_delay_ms:g} ms delay): "
            f"relay {f(r['slo_qps_relay'])} vs baseline {f(r['slo_qps_baseline'])} QPS "
            f"(x{f(r['loadgen_slo_throughput_ratio'])}); virtual clock x{f(r['vclock_slo_throughput_ratio'])} "
            f"({f(r['vclock_slo_qps_relay'])} vs {f(r['vclock_slo_qps_baseline'])} QPS).")
    if "http_slo_qps_relay" in r:
        text += (f" Over HTTP: relay {f(r['http_slo_qps_relay'])} vs baseline {f(r['http_slo_qps_baseline'])} QPS "
                 f"({f(r['http_vs_in_process_relay'])} of in process), serving path "
                 f"{f(r['serving_path_ms'], ' ms')} per ranking at {args.low_qps:g} QPS, "
                 f"{r['http_queries_lost']} of {r['http_queries']} queries lost, scores within "
                 f"{f(r['http_max_abs_diff'])} of full inference on {r['http_checked']} checked.")
    return text


def _vclock_summary(vclock: Optional[dict]) -> Optional[dict]:
    if not vclock:
        return None
    keep = ("slo_throughput", "at_ref")
    return {"result": vclock.get("result"), "created": vclock.get("created"),
            "modes": {m: {k: r[k] for k in keep if k in r} for m, r in vclock.get("modes", {}).items()},
            "report": (vclock.get("paths") or {}).get("markdown")}


def _setup(args, model, source: str, profile: str, load_start) -> dict:
    import torch

    cfg = model.config
    return {"device": args.device, "torch": torch.__version__, "threads": args.threads, "cpu_count": os.cpu_count(),
            "model": f"{args.model}: {args.shape.describe()}, {cfg.num_items} items",
            "workload_source": source, "candidates": args.candidates, "pipeline_delay_ms": args.pipeline_delay_ms,
            "slo_ms": args.slo_ms, "loadgen_bound_ms": args.slo_ms + args.pipeline_delay_ms,
            "requests": args.requests, "warmup_requests": args.warmup_requests,
            "min_duration_s": args.min_duration_s, "order": args.order, "latency_profile": profile,
            "trigger": "off" if args.no_trigger else f"margin {args.trigger_margin:g} x SLO",
            "hbm_mb": args.hbm_mb, "dram_mb": args.dram_mb, "page_size": args.page_size,
            "chunk_tokens": args.chunk_tokens, "url": args.url, "repeats": args.repeats,
            "noise_band": args.noise_band,
            "load_average": f"{_fmt(load_start)} at start, {_fmt(_loadavg())} at end (1-minute)"}


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"
