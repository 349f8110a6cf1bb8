"""CUDA graphs for the ranking forward: buckets, padding and static buffers (on the CPU, replayed eagerly through
Triton's interpreter), capture and replay on a GPU."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when it first decorates kernels (see kernel_problems.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import relaygr_engine as rg  # noqa: E402
from relaygr_engine._host import Arena, _layout, _stage, _view  # noqa: E402
from relaygr_engine.engine.graphs import GraphRunner, bucket  # noqa: E402

from engine_helpers import ATOL, assert_exact, candidates, history, make_engine, make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_bucket_pads_at_most_a_quarter_to_multiples_of_16():
    assert [bucket(n) for n in (0, 1, 16, 17, 64, 65, 100, 128, 129, 384, 385, 1000)] == \
        [0, 16, 16, 32, 64, 80, 112, 128, 160, 384, 448, 1024]
    for n in range(1, 3000):
        b = bucket(n)
        assert b >= n and b % 16 == 0 and (b - n <= max(15, n // 4)) and bucket(b) == b
    assert bucket(100, steps=1) == 128 and bucket(129, steps=1) == 256


def test_arena_stages_host_values_and_loads_them_in_one_copy():
    a = Arena([(torch.int32, (3,)), (torch.bool, (5,)), (torch.long, (2, 2))], torch.device("cpu"))
    staging, arrays = a.stage()
    assert staging.dtype == torch.uint8 and staging.numel() == a.nbytes
    assert [(x.dtype, x.shape) for x in arrays] == [(np.int32, (3,)), (np.bool_, (5,)), (np.int64, (2, 2))]
    arrays[0][:] = [0, 1, 2]
    arrays[1][:] = True
    arrays[2][:] = [[0, 1], [2, 3]]
    assert a.views[0].tolist() == [0, 0, 0]  # nothing copied before load
    a.load(staging)
    assert a.views[0].tolist() == [0, 1, 2] and a.views[1].all() and a.views[2].tolist() == [[0, 1], [2, 3]]
    assert all(v.untyped_storage().data_ptr() == a.buffer.untyped_storage().data_ptr() for v in a.views)
    again, arrays = a.stage()  # on the CPU the copy is done when load returns: the same buffer and views again
    assert again is staging and arrays[0].tolist() == [0, 1, 2]
    other, _ = a.stage()  # while one is out (written, not loaded): another
    assert other.data_ptr() != staging.data_ptr()
    held = [a.stage()[0] for _ in range(2 * Arena.KEEP)]  # many out at once: fresh ones past the kept
    assert len({t.data_ptr() for t in held + [staging, other]}) == len(held) + 2 and len(a._kept) == Arena.KEEP
    a.load(other)
    assert a.stage()[0] is other


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a copy still pending on its stream)")
def test_arena_hands_out_no_buffer_a_pending_copy_still_reads_cuda():
    """On CUDA a kept staging buffer whose copy is still queued (behind a busy stream) is not handed out again: the
    next refill gets another buffer, the pending copy reads its own values, and once both copies are done the first
    buffer comes back."""
    a = Arena([(torch.long, (1 << 16,))], torch.device("cuda"))
    staging, arrays = a.stage()
    arrays[0][:] = 1
    torch.cuda._sleep(50_000_000)  # the stream busy for a while: the copy queued behind it stays pending
    a.load(staging)
    again, more = a.stage()
    assert again.data_ptr() != staging.data_ptr()  # not the buffer the pending copy reads
    more[0][:] = 2
    torch.cuda.synchronize()
    assert int(a.views[0].sum()) == 1 << 16  # the first copy read 1s, untouched by the later writes
    a.load(again)
    torch.cuda.synchronize()
    assert a.stage()[0] is staging  # both copies done: the first kept buffer again


def test_row_tables_written_segment_by_segment_equal_the_whole_batch_ones():
    """``structure_arrays`` with few segments writes each segment's rows by slices (into ``out`` or new arrays); with
    many, it builds whole-batch arrays: every table equal, for random segments (empty ones, all-candidate ones,
    contextual rows, long prefixes), with and without positions (the tables start filled with 7s: every entry is
    written)."""
    from relaygr_engine import rows as B

    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 2 * B.FEW_SEGMENTS + 1))
        rows = [int(x) for x in rng.integers(0, 40, n)]
        ncand = [int(rng.integers(0, m + 1)) for m in rows]
        nctx = [int(rng.integers(0, m - c + 1)) for m, c in zip(rows, ncand)]
        starts = [int(x) for x in rng.integers(0, 70_000 if trial % 50 == 0 else 500, n)]
        tokens = None if trial % 3 == 0 else [s + m - c for s, m, c in zip(starts, rows, ncand)]
        whole = B.structure_arrays(starts, rows, ncand, nctx, tokens)
        out = {name: np.full_like(a, 7) for name, a in whole.items()}
        got = B.structure_arrays(starts, rows, ncand, nctx, tokens, out=out)
        assert got is out and set(got) == set(whole)
        for name, a in whole.items():
            np.testing.assert_array_equal(got[name], a, err_msg=f"{name} (trial {trial}, {n} segments)")
        ref = B._whole_batch(starts, rows, ncand, nctx, tokens)  # (few segments: both above went segment-wise)
        assert set(ref) == set(whole)
        for name, a in ref.items():
            np.testing.assert_array_equal(whole[name], a, err_msg=f"{name} (trial {trial}, {n} segments)")


def test_staging_packs_tensors_of_any_dtype_at_their_offsets():
    ts = [torch.arange(3, dtype=torch.int32), None, torch.tensor([True, False]), torch.arange(6.0).view(2, 3).t(),
          torch.tensor([1.5, -2.0], dtype=torch.bfloat16), torch.ones(2, requires_grad=True)]
    offsets, total = _layout([0 if t is None else t.numel() * t.element_size() for t in ts])
    staging = _stage(ts, offsets, total, torch.device("cpu"))
    for t, o in zip(ts, offsets):
        if t is not None:
            assert torch.equal(_view(staging, o, t.dtype, t.shape), t.detach()), (t, o)


def test_cuda_graphs_argument_is_checked():
    model = make_model()
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA cache with the Triton attention backend, got "
                                         "device 'cpu'"):
        make_engine(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be a bool or a GraphConfig, got int"):
        make_engine(model, cuda_graphs=1)
    with pytest.raises(ValueError, match="max_graphs must be"):
        rg.GraphConfig(max_graphs=0)


def _interpreted_engine(model, **kw):
    """A CPU engine on the Triton kernel whose ranking forwards go through the graph runner, replayed eagerly."""
    from relaygr_engine.kernels import _common
    if not _common.interpreter_active():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import)")
    max_graphs = kw.pop("max_graphs", 2)
    engine = make_engine(model, cache=dict(attention_backend="triton", **kw.pop("cache", {})), **kw)
    engine.runner.graphs = GraphRunner(engine.model, engine.layers, engine.state,
                                       rg.GraphConfig(max_graphs=max_graphs), capture=False)
    return engine


@needs_triton
@pytest.mark.parametrize("attention", ["hstu", "softmax"])
def test_padded_static_forward_equals_full_inference(attention):
    """Hits, misses, stored misses and extensions, one user or three (empty user slots), with and without
    timestamps: every score of the padded forward equals full inference, and the K/V and timestamps it stores
    serve the next ranking exactly."""
    model = make_model(attention)
    engine = _interpreted_engine(model, store_misses=True)
    h1, h2, h3 = history(45, seed=1), history(30, seed=2), history(21, seed=3, timestamps=False)
    c1, c2, c3 = candidates(7, seed=4), candidates(3, seed=5), candidates(5, seed=6)
    t1 = engine.prefill_prefix(1, h1.prefix(20))
    hit = engine.rank_with_prefix(1, h1.prefix(33), c1, ticket=t1)        # hit, extends the entry to 33
    assert hit.source == "hbm" and hit.cached_tokens == 20
    assert_exact(hit, model, h1.prefix(33), c1)
    batch = engine.rank_with_prefix_batch([rg.RankRequest(1, h1, c1), rg.RankRequest(2, h2, c2),
                                           rg.RankRequest(3, h3, c3)])    # hit on the extension; stored misses
    assert [r.source for r in batch] == ["hbm", "recompute", "recompute"] and batch[0].cached_tokens == 33
    for r, h, c in zip(batch, (h1, h2, h3), (c1, c2, c3)):
        assert_exact(r, model, h, c)
    again = engine.rank_with_prefix_batch([rg.RankRequest(2, h2, c2), rg.RankRequest(3, h3, c3)])
    assert [r.cached_tokens for r in again] == [30, 21]                   # what the padded forward stored
    for r, h, c in zip(again, (h2, h3), (c2, c3)):
        assert_exact(r, model, h, c)
    s = engine.stats()
    assert s["graph_replays"] == 0 and s["graph_failures"] == 0 and len(engine.runner.graphs.buckets) <= 2
    assert s["graph_evictions"] >= 1                                     # more than two buckets were used


@needs_triton
def test_padding_rows_fill_a_bucket_as_a_user_of_their_own():
    """A ranking of 25 new history rows and 7 candidates in a bucket of 32 + 16 rows: after the user come the
    padding user's 7 history rows, then its 9 candidates, at position 0, their ids copies of the last row; the row
    tables count it as a user of its own."""
    engine = _interpreted_engine(make_model())
    h, c = history(45, seed=1), candidates(7, seed=4)
    engine.prefill_prefix(1, h.prefix(20))
    assert engine.rank_with_prefix(1, h, c).cached_tokens == 20
    b = next(b for k, b in engine.runner.graphs.buckets.items() if k.candidates)
    assert (b.key.users, b.key.history_rows, b.key.candidates) == (1, 32, 16)
    v, R = b.view, 25 + 7
    assert v("cu_seqlens").tolist() == [0, R, 48] and v("num_candidates").tolist() == [7, 9]
    assert v("positions")[:R].tolist() == list(range(20, 45)) + [45] * 7 and not v("positions")[R:].any()
    for name in ("item_ids", "action_ids", "timestamps"):
        assert (v(name)[R:] == v(name)[R - 1]).all(), name
    assert v("item_ids")[R - 7:R].tolist() == c.tolist()
    assert v("is_candidate").tolist() == [False] * 25 + [True] * 7 + [False] * 7 + [True] * 9
    assert v("is_behavior").tolist() == [True] * 25 + [False] * 7 + [True] * 7 + [False] * 9
    assert not v("is_context").any() and v("segment_ids").tolist() == [0] * R + [1] * 16
    assert v("candidate_rows").tolist() == list(range(25, 32)) + list(range(39, 48))


@needs_triton
def test_a_refill_writes_every_entry_whatever_its_reused_buffer_held():
    """The bucket's staging buffers are reused: a ranking's refill writes every entry of every buffer view, so the
    device buffers hold the same values whether the reused host buffer held the last ranking's values, zeros or
    0xFF bytes, and the scores stay exact (a lease of an hour: the prefix is never extended under a slow
    interpreter)."""
    model = make_model()
    engine = _interpreted_engine(model, cache=dict(lease_ttl_s=3600.0))
    h, c = history(45, seed=1), candidates(7, seed=4)
    engine.prefill_prefix(1, h.prefix(20))
    engine.rank_with_prefix(1, h, c)
    b = next(b for k, b in engine.runner.graphs.buckets.items() if k.candidates)
    clean = [v.clone() for v in b.arena.views]
    for poison in (None, 0x00, 0xFF):
        if poison is not None:
            with torch.inference_mode():  # (the engine made them inside its inference mode)
                for kept in b.arena._kept:
                    kept.buffer.fill_(poison)
        res = engine.rank_with_prefix(1, h, c)
        assert res.cached_tokens == 20
        assert_exact(res, model, h, c)
        for name, v, want in zip(b.names, b.arena.views, clean):
            assert torch.equal(v, want), (poison, name)


@needs_triton
def test_pre_infer_chunks_go_through_few_padded_buckets_exactly(monkeypatch):
    """A chunked pre-infer (chunks of 32 tokens, the last one short) runs through the padded static forward in
    buckets without candidate rows, one per chunk size and power of two of the cached prefix; the K/V it stores
    serve a ranking exactly. GraphConfig(prefill=False) leaves pre-infers eager."""
    model = make_model()
    engine = _interpreted_engine(model, max_graphs=16)
    served = []
    real = GraphRunner.run
    monkeypatch.setattr(GraphRunner, "run", lambda self, jobs, parts: (served.append(
        sum(0 if c is None else c.numel() for _, _, c, _ in parts)), real(self, jobs, parts))[-1])
    h, c = history(100, seed=8), candidates(5)
    for end in (32, 64, 96, 100):
        t = engine.prefill_prefix(1, h.prefix(end))
        assert t.admitted and t.computed_tokens == end - (end - 1) // 32 * 32
    assert served == [0, 0, 0, 0]
    keys = sorted((k.history_rows, k.prefix) for k in engine.runner.graphs.buckets if k.candidates == 0)
    assert keys == [(16, 128), (32, 0), (32, 32), (32, 64)]
    res = engine.rank_with_prefix(1, h, c, ticket=t)
    assert res.source == "hbm" and res.cached_tokens == 100 and served[-1] == 5
    assert_exact(res, model, h, c)
    assert engine.stats()["graph_failures"] == 0
    eager = _interpreted_engine(model, max_graphs=16)
    eager.runner.graphs.config = rg.GraphConfig(prefill=False)
    eager.prefill_prefix(1, h.prefix(32))
    assert served[-1] == 5 and not eager.runner.graphs.buckets
    with pytest.raises(ValueError, match="prefill must be a bool, got 1"):
        rg.GraphConfig(prefill=1)


@needs_triton
def test_a_layerwise_dram_hit_through_the_padded_forward_is_exact():
    """Layer-wise onload (the CPU stand-in) under the graph runner's static forward: each layer's copy is made when
    that layer's attention starts, and the DRAM hit (extended by its new rows) scores exactly."""
    model = make_model()
    engine = _interpreted_engine(model, max_graphs=16, cache=dict(dram_bytes=1 << 24, onload="layer"))
    h, c = history(60, seed=9), candidates(6)
    t = engine.prefill_prefix(1, h.prefix(40))
    engine.rank_with_prefix(1, h.prefix(40), c, ticket=t)          # evictable now: spilled to DRAM
    for fp, _ in engine.pool.entries_of(1):
        engine.pool.free(1, fp)
    res = engine.rank_with_prefix(1, h, c)
    assert res.source == "dram" and res.cached_tokens == 40
    assert_exact(res, model, h, c)
    s = engine.stats()
    assert s["layered_reloads"] == 1 and engine.state.onload.pending == 0 and s["graph_failures"] == 0


class _ReadsHostLayout(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, batch):
        assert len(batch.rows) >= 1
        return self.inner(batch)


@needs_triton
def test_a_model_reading_the_host_layout_is_served_eagerly_and_exactly(caplog):
    inner = make_model()
    engine = _interpreted_engine(_ReadsHostLayout(inner))
    h, c = history(40, seed=7), candidates(6)
    with caplog.at_level("WARNING", logger="relaygr_engine"):
        t = engine.prefill_prefix(1, h.prefix(25))          # the pre-infer's forward finds it: eager from then on
        first = engine.rank_with_prefix(1, h, c, ticket=t)
        second = engine.rank_with_prefix(1, h, c)
    assert first.cached_tokens == 25
    assert_exact(first, inner, h, c)
    assert_exact(second, inner, h, c)
    s = engine.stats()
    assert s["graph_failures"] == 1 and s["graph_eager"] == 2
    assert sum("reads the batch's host layout" in r.message for r in caplog.records) == 1


# ----------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")


def test_bench_host_replays_a_stand_in_graph(capsys):
    """``relaygr bench host`` (formerly benchmarks/tools/host_work.py) times rankings served by graph replays (the
    first of its bucket eager), each with its real host work, and prints one RESULT line with each step's time."""
    from relaygr_engine.bench import host

    host.main(["--seeds", "0,1", "--calls", "3", "--device", "cpu", "--model", "small", "--history", "200",
               "--new", "20", "--candidates", "8"])  # (it asserts the replay count)
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[1:3]] == ["seed 0", "seed 1"]
    assert out[-1].startswith("RESULT host_us_per_rank=")
    assert "seeds=2 history=200 new_rows=20 candidates=8 model=small device=cpu" in out[-1]
    steps = {kv.split("=")[0][5:-3]: float(kv.split("=")[1]) for kv in out[-1].split() if kv.startswith("step_")}
    reached = [key for _, _, key, _ in host.STEPS]
    assert list(steps) == reached  # every step timed: each wrapper was reached
    assert all(v > 0 for v in steps.values())
    assert [steps[k] for k in ("ranking", "runner", "fill")] == sorted((steps[k] for k in ("ranking", "runner",
                                                                                             "fill")), reverse=True)
    from relaygr_engine.engine import graphs
    assert graphs.GraphRunner.__dict__["_fill"].__name__ == "_fill" and not hasattr(graphs.GraphRunner._fill,
                                                                                     "__wrapped__")  # unwrapped after


@needs_triton
def test_bucket_tables_follow_each_batch_layout_and_pages():
    """A bucket keeps its row and page tables by layout: a second user of the same layout on other pages gets its own
    page table, the first user again the kept one, a third of another layout new row tables; every score exact and
    every buffer equal to a bucket's first fill of that batch."""
    from relaygr_engine.engine.staging import host_layout

    model = make_model()
    engine = _interpreted_engine(model, cache=dict(lease_ttl_s=3600.0), extend_on_rank=False)
    hs = [history(45, seed=s) for s in (1, 2, 3)]
    c = candidates(7, seed=4)
    for user, h, cached in ((1, hs[0], 20), (2, hs[1], 20), (3, hs[2], 24)):
        engine.prefill_prefix(user, h.prefix(cached))
    runner = engine.runner.graphs
    other = GraphRunner(engine.model, engine.layers, engine.state, rg.GraphConfig(), capture=False)
    seen = []
    real = runner.run
    runner.run = lambda jobs, parts: (seen.append((jobs, parts)), real(jobs, parts))[-1]
    for user, h in ((1, hs[0]), (2, hs[1]), (1, hs[0]), (3, hs[2]), (2, hs[1])):
        res = engine.rank_with_prefix(user, h, c)
        assert_exact(res, model, h, c)
        b = next(b for k, b in runner.buckets.items() if k.candidates)
        jobs, parts = seen[-1]
        want = other._new_bucket(b.key)  # a bucket's first fill of this batch
        other._fill(want, jobs, host_layout(parts), parts)
        for name in b.names:
            assert torch.equal(b.view(name), want.view(name)), (user, name)
    assert [len(kept) for kept in b.tables.kept.values()] == [2, 3]  # two layouts; three users' pages


def test_a_bucket_tiles_only_the_live_rows():
    """A bucket's tile tables hold the batch's live tiles (its padding user's included), not ``rows // m + S`` per
    kind: the key names them, and equal shapes of other live tiles take another bucket."""
    from relaygr_engine.engine.records import Job, Prepared
    from relaygr_engine.engine.staging import host_layout

    engine = make_engine(make_model())
    runner = GraphRunner(engine.model, engine.layers, engine.state, rg.GraphConfig(), capture=False)
    h = history(60, seed=1)

    def key(cached, new, cands):
        hist = h.prefix(cached + new)
        p = Prepared(1, hist, candidates(cands), None)
        return runner.key([Job(p, cached, np.arange(8), p.candidates)], host_layout([(hist, cached, p.candidates,
                                                                                      None)]))
    m = runner._tile_rows(1, 32, 16, 32)
    assert m == (32, 32)  # (the interpreter's tiles)
    k = key(20, 25, 7)  # 25 history rows + the padding user's 7; 7 candidates + its 9
    assert (k.history_rows, k.candidates, k.tiles) == (32, 16, (2, 2))
    assert key(20, 32, 16).tiles == (1, 1)  # an exact fit: no padding user's rows
    assert key(20, 30, 16).tiles == (2, 1) != key(20, 32, 16).tiles


@gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("attention", ["hstu", "softmax"])
def test_cuda_graph_replays_are_exact_and_never_wait_for_the_device(attention):
    """fp32 on CUDA: the first ranking of a bucket is captured, later ones of other lengths in the same bucket replay
    it, exactly, with no device-to-host synchronisation; a second bucket is captured beside it; a request given on
    the device replays too."""
    from relaygr_engine.testing import forbid_device_sync

    model = rg.build_ranker(make_model(attention).config, seed=0, device="cuda")
    engine = make_engine(model, cache=dict(device="cuda", attention_backend="triton"), cuda_graphs=True)
    h = history(120, seed=5)
    c = candidates(37)
    tickets = {L: engine.prefill_prefix(L, h.prefix(L - 9)) for L in (100, 110, 120)}
    first = engine.rank_with_prefix(100, h.prefix(100), c, ticket=tickets[100])
    assert engine.stats()["graph_captures"] == 1
    torch.cuda.synchronize()
    with forbid_device_sync():
        later = [engine.rank_with_prefix(L, h.prefix(L), c, ticket=tickets[L]) for L in (110, 120)]
    assert engine.stats()["graph_replays"] == 2 and engine.stats()["graph_captures"] == 1
    for r, L in zip([first, *later], (100, 110, 120)):
        assert r.source == "hbm"
        assert_exact(r, model, h.prefix(L), c)
    two = engine.rank_with_prefix_batch([rg.RankRequest(110, h.prefix(110), c), rg.RankRequest(7, h, c[:4])])
    assert engine.stats()["graph_captures"] == 2
    assert_exact(two[0], model, h.prefix(110), c)
    assert_exact(two[1], model, h, c[:4])
    replays = engine.stats()["graph_replays"]
    for L in (110, 120):  # requests given on the device: their rows are copied there, into one bucket
        r = engine.rank_with_prefix(L, h.prefix(L).to("cuda"), c.cuda())
        assert r.source == "hbm"
        assert_exact(r, model, h.prefix(L), c)
    assert engine.stats()["graph_replays"] > replays
    scores = first.scores.clone()
    engine.rank_with_prefix(110, h.prefix(110), c)                      # a replay does not touch earlier results
    assert torch.equal(first.scores, scores)
    assert float((later[0].scores - model.rank_full(h.prefix(110), c)).abs().max()) <= ATOL


@gpu
@needs_cuda
@needs_triton
def test_cuda_graphed_pre_infer_chunks_replay_exactly():
    """fp32 on CUDA: fixed-size pre-infer chunks of several users are captured once per bucket and replayed; the
    K/V they store serve rankings exactly."""
    model = rg.build_ranker(make_model().config, seed=0, device="cuda")
    engine = make_engine(model, cache=dict(device="cuda", attention_backend="triton"), cuda_graphs=True)
    h, c = history(128, seed=11), candidates(9)
    for user in (1, 2, 3):
        for end in (32, 64, 96, 128):
            assert engine.prefill_prefix(user, h.prefix(end)).admitted
    s = engine.stats()
    assert s["prefill_graph_captures"] == 4 and s["prefill_graph_replays"] == 8 and s["graph_failures"] == 0
    for user in (1, 2, 3):
        res = engine.rank_with_prefix(user, h, c)
        assert res.source == "hbm" and res.cached_tokens == 128
        assert_exact(res, model, h, c)


class _ReadsScores(torch.nn.Module):
    """A model whose forward reads its scores back on the host: it runs eagerly, and its capture fails."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, batch):
        scores = self.inner(batch)
        assert float(scores.float().abs().sum()) >= 0.0
        return scores


def test_a_failed_capture_resets_the_cuda_generator(monkeypatch, caplog):
    """After a capture that raised, the device's default generator continues from a fresh copy of its state; where
    that fails, one warning says so. A CPU engine has no generator to reset."""
    from relaygr_engine import _warn
    from relaygr_engine.engine import graphs

    class Generator:
        def __init__(self, fail=False):
            self.fail, self.set = fail, []

        def clone_state(self):
            if self.fail:
                raise RuntimeError("no clone")
            return ("copy of", self)

        def graphsafe_set_state(self, state):
            self.set.append(state)

    gens = [Generator(), Generator()]
    monkeypatch.setattr(torch.cuda, "default_generators", gens, raising=False)
    graphs.reset_rng_after_failed_capture(torch.device("cuda", 1))
    assert gens[0].set == [] and gens[1].set == [("copy of", gens[1])]
    graphs.reset_rng_after_failed_capture(torch.device("cpu"))
    assert gens[1].set == [("copy of", gens[1])]
    _warn.forget()
    monkeypatch.setattr(torch.cuda, "default_generators", [Generator(fail=True)], raising=False)
    with caplog.at_level("WARNING", logger="relaygr_engine"):
        for _ in range(2):
            graphs.reset_rng_after_failed_capture(torch.device("cuda", 0))
    assert sum("could not reset the CUDA generator" in r.message for r in caplog.records) == 1


@gpu
@needs_cuda
@needs_triton
def test_cuda_a_failed_capture_serves_eagerly_and_leaves_random_ops_working():
    """fp32 on CUDA: a model that reads its scores on the host cannot be captured; the ranking is served eagerly
    and exactly, the failure counted, and random ops on the device work afterwards (torch leaves its generator
    marked as capturing after a capture that raised: the engine resets it)."""
    inner = rg.build_ranker(make_model().config, seed=0, device="cuda")
    engine = make_engine(_ReadsScores(inner), cache=dict(device="cuda", attention_backend="triton"),
                         cuda_graphs=True)
    h, c = history(80, seed=3), candidates(11)
    assert engine.prefill_prefix(1, h.prefix(70)).admitted
    first, second = engine.rank_with_prefix(1, h, c), engine.rank_with_prefix(1, h, c)
    for r in (first, second):
        assert r.source == "hbm"
        assert_exact(r, inner, h, c)
    assert engine.stats()["graph_failures"] == 1
    x = torch.randn(1000, device="cuda")
    assert x.shape == (1000,) and float(x.std()) > 0.5
