"""Interaction logs of the ranking workloads: reading a CSV (:func:`read_interactions`) into an
:class:`InteractionLog`, mapping its item and action ids into a model's vocabulary (:func:`remap_items`,
:func:`action_ids`) and compressing each user's timeline (:func:`compress_times`). The rules are in the
:mod:`relaygr_engine.workload.build` module doc; the names are re-exported there.
"""
from __future__ import annotations

import csv
import gzip
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

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
    """Map raw item ids into ``[0, num_items)`` by frequency rank, hashing the overflow (see the
    :mod:`relaygr_engine.workload.build` module doc).

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
    """Action ids in ``[0, num_actions)`` of every event (see the :mod:`relaygr_engine.workload.build` module doc
    for the rule)."""
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
