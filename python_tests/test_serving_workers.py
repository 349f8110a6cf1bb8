"""Several workers on one virtual clock: placement, continuous batching, and a disaggregated pre-infer pool."""
from __future__ import annotations

import numpy as np
import pytest

from relaygr_engine.bench.sim import (BatchPolicy, PrefillOutcome, RankOutcome, Role, Worker, simulate)
from relaygr_engine.workload.build import Request, Workload, WorkloadConfig
from relaygr_engine.policy.affinity import rank_replicas

from test_serving import FakeService, FakeTimer, _qps, _small_log_and_ranker


def _workload(arrivals_s, users, delay=0.05, tokens=1) -> Workload:
    z = np.zeros(tokens, dtype=np.int64)
    reqs = [Request(index=i, user_id=u, item_ids=z, action_ids=z, timestamps=z, prefix_len=tokens, candidates=z[:1],
                    request_ts=0, offset_s=float(a)) for i, (a, u) in enumerate(zip(arrivals_s, users))]
    cfg = WorkloadConfig(num_items=4, num_actions=1, num_requests=len(reqs), num_candidates=1, pipeline_delay_s=delay)
    return Workload(reqs, cfg)


class BatchingService(FakeService):
    """A batch of n rankings takes ``rank_miss + (n - 1) * per_extra`` s."""

    per_extra = 0.002

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[int]] = []

    def rank_batch(self, reqs, now):
        self.batches.append([r.index for r in reqs])
        self.timer.t += self.rank_miss + (len(reqs) - 1) * self.per_extra
        return [RankOutcome("full") for _ in reqs]


def _users_homed(workers: int) -> list[int]:
    """One user whose rendezvous-first worker is each of ``range(workers)``."""
    out = {}
    for u in range(1000):
        out.setdefault(rank_replicas(u, list(range(workers)))[0], u)
        if len(out) == workers:
            return [out[w] for w in range(workers)]
    raise AssertionError("no user for some worker")


def test_co_located_workers_serve_different_users_in_parallel():
    a, b = _users_homed(2)
    arr = [0.0, 0.0, 0.001]
    timer = FakeTimer()
    svcs = [FakeService(timer, relay=False), FakeService(timer, relay=False)]
    res = simulate([Worker(s) for s in svcs], _workload(arr, [a, b, a], delay=0.0), _qps(arr), timer=timer)
    # users a and b each on their own worker: no queueing between them; a's second request waits for its first
    np.testing.assert_allclose(res.latency_s, [0.010, 0.010, 0.019])
    assert [i for _, i, _ in svcs[0].log] == [0, 2] and [i for _, i, _ in svcs[1].log] == [1]
    assert res.workers == 2 and res.busy_s == pytest.approx(0.030)


def test_continuous_batching_serves_what_is_queued_within_the_token_budget():
    arr = [0.0, 0.001, 0.002, 0.003, 0.004]
    timer = FakeTimer()
    svc = BatchingService(timer, relay=False)
    wl = _workload(arr, [1] * 5, delay=0.0, tokens=9)   # 9 history tokens + 1 candidate each
    res = simulate(svc, wl, _qps(arr), timer=timer, batch=BatchPolicy(max_batch=8, max_tokens=30))
    # the first ranking runs alone (nothing else queued); at 10 ms four are queued: 3 fit in 30 tokens, then the
    # last one alone (a batch of one is a plain rank call)
    assert [i for _, i, _ in svc.log] == [0, 4] and svc.batches == [[1, 2, 3]]
    np.testing.assert_allclose(res.finish_s, [0.010, 0.024, 0.024, 0.024, 0.034])
    with pytest.raises(ValueError, match="max_batch"):
        BatchPolicy(max_batch=0)


class PackingService(FakeService):
    """A pre-infer-only fake: each pre-infer ships a payload of ``nbytes`` after ``pack`` s of packing."""

    pack = 0.001
    copy = 0.003

    def prefill(self, req, now):
        self.log.append(("prefill", req.index, now))
        self.timer.t += self.prefill_s + self.pack
        return PrefillOutcome(True, "admitted", payload=_Payload(req.index), pack_s=self.pack)

    def ship(self, payload):
        self.timer.t += self.copy
        return payload


class _Payload:
    nbytes = 1000

    def __init__(self, index: int) -> None:
        self.index = index


class ReceivingService(FakeService):
    unpack = 0.0005

    def receive(self, req, payload, now):
        assert payload.index == req.index
        self.log.append(("receive", req.index, now))
        self.timer.t += self.unpack
        self.cached.add(req.index)
        return PrefillOutcome(True, "admitted")


def test_disaggregated_prefix_arrives_after_pack_copy_unpack_and_a_late_one_recomputes():
    timer = FakeTimer()
    pre, rank = PackingService(timer, relay=True), ReceivingService(timer, relay=True)
    workers = [Worker(pre, Role.PREFILL), Worker(rank, Role.RANK)]
    # request 0: 50 ms gap > 8 + 1 ms pre-infer + 3 ms copy + 0.5 ms unpack: a hit; request 1: 10 ms gap: late
    wl = _workload([0.0, 1.0], [1, 1], delay=0.05)
    res = simulate(workers, wl, 1.0, timer=timer)
    assert rank.log[0] == ("receive", 0, pytest.approx(0.012)) and rank.log[1][:2] == ("rank", 0)
    assert res.sources[0] == "hbm" and res.had_ticket[0]
    np.testing.assert_allclose(res.latency_s[0], 0.001)
    tx = res.prefill["transfer"]
    assert tx["transfers"] == 2 and tx["transfer_bytes"] == 2000 and tx["late"] == 0
    assert tx["pack_s"] == pytest.approx(0.002) and tx["copy_s"] == pytest.approx(0.006)
    assert tx["unpack_s"] == pytest.approx(0.001)
    # the ranking pool never pre-infers and the pre-infer pool never ranks
    assert {j for j, _, _ in pre.log} == {"prefill"} and "prefill" not in {j for j, _, _ in rank.log}
    timer = FakeTimer()
    pre, rank = PackingService(timer, relay=True), ReceivingService(timer, relay=True)
    res = simulate([Worker(pre, Role.PREFILL), Worker(rank, Role.RANK)], _workload([0.0], [1], delay=0.010), 1.0,
                   timer=timer)
    assert res.sources == ["recompute"] and res.prefill["transfer"]["late"] == 1
    assert [j for j, _, _ in rank.log] == ["rank"]


def test_disaggregated_workers_on_real_engines_rank_from_shipped_prefixes():
    pytest.importorskip("torch")
    import relaygr_engine as rg
    from relaygr_engine.bench.sim import PreInferService, RelayService, disaggregated_workers

    w, model = _small_log_and_ranker(num_users=6, per_user=10, num_requests=24)

    def relay(chunk=0):
        return RelayService(rg.RelayEngine(model, rg.CacheConfig(page_size=4, num_pages=512, lease_ttl_s=30.0)),
                            chunk_tokens=chunk)

    workers = disaggregated_workers([PreInferService(relay())], [relay(), relay()])
    res = simulate(workers, w, 0.01, batch=BatchPolicy(max_batch=4))
    tx = res.prefill["transfer"]
    assert tx["transfers"] == len(w) and tx["late"] == 0 and tx["refused"] == 0
    assert set(res.sources) == {"hbm"} and res.had_ticket.all()
    assert res.engine_stats["imports"] + res.engine_stats["imports_already_cached"] == len(w)
    assert res.engine_stats["exports"] == len(w) and res.engine_stats["prefills"] > 0
    with pytest.raises(ValueError, match="chunk_tokens must be 0"):
        PreInferService(relay(chunk=8))


def test_merged_worker_stats_sum_counts_and_keep_setup_values():
    """Several workers' engine stats are merged for the report: counts add up, the cache's bits per value are the
    workers' common value (never a sum), None where workers differ."""
    from types import SimpleNamespace

    from relaygr_engine.bench.sim.clock import _merged_stats
    worker = (lambda **stats: SimpleNamespace(service=SimpleNamespace(stats=lambda: stats)))
    merged = _merged_stats([worker(hbm_hits=3, kv_bits=16, pool_num_pages=100),
                            worker(hbm_hits=4, kv_bits=16, pool_num_pages=100)])
    assert merged == {"hbm_hits": 7, "kv_bits": 16, "pool_num_pages": 200}
    assert _merged_stats([worker(kv_bits=8), worker(kv_bits=16), worker(kv_bits=16)])["kv_bits"] is None
