"""A compiled kernel's SASS, read with ``nvdisasm`` (shipped in Triton's wheel): each instruction's address, text,
labels and predicate. The autotuner's flow check of 8-bit variants reads it
(:mod:`relaygr_engine.kernels._sass_flow`); :mod:`benchmarks.tools.sass` counts its instruction mix."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

__all__ = ["disassemble", "nvdisasm_path"]

_INSTR = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*)")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA(?:\.[A-Z]+)*\s+`\((\.L_x_\d+)\)")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def nvdisasm_path() -> str:
    """The ``nvdisasm`` of Triton's NVIDIA backend."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(path):
        raise RuntimeError(f"no nvdisasm at {path} (Triton's wheel ships it with the NVIDIA backend)")
    return path


def disassemble(cubin: bytes) -> list[tuple[int, str, str, bool]]:
    """``(address, text, labels, predicated)`` of each SASS instruction of ``cubin``: its text without the
    predicate, the labels that name its address (comma-separated, or ``""``), and whether it has a predicate."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([nvdisasm_path(), "-c", path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()[-400:]}")
    out, pending = [], []
    for line in proc.stdout.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            text = _PREDICATE.sub("", m.group(2))
            out.append((int(m.group(1), 16), text, ",".join(pending), text != m.group(2)))
            pending = []
    return out
