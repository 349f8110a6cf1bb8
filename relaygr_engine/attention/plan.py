"""What a batch's attention runs, and why: one :class:`AttentionPlan` says it for every layer of a forward.

The decisions are made where they always are (the backend by :func:`~relaygr_engine.attention.ops._resolve_backend`,
the 8-bit read by :func:`relaygr_engine.quant.kernel_runs`, every kernel launch decision by
:func:`relaygr_engine.kernels._launch.decide`); a plan collects them with their reasons:

============  ==========================================================================================
backend       torch or Triton (``CacheConfig.attention_backend``, ``auto``: Triton on CUDA/NPU)
path          the torch backend's batch plan or per-user reference, or the Triton kernel
kv_read       how 8-bit pages are read (the kernel, or the torch path where its read is off)
kernel        tiles, config, page reads, sm_90 kernel, splits, streams, bias, partials, SiLU
============  ==========================================================================================

:func:`plan_attention` plans a batch shape for a device that need not be here (a
:class:`~relaygr_engine.kernels._target.Target`: ``relaygr explain``); :func:`of_forward` describes what a forward
ran, and :func:`log_once` logs it at INFO once per batch shape (as vLLM logs its attention backend).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .. import quant
from ..config import AttentionBackend, AttentionMode, KVDtype, parse_choice

__all__ = ["AttentionPlan", "plan_attention", "of_forward", "log_once"]

_log = logging.getLogger("relaygr_engine")
_logged: set = set()


@dataclass(frozen=True)
class AttentionPlan:
    """What a batch's attention runs on a device, and why.

    Attributes
    ----------
    target : str
        The device (``"NVIDIA H100 SXM (132 SMs, sm_90)"``).
    shape : dict
        The batch and layer shape the plan is for (users, cached, new and candidate rows, heads, head dim, dtype,
        page size, page format, mode).
    decisions : tuple of (str, str)
        ``(name, "choice: reason")`` in the order of the table in the module doc.
    """

    target: str
    shape: dict
    decisions: tuple

    def describe(self) -> str:
        """The plan as text: the target and shape, then one line per decision."""
        shape = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        width = max(len(k) for k, _ in self.decisions)
        return "\n".join([f"attention plan on {self.target}", f"  shape: {shape}"]
                         + [f"  {k:<{width}}  {v}" for k, v in self.decisions])

    def as_dict(self) -> dict:
        return {"target": self.target, "shape": dict(self.shape), "decisions": dict(self.decisions)}


def _backend(backend, target) -> tuple[AttentionBackend, str]:
    from .ops import _resolve_backend

    asked = parse_choice(AttentionBackend, backend, "backend")
    got = _resolve_backend(asked, target)
    if asked is not AttentionBackend.AUTO:
        return got, f"{got.value}: as configured (CacheConfig.attention_backend={asked.value!r})"
    if got is AttentionBackend.TRITON:
        return got, f"triton: backend='auto' on {target.type}"
    if target.type == "cpu":
        return got, "torch: backend='auto' on the CPU (the Triton kernel runs there only in its interpreter, for tests)"
    return got, f"torch: backend='auto' on {target.type}, where the Triton kernel does not import"


def _path(backend: AttentionBackend, dtype: torch.dtype, kv_dtype: KVDtype, target, torch_plan: bool) -> tuple:
    """``(reads through the kernel, path decision, kv_read decision or None)``."""
    kernel = backend is AttentionBackend.TRITON
    kv_read = None
    if kv_dtype.quantized:
        if kernel and not quant.kernel_runs(target):
            kernel = False
            kv_read = (f"torch path: the kernel's 8-bit read is off on CUDA until it passes there "
                       f"({quant.KERNEL_ENV}=1 runs it)")
        else:
            kv_read = ("the kernel: values and scales dequantised per key block" if kernel else
                       "torch: pages dequantised on gather")
    if kernel:
        return True, "the Triton kernel (relaygr_engine.kernels.prefix_attention)", kv_read
    if dtype not in (torch.float32, torch.float64):
        return False, "the per-user torch reference (attention.reference): the torch plan computes in fp32", kv_read
    if torch_plan:
        return False, ("the batch's torch plan: one gather of the cached rows, a padded attention per layer "
                       "(attention.torch_plan)"), kv_read
    return False, ("the per-user torch reference (attention.reference): the batch passes the torch plan's "
                   "padded size"), kv_read


def _decisions(backend, path, kv_read, launch) -> tuple:
    out = [("backend", backend), ("path", path)]
    if kv_read is not None:
        out.append(("kv_read", kv_read))
    if launch is not None:
        out += list(launch.describe().items())
    return tuple(out)


def plan_attention(target, *, mode, num_heads: int, head_dim: int, dtype, page_size: int,
                   cached: Sequence[int], new: Sequence[int], candidates: Sequence[int], kv_dtype="model",
                   backend="auto", biased: bool = True, **options) -> AttentionPlan:
    """What a batch of ``len(cached)`` users (user ``b``: ``cached[b]`` cached tokens, ``new[b]`` new history rows,
    ``candidates[b]`` candidates) would run on ``target`` (a :class:`~relaygr_engine.kernels._target.Target` or a
    ``torch.device``), one layer of ``num_heads x head_dim`` in ``dtype``; ``options``: the kernel's (splits,
    page_reads, hopper_kernel, ...). Host arithmetic only: nothing is allocated on ``target``.

    Raises
    ------
    ValueError
        Lengths of different counts or negative, a bad choice string (naming the argument).
    """
    from ..config import resolve_dtype

    mode = parse_choice(AttentionMode, mode, "mode")
    kd = parse_choice(KVDtype, kv_dtype, "kv_dtype")
    dtype = resolve_dtype(dtype)
    if not (len(cached) == len(new) == len(candidates) >= 1):
        raise ValueError(f"cached, new and candidates must give one length per user (at least one), got "
                         f"{len(cached)}, {len(new)} and {len(candidates)}")
    if min(*cached, *new, *candidates) < 0:
        raise ValueError("cached, new and candidates must be >= 0")
    from ..kernels._common import target_of

    target = target_of(target)
    be, be_why = _backend(backend, target)
    from .torch_plan import fits

    rows = [n + c for n, c in zip(new, candidates)]
    kernel, path, kv_read = _path(be, dtype, kd, target, fits(rows, cached, num_heads))
    shape = dict(users=len(cached), cached=_span(cached), new=_span(new), candidates=_span(candidates),
                 heads=num_heads, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), page_size=page_size,
                 kv_dtype=kd.value, mode=mode.value)
    launch = _launch(target, mode, num_heads, head_dim, dtype, page_size, cached, new, candidates, kd, biased,
                     options) if kernel else None
    return AttentionPlan(str(target), shape, _decisions(be_why, path, kv_read, launch))


def _span(values: Sequence[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else f"{min(values)}..{max(values)}"


def _launch(target, mode, num_heads, head_dim, dtype, page_size, cached, new, candidates, kd, biased, options):
    """The kernel's decisions for the batch: its tiles planned on the host (as the engine plans them from host
    copies of the page table), then :func:`~relaygr_engine.kernels._launch.decide`."""
    import numpy as np

    from ..kernels import _common as C
    from ..kernels._launch import decide
    from ..kernels._prefix_config import pick_config
    from ..kernels._prefix_plan import _plan

    pages = [C.cdiv(c, page_size) for c in cached]
    rows = [n + c for n, c in zip(new, candidates)]
    table = C.PageTable(cu_seqlens_q=np.cumsum([0, *rows]).tolist(),
                        num_candidates=list(candidates), kv_indptr=np.cumsum([0, *pages]).tolist(),
                        kv_last_page_len=[c - (p - 1) * page_size if p else 0 for c, p in zip(cached, pages)])
    interpreted = target.type == "cpu"
    cfg = pick_config(target, dtype, head_dim, options.pop("block_m", None), options.get("block_n"),
                      interpreted=interpreted)
    num_pages = max(1, sum(pages))
    plan = _plan(table, page_size=page_size, num_pages=num_pages, cfg=cfg, device=torch.device("cpu"))
    options["fixed_block_n"] = options.pop("block_n", None)
    return decide(plan, target, cfg, dtype=dtype, head_dim=head_dim, num_heads=num_heads, num_pages=num_pages,
                  kv_dtype=kd, hstu=mode is AttentionMode.HSTU, biased=biased, interpreted=interpreted, **options)


def of_forward(paged, target, dtype: torch.dtype, shape: dict, backend="auto") -> AttentionPlan:
    """What a forward over ``paged`` (a :class:`~relaygr_engine.attention.context.PagedState`) ran on ``target``:
    its backend (``backend``: as configured), path and page reads, and the kernel decisions its first layer made
    (``shape``: what the plan says the batch was)."""
    from ..kernels._common import target_of

    target = target_of(target)
    kernel, path, kv_read = _path(paged.backend, dtype, paged.kv_dtype, target, paged.torch_plan is not None)
    launches = getattr(paged.plan, "launches", None) or {}
    launch = next(iter(launches.values()), None) if kernel else None
    be_why = _backend(backend, target)[1]
    return AttentionPlan(str(target), dict(shape), _decisions(be_why, path, kv_read, launch))


def log_once(key, make: Callable[[], AttentionPlan], logger: Optional[logging.Logger] = None) -> bool:
    """Log ``make()``'s plan at INFO the first time ``key`` (a batch shape) is seen in this process, if INFO is on;
    returns whether it logged."""
    logger = logger or _log
    if key in _logged or not logger.isEnabledFor(logging.INFO):
        return False
    _logged.add(key)
    logger.info("%s", make().describe())
    return True
