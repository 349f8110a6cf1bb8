"""Prefix attention compiled on CUDA (bf16 and fp32; skipped without a CUDA device), and the split-prefix choice."""
from __future__ import annotations

import threading

import pytest
import torch
from kernel_problems import attention_kwargs, check_attention, gpu, make_problem, needs_cuda

from relaygr_engine.kernels._prefix_config import tma_device
from relaygr_engine.kernels.prefix_attention import prefix_attention
from relaygr_engine.kernels.reference import prefix_attention_ref


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
@pytest.mark.parametrize("persistent", [False, True])
def test_prefix_attention_bf16_cuda(mode, persistent):
    users = [(1000, 17, 300), (0, 40, 5), (129, 0, 64)]
    args, bias = make_problem(users, 64, 4, 128, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(mode, bias, 128)
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()}, **kw)
    outs = [prefix_attention(**args, **kw, persistent=persistent, bias_table_bytes=b) for b in (None, 0)]
    for out in outs:  # history tiles reading the bias table, and computing it in the kernel
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    # full key blocks through pointers only, and (sm_90+) through tensor descriptors only: each in one fixed config
    # (the autotuned calls above time both kinds but keep one), so this compiles two binaries, not two autotune sets
    reads = ["pointers"] + (["tma"] if tma_device(torch.device("cuda")) else [])
    for r in reads:
        out = prefix_attention(**args, **kw, persistent=persistent, block_n=64, page_reads=r)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_concurrent_tiles_equal_one_stream_eagerly_and_in_a_graph_bf16_cuda(mode):
    """A ranking's shape, split: history tiles on the side stream beside the candidate tiles give the one-stream
    result bit for bit, eagerly and captured in a CUDA graph (two branches) replayed over new inputs."""
    from relaygr_engine.kernels.prefix_attention import plan_prefix_attention

    users = [(3000, 64, 256)]
    args, bias = make_problem(users, 64, 4, 128, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(mode, bias, 128)
    meta = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")
    kw["plan"] = plan_prefix_attention(**{n: args[n] for n in meta}, kv_cache=args["kv_cache"])  # (no device read)
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()},
                               **{n: x for n, x in kw.items() if n != "plan"})
    one = prefix_attention(**args, **kw, concurrent_tiles=False)
    two = prefix_attention(**args, **kw)  # the default on CUDA
    torch.testing.assert_close(two, one, atol=0, rtol=0)
    torch.testing.assert_close(two.float(), ref, atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prefix_attention(**args, **kw, concurrent_tiles=True)
    for t in ("q", "k", "v"):
        args[t].copy_(torch.randn_like(args[t]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, prefix_attention(**args, **kw, concurrent_tiles=False), atol=0, rtol=0)
    # a thread whose first call is inside a capture creates no stream there: its launches share the capturing one
    captured = []

    def capture_first():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured.append(prefix_attention(**args, **kw, concurrent_tiles=True))
        g.replay()
        torch.cuda.synchronize()
    worker = threading.Thread(target=capture_first)
    worker.start()
    worker.join()
    torch.testing.assert_close(captured[0], out, atol=0, rtol=0)


@gpu
@needs_cuda
def test_page_reads_tma_before_sm90_is_refused():
    if tma_device(torch.device("cuda")):
        pytest.skip("this GPU runs TMA reads (sm_90+)")
    args, bias = make_problem([(100, 4, 8)], 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page_reads='tma': needs sm_90 or later"):
        prefix_attention(**args, mode="softmax", scale=0.1, page_reads="tma")


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_prefix_attention_split_prefix_bf16_cuda(mode):
    """A ranking's shape (one user, few rows, long prefix): the automatic split choice splits, and forced splits
    agree with the reference, their partials in bf16 (the default for a bf16 model) and in fp32; bf16 partials add
    at most about one bf16 rounding of the output to the fp32 partials' result."""
    from relaygr_engine.kernels._split import pick_splits

    users = [(4000, 64, 256)]
    args, bias = make_problem(users, 64, 4, 128, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(mode, bias, 128)
    assert pick_splits(torch.device("cuda"), 5 * 4, 4000) > 1
    assert pick_splits(torch.device("cuda"), 5 * 4, 0) == 1  # nothing cached (a prefill): never split
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()}, **kw)
    for splits in (None, 3):
        out = prefix_attention(**args, **kw, splits=splits)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
        wide = prefix_attention(**args, **kw, splits=splits, split_dtype=torch.float32)
        torch.testing.assert_close(wide.float(), ref, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out.float(), wide.float(), atol=2 ** -6 * float(wide.float().abs().max()), rtol=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_value_splits_at_head_dim_256_bf16_cuda(mode, monkeypatch):
    """Head dim 256 with the value columns over two programs, within bf16 tolerance of the reference: autotuned
    among those configs (with and without a prefix split, and a fixed one), then each of them alone (the autotuner
    returns its winner's output only), the one-warp-group config of 64-row tiles (4 warps) among them."""
    from relaygr_engine.kernels import _prefix_config as K

    users = [(2000, 40, 256), (0, 9, 3), (300, 0, 70)]
    args, bias = make_problem(users, 64, 2, 256, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(mode, bias, 256)
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()}, **kw)
    for extra in (dict(), dict(splits=3), dict(block_m=64, block_n=32)):
        out = prefix_attention(**args, **kw, value_splits=2, **extra)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2, msg=str(extra))
    tuner, real = K.autotuned_kernel(), K.prune_configs
    configs = [c for c in K.CUDA_CONFIGS if c.kwargs["V_SPLITS"] == 2]
    assert {c.num_warps for c in configs} == {4, 8}
    for config in configs:  # (the 4-warp ones take 64 rows a program: a 64-row tile, or a 128-row one in two)
        offered = []

        def only(candidates, named, c=config, **meta):
            offered.append(c in real(candidates, named, **meta))
            return [c]

        monkeypatch.setattr(tuner, "early_config_prune", only)
        K.reset_autotuning()
        rows = 64 if config.num_warps == 4 and config.kwargs["M_SPLITS"] == 1 else None
        out = prefix_attention(**args, **kw, value_splits=2, block_m=rows)
        assert offered and all(offered), config  # each launch (history and candidate tiles) would offer it
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2, msg=str(config))
    K.reset_autotuning()


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_several_programs_per_sm_configs_at_head_dim_64_bf16_cuda(mode, monkeypatch):
    """The configs that put several programs on an SM, each forced in turn for the candidate tiles: one warp group
    per 64 rows (a 128-row tile as two 4-warp programs); within bf16 tolerance of the reference."""
    from relaygr_engine.kernels import _prefix_config as K

    args, bias = make_problem([(1500, 20, 300), (64, 0, 40)], 64, 4, 64, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(mode, bias, 64)
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()}, **kw)
    tuner, real = K.autotuned_kernel(), K.prune_configs
    halves = [c for c in K.CUDA_CONFIGS if c.kwargs["M_SPLITS"] == 2 and c.kwargs["V_SPLITS"] == 1]
    reads = ["pointers", "tma"] if tma_device(torch.device("cuda")) else ["pointers"]
    assert len(halves) == 5
    for config in halves:
        if config.kwargs["TMA"] and "tma" not in reads:
            continue
        offered = []

        def only(candidates, named, c=config, **meta):
            kept = real(candidates, named, **meta)
            if not meta.get("CAND_TILES", named.get("CAND_TILES")):
                return kept  # history tiles: their own configs
            offered.append(c in kept)
            return [c]

        monkeypatch.setattr(tuner, "early_config_prune", only)
        K.reset_autotuning()
        out = prefix_attention(**args, **kw, page_reads="tma" if config.kwargs["TMA"] else "pointers")
        assert offered == [True], config
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2, msg=str(config))
    K.reset_autotuning()


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_split_tiles_on_one_warp_group_at_head_dim_256_bf16_cuda(mode, monkeypatch):
    """A ranking's tiles at head dim 256 (128 rows, split prefix) as two 4-warp programs per tile, each of the
    configs the autotuner may now pick there forced in turn (history tiles; HSTU's candidate tiles too): within
    bf16 tolerance of the reference."""
    from relaygr_engine.kernels import _prefix_config as K

    args, bias = make_problem([(3000, 100, 40)], 64, 2, 256, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(mode, bias, 256)
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()}, **kw)
    tuner, real = K.autotuned_kernel(), K.prune_configs
    reads = ["pointers", "tma"] if tma_device(torch.device("cuda")) else ["pointers"]
    wide = [c for c in K.CUDA_CONFIGS if c.num_warps == 4 and c.kwargs["M_SPLITS"] == 2
            and c.kwargs["V_SPLITS"] == 1 and c.kwargs["BLOCK_N"] == 32]
    assert len(wide) == 4
    for config in wide:
        if config.kwargs["TMA"] and "tma" not in reads:
            continue
        offered = []

        def only(candidates, named, c=config, **meta):
            kept = real(candidates, named, **meta)
            if meta.get("CAND_TILES", named.get("CAND_TILES")) and mode == "softmax":
                return kept  # softmax's candidate tiles: their own configs
            offered.append(c in kept)
            return [c]

        monkeypatch.setattr(tuner, "early_config_prune", only)
        K.reset_autotuning()
        out = prefix_attention(**args, **kw, splits=4, page_reads="tma" if config.kwargs["TMA"] else "pointers")
        assert offered == [True] * (2 if mode == "hstu" else 1), config
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2, msg=str(config))
    K.reset_autotuning()


@gpu
@needs_cuda
def test_new_batch_shapes_compile_no_new_kernel_binary():
    """Rankings of other lengths reuse the binaries of the first call (no second-long compile on the hot path), of
    the attention kernel and of the bias-table kernel (with a plan, two layers: the bias index built, then read)."""
    from relaygr_engine.kernels._bias_table import bias_table_kernel
    from relaygr_engine.kernels.prefix_attention import _prefix_attention_kernel as kernel
    from relaygr_engine.kernels.prefix_attention import plan_prefix_attention

    def binaries():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in (kernel, bias_table_kernel)]

    for i, users in enumerate([[(4000, 64, 256)], [(3001, 17, 255)], [(4100, 1, 33)], [(2500, 48, 64)]]):
        args, bias = make_problem(users, 64, 4, 128, device="cuda", dtype=torch.bfloat16, seed=i)
        kw = attention_kwargs("hstu", bias, 128)
        prefix_attention(**args, **kw, splits=3)
        plan = plan_prefix_attention(**{n: args[n] for n in ("cu_seqlens_q", "num_candidates", "kv_indptr",
                                                             "kv_indices", "kv_last_page_len")},
                                     kv_cache=args["kv_cache"])
        for _ in range(2):
            prefix_attention(**args, **kw, splits=3, plan=plan)
        if i == 0:
            first = binaries()
    assert binaries() == first


@gpu
@needs_cuda
def test_autotune_configs_compile_in_parallel_before_timing(monkeypatch):
    """A variant's first call compiles the configs it keeps on threads (kernels._compile) before the autotuner times
    them: every submitted config is a new binary when that returns, and the timing compiles nothing more; the result
    is within bf16 tolerance. (Head dim 96: a variant no other test compiles in this process.)"""
    from relaygr_engine.kernels import _compile
    from relaygr_engine.kernels.prefix_attention import _prefix_attention_kernel as kernel

    def binaries():
        return sum(len(c[0]) for c in kernel.device_caches.values())

    monkeypatch.setenv("RELAYGR_COMPILE_WORKERS", "4")
    spans, real = [], _compile.compile_configs

    def spy(*a, **kw):
        before = binaries()
        n = real(*a, **kw)
        spans.append((before, binaries(), n))
        return n

    monkeypatch.setattr(_compile, "compile_configs", spy)
    args, bias = make_problem([(700, 20, 90), (64, 3, 5)], 64, 2, 96, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs("hstu", bias, 96)
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()}, **kw)
    out = prefix_attention(**args, **kw)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    assert len(spans) == 2  # history and candidate tiles: a variant each
    for i, (before, after, n) in enumerate(spans):
        assert n >= 2 and after - before == n, spans        # each kept config compiled in the parallel step
        if i:
            assert before == spans[i - 1][1], spans           # the previous variant's timing compiled nothing
    assert binaries() == spans[-1][1], spans


@gpu
@needs_cuda
def test_prefix_attention_fp32_cuda_ieee():
    args, bias = make_problem([(300, 20, 100), (64, 1, 3)], 32, 2, 64, device="cuda")
    check_attention(args, attention_kwargs("hstu", bias, 64), persistent=False)
    check_attention(args, attention_kwargs("softmax", bias, 64), persistent=True)


def test_pick_splits_cuts_the_last_wave_and_splits_only_users_with_many_keys(monkeypatch):
    """The portable kernel's split count: the fewest waves of one program per SM times each program's keys and
    fixed traffic (``least_waves``), so a count whose last wave is nearly empty loses to one of whole waves; never
    more splits than ``MIN_SPLIT_KEYS`` allows."""
    from relaygr_engine.kernels import _split

    monkeypatch.setattr(_split.C, "_num_cores", lambda kind, index: 132)
    cuda = torch.device("cuda", 0)
    assert _split.pick_splits(cuda, 12, 3968 + 128) == 11    # a ranking at NVIDIA's shape: 132 programs, one wave
    assert _split.pick_splits(cuda, 24, 1 << 20) == 11       # 264 programs: two whole waves
    assert _split.pick_splits(cuda, 24, 2000) == 5           # 120 programs, one wave (7 would make two)
    assert _split.pick_splits(cuda, 144, 16448) == 9         # 144 programs: 1.09 waves unsplit, 9.8 of 1/9 the keys
    assert _split.pick_splits(cuda, 96, 4160) == 4           # 3 (the former rule) make 2.2 waves, 4 make 2.9
    assert _split.pick_splits(cuda, 264, 1 << 20) == 1       # two whole waves unsplit
    assert _split.pick_splits(cuda, 24, 255) == 1 and _split.pick_splits(cuda, 200, 511) == 1  # too few keys
    assert _split.pick_splits(cuda, 0, 0) == 1
    assert _split.pick_splits(torch.device("cpu"), 1, 1 << 20) == 1
    assert _split.pick_splits(cuda, 24, 3968, interpreted=True) == 1
    assert _split.pick_splits(torch.device("cpu"), 1, 0, splits=4) == 4
    for bad in (0, 33, True, 2.0):
        with pytest.raises(ValueError, match="splits must be an integer in"):
            _split.pick_splits(cuda, 24, 3968, splits=bad)


def test_split_layout_shares_every_key_evenly_and_drops_empty_splits(monkeypatch):
    """The launcher's splits: at NVIDIA's ranking shape (3968 cached keys + 128 new history rows, 12 tiles x heads)
    11 splits of 384 keys, where splitting the prefix alone gave 15 of 384 (4 of them empty, and split 0 also took
    the 128 new keys); a chosen count never leaves a split without keys; a caller's count is kept; the splits
    always cover the longest user's keys."""
    from relaygr_engine.kernels import _split

    monkeypatch.setattr(_split.C, "_num_cores", lambda kind, index: 132)
    cuda = torch.device("cuda", 0)
    assert _split.split_layout(cuda, 12, 3968 + 128) == (11, 384)
    assert _split.split_layout(cuda, 12, 4096 + 128) == (11, 384)       # a graph bucket's bound (prefix 4096)
    assert _split.split_layout(cuda, 24, 2000) == (5, 448)            # 5 x 448 >= 2000
    assert _split.split_layout(cuda, 24, 1000) == (3, 384)            # 3 x 384 >= 1000: no fourth split
    assert _split.split_layout(cuda, 24, 255) == (1, 256)             # one split covers every key
    assert _split.split_layout(cuda, 4, 1040, block_n=128) == (3, 384)  # 4 chosen, 128-key aligned: 3 used
    assert _split.split_layout(cuda, 12, 3968, splits=31) == (31, 128)    # a caller's count, as given
    assert _split.split_layout(torch.device("cpu"), 1, 0) == (1, 64)
    for work, keys in ((12, 4096), (24, 2000), (5, 100_000), (100, 700), (3, 64 * 31 + 1)):
        for forced in (None, 1, 7, 32):
            n, length = _split.split_layout(cuda, work, keys, splits=forced)
            assert n * length >= keys and length % 64 == 0
            if forced is None:
                assert (n - 1) * length < keys                        # the last split has keys


@gpu
@needs_cuda
def test_saved_autotune_choices_run_untimed_in_a_later_tuning_bf16_cuda(tmp_path, monkeypatch):
    """A variant tuned here, saved, forgotten and loaded: the launch runs the loaded config without pruning,
    compiling the other candidates or timing any (the autotuner's hooks fail if called), bit for bit what the
    tuned launch gave."""
    from relaygr_engine.kernels import _prefix_config as K
    from relaygr_engine.kernels.prefix_attention import load_autotune, save_autotune

    args, bias = make_problem([(2000, 30, 200)], 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs("hstu", bias, 128)
    tuner = K.autotuned_kernel()
    K.reset_autotuning()
    tuned = prefix_attention(**args, **kw)
    choices = dict(tuner.cache)
    path = str(tmp_path / "choices.json")
    assert save_autotune(path) == len(choices) >= 1
    K.reset_autotuning()
    assert load_autotune(path) == len(choices)
    assert tuner.cache == choices
    monkeypatch.setattr(tuner, "early_config_prune", lambda *a, **k: pytest.fail("pruned (tuning again)"))
    monkeypatch.setattr(tuner, "_bench", lambda *a, **k: pytest.fail("timed a config"))
    torch.testing.assert_close(prefix_attention(**args, **kw), tuned, atol=0, rtol=0)
    K.reset_autotuning()
