"""Latency statistics and the Markdown/JSON/PNG report of the SLO benchmark (the SLO searches are in
:mod:`relaygr_engine.bench.search`, re-exported here).

Percentiles are :func:`relaygr_engine.bench.common.percentile` (re-exported here), the definition every benchmark
uses: linear interpolation between the closest ranks, numpy's default.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .common import percentile
from .search import SearchResult, search_lockstep, search_max, search_steps, slo_throughput

__all__ = ["percentile", "latency_summary", "SearchResult", "search_max", "search_steps", "search_lockstep",
           "slo_throughput", "result_line",
           "render_markdown", "plot_latency_vs_qps", "plot_max_len", "write_report"]


# ----------------------------------------------------------------------------------------------- statistics
def latency_summary(latency_s) -> dict:
    """``n``, ``mean_ms``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``max_ms`` of latencies given in seconds."""
    x = np.asarray(latency_s, dtype=np.float64) * 1e3
    p50, p90, p99 = percentile(x, [50, 90, 99]).tolist()
    return {"n": int(x.size), "mean_ms": float(x.mean()), "p50_ms": p50, "p90_ms": p90, "p99_ms": p99,
            "max_ms": float(x.max())}


# ----------------------------------------------------------------------------------------------- output
def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v):
            return "nan"
        return f"{float(v):.4g}"
    return str(v)


def result_line(values: dict) -> str:
    """``RESULT k=v k=v ...`` with floats to 4 significant digits (None -> nan)."""
    return "RESULT " + " ".join(f"{k}={_fmt(float('nan') if v is None else v)}" for k, v in values.items())


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(report: dict, plots: bool = True) -> str:
    """The Markdown report of a :mod:`relaygr_engine.bench.slo` run (``report`` is its JSON dict); ``plots``:
    whether it links the PNG plots written beside it."""
    s = report["setup"]
    modes = report["modes"]
    lines = [f"# {report.get('title', 'Relay-race vs full inference under a P99 SLO')}", ""]
    lines += [f"Generated {report.get('created', '')}. SLO: P99 ranking latency <= **{s['slo_ms']:g} ms**.", ""]
    lines += ["## Headline", "", report.get("headline", ""), ""]
    rows = []
    for m, r in modes.items():
        ml = r.get("max_len", {})
        ref = r.get("at_ref", {})
        rows.append([m, _fmt(r["slo_throughput"]["best"]) + (" (capped)" if r["slo_throughput"]["status"] == "capped"
                                                             else ""),
                     _fmt(ml.get("best")) + (" (capped)" if ml.get("status") == "capped" else ""),
                     ref.get("p50_ms"), ref.get("p99_ms")])
    lines += [_table(["mode", "SLO-compliant QPS", f"max history @ {_fmt(s.get('ref_qps'))} QPS",
                      "P50 ms @ ref", "P99 ms @ ref"], rows), ""]
    lines += ["## Setup", ""]
    for k in ("device", "torch", "threads", "load_average", "baseline", "service_time_clock", "repeats", "workers",
              "model", "execution", "cache", "trigger", "workload_source", "length", "requests", "warmup_requests",
              "candidates", "pipeline_delay_ms", "suffix_tokens", "ref_qps", "quick", "sharing"):
        if k in s:
            lines.append(f"- **{k}**: {_fmt(s[k]) if not isinstance(s[k], (dict, list)) else json.dumps(s[k])}")
    wl = s.get("workload", {})
    if wl:
        lines.append("- **served stream**: " + ", ".join(f"{k}={_fmt(v)}" for k, v in wl.items()
                                                     if not isinstance(v, (dict, list))))
    lines += ["", "## Method", "", report.get("method", ""), ""]
    lines += ["## Latency vs QPS", ""] + (["![latency vs QPS](latency_vs_qps.png)", ""] if plots else [])
    for m, r in modes.items():
        lines += [f"### {m}", ""]
        rows = [[p["qps"], p["p50_ms"], _p99(p), p["mean_ms"], p.get("utilization"), p.get("work_ms_per_request"),
                 _sources(p.get("sources", {})), _prefill(p.get("prefill", {}))] for p in r["curve"]]
        lines += [_table(["QPS", "P50 ms", "P99 ms", "mean ms", "busy share", "worker ms / request",
                          "ranking sources", "pre-infers"], rows), "",
                  "(worker ms / request: worker time spent on the measured requests, their rankings and "
                  "pre-infers, per measured request)", ""]
        st = r["slo_throughput"]
        lines += [f"SLO-compliant throughput: **{_fmt(st['best'])} QPS** ({st['status']}; first failing QPS "
                  f"{_fmt(st['first_fail'])}).", ""]
    lines += ["## Longest history within the SLO", ""] + (["![max history](max_len.png)", ""] if plots else [])
    for m, r in modes.items():
        ml = r.get("max_len")
        if not ml:
            continue
        rows = [[p["length"], p["p50_ms"], _p99(p), _sources(p.get("sources", {}))] for p in ml["curve"]]
        lines += [f"### {m}", "", _table(["base length", "P50 ms", "P99 ms", "ranking sources"], rows), "",
                  f"Longest base history length with P99 <= SLO at {_fmt(s.get('ref_qps'))} QPS: "
                  f"**{_fmt(ml['best'])}** ({ml['status']}; first failing {_fmt(ml['first_fail'])}).", ""]
    lines += ["## Cache tiers and trigger at the reference QPS", ""]
    for m, r in modes.items():
        ref = r.get("at_ref", {})
        if not ref:
            continue
        lines += [f"### {m}", "", f"- ranking sources: {_sources(ref.get('sources', {}))}",
                  f"- hit rates: {json.dumps(ref.get('hit_rates', {}))}",
                  f"- pre-infers: {_prefill(ref.get('prefill', {}))}"]
        es = ref.get("engine_stats", {})
        if es:
            lines.append("- engine stats: " + ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(es.items())))
        lines.append("")
    for title, text in report.get("sections", []):
        lines += [f"## {title}", "", text, ""]
    if report.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    lines += ["```", report.get("result_line", ""), "```", ""]
    return "\n".join(lines)


def _p99(p: dict) -> str:
    """P99 cell: a run stopped once P99 > SLO was certain shows its partial P99 as a lower bound; a repeated point
    lists every run's P99 (the cell's value is the median run's)."""
    runs = p.get("p99_runs_ms") or []
    extra = (f" (median of {len(runs)} runs: " + ", ".join(_fmt(v) for v in runs) + ")") if len(runs) > 1 else ""
    if p.get("stopped_early"):
        return f">= {_fmt(p['p99_ms'])} (stopped at {p.get('completed')}/{p.get('num_requests')})" + extra
    return _fmt(p["p99_ms"]) + extra


def _sources(src: dict) -> str:
    tot = sum(src.values()) or 1
    return ", ".join(f"{k} {v / tot:.0%}" for k, v in sorted(src.items())) or "-"


def _prefill(pf: dict) -> str:
    if not pf or not pf.get("signals"):
        return "-"
    refused = pf.get("refused", {})
    ref = (" (" + ", ".join(f"{k} {v}" for k, v in sorted(refused.items())) + ")") if refused else ""
    return (f"{pf.get('signals', 0)} signals: {pf.get('admitted', 0)} cached, "
            f"{sum(refused.values())} declined{ref}, {pf.get('dropped_stale', 0)} dropped stale")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def plot_latency_vs_qps(modes: dict, slo_ms: float, path) -> Path:
    """P50 (dashed) and P99 (solid) ranking latency vs QPS per mode, with the two reference lines: the SLO
    (horizontal) and each mode's SLO-compliant throughput (vertical, dotted). The legend sits beside the axes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 4.4), dpi=120)
    for i, (m, r) in enumerate(modes.items()):
        pts = sorted(r["curve"], key=lambda p: p["qps"])
        q = [p["qps"] for p in pts]
        color = f"C{i}"
        ax.plot(q, [p["p99_ms"] for p in pts], "-", color=color, label=f"{m} P99")
        full = [p for p in pts if not p.get("stopped_early")]
        part = [p for p in pts if p.get("stopped_early")]
        ax.plot([p["qps"] for p in full], [p["p99_ms"] for p in full], "o", color=color)
        if part:
            ax.plot([p["qps"] for p in part], [p["p99_ms"] for p in part], "o", mfc="none", color=color,
                    label=f"{m} P99 lower bound (run stopped)")
        ax.plot(q, [p["p50_ms"] for p in pts], "x--", color=color, alpha=0.6, label=f"{m} P50")
        best = r["slo_throughput"]["best"]
        if best:
            ax.axvline(best, color=color, lw=1.0, ls=":", label=f"{m} SLO-compliant throughput ({best:.3g} QPS)")
    ax.axhline(slo_ms, color="k", lw=1, ls="-.", label=f"SLO: P99 <= {slo_ms:g} ms")
    ax.set_xlabel("offered load (QPS)")
    ax.set_ylabel("ranking latency (ms, log scale)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_title("Ranking latency vs load")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_max_len(modes: dict, ref_qps: float, path) -> Path:
    """Bars of the longest base history length within the SLO per mode."""
    plt = _pyplot()
    names = [m for m, r in modes.items() if r.get("max_len")]
    vals = [modes[m]["max_len"]["best"] or 0 for m in names]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    bars = ax.bar(names, vals, color=[f"C{i}" for i in range(len(names))])
    for b, m in zip(bars, names):
        tag = " (capped)" if modes[m]["max_len"]["status"] == "capped" else ""
        ax.annotate(f"{int(b.get_height())}{tag}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xlabel("mode")
    ax.set_ylabel("longest history (tokens)")
    ax.set_ylim(0, max(vals + [1]) * 1.15)  # room for the labels above the bars
    ax.set_title(f"Longest history with P99 <= SLO at {ref_qps:.3g} QPS")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(report: dict, out_dir, json_path: Optional[str] = None, plots: bool = True) -> dict:
    """Write ``report.json`` and ``report.md``, then (``plots``) ``latency_vs_qps.png`` and ``max_len.png``, into
    ``out_dir``.

    The JSON and Markdown are on disk before any plot is drawn, so a failing plot never loses a measurement.
    ``json_path`` also writes the JSON there. Returns the written paths by name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "markdown": out / "report.md"}
    text = json.dumps(_jsonable(report), indent=1)
    paths["json"].write_text(text + "\n")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
        paths["json_copy"] = Path(json_path)
    paths["markdown"].write_text(render_markdown(report, plots=plots))
    if plots:
        paths["latency_plot"] = plot_latency_vs_qps(report["modes"], report["setup"]["slo_ms"],
                                                    out / "latency_vs_qps.png")
        if any(r.get("max_len") for r in report["modes"].values()):
            paths["max_len_plot"] = plot_max_len(report["modes"], report["setup"].get("ref_qps") or 0.0,
                                                 out / "max_len.png")
    return {k: str(v) for k, v in paths.items()}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, os.PathLike):
        return str(x)
    return x
