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
stored; their scores are dropped. The attention kernel runs a fixed tile table (the bucket's most tiles, the spare
ones empty) and splits each tile's keys as for the bucket's longest prefix and all its new history rows.

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

import numpy as np
import torch
from torch import nn

from .._host import Arena
from .._warn import warn_once
from ..batch import RelayBatch, RequestRows, build_device, gather_rows, structure_arrays
from ..config import AttentionBackend, GraphConfig
from ..attention.context import PagedState, paged_context
from ..kernels._common import cdiv, tile_arrays
from .layout import check_scores, log_plan, page_layout, split_scores
from .records import Job
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
    num_tiles: tuple  # (history tiles, candidate tiles) of the fixed grid
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
        rows = gather_rows(parts, build_device(parts, self.state.cache.device))
        key = self.key(jobs, rows)
        b = self.buckets.get(key)
        if b is None:
            b = self._new_bucket(key)
        self.buckets.move_to_end(key)
        self._fill(b, jobs, rows)
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

    def key(self, jobs: list[Job], rows: RequestRows) -> GraphKey:
        """The bucket of a batch of ranking jobs."""
        C = rows.num_candidate_rows
        H = rows.num_rows - C
        longest = max(j.start for j in jobs)
        return GraphKey(rows.times is not None, rows.actions is not None,
                        any(j.write_pages is not None and j.prep.num_tokens > j.start for j in jobs),
                        1 << (len(jobs) - 1).bit_length(), bucket(H), bucket(C),
                        0 if longest == 0 else 1 << (longest - 1).bit_length())

    # ------------------------------------------------------------------------------------------ buckets
    def _new_bucket(self, key: GraphKey) -> _Bucket:
        from ..kernels._prefix_config import history_tile_rows
        from ..kernels.prefix_attention import pick_config

        while len(self.buckets) >= self.config.max_graphs:
            self.buckets.popitem(last=False)
            self.state.counters.graph_evictions += 1
        cache = self.state.cache
        R, S = key.history_rows + key.candidates, key.users + 1
        cfg = pick_config(cache.device, cache.dtype, cache.kv[0].shape[-1])
        # Per kind, the sum over segments of ceil(rows / block_m), at most; the plan's keys: key.prefix + R.
        tiles = lambda rows, m: rows // m + S  # noqa: E731
        block_m = (history_tile_rows(cfg, lambda m: tiles(key.history_rows, m), key.prefix + R), cfg.block_m)
        num_tiles = (tiles(key.history_rows, block_m[0]), tiles(key.candidates, block_m[1]))
        pages = max(1, key.users * cdiv(key.prefix, self.state.page_size))
        i32, i64 = torch.int32, torch.long
        specs = {"item_ids": (i64, (R,)), "positions": (i64, (R,)), "is_candidate": (torch.bool, (R,)),
                 "is_context": (torch.bool, (R,)), "is_behavior": (torch.bool, (R,)), "segment_ids": (i64, (R,)),
                 "cu_seqlens": (i32, (S + 1,)), "num_candidates": (i32, (S,)),
                 "kv_indptr": (i32, (S + 1,)), "kv_indices": (i32, (pages,)), "kv_last": (i32, (S,)),
                 "hist_tiles": (i32, (2, num_tiles[0])), "cand_tiles": (i32, (2, num_tiles[1])),
                 "slots": (i64, (R,)), "candidate_rows": (i64, (key.candidates,))}
        if key.acted:
            specs["action_ids"] = (i64, (R,))
        if key.timed:
            specs["timestamps"] = (i64, (R,))
        if key.timed and key.writes:
            specs.update(ts_rows=(i64, (R,)), ts_flat=(i64, (R,)))
        names = list(specs)
        b = _Bucket(key, Arena([specs[n] for n in names], cache.device), names, block_m, num_tiles)
        self.buckets[key] = b
        return b

    def _fill(self, b: _Bucket, jobs: list[Job], rows: RequestRows) -> None:
        """Write the padded rows of ``rows`` and the host tables into ``b``'s buffers: numpy writes into one staging
        buffer, one host-to-device copy (then a copy per row field of rows built on the device)."""
        key, ps = b.key, self.state.page_size
        C, R = rows.num_candidate_rows, rows.num_rows
        pad_hist, pad_cand = key.history_rows - (R - C), key.candidates - C
        empty = key.users - len(jobs)
        # after the users, empty users, then the padding user: no prefix, no history tokens (its rows at position 0)
        seg_rows = [*rows.rows] + [0] * empty + [pad_hist + pad_cand]
        seg_cand = [*rows.candidates] + [0] * empty + [pad_cand]
        seg_ctx, seg_start, seg_tokens = ([*v] + [0] * (empty + 1) for v in (rows.context, rows.starts, rows.tokens))
        lay = page_layout(jobs, rows.rows, ps)
        staging, arrays = b.arena.stage()
        out = dict(zip(b.names, arrays))
        structure_arrays(seg_start, seg_rows, seg_cand, seg_ctx, seg_tokens, out=out)
        n = lay.indptr[-1]
        out["kv_indptr"][:len(jobs) + 1], out["kv_indptr"][len(jobs) + 1:] = lay.indptr, n
        out["kv_indices"][:n], out["kv_indices"][n:] = lay.indices, 0
        out["kv_last"][:len(jobs)], out["kv_last"][len(jobs):] = lay.last, 0
        slots = out["slots"]
        slots[:] = -1
        slots[lay.write_rows] = lay.write_pages * ps + lay.write_slots
        tile_arrays(seg_rows, seg_cand, b.block_m, b.num_tiles, out=(out["hist_tiles"], out["cand_tiles"]))
        if "ts_rows" in out:
            written = np.flatnonzero(slots >= 0)
            out["ts_rows"][:] = np.resize(written, len(slots))  # repeats of real writes: the same values again
            out["ts_flat"][:] = slots[out["ts_rows"]]
        device_rows = []
        for name, pieces in (("item_ids", rows.items), ("action_ids", rows.actions), ("timestamps", rows.times)):
            if pieces is None:
                continue
            if rows.device.type != "cpu":
                device_rows.append((b.view(name), torch.cat(pieces) if len(pieces) > 1 else pieces[0]))
                continue
            a = out[name]
            np.concatenate(pieces, out=a[:R])
            a[R:] = a[R - 1]  # the padding rows: copies of the last row (ids the model accepts)
        b.arena.load(staging)
        for view, t in device_rows:  # after the staged copy, on the same stream
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
