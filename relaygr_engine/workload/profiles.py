"""Fitted workload profiles: :func:`fit_profile` condenses an interaction log into a small JSON-able profile,
:func:`synthesize_interactions` draws a synthetic log from one, and the package ships one fitted to MovieLens
(:data:`DEFAULT_PROFILE`, read by :func:`load_profile`). The names are re-exported by
:mod:`relaygr_engine.workload.build`.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..stats import percentile
from .logs import InteractionLog, _sorted_log

PROFILE_FORMAT = "relaygr-workload-profile/1"
DEFAULT_PROFILE = "movielens_small_profile.json"

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
        text = resources.files("relaygr_engine.workload.data").joinpath(DEFAULT_PROFILE).read_text()
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
