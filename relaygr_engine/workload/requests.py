"""The served request stream of a ranking workload: how a log becomes one (:class:`WorkloadConfig`), its
requests (:class:`Request`) and the stream with its arrivals at a QPS (:class:`Workload`). Built by
:func:`relaygr_engine.workload.build.build_workload`; the names are re-exported there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..stats import percentile


@dataclass(frozen=True)
class WorkloadConfig:
    """How a log becomes a ranking request stream (see the :mod:`relaygr_engine.workload.build` module doc for each
    rule).

    Parameters
    ----------
    num_items, num_actions : int
        The model's vocabulary sizes; item and action ids are mapped into them.
    num_requests : int
        Requests in the measured window.
    warmup_requests : int
        Requests served before the measured window (the log's preceding events), not measured.
    num_candidates : int
        Candidates per ranking request: the event's own item plus popularity-sampled others.
    length_scale : float
        Tokens per real behavior (> 0).
    base_length : int, optional
        Each user's first served request carries exactly this many tokens (max-length experiment).
    max_history : int
        Hard cap on history tokens (oldest dropped).
    trim_tokens : int
        The oldest tokens beyond the cap are dropped in blocks of this many (counted from the user's first token),
        so a capped history holds ``max_history - trim_tokens + 1 .. max_history`` tokens and consecutive
        requests of a user share their prefix until the next block boundary (1: drop exactly the excess, the
        window slides with every new behavior).
    suffix_tokens : int
        Newest history tokens left out of the pre-inferred prefix (the short-term behaviors computed at ranking).
    min_history : int
        Events whose user has fewer earlier real behaviors are not served.
    pipeline_delay_s : float
        Retrieval-to-ranking delay: the pre-infer signal arrives this long before its ranking request.
    gap_cap_s, gap_floor_s : float
        Saturation and floor of the per-user gap compression.
    seed : int
    """

    num_items: int
    num_actions: int
    num_requests: int = 400
    warmup_requests: int = 0
    num_candidates: int = 64
    length_scale: float = 1.0
    base_length: Optional[int] = None
    max_history: int = 4096
    trim_tokens: int = 1
    suffix_tokens: int = 16
    min_history: int = 1
    pipeline_delay_s: float = 0.05
    gap_cap_s: float = 1800.0
    gap_floor_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_items", "num_actions", "num_requests", "num_candidates", "max_history", "min_history",
                     "trim_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.warmup_requests, int) or isinstance(self.warmup_requests, bool) \
                or self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be an integer >= 0, got {self.warmup_requests!r}")
        if not isinstance(self.suffix_tokens, int) or self.suffix_tokens < 0:
            raise ValueError(f"suffix_tokens must be an integer >= 0, got {self.suffix_tokens!r}")
        if not (isinstance(self.length_scale, (int, float)) and math.isfinite(self.length_scale)
                and self.length_scale > 0):
            raise ValueError(f"length_scale must be a finite number > 0, got {self.length_scale!r}")
        if self.base_length is not None and (not isinstance(self.base_length, int) or self.base_length < 1):
            raise ValueError(f"base_length must be None or an integer >= 1, got {self.base_length!r}")
        if self.base_length is not None and self.base_length > self.max_history:
            raise ValueError(f"base_length must be <= max_history={self.max_history}, got {self.base_length}")
        if not (isinstance(self.pipeline_delay_s, (int, float)) and self.pipeline_delay_s >= 0):
            raise ValueError(f"pipeline_delay_s must be >= 0, got {self.pipeline_delay_s!r}")
        if not (isinstance(self.gap_cap_s, (int, float)) and self.gap_cap_s > 0):
            raise ValueError(f"gap_cap_s must be > 0, got {self.gap_cap_s!r}")
        if not (isinstance(self.gap_floor_s, (int, float)) and self.gap_floor_s >= 0):
            raise ValueError(f"gap_floor_s must be >= 0, got {self.gap_floor_s!r}")
        if self.num_candidates > self.num_items:
            raise ValueError(f"num_candidates must be <= num_items={self.num_items}, got {self.num_candidates}")


@dataclass(frozen=True, eq=False)
class Request:
    """One ranking request and its pre-infer signal.

    Attributes
    ----------
    index : int
        Position in arrival order.
    user_id : int
    item_ids, action_ids, timestamps : int64 ``[L]``
        The history, oldest first (views into the user's token sequence).
    prefix_len : int
        Leading history tokens the pre-infer caches (``L - suffix_tokens``, at least 0).
    candidates : int64 ``[C]``
        Candidate item ids (index 0 is the item the user actually interacted with).
    request_ts : int
        The event's own timestamp (seconds; the candidates' time).
    offset_s : float
        Compressed time since the window's first request (see :meth:`Workload.arrivals`).
    warmup : bool
        Served before the measured window, not measured.
    """

    index: int
    user_id: int
    item_ids: np.ndarray
    action_ids: np.ndarray
    timestamps: np.ndarray
    prefix_len: int
    candidates: np.ndarray
    request_ts: int
    offset_s: float
    warmup: bool = False

    @property
    def history_len(self) -> int:
        return int(self.item_ids.shape[0])


@dataclass
class Workload:
    """A served request stream in arrival order plus a description of how it was built."""

    requests: list[Request]
    config: WorkloadConfig
    info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def arrivals(self, qps: float) -> np.ndarray:
        """Arrival times (s, float64 ``[n]``, the first at 0) rescaled so the mean rate is ``qps``.

        ``arrival_i = offset_i * (n - 1) / (qps * offset_{n-1})``. A window whose compressed times are all equal
        falls back to even spacing ``i / qps``.
        """
        if not (isinstance(qps, (int, float)) and math.isfinite(qps) and qps > 0):
            raise ValueError(f"qps must be a finite number > 0, got {qps!r}")
        off = np.asarray([r.offset_s for r in self.requests], dtype=np.float64)
        n = off.shape[0]
        if n <= 1:
            return np.zeros(n)
        if off[-1] <= 0:
            return np.arange(n, dtype=np.float64) / qps
        return off * ((n - 1) / (qps * off[-1]))

    @property
    def num_warmup(self) -> int:
        """Warm-up requests (served first, not measured)."""
        return sum(1 for r in self.requests if r.warmup)

    @property
    def measured(self) -> list[Request]:
        """The measured requests (those after the warm-up), in arrival order."""
        return self.requests[self.num_warmup:]

    def history_lengths(self) -> np.ndarray:
        """History tokens of every request (warm-up included), in arrival order."""
        return np.asarray([r.history_len for r in self.requests], dtype=np.int64)

    def describe(self, qps: Optional[float] = None) -> dict:
        """Summary numbers of the measured requests: history length quantiles, users, same-user re-requests (and
        their gaps at ``qps``; a re-request may follow a warm-up request)."""
        W = self.num_warmup
        lens = self.history_lengths()[W:]
        users = np.asarray([r.user_id for r in self.requests])
        d = dict(self.info)
        d.update({
            "requests": len(self.requests) - W, "warmup_requests": W,
            "users": int(np.unique(users[W:]).shape[0]),
            "history_len_p50": percentile(lens, 50) if lens.size else 0.0,
            "history_len_p90": percentile(lens, 90) if lens.size else 0.0,
            "history_len_max": int(lens.max()) if lens.size else 0,
            "history_len_mean": float(lens.mean()) if lens.size else 0.0,
        })
        if qps is not None and len(self.requests) > 1:
            arr = self.arrivals(qps)
            last: dict[int, float] = {}
            gaps = []
            for i, (u, a) in enumerate(zip(users.tolist(), arr.tolist())):
                if u in last and i >= W:
                    gaps.append(a - last[u])
                last[u] = a
            d["rerequest_share"] = len(gaps) / max(1, len(self.requests) - W)
            d["rerequest_gap_p50_s"] = percentile(gaps, 50) if gaps else float("nan")
        return d
