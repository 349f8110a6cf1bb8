"""The engine's host work in one CUDA-graph cached ranking, the graph's replay stubbed out (any machine).

A graphed ranking's latency is its host work (the request's checks, the prefix lookup and pin, the request rows,
the page table, the graph buffers' fill and their host-to-device copy), then the graph launch and the GPU work. This
times the first part alone, on the CPU or on CUDA: the engine's graph runner serves every ranking from a stand-in
graph whose replay does nothing (its scores are zeros), so what is timed is everything the engine does around a
replay.

Model: NVIDIA's public HSTU inference shape (``--model``; its size matters only through the weights the engine's
identity check walks); a history of ``--history`` tokens of which ``--new`` are new (the rest pre-inferred), and
``--candidates`` candidates. Each seed draws its own history and candidates; the RESULT line gives the median over
seeds of each seed's median time per ranking, and the spread (min, max) of those medians:

    python benchmarks/host_work.py [--seeds 0,1,2] [--calls 300] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import time

import torch

import relaygr_engine as rg
from relaygr_engine.bench.common import percentile, synthetic_history
from relaygr_engine.engine.graphs import GraphRunner
from relaygr_engine.models.presets import shape_of


class _NoReplay:
    def replay(self) -> None:
        pass


class StubGraphs(GraphRunner):
    """A graph runner whose "capture" keeps a stand-in graph: each later ranking of a bucket does all of a replay's
    host work, and its replay does nothing (zero scores)."""

    def _capture(self, b) -> None:
        b.graph, b.out = _NoReplay(), torch.zeros(b.key.candidates, self.tasks, device=self.state.cache.device)

    def _forward(self, b, batch, paged) -> torch.Tensor:
        return torch.zeros(b.key.candidates, self.tasks, device=self.state.cache.device)


def engine_for(args, device: torch.device) -> rg.RelayEngine:
    name = "bfloat16" if device.type == "cuda" else "float32"
    dtype, shape = getattr(torch, name), shape_of(args.model, dtype=name)
    cfg = shape.config(attention="hstu", num_items=100_000, num_actions=4, max_seq_len=args.history, num_tasks=2)
    model = rg.build_ranker(cfg, seed=0, device=device)
    pages = len(args.seeds) * -(-args.history // 64) + 8
    engine = rg.RelayEngine(model, rg.CacheConfig(
        device=str(device), page_size=64, num_pages=pages, lease_ttl_s=3600.0, dtype=dtype, max_pinned_fraction=1.0,
        attention_backend="torch"), extend_on_rank=False)  # (the rankings' forward is stubbed: no kernel to build)
    runner = StubGraphs(engine.model, engine.layers, engine.state, rg.GraphConfig(max_graphs=4, prefill=False),
                        capture=False)  # pre-infers run (eagerly): the rankings read real K/V
    runner.capture, runner.tasks = True, cfg.num_tasks
    engine.runner.graphs = runner
    return engine


def time_seed(engine: rg.RelayEngine, seed: int, args, device: torch.device) -> list[float]:
    """Microseconds of host work per ranking, ``args.calls`` warmed-up rankings of one user."""
    h = synthetic_history(args.history, 100_000, seed=seed)
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 100_000, (args.candidates,), generator=g)
    user = 1000 + seed
    assert engine.prefill_prefix(user, h.prefix(args.history - args.new)).admitted
    times = []
    for i in range(args.calls + 20):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = engine.rank_with_prefix(user, h, c)
        dt = time.perf_counter() - t0
        assert r.source == "hbm" and r.cached_tokens == args.history - args.new, (r.source, r.cached_tokens)
        if i >= 20:
            times.append(dt * 1e6)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="nvidia-hstu")
    p.add_argument("--history", type=int, default=4096)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--candidates", type=int, default=256)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    engine = engine_for(args, device)
    medians = []
    for seed in args.seeds:
        times = time_seed(engine, seed, args, device)
        medians.append(percentile(times, 50))
        print(f"seed {seed}: median {medians[-1]:.1f} us per ranking (p10 {percentile(times, 10):.1f}, "
              f"p90 {percentile(times, 90):.1f}; {args.calls} rankings)")
    s = engine.stats()
    assert len(engine.runner.graphs.buckets) == 1 and s["graph_replays"] == len(args.seeds) * (args.calls + 20) - 1, s
    tag = f"L{args.history}_C{args.candidates}"
    print(f"RESULT host_us_{tag}={percentile(medians, 50):.1f} host_us_min_{tag}={min(medians):.1f} "
          f"host_us_max_{tag}={max(medians):.1f} seeds={len(args.seeds)} new_rows={args.new} model={args.model} "
          f"device={device.type} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
