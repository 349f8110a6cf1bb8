"""``relaygr bench ptxas``: registers, spills and shared memory of the prefix-attention kernel's configs, no GPU needed.

Each config (mode, head dim, ``BLOCK_M``, ``BLOCK_N``, warps, stages, persistent or not) is compiled by Triton for an
NVIDIA target (default ``sm_90``, the H100/H200) and assembled by the ptxas Triton ships, whose ``-v`` report gives
the registers per thread and the bytes spilled to local memory; Triton's metadata gives the shared memory a program
asks for. These are static facts of the compiled code, not timings: a config that spills pays local-memory traffic
in its inner loop, and one whose shared memory exceeds the target's per-block limit cannot launch. The tile rule in
``kernels/prefix_attention.py`` (``pick_config``, ``CUDA_CONFIGS``) is chosen from this report.

Runs on any machine whose Triton has the NVIDIA backend (the PyPI wheel does); nothing is launched.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

from ..cli_args import ArgumentParser, POSITIVE_INTS

__all__ = ["Build", "compile_attention", "compile_kernel", "ptxas_report", "main"]

# Shared memory one program may opt into, per compute capability (bytes; CUDA programming guide, "Technical
# Specifications per Compute Capability").
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


@dataclass(frozen=True)
class Build:
    """One compiled config and what ptxas reported for it."""

    mode: str
    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    persistent: bool
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    fits: bool             # shared memory within the target's per-block limit
    compile_s: float


def _require_nvidia_backend():
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("triton is not installed (pip install 'relaygr-engine[triton]')")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        raise RuntimeError("this triton has no NVIDIA backend (e.g. triton-ascend); ptxas reports need one")


def compile_kernel(fn, types: dict, constexprs: dict, *, arch: int = 90, num_warps: int = 4, num_stages: int = 2,
                   values: Optional[dict] = None):
    """Compile ``fn`` (a ``@triton.jit`` function) for ``sm_<arch>`` without a GPU; returns Triton's kernel object.

    ``types`` maps argument names to Triton types (``"*bf16"``, ``"fp32"``; unnamed arguments are ``"i32"``),
    ``constexprs`` maps constexpr argument names to values. Specialised as a launch would be: every pointer is
    16-byte aligned (as torch allocates), and an integer argument named in ``values`` is known to be a multiple of
    16 when its value is (Triton's launcher specialises each integer that way unless ``do_not_specialize``), so the
    vector widths, and with them the asynchronous copies, are those of a real launch.
    """
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    idx = {(fn.arg_names.index(n),): v for n, v in constexprs.items()}
    plain = {p.name for p in fn.params if p.do_not_specialize}
    aligned = [n for n, t in sig.items() if t.startswith("*")]
    aligned += [n for n, v in (values or {}).items() if n not in plain and sig.get(n, "").startswith("i")
                and v % 16 == 0]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton_compile(ASTSource(fn=fn, signature=sig, constexprs=idx, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def attention_types(pointer: str) -> dict:
    """Argument types of ``_prefix_attention_kernel`` with floating tensors of type ``pointer`` (e.g. ``"*bf16"``)."""
    types = {n: pointer for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "kv_ptr")}
    types.update({n: "*i32" for n in ("kv_indptr_ptr", "kv_indices_ptr", "kv_last_ptr", "cu_q_ptr", "num_cand_ptr",
                                      "tile_user_ptr", "tile_row_ptr")})
    types.update(pos_bias_ptr="*fp32", ts_bias_ptr="*fp32", ts_cache_ptr="*i64", ts_q_ptr="*i64",
                 ts_bounds_ptr="*i64", ws_ptr="*fp32", ml_ptr="*fp32", scale="fp32", inv_norm="fp32")
    return types


def attention_values(head_dim: int, page_size: int, heads: int) -> dict:
    """The integer arguments of a launch whose values are fixed by the shapes (contiguous ``[rows, H, D]`` inputs
    and cache ``[pages, 2, page_size, H, D]``), for the launcher's specialisation."""
    row = heads * head_dim
    values = dict(num_heads=heads, stride_ts_page=page_size, stride_page=2 * page_size * row,
                  stride_kv=page_size * row, stride_slot=row, stride_head=head_dim)
    for t in "qkvo":
        values.update({f"stride_{t}t": row, f"stride_{t}h": head_dim})
    return values


def compile_attention(mode: str, head_dim: int, block_m: int, block_n: int, *, num_warps: int, num_stages: int,
                      persistent: bool = False, page_size: int = 64, dtype: str = "bf16", arch: int = 90,
                      cand_tiles: bool = True, bias: bool = True, heads: int = 4):
    """Compile ``_prefix_attention_kernel`` for one config: candidate or history tiles, HSTU with both in-kernel
    biases on (or, ``bias=False``, none)."""
    from relaygr_engine.kernels import _common as C
    from relaygr_engine.kernels import prefix_attention as pa

    hstu = mode == "hstu"
    biased = hstu and bias
    ts_bits, ts_steps = pa._ts_search(32) if biased else (1, 0)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, C.next_pow2(head_dim)), PAGE_SIZE=page_size,
                      BLOCK_M=block_m, BLOCK_N=block_n, CAND_TILES=cand_tiles, HSTU=hstu, HAS_POS=biased,
                      HAS_TS=biased, TS_BITS=ts_bits,
                      TS_STEPS=ts_steps, TS_TABLE=False, TS_ABS=False,
                      DOT_PRECISION=None if dtype != "fp32" else "ieee", PERSISTENT=persistent, SPLIT=False)
    return compile_kernel(pa._prefix_attention_kernel, attention_types("*" + dtype), constexprs, arch=arch,
                          num_warps=num_warps, num_stages=num_stages,
                          values=attention_values(head_dim, page_size, heads))


def ptxas_report(ptx: str, arch: int = 90) -> tuple[int, int, int]:
    """``(registers, spill_store_bytes, spill_load_bytes)`` from assembling ``ptx`` with Triton's ptxas ``-v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", src, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if proc.returncode != 0 or regs is None or spill is None:
        raise RuntimeError(f"ptxas failed or printed no resource report: {text.strip()[-400:]}")
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def build(mode, head_dim, block_m, block_n, num_warps, num_stages, persistent, *, page_size=64, dtype="bf16",
          arch=90, smem_limit: Optional[int] = None) -> Build:
    """Compile one config and read its resources."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel = compile_attention(mode, head_dim, block_m, block_n, num_warps=num_warps, num_stages=num_stages,
                                   persistent=persistent, page_size=page_size, dtype=dtype, arch=arch)
    regs, st, ld = ptxas_report(kernel.asm["ptx"], arch)
    smem = int(kernel.metadata.shared)
    limit = smem_limit or SMEM_LIMIT.get(arch, 49152)
    return Build(mode, head_dim, block_m, block_n, num_warps, num_stages, persistent, regs, st, ld, smem,
                 smem <= limit, time.perf_counter() - t0)


def main(argv: Optional[list[str]] = None) -> int:
    ap = ArgumentParser(prog="relaygr bench ptxas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90 = sm_90, H100/H200)")
    ap.add_argument("--modes", default="softmax,hstu")
    ap.add_argument("--head-dims", type=POSITIVE_INTS, default="64,128")
    ap.add_argument("--block-m", type=POSITIVE_INTS, default="64,128")
    ap.add_argument("--block-n", type=POSITIVE_INTS, default="32,64,128")
    ap.add_argument("--warps", type=POSITIVE_INTS, default="4,8")
    ap.add_argument("--stages", type=POSITIVE_INTS, default="2,3")
    ap.add_argument("--persistent", choices=("no", "yes", "both"), default="no",
                    help="build the one-tile-per-program kernel, the persistent one, or both")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    opts = ap.parse_args(argv)
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if not modes or any(m not in ("softmax", "hstu") for m in modes):
        ap.error(f"--modes must name 'softmax' and/or 'hstu', got {opts.modes!r}")
    try:
        _require_nvidia_backend()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from relaygr_engine.kernels._common import interpreter_requested

    if interpreter_requested():
        print("error: TRITON_INTERPRET is set; unset it to compile for a GPU target", file=sys.stderr)
        return 2
    import triton

    pers = {"no": (False,), "yes": (True,), "both": (False, True)}[opts.persistent]
    dims, bms, bns, warps, stages = opts.head_dims, opts.block_m, opts.block_n, opts.warps, opts.stages
    pow2 = lambda x, lo: x >= lo and not x & (x - 1)  # noqa: E731
    for name, values, ok, want in (("head-dims", dims, lambda d: 1 <= d <= 256, "in [1, 256]"),
                                   ("block-m", bms, lambda b: pow2(b, 16), "powers of two >= 16"),
                                   ("block-n", bns, lambda b: pow2(b, 16), "powers of two >= 16"),
                                   ("warps", warps, lambda w: pow2(w, 1) and w <= 32, "powers of two <= 32"),
                                   ("stages", stages, lambda x: x >= 1, ">= 1"),
                                   ("page-size", [opts.page_size], lambda p: p >= 1, ">= 1")):
        if not all(ok(v) for v in values):
            ap.error(f"--{name} must be {want}, got {values}")
    grid = list(itertools.product(modes, dims, bms, bns, warps, stages, pers))
    print(f"target=sm_{opts.arch} dtype={opts.dtype} page_size={opts.page_size} triton={triton.__version__} "
          f"smem_limit={SMEM_LIMIT.get(opts.arch, 49152)}  ({len(grid)} configs; static report, nothing launched)")
    print(f"{'mode':<8} {'D':>4} {'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} {'pers':>4} {'regs':>5} "
          f"{'spill_st':>8} {'spill_ld':>8} {'smem':>7} {'fits':>4}")
    rows = []
    for cfg in grid:
        b = build(*cfg, page_size=opts.page_size, dtype=opts.dtype, arch=opts.arch)
        rows.append(b)
        print(f"{b.mode:<8} {b.head_dim:>4} {b.block_m:>4} {b.block_n:>4} {b.num_warps:>5} {b.num_stages:>6} "
              f"{'y' if b.persistent else 'n':>4} {b.registers:>5} {b.spill_store_bytes:>8} {b.spill_load_bytes:>8} "
              f"{b.shared_bytes:>7} {'y' if b.fits else 'NO':>4}", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(arch=opts.arch, dtype=opts.dtype, page_size=opts.page_size, triton=triton.__version__,
                           rows=[asdict(b) for b in rows]), f, indent=1)
    clean = [b for b in rows if b.fits and b.spill_store_bytes == 0]
    print(f"RESULT arch=sm_{opts.arch} configs={len(rows)} spill_free={len(clean)} "
          f"spilling={sum(b.spill_store_bytes > 0 for b in rows)} over_smem={sum(not b.fits for b in rows)} "
          f"max_spill_bytes={max(b.spill_store_bytes for b in rows)} triton={triton.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
