"""What every Ray Serve replica builds: :class:`ReplicaSpec` (model, weights, cache, trigger, limits), shared by
:mod:`~relaygr_engine.serving.ray_serve` (which re-exports it) and :mod:`~relaygr_engine.serving.disaggregated`."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Mapping, Optional, Union

import torch

from ..config import CacheConfig
from ..engine import RelayEngine
from ..models import GRModelConfig, build_ranker
from ..policy import _checks
from ..policy.latency import LatencyModel
from ..policy.trigger import SequenceAwareTrigger, TriggerConfig
from . import wire
from .chunked_prefill import WholePrefixTrigger

__all__ = ["ReplicaSpec"]


def _from(cls, name: str, value):
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"{name} has unknown fields {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**value)
    raise ValueError(f"{name} must be a {cls.__name__} or a dict of its fields, got {type(value).__name__}")


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds.

    Parameters
    ----------
    model : GRModelConfig or dict
    seed : int
        ``build_ranker`` seed (the weights when no ``state_dict_path`` is given).
    state_dict_path : str, optional
        A ``torch.save``-d ``state_dict`` loaded into the model (a path every node can read).
    cache : CacheConfig or dict
        The replica's cache; its ``device`` is where the model runs.
    trigger : TriggerConfig or dict, optional
        Pre-inference admission (:class:`~relaygr_engine.policy.trigger.SequenceAwareTrigger`); None admits every
        pre-infer the pool can take.
    latency_profile : str, optional
        The trigger's latency profile (``relaygr calibrate``); default: the profile shipped for the device type.
    torch_threads : int
        ``torch.set_num_threads`` in the replica (>= 1).
    max_pending_prefills : int, optional
        Pre-infers a replica holds at once (queued or running, >= 1); one more is rejected immediately. None: no
        bound.
    slo_ms : float
        The ranking latency objective (> 0) a replica measures its rankings against (time in the replica), for
        the live ratio policy (:mod:`~relaygr_engine.serving.ratio_policy`).
    limits : RequestLimits or dict
        What one request may hold (body bytes, JSON nesting, candidates, history entries), checked before it is
        parsed into tensors (:class:`~relaygr_engine.serving.wire.RequestLimits`; default: its defaults, with the
        history bounded by the model's ``max_seq_len``).
    store_misses : bool
        Keep the history K/V of rankings that found nothing cached (``RelayEngine(store_misses=...)``).
    max_kept_prefixes : int
        Prefixes of leased tickets kept for rankings by difference (>= 0; 0: every such ranking is answered 409
        and resent whole; :class:`~relaygr_engine.serving.prefix_store.PrefixStore`).
    prefill_chunk_tokens : int
        Pre-infer in chunks of at most this many new tokens, a waiting ranking going between two chunks (>= 0;
        0: one call; :mod:`~relaygr_engine.serving.chunked_prefill`).
    """

    model: Union[GRModelConfig, dict]
    seed: int = 0
    state_dict_path: Optional[str] = None
    cache: Union[CacheConfig, dict] = CacheConfig()
    trigger: Union[TriggerConfig, dict, None] = None
    latency_profile: Optional[str] = None
    torch_threads: int = 1
    max_pending_prefills: Optional[int] = None
    slo_ms: float = 100.0
    limits: Union[wire.RequestLimits, dict] = wire.RequestLimits()
    store_misses: bool = False
    max_kept_prefixes: int = 4096
    prefill_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _from(GRModelConfig, "model", self.model))
        object.__setattr__(self, "limits", _from(wire.RequestLimits, "limits", self.limits))
        object.__setattr__(self, "cache", _from(CacheConfig, "cache", self.cache))
        if self.trigger is not None:
            object.__setattr__(self, "trigger", _from(TriggerConfig, "trigger", self.trigger))
        _checks.count("seed", self.seed)
        _checks.count("torch_threads", self.torch_threads, 1)
        if self.max_pending_prefills is not None:
            _checks.count("max_pending_prefills", self.max_pending_prefills, 1)
        object.__setattr__(self, "slo_ms", _checks.number("slo_ms", self.slo_ms, low=0.0, low_open=True))
        _checks.count("max_kept_prefixes", self.max_kept_prefixes)
        _checks.count("prefill_chunk_tokens", self.prefill_chunk_tokens)
        if not isinstance(self.store_misses, bool):
            raise ValueError(f"store_misses must be a bool, got {type(self.store_misses).__name__}")
        for name in ("state_dict_path", "latency_profile"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path or None, got {type(v).__name__}")

    def to_json(self) -> dict:
        """The spec as JSON-ready fields (``ReplicaSpec(**spec.to_json())`` builds it again), e.g. for the
        arguments of a Serve config."""
        def plain(v):
            if is_dataclass(v):
                return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
            if isinstance(v, Enum):
                return v.value
            if isinstance(v, torch.dtype):
                return str(v).removeprefix("torch.")
            return os.fspath(v) if isinstance(v, os.PathLike) else v

        return plain(self)

    def build_engine(self) -> RelayEngine:
        """The model (seeded, or loaded from ``state_dict_path``), its trigger and engine, on the cache device."""
        device = self.cache.device
        model = build_ranker(self.model, seed=self.seed, device=device)
        if self.state_dict_path is not None:
            model.load_state_dict(torch.load(self.state_dict_path, map_location=device, weights_only=True))
        trigger = None
        if self.trigger is not None:
            lat = (LatencyModel.load(self.latency_profile) if self.latency_profile is not None
                   else LatencyModel.default(device))
            trigger = SequenceAwareTrigger(lat, self.trigger)
            if self.prefill_chunk_tokens:  # the chunks of one pre-infer are judged once, on the whole prefix
                trigger = WholePrefixTrigger(trigger, self.cache.page_size)
        return RelayEngine(model, self.cache, trigger, store_misses=self.store_misses)
