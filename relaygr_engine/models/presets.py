"""Named model sizes for the benchmarks: one table, :data:`PRESETS`, and the :class:`ModelShape` each names.

``small`` is the CPU demo's ranker (2 layers, hidden 64, 2 heads x 32, fp32); ``nvidia-hstu`` is NVIDIA's public
HSTU inference shape (recsys-examples: 8 layers, 4 heads x 256, hidden 1024, bf16).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..config import check_int, parse_choice, resolve_dtype

__all__ = ["ModelPreset", "ModelShape", "PRESETS", "shape_of"]


class ModelPreset(str, enum.Enum):
    """The named sizes of :data:`PRESETS`."""

    SMALL = "small"
    NVIDIA_HSTU = "nvidia-hstu"


@dataclass(frozen=True)
class ModelShape:
    """The size of a benchmark ranker.

    Parameters
    ----------
    num_layers, hidden_dim, num_heads, head_dim : int
        Each >= 1 (the cache stores ``num_heads x head_dim`` K and V per token and layer).
    dtype : {"float32", "float16", "bfloat16"}
        Weights and KV pages.
    """

    num_layers: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_dim", "num_heads", "head_dim"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        object.__setattr__(self, "dtype", str(resolve_dtype(self.dtype)).removeprefix("torch."))

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of cached K and V of one token over all layers: ``num_layers * 2 * num_heads * head_dim * size``."""
        return self.num_layers * 2 * self.num_heads * self.head_dim * self.torch_dtype.itemsize

    def describe(self) -> str:
        """One line: ``8 layers, hidden 1024, 4 heads x 256, bfloat16, 32 KiB of KV per token``."""
        kib = self.kv_bytes_per_token / 1024
        return (f"{self.num_layers} layers, hidden {self.hidden_dim}, {self.num_heads} heads x {self.head_dim}, "
                f"{self.dtype}, {kib:g} KiB of KV per token")

    def config(self, **fields):
        """A :class:`~relaygr_engine.models.GRModelConfig` of this size (HSTU by default); ``fields`` add the
        vocabulary, ``max_seq_len`` and the rest."""
        from .config import GRModelConfig

        return GRModelConfig(**dict(dict(attention="hstu", num_layers=self.num_layers, hidden_dim=self.hidden_dim,
                                         num_heads=self.num_heads, head_dim=self.head_dim), **fields))


PRESETS: dict[ModelPreset, ModelShape] = {
    ModelPreset.SMALL: ModelShape(num_layers=2, hidden_dim=64, num_heads=2, head_dim=32, dtype="float32"),
    ModelPreset.NVIDIA_HSTU: ModelShape(num_layers=8, hidden_dim=1024, num_heads=4, head_dim=256, dtype="bfloat16"),
}


def shape_of(preset="small", *, num_layers: Optional[int] = None, hidden_dim: Optional[int] = None,
             num_heads: Optional[int] = None, head_dim: Optional[int] = None,
             dtype: Optional[str] = None) -> ModelShape:
    """The preset's shape with the sizes given replaced; ``hidden_dim`` follows ``num_heads x head_dim`` when either
    is given and it is not.

    Raises
    ------
    ValueError
        An unknown preset or a size that is not an integer >= 1 (naming it), an unknown dtype.
    """
    base = PRESETS[parse_choice(ModelPreset, preset, "preset")]
    heads = base.num_heads if num_heads is None else num_heads
    width = base.head_dim if head_dim is None else head_dim
    if hidden_dim is None and (num_heads is not None or head_dim is not None):
        hidden_dim = check_int("num_heads", heads, 1) * check_int("head_dim", width, 1)
    changes = {k: v for k, v in dict(num_layers=num_layers, hidden_dim=hidden_dim, num_heads=num_heads,
                                     head_dim=head_dim, dtype=dtype).items() if v is not None}
    return replace(base, **changes)
