"""CacheConfig validation and PagedKVCache storage."""
from __future__ import annotations

import pytest
import torch

import relaygr_engine as rg
from relaygr_engine.config import AttentionBackend


def test_config_defaults_and_normalisation():
    cfg = rg.CacheConfig()
    assert cfg.device == "cpu" and cfg.dtype == torch.float32 and cfg.page_size == 16
    assert cfg.attention_backend is AttentionBackend.AUTO
    assert rg.CacheConfig(dtype="bf16").dtype == torch.bfloat16
    assert rg.CacheConfig(attention_backend="TORCH").attention_backend is AttentionBackend.TORCH
    with pytest.raises(Exception):
        cfg.page_size = 32  # frozen


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "device"),
    (dict(dtype="int8"), "dtype"),
    (dict(page_size=0), "page_size"),
    (dict(num_pages=0), "num_pages"),
    (dict(num_pages=8, hbm_bytes=1 << 20), "not both"),
    (dict(hbm_bytes=-1), "hbm_bytes"),
    (dict(max_pinned_fraction=0.0), "max_pinned_fraction"),
    (dict(max_pinned_fraction=1.5), "max_pinned_fraction"),
    (dict(lease_ttl_s=0), "lease_ttl_s"),
    (dict(lease_ttl_s=float("inf")), "lease_ttl_s"),
    (dict(attention_backend="cudnn"), "'auto', 'torch', 'triton'"),
    (dict(dram_bytes=-5), "dram_bytes"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rg.CacheConfig(**kwargs)


def test_pages_from_byte_budget():
    cfg = rg.CacheConfig(page_size=16, hbm_bytes=10 * (2 * 2 * 16 * 4 * 8 * 4 + 16 * 8) + 7)
    cache = rg.PagedKVCache(cfg, num_layers=2, num_heads=4, head_dim=8)
    assert cache.num_pages == 10
    assert cache.kv[0].shape == (10, 2, 16, 4, 8) and len(cache.kv) == 2
    assert cache.nbytes == 10 * cfg.page_bytes(2, 4, 8)
    assert cache.pool.max_pinned_pages == 5  # max_pinned_fraction 0.5
    with pytest.raises(ValueError, match="holds no page"):
        rg.PagedKVCache(rg.CacheConfig(hbm_bytes=100), 2, 4, 8)


def test_write_gather_round_trip_across_pages():
    cache = rg.PagedKVCache(rg.CacheConfig(page_size=4, num_pages=16), num_layers=2, num_heads=2, head_dim=3)
    pages = cache.pool.insert(1, 1, 11, now=0.0)
    k, v = torch.randn(11, 2, 3), torch.randn(11, 2, 3)
    cache.write(1, pages, k[:6], v[:6])
    cache.write(1, pages, k[6:], v[6:], start=6)  # a later append lands in the right slots
    ts = torch.arange(100, 111)
    cache.write_timestamps(pages, ts)
    gk, gv = cache.gather(1, pages, 11)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert torch.equal(cache.gather_timestamps(pages, 11), ts)
    assert torch.equal(cache.kv[1][int(pages[2]), 0, 2], k[10])  # token 10 = page 2, slot 2
    indptr, indices, last = cache.page_table([(1, 1)])
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 3] and last.tolist() == [3]
    assert torch.equal(indices, torch.as_tensor(pages))


def test_cache_rejects_bad_writes():
    cache = rg.PagedKVCache(rg.CacheConfig(page_size=4, num_pages=8), num_layers=1, num_heads=2, head_dim=3)
    pages = cache.pool.insert(1, 1, 5, now=0.0)
    good = torch.randn(5, 2, 3)
    snapshot = cache.kv[0].clone()
    with pytest.raises(IndexError, match="layer"):
        cache.write(1, pages, good, good)
    with pytest.raises(ValueError, match=r"\[n, 2, 3\]"):
        cache.write(0, pages, torch.randn(5, 3, 3), good)
    with pytest.raises(ValueError, match="same shape"):
        cache.write(0, pages, good, good[:4])
    with pytest.raises(ValueError, match="do not fit"):
        cache.write(0, pages, torch.randn(9, 2, 3), torch.randn(9, 2, 3))
    with pytest.raises(IndexError, match="page ids"):
        cache.write(0, [0, 99], good, good)
    with pytest.raises(ValueError, match="int32/int64"):
        cache.write(0, torch.tensor([0.0, 1.0]), good, good)
    assert torch.equal(cache.kv[0], snapshot)
    with pytest.raises(ValueError, match="num_heads"):
        rg.PagedKVCache(rg.CacheConfig(), num_layers=1, num_heads=0, head_dim=3)
