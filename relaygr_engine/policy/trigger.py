"""Sequence-aware trigger: which requests get their prefix pre-inferred.

Pre-inference costs accelerator time, host work and pinned cache pages, so it is spent only where it pays: on
requests whose baseline ranking would put the SLO at risk. A request is *at risk* when the latency model predicts
its full inference above ``slo_ms * margin``; with ``margin <= 1`` this includes every history longer than the
longest one the baseline serves within the SLO (:meth:`SequenceAwareTrigger.max_servable_history_len`). An at-risk
request is admitted only while

* the pinned cache footprint plus this prefix stays within ``max_footprint_fraction`` of the pool's pages, and
* in-flight pre-inference work stays within the load bounds: tokens started per second over a sliding window
  (``max_prefill_tokens_per_s``) and pre-inferences started but not done (``max_inflight_prefills``).

Each decision carries its reason; :meth:`SequenceAwareTrigger.stats` counts decisions per reason.

Usage (what the engine does)::

    trig = SequenceAwareTrigger(LatencyModel.default("cpu"), TriggerConfig(slo_ms=50.0))
    d = trig.decide(history_len=L, num_candidates=None, prefix_pages=P, pinned_pages=pool.num_pinned_pages,
                    num_pages=pool.num_pages, reserve=True)   # reserve: count the prefill as started, atomically
    if d.admit:
        try:
            ...  # pre-infer
        finally:
            trig.on_prefill_done(L)
"""
from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass
from typing import Optional

from ..config import parse_choice
from . import _checks
from .latency import LatencyModel

__all__ = ["TriggerReason", "TriggerConfig", "TriggerDecision", "SequenceAwareTrigger"]


class TriggerReason(str, enum.Enum):
    """Why a pre-inference was admitted or declined."""

    AT_RISK = "at_risk"            # admitted: predicted baseline latency > slo_ms * margin, bounds respected
    NOT_AT_RISK = "not_at_risk"    # declined: the baseline meets the SLO with room to spare
    FOOTPRINT = "footprint"        # declined: pinned pages plus this prefix would pass the footprint bound
    LOAD = "load"                  # declined: in-flight pre-inference work is at its bound


@dataclass(frozen=True)
class TriggerConfig:
    """Thresholds of the sequence-aware trigger.

    Parameters
    ----------
    slo_ms : float
        Ranking latency objective in ms (> 0), e.g. the P99 budget of the ranking stage.
    margin : float
        In (0, 1]: a request is at risk when its predicted full-inference latency exceeds ``slo_ms * margin``.
        Lower pre-infers more requests (a safety margin for tail latency and queueing).
    expected_candidates : int
        Candidate count (>= 1) assumed when a decision is made before the candidates are known (at retrieval).
    max_footprint_fraction : float
        In (0, 1]: pinned pages plus the new prefix's pages must stay within this share of the pool.
    max_prefill_tokens_per_s : float, optional
        Bound (> 0) on pre-inferred tokens started per second, measured over the last ``rate_window_s`` seconds.
        A prefix larger than the whole window budget is still admitted when the window is empty, so long histories
        (the ones most at risk) are never starved. None: no rate bound.
    max_inflight_prefills : int, optional
        Bound (>= 1) on pre-inferences started and not yet done. None: no bound.
    rate_window_s : float
        Length of the sliding window of the rate bound in seconds (> 0).
    """

    slo_ms: float = 50.0
    margin: float = 0.5
    expected_candidates: int = 256
    max_footprint_fraction: float = 0.5
    max_prefill_tokens_per_s: Optional[float] = None
    max_inflight_prefills: Optional[int] = None
    rate_window_s: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "slo_ms", _checks.number("slo_ms", self.slo_ms, low=0.0, low_open=True))
        object.__setattr__(self, "margin", _checks.number("margin", self.margin, low=0.0, high=1.0, low_open=True))
        object.__setattr__(self, "expected_candidates",
                           _checks.count("expected_candidates", self.expected_candidates, 1))
        object.__setattr__(self, "max_footprint_fraction",
                           _checks.number("max_footprint_fraction", self.max_footprint_fraction,
                                          low=0.0, high=1.0, low_open=True))
        if self.max_prefill_tokens_per_s is not None:
            object.__setattr__(self, "max_prefill_tokens_per_s",
                               _checks.number("max_prefill_tokens_per_s", self.max_prefill_tokens_per_s,
                                              low=0.0, low_open=True))
        if self.max_inflight_prefills is not None:
            object.__setattr__(self, "max_inflight_prefills",
                               _checks.count("max_inflight_prefills", self.max_inflight_prefills, 1))
        object.__setattr__(self, "rate_window_s",
                           _checks.number("rate_window_s", self.rate_window_s, low=0.0, low_open=True))

    @property
    def threshold_ms(self) -> float:
        """Predicted latency above which a request is at risk: ``slo_ms * margin``."""
        return self.slo_ms * self.margin


@dataclass(frozen=True)
class TriggerDecision:
    """Outcome of :meth:`SequenceAwareTrigger.decide`.

    ``admit`` is True exactly when ``reason == "at_risk"``; ``reason`` is one of the :class:`TriggerReason` values
    (stored as its string); ``predicted_ms`` is the model's full-inference latency for the request.
    """

    admit: bool
    reason: str
    predicted_ms: float

    def __post_init__(self) -> None:
        reason = parse_choice(TriggerReason, self.reason, "reason")
        object.__setattr__(self, "reason", reason.value)
        if not isinstance(self.admit, bool):
            raise ValueError(f"admit must be a bool, got {self.admit!r}")
        if self.admit != (reason is TriggerReason.AT_RISK):
            raise ValueError(f"admit must be {reason is TriggerReason.AT_RISK} for reason {reason.value!r}, "
                             f"got {self.admit}")
        object.__setattr__(self, "predicted_ms", _checks.number("predicted_ms", self.predicted_ms, low=0.0))


class SequenceAwareTrigger:
    """Admits pre-inference for at-risk requests within footprint and load bounds. Thread-safe.

    Parameters
    ----------
    latency_model : LatencyModel
        Predicts full-inference latency on this device (see ``relaygr calibrate``).
    config : TriggerConfig
    """

    def __init__(self, latency_model: LatencyModel, config: TriggerConfig = TriggerConfig()) -> None:
        if not isinstance(latency_model, LatencyModel):
            raise ValueError(f"latency_model must be a LatencyModel, got {type(latency_model).__name__}")
        if not isinstance(config, TriggerConfig):
            raise ValueError(f"config must be a TriggerConfig, got {type(config).__name__}")
        self._model = latency_model
        self._cfg = config
        self._lock = threading.Lock()
        self._window: collections.deque[tuple[float, int]] = collections.deque()  # (start time, tokens)
        self._window_tokens = 0
        self._inflight = 0
        self._inflight_tokens = 0
        self._c = {"trigger_decisions": 0, "trigger_admits": 0, "trigger_declines": 0,
                   "trigger_prefills_started": 0, "trigger_prefills_done": 0}
        for r in TriggerReason:
            if r is not TriggerReason.AT_RISK:
                self._c["trigger_declines_" + r.value] = 0

    @property
    def latency_model(self) -> LatencyModel:
        return self._model

    @property
    def config(self) -> TriggerConfig:
        return self._cfg

    def predict_ms(self, history_len: int, num_candidates: Optional[int] = None) -> float:
        """Predicted full-inference latency; ``num_candidates=None`` uses ``config.expected_candidates``."""
        C = self._cfg.expected_candidates if num_candidates is None else num_candidates
        return self._model.predict_ms(history_len, C)

    def max_servable_history_len(self, num_candidates: Optional[int] = None) -> Optional[int]:
        """Longest history the baseline serves within ``slo_ms`` (see :meth:`LatencyModel.max_history_len`)."""
        C = self._cfg.expected_candidates if num_candidates is None else num_candidates
        return self._model.max_history_len(self._cfg.slo_ms, C)

    # ------------------------------------------------------------------ decisions
    def decide(self, *, history_len: int, num_candidates: Optional[int], prefix_pages: int, pinned_pages: int,
               num_pages: int, now: Optional[float] = None, reserve: bool = False) -> TriggerDecision:
        """Decide whether to pre-infer a prefix of ``history_len`` tokens.

        Parameters
        ----------
        history_len : int
            Tokens of the prefix to pre-infer (>= 0); also the tokens counted by the rate bound.
        num_candidates : int or None
            Candidates of the ranking request, or None when not yet known (``config.expected_candidates``).
        prefix_pages : int
            Pages the prefix would pin (>= 0).
        pinned_pages : int
            Pages pinned in the pool now (>= 0).
        num_pages : int
            Pages in the pool (>= 1).
        now : float, optional
            ``time.monotonic()`` seconds; tests pass it explicitly.
        reserve : bool
            When admitted, also record the prefill as started (as :meth:`on_prefill_start` would) under the same
            lock, so concurrent callers cannot overshoot the load bounds between deciding and starting.

        Returns
        -------
        TriggerDecision
            Reasons are checked in order: ``not_at_risk``, ``footprint``, ``load``; else ``at_risk`` (admitted).
        """
        L = _checks.count("history_len", history_len)
        C = self._cfg.expected_candidates if num_candidates is None else _checks.count("num_candidates",
                                                                                        num_candidates)
        prefix_pages = _checks.count("prefix_pages", prefix_pages)
        pinned_pages = _checks.count("pinned_pages", pinned_pages)
        num_pages = _checks.count("num_pages", num_pages, 1)
        t = _checks.clock(now)
        predicted = self._model.predict_ms(L, C)
        cfg = self._cfg
        with self._lock:
            if predicted <= cfg.threshold_ms:
                reason = TriggerReason.NOT_AT_RISK
            elif pinned_pages + prefix_pages > cfg.max_footprint_fraction * num_pages:
                reason = TriggerReason.FOOTPRINT
            elif self._over_load(L, t):
                reason = TriggerReason.LOAD
            else:
                reason = TriggerReason.AT_RISK
                if reserve:
                    self._start(L, t)
            admit = reason is TriggerReason.AT_RISK
            self._c["trigger_decisions"] += 1
            if admit:
                self._c["trigger_admits"] += 1
            else:
                self._c["trigger_declines"] += 1
                self._c["trigger_declines_" + reason.value] += 1
        return TriggerDecision(admit=admit, reason=reason.value, predicted_ms=predicted)

    def _prune(self, now: float) -> None:
        horizon = now - self._cfg.rate_window_s
        while self._window and self._window[0][0] <= horizon:
            self._window_tokens -= self._window.popleft()[1]

    def _over_load(self, tokens: int, now: float) -> bool:
        cfg = self._cfg
        if cfg.max_inflight_prefills is not None and self._inflight >= cfg.max_inflight_prefills:
            return True
        if cfg.max_prefill_tokens_per_s is not None:
            self._prune(now)
            budget = cfg.max_prefill_tokens_per_s * cfg.rate_window_s
            if self._window_tokens > 0 and self._window_tokens + tokens > budget:
                return True
        return False

    def _start(self, tokens: int, now: float) -> None:
        self._prune(now)
        self._window.append((now, tokens))
        self._window_tokens += tokens
        self._inflight += 1
        self._inflight_tokens += tokens
        self._c["trigger_prefills_started"] += 1

    # ------------------------------------------------------------------ load accounting
    def on_prefill_start(self, tokens: int, now: Optional[float] = None) -> None:
        """Record a pre-inference of ``tokens`` tokens starting (not needed after ``decide(reserve=True)``)."""
        tokens = _checks.count("tokens", tokens)
        t = _checks.clock(now)
        with self._lock:
            self._start(tokens, t)

    def on_prefill_done(self, tokens: int, now: Optional[float] = None) -> None:
        """Record a started pre-inference of ``tokens`` tokens finishing (successfully or not).

        Raises ValueError when no pre-inference is in flight or ``tokens`` exceeds the in-flight tokens.
        """
        tokens = _checks.count("tokens", tokens)
        t = _checks.clock(now)
        with self._lock:
            if self._inflight == 0:
                raise ValueError("on_prefill_done called with no pre-inference in flight (started 0, not done)")
            if tokens > self._inflight_tokens:
                raise ValueError(f"tokens must be <= the in-flight pre-inference tokens ({self._inflight_tokens}), "
                                 f"got {tokens}")
            self._inflight -= 1
            self._inflight_tokens -= tokens
            self._c["trigger_prefills_done"] += 1
            self._prune(t)

    def stats(self, now: Optional[float] = None) -> dict:
        """Counters (decisions, admits, declines, per reason, prefills started/done) and gauges (in-flight
        prefills and tokens, tokens started within the rate window as of ``now``)."""
        t = _checks.clock(now)
        with self._lock:
            self._prune(t)
            out = dict(self._c)
            out["trigger_inflight_prefills"] = self._inflight
            out["trigger_inflight_prefill_tokens"] = self._inflight_tokens
            out["trigger_window_prefill_tokens"] = self._window_tokens
        return out

    def __repr__(self) -> str:
        return f"SequenceAwareTrigger(config={self._cfg!r}, model=({self._model.a:.4g}, {self._model.b:.4g}, " \
               f"{self._model.c:.4g}, {self._model.d:.4g}) ms on {self._model.device!r})"
