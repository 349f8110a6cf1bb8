"""``relaygr bench slo --seeds 0,1,2``: the SLO benchmark once per seed, reported as medians with their spread.

Each seed is a whole run of :func:`relaygr_engine.bench.slo.run` (its own synthetic draw or sample of the log,
workload, trace and searches) written to ``--out/seed{N}``; the seeds of one command share the model (its weights
do not depend on the seed), the calibration and the services (:mod:`relaygr_engine.bench.slo_shared`), and under
``--budget-s`` one plan (:mod:`relaygr_engine.bench.slo_budget`). Ratios (relay / baseline, disaggregated /
co-located) are measured inside each run and then summarised across seeds: the median, and the smallest and
largest value. ``--out`` gets ``summary.md`` and ``summary.json``; the last line is ``RESULT
slo_throughput_ratio=<median> slo_throughput_ratio_min=... slo_throughput_ratio_max=... max_len_ratio=... ...
seeds=N``.

The seeds of a long run may also go in separate calls into the same ``--out`` (``--seeds 0``, then ``--seeds 1``,
...; each records its settings); ``relaygr bench seeds OUT`` then summarises them all, refusing runs whose settings
differ other than in their seed.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
from typing import Optional

from . import report as rpt
from .common import percentile

__all__ = ["parse_seeds", "read_seed_reports", "run_seeds", "summarize_seeds", "write_summary"]


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``; ValueError naming ``--seeds`` otherwise."""
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds must be distinct integers >= 0, got {text!r}")
    return seeds


def _spread(values: list) -> dict:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "values": list(values)}
    return {"median": percentile(vals, 50), "min": min(vals), "max": max(vals), "values": list(values)}


def summarize_seeds(reports: dict) -> dict:
    """Median and spread over seeds of every RESULT value and of each mode's SLO QPS and longest history."""
    keys = list(next(iter(reports.values()))["result"])
    out = {"result": {k: _spread([r["result"].get(k) for r in reports.values()]) for k in keys
                      if k not in ("slo_ms",)}}
    modes = next(iter(reports.values()))["modes"]
    out["modes"] = {m: {"slo_qps": _spread([r["modes"][m]["slo_throughput"]["best"] for r in reports.values()]),
                        "max_len": _spread([(r["modes"][m].get("max_len") or {}).get("best")
                                            for r in reports.values()])}
                    for m in modes}
    cx = [r.get("crossover") for r in reports.values() if r.get("crossover")]
    if cx:
        out["crossover"] = {
            "crossover_p": [c["crossover_p"] for c in cx], "policy_p": [c.get("policy_p") for c in cx],
            "rows": [{"P": row["P"], "qps_vs_colocated": _spread([c["rows"][i]["qps_vs_colocated"] for c in cx]),
                      "len_vs_colocated": _spread([c["rows"][i]["len_vs_colocated"] for c in cx])}
                     for i, row in enumerate(cx[0]["rows"])]}
    return out


def _cell(s: dict) -> str:
    if s["median"] is None:
        return "-"
    return f"{rpt._fmt(s['median'])} [{rpt._fmt(s['min'])} .. {rpt._fmt(s['max'])}]"


def render(summary: dict, seeds: list[int], setup: dict) -> str:
    lines = [f"# SLO benchmark over seeds {', '.join(map(str, seeds))}", "",
             f"Generated {datetime.datetime.now().isoformat(timespec='seconds')}. Median [min .. max] over "
             f"{len(seeds)} seeds; each ratio is measured inside one run. Per-seed reports: `seed<N>/report.md`.", "",
             f"- workload: {setup.get('workload_source')}", f"- device: {setup.get('device')}, "
             f"{setup.get('threads')} thread(s), {setup.get('cpu_count')} CPUs; service-time clock: "
             f"{setup.get('service_time_clock')}", f"- workers: {json.dumps(setup.get('workers'))}", "",
             rpt._table(["mode", "SLO-compliant QPS", "longest history within the SLO"],
                        [[m, _cell(v["slo_qps"]), _cell(v["max_len"])] for m, v in summary["modes"].items()]), "",
             rpt._table(["result", "median [min .. max]"], [[k, _cell(v)] for k, v in summary["result"].items()]),
             ""]
    b = summary.get("budget")
    if b:
        from .slo_budget import Plan

        lines += ["## Budget (--budget-s)", "", Plan.from_dict(b["plan"]).markdown(), "",
                  f"The command used {b['elapsed_s']:g} s of its {b['budget_s']:g} s"
                  + (f"; seeds not finished: {b['unfinished_seeds']}" if b.get("unfinished_seeds") else "")
                  + ". The seeds shared the model (its weights do not depend on the seed), the calibration, the "
                    "compiled model, the captured graphs and the code-path warm-up; each seed paid for its own log, "
                    "workloads and runs (per seed: `seed<N>/report.md`, section Budget).", "",
                  rpt._table(["seed", "phase", "predicted s", "deadline s", "spent s"],
                             [[s, name, p.get("predicted_s"), p.get("deadline_s"), p.get("spent_s", "-")]
                              for s, ph in b["phases"].items() for name, p in ph.items()]), "",
                  "```", summary.get("result_line", ""), "```", ""]
    cx = summary.get("crossover")
    if cx:
        lines += ["## Co-located vs disaggregated", "",
                  rpt._table(["P", "QPS vs co-located", "max history vs co-located"],
                             [[r["P"], _cell(r["qps_vs_colocated"]), _cell(r["len_vs_colocated"])]
                              for r in cx["rows"]]), "",
                  f"Crossover P per seed: {cx['crossover_p']}; ratio policy's P per seed: {cx['policy_p']}.", ""]
    return "\n".join(lines)


def plot_crossover(cx: dict, workers, path) -> str:
    """Disaggregated / co-located SLO-compliant throughput and longest history per P: medians over seeds with
    min..max bars, 1 = co-located."""
    plt = rpt._pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ps = [r["P"] for r in cx["rows"]]
    for k, (key, label) in enumerate((("qps_vs_colocated", "SLO-compliant QPS"),
                                      ("len_vs_colocated", "longest history"))):
        med = [r[key]["median"] for r in cx["rows"]]
        if any(m is None for m in med):
            continue
        lo = [m - r[key]["min"] for m, r in zip(med, cx["rows"])]
        hi = [r[key]["max"] - m for m, r in zip(med, cx["rows"])]
        ax.bar([p + (k - 0.5) * 0.35 for p in ps], med, width=0.35, yerr=[lo, hi], capsize=4, color=f"C{k}",
               label=label)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="co-located")
    ax.set_xticks(ps)
    ax.set_xlabel(f"pre-infer workers P of K = {workers}")
    ax.set_ylabel("disaggregated / co-located")
    ax.set_title("median over seeds, bars: min..max")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def seed_args(args) -> list:
    """One copy of ``args`` per seed of ``args.seeds``: that seed, its out dir ``args.out/seed{N}``, no JSON path
    and no seeds of its own (one run's options)."""
    runs = []
    for s in parse_seeds(args.seeds):
        a = copy.copy(args)
        a.seed, a.out, a.json, a.seeds = s, os.path.join(args.out, f"seed{s}"), None, None
        runs.append(a)
    return runs


def run_seeds(args, run, shared=None) -> dict:
    """``run(args)`` once per seed of ``args.seeds`` (:func:`seed_args`); writes and returns the summary.

    ``shared``: what the seeds share (:class:`~relaygr_engine.bench.slo_shared.Shared`). Under its budget, a seed
    that does not fit any more is not started, and one stopped before its reference runs is not finished: both
    are listed in the summary (their points, kept, let ``--resume`` continue them).

    Raises
    ------
    relaygr_engine.bench.slo_budget.Deadline
        No seed finished within the budget.
    """
    from .slo_budget import Deadline

    reports, unfinished = {}, []
    todo = seed_args(args)
    for i, a in enumerate(todo):
        if shared is not None:
            shared.seeds_left = [x.seed for x in todo[i:]]
            if not shared.can_start_seed():
                unfinished += [x.seed for x in todo[i:]]
                print(f"=== seeds {', '.join(str(x.seed) for x in todo[i:])}: not started (the budget's time left "
                      f"does not fit one) ===", flush=True)
                break
        print(f"=== seed {a.seed} ===", flush=True)
        try:
            reports[a.seed] = run(a)
        except Deadline as e:
            unfinished.append(a.seed)
            print(f"seed {a.seed}: not finished within the budget ({e}); its points are kept in {a.out}", flush=True)
    if not reports:
        raise Deadline(f"no seed of {args.seeds} finished")
    budget = None
    if shared is not None and shared.budget is not None:
        budget = {"budget_s": shared.budget.seconds, "unfinished_seeds": unfinished}
    return write_summary(args.out, reports, budget=budget, elapsed=(lambda: shared.budget.elapsed()) if budget
                         else None)


def write_summary(out: str, reports: dict, budget: Optional[dict] = None, elapsed=None) -> dict:
    """Summarise ``reports`` (seed -> one run's report) into ``out``: ``summary.json``, ``summary.md`` (and the
    crossover plot of disaggregated runs); returns the summary with its ``result_line``.

    Runs under ``--budget-s`` add the budget, the command's elapsed seconds (``elapsed()`` when the summary is
    written, else the last report's) and the plan's resolution to the summary and its RESULT line; ``budget``
    may list ``unfinished_seeds``."""
    seeds = sorted(reports)
    reports = {s: reports[s] for s in seeds}
    summary = summarize_seeds(reports)
    setup = next(iter(reports.values()))["setup"]
    planned = [r["budget"] for r in reports.values() if r.get("budget")]
    if planned:
        summary["budget"] = dict({"budget_s": planned[0]["budget_s"], "plan": planned[0]["plan"],
                                  "unfinished_seeds": [], "phases": {s: r["budget"]["phases"] for s, r in
                                                                     reports.items() if r.get("budget")},
                                  "sharing": {s: r["budget"].get("sharing") for s, r in reports.items()
                                              if r.get("budget")}}, **(budget or {}))
    os.makedirs(out, exist_ok=True)
    flat = {}
    for k in ("slo_throughput_ratio", "max_len_ratio", "slo_qps_relay", "slo_qps_baseline", "max_len_relay",
              "max_len_baseline", "resident_prefixes", "hbm_hit_rate", "hbm_pages"):
        if k in summary["result"]:
            v = summary["result"][k]
            flat.update({k: v["median"], f"{k}_min": v["min"], f"{k}_max": v["max"]})
    flat["seeds"] = len(seeds)
    if planned:
        b = summary["budget"]
        b["elapsed_s"] = round(elapsed() if elapsed else max(p["elapsed_s"] for p in planned), 1)
        plan = b["plan"]["values"]
        flat.update(budget_s=b["budget_s"], elapsed_s=b["elapsed_s"], requests=plan["requests"],
                    rel_tol=plan["rel_tol"], len_step=plan["len_step"], repeats=plan["repeats"])
    summary["result_line"] = rpt.result_line(flat)
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"seeds": seeds, "summary": summary}, f, indent=1, default=str)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(render(summary, seeds, setup))
    if summary.get("crossover"):
        plot_crossover(summary["crossover"], setup.get("workers", {}).get("K"), os.path.join(out, "crossover.png"))
    return summary


def read_seed_reports(out: str) -> dict:
    """The reports of the seed runs under ``out`` (``seed<N>/report.json``, as ``bench slo --seeds`` writes them,
    possibly from several calls: one seed each), as seed -> report.

    Raises
    ------
    ValueError
        No seed report under ``out``; a report without its run's settings (written before they were recorded); or
        runs whose settings differ other than in their seed (the keys that differ are named).
    """
    found = {}
    for name in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        path = os.path.join(out, name, "report.json")
        if name.startswith("seed") and name[4:].isdigit() and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found[int(name[4:])] = json.load(f)
    if not found:
        raise ValueError(f"out must hold seed runs (seed<N>/report.json, from bench slo --seeds), got none in {out!r}")
    bare = [s for s, r in found.items() if "settings" not in r]
    if bare:
        raise ValueError(f"the runs of seeds {bare} do not record their settings (written by an older version): "
                         "run them again")
    first, want = next(iter(found.items()))
    for s, r in found.items():
        differ = sorted(k for k in set(want["settings"]) | set(r["settings"])
                        if k != "seed" and want["settings"].get(k) != r["settings"].get(k))
        if differ:
            raise ValueError(f"seed runs must share their settings, but seed {s} differs from seed {first} in "
                             f"{', '.join(differ)}")
    return found


def main(argv: Optional[list[str]] = None) -> int:
    """``relaygr bench seeds OUT``: summarise the seed runs under OUT, run in one call or several."""
    from ..cli_args import ArgumentParser
    ap = ArgumentParser(prog="relaygr bench seeds",
                        description="Summarise the seed runs of bench slo under OUT (seed<N>/report.json; run in one "
                                    "call with --seeds 0,1,2, or seed by seed into the same OUT), as bench slo "
                                    "--seeds does at its end: OUT/summary.md, summary.json, the RESULT line.")
    ap.add_argument("out", metavar="OUT", help="the --out directory of the seed runs")
    args = ap.parse_args(argv)
    try:
        reports = read_seed_reports(args.out)
    except ValueError as e:
        ap.error(f"argument OUT: {e}")
    print_summary(write_summary(args.out, reports), args.out)
    return 0


def print_summary(summary: dict, out: Optional[str]) -> None:
    print(f"\nsummary: {os.path.join(out or '.', 'summary.md')}")
    print(summary["result_line"], flush=True)
