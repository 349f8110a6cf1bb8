"""The forward context: what a :class:`~relaygr_engine.attention.layer.PrefixAttention` reads while a model runs.

A model's forward receives a :class:`~relaygr_engine.batch.RelayBatch`; its attention layers find the batch, and in
a relay forward the pages, through the context set around the call (as vLLM's and SGLang's attention layers do):

* :func:`batch_context` (dense): no cache; each layer runs dense masked attention over the batch. Training, the
  oracle and tests use it; a model may also enter it in its own ``forward`` so that a plain ``model(batch)`` call
  works (inside a relay forward it does nothing).
* :func:`paged_context` (relay): set by the engine. Each layer writes the new history rows' K/V into their pages
  and attends over the cached prefix pages with the batch's plan (built once for all layers).

The contexts of a thread live on a thread-local stack, which TorchDynamo traces: a model compiled with
``fullgraph=True`` enters :func:`batch_context` and its layers find their context without a graph break. A
compiled graph reads only ``relay``, the batch (dense) and ``layer_index``/``kv_caches`` (relay); the page tables
and plans are read by the ``relaygr::prefix_attention`` op's implementation (:mod:`relaygr_engine.attention.op`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from ..batch import RelayBatch
from ..config import KVDtype

__all__ = ["ForwardContext", "PagedState", "batch_context", "current_context", "paged_context"]


@dataclass(eq=False)
class PagedState:
    """The pages of one relay forward, shared by every layer.

    Attributes
    ----------
    kv_caches : list of Tensor [num_pages, 2, page_size, H, D]
        One per registered layer (index = registration order in ``model.modules()``).
    kv_flat : list of Tensor [num_pages * 2 * page_size, H, D] or None
        The same caches viewed flat (row ``page * 2 * page_size + slot`` is K, ``page_size`` rows further V); None:
        the layers view them.
    kv_indptr, kv_indices, kv_last_page_len : IntTensor
        Each user's cached prefix pages (FlashInfer's layout; see
        :func:`relaygr_engine.attention.ops.paged_prefix_attention`).
    ts_cache : LongTensor [num_pages, page_size] or None
        Timestamps of the cached tokens (None when the batch has no timestamps).
    write_rows : LongTensor [W] or None
        Batch rows whose K/V each layer stores in the cache (new history rows of entries being written).
    write_pages, write_slots : LongTensor [W] or None
        Where row ``write_rows[i]`` goes: page ``write_pages[i]``, slot ``write_slots[i]``.
    write_kv_rows : LongTensor [W] or None
        The same place as a row of a layer's cache viewed as ``[num_pages * 2 * page_size, H, D]`` (K; V is
        ``page_size`` rows further). Set with the other three by :meth:`set_writes`.
    backend : AttentionBackend
    plan : PrefixAttentionPlan or None
        The Triton schedule of the batch (None on the torch backend).
    torch_plan : TorchPlan or None
        The torch backend's per-batch index tables (:mod:`relaygr_engine.attention.torch_plan`); None where the batch is
        too large for padded attention or the backend is Triton.
    """

    kv_caches: Sequence[torch.Tensor]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    ts_cache: Optional[torch.Tensor]
    backend: object
    write_rows: Optional[torch.Tensor] = None
    write_pages: Optional[torch.Tensor] = None
    write_slots: Optional[torch.Tensor] = None
    write_kv_rows: Optional[torch.Tensor] = None
    plan: object = None
    torch_plan: object = None
    kv_flat: Optional[Sequence[torch.Tensor]] = None
    compiled: bool = False  # torch plan path: the compiled attention core (RelayEngine(compile_attention=True))
    kv_dtype: KVDtype = KVDtype.MODEL  # how the pages store K/V (8-bit: quantised on write, dequantised on read)
    compute_dtype: Optional[torch.dtype] = None  # what attention computes in (default: the pages' dtype)
    validated: bool = False  # the first layer checked the op's arguments (later layers share them)
    _slot_mapping: Optional[torch.Tensor] = None

    def flat(self, index: int) -> torch.Tensor:
        """Layer ``index``'s cache viewed ``[num_pages * 2 * page_size, H, D]``."""
        if self.kv_flat is not None:
            return self.kv_flat[index]
        cache = self.kv_caches[index]
        return cache.view(-1, *cache.shape[3:])

    def set_writes(self, rows: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the K/V of batch rows ``rows`` at ``(pages, slots)`` in every layer (computed once per batch)."""
        self.write_rows, self.write_pages, self.write_slots = rows, pages, slots
        self.write_kv_rows = pages * (2 * self.kv_caches[0].shape[2]) + slots

    def slot_mapping(self, num_rows: int, page_size: int) -> torch.Tensor:
        """``page * page_size + slot`` of every batch row, -1 where a row is not stored (the Triton ``kv_write``)."""
        if self._slot_mapping is None:
            m = torch.full((num_rows,), -1, dtype=torch.long, device=self.kv_indptr.device)
            if self.write_rows is not None:
                m[self.write_rows] = self.write_pages * page_size + self.write_slots
            self._slot_mapping = m
        return self._slot_mapping


@dataclass(eq=False)
class ForwardContext:
    """The batch a forward runs on, and its pages in a relay forward (``paged`` None: dense attention).

    A compiled model reads ``relay`` (a bool: which graph runs), ``batch`` in a dense forward (the model's own
    argument) and ``layer_index``/``kv_caches`` in a relay forward (which page tensors a layer's op writes); the
    rest (page tables, plans) is read by the op's implementation only, never traced.
    """

    batch: RelayBatch
    paged: Optional[PagedState] = None
    layer_index: dict = field(default_factory=dict)  # id(PrefixAttention) -> its layer index (relay forwards)
    dense_cache: dict = field(default_factory=dict)  # the batch's masks and bias indices, shared by the layers
    layers: Sequence[nn.Module] = ()  # relay forwards: the model's attention layers, in layer-index order
    kv_caches: tuple = ()  # relay forwards: each layer's page tensor (what its op writes)

    @property
    def relay(self) -> bool:
        return self.paged is not None


class _Frames(threading.local):
    """The forward contexts of this thread, innermost last.

    A thread-local list rather than a ``ContextVar``: TorchDynamo traces reads and appends of it, so a model
    compiled with ``fullgraph=True`` enters :func:`batch_context` and its layers find their context without a
    graph break.
    """

    def __init__(self) -> None:
        self.stack: list = []


_FRAMES = _Frames()


def current_context() -> Optional[ForwardContext]:
    """The context of the forward running now in this thread, or None outside any."""
    stack = _FRAMES.stack
    return stack[-1] if stack else None


class _Entered:
    """Pushes ``ctx`` on this thread's context stack for a ``with`` block (a class: TorchDynamo inlines it)."""

    def __init__(self, ctx: Optional[ForwardContext]) -> None:
        self.ctx = ctx

    def __enter__(self) -> Optional[ForwardContext]:
        if self.ctx is not None:
            _FRAMES.stack.append(self.ctx)
            return self.ctx
        return current_context()

    def __exit__(self, *exc) -> bool:
        if self.ctx is not None:
            _FRAMES.stack.pop()
        return False


def batch_context(batch: RelayBatch) -> _Entered:
    """Run the attention layers called inside over ``batch`` with dense masked attention (no cache).

    A no-op when a forward over this same batch is already running (e.g. the engine's relay forward), so a model
    may enter it in its own ``forward``. Use as ``with batch_context(batch): ...``; a model compiled with
    ``torch.compile(fullgraph=True)`` may enter it.

    Parameters
    ----------
    batch : RelayBatch
        Every user's rows must start at position 0 (dense attention cannot see a cached prefix).
    """
    if not isinstance(batch, RelayBatch):
        raise ValueError(f"batch must be a RelayBatch, got {type(batch).__name__}")
    ctx = current_context()
    if ctx is not None and ctx.batch is batch:
        return _Entered(None)
    if batch.has_prefix:
        raise ValueError(f"batch must start every user at position 0 for dense attention (no cache), got starts "
                         f"{list(batch.start)}")
    return _Entered(ForwardContext(batch))


def paged_context(batch: RelayBatch, paged: PagedState, layers: Sequence[nn.Module]) -> _Entered:
    """Run a relay forward of ``batch`` over ``paged``; ``layers`` are the model's attention layers in order."""
    return _Entered(ForwardContext(batch, paged, {id(m): i for i, m in enumerate(layers)}, layers=tuple(layers),
                                   kv_caches=tuple(paged.kv_caches)))
