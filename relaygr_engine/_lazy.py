"""Lazy package faces: a package lists its public names and the module defining each; a name's module is imported on
first access, so importing the package stays cheap (no torch kernels, no Triton)."""
from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str], cache: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to the module (relative to
    ``package``) that defines it; a resolved name is stored in ``cache`` (the package's ``globals()``)."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            cache[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(exports) + [n for n in ("__version__",) if n in cache]

    return __getattr__, __dir__
