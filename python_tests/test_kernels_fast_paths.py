"""CUDA's fast paths of the prefix-attention kernel, checked exact in Triton's interpreter: HSTU's SiLU through a
tanh (``FAST_SILU``, with its PTX tanh swapped for an exact one), full key blocks read through a tensor descriptor
(``page_reads="tma"``), the two kinds of tile launched on two streams (``concurrent_tiles``, its order of
launches and joins), and split partials stored in 16 bits (``split_dtype``, a 16-bit model's default)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import triton
import triton.language as tl
from kernel_problems import (CUDA, INTERPRETER, attention_kwargs, check_attention, make_problem, needs_interpreter,
                             prefix_attention)


@triton.jit
def _tanh_exact(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _tanh_wrong(x):
    return x * 0.0


@needs_interpreter
def test_fast_silu_form_is_exact_with_an_exact_tanh(monkeypatch):
    """CUDA's 16-bit path (``FAST_SILU``: ``SiLU(x) = h + h tanh(h)``, ``h = x / 2``, with the bias halved in the
    table, in the kernel's own bias terms and in a candidate's self term) gives the reference's result when its
    PTX tanh is swapped for an exact one: every bias path (table, in-kernel, split) agrees within 1e-4. A wrong tanh
    fails it, so the fast form is the one that ran."""
    from relaygr_engine.kernels import _launch, _prefix_blocks as K

    monkeypatch.setattr(_launch, "fast_silu", lambda device, dtype: True)
    args, bias = make_problem([(45, 20, 9), (16, 3, 0), (0, 7, 5)], 16, 2, 32, seed=5)
    kw = attention_kwargs("hstu", bias, 32)
    monkeypatch.setattr(K, "_tanh_approx", _tanh_exact)
    for budget, splits in ((None, 1), (0, 1), (None, 3)):
        check_attention(args, kw, persistent=splits == 3, block_m=16, block_n=16, splits=splits,
                        bias_table_bytes=budget)
    monkeypatch.setattr(K, "_tanh_approx", _tanh_wrong)
    with pytest.raises(AssertionError):
        check_attention(args, kw, persistent=False, block_m=16, block_n=16)




@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_page_reads_through_a_tensor_descriptor_match_pointer_reads(mode, monkeypatch):
    """``page_reads="tma"``: full key blocks come through a tensor descriptor over the pages (rows ``[pages * 2 *
    page_size, H * D]``), a user's masked last block through pointers; the result is the reference's within 1e-4,
    with one or several key blocks per page, split or not. A descriptor over zeroed pages changes it, so the
    descriptor is what the full blocks read."""
    from relaygr_engine.kernels import _launch, _prefix_config as K, prefix_attention as pa

    users = [(100, 5, 7), (64, 0, 3), (0, 9, 2), (33, 4, 0)]
    args, bias = make_problem(users, 32, 2, 32, seed=3)
    kw = attention_kwargs(mode, bias, 32)
    seen = []
    real = _launch.page_read_mode
    monkeypatch.setattr(_launch, "page_read_mode", lambda *a, **k: seen.append(real(*a, **k)[0]) or real(*a, **k))
    for block_n, splits in ((16, 1), (32, 1), (16, 3)):
        check_attention(args, kw, persistent=splits > 1, block_m=16, block_n=block_n, splits=splits,
                        page_reads="tma")
    assert seen == [K.TMA_ONLY] * 3
    check_attention(args, kw, persistent=False, block_m=16, block_n=16)  # auto: pointers in the interpreter
    assert seen[-1] == K.TMA_OFF

    descriptor = pa.kv_descriptor

    def zeroed(kv_cache, *a, **k):
        return descriptor(torch.zeros_like(kv_cache), *a, **k)

    monkeypatch.setattr(pa, "kv_descriptor", zeroed)
    with pytest.raises(AssertionError):
        check_attention(args, kw, persistent=False, block_m=16, block_n=16, page_reads="tma")


@needs_interpreter
def test_page_reads_tma_refuses_what_it_cannot_read():
    """``page_reads="tma"`` names why it cannot run, before any launch; a bad spelling lists the choices."""
    from relaygr_engine import quant
    from relaygr_engine.kernels.prefix_attention import prefix_attention

    args, bias = make_problem([(40, 2, 3)], 16, 2, 48)
    kw = dict(mode="softmax", scale=0.1)
    with pytest.raises(ValueError, match="page_reads='tma': the head dim must be a power of two >= 16, got 48"):
        prefix_attention(**args, **kw, page_reads="tma")
    args, bias = make_problem([(40, 2, 3)], 16, 2, 32)
    with pytest.raises(ValueError, match=r"page_reads='tma': page_size must be a multiple of the key block \(32\), "
                                         "got 16"):
        prefix_attention(**args, **kw, block_n=32, page_reads="tma")
    shifted = torch.empty(args["kv_cache"].numel() + 1)[1:].view(args["kv_cache"].shape)  # 4 bytes off
    shifted.copy_(args["kv_cache"])
    with pytest.raises(ValueError, match="page_reads='tma': kv_cache's data must start 16-byte aligned"):
        prefix_attention(**dict(args, kv_cache=shifted), **kw, block_n=16, page_reads="tma")
    pages = torch.zeros(quant.layer_shape(quant.KVDtype.INT8, args["kv_cache"].shape[0], 16, 2, 32),
                        dtype=torch.uint8)
    with pytest.raises(ValueError, match="page_reads='tma': kv_dtype='int8' pages are read through pointers"):
        prefix_attention(**dict(args, kv_cache=pages), **kw, block_n=16, kv_dtype="int8", page_reads="tma")
    with pytest.raises(ValueError, match="page_reads must be one of 'auto', 'pointers', 'tma', got 'dma'"):
        prefix_attention(**args, **kw, page_reads="dma")


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_value_splits_share_a_tile_and_match_the_reference(mode, monkeypatch):
    """``value_splits``: programs on grid axis 1 each take the tile's scores and their share of its value columns;
    the result is the reference's within 1e-4 with 2 and 4 of them, split over the prefix or not, persistent or not,
    at a head dim that is not a power of two (the last program's columns partly past it), with the bias from the
    table and computed in the kernel. A grid with one program on that axis leaves columns unwritten and fails, so the
    split is what ran."""
    from relaygr_engine.kernels import prefix_attention as pa

    for head_dim, parts in ((64, 4), (48, 2)):
        args, bias = make_problem([(45, 20, 9), (16, 3, 0), (0, 7, 5)], 16, 2, head_dim, seed=head_dim)
        kw = attention_kwargs(mode, bias, head_dim)
        for splits, budget in ((1, None), (3, None), (1, 0)):
            check_attention(args, kw, persistent=splits > 1, block_m=16, block_n=16, splits=splits,
                            bias_table_bytes=budget, value_splits=parts)
    real = pa._grid
    monkeypatch.setattr(pa, "_grid", lambda programs: lambda meta: real(programs)(meta)[:1] + (1,))
    # (uninitialised memory as NaN: a freed output of the same size could otherwise hold the right values)
    monkeypatch.setattr(torch, "empty_like", lambda x, **k: torch.full_like(x, float("nan"), **k))
    with pytest.raises(AssertionError):
        check_attention(args, kw, persistent=False, block_m=16, block_n=16, value_splits=2)


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_row_splits_share_a_tile_and_match_the_reference(mode, monkeypatch):
    """``M_SPLITS`` (the autotuner's choice on CUDA; here a fixed config's ``row_splits``): two programs on grid
    axis 1 each take half of a tile's rows, with their rows of the bias table or the bias computed in the kernel,
    split over the prefix or not, with the value columns split too (four programs a tile); the result is the
    reference's within 1e-4. A grid without the second half's programs leaves rows unwritten and fails."""
    from relaygr_engine.kernels import prefix_attention as pa

    monkeypatch.setattr(pa, "pick_config", lambda *a, **k: pa.KernelConfig(32, 16, row_splits=2))
    args, bias = make_problem([(45, 40, 9), (16, 3, 0), (0, 7, 37)], 16, 2, 32, seed=7)
    kw = attention_kwargs(mode, bias, 32)
    for splits, budget, parts in ((1, None, None), (3, None, None), (1, 0, None), (3, None, 2)):
        check_attention(args, kw, persistent=splits > 1, splits=splits, bias_table_bytes=budget, value_splits=parts)
    monkeypatch.setattr(pa, "_grid", lambda programs: lambda meta: (programs, meta["V_SPLITS"]))
    monkeypatch.setattr(torch, "empty_like", lambda x, **k: torch.full_like(x, float("nan"), **k))
    with pytest.raises(AssertionError):
        check_attention(args, kw, persistent=False)


@needs_interpreter
def test_value_splits_count_as_programs_when_the_prefix_splits_are_chosen(monkeypatch):
    """The prefix split rule is given every program of a tile: tiles x heads x the caller's value splits."""
    from relaygr_engine.kernels import _split

    seen = []
    monkeypatch.setattr(_split, "pick_splits", lambda device, work, *a, **k: seen.append(work) or 1)
    args, bias = make_problem([(45, 20, 9), (16, 3, 0)], 16, 2, 32)  # 16-row tiles: 2 + 1 history, 1 candidate
    for parts in (None, 2):
        prefix_attention(**args, mode="softmax", scale=0.1, block_m=16, block_n=16, value_splits=parts)
    assert seen == [4 * 2, 4 * 2 * 2]


@needs_interpreter
def test_value_splits_on_8bit_pages_match_one_program():
    """8-bit pages (the scales ride on the scores and the weights) give the same result with the value columns
    split over 2 programs as with one."""
    from relaygr_engine import quant
    from relaygr_engine.config import KVDtype

    args, bias = make_problem([(45, 20, 9), (33, 0, 4)], 16, 2, 32, seed=9)
    kv_cache = args["kv_cache"].nan_to_num(0.0)
    pages = quant.quantize_pages(kv_cache, KVDtype.INT8)
    kw = attention_kwargs("hstu", bias, 32)
    run = lambda parts: prefix_attention(**dict(args, kv_cache=pages), **kw, block_m=16, block_n=16,  # noqa: E731
                                         kv_dtype="int8", value_splits=parts)
    torch.testing.assert_close(run(2), run(1), atol=1e-5, rtol=0)


@needs_interpreter
def test_value_splits_refuses_what_cannot_run(monkeypatch):
    """Each refusal names the argument and what it needs, before any launch."""
    from relaygr_engine.kernels import prefix_attention as pa

    args, bias = make_problem([(40, 2, 3)], 16, 2, 64)
    kw = dict(mode="softmax", scale=0.1)
    for bad in (3, 0, 8, True, 2.0):
        with pytest.raises(ValueError, match=r"value_splits must be a power of two in \[1, 4\] at head dim 64 "
                                             rf"\(each program takes at least 16 value columns\), got {bad!r}"):
            prefix_attention(**args, **kw, value_splits=bad)
    with pytest.raises(ValueError, match="page_reads='tma' reads every value column of a key block: value_splits "
                                         "must be 1, got 2"):
        prefix_attention(**args, **kw, block_n=16, page_reads="tma", value_splits=2)
    # CUDA's autotuned configs (block_n left to the autotuner) split the value columns over 1 or 2 programs only.
    monkeypatch.setattr(pa, "pick_config", lambda *a, **k: pa.KernelConfig(16, None))
    monkeypatch.setattr(pa, "autotuned_kernel", lambda: pytest.fail("launched"))
    with pytest.raises(ValueError, match="value_splits=4 needs a fixed block_n: the autotuned configs split the value "
                                         "columns over 1 or 2 programs"):
        prefix_attention(**args, **kw, value_splits=4)


@needs_interpreter
def test_concurrent_tiles_fork_the_history_launch_and_join_before_the_merge(monkeypatch):
    """With ``concurrent_tiles`` the history tiles launch inside the side stream's context, the candidate tiles on
    the call's stream, and the streams join before the split merge reads the partial sums (a stand-in for CUDA's
    streams records the order on the CPU); the result is the one-stream result."""
    from relaygr_engine.kernels import _common as C, _prefix_plan, prefix_attention as pa

    args, bias = make_problem([(70, 9, 6), (40, 3, 5)], 16, 2, 32, seed=4)
    kw = attention_kwargs("hstu", bias, 32)
    one = prefix_attention(**args, **kw, block_m=16, block_n=16, splits=3)
    events = []

    @contextlib.contextmanager
    def streams(device, concurrent):
        events.append(("fork", concurrent))

        @contextlib.contextmanager
        def on(side):
            events.append("side" if side else "main")
            yield
        yield on
        events.append("join")

    def merge(ws, ml, out):
        events.append("merge")
        return real_merge(ws, ml, out)
    real_merge = pa.merge_splits
    monkeypatch.setattr(C, "tile_streams", streams)
    monkeypatch.setattr(pa, "merge_splits", merge)
    monkeypatch.setattr(_prefix_plan, "_concurrent",
                        lambda flag, device, hist, cand: bool(hist and cand) and flag is not False)
    two = prefix_attention(**args, **kw, block_m=16, block_n=16, splits=3)
    assert events == [("fork", True), "side", "main", "join", "merge"]
    torch.testing.assert_close(two, one, atol=0, rtol=0)
    events.clear()
    prefix_attention(**args, **kw, block_m=16, block_n=16, splits=3, concurrent_tiles=False)
    assert events == [("fork", False), "side", "main", "join", "merge"]  # (one stream: `on` does nothing then)
    events.clear()
    hist_only = dict(args, num_candidates=torch.zeros_like(args["num_candidates"]))  # one kind of tile: one launch
    prefix_attention(**hist_only, **kw, block_m=16, block_n=16)
    assert events == [("fork", False), "side", "join"]


def test_concurrent_tiles_default_where_the_history_launch_leaves_sms_idle(monkeypatch):
    """None: two streams on CUDA where both kinds of tile have work and the history launch has fewer programs than
    SMs (NVIDIA's ranking shape: 1 history tile x 4 heads x 11 splits = 44 of 132), one stream where it fills them
    (a long full inference) or off CUDA; a caller's choice is kept where both kinds have work."""
    from relaygr_engine.kernels import _common as C, _prefix_plan, prefix_attention as pa

    monkeypatch.setattr(C, "_num_cores", lambda kind, index: 132)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _prefix_plan._concurrent(None, cuda, 64, 8) and not _prefix_plan._concurrent(None, cuda, 512, 8)
    assert not _prefix_plan._concurrent(None, cuda, 132, 8) and not _prefix_plan._concurrent(None, cpu, 1, 1)
    assert not any(_prefix_plan._concurrent(flag, cuda, h, c) for flag in (None, True) for h, c in ((0, 8), (64, 0)))
    assert _prefix_plan._concurrent(True, cuda, 512, 8) and not _prefix_plan._concurrent(False, cuda, 64, 8)


@needs_interpreter
def test_concurrent_tiles_refuses_what_cannot_run():
    """Named, with what it needs, before any launch; on the CPU the launches share one stream (None, False)."""
    from relaygr_engine.kernels import _common as C

    args, bias = make_problem([(40, 2, 3)], 16, 2, 32)
    kw = dict(mode="softmax", scale=0.1)
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match=rf"concurrent_tiles must be a bool or None, got {bad!r}"):
            prefix_attention(**args, **kw, concurrent_tiles=bad)
    with pytest.raises(ValueError, match="concurrent_tiles=True needs a CUDA device \\(streams\\), got cpu"):
        prefix_attention(**args, **kw, concurrent_tiles=True)
    ref = prefix_attention(**args, **kw)
    torch.testing.assert_close(prefix_attention(**args, **kw, concurrent_tiles=False), ref, atol=0, rtol=0)
    with C.tile_streams(torch.device("cpu"), True) as on, on(side=True):
        pass  # no streams off CUDA: a no-op context


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_split_partials_in_16_bits_match_the_reference(mode):
    """``split_dtype``: a 16-bit model's partials are stored in its dtype (here fp16 partials of an fp32 problem: the
    interpreter has no bf16), each split's share rounded once and merged in fp32: within fp16 rounding of the
    reference, and not bit-equal to the fp32 partials (the 16-bit store ran). An fp32 model's default is fp32
    partials (exact to 1e-4, bit-equal to asking for them). Softmax stores each split's normalised output, so values
    whose un-normalised sums would pass fp16's largest (65504) stay finite."""
    users = [(150, 7, 20), (3, 2, 4), (0, 5, 3), (97, 0, 9)]
    args, bias = make_problem(users, 16, 2, 32, seed=3)
    kw = attention_kwargs(mode, bias, 32)
    fixed = dict(persistent=False, block_m=16, block_n=16, splits=3)
    exact = check_attention(args, kw, **fixed)
    torch.testing.assert_close(check_attention(args, kw, **fixed, split_dtype=torch.float32), exact, atol=0, rtol=0)
    half = check_attention(args, kw, **fixed, split_dtype=torch.float16, atol=2e-3)
    assert not torch.equal(half, exact)
    if mode == "softmax":  # positive values up to 3e4: a split's un-normalised sum of ~50 of them would overflow
        grow = lambda x: x.abs().clamp(max=3.0) * 1e4  # noqa: E731
        big = dict(args, v=grow(args["v"]), kv_cache=args["kv_cache"].clone())
        big["kv_cache"][:, 1] = grow(big["kv_cache"][:, 1])
        check_attention(big, kw, **fixed, split_dtype=torch.float16, atol=3e4 * 2e-3)


@needs_interpreter
def test_split_dtype_refuses_what_cannot_run(monkeypatch):
    """Named, with what it takes, before any launch: a dtype other than fp32/fp16/bf16, bf16 in the CPU
    interpreter, and more rows of split partials than the kernel's int32 row index reaches."""
    from relaygr_engine.kernels import _prefix_plan

    args, _ = make_problem([(40, 2, 3)], 16, 2, 32)
    kw = dict(mode="softmax", scale=0.1, splits=2)
    for bad in (torch.float64, torch.int8, "float16"):
        with pytest.raises(ValueError, match=rf"split_dtype must be torch.float32, torch.float16 or torch.bfloat16, "
                                             rf"got {bad!r}"):
            prefix_attention(**args, **kw, split_dtype=bad)
    with pytest.raises(ValueError, match=r"split_dtype=torch.bfloat16 cannot run in the CPU interpreter \(numpy has "
                                         r"no bf16\)"):
        prefix_attention(**args, **kw, split_dtype=torch.bfloat16)
    rows = args["q"].shape[0]
    monkeypatch.setattr(_prefix_plan, "schedule", lambda plan, *a, **k: (2 ** 31 // (2 * rows) + 1, 64, False))
    with pytest.raises(ValueError, match=r"rows of split partials, at most 2\*\*31 - 1: ask for fewer splits"):
        prefix_attention(**args, **kw)


@pytest.mark.skipif(not (INTERPRETER or CUDA), reason="needs Triton's interpreter (CPU) or a CUDA device")
@pytest.mark.parametrize("softmax", [False, True])
def test_the_merge_kernel_writes_what_its_reference_writes(softmax):
    """The split merge (softmax: one kernel, in the interpreter or on CUDA where there is one; HSTU: a torch sum):
    the weighted mean or the sum of random partials equal the torch reference's within fp32 rounding, fp32 and fp16
    partials, 1 to 5 splits, a head dim split over two programs and one that is not a power of two, splits without
    keys (max -1e30, sum 0) and rows no split saw (all weights 0: zeros), into an output at row and head strides of
    a fused projection; nothing past the output's rows and heads written."""
    from relaygr_engine.kernels._split import merge_splits
    from relaygr_engine.kernels.reference import merge_splits_ref

    g = torch.Generator().manual_seed(11)
    for splits, dtype, (total_q, heads, dim) in ((1, torch.float32, (5, 2, 32)), (3, torch.float16, (37, 3, 72)),
                                                 (5, torch.float32, (20, 1, 128))):
        ws = torch.randn(splits, total_q, heads, dim, generator=g).to(dtype)
        ml = None
        if softmax:
            ml = torch.stack((torch.randn(splits, total_q, heads, generator=g) * 20,
                              torch.rand(splits, total_q, heads, generator=g) * 5), -1)
            ml[0, :3] = torch.tensor([-1.0e30, 0.0])        # a split without keys
            ml[:, 3] = torch.tensor([-1.0e30, 0.0])         # a row no split saw
        device = "cpu" if INTERPRETER else "cuda"
        ws, ml = ws.to(device), None if ml is None else ml.to(device)
        fused = torch.full((total_q, heads + 1, dim + 8), float("nan"), device=device)
        out = fused[:, :heads, :dim]
        merge_splits(ws, ml, out)
        ref = merge_splits_ref(ws, ml, torch.empty(total_q, heads, dim, device=device))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert torch.isnan(fused[:, heads:]).all() and torch.isnan(fused[:, :, dim:]).all()
        if softmax:
            assert (out[3] == 0).all()
