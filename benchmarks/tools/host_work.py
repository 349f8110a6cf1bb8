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

    python benchmarks/tools/host_work.py [--seeds 0,1,2] [--calls 300] [--device cpu|cuda] [--phases]

``--phases`` also prints where the time goes, microseconds per ranking (mean over every timed ranking) spent in each
step of the engine's host work: the request's checks and token keys, the model identity, lookup and pin, gathering
the rows, the page table, the row and tile tables; then, as wholes holding some of those, the buffers' fill and
copy, the graph runner and the ranking call. Each step is timed by a wrapper (about a microsecond each, so the
wholes run a little higher than the RESULT line, which is timed without them).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
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


# (owner, attribute, phase): the steps --phases times, wrapped where the engine calls them
PHASES = [("engine.core.RelayEngine", "_prepare", "request checks and token keys"),
          ("identity.WeightsIdentity", "value", "model identity"),
          ("engine.rank.RankPlanner", "job", "lookup and pin"),
          ("engine.graphs", "gather_rows", "request rows"),
          ("engine.graphs", "page_layout", "page table"),
          ("engine.graphs", "structure_arrays", "row tables"),
          ("engine.graphs", "tile_arrays", "tile tables"),
          ("engine.graphs.GraphRunner", "_fill", "buffers' fill and copy (all of it)"),
          ("engine.graphs.GraphRunner", "run", "graph runner (all of it)"),
          ("engine.core.RelayEngine", "rank_with_prefix_batch", "ranking (all of it)")]


@contextlib.contextmanager
def timed_phases():
    """Within: each of :data:`PHASES` wrapped by a timer; yields the dict of seconds spent in each (by phase)."""
    import importlib

    spent: collections.Counter = collections.Counter()
    undo = []
    for where, attr, phase in PHASES:
        path = where.split(".")
        mod = importlib.import_module("relaygr_engine." + ".".join(p for p in path if p[0].islower()))
        owner = functools.reduce(getattr, [p for p in path if p[0].isupper()], mod)
        real = owner.__dict__[attr]
        if isinstance(real, property):
            new = property(_timer(real.fget, phase, spent))
        else:
            new = _timer(real, phase, spent)
        setattr(owner, attr, new)
        undo.append((owner, attr, real))
    try:
        yield spent
    finally:
        for owner, attr, real in reversed(undo):
            setattr(owner, attr, real)


def _timer(fn, phase: str, spent: collections.Counter):
    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[phase] += time.perf_counter() - t0
    return timed


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


def request(seed: int, args) -> tuple:
    """Seed ``seed``'s user, history and candidates."""
    g = torch.Generator().manual_seed(seed)
    return 1000 + seed, synthetic_history(args.history, 100_000, seed=seed), \
        torch.randint(0, 100_000, (args.candidates,), generator=g)


def time_seed(engine: rg.RelayEngine, seed: int, args, device: torch.device, warm: int = 20) -> list[float]:
    """Microseconds of host work per ranking, ``args.calls`` rankings of one user after ``warm`` more (its prefix
    pre-inferred first unless ``warm`` is 0: then it must be cached already)."""
    user, h, c = request(seed, args)
    if warm:
        assert engine.prefill_prefix(user, h.prefix(args.history - args.new)).admitted
    times = []
    for i in range(args.calls + warm):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = engine.rank_with_prefix(user, h, c)
        dt = time.perf_counter() - t0
        assert r.source == "hbm" and r.cached_tokens == args.history - args.new, (r.source, r.cached_tokens)
        if i >= warm:
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
    p.add_argument("--phases", action="store_true", help="also print the time of each step (see the module doc)")
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
    if args.phases:  # (after the timed seeds, whose figures are without the wrappers: the same rankings again)
        with timed_phases() as spent:
            n = sum(len(time_seed(engine, seed, args, device, warm=0)) for seed in args.seeds)
        for _, _, phase in PHASES:
            print(f"phase {phase}: {spent[phase] / n * 1e6:.1f} us per ranking")
    s = engine.stats()
    replays = len(args.seeds) * (args.calls + 20 + (args.calls if args.phases else 0)) - 1  # (the first one eager)
    assert len(engine.runner.graphs.buckets) == 1 and s["graph_replays"] == replays, s
    tag = f"L{args.history}_C{args.candidates}"
    print(f"RESULT host_us_{tag}={percentile(medians, 50):.1f} host_us_min_{tag}={min(medians):.1f} "
          f"host_us_max_{tag}={max(medians):.1f} seeds={len(args.seeds)} new_rows={args.new} model={args.model} "
          f"device={device.type} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
