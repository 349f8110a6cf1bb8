"""Configs of the paged prefix-attention kernel (:mod:`relaygr_engine.kernels._prefix_kernel`): tile sizes per
device and kind of tile, the CUDA autotune set and its pruning, the autotuned kernel."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton

from ..config import KVDtype, PageReads
from . import _autotune_store
from ._bias_table import rows_fit
from ._compile import precompiling
from ._prefix_kernel import prefix_attention_kernel
from ._target import capability


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of one call: rows of a candidate tile (``block_m``) and of a history tile
    (``hist_block_m``; ``hist_fallback_m`` where the batch's history rows of the bias table would pass its budget),
    keys per block (``block_n=None``: autotuned on CUDA), programs sharing a tile's rows in a launch of fixed
    tile sizes (``row_splits``; the autotuner picks its own)."""

    block_m: int
    block_n: Optional[int]
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    hist_block_m: Optional[int] = None
    hist_fallback_m: Optional[int] = None
    row_splits: int = 1

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
# a key block's K/V serve 128 candidates and no score is computed twice. History tiles of 64 rows up to head dim
# 128: new history is short. On 8 warps both groups of a 64-row tile compute the same scores (``bench ptxas``: two
# special-function instructions per score where one suffices); on 4 warps (one group) none is repeated, but its
# registers hold twice the state, which spills above head dim 128 (and at 128 with 64-key blocks when the bias is
# computed in the kernel). So history tiles autotune over both where 4 warps compile spill-free, candidate tiles
# over 8. Above head dim 128 history tiles take 128 rows on 8 warps (no score repeated, spill-free while they read
# HSTU's bias from the table), except in a batch whose history rows of the bias table would pass its budget: there
# they compute the bias in the kernel, which spills at 128 rows, and take 64 (``history_tile_rows``). BLOCK_N and
# stages are autotuned over the configs that compile spill-free (``prune_configs``). Read off ``python -m
# benchmarks.tools.ptxas --defaults`` (sm_90, bf16; benchmarks/results/).
# Each config reads full key blocks through pointers or, on sm_90+, through a tensor descriptor (TMA: the copy
# engine moves a block, no per-thread addresses): which is faster depends on the GPU and the variant, so where both
# can run the autotuner measures both (``TMA_READS``, :func:`page_reads`).
CUDA_BLOCK_M = 128
CUDA_HIST_BLOCK_M = 64
CUDA_NUM_WARPS = 8
TMA_OFF, TMA_EITHER, TMA_ONLY = 0, 1, 2  # TMA_READS: which page reads the autotuner may pick


def _fit_descriptor(nargs) -> None:
    """Autotune pre-hook: the K/V tensor descriptor's block is the config's key block (``[BLOCK_N, HEAD_DIM]``)."""
    if nargs.get("kv_desc") is not None:
        nargs["kv_desc"].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


# The autotune space: the configs some GPU run's autotuner chose for a variant (docs/kernels.md, "The autotune space",
# says which runs), as (warps, BLOCK_N, stages, TMA, V_SPLITS, M_SPLITS); ``prune_configs`` keeps those of a
# variant that compile spill-free. 4 warps are one warp group: a 64-row tile whole, or a 128-row one as two
# programs of 64 rows (``M_SPLITS``: no score computed twice; two to four fit an SM up to head dim 128,
# ``benchmarks/results/ptxas-sm90-row-splits.txt``). Value splits (``V_SPLITS`` programs share a tile, each with
# D / V_SPLITS of its value columns) read through pointers; offered above head dim 128 (``_clean_value_split``).
AUTOTUNE_V_SPLITS = (1, 2)
CHOSEN_CONFIGS = (
    (8, 32, 2, False, 1, 1), (8, 32, 2, True, 1, 1), (8, 32, 3, False, 1, 1), (8, 32, 3, True, 1, 1),
    (8, 64, 3, False, 1, 1), (8, 64, 3, True, 1, 1),
    (4, 32, 2, False, 1, 1), (4, 64, 3, False, 1, 1), (4, 64, 3, True, 1, 1),
    (4, 32, 2, False, 1, 2), (4, 32, 2, True, 1, 2), (4, 32, 3, False, 1, 2), (4, 32, 3, True, 1, 2),
    (4, 64, 3, True, 1, 2),
    (8, 32, 2, False, 2, 1), (8, 32, 3, False, 2, 1), (8, 64, 2, False, 2, 1), (4, 32, 2, False, 2, 1),
    (4, 32, 2, False, 2, 2),
)
# 8-bit pages above head dim 128, history tiles computing the bias in the kernel: the one variant whose 32-key blocks
# spill (28 bytes at 2 stages, int8); 16-key blocks do not.
NARROW_CONFIG = triton.Config({"BLOCK_N": 16, "TMA": False, "V_SPLITS": 1, "M_SPLITS": 1}, num_warps=CUDA_NUM_WARPS,
                              num_stages=2, pre_hook=_fit_descriptor)
CUDA_CONFIGS = [triton.Config({"BLOCK_N": bn, "TMA": tma, "V_SPLITS": v, "M_SPLITS": m}, num_warps=w, num_stages=s,
                              pre_hook=_fit_descriptor if v == 1 else None)
                for w, bn, s, tma, v, m in CHOSEN_CONFIGS] + [NARROW_CONFIG]
CUDA_MAX_BLOCK_N = max(c.kwargs["BLOCK_N"] for c in CUDA_CONFIGS)  # the widest key block autotuning may pick
TMA_MIN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in CUDA_CONFIGS if c.kwargs["TMA"])
# Keys per split are a multiple of this (every autotuned BLOCK_N divides it; a caller's wider block raises it), so
# only a user's last key block is masked; no coarser, so the splits' shares stay even.
SPLIT_ALIGN = CUDA_MAX_BLOCK_N
# No length in the key: a serving process autotunes each compiled variant once, at its first call (a warm-up),
# never again at a new history length (each autotune benchmarks every config: about half a second, which a ranking
# caught behind it would pay). ``relaygr bench kernels`` clears the choices per shape (``reset_autotuning``).
AUTOTUNE_KEYS = ["HEAD_DIM", "PAGE_SIZE", "BLOCK_M", "CAND_TILES", "HSTU", "HAS_POS", "HAS_TS", "HIST_TABLE",
                 "PERSISTENT", "SPLIT", "KV8", "FAST_SILU", "TMA_READS", "V_SPLITS_PICK", "SKIP_FULL"]


def _one_group_rows(c, rows: int) -> bool:
    """Whether each program of config ``c`` on a tile of ``rows`` rows takes what one warp group (4 warps) runs: at
    most 64 rows, exactly 64 where the tile is split (``M_SPLITS``)."""
    sub = rows // c.kwargs["M_SPLITS"]
    return sub <= 64 and (c.kwargs["M_SPLITS"] == 1 or sub == 64)


def _clean_one_program(c, head_dim: int, rows: int, cand: bool, row_bias: bool, cand_bias: bool,
                       split: bool = False, kv8: bool = False) -> bool:
    """Whether a config without value splits compiles spill-free (or, where said, without local-memory accesses in
    its key loops) and fits shared memory on sm_90 (bf16):

    - 8 warps; ``BLOCK_N = 32`` above head dim 128; HSTU history tiles that compute their bias per (row, key) in
      the kernel ``BLOCK_N = 32`` from head dim 128 and 2 stages only above it; HSTU candidate tiles with a bias
      (their table row read per key block) 3 stages only above 128;
    - 4 warps (one warp group) up to head dim 128, taking 64 rows a program (a candidate tile of 64 rows, or of
      128 as two programs) or a history tile of up to 64;
    - 4 warps above head dim 128 only with a split prefix (``SPLIT``: a ranking's few tiles), a 128-row tile as two
      programs, 32-key blocks, pages in the model's dtype, 2 or 3 stages, either page read: history tiles reading
      HSTU's bias from the table or without one, and HSTU candidate tiles with a bias. These have no local-memory
      access in their key loops with Triton 3.6 or 3.9 (``bench ptxas``'s ``lcl``); some spill outside them (up to
      36 bytes for history tiles, 8-116 for candidate tiles; ``benchmarks/results/ptxas-sm90-defaults-split*``),
      where softmax and unbiased candidate tiles also touch local memory inside. At 2 stages two such programs fit
      an SM, where one 8-warp program fills it."""
    one_group = (head_dim <= 128 and _one_group_rows(c, rows)
                 and (rows // c.kwargs["M_SPLITS"] == 64 or not cand))  # (candidate tiles: 64 rows a program)
    wide_group = (head_dim > 128 and split and not kv8 and c.kwargs["M_SPLITS"] > 1 and _one_group_rows(c, rows)
                  and c.kwargs["BLOCK_N"] == 32 and (cand_bias if cand else not row_bias))
    return ((c.num_warps == CUDA_NUM_WARPS or one_group or wide_group)
            and (c.kwargs["BLOCK_N"] <= 32 or (head_dim <= 128 and not (row_bias and head_dim >= 128)))
            and (c.num_stages <= 2 or not (row_bias and head_dim > 128))
            and (c.num_stages >= 3 or not (cand_bias and head_dim > 128) or wide_group))


def _clean_value_split(c, rows: int, row_bias: bool, split: bool) -> bool:
    """Whether a config of :data:`CUDA_CONFIGS` splitting the value columns in two compiles spill-free on sm_90
    (bf16; read off ``benchmarks/results/ptxas-sm90-value-splits.txt`` at head dim 256, where the halved
    accumulator is what it buys): its 4-warp configs (one warp group, so two programs per SM) where each program
    takes 64 rows (a 64-row tile whole, a 128-row one in two); its 64-key blocks on 8 warps except for 128-row
    history tiles computing HSTU's bias in the kernel. History tiles computing it with split-prefix scheduling
    (``SPLIT``, the partial state stored) keep only 32-key blocks on 8 warps: the other two spill 44-56 bytes
    there (``benchmarks/results/ptxas-sm90-defaults-split.txt``)."""
    if c.num_warps != CUDA_NUM_WARPS:
        return _one_group_rows(c, rows) and not (row_bias and split)
    return c.kwargs["BLOCK_N"] == 32 or not (row_bias and (rows > 64 or split))


def prune_configs(configs, named_args, **kwargs):
    """The autotune candidates of a variant (``SPLIT`` too: a split prefix stores partial state, which takes
    registers) that compile spill-free and fit shared memory on sm_90 (bf16): without
    value splits as :func:`_clean_one_program` says, with two as :func:`_clean_value_split` says, offered above
    head dim 128 (or where the caller asked for them: ``V_SPLITS_PICK``, then only those); 8-bit pages with the
    in-kernel bias above head dim 128 only :data:`NARROW_CONFIG`, which no other variant takes. Configs reading
    pages through a tensor descriptor are offered as ``TMA_READS`` allows (they compile as the pointer configs do)
    when a key block lies in one page. (On 8-bit pages the autotuner then drops the kept configs whose compiled code
    fails the SASS flow check: :func:`_kv8`.)"""
    meta = {**named_args, **kwargs}
    head_dim, hstu, cand = meta.get("HEAD_DIM", 0), meta.get("HSTU", False), meta.get("CAND_TILES", True)
    rows = meta.get("BLOCK_M", 64)
    biased = hstu and (meta.get("HAS_POS", False) or meta.get("HAS_TS", False))
    row_bias = biased and not cand and not meta.get("HIST_TABLE", False)
    cand_bias = biased and cand
    reads, page_size = meta.get("TMA_READS", TMA_OFF), meta.get("PAGE_SIZE", 0)
    kv8 = meta.get("KV8", False)
    narrow = kv8 and row_bias and head_dim > 128
    pick = meta.get("V_SPLITS_PICK", 0)
    split = meta.get("SPLIT", False)

    def offered(c) -> bool:
        splits = c.kwargs["V_SPLITS"]
        if pick:
            return splits == pick
        return splits == 1 or (head_dim > 128 and not narrow)

    kept = [c for c in configs
            if (c is NARROW_CONFIG) == narrow and offered(c)
            and (reads != TMA_OFF if c.kwargs["TMA"] else reads != TMA_ONLY)
            and not (c.kwargs["TMA"] and page_size % c.kwargs["BLOCK_N"])
            and (c is NARROW_CONFIG or (_clean_value_split(c, rows, row_bias, split) if c.kwargs["V_SPLITS"] > 1
                                        else _clean_one_program(c, head_dim, rows, cand, row_bias, cand_bias, split, kv8)))]
    return kept or [c for c in configs if offered(c)][:1] or configs[:1]


def pick_config(device, dtype, head_dim: int, block_m: Optional[int] = None, block_n: Optional[int] = None, *,
                interpreted: bool = False) -> KernelConfig:
    """Tile sizes for a call; ``block_m`` sets both kinds of tile; ``block_n=None`` on CUDA means "autotune" (see
    the rule above ``CUDA_CONFIGS``)."""
    if interpreted or device.type == "cpu":
        return KernelConfig(block_m or INTERPRETER_BLOCK_M, block_n or INTERPRETER_BLOCK_N)
    if device.type == "npu":  # pragma: no cover - needs an Ascend host
        return KernelConfig(block_m or NPU_BLOCK_M, block_n or NPU_BLOCK_N)
    wide = block_m is None and head_dim > 128  # 128-row history tiles where the table's rows fit its budget
    return KernelConfig(block_m or CUDA_BLOCK_M, block_n, num_warps=CUDA_NUM_WARPS if block_n else None,
                        num_stages=2 if block_n else None,
                        hist_block_m=CUDA_BLOCK_M if wide else block_m or CUDA_HIST_BLOCK_M,
                        hist_fallback_m=CUDA_HIST_BLOCK_M if wide else None)


def page_read_mode(choice: PageReads, device, *, kv_dtype: KVDtype, head_dim: int, page_size: int,
                   block_n: Optional[int], aligned: bool, num_pages: int) -> tuple[int, str]:
    """How a launch reads full key blocks (``TMA_READS``) and why: the rule of :func:`page_reads`, without the
    cache tensor (``aligned``: its data starts 16-byte aligned; ``num_pages``: its pages), so a plan can say it for
    a device that is not here (``device``: a ``torch.device`` or a
    :class:`~relaygr_engine.kernels._target.Target`). ``ValueError`` for ``tma`` where it cannot run."""
    key_block = block_n or TMA_MIN_BLOCK_N
    rows = num_pages * 2 * page_size
    if choice is PageReads.POINTERS:
        return TMA_OFF, "pointers, as asked"
    why = None
    if kv_dtype.quantized:
        why = f"kv_dtype={kv_dtype.value!r} pages are read through pointers"
    elif head_dim < 16 or head_dim & (head_dim - 1):
        why = f"the head dim must be a power of two >= 16, got {head_dim}"
    elif not aligned:
        why = "kv_cache's data must start 16-byte aligned"
    elif page_size % key_block:
        why = f"page_size must be a multiple of the key block ({key_block}), got {page_size}"
    elif rows >= 1 << 31:
        why = f"the pages hold {rows} K/V rows, more than a descriptor's int32 coordinates reach"
    elif device.type == "cuda" and not tma_device(device):
        why = f"needs sm_90 or later, got sm_{''.join(map(str, capability(device)))}"
    elif device.type not in ("cuda", "cpu"):
        why = f"not on {device.type}"
    if choice is PageReads.AUTO:
        if why is not None:
            return TMA_OFF, f"pointers: TMA {why}"
        if device.type != "cuda":
            return TMA_OFF, "pointers: TMA reads are autotuned on CUDA only"
        if block_n is not None:
            return TMA_OFF, "pointers: a fixed block_n is not autotuned"
        return TMA_EITHER, "autotuned: pointers or TMA (sm_90+, a key block within a page)"
    if why is not None:
        raise ValueError(f"page_reads='tma': {why}")
    return TMA_ONLY, "TMA, as asked"


def page_reads(choice: PageReads, kv_cache: torch.Tensor, *, kv_dtype: KVDtype, page_size: int,
               block_n: Optional[int]) -> tuple[int, object]:
    """How a launch reads full key blocks: ``(TMA_READS, kv_desc)``, the descriptor (None without TMA) viewing
    ``kv_cache [num_pages, 2, page_size, H, D]`` as rows ``[num_pages * 2 * page_size, H * D]``.

    ``auto`` lets the autotuner pick on CUDA sm_90+ where TMA can run, and reads through pointers elsewhere (and
    with a fixed ``block_n``, which is not autotuned); ``tma`` raises ``ValueError`` where it cannot run: 8-bit
    pages, a head dim not a power of two, a cache not 16-byte aligned, a page not a whole number of key blocks, a
    GPU before sm_90 (the interpreter runs it, for tests). ``kv_cache`` is contiguous (the launcher checks it)."""
    num_pages, _, _, heads, head_dim = kv_cache.shape
    reads, _ = page_read_mode(choice, kv_cache.device, kv_dtype=kv_dtype, head_dim=head_dim, page_size=page_size,
                              block_n=block_n, aligned=kv_cache.data_ptr() % 16 == 0, num_pages=num_pages)
    if reads == TMA_OFF:
        return TMA_OFF, None
    return reads, kv_descriptor(kv_cache, page_size, block_n)


def kv_descriptor(kv_cache: torch.Tensor, page_size: int, block_n: Optional[int]):
    """The tensor descriptor TMA page reads load full key blocks through: ``kv_cache [num_pages, 2, slots, H, D]``
    viewed as rows ``[num_pages * 2 * page_size, H * D]``, a block ``[block_n, D]`` (autotuned: the narrowest TMA
    block, which the autotuner's pre-hook widens to its config's)."""
    from triton.tools.tensor_descriptor import TensorDescriptor  # (not every Triton build has it: imported here)

    num_pages, _, _, heads, head_dim = kv_cache.shape
    rows = num_pages * 2 * page_size
    return TensorDescriptor(kv_cache.view(rows, heads * head_dim), [rows, heads * head_dim], [heads * head_dim, 1],
                            [block_n or TMA_MIN_BLOCK_N, head_dim])


def tma_device(device) -> bool:
    """Whether ``device`` (a ``torch.device`` or a :class:`~relaygr_engine.kernels._target.Target`) is a CUDA GPU
    that runs tensor-descriptor (TMA) page reads: sm_90 or later."""
    return device.type == "cuda" and capability(device)[0] >= 9


def history_tile_rows(cfg: KernelConfig, num_tiles: Callable[[int], int], max_key_len: int) -> int:
    """Rows per history tile for a batch: ``cfg.hist_block_m``, or ``cfg.hist_fallback_m`` where ``num_tiles(m)``
    history tiles of ``m`` rows would make the bias table's history rows pass their default budget
    (:data:`~relaygr_engine.kernels._bias_table.HIST_BIAS_TABLE_BYTES`): those tiles compute the bias in the
    kernel, which the taller tiles cannot do without spilling."""
    m = cfg.hist_block_m
    if cfg.hist_fallback_m is None or rows_fit(num_tiles(m) * m, max_key_len, cfg.block_n or CUDA_MAX_BLOCK_N):
        return m
    return cfg.hist_fallback_m


# Each autotune candidate is timed over AUTOTUNE_REP_MS after AUTOTUNE_WARMUP_MS (Triton's default is 100 and 25):
# a launch takes microseconds to a millisecond, so a few hundred runs already rank the configs, and a variant's up
# to 12 candidates cost a warm-up well under a second instead of two.
AUTOTUNE_WARMUP_MS = 5
AUTOTUNE_REP_MS = 20


def _bench_config(kernel_call, quantiles):
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=quantiles)


_autotuned = None


def reset_autotuning() -> None:
    """Forget the autotuned configs chosen so far (the next call of each variant tunes again)."""
    if _autotuned is not None:
        _autotuned.cache.clear()


def save_autotune(path: str, device=None) -> int:
    """Write the autotuner's choices so far (every variant tuned or loaded since the last :func:`reset_autotuning`)
    to ``path`` (JSON, replaced atomically), marked with where they were measured (CUDA ``device``, None: the
    current one; :func:`autotune_fingerprint`); returns how many. A later process loads them with
    :func:`load_autotune` or ``RELAYGR_AUTOTUNE_FILE`` (:mod:`relaygr_engine.kernels._autotune_store`)."""
    tuner = autotuned_kernel()
    _autotune_store.write(path, _autotune_store.document(tuner.cache, autotune_fingerprint(device), AUTOTUNE_KEYS))
    return len(tuner.cache)


def load_autotune(path: str, device=None) -> int:
    """Load the choices that :func:`save_autotune` wrote to ``path`` into the autotuner (each such variant then
    compiles and runs that config, untimed); returns how many. Nothing is loaded from a file measured on another
    GPU, Triton or kernel source (logged), nor a choice the kernel's pruning no longer keeps for its variant.
    ``ValueError`` naming ``path`` if it is not such a file."""
    tuner = autotuned_kernel()
    doc = _autotune_store.read(path)
    return _autotune_store.apply(doc, tuner.cache, CUDA_CONFIGS, prune_configs, autotune_fingerprint(device),
                                 AUTOTUNE_KEYS, source=f"autotune file {path!r}")


def autotuned_choices() -> list[str]:
    """The configs the autotuner has kept, one per variant tuned since the last :func:`reset_autotuning`."""
    return [str(c) for c in _autotuned.cache.values()] if _autotuned is not None else []


def _kv8(named_args: dict, kwargs: dict) -> bool:
    """Whether an autotuned call reads 8-bit pages: its configs' SASS is checked before they are timed
    (:func:`~relaygr_engine.kernels._compile.flow_clean`)."""
    return bool({**named_args, **kwargs}.get("KV8", False))


def autotuned_kernel():
    """The kernel wrapped by ``triton.autotune`` over :data:`CUDA_CONFIGS` (built on first use)."""
    global _autotuned
    if _autotuned is None:
        # (pruned, then the kept configs compiled in parallel before the autotuner times them: kernels._compile)
        prune = precompiling(prune_configs, prefix_attention_kernel, checked=_kv8)
        _autotuned = triton.autotune(configs=CUDA_CONFIGS, key=AUTOTUNE_KEYS, do_bench=_bench_config,
                                     prune_configs_by={"early_config_prune": prune})(prefix_attention_kernel)
        if torch.cuda.is_available():  # choices kept on disk with RELAYGR_AUTOTUNE_FILE (kernels._autotune_store)
            _autotune_store.install(_autotuned, CUDA_CONFIGS, prune_configs, autotune_fingerprint, AUTOTUNE_KEYS)
    return _autotuned


def autotune_fingerprint(device=None) -> dict:
    """Where the autotuner's choices hold (:func:`~relaygr_engine.kernels._autotune_store.fingerprint`): this
    CUDA ``device``'s GPU (None: the current one), this Triton and this kernel's source."""
    return _autotune_store.fingerprint(prefix_attention_kernel, device)

