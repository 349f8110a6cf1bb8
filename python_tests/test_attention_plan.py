"""One place decides the attention path and says so: the kernel's launch decisions (kernels._launch), the plan that
collects them with the backend and path (attention.plan), ``relaygr explain``, and the engine's log of each shape."""
from __future__ import annotations

import logging

import pytest
import torch

from kernel_problems import attention_kwargs, make_problem, needs_interpreter

import relaygr_engine as rg
from relaygr_engine import cli
from relaygr_engine.attention import plan as attention_plan
from relaygr_engine.attention.plan import plan_attention
from relaygr_engine.kernels._target import GPUS, Target, named_gpu

H100 = named_gpu("h100")


def decisions(plan) -> dict:
    return dict(plan.decisions)


def test_nvidia_ranking_shape_on_an_h100_is_planned_without_a_gpu():
    """NVIDIA's ranking shape (4 heads x 256, bf16, 3968 cached + 128 new tokens, 256 candidates, 64-token pages)
    planned for an H100 from host arithmetic: the Triton kernel, 11 prefix splits of 384 keys making one wave of
    132 programs on 132 SMs, the history tiles on a second stream, HSTU's bias from the per-layer table, bf16
    partials, the fast SiLU; the sm_90 kernel off unless asked for."""
    p = plan_attention(H100, mode="hstu", num_heads=4, head_dim=256, dtype="bfloat16", page_size=64,
                       cached=[3968], new=[128], candidates=[256])
    d = decisions(p)
    assert d["backend"].startswith("triton:") and d["path"].startswith("the Triton kernel")
    assert d["tiles"] == "1 history tile(s) of 128 rows, 2 candidate tile(s) of 128 rows, x 4 heads"
    assert d["splits"].startswith("11 of 384 keys:") and "132 programs, 1 wave(s)" in d["splits"]
    assert d["streams"].startswith("two:")
    assert d["page_reads"].startswith("autotuned")
    assert d["bias"].startswith("a per-layer table") and d["sm90_kernel"].startswith("off (opt-in")
    assert d["split_partials"].startswith("bfloat16") and d["silu"].startswith("one approximate tanh")
    assert p.target == GPUS["h100"].name and p.shape["cached"] == "3968"
    text = p.describe()
    assert text.splitlines()[0] == f"attention plan on {H100.name}" and "splits" in text


def test_the_plan_follows_the_device_and_the_page_format():
    """Fewer SMs, another split count; an sm_80 GPU reads pages through pointers; 8-bit pages on CUDA attend
    through the torch path (the kernel's 8-bit read is off there); the CPU serves the torch reference."""
    kw = dict(mode="hstu", num_heads=4, head_dim=256, dtype="bfloat16", page_size=64, cached=[3968], new=[128],
              candidates=[256])
    small = Target("cuda", "a 20-SM GPU", 20, (9, 0))
    assert decisions(plan_attention(small, **kw))["splits"] != decisions(plan_attention(H100, **kw))["splits"]
    assert decisions(plan_attention(named_gpu("a100"), **kw))["page_reads"].startswith("pointers: TMA needs sm_90")
    kv8 = decisions(plan_attention(H100, **dict(kw, kv_dtype="int8")))
    assert kv8["path"].startswith("the per-user torch reference") and kv8["kv_read"].startswith("torch path")
    assert "splits" not in kv8
    cpu = decisions(plan_attention(torch.device("cpu"), **kw))
    assert cpu["backend"].startswith("torch: backend='auto' on the CPU") and "splits" not in cpu
    small_batch = dict(kw, dtype="float32", cached=[32], new=[4], candidates=[8])
    assert decisions(plan_attention(torch.device("cpu"), **small_batch))["path"].startswith("the batch's torch plan")


def test_plan_attention_refuses_what_it_cannot_plan():
    kw = dict(mode="hstu", num_heads=4, head_dim=64, dtype="float32", page_size=16)
    with pytest.raises(ValueError, match="one length per user"):
        plan_attention(H100, **kw, cached=[1, 2], new=[1], candidates=[1])
    with pytest.raises(ValueError, match="must be >= 0"):
        plan_attention(H100, **kw, cached=[-1], new=[1], candidates=[1])
    with pytest.raises(ValueError, match="gpu must be one of"):
        named_gpu("z80")


@needs_interpreter
@pytest.mark.parametrize("mode", ["softmax", "hstu"])
def test_a_call_runs_what_the_plan_says(mode):
    """The launch decisions a real call made (kept in its batch plan) are the ones :func:`plan_attention` gives for
    the same batch on the same device: one rule, whether planning or running."""
    from relaygr_engine.kernels.prefix_attention import plan_prefix_attention, prefix_attention

    users = [(40, 5, 7), (16, 0, 3), (0, 9, 2)]
    args, bias = make_problem(users, 16, 2, 32, seed=1)
    kw = attention_kwargs(mode, bias, 32)
    meta = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")
    batch_plan = plan_prefix_attention(*(args[n] for n in meta), kv_cache=args["kv_cache"])
    prefix_attention(**args, **kw, plan=batch_plan, splits=2)
    prefix_attention(**args, **kw, plan=batch_plan, splits=2)
    assert len(batch_plan.launches) == 1  # decided once for both calls
    ran = next(iter(batch_plan.launches.values())).describe()
    planned = decisions(plan_attention(torch.device("cpu"), mode=mode, num_heads=2, head_dim=32,
                                       dtype="float32", page_size=16, cached=[u[0] for u in users],
                                       new=[u[1] for u in users], candidates=[u[2] for u in users],
                                       backend="triton", biased=mode == "hstu", splits=2))
    assert {k: planned[k] for k in ran} == ran


def test_relaygr_explain_prints_the_plan(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(["explain", "--model", "nvidia-hstu", "--history", "4096", "--candidates", "256", "--gpu",
                     "h100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "nvidia-hstu: 8 layers" in text and f"attention plan on {H100.name}" in text and "11 of 384 keys" in text
    import json

    assert json.loads(out.read_text())["decisions"]["splits"].startswith("11 of 384 keys")
    assert cli.main(["explain", "--model", "nvidia-hstu", "--device", "cpu"]) == 0
    assert "torch: backend='auto' on the CPU" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ex:
        cli.main(["explain", "--history", "10", "--new-tokens", "11"])
    assert ex.value.code == 2 and "--new-tokens (11) must be <= --history (10)" in capsys.readouterr().err


def test_the_engine_logs_each_batch_shape_once(caplog, monkeypatch):
    """At INFO the engine says what a forward ran, once per size class of batch in the process (as vLLM logs its
    attention backend once): a second ranking of the same class logs nothing new."""
    monkeypatch.setattr(attention_plan, "_logged", set())
    cfg = rg.GRModelConfig(attention="hstu", num_layers=1, hidden_dim=16, num_heads=2, head_dim=8, num_items=50,
                           num_actions=2, max_seq_len=256, num_tasks=1)
    engine = rg.RelayEngine(rg.build_ranker(cfg, seed=0), rg.CacheConfig(page_size=8, num_pages=64))
    hist = rg.Behaviors(item_ids=torch.arange(40) % 50, timestamps=torch.arange(40) * 60)
    with caplog.at_level(logging.INFO, logger="relaygr_engine"):
        engine.rank_with_prefix(user_id=1, history=hist, candidates=torch.arange(4))
        engine.rank_with_prefix(user_id=2, history=hist, candidates=torch.arange(4))
    plans = [r for r in caplog.records if r.getMessage().startswith("attention plan on cpu")]
    assert len(plans) == 1
    assert "backend  torch: backend='auto' on the CPU" in plans[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="relaygr_engine"):
        caplog.clear()
        engine.rank_with_prefix(user_id=3, history=hist, candidates=torch.arange(40))
    assert not caplog.records  # below INFO: nothing built, nothing logged
