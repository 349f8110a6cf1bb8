"""``relaygr bench kernels``' own shapes (``--shape``), its split-count comparison (``--splits``) and the device timer
its figures come from (:mod:`relaygr_engine.bench.device_timing`). The built-in shapes' smoke run is in
test_kernels.py."""
from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from kernel_problems import ATOL, gpu, needs_cuda, needs_interpreter

from relaygr_engine.bench.device_timing import device_seconds
from relaygr_engine.bench.kernel_shapes import Shape, parse_shape


def test_parse_shape_reads_every_field_and_names_what_is_wrong():
    assert parse_shape("B=1,P=3968,n=128,C=256,H=4,D=256", "hstu") == Shape(1, 3968, 128, 256, 4, 256, 64, "hstu")
    assert parse_shape("B=2 P=0 n=5 C=0 H=1 D=32 page=16", "softmax") == Shape(2, 0, 5, 0, 1, 32, 16, "softmax")
    with pytest.raises(ValueError, match="lacks \\['D'\\]"):
        parse_shape("B=1,P=64,n=1,C=2,H=1", "hstu")
    with pytest.raises(ValueError, match="KEY=INTEGER .* got 'X=3'"):
        parse_shape("B=1,P=64,n=1,C=2,H=1,D=32,X=3", "hstu")
    with pytest.raises(ValueError, match="KEY=INTEGER .* got 'D=-1'"):
        parse_shape("B=1,P=64,n=1,C=2,H=1,D=-1", "hstu")
    with pytest.raises(ValueError, match="new \\+ candidates >= 1"):
        parse_shape("B=1,P=64,n=0,C=0,H=1,D=32", "hstu")


@needs_interpreter
def test_bench_kernels_times_a_given_shape_at_each_split_count(tmp_path, capsys):
    from relaygr_engine.bench import kernels as bench

    path = tmp_path / "k.json"
    spec = "B=1,P=300,n=3,C=5,H=2,D=32,page=16"
    assert bench.main(["--modes", "hstu,softmax", "--shape", spec, "--splits", "auto,3", "--json", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = out[-1]
    assert "geomean_ms_s1=" in last and "geomean_ms_s3=" in last  # auto: no split in the interpreter
    assert "geomean_ms_split_" not in last  # (one rule: no comparison of rules)
    rows = json.loads(path.read_text())["rows"]
    assert sorted((r["mode"], r["splits"]) for r in rows) == [("hstu", 1), ("hstu", 3), ("softmax", 1),
                                                              ("softmax", 3)]
    # keys per split: 303 keys (prefix and new history) in one share of 320, or in three of 128 (64-key multiples)
    assert {(r["splits"], r["split_keys"]) for r in rows} == {(1, 320), (3, 128)}
    assert any("keys/S" in line for line in out)
    assert all(r["prefix"] == 300 and r["cands"] == 5 and r["max_abs_err"] <= ATOL for r in rows)
    for bad in (["--shape", "B=1,P=64"], ["--splits", "0"], ["--splits", "33"], ["--splits", "two"],
                ["--splits", "auto,fill"], ["--hopper-overlap", "yes"]):  # (the last two: options removed)
        with pytest.raises(SystemExit):
            bench.main(bad)
    err = capsys.readouterr().err
    assert "--shape: 'B=1,P=64' lacks" in err and "--splits must be 'auto' and/or integers in [1, 32]" in err


@needs_interpreter
def test_bench_kernels_compares_value_splits(tmp_path, capsys):
    """``--value-splits auto,2``: each shape once per value, exact, one geomean each (auto: one program per tile in
    the interpreter); a value that is not a power of two is a usage error."""
    from relaygr_engine.bench import kernels as bench

    path = tmp_path / "k.json"
    assert bench.main(["--modes", "softmax", "--shape", "B=2,P=100,n=3,C=5,H=2,D=32,page=16", "--value-splits",
                       "auto,2", "--json", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "geomean_ms_vauto=" in out[-1] and "geomean_ms_v2=" in out[-1]
    rows = json.loads(path.read_text())["rows"]
    assert [r["value_splits"] for r in rows] == [None, 2] and all(r["max_abs_err"] <= ATOL for r in rows)
    with pytest.raises(SystemExit):
        bench.main(["--value-splits", "3"])
    assert "--value-splits must be 'auto' and/or powers of two" in capsys.readouterr().err


@needs_interpreter
def test_bench_kernels_concurrent_tiles_choices(tmp_path, capsys):
    """``--concurrent-tiles auto,no``: each shape once per value, each row saying what ran (one stream off CUDA);
    ``yes`` off CUDA and an unknown word are usage errors."""
    from relaygr_engine.bench import kernels as bench

    path = tmp_path / "k.json"
    assert bench.main(["--modes", "hstu", "--shape", "B=1,P=100,n=3,C=5,H=1,D=32,page=16", "--concurrent-tiles",
                       "auto,no", "--json", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(path.read_text())["rows"]
    assert [r["concurrent"] for r in rows] == [False, False] and all(r["max_abs_err"] <= ATOL for r in rows)
    assert any(" cc " in line for line in out) and "geomean_ms_cc" not in out[-1]  # (one value ran: nothing to compare)
    # (as a CUDA run's rows would be: one each way) a geomean per value, to compare them in one run
    from relaygr_engine.bench import kernels_summary as S

    rows[0].update(concurrent=True, time_ms=2.0)
    rows[1].update(concurrent=False, time_ms=3.0)
    summary = S.summarize(rows, device="cpu", dtype="float32")
    assert (summary["geomean_ms_ccy"], summary["geomean_ms_ccn"]) == pytest.approx((2.0, 3.0))
    assert " y " in S.row_line(rows[0]) and " n " in S.row_line(rows[1])
    for bad, msg in ((["--concurrent-tiles", "yes"], "--concurrent-tiles yes needs a CUDA device (streams), got cpu"),
                     (["--concurrent-tiles", "maybe"], "--concurrent-tiles must be 'auto', 'no', 'yes'")):
        with pytest.raises(SystemExit):
            bench.main(bad)
        assert msg in capsys.readouterr().err


@needs_interpreter
def test_bench_kernels_split_dtype_choices(tmp_path, capsys):
    """``--split-dtype model,fp16``: each shape once per value, each split row naming the partials' dtype that ran
    (model: fp32 in the interpreter), a geomean per dtype; an unsplit row names none; bf16 in the interpreter and
    an unknown name are usage errors."""
    from relaygr_engine.bench import kernels as bench

    path = tmp_path / "k.json"
    shape = ["--modes", "hstu", "--shape", "B=1,P=100,n=3,C=5,H=1,D=32,page=16"]
    assert bench.main(shape + ["--splits", "2", "--split-dtype", "model,fp16", "--json", str(path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(path.read_text())["rows"]
    assert [r["split_dtype"] for r in rows] == ["fp32", "fp16"] and all(r["max_abs_err"] <= 2e-3 for r in rows)
    assert "geomean_ms_sd_fp16=" in out[-1] and "geomean_ms_sd_fp32=" in out[-1]
    assert any(" fp16 " in line for line in out)
    assert bench.main(shape + ["--splits", "1", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["rows"][0]["split_dtype"] is None
    capsys.readouterr()
    for bad, msg in ((["--split-dtype", "bf16"], "--split-dtype bf16 cannot run in the CPU interpreter"),
                     (["--split-dtype", "fp8"], "--split-dtype must be 'model', 'fp32', 'fp16', 'bf16'")):
        with pytest.raises(SystemExit):
            bench.main(bad)
        assert msg in capsys.readouterr().err


def test_device_seconds_on_the_cpu_is_the_median_wall_time():
    calls = []
    t = device_seconds(lambda: calls.append(1), torch.device("cpu"), warmup=2, iters=5)
    assert len(calls) == 7 and 0 <= t < 1


@gpu
@needs_cuda
def test_device_seconds_replays_a_captured_call_and_falls_back_where_capture_fails(caplog):
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    seen = []

    def step():
        seen.append(1)
        return x @ x

    t = device_seconds(step, device, warmup=1, iters=10)
    assert len(seen) == 2 and t > 0             # the warm-up and the capture ran Python; ten replays did not
    host_read = lambda: float((x @ x).sum())    # noqa: E731 - a host read cannot be captured
    with caplog.at_level(logging.WARNING, logger="relaygr_engine.bench.device_timing"):
        assert device_seconds(host_read, device, warmup=1, iters=3) > 0
    assert "cannot be captured in a CUDA graph" in caplog.text
    assert float(torch.randn(1000, device=device).std()) > 0.5  # random ops still work after the failed capture


def test_run_gpu_sh_kernel_steps_parse(tmp_path, monkeypatch):
    """Every ``bench kernels`` step of benchmarks/run_gpu.sh parses as on a CUDA machine and reaches its first
    shape (a bad option there would cost a device call): the device is faked, the first shape's run stops it."""
    import pathlib
    import shlex

    from relaygr_engine.bench import kernels as bench

    class Reached(Exception):
        pass

    def first_shape(shape, device, dtype, **kw):
        raise Reached(kw)

    monkeypatch.setattr(bench, "_prepare_device", lambda name: (torch.device("cuda"), ""))
    monkeypatch.setattr(bench, "run_shape", first_shape)
    script = (pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "run_gpu.sh").read_text()
    lines = [x for x in script.replace("\\\n", " ").splitlines()
             if "relaygr_engine.cli bench kernels" in x and "--summarize" not in x]
    assert len(lines) >= 7
    for line in lines:
        before, cmd = line.split("relaygr_engine.cli bench kernels", 1)
        argv = shlex.split(cmd.replace("${OUT_DIR}", str(tmp_path)).replace("${d}", "64"))
        with monkeypatch.context() as env:
            for name, value in re.findall(r"\b(RELAYGR_\w+)=(\S+)", before):  # the step's environment
                env.setenv(name, value)
            with pytest.raises(Reached) as got:
                bench.main(argv)
        if "--kv-dtype" in argv:  # the 8-bit steps switch the kernel's 8-bit read on: refused without it on CUDA
            with pytest.raises(SystemExit):
                bench.main(argv)
        if "--concurrent-tiles" in argv:  # kernels-splits: the ranking layer, its first split count, both ways
            assert got.value.args[0]["splits"] is None and got.value.args[0]["concurrent_tiles"] is None
        if "--split-dtype" in argv:  # kernels-split-dtype: the launcher's partials first
            assert got.value.args[0]["split_dtype"] is None


def test_profile_rank_counts_overlapping_kernels_once():
    """benchmarks/tools/profile_rank.py's GPU busy time is the union of the kernels' spans: two launches running at once
    (the history and candidate tiles on two streams) count once, gaps not at all."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tools" / "profile_rank.py"
    spec = importlib.util.spec_from_file_location("profile_rank", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.busy_us([(20, 25), (0, 10), (5, 15), (21, 22), (15, 16)]) == 21.0
    assert module.busy_us([]) == 0.0 and module.busy_us([(3, 3)]) == 0.0
    # --interleave: only the kernels inside a ranking's own call count (not the full inference's or the miss's)
    spans = [(1, 4), (5, 9), (12, 14), (13, 21), (30, 31)]
    assert module.within(spans, [(0, 10), (12, 20), (30, 31)]) == [(1, 4), (5, 9), (12, 14), (30, 31)]


def test_the_matmul_reference_is_the_best_of_its_readings(monkeypatch):
    """A slow reading of the roofline matmul (a transient of the GPU) must not lower the reference a row is
    compared with: the rate comes from the fastest of the readings, each a median."""
    from relaygr_engine.bench import kernels as bench

    readings = iter([2e-3, 1e-3, 4e-3])
    monkeypatch.setattr(bench, "_time", lambda fn, device, warmup, iters: next(readings))
    flops = 2 * 4096 * 4096 * 128
    got = bench._matmul_tflops(flops, torch.device("cpu"), torch.float32, 0, 1)
    assert got == pytest.approx(flops / 1e-3 / 1e12)
    assert next(readings, None) is None  # every reading taken


def test_bench_kernels_reports_the_hopper_kernel_beside_the_portable_one():
    """``bench kernels --hopper-kernel no,yes``: one geomean time per setting and the long shapes' matmul fraction
    of each mode and setting in its own field (the portable kernel's as before)."""
    from relaygr_engine.bench import kernels_summary as S

    def row(hk, ms, frac, mode="hstu"):
        return dict(shape="x", mode=mode, block_m=128, speedup_vs_gathered=1.0, speedup_vs_recompute=2.0,
                    paged_overhead=0.0, max_abs_err=1e-3, time_ms=ms, prefix=4096, new=32, cands=256, users=4,
                    matmul_fraction=frac, hopper_kernel=hk, tflops=100.0, gbps=1.0, plan_ms=0.1,
                    speedup_vs_flashinfer=None, flashinfer_note="-")

    summary = S.summarize([row(False, 2.0, 0.25), row(True, 1.0, 0.5)], device="cuda", dtype="bfloat16")
    assert summary["geomean_ms_hopper_no"] == 2.0 and summary["geomean_ms_hopper_yes"] == 1.0
    assert summary["matmul_fraction_long_hstu"] == 0.25 and summary["matmul_fraction_long_hstu_hopper"] == 0.5
    assert "hk" in S.header(True) and S.row_line(row(True, 1.0, 0.5)).split()[7] == "y"
    plain = S.summarize([row(False, 2.0, 0.25)], device="cuda", dtype="bfloat16")
    assert "geomean_ms_hopper_no" not in plain and "matmul_fraction_long_hstu_hopper" not in plain
    both = S.summarize([row(False, 2.0, 0.25), row(True, 1.0, 0.5), row(False, 4.0, 0.2, "softmax"),
                        row(True, 1.0, 0.8, "softmax")], device="cuda", dtype="bfloat16")
    assert (both["matmul_fraction_long_softmax"], both["matmul_fraction_long_softmax_hopper"]) == (0.2, 0.8)
    assert (both["matmul_fraction_long_hstu"], both["matmul_fraction_long_hstu_hopper"]) == (0.25, 0.5)
    from relaygr_engine.bench.autotune_report import describe  # the portable kernel's share, in the autotuned lines

    key = dict(HSTU=True, CAND_TILES=True, SPLIT=True, HEAD_DIM=256, BLOCK_M=128, TMA_READS=1)
    assert describe(dict(key, SKIP_FULL=32)) == "hstu cand split rest-of-32 D=256 BM=128 reads=either"
    assert "rest-of" not in describe(dict(key, SKIP_FULL=0))
