"""Scale-out on Ray Serve: a local 2-replica Serve app (affinity of pre-infer and ranking, rejection-based
forwarding, exact scores through a replica failure)."""
from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.policy.affinity import rank_replicas
from relaygr_engine.serving import wire
from relaygr_engine.serving.ray_serve import ReplicaSpec
from relaygr_engine.serving.route_key import RouteKey
from ray_local import local_ray, server_port, wait_for_http
from serve_helpers import CFG, SEED, _exact, _post, candidates, history, needs_ray


# ---------------------------------------------------------------------------------------------------- Ray Serve app
NUM_USERS = 40


@pytest.fixture(scope="module")
def app():
    """A local Ray instance (2 CPUs, loopback) with the app on 2 replicas; always shut down."""
    from relaygr_engine.serving.client import RelayClient
    from relaygr_engine.serving.ray_serve import run

    port = server_port()
    spec = ReplicaSpec(model=CFG, seed=SEED, torch_threads=1,
                       cache=rg.CacheConfig(page_size=16, num_pages=256, max_pinned_fraction=0.5,
                                            lease_ttl_s=600.0))
    with local_ray(env={"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}) as ray:
        handle = run(spec, num_replicas=2, num_cpus=0.5, host="127.0.0.1", port=port, stats_period_s=0.2,
                     app_name="relaygr_test", route_prefix="/relay")
        yield {"client": RelayClient(handle, forward_deadline_s=30.0), "port": port, "ray": ray,
               "model": rg.build_ranker(CFG, seed=SEED)}


@pytest.mark.ray
@needs_ray
def test_http_prefill_then_rank_on_the_same_replica(app):
    port, model = app["port"], app["model"]
    for u in (900, 901, 902):
        h, c = history(u, 50), candidates(u)
        status, pre = _post(port, "/relay/prefill", {"user_id": u, **wire.behaviors_to_json(h.prefix(40))},
                            RouteKey(u, prefill=True).encode())
        assert status == 200 and pre["admitted"], pre
        body = {"user_id": u, **wire.behaviors_to_json(h), "candidates": c.tolist(), "ticket": pre["ticket"]}
        status, res = _post(port, "/relay/rank", body, pre["route_key"])
        assert status == 200 and res["replica"] == pre["replica"] and res["source"] == "hbm", res
        assert res["cached_tokens"] == 40 and _exact(model, h, c, torch.tensor(res["scores"])) <= 1e-4
    status, err = _post(port, "/relay/rank", {"user_id": 1, "item_ids": [1, 2]}, "1")
    assert status == 400 and "candidates" in err["error"]
    with pytest.raises(ValueError, match="candidates"):  # through the handle, bad input raises the replica's error
        app["client"].rank(1, history(1, 10), torch.tensor([CFG.num_items]))


@pytest.mark.ray
@needs_ray
def test_cli_deploys_an_app_that_serves_http(app, capsys):
    from relaygr_engine.serving.cli import main

    port, model = app["port"], app["model"]
    model_json = json.dumps({k: v for k, v in CFG.__dict__.items() if k != "attention"})
    argv = ["--replicas", "1", "--replica-cpus", "0.25", "--app-name", "relaygr_cli", "--route-prefix", "/cli",
            "--port", str(port), "--model", model_json, "--seed", str(SEED), "--num-pages", "64",
            "--lease-ttl-s", "600", "--duration", "600"]
    out, stop = {}, threading.Event()  # the test's requests end the server, not a clock
    th = threading.Thread(target=lambda: out.setdefault("rc", main(argv, stop=stop)))
    th.start()
    try:
        wait_for_http(f"http://127.0.0.1:{port}/cli/stats", th.is_alive, lambda: "".join(capsys.readouterr()),
                      timeout_s=180)
        h, c = history(77, 30), candidates(77)
        status, pre = _post(port, "/cli/prefill", {"user_id": 77, **wire.behaviors_to_json(h.prefix(20))},
                            "77;prefill")
        assert status == 200 and pre["admitted"]
        status, res = _post(port, "/cli/rank", {"user_id": 77, **wire.behaviors_to_json(h), "candidates": c.tolist(),
                                                "ticket": pre["ticket"]}, pre["route_key"])
        assert status == 200 and res["replica"] == pre["replica"] and res["source"] == "hbm"
        assert _exact(model, h, c, torch.tensor(res["scores"])) <= 1e-4
    finally:
        stop.set()
        th.join(timeout=120)
    assert out.get("rc") == 0
    printed = capsys.readouterr().out
    assert f"HTTP http://127.0.0.1:{port}/cli/" in printed and "x-session-id" in printed
    from ray import serve
    assert "relaygr_cli" not in serve.status().applications  # deleted on exit; the cluster's Serve keeps running


@pytest.mark.ray
@needs_ray
def test_prefill_is_forwarded_when_the_home_replica_rejects(app):
    client, model = app["client"], app["model"]
    seen: dict = {}  # learn the two replica ids from where short pre-infers land
    for u in itertools.count(4000):
        pre = client.prefill(u, history(u, 20))
        seen[u] = pre.replica
        client.rank(u, history(u, 20), candidates(u), ticket=pre)  # ends its lease
        if len(set(seen.values())) == 2:
            break
    x, y = sorted(set(seen.values()))

    def homed_at(r):  # users whose rendezvous home is replica r
        return (u for u in itertools.count(5000) if rank_replicas(u, [x, y])[0] == r)

    homed = {x: homed_at(x), y: homed_at(y)}

    # A replica's leases may pin 128 pages; a 240-token prefix takes 15, so 8 fit. Ten users homed at x: the
    # first 8 land there, x rejects the next two (pool_full) and they are forwarded to y.
    on_x = [next(homed[x]) for _ in range(10)]
    pres = {u: client.prefill(u, history(u, 250).prefix(240)) for u in on_x}
    assert [pres[u].replica for u in on_x] == [x] * 8 + [y] * 2
    for u in on_x[8:]:
        assert pres[u].admitted and pres[u].forward.rejected == (x,) and pres[u].forward.attempts == 2
    # y holds 2 of them: 6 of its own users fit, the 7th is rejected by y, then by x: it does not land
    on_y = [next(homed[y]) for _ in range(7)]
    pres.update({u: client.prefill(u, history(u, 250).prefix(240)) for u in on_y})
    assert [pres[u].replica for u in on_y] == [y] * 6 + [None]
    last = pres[on_y[-1]]
    assert not last.admitted and last.reason == "pool_full" and last.ticket is None
    assert last.forward.rejected == (y, x) and not last.forward.landed and not last.forward.expired

    # every user ranks exactly; the pre-inferred ones on the replica that holds their prefix (its cache)
    for u, pre in pres.items():
        h, c = history(u, 250), candidates(u)
        r = client.rank(u, h, c, ticket=pre)
        assert _exact(model, h, c, r.scores) <= 1e-4
        if pre.admitted:
            assert r.replica == pre.replica and r.source == "hbm" and r.cached_tokens == 240
    u = next(homed[x])
    after = client.prefill(u, history(u, 240))
    assert after.replica == x and after.forward.attempts == 1  # the rankings ended the leases: room again
    assert client.rank(u, history(u, 240), candidates(u), ticket=after).source == "hbm"


@pytest.mark.ray
@needs_ray
def test_affinity_and_exact_scores_through_a_replica_failure(app):
    client, model, ray = app["client"], app["model"], app["ray"]
    users = list(range(NUM_USERS))
    hist = {u: history(u, 32 + (u * 7) % 64) for u in users}
    cands = {u: candidates(u) for u in users}
    prefix = {u: hist[u].prefix(len(hist[u]) - 8) for u in users}
    with ThreadPoolExecutor(4) as pool:
        pres = dict(zip(users, pool.map(lambda u: client.prefill(u, prefix[u]), users)))
    assert all(p.admitted for p in pres.values()), {u: p.reason for u, p in pres.items() if not p.admitted}
    before = client.stats()

    # Rank the first half. Then, with the rest of the second half in flight, kill the replica holding the most of
    # the second half's prefixes, wait until it is gone, and rank its users (their tickets name the dead replica).
    first, second = users[: NUM_USERS // 2], users[NUM_USERS // 2:]
    counts: dict = {}
    for u in second:
        counts[pres[u].replica] = counts.get(pres[u].replica, 0) + 1
    victim = max(counts, key=counts.get)
    orphans = [u for u in second if pres[u].replica == victim]
    actor = ray.get_actor(client.describe(victim)["actor_name"], namespace="serve")
    results: dict = {}

    def rank(u):
        results[u] = client.rank(u, hist[u], cands[u], ticket=pres[u])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(rank, first))
        futures = [pool.submit(rank, u) for u in second if u not in orphans]
        ray.kill(actor, no_restart=True)
        end = time.monotonic() + 120
        while True:  # until requests to the victim fail or go elsewhere
            try:
                client.describe(victim)
            except (KeyError, ray.exceptions.RayActorError):
                break
            assert time.monotonic() < end, "the killed replica kept answering"
            time.sleep(0.05)
        futures += [pool.submit(rank, u) for u in orphans]
        for f in futures:
            f.result()  # no request lost: each returns scores

    assert sorted(results) == users
    for u in users:
        assert _exact(model, hist[u], cands[u], results[u].scores) <= 1e-4, u
    # every ranking whose ticket's replica was alive read the prefix from that replica's cache
    kept = [u for u in users if not results[u].rerouted]
    hits = [u for u in kept if results[u].source == "hbm" and results[u].replica == pres[u].replica]
    assert len(hits) >= 0.95 * len(kept) and len(kept) >= NUM_USERS // 2
    # users of the dead replica are re-routed and recomputed, and counted
    rerouted = [u for u in users if results[u].rerouted]
    assert rerouted == orphans and all(results[u].replica != victim for u in rerouted)
    stats = {k: v - before[k] for k, v in client.stats().items()}
    assert stats["reroutes"] == len(rerouted) >= 1
    assert all(results[u].source == "recompute" for u in rerouted)  # no live replica holds their prefixes
    assert stats["recomputes_after_failure"] == len(rerouted)
    # the dead replica's users are served again (on the survivor or Serve's replacement) with a working cache
    u = rerouted[0]
    again = client.prefill(u, hist[u])
    assert again.admitted and again.replica != victim
    r = client.rank(u, hist[u], cands[u], ticket=again)
    assert r.source == "hbm" and r.replica == again.replica
    assert _exact(model, hist[u], cands[u], r.scores) <= 1e-4
