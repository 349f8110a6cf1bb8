"""The lean HTTP path without Ray: compact arrays, rankings by difference (their 409 and full resend), the engine
gate's order, the inline body header, and the HTTP client against the replica's own handler."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.serving import wire
from relaygr_engine.serving.gate import EngineGate
from relaygr_engine.serving.http_ingress import BODY_HEADER, BODY_HEADER_MAX_BYTES
from relaygr_engine.serving.prefix_store import PrefixStore
from relaygr_engine.serving.ray_serve import RelayReplica, ReplicaSpec
from serve_helpers import CFG, SEED, candidates, history

ATOL = 1e-5


# ---------------------------------------------------------------------------------------------------- wire
def test_b64le_arrays_round_trip_and_keep_the_limits():
    h = history(1, 40)
    body = json.loads(json.dumps({"user_id": 1, **wire.behaviors_to_json(h, "b64le")}))
    assert body["encoding"] == "b64le" and isinstance(body["item_ids"], str)
    back = wire.behaviors_from_json(body, max_history=40)
    for name in ("item_ids", "action_ids", "timestamps"):
        assert torch.equal(getattr(back, name), getattr(h, name))
    with pytest.raises(ValueError, match="at most max_history=39 entries"):
        wire.behaviors_from_json(body, max_history=39)
    with pytest.raises(ValueError, match="base64 string of little-endian int64"):
        wire.behaviors_from_json(dict(body, item_ids="not base64!"))
    with pytest.raises(ValueError, match="multiple of 8 bytes"):
        wire.behaviors_from_json(dict(body, item_ids="AAAA"))
    with pytest.raises(ValueError, match="item_ids must be a list"):  # JSON lists without the encoding
        wire.behaviors_from_json(dict(body, encoding="json"))
    with pytest.raises(ValueError, match="encoding must be one of json, b64le"):
        wire.behaviors_from_json(dict(body, encoding="msgpack"))


def test_history_digest_names_the_tokens():
    h = history(2, 30)
    assert wire.history_digest(h, 20) == wire.history_digest(h.prefix(20))
    assert wire.history_digest(h, 20) != wire.history_digest(h, 21)
    other = rg.Behaviors(h.item_ids.clone(), h.action_ids.clone(), h.timestamps.clone())
    other.item_ids[3] += 1
    assert wire.history_digest(other, 20) != wire.history_digest(h, 20)
    assert wire.history_digest(other, 3) == wire.history_digest(h, 3)


# ---------------------------------------------------------------------------------------------------- prefix store
def _ticket(user: int, fp: int, n: int, expires: float = 100.0) -> rg.PrefixTicket:
    return rg.PrefixTicket(True, "admitted", user, fp, n, expires, 0, n)


def test_prefix_store_rebuilds_the_exact_history_or_asks_for_it():
    h = history(3, 50)
    store = PrefixStore(max_entries=2)
    t = _ticket(3, 11, 40)
    store.keep(t, h.prefix(40), now=0.0)
    tail = rg.Behaviors(h.item_ids[40:], h.action_ids[40:], h.timestamps[40:])
    full = store.rebuild(t, 40, wire.history_digest(h, 40), tail, now=1.0)
    assert (full.token_keys() == h.token_keys()).all()
    with pytest.raises(wire.NeedFullHistory) as e:
        store.rebuild(t, 40, "0" * 32, tail, now=1.0)
    assert e.value.reason == "digest_mismatch"
    with pytest.raises(wire.NeedFullHistory) as e:
        store.rebuild(_ticket(3, 12, 40), 40, wire.history_digest(h, 40), tail, now=1.0)
    assert e.value.reason == "unknown_ticket"
    with pytest.raises(wire.NeedFullHistory):  # its lease ran out
        store.rebuild(t, 40, wire.history_digest(h, 40), tail, now=100.0)
    for fp in (1, 2, 3):  # bounded: the oldest go first
        store.keep(_ticket(3, fp, 40), h.prefix(40), now=0.0)
    assert len(store) == 2 and store.stats()["prefix_store_dropped"] == 1


# ---------------------------------------------------------------------------------------------------- gate
def _until(predicate, what: str) -> None:
    """Wait for another thread to reach a state (bounded; fails naming it)."""
    done = threading.Event()
    for _ in range(20000):
        if predicate():
            return
        done.wait(0.001)
    pytest.fail(f"timed out waiting until {what}")


def test_gate_serves_rankings_first_and_drops_superseded_prefills():
    gate, order, release = EngineGate(), [], threading.Event()

    def hold():
        with gate.ranking(0):
            order.append("running")
            release.wait(30)

    def prefill(user):
        with gate.prefill(user) as (go, _):
            order.append(f"prefill{user}" if go else f"dropped{user}")

    def rank(user):
        with gate.ranking(user):
            order.append(f"rank{user}")

    threads = [threading.Thread(target=hold)]
    threads[0].start()
    _until(lambda: order == ["running"], "the first ranking holds the gate")
    for target, user in ((prefill, 1), (prefill, 2)):
        threads.append(threading.Thread(target=target, args=(user,)))
        threads[-1].start()
    _until(lambda: sum(gate._pending.values()) == 2, "two pre-infers wait")
    threads.append(threading.Thread(target=rank, args=(2,)))
    threads[-1].start()
    _until(lambda: gate._ranks_waiting == 1, "a ranking waits")
    release.set()
    for t in threads:
        t.join(30)
    assert order[:2] == ["running", "rank2"]  # before the pre-infers that came first
    assert sorted(order[2:]) == ["dropped2", "prefill1"]  # user 2's ranking came: its pre-infer is dropped
    assert gate.stats()["gate_superseded_prefills"] == 1


# ---------------------------------------------------------------------------------------------------- replica
class _Request:
    """A Starlette request for the replica's handler, the body in the body or in the inline header."""

    def __init__(self, path: str, body: dict, key: str = "", inline: bool = False, extra: bytes = b"") -> None:
        from starlette.requests import Request

        raw = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"x-session-id", key.encode())]
        if inline:
            headers += [(BODY_HEADER.encode(), raw), (b"content-length", str(len(extra)).encode())]
            raw = extra
        else:
            headers.append((b"content-length", str(len(raw)).encode()))
        sent = [False]

        async def receive():
            first, sent[0] = not sent[0], True
            return {"type": "http.request", "body": raw if first else b"", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"",
                 "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000)}
        self.request = Request(scope, receive)


@pytest.fixture(scope="module")
def replica():
    pytest.importorskip("starlette", reason="starlette (installed with ray[serve]) builds the handler's requests")
    threads = torch.get_num_threads()
    try:
        rep = RelayReplica(ReplicaSpec(model=CFG, seed=SEED, cache=dict(num_pages=64), max_kept_prefixes=8))
    finally:
        torch.set_num_threads(threads)
    return rep, rg.build_ranker(CFG, seed=SEED)


def _call(rep, req: _Request):
    resp = asyncio.run(rep(req.request))
    return resp.status_code, json.loads(resp.body), resp.headers.get("server-timing", "")


def test_replica_ranks_by_difference_exactly_and_409s_without_changing_state(replica):
    rep, model = replica
    h, c = history(21, 60), candidates(21)
    status, pre, timing = _call(rep, _Request("/prefill", {"user_id": 21, **wire.behaviors_to_json(h.prefix(48),
                                                                                                   "b64le")}))
    assert status == 200 and pre["admitted"] and "engine;dur=" in timing
    tail = rg.Behaviors(h.item_ids[48:], h.action_ids[48:], h.timestamps[48:])
    body = {"user_id": 21, **wire.behaviors_to_json(tail, "b64le"), "candidates": wire.ids_to_json(c, "b64le"),
            "ticket": pre["ticket"], "prefix": {"num_tokens": 48, "digest": wire.history_digest(h, 48)}}
    before = rep.engine.stats()
    status, reply, _ = _call(rep, _Request("/rank", dict(body, prefix={"num_tokens": 48, "digest": "0" * 32}),
                                           inline=True))
    assert status == 409 and reply["need_full_history"] and reply["reason"] == "digest_mismatch"
    assert rep.engine.stats() == before  # refused before the engine saw it
    status, reply, _ = _call(rep, _Request("/rank", body, inline=True))
    assert status == 200 and reply["source"] == "hbm" and reply["ticket_used"]
    assert float((wire.scores_from_json(reply) - model.rank_full(h, c)).abs().max()) < ATOL
    status, reply, _ = _call(rep, _Request("/rank", body))  # the lease ended with that ranking: unknown now
    assert status == 409 and reply["reason"] == "unknown_ticket"


def test_replica_full_inference_and_inline_header_limits(replica):
    rep, model = replica
    h, c = history(22, 40), candidates(22)
    body = {"user_id": 22, **wire.behaviors_to_json(h), "candidates": c.tolist(), "full_inference": True}
    before = rep.engine.stats()["rank_requests"]
    status, reply, _ = _call(rep, _Request("/rank", body, inline=True))
    assert status == 200 and reply["source"] == "full"
    assert float((torch.tensor(reply["scores"]) - model.rank_full(h, c)).abs().max()) < ATOL
    assert rep.engine.stats()["rank_requests"] == before  # the cache was not touched
    status, reply, _ = _call(rep, _Request("/rank", body, inline=True, extra=b"{}"))
    assert status == 400 and "must have an empty body" in reply["error"]
    big = dict(body, candidates=[1] * (BODY_HEADER_MAX_BYTES // 2))
    status, reply, _ = _call(rep, _Request("/rank", big, inline=True))
    assert status == 413 and f"at most {BODY_HEADER_MAX_BYTES} bytes" in reply["error"]
    ticket = wire.ticket_to_json(_ticket(22, 5, 10), rep.replica_id)
    status, reply, _ = _call(rep, _Request("/rank", dict(body, ticket=ticket)))
    assert status == 400 and "full_inference" in reply["error"]


def test_http_client_resends_the_whole_history_after_a_409(replica, monkeypatch):
    """The client's protocol against the replica's own handler (its transport replaced by a direct call)."""
    from relaygr_engine.serving.http_client import RelayHTTPClient

    rep, model = replica
    client = RelayHTTPClient("http://127.0.0.1:1/")

    def post(endpoint, body, key):
        inline = len(json.dumps(body)) <= client.inline_max_bytes
        status, reply, timing = _call(rep, _Request("/" + endpoint, body, key.encode(), inline=inline))
        return status, reply, {"client_ms": 0.0}

    monkeypatch.setattr(client, "post", post)
    h, c = history(23, 64), candidates(23)
    pre = client.prefill(23, h.prefix(50))
    assert pre.admitted and pre.replica == rep.replica_id
    r = client.rank(23, h, c, pre)
    assert r.by_difference and not r.resent_full and r.source == "hbm"
    assert float((r.scores - model.rank_full(h, c)).abs().max()) < ATOL
    pre = client.prefill(23, h.prefix(50))
    changed = rg.Behaviors(torch.cat([h.item_ids[:1] + 1, h.item_ids[1:]]), h.action_ids, h.timestamps)
    r = client.rank(23, changed, c, pre)  # not the history pre-inferred: 409, then whole, still exact
    assert r.resent_full and not r.by_difference
    assert float((r.scores - model.rank_full(changed, c)).abs().max()) < ATOL
    assert client.stats()["rank_full_resends"] == 1 and client.stats()["rank_by_difference"] == 1


def test_replica_pre_infers_in_chunks_judged_once_on_the_whole_prefix():
    from relaygr_engine.serving.chunked_prefill import chunk_targets

    assert chunk_targets(0, 50, 16) == [16, 32, 48, 50] and chunk_targets(20, 50, 16) == [36, 50]
    assert chunk_targets(0, 50, 0) == [50] and chunk_targets(60, 50, 16) == [50]
    threads = torch.get_num_threads()
    try:
        rep = RelayReplica(ReplicaSpec(model=CFG, seed=SEED, cache=dict(num_pages=64), prefill_chunk_tokens=16,
                                       trigger=dict(slo_ms=100.0, margin=1e-6, expected_candidates=6)))
    finally:
        torch.set_num_threads(threads)
    model = rg.build_ranker(CFG, seed=SEED)
    h, c = history(24, 60), candidates(24)
    status, pre, _ = _call(rep, _Request("/prefill", {"user_id": 24, **wire.behaviors_to_json(h.prefix(48))}))
    assert status == 200 and pre["admitted"] and pre["ticket"]["num_tokens"] == 48
    s = rep.engine.stats()
    assert s["prefills"] == 3 and s["trigger_admits"] == 1  # three chunks, one decision on the whole prefix
    status, reply, _ = _call(rep, _Request("/rank", {"user_id": 24, **wire.behaviors_to_json(h),
                                                     "candidates": c.tolist(), "ticket": pre["ticket"]}))
    assert status == 200 and reply["source"] == "hbm" and reply["cached_tokens"] == 48
    assert float((torch.tensor(reply["scores"]) - model.rank_full(h, c)).abs().max()) < ATOL
