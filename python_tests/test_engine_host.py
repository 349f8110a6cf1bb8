"""The ranking's host work, off the critical path and exact: the model identity's counters, token matching on raw
arrays, fingerprints extended by the new tokens only, a graph bucket's memoised tables and its live tiles (the
padded plan decides what the eager plan decides), and ``relaygr bench host``."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

import relaygr_engine as rg
from engine_helpers import assert_exact, candidates, history, make_engine, make_model
from relaygr_engine.engine.index import EntryTokens, common_tokens
from relaygr_engine.engine.records import Hit, Prepared
from relaygr_engine.identity import WeightsIdentity

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------- identity
def test_identity_notices_every_documented_change_and_rehashes_only_then():
    """In-place edits, ``load_state_dict`` (copying or assigning), ``.to()`` of the module or of a submodule,
    assigned or replaced parameters and submodules, slots written or deleted without hooks: each changes the
    identity (or restores it with the same weights); a read with nothing changed hashes nothing."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    w = WeightsIdentity(m)
    first = w.value
    hashed = []
    real = torch.Tensor.numpy
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "numpy", lambda t, *a, **k: (hashed.append(1), real(t, *a, **k))[1])
        assert all(w.value == first for _ in range(5)) and not hashed  # counters only
    with torch.no_grad():
        m[0].weight.mul_(2)
    edited = w.value
    assert edited != first
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()})
    assert w.value == edited  # same values copied in: same identity
    m.load_state_dict({k: v * 2 for k, v in m.state_dict().items()}, assign=True)
    assert w.value not in (first, edited)
    m.load_state_dict({k: v / 2 for k, v in m.state_dict().items()}, assign=True)
    assert w.value == edited
    m.double()
    assert w.value != edited
    m.float()
    assert w.value == edited
    m[1].half()  # a submodule's .to()
    assert w.value != edited
    m[1].float()
    assert w.value == edited
    m[1].weight = nn.Parameter(m[1].weight.detach() + 1)
    assert w.value != edited
    m[1]._parameters["weight"] = nn.Parameter(m[1].weight.detach() - 1)  # no hook: the slot check sees it
    assert w.value == edited
    m[0] = nn.Linear(4, 4)
    replaced = w.value
    assert replaced != edited
    del m[1].bias  # a deleted slot
    assert w.value != replaced
    m.load_state_dict({k: v for k, v in m.state_dict().items()}, strict=True)  # (still works after all of it)


def test_engine_identity_follows_a_load_of_other_weights_between_rankings():
    """A ranking after ``load_state_dict`` of other weights recomputes; loading the first weights back makes the
    cached prefix usable again (exact both times)."""
    model = make_model()
    engine = make_engine(model)
    h, c = history(30, seed=3), candidates(4)
    engine.prefill_prefix(1, h.prefix(20))
    assert engine.rank_with_prefix(1, h, c).source == "hbm"
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(make_model(seed=5).state_dict())
    r = engine.rank_with_prefix(1, h, c)
    assert r.source == "recompute"
    assert_exact(r, model, h, c)
    model.load_state_dict(saved)
    r = engine.rank_with_prefix(1, h, c)
    assert r.source == "hbm"
    assert_exact(r, model, h, c)


# ----------------------------------------------------------------------------------------------- matching
def _lcp_of_keys(a: np.ndarray, b: np.ndarray, k: int) -> int:
    diff = np.flatnonzero((a[:k] != b[:k]).any(axis=1))
    return k if diff.size == 0 else int(diff[0])


def _variant(base: rg.Behaviors, rng: np.random.Generator) -> rg.Behaviors:
    """``base`` with one change at a random place: an id, an action, a time, the first time, a contextual id, the
    count of contextual tokens, or none."""
    items, acts, ts, ctx = (None if x is None else x.clone() for x in (base.item_ids, base.action_ids,
                                                                         base.timestamps, base.context_ids))
    kind = rng.integers(0, 7)
    at = int(rng.integers(0, len(items)))
    if kind == 0:
        items[at] += 1
    elif kind == 1 and acts is not None:
        acts[at] = (acts[at] + 1) % 4
    elif kind == 2 and ts is not None:
        ts[at:] += 1
    elif kind == 3 and ts is not None:
        ts[0] -= 1
    elif kind == 4 and ctx is not None:
        ctx[int(rng.integers(0, len(ctx)))] += 1
    elif kind == 5:
        ctx = torch.arange(int(rng.integers(0, 4)))
        ctx = ctx if len(ctx) else None
    return rg.Behaviors(items, acts, ts, ctx)


@pytest.mark.parametrize("acted, timed", list(itertools.product((False, True), repeat=2)))
def test_raw_token_matching_equals_the_token_key_rows(acted, timed):
    """``common_tokens`` (an entry's kept arrays against a request's) is, for any ``k``, the count of leading
    ``Behaviors.token_keys`` rows that agree: random histories with and without contextual tokens, one change
    anywhere (or none), every ``k``."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        L = int(rng.integers(1, 40))
        U = int(rng.integers(0, 4))
        base = rg.Behaviors(torch.from_numpy(rng.integers(0, 50, L)),
                            torch.from_numpy(rng.integers(0, 4, L)) if acted else None,
                            torch.from_numpy(np.cumsum(rng.integers(0, 9, L))) if timed else None,
                            torch.arange(U) if U else None)
        other = _variant(base, rng)
        n = int(rng.integers(1, base.num_tokens + 1))
        kept = EntryTokens.of(base, n)
        want_keys = base.token_keys()[:n]
        for k in range(0, min(n, other.num_tokens) + 1):
            want = _lcp_of_keys(want_keys, other.token_keys(), k)
            assert common_tokens(kept, other, k) == want, (trial, k)


def test_token_keys_of_a_range_are_the_rows_of_the_whole_table():
    h = history(20, seed=2, context=3)
    whole = h.token_keys()
    for a, b in [(0, 23), (0, 2), (2, 5), (3, 23), (10, 10), (22, 23)]:
        assert np.array_equal(h.token_keys(a, b), whole[a:b]), (a, b)
    with pytest.raises(ValueError, match=r"0 <= start <= stop <= 23, got 5 and 4"):
        h.token_keys(5, 4)


def test_a_prefix_differing_anywhere_is_never_reused_past_the_difference():
    """A request whose history differs from the cached prefix at one token (id, action, time, the first time) reads
    exactly the tokens before it, and its scores equal full inference."""
    model = make_model()
    engine = make_engine(model, extend_on_rank=False)
    h = history(40, seed=4)
    engine.prefill_prefix(7, h.prefix(30))
    c = candidates(3)
    for field, at, want in (("item_ids", 12, 12), ("action_ids", 29, 29), ("timestamps", 5, 5),
                            ("timestamps", 0, 0)):
        fields = {f: getattr(h, f).clone() for f in ("item_ids", "action_ids", "timestamps")}
        if field == "timestamps":
            fields[field][at:] += 1
        else:
            fields[field][at] = (fields[field][at] + 1) % 4
        other = rg.Behaviors(**fields)
        assert engine.match_length(7, other) == want, field
        r = engine.rank_with_prefix(7, other, c)
        assert r.cached_tokens == want
        assert_exact(r, model, other, c)


def test_an_extended_fingerprint_equals_the_one_hashed_from_the_start():
    """The fingerprint of a longer history over a recorded entry hashes the new tokens only, and equals the one
    hashed from the first token; a ranking's extension keys the grown entry so that pre-inferring the same
    history finds it cached."""
    model = make_model(context=2)
    engine = make_engine(model)
    h = history(50, seed=6, context=2)
    t = engine.prefill_prefix(3, h.prefix(30))
    with engine.index.held():
        whole = engine.index.fingerprint(Prepared(3, h, None, None), h.num_tokens)
        p = Prepared(3, h, None, None)
        assert engine.index.fingerprint(p, h.num_tokens, Hit(t.fingerprint, t.num_tokens, t.num_tokens)) == whole
        assert "_keys" not in p.__dict__  # only the new tokens' rows were built
    r = engine.rank_with_prefix(3, h, candidates(2), ticket=t)  # the lease ends, then the entry grows to 52
    assert r.cached_tokens == 32 and engine.stats()["extensions"] == 1
    assert_exact(r, model, h, candidates(2))
    again = engine.prefill_prefix(3, h)
    assert again.reason == "already_cached" and again.fingerprint == whole
    assert engine.rank_with_prefix(3, h, candidates(2)).cached_tokens == 52


# ----------------------------------------------------------------------------------------------- live tiles
def test_a_graph_bucket_plans_the_splits_the_eager_plan_does_at_nvidias_shape():
    """A graphed ranking at NVIDIA's shape (4 heads x 256, 3968 cached + 128 new tokens, 256 candidates), planned for
    an H100: the bucket's tables hold the live tiles (1 history + 2 candidate tiles, not the 3 + 4 of ``rows // m +
    S``), so ``decide`` gives it the eager plan's 11 splits (the padded tables' 28 (tile, head) pairs got 4) and
    a bias table of 128 history rows and a row per user slot (2, not 386 rows)."""
    from relaygr_engine.bench.host import StubGraphs
    from relaygr_engine.config import KVDtype
    from relaygr_engine.kernels import _common as C
    from relaygr_engine.kernels._launch import decide
    from relaygr_engine.kernels._prefix_config import pick_config
    from relaygr_engine.kernels._prefix_plan import _plan
    from relaygr_engine.kernels._target import named_gpu

    cfg = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=1024, num_heads=4, head_dim=256,
                           num_items=1000, num_actions=4, max_seq_len=4096, num_tasks=2)
    engine = rg.RelayEngine(rg.build_ranker(cfg, seed=0), rg.CacheConfig(
        page_size=64, num_pages=72, lease_ttl_s=3600.0, max_pinned_fraction=1.0, attention_backend="torch"),
        extend_on_rank=False)
    runner = StubGraphs(engine.model, engine.layers, engine.state, rg.GraphConfig(prefill=False), capture=False)
    runner.capture, runner.tasks, runner.target = True, 2, named_gpu("h100")
    engine.runner.graphs = runner
    h = history(4096, seed=1)
    h = rg.Behaviors(h.item_ids % 1000, h.action_ids, h.timestamps)
    assert engine.prefill_prefix(1, h.prefix(3968)).admitted
    assert engine.rank_with_prefix(1, h, candidates(256)).cached_tokens == 3968
    b = next(iter(runner.buckets.values()))
    graphed = runner._static(b)[1].plan
    h100 = named_gpu("h100")
    kcfg = pick_config(h100, torch.bfloat16, 256)
    layer = dict(dtype=torch.bfloat16, head_dim=256, num_heads=4, num_pages=72, kv_dtype=KVDtype.MODEL, hstu=True,
                 biased=True, interpreted=False)
    table = C.PageTable([0, 384], [256], [0, 62], [64])
    eager = _plan(table, page_size=64, num_pages=72, cfg=kcfg, device=torch.device("cpu"))
    got, want = decide(graphed, h100, kcfg, **layer), decide(eager, h100, kcfg, **layer)
    assert (graphed.hist_tiles.shape[1], graphed.cand_tiles.shape[1]) == (1, 2) == \
        (eager.hist_tiles.shape[1], eager.cand_tiles.shape[1])
    assert got.num_splits == want.num_splits == 11
    assert got.num_splits * got.split_len >= b.key.prefix + b.key.history_rows  # every key of the bucket covered
    assert got.hist_table and (got.user_rows, want.user_rows) == (2, 1)
    padded = C.tile_table([384, 0], [256, 0], (128, 128), (3, 4))  # the tables' former widths
    former = type(graphed)(128, 128, 2, 384, 64, 72, padded[0], padded[1], graphed.max_key_len, 3968,
                           graphed.max_context_len, {})
    assert decide(former, h100, kcfg, **layer).num_splits == 4


# ----------------------------------------------------------------------------------------------- kept tables
def test_a_kept_torch_plan_serves_only_its_layout():
    """The torch backend's plan is kept per layout (entries, cached tokens, pages, rows, row times): other
    candidate ids of the same count reuse it, another request time, another user's pages or another history length
    build their own; every ranking exact."""
    model = make_model()
    engine = make_engine(model, extend_on_rank=False)
    h1, h2 = history(30, seed=1), history(30, seed=2)
    engine.prefill_prefix(1, h1.prefix(24))
    engine.prefill_prefix(2, h2.prefix(24))
    plans = engine.runner._torch_plans
    last = int(h1.timestamps[-1])
    for user, h, c, t_req, kept in ((1, h1, candidates(3, seed=1), None, 1), (1, h1, candidates(3, seed=2), None, 1),
                                    (1, h1, candidates(3, seed=2), last + 60, 2), (2, h2, candidates(3), None, 3),
                                    (1, h1.prefix(28), candidates(3), None, 4), (1, h1, candidates(3), None, 4)):
        r = engine.rank_with_prefix(user, h, c, request_time=t_req)
        assert r.cached_tokens == 24 and len(plans) == kept
        assert_exact(r, model, h, c, request_time=t_req)
    from relaygr_engine.engine import forward
    sizes = [size for _, size in plans.values()]
    assert engine.runner._torch_plan_bytes == sum(sizes) > 0
    with pytest.MonkeyPatch.context() as mp:  # a byte budget of two plans keeps the most recent within it
        mp.setattr(forward, "TORCH_PLANS_BYTES", 2 * max(sizes))
        r = engine.rank_with_prefix(2, h2.prefix(27), candidates(3))  # a new layout
        assert_exact(r, model, h2.prefix(27), candidates(3))
        assert 1 <= len(plans) <= 2 and engine.runner._torch_plan_bytes <= 2 * max(sizes)
        assert next(reversed(plans))[0][0][0] == (2, _entry_of(engine, 2))


def _entry_of(engine, user):
    """The fingerprint of ``user``'s one cached entry."""
    (fp, _), = engine.pool.entries_of(user)
    return fp
