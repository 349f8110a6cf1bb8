"""Host-side tables of one forward's jobs: their page table, the K/V rows they store, and their scores' split.

Shared by the eager forward (:mod:`relaygr_engine.engine.forward`) and the CUDA-graph one
(:mod:`relaygr_engine.engine.graphs`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .records import Job

_log = logging.getLogger("relaygr_engine")

__all__ = ["PageLayout", "check_scores", "log_plan", "page_layout", "split_scores"]


@dataclass(frozen=True)
class PageLayout:
    """The cached prefix pages of a batch's users (FlashInfer's layout) and where their new K/V rows go.

    Attributes
    ----------
    indptr : int32 array [B+1]
    indices : int32 array [indptr[-1]]
    last : int32 array [B]
        Tokens in each user's last prefix page (0 without pages).
    write_rows, write_pages, write_slots : int64 arrays [W]
        Batch row ``write_rows[i]`` is stored at page ``write_pages[i]``, slot ``write_slots[i]`` (W = 0: none).
    """

    indptr: np.ndarray
    indices: np.ndarray
    last: np.ndarray
    write_rows: np.ndarray
    write_pages: np.ndarray
    write_slots: np.ndarray


def page_layout(jobs: Sequence[Job], rows: Sequence[int], page_size: int) -> PageLayout:
    """The :class:`PageLayout` of ``jobs``, whose batch segments have ``rows`` rows each."""
    ps = page_size
    indptr, last, indices = [0], [], []
    w_rows, w_pages, w_slots = [], [], []
    r0 = 0
    for j, n_rows in zip(jobs, rows):
        n_pages = -(-j.start // ps)
        indices.append(np.asarray(j.pages[:n_pages] if n_pages else (), dtype=np.int32))
        indptr.append(indptr[-1] + n_pages)
        last.append(j.start - (n_pages - 1) * ps if n_pages else 0)
        n = j.prep.num_tokens - j.start
        if j.write_pages is not None and n:
            tok = np.arange(j.start, j.prep.num_tokens)
            w_rows.append(np.arange(r0, r0 + n))
            w_pages.append(np.asarray(j.write_pages, dtype=np.int64)[tok // ps])
            w_slots.append(tok % ps)
        r0 += n_rows
    i32 = (lambda a: np.asarray(a, dtype=np.int32))
    i64 = (lambda a: np.concatenate(a).astype(np.int64, copy=False) if a else np.zeros(0, np.int64))
    return PageLayout(i32(indptr), np.concatenate(indices), i32(last), i64(w_rows), i64(w_pages), i64(w_slots))


def check_scores(scores, num_candidate_rows: int) -> None:
    """ValueError unless ``scores`` is the model's ``[num_candidate_rows, num_tasks]`` output."""
    C = num_candidate_rows
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.shape[0] != C:
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"model(batch) must return the candidate rows' scores [{C}, num_tasks] "
                         f"(batch.num_candidate_rows = {C}), got {got}")


def split_scores(scores: torch.Tensor, candidates_per_user: Sequence[int]) -> list[Optional[torch.Tensor]]:
    """Each user's rows of ``scores`` in batch order (None for a user without candidates)."""
    out, c0 = [], 0
    for C_b in candidates_per_user:
        out.append(scores[c0:c0 + C_b] if C_b else None)
        c0 += C_b
    return out


def log_plan(key, paged, cache, shape) -> None:
    """Log at INFO, once per ``key()`` (a batch's size class or graph bucket) in the process, what the forward over
    ``paged`` ran: backend, path and kernel decisions (:func:`relaygr_engine.attention.plan.of_forward`; ``shape()``
    what the plan says of the batch). Nothing is built while the ``relaygr_engine`` logger is below INFO."""
    if not _log.isEnabledFor(logging.INFO):
        return
    from ..attention.plan import log_once, of_forward

    log_once(key(), lambda: of_forward(paged, cache.device, cache.dtype, dict(
        shape(), heads=cache.num_heads, head_dim=cache.head_dim, page_size=cache.page_size,
        kv_dtype=cache.kv_dtype.value), cache.config.attention_backend))
