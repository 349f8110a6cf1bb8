"""``relaygr bench host``: the engine's host work in one CUDA-graph cached ranking, the graph's replay stubbed out
(any machine).

A graphed ranking's latency is its host work (the request's checks, the prefix lookup and pin, the request rows,
the page table, the graph buffers' fill and their host-to-device copy), then the graph launch and the GPU work. A
graph fixes addresses, not data, so all of the host work runs while the GPU idles. This times it alone, on the CPU
or on CUDA: the engine's graph runner serves every ranking from a stand-in graph whose replay does nothing (its
scores are zeros), so what is timed is everything the engine does around a replay.

Model: NVIDIA's public HSTU inference shape (``--model``; its size matters through the weights the engine's
identity check tracks); a history of ``--history`` tokens of which ``--new`` are new (the rest pre-inferred), and
``--candidates`` candidates. Each seed draws its own history and candidates; each ranking is a new request object
over copies of the seed's tensors (its checks and host views made again, as a server builds a request from the
tensors it received). ``host_us_per_rank`` is the median over seeds of each seed's median
microseconds per ranking, with the spread (min, max) of those medians; the clock is the thread's CPU time on a
CPU with one torch thread (other processes on a shared machine barely move it), else wall time (``--clock``).

Where the time goes (``step_*_us``): microseconds per ranking (mean over every ranking of a second pass) spent in
each step: the request's checks, the model identity, lookup and pin, the request rows, the row and page tables,
then, as wholes holding some of those, the buffers' fill and copy, the graph runner and the ranking call. Each step
is timed by a wrapper (about a microsecond each, so the wholes run a little higher than ``host_us_per_rank``,
which is timed without them). ``--no-steps`` skips that pass.

    relaygr bench host [--model nvidia-hstu] [--device cpu|cuda] [--seeds 0,1,2] [--calls 300] [--json PATH]
"""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import time
from typing import Optional

import torch

from ..cli_args import COUNT, POSITIVE_INT, ArgumentParser, NumberList, device as device_arg
from ..engine.graphs import GraphRunner
from ..results import emit_result, environment
from .common import percentile, synthetic_history

__all__ = ["STEPS", "StubGraphs", "engine_for", "main", "timed_steps"]


class _NoReplay:
    def replay(self) -> None:
        pass


class StubGraphs(GraphRunner):
    """A graph runner whose "capture" keeps a stand-in graph: each later ranking of a bucket does all of a replay's
    host work, and its replay does nothing (zero scores). Set ``tasks`` (the model's score columns) and ``capture``
    after making one with ``capture=False`` (no CUDA graph pool)."""

    tasks = 1

    def _capture(self, b) -> None:
        b.graph, b.out = _NoReplay(), torch.zeros(b.key.candidates, self.tasks, device=self.state.cache.device)

    def _forward(self, b, batch, paged) -> torch.Tensor:
        return torch.zeros(b.key.candidates, self.tasks, device=self.state.cache.device)


# (where, attribute, step key, what): the steps timed, wrapped where the engine calls them; a step the engine does
# not have (an older engine) is left out
STEPS = [("engine.core.RelayEngine", "_prepare", "checks", "request checks"),
         ("identity.WeightsIdentity", "value", "identity", "model identity"),
         ("engine.rank.RankPlanner", "job", "lookup", "lookup and pin"),
         ("engine.graphs", "host_layout", "layout", "request layout"),
         ("engine.graphs", "write_host_rows", "rows", "request rows"),
         ("engine.graphs.GraphRunner", "_fill", "fill", "buffers' fill and copy (all of it)"),
         ("engine.graphs.GraphRunner", "run", "runner", "graph runner (all of it)"),
         ("engine.core.RelayEngine", "rank_with_prefix_batch", "ranking", "ranking (all of it)")]


@contextlib.contextmanager
def timed_steps(timer=time.perf_counter):
    """Within: each of :data:`STEPS` wrapped by a ``timer``; yields the dict of seconds spent in each (by key)."""
    spent: collections.Counter = collections.Counter()
    undo = []
    for where, attr, key, _ in STEPS:
        path = where.split(".")
        mod = importlib.import_module("relaygr_engine." + ".".join(p for p in path if p[0].islower()))
        owner = functools.reduce(getattr, [p for p in path if p[0].isupper()], mod)
        real = owner.__dict__.get(attr)
        if real is None:
            continue
        new = property(_timer(real.fget, key, spent, timer)) if isinstance(real, property) else \
            _timer(real, key, spent, timer)
        setattr(owner, attr, new)
        undo.append((owner, attr, real))
    try:
        yield spent
    finally:
        for owner, attr, real in reversed(undo):
            setattr(owner, attr, real)


def _timer(fn, key: str, spent: collections.Counter, timer):
    @functools.wraps(fn)
    def timed(*a, **k):
        t0 = timer()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += timer() - t0
    return timed


def engine_for(model_name: str, history: int, users: int, device: torch.device):
    """An engine over ``model_name`` (bf16 on CUDA, fp32 elsewhere) with pages for ``users`` histories of
    ``history`` tokens, serving rankings through a stand-in graph runner (pre-infers run eagerly, so the rankings
    read real pages)."""
    import relaygr_engine as rg
    from ..models.presets import shape_of

    name = "bfloat16" if device.type == "cuda" else "float32"
    dtype, shape = getattr(torch, name), shape_of(model_name, dtype=name)
    cfg = shape.config(attention="hstu", num_items=100_000, num_actions=4, max_seq_len=history, num_tasks=2)
    model = rg.build_ranker(cfg, seed=0, device=device)
    engine = rg.RelayEngine(model, rg.CacheConfig(
        device=str(device), page_size=64, num_pages=users * -(-history // 64) + 8, lease_ttl_s=3600.0, dtype=dtype,
        max_pinned_fraction=1.0, attention_backend="torch"), extend_on_rank=False)  # (no kernel to build)
    runner = StubGraphs(engine.model, engine.layers, engine.state, rg.GraphConfig(max_graphs=4, prefill=False),
                            capture=False)
    runner.capture, runner.tasks = True, cfg.num_tasks
    engine.runner.graphs = runner
    return engine


def _request(seed: int, history: int, candidates: int, device: torch.device):
    """Seed ``seed``'s user, history and candidates (on the host, as a server receives them)."""
    g = torch.Generator().manual_seed(seed)
    return 1000 + seed, synthetic_history(history, 100_000, seed=seed), \
        torch.randint(0, 100_000, (candidates,), generator=g)


def time_seed(engine, seed: int, args, device: torch.device, timer, warm: int = 20) -> list[float]:
    """Microseconds of host work per ranking, ``args.calls`` rankings of one user after ``warm`` more (its prefix
    pre-inferred first unless ``warm`` is 0: then it must be cached already). Each ranking gets new tensors."""
    from ..behaviors import Behaviors

    user, h, c = _request(seed, args.history, args.candidates, device)
    if warm:
        assert engine.prefill_prefix(user, h.prefix(args.history - args.new)).admitted
    tensors = tuple(None if x is None else x.clone() for x in (h.item_ids, h.action_ids, h.timestamps,
                                                               h.context_ids))  # (not the pre-inferred ones)
    times = []
    for i in range(args.calls + warm):
        hist = Behaviors(*tensors)  # a new request object: its checks and host views are made again
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = timer()
        r = engine.rank_with_prefix(user, hist, c)
        dt = timer() - t0
        assert r.source == "hbm" and r.cached_tokens == args.history - args.new, (r.source, r.cached_tokens)
        if i >= warm:
            times.append(dt * 1e6)
    return times


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="nvidia-hstu", help="model preset (relaygr_engine.models.presets)")
    ap.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seeds", type=NumberList(COUNT), default=[0, 1, 2])
    ap.add_argument("--calls", type=POSITIVE_INT, default=300, help="timed rankings per seed")
    ap.add_argument("--history", type=POSITIVE_INT, default=4096)
    ap.add_argument("--new", type=POSITIVE_INT, default=128, help="new history tokens (the rest pre-inferred)")
    ap.add_argument("--candidates", type=POSITIVE_INT, default=256)
    ap.add_argument("--threads", type=POSITIVE_INT, default=1, help="torch intra-op threads")
    ap.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                    help="auto: the thread's CPU time on a CPU with one thread, else wall time")
    ap.add_argument("--no-steps", action="store_true", help="skip the pass that times each step")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    if args.new >= args.history:
        ap.error(f"--new must be below --history ({args.history}), got {args.new}")
    device = torch.device(args.device)
    if args.clock == "cpu" and (device.type != "cpu" or args.threads != 1):
        ap.error(f"--clock cpu needs --device cpu and --threads 1 (the work on the calling thread), got "
                 f"{device} and {args.threads}")
    torch.set_num_threads(args.threads)
    cpu = args.clock == "cpu" or (args.clock == "auto" and device.type == "cpu" and args.threads == 1)
    timer, clock = (time.thread_time, "thread_CPU_time") if cpu else (time.perf_counter, "wall_time")
    from ..models.presets import shape_of

    try:
        shape_of(args.model)
    except ValueError as e:
        ap.error(f"argument --model: {e}")
    engine = engine_for(args.model, args.history, len(args.seeds), device)
    print(f"relaygr bench host: {args.model}, {args.history} tokens ({args.new} new), {args.candidates} candidates, "
          f"{device}, {args.threads} thread(s), {clock.replace('_', ' ')}; replays stubbed")
    medians = []
    for seed in args.seeds:
        times = time_seed(engine, seed, args, device, timer)
        medians.append(percentile(times, 50))
        print(f"seed {seed}: median {medians[-1]:.1f} us per ranking (p10 {percentile(times, 10):.1f}, "
              f"p90 {percentile(times, 90):.1f}; {args.calls} rankings)")
    steps = {}
    if not args.no_steps:  # (after the timed seeds, whose figures are without the wrappers: the same rankings again)
        with timed_steps(timer) as spent:
            n = sum(len(time_seed(engine, seed, args, device, timer, warm=0)) for seed in args.seeds)
        for _, _, key, what in STEPS:
            if key in spent:
                steps[f"step_{key}_us"] = round(spent[key] / n * 1e6, 1)
                print(f"  {what:<40} {steps[f'step_{key}_us']:7.1f} us per ranking")
    s = engine.stats()
    replays = len(args.seeds) * (args.calls + 20 + (0 if args.no_steps else args.calls)) - 1  # (the first eager)
    assert len(engine.runner.graphs.buckets) == 1 and s["graph_replays"] == replays, s
    result = dict(host_us_per_rank=round(percentile(medians, 50), 1), host_us_min=round(min(medians), 1),
                  host_us_max=round(max(medians), 1), **steps, seeds=len(args.seeds), history=args.history,
                  new_rows=args.new, candidates=args.candidates, model=args.model, device=device.type,
                  threads=args.threads, clock=clock)
    emit_result(result, args.json, extra=dict(environment=environment(str(device)), medians=medians))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
