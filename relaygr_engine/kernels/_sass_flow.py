"""Static data-flow checks of a compiled kernel's SASS, no GPU: what a miscompiled warp-group MMA reads.

Two defects, found by following the kernel's control flow (branches and their targets, from ``nvdisasm``):

``undefined``
    a uniform register (``URn``) read where some path from the kernel's entry has written none of it. The
    descriptors of a ``wgmma`` (``HGMMA``: the shared-memory address, strides and swizzle of an operand tile) live in
    uniform registers; one read undefined on some path reads whatever the register holds there, so the MMA reads
    an arbitrary shared-memory address (out of range, or in range and wrong).
``in_flight``
    a register of an issued, not yet waited for ``HGMMA`` (its A operand in registers, its accumulator) written, or
    its accumulator read, before the warp group's ``WARPGROUP.DEPBAR.LE gsb0, 0x0``.

Both hold for correct code whatever the data; a report of either is a compiler defect (or a checker's false alarm,
to be read in the SASS). ``python -m benchmarks.tools.ptxas`` counts them per config (its ``flow`` column).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ._sass import _BRANCH, disassemble

__all__ = ["Defect", "flow_defects"]

_UR = re.compile(r"\bUR(\d+)\b")
_R = re.compile(r"(?<![\w.])R(\d+)\b")
_SHAPE = re.compile(r"\.(\d+)x(\d+)x\d+")
_GDESC = re.compile(r"gdesc\[UR(\d+)\]")
# Instructions whose first operand is not a general register they write.
_NO_DEST = ("ST", "STS", "STG", "STL", "RED", "ATOM", "BAR", "BRA", "WARPGROUP", "DEPBAR", "LDGSTS", "FENCE",
            "MEMBAR", "EXIT", "NOP", "LDGDEPBAR", "BSSY", "BSYNC", "WARPSYNC", "UTMALDG", "SYNCS", "ISETP", "FSETP",
            "DSETP", "HSETP2", "PLOP3", "R2UR", "CALL", "RET", "YIELD", "ERRBAR", "CCTL", "HGMMA")


@dataclass(frozen=True)
class Defect:
    """One defect: where (``address`` and ``instruction``), which (``kind``: ``undefined`` or ``in_flight``) and
    what (``detail``: the register, and for ``in_flight`` the HGMMA it belongs to)."""

    address: int
    instruction: str
    kind: str
    detail: str


@dataclass(frozen=True)
class _Ins:
    addr: int
    text: str
    op: str
    ops: tuple
    labels: tuple
    predicated: bool


def _program(cubin: bytes) -> list[_Ins]:
    out = []
    for addr, text, labels, predicated in disassemble(cubin):
        t = text.rstrip(" ;")
        op, _, rest = t.partition(" ")
        out.append(_Ins(addr, t, op, tuple(o.strip() for o in rest.split(",")) if rest else (),
                        tuple(filter(None, labels.split(","))), predicated))
    return out


def _successors(code: list[_Ins], i: int, at: dict) -> list[int]:
    ins = code[i]
    m = _BRANCH.search(ins.text)
    out = [at[m.group(1)]] if m and m.group(1) in at else []
    if (m or ins.op.startswith("EXIT")) and not ins.predicated:
        return out
    return out + ([i + 1] if i + 1 < len(code) else [])


def _ur_written(ins: _Ins) -> set:
    m = _UR.fullmatch(ins.ops[0]) if ins.ops else None
    if not m or ins.op.startswith(("HGMMA", "ST", "BRA")):
        return set()
    r = int(m.group(1))
    return {r, r + 1} if ".64" in ins.op or ".WIDE" in ins.op else {r}


def _ur_read(ins: _Ins) -> set:
    regs = set()
    m = _GDESC.search(ins.text)
    if m:  # gdesc[URn]: A's descriptor in URn, URn+1 (unless A is in registers), B's in URn+2, URn+3
        n = int(m.group(1))
        a_in_registers = len(ins.ops) > 1 and _R.fullmatch(ins.ops[1])
        regs |= {n + 2, n + 3} | (set() if a_in_registers else {n, n + 1})
    for o in ins.ops[1 if _ur_written(ins) else 0:]:
        if "gdesc" not in o:
            regs |= {int(x) for x in _UR.findall(o)}
    return regs


def _undefined(code: list[_Ins], at: dict) -> list[Defect]:
    """Uniform registers read where some path from the entry writes none of them (a may-be-undefined data flow:
    a predicated write counts as a write)."""
    everything = frozenset(range(256))
    undef = [None] * len(code)
    undef[0], work = everything, [0]
    while work:
        i = work.pop()
        out = undef[i] - _ur_written(code[i])
        for s in _successors(code, i, at):
            if undef[s] is None or not out <= undef[s]:
                undef[s] = out if undef[s] is None else undef[s] | out
                work.append(s)
    return [Defect(ins.addr, ins.text, "undefined", f"UR{r}")
            for i, ins in enumerate(code) if undef[i] is not None
            for r in sorted(_ur_read(ins) & undef[i])]


def _width(op: str) -> int:
    if op.startswith("CS2R") or ".WIDE" in op or (".64" in op and not op.startswith("U")):
        return 2
    m = re.match(r"LDSM\.\S*\.(\d)", op)
    return 4 if ".128" in op else int(m.group(1)) if m else 1


def _r_written(ins: _Ins) -> set:
    m = _R.fullmatch(ins.ops[0]) if ins.ops else None
    if not m or ins.op.split(".")[0] in _NO_DEST or ins.op.startswith("U"):
        return set()
    r = int(m.group(1))
    return set(range(r, r + _width(ins.op)))


def _r_read(ins: _Ins) -> set:
    skip = 1 if _r_written(ins) else 0
    regs = {int(x) for o in ins.ops[skip:] for x in _R.findall(o)}
    if ins.op.startswith(("STS", "STG", "STL", "ST.")) and ins.ops and _R.fullmatch(ins.ops[-1]):
        r = int(_R.fullmatch(ins.ops[-1]).group(1))
        regs |= set(range(r, r + _width(ins.op)))
    return regs


def _mma_registers(ins: _Ins) -> tuple[set, set]:
    """An HGMMA's accumulator registers (``M * N / 128`` from its first) and its A operand's (4, where in
    registers)."""
    m, n = map(int, _SHAPE.search(ins.op).groups())
    acc = _R.fullmatch(ins.ops[0])
    a = _R.fullmatch(ins.ops[1]) if len(ins.ops) > 1 else None
    return (set(range(int(acc.group(1)), int(acc.group(1)) + m * n // 128)) if acc else set(),
            set(range(int(a.group(1)), int(a.group(1)) + 4)) if a else set())


def _in_flight(code: list[_Ins], at: dict, limit: int = 20000) -> list[Defect]:
    """From each HGMMA, every path up to the warp group's full wait: instructions that write its A operand or
    accumulator, or read its accumulator (another HGMMA chaining on the accumulator excepted)."""
    found = []
    for i, ins in enumerate(code):
        if not ins.op.startswith("HGMMA"):
            continue
        acc, a = _mma_registers(ins)
        seen, stack = set(), list(_successors(code, i, at))
        while stack and len(seen) < limit:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            other = code[j]
            if other.op.startswith("WARPGROUP.DEPBAR") and other.ops and other.ops[-1] == "0x0":
                continue
            if not other.op.startswith("HGMMA"):
                written, read = _r_written(other), _r_read(other)
                for what, regs in (("A operand", written & a), ("accumulator written", written & acc),
                                   ("accumulator read", read & acc)):
                    if regs:
                        found.append(Defect(other.addr, other.text, "in_flight",
                                            f"R{min(regs)}: {what} of the HGMMA at {ins.addr:#x}"))
            stack += _successors(code, j, at)
    return found


def flow_defects(cubin: bytes) -> list[Defect]:
    """The :class:`Defect` s of a kernel's SASS, by address (``undefined`` and ``in_flight``: the module's
    docstring)."""
    code = _program(cubin)
    at = {name: i for i, ins in enumerate(code) for name in ins.labels}
    return sorted(_undefined(code, at) + _in_flight(code, at), key=lambda d: (d.address, d.kind, d.detail))
