"""Audit the ranking hot path for device-to-host synchronisations (CUDA only).

Runs a warmed-up HBM hit (single and batched, candidates on the host and on the device, both attention backends)
under ``torch.cuda.set_sync_debug_mode("warn")`` and prints, per case, how many synchronising calls were made and
where (the innermost frames inside relaygr_engine).

    python benchmarks/tools/sync_audit.py
"""
from __future__ import annotations

import collections
import traceback
import warnings

import torch

import relaygr_engine as rg
from relaygr_engine.bench.common import synthetic_history


def audit(fn):
    sites = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "relaygr_engine" in f.filename]
        where = " <- ".join(f"{f.filename.split('relaygr_engine/')[-1]}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
        sites[where or f"{filename}:{lineno}"] += 1

    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    return sites


def main():
    for attention in ("hstu", "softmax"):
        cfg = rg.GRModelConfig(attention=attention, num_layers=2, hidden_dim=64, num_heads=2, head_dim=32,
                               num_items=1000, num_actions=4, max_seq_len=256, num_tasks=2)
        model = rg.build_ranker(cfg, seed=0, device="cuda")
        for backend in ("triton", "torch"):
            engine = rg.RelayEngine(model, rg.CacheConfig(device="cuda", page_size=16, num_pages=256,
                                                          lease_ttl_s=3600.0, attention_backend=backend))
            h, h2 = synthetic_history(100, 1000, 1), synthetic_history(90, 1000, 2)
            cands_host = torch.randint(0, 1000, (37,))
            t1 = engine.prefill_prefix(1, h.prefix(80))
            t2 = engine.prefill_prefix(2, h2.prefix(70))
            for cands in (cands_host, cands_host.cuda()):
                where = cands.device.type
                for _ in range(2):  # warm-up (compiles, allocator)
                    engine.rank_with_prefix(1, h, cands, ticket=t1)
                    engine.rank_with_prefix_batch([rg.RankRequest(1, h, cands, t1), rg.RankRequest(2, h2, cands, t2)])
                torch.cuda.synchronize()
                for name, fn in (("single", lambda: engine.rank_with_prefix(1, h, cands, ticket=t1)),
                                 ("batch2", lambda: engine.rank_with_prefix_batch(
                                     [rg.RankRequest(1, h, cands, t1), rg.RankRequest(2, h2, cands, t2)]))):
                    sites = audit(fn)
                    print(f"{attention} {backend} cands={where} {name}: {sum(sites.values())} syncs")
                    for s, n in sites.most_common():
                        print(f"    {n} x {s}")


if __name__ == "__main__":
    main()
