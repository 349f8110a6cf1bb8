"""The one place that loads the C++ extension ``relaygr_engine._C``.

``PrefixBlockPool`` is the C++ pool when the extension imports, else the pure-Python pool with the same API (one
logged warning). ``RELAYGR_PUREPYTHON=1`` forces the pure-Python pool.
"""
from __future__ import annotations

import logging
import os

from ._pool_py import PrefixBlockPool as PyPrefixBlockPool

__all__ = ["PrefixBlockPool", "PyPrefixBlockPool", "CppPrefixBlockPool", "EXTENSION_LOADED", "EXTENSION_ERROR",
           "pool_implementations"]

_log = logging.getLogger("relaygr_engine")

CppPrefixBlockPool = None
EXTENSION_ERROR: str | None = None

if os.environ.get("RELAYGR_PUREPYTHON", "") not in ("", "0"):
    EXTENSION_ERROR = "disabled by RELAYGR_PUREPYTHON"
else:
    try:
        from . import _C  # type: ignore[attr-defined]

        CppPrefixBlockPool = _C.PrefixBlockPool
    except ImportError as exc:  # not built, or built for another Python
        EXTENSION_ERROR = f"{type(exc).__name__}: {exc}"
        _log.warning("relaygr_engine._C not loaded (%s); using the pure-Python block pool", EXTENSION_ERROR)

EXTENSION_LOADED = CppPrefixBlockPool is not None
PrefixBlockPool = CppPrefixBlockPool if EXTENSION_LOADED else PyPrefixBlockPool


def pool_implementations() -> dict[str, type]:
    """Every pool implementation available in this process, by name ("cpp", "python")."""
    impls = {"python": PyPrefixBlockPool}
    if CppPrefixBlockPool is not None:
        impls["cpp"] = CppPrefixBlockPool
    return impls
