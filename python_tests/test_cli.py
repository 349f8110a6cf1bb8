"""The ``relaygr`` command line and smoke runs of the cheap benchmarks (each must end with a RESULT line)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relaygr_engine import cli
from relaygr_engine._ext import EXTENSION_LOADED


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def parse_result(line: str) -> dict[str, str]:
    assert line.startswith("RESULT "), line
    return dict(kv.split("=", 1) for kv in line.split()[1:])


def test_info(capsys):
    assert cli.main(["info"]) == 0
    r = parse_result(last_line(capsys))
    assert r["extension_loaded"] == str(int(EXTENSION_LOADED))


def test_usage_and_unknown_commands(capsys):
    assert cli.main([]) == 0
    assert "relaygr bench NAME" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):
        cli.main(["bogus"])
    assert "unknown command" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        cli.main(["bench", "nonsense"])
    err = capsys.readouterr().err
    assert "pool" in err and "rank" in err and "tiers" in err


def test_bench_pool_smoke(tmp_path, capsys):
    path = tmp_path / "pool.json"
    assert cli.main(["bench", "pool", "--quick", "--json", str(path)]) == 0
    r = parse_result(last_line(capsys))
    assert float(r["py_ops_per_s"]) > 0
    if EXTENSION_LOADED:
        assert float(r["cpp_ops_per_s"]) > 0 and float(r["speedup"]) > 0
    data = json.loads(path.read_text())
    assert data["result"]["py_ops_per_s"] == int(r["py_ops_per_s"])


def test_bench_tiers_smoke(capsys):
    assert cli.main(["bench", "tiers", "--lengths", "64,96", "--repeats", "1", "--candidates", "4"]) == 0
    r = parse_result(last_line(capsys))
    assert float(r["reload_ms"]) > 0 and float(r["recompute_ms"]) > 0 and float(r["rank_hbm_ms"]) > 0
    # a DRAM hit against an HBM hit (issue 26's third goal, read at 8k tokens on a GPU), at every length
    assert all(float(r[f"dram_{k}_vs_hbm_L{L}"]) > 0 for k in ("layer", "serial") for L in (64, 96))


def test_bench_rank_smoke(capsys):
    assert cli.main(["bench", "rank", "--quick", "--threads", "1"]) == 0
    r = parse_result(last_line(capsys))
    assert any(k.startswith("speedup_L") for k in r)
    assert r["kv_dtype"] == "model" and "kv8_read" not in r


def test_bench_rank_on_8bit_pages_names_the_path_that_read_them(capsys):
    """``--kv-dtype int8``: the engine's pages in int8; on the CPU the torch path reads them (``kv8_read``)."""
    assert cli.main(["bench", "rank", "--quick", "--threads", "1", "--lengths", "256", "--kv-dtype", "int8"]) == 0
    r = parse_result(last_line(capsys))
    assert r["kv_dtype"] == "int8" and r["kv8_read"] == "torch" and float(r["max_abs_diff"]) < 0.05


def test_console_script_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "relaygr_engine.cli", "info"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("RESULT ")


def test_bench_rank_graph_speedup_compares_both_graphed():
    """``graph_speedup`` is full inference over the cached ranking with both graphed through the same kernels (the
    engine's no-cache forward); the eager dense full inference is ``graph_speedup_vs_dense`` (the H100 run of
    2026-11-25: 7.67 and 13.1 ms over 2.18 ms)."""
    from relaygr_engine.bench.rank import graph_result

    r = graph_result(4096, 256, full_ms=13.1, cached_ms=9.55, graph_full_ms=7.67, graph_cached_ms=2.18)
    assert r == {"graph_cached_ms_L4096_C256": 2.18, "graph_recompute_ms_L4096_C256": 7.67,
                 "graph_speedup_L4096_C256": 3.52, "graph_speedup_vs_dense_L4096_C256": 6.01,
                 "graph_gain_L4096_C256": 4.38}


def test_bench_rank_back_to_back_calls_each_once_and_averages(monkeypatch):
    """``graph_cached_b2b_ms``'s timer: ``n`` calls one after the other, the time per call (a fake clock that each
    call moves by 5 ms)."""
    import torch

    from relaygr_engine.bench import rank

    clock = [100.0]
    monkeypatch.setattr(rank.time, "perf_counter", lambda: clock[0])
    assert rank.back_to_back_ms(lambda: clock.__setitem__(0, clock[0] + 0.005), torch.device("cpu"), 4) == \
        pytest.approx(5.0)
    # on CUDA (a stand-in synchronise): once before and once after, or after every call too (each call's latency)
    log = []
    monkeypatch.setattr(rank.torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    call = lambda: log.append("call")  # noqa: E731
    rank.back_to_back_ms(call, torch.device("cuda"), 3)
    assert log == ["sync", "call", "call", "call", "sync"]
    log.clear()
    rank.back_to_back_ms(call, torch.device("cuda"), 2, wait_each=True)
    assert log == ["sync", "call", "sync", "call", "sync", "sync"]
