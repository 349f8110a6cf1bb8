"""``relaygr bench slo``: relay-race serving vs full inference under a P99 ranking SLO, on a real-log workload.

For each mode (``baseline``: full inference on the critical path, ``model.rank_uncached`` by default (the relay
engine's kernels without a cache) or ``model.rank_full`` with ``--baseline dense``; ``relay``: trigger + HBM prefix
cache (+ DRAM expander); ``relay_no_expander``) on the same request stream (:mod:`relaygr_engine.workload.build`),
served by one worker on a virtual clock with the real engine's compute (:mod:`relaygr_engine.bench.sim`):

1. **SLO-compliant throughput**: the highest QPS whose P99 ranking latency is within ``--slo-ms``
   (a geometric sweep, then bisection: :func:`relaygr_engine.bench.search.slo_throughput`); every evaluated QPS is
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

``--budget-s S`` plans the searches' settings so that the whole command ends within S seconds
(:mod:`relaygr_engine.bench.slo_budget`).

Writes ``report.md``, ``report.json``, ``latency_vs_qps.png`` and ``max_len.png`` to ``--out`` and ends with
``RESULT slo_throughput_ratio=... max_len_ratio=... p99_ms_relay=... p99_ms_baseline=...`` (relay / baseline,
measured in this run).

This module holds the command line (options, their checks, :func:`main`); the run itself is
:mod:`relaygr_engine.bench.slo_run`, its printed and written words :mod:`relaygr_engine.bench.slo_output`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ..cli_args import (COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_INT, ArgumentParser, ChoiceList,
                        add_model_arguments, device, existing_file, require_modules)
from ..config import KVDtype
from . import slo_setup, slo_workers
from .sim import BaselineImpl, Mode
from .slo_output import METHOD, Console, _wants_progress, print_paths, print_table  # noqa: F401 (re-exported)
from .slo_run import _cpu_timer_ok, load_log, run
from ..workload.logs import InteractionLog

__all__ = ["build_parser", "apply_settings", "check_args", "load_checked_log", "run", "run_checked", "main",
           "METHOD"]


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
    g.add_argument("--repeats", type=POSITIVE_INT,
                   help="runs of a point whose P99 lies within --noise-band of the SLO (the majority decides) "
                        "(default: 3)")
    g.add_argument("--noise-band", type=NON_NEGATIVE, default=0.25,
                   help="relative distance of P99 from the SLO within which a point is repeated")
    g.add_argument("--full-runs", action="store_true",
                   help="never stop a run early (by default a run stops once P99 > SLO is certain; its curve "
                        "point is then a lower bound)")
    g.add_argument("--no-max-len", action="store_true", help="skip the max-length search")
    g.add_argument("--budget-s", type=POSITIVE,
                   help="end the whole command (every seed, calibration, compilation and graph capture included) "
                        "within this many seconds of wall time: the options --requests, --warmup-requests, "
                        "--min-duration-s, --rel-tol, --len-step and --repeats not given are planned from the "
                        "calibration's measured costs (the finest settings from the full ones down to the quick "
                        "resolution with one run per point that fit), printed before serving and recorded in the "
                        "reports; a usage error where not even the quick resolution fits "
                        "(relaygr_engine.bench.slo_budget)")
    if quick:
        ap.set_defaults(quick=True)
        g.add_argument("--thorough", dest="quick", action="store_false",
                       help="the full benchmark settings instead of the quick ones (several times longer)")
    else:
        g.add_argument("--quick", action="store_true",
                       help="the quick settings (a few minutes) for every option above that is not given")
    g = ap.add_argument_group("output")
    g.add_argument("--out", default="reports/slo", help="report directory")
    g.add_argument("--resume", action="store_true",
                   help="continue a run of the same settings cut short in --out: its calibration and measured "
                        "points (points.jsonl, kept as each finishes) are taken back, only the others are served "
                        "(a usage error where the file's settings differ)")
    g.add_argument("--json", help="also write the report JSON here")
    g.add_argument("--no-plots", action="store_true", help="write the report without its plots (no matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def apply_settings(args) -> None:
    """Fill the options left unset: the quick or full settings, the warm-up (1 or 2 x --requests) and three
    repeats; with ``--budget-s`` those stay unset, listed in ``args.planned``: the run plans them."""
    from .slo_budget import planned_keys

    args.planned = planned_keys(args) if getattr(args, "budget_s", None) else []
    if not args.planned:
        settings = QUICK_SETTINGS if args.quick else FULL_SETTINGS
        for key, value in settings.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if args.warmup_requests is None:
            args.warmup_requests = (1 if args.quick else 2) * args.requests
        if args.repeats is None:
            args.repeats = 3
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
    if not args.no_max_len and args.len_step is not None and args.len_step > args.max_len_hi:
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
    _check_points(parser, args)


def _check_points(parser: argparse.ArgumentParser, args) -> None:
    """With ``--resume``, each run directory's kept points (:mod:`~relaygr_engine.bench.slo_points`: a run cut
    short resumes from them) must be a run's of the same settings: else a usage error naming the file, before any
    work."""
    if not args.resume:
        return
    from .seeds import seed_args
    from .slo_points import PointLog
    from .slo_run import _settings

    for a in seed_args(args) if args.seeds else [args]:
        try:
            PointLog(a.out, _settings(a, kept=True))
        except ValueError as e:
            parser.error(str(e))


def load_checked_log(parser: argparse.ArgumentParser, args) -> tuple[InteractionLog, str]:
    """:func:`load_log`, with an unreadable ``--data`` file or a log too short for ``--requests`` and
    ``--warmup-requests`` reported as usage errors naming those options."""
    try:
        log, source = load_log(args)
    except ValueError as e:
        parser.error(f"argument {'--data' if args.data else '--profile'}: {e}")
    usable = log.num_eligible()
    from .slo_budget import LADDER

    least = LADDER[-1].values()  # a budget plans what the log can serve, at least the last rung's
    requests = args.requests if args.requests is not None else least["requests"]
    warmup = args.warmup_requests if args.warmup_requests is not None else \
        least["warmup_requests"] * requests // least["requests"]
    if usable < requests + warmup:
        where = f"--data {args.data}" if args.data else "the workload profile"
        parser.error(f"{where} has {usable} events usable as requests (users' events after their first), but "
                     f"--requests {requests} + --warmup-requests {warmup} need {requests + warmup}: give smaller "
                     f"values")
    args.usable_events = usable
    return log, source


def prepare(parser: argparse.ArgumentParser, argv: Optional[list[str]]) -> tuple:
    """Parse ``argv`` and check everything a run needs before it starts: ``(args, log, source)`` for :func:`run`.

    Every mistake (an option's value, a combination of options, the ``--data`` file, a missing optional
    dependency) ends here as a one-line usage error (exit status 2)."""
    args = parser.parse_args(argv)
    check_args(parser, args)
    log, source = load_checked_log(parser, args)
    return args, log, source


def command_started() -> tuple[float, bool]:
    """When this command started (``time.monotonic()``) and whether it is a process of its own: as ``relaygr``
    recorded it (the process's start for a command line), else now (a call from Python)."""
    import time

    from .. import cli

    started, cli.CALL_STARTED = cli.CALL_STARTED, None
    return (time.monotonic(), False) if started is None else started


_EXIT_S = 2.0  # what a process that imported torch takes to exit (its teardown; 1-3 s on a loaded CPU)


def run_checked(parser: argparse.ArgumentParser, args, log, source, started: tuple[float, bool]):
    """:func:`run`, once per seed with ``--seeds``, sharing one :class:`~relaygr_engine.bench.slo_shared.Shared`;
    a budget too small is a usage error (exit status 2). Returns the report, or the seeds' summary."""
    from .slo_budget import BudgetTooSmall
    from .slo_shared import Shared

    shared = Shared(args, started[0], exit_s=_EXIT_S if started[1] else 0.0)
    os.makedirs(args.out, exist_ok=True)  # (from the start: RELAYGR_AUTOTUNE_FILE may name a file in it)
    try:
        if args.seeds:
            from . import seeds
            return seeds.run_seeds(args, lambda a: run(a, *load_checked_log(parser, a), shared=shared), shared)
        return run(args, log, source, shared=shared)
    except BudgetTooSmall as e:
        parser.error(str(e))


def main(argv: Optional[list[str]] = None) -> int:
    started = command_started()
    parser = build_parser()
    args, log, source = prepare(parser, argv)
    from .slo_budget import Deadline

    try:
        report = run_checked(parser, args, log, source, started)
    except Deadline as e:
        print(f"\nnot finished within --budget-s {args.budget_s:g}: {e} (the points measured are kept in "
              f"{args.out}: --resume continues)", flush=True)
        return 1
    if args.seeds:
        from . import seeds
        seeds.print_summary(report, args.out)
        return 0
    print()
    print(report["headline"])
    print()
    print_table(report)
    print_paths(report)
    print(report["result_line"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
