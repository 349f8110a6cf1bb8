"""Autotune configs compiled in parallel before the autotuner times them (kernels._compile): the thread count's
setting, and what is submitted for each config, checked with a stand-in kernel (a real compile needs a GPU target:
test_kernels_cuda.py compiles the prefix kernel's configs that way on CUDA)."""
from __future__ import annotations

import logging
import threading

import pytest
import triton

from relaygr_engine import _warn
from relaygr_engine.kernels import _compile


class _Descriptor:
    block_shape = None


class _Kernel:
    """Records each ``warmup`` call: its arguments and the descriptor's block shape at that moment."""
    __name__ = "stand_in_kernel"

    def __init__(self, fail=False):
        self.calls, self.fail, self.threads = [], fail, set()

    def warmup(self, *args, grid, **kwargs):
        if self.fail:
            raise RuntimeError("no target")
        self.threads.add(threading.get_ident())
        desc = next((a for a in args if isinstance(a, _Descriptor)), None)
        self.calls.append((args, grid, kwargs, desc.block_shape if desc else None))


def _fit(nargs):  # a pre-hook like the prefix kernel's: the descriptor's block follows the config
    nargs["desc"].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


def test_compile_workers_setting():
    assert 1 <= _compile.compile_workers({}) <= _compile.MAX_DEFAULT_WORKERS
    assert _compile.compile_workers({"RELAYGR_COMPILE_WORKERS": "0"}) == 0
    assert _compile.compile_workers({"RELAYGR_COMPILE_WORKERS": " 6 "}) == 6
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match="RELAYGR_COMPILE_WORKERS must be an integer >= 0.*" + bad):
            _compile.compile_workers({"RELAYGR_COMPILE_WORKERS": bad})


def test_every_kept_config_is_submitted_after_its_pre_hook():
    configs = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=2, pre_hook=_fit) for bn in (32, 64)
               for w in (4, 8)]
    desc = _Descriptor()
    named = {"q": "q-tensor", "desc": desc, "n": 7}
    grid = object()
    kernel = _Kernel()
    done = _compile.compile_configs(kernel, configs, named, {"grid": grid, "warmup": False, "HEAD_DIM": 128},
                                    workers=3)
    assert done == 4 and len(kernel.calls) == 4
    for config, (args, got_grid, kwargs, shape) in zip(configs, kernel.calls):
        assert args == ("q-tensor", desc, 7) and got_grid is grid    # positional, in the kernel's order
        assert "warmup" not in kwargs and kwargs["HEAD_DIM"] == 128   # the call's own keywords, less `warmup`
        assert kwargs["BLOCK_N"] == config.kwargs["BLOCK_N"] and kwargs["num_warps"] == config.num_warps
        assert shape == [config.kwargs["BLOCK_N"], 128]               # its pre-hook ran right before
    # under triton.AsyncCompileMode the submissions come from the caller's thread (the pool compiles)
    assert kernel.threads == {threading.get_ident()}


def test_nothing_to_gain_or_a_failure_leaves_it_to_the_autotuner(caplog):
    configs = [triton.Config({"BLOCK_N": bn}) for bn in (16, 32)]
    kernel = _Kernel()
    assert _compile.compile_configs(kernel, configs, {}, {"grid": 1}, workers=1) == 0
    assert _compile.compile_configs(kernel, configs[:1], {}, {"grid": 1}, workers=8) == 0
    assert kernel.calls == []
    _warn.forget()
    broken = _Kernel(fail=True)
    with caplog.at_level(logging.WARNING, logger="relaygr_engine.kernels._compile"):
        assert _compile.compile_configs(broken, configs, {}, {"grid": 1}, workers=2) == 0
        assert _compile.compile_configs(broken, configs, {}, {"grid": 1}, workers=2) == 0
    warned = [r for r in caplog.records if "parallel compile" in r.getMessage()]
    assert len(warned) == 1 and "no target" in warned[0].getMessage()   # once


def test_precompiling_prunes_first_then_compiles_what_it_keeps(monkeypatch):
    seen = []
    monkeypatch.setattr(_compile, "compile_configs", lambda fn, kept, named, kw: seen.append((fn, kept, kw)))
    prune = _compile.precompiling(lambda configs, named, **kw: configs[1:], "kernel")
    assert prune([1, 2, 3], {"a": 1}, grid=4, BLOCK_M=64) == [2, 3]
    assert seen == [("kernel", [2, 3], {"grid": 4, "BLOCK_M": 64})]


def test_autotune_report_names_each_variant_its_kept_config_and_every_candidates_time(capsys):
    """bench rank and profile_rank.py print, per autotuned variant, the config kept and each candidate's median time
    (read off the autotuner after it tunes a variant; here a stand-in for its run does the tuning)."""
    from relaygr_engine.bench import autotune_report as R
    from relaygr_engine.kernels import _prefix_config as K

    tuner = K.autotuned_kernel()
    K.reset_autotuning()
    assert R.variants() == []
    values = dict(HEAD_DIM=256, PAGE_SIZE=64, BLOCK_M=128, CAND_TILES=True, HSTU=True, HAS_POS=True, HAS_TS=True,
                  HIST_TABLE=False, PERSISTENT=False, SPLIT=True, KV8=False, FAST_SILU=True,
                  TMA_READS=K.TMA_EITHER, V_SPLITS_PICK=0, SKIP_FULL=0)
    key = tuple(values[k] for k in K.AUTOTUNE_KEYS) + ("torch.bfloat16",)
    eight = next(c for c in K.CUDA_CONFIGS if c.num_warps == 8 and c.kwargs["TMA"] and c.num_stages == 3
                 and c.kwargs["BLOCK_N"] == 32)
    halves = next(c for c in K.CUDA_CONFIGS if c.num_warps == 4 and c.kwargs["M_SPLITS"] == 2
                  and c.kwargs["V_SPLITS"] == 1 and c.kwargs["BLOCK_N"] == 32 and c.num_stages == 2
                  and not c.kwargs["TMA"])

    def tune(*args, **kwargs):  # what Triton's autotuner leaves behind after tuning a variant
        tuner.configs_timings = {eight: [0.041, 0.04, 0.042], halves: [0.028, 0.027, 0.03]}
        tuner.cache[key] = halves
        return "launched"

    tuner.__dict__.pop("_relaygr_records", None)
    tuner.run = tune
    try:
        R.record_timings()
        R.record_timings()  # idempotent: wrapped once
        assert tuner.run(1, grid=(1,), warmup=False) == "launched"
        rows = R.print_variants()
        assert rows == [{"variant": "hstu cand split D=256 BM=128 reads=either", "config": "4w bn32 s2 m2",
                         "timings_ms": [("4w bn32 s2 m2", 0.028), ("8w bn32 s3 tma", 0.041)]}]
        assert capsys.readouterr().out == ("autotuned: hstu cand split D=256 BM=128 reads=either: 4w bn32 s2 m2 | "
                                           "4w bn32 s2 m2 0.0280, 8w bn32 s3 tma 0.0410\n")
        hist = dict(values, CAND_TILES=False, SPLIT=False, HIST_TABLE=True, HSTU=False, TMA_READS=K.TMA_OFF)
        assert R.describe(hist) == "softmax hist table D=256 BM=128 reads=pointers"
    finally:
        tuner.__dict__.pop("run", None)  # the class's own run again
        tuner.__dict__.pop("_relaygr_records", None)
        K.reset_autotuning()
