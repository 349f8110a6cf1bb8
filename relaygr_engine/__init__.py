"""relaygr-engine: relay-race inference for generative-recommendation rankers.

A user's long-term behavior prefix is pre-inferred early (at retrieval), its per-layer KV stays resident in device
memory as pages, and the ranking stage computes only the new tokens and the candidates against the cached prefix.
"""
from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

# Public names and the module that defines each; resolved on first access so `import relaygr_engine` stays cheap.
_EXPORTS = {
    "CacheConfig": ".config",
    "AttentionBackend": ".config",
    "GraphConfig": ".config",
    "KVDtype": ".config",
    "PrefixBlockPool": "._ext",
    "PagedKVCache": ".cache",
    "GRModelConfig": ".models",
    "Behaviors": ".behaviors",
    "RelayBatch": ".batch",
    "PrefixAttention": ".attention.layer",
    "batch_context": ".attention.context",
    "GRRanker": ".models",
    "build_ranker": ".models",
    "RelayEngine": ".engine",
    "PrefixTicket": ".engine",
    "RankRequest": ".engine",
    "PackedPrefix": ".engine",
    "RankResult": ".engine",
    "paged_prefix_attention": ".attention.ops",
    "SequenceAwareTrigger": ".policy",
    "TriggerConfig": ".policy",
    "LatencyModel": ".policy",
    "AffinityRouter": ".policy",
    "HostKVTier": ".tiers",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
