"""``relaygr demo``: the main job in a few minutes: relay-race serving vs full inference under a P99 SLO.

Runs :mod:`relaygr_engine.bench.slo` with its quick settings (``--thorough`` for the full ones) on a workload drawn
from the workload profile that ships with the package (fitted to the MovieLens ml-latest-small ratings log: events
per user, same-user gaps, item popularity, ratings), so it needs no data download; ``--data CSV`` uses a real
interaction log instead. Every latency comes from the real engine and model (a small HSTU ranker) on this machine.
Prints the comparison table, where the Markdown/JSON report and the plots are, and the ``RESULT`` line.
"""
from __future__ import annotations

import sys
from typing import Optional

from . import slo

__all__ = ["build_parser", "main"]


def build_parser():
    ap = slo.build_parser(prog="relaygr demo", description=__doc__.split("\n\n")[0], quick=True)
    ap.set_defaults(out="reports/demo")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    started = slo.command_started()
    parser = build_parser()
    args, log, source = slo.prepare(parser, argv)
    if args.data:
        print(f"relaygr demo: workload from the interaction log {args.data}")
    else:
        print("relaygr demo: workload drawn from the packaged profile fitted to the MovieLens ml-latest-small "
              "ratings log (no data needed; pass --data ratings.csv[.gz] to use a real log)")
    print(f"relaygr demo: one worker on a virtual clock, real engine calls on {args.device}; SLO P99 <= "
          f"{args.slo_ms:g} ms; modes {','.join(args.modes)} ({'quick' if args.quick else 'full'} settings)\n",
          flush=True)
    report = slo.run_checked(parser, args, log, source, started)
    if args.seeds:
        from . import seeds
        seeds.print_summary(report, args.out)
        return 0
    print()
    print(report["headline"])
    print()
    slo.print_table(report)
    slo.print_paths(report)
    print(report["result_line"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
