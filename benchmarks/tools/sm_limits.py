"""Per-SM limits of NVIDIA GPUs by compute capability, and how many programs of a compiled kernel fit on one SM at
once (static occupancy), for ``python -m benchmarks.tools.ptxas``.

Figures from the CUDA C++ Programming Guide ("Technical Specifications per Compute Capability"): 64K 32-bit
registers per SM, allocated per warp in units of 256; the shared memory an SM holds, of which each resident block
also reserves 1 KB; resident warps and blocks per SM.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SMLimits", "LIMITS", "limits", "programs_per_sm"]


@dataclass(frozen=True)
class SMLimits:
    """What one SM of a compute capability holds."""

    smem_per_block: int      # bytes a block may opt into
    smem_per_sm: int         # bytes of shared memory per SM
    max_warps: int           # resident warps per SM
    max_blocks: int          # resident blocks per SM
    registers: int = 65536   # 32-bit registers per SM
    reg_unit: int = 256      # registers are allocated per warp in multiples of this
    smem_reserved: int = 1024  # bytes each resident block reserves


LIMITS = {80: SMLimits(166912, 167936, 64, 32), 86: SMLimits(101376, 102400, 48, 16),
          89: SMLimits(101376, 102400, 48, 24), 90: SMLimits(232448, 233472, 64, 32),
          100: SMLimits(232448, 233472, 64, 32), 120: SMLimits(101376, 102400, 48, 32)}


def limits(arch: int) -> SMLimits:
    """The limits of compute capability ``arch`` (e.g. 90); ValueError for one not in :data:`LIMITS`."""
    if arch not in LIMITS:
        raise ValueError(f"arch must be one of {sorted(LIMITS)}, got {arch}")
    return LIMITS[arch]


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int, arch: int = 90) -> int:
    """Programs (blocks) of ``num_warps`` warps, each thread using ``registers`` registers and each block
    ``shared_bytes`` of shared memory, that one SM of ``arch`` holds at once: the least of what its registers, its
    shared memory, its warp slots and its block slots allow (0: the block does not fit)."""
    lim = limits(arch)
    warp_regs = -(-registers * 32 // lim.reg_unit) * lim.reg_unit
    by_regs = lim.registers // warp_regs // num_warps if warp_regs else lim.max_blocks
    by_smem = lim.smem_per_sm // (shared_bytes + lim.smem_reserved) if shared_bytes <= lim.smem_per_block else 0
    return min(by_regs, by_smem, lim.max_warps // num_warps, lim.max_blocks)
