"""What ``relaygr bench slo`` prints and writes beside its measurements: the report's method section, the lines
and verdicts of the search, the headline and notes, the progress console and the final table."""
from __future__ import annotations

import json
import sys
from typing import Optional

from . import report as rpt
from . import slo_setup

METHOD = """\
**Workload.** Every interaction event of the log becomes one ranking request of its user: the history is the
user's earlier behaviors (oldest first), the candidates are the event's own item plus popularity-sampled items, and
a pre-infer signal precedes the ranking request by the retrieval-to-ranking delay. Each user's timeline is
compressed on its own (gap ``g -> floor + g*cap/(g+cap)``, 1 s floor and 30 min cap by default: strictly
increasing, so the order of a user's re-request gaps is kept), users are aligned so that many are active at once,
each at a random point of its history, and the served window is rescaled linearly to the target QPS (the same
stream at every QPS). The measured requests are preceded by warm-up requests (the log's preceding events), served
the same way but not measured, so the measured requests meet caches and queues in their steady state. Item ids are
remapped by frequency rank (overflow hashed); ``length_scale`` expands every real behavior into that many tokens
(the behavior plus synthetic companions) because real logs' histories are short while the engine targets long
sequences; a history over the cap loses its oldest tokens in blocks (``trim_tokens``), as a production long-term
sequence is truncated now and then rather than shifted by every new behavior.

**Serving.** One worker (one engine, one device) serves two queues: ranking (priority) and pre-infer
(deferrable). Nothing sleeps: a virtual clock advances by the measured duration of each real engine call (the
baseline's full inference, the relay engine's `prefill_prefix` / `rank_with_prefix`, with `now=` the virtual time
so leases expire on the same clock). When the worker is free it takes the oldest ranking request, else the oldest
pre-infer whose ranking has not arrived yet (those whose ranking already arrived are dropped and counted: the
ranking uses what the cache holds or recomputes). Jobs are not preempted; a pre-infer runs as chunks of at most
``chunk_tokens`` tokens (each extending the entry the previous chunk cached), so a ranking waits for one chunk at
most. A ranking's latency is its completion time minus its arrival time, queueing included. The relay trigger
(`SequenceAwareTrigger`, latency model calibrated at start-up on this model's baseline full inference) pre-infers
only requests whose full inference is predicted to put the SLO at risk, within its footprint bound. The baseline's
full inference is `model.rank_uncached` by default: the same attention kernels as the relay engine with no cached
prefix, so the two modes differ only by the cache (`--baseline dense` uses the dense oracle `model.rank_full`,
several times slower on long histories).

**Timing.** A job's duration is the CPU time of the worker thread (`--timer cpu`, the default on one CPU thread):
it leaves out time the operating system gives to other processes on a shared machine. It does not remove every
interference (caches, memory bandwidth and sibling hyper-threads are shared: the same call can take up to twice
as long under load), so the search repeats the points where noise can decide: a point whose P99 lies within
``noise_band`` of the SLO is run ``repeats`` times and the majority decides.

**Statistics.** P50/P99 are percentiles over the measured requests of a run, interpolated linearly between the
closest ranks (numpy's default; the definition every benchmark of the package uses). The SLO-compliant
throughput is the highest QPS whose P99 <= SLO, found by a geometric sweep then bisection (each result is a
passing QPS with a failing QPS just above it); the longest history is searched the same way over page-aligned
lengths. The modes' searches run in lockstep (one evaluation of each mode in turn), so slow drift of a shared
machine affects every mode alike. A run stops as soon as P99 > SLO is certain (enough requests over the SLO); its
P99 is then a lower bound, marked as such. Every number in one report comes from one run of the benchmark."""

def _prefill_line(s: dict) -> str:
    """One line on a relay run's pre-inferences: what ran, what was in time, what the rankings found."""
    pf, es = s["prefill"], s["engine_stats"]
    refused = ", ".join(f"{k} {v}" for k, v in sorted(pf.get("refused", {}).items())) or "none"
    return (f"pre-infers: {pf['signals']} signals, {pf['started']} started, {pf['admitted']} done before their "
            f"ranking, {pf['cut_short']} cut short, {pf['dropped_stale']} dropped (ranking came first), refused: "
            f"{refused}; {pf['service_s'] * 1e3 / max(1, s['completed']):.1f} ms/request; "
            f"prefix copies {es.get('prefill_copies', 0)}, stale tickets {es.get('stale_tickets', 0)}, "
            f"cached tokens/ranking {es.get('cached_tokens', 0) / max(1, es.get('rank_requests', 1)):.0f}")


def _fmt_load(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _verdict(s: dict, slo_ms: float, ok: Optional[bool] = None) -> str:
    runs = s.get("p99_runs_ms", [])
    votes = (f" ({s['passed_runs']}/{len(runs)} runs pass: p99 " + ", ".join(f"{v:.0f}" for v in runs) + " ms)"
             if len(runs) > 1 else "")
    if ok is None:
        ok = s["p99_ms"] <= slo_ms and not s["stopped_early"]
    if s["stopped_early"] and not votes:
        return f"over SLO (stopped after {s['completed']}/{s['num_requests']} requests)"
    return ("ok" if ok else "over SLO") + votes


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

def _notes(args, results, relay_mode) -> list[str]:
    notes = slo_setup.fairness_notes(results)
    if "relay" in results:
        dram = results["relay"]["at_ref"]["engine_stats"].get("dram_hits", 0)
        if dram == 0:
            notes.append("No ranking read the DRAM tier (dram_hits = 0) in mode relay at the reference QPS.")
    for m, r in results.items():
        for key in ("slo_throughput", "max_len"):
            if key in r and r[key]["status"] != "ok":
                notes.append(f"{m}: {key} search status '{r[key]['status']}' (see the search ranges).")
    return notes


def budget_markdown(budget: dict) -> str:
    """The report's budget section: the plan, each phase's prediction, share and time spent, the searches'
    statuses, and what this seed paid itself beside what the command paid once."""
    from .slo_budget import Plan

    plan = Plan.from_dict(budget["plan"])
    rows = [[name, p.get("predicted_s"), p.get("deadline_s"), round(p["spent_s"], 2) if "spent_s" in p else "-"]
            for name, p in budget["phases"].items()]
    statuses = "; ".join(f"{m}: " + ", ".join(f"{k} {v}" for k, v in st.items() if v)
                         for m, st in budget["statuses"].items())
    share = budget.get("sharing", {})
    return "\n".join([
        plan.markdown(), "",
        f"The command had used {budget['elapsed_s']:.1f} s of its {budget['budget_s']:g} s when this report was "
        f"written. Each phase's share of the time left (its deadline, from its start) follows the predictions; a "
        f"search starts no evaluation past it (status `deadline`).", "",
        rpt._table(["phase", "predicted s", "deadline s", "spent s"], rows), "",
        f"Search statuses: {statuses}. Cost model: {json.dumps(budget.get('cost_model', {}))}. Calibration: "
        f"{json.dumps(budget.get('calibration', {}))}.", "",
        f"Paid once for the command: {json.dumps(share.get('paid_once', {}))}. Paid by this seed itself: "
        f"{json.dumps(share.get('paid_by_this_seed', {}))}.", ""])


def _wants_progress(args) -> bool:
    """A progress bar is drawn on a terminal unless ``--no-progress``."""
    return not args.no_progress and sys.stderr.isatty()


class Console:
    """The benchmark's output: lines on stdout and, on a terminal, a progress bar on stderr for the current run.

    Lines go through the bar's own ``write`` while a bar is shown, so a line never lands on the bar's row.
    """

    def __init__(self, show_bar: bool) -> None:
        self.show_bar = show_bar
        self.bar = None

    def say(self, msg: str) -> None:
        """Print one line on stdout (above the bar)."""
        if self.bar is None:
            print(msg, flush=True)
        else:
            self.bar.write(msg, file=sys.stdout)
            sys.stdout.flush()

    def start(self, what: str, total: int) -> None:
        """Show the bar for a run of ``total`` requests labelled ``what``."""
        if self.bar is None and self.show_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=what, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)
        elif self.bar is not None:
            self.bar.reset(total=total)
            self.bar.set_description(what, refresh=True)

    def close(self) -> None:
        """Remove the bar; later lines print plainly."""
        if self.bar is not None:
            self.bar.close()
        self.bar, self.show_bar = None, False


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


def print_paths(report: dict) -> None:
    """Where the report, its JSON and its plots were written, and how long the run took."""
    p = report["paths"]
    plots = ", ".join(p[k] for k in ("latency_plot", "max_len_plot") if k in p) or "none (--no-plots)"
    print(f"\nreport:  {p['markdown']}\njson:    {p['json']}\nplots:   {plots}\nelapsed: {report['elapsed_s']:.0f}s")
