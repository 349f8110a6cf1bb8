"""Ranking workloads from real interaction logs: read a log (or synthesise one from a fitted profile), turn each
event into a ranking request with its user's earlier behaviors as the history, and time the stream at a target QPS.

The pipeline and its rules are :mod:`relaygr_engine.workload.build`'s module doc; ``relaygr workload fit`` and
``relaygr workload describe`` fit a profile from a CSV and print a log's statistics.
"""
from __future__ import annotations

from .build import build_workload, main
from .logs import InteractionLog, action_ids, compress_times, read_interactions, remap_items
from .profiles import DEFAULT_PROFILE, PROFILE_FORMAT, fit_profile, load_profile, save_profile, synthesize_interactions
from .requests import Request, Workload, WorkloadConfig

__all__ = ["InteractionLog", "WorkloadConfig", "Request", "Workload", "read_interactions", "remap_items",
           "action_ids", "compress_times", "build_workload", "fit_profile", "save_profile", "load_profile",
           "synthesize_interactions", "DEFAULT_PROFILE", "PROFILE_FORMAT", "main"]
