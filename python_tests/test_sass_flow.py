"""The SASS data-flow checks of ``python -m benchmarks.tools.ptxas`` (:mod:`relaygr_engine.kernels._sass_flow`): on
hand-written instruction lists, then on the 8-bit prefix kernel's candidate-tile configs the launcher keeps (compiled
for sm_90, no GPU)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from relaygr_engine.kernels import _sass_flow as sass_flow

REPO = pathlib.Path(__file__).resolve().parents[1]  # (the checkout: benchmarks.tools imports from it)


def _defects(monkeypatch, listing: str):
    """:func:`~relaygr_engine.kernels._sass_flow.flow_defects` of ``listing``: one instruction a line, ``ADDR [LABEL:]
    [@P] TEXT`` (addresses in hex)."""
    code = []
    for line in filter(None, map(str.strip, listing.splitlines())):
        addr, _, text = line.partition(" ")
        label = ""
        if text.startswith(".L_x_"):
            label, _, text = text.partition(": ")
        predicated = text.startswith("@")
        code.append((int(addr, 16), text.split(" ", 1)[1] if predicated else text, label, predicated))
    monkeypatch.setattr(sass_flow, "disassemble", lambda cubin: code)
    return [(d.address, d.kind, d.detail.split(":")[0]) for d in sass_flow.flow_defects(b"")]


# The pattern ptxas 12.8 made of the 8-bit candidate tiles at 3 stages: a descriptor derived from UR10, which only
# the block a predicated branch jumps over writes.
SKIPPED_WRITE = """
00 S2UR UR5, SR_CTAID.X ;
10 ULDC.64 UR6, c[0x0][0x210] ;
20 ISETP.NE.AND P1, PT, R1, RZ, PT ;
30 @!P1 BRA `(.L_x_0) ;
40 UIADD3 UR10, UR5, 0x2, URZ ;
50 .L_x_0: UIADD3.64 UR6, UR10, 0x7e, URZ ;
60 HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR4].tnspB, R24, gsb0 ;
70 WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
80 EXIT ;
"""


def test_a_uniform_register_written_on_one_path_only_is_undefined(monkeypatch):
    assert _defects(monkeypatch, SKIPPED_WRITE) == [(0x50, "undefined", "UR10")]
    # written before the branch: defined on every path (and a 64-bit write defines both halves)
    hoisted = SKIPPED_WRITE.replace("40 UIADD3 UR10, UR5, 0x2, URZ ;", "").replace(
        "20 ISETP", "18 UIMAD.WIDE UR10, UR5, 0x2, URZ ;\n20 ISETP")
    assert _defects(monkeypatch, hoisted) == []


def test_registers_of_an_in_flight_wgmma_touched_before_its_wait(monkeypatch):
    listing = """
    00 ULDC.64 UR6, c[0x0][0x210] ;
    10 .L_x_1: HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR4].tnspB, R24, gsb0 ;
    20 MOV R90, RZ ;
    30 FADD R100, R30, R1 ;
    40 WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    50 MOV R88, RZ ;
    60 FADD R100, R30, R1 ;
    70 EXIT ;
    """
    # the A operand (R88..R91) written and the accumulator (R24..R55) read before the wait; after it, nothing
    assert _defects(monkeypatch, listing) == [(0x20, "in_flight", "R90"), (0x30, "in_flight", "R30")]
    # across a loop's back edge: the next trip writes the accumulator before the wait
    loop = """
    00 ULDC.64 UR6, c[0x0][0x210] ;
    10 .L_x_1: MOV R24, RZ ;
    20 WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    30 HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR4].tnspB, R24, gsb0 ;
    40 @P0 BRA `(.L_x_1) ;
    50 WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    60 EXIT ;
    """
    assert _defects(monkeypatch, loop) == [(0x10, "in_flight", "R24")]


class _Compiled:
    def __init__(self, cubin):
        self.asm = {"cubin": cubin}


class _Kernel:
    """Stands in for a ``@triton.jit`` function: ``warmup`` returns a "compiled kernel" whose cubin names the
    config (``BLOCK_N``), or raises for a config that does not compile."""

    __name__ = "fake_kernel"

    def warmup(self, *args, grid, BLOCK_N, **kwargs):
        if BLOCK_N == 16:
            raise RuntimeError("does not compile")
        return _Compiled(f"n{BLOCK_N}".encode())


def test_the_autotuner_drops_configs_whose_code_fails_the_flow_check(monkeypatch, caplog):
    """:func:`relaygr_engine.kernels._compile.flow_clean` (what the autotuner runs on 8-bit pages' configs before
    timing them): configs with a defect dropped and logged; one that does not compile kept for the autotuner to
    report; all of them where none is clean or the check cannot run."""
    import triton

    from relaygr_engine import _warn
    from relaygr_engine.kernels import _compile

    _warn.forget()
    configs = [triton.Config({"BLOCK_N": n}) for n in (16, 32, 64)]
    bad = {b"n64"}
    defect = sass_flow.Defect(0x50, "UIADD3.64 UR6, UR10, 0x7e, URZ", "undefined", "UR10")
    monkeypatch.setattr(sass_flow, "flow_defects", lambda cubin: [defect] if cubin in bad else [])
    with caplog.at_level("WARNING", logger="relaygr_engine"):
        kept = _compile.flow_clean(_Kernel(), configs, {"x": 1}, {"grid": (1,), "warmup": False})
    assert [c.kwargs["BLOCK_N"] for c in kept] == [16, 32]
    assert any("BLOCK_N: 64" in r.getMessage() and "UR10" in r.getMessage() for r in caplog.records)
    bad = {b"n32", b"n64"}
    assert [c.kwargs["BLOCK_N"] for c in _compile.flow_clean(_Kernel(), configs[1:], {}, {"grid": (1,)})] == [32, 64]
    monkeypatch.setattr(sass_flow, "flow_defects", lambda cubin: (_ for _ in ()).throw(RuntimeError("no nvdisasm")))
    assert _compile.flow_clean(_Kernel(), configs, {}, {"grid": (1,)}) == configs


KV8_CONFIGS = r"""
import warnings
warnings.filterwarnings("ignore")
from benchmarks.tools.ptxas import compile_attention
from relaygr_engine.kernels._sass_flow import flow_defects
from relaygr_engine.kernels import _prefix_config as K

for mode in ("softmax", "hstu"):
    for split in (False, True):
        kept = K.prune_configs(K.CUDA_CONFIGS, {}, HEAD_DIM=128, BLOCK_M=128, HSTU=mode == "hstu", CAND_TILES=True,
                               HAS_POS=False, HAS_TS=False, PAGE_SIZE=64, KV8=True, SPLIT=split, TMA_READS=K.TMA_OFF)
        clean = []
        for c in kept:
            k = compile_attention(mode, 128, 128, c.kwargs["BLOCK_N"], num_warps=c.num_warps,
                                  num_stages=c.num_stages, bias=False, kv_dtype="int8", m_splits=c.kwargs["M_SPLITS"],
                                  split=split)
            if not flow_defects(k.asm["cubin"]):
                clean.append(c)
        print(mode, split, len(kept), len(clean))
        assert clean, (mode, split)
print("ok")
"""


@pytest.mark.slow
def test_the_8bit_candidate_tiles_keep_configs_that_pass_the_flow_check():
    """The CUDA 8-bit test's variants (candidate tiles, head dim 128, int8 pages, both modes, unsplit and split):
    configs the launcher keeps compile for sm_90 and at least one passes the flow check, so the autotuner has one
    to run (with the GPU machines' Triton 3.6 and its ptxas 12.8 the 3-stage ones fail it:
    ``benchmarks/results/static-kv8-2026-11-28``)."""
    pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", KV8_CONFIGS], env=env, capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
