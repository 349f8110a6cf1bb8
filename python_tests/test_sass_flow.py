"""The SASS data-flow checks of ``relaygr bench ptxas`` (:mod:`relaygr_engine.bench.sass_flow`), on hand-written
instruction lists."""
from __future__ import annotations

import pytest

from relaygr_engine.bench import sass_flow


def _defects(monkeypatch, listing: str):
    """:func:`~relaygr_engine.bench.sass_flow.flow_defects` of ``listing``: one instruction a line, ``ADDR [LABEL:]
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
