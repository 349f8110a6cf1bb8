"""Host side of the Hopper kernel (:mod:`relaygr_engine.kernels._hopper`): when a call may use it, its launch beside
the portable kernel's, and a pure-torch twin of what it writes (its offline compile for sm_90:
:mod:`benchmarks.tools.ptxas_hopper`).

It is opt-in: right on an H100 and an H200, faster than the portable kernel on the long HSTU shapes (geomean 0.2988
vs 0.3483 ms, ``benchmarks/results/gpu-h200-2026-11-26b/``) but slower in a ranking (1.65 vs 1.30 ms,
``benchmarks/results/gpu-h100-2026-11-26/``):
``prefix_attention(..., hopper_kernel=True)`` (``ValueError`` naming why where it cannot run) or
``RELAYGR_HOPPER_KERNEL=1`` (used where it can, the portable kernel elsewhere). Where its compile or launch raises,
it is off for the rest of the process (logged once, :func:`why_not` says why), and a call that had not asked for it
explicitly runs again on the portable kernel alone (:func:`falls_back`).
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from .._warn import warn_once
from ..config import env_flag
from . import _common as C
from ._target import capability

__all__ = ["ENV", "LaunchError", "falls_back", "fail", "requested", "pages_fit", "takes", "why_not", "key_block",
           "block_n", "programs_per_split", "pick_splits", "clear_slot", "launch", "emulate", "state"]

# A program's fixed traffic in pick_splits' model: q's load, its partial's store and the merge's read of it, three
# [64, D] tiles, i.e. 3 x 64 / 2 keys' worth of K and V bytes.
OVERHEAD_ROWS = 3 * 64

ENV = "RELAYGR_HOPPER_KERNEL"
log = logging.getLogger(__name__)
_failed: Optional[str] = None  # why the kernel is off for this process (its compile or launch raised)
_launches = 0  # its launches in this process that returned (eager calls and graph captures: a replay runs no Python)


class LaunchError(RuntimeError):
    """The Hopper kernel's compile or launch raised (the cause chained)."""


def falls_back(launcher):
    """Decorate the launcher (``prefix_attention``): a call whose Hopper launch raises :class:`LaunchError` runs
    again with ``hopper_kernel=False``, unless it asked for the kernel with ``hopper_kernel=True`` (it then gets
    the error). Nothing the failed attempt wrote is read: the rerun allocates its own partials and output."""
    @functools.wraps(launcher)
    def call(*args, **kwargs):
        try:
            return launcher(*args, **kwargs)
        except LaunchError:
            if kwargs.get("hopper_kernel"):
                raise
            return launcher(*args, **dict(kwargs, hopper_kernel=False))
    return call


def requested(hopper_kernel: Optional[bool]) -> bool:
    """``hopper_kernel`` as given, else ``RELAYGR_HOPPER_KERNEL`` (``1``/``true``/``on``/``yes``)."""
    if hopper_kernel is not None:
        if not isinstance(hopper_kernel, bool):
            raise ValueError(f"hopper_kernel must be a bool or None, got {hopper_kernel!r}")
        return hopper_kernel
    return env_flag(ENV)


def block_n(head_dim: int) -> int:
    """The kernel's key block at ``head_dim`` (a candidate tile's full blocks are multiples of it)."""
    from ._hopper import CONFIGS

    return CONFIGS[head_dim][0]


def pages_fit(page_size: int, key_block: int) -> bool:
    """Whether the kernel's key blocks of ``key_block`` keys fit ``page_size``-token pages: a block within one page,
    or over whole pages of at least 8 tokens (one copy each; the shared-memory swizzle repeats every 8 rows)."""
    return page_size % key_block == 0 or (key_block % page_size == 0 and page_size >= 8)


def takes(block_m: int) -> bool:
    """Whether the kernel takes tiles of ``block_m`` rows (64 or 128: one or two programs of one warp group,
    ``_hopper.SUB_M`` rows each; spelled here, where no Gluon is imported: this runs on every call)."""
    return block_m in (64, 128)


def why_not(*, device, dtype: torch.dtype, quantized: bool, head_dim: int, page_size: int, block_m: int,
            aligned: bool, num_pages: int, persistent: bool, value_splits, fixed_block_n) -> Optional[str]:
    """Why a call cannot run the Hopper kernel (None: it can): it takes tiles of 64 or 128 rows (``block_m``: the
    candidate tiles'; history tiles of another height stay on the portable kernel), HSTU or softmax, in bf16/fp16
    on an sm_90 GPU, pages in the model's dtype at head dim 64, 128 or 256, a page a whole number of its key
    blocks, one program per tile (no persistent grid, value splits or fixed key block), unless it failed earlier in
    this process. ``device``: a ``torch.device`` or a :class:`~relaygr_engine.kernels._target.Target`;
    ``aligned``: the cache's data starts 16-byte aligned; ``num_pages``: its pages."""
    from ._hopper import CONFIGS

    if _failed is not None:
        return f"it failed earlier in this process ({_failed})"
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if capability(device)[0] != 9:  # (read once per device)
        return "needs an sm_90 GPU (Hopper's wgmma)"
    try:
        import triton.experimental.gluon.language.nvidia.hopper  # noqa: F401
    except ImportError as err:
        return f"needs Triton's Gluon with Hopper support ({err})"
    bn = block_n(head_dim) if head_dim in CONFIGS else 0
    problems = [(dtype not in (torch.bfloat16, torch.float16), f"bf16 or fp16 only, got {dtype}"),
                (quantized, "pages in the model's dtype only"),
                (head_dim not in CONFIGS, f"head dim 64, 128 or 256, got {head_dim}"),
                (bn > 0 and not pages_fit(page_size, bn),
                 f"page_size must be a multiple or a divisor >= 8 of the key block ({bn}), got {page_size}"),
                (not takes(block_m), f"candidate tiles of 64 or 128 rows, got {block_m}"),
                (not aligned, "kv_cache's data must start 16-byte aligned"),
                (num_pages * 2 * page_size >= 2 ** 31, "more K/V rows than int32 coordinates reach"),
                (persistent, "no persistent grid"),
                ((value_splits or 1) > 1, "no value splits"),
                (fixed_block_n is not None, "no fixed block_n")]
    return next((why for bad, why in problems if bad), None)


def key_block(hopper_kernel: Optional[bool], **call) -> int:
    """The Hopper kernel's key block where a call (``call``: :func:`why_not`'s arguments) runs it, else 0; with
    ``hopper_kernel=True`` where it cannot, ``ValueError`` naming why."""
    why = why_not(**call)
    if why is not None and hopper_kernel:
        raise ValueError(f"hopper_kernel=True cannot run here: {why}")
    return block_n(call["head_dim"]) if why is None else 0


def programs_per_split(plan, num_heads: int) -> int:
    """Programs of one split of the kernel's launches for ``plan``: a program per 64 rows of each tile it may take
    (candidate tiles, and history tiles of a height it takes), per head."""
    from ._hopper import SUB_M

    tiles = ((plan.cand_tiles, plan.block_m), (plan.hist_tiles, plan.hist_block_m))
    return num_heads * sum(t.shape[1] * (rows // SUB_M.value) for t, rows in tiles if takes(rows))


def pick_splits(device: torch.device, head_dim: int, programs_per_split: int, max_keys: int) -> int:
    """How many splits the kernel's launches cut each tile's keys into: :func:`~relaygr_engine.kernels._split.
    least_waves` for ``programs_per_split`` programs, ``slots`` = SMs x the programs an SM holds (registers:
    ``MAXNREG`` a thread, 8 warps a program), which share its tensor cores, and a 64-row program's fixed traffic
    (:data:`OVERHEAD_ROWS`). At NVIDIA's ranking shape (24 programs a split, 132 SMs x 2, 4096 keys) 11 splits
    make one wave. 1 on a device other than CUDA."""
    from . import _hopper as H
    from ._split import least_waves

    if device.type != "cuda":
        return 1
    _, _, maxnreg = H.CONFIGS[head_dim]
    slots = C.num_cores(device) * (65536 // (maxnreg * 256))
    return least_waves(programs_per_split, slots, max_keys, OVERHEAD_ROWS / 2)


def clear_slot(ws: torch.Tensor, ml: Optional[torch.Tensor]) -> None:
    """Make one slot of the split partials (``ws [total_q, H, D]``, softmax's ``ml [total_q, H, 2]``) add nothing
    to the merge, for rows whose tiles no launch writes into it: HSTU's zero; softmax's a split without keys (the
    kernels' initial running max, a zero sum)."""
    from ._merge_kernel import NO_KEY_MAX

    ws.zero_()
    if ml is not None:
        ml[..., 0].fill_(NO_KEY_MAX.value)
        ml[..., 1].zero_()


def launch(q, ws, ml, kv_cache, kv_indices, kv_indptr, kv_last_page_len, cu_seqlens_q, num_candidates, tiles,
           block_m: int, cand: bool, table, *, hstu: bool, page_size: int, num_splits: int, split_len: int,
           scale: float, inv_norm: float) -> None:
    """Write the full cached key blocks of ``tiles`` (int32 ``[2, n]``: user and first segment row of each tile of
    ``block_m`` rows, candidate tiles if ``cand`` else history tiles) as split partials: split ``s`` of each (tile,
    head) its share of them into ``ws[s]`` (``ws [S + 1, total_q, H, D]``; slot ``S``, the rest of the keys, is the
    portable kernel's), softmax's running max and sum into ``ml[s]`` (``[S + 1, total_q, H, 2]`` fp32; unused for
    HSTU). ``table``: the rows of the bias table for this kind of tile (candidate tiles: one per user; history
    tiles: one per tile row), halved; None without a bias (always for softmax). Anything it raises (the descriptor,
    the compile, the launch) turns the kernel off for the process: :func:`fail`."""
    try:
        _launch(q, ws, ml, kv_cache, kv_indices, kv_indptr, kv_last_page_len, cu_seqlens_q, num_candidates, tiles,
                block_m, cand, table, hstu=hstu, page_size=page_size, num_splits=num_splits, split_len=split_len,
                scale=scale, inv_norm=inv_norm)
    except Exception as err:  # noqa: BLE001 (whatever failed, the portable kernel can still answer)
        fail(err)


def _launch(q, ws, ml, kv_cache, kv_indices, kv_indptr, kv_last_page_len, cu_seqlens_q, num_candidates, tiles,
            block_m, cand, table, *, hstu, page_size, num_splits, split_len, scale, inv_norm) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import _hopper as H

    total_q, num_heads, head_dim = q.shape
    bn, stages, maxnreg = H.CONFIGS[head_dim]
    gdtype = H.gl.bfloat16 if q.dtype == torch.bfloat16 else H.gl.float16
    rows = kv_cache.shape[0] * 2 * page_size
    piece = min(bn, page_size)  # rows a copy (a block spans whole pages where they are smaller)
    desc = TensorDescriptor(kv_cache.view(rows, num_heads * head_dim), [rows, num_heads * head_dim],
                            [num_heads * head_dim, 1], [piece, head_dim], H.kv_layout(head_dim, piece, gdtype))
    parts = block_m // H.SUB_M.value
    programs = tiles.shape[1] * parts * num_heads * num_splits
    if programs == 0:
        return
    tb = ws if table is None else table
    with C.device_guard(q.device):
        H.hopper_kernel[(programs,)](
            q, ws, ml, desc, kv_indices, kv_indptr, kv_last_page_len, cu_seqlens_q, num_candidates, tiles[0],
            tiles[1], tb, num_heads, num_splits, split_len, total_q, q.stride(0), q.stride(1),
            0 if table is None else table.stride(0), scale, inv_norm,
            HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_N=bn, STAGES=stages, HSTU=hstu, HAS_BIAS=table is not None,
            CAND_TILES=cand, M_PARTS=parts,
            **H.layouts(head_dim, bn, gdtype), num_warps=4, maxnreg=maxnreg)
    global _launches
    _launches += 1


def state() -> dict:
    """What this process did with the kernel, for a benchmark's report: ``launches`` (those that returned: eager
    calls and CUDA-graph captures, a replay launching without Python) and ``failed`` (why it is off, or None)."""
    return {"launches": _launches, "failed": _failed}


def fail(err: BaseException) -> None:
    """Turn the kernel off for this process after ``err`` (logged once) and raise :class:`LaunchError` from it."""
    global _failed
    _failed = f"{type(err).__name__}: {err}"[:500]
    warn_once(log, ("hopper", "failed"), "the sm_90 prefix-attention kernel failed (%s); it is off for this "
              "process and the portable kernel runs instead", _failed)
    raise LaunchError(_failed) from err


def emulate(q, ws, ml, kv_cache, kv_indices, kv_indptr, kv_last_page_len, cu_seqlens_q, num_candidates, tiles,
            block_m: int, cand: bool, table, *, hstu: bool, page_size: int, num_splits: int, split_len: int,
            scale: float, inv_norm: float, halved: bool = True, key_block: Optional[int] = None) -> None:
    """What :func:`launch` writes, in torch (fp32 math; the tests' stand-in where no sm_90 GPU runs it, and its
    reference on one): for each row of the tiles, head and split ``s``, over the split's share of the user's full
    cached key blocks, HSTU's ``sum SiLU(q.k_j scale + bias_j) v_j / N`` into ``ws[s]``, or softmax's
    ``sum 2^(x_j - m) v_j / l`` with ``x_j = q.k_j scale log2(e)``, its max ``m`` (``NO_KEY_MAX`` without keys) and sum
    ``l`` into ``ws[s]`` and ``ml[s]`` (the kernel's ``m`` may lag the exact max by up to its ``RESCALE_AT``, its
    ``l`` then smaller by ``2^lag``: the same merged result). ``halved``: the table's entries are half the bias
    (the fast-SiLU form the kernel reads)."""
    from ._merge_kernel import NO_KEY_MAX

    total_q, num_heads, head_dim = q.shape
    bn = key_block or block_n(head_dim)
    cu, ncand = cu_seqlens_q.tolist(), num_candidates.tolist()
    indptr, last = kv_indptr.tolist(), kv_last_page_len.tolist()
    for t, (user, first) in enumerate(zip(tiles[0].tolist(), tiles[1].tolist())):
        start, end = cu[user], cu[user + 1] - (0 if cand else ncand[user])
        rows = list(range(start + first, min(start + first + block_m, end)))
        if not rows:
            continue
        n_pages = indptr[user + 1] - indptr[user]
        prefix = (n_pages - 1) * page_size + last[user] if n_pages else 0
        full = prefix // bn * bn
        pages = kv_indices[indptr[user]:indptr[user + 1]].long()
        keys = kv_cache[pages, 0].reshape(-1, num_heads, head_dim)[:full].float()
        vals = kv_cache[pages, 1].reshape(-1, num_heads, head_dim)[:full].float()
        logits = torch.einsum("rhd,khd->hrk", q[rows].float(), keys) * scale  # [H, rows, full]
        if table is not None:
            trows = [user] * len(rows) if cand else [t * block_m + r for r in range(len(rows))]
            logits = logits + table[trows, :full].float() * (2.0 if halved else 1.0)
        for s in range(num_splits):
            lo, hi = s * split_len, min((s + 1) * split_len, full)
            part = torch.zeros(len(rows), num_heads, head_dim, device=q.device)
            m = torch.full((num_heads, len(rows)), NO_KEY_MAX.value, device=q.device)
            l = torch.zeros(num_heads, len(rows), device=q.device)
            if hi > lo and hstu:
                w = torch.nn.functional.silu(logits[:, :, lo:hi])
                part = torch.einsum("hrk,khd->rhd", w, vals[lo:hi]) * inv_norm
            elif hi > lo:
                x = logits[:, :, lo:hi] * 1.4426950408889634
                m = x.amax(-1)
                p = torch.exp2(x - m.unsqueeze(-1))
                l = p.sum(-1)
                part = torch.einsum("hrk,khd->rhd", p, vals[lo:hi]) / l.t().unsqueeze(-1)
            ws[s, rows] = part.to(ws.dtype)
            if not hstu:
                ml[s, rows] = torch.stack((m, l), -1).transpose(0, 1)
