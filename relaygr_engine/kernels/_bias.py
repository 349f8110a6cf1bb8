"""The HSTU relative bias in Triton: ``pos_bias[clamp(q_pos - k_pos, 0, NP - 1)] + ts_bias[bucket(t_q - t_k)]``
(``@triton.jit`` helpers shared by the prefix-attention kernel's history tiles and the bias-table kernel,
:mod:`relaygr_engine.kernels._bias_table`)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _log2_bucket(dt, TS_BITS: tl.constexpr):
    """``min(bit_length(max(dt, 0)), TS_BITS)`` of int64 ``dt``, from the exponent of ``d`` as a float.

    ``d = clamp(dt, 0, 2**TS_BITS - 1)`` converts to a float whose biased exponent minus the bias is
    ``bit_length(d)`` when the conversion is exact: fp32 up to 24 bits, fp64 up to 53 (``d = 0`` has exponent field 0
    and maps to 0). Up to 31 bits the clamp works on the two 32-bit words of ``dt``.
    Above 53 bits the conversion can round up to a power of two, one too many, which a compare
    (``d >> (e - 1) == 0``) takes back.
    """
    if TS_BITS <= 31:
        hi = (dt >> 32).to(tl.int32)  # the high word: 0 <= dt < 2**31 when it is 0 and the low word is >= 0
        lo = dt.to(tl.int32)
        d = tl.where(hi < 0, 0, tl.where((hi > 0) | (lo < 0), (1 << 31) - 1, lo))
        if TS_BITS < 31:
            d = tl.minimum(d, (1 << TS_BITS) - 1)
    else:
        d = tl.minimum(tl.maximum(dt, 0), (1 << TS_BITS) - 1)
    if TS_BITS <= 24:
        e = tl.maximum((d.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126, 0)
    else:
        e = tl.maximum((d.to(tl.float64).to(tl.int64, bitcast=True) >> 52).to(tl.int32) - 1022, 0)
    if TS_BITS > 53:
        e = tl.where((e > 0) & ((d >> tl.maximum(e - 1, 0)) == 0), e - 1, e)
    return e


@triton.jit
def _table_bucket(dt, bounds_ptr, num_bounds, TS_ABS: tl.constexpr, TS_STEPS: tl.constexpr):
    """How many steps of the non-decreasing int64 table ``bounds[0 .. num_bounds)`` are ``<= dt`` (``|dt|`` with
    ``TS_ABS``): a binary search extending the count by ``2**j``, ``j = TS_STEPS - 1 .. 0``."""
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


@triton.jit
def _rel_bias(q_pos, k_pos, t_q, t_k, pos_bias_ptr, ts_bias_ptr, ts_bounds_ptr, num_pos, num_ts_bounds,
              HAS_POS: tl.constexpr, HAS_TS: tl.constexpr, TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr,
              TS_TABLE: tl.constexpr, TS_ABS: tl.constexpr):
    """``pos_bias[clamp(q_pos - k_pos, 0, NP - 1)] + ts_bias[bucket(t_q - t_k)]`` in fp32 (the tables in any float
    dtype: a model's bf16 parameters are read as they are, each entry widened exactly), broadcast over the shapes
    given: ``[BLOCK_M, BLOCK_N]`` for a history tile, a vector of keys for one query position and time (the
    bias table), a scalar for a candidate's own key.
    Every index is clamped into its table, so no load needs a mask."""
    p, b = _rel_index(q_pos, k_pos, t_q, t_k, ts_bounds_ptr, num_pos, num_ts_bounds, HAS_POS, HAS_TS, TS_BITS,
                      TS_STEPS, TS_TABLE, TS_ABS)
    return _gather_bias(p, b, pos_bias_ptr, ts_bias_ptr, HAS_POS, HAS_TS)


@triton.jit
def _rel_index(q_pos, k_pos, t_q, t_k, ts_bounds_ptr, num_pos, num_ts_bounds, HAS_POS: tl.constexpr,
               HAS_TS: tl.constexpr, TS_BITS: tl.constexpr, TS_STEPS: tl.constexpr, TS_TABLE: tl.constexpr,
               TS_ABS: tl.constexpr):
    """The entries :func:`_rel_bias` reads: ``(clamp(q_pos - k_pos, 0, NP - 1), bucket(t_q - t_k))`` (0 for a
    term that is off). They depend on positions and times only, not on a layer's tables."""
    p = 0
    b = 0
    if HAS_TS:
        if TS_TABLE:
            b = _table_bucket(t_q - t_k, ts_bounds_ptr, num_ts_bounds, TS_ABS, TS_STEPS)
        else:
            b = _log2_bucket(t_q - t_k, TS_BITS)
    if HAS_POS:
        p = tl.minimum(tl.maximum(q_pos - k_pos, 0), num_pos - 1)
    return p, b


@triton.jit
def _gather_bias(p, b, pos_bias_ptr, ts_bias_ptr, HAS_POS: tl.constexpr, HAS_TS: tl.constexpr):
    """``pos_bias[p] + ts_bias[b]`` in fp32, the terms that are on (:func:`_rel_index`'s entries)."""
    if HAS_TS:
        bias = tl.load(ts_bias_ptr + b).to(tl.float32)
        if HAS_POS:  # (started from the first term: 0.0 + x is an add the compiler must keep, for x = -0.0)
            bias += tl.load(pos_bias_ptr + p).to(tl.float32)
    else:
        bias = tl.load(pos_bias_ptr + p).to(tl.float32)
    return bias
