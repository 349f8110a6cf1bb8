"""Published HSTU layer variants: converted checkpoints score like independent implementations of the published
formulas, and stay exact on every relay path (torch and the Triton interpreter); bad checkpoints are refused."""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import relaygr_engine as rg
from relaygr_engine.models import convert
from relaygr_engine.testing import check_relay_exact

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D_MODEL, H, DQK, DV, MAX_LEN, ITEMS = 24, 2, 8, 12, 40, 300


# ----------------------------------------------------------------------------------------- published formulas
# Written from the published layer definitions, in float64, one request at a time over dense [n, n] masks: rows
# are the history (causal) then the candidates (each sees the history and itself), as the target-aware mask does.
def visible(n_hist: int, n: int) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return ((j <= i) & (j < n_hist)) | (i == j)


def layer_norm(x, w=None, b=None, eps=1e-6):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def stu_layer(x, sd, n_hist, *, N, alpha, group_norm):
    """Meta STU: u = SiLU(.); A = SiLU(alpha q.k) / N; y = u * norm(a); out = x + concat(u, a, y) W_o."""
    n = x.shape[0]
    uvqk = layer_norm(x, sd["_input_norm_weight"], sd["_input_norm_bias"]) @ sd["_uvqk_weight"] + sd["_uvqk_beta"]
    u, v, q, k = uvqk.split([H * DV, H * DV, H * DQK, H * DQK], dim=1)
    u = F.silu(u)
    q, k, v = q.view(n, H, DQK), k.view(n, H, DQK), v.view(n, H, DV)
    w = F.silu(torch.einsum("ihd,jhd->hij", q, k) * alpha) / N * visible(n_hist, n)
    a = torch.einsum("hij,jhd->ihd", w, v).reshape(n, H * DV)
    if group_norm:
        normed = F.group_norm(a.view(n, H, DV), H, sd["_output_norm_weight"], sd["_output_norm_bias"], 1e-6)
        normed = normed.reshape(n, H * DV)
    else:
        normed = layer_norm(a, sd["_output_norm_weight"], sd["_output_norm_bias"])
    return x + torch.cat([u, a, u * normed], dim=1) @ sd["_output_weight"]


def research_bucket(dt):
    return (torch.log(torch.abs(dt).clamp(min=1).float()) / 0.301).long()


def research_layer(x, sd, n_hist, pos, ts, *, N, num_buckets, next_time=False):
    """Meta research HSTU: SiLU on u, v, q, k; A = SiLU(q.k + rab) / N; out = x + W_o(u * LN(a)) + b, LayerNorms
    without affine parameters. rab_ij = pos_w[N-1 + j - i] + ts_w[clamp(bucket(t - t_j), 0, NB)] with t = t_i (or
    the published t_{i+1} when ``next_time``); no rab without timestamps."""
    n = x.shape[0]
    u, v, q, k = F.silu(layer_norm(x) @ sd["_uvqk"]).split([H * DV, H * DV, H * DQK, H * DQK], dim=1)
    q, k, v = q.view(n, H, DQK), k.view(n, H, DQK), v.view(n, H, DV)
    s = torch.einsum("ihd,jhd->hij", q, k)
    if ts is not None:
        pw = sd["_rel_attn_bias._pos_w"]
        rel = (pos[None, :] - pos[:, None] + N - 1).clamp(min=0)  # j - i + N - 1 (>= 0 where visible)
        t_q = torch.cat([ts[1:], ts[-1:]]) if next_time else ts
        b = research_bucket(t_q[:, None] - ts[None, :]).clamp(0, num_buckets)
        s = s + pw[rel] + sd["_rel_attn_bias._ts_w"][b]
    w = F.silu(s) / N * visible(n_hist, n)
    a = torch.einsum("hij,jhd->ihd", w, v).reshape(n, H * DV)
    return x + (u * layer_norm(a)) @ sd["_o.weight"].t() + sd["_o.bias"]


def nvidia_layer(x, sd, n_hist, *, N, eps):
    """NVIDIA HSTU (training layout): per-head [u, v, q, k] columns; SiLU on all; A = SiLU(q.k / sqrt(D)) / N;
    out = x + (u * LN(a)) W_proj."""
    n = x.shape[0]
    h = layer_norm(x, sd["_input_layernorm_weight"], sd["_input_layernorm_bias"], eps)
    uvqk = F.silu(h @ sd["_linear_uvqk_weight"] + sd["_linear_uvqk_bias"]).view(n, H, 2 * DV + 2 * DQK)
    u, v, q, k = uvqk.split([DV, DV, DQK, DQK], dim=-1)
    w = F.silu(torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(DQK)) / N * visible(n_hist, n)
    a = torch.einsum("hij,jhd->ihd", w, v).reshape(n, H * DV)
    normed = layer_norm(a, sd["_output_layernorm_weight"], sd["_output_layernorm_bias"], eps)
    return x + (u.reshape(n, H * DV) * normed) @ sd["_linear_proj_weight"]


def published_scores(model, layer_fn, history, cands, request_time=None):
    """The ranker's own embeddings and heads around ``layer_fn`` (the published layers), in float64."""
    batch = rg.RelayBatch.full(history, cands, request_time)
    m = model.double()
    try:
        with torch.no_grad():
            x = m.embed(batch)
            n_hist = x.shape[0] - len(cands)
            for layer in range(model.config.num_layers):
                x = layer_fn(layer, x, n_hist, batch)
            return m.score(x[n_hist:]).float()
    finally:
        model.float()


# ----------------------------------------------------------------------------------------- checkpoints
def rand(*shape, g, scale=0.3):
    return (torch.randn(*shape, generator=g) * scale).double()


def stu_checkpoint(layers, seed, group_norm=False):
    g = torch.Generator().manual_seed(seed)
    width = H if group_norm else H * DV
    return [{"_uvqk_weight": rand(D_MODEL, (2 * DV + 2 * DQK) * H, g=g),
             "_uvqk_beta": rand((2 * DV + 2 * DQK) * H, g=g),
             "_input_norm_weight": 1 + rand(D_MODEL, g=g), "_input_norm_bias": rand(D_MODEL, g=g),
             "_output_weight": rand(3 * DV * H, D_MODEL, g=g), "_output_norm_weight": 1 + rand(width, g=g),
             "_output_norm_bias": rand(width, g=g)} for _ in range(layers)]


def research_checkpoint(layers, seed, n_rab):
    g = torch.Generator().manual_seed(seed)
    return [{"_uvqk": rand(D_MODEL, (2 * DV + 2 * DQK) * H, g=g), "_o.weight": rand(D_MODEL, DV * H, g=g),
             "_o.bias": rand(D_MODEL, g=g), "_rel_attn_bias._pos_w": rand(2 * n_rab - 1, g=g, scale=1.0),
             "_rel_attn_bias._ts_w": rand(129, g=g, scale=1.0)} for _ in range(layers)]


def nvidia_checkpoint(layers, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"_linear_uvqk_weight": rand(D_MODEL, (2 * DV + 2 * DQK) * H, g=g),
             "_linear_uvqk_bias": rand((2 * DV + 2 * DQK) * H, g=g),
             "_input_layernorm_weight": 1 + rand(D_MODEL, g=g), "_input_layernorm_bias": rand(D_MODEL, g=g),
             "_output_layernorm_weight": 1 + rand(H * DV, g=g), "_output_layernorm_bias": rand(H * DV, g=g),
             "_linear_proj_weight": rand(H * DV, D_MODEL, g=g)} for _ in range(layers)]


def ranker(options, layers=2, seed=0):
    cfg = rg.GRModelConfig(num_layers=layers, hidden_dim=D_MODEL, num_items=ITEMS, num_actions=3,
                           max_seq_len=MAX_LEN, num_tasks=2, **options)
    return rg.build_ranker(cfg, seed=seed)


def load(model, layer_entries):
    result = model.load_state_dict({k: v.float() for k, v in layer_entries.items()}, strict=False)
    assert not result.unexpected_keys and not any(k.startswith("layers.") for k in result.missing_keys)
    return model


def histories(lengths=(11, 17), seed=3, timestamps=True):
    out = []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(seed + i)
        gaps = torch.randint(0, 200_000, (n,), generator=g)  # seconds to days: many log and sqrt buckets
        out.append(rg.Behaviors(item_ids=torch.randint(0, ITEMS, (n,), generator=g),
                                action_ids=torch.randint(0, 3, (n,), generator=g),
                                timestamps=1_700_000_000 + torch.cumsum(gaps, 0) if timestamps else None))
    return out


def candidates(count=(4, 3)):
    return [torch.randint(0, ITEMS, (c,), generator=torch.Generator().manual_seed(c)) for c in count]


TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def interpreter_or_skip():
    from relaygr_engine.kernels import _common
    if not _common.interpreter_active():
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton's first import)")


# ----------------------------------------------------------------------------------------- Meta STU
@pytest.mark.parametrize("group_norm", [False, True])
def test_meta_stu_checkpoint_scores_like_the_published_layer_on_every_path(group_norm):
    N = 32.0
    opts = convert.meta_stu_options(H, DQK, DV, None, group_norm, hstu_norm=N)
    model = ranker(opts)
    ckpt = stu_checkpoint(2, seed=1, group_norm=group_norm)
    load(model, convert.from_meta_stu(ckpt, model.config))
    hists, cands = histories(), candidates()
    for h, c in zip(hists, cands):
        want = published_scores(model, lambda l, x, n, b: stu_layer(x, ckpt[l], n, N=N, alpha=DQK ** -0.5,
                                                                    group_norm=group_norm), h, c)
        torch.testing.assert_close(model.rank_full(h, c), want, atol=1e-4, rtol=0)
    report = check_relay_exact(model, hists, cands)
    assert set(report) == {"miss", "hit", "batch", "extend", "dram"} and max(report.values()) <= 1e-4


def test_meta_stu_per_batch_normaliser_runs_dense_and_is_refused_by_the_engine():
    model = ranker(convert.meta_stu_options(H, DQK, DV, 0.2, hstu_norm="batch"))
    ckpt = stu_checkpoint(2, seed=2)
    load(model, convert.from_meta_stu(ckpt, model.config))
    h, c = histories((9,))[0], candidates((3,))[0]
    want = published_scores(model, lambda l, x, n, b: stu_layer(x, ckpt[l], n, N=12.0, alpha=0.2,
                                                                group_norm=False), h, c)
    torch.testing.assert_close(model.rank_full(h, c), want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=r"must be prefix-stable .*layers\.0\.attn: hstu_norm='batch'"):
        rg.RelayEngine(model, rg.CacheConfig(num_pages=64))


def test_models_declaring_prefix_unstable_features_are_refused():
    model = ranker({})
    model.prefix_unstable_features = ("positions counted from the end",)
    with pytest.raises(ValueError, match="must be prefix-stable .*positions counted from the end"):
        rg.RelayEngine(model, rg.CacheConfig(num_pages=64))


def test_meta_stu_round_trip_and_options():
    model = ranker(convert.meta_stu_options(H, DQK, DV, None, True, hstu_norm=32.0))
    ckpt = stu_checkpoint(2, seed=4, group_norm=True)
    got = convert.from_meta_stu(ckpt, model.config)
    back = [{"_uvqk_weight": got[f"layers.{l}.uvqk.weight"].t(), "_uvqk_beta": got[f"layers.{l}.uvqk.bias"],
             "_input_norm_weight": got[f"layers.{l}.input_norm.weight"],
             "_input_norm_bias": got[f"layers.{l}.input_norm.bias"],
             "_output_weight": got[f"layers.{l}.out_proj.weight"].t(),
             "_output_norm_weight": got[f"layers.{l}.output_norm.weight"],
             "_output_norm_bias": got[f"layers.{l}.output_norm.bias"]} for l in range(2)]
    for a, b in zip(ckpt, back):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(got[f"layers.{l}.{n}"].any() for l in range(2) for n in ("rel_pos_bias", "time_bias",
                                                                            "out_proj.bias"))
    with pytest.raises(ValueError, match="contextual_seq_len must be 0: .*not prefix-stable"):
        convert.meta_stu_options(H, DQK, DV, hstu_norm=32.0, contextual_seq_len=2)


# ----------------------------------------------------------------------------------------- Meta research HSTU
def test_meta_research_checkpoint_scores_like_the_published_layer_on_every_path():
    n_rab = MAX_LEN  # max_sequence_len + max_output_len of the research model
    model = ranker(convert.meta_research_options(H, DQK, DV, max_len=n_rab))
    ckpt = research_checkpoint(2, seed=5, n_rab=n_rab)
    load(model, convert.from_meta_research_hstu(ckpt, model.config))
    hists, cands = histories(), candidates()
    for h, c in zip(hists, cands):
        def layer_fn(l, x, n, batch, next_time=False):
            return research_layer(x, ckpt[l], n, batch.positions, batch.timestamps, N=n_rab, num_buckets=128,
                                  next_time=next_time)
        torch.testing.assert_close(model.rank_full(h, c), published_scores(model, layer_fn, h, c), atol=1e-4, rtol=0)
        # the published t_{i+1} time bias scores differently (documented: loads partly)
        nxt = published_scores(model, lambda *a: layer_fn(*a, next_time=True), h, c)
        assert float((model.rank_full(h, c) - nxt).abs().max()) > 1e-3
    report = check_relay_exact(model, hists, cands)
    assert max(report.values()) <= 1e-4
    # without timestamps the research layer has no relative bias at all
    plain = histories(timestamps=False)
    for h, c in zip(plain, cands):
        want = published_scores(model, lambda l, x, n, b: research_layer(x, ckpt[l], n, b.positions, None, N=n_rab,
                                                                          num_buckets=128), h, c)
        torch.testing.assert_close(model.rank_full(h, c), want, atol=1e-4, rtol=0)
    assert max(check_relay_exact(model, plain, cands, paths=("hit", "batch")).values()) <= 1e-4


def test_meta_research_round_trip():
    model = ranker(convert.meta_research_options(H, DQK, DV, max_len=MAX_LEN))
    ckpt = research_checkpoint(1, seed=6, n_rab=MAX_LEN)
    got = convert.from_meta_research_hstu(ckpt * 2, model.config)
    assert torch.equal(got["layers.0.uvqk.weight"].t(), ckpt[0]["_uvqk"])
    assert torch.equal(got["layers.1.out_proj.weight"], ckpt[0]["_o.weight"])
    pos = got["layers.0.rel_pos_bias"]  # rel_pos_bias[d] = _pos_w[N-1-d]; the farthest entry past N-1
    assert torch.equal(pos[:MAX_LEN].flip(0), ckpt[0]["_rel_attn_bias._pos_w"][:MAX_LEN])
    assert pos[MAX_LEN] == ckpt[0]["_rel_attn_bias._pos_w"][0]
    assert torch.equal(got["layers.0.time_bias"], ckpt[0]["_rel_attn_bias._ts_w"])


# ----------------------------------------------------------------------------------------- NVIDIA
def test_nvidia_checkpoint_scores_like_the_published_layer_on_every_path():
    opts = convert.nvidia_hstu_options(H, DQK, scaling_seqlen=48.0)
    opts["value_dim"] = DV  # the layer allows separate widths; the interleaving is per head either way
    model = ranker(opts)
    ckpt = nvidia_checkpoint(2, seed=7)
    load(model, convert.from_nvidia_hstu(ckpt, model.config))
    hists, cands = histories(), candidates()
    for h, c in zip(hists, cands):
        want = published_scores(model, lambda l, x, n, b: nvidia_layer(x, ckpt[l], n, N=48.0, eps=1e-5), h, c)
        torch.testing.assert_close(model.rank_full(h, c), want, atol=1e-4, rtol=0)
    assert max(check_relay_exact(model, hists, cands).values()) <= 1e-4


def test_nvidia_round_trip_interleaves_per_head():
    model = ranker(dict(convert.nvidia_hstu_options(H, DQK, scaling_seqlen=48.0), value_dim=DV), layers=1)
    ckpt = nvidia_checkpoint(1, seed=8)
    got = convert.from_nvidia_hstu(ckpt, model.config)
    w = got["layers.0.uvqk.weight"].t()  # [d, u | v | q | k]
    u, v, q, k = w.split([H * DV, H * DV, H * DQK, H * DQK], dim=1)
    per_head = torch.cat([torch.cat([u.view(-1, H, DV), v.view(-1, H, DV), q.view(-1, H, DQK),
                                     k.view(-1, H, DQK)], dim=2)], dim=2).reshape(D_MODEL, -1)
    assert torch.equal(per_head, ckpt[0]["_linear_uvqk_weight"])
    assert torch.equal(got["layers.0.out_proj.weight"].t(), ckpt[0]["_linear_proj_weight"])


# ----------------------------------------------------------------------------------------- bad checkpoints
def test_converters_name_what_does_not_fit():
    stu = ranker(convert.meta_stu_options(H, DQK, DV, hstu_norm=32.0)).config
    bad = stu_checkpoint(2, seed=9)
    bad[1]["_output_weight"] = bad[1]["_output_weight"][:-1]
    with pytest.raises(ValueError, match=r"layer 1: _output_weight must have shape \[72, 24\] .*got \[71, 24\]"):
        convert.from_meta_stu(bad, stu)
    with pytest.raises(ValueError, match=r"layer 0: missing _uvqk_beta"):
        convert.from_meta_stu([{k: v for k, v in s.items() if k != "_uvqk_beta"} for s in stu_checkpoint(2, 1)], stu)
    with pytest.raises(ValueError, match=r"unexpected Meta STU tensors \['extra'\]"):
        convert.from_meta_stu([dict(s, extra=torch.zeros(1)) for s in stu_checkpoint(2, 1)], stu)
    with pytest.raises(ValueError, match="must have config.num_layers=2 entries, got 1"):
        convert.from_meta_stu(stu_checkpoint(1, 1), stu)
    with pytest.raises(ValueError, match=r"_output_norm_weight must have shape \[2\] \(num_heads=2 "):
        convert.from_meta_stu(stu_checkpoint(2, 1), rg.GRModelConfig(**{**stu.__dict__, "hstu_output_norm": "group"}))
    with pytest.raises(ValueError, match="config.hstu_output must be 'concat_ux' for Meta STU layers, got 'gated'"):
        convert.from_meta_stu(stu_checkpoint(2, 1), ranker({}).config)
    research = ranker(convert.meta_research_options(H, DQK, DV, max_len=MAX_LEN)).config
    ckpt = research_checkpoint(2, seed=9, n_rab=MAX_LEN + 1)
    with pytest.raises(ValueError, match=r"so the research layer divides by N = 41; config.hstu_norm must be 41.0"):
        convert.from_meta_research_hstu(ckpt, research)
    ckpt = research_checkpoint(2, seed=9, n_rab=MAX_LEN)
    ckpt[0]["_o.weight"] = torch.zeros(D_MODEL, 3 * DV * H, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"layer 0: _o.weight reads .*concat_ua=True"):
        convert.from_meta_research_hstu(ckpt, research)
    nv = ranker(convert.nvidia_hstu_options(H, DQK, scaling_seqlen=48.0)).config  # value_dim = DQK != DV
    with pytest.raises(ValueError, match=r"layer 0: _linear_uvqk_weight must have shape \[24, 64\]"):
        convert.from_nvidia_hstu(nvidia_checkpoint(2, 1), nv)


# ----------------------------------------------------------------------------------------- options on every backend
def option_sets():
    return [dict(time_bucket="sqrt_60", num_time_buckets=400, value_dim=DV),
            dict(time_bucket="ln_0301", num_time_buckets=20, hstu_activation="silu_uvqk", hstu_output="concat_ux",
                 hstu_output_norm="group", value_dim=6, norm_eps=1e-6, attn_alpha=0.5, hstu_norm=17.0),
            dict(rab_without_time=False, head_dim=8, value_dim=4)]


@pytest.mark.parametrize("options", option_sets(), ids=["sqrt_60", "ln_0301-concat-group", "no-rab-without-time"])
def test_options_keep_every_relay_path_exact(options):
    model = ranker(options, seed=11)
    hists, cands = histories((13, 22)), candidates()
    assert max(check_relay_exact(model, hists, cands).values()) <= 1e-4
    late = [int(hists[0].timestamps[-1]) - 50_000]  # a request time before the last behaviors: |dt| matters
    assert max(check_relay_exact(model, hists[:1], cands[:1], request_times=late, paths=("hit",)).values()) <= 1e-4


@TRITON
@pytest.mark.parametrize("options", option_sets()[:2], ids=["sqrt_60", "ln_0301-concat-group"])
def test_options_exact_with_the_triton_interpreter(options):
    interpreter_or_skip()
    model = ranker(options, seed=12)
    report = check_relay_exact(model, histories((9, 14)), candidates(), attention_backend="triton",
                               paths=("miss", "hit", "dram"))
    assert max(report.values()) <= 1e-4


@TRITON
def test_converted_stu_exact_with_the_triton_interpreter():
    interpreter_or_skip()
    model = ranker(convert.meta_stu_options(H, DQK, DV, None, True, hstu_norm=32.0))
    load(model, convert.from_meta_stu(stu_checkpoint(2, seed=13, group_norm=True), model.config))
    report = check_relay_exact(model, histories((9, 14)), candidates(), attention_backend="triton",
                               paths=("miss", "hit", "batch"))
    assert max(report.values()) <= 1e-4


def test_defaults_keep_the_layer_as_before():
    cfg = ranker({}).config
    want = (32, 1e-5, float(MAX_LEN), 1 / math.sqrt(32))
    assert (cfg.value_dim, cfg.norm_eps, cfg.hstu_norm, cfg.attention_scale) == want
    layer = ranker({}).layers[0]
    assert layer.uvqk.weight.shape == (4 * H * 32, D_MODEL) and layer.out_proj.weight.shape == (D_MODEL, H * 32)
    with pytest.raises(ValueError, match="hstu_output applies to attention='hstu' only"):
        rg.GRModelConfig(attention="softmax", hstu_output="concat_ux")
    with pytest.raises(ValueError, match=r"num_time_buckets must be in \[1, 64\] for time_bucket='log2', got 65"):
        rg.GRModelConfig(num_time_buckets=65)
    assert rg.GRModelConfig(time_bucket="sqrt_60", num_time_buckets=2049).num_time_buckets == 2049


def test_time_buckets_equal_the_published_float32_formulas():
    from relaygr_engine.attention.ops import time_bucket_bounds, time_buckets
    formulas = {"ln_0301": lambda d: (torch.log(d.abs().clamp(min=1).float()) / 0.301).long(),
                "sqrt_60": lambda d: torch.sqrt(d.float().clamp(min=1e-6) / 60.0).long()}
    g = torch.Generator().manual_seed(0)
    for name, nb in (("ln_0301", 129), ("sqrt_60", 2049), ("sqrt_60", 7)):
        bounds = time_bucket_bounds(name, nb)
        steps = bounds[bounds < (1 << 62)]
        d = torch.cat([steps - 1, steps, steps + 1, -steps, torch.arange(-100, 100),
                       torch.randint(-(1 << 40), 1 << 40, (2000,), generator=g)])
        want = formulas[name](d).clamp(0, nb - 1)
        assert torch.equal(time_buckets(d, nb, name), want), name
    assert time_buckets(torch.tensor([-5, 5]), 129, "ln_0301").tolist() == [5, 5]
    assert time_buckets(torch.tensor([-500, 500]), 100, "sqrt_60").tolist() == [0, 2]
