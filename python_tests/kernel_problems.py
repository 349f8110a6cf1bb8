"""Shared by the kernel tests: the interpreter switch, skip markers and a random varlen problem builder.

Without CUDA the kernels run in Triton's CPU interpreter in fp32 (max abs diff <= 1e-4). Triton reads
``TRITON_INTERPRET`` when it decorates ``@triton.jit`` functions, its own library functions included, so the variable
is set here (and in conftest.py) before triton's first import; if triton was already imported without it,
``test_interpreter_active`` fails and says so. bf16 tests on CUDA skip where there is no CUDA device.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from relaygr_engine.kernels import _common  # noqa: E402
from relaygr_engine.kernels.prefix_attention import prefix_attention  # noqa: E402
from relaygr_engine.kernels.reference import prefix_attention_ref  # noqa: E402

INTERPRETER = _common.interpreter_active()
ATOL = 1e-4

needs_interpreter = pytest.mark.skipif(
    not INTERPRETER, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import); "
                            "not active in this process")
needs_cuda = pytest.mark.skipif(not CUDA or INTERPRETER,
                                reason="needs a CUDA device and compiled Triton (no CUDA here, or interpreter mode)")
gpu = pytest.mark.gpu


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
                    bias_table_bytes=None, page_reads="auto", value_splits=None, split_dtype=None,
                    hopper_kernel=None):
    """The kernel's output against the reference's (within ``atol``); returns it."""
    out = prefix_attention(**args, **kw, persistent=persistent, block_m=block_m, block_n=block_n, splits=splits,
                           bias_table_bytes=bias_table_bytes, page_reads=page_reads, value_splits=value_splits,
                           split_dtype=split_dtype, hopper_kernel=hopper_kernel)
    ref = prefix_attention_ref(**args, **kw)
    assert out.shape == ref.shape and out.dtype == args["q"].dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)
    return out
