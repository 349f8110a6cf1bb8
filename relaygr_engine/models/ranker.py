"""The generative-recommendation ranker: embeddings, layers, multi-task heads, dense oracle and paged forward."""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from ..batch import RelayBatch, check_request, request_time_of
from ..behaviors import Behaviors
from ..attention.context import batch_context, paged_context, PagedState
from ..attention.layer import find_layers
from ..config import AttentionBackend
from ..identity import WeightsIdentity
from ..attention.ops import _resolve_backend, plan_paged_attention
from ..attention.torch_plan import build_torch_plan
from .config import GRModelConfig
from .layers import make_layer

__all__ = ["GRRanker", "build_ranker"]


def _check_range(name: str, x, hi: int) -> None:
    """ValueError unless every id of ``x`` (a tensor, or a host array) is in ``[0, hi)``."""
    if isinstance(x, np.ndarray) or x.device.type == "cpu":  # on the host: numpy's reductions, no tensor ops
        a = x if isinstance(x, np.ndarray) else x.numpy()
        lo_v, hi_v = int(a.min()), int(a.max())
    else:
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

    ``model(batch)`` takes a :class:`~relaygr_engine.batch.RelayBatch` and returns the candidate rows' scores
    ``[number of candidate rows, num_tasks]`` (the engine's model contract); outside a relay forward it runs dense
    attention. Build one with :func:`build_ranker`; the parameter names are listed in :mod:`relaygr_engine.models`.
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
        self.final_norm = nn.LayerNorm(d, eps=config.norm_eps)
        self.task_heads = nn.Linear(d, config.num_tasks)
        self._identity = WeightsIdentity(self, repr(config).encode())

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
        return self._identity.value

    def mark_weights_changed(self) -> None:
        """Force :attr:`identity` to be recomputed (e.g. after editing parameters through ``.data``)."""
        self._identity.invalidate()

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
            Not a :class:`Behaviors`; wrong device; empty history; a negative timestamp; more than
            ``max_seq_len`` history tokens; ids out of range; missing or misshaped contextual tokens; candidates
            not a non-empty 1-D int64 tensor on the model's device with ids in ``[0, num_items)``;
            ``request_time`` not an integer in ``[0, 2**63)``, or given for a history without timestamps.
        """
        cfg = self.config
        t_req = check_request(history, candidates, request_time, self.device)
        if self.num_tokens(history) > cfg.max_seq_len:
            raise ValueError(f"history must have at most max_seq_len={cfg.max_seq_len} tokens "
                             f"({cfg.num_context_tokens} contextual + behaviors), got {self.num_tokens(history)}")
        host = history.device.type == "cpu"
        ids, acts, _, ctx_ids = history.arrays() if host else (history.item_ids, history.action_ids, None,
                                                                history.context_ids)
        _check_range("history.item_ids", ids, cfg.num_items)
        if acts is not None:
            _check_range("history.action_ids", acts, cfg.num_actions)
        ctx = history.context_ids
        if cfg.num_context_tokens:
            if ctx is None or ctx.numel() != cfg.num_context_tokens:
                got = None if ctx is None else ctx.numel()
                raise ValueError(f"history.context_ids must have {cfg.num_context_tokens} entries "
                                 f"(num_context_tokens), got {got}")
            _check_range("history.context_ids", ctx_ids, cfg.context_vocab_size)
        elif ctx is not None:
            raise ValueError(f"history.context_ids must be None: the model has no contextual tokens, got "
                             f"{ctx.numel()} ids")
        if candidates is not None:
            _check_range("candidates", candidates, cfg.num_items)
        return t_req

    # ------------------------------------------------------------------------------------------ inputs
    def token_keys(self, history: Behaviors) -> np.ndarray:
        """:meth:`Behaviors.token_keys` (kept for callers of the ranker)."""
        return history.token_keys()

    def token_timestamps(self, history: Behaviors) -> Optional[torch.Tensor]:
        """:meth:`Behaviors.token_timestamps` (kept for callers of the ranker)."""
        return history.token_timestamps()

    def embed(self, batch: RelayBatch) -> torch.Tensor:
        """Input embeddings of a batch's rows ``[R, hidden_dim]``.

        A behavior is ``item_emb + action_emb``, a contextual token ``context_emb``, a candidate
        ``item_emb + candidate_emb``; every row adds ``pos_emb[position]``.
        """
        ids = batch.item_ids
        if self.config.num_context_tokens:
            ctx = batch.is_context
            zero = ids.new_zeros(())
            e = torch.where(ctx[:, None], self.context_emb(torch.where(ctx, ids, zero)),
                            self.item_emb(torch.where(ctx, zero, ids)))
        else:
            e = self.item_emb(ids)
        if batch.action_ids is not None:
            e = e + self.action_emb(batch.action_ids) * batch.is_behavior[:, None]
        e = e + self.candidate_emb * batch.is_candidate[:, None]
        return e + self.pos_emb(batch.positions)

    def embed_rows(self, history: Behaviors, start: int, candidates: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Input embeddings of history tokens ``start .. T-1``, then of the candidates: ``[T - start + C, d]``."""
        return self.embed(RelayBatch.from_requests([(history, start, candidates, None)], device=self.device))

    def row_timestamps(self, history: Behaviors, start: int, num_candidates: int,
                       request_time: Optional[int]) -> Optional[torch.Tensor]:
        """Timestamps of the rows :meth:`embed_rows` makes (``[T - start + C]`` int64), or None without timestamps."""
        ts = history.token_timestamps()
        if ts is None:
            return None
        return torch.cat([ts[start:], ts.new_full((num_candidates,), request_time_of(history, request_time))])

    # ------------------------------------------------------------------------------------------ forward passes
    def score(self, h: torch.Tensor) -> torch.Tensor:
        """Multi-task heads on candidate outputs ``[C, hidden]`` -> scores ``[C, num_tasks]``."""
        return self.task_heads(self.final_norm(h))

    def forward(self, batch: RelayBatch) -> torch.Tensor:
        """Scores of the batch's candidate rows, ``[batch.num_candidate_rows, num_tasks]`` in batch order.

        Inside a relay forward the layers read and write the engine's pages; otherwise they run dense attention
        over the batch (every user's rows must then start at position 0).
        """
        with batch_context(batch):
            x = self.embed(batch)
            for layer in self.layers:
                x = layer(x)
            return self.score(x[batch.candidate_rows])

    @torch.inference_mode()
    def rank_full(self, history: Behaviors, candidates: torch.Tensor,
                  request_time: Optional[int] = None) -> torch.Tensor:
        """Score candidates with no cache: dense masked attention over ``[history, candidates]`` (the oracle).

        ``self(RelayBatch.full(...))`` outside a relay forward: every layer's ``PrefixAttention`` builds the full
        ``[N, N]`` mask (``N = T + C``), position distances and time buckets once and runs dense attention; it
        never calls the paged op, so the cached path is checked against independent code. Cost grows as ``N**2``:
        this is also the no-cache baseline.

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
        self.check_inputs(history, candidates, request_time)
        return self(RelayBatch.full(history, candidates, request_time, device=self.device))

    @torch.inference_mode()
    def rank_uncached(self, history: Behaviors, candidates: torch.Tensor, request_time: Optional[int] = None,
                      backend: str = "auto") -> torch.Tensor:
        """Score candidates with no cache through the paged attention op (an empty prefix): full inference.

        Computes every history token and candidate like :meth:`rank_full` (equal scores up to fp32 rounding), but
        with the varlen kernels the cached path uses (causal blocks, no masked-out ``N x N`` work, no dense bias
        tables), so it is the efficient no-cache baseline: compared with a cached ranking, the only difference
        is the cache.

        Parameters
        ----------
        history, candidates, request_time
            As in :meth:`rank_full`.
        backend : {"auto", "torch", "triton"}
            The attention op's backend, picked as the engine picks it (``CacheConfig.attention_backend``):
            ``"auto"`` (default) runs the Triton kernels on CUDA and NPU where Triton imports, else the torch
            reference.

        Returns
        -------
        Tensor [C, num_tasks]
        """
        self.check_inputs(history, candidates, request_time)
        batch = RelayBatch.full(history, candidates, request_time, device=self.device)
        layers = find_layers(self)
        dev, cfg = self.device, self.config
        empty = torch.empty((0, 2, 1, cfg.num_heads, max(cfg.head_dim, cfg.value_dim)), dtype=self.dtype, device=dev)
        i32 = (lambda *v: torch.tensor(v, dtype=torch.int32, device=dev))
        indptr, indices, last = i32(0, 0), i32(), i32(0)
        be = _resolve_backend(backend, dev)
        plan = plan_paged_attention(empty, indptr, indices, last, batch.cu_seqlens, batch.num_candidates, backend=be)
        paged = PagedState([empty] * len(layers), indptr, indices, last, None, be, plan=plan)
        if be is AttentionBackend.TORCH:  # the cached path's per-batch plan, for the same fixed cost per layer
            paged.torch_plan = build_torch_plan(batch.rows, batch.candidates_per_user, [0], [np.zeros(0, np.int64)],
                                                1, cfg.num_heads, dev, ts_rows=batch.timestamps)
        with paged_context(batch, paged, layers):
            return self(batch)


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
