"""``relaygr serve``: relay engines on Ray Serve replicas behind the affinity request router.

Starts a local Ray instance (loopback only, no dashboard) or joins a running cluster (``--address``), deploys
``--replicas`` replicas (or, with ``--prefill-replicas P --rank-replicas R``, a pre-infer pool of P replicas that
ship packed prefixes to a ranking pool of R: :mod:`relaygr_engine.serving.disaggregated`), prints the HTTP address
and where Prometheus scrapes the replicas' metrics (each Ray node's metrics export port,
:mod:`relaygr_engine.serving.metrics`), and blocks until Ctrl-C or SIGTERM (or ``--duration`` seconds).
Endpoints: ``POST {prefix}prefill``, ``POST {prefix}rank`` (JSON), ``GET {prefix}stats``; the route key goes in the
``x-session-id`` header (see docs/ray_serve.md). Needs ``pip install 'relaygr-engine[ray]'``.

Local mode listens on loopback only: Ray's node IP is 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set
before Ray is imported, so that Ray does not replace 127.0.0.1 by the machine's address; then its GCS, raylet, agents
and workers bind 127.0.0.1), no dashboard, and Serve's HTTP proxy on ``--host`` (127.0.0.1). Serving other machines
is explicit: ``--address`` joins a cluster started with ``ray start``, ``--host 0.0.0.0`` opens the HTTP port.
A local Ray also starts its workers (the replicas and Serve's proxy) at normal priority (``RAY_worker_niceness=0``
unless set; Ray's own default, nice 15, lets any other process on the machine, a load generator included, take the
CPU from the serving path).

A ``--port`` (or ``--metrics-port``) that cannot be listened on is a usage error before a local Ray starts; if the
port is taken between that check and Serve's proxy binding it, the proxy's failure ends as the same one-line error
(exit status 2) after Ray has shut down.
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Optional

from ..cli_args import (COUNT, NON_NEGATIVE, POSITIVE, POSITIVE_INT, ArgumentParser, Number, in_flags, json_object,
                        require_modules)

_DEVICES = ("cpu", "cuda")
_LOCAL_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a local Ray keeps 127.0.0.1 as its node IP
_NICENESS_ENV = "RAY_worker_niceness"  # a local Ray starts its workers (replicas, proxy) at this nice value
_LOOPBACK = "127.0.0.1"
_BIND_FAILURE = re.compile(r"Failed to bind to address '([^']*)'")  # Serve's proxy (ray.serve._private.http_util)


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [1, 65535], got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="relaygr serve", formatter_class=argparse.HelpFormatter,
                       description="Relay engines on Ray Serve replicas behind the affinity request router.")
    c = p.add_argument_group("cluster")
    c.add_argument("--replicas", type=POSITIVE_INT, default=2, help="replicas, each with its own engine (2)")
    c.add_argument("--prefill-replicas", type=POSITIVE_INT, default=None,
                   help="disaggregated: a pre-infer pool of this many replicas that ship packed prefixes to a "
                        "ranking pool of --rank-replicas (default: co-located --replicas)")
    c.add_argument("--rank-replicas", type=POSITIVE_INT, default=None,
                   help="disaggregated: ranking pool size (default 2)")
    c.add_argument("--ratio-control", type=json_object, nargs="?", const={}, default=None,
                   help="disaggregated: move replicas between the pools online from live SLO attainment, queueing and "
                        "late prefixes (Serve's autoscaling with relaygr_engine.serving.ratio_policy); optional JSON "
                        "of PoolRatioPolicy keywords, e.g. '{\"window_s\": 10}' (deployed from a Serve config)")
    c.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. 'auto' or 'HOST:6379'); default: start a local one on 127.0.0.1")
    c.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    c.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica (1)")
    c.add_argument("--host", default="127.0.0.1", help="HTTP host of Serve's proxy (127.0.0.1)")
    c.add_argument("--port", type=_port, default=8000, help="HTTP port (8000)")
    c.add_argument("--route-prefix", default="/", help="HTTP route prefix of the app (/)")
    c.add_argument("--app-name", default="relaygr", help="Serve application name (relaygr)")
    c.add_argument("--metrics-port", type=_port, default=None,
                   help="Prometheus metrics export port of the local Ray instance (default: one Ray picks; "
                        "printed at start)")
    c.add_argument("--duration", type=NON_NEGATIVE, default=None,
                   help="serve this many seconds, then stop (default: until Ctrl-C)")
    e = p.add_argument_group("engine (every replica)")
    e.add_argument("--device", default="cpu", choices=_DEVICES, help="cpu (default) or cuda (one GPU per replica)")
    e.add_argument("--model", type=json_object, default={},
                   help="GRModelConfig fields as JSON or a JSON file (default: GRModelConfig())")
    e.add_argument("--seed", type=COUNT, default=0, help="build_ranker seed when no --state-dict is given (0)")
    e.add_argument("--state-dict", default=None, help="torch.save-d state_dict to load (a path every node reads)")
    e.add_argument("--num-pages", type=POSITIVE_INT, default=4096, help="cache pages per replica (4096)")
    e.add_argument("--page-size", type=POSITIVE_INT, default=16, help="tokens per page (16)")
    e.add_argument("--max-pinned-fraction", type=float, default=0.5, help="share of pages leases may pin (0.5)")
    e.add_argument("--lease-ttl-s", type=POSITIVE, default=1.0, help="pre-infer lease: the relay window in s (1.0)")
    e.add_argument("--dram-mb", type=NON_NEGATIVE, default=0.0,
                   help="host DRAM tier per replica in MiB: evicted prefixes are kept there (0: none)")
    e.add_argument("--store-misses", action="store_true",
                   help="keep the history K/V of rankings that found nothing cached")
    e.add_argument("--prefill-chunk-tokens", type=COUNT, default=0,
                   help="pre-infer in chunks of at most this many new tokens, rankings going between chunks (0: "
                        "one call)")
    e.add_argument("--max-kept-prefixes", type=COUNT, default=4096,
                   help="prefixes of leased tickets kept per replica for rankings sent by difference (4096; 0: "
                        "none, such rankings are answered 409 and resent whole)")
    e.add_argument("--trigger", type=json_object, default=None,
                   help="TriggerConfig fields as JSON or a JSON file (default: no trigger, pre-infer what fits)")
    e.add_argument("--latency-profile", default=None, help="the trigger's profile (default: the shipped one)")
    e.add_argument("--max-pending-prefills", type=POSITIVE_INT, default=None,
                   help="pre-infers a replica holds at once; more are rejected and forwarded (default: no bound)")
    e.add_argument("--slo-ms", type=POSITIVE, default=100.0,
                   help="ranking latency objective each replica measures its rankings against (100)")
    e.add_argument("--torch-threads", type=POSITIVE_INT, default=1, help="torch threads per replica (1)")
    lim = p.add_argument_group("request limits (checked before a request is parsed into tensors)")
    lim.add_argument("--max-body-bytes", type=POSITIVE_INT, default=1 << 20, help="HTTP body bytes; past it 413 (1 MiB)")
    lim.add_argument("--max-json-depth", type=POSITIVE_INT, default=8,
                     help="nested JSON arrays and objects, <= 256 (8)")
    lim.add_argument("--max-candidates", type=POSITIVE_INT, default=4096, help="candidates per ranking (4096)")
    lim.add_argument("--max-history", type=POSITIVE_INT, default=None,
                     help="entries per history list (default: the model's max_seq_len)")
    r = p.add_argument_group("routing")
    r.add_argument("--load-factor", type=Number(float, 1.0), default=1.25, help="bounded-load factor, >= 1 (1.25)")
    r.add_argument("--stats-period-s", type=POSITIVE, default=0.5, help="replica stats poll period (0.5)")
    r.add_argument("--max-ongoing-requests", type=POSITIVE_INT, default=32, help="requests a replica holds at once (32)")
    return p


def _spec(args):
    from ..config import CacheConfig
    from .ray_serve import ReplicaSpec
    from .wire import RequestLimits

    cache = CacheConfig(device=args.device, page_size=args.page_size, num_pages=args.num_pages,
                        max_pinned_fraction=args.max_pinned_fraction, lease_ttl_s=args.lease_ttl_s,
                        dram_bytes=int(args.dram_mb * 2**20))
    return ReplicaSpec(model=dict(args.model), seed=args.seed, state_dict_path=args.state_dict, cache=cache,
                       trigger=args.trigger, latency_profile=args.latency_profile, torch_threads=args.torch_threads,
                       max_pending_prefills=args.max_pending_prefills, slo_ms=args.slo_ms,
                       store_misses=args.store_misses, max_kept_prefixes=args.max_kept_prefixes,
                       prefill_chunk_tokens=args.prefill_chunk_tokens,
                       limits=RequestLimits(max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                                            max_candidates=args.max_candidates, max_history=args.max_history))


def main(argv: Optional[list[str]] = None, stop: Optional[threading.Event] = None) -> int:
    """Run ``relaygr serve``.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default: ``sys.argv[1:]``).
    stop : threading.Event, optional
        Serve until it is set, for a caller that runs the server in a thread (Ctrl-C, SIGTERM and ``--duration``
        stop it as well).

    Returns
    -------
    int
        The exit status: 0 once stopped; usage errors exit with status 2 (``SystemExit``).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        spec = _spec(args)
        if args.rank_replicas is not None and args.prefill_replicas is None:
            raise ValueError("--rank-replicas needs --prefill-replicas (the disaggregated mode)")
        if args.ratio_control is not None:
            if args.prefill_replicas is None:
                raise ValueError("--ratio-control needs --prefill-replicas (the disaggregated mode)")
            from .ratio_policy import PoolRatioPolicy
            try:
                PoolRatioPolicy.from_options(args.ratio_control)
            except ValueError as e:
                raise ValueError(f"--ratio-control: {e}") from None
        if args.prefill_replicas is not None and args.rank_replicas is None:
            args.rank_replicas = 2
    except (ValueError, TypeError) as e:
        parser.error(in_flags(parser, str(e)))
    if args.metrics_port is not None and args.address is not None:
        parser.error("--metrics-port sets the port of a local Ray instance; a cluster's nodes (--address) export "
                     "metrics on the ports they were started with")
    if args.address is None:  # read by Ray when it is imported (see the module docstring)
        os.environ[_LOCAL_NODE_ENV] = "0"
        os.environ.setdefault(_NICENESS_ENV, "0")  # replicas and proxy at normal priority (Ray's default: 15)
    require_modules(parser, ["ray.serve"], "ray", "relaygr serve")
    import ray
    from ray import serve

    if args.address is None and not ray.is_initialized():  # this process starts Ray and Serve's proxy here
        _check_listen(parser, "--port", args.host, args.port)
        if args.metrics_port is not None:
            _check_listen(parser, "--metrics-port", _LOOPBACK, args.metrics_port)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return _serve(parser, args, spec, ray, serve, stop)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_listen(parser: argparse.ArgumentParser, flag: str, host: str, port: int) -> None:
    """Stop with a usage error naming ``flag`` (or ``--host``) when ``host:port`` cannot be bound now.

    Binds without ``SO_REUSEADDR``, as Serve's proxy does, so a port any socket holds counts as in use.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        parser.error(f"argument --host: expected an address of this machine, got {host!r} ({e.strerror})")
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                parser.error(f"argument {flag}: expected a free port, got {port}: {_address(host, port)} is "
                             "already in use")
            if e.errno == errno.EADDRNOTAVAIL:
                parser.error(f"argument --host: expected an address of this machine, got {host!r} "
                             f"({e.strerror})")
            parser.error(f"argument {flag}: cannot listen on {_address(host, port)} ({e.strerror})")


def _bind_failure(exc: BaseException) -> Optional[str]:
    """The address in Serve's proxy bind failure (a ``RayTaskError(RuntimeError)`` out of ``serve.start``) found in
    ``exc`` or what caused it; ``None`` for any other error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = _BIND_FAILURE.search(str(exc))
        if found:
            return found.group(1)
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None


def _metrics_urls(ray) -> list[str]:
    """Where Prometheus scrapes the replicas' metrics: each live Ray node's metrics export endpoint."""
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def _stop_on_sigterm():
    """Make SIGTERM stop the server like Ctrl-C (so Ray and Serve shut down); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _start_ray(args, ray) -> tuple[bool, str]:
    """Connect to Ray as ``args`` say; ``(whether this process started it, where)``."""
    if ray.is_initialized():  # called from a driver that is already connected
        return False, "the Ray instance this process is connected to"
    if args.address is None:
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address=_LOOPBACK,
                 _metrics_export_port=args.metrics_port)
        return True, "a local Ray instance (127.0.0.1)"
    ray.init(address=args.address)
    return False, f"the Ray cluster at {args.address}"


def _deploy(args, spec) -> str:
    """Start Serve and deploy the app; returns what was deployed, in words."""
    common = dict(app_name=args.app_name, route_prefix=args.route_prefix, host=args.host, port=args.port,
                  num_cpus=args.replica_cpus, num_gpus=1.0 if args.device == "cuda" else 0.0,
                  load_factor=args.load_factor, stats_period_s=args.stats_period_s,
                  max_ongoing_requests=args.max_ongoing_requests)
    if args.prefill_replicas is None:
        from .ray_serve import run
        run(spec, num_replicas=args.replicas, **common)
        return f"{args.replicas} replica(s)"
    from .disaggregated import run_disaggregated
    run_disaggregated(spec, prefill_replicas=args.prefill_replicas, rank_replicas=args.rank_replicas,
                      ratio_control=args.ratio_control, **common)
    return (f"{args.prefill_replicas} pre-infer + {args.rank_replicas} ranking replica(s) "
            f"(disaggregated{', live ratio control' if args.ratio_control is not None else ''})")


def _announce(args, ray, shape: str, where: str, started_ray: bool) -> None:
    prefix = args.route_prefix.rstrip("/") + "/"
    print(f"relaygr serve: {shape} of app {args.app_name!r} on {where}")
    print(f"HTTP http://{_address(args.host, args.port)}{prefix}  (POST {prefix}prefill, POST {prefix}rank, "
          f"GET {prefix}stats; route key in header x-session-id, e.g. '7;prefill' then the prefill reply's route_key)")
    if not started_ray:
        print("(a Serve instance already running on the cluster keeps its own HTTP host and port)")
    print(f"metrics (Prometheus): {', '.join(_metrics_urls(ray))}  (names: relaygr_engine.serving.metrics, "
          "prefixed ray_ by Ray)")
    print("Ctrl-C (or SIGTERM) to stop" if args.duration is None else f"serving for {args.duration:g} s",
          flush=True)


def _wait(duration: Optional[float], stop: Optional[threading.Event]) -> None:
    """Until ``duration`` seconds have passed or ``stop`` is set (Ctrl-C and SIGTERM raise KeyboardInterrupt)."""
    stop = stop if stop is not None else threading.Event()
    end = None if duration is None else time.monotonic() + duration
    while not stop.is_set() and (end is None or time.monotonic() < end):
        stop.wait(0.2 if end is None else max(0.0, min(0.2, end - time.monotonic())))


def _serve(parser, args, spec, ray, serve, stop: Optional[threading.Event] = None) -> int:
    started_ray, where = _start_ray(args, ray)
    node_ip = ray.util.get_node_ip_address() if started_ray else _LOOPBACK
    if node_ip != _LOOPBACK:  # Ray was imported before the environment was set (a caller's process)
        ray.shutdown()
        print(f"relaygr serve: the local Ray node took the address {node_ip}, not {_LOOPBACK}; run relaygr serve "
              f"in its own process or set {_LOCAL_NODE_ENV}=0 before importing ray", file=sys.stderr)
        return 2
    restore = _stop_on_sigterm()  # after ray.init, which installs its own SIGTERM handler
    failure, deployed = None, False
    try:
        try:
            shape = _deploy(args, spec)
            deployed = True
        except Exception as e:  # noqa: BLE001 - only the proxy's bind failure is turned into a usage error
            address = _bind_failure(e)
            if address is None:
                raise
            failure = (f"argument --port: expected a free port, got {args.port}: Serve's HTTP proxy could not "
                       f"bind {address} (in use by another process?)")
        else:
            _announce(args, ray, shape, where, started_ray)
            _wait(args.duration, stop)
    except KeyboardInterrupt:
        print("relaygr serve: stopping", flush=True)
    finally:
        try:
            if started_ray:
                if deployed:
                    serve.shutdown()  # replicas stop gracefully
                ray.shutdown()  # stops every process of the local instance, Serve's too
            elif failure is None:  # a failed start deployed nothing
                serve.delete(args.app_name)
        finally:
            restore()
    if failure is not None:
        parser.error(failure)  # after Ray's shutdown, so that its output does not follow the error line
    return 0


if __name__ == "__main__":
    sys.exit(main())
