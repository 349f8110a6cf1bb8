"""A plan's HSTU bias index: each table entry's position index and time bucket, built by the first layer's call and
read by the later layers' (two gathers per entry instead of the page table, the key timestamps and the bucket),
checked exact in Triton's interpreter against the reference for every layer's own tables."""
from __future__ import annotations

import pytest
import torch
from kernel_problems import ATOL, attention_kwargs, make_problem, needs_interpreter, prefix_attention

from relaygr_engine.kernels.reference import prefix_attention_ref

META = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")


def _spy_modes(monkeypatch) -> list:
    """The INDEX mode of every bias-table launch (0: computed, 1: computed and index stored, 2: from the index)."""
    from relaygr_engine.kernels import _bias_table as T

    modes, real = [], T.bias_table_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                modes.append(kwargs["INDEX"])
                return real[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(T, "bias_table_kernel", Spy())
    return modes


@needs_interpreter
@pytest.mark.parametrize("time_bucket", ["log2", "sqrt_60"])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_plan_builds_its_bias_index_once_for_every_layer(monkeypatch, time_bucket, splits):
    """Three layers with their own ``pos_bias``/``ts_bias`` share one plan: the first builds the index, the others
    read it, every one exact (candidate and history rows of the table, users with and without a prefix). New
    timestamp tensors or another bucket function build it again; a call without a plan computes its table."""
    from relaygr_engine.kernels.prefix_attention import plan_prefix_attention

    modes = _spy_modes(monkeypatch)
    nb = 9 if time_bucket == "log2" else 40
    args, bias = make_problem([(70, 9, 6), (40, 3, 5), (0, 4, 2)], 16, 2, 32, seed=11, num_buckets=nb)
    plan = plan_prefix_attention(**{n: args[n] for n in META}, kv_cache=args["kv_cache"], block_m=16)
    kw = dict(attention_kwargs("hstu", bias, 32), time_bucket=time_bucket)
    g = torch.Generator().manual_seed(3)

    def layer(**over):
        lay = dict(kw, pos_bias=torch.randn(64, generator=g), ts_bias=torch.randn(nb, generator=g), **over)
        out = prefix_attention(**args, **lay, plan=plan, block_n=16, splits=splits)
        torch.testing.assert_close(out, prefix_attention_ref(**args, **lay), atol=ATOL, rtol=0)

    for _ in range(3):
        layer()
    assert modes == [1, 2, 2]
    moved = kw["ts_q"].clone()
    moved[9:15] += 1 << 20  # the first user's candidates ask later (another tensor: its buckets differ)
    layer(ts_q=moved)
    layer(ts_q=moved)
    assert modes[3:] == [1, 2]
    if time_bucket == "sqrt_60":
        layer(ts_q=moved, time_bucket="ln_0301")
        assert modes[-1] == 1
    out = prefix_attention(**args, **kw, block_n=16, splits=splits)  # no plan: nothing kept
    torch.testing.assert_close(out, prefix_attention_ref(**args, **kw), atol=ATOL, rtol=0)
    assert modes[-1] == 0


@needs_interpreter
def test_the_bias_index_needs_no_timestamps_for_position_only_bias(monkeypatch):
    """With ``pos_bias`` alone the index depends on the plan only: built once, read by every later layer."""
    from relaygr_engine.kernels.prefix_attention import plan_prefix_attention

    modes = _spy_modes(monkeypatch)
    args, bias = make_problem([(50, 6, 12), (9, 0, 4)], 16, 2, 32, seed=7, num_pos=20)
    plan = plan_prefix_attention(**{n: args[n] for n in META}, kv_cache=args["kv_cache"])
    for i in range(2):
        kw = attention_kwargs("hstu", dict(bias, pos_bias=bias["pos_bias"] * (i + 1)), 32, ("pos",))
        out = prefix_attention(**args, **kw, plan=plan)
        torch.testing.assert_close(out, prefix_attention_ref(**args, **kw), atol=ATOL, rtol=0)
    assert modes == [1, 2]


@needs_interpreter
def test_an_engine_forward_builds_the_index_once_for_all_its_layers(monkeypatch):
    """Through the engine (Triton backend, CPU interpreter): each forward's first layer builds the index, the
    second reads it (the layers pass the batch's own timestamp tensors), and a new forward builds its own; the
    scores stay exact."""
    from engine_helpers import assert_exact, candidates, history, make_engine, make_model

    modes = _spy_modes(monkeypatch)
    model = make_model("hstu")
    engine = make_engine(model, cache=dict(attention_backend="triton"))
    h, cands = history(27, seed=3), candidates(5)
    engine.prefill_prefix(1, h.prefix(12))
    modes.clear()
    assert_exact(engine.rank_with_prefix(1, h, cands), model, h, cands)
    assert_exact(engine.rank_with_prefix(2, h, cands), model, h, cands)  # a miss: another forward
    assert modes == [1, 2, 1, 2]  # two layers each
