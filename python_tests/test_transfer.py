"""Prefix KV transfer between two engines: export (pack) on the pre-infer side, import (unpack) on the ranking side."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import relaygr_engine as rg

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = rg.GRModelConfig(attention="hstu", num_layers=2, hidden_dim=32, num_heads=2, head_dim=16, num_items=300,
                       num_actions=3, max_seq_len=256, num_tasks=2)


def history(user: int, n: int) -> rg.Behaviors:
    g = torch.Generator().manual_seed(user)
    return rg.Behaviors(torch.randint(0, CFG.num_items, (n,), generator=g),
                        torch.randint(0, CFG.num_actions, (n,), generator=g), 1_000 + torch.arange(n) * 30)


@pytest.fixture
def engines():
    model = rg.build_ranker(CFG, seed=1)
    cache = rg.CacheConfig(page_size=8, num_pages=64, max_pinned_fraction=0.5, lease_ttl_s=100.0)
    return model, rg.RelayEngine(model, cache), rg.RelayEngine(rg.build_ranker(CFG, seed=1), cache)


def test_exported_prefix_ranks_as_a_hit_on_the_importer_with_exact_scores(engines):
    model, sender, receiver = engines
    h, cands = history(7, 61), torch.randint(0, CFG.num_items, (5,))
    ticket = sender.prefill_prefix(7, h.prefix(53), now=0.0)
    packed = sender.export_prefix(ticket, h.prefix(53), now=0.0)
    assert packed.num_tokens == 53 and packed.kv.shape == (2, 2, 56, 2, 16) and packed.timestamps.shape == (53,)
    assert packed.nbytes == packed.kv.numel() * 4 + 53 * 8
    # the sender ended its lease and keeps the entry, evictable
    assert sender.pool.num_pinned_pages == 0 and sender.match_length(7, h) == 53
    got = receiver.import_prefix(h.prefix(53), packed.to("cpu"), now=1.0)
    assert got.admitted and got.reason == "admitted" and got.num_tokens == 53 and got.fingerprint == packed.fingerprint
    assert receiver.pool.num_pinned_pages == 7  # leased until its ranking
    res = receiver.rank_with_prefix(7, h, cands, ticket=got, now=2.0)
    assert res.source == "hbm" and res.cached_tokens == 53 and res.computed_tokens == 8 + 5
    assert (res.scores - model.rank_full(h, cands)).abs().max().item() <= 1e-4
    s, r = sender.stats(), receiver.stats()
    assert (s["exports"], s["export_bytes"]) == (1, packed.nbytes)
    assert (r["imports"], r["import_bytes"], r["hbm_hits"], r["prefills"]) == (1, packed.nbytes, 1, 0)
    # the same prefix again: the receiver holds it, nothing is copied
    again = receiver.import_prefix(h.prefix(53), packed, now=3.0)
    assert again.admitted and again.reason == "already_cached"
    assert receiver.stats()["imports"] == 1 and receiver.stats()["imports_already_cached"] == 1


def test_import_refuses_a_foreign_buffer_before_any_state_changes(engines):
    model, sender, receiver = engines
    h = history(3, 40)
    packed = sender.export_prefix(sender.prefill_prefix(3, h, now=0.0), h, now=0.0)
    before = receiver.stats()
    other = rg.RelayEngine(rg.build_ranker(CFG, seed=2), rg.CacheConfig(page_size=8, num_pages=64))
    with pytest.raises(ValueError, match="another model"):
        other.import_prefix(h, packed)
    with pytest.raises(ValueError, match="user 3's 40-token prefix"):
        receiver.import_prefix(h.prefix(39), packed)
    with pytest.raises(ValueError, match="kv must be"):
        receiver.import_prefix(h, dataclasses.replace(packed, kv=packed.kv[:1]))
    with pytest.raises(ValueError, match="page size"):
        rg.RelayEngine(model, rg.CacheConfig(page_size=16, num_pages=64)).import_prefix(h, packed)
    with pytest.raises(ValueError, match="admitted PrefixTicket"):
        sender.export_prefix(rg.PrefixTicket(False, "pool_full", 3, 0, 40, None), h)
    assert receiver.stats() == before and receiver.pool.num_free_pages == 64


def test_import_is_refused_when_the_pinned_budget_is_taken_and_export_of_an_evicted_entry_is_none(engines):
    model, sender, receiver = engines
    packs = []
    for u in range(5):  # 40 tokens = 5 pages each; the receiver's leases may pin 32 pages
        h = history(u, 40)
        packs.append((h, sender.export_prefix(sender.prefill_prefix(u, h, now=0.0), h, now=0.0)))
    tickets = [receiver.import_prefix(h, p, now=1.0) for h, p in packs]
    assert [t.reason for t in tickets] == ["admitted"] * 5
    h, p = history(9, 64), None
    t9 = sender.prefill_prefix(9, h, now=0.0)
    p = sender.export_prefix(t9, h, now=0.0)
    refused = receiver.import_prefix(h, p, now=1.0)  # 25 + 8 pages > 32
    assert not refused.admitted and refused.reason == "pool_full" and receiver.stats()["imports_refused"] == 1
    # an entry evicted at the sender: nothing to export
    short = rg.RelayEngine(model, rg.CacheConfig(page_size=8, num_pages=8, max_pinned_fraction=1.0, lease_ttl_s=1.0))
    tk = short.prefill_prefix(1, history(1, 30), now=0.0)
    assert short.prefill_prefix(2, history(2, 40), now=5.0).admitted  # user 1's lease ran out: evicted (4+5 > 8)
    assert short.export_prefix(tk, history(1, 30), now=5.0) is None


def test_bench_transfer_reports_bytes_per_prefix_and_a_result_line(capsys):
    from relaygr_engine import cli

    assert cli.main(["bench", "transfer", "--lengths", "40", "--repeats", "1", "--threads", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    r = dict(kv.split("=", 1) for kv in line.split()[1:])
    # 2 layers x (K, V) x 48 page-padded tokens x 2 heads x 32 dims x 4 bytes, plus 40 int64 timestamps
    assert line.startswith("RESULT ") and int(r["bytes"]) == 2 * 2 * 48 * 2 * 32 * 4 + 40 * 8
    assert float(r["transfer_gbps"]) > 0 and float(r["plain_copy_gbps"]) > 0
