"""``RelayEngine``: the public API and its lock; the steps live beside it (index, prefill, tiers, forward)."""
from __future__ import annotations

import hashlib
import threading
from typing import Optional, Sequence, Union

import torch
from torch import nn

from ..batch import check_request
from ..behaviors import Behaviors
from ..config import CacheConfig, GraphConfig
from ..attention.layer import find_layers
from ..identity import WeightsIdentity
from ..policy._checks import clock as _clock
from ..policy._checks import user_id as _user_id
from .build_checks import cache_shape, check_prefix_stable, graph_config, model_device, same_device
from .compiled import eager_module
from .forward import ForwardRunner
from .index import PrefixIndex
from .prefill import PrefillPlanner
from .rank import RankPlanner
from .records import Job, Pin, Prepared, PrefixTicket, RankRequest, RankResult
from .tiers import CacheState
from .transfer import PackedPrefix, check_packed, pack_entry, store_packed

__all__ = ["RelayEngine"]


class RelayEngine:
    """Relay-race inference for one ranker over a paged prefix-KV cache.

    Parameters
    ----------
    model : nn.Module
        A ranker holding :class:`~relaygr_engine.attention.layer.PrefixAttention` layers, called as
        ``model(batch) -> scores [number of candidate rows, num_tasks]`` (see :mod:`relaygr_engine.engine`), on the
        cache's device; or such a ranker compiled with ``torch.compile`` (served compiled, see ``compile_model``). A
        model with a ``check_inputs(history, candidates, request_time)`` method (like
        :class:`~relaygr_engine.models.GRRanker`) has it called on every request before any state changes.
        A model whose outputs are not prefix-stable is refused with ``ValueError``: a layer with
        ``hstu_norm="batch"``, or a model listing features in a ``prefix_unstable_features`` attribute (e.g.
        positions counted from the end, query-time-relative features, a bidirectional contextual block).
    cache_config : CacheConfig, optional
        Where and how the cache lives (default ``CacheConfig()``: CPU, fp32, 4096 pages of 16 tokens).
    trigger : object, optional
        Pre-inference admission hook (see :mod:`relaygr_engine.engine`); None admits every prefill the pool can take.
    extend_on_rank : bool
        Append the new history tokens' KV to the reused entry while ranking (default True).
    store_misses : bool
        Keep the history KV of a ranking that found nothing cached as a new evictable entry (default False: it
        may evict the least recently used entry; relay serving under load turns it on so that the cache keeps
        up when pre-inferences are dropped).
    model_version : str, optional
        The model part of every prefix fingerprint. Default: a hash of the model's state dict, recomputed when a
        tensor of it changes. Give a version string when the weights are managed elsewhere (and change it with
        them: cached prefixes of another version are never reused).
    compile_attention : bool
        Torch backend: run each layer's attention over the batch plan through ``torch.compile`` (dynamic shapes;
        :func:`relaygr_engine.attention.torch_plan.compiled_core`). Default False. The first calls of each kind (dtype,
        mode, single or batched) compile, about a minute on a CPU; ``relaygr bench overhead --compile`` measures
        what it gains on a machine.
    compile_model : bool
        Compile the whole model: ``torch.compile(model, fullgraph=True, dynamic=True)``, each layer's attention one
        opaque op (:mod:`relaygr_engine.attention.op`), so the model's projections, norms and gates fuse around it.
        Default False. The first forwards of each kind (prefill, ranking, batch) compile (seconds to a minute on
        a CPU). A model that cannot be compiled is served eagerly from then on (logged once; ``stats()`` counts
        ``compile_failures`` and ``compile_eager``); the same holds for a model given compiled.
    cuda_graphs : bool or GraphConfig
        Serve ranking forwards through CUDA graphs over padded shape buckets (:mod:`relaygr_engine.engine.graphs`):
        each bucket's first ranking runs eagerly and is captured, later ones replay it in one launch. True means
        ``GraphConfig()``. Needs a CUDA cache with the Triton backend. Default False. ``stats()`` counts
        ``graph_replays``, ``graph_captures``, ``graph_evictions``, and ``graph_eager``/``graph_failures``
        (forwards served eagerly after a model could not be captured; the reason is logged once).
    """

    def __init__(self, model: nn.Module, cache_config: Optional[CacheConfig] = None, trigger=None, *,
                 extend_on_rank: bool = True, store_misses: bool = False,
                 model_version: Optional[str] = None, compile_attention: bool = False,
                 compile_model: bool = False, cuda_graphs: Union[bool, GraphConfig] = False) -> None:
        layers = find_layers(eager_module(model))
        if not layers:
            raise ValueError(f"model must hold at least one relaygr_engine.PrefixAttention layer (where its "
                             f"attention call was), got a {type(model).__name__} without one")
        cache_config = CacheConfig() if cache_config is None else cache_config
        if not isinstance(cache_config, CacheConfig):
            raise ValueError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
        dev = model_device(model)
        if dev is not None and not same_device(dev, torch.device(cache_config.device)):
            raise ValueError(f"model must be on the cache device {cache_config.device}, got {dev}")
        if trigger is not None and not all(callable(getattr(trigger, m, None)) for m in ("decide", "on_prefill_done")):
            raise ValueError(f"trigger must be None or have decide(...) and on_prefill_done(...) methods, got "
                             f"{type(trigger).__name__}")
        if not isinstance(compile_attention, bool):
            raise ValueError(f"compile_attention must be a bool, got {compile_attention!r}")
        if not isinstance(compile_model, bool):
            raise ValueError(f"compile_model must be a bool, got {compile_model!r}")
        graphs = graph_config(cuda_graphs, cache_config)
        if model_version is not None and not (isinstance(model_version, str) and model_version):
            raise ValueError(f"model_version must be a non-empty string or None, got {model_version!r}")
        check_prefix_stable(eager_module(model), layers)
        H, D = cache_shape(layers)
        self.model = model
        self.layers = layers
        self.config = cache_config
        self.trigger = trigger
        self.extend_on_rank = bool(extend_on_rank)
        self.store_misses = bool(store_misses)
        self.model_version = model_version
        self._weights = None if model_version is not None else WeightsIdentity(model)
        self.state = CacheState.build(cache_config, len(layers), H, D)
        self.cache, self.dram, self.expander = self.state.cache, self.state.dram, self.state.expander
        self.pool, self.page_size = self.cache.pool, self.cache.page_size
        self._kv_bits = 8 if self.cache.kv_dtype.quantized else torch.finfo(self.cache.dtype).bits
        self.index = PrefixIndex(self.pool, self.dram, self.model_identity)
        self.prefill = PrefillPlanner(self.state, self.index, trigger)
        self.ranking = RankPlanner(self.state, self.index)
        self.runner = ForwardRunner(model, layers, self.state, compile_attention=compile_attention,
                                    compile_model=compile_model, graphs=graphs)
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return (f"RelayEngine(model={type(self.model).__name__}, layers={len(self.layers)}, cache={self.cache!r}, "
                f"trigger={type(self.trigger).__name__ if self.trigger else None})")

    def model_identity(self) -> int:
        """The model part of prefix fingerprints (64 bits): ``model_version``'s hash, or the state dict's."""
        if self._weights is None:
            return int.from_bytes(hashlib.blake2b(self.model_version.encode(), digest_size=8).digest(), "little")
        return self._weights.value

    def reset(self) -> None:
        """Empty the cache and zero the counters: afterwards the engine serves as a freshly built one with the same
        arguments would, but keeps what is paid once (the compiled model, captured CUDA graphs, the page memory).

        Every entry leaves both tiers (pending tickets go stale), leases end, the expander forgets its measured
        costs and every ``stats()`` counter restarts at zero. The trigger, if any, is the caller's to reset.
        """
        with self._lock:
            self.state.reset()
            self.pool, self.dram, self.expander = self.state.pool, self.state.dram, self.state.expander
            self.index.reset(self.pool, self.dram)
            self.runner.timer.pending.clear()   # spans of earlier work: not this run's costs

    def mark_weights_changed(self) -> None:
        """Rehash the model's state on the next call (after replacing a submodule or editing ``.data``)."""
        if self._weights is not None:
            self._weights.invalidate()

    # ------------------------------------------------------------------------------------------ prefill
    def prefill_prefix(self, user_id: int, history: Behaviors, now: Optional[float] = None) -> PrefixTicket:
        """Pre-infer ``history`` (a user's prefix) and keep its per-layer KV cached under a lease.

        Parameters
        ----------
        user_id : int
            In ``[0, 2**64)``.
        history : Behaviors
            The prefix, oldest first.
        now : float, optional
            Pool-clock time in seconds (default ``time.monotonic()``).

        Returns
        -------
        PrefixTicket

        Raises
        ------
        ValueError
            Bad input, before any cache state changes.
        """
        return self.prefill_prefix_batch([(user_id, history)], now=now)[0]

    def prefill_prefix_batch(self, items: Sequence[tuple[int, Behaviors]],
                             now: Optional[float] = None) -> list[PrefixTicket]:
        """:meth:`prefill_prefix` for many ``(user_id, history)`` pairs in one varlen forward.

        Equal to calling :meth:`prefill_prefix` on each item in order. Every item is validated before any cache
        state changes.
        """
        preps = []
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"items[{i}] must be a (user_id, history) pair, got {type(item).__name__}")
            preps.append(self._prepare(item[0], item[1]))
        t = _clock(now)
        c, ttl = self.state.counters, self.config.lease_ttl_s
        with self._lock, torch.inference_mode(), self.index.held():
            self.state.spill_expired(t)
            tickets: list[Optional[PrefixTicket]] = [None] * len(preps)
            jobs: list[Job] = []
            pending: set = set()  # entries created or extended in this batch (KV not written yet)
            try:
                for i, p in enumerate(preps):
                    tickets[i], job = self.prefill.plan(p, t, pending)
                    if job is not None:
                        job.index = i
                        jobs.append(job)
                        pending.add(job.key)
                self.runner.run(jobs)
            except BaseException:
                for job in jobs:
                    self.state.drop(job.key, t)
                    self.prefill.done(job.prep, t)
                raise
            for job in jobs:
                self.prefill.done(job.prep, t)
                p, fp = job.prep, job.key[1]
                if job.start:  # extended an entry: lease it now (never refused while we hold a reference)
                    self.pool.lease(p.user_id, fp, ttl, now=t)
                self.pool.unpin(p.user_id, fp, now=t)
                T = p.num_tokens
                tickets[job.index] = PrefixTicket(True, "admitted", p.user_id, fp, T, t + ttl,
                                                  cached_tokens=job.start, computed_tokens=T - job.start)
                if self.dram is not None:
                    self.state.leased[(p.user_id, fp)] = t + ttl
                c.prefills += 1
                c.prefill_computed_tokens += T - job.start
                c.prefill_reused_tokens += job.start
            return tickets

    # ------------------------------------------------------------------------------------------ transfer
    def export_prefix(self, ticket: PrefixTicket, history: Behaviors,
                      now: Optional[float] = None) -> Optional[PackedPrefix]:
        """Pack the prefix an admitted ticket of this engine names, for another engine's :meth:`import_prefix`.

        Ends the ticket's lease here (the entry stays cached and evictable, so the user's next pre-infer extends
        it). See :mod:`relaygr_engine.engine.transfer`.

        Parameters
        ----------
        ticket : PrefixTicket
            Admitted, from :meth:`prefill_prefix` on this engine.
        history : Behaviors
            The pre-inferred prefix (``ticket.num_tokens`` tokens).
        now : float, optional

        Returns
        -------
        PackedPrefix or None
            None when the entry is gone (its lease ran out and it was evicted).
        """
        if not isinstance(ticket, PrefixTicket) or not ticket.admitted:
            raise ValueError(f"ticket must be an admitted PrefixTicket, got {ticket!r}")
        p = self._prepare(ticket.user_id, history)
        if p.num_tokens != ticket.num_tokens:
            raise ValueError(f"history must be the ticket's {ticket.num_tokens}-token prefix, got {p.num_tokens} "
                             f"tokens")
        t = _clock(now)
        with self._lock, torch.inference_mode():
            return pack_entry(self.state, self.index.fingerprint(p, p.num_tokens), ticket, t)

    def import_prefix(self, history: Behaviors, packed: PackedPrefix, now: Optional[float] = None) -> PrefixTicket:
        """Store a prefix packed by another engine (:meth:`export_prefix`) in this cache under a lease.

        A ranking then reads it as a device-cache hit. ``reason``: ``"admitted"`` (unpacked into new pages),
        ``"already_cached"`` (this cache holds it: leased, nothing copied), ``"pool_full"`` or ``"budget"`` (not
        admitted, as for :meth:`prefill_prefix`).

        Raises
        ------
        ValueError
            ``packed`` is not ``history``'s prefix under this model, or does not fit this cache's layout; before
            any state changes.
        """
        if not isinstance(packed, PackedPrefix):
            raise ValueError(f"packed must be a PackedPrefix, got {type(packed).__name__}")
        p = self._prepare(packed.user_id, history)
        t = _clock(now)
        with self._lock, torch.inference_mode():
            fp = self.index.fingerprint(p, p.num_tokens)
            check_packed(self.state, packed, p, fp)
            self.state.spill_expired(t)
            return store_packed(self.state, self.index, self.prefill, p, packed, t)

    # ------------------------------------------------------------------------------------------ ranking
    def rank_with_prefix(self, user_id: int, history: Behaviors, candidates: torch.Tensor,
                         ticket: Optional[PrefixTicket] = None, request_time: Optional[int] = None,
                         now: Optional[float] = None) -> RankResult:
        """Score ``candidates`` for a user, reusing the longest cached prefix of ``history``.

        Parameters
        ----------
        user_id : int
        history : Behaviors
            The user's full current history (the cached prefix, if any, plus newer behaviors).
        candidates : LongTensor [C]
            Candidate item ids (C >= 1).
        ticket : PrefixTicket, optional
            From :meth:`prefill_prefix` for this user; ends its lease.
        request_time : int, optional
            The candidates' timestamp (seconds); defaults to the last behavior's timestamp.
        now : float, optional
            Pool-clock time in seconds (default ``time.monotonic()``).

        Returns
        -------
        RankResult
            ``scores [C, num_tasks]`` equal to the model's no-cache forward of the request.

        Raises
        ------
        ValueError
            Bad input, before any cache state changes.
        """
        return self.rank_with_prefix_batch(
            [RankRequest(user_id, history, candidates, ticket, request_time)], now=now)[0]

    def rank_with_prefix_batch(self, requests: Sequence[RankRequest],
                               now: Optional[float] = None) -> list[RankResult]:
        """:meth:`rank_with_prefix` for many requests in one varlen forward (no padding).

        Equal to calling :meth:`rank_with_prefix` on each request in order, except that requests reusing the
        same entry extend it once (with the longest of their histories). Every request is validated before any
        cache state changes.
        """
        preps = []
        for i, r in enumerate(requests):
            if not isinstance(r, RankRequest):
                raise ValueError(f"requests[{i}] must be a RankRequest, got {type(r).__name__}")
            preps.append(self._prepare(r.user_id, r.history, r.candidates, r.request_time, r.ticket, rank=True))
        t = _clock(now)
        with self._lock, torch.inference_mode(), self.index.held():
            self.state.spill_expired(t)
            pins: dict = {}
            reloaded: set = set()  # reloaded from DRAM in this call, first reader not yet served
            jobs: list[Job] = []
            extended: list[Pin] = []
            stored: list = []
            done = False
            try:
                for p in preps:
                    jobs.append(self.ranking.job(p, pins, reloaded, t))
                self.ranking.end_tickets(preps, t)  # before an extension re-keys a leased entry
                if self.extend_on_rank:
                    extended = [pin for pin in pins.values() if self.ranking.plan_extension(pin, jobs, t)]
                if self.store_misses:
                    stored = self.ranking.plan_stores(jobs, t)
                with self.state.onload_scope():  # each layer waits for its own pages of a DRAM hit
                    outs = self.runner.run(jobs)
                done = True
            finally:
                self.state.join_onload()
                for pin in pins.values():
                    if not done and pin in extended:
                        pin.broken = True
                    self.pool.unpin(*pin.key, now=t)
                    if pin.broken:
                        self.state.drop(pin.key, t, unpin=False)
                for key in stored:
                    if done:
                        self.pool.unpin(*key, now=t)
                    else:
                        self.state.drop(key, t)
            c = self.state.counters
            c.extensions += len(extended)
            c.stored_on_rank += len(stored)
            results = []
            for job, scores in zip(jobs, outs):
                T, C = job.prep.num_tokens, job.candidates.numel()
                source = "recompute" if job.key is None else "hbm"
                if job.key in reloaded:
                    source = "dram"
                    reloaded.discard(job.key)
                results.append(RankResult(scores, source, job.start, T - job.start + C, self.cache.kv_dtype.value))
                c.count_ranking(source, job.start, T - job.start + C, C)
            if self.dram is not None:  # now evictable unless another ticket's lease holds them: keep a DRAM copy
                for key in [pin.key for pin in pins.values()] + stored:
                    self.state.spill_if_evictable(key, t)
            return results

    # ------------------------------------------------------------------------------------------ queries
    def match_length(self, user_id: int, history: Behaviors) -> int:
        """History tokens a ranking request with ``history`` would read from the cache now (0 on a miss).

        Changes nothing (no pin, no LRU touch, no counter).
        """
        p = self._prepare(user_id, history)
        with self._lock:
            m = self.index.match(p, p.num_tokens)
            return 0 if m is None else m.usable

    def stats(self) -> dict[str, int]:
        """Counters as a flat dict: the engine's, ``evictions``, and every pool stat prefixed ``pool_``.

        ``hbm_hits``/``dram_hits``/``recomputes``: ranking requests that reused a prefix from device memory /
        reloaded it from the DRAM tier / computed from scratch; ``reloads``/``spills`` (and ``*_bytes``): copies
        between the tiers (``reloads_declined_cost``: DRAM hits where recomputing was predicted cheaper;
        ``spill_failures``/``reload_failures``: copies that failed, served without them);
        ``trigger_*``: the trigger's decisions when one is set; ``cached_tokens``/``computed_tokens``: history
        tokens read / rows computed while ranking; ``extensions``: entries extended while ranking;
        ``stored_on_rank``: missed histories kept; ``expired_leases``: pre-infer leases that ran out before their
        ranking came; ``late_tickets``: tickets presented after that; ``stale_tickets``: tickets whose entry was
        gone, re-keyed or whose lease was already ended; ``prefills``: admitted pre-inferences that computed KV;
        ``prefill_declines`` (and by cause): not admitted.
        """
        with self._lock:
            s = self.state.counters.as_dict()
            pool = self.pool.stats()
            s["evictions"] = int(pool["evictions"])
            s.update({f"pool_{k}": int(v) for k, v in pool.items()})
            s["expired_leases"] = int(pool["expirations"])
            if self.dram is not None:
                s.update(self.dram.stats())
            if self.trigger is not None and callable(getattr(self.trigger, "stats", None)):
                s.update({k: v for k, v in self.trigger.stats(now=None).items() if isinstance(v, int)})
            s.setdefault("trigger_admits", 0)
            s.setdefault("trigger_declines", 0)
            s["kv_bits"] = self._kv_bits  # bits per stored K/V value: 8 for an 8-bit cache (kv_dtype), else 16/32
            return s

    # ------------------------------------------------------------------------------------------ validation
    def _prepare(self, user_id, history, candidates=None, request_time=None, ticket=None,
                 rank: bool = False) -> Prepared:
        u = _user_id(user_id)
        if rank and candidates is None:
            raise ValueError("candidates must be a 1-D int64 tensor of item ids, got None")
        check = getattr(self.model, "check_inputs", None)
        if callable(check):
            t_req = check(history, candidates, request_time)
        else:
            t_req = check_request(history, candidates, request_time, self.cache.device)
        if ticket is not None:
            if not isinstance(ticket, PrefixTicket):
                raise ValueError(f"ticket must be a PrefixTicket or None, got {type(ticket).__name__}")
            if ticket.user_id != u:
                raise ValueError(f"ticket is for user_id={ticket.user_id}, but the request is for user_id={u}")
        return Prepared(u, history, candidates, t_req, ticket)
