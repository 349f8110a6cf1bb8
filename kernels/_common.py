"""Host-side helpers shared by the kernel launchers: device checks, interpreter detection, grid sizing.

Triton compiles nothing here. The launchers in the kernel files validate their inputs with these helpers before any
kernel runs, so a wrong shape, dtype, device or layout is a ``ValueError`` naming the argument, never a crash or a
silent wrong answer inside a kernel.

Devices
-------
``cuda``  compiled Triton.
``npu``   the same Triton source through triton-ascend; ``torch_npu`` is imported here, only when an NPU tensor
          arrives.
``cpu``   Triton's interpreter (``TRITON_INTERPRET=1``), one program at a time on numpy; fp32 only (numpy has no
          bf16). Triton reads ``TRITON_INTERPRET`` when a function is decorated with ``@triton.jit``, and
          ``triton.language``'s own library functions (``tl.sum``, ``tl.zeros``, ...) are decorated when triton is
          first imported, so the variable must be set before the first ``import triton`` in the process.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import os
from typing import Iterable, Optional, Sequence

import torch

_log = logging.getLogger("relaygr_engine")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICE_TYPES = ("cpu", "cuda", "npu")

# Programs a persistent grid launches in the interpreter: a few, so that each one loops over several tiles.
INTERPRETER_PROGRAMS = 3


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- interpreter
def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value now."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def is_interpreted(fn) -> bool:
    """Whether ``fn`` was decorated in interpreter mode."""
    return type(fn).__name__ == "InterpretedFunction"


def interpreter_active() -> bool:
    """Whether triton was imported in interpreter mode (``triton.language`` library functions are interpreted)."""
    import triton.language as tl

    return is_interpreted(tl.sum)


def check_launchable(device: torch.device, kernel) -> None:
    """Raise ``ValueError`` unless ``kernel`` can run on tensors of ``device``.

    CPU tensors need the interpreter, and the interpreter needs ``TRITON_INTERPRET=1`` from before triton's first
    import (checked: a kernel decorated in another mode, or a triton imported without it, is refused with the fix).
    """
    if device.type == "cpu":
        if not (is_interpreted(kernel) and interpreter_active()):
            raise ValueError(
                "Triton kernels run on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 in the "
                "environment before triton is first imported (it is read at @triton.jit decoration time), or use "
                f"the torch backend (interpreter requested now: {interpreter_requested()}, triton imported in "
                f"interpreter mode: {interpreter_active()})")
    elif device.type == "npu":
        load_npu()
    elif device.type != "cuda":
        raise ValueError(f"device must be one of {', '.join(DEVICE_TYPES)}, got {device}")


@functools.lru_cache(maxsize=None)
def load_npu():
    """Import ``torch_npu`` (which registers the NPU device and triton-ascend's driver) on first use."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:  # pragma: no cover - needs an Ascend host
        raise ValueError(f"NPU tensors need torch_npu and triton-ascend installed: {exc}") from exc


def device_guard(device: torch.device):
    """Make ``device`` current for the launch (Triton launches on the current device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "npu":  # pragma: no cover - needs an Ascend host
        return torch.npu.device(device)  # type: ignore[attr-defined]
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _num_cores(device_type: str, index: int) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    if device_type == "npu":  # pragma: no cover - needs an Ascend host
        try:
            import triton

            props = triton.runtime.driver.active.utils.get_device_properties(index)
            return int(props.get("num_aicore") or props["num_vectorcore"])
        except Exception as exc:  # the property names differ across triton-ascend releases
            _log.warning("could not read the NPU core count (%s); persistent grids use 20 programs", exc)
            return 20
    return INTERPRETER_PROGRAMS


def num_programs(device: torch.device, num_work: int, persistent: bool) -> int:
    """Programs to launch for ``num_work`` tiles: one each, or (persistent) one per core, each looping."""
    if not persistent:
        return max(1, num_work)
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else 0)
    return max(1, min(num_work, _num_cores(device.type, index)))


# ---------------------------------------------------------------------------------------------- validation
def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{list(x.shape)} {x.dtype} on {x.device}"
    return type(x).__name__


def check_tensor(name: str, x, *, ndim: Optional[int] = None, shape: Optional[Sequence[Optional[int]]] = None,
                 dtypes: Optional[Iterable[torch.dtype]] = None, device: Optional[torch.device] = None,
                 contiguous: bool = True) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size. Returns ``x``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {describe(x)}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(x.shape)}")
    if shape is not None:
        for want, got in zip(shape, x.shape):
            if want is not None and want != got:
                expected = ["*" if s is None else s for s in shape]
                raise ValueError(f"{name} must have shape {expected}, got {list(x.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if x.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on {device} (like the other inputs), got {x.device}")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {list(x.stride())}")
    return x


def check_scalar(name: str, value, *, positive: bool = False) -> float:
    """A finite real number (``> 0`` when ``positive``), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def as_page_ids(name: str, page_ids, num_pages: int, device: torch.device, *, unique: bool) -> torch.Tensor:
    """``page_ids`` (sequence, array or 1-D integer tensor) as int64 on ``device``, checked in ``[0, num_pages)``."""
    if isinstance(page_ids, torch.Tensor):
        t = page_ids
    else:
        try:
            t = torch.as_tensor(list(page_ids) if not hasattr(page_ids, "__array__") else page_ids)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be a 1-D sequence of integer page ids, got {describe(page_ids)}") from exc
        if t.numel() == 0:
            t = t.to(torch.int64)
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor of page ids, got {describe(t)}")
    t = t.to(device=device, dtype=torch.int64).contiguous()
    if t.numel():
        host = t.cpu()
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= num_pages:
            raise IndexError(f"{name} must hold page ids in [0, {num_pages}), got range [{lo}, {hi}]")
        if unique and torch.unique(host).numel() != host.numel():
            raise ValueError(f"{name} must not repeat a page id (two copies would race on one page)")
    return t
