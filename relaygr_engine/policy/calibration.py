"""``relaygr calibrate``: measure the full-inference latency profile the sequence-aware trigger uses.

Builds a ranker (``build_ranker(GRModelConfig(...), seed=0)``, the shape given on the command line), times
``model.rank_full(history, candidates)`` on random behaviors over a grid of history lengths ``L`` and candidate
counts ``C``, fits ``t(L, C) = a + b*(L+C) + c*(L+C)^2 + d*C*L`` (non-negative least squares) and writes the
profile JSON (device, torch version, model configuration, points, coefficients, fit quality)::

    relaygr calibrate --device cpu --out latency_cpu.json
    relaygr calibrate --device cuda --num-layers 4 --hidden-dim 256 --max-seq-len 4096 --out latency_cuda.json

Load it with ``relaygr_engine.policy.LatencyModel.load(path)``. Each point records a quantile of its repeats
(``--quantile``, default 0.9: toward the tail, since the trigger guards a P99 objective). Repeats run in rounds over
the grid so drift of a shared machine spreads over all points.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import time
from typing import Callable, Optional

import torch

from ..cli_args import ArgumentParser, POSITIVE_INTS
from .latency import LatencyModel, calibrate
from ..results import emit_result, environment

__all__ = ["main", "measure"]


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="relaygr calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    m = p.add_argument_group("model (defaults: the GRModelConfig example of the README)")
    m.add_argument("--attention", default="hstu", choices=["hstu", "softmax"])
    m.add_argument("--num-layers", type=int, default=2)
    m.add_argument("--hidden-dim", type=int, default=64)
    m.add_argument("--num-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=32)
    m.add_argument("--num-items", type=int, default=1000)
    m.add_argument("--num-actions", type=int, default=4)
    m.add_argument("--max-seq-len", type=int, default=1024)
    m.add_argument("--num-tasks", type=int, default=2)
    g = p.add_argument_group("grid and timing")
    g.add_argument("--lengths", type=POSITIVE_INTS, default=None,
                   help="history lengths, comma-separated (default: 1/32 .. 1 of --max-seq-len, 7 values)")
    g.add_argument("--candidates", type=POSITIVE_INTS, default=[16, 64, 128, 256],
                   help="candidate counts (16,64,128,256)")
    g.add_argument("--repeats", type=int, default=5, help="timed calls per point (5)")
    g.add_argument("--warmup", type=int, default=1, help="untimed calls per point first (1)")
    g.add_argument("--quantile", type=float, default=0.9, help="quantile of the repeats a point records (0.9)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g.add_argument("--timer", default="wall", choices=["wall", "thread"],
                   help="wall: elapsed time (default; what serving sees). thread: CPU time of the calling thread "
                        "(CPU device with --threads 1 only), which leaves out time other processes take on a "
                        "shared machine")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="profile JSON to write (default: latency_<device type>.json)")
    p.add_argument("--json", default=None, help="also write the RESULT numbers as JSON")
    p.add_argument("--note", default=None, help="free text recorded in the profile (how and why it was measured)")
    return p


def _jsonable(cfg) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = v.value if isinstance(v, enum.Enum) else v
    return out


def measure(model, lengths, cand_counts, *, repeats: int = 5, warmup: int = 1, quantile: float = 0.9,
            seed: int = 0, timer: Callable[[], float] = time.perf_counter,
            meta: Optional[dict] = None) -> LatencyModel:
    """Calibrate a :class:`LatencyModel` on ``model.rank_full`` over ``lengths x cand_counts``.

    Inputs are generated before timing (random items, actions and increasing timestamps, ``seed``), so a timed
    call is exactly one ``rank_full`` under ``torch.inference_mode`` (plus a device synchronize on CUDA).
    """
    from ..models import Behaviors

    cfg = model.config
    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    hist, cands = {}, {}
    for L in lengths:
        ts = torch.sort(torch.randint(0, 10 ** 8, (L,), generator=gen)).values
        hist[L] = Behaviors(item_ids=torch.randint(0, cfg.num_items, (L,), generator=gen).to(dev),
                            action_ids=torch.randint(0, cfg.num_actions, (L,), generator=gen).to(dev),
                            timestamps=ts.to(dev))
    for C in cand_counts:
        cands[C] = torch.randint(0, cfg.num_items, (C,), generator=gen).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run(L: int, C: int) -> None:
        with torch.inference_mode():
            model.rank_full(hist[L], cands[C])
        sync()

    return calibrate(run, lengths, cand_counts, repeats, warmup=warmup, quantile=quantile, timer=timer,
                     device=dev.type, meta=meta)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from ..models import GRModelConfig, build_ranker

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        cfg = GRModelConfig(attention=args.attention, num_layers=args.num_layers, hidden_dim=args.hidden_dim,
                            num_heads=args.num_heads, head_dim=args.head_dim, num_items=args.num_items,
                            num_actions=args.num_actions, max_seq_len=args.max_seq_len, num_tasks=args.num_tasks)
    except ValueError as exc:
        print(f"relaygr calibrate: {exc}", file=sys.stderr)
        return 2
    lengths = args.lengths or sorted({max(1, cfg.max_seq_len * k // 32) for k in (1, 4, 8, 12, 16, 24, 32)})
    bad = [L for L in lengths if not 1 <= L <= cfg.max_seq_len]
    if bad:
        print(f"relaygr calibrate: --lengths must be in [1, max_seq_len={cfg.max_seq_len}], got {bad}",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if args.timer == "thread" and (device.type != "cpu" or torch.get_num_threads() != 1):
        print(f"relaygr calibrate: --timer thread needs --device cpu and --threads 1, got device={device}, "
              f"threads={torch.get_num_threads()}", file=sys.stderr)
        return 2
    model = build_ranker(cfg, seed=0, device=device)
    env = environment(str(device))
    meta = {"torch_version": torch.__version__, "device_name": env["device_name"], "threads": env["threads"],
            "date": env["date"], "commit": env["commit"], "model_config": _jsonable(cfg),
            "timer": "time.thread_time" if args.timer == "thread" else "time.perf_counter",
            "measured": "GRRanker.rank_full (no cache), inference_mode, random behaviors"}
    if args.note:
        meta["note"] = args.note
    print(f"calibrating rank_full on {env['device_name']} ({device}, torch {torch.__version__}, "
          f"{env['threads']} threads): {len(lengths)} lengths x {len(args.candidates)} candidate counts, "
          f"{args.repeats} repeats, q{args.quantile:g}, {args.timer} time")
    try:
        prof = measure(model, lengths, args.candidates, repeats=args.repeats, warmup=args.warmup,
                       quantile=args.quantile, seed=args.seed,
                       timer=time.thread_time if args.timer == "thread" else time.perf_counter, meta=meta)
    except ValueError as exc:
        print(f"relaygr calibrate: {exc}", file=sys.stderr)
        return 2
    print(f"{'L':>6} {'C':>5} {'measured_ms':>12} {'fit_ms':>9} {'err_%':>7}")
    for p in prof.points:
        fit = prof.predict_ms(p.history_len, p.num_candidates)
        print(f"{p.history_len:>6} {p.num_candidates:>5} {p.ms:>12.3f} {fit:>9.3f} "
              f"{100 * (fit - p.ms) / max(p.ms, 1e-9):>7.1f}")
    a, b, c, d = prof.coefficients
    print(f"t_ms(L, C) = {a:.4g} + {b:.4g}*(L+C) + {c:.4g}*(L+C)^2 + {d:.4g}*C*L")
    out = args.out or f"latency_{device.type}.json"
    prof.save(out)
    print(f"wrote {out}")
    fit = prof.meta["fit"]
    emit_result({"device": str(device), "points": len(prof.points), "a_ms": a, "b_ms": b, "c_ms": c, "d_ms": d,
                 "rmse_ms": fit["rmse_ms"], "max_rel_err": fit["max_rel_err"], "out": out},
                json_path=args.json, extra={"profile": prof.to_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
