"""Report maths on synthetic latencies with known answers: percentiles and the SLO searches."""
from __future__ import annotations

import json

import numpy as np
import pytest

from relaygr_engine.bench.report import (latency_summary, percentile, render_markdown, result_line, search_max,
                                         slo_throughput, write_report)


def test_percentiles_interpolate_linearly_between_closest_ranks():
    x = np.arange(1, 101)                     # 1..100, shuffled
    np.random.default_rng(0).shuffle(x)
    assert percentile(x, 99) == pytest.approx(99.01)           # h = 0.99 * 99 = 98.01: 99 + 0.01 * (100 - 99)
    assert percentile(x, 50) == pytest.approx(50.5)
    assert percentile(x, 100) == 100.0 and percentile(x, 0) == 1.0
    assert percentile(np.arange(1, 201), 99) == pytest.approx(198.01)
    assert percentile([5.0], 99) == 5.0
    assert percentile(np.arange(1, 11), 99) == pytest.approx(9.91)          # h = 8.91
    assert percentile(np.arange(1, 11), 10) == pytest.approx(1.9)
    assert percentile(np.arange(1, 11), [0, 50, 100]).tolist() == [1.0, 5.5, 10.0]
    with pytest.raises(ValueError, match="values must hold at least one sample"):
        percentile([], 50)
    with pytest.raises(ValueError, match="values must not hold NaN"):
        percentile([1.0, float("nan")], 50)
    for q in (-1, 100.5, float("nan"), "p99", [50, 101]):
        with pytest.raises(ValueError, match=r"q must be a percent in \[0, 100\]"):
            percentile([1.0], q)


def test_every_benchmark_percentile_is_the_same_definition():
    """report's percentile (the SLO benchmark) is common's (every other benchmark), and it is numpy's default."""
    from relaygr_engine.bench import common, report

    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100, 1001):
        lat = rng.lognormal(size=n)
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert report.percentile(lat, q) == common.percentile(lat, q)
            assert common.percentile(lat, q) == pytest.approx(float(np.percentile(lat, q)), rel=1e-12)
        s = latency_summary(lat)
        assert s["p99_ms"] == pytest.approx(common.percentile(lat * 1e3, 99), rel=1e-12)


def test_exceed_count_is_when_a_percentile_over_a_threshold_is_certain():
    """With exceed_count(n, q) samples over a threshold P_q is over it whatever the others; with one fewer, the others
    can keep it at or below (the SLO benchmark stops a run at that count)."""
    from relaygr_engine.bench.common import exceed_count

    thr = 1.0
    for n in (1, 2, 3, 10, 99, 100, 101, 1000):
        for q in (50, 90, 99, 100):
            k = exceed_count(n, q)
            assert 1 <= k <= n
            assert percentile([2.0] * k + [-1e9] * (n - k), q) > thr
            assert percentile([2.0] * (k - 1) + [-1e9] * (n - k + 1), q) <= thr
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        exceed_count(0, 99)
    with pytest.raises(ValueError, match=r"q must be a percent in \[0, 100\]"):
        exceed_count(10, 101)


def test_latency_summary_is_in_milliseconds():
    s = latency_summary(np.arange(1, 101) / 1000.0)
    assert s["n"] == 100 and s["p99_ms"] == pytest.approx(99.01) and s["p50_ms"] == pytest.approx(50.5)
    assert s["max_ms"] == pytest.approx(100.0) and s["mean_ms"] == pytest.approx(50.5)


def _queue_p99_ms(qps: float, service_ms: float = 10.0) -> float:
    """Known-answer latency model: P99 = service / (1 - rho) below saturation, huge above."""
    rho = qps * service_ms / 1000.0
    return service_ms / (1.0 - rho) if rho < 1 else 1e9


def test_slo_throughput_finds_the_known_threshold():
    # P99 <= 40 ms  <=>  10 / (1 - rho) <= 40  <=>  rho <= 0.75  <=>  qps <= 75
    calls = []

    def run(q):
        calls.append(q)
        return _queue_p99_ms(q), None

    res = slo_throughput(run, 40.0, start_qps=5.0, lo=0.5, hi=1000.0, rel_tol=0.01)
    assert res.status == "ok"
    assert res.best <= 75.0 < res.first_fail
    assert (res.first_fail - res.best) <= 0.01 * res.best
    assert res.best == pytest.approx(75.0, rel=0.011)
    assert len(calls) == len(set(calls))                       # each QPS run once
    assert all(p == (_queue_p99_ms(x) <= 40.0) for x, p, _ in res.points)


def test_search_from_above_sweeps_down_first():
    res = slo_throughput(lambda q: (_queue_p99_ms(q), None), 40.0, start_qps=500.0, lo=0.5, hi=1000.0)
    assert res.status == "ok" and res.best <= 75.0 < res.first_fail
    assert [x for x, _, _ in res.points][:3] == [500.0, 312.5, 195.3125]


def test_search_reports_capped_and_none():
    res = search_max(lambda x: (True, None), 10.0, lo=1.0, hi=100.0)
    assert res.status == "capped" and res.best == 100.0 and res.first_fail is None
    res = search_max(lambda x: (False, None), 10.0, lo=1.0, hi=100.0)
    assert res.status == "none" and res.best is None and res.first_fail == 1.0


def test_integer_search_for_the_longest_length():
    # lengths up to 1000 pass; multiples of 16 only
    res = search_max(lambda L: (L <= 1000, None), 256, lo=16, hi=8192, integer=True, step=16)
    assert res.status == "ok"
    assert res.best == 992 and res.first_fail == 1008
    assert all(x % 16 == 0 for x, _, _ in res.points)


def test_noisy_non_monotone_points_still_give_a_measured_bracket():
    # a spurious pass at 300 above a failure at 200: the answer stays bracketed by measured points below it
    truth = {50: True, 100: True, 200: False, 300: True}
    res = search_max(lambda x: (truth.get(x, x < 150), None), 50, lo=1, hi=400, rel_tol=0.02)
    assert res.status == "ok" and res.best < 150 <= res.first_fail <= 200


def test_result_line_and_report_files(tmp_path):
    line = result_line({"slo_throughput_ratio": 2.345678, "max_len_ratio": None, "p99_ms_relay": 12})
    assert line == "RESULT slo_throughput_ratio=2.346 max_len_ratio=nan p99_ms_relay=12"
    curve = [{"qps": q, "p50_ms": 5.0, "p99_ms": _queue_p99_ms(q), "mean_ms": 6.0, "utilization": q / 100,
              "sources": {"full": 10}, "prefill": {}} for q in (10, 50, 80)]
    mode = {"curve": curve, "slo_throughput": {"best": 75.0, "first_fail": 76.0, "status": "ok"},
            "max_len": {"best": 992, "first_fail": 1008, "status": "ok",
                        "curve": [{"length": 992, "p50_ms": 4.0, "p99_ms": 39.0, "sources": {"full": 10}}]},
            "at_ref": {"p50_ms": 5.0, "p99_ms": 20.0, "sources": {"full": 10}, "hit_rates": {},
                       "prefill": {}, "engine_stats": {}}}
    report = {"setup": {"slo_ms": 40.0, "ref_qps": 20.0}, "modes": {"baseline": mode}, "method": "m",
              "headline": "h", "result_line": line}
    paths = write_report(report, tmp_path / "out", json_path=str(tmp_path / "r.json"))
    for k in ("json", "markdown", "latency_plot", "max_len_plot", "json_copy"):
        assert (tmp_path / "out").exists() and __import__("os").path.getsize(paths[k]) > 0
    assert json.loads((tmp_path / "r.json").read_text())["modes"]["baseline"]["slo_throughput"]["best"] == 75.0
    md = render_markdown(report)
    assert "| baseline | 75 | 992 |" in md and md.rstrip().endswith("```")


def test_lockstep_searches_alternate_and_match_separate_searches():
    from relaygr_engine.bench.report import search_lockstep, search_steps
    order = []

    def ev(name, limit):
        def f(q):
            order.append(name)
            return _queue_p99_ms(q, service_ms=1000.0 / limit / 1.5) <= 40.0, None
        return f

    kw = dict(lo=0.5, hi=1000.0, rel_tol=0.02)
    res = search_lockstep({"a": (search_steps(5.0, **kw), ev("a", 100)), "b": (search_steps(5.0, **kw), ev("b", 20))})
    n = min(order.count("a"), order.count("b"))
    assert order[:2 * n] == ["a", "b"] * n                          # one evaluation of each in turn
    for name, limit in (("a", 100), ("b", 20)):
        alone = slo_throughput(lambda q, limit=limit: (_queue_p99_ms(q, 1000.0 / limit / 1.5), None), 40.0, 5.0,
                               factor=2.0, **kw)
        assert res[name].best == alone.best and res[name].first_fail == alone.first_fail


def test_a_search_started_near_its_answer_brackets_it_in_few_evaluations():
    """``first_factor``: a sweep whose steps start small and square up to ``factor`` (a start measured before);
    an integer search moves at least one step; the result is the same bracket a plain search finds."""
    from relaygr_engine.bench.search import search_max

    seen = []
    res = search_max(lambda x: (seen.append(x) or x <= 230.0, None), 220.0, lo=1.0, hi=1e4, rel_tol=0.15,
                     first_factor=1.15)
    assert seen == [220.0, 220.0 * 1.15] and (res.best, res.status) == (220.0, "ok")   # 2 evaluations
    seen.clear()
    res = search_max(lambda x: (seen.append(x) or x <= 900.0, None), 220.0, lo=1.0, hi=1e4, rel_tol=0.15,
                     first_factor=1.15)
    ratios = [b / a for a, b in zip(seen, seen[1:4])]
    assert ratios == pytest.approx([1.15, 1.15 ** 2, 1.15 ** 4]) and res.status == "ok"   # far: it speeds up
    assert res.best <= 900.0 < res.first_fail <= 1.15 * res.best
    seen.clear()
    res = search_max(lambda x: (seen.append(x) or x <= 2200, None), 2176, lo=128, hi=4096, integer=True, step=128,
                     first_factor=1.02)
    assert seen == [2176, 2304] and (res.best, res.first_fail) == (2176, 2304)   # one step, not a snap in place
    with pytest.raises(ValueError, match="first_factor"):
        search_max(lambda x: (True, None), 1.0, lo=1.0, hi=2.0, factor=2.0, first_factor=3.0)


def test_a_search_stops_at_its_deadline_with_the_bracket_so_far():
    from relaygr_engine.bench.search import search_max

    for limit, want in ((1, (8.0, None)), (2, (8.0, 16.0)), (4, (12.0, 14.0))):
        seen = []
        res = search_max(lambda x: (seen.append(x) or x <= 13.0, None), 8.0, lo=1.0, hi=100.0, rel_tol=0.01,
                         stop=lambda: len(seen) >= limit)
        assert len(seen) == limit and res.status == "deadline" and (res.best, res.first_fail) == want
    res = search_max(lambda x: pytest.fail("evaluated"), 8.0, lo=1.0, hi=100.0, stop=lambda: True)
    assert (res.best, res.first_fail, res.status, res.points) == (None, None, "deadline", [])
    # an evaluation cut short answers None: not counted, the search ends with the bracket measured so far
    answers = iter([(True, None), (False, None), None])
    res = search_max(lambda x: next(answers), 8.0, lo=1.0, hi=100.0, rel_tol=0.01)
    assert (res.best, res.first_fail, res.status, len(res.points)) == (8.0, 16.0, "deadline", 2)
