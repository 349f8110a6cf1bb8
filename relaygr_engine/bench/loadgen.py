"""``relaygr bench loadgen``: the SLO benchmark under MLPerf LoadGen, in real time, in process and over HTTP.

``relaygr bench slo`` serves its stream on a virtual clock. This command serves the same workload (same data,
model, candidates, pipeline delay, SLO: ``bench slo``'s options, parsed and checked by it) on the wall clock, driven
by MLPerf's load generator (``pip install 'relaygr-engine[loadgen]'``: ``mlperf_loadgen``) in its Server scenario
(Poisson arrivals at a target QPS, performance only). A LoadGen query is a user's request arriving at retrieval:
in a relay mode its pre-infer signal is issued then and its ranking request ``--pipeline-delay-ms`` later; the
baseline ranks by full inference after the same delay. The query completes when its ranking does, so LoadGen's
latency bound is **SLO + pipeline delay** at the 99th percentile (its ``Performance constraints satisfied``).

Targets: in this process (:mod:`~relaygr_engine.bench.loadgen_server`: one worker thread with the virtual clock's
policy) and, with ``--url``, a running ``relaygr serve`` over HTTP (:mod:`~relaygr_engine.bench.loadgen_http`:
the deployed path, the Serve proxy's affinity router and forwarding included; ``--serve-command`` prints the
server command matching these settings). For each target and mode: the SLO-compliant throughput (``bench slo``'s
search, one LoadGen run per QPS) or one ``--target-qps``; the P99 of every mode at the reference QPS; with
``--url``, the rankings' P50 at ``--low-qps`` in both targets (the serving path's own cost per request). Beside it,
``bench slo``'s virtual-clock search at the same settings (run here into ``--out``/vclock, or read from
``--slo-report``).

Writes ``report.md`` and ``report.json`` to ``--out``, LoadGen's ``mlperf_log_summary.txt`` and
``mlperf_log_detail.txt`` of every run under ``--out``/loadgen/TARGET/, and ends with ``RESULT
loadgen_slo_throughput_ratio=... vclock_slo_throughput_ratio=... ...``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
from typing import Optional

from ..cli_args import COUNT, POSITIVE, POSITIVE_INT, existing_file, require_modules
from . import slo
from .loadgen_sut import Order

__all__ = ["build_parser", "check_args", "serve_command", "main"]


def build_parser() -> argparse.ArgumentParser:
    """``bench slo``'s options and this command's own (group ``loadgen``)."""
    ap = slo.build_parser(prog="relaygr bench loadgen", description=__doc__.split("\n\n")[0])
    ap.set_defaults(out="reports/loadgen")
    g = ap.add_argument_group("loadgen")
    g.add_argument("--target-qps", type=POSITIVE,
                   help="one LoadGen run per mode at this QPS instead of the SLO-compliant throughput search")
    g.add_argument("--max-run-s", type=POSITIVE, default=300.0,
                   help="longest LoadGen run of the search: it tries no QPS below --requests / --max-run-s")
    g.add_argument("--order", default=Order.STREAM.value, choices=[o.value for o in Order],
                   help="which request a query serves: 'stream' = the k-th query issued serves the stream's k-th "
                        "request (a user's requests keep their order), 'loadgen' = LoadGen's sample index picks it")
    g.add_argument("--latency-profile", type=existing_file,
                   help="the trigger's latency model (a JSON of LatencyModel.save, e.g. written by an earlier run "
                        "into --out) instead of calibrating here; give the server the same one")
    g.add_argument("--url", help="also measure a running 'relaygr serve' at this URL over HTTP (modes baseline and "
                                 "relay; see --serve-command)")
    g.add_argument("--no-in-process", action="store_true", help="with --url: only the HTTP target")
    g.add_argument("--low-qps", type=POSITIVE, default=5.0,
                   help="with --url and the in-process target: QPS at which both targets' relay ranking P50 give the "
                        "serving path's own cost")
    g.add_argument("--http-threads", type=POSITIVE_INT, default=64,
                   help="client threads of the HTTP target (each query holds one until its ranking's reply)")
    g.add_argument("--check-every", type=COUNT, default=10,
                   help="over HTTP, compare the scores of every this many-th query with full inference (0: none)")
    g.add_argument("--http-encoding", default="b64le", choices=["b64le", "json"],
                   help="id lists and scores over HTTP: base64 little-endian arrays, or JSON lists")
    g.add_argument("--no-by-difference", action="store_true",
                   help="over HTTP, send every ranking's whole history (not only what follows its ticket's prefix)")
    g.add_argument("--inline-max-bytes", type=COUNT, default=8192,
                   help="over HTTP, requests up to this size travel in the x-relaygr-body header (0: never)")
    g.add_argument("--slo-report", type=existing_file,
                   help="a bench slo report.json at these settings: its ratio is the virtual clock's (not run here)")
    g.add_argument("--no-vclock", action="store_true", help="no virtual-clock comparison")
    g.add_argument("--serve-command", action="store_true",
                   help="write the trigger's latency model into --out, print the 'relaygr serve' command that "
                        "serves these settings, and exit")
    return ap


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """``bench slo``'s checks, then this command's (one worker, the modes HTTP serves, what the server supports),
    and ``mlperf_loadgen`` installed. Called before any work."""
    slo.check_args(parser, args)
    if args.workers != 1 or args.disaggregate:
        parser.error(f"bench loadgen serves with one worker: expected --workers 1 and no --disaggregate, got "
                     f"--workers {args.workers} --disaggregate {args.disaggregate or '-'}")
    if args.seeds:
        parser.error(f"bench loadgen runs one seed: give --seed, got --seeds {args.seeds}")
    if args.resume:
        parser.error("--resume is bench slo's (its points file); bench loadgen reruns its points")
    if args.no_in_process and not args.url:
        parser.error("--no-in-process needs --url (a target to measure)")
    if args.slo_report and args.no_vclock:
        parser.error("--slo-report and --no-vclock both say where the virtual clock's result comes from; give one")
    if args.url or args.serve_command:
        if args.kv_dtype != "model" or args.baseline != "paged" or args.max_batch != 1 or args.cuda_graphs \
                or args.compile:
            parser.error(f"the HTTP target serves --kv-dtype model, --baseline paged, --max-batch 1, no CUDA graphs "
                         f"or compilation, got --kv-dtype {args.kv_dtype} --baseline {args.baseline} --max-batch "
                         f"{args.max_batch}{' --cuda-graphs' if args.cuda_graphs else ''}"
                         f"{' --compile' if args.compile else ''}")
    if args.url:
        from ..serving.http_client import RelayHTTPClient
        try:
            RelayHTTPClient(args.url)
        except ValueError as e:
            parser.error(f"argument --url: {e}")
    if not args.serve_command:
        require_modules(parser, ["mlperf_loadgen"], "loadgen", "bench loadgen")


def serve_command(args, model, profile_path: str) -> list[str]:
    """The ``relaygr serve`` arguments whose replica serves what the in-process relay does: the same model (config
    and seed), page size, HBM pages, DRAM tier, lease, stored misses, pre-infer chunks, trigger and latency
    model, one replica."""
    cfg = model.config
    fields = {k: getattr(cfg, k) for k in ("num_layers", "hidden_dim", "num_heads", "head_dim", "num_items",
                                           "num_actions", "max_seq_len", "num_tasks")}
    fields["attention"] = cfg.attention.value
    pages = int(args.hbm_mb * 2**20) // (args.page_size * args.shape.kv_bytes_per_token)
    cmd = ["relaygr", "serve", "--replicas", "1", "--model", json.dumps(fields, separators=(",", ":")),
           "--seed", str(args.seed), "--device", "cpu" if args.device == "cpu" else "cuda",
           "--torch-threads", str(args.threads), "--page-size", str(args.page_size), "--num-pages", str(pages),
           "--dram-mb", f"{args.dram_mb:g}", "--lease-ttl-s", f"{args.lease_ms / 1e3:g}", "--slo-ms",
           f"{args.slo_ms:g}", "--prefill-chunk-tokens", str(args.chunk_tokens)]
    if not args.no_store_misses:
        cmd.append("--store-misses")
    if not args.no_trigger:
        trig = {"slo_ms": args.slo_ms, "margin": args.trigger_margin, "expected_candidates": args.candidates}
        cmd += ["--trigger", json.dumps(trig, separators=(",", ":")),
                "--latency-profile", os.path.abspath(profile_path)]
    return cmd


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    log, source = slo.load_checked_log(parser, args)
    from . import loadgen_report

    if args.serve_command:
        lat_path, model, _ = loadgen_report.calibration(args, log)
        print(shlex.join(serve_command(args, model, lat_path)))
        return 0
    vclock = None
    if args.slo_report:
        with open(args.slo_report, encoding="utf-8") as f:
            vclock = json.load(f)
    elif not args.no_vclock:
        from .slo_run import run as run_slo

        vargs = copy.copy(args)
        vargs.out, vargs.json, vargs.no_max_len = os.path.join(args.out, "vclock"), None, True
        print("virtual clock (bench slo, SLO-compliant throughput search) into", vargs.out, flush=True)
        vclock = run_slo(vargs, log, source)
        print(vclock["result_line"].replace("RESULT ", "vclock: "), flush=True)
    report = loadgen_report.run(args, log, source, vclock)
    print()
    print(report["headline"])
    print(f"report: {report['paths']['markdown']}")
    print(report["result_line"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
