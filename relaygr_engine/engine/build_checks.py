"""What a :class:`~relaygr_engine.engine.core.RelayEngine` checks and derives from its model and config when it is
built: the model's device, the one cache shape its layers share, prefix stability, and the CUDA-graph setting."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import AttentionBackend, CacheConfig, GraphConfig
from ..attention.ops import _resolve_backend

__all__ = ["cache_shape", "check_prefix_stable", "graph_config", "model_device", "same_device"]


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def model_device(model: nn.Module) -> Optional[torch.device]:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


def cache_shape(layers) -> tuple[int, int]:
    """``(num_heads, cache_dim)`` shared by every layer (one paged cache shape for all layers)."""
    H, D = layers[0].num_heads, layers[0].cache_dim
    for i, m in enumerate(layers):
        if (m.num_heads, m.cache_dim) != (H, D):
            raise ValueError(f"every PrefixAttention layer must cache {H} heads x {D} (layer 0's), got layer {i} "
                             f"with {m.num_heads} heads x {m.cache_dim}")
    return H, D


def check_prefix_stable(model: nn.Module, layers) -> None:
    """ValueError unless every layer is prefix-stable and the model declares no ``prefix_unstable_features``."""
    names = {id(m): n for n, m in model.named_modules()}
    found = [f"{names.get(id(m), '?')}: hstu_norm='batch' (a per-batch normaliser)" for m in layers
             if not getattr(m, "prefix_stable", True)]
    found += [str(f) for f in getattr(model, "prefix_unstable_features", ())]
    if found:
        raise ValueError("model must be prefix-stable (a cached row's output may not depend on rows computed after "
                         f"it) to be served over cached prefixes; {type(model).__name__} has: {'; '.join(found)}. "
                         "Serve it without a RelayEngine, or replace these features (see docs/hstu_variants.md)")


def graph_config(cuda_graphs, cache_config: CacheConfig) -> Optional[GraphConfig]:
    """The engine's ``cuda_graphs`` argument as a config (None: off); ValueError where graphs cannot run."""
    if cuda_graphs is False or cuda_graphs is None:
        return None
    if cuda_graphs is True:
        cuda_graphs = GraphConfig()
    if not isinstance(cuda_graphs, GraphConfig):
        raise ValueError(f"cuda_graphs must be a bool or a GraphConfig, got {type(cuda_graphs).__name__}")
    dev = torch.device(cache_config.device)
    if dev.type != "cuda" or _resolve_backend(cache_config.attention_backend, dev) is not AttentionBackend.TRITON:
        raise ValueError(f"cuda_graphs needs a CUDA cache with the Triton attention backend, got device "
                         f"{cache_config.device!r} with attention_backend={cache_config.attention_backend.value!r}")
    return cuda_graphs
