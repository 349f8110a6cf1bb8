"""The sm_90 kernel (relaygr_engine/kernels/_hopper.py) and its place beside the portable one.

Without an sm_90 GPU: the split of a tile's keys between the two kernels (the portable kernel's
``SKIP_FULL`` share in the interpreter, the Hopper kernel's through its torch twin ``emulate``) adds up to the
reference exactly; what may and may not run it; and its offline compile for sm_90 (registers, spills, shared memory,
instruction mix). On one, the kernel itself against the reference (``gpu`` tests, skipped here).
"""
from __future__ import annotations

import functools
import itertools
import logging

import pytest
import torch
from kernel_problems import attention_kwargs, check_attention, gpu, make_problem, needs_cuda, needs_interpreter

from relaygr_engine import _warn
from relaygr_engine.kernels import _hopper_launch as HL
from relaygr_engine.kernels import prefix_attention as pa
from relaygr_engine.kernels._prefix_config import KernelConfig
from relaygr_engine.kernels.reference import prefix_attention_ref

# (the last: a prefix of whole key blocks and no new history, whose candidates' own key is the rest's only key)
USERS = [(45, 20, 9), (16, 3, 0), (0, 7, 5), (33, 0, 17), (64, 2, 3), (100, 1, 40), (32, 0, 4)]


def stand_in(monkeypatch, launch=None, key_block=16):
    """Let the Hopper path run here: nothing refused, a 16-key block, its share computed by the torch twin."""
    monkeypatch.setattr(HL, "why_not", lambda **kw: None)
    monkeypatch.setattr(HL, "takes", lambda block_m: True)
    monkeypatch.setattr(HL, "block_n", lambda head_dim: key_block)
    monkeypatch.setattr(HL, "launch", launch or functools.partial(HL.emulate, halved=False, key_block=key_block))


@needs_interpreter
@pytest.mark.parametrize("mode, which", [("hstu", ("pos", "ts")), ("hstu", ("pos",)), ("hstu", ()),
                                         ("softmax", ())])
def test_the_two_kernels_shares_add_up_to_the_reference(mode, which, monkeypatch):
    """Tiles' full cached blocks by the Hopper kernel's twin, one partial per split, the rest (the last partial
    block, the new history, the self term) by the portable kernel with SKIP_FULL as one more partial, merged: the
    reference's within 1e-4, split or not, 16- and 32-key blocks, with and without the bias table, HSTU and softmax
    (had the portable kernel not skipped the full blocks, the twin's share would count them twice). Without the
    twin's share it fails."""
    args, bias = make_problem(USERS, 16, 2, 32, seed=3)
    kw = attention_kwargs(mode, bias, 32, which)
    for key_block, splits in ((16, None), (16, 3), (32, 2)):
        stand_in(monkeypatch, key_block=key_block)
        for block_m in (16, 32):
            check_attention(args, kw, persistent=False, block_m=block_m, block_n=16, splits=splits,
                            hopper_kernel=True)
    def missing(q, ws, ml, *a, hstu, num_splits, **k):  # the Hopper share missing: its slots add nothing
        for s in range(num_splits):
            HL.clear_slot(ws[s], None if hstu else ml[s])

    stand_in(monkeypatch, launch=missing)
    with pytest.raises(AssertionError):
        check_attention(args, kw, persistent=False, block_m=16, block_n=16, splits=2, hopper_kernel=True)


@needs_interpreter
@pytest.mark.parametrize("mode", ["hstu", "softmax"])
def test_rows_the_hopper_kernel_does_not_take_see_a_neutral_extra_slot(mode, monkeypatch):
    """History tiles of a height the Hopper kernel does not take stay on the portable kernel's usual splits; the
    extra slot (the rest of the candidate tiles' keys) must add nothing to their rows: the reference's within 1e-4
    although the slot is first filled with garbage."""
    args, bias = make_problem(USERS, 16, 2, 32, seed=4)
    kw = attention_kwargs(mode, bias, 32)
    stand_in(monkeypatch, key_block=16)
    monkeypatch.setattr(HL, "takes", lambda block_m: block_m == 32)  # candidate tiles only
    monkeypatch.setattr(pa, "pick_config", lambda *a, **k: KernelConfig(32, 16, hist_block_m=16))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    for splits in (None, 2):
        check_attention(args, kw, persistent=False, splits=splits, hopper_kernel=True)
    monkeypatch.setattr(HL, "launch", lambda *a, **k: None)  # (and the test can fail: without the Hopper share)
    with pytest.raises(AssertionError):
        check_attention(args, kw, persistent=False, splits=2, hopper_kernel=True)


def test_splits_fill_whole_waves_of_the_programs_an_sm_holds(monkeypatch):
    """The Hopper launches' split count: at NVIDIA's ranking shape (2 candidate tiles and 1 history tile of 128
    rows, 4 heads, head dim 256: 24 programs a split; 132 SMs holding 2 each) 11 splits, one full wave (16 would
    make 384 programs: two waves); no split where one already fills the SMs and keys are few; at most as many as
    MIN_SPLIT_KEYS allows; 1 off CUDA. ``split_layout`` trims a target as its own choice."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from relaygr_engine.kernels import _common, _split

    monkeypatch.setattr(_common, "_num_cores", lambda kind, index: 132)
    cuda = torch.device("cuda", 0)
    assert HL.pick_splits(cuda, 256, 24, 3968 + 128) == 11
    assert HL.pick_splits(cuda, 256, 264, 4096) == 1                             # one split fills every slot
    assert HL.pick_splits(cuda, 64, 24, 600) == 2                                # 600 // MIN_SPLIT_KEYS
    assert HL.pick_splits(cuda, 128, 24, 100) == 1 and HL.pick_splits(torch.device("cpu"), 256, 24, 4096) == 1
    assert _split.split_layout(cuda, 12, 4096, target=11) == (11, 384)
    assert _split.split_layout(cuda, 12, 4000, target=15) == (13, 320)           # 15 x 320 would leave 2 empty
    args, _ = make_problem([(300, 20, 200), (64, 1, 3)], 64, 4, 64)
    meta = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")
    plan = pa.plan_prefix_attention(**{n: args[n] for n in meta}, kv_cache=args["kv_cache"], block_m=64)
    # 64-row tiles: candidate 4 + 1, history 1 + 1, one program each per head (takes 64 and 128 only)
    assert HL.programs_per_split(plan, 4) == 4 * (plan.cand_tiles.shape[1] + plan.hist_tiles.shape[1]) == 28
    monkeypatch.setattr(HL, "takes", lambda block_m: False)
    assert HL.programs_per_split(plan, 4) == 0


@needs_interpreter
def test_a_failing_hopper_launch_turns_it_off_and_the_call_reruns_portable(monkeypatch, caplog):
    """Asked for by the environment, a Hopper launch that raises (e.g. its compile) logs once, turns the kernel off
    for the process, and the call's result is the portable kernel's; later calls do not try it (why_not says why);
    asked for with ``hopper_kernel=True``, the call raises LaunchError, chained to the cause."""
    args, bias = make_problem(USERS[:4], 16, 2, 32, seed=7)
    kw = attention_kwargs("hstu", bias, 32)
    plain = pa.prefix_attention(**args, **kw, block_m=16, block_n=16, splits=2)
    calls, real_launch = [], HL.launch

    def broken(*a, **k):
        calls.append(1)
        try:
            raise RuntimeError("no such instruction")
        except RuntimeError as err:
            HL.fail(err)

    stand_in(monkeypatch, launch=broken)
    monkeypatch.setattr(HL, "why_not", lambda **kw: HL._failed and f"it failed earlier ({HL._failed})")
    monkeypatch.setattr(HL, "_failed", None)
    monkeypatch.setenv(HL.ENV, "1")
    _warn.forget()
    with caplog.at_level(logging.WARNING, logger=HL.log.name):
        out = pa.prefix_attention(**args, **kw, block_m=16, block_n=16, splits=2)
        again = pa.prefix_attention(**args, **kw, block_m=16, block_n=16, splits=2)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)
    torch.testing.assert_close(again, plain, atol=0, rtol=0)
    assert len(calls) == 1 and "RuntimeError: no such instruction" in HL._failed
    assert [r.getMessage().count("off for this process") for r in caplog.records] == [1]
    # a benchmark's RESULT says its figures are the portable kernel's (bench rank, profile_rank.py)
    from relaygr_engine.bench.autotune_report import hopper_fields

    launches = HL.state()["launches"]
    assert hopper_fields() == {"hopper_launches": launches, "hopper_failed": 1}
    monkeypatch.setattr(HL, "_failed", None)  # (on again, asked for explicitly)
    with pytest.raises(HL.LaunchError, match="no such instruction") as info:
        pa.prefix_attention(**args, **kw, block_m=16, block_n=16, splits=2, hopper_kernel=True)
    assert isinstance(info.value.__cause__, RuntimeError)
    # the real launch: whatever its body raises (here the descriptor, before any compile) is such a failure
    monkeypatch.setattr(HL, "_failed", None)

    def bad_descriptor(*a, **k):
        raise ValueError("strides must be 16-byte aligned")

    monkeypatch.setattr(HL, "_launch", bad_descriptor)
    with pytest.raises(HL.LaunchError, match="ValueError: strides must be 16-byte aligned"):
        real_launch(*[None] * 13, hstu=True, page_size=16, num_splits=1, split_len=64, scale=1.0, inv_norm=1.0)
    assert HL._failed == "ValueError: strides must be 16-byte aligned"
    assert HL.state() == {"launches": launches, "failed": HL._failed}  # (a launch that raised is not counted)


def test_hopper_kernel_is_asked_for_by_flag_or_environment(monkeypatch):
    monkeypatch.delenv(HL.ENV, raising=False)
    assert not HL.requested(None) and HL.requested(True) and not HL.requested(False)
    for on in ("1", "true", "ON", "yes"):
        monkeypatch.setenv(HL.ENV, on)
        assert HL.requested(None) and not HL.requested(False)
    monkeypatch.setenv(HL.ENV, "0")
    assert not HL.requested(None)
    with pytest.raises(ValueError, match="hopper_kernel must be a bool or None, got 'yes'"):
        HL.requested("yes")


def test_per_batch_integers_are_not_specialised():
    """A new ranking length (rows, splits, keys per split) compiles no new binary of the Hopper kernel."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from relaygr_engine.kernels import _hopper as H

    assert {p.name for p in H.hopper_kernel.params if p.do_not_specialize} == {"num_splits", "split_len", "total_q"}


def test_tile_heights_taken_are_one_or_two_of_the_kernels_programs():
    """``takes`` (which spells the heights so that no Gluon is imported on every call) agrees with the kernel's rows
    a program, and the split rules share one bound on the split count."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from relaygr_engine.kernels import _hopper as H
    from relaygr_engine.kernels import _split

    sub_m = H.SUB_M.value
    assert [m for m in (16, 32, sub_m, 2 * sub_m, 4 * sub_m) if HL.takes(m)] == [sub_m, 2 * sub_m]
    assert _split.most_splits(0) == 1 and _split.most_splits(10 ** 9) == _split.MAX_SPLITS
    assert _split.most_splits(3 * _split.MIN_SPLIT_KEYS + 1) == 3


def test_why_not_names_what_keeps_a_call_off_the_hopper_kernel(monkeypatch):
    ok = dict(device=torch.device("cuda"), dtype=torch.bfloat16, quantized=False, head_dim=256,
              page_size=64, block_m=128, aligned=True, num_pages=4, persistent=False, value_splits=None,
              fixed_block_n=None)
    assert "CUDA device" in HL.why_not(**dict(ok, device=torch.device("cpu")))
    monkeypatch.setattr(HL, "capability", lambda device: (10, 0))
    assert "sm_90" in HL.why_not(**ok)
    monkeypatch.setattr(HL, "capability", lambda device: (9, 0))
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    assert HL.why_not(**ok) is None
    monkeypatch.setattr(HL, "_failed", "RuntimeError: boom")
    assert HL.why_not(**ok) == "it failed earlier in this process (RuntimeError: boom)"
    monkeypatch.setattr(HL, "_failed", None)
    for change, words in ((dict(dtype=torch.float32), "bf16 or fp16"),
                          (dict(quantized=True), "model's dtype"), (dict(head_dim=96), "head dim"),
                          (dict(page_size=48), "page_size"), (dict(page_size=4), "divisor >= 8"),
                          (dict(block_m=32), "64 or 128 rows"),
                          (dict(persistent=True), "persistent"), (dict(value_splits=2), "value splits"),
                          (dict(fixed_block_n=32), "block_n")):
        assert words in HL.why_not(**dict(ok, **change)), change


@needs_interpreter
def test_asked_where_it_cannot_run_it_refuses_or_steps_aside(monkeypatch):
    """``hopper_kernel=True`` on the CPU: ``ValueError`` with the reason, before anything runs; the environment
    variable there: the portable kernel alone, the same result as without it."""
    args, bias = make_problem(USERS[:3], 16, 2, 32, seed=5)
    kw = attention_kwargs("hstu", bias, 32)
    with pytest.raises(ValueError, match="hopper_kernel=True cannot run here: needs a CUDA device"):
        pa.prefix_attention(**args, **kw, hopper_kernel=True)
    plain = pa.prefix_attention(**args, **kw)
    monkeypatch.setenv(HL.ENV, "1")
    torch.testing.assert_close(pa.prefix_attention(**args, **kw), plain, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- offline compile
def test_compiles_for_sm90_spill_free_several_programs_per_sm(tmp_path):
    """Static, no GPU (``python -m benchmarks.tools.ptxas --hopper``, in its own process: the interpreter this one runs
    in would capture the compile): each head dim's config compiles for sm_90 with no spill and no local access in its
    key loop, for HSTU's candidate and history tiles and softmax's, its registers (8 warps a program) and shared memory
    fit three programs on an SM at head dim 64 and two at 128 and 256, its key loop issues wgmma and one special
    function per score (HSTU's tanh; softmax's exp2, and one a row for the max's correction), its K/V arrive
    through TMA, and both biases add under 15% to the instructions of either HSTU tile kind; with 16-token pages
    (a key block over several) the same, one copy of K and of V per page."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "hopper.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tools.ptxas", "--hopper", "--json",
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())["result"]
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT hopper_spilling=0 hopper_loop_local=0")
    assert (got["hopper_spilling"], got["hopper_loop_local"]) == (0, 0)
    for (d, per_sm), at in itertools.product(((64, 3), (128, 2), (256, 2)), ("d", "hist_d", "softmax_d")):
        assert got[f"hopper_programs_per_sm_{at}{d}"] >= per_sm
        assert got[f"hopper_loop_mma_{at}{d}"] > 0 and got[f"hopper_tma_copies_{at}{d}"] > 0
        if at == "softmax_d":  # one exp2 a score, and one a row for the running max's correction (2 rows a thread)
            bn = 64 if d < 256 else 32
            assert got[f"hopper_mufu_per_score_{at}{d}"] == pytest.approx(1.0 + 2 / (64 * bn / 128), abs=1e-3)
        else:
            assert got[f"hopper_mufu_per_score_{at}{d}"] == 1.0
    assert 1.0 < got["hopper_bias_instr_ratio_cand"] < 1.15 and 1.0 < got["hopper_bias_instr_ratio_hist"] < 1.15
    for d in (64, 128, 256):  # softmax's rescale is a branch its usual path skips; HSTU's loop has none
        assert got[f"hopper_loop_usual_per_score_softmax_d{d}"] < got[f"hopper_loop_instr_per_score_softmax_d{d}"]
        assert got[f"hopper_loop_usual_per_score_d{d}"] == got[f"hopper_loop_instr_per_score_d{d}"]
    # 16-token pages (the engine's default): a key block over several pages, a copy of K and of V per page
    small = tmp_path / "hopper16.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tools.ptxas", "--hopper", "--page-size",
                           "16", "--json", str(small)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    paged = json.loads(small.read_text())["result"]
    assert (paged["hopper_spilling"], paged["hopper_loop_local"]) == (0, 0)
    for d, at in itertools.product((64, 128, 256), ("d", "hist_d", "softmax_d")):  # 64/16 or 32/16 pieces each
        assert paged[f"hopper_tma_copies_{at}{d}"] == got[f"hopper_tma_copies_{at}{d}"] * (4 if d < 256 else 2)


def _static_rows(script: str) -> list:
    """Run a static-compile ``script`` in its own process, without the interpreter (which would capture the
    compile); the JSON lines it prints."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


_LAUNCH_CHECK = """
import itertools, json
from benchmarks.tools.ptxas_hopper import compile_hopper, compile_launch
for d, page, kind in itertools.product((64, 128, 256), (64, 16), ("cand", "hist", "softmax")):
    hstu, cand = kind != "softmax", kind != "hist"
    kernel, grid = compile_launch(d, hstu=hstu, cand=cand, page_size=page, num_splits=3)
    static = compile_hopper(d, hstu=hstu, cand=cand, page_size=page)
    print(json.dumps(dict(d=d, page=page, kind=kind, grid=list(grid),
                          same=kernel.asm["cubin"] == static.asm["cubin"])))
"""


def test_a_launch_compiles_exactly_what_the_static_report_describes():
    """No GPU: ``_hopper_launch.launch``, called as a ranking's layer calls it (host tensors, a driver standing in
    for sm_90 whose launches only compile), asks for a program per 64 rows, head and split, and compiles a binary
    identical to the one ``bench ptxas --hopper`` reports on (``compile_hopper``), at each head dim, for 64- and
    16-token pages, HSTU's candidate and history tiles and softmax's: the launch's arguments agree with the
    kernel's signature and specialise as the report assumes. (In its own process, without the interpreter.)"""
    rows = _static_rows(_LAUNCH_CHECK)
    assert len(rows) == 18
    for r in rows:
        assert r["grid"] == [2 * 2 * 4 * 3], r  # 2 tiles of 128 rows (2 programs each) x 4 heads x 3 splits
        assert r["same"], r


def test_a_loops_usual_path_leaves_out_what_a_forward_branch_inside_it_skips():
    """``sass._skippable``: instructions a predicated forward branch jumps over inside the loop body; not an
    unconditional one, nor one leaving the loop (a barrier wait's retry placed after it)."""
    from benchmarks.tools.sass import _loops, _skippable

    code = [(0x00, "MOV R0, R1 ;", ".L_x_0", False),
            (0x10, "BRA `(.L_x_9) ;", "", True),         # leaves the loop: skips nothing in it
            (0x20, "BRA `(.L_x_1) ;", "", True),         # skips the next two
            (0x30, "FMUL R2, R2, R3 ;", "", False),
            (0x40, "FMUL R4, R4, R3 ;", "", False),
            (0x50, "BRA `(.L_x_2) ;", ".L_x_1", False),  # unconditional: not counted
            (0x60, "FADD R5, R5, R6 ;", "", False),
            (0x70, "BRA `(.L_x_0) ;", ".L_x_2", True),   # the loop's back edge
            (0x80, "EXIT ;", ".L_x_9", False)]
    assert _loops(code) == [(0x00, 0x70)]
    assert _skippable(code, 0x00, 0x70) == 2


# ---------------------------------------------------------------------------------------------- on a GPU
# (the kernel against its twin first: the quickest to say which part is wrong)
@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [64, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hopper_kernel_writes_what_its_torch_twin_writes_bf16_cuda(head_dim, page_size):
    """On sm_90: the kernel alone against ``emulate`` on the same split partials (3 splits and the portable
    kernel's slot), for HSTU's candidate and history tiles (random bias rows) and softmax's candidate tiles, key
    blocks within a page (64 tokens) and over several (16): within bf16 tolerance (softmax's running sum at the
    twin's max within fp32's), and nothing else of the partials touched."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU (Hopper's wgmma)")
    users = [(1000, 17, 300), (0, 40, 5), (129, 0, 64), (300, 3, 1)]
    args, _ = make_problem(users, page_size, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    meta = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")
    plan = pa.plan_prefix_attention(**{n: args[n] for n in meta}, kv_cache=args["kv_cache"])
    kw = dict(page_size=page_size, num_splits=3, split_len=448, scale=head_dim ** -0.5, inv_norm=1 / 64)
    for hstu, cand, tiles, block_m in ((True, True, plan.cand_tiles, plan.block_m),
                                       (True, False, plan.hist_tiles, plan.hist_block_m),
                                       (False, True, plan.cand_tiles, plan.block_m)):
        if not HL.takes(block_m):
            continue
        table = torch.randn(max(len(users), tiles.shape[1] * block_m), 1024 + 128, device="cuda") * 0.25
        ws = torch.randn(4, *args["q"].shape, device="cuda").to(torch.bfloat16)
        ml = torch.randn(4, *args["q"].shape[:2], 2, device="cuda")
        twin, twin_ml = ws.clone(), ml.clone()
        common = (args["kv_cache"], args["kv_indices"], args["kv_indptr"], args["kv_last_page_len"],
                  args["cu_seqlens_q"], args["num_candidates"], tiles, block_m, cand, table if hstu else None)
        launches = HL.state()["launches"]
        HL.launch(args["q"], ws, ml, *common, hstu=hstu, **kw)
        assert HL.state()["launches"] == launches + 1
        HL.emulate(args["q"], twin, twin_ml, *common, hstu=hstu, **kw, halved=True)
        what = f"hstu={hstu} candidate tiles={cand}"
        torch.testing.assert_close(ws.float(), twin.float(), atol=3e-2, rtol=3e-2, msg=what)
        # Softmax's running max may lag the twin's (exact) one by up to 8: the kernel rescales only past that. Its
        # partial (over its own sum) does not depend on it; its sum does, by 2^lag.
        lag = twin_ml[..., 0] - ml[..., 0]
        assert (lag >= -1e-3).all() and (lag <= 8 + 1e-3).all(), what
        torch.testing.assert_close(ml[..., 1] * torch.exp2(-lag), twin_ml[..., 1], atol=1e-3, rtol=1e-3, msg=what)


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim, mode, page_size", [(64, "hstu", 64), (128, "hstu", 64), (256, "hstu", 64),
                                                        (64, "softmax", 64), (128, "softmax", 64),
                                                        (256, "softmax", 64), (128, "hstu", 16)])
def test_hopper_kernel_matches_the_reference_bf16_cuda(head_dim, mode, page_size):
    """On sm_90 (skipped elsewhere): the tiles' full blocks on the Hopper kernel, split or not, eagerly and
    replayed in a CUDA graph, within bf16 tolerance of the reference, HSTU with both biases and softmax, and 16-token
    pages (the engine's default: a key block over several pages)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU (Hopper's wgmma)")
    users = [(1000, 17, 300), (0, 40, 5), (129, 0, 64), (2048, 128, 256), (256, 0, 32)]
    args, bias = make_problem(users, page_size, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(mode, bias, head_dim)
    ref = prefix_attention_ref(**{n: (t.float() if t.is_floating_point() else t) for n, t in args.items()}, **kw)
    for splits in (None, 1, 5):
        out = pa.prefix_attention(**args, **kw, splits=splits, hopper_kernel=True)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2, msg=f"splits={splits}")
    # A capture reads nothing back from the device: the schedule is planned before it, as a forward plans once for
    # its layers (and the plan's first call, eager, builds what it keeps for the others).
    meta = ("cu_seqlens_q", "num_candidates", "kv_indptr", "kv_indices", "kv_last_page_len")
    plan = pa.plan_prefix_attention(**{n: args[n] for n in meta}, kv_cache=args["kv_cache"])
    eager = pa.prefix_attention(**args, **kw, plan=plan, hopper_kernel=True)
    torch.testing.assert_close(eager.float(), ref, atol=3e-2, rtol=3e-2, msg="planned")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.prefix_attention(**args, **kw, plan=plan, hopper_kernel=True)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
