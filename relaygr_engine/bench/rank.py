"""``relaygr bench rank``: full inference vs ranking against a cached prefix, over history length and candidates.

For each history length ``L`` and candidate count ``C`` it times, end to end from Python (median of ``--repeats``
interleaved runs after a warm-up):

* ``full``: ``model.rank_full(history, candidates)``, dense masked attention over all ``L + C`` tokens (the no-cache
  baseline the issue names);
* ``recompute``: ``engine.rank_with_prefix`` for a user with nothing cached, i.e. the same paged op with an empty
  prefix (causal blocks, no masked-out work): the conservative baseline, isolating what the cache itself saves;
* ``cached``: ``engine.rank_with_prefix`` where the first ``L - new`` tokens were pre-inferred (``prefill_prefix``,
  not timed) and only the last ``new`` tokens (default 16) plus the candidates are computed.

Scores of all three are checked to agree. With ``--cuda-graphs`` a second engine serves ``recompute`` and
``cached`` again through CUDA graphs (:mod:`relaygr_engine.engine.graphs`), timed in the same runs, after the
warm-up captured them: ``graph_speedup`` is graphed recompute (full inference through the same kernels) over
graphed cached, ``graph_speedup_vs_dense`` the eager dense ``full`` over graphed cached, ``graph_gain`` eager cached
over graphed cached (:func:`graph_result`). Every timed run above is a latency: the device synchronised before the
call and after it (a ranking returns its scores on the device without waiting for them). After the interleaved runs
the graphed cached ranking runs ``--repeats`` times back to back (:func:`back_to_back_ms`), twice:
``graph_cached_b2b_wait_ms`` synchronises after each call (a warm ranking's latency, nothing else run between), and
``graph_cached_b2b_ms`` only after the last, so each ranking's host work overlaps the previous one's GPU work (a
stream of rankings' time per ranking, not a latency: the three differ, e.g. 1.30, 1.14 and 0.80 ms at NVIDIA's shape;
measured: ``benchmarks/results/gpu-h100-2026-11-26/``). With ``--compile`` every path
runs the whole model compiled (``torch.compile(fullgraph=True, dynamic=True)``: the engines with
``compile_model=True``, ``full`` through the compiled dense forward); the warm-up compiles and is not timed. NVIDIA's
shape with both::

    relaygr bench rank --device cuda --model nvidia-hstu --page-size 64 \
        --lengths 4096 --new 128 --candidates 256 --compile --cuda-graphs

Model: HSTU (or ``--attention softmax``) of the ``--model`` preset's size (default ``small``: 2 layers, hidden 64,
2 heads x 32, float32), any of ``--layers/--hidden/--heads/--head-dim/--dtype`` replacing it (the KV pages use the
model's dtype, or with ``--kv-dtype int8`` / ``fp8_e4m3`` the 8-bit format of :mod:`relaygr_engine.quant`: the
RESULT's ``kv8_read`` names the path that read them, ``kernel`` or ``torch``,
:func:`~relaygr_engine.quant.kernel_runs`). NVIDIA's public HSTU inference shape (``--model nvidia-hstu``: 8 layers,
4 heads x 256, bf16; a 4096-token block with 3968 cached and 256 candidates) is::

    relaygr bench rank --device cuda --model nvidia-hstu --page-size 64 --lengths 4096 --new 128 --candidates 256

    relaygr bench rank [--quick] [--json PATH] [--attention hstu|softmax] [--new N] [--repeats N]
                       [--threads N] [--device cpu|cuda] [--backend auto|torch|triton] [--model PRESET]
                       [--layers N] [--hidden N] [--heads H] [--head-dim D] [--dtype D] [--page-size N]
                       [--lengths L,L,...] [--candidates C,C,...] [--compile] [--cuda-graphs]
                       [--kv-dtype model|int8|fp8_e4m3]

On CUDA the RESULT also says whether the sm_90 kernel served (``RELAYGR_HOPPER_KERNEL=1``): ``hopper_launches``
(its launches: eager calls and graph captures) and ``hopper_failed`` (1: it failed, the portable kernel ran, the
reason printed).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..batch import RelayBatch
from ..cli_args import ArgumentParser, POSITIVE_INT, POSITIVE_INTS, add_model_arguments, model_shape
from ..config import CacheConfig
from ..engine import RelayEngine
from ..models import build_ranker
from . import autotune_report
from .common import emit_result, environment, percentile, synthetic_history

LENGTHS = (256, 1024, 4096)
CANDIDATES = (64, 256)


def graph_result(L: int, C: int, *, full_ms: float, cached_ms: float, graph_full_ms: float,
                 graph_cached_ms: float) -> dict:
    """The RESULT fields of the graphed runs at ``L`` tokens and ``C`` candidates: ``graph_speedup`` is full
    inference over the cached ranking with both graphed and the same kernels (the engine's no-cache forward,
    ``recompute``: what the ranking would cost without a cache), ``graph_speedup_vs_dense`` the eager dense
    ``full`` over the graphed cached ranking, ``graph_gain`` the eager cached ranking over the graphed one."""
    at = f"_L{L}_C{C}"
    return {f"graph_cached_ms{at}": round(graph_cached_ms, 2), f"graph_recompute_ms{at}": round(graph_full_ms, 2),
            f"graph_speedup{at}": round(graph_full_ms / graph_cached_ms, 2),
            f"graph_speedup_vs_dense{at}": round(full_ms / graph_cached_ms, 2),
            f"graph_gain{at}": round(cached_ms / graph_cached_ms, 2)}


def _time(fn, device: torch.device):
    """(milliseconds, result) of one call of ``fn``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3, out


def back_to_back_ms(fn, device: torch.device, n: int, wait_each: bool = False) -> float:
    """Milliseconds per call of ``n`` calls of ``fn`` one after the other, the device synchronised before the
    first and after the last, and with ``wait_each`` after every call (each call's latency; without it a call's
    host work overlaps the device work the previous calls queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        if wait_each and device.type == "cuda":
            torch.cuda.synchronize(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3 / n


def kv8_read(cache: CacheConfig, device: torch.device) -> str:
    """The path that reads a ranking's 8-bit pages: ``kernel`` (the Triton kernel) or ``torch``."""
    from .. import quant
    from ..attention.ops import _resolve_backend

    triton = _resolve_backend(cache.attention_backend, device).value == "triton"
    return "kernel" if triton and quant.kernel_runs(device) else "torch"


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench rank", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: L in {256, 1024}, C = 64, 1 repeat")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    ap.add_argument("--attention", default="hstu", choices=["hstu", "softmax"])
    ap.add_argument("--new", type=int, default=16, help="history tokens not in the cached prefix (default 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--lengths", type=POSITIVE_INTS, default=None, metavar="L,L,...",
                    help=f"history lengths (default {','.join(map(str, LENGTHS))})")
    ap.add_argument("--candidates", type=POSITIVE_INTS, default=None, metavar="C,C,...",
                    help=f"candidate counts (default {','.join(map(str, CANDIDATES))})")
    ap.add_argument("--page-size", type=POSITIVE_INT, default=16, help="tokens per KV page (default 16)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also time recompute and cached through CUDA graphs (a CUDA device, the Triton backend)")
    ap.add_argument("--compile", action="store_true",
                    help="run the whole model compiled on every path (torch.compile, fullgraph, dynamic shapes)")
    ap.add_argument("--kv-dtype", default="model", choices=("model", "int8", "fp8_e4m3"),
                    help="the prefix pages' format: the model's dtype, or 8-bit values with a scale per token and head")
    add_model_arguments(ap)
    args = ap.parse_args(argv)
    shape = model_shape(ap, args)
    if args.cuda_graphs and (args.device == "cpu" or args.backend == "torch"):
        ap.error("--cuda-graphs needs --device cuda and the Triton backend (--backend auto or triton)")
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths, cands = ((256, 1024), (64,)) if args.quick else (LENGTHS, CANDIDATES)
    lengths = args.lengths or lengths
    cands = args.candidates or cands
    repeats = 1 if args.quick else max(1, args.repeats)
    device = torch.device(args.device)
    if device.type == "cuda":
        autotune_report.record_timings()  # each autotuned variant's candidates, timed, for the report at the end

    dtype, ps = shape.torch_dtype, args.page_size
    cfg = shape.config(attention=args.attention, num_items=10_000, num_actions=4, max_seq_len=max(lengths),
                       num_tasks=2)
    model = build_ranker(cfg, seed=0, device=device, dtype=dtype)
    pages = sum(-(-L // ps) for L in lengths) + 16
    cache = CacheConfig(device=str(device), page_size=ps, num_pages=pages, dtype=dtype, max_pinned_fraction=1.0,
                        lease_ttl_s=3600.0, attention_backend=args.backend, kv_dtype=args.kv_dtype)
    engine = RelayEngine(model, cache, extend_on_rank=False, compile_model=args.compile)
    graphed = (RelayEngine(model, cache, extend_on_rank=False, cuda_graphs=True, compile_model=args.compile)
               if args.cuda_graphs else None)
    full_model = torch.compile(model, fullgraph=True, dynamic=True) if args.compile else model

    @torch.inference_mode()
    def rank_full(hist, c):
        model.check_inputs(hist, c)
        return full_model(RelayBatch.full(hist, c, device=device))
    env = environment(str(device))
    print(f"relaygr bench rank: {args.attention}, {args.model} model: {shape.describe()}, page {ps}, "
          f"{env['device_name']}, {env['threads']} threads, prefix = L - {args.new}, "
          f"{'compiled' if args.compile else 'eager'}, pages {args.kv_dtype}, "
          f"median of {repeats} (after a warm-up)")
    print(f"{'L':>6} {'C':>5} {'cached':>7} {'full ms':>10} {'recomp ms':>10} {'cached ms':>10} "
          f"{'vs full':>8} {'vs recomp':>9} {'max|diff|':>10}")
    result: dict = {}
    rows = []
    worst = 0.0
    for i, L in enumerate(lengths):
        hist = synthetic_history(L, cfg.num_items, seed=i)
        prefix = max(1, L - args.new)
        ticket = engine.prefill_prefix(user_id=i, history=hist.prefix(prefix))
        if not ticket.admitted:
            raise RuntimeError(f"prefill of {prefix} tokens was not admitted: {ticket.reason}")
        if graphed is not None:
            graphed.prefill_prefix(user_id=i, history=hist.prefix(prefix))
        for C in cands:
            c = torch.randint(0, cfg.num_items, (C,), generator=torch.Generator().manual_seed(C))  # on the host
            full_ms, recompute_ms, cached_ms, graph_re_ms, graph_ms = [], [], [], [], []
            for r in range(repeats + 1):  # run 0 warms up
                t_full, full = _time(lambda: rank_full(hist, c), device)
                t_re, miss = _time(lambda: engine.rank_with_prefix(user_id=1000 + i, history=hist, candidates=c),
                                   device)
                t_cached, res = _time(lambda: engine.rank_with_prefix(user_id=i, history=hist, candidates=c), device)
                if res.source != "hbm" or res.cached_tokens != prefix or miss.source != "recompute":
                    raise RuntimeError(f"expected a hit of {prefix} tokens and a miss, got {res.source} "
                                       f"{res.cached_tokens} and {miss.source}")
                if graphed is not None:
                    t_gre, gmiss = _time(lambda: graphed.rank_with_prefix(user_id=1000 + i, history=hist,
                                                                          candidates=c), device)
                    t_g, gres = _time(lambda: graphed.rank_with_prefix(user_id=i, history=hist, candidates=c), device)
                    if gres.source != "hbm" or gmiss.source != "recompute":
                        raise RuntimeError(f"graphs: expected a hit and a miss, got {gres.source} and {gmiss.source}")
                if r:
                    full_ms.append(t_full)
                    recompute_ms.append(t_re)
                    cached_ms.append(t_cached)
                    if graphed is not None:
                        graph_re_ms.append(t_gre)
                        graph_ms.append(t_g)
            outs = [res, miss] + ([gres, gmiss] if graphed is not None else [])
            diff = max(float((o.scores.float() - full.float()).abs().max()) for o in outs)
            worst = max(worst, diff)
            f, rc, k = (percentile(x, 50) for x in (full_ms, recompute_ms, cached_ms))
            rows.append(dict(L=L, C=C, cached_tokens=prefix, full_ms=f, recompute_ms=rc, cached_ms=k,
                             speedup=f / k, speedup_vs_recompute=rc / k, max_abs_diff=diff))
            print(f"{L:>6} {C:>5} {prefix:>7} {f:>10.2f} {rc:>10.2f} {k:>10.2f} {f / k:>7.1f}x {rc / k:>8.1f}x "
                  f"{diff:>10.2e}")
            result[f"speedup_L{L}_C{C}"] = round(f / k, 2)
            result[f"speedup_vs_recompute_L{L}_C{C}"] = round(rc / k, 2)
            result[f"full_ms_L{L}_C{C}"] = round(f, 2)
            result[f"recompute_ms_L{L}_C{C}"] = round(rc, 2)
            result[f"cached_ms_L{L}_C{C}"] = round(k, 2)
            if graphed is not None:
                g, gr = percentile(graph_ms, 50), percentile(graph_re_ms, 50)
                again = lambda: graphed.rank_with_prefix(user_id=i, history=hist, candidates=c)  # noqa: E731
                b2b_wait = back_to_back_ms(again, device, repeats, wait_each=True)
                b2b = back_to_back_ms(again, device, repeats)
                rows[-1].update(graph_cached_ms=g, graph_recompute_ms=gr, graph_cached_b2b_wait_ms=b2b_wait,
                                graph_cached_b2b_ms=b2b)
                print(f"{'':>6} {'':>5} {'graphs':>7} {'':>10} {gr:>10.2f} {g:>10.2f} {f / g:>7.1f}x {gr / g:>8.1f}x "
                      f"{'':>10} (cached eager / graphs {k / g:.2f}x; cached back to back: {b2b_wait:.2f} ms each "
                      f"waited for, {b2b:.2f} ms overlapped)")
                result.update(graph_result(L, C, full_ms=f, cached_ms=k, graph_full_ms=gr, graph_cached_ms=g))
                result[f"graph_cached_b2b_wait_ms_L{L}_C{C}"] = round(b2b_wait, 2)
                result[f"graph_cached_b2b_ms_L{L}_C{C}"] = round(b2b, 2)
    fallbacks = sum(e.stats()["compile_failures"] for e in (engine, graphed) if e is not None)
    if fallbacks:
        print(f"note: {fallbacks} engine(s) could not compile the model and ran it eagerly")
    result.update(max_abs_diff=worst, compiled=args.compile and not fallbacks, attention=args.attention,
                  model=args.model, layers=shape.num_layers, hidden=shape.hidden_dim, heads=shape.num_heads,
                  head_dim=shape.head_dim, dtype=shape.dtype, kv_bytes_per_token=shape.kv_bytes_per_token,
                  device=str(device), threads=env["threads"], kv_dtype=args.kv_dtype)
    if cache.kv_dtype.quantized:
        result["kv8_read"] = kv8_read(cache, device)
    if device.type == "cuda":
        result.update(autotune_report.hopper_fields())
    tuned = autotune_report.print_variants()  # which configs won on this device (CUDA), and by how much
    emit_result(result, args.json, extra=dict(environment=env, rows=rows, new_tokens=args.new, repeats=repeats,
                                              autotuned=tuned))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
