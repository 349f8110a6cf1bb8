"""``relaygr bench pool``: block-pool throughput and per-call latency, C++ vs pure Python, in one run.

Each cycle is the pool's life of one request with a 64-page prefix: ``insert`` (pre-infer; evicts the LRU entry when
the pool is full), ``unpin``, ``lookup``, ``pin`` and ``unpin`` (ranking). Ops are pool calls.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..cli_args import ArgumentParser
from .._ext import pool_implementations
from .common import emit_result, environment, percentile

CALLS_PER_CYCLE = 5


def run_cycles(pool_cls, cycles: int, pages_per_prefix: int, page_size: int, users: int) -> dict[str, float]:
    """Time ``cycles`` request cycles on a fresh pool; return ops/s and per-call latency percentiles (us)."""
    num_pages = pages_per_prefix * max(2, users // 4)  # room for a quarter of the users: constant eviction
    pool = pool_cls(num_pages, page_size)
    tokens = pages_per_prefix * page_size
    lat = np.empty(cycles * CALLS_PER_CYCLE, dtype=np.int64)
    clock = time.perf_counter_ns
    k = 0
    t0 = time.perf_counter()
    for i in range(cycles):
        user, fp = i % users, i // users  # a user's prefix changes each time round: fresh inserts
        a = clock()
        pool.insert(user, fp, tokens, now=float(i))
        b = clock()
        pool.unpin(user, fp, now=float(i))
        c = clock()
        pool.lookup(user, fp)
        d = clock()
        pool.pin(user, fp, now=float(i))
        e = clock()
        pool.unpin(user, fp, now=float(i))
        f = clock()
        lat[k:k + 5] = (b - a, c - b, d - c, e - d, f - e)
        k += 5
    elapsed = time.perf_counter() - t0
    pool.check_invariants()
    s = pool.stats()
    assert s["inserts"] == cycles and s["evictions"] > 0
    return {"ops_per_s": cycles * CALLS_PER_CYCLE / elapsed,
            "page_ops_per_s": (s["allocations"] + s["evicted_pages"] + s["hits"] * pages_per_prefix) / elapsed,
            "p50_us": percentile(lat, 50) / 1e3, "p99_us": percentile(lat, 99) / 1e3,
            "insert_p99_us": percentile(lat[0::5], 99) / 1e3, "evictions": s["evictions"]}


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench pool", description=__doc__)
    ap.add_argument("--cycles", type=int, default=20000)
    ap.add_argument("--pages", type=int, default=64, help="pages per prefix (default 64)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="a smoke run (2000 cycles)")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    cycles = 2000 if args.quick else args.cycles
    impls = pool_implementations()
    env = environment("cpu")
    print(f"relaygr bench pool: {cycles} cycles x {CALLS_PER_CYCLE} calls, {args.pages}-page prefixes, "
          f"{args.users} users, on {env['device_name']}")
    if "cpp" not in impls:
        print("  (C++ extension not loaded: only the pure-Python pool is measured)")
    rows = {}
    print(f"{'pool':8s} {'ops/s':>12s} {'page-ops/s':>12s} {'p50 us':>8s} {'p99 us':>8s} {'insert p99 us':>14s}")
    for name in ("cpp", "python"):
        if name not in impls:
            continue
        run_cycles(impls[name], min(cycles, 500), args.pages, args.page_size, args.users)  # warm-up
        r = rows[name] = run_cycles(impls[name], cycles, args.pages, args.page_size, args.users)
        print(f"{name:8s} {r['ops_per_s']:12.0f} {r['page_ops_per_s']:12.0f} {r['p50_us']:8.2f} "
              f"{r['p99_us']:8.2f} {r['insert_p99_us']:14.2f}")
    result = {}
    if "cpp" in rows:
        result["cpp_ops_per_s"] = round(rows["cpp"]["ops_per_s"])
    result["py_ops_per_s"] = round(rows["python"]["ops_per_s"])
    if "cpp" in rows:
        result["speedup"] = round(rows["cpp"]["ops_per_s"] / rows["python"]["ops_per_s"], 2)
        result["cpp_p99_us"] = round(rows["cpp"]["p99_us"], 2)
    result["py_p99_us"] = round(rows["python"]["p99_us"], 2)
    emit_result(result, args.json, {"environment": env, "rows": rows, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
