"""Model identity: a 64-bit hash of a module's weights, recomputed only when they change."""
from __future__ import annotations

import hashlib
from typing import Optional

import torch
from torch import nn

__all__ = ["WeightsIdentity"]


class WeightsIdentity:
    """64-bit BLAKE2b hash of a module's state (every parameter and buffer: name, dtype, shape, bytes).

    Recomputed when a tensor of the state changes: ``load_state_dict`` and in-place edits (tensor version
    counters), ``.to(...)`` (new tensors). Replacing a submodule after the first call is not seen: call
    :meth:`invalidate` then. Modules with equal state (on any device) share an identity.

    Parameters
    ----------
    module : nn.Module
    salt : bytes
        Mixed into the hash first (e.g. a config's repr).
    """

    def __init__(self, module: nn.Module, salt: bytes = b"") -> None:
        self._module, self._salt = module, salt
        self._slots: Optional[list] = None
        self._key: Optional[list] = None
        self._value = 0

    def invalidate(self) -> None:
        """Forget the tracked tensors and the hash: the next :attr:`value` rehashes."""
        self._slots, self._key = None, None

    @property
    def value(self) -> int:
        if self._slots is None:  # where each tensor lives; its current tensor is re-read on every call
            self._slots = [(d, name) for m in self._module.modules() for d in (m._parameters, m._buffers)
                           for name in d if d[name] is not None]
        key = [(id(t), t.data_ptr(), t._version) for d, name in self._slots for t in (d[name],)]
        if key != self._key:
            h = hashlib.blake2b(self._salt, digest_size=8)
            for name, t in self._module.state_dict(keep_vars=True).items():
                if not isinstance(t, torch.Tensor):
                    continue
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
            self._value = int.from_bytes(h.digest(), "little")
            self._key = key
        return self._value
