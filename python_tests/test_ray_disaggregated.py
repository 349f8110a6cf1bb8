"""Disaggregated serving on Ray Serve: 1 pre-infer + 2 ranking replicas, on one node and on two simulated nodes.

Every ranking is exact; rankings whose prefix was shipped read it on their ranking replica; killing the pre-infer
replica mid-run loses no request (its users' rankings compute their prefix and are counted)."""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.serving.ray_serve import ReplicaSpec

from ray_local import server_port
from serve_helpers import _exact

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(not HAS_RAY, reason="ray[serve] is not installed (pip install 'relaygr-engine[ray]')")]

CFG = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=32, num_heads=2, head_dim=16, num_items=500,
                       num_actions=4, max_seq_len=256, num_tasks=2)
SEED = 5
USERS = 36
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": None, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0",
       "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0", "OMP_NUM_THREADS": "1"}


def history(user: int, length: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(2000 + user)
    return rg.Behaviors(item_ids=torch.randint(0, CFG.num_items, (length,), generator=g),
                        action_ids=torch.randint(0, CFG.num_actions, (length,), generator=g),
                        timestamps=1_700_000_000 + torch.arange(length) * 60)


def candidates(user: int) -> torch.Tensor:
    return torch.randint(0, CFG.num_items, (6,), generator=torch.Generator().manual_seed(7000 + user))


def _start_ray(kind: str):
    """A local Ray instance on 127.0.0.1, or a two-node ``Cluster`` (both nodes on 127.0.0.1) whose nodes carry
    the custom resources that place the pre-infer pool on one and the ranking pool on the other."""
    import ray

    if kind == "one_node":
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, object_store_memory=80 * 2 ** 20)
        return None, {}
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    # Ray resolves a loopback GCS address to the machine's outward IP for every node after the head; in
    # single-machine mode (the switch Ray keeps for macOS and Windows) it stays on 127.0.0.1.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"prefill_node": 2}, "node_ip_address": "127.0.0.1",
        "include_dashboard": False, "object_store_memory": 80 * 2 ** 20})
    cluster.add_node(num_cpus=1, resources={"rank_node": 3}, node_ip_address="127.0.0.1",
                     object_store_memory=80 * 2 ** 20)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, {"prefill_resources": {"prefill_node": 1}, "rank_resources": {"rank_node": 1}}


@pytest.fixture(scope="module", params=["one_node", "two_nodes"])
def app(request):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update({k: v for k, v in ENV.items() if v is not None})
    import ray
    from ray import serve
    from ray._private import ray_constants

    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER

    from relaygr_engine.serving.client import RelayClient
    from relaygr_engine.serving.disaggregated import run_disaggregated

    cluster = None
    spec = ReplicaSpec(model=CFG, seed=SEED, torch_threads=1,
                       cache=rg.CacheConfig(page_size=16, num_pages=256, max_pinned_fraction=0.5, lease_ttl_s=600.0))
    try:
        cluster, placement = _start_ray(request.param)
        rank, prefill = run_disaggregated(spec, prefill_replicas=1, rank_replicas=2, num_cpus=0.25,
                                          app_name=f"pd_{request.param}", port=server_port(), stats_period_s=0.2,
                                          **placement)
        yield {"client": RelayClient(rank, prefill_handle=prefill, forward_deadline_s=2.0), "prefill": prefill,
               "ray": ray, "model": rg.build_ranker(CFG, seed=SEED), "kind": request.param}
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_shipped_prefixes_hit_on_the_ranking_pool_and_a_killed_pre_infer_replica_loses_nothing(app):
    client, model, ray = app["client"], app["model"], app["ray"]
    users = list(range(USERS))
    hist = {u: history(u, 40 + (u * 11) % 80) for u in users}
    prefix = {u: hist[u].prefix(len(hist[u]) - 8) for u in users}
    pre_desc = app["prefill"].options(method_name="describe").remote().result()
    pres, results = {}, {}
    second_half_prefilled = threading.Event()

    def serve_user(u):
        pres[u] = client.prefill(u, prefix[u])
        if u >= USERS // 2:
            second_half_prefilled.set()
        results[u] = client.rank(u, hist[u], candidates(u), ticket=pres[u])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(serve_user, users[: USERS // 2]))
        futures = [pool.submit(serve_user, u) for u in users[USERS // 2:]]
        # kill mid-run: once the second half's first pre-infer has returned, with the rest in flight or queued
        assert second_half_prefilled.wait(timeout=120), "no pre-infer of the second half returned"
        ray.kill(ray.get_actor(pre_desc["actor_name"], namespace="serve"), no_restart=True)
        for f in futures:
            f.result()  # no request lost: each returns scores

    assert sorted(results) == users
    for u in users:
        assert _exact(model, hist[u], candidates(u), results[u].scores) <= 1e-4, u
    shipped = [u for u in users if pres[u].admitted]
    assert len(shipped) >= USERS // 2  # every user before the kill
    for u in shipped:
        assert pres[u].ticket["replica"] != pres[u].replica  # ranked elsewhere than pre-inferred
    hits = [u for u in shipped if results[u].source == "hbm" and results[u].replica == pres[u].ticket["replica"]
            and results[u].cached_tokens == len(prefix[u])]
    assert len(hits) >= 0.95 * len(shipped)
    lost = [u for u in users if not pres[u].admitted]
    assert all(results[u].source == "recompute" for u in lost)  # computed on the ranking pool, counted below
    s = client.stats()
    assert s["rank_recompute"] >= len(lost) and s["prefill_admitted"] == len(shipped)
    rank_replicas = {results[u].replica for u in users}
    assert len(rank_replicas) == 2
    if app["kind"] == "two_nodes":  # the transfer crossed nodes
        rank_nodes = {client.describe(r)["node_id"] for r in rank_replicas}
        assert pre_desc["node_id"] not in rank_nodes
    # the pool serves again once Serve replaced its pre-infer replica
    u = users[0]
    end = time.monotonic() + 120
    while not (again := client.prefill(u, hist[u])).admitted:
        assert time.monotonic() < end, again.reason
        time.sleep(0.5)
    r = client.rank(u, hist[u], candidates(u), ticket=again)
    assert r.source == "hbm" and r.cached_tokens == len(hist[u]) and _exact(model, hist[u], candidates(u),
                                                                           r.scores) <= 1e-4


def test_serve_cli_rejects_bad_pool_sizes_before_starting_ray(capsys):
    from relaygr_engine.serving.cli import main

    for argv, message in ((["--rank-replicas", "2"], "--rank-replicas needs --prefill-replicas"),
                          (["--prefill-replicas", "0"], "--prefill-replicas: expected an integer >= 1, got 0")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err  # one usage line naming the flag
