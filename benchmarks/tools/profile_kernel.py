"""Profile one call of the paged prefix-attention kernel at a shape of your choice on CUDA, for Nsight Compute.

The call is warmed up first (its variants compiled and autotuned: hundreds of launches), then run once between
``cudaProfilerStart``/``Stop`` and nothing else, so ncu measures just that call's launches (the history tiles', the
candidate tiles' and, with split prefixes, the merge's). The default shape is the long HSTU shape of
``relaygr bench kernels`` at head dim 256 (4 users, 16384 cached keys each, 32 new rows and 1024 candidates):

    ncu --profile-from-start off --kernel-name regex:prefix_attention --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis python benchmarks/tools/profile_kernel.py [--shape SPEC] [--mode hstu]
"""
from __future__ import annotations

import argparse

import torch

from relaygr_engine.bench.kernel_shapes import parse_shape
from relaygr_engine.bench.kernels import problem
from relaygr_engine.kernels.prefix_attention import plan_prefix_attention, prefix_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="B=4,P=16384,n=32,C=1024,H=4,D=256",
                    help="users, cached prefix, new rows, candidates, heads, head dim (as bench kernels --shape)")
    ap.add_argument("--mode", default="hstu", choices=("hstu", "softmax"))
    ap.add_argument("--splits", type=int, default=None, help="split-prefix programs per tile (default: the rule)")
    ap.add_argument("--page-reads", default="auto", choices=("auto", "pointers", "tma"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    try:
        shape = parse_shape(args.shape, args.mode)
    except ValueError as exc:
        ap.error(f"--shape: {exc}")
    device = torch.device("cuda")
    a, kw = problem(shape, device, torch.bfloat16, contiguous=False)
    meta = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")
    plan = plan_prefix_attention(**{n: a[n] for n in meta}, kv_cache=a["kv_cache"])
    call = lambda: prefix_attention(**a, **kw, plan=plan, splits=args.splits, page_reads=args.page_reads)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one call: {shape.name}, {plan.num_tiles} tiles x {shape.heads} heads")


if __name__ == "__main__":
    main()
