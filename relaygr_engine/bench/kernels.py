"""``relaygr bench kernels``: the paged prefix-attention kernel against its baselines.

Per shape (a batch of users, each with a cached prefix, a few new history tokens and its candidates):

* ``paged``       the Triton kernel over scattered pages (the production layout);
* ``contig``      the same kernel with each user's pages consecutive in memory -> paging overhead;
* ``gathered``    the same attention on contiguous, already gathered K/V: ``torch`` SDPA with the target mask
                  (softmax) or dense torch matmuls with SiLU and the materialised bias (hstu);
* ``recompute``   the kernel with no cache: prefix + new tokens + candidates all recomputed (what caching saves);
* on CUDA also a bf16 matmul of the same FLOPs (the roofline reference) and FlashInfer's paged prefill with a
  custom mask when ``flashinfer`` is installed (softmax only). ``matmul_fraction_long_{softmax,hstu}`` in the RESULT
  line: the geomean, over the long shapes (prefix >= 4096, >= 256 query rows per user, batch >= 4; HSTU with both
  biases), of the kernel's useful TFLOP/s over that matmul's, measured in the same run.

Kernel times exclude the plan (the tile schedule, built once per forward and shared by its layers; FlashInfer's
plan is likewise outside its timing); ``plan_ms`` reports it.

FLOPs count useful work only: ``4 * H * D`` per visible (query, key) pair. Bytes are the minimal traffic: the
cached prefix K/V once plus q, k, v and the output. On the CPU the kernels run in Triton's interpreter with tiny
shapes: a smoke run of the whole path whose timings say nothing about a device.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import sys
from dataclasses import asdict
from typing import Callable, Optional

import torch

from .. import quant
from ..cli_args import POSITIVE_INTS, ArgumentParser
from ..config import SHORT_DTYPE_NAMES, KVDtype
from . import kernels_summary as S
from .device_timing import device_seconds as _time
from .kernel_shapes import CPU_SHAPES, GPU_SHAPES, Shape, parse_shape

__all__ = ["main", "problem", "run_shape"]


# ------------------------------------------------------------------------------------------------ problem set-up
def problem(shape: Shape, device, dtype, *, contiguous: bool, seed: int = 0):
    """Kernel arguments for ``shape``: pages shuffled across the pool, or each user's pages consecutive."""
    g = torch.Generator().manual_seed(seed)
    b, p, n, c, h, d, ps = (shape.users, shape.prefix, shape.new, shape.cands, shape.heads, shape.head_dim,
                            shape.page_size)
    pages_per_user = -(-p // ps)
    num_pages = b * pages_per_user + 1
    order = torch.arange(num_pages - 1) if contiguous else torch.randperm(num_pages - 1, generator=g)
    indices = order.view(b, pages_per_user) if pages_per_user else order.view(b, 0)
    rows = n + c
    total = b * rows
    q, k, v = (torch.randn(total, h, d, generator=g).to(device, dtype) for _ in range(3))
    kv_cache = torch.randn(num_pages, 2, ps, h, d, generator=g).to(device, dtype)
    ts_cache = torch.cumsum(torch.randint(0, 600, (num_pages, ps), generator=g).view(-1), 0).view(num_pages, ps)
    ts_q = torch.full((total,), int(ts_cache.max()) + 60, dtype=torch.int64)
    i32 = lambda x: torch.as_tensor(x, dtype=torch.int32).to(device)  # noqa: E731
    last = p - (pages_per_user - 1) * ps if pages_per_user else 0
    args = dict(q=q, k=k, v=v, kv_cache=kv_cache,
                kv_indptr=i32([u * pages_per_user for u in range(b + 1)]), kv_indices=i32(indices.reshape(-1)),
                kv_last_page_len=i32([last] * b), cu_seqlens_q=i32([u * rows for u in range(b + 1)]),
                num_candidates=i32([c] * b))
    kw = dict(mode=shape.mode, scale=1.0 / math.sqrt(d))
    if shape.mode == "hstu":
        max_len = p + n + 1
        kw.update(hstu_norm=float(max_len), pos_bias=(0.1 * torch.randn(max_len + 1, generator=g)).to(device),
                  ts_bias=(0.1 * torch.randn(32, generator=g)).to(device), ts_cache=ts_cache.to(device),
                  ts_q=ts_q.to(device))
    return args, kw


def _recompute_problem(shape: Shape, device, dtype):
    """No cache: every user's prefix is recomputed as new history rows."""
    full = Shape(shape.users, 0, shape.prefix + shape.new, shape.cands, shape.heads, shape.head_dim,
                 shape.page_size, shape.mode)
    args, kw = problem(full, device, dtype, contiguous=True)
    if shape.mode == "hstu":
        kw["hstu_norm"] = float(shape.prefix + shape.new + 1)
    return args, kw


def _gathered(args, kw, shape: Shape):
    """Contiguous K/V per user ``[B, H, P + n + C, D]``, queries ``[B, H, n + C, D]`` and the dense mask/bias."""
    from relaygr_engine.kernels.reference import time_bucket_ref, visible_mask_ref

    b, p, n, c, ps = shape.users, shape.prefix, shape.new, shape.cands, shape.page_size
    rows = n + c
    device = args["q"].device
    pages = args["kv_indices"].long().view(b, -1)
    tok = torch.arange(p, device=device)
    page_of = pages[:, tok // ps]                                           # [B, P]
    slot_of = (tok % ps).expand(b, p)
    seg = lambda x: x.view(b, rows, shape.heads, shape.head_dim)  # noqa: E731
    k = torch.cat([args["kv_cache"][page_of, 0, slot_of], seg(args["k"])], 1).transpose(1, 2).contiguous()
    v = torch.cat([args["kv_cache"][page_of, 1, slot_of], seg(args["v"])], 1).transpose(1, 2).contiguous()
    q = seg(args["q"]).transpose(1, 2).contiguous()
    mask = visible_mask_ref(p, n, c, device)                                # [rows, P + rows]
    rab = None
    if shape.mode == "hstu":
        q_pos = p + torch.arange(rows, device=device).clamp_max(n)
        k_pos = torch.cat([torch.arange(p, device=device), q_pos])
        dist = (q_pos[:, None] - k_pos[None, :]).clamp(0, kw["pos_bias"].numel() - 1)
        t_q = kw["ts_q"].view(b, rows)
        t_k = torch.cat([kw["ts_cache"][page_of, slot_of], t_q], 1)          # [B, P + rows]
        bucket = time_bucket_ref(t_q[:, :, None] - t_k[:, None, :], kw["ts_bias"].numel())
        rab = (kw["pos_bias"][dist] + kw["ts_bias"][bucket]).unsqueeze(1).to(q.dtype)  # [B, 1, rows, keys]
    return q, k, v, mask, rab


def _dense_baseline(q, k, v, mask, rab, kw):
    """The attention on gathered K/V with torch: SDPA (softmax) or dense SiLU attention (hstu). [B, H, rows, D]."""
    if kw["mode"] == "softmax":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kw["scale"])
    s = torch.matmul(q, k.transpose(-1, -2)) * kw["scale"] + rab
    w = (torch.nn.functional.silu(s) * mask) / kw["hstu_norm"]
    return torch.matmul(w.to(v.dtype), v)


# ------------------------------------------------------------------------------------------------ timing
_MATMUL_READINGS = 3  # the reference is the best of this many medians: one slow reading must not flatter a row


def _matmul_tflops(flops: float, device, dtype, warmup: int, iters: int) -> float:
    """TFLOP/s of a bf16 ``[4096, K] x [K, 4096]`` matmul with about ``flops`` FLOPs (the roofline reference).

    The best of ``_MATMUL_READINGS`` median times, each over ``iters`` runs: an attainable rate, so a transient
    slowdown of the GPU during one reading (seen once on an H100: 249 TFLOP/s against 530 for the same matmul
    the row before) does not inflate the row's ``matmul_fraction``.
    """
    m = n = 4096
    k = max(64, int(round(flops / (2 * m * n) / 64)) * 64)
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    t = min(_time(lambda: torch.matmul(a, b), device, warmup, iters) for _ in range(_MATMUL_READINGS))
    return 2 * m * n * k / t / 1e12


def _flashinfer_time(shape: Shape, args, kw, warmup: int, iters: int) -> tuple[Optional[float], str]:
    """FlashInfer paged prefill (custom target mask) over the same pages plus the new rows; (seconds, note)."""
    if kw["mode"] != "softmax":
        return None, "softmax only"
    try:
        import flashinfer  # type: ignore[import-not-found]
    except ImportError:
        return None, "not installed"
    try:
        b, p, n, c, ps = shape.users, shape.prefix, shape.new, shape.cands, shape.page_size
        rows, device = n + c, args["q"].device
        total_tok = p + rows
        pages_per_user = -(-total_tok // ps)
        # FlashInfer reads every key from pages: write prefix + new rows of each user into fresh pages.
        cache = torch.empty(b * pages_per_user, 2, ps, shape.heads, shape.head_dim, device=device,
                            dtype=args["q"].dtype)
        q, k, v, mask, _ = _gathered(args, kw, shape)
        flat = cache.view(b, pages_per_user * ps, 2, shape.heads, shape.head_dim)
        flat[:, :total_tok, 0] = k.transpose(1, 2)
        flat[:, :total_tok, 1] = v.transpose(1, 2)
        i32 = lambda x: torch.as_tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD")
        wrapper.plan(i32([u * rows for u in range(b + 1)]), i32([u * pages_per_user for u in range(b + 1)]),
                     i32(list(range(b * pages_per_user))), i32([total_tok - (pages_per_user - 1) * ps] * b),
                     shape.heads, shape.heads, shape.head_dim, ps, custom_mask=mask.reshape(-1).repeat(b),
                     sm_scale=kw["scale"], q_data_type=args["q"].dtype, kv_data_type=cache.dtype)
        return _time(lambda: wrapper.run(args["q"], cache), device, warmup, iters), "ok"
    except Exception as exc:  # an API drift in flashinfer must not stop the benchmark
        return None, f"failed: {type(exc).__name__}: {str(exc)[:80]}"


# ------------------------------------------------------------------------------------------------ one shape
def run_shape(shape: Shape, device: torch.device, dtype, *, warmup: int, iters: int, persistent: bool,
              block_m: Optional[int] = None, kv_dtype: str = "model", page_reads: str = "auto",
              splits: Optional[int] = None, value_splits: Optional[int] = None,
              concurrent_tiles: Optional[bool] = None, split_dtype: Optional[torch.dtype] = None,
              hopper_kernel: bool = False) -> dict:
    """Time one shape (``block_m=None``: the kernel's own tile rule) against its baselines; one result row. With an
    8-bit ``kv_dtype`` the same pages are also timed in that format (``kv8_ms``, ``kv8_speedup`` over the model
    dtype's pages, ``kv8_err`` against them, ``kv8_read`` the path that read them). On sm_90+ with
    ``page_reads="auto"`` (pointer and TMA reads autotuned together) the pointer reads alone are timed too
    (``pointers_ms``, ``tma_gain``); ``autotuned`` lists the configs the autotuner kept. ``splits``: programs per
    tile and head over its keys (None: the launcher's rule); the row's ``splits`` is the number used,
    ``split_keys`` the keys each takes. ``value_splits``: programs
    per tile over its value columns (None: autotuned on CUDA, 1 elsewhere; ``autotuned`` names the choice).
    ``concurrent_tiles``: the history and candidate tiles' launches on two streams or one (None: the launcher's
    rule); the row's ``concurrent`` is what ran. ``split_dtype``: the split partials' dtype (None: the launcher's,
    the model's when 16-bit); the row's ``split_dtype`` is what ran where the launch split (else None).
    ``hopper_kernel``: tiles' full cached blocks on the sm_90 kernel (``relaygr_engine/kernels/_hopper.py``)."""
    from relaygr_engine.kernels._prefix_config import autotuned_choices, tma_device
    from relaygr_engine.kernels._split import split_dtype as partials_dtype
    from relaygr_engine.kernels._prefix_plan import schedule
    from relaygr_engine.kernels.prefix_attention import plan_prefix_attention, prefix_attention, reset_autotuning

    args, kw = problem(shape, device, dtype, contiguous=False)
    gq, gk, gv, mask, rab = _gathered(args, kw, shape)

    # Each problem is planned once, outside the timed calls, as a forward plans once for all its layers (and as
    # FlashInfer's plan is kept out of its timing); the plan's own time is reported beside.
    meta = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")
    plan_of = lambda a: plan_prefix_attention(**{n: a[n] for n in meta}, kv_cache=a["kv_cache"],  # noqa: E731
                                              block_m=block_m)
    plan = plan_of(args)
    run = lambda a, k, p, r=page_reads, s=splits: prefix_attention(  # noqa: E731
        **a, **k, persistent=persistent, plan=p, page_reads=r, splits=s, value_splits=value_splits,
        concurrent_tiles=concurrent_tiles, split_dtype=split_dtype, hopper_kernel=hopper_kernel)
    used_m = plan.block_m
    used_splits, split_keys, concurrent = schedule(plan, device, shape.heads, splits=splits,
                                                   value_splits=value_splits, concurrent_tiles=concurrent_tiles,
                                                   hopper_dim=shape.head_dim if hopper_kernel else 0)
    reset_autotuning()  # the paged and contiguous problems are tuned on this shape, the recompute one on its own
    out = run(args, kw, plan)
    t_paged = _time(lambda: run(args, kw, plan), device, warmup, iters)
    base = _dense_baseline(gq, gk, gv, mask, rab, kw)                       # [B, H, rows, D]
    base = base.transpose(1, 2).reshape(out.shape)
    err = float((out.float() - base.float()).abs().max())

    chosen = autotuned_choices()
    flops = 4 * shape.heads * shape.head_dim * shape.visible_pairs()
    elt = torch.empty((), dtype=dtype).element_size()
    nbytes = (shape.users * shape.prefix * 2 + 4 * args["q"].shape[0]) * shape.heads * shape.head_dim * elt
    row = dict(shape=shape.name, **asdict(shape), block_m=used_m, splits=used_splits, split_keys=split_keys,
               value_splits=value_splits, concurrent=concurrent, hopper_kernel=hopper_kernel,
               split_dtype=SHORT_DTYPE_NAMES[partials_dtype(split_dtype, dtype, device)] if used_splits > 1 else None,
               time_ms=t_paged * 1e3, tflops=flops / t_paged / 1e12, gbps=nbytes / t_paged / 1e9, max_abs_err=err,
               autotuned=chosen)
    (cargs, _), (rargs, rkw) = problem(shape, device, dtype, contiguous=True), _recompute_problem(shape, device, dtype)
    cplan, rplan = plan_of(cargs), plan_of(rargs)
    t_contig = _time(lambda: run(cargs, kw, cplan), device, warmup, iters)
    both = page_reads == "auto" and tma_device(device)
    both = both and (value_splits or 1) == 1  # (a value split reads through pointers)
    t_ptr = _time(lambda: run(args, kw, plan, "pointers"), device, warmup, iters) if both else None
    t_base = _time(lambda: _dense_baseline(gq, gk, gv, mask, rab, kw), device, warmup, iters)
    reset_autotuning()
    t_full = _time(lambda: run(rargs, rkw, rplan, s=None), device, warmup, iters)  # no prefix: the launcher's rule
    t_plan = _time(lambda: plan_of(args), device, warmup, iters, graph=False)  # host work: reads the device
    row.update(contig_ms=t_contig * 1e3, paged_overhead=t_paged / t_contig - 1,
               gathered_ms=t_base * 1e3, speedup_vs_gathered=t_base / t_paged, recompute_ms=t_full * 1e3,
               speedup_vs_recompute=t_full / t_paged, plan_ms=t_plan * 1e3,
               gathered_baseline="sdpa" if shape.mode == "softmax" else "torch dense")
    if t_ptr is not None:
        row.update(pointers_ms=t_ptr * 1e3, tma_gain=t_ptr / t_paged)
    if kv_dtype != "model":
        qargs = dict(args, kv_cache=quant.quantize_pages(args["kv_cache"], KVDtype(kv_dtype)))
        out8 = prefix_attention(**qargs, **kw, persistent=persistent, plan=plan, kv_dtype=kv_dtype)
        t8 = _time(lambda: prefix_attention(**qargs, **kw, persistent=persistent, plan=plan, kv_dtype=kv_dtype),
                   device, warmup, iters)
        row.update(kv8_ms=t8 * 1e3, kv8_speedup=t_paged / t8, kv8_err=float((out8.float() - out.float()).abs().max()),
                   kv8_read="kernel")  # (the launcher's kernel read them: main refuses where it does not)
    return _beside_matmul(row, flops, device, warmup, iters, lambda: _flashinfer_time(shape, args, kw, warmup, iters))


def _beside_matmul(row: dict, flops: float, device: torch.device, warmup: int, iters: int,
                   flashinfer: Callable) -> dict:
    """``row`` with, on CUDA, the bf16 matmul rate of its FLOPs measured now (``matmul_fraction``) and FlashInfer's
    time (``flashinfer()``: ``(seconds or None, note)``)."""
    if device.type == "cuda":
        mm = _matmul_tflops(flops, device, torch.bfloat16, warmup, iters)
        row.update(matmul_tflops=mm, matmul_fraction=row["tflops"] / mm)
        t_fi, note = flashinfer()
        row.update(flashinfer_ms=None if t_fi is None else t_fi * 1e3, flashinfer_note=note,
                   speedup_vs_flashinfer=None if t_fi is None else t_fi * 1e3 / row["time_ms"])
    return row


# ------------------------------------------------------------------------------------------------ main
def _prepare_device(name: str) -> tuple[Optional[torch.device], str]:
    """Resolve ``--device``; on the CPU switch Triton to its interpreter (before triton's first import)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cpu":
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
        from relaygr_engine.kernels._common import interpreter_active

        if not interpreter_active():
            return None, "triton was imported before TRITON_INTERPRET=1 could be set; run in a fresh process"
    if device.type == "npu":  # pragma: no cover - needs an Ascend host
        from relaygr_engine.kernels._common import load_npu

        load_npu()
    return device, ""


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (cuda if present, else cpu interpreter) | cpu | cuda | npu")
    ap.add_argument("--modes", default="softmax,hstu", help="comma-separated: softmax,hstu")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up runs per timing (default 3 on devices, 0 on cpu)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs (default 20 on devices, 1 on cpu)")
    ap.add_argument("--persistent", action="store_true", help="persistent grid (one program per core)")
    ap.add_argument("--block-m", default="auto",
                    help="query rows per tile: auto (the kernel's rule) or a comma-separated list to compare, e.g. "
                         "64,128 (each shape runs once per value)")
    ap.add_argument("--kv-dtype", default="model", choices=("model", "int8", "fp8_e4m3"),
                    help="also time each shape's pages in this 8-bit format (kv8_ms, kv8_speedup; fp8 on CUDA only)")
    ap.add_argument("--page-reads", default="auto", choices=("auto", "pointers", "tma"),
                    help="full key blocks through pointers, tensor descriptors (TMA, sm_90+), or both autotuned "
                         "(auto; on sm_90+ the pointer reads alone are timed too: tma_gain)")
    ap.add_argument("--head-dims", type=POSITIVE_INTS, default=None,
                    help="only the shapes of these head dims (e.g. one call per head dim where time per call is "
                         "limited; --summarize joins their --json outputs)")
    ap.add_argument("--shape", action="append", metavar="SPEC",
                    help="run this shape instead of the built-in set, once per mode in --modes (repeatable): "
                         "'B=1,P=3968,n=128,C=256,H=4,D=256' (users, cached prefix, new rows, candidates, heads, "
                         "head dim; page=64 by default), e.g. one layer of a ranking at NVIDIA's HSTU shape")
    ap.add_argument("--splits", default="auto",
                    help="programs per tile and head over its keys (cached prefix, then new history): auto (the "
                         "launcher's rule: the fewest waves of programs) and/or a comma-separated list to compare, "
                         "e.g. auto,1,7,15 (each shape runs once per value)")
    ap.add_argument("--value-splits", default="auto",
                    help="programs per tile over its value columns: auto (autotuned on CUDA: 1 or 2 above head dim "
                         "128; 1 elsewhere) and/or a comma-separated list of powers of two to compare, e.g. auto,1,2")
    ap.add_argument("--concurrent-tiles", default="auto",
                    help="the history and candidate tiles' launches on two streams (yes) or one after the other "
                         "(no): auto (the launcher's rule: two on CUDA where the history launch has fewer programs "
                         "than SMs) and/or a comma-separated list to compare, "
                         "e.g. auto,no (each shape runs once per value; yes needs CUDA)")
    ap.add_argument("--split-dtype", default="model",
                    help="the split partials' dtype: model (the launcher's: the model's, bf16 on CUDA; fp32 in the "
                         "interpreter) and/or fp32, fp16, bf16, comma-separated to compare, e.g. model,fp32")
    ap.add_argument("--hopper-kernel", default="no",
                    help="tiles' full cached blocks on the warp-specialised sm_90 kernel (yes; HSTU and softmax) "
                         "or the portable one (no): comma-separated to compare, e.g. no,yes (yes: an sm_90 GPU "
                         "only)")
    ap.add_argument("--summarize", nargs="+", metavar="JSON",
                    help="run nothing: print the table and RESULT line of these --json outputs of one device and "
                         "dtype together (and with --json write them as one)")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    opts = ap.parse_args(argv)
    if opts.summarize:
        try:
            rows, meta = S.load_rows(opts.summarize)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return _report(rows, S.summarize(rows, **meta), opts.json)

    device, why = _prepare_device(opts.device)
    if device is None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("softmax", "hstu")]
    if bad:
        ap.error(f"--modes must name 'softmax' and/or 'hstu', got {bad}")
    block_ms = _int_list(ap, "--block-m", opts.block_m, lambda b: b >= 16 and not b & (b - 1), "powers of two >= 16")
    from relaygr_engine.kernels._split import MAX_SPLITS

    splits = _int_list(ap, "--splits", opts.splits, lambda x: 1 <= x <= MAX_SPLITS, f"integers in [1, {MAX_SPLITS}]")
    v_splits = _int_list(ap, "--value-splits", opts.value_splits, lambda v: v >= 1 and not v & (v - 1),
                         "powers of two")
    custom = [_shape(ap, spec, m) for spec in opts.shape or () for m in modes]
    cpu = device.type == "cpu"
    concurrent = _choices(ap, "--concurrent-tiles", opts.concurrent_tiles, {"auto": None, "no": False, "yes": True})
    if True in concurrent and device.type != "cuda":
        ap.error(f"--concurrent-tiles yes needs a CUDA device (streams), got {device}")
    split_dtypes = _choices(ap, "--split-dtype", opts.split_dtype,
                            {"model": None, **{name: d for d, name in SHORT_DTYPE_NAMES.items()}})
    if torch.bfloat16 in split_dtypes and cpu:
        ap.error("--split-dtype bf16 cannot run in the CPU interpreter (numpy has no bf16)")
    if opts.kv_dtype != "model" and not quant.kernel_runs(device):
        ap.error(f"--kv-dtype {opts.kv_dtype} on {device.type}: the kernel's 8-bit read is off there until it passes "
                 f"on a GPU (relaygr_engine.quant.kernel_runs); {quant.KERNEL_ENV}=1 runs it anyway")
    hoppers = _choices(ap, "--hopper-kernel", opts.hopper_kernel, {"no": False, "yes": True})
    if True in hoppers and cpu:
        ap.error("--hopper-kernel yes needs an sm_90 GPU")
    dtype = torch.float32 if cpu else torch.bfloat16
    warmup = opts.warmup if opts.warmup is not None else (0 if cpu else 3)
    iters = opts.iters if opts.iters is not None else (1 if cpu else 20)
    shapes = custom or [s for s in (CPU_SHAPES if cpu else GPU_SHAPES)
                        if s.mode in modes and (opts.head_dims is None or s.head_dim in opts.head_dims)]
    if not shapes:
        ap.error(f"no shape has a head dim in {opts.head_dims} (they have "
                 f"{sorted({s.head_dim for s in (CPU_SHAPES if cpu else GPU_SHAPES)})})")

    if cpu:
        print("CPU: Triton interpreter smoke run (fp32, tiny shapes). Timings measure the numpy interpreter, "
              "not a device; run on CUDA/NPU for performance numbers.")
    print(f"device={device} dtype={str(dtype).replace('torch.', '')} persistent={opts.persistent} "
          f"warmup={warmup} iters={iters}")
    print(S.header(device.type == "cuda"))
    rows = []
    for shape, block_m, n_splits, n_v, cc, sd, hk in itertools.product(shapes, block_ms, splits, v_splits, concurrent,
                                                                       split_dtypes, hoppers):
        try:
            r = run_shape(shape, device, dtype, warmup=warmup, iters=iters, persistent=opts.persistent,
                          block_m=block_m, kv_dtype=opts.kv_dtype, page_reads=opts.page_reads, splits=n_splits,
                          value_splits=n_v, concurrent_tiles=cc, split_dtype=sd, hopper_kernel=hk)
        except ValueError as exc:  # a shape this device or --page-reads cannot run
            print(f"error: {shape.name}: {exc}", file=sys.stderr)
            return 2
        rows.append(r)
        print(S.row_line(r))
    return _report(rows, S.summarize(rows, device=str(device), dtype=str(dtype).replace("torch.", ""),
                                     kv_dtype=opts.kv_dtype), opts.json, printed=True)


def _int_list(ap: ArgumentParser, flag: str, text: str, ok: Callable[[int], bool], what: str) -> list:
    """The comma-separated values of ``text``: None for 'auto', else integers (a usage error unless all are
    ``what``)."""
    values = []
    for x in (t.strip() for t in text.split(",")):
        if x == "auto":
            values.append(None)
        elif x.isdigit() and ok(int(x)):
            values.append(int(x))
        elif x:
            values = []
            break
    if not values:
        ap.error(f"{flag} must be 'auto' and/or {what}, comma-separated, got {text!r}")
    return values


def _choices(ap: ArgumentParser, flag: str, text: str, names: dict) -> list:
    """The comma-separated values of ``text``, each a key of ``names`` (a usage error otherwise), as their
    values."""
    keys = [t.strip() for t in text.split(",") if t.strip()]
    if not keys or any(k not in names for k in keys):
        ap.error(f"{flag} must be {', '.join(map(repr, names))}, comma-separated, got {text!r}")
    return [names[k] for k in keys]


def _shape(ap: ArgumentParser, spec: str, mode: str) -> Shape:
    try:
        return parse_shape(spec, mode)
    except ValueError as exc:
        ap.error(f"--shape: {exc}")


def _report(rows: list[dict], summary: dict, json_path: Optional[str], printed: bool = False) -> int:
    """The table (unless ``printed`` as the run went), its note and the RESULT line; ``json_path``: also as JSON."""
    if not printed:
        print(S.header(all("matmul_fraction" in r for r in rows)))
        for r in rows:
            print(S.row_line(r))
    print(S.NOTE)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(summary=summary, rows=rows), f, indent=2)
    print(S.result_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
