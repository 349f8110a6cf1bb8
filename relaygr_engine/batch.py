"""``RelayBatch``: the rows a ranker's forward receives, many users flattened, no padding.

Token layout of one request (user): its contextual tokens (``Behaviors.context_ids``), then its behaviors, then its
candidates. History token ``t`` (contextual or behavior) sits at position ``t``; every candidate sits at position
``T`` (the history length). A batch holds, per user, only the rows computed *now*: the history tokens after the
user's cached prefix (``start .. T-1``), then its candidates. A no-cache batch (:meth:`RelayBatch.full`) starts at 0.

Timestamps: a behavior's row carries its own timestamp, a contextual token the first behavior's, and a candidate
the request time (``request_time``, default the last behavior's timestamp).
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import numpy as np
import torch

from ._host import ship
from .behaviors import Behaviors

__all__ = ["RelayBatch", "check_request", "request_time_of"]

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


_TENSOR_FIELDS = ("item_ids", "action_ids", "timestamps", "positions", "is_candidate", "is_context", "is_behavior",
                  "segment_ids", "candidate_rows", "cu_seqlens", "num_candidates")


def _cat(xs: list) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def _join(xs: list) -> torch.Tensor:
    """Host arrays joined into one CPU tensor (one numpy copy, no tensor op)."""
    return torch.from_numpy(np.concatenate(xs))


def _host_rows(h: Behaviors, start: int, c, t_c, items: list, actions: list, times: list) -> None:
    """Append a host part's rows as numpy views: its history tokens from ``start`` (contextual, then behaviors), then
    its candidates; zero actions and the first behavior's time on contextual rows, ``t_c`` on candidates."""
    U = h.num_context_tokens
    b0, n_ctx, C = max(0, start - U), max(0, U - start), 0 if c is None else c.numel()
    ids, acts, ts, ctx = h.arrays()
    if n_ctx:
        items.append(ctx[start:])
    items.append(ids[b0:])
    if C:
        items.append(c.numpy())
    if acts is not None:
        actions += [np.zeros(n_ctx, np.int64), acts[b0:], np.zeros(C, np.int64)]
    if ts is not None:
        times += [np.full(n_ctx, ts[0], np.int64), ts[b0:], np.full(C, 0 if t_c is None else t_c, np.int64)]


def _device_rows(h: Behaviors, start: int, c, t_c, dev: torch.device, items: list, actions: list,
                 times: list) -> None:
    """:func:`_host_rows` for a batch built on ``dev``: host pieces moved there (non-blocking), tensor rows."""
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


# Up to this many segments structure_arrays(out=...) writes each segment's rows by slices (a few numpy calls per
# segment); past it, whole-batch arrays and one copy each (fewer calls for many segments). Equal results, tested.
FEW_SEGMENTS = 6
_ROWS = np.arange(1 << 16, dtype=np.int64)  # row numbers to slice from (grown on demand)


def structure_arrays(starts, rows, ncand, nctx, tokens, out: Optional[dict] = None) -> dict[str, np.ndarray]:
    """The row tables of segments of ``rows`` rows each (the last ``ncand`` candidates, the first ``nctx``
    contextual, starting at history token ``starts``), as numpy arrays: ``is_candidate``, ``is_context``,
    ``is_behavior``, ``segment_ids``, ``candidate_rows``, ``cu_seqlens``, ``num_candidates`` and, unless ``tokens``
    (each segment's history length ``T``) is None, ``positions``. ``out``: arrays of those names and sizes to write
    them into (returned)."""
    B = len(rows)
    if out is not None and B <= FEW_SEGMENTS:
        return _write_segments(out, starts, rows, ncand, nctx, tokens)
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
    if out is None:
        return host
    for name, a in host.items():
        out[name][...] = a
    return out


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
    items, actions, times = [], [], []
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
            _host_rows(h, start, c, t_c, items, actions, times)
        else:
            _device_rows(h, start, c, t_c, dev, items, actions, times)
        starts.append(start)
        rows.append(T - start + C)
        ncand.append(C)
        nctx.append(max(0, U - start))
        tokens.append(T)
    return RequestRows(items, actions if acted else None, times if timed else None, tuple(starts), tuple(rows),
                       tuple(ncand), tuple(nctx), tuple(tokens), dev)


def _on(x: torch.Tensor, device: torch.device) -> bool:
    """Whether ``x`` may feed a model on ``device``: on that device, or on the host (moved in the batch)."""
    return x.device == device or x.device.type == "cpu"


def check_request(history: Behaviors, candidates: Optional[torch.Tensor], request_time,
                  device: torch.device) -> Optional[int]:
    """Check a request's structure for a model on ``device``; return the candidates' timestamp (None without
    timestamps).

    The history and the candidates may be on ``device`` or on the host (the CPU): a batch moves host rows to the
    model's device in one copy. Host inputs are checked without any device work, so on an accelerator they keep the
    ranking free of device-to-host synchronisation; inputs already on the accelerator cost a read-back to check.

    Raises
    ------
    ValueError
        Not a :class:`Behaviors`; on another device; empty history; a negative timestamp; candidates (when given)
        not a non-empty 1-D int64 tensor on ``device`` or the host; ``request_time`` not an integer in
        ``[0, 2**63)``, or given for a history without timestamps. Id ranges and lengths are the model's to check
        (``check_inputs``).

    Times are seconds in ``[0, 2**63)``, so every difference of two of them (the time bias's input) fits in int64.
    """
    if not isinstance(history, Behaviors):
        raise ValueError(f"history must be a Behaviors, got {type(history).__name__}")
    if not _on(history.item_ids, device):
        raise ValueError(f"history must be on {device} (the model's device) or the cpu, got {history.device}")
    if len(history) == 0:
        raise ValueError("history must hold at least one behavior, got 0")
    if history.timestamps is not None:
        ts = history.arrays()[2] if history.device.type == "cpu" else history.timestamps.cpu().numpy()
        low = int(np.minimum.reduce(ts))  # on the host: no device op on CPU
        if low < 0:
            raise ValueError(f"history.timestamps must be times in seconds >= 0, got {low}")
    if candidates is not None:
        if not isinstance(candidates, torch.Tensor) or candidates.dim() != 1 or candidates.dtype != torch.long:
            got = (f"{tuple(candidates.shape)} {candidates.dtype}" if isinstance(candidates, torch.Tensor)
                   else type(candidates).__name__)
            raise ValueError(f"candidates must be a 1-D int64 tensor of item ids, got {got}")
        if not _on(candidates, device):
            raise ValueError(f"candidates must be on {device} (the model's device) or the cpu, got "
                             f"{candidates.device}")
        if candidates.numel() == 0:
            raise ValueError("candidates must hold at least one item id, got 0")
    return request_time_of(history, request_time)


@dataclass(frozen=True, eq=False)
class RelayBatch:
    """Rows of many users, flattened: each user's new history rows, then its candidates.

    Build one with :meth:`full` (one whole request, no cache: training and the oracle) or :meth:`from_requests`;
    the engine builds them for relay forwards. ``R`` rows, ``B`` users; every tensor is on one device.

    A compiled model (``torch.compile(model, fullgraph=True, dynamic=True)``) should read only the tensors and the
    None-ness of the optional ones: they are prepared before the forward, so one graph serves batches of any
    lengths. The host tuples (``start``, ``rows``, ``candidates_per_user``) and ``num_candidate_rows`` are Python
    values: a compiled model that reads them is specialised on them (a recompile per new value) and cannot be
    replayed by a CUDA graph.

    Attributes
    ----------
    item_ids : LongTensor [R]
        Item id of a behavior or candidate row; the context id of a contextual-token row.
    action_ids : LongTensor [R] or None
        Action of a behavior row (0 on other rows); None when the histories have no action ids.
    timestamps : LongTensor [R] or None
        Row timestamps (see the module docstring); None when the histories have no timestamps.
    positions : LongTensor [R]
        History token ``t`` at position ``t``; candidates at ``T``.
    is_candidate, is_context, is_behavior : BoolTensor [R]
        Candidate rows; contextual user-feature rows (``Behaviors.context_ids``); behavior rows (neither).
    segment_ids : LongTensor [R]
        The user (segment ``b`` in ``0..B-1``) of each row.
    candidate_rows : LongTensor [number of candidate rows]
        Row indices of the candidates, in batch order (``x[batch.candidate_rows]`` selects what to score).
    cu_seqlens : IntTensor [B+1]
        Row offsets of each user's segment (int32).
    num_candidates : IntTensor [B]
        The last ``num_candidates[b]`` rows of segment ``b`` are candidates (int32).
    start : tuple of int, length B
        Cached history tokens of each user (the position of its first row); 0 in a no-cache batch.
    rows, candidates_per_user : tuple of int, length B
        Host copies of the segment lengths and of ``num_candidates`` (no device read needed).
    has_prefix : bool
        Some user starts after a cached prefix (``any(start)``): such a batch runs only in a relay forward.
    """

    item_ids: torch.Tensor
    action_ids: Optional[torch.Tensor]
    timestamps: Optional[torch.Tensor]
    positions: torch.Tensor
    is_candidate: torch.Tensor
    is_context: torch.Tensor
    cu_seqlens: torch.Tensor
    num_candidates: torch.Tensor
    start: tuple
    rows: tuple
    candidates_per_user: tuple
    is_behavior: torch.Tensor = None
    segment_ids: torch.Tensor = None
    candidate_rows: torch.Tensor = None
    has_prefix: bool = False

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def full(cls, history: Behaviors, candidates: torch.Tensor, request_time: Optional[int] = None,
             device: Optional[torch.device] = None) -> "RelayBatch":
        """The no-cache batch of one whole request: every history token, then the candidates.

        Parameters
        ----------
        history : Behaviors
        candidates : LongTensor [C]
        request_time : int, optional
            The candidates' timestamp (default: the last behavior's).
        device : torch.device, optional
            Where the batch goes (default: the history's device); see :meth:`from_requests`.
        """
        return cls.from_requests([(history, 0, candidates, request_time)], device=device)

    @classmethod
    def from_requests(cls, parts: Sequence[tuple], device: Optional[torch.device] = None) -> "RelayBatch":
        """A batch of ``(history, start, candidates, request_time)`` parts, one per user, in order.

        ``start`` history tokens of a part are cached (not in the batch); ``candidates`` may be None (a prefill).
        Structure is checked; ids are not (that is the model's business).

        ``device`` (default: the first history's device) is where the batch goes. Parts may be on it or on the
        host: when every part is on the host the rows are built there and moved in one pinned, non-blocking copy
        (no device work, no synchronisation), else host pieces are moved to ``device`` as they are used.
        """
        if not parts:
            raise ValueError("parts must hold at least one (history, start, candidates, request_time) part, got 0")
        h0 = parts[0][0]
        if not isinstance(h0, Behaviors):
            raise ValueError(f"parts[0] history must be a Behaviors, got {type(h0).__name__}")
        target = h0.device if device is None else torch.device(device)
        batch = cls._build(gather_rows(parts, build_device(parts, target)))
        return batch if batch.device == target else batch._moved(target)

    def _moved(self, device: torch.device) -> "RelayBatch":
        """This host batch on ``device``, in one copy."""
        names = _TENSOR_FIELDS
        moved = ship([getattr(self, n) for n in names], device)
        return dataclasses.replace(self, **dict(zip(names, moved)))

    @classmethod
    def _build(cls, r: RequestRows) -> "RelayBatch":
        join = _join if r.device.type == "cpu" else _cat
        return cls(item_ids=join(r.items), action_ids=None if r.actions is None else join(r.actions),
                   timestamps=None if r.times is None else join(r.times),
                   **_structure(r.starts, r.rows, r.candidates, r.context, r.tokens, r.device))

    def __post_init__(self) -> None:
        if self.candidate_rows is None:  # built field by field: derive the row tables from the host layout
            n_ctx = [int(x) for x in torch.segment_reduce(self.is_context.long().cpu(), "sum",
                                                          lengths=torch.tensor(self.rows))] if self.rows else []
            tables = _structure(self.start, self.rows, self.candidates_per_user, n_ctx, None, self.device)
            for name in ("is_behavior", "segment_ids", "candidate_rows", "has_prefix"):
                object.__setattr__(self, name, tables[name])

    # ------------------------------------------------------------------------------------------ views
    def __len__(self) -> int:
        return self.item_ids.numel()

    def __repr__(self) -> str:
        return (f"RelayBatch(users={self.num_users}, rows={len(self)}, candidates={self.num_candidate_rows}, "
                f"timestamps={self.timestamps is not None}, device={self.device})")

    @property
    def device(self) -> torch.device:
        return self.item_ids.device

    @property
    def num_users(self) -> int:
        return len(self.rows)

    @cached_property
    def num_candidate_rows(self) -> int:
        return sum(self.candidates_per_user)
