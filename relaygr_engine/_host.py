"""Host index tables to device tensors, with no op on the CPU (the hot path builds several per forward)."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["to_device"]


def to_device(a, dtype: np.dtype, device: torch.device) -> torch.Tensor:
    """``a`` (array-like) as a contiguous ``dtype`` tensor on ``device``.

    On the CPU the tensor shares the numpy array's memory (``torch.from_numpy``: no copy, no dispatched op); on
    another device it is one host-to-device copy.
    """
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
    return t if device.type == "cpu" else t.to(device)
