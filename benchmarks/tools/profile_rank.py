"""Profile one cached ranking at NVIDIA's public HSTU inference shape on CUDA (where its time goes).

8 layers, 4 heads x 256, bf16, a 4096-token history of which 3968 are cached, 256 candidates: prints the device
kernels by total CUDA time, the host-side aten ops by CPU time (torch.profiler), and the engine's Python functions
by cumulative time (cProfile), each for ``--calls`` warmed-up rankings. A ranking returns its scores on the device
without waiting for them, so rankings run back to back overlap one's host work with the previous one's GPU work; the
script times them both ways (waited for after each call, and only after the last). With ``--interleave`` it also
times and profiles each ranking after a dense full inference and a miss (as ``relaygr bench rank`` interleaves its
paths), waited for, its GPU busy time counted within the ranking's own call and wait. With
``--cuda-profiler-window`` it runs one warmed-up ranking between ``cudaProfilerStart``/``Stop`` and nothing else,
for Nsight Compute to measure just that ranking's kernels (warm-up and autotuning launch the kernel hundreds of times
before):

    python benchmarks/tools/profile_rank.py [--calls 5] [--cuda-graphs]
    ncu --profile-from-start off --kernel-name regex:prefix_attention --section SpeedOfLight \
        python benchmarks/tools/profile_rank.py --cuda-profiler-window
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import relaygr_engine as rg
from relaygr_engine.bench import autotune_report
from relaygr_engine.bench.common import percentile, synthetic_history


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` spans: the time a device was busy with any of them."""
    busy, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return busy


def within(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The ``(start, end)`` spans that lie inside one of the ``windows`` (a call's host span and its wait for the
    device: the kernels it launched)."""
    return [(a, b) for a, b in spans if any(lo <= a and b <= hi for lo, hi in windows)]


def interleaved(rank, other, calls: int) -> None:
    """Each of ``calls`` rankings timed and profiled alone after ``other()`` (other paths' work, as bench rank
    interleaves them): the median time per ranking and the GPU busy time within its calls."""
    times = []
    for _ in range(calls):
        other()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rank()
        torch.cuda.synchronize()  # (its scores: a ranking returns without waiting for its GPU work)
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"per ranking after a full inference and a miss: median {percentile(times, 50):.2f} ms "
          f"(min {min(times):.2f}, max {max(times):.2f})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            other()
            torch.cuda.synchronize()
            with torch.profiler.record_function("relaygr.ranking"):
                rank()
                torch.cuda.synchronize()
    events = prof.events()
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == "relaygr.ranking"]
    spans = within([(e.time_range.start, e.time_range.end) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA], windows)
    print(f"GPU busy within those rankings: {busy_us(spans) / calls:.1f} us per ranking, "
          f"{sum(b - a for a, b in windows) / calls:.1f} us of host span")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="rank through CUDA graphs (RelayEngine(cuda_graphs=True)), as bench rank's graph_cached_ms: "
                         "the profile then shows the host work around each replay")
    ap.add_argument("--interleave", action="store_true",
                    help="also time and profile each ranking after a dense full inference and a miss, as bench rank "
                         "interleaves them (it measured 2.18 ms where back to back took 1.18 ms, run 3)")
    ap.add_argument("--cuda-profiler-window", action="store_true",
                    help="run one warmed-up ranking inside cudaProfilerStart/Stop (for ncu --profile-from-start off)")
    args = ap.parse_args()
    autotune_report.record_timings()
    L, new, C = 4096, 128, 256
    cfg = rg.GRModelConfig(attention="hstu", num_layers=8, hidden_dim=1024, num_heads=4, head_dim=256,
                           num_items=10_000, num_actions=4, max_seq_len=L, num_tasks=2)
    model = rg.build_ranker(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    engine = rg.RelayEngine(model, rg.CacheConfig(device="cuda", page_size=64, num_pages=160, dtype=torch.bfloat16,
                                                  max_pinned_fraction=1.0, lease_ttl_s=3600.0),
                            extend_on_rank=False, cuda_graphs=args.cuda_graphs)
    hist = synthetic_history(L, 10_000, seed=0)
    cands = torch.randint(0, 10_000, (C,), generator=torch.Generator().manual_seed(1))
    engine.prefill_prefix(1, hist.prefix(L - new))
    rank = (lambda: engine.rank_with_prefix(1, hist, cands))
    for _ in range(3):
        rank()
    torch.cuda.synchronize()
    if args.cuda_profiler_window:
        torch.cuda.profiler.start()
        rank()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    for wait_each in (True, False):  # (a ranking returns its scores on the device without waiting for them)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            rank()
            if wait_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
        how = ("each waited for (latency)" if wait_each
               else "waited for after the last only (host work overlapping the previous ranking's GPU work)")
        print(f"per ranking: {t_all / args.calls * 1e3:.2f} ms end to end, rankings back to back, {how}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            rank()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    busy, total = busy_us(spans), sum(b - a for a, b in spans)
    print(f"GPU per ranking: busy {busy / args.calls:.1f} us (the union of its kernels' and copies' spans), "
          f"{total / args.calls:.1f} us summed over them ({(total - busy) / args.calls:.1f} us overlapped: launches "
          f"on two streams at once)")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    if args.interleave:
        interleaved(rank, lambda: (model.rank_full(hist, cands), engine.rank_with_prefix(1000, hist, cands)),
                    args.calls)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.calls):
        rank()
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    autotune_report.print_variants()  # the configs the profiled launches ran, and each candidate's time
    print("sm_90 kernel:", autotune_report.hopper_fields())  # (whether it ran, or failed and fell back)


if __name__ == "__main__":
    main()
