"""Configs of the paged prefix-attention kernel (:mod:`relaygr_engine.kernels._prefix_kernel`): tile sizes per
device and kind of tile, the CUDA autotune set and its pruning, the autotuned kernel."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import triton

from ._prefix_kernel import prefix_attention_kernel


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of one call: rows of a candidate tile (``block_m``) and of a history tile
    (``hist_block_m``), keys per block (``block_n=None``: autotuned on CUDA)."""

    block_m: int
    block_n: Optional[int]
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    hist_block_m: Optional[int] = None

    def __post_init__(self):
        if self.hist_block_m is None:
            object.__setattr__(self, "hist_block_m", self.block_m)


# Interpreter: small tiles keep numpy work per step low while leaving few steps per tile.
INTERPRETER_BLOCK_M = 32
INTERPRETER_BLOCK_N = 32
# NPU (triton-ascend): one fixed config sized for the ~192 KB unified buffer; no autotuning.
NPU_BLOCK_M = 64
NPU_BLOCK_N = 64
# CUDA. Candidate tiles of 128 rows on 8 warps (two warp groups): each group owns 64 rows (one wgmma M on sm_90), so
# a key block's K/V serve 128 candidates and no score is computed twice. History tiles of 64 rows: new history is
# short, and the per-(row, key) bias of a 128-row tile spills at head dim 256. On 8 warps both groups of a 64-row
# tile compute the same scores (``bench ptxas``: two special-function instructions per score where one suffices);
# on 4 warps (one group) none is repeated, but its registers hold twice the state, which spills above head dim 128
# (and at 128 with 64-key blocks when the bias is computed in the kernel). So history tiles autotune over both
# where 4 warps compile spill-free, candidate tiles over 8. BLOCK_N and stages are autotuned over the configs that
# compile spill-free (``prune_configs``). Read off ``relaygr bench ptxas --defaults`` (sm_90, bf16;
# benchmarks/results/).
CUDA_BLOCK_M = 128
CUDA_HIST_BLOCK_M = 64
CUDA_NUM_WARPS = 8
CUDA_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for w in (CUDA_NUM_WARPS, 4)
                for bn in (32, 64) for s in (2, 3)]
CUDA_MAX_BLOCK_N = max(c.kwargs["BLOCK_N"] for c in CUDA_CONFIGS)  # the widest key block autotuning may pick
# Keys per split are a multiple of this (every BLOCK_N divides it), so only a user's last key block is masked.
SPLIT_ALIGN = 128
# No length in the key: a serving process autotunes each compiled variant once, at its first call (a warm-up),
# never again at a new history length (each autotune benchmarks every config: about half a second, which a ranking
# caught behind it would pay). ``relaygr bench kernels`` clears the choices per shape (``reset_autotuning``).
AUTOTUNE_KEYS = ["HEAD_DIM", "PAGE_SIZE", "BLOCK_M", "CAND_TILES", "HSTU", "HAS_POS", "HAS_TS", "HIST_TABLE",
                 "PERSISTENT", "SPLIT", "KV8", "FAST_SILU"]


def prune_configs(configs, named_args, **kwargs):
    """The autotune candidates of a variant that compile spill-free and fit shared memory on sm_90 (bf16):
    candidate tiles on 8 warps, history tiles on 8 or (up to head dim 128 and 64 rows) 4; ``BLOCK_N = 32`` above
    head dim 128; HSTU history tiles that compute their bias per (row, key) in the kernel (no ``HIST_TABLE``)
    ``BLOCK_N = 32`` from head dim 128 and 2 stages only above it; HSTU candidate tiles with a bias (their table row
    read per key block) 3 stages only above 128. Every other config of :data:`CUDA_CONFIGS` is kept."""
    meta = {**named_args, **kwargs}
    head_dim, hstu, cand = meta.get("HEAD_DIM", 0), meta.get("HSTU", False), meta.get("CAND_TILES", True)
    biased = hstu and (meta.get("HAS_POS", False) or meta.get("HAS_TS", False))
    row_bias = biased and not cand and not meta.get("HIST_TABLE", False)
    cand_bias = biased and cand
    kept = [c for c in configs
            if (c.num_warps == CUDA_NUM_WARPS or not cand and head_dim <= 128 and meta.get("BLOCK_M", 64) <= 64)
            and (c.kwargs["BLOCK_N"] <= 32 or (head_dim <= 128 and not (row_bias and head_dim >= 128)))
            and (c.num_stages <= 2 or not (row_bias and head_dim > 128))
            and (c.num_stages >= 3 or not (cand_bias and head_dim > 128))]
    return kept or configs[:1]


def pick_config(device, dtype, head_dim: int, block_m: Optional[int] = None, block_n: Optional[int] = None, *,
                interpreted: bool = False) -> KernelConfig:
    """Tile sizes for a call; ``block_m`` sets both kinds of tile; ``block_n=None`` on CUDA means "autotune" (see
    the rule above ``CUDA_CONFIGS``)."""
    if interpreted or device.type == "cpu":
        return KernelConfig(block_m or INTERPRETER_BLOCK_M, block_n or INTERPRETER_BLOCK_N)
    if device.type == "npu":  # pragma: no cover - needs an Ascend host
        return KernelConfig(block_m or NPU_BLOCK_M, block_n or NPU_BLOCK_N)
    return KernelConfig(block_m or CUDA_BLOCK_M, block_n, num_warps=CUDA_NUM_WARPS if block_n else None,
                        num_stages=2 if block_n else None, hist_block_m=block_m or CUDA_HIST_BLOCK_M)


_autotuned = None


def reset_autotuning() -> None:
    """Forget the autotuned configs chosen so far (the next call of each variant tunes again)."""
    if _autotuned is not None:
        _autotuned.cache.clear()


def autotuned_kernel():
    """The kernel wrapped by ``triton.autotune`` over :data:`CUDA_CONFIGS` (built on first use)."""
    global _autotuned
    if _autotuned is None:
        _autotuned = triton.autotune(configs=CUDA_CONFIGS, key=AUTOTUNE_KEYS,
                                     prune_configs_by={"early_config_prune": prune_configs})(prefix_attention_kernel)
    return _autotuned
