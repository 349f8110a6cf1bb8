"""Generative-recommendation rankers (HSTU and softmax transformer) with an exact paged-prefix forward.

Token layout of one request: ``num_context_tokens`` contextual user tokens, then the behaviors (item + action
embeddings), then the candidates. History token ``t`` sits at position ``t``; every candidate sits at position
``T`` (the history length). History attention is causal; each candidate attends to all history tokens and to
itself only (target mask), so a candidate's score never depends on the other candidates in the request.

The ranker is one model built on the public pieces a user's own ranker uses: its layers call
:class:`relaygr_engine.PrefixAttention` and ``GRRanker(batch)`` takes a :class:`relaygr_engine.RelayBatch`.
``GRRanker.rank_full`` scores a request with dense masked attention (the oracle); ``GRRanker.rank_uncached``
computes the same scores with no cache through the paged op (the efficient no-cache baseline);
:class:`relaygr_engine.RelayEngine` runs ``GRRanker(batch)`` over cached prefix pages.

Parameters (``state_dict`` names)
---------------------------------
``H = num_heads``, ``D = head_dim`` (q/k width), ``Dv = value_dim`` (u/v width, default ``D``), ``d = hidden_dim``,
``l`` = layer index. Linear weights are ``[out, in]`` (``y = x W^T + b``). Within a projection, head ``h`` owns
columns ``h*D .. h*D+D-1`` (``h*Dv ..`` for u and v) of each part.

==================================  ==============================  ==========================================
name                                shape                           meaning
==================================  ==============================  ==========================================
``item_emb.weight``                 ``[num_items, d]``              item embedding (behaviors and candidates)
``action_emb.weight``               ``[num_actions, d]``            action embedding, added to a behavior
``context_emb.weight``              ``[context_vocab_size, d]``     contextual tokens (``num_context_tokens > 0``)
``pos_emb.weight``                  ``[max_seq_len + 1, d]``        absolute position; row ``T`` = candidates
``candidate_emb``                   ``[d]``                         added to every candidate token
``layers.{l}.input_norm.weight``    ``[d]``                         hstu: LayerNorm before ``uvqk``
``layers.{l}.input_norm.bias``      ``[d]``
``layers.{l}.uvqk.weight``          ``[(2*Dv + 2*D) * H, d]``       hstu: rows ``u``, ``v``, ``q``, ``k`` in order
``layers.{l}.uvqk.bias``            ``[(2*Dv + 2*D) * H]``
``layers.{l}.rel_pos_bias``         ``[max_seq_len + 1]``           hstu: rab by position distance (>= 0)
``layers.{l}.time_bias``            ``[num_time_buckets]``          hstu: rab by ``time_bucket`` of ``t_q - t_k``
``layers.{l}.output_norm.weight``   ``[H*Dv]`` (group norm: ``[H]``)  hstu: norm of ``A V``
``layers.{l}.output_norm.bias``     ``[H*Dv]`` (group norm: ``[H]``)
``layers.{l}.out_proj.weight``      ``[d, H*Dv]`` (concat_ux: 3x)   both: attention output projection
``layers.{l}.out_proj.bias``        ``[d]``
``layers.{l}.attn_norm.weight``     ``[d]``                         softmax: LayerNorm before ``qkv``
``layers.{l}.attn_norm.bias``       ``[d]``
``layers.{l}.qkv.weight``           ``[(2*D + Dv) * H, d]``         softmax: rows ``q``, ``k``, ``v`` in order
``layers.{l}.qkv.bias``             ``[(2*D + Dv) * H]``
``layers.{l}.ffn_norm.weight``      ``[d]``                         softmax: LayerNorm before the FFN
``layers.{l}.ffn_norm.bias``        ``[d]``
``layers.{l}.ffn_in.weight``        ``[ffn_dim, d]``                softmax: FFN up-projection (GELU after)
``layers.{l}.ffn_in.bias``          ``[ffn_dim]``
``layers.{l}.ffn_out.weight``       ``[d, ffn_dim]``                softmax: FFN down-projection
``layers.{l}.ffn_out.bias``         ``[d]``
``final_norm.weight``               ``[d]``                         LayerNorm before the heads
``final_norm.bias``                 ``[d]``
``task_heads.weight``               ``[num_tasks, d]``              row ``t``: task ``t``'s logit
``task_heads.bias``                 ``[num_tasks]``
==================================  ==============================  ==========================================

HSTU layer (defaults): ``u, v, q, k = split(uvqk(input_norm(x)))``; ``A_ij = SiLU(alpha q_i.k_j + rab_ij) / N`` on
visible pairs (``alpha = 1/sqrt(D)``, ``N = max_seq_len``); ``x += out_proj(SiLU(u) * output_norm(A V))``. The
published HSTU layers differ from these defaults in several terms (which of u, v, q, k get SiLU, what the output
projection reads, the norm and its eps, alpha, ``N``, the time buckets, the value width), so a checkpoint does not
load by transposing one matrix: build the config with the matching options and map the weights with
:mod:`relaygr_engine.models.convert` (``from_meta_stu``, ``from_meta_research_hstu``, ``from_nvidia_hstu``), which
checks every shape. docs/hstu_variants.md lists what loads exactly, what partly, and what is not prefix-stable.
The time bias uses ``t_q - t_k`` of the query token itself (see :class:`GRRanker`); a checkpoint trained with
``t_{q+1} - t_k`` maps parameter-wise but scores differently.

Softmax layer (pre-LN): ``x += out_proj(softmax(q.k / sqrt(D)) v)``; ``x += ffn_out(GELU(ffn_in(ffn_norm(x))))``.
"""
from __future__ import annotations

from ..behaviors import Behaviors
from . import convert
from .config import GRModelConfig, HSTUActivation, HSTUOutput, HSTUOutputNorm
from .layers import HSTULayer, SoftmaxLayer
from .ranker import GRRanker, build_ranker

__all__ = ["Behaviors", "GRModelConfig", "GRRanker", "HSTUActivation", "HSTULayer", "HSTUOutput", "HSTUOutputNorm",
           "SoftmaxLayer", "build_ranker", "convert"]
