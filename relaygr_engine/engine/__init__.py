"""Relay-race inference: pre-infer a user's prefix early, keep its per-layer KV as pages, rank against it later.

``prefill_prefix`` (at retrieval time) computes a user's history KV and stores it in the
:class:`~relaygr_engine.cache.PagedKVCache` under a *lease*, so it stays resident until the ranking request comes.
``rank_with_prefix`` (the ranking stage) reuses the longest cached prefix that is exactly the first tokens of the
request's history, computes only the remaining history tokens and the candidates, and ends the lease. Whatever the cache
holds, the scores equal the model's full inference (its no-cache forward, e.g. ``GRRanker.rank_full``); a miss only
costs time (``source="recompute"``).

Model
-----
Any ``torch.nn.Module`` holding at least one :class:`~relaygr_engine.attention.layer.PrefixAttention` (where its
attention call was) and called as ``model(batch) -> [number of candidate rows, num_tasks]`` with a
:class:`~relaygr_engine.batch.RelayBatch`. The engine finds the layers by walking ``model.modules()`` (layer index =
registration order), sizes the cache from them, and runs each forward with its pages in the forward context: every
layer stores the new history rows' K/V in their pages itself and attends over the cached prefix pages. The model
must be *prefix-stable*: a history token's row and K/V depend only on earlier tokens (see the README's "Bring your
own ranker"); :func:`relaygr_engine.testing.check_relay_exact` checks it.

Prefix identity
---------------
An entry is keyed by ``(user_id, fingerprint)``. The fingerprint of the first ``n`` history tokens is a 64-bit
BLAKE2b hash of the model identity (a hash of the state dict - every parameter and buffer - recomputed when a
tensor changes: ``load_state_dict``, in-place edits, ``.to()``; or the ``model_version`` string the user gives),
whether the history has action ids and timestamps, and the first ``n`` rows of ``Behaviors.token_keys`` (kind, id,
action, timestamp of each token). Beside each entry the engine keeps those token rows (with the identity and flags), so
a request reuses the *longest common prefix* of its history and any entry of the user: all of a shorter entry, or the
leading part of a longer one (the KV of a token depends only on the tokens before it, so any prefix of a cached entry is
exact). A history changed anywhere in the cached part (e.g. at the front) shares nothing there and recomputes.

Prefill tickets (``PrefixTicket.reason``)
-----------------------------------------
``"admitted"``
    The KV was computed and stored, leased for ``CacheConfig.lease_ttl_s``; ``cached_tokens`` says how many
    leading tokens were reused from the user's cached entries. When a cached entry is wholly a prefix of this
    history it is *extended* in place and re-keyed (only the new tokens are computed); a pending ticket of the
    shorter prefix then goes stale (harmless: its ranking still reads its prefix, the leading part of the grown
    entry, whose lease this prefill took over). When this history shares only the leading part of an entry, a new
    entry starts with a device copy of that part (memory bandwidth only; ``prefill_copies``).
``"already_cached"``
    This prefix was already cached, as an entry or the leading part of a longer one (possibly reloaded from the
    DRAM tier); that entry's lease was renewed (admitted) and the ticket names it.
``"trigger:<reason>"``
    The trigger declined the pre-inference (not admitted; nothing computed).
``"pool_full"``
    The pages pinned now (other leased prefixes waiting for their ranking, ranking reads) leave no room for this
    prefix within the pinned-page budget (``CacheConfig.max_pinned_fraction``); not admitted. Unpinned entries
    never block a prefill: they are evicted in LRU order.
``"budget"``
    The prefix alone needs more pages than the pinned-page budget allows; it can never be admitted in this pool.

Ranking
-------
A ranking read pins the entry it uses (never refused) and unpins it afterwards. A presented, admitted ticket ends
its lease (the entry stays cached, evictable in LRU order). The history KV a ranking computes can be kept, so the
user's next request reuses more: with ``extend_on_rank`` (default) the new tokens are appended to the entry used
(``pool.extend``, re-keyed to the longer prefix) when pages are available and no other lease holds the entry
(tickets presented with the ranking end their leases first); with ``store_misses`` a ranking that found nothing cached
stores its whole history as a new evictable entry (``stored_on_rank``) when pages are available (evicting in LRU order).
Those pages are taken before the forward, and the layers write the K/V into them; if the forward fails, they are freed.

Trigger
-------
``trigger`` is None (admit every prefill the pool can take) or a
:class:`~relaygr_engine.policy.trigger.SequenceAwareTrigger` (or any object with the same two methods). Before any
page is taken, the engine calls ``decide(history_len=T, num_candidates=None, prefix_pages=ceil(T / page_size),
pinned_pages=..., num_pages=..., now=t, reserve=True)``; ``decision.admit`` and ``decision.reason`` say whether to
pre-infer. An admitted prefill is reported back with ``on_prefill_done(T, now=t)`` once it ends (stored, refused by
the pool or failed), so the trigger's load bound counts only work in flight. The trigger's counters
(``trigger_admits``, ``trigger_declines``, ...) appear in :meth:`RelayEngine.stats`.

DRAM tier (memory-aware expander)
---------------------------------
With ``CacheConfig(dram_bytes > 0)`` the engine keeps a :class:`~relaygr_engine.tiers.HostKVTier`. An entry is
spilled to it as one contiguous copy (:meth:`~relaygr_engine.cache.PagedKVCache.pack`) when it becomes evictable: after
the ranking that read it, or when its pre-infer lease ends unused (checked at the start of every engine call, before
anything could evict it). An entry already in DRAM under the same key is not copied again, and a user's spill replaces
its older (shorter) DRAM entries. A ranking request whose longest matching prefix is only in DRAM reloads it into pages
(one copy, :meth:`~relaygr_engine.cache.PagedKVCache.unpack`) when :class:`~relaygr_engine.tiers.ReloadCostModel`
predicts that reloading is cheaper than recomputing; its result says ``source="dram"``. A prefill does the same: when
DRAM holds a longer prefix of its history than device memory, that prefix is reloaded and only the newer tokens are
computed (``prefill_dram_reloads``). Engine calls are serialised, so concurrent rankings of
one user cause one reload, and the later ones read the reloaded pages (``source="hbm"``).

Transfer
--------
``export_prefix(ticket, history)`` packs an admitted prefix of all layers into one contiguous buffer
(:class:`~relaygr_engine.engine.transfer.PackedPrefix`) and ends its lease; another engine's
``import_prefix(history, packed)`` unpacks it into its own pages under a lease, so a ranking there reads it as a
device-cache hit (disaggregated pre-infer and ranking pools). Counters ``exports``, ``imports`` (and bytes),
``imports_already_cached``, ``imports_refused``.

Thread safety: every public method holds one engine lock (the pool itself is also thread-safe).
"""
from __future__ import annotations

from .core import RelayEngine
from .records import EngineCounters, PrefixTicket, RankRequest, RankResult
from .transfer import PackedPrefix

__all__ = ["EngineCounters", "PackedPrefix", "PrefixTicket", "RankRequest", "RankResult", "RelayEngine"]
