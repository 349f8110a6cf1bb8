"""The served model's forward, compiled when it can be: ``torch.compile`` of the whole ranker, eager fallback.

A ranker built on :class:`~relaygr_engine.PrefixAttention` + :class:`~relaygr_engine.RelayBatch` compiles as one
graph (``fullgraph=True, dynamic=True``): each attention layer is one opaque op (``relaygr::prefix_attention``)
and the rest of the model (projections, norms, gates, heads) is fused around it. A model that cannot be compiled
(a graph break under ``fullgraph``, a backend failure) is served eagerly from then on: its forward is run again
eagerly (the op's writes are the same K/V again), the reason is logged once and ``stats()`` counts
``compile_failures`` and ``compile_eager``. A failure the eager forward repeats is the model's own error (bad input
for it): it is raised, and compilation stays on.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

__all__ = ["ModelCaller", "eager_module"]

_log = logging.getLogger("relaygr_engine")


def eager_module(model: nn.Module) -> nn.Module:
    """The eager module under a ``torch.compile``'d one (the model itself when it is not compiled)."""
    return getattr(model, "_orig_mod", model)


class ModelCaller:
    """Calls the served model on a batch: its compiled form when there is one, else the eager module.

    Parameters
    ----------
    model : nn.Module
        The ranker, or a ``torch.compile``'d ranker (then served as given).
    compile_model : bool
        Compile ``model`` here: ``torch.compile(model, fullgraph=True, dynamic=True)``.
    counters : object
        The engine's counters (``compile_failures``, ``compile_eager``).
    """

    def __init__(self, model: nn.Module, compile_model: bool, counters) -> None:
        self.eager = eager_module(model)
        self.compiled: Optional[nn.Module] = model if model is not self.eager else None
        if compile_model and self.compiled is None:
            self.compiled = torch.compile(self.eager, fullgraph=True, dynamic=True)
        self.counters = counters
        self.disabled: Optional[str] = None

    @property
    def is_compiled(self) -> bool:
        """Whether forwards run compiled (False without a compiled model, or after a failure)."""
        return self.compiled is not None and self.disabled is None

    def __call__(self, batch):
        if self.compiled is None:
            return self.eager(batch)
        if self.disabled is not None:
            self.counters.compile_eager += 1
            return self.eager(batch)
        try:
            return self.compiled(batch)
        except torch._dynamo.exc.TorchDynamoException as exc:
            out = self.eager(batch)  # raises the model's own error when the input is at fault
            self.disabled = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.counters.compile_failures += 1
            self.counters.compile_eager += 1
            _log.warning("compiled model: serving forwards eagerly from now on (%s)", self.disabled)
            return out
