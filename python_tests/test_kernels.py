"""The prefix-attention kernel against its pure-torch reference, in Triton's CPU interpreter (fp32, max abs diff <=
1e-4) or compiled on CUDA (:mod:`kernel_problems` sets the interpreter up). The KV write/pack kernels are in
test_kernels_kv.py, the CUDA-only tests in test_kernels_cuda.py, CUDA's fast paths checked in the interpreter in
test_kernels_fast_paths.py, the sm_90 static compiles in test_kernels_sm90.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from kernel_problems import (CUDA, INTERPRETER, ATOL, attention_kwargs, check_attention, make_problem,
                             needs_interpreter)

from relaygr_engine.kernels import _common
from relaygr_engine.kernels.kv_write import kv_write
from relaygr_engine.kernels.prefix_attention import AttentionMode, prefix_attention
from relaygr_engine.kernels.reference import prefix_attention_ref, time_bucket_ref, visible_mask_ref


# ------------------------------------------------------------------------------------------------ references
def test_time_bucket_ref_is_clamped_bit_length():
    values = [-(1 << 40), -1, 0, 1, 2, 3, 4, 5, 7, 8, 9, 255, 256, (1 << 20) - 1, 1 << 20, (1 << 62) + 3,
              (1 << 63) - 1]
    d = torch.tensor(values, dtype=torch.int64)
    for nb in (1, 2, 8, 33, 64, 70):
        want = [min(max(x, 0).bit_length(), nb - 1) for x in values]
        assert time_bucket_ref(d, nb).tolist() == want


def test_visible_mask_ref():
    m = visible_mask_ref(num_prefix=2, num_hist=2, num_cand=2)
    assert m.int().tolist() == [[1, 1, 1, 0, 0, 0],   # history 0: prefix + itself
                                [1, 1, 1, 1, 0, 0],   # history 1: causal
                                [1, 1, 1, 1, 1, 0],   # candidate 0: prefix + history + itself
                                [1, 1, 1, 1, 0, 1]]   # candidate 1: never candidate 0


def test_interpreter_active():
    """Without CUDA the kernels must be testable here: the interpreter has to be on."""
    if CUDA:
        pytest.skip("CUDA present: kernels are compiled, not interpreted")
    assert INTERPRETER, ("triton was imported before TRITON_INTERPRET=1 was set, so the CPU tests cannot run; "
                         "set it in the environment or in a conftest.py before anything imports triton")


# ------------------------------------------------------------------------------------------------ prefix attention
# (users [(prefix, new history, candidates)], page_size, heads, head_dim, block_m, block_n)
ATTN_CASES = {
    "no-prefix": ([(0, 5, 3)], 16, 1, 32, None, None),
    "prefix-1": ([(1, 3, 40)], 16, 2, 64, 16, 16),
    "prefix-page-1": ([(15, 4, 10)], 16, 1, 32, None, None),
    "prefix-page+1": ([(33, 0, 20)], 32, 1, 64, None, None),
    "four-users-pages": ([(200, 7, 30), (0, 12, 0), (63, 1, 1), (130, 30, 5)], 64, 2, 128, 32, 16),
    "hundreds-of-candidates": ([(100, 3, 300)], 16, 1, 32, 64, 64),
    "head-dim-48": ([(40, 9, 17), (17, 2, 3)], 32, 2, 48, 16, 64),
    "history-only-multi-tile": ([(70, 45, 0), (5, 1, 0)], 16, 1, 32, 16, 32),
}


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_prefix_attention_matches_reference(case, mode):
    users, page_size, heads, head_dim, block_m, block_n = ATTN_CASES[case]
    args, bias = make_problem(users, page_size, heads, head_dim, seed=len(case))
    persistent = (sorted(ATTN_CASES).index(case) + (mode == "hstu")) % 2 == 0  # alternate the grid per case
    check_attention(args, attention_kwargs(mode, bias, head_dim), persistent=persistent, block_m=block_m,
                    block_n=block_n)


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
@pytest.mark.parametrize("splits", [2, 5])
def test_prefix_attention_split_prefix_matches_reference(mode, splits):
    """Split-prefix programs (flash-decoding style) and their merge: users with long, short and no prefix, chunks
    that end mid-page and splits left with no keys at all."""
    users = [(150, 7, 20), (3, 2, 4), (0, 5, 3), (97, 0, 9)]
    args, bias = make_problem(users, 16, 2, 32, seed=splits)
    check_attention(args, attention_kwargs(mode, bias, 32), persistent=splits == 5, block_m=16, block_n=16,
                    splits=splits)
    with pytest.raises(ValueError, match="splits must be an integer in"):
        prefix_attention(**args, **attention_kwargs(mode, bias, 32), splits=0)


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_prefix_attention_splits_share_new_history(mode):
    """A split's share runs past the cached prefix into the new history rows: 30 cached keys and 150 new rows in
    splits of 64 keys put the new history in three splits, history tiles' causal keys across two, the candidates'
    self term in the last; users whose keys end in an earlier split, or have no prefix, leave later splits empty.
    Every key counted once (a key dropped or taken twice moves the result past 1e-4), bias from the table and
    computed in the kernel."""
    from relaygr_engine.kernels._split import split_layout

    users = [(30, 150, 7), (0, 70, 5), (64, 0, 3), (100, 20, 0)]
    assert split_layout(torch.device("cpu"), 1, 180, splits=3) == (3, 64)
    args, bias = make_problem(users, 16, 2, 32, seed=7)
    for splits, budget in ((3, None), (4, 0)):
        check_attention(args, attention_kwargs(mode, bias, 32), persistent=splits == 4, block_m=16, block_n=16,
                        splits=splits, bias_table_bytes=budget)


@needs_interpreter
@pytest.mark.parametrize("seed", range(8))
def test_prefix_attention_random_shapes(seed):
    """Random batches: 1-4 users, prefix 0..150, history 0..20, candidates 0..80, any page size, mode and grid."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa: E731
    rand = lambda hi: int(torch.randint(hi + 1, (1,), generator=g))  # noqa: E731
    users = [(rand(150), rand(20), rand(80)) for _ in range(1 + rand(3))]
    page_size, head_dim, heads = pick([16, 32, 64]), pick([16, 32, 64]), 1 + rand(1)
    mode = pick(["softmax", "hstu"])
    args, bias = make_problem(users, page_size, heads, head_dim, seed=seed, num_pos=1 + rand(200),
                              num_buckets=1 + rand(40))
    which = pick([(), ("pos",), ("ts",), ("pos", "ts")])
    check_attention(args, attention_kwargs(mode, bias, head_dim, which), persistent=bool(seed % 2),
                    block_m=pick([16, 32]), block_n=pick([16, 32, 64]), bias_table_bytes=pick([None, 0]))


@needs_interpreter
@pytest.mark.parametrize("time_bucket", ["log2", "sqrt_60"])
def test_history_tiles_read_the_bias_table_within_its_budget(monkeypatch, time_bucket):
    """History tiles get rows of the bias table when they fit ``bias_table_bytes`` (4 bytes per tile row and key,
    the row width rounded up to 16) and compute the bias in the kernel otherwise: both give the same bits, split or
    not, and match the reference."""
    from relaygr_engine.kernels import _bias_table, prefix_attention as pa

    users = [(45, 20, 9), (16, 3, 0), (0, 7, 5), (30, 0, 4)]
    args, bias = make_problem(users, 16, 2, 32, seed=21, num_buckets=9 if time_bucket == "log2" else 40)
    kw = dict(attention_kwargs("hstu", bias, 32), time_bucket=time_bucket)
    built = []
    real = _bias_table.bias_table
    monkeypatch.setattr(pa, "bias_table", lambda user_rows, hist_tiles, *a, **k: (
        built.append((user_rows, None if hist_tiles is None else hist_tiles.shape[1])),
        real(user_rows, hist_tiles, *a, **k))[1])
    # history tiles of 16 rows: user 0 has 2, users 1 and 2 one each; rows as wide as the plan's bound on keys,
    # 45 + 29 = 74 (it counts the candidate rows too), plus 15 columns that align the new keys and a key block of 16
    # less one, rounded up to 112 entries
    need = 4 * 16 * 4 * 112
    outs = {}
    for budget in (None, need, need - 1, 0):
        for splits in (1, 3):
            built.clear()
            outs[budget, splits] = check_attention(args, kw, persistent=splits == 3, block_m=16, block_n=16,
                                                   splits=splits, bias_table_bytes=budget)
            assert built == [(4, 4 if budget is None or budget >= need else None)], (budget, built)
    for key, out in outs.items():
        assert torch.equal(out, outs[None, key[1]]), key


@needs_interpreter
@pytest.mark.parametrize("which", [(), ("pos",), ("ts",)], ids=["no-bias", "pos-only", "ts-only"])
def test_prefix_attention_hstu_bias_subsets(which):
    args, bias = make_problem([(50, 6, 12), (9, 0, 4)], 16, 2, 32, seed=7, num_pos=20)
    kw = attention_kwargs("hstu", bias, 32, which)
    check_attention(args, kw, persistent=True)


@needs_interpreter
@pytest.mark.parametrize("num_buckets", [1, 2, 9, 26, 32, 40, 64])
def test_prefix_attention_time_buckets(num_buckets):
    """Deltas at every power-of-two edge, negative and beyond 2**31 (either 32-bit word alone misleads, fp64 rounds
    above 2**53): the 32-bit, fp32, fp64 and corrected bucket paths."""
    args, bias = make_problem([(64, 2, 6)], 16, 1, 16, seed=3, num_buckets=num_buckets)
    edges = [0, 1, 2, 3, 4, 7, 8, 1023, 1024, (1 << 31) - 1, 1 << 31, (1 << 32) + 1, (1 << 32) + (1 << 31),
             (1 << 40) + 5, (1 << 53) + 1, (1 << 54) - 1, (1 << 61) + 1, (1 << 62) + 3, -1, -(1 << 33)]
    t_req = 1 << 62
    ts_k = torch.tensor([t_req - edges[i % len(edges)] for i in range(64)], dtype=torch.int64)
    pages = args["kv_indices"].long()
    bias["ts_cache"][pages] = ts_k.view(-1, 16)
    bias["ts_q"][:] = t_req
    check_attention(args, attention_kwargs("hstu", bias, 16, ("ts",)), persistent=False)


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_persistent_and_grid_launch_agree_bitwise(mode):
    args, bias = make_problem([(45, 10, 50), (16, 3, 2), (0, 0, 7)], 16, 2, 32, seed=11)
    kw = attention_kwargs(mode, bias, 32)
    grid = prefix_attention(**args, **kw, persistent=False, block_m=16)
    pers = prefix_attention(**args, **kw, persistent=True, block_m=16)
    assert torch.equal(grid, pers)
    torch.testing.assert_close(grid, prefix_attention_ref(**args, **kw), atol=ATOL, rtol=0)


@needs_interpreter
def test_a_plan_built_once_serves_every_call_and_is_checked():
    """plan_prefix_attention + plan= gives bitwise the unplanned result; a plan of another batch is refused."""
    from relaygr_engine.kernels.prefix_attention import PrefixAttentionPlan, plan_prefix_attention

    args, bias = make_problem([(45, 10, 50), (16, 3, 2), (0, 0, 7)], 16, 2, 32, seed=12)
    meta = {n: args[n] for n in ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")}
    plan = plan_prefix_attention(**meta, kv_cache=args["kv_cache"], block_m=16)
    assert isinstance(plan, PrefixAttentionPlan) and plan.block_m == 16 and plan.total_q == 72
    # history tiles: users 0 and 1 (10 and 3 rows); candidate tiles: ceil(50 / 16) + 1 + 1
    assert plan.hist_tiles.tolist() == [[0, 1], [0, 0]]
    assert plan.cand_tiles.tolist() == [[0, 0, 0, 0, 1, 2], [10, 26, 42, 58, 3, 0]]
    assert plan.num_tiles == 2 + 6 and plan.max_key_len == 45 + 60 and plan.num_cached == 61
    for mode in ("softmax", "hstu"):
        kw = attention_kwargs(mode, bias, 32)
        want = prefix_attention(**args, **kw, block_m=16)
        assert torch.equal(prefix_attention(**args, **kw, plan=plan), want)
        assert torch.equal(prefix_attention(**args, **kw, plan=plan, persistent=True), want)

    kw = attention_kwargs("softmax", bias, 32)
    with pytest.raises(ValueError, match="block_m=32 differs from the plan's block_m=16"):
        prefix_attention(**args, **kw, plan=plan, block_m=32)
    with pytest.raises(ValueError, match="plan must be a PrefixAttentionPlan"):
        prefix_attention(**args, **kw, plan=(plan.hist_tiles, plan.cand_tiles))
    other, _ = make_problem([(45, 10, 50), (16, 3, 3)], 16, 2, 32, seed=12)
    with pytest.raises(ValueError, match="plan was built for 3 users, 72 rows and .* got 2 users, 66 rows"):
        prefix_attention(**other, **kw, plan=plan)
    bigger = dict(args, kv_cache=torch.cat([args["kv_cache"], args["kv_cache"]]))
    with pytest.raises(ValueError, match="pages of 16 tokens on cpu, got 3 users, 72 rows and 14 pages"):
        prefix_attention(**bigger, **kw, plan=plan)
    bad = dict(meta, kv_last_page_len=meta["kv_last_page_len"] + 16)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] must be in \[1, 16\] \(user 0 has 3 pages\), got 29"):
        plan_prefix_attention(**bad, kv_cache=args["kv_cache"])


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_cached_prefix_equals_full_recompute(mode):
    """Rows attending to a prefix written by kv_write equal the same rows of an uncached pass over everything."""
    g = torch.Generator().manual_seed(5)
    page_size, heads, head_dim, p, n, c = 16, 2, 32, 37, 6, 9
    total = p + n + c
    q, k, v = (torch.randn(total, heads, head_dim, generator=g) for _ in range(3))
    ts = torch.cumsum(torch.randint(0, 5000, (total,), generator=g), 0)
    ts[p + n:] = ts[p + n - 1] + 17
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    pages = [5, 0, 3]
    kv_cache = torch.full((6, 2, page_size, heads, head_dim), float("nan"))
    ts_cache = torch.zeros(6, page_size, dtype=torch.int64)
    slots = torch.tensor([pages[t // page_size] * page_size + t % page_size for t in range(p)])
    kv_write(kv_cache, k[:p], v[:p], slots, ts=ts[:p], ts_cache=ts_cache)
    pos_bias, ts_bias = 0.3 * torch.randn(80, generator=g), 0.3 * torch.randn(24, generator=g)
    kw = dict(mode=mode, scale=0.2)
    if mode == "hstu":
        kw.update(hstu_norm=total, pos_bias=pos_bias, ts_bias=ts_bias)
    cached = prefix_attention(q[p:], k[p:], v[p:], kv_cache, i32([0, 3]), i32(pages), i32([p - 2 * page_size]),
                              i32([0, n + c]), i32([c]), ts_cache=ts_cache, ts_q=ts[p:], **kw)
    full = prefix_attention(q, k, v, kv_cache, i32([0, 0]), i32([]), i32([0]), i32([0, total]), i32([c]),
                            ts_cache=ts_cache, ts_q=ts, **kw)
    torch.testing.assert_close(cached, full[p:], atol=ATOL, rtol=0)


@needs_interpreter
def test_prefix_attention_empty_and_mode_spellings():
    args, bias = make_problem([(20, 0, 0), (3, 0, 0)], 16, 1, 16)
    assert prefix_attention(**args, mode="softmax", scale=1.0).shape == (0, 1, 16)
    args, bias = make_problem([(20, 2, 3)], 16, 1, 16)
    a = prefix_attention(**args, mode=AttentionMode.HSTU, scale=0.5)
    b = prefix_attention(**args, mode="HSTU", scale=0.5)
    assert torch.equal(a, b)


@needs_interpreter
def test_prefix_attention_without_cached_pages_needs_no_ts_cache():
    """No user has pages: timestamps of query rows suffice; bias tables of any float dtype are read as fp32."""
    args, bias = make_problem([(0, 4, 3), (0, 2, 0)], 16, 1, 16)
    kw = dict(mode="hstu", scale=0.5, pos_bias=bias["pos_bias"].double(), ts_bias=bias["ts_bias"], ts_q=bias["ts_q"])
    out = prefix_attention(**args, **kw)
    torch.testing.assert_close(out, prefix_attention_ref(**args, **kw, ts_cache=bias["ts_cache"]), atol=ATOL, rtol=0)


def _bad(args, **changes):
    out = dict(args)
    out.update(changes)
    return out


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_views_of_one_projection_need_no_copy(mode):
    """q, k and v split from one fused projection (dense rows, far apart) give the contiguous inputs' result, and
    kv_write stores such k/v rows as it stores contiguous ones; rows that are not dense are refused."""
    args, bias = make_problem([(40, 3, 5), (0, 2, 3), (17, 0, 4)], 16, 2, 32)
    T = args["q"].shape[0]
    fused = torch.cat([torch.randn(T, 7), *(args[n].reshape(T, -1) for n in ("q", "k", "v"))], 1)  # [T, 7 + 3 * 64]
    views = {n: fused[:, 7 + 64 * i: 7 + 64 * (i + 1)].view(T, 2, 32) for i, n in enumerate(("q", "k", "v"))}
    assert not views["q"].is_contiguous() and _common.rows_dense(views["q"])
    kw = attention_kwargs(mode, bias, 32)
    torch.testing.assert_close(prefix_attention(**{**args, **views}, **kw), prefix_attention(**args, **kw),
                               atol=0, rtol=0)
    slots = torch.arange(T, dtype=torch.int64) + 5
    caches = [torch.zeros_like(args["kv_cache"]) for _ in range(2)]
    kv_write(caches[0], views["k"], views["v"], slots)
    kv_write(caches[1], args["k"], args["v"], slots)
    assert torch.equal(caches[0], caches[1]) and caches[0].abs().sum() > 0
    from relaygr_engine import quant
    from relaygr_engine.config import KVDtype
    shape8 = quant.layer_shape(KVDtype.INT8, args["kv_cache"].shape[0], 16, 2, 32)
    pages8 = [torch.zeros(shape8, dtype=torch.uint8) for _ in range(2)]     # int8 pages: rows quantised as read
    kv_write(pages8[0], views["k"], views["v"], slots, kv_dtype="int8")
    kv_write(pages8[1], args["k"], args["v"], slots, kv_dtype="int8")
    assert torch.equal(pages8[0], pages8[1]) and pages8[0].any()
    swapped = args["k"].transpose(0, 1).contiguous().transpose(0, 1)           # rows not dense: strides [32, T*32, 1]
    with pytest.raises(ValueError, match=r"k must have dense rows \(strides \[\*, 32, 1\]; call \.contiguous\(\)\)"):
        kv_write(caches[0], swapped, args["v"], slots)


@needs_interpreter
def test_prefix_attention_rejects_bad_inputs():
    args, bias = make_problem([(20, 2, 3), (0, 1, 1)], 16, 2, 32)
    kw = dict(mode="softmax", scale=1.0)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cases = [
        (_bad(args, kv_indptr=args["kv_indptr"].long()), kw, ValueError, "kv_indptr must have dtype"),
        (_bad(args, q=args["q"].transpose(0, 1).contiguous().transpose(0, 1)), kw, ValueError, "contiguous"),
        (_bad(args, k=args["k"][:, :1].contiguous()), kw, ValueError, "k must have shape"),
        (_bad(args, v=args["v"].double()), kw, ValueError, "v must have dtype"),
        (_bad(args, k=torch.empty(args["k"].shape, device="meta")), kw, ValueError, "k must be on cpu"),
        (_bad(args, kv_cache=args["kv_cache"][:, :1]), kw, ValueError, "kv_cache must have shape"),
        (_bad(args, cu_seqlens_q=i32([0, 5, 8])), kw, ValueError,
         r"cu_seqlens_q must be non-decreasing offsets from 0 to 7 \(rows of q\), got \[0, 5, 8\]"),
        (_bad(args, num_candidates=i32([6, 1])), kw, ValueError,
         r"num_candidates\[0\] must be in \[0, 5\] \(user 0's rows\), got 6"),
        (_bad(args, kv_last_page_len=i32([0, 0])), kw, ValueError, r"kv_last_page_len\[0\] must be in \[1, 16\]"),
        (_bad(args, kv_indices=args["kv_indices"] + 100), kw, IndexError, "kv_indices must hold page ids"),
        (args, dict(mode="linear", scale=1.0), ValueError, "mode must be one of 'softmax', 'hstu'"),
        (args, dict(mode="softmax", scale=float("nan")), ValueError, "scale must be a finite number"),
        (args, dict(mode="softmax", scale=1.0, pos_bias=bias["pos_bias"]), ValueError, "mode='hstu' only"),
        (args, dict(mode="hstu", scale=1.0, ts_bias=bias["ts_bias"]), ValueError, "ts_bias needs ts_q"),
        (args, dict(mode="hstu", scale=1.0, ts_bias=bias["ts_bias"], ts_q=bias["ts_q"]), ValueError,
         "ts_bias needs ts_cache: 20 cached tokens"),
        (args, dict(mode="hstu", scale=1.0, hstu_norm=0.0), ValueError, "hstu_norm must be > 0"),
        (args, dict(mode="hstu", scale=1.0, pos_bias=bias["pos_bias"].long()), ValueError, "pos_bias must"),
        (args, dict(mode="hstu", scale=1.0, pos_bias=bias["pos_bias"][:0]), ValueError, "at least one entry"),
        (args, dict(kw, block_n=24), ValueError, "block_n must be a power of two"),
        (args, dict(kw, bias_table_bytes=-1), ValueError, "bias_table_bytes must be an integer >= 0, got -1"),
        (args, dict(kw, bias_table_bytes=True), ValueError, "bias_table_bytes must be an integer >= 0, got True"),
    ]
    for a, k, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            prefix_attention(**a, **k)


_I32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731


@pytest.mark.parametrize("change", [
    lambda a: dict(kv_indptr=a["kv_indptr"].long()),
    lambda a: dict(num_candidates=a["num_candidates"][None]),
    lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][:-1]),
    lambda a: dict(kv_indptr=a["kv_indptr"] + 1),
    lambda a: dict(kv_indices=torch.cat([a["kv_indices"], _I32([0])])),  # kv_indptr ends before kv_indices
    lambda a: dict(num_candidates=_I32([6, 1])),
    lambda a: dict(kv_last_page_len=_I32([0, 0])),
    lambda a: dict(kv_indices=a["kv_indices"] + 100),
])
def test_the_op_and_the_kernel_plan_share_one_layout_check(change):
    """ops.paged_prefix_attention and plan_prefix_attention refuse a bad table with the same error.

    (Bad ``cu_seqlens_q`` values are left out: the op's message names the row count of q, which a plan never sees.)
    """
    from relaygr_engine.kernels.prefix_attention import plan_prefix_attention
    from relaygr_engine.attention.ops import paged_prefix_attention

    args, _ = make_problem([(20, 2, 3), (0, 1, 1)], 16, 2, 32)
    bad = _bad(args, **change(args))
    meta = {n: bad[n] for n in ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")}
    with pytest.raises(ValueError) as by_op:
        paged_prefix_attention(**bad, mode="softmax", scale=1.0, backend="torch")
    with pytest.raises(ValueError) as by_plan:
        plan_prefix_attention(**meta, kv_cache=bad["kv_cache"])
    assert str(by_op.value) == str(by_plan.value)
    assert type(by_op.value) is type(by_plan.value)


def test_cpu_launch_without_interpreter_is_refused():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _common.check_launchable(torch.device("cpu"), object())


def test_an_interpreter_that_cannot_run_the_kernels_is_named(monkeypatch):
    """Triton before 3.7 with numpy 2.4 or later (its interpreter converts one-element arrays with ``int()``): a
    CPU launch in interpreter mode is refused naming both versions and the fix; 3.7 on, or numpy 2.3, runs."""
    import importlib.metadata

    def problem(triton_version, numpy_version):
        monkeypatch.setattr(importlib.metadata, "version", lambda name: triton_version)
        monkeypatch.setattr(_common.np, "__version__", numpy_version)
        _common.interpreter_problem.cache_clear()
        return _common.interpreter_problem()

    try:
        why = problem("3.6.0", "2.5.2")
        assert "Triton 3.6.0" in why and "numpy 2.5.2" in why and "Triton >= 3.7 or numpy < 2.4" in why
        kernel = type("InterpretedFunction", (), {})()  # (what the interpreter-mode check looks for)
        monkeypatch.setattr(_common, "interpreter_active", lambda: True)
        with pytest.raises(ValueError, match="Triton 3.6.0's CPU interpreter fails on numpy 2.5.2"):
            _common.check_launchable(torch.device("cpu"), kernel)
        assert problem("3.7.0", "2.5.2") is None and problem("3.6.0+git1ab2", "2.3.4") is None
        assert problem("3.10.1", "2.4.0") is None and problem("2.3.1", "2.4.0rc1") is not None
    finally:
        _common.interpreter_problem.cache_clear()


# ------------------------------------------------------------------------------------------------ bench smoke
@needs_interpreter
def test_bench_kernels_smoke(tmp_path, capsys):
    from relaygr_engine.bench import kernels as bench

    path = tmp_path / "k.json"
    assert bench.main(["--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "interpreter" in text
    assert text.strip().splitlines()[-1].startswith("RESULT ")
    data = json.loads(path.read_text())
    assert data["rows"] and all(r["max_abs_err"] <= ATOL for r in data["rows"])

    # --block-m compares tile heights in one run: each shape once per value, a geomean per value in RESULT
    assert bench.main(["--modes", "softmax", "--block-m", "16,32", "--json", str(path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "geomean_speedup_vs_sdpa_bm16=" in last and "geomean_speedup_vs_sdpa_bm32=" in last
    rows = json.loads(path.read_text())["rows"]
    assert sorted(r["block_m"] for r in rows) == [16, 32] and all(r["max_abs_err"] <= ATOL for r in rows)
    with pytest.raises(SystemExit):
        bench.main(["--block-m", "24"])
    with pytest.raises(SystemExit):
        bench.main(["--head-dims", "48"])  # no shape has it

    # runs split between calls (e.g. per head dim), joined by --summarize: the RESULT of all their rows
    parts = [tmp_path / f"{m}.json" for m in ("softmax", "hstu")]
    for m, part in zip(("softmax", "hstu"), parts):
        assert bench.main(["--modes", m, "--head-dims", "32", "--json", str(part)]) == 0
    capsys.readouterr()
    joined = tmp_path / "all.json"
    assert bench.main(["--summarize", *map(str, parts), "--json", str(joined)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and "shapes=2" in last and "geomean_speedup_vs_sdpa=" in last
    rows = json.loads(joined.read_text())["rows"]
    assert sorted(r["mode"] for r in rows) == ["hstu", "softmax"]
    other = json.loads(parts[1].read_text())
    other["summary"]["dtype"] = "bfloat16"
    parts[1].write_text(json.dumps(other))
    assert bench.main(["--summarize", *map(str, parts)]) == 2
    assert "summarise runs of one setting" in capsys.readouterr().err
    assert bench.main(["--summarize", str(tmp_path / "missing.json")]) == 2
