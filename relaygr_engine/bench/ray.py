"""Relay-race serving on 1 vs N Ray Serve replicas: closed-loop throughput and ranking latency.

For each replica count the app is deployed (the affinity router, one engine per replica) and ``--concurrency``
client threads (:class:`~relaygr_engine.serving.client.RelayClient`) each loop over requests: pre-infer a user's
prefix, then rank its full history (prefix + ``--new-tokens``) against ``--candidates`` items with the ticket.
Users are drawn round-robin from ``--users``. The first ``--concurrency`` requests warm up and are not counted.

Reported per replica count: requests per second (wall clock of the counted requests), client-side ranking latency
p50/p99 (the Serve hop included), the share of rankings that read the prefix from the replica cache, and
pre-infers forwarded past a rejecting replica. Scaling needs cores: give each replica its own (``--replica-cpus``)
and a machine or cluster that has them; on a small machine the numbers show overhead, not scaling.

Entry point ``main(argv)`` (a ``relaygr bench`` module can re-export it). Ends with one ``RESULT`` line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from ..cli_args import ArgumentParser, POSITIVE_INTS
from .common import percentile


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="relaygr bench ray", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=POSITIVE_INTS, default=[1, 2], help="replica counts to compare (1,2)")
    p.add_argument("--requests", type=int, default=200, help="counted requests per replica count (200)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads (4)")
    p.add_argument("--users", type=int, default=64, help="distinct users (64)")
    p.add_argument("--history", type=int, default=384, help="prefix tokens pre-inferred (384)")
    p.add_argument("--new-tokens", type=int, default=16, help="history tokens added before ranking (16)")
    p.add_argument("--candidates", type=int, default=64, help="candidates per ranking (64)")
    p.add_argument("--model", default=None, help="GRModelConfig fields as JSON (default: GRModelConfig())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-pages", type=int, default=4096, help="cache pages per replica (4096)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica (1)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch threads per replica (1)")
    p.add_argument("--address", default=None, help="join this Ray cluster (default: a local instance on 127.0.0.1)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    p.add_argument("--json", default=None, help="also write the numbers as JSON to this path")
    return p


def _workload(args, cfg):
    g = torch.Generator().manual_seed(args.seed + 1)
    L = args.history + args.new_tokens
    users = []
    for u in range(args.users):
        items = torch.randint(0, cfg.num_items, (L,), generator=g)
        acts = torch.randint(0, cfg.num_actions, (L,), generator=g)
        ts = 1_700_000_000 + torch.arange(L) * 60
        users.append((items, acts, ts, torch.randint(0, cfg.num_items, (args.candidates,), generator=g)))
    return users


def _run_one(args, spec, users, n: int) -> dict:
    from ray import serve

    from .. import Behaviors
    from ..serving.client import RelayClient
    from ..serving.ray_serve import build_app

    name = f"relaygr_bench_{n}"
    handle = serve.run(build_app(spec, num_replicas=n, num_cpus=args.replica_cpus,
                                 num_gpus=1.0 if args.device == "cuda" else 0.0),
                       name=name, route_prefix=f"/{name}")
    client = RelayClient(handle)
    rank_ms, sources = [], []

    def one(i: int) -> None:
        u = i % len(users)
        items, acts, ts, cands = users[u]
        full = Behaviors(items, acts, ts)
        pre = client.prefill(u, full.prefix(args.history))
        t0 = time.perf_counter()
        r = client.rank(u, full, cands, ticket=pre)
        if i >= args.concurrency:
            rank_ms.append((time.perf_counter() - t0) * 1e3)
            sources.append(r.source)

    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, range(args.concurrency)))  # warm-up
            t0 = time.perf_counter()
            list(pool.map(one, range(args.concurrency, args.concurrency + args.requests)))
            wall = time.perf_counter() - t0
    finally:
        serve.delete(name)
    lat = np.array(rank_ms)
    s = client.stats()
    return {"replicas": n, "requests": len(lat), "rps": len(lat) / wall, "rank_p50_ms": percentile(lat, 50),
            "rank_p99_ms": percentile(lat, 99), "hbm_share": sources.count("hbm") / len(sources),
            "prefill_forwarded": s["prefill_forwarded"], "prefill_not_landed": s["prefill_not_landed"]}


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from .. import CacheConfig, GRModelConfig
    from ..serving.ray_serve import ReplicaSpec

    try:
        for name in ("requests", "concurrency", "users", "history", "candidates", "torch_threads"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        cfg = GRModelConfig(**(json.loads(args.model) if args.model else {}))
        if args.history + args.new_tokens > cfg.max_seq_len:
            raise ValueError(f"--history + --new-tokens must be <= max_seq_len ({cfg.max_seq_len}), got "
                             f"{args.history + args.new_tokens}")
        spec = ReplicaSpec(model=cfg, seed=args.seed, torch_threads=args.torch_threads,
                           cache=CacheConfig(device=args.device, num_pages=args.num_pages, lease_ttl_s=60.0))
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        print(f"relaygr bench ray: {e}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        print("relaygr bench ray: Ray Serve is not installed; pip install 'relaygr-engine[ray]'", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        if args.address is None:
            ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False)
        else:
            ray.init(address=args.address, log_to_driver=False)
    users = _workload(args, cfg)
    rows = []
    try:
        serve.start(http_options={"host": None})  # handles only: no HTTP proxy
        for n in args.replicas:
            rows.append(_run_one(args, spec, users, n))
    finally:
        if started:
            if args.address is None:
                serve.shutdown()
            ray.shutdown()
    print(f"model: {cfg.attention.value}, {cfg.num_layers} layers, d={cfg.hidden_dim}; history {args.history} + "
          f"{args.new_tokens} new, {args.candidates} candidates; {args.concurrency} client threads; "
          f"{args.replica_cpus:g} CPU(s) per replica; device {args.device}")
    print(f"{'replicas':>8} {'requests':>8} {'req/s':>8} {'rank p50 ms':>11} {'rank p99 ms':>11} {'hbm share':>9} "
          f"{'forwarded':>9}")
    for r in rows:
        print(f"{r['replicas']:>8} {r['requests']:>8} {r['rps']:>8.1f} {r['rank_p50_ms']:>11.2f} "
              f"{r['rank_p99_ms']:>11.2f} {r['hbm_share']:>9.3f} {r['prefill_forwarded']:>9}")
    base = rows[0]
    result = {"replicas": ",".join(str(r["replicas"]) for r in rows)}
    for r in rows:
        result[f"rps_{r['replicas']}"] = round(r["rps"], 2)
        result[f"rank_p99_ms_{r['replicas']}"] = round(r["rank_p99_ms"], 2)
        result[f"hbm_share_{r['replicas']}"] = round(r["hbm_share"], 3)
    for r in rows[1:]:
        result[f"speedup_{r['replicas']}_vs_{base['replicas']}"] = round(r["rps"] / base["rps"], 3)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "args": {k: v for k, v in vars(args).items() if k != "json"}}, f, indent=1)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
