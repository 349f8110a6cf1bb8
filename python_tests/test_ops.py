"""paged_prefix_attention: the torch op against a naive per-query loop, validation, dispatch, registration."""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import relaygr_engine.attention.reference as reference_attention
from relaygr_engine.attention.ops import paged_prefix_attention, time_buckets

PAGE = 4
H, D = 2, 8
NUM_PAGES = 48
NB = 9  # time buckets
POS = 33  # position-bias entries


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------- fixtures
def make_batch(segments, seed=0, same_request_time=True):
    """Random op inputs for users given as (prefix tokens P, new history tokens n, candidates C)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(n + c for _, n, c in segments)
    q, k, v = (torch.randn(total, H, D, generator=g) for _ in range(3))
    kv_cache = torch.randn(NUM_PAGES, 2, PAGE, H, D, generator=g)
    ts_cache = torch.randint(0, 1 << 20, (NUM_PAGES, PAGE), generator=g)
    free = torch.randperm(NUM_PAGES, generator=g).tolist()
    indptr, indices, last, cu, ncand, ts_q = [0], [], [], [0], [], []
    for P, n, c in segments:
        pages = -(-P // PAGE)
        indices += [free.pop() for _ in range(pages)]
        indptr.append(len(indices))
        last.append(P - (pages - 1) * PAGE if pages else 0)
        cu.append(cu[-1] + n + c)
        ncand.append(c)
        t_new = (1 << 20) + torch.randint(0, 1 << 12, (n,), generator=g)
        t_req = (1 << 21) + torch.randint(0, 1 << 12, (1 if same_request_time else c,), generator=g).expand(c)
        ts_q.append(torch.cat([t_new, t_req]))
    i32 = (lambda a: torch.tensor(a, dtype=torch.int32))
    return dict(q=q, k=k, v=v, kv_cache=kv_cache, kv_indptr=i32(indptr), kv_indices=i32(indices),
                kv_last_page_len=i32(last), cu_seqlens_q=i32(cu), num_candidates=i32(ncand),
                ts_cache=ts_cache, ts_q=torch.cat(ts_q).long())


def naive(args, mode, scale, hstu_norm=1.0, pos_bias=None, ts_bias=None):
    """One query row at a time, keys listed token by token, in float64: the op's spec written out literally."""
    a = {key: (t.double() if t.is_floating_point() else t) for key, t in args.items()}
    q, k, v, cache = a["q"], a["k"], a["v"], a["kv_cache"]
    indptr, indices = a["kv_indptr"].tolist(), a["kv_indices"].tolist()
    last, cu, ncand = a["kv_last_page_len"].tolist(), a["cu_seqlens_q"].tolist(), a["num_candidates"].tolist()
    ts_cache, ts_q = a["ts_cache"], a["ts_q"]
    out = torch.zeros_like(q)
    for b in range(len(ncand)):
        pages = indices[indptr[b]:indptr[b + 1]]
        P = (len(pages) - 1) * PAGE + last[b] if pages else 0
        # (position, key, value, time) of every cached token
        prefix = [(j, cache[pages[j // PAGE], 0, j % PAGE], cache[pages[j // PAGE], 1, j % PAGE],
                   int(ts_cache[pages[j // PAGE], j % PAGE])) for j in range(P)]
        r0, r1 = cu[b], cu[b + 1]
        n = r1 - r0 - ncand[b]
        new = [(P + i, k[r0 + i], v[r0 + i], int(ts_q[r0 + i])) for i in range(n)]
        for i in range(r1 - r0):
            row = r0 + i
            if i < n:
                q_pos, keys = P + i, prefix + new[:i + 1]
            else:
                q_pos, keys = P + n, prefix + new + [(P + n, k[row], v[row], int(ts_q[row]))]
            t_q = int(ts_q[row])
            for h in range(H):
                logits = torch.stack([scale * (q[row, h] @ kk[h]) for _, kk, _, _ in keys])
                vals = torch.stack([vv[h] for _, _, vv, _ in keys])
                if mode == "softmax":
                    out[row, h] = torch.softmax(logits, 0) @ vals
                    continue
                for j, (k_pos, _, _, t_k) in enumerate(keys):
                    if pos_bias is not None:
                        logits[j] += float(pos_bias[min(q_pos - k_pos, len(pos_bias) - 1)])
                    if ts_bias is not None:
                        logits[j] += float(ts_bias[min(max(t_q - t_k, 0).bit_length(), len(ts_bias) - 1)])
                out[row, h] = F.silu(logits) @ vals / hstu_norm
    return out


SEGMENTS = {
    "empty_prefix": [(0, 3, 2)],
    "prefix_1": [(1, 0, 5)],
    "page_minus_1": [(PAGE - 1, 2, 1)],
    "page": [(PAGE, 1, 2)],
    "page_plus_1": [(PAGE + 1, 0, 3)],
    "several_pages_many_candidates": [(3 * PAGE + 2, 5, 40)],
    "candidates_only": [(0, 0, 1)],
    "history_only": [(2 * PAGE, 3, 0)],
    "varlen_batch": [(0, 3, 2), (1, 0, 5), (PAGE + 1, 4, 3), (0, 0, 0), (2 * PAGE + 3, 0, 7), (PAGE, 6, 1)],
}


def biases(kind):
    g = torch.Generator().manual_seed(7)
    pos = torch.randn(POS, generator=g) if kind in ("pos", "pos+ts") else None
    ts = torch.randn(NB, generator=g) if kind in ("ts", "pos+ts") else None
    return pos, ts


# ----------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", sorted(SEGMENTS))
@pytest.mark.parametrize("mode, bias", [("softmax", "none"), ("hstu", "none"), ("hstu", "pos"), ("hstu", "ts"),
                                        ("hstu", "pos+ts")])
def test_op_matches_naive_loop(name, mode, bias):
    args = make_batch(SEGMENTS[name], seed=len(name))
    pos, ts = biases(bias)
    kw = dict(mode=mode, scale=0.37)
    if mode == "hstu":
        kw.update(hstu_norm=5.0, pos_bias=pos, ts_bias=ts)
    got = paged_prefix_attention(**args, **kw)
    want = naive(args, **kw)
    assert got.shape == args["q"].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_small_blocks_and_per_row_request_times(monkeypatch, mode):
    """Row blocking (forced tiny) and candidates with different timestamps give the same result."""
    monkeypatch.setattr(reference_attention, "_MAX_BLOCK_ELEMS", 7)
    args = make_batch(SEGMENTS["varlen_batch"], seed=3, same_request_time=False)
    pos, ts = biases("pos+ts")
    kw = dict(mode=mode, scale=0.5)
    if mode == "hstu":
        kw.update(hstu_norm=3.0, pos_bias=pos, ts_bias=ts)
    torch.testing.assert_close(paged_prefix_attention(**args, **kw).double(), naive(args, **kw),
                               atol=1e-5, rtol=1e-5)


def sorted_times(args, seed=0, gap_bits=12, request_offset=1):
    """Give every user non-decreasing timestamps over its cached tokens then its new rows (a real history);
    candidates get the last history time + ``request_offset`` (negative: before part of the history)."""
    g = torch.Generator().manual_seed(seed)
    a = dict(args)
    ts_cache, ts_q = a["ts_cache"].clone(), a["ts_q"].clone()
    indptr, indices = a["kv_indptr"].tolist(), a["kv_indices"].tolist()
    last, cu, ncand = a["kv_last_page_len"].tolist(), a["cu_seqlens_q"].tolist(), a["num_candidates"].tolist()
    for b in range(len(ncand)):
        pages = indices[indptr[b]:indptr[b + 1]]
        P = (len(pages) - 1) * PAGE + last[b] if pages else 0
        n = cu[b + 1] - cu[b] - ncand[b]
        # repeated times (gap 0) and gaps spanning many buckets
        gaps = torch.randint(0, 1 << gap_bits, (P + n,), generator=g) * torch.randint(0, 2, (P + n,), generator=g)
        t = (1 << 30) + torch.cumsum(gaps, 0)
        for j in range(P):
            ts_cache[pages[j // PAGE], j % PAGE] = t[j]
        ts_q[cu[b]:cu[b] + n] = t[P:]
        t_last = int(t[-1]) if P + n else 1 << 30
        ts_q[cu[b] + n:cu[b + 1]] = t_last + request_offset
    a.update(ts_cache=ts_cache, ts_q=ts_q)
    return a


@pytest.mark.parametrize("gap_bits, num_buckets, request_offset", [(12, NB, 1), (40, 64, 5), (3, 1, 0),
                                                                   (10, NB, -(1 << 12))])
def test_sorted_histories_take_the_run_length_time_bias(monkeypatch, gap_bits, num_buckets, request_offset):
    """Non-decreasing key times never bucketise per element, and give exactly the spec's biases."""
    args = sorted_times(make_batch(SEGMENTS["varlen_batch"], seed=5), seed=gap_bits, gap_bits=gap_bits,
                        request_offset=request_offset)
    g = torch.Generator().manual_seed(3)
    pos, ts = torch.randn(POS, generator=g), torch.randn(num_buckets, generator=g)
    kw = dict(mode="hstu", scale=0.4, hstu_norm=2.0, pos_bias=pos, ts_bias=ts)
    want = naive(args, **kw)

    def no_buckets(*a, **k):
        raise AssertionError("per-element time buckets on a sorted history")

    monkeypatch.setattr(reference_attention, "time_buckets", no_buckets)
    torch.testing.assert_close(paged_prefix_attention(**args, **kw).double(), want, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(reference_attention, "_HISTORY_BLOCK_ROWS", 2)  # several causal blocks per user
    torch.testing.assert_close(paged_prefix_attention(**args, **kw).double(), want, atol=1e-5, rtol=1e-5)


def test_time_bias_falls_back_to_buckets_for_unsorted_keys():
    args = sorted_times(make_batch([(2 * PAGE + 1, 3, 2)], seed=8), seed=1)
    args["ts_q"][0] = 1 << 29  # one new row older than the cached prefix: keys not sorted
    pos, ts = biases("pos+ts")
    kw = dict(mode="hstu", scale=0.4, hstu_norm=2.0, pos_bias=pos, ts_bias=ts)
    torch.testing.assert_close(paged_prefix_attention(**args, **kw).double(), naive(args, **kw), atol=1e-5,
                               rtol=1e-5)


def test_hstu_partial_sums_add_over_split_prefix():
    """HSTU attention is a plain sum over keys: caching more of the history must not change outputs."""
    base = make_batch([(2 * PAGE + 1, 0, 4)], seed=11)
    pos, ts = biases("pos+ts")
    kw = dict(mode="hstu", scale=0.3, hstu_norm=7.0, pos_bias=pos, ts_bias=ts)
    want = naive(base, **kw)
    torch.testing.assert_close(paged_prefix_attention(**base, **kw).double(), want, atol=1e-5, rtol=1e-5)


def test_fp64_inputs_accumulate_in_fp64():
    args = {k: (t.double() if t.is_floating_point() else t) for k, t in make_batch([(PAGE + 2, 2, 3)]).items()}
    got = paged_prefix_attention(**args, mode="softmax", scale=0.2)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, naive(args, "softmax", 0.2), atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------------------------- time buckets
def test_time_buckets_equal_python_bit_length():
    values = [-(1 << 40), -5, -1, 0, 1, 2, 3, 4, 5, 7, 8, 255, 256, 257, (1 << 31) - 1, 1 << 31, (1 << 52) + 1,
              (1 << 62) - 1, 1 << 62, (1 << 63) - 1]
    d = torch.tensor(values, dtype=torch.long)
    for nb in (1, 2, 5, 32, 64):
        want = [min(max(x, 0).bit_length(), nb - 1) for x in values]
        assert time_buckets(d, nb).tolist() == want, nb


def test_time_buckets_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_buckets"):
        time_buckets(torch.zeros(3, dtype=torch.long), 65)
    with pytest.raises(ValueError, match="int64"):
        time_buckets(torch.zeros(3, dtype=torch.int32), 8)


# ----------------------------------------------------------------------------------------------- validation
def _bad(args, **changes):
    a = dict(args)
    a.update(changes)
    return a


@pytest.mark.parametrize("change, match", [
    (lambda a: dict(q=a["q"][None]), "q must be 3-D"),
    (lambda a: dict(k=a["k"][:-1]), "k must have the shape of q"),
    (lambda a: dict(v=a["v"].double()), "v must be torch.float32"),
    (lambda a: dict(kv_cache=a["kv_cache"][:, :1]), "kv_cache must have shape"),
    (lambda a: dict(kv_cache=a["kv_cache"][..., :3]), "kv_cache must have shape"),
    (lambda a: dict(kv_indptr=a["kv_indptr"].long()), "kv_indptr must have dtype torch.int32, got torch.int64"),
    (lambda a: dict(kv_indices=a["kv_indices"].long()), "kv_indices must have dtype torch.int32, got torch.int64"),
    (lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"][:-1]), "cu_seqlens_q must have 3 entries"),
    (lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].flip(0)), "cu_seqlens_q must be non-decreasing"),
    (lambda a: dict(kv_indptr=a["kv_indptr"] + 1), "kv_indptr must be non-decreasing offsets from 0"),
    (lambda a: dict(num_candidates=a["num_candidates"] + 100), r"num_candidates\[0\] must be in"),
    (lambda a: dict(kv_last_page_len=a["kv_last_page_len"] * 0), r"kv_last_page_len\[0\] must be in \[1, 4\]"),
    (lambda a: dict(kv_indices=a["kv_indices"] + NUM_PAGES), "kv_indices must hold page ids in"),
    (lambda a: dict(num_candidates=a["num_candidates"][None]), "num_candidates must be 1-D"),
])
def test_validation_names_the_bad_argument(change, match):
    args = make_batch([(PAGE + 1, 2, 3), (2, 1, 1)])
    with pytest.raises(ValueError, match=match):
        paged_prefix_attention(**_bad(args, **change(args)), mode="softmax", scale=1.0)


def test_validation_of_mode_scale_and_biases():
    args = make_batch([(PAGE + 1, 2, 3)])
    pos, ts = biases("pos+ts")
    with pytest.raises(ValueError, match="mode must be one of 'softmax', 'hstu'"):
        paged_prefix_attention(**args, mode="linear", scale=1.0)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'torch', 'triton'"):
        paged_prefix_attention(**args, mode="hstu", scale=1.0, backend="cuda")
    with pytest.raises(ValueError, match="scale must be a finite number"):
        paged_prefix_attention(**args, mode="hstu", scale=float("nan"))
    with pytest.raises(ValueError, match="hstu_norm must be a finite number > 0"):
        paged_prefix_attention(**args, mode="hstu", scale=1.0, hstu_norm=0.0)
    with pytest.raises(ValueError, match="apply to mode='hstu' only"):
        paged_prefix_attention(**args, mode="softmax", scale=1.0, pos_bias=pos)
    no_ts = dict(args, ts_q=None)
    with pytest.raises(ValueError, match="ts_q .* is required with ts_bias"):
        paged_prefix_attention(**no_ts, mode="hstu", scale=1.0, ts_bias=ts)
    with pytest.raises(ValueError, match="ts_cache .* is required"):
        paged_prefix_attention(**dict(args, ts_cache=None), mode="hstu", scale=1.0, ts_bias=ts)
    with pytest.raises(ValueError, match="ts_q must be torch.int64"):
        paged_prefix_attention(**dict(args, ts_q=args["ts_q"].int()), mode="hstu", scale=1.0, ts_bias=ts)
    with pytest.raises(ValueError, match="pos_bias must be a floating-point"):
        paged_prefix_attention(**args, mode="hstu", scale=1.0, pos_bias=torch.zeros(4, dtype=torch.long))


# ----------------------------------------------------------------------------------------------- dispatch
def test_triton_backend_dispatches_with_the_same_arguments(monkeypatch):
    seen = {}

    def prefix_attention(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return torch.zeros_like(args[0])

    fake = types.ModuleType("relaygr_engine.kernels.prefix_attention")
    fake.prefix_attention = prefix_attention
    monkeypatch.setitem(sys.modules, "relaygr_engine.kernels.prefix_attention", fake)
    args = make_batch([(PAGE + 1, 2, 3)])
    pos, ts = biases("pos+ts")
    out = paged_prefix_attention(**args, mode="hstu", scale=0.5, hstu_norm=4.0, pos_bias=pos, ts_bias=ts,
                                 backend="triton")
    assert torch.equal(out, torch.zeros_like(args["q"]))
    names = ["q", "k", "v", "kv_cache", "kv_indptr", "kv_indices", "kv_last_page_len", "cu_seqlens_q",
             "num_candidates"]
    assert all(a is args[n] for a, n in zip(seen["args"], names)) and len(seen["args"]) == len(names)
    kw = seen["kwargs"]
    assert kw["mode"] == "hstu" and kw["scale"] == 0.5 and kw["hstu_norm"] == 4.0
    assert kw["pos_bias"] is pos and kw["ts_bias"] is ts and kw["ts_cache"] is args["ts_cache"]
    assert kw["ts_q"] is args["ts_q"]


def test_triton_backend_missing_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "relaygr_engine.kernels.prefix_attention", None)  # import raises
    args = make_batch([(PAGE, 1, 1)])
    with pytest.raises(ImportError, match="backend='triton' needs relaygr_engine.kernels.prefix_attention"):
        paged_prefix_attention(**args, mode="softmax", scale=1.0, backend="triton")
    # auto on the CPU is the torch reference and never needs Triton
    out = paged_prefix_attention(**args, mode="softmax", scale=1.0, backend="auto")
    torch.testing.assert_close(out.double(), naive(args, "softmax", 1.0), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------- registration
def test_registered_custom_op_and_fake_impl():
    args = make_batch([(PAGE + 1, 2, 3), (0, 1, 2)])
    pos, ts = biases("pos+ts")
    call = (args["q"], args["k"], args["v"], args["kv_cache"], args["kv_indptr"], args["kv_indices"],
            args["kv_last_page_len"], args["cu_seqlens_q"], args["num_candidates"], "hstu", 0.5, 3.0, pos, ts,
            args["ts_cache"], args["ts_q"])
    op = torch.ops.relaygr.paged_prefix_attention.default
    torch.testing.assert_close(op(*call), paged_prefix_attention(**args, mode="hstu", scale=0.5, hstu_norm=3.0,
                                                                   pos_bias=pos, ts_bias=ts))
    torch.library.opcheck(op, call, test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake_call = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in call)
        out = op(*fake_call)
    assert out.shape == args["q"].shape and out.dtype == args["q"].dtype
    assert math.isfinite(float(paged_prefix_attention(**args, mode="softmax", scale=1.0).abs().sum()))


@pytest.mark.parametrize("time_bucket, num_buckets", [("ln_0301", 129), ("sqrt_60", 300)])
@pytest.mark.parametrize("request_offset", [7, -(1 << 14)])
def test_float_time_buckets_take_the_run_length_bias_when_it_is_exact(monkeypatch, time_bucket, num_buckets,
                                                                      request_offset):
    """The run-length time bias holds for any step function; for ln_0301 (a function of |dt|) only while no
    candidate is earlier than a key it sees, else the op buckets per element. Both equal the reference."""
    from relaygr_engine.kernels.reference import prefix_attention_ref
    args = sorted_times(make_batch(SEGMENTS["varlen_batch"], seed=5), seed=16, gap_bits=16,
                        request_offset=request_offset)
    g = torch.Generator().manual_seed(4)
    kw = dict(mode="hstu", scale=0.4, hstu_norm=2.0, pos_bias=torch.randn(POS, generator=g),
              ts_bias=torch.randn(num_buckets, generator=g), time_bucket=time_bucket)
    want = prefix_attention_ref(**args, **kw)
    if request_offset > 0 or time_bucket == "sqrt_60":
        def no_buckets(*a, **k):
            raise AssertionError("per-element time buckets on a sorted history")
        monkeypatch.setattr(reference_attention, "time_buckets", no_buckets)
    torch.testing.assert_close(paged_prefix_attention(**args, **kw), want, atol=1e-5, rtol=1e-5)


def test_warn_once_logs_a_key_once_until_forgotten(caplog):
    """The project's one warn-once (relaygr_engine._warn): a key's first warning goes through the caller's logger,
    later ones with that key do not, another key does; ``forget`` starts over."""
    import logging

    from relaygr_engine import _warn

    _warn.forget()
    log = logging.getLogger("relaygr_engine.test")
    with caplog.at_level(logging.WARNING, logger="relaygr_engine.test"):
        assert _warn.warn_once(log, ("test", 1), "first %s", "a")
        assert not _warn.warn_once(log, ("test", 1), "again %s", "b")
        assert _warn.warn_once(log, ("test", 2), "other")
        _warn.forget()
        assert _warn.warn_once(log, ("test", 1), "after forget")
    assert [r.getMessage() for r in caplog.records] == ["first a", "other", "after forget"]
