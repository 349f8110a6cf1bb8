"""The shapes ``relaygr bench kernels`` times: a batch of users, each with a cached prefix, new history rows and
candidates, over paged K/V (the built-in sets, or one given as ``--shape``)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shape", "GPU_SHAPES", "CPU_SHAPES", "parse_shape"]


@dataclass(frozen=True)
class Shape:
    users: int
    prefix: int          # cached tokens per user
    new: int             # new history tokens per user
    cands: int           # candidates per user
    heads: int
    head_dim: int
    page_size: int
    mode: str            # "softmax" | "hstu"

    @property
    def name(self) -> str:
        return (f"{self.mode} B={self.users} P={self.prefix} n={self.new} C={self.cands} H={self.heads} "
                f"D={self.head_dim} page={self.page_size}")

    def visible_pairs(self) -> int:
        """(query, key) pairs a user's rows see, times users."""
        p, n, c = self.prefix, self.new, self.cands
        return self.users * (n * p + n * (n + 1) // 2 + c * (p + n + 1))


# Head dims 64 and 128 with 8 heads; 256 with 4 heads (NVIDIA's public HSTU inference configuration).
GPU_SHAPES = [Shape(4, p, 32, c, 8 if d < 256 else 4, d, 64, m) for m in ("softmax", "hstu")
              for p, c, d in ((4096, 256, 128), (4096, 1024, 64), (4096, 256, 256), (16384, 512, 128),
                              (16384, 1024, 64), (16384, 1024, 256))]
CPU_SHAPES = [Shape(2, 40, 5, 12, 2, 32, 16, m) for m in ("softmax", "hstu")]


_SHAPE_KEYS = {"B": "users", "P": "prefix", "n": "new", "C": "cands", "H": "heads", "D": "head_dim",
               "page": "page_size"}


def parse_shape(spec: str, mode: str) -> Shape:
    """A :class:`Shape` of ``mode`` from ``'B=1,P=3968,n=128,C=256,H=4,D=256[,page=64]'`` (commas or spaces
    between the fields); ValueError naming what is wrong."""
    fields = {"page_size": 64}
    for part in spec.replace(" ", ",").split(","):
        key, _, value = part.partition("=")
        if not part:
            continue
        if key not in _SHAPE_KEYS or not value.isdigit():
            raise ValueError(f"expected KEY=INTEGER with KEY in {list(_SHAPE_KEYS)}, got {part!r} in {spec!r}")
        fields[_SHAPE_KEYS[key]] = int(value)
    missing = [k for k, f in _SHAPE_KEYS.items() if f not in fields]
    if missing:
        raise ValueError(f"{spec!r} lacks {missing}")
    if min(fields[f] for f in ("users", "heads", "head_dim", "page_size")) < 1 or fields["new"] + fields["cands"] < 1:
        raise ValueError(f"{spec!r}: users, heads, head dim and page size must be >= 1, and new + candidates >= 1")
    return Shape(mode=mode, **fields)
