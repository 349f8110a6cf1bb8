"""``relaygr bench slo``: relay-race serving vs full inference under a P99 ranking SLO, on a real-log workload.

For each mode (``baseline``: full inference on the critical path, ``model.rank_uncached`` by default (the relay
engine's kernels without a cache) or ``model.rank_full`` with ``--baseline dense``; ``relay``: trigger + HBM prefix
cache (+ DRAM expander); ``relay_no_expander``) on the same request stream (:mod:`relaygr_engine.bench.workload`),
served by one worker on a virtual clock with the real engine's compute (:mod:`relaygr_engine.bench.serving`):

1. **SLO-compliant throughput**: the highest QPS whose P99 ranking latency is within ``--slo-ms``
   (a geometric sweep, then bisection: :func:`relaygr_engine.bench.report.slo_throughput`); every evaluated QPS is
   a point of the latency-vs-QPS curve.
2. **Reference QPS** (``--ref-qps``, default half the baseline's SLO-compliant throughput): P50/P99, cache-tier hit
   rates and trigger decisions of every mode.
3. **Longest history within the SLO** at the reference QPS: each user's first served request carries exactly
   ``L`` history tokens (later ones append), searched over ``L`` in page multiples.

Defaults on the CPU: the ``small`` HSTU ranker (``--model``: 2 layers, hidden 64, 2 heads x 32, fp32), 64
candidates, SLO 100 ms, 50 ms retrieval-to-ranking delay, 8 tokens per real behavior with a 2048-token cap (the
baseline's longest histories take well over half the SLO on one CPU thread), warm-up of twice the measured requests,
thread CPU time as the service-time clock, marginal points repeated three times. On CUDA the workload reaches
production lengths and both sides run graphed and compiled (:mod:`relaygr_engine.bench.slo_setup`); NVIDIA's HSTU
shape over three seeds: ``relaygr bench slo --device cuda --model nvidia-hstu --seeds 0,1,2``.

Writes ``report.md``, ``report.json``, ``latency_vs_qps.png`` and ``max_len.png`` to ``--out`` and ends with
``RESULT slo_throughput_ratio=... max_len_ratio=... p99_ms_relay=... p99_ms_baseline=...`` (relay / baseline,
measured in this run).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys
import time
from typing import Optional

import numpy as np

from ..cli_args import (COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_INT, ArgumentParser, ChoiceList,
                        add_model_arguments, device, existing_file, require_modules)
from ..config import KVDtype
from . import report as rpt
from . import slo_setup, slo_workers
from .common import exceed_count
from .serving import BaselineImpl, Mode, cpu_timer, simulate
from .workload import (InteractionLog, Workload, WorkloadConfig, build_workload, load_profile, read_interactions,
                       synthesize_interactions)

__all__ = ["build_parser", "apply_settings", "check_args", "load_checked_log", "run", "main", "METHOD"]

_MAX_REQUESTS_FACTOR = 4  # the measured stream holds this many times --requests (for --min-duration-s)

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


# ----------------------------------------------------------------------------------------------- CLI
# The settings --quick changes (the demo's defaults); an option the user gives keeps the user's value.
FULL_SETTINGS = {"requests": 200, "min_duration_s": 4.0, "rel_tol": 0.08, "len_step": 32}
QUICK_SETTINGS = {"requests": 100, "min_duration_s": 1.5, "rel_tol": 0.15, "len_step": 128}


def build_parser(prog: str = "relaygr bench slo", description: Optional[str] = None,
                 quick: bool = False) -> argparse.ArgumentParser:
    """The options of the SLO benchmark; ``quick=True`` makes the quick settings the defaults (``relaygr demo``),
    with ``--thorough`` for the full ones instead of ``--quick``."""
    ap = ArgumentParser(prog=prog, description=description or __doc__.split("\n\n")[0])
    default, other = (QUICK_SETTINGS, FULL_SETTINGS) if quick else (FULL_SETTINGS, QUICK_SETTINGS)
    switch = "--thorough" if quick else "--quick"

    def preset(key: str) -> str:
        return f"(default: {default[key]:g}; {other[key]:g} with {switch})"

    g = ap.add_argument_group("workload")
    g.add_argument("--data", type=existing_file,
                   help="interaction CSV (.csv/.csv.gz: user_id,item_id,timestamp[,action|rating]); "
                        "default: a synthetic log from the packaged MovieLens-fitted profile")
    g.add_argument("--profile", type=existing_file,
                   help="workload profile JSON to synthesize from (default: the packaged one)")
    g.add_argument("--requests", type=POSITIVE_INT, help="measured ranking requests per run (at least) "
                                                         + preset("requests"))
    g.add_argument("--min-duration-s", type=NON_NEGATIVE,
                   help="a run's measured requests span at least this much virtual time (more requests at high "
                        "QPS, up to 4 x --requests), so a short burst cannot pass an overloaded QPS "
                        + preset("min_duration_s"))
    g.add_argument("--warmup-requests", type=COUNT,
                   help="requests served before the measured ones in every run (the log's preceding events), "
                        "not measured, so the caches are in their steady state (default: 2 x --requests, 1 x with "
                        "the quick settings; with 2 x the share of measured requests whose user has no earlier "
                        "request falls to ~15-20%%, near the ~6-8%% it converges to)")
    g.add_argument("--candidates", type=POSITIVE_INT,
                   help="candidates per ranking request " + slo_setup._help("candidates"))
    g.add_argument("--length-scale", type=POSITIVE,
                   help="history tokens per real behavior (real logs are short: MovieLens median 70) "
                        + slo_setup._help("length_scale"))
    g.add_argument("--max-history", type=POSITIVE_INT,
                   help="history cap in tokens (oldest dropped) of the throughput workload "
                        + slo_setup._help("max_history"))
    g.add_argument("--trim-tokens", type=POSITIVE_INT,
                   help="a history over the cap loses its oldest tokens in blocks of this many, so a user's "
                        "consecutive requests share their prefix (default: a quarter of the cap; 1: slide by one "
                        "behavior per request)")
    g.add_argument("--suffix-tokens", type=COUNT, default=16,
                   help="newest history tokens computed at ranking instead of pre-inferred")
    g.add_argument("--pipeline-delay-ms", type=NON_NEGATIVE, default=50.0, help="retrieval-to-ranking delay")
    g.add_argument("--num-items", type=POSITIVE_INT, default=8192,
                   help="model item vocabulary (ids remapped into it)")
    g.add_argument("--seed", type=COUNT, default=0)
    g.add_argument("--seeds", default=None,
                   help="comma-separated seeds: one whole run per seed (in --out/seedN), reported as the median "
                        "with min and max (relaygr_engine.bench.seeds)")
    g = ap.add_argument_group("serving")
    g.add_argument("--slo-ms", type=POSITIVE, default=100.0, help="P99 ranking latency objective")
    g.add_argument("--modes", type=ChoiceList(Mode), default=f"{Mode.BASELINE.value},{Mode.RELAY.value}",
                   metavar="MODE[,MODE...]",
                   help=f"comma-separated modes from {', '.join(m.value for m in Mode)} (baseline is always run)")
    g.add_argument("--hbm-mb", type=POSITIVE,
                   help="device KV cache budget (MiB) (default: 64 on the CPU; on CUDA 16 GiB, at most a fifth of "
                        "the device's memory)")
    g.add_argument("--kv-dtype", default="model", choices=[k.value for k in KVDtype],
                   help="how the relay's cache stores K/V: model (exact), int8 or fp8_e4m3 (8-bit values and a "
                        "scale per token and head: about twice the prefixes in --hbm-mb; scores close to, not equal "
                        "to, full inference)")
    g.add_argument("--dram-mb", type=NON_NEGATIVE,
                   help="DRAM expander budget of mode relay (MiB) (default: 256 on the CPU, --hbm-mb on CUDA)")
    g.add_argument("--lease-ms", type=POSITIVE, default=1000.0, help="pre-infer lease (relay window)")
    g.add_argument("--chunk-tokens", type=COUNT,
                   help="pre-infer chunk (0: whole prefix at once) " + slo_setup._help("chunk_tokens"))
    g.add_argument("--trigger-margin", type=NON_NEGATIVE, default=0.1,
                   help="pre-infer when predicted full inference > margin * SLO")
    g.add_argument("--no-trigger", action="store_true", help="pre-infer every request the cache can take")
    g.add_argument("--no-store-misses", action="store_true",
                   help="do not keep the history KV of relay rankings that found nothing cached "
                        "(RelayEngine(store_misses=False))")
    g.add_argument("--baseline", default="paged", choices=[b.value for b in BaselineImpl],
                   help="full inference of the baseline: 'paged' = the engine's attention op with no cache (the "
                        "same kernels as relay), 'dense' = model.rank_full (the dense oracle)")
    g.add_argument("--timer", default="auto", choices=["auto", "cpu", "wall"],
                   help="service-time clock of the virtual-clock worker: 'cpu' = the thread's CPU time (robust "
                        "to other processes on a shared machine; needs --device cpu --threads 1), 'wall' = "
                        "perf_counter; 'auto' = cpu where valid, else wall")
    g.add_argument("--device", type=device, default="cpu", help="torch device of the model and cache")
    g.add_argument("--threads", type=POSITIVE_INT, default=1, help="torch intra-op threads (one worker)")
    slo_workers.add_arguments(ap)
    slo_setup.add_arguments(ap)
    add_model_arguments(ap)
    g = ap.add_argument_group("search")
    g.add_argument("--qps-start", type=POSITIVE, help="first QPS of the sweep (default: from the calibration)")
    g.add_argument("--ref-qps", type=POSITIVE, help="QPS of the max-length search and the per-mode details "
                                                    "(default: half the baseline's SLO-compliant throughput)")
    g.add_argument("--rel-tol", type=POSITIVE, help="QPS bisection tolerance (relative) " + preset("rel_tol"))
    g.add_argument("--len-step", type=POSITIVE_INT,
                   help="history length resolution of the max-length search " + preset("len_step"))
    g.add_argument("--max-len-hi", type=POSITIVE_INT,
                   help="longest history the max-length search tries (the model's max_seq_len is the larger of "
                        "this and --max-history) " + slo_setup._help("max_len_hi"))
    g.add_argument("--repeats", type=POSITIVE_INT, default=3,
                   help="runs of a point whose P99 lies within --noise-band of the SLO (the majority decides)")
    g.add_argument("--noise-band", type=NON_NEGATIVE, default=0.25,
                   help="relative distance of P99 from the SLO within which a point is repeated")
    g.add_argument("--full-runs", action="store_true",
                   help="never stop a run early (by default a run stops once P99 > SLO is certain; its curve "
                        "point is then a lower bound)")
    g.add_argument("--no-max-len", action="store_true", help="skip the max-length search")
    if quick:
        ap.set_defaults(quick=True)
        g.add_argument("--thorough", dest="quick", action="store_false",
                       help="the full benchmark settings instead of the quick ones (several times longer)")
    else:
        g.add_argument("--quick", action="store_true",
                       help="the quick settings (a few minutes) for every option above that is not given")
    g = ap.add_argument_group("output")
    g.add_argument("--out", default="reports/slo", help="report directory")
    g.add_argument("--json", help="also write the report JSON here")
    g.add_argument("--no-plots", action="store_true", help="write the report without its plots (no matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def apply_settings(args) -> None:
    """Fill the options left unset: the quick or full settings, and the warm-up (1 or 2 x --requests)."""
    settings = QUICK_SETTINGS if args.quick else FULL_SETTINGS
    for key, value in settings.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup_requests is None:
        args.warmup_requests = (1 if args.quick else 2) * args.requests
    slo_setup.apply_defaults(args)


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """The checks that involve several options or the environment, as usage errors naming the options; then the
    optional dependencies this run needs. Called before any work."""
    apply_settings(args)
    if args.timer == "cpu" and not _cpu_timer_ok(args):
        parser.error(f"--timer cpu needs --device cpu and --threads 1 (the job's compute on this thread), got "
                     f"--device {args.device} --threads {args.threads}")
    slo_setup.check(parser, args)
    if args.candidates > args.num_items:
        parser.error(f"--candidates ({args.candidates}) must be <= --num-items ({args.num_items})")
    if not args.no_max_len and args.len_step > args.max_len_hi:
        parser.error(f"--len-step ({args.len_step}) must be <= --max-len-hi ({args.max_len_hi}), or pass "
                     "--no-max-len")
    if args.data and args.profile:
        parser.error("--data and --profile both name a workload; give one")
    try:
        slo_workers.check(args)
        if args.seeds:
            from .seeds import parse_seeds
            parse_seeds(args.seeds)
    except ValueError as e:
        parser.error(str(e))
    args.modes = [Mode.BASELINE.value] + [m for m in args.modes if m != Mode.BASELINE.value]
    if len(args.modes) < 2:
        parser.error(f"--modes needs a relay mode to compare with the baseline, got {','.join(args.modes)}")
    if not args.no_plots:
        require_modules(parser, ["matplotlib"], "bench", "drawing the report's plots (--no-plots skips them)")
    if _wants_progress(args):
        require_modules(parser, ["tqdm"], "bench", "the progress bar (--no-progress skips it)")


def load_checked_log(parser: argparse.ArgumentParser, args) -> tuple[InteractionLog, str]:
    """:func:`load_log`, with an unreadable ``--data`` file or a log too short for ``--requests`` and
    ``--warmup-requests`` reported as usage errors naming those options."""
    try:
        log, source = load_log(args)
    except ValueError as e:
        parser.error(f"argument {'--data' if args.data else '--profile'}: {e}")
    usable = log.num_eligible()
    if usable < args.requests + args.warmup_requests:
        where = f"--data {args.data}" if args.data else "the workload profile"
        parser.error(f"{where} has {usable} events usable as requests (users' events after their first), but "
                     f"--requests {args.requests} + --warmup-requests {args.warmup_requests} need "
                     f"{args.requests + args.warmup_requests}: give smaller values")
    return log, source


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


def calibrate_latency(model, num_candidates: int, max_len: int, device: str, repeats: int = 3,
                      impl: str = "paged", timer=time.perf_counter):
    """Fit the trigger's latency model on the baseline's full inference of this model (a few seconds).

    ``impl`` is the baseline's implementation (:class:`~relaygr_engine.bench.serving.BaselineImpl`), so the
    trigger predicts what a ranking without a cache would cost here; ``timer`` is the benchmark's service-time clock.
    """
    import torch

    from ..models import Behaviors
    from ..policy import calibrate

    cfg = model.config
    g = torch.Generator().manual_seed(0)
    rank = model.rank_uncached if BaselineImpl(impl) is BaselineImpl.PAGED else model.rank_full

    def fn(L: int, C: int) -> None:
        L = max(L, 1)
        h = Behaviors(torch.randint(0, cfg.num_items, (L,), generator=g).to(device),
                      torch.randint(0, cfg.num_actions, (L,), generator=g).to(device),
                      torch.arange(L, dtype=torch.long).to(device) * 60)
        rank(h, torch.randint(0, cfg.num_items, (C,), generator=g).to(device))

    grid = (32, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
    grid += tuple(4096 << k for k in range(1, max(0, (max_len - 1) // 4096).bit_length() + 1))  # production lengths
    lengths = sorted({min(max_len, x) for x in grid})
    return calibrate(fn, lengths, [num_candidates], repeats, warmup=1, quantile=0.75, timer=timer, device=device,
                     meta={"model": "benchmark model", "candidates": num_candidates, "baseline": impl})


def _cpu_timer_ok(args) -> bool:
    """Whether the thread's CPU time is a job's service time: the compute runs on this thread."""
    return str(args.device).startswith("cpu") and args.threads == 1


def _timer(args):
    """The service-time clock ``--timer`` names (``auto``: thread CPU time on one CPU thread, else wall)."""
    cpu_ok = _cpu_timer_ok(args)
    assert args.timer != "cpu" or cpu_ok, "check_args refuses --timer cpu here"
    if args.timer == "cpu" or (args.timer == "auto" and cpu_ok):
        return cpu_timer, "thread CPU time"
    return time.perf_counter, "wall time (perf_counter)"


class _Bench:
    """Everything one benchmark run shares: model, latency model, workloads, options, progress bar."""

    def __init__(self, args, log: InteractionLog, model, latency_model, console: "Console",
                 timer=time.perf_counter) -> None:
        self.args, self.log, self.model, self.lat, self.console = args, log, model, latency_model, console
        self.timer = timer
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


def prepare(parser: argparse.ArgumentParser, argv: Optional[list[str]]) -> tuple:
    """Parse ``argv`` and check everything a run needs before it starts: ``(args, log, source)`` for :func:`run`.

    Every mistake (an option's value, a combination of options, the ``--data`` file, a missing optional
    dependency) ends here as a one-line usage error (exit status 2)."""
    args = parser.parse_args(argv)
    check_args(parser, args)
    log, source = load_checked_log(parser, args)
    return args, log, source


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
    lat = calibrate_latency(model, args.candidates, max(args.max_history, args.max_len_hi), args.device,
                            repeats=5, impl=args.baseline, timer=timer)
    base_max = lat.max_history_len(args.slo_ms, args.candidates)
    out.say(f"service times: {timer_name}; baseline full inference: {args.baseline} "
         f"({'model.rank_uncached' if args.baseline == 'paged' else 'model.rank_full'})")
    out.say(f"calibrated full inference on this model in {time.perf_counter() - t0:.1f}s: "
         + ", ".join(f"{lat.predict_ms(L, args.candidates):.1f} ms @{L}" for L in (256, 1024, 2048))
         + f" tokens; longest history within {args.slo_ms:g} ms unloaded ~{base_max}")

    bench = _Bench(args, log, model, lat, out, timer)
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
            ok, s = bench.judge(m, q)
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
        s = bench.run(m, ref_qps, label=f"{ref_qps:.3g} QPS (reference)")
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
                ok, s = bench.judge(m, ref_qps, base_length=L, label=f"L={L}")
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


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, log, source = prepare(parser, argv)
    if args.seeds:
        from . import seeds
        seeds.print_summary(seeds.run_seeds(args, lambda a: run(a, *load_checked_log(parser, a))), args.out)
        return 0
    report = run(args, log, source)
    print()
    print(report["headline"])
    print()
    print_table(report)
    print_paths(report)
    print(report["result_line"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
