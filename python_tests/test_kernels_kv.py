"""The KV write and pack/unpack kernels against their pure-torch references (interpreter on the CPU, bf16 on CUDA)."""
from __future__ import annotations

import pytest
import torch
from kernel_problems import gpu, needs_cuda, needs_interpreter

from relaygr_engine.kernels.kv_pack import kv_pack, kv_unpack, packed_shape
from relaygr_engine.kernels.kv_write import kv_write
from relaygr_engine.kernels.reference import kv_pack_ref, kv_unpack_ref, kv_write_ref


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
