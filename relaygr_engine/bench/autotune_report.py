"""What the prefix kernel's autotuner chose on this device, and what each candidate took: printed by ``relaygr bench
rank`` and ``benchmarks/tools/profile_rank.py`` (CUDA), so a GPU run says which configs win at a shape (e.g. one 8-warp
program per tile, two 4-warp ones, or the value columns split) without forcing each in turn; and whether the sm_90
kernel ran (:func:`hopper_fields`: with ``RELAYGR_HOPPER_KERNEL=1`` a failure falls back to the portable kernel,
logged once, so a run must say which kernel its figures are from).

Timings are read off Triton's autotuner after each variant's tuning (its ``configs_timings``: the median of each
config's runs, in ms); :func:`record_timings` makes the autotuner keep them, by wrapping its ``run`` for the
benchmarks only (the engine's launches never pay for it). Nothing is tuned off CUDA: the lists are then empty.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["record_timings", "variants", "describe", "label", "print_variants", "hopper_fields"]

_timings: dict = {}


def _tuner():
    """The prefix kernel's autotuner, or None without Triton."""
    try:
        from ..kernels._prefix_config import autotuned_kernel
    except ImportError:
        return None
    return autotuned_kernel()


def record_timings() -> None:
    """From now on keep each variant's autotune timings (idempotent; does nothing without Triton)."""
    tuner = _tuner()
    if tuner is None or getattr(tuner, "_relaygr_records", False):
        return
    run = tuner.run

    def recording_run(*args, **kwargs):
        before = len(tuner.cache)
        out = run(*args, **kwargs)
        if len(tuner.cache) > before:  # a variant was just tuned: the newest key, its candidates' timings
            key = next(reversed(tuner.cache))
            _timings[key] = [(config, _median(t)) for config, t in getattr(tuner, "configs_timings", {}).items()]
        return out

    tuner.run = recording_run
    tuner._relaygr_records = True


def _median(t) -> float:
    return float(t[0] if isinstance(t, (list, tuple)) else t)


def label(config) -> str:
    """A config in a few characters: ``8w bn32 s3 tma``, ``4w bn32 s2 m2`` (rows split), ``v2`` (value columns)."""
    kw = config.kwargs
    parts = [f"{config.num_warps}w", f"bn{kw.get('BLOCK_N')}", f"s{config.num_stages}"]
    parts += [p for p, on in (("tma", kw.get("TMA")), (f"v{kw.get('V_SPLITS')}", kw.get("V_SPLITS", 1) > 1),
                              (f"m{kw.get('M_SPLITS')}", kw.get("M_SPLITS", 1) > 1),
                              (f"r{config.maxnreg}", config.maxnreg)) if on]
    return " ".join(parts)


def describe(key: dict) -> str:
    """A variant's autotune key in a few words: ``hstu cand split D=256 BM=128 reads=either`` (``rest-of-32``: the
    keys past a tile's full 32-key cached blocks, which the sm_90 kernel takes: ``SKIP_FULL``)."""
    from ..kernels._prefix_config import TMA_EITHER, TMA_OFF, TMA_ONLY

    words = ["hstu" if key.get("HSTU") else "softmax", "cand" if key.get("CAND_TILES") else "hist"]
    words += [w for w, on in (("split", key.get("SPLIT")), ("persistent", key.get("PERSISTENT")),
                              ("table", key.get("HIST_TABLE")), ("kv8", key.get("KV8")),
                              (f"rest-of-{key.get('SKIP_FULL')}", key.get("SKIP_FULL"))) if on]
    reads = {TMA_OFF: "pointers", TMA_EITHER: "either", TMA_ONLY: "tma"}.get(key.get("TMA_READS"), "?")
    return " ".join(words + [f"D={key.get('HEAD_DIM')}", f"BM={key.get('BLOCK_M')}", f"reads={reads}"])


def variants() -> list[dict]:
    """Each variant tuned since the last ``reset_autotuning``: ``{"variant", "config", "timings_ms"}``, the config
    kept (its :func:`label`) and, where :func:`record_timings` was on, every candidate's median ms, fastest first."""
    tuner = _tuner()
    if tuner is None:
        return []
    from ..kernels._prefix_config import AUTOTUNE_KEYS

    out = []
    for key, config in tuner.cache.items():
        timed = sorted(_timings.get(key, []), key=lambda x: x[1])
        out.append({"variant": describe(dict(zip(AUTOTUNE_KEYS, key))), "config": label(config),
                    "timings_ms": [(label(c), round(t, 4)) for c, t in timed]})
    return out


def print_variants(rows: Optional[list[dict]] = None) -> list[dict]:
    """One line per tuned variant (:func:`variants`): ``autotuned: <variant>: <kept> | <config> <ms>, ...``."""
    rows = variants() if rows is None else rows
    for row in rows:
        timed = ", ".join(f"{c} {t:.4f}" for c, t in row["timings_ms"])
        print(f"autotuned: {row['variant']}: {row['config']}" + (f" | {timed}" if timed else ""))
    return rows


def hopper_fields() -> dict:
    """The sm_90 kernel in this process, for a RESULT line: ``hopper_launches`` (launches that returned: eager calls
    and CUDA-graph captures) and ``hopper_failed`` (1 if it failed and the portable kernel ran instead, the reason
    printed). Empty without Triton (no kernel to report on)."""
    try:
        from ..kernels import _hopper_launch as HL
    except ImportError:
        return {}
    state = HL.state()
    if state["failed"] is not None:
        print(f"note: the sm_90 kernel failed and the portable kernel ran instead: {state['failed']}")
    return {"hopper_launches": state["launches"], "hopper_failed": int(state["failed"] is not None)}
