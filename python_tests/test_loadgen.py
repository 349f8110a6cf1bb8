"""``relaygr bench loadgen``: short MLPerf LoadGen Server runs (a few seconds, a small model), in process and against
``relaygr serve`` over HTTP; every query answered, LoadGen's summary valid, HTTP scores exact."""
from __future__ import annotations

import json
import shlex

import pytest

from relaygr_engine.bench import loadgen
from serve_helpers import needs_ray

pytest.importorskip("mlperf_loadgen", reason="mlperf_loadgen is not installed (pip install 'relaygr-engine[loadgen]')")

# A small ranker and short histories: one query costs about a millisecond, so 480 queries at 160 QPS take three
# seconds per mode, and a generous bound keeps every query within it on a loaded machine (LoadGen's early stopping
# then finds the run valid: 480 queries without a late one suffice at the 99th percentile).
SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--head-dim", "16", "--num-items", "512",
         "--candidates", "16", "--length-scale", "1", "--max-history", "128", "--max-len-hi", "128", "--no-max-len",
         "--hbm-mb", "4", "--dram-mb", "4", "--slo-ms", "2000", "--pipeline-delay-ms", "5", "--min-duration-s", "0",
         "--warmup-requests", "32", "--repeats", "1", "--no-plots", "--no-progress", "--no-vclock"]


def _report(out) -> dict:
    return json.loads((out / "report.json").read_text())


def _summary(point: dict) -> str:
    with open(f"{point['logs']}/mlperf_log_summary.txt", encoding="utf-8") as f:
        return f.read()


def test_an_in_process_server_run_answers_every_query_and_is_valid(tmp_path, capsys):
    out = tmp_path / "lg"
    assert loadgen.main(SMALL + ["--requests", "480", "--target-qps", "160", "--out", str(out)]) == 0
    assert "RESULT loadgen_slo_throughput_ratio=" in capsys.readouterr().out
    report = _report(out)
    for mode in ("baseline", "relay"):
        p = report["targets"]["in_process"][mode]["at_ref"]
        assert p["queries"] == p["issued"] == p["answered"] == 480 and p["errors"] == 0, p
        assert p["loadgen"]["query_count"] == 480 and p["loadgen"]["validity"] == "VALID", p["loadgen"]
        text = _summary(p)
        assert "Scenario : Server" in text and "Result is : VALID" in text
        assert "Performance constraints satisfied : Yes" in text and "Early stopping satisfied: Yes" in text
    relay = report["targets"]["in_process"]["relay"]["at_ref"]
    assert relay["prefill"]["signals"] == 480 and relay["sources"].get("hbm", 0) > 0  # pre-infers were used


def test_usage_errors_name_the_options(capsys):
    for argv, words in ((["--workers", "2"], "expected --workers 1"),
                        (["--no-in-process"], "--no-in-process needs --url"),
                        (["--url", "ftp://x/"], "argument --url: url must be an http:// URL"),
                        (["--url", "http://127.0.0.1:1/", "--kv-dtype", "int8"], "--kv-dtype model")):
        with pytest.raises(SystemExit) as e:
            loadgen.main(SMALL + argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err


@needs_ray
@pytest.mark.ray
def test_an_http_run_against_relaygr_serve_is_exact_and_loses_nothing(tmp_path, capsys):
    from ray_local import serve_process, server_port

    out = tmp_path / "lg"
    base = SMALL + ["--requests", "120", "--out", str(out)]
    assert loadgen.main(base + ["--serve-command"]) == 0
    cmd = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert cmd[:2] == ["relaygr", "serve"]
    port = server_port()
    with serve_process(cmd[2:], port, tmp_path / "serve.log"):
        assert loadgen.main(base + ["--url", f"http://127.0.0.1:{port}/", "--no-in-process", "--target-qps", "60",
                                    "--latency-profile", str(out / "latency_profile.json"),
                                    "--check-every", "4"]) == 0
    r = _report(out)["result"]
    assert r["http_queries"] == 240 and r["http_queries_lost"] == 0
    assert r["http_checked"] == 60 and r["http_max_abs_diff"] < 1e-4
    relay = _report(out)["targets"]["http"]["relay"]["at_ref"]
    assert relay["client"]["rank_by_difference"] > 0  # rankings with a ticket went by difference
    assert "Result is : " in _summary(relay) and relay["answered"] == 120
