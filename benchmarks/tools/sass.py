"""The instruction mix of a compiled kernel, read from its SASS with ``nvdisasm`` (shipped in Triton's wheel).

Static facts, no GPU: how many instructions the kernel has, how many are tensor-core MMAs, synchronous global loads
or asynchronous copies, shuffles, special-function instructions (``MUFU``: exp2, reciprocal, tanh; a unit with a
sixteenth of the tensor cores' per-element rate, which attention's pointwise work can saturate), local-memory
accesses (spilled registers: once per program outside the loops, or at every key block inside them), and the same for
its key loop (the loop body with the most MMAs, where a paged
attention kernel spends its time). ``python -m benchmarks.tools.ptxas`` prints them per config.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass

from relaygr_engine.kernels._sass import _BRANCH, _LABEL, disassemble, nvdisasm_path  # noqa: F401 (re-exported)

__all__ = ["Mix", "disassemble", "instruction_mix", "nvdisasm_path"]

MMA_OPS = ("HGMMA", "HMMA", "IMMA", "QGMMA")     # warp-group (sm_90) and warp-level tensor-core MMAs
ASYNC_OPS = ("LDGSTS", "UTMALDG", "UBLKCP")     # cp.async and TMA copies into shared memory
LOAD_OPS = ("LDG",)                             # synchronous global loads (into registers)
SHUFFLE_OPS = ("SHFL",)
SPECIAL_OPS = ("MUFU",)
LOCAL_OPS = ("LDL", "STL")                      # local memory: where spilled registers go


@dataclass(frozen=True)
class Mix:
    """Instruction counts of a whole kernel or of one loop body."""

    instructions: int
    mma: int
    global_loads: int
    async_copies: int
    shuffles: int
    special: int = 0    # special-function unit instructions (MUFU)
    local: int = 0      # local-memory loads and stores (LDL, STL): spilled registers moving
    skippable: int = 0  # a loop's: instructions a conditional forward branch inside it jumps over

    @classmethod
    def of(cls, ops: collections.Counter) -> "Mix":
        count = lambda names: sum(ops[n] for n in names)  # noqa: E731
        return cls(sum(ops.values()), count(MMA_OPS), count(LOAD_OPS), count(ASYNC_OPS), count(SHUFFLE_OPS),
                   count(SPECIAL_OPS), count(LOCAL_OPS))


def _opcode(text: str) -> str:
    return text.split()[0].split(".")[0] if text else ""


def _labels(code: list[tuple[int, str, str, bool]]) -> dict:
    return {name: addr for addr, _, labels, _ in code for name in filter(None, labels.split(","))}


def _loops(code: list[tuple[int, str, str, bool]]) -> list[tuple[int, int]]:
    """``(first, last)`` addresses of each innermost loop body: a backward branch's span that holds no other. (A
    span that holds one is not a source loop: e.g. the jump back from an out-of-line wait on a TMA barrier, placed
    at the kernel's end, spans the whole kernel.)"""
    at = _labels(code)
    spans = []
    for addr, text, _, _ in code:
        m = _BRANCH.search(text)
        if m and at.get(m.group(1), addr) < addr:
            spans.append((at[m.group(1)], addr))
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def _skippable(code: list[tuple[int, str, str, bool]], first: int, last: int) -> int:
    """Instructions of the loop body ``[first, last]`` that a conditional forward branch to a label inside it jumps
    over (e.g. softmax's rescale of the accumulator, done only when a row's running max grows enough): the body's
    other instructions are its usual path."""
    at, skipped = _labels(code), set()
    for addr, text, _, predicated in code:
        m = _BRANCH.search(text) if predicated and first <= addr <= last else None
        if m and addr < at.get(m.group(1), -1) <= last:
            skipped.update(a for a, *_ in code if addr < a < at[m.group(1)])
    return len(skipped)


def instruction_mix(cubin: bytes) -> tuple[Mix, Mix]:
    """The mix of the whole kernel and of its key loop: the innermost loop body (:func:`_loops`) holding the most
    MMAs, ties to the first (an all-zero :class:`Mix` when no loop holds an MMA), with its ``skippable``
    instructions (:func:`_skippable`)."""
    code = disassemble(cubin)
    whole = Mix.of(collections.Counter(_opcode(t) for _, t, _, _ in code))
    best, best_span = Mix(0, 0, 0, 0, 0), None
    for first, last in _loops(code):
        mix = Mix.of(collections.Counter(_opcode(t) for a, t, _, _ in code if first <= a <= last))
        if mix.mma > best.mma:
            best, best_span = mix, (first, last)
    if best_span is None:
        return whole, best
    return whole, dataclasses.replace(best, skippable=_skippable(code, *best_span))
