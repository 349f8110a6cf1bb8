"""What a user meets on the command line: every documented mistake is a one-line usage error naming the user's flag
(exit status 2, no traceback, before any work), help texts say what the options really do, the report is written
before its plots, and progress-bar rows go through the bar's own write."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from relaygr_engine import cli, cli_args
from relaygr_engine.bench import demo, report, slo


def usage_error(capsys, argv) -> str:
    """Run ``relaygr argv`` in-process; assert a one-line usage error with status 2; return that line."""
    with pytest.raises(SystemExit) as ex:
        cli.main(argv)
    assert ex.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


@pytest.fixture
def short_csv(tmp_path):
    path = tmp_path / "short.csv"
    rows = ["user_id,item_id,timestamp"] + [f"{u},{i},{60 * i}" for u in range(3) for i in range(4)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("argv, flag, says", [
    (["bench", "slo", "--slo-ms", "-5"], "--slo-ms", "expected a number > 0, got -5"),
    (["bench", "transfer", "--lengths", "256,0"], "--lengths", "each an integer >= 1, got '256,0'"),
    (["bench", "tiers", "--repeats", "0"], "--repeats", "expected an integer >= 1, got 0"),
    (["bench", "slo", "--slo-ms", "nan"], "--slo-ms", "expected a number > 0"),
    (["bench", "slo", "--data", "/nonexistent.csv"], "--data", "no such file"),
    (["bench", "slo", "--modes", "foo"], "--modes", "baseline, relay, relay_no_expander, got 'foo'"),
    (["bench", "slo", "--modes", "baseline,relay,fast"], "--modes", "got 'fast'"),
    (["bench", "slo", "--requests", "0"], "--requests", "expected an integer >= 1, got 0"),
    (["bench", "slo", "--requests", "ten"], "--requests", "expected an integer >= 1, got 'ten'"),
    (["demo", "--requests", "0"], "--requests", "expected an integer >= 1, got 0"),
    (["demo", "--threads", "0"], "--threads", "expected an integer >= 1"),
    (["demo", "--dram-mb", "-1"], "--dram-mb", "expected a number >= 0"),
    (["demo", "--modes", "baseline"], "--modes", "needs a relay mode"),
    (["demo", "--timer", "cpu", "--threads", "2"], "--timer cpu", "--threads 2"),
    (["demo", "--candidates", "100", "--num-items", "50"], "--candidates", "--num-items (50)"),
    (["demo", "--max-len-hi", "64"], "--len-step (128)", "--max-len-hi (64)"),
    (["demo", "--bogus"], "--bogus", "unrecognized arguments"),
    (["bench", "nonsense"], "NAME", "got 'nonsense'"),
    (["bench"], "NAME", "missing"),
    (["nonsense"], "unknown command", "'nonsense'"),
])
def test_each_mistake_is_a_one_line_usage_error_naming_the_flag(capsys, argv, flag, says):
    line = usage_error(capsys, argv)
    assert flag in line and says in line, line
    assert "budget_ms" not in line and "num_requests" not in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_cuda_on_a_cpu_only_torch_is_a_usage_error(capsys):
    line = usage_error(capsys, ["demo", "--device", "cuda"])
    assert "argument --device" in line and "no CUDA device" in line and "use cpu" in line


def test_device_typos_are_named(capsys):
    line = usage_error(capsys, ["bench", "slo", "--device", "gpu0"])
    assert "argument --device" in line and "'gpu0'" in line


def test_a_too_short_log_speaks_in_the_users_flags(capsys, short_csv):
    line = usage_error(capsys, ["demo", "--data", str(short_csv), "--requests", "5"])
    assert f"--data {short_csv} has 9 events usable as requests" in line
    assert "--requests 5 + --warmup-requests 5 need 10" in line


def test_an_unreadable_log_is_a_usage_error_naming_data(capsys, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("user_id,item_id,timestamp\n1,2,yesterday\n")
    line = usage_error(capsys, ["bench", "slo", "--data", str(bad)])
    assert line.startswith("relaygr bench slo: error: argument --data:") and "cannot parse row" in line


def test_missing_optional_dependencies_stop_before_any_work(capsys, monkeypatch):
    real = cli_args.importlib.util.find_spec
    monkeypatch.setattr(cli_args.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    line = usage_error(capsys, ["demo"])
    assert "matplotlib" in line and "pip install 'relaygr-engine[bench]'" in line and "--no-plots" in line
    # --no-plots runs without it: the same checks then pass (the run itself is not started here)
    args = demo.build_parser().parse_args(["--no-plots", "--no-progress"])
    slo.check_args(demo.build_parser(), args)


def test_a_usage_error_from_the_console_script_has_no_traceback():
    out = subprocess.run([sys.executable, "-m", "relaygr_engine.cli", "bench", "slo", "--slo-ms", "-5"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "relaygr bench slo: error: argument --slo-ms: expected a number > 0, got -5 (see relaygr bench slo --help)"]


def test_every_listed_benchmark_has_a_command_line():
    """``relaygr bench --help`` lists the registered benchmarks, each a module with a command line; helper modules
    (``slo_setup``, ``report``, ...) and the kernel-developer tools (``ptxas``, ``sass``) are not among them."""
    import importlib
    names = cli._benchmarks()
    assert {"kernels", "overhead", "rank", "slo", "tiers"} <= set(names)
    assert not {"ptxas", "sass", "slo_setup", "slo_run", "common", "report", "workload", "demo"} & set(names)
    for name in names:
        assert callable(importlib.import_module(cli.BENCHMARKS[name]).main), name


def test_a_developer_tool_named_as_a_benchmark_says_where_it_runs(capsys):
    """``relaygr bench ptxas``: a usage error naming the checkout's tool, not an unknown name."""
    with pytest.raises(SystemExit) as ex:
        cli.main(["bench", "ptxas", "--defaults"])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "python -m benchmarks.tools.ptxas" in err and "checkout" in err


def test_help_texts(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "``" not in text and "relaygr bench NAME" in text and "slo" in text
    assert cli.main(["bench", "--help"]) == 0
    assert "NAME: " in capsys.readouterr().out
    with pytest.raises(SystemExit) as ex:
        cli.main(["demo", "--help"])
    assert ex.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 100; 200 with --thorough)" in text  # --requests: what the demo really runs
    assert "--quick" not in text and "(default: True)" not in text and "(default: None)" not in text


def test_quick_and_full_settings_keep_the_users_values():
    def settings(argv):
        args = demo.build_parser().parse_args(argv)
        slo.apply_settings(args)
        return args.requests, args.warmup_requests, args.len_step

    assert settings([]) == (100, 100, 128)
    assert settings(["--thorough"]) == (200, 400, 32)
    assert settings(["--requests", "300"]) == (300, 300, 128)  # not capped by the quick settings
    full = slo.build_parser().parse_args(["--quick", "--len-step", "64"])
    slo.apply_settings(full)
    assert (full.requests, full.len_step) == (100, 64)


def _report() -> dict:
    point = {"qps": 10.0, "p50_ms": 5.0, "p99_ms": 50.0, "mean_ms": 6.0, "stopped_early": False}
    mode = {"curve": [point], "slo_throughput": {"best": 10.0, "first_fail": 12.0, "status": "ok"},
            "at_ref": dict(point, sources={"hbm": 3}, hit_rates={"hbm": 1.0})}
    return {"setup": {"slo_ms": 100.0, "ref_qps": 5.0}, "modes": {"baseline": mode, "relay": mode},
            "result_line": "RESULT x=1"}


def test_the_report_is_written_before_its_plots(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(report, "plot_latency_vs_qps", broken)
    with pytest.raises(RuntimeError, match="plotting failed"):
        report.write_report(_report(), tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["result_line"] == "RESULT x=1"
    assert "RESULT x=1" in (tmp_path / "report.md").read_text()


def test_no_plots_writes_a_report_without_images(tmp_path):
    paths = report.write_report(_report(), tmp_path, plots=False)
    assert set(paths) == {"json", "markdown"}
    assert ".png" not in (tmp_path / "report.md").read_text() and not list(tmp_path.glob("*.png"))


def test_rows_go_through_the_progress_bars_own_write(capsys, monkeypatch):
    from tqdm import tqdm

    written = []
    real = tqdm.write
    monkeypatch.setattr(tqdm, "write", classmethod(lambda cls, s, **kw: (written.append(s), real(s, **kw))))
    console = slo.Console(show_bar=True)
    console.say("before the bar")
    console.start("baseline 10 QPS", total=5)
    console.bar.update(2)
    console.say("  baseline   10 QPS  ok")
    console.close()
    console.say("after the bar")
    assert written == ["  baseline   10 QPS  ok"]
    assert capsys.readouterr().out.splitlines() == ["before the bar", "  baseline   10 QPS  ok", "after the bar"]
