"""CUDA graphs for the ranking forward (and pre-infer chunks): each padded shape bucket is captured once, then
replayed.

A ranking's GPU work is a few milliseconds, but queueing it from Python (about a hundred launches per forward:
the user's model ops, a KV write and an attention kernel per layer) costs as much or more. A CUDA graph replays
the whole forward in one launch. A graph has fixed shapes and addresses, so the rows of a batch are padded up to a
shape bucket (:class:`GraphKey`) and every input is copied into the bucket's static buffers (one
:class:`~relaygr_engine._host.Arena`, refilled in one host-to-device copy per replay), as NVIDIA's HSTU inference
does with its padded batch buckets.

Padding. After the batch's ``B`` users come empty users up to ``U`` (a power of two), then one padding user holding
the extra rows: ``H_pad - H`` history rows and ``C_pad - C`` candidates, with no cached prefix and no history
tokens (every row at position 0), their items, actions and times copies of the batch's last row (so every id stays
one the model accepts). Padding rows attend only to themselves and the padding user's rows; their K/V are not
stored; their scores are dropped.

Live tiles. The attention kernel's tile tables hold the batch's live tiles (the padding user's included; the key
names their count per kind, rounded up past 8 by :func:`~relaygr_engine.kernels._prefix_plan.round_tiles`), not
the most a bucket's batches could make (``rows // block_m + users``), so the split count and the HSTU bias table are
chosen for the live work: at NVIDIA's shape 3 tiles x 4 heads, 11 splits, as the eager plan, where tables of 7 tiles
got 4 (and a 386-row bias table for 129 live rows). A graph fixes its launch grid and the split count (a launch
argument) at capture, so a batch of another tile count takes a graph of its own rather than one grid sized for the
most tiles whose programs read the count on the device: the kernel stays as it is, and the graphs stay few (a
single-user ranking's tiles follow from its padded shape, up to one tile of the padding user's rows per kind; a
batch's counts take at most 4 widths per power of two, within ``GraphConfig.max_graphs``). Each tile's keys are
split as for the bucket's longest prefix and all its new history rows (every key of every batch it serves covered).

Host work. A replay's host work is what depends on the request: its rows are written straight into the staging
buffer, and the row, tile and page tables are computed once per layout and bucket and copied back after
(:mod:`relaygr_engine.engine.staging`).

What a captured model may do. It runs on the batch's tensors (``item_ids``, ``positions``, ...,
``candidate_rows``, ``num_candidate_rows``): the host layout (``rows``, ``start``, ``candidates_per_user``) changes
between the batches a graph replays, so reading it raises, and the engine then serves every forward eagerly
(logged once). A forward that synchronises with the host or copies host memory cannot be captured either; the
same fallback applies. The first batch of each bucket runs eagerly over the static buffers (its result is
served), then the bucket is captured.

Pre-infer forwards (rows without candidates: ``GraphConfig.prefill``) go through the same buckets with no
candidate rows; a relay pre-infers in chunks of a fixed size, so its forwards fall in few buckets (one per chunk
size and power of two of the cached prefix). Layer-wise DRAM onload (:mod:`relaygr_engine.onload`) waits on
external events, so a captured forward waits on the copies of the hit it serves.
"""
from __future__ import annotations

import collections
import gc
import logging
import traceback
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from .._host import Arena
from .._warn import warn_once
from ..batch import RelayBatch
from ..rows import gather_rows, write_host_rows
from ..config import AttentionBackend, GraphConfig
from ..attention.context import PagedState, paged_context
from ..kernels._common import cdiv
from ..kernels._prefix_plan import live_tiles, round_tiles
from .layout import check_scores, log_plan, split_scores
from .records import Job
from .staging import HostRows, Tables, host_layout, page_bytes, page_tables, row_tables
from .tiers import CacheState

__all__ = ["GraphKey", "GraphRunner", "HostLayoutRead", "bucket", "reset_rng_after_failed_capture"]

_log = logging.getLogger("relaygr_engine")
_MIN_ROWS = 16


def bucket(n: int, steps: int = 4) -> int:
    """``n`` rounded up to one of ``steps`` sizes per power of two, a multiple of 16 (0 stays 0).

    With 4 steps a bucket pads at most 25% (and at most 15 rows below 64); with 1, to a power of two.
    """
    if n <= 0:
        return 0
    if n <= _MIN_ROWS:
        return _MIN_ROWS
    top = 1 << (n - 1).bit_length()                    # the power of two at or above n
    step = max(_MIN_ROWS, top // (2 * steps))
    return cdiv(n, step) * step


def reset_rng_after_failed_capture(device: torch.device) -> None:
    """After a CUDA graph capture on ``device`` that raised: its default CUDA generator continues from a fresh copy
    of its state (the same seed and offset).

    torch ends such a capture without ending the generator's part in it (the state stays marked as capturing, in
    the torch releases whose generator state has that mark), so every later random op on the device would raise
    "Offset increment outside graph capture encountered unexpectedly": a caller that goes on eagerly after a failed
    capture would leave the process's random numbers broken. Graphs captured before keep the state they were
    captured with. Where the reset itself fails, it says so (logged once) and leaves the generator as it is."""
    if device.type != "cuda":
        return
    try:
        gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        gen.graphsafe_set_state(gen.clone_state())
    except Exception as exc:  # noqa: BLE001 - a best effort on a path that is already falling back
        warn_once(_log, ("graphs", "rng-reset"), "could not reset the CUDA generator after a failed graph capture "
                  "(%s: %s): random ops on %s may raise from now on", type(exc).__name__, exc, device)


class GraphKey(NamedTuple):
    """A shape bucket: everything a captured forward's shapes and launches depend on."""

    timed: bool           # rows carry timestamps
    acted: bool           # rows carry action ids
    writes: bool          # some rows' K/V are stored
    users: int            # U: user slots (a power of two), plus one padding user
    history_rows: int     # H_pad: new history rows
    candidates: int       # C_pad: candidate rows
    prefix: int           # longest cached prefix (a power of two): the split-prefix schedule's length
    tiles: tuple = (0, 0)  # (history, candidate) tiles of its tile tables: the batch's live ones (round_tiles)


# Layouts whose GraphKey a runner keeps (past it the kept keys are dropped and made again as batches come).
KEYS_KEPT = 4096


def _flags(rows) -> tuple[bool, bool]:
    """``(timestamps, action ids)`` of a batch's rows (HostRows or RequestRows)."""
    if isinstance(rows, HostRows):
        return rows.timed, rows.acted
    return rows.times is not None, rows.actions is not None


class HostLayoutRead(RuntimeError):
    """A captured forward read the batch's host layout (``rows``, ``start``, ``candidates_per_user``)."""


class _HostLayout(tuple):
    """Stands in for the host layout of a batch a graph replays: reading it raises :class:`HostLayoutRead`."""

    def _refuse(self, *args, **kwargs):
        raise HostLayoutRead("a CUDA-graph ranking forward read the batch's host layout (rows, start or "
                             "candidates_per_user), which changes between the batches one graph replays; use the "
                             "batch's tensors (cu_seqlens, num_candidates, candidate_rows) or turn cuda_graphs off")

    __iter__ = __getitem__ = __len__ = __contains__ = _refuse


_HIDDEN = _HostLayout()


@dataclass(eq=False)
class _Bucket:
    """The static buffers of one key, and its graph once captured."""

    key: GraphKey
    arena: Arena
    names: list
    block_m: tuple  # rows of a history tile and of a candidate tile
    num_tiles: tuple  # (history tiles, candidate tiles) of the fixed grid: the key's live tiles
    tables: Tables
    row_fields: tuple = ()  # the arena entries of item_ids, action_ids, timestamps (None: not in it)
    graph: Optional[object] = None
    out: Optional[torch.Tensor] = None

    def view(self, name: str) -> Optional[torch.Tensor]:
        return self.arena.views[self.names.index(name)] if name in self.names else None


class GraphRunner:
    """Serves ranking forwards through captured CUDA graphs (:class:`~relaygr_engine.engine.forward.ForwardRunner`
    asks it first).

    Parameters
    ----------
    model : nn.Module
    layers : sequence of PrefixAttention
    state : CacheState
    config : GraphConfig
    capture : bool
        Capture graphs (default). False (tests on a CPU): every forward runs eagerly over the static buffers, which
        checks the padding and the buffers without a GPU.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], state: CacheState, config: GraphConfig, *,
                 capture: bool = True) -> None:
        self.model, self.layers, self.state, self.config = model, list(layers), state, config
        self.capture = capture
        self.buckets: collections.OrderedDict = collections.OrderedDict()
        self.disabled: Optional[str] = None
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._block_m: dict = {}  # padded shape -> tile rows (_tile_rows)
        self.target = state.cache.device  # what the buckets' tiles are planned for (a Target: a GPU not here)
        self._keys: dict = {}  # a batch's layout -> its GraphKey (key)

    # ------------------------------------------------------------------------------------------ entry
    def serves(self, jobs: list[Job]) -> bool:
        """Whether a forward of ``jobs`` goes through graphs: rankings (every job has candidates), or pre-infers
        (none has) when ``config.prefill``."""
        ranked = [j.candidates is not None for j in jobs]
        return all(ranked) or (self.config.prefill and not any(ranked))

    def run(self, jobs: list[Job], parts: list[tuple]) -> Optional[list]:
        """Each job's scores ``[C, num_tasks]`` (None for a pre-infer job) from a graph replay (or the bucket's
        first, eager, forward); None where this forward is not served here (graphs turned off after a failure):
        the caller runs it eagerly. ``jobs`` are all rankings or all pre-infers (:meth:`serves`); ``parts`` are
        their ``(history, start, candidates, request_time)`` (:meth:`RelayBatch.from_requests`)."""
        c = self.state.counters
        if self.disabled is not None:
            c.graph_eager += 1
            return None
        rows = host_layout(parts) or gather_rows(parts, self.state.cache.device)
        key = self.key(jobs, rows)
        b = self.buckets.get(key)
        if b is None:
            b = self._new_bucket(key)
        self.buckets.move_to_end(key)
        self._fill(b, jobs, rows, parts)
        C = rows.num_candidate_rows
        if b.graph is not None:
            b.graph.replay()
            scores = b.out[:C].clone()
            if C:
                c.graph_replays += 1
            else:
                c.prefill_graph_replays += 1
        else:
            try:
                batch, paged = self._static(b)
                scores = self._forward(b, batch, paged)[:C]
                log_plan(lambda: ("graph", b.key), paged, self.state.cache, lambda: dict(
                    users=b.key.users, history_rows=b.key.history_rows, candidates=b.key.candidates,
                    prefix=b.key.prefix, bucket="CUDA graph"))
            except HostLayoutRead as exc:
                self._disable(f"the model reads the batch's host layout ({exc})")
                return None
            if self.capture:
                self._capture(b)
        return split_scores(scores, rows.candidates)

    def key(self, jobs: list[Job], rows) -> GraphKey:
        """The bucket of a batch of ranking jobs (``rows``: their :class:`~relaygr_engine.engine.staging.HostRows`
        or :class:`~relaygr_engine.rows.RequestRows`): its padded shape, and the tiles its rows make (the padding
        user's included), so that the kernel's tables, split count and bias table follow the batch's live tiles."""
        writes = any(j.write_pages is not None and j.prep.num_tokens > j.start for j in jobs)
        layout = (rows.starts, rows.rows, rows.candidates, writes, _flags(rows))
        got = self._keys.get(layout)
        if got is None:
            if len(self._keys) >= KEYS_KEPT:
                self._keys.clear()
            got = self._keys[layout] = self._key(rows, writes)
        return got

    def _key(self, rows, writes: bool) -> GraphKey:
        C = rows.num_candidate_rows
        H = rows.num_rows - C
        longest = max(rows.starts)
        users, H_pad, C_pad = 1 << (len(rows.rows) - 1).bit_length(), bucket(H), bucket(C)
        prefix = 0 if longest == 0 else 1 << (longest - 1).bit_length()
        block_m = self._tile_rows(users, H_pad, C_pad, prefix)
        live = live_tiles([r - c for r, c in zip(rows.rows, rows.candidates)] + [H_pad - H],
                          [*rows.candidates, C_pad - C], block_m)
        most = (H_pad // block_m[0] + users + 1, C_pad // block_m[1] + users + 1)
        timed, acted = _flags(rows)
        return GraphKey(timed, acted, writes, users, H_pad, C_pad, prefix,
                        (round_tiles(live[0], most[0]), round_tiles(live[1], most[1])))

    def _tile_rows(self, users: int, history_rows: int, candidates: int, prefix: int) -> tuple[int, int]:
        """Rows of a history tile and of a candidate tile in the buckets of this padded shape (the kernel's
        config for the cache; history tiles' height by the bias table's budget for the shape's most tiles)."""
        shape = (users, history_rows, candidates, prefix)
        got = self._block_m.get(shape)
        if got is None:
            from ..kernels._prefix_config import history_tile_rows
            from ..kernels.prefix_attention import pick_config

            cache = self.state.cache
            cfg = pick_config(self.target, cache.dtype, cache.kv[0].shape[-1])
            most = (lambda m: history_rows // m + users + 1)  # (per kind: the sum over segments of ceil(rows / m))
            got = self._block_m[shape] = (history_tile_rows(cfg, most, prefix + history_rows + candidates),
                                          cfg.block_m)
        return got

    # ------------------------------------------------------------------------------------------ buckets
    def _new_bucket(self, key: GraphKey) -> _Bucket:
        while len(self.buckets) >= self.config.max_graphs:
            self.buckets.popitem(last=False)
            self.state.counters.graph_evictions += 1
        cache = self.state.cache
        R, S = key.history_rows + key.candidates, key.users + 1
        block_m = self._tile_rows(key.users, key.history_rows, key.candidates, key.prefix)
        pages = max(1, key.users * cdiv(key.prefix, self.state.page_size))
        i32, i64 = torch.int32, torch.long
        # In three spans of the arena: the request's rows (written every time), then the row and tile tables and
        # the page tables (each restored from the bucket's tables of the same layout, _Tables).
        specs = {"item_ids": (i64, (R,))}
        if key.acted:
            specs["action_ids"] = (i64, (R,))
        if key.timed:
            specs["timestamps"] = (i64, (R,))
        specs.update({"positions": (i64, (R,)), "is_candidate": (torch.bool, (R,)), "is_context": (torch.bool, (R,)),
                      "is_behavior": (torch.bool, (R,)), "segment_ids": (i64, (R,)), "cu_seqlens": (i32, (S + 1,)),
                      "num_candidates": (i32, (S,)), "candidate_rows": (i64, (key.candidates,)),
                      "hist_tiles": (i32, (2, key.tiles[0])), "cand_tiles": (i32, (2, key.tiles[1])),
                      "kv_indptr": (i32, (S + 1,)), "kv_indices": (i32, (pages,)), "kv_last": (i32, (S,)),
                      "slots": (i64, (R,))})
        if key.timed and key.writes:
            specs.update(ts_rows=(i64, (R,)), ts_flat=(i64, (R,)))
        names = list(specs)
        arena = Arena([specs[n] for n in names], cache.device)
        spans = {"rows": arena.span(names.index("positions"), names.index("cand_tiles")),
                 "pages": arena.span(names.index("kv_indptr"), len(names) - 1)}
        b = _Bucket(key, arena, names, block_m, key.tiles, Tables(spans),
                    tuple(names.index(n) if n in specs else None for n in ("item_ids", "action_ids", "timestamps")))
        self.buckets[key] = b
        return b

    def _fill(self, b: _Bucket, jobs: list[Job], rows, parts: Sequence[tuple]) -> None:
        """Write the padded rows of ``parts`` and the host tables into ``b``'s buffers: numpy writes into one staging
        buffer, one host-to-device copy (then a copy per row field where the rows were built on the device, ``rows``
        a :class:`~relaygr_engine.rows.RequestRows`). The tables are computed once per layout and bucket: a later
        batch of the same layout copies their bytes (:class:`~relaygr_engine.engine.staging.Tables`)."""
        R, key = rows.num_rows, b.key
        staging, arrays = b.arena.stage()
        raw, ps = staging.numpy(), self.state.page_size
        named = (lambda: dict(zip(b.names, arrays)))
        layout = (rows.starts, rows.rows, rows.candidates, rows.context, rows.tokens)
        b.tables.fill("rows", layout, raw, lambda: row_tables(key, b.block_m, rows, len(jobs), named()))
        pages = tuple((j.start, j.prep.num_tokens, page_bytes(j.pages, -(-j.start // ps)),
                       None if j.write_pages is None else page_bytes(j.write_pages, len(j.write_pages)))
                      for j in jobs)
        b.tables.fill("pages", (rows.rows, pages), raw, lambda: page_tables(jobs, rows, ps, named()))
        names = ("item_ids", "action_ids", "timestamps")
        if isinstance(rows, HostRows):
            fields = [None if i is None else arrays[i] for i in b.row_fields]
            write_host_rows(parts, *fields)
            if R < key.history_rows + key.candidates:
                for a in fields:
                    if a is not None:
                        a[R:] = a[R - 1]  # the padding rows: copies of the last row (ids the model accepts)
            b.arena.load(staging)
            return
        b.arena.load(staging)
        for name, pieces in zip(names, (rows.items, rows.actions, rows.times)):  # after the staged copy, same stream
            if pieces is None:
                continue
            view, t = b.view(name), torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            view[:R].copy_(t)
            if R < view.numel():
                view[R:].copy_(t[-1:].expand(view.numel() - R))

    # ------------------------------------------------------------------------------------------ forward
    def _static(self, b: _Bucket) -> tuple[RelayBatch, PagedState]:
        """A batch and paged state over ``b``'s buffers: new objects, so nothing computed from one batch's values
        (a cached property) is kept in a graph."""
        v, cache, key = b.view, self.state.cache, b.key
        batch = RelayBatch(item_ids=v("item_ids"), action_ids=v("action_ids"), timestamps=v("timestamps"),
                           positions=v("positions"), is_candidate=v("is_candidate"), is_context=v("is_context"),
                           is_behavior=v("is_behavior"), segment_ids=v("segment_ids"),
                           candidate_rows=v("candidate_rows"), cu_seqlens=v("cu_seqlens"),
                           num_candidates=v("num_candidates"), start=_HIDDEN, rows=_HIDDEN,
                           candidates_per_user=_HIDDEN, has_prefix=True)
        batch.__dict__["num_candidate_rows"] = key.candidates
        from ..kernels.prefix_attention import PrefixAttentionPlan

        R, S = len(batch), key.users + 1
        plan = PrefixAttentionPlan(b.block_m[1], b.block_m[0], S, R, self.state.page_size, cache.kv[0].shape[0],
                                   v("hist_tiles"), v("cand_tiles"), key.prefix + R, key.prefix,
                                   key.prefix + key.history_rows, {})
        paged = PagedState(cache.kv, v("kv_indptr"), v("kv_indices"), v("kv_last"),
                           cache.timestamps if key.timed else None, AttentionBackend.TRITON, kv_flat=cache.kv_flat,
                           plan=plan, kv_dtype=cache.kv_dtype, compute_dtype=cache.dtype)
        if key.writes:
            paged.write_rows = paged._slot_mapping = v("slots")  # the Triton write reads the slot of every row
        return batch, paged

    def _forward(self, b: _Bucket, batch: RelayBatch, paged: PagedState) -> torch.Tensor:
        with paged_context(batch, paged, self.layers):
            scores = self.model(batch)
        check_scores(scores, b.key.candidates)
        if "ts_rows" in b.names:
            self.state.cache.timestamps.view(-1).index_copy_(0, b.view("ts_flat"),
                                                             batch.timestamps[b.view("ts_rows")])
        return scores

    def _capture(self, b: _Bucket) -> None:
        graph = torch.cuda.CUDAGraph()
        # No garbage collection during the capture: freeing a pinned host buffer there records an event on the
        # stream it was copied on (the legacy default stream), which invalidates the capture. thread_local: a CUDA
        # call of another thread of the process (a server's) cannot spoil it either.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._forward(b, *self._static(b))
        except Exception as exc:  # noqa: BLE001 - any capture failure: serve eagerly from now on
            self.buckets.pop(b.key, None)
            reset_rng_after_failed_capture(self.state.cache.device)
            first = exc.__context__ or exc  # what failed inside the capture (ending it raises a second error)
            self._disable(f"capture failed: {type(first).__name__}: {first}",
                          "".join(traceback.format_exception(first)))
            return
        finally:
            if collecting:
                gc.enable()
        b.graph, b.out = graph, out
        if b.key.candidates:
            self.state.counters.graph_captures += 1
        else:
            self.state.counters.prefill_graph_captures += 1

    def _disable(self, reason: str, details: str = "") -> None:
        self.disabled = reason
        self.buckets.clear()
        self.state.counters.graph_failures += 1
        _log.warning("cuda_graphs: serving forwards eagerly: %s", reason)
        if details:
            _log.info("cuda_graphs: the capture's failure:\n%s", details)
