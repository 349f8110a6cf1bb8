"""Configuration dataclasses and choice enums of the engine."""
from __future__ import annotations

import enum
import math
import numbers
import operator
import os
import reprlib
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["AttentionBackend", "AttentionMode", "CacheConfig", "GraphConfig", "KVDtype", "OnloadMode", "PageReads",
           "TimeBucket", "check_int", "env_flag", "parse_choice", "resolve_dtype"]


def check_int(name: str, value, minimum: int = 0, below: Optional[int] = None) -> int:
    """``value`` as a Python int in ``[minimum, below)`` (no upper bound when ``below`` is None): an int or a numpy
    integer (anything with ``__index__``); bools are refused. Else ValueError naming ``name``."""
    expected = f"an integer >= {minimum}" if below is None else f"an integer in [{minimum}, {_bound(below)})"
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be {expected}, got {type(value).__name__} {reprlib.repr(value)}") from None
    if v < minimum or (below is not None and v >= below):
        raise ValueError(f"{name} must be {expected}, got {v}")
    return v


def _bound(n: int) -> str:
    """``2**k`` for a power of two past 2**16, else the number."""
    return f"2**{n.bit_length() - 1}" if n > 1 << 16 and n & (n - 1) == 0 else str(n)


def _real(value) -> bool:
    """A real number that is not a bool (ints, floats, numpy scalars)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to a true value now (``1``, ``true``, ``on``, ``yes``, any case)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on", "yes")


def parse_choice(enum_cls: type[enum.Enum], value, name: str):
    """Turn ``value`` (an enum member or its string value) into a member of ``enum_cls``.

    Raises ``ValueError`` naming ``name`` and listing the valid choices.
    """
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(str(value).lower())
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


class AttentionBackend(str, enum.Enum):
    """Which implementation runs attention over cached pages."""

    AUTO = "auto"      # Triton on CUDA/NPU, torch elsewhere
    TORCH = "torch"    # pure-torch reference (any device)
    TRITON = "triton"  # Triton kernels (CUDA, NPU, or the CPU interpreter with TRITON_INTERPRET=1)


class OnloadMode(str, enum.Enum):
    """How a ranking's DRAM hit is copied back into device pages (:mod:`relaygr_engine.onload`)."""

    AUTO = "auto"      # layer on CUDA, serial elsewhere
    SERIAL = "serial"  # the whole prefix, all layers, before the forward starts
    LAYER = "layer"    # layer by layer on a side stream, each layer's attention waiting for its own layer only


class KVDtype(str, enum.Enum):
    """How the prefix KV cache stores K and V (:mod:`relaygr_engine.quant`)."""

    MODEL = "model"        # in the cache's ``dtype``: scores equal full inference
    FP8_E4M3 = "fp8_e4m3"  # 8-bit float (e4m3) with an fp32 scale per token and head: about half of bf16's bytes
    INT8 = "int8"          # 8-bit integer with an fp32 scale per token and head

    @property
    def quantized(self) -> bool:
        return self is not KVDtype.MODEL


# The quantised page format's sizes (one definition; :mod:`relaygr_engine.quant` holds the rest of the format).
SCALE_BYTES = 4  # bytes of a row's fp32 scale


def storage_dtype(kv_dtype: KVDtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a cache layer tensor: ``dtype``, or ``uint8`` when quantised."""
    return torch.uint8 if kv_dtype.quantized else dtype


def scale_slots(kv_dtype: KVDtype, page_size: int, head_dim: int) -> int:
    """Slots of a page's K (or V) section that hold scales: ``ceil(4 * page_size / head_dim)``, 0 unquantised."""
    return -(-SCALE_BYTES * page_size // head_dim) if kv_dtype.quantized else 0


def layer_shape(kv_dtype: KVDtype, num_pages: int, page_size: int, num_heads: int, head_dim: int) -> tuple:
    """Shape of one layer's cache tensor."""
    return (num_pages, 2, page_size + scale_slots(kv_dtype, page_size, head_dim), num_heads, head_dim)


class PageReads(str, enum.Enum):
    """How the Triton prefix-attention kernel reads a full key block's K and V from the pages."""

    AUTO = "auto"          # on sm_90+ the autotuner measures both and keeps the faster per variant; else pointers
    POINTERS = "pointers"  # per-thread addresses, asynchronous copies (portable: every device, the interpreter)
    TMA = "tma"            # two tensor-descriptor loads (Hopper's copy engine); ValueError where it cannot run


class AttentionMode(str, enum.Enum):
    """How attention weights are formed over the visible keys.

    The one definition shared by the op (:mod:`relaygr_engine.attention.ops`), the Triton kernel
    (``relaygr_engine.kernels.prefix_attention``) and the model configuration; parse user input with
    ``parse_choice(AttentionMode, value, "mode")``.
    """

    SOFTMAX = "softmax"  # softmax(scale * q.k) over the visible keys
    HSTU = "hstu"        # SiLU(scale * q.k + rab) / hstu_norm, pointwise (no normalisation over keys)


class TimeBucket(str, enum.Enum):
    """How the HSTU time bias buckets a time difference ``d = t_q - t_k`` (int64 seconds), before the clamp to
    ``num_buckets - 1``.

    The one definition shared by the op, the torch plan, the Triton kernel and the model configuration. Every
    function is a step function of ``d``; :func:`relaygr_engine.attention.ops.time_bucket_bounds` gives its integer
    steps, which is how every backend computes it (so they agree exactly).
    """

    LOG2 = "log2"        # bit_length(max(d, 0)): bucket b >= 1 holds d in [2**(b-1), 2**b)
    LN_0301 = "ln_0301"  # floor(ln(max(|d|, 1)) / 0.301) in float32 (Meta's research HSTU; note the |d|)
    SQRT_60 = "sqrt_60"  # floor(sqrt(max(d, 1e-6) / 60)) in float32 (Meta's STU time encoder)

    @property
    def absolute(self) -> bool:
        """Whether the function reads ``|d|`` (else negative differences fall in bucket 0)."""
        return self is TimeBucket.LN_0301


# The float dtypes a model, a cache or a kernel's partials take, by their short (Triton's) names; resolve_dtype also
# takes torch's long names ("bfloat16").
SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_DTYPES = {**{str(d).removeprefix("torch."): d for d in SHORT_DTYPE_NAMES},
           **{name: d for d, name in SHORT_DTYPE_NAMES.items()}}


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """Map ``"float32" | "float16" | "bfloat16"`` (or a torch dtype) to a torch dtype; ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(sorted(_DTYPES))}, got {dtype!r}") from None


@dataclass(frozen=True)
class CacheConfig:
    """Where and how the prefix KV cache lives.

    Parameters
    ----------
    device : str
        ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"`` or ``"npu"``.
    dtype : str or torch.dtype
        KV storage dtype: ``"float32"`` (default), ``"float16"`` or ``"bfloat16"``.
    page_size : int
        Tokens per page (default 16).
    num_pages : int, optional
        Pages in the pool. Give this or ``hbm_bytes``; with neither, 4096 pages.
    hbm_bytes : int, optional
        Byte budget for the device KV storage (all layers, K and V, plus timestamps); the page count is derived
        from it and the model's shape.
    max_pinned_fraction : float
        Share of pages that pinned (leased or being read) prefixes may hold, in (0, 1] (default 0.5). Past it a new
        pre-infer is refused, so leases can never starve ranking of pages.
    lease_ttl_s : float
        How long a pre-inferred prefix stays pinned waiting for its ranking request (the relay window), > 0.
    attention_backend : {"auto", "torch", "triton"}
        Attention over cached pages; "auto" picks Triton on CUDA/NPU and torch elsewhere.
    dram_bytes : int
        Byte budget of the server-local DRAM tier (0 turns it off).
    kv_dtype : {"model", "fp8_e4m3", "int8"}
        How K and V are stored (:class:`KVDtype`). ``"model"`` (default): in ``dtype``, exact. ``"fp8_e4m3"`` and
        ``"int8"``: 8 bits per value plus an fp32 scale per token and head (kept inside the page; ``head_dim`` must
        be a multiple of 4), about half the bytes of bf16, so about twice the users fit;
        scores are then no longer equal to full inference (measured: ``relaygr bench kvquant``). The new rows of
        the current forward attend at full precision; cached rows are dequantized on load. fp8 needs the torch
        backend on the CPU (Triton's interpreter has no fp8) and is refused on NPU.
    onload : {"auto", "serial", "layer"}
        How a ranking's DRAM hit is copied back (:class:`OnloadMode`): ``"layer"`` copies layer ``l + 1``'s pages
        on a side stream while layer ``l`` computes (on a CPU a stand-in makes each layer's copy when its attention
        needs it); ``"serial"`` copies every layer before the forward; ``"auto"`` (default): layer on CUDA.
    """

    device: str = "cpu"
    dtype: Union[str, torch.dtype] = "float32"
    page_size: int = 16
    num_pages: Optional[int] = None
    hbm_bytes: Optional[int] = None
    max_pinned_fraction: float = 0.5
    lease_ttl_s: float = 1.0
    attention_backend: Union[str, AttentionBackend] = AttentionBackend.AUTO
    dram_bytes: int = 0
    onload: Union[str, OnloadMode] = OnloadMode.AUTO
    kv_dtype: Union[str, KVDtype] = KVDtype.MODEL

    def __post_init__(self) -> None:
        object.__setattr__(self, "onload", parse_choice(OnloadMode, self.onload, "onload"))
        object.__setattr__(self, "kv_dtype", parse_choice(KVDtype, self.kv_dtype, "kv_dtype"))
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        object.__setattr__(self, "attention_backend",
                           parse_choice(AttentionBackend, self.attention_backend, "attention_backend"))
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda", "npu"):
            raise ValueError(f"device must be 'cpu', 'cuda[:N]' or 'npu[:N]', got {self.device!r}")
        object.__setattr__(self, "device", str(dev))
        object.__setattr__(self, "page_size", _positive_int("page_size", self.page_size))
        if self.num_pages is not None and self.hbm_bytes is not None:
            raise ValueError("give num_pages or hbm_bytes, not both "
                             f"(got num_pages={self.num_pages}, hbm_bytes={self.hbm_bytes})")
        for name in ("num_pages", "hbm_bytes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        f = self.max_pinned_fraction
        if not (_real(f) and 0 < f <= 1):
            raise ValueError(f"max_pinned_fraction must be in (0, 1], got {f!r}")
        object.__setattr__(self, "max_pinned_fraction", float(f))
        t = self.lease_ttl_s
        if not (_real(t) and math.isfinite(t) and t > 0):
            raise ValueError(f"lease_ttl_s must be a finite number of seconds > 0, got {t!r}")
        object.__setattr__(self, "lease_ttl_s", float(t))
        object.__setattr__(self, "dram_bytes", check_int("dram_bytes", self.dram_bytes, 0))
        self._check_kv_dtype()

    def _check_kv_dtype(self) -> None:
        """An 8-bit cache on a backend that cannot serve it is refused before anything is built."""
        if not self.kv_dtype.quantized:
            return
        device = torch.device(self.device).type
        if device == "npu":
            raise ValueError(f"kv_dtype={self.kv_dtype.value!r} is not supported on npu (triton-ascend has no 8-bit "
                             "K/V path here); use kv_dtype='model'")
        if (self.kv_dtype is KVDtype.FP8_E4M3 and device == "cpu"
                and self.attention_backend is AttentionBackend.TRITON):
            raise ValueError("kv_dtype='fp8_e4m3' needs attention_backend 'torch' or 'auto' on the CPU (Triton's "
                             "interpreter has no fp8); got attention_backend='triton'")

    @property
    def layered_onload(self) -> bool:
        """Whether DRAM hits are copied back layer by layer (``onload`` resolved for this device)."""
        if self.onload is OnloadMode.AUTO:
            return torch.device(self.device).type == "cuda"
        return self.onload is OnloadMode.LAYER

    def page_bytes(self, num_layers: int, num_heads: int, head_dim: int) -> int:
        """Bytes one page takes on the device: K and V of every layer (8-bit: values and their scales) plus its
        int64 timestamps."""
        shape = layer_shape(self.kv_dtype, 1, self.page_size, num_heads, head_dim)
        elem = torch.empty((), dtype=storage_dtype(self.kv_dtype, self.dtype)).element_size()
        return num_layers * math.prod(shape) * elem + self.page_size * 8

    def resolve_num_pages(self, num_layers: int, num_heads: int, head_dim: int) -> int:
        """The pool's page count: ``num_pages``, or as many pages as ``hbm_bytes`` holds, or 4096."""
        if self.num_pages is not None:
            return self.num_pages
        if self.hbm_bytes is None:
            return 4096
        n = self.hbm_bytes // self.page_bytes(num_layers, num_heads, head_dim)
        if n < 1:
            raise ValueError(f"hbm_bytes={self.hbm_bytes} holds no page: one page needs "
                             f"{self.page_bytes(num_layers, num_heads, head_dim)} bytes")
        return int(n)

    def max_pinned_pages(self, num_pages: int) -> int:
        """Pinned-page budget for a pool of ``num_pages`` pages (at least 1)."""
        return max(1, int(num_pages * self.max_pinned_fraction))


@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs for the ranking forward (``RelayEngine(cuda_graphs=GraphConfig(...))``; see
    :mod:`relaygr_engine.engine.graphs`).

    Parameters
    ----------
    max_graphs : int
        Captured shape buckets kept (default 64); a new bucket past it replaces the least recently used one.
    prefill : bool
        Graph pre-infer forwards too (default True): a pre-infer chunk is rows without candidates, so fixed chunk
        sizes fall in few buckets (counted apart: ``prefill_graph_replays``, ``prefill_graph_captures``).
    """

    max_graphs: int = 64
    prefill: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_graphs", _positive_int("max_graphs", self.max_graphs))
        if not isinstance(self.prefill, bool):
            raise ValueError(f"prefill must be a bool, got {self.prefill!r}")


def _positive_int(name: str, value) -> int:
    """:func:`check_int` with ``minimum=1``."""
    return check_int(name, value, 1)
