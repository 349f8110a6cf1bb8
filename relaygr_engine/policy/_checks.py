"""Argument checks shared by the policies: each raises ``ValueError`` naming the argument, expected vs actual."""
from __future__ import annotations

import math
import time
from typing import Optional

from ..config import check_int


count = check_int  # ``value`` as an int >= ``minimum`` (bools refused); the one integer check


def u64(name: str, value) -> int:
    """An unsigned 64-bit value: an int in ``[0, 2**64)`` (bools are refused)."""
    return check_int(name, value, 0, 1 << 64)


def user_id(value) -> int:
    """A user id: an int in ``[0, 2**64)`` (bools are refused)."""
    return u64("user_id", value)


def number(name: str, value, *, low: float = -math.inf, high: float = math.inf,
           low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float in the interval ``low..high`` (bounds closed unless ``*_open``)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}") from None
    below = v <= low if low_open else v < low
    above = v >= high if high_open else v > high
    if not math.isfinite(v) or below or above:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name} must be a finite number in {lo}{low:g}, {high:g}{hi}, got {value!r}")
    return v


def clock(now: Optional[float]) -> float:
    """``now`` checked, or ``time.monotonic()`` when it is None."""
    if now is None:
        return time.monotonic()
    return number("now", now)
