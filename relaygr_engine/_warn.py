"""Warn once per process: the project's one warn-once. A warning goes through ``logging`` (the caller's logger) the
first time its key is seen; later ones with the same key are dropped, so a condition met at every call (a missing
optional library, a failing cache file, an unmeasured device) says so once."""
from __future__ import annotations

import logging
import threading
from typing import Hashable

__all__ = ["warn_once", "forget"]

_seen: set = set()
_lock = threading.Lock()


def warn_once(logger: logging.Logger, key: Hashable, message: str, *args) -> bool:
    """Log ``message % args`` at WARNING through ``logger`` unless ``key`` was logged before in this process;
    True where it logged. Keys are shared by the whole project: make them say what they are about (a tuple whose
    first item names the module)."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.warning(message, *args)
    return True


def forget() -> None:
    """Forget every key (tests: each starts with nothing warned)."""
    with _lock:
        _seen.clear()
