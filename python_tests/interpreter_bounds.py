"""A bounds-checked Triton interpreter for tests: every load and store a kernel makes (its unmasked lanes) must fall
inside the storage of one of that launch's tensor arguments, else the launch raises ``OutOfBounds`` naming the
access and the addresses.

On a GPU such an access reads another allocation's bytes, or stops the process with an illegal memory access; the
interpreter alone reads whatever the address holds. The check is coarser than a sanitizer's: an access through one
argument's pointer that lands in another argument's storage passes, and tensor-descriptor (TMA) reads are not
checked. Import it with ``TRITON_INTERPRET=1`` set, and
call :func:`install` before the kernels first run. It patches the interpreter's internals (Triton 3.7-3.9's
``GridExecutor._init_args_hst`` and ``InterpreterBuilder.create_masked_load``/``create_masked_store``):
:func:`install` raises ``RuntimeError`` where they are missing.
"""
from __future__ import annotations

import numpy as np

__all__ = ["OutOfBounds", "install", "checked_accesses"]

_ranges: list = []     # (first byte, one past the last) of each tensor argument's storage, this launch
_counts = {"load": 0, "store": 0}
_np_dtype = None       # the interpreter's numpy dtype of a Triton element type (set by install)


class OutOfBounds(AssertionError):
    """A kernel's load or store outside every tensor argument's storage."""


def _collect(arg) -> None:
    if hasattr(arg, "untyped_storage"):
        storage = arg.untyped_storage()
        _ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    elif isinstance(arg, (tuple, list)):
        for item in arg:
            _collect(item)
    elif hasattr(arg, "base") and hasattr(arg, "block_shape"):  # a tensor descriptor
        _collect(arg.base)


def _check(kind: str, ptrs, mask) -> None:
    addresses = ptrs.data.reshape(-1)[np.asarray(mask.data, dtype=bool).reshape(-1)].astype(np.uint64)
    _counts[kind] += 1
    if addresses.size == 0:
        return
    width = np.uint64(np.dtype(_np_dtype(ptrs.get_element_ty())).itemsize)
    inside = np.zeros(addresses.shape, dtype=bool)
    for lo, hi in _ranges:
        inside |= (addresses >= np.uint64(lo)) & (addresses + width <= np.uint64(hi))
    if not inside.all():
        bad = addresses[~inside]
        raise OutOfBounds(f"{kind} of {int(width)}-byte elements outside every tensor argument: {bad.size} of "
                          f"{addresses.size} lanes, e.g. address {int(bad[0])}; arguments' storages "
                          f"{[(lo, hi) for lo, hi in _ranges]}")


def install() -> None:
    """Patch the interpreter (idempotent)."""
    from triton.runtime import interpreter as I

    executor, builder = getattr(I, "GridExecutor", None), getattr(I, "InterpreterBuilder", None)
    needed = ((executor, "_init_args_hst"), (builder, "create_masked_load"), (builder, "create_masked_store"),
              (I, "_get_np_dtype"))
    if any(cls is None or not hasattr(cls, name) for cls, name in needed):
        raise RuntimeError("this Triton's interpreter lacks the hooks interpreter_bounds patches")
    if getattr(builder, "_bounds_checked", False):
        return
    init, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store
    global _np_dtype
    _np_dtype = I._get_np_dtype

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        _ranges.clear()
        _collect(list(args_hst))
        _collect(list(kwargs_hst.values()))
        return args_hst, kwargs_hst

    def checked_load(self, ptrs, mask, other, *rest):
        _check("load", ptrs, mask)
        return load(self, ptrs, mask, other, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        _check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    executor._init_args_hst = init_args
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    builder._bounds_checked = True


def checked_accesses() -> dict:
    """Loads and stores checked so far (a test can tell that the check ran)."""
    return dict(_counts)
