"""Ranking workloads built from real interaction logs (or from a profile fitted to one).

Pipeline
--------
1. :func:`read_interactions` reads a CSV (``.csv`` or ``.csv.gz``) of ``user_id,item_id,timestamp[,action]``.
   Header names are matched case-insensitively against a few common aliases (MovieLens ``userId,movieId,rating,
   timestamp`` works as is); CRLF line endings are fine. Rows are sorted by (user, timestamp, file order).
2. :func:`build_workload` turns every interaction event into one ranking request of that user:
   the history is the user's earlier behaviors, the candidates are ``num_candidates`` item ids, and the arrival time
   comes from the time compression below. A pre-infer signal precedes each ranking request by
   ``pipeline_delay_s`` (the retrieval-to-ranking delay).
3. :meth:`Workload.arrivals` rescales the compressed times to a target QPS.

Item ids (:func:`remap_items`)
    Raw item ids are remapped into ``[0, num_items)`` by frequency rank: the most frequent raw id gets 0, the next 1,
    and so on (ties broken by the smaller raw id). When the log has more distinct items than fit, the
    ``num_items - B`` most frequent keep their own id and the rest are hashed (splitmix64 of the raw id) into the
    ``B = max(1, num_items // 16)`` overflow ids ``[num_items - B, num_items)``.

Actions
    An integer ``action`` column is clipped into ``[0, num_actions)``; a text one is mapped by frequency rank (then
    clipped). Without an action column a ``rating`` column stands in: ``action = floor(rating + 0.5)`` clipped into
    ``[0, num_actions)``. With neither, every action is 0.

Time compression (:func:`compress_times`)
    Real logs span years, and users rate in bursts (MovieLens: median same-user gap 11 s, tail of years). Each user's
    timeline is compressed on its own: ``c_0 = 0`` and ``c_k = c_{k-1} + g(t_k - t_{k-1})`` with the saturating map
    ``g(x) = floor + x * cap / (x + cap)`` (``cap = gap_cap_s``, 30 min, ``floor = gap_floor_s``, 1 s, by
    default). ``g`` is strictly increasing, so the order of a user's gaps is preserved exactly (equal gaps stay
    equal); short gaps are kept nearly as they are and long absences saturate at the cap. The floor separates a
    user's events logged in the same second (16% of MovieLens gaps are 0 s: a page of ratings submitted at once),
    which would otherwise arrive as simultaneous ranking requests at every QPS.
    Users are then aligned so that many of them are active at once, each at a random point of its life (as in
    production, where the active users are a sample of the population): user ``u`` gets a seeded random anchor
    event ``a_u`` (uniform over its events) and the offset ``o_u = U_u * cap - c_{a_u}`` with
    ``U_u ~ Uniform[0, 1)``, so its anchor lands at a uniform time in ``[0, cap)``. All events are ordered globally
    by ``s = o_u + c_k`` and the measured window is the ``num_requests`` consecutive eligible events centred on
    ``s = cap / 2``, preceded by ``warmup_requests`` more (the events just before it, served but not measured:
    a serving system runs continuously, so the measured requests meet caches and queues in their steady state
    rather than empty). (On MovieLens, 400 requests come from 183 users, median history 59 behaviors, and 54% of the
    requests follow an earlier one of the same user.)
    Finally :meth:`Workload.arrivals` rescales the window linearly so that its mean rate is the target QPS:
    ``arrival_i = (s_i - s_0) * (n - 1) / (qps * (s_{n-1} - s_0))``. The linear rescale keeps every ratio of a
    user's gaps, so the order of each user's re-request gaps is preserved at every QPS.

History length
    The real log's histories are short (MovieLens median 70) while the engine targets thousands of tokens.
    ``length_scale = S`` turns the user's real behavior ``j`` into ``floor(S*(j+1)) - floor(S*j)`` tokens: the
    behavior itself followed by synthetic companions (item = hash of (user, j, r), same action and timestamp), so a
    user's token sequence is the same for all its requests and every history is a prefix of the next one.
    ``base_length = L`` (the max-length experiment) gives each user's first served request exactly ``L`` tokens (the
    oldest dropped, or synthetic older behaviors prepended), and later requests of that user append to it: prefixes
    stay stable. ``max_history`` is a hard cap (oldest tokens dropped) that keeps histories within the model's
    ``max_seq_len``. The oldest tokens go in blocks of ``trim_tokens``: a production long-term sequence is
    truncated now and then, not shifted by one behavior per request, so a user's consecutive requests share
    their prefix (with ``trim_tokens = 1`` every new behavior of a capped user changes the whole prefix).

Synthetic logs (:func:`fit_profile`, :func:`synthesize_interactions`)
    The package ships a profile fitted to MovieLens ml-latest-small (empirical quantiles of events per user and of
    same-user gaps, the item popularity curve and the rating histogram) so the benchmark runs without the raw log.
    Regenerate it with ``python -m relaygr_engine.bench.workload fit ratings.csv.gz -o profile.json``.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import math
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .common import percentile

__all__ = [
    "InteractionLog", "WorkloadConfig", "Request", "Workload", "read_interactions", "remap_items", "action_ids",
    "compress_times", "build_workload", "fit_profile", "save_profile", "load_profile", "synthesize_interactions",
    "DEFAULT_PROFILE", "PROFILE_FORMAT", "main",
]

PROFILE_FORMAT = "relaygr-workload-profile/1"
DEFAULT_PROFILE = "movielens_small_profile.json"

# Header aliases (lower case) of each column.
_ALIASES = {
    "user": ("user_id", "userid", "user", "uid"),
    "item": ("item_id", "itemid", "item", "movie_id", "movieid", "iid"),
    "timestamp": ("timestamp", "time", "ts", "event_time", "unix_time"),
    "action": ("action", "action_id", "actionid", "event", "event_type", "behavior"),
    "rating": ("rating", "score"),
}


# ----------------------------------------------------------------------------------------------- reading logs
@dataclass(frozen=True)
class InteractionLog:
    """Interaction events sorted by (user, timestamp, file order); all arrays have shape ``[N]``.

    Attributes
    ----------
    user_ids, item_ids : int64
        Raw ids as in the source.
    timestamps : int64
        Seconds.
    action_values : float64 or None
        The action column (text actions already mapped to frequency ranks), or the rating, or None.
    action_kind : {"action", "rating", "none"}
    source : str
        Where the events came from (a path or ``"profile:<name>"``).
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    timestamps: np.ndarray
    action_values: Optional[np.ndarray]
    action_kind: str
    source: str

    def __len__(self) -> int:
        return int(self.user_ids.shape[0])

    @property
    def num_users(self) -> int:
        return int(np.unique(self.user_ids).shape[0])

    @property
    def num_distinct_items(self) -> int:
        return int(np.unique(self.item_ids).shape[0])

    def num_eligible(self, min_history: int = 1) -> int:
        """Events with at least ``min_history`` earlier events of the same user: the most requests (warm-up and
        measured) :func:`build_workload` can draw."""
        _, counts = np.unique(self.user_ids, return_counts=True)
        return int(np.maximum(counts - min_history, 0).sum())


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", newline="", encoding="utf-8")
    return open(path, "rt", newline="", encoding="utf-8")


def _find_column(header: list[str], kind: str) -> Optional[int]:
    names = [h.strip().lower() for h in header]
    for alias in _ALIASES[kind]:
        if alias in names:
            return names.index(alias)
    return None


def read_interactions(path) -> InteractionLog:
    """Read a ``.csv`` or ``.csv.gz`` interaction log (gzip is detected from the file's magic bytes).

    The first row is a header; the user, item and timestamp columns are required (aliases: see ``_ALIASES``), an
    ``action`` or ``rating`` column is optional. Extra columns are ignored.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If a required column is missing, a row is malformed, or the file has no events.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"interaction log not found: {path}")
    with _open_text(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise ValueError(f"{path} is empty; expected a header user_id,item_id,timestamp[,action]") from None
        cols = {kind: _find_column(header, kind) for kind in _ALIASES}
        missing = [k for k in ("user", "item", "timestamp") if cols[k] is None]
        if missing:
            raise ValueError(f"{path}: no {'/'.join(missing)} column in header {header}; accepted names: "
                             + "; ".join(f"{k}: {', '.join(_ALIASES[k])}" for k in missing))
        kind = "action" if cols["action"] is not None else ("rating" if cols["rating"] is not None else "none")
        ci, cj, ct = cols["user"], cols["item"], cols["timestamp"]
        ca = cols["action"] if kind == "action" else cols["rating"]
        users, items, times, acts = [], [], [], []
        for lineno, row in enumerate(reader, start=2):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            try:
                users.append(int(row[ci]))
                items.append(int(row[cj]))
                times.append(int(float(row[ct])))
                if ca is not None:
                    acts.append(row[ca].strip())
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}:{lineno}: cannot parse row {row!r} ({e})") from None
    if not users:
        raise ValueError(f"{path} has a header but no events")
    values = None
    if ca is not None:
        try:
            values = np.asarray([float(a) for a in acts], dtype=np.float64)
        except ValueError:
            if kind == "rating":
                raise ValueError(f"{path}: rating column must be numeric") from None
            names, inv, counts = np.unique(np.asarray(acts), return_inverse=True, return_counts=True)
            order = np.lexsort((names, -counts))           # most frequent text action -> 0
            rank = np.empty_like(order)
            rank[order] = np.arange(order.shape[0])
            values = rank[inv].astype(np.float64)
    return _sorted_log(np.asarray(users, np.int64), np.asarray(items, np.int64), np.asarray(times, np.int64),
                       values, kind, str(path))


def _sorted_log(users, items, times, values, kind, source) -> InteractionLog:
    order = np.lexsort((np.arange(users.shape[0]), times, users))   # user, then time, then file order
    return InteractionLog(users[order], items[order], times[order],
                          None if values is None else values[order], kind, source)


# ----------------------------------------------------------------------------------------------- id mapping
def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    z = np.asarray(x).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def remap_items(item_ids: np.ndarray, num_items: int) -> tuple[np.ndarray, dict]:
    """Map raw item ids into ``[0, num_items)`` by frequency rank, hashing the overflow (see the module doc).

    Returns
    -------
    mapped : int64 ``[N]``
    info : dict
        ``distinct``, ``kept`` (items with their own id), ``overflow_buckets``, ``overflow_event_share``.
    """
    if not isinstance(num_items, int) or num_items < 1:
        raise ValueError(f"num_items must be an integer >= 1, got {num_items!r}")
    raw = np.asarray(item_ids, dtype=np.int64)
    uniq, inv, counts = np.unique(raw, return_inverse=True, return_counts=True)
    order = np.lexsort((uniq, -counts))          # by count desc, then raw id asc
    rank = np.empty(uniq.shape[0], dtype=np.int64)
    rank[order] = np.arange(uniq.shape[0])
    if uniq.shape[0] <= num_items:
        buckets, kept = 0, uniq.shape[0]
        ids = rank
    else:
        buckets = max(1, num_items // 16)
        kept = num_items - buckets
        hashed = kept + (_mix64(uniq.astype(np.uint64)) % np.uint64(buckets)).astype(np.int64)
        ids = np.where(rank < kept, rank, hashed)
    mapped = ids[inv.reshape(-1)]
    share = float(np.mean(rank[inv.reshape(-1)] >= kept)) if raw.size else 0.0
    return mapped, {"distinct": int(uniq.shape[0]), "kept": int(kept), "overflow_buckets": int(buckets),
                    "overflow_event_share": share}


def action_ids(log: InteractionLog, num_actions: int) -> np.ndarray:
    """Action ids in ``[0, num_actions)`` of every event (see the module doc for the rule)."""
    if not isinstance(num_actions, int) or num_actions < 1:
        raise ValueError(f"num_actions must be an integer >= 1, got {num_actions!r}")
    if log.action_values is None:
        return np.zeros(len(log), dtype=np.int64)
    return np.clip(np.floor(log.action_values + 0.5), 0, num_actions - 1).astype(np.int64)


# ----------------------------------------------------------------------------------------------- time compression
def compress_times(user_ids: np.ndarray, timestamps: np.ndarray, gap_cap_s: float,
                   gap_floor_s: float = 0.0) -> np.ndarray:
    """Per-user compressed time of each event (events sorted by user then time), float64 ``[N]``.

    ``c = 0`` at a user's first event and ``c_k = c_{k-1} + g(t_k - t_{k-1})`` with
    ``g(x) = floor + x * cap / (x + cap)``.
    """
    if not (isinstance(gap_cap_s, (int, float)) and math.isfinite(gap_cap_s) and gap_cap_s > 0):
        raise ValueError(f"gap_cap_s must be a finite number of seconds > 0, got {gap_cap_s!r}")
    if not (isinstance(gap_floor_s, (int, float)) and math.isfinite(gap_floor_s) and gap_floor_s >= 0):
        raise ValueError(f"gap_floor_s must be a finite number of seconds >= 0, got {gap_floor_s!r}")
    u = np.asarray(user_ids)
    t = np.asarray(timestamps, dtype=np.float64)
    if u.shape != t.shape or u.ndim != 1:
        raise ValueError(f"user_ids and timestamps must be 1-D of equal length, got {u.shape} and {t.shape}")
    if u.size == 0:
        return np.zeros(0)
    gaps = np.diff(t, prepend=t[0])
    first = np.ones(u.shape[0], dtype=bool)
    first[1:] = u[1:] != u[:-1]
    if np.any(gaps[~first] < 0):
        raise ValueError("events must be sorted by user then timestamp")
    gaps[first] = 0.0
    step = gap_floor_s + gaps * gap_cap_s / (gaps + gap_cap_s)
    step[first] = 0.0
    cum = np.cumsum(step)
    starts = np.flatnonzero(first)
    lens = np.diff(np.append(starts, u.shape[0]))
    return cum - np.repeat(cum[starts], lens)


# ----------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class WorkloadConfig:
    """How a log becomes a ranking request stream (see the module doc for each rule).

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


def _user_tokens(items: np.ndarray, acts: np.ndarray, times: np.ndarray, user: int, scale: float,
                 num_items: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token sequence of one user under ``length_scale`` and ``ends[k]`` = tokens of behaviors ``0..k-1``."""
    n = items.shape[0]
    ends = np.floor(scale * np.arange(n + 1) + 1e-9).astype(np.int64)
    reps = np.diff(ends)
    if scale == 1.0:
        return items, acts, times, ends
    tok_items = np.repeat(items, reps)
    tok_acts = np.repeat(acts, reps)
    tok_times = np.repeat(times, reps)
    # r = position inside a behavior's expansion; r > 0 are synthetic companions
    r = np.arange(tok_items.shape[0]) - np.repeat(ends[:-1], reps)
    j = np.repeat(np.arange(n), reps)
    comp = r > 0
    if comp.any():
        key = (np.uint64(user) * np.uint64(0x100000001B3)) ^ (j[comp].astype(np.uint64) << np.uint64(20)) \
            ^ r[comp].astype(np.uint64)
        tok_items = tok_items.copy()
        tok_items[comp] = (_mix64(key) % np.uint64(num_items)).astype(np.int64)
    return tok_items, tok_acts, tok_times, ends


def _older_tokens(user: int, count: int, first_ts: int, num_items: int, num_actions: int):
    """``count`` synthetic behaviors older than the user's first one (deterministic per user)."""
    i = np.arange(count, dtype=np.uint64)
    key = (np.uint64(user) * np.uint64(0x9E3779B1)) ^ (np.uint64(1) << np.uint64(62)) ^ i
    h = _mix64(key)
    items = (h % np.uint64(num_items)).astype(np.int64)
    acts = ((h >> np.uint64(32)) % np.uint64(num_actions)).astype(np.int64)
    # one synthetic behavior a minute, oldest first, ending a minute before the first real one (times are >= 0)
    times = np.maximum(first_ts - 60 * (count - np.arange(count, dtype=np.int64)), 0)
    return items, acts, times


def build_workload(log: InteractionLog, config: WorkloadConfig) -> Workload:
    """Build the served request stream of ``log`` (see the module doc for every rule).

    Raises
    ------
    ValueError
        If the log has fewer eligible events (users with ``>= min_history`` earlier behaviors) than
        ``config.num_requests``.
    """
    cfg = config
    items, item_info = remap_items(log.item_ids, cfg.num_items)
    acts = action_ids(log, cfg.num_actions)
    users, times = log.user_ids, log.timestamps
    comp = compress_times(users, times, cfg.gap_cap_s, cfg.gap_floor_s)

    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    lens = np.diff(np.append(starts, users.shape[0]))
    pos = np.arange(users.shape[0]) - np.repeat(starts, lens)     # k = earlier real behaviors of the user
    # align users: a uniformly drawn event of each user (its anchor) lands at a uniform time in [0, gap_cap_s)
    rng = np.random.default_rng(cfg.seed)
    anchors = starts + np.floor(rng.random(starts.shape[0]) * lens).astype(np.int64)
    offsets = rng.random(starts.shape[0]) * cfg.gap_cap_s - comp[anchors]
    glob = np.repeat(offsets, lens) + comp

    eligible = np.flatnonzero(pos >= cfg.min_history)
    total = cfg.warmup_requests + cfg.num_requests
    if eligible.shape[0] < total:
        raise ValueError(f"the log has {eligible.shape[0]} events with >= min_history={cfg.min_history} earlier "
                         f"behaviors; num_requests={cfg.num_requests} + warmup_requests={cfg.warmup_requests} needs "
                         f"at least that many")
    order = eligible[np.lexsort((pos[eligible], users[eligible], glob[eligible]))]
    mid = int(np.searchsorted(glob[order], 0.5 * cfg.gap_cap_s))
    lo = min(max(cfg.warmup_requests, mid - cfg.num_requests // 2), order.shape[0] - cfg.num_requests)
    window = order[lo - cfg.warmup_requests:lo + cfg.num_requests]

    # candidate sampler: item popularity (mapped ids) in the whole log
    pop = np.bincount(items, minlength=cfg.num_items).astype(np.float64)
    pop /= pop.sum()
    user_of = np.repeat(np.arange(starts.shape[0]), lens)
    token_cache: dict[int, tuple] = {}
    first_k: dict[int, int] = {}
    requests: list[Request] = []
    capped = 0
    t0 = glob[window[0]]
    for idx, ev in enumerate(window.tolist()):
        u_row = int(user_of[ev])
        user = int(users[ev])
        k = int(pos[ev])
        if user not in token_cache:
            s, n = int(starts[u_row]), int(lens[u_row])
            token_cache[user] = _user_tokens(items[s:s + n], acts[s:s + n], times[s:s + n], user,
                                             float(cfg.length_scale), cfg.num_items)
            first_k[user] = k
        t_items, t_acts, t_times, ends = token_cache[user]
        end = int(ends[k])
        begin = 0
        if cfg.base_length is not None:
            # tokens to drop from the front so the user's first served request has base_length tokens;
            # negative: prepend synthetic older behaviors (once: afterwards the difference is 0)
            drop = int(ends[first_k[user]]) - cfg.base_length
            if drop < 0:
                t_items, t_acts, t_times, ends = _prepend_older(token_cache, user, -drop, cfg)
                end = int(ends[k])
            else:
                begin = drop
        if end - begin > cfg.max_history:  # drop the oldest tokens in whole blocks of trim_tokens
            begin += -(-(end - begin - cfg.max_history) // cfg.trim_tokens) * cfg.trim_tokens
            capped += 1
        hist = slice(begin, end)
        c = cfg.num_candidates
        r_rng = np.random.default_rng([cfg.seed, user, k])
        cands = np.empty(c, dtype=np.int64)
        cands[0] = items[ev]
        if c > 1:
            others = r_rng.choice(cfg.num_items, size=c - 1, replace=True, p=pop)
            cands[1:] = others
        L = end - begin
        requests.append(Request(
            index=idx, user_id=user, item_ids=t_items[hist], action_ids=t_acts[hist], timestamps=t_times[hist],
            prefix_len=max(0, L - cfg.suffix_tokens), candidates=cands, request_ts=int(times[ev]),
            offset_s=float(glob[ev] - t0), warmup=idx < cfg.warmup_requests))
    info = {
        "source": log.source, "log_events": len(log), "log_users": int(starts.shape[0]),
        "items": item_info, "action_kind": log.action_kind, "length_scale": float(cfg.length_scale),
        "base_length": cfg.base_length, "max_history": cfg.max_history, "trim_tokens": cfg.trim_tokens,
        "capped_requests": capped,
        "suffix_tokens": cfg.suffix_tokens, "num_candidates": cfg.num_candidates,
        "warmup_requests": cfg.warmup_requests,
        "pipeline_delay_s": cfg.pipeline_delay_s, "gap_cap_s": cfg.gap_cap_s, "gap_floor_s": cfg.gap_floor_s,
    }
    return Workload(requests, cfg, info)


def _prepend_older(token_cache: dict, user: int, count: int, cfg: WorkloadConfig):
    """Prepend ``count`` synthetic older behaviors to a user's cached token sequence (once per user)."""
    t_items, t_acts, t_times, ends = token_cache[user]
    o_items, o_acts, o_times = _older_tokens(user, count, int(t_times[0]) if len(t_times) else 0,
                                             cfg.num_items, cfg.num_actions)
    new = (np.concatenate([o_items, t_items]), np.concatenate([o_acts, t_acts]),
           np.concatenate([o_times, t_times]), ends + count)
    token_cache[user] = new
    return new


# ----------------------------------------------------------------------------------------------- fitted profiles
_Q_BODY = np.linspace(0.0, 1.0, 101)
_Q_GAPS = np.unique(np.concatenate([_Q_BODY, [0.995, 0.999]]))


def fit_profile(log: InteractionLog, name: str = "") -> dict:
    """Fit the small JSON-able profile :func:`synthesize_interactions` draws from.

    It holds empirical quantiles (101 evenly spaced levels) of events per user and of same-user gaps (plus the 99.5
    and 99.9 percentiles), the item popularity curve (cumulative event share of the top-r items at ~48 log-spaced
    ranks r), the action/rating histogram, and the log's size and time range.
    """
    users, times = log.user_ids, log.timestamps
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    lens = np.diff(np.append(starts, users.shape[0]))
    same = users[1:] == users[:-1]
    gaps = np.diff(times)[same].astype(np.float64)
    _, counts = np.unique(log.item_ids, return_counts=True)
    counts = np.sort(counts)[::-1]
    cum = np.cumsum(counts) / counts.sum()
    ranks = np.unique(np.round(np.geomspace(1, counts.shape[0], 48)).astype(np.int64))
    prof = {
        "format": PROFILE_FORMAT,
        "name": name or Path(log.source).name,
        "num_users": int(starts.shape[0]), "num_events": len(log), "num_items": int(counts.shape[0]),
        "time_range_s": [int(times.min()), int(times.max())],
        "events_per_user": {"q": _Q_BODY.round(4).tolist(), "v": percentile(lens, 100 * _Q_BODY).round(2).tolist()},
        "gap_s": {"q": _Q_GAPS.round(4).tolist(),
                  "v": (percentile(gaps, 100 * _Q_GAPS).round(2).tolist() if gaps.size else [0.0] * _Q_GAPS.size)},
        "item_popularity": {"rank": ranks.tolist(), "cum_share": cum[ranks - 1].round(6).tolist()},
        "action_kind": log.action_kind,
    }
    if log.action_values is not None:
        vals, cnt = np.unique(log.action_values, return_counts=True)
        prof["action_values"] = {"values": vals.tolist(), "probs": (cnt / cnt.sum()).round(6).tolist()}
    return prof


def save_profile(profile: dict, path) -> Path:
    """Write ``profile`` as indented JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return path


def load_profile(path=None) -> dict:
    """Load a profile JSON; ``None`` loads the packaged MovieLens ml-latest-small profile."""
    if path is None:
        text = resources.files("relaygr_engine").joinpath("workload_data", DEFAULT_PROFILE).read_text()
    else:
        text = Path(path).read_text()
    prof = json.loads(text)
    if prof.get("format") != PROFILE_FORMAT:
        raise ValueError(f"profile format must be {PROFILE_FORMAT!r}, got {prof.get('format')!r}")
    return prof


def _inverse_cdf(u: np.ndarray, q: Sequence[float], v: Sequence[float], log_space: bool) -> np.ndarray:
    q = np.asarray(q, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if log_space:
        return np.expm1(np.interp(u, q, np.log1p(v)))
    return np.interp(u, q, v)


def synthesize_interactions(profile: dict, num_users: Optional[int] = None, seed: int = 0) -> InteractionLog:
    """Draw a synthetic log whose per-user lengths, same-user gaps, item popularity and actions follow ``profile``.

    Users are independent; a user's event count is drawn from the events-per-user quantiles, its gaps i.i.d. from
    the gap quantiles (interpolated in log1p space, so the heavy tail is kept), items from the popularity curve and
    actions from the histogram. Raw item ids are popularity ranks (0 = most popular). Gaps are i.i.d., so session
    structure beyond the gap marginal is not reproduced.
    """
    n_users = int(profile["num_users"] if num_users is None else num_users)
    if n_users < 1:
        raise ValueError(f"num_users must be >= 1, got {n_users}")
    rng = np.random.default_rng(seed)
    epu = profile["events_per_user"]
    lens = np.maximum(1, np.round(_inverse_cdf(rng.random(n_users), epu["q"], epu["v"], False))).astype(np.int64)
    total = int(lens.sum())
    g = profile["gap_s"]
    gaps = np.round(_inverse_cdf(rng.random(total), g["q"], g["v"], True)).astype(np.int64)
    first = np.r_[0, np.cumsum(lens)[:-1]]
    t_lo, t_hi = profile["time_range_s"]
    gaps[first] = rng.integers(t_lo, max(t_lo + 1, (t_lo + t_hi) // 2), size=n_users)   # each user's start
    users = np.repeat(np.arange(1, n_users + 1, dtype=np.int64), lens)
    cum = np.cumsum(gaps)
    times = cum - np.repeat(cum[first], lens) + np.repeat(gaps[first], lens)
    pop = profile["item_popularity"]
    ranks = np.asarray(pop["rank"], dtype=np.float64)
    share = np.asarray(pop["cum_share"], dtype=np.float64)
    u = rng.random(total)
    # rank r holds the share between cum_share(r-1) and cum_share(r): invert the piecewise-linear CDF
    items = np.ceil(np.interp(u, np.r_[0.0, share], np.r_[0.0, ranks])).astype(np.int64) - 1
    items = np.clip(items, 0, int(profile["num_items"]) - 1)
    values = None
    kind = profile.get("action_kind", "none")
    if "action_values" in profile:
        av = profile["action_values"]
        p = np.asarray(av["probs"], dtype=np.float64)
        values = rng.choice(np.asarray(av["values"], dtype=np.float64), size=total, p=p / p.sum())
    else:
        kind = "none"
    return _sorted_log(users, items, times.astype(np.int64), values, kind,
                       f"profile:{profile.get('name', 'unnamed')}")


# ----------------------------------------------------------------------------------------------- CLI
def _log_stats(log: InteractionLog) -> dict:
    users = log.user_ids
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    lens = np.diff(np.append(starts, users.shape[0]))
    gaps = np.diff(log.timestamps)[users[1:] == users[:-1]]
    return {"events": len(log), "users": int(starts.shape[0]), "items": log.num_distinct_items,
            "events_per_user_p50": percentile(lens, 50), "events_per_user_p90": percentile(lens, 90),
            "events_per_user_max": int(lens.max()), "gap_p50_s": percentile(gaps, 50) if gaps.size else 0.0,
            "gap_le_60s_share": float(np.mean(gaps <= 60)) if gaps.size else 0.0}


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m relaygr_engine.bench.workload {fit,describe}``."""
    ap = argparse.ArgumentParser(prog="python -m relaygr_engine.bench.workload",
                                 description="Fit or describe ranking workload profiles.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit a profile JSON from an interaction CSV (.csv or .csv.gz)")
    f.add_argument("data", help="CSV with user_id,item_id,timestamp[,action|rating]")
    f.add_argument("-o", "--out", required=True, help="output JSON path")
    f.add_argument("--name", default="", help="profile name (default: the file name)")
    d = sub.add_parser("describe", help="print log statistics of a CSV or of a profile's synthetic log")
    d.add_argument("--data", help="CSV to describe (default: the packaged profile)")
    d.add_argument("--profile", help="profile JSON (default: the packaged one)")
    args = ap.parse_args(argv)
    if args.cmd == "fit":
        log = read_interactions(args.data)
        path = save_profile(fit_profile(log, args.name), args.out)
        print(f"fitted {len(log)} events of {log.num_users} users from {args.data} -> {path}")
        return 0
    log = read_interactions(args.data) if args.data else synthesize_interactions(load_profile(args.profile))
    for k, v in _log_stats(log).items():
        print(f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
