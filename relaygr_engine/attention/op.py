"""``relaygr::prefix_attention``: a layer's whole relay-forward attention as one registered, opaque op.

As in vLLM, where every attention layer calls one custom op whose implementation reads the forward context, a
:class:`~relaygr_engine.attention.layer.PrefixAttention` in a relay forward calls
``torch.ops.relaygr.prefix_attention(q, k, v, kv_cache, pos_bias, ts_bias, layer)``. The op stores the new history rows'
K/V in ``kv_cache`` (the layer's pages: declared mutated) and attends over each user's cached prefix. Everything else it
needs (the batch's page table, its plan, the rows to store, the layer's mode and scale) it reads from the forward
context when it runs, so a compiler traces neither the context nor the plan: the rest of the model compiles around the
op, which its fake implementation describes as ``[R, H, Dv]`` in ``q``'s dtype. Eager calls skip the dispatcher and run
:func:`relay_attention` directly (the same code).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import quant
from ..config import AttentionBackend
from .context import current_context
from ..onload import wait_layer
from .checks import _check_args
from ..kernels._common import with_dense_rows
from .ops import _dispatch
from .torch_plan import planned_attention

__all__ = ["relay_attention"]


def relay_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    pos_bias: Optional[torch.Tensor], ts_bias: Optional[torch.Tensor], layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention in the running relay forward (the implementation of the op).

    Parameters
    ----------
    q, k : Tensor [R, H, D]
    v : Tensor [R, H, Dv]
        The batch's rows (each user's new history rows, then its candidates).
    kv_cache : Tensor [num_pages, 2, page_size, H, Dc]
        The layer's pages (``Dc = max(D, Dv)``); the K/V of the rows the engine stores are written into it.
    pos_bias, ts_bias : Tensor [P], Tensor [NB], optional
        hstu: the layer's bias tables.
    layer : int
        The layer's index among the engine's layers.

    Returns
    -------
    Tensor [R, H, Dv] in ``q``'s dtype.
    """
    ctx = current_context()
    if ctx is None or not ctx.relay:
        raise RuntimeError("relaygr::prefix_attention runs inside a relay forward only (RelayEngine)")
    st, batch, module = ctx.paged, ctx.batch, ctx.layers[layer]
    wait_layer(layer)  # a DRAM hit's copy of this layer's pages (relaygr_engine.onload), before they are touched
    module._check(q, k, v, pos_bias, ts_bias, len(batch))
    if not module.prefix_stable:
        raise ValueError("hstu_norm='batch' is not prefix-stable: this layer runs the dense forward only "
                         "(a relay forward divides by a constant normaliser)")
    if batch.timestamps is None:
        ts_bias = None
        if module.bias_needs_time:
            pos_bias = None
    out_dtype, Dc, kd = q.dtype, kv_cache.shape[-1], st.kv_dtype
    if Dc != module.head_dim:  # zero columns change no dot product
        q, k = F.pad(q, (0, Dc - module.head_dim)), F.pad(k, (0, Dc - module.head_dim))
    if Dc != module.value_dim:
        v = F.pad(v, (0, Dc - module.value_dim))
    dtype = st.compute_dtype or kv_cache.dtype
    if q.dtype != dtype:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    flat = st.flat(layer) if kv_cache is st.kv_caches[layer] else kv_cache.view(-1, *kv_cache.shape[3:])
    if st.write_rows is not None:
        _write(st, kv_cache, flat, k, v, len(batch))
    ts_q = batch.timestamps if ts_bias is not None else None
    ts_cache = st.ts_cache if ts_bias is not None else None
    args = (q, k, v, kv_cache, st.kv_indptr, st.kv_indices, st.kv_last_page_len, batch.cu_seqlens,
            batch.num_candidates, module.mode, module.scale, module.hstu_norm, pos_bias, ts_bias, ts_cache, ts_q)
    if not st.validated:  # the first layer checks; a plan (when set) was built from checked tables already
        _check_args(*args, read_tables=st.plan is None and st.torch_plan is None, time_bucket=module.time_bucket,
                    kv_dtype=kd)
        st.validated = True
    if st.torch_plan is not None and q.dtype in (torch.float32, torch.float64):
        o = planned_attention(st.torch_plan, q, k, v, flat, module.mode, module.scale, module.hstu_norm, pos_bias,
                              ts_bias, module.time_bucket, compiled=st.compiled, kv_dtype=kd)
    else:
        o = _dispatch(*args, st.backend, plan=st.plan, time_bucket=module.time_bucket, kv_dtype=kd)
    if Dc != module.value_dim:
        o = o[..., :module.value_dim]
    return o if o.dtype == out_dtype else o.to(out_dtype)


def _write(st, cache: torch.Tensor, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> None:
    """Store the K/V of the batch rows the engine is keeping in one layer's pages (quantised when 8-bit)."""
    page_size = quant.token_page_size(st.kv_dtype, cache.shape[2], cache.shape[-1])
    if st.backend is AttentionBackend.TRITON:
        from ..kernels.kv_write import kv_write
        kv_write(cache, with_dense_rows(k), with_dense_rows(v), st.slot_mapping(rows, page_size), check_slots=False,
                 kv_dtype=st.kv_dtype)
        return
    if st.kv_dtype.quantized:
        quant.store(cache, st.kv_dtype, page_size, st.write_pages, st.write_slots,
                    k.index_select(0, st.write_rows), v.index_select(0, st.write_rows))
        return
    dst = st.write_kv_rows
    flat.index_copy_(0, dst, k.index_select(0, st.write_rows))
    flat.index_copy_(0, dst + cache.shape[2], v.index_select(0, st.write_rows))


@torch.library.custom_op("relaygr::prefix_attention", mutates_args=("kv_cache",))
def _prefix_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                         pos_bias: Optional[torch.Tensor], ts_bias: Optional[torch.Tensor],
                         layer: int) -> torch.Tensor:
    return relay_attention(q, k, v, kv_cache, pos_bias, ts_bias, layer).contiguous()  # the fake's strides


@_prefix_attention_op.register_fake
def _(q, k, v, kv_cache, pos_bias, ts_bias, layer):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
