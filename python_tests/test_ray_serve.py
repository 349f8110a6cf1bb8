"""Scale-out on Ray Serve, without a cluster: route keys, the JSON wire format, the replica class and the client's
forwarding logic (the local 2-replica Serve app: test_ray_serve_app.py)."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.policy.affinity import AffinityRouter, ForwardResult, rank_replicas
from relaygr_engine.serving import wire
from relaygr_engine.serving.ray_serve import RelayReplica, ReplicaSpec
from relaygr_engine.serving.route_key import RouteKey, route_order
from serve_helpers import CFG, SEED, candidates, history, needs_ray


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
