"""GRModelConfig, Behaviors, GRRanker: the dense oracle against a per-token loop, validation, identity, names."""
from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import relaygr_engine as rg
import relaygr_engine.models as models

KINDS = ("hstu", "softmax")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_config(attention="hstu", **kw):
    base = dict(attention=attention, num_layers=2, hidden_dim=32, num_heads=2, head_dim=16, num_items=500,
                num_actions=3, max_seq_len=64, num_tasks=3, num_time_buckets=12)
    base.update(kw)
    return rg.GRModelConfig(**base)


def random_history(L, seed=0, actions=True, timestamps=True, context=0, num_items=500):
    g = torch.Generator().manual_seed(seed)
    return rg.Behaviors(
        item_ids=torch.randint(0, num_items, (L,), generator=g),
        action_ids=torch.randint(0, 3, (L,), generator=g) if actions else None,
        timestamps=torch.cumsum(torch.randint(0, 5000, (L,), generator=g), 0) + 1_600_000_000 if timestamps else None,
        context_ids=torch.randint(0, 7, (context,), generator=g) if context else None)


# ----------------------------------------------------------------------------------------------- the oracle
def per_token_scores(model, history, candidate, request_time):
    """Score one candidate as the last token of a plain causal sequence, one query at a time, in float64."""
    m = copy.deepcopy(model).double()
    cfg = m.config
    cand = torch.tensor([candidate])
    T = m.num_tokens(history)
    x = m.embed_rows(history, 0, cand)  # [T + 1, d]; the candidate at position T
    ts = m.row_timestamps(history, 0, 1, request_time)
    for layer in m.layers:
        q, k, v, aux = layer.project(x)
        o = torch.zeros_like(q)
        for i in range(T + 1):
            for h in range(cfg.num_heads):
                logits = torch.stack([(q[i, h] @ k[j, h]) for j in range(i + 1)]) * cfg.attention_scale
                if cfg.attention.value == "softmax":
                    o[i, h] = torch.softmax(logits, 0) @ v[:i + 1, h]
                    continue
                for j in range(i + 1):
                    logits[j] += layer.rel_pos_bias[min(i - j, cfg.max_seq_len)]
                    if ts is not None:
                        d = max(int(ts[i]) - int(ts[j]), 0)
                        logits[j] += layer.time_bias[min(d.bit_length(), cfg.num_time_buckets - 1)]
                o[i, h] = F.silu(logits) @ v[:i + 1, h] / cfg.max_seq_len
        x = layer.finish(x, o, aux)
    return m.score(x[T:])[0]


@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("timestamps, context", [(True, 0), (False, 0), (True, 2)])
def test_rank_full_equals_each_candidate_alone_in_a_causal_sequence(attention, timestamps, context):
    cfg = small_config(attention, num_context_tokens=context, context_vocab_size=7 if context else 0)
    model = rg.build_ranker(cfg, seed=1)
    hist = random_history(9, seed=2, timestamps=timestamps, context=context)
    cands = torch.tensor([5, 17, 5, 499])
    t_req = None if not timestamps else int(hist.timestamps[-1]) + 777
    scores = model.rank_full(hist, cands, request_time=t_req)
    assert scores.shape == (4, 3) and scores.dtype == torch.float32
    for i, c in enumerate(cands.tolist()):
        want = per_token_scores(model, hist, c, t_req if timestamps else None)
        torch.testing.assert_close(scores[i].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", KINDS)
@pytest.mark.parametrize("timestamps, context", [(True, 0), (False, 0), (True, 2)])
def test_rank_uncached_equals_rank_full(attention, timestamps, context, monkeypatch):
    """The no-cache baseline through the paged op scores like the dense oracle (also over several blocks)."""
    cfg = small_config(attention, num_context_tokens=context, context_vocab_size=7 if context else 0)
    model = rg.build_ranker(cfg, seed=4)
    hist = random_history(50, seed=9, timestamps=timestamps, context=context)
    cands = torch.randint(0, 500, (13,), generator=torch.Generator().manual_seed(2))
    t_req = None if not timestamps else int(hist.timestamps[-1]) + 99
    want = model.rank_full(hist, cands, request_time=t_req)
    torch.testing.assert_close(model.rank_uncached(hist, cands, request_time=t_req), want, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr("relaygr_engine.attention.reference._HISTORY_BLOCK_ROWS", 7)  # several causal blocks
    torch.testing.assert_close(model.rank_uncached(hist, cands, request_time=t_req), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="candidates must hold at least one"):
        model.rank_uncached(hist, cands[:0])


def test_rank_uncached_picks_its_backend_as_the_engine_does(monkeypatch):
    """``backend="auto"`` (the default, as ``CacheConfig.attention_backend``'s) resolves on the model's device: the
    torch reference on the CPU, the Triton kernels on CUDA; an explicit choice is kept; a bad one is named."""
    import relaygr_engine.models.ranker as ranker

    asked = []
    plan = ranker.plan_paged_attention
    monkeypatch.setattr(ranker, "plan_paged_attention", lambda *a, backend, **k: asked.append(backend) or plan(
        *a, backend=backend, **k))
    model = rg.build_ranker(small_config(), seed=1)
    hist, cands = random_history(9, seed=2), torch.arange(3)
    model.rank_uncached(hist, cands)
    model.rank_uncached(hist, cands, backend="torch")
    assert asked == [rg.AttentionBackend.TORCH] * 2
    assert inspect.signature(model.rank_uncached).parameters["backend"].default == "auto"
    with pytest.raises(ValueError, match="backend"):
        model.rank_uncached(hist, cands, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_rank_uncached_runs_the_triton_kernels_on_cuda(monkeypatch):
    """On CUDA the no-cache baseline's default runs the engine's Triton kernels, not the torch reference."""
    pytest.importorskip("triton")
    import relaygr_engine.models.ranker as ranker

    asked = []
    plan = ranker.plan_paged_attention
    monkeypatch.setattr(ranker, "plan_paged_attention", lambda *a, backend, **k: asked.append(backend) or plan(
        *a, backend=backend, **k))
    model = rg.build_ranker(small_config(), seed=1, device="cuda")
    hist = random_history(9, seed=2)
    hist = rg.Behaviors(*(None if t is None else t.cuda() for t in (hist.item_ids, hist.action_ids,
                                                                     hist.timestamps)))
    want = model.rank_full(hist, torch.arange(3, device="cuda"))
    torch.testing.assert_close(model.rank_uncached(hist, torch.arange(3, device="cuda")), want, atol=1e-4,
                               rtol=1e-4)
    assert asked == [rg.AttentionBackend.TRITON]


@pytest.mark.parametrize("attention", KINDS)
def test_candidate_scores_do_not_depend_on_other_candidates(attention):
    model = rg.build_ranker(small_config(attention), seed=3)
    hist = random_history(20, seed=4)
    cands = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(5))
    full = model.rank_full(hist, cands)
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(model.rank_full(hist, cands[perm]), full[perm], atol=1e-5, rtol=0)
    torch.testing.assert_close(model.rank_full(hist, cands[7:8]), full[7:8], atol=1e-5, rtol=0)


def test_time_bias_and_request_time_are_live_in_hstu_only():
    hist = random_history(15, seed=8)
    no_ts = rg.Behaviors(hist.item_ids, hist.action_ids)
    cands = torch.tensor([1, 2, 3])
    hstu = rg.build_ranker(small_config("hstu"), seed=0)
    assert not torch.allclose(hstu.rank_full(hist, cands), hstu.rank_full(no_ts, cands))
    later = int(hist.timestamps[-1]) + 10 ** 6
    assert not torch.allclose(hstu.rank_full(hist, cands), hstu.rank_full(hist, cands, request_time=later))
    soft = rg.build_ranker(small_config("softmax"), seed=0)
    torch.testing.assert_close(soft.rank_full(hist, cands), soft.rank_full(no_ts, cands))


def test_actions_are_optional():
    model = rg.build_ranker(small_config(), seed=0)
    hist = random_history(10, seed=1, actions=False)
    assert model.rank_full(hist, torch.tensor([4])).shape == (1, 3)


# ----------------------------------------------------------------------------------------------- config & build
def test_config_defaults_and_choices():
    cfg = rg.GRModelConfig()
    assert cfg.attention.value == "hstu" and cfg.ffn_dim == 4 * cfg.hidden_dim
    assert rg.GRModelConfig(attention="SOFTMAX").attention.value == "softmax"
    with pytest.raises(ValueError, match="attention must be one of 'softmax', 'hstu'"):
        rg.GRModelConfig(attention="linear")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_layers=0), "num_layers"), (dict(hidden_dim=True), "hidden_dim"), (dict(num_items=0), "num_items"),
    (dict(max_seq_len=-1), "max_seq_len"), (dict(num_time_buckets=65), "num_time_buckets"),
    (dict(num_context_tokens=2), "context_vocab_size"), (dict(num_context_tokens=-1), "num_context_tokens"),
    (dict(num_context_tokens=8, context_vocab_size=3, max_seq_len=8), "num_context_tokens must be < max_seq_len"),
    (dict(ffn_dim=0), "ffn_dim"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rg.GRModelConfig(**kwargs)


def test_build_ranker_is_deterministic_and_leaves_global_rng_alone():
    cfg = small_config()
    state = torch.random.get_rng_state()
    a, b, c = rg.build_ranker(cfg, seed=0), rg.build_ranker(cfg, seed=0), rg.build_ranker(cfg, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.item_emb.weight, c.item_emb.weight)
    assert not a.training and a.dtype == torch.float32 and a.device.type == "cpu"
    assert isinstance(a, rg.GRRanker)


def test_documented_parameter_table_matches_state_dict():
    documented = set(re.findall(r"^``([\w.{}]+)``\s+``\[", models.__doc__, re.M))
    seen = set()
    for attention in KINDS:
        for context in (0, 2):
            cfg = small_config(attention, num_context_tokens=context, context_vocab_size=5 if context else 0)
            names = {re.sub(r"^layers\.\d+\.", "layers.{l}.", n) for n in rg.build_ranker(cfg).state_dict()}
            assert names <= documented, names - documented
            seen |= names
    assert seen == documented, documented - seen


def test_identity_follows_the_weights():
    cfg = small_config()
    model = rg.build_ranker(cfg, seed=0)
    first = model.identity
    assert first == model.identity == rg.build_ranker(cfg, seed=0).identity
    assert 0 <= first < 1 << 64
    model.load_state_dict(rg.build_ranker(cfg, seed=1).state_dict())
    second = model.identity
    assert second != first
    with torch.no_grad():
        model.task_heads.bias.add_(1.0)
    assert model.identity != second
    model.load_state_dict(rg.build_ranker(cfg, seed=0).state_dict())
    assert model.identity == first  # same weights, same identity
    assert model.double().identity != first


# ----------------------------------------------------------------------------------------------- validation
def test_behaviors_structure_checks():
    ids = torch.arange(5)
    with pytest.raises(ValueError, match="item_ids must be 1-D"):
        rg.Behaviors(ids[None])
    with pytest.raises(ValueError, match="item_ids must be int64"):
        rg.Behaviors(ids.int())
    with pytest.raises(ValueError, match="action_ids must have 5 entries"):
        rg.Behaviors(ids, action_ids=ids[:4])
    with pytest.raises(ValueError, match="timestamps must be int64"):
        rg.Behaviors(ids, timestamps=ids.double())
    with pytest.raises(ValueError, match="item_ids must be a 1-D int64 torch.Tensor"):
        rg.Behaviors([1, 2, 3])
    h = rg.Behaviors(ids, action_ids=ids % 2, timestamps=ids * 10)
    p = h.prefix(3)
    assert len(p) == 3 and p.timestamps.tolist() == [0, 10, 20]
    with pytest.raises(ValueError, match="n must be an integer in"):
        h.prefix(6)


@pytest.mark.parametrize("make, match", [
    (lambda h, c: (rg.Behaviors(h.item_ids + 500), c, None), r"history.item_ids must be in \[0, 500\)"),
    (lambda h, c: (rg.Behaviors(h.item_ids, action_ids=h.action_ids + 3), c, None), "history.action_ids"),
    (lambda h, c: (rg.Behaviors(torch.zeros(65, dtype=torch.long)), c, None), "at most max_seq_len=64"),
    (lambda h, c: (rg.Behaviors(h.item_ids[:0]), c, None), "at least one behavior"),
    (lambda h, c: (h, c[:0], None), "candidates must hold at least one"),
    (lambda h, c: (h, c[None], None), "candidates must be a 1-D int64"),
    (lambda h, c: (h, c.int(), None), "candidates must be a 1-D int64"),
    (lambda h, c: (h, c - 1, None), r"candidates must be in \[0, 500\)"),
    (lambda h, c: (h, c, 1.5), "request_time must be an integer"),
    (lambda h, c: (h, c, True), "request_time must be an integer"),
    (lambda h, c: (rg.Behaviors(h.item_ids), c, 5), "request_time applies to a history with timestamps"),
    (lambda h, c: (rg.Behaviors(h.item_ids, context_ids=h.item_ids[:1]), c, None), "context_ids must be None"),
    (lambda h, c: ("not behaviors", c, None), "history must be a Behaviors"),
])
def test_check_inputs_rejects_bad_requests(make, match):
    model = rg.build_ranker(small_config(), seed=0)
    hist, cands, t = make(random_history(10), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=match):
        model.rank_full(hist, cands, request_time=t)


def test_context_tokens_are_required_with_the_right_count():
    cfg = small_config(num_context_tokens=2, context_vocab_size=7)
    model = rg.build_ranker(cfg, seed=0)
    hist = random_history(6, context=2)
    assert model.num_tokens(hist) == 8
    with pytest.raises(ValueError, match="context_ids must have 2 entries"):
        model.rank_full(rg.Behaviors(hist.item_ids), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"history.context_ids must be in \[0, 7\)"):
        model.rank_full(rg.Behaviors(hist.item_ids, context_ids=torch.tensor([0, 7])), torch.tensor([1]))
    too_long = random_history(63, context=2)
    with pytest.raises(ValueError, match="at most max_seq_len=64 tokens"):
        model.rank_full(too_long, torch.tensor([1]))
