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
    Regenerate it with ``relaygr workload fit ratings.csv.gz -o profile.json``.

This module builds the stream (:func:`build_workload`) and holds the command line; the logs are read and mapped in
:mod:`relaygr_engine.workload.logs`, the stream's types are :mod:`relaygr_engine.workload.requests`
and the profiles :mod:`relaygr_engine.workload.profiles`. Every name of ``__all__`` is importable from here.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np

from ..stats import percentile
from .logs import InteractionLog, _mix64, action_ids, compress_times, read_interactions, remap_items
from .profiles import (DEFAULT_PROFILE, PROFILE_FORMAT, fit_profile, load_profile, save_profile,
                                synthesize_interactions)
from .requests import Request, Workload, WorkloadConfig

__all__ = [
    "InteractionLog", "WorkloadConfig", "Request", "Workload", "read_interactions", "remap_items", "action_ids",
    "compress_times", "build_workload", "fit_profile", "save_profile", "load_profile", "synthesize_interactions",
    "DEFAULT_PROFILE", "PROFILE_FORMAT", "main",
]


# ----------------------------------------------------------------------------------------------- workload
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
    """``relaygr workload {fit,describe}``."""
    ap = argparse.ArgumentParser(prog="relaygr workload",
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
