"""Conformance check for a user's ranker: relay-race scores must equal the model's own no-cache forward.

    from relaygr_engine.testing import check_relay_exact
    report = check_relay_exact(model, histories, candidates)   # raises RelayMismatch on a difference

It runs every engine path on small engines (a miss, a hit over a pre-inferred prefix, a batch, an entry extended
while ranking and read again, a reload from the DRAM tier) and compares each score with the no-cache forward
(``model(batch)`` under :func:`relaygr_engine.batch_context`). On a difference it names the first
:class:`~relaygr_engine.PrefixAttention` layer whose output differs: in a model that is not prefix-stable (a
per-batch normaliser, positions counted from the end, query-time-relative features, a bidirectional block), the
rows computed over a cached prefix see other inputs than the same rows of a whole-sequence forward.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from .batch import RelayBatch
from .behaviors import Behaviors
from .config import CacheConfig, KVDtype, parse_choice
from .attention.context import batch_context, current_context
from .attention.layer import find_layers
from .engine import RankRequest, RelayEngine

__all__ = ["RelayMismatch", "check_relay_exact", "forbid_device_sync", "no_cache_scores"]

PATHS = ("miss", "hit", "batch", "extend", "dram")


class RelayMismatch(AssertionError):
    """Relay-race scores differ from the no-cache forward (the message names the path, request and layer)."""


def no_cache_scores(model: nn.Module, history: Behaviors, candidates: torch.Tensor,
                    request_time: Optional[int] = None) -> torch.Tensor:
    """The model's no-cache forward of one request: ``model(RelayBatch.full(...))`` with dense attention."""
    device = next((p.device for p in model.parameters()), None)
    batch = RelayBatch.full(history, candidates, request_time, device=device)
    with torch.inference_mode(), batch_context(batch):
        return model(batch)


@contextlib.contextmanager
def forbid_device_sync() -> Iterator[None]:
    """Fail on any device-to-host synchronisation inside the block (CUDA; elsewhere it checks nothing).

    Implicit waits (``.item()``, ``.tolist()``, ``.cpu()``, blocking copies, ``nonzero``, ...) raise through
    torch's sync debug mode set to ``"error"``; explicit ones (``torch.cuda.synchronize``,
    ``Stream.synchronize``, ``Event.synchronize``) raise ``RuntimeError`` naming the call. Use it to check that a
    warmed-up ranking (first calls compile and autotune kernels) queues its work without waiting for it::

        with rg.testing.forbid_device_sync():
            result = engine.rank_with_prefix(user, history, candidates, ticket=ticket)
    """
    if not torch.cuda.is_available():
        yield
        return
    waits = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
    saved = [getattr(owner, name) for owner, name in waits]

    def refuse(what: str):
        def call(*args, **kwargs):
            raise RuntimeError(f"{what} was called inside forbid_device_sync()")
        return call

    mode = torch.cuda.get_sync_debug_mode()
    try:
        for owner, name in waits:
            setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
        torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
        for (owner, name), fn in zip(waits, saved):
            setattr(owner, name, fn)


class _LayerTap:
    """Records every PrefixAttention output of each forward with the batch it ran on."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = find_layers(model)
        names = {id(m): n for n, m in model.named_modules()}
        self.names = [names.get(id(m), "?") for m in self.layers]
        self.runs: list[tuple[RelayBatch, dict]] = []
        self._hooks = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.layers)]

    def _hook(self, i: int):
        def hook(module, args, out):
            ctx = current_context()
            if not self.runs or self.runs[-1][0] is not ctx.batch:
                self.runs.append((ctx.batch, {}))
            self.runs[-1][1][i] = out.detach().clone()
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def _first_layer(tap: _LayerTap, relay_run, b: int, dense_run, atol: float) -> str:
    """Name the first layer whose rows of user ``b`` in ``relay_run`` differ from the same rows of ``dense_run``."""
    batch, outs = relay_run
    dense_batch, dense_outs = dense_run
    r0 = sum(batch.rows[:b])
    r1, start = r0 + batch.rows[b], batch.start[b]
    # the dense run holds every history row from 0: the relay rows are its rows start.. (history, then candidates)
    rows = torch.arange(start, start + r1 - r0, device=batch.device)
    for i in range(len(tap.layers)):
        if i not in outs or i not in dense_outs:
            continue
        diff = float((outs[i][r0:r1].float() - dense_outs[i][rows].float()).abs().max())
        if diff > atol:
            return f"layer {i} ({tap.names[i]}: max difference {diff:.3g})"
    return "none of the PrefixAttention outputs (the difference arises after the last layer)"


def check_relay_exact(model: nn.Module, histories: Sequence[Behaviors], candidates, *,
                      request_times: Optional[Sequence[Optional[int]]] = None, atol: float = 1e-4,
                      attention_backend: str = "torch", page_size: int = 4,
                      paths: Sequence[str] = PATHS, kv_dtype: str = "model") -> dict[str, float]:
    """Check that relay-race inference of ``model`` equals its no-cache forward on every engine path.

    Exactness holds for a cache in the model's dtype (the default ``kv_dtype="model"``). An 8-bit cache
    (``kv_dtype="int8"`` or ``"fp8_e4m3"``) reads cached rows dequantised, so its scores are close to, not equal to,
    the no-cache forward: the check then runs the same paths on such a cache and needs the ``atol`` you accept.

    Parameters
    ----------
    model : nn.Module
        A ranker built on :class:`~relaygr_engine.PrefixAttention` (see :class:`~relaygr_engine.RelayEngine`), in
        eval mode, on the device it will serve on; or such a ranker compiled with ``torch.compile`` (served
        compiled, checked against the eager model's no-cache forward).
    histories : sequence of Behaviors
        One per request; each needs at least 3 history tokens (a prefix, newer tokens, and more).
    candidates : LongTensor [C] or sequence of them
        The candidates of every request, or of each.
    request_times : sequence of int or None, optional
    atol : float
        Largest allowed absolute score difference (fp32: 1e-4).
    attention_backend : {"torch", "triton", "auto"}
    page_size : int
        Small pages put prefix boundaries inside pages (default 4).
    paths : sequence of {"miss", "hit", "batch", "extend", "dram"}
    kv_dtype : {"model", "int8", "fp8_e4m3"}
        The engines' cache format (:class:`~relaygr_engine.config.KVDtype`).

    Returns
    -------
    dict
        The largest absolute difference seen on each path.

    Raises
    ------
    RelayMismatch
        A score differs by more than ``atol``; the message names the path, the request and the first layer
        whose output differs.
    ValueError
        Bad arguments.
    """
    histories = list(histories)
    if not histories or not all(isinstance(h, Behaviors) for h in histories):
        raise ValueError("histories must be a non-empty sequence of Behaviors")
    cands = [candidates] * len(histories) if isinstance(candidates, torch.Tensor) else list(candidates)
    if len(cands) != len(histories):
        raise ValueError(f"candidates must be one tensor or one per history ({len(histories)}), got {len(cands)}")
    times = [None] * len(histories) if request_times is None else list(request_times)
    if len(times) != len(histories):
        raise ValueError(f"request_times must have one entry per history ({len(histories)}), got {len(times)}")
    for i, h in enumerate(histories):
        if h.num_tokens < 3:
            raise ValueError(f"histories[{i}] must have at least 3 tokens, got {h.num_tokens}")
    kd = parse_choice(KVDtype, kv_dtype, "kv_dtype")
    if kd.quantized and atol == 1e-4:
        raise ValueError(f"kv_dtype={kd.value!r} is not exact (cached rows are read dequantised): pass the atol you "
                         "accept, e.g. from relaygr bench kvquant")
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"paths must be among {PATHS}, got {sorted(unknown)}")
    dev = next((t.device for t in model.parameters()), torch.device("cpu"))
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)
    tokens = sum(h.num_tokens for h in histories)
    pages = 4 * (tokens // page_size + 2 * len(histories)) + 16

    def engine(dram: bool = False) -> RelayEngine:
        cfg = CacheConfig(device=str(dev), dtype=dtype, page_size=page_size, num_pages=pages,
                          max_pinned_fraction=1.0, lease_ttl_s=3600.0, attention_backend=attention_backend,
                          dram_bytes=(1 << 30) if dram else 0, kv_dtype=kd)
        return RelayEngine(model, cfg, extend_on_rank=True)

    eager = getattr(model, "_orig_mod", model)  # a torch.compile'd model is checked against its eager forward
    tap = _LayerTap(eager) if eager is model else None  # hooks would enter a compiled graph: name no layer there
    report: dict[str, float] = {}
    try:
        want, dense_runs = [], []
        for h, c, t in zip(histories, cands, times):
            want.append(no_cache_scores(eager, h, c, t))
            if tap is not None:
                dense_runs.append(tap.runs[-1])

        def check(path: str, i: int, result, expect_source: Optional[str]) -> None:
            diff = float((result.scores.float() - want[i].float()).abs().max())
            report[path] = max(report.get(path, 0.0), diff)
            if expect_source is not None and result.source != expect_source:
                raise RelayMismatch(f"path {path!r}, request {i}: expected the engine to serve from "
                                    f"{expect_source!r}, got {result.source!r}")
            if diff > atol:
                layer = "not named for a compiled model (check the eager model to name it)"
                if tap is not None:
                    layer = _first_layer(tap, tap.runs[-1], _user_in(tap.runs[-1][0], i, path), dense_runs[i], atol)
                raise RelayMismatch(f"relay path {path!r} differs from the no-cache forward for request {i}: max "
                                    f"abs difference {diff:.3g} > atol {atol:g}; first differing layer: {layer}")

        cut = [max(1, h.num_tokens // 2) for h in histories]
        if "miss" in paths:
            e = engine()
            for i, (h, c, t) in enumerate(zip(histories, cands, times)):
                check("miss", i, e.rank_with_prefix(i, h, c, request_time=t), "recompute")
        if "hit" in paths:
            e = engine()
            for i, (h, c, t) in enumerate(zip(histories, cands, times)):
                ticket = e.prefill_prefix(i, _prefix(h, cut[i]))
                check("hit", i, e.rank_with_prefix(i, h, c, ticket=ticket, request_time=t), "hbm")
        if "batch" in paths:
            e = engine()
            e.prefill_prefix_batch([(i, _prefix(h, cut[i])) for i, h in enumerate(histories) if i % 2 == 0])
            res = e.rank_with_prefix_batch([RankRequest(i, h, c, request_time=t)
                                            for i, (h, c, t) in enumerate(zip(histories, cands, times))])
            for i, r in enumerate(res):
                check("batch", i, r, None)
        if "extend" in paths:
            e = engine()
            for i, (h, c, t) in enumerate(zip(histories, cands, times)):
                mid = max(cut[i] + 1, h.num_tokens - 1)
                ticket = e.prefill_prefix(i, _prefix(h, cut[i]))
                e.rank_with_prefix(i, _prefix(h, mid), c, ticket=ticket)  # extends the entry to `mid` tokens
                res = e.rank_with_prefix(i, h, c, request_time=t)
                check("extend", i, res, "hbm")
                if res.cached_tokens != mid:
                    raise RelayMismatch(f"path 'extend', request {i}: expected {mid} cached tokens after the "
                                        f"extension, got {res.cached_tokens}")
        if "dram" in paths:
            for i, h in enumerate(histories):  # pre-infer, rank (the entry is spilled), free the device copy
                e = engine(dram=True)  # a fresh cost model prefers reloading until it has measured both
                ticket = e.prefill_prefix(i, _prefix(h, cut[i]))
                e.rank_with_prefix(i, _prefix(h, cut[i]), cands[i], ticket=ticket)
                for fp, _ in e.pool.entries_of(i):  # leave only the DRAM copy
                    e.pool.free(i, fp)
                check("dram", i, e.rank_with_prefix(i, h, cands[i], request_time=times[i]), "dram")
    finally:
        if tap is not None:
            tap.close()
    return report


def _prefix(h: Behaviors, n_tokens: int) -> Behaviors:
    """The history's first ``n_tokens`` tokens (contextual tokens count; at least one behavior is kept)."""
    return h.prefix(max(1, min(len(h), n_tokens - h.num_context_tokens)))


def _user_in(batch: RelayBatch, i: int, path: str) -> int:
    """Segment of request ``i`` in the last forward (batches hold every request; single rankings one)."""
    return i if path == "batch" and batch.num_users > i else 0
