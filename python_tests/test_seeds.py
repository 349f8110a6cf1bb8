"""Summaries of the SLO benchmark over seeds: medians with min and max, ratios kept per run."""
from __future__ import annotations

import pytest

from relaygr_engine.bench.seeds import parse_seeds, render, summarize_seeds


def _report(qps_relay, qps_base, len_relay, len_base, cx_ratio=None):
    modes = {"baseline": {"slo_throughput": {"best": qps_base}, "max_len": {"best": len_base}},
             "relay": {"slo_throughput": {"best": qps_relay}, "max_len": {"best": len_relay}}}
    rep = {"result": {"slo_throughput_ratio": qps_relay / qps_base, "max_len_ratio": len_relay / len_base,
                      "slo_ms": 100.0}, "modes": modes}
    if cx_ratio is not None:
        rep["crossover"] = {"crossover_p": 1 if cx_ratio >= 1 else None, "policy_p": 2,
                            "rows": [{"P": 1, "qps_vs_colocated": cx_ratio, "len_vs_colocated": None}]}
    return rep


def test_medians_and_spread_over_seeds(tmp_path):
    reports = {0: _report(40, 10, 2000, 1000, 1.2), 1: _report(30, 12, 1500, 1000, 0.9),
               2: _report(60, 10, 3000, 1500, 1.0)}
    s = summarize_seeds(reports)
    r = s["result"]["slo_throughput_ratio"]
    assert (r["median"], r["min"], r["max"]) == (4.0, 2.5, 6.0)   # per-run ratios, not a ratio of medians
    assert s["result"]["max_len_ratio"]["median"] == 2.0 and "slo_ms" not in s["result"]
    assert s["modes"]["relay"]["slo_qps"]["median"] == 40 and s["modes"]["baseline"]["max_len"]["max"] == 1500
    cx = s["crossover"]
    assert cx["crossover_p"] == [1, None, 1] and cx["rows"][0]["qps_vs_colocated"]["median"] == 1.0
    assert cx["rows"][0]["len_vs_colocated"]["median"] is None
    text = render(s, [0, 1, 2], {"workers": {"K": 3}})
    assert "4 [2.5 .. 6]" in text and "Crossover P per seed: [1, None, 1]" in text
    pytest.importorskip("matplotlib")
    from relaygr_engine.bench.seeds import plot_crossover
    assert plot_crossover(cx, 3, tmp_path / "cx.png") and (tmp_path / "cx.png").stat().st_size > 0


def test_parse_seeds_names_the_option():
    assert parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "a", "1,1", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def _write_run(out, seed, settings, qps_relay, qps_base):
    """One seed's run directory as ``bench slo --seeds`` writes it (the report fields a summary reads)."""
    import json
    rep = _report(qps_relay, qps_base, 2000, 1000)
    rep.update(setup={"device": "cpu", "workers": {"K": 1}}, settings=dict(settings, seed=seed))
    (out / f"seed{seed}").mkdir(parents=True)
    (out / f"seed{seed}" / "report.json").write_text(json.dumps(rep))


def test_bench_seeds_summarises_seeds_run_in_separate_calls(tmp_path, capsys):
    """Seeds run one per call into the same directory are summarised afterwards like one --seeds run."""
    from relaygr_engine import cli
    settings = {"model": "nvidia-hstu", "max_history": 16384, "quick": True}
    for seed, qps in ((0, 40), (1, 30), (2, 60)):
        _write_run(tmp_path, seed, settings, qps, 10)
    assert cli.main(["bench", "seeds", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "slo_throughput_ratio=4 " in line and "slo_throughput_ratio_min=3 " in line and line.endswith("seeds=3")
    assert "over seeds 0, 1, 2" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("case", ["differ", "none", "bare"])
def test_bench_seeds_refuses_runs_it_cannot_summarise(tmp_path, capsys, case):
    """Runs with different settings (other than the seed), no runs, or runs that do not record their settings are
    usage errors that name what is wrong; nothing is written."""
    import json
    from relaygr_engine import cli
    if case != "none":
        _write_run(tmp_path, 0, {"max_history": 16384}, 40, 10)
        _write_run(tmp_path, 1, {"max_history": 8192}, 30, 10)
    if case == "bare":
        path = tmp_path / "seed1" / "report.json"
        rep = json.loads(path.read_text())
        del rep["settings"]
        path.write_text(json.dumps(rep))
    with pytest.raises(SystemExit) as ex:
        cli.main(["bench", "seeds", str(tmp_path)])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("relaygr bench seeds: error: argument OUT:")
    assert {"differ": "seed 1 differs from seed 0 in max_history", "none": "got none",
            "bare": "seeds [1] do not record their settings"}[case] in err
    assert not (tmp_path / "summary.md").exists()
