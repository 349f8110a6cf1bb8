"""Virtual-clock serving loop mechanics with a deterministic fake service-time engine."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from relaygr_engine.bench.sim import PrefillOutcome, RankOutcome, simulate
from relaygr_engine.workload.build import Request, Workload, WorkloadConfig


class FakeTimer:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeService:
    """Ranking takes ``rank_hit`` s after a completed pre-infer, ``rank_miss`` s otherwise; a pre-infer is
    ``chunks`` calls of ``prefill`` s each."""

    def __init__(self, timer: FakeTimer, relay: bool, rank_hit=0.001, rank_miss=0.010, prefill=0.008, chunks=1,
                 refuse=()) -> None:
        self.timer, self.wants_prefill = timer, relay
        self.rank_hit, self.rank_miss, self.prefill_s, self.chunks = rank_hit, rank_miss, prefill, chunks
        self.refuse = set(refuse)
        self.progress: dict[int, int] = {}
        self.cached: set[int] = set()
        self.cancelled: list[int] = []
        self.log: list[tuple[str, int, float]] = []     # (job, request index, virtual now)

    def rank(self, req, now):
        self.log.append(("rank", req.index, now))
        hit = req.index in self.cached
        self.timer.t += self.rank_hit if hit else self.rank_miss
        return RankOutcome("hbm" if hit else ("recompute" if self.wants_prefill else "full"))

    def prefill(self, req, now):
        self.log.append(("prefill", req.index, now))
        if req.index in self.refuse:
            return PrefillOutcome(False, "trigger:footprint")
        self.timer.t += self.prefill_s
        done = self.progress[req.index] = self.progress.get(req.index, 0) + 1
        if done < self.chunks:
            return PrefillOutcome(True, "admitted", remaining=True)
        self.cached.add(req.index)
        return PrefillOutcome(True, "admitted")

    def cancel(self, req, now):
        self.cancelled.append(req.index)

    def stats(self):
        return {"fake": 1}


def _workload(arrivals_s, delay=0.05, warmup=0) -> Workload:
    """Requests whose arrivals (before the loop's +delay shift) are ``arrivals_s`` at qps = :func:`_qps`; the first
    ``warmup`` are warm-up requests."""
    z = np.zeros(1, dtype=np.int64)
    reqs = [Request(index=i, user_id=i, item_ids=z, action_ids=z, timestamps=z, prefix_len=1, candidates=z,
                    request_ts=0, offset_s=float(a), warmup=i < warmup) for i, a in enumerate(arrivals_s)]
    cfg = WorkloadConfig(num_items=4, num_actions=1, num_requests=max(1, len(reqs)), num_candidates=1,
                         pipeline_delay_s=delay)
    return Workload(reqs, cfg)


def _qps(arr) -> float:
    return (len(arr) - 1) / arr[-1]


def test_idle_worker_latency_is_the_service_time():
    arr = [0.0, 1.0, 2.0]
    timer = FakeTimer()
    res = simulate(FakeService(timer, relay=False), _workload(arr, delay=0.05), _qps(arr), timer=timer)
    np.testing.assert_allclose(res.arrival_s, np.array(arr) + 0.05)     # first signal at virtual time 0
    np.testing.assert_allclose(res.latency_s, [0.010] * 3)
    assert res.sources == ["full"] * 3 and res.prefill["signals"] == 0


def test_queueing_on_the_virtual_clock():
    # three rankings 2 ms apart, 10 ms each: waits 0, 8, 16 ms
    arr = [0.0, 0.002, 0.004]
    timer = FakeTimer()
    res = simulate(FakeService(timer, relay=False), _workload(arr, delay=0.0), _qps(arr), timer=timer)
    np.testing.assert_allclose(res.start_s, [0.0, 0.010, 0.020])
    np.testing.assert_allclose(res.latency_s, [0.010, 0.018, 0.026])
    assert res.busy_s == pytest.approx(0.030)


def test_warmup_is_served_not_measured_and_the_window_opens_when_the_worker_is_free():
    # two warm-up rankings at 0 and 1 ms take 10 ms each (busy until 20 ms); the measured one arrives at 5 ms
    arr = [0.0, 0.001, 0.005, 0.030]
    timer = FakeTimer()
    svc = FakeService(timer, relay=True)
    res = simulate(svc, _workload(arr, delay=0.0, warmup=2), _qps(arr), timer=timer)
    assert [i for j, i, _ in svc.log if j == "rank"] == [0, 1, 2, 3]
    assert res.num_requests == 2 and len(res.latency_s) == 2
    # the measured window was shifted by 15 ms (the worker was busy until 20 ms) and never queued behind warm-up
    np.testing.assert_allclose(res.arrival_s, [0.020, 0.045])
    np.testing.assert_allclose(res.latency_s, [0.010, 0.010])
    # pre-infer counters cover the measured requests only (no pipeline gap here: their rankings come first)
    assert res.prefill["signals"] == 2 and res.prefill["dropped_stale"] == 2 and res.prefill["started"] == 0


def test_a_stateless_service_skips_its_warmup():
    arr = [0.0, 0.001, 0.005, 0.030]
    timer = FakeTimer()
    svc = FakeService(timer, relay=False)
    svc.stateless = True
    res = simulate(svc, _workload(arr, delay=0.0, warmup=2), _qps(arr), timer=timer)
    assert [i for _, i, _ in svc.log] == [2, 3]
    np.testing.assert_allclose(res.latency_s, [0.010, 0.010])
    assert res.busy_s == pytest.approx(0.020)


def test_relay_prefills_in_the_pipeline_gap_and_passes_virtual_now():
    arr = [0.0, 1.0]
    timer = FakeTimer()
    svc = FakeService(timer, relay=True)
    res = simulate(svc, _workload(arr, delay=0.05), _qps(arr), timer=timer)
    # signal 50 ms before arrival, an 8 ms pre-infer, then a 1 ms cached ranking at arrival
    assert svc.log == [("prefill", 0, 0.0), ("rank", 0, pytest.approx(0.05)),
                       ("prefill", 1, pytest.approx(1.0)), ("rank", 1, pytest.approx(1.05))]
    np.testing.assert_allclose(res.latency_s, [0.001, 0.001])
    assert res.had_ticket.tolist() == [True, True]
    assert res.prefill["admitted"] == 2 and res.prefill["dropped_stale"] == 0
    assert res.sources == ["hbm", "hbm"]


def test_rankings_take_priority_over_queued_prefills():
    # signals at -1 ms, 1 ms, 49 ms (relative); ranking 1 arrives while ranking 0 runs and is served before the
    # queued pre-infer of request 1, which is then stale: dropped, never run
    arr = [0.0, 0.002, 0.050]
    timer = FakeTimer()
    svc = FakeService(timer, relay=True, rank_miss=0.010, prefill=0.005)
    res = simulate(svc, _workload(arr, delay=0.001), _qps(arr), timer=timer)
    jobs = [(j, i) for j, i, _ in svc.log]
    assert jobs == [("prefill", 0), ("rank", 0), ("rank", 1), ("prefill", 2), ("rank", 2)]
    assert res.prefill["dropped_stale"] == 1 and res.prefill["started"] == 2
    assert res.had_ticket.tolist() == [True, False, True] and res.sources[1] == "recompute"


def test_stale_prefills_are_dropped_under_load_and_never_run_after_their_ranking():
    rng = np.random.default_rng(0)
    arr = np.sort(rng.random(200)) * 0.5                 # ~400 QPS: far above what 10 ms rankings sustain
    timer = FakeTimer()
    svc = FakeService(timer, relay=True)
    res = simulate(svc, _workload(arr, delay=0.005), _qps(arr), timer=timer)
    ranked_at = {i: k for k, (j, i, _) in enumerate(svc.log) if j == "rank"}
    for k, (j, i, now) in enumerate(svc.log):
        if j == "prefill":
            assert k < ranked_at[i]                       # a pre-infer never runs after its ranking was served
            assert now < res.arrival_s[i]                 # ...nor once its ranking had arrived
    pf = res.prefill
    assert pf["started"] + pf["dropped_stale"] == pf["signals"] == 200
    assert pf["dropped_stale"] > 100
    assert np.all(res.finish_s >= res.arrival_s) and np.all(res.start_s >= res.arrival_s)


def test_running_prefill_is_not_preempted_and_refusals_are_counted():
    # request 0's pre-infer starts 1 ms before its ranking arrives and runs 8 ms: the ranking waits 7 ms
    arr = [0.0, 1.0]
    timer = FakeTimer()
    svc = FakeService(timer, relay=True, prefill=0.008, refuse={1})
    res = simulate(svc, _workload(arr, delay=0.001), _qps(arr), timer=timer)
    assert res.start_s[0] - res.arrival_s[0] == pytest.approx(0.007)
    assert res.latency_s[0] == pytest.approx(0.008)      # 7 ms wait, then a 1 ms cached ranking
    assert res.prefill["refused"] == {"trigger:footprint": 1} and res.sources[1] == "recompute"
    assert res.engine_stats == {"fake": 1}


def test_chunked_prefill_yields_to_an_arriving_ranking_and_is_cut_short():
    # each pre-infer is 4 chunks of 4 ms; with a 10 ms pipeline gap the ranking arrives during the third chunk
    arr = [0.0, 1.0]
    timer = FakeTimer()
    svc = FakeService(timer, relay=True, prefill=0.004, chunks=4)
    res = simulate(svc, _workload(arr, delay=0.010), _qps(arr), timer=timer)
    assert [j for j, i, _ in svc.log if i == 0] == ["prefill", "prefill", "prefill", "rank"]
    assert res.start_s[0] - res.arrival_s[0] == pytest.approx(0.002)     # waits for the running chunk only
    assert res.latency_s[0] == pytest.approx(0.002 + 0.010)               # then ranks without a full prefix
    assert res.prefill["cut_short"] == 2 and svc.cancelled == [0, 1]
    assert res.prefill["chunks"] == 6 and res.prefill["admitted"] == 0
    # with a 20 ms gap all four chunks finish first and the ranking is a 1 ms hit
    timer = FakeTimer()
    svc = FakeService(timer, relay=True, prefill=0.004, chunks=4)
    res = simulate(svc, _workload(arr, delay=0.020), _qps(arr), timer=timer)
    np.testing.assert_allclose(res.latency_s, [0.001, 0.001])
    assert res.prefill["chunks"] == 8 and res.prefill["admitted"] == 2 and res.prefill["cut_short"] == 0


def test_stop_over_ends_the_run_once_the_outcome_is_certain():
    arr = [0.0, 0.001, 0.002, 0.003, 0.004, 5.0]          # a burst: latencies 10, 19, 28, 37, 46 ms, then 10
    timer = FakeTimer()
    res = simulate(FakeService(timer, relay=False), _workload(arr, delay=0.0), _qps(arr), timer=timer,
                   stop_over=(0.025, 2))
    assert res.stopped_early and res.num_requests == 6
    np.testing.assert_allclose(res.latency_s, [0.010, 0.019, 0.028, 0.037])   # stopped at the 2nd over 25 ms
    timer = FakeTimer()
    res = simulate(FakeService(timer, relay=False), _workload(arr, delay=0.0), _qps(arr), timer=timer,
                   stop_over=(0.050, 2))
    assert not res.stopped_early and len(res.latency_s) == 6


def _small_log_and_ranker(num_users: int, per_user: int, num_requests: int):
    """A real-engine set-up: a log of ``num_users`` users with ``per_user`` events each (seeded), its workload of
    ``num_requests`` requests (4 candidates, 10 s pipeline gap), and a 1-layer HSTU ranker."""
    import relaygr_engine as rg
    from relaygr_engine.workload.build import InteractionLog, build_workload

    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(num_users), per_user)
    times = np.concatenate([np.cumsum(rng.integers(1, 20, size=per_user)) for _ in range(num_users)])
    log = InteractionLog(users, rng.integers(0, 50, size=num_users * per_user), times, None, "none", "test")
    w = build_workload(log, WorkloadConfig(num_items=64, num_actions=1, num_requests=num_requests, num_candidates=4,
                                           base_length=40, suffix_tokens=2, pipeline_delay_s=10.0))
    cfg = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=16, num_heads=1, head_dim=8, num_items=64,
                           num_actions=1, max_seq_len=128)
    return w, rg.build_ranker(cfg, seed=0)


def test_relay_service_on_the_real_engine_chunks_caches_and_counts_trigger_decisions():
    pytest.importorskip("torch")
    import relaygr_engine as rg
    from relaygr_engine.bench.sim import BaselineService, RelayService, TriggerHook
    from relaygr_engine.policy import LatencyModel, SequenceAwareTrigger, TriggerConfig

    w, model = _small_log_and_ranker(num_users=4, per_user=30, num_requests=20)
    # at 0.01 QPS with a 10 s pipeline gap every pre-infer (8-token chunks) finishes before its ranking, and a
    # user's next pre-infer starts after its previous ranking
    eng = rg.RelayEngine(model, rg.CacheConfig(page_size=4, num_pages=512, lease_ttl_s=30.0))
    res = simulate(RelayService(eng, chunk_tokens=8), w, 0.01)
    assert res.prefill["admitted"] == len(w) and res.had_ticket.all()
    assert res.prefill["chunks"] >= len(w) + 4 * len({r.user_id for r in w.requests})   # 38-token first prefixes
    assert set(res.sources) == {"hbm"}
    assert all(c >= r.prefix_len for c, r in zip(res.cached_tokens, w.requests))
    assert res.engine_stats["stale_tickets"] == 0 and res.engine_stats["expired_leases"] == 0
    # a trigger that calls nothing at risk declines every pre-infer; rankings recompute
    never = SequenceAwareTrigger(LatencyModel(0.0, 0.0, 0.0, device="cpu"), TriggerConfig(slo_ms=10.0))
    hook = TriggerHook(never)
    eng = rg.RelayEngine(model, rg.CacheConfig(page_size=4, num_pages=512), trigger=hook)
    res = simulate(RelayService(eng, hook), w, 1.0)
    assert res.prefill["admitted"] == 0 and res.engine_stats["trigger_declines_not_at_risk"] > 0
    assert set(res.sources) == {"recompute"} and res.engine_stats["trigger_inflight_prefill_tokens"] == 0
    base = simulate(BaselineService(model), w, 1.0)
    assert base.sources == ["full"] * len(w)


def test_the_latency_model_is_calibrated_on_the_baselines_own_ranking():
    """The trigger's latency model times full inference as the baseline's workers serve it (same service, same
    options: implementation, CUDA graphs, compilation), at every length up to the longest searched."""
    pytest.importorskip("torch")
    import argparse

    from relaygr_engine.bench import slo_workers
    from relaygr_engine.bench.slo_run import calibrate_latency

    _, model = _small_log_and_ranker(num_users=2, per_user=10, num_requests=2)
    a = argparse.Namespace(device="cpu", baseline="paged", cuda_graphs=False, compile=False, page_size=8)
    service = slo_workers.baseline(model, a)
    assert (service.impl.value, service.cuda_graphs, service.compile_model, service.page_size) == ("paged", False,
                                                                                                   False, 8)
    served = []
    score = service.score
    service.score = lambda h, c, request_time=None: served.append((len(h), len(c))) or score(h, c, request_time)
    lat = calibrate_latency(service, 5, 64, "cpu", repeats=1)
    lengths = sorted({L for L, _ in served})
    assert lengths[0] == 32 and lengths[-1] == 64 and {C for _, C in served} == {5}
    assert lat.meta["baseline"] == "paged" and lat.meta["cuda_graphs"] is False and lat.meta["compiled"] is False


def test_abort_ends_the_run_where_it_is():
    """``abort`` (a wall-clock deadline) is asked before every step: the run ends there, marked aborted."""
    arr = [0.0, 1.0, 2.0, 3.0]
    timer = FakeTimer()
    svc = FakeService(timer, relay=False)
    asked = []
    res = simulate(svc, _workload(arr, delay=0.0), _qps(arr), timer=timer,
                   abort=lambda: asked.append(1) or len(svc.log) >= 2)
    assert res.aborted and len(svc.log) == 2 and len(res.latency_s) == 2 and len(asked) >= 3
    res = simulate(FakeService(FakeTimer(), relay=False), _workload(arr, delay=0.0), _qps(arr), abort=lambda: False)
    assert not res.aborted and len(res.latency_s) == 4


class TickTimer:
    """A service-time clock that advances 1 ms per reading: every job takes as long as its clock readings say, the
    same in every run, so two runs of the same work give the same virtual times."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def test_a_reset_service_serves_a_run_exactly_as_a_fresh_one():
    """The SLO benchmark reuses each worker's service across runs (``service.reset(trigger)``, keeping compiled
    code and graphs): a run after a reset, even after a run of other work, matches a run on a freshly built
    service in every latency, source, pre-infer count and engine counter."""
    pytest.importorskip("torch")
    import relaygr_engine as rg
    from relaygr_engine.bench.sim import BaselineService, RelayService, TriggerHook
    from relaygr_engine.workload import Workload
    from relaygr_engine.policy import LatencyModel, SequenceAwareTrigger, TriggerConfig

    w, model = _small_log_and_ranker(num_users=4, per_user=12, num_requests=12)
    w = Workload([dataclasses.replace(r, warmup=i < 4) for i, r in enumerate(w.requests)], w.config, w.info)
    lat = LatencyModel(0.0, 0.05, 0.0, device="cpu")

    def trigger():
        return SequenceAwareTrigger(lat, TriggerConfig(slo_ms=10.0, margin=0.1, expected_candidates=4))

    def relay():
        hook = TriggerHook(trigger())
        engine = rg.RelayEngine(model, rg.CacheConfig(page_size=4, num_pages=48, lease_ttl_s=0.5, dram_bytes=1 << 20),
                                trigger=hook, store_misses=True)
        return RelayService(engine, hook, chunk_tokens=16)

    def run(service, qps):
        service.prepare(w.requests)
        r = simulate(service, w, qps, timer=TickTimer())
        return (r.latency_s.tolist(), r.sources, r.cached_tokens.tolist(), r.had_ticket.tolist(),
                json.dumps(r.prefill, sort_keys=True), r.engine_stats)

    for make in (relay, lambda: BaselineService(model)):
        want = run(make(), 2.0)
        service = make()
        run(service, 20.0)                       # other work first: a loaded run leaves other state behind
        service.reset(trigger())
        assert run(service, 2.0) == want
    assert want[4] != json.dumps({}) and "hbm" in run(relay(), 2.0)[1]
