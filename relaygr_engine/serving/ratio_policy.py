"""Live P:R control on Ray Serve: the ratio controller as an application-level autoscaling policy.

Every replica of a disaggregated app keeps a :class:`LoadWindow` of what it served (rankings, how many within the
SLO, queueing before the engine; pre-infers and their queueing; prefixes shipped and those that never served
their ranking) and hands it to Serve through ``record_autoscaling_stats`` (Serve's custom autoscaling metrics).
Serve's controller calls :class:`PoolRatioPolicy` on every autoscaling tick with both pools' contexts; once per
``window_s`` the policy turns the pools' metrics over Serve's look-back period into a
:class:`~relaygr_engine.policy.ratio.WindowStats` and feeds a
:class:`~relaygr_engine.policy.ratio.RatioController`. A move shifts one replica from one pool's target to the
other's (the total stays), and Serve starts and stops replicas as for any autoscaling decision, within each
pool's ``min_replicas``/``max_replicas``. No scheduler of our own: the decision is Serve's autoscaling target.

Serve takes application-level policies from a Serve config (``autoscaling_policy`` of the application), so an app
with live control is deployed from a config (:func:`relaygr_engine.serving.disaggregated.run_disaggregated` with
``ratio_control``; ``relaygr serve --ratio-control``), as ``serve deploy`` would.

This module imports nothing from Ray: the policy reads the attributes of Serve's ``AutoscalingContext``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from ..policy import _checks
from ..policy.ratio import RatioController, WindowStats

__all__ = ["LoadWindow", "window_stats", "PoolRatioPolicy", "pool_autoscaling_config", "POLICY_PATH"]

POLICY_PATH = "relaygr_engine.serving.ratio_policy:PoolRatioPolicy"
logger = logging.getLogger("ray.serve")  # the policy runs in Serve's controller: its moves go to the controller log


@dataclass
class LoadWindow:
    """What one replica served since Serve last collected its metrics (counts; waits summed in seconds).

    Attributes
    ----------
    rankings, rankings_in_slo : int
        Rankings answered, and those whose time in the replica was within the SLO.
    rank_wait_s : float
        Their summed queueing before the engine started them.
    prefills : int
        Pre-infers that reached the engine; ``prefill_wait_s`` their summed queueing.
    shipped : int
        Prefixes a pre-infer replica handed over (or tried to).
    late : int
        Shipped prefixes that served no ranking: a hand-over that landed nowhere, or a ranking whose ticket found
        its prefix gone (it computed the prefix).
    """

    rankings: int = 0
    rankings_in_slo: int = 0
    rank_wait_s: float = 0.0
    prefills: int = 0
    prefill_wait_s: float = 0.0
    shipped: int = 0
    late: int = 0

    def ranked(self, wait_s: float, latency_s: float, slo_s: float, missed_ticket: bool) -> None:
        """One ranking: queued ``wait_s``, ``latency_s`` in the replica, SLO ``slo_s``; ``missed_ticket``: it
        carried a ticket but computed its prefix."""
        self.rankings += 1
        self.rankings_in_slo += int(latency_s <= slo_s)
        self.rank_wait_s += wait_s
        self.late += int(missed_ticket)

    def prefilled(self, wait_s: float) -> None:
        """One pre-infer that reached the engine after queueing ``wait_s``."""
        self.prefills += 1
        self.prefill_wait_s += wait_s

    def handed_over(self, landed: bool) -> None:
        """One prefix shipped to the ranking pool; ``landed``: a ranking replica stored it."""
        self.shipped += 1
        self.late += int(not landed)

    def take(self) -> dict[str, float]:
        """The window as Serve's metrics (``name -> float``), and a fresh window started."""
        out = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, f.default)
        return out


def window_stats(*pool_metrics: Mapping[str, Mapping[Any, float]], min_rankings: float = 1.0) -> Optional[WindowStats]:
    """The controller's window from the pools' aggregated metrics (``name -> {replica: value}``, as in Serve's
    ``AutoscalingContext.aggregated_metrics``); None when fewer than ``min_rankings`` rankings were seen.

    Each value is a replica's mean per collection over Serve's look-back period, so sums over replicas are
    proportional to the pools' totals and their ratios are the window's shares and means.
    """
    total = {f.name: 0.0 for f in fields(LoadWindow)}
    for metrics in pool_metrics:
        for name in total:
            total[name] += sum(float(v) for v in (metrics or {}).get(name, {}).values())
    n = total["rankings"]
    if n <= 0 or n < min_rankings:
        return None
    return WindowStats(slo_attainment=min(1.0, total["rankings_in_slo"] / n),
                       rank_wait_s=total["rank_wait_s"] / n,
                       prefill_wait_s=total["prefill_wait_s"] / total["prefills"] if total["prefills"] > 0 else 0.0,
                       late_share=min(1.0, total["late"] / max(total["shipped"], 1.0)))


class PoolRatioPolicy:
    """Serve application-level autoscaling policy: one :class:`~relaygr_engine.policy.ratio.RatioController`
    over the live metrics of the pre-infer and ranking pools (module doc).

    Parameters
    ----------
    prefill_deployment, rank_deployment : str
        The pools' deployment names.
    target_attainment, max_late_share, patience
        The controller's (:class:`~relaygr_engine.policy.ratio.RatioController`).
    window_s : float
        Seconds (> 0) between the windows fed to the controller (Serve ticks far more often; set the pools'
        ``look_back_period_s`` to about the same).
    min_rankings : float
        A window with fewer rankings (>= 0, summed per-collection means) is not judged.

    The controller starts from the pools' targets as deployed and follows any change made outside it (a
    redeploy, bounds). While a pool is still starting or stopping replicas no window is judged.
    """

    def __init__(self, prefill_deployment: str = "RelayPrefill", rank_deployment: str = "RelayRank", *,
                 target_attainment: float = 0.99, max_late_share: float = 0.1, patience: int = 2,
                 window_s: float = 10.0, min_rankings: float = 1.0) -> None:
        for name, v in (("prefill_deployment", prefill_deployment), ("rank_deployment", rank_deployment)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a deployment name, got {v!r}")
        self.names = (prefill_deployment, rank_deployment)
        self.options = {"target_attainment": target_attainment, "max_late_share": max_late_share,
                        "patience": patience}
        RatioController.starting_at(1, 1, **self.options)  # checks the options now, not on Serve's first tick
        self.window_s = _checks.number("window_s", window_s, low=0.0, low_open=True)
        self.min_rankings = _checks.number("min_rankings", min_rankings, low=0.0)
        self.controller: Optional[RatioController] = None
        self.last_window: Optional[WindowStats] = None
        self.moves = 0
        self._next = 0.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "PoolRatioPolicy":
        """The policy from a dict of its keywords (a config's ``policy_kwargs``); unknown keys raise
        ``ValueError`` naming the valid ones."""
        import inspect

        if not isinstance(options, Mapping):
            raise ValueError(f"ratio control options must be a dict, got {type(options).__name__}")
        valid = [p for p in inspect.signature(cls).parameters]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"ratio control options {unknown} are unknown; valid: {valid}")
        return cls(**options)

    def _pools(self, contexts: Mapping[Any, Any]):
        by_name = {ctx.deployment_name: ctx for ctx in contexts.values()}
        return tuple(by_name.get(name) for name in self.names)

    def __call__(self, contexts: Mapping[Any, Any]) -> tuple[dict, dict]:
        """One Serve tick: ``{deployment_id: target replicas}`` for both pools, and no policy state."""
        pre, rank = self._pools(contexts)
        if pre is None or rank is None:  # not this app's pools: leave every target as it is
            return {dep: ctx.target_num_replicas for dep, ctx in contexts.items()}, {}
        now = pre.current_time if pre.current_time is not None else time.time()
        targets = (pre.target_num_replicas, rank.target_num_replicas)
        settled = all(c.current_num_replicas == c.target_num_replicas for c in (pre, rank))
        if self.controller is None or self.controller.split != targets:  # first tick, or changed outside
            self.controller = RatioController.starting_at(*targets, **self.options)
            self._next = now + self.window_s
        elif not settled:  # Serve is moving replicas: judge only windows measured on the pools as they are now
            self._next = now + self.window_s
        elif now >= self._next:
            self._next = now + self.window_s
            self.last_window = window_stats(pre.aggregated_metrics, rank.aggregated_metrics,
                                            min_rankings=self.min_rankings)
            if self.last_window is not None and self.controller.observe(self.last_window) is not None:
                self.moves += 1
                logger.info("ratio: pre-infer:ranking %d:%d -> %d:%d after %s", *targets, *self.controller.split,
                            self.last_window)
        n_p, n_d = self.controller.split
        return {pre.deployment_id: n_p, rank.deployment_id: n_d}, {}


def pool_autoscaling_config(replicas: int, total: int, *, window_s: float = 10.0,
                            metrics_interval_s: Optional[float] = None) -> dict:
    """A pool's Serve ``autoscaling_config`` under :class:`PoolRatioPolicy`: ``replicas`` to start, room for
    ``1 .. total - 1``, no extra delay (the controller's ``patience`` is the delay), Serve's look-back period
    ``window_s`` and a metrics push every ``metrics_interval_s`` (default: ``window_s / 4``)."""
    _checks.count("total", total, 2)
    _checks.count("replicas", replicas, 1, total)
    _checks.number("window_s", window_s, low=0.0, low_open=True)
    interval = window_s / 4 if metrics_interval_s is None else _checks.number(
        "metrics_interval_s", metrics_interval_s, low=0.0, low_open=True)
    return {"min_replicas": 1, "max_replicas": total - 1, "initial_replicas": replicas, "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.0, "look_back_period_s": float(window_s), "metrics_interval_s": float(interval)}
