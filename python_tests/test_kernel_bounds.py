"""Every Triton kernel stays inside its tensors: run in the interpreter with each load and store checked against the
storages of the launch's tensor arguments (``interpreter_bounds``), over the tile shapes, splits and page formats
the CUDA launcher picks, and leaves its inputs unchanged. In a fresh process: the interpreter must be on before
Triton's first import."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from interpreter_process import interpreter_env

SCRIPT = textwrap.dedent("""
    import sys, itertools
    import torch
    sys.path.insert(0, {tests!r})
    import interpreter_bounds as IB
    try:
        IB.install()
    except RuntimeError as exc:
        print("skip", exc)
        raise SystemExit(0)
    import triton, triton.language as tl
    from kernel_problems import attention_kwargs, make_problem
    from relaygr_engine import quant
    from relaygr_engine.config import KVDtype
    from relaygr_engine.kernels import prefix_attention as PA
    from relaygr_engine.kernels._prefix_config import KernelConfig
    from relaygr_engine.kernels.kv_pack import kv_pack, kv_unpack
    from relaygr_engine.kernels.kv_write import kv_write

    @triton.jit
    def shifted_copy(x_ptr, y_ptr, SHIFT: tl.constexpr):
        o = tl.arange(0, 16)
        tl.store(y_ptr + o, tl.load(x_ptr + o + SHIFT))

    x, y = torch.arange(16.0), torch.empty(16)
    shifted_copy[(1,)](x, y, SHIFT=0)
    try:
        shifted_copy[(1,)](x, y, SHIFT=1)  # one element past x's storage
        planted = "missed"
    except Exception as exc:
        planted = "caught" if "outside every tensor argument" in str(exc) else repr(exc)
    print("planted", planted)

    def intact(before, after):
        return all(torch.equal(a, b) if not a.is_floating_point() else torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
                   for a, b in zip(before, after))

    users = [(300, 17, 40), (64, 0, 9), (0, 5, 3), (47, 2, 0)]
    # (block_m, programs sharing a tile's rows, block_n, splits, value splits): the launcher's CUDA shapes in small
    configs = [(32, 1, 16, None, None), (128, 2, 32, 5, None), (64, 1, 32, 3, 2)]
    calls = 0
    for page_size, kv in ((16, "model"), (24, "model"), (16, "int8")):
        args, bias = make_problem(users, page_size, 2, 32, seed=page_size)
        if kv == "int8":
            args["kv_cache"] = quant.quantize_pages(args["kv_cache"].nan_to_num(0.0), KVDtype.INT8)
        for mode, (bm, m, bn, splits, vs) in itertools.product(("softmax", "hstu"), configs):
            kw = attention_kwargs(mode, bias, 32)
            before = [t.clone() for t in (*args.values(), *kw.values()) if isinstance(t, torch.Tensor)]
            PA.pick_config = lambda *a, **k: KernelConfig(bm, bn, row_splits=m)
            PA.prefix_attention(**args, **kw, splits=splits, value_splits=vs, kv_dtype=kv)
            after = [t for t in (*args.values(), *kw.values()) if isinstance(t, torch.Tensor)]
            assert intact(before, after), (page_size, kv, mode, bm, m, bn, splits, vs)
            calls += 1
    g = torch.Generator().manual_seed(0)
    for kv in ("model", "int8"):  # the KV write, padding rows (-1) skipped
        kd = KVDtype(kv)
        pages = torch.zeros(quant.layer_shape(kd, 5, 16, 2, 32), dtype=quant.storage_dtype(kd, torch.float32))
        k, v = torch.randn(20, 2, 32, generator=g), torch.randn(20, 2, 32, generator=g)
        slots = torch.randperm(80, generator=g)[:20]
        slots[[2, 9]] = -1
        kv_write(pages, k, v, slots, kv_dtype=kv)
        calls += 1
    caches = [torch.randn(6, 2, 16, 2, 32, generator=g) for _ in range(3)]
    buf = kv_pack(caches, [4, 0, 5])
    kv_unpack(buf, caches, [1, 2, 3])
    print("calls", calls, "checked", IB.checked_accesses())
""")


def test_kernels_read_and_write_only_their_tensors_in_the_bounds_checked_interpreter():
    """Prefix attention (softmax and HSTU with both biases; pages the key block divides and not; model-dtype and int8
    pages; 1 to 5 prefix splits, a tile's rows on two programs, its value columns on two), the KV write (both
    formats) and page pack/unpack: no load or store outside the launch's tensors, inputs unchanged; and a planted
    one-element overrun is caught, so the check is live."""
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=os.path.dirname(__file__))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    if "skip" in lines:
        pytest.skip(lines["skip"])
    assert lines["planted"] == "caught"
    calls = int(lines["calls"].split()[0])
    assert calls == 20
    assert "'store'" in lines["calls"] and "'load'" in lines["calls"]
