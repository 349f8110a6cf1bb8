"""Compiling an autotuned variant's configs in parallel before the autotuner times them.

Triton's autotuner compiles each candidate config the first time it times it, one after the other. At head dim 256
a variant of the prefix kernel has up to 12 candidates of a few seconds' compile each, so a serving process's first
ranking (its warm-up) and every benchmark's first call wait on them in series. Here the pruning step, which runs
once per variant right before the timing, also submits every kept config's compile to a thread pool through
Triton's public ``AsyncCompileMode`` (the compiler releases the GIL; the copies land in the kernel's cache, so the
timing loop finds them compiled). Anything that fails here is left to the autotuner's own serial path, which
compiles (and reports) it as before: this only ever saves time.

``RELAYGR_COMPILE_WORKERS`` sets the threads (default: half the CPU cores, at most 8); ``0`` or ``1`` turns it off.

For the variants a ``checked`` predicate names (the prefix kernel's on 8-bit pages), the kept configs' SASS is then
read for defects of its control flow (:func:`flow_clean`): a config whose compiled code reads a ``wgmma`` descriptor
undefined on some path, or touches an in-flight ``wgmma``'s registers, is never timed or run. Such code is a
compiler's miscompile of a correct program (Triton 3.6's ptxas 12.8 makes some of the 8-bit configs so), which
depends on the config and the assembler, so it is checked where it is compiled rather than listed.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import triton

from .._warn import warn_once

__all__ = ["compile_workers", "compile_configs", "flow_clean", "precompiling"]

log = logging.getLogger(__name__)
ENV_WORKERS = "RELAYGR_COMPILE_WORKERS"
MAX_DEFAULT_WORKERS = 8


def compile_workers(env: Optional[dict] = None) -> int:
    """Threads compiling a variant's configs: ``RELAYGR_COMPILE_WORKERS`` (an integer >= 0), else half the CPU
    cores this process may use, at most 8. ``ValueError`` naming the variable for anything else."""
    env = os.environ if env is None else env
    raw = env.get(ENV_WORKERS)
    if raw is None or raw.strip() == "":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(MAX_DEFAULT_WORKERS, cores // 2))
    try:
        workers = int(raw)
    except ValueError:
        workers = -1
    if workers < 0:
        raise ValueError(f"{ENV_WORKERS} must be an integer >= 0 (0 or 1: compile serially), got {raw!r}")
    return workers


def compile_configs(fn, configs, named_args: dict, kwargs: dict, workers: Optional[int] = None) -> int:
    """Compile ``fn`` for each of ``configs`` at the call ``fn[grid](*named_args.values(), **kwargs)`` on a pool of
    ``workers`` threads (default :func:`compile_workers`), without launching anything; returns how many were
    submitted (0 where it did nothing: fewer than two configs or workers, or a failure, logged once).

    Each config's ``pre_hook`` runs right before its compile is submitted (a hook may change an argument the
    compiled code is specialised on, e.g. a tensor descriptor's block shape), as the autotuner runs it before
    timing that config."""
    workers = compile_workers() if workers is None else workers
    if workers < 2 or len(configs) < 2:
        return 0
    call = {k: v for k, v in kwargs.items() if k != "warmup"}
    args = list(named_args.values())
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(min(workers, len(configs))) as pool, \
                triton.AsyncCompileMode(pool, ignore_errors=True):
            for config in configs:
                current = config.all_kwargs()
                if config.pre_hook is not None:
                    config.pre_hook({**named_args, **call, **current})
                fn.warmup(*args, **call, **current)
    except Exception as err:  # noqa: BLE001 - never worse than the serial path
        what = getattr(fn, "__name__", "kernel")
        warn_once(log, ("compile", what), "parallel compile of the autotune configs skipped (%s: %s: %s); the "
                  "autotuner compiles them one by one", what, type(err).__name__, err)
        return 0
    log.info("compiled %d autotune configs of %s in %.1f s on %d threads", len(configs),
             getattr(fn, "__name__", "kernel"), time.perf_counter() - t0, min(workers, len(configs)))
    return len(configs)


def flow_clean(fn, configs, named_args: dict, kwargs: dict, workers: Optional[int] = None) -> list:
    """The configs of ``configs`` whose compiled code (``fn`` at the call ``fn[grid](*named_args.values(),
    **kwargs)``, from the kernel's cache where :func:`compile_configs` put it) has no control-flow defect
    (:func:`relaygr_engine.kernels._sass_flow.flow_defects`, on ``workers`` threads: default
    :func:`compile_workers`); each one dropped is logged once. All of them where the check cannot run (no cubin, no
    ``nvdisasm``: logged once) and where none is clean (logged): the autotuner then times them as before. A config
    whose compile fails is kept (the autotuner reports it)."""
    from ._sass_flow import flow_defects

    call = {k: v for k, v in kwargs.items() if k != "warmup"}
    args = list(named_args.values())
    what = getattr(fn, "__name__", "kernel")
    cubins = []
    for config in configs:
        current = config.all_kwargs()
        if config.pre_hook is not None:
            config.pre_hook({**named_args, **call, **current})
        try:
            cubins.append(fn.warmup(*args, **call, **current).asm["cubin"])
        except Exception:  # noqa: BLE001 - the autotuner compiles and reports it
            cubins.append(None)
    workers = compile_workers() if workers is None else workers
    try:
        with ThreadPoolExecutor(max(1, min(workers, len(configs)))) as pool:  # (nvdisasm runs as a process)
            found = list(pool.map(lambda cubin: [] if cubin is None else flow_defects(cubin), cubins))
    except Exception as err:  # noqa: BLE001 - no nvdisasm, say: nothing to check with
        warn_once(log, ("flow", what), "the SASS flow check of %s's autotune configs did not run (%s: %s); every "
                  "config is timed", what, type(err).__name__, err)
        return list(configs)
    clean = []
    for config, defects in zip(configs, found):
        if defects:
            first = defects[0]
            warn_once(log, ("flow", what, str(config)), "autotune config %s of %s dropped: its SASS reads %s "
                      "(%s, at %#x: %s) and %d more such defects (relaygr_engine.kernels._sass_flow)", config, what,
                      first.detail, first.kind, first.address, first.instruction, len(defects) - 1)
        else:
            clean.append(config)
    if not clean:
        warn_once(log, ("flow-none", what), "every autotune config of %s has SASS flow defects; timing them all",
                  what)
        return list(configs)
    return clean


def precompiling(prune: Callable, fn, checked: Optional[Callable] = None) -> Callable:
    """An ``early_config_prune`` for ``triton.autotune`` that prunes with ``prune``, compiles what it keeps in
    parallel (:func:`compile_configs`) and, for a variant where ``checked(named_args, kwargs)`` holds, keeps only the
    configs whose code passes :func:`flow_clean`. The autotuner calls it once per variant, right before timing."""
    def prune_then_compile(configs, named_args, **kwargs):
        kept = prune(configs, named_args, **kwargs)
        compile_configs(fn, kept, named_args, kwargs)
        if checked is not None and checked(named_args, kwargs):
            kept = flow_clean(fn, kept, named_args, kwargs)
        return kept
    return prune_then_compile
