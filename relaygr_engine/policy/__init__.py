"""Serving policies: the sequence-aware trigger (which prefixes to pre-infer), its latency model, and the
affinity-aware router (which replica serves a user)."""
from .latency import LatencyModel, LatencyPoint, calibrate, fit_coefficients
from .affinity import (AffinityRouter, ForwardResult, load_cap, order_bounded, pick_bounded, rank_replicas,
                     replica_weight)
from .trigger import SequenceAwareTrigger, TriggerConfig, TriggerDecision, TriggerReason

__all__ = ["LatencyModel", "LatencyPoint", "calibrate", "fit_coefficients", "SequenceAwareTrigger", "TriggerConfig",
           "TriggerDecision", "TriggerReason", "AffinityRouter", "ForwardResult", "rank_replicas", "order_bounded",
           "pick_bounded", "load_cap", "replica_weight"]
