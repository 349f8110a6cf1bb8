"""The generative-recommendation ranker: embeddings, layers, multi-task heads, dense oracle and paged forward."""
from __future__ import annotations

import hashlib
import operator
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from ..config import AttentionBackend, parse_choice
from ..ops import AttentionMode, _check_args, _dispatch, paged_prefix_attention, plan_paged_attention, time_buckets
from .behaviors import Behaviors
from .config import GRModelConfig
from .layers import make_layer

__all__ = ["GRRanker", "build_ranker"]

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check_range(name: str, x: torch.Tensor, hi: int) -> None:
    lo_v, hi_v = int(x.min()), int(x.max())
    if lo_v < 0 or hi_v >= hi:
        raise ValueError(f"{name} must be in [0, {hi}), got values in [{lo_v}, {hi_v}]")


class GRRanker(nn.Module):
    """A generative-recommendation ranker over ``[contextual tokens, behaviors, candidates]``.

    Token ``t`` of a user's history (its ``num_context_tokens`` contextual tokens, then its behaviors) sits at
    position ``t``; all candidates sit at position ``T`` (the history length). History attention is causal; a
    candidate attends to every history token and to itself only, so its score never depends on the other
    candidates of the request. Scores are the heads' raw outputs (logits), ``[C, num_tasks]``.

    Timestamps: a behavior's token carries its own timestamp; contextual tokens carry the first behavior's
    timestamp; candidates carry the *request time*, which is ``request_time`` when given and the last behavior's
    timestamp otherwise. The HSTU time bias of query ``i`` and key ``j`` uses ``t_i - t_j`` (the query token's own
    time, not the next token's), so a history token's output never depends on later tokens and a cached prefix's
    K/V stays exact when the history grows.

    Build one with :func:`build_ranker`; the parameter names are listed in :mod:`relaygr_engine.models`.
    """

    def __init__(self, config: GRModelConfig) -> None:
        super().__init__()
        if not isinstance(config, GRModelConfig):
            raise ValueError(f"config must be a GRModelConfig, got {type(config).__name__}")
        self.config = config
        d = config.hidden_dim
        self.item_emb = nn.Embedding(config.num_items, d)
        self.action_emb = nn.Embedding(config.num_actions, d)
        if config.num_context_tokens:
            self.context_emb = nn.Embedding(config.context_vocab_size, d)
        self.pos_emb = nn.Embedding(config.max_seq_len + 1, d)
        self.candidate_emb = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(make_layer(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(d)
        self.task_heads = nn.Linear(d, config.num_tasks)
        self._identity_key: Optional[tuple] = None
        self._identity = 0
        self._param_slots: Optional[list] = None

    # ------------------------------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.item_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.item_emb.weight.dtype

    @property
    def identity(self) -> int:
        """64-bit hash of the config and every parameter's bytes: the model part of a prefix fingerprint.

        It is recomputed whenever a parameter tensor changes: ``load_state_dict`` (also flagged explicitly),
        in-place edits (tracked by tensor version counters), ``.to(...)``. So cached prefixes computed with other
        weights are never reused. Models with equal config and weights share an identity (on any device).
        Replacing a submodule after construction is not tracked: call :meth:`mark_weights_changed` then.
        """
        if self._param_slots is None:  # where each parameter lives; re-read on every call (cheap dict lookups)
            self._param_slots = [(m._parameters, name) for m in self.modules() for name in m._parameters
                                 if m._parameters[name] is not None]
        key = tuple((id(p), p.data_ptr(), p._version) for p in (d[name] for d, name in self._param_slots))
        if key != self._identity_key:
            h = hashlib.blake2b(repr(self.config).encode(), digest_size=8)
            for name, p in self.named_parameters():
                h.update(f"{name}:{p.dtype}:{tuple(p.shape)}".encode())
                h.update(p.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
            self._identity = int.from_bytes(h.digest(), "little")
            self._identity_key = key
        return self._identity

    def mark_weights_changed(self) -> None:
        """Force :attr:`identity` to be recomputed (e.g. after editing parameters through ``.data``)."""
        self._identity_key = None
        self._param_slots = None

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        self.mark_weights_changed()
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.mark_weights_changed()
        return result

    def num_tokens(self, history: Behaviors) -> int:
        """History tokens ``T``: contextual tokens plus behaviors."""
        return self.config.num_context_tokens + len(history)

    # ------------------------------------------------------------------------------------------ validation
    def check_inputs(self, history: Behaviors, candidates: Optional[torch.Tensor] = None,
                     request_time: Optional[int] = None) -> Optional[int]:
        """Validate a request against this model; return the candidates' timestamp (None without timestamps).

        Raises
        ------
        ValueError
            Not a :class:`Behaviors`; wrong device; empty history; more than ``max_seq_len`` history tokens; ids
            out of range; missing or misshaped contextual tokens; candidates not a non-empty 1-D int64 tensor on
            the model's device with ids in ``[0, num_items)``; ``request_time`` not an int64 integer, or given
            for a history without timestamps.
        """
        cfg, dev = self.config, self.device
        if not isinstance(history, Behaviors):
            raise ValueError(f"history must be a Behaviors, got {type(history).__name__}")
        if history.device != dev:
            raise ValueError(f"history must be on {dev} (the model's device), got {history.device}")
        if len(history) == 0:
            raise ValueError("history must hold at least one behavior, got 0")
        if self.num_tokens(history) > cfg.max_seq_len:
            raise ValueError(f"history must have at most max_seq_len={cfg.max_seq_len} tokens "
                             f"({cfg.num_context_tokens} contextual + behaviors), got {self.num_tokens(history)}")
        _check_range("history.item_ids", history.item_ids, cfg.num_items)
        if history.action_ids is not None:
            _check_range("history.action_ids", history.action_ids, cfg.num_actions)
        ctx = history.context_ids
        if cfg.num_context_tokens:
            if ctx is None or ctx.numel() != cfg.num_context_tokens:
                got = None if ctx is None else ctx.numel()
                raise ValueError(f"history.context_ids must have {cfg.num_context_tokens} entries "
                                 f"(num_context_tokens), got {got}")
            _check_range("history.context_ids", ctx, cfg.context_vocab_size)
        elif ctx is not None:
            raise ValueError(f"history.context_ids must be None: the model has no contextual tokens, got "
                             f"{ctx.numel()} ids")
        if candidates is not None:
            if not isinstance(candidates, torch.Tensor) or candidates.dim() != 1 or candidates.dtype != torch.long:
                got = (f"{tuple(candidates.shape)} {candidates.dtype}" if isinstance(candidates, torch.Tensor)
                       else type(candidates).__name__)
                raise ValueError(f"candidates must be a 1-D int64 tensor of item ids, got {got}")
            if candidates.device != dev:
                raise ValueError(f"candidates must be on {dev} (the model's device), got {candidates.device}")
            if candidates.numel() == 0:
                raise ValueError("candidates must hold at least one item id, got 0")
            _check_range("candidates", candidates, cfg.num_items)
        return self._request_time(history, request_time)

    @staticmethod
    def _request_time(history: Behaviors, request_time) -> Optional[int]:
        if request_time is None:
            return None if history.timestamps is None else int(history.timestamps[-1])
        if isinstance(request_time, bool):
            raise ValueError(f"request_time must be an integer time in seconds, got {request_time!r}")
        try:
            t = operator.index(request_time.item() if isinstance(request_time, torch.Tensor) else request_time)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"request_time must be an integer time in seconds, got {request_time!r}") from None
        if not _INT64_MIN <= t <= _INT64_MAX:
            raise ValueError(f"request_time must fit in int64, got {t}")
        if history.timestamps is None:
            raise ValueError("request_time applies to a history with timestamps; got a history without them")
        return t

    # ------------------------------------------------------------------------------------------ inputs
    def token_keys(self, history: Behaviors) -> np.ndarray:
        """What each history token is, for prefix fingerprints: int64 ``[T, 4]`` rows ``(kind, id, action, time)``.

        ``kind`` is 0 for a contextual token, 1 for a behavior; ``action`` is -1 without action ids; ``time`` is 0
        without timestamps. Two histories whose first ``n`` rows agree give identical K/V for their first ``n``
        tokens (with equal weights and the same presence of timestamps).
        """
        U, L = self.config.num_context_tokens, len(history)
        keys = np.zeros((U + L, 4), dtype=np.int64)
        keys[U:, 0] = 1
        keys[U:, 1] = history.item_ids.cpu().numpy()
        keys[:, 2] = -1
        if history.action_ids is not None:
            keys[U:, 2] = history.action_ids.cpu().numpy()
        if U:
            keys[:U, 1] = history.context_ids.cpu().numpy()
        ts = self.token_timestamps(history)
        if ts is not None:
            keys[:, 3] = ts.cpu().numpy()
        return keys

    def token_timestamps(self, history: Behaviors) -> Optional[torch.Tensor]:
        """Timestamps of the ``T`` history tokens (contextual tokens take the first behavior's), or None."""
        ts = history.timestamps
        if ts is None:
            return None
        U = self.config.num_context_tokens
        return torch.cat([ts[:1].expand(U), ts]) if U else ts

    def embed_rows(self, history: Behaviors, start: int, candidates: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Input embeddings of history tokens ``start .. T-1``, then of the candidates.

        A history token is ``item_emb + action_emb`` (behavior) or ``context_emb`` (contextual), plus
        ``pos_emb[t]``; a candidate is ``item_emb + candidate_emb + pos_emb[T]``.

        Returns
        -------
        Tensor [T - start + C, hidden_dim]
        """
        U, T = self.config.num_context_tokens, self.num_tokens(history)
        parts = []
        if start < U:
            parts.append(self.context_emb(history.context_ids[start:]))
        b0 = max(0, start - U)
        if b0 < len(history):
            e = self.item_emb(history.item_ids[b0:])
            if history.action_ids is not None:
                e = e + self.action_emb(history.action_ids[b0:])
            parts.append(e)
        x = (torch.cat(parts) if parts else self.pos_emb.weight[:0]) + self.pos_emb.weight[start:T]
        if candidates is None:
            return x
        c = self.item_emb(candidates) + self.candidate_emb + self.pos_emb.weight[T]
        return torch.cat([x, c])

    def row_timestamps(self, history: Behaviors, start: int, num_candidates: int,
                       request_time: Optional[int]) -> Optional[torch.Tensor]:
        """Timestamps of the rows :meth:`embed_rows` makes (``[T - start + C]`` int64), or None without timestamps."""
        ts = self.token_timestamps(history)
        if ts is None:
            return None
        return torch.cat([ts[start:], ts.new_full((num_candidates,), request_time)])

    # ------------------------------------------------------------------------------------------ forward passes
    def score(self, h: torch.Tensor) -> torch.Tensor:
        """Multi-task heads on candidate outputs ``[C, hidden]`` -> scores ``[C, num_tasks]``."""
        return self.task_heads(self.final_norm(h))

    @torch.inference_mode()
    def forward_paged(self, x: torch.Tensor, kv_caches: Sequence[torch.Tensor], kv_indptr: torch.Tensor,
                      kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      num_candidates: torch.Tensor, *, ts_q: Optional[torch.Tensor] = None,
                      ts_cache: Optional[torch.Tensor] = None, backend: str = "torch"):
        """Run the layers over new rows of many users whose prefixes are cached as pages (varlen, no padding).

        Parameters
        ----------
        x : Tensor [R, hidden_dim]
            Input rows (:meth:`embed_rows`), user after user: each user's new history tokens, then candidates.
        kv_caches : sequence of ``num_layers`` Tensors [num_pages, 2, page_size, H, D]
            Each layer's paged cache.
        kv_indptr, kv_indices, kv_last_page_len, cu_seqlens_q, num_candidates : int32 tensors
            The page table and row layout, as in :func:`~relaygr_engine.ops.paged_prefix_attention`.
        ts_q : LongTensor [R], optional
            Row timestamps (:meth:`row_timestamps`); turns on the HSTU time bias.
        ts_cache : LongTensor [num_pages, page_size], optional
            Timestamps of the cached tokens (needed with ``ts_q`` when any user has cached pages).
        backend : {"torch", "triton", "auto"}

        Returns
        -------
        h : Tensor [R, hidden_dim]
            Last layer's output rows (apply :meth:`score` to the candidate rows).
        kv : list of ``num_layers`` (k, v) pairs of Tensors [R, H, D]
            Each layer's K and V of every row; the history rows' are what the prefix cache stores.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches must hold {len(self.layers)} layers, got {len(kv_caches)}")
        kv = []
        first = kv_caches[0] if len(kv_caches) else None
        be = parse_choice(AttentionBackend, backend, "backend")
        # The Triton kernel's tile schedule is built once here and reused by every layer (None for torch).
        plan = None if first is None else plan_paged_attention(first, kv_indptr, kv_indices, kv_last_page_len,
                                                               cu_seqlens_q, num_candidates, backend=be)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            q, k, v, aux = layer.project(x)
            kw = layer.op_kwargs(use_time=ts_q is not None)
            args = (q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype), cache, kv_indptr, kv_indices,
                    kv_last_page_len, cu_seqlens_q, num_candidates)
            op = (AttentionMode(kw["mode"]), kw["scale"], kw.get("hstu_norm", 1.0), kw.get("pos_bias"),
                  kw.get("ts_bias"), ts_cache, ts_q)
            same = (i > 0 and isinstance(cache, torch.Tensor) and cache.shape == first.shape
                    and cache.dtype == first.dtype and cache.device == first.device)
            planned = i == 0 and plan is not None
            if planned:  # the plan read and checked the page table and rows: check the rest without a second read
                _check_args(*args, *op, read_tables=False)
            if same or planned:  # validated: by the first layer, or just above and by the plan
                o = _dispatch(*args, *op, be, plan=plan)
            else:
                o = paged_prefix_attention(*args, ts_cache=ts_cache, ts_q=ts_q, backend=be, **kw)
            x = layer.finish(x, o.to(x.dtype), aux)
            kv.append((k, v))
        return x, kv

    @torch.inference_mode()
    def rank_full(self, history: Behaviors, candidates: torch.Tensor,
                  request_time: Optional[int] = None) -> torch.Tensor:
        """Score candidates with no cache: dense masked attention over ``[history, candidates]`` (the oracle).

        Builds the full ``[N, N]`` mask (``N = T + C``), position distances and time buckets, and runs every
        layer's :meth:`attend_dense`; it never calls the paged op, so the cached path is checked against
        independent code. Cost grows as ``N**2``: this is also the no-cache baseline.

        Parameters
        ----------
        history : Behaviors
            The user's behaviors (``T = num_context_tokens + len(history) <= max_seq_len`` tokens).
        candidates : LongTensor [C]
            Candidate item ids.
        request_time : int, optional
            The candidates' timestamp (seconds); defaults to the last behavior's timestamp.

        Returns
        -------
        Tensor [C, num_tasks]
        """
        t_req = self.check_inputs(history, candidates, request_time)
        T, C = self.num_tokens(history), candidates.numel()
        N = T + C
        x = self.embed_rows(history, 0, candidates)
        idx = torch.arange(N, device=x.device)
        is_candidate = idx >= T
        visible = (idx[None, :] < T) & ((idx[None, :] <= idx[:, None]) | is_candidate[:, None])
        visible.diagonal().fill_(True)  # a candidate sees itself
        dist = buckets = None
        if self.config.attention.value == "hstu":
            pos = idx.clamp(max=T)
            dist = (pos[:, None] - pos[None, :]).clamp_(0, self.config.max_seq_len)
            ts = self.row_timestamps(history, 0, C, t_req)
            if ts is not None:
                buckets = time_buckets(ts[:, None] - ts[None, :], self.config.num_time_buckets)
        for layer in self.layers:
            q, k, v, aux = layer.project(x)
            x = layer.finish(x, layer.attend_dense(q, k, v, visible, dist, buckets), aux)
        return self.score(x[T:])

    @torch.inference_mode()
    def rank_uncached(self, history: Behaviors, candidates: torch.Tensor, request_time: Optional[int] = None,
                      backend: str = "torch") -> torch.Tensor:
        """Score candidates with no cache through the paged attention op (an empty prefix): full inference.

        Computes every history token and candidate like :meth:`rank_full` (equal scores up to fp32 rounding), but
        with the varlen kernels the cached path uses (causal blocks, no masked-out ``N x N`` work, no dense bias
        tables), so it is the efficient no-cache baseline: compared with a cached ranking, the only difference
        is the cache.

        Returns
        -------
        Tensor [C, num_tasks]
        """
        t_req = self.check_inputs(history, candidates, request_time)
        T, C = self.num_tokens(history), candidates.numel()
        x = self.embed_rows(history, 0, candidates)
        ts = self.row_timestamps(history, 0, C, t_req)
        dev, cfg = x.device, self.config
        empty = torch.empty((0, 2, 1, cfg.num_heads, cfg.head_dim), dtype=x.dtype, device=dev)
        i32 = (lambda *v: torch.tensor(v, dtype=torch.int32, device=dev))
        h, _ = self.forward_paged(x, [empty] * cfg.num_layers, i32(0, 0), i32(), i32(0), i32(0, T + C), i32(C),
                                  ts_q=ts, backend=backend)
        return self.score(h[T:])

    def forward(self, history: Behaviors, candidates: torch.Tensor,
                request_time: Optional[int] = None) -> torch.Tensor:
        """Same as :meth:`rank_full`."""
        return self.rank_full(history, candidates, request_time)


def build_ranker(config: GRModelConfig, seed: int = 0, device: Union[str, torch.device] = "cpu",
                 dtype: torch.dtype = torch.float32) -> GRRanker:
    """A randomly initialised :class:`GRRanker` in eval mode (deterministic in ``seed``).

    Standard PyTorch initialisation, except that ``candidate_emb`` is N(0, 1) and the HSTU biases
    (``rel_pos_bias``, ``time_bias``) are N(0, 0.5), so every term of the model is live. The global RNG state is
    left untouched. Load trained weights with ``load_state_dict``.
    """
    if not isinstance(config, GRModelConfig):
        raise ValueError(f"config must be a GRModelConfig, got {type(config).__name__}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GRRanker(config)
        with torch.no_grad():
            model.candidate_emb.normal_()
            for layer in model.layers:
                for name in ("rel_pos_bias", "time_bias"):
                    if hasattr(layer, name):
                        getattr(layer, name).normal_(0.0, 0.5)
    return model.to(device=device, dtype=dtype).eval()
