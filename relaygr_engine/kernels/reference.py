"""Pure-torch references of the kernels: naive, per user, and written from the definitions (any device).

They take the kernels' arguments and produce what the kernels must produce; tests compare against them. The
attention reference builds the full ``[rows, keys]`` mask and bias of each user explicitly and computes in float64
(float32 on NPU), so it is an independent statement of the semantics, not a copy of the kernel's tiling.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["prefix_attention_ref", "kv_write_ref", "kv_pack_ref", "kv_unpack_ref", "merge_splits_ref",
           "time_bucket_ref", "visible_mask_ref"]


def time_bucket_ref(dt: torch.Tensor, num_buckets: int, time_bucket="log2") -> torch.Tensor:
    """Bucket of each int64 time difference ``dt``, clamped to ``num_buckets - 1``, straight from the definition.

    * ``"log2"``: ``bit_length(max(dt, 0))``, the number of powers of two ``2**k <= dt`` (``searchsorted``);
    * ``"ln_0301"``: ``floor(ln(max(|dt|, 1)) / 0.301)`` evaluated in float32, as Meta's research HSTU does;
    * ``"sqrt_60"``: ``floor(sqrt(max(dt, 1e-6) / 60))`` evaluated in float32, as Meta's STU time encoder does.
    """
    kind = str(getattr(time_bucket, "value", time_bucket)).lower()
    if kind == "log2":
        top = min(num_buckets - 2, 62)
        bounds = torch.tensor([1 << e for e in range(top + 1)], dtype=torch.int64, device=dt.device)
        return torch.searchsorted(bounds, dt.clamp_min(0).contiguous(), right=True)
    if kind == "ln_0301":
        raw = (torch.log(dt.abs().clamp(min=1).to(torch.float32)) / 0.301).long()
    elif kind == "sqrt_60":
        raw = torch.sqrt(dt.to(torch.float32).clamp(min=1e-6) / 60.0).long()
    else:
        raise ValueError(f"time_bucket must be one of 'log2', 'ln_0301', 'sqrt_60', got {time_bucket!r}")
    return raw.clamp(0, num_buckets - 1)


def visible_mask_ref(num_prefix: int, num_hist: int, num_cand: int, device=None) -> torch.Tensor:
    """Bool ``[n + C, P + n + C]``: which keys (prefix, new history, candidates) each query row sees.

    History row ``i`` sees the prefix and history ``0..i``; candidate ``c`` sees the prefix, all history and itself.
    """
    rows = num_hist + num_cand
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(rows, device=device)[None, :]
    own = (c <= r) & ((c < num_hist) | (c == r))
    return torch.cat([torch.ones(rows, num_prefix, dtype=torch.bool, device=device), own], dim=1)


def _positions(num_prefix: int, num_hist: int, num_cand: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    seg = num_prefix + torch.arange(num_hist + num_cand, device=device).clamp_max(num_hist)
    return seg, torch.cat([torch.arange(num_prefix, device=device), seg])


def prefix_attention_ref(q, k, v, kv_cache, kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates,
                         *, mode, scale, hstu_norm=1.0, pos_bias=None, ts_bias=None, ts_cache=None,
                         ts_q=None, time_bucket="log2") -> torch.Tensor:
    """Reference of :func:`relaygr_engine.kernels.prefix_attention.prefix_attention` (same arguments)."""
    mode = str(getattr(mode, "value", mode)).lower()
    if mode not in ("softmax", "hstu"):
        raise ValueError(f"mode must be one of 'softmax', 'hstu', got {mode!r}")
    cdt = torch.float32 if q.device.type == "npu" else torch.float64
    page_size = kv_cache.shape[2]
    out = torch.zeros(q.shape, dtype=cdt, device=q.device)
    cu, indptr = cu_seqlens_q.tolist(), kv_indptr.tolist()
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        num_cand = int(num_candidates[b])
        num_hist = hi - lo - num_cand
        pages = kv_indices[indptr[b]:indptr[b + 1]].long()
        num_prefix = 0 if pages.numel() == 0 else (pages.numel() - 1) * page_size + int(kv_last_page_len[b])
        tok = torch.arange(num_prefix, device=q.device)
        page_of, slot_of = pages[tok // page_size], tok % page_size
        keys = torch.cat([kv_cache[page_of, 0, slot_of], k[lo:hi]]).to(cdt)      # [P + n + C, H, D]
        vals = torch.cat([kv_cache[page_of, 1, slot_of], v[lo:hi]]).to(cdt)
        logits = torch.einsum("qhd,khd->hqk", q[lo:hi].to(cdt), keys) * scale   # [H, rows, keys]
        mask = visible_mask_ref(num_prefix, num_hist, num_cand, q.device)
        if mode == "softmax":
            w = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        else:
            rab = torch.zeros(mask.shape, dtype=cdt, device=q.device)
            if pos_bias is not None:
                q_pos, k_pos = _positions(num_prefix, num_hist, num_cand, q.device)
                dist = (q_pos[:, None] - k_pos[None, :]).clamp(0, pos_bias.numel() - 1)
                rab += pos_bias.to(cdt)[dist]
            if ts_bias is not None:
                t_q = ts_q[lo:hi].long()
                t_k = torch.cat([ts_cache[page_of, slot_of].long(), t_q])
                rab += ts_bias.to(cdt)[time_bucket_ref(t_q[:, None] - t_k[None, :], ts_bias.numel(), time_bucket)]
            w = torch.nn.functional.silu(logits + rab) * mask / hstu_norm
        out[lo:hi] = torch.einsum("hqk,khd->qhd", w, vals)
    return out.to(q.dtype)


def kv_write_ref(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                 ts: Optional[torch.Tensor] = None, ts_cache: Optional[torch.Tensor] = None) -> None:
    """Reference of :func:`relaygr_engine.kernels.kv_write.kv_write`: rows with ``slot < 0`` are skipped."""
    page_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, off = slots // page_size, slots % page_size
    kv_cache[page, 0, off] = k[keep].to(kv_cache.dtype)
    kv_cache[page, 1, off] = v[keep].to(kv_cache.dtype)
    if ts is not None:
        ts_cache[page, off] = ts[keep].to(ts_cache.dtype)


def kv_pack_ref(kv_caches: Sequence[torch.Tensor], page_ids) -> torch.Tensor:
    """Reference of :func:`relaygr_engine.kernels.kv_pack.kv_pack`: ``[L, 2, n * page_size, H, D]``."""
    ids = torch.as_tensor(page_ids, dtype=torch.long, device=kv_caches[0].device)
    _, _, page_size, h, d = kv_caches[0].shape
    # [n, 2, page_size, H, D] -> [2, n, page_size, H, D] -> [2, n * page_size, H, D]
    return torch.stack([c[ids].transpose(0, 1).reshape(2, ids.numel() * page_size, h, d) for c in kv_caches])


def kv_unpack_ref(buffer: torch.Tensor, kv_caches: Sequence[torch.Tensor], page_ids) -> None:
    """Reference of :func:`relaygr_engine.kernels.kv_pack.kv_unpack`."""
    ids = torch.as_tensor(page_ids, dtype=torch.long, device=kv_caches[0].device)
    _, _, page_size, h, d = kv_caches[0].shape
    for layer, cache in enumerate(kv_caches):
        cache[ids] = buffer[layer].to(cache.device).reshape(2, ids.numel(), page_size, h, d).transpose(0, 1)


def merge_splits_ref(ws: torch.Tensor, ml: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """What the split merge writes into ``out [total_q, H, D]``, in fp32, from the partials ``ws [S, total_q, H,
    D]`` (and, softmax, ``ml [S, total_q, H, 2]``: each split's running max in the log2 domain and sum): HSTU
    ``sum_s ws[s]``; softmax ``sum_s w_s ws[s] / sum_s w_s`` with ``w_s = 2^(m_s - max_s m_s) l_s`` (0 where every
    ``l_s`` is)."""
    if ml is None:
        return out.copy_(ws.float().sum(0))
    m, l = ml[..., 0], ml[..., 1]
    w = torch.exp2(m - m.amax(0)) * l
    den = w.sum(0)
    num = (w.unsqueeze(-1) * ws.float()).sum(0)
    return out.copy_(num / torch.where(den > 0, den, torch.ones_like(den)).unsqueeze(-1))
