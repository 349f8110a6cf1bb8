"""``relaygr bench overhead``: the fixed cost of a ranking, in aten ops (deterministic) and in time.

Op counts are taken with a ``TorchDispatchMode`` that counts every aten op the call dispatches (views included:
every op is host work). Of them, ``launches_per_layer`` counts those that launch a kernel on a GPU (every op but
views, allocations and metadata-only ops, :data:`NO_KERNEL`), plus Triton kernel launches (none on the CPU's torch
backend). One ranking is counted on two models that differ only in depth (``2`` and ``8`` layers), so
``ops_per_layer = (ops_8 - ops_2) / 6`` and ``ops_per_request = ops_2 - 2 * ops_per_layer``; the same for launches
and for the no-cache path (``GRRanker.rank_uncached``). The counted ranking repeats the warm-up's layout, as a user
ranked again over the same prefix does (the torch backend's plan for it is kept: ``ForwardRunner._torch_plan``).

Times are the median of ``--repeats`` calls after a warm-up, one torch thread by default, for history lengths
``L`` in {16, 256}, candidates ``C`` in {1, 64}: single requests and batches of 8 and 32 (per request), a cache
hit (all but the last 4 tokens cached) and no cache (``rank_uncached``).

Model: HSTU, hidden 64, 2 heads x 32, fp32, CPU (``--device`` for another), torch backend.

Where a hit's time goes (L=16, C=1, single and batch of 32; :func:`split_hit_time`): the model's own ops (its
projections, norms, gates and heads), the engine's attention op in its layers, and the engine's host work around
the forward (validation, prefix lookup and pins, the batch's row tables, page layout and plan, results), each the
median over the same calls (``model_us_*``, ``attention_us_*``, ``engine_us_*``), timed by proxies (one Python call
more per forward and per layer).

With ``--compile`` the hit path is also timed on an engine that runs the whole model compiled
(``RelayEngine(compile_model=True)``: ``torch.compile(fullgraph=True, dynamic=True)``, each attention layer one
opaque op); the compile itself, on each configuration's first call, is not timed.

    relaygr bench overhead [--quick] [--compile] [--json PATH] [--repeats N] [--threads N] [--device cpu|cuda]
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..attention import layer as layer_module, op as relay_op
from ..cli_args import ArgumentParser
from ..config import CacheConfig
from ..engine import RankRequest, RelayEngine
from ..models import Behaviors, GRModelConfig, build_ranker
from .common import emit_result, environment, median_time, percentile, synthetic_history
from .sim import service_clock

__all__ = ["NO_KERNEL", "OpCounter", "count_launches", "count_ops", "hit_path_ops", "main", "split_hit_time"]

NEW_TOKENS = 4


# aten ops that launch no kernel on a GPU besides views: allocations and metadata-only ops (and the scalar read,
# a device-to-host copy, not a launch)
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                       "_reshape_alias", "alias", "lift_fresh", "set_", "resize_", "_local_scalar_dense"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (``counts``: op name -> calls) and, of them, those that launch a
    kernel on a GPU (``launches``: every op but views, :data:`NO_KERNEL`), plus Triton kernel launches (``triton``:
    kernel name -> launches, counted where Triton is installed)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.launches: Counter = Counter()
        self.triton: Counter = Counter()
        self._undo: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        if not func.is_view and name not in NO_KERNEL:
            self.launches[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._undo = _count_triton(self.triton)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, real in self._undo:
            owner.run = real
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def kernel_launches(self) -> int:
        """aten ops that launch a kernel, plus Triton launches."""
        return sum(self.launches.values()) + sum(self.triton.values())


def _count_triton(counts: Counter) -> list:
    """Wrap Triton's kernel ``run`` (compiled and interpreted) to count launches by kernel name; the undo list."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return []
    from triton.runtime import interpreter, jit

    undo = []
    for owner in (jit.JITFunction, getattr(interpreter, "InterpretedFunction", None)):
        if owner is None or "run" not in owner.__dict__:
            continue
        real = owner.__dict__["run"]

        def run(self, *args, _real=real, **kwargs):
            counts[getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "kernel")] += 1
            return _real(self, *args, **kwargs)

        owner.run = run
        undo.append((owner, real))
    return undo


def count_ops(fn: Callable[[], object]) -> Counter:
    """The aten ops one call of ``fn`` dispatches."""
    with OpCounter() as c:
        fn()
    return c.counts


def count_launches(fn: Callable[[], object]) -> int:
    """Kernel launches one call of ``fn`` would make on a GPU: aten ops that launch one, plus Triton launches."""
    with OpCounter() as c:
        fn()
    return c.kernel_launches


def _model(layers: int, device: str, max_len: int = 512):
    cfg = GRModelConfig(attention="hstu", num_layers=layers, hidden_dim=64, num_heads=2, head_dim=32,
                        num_items=10_000, num_actions=4, max_seq_len=max_len, num_tasks=2)
    return build_ranker(cfg, seed=0, device=device)


def _engine(model, device: str, pages: int = 4096, compile_model: bool = False) -> RelayEngine:
    return RelayEngine(model, CacheConfig(device=device, page_size=16, num_pages=pages, max_pinned_fraction=1.0,
                                          lease_ttl_s=1e9, attention_backend="torch"), extend_on_rank=False,
                       compile_model=compile_model)


def _cached(engine: RelayEngine, users, hist: Behaviors) -> None:
    engine.prefill_prefix_batch([(u, hist.prefix(len(hist) - NEW_TOKENS)) for u in users])


def hit_path_ops(layers: int, L: int = 16, C: int = 1, device: str = "cpu") -> dict[str, Counter]:
    """aten ops of one cache-hit ranking and of one no-cache ranking (``rank_uncached``) on a ``layers``-deep model."""
    model = _model(layers, device)
    engine = _engine(model, device)
    hist, cands = synthetic_history(L, 10_000, 0, device), torch.arange(C, device=device)
    _cached(engine, [1], hist)
    engine.rank_with_prefix(1, hist, cands)  # warm: first-call caches (fingerprints, lazy imports)
    model.rank_uncached(hist, cands)
    # a new Behaviors per counted call, as a new request brings: its host views are made (and counted) again
    fresh = (lambda: Behaviors(hist.item_ids, hist.action_ids, hist.timestamps, hist.context_ids))
    out = {}
    for path, fn in (("hit", lambda: engine.rank_with_prefix(1, fresh(), cands)),
                     ("uncached", lambda: model.rank_uncached(fresh(), cands))):
        with OpCounter() as c:
            fn()
        out[path], out[f"{path}_launches"] = c.counts, c.launches + c.triton
    return out


def _per_layer(device: str) -> dict[str, float]:
    two, eight = hit_path_ops(2, device=device), hit_path_ops(8, device=device)
    out = {}
    for path in ("hit", "uncached", "hit_launches", "uncached_launches"):
        a, b = sum(two[path].values()), sum(eight[path].values())
        per_layer = (b - a) / 6
        what = "launches" if path.endswith("_launches") else "ops"
        path = path.removesuffix("_launches")
        out[f"{path}_{what}_per_layer"] = per_layer
        out[f"{path}_{what}_per_request"] = a - 2 * per_layer
    return out


class _Timed:
    """Calls ``fn`` and adds the time of each call to ``seconds``."""

    def __init__(self, fn: Callable, timer: Callable[[], float]) -> None:
        self.fn, self.timer, self.seconds = fn, timer, 0.0

    def __call__(self, *args, **kwargs):
        t0 = self.timer()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += self.timer() - t0


def split_hit_time(engine: RelayEngine, reqs: list, device: torch.device, repeats: int,
                   timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median microseconds per request of ``engine.rank_with_prefix_batch(reqs)`` and of its parts, over the same
    ``repeats`` calls (after one untimed call).

    Returns ``total``; ``model``: the model's own work in its forward (layers, norms, heads: the forward less the
    attention op); ``attention``: the engine's attention op in every layer (``relay_attention``: page reads and
    writes, the attention itself); ``engine``: the engine's host work around the forward (validation, lookup, pins,
    the batch's tables and plan, results). Each is the median of its own samples, so the parts need not add up to
    ``total`` exactly. The parts are timed by proxies around the engine's model caller and the op's implementation.
    """
    runner = engine.runner
    forward = runner.model = _Timed(runner.model, timer)
    attention = _Timed(relay_op.relay_attention, timer)
    homes = (relay_op, layer_module)  # the op's implementation, and the eager layers' direct call of it
    for home in homes:
        home.relay_attention = attention
    samples: dict[str, list] = {"total": [], "model": [], "attention": [], "engine": []}
    try:
        engine.rank_with_prefix_batch(reqs)
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            forward.seconds, attention.seconds, t0 = 0.0, 0.0, timer()
            engine.rank_with_prefix_batch(reqs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            total = timer() - t0
            for key, value in (("total", total), ("model", forward.seconds - attention.seconds),
                               ("attention", attention.seconds), ("engine", total - forward.seconds)):
                samples[key].append(value)
    finally:
        runner.model = forward.fn
        for home in homes:
            home.relay_attention = attention.fn
    per = 1e6 / len(reqs)
    return {key: float(percentile(values, 50)) * per for key, values in samples.items()}


def _split(engine: RelayEngine, device: torch.device, repeats: int, timer, batches: tuple,
           tag: str = "") -> dict[str, float]:
    """Print and return where a hit at L=16, C=1 goes (:func:`split_hit_time`) for each batch size; ``tag`` ends
    the keys (``"_compiled"`` for the compiled engine)."""
    hist, cand, out = synthetic_history(16, 10_000, 16, device), torch.arange(1, device=device), {}
    _cached(engine, range(max(batches)), hist)
    print(f"where a hit goes{tag.replace('_', ', ')} (L=16, C=1; us per request): total = the model's own ops + the "
          "attention op + the engine's host work")
    for B in batches:
        split = split_hit_time(engine, [RankRequest(u, hist, cand) for u in range(B)], device, repeats, timer)
        print(f"  batch {B:>2}: {split['total']:7.1f} = {split['model']:7.1f} + {split['attention']:7.1f} + "
              f"{split['engine']:7.1f}")
        suffix = "call" if B == 1 else f"request_b{B}"
        for part in ("model", "attention", "engine"):
            out[f"{part}_us_per_{suffix}{tag}"] = round(split[part], 1)
    return out


def _time(fn, device: torch.device, repeats: int, timer=time.perf_counter) -> float:
    """Median microseconds of one call of ``fn`` on ``timer`` (after one untimed call)."""
    return median_time(fn, device, repeats, warmup=1, timer=timer) * 1e6


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: op counts, L=16 and C=1 only, 5 repeats")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true",
                    help="also time the hit path with the whole model compiled (RelayEngine(compile_model=True); "
                         "compiles first)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = 5 if args.quick else args.repeats
    lengths, cands = ((16,), (1,)) if args.quick else ((16, 256), (1, 64))
    env = environment(str(device))
    # One CPU thread: the thread's CPU time, which other processes on a shared machine barely move; else wall time.
    timer, clock = service_clock(device, args.threads)

    ops = _per_layer(str(device))
    print(f"relaygr bench overhead: HSTU, hidden 64, 2 heads x 32, fp32, {env['device_name']}, {args.threads} "
          f"thread(s), torch backend, {clock}; hit = all but the last {NEW_TOKENS} history tokens cached")
    print(f"aten ops: hit path {ops['hit_ops_per_layer']:.1f}/layer + {ops['hit_ops_per_request']:.1f}/request; "
          f"no cache {ops['uncached_ops_per_layer']:.1f}/layer + {ops['uncached_ops_per_request']:.1f}/request")
    print(f"kernel launches (ops that launch one on a GPU, plus Triton's): hit path "
          f"{ops['hit_launches_per_layer']:.1f}/layer + {ops['hit_launches_per_request']:.1f}/request; no cache "
          f"{ops['uncached_launches_per_layer']:.1f}/layer + {ops['uncached_launches_per_request']:.1f}/request")
    print(f"{'L':>5} {'C':>4} {'batch':>6} {'hit us/req':>11} {'no-cache us/req':>16}"
          + (f" {'hit compiled':>13}" if args.compile else ""))
    model = _model(2, str(device))
    engine = _engine(model, str(device))
    compiled = _engine(model, str(device), compile_model=True) if args.compile else None
    rows, result = [], {}
    for L in lengths:
        hist = synthetic_history(L, 10_000, L, device)
        _cached(engine, range(32), hist)
        if compiled is not None:
            _cached(compiled, range(32), hist)
        for C in cands:
            c = torch.arange(C, device=device)
            for B in (1,) if args.quick else (1, 8, 32):
                reqs = [RankRequest(u, hist, c) for u in range(B)]
                hit = _time(lambda: engine.rank_with_prefix_batch(reqs), device, repeats, timer) / B
                full = _time(lambda: [model.rank_uncached(hist, c) for _ in range(B)], device, repeats, timer) / B
                row = dict(L=L, C=C, batch=B, hit_us_per_request=hit, uncached_us_per_request=full)
                line = f"{L:>5} {C:>4} {B:>6} {hit:>11.1f} {full:>16.1f}"
                if compiled is not None:
                    compiled.rank_with_prefix_batch(reqs)  # compile outside the timed calls
                    row["hit_compiled_us_per_request"] = _time(
                        lambda: compiled.rank_with_prefix_batch(reqs), device, repeats, timer) / B
                    line += f" {row['hit_compiled_us_per_request']:>13.1f}"
                rows.append(row)
                print(line)
    by = {(r["L"], r["C"], r["batch"]): r for r in rows}
    result.update(ops_per_layer=round(ops["hit_ops_per_layer"], 1),
                  ops_per_request=round(ops["hit_ops_per_request"], 1),
                  launches_per_layer=round(ops["hit_launches_per_layer"], 1),
                  launches_per_request=round(ops["hit_launches_per_request"], 1),
                  uncached_ops_per_layer=round(ops["uncached_ops_per_layer"], 1),
                  us_per_call=round(by[(16, 1, 1)]["hit_us_per_request"], 1))
    if (16, 1, 32) in by:
        result["us_per_request_b32"] = round(by[(16, 1, 32)]["hit_us_per_request"], 1)
    if compiled is not None:
        if compiled.stats()["compile_failures"]:
            print("note: the model could not be compiled; the compiled column ran it eagerly")
        result["us_per_call_compiled"] = round(by[(16, 1, 1)]["hit_compiled_us_per_request"], 1)
        if (16, 1, 32) in by:
            result["us_per_request_b32_compiled"] = round(by[(16, 1, 32)]["hit_compiled_us_per_request"], 1)
    batches = (1,) if args.quick else (1, 32)
    result.update(_split(engine, device, repeats, timer, batches))
    if compiled is not None:
        result.update(_split(compiled, device, repeats, timer, batches, "_compiled"))
    result.update(device=str(device), threads=args.threads, clock=clock.split(" (")[0].replace(" ", "_"))
    emit_result(result, args.json, extra=dict(environment=env, rows=rows, op_counts=ops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
