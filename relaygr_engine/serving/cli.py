"""``relaygr serve``: relay engines on Ray Serve replicas behind the affinity request router.

Starts a local Ray instance (loopback only, no dashboard) or joins a running cluster (``--address``), deploys
``--replicas`` replicas (or, with ``--prefill-replicas P --rank-replicas R``, a pre-infer pool of P replicas that
ship packed prefixes to a ranking pool of R: :mod:`relaygr_engine.serving.disaggregated`), prints the HTTP address
and blocks until Ctrl-C or SIGTERM (or ``--duration`` seconds).
Endpoints: ``POST {prefix}prefill``, ``POST {prefix}rank`` (JSON), ``GET {prefix}stats``; the route key goes in the
``x-session-id`` header (see docs/ray_serve.md). Needs ``pip install 'relaygr-engine[ray]'``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Optional

_DEVICES = ("cpu", "cuda")


def _json_arg(text: str):
    """A JSON object given inline or as a path to a .json file."""
    try:
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as f:
                value = json.load(f)
        else:
            value = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object or a path to one, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relaygr serve",
                                description="Relay engines on Ray Serve replicas behind the affinity request router.")
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=int, default=2, help="replicas, each with its own engine (2)")
    c.add_argument("--prefill-replicas", type=int, default=None,
                   help="disaggregated: a pre-infer pool of this many replicas that ship packed prefixes to a "
                        "ranking pool of --rank-replicas (default: co-located --replicas)")
    c.add_argument("--rank-replicas", type=int, default=None, help="disaggregated: ranking pool size (default 2)")
    c.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. 'auto' or 'HOST:6379'); default: start a local one on 127.0.0.1")
    c.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    c.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica (1)")
    c.add_argument("--host", default="127.0.0.1", help="HTTP host of Serve's proxy (127.0.0.1)")
    c.add_argument("--port", type=int, default=8000, help="HTTP port (8000)")
    c.add_argument("--route-prefix", default="/", help="HTTP route prefix of the app (/)")
    c.add_argument("--app-name", default="relaygr", help="Serve application name (relaygr)")
    c.add_argument("--duration", type=float, default=None, help="serve this many seconds, then stop (default: until "
                                                                  "Ctrl-C)")
    e = p.add_argument_group("engine (every replica)")
    e.add_argument("--device", default="cpu", choices=_DEVICES, help="cpu (default) or cuda (one GPU per replica)")
    e.add_argument("--model", type=_json_arg, default={},
                   help="GRModelConfig fields as JSON or a JSON file (default: GRModelConfig())")
    e.add_argument("--seed", type=int, default=0, help="build_ranker seed when no --state-dict is given (0)")
    e.add_argument("--state-dict", default=None, help="torch.save-d state_dict to load (a path every node reads)")
    e.add_argument("--num-pages", type=int, default=4096, help="cache pages per replica (4096)")
    e.add_argument("--page-size", type=int, default=16, help="tokens per page (16)")
    e.add_argument("--max-pinned-fraction", type=float, default=0.5, help="share of pages leases may pin (0.5)")
    e.add_argument("--lease-ttl-s", type=float, default=1.0, help="pre-infer lease: the relay window in s (1.0)")
    e.add_argument("--trigger", type=_json_arg, default=None,
                   help="TriggerConfig fields as JSON or a JSON file (default: no trigger, pre-infer what fits)")
    e.add_argument("--latency-profile", default=None, help="the trigger's profile (default: the shipped one)")
    e.add_argument("--max-pending-prefills", type=int, default=None,
                   help="pre-infers a replica holds at once; more are rejected and forwarded (default: no bound)")
    e.add_argument("--torch-threads", type=int, default=1, help="torch threads per replica (1)")
    r = p.add_argument_group("routing")
    r.add_argument("--load-factor", type=float, default=1.25, help="bounded-load factor, >= 1 (1.25)")
    r.add_argument("--stats-period-s", type=float, default=0.5, help="replica stats poll period (0.5)")
    r.add_argument("--max-ongoing-requests", type=int, default=32, help="requests a replica holds at once (32)")
    return p


def _spec(args):
    from ..config import CacheConfig
    from .ray_serve import ReplicaSpec

    cache = CacheConfig(device=args.device, page_size=args.page_size, num_pages=args.num_pages,
                        max_pinned_fraction=args.max_pinned_fraction, lease_ttl_s=args.lease_ttl_s)
    return ReplicaSpec(model=dict(args.model), seed=args.seed, state_dict_path=args.state_dict, cache=cache,
                       trigger=args.trigger, latency_profile=args.latency_profile, torch_threads=args.torch_threads,
                       max_pending_prefills=args.max_pending_prefills)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = _spec(args)
        if args.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
        if args.rank_replicas is not None and args.prefill_replicas is None:
            raise ValueError("--rank-replicas needs --prefill-replicas (the disaggregated mode)")
        if args.prefill_replicas is not None:
            args.rank_replicas = 2 if args.rank_replicas is None else args.rank_replicas
            if args.prefill_replicas < 1 or args.rank_replicas < 1:
                raise ValueError(f"--prefill-replicas and --rank-replicas must be >= 1, got {args.prefill_replicas} "
                                 f"and {args.rank_replicas}")
        if args.duration is not None and args.duration < 0:
            raise ValueError(f"--duration must be >= 0 seconds, got {args.duration}")
    except (ValueError, TypeError) as e:
        print(f"relaygr serve: {e}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        print("relaygr serve: Ray Serve is not installed; pip install 'relaygr-engine[ray]'", file=sys.stderr)
        return 2

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return _serve(args, spec, ray, serve)


def _stop_on_sigterm():
    """Make SIGTERM stop the server like Ctrl-C (so Ray and Serve shut down); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _serve(args, spec, ray, serve) -> int:
    from .ray_serve import run

    started_ray = False
    if ray.is_initialized():  # called from a driver that is already connected
        where = "the Ray instance this process is connected to"
    elif args.address is None:
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
        started_ray, where = True, "a local Ray instance (127.0.0.1)"
    else:
        ray.init(address=args.address)
        where = f"the Ray cluster at {args.address}"
    restore = _stop_on_sigterm()  # after ray.init, which installs its own SIGTERM handler
    try:
        common = dict(app_name=args.app_name, route_prefix=args.route_prefix, host=args.host, port=args.port,
                      num_cpus=args.replica_cpus, num_gpus=1.0 if args.device == "cuda" else 0.0,
                      load_factor=args.load_factor, stats_period_s=args.stats_period_s,
                      max_ongoing_requests=args.max_ongoing_requests)
        if args.prefill_replicas is None:
            run(spec, num_replicas=args.replicas, **common)
            shape = f"{args.replicas} replica(s)"
        else:
            from .disaggregated import run_disaggregated
            run_disaggregated(spec, prefill_replicas=args.prefill_replicas, rank_replicas=args.rank_replicas,
                              **common)
            shape = (f"{args.prefill_replicas} pre-infer + {args.rank_replicas} ranking replica(s) "
                     f"(disaggregated)")
        prefix = args.route_prefix.rstrip("/") + "/"
        url = f"http://{args.host}:{args.port}{prefix}"
        print(f"relaygr serve: {shape} of app {args.app_name!r} on {where}")
        print(f"HTTP {url}  (POST {prefix}prefill, POST {prefix}rank, GET {prefix}stats; route key in header "
              "x-session-id, e.g. '7;prefill' then the prefill reply's route_key)")
        if not started_ray:
            print("(a Serve instance already running on the cluster keeps its own HTTP host and port)")
        print("Ctrl-C (or SIGTERM) to stop" if args.duration is None else f"serving for {args.duration:g} s",
              flush=True)
        end = None if args.duration is None else time.monotonic() + args.duration
        while end is None or time.monotonic() < end:
            time.sleep(0.2 if end is None else max(0.0, min(0.2, end - time.monotonic())))
    except KeyboardInterrupt:
        print("relaygr serve: stopping", flush=True)
    finally:
        try:
            if started_ray:
                serve.shutdown()
                ray.shutdown()
            else:
                serve.delete(args.app_name)
        finally:
            restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
