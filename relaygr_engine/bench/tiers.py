"""``relaygr bench tiers``: reloading a prefix from the DRAM tier vs recomputing it, 256 to 8192 tokens.

Per prefix length L, in one run on one engine:

* ``reload ms``: copying the prefix's packed KV (all layers, one contiguous buffer) from DRAM into device pages
  (:meth:`PagedKVCache.unpack`), the expander's critical-path cost;
* ``recompute ms``: computing the prefix's KV from scratch (``prefill_prefix`` on a cold cache);
* ``rank dram ms`` / ``rank recompute ms``: a whole ranking request (prefix + 16 new tokens + C candidates) whose
  prefix is only in DRAM, vs one with nothing cached, with ``source`` checked; the DRAM hit twice: ``serial``
  copies every layer before the forward, ``layer`` (layer-wise onload, :mod:`relaygr_engine.onload`) copies layer
  ``l + 1`` on a side stream while layer ``l`` computes (on a CPU a stand-in copies each layer when it is needed:
  no overlap, the same work);
* ``rank hbm ms``: the same request with its prefix resident in device memory (an HBM hit), what a DRAM hit is
  measured against (``dram_layer_vs_hbm_L*``: the layer-wise DRAM hit's latency over the HBM hit's);
* on CUDA, the reload's GB/s next to a plain pinned host-to-device copy of the same bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

import torch

import relaygr_engine as rg

from ..cli_args import POSITIVE_INT, POSITIVE_INTS, ArgumentParser, add_model_arguments, model_shape
from ..cli_args import device as device_arg
from .common import emit_result, environment, median_time, synthetic_history

NEW_TOKENS = 16


def _time(fn, device, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms."""
    return median_time(fn, device, repeats) * 1e3


def measure(model, L: int, cands: torch.Tensor, device: torch.device, dtype, page_size: int,
            repeats: int) -> dict[str, float]:
    """Reload vs recompute numbers for one prefix length (see the module docstring)."""
    pages = -(-(L + NEW_TOKENS) // page_size) * 2 + 4
    cfg = rg.CacheConfig(device=str(device), dtype=dtype, page_size=page_size, num_pages=pages,
                         max_pinned_fraction=1.0, lease_ttl_s=3600.0, dram_bytes=1 << 40, onload="serial")
    engine = rg.RelayEngine(model, cfg, extend_on_rank=False)
    layered = rg.RelayEngine(model, dataclasses.replace(cfg, onload="layer"), extend_on_rank=False)
    full = synthetic_history(L + NEW_TOKENS, model.config.num_items, seed=L)
    prefix = full.prefix(L)
    user = 1

    def cold_prefill():
        for fp, _ in engine.pool.entries_of(user):
            engine.pool.free(user, fp)
        t = engine.prefill_prefix(user, prefix)
        engine.pool.release_lease(user, t.fingerprint)

    recompute_ms = _time(cold_prefill, device, repeats)
    engine.rank_with_prefix(user, prefix, cands)  # the entry becomes evictable: spilled to DRAM
    (fp, _), = engine.dram.entries_of(user)
    entry = engine.dram.get(user, fp)
    pages_ids = engine.pool.pages_of(user, fp)
    reload_ms = _time(lambda: engine.cache.unpack(entry.kv, pages_ids), device, repeats)
    nbytes = entry.nbytes

    def rank_from_dram(e=engine):
        for f, _ in e.pool.entries_of(user):
            e.pool.free(user, f)
        r = e.rank_with_prefix(user, full, cands)
        assert r.source == "dram", r.source

    def rank_recompute():
        for f, _ in engine.pool.entries_of(user):
            engine.pool.free(user, f)
        engine.dram.discard(user, fp)
        r = engine.rank_with_prefix(user, full, cands)
        assert r.source == "recompute", r.source
        engine.dram.put(entry)

    rank_dram_ms = _time(rank_from_dram, device, repeats)
    layered.dram.put(entry)
    rank_layer_ms = _time(lambda: rank_from_dram(layered), device, repeats)
    assert layered.stats()["layered_reloads"] == repeats and engine.stats()["layered_reloads"] == 0

    def rank_from_hbm():  # the prefix the last DRAM hit reloaded stays in device memory
        r = layered.rank_with_prefix(user, full, cands)
        assert r.source == "hbm", r.source

    rank_hbm_ms = _time(rank_from_hbm, device, repeats)
    rank_recompute_ms = _time(rank_recompute, device, repeats)
    row = dict(L=L, bytes=nbytes, reload_ms=reload_ms, recompute_ms=recompute_ms,
               rank_dram_ms=rank_dram_ms, rank_dram_layer_ms=rank_layer_ms, rank_hbm_ms=rank_hbm_ms,
               rank_recompute_ms=rank_recompute_ms, reload_gbps=nbytes / reload_ms / 1e6)
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        copy_ms = _time(lambda: dev.copy_(host, non_blocking=True), device, repeats)
        row["h2d_gbps"] = nbytes / copy_ms / 1e6
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench tiers", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=POSITIVE_INTS, default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--candidates", type=POSITIVE_INT, default=64)
    ap.add_argument("--page-size", type=POSITIVE_INT, default=16)
    ap.add_argument("--repeats", type=POSITIVE_INT, default=3)
    ap.add_argument("--threads", type=POSITIVE_INT, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="smoke run: lengths 256,1024, two repeats")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    add_model_arguments(ap)
    args = ap.parse_args(argv)
    shape = model_shape(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = shape.dtype
    lengths = [256, 1024] if args.quick else args.lengths
    repeats = 2 if args.quick else args.repeats
    cfg = shape.config(num_items=10000, num_actions=4, max_seq_len=max(lengths) + NEW_TOKENS, num_tasks=2)
    model = rg.build_ranker(cfg, seed=0, device=device, dtype=shape.torch_dtype)
    cands = torch.randint(0, cfg.num_items, (args.candidates,), generator=torch.Generator().manual_seed(0))
    env = environment(str(device))
    print(f"relaygr bench tiers on {env['device_name']} ({device}, {torch.get_num_threads()} threads): "
          f"HSTU, {args.model} model: {shape.describe()}, page {args.page_size}, C={args.candidates}, "
          f"{NEW_TOKENS} new tokens, median of {repeats}")
    head = f"{'L':>6s} {'MB':>7s} {'reload ms':>10s} {'recompute ms':>13s} {'ratio':>7s} " \
           f"{'rank dram ms':>13s} {'layer-wise ms':>14s} {'rank hbm ms':>12s} {'rank recomp ms':>15s} " \
           f"{'reload GB/s':>12s}"
    print(head + ("  h2d GB/s" if device.type == "cuda" else ""))
    measure(model, 64, cands.to(device), device, dtype, args.page_size, 1)  # warm-up (op registration, caches)
    rows = []
    for L in lengths:
        r = measure(model, L, cands.to(device), device, dtype, args.page_size, repeats)
        rows.append(r)
        line = (f"{L:6d} {r['bytes'] / 2**20:7.2f} {r['reload_ms']:10.3f} {r['recompute_ms']:13.2f} "
                f"{r['recompute_ms'] / r['reload_ms']:6.0f}x {r['rank_dram_ms']:13.2f} {r['rank_dram_layer_ms']:14.2f} "
                f"{r['rank_hbm_ms']:12.2f} {r['rank_recompute_ms']:15.2f} {r['reload_gbps']:12.2f}")
        print(line + (f"  {r['h2d_gbps']:8.2f}" if "h2d_gbps" in r else ""), flush=True)
    last = rows[-1]
    result = {"device": device.type, "max_len": last["L"],
              "reload_ms": round(last["reload_ms"], 4), "recompute_ms": round(last["recompute_ms"], 3),
              "reload_speedup": round(last["recompute_ms"] / last["reload_ms"], 1),
              "rank_speedup_dram_vs_recompute": round(last["rank_recompute_ms"] / last["rank_dram_ms"], 2),
              "rank_dram_serial_ms": round(last["rank_dram_ms"], 3),
              "rank_dram_layer_ms": round(last["rank_dram_layer_ms"], 3),
              "layer_onload_gain": round(last["rank_dram_ms"] / last["rank_dram_layer_ms"], 2),
              "rank_hbm_ms": round(last["rank_hbm_ms"], 3),
              "reload_gbps": round(last["reload_gbps"], 2)}
    for r in rows:  # a DRAM hit's ranking latency over an HBM hit's, layer-wise and serial, at every length
        result[f"dram_layer_vs_hbm_L{r['L']}"] = round(r["rank_dram_layer_ms"] / r["rank_hbm_ms"], 2)
        result[f"dram_serial_vs_hbm_L{r['L']}"] = round(r["rank_dram_ms"] / r["rank_hbm_ms"], 2)
    if "h2d_gbps" in last:
        result["h2d_gbps"] = round(last["h2d_gbps"], 2)
        result["reload_vs_h2d"] = round(last["reload_gbps"] / last["h2d_gbps"], 3)
    emit_result(result, args.json, {"environment": env, "rows": rows, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
