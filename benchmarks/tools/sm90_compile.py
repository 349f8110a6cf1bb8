"""Offline compile of a Triton or Gluon kernel for an NVIDIA target, and ptxas's report of it: the primitives
:mod:`benchmarks.tools.ptxas` (the portable kernel's configs) and :mod:`benchmarks.tools.ptxas_hopper` (the sm_90
kernel) share. Nothing is launched; Triton's NVIDIA backend (in the PyPI wheel) is all it needs."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Optional


def _require_nvidia_backend():
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("triton is not installed (pip install 'relaygr-engine[triton]')")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        raise RuntimeError("this triton has no NVIDIA backend (e.g. triton-ascend); ptxas reports need one")


def compile_kernel(fn, types: dict, constexprs: dict, *, arch: int = 90, num_warps: int = 4, num_stages: int = 2,
                   values: Optional[dict] = None, maxnreg: Optional[int] = None, source=None):
    """Compile ``fn`` (a ``@triton.jit`` function, or with ``source`` Gluon's ``GluonASTSource`` a ``@gluon.jit``
    one) for ``sm_<arch>`` without a GPU; returns Triton's kernel object.

    ``types`` maps argument names to Triton types (``"*bf16"``, ``"fp32"``; unnamed arguments are ``"i32"``),
    ``constexprs`` maps constexpr argument names to values. Specialised as a launch would be: every pointer is
    16-byte aligned (as torch allocates), and an integer argument named in ``values`` is known to be a multiple of
    16 when its value is (Triton's launcher specialises each integer that way unless ``do_not_specialize``), so the
    vector widths, and with them the asynchronous copies, are those of a real launch. ``maxnreg`` caps the
    registers per thread, as an autotune config's does.
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
    return triton_compile((source or ASTSource)(fn=fn, signature=sig, constexprs=idx, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))


def torch_dtype(dtype: str):
    """The torch dtype of a Triton type name (``"bf16"``, ``"fp16"``, ``"fp32"``)."""
    from relaygr_engine.config import resolve_dtype

    return resolve_dtype(dtype)


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


def ptxas_version(arch: int = 90) -> str:
    """The version of the ptxas Triton assembles ``sm_<arch>`` with (``TRITON_PTXAS_PATH`` may name another), e.g.
    ``12.8.93``."""
    from triton.backends.nvidia.compiler import get_ptxas_version

    m = re.search(r"V(\d+\.\d+\.\d+)", get_ptxas_version(arch))
    return m.group(1) if m else "?"
