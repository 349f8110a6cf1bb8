"""Host-side helpers shared by the kernel launchers: device checks, interpreter detection, grid sizing.

Triton compiles nothing here (this module imports torch and the package's config only, no Triton). The launchers
in the kernel files validate their inputs with these helpers before any kernel runs, so a wrong shape, dtype,
device or layout is a ``ValueError`` naming the argument, never a crash or a silent wrong answer inside a kernel.
:func:`check_page_table` is also the check of :func:`relaygr_engine.attention.ops.paged_prefix_attention`.

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
import threading
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..config import SHORT_DTYPE_NAMES, env_flag
from ._target import Target

_log = logging.getLogger("relaygr_engine")

FLOAT_DTYPES = tuple(SHORT_DTYPE_NAMES)  # fp32, fp16, bf16: the config's one map of them
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
    return env_flag("TRITON_INTERPRET")


def is_interpreted(fn) -> bool:
    """Whether ``fn`` was decorated in interpreter mode."""
    return type(fn).__name__ == "InterpretedFunction"


def interpreter_active() -> bool:
    """Whether triton was imported in interpreter mode (``triton.language`` library functions are interpreted)."""
    import triton.language as tl

    return is_interpreted(tl.sum)


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``3.6.0`` or ``2.5.2+git1a2b``."""
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> Optional[str]:
    """Why Triton's CPU interpreter cannot run these kernels with the installed Triton and numpy, or None: before
    3.7 it turns a one-element array into an index with ``int()``, which numpy 2.4 refuses (a ``TypeError``, "only
    0-dimensional arrays can be converted to Python scalars", at a kernel's loop over its program id)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_version = version("triton")
    except PackageNotFoundError:
        return "triton is not installed"
    if _release(triton_version) < (3, 7) and _release(np.__version__) >= (2, 4):
        return (f"Triton {triton_version}'s CPU interpreter fails on numpy {np.__version__} (it converts one-element "
                f"arrays with int(), which numpy 2.4 refuses): Triton >= 3.7 or numpy < 2.4 runs it")
    return None


def check_launchable(device: torch.device, kernel) -> None:
    """Raise ``ValueError`` unless ``kernel`` can run on tensors of ``device``.

    CPU tensors need the interpreter, and the interpreter needs ``TRITON_INTERPRET=1`` from before triton's first
    import (checked: a kernel decorated in another mode, or a triton imported without it, is refused with the fix),
    and a Triton whose interpreter runs with the installed numpy (:func:`interpreter_problem`).
    """
    if device.type == "cpu":
        if not (is_interpreted(kernel) and interpreter_active()):
            raise ValueError(
                "Triton kernels run on CPU tensors only in Triton's interpreter: set TRITON_INTERPRET=1 in the "
                "environment before triton is first imported (it is read at @triton.jit decoration time), or use "
                f"the torch backend (interpreter requested now: {interpreter_requested()}, triton imported in "
                f"interpreter mode: {interpreter_active()})")
        why = interpreter_problem()
        if why is not None:
            raise ValueError(f"Triton kernels cannot run on CPU tensors here: {why}; or use the torch backend")
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


def _device_index(device: torch.device) -> int:
    """``device``'s index: the current CUDA device where it names none."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def num_cores(device) -> int:
    """Cores of ``device`` (a ``torch.device`` or a :class:`~relaygr_engine.kernels._target.Target`): SMs (CUDA),
    AI cores (NPU), :data:`INTERPRETER_PROGRAMS` on the CPU."""
    if isinstance(device, Target):
        return device.cores
    return _num_cores(device.type, _device_index(device))


def target_of(device) -> Target:
    """The :class:`~relaygr_engine.kernels._target.Target` of ``device`` (a ``torch.device``; a Target is returned
    as is): what the launch rules read of it, once per device."""
    if isinstance(device, Target):
        return device
    device = torch.device(device)
    return _target_of(device.type, _device_index(device))


@functools.lru_cache(maxsize=None)
def _target_of(device_type: str, index: int) -> Target:
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(index)
        return Target("cuda", f"{props.name} ({props.multi_processor_count} SMs, sm_{props.major}{props.minor})",
                      props.multi_processor_count, (props.major, props.minor))
    name = "cpu" if device_type == "cpu" else device_type
    return Target(device_type, name, _num_cores(device_type, index))


def num_programs(device: torch.device, num_work: int, persistent: bool) -> int:
    """Programs to launch for ``num_work`` tiles: one each, or (persistent) one per core, each looping."""
    if not persistent:
        return max(1, num_work)
    return max(1, min(num_work, num_cores(device)))


# ---------------------------------------------------------------------------------------------- streams
_SIDE = threading.local()  # per thread (a thread capturing a CUDA graph takes in every stream it forks to)


def _side_stream(index: int) -> Optional[torch.cuda.Stream]:
    """This thread's side stream on CUDA device ``index``, created on first use; None where it does not exist yet
    and the current stream is capturing a CUDA graph (no stream is created inside a capture: its launches then
    share the capturing stream)."""
    streams = _SIDE.__dict__.setdefault("streams", {})
    if index not in streams:
        if torch.cuda.is_current_stream_capturing():
            return None
        streams[index] = torch.cuda.Stream(device=index)
    return streams[index]


@contextlib.contextmanager
def tile_streams(device: torch.device, concurrent: bool):
    """Launch on two streams inside the block: it yields ``on(side)``, a context that runs the launches in it on
    this thread's side stream (``side=True``) or on the current stream. The side stream first waits for the current
    one (it sees every input queued so far) and the current one waits for the side stream on exit (whatever follows
    sees every output; tensors used on the side stream are freed after that point in the current stream's order, so
    the caching allocator reuses none of them early). Inside a CUDA graph capture the side stream's launches become
    a parallel branch. ``concurrent=False``, a device other than CUDA, or a capture before this thread's first
    side stream: one stream, ``on`` does nothing."""
    side_stream = None
    if concurrent and device.type == "cuda":
        side_stream = _side_stream(_device_index(device))
    if side_stream is None:
        yield lambda side: contextlib.nullcontext()
        return
    main = torch.cuda.current_stream(device)
    side_stream.wait_stream(main)
    try:
        yield lambda side: torch.cuda.stream(side_stream) if side else contextlib.nullcontext()
    finally:
        main.wait_stream(side_stream)


# ---------------------------------------------------------------------------------------------- validation
EMPTY_TILE_ROW = 1 << 30  # first row of a padding tile: past every segment, so the tile computes and stores nothing


def tile_arrays(seqlens: Sequence[int], num_candidates: Sequence[int], block_m: tuple[int, int],
                num_tiles: Optional[tuple[int, int]] = None,
                out: Optional[tuple[np.ndarray, np.ndarray]] = None) -> tuple[np.ndarray, np.ndarray]:
    """The prefix-attention tiles of a varlen batch: history tiles and candidate tiles, never mixed.

    User ``b``'s rows ``[0, n_b)`` (``n_b = seqlens[b] - num_candidates[b]``, its new history) are cut into history
    tiles of ``block_m[0]`` rows, its rows ``[n_b, seqlens[b])`` (its candidates) into candidate tiles of
    ``block_m[1]``.

    Parameters
    ----------
    seqlens, num_candidates : sequence of int
        Query rows and candidates of each user (segment), ``B`` of each.
    block_m : (int, int)
        Rows per history tile and per candidate tile.
    num_tiles : (int, int), optional
        Pad the two tables to these many tiles (a CUDA graph's fixed grid); a padding tile belongs to the last user
        and starts at :data:`EMPTY_TILE_ROW`, past every segment, so it computes and stores nothing.
    out : (int32 array [2, num_tiles[0]], int32 array [2, num_tiles[1]]), optional
        Write the (padded) tables there.

    Returns
    -------
    (hist_tiles, cand_tiles) : int32 arrays [2, n], each column ``[user, first row in its segment]``.
    """
    assert seqlens and len(seqlens) == len(num_candidates), (seqlens, num_candidates)
    tables = []
    for kind in range(2):
        users, rows = [], []
        for b, (n, c) in enumerate(zip(seqlens, num_candidates)):
            lo, hi = (0, n - c) if kind == 0 else (n - c, n)
            first = range(lo, hi, block_m[kind])
            users += [b] * len(first)
            rows += first
        size = len(users) if num_tiles is None else num_tiles[kind]
        assert size >= len(users), (num_tiles, kind, len(users))
        table = np.empty((2, size), dtype=np.int32) if out is None else out[kind]
        assert table.shape == (2, size) and table.dtype == np.int32, (table.shape, table.dtype, size)
        table[0, :len(users)], table[0, len(users):] = users, len(seqlens) - 1
        table[1, :len(users)], table[1, len(users):] = rows, EMPTY_TILE_ROW
        tables.append(table)
    return tables[0], tables[1]


def tile_table(seqlens: Sequence[int], num_candidates: Sequence[int], block_m: tuple[int, int],
               num_tiles: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile_arrays` as int32 CPU tensors ``[2, n]`` (sharing the arrays' memory)."""
    hist, cand = tile_arrays(seqlens, num_candidates, block_m, num_tiles)
    return torch.from_numpy(hist), torch.from_numpy(cand)


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{list(x.shape)} {x.dtype} on {x.device}"
    return type(x).__name__


def rows_dense(x: torch.Tensor) -> bool:
    """Whether each row ``x[i]`` is one dense run of memory (any stride between rows): e.g. ``q``, ``k`` and ``v``
    split from one fused projection ``[T, H * (D_q + D_k + D_v)]`` and viewed as ``[T, H, D]``."""
    step = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def with_dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where its rows are dense (:func:`rows_dense`), else a contiguous copy: what the kernels that
    read rows at any stride take."""
    return x if rows_dense(x) else x.contiguous()


def check_tensor(name: str, x, *, ndim: Optional[int] = None, shape: Optional[Sequence[Optional[int]]] = None,
                 dtypes: Optional[Iterable[torch.dtype]] = None, device: Optional[torch.device] = None,
                 contiguous: bool = True, dense_rows: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size; ``dense_rows``: instead of
    ``contiguous``, each row dense (:func:`rows_dense`). Returns ``x``."""
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
    if dense_rows:
        if not rows_dense(x):
            want = [math.prod(x.shape[i + 1:]) for i in range(1, x.dim())]
            raise ValueError(f"{name} must have dense rows (strides [*, {', '.join(map(str, want))}]; call "
                             f".contiguous()), got strides {list(x.stride())}")
    elif contiguous and not x.is_contiguous():
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


# ---------------------------------------------------------------------------------------------- page table
class PageIdError(IndexError, ValueError):
    """A page id outside the cache: an ``IndexError`` that is also a ``ValueError`` (both were raised for it)."""


@dataclass(frozen=True)
class PageTable:
    """A batch's row layout and page table as read on the host by :func:`check_page_table` (lists of ints)."""

    cu_seqlens_q: list[int]
    num_candidates: list[int]
    kv_indptr: list[int]
    kv_last_page_len: list[int]

    @property
    def batch(self) -> int:
        return len(self.num_candidates)


def _check_offsets(name: str, values: list[int], total: Optional[int], what: str) -> None:
    """``values`` start at 0, never decrease and end at ``total`` (anywhere when None)."""
    if values[0] != 0 or (total is not None and values[-1] != total) or any(
            b < a for a, b in zip(values, values[1:])):
        span = "from 0" if total is None else f"from 0 to {total}"
        raise ValueError(f"{name} must be non-decreasing offsets {span} ({what}), got {values}")


def check_page_table(cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len, *,
                     device: torch.device, num_pages: int, page_size: int, total_q: Optional[int] = None,
                     read: bool = True, contiguous: bool = False) -> Optional[PageTable]:
    """Check a batch's row layout and page table; return the values read on the host.

    ``B = len(num_candidates)`` users. Always checked (no device read): each table is a 1-D int32 tensor on
    ``device`` (and contiguous when ``contiguous``); ``cu_seqlens_q`` and ``kv_indptr`` have ``B + 1`` entries,
    ``kv_last_page_len`` has ``B``. With ``read``, the values too, in one device-to-host transfer:

    * ``cu_seqlens_q``: non-decreasing offsets from 0 to ``total_q`` (any end when ``total_q`` is None);
    * ``kv_indptr``: non-decreasing offsets from 0 to ``len(kv_indices)``;
    * ``num_candidates[b]`` in ``[0, rows of user b]``;
    * ``kv_last_page_len[b]`` in ``[1, page_size]`` for a user with pages, 0 for one without;
    * ``kv_indices`` in ``[0, num_pages)``.

    Parameters
    ----------
    cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len : Tensor
        As in :func:`relaygr_engine.attention.ops.paged_prefix_attention`.
    device : torch.device
        Where the tables must be (that of the other inputs).
    num_pages, page_size : int
        Of the paged cache the table indexes.
    total_q : int, optional
        Rows of the query tensor.
    read : bool
        Check the values (else the tensors only, and return None).
    contiguous : bool
        Require contiguous tables (the kernels read them with unit stride).

    Returns
    -------
    PageTable or None
        The tables' values (without ``kv_indices``), or None when not ``read``.

    Raises
    ------
    ValueError
        Naming the first bad argument, with what was expected and what it got.
    PageIdError
        ``kv_indices`` out of range (an ``IndexError`` and a ``ValueError``).
    """
    tables = {"cu_seqlens_q": cu_seqlens_q, "num_candidates": num_candidates, "kv_indptr": kv_indptr,
              "kv_indices": kv_indices, "kv_last_page_len": kv_last_page_len}
    for name, x in tables.items():
        check_tensor(name, x, ndim=1, dtypes=(torch.int32,), device=device, contiguous=contiguous)
    B = num_candidates.numel()
    for name, want in (("kv_indptr", B + 1), ("kv_last_page_len", B), ("cu_seqlens_q", B + 1)):
        if tables[name].numel() != want:
            raise ValueError(f"{name} must have {want} entries (B = len(num_candidates) = {B}), "
                             f"got {tables[name].numel()}")
    if not read:
        return None
    # One device-to-host transfer for every value checked below (each read waits for the queued device work).
    parts = [cu_seqlens_q, kv_indptr, kv_last_page_len, num_candidates]
    if kv_indices.numel():
        parts += [kv_indices.min().reshape(1), kv_indices.max().reshape(1)]
    host = torch.cat(parts).tolist()
    table = PageTable(cu_seqlens_q=host[:B + 1], kv_indptr=host[B + 1:2 * B + 2],
                      kv_last_page_len=host[2 * B + 2:3 * B + 2], num_candidates=host[3 * B + 2:4 * B + 2])
    cu, indptr, last, ncand = table.cu_seqlens_q, table.kv_indptr, table.kv_last_page_len, table.num_candidates
    _check_offsets("cu_seqlens_q", cu, total_q, "rows of q")
    _check_offsets("kv_indptr", indptr, kv_indices.numel(), "entries of kv_indices")
    for b in range(B):
        rows, pages = cu[b + 1] - cu[b], indptr[b + 1] - indptr[b]
        if not 0 <= ncand[b] <= rows:
            raise ValueError(f"num_candidates[{b}] must be in [0, {rows}] (user {b}'s rows), got {ncand[b]}")
        lo, hi = (1, page_size) if pages else (0, 0)
        if not lo <= last[b] <= hi:
            raise ValueError(f"kv_last_page_len[{b}] must be in [{lo}, {hi}] (user {b} has {pages} pages), "
                             f"got {last[b]}")
    if kv_indices.numel() and not (0 <= host[-2] and host[-1] < num_pages):
        raise PageIdError(f"kv_indices must hold page ids in [0, {num_pages}), got range [{host[-2]}, {host[-1]}]")
    return table
