"""The attention stack: the layer a user's model calls, the forward context the engine sets, the registered op
that reads and writes pages, the choice of backend and kernel for a batch, the checks, and the torch references.

==================================  =================================================================================
``layer.PrefixAttention``           the ``nn.Module`` a ranker calls where its attention was
``context``                         the forward context (``batch_context`` for dense forwards, ``paged_context``)
``op``                              ``relaygr::prefix_attention``: a layer's whole relay attention as one opaque op
``ops.paged_prefix_attention``      the public op over a paged cache (torch reference, Triton kernel, or auto)
``plan``                            what a batch's attention runs, and why (:func:`plan.describe`)
``torch_plan``, ``reference``       the torch path: a batch's gather plan, and the per-user reference
``checks``, ``time_buckets``        argument checks; HSTU's time-bias buckets
==================================  =================================================================================

The Triton kernels are :mod:`relaygr_engine.kernels`. Importing this package imports none of its modules: each
name below loads its module on first access.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "PrefixAttention": ".layer",
    "find_layers": ".layer",
    "ForwardContext": ".context",
    "batch_context": ".context",
    "current_context": ".context",
    "paged_prefix_attention": ".ops",
    "plan_paged_attention": ".ops",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
