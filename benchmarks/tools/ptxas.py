"""``python -m benchmarks.tools.ptxas``: registers, spills, shared memory and instruction mix of the prefix-attention
kernel's configs, no GPU needed.

Each config (mode, head dim, tile kind, ``BLOCK_M``, ``BLOCK_N``, warps, stages, persistent or not) is compiled by
Triton for an NVIDIA target (default ``sm_90``, the H100/H200), specialised as a launch would be (aligned pointers,
shape-fixed strides known multiples of 16), and assembled by the ptxas Triton ships, whose ``-v`` report gives the
registers per thread and the bytes spilled to local memory; Triton's metadata gives the shared memory a program asks
for; ``nvdisasm`` gives the SASS instruction mix (:mod:`benchmarks.tools.sass`): all instructions, tensor-core
MMAs, synchronous global loads, asynchronous copies, shuffles and special-function instructions (``mufu``), of the
whole kernel and of its key loop; :mod:`relaygr_engine.kernels._sass_flow` the defects of its control flow (``flow``:
uniform registers read undefined on some path, registers of an in-flight ``wgmma`` touched). These are
static facts of the compiled code, not timings: a config that spills pays local-memory traffic in its inner loop,
and one whose shared memory exceeds the target's per-block limit cannot launch.

``--defaults`` compiles exactly the configs the launcher can run on CUDA (``pick_config``'s tile rows per kind,
``CUDA_CONFIGS`` after ``prune_configs``) for head dims 64, 128 and 256, softmax and HSTU with both biases (history
tiles reading them from the bias table, and computing them in the kernel, the launcher's path above the table's
budget), plus HSTU without biases to measure what the biases cost; the grid flags pick any other set.

Runs on any machine whose Triton has the NVIDIA backend (the PyPI wheel does); nothing is launched.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Iterator, Optional

from relaygr_engine.cli_args import ArgumentParser, POSITIVE_INTS
from benchmarks.tools.sass import Mix, instruction_mix
from benchmarks.tools.sm90_compile import (_require_nvidia_backend, compile_kernel, ptxas_report,  # noqa: F401
                                          ptxas_version, torch_dtype)
from relaygr_engine.kernels._sass_flow import flow_defects
from benchmarks.tools.sm_limits import LIMITS, limits, programs_per_sm

__all__ = ["Build", "compile_attention", "compile_kernel", "default_grid", "ptxas_report", "main"]

MODES = ("softmax", "hstu", "hstu-inkernel", "hstu-nobias")
BIASED = ("hstu", "hstu-inkernel")


@dataclass(frozen=True)
class Config:
    """One config to compile: ``mode`` is ``softmax``, ``hstu`` (both biases; history tiles read them from the bias
    table, the launcher's choice within its budget), ``hstu-inkernel`` (both biases; history tiles compute them
    per (row, key), the launcher's choice above it; candidate tiles as ``hstu``) or ``hstu-nobias``."""

    mode: str
    head_dim: int
    cand_tiles: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    persistent: bool = False
    kv_dtype: str = "model"   # "int8" / "fp8_e4m3": 8-bit pages (relaygr_engine.quant)
    tma: bool = False         # full key blocks through a tensor descriptor (sm_90+), not pointers
    v_splits: int = 1         # programs sharing a tile's value columns (V_SPLITS)
    m_splits: int = 1         # programs sharing a tile's rows (M_SPLITS: each takes block_m / m_splits)
    maxnreg: Optional[int] = None  # registers a thread may use at most (ptx .maxnreg; None: ptxas chooses)
    split: bool = False       # split-prefix scheduling (SPLIT): a share of the tile's keys, partial state stored


@dataclass(frozen=True)
class Build:
    """One compiled config and what ptxas and nvdisasm report for it."""

    config: Config
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    fits: bool             # shared memory within the target's per-block limit
    programs_per_sm: int   # programs one SM holds at once (registers, shared memory, warp and block slots)
    sass: Mix              # the whole kernel
    loop: Mix              # its key loop
    compile_s: float
    flow: int = 0          # defects of its control flow (sass_flow.flow_defects): 0 for correct code


def attention_types(pointer: str) -> dict:
    """Argument types of ``_prefix_attention_kernel`` with floating tensors of type ``pointer`` (e.g. ``"*bf16"``);
    split partials in that type too (the launcher's default, :func:`~relaygr_engine.kernels._split.split_dtype`: a
    16-bit model's dtype; fp32 for fp32)."""
    types = {n: pointer for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "kv_ptr")}
    types["kvs_ptr"] = "*fp32"
    types.update({n: "*i32" for n in ("kv_indptr_ptr", "kv_indices_ptr", "kv_last_ptr", "cu_q_ptr", "num_cand_ptr",
                                      "tile_user_ptr", "tile_row_ptr")})
    types.update(pos_bias_ptr=pointer, ts_bias_ptr=pointer, ts_cache_ptr="*i64", ts_q_ptr="*i64",  # a model's params
                 ts_bounds_ptr="*i64", bias_table_ptr="*fp32", ws_ptr=pointer, ml_ptr="*fp32", scale="fp32",
                 inv_norm="fp32")
    return types


def attention_values(head_dim: int, page_size: int, heads: int, slots: Optional[int] = None) -> dict:
    """The integer arguments of a launch whose values are fixed by the shapes (contiguous ``[rows, H, D]`` inputs
    and cache ``[pages, 2, slots, H, D]``, ``slots = page_size`` unless 8-bit), for the launcher's
    specialisation."""
    row, slots = heads * head_dim, slots or page_size
    values = dict(num_heads=heads, stride_ts_page=page_size, stride_page=2 * slots * row,
                  stride_kv=slots * row, stride_slot=row, stride_head=head_dim,
                  stride_tb=4096)  # the bias table's rows: always a multiple of 16 entries
    for t in "qkvo":
        values.update({f"stride_{t}t": row, f"stride_{t}h": head_dim})
    return values


def compile_attention(mode: str, head_dim: int, block_m: int, block_n: int, *, num_warps: int, num_stages: int,
                      persistent: bool = False, page_size: int = 64, dtype: str = "bf16", arch: int = 90,
                      cand_tiles: bool = True, bias: bool = True, heads: int = 4, kv_dtype: str = "model",
                      hist_table: bool = True, tma: bool = False, v_splits: int = 1, m_splits: int = 1,
                      maxnreg: Optional[int] = None, split: bool = False):
    """Compile ``_prefix_attention_kernel`` for one config: candidate or history tiles, HSTU with both biases on
    (or, ``bias=False``, none), pages in the model's dtype or 8-bit (``kv_dtype``), full key blocks read through
    pointers or (``tma``) tensor descriptors, value columns split over ``v_splits`` programs and rows over
    ``m_splits``, registers capped at ``maxnreg`` per thread, a share of each tile's keys with the partial state
    stored (``split``: split-prefix scheduling, as a launch over few tiles runs). History tiles read
    their bias from the bias table (``hist_table``, the launcher's choice within its budget) or compute it in the
    kernel."""
    import torch

    from relaygr_engine import quant
    from relaygr_engine.config import KVDtype
    from relaygr_engine.kernels import _common as C
    from relaygr_engine.kernels import prefix_attention as pa
    from relaygr_engine.kernels._launch import fast_silu

    hstu = mode == "hstu"
    biased = hstu and bias
    ts_bits = pa._ts_bits(32) if biased else 1
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, C.next_pow2(head_dim)), PAGE_SIZE=page_size,
                      BLOCK_M=block_m, BLOCK_N=block_n, CAND_TILES=cand_tiles, HSTU=hstu, HAS_POS=biased,
                      HAS_TS=biased, TS_BITS=ts_bits,
                      TS_STEPS=0, TS_TABLE=False, TS_ABS=False,
                      HIST_TABLE=biased and hist_table and not cand_tiles,
                      DOT_PRECISION=None if dtype != "fp32" else "ieee", PERSISTENT=persistent, SPLIT=split,
                      KV8=KVDtype(kv_dtype).quantized,
                      FAST_SILU=hstu and fast_silu(torch.device("cuda"), torch_dtype(dtype)), TMA=tma,
                      TMA_READS=int(tma), V_SPLITS=v_splits, V_SPLITS_PICK=v_splits, M_SPLITS=m_splits,
                      SKIP_FULL=0)
    types = attention_types("*" + dtype)
    if tma:
        types["kv_desc"] = f"tensordesc<{dtype}[{block_n}, {head_dim}]>"
    else:
        constexprs["kv_desc"] = None
    if constexprs["KV8"]:
        types["kv_ptr"] = "*i8" if kv_dtype == "int8" else "*fp8e4nv"
    slots = quant.layer_shape(KVDtype(kv_dtype), 1, page_size, heads, head_dim)[2]
    return compile_kernel(pa._prefix_attention_kernel, types, constexprs, arch=arch, num_warps=num_warps,
                          num_stages=num_stages, values=attention_values(head_dim, page_size, heads, slots),
                          maxnreg=maxnreg)


def build(cfg: Config, *, page_size=64, dtype="bf16", arch=90, smem_limit: Optional[int] = None) -> Build:
    """Compile one config and read its resources and instruction mix (Triton's warnings as the caller's filters
    say: :func:`build_all` silences them)."""
    t0 = time.perf_counter()
    kernel = compile_attention(cfg.mode.split("-")[0], cfg.head_dim, cfg.block_m, cfg.block_n,
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages, persistent=cfg.persistent,
                               page_size=page_size, dtype=dtype, arch=arch, cand_tiles=cfg.cand_tiles,
                               bias=cfg.mode in BIASED, kv_dtype=cfg.kv_dtype,
                               hist_table=cfg.mode != "hstu-inkernel", tma=cfg.tma, v_splits=cfg.v_splits,
                               m_splits=cfg.m_splits, maxnreg=cfg.maxnreg, split=cfg.split)
    regs, st, ld = ptxas_report(kernel.asm["ptx"], arch)
    whole, loop = instruction_mix(kernel.asm["cubin"])
    smem = int(kernel.metadata.shared)
    limit = smem_limit or limits(arch).smem_per_block
    return Build(cfg, regs, st, ld, smem, smem <= limit, programs_per_sm(regs, smem, cfg.num_warps, arch), whole, loop,
                 time.perf_counter() - t0, len(flow_defects(kernel.asm["cubin"])))


def build_all(grid: list[Config], workers: Optional[int] = None, **kw) -> Iterator[Build]:
    """:func:`build` of each config of ``grid`` (keywords as :func:`build`'s), in the grid's order: on
    ``workers`` threads (default: :func:`~relaygr_engine.kernels._compile.compile_workers`,
    ``RELAYGR_COMPILE_WORKERS``; Triton's compiler releases the GIL, ptxas and nvdisasm are processes), Triton's
    warnings silenced."""
    from relaygr_engine.kernels._compile import compile_workers

    workers = compile_workers() if workers is None else workers
    with warnings.catch_warnings(), ThreadPoolExecutor(max(1, workers)) as pool:  # (0 or 1: one thread, serially)
        warnings.simplefilter("ignore")  # (the filters are the process's: set once here, not per thread)
        yield from pool.map(lambda cfg: build(cfg, **kw), grid)


def default_grid(head_dims, modes=MODES, dtype="bf16", page_size=64, kv_dtype="model", tma=True,
                 splits=(False,)) -> list[Config]:
    """The configs the launcher can run on CUDA: per head dim, mode and tile kind, ``pick_config``'s rows per tile
    and every autotune config ``prune_configs`` keeps (one-tile-per-program launches, the launcher's default; page
    reads through pointers and, with ``tma`` (sm_90+) and pages in the model's dtype, tensor descriptors);
    ``hstu-inkernel`` for history tiles only (candidate tiles always read the bias table). Where history tiles
    fall back to fewer rows in batches whose bias table would pass its budget (``hist_fallback_m``, above head dim
    128), both heights: the taller reading the table (``hstu``), the shorter computing the bias
    (``hstu-inkernel``), and both for modes without a bias. Each unsplit, split (split-prefix scheduling: what a
    launch over few tiles compiles) or both, as ``splits`` lists."""
    import torch

    from relaygr_engine.kernels import _prefix_config as K

    grid = []
    for mode, d, cand in itertools.product(modes, head_dims, (False, True)):
        if mode == "hstu-inkernel" and cand:
            continue
        pick = K.pick_config(torch.device("cuda"), torch_dtype(dtype), d)
        biased = mode in BIASED
        heights = [pick.block_m if cand else pick.hist_block_m]
        if not cand and pick.hist_fallback_m is not None:
            heights = {"hstu": heights, "hstu-inkernel": [pick.hist_fallback_m]}.get(
                mode, [pick.hist_fallback_m] + heights)
        for rows, sp in itertools.product(heights, splits):
            kept = K.prune_configs(K.CUDA_CONFIGS, {}, HEAD_DIM=d, BLOCK_M=rows, HSTU=mode.startswith("hstu"),
                                   CAND_TILES=cand, HAS_POS=biased, HAS_TS=biased, HIST_TABLE=mode == "hstu",
                                   PAGE_SIZE=page_size, KV8=kv_dtype != "model", SPLIT=sp,
                                   TMA_READS=K.TMA_EITHER if tma and kv_dtype == "model" else K.TMA_OFF)
            grid += [Config(mode, d, cand, rows, c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, kv_dtype=kv_dtype,
                            tma=c.kwargs["TMA"], v_splits=c.kwargs["V_SPLITS"], m_splits=c.kwargs["M_SPLITS"],
                            maxnreg=c.maxnreg, split=sp) for c in kept]
    return grid


def _bias_ratios(rows: list[Build]) -> dict:
    """HSTU-with-biases over HSTU-without instructions (whole kernel and key loop), max over the configs of each
    tile kind (``hist``: history tiles reading the bias table, ``hist_inkernel``: computing it), and per head dim
    for candidate tiles (``bias_instr_ratio_cand_d256``)."""
    plain = {dataclasses.replace(b.config, mode="hstu"): b for b in rows if b.config.mode == "hstu-nobias"}
    pairs = [(b, p) for b in rows if b.config.mode in BIASED
             for p in [plain.get(dataclasses.replace(b.config, mode="hstu"))] if p is not None]
    groups = {"cand": [x for x in pairs if x[0].config.cand_tiles],
              "hist": [x for x in pairs if not x[0].config.cand_tiles and x[0].config.mode == "hstu"],
              "hist_inkernel": [x for x in pairs if x[0].config.mode == "hstu-inkernel"]}
    for d in sorted({b.config.head_dim for b, _ in groups["cand"]}):
        groups[f"cand_d{d}"] = [x for x in groups["cand"] if x[0].config.head_dim == d]
    out = {}
    for kind, group in groups.items():
        if group:
            out[f"bias_instr_ratio_{kind}"] = max(b.sass.instructions / p.sass.instructions for b, p in group)
            out[f"bias_loop_ratio_{kind}"] = max(b.loop.instructions / max(p.loop.instructions, 1) for b, p in group)
    return {k: round(v, 3) for k, v in out.items()}


def _special_per_score(rows: list[Build]) -> dict:
    """Special-function instructions (exp2, reciprocal, tanh) per score of the key loop, max over the configs of
    each mode and tile kind: the loop's ``mufu`` per thread times the threads, over the block's scores
    ``BLOCK_M / M_SPLITS * BLOCK_N`` (a program's rows). Softmax needs one (its exp2, plus one per row for the
    rescale); HSTU's SiLU two (exp2 and a reciprocal), or one through an approximate tanh; a config whose warp
    groups compute the same scores counts each time."""
    out = {}
    for mode, cand in itertools.product(MODES, (True, False)):
        per = [b.loop.special * 32 * b.config.num_warps * b.config.m_splits
               / (b.config.block_m * b.config.block_n)
               for b in rows if b.config.mode == mode and b.config.cand_tiles == cand and b.loop.mma]
        if per:
            out[f"mufu_per_score_{mode.replace('-', '_')}_{'cand' if cand else 'hist'}"] = round(max(per), 3)
    return out


def _row(b: Build) -> str:
    c, w, lp = b.config, b.sass, b.loop
    return (f"{c.mode:<11} {c.head_dim:>4} {'cand' if c.cand_tiles else 'hist':>4} {c.block_m:>4} {c.block_n:>4} "
            f"{c.num_warps:>5} {c.num_stages:>6} {'y' if c.persistent else 'n':>4} {'y' if c.tma else 'n':>3} "
            f"{c.v_splits:>2} {c.m_splits:>2} {c.maxnreg or '-':>3} {'y' if c.split else 'n':>2} {b.registers:>5} "
            f"{b.spill_store_bytes:>8} {b.spill_load_bytes:>8} {b.shared_bytes:>7} {'y' if b.fits else 'NO':>4} "
            f"{b.programs_per_sm:>4} "
            f"{w.instructions:>6} {w.mma:>4} {w.global_loads:>4} {w.async_copies:>5} {w.shuffles:>4} "
            f"{lp.instructions:>5} {lp.mma:>4} {lp.global_loads:>4} {lp.async_copies:>5} {lp.special:>4} {lp.local:>3} "
            f"{b.flow:>4}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="python -m benchmarks.tools.ptxas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90 = sm_90, H100/H200)")
    ap.add_argument("--defaults", action="store_true",
                    help="the configs the launcher runs on CUDA (head dims 64,128,256 unless --head-dims is given; "
                         "the grid flags below are ignored)")
    ap.add_argument("--modes", default="softmax,hstu",
                    help="softmax, hstu (both biases, history tiles reading the bias table), hstu-inkernel (history "
                         "tiles computing them), hstu-nobias")
    ap.add_argument("--head-dims", type=POSITIVE_INTS, default=None, help="(64,128; 64,128,256 with --defaults)")
    ap.add_argument("--tiles", choices=("cand", "hist", "both"), default="cand",
                    help="compile the candidate-tile kernel, the history-tile one, or both (cand)")
    ap.add_argument("--block-m", type=POSITIVE_INTS, default="64,128")
    ap.add_argument("--block-n", type=POSITIVE_INTS, default="32,64,128")
    ap.add_argument("--warps", type=POSITIVE_INTS, default="4,8")
    ap.add_argument("--stages", type=POSITIVE_INTS, default="2,3")
    ap.add_argument("--persistent", choices=("no", "yes", "both"), default="no",
                    help="build the one-tile-per-program kernel, the persistent one, or both")
    ap.add_argument("--page-reads", choices=("pointers", "tma", "both"), default="pointers",
                    help="full key blocks read through pointers, tensor descriptors (TMA, sm_90+), or both")
    ap.add_argument("--value-splits", type=POSITIVE_INTS, default="1",
                    help="programs sharing a tile's value columns (powers of two; pointer page reads only above 1)")
    ap.add_argument("--row-splits", type=POSITIVE_INTS, default="1",
                    help="programs sharing a tile's rows (powers of two; each takes block-m / row-splits rows)")
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="cap the registers per thread (ptx .maxnreg, as an autotune config's maxnreg; default: none)")
    ap.add_argument("--split-prefix", choices=("no", "yes", "both"), default="no",
                    help="build each config unsplit, with split-prefix scheduling (a share of each tile's keys, the "
                         "partial state stored: what a launch over few tiles, e.g. one user's ranking, compiles), or "
                         "both; also with --defaults")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--kv-dtype", choices=("model", "int8", "fp8_e4m3"), default="model",
                    help="pages in the model's dtype (model) or 8-bit with per-token scales")
    ap.add_argument("--hopper", action="store_true",
                    help="instead, the sm_90 warp-specialised kernel for tiles' full cached blocks "
                         "(relaygr_engine/kernels/_hopper.py, "
                         "Gluon; HSTU and softmax) at head dims 64, 128 and 256, pages of --page-size tokens "
                         "(benchmarks/tools/ptxas_hopper.py)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    opts = ap.parse_args(argv)
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if opts.arch not in LIMITS:
        ap.error(f"--arch must be one of {sorted(LIMITS)}, got {opts.arch}")
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes must name {', '.join(map(repr, MODES))} (one or more), got {opts.modes!r}")
    try:
        _require_nvidia_backend()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from relaygr_engine.kernels._common import interpreter_requested

    if interpreter_requested():
        print("error: TRITON_INTERPRET is set; unset it to compile for a GPU target", file=sys.stderr)
        return 2
    if opts.hopper:
        from benchmarks.tools import ptxas_hopper

        return ptxas_hopper.main(opts.arch, opts.json, page_size=opts.page_size)
    import triton

    no_yes_both = {"no": (False,), "yes": (True,), "both": (False, True)}
    pers, splits = no_yes_both[opts.persistent], no_yes_both[opts.split_prefix]
    dims = opts.head_dims or ([64, 128, 256] if opts.defaults else [64, 128])
    bms, bns, warps, stages = opts.block_m, opts.block_n, opts.warps, opts.stages
    pow2 = lambda x, lo: x >= lo and not x & (x - 1)  # noqa: E731
    for name, values, ok, want in (("head-dims", dims, lambda d: 1 <= d <= 256, "in [1, 256]"),
                                   ("block-m", bms, lambda b: pow2(b, 16), "powers of two >= 16"),
                                   ("block-n", bns, lambda b: pow2(b, 16), "powers of two >= 16"),
                                   ("warps", warps, lambda w: pow2(w, 1) and w <= 32, "powers of two <= 32"),
                                   ("stages", stages, lambda x: x >= 1, ">= 1"),
                                   ("value-splits", opts.value_splits, lambda v: pow2(v, 1), "powers of two"),
                                   ("row-splits", opts.row_splits, lambda v: pow2(v, 1), "powers of two"),
                                   ("maxnreg", [opts.maxnreg or 255], lambda r: 24 <= r <= 255, "in [24, 255]"),
                                   ("page-size", [opts.page_size], lambda p: p >= 1, ">= 1")):
        if not all(ok(v) for v in values):
            ap.error(f"--{name} must be {want}, got {values}")
    if opts.defaults:
        grid = default_grid(dims, dtype=opts.dtype, page_size=opts.page_size, kv_dtype=opts.kv_dtype,
                            tma=opts.arch >= 90, splits=splits)
    else:
        kinds = {"cand": (True,), "hist": (False,), "both": (False, True)}[opts.tiles]
        reads = {"pointers": (False,), "tma": (True,), "both": (False, True)}[opts.page_reads]
        grid = [Config(*c, kv_dtype=opts.kv_dtype, tma=t, v_splits=v, m_splits=m, maxnreg=opts.maxnreg, split=sp)
                for *c, t, v, m, sp in itertools.product(modes, dims, kinds, bms, bns, warps, stages, pers, reads,
                                                         opts.value_splits, opts.row_splits, splits)
                if not (t and v > 1) and c[3] // m >= 16]
    print(f"target=sm_{opts.arch} dtype={opts.dtype} kv_dtype={opts.kv_dtype} page_size={opts.page_size} "
          f"triton={triton.__version__} ptxas={ptxas_version(opts.arch)} "
          f"smem_limit={limits(opts.arch).smem_per_block}  ({len(grid)} configs; static report, nothing launched)")
    print(f"{'mode':<11} {'D':>4} {'tile':>4} {'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} {'pers':>4} {'tma':>3} "
          f"{'vs':>2} {'ms':>2} {'cap':>3} {'sp':>2} {'regs':>5} "
          f"{'spill_st':>8} {'spill_ld':>8} {'smem':>7} {'fits':>4} {'p/sm':>4} {'instr':>6} {'mma':>4} {'ldg':>4} "
          f"{'async':>5} {'shfl':>4} {'loop':>5} {'mma':>4} {'ldg':>4} {'async':>5} {'mufu':>4} {'lcl':>3} {'flow':>4}")
    rows = []
    for b in build_all(grid, page_size=opts.page_size, dtype=opts.dtype, arch=opts.arch):
        rows.append(b)
        print(_row(b), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(arch=opts.arch, dtype=opts.dtype, page_size=opts.page_size, triton=triton.__version__,
                           rows=[asdict(b) for b in rows]), f, indent=1)
    clean = [b for b in rows if b.fits and b.spill_store_bytes == 0]
    fields = dict(arch=f"sm_{opts.arch}", configs=len(rows), spill_free=len(clean),
                  spilling=sum(b.spill_store_bytes > 0 for b in rows), over_smem=sum(not b.fits for b in rows),
                  max_spill_bytes=max(b.spill_store_bytes for b in rows), flow_defects=sum(b.flow > 0 for b in rows))
    if opts.defaults:
        default = [b for b in rows if b.config.mode != "hstu-nobias"]
        fields.update(default_configs=len(default), default_spilling=sum(b.spill_store_bytes > 0 for b in default),
                      default_loop_spilling=sum(b.loop.local > 0 for b in default),
                      default_over_smem=sum(not b.fits for b in default),
                      default_flow_defects=sum(b.flow > 0 for b in default))
    for d in sorted({b.config.head_dim for b in clean if b.config.cand_tiles}):  # candidate tiles' best occupancy
        fields[f"max_programs_per_sm_cand_d{d}"] = max(b.programs_per_sm for b in clean
                                                      if b.config.cand_tiles and b.config.head_dim == d)
    fields.update(_bias_ratios(rows))
    fields.update(_special_per_score(rows))
    fields["kv_dtype"] = opts.kv_dtype
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()) + f" triton={triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
