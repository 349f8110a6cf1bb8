"""Randomised fault injection on the engine, on every pool implementation: seeded random interleavings of prefills
(single and batched), rankings (single and batched, with fresh, stale and foreign tickets), clock jumps that expire
leases, eviction pressure in tiny pools, DRAM spills and reloads, ``store_misses`` on and off, bad requests, and
injected failures (a forward that raises, DRAM copies that fail). After every step: each ranking returned scores
equal to the model's no-cache forward, only documented input errors (ValueError) and the injected failures escaped,
the pool's invariants hold and no page is left pinned by a finished call."""
from __future__ import annotations

import random

import pytest
import torch

import relaygr_engine as rg

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = rg.GRModelConfig(attention="hstu", num_layers=2, hidden_dim=16, num_heads=2, head_dim=8, num_items=200,
                       num_actions=3, max_seq_len=64, num_tasks=1, num_time_buckets=8)
USERS = 6
STEPS = 70
SEEDS = 6


class InjectedFault(RuntimeError):
    """A failure the test injects (never a documented input error)."""


class Faults:
    """One-shot failures, armed until they fire: the model's next forward, the DRAM tier's next allocation (a spill),
    the next copy back from DRAM (a reload)."""

    def __init__(self, engine: rg.RelayEngine) -> None:
        self.armed: set = set()
        model, dram, cache = engine.model, engine.dram, engine.cache
        forward = model.forward

        def faulty_forward(batch):
            self._fire("forward")
            return forward(batch)

        model.forward = faulty_forward
        if dram is not None:
            alloc, unpack = dram.alloc, cache.unpack
            dram.alloc = lambda *a, **k: (self._fire("alloc"), alloc(*a, **k))[1]
            cache.unpack = lambda *a, **k: (self._fire("unpack"), unpack(*a, **k))[1]

    def _fire(self, what: str) -> None:
        if what in self.armed:
            self.armed.discard(what)
            raise (MemoryError if what == "alloc" else InjectedFault)(f"injected {what} failure")


class Oracle:
    """The no-cache forward of each (history, candidates, request_time), computed once."""

    def __init__(self, model) -> None:
        self.model, self.memo = model, {}

    def check(self, hist: rg.Behaviors, cands: torch.Tensor, t_req, scores: torch.Tensor) -> None:
        key = (tuple(hist.item_ids.tolist()), tuple(hist.timestamps.tolist()), tuple(cands.tolist()), t_req)
        if key not in self.memo:
            with torch.inference_mode():
                self.memo[key] = self.model.rank_full(hist, cands, request_time=t_req)
        assert scores.shape == self.memo[key].shape
        assert float((scores - self.memo[key]).abs().max()) <= 1e-4


def user_history(user: int, length: int, rng: random.Random) -> rg.Behaviors:
    """The user's behaviors: a fixed sequence (so prefixes are shared), sometimes changed at the front."""
    g = torch.Generator().manual_seed(100 + user)
    items = torch.randint(0, CFG.num_items, (64,), generator=g)[:length].clone()
    if rng.random() < 0.1:
        items[0] = (items[0] + 1) % CFG.num_items  # a different history: shares nothing cached
    return rg.Behaviors(item_ids=items, action_ids=torch.randint(0, CFG.num_actions, (64,), generator=g)[:length],
                        timestamps=1_700_000_000 + 30 * torch.arange(length))


def run_interleaving(seed: int, store_misses: bool, dram: bool) -> dict:
    rng = random.Random(seed)
    model = rg.build_ranker(CFG, seed=seed % 3)
    cache = rg.CacheConfig(page_size=rng.choice([2, 4]), num_pages=rng.choice([6, 8, 12]), lease_ttl_s=2.0,
                           max_pinned_fraction=rng.choice([0.5, 1.0]), dram_bytes=(1 << 16) if dram else 0,
                           attention_backend="torch")
    engine = rg.RelayEngine(model, cache, store_misses=store_misses, extend_on_rank=rng.random() < 0.8)
    faults, oracle = Faults(engine), Oracle(model)
    tickets: dict = {}
    now, seen = 0.0, {"rankings": 0, "injected": 0, "input_errors": 0}

    def ranking(u: int):
        hist = user_history(u, rng.randint(1, 40), rng)
        cands = torch.randint(0, CFG.num_items, (rng.randint(1, 9),), generator=torch.Generator().manual_seed(u))
        t_req = rng.choice([None, 1_700_005_000])
        return rg.RankRequest(u, hist, cands, tickets.pop(u, None) if rng.random() < 0.7 else None, t_req)

    for _ in range(STEPS):
        op = rng.choices(["prefill", "prefill_batch", "rank", "rank_batch", "advance", "bad", "fault"],
                         weights=[3, 1, 4, 2, 2, 1, 2])[0]
        if op == "fault":
            faults.armed.add(rng.choice(["forward", "alloc", "unpack", "unpack"] if dram else ["forward"]))
            op = rng.choice(["prefill", "rank", "rank_batch"])
        before = engine.stats()
        try:
            if op == "prefill":
                u = rng.randrange(USERS)
                tickets[u] = engine.prefill_prefix(u, user_history(u, rng.randint(1, 32), rng), now=now)
            elif op == "prefill_batch":
                us = [rng.randrange(USERS) for _ in range(rng.randint(2, 4))]
                done = engine.prefill_prefix_batch([(u, user_history(u, rng.randint(1, 32), rng)) for u in us],
                                                   now=now)
                tickets.update(zip(us, done))
            elif op in ("rank", "rank_batch"):
                reqs = [ranking(rng.randrange(USERS)) for _ in range(1 if op == "rank" else rng.randint(2, 5))]
                if len({r.ticket.fingerprint for r in reqs if r.ticket is not None}) < \
                        sum(r.ticket is not None for r in reqs):
                    reqs = [rg.RankRequest(r.user_id, r.history, r.candidates, None, r.request_time) for r in reqs]
                for r, res in zip(reqs, engine.rank_with_prefix_batch(reqs, now=now)):
                    oracle.check(r.history, r.candidates, r.request_time, res.scores)
                    assert res.source in ("hbm", "dram", "recompute")
                    seen["rankings"] += 1
            elif op == "advance":
                now += rng.choice([0.5, 1.0, 3.0])
            else:  # a documented input error: nothing changes
                u = rng.randrange(USERS)
                bad = rg.RankRequest(u, user_history(u, 8, rng), torch.tensor([CFG.num_items]))
                with pytest.raises(ValueError, match="candidates must be in"):
                    engine.rank_with_prefix_batch([ranking(u), bad], now=now)
                seen["input_errors"] += 1
                assert engine.stats() == before
        except InjectedFault:
            seen["injected"] += 1
        engine.pool.check_invariants()
        engine.pool.expire(now=now)
        s = engine.stats()
        assert s["rank_requests"] == s["hbm_hits"] + s["dram_hits"] + s["recomputes"]
        # no finished call holds a reference: only live pre-infer leases pin pages
        live = sum(-(-n // engine.page_size) for u in range(USERS) for fp, n in engine.pool.entries_of(u)
                   if engine.pool.has_lease(u, fp, now=now))
        assert s["pool_pinned_pages"] == live
    seen.update({k: engine.stats()[k] for k in ("spill_failures", "reload_failures", "spills", "reloads",
                                                "evictions", "stored_on_rank", "extensions")})
    return seen


@pytest.mark.parametrize("dram", [False, True], ids=["hbm", "hbm+dram"])
@pytest.mark.parametrize("store_misses", [False, True], ids=["plain", "store_misses"])
def test_random_interleavings_with_faults_keep_scores_exact(pool_cls, monkeypatch, store_misses, dram):
    monkeypatch.setattr("relaygr_engine.cache.PrefixBlockPool", pool_cls)
    totals: dict = {}
    for seed in range(SEEDS):  # fixed seeds: the same interleavings on every run
        for k, v in run_interleaving(seed, store_misses, dram).items():
            totals[k] = totals.get(k, 0) + v
    # the interleavings reached what they are meant to exercise
    assert totals["rankings"] >= 60 and totals["input_errors"] >= 2 and totals["evictions"] >= 5
    assert totals["injected"] >= 2
    if dram:
        assert totals["spills"] >= 5 and totals["reloads"] >= 2
        assert totals["spill_failures"] >= 1 and totals["reload_failures"] >= 1
    if store_misses:
        assert totals["stored_on_rank"] >= 5
