"""The engine's public records (tickets, requests, results), its counters and its internal bookkeeping."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from ..behaviors import Behaviors
from ..policy import _checks

__all__ = ["EngineCounters", "PrefixTicket", "RankRequest", "RankResult"]

Key = tuple  # (user_id, fingerprint) of a cache entry


@dataclass(frozen=True)
class PrefixTicket:
    """What ``prefill_prefix`` did; present it to ``rank_with_prefix`` to end the pre-infer lease.

    Attributes
    ----------
    admitted : bool
        The prefix is cached and leased.
    reason : str
        ``"admitted"``, ``"already_cached"``, ``"trigger:<reason>"``, ``"pool_full"`` or ``"budget"`` (see
        :mod:`relaygr_engine.engine`).
    user_id, fingerprint : int
        The cache key of the prefix.
    num_tokens : int
        History tokens in the prefix (contextual tokens + behaviors).
    expires_at : float or None
        Pool-clock time (``time.monotonic()`` seconds, or the ``now`` given) when the lease ends; None if not
        admitted.
    cached_tokens : int
        Tokens whose KV was already cached (reused, not recomputed).
    computed_tokens : int
        Tokens whose KV this prefill computed.
    """

    admitted: bool
    reason: str
    user_id: int
    fingerprint: int
    num_tokens: int
    expires_at: Optional[float]
    cached_tokens: int = 0
    computed_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.admitted, bool):
            raise ValueError(f"admitted must be a bool, got {type(self.admitted).__name__} {self.admitted!r}")
        if not isinstance(self.reason, str):
            raise ValueError(f"reason must be a str, got {type(self.reason).__name__}")
        object.__setattr__(self, "user_id", _checks.user_id(self.user_id))
        object.__setattr__(self, "fingerprint", _checks.u64("fingerprint", self.fingerprint))
        for name in ("num_tokens", "cached_tokens", "computed_tokens"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name)))
        if self.expires_at is not None:
            object.__setattr__(self, "expires_at", _checks.number("expires_at", self.expires_at))


@dataclass(frozen=True, eq=False)
class RankRequest:
    """One ranking request: a user's full current history and candidates.

    ``request_time`` is the candidates' timestamp in seconds (default: the last behavior's timestamp).
    """

    user_id: int
    history: Behaviors
    candidates: torch.Tensor
    ticket: Optional[PrefixTicket] = None
    request_time: Optional[int] = None


@dataclass(frozen=True, eq=False)
class RankResult:
    """Scores of one request and how they were computed.

    Attributes
    ----------
    scores : Tensor [C, num_tasks]
    source : str
        ``"hbm"`` (a prefix was reused from the device cache), ``"dram"`` (a prefix was reloaded from the host
        DRAM tier) or ``"recompute"`` (nothing reusable was cached).
    cached_tokens : int
        History tokens read from the cache.
    computed_tokens : int
        Rows computed now: the remaining history tokens plus the candidates.
    kv_dtype : str
        How the engine's cache stores K/V (:class:`~relaygr_engine.config.KVDtype`): ``"model"`` (scores equal full
        inference), or ``"int8"``/``"fp8_e4m3"`` (cached rows were read dequantised: scores are close to, not
        equal to, full inference).
    """

    scores: torch.Tensor
    source: str
    cached_tokens: int
    computed_tokens: int
    kv_dtype: str = "model"


@dataclass
class EngineCounters:
    """The engine's own counters (see :meth:`relaygr_engine.RelayEngine.stats` for their meaning)."""

    rank_requests: int = 0
    hbm_hits: int = 0
    dram_hits: int = 0
    recomputes: int = 0
    reloads: int = 0
    layered_reloads: int = 0
    reload_bytes: int = 0
    reloads_declined_cost: int = 0
    reloads_refused: int = 0
    spills: int = 0
    spill_bytes: int = 0
    spill_failures: int = 0
    reload_failures: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    candidates: int = 0
    extensions: int = 0
    late_tickets: int = 0
    stale_tickets: int = 0
    prefills: int = 0
    prefill_already_cached: int = 0
    prefill_declines: int = 0
    prefill_declines_trigger: int = 0
    prefill_declines_budget: int = 0
    prefill_declines_pool_full: int = 0
    prefill_computed_tokens: int = 0
    prefill_reused_tokens: int = 0
    prefill_copies: int = 0
    prefill_copied_tokens: int = 0
    prefill_dram_reloads: int = 0
    stored_on_rank: int = 0
    graph_replays: int = 0
    graph_captures: int = 0
    graph_eager: int = 0
    graph_evictions: int = 0
    graph_failures: int = 0
    prefill_graph_replays: int = 0
    prefill_graph_captures: int = 0
    compile_failures: int = 0
    compile_eager: int = 0
    exports: int = 0
    export_bytes: int = 0
    imports: int = 0
    import_bytes: int = 0
    imports_already_cached: int = 0
    imports_refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def count_ranking(self, source: str, cached: int, computed: int, candidates: int) -> None:
        """One ranking served from ``source`` (``"hbm"``, ``"dram"`` or ``"recompute"``)."""
        self.rank_requests += 1
        if source == "hbm":
            self.hbm_hits += 1
        elif source == "dram":
            self.dram_hits += 1
        else:
            self.recomputes += 1
        self.cached_tokens += cached
        self.computed_tokens += computed
        self.candidates += candidates

    def count_decline(self, reason: str) -> None:
        """One prefill not admitted, for ``reason`` (``"trigger:..."``, ``"budget"`` or ``"pool_full"``)."""
        self.prefill_declines += 1
        if reason.startswith("trigger:"):
            self.prefill_declines_trigger += 1
        elif reason == "budget":
            self.prefill_declines_budget += 1
        else:
            assert reason == "pool_full", reason
            self.prefill_declines_pool_full += 1


# ------------------------------------------------------------------------------------------ internal records
@dataclass(eq=False)
class Prepared:
    """A validated request.

    Its token keys (:meth:`Behaviors.token_keys`, ``[T, 4]``) are built on first use of :attr:`keys`: a ranking
    matched by its raw token arrays (:mod:`relaygr_engine.engine.index`) builds none, or only its new tokens' rows
    (:meth:`key_rows`).
    """

    user_id: int
    history: Behaviors
    candidates: Optional[torch.Tensor]
    request_time: Optional[int]
    ticket: Optional[PrefixTicket] = None
    num_tokens: int = -1  # the history's tokens T (-1: read from it)

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = self.history.num_tokens

    @property
    def keys(self) -> np.ndarray:
        """``Behaviors.token_keys()`` of the history (built once)."""
        keys = self.__dict__.get("_keys")
        if keys is None:
            keys = self.__dict__["_keys"] = self.history.token_keys()
        return keys

    def key_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start .. stop - 1`` of :attr:`keys` (from the whole table when built, else only those rows)."""
        keys = self.__dict__.get("_keys")
        return keys[start:stop] if keys is not None else self.history.token_keys(start, stop)


@dataclass(eq=False)
class Job:
    """Rows to compute for one request: history tokens ``start..T-1`` (+ candidates) over ``start`` cached ones.

    ``pages`` are read (their first ``ceil(start / page_size)`` hold the prefix); ``write_pages``, when set, are
    the pages of the entry the new history rows' K/V are stored in (tokens ``start..T-1``).
    """

    prep: Prepared
    start: int
    pages: Optional[np.ndarray]
    candidates: Optional[torch.Tensor]
    key: Optional[Key] = None  # the pinned entry read (rank) or written (prefill)
    index: int = 0
    write_pages: Optional[np.ndarray] = None

    @property
    def num_rows(self) -> int:
        return self.prep.num_tokens - self.start + (0 if self.candidates is None else self.candidates.numel())


class Hit(NamedTuple):
    """A cached entry ``(user, fp)`` of ``num_tokens`` tokens whose first ``usable`` tokens are the request's."""

    fp: int
    num_tokens: int
    usable: int


@dataclass(eq=False)
class Pin:
    """An entry a ranking batch holds pinned while it reads it."""

    key: Key
    pages: np.ndarray
    num_tokens: int
    broken: bool = False  # its KV could not be completed: free it
