"""Paged prefix attention: new history tokens and candidates of a batch of users against their cached prefix pages.

One launch serves a varlen batch. Work is split into tiles of ``BLOCK_M`` consecutive query rows of one user and one
head; a program takes one tile (or, with a persistent grid, loops over tiles ``pid, pid + programs, ...``). For its
tile it

1. starts candidate rows from their one self term (a candidate sees itself, never another candidate), so the rows'
   own K/V are dead before the key loops; then streams
2. the user's cached prefix from the paged cache, ``BLOCK_N`` tokens at a time (each token's page id read from
   ``kv_indices``, the partial last page masked), which every row of the tile sees; then
3. the user's new history K/V rows (causal for history rows; all of them for candidate rows).

All candidates of a user in one tile share every prefix page load, so the prefix is read once per tile, not once per
candidate.

Modes
-----
softmax  online softmax in fp32 (running max and sum, ``exp2`` with the scale folded in).
hstu     ``sum_j SiLU(alpha * q.k_j + rab_ij) v_j / N``: pointwise, so no running max or log-sum-exp. The relative
         bias ``rab`` is computed in the kernel from integer positions and int64 timestamps (``pos_bias[min(dq,
         P-1)] + ts_bias[bucket(t_q - t_k)]``), never materialised as a ``[queries, keys]`` tensor.

Positions: prefix token ``j`` -> ``j``; new history token ``i`` -> ``P + i``; every candidate -> ``P + n`` (the
history length). So key ``j`` of the concatenated sequence [prefix | new history] has position ``j``, and row ``r``
sees keys ``j < P + min(r + 1, n)``.

Only plain pointer arithmetic with masks is used (no block pointers, no tensor descriptors), so the same source runs
through triton-ascend and Triton's CPU interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .._host import ship
from ..config import AttentionMode, TimeBucket, parse_choice
from ..ops import check_time_buckets, time_bucket_bounds
from . import _common as C
from ._split import merge_splits, pick_splits

__all__ = ["prefix_attention", "plan_prefix_attention", "PrefixAttentionPlan", "AttentionMode", "KernelConfig",
           "pick_config"]


# ------------------------------------------------------------------------------------------------------ kernel
# Integer arguments that change from batch to batch. Triton specialises an int argument on its value being 1 or a
# multiple of 16 by default, so each new combination compiles a new binary (about a second, paid by the ranking
# that meets it: ``relaygr bench slo`` on an H100 saw 2-second P99 stalls); these are passed as plain values.
_BATCH_ARGS = ["num_work", "num_programs", "num_splits", "split_len", "total_q"]


@triton.jit
def _time_bucket(dt, TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr):
    """``min(bit_length(max(dt, 0)), TS_BITS)`` of an int64 tile, with integer compares and shifts only.

    Clamping ``dt`` to ``2**TS_BITS - 1`` first caps the bit length at ``TS_BITS`` (bit_length is monotone); a
    binary search over ``TS_STEPS`` shifts (``2**TS_STEPS >= TS_BITS``) then counts the bits. Values of at most 31
    bits are searched in int32.
    """
    d = tl.minimum(tl.maximum(dt, 0), (1 << TS_BITS) - 1)
    if TS_BITS <= 31:
        d = d.to(tl.int32)
    bits = tl.zeros_like(d)
    for j in tl.static_range(TS_STEPS - 1, -1, -1):  # shift by 2**j: 32, 16, ..., 1
        big = d >= (1 << (1 << j))
        d = tl.where(big, d >> (1 << j), d)
        bits += tl.where(big, 1 << j, 0)
    return bits + d  # d is now 0 or 1: the top bit


@triton.jit
def _table_bucket(dt, bounds_ptr, num_bounds, TS_ABS: tl.constexpr, TS_STEPS: tl.constexpr):
    """How many steps of the non-decreasing int64 table ``bounds[0 .. num_bounds)`` are ``<= dt`` (``|dt|`` with
    ``TS_ABS``): a binary search that tries to extend the count by ``2**j`` for ``j = TS_STEPS - 1 .. 0``
    (``2**TS_STEPS > num_bounds``), one gather from the small table per step."""
    d = dt
    if TS_ABS:
        d = tl.where(dt < 0, -dt, dt)
    count = tl.zeros_like(d).to(tl.int32)
    for j in tl.static_range(TS_STEPS - 1, -1, -1):
        probe = count + (1 << j)
        ok = probe <= num_bounds
        step = tl.load(bounds_ptr + (probe - 1), mask=ok, other=0)
        count = tl.where(ok & (step <= d), probe, count)
    return count


@triton.jit(do_not_specialize=_BATCH_ARGS)
def _prefix_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,                     # [total_q, H, D]
    kv_ptr,                                           # [num_pages, 2, PAGE_SIZE, H, D]
    kv_indptr_ptr, kv_indices_ptr, kv_last_ptr,       # paged layout (int32)
    cu_q_ptr, num_cand_ptr,                           # query layout (int32)
    tile_user_ptr, tile_row_ptr,                      # [num_tiles] (int32): user and first segment row of a tile
    pos_bias_ptr, ts_bias_ptr, ts_cache_ptr, ts_q_ptr, ts_bounds_ptr,
    ws_ptr, ml_ptr,                                   # SPLIT: partial outputs [S, total_q, H, D], [S, total_q, H, 2]
    num_heads, num_work, num_programs, num_splits, split_len, total_q,
    num_pos, num_ts_bounds, stride_ts_page,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_page, stride_kv, stride_slot, stride_head,
    scale, inv_norm,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HSTU: tl.constexpr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr,
    TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr, TS_TABLE: tl.constexpr, TS_ABS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PERSISTENT: tl.constexpr, SPLIT: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    qk_scale = scale * LOG2E
    if PERSISTENT:
        work_end = num_work
        work_step = num_programs
    else:
        # One tile per program: a single-trip loop the compiler removes, so nothing is hoisted out of it and kept
        # live across the key loops (a runtime-bounded loop here costs registers: ptxas spills, see pick_config).
        work_end = pid + 1
        work_step = 1

    for work in range(pid, work_end, work_step):
        split = work % num_splits                               # prefix chunk (0 without SPLIT)
        tile = work // num_splits // num_heads
        head = work // num_splits % num_heads
        user = tl.load(tile_user_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
        q_start = tl.load(cu_q_ptr + user)
        seqlen = tl.load(cu_q_ptr + user + 1) - q_start
        n_hist = seqlen - tl.load(num_cand_ptr + user)
        page_lo = tl.load(kv_indptr_ptr + user)
        n_pages = tl.load(kv_indptr_ptr + user + 1) - page_lo
        prefix_len = tl.where(n_pages > 0, (n_pages - 1) * PAGE_SIZE + tl.load(kv_last_ptr + user), 0)

        rows = row0 + offs_m                                    # rows of the user's segment
        row_ok = rows < seqlen
        is_cand = row_ok & (rows >= n_hist)
        g_rows = (q_start + rows).to(tl.int64)                  # rows of q/k/v/out
        q = tl.load(q_ptr + g_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        key_limit = prefix_len + tl.minimum(rows + 1, n_hist)   # row r sees keys j < key_limit[r]
        if HAS_POS:
            q_pos = prefix_len + tl.minimum(rows, n_hist)
        if HAS_TS:
            t_q = tl.load(ts_q_ptr + g_rows, mask=row_ok, other=0)

        # Candidate rows start from their self term (key = the row's own k/v, distance 0, time delta 0), so the
        # state enters the key loop already holding it and k/v of the rows are dead before the loop.
        self_on = is_cand & (rows * 0 + split == 0)            # split 0 also owns the self term and new rows
        self_ok = self_on[:, None] & d_ok[None, :]
        k_self = tl.load(k_ptr + g_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :],
                         mask=self_ok, other=0.0).to(tl.float32)
        v_self = tl.load(v_ptr + g_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :],
                         mask=self_ok, other=0.0).to(tl.float32)
        s_self = tl.sum(q.to(tl.float32) * k_self, 1)
        if HSTU:
            s_self = s_self * scale
            if HAS_POS:
                s_self += tl.load(pos_bias_ptr)
            if HAS_TS:
                s_self += tl.load(ts_bias_ptr)
            p_self = tl.where(self_on, s_self * tl.sigmoid(s_self), 0.0)
            acc = p_self[:, None] * v_self
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # unused in hstu mode
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            m_i = tl.where(self_on, s_self * qk_scale, -1.0e30)  # running max of log2-scaled logits
            l_i = tl.where(self_on, 1.0, 0.0)                     # running sum of exp2(logit - m_i)
            acc = v_self                                          # zero for non-candidate rows
        new_end = tl.minimum(n_hist, row0 + BLOCK_M)            # new history keys any row of the tile sees

        # Phase 0 streams this split's cached prefix tokens from pages ([0, P) without SPLIT), phase 1 the new
        # history rows [P, P + new_end) (split 0 only).
        for PHASE in tl.static_range(2):
            if PHASE == 0:
                lo = split * split_len
                hi = tl.minimum(lo + split_len, prefix_len)
            else:
                lo = prefix_len
                hi = tl.where(split == 0, prefix_len + new_end, prefix_len)
            for start in range(lo, hi, BLOCK_N):
                kpos = start + offs_n
                k_ok = kpos < hi
                kd_ok = k_ok[:, None] & d_ok[None, :]
                if PHASE == 0:
                    page = tl.load(kv_indices_ptr + page_lo + kpos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
                    slot = kpos % PAGE_SIZE
                    kv_off = page * stride_page + slot * stride_slot + head * stride_head
                    k = tl.load(kv_ptr + kv_off[:, None] + offs_d[None, :], mask=kd_ok, other=0.0)
                    v = tl.load(kv_ptr + stride_kv + kv_off[:, None] + offs_d[None, :], mask=kd_ok, other=0.0)
                    if HAS_TS:
                        t_k = tl.load(ts_cache_ptr + page * stride_ts_page + slot, mask=k_ok, other=0)
                else:
                    k_rows = (q_start + kpos - prefix_len).to(tl.int64)
                    k = tl.load(k_ptr + k_rows[:, None] * stride_kt + head * stride_kh + offs_d[None, :],
                                mask=kd_ok, other=0.0)
                    v = tl.load(v_ptr + k_rows[:, None] * stride_vt + head * stride_vh + offs_d[None, :],
                                mask=kd_ok, other=0.0)
                    if HAS_TS:
                        t_k = tl.load(ts_q_ptr + k_rows, mask=k_ok, other=0)

                visible = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] < key_limit[:, None])
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                if HSTU:
                    s = s * scale
                    if HAS_POS:
                        dist = tl.maximum(tl.minimum(q_pos[:, None] - kpos[None, :], num_pos - 1), 0)
                        s += tl.load(pos_bias_ptr + dist, mask=visible, other=0.0)
                    if HAS_TS:
                        if TS_TABLE:
                            bucket = _table_bucket(t_q[:, None] - t_k[None, :], ts_bounds_ptr, num_ts_bounds,
                                                   TS_ABS, TS_STEPS)
                        else:
                            bucket = _time_bucket(t_q[:, None] - t_k[None, :], TS_BITS, TS_STEPS)
                        s += tl.load(ts_bias_ptr + bucket, mask=visible, other=0.0)
                    p = tl.where(visible, s * tl.sigmoid(s), 0.0)
                    acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                else:
                    s = tl.where(visible, s * qk_scale, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(s - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                    m_i = m_new

        if SPLIT:  # partial state, merged by merge_splits: un-normalised sums (and softmax's running max and sum)
            ws_rows = (split * total_q + g_rows) * num_heads + head
            tl.store(ws_ptr + ws_rows[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
            if not HSTU:
                tl.store(ml_ptr + ws_rows * 2, m_i, mask=row_ok)
                tl.store(ml_ptr + ws_rows * 2 + 1, l_i, mask=row_ok)
        else:
            if HSTU:
                out = acc * inv_norm
            else:
                out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(out_ptr + g_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of one call (``block_n=None``: autotuned on CUDA)."""

    block_m: int
    block_n: Optional[int]
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None


# Interpreter: small tiles keep numpy work per step low while leaving few steps per tile.
INTERPRETER_BLOCK_M = 32
INTERPRETER_BLOCK_N = 32
# CUDA. Without tensor descriptors (kept out for triton-ascend), every K/V tile is loaded through a tensor of
# pointers, which costs registers: a [64, 128] tile's addresses alone take ~64 registers per thread at 8 warps. The
# tile rule below is read off ``relaygr bench ptxas`` (sm_90, bf16, page 64; benchmarks/results/ptxas-sm90-*.txt):
# * 8 warps: with 4, every config with BLOCK_M = 128 or head dim 128 spills (0.2 to 22 KB per thread);
# * BLOCK_M = 128 for head dims <= 64, 64 above: at head dim 128 every BLOCK_M = 128 config spills (120 B softmax,
#   ~1-2 KB hstu), while BLOCK_M = 64 with BLOCK_N = 32 compiles spill-free in both modes. BLOCK_M = 64 reads each
#   prefix block twice as often per query row; whether that costs more than the spills it avoids is for a GPU run
#   to settle (``relaygr bench kernels --block-m 64,128``), and ``block_m=`` overrides the rule;
# * BLOCK_N in {32, 64}, autotuned with 2 or 3 stages: BLOCK_N = 32 with 2 stages is spill-free for every head dim
#   and mode above, the other three spill at most 280 B; BLOCK_N = 128 spills up to 3 KB and needs 100-230 KB of
#   shared memory in hstu mode.
CUDA_NUM_WARPS = 8
CUDA_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=CUDA_NUM_WARPS, num_stages=s) for bn in (32, 64)
                for s in (2, 3)]
# NPU (triton-ascend): one fixed config sized for the ~192 KB unified buffer; no autotuning.
NPU_BLOCK_M = 64
NPU_BLOCK_N = 64
# No length in the key: a serving process autotunes each compiled variant once, at its first call (a warm-up),
# never again at a new history length (each autotune benchmarks every config: about half a second, which a ranking
# caught behind it would pay; ``relaygr bench slo`` on an H100 saw P99 jump from 12 to 323 ms). ``relaygr bench
# kernels`` clears the choices per shape (``reset_autotuning``) so each shape is timed with its own best config.
AUTOTUNE_KEYS = ["HEAD_DIM", "PAGE_SIZE", "BLOCK_M", "HSTU", "HAS_POS", "HAS_TS", "PERSISTENT", "SPLIT"]


def pick_config(device: torch.device, dtype: torch.dtype, head_dim: int, block_m: int | None = None,
                block_n: int | None = None, *, interpreted: bool = False) -> KernelConfig:
    """Tile sizes for a call; ``block_n=None`` on CUDA means "autotune" (see the rule above ``CUDA_CONFIGS``)."""
    if interpreted or device.type == "cpu":
        return KernelConfig(block_m or INTERPRETER_BLOCK_M, block_n or INTERPRETER_BLOCK_N)
    if device.type == "npu":  # pragma: no cover - needs an Ascend host
        return KernelConfig(block_m or NPU_BLOCK_M, block_n or NPU_BLOCK_N)
    if block_m is None:
        block_m = 64 if dtype == torch.float32 or head_dim > 64 else 128
    return KernelConfig(block_m, block_n, num_warps=CUDA_NUM_WARPS if block_n else None,
                        num_stages=2 if block_n else None)


_autotuned = None


def reset_autotuning() -> None:
    """Forget the autotuned configs chosen so far (the next call of each variant tunes again)."""
    if _autotuned is not None:
        _autotuned.cache.clear()


def _autotuned_kernel():
    global _autotuned
    if _autotuned is None:
        _autotuned = triton.autotune(configs=CUDA_CONFIGS, key=AUTOTUNE_KEYS)(_prefix_attention_kernel)
    return _autotuned


# ------------------------------------------------------------------------------------------------------ launcher
def _bias_table(name: str, table, device: torch.device) -> torch.Tensor:
    """A 1-D floating bias table as contiguous fp32 (tables are tiny; the kernel reads fp32)."""
    C.check_tensor(name, table, ndim=1, dtypes=C.FLOAT_DTYPES + (torch.float64,), device=device, contiguous=False)
    if table.numel() < 1:
        raise ValueError(f"{name} must have at least one entry")
    return table.to(torch.float32).contiguous()


def _dot_precision(dtype: torch.dtype, allow_tf32: bool):
    """``tl.dot`` input precision: IEEE fp32 unless TF32 is allowed; the backend default for fp16/bf16."""
    if dtype != torch.float32:
        return None
    return "tf32" if allow_tf32 else "ieee"


def _ts_search(num_buckets: int) -> tuple[int, int]:
    """(TS_BITS, TS_STEPS) for ``bucket = min(bit_length(d), num_buckets - 1)`` of int64 deltas."""
    bits = min(num_buckets - 1, 63)
    steps = 0
    while (1 << steps) < bits:
        steps += 1
    return bits, steps


@dataclass(frozen=True)
class PrefixAttentionPlan:
    """The schedule of one varlen batch: built once on the host, reused by every layer of a forward.

    Like FlashInfer's ``plan``/``run`` split. The metadata is read from the device once to check it and to build
    the tile table. Then each layer's :func:`prefix_attention` call launches with no device-to-host read (a read
    waits for all queued GPU work, so one per layer would serialise the host's launches with the kernels).

    Attributes
    ----------
    block_m : int
        Query rows per tile (the tile table is built for it).
    batch, total_q : int
        Users and query rows the plan was built for (checked against each call).
    page_size, num_pages : int
        Of the cache the page table was checked against (checked against each call).
    tile_user, tile_row : int32 Tensor [num_tiles]
        On the device: each tile's user and first row in that user's segment.
    max_key_len : int
        Longest prefix + segment of a user.
    max_prefix_len : int
        Longest cached prefix of a user (what split-prefix scheduling divides).
    num_cached : int
        Cached tokens over all users.
    """

    block_m: int
    batch: int
    total_q: int
    page_size: int
    num_pages: int
    tile_user: torch.Tensor
    tile_row: torch.Tensor
    max_key_len: int
    num_cached: int
    max_prefix_len: int = 0

    @property
    def num_tiles(self) -> int:
        return self.tile_user.numel()


def _plan(table: C.PageTable, *, page_size, num_pages, block_m, device) -> PrefixAttentionPlan:
    """Build the tile table of a checked layout (:func:`~relaygr_engine.kernels._common.check_page_table`'s values)
    on ``device``."""
    b = table.batch
    cu, last = torch.tensor(table.cu_seqlens_q), torch.tensor(table.kv_last_page_len)
    indptr = torch.tensor(table.kv_indptr)
    seqlens, pages = cu[1:] - cu[:-1], indptr[1:] - indptr[:-1]
    prefix = torch.where(pages > 0, (pages - 1) * page_size + last, torch.zeros_like(pages))
    table_dev = ship([C.tile_table(seqlens.tolist(), block_m)], device)[0]  # never waits for the device
    max_key_len = int((prefix + seqlens).max()) if b else 0
    return PrefixAttentionPlan(block_m, b, table.cu_seqlens_q[-1], page_size, num_pages, table_dev[0], table_dev[1],
                               max_key_len, int(prefix.sum()), int(prefix.max()) if b else 0)


def plan_prefix_attention(cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len, *, kv_cache,
                          block_m=None) -> PrefixAttentionPlan:
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
        Query rows per tile; default: the device's rule (:func:`pick_config`).

    Returns
    -------
    PrefixAttentionPlan
        Pass it as ``plan=`` to :func:`prefix_attention` for each layer.
    """
    C.check_tensor("kv_cache", kv_cache, ndim=5, dtypes=C.FLOAT_DTYPES)
    _check_block("block_m", block_m)
    device = kv_cache.device
    num_pages, _, page_size = kv_cache.shape[:3]
    tables = (cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len)
    on_host = all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tables)
    table = C.check_page_table(*tables, device=torch.device("cpu") if on_host else device, num_pages=num_pages,
                               page_size=page_size, contiguous=True)
    cfg = pick_config(device, kv_cache.dtype, kv_cache.shape[-1], block_m,
                      interpreted=C.is_interpreted(_prefix_attention_kernel))
    return _plan(table, page_size=page_size, num_pages=num_pages, block_m=cfg.block_m, device=device)


def _check_block(name: str, size) -> None:
    if size is not None and (not isinstance(size, int) or size < 16 or size & (size - 1)):
        raise ValueError(f"{name} must be a power of two >= 16, got {size!r}")


def prefix_attention(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates, *,
                     mode, scale, hstu_norm=1.0, pos_bias=None, ts_bias=None, ts_cache=None, ts_q=None,
                     time_bucket="log2", persistent=False, block_m=None, block_n=None, allow_tf32=False,
                     plan: Optional[PrefixAttentionPlan] = None, splits: Optional[int] = None) -> torch.Tensor:
    """Attention of each user's new history rows and candidates over its cached prefix pages and new rows.

    Parameters
    ----------
    q, k, v : Tensor [total_q, H, D]
        Per user, its new history rows then its candidates, user after user (fp32/fp16/bf16, one dtype).
    kv_cache : Tensor [num_pages, 2, page_size, H, D]
        One layer's paged cache (index 0 = K, 1 = V), dtype of ``q``.
    kv_indptr : int32 Tensor [B+1]
        Offsets of each user's pages in ``kv_indices``.
    kv_indices : int32 Tensor [nnz]
        Page ids, user after user, in token order.
    kv_last_page_len : int32 Tensor [B]
        Tokens in the user's last page (1..page_size); 0 for a user without cached prefix.
    cu_seqlens_q : int32 Tensor [B+1]
        Row offsets of each user's segment in ``q``.
    num_candidates : int32 Tensor [B]
        The last ``num_candidates[b]`` rows of user ``b``'s segment are candidates.
    mode : {"softmax", "hstu"}
    scale : float
        softmax: logit scale; hstu: ``alpha`` in ``SiLU(alpha * q.k + rab)``.
    hstu_norm : float
        hstu: the sum is divided by this constant ``N`` (> 0).
    pos_bias : Tensor [P], optional
        hstu: bias by position distance ``q_pos - k_pos`` clamped to ``P - 1`` (read as fp32).
    ts_bias : Tensor [NB], optional
        hstu: bias by time bucket of ``t_q - t_k`` under ``time_bucket`` (read as fp32); needs ``ts_q`` and, when
        a user has cached pages, ``ts_cache``.
    ts_cache : int64 Tensor [num_pages, page_size], optional
        Timestamps of the cached tokens.
    ts_q : int64 Tensor [total_q], optional
        Timestamps of the query rows (candidates: the request time).
    time_bucket : {"log2", "ln_0301", "sqrt_60"}
        The bucket function (:func:`relaygr_engine.ops.time_buckets`): ``"log2"``
        (``min(bit_length(max(d, 0)), NB - 1)``) is computed with shifts, the others by a binary search over the
        steps of :func:`relaygr_engine.ops.time_bucket_bounds`.
    persistent : bool
        Launch one program per core (SMs / AI cores; a few in the interpreter), each looping over tiles, instead
        of one program per tile.
    block_m, block_n : int, optional
        Tile sizes (powers of two >= 16); default: by device (CUDA autotunes ``block_n``).
    allow_tf32 : bool
        fp32 inputs on CUDA: let ``tl.dot`` use TF32 (faster, ~1e-3 relative error) instead of IEEE fp32.
    plan : PrefixAttentionPlan, optional
        This batch's schedule from :func:`plan_prefix_attention` (built once, reused by every layer): the call then
        reads nothing back from the device. It must have been built for this batch's metadata (its batch size,
        row count and device are checked, the table contents are trusted). Without it, the call plans for itself.
    splits : int, optional
        Split each user's cached prefix over this many programs (flash-decoding style), their partial sums merged
        after the kernel (:func:`~relaygr_engine.kernels._split.merge_splits`). Default: by device
        (:func:`~relaygr_engine.kernels._split.pick_splits`: on CUDA when the tiles alone leave most SMs idle, e.g.
        one user's few hundred rows against a long prefix; never elsewhere).

    Returns
    -------
    Tensor [total_q, H, D]
        In the dtype of ``q``; accumulation in fp32.

    Notes
    -----
    Without ``plan``, the metadata (``cu_seqlens_q``, ``num_candidates``, ``kv_indptr``, ``kv_last_page_len`` and
    the range of ``kv_indices``) is read on the host once per call to check it and to build the tile table. Rows of
    one user are tiled together, so a tile of candidates reads each prefix page once.
    """
    mode = parse_choice(AttentionMode, mode, "mode")
    hstu = mode is AttentionMode.HSTU
    C.check_tensor("q", q, ndim=3, dtypes=C.FLOAT_DTYPES)
    device = q.device
    total_q, num_heads, head_dim = q.shape
    C.check_tensor("k", k, shape=q.shape, dtypes=(q.dtype,), device=device)
    C.check_tensor("v", v, shape=q.shape, dtypes=(q.dtype,), device=device)
    C.check_tensor("kv_cache", kv_cache, shape=(None, 2, None, num_heads, head_dim), dtypes=(q.dtype,),
                   device=device)
    num_pages, _, page_size = kv_cache.shape[:3]
    # The values are read (once) only when this call plans for itself and has rows to compute.
    table = C.check_page_table(cu_seqlens_q, num_candidates, kv_indptr, kv_indices, kv_last_page_len,
                               device=device, num_pages=num_pages, page_size=page_size, total_q=total_q,
                               read=plan is None and total_q > 0, contiguous=True)
    batch = num_candidates.numel()
    scale = C.check_scalar("scale", scale)
    inv_norm = 1.0 / C.check_scalar("hstu_norm", hstu_norm, positive=True)
    if not hstu and (pos_bias is not None or ts_bias is not None):
        raise ValueError("pos_bias and ts_bias apply to mode='hstu' only; softmax mode takes no bias")
    if pos_bias is not None:
        pos_bias = _bias_table("pos_bias", pos_bias, device)
    if ts_bias is not None:
        ts_bias = _bias_table("ts_bias", ts_bias, device)
        ts_fn = check_time_buckets("ts_bias entries", ts_bias.numel(), time_bucket)
        if ts_q is None:
            raise ValueError("ts_bias needs ts_q (timestamps of the query rows) and, when a user has cached pages, "
                             "ts_cache (timestamps of the cached tokens)")
        C.check_tensor("ts_q", ts_q, shape=(total_q,), dtypes=(torch.int64,), device=device)
        if ts_cache is not None:
            C.check_tensor("ts_cache", ts_cache, shape=(num_pages, page_size), dtypes=(torch.int64,),
                           device=device)
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    if plan is not None:
        if not isinstance(plan, PrefixAttentionPlan):
            raise ValueError(f"plan must be a PrefixAttentionPlan (plan_prefix_attention), got {C.describe(plan)}")
        built = (plan.batch, plan.total_q, plan.page_size, plan.num_pages, plan.tile_user.device)
        if built != (batch, total_q, page_size, num_pages, device):
            raise ValueError(f"plan was built for {plan.batch} users, {plan.total_q} rows and {plan.num_pages} "
                             f"pages of {plan.page_size} tokens on {plan.tile_user.device}, got {batch} users, "
                             f"{total_q} rows and {num_pages} pages of {page_size} tokens on {device}")
        if block_m is not None and block_m != plan.block_m:
            raise ValueError(f"block_m={block_m} differs from the plan's block_m={plan.block_m}")
    C.check_launchable(device, _prefix_attention_kernel)
    if device.type == "cpu" and q.dtype != torch.float32:
        raise ValueError(f"the CPU interpreter runs fp32 only (numpy has no bf16), got q.dtype={q.dtype}")

    out = torch.empty_like(q)
    if total_q == 0:
        return out
    cfg = pick_config(device, q.dtype, head_dim, plan.block_m if plan is not None else block_m, block_n,
                      interpreted=C.is_interpreted(_prefix_attention_kernel))
    if plan is None:
        plan = _plan(table, page_size=page_size, num_pages=num_pages, block_m=cfg.block_m, device=device)
    if ts_bias is not None and ts_cache is None and plan.num_cached:
        raise ValueError(f"ts_bias needs ts_cache: {plan.num_cached} cached tokens have no timestamps")
    num_splits = pick_splits(device, plan.num_tiles * num_heads, plan.max_prefix_len, splits,
                             interpreted=C.is_interpreted(_prefix_attention_kernel))
    split_len = C.cdiv(max(plan.max_prefix_len, 1), num_splits)
    num_work = plan.num_tiles * num_heads * num_splits
    programs = C.num_programs(device, num_work, persistent)
    ws = ml = q  # stand-ins without SPLIT (never written)
    if num_splits > 1:
        ws = torch.empty((num_splits, total_q, num_heads, head_dim), dtype=torch.float32, device=device)
        ml = ws if hstu else torch.empty((num_splits, total_q, num_heads, 2), dtype=torch.float32, device=device)
    has_pos, has_ts = pos_bias is not None, ts_bias is not None
    ts_bits, ts_steps = _ts_search(ts_bias.numel()) if has_ts else (1, 0)
    ts_table = has_ts and ts_fn is not TimeBucket.LOG2
    ts_bounds = time_bucket_bounds(ts_fn, ts_bias.numel(), device) if ts_table else None
    if ts_table:
        ts_steps = ts_bounds.numel().bit_length()
    dummy = q  # stands in for absent optional pointers (never read: their flags are off)
    args = (
        q, k, v, out, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates,
        plan.tile_user, plan.tile_row,
        pos_bias if has_pos else dummy, ts_bias if has_ts else dummy,
        ts_cache if has_ts and ts_cache is not None else dummy, ts_q if has_ts else dummy,
        ts_bounds if ts_table else dummy, ws, ml,
        num_heads, num_work, programs, num_splits, split_len, total_q,
        pos_bias.numel() if has_pos else 1, ts_bounds.numel() if ts_table else 0,
        ts_cache.stride(0) if has_ts and ts_cache is not None else 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        scale, inv_norm,
    )
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, C.next_pow2(head_dim)), PAGE_SIZE=page_size,
                BLOCK_M=cfg.block_m, HSTU=hstu, HAS_POS=has_pos, HAS_TS=has_ts, TS_BITS=ts_bits,
                TS_STEPS=ts_steps, TS_TABLE=ts_table, TS_ABS=ts_table and ts_fn.absolute,
                DOT_PRECISION=_dot_precision(q.dtype, allow_tf32), PERSISTENT=persistent, SPLIT=num_splits > 1)
    with C.device_guard(device):
        if cfg.block_n is None:
            _autotuned_kernel()[(programs,)](*args, **meta)
        else:
            extra = {}
            if cfg.num_warps is not None:
                extra = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            _prefix_attention_kernel[(programs,)](*args, BLOCK_N=cfg.block_n, **meta, **extra)
    if num_splits > 1:
        out.copy_(merge_splits(ws, None if hstu else ml, inv_norm))
    return out
