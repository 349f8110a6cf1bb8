"""Workload builder: log parsing, id mapping, ordering, caps, time compression, fitted profiles."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from relaygr_engine.workload.build import (WorkloadConfig, build_workload, compress_times, fit_profile, load_profile,
                                           read_interactions, remap_items, synthesize_interactions, action_ids)


def _write(path, text: str, gz: bool = False) -> None:
    data = text.encode()
    if gz:
        data = gzip.compress(data)
    path.write_bytes(data)


def _log_csv(tmp_path, rows, header="user_id,item_id,timestamp", gz=False, crlf=False, name="log.csv"):
    sep = "\r\n" if crlf else "\n"
    p = tmp_path / name
    _write(p, sep.join([header] + [",".join(map(str, r)) for r in rows]) + sep, gz=gz)
    return p


def _random_rows(n_users=30, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_users):
        t = int(rng.integers(0, 10_000))
        for _ in range(int(rng.integers(3, 40))):
            t += int(rng.choice([0, 1, 5, 30, 600, 86_400]))
            rows.append((u, int(rng.integers(0, 200)), t, float(rng.integers(1, 11)) / 2))
    rng.shuffle(rows)
    return rows


# ----------------------------------------------------------------------------------------------- reading
def test_reads_movielens_style_gzip_with_crlf_and_case_insensitive_header(tmp_path):
    rows = [(2, 50, 4.0, 30), (1, 10, 3.5, 20), (1, 11, 0.5, 10), (2, 51, 5.0, 5)]  # userId,movieId,rating,ts
    p = _log_csv(tmp_path, rows, header="userId,movieId,rating,timestamp", gz=True, crlf=True, name="r.csv.gz")
    log = read_interactions(p)
    assert log.user_ids.tolist() == [1, 1, 2, 2]            # sorted by user, then time
    assert log.timestamps.tolist() == [10, 20, 5, 30]
    assert log.item_ids.tolist() == [11, 10, 51, 50]
    assert log.action_kind == "rating"
    # action = floor(rating + 0.5) clipped to num_actions - 1
    assert action_ids(log, 4).tolist() == [1, 3, 3, 3]
    assert action_ids(log, 8).tolist() == [1, 4, 5, 4]


def test_text_actions_map_by_frequency_and_ties_keep_file_order(tmp_path):
    rows = [(1, 5, 7, "click"), (1, 6, 7, "buy"), (1, 7, 7, "click")]
    log = read_interactions(_log_csv(tmp_path, rows, header="USER,Item,Time,Action"))
    assert log.item_ids.tolist() == [5, 6, 7]                # equal timestamps keep file order
    assert action_ids(log, 4).tolist() == [0, 1, 0]          # most frequent text action -> 0


def test_missing_column_names_the_column_and_the_accepted_aliases(tmp_path):
    p = _log_csv(tmp_path, [(1, 2)], header="user_id,item_id")
    with pytest.raises(ValueError, match="timestamp"):
        read_interactions(p)
    with pytest.raises(FileNotFoundError):
        read_interactions(tmp_path / "nope.csv")


def test_remap_items_by_frequency_rank_with_hashed_overflow():
    raw = np.array([7, 7, 7, 3, 3, 9, 100, 101, 102, 103])
    mapped, info = remap_items(raw, num_items=16)             # everything fits: pure frequency rank
    assert mapped[:6].tolist() == [0, 0, 0, 1, 1, 2]          # 7 most frequent, then 3, then 9 (ties: smaller raw id)
    assert info["overflow_buckets"] == 0
    mapped, info = remap_items(raw, num_items=5)              # 7 distinct > 5: top 4 kept, 1 overflow bucket
    assert info["kept"] == 4 and info["overflow_buckets"] == 1
    assert mapped.min() >= 0 and mapped.max() < 5
    assert mapped[:6].tolist() == [0, 0, 0, 1, 1, 2] and mapped[6] == 3
    assert set(mapped[7:].tolist()) == {4}
    big, _ = remap_items(np.arange(10_000), num_items=1000)
    assert big.min() >= 0 and big.max() < 1000
    assert len(np.unique(big[big >= 1000 - 62])) > 1          # the overflow hash spreads over its buckets


# ----------------------------------------------------------------------------------------------- compression
def test_compression_keeps_the_order_of_each_users_gaps():
    rng = np.random.default_rng(1)
    users = np.repeat(np.arange(5), 50)
    times = np.concatenate([np.cumsum(rng.choice([0, 1, 7, 60, 3600, 10**7], size=50)) for _ in range(5)])
    c = compress_times(users, times, gap_cap_s=1800.0)
    for u in range(5):
        m = users == u
        g_raw = np.diff(times[m])
        g_c = np.diff(c[m])
        assert c[m][0] == 0.0
        assert np.all(g_c >= 0) and np.all(g_c < 1800.0)
        i, j = np.triu_indices(len(g_raw), 1)
        d = g_c[i] - g_c[j]                      # compressed times are cumulative sums: allow rounding error
        assert np.array_equal(np.sign(g_raw[i] - g_raw[j]), np.where(np.abs(d) < 1e-6, 0, np.sign(d)))


def test_arrivals_rescale_to_the_qps_and_keep_each_users_gap_order(tmp_path):
    log = read_interactions(_log_csv(tmp_path, _random_rows()))
    w = build_workload(log, WorkloadConfig(num_items=64, num_actions=4, num_requests=200, num_candidates=8))
    for qps in (10.0, 250.0):
        a = w.arrivals(qps)
        assert a[0] == 0.0 and np.all(np.diff(a) >= 0)                    # arrival order
        assert a[-1] == pytest.approx((len(a) - 1) / qps)                 # mean rate = qps
    a1, a2 = w.arrivals(10.0), w.arrivals(250.0)
    users = np.array([r.user_id for r in w.requests])
    for u in np.unique(users):
        g1, g2 = np.diff(a1[users == u]), np.diff(a2[users == u])
        assert np.allclose(g1 * 10.0 / 250.0, g2)                         # same shape at every QPS
    # a user's served gaps are ordered like its raw gaps (the compression is strictly increasing)
    for u in np.unique(users):
        reqs = [r for r in w.requests if r.user_id == u]
        raw = np.diff([r.request_ts for r in reqs])
        g = np.diff(a1[users == u])
        i, j = np.triu_indices(len(raw), 1)
        assert np.array_equal(np.sign(raw[i] - raw[j]), np.sign(np.round(g[i] - g[j], 12)))


# ----------------------------------------------------------------------------------------------- building
def test_histories_are_the_users_earlier_behaviors_in_order(tmp_path):
    rows = _random_rows(n_users=12, seed=3)
    log = read_interactions(_log_csv(tmp_path, rows, header="user_id,item_id,timestamp,rating"))
    cfg = WorkloadConfig(num_items=512, num_actions=4, num_requests=60, num_candidates=5, suffix_tokens=2)
    w = build_workload(log, cfg)
    assert len(w) == 60 and [r.index for r in w.requests] == list(range(60))
    mapped, _ = remap_items(log.item_ids, 512)
    acts = action_ids(log, 4)
    for r in w.requests:
        m = np.flatnonzero(log.user_ids == r.user_id)
        k = r.history_len                                   # scale 1, no cap: history = all k earlier behaviors
        assert k >= 1
        assert r.request_ts == log.timestamps[m[k]]
        assert r.item_ids.tolist() == mapped[m[:k]].tolist()
        assert r.action_ids.tolist() == acts[m[:k]].tolist()
        assert np.all(np.diff(r.timestamps) >= 0) and r.timestamps[-1] <= r.request_ts
        assert r.prefix_len == max(0, k - 2)
        assert r.candidates.shape == (5,) and r.candidates[0] == mapped[m[k]]
        assert r.candidates.min() >= 0 and r.candidates.max() < 512
    # a user's later request extends its earlier one
    by_user: dict = {}
    for r in w.requests:
        if r.user_id in by_user:
            prev = by_user[r.user_id]
            assert r.history_len > prev.history_len
            assert r.item_ids[:prev.history_len].tolist() == prev.item_ids.tolist()
        by_user[r.user_id] = r


def test_length_scale_cap_and_base_length(tmp_path):
    log = read_interactions(_log_csv(tmp_path, _random_rows(n_users=20, seed=5)))
    base = build_workload(log, WorkloadConfig(num_items=256, num_actions=2, num_requests=80, num_candidates=4))
    scaled = build_workload(log, WorkloadConfig(num_items=256, num_actions=2, num_requests=80, num_candidates=4,
                                                length_scale=3.0))
    assert [r.user_id for r in base.requests] == [r.user_id for r in scaled.requests]
    for b, s in zip(base.requests, scaled.requests):
        assert s.history_len == 3 * b.history_len
        assert s.item_ids[::3].tolist() == b.item_ids.tolist()          # every 3rd token is the real behavior
        assert s.timestamps[::3].tolist() == b.timestamps.tolist()
    capped = build_workload(log, WorkloadConfig(num_items=256, num_actions=2, num_requests=80, num_candidates=4,
                                                length_scale=3.0, max_history=10, suffix_tokens=4))
    for s, c in zip(scaled.requests, capped.requests):
        assert c.history_len == min(10, s.history_len)
        assert c.item_ids.tolist() == s.item_ids[-c.history_len:].tolist()   # the newest tokens are kept
        assert c.prefix_len == max(0, c.history_len - 4)
    fixed = build_workload(log, WorkloadConfig(num_items=256, num_actions=2, num_requests=80, num_candidates=4,
                                               base_length=25))
    first: dict = {}
    for b, f in zip(base.requests, fixed.requests):
        if f.user_id not in first:
            first[f.user_id] = f
            assert f.history_len == 25                                  # first request: exactly base_length
        else:
            p = first[f.user_id]
            assert f.history_len - p.history_len == b.history_len - first_base(base, f.user_id)
            assert f.item_ids[:p.history_len].tolist() == p.item_ids.tolist()   # later ones append
        n = min(b.history_len, f.history_len)
        assert f.item_ids[-n:].tolist() == b.item_ids[-n:].tolist()     # the real behaviors end the history


def test_trimming_in_blocks_keeps_each_users_prefix(tmp_path):
    log = read_interactions(_log_csv(tmp_path, _random_rows(n_users=20, seed=6)))
    kw = dict(num_items=256, num_actions=2, num_requests=80, num_candidates=4, length_scale=3.0)
    full = build_workload(log, WorkloadConfig(**kw))
    blocks = build_workload(log, WorkloadConfig(**kw, max_history=12, trim_tokens=6))
    last: dict = {}
    shared = 0
    for f, c in zip(full.requests, blocks.requests):
        assert 12 - 6 + 1 <= c.history_len <= 12 or c.history_len == f.history_len <= 12
        dropped = f.history_len - c.history_len
        assert dropped % 6 == 0                                          # whole blocks from the user's start
        assert c.item_ids.tolist() == f.item_ids[dropped:].tolist()     # the newest tokens are kept
        p = last.get(c.user_id)
        if p is not None and p[0] == dropped:                           # same block: the old history is a prefix
            assert c.item_ids[:p[1].shape[0]].tolist() == p[1].tolist()
            shared += 1
        last[c.user_id] = (dropped, c.item_ids)
    assert shared > 0
    with pytest.raises(ValueError, match="trim_tokens"):
        WorkloadConfig(**kw, trim_tokens=0)


def first_base(w, user):
    return next(r.history_len for r in w.requests if r.user_id == user)


def test_too_few_events_is_a_value_error(tmp_path):
    log = read_interactions(_log_csv(tmp_path, [(1, 1, 1), (1, 2, 2), (2, 3, 3)]))
    with pytest.raises(ValueError, match="num_requests"):
        build_workload(log, WorkloadConfig(num_items=8, num_actions=1, num_requests=5, num_candidates=2))
    with pytest.raises(ValueError, match="length_scale"):
        WorkloadConfig(num_items=8, num_actions=1, length_scale=0)


# ----------------------------------------------------------------------------------------------- profiles
def test_packaged_profile_loads_and_synthesizes_a_log_like_movielens():
    prof = load_profile()
    assert prof["num_users"] == 610 and prof["num_events"] == 100_836
    log = synthesize_interactions(prof, seed=0)
    users = log.user_ids
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    lens = np.diff(np.append(starts, users.shape[0]))
    assert len(starts) == 610
    assert 40 <= np.median(lens) <= 110                                   # MovieLens: 70.5
    gaps = np.diff(log.timestamps)[users[1:] == users[:-1]]
    assert 0.75 <= np.mean(gaps <= 60) <= 0.9                             # MovieLens: 83%
    w = build_workload(log, WorkloadConfig(num_items=1000, num_actions=4, num_requests=100, num_candidates=16))
    assert len(w) == 100


def test_fit_profile_round_trips_quantiles(tmp_path):
    log = read_interactions(_log_csv(tmp_path, _random_rows(n_users=40, seed=7), header="u,item,ts,rating"
                                     .replace("u,", "user,")))
    prof = fit_profile(log, name="test")
    lens = np.unique(log.user_ids, return_counts=True)[1]
    assert prof["events_per_user"]["v"][50] == pytest.approx(np.median(lens))
    assert prof["events_per_user"]["v"][-1] == lens.max()
    assert prof["item_popularity"]["cum_share"][-1] == pytest.approx(1.0)
    syn = synthesize_interactions(prof, num_users=40, seed=1)
    assert len(np.unique(syn.user_ids)) == 40
    assert syn.item_ids.max() < prof["num_items"]
