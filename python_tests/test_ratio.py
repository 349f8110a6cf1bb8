"""The pre-infer : ranking ratio policy: offline split from service rates, online moves, Serve autoscaling."""
from __future__ import annotations

import pytest

from relaygr_engine.policy.ratio import RatioController, ServiceRates, WindowStats, autoscaling_config, split


def test_split_balances_pool_throughputs():
    # a pre-infer takes 3x a ranking and every request is pre-inferred: 3 pre-infer per ranking instance
    r = ServiceRates(prefill_s=0.030, rank_s=0.010)
    assert split(8, r) == (6, 2)
    # rankings batched by 3 (b_d = 3 per 10 ms): the ranking pool needs a third of that share
    assert split(8, ServiceRates(prefill_s=0.030, rank_s=0.010, rank_batch=3.0)) == (7, 1)
    # only a quarter of requests is pre-inferred: fewer pre-infer instances
    assert split(8, ServiceRates(prefill_s=0.030, rank_s=0.010, prefill_share=0.25)) == (3, 5)
    assert split(2, ServiceRates(prefill_s=1.0, rank_s=1e-3)) == (1, 1)  # each pool keeps one
    assert split(5, ServiceRates(prefill_s=0.01, rank_s=0.01, prefill_share=0.0)) == (1, 4)
    with pytest.raises(ValueError, match="total"):
        split(1, r)
    with pytest.raises(ValueError, match="prefill_share"):
        ServiceRates(prefill_s=0.01, rank_s=0.01, prefill_share=1.5)


def test_controller_moves_one_instance_after_patience_windows_that_agree():
    c = RatioController(6, ServiceRates(prefill_s=0.02, rank_s=0.02), patience=2)
    assert c.split == (3, 3)
    slow_ranks = WindowStats(slo_attainment=0.9, rank_wait_s=0.05, prefill_wait_s=0.001, late_share=0.0)
    late = WindowStats(slo_attainment=0.97, rank_wait_s=0.001, prefill_wait_s=0.04, late_share=0.3)
    fine = WindowStats(slo_attainment=1.0, rank_wait_s=0.001, prefill_wait_s=0.001, late_share=0.0)
    assert c.observe(slow_ranks) is None and c.observe(slow_ranks) == (2, 4)
    assert c.observe(late) is None and c.observe(fine) is None and c.observe(late) is None  # streak broken
    assert c.observe(late) == (3, 3)
    for _ in range(10):
        c.observe(slow_ranks)
    assert c.split == (1, 5)  # the pre-infer pool keeps one instance
    with pytest.raises(ValueError, match="late_share"):
        WindowStats(1.0, 0.0, 0.0, 2.0)


def test_autoscaling_config_keeps_a_pool_near_its_share():
    assert autoscaling_config(3, per_replica_rate=50.0) == {
        "min_replicas": 2, "max_replicas": 4, "initial_replicas": 3, "target_ongoing_requests": 5.0}
    assert autoscaling_config(1, 2.0, slack=2)["min_replicas"] == 1
    with pytest.raises(ValueError, match="replicas"):
        autoscaling_config(0, 1.0)


def test_the_split_reaches_each_pools_serve_autoscaling_config():
    pytest.importorskip("ray.serve")
    import relaygr_engine as rg
    from relaygr_engine.serving.disaggregated import build_disaggregated_app, pool_autoscaling
    from relaygr_engine.serving.ray_serve import ReplicaSpec

    pre, rank = pool_autoscaling(6, ServiceRates(prefill_s=0.030, rank_s=0.010))
    assert (pre["initial_replicas"], rank["initial_replicas"]) == split(6, ServiceRates(0.030, 0.010)) == (4, 2)
    app = build_disaggregated_app(ReplicaSpec(model=rg.GRModelConfig()), prefill_autoscaling=pre,
                                  rank_autoscaling=rank)
    ingress = app._bound_deployment                       # the ranking pool
    prefill = ingress.init_args[1]._bound_deployment      # the pre-infer pool it holds a handle to
    for deployment, cfg in ((ingress, rank), (prefill, pre)):
        a = deployment._deployment_config.autoscaling_config
        assert (a.min_replicas, a.initial_replicas, a.max_replicas) == (cfg["min_replicas"], cfg["initial_replicas"],
                                                                       cfg["max_replicas"])
        assert a.target_ongoing_requests == cfg["target_ongoing_requests"]
    with pytest.raises(ValueError, match="rank_autoscaling"):
        build_disaggregated_app(ReplicaSpec(model=rg.GRModelConfig()), rank_autoscaling=[1])
