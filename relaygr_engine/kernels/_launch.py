"""Every launch decision of a paged prefix-attention call, made in one place, each with its reason (:func:`decide`).

A :class:`Launch` says how :func:`~relaygr_engine.kernels.prefix_attention.prefix_attention` runs a batch's tiles:
the tile config (rows per kind, key block autotuned or fixed), how full key blocks are read (pointers, TMA, or
autotuned between them), whether the sm_90 kernel takes the tiles' full cached blocks, the prefix split count and
keys per split, one stream or two, where HSTU's relative bias comes from, the dtype of split partials and the SiLU
form. The decisions read the batch's tile counts and lengths, the layer's shape and the device as a
:class:`~relaygr_engine.kernels._target.Target` only: host-side arithmetic, the same for a call on this device and
for a plan made for a GPU that is not here (``relaygr explain``). A batch's plan keeps its decisions per layer
signature (:meth:`~relaygr_engine.kernels._prefix_plan.PrefixAttentionPlan.launch`), so the layers of a forward
after the first decide nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import KVDtype, PageReads
from . import _common as C
from . import _hopper_launch as HL
from ._bias_table import hist_rows_fit
from ._prefix_config import CUDA_MAX_BLOCK_N, TMA_EITHER, TMA_ONLY, KernelConfig, page_read_mode
from ._split import MAX_SPLITS, split_dtype as pick_split_dtype

__all__ = ["Launch", "decide", "fast_silu"]

_READS = {0: "pointers", TMA_EITHER: "autotuned (pointers or TMA)", TMA_ONLY: "TMA"}


@dataclass(frozen=True)
class Launch:
    """How one call runs a batch's tiles; ``reasons`` says why for each decision (name -> reason).

    Attributes
    ----------
    cfg : KernelConfig
        Rows of a candidate tile, key block (None: autotuned), warps and stages where fixed.
    hist_block_m : int
        Rows of a history tile.
    tma_reads : int
        ``TMA_READS``: 0 pointers, 1 autotuned between pointers and TMA, 2 TMA.
    hopper : int
        The sm_90 kernel's key block where it takes the tiles' full cached blocks, 0 where it does not.
    num_splits, split_len : int
        Programs sharing each (tile, head)'s keys, and the keys each takes.
    concurrent : bool
        History and candidate tiles launched on two streams.
    hist_table : bool
        History tiles read HSTU's bias from the per-layer table (else they compute it in the kernel).
    user_rows : int
        Table rows of the candidate tiles (one per user; 0 without a table).
    split_dtype : torch.dtype
        Dtype of the split partials.
    fast_silu : bool
        HSTU's SiLU through one approximate tanh.
    """

    cfg: KernelConfig
    hist_block_m: int
    tma_reads: int
    hopper: int
    num_splits: int
    split_len: int
    concurrent: bool
    hist_table: bool
    user_rows: int
    split_dtype: torch.dtype
    fast_silu: bool
    reasons: tuple = ()

    @property
    def slots(self) -> int:
        """Split partials per row: the splits, plus one for the portable kernel's rest beside the sm_90 kernel."""
        return self.num_splits + (self.hopper > 0)

    def describe(self) -> dict:
        """Each decision and its reason, as ``{name: "choice: reason"}``."""
        return dict(self.reasons)


def fast_silu(device, dtype: torch.dtype) -> bool:
    """HSTU's SiLU through one approximate tanh (``FAST_SILU``): CUDA with 16-bit inputs, whose weights' rounding
    dwarfs its error; fp32 keeps the exact form (and the interpreter and triton-ascend have no PTX)."""
    return device.type == "cuda" and dtype != torch.float32


def decide(plan, target, cfg: KernelConfig, *, dtype: torch.dtype, head_dim: int, num_heads: int, num_pages: int,
           kv_dtype: KVDtype, hstu: bool, biased: bool, interpreted: bool, aligned: bool = True,
           page_reads: PageReads = PageReads.AUTO, splits: Optional[int] = None,
           value_splits: Optional[int] = None, concurrent_tiles: Optional[bool] = None,
           hopper_kernel: Optional[bool] = None, persistent: bool = False, fixed_block_n: Optional[int] = None,
           bias_table_bytes: Optional[int] = None, split_dtype: Optional[torch.dtype] = None) -> Launch:
    """The launch decisions of a call on ``plan``'s tiles (see the module doc).

    Parameters
    ----------
    plan : PrefixAttentionPlan
        The batch's tiles (counts, heights, longest keys); its tile tables are not read.
    target : Target or torch.device
        The device the launch runs on (or is planned for).
    cfg : KernelConfig
        The tile config picked for the call (:func:`~relaygr_engine.kernels._prefix_config.pick_config`).
    dtype, head_dim, num_heads, num_pages, kv_dtype
        The layer's shape: q's dtype, heads and head dim, the cache's pages and how they store K/V.
    hstu, biased : bool
        HSTU mode; with a relative bias (position or time).
    interpreted : bool
        The kernel runs in Triton's interpreter.
    aligned : bool
        The cache's data starts 16-byte aligned.
    page_reads, splits, value_splits, concurrent_tiles, hopper_kernel, persistent, bias_table_bytes, split_dtype
        The caller's options, as :func:`~relaygr_engine.kernels.prefix_attention.prefix_attention` takes them;
        ``fixed_block_n`` is its ``block_n``.

    Returns
    -------
    Launch
    """
    why: dict[str, str] = {}
    device = target
    page_size = plan.page_size
    why["tiles"] = (f"{plan.hist_tiles.shape[1]} history tile(s) of {plan.hist_block_m} rows, "
                    f"{plan.cand_tiles.shape[1]} candidate tile(s) of {plan.block_m} rows, x {num_heads} heads")
    why["config"] = _config_reason(cfg, target, interpreted)
    tma_reads, reads_why = page_read_mode(page_reads, device, kv_dtype=kv_dtype, head_dim=head_dim,
                                          page_size=page_size, block_n=cfg.block_n, aligned=aligned,
                                          num_pages=num_pages)
    why["page_reads"] = f"{_READS[tma_reads]}: {reads_why}" if ":" not in reads_why else reads_why
    hopper = 0
    if HL.requested(hopper_kernel):
        call = dict(device=device, dtype=dtype, quantized=kv_dtype.quantized, head_dim=head_dim, page_size=page_size,
                    block_m=plan.block_m, aligned=aligned, num_pages=num_pages, persistent=persistent,
                    value_splits=value_splits, fixed_block_n=fixed_block_n)
        hopper = HL.key_block(hopper_kernel, **call)
        why["sm90_kernel"] = (f"on: the tiles' full cached blocks in {hopper}-key blocks" if hopper else
                              f"off: {HL.why_not(**call)}")
    else:
        why["sm90_kernel"] = f"off (opt-in: {HL.ENV}=1 or hopper_kernel=True)"
    from ._prefix_plan import schedule

    num_splits, split_len, concurrent = schedule(plan, device, num_heads, block_n=cfg.block_n, splits=splits,
                                                 value_splits=value_splits, concurrent_tiles=concurrent_tiles,
                                                 hopper_dim=head_dim if hopper else 0, interpreted=interpreted)
    why["splits"] = _splits_reason(plan, target, num_heads, num_splits, split_len, splits, value_splits, hopper,
                                   interpreted)
    why["streams"] = _streams_reason(plan, target, num_heads, num_splits, concurrent, concurrent_tiles, hopper)
    user_rows, hist_table = 0, False
    if hstu and biased:
        user_rows = plan.batch if plan.cand_tiles.shape[1] else 0
        hist_table = hist_rows_fit(plan.hist_tiles, plan.hist_block_m, plan.max_key_len,
                                   cfg.block_n or CUDA_MAX_BLOCK_N, bias_table_bytes)
        why["bias"] = (f"a per-layer table: {user_rows} candidate row(s) (one per user)"
                       + (f", {plan.hist_tiles.shape[1] * plan.hist_block_m} history rows" if hist_table else
                          "; history tiles compute theirs in the kernel (their rows would pass the table's budget)"
                          if plan.hist_tiles.shape[1] else ""))
    else:
        why["bias"] = "none" + (" (softmax)" if not hstu else " (no relative bias)")
    ws_dtype = pick_split_dtype(split_dtype, dtype, device)
    if num_splits + (hopper > 0) > 1:
        why["split_partials"] = (f"{str(ws_dtype).replace('torch.', '')}: "
                                 + ("as asked" if split_dtype is not None else "the model's 16-bit dtype (half the "
                                    "bytes)" if ws_dtype == dtype else "fp32 for an fp32 model"))
    fast = hstu and fast_silu(device, dtype)
    if hstu:
        why["silu"] = "one approximate tanh (CUDA, 16-bit inputs)" if fast else "exact"
    return Launch(cfg, plan.hist_block_m, tma_reads, hopper, num_splits, split_len, concurrent, hist_table,
                  user_rows, ws_dtype, fast, tuple(why.items()))


def _config_reason(cfg: KernelConfig, target, interpreted: bool) -> str:
    if interpreted or target.type == "cpu":
        return f"interpreter tiles: {cfg.block_n}-key blocks"
    if target.type == "npu":
        return f"fixed for triton-ascend's unified buffer: {cfg.block_n}-key blocks"
    if cfg.block_n is None:
        return ("autotuned at each variant's first call over the configs that compile spill-free on sm_90 "
                "(key block, warps, stages, page reads; _prefix_config.CUDA_CONFIGS)")
    return f"fixed: {cfg.block_n}-key blocks, {cfg.num_warps} warps, {cfg.num_stages} stages (as asked)"


def _splits_reason(plan, target, num_heads, num_splits, split_len, splits, value_splits, hopper,
                   interpreted) -> str:
    head = f"{num_splits} of {split_len} keys" if num_splits > 1 else f"none ({split_len} keys a program)"
    if splits is not None:
        return f"{head}: as asked"
    if target.type != "cuda" or interpreted:
        return f"{head}: split only on CUDA"
    work = plan.num_tiles * num_heads * (value_splits or 1)
    cores = C.num_cores(target)
    if hopper:
        return f"{head}: the sm_90 kernel's count (whole waves of the programs an SM holds)"
    waves = C.cdiv(work * num_splits, cores)
    return (f"{head}: the fewest waves of (keys / S + a program's fixed traffic) for {work} (tile, head) pair(s) "
            f"on {cores} SMs, at most {MAX_SPLITS}: {work * num_splits} programs, {waves} wave(s)")


def _streams_reason(plan, target, num_heads, num_splits, concurrent, concurrent_tiles, hopper) -> str:
    hist = plan.hist_tiles.shape[1] * num_heads * num_splits
    cand = plan.cand_tiles.shape[1] * num_heads
    if not (hist and cand):
        return "one: a single kind of tile"
    if concurrent_tiles is not None:
        return f"{'two' if concurrent else 'one'}: as asked"
    if hopper:
        return "two: the sm_90 kernel's launches beside the portable kernel's" if concurrent else "one"
    if concurrent:
        return f"two: the history launch's {hist} programs leave SMs idle ({C.num_cores(target)})"
    if target.type != "cuda":
        return "one: streams are CUDA's"
    return f"one: the history launch's {hist} programs fill the {C.num_cores(target)} SMs"
