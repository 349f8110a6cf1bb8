"""Paged prefix attention: new history tokens and candidates of a batch of users against their cached prefix pages.

The launcher; the batch plan is in :mod:`relaygr_engine.kernels._prefix_plan`, the ``@triton.jit`` code in
:mod:`relaygr_engine.kernels._prefix_kernel`, its configs in :mod:`relaygr_engine.kernels._prefix_config`. A call
checks its inputs, plans the batch's tiles (or takes a plan built once per batch, :func:`plan_prefix_attention`), and
launches the kernel once per kind of tile: history tiles (new history rows: causal) and candidate tiles (all of a
user's candidates share one query position and time). With split-prefix scheduling each tile's keys (its cached
prefix, then the new history rows it sees) are shared by several programs, an even share each, whose partial sums
are merged after both launches; with value splits its output columns are (each program computes all the tile's
scores).

Modes
-----
softmax  online softmax in fp32 (running max and sum, ``exp2`` with the scale folded in).
hstu     ``sum_j SiLU(alpha * q.k_j + rab_ij) v_j / N``: pointwise, so no running max or log-sum-exp. The relative
         bias ``rab = pos_bias[min(dq, P-1)] + ts_bias[bucket(t_q - t_k)]`` (integer positions, int64 timestamps)
         is computed once per layer into a bias table (:mod:`relaygr_engine.kernels._bias_table`): one row per
         user serves all its candidates (they share a position and a time), one row per history row within
         :data:`~relaygr_engine.kernels._bias_table.HIST_BIAS_TABLE_BYTES` (32 MiB); above that budget history
         tiles compute it per (row, key) in the kernel. No ``[candidates, keys]`` bias is ever made. With a plan
         (one per batch), the table's position indices and time buckets, which no layer changes, are kept in it by
         the first layer's call: the later layers' tables are two gathers per entry.

Positions: prefix token ``j`` -> ``j``; new history token ``i`` -> ``P + i``; every candidate -> ``P + n`` (the
history length). So key ``j`` of the concatenated sequence [prefix | new history] has position ``j``, and row ``r``
sees keys ``j < P + min(r + 1, n)``. A user's candidates share one query time, the request time: the kernel reads
it from the user's first candidate row (``ts_q``).

Layout: pages are FlashInfer's and NVIDIA's NHD ``[num_pages, 2, page_size, H, D]``. A key's ``D`` values are one
contiguous run (512 bytes at bf16 and D = 256), so a key block's loads are whole cache lines in either layout; HND
(``[..., H, page_size, D]``) would make a page's block of one head one run, but would break the paged contract
shared with FlashInfer and NVIDIA's HSTU inference, whose pages users move between engines.
"""
from __future__ import annotations

from typing import Optional

import torch
from .. import quant
from ..config import AttentionMode, KVDtype, PageReads, TimeBucket, check_int, parse_choice
from ..attention.time_buckets import check_time_buckets, time_bucket_bounds
from . import _common as C
from . import _hopper_launch as HL
from ._prefix_config import (AUTOTUNE_V_SPLITS, CUDA_MAX_BLOCK_N, TMA_ONLY, KernelConfig,
                             autotuned_kernel, kv_descriptor, load_autotune, pick_config,
                             reset_autotuning, save_autotune)
from ._bias_table import bias_table
from ._launch import decide
from ._prefix_kernel import prefix_attention_kernel
from ._prefix_plan import (PrefixAttentionPlan, _check_block, _plan, check_plan, check_value_splits,
                           plan_prefix_attention)
from ._split import merge_splits, split_dtype as pick_split_dtype

__all__ = ["prefix_attention", "plan_prefix_attention", "PrefixAttentionPlan", "AttentionMode", "KernelConfig",
           "pick_config", "reset_autotuning", "save_autotune", "load_autotune"]

_prefix_attention_kernel = prefix_attention_kernel  # the name tests and ``python -m benchmarks.tools.ptxas`` compile


# ------------------------------------------------------------------------------------------------------ launcher
def _bias_table(name: str, table, device: torch.device) -> torch.Tensor:
    """A 1-D floating bias table, contiguous, as the kernels read it: fp32/fp16/bf16 as given (widened to fp32 where
    read: no conversion kernel per layer for a bf16 model's parameters), float64 as fp32."""
    C.check_tensor(name, table, ndim=1, dtypes=C.FLOAT_DTYPES + (torch.float64,), device=device, contiguous=False)
    if table.numel() < 1:
        raise ValueError(f"{name} must have at least one entry")
    return (table.to(torch.float32) if table.dtype == torch.float64 else table).contiguous()


def _dot_precision(dtype: torch.dtype, allow_tf32: bool):
    """``tl.dot`` input precision: IEEE fp32 unless TF32 is allowed; the backend default for fp16/bf16."""
    if dtype != torch.float32:
        return None
    return "tf32" if allow_tf32 else "ieee"


def _ts_bits(num_buckets: int) -> int:
    """TS_BITS for ``bucket = min(bit_length(d), num_buckets - 1)`` of int64 deltas (the log2 buckets need no
    search steps: the kernel reads the bit length off a float's exponent)."""
    return min(num_buckets - 1, 63)


def _grid(programs: int):
    """A launch's grid: ``programs`` (tiles x heads x prefix splits, or one per core) by the programs sharing a
    tile (its value splits times its row splits: ``V_SPLITS`` x ``M_SPLITS``, set by the caller or the
    autotuner)."""
    return lambda meta: (programs, meta["V_SPLITS"] * meta["M_SPLITS"])


@HL.falls_back
def prefix_attention(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates, *,
                     mode, scale, hstu_norm=1.0, pos_bias=None, ts_bias=None, ts_cache=None, ts_q=None,
                     time_bucket="log2", persistent=False, block_m=None, block_n=None, allow_tf32=False,
                     plan: Optional[PrefixAttentionPlan] = None, splits: Optional[int] = None,
                     kv_dtype="model", bias_table_bytes: Optional[int] = None,
                     page_reads="auto", value_splits: Optional[int] = None,
                     concurrent_tiles: Optional[bool] = None,
                     split_dtype: Optional[torch.dtype] = None,
                     hopper_kernel: Optional[bool] = None) -> torch.Tensor:
    """Attention of each user's new history rows and candidates over its cached prefix pages and new rows.

    Parameters
    ----------
    q, k, v : Tensor [total_q, H, D]
        Per user, its new history rows then its candidates, user after user (fp32/fp16/bf16, one dtype). Each row
        dense, rows at any stride: views of one fused projection need no copy.
    kv_cache : Tensor [num_pages, 2, page_size, H, D]
        One layer's paged cache (index 0 = K, 1 = V), dtype of ``q``; with an 8-bit ``kv_dtype``
        ``uint8 [num_pages, 2, page_size + S, H, D]`` values and scale slots (:mod:`relaygr_engine.quant`).
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
        The bucket function (:func:`relaygr_engine.attention.ops.time_buckets`): ``"log2"``
        (``min(bit_length(max(d, 0)), NB - 1)``) is computed with shifts, the others by a binary search over the
        steps of :func:`relaygr_engine.attention.ops.time_bucket_bounds`.
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
    kv_dtype : {"model", "fp8_e4m3", "int8"}
        How ``kv_cache`` stores K/V: cached rows are dequantised on load (the K scales multiply the scores, the V
        scales the weights); ``k``/``v``, the new rows, stay at full precision. fp8 runs on CUDA only.
    splits : int, optional
        Split each tile's keys (its user's cached prefix, then the new history rows it sees) over this many
        programs (flash-decoding style), an even share each, their partial sums merged after the kernel
        (:func:`~relaygr_engine.kernels._split.merge_splits`). Default: by device
        (:func:`~relaygr_engine.kernels._split.split_layout`: on CUDA when the tiles alone leave most SMs idle, e.g.
        one user's few hundred rows against a long prefix, and no more splits than have keys; never elsewhere).
    bias_table_bytes : int, optional
        hstu with a bias: the history tiles read their bias from a per-layer table
        (:mod:`~relaygr_engine.kernels._bias_table`: 4 bytes per history tile row and key of the longest
        user, plus a key block, rounded up to 16 keys)
        when it takes at most this many bytes (default ``HIST_BIAS_TABLE_BYTES``, 32 MiB), else compute it in the
        kernel; 0 always computes it. Candidate tiles always read theirs from a table (one row per user).
    page_reads : {"auto", "pointers", "tma"}
        How full key blocks' K/V are read (:class:`~relaygr_engine.config.PageReads`): ``"auto"`` autotunes
        pointer reads against tensor-descriptor (TMA) reads on CUDA sm_90+ (pointers elsewhere); ``"tma"`` only
        the latter, and raises ``ValueError`` where they cannot run (8-bit pages, a head dim not a power of two, a
        page not a whole number of key blocks, a cache not 16-byte aligned, a GPU before sm_90).
    value_splits : int, optional
        Programs sharing a tile's value columns (a power of two): each computes all the tile's scores and ``D /
        value_splits`` columns of its output, so its accumulator takes that many times fewer registers (what bounds
        a tile at head dim 256) for scores computed ``value_splits`` times. Default: 1, autotuned over 1 and 2
        above head dim 128 on CUDA (:mod:`~relaygr_engine.kernels._prefix_config`); with ``block_n`` autotuned
        only 1 or 2 can be asked for; ``"tma"`` page reads take 1. Asked for, they count as programs where the
        prefix split count is chosen (``splits=None``).
    concurrent_tiles : bool, optional
        Launch the history tiles on a side stream, so that their launch and the candidate tiles' run at the same
        time (they write disjoint rows; the call's stream waits for both before it returns or merges splits), not
        one after the other. Default (None): on CUDA where the batch has both kinds of tile and the history launch
        has fewer programs than the GPU has SMs (e.g. a ranking's one history tile per head against a long
        prefix): the candidate tiles' programs then run on the SMs the history launch leaves idle instead of after
        it. Inside a CUDA graph the two launches are two branches.
    split_dtype : torch.dtype, optional
        With split-prefix scheduling, the dtype each split's partial output is stored in between the kernel and the
        merge (a split accumulates in fp32, the merge adds up in fp32; softmax's running max and sum stay fp32).
        Default: the model's dtype when it is 16-bit, so the partials, the largest buffer a split launch writes
        and the merge reads, take half the bytes of fp32; fp32 for an fp32 model
        (:func:`~relaygr_engine.kernels._split.split_dtype`). ``torch.float32`` keeps a 16-bit model's partials at
        fp32.
    hopper_kernel : bool, optional
        Tiles' full cached key blocks on the warp-specialised sm_90 kernel (:mod:`~relaygr_engine.kernels._hopper`,
        HSTU or softmax), the rest on this one as one more split partial, on a second stream where
        ``concurrent_tiles`` allows (history tiles whose HSTU bias the kernel would compute in place of a table
        stay on this one). Default (None): ``RELAYGR_HOPPER_KERNEL=1`` uses it where it can run; ``True`` raises
        ``ValueError`` naming why where it cannot. Where its compile or launch raises, it is off for the process
        (logged once) and a call that did not pass ``True`` runs again on this kernel alone. Not yet run on a GPU.

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
    C.check_tensor("q", q, ndim=3, dtypes=C.FLOAT_DTYPES, dense_rows=True)
    device = q.device
    total_q, num_heads, head_dim = q.shape
    C.check_tensor("k", k, shape=q.shape, dtypes=(q.dtype,), device=device, dense_rows=True)
    C.check_tensor("v", v, shape=q.shape, dtypes=(q.dtype,), device=device, dense_rows=True)
    kd = parse_choice(KVDtype, kv_dtype, "kv_dtype")
    C.check_tensor("kv_cache", kv_cache, shape=(None, 2, None, num_heads, head_dim),
                   dtypes=(quant.storage_dtype(kd, q.dtype),), device=device)
    num_pages, page_size = kv_cache.shape[0], quant.token_page_size(kd, kv_cache.shape[2], head_dim)
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
    check_value_splits(value_splits, head_dim)
    if concurrent_tiles is not None and not isinstance(concurrent_tiles, bool):
        raise ValueError(f"concurrent_tiles must be a bool or None, got {concurrent_tiles!r}")
    if concurrent_tiles and device.type != "cuda":
        raise ValueError(f"concurrent_tiles=True needs a CUDA device (streams), got {device}")
    if bias_table_bytes is not None:
        bias_table_bytes = check_int("bias_table_bytes", bias_table_bytes)
    pick_split_dtype(split_dtype, q.dtype, device)  # (checks split_dtype)
    HL.requested(hopper_kernel)  # (checks hopper_kernel)
    reads = parse_choice(PageReads, page_reads, "page_reads")
    if plan is not None:
        check_plan(plan, batch=batch, total_q=total_q, page_size=page_size, num_pages=num_pages, device=device,
                   block_m=block_m)
    C.check_launchable(device, _prefix_attention_kernel)
    if device.type == "cpu" and q.dtype != torch.float32:
        raise ValueError(f"the CPU interpreter runs fp32 only (numpy has no bf16), got q.dtype={q.dtype}")
    if kd.quantized and not quant.kernel_runs(device):
        raise ValueError(f"kv_dtype={kd.value!r} on {device.type}: 8-bit pages are not read by this kernel on CUDA "
                         f"until it passes there (relaygr_engine.quant.kernel_runs; {quant.KERNEL_ENV}=1 runs it "
                         f"anyway); use ops.paged_prefix_attention(backend='torch')")
    if device.type == "cpu" and kd is KVDtype.FP8_E4M3:
        raise ValueError("kv_dtype='fp8_e4m3' cannot run in the CPU interpreter (numpy has no fp8); use the torch "
                         "backend on the CPU")

    out = torch.empty_like(q)
    if total_q == 0:
        return out
    interpreted = C.is_interpreted(_prefix_attention_kernel)
    cfg = pick_config(device, q.dtype, head_dim, plan.block_m if plan is not None else block_m, block_n,
                      interpreted=interpreted)
    if cfg.block_n is None and value_splits not in (None, *AUTOTUNE_V_SPLITS):
        raise ValueError(f"value_splits={value_splits} needs a fixed block_n: the autotuned configs split the value "
                         f"columns over {' or '.join(map(str, AUTOTUNE_V_SPLITS))} programs")
    if reads is PageReads.TMA and (value_splits or 1) > 1:
        raise ValueError(f"page_reads='tma' reads every value column of a key block: value_splits must be 1, got "
                         f"{value_splits}")
    planned = plan is not None  # (a caller's plan serves several calls: its bias index is worth keeping)
    if plan is None:
        plan = _plan(table, page_size=page_size, num_pages=num_pages, cfg=cfg, device=device)
    if ts_bias is not None and ts_cache is None and plan.num_cached:
        raise ValueError(f"ts_bias needs ts_cache: {plan.num_cached} cached tokens have no timestamps")
    # Every launch decision (kernels._launch), once per batch plan and layer signature.
    options = dict(page_reads=reads, splits=splits, value_splits=value_splits, concurrent_tiles=concurrent_tiles,
                   hopper_kernel=hopper_kernel, persistent=persistent, fixed_block_n=block_n,
                   bias_table_bytes=bias_table_bytes, split_dtype=split_dtype)
    layer = dict(dtype=q.dtype, head_dim=head_dim, num_heads=num_heads, num_pages=num_pages, kv_dtype=kd, hstu=hstu,
                 biased=hstu and (pos_bias is not None or ts_bias is not None), interpreted=interpreted,
                 aligned=kv_cache.data_ptr() % 16 == 0)
    launch = plan.launch((cfg, HL.state()["failed"], *layer.items(), *options.items()),
                         lambda: decide(plan, C.target_of(device), cfg, **layer, **options))
    tma_reads, hopper = launch.tma_reads, launch.hopper
    kv_desc = kv_descriptor(kv_cache, page_size, cfg.block_n) if tma_reads else None
    num_splits, split_len, concurrent, slots = launch.num_splits, launch.split_len, launch.concurrent, launch.slots
    assert num_splits * split_len >= plan.max_context_len, "the splits must cover every tile's keys"
    if slots > 1 and slots * total_q * num_heads >= 2 ** 31:  # (the kernels' partial rows are int32)
        raise ValueError(f"splits={num_splits} over {total_q} rows and {num_heads} heads make "
                         f"{slots * total_q * num_heads} rows of split partials, at most 2**31 - 1: ask for "
                         f"fewer splits")
    ws = ml = q  # stand-ins without SPLIT (never written)
    if slots > 1:
        ws = torch.empty((slots, total_q, num_heads, head_dim), dtype=launch.split_dtype, device=device)
        ml = ws if hstu else torch.empty((slots, total_q, num_heads, 2), dtype=torch.float32, device=device)
    has_pos, has_ts = pos_bias is not None, ts_bias is not None
    ts_bits = _ts_bits(ts_bias.numel()) if has_ts else 1
    ts_table = has_ts and ts_fn is not TimeBucket.LOG2
    ts_bounds = time_bucket_bounds(ts_fn, ts_bias.numel(), device) if ts_table else None
    ts_steps = ts_bounds.numel().bit_length() if ts_table else 0  # the table search's steps
    dummy = q  # stands in for absent optional pointers (never read: their flags are off)
    # HSTU's bias once per layer (kernels._bias_table): a row per user for the candidate tiles and, within the
    # budget, a row per history tile row; history tiles without rows compute theirs in the kernel. With a plan
    # given, its bias index (positions and time buckets, which no layer changes) is built once for all layers.
    table, user_rows, hist_table, fast_silu = None, launch.user_rows, launch.hist_table, launch.fast_silu
    if hstu and (has_pos or has_ts):
        max_block_n = cfg.block_n or CUDA_MAX_BLOCK_N  # (autotuned: any of CUDA_CONFIGS)
        table = bias_table(
            user_rows, plan.hist_tiles if hist_table else None, plan.hist_block_m, plan.max_key_len, max_block_n,
            (kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates), (pos_bias, ts_bias),
            (ts_cache if has_ts and ts_cache is not None else ts_q if has_ts else dummy,
             ts_q if has_ts else dummy, ts_bounds if ts_table else dummy),
            page_size=page_size, ts_bits=ts_bits, ts_steps=ts_steps, ts_table=ts_table,
            ts_abs=ts_table and ts_fn.absolute, device=device, scale=0.5 if fast_silu else 1.0,
            index=plan.bias_index if planned else None, index_key=(ts_fn if has_ts else None,),
            index_tensors=tuple(t for t in (ts_cache, ts_q) if has_ts and t is not None))
    # 8-bit pages: the values through a view of their dtype, the scales through an fp32 view of the same bytes.
    pages = kv_cache.view(quant.value_dtype(kd)) if kd.quantized else kv_cache
    scales = kv_cache.view(-1).view(torch.float32) if kd.quantized else q
    head = (q, k, v, out, pages, scales, kv_desc, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q,
            num_candidates)
    tail = (
        pos_bias if has_pos else dummy, ts_bias if has_ts else dummy,
        ts_cache if has_ts and ts_cache is not None else dummy, ts_q if has_ts else dummy,
        ts_bounds if ts_table else dummy)
    shape = (pos_bias.numel() if has_pos else 1, ts_bounds.numel() if ts_table else 0,
             ts_cache.stride(0) if has_ts and ts_cache is not None else 0,
             0 if table is None else table.stride(0),
             q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
             out.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
             scale, inv_norm)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, C.next_pow2(head_dim)), PAGE_SIZE=page_size,
                HSTU=hstu, HAS_POS=has_pos, HAS_TS=has_ts, TS_BITS=ts_bits,
                TS_STEPS=ts_steps, TS_TABLE=ts_table, TS_ABS=ts_table and ts_fn.absolute,
                DOT_PRECISION=_dot_precision(q.dtype, allow_tf32), PERSISTENT=persistent,
                SPLIT=slots > 1,
                KV8=kd.quantized, FAST_SILU=fast_silu, TMA_READS=tma_reads,
                V_SPLITS_PICK=value_splits or 0)
    if cfg.block_n is None:
        kernel, extra = autotuned_kernel(), {}
    else:
        kernel, extra = _prefix_attention_kernel, dict(BLOCK_N=cfg.block_n, TMA=tma_reads == TMA_ONLY,
                                                       V_SPLITS=value_splits or 1, M_SPLITS=cfg.row_splits)
        if cfg.num_warps is not None:
            extra.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launches = [(cand, tiles, rows) for cand, tiles, rows in ((False, plan.hist_tiles, plan.hist_block_m),
                                                              (True, plan.cand_tiles, plan.block_m))
                if tiles.shape[1] * num_heads > 0]
    # The Hopper kernel takes the full cached blocks of the tiles it takes (history tiles' where they read the bias
    # table or have none), the portable kernel the rest, one program per tile, into slot S, on the side stream.
    skips = [hopper if HL.takes(rows) and (cand or hist_table or not (has_pos or has_ts)) else 0
             for cand, _, rows in launches]
    if hopper and not all(skips):  # rows the portable kernel splits as ever: slot S must add nothing to them
        HL.clear_slot(ws[num_splits], None if hstu else ml[num_splits])
    with C.device_guard(device), C.tile_streams(device, concurrent) as on:
        for (cand, tiles, rows), skip in zip(launches, skips):
            work, (splits_of, keys_of) = tiles.shape[1] * num_heads, (
                (1, C.cdiv(plan.max_context_len, 16) * 16) if skip else (num_splits, split_len))
            programs = C.num_programs(device, work * splits_of, persistent)
            rows_of = dummy if table is None or not (cand or hist_table) else table if cand else table[user_rows:]
            with on(side=not cand or hopper > 0):
                kernel[_grid(programs)](*head, tiles[0], tiles[1], *tail, rows_of, ws[num_splits:] if skip else ws,
                                        ml[num_splits:] if skip and not hstu else ml, num_heads, work * splits_of,
                                        programs, splits_of, keys_of, total_q, *shape, BLOCK_M=rows, CAND_TILES=cand,
                                        HIST_TABLE=hist_table and not cand, SKIP_FULL=skip, **meta, **extra)
            if skip:  # the full blocks, a partial per split (kernels._hopper)
                HL.launch(q, ws, ml, kv_cache, kv_indices, kv_indptr, kv_last_page_len, cu_seqlens_q, num_candidates,
                          tiles, rows, cand, None if table is None else rows_of, hstu=hstu, page_size=page_size,
                          num_splits=num_splits, split_len=split_len, scale=scale, inv_norm=inv_norm)
    if slots > 1:
        merge_splits(ws, None if hstu else ml, out)
    return out
