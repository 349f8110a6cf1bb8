"""Model identity: a 64-bit hash of a module's weights, recomputed only when they change.

Reading the identity is on every engine call's path, so it does not walk the weights' bytes, nor (in the common
case) the module tree: it compares a few counters.

* **Structure** (which tensors make the state, and their memory) changes through module calls that torch reports:
  assigning a parameter, buffer or submodule (``module.x = ...``, ``register_*``, ``load_state_dict(assign=True)``)
  fires torch's global registration hooks, and ``.to()``/``.cuda()``/``.half()``/``.float()``... run
  ``Module._apply``, which torch offers no hook for: this module counts its calls by wrapping
  ``torch.nn.Module._apply`` once per process (the wrapper calls the original and bumps a counter;
  :func:`structure_generation`). Any of them, on any module of the process, makes the next read walk the tree again
  (a few microseconds per hundred tensors) and compare each tensor's identity and data pointer with those hashed
  (``.to()`` gives every converted tensor new memory). A slot written or deleted without a hook
  (``module._parameters[name] = t``, ``del module.name``) is caught by each read's check that every slot still
  holds its tensor.
* **Values** change in place: ``load_state_dict`` copies into the tensors, an optimizer or ``with
  torch.no_grad(): p.mul_(2)`` edits them; each bumps the tensor's version counter. A read sums the version counters
  of the tracked tensors (versions only grow, so the sum grows exactly when one does).

A read between changes so costs a slot check and a sum of version counters (about 6 us for NVIDIA's 8-layer HSTU
shape, 88 tensors, on a 2-core x86 VM), where the walk it replaces read every tensor's identity, data pointer and
version and compared the lists (about 11 us). The bytes are hashed again only when the walk's key or the sum
changed.

Not seen: writes through ``.data`` (``p.data.mul_(2)``, ``p.data = t``: a tensor of its own version counter);
call :meth:`WeightsIdentity.invalidate` after them.
"""
from __future__ import annotations

import functools
import hashlib
import operator
import threading
from typing import Optional

import torch
from torch import nn

__all__ = ["WeightsIdentity", "structure_generation"]

_GENERATION = [0]  # bumped by every hook below: a module tree's tensors may have been replaced
_INSTALLED = threading.Lock()
_VERSION = operator.attrgetter("_version")
_DATA_PTR = operator.methodcaller("data_ptr")
_GET = operator.getitem


def _bump(*_args, **_kwargs) -> None:
    """Registration hooks' callback (returning None keeps what is registered)."""
    _GENERATION[0] += 1


def _install() -> None:
    """Torch's global registration hooks, and a counting wrapper around ``nn.Module._apply`` (once per process)."""
    with _INSTALLED:
        if getattr(nn.Module._apply, "_relaygr_counted", False):
            return
        from torch.nn.modules import module as torch_module

        for register in ("register_module_parameter_registration_hook",
                         "register_module_buffer_registration_hook", "register_module_module_registration_hook"):
            getattr(torch_module, register)(_bump)
        original = nn.Module._apply

        @functools.wraps(original)
        def _apply(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                _GENERATION[0] += 1

        _apply._relaygr_counted = True
        nn.Module._apply = _apply


def structure_generation() -> int:
    """How many times, in this process, a module's tensors may have been replaced (parameter, buffer or submodule
    registration, ``Module._apply``) since the hooks were installed (the first :class:`WeightsIdentity`)."""
    return _GENERATION[0]


class WeightsIdentity:
    """64-bit BLAKE2b hash of a module's state (every parameter and buffer: name, dtype, shape, bytes).

    Recomputed when a tensor of the state changes: ``load_state_dict`` and in-place edits (tensor version
    counters), ``.to(...)`` and assigned parameters, buffers or submodules (torch's hooks; see the module doc for
    what is and is not seen). Modules with equal state (on any device) share an identity. A read of :attr:`value`
    between changes compares counters: no walk of the weights.

    Parameters
    ----------
    module : nn.Module
    salt : bytes
        Mixed into the hash first (e.g. a config's repr).
    """

    def __init__(self, module: nn.Module, salt: bytes = b"") -> None:
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _install()
        self._module, self._salt = module, salt
        self._generation = -1          # structure_generation() when the slots were read
        self._dicts: list = []         # the slots: (module._parameters or ._buffers, name), as two lists
        self._names: list = []
        self._tensors: list = []       # the tensor each slot held then
        self._key: tuple = ()          # their identities and data pointers then
        self._hashed: Optional[tuple] = None  # the key and the sum of the version counters hashed last
        self._value = 0

    def invalidate(self) -> None:
        """Forget the tracked tensors and the hash: the next :attr:`value` rehashes."""
        self._generation, self._hashed = -1, None

    def _walk(self) -> None:
        """Read the slots again, and the key of what they hold (each tensor's identity and data pointer: ``.to()``
        allocates every converted tensor while the old one lives, so a converted tensor has a new pointer)."""
        gen = _GENERATION[0]  # (read first: a change while walking makes the next read walk again)
        slots = [(d, name) for m in self._module.modules() for d in (m._parameters, m._buffers) for name in d
                 if d[name] is not None]
        self._dicts, self._names = [d for d, _ in slots], [name for _, name in slots]
        self._tensors = list(map(_GET, self._dicts, self._names))
        self._key = (list(map(id, self._tensors)), list(map(_DATA_PTR, self._tensors)))
        self._generation = gen

    def _moved(self) -> bool:
        """Whether the tree may hold other tensors than those tracked: a hook fired, or a slot was written or
        deleted without one (``module._parameters[name] = ...``, ``del module.name``)."""
        if self._generation != _GENERATION[0]:
            return True
        try:
            return any(map(operator.is_not, map(_GET, self._dicts, self._names), self._tensors))
        except KeyError:
            return True

    @property
    def value(self) -> int:
        if self._moved():
            self._walk()
        hashed = (self._key, sum(map(_VERSION, self._tensors)))
        if hashed != self._hashed:
            h = hashlib.blake2b(self._salt, digest_size=8)
            for name, t in self._module.state_dict(keep_vars=True).items():
                if not isinstance(t, torch.Tensor):
                    continue
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
            self._value, self._hashed = int.from_bytes(h.digest(), "little"), hashed
        return self._value
