"""The rows a batch's parts make (:class:`~relaygr_engine.batch.RelayBatch`'s layout: each user's history tokens
from its cached prefix on, then its candidates), gathered or written straight into arrays, and their row tables.

Shared by :meth:`RelayBatch.from_requests <relaygr_engine.batch.RelayBatch.from_requests>` and the engine's CUDA-graph
runner (:mod:`relaygr_engine.engine.graphs`), which writes a batch's rows into its staging buffer.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ._host import ship
from .behaviors import Behaviors

__all__ = ["FEW_SEGMENTS", "RequestRows", "build_device", "gather_rows", "request_time_of", "structure_arrays",
           "write_host_rows"]

_INT64_MAX = (1 << 63) - 1


def request_time_of(history: Behaviors, request_time) -> Optional[int]:
    """The candidates' timestamp of a request: ``request_time``, or the last behavior's; None without timestamps.

    Raises
    ------
    ValueError
        ``request_time`` not an integer in ``[0, 2**63)``, or given for a history without timestamps.
    """
    if request_time is None:
        if history.timestamps is None:
            return None
        return int(history.arrays()[2][-1] if history.device.type == "cpu" else history.timestamps[-1])
    if isinstance(request_time, bool):
        raise ValueError(f"request_time must be an integer time in seconds, got {request_time!r}")
    try:
        t = operator.index(request_time.item() if isinstance(request_time, torch.Tensor) else request_time)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"request_time must be an integer time in seconds, got {request_time!r}") from None
    if not 0 <= t <= _INT64_MAX:
        raise ValueError(f"request_time must be an integer time in seconds in [0, 2**63), got {t}")
    if history.timestamps is None:
        raise ValueError("request_time applies to a history with timestamps; got a history without them")
    return t


def _cat(xs: list) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def _join(xs: list) -> torch.Tensor:
    """Host arrays joined into one CPU tensor (at most one numpy copy, no tensor op)."""
    return torch.from_numpy(xs[0] if len(xs) == 1 else np.concatenate(xs))


def write_host_rows(parts: Sequence[tuple], items: np.ndarray, actions: Optional[np.ndarray],
                    times: Optional[np.ndarray]) -> int:
    """Write the rows of host ``parts`` (as :class:`~relaygr_engine.batch.RelayBatch` lays them out: a part's
    history tokens from ``start``, contextual then behaviors, then its candidates; zero actions and the first
    behavior's time on contextual rows, the request time on candidates) into the first rows of ``items`` (and of
    ``actions``/``times`` where given), slice by slice (no pieces, no joins); returns the rows written. A part's
    ``request_time`` is the resolved one (:func:`request_time_of`), its history and candidates host tensors."""
    r = 0
    for h, start, c, t_c in parts:
        ids, acts, ts, ctx = h.arrays()
        U = 0 if ctx is None else len(ctx)
        b0, n_ctx = max(0, start - U), max(0, U - start)
        e1 = r + n_ctx
        e2 = e1 + len(ids) - b0
        e3 = e2 + (0 if c is None else c.numel())
        if n_ctx:
            items[r:e1] = ctx[start:]
        items[e1:e2] = ids[b0:]
        if e3 > e2:
            items[e2:e3] = c.numpy()
        if actions is not None:
            actions[r:e1] = 0
            actions[e1:e2] = acts[b0:]
            actions[e2:e3] = 0
        if times is not None:
            times[r:e1] = ts[0]
            times[e1:e2] = ts[b0:]
            times[e2:e3] = 0 if t_c is None else t_c
        r = e3
    return r


def _device_rows(h: Behaviors, start: int, c, t_c, dev: torch.device, items: list, actions: list,
                 times: list) -> None:
    """:func:`write_host_rows`' rows for a batch built on ``dev``, as pieces: host pieces moved there (non-blocking),
    tensor rows (the caller joins them)."""
    if h.device != dev:
        h = Behaviors(*ship([h.item_ids, h.action_ids, h.timestamps, h.context_ids], dev))
    if c is not None and c.device != dev:
        c = ship([c], dev)[0]
    U = h.num_context_tokens
    b0, n_ctx, C = max(0, start - U), max(0, U - start), 0 if c is None else c.numel()
    items += [h.context_ids[start:], h.item_ids[b0:]] if n_ctx else [h.item_ids[b0:]]
    if C:
        items.append(c)
    if h.action_ids is not None:
        if n_ctx:
            actions.append(h.action_ids.new_zeros(n_ctx))
        actions.append(h.action_ids[b0:])
        if C:
            actions.append(h.action_ids.new_zeros(C))
    if h.timestamps is not None:
        ts = h.timestamps
        if n_ctx:
            times.append(ts[:1].expand(n_ctx))
        times.append(ts[b0:])
        if C:
            times.append(ts.new_full((C,), t_c))


# Up to this many segments structure_arrays writes each segment's rows by slices (a few numpy calls per segment);
# past it, whole-batch arrays (and one copy each into ``out``): fewer calls for many segments. Equal results, tested.
FEW_SEGMENTS = 6
_ROWS = np.arange(1 << 16, dtype=np.int64)  # row numbers to slice from (grown on demand)


def structure_arrays(starts, rows, ncand, nctx, tokens, out: Optional[dict] = None) -> dict[str, np.ndarray]:
    """The row tables of segments of ``rows`` rows each (the last ``ncand`` candidates, the first ``nctx``
    contextual, starting at history token ``starts``), as numpy arrays: ``is_candidate``, ``is_context``,
    ``is_behavior``, ``segment_ids``, ``candidate_rows``, ``cu_seqlens``, ``num_candidates`` and, unless ``tokens``
    (each segment's history length ``T``) is None, ``positions``. ``out``: arrays of those names and sizes to write
    them into (returned)."""
    B = len(rows)
    if B <= FEW_SEGMENTS:
        if out is None:
            R, C = sum(rows), sum(ncand)
            out = dict(is_candidate=np.empty(R, np.bool_), is_context=np.empty(R, np.bool_),
                       is_behavior=np.empty(R, np.bool_), segment_ids=np.empty(R, np.int64),
                       candidate_rows=np.empty(C, np.int64), cu_seqlens=np.empty(B + 1, np.int32),
                       num_candidates=np.empty(B, np.int32))
            if tokens is not None:
                out["positions"] = np.empty(R, np.int64)
        return _write_segments(out, starts, rows, ncand, nctx, tokens)
    host = _whole_batch(starts, rows, ncand, nctx, tokens)
    if out is None:
        return host
    for name, a in host.items():
        out[name][...] = a
    return out


def _whole_batch(starts, rows, ncand, nctx, tokens) -> dict[str, np.ndarray]:
    """:func:`structure_arrays` as whole-batch arrays (a fixed number of numpy calls, whatever the segments)."""
    B = len(rows)
    m, C, U, P = np.array([rows, ncand, nctx, starts], np.int64).reshape(4, B)       # one copy
    R = int(m.sum())
    seg = np.repeat(np.arange(B, dtype=np.int64), m)
    ends = np.cumsum(m)
    local = np.arange(R, dtype=np.int64) - (ends - m)[seg]               # row index within its segment
    is_cand = local >= (m - C)[seg]
    is_ctx = local < U[seg]
    host = dict(is_candidate=is_cand, is_context=is_ctx, is_behavior=~(is_cand | is_ctx), segment_ids=seg,
                candidate_rows=np.flatnonzero(is_cand).astype(np.int64),
                cu_seqlens=np.concatenate([[0], ends]).astype(np.int32), num_candidates=C.astype(np.int32))
    if tokens is not None:
        T = np.asarray(tokens, np.int64).reshape(B)
        host["positions"] = np.minimum(P[seg] + local, T[seg])           # candidates all at T
    return host


def _write_segments(out: dict, starts, rows, ncand, nctx, tokens) -> dict:
    """:func:`structure_arrays` into ``out``, segment by segment."""
    global _ROWS
    cand, ctx, beh, seg = out["is_candidate"], out["is_context"], out["is_behavior"], out["segment_ids"]
    cand_rows, cu, pos = out["candidate_rows"], out["cu_seqlens"], out["positions"] if tokens is not None else None
    most = max(sum(rows), max(starts) + max(rows)) if rows else 0
    if most > len(_ROWS):
        _ROWS = np.arange(1 << most.bit_length(), dtype=np.int64)
    r = k = 0
    cu[0] = 0
    for b in range(len(rows)):
        m, C, U = rows[b], ncand[b], nctx[b]
        h = m - C  # its history rows (contextual first), then its candidates
        cand[r:r + h], cand[r + h:r + m] = False, True
        ctx[r:r + U], ctx[r + U:r + m] = True, False
        beh[r:r + U], beh[r + U:r + h], beh[r + h:r + m] = False, True, False
        seg[r:r + m] = b
        cand_rows[k:k + C] = _ROWS[r + h:r + m]
        if pos is not None:
            np.minimum(_ROWS[starts[b]:starts[b] + m], tokens[b], out=pos[r:r + m])  # candidates all at T
        r, k = r + m, k + C
        cu[b + 1] = r
    out["num_candidates"][...] = ncand
    return out


def _structure(starts, rows, ncand, nctx, tokens, dev: torch.device) -> dict:
    """:func:`structure_arrays` moved to ``dev`` in one copy, with the batch's host layout."""
    host = structure_arrays(starts, rows, ncand, nctx, tokens)
    names = list(host)
    moved = ship([torch.from_numpy(host[n]) for n in names], dev)
    out = dict(zip(names, moved))
    out.update(start=tuple(map(int, starts)), rows=tuple(map(int, rows)), candidates_per_user=tuple(map(int, ncand)),
               has_prefix=any(starts))
    return out


@dataclass(frozen=True, eq=False)
class RequestRows:
    """The rows of ``(history, start, candidates, request_time)`` parts, one per user, not yet joined
    (:func:`gather_rows`): each user's pieces and segment sizes.

    Attributes
    ----------
    items, actions, times : lists of pieces
        The row fields' pieces in row order (numpy arrays built on the host, tensors on a device); ``actions`` and
        ``times`` None when the histories have no action ids or timestamps.
    starts, rows, candidates, context, tokens : tuples of int, one per user
        Cached history tokens, rows, candidate rows, contextual rows, history length ``T``.
    device : torch.device
        Where the pieces are.
    """

    items: list
    actions: Optional[list]
    times: Optional[list]
    starts: tuple
    rows: tuple
    candidates: tuple
    context: tuple
    tokens: tuple
    device: torch.device

    @property
    def num_rows(self) -> int:
        return sum(self.rows)

    @property
    def num_candidate_rows(self) -> int:
        return sum(self.candidates)


def build_device(parts: Sequence[tuple], target: torch.device) -> torch.device:
    """Where a batch of ``parts`` is built: the host when every part is there (then moved in one copy), else
    ``target``."""
    host = all(p[0].device.type == "cpu" and (p[2] is None or p[2].device.type == "cpu")
               for p in parts if isinstance(p[0], Behaviors) and isinstance(p[2], (torch.Tensor, type(None))))
    return torch.device("cpu") if host else target


def gather_rows(parts: Sequence[tuple], dev: torch.device) -> RequestRows:
    """The checked rows of ``parts`` (``(history, start, candidates, request_time)``, at least one) on ``dev``.

    Raises
    ------
    ValueError
        A part whose history is not a :class:`Behaviors`, has timestamps or action ids unlike the first, whose
        ``start`` is not in ``[0, T]``, or whose candidates are not a 1-D int64 tensor on ``dev`` or the host.
    """
    h0 = parts[0][0]
    timed, acted = h0.timestamps is not None, h0.action_ids is not None
    items, actions, times, host = [], [], [], []
    starts, rows, ncand, nctx, tokens = [], [], [], [], []
    for i, (h, start, c, t_req) in enumerate(parts):
        if not isinstance(h, Behaviors):
            raise ValueError(f"parts[{i}] history must be a Behaviors, got {type(h).__name__}")
        if (h.timestamps is not None) != timed or (h.action_ids is not None) != acted:
            raise ValueError(f"parts[{i}] must have timestamps and action ids like parts[0] "
                             f"(timestamps={timed}, action_ids={acted})")
        U, T = h.num_context_tokens, h.num_tokens
        if not (isinstance(start, int) and 0 <= start <= T):
            raise ValueError(f"parts[{i}] start must be an integer in [0, {T}], got {start!r}")
        if c is not None and (not isinstance(c, torch.Tensor) or c.dim() != 1 or c.dtype != torch.long
                              or not _on(c, dev)):
            got = f"{tuple(c.shape)} {c.dtype} on {c.device}" if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(f"parts[{i}] candidates must be a 1-D int64 tensor on {dev} or the cpu, got {got}")
        C = 0 if c is None else c.numel()
        t_c = request_time_of(h, t_req) if timed and C else None  # before a move: read on the host
        if dev.type == "cpu":
            host.append((h, start, c, t_c))
        else:
            _device_rows(h, start, c, t_c, dev, items, actions, times)
        starts.append(start)
        rows.append(T - start + C)
        ncand.append(C)
        nctx.append(max(0, U - start))
        tokens.append(T)
    if dev.type == "cpu":  # the rows straight into one array per field
        R = sum(rows)
        items = [np.empty(R, np.int64)]
        actions, times = ([np.empty(R, np.int64)] if on else None for on in (acted, timed))
        write_host_rows(host, items[0], actions and actions[0], times and times[0])
    return RequestRows(items, actions if acted else None, times if timed else None, tuple(starts), tuple(rows),
                       tuple(ncand), tuple(nctx), tuple(tokens), dev)


def _on(x: torch.Tensor, device: torch.device) -> bool:
    """Whether ``x`` may feed a model on ``device``: on that device, or on the host (moved in the batch)."""
    return x.device == device or x.device.type == "cpu"
