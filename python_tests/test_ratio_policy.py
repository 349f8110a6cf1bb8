"""The live ratio policy: replicas' load windows, the window the controller judges, and the Serve application-level
policy driven with Serve-shaped contexts (no Ray needed; the live run is in test_ray_ratio.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.policy.ratio import RatioController, WindowStats
from relaygr_engine.serving.ratio_policy import LoadWindow, PoolRatioPolicy, pool_autoscaling_config, window_stats
from relaygr_engine.serving.ray_serve import RelayReplica, ReplicaSpec
from relaygr_engine.serving import wire


def test_load_window_counts_and_starts_afresh_when_taken():
    w = LoadWindow()
    w.ranked(0.002, 0.010, 0.050, missed_ticket=False)
    w.ranked(0.030, 0.080, 0.050, missed_ticket=True)
    w.prefilled(0.004)
    w.handed_over(landed=True)
    w.handed_over(landed=False)
    got = w.take()
    assert got == {"rankings": 2.0, "rankings_in_slo": 1.0, "rank_wait_s": pytest.approx(0.032), "prefills": 1.0,
                   "prefill_wait_s": 0.004, "shipped": 2.0, "late": 2.0}
    assert all(isinstance(v, float) for v in got.values())
    assert set(w.take().values()) == {0.0}


def _metrics(**per_replica):
    """Serve's aggregated metrics shape: name -> {replica: value}."""
    out = {}
    for replica, values in per_replica.items():
        for name, v in values.items():
            out.setdefault(name, {})[replica] = v
    return out


def test_window_stats_sums_the_pools_replicas():
    rank = _metrics(r1={"rankings": 30, "rankings_in_slo": 27, "rank_wait_s": 0.6, "late": 1},
                    r2={"rankings": 10, "rankings_in_slo": 9, "rank_wait_s": 0.2})
    pre = _metrics(p1={"prefills": 8, "prefill_wait_s": 0.4, "shipped": 8, "late": 1})
    w = window_stats(pre, rank)
    assert (w.slo_attainment, w.prefill_wait_s, w.late_share) == (0.9, 0.05, 0.25)
    assert w.rank_wait_s == pytest.approx(0.02)
    assert window_stats(pre, _metrics(r1={"rankings": 0})) is None  # nothing to judge
    assert window_stats(pre, rank, min_rankings=41) is None
    assert window_stats({}, rank).prefill_wait_s == 0.0 and window_stats({}, rank).late_share == 1.0  # 1 late / 0
    assert window_stats(None, rank) is not None


def _ctx(name, current, target, metrics, now):
    return SimpleNamespace(deployment_id=("app", name), deployment_name=name, current_num_replicas=current,
                           target_num_replicas=target, aggregated_metrics=metrics, current_time=now)


def _tick(policy, pre, rank, now, pre_metrics=None, rank_metrics=None):
    contexts = {("app", "P"): _ctx("P", *pre, pre_metrics or {}, now),
                ("app", "R"): _ctx("R", *rank, rank_metrics or {}, now)}
    decisions, state = policy(contexts)
    assert state == {}
    return decisions[("app", "P")], decisions[("app", "R")]


SLOW_RANKS = _metrics(r1={"rankings": 20, "rankings_in_slo": 10, "rank_wait_s": 1.0})
LATE = (_metrics(p1={"prefills": 10, "prefill_wait_s": 2.0, "shipped": 10, "late": 5}),
        _metrics(r1={"rankings": 20, "rankings_in_slo": 20, "rank_wait_s": 0.02}))


def test_policy_moves_a_replica_after_patience_windows_and_only_once_per_window():
    p = PoolRatioPolicy("P", "R", patience=2, window_s=10.0)
    assert _tick(p, (2, 2), (1, 1), 0.0, rank_metrics=SLOW_RANKS) == (2, 1)  # first tick: starts, judges nothing
    assert p.controller.split == (2, 1) and p.last_window is None
    for t in (1.0, 5.0, 9.9):  # Serve ticks often; one window per window_s
        assert _tick(p, (2, 2), (1, 1), t, rank_metrics=SLOW_RANKS) == (2, 1)
    assert p.last_window is None
    assert _tick(p, (2, 2), (1, 1), 10.0, rank_metrics=SLOW_RANKS) == (2, 1)  # 1 window of 2
    assert p.last_window.slo_attainment == 0.5 and p.moves == 0
    assert _tick(p, (2, 2), (1, 1), 20.0, rank_metrics=SLOW_RANKS) == (1, 2)  # the ranking pool is short
    assert p.moves == 1
    # Serve is moving replicas (current != target): no window is judged until it is done
    for t in (30.0, 40.0, 50.0):
        assert _tick(p, (2, 1), (1, 2), t, rank_metrics=SLOW_RANKS) == (1, 2)
    assert p.moves == 1
    # settled; the pre-infer pool is now the bottleneck (prefixes late, pre-infers queue)
    assert _tick(p, (1, 1), (2, 2), 51.0, *LATE) == (1, 2)
    assert _tick(p, (1, 1), (2, 2), 61.0, *LATE) == (1, 2)
    assert _tick(p, (1, 1), (2, 2), 71.0, *LATE) == (2, 1) and p.moves == 2


def test_policy_follows_changes_made_outside_it_and_leaves_other_apps_alone():
    p = PoolRatioPolicy("P", "R", patience=1, window_s=1.0)
    _tick(p, (1, 1), (3, 3), 0.0)
    assert _tick(p, (2, 2), (2, 2), 0.5, rank_metrics=SLOW_RANKS) == (2, 2)  # redeployed 2:2: restart from there
    assert p.controller.split == (2, 2) and p.moves == 0
    assert _tick(p, (2, 2), (2, 2), 1.6, rank_metrics=SLOW_RANKS) == (1, 3)
    assert _tick(p, (1, 1), (3, 3), 3.0, rank_metrics=SLOW_RANKS) == (1, 3)  # the pre-infer pool keeps one
    other = {("x", "A"): _ctx("A", 1, 4, {}, 0.0)}
    assert p(other) == ({("x", "A"): 4}, {})


def test_policy_and_pool_config_check_their_arguments():
    with pytest.raises(ValueError, match="window_s"):
        PoolRatioPolicy(window_s=0)
    with pytest.raises(ValueError, match="patience"):
        PoolRatioPolicy(patience=0)
    with pytest.raises(ValueError, match="prefill_deployment"):
        PoolRatioPolicy(prefill_deployment="")
    with pytest.raises(ValueError, match=r"\['window'\] are unknown; valid: .*window_s"):
        PoolRatioPolicy.from_options({"window": 3})
    assert PoolRatioPolicy.from_options({"window_s": 3}).window_s == 3.0
    cfg = pool_autoscaling_config(2, 5, window_s=8.0)
    assert cfg == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2, "upscale_delay_s": 0.0,
                   "downscale_delay_s": 0.0, "look_back_period_s": 8.0, "metrics_interval_s": 2.0}
    with pytest.raises(ValueError, match="replicas"):
        pool_autoscaling_config(5, 5)
    with pytest.raises(ValueError, match="total"):
        pool_autoscaling_config(1, 1)


def test_controller_starting_at_a_deployed_split():
    c = RatioController.starting_at(3, 1, patience=1)
    assert c.split == (3, 1)
    assert c.observe(WindowStats(0.5, 0.1, 0.0, 0.0)) == (2, 2)
    with pytest.raises(ValueError, match="rank"):
        RatioController.starting_at(1, 0)


CFG = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=32, num_heads=2, head_dim=16, num_items=200,
                       num_actions=4, max_seq_len=128, num_tasks=2)


def test_replica_spec_round_trips_through_json():
    import json

    spec = ReplicaSpec(model=CFG, seed=3, cache=rg.CacheConfig(dtype="bfloat16", num_pages=64), trigger={},
                       slo_ms=25.0)
    fields = json.loads(json.dumps(spec.to_json()))
    assert ReplicaSpec(**fields) == spec
    with pytest.raises(ValueError, match="slo_ms"):
        ReplicaSpec(model=CFG, slo_ms=0)


def test_replica_reports_its_load_window_to_serve():
    g = torch.Generator().manual_seed(0)
    h = rg.Behaviors(item_ids=torch.randint(0, 200, (24,), generator=g),
                     action_ids=torch.randint(0, 4, (24,), generator=g))
    body = {"user_id": 4, **wire.behaviors_to_json(h), "candidates": [1, 2, 3]}

    async def serve(slo_ms):
        replica = RelayReplica(ReplicaSpec(model=CFG, cache=rg.CacheConfig(num_pages=64, lease_ttl_s=600.0),
                                           slo_ms=slo_ms))
        pre = await replica.prefill({"user_id": 4, **wire.behaviors_to_json(h.prefix(16))})
        hit = await replica.rank(dict(body, ticket=pre["ticket"]))
        await replica.rank(body)
        return pre, hit, await replica.record_autoscaling_stats(), await replica.record_autoscaling_stats()

    pre, hit, first, second = asyncio.run(serve(1e6))
    assert pre["admitted"] and hit["source"] == "hbm"
    assert first["rankings"] == 2 and first["rankings_in_slo"] == 2 and first["prefills"] == 1
    assert first["rank_wait_s"] > 0 and first["prefill_wait_s"] > 0 and first["late"] == 0
    assert set(second.values()) == {0.0}  # taken: a fresh window
    assert asyncio.run(serve(1e-6))[2]["rankings_in_slo"] == 0
