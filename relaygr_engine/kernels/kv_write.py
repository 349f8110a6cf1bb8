"""Scatter new tokens' K/V (and optionally their timestamps) into their cache pages.

Token ``i`` goes to page ``slot_mapping[i] // page_size``, in-page offset ``slot_mapping[i] % page_size``; a negative
slot (padding) is skipped. A token's K (and V) row of ``H * D`` elements is contiguous in ``k`` and in its cache slot,
so a program copies a ``[BLOCK_T tokens, BLOCK_C columns]`` tile of rows with one gathered store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import quant
from ..config import KVDtype, parse_choice
from . import _common as C

__all__ = ["kv_write"]


@triton.jit(do_not_specialize=["num_tokens", "num_work", "num_programs"])  # per batch (see prefix_attention)
def _kv_write_kernel(
    kv_ptr,                                    # [num_pages, 2, PAGE_SIZE, H, D]
    k_ptr, v_ptr,                              # [n, H, D]
    slot_ptr,                                  # [n] int64: page * PAGE_SIZE + offset, < 0 = skip
    ts_ptr, ts_cache_ptr,                      # [n] int64 -> [num_pages, PAGE_SIZE] int64
    num_tokens, row_width, num_col_blocks, num_work, num_programs,
    stride_kt, stride_vt, stride_page, stride_kv, stride_slot, stride_ts_page,
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_TS: tl.constexpr,
):
    pid = tl.program_id(0)
    for work in range(pid, num_work, num_programs):
        tok_block = work // num_col_blocks
        col_block = work % num_col_blocks
        toks = tok_block * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = tl.load(slot_ptr + toks, mask=toks < num_tokens, other=-1).to(tl.int64)
        ok = slot >= 0
        slot = tl.where(ok, slot, 0)
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        dst = page * stride_page + off * stride_slot
        cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = ok[:, None] & (cols < row_width)[None, :]
        t64 = toks.to(tl.int64)
        k = tl.load(k_ptr + t64[:, None] * stride_kt + cols[None, :], mask=mask)
        tl.store(kv_ptr + dst[:, None] + cols[None, :], k.to(kv_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + t64[:, None] * stride_vt + cols[None, :], mask=mask)
        tl.store(kv_ptr + stride_kv + dst[:, None] + cols[None, :], v.to(kv_ptr.dtype.element_ty), mask=mask)
        if HAS_TS:
            if col_block == 0:
                ts = tl.load(ts_ptr + toks, mask=ok, other=0)
                tl.store(ts_cache_ptr + page * stride_ts_page + off, ts, mask=ok)


@triton.jit(do_not_specialize=["num_tokens", "num_work", "num_programs"])
def _kv_write_quant_kernel(
    kv_ptr, kvs_ptr,                           # 8-bit view / fp32 view of [num_pages, 2, PAGE_SIZE + S, H, D] bytes
    k_ptr, v_ptr,                              # [n, H, D]
    slot_ptr,                                  # [n] int64: page * PAGE_SIZE + offset, < 0 = skip
    num_tokens, num_heads, num_work, num_programs,
    stride_kt, stride_vt, stride_page, stride_kv, stride_slot,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr, INT8: tl.constexpr,
):
    """Quantise ``[BLOCK_T tokens, head]`` rows of K and V and store values and per-row scales
    (:mod:`relaygr_engine.quant`: ``scale = amax / QMAX``; int8 ``floor(x / scale + 0.5)``, fp8 rounded)."""
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for work in range(pid, num_work, num_programs):
        head = work % num_heads
        toks = work // num_heads * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = tl.load(slot_ptr + toks, mask=toks < num_tokens, other=-1).to(tl.int64)
        ok = slot >= 0
        slot = tl.where(ok, slot, 0)
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        t64 = toks.to(tl.int64)
        for KV in tl.static_range(2):
            if KV == 0:
                x = tl.load(k_ptr + t64[:, None] * stride_kt + head * HEAD_DIM + offs_d[None, :],
                            mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            else:
                x = tl.load(v_ptr + t64[:, None] * stride_vt + head * HEAD_DIM + offs_d[None, :],
                            mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), 1)
            scale = tl.where(amax > 0, amax / QMAX, 1.0)
            y = x / scale[:, None]
            if INT8:
                y = tl.minimum(tl.maximum(tl.floor(y + 0.5), -QMAX), QMAX)
            else:
                y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            base = page * stride_page + KV * stride_kv
            dst = base + off * stride_slot + head * HEAD_DIM
            tl.store(kv_ptr + dst[:, None] + offs_d[None, :], y.to(kv_ptr.dtype.element_ty),
                     mask=ok[:, None] & d_ok[None, :])
            tl.store(kvs_ptr + ((base + PAGE_SIZE * stride_slot) >> 2) + off * num_heads + head, scale, mask=ok)


# Tile shapes: tokens x columns of the H * D row. Larger column tiles on devices, small in the interpreter.
BLOCK_T = 16
BLOCK_C_DEVICE = 256
BLOCK_C_INTERPRETER = 128


def kv_write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, *,
             ts: torch.Tensor | None = None, ts_cache: torch.Tensor | None = None, persistent: bool = False,
             check_slots: bool = True, kv_dtype="model") -> None:
    """Write ``k``/``v`` rows into ``kv_cache`` in place at ``slot_mapping``.

    Parameters
    ----------
    kv_cache : Tensor [num_pages, 2, page_size, H, D]
        One layer's cache (fp32/fp16/bf16); rows are converted to its dtype. With an 8-bit ``kv_dtype``
        (``"int8"``, ``"fp8_e4m3"``): ``uint8 [num_pages, 2, page_size + S, H, D]`` (:mod:`relaygr_engine.quant`);
        rows are quantised, each with its own scale.
    k, v : Tensor [n, H, D]
        The new tokens' keys and values (fp32/fp16/bf16); each row dense, rows at any stride.
    slot_mapping : int64 (or int32) Tensor [n]
        ``page_id * page_size + offset`` of each token; ``< 0`` skips the token (padding). Two tokens with one slot
        leave either row there (unspecified which).
    ts : int64 Tensor [n], optional
        Timestamps of the tokens, written to ``ts_cache`` at the same slots.
    ts_cache : int64 Tensor [num_pages, page_size], optional
        Timestamps beside the pages; required with ``ts``.
    persistent : bool
        One program per core, each looping over tiles.
    check_slots : bool
        Read the slots' range on the host (one device sync) and raise ``IndexError`` past the cache; turn off only
        where the slots are known valid (an out-of-range slot would write outside the cache).
    kv_dtype : {"model", "int8", "fp8_e4m3"}
        The cache's format (:class:`~relaygr_engine.config.KVDtype`; fp8 on CUDA only).
    """
    kd = parse_choice(KVDtype, kv_dtype, "kv_dtype")
    C.check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(torch.uint8,) if kd.quantized else C.FLOAT_DTYPES)
    device = kv_cache.device
    num_pages, two, slots, num_heads, head_dim = kv_cache.shape
    page_size = quant.token_page_size(kd, slots, head_dim)
    if two != 2:
        raise ValueError(f"kv_cache must have shape [num_pages, 2, page_size, H, D], got {list(kv_cache.shape)}")
    C.check_tensor("k", k, shape=(None, num_heads, head_dim), dtypes=C.FLOAT_DTYPES, device=device, dense_rows=True)
    n = k.shape[0]
    C.check_tensor("v", v, shape=(n, num_heads, head_dim), dtypes=C.FLOAT_DTYPES, device=device, dense_rows=True)
    C.check_tensor("slot_mapping", slot_mapping, shape=(n,), dtypes=(torch.int64, torch.int32), device=device)
    if (ts is None) != (ts_cache is None):
        raise ValueError("give ts and ts_cache together (timestamps and where they go), or neither")
    if ts is not None:
        C.check_tensor("ts", ts, shape=(n,), dtypes=(torch.int64,), device=device)
        C.check_tensor("ts_cache", ts_cache, shape=(num_pages, page_size), dtypes=(torch.int64,), device=device)
    C.check_launchable(device, _kv_write_kernel)
    if device.type == "cpu" and ((kv_cache.dtype != torch.float32 and not kd.quantized) or k.dtype != torch.float32
                                 or v.dtype != torch.float32 or kd is KVDtype.FP8_E4M3):
        raise ValueError("the CPU interpreter runs fp32 and int8 only (numpy has no bf16 or fp8)")
    if n == 0:
        return
    if check_slots:
        hi = int(slot_mapping.max())
        if hi >= num_pages * page_size:
            raise IndexError(f"slot_mapping must hold slots < num_pages * page_size = {num_pages * page_size} "
                             f"(or < 0 to skip), got max {hi}")
    if kd.quantized:
        _write_quantized(kv_cache, k, v, slot_mapping, kd, page_size, persistent)
        return
    row_width = num_heads * head_dim
    block_c = min(BLOCK_C_INTERPRETER if C.is_interpreted(_kv_write_kernel) else BLOCK_C_DEVICE,
                  C.next_pow2(row_width))
    num_col_blocks = C.cdiv(row_width, block_c)
    num_work = C.cdiv(n, BLOCK_T) * num_col_blocks
    programs = C.num_programs(device, num_work, persistent)
    has_ts = ts is not None
    with C.device_guard(device):
        _kv_write_kernel[(programs,)](
            kv_cache, k, v, slot_mapping, ts if has_ts else slot_mapping, ts_cache if has_ts else slot_mapping,
            n, row_width, num_col_blocks, num_work, programs,
            k.stride(0), v.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            ts_cache.stride(0) if has_ts else 0,
            PAGE_SIZE=page_size, BLOCK_T=BLOCK_T, BLOCK_C=block_c, HAS_TS=has_ts)


def _write_quantized(kv_cache, k, v, slot_mapping, kd, page_size: int, persistent: bool) -> None:
    """The 8-bit write of :func:`kv_write` (inputs checked): one program per ``BLOCK_T`` tokens and head."""
    num_heads, head_dim, n = kv_cache.shape[3], kv_cache.shape[4], k.shape[0]
    num_work = C.cdiv(n, BLOCK_T) * num_heads
    programs = C.num_programs(kv_cache.device, num_work, persistent)
    with C.device_guard(kv_cache.device):
        _kv_write_quant_kernel[(programs,)](
            kv_cache.view(quant.value_dtype(kd)), kv_cache.view(-1).view(torch.float32), k, v, slot_mapping,
            n, num_heads, num_work, programs, k.stride(0), v.stride(0),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_T=BLOCK_T, BLOCK_D=max(16, C.next_pow2(head_dim)),
            QMAX=quant.QMAX[kd], INT8=kd is KVDtype.INT8)
