"""Model presets and size flags of the benchmarks (``--model``, ``--layers/--hidden/--heads/--head-dim/--dtype``),
the device-dependent defaults of ``bench slo``, and the GPU seeds command line (parsed here, run on a CPU at tiny
settings)."""
from __future__ import annotations

import json
import types

import pytest
import torch

from relaygr_engine import cli
from relaygr_engine.bench import demo, slo, slo_setup
from relaygr_engine.models.presets import PRESETS, ModelPreset, ModelShape, shape_of

from test_cli_errors import usage_error

GPU_SEEDS = ["bench", "slo", "--device", "cuda", "--model", "nvidia-hstu", "--seeds", "0,1,2"]


def test_one_table_names_the_demo_model_and_nvidias_hstu_shape():
    assert PRESETS[ModelPreset.SMALL] == ModelShape(2, 64, 2, 32, "float32")
    nv = PRESETS[ModelPreset.NVIDIA_HSTU]
    assert (nv.num_layers, nv.hidden_dim, nv.num_heads, nv.head_dim, nv.dtype) == (8, 1024, 4, 256, "bfloat16")
    assert nv.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2 == 32768
    assert "32 KiB of KV per token" in nv.describe()
    assert PRESETS[ModelPreset.SMALL].kv_bytes_per_token == 2 * 2 * 2 * 32 * 4


def test_sizes_replace_the_presets_and_hidden_follows_heads_times_head_dim():
    assert shape_of("nvidia-hstu", num_layers=2) == ModelShape(2, 1024, 4, 256, "bfloat16")
    assert shape_of("small", num_heads=4).hidden_dim == 128
    assert shape_of("small", num_heads=4, hidden_dim=48).hidden_dim == 48
    assert shape_of("nvidia-hstu", dtype="float32").kv_bytes_per_token == 65536
    cfg = shape_of("small").config(num_items=10, max_seq_len=64)
    assert (cfg.num_layers, cfg.hidden_dim, cfg.num_heads, cfg.head_dim) == (2, 64, 2, 32)


@pytest.mark.parametrize("kwargs, says", [
    (dict(preset="large"), "preset must be one of 'small', 'nvidia-hstu', got 'large'"),
    (dict(num_layers=0), "num_layers must be an integer >= 1, got 0"),
    (dict(head_dim=2.5), "head_dim must be an integer >= 1, got float 2.5"),
    (dict(dtype="float8"), "dtype must be one of"),
])
def test_bad_shapes_raise_naming_the_field(kwargs, says):
    with pytest.raises(ValueError, match=says):
        shape_of(**kwargs)


@pytest.mark.parametrize("bench", ["slo", "rank", "tiers"])
@pytest.mark.parametrize("flags, flag, says", [
    (["--layers", "0"], "argument --layers", "expected an integer >= 1, got 0"),
    (["--hidden", "wide"], "argument --hidden", "expected an integer >= 1, got 'wide'"),
    (["--heads", "-2"], "argument --heads", "expected an integer >= 1, got -2"),
    (["--head-dim", "1.5"], "argument --head-dim", "expected an integer >= 1, got '1.5'"),
    (["--dtype", "fp8"], "argument --dtype", "invalid choice: 'fp8'"),
    (["--model", "huge"], "argument --model", "invalid choice: 'huge' (choose from 'small', 'nvidia-hstu')"),
])
def test_bad_sizes_are_one_line_usage_errors(capsys, bench, flags, flag, says):
    line = usage_error(capsys, ["bench", bench, *flags])
    assert line.startswith(f"relaygr bench {bench}: error: {flag}") and says in line, line


def test_a_cache_too_small_for_one_history_of_the_model_is_a_usage_error(capsys):
    line = usage_error(capsys, ["bench", "slo", "--model", "nvidia-hstu"])
    assert "--hbm-mb must hold one --max-history 2048-token history" in line
    assert "32768 bytes of KV per token" in line and "expected >= 128, got 64" in line


def _settings(parser, argv):
    args = parser.parse_args(argv)
    slo.check_args(parser, args)
    return args


def test_the_cpu_demo_and_its_defaults_are_unchanged():
    args = _settings(demo.build_parser(), ["--no-plots", "--no-progress"])
    assert args.shape == PRESETS[ModelPreset.SMALL] and args.model == "small"
    assert (args.candidates, args.length_scale, args.max_history, args.max_len_hi) == (64, 8.0, 2048, 4096)
    assert (args.hbm_mb, args.dram_mb, args.chunk_tokens, args.page_size) == (64.0, 256.0, 256, 16)
    assert (args.cuda_graphs, args.compile, args.requests, args.len_step) == (False, False, 100, 128)
    model = slo_setup.build_model(args, num_items=args.num_items, num_actions=6)
    c = model.config
    assert (c.num_layers, c.hidden_dim, c.num_heads, c.head_dim, c.max_seq_len) == (2, 64, 2, 32, 4096)
    assert next(model.parameters()).dtype == torch.float32


@pytest.fixture
def fake_h100(monkeypatch):
    """A torch that sees one CUDA device of 80 GiB (argument parsing only: nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev=None: types.SimpleNamespace(total_memory=80 * 2**30, name="fake H100"))


def test_the_gpu_seeds_command_line_is_accepted_with_production_defaults(fake_h100):
    args = _settings(slo.build_parser(), GPU_SEEDS[2:] + ["--no-plots", "--no-progress"])
    assert args.shape == PRESETS[ModelPreset.NVIDIA_HSTU] and args.seeds == "0,1,2"
    assert args.max_history >= 16384 and args.candidates == 256 and args.max_len_hi >= 4 * args.max_history
    assert (args.page_size, args.chunk_tokens, args.length_scale) == (64, 1024, 64.0)
    assert args.hbm_mb == 16384.0 and args.dram_mb == 16384.0      # 16 GiB: a fifth of 80 GiB is more
    assert args.cuda_graphs and args.compile                       # both sides at their best on CUDA
    off = _settings(slo.build_parser(), GPU_SEEDS[2:] + ["--no-plots", "--no-progress", "--no-compile",
                                                         "--no-cuda-graphs", "--hbm-mb", "4096"])
    assert not off.cuda_graphs and not off.compile and off.hbm_mb == 4096.0


def test_cuda_graphs_on_the_cpu_stay_a_usage_error(capsys):
    line = usage_error(capsys, ["bench", "slo", "--cuda-graphs"])
    assert "--cuda-graphs needs a CUDA --device" in line and "--device cpu" in line


def test_a_cpu_dry_run_of_the_seeds_command_at_tiny_settings(tmp_path, capsys):
    """The GPU seeds run's flags, on the CPU with a one-layer version of the model and a tiny workload: every seed
    runs, each report states the model, dtype, KV bytes per token and HBM budget, and ``relaygr bench seeds``
    summarises the runs again from their reports."""
    out = tmp_path / "seeds"
    argv = ["bench", "slo", "--model", "nvidia-hstu", "--seeds", "0,1", "--layers", "1", "--hidden", "32",
            "--heads", "1", "--head-dim", "32", "--dtype", "float32", "--quick", "--requests", "10",
            "--warmup-requests", "5", "--max-history", "128", "--max-len-hi", "256", "--len-step", "128",
            "--candidates", "4", "--repeats", "1", "--no-plots", "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 0
    result = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    assert len(result) == 1
    # the same seeds summarised afterwards (as when each seed runs in its own call): the same RESULT line
    (out / "summary.md").unlink()
    assert cli.main(["bench", "seeds", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == result[0] and (out / "summary.md").exists()
    for seed in (0, 1):
        rep = json.loads((out / f"seed{seed}" / "report.json").read_text())
        m = rep["setup"]["model"]
        assert (m["preset"], m["dtype"], m["kv_bytes_per_token"], m["num_layers"]) == ("nvidia-hstu", "float32",
                                                                                          256, 1)
        assert m["hbm_budget_bytes"] == 64 * 2**20 and m["hbm_budget_tokens"] == 64 * 2**20 // 256
        assert rep["setup"]["execution"]["cuda_graphs"] is False
        assert "**model**" in (out / f"seed{seed}" / "report.md").read_text()


def test_run_gpu_sh_runs_the_seeds_command_line(fake_h100):
    """benchmarks/run_gpu.sh's slo-seeds step is the issue's command line (plus where it writes), and it parses."""
    import pathlib
    import shlex

    script = (pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "run_gpu.sh").read_text()
    joined = script.replace("\\\n", " ")
    line = next(x for x in joined.splitlines() if x.startswith("step slo-seeds "))
    cmd = line.split("relaygr_engine.cli", 1)[1].replace('"${OUT_DIR}', '"out').replace('"${SLO_SEEDS}"', "0,1,2")
    argv = shlex.split(cmd.replace("${SLO_ARGS}", ""))  # (SLO_ARGS unset: the full settings)
    assert argv[:len(GPU_SEEDS)] == GPU_SEEDS
    args = _settings(slo.build_parser(), argv[2:] + ["--no-plots"])
    assert args.shape == PRESETS[ModelPreset.NVIDIA_HSTU] and args.cuda_graphs and args.compile and not args.quick
    quick = _settings(slo.build_parser(), shlex.split(cmd.replace("${SLO_ARGS}", "--quick"))[2:] + ["--no-plots"])
    assert quick.quick and quick.shape == args.shape


def test_run_gpu_sh_has_the_budgeted_seeds_step_first_in_its_plan(fake_h100):
    """benchmarks/run_gpu.sh's slo-gpu step: the three seeds at NVIDIA's shape under --budget-s, fitting one
    device call with the install, autotune choices kept in the run's folder; listed first in the header's plan."""
    import pathlib
    import shlex

    script = (pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "run_gpu.sh").read_text()
    plan = [x for x in script.splitlines() if x.startswith("# Next GPU run: ")]
    assert plan and plan[0].split("1. ", 1)[1].startswith("STEPS=slo-gpu")
    line = next(x for x in script.replace("\\\n", " ").splitlines() if x.startswith("step slo-gpu "))
    limit = int(line.split()[2])
    words = shlex.split(line.replace('"${OUT_DIR}', '"out'))
    assert "RELAYGR_AUTOTUNE_FILE=out/slo-gpu/autotune.json" in words
    argv = words[words.index("relaygr_engine.cli") + 1:]
    assert argv[:len(GPU_SEEDS)] == GPU_SEEDS and argv[argv.index("--out") + 1] == "out/slo-gpu"
    args = _settings(slo.build_parser(), argv[2:] + ["--no-plots"])
    assert args.budget_s == 330 and args.budget_s * 1.1 + 150 <= limit   # S + 10% and the install fit the step
    assert args.shape == PRESETS[ModelPreset.NVIDIA_HSTU] and args.cuda_graphs and args.compile
    assert set(args.planned) == {"requests", "warmup_requests", "min_duration_s", "rel_tol", "len_step", "repeats"}
