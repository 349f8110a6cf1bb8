"""``relaygr bench transfer``: moving one pre-inferred prefix between engines, per prefix length.

Per prefix length L (one pre-infer engine, one ranking engine, the SLO benchmark's model):

* ``MB``: bytes shipped per prefix (all layers' K/V, page-padded, plus the timestamps);
* ``pack ms``: all layers' pages into one contiguous buffer (``PagedKVCache.pack``: Triton ``kv_pack`` on
  CUDA/NPU, the torch reference elsewhere);
* ``copy ms``: that buffer into a new one (what the link between the devices carries, here a host memory copy);
* ``unpack ms``: the buffer into the receiver's pages (``PagedKVCache.unpack``: ``kv_unpack`` / reference);
* ``plain copy ms``: one copy of the same number of bytes between two contiguous buffers (the bandwidth the
  transfer path is compared with), and ``per-page ms``: the same KV copied page by page and layer by layer
  straight into the receiver's pages (the per-block sends packing replaces);
* GB/s of pack + copy + unpack vs the plain copy.

The receiver's pages are checked equal to the sender's once per length. Medians of ``--repeats`` timed calls.
Ends with ``RESULT device=... L=... bytes=... transfer_gbps=... plain_copy_gbps=... transfer_vs_plain=...
per_page_vs_packed=...`` for the longest length.
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

import relaygr_engine as rg

from ..cli_args import POSITIVE_INT, POSITIVE_INTS, ArgumentParser
from ..cli_args import device as device_arg
from .common import emit_result, environment
from .tiers import _time as _time_ms


def _history(L: int, num_items: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(L)
    return rg.Behaviors(item_ids=torch.randint(0, num_items, (L,), generator=g),
                        action_ids=torch.randint(0, 4, (L,), generator=g),
                        timestamps=torch.arange(L, dtype=torch.long) * 60 + 1_600_000_000)


def measure(model, L: int, device: torch.device, page_size: int, repeats: int) -> dict:
    """The numbers of one prefix length (see the module doc)."""
    n_pages = -(-L // page_size)
    cfg = rg.CacheConfig(device=str(device), page_size=page_size, num_pages=n_pages + 2, max_pinned_fraction=1.0,
                         lease_ttl_s=3600.0)
    sender, receiver = rg.RelayEngine(model, cfg), rg.RelayEngine(model, cfg)
    hist = _history(L, model.config.num_items)
    ticket = sender.prefill_prefix(1, hist)
    src = sender.pool.pages_of(1, ticket.fingerprint)
    packed = sender.export_prefix(ticket, hist)
    got = receiver.import_prefix(hist, packed)
    assert got.admitted, got.reason
    dst = receiver.pool.pages_of(1, got.fingerprint)
    for a, b in zip(sender.cache.kv, receiver.cache.kv):
        assert torch.equal(a[torch.as_tensor(src, dtype=torch.long)], b[torch.as_tensor(dst, dtype=torch.long)])
    s_cache, r_cache = sender.cache, receiver.cache
    buf = packed.kv
    pack_ms = _time_ms(lambda: s_cache.pack(src), device, repeats)
    copy_ms = _time_ms(lambda: packed.to(device), device, repeats)
    unpack_ms = _time_ms(lambda: r_cache.unpack(buf, dst), device, repeats)
    plain_src = torch.empty(packed.nbytes, dtype=torch.uint8, device=device)
    plain_dst = torch.empty_like(plain_src)
    plain_ms = _time_ms(lambda: plain_dst.copy_(plain_src), device, repeats)

    def per_page():
        for a, b in zip(s_cache.kv, r_cache.kv):
            for s, d in zip(src.tolist(), dst.tolist()):
                b[d].copy_(a[s])

    per_page_ms = _time_ms(per_page, device, repeats)
    total = pack_ms + copy_ms + unpack_ms
    return dict(L=L, bytes=packed.nbytes, pages=n_pages, pack_ms=pack_ms, copy_ms=copy_ms, unpack_ms=unpack_ms,
                transfer_ms=total, plain_copy_ms=plain_ms, per_page_ms=per_page_ms,
                transfer_gbps=packed.nbytes / total / 1e6, plain_copy_gbps=packed.nbytes / plain_ms / 1e6,
                copies_per_page_path=2 * len(s_cache.kv) * n_pages)


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench transfer", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=POSITIVE_INTS, default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--page-size", type=POSITIVE_INT, default=16)
    ap.add_argument("--repeats", type=POSITIVE_INT, default=5)
    ap.add_argument("--threads", type=POSITIVE_INT, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="smoke run: lengths 256,1024, three repeats")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    args = ap.parse_args(argv)
    lengths = [256, 1024] if args.quick else args.lengths
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = 3 if args.quick else args.repeats
    cfg = rg.GRModelConfig(attention="hstu", num_layers=2, hidden_dim=64, num_heads=2, head_dim=32, num_items=10000,
                           num_actions=4, max_seq_len=max(lengths), num_tasks=2)
    model = rg.build_ranker(cfg, seed=0, device=device)
    env = environment(str(device))
    kernels = "Triton kv_pack/kv_unpack" if device.type in ("cuda", "npu") else "torch reference pack/unpack"
    print(f"relaygr bench transfer on {env['device_name']} ({device}, fp32, {torch.get_num_threads()} threads): "
          f"HSTU 2 layers, 2x32 heads, page {args.page_size}, {kernels}, median of {repeats}")
    print(f"{'L':>6s} {'MB':>7s} {'pack ms':>8s} {'copy ms':>8s} {'unpack ms':>9s} {'GB/s':>7s} "
          f"{'plain copy ms':>13s} {'plain GB/s':>10s} {'per-page ms':>11s}")
    measure(model, min(64, min(lengths)), device, args.page_size, 1)  # warm-up
    rows = []
    for L in lengths:
        r = measure(model, L, device, args.page_size, repeats)
        rows.append(r)
        print(f"{L:6d} {r['bytes'] / 2**20:7.3f} {r['pack_ms']:8.3f} {r['copy_ms']:8.3f} {r['unpack_ms']:9.3f} "
              f"{r['transfer_gbps']:7.2f} {r['plain_copy_ms']:13.3f} {r['plain_copy_gbps']:10.2f} "
              f"{r['per_page_ms']:11.3f}", flush=True)
    last = rows[-1]
    result = {"device": device.type, "L": last["L"], "bytes": last["bytes"],
              "pack_ms": round(last["pack_ms"], 4), "copy_ms": round(last["copy_ms"], 4),
              "unpack_ms": round(last["unpack_ms"], 4), "transfer_gbps": round(last["transfer_gbps"], 3),
              "plain_copy_gbps": round(last["plain_copy_gbps"], 3),
              "transfer_vs_plain": round(last["transfer_gbps"] / last["plain_copy_gbps"], 3),
              "per_page_vs_packed": round(last["per_page_ms"] / last["transfer_ms"], 2)}
    emit_result(result, args.json, {"environment": env, "rows": rows, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
