"""The words of ``relaygr bench loadgen``'s report: :func:`render` (Markdown) and :func:`write` (``report.md``,
``report.json``)."""
from __future__ import annotations

import json
import os
from typing import Callable

from .report import _fmt, _table

__all__ = ["METHOD", "render", "write"]

METHOD = """\
**Load.** MLPerf LoadGen (`mlperf_loadgen`), Server scenario, performance only: queries at Poisson arrival times of
mean rate QPS, each issued on its own schedule, latency measured by LoadGen from the scheduled time to the
completion. A query is a user's request at retrieval; it completes when its ranking does, so LoadGen's bound is
the SLO plus the pipeline delay at the 99th percentile. LoadGen issues exactly the number of requests `bench slo`
measures at that QPS (`min_query_count`; `min_duration_ms` 0), in the stream's order (`--order stream`: the k-th
query serves the k-th request; LoadGen's random sample index would separate a user's consecutive requests).

**Serving in process.** One worker thread with the virtual clock's policy (rankings first; pre-infers in chunks,
dropped once their ranking is due), the same services (`bench.sim`) and engines, on the wall clock: every
wait counts (queueing, a running chunk, the interpreter and LoadGen's threads, other processes). A relay run's
cache is first warmed by the stream's warm-up requests on the virtual clock, exactly as `bench slo` serves them.

**Serving over HTTP.** The same queries sent to a running `relaygr serve` by client threads: the pre-infer at the
query (`POST /prefill`, forwarded on rejection), the ranking after the delay (`POST /rank`, to the ticket's
replica, by difference when it has the ticket: the prefix's digest and only the newer behaviors; a 409 resends
the whole history), through Serve's proxy and the affinity request router. The baseline ranks with
`"full_inference": true` (`model.rank_uncached` on the replica). Each run renames its users (new to the server)
and warms the cache with its warm-up requests, closed loop. A sample of scores is compared with full inference.

**Verdict.** A point passes when LoadGen's performance constraint holds (P99 <= SLO + delay) and every query was
answered without error; `Result is` (LoadGen's verdict, early stopping included: at 99% confidence it needs about
460 queries without a late one) is reported beside it. Marginal points are repeated and the majority decides,
and the QPS search is `bench slo`'s (sweep by 2, then bisection), the modes in lockstep."""


def _pct(p: dict, key: str):
    v = p.get(key)
    return "-" if v is None else v


def _curve(points: list) -> str:
    rows = [[p["qps"], (p["loadgen"] or {}).get("target_ms"), p.get("loadgen_ranking_p99_ms"), _pct(p, "p50_ms"),
             _pct(p, "p99_ms"), (p["loadgen"] or {}).get("validity"), "yes" if p["passed"] else "no",
             f"{p['answered']}/{p['queries']}", _sources(p.get("sources", {})), p.get("logs", "")]
            for p in points]
    return _table(["QPS", "LoadGen P99 ms", "ranking P99 ms (LoadGen - delay)", "own ranking P50 ms",
                   "own ranking P99 ms", "LoadGen result", "passes", "answered", "ranking sources", "logs"], rows)


def _sources(src: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(src.items())) or "-"


def _target(name: str, res: dict) -> list:
    lines = [f"## Target: {name}", ""]
    rows = []
    for m, r in res.items():
        st = r.get("slo_throughput") or {}
        ref = r.get("at_ref", {})
        rows.append([m, st.get("best", "-"), st.get("first_fail", "-"), ref.get("qps", "-"),
                     ref.get("loadgen_ranking_p99_ms", "-"), _pct(ref, "p50_ms"), _pct(ref, "p99_ms"),
                     (ref.get("loadgen") or {}).get("validity", "-")])
    lines += [_table(["mode", "SLO-compliant QPS", "first failing QPS", "ref QPS", "ranking P99 ms @ref (LoadGen)",
                      "own P50 ms @ref", "own P99 ms @ref", "LoadGen result @ref"], rows), ""]
    for m, r in res.items():
        if r.get("curve"):
            lines += [f"### {name} / {m}: the search", "", _curve(r["curve"]), ""]
        extra = [r[k] for k in ("at_ref", "at_low") if k in r]
        lines += [f"### {name} / {m}: reference and low-load points", "", _curve(extra), ""]
        for p in extra:
            if p.get("prefill"):
                lines.append(f"- {p['qps']:g} QPS pre-infers: " + ", ".join(f"{k} {_fmt(v)}" for k, v in
                                                                          sorted(p["prefill"].items())))
            if p.get("server_timing_p50_ms"):
                lines.append(f"- {p['qps']:g} QPS Server-Timing P50 (ms): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in p["server_timing_p50_ms"].items()))
            if p.get("client"):
                lines.append(f"- {p['qps']:g} QPS client: " + ", ".join(f"{k} {v}" for k, v in p["client"].items()
                                                                          if v))
        lines.append("")
    return lines


def render(report: dict) -> str:
    """The Markdown report."""
    s, r = report["setup"], report["result"]
    lines = [f"# {report['title']}", "", f"Generated {report['created']}.", "", "## Headline", "",
             report["headline"], "", "```", report["result_line"], "```", "", "## Setup", ""]
    lines += [f"- **{k}**: {_fmt(v)}" for k, v in s.items()]
    lines += ["", "## Method", "", METHOD, ""]
    for name, res in report["targets"].items():
        lines += _target(name, res)
    v = report.get("vclock")
    lines += ["## Beside the virtual clock (bench slo at the same settings)", ""]
    if v:
        rows = [[m, (x.get("slo_throughput") or {}).get("best"), (x.get("at_ref") or {}).get("p99_ms"),
                 (x.get("at_ref") or {}).get("mean_service_ms")] for m, x in v["modes"].items()]
        lines += [_table(["mode", "SLO-compliant QPS (virtual clock)", "P99 ms @ its ref",
                          "mean ranking service ms @ its ref"], rows), "",
                  f"Ratio: LoadGen x{_fmt(r.get('loadgen_slo_throughput_ratio'))}, virtual clock "
                  f"x{_fmt(r.get('vclock_slo_throughput_ratio'))} (report: {v.get('report')}).", ""]
    else:
        lines += ["Not run (--no-vclock).", ""]
    return "\n".join(lines)


def write(report: dict, out: str, render_fn: Callable[[dict], str] = render) -> dict:
    """Write ``report.json`` and ``report.md`` into ``out``; their paths."""
    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, "report.json"), "markdown": os.path.join(out, "report.md")}
    report = dict(report, paths=paths)
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    with open(paths["markdown"], "w", encoding="utf-8") as f:
        f.write(render_fn(report))
        f.write("\n")
    return paths
