"""The batch plan of the paged prefix-attention kernel (:mod:`relaygr_engine.kernels.prefix_attention`): a varlen
batch's layout checked and cut into history and candidate tiles once on the host, reused by every layer's call."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import quant
from .._host import ship
from ..config import KVDtype, parse_choice
from . import _common as C
from . import _hopper_launch as HL
from ._prefix_config import KernelConfig, history_tile_rows, pick_config
from ._prefix_kernel import prefix_attention_kernel
from ._split import split_layout

__all__ = ["PrefixAttentionPlan", "live_tiles", "plan_prefix_attention", "round_tiles", "schedule"]


@dataclass(frozen=True)
class PrefixAttentionPlan:
    """The schedule of one varlen batch: built once on the host, reused by every layer of a forward.

    Like FlashInfer's ``plan``/``run`` split. The metadata is read from the device once to check it and to build
    the tile tables. Then each layer's :func:`prefix_attention` call launches with no device-to-host read (a read
    waits for all queued GPU work, so one per layer would serialise the host's launches with the kernels).

    Attributes
    ----------
    block_m, hist_block_m : int
        Query rows per candidate tile and per history tile (the tile tables are built for them).
    batch, total_q : int
        Users and query rows the plan was built for (checked against each call).
    page_size, num_pages : int
        Of the cache the page table was checked against (checked against each call).
    hist_tiles, cand_tiles : int32 Tensor [2, n]
        On the device: the history tiles and the candidate tiles, each column a tile's user and first row in that
        user's segment (:func:`~relaygr_engine.kernels._common.tile_table`).
    max_key_len : int
        Longest prefix + segment of a user.
    max_context_len : int
        Longest cached prefix + new history of a user: the most keys a tile streams besides its candidates' own
        (what split-prefix scheduling divides).
    num_cached : int
        Cached tokens over all users.
    bias_index : dict or None
        Where the batch's HSTU bias index is kept between calls (:func:`~relaygr_engine.kernels._bias_table.
        bias_table`): the first layer's call with biases stores each table entry's position index and time bucket,
        and the later layers' calls, given the same timestamp tensors (the same objects), build their tables from
        it with two gathers per entry. Timestamps changed in place between calls that share a plan are not seen:
        a batch's plan serves that batch. None: every call computes its table from the timestamps.
    launches : dict
        The launch decisions made for this batch, per layer signature (:meth:`launch`).
    """

    block_m: int
    hist_block_m: int
    batch: int
    total_q: int
    page_size: int
    num_pages: int
    hist_tiles: torch.Tensor
    cand_tiles: torch.Tensor
    max_key_len: int
    num_cached: int
    max_context_len: int = 0
    bias_index: Optional[dict] = field(default=None, compare=False, repr=False)
    launches: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tiles(self) -> int:
        return self.hist_tiles.shape[1] + self.cand_tiles.shape[1]

    @property
    def device(self) -> torch.device:
        return self.hist_tiles.device

    def launch(self, key: tuple, decide):
        """The launch decisions (:class:`~relaygr_engine.kernels._launch.Launch`) of the calls on this batch with
        layer signature ``key``: ``decide()``'s, made once per signature (the layers of a forward share one)."""
        got = self.launches.get(key)
        if got is None:
            got = self.launches[key] = decide()
        return got


def live_tiles(hist_rows, cand_rows, block_m: tuple[int, int]) -> tuple[int, int]:
    """The tiles of a batch whose segments have ``hist_rows`` new history rows and ``cand_rows`` candidates each:
    ``(history tiles, candidate tiles)`` of ``block_m`` rows (the widths :func:`~relaygr_engine.kernels._common.
    tile_arrays` gives the two tables without padding)."""
    return (sum(C.cdiv(n, block_m[0]) for n in hist_rows), sum(C.cdiv(n, block_m[1]) for n in cand_rows))


def round_tiles(n: int, most: int) -> int:
    """A tile table's width for ``n`` live tiles in a CUDA graph bucket whose batches have at most ``most``: ``n``
    itself up to 8, else ``n`` rounded up to a multiple of an eighth of the power of two at or above it (at most
    25% spare tiles; 4 widths per power of two, so a bucket's batches share few graphs), at most ``most``."""
    if n <= 8:
        return min(n, most)
    step = (1 << (n - 1).bit_length()) // 8
    return min(C.cdiv(n, step) * step, most)


def _plan(table: C.PageTable, *, page_size, num_pages, cfg: KernelConfig, device) -> PrefixAttentionPlan:
    """Build the tile table of a checked layout (:func:`~relaygr_engine.kernels._common.check_page_table`'s values)
    on ``device``."""
    b = table.batch
    cu, last = torch.tensor(table.cu_seqlens_q), torch.tensor(table.kv_last_page_len)
    indptr = torch.tensor(table.kv_indptr)
    seqlens, pages = cu[1:] - cu[:-1], indptr[1:] - indptr[:-1]
    prefix = torch.where(pages > 0, (pages - 1) * page_size + last, torch.zeros_like(pages))
    max_key_len = int((prefix + seqlens).max()) if b else 0
    rows = seqlens.tolist()
    hist = [n - c for n, c in zip(rows, table.num_candidates)]
    context = prefix + torch.tensor(hist, dtype=prefix.dtype)
    hist_m = history_tile_rows(cfg, lambda m: sum(C.cdiv(n, m) for n in hist), max_key_len)
    tiles = ship(list(C.tile_table(rows, table.num_candidates, (hist_m, cfg.block_m))), device)  # never waits
    return PrefixAttentionPlan(cfg.block_m, hist_m, b, table.cu_seqlens_q[-1], page_size, num_pages,
                               tiles[0], tiles[1],
                               max_key_len, int(prefix.sum()), int(context.max()) if b else 0, {})


def plan_prefix_attention(cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len, *, kv_cache,
                          block_m=None, kv_dtype="model") -> PrefixAttentionPlan:
    """Check a batch's layout and build its tile schedule once, for every layer's :func:`prefix_attention` call.

    Parameters
    ----------
    cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len : int32 Tensors
        As in :func:`prefix_attention`, on the device of ``kv_cache``, or all five on the host (the CPU): host
        copies of the tables the layers will be given are checked and planned without any read from the device.
    kv_cache : Tensor [num_pages, 2, page_size, H, D]
        A layer's cache: its page count, page size, head dim, dtype and device decide the tiles (all layers of a
        model share them).
    block_m : int, optional
        Query rows per tile (both kinds); default: the device's rule (:func:`pick_config`).
    kv_dtype : {"model", "fp8_e4m3", "int8"}
        How ``kv_cache`` stores K/V (8-bit: ``uint8`` pages with scale slots, :mod:`relaygr_engine.quant`).

    Returns
    -------
    PrefixAttentionPlan
        Pass it as ``plan=`` to :func:`prefix_attention` for each layer.
    """
    kd = parse_choice(KVDtype, kv_dtype, "kv_dtype")
    C.check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(torch.uint8,) if kd.quantized else C.FLOAT_DTYPES)
    _check_block("block_m", block_m)
    device = kv_cache.device
    num_pages, page_size = kv_cache.shape[0], quant.token_page_size(kd, kv_cache.shape[2], kv_cache.shape[-1])
    tables = (cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len)
    on_host = all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tables)
    table = C.check_page_table(*tables, device=torch.device("cpu") if on_host else device, num_pages=num_pages,
                               page_size=page_size, contiguous=True)
    cfg = pick_config(device, kv_cache.dtype, kv_cache.shape[-1], block_m,
                      interpreted=C.is_interpreted(prefix_attention_kernel))
    return _plan(table, page_size=page_size, num_pages=num_pages, cfg=cfg, device=device)


def _check_block(name: str, size) -> None:
    if size is not None and (not isinstance(size, int) or size < 16 or size & (size - 1)):
        raise ValueError(f"{name} must be a power of two >= 16, got {size!r}")


def check_value_splits(value_splits, head_dim: int) -> None:
    """``value_splits``: None, or a power of two leaving each program at least 16 value columns."""
    most = max(16, C.next_pow2(head_dim)) // 16
    if value_splits is not None and (isinstance(value_splits, bool) or not isinstance(value_splits, int)
                                     or value_splits < 1 or value_splits & (value_splits - 1)
                                     or value_splits > most):
        raise ValueError(f"value_splits must be a power of two in [1, {most}] at head dim {head_dim} (each program "
                         f"takes at least 16 value columns), got {value_splits!r}")


def check_plan(plan, *, batch: int, total_q: int, page_size: int, num_pages: int, device: torch.device,
               block_m: Optional[int]) -> None:
    """``ValueError`` unless ``plan`` is a :class:`PrefixAttentionPlan` built for a batch of ``batch`` users and
    ``total_q`` rows over ``num_pages`` pages of ``page_size`` tokens on ``device`` (and, given, ``block_m`` rows a
    candidate tile). Its tables' contents are trusted."""
    if not isinstance(plan, PrefixAttentionPlan):
        raise ValueError(f"plan must be a PrefixAttentionPlan (plan_prefix_attention), got {C.describe(plan)}")
    built = (plan.batch, plan.total_q, plan.page_size, plan.num_pages, plan.device)
    if built != (batch, total_q, page_size, num_pages, device):
        raise ValueError(f"plan was built for {plan.batch} users, {plan.total_q} rows and {plan.num_pages} "
                         f"pages of {plan.page_size} tokens on {plan.device}, got {batch} users, "
                         f"{total_q} rows and {num_pages} pages of {page_size} tokens on {device}")
    if block_m is not None and block_m != plan.block_m:
        raise ValueError(f"block_m={block_m} differs from the plan's block_m={plan.block_m}")


def schedule(plan: PrefixAttentionPlan, device: torch.device, num_heads: int, *, block_n: Optional[int] = None,
             splits: Optional[int] = None, value_splits: Optional[int] = None,
             concurrent_tiles: Optional[bool] = None, hopper_dim: int = 0,
             interpreted: Optional[bool] = None) -> tuple[int, int, bool]:
    """How a call runs ``plan``'s tiles: ``(num_splits, split_len, concurrent)``, the prefix splits of each
    (tile, head) and their keys (:func:`~relaygr_engine.kernels._split.split_layout`; a caller's value splits
    count as programs, the autotuner's are not known here), and whether the launches run on two streams
    (:func:`_concurrent`). ``hopper_dim``: the head dim where the sm_90 kernel takes the full blocks (0: it does
    not): its own split count (:func:`~relaygr_engine.kernels._hopper_launch.pick_splits`), and the portable
    kernel's share on the side stream unless ``concurrent_tiles=False``. ``device``: a ``torch.device`` or a
    :class:`~relaygr_engine.kernels._target.Target`; ``interpreted``: the kernel runs in Triton's interpreter
    (None: as this process's kernel was decorated)."""
    if interpreted is None:
        interpreted = C.is_interpreted(prefix_attention_kernel)
    target = HL.pick_splits(device, hopper_dim, HL.programs_per_split(plan, num_heads), plan.max_context_len) \
        if hopper_dim and splits is None else None
    num_splits, split_len = split_layout(device, plan.num_tiles * num_heads * (value_splits or 1),
                                         plan.max_context_len, block_n, splits, target=target,
                                         interpreted=interpreted)
    if hopper_dim:
        return num_splits, split_len, device.type == "cuda" and concurrent_tiles is not False
    concurrent = _concurrent(concurrent_tiles, device, plan.hist_tiles.shape[1] * num_heads * num_splits,
                             plan.cand_tiles.shape[1] * num_heads)
    return num_splits, split_len, concurrent


def _concurrent(concurrent_tiles: Optional[bool], device: torch.device, hist_work: int, cand_work: int) -> bool:
    """Whether a call's two launches run on two streams: both have work (``hist_work`` programs of history tiles,
    ``cand_work`` (tile, head) pairs of candidate tiles), and ``concurrent_tiles``; None: on CUDA where the history
    launch alone leaves SMs idle (fewer programs than SMs: a ranking's few new rows), the only case where the
    candidate launch has SMs to run on beside it (else the side stream is host work for nothing)."""
    if not (hist_work and cand_work):
        return False
    if concurrent_tiles is not None:
        return concurrent_tiles
    return device.type == "cuda" and hist_work < C.num_cores(device)
