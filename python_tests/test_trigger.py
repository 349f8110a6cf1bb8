"""Sequence-aware trigger and its latency model: decisions, bounds, counters, calibration, profiles."""
from __future__ import annotations

import json
import logging
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr_engine.policy import (LatencyModel, LatencyPoint, SequenceAwareTrigger, TriggerConfig, TriggerDecision,
                                   TriggerReason, calibrate)

# t(L, C) = 2 + 0.01 (L+C) + 1e-5 (L+C)^2 + 2e-6 C L   (ms)
MODEL = LatencyModel(a=2.0, b=0.01, c=1e-5, d=2e-6, device="cpu")


def t_ms(L, C, a=2.0, b=0.01, c=1e-5, d=2e-6):
    n = L + C
    return a + b * n + c * n * n + d * C * L


def make(**cfg):
    cfg.setdefault("slo_ms", 20.0)
    cfg.setdefault("margin", 0.5)
    cfg.setdefault("expected_candidates", 100)
    return SequenceAwareTrigger(MODEL, TriggerConfig(**cfg))


def decide(trig, L, C=None, prefix_pages=0, pinned_pages=0, num_pages=1000, now=0.0, **kw):
    return trig.decide(history_len=L, num_candidates=C, prefix_pages=prefix_pages, pinned_pages=pinned_pages,
                       num_pages=num_pages, now=now, **kw)


# ---------------------------------------------------------------------------------------------------- latency model
def test_predict_matches_formula():
    for L, C in [(0, 1), (100, 10), (4000, 500)]:
        assert MODEL.predict_ms(L, C) == pytest.approx(t_ms(L, C), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(a=st.floats(0, 5), b=st.floats(0, 0.1), c=st.floats(0, 1e-4), d=st.floats(0, 1e-4),
       budget=st.floats(0, 200), C=st.integers(0, 300))
def test_max_history_len_is_the_boundary(a, b, c, d, budget, C):
    m = LatencyModel(a, b, c, d)
    L = m.max_history_len(budget, C)
    if L is None:  # every length fits: the prediction does not grow, or too slowly for any boundary to exist
        assert m.predict_ms(1 << 62, C) <= budget
    elif L == -1:
        assert m.predict_ms(0, C) > budget
    else:
        assert m.predict_ms(L, C) <= budget < m.predict_ms(L + 1, C)


def test_latency_model_rejects_bad_coefficients_and_inputs():
    with pytest.raises(ValueError, match="b must be"):
        LatencyModel(1.0, -0.1, 0.0)
    with pytest.raises(ValueError, match="c must be"):
        LatencyModel(1.0, 0.1, float("nan"))
    with pytest.raises(ValueError, match="history_len must be an integer >= 0, got -1"):
        MODEL.predict_ms(-1, 10)
    with pytest.raises(ValueError, match="num_candidates"):
        MODEL.predict_ms(10, 2.5)
    with pytest.raises(ValueError, match="budget_ms"):
        MODEL.max_history_len(-1.0, 10)


# ---------------------------------------------------------------------------------------------------- calibration
class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def synthetic(clock, noise=0.0, seed=0, **coef):
    rng = np.random.default_rng(seed)

    def fn(L, C):
        clock.t += t_ms(L, C, **coef) * (1.0 + noise * rng.standard_normal()) / 1e3

    return fn


GRID_L = [0, 64, 128, 256, 512, 1024, 2048]
GRID_C = [1, 16, 64, 256]


def test_calibrate_recovers_exact_coefficients():
    clock = FakeClock()
    m = calibrate(synthetic(clock), GRID_L, GRID_C, repeats=2, timer=clock, device="cpu")
    assert m.coefficients == pytest.approx((2.0, 0.01, 1e-5, 2e-6), rel=1e-6)
    assert len(m.points) == len(GRID_L) * len(GRID_C)
    assert m.meta["fit"]["max_rel_err"] < 1e-9
    assert m.meta["repeats"] == 2 and m.meta["quantile"] == 0.5


def test_calibrate_recovers_coefficients_under_noise():
    clock = FakeClock()
    m = calibrate(synthetic(clock, noise=0.01, seed=1), GRID_L, GRID_C, repeats=5, timer=clock)
    # 1% multiplicative noise, median of 5: the dominant terms come back within a few percent ...
    assert m.b == pytest.approx(0.01, rel=0.05)
    assert m.c == pytest.approx(1e-5, rel=0.05)
    # ... and the prediction within 3% over the whole grid (worst seen over 40 seeds: 0.7%).
    for L in GRID_L:
        for C in GRID_C:
            assert m.predict_ms(L, C) == pytest.approx(t_ms(L, C), rel=0.03)


def test_calibrate_leaves_unidentifiable_term_at_zero_and_stays_non_negative():
    clock = FakeClock()
    # One candidate count: C*L is a combination of 1 and L+C, so it cannot be told apart.
    m = calibrate(synthetic(clock), GRID_L, [32], repeats=1, timer=clock)
    assert m.d == 0.0
    for L in GRID_L:
        assert m.predict_ms(L, 32) == pytest.approx(t_ms(L, 32), rel=1e-6)
    # A decreasing measurement cannot make a coefficient negative.
    pts = [LatencyPoint(L, 8, 10.0 - 0.001 * L) for L in GRID_L]
    fit = LatencyModel.fit(pts)
    assert min(fit.coefficients) >= 0.0


def test_calibrate_records_the_requested_quantile():
    clock = FakeClock()
    times = iter([1.0, 5.0, 2.0, 4.0, 3.0])  # ms, one grid point, 5 repeats

    def fn(L, C):
        clock.t += next(times, 0.0) / 1e3

    m = calibrate(fn, [10], [1], repeats=5, warmup=0, quantile=1.0, timer=clock)
    assert m.points[0].ms == pytest.approx(5.0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(lengths=[-1]), "lengths\\[0\\]"),
    (dict(lengths=[]), "lengths"),
    (dict(cand_counts=[0]), "cand_counts\\[0\\]"),
    (dict(repeats=0), "repeats"),
    (dict(warmup=-1), "warmup"),
    (dict(quantile=1.5), "quantile"),
    (dict(fn=None), "fn"),
])
def test_calibrate_rejects_bad_arguments(kwargs, name):
    args = dict(fn=lambda L, C: None, lengths=[8], cand_counts=[1], repeats=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        calibrate(args.pop("fn"), args.pop("lengths"), args.pop("cand_counts"), args.pop("repeats"), **args)


# ---------------------------------------------------------------------------------------------------- profiles
def test_profile_json_round_trip(tmp_path):
    clock = FakeClock()
    m = calibrate(synthetic(clock), GRID_L[:4], GRID_C[:2], repeats=1, timer=clock, device="cuda",
                  meta={"torch_version": "x", "model_config": {"num_layers": 2}})
    path = tmp_path / "p.json"
    m.save(path)
    back = LatencyModel.load(path)
    assert back == m
    assert back.meta == m.meta
    assert json.loads(path.read_text())["format"] == "relaygr-latency-profile"


@pytest.mark.parametrize("mutate, name", [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d["coefficients_ms"].pop("c"), "coefficients_ms"),
    (lambda d: d["coefficients_ms"].update(a=-1.0), "a must be"),
    (lambda d: d.update(points=[{"history_len": 1}]), "points\\[0\\]"),
    (lambda d: d.update(points=[{"history_len": -4, "num_candidates": 1, "ms": 1.0}]), "history_len"),
])
def test_profile_rejects_malformed(mutate, name):
    d = LatencyModel(1.0, 0.1, 0.0, points=(LatencyPoint(1, 1, 1.2),)).to_dict()
    mutate(d)
    with pytest.raises(ValueError, match=name):
        LatencyModel.from_dict(d)


def test_default_cpu_profile_is_shipped_and_sane(caplog):
    m = LatencyModel.default("cpu")
    assert m.device == "cpu" and len(m.points) >= 6
    assert m.meta["model_config"]["num_layers"] >= 1
    assert m.predict_ms(2048, 256) > m.predict_ms(64, 16) > 0
    with caplog.at_level(logging.WARNING, logger="relaygr_engine"):
        fallback = LatencyModel.default("npu:0")
    assert fallback == m
    assert any("no shipped latency profile for device 'npu:0'" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------- decisions
def test_at_risk_versus_not_at_risk():
    trig = make()  # threshold 10 ms
    L_ok = MODEL.max_history_len(10.0, 100)
    assert L_ok is not None and L_ok > 0
    ok = decide(trig, L_ok, 100)
    risky = decide(trig, L_ok + 1, 100)
    assert (ok.admit, ok.reason) == (False, "not_at_risk")
    assert ok.predicted_ms == pytest.approx(t_ms(L_ok, 100))
    assert risky.admit and risky.reason == "at_risk"
    assert risky.predicted_ms == pytest.approx(t_ms(L_ok + 1, 100)) and risky.predicted_ms > 10.0


def test_unknown_candidates_use_expected_candidates():
    trig = make(expected_candidates=300)
    d = decide(trig, 500, None)
    assert d.predicted_ms == pytest.approx(t_ms(500, 300))
    assert trig.max_servable_history_len() == MODEL.max_history_len(20.0, 300)


def test_longer_than_servable_is_always_at_risk():
    trig = make(margin=1.0)
    L_max = trig.max_servable_history_len(100)
    assert not decide(trig, L_max, 100).admit
    assert decide(trig, L_max + 1, 100).reason == "at_risk"


def test_footprint_bound():
    trig = make(max_footprint_fraction=0.25)  # 250 of 1000 pages
    L = 2000  # at risk
    assert decide(trig, L, prefix_pages=50, pinned_pages=200).admit  # 250 <= 250
    d = decide(trig, L, prefix_pages=51, pinned_pages=200)
    assert not d.admit and d.reason == "footprint"
    # not_at_risk is reported before the footprint
    assert decide(trig, 10, prefix_pages=999, pinned_pages=999).reason == "not_at_risk"


def test_inflight_load_bound():
    trig = make(max_inflight_prefills=2)
    L = 2000
    trig.on_prefill_start(L, now=0.0)
    assert decide(trig, L, reserve=True).admit
    d = decide(trig, L)
    assert not d.admit and d.reason == "load"
    trig.on_prefill_done(L, now=0.1)
    assert decide(trig, L).admit
    assert decide(trig, L, prefix_pages=600, pinned_pages=0).reason == "footprint"  # footprint before load


def test_rate_load_bound_sliding_window():
    trig = make(max_prefill_tokens_per_s=3000.0, rate_window_s=1.0)  # 3000 tokens per 1 s window
    assert decide(trig, 2000, now=0.0, reserve=True).admit        # window 0 -> 2000
    assert decide(trig, 1000, now=0.5, reserve=True).admit        # 3000 <= 3000
    d = decide(trig, 1000, now=0.9)                               # 4000 > 3000
    assert (d.admit, d.reason) == (False, "load")
    assert trig.stats(now=0.9)["trigger_window_prefill_tokens"] == 3000
    assert decide(trig, 1000, now=1.0).admit                      # the t=0 start left the window: 1000 + 1000
    assert trig.stats(now=1.0)["trigger_window_prefill_tokens"] == 1000
    # done does not erase started work from the rate window (it bounds the start rate)
    trig.on_prefill_done(2000, now=1.2)
    trig.on_prefill_done(1000, now=1.2)
    assert trig.stats(now=1.2)["trigger_window_prefill_tokens"] == 1000
    assert trig.stats(now=1.6)["trigger_window_prefill_tokens"] == 0


def test_rate_bound_admits_an_oversized_prefix_into_an_empty_window():
    trig = make(max_prefill_tokens_per_s=1000.0, rate_window_s=1.0)
    assert decide(trig, 5000, now=0.0, reserve=True).admit
    assert decide(trig, 5000, now=0.5).reason == "load"
    assert decide(trig, 5000, now=1.0).admit


def test_reasons_and_counters():
    trig = make(max_inflight_prefills=1, max_footprint_fraction=0.5)
    keys = {"trigger_decisions", "trigger_admits", "trigger_declines", "trigger_declines_not_at_risk",
            "trigger_declines_footprint", "trigger_declines_load", "trigger_prefills_started",
            "trigger_prefills_done", "trigger_inflight_prefills", "trigger_inflight_prefill_tokens",
            "trigger_window_prefill_tokens"}
    assert set(trig.stats(now=0.0)) == keys
    reasons = [decide(trig, 10).reason,                              # not_at_risk
               decide(trig, 2000, prefix_pages=501).reason,          # footprint
               decide(trig, 2000, reserve=True).reason,              # at_risk (reserved)
               decide(trig, 2000).reason,                            # load
               decide(trig, 3000).reason]                            # load
    assert reasons == ["not_at_risk", "footprint", "at_risk", "load", "load"]
    assert set(reasons) <= {r.value for r in TriggerReason}
    s = trig.stats(now=0.0)
    assert (s["trigger_decisions"], s["trigger_admits"], s["trigger_declines"]) == (5, 1, 4)
    assert (s["trigger_declines_not_at_risk"], s["trigger_declines_footprint"], s["trigger_declines_load"]) == (1, 1, 2)
    assert (s["trigger_prefills_started"], s["trigger_inflight_prefills"], s["trigger_inflight_prefill_tokens"]) \
        == (1, 1, 2000)


def test_decision_validates_reason_and_admit():
    assert TriggerDecision(True, TriggerReason.AT_RISK, 3.0).reason == "at_risk"
    with pytest.raises(ValueError, match="reason must be one of .*'at_risk'.*got 'busy'"):
        TriggerDecision(False, "busy", 1.0)
    with pytest.raises(ValueError, match="admit must be False for reason 'load'"):
        TriggerDecision(True, "load", 1.0)
    with pytest.raises(ValueError, match="predicted_ms"):
        TriggerDecision(False, "load", -1.0)


@pytest.mark.parametrize("field, value", [
    ("slo_ms", 0.0), ("slo_ms", -5.0), ("slo_ms", math.inf), ("margin", 0.0), ("margin", 1.5),
    ("expected_candidates", 0), ("expected_candidates", 2.5), ("max_footprint_fraction", 0.0),
    ("max_footprint_fraction", 1.01), ("max_prefill_tokens_per_s", 0.0), ("max_inflight_prefills", 0),
    ("rate_window_s", 0.0), ("slo_ms", "fast"),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        TriggerConfig(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("history_len", -1), ("num_candidates", -3), ("prefix_pages", -1), ("pinned_pages", -1), ("num_pages", 0),
    ("now", math.nan), ("history_len", 1.5),
])
def test_decide_rejects_bad_inputs(field, value):
    trig = make()
    args = dict(history_len=100, num_candidates=10, prefix_pages=1, pinned_pages=0, num_pages=10, now=0.0)
    args[field] = value
    with pytest.raises(ValueError, match=field):
        trig.decide(**args)
    assert trig.stats(now=0.0)["trigger_decisions"] == 0


def test_trigger_rejects_bad_construction_and_unmatched_done():
    with pytest.raises(ValueError, match="latency_model"):
        SequenceAwareTrigger({"a": 1}, TriggerConfig())
    with pytest.raises(ValueError, match="config"):
        SequenceAwareTrigger(MODEL, {"slo_ms": 1})
    trig = make()
    with pytest.raises(ValueError, match="no pre-inference in flight"):
        trig.on_prefill_done(10, now=0.0)
    trig.on_prefill_start(10, now=0.0)
    with pytest.raises(ValueError, match="tokens must be <= .* got 11"):
        trig.on_prefill_done(11, now=0.0)
    with pytest.raises(ValueError, match="tokens"):
        trig.on_prefill_start(-1, now=0.0)


def test_concurrent_reserve_never_overshoots_the_inflight_bound():
    trig = make(max_inflight_prefills=3)
    peak = []
    lock = threading.Lock()

    def worker():
        for _ in range(200):
            d = decide(trig, 2000, reserve=True)
            if d.admit:
                with lock:
                    peak.append(trig.stats(now=0.0)["trigger_inflight_prefills"])
                trig.on_prefill_done(2000, now=0.0)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = trig.stats(now=0.0)
    assert max(peak) <= 3
    assert s["trigger_decisions"] == 800 == s["trigger_admits"] + s["trigger_declines_load"]
    assert s["trigger_prefills_started"] == s["trigger_prefills_done"] == s["trigger_admits"]
    assert s["trigger_inflight_prefills"] == 0


# ---------------------------------------------------------------------------------------------------- relaygr calibrate
def test_calibrate_cli_writes_a_loadable_profile(tmp_path, capsys):
    from relaygr_engine.policy.calibration import main

    out = tmp_path / "prof.json"
    rc = main(["--num-layers", "1", "--max-seq-len", "64", "--lengths", "8,16,32", "--candidates", "2,4",
               "--repeats", "1", "--warmup", "0", "--out", str(out)])
    assert rc == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("RESULT device=cpu points=6 ")
    prof = LatencyModel.load(out)
    assert prof.device == "cpu" and len(prof.points) == 6
    assert prof.meta["model_config"]["num_layers"] == 1 and prof.meta["model_config"]["attention"] == "hstu"
    assert {"torch_version", "threads", "fit", "quantile", "repeats"} <= set(prof.meta)


def test_calibrate_cli_rejects_lengths_past_max_seq_len(capsys):
    from relaygr_engine.policy.calibration import main

    assert main(["--max-seq-len", "64", "--lengths", "8,65", "--repeats", "1"]) == 2
    assert "--lengths must be in [1, max_seq_len=64], got [65]" in capsys.readouterr().err
