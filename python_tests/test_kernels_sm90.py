"""The kernels compiled for sm_90 (H100/H200) without a GPU: every kernel lowers to PTX and a cubin in Triton's
portable subset, ``python -m benchmarks.tools.ptxas`` reports registers, spills, shared memory and the SASS instruction
mix, and the CUDA autotune set keeps the configs that report found spill-free. The compiles run in fresh processes (this
one may hold triton in interpreter mode)."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")


# ------------------------------------------------------------------------------------------------ CUDA compile
COMPILE_FOR_SM90 = r"""
import warnings
warnings.filterwarnings("ignore")
from benchmarks.tools.ptxas import compile_attention, compile_kernel, ptxas_report
from relaygr_engine.kernels import _bias_table, _merge_kernel, kv_pack, kv_write, prefix_attention as p

def check(k, name):
    ttir = k.asm["ttir"]
    assert "make_tensor_ptr" not in ttir and "tt.advance" not in ttir and "descriptor" not in ttir, name
    assert "cubin" in k.asm and k.asm["ptx"], name
    return k

for persistent in (False, True):
    k = check(compile_attention("softmax", 128, 128, 64, num_warps=8, num_stages=2, persistent=persistent), "softmax")
    assert "wgmma" in k.asm["ptx"]   # Hopper tensor cores
    assert "cp.async" in k.asm["ptx"]  # K/V blocks copied asynchronously into shared memory (pipelined)
    for cand in (False, True):
        k = check(compile_attention("hstu", 128, 64, 32, num_warps=8, num_stages=3, persistent=persistent,
                                    cand_tiles=cand), "hstu")
        assert "tanh.approx.f32" in k.asm["ptx"]  # bf16: SiLU through one approximate tanh
    check(compile_attention("hstu", 128, 64, 32, num_warps=8, num_stages=2, persistent=persistent,
                            cand_tiles=False, hist_table=False), "hstu, history bias in the kernel")
import triton
from benchmarks.tools.sass import instruction_mix
for cand in (False, True):  # the Hopper variant beside it: full key blocks through a tensor descriptor (TMA)
    k = compile_attention("hstu", 256, 128 if cand else 64, 32, num_warps=8, num_stages=3, cand_tiles=cand, tma=True)
    assert "cp.async.bulk.tensor" in k.asm["ptx"] and instruction_mix(k.asm["cubin"])[1].local == 0
    # spill-free with Triton 3.9's ptxas; 3.6's (the GPU machines') spills 20 bytes of the candidate tile outside
    # its key loop (README, "With the GPU machines' Triton")
    assert ptxas_report(k.asm["ptx"])[1] == 0 or (cand and triton.__version__.startswith("3.6."))
k = check(compile_attention("hstu", 48, 64, 32, num_warps=4, num_stages=2, page_size=16, dtype="fp32"), "hstu fp32")
assert "tanh.approx" not in k.asm["ptx"]  # fp32 keeps the exact SiLU
regs, spill_st, spill_ld = ptxas_report(k.asm["ptx"])
assert 0 < regs <= 255 and spill_st >= 0 and spill_ld >= 0
check(compile_kernel(kv_write._kv_write_kernel, dict(kv_ptr="*bf16", k_ptr="*fp32", v_ptr="*fp32", slot_ptr="*i64",
                                                      ts_ptr="*i64", ts_cache_ptr="*i64"),
                     dict(PAGE_SIZE=64, BLOCK_T=16, BLOCK_C=256, HAS_TS=True)), "kv_write")
for index in (0, 1, 2):  # computed; computed with the batch's index stored; from the index
    check(compile_kernel(_bias_table.bias_table_kernel,
                         dict(out_ptr="*fp32", idx_ptr="*i32", scale="fp32", pos_bias_ptr="*fp32",
                              ts_bias_ptr="*fp32", ts_cache_ptr="*i64", ts_q_ptr="*i64", ts_bounds_ptr="*i64",
                              **{n: "*i32" for n in ("kv_indptr_ptr", "kv_indices_ptr", "kv_last_ptr", "cu_q_ptr",
                                                     "num_cand_ptr", "tile_user_ptr", "tile_row_ptr")}),
                         dict(PAGE_SIZE=64, BLOCK=256, BLOCK_M=64, HAS_POS=True, HAS_TS=True, TS_BITS=31, TS_STEPS=0,
                              TS_TABLE=False, TS_ABS=False, INDEX=index, BUCKET_BITS=5 if index else 1)),
          f"bias_table INDEX={index}")
for pack in (True, False):
    check(compile_kernel(kv_pack._page_copy_kernel, dict(cache_ptr="*bf16", buf_ptr="*bf16", page_ids_ptr="*i64"),
                         dict(PAGE_NUMEL=64 * 8 * 128, BLOCK=4096, PACK=pack)), "kv_pack")
for d in (64, 256):  # softmax's split merge
    k = check(compile_kernel(_merge_kernel.merge_kernel, dict(ws_ptr="*bf16", ml_ptr="*fp32", out_ptr="*bf16"),
                             dict(HEAD_DIM=d, BLOCK_D=64, BLOCK_R=16)), "merge")
    assert ptxas_report(k.asm["ptx"])[1] == 0
# per-batch integers are not specialised (a new batch shape must not compile a new binary)
for k, names in ((p._prefix_attention_kernel, {"num_work", "num_programs", "num_splits", "split_len", "total_q"}),
                 (_bias_table.bias_table_kernel, {"num_user_rows", "stride_row"}),
                 (kv_write._kv_write_kernel, {"num_tokens", "num_work", "num_programs"}),
                 (kv_pack._page_copy_kernel, {"num_sel", "num_work", "num_programs"}),
                 (_merge_kernel.merge_kernel, {"num_rows", "num_splits"})):
    assert {q.name for q in k.params if q.do_not_specialize} == names, k
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_cuda_sm90_without_a_gpu():
    """The compiled path (not the interpreter): every kernel lowers to PTX/cubin for sm_90 with bf16 and fp32
    inputs, with no block pointers or tensor descriptors (the portable subset). Runs in a fresh process, since this
    one may hold triton in interpreter mode."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here (e.g. triton-ascend)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_bench_ptxas_reports_registers_spills_and_shared_memory(tmp_path):
    """``python -m benchmarks.tools.ptxas`` compiles a config for sm_90 without a GPU and reports ptxas's resource
    numbers."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here (e.g. triton-ascend)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "benchmarks.tools.ptxas", "--modes", "softmax", "--head-dims", "64",
           "--block-m", "64", "--block-n", "32", "--warps", "4", "--stages", "2", "--split-prefix", "both",
           "--json", str(path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT arch=sm_90 configs=2 "), last
    row, split = json.loads(path.read_text())["rows"]
    # the split-prefix build stores its partial state (a running max and sum per row too): more code, same loop
    assert (row["config"]["split"], split["config"]["split"]) == (False, True)
    assert split["sass"]["instructions"] > row["sass"]["instructions"] and split["loop"]["mma"] == row["loop"]["mma"]
    assert 0 < row["registers"] <= 255 and row["spill_store_bytes"] >= 0
    assert 0 < row["shared_bytes"] <= 232448 and row["fits"]
    from benchmarks.tools.sm_limits import programs_per_sm

    assert row["programs_per_sm"] == programs_per_sm(row["registers"], row["shared_bytes"], 4) >= 1
    assert f"max_programs_per_sm_cand_d64={row['programs_per_sm']}" in last
    bad = subprocess.run(cmd[:5] + ["--modes", "flash"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--modes must name" in bad.stderr
    bad = subprocess.run(cmd[:5] + ["--arch", "75"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--arch must be one of [80, 86, 89, 90, 100, 120], got 75" in bad.stderr


def test_programs_per_sm_takes_the_tightest_of_registers_shared_memory_and_slots():
    """Static occupancy on sm_90: registers are allocated per warp in units of 256 and each block reserves 1 KB of
    shared memory; a block past the per-block limit fits nowhere."""
    from benchmarks.tools.sm_limits import limits, programs_per_sm

    assert programs_per_sm(255, 81920, 4) == 2      # 4 warps x 8192 registers: two blocks fill 64K
    assert programs_per_sm(255, 196608, 8) == 1     # the 128-row head-dim-256 tile
    assert programs_per_sm(130, 49152, 4) == 3      # 136 registers a thread once rounded: 15 warps' worth
    assert programs_per_sm(128, 110 * 1024, 4) == 2  # shared memory: 2 x (110 KB + 1 KB) of 228 KB
    assert programs_per_sm(32, 0, 1) == 32          # block slots
    assert programs_per_sm(32, 0, 4) == 16          # warp slots: 64 / 4
    assert programs_per_sm(64, 232449, 4) == 0      # over the 227 KB a block may opt into
    assert programs_per_sm(255, 0, 4, arch=86) == 2 and limits(86).max_warps == 48
    with pytest.raises(ValueError, match=r"arch must be one of \[80, 86, 89, 90, 100, 120\], got 75"):
        programs_per_sm(32, 0, 4, arch=75)


@pytest.mark.slow
def test_bench_ptxas_defaults_compile_the_launchers_configs_spill_free(tmp_path):
    """``python -m benchmarks.tools.ptxas --defaults``: exactly the configs the CUDA launcher can pick (rows per tile
    kind from ``pick_config``, autotune configs after ``prune_configs``), each spill-free, unsplit and split over the
    keys (the build a ranking's few tiles run), with its SASS instruction mix: tensor cores and asynchronous K/V copies
    in the key loop."""
    import importlib.util
    import subprocess

    from relaygr_engine.kernels import _prefix_config as K

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here (e.g. triton-ascend)")
    from relaygr_engine.kernels._compile import ENV_WORKERS, compile_workers

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (the configs compile on threads: at least two, where a serial run on two cores would default to one)
    env[ENV_WORKERS] = str(max(2, compile_workers()))
    path = tmp_path / "d.json"
    cmd = [sys.executable, "-m", "benchmarks.tools.ptxas", "--defaults", "--head-dims", "64",
           "--split-prefix", "both", "--json", str(path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = dict(kv.split("=", 1) for kv in proc.stdout.strip().splitlines()[-1].split()[1:])
    rows = json.loads(path.read_text())["rows"]
    biased = ("hstu", "hstu-inkernel")
    expect = {(m, c, len(K.prune_configs(K.CUDA_CONFIGS, {}, HEAD_DIM=64, HSTU=m != "softmax", CAND_TILES=c,
                                         HAS_POS=m in biased, HAS_TS=m in biased, HIST_TABLE=m == "hstu",
                                         BLOCK_M=K.CUDA_BLOCK_M if c else K.CUDA_HIST_BLOCK_M, PAGE_SIZE=64,
                                         TMA_READS=K.TMA_EITHER)))
              for m in ("softmax", "hstu", "hstu-inkernel", "hstu-nobias") for c in (False, True)
              if not (m == "hstu-inkernel" and c)}  # candidate tiles always read the bias table
    got = {(r["config"]["mode"], r["config"]["cand_tiles"]) for r in rows}
    assert got == {(m, c) for m, c, _ in expect} and len(rows) == 2 * sum(n for *_, n in expect)
    assert sum(r["config"]["split"] for r in rows) == len(rows) // 2  # each config unsplit and split
    assert int(result["default_configs"]) == 2 * sum(n for m, _, n in expect if m != "hstu-nobias")
    assert result["default_spilling"] == "0" and result["default_loop_spilling"] == "0"
    assert all(r["loop"]["local"] == 0 for r in rows)  # (the report's lcl column: local accesses in the key loop)
    for kind in ("cand", "hist", "hist_inkernel"):
        assert float(result[f"bias_instr_ratio_{kind}"]) > 1.0, kind
    # one special-function instruction per HSTU score (the approximate tanh), where no warp group repeats a score
    assert float(result["mufu_per_score_hstu_cand"]) == 1.0
    assert float(result["mufu_per_score_softmax_cand"]) > 1.0  # its exp2, plus each row's rescale
    hist4 = [r for r in rows if not r["config"]["cand_tiles"] and r["config"]["num_warps"] == 4]
    assert {r["config"]["tma"] for r in rows} == {False, True}  # pointer and tensor-descriptor page reads
    assert hist4 and all(r["loop"]["special"] * 128 * r["config"]["m_splits"]
                         == r["config"]["block_m"] * r["config"]["block_n"]
                         for r in hist4 if r["config"]["mode"].startswith("hstu"))
    # reading the bias table costs a history tile less than computing it
    assert float(result["bias_loop_ratio_hist"]) < float(result["bias_loop_ratio_hist_inkernel"])
    for r in rows:
        assert r["config"]["block_m"] == (K.CUDA_BLOCK_M if r["config"]["cand_tiles"] else K.CUDA_HIST_BLOCK_M)
        assert r["spill_store_bytes"] == 0 and r["fits"] and r["loop"]["mma"] > 0 and r["loop"]["async_copies"] > 0


BUILD_ON_THREADS = r"""
import json, sys
from dataclasses import asdict
from benchmarks.tools.ptxas import Config, build_all

grid = [Config("softmax", 64, True, 128, 32, 8, 2), Config("hstu", 64, False, 64, 64, 4, 3, tma=True),
        Config("hstu-nobias", 128, True, 128, 64, 8, 2, split=True)]
rows = [[{k: v for k, v in asdict(b).items() if k != "compile_s"} for b in build_all(grid, workers=w)]
        for w in (0, 3)]
json.dump(rows, sys.stdout)
"""


def test_bench_ptxas_builds_on_threads_as_one_after_the_other():
    """``bench ptxas`` compiles its configs on threads (``build_all``): the same reports, in the grid's order, as
    compiled one after the other."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", BUILD_ON_THREADS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    serial, threaded = json.loads(proc.stdout)
    assert serial == threaded and len(serial) == 3
    assert [(r["config"]["mode"], r["config"]["head_dim"]) for r in threaded] == [
        ("softmax", 64), ("hstu", 64), ("hstu-nobias", 128)]


def test_prune_configs_keeps_the_rules_the_static_report_found():
    """The CUDA autotune set per variant (read off ``python -m benchmarks.tools.ptxas --defaults``): candidate tiles on
    8 warps; history tiles of 64 rows also on 4 (one warp group: no score computed twice) up to head dim 128; head dim
    256 keeps 32-key blocks only; there biased HSTU candidate tiles keep 3 stages and history tiles computing their
    bias in the kernel 2 (reading it from the table, both); head dim 64 keeps every config of the space (pointer
    reads: on 8 warps 32-key blocks at 2 and 3 stages and 64-key blocks at 3; on one warp group 32-key blocks at 2
    stages and 64-key blocks at 3, or, a 128-row tile as two programs, 32-key blocks at 2 and 3). Value columns
    split in two are offered above head dim 128 (or where asked for, then alone): on 8 warps 32-key blocks, and
    64-key blocks at 2 stages except for 128-row history tiles computing their bias (and 64-row ones with a split
    prefix); on 4 warps 64 rows a program, 32-key blocks, 2 stages (a 128-row tile as two such programs; not for
    history tiles computing their bias with a split prefix). No config caps the registers."""
    from relaygr_engine.kernels import _prefix_config as K

    def kept(warps=8, splits=1, rows=1, **meta):
        return sorted((c.kwargs["BLOCK_N"], c.num_stages) for c in K.prune_configs(K.CUDA_CONFIGS, {}, **meta)
                      if c.num_warps == warps and c.kwargs["V_SPLITS"] == splits and c.kwargs["M_SPLITS"] == rows)

    eight, group, halves = [(32, 2), (32, 3), (64, 3)], [(32, 2), (64, 3)], [(32, 2), (32, 3)]  # the space's
    assert kept(HEAD_DIM=64, HSTU=True, CAND_TILES=True, HAS_POS=True, HAS_TS=True) == eight
    # one warp group per 64 rows: a 64-row candidate tile whole, a 128-row one as two programs; never above 128
    assert kept(4, HEAD_DIM=64, HSTU=True, CAND_TILES=True, HAS_POS=True, HAS_TS=True) == group
    for d in (64, 128):
        assert kept(4, rows=2, HEAD_DIM=d, HSTU=True, CAND_TILES=True, HAS_POS=True, BLOCK_M=128) == halves
        assert kept(4, HEAD_DIM=d, HSTU=True, CAND_TILES=True, HAS_POS=True, BLOCK_M=128) == []
        assert kept(4, HEAD_DIM=d, HSTU=True, CAND_TILES=True, HAS_POS=True, BLOCK_M=32) == []
    assert kept(4, rows=2, HEAD_DIM=256, HSTU=True, CAND_TILES=True, HAS_POS=True, BLOCK_M=128) == []
    assert kept(HEAD_DIM=256, HSTU=True, CAND_TILES=True, HAS_POS=True, HAS_TS=True) == [(32, 3)]
    assert kept(HEAD_DIM=256, HSTU=True, CAND_TILES=True) == [(32, 2), (32, 3)]
    assert kept(HEAD_DIM=256, HSTU=True, CAND_TILES=False, HAS_TS=True) == [(32, 2)]
    assert kept(HEAD_DIM=256, HSTU=True, CAND_TILES=False, HAS_TS=True, HIST_TABLE=True) == [(32, 2), (32, 3)]
    assert kept(4, HEAD_DIM=256, HSTU=True, CAND_TILES=False, HAS_TS=True, HIST_TABLE=True) == []
    # ... but a split prefix's 128-row history tiles as two 4-warp programs (spill-free with Triton 3.6 and 3.9):
    # reading the bias table or without one, 32-key blocks, pages in the model's dtype
    wide = dict(HEAD_DIM=256, CAND_TILES=False, BLOCK_M=128, SPLIT=True)
    for meta in (dict(HSTU=True, HAS_TS=True, HIST_TABLE=True), dict(HSTU=True), dict(HSTU=False)):
        assert kept(4, rows=2, **wide, **meta) == [(32, 2), (32, 3)], meta
        assert kept(4, rows=2, **dict(wide, SPLIT=False), **meta) == [], meta      # unsplit: they spill
        assert kept(4, rows=2, **wide, **meta, KV8=True) == [], meta              # 8-bit pages: they spill
        assert kept(4, **wide, **meta) == [], meta                                # 128 rows on one warp group
    assert kept(4, rows=2, **wide, HSTU=True, HAS_TS=True) == []                  # computing the bias: they spill
    # and HSTU candidate tiles with a bias: they spill, but not in the key loops (softmax's and unbiased ones do)
    cand = dict(wide, CAND_TILES=True)
    assert kept(4, rows=2, **cand, HSTU=True, HAS_POS=True, HAS_TS=True) == [(32, 2), (32, 3)]
    assert kept(4, rows=2, **dict(cand, SPLIT=False), HSTU=True, HAS_POS=True, HAS_TS=True) == []
    assert kept(4, rows=2, **cand, HSTU=True) == [] == kept(4, rows=2, **cand, HSTU=False)
    for warps, space in ((8, eight), (4, group)):
        assert kept(warps, HEAD_DIM=128, HSTU=True, CAND_TILES=False, HAS_POS=True) == [c for c in space if c[0] == 32]
        assert kept(warps, HEAD_DIM=128, HSTU=True, CAND_TILES=False, HAS_POS=True, HIST_TABLE=True) == space
        assert kept(warps, HEAD_DIM=64, HSTU=False, CAND_TILES=False) == space
    assert kept(4, HEAD_DIM=64, HSTU=False, CAND_TILES=False, BLOCK_M=128) == []  # 128 rows: 8 warps, or two programs
    assert kept(4, rows=2, HEAD_DIM=64, HSTU=False, CAND_TILES=False, BLOCK_M=128) == halves
    assert kept(HEAD_DIM=128, HSTU=True, CAND_TILES=False) == kept(HEAD_DIM=128, HSTU=False, CAND_TILES=False)
    cand256 = dict(HEAD_DIM=256, HSTU=True, CAND_TILES=True, HAS_POS=True, HAS_TS=True)
    assert kept(8, 2, **cand256, BLOCK_M=128) == [(32, 2), (32, 3), (64, 2)]
    assert kept(4, 2, **cand256, BLOCK_M=128) == [] and kept(4, 2, **cand256, BLOCK_M=64) == [(32, 2)]
    assert kept(4, 2, rows=2, **cand256, BLOCK_M=128) == [(32, 2)]  # two programs of 64 rows
    assert kept(4, 2, rows=2, **cand256, BLOCK_M=64) == [] and kept(4, 2, **cand256, BLOCK_M=32) == [(32, 2)]
    assert all(c.kwargs["M_SPLITS"] == 1 for c in K.CUDA_CONFIGS if c.num_warps == K.CUDA_NUM_WARPS)
    hist256 = dict(HEAD_DIM=256, HSTU=True, CAND_TILES=False, HAS_TS=True)
    assert kept(8, 2, **hist256, BLOCK_M=128) == [(32, 2), (32, 3)]
    assert kept(8, 2, **hist256, BLOCK_M=64) == [(32, 2), (32, 3), (64, 2)]
    assert kept(4, 2, **hist256, BLOCK_M=64) == [(32, 2)]
    # computing the bias with the prefix split (the partial state stored): 32-key blocks on 8 warps only
    assert kept(8, 2, **hist256, BLOCK_M=64, SPLIT=True) == [(32, 2), (32, 3)]
    assert kept(4, 2, **hist256, BLOCK_M=64, SPLIT=True) == []
    assert kept(8, 2, **hist256, BLOCK_M=128, HIST_TABLE=True) == [(32, 2), (32, 3), (64, 2)]
    assert kept(8, 2, **hist256, BLOCK_M=128, HIST_TABLE=True, SPLIT=True) == [(32, 2), (32, 3), (64, 2)]
    for warps in (8, 4):
        assert kept(warps, 2, HEAD_DIM=128, HSTU=False, CAND_TILES=True, BLOCK_M=64) == []
    # asked for: only those, at any head dim
    assert kept(8, 2, HEAD_DIM=64, HSTU=False, CAND_TILES=True, V_SPLITS_PICK=2) == [(32, 2), (32, 3), (64, 2)]
    assert kept(8, 1, HEAD_DIM=64, HSTU=False, CAND_TILES=True, V_SPLITS_PICK=2) == []
    assert kept(8, 2, **cand256, V_SPLITS_PICK=1) == [] and kept(8, 1, **cand256, V_SPLITS_PICK=1) == [(32, 3)]
    assert all(c.maxnreg is None for c in K.CUDA_CONFIGS)


def test_prune_configs_offers_tensor_descriptor_reads_as_the_launch_allows():
    """``TMA_READS``: off keeps the pointer configs only, only keeps the tensor-descriptor ones, either keeps both,
    where a key block lies in one page; a config the space holds with both page reads is kept with both or with
    neither (same rules: they compile alike)."""
    from relaygr_engine.kernels import _prefix_config as K

    def kept(reads, page_size=64, splits=1, **meta):
        meta = {**dict(HEAD_DIM=128, HSTU=True, CAND_TILES=False, HAS_POS=True, HIST_TABLE=True), **meta}
        return sorted((c.kwargs["TMA"], c.num_warps, c.kwargs["M_SPLITS"], c.kwargs["BLOCK_N"], c.num_stages)
                      for c in K.prune_configs(K.CUDA_CONFIGS, {}, PAGE_SIZE=page_size, TMA_READS=reads, **meta)
                      if c.kwargs["V_SPLITS"] == splits)

    space = {(c.kwargs["TMA"], c.num_warps, c.kwargs["M_SPLITS"], c.kwargs["BLOCK_N"], c.num_stages)
             for c in K.CUDA_CONFIGS}
    both = {k[1:] for k in space if k[0]} & {k[1:] for k in space if not k[0]}  # (held with either page read)
    for meta in (dict(), dict(HEAD_DIM=256), dict(HEAD_DIM=64, CAND_TILES=True, BLOCK_M=128)):
        pointers, tma = kept(K.TMA_OFF, **meta), kept(K.TMA_ONLY, **meta)
        assert pointers and tma and not any(t for t, *_ in pointers) and all(t for t, *_ in tma), meta
        assert kept(K.TMA_EITHER, **meta) == sorted(pointers + tma), meta
        assert {c[1:] for c in pointers} & both == {c[1:] for c in tma} & both != set(), meta
    pointers, tma = kept(K.TMA_OFF), kept(K.TMA_ONLY)
    assert kept(K.TMA_EITHER, page_size=32) == sorted(pointers + [c for c in tma if c[3] == 32]) != pointers + tma
    # a value split reads through pointers: offered with either, never with descriptors only
    assert kept(K.TMA_EITHER, HEAD_DIM=256, splits=2) == kept(K.TMA_OFF, HEAD_DIM=256, splits=2) != []
    assert kept(K.TMA_ONLY, HEAD_DIM=256, splits=2) == []


def test_history_tiles_take_128_rows_above_head_dim_128_while_the_bias_table_fits():
    """Above head dim 128 a 64-row history tile on 8 warps computes every score twice and one on 4 warps spills,
    so history tiles take 128 rows (spill-free reading HSTU's bias from the table), falling back to 64 in a batch
    whose table rows would pass the budget (they compute the bias in the kernel, which spills at 128 rows)."""
    import torch

    from relaygr_engine.kernels import _prefix_config as K

    cuda = torch.device("cuda")
    cfg = K.pick_config(cuda, torch.bfloat16, 256)
    assert (cfg.block_m, cfg.hist_block_m, cfg.hist_fallback_m) == (128, 128, 64)
    small = K.pick_config(cuda, torch.bfloat16, 128)
    assert (small.hist_block_m, small.hist_fallback_m) == (64, None)
    mine = K.pick_config(cuda, torch.bfloat16, 256, block_m=64)  # a caller's tile height is kept
    assert (mine.hist_block_m, mine.hist_fallback_m) == (64, None)

    def tiles(users, rows):
        return lambda m: users * -(-rows // m)

    # a ranking at NVIDIA's shape: 4 users x 128 new rows over ~4.4K keys, 2.3 MB of table rows per user
    assert K.history_tile_rows(cfg, tiles(4, 128), 4096 + 384) == 128
    # full inference of 4 users x 8192 tokens: 256 tiles x 128 rows x ~8.3K keys x 4 B, far past 32 MiB
    assert K.history_tile_rows(cfg, tiles(4, 8192), 8192) == 64
    assert K.history_tile_rows(small, tiles(4, 8192), 8192) == 64  # no fallback: always its height


def test_eight_bit_pages_take_16_key_blocks_where_32_spill():
    """8-bit pages above head dim 128 with the bias computed in the kernel (history tiles past the table's budget):
    only the 16-key config, the one whose compile does not spill there; no other variant is offered it."""
    from relaygr_engine.kernels import _prefix_config as K

    def kept(**meta):
        return [(c.num_warps, c.kwargs["BLOCK_N"], c.num_stages)
                for c in K.prune_configs(K.CUDA_CONFIGS, {}, HSTU=True, CAND_TILES=False, HAS_TS=True, **meta)]

    assert kept(HEAD_DIM=256, KV8=True) == [(8, 16, 2)]
    assert (8, 16, 2) not in kept(HEAD_DIM=256) + kept(HEAD_DIM=128, KV8=True) + kept(HEAD_DIM=256, KV8=True,
                                                                                     HIST_TABLE=True)
    assert K.CUDA_MAX_BLOCK_N == 64 and K.TMA_MIN_BLOCK_N == 32
