"""What a launch decision knows of a device: its type, cores and compute capability (:class:`Target`).

Every rule that chooses how the prefix-attention kernel runs (tile configs, page reads, split counts, streams, the
sm_90 kernel) reads only these, so the same rules plan for the device a call runs on and for a
named GPU that is not here (:data:`GPUS`, ``relaygr explain --gpu h100``; a device's own:
:func:`~relaygr_engine.kernels._common.target_of`): planning is host-side arithmetic.
A :class:`Target` stands where those rules take a ``torch.device`` (``.type``, ``.index``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Target", "GPUS", "named_gpu", "capability"]


@dataclass(frozen=True)
class Target:
    """A device as the launch rules see it.

    Attributes
    ----------
    type : {"cpu", "cuda", "npu"}
        The torch device type.
    name : str
        What the plan calls it (``"NVIDIA H100 80GB HBM3"``, ``"cpu (Triton interpreter)"``).
    cores : int
        SMs (CUDA), AI cores (NPU), the interpreter's programs of a persistent grid (CPU).
    capability : (int, int) or None
        CUDA compute capability; None elsewhere.
    index : None
        No device index: a target is not a device the process holds.
    """

    type: str
    name: str
    cores: int
    capability: Optional[tuple[int, int]] = None
    index: None = None

    def __str__(self) -> str:
        return self.name


# GPUs ``relaygr explain --gpu NAME`` plans for (SMs and compute capability from NVIDIA's data sheets).
GPUS = {
    "h100": Target("cuda", "NVIDIA H100 SXM (132 SMs, sm_90)", 132, (9, 0)),
    "h100-pcie": Target("cuda", "NVIDIA H100 PCIe (114 SMs, sm_90)", 114, (9, 0)),
    "h200": Target("cuda", "NVIDIA H200 (132 SMs, sm_90)", 132, (9, 0)),
    "a100": Target("cuda", "NVIDIA A100 SXM (108 SMs, sm_80)", 108, (8, 0)),
    "l40s": Target("cuda", "NVIDIA L40S (142 SMs, sm_89)", 142, (8, 9)),
    "l4": Target("cuda", "NVIDIA L4 (58 SMs, sm_89)", 58, (8, 9)),
}


def named_gpu(name: str) -> Target:
    """The :data:`GPUS` entry ``name`` (case-insensitive); ValueError naming the choices otherwise."""
    key = str(name).lower()
    if key not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(sorted(GPUS))}, got {name!r}")
    return GPUS[key]


def capability(device) -> tuple[int, int]:
    """The compute capability of a CUDA ``device`` (a ``torch.device`` or a :class:`Target`), read once per
    device."""
    if isinstance(device, Target):
        return device.capability or (0, 0)
    return _cuda_capability(device.index)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: Optional[int]) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
