"""Prometheus metrics: the same definitions read through prometheus_client in a plain process and scraped over
HTTP from Ray's metrics export port for a Ray Serve replica."""
from __future__ import annotations

import importlib.util
import re
import time
from pathlib import Path

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.serving import metrics as m
from ray_local import http_get, local_ray, server_port

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
HAS_PROM = importlib.util.find_spec("prometheus_client") is not None

CFG = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=32, num_heads=2, head_dim=16, num_items=300,
                       num_actions=4, max_seq_len=256, num_tasks=2)


def history(user: int, length: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(user)
    return rg.Behaviors(item_ids=torch.randint(0, CFG.num_items, (length,), generator=g),
                        action_ids=torch.randint(0, CFG.num_actions, (length,), generator=g),
                        timestamps=1_700_000_000 + torch.arange(length) * 60)


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    """Every sample of metric ``name`` in a Prometheus text exposition: (labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def test_every_metric_is_documented_once():
    names = [spec.name for spec in m.METRICS]
    assert len(names) == len(set(names)) and all(n.startswith("relaygr_") for n in names)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "ray_serve.md").read_text()
    assert m.metrics_table() in doc  # the documented table is the one the code exports


@pytest.mark.skipif(not HAS_PROM, reason="prometheus_client is not installed (pip install 'relaygr-engine[metrics]')")
def test_a_process_without_ray_reads_the_engine_metrics_through_prometheus_client():
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    rec = m.EngineMetrics.prometheus(registry)
    engine = rg.RelayEngine(rg.build_ranker(CFG, seed=0), rg.CacheConfig(page_size=16, num_pages=64))
    cands = torch.arange(5)
    for user in range(3):
        h = history(user, 48)
        t0 = time.perf_counter()
        ticket = engine.prefill_prefix(user, h.prefix(40))
        rec.record_prefill("admitted" if ticket.admitted else "declined", time.perf_counter() - t0)
        for _ in range(2):
            t0 = time.perf_counter()
            engine.rank_with_prefix(user, h, cands, ticket=ticket)
            rec.record_ranking(time.perf_counter() - t0)
        rec.record_engine(engine.stats())
    text = generate_latest(registry).decode()
    stats = engine.stats()
    for key in ("rank_requests", "hbm_hits", "recomputes", "prefills", "cached_tokens", "computed_tokens"):
        assert samples(text, f"relaygr_engine_{key}_total") == [({}, float(stats[key]))], key
    assert stats["rank_requests"] == 6 and stats["hbm_hits"] == 6
    assert samples(text, "relaygr_rank_latency_ms_count") == [({}, 6.0)]
    assert samples(text, "relaygr_prefill_requests_total") == [({"outcome": "admitted"}, 3.0)]
    assert samples(text, "relaygr_cache_free_pages") == [({}, float(stats["pool_free_pages"]))]
    rec.record_engine(engine.stats())  # no new work: the counters do not move
    assert samples(generate_latest(registry).decode(), "relaygr_engine_rank_requests_total") == [({}, 6.0)]


@pytest.mark.ray
@pytest.mark.skipif(not (HAS_RAY and HAS_PROM), reason="ray[serve] is not installed (pip install "
                                                         "'relaygr-engine[ray]')")
def test_a_serve_replica_exports_its_metrics_on_rays_metrics_port():
    from relaygr_engine.serving.client import RelayClient
    from relaygr_engine.serving.ray_serve import DEPLOYMENT_NAME, ReplicaSpec, run

    metrics_port = server_port()
    spec = ReplicaSpec(model=CFG, seed=0, cache=rg.CacheConfig(page_size=16, num_pages=64, lease_ttl_s=600.0))
    with local_ray(_metrics_export_port=metrics_port):
        client = RelayClient(run(spec, num_replicas=1, num_cpus=0.5, port=server_port(), app_name="relaygr_metrics",
                                 route_prefix=None))
        cands = torch.arange(4)
        for user in range(2):
            h = history(user, 40)
            pre = client.prefill(user, h.prefix(32))
            res = client.rank(user, h, cands, ticket=pre)
            assert res.source == "hbm"
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        end = time.monotonic() + 120
        while True:  # Ray's metrics agent exports what the replica recorded every few seconds
            status, raw = http_get(url)
            text = raw.decode() if status == 200 else ""  # the agent may not listen yet
            ranks = samples(text, "ray_relaygr_engine_rank_requests_total")
            if ranks and ranks[0][1] >= 2:
                break
            assert time.monotonic() < end, f"no relaygr metrics at {url} after 120 s"
            time.sleep(2)
    labels, value = ranks[0]
    assert value == 2.0 and labels["deployment"] == DEPLOYMENT_NAME and labels["application"] == "relaygr_metrics"
    assert samples(text, "ray_relaygr_engine_hbm_hits_total")[0][1] == 2.0
    hist = samples(text, "ray_relaygr_rank_latency_ms_count")
    assert hist and hist[0][1] == 2.0
    prefill = {s[0]["outcome"]: s[1] for s in samples(text, "ray_relaygr_prefill_requests_total")}
    assert prefill == {"admitted": 2.0}
    assert re.search(r"^# TYPE ray_relaygr_rank_latency_ms histogram$", text, re.M)
