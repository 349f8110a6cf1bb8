"""``relaygr bench slo --budget-s S``: the plan (the finest settings that fit, from the full ones to the quick
resolution), its deadlines, the usage error of a budget too small, and a budgeted run of two seeds sharing one
model, calibration and set of services (tiny settings, on the CPU)."""
from __future__ import annotations

import json
import time
import types

import pytest

from relaygr_engine import cli
from relaygr_engine.bench import slo, slo_budget, slo_cost
from relaygr_engine.bench.slo_budget import LADDER, Budget, BudgetTooSmall, Plan, choose
from relaygr_engine.policy import LatencyModel

TINY = ["bench", "slo", "--model", "nvidia-hstu", "--layers", "1", "--hidden", "32", "--heads", "1", "--head-dim",
        "32", "--dtype", "float32", "--requests", "10", "--warmup-requests", "5", "--max-history", "128",
        "--max-len-hi", "256", "--candidates", "4", "--no-plots", "--no-progress"]


def test_the_ladder_runs_from_the_full_settings_to_the_quick_resolution():
    full, quick = LADDER[0].values(), LADDER[-1].values()
    assert {k: full[k] for k in slo.FULL_SETTINGS} == slo.FULL_SETTINGS and full["repeats"] == 3
    assert full["warmup_requests"] == 2 * full["requests"]
    assert {k: quick[k] for k in slo.QUICK_SETTINGS} == slo.QUICK_SETTINGS and quick["repeats"] == 1
    # every rung predicted cheaper than the one before it (one seed and a later one, a CPU-like latency model)
    cost = slo_cost.CostModel(LatencyModel(0.5, 0.004, 4e-6, device="cpu"), 64, 1.5)
    shape = slo_cost.SeedShape(modes=["baseline", "relay"], candidates=64, workers=1, mean_len=600.0, growth=10.0,
                               capacity=90.0, max_len_hi=4096)
    for later in (False, True):
        totals = [slo_cost.predict_seed(cost, r.values(), shape, later=later)["total"] for r in LADDER]
        assert all(a > b for a, b in zip(totals, totals[1:])), totals
    first = slo_cost.predict_seed(cost, LADDER[-1].values(), shape)
    assert slo_cost.predict_seed(cost, LADDER[-1].values(), shape, later=True)["runs"] < first["runs"]
    bound = slo_cost.predict_seed(slo_cost.CostModel(cost.lat, 64), LADDER[-1].values(), shape, miss=0.0)
    assert bound["total"] < first["total"]


def _args(**given):
    planned = [k for k in slo_budget.PLANNED if k not in given]
    return types.SimpleNamespace(planned=planned, **{k: given.get(k) for k in slo_budget.PLANNED})


def _predict(cost_per_request: float):
    """A prediction proportional to the measured requests a rung serves (a stand-in for :func:`predict_seed`)."""
    def predict(values, i):
        t = cost_per_request * (values["requests"] + values["warmup_requests"]) * values["repeats"] / values["rel_tol"]
        return {"qps": t, "ref": 0.0, "len": t / values["len_step"], "total": t + t / values["len_step"]}
    return predict


def test_the_plan_is_the_finest_rung_that_fits_and_keeps_the_given_options():
    predict = _predict(0.01)
    costs = [sum(predict(r.values(), i)["total"] for i in range(2)) for r in LADDER]
    left = costs[2] / slo_budget.FIT + 1e-6          # the third rung fits, the second does not
    plan = choose(left, 5.0, 100.0, [0, 1], predict, _args())
    assert plan.rung == LADDER[2].name and plan.fits and plan.values == LADDER[2].values()
    assert plan.total_s == pytest.approx(costs[2]) and plan.seeds == 2 and set(plan.predicted_s) == {"0", "1"}
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.resolution() == {k: LADDER[2].values()[k] for k in ("requests", "rel_tol", "len_step", "repeats")}
    assert any("settings 'medium'" in line for line in plan.lines())
    given = choose(left, 5.0, 100.0, [0, 1], predict, _args(requests=10, len_step=64))
    assert given.values["requests"] == 10 and given.values["len_step"] == 64
    assert given.values["warmup_requests"] == LADDER[0].warmup * 10 and "requests" not in given.planned
    assert choose(left, 5.0, 100.0, [0], predict, _args(), usable=250).values["requests"] <= 125  # a short log


def test_a_budget_the_prediction_passes_runs_the_last_rung_and_one_its_bound_passes_is_refused():
    predict = _predict(0.01)
    last = sum(predict(LADDER[-1].values(), i)["total"] for i in range(2))
    half = lambda values, i: {k: v / 2 for k, v in predict(values, i).items()}  # noqa: E731
    plan = choose(0.8 * last, 5.0, 100.0, [0, 1], predict, _args(), bound=half)
    assert plan.rung == LADDER[-1].name and not plan.fits and "deadlines will cut" in plan.lines()[-1]
    with pytest.raises(BudgetTooSmall, match="argument --budget-s: 100 s cannot reach the quick settings") as e:
        choose(0.4 * last, 5.0, 100.0, [0, 1], predict, _args(), bound=half)
    need = int(str(e.value).split("give --budget-s ")[1].split()[0])
    assert need >= 5.0 + last / slo_budget.FIT and isinstance(e.value, ValueError)


def test_the_budget_clock_shares_the_time_left_and_keeps_the_end_free():
    now = [100.0]
    b = Budget(60.0, started=100.0, clock=lambda: now[0], exit_s=2.0)
    assert b.serve_until() == 100.0 + 60.0 - 3.0 - 2.0          # writing (1.5 x 2 s estimated) and exit kept free
    now[0] = 110.0
    assert (b.elapsed(), b.left()) == (10.0, 50.0)
    soft, abort = b.shares([("qps", 10.0), ("ref", 5.0), ("len", 25.0)], mandatory_s=5.0)
    assert soft == pytest.approx(110.0 + 45.0 * 10 / 40) and abort == pytest.approx(155.0 - 5.0)
    for bad in (0, -1, float("inf"), "60"):
        with pytest.raises(ValueError, match="seconds"):
            Budget(bad)
    with pytest.raises(ValueError, match="exit_s"):
        Budget(10.0, exit_s=-1.0)


def test_a_budget_too_small_is_a_usage_error_before_anything_is_served(tmp_path, capsys):
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        cli.main(TINY + ["--budget-s", "1", "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and time.monotonic() - t0 < 30
    captured = capsys.readouterr()
    line = captured.err.strip().splitlines()[-1]
    assert line.startswith("relaygr bench slo: error: argument --budget-s: 1 s cannot reach the quick settings'")
    assert int(line.split("give --budget-s ")[1].split()[0]) > 1
    assert "searching" not in captured.out and "budget plan" not in captured.out     # nothing served


def test_a_budgeted_run_of_two_seeds_fits_shares_its_set_up_and_resumes(tmp_path, capsys):
    """Two seeds under --budget-s: the whole call ends within S (+10%), the plan is printed before serving and
    recorded in each report, the summary and the points file; the seeds share the model, the calibration and the
    services (built once each); the RESULT line states the budget, the elapsed time and the plan's resolution;
    --resume takes the plan and every point back and measures none of them again."""
    budget = 15.0
    out = tmp_path / "seeds"
    argv = TINY + ["--seeds", "0,1", "--budget-s", f"{budget:g}", "--out", str(out)]
    t0 = time.monotonic()
    assert cli.main(argv) == 0
    took = time.monotonic() - t0
    assert took <= budget * (1 + slo_budget.OVERRUN)
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines.index(next(x for x in lines if x.startswith("budget plan:"))) < \
        lines.index(next(x for x in lines if x.startswith("searching each mode's highest QPS")))
    assert "calibrated full inference measured once for every seed of this command" in text
    result = [x for x in lines if x.startswith("RESULT ")]
    assert len(result) == 1
    fields = dict(kv.split("=") for kv in result[0].split()[1:])
    assert fields["budget_s"] == "15" and 0 < float(fields["elapsed_s"]) <= budget * (1 + slo_budget.OVERRUN)
    assert fields["requests"] == "10" and fields["seeds"] == "2"       # given: kept; the rest planned
    summary = json.loads((out / "summary.json").read_text())["summary"]
    plan = summary["budget"]["plan"]
    assert (float(fields["rel_tol"]), int(fields["len_step"])) == (plan["values"]["rel_tol"],
                                                                    plan["values"]["len_step"])
    assert "requests" not in plan["planned"] and "rel_tol" in plan["planned"]
    assert "## Budget (--budget-s)" in (out / "summary.md").read_text()
    for seed in (0, 1):
        rep = json.loads((out / f"seed{seed}" / "report.json").read_text())
        assert rep["budget"]["plan"] == plan and set(rep["budget"]["phases"]) == {"qps", "ref", "len"}
        assert rep["settings"]["rel_tol"] == plan["values"]["rel_tol"]
        built = rep["setup"]["sharing"]["paid_once"]["services_built"]
        assert built == {"baseline": 1, "relay": 1}                  # one set of services for both seeds
        paid = rep["setup"]["sharing"]["paid_by_this_seed"]
        assert paid["services_built"] == ({"baseline": 1, "relay": 1} if seed == 0 else {})
        assert "## Budget (--budget-s)" in (out / f"seed{seed}" / "report.md").read_text()
        points = [json.loads(x) for x in (out / f"seed{seed}" / "points.jsonl").read_text().splitlines()]
        assert points[0]["settings"]["rel_tol"] is None and [x["plan"] for x in points if "plan" in x] == [plan]
    # --resume: the plan and every point taken back (a search cut by its deadline may go on: new points only)
    before = {seed: (out / f"seed{seed}" / "points.jsonl").read_text().splitlines() for seed in (0, 1)}
    assert cli.main(argv + ["--resume"]) == 0
    assert "budget plan 'full' (made before this seed)".replace("full", plan["rung"]) in capsys.readouterr().out
    for seed in (0, 1):
        after = (out / f"seed{seed}" / "points.jsonl").read_text().splitlines()
        keys = [json.loads(x).get("key") for x in after[1:]]
        assert after[:len(before[seed])] == before[seed] and len(keys) == len(set(keys))
        assert json.loads((out / f"seed{seed}" / "report.json").read_text())["budget"]["plan"] == plan


def test_a_later_seed_brackets_an_unchanged_answer_in_two_evaluations():
    """From an earlier seed's answer the first step is the tolerance (a hair under, so the bisection's test holds
    in floating point) for a QPS, one step for a length."""
    from relaygr_engine.bench.search import search_max

    for tol, prior in ((0.12, 41.86), (0.15, 243.17), (0.08, 1.3)):
        near = slo_cost.expected("qps", ["baseline", "relay"], 10.0, {"baseline": prior}, tol)
        assert near["relay"] == (10.0 * slo_cost.RELAY_QPS_PRIOR, 1.25)   # no answer yet: the estimate
        kw = slo_cost.qps_searches(["baseline"], 1.0, tol, 20, near)["baseline"]
        for answer in (prior * (1 + tol / 2), prior * (1 - tol / 2)):
            seen = []
            res = search_max(lambda x: (seen.append(x) or x <= answer, None), **kw)
            assert len(seen) == 2 and res.status == "ok", (tol, prior, answer, seen)
    near = slo_cost.expected("len", ["baseline"], 1024, {"baseline": 2176}, 128)
    kw = slo_cost.length_searches(["baseline"], 128, 128, 4096, 14, near)["baseline"]
    seen = []
    assert search_max(lambda x: (seen.append(x) or x <= 2200, None), **kw).best == 2176 and seen == [2176, 2304]


def test_a_budgeted_calibration_probes_lengths_in_order_and_keeps_what_fits(monkeypatch):
    """``calibrate_latency(max_s=...)``: lengths probed shortest first stop once half the share is spent; the
    timed rounds are as many as fit (at least one); ``on_probe`` sees the probes' fit before the rounds."""
    from relaygr_engine.bench import slo_shared

    clock = [0.0]
    monkeypatch.setattr(slo_shared, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = []

    class Baseline:  # each call takes its history length in milliseconds on the fake clock
        model = types.SimpleNamespace(config=types.SimpleNamespace(num_items=50, num_actions=2))
        impl, cuda_graphs, compile_model = types.SimpleNamespace(value="paged"), False, False

        def score(self, history, candidates):
            calls.append(len(history))
            clock[0] += len(history) / 1e3

    probed = []
    lat = slo_shared.calibrate_latency(Baseline(), 4, 4096, "cpu", repeats=5, timer=lambda: clock[0], max_s=4.0,
                                       on_probe=lambda model, spent: probed.append((len(calls), spent)))
    assert lat.meta["skipped_lengths"] == [1536, 2048, 3072, 4096] and lat.meta["repeats"] == 1
    assert probed == [(6, pytest.approx(2.72))] and calls == [32, 128, 256, 512, 768, 1024] * 2
    assert lat.meta["wall_per_service"] == pytest.approx(1.0) and lat.predict_ms(1024, 4) == pytest.approx(1024, 0.05)
    calls.clear()
    lat = slo_shared.calibrate_latency(Baseline(), 4, 4096, "cpu", repeats=3, timer=lambda: clock[0])
    assert lat.meta["skipped_lengths"] == [] and len(calls) == 4 * 10          # no budget: every length, 3 rounds
