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
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import numpy as np
import torch

from ._host import ship
from .behaviors import Behaviors
from .rows import RequestRows, _cat, _join, _on, _structure, build_device, gather_rows, request_time_of

__all__ = ["RelayBatch", "check_request", "request_time_of"]

_TENSOR_FIELDS = ("item_ids", "action_ids", "timestamps", "positions", "is_candidate", "is_context", "is_behavior",
                  "segment_ids", "candidate_rows", "cu_seqlens", "num_candidates")


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
