"""The opt-in 8-bit prefix KV cache (``CacheConfig(kv_dtype="int8" | "fp8_e4m3")``).

The format (values and per-token scales inside each page), its error bounds, the page budget, every engine path on
both formats (close to full inference, not equal; the DRAM tier and the export/import transfer move the 8-bit bytes
unchanged), the Triton kernel's int8 path in the interpreter against the torch reference, and the refusals.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine import quant
from relaygr_engine.cache import PagedKVCache
from relaygr_engine.config import KVDtype
from relaygr_engine.testing import check_relay_exact
from interpreter_process import interpreter_env

FORMATS = [KVDtype.INT8, KVDtype.FP8_E4M3]
CFG = dict(attention="hstu", num_layers=2, hidden_dim=32, num_heads=2, head_dim=16, num_items=500, num_actions=4,
           max_seq_len=256, num_tasks=2)


def histories(seed=0, lengths=(40, 23, 61)):
    g = torch.Generator().manual_seed(seed)
    return [rg.Behaviors(item_ids=torch.randint(0, 500, (n,), generator=g),
                         timestamps=torch.cumsum(torch.randint(1, 1000, (n,), generator=g), 0)) for n in lengths]


# ------------------------------------------------------------------------------------------------ the format
@pytest.mark.parametrize("kd", FORMATS)
def test_pages_round_trip_within_the_format_error_bound(kd):
    ps, H, D = 16, 3, 32
    layer = torch.zeros(quant.layer_shape(kd, 6, ps, H, D), dtype=torch.uint8)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(40, H, D, generator=g) * 3, torch.randn(40, H, D, generator=g)
    k[3] = 0.0  # a row of zeros stays zeros
    pages, slots = torch.randint(0, 6, (40,), generator=g), torch.randperm(6 * ps, generator=g)[:40] % ps
    key = pages * ps + slots
    keep = torch.tensor([key[:i].ne(key[i]).all().item() for i in range(40)])  # distinct slots only
    pages, slots, k, v = pages[keep], slots[keep], k[keep], v[keep]
    quant.store(layer, kd, ps, pages, slots, k, v)
    K, V = quant.load_pages(layer, kd, ps, torch.arange(6), torch.float32)
    for x, got in ((k, K[pages, slots]), (v, V[pages, slots])):
        amax = x.abs().amax(-1, keepdim=True)
        bound = amax / 254 if kd is KVDtype.INT8 else amax / 16  # half an int8 step; e4m3's 2**-4 of amax
        assert ((got - x).abs() <= bound + 1e-6).all()
        assert (got - x).abs().max() > 0  # really 8-bit
    assert K[pages[3], slots[3]].abs().max() == 0 if keep[3] else True


def test_layer_shape_and_its_inverse():
    for kd in (KVDtype.MODEL, *FORMATS):
        for ps in (1, 3, 16, 24, 64, 128):
            for d in (4, 16, 32, 64, 256):
                slots = quant.layer_shape(kd, 2, ps, 4, d)[2]
                assert quant.token_page_size(kd, slots, d) == ps
                assert slots == ps + (-(-4 * ps // d) if kd.quantized else 0)


def test_page_budget_counts_the_smaller_pages():
    """At one HBM budget an 8-bit cache holds about twice the pages of bf16 (NVIDIA's HSTU shape) and 3.5 times the
    pages of fp32 at head dim 32 (the scales cost 4 bytes per row)."""
    budget = 1 << 30
    bf16 = rg.CacheConfig(dtype="bfloat16", page_size=64, hbm_bytes=budget).resolve_num_pages(8, 4, 256)
    fp32 = rg.CacheConfig(page_size=16, hbm_bytes=budget).resolve_num_pages(2, 2, 32)
    for kd in FORMATS:
        q = rg.CacheConfig(dtype="bfloat16", page_size=64, hbm_bytes=budget, kv_dtype=kd).resolve_num_pages(8, 4, 256)
        assert 1.9 < q / bf16 < 2.0
        q32 = rg.CacheConfig(page_size=16, hbm_bytes=budget, kv_dtype=kd).resolve_num_pages(2, 2, 32)
        assert 3.4 < q32 / fp32 < 3.6
        cache = PagedKVCache(rg.CacheConfig(page_size=16, num_pages=10, kv_dtype=kd), 2, 2, 32)
        assert cache.kv[0].dtype == torch.uint8 and cache.kv[0].shape == (10, 2, 18, 2, 32)
        assert cache.nbytes == 10 * rg.CacheConfig(page_size=16, kv_dtype=kd).page_bytes(2, 2, 32)


def test_bad_kv_dtype_is_refused_before_any_state():
    with pytest.raises(ValueError, match="kv_dtype must be one of 'model', 'fp8_e4m3', 'int8', got 'int4'"):
        rg.CacheConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype='fp8_e4m3' needs attention_backend 'torch' or 'auto' on the CPU"):
        rg.CacheConfig(kv_dtype="fp8_e4m3", attention_backend="triton")
    model = rg.build_ranker(rg.GRModelConfig(**dict(CFG, head_dim=6)), seed=0)
    with pytest.raises(ValueError, match="needs head_dim a multiple of 4"):
        rg.RelayEngine(model, rg.CacheConfig(kv_dtype="int8"))
    with pytest.raises(ValueError, match="kv_dtype='int8' is not exact"):
        check_relay_exact(rg.build_ranker(rg.GRModelConfig(**CFG), seed=0), histories(), torch.arange(5),
                          kv_dtype="int8")


# ------------------------------------------------------------------------------------------------ engine paths
@pytest.mark.parametrize("kd", FORMATS)
@pytest.mark.parametrize("attention", ["hstu", "softmax"])
def test_every_engine_path_on_an_8bit_cache_is_close_not_equal(kd, attention):
    """miss (nothing cached: exact), hit, batch, extension and DRAM reload within the format's error of full
    inference; the DRAM reload moves the 8-bit pages unchanged (its scores equal the hit's)."""
    model = rg.build_ranker(rg.GRModelConfig(**dict(CFG, attention=attention)), seed=1)
    hs, c = histories(), torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(3))
    exact = check_relay_exact(model, hs, c)
    assert max(exact.values()) <= 1e-5
    report = check_relay_exact(model, hs, c, kv_dtype=kd, atol=0.02)
    assert report["miss"] <= 1e-5                          # no cached row is read
    assert all(report[p] > 1e-5 for p in ("hit", "batch", "extend", "dram"))   # cached rows are 8-bit
    assert report["dram"] == report["hit"]                 # the same bytes, reloaded


@pytest.mark.parametrize("kd", FORMATS)
def test_export_import_moves_the_8bit_pages_and_stats_state_the_format(kd):
    model = rg.build_ranker(rg.GRModelConfig(**CFG), seed=2)
    (h,) = histories(lengths=(50,))
    c = torch.arange(7)
    cfg = rg.CacheConfig(page_size=8, num_pages=256, kv_dtype=kd)
    sender, receiver = rg.RelayEngine(model, cfg), rg.RelayEngine(model, cfg)
    ticket = sender.prefill_prefix(1, h)
    packed = sender.export_prefix(ticket, h)
    assert packed.kv.dtype == torch.uint8 and packed.kv.shape == sender.cache.packed_shape(-(-50 // 8))
    bf16 = rg.RelayEngine(model, rg.CacheConfig(dtype="bfloat16", page_size=8, num_pages=256))
    bf16_kv = bf16.export_prefix(bf16.prefill_prefix(1, h), h).kv
    assert packed.kv.nbytes / bf16_kv.nbytes == (8 + 2) / (2 * 8)  # a byte per value, 2 scale slots per page
    here = sender.rank_with_prefix(1, h, c, ticket=ticket)
    there = receiver.rank_with_prefix(1, h, c, ticket=receiver.import_prefix(h, packed))
    assert there.source == "hbm" and torch.equal(here.scores, there.scores)
    assert here.kv_dtype == kd.value and receiver.stats()["kv_bits"] == 8
    wrong = rg.RelayEngine(model, rg.CacheConfig(page_size=8, num_pages=256))
    with pytest.raises(ValueError, match="packed.kv must be torch.float32"):
        wrong.import_prefix(h, packed)
    assert wrong.stats()["kv_bits"] == 32 and wrong.rank_with_prefix(1, h, c).kv_dtype == "model"


def test_the_op_checks_the_cache_format():
    q = torch.randn(5, 2, 16)
    tables = dict(kv_indptr=torch.tensor([0, 1], dtype=torch.int32), kv_indices=torch.tensor([0], dtype=torch.int32),
                  kv_last_page_len=torch.tensor([3], dtype=torch.int32),
                  cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                  num_candidates=torch.tensor([2], dtype=torch.int32))
    fp32_cache = torch.randn(1, 2, 4, 2, 16)
    with pytest.raises(ValueError, match="kv_cache must be torch.uint8"):
        rg.paged_prefix_attention(q, q, q, fp32_cache, **tables, mode="softmax", scale=0.25, kv_dtype="int8")
    layer = quant.quantize_pages(fp32_cache, KVDtype.INT8)
    out = rg.paged_prefix_attention(q, q, q, layer, **tables, mode="softmax", scale=0.25, kv_dtype="int8")
    ref = rg.paged_prefix_attention(q, q, q, fp32_cache, **tables, mode="softmax", scale=0.25)
    assert 0 < (out - ref).abs().max() < 0.02
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        rg.paged_prefix_attention(q, q, q, layer, **tables, mode="softmax", scale=0.25, kv_dtype="e5m2")


# ------------------------------------------------------------------------------------------------ Triton (int8)
TRITON_INT8 = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from kernel_problems import attention_kwargs, make_problem
    from relaygr_engine import quant
    from relaygr_engine.config import KVDtype
    from relaygr_engine.kernels.prefix_attention import prefix_attention
    from relaygr_engine.attention.ops import paged_prefix_attention_torch

    worst = 0.0
    for seed, (users, ps) in enumerate([([(45, 10, 50), (16, 3, 2), (0, 0, 7), (130, 0, 33)], 16),
                                        ([(100, 5, 20), (64, 40, 3)], 32), ([(70, 2, 9)], 24)]):
        args, bias = make_problem(users, ps, 2, 32, seed=seed)
        args["kv_cache"] = quant.quantize_pages(args["kv_cache"].nan_to_num(0.0), KVDtype.INT8)
        for mode in ("softmax", "hstu"):
            kw = attention_kwargs(mode, bias, 32)
            ref = paged_prefix_attention_torch(**args, **{{k: kw.get(k) for k in ("mode", "scale", "pos_bias",
                                               "ts_bias", "ts_cache", "ts_q")}}, hstu_norm=kw.get("hstu_norm", 1.0),
                                               kv_dtype="int8")
            for splits in (None, 3):
                out = prefix_attention(**args, **kw, kv_dtype="int8", splits=splits)
                worst = max(worst, float((out - ref).abs().max()))
    print("worst", worst)
""")


def test_triton_kernel_int8_pages_match_the_torch_reference_in_the_interpreter():
    """The kernel's 8-bit path (scales on the scores and weights) against the torch reference reading the same
    int8 pages, whole blocks and partial ones, pages a block divides and pages it does not (24), split prefixes.
    In a fresh process: the interpreter must be on before triton's first import."""
    env = interpreter_env()
    code = TRITON_INT8.format(tests=os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = float(proc.stdout.split("worst")[-1])
    assert worst <= 1e-5


KV_WRITE_INT8 = textwrap.dedent("""
    import torch
    from relaygr_engine import quant
    from relaygr_engine.config import KVDtype
    from relaygr_engine.kernels.kv_write import kv_write

    g = torch.Generator().manual_seed(0)
    for ps, H, D in ((16, 2, 32), (24, 3, 20), (8, 1, 64)):
        shape = quant.layer_shape(KVDtype.INT8, 7, ps, H, D)
        k, v = torch.randn(30, H, D, generator=g) * 2, torch.randn(30, H, D, generator=g)
        k[5] = 0.0
        slots = torch.randperm(7 * ps, generator=g)[:30]
        slots[[3, 11]] = -1                                        # padding rows are skipped
        got, want = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
        kv_write(got, k, v, slots, kv_dtype="int8")
        keep = slots >= 0
        quant.store(want, KVDtype.INT8, ps, slots[keep] // ps, slots[keep] % ps, k[keep], v[keep])
        assert torch.equal(got, want), (ps, H, D)
    print("ok")
""")


def test_triton_kv_write_quantises_like_the_torch_path_in_the_interpreter():
    """The 8-bit KV-write kernel stores the same bytes (values and scales) as :func:`relaygr_engine.quant.store`."""
    proc = subprocess.run([sys.executable, "-c", KV_WRITE_INT8], env=interpreter_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


ENGINE_TRITON_INT8 = textwrap.dedent("""
    import torch
    import relaygr_engine as rg
    from relaygr_engine.testing import check_relay_exact

    model = rg.build_ranker(rg.GRModelConfig(**{cfg!r}), seed=1)
    g = torch.Generator().manual_seed(0)
    hs = [rg.Behaviors(item_ids=torch.randint(0, 500, (n,), generator=g),
                       timestamps=torch.cumsum(torch.randint(1, 1000, (n,), generator=g), 0)) for n in (40, 23)]
    c = torch.randint(0, 500, (9,), generator=g)
    torch_int8 = check_relay_exact(model, hs, c, kv_dtype="int8", atol=0.02)
    triton_int8 = check_relay_exact(model, hs, c, kv_dtype="int8", atol=0.02, attention_backend="triton")
    print(max(abs(torch_int8[p] - triton_int8[p]) for p in torch_int8))
""")


def test_engine_on_the_triton_backend_writes_and_reads_int8_pages_like_the_torch_backend():
    """Every engine path with the Triton kernels (the quantising KV write and the 8-bit attention, in the
    interpreter) ends as close to full inference as the torch backend's."""
    proc = subprocess.run([sys.executable, "-c", ENGINE_TRITON_INT8.format(cfg=CFG)],
                          env=interpreter_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) <= 1e-5


def test_8bit_pages_attend_through_torch_where_the_kernel_is_off(monkeypatch, caplog):
    """Where :func:`relaygr_engine.quant.kernel_runs` says no (CUDA without ``RELAYGR_KV8_KERNEL=1``), a Triton-backend
    call on 8-bit pages gets the torch path's output, with one warning; the model dtype still takes the kernel, and
    so do 8-bit pages where the kernel runs."""
    from relaygr_engine import _warn
    from relaygr_engine.attention import ops

    calls = []
    monkeypatch.setattr(ops, "_triton_impl", lambda: (lambda *a, **kw: calls.append(kw["kv_dtype"]) or a[0]))
    _warn.forget()
    g = torch.Generator().manual_seed(1)
    ps, H, D, P = 16, 2, 32, 6
    dense = torch.randn(P, 2, ps, H, D, generator=g)
    pages = quant.quantize_pages(dense, KVDtype.INT8)
    q, kn, vn = (torch.randn(9, H, D, generator=g) for _ in range(3))
    tables = dict(kv_indptr=torch.tensor([0, 4, 6], dtype=torch.int32), kv_indices=torch.tensor(
        [5, 0, 3, 1, 2, 4], dtype=torch.int32), kv_last_page_len=torch.tensor([7, 16], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 5, 9], dtype=torch.int32), num_candidates=torch.tensor([3, 4], dtype=torch.int32))
    kw = dict(mode="hstu", scale=D ** -0.5, kv_dtype="int8")
    want = ops.paged_prefix_attention(q, kn, vn, pages, **tables, **kw, backend="torch")
    monkeypatch.setattr(quant, "kernel_runs", lambda device: False)
    with caplog.at_level("WARNING", logger="relaygr_engine"):
        for _ in range(2):
            got = ops.paged_prefix_attention(q, kn, vn, pages, **tables, **kw, backend="triton")
            assert torch.equal(got, want)
    assert calls == [] and sum("8-bit pages" in r.message for r in caplog.records) == 1
    ops.paged_prefix_attention(q, kn, vn, dense, **tables, mode="hstu", scale=D ** -0.5, backend="triton")
    assert calls == ["model"]
    monkeypatch.setattr(quant, "kernel_runs", lambda device: True)
    ops.paged_prefix_attention(q, kn, vn, pages, **tables, **kw, backend="triton")
    assert calls == ["model", "int8"]
    if torch.cuda.is_available():
        return
    monkeypatch.undo()
    monkeypatch.delenv(quant.KERNEL_ENV, raising=False)
    assert quant.kernel_runs(torch.device("cpu")) and not quant.kernel_runs(torch.device("cuda"))
    monkeypatch.setenv(quant.KERNEL_ENV, "1")
    assert quant.kernel_runs(torch.device("cuda"))


# ------------------------------------------------------------------------------------------------ CUDA
CUDA = torch.cuda.is_available()


# The kernel's 8-bit read on CUDA: expected to fail until a GPU run shows it right (then the kernel reads 8-bit pages
# there by default, relaygr_engine.quant.kernel_runs, and this mark goes): strict, so that a pass is noticed.
KV8_PENDING = pytest.mark.xfail(
    CUDA, strict=True, reason="the kernel's 8-bit read on CUDA faulted (ptxas 12.8) or was wrong (ptxas 13.4) on the "
    "GPU runs so far; the autotuner drops the configs ptxas 12.8 miscompiles since "
    "(benchmarks/results/static-kv8-2026-11-28): a pass here means the fix holds")


def _cuda_8bit_pages(kd, num_pages, ps, H, D, g):
    """Rows ``k, v [num_pages * ps, H, D]`` (bf16, CUDA) written to a quantised layer by the Triton KV write and by
    :func:`relaygr_engine.quant.store`: ``(k, v, written_by_the_kernel, written_by_torch)``."""
    from relaygr_engine.kernels.kv_write import kv_write

    dev = torch.device("cuda")
    shape = quant.layer_shape(kd, num_pages, ps, H, D)
    k, v = (torch.randn(num_pages * ps, H, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.arange(num_pages * ps, device=dev)
    got, want = torch.zeros(shape, dtype=torch.uint8, device=dev), torch.zeros(shape, dtype=torch.uint8, device=dev)
    kv_write(got, k, v, slots, kv_dtype=kd)
    quant.store(want, kd, ps, slots // ps, slots % ps, k, v)
    return k, v, got, want


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("kd", FORMATS)
def test_cuda_8bit_write_matches_the_torch_path(kd):
    """On CUDA (bf16 rows) the Triton KV write stores what the torch path stores, up to one 8-bit step where the
    two round differently."""
    dev, ps, P = torch.device("cuda"), 64, 64
    k, v, got, want = _cuda_8bit_pages(kd, P, ps, 4, 128, torch.Generator(device=dev).manual_seed(0))
    K1, V1 = quant.load_pages(got, kd, ps, torch.arange(P, device=dev), torch.float32)
    K2, V2 = quant.load_pages(want, kd, ps, torch.arange(P, device=dev), torch.float32)
    for x, a, b in ((k, K1, K2), (v, V1, V2)):  # each tensor's step is its own rows' largest scale
        step = x.float().abs().amax(-1).max() / quant.QMAX[kd] * (1 if kd is KVDtype.INT8 else 32)
        # (the two quantisers' fp32 scales may differ in their last bits: a value one step off is then off by
        # the step times 1 + a few fp32 ulps of up to QMAX)
        assert (a - b).abs().max() <= step * (1 + 1e-4)


CUDA_8BIT_KERNEL = r"""
import json, sys
import torch
from relaygr_engine.config import KVDtype
from relaygr_engine.kernels.prefix_attention import prefix_attention
from relaygr_engine.attention.ops import paged_prefix_attention_torch
from test_kvquant import _cuda_8bit_pages

kd = KVDtype(sys.argv[1])
dev, ps, H, D = torch.device("cuda"), 64, 4, 128
g = torch.Generator(device=dev).manual_seed(0)
_, _, got, _ = _cuda_8bit_pages(kd, 64, ps, H, D, g)
users = [(3000, 64, 256), (1000, 0, 32)]
cu = torch.tensor([0, 320, 352], dtype=torch.int32, device=dev)
q, kn, vn = (torch.randn(352, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
pages = [-(-p // ps) for p, _, _ in users]
indptr = torch.tensor([0, pages[0], sum(pages)], dtype=torch.int32, device=dev)
tables = dict(kv_indptr=indptr, kv_indices=torch.randperm(64, device=dev)[:sum(pages)].int(),
              kv_last_page_len=torch.tensor([3000 - 46 * ps, 1000 - 15 * ps], dtype=torch.int32, device=dev),
              cu_seqlens_q=cu, num_candidates=torch.tensor([256, 32], dtype=torch.int32, device=dev))
for mode in ("softmax", "hstu"):
    out = prefix_attention(q, kn, vn, got, **tables, mode=mode, scale=D ** -0.5, kv_dtype=kd.value)
    ref = paged_prefix_attention_torch(q.float(), kn.float(), vn.float(), got, **tables, mode=mode,
                                       scale=D ** -0.5, kv_dtype=kd.value)
    err = (out.float() - ref).abs()
    print(json.dumps(dict(mode=mode, max_abs_err=float(err.max()),
                          mismatched=float((err > 3e-2 + 3e-2 * ref.abs()).float().mean()))), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")
@KV8_PENDING
@pytest.mark.parametrize("kd", FORMATS)
def test_cuda_8bit_kernel_matches_the_torch_path(kd):
    """On CUDA, the kernel's 8-bit read (switched on: ``RELAYGR_KV8_KERNEL=1``) over pages the Triton KV write stored
    matches the torch reference, both modes (in a process of its own: a kernel fault loses that process's CUDA
    context, not this one's)."""
    env = {**os.environ, quant.KERNEL_ENV: "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", CUDA_8BIT_KERNEL, kd.value], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["softmax", "hstu"], proc.stdout[-2000:]
    assert all(r["mismatched"] == 0 for r in rows), rows


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")
def test_cuda_kernel_refuses_8bit_pages_unless_switched_on(monkeypatch):
    """On CUDA without ``RELAYGR_KV8_KERNEL=1`` the kernel's entry refuses 8-bit pages before launching anything,
    naming the switch."""
    from relaygr_engine.kernels.prefix_attention import prefix_attention

    monkeypatch.delenv(quant.KERNEL_ENV, raising=False)
    dev, H, D = torch.device("cuda"), 2, 64
    pages = torch.zeros(quant.layer_shape(KVDtype.FP8_E4M3, 2, 16, H, D), dtype=torch.uint8, device=dev)
    q = torch.zeros(4, H, D, dtype=torch.bfloat16, device=dev)
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=quant.KERNEL_ENV):
        prefix_attention(q, q, q, pages, i32([0, 1]), i32([1]), i32([5]), i32([0, 4]), i32([2]), mode="softmax",
                         scale=0.125, kv_dtype="fp8_e4m3")


# ------------------------------------------------------------------------------------------------ benchmark
def test_bench_kvquant_trains_and_compares_on_a_log(tmp_path, capsys):
    """``relaygr bench kvquant`` on a small log: trains, ranks held-out requests through each cache format, and
    reports agreement with the model-dtype cache (itself equal to full inference) in its RESULT line."""
    from relaygr_engine.bench import kvquant

    g = torch.Generator().manual_seed(0)
    rows = ["userId,movieId,rating,timestamp"]
    for u in range(12):
        for j in range(30):
            rows.append(f"{u},{int(torch.randint(0, 40, (1,), generator=g))},{1 + j % 5}.0,{1000 + 60 * j}")
    log = tmp_path / "r.csv"
    log.write_text("\n".join(rows) + "\n")
    out = tmp_path / "k.json"
    assert kvquant.main(["--data", str(log), "--steps", "3", "--requests", "12", "--candidates", "8",
                         "--max-history", "24", "--json", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    for kind in ("hstu", "softmax"):
        assert float(fields[f"{kind}_exact_max_abs"]) <= 1e-4
        for name in ("int8", "fp8"):
            assert 0 < float(fields[f"{kind}_{name}_max_abs"]) < 0.1
            assert 0.5 <= float(fields[f"{kind}_{name}_top10"]) <= 1 and -1 <= float(fields[f"{kind}_{name}_tau"]) <= 1
    with pytest.raises(SystemExit) as e:
        kvquant.main(["--data", str(tmp_path / "missing.csv")])
    assert e.value.code == 2 and "--data" in capsys.readouterr().err


def test_agreement_of_rankings():
    from relaygr_engine.bench.kvquant import agreement

    a = torch.arange(20.0)
    assert agreement(a, a) == (1.0, 1.0)
    assert agreement(a, -a) == (0.0, -1.0)
    b = a.clone()
    b[[0, 1]] = b[[1, 0]]          # one swapped pair out of 190
    top, tau = agreement(a, b)
    assert top == 1.0 and abs(tau - (1 - 2 / 190)) < 1e-9


def test_bench_kernels_times_8bit_pages_beside_the_model_dtype():
    """``relaygr bench kernels --kv-dtype int8`` (interpreter smoke): each shape's pages also timed in int8, with
    the speed ratio and the error against the model-dtype pages in its RESULT line."""
    proc = subprocess.run([sys.executable, "-m", "relaygr_engine.cli", "bench", "kernels", "--device", "cpu",
                           "--kv-dtype", "int8"], env=interpreter_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fields = dict(kv.split("=", 1) for kv in proc.stdout.strip().splitlines()[-1].split()[1:])
    assert fields["kv_dtype"] == "int8" and float(fields["geomean_kv8_speedup"]) > 0
    assert 0 < float(fields["max_kv8_err"]) < 0.05
    # (no long shape in the interpreter's: the largest ratio over all of them, at least the inverse of the geomean
    # speedup; the kernel read the pages)
    assert float(fields["kv8_time_ratio"]) >= 0.99 / float(fields["geomean_kv8_speedup"])
    assert fields["kv8_read"] == "kernel"
