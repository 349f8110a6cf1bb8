"""``python -m benchmarks.tools.ptxas --hopper``: the sm_90 kernel for tiles' full cached blocks
(``relaygr_engine/kernels/_hopper.py``, Gluon) compiled offline at each head dim's config, for HSTU's candidate and
history tiles and softmax's, beside what ``--defaults`` reports for the portable kernel: registers (a program is 8
warps: the compute warp group and the loader's), spill bytes, shared memory, programs per SM, the instruction mix of the
whole kernel and of its key loop with the loop's instructions per score (all, and its usual path: without what a branch
in it may skip), and the instructions with both biases over those with none (each HSTU tile kind's worst)."""
from __future__ import annotations

import contextlib
import itertools
from typing import Optional

__all__ = ["compile_hopper", "compile_launch", "report", "main"]


def compile_hopper(head_dim: int, *, hstu: bool = True, cand: bool = True, bias: bool = True, dtype: str = "bf16",
                   page_size: int = 64, heads: int = 4, arch: int = 90):
    """Compile the kernel's config at ``head_dim`` for ``sm_<arch>`` with no GPU (:func:`ptxas.compile_kernel`,
    specialised as a launch would be): the compiled kernel (``asm['ptx']``, ``asm['cubin']``, ``metadata.shared``)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from relaygr_engine.kernels import _hopper as H
    from benchmarks.tools.sm90_compile import compile_kernel, torch_dtype

    bn, stages, maxnreg = H.CONFIGS[head_dim]
    gdtype = {"bf16": H.gl.bfloat16, "fp16": H.gl.float16}[dtype]
    rows, piece = 2 * page_size * 16, min(bn, page_size)
    desc = TensorDescriptor(torch.empty(rows, heads * head_dim, dtype=torch_dtype(dtype)), [rows, heads * head_dim],
                            [heads * head_dim, 1], [piece, head_dim], H.kv_layout(head_dim, piece, gdtype))
    types = {"q_ptr": f"*{dtype}", "ws_ptr": f"*{dtype}", "ml_ptr": f"*{dtype}" if hstu else "*fp32",
             "kv_desc": mangle_type(desc), "tb_ptr": "*fp32",
             "scale": "fp32", "inv_norm": "fp32",
             **{n: "*i32" for n in ("kv_indices_ptr", "kv_indptr_ptr", "kv_last_ptr", "cu_q_ptr", "num_cand_ptr",
                                    "tile_user_ptr", "tile_row_ptr")}}
    constexprs = dict(HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_N=bn, STAGES=stages, HSTU=hstu,
                      HAS_BIAS=bias and hstu, CAND_TILES=cand, M_PARTS=2, **H.layouts(head_dim, bn, gdtype))
    # the strides a launch passes: a fused projection's rows, the head dim, a bias table's rows (multiples of 16)
    values = dict(num_heads=heads, stride_qt=4 * heads * head_dim, stride_qh=head_dim, stride_tb=4096 + 16)
    return compile_kernel(H.hopper_kernel, types, constexprs, arch=arch, num_warps=4, values=values,
                          maxnreg=maxnreg, source=GluonASTSource)


@contextlib.contextmanager
def _compile_only(arch: int):
    """Within: Triton's active driver stands in for an ``sm_<arch>`` GPU (device 0, stream 0, nothing else), and a
    launch of the Hopper kernel compiles for it (Triton's ``warmup``) instead of launching. Yields the list that
    collects each launch's ``(kernel, grid)``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from relaygr_engine.kernels import _hopper as H

    class StandIn:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

    class CompileOnly:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: got.append((kernel.warmup(*args, grid=grid, **kwargs), grid))

    got: list = []
    # (the driver in use, None where none was chosen yet: reading ``driver.active`` would choose one, and raise
    # on a machine without a GPU)
    kernel, previous = H.hopper_kernel, getattr(driver, "_active", None)
    driver.set_active(StandIn())
    H.hopper_kernel = CompileOnly()
    try:
        yield got
    finally:
        H.hopper_kernel = kernel
        driver._active = previous


def compile_launch(head_dim: int, *, hstu: bool = True, cand: bool = True, bias: bool = True, page_size: int = 64,
                   heads: int = 4, num_splits: int = 3, arch: int = 90):
    """What a launch of the kernel compiles, with no GPU: :func:`~relaygr_engine.kernels._hopper_launch.launch` run
    as a ranking's layer calls it (two tiles of 128 rows of one user over 62 full pages; the bias table's rows as
    the launcher builds them) on host tensors, under a driver standing in for ``sm_<arch>`` whose launches only
    compile. Returns ``(kernel, grid)``: the kernel to set beside :func:`compile_hopper`'s (the static report's) and
    the grid the launch asked for."""
    import torch

    from relaygr_engine.kernels import _hopper_launch as HL
    from relaygr_engine.kernels._bias_table import table_width

    users, total_q, pages, block_m = 1, 512, 64, 128
    q = torch.zeros(total_q, heads, head_dim, dtype=torch.bfloat16)
    kv = torch.zeros(pages, 2, page_size, heads, head_dim, dtype=torch.bfloat16)
    ws = torch.zeros(num_splits + 1, total_q, heads, head_dim, dtype=torch.bfloat16)
    ml = ws if hstu else torch.zeros(num_splits + 1, total_q, heads, 2)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    tiles = i32(0, 0, 0, block_m).view(2, 2)  # (users, first rows): two tiles of one user
    full = 62
    rows = users if cand else 2 * block_m
    table = torch.zeros(rows, table_width(full * page_size + total_q, 64)) if bias and hstu else None
    with _compile_only(arch) as got:
        HL.launch(q, ws, ml, kv, torch.arange(pages, dtype=torch.int32), i32(0, full), i32(page_size),
                  i32(0, total_q), i32(256), tiles, block_m, cand, table, hstu=hstu, page_size=page_size,
                  num_splits=num_splits, split_len=full * page_size // num_splits // 64 * 64 + 64, scale=0.0625,
                  inv_norm=1 / 4096)
    (kernel, grid), = got
    return kernel, grid


def report(arch: int = 90, head_dims=(64, 128, 256), smem_limit: int = 232448, page_size: int = 64) -> dict:
    """Print one line per head dim and tile kind and return the RESULT fields: ``hopper_spilling=`` and
    ``hopper_loop_local=`` (configs that spill, that touch local memory in the key loop), and per head dim
    ``_d<D>``: programs per SM, key-loop instructions per score, key-loop MMAs, special-function instructions per
    score, TMA copies (HSTU candidate tiles with both biases; history tiles' with ``_hist_d<D>``, softmax's with
    ``_softmax_d<D>``). ``page_size``: a key block within a page (64), or over several (16: a copy per page)."""
    import triton

    from relaygr_engine.kernels import _hopper as H
    from benchmarks.tools.sm90_compile import ptxas_report
    from benchmarks.tools.sass import instruction_mix

    print(f"hopper kernel (Gluon, warp-specialised; HSTU candidate and history tiles, softmax) target=sm_{arch} "
          f"dtype=bf16 page_size={page_size} triton={triton.__version__} (static report, nothing launched)")
    print(f"{'D':>4} {'tile':>7} {'BN':>4} {'stages':>6} {'maxnreg':>7} {'regs':>5} {'spill_st':>8} {'spill_ld':>8} "
          f"{'smem':>7} {'p/sm':>4} {'instr':>6} {'mma':>4} {'async':>5} {'loop':>5} {'mma':>4} {'mufu':>4} "
          f"{'lcl':>3} {'instr/score':>11} {'usual':>5}")
    fields: dict = {"hopper_spilling": 0, "hopper_loop_local": 0}
    for d, kind in itertools.product(head_dims, ("cand", "hist", "softmax")):
        bn, stages, maxnreg = H.CONFIGS[d]
        hstu, cand = kind != "softmax", kind != "hist"
        kernel = compile_hopper(d, hstu=hstu, cand=cand, arch=arch, page_size=page_size)
        regs, spill_st, spill_ld = ptxas_report(kernel.asm["ptx"], arch)
        whole, loop = instruction_mix(kernel.asm["cubin"])
        smem = kernel.metadata.shared
        per_sm = min(65536 // (regs * 256), smem_limit // max(smem, 1))
        per_score = loop.instructions * 128 / (64 * bn)  # a thread's loop instructions over its scores
        usual = (loop.instructions - loop.skippable) * 128 / (64 * bn)  # (without what a branch may skip)
        print(f"{d:>4} {kind:>7} {bn:>4} {stages:>6} {maxnreg:>7} {regs:>5} {spill_st:>8} "
              f"{spill_ld:>8} {smem:>7} {per_sm:>4} {whole.instructions:>6} {whole.mma:>4} {whole.async_copies:>5} "
              f"{loop.instructions:>5} {loop.mma:>4} {loop.special:>4} {loop.local:>3} {per_score:>11.2f} "
              f"{usual:>5.2f}")
        fields["hopper_spilling"] += spill_st > 0
        fields["hopper_loop_local"] += loop.local > 0
        at = {"cand": f"d{d}", "hist": f"hist_d{d}", "softmax": f"softmax_d{d}"}[kind]
        fields[f"hopper_programs_per_sm_{at}"] = per_sm
        fields[f"hopper_loop_instr_per_score_{at}"] = round(per_score, 2)
        fields[f"hopper_loop_usual_per_score_{at}"] = round(usual, 2)
        fields[f"hopper_loop_mma_{at}"] = loop.mma
        fields[f"hopper_mufu_per_score_{at}"] = round(loop.special * 128 / (64 * bn), 3)
        fields[f"hopper_tma_copies_{at}"] = whole.async_copies
        if hstu:
            plain = instruction_mix(compile_hopper(d, cand=cand, bias=False, arch=arch,
                                                   page_size=page_size).asm["cubin"])[0]
            ratio = f"hopper_bias_instr_ratio_{kind}"
            fields[ratio] = round(max(fields.get(ratio, 0.0), whole.instructions / plain.instructions), 3)
    return fields


def main(arch: int, json_path: Optional[str] = None, page_size: int = 64) -> int:
    """Print the report and its RESULT line (``json_path``: the fields also as JSON)."""
    from relaygr_engine.bench.common import emit_result

    emit_result(report(arch, page_size=page_size), json_path)
    return 0
