"""The prefix kernel's autotune choices on disk: a process reuses what an earlier one measured on the same GPU.

Triton's autotuner compiles and times every candidate config of a variant at the variant's first call, in every
process. At head dim 256 a variant keeps up to 12 candidates, each compiled for seconds, so each serving replica's
start (and each benchmark) pays that again; and replicas whose timings differ by noise may keep different configs,
so one request can score with different summation orders on two replicas. With a file of choices, a variant
compiles the one config named there and every process that loads it runs the same configs. (Triton's own
``cache_results`` cannot do this here: it skips configs with a ``pre_hook``, which every config of this kernel has.)

A file holds, per variant (the autotuner's key: the kernel's specialisation constants named in
:data:`~relaygr_engine.kernels._prefix_config.AUTOTUNE_KEYS`, then the dtypes of its tensors), the config kept,
and where it was measured (:func:`fingerprint`: the GPU's name and compute capability, the Triton version and the
kernel's source hash). It is used only where it was measured: a file from another GPU, Triton or kernel source
loads nothing (logged), and the autotuner tunes as usual. A loaded choice must be a config the kernel's pruning
keeps for its variant; any other is skipped (logged).

``RELAYGR_AUTOTUNE_FILE=<path>``: read when the autotuned kernel is first built (if the file exists), rewritten
(atomically, the choices read and made so far) after each variant the process tunes. Or explicitly:
:func:`~relaygr_engine.kernels.prefix_attention.save_autotune` and
:func:`~relaygr_engine.kernels.prefix_attention.load_autotune`.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Callable, Optional, Sequence

from .._warn import warn_once

__all__ = ["ENV_FILE", "FORMAT", "fingerprint", "document", "write", "read", "apply", "install"]

log = logging.getLogger(__name__)
ENV_FILE = "RELAYGR_AUTOTUNE_FILE"
FORMAT = 1


def _warn_once(what, message: str, *args) -> None:
    warn_once(log, ("autotune-store", what), message, *args)


def fingerprint(kernel, device=None) -> dict:
    """Where choices are measured and valid: ``{"gpu", "capability", "triton", "kernel"}`` for CUDA ``device``
    (None: the current one) and ``kernel`` (a ``triton.jit`` function: its source hash, ``cache_key``)."""
    import torch
    import triton

    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(index)
    return {"gpu": torch.cuda.get_device_name(index), "capability": f"{major}.{minor}",
            "triton": triton.__version__, "kernel": kernel.cache_key}


def _config_dict(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "maxnreg": config.maxnreg}


def document(choices: dict, where: dict, keys: Sequence[str]) -> dict:
    """The JSON document of ``choices`` (autotuner key tuple -> config) measured at ``where``
    (:func:`fingerprint`); ``keys`` name the key's leading entries (the dtypes follow)."""
    entries = [{"key": list(key), "config": _config_dict(config)} for key, config in choices.items()]
    return {"format": FORMAT, "fingerprint": dict(where), "key_names": list(keys), "entries": entries}


def write(path: str, doc: dict) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file in the same folder, then renamed over it), so a
    concurrent reader sees the old file or the new one, never a part."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".autotune-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: str) -> dict:
    """The document at ``path``, checked for shape; ``ValueError`` naming the path if it cannot be read as one."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"autotune file {path!r} cannot be read: {type(err).__name__}: {err}") from None
    problem = None
    if not isinstance(doc, dict):
        problem = f"expected a JSON object, got {type(doc).__name__}"
    elif doc.get("format") != FORMAT:
        problem = f"expected format {FORMAT}, got {doc.get('format')!r}"
    elif not isinstance(doc.get("fingerprint"), dict) or not isinstance(doc.get("key_names"), list):
        problem = "expected 'fingerprint' (an object) and 'key_names' (a list)"
    elif not isinstance(doc.get("entries"), list):
        problem = "expected 'entries' (a list)"
    else:
        for i, e in enumerate(doc["entries"]):
            ok = (isinstance(e, dict) and isinstance(e.get("key"), list)
                  and all(isinstance(v, (str, int, float, bool)) or v is None for v in e["key"])
                  and isinstance(e.get("config"), dict) and isinstance(e["config"].get("kwargs"), dict))
            if not ok:
                problem = f"entry {i} is not {{'key': [values], 'config': {{'kwargs': {{...}}, ...}}}}"
                break
    if problem:
        raise ValueError(f"autotune file {path!r}: {problem}")
    return doc


def apply(doc: dict, cache: dict, configs: Sequence, prune: Callable, where: dict, keys: Sequence[str],
          source: str = "autotune file") -> int:
    """Put ``doc``'s choices into an autotuner's ``cache`` (key tuple -> config) and return how many: nothing when
    its fingerprint or key names differ from ``where``/``keys`` (logged); each entry's config must be one of
    ``configs`` (the very object is stored, its ``pre_hook`` with it) that ``prune(configs, {}, **named)`` keeps
    for the entry's variant, else that entry is skipped (logged)."""
    if doc["fingerprint"] != where:
        diff = sorted(k for k in set(doc["fingerprint"]) | set(where) if doc["fingerprint"].get(k) != where.get(k))
        _warn_once(("fingerprint", source), "%s measured elsewhere (%s differ: %s here, %s there): not loaded; the "
                   "autotuner tunes as usual", source, ", ".join(diff), {k: where.get(k) for k in diff},
                   {k: doc["fingerprint"].get(k) for k in diff})
        return 0
    if list(doc["key_names"]) != list(keys):
        _warn_once(("keys", source), "%s keys its choices by %s, this kernel by %s: not loaded", source,
                   doc["key_names"], list(keys))
        return 0
    loaded, skipped = 0, []
    for entry in doc["entries"]:
        key, want = tuple(entry["key"]), entry["config"]
        want = {"kwargs": want["kwargs"], **{k: want.get(k) for k in ("num_warps", "num_stages", "maxnreg")}}
        match = [c for c in configs if _config_dict(c) == want]
        named = dict(zip(keys, key))
        if len(key) < len(keys) or not match or match[0] not in prune(configs, {}, **named):
            skipped.append(entry)
            continue
        cache[key] = match[0]
        loaded += 1
    if skipped:
        _warn_once(("skipped", source), "%s: %d of its %d choices are not configs this kernel keeps for their "
                   "variant (skipped; those variants tune as usual)", source, len(skipped), len(doc["entries"]))
    log.info("%s: %d autotune choices loaded", source, loaded)
    return loaded


def install(tuner, configs: Sequence, prune: Callable, where: Callable[[], dict], keys: Sequence[str],
            path: Optional[str] = None) -> Optional[str]:
    """With ``path`` (default: ``$RELAYGR_AUTOTUNE_FILE``; nothing without one): load it into ``tuner`` if it
    exists (a file that cannot be read is logged and left to be rewritten), then wrap ``tuner.run`` so that after
    a call that tuned a variant the file is rewritten with every choice loaded or made so far. ``where`` gives
    the fingerprint (called when needed: it reads the GPU). Returns the path used, or None."""
    path = os.environ.get(ENV_FILE, "").strip() if path is None else path
    if not path:
        return None
    known: dict = {}
    if os.path.exists(path):
        try:
            cache: dict = {}
            apply(read(path), cache, configs, prune, where(), keys, source=f"{ENV_FILE}={path}")
            tuner.cache.update(cache)
            known.update(cache)
        except Exception as err:  # noqa: BLE001 - a choices file only ever saves time: never fail a launch
            _warn_once(("read", path), "%s (ignored; rewritten after the next tuning)", err)
    run = tuner.run

    def run_and_save(*args, **kwargs):
        out = run(*args, **kwargs)
        new = {k: c for k, c in tuner.cache.items() if known.get(k) is not c}
        if new:
            known.update(new)
            try:
                write(path, document(known, where(), keys))
            except Exception as err:  # noqa: BLE001 - (as above)
                _warn_once(("write", path), "autotune choices not saved to %s: %s: %s", path, type(err).__name__,
                           err)
        return out

    tuner.run = run_and_save
    return path
