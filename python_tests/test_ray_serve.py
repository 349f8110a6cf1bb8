"""Scale-out on Ray Serve: route keys, the JSON wire format, the replica class, and a local 2-replica Serve app
(affinity of pre-infer and ranking, rejection-based forwarding, exact scores through a replica failure)."""
from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.policy.affinity import AffinityRouter, ForwardResult, rank_replicas
from relaygr_engine.serving import wire
from relaygr_engine.serving.ray_serve import RelayReplica, ReplicaSpec
from relaygr_engine.serving.route_key import RouteKey, route_order
from ray_local import local_ray, server_port, wait_for_http

HAS_RAY = importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="ray[serve] is not installed (pip install 'relaygr-engine[ray]')")

CFG = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=32, num_heads=2, head_dim=16, num_items=500,
                       num_actions=4, max_seq_len=256, num_tasks=2)
SEED = 3


def history(user: int, length: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(1000 + user)
    return rg.Behaviors(item_ids=torch.randint(0, CFG.num_items, (length,), generator=g),
                        action_ids=torch.randint(0, CFG.num_actions, (length,), generator=g),
                        timestamps=1_700_000_000 + torch.arange(length) * 60)


def candidates(user: int, n: int = 6) -> torch.Tensor:
    return torch.randint(0, CFG.num_items, (n,), generator=torch.Generator().manual_seed(5000 + user))


# ---------------------------------------------------------------------------------------------------- route keys
def test_route_key_round_trips_and_names_bad_fields():
    for key in (RouteKey(7), RouteKey(7, prefill=True), RouteKey(2 ** 64 - 1, at="ab12"),
                RouteKey(9, prefill=True, skip=("ab", "cd"))):
        assert RouteKey.parse(key.encode()) == key
    assert RouteKey.parse("7;prefill;skip=ab,cd").encode() == "7;prefill;skip=ab,cd"
    assert RouteKey.parse(" 7 ;at=x1") == RouteKey(7, at="x1")
    with pytest.raises(ValueError, match="user_id"):
        RouteKey.parse("u7;prefill")
    with pytest.raises(ValueError, match="route key field"):
        RouteKey.parse("7;pin=ab")
    with pytest.raises(ValueError, match="at must be a replica id"):
        RouteKey(7, at="a;b")
    with pytest.raises(ValueError, match="user_id"):
        RouteKey(2 ** 64)


def test_route_order_is_the_affinity_router_order():
    replicas = ["r0", "r1", "r2", "r3"]
    local = AffinityRouter(replicas)
    for u in range(200):
        assert route_order(RouteKey(u), replicas, {}) == rank_replicas(u, replicas)
        assert route_order(RouteKey(u, prefill=True), replicas, {})[0] == local.route(u)


def test_route_order_pins_ticket_replica_while_alive():
    replicas = ["r0", "r1", "r2"]
    busy = {r: {"inflight_prefills": 50, "inflight_ranks": 50} for r in replicas}
    for u in range(50):
        other = rank_replicas(u, replicas)[-1]
        assert route_order(RouteKey(u, at=other), replicas, busy) == [other]  # whatever its load
        gone = [r for r in replicas if r != other]
        assert route_order(RouteKey(u, at=other), gone, {}) == rank_replicas(u, gone)  # re-routed when it left
        assert route_order(RouteKey(u, at=other, skip=(other,)), replicas, {}) == rank_replicas(u, gone)


def test_route_order_bounds_load_and_passes_over_full_replicas_for_prefill():
    replicas = ["r0", "r1", "r2"]
    for u in range(50):
        home, second, third = rank_replicas(u, replicas)
        loaded = {home: {"inflight_prefills": 0, "inflight_ranks": 9}}
        assert route_order(RouteKey(u), replicas, loaded)[0] == second  # 10 > ceil(1.25 * 10 / 3)
        assert route_order(RouteKey(u, prefill=True), replicas, loaded)[0] == home  # pre-infer load only
        full = {home: {"accepts_prefill": False}}
        assert route_order(RouteKey(u, prefill=True), replicas, full) == [second, third, home]
        assert route_order(RouteKey(u), replicas, full)[0] == home  # rankings are never refused pages
        assert route_order(RouteKey(u, prefill=True, skip=(home,)), replicas, {}) == [second, third]
        # every replica skipped: offer them all again (the caller sees the rejection repeated and stops)
        assert route_order(RouteKey(u, prefill=True, skip=tuple(replicas)), replicas, {}) == [home, second, third]


# ---------------------------------------------------------------------------------------------------- wire format
def test_wire_round_trip_and_errors():
    h = history(1, 20)
    body = json.loads(json.dumps({"user_id": 1, **wire.behaviors_to_json(h)}))
    back = wire.behaviors_from_json(body)
    for name in ("item_ids", "action_ids", "timestamps"):
        assert torch.equal(getattr(back, name), getattr(h, name))
    assert back.context_ids is None
    t = rg.PrefixTicket(True, "admitted", 2 ** 64 - 5, 2 ** 64 - 1, 20, 12.5, 0, 20)
    js = json.loads(json.dumps(wire.ticket_to_json(t, "ab")))
    assert wire.ticket_from_json(js) == (t, "ab")
    with pytest.raises(ValueError, match="item_ids"):
        wire.behaviors_from_json({"user_id": 1})
    with pytest.raises(ValueError, match="timestamps must be a list of integers"):
        wire.behaviors_from_json({"item_ids": [1, 2], "timestamps": [1.5, 2]})
    with pytest.raises(ValueError, match="item_ids must be a list of integers"):
        wire.behaviors_from_json({"item_ids": [1, True]})
    with pytest.raises(ValueError, match="candidates"):
        wire.candidates_from_json({"item_ids": [1]})
    with pytest.raises(ValueError, match="fingerprint"):
        wire.ticket_from_json({k: v for k, v in js.items() if k != "fingerprint"})


# ---------------------------------------------------------------------------------------------------- replica class
def test_replica_serves_exact_scores_and_rejects_what_it_cannot_take():
    spec = ReplicaSpec(model=dict(CFG.__dict__, attention="hstu"), seed=SEED,
                       cache=dict(num_pages=8, max_pinned_fraction=0.5, lease_ttl_s=600.0), max_pending_prefills=1)
    threads = torch.get_num_threads()
    try:
        rep = RelayReplica(spec)  # sets torch threads (spec.torch_threads) for the process it runs in
    finally:
        torch.set_num_threads(threads)
    model = rg.build_ranker(CFG, seed=SEED)
    h, c = history(1, 40), candidates(1)

    async def go():
        body = {"user_id": 1, **wire.behaviors_to_json(h.prefix(30))}
        pre = await rep.prefill(body)
        assert pre["admitted"] and not pre["rejected"] and pre["ticket"]["replica"] == rep.replica_id
        assert pre["route_key"] == f"1;at={rep.replica_id}"
        # 2 of the 4 pages the leases may pin are taken: a 4-page prefix is rejected (the caller forwards it)
        other = await rep.prefill({"user_id": 2, **wire.behaviors_to_json(history(2, 60))})
        assert other == dict(other, admitted=False, rejected=True, reason="pool_full", ticket=None)
        assert rep.record_routing_stats()["accepts_prefill"]  # 2 of 4 pinned pages: a short one still fits
        full = await rep.prefill({"user_id": 4, **wire.behaviors_to_json(history(4, 32))})
        assert full["admitted"] and not rep.record_routing_stats()["accepts_prefill"]
        rank_body = {"user_id": 1, **wire.behaviors_to_json(h), "candidates": c.tolist(), "ticket": pre["ticket"]}
        res = await rep.rank(json.loads(json.dumps(rank_body)))
        assert res["source"] == "hbm" and res["cached_tokens"] == 30 and res["ticket_used"]
        assert (torch.tensor(res["scores"]) - model.rank_full(h, c)).abs().max().item() <= 1e-4
        foreign = dict(pre["ticket"], replica="elsewhere")
        res2 = await rep.rank({"user_id": 1, **wire.behaviors_to_json(h), "candidates": c.tolist(),
                               "ticket": foreign})
        assert not res2["ticket_used"] and res2["scores"] == res["scores"]
        # a pre-infer arriving while one is pending is rejected at once (max_pending_prefills=1)
        await rep.rank({"user_id": 4, **wire.behaviors_to_json(history(4, 32)), "candidates": c.tolist(),
                        "ticket": full["ticket"]})  # frees the pinned budget
        assert rep.record_routing_stats()["accepts_prefill"]
        rep._inflight_prefills = 1
        assert not rep.record_routing_stats()["accepts_prefill"]
        busy = await rep.prefill({"user_id": 3, **wire.behaviors_to_json(history(3, 10))})
        assert busy["rejected"] and busy["reason"] == "replica:busy"
        rep._inflight_prefills = 0
        with pytest.raises(ValueError, match="candidates"):
            await rep.rank({"user_id": 1, **wire.behaviors_to_json(h)})
        s = await rep.stats()
        assert s["replica_foreign_tickets"] == 1 and s["replica_busy_rejections"] == 1
        assert s["replica_prefill_rejections"] == 2 and s["hbm_hits"] == 3  # a ticket is not needed to hit

    asyncio.run(go())


def test_replica_spec_checks_fields():
    with pytest.raises(ValueError, match="unknown fields"):
        ReplicaSpec(model=dict(num_layerz=2))
    with pytest.raises(ValueError, match="torch_threads"):
        ReplicaSpec(model=CFG, torch_threads=0)
    with pytest.raises(ValueError, match="cache must be a CacheConfig"):
        ReplicaSpec(model=CFG, cache="cpu")


# ---------------------------------------------------------------------------------------------------- client logic
class FakeServe:
    """A DeploymentHandle stand-in: places a request by ``route_order`` over the live replicas (as the Serve
    router does) and answers like a replica: pre-infers rejected by replicas in ``full``; a ranking on a replica in
    ``dies`` kills it mid-request (RayActorError) and removes it from the live set."""

    def __init__(self, replicas, full=(), dies=(), tick=0.0) -> None:
        self.live, self.full, self.dies = list(replicas), set(full), set(dies)
        self.now, self.tick, self.keys = 0.0, tick, []

    def clock(self) -> float:
        return self.now

    def options(self, *, method_name, session_id):
        return _FakeCall(self, method_name, RouteKey.parse(session_id))

    def serve(self, method, key, body):
        self.keys.append(key)
        self.now += self.tick
        replica = route_order(key, self.live, {})[0]
        if method == "prefill":
            reason = "pool_full" if replica in self.full else "admitted"
            t = rg.PrefixTicket(reason == "admitted", reason, key.user_id, 1, len(body["item_ids"]), None)
            return wire.prefill_reply(t, replica, key.user_id)
        if replica in self.dies:
            self.dies.discard(replica)
            self.live.remove(replica)
            from ray.exceptions import ActorDiedError
            raise ActorDiedError()
        hit = body.get("ticket", {}).get("replica") == replica
        res = rg.RankResult(torch.zeros(len(body["candidates"]), 2), "hbm" if hit else "recompute", 0, 1)
        return wire.rank_reply(res, replica, hit)


class _FakeCall:
    def __init__(self, fake, method, key) -> None:
        self.fake, self.method, self.key = fake, method, key

    def remote(self, *args):
        fake, method, key = self.fake, self.method, self.key

        class Response:
            def result(self):
                return fake.serve(method, key, *args)
        return Response()


@needs_ray
def test_client_forwards_rejected_prefill_down_the_users_order():
    from relaygr_engine.serving.client import RelayClient

    replicas = ["ra", "rb", "rc"]
    u = 11
    x, y, z = rank_replicas(u, replicas)
    fake = FakeServe(replicas, full=(x, y))
    client = RelayClient(fake, retry_backoff_s=0.0, clock=fake.clock)
    pre = client.prefill(u, history(u, 10))
    assert pre.admitted and pre.replica == z and pre.ticket["replica"] == z
    assert pre.forward == ForwardResult(replica=z, value=pre.forward.value, attempts=3, rejected=(x, y))
    assert [k.skip for k in fake.keys] == [(), (x,), (x, y)] and all(k.prefill for k in fake.keys)
    # every replica full: the router has none left to offer (it repeats one), the pre-infer does not land
    fake.full = set(replicas)
    none = client.prefill(u, history(u, 10))
    assert not none.admitted and none.replica is None and none.reason == "pool_full"
    assert none.forward.rejected == (x, y, z) and not none.forward.landed and not none.forward.expired
    s = client.stats()
    assert (s["prefills"], s["prefill_admitted"], s["prefill_forwarded"], s["prefill_rejections"],
            s["prefill_not_landed"]) == (2, 1, 2, 5, 1)


@needs_ray
def test_client_prefill_forwarding_stops_at_the_deadline():
    from relaygr_engine.serving.client import RelayClient

    fake = FakeServe(["ra", "rb", "rc"], full=("ra", "rb", "rc"), tick=1.0)  # each attempt takes 1 s
    client = RelayClient(fake, retry_backoff_s=0.0, clock=fake.clock)
    pre = client.prefill(5, history(5, 10), deadline_s=1.5)
    assert pre.forward.expired and pre.forward.attempts == 2 and pre.replica is None
    assert client.stats()["prefill_expired"] == 1


@needs_ray
def test_client_reroutes_a_ranking_whose_replica_died():
    from relaygr_engine.serving.client import RelayClient

    replicas = ["ra", "rb", "rc"]
    u = 23
    home, second, _ = rank_replicas(u, replicas)
    fake = FakeServe(replicas, dies=(home,))
    client = RelayClient(fake, retry_backoff_s=0.0, clock=fake.clock)
    pre = client.prefill(u, history(u, 10))
    assert pre.replica == home
    res = client.rank(u, history(u, 12), candidates(u), ticket=pre)  # home dies while serving it
    assert res.replica == second and res.rerouted and res.sends == 2 and res.source == "recompute"
    assert [str(k) for k in fake.keys[1:]] == [f"{u};at={home}", f"{u};skip={home}"]
    # the ticket's replica already gone: the router places the user anew (no failure seen by the client)
    again = client.rank(u, history(u, 12), candidates(u), ticket=pre)
    assert again.replica == second and again.rerouted and again.sends == 1
    s = client.stats()
    assert (s["reroutes"], s["recomputes_after_failure"], s["resends"], s["replica_failures"]) == (2, 2, 1, 1)
    ok = client.rank(u, history(u, 12), candidates(u), ticket=client.prefill(u, history(u, 10)))
    assert ok.replica == second and ok.source == "hbm" and not ok.rerouted


def test_cli_rejects_bad_arguments_before_starting_ray(capsys):
    from relaygr_engine.serving.cli import main

    for argv, says in ((["--replicas", "0"], "argument --replicas: expected an integer >= 1, got 0"),
                       (["--model", '{"num_layerz": 2}'], "unknown fields"),
                       (["--load-factor", "0.5"], "argument --load-factor: expected a number >= 1, got 0.5"),
                       (["--device", "tpu"], "argument --device: invalid choice"),
                       (["--address", "auto", "--metrics-port", "9000"], "--metrics-port sets the port")):
        with pytest.raises(SystemExit) as ex:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert ex.value.code == 2 and len(err) == 1 and says in err[0], err


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


def _exact(model, h, c, scores) -> float:
    return (scores - model.rank_full(h, c)).abs().max().item()


def _post(port: int, path: str, body: dict, key: str):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "x-session-id": key}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


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
