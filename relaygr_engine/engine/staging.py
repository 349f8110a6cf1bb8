"""What a CUDA-graph replay writes on the host (:mod:`relaygr_engine.engine.graphs`): a batch's rows straight into
the staging buffer, and the bucket's tables, computed once per layout and copied back after.

A graph fixes addresses, not data, so every replay refills its bucket's static buffers. Of what it writes, only the
rows' ids, actions and times are the request's own; the row, tile and page tables follow from its layout (each
user's cached tokens, rows, candidates, pages), which repeats: a user ranked again against the same cached prefix, a
relay's fixed shapes. :class:`Tables` keeps a bucket's tables by layout as byte images of spans of its arena, so a
batch of a known layout costs one copy per span; :func:`host_layout` and
:func:`~relaygr_engine.rows.write_host_rows` take the engine's parts (checked by the engine already) without
building intermediate pieces.
"""
from __future__ import annotations

import collections
from typing import NamedTuple, Optional, Sequence

import numpy as np

from ..rows import structure_arrays
from ..kernels._common import tile_arrays
from .layout import page_layout

__all__ = ["HostRows", "TABLES_PER_BUCKET", "Tables", "host_layout", "page_bytes", "page_tables", "row_tables"]

# Table images a bucket keeps per span (row tables, page tables): the layouts of its last few batches.
TABLES_PER_BUCKET = 8


class HostRows(NamedTuple):
    """The segment sizes of host parts (what :class:`~relaygr_engine.rows.RequestRows` says of them, without
    the rows' pieces): per user its cached history tokens, rows, candidate rows, contextual rows, history length."""

    starts: tuple
    rows: tuple
    candidates: tuple
    context: tuple
    tokens: tuple
    timed: bool
    acted: bool

    @property
    def num_rows(self) -> int:
        return sum(self.rows)

    @property
    def num_candidate_rows(self) -> int:
        return sum(self.candidates)


def host_layout(parts: Sequence[tuple]) -> Optional[HostRows]:
    """The :class:`HostRows` of the engine's ``(history, start, candidates, request_time)`` parts, with timestamps
    and action ids like the first part's (the engine checked them: no check here); None unless every part's
    history and candidates are host tensors (then the batch's rows are built on the device)."""
    starts, rows, cands, ctx, tokens = [], [], [], [], []
    for h, start, c, _ in parts:
        if h.item_ids.device.type != "cpu" or (c is not None and c.device.type != "cpu"):
            return None
        U = 0 if h.context_ids is None else h.context_ids.numel()
        T, C = U + h.item_ids.numel(), 0 if c is None else c.numel()
        starts.append(start)
        rows.append(T - start + C)
        cands.append(C)
        ctx.append(max(0, U - start))
        tokens.append(T)
    h0 = parts[0][0]
    return HostRows(tuple(starts), tuple(rows), tuple(cands), tuple(ctx), tuple(tokens), h0.timestamps is not None,
                    h0.action_ids is not None)


def page_bytes(pages, n: int) -> bytes:
    """The first ``n`` entries of a page array (None: none), as bytes (part of a layout's key)."""
    return b"" if pages is None or not n else np.asarray(pages[:n]).tobytes()


class Tables:
    """A bucket's host tables by the layout that made them: a span of the arena's bytes
    (:meth:`~relaygr_engine._host.Arena.span`) per kind, the last :data:`TABLES_PER_BUCKET` layouts of each. A batch
    of a kept layout copies the bytes into its staging buffer (one copy, whatever the buffer held); another computes
    them, and they are kept.

    Parameters
    ----------
    spans : dict of str -> (int, int)
        Each kind's bytes ``[lo, hi)`` in a staging buffer.
    """

    def __init__(self, spans: dict) -> None:
        self.spans = spans
        self.kept = {name: collections.OrderedDict() for name in spans}

    def fill(self, name: str, layout, raw: np.ndarray, write) -> None:
        """Put the tables of ``layout`` (hashable) into span ``name`` of ``raw`` (a staging buffer's bytes);
        ``write()`` computes them into it where ``layout`` is not kept."""
        lo, hi = self.spans[name]
        kept = self.kept[name]
        image = kept.get(layout)
        if image is not None:
            kept.move_to_end(layout)
            raw[lo:hi] = image
            return
        write()
        kept[layout] = raw[lo:hi].copy()
        if len(kept) > TABLES_PER_BUCKET:
            kept.popitem(last=False)


def row_tables(key, block_m: tuple, rows, users: int, out: dict) -> None:
    """The row and tile tables of ``rows`` (``users`` of them) padded to a bucket's ``key`` (a
    :class:`~relaygr_engine.engine.graphs.GraphKey`), tiles of ``block_m`` rows, into the arrays ``out`` names."""
    C, R = rows.num_candidate_rows, rows.num_rows
    pad_hist, pad_cand = key.history_rows - (R - C), key.candidates - C
    empty = key.users - users
    # after the users, empty users, then the padding user: no prefix, no history tokens (its rows at position 0)
    seg_rows = [*rows.rows] + [0] * empty + [pad_hist + pad_cand]
    seg_cand = [*rows.candidates] + [0] * empty + [pad_cand]
    seg_ctx, seg_start, seg_tokens = ([*v] + [0] * (empty + 1) for v in (rows.context, rows.starts, rows.tokens))
    structure_arrays(seg_start, seg_rows, seg_cand, seg_ctx, seg_tokens, out=out)
    tile_arrays(seg_rows, seg_cand, block_m, key.tiles, out=(out["hist_tiles"], out["cand_tiles"]))


def page_tables(jobs: Sequence, rows, page_size: int, out: dict) -> None:
    """The page table of ``jobs`` and the K/V rows they store (their slots, and the timestamp rows' copy), into the
    arrays ``out`` names (padded: no pages and no stores past the jobs)."""
    lay = page_layout(jobs, rows.rows, page_size)
    n, B = lay.indptr[-1], len(jobs)
    out["kv_indptr"][:B + 1], out["kv_indptr"][B + 1:] = lay.indptr, n
    out["kv_indices"][:n], out["kv_indices"][n:] = lay.indices, 0
    out["kv_last"][:B], out["kv_last"][B:] = lay.last, 0
    slots = out["slots"]
    slots[:] = -1
    slots[lay.write_rows] = lay.write_pages * page_size + lay.write_slots
    if "ts_rows" in out:
        written = np.flatnonzero(slots >= 0)
        out["ts_rows"][:] = np.resize(written, len(slots))  # repeats of real writes: the same values again
        out["ts_flat"][:] = slots[out["ts_rows"]]
