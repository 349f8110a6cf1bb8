"""Batch and forward-context building: the jobs of one engine call through the user's model in one relay forward."""
from __future__ import annotations

import collections
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from .._host import ship
from ..batch import RelayBatch
from ..config import AttentionBackend, GraphConfig
from ..attention.context import PagedState, paged_context
from ..attention.torch_plan import build_torch_plan
from ..attention.ops import _resolve_backend, plan_paged_attention
from .compiled import ModelCaller
from .graphs import GraphRunner
from .layout import check_scores, log_plan, page_layout, split_scores
from .records import Job
from .staging import page_bytes
from .timing import LazyTimer
from .tiers import CacheState

__all__ = ["ForwardRunner", "TORCH_PLANS_BYTES", "TORCH_PLANS_KEPT"]

# Torch-backend plans a runner keeps, by layout (the most recent; ForwardRunner._torch_plan), and the most bytes
# their tensors may hold together (a plan larger than that is not kept).
TORCH_PLANS_KEPT = 64
TORCH_PLANS_BYTES = 64 << 20


class ForwardRunner:
    """Runs jobs (rows over cached prefixes) through ``model`` with the engine's pages in the forward context.

    Parameters
    ----------
    model : nn.Module
        Called as ``model(batch) -> [number of candidate rows, num_tasks]``.
    layers : sequence of PrefixAttention
        The model's attention layers; layer ``i`` reads and writes ``state.cache.kv[i]``.
    state : CacheState
    compile_attention : bool
        Run the torch backend's planned attention compiled (``PagedState.compiled``).
    compile_model : bool
        Compile the whole model (:class:`~relaygr_engine.engine.compiled.ModelCaller`); a model given compiled
        is served compiled either way.
    graphs : GraphConfig, optional
        Serve ranking forwards through CUDA graphs (:mod:`relaygr_engine.engine.graphs`), over the compiled model
        when there is one.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], state: CacheState, *,
                 compile_attention: bool = False, compile_model: bool = False,
                 graphs: Optional[GraphConfig] = None) -> None:
        self.layers, self.state = list(layers), state
        self.model = ModelCaller(model, compile_model, state.counters)
        self.compile_attention = compile_attention
        self.timer = LazyTimer(state.cache.device)
        self.graphs = None if graphs is None else GraphRunner(self.model, layers, state, graphs)
        self._torch_plans: collections.OrderedDict = collections.OrderedDict()  # layout -> (torch plan, its bytes)
        self._torch_plan_bytes = 0

    def run(self, jobs: list[Job]) -> list[Optional[torch.Tensor]]:
        """Every job's scores ``[C, num_tasks]`` (None without candidates); each job's new history K/V is written to
        its ``write_pages`` by the layers.

        Jobs go in one varlen forward per kind of history (with or without timestamps, action ids).
        """
        out: list = [None] * len(jobs)
        if not jobs:
            return out
        mark = self.timer.start(sum(j.num_rows for j in jobs))
        groups: dict[tuple, list[int]] = {}
        for i, j in enumerate(jobs):
            h = j.prep.history
            groups.setdefault((h.timestamps is not None, h.action_ids is not None), []).append(i)
        if len(groups) == 1:  # (one kind of history: the jobs in order)
            out = self._run_group(jobs)
        else:
            for group in groups.values():
                for i, scores in zip(group, self._run_group([jobs[i] for i in group])):
                    out[i] = scores
        for rows, seconds in self.timer.stop(mark):  # no wait for the device: spans finished by now
            self.state.expander.observe_recompute(rows, seconds)
        return out

    def _plan(self, backend: AttentionBackend, tables: list[torch.Tensor], batch: RelayBatch):
        """The Triton kernel's tile schedule (None for the torch backend), planned from host copies of the page
        table and row layout: no read from the device."""
        if backend is not AttentionBackend.TRITON:
            return None
        rows = [torch.from_numpy(np.asarray(a, dtype=np.int32)) for a in (np.cumsum([0, *batch.rows]),
                                                                           batch.candidates_per_user)]
        return plan_paged_attention(self.state.cache.kv[0], *tables, *rows, backend=backend,
                                    kv_dtype=self.state.cache.kv_dtype)

    def _torch_plan(self, jobs: list[Job], batch: RelayBatch):
        """The torch backend's plan of the batch (:func:`~relaygr_engine.attention.torch_plan.build_torch_plan`).

        On the CPU a ranking's plan is kept per layout: each user's entry, cached tokens and pages, rows and
        candidates, the rows' timestamps (its index tables, and the bias indices its first layer adds, read only
        these; the cached tokens' timestamps are the entry's, which its key fixes). A batch of a kept layout (a user
        ranked again over the same prefix, as a relay does between pre-infers) reuses it: the last
        :data:`TORCH_PLANS_KEPT`, within :data:`TORCH_PLANS_BYTES` of tensors."""
        st = self.state
        cache, ps, dev = st.cache, st.page_size, st.cache.device
        timed = batch.timestamps is not None
        key = None
        if dev.type == "cpu" and all(j.candidates is not None for j in jobs):  # (rankings: a pre-infer's rows are new)
            key = (tuple((j.key, j.start, page_bytes(j.pages, -(-j.start // ps))) for j in jobs), batch.rows,
                   batch.candidates_per_user, batch.timestamps.numpy().tobytes() if timed else None)
            got = self._torch_plans.get(key)
            if got is not None:
                self._torch_plans.move_to_end(key)
                return got[0]
        plan = build_torch_plan(
            batch.rows, batch.candidates_per_user, [j.start for j in jobs],
            [j.pages if j.start else np.zeros(0, np.int64) for j in jobs], ps, cache.num_heads, dev,
            ts_rows=batch.timestamps if timed else None, ts_cache=cache.timestamps if timed else None,
            slots_per_page=cache.slots_per_page if cache.kv_dtype.quantized else None, head_dim=cache.head_dim)
        if key is not None and plan is not None:
            size = sum(t.numel() * t.element_size() for t in vars(plan).values() if isinstance(t, torch.Tensor))
            kept = self._torch_plans
            kept[key] = (plan, size)
            self._torch_plan_bytes += size
            while kept and (len(kept) > TORCH_PLANS_KEPT or self._torch_plan_bytes > TORCH_PLANS_BYTES):
                self._torch_plan_bytes -= kept.popitem(last=False)[1][1]
        return plan

    def _run_group(self, jobs: list[Job]) -> list[Optional[torch.Tensor]]:
        st = self.state
        cache, ps, dev = st.cache, st.page_size, st.cache.device
        parts = [(j.prep.history, j.start, j.candidates, j.prep.request_time) for j in jobs]
        if self.graphs is not None and self.graphs.serves(jobs):
            out = self.graphs.run(jobs, parts)
            if out is not None:
                return out
        batch = RelayBatch.from_requests(parts, device=dev)
        lay = page_layout(jobs, batch.rows, ps)
        host = [torch.from_numpy(a) for a in (lay.indptr, lay.indices, lay.last)]
        kv_indptr, kv_indices, kv_last = ship(host, dev)
        backend = _resolve_backend(st.config.attention_backend, dev)
        timed = batch.timestamps is not None
        paged = PagedState(cache.kv, kv_indptr, kv_indices, kv_last, cache.timestamps if timed else None, backend,
                           kv_flat=cache.kv_flat, compiled=self.compile_attention,
                           plan=self._plan(backend, host, batch), kv_dtype=cache.kv_dtype, compute_dtype=cache.dtype)
        if backend is AttentionBackend.TORCH:
            paged.torch_plan = self._torch_plan(jobs, batch)
        writes = lay.write_rows.size > 0
        if writes:
            paged.set_writes(*ship([torch.from_numpy(a) for a in (lay.write_rows, lay.write_pages, lay.write_slots)],
                                   dev))
        with paged_context(batch, paged, self.layers):
            scores = self.model(batch)
        check_scores(scores, batch.num_candidate_rows)
        log_plan(lambda: ("eager", len(jobs), *(_pow2(n) for n in (len(batch), batch.num_candidate_rows,
                                                                   max(j.start for j in jobs)))), paged, cache,
                 lambda: dict(users=len(jobs), rows=len(batch), candidates=batch.num_candidate_rows,
                              cached=max(j.start for j in jobs)))
        if writes and timed:
            cache.timestamps[paged.write_pages, paged.write_slots] = batch.timestamps[paged.write_rows]
        return split_scores(scores, batch.candidates_per_user)


def _pow2(n: int) -> int:
    """``n`` rounded up to a power of two (0 stays 0): the size class a batch's plan is logged once for."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()
