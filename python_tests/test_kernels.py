"""Triton kernels against their pure-torch references.

Without CUDA the kernels run in Triton's CPU interpreter in fp32 (max abs diff <= 1e-4). Triton reads
``TRITON_INTERPRET`` when it decorates ``@triton.jit`` functions, its own library functions included, so the variable
is set here before triton's first import; if triton was already imported without it, ``test_interpreter_active``
fails and says so. bf16 tests on CUDA skip where there is no CUDA device.
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from relaygr_engine.kernels import _common  # noqa: E402
from relaygr_engine.kernels.kv_pack import kv_pack, kv_unpack, packed_shape  # noqa: E402
from relaygr_engine.kernels.kv_write import kv_write  # noqa: E402
from relaygr_engine.kernels.prefix_attention import AttentionMode, prefix_attention  # noqa: E402
from relaygr_engine.kernels.reference import (  # noqa: E402
    kv_pack_ref, kv_unpack_ref, kv_write_ref, prefix_attention_ref, time_bucket_ref, visible_mask_ref)

INTERPRETER = _common.interpreter_active()
ATOL = 1e-4

needs_interpreter = pytest.mark.skipif(
    not INTERPRETER, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import); "
                            "not active in this process")
needs_cuda = pytest.mark.skipif(not CUDA or INTERPRETER,
                                reason="needs a CUDA device and compiled Triton (no CUDA here, or interpreter mode)")
gpu = pytest.mark.gpu


# ------------------------------------------------------------------------------------------------ problem builder
def make_problem(users, page_size, heads, head_dim, *, seed=0, spare_pages=3, num_buckets=16, num_pos=64,
                 device="cpu", dtype=torch.float32):
    """A random varlen batch; ``users`` = [(prefix_len, new_history, candidates), ...].

    Pages are scattered (shuffled ids, spare pages between) and every unused cache slot holds NaN, so any read
    outside a user's tokens poisons the output. Timestamps increase with log-uniform gaps (a few negative, to
    exercise the clamp at 0); candidates share the request time.
    """
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(_common.cdiv(p, page_size) for p, _, _ in users) + spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    kv_cache = torch.full((num_pages, 2, page_size, heads, head_dim), float("nan"))
    ts_cache = torch.randint(-(1 << 40), 1 << 40, (num_pages, page_size), generator=g)
    cu, cand, indptr, indices, last, ts_q = [0], [], [0], [], [], []
    for p, n, c in users:
        pages = [perm.pop() for _ in range(_common.cdiv(p, page_size))]
        gaps = (2.0 ** (torch.rand(p + n + 1, generator=g) * 24)).long() - torch.randint(0, 3, (p + n + 1,),
                                                                                         generator=g)
        ts = torch.cumsum(gaps, 0) + (1 << 30)
        for t in range(p):
            page, slot = pages[t // page_size], t % page_size
            kv_cache[page, :, slot] = torch.randn(2, heads, head_dim, generator=g)
            ts_cache[page, slot] = ts[t]
        ts_q += ts[p:p + n].tolist() + [int(ts[p + n])] * c
        cu.append(cu[-1] + n + c)
        cand.append(c)
        indices += pages
        indptr.append(len(indices))
        last.append(0 if not pages else p - (len(pages) - 1) * page_size)
    total = cu[-1]
    q, k, v = (torch.randn(total, heads, head_dim, generator=g) for _ in range(3))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    args = dict(q=q, k=k, v=v, kv_cache=kv_cache)
    args = {name: t.to(device=device, dtype=dtype) for name, t in args.items()}
    args.update(kv_indptr=i32(indptr), kv_indices=i32(indices), kv_last_page_len=i32(last), cu_seqlens_q=i32(cu),
                num_candidates=i32(cand))
    bias = dict(pos_bias=(0.5 * torch.randn(num_pos, generator=g)).to(device),
                ts_bias=(0.5 * torch.randn(num_buckets, generator=g)).to(device),
                ts_cache=ts_cache.to(device), ts_q=torch.tensor(ts_q, dtype=torch.int64, device=device))
    return args, bias


def attention_kwargs(mode, bias, head_dim, which=("pos", "ts")):
    if mode == "softmax":
        return dict(mode="softmax", scale=1.0 / math.sqrt(head_dim))
    kw = dict(mode="hstu", scale=1.0 / math.sqrt(head_dim), hstu_norm=64.0)
    if "pos" in which:
        kw["pos_bias"] = bias["pos_bias"]
    if "ts" in which:
        kw.update(ts_bias=bias["ts_bias"], ts_cache=bias["ts_cache"], ts_q=bias["ts_q"])
    return kw


def check_attention(args, kw, *, persistent, block_m=None, block_n=None, atol=ATOL, splits=None,
                    bias_table_bytes=None):
    out = prefix_attention(**args, **kw, persistent=persistent, block_m=block_m, block_n=block_n, splits=splits,
                           bias_table_bytes=bias_table_bytes)
    ref = prefix_attention_ref(**args, **kw)
    assert out.shape == ref.shape and out.dtype == args["q"].dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    return out


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
    from relaygr_engine.kernels import _prefix_kernel as K, prefix_attention as pa

    monkeypatch.setattr(pa, "_fast_silu", lambda device, dtype: True)
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
    from relaygr_engine.ops import paged_prefix_attention

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


# ------------------------------------------------------------------------------------------------ kv_write
@needs_interpreter
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("with_ts", [False, True])
def test_kv_write_matches_reference(persistent, with_ts):
    g = torch.Generator().manual_seed(int(persistent) * 2 + int(with_ts))
    num_pages, page_size, heads, head_dim, n = 12, 16, 2, 48, 37
    cache = torch.randn(num_pages, 2, page_size, heads, head_dim, generator=g)
    ts_cache = torch.randint(0, 1000, (num_pages, page_size), generator=g)
    expect, expect_ts = cache.clone(), ts_cache.clone()
    k, v = torch.randn(n, heads, head_dim, generator=g), torch.randn(n, heads, head_dim, generator=g)
    slots = torch.randperm(num_pages * page_size, generator=g)[:n]
    slots[[0, 5, 36]] = -1  # padding rows are skipped
    ts = torch.randint(1 << 40, 1 << 41, (n,), generator=g)
    extra = dict(ts=ts, ts_cache=ts_cache) if with_ts else {}
    kv_write(cache, k, v, slots, persistent=persistent, **extra)
    kv_write_ref(expect, k, v, slots, **(dict(ts=ts, ts_cache=expect_ts) if with_ts else {}))
    assert torch.equal(cache, expect)
    assert torch.equal(ts_cache, expect_ts)
    page, off = slots[1] // page_size, slots[1] % page_size
    assert torch.equal(cache[page, 0, off], k[1]) and torch.equal(cache[page, 1, off], v[1])


@needs_interpreter
def test_kv_write_rejects_bad_inputs():
    cache = torch.zeros(4, 2, 16, 2, 32)
    k = v = torch.zeros(3, 2, 32)
    with pytest.raises(IndexError, match="slot_mapping must hold slots < num_pages"):
        kv_write(cache, k, v, torch.tensor([0, 1, 64]))
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        kv_write(cache, k, v, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="v must have shape"):
        kv_write(cache, k, torch.zeros(3, 2, 16), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="give ts and ts_cache together"):
        kv_write(cache, k, v, torch.tensor([0, 1, 2]), ts=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        kv_write(torch.zeros(4, 3, 16, 2, 32), k, v, torch.tensor([0, 1, 2]))
    kv_write(cache, k[:0], v[:0], torch.tensor([], dtype=torch.int64))  # nothing to write is fine
    assert not cache.any()


# ------------------------------------------------------------------------------------------------ kv_pack
def _caches(num_layers=3, num_pages=9, page_size=16, heads=2, head_dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_pages, 2, page_size, heads, head_dim, generator=g) for _ in range(num_layers)]


@needs_interpreter
@pytest.mark.parametrize("persistent", [False, True])
def test_kv_pack_layout_and_roundtrip(persistent):
    caches = _caches()
    ids = [7, 2, 5, 0]
    buf = kv_pack(caches, ids, persistent=persistent)
    assert buf.shape == packed_shape(caches, 4) == (3, 2, 64, 2, 32) and buf.is_contiguous()
    assert torch.equal(buf, kv_pack_ref(caches, ids))
    for layer in (0, 2):  # the documented layout, element by element for some slots
        for i, page in enumerate(ids):
            for slot in (0, 15):
                assert torch.equal(buf[layer, 0, i * 16 + slot], caches[layer][page, 0, slot])
                assert torch.equal(buf[layer, 1, i * 16 + slot], caches[layer][page, 1, slot])
    dest, expect = _caches(seed=1), _caches(seed=1)
    kv_unpack(buf, dest, torch.tensor([1, 8, 3, 4], dtype=torch.int32), persistent=persistent)
    kv_unpack_ref(buf, expect, [1, 8, 3, 4])
    assert all(torch.equal(a, b) for a, b in zip(dest, expect))
    assert all(torch.equal(d[1], c[7]) and torch.equal(d[0], e[0]) for d, c, e in zip(dest, caches, _caches(seed=1)))


@needs_interpreter
def test_kv_pack_out_and_empty():
    caches = _caches(num_layers=2)
    out = torch.full(packed_shape(caches, 2), 7.0)
    assert kv_pack(caches, [4, 4], out=out) is out  # a page may be packed twice
    assert torch.equal(out[:, :, :16], out[:, :, 16:]) and torch.equal(out, kv_pack_ref(caches, [4, 4]))
    empty = kv_pack(caches, [])
    assert empty.shape == (2, 2, 0, 2, 32)
    before = [c.clone() for c in caches]
    kv_unpack(empty, caches, [])
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


@needs_interpreter
def test_kv_pack_rejects_bad_inputs():
    caches = _caches(num_layers=2)
    buf = kv_pack(caches, [1, 2])
    with pytest.raises(ValueError, match="must not repeat a page id"):
        kv_unpack(buf, caches, [3, 3])
    with pytest.raises(IndexError, match=r"page_ids must hold page ids in \[0, 9\)"):
        kv_pack(caches, [0, 9])
    with pytest.raises(ValueError, match="buffer must have shape"):
        kv_unpack(buf, caches, [1, 2, 3])
    with pytest.raises(ValueError, match="kv_caches\\[1\\] must have shape"):
        kv_pack([caches[0], caches[1][:, :, :8].contiguous()], [0])
    with pytest.raises(ValueError, match="non-empty list"):
        kv_pack(caches[0], [0])
    with pytest.raises(ValueError, match="out must have dtype"):
        kv_pack(caches, [1], out=torch.zeros(packed_shape(caches, 1), dtype=torch.float64))


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


# ------------------------------------------------------------------------------------------------ CUDA (bf16)
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


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_prefix_attention_split_prefix_bf16_cuda(mode):
    """A ranking's shape (one user, few rows, long prefix): the automatic split choice splits, and forced splits
    agree with the reference."""
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


@gpu
@needs_cuda
def test_new_batch_shapes_compile_no_new_kernel_binary():
    """Rankings of other lengths reuse the binaries of the first call (no second-long compile on the hot path), of
    the attention kernel and of the bias-table kernel."""
    from relaygr_engine.kernels._bias_table import bias_table_kernel
    from relaygr_engine.kernels.prefix_attention import _prefix_attention_kernel as kernel

    def binaries():
        return [sum(len(c[0]) for c in k.device_caches.values()) for k in (kernel, bias_table_kernel)]

    for i, users in enumerate([[(4000, 64, 256)], [(3001, 17, 255)], [(4100, 1, 33)], [(2500, 48, 64)]]):
        args, bias = make_problem(users, 64, 4, 128, device="cuda", dtype=torch.bfloat16, seed=i)
        kw = attention_kwargs("hstu", bias, 128)
        prefix_attention(**args, **kw, splits=3)
        if i == 0:
            first = binaries()
    assert binaries() == first


@gpu
@needs_cuda
def test_prefix_attention_fp32_cuda_ieee():
    args, bias = make_problem([(300, 20, 100), (64, 1, 3)], 32, 2, 64, device="cuda")
    check_attention(args, attention_kwargs("hstu", bias, 64), persistent=False)
    check_attention(args, attention_kwargs("softmax", bias, 64), persistent=True)


@gpu
@needs_cuda
def test_kv_write_and_pack_bf16_cuda():
    caches = [torch.randn(40, 2, 32, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    k, v = torch.randn(50, 4, 64, device="cuda"), torch.randn(50, 4, 64, device="cuda")
    slots = torch.randperm(40 * 32, device="cuda")[:50]
    expect = caches[0].clone()
    kv_write(caches[0], k, v, slots)  # fp32 rows into a bf16 cache
    kv_write_ref(expect, k, v, slots)
    assert torch.equal(caches[0], expect)
    ids = torch.tensor([3, 31, 7], device="cuda")
    host = torch.empty(packed_shape(caches, 3), dtype=torch.bfloat16, pin_memory=True)
    kv_pack(caches, ids, out=host)
    torch.cuda.synchronize()
    assert torch.equal(host, kv_pack_ref([c.cpu() for c in caches], ids.cpu()))
    dest = [torch.zeros_like(c) for c in caches]
    kv_unpack(host, dest, ids)
    assert all(torch.equal(d[ids], c[ids]) for d, c in zip(dest, caches))


def test_pick_splits_splits_only_long_cached_prefixes_that_leave_cores_idle(monkeypatch):
    from relaygr_engine.kernels import _split

    monkeypatch.setattr(_split.C, "_num_cores", lambda kind, index: 132)
    cuda = torch.device("cuda", 0)
    assert _split.pick_splits(cuda, 24, 3968) == 7           # 24 programs on 132 cores: 3968 // 512 keys-limited
    assert _split.pick_splits(cuda, 24, 1 << 20) == 11       # core-limited: cdiv(2 * 132, 24)
    assert _split.pick_splits(cuda, 24, 511) == 1            # too few cached keys per split
    assert _split.pick_splits(cuda, 0, 0) == 1 and _split.pick_splits(cuda, 200, 1 << 20) == 1
    assert _split.pick_splits(torch.device("cpu"), 1, 1 << 20) == 1
    assert _split.pick_splits(cuda, 24, 3968, interpreted=True) == 1
    assert _split.pick_splits(torch.device("cpu"), 1, 0, splits=4) == 4
    for bad in (0, 33, True, 2.0):
        with pytest.raises(ValueError, match="splits must be an integer in"):
            _split.pick_splits(cuda, 24, 3968, splits=bad)
