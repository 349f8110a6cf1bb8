"""Load HSTU layers trained with the open-source implementations into a :class:`~relaygr_engine.models.GRRanker`.

Each ``from_*`` function takes one state dict per layer (the tensors of that layer, keyed by the source's own
parameter names, without module prefixes) and the :class:`GRModelConfig` of the ranker it loads into; it returns the
``layers.{l}.*`` entries of that ranker's ``state_dict`` (load them with ``strict=False`` beside your own
embeddings, final norm and task heads). Every tensor's shape is checked against the config before anything is
returned, and so are the options the source's formula needs; a mismatch is a ``ValueError`` naming the layer, the
source tensor or option, and expected vs actual. The ``*_options`` functions give the ``GRModelConfig`` options that
reproduce each source's layer formula.

Sources (the layouts; docs/hstu_variants.md has what loads exactly, partly, and what is not prefix-stable):

* Meta generative-recommenders, production ``STULayer``: ``_uvqk_weight [d, (2*Dv + 2*Dqk) * H]`` (``y = x W``;
  column blocks u, v, q, k, each head-major), ``_uvqk_beta``, ``_input_norm_weight/_bias [d]``,
  ``_output_weight [3*Dv*H, d]`` (reads ``concat(u, a, u * norm(a))``, no bias), ``_output_norm_weight/_bias``
  (``[Dv*H]``, or ``[H]`` with ``use_group_norm``). No relative bias in the layer.
* Meta generative-recommenders, research ``HSTU`` (``SequentialTransductionUnitJagged``): ``_uvqk [d, ...]`` (no
  bias), LayerNorms without affine parameters, ``_o.weight [d, Dv*H]`` and ``_o.bias [d]`` (``nn.Linear``), and
  ``_rel_attn_bias._pos_w [2N-1]`` (bias of query ``i``, key ``j`` is ``_pos_w[N-1 + j - i]``) with
  ``_rel_attn_bias._ts_w [NB+1]``, or ``_rel_attn_bias._w [2N-1]`` for its position-only bias.
* NVIDIA recsys-examples, training ``FusedHSTULayer``: ``_linear_uvqk_weight [d, H * (2*Dv + 2*Dqk)]``
  (``y = x W``; per head ``h`` the columns ``h*(2Dv+2Dqk) ..`` hold that head's u, v, q, k),
  ``_linear_uvqk_bias``, ``_linear_proj_weight [Dv*H, d]`` (no bias), ``_output_layernorm_weight/_bias [Dv*H]``
  and, with ``learnable_input_layernorm``, ``_input_layernorm_weight/_bias [d]``.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence, Union

import torch

from ..config import TimeBucket
from ..attention.ops import AttentionMode
from .config import GRModelConfig, HSTUActivation, HSTUOutput, HSTUOutputNorm

__all__ = ["from_meta_research_hstu", "from_meta_stu", "from_nvidia_hstu", "meta_research_options",
           "meta_stu_options", "nvidia_hstu_options"]

Norm = Union[float, str]


# ---------------------------------------------------------------------------------------------------- options
def meta_stu_options(num_heads: int, attention_dim: int, hidden_dim: int, attn_alpha=None,
                     use_group_norm: bool = False, *, hstu_norm: Norm, contextual_seq_len: int = 0,
                     max_attn_len: int = 0) -> dict:
    """``GRModelConfig`` options of a Meta ``STULayer`` from its ``STULayerConfig`` fields.

    Parameters
    ----------
    num_heads, attention_dim, hidden_dim, attn_alpha, use_group_norm
        The STU fields (``attention_dim`` is the q/k width per head, ``hidden_dim`` the u/v width per head; the
        ranker's own ``hidden_dim`` is STU's ``embedding_dim`` and is not set here).
    hstu_norm : float or "batch"
        STU divides by the batch's longest sequence; a relay engine needs one constant (e.g. the longest request
        served). ``"batch"`` reproduces the training-time normaliser in the dense forward only.
    contextual_seq_len, max_attn_len : int
        Must be 0: the bidirectional contextual block is not prefix-stable, and sliding-window attention is not
        supported.
    """
    if contextual_seq_len:
        raise ValueError(f"contextual_seq_len must be 0: STU's contextual tokens attend to each other "
                         f"bidirectionally, which is not prefix-stable; got {contextual_seq_len}")
    if max_attn_len:
        raise ValueError(f"max_attn_len must be 0 (sliding-window attention is not supported), got {max_attn_len}")
    return dict(attention="hstu", num_heads=num_heads, head_dim=attention_dim, value_dim=hidden_dim,
                attn_alpha=float(attn_alpha) if attn_alpha else 1.0 / math.sqrt(attention_dim), norm_eps=1e-6,
                hstu_norm=hstu_norm, hstu_activation="silu_u", hstu_output="concat_ux",
                hstu_output_norm="group" if use_group_norm else "layer")


def meta_research_options(num_heads: int, attention_dim: int, linear_dim: int, *, max_len: int,
                          num_buckets: int = 128) -> dict:
    """``GRModelConfig`` options of Meta's research HSTU (``linear_activation="silu"``, ``concat_ua=False``).

    ``max_len`` is its ``max_sequence_len + max_output_len``: the padded length it divides by and the size of its
    position table. Its time bias reads ``|t_{i+1} - t_j|`` (the next token's time); the ranker reads
    ``t_i - t_j``, which keeps cached prefixes exact (see docs/hstu_variants.md).
    """
    return dict(attention="hstu", num_heads=num_heads, head_dim=attention_dim, value_dim=linear_dim, attn_alpha=1.0,
                norm_eps=1e-6, hstu_norm=float(max_len), hstu_activation="silu_uvqk", hstu_output="gated",
                hstu_output_norm="layer", time_bucket="ln_0301", num_time_buckets=num_buckets + 1,
                rab_without_time=False)


def nvidia_hstu_options(num_heads: int, kv_channels: int, *, layernorm_epsilon: float = 1e-5,
                        scaling_seqlen: float) -> dict:
    """``GRModelConfig`` options of NVIDIA recsys-examples' HSTU layer (``residual=True``); ``scaling_seqlen`` is
    the constant ``N`` to serve with (its default is the batch's longest sequence)."""
    return dict(attention="hstu", num_heads=num_heads, head_dim=kv_channels, value_dim=kv_channels,
                norm_eps=layernorm_epsilon, hstu_norm=scaling_seqlen, hstu_activation="silu_uvqk",
                hstu_output="gated", hstu_output_norm="layer")


# ---------------------------------------------------------------------------------------------------- checks
def _check_config(config: GRModelConfig, source: str, want: Mapping[str, object]) -> None:
    if not isinstance(config, GRModelConfig):
        raise ValueError(f"config must be a GRModelConfig, got {type(config).__name__}")
    if config.attention is not AttentionMode.HSTU:
        raise ValueError(f"config.attention must be 'hstu' to load {source} layers, got {config.attention.value!r}")
    for name, value in want.items():
        got = getattr(config, name)
        same = math.isclose(got, value, rel_tol=1e-12) if isinstance(value, float) else got == value
        if not same:
            shown = getattr(value, "value", value)
            raise ValueError(f"config.{name} must be {shown!r} for {source} layers, got {getattr(got, 'value', got)!r}")


def _layers(layer_state_dicts, config: GRModelConfig, source: str, known: set) -> list[Mapping]:
    sds = list(layer_state_dicts) if isinstance(layer_state_dicts, Sequence) else None
    if sds is None or not all(isinstance(sd, Mapping) for sd in sds):
        raise ValueError(f"layer_state_dicts must be a sequence of per-layer state dicts ({source}), got "
                         f"{type(layer_state_dicts).__name__}")
    if len(sds) != config.num_layers:
        raise ValueError(f"layer_state_dicts must have config.num_layers={config.num_layers} entries, got {len(sds)}")
    for i, sd in enumerate(sds):
        extra = sorted(set(sd) - known)
        if extra:
            raise ValueError(f"layer {i}: unexpected {source} tensors {extra} (expected names among {sorted(known)})")
    return sds


def _take(sd: Mapping, layer: int, name: str, shape: Sequence[int], meaning: str) -> torch.Tensor:
    """``sd[name]`` as a float tensor of ``shape``; ValueError naming the layer, tensor, meaning and shapes."""
    if name not in sd:
        raise ValueError(f"layer {layer}: missing {name} ({meaning}, shape {list(shape)})")
    x = sd[name]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"layer {layer}: {name} must be a floating-point tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"layer {layer}: {name} must have shape {list(shape)} ({meaning}), got {list(x.shape)}")
    return x.detach()


def _layer_out(l: int, config: GRModelConfig, *, uvqk_w, uvqk_b, in_w, in_b, out_norm_w, out_norm_b, out_w, out_b,
               pos=None, ts=None) -> dict:
    """The ``layers.{l}.*`` entries; absent biases are zero (no relative bias)."""
    ref = uvqk_w
    zeros = (lambda n: ref.new_zeros(n))
    p = f"layers.{l}."
    return {p + "input_norm.weight": in_w, p + "input_norm.bias": in_b,
            p + "uvqk.weight": uvqk_w.contiguous(), p + "uvqk.bias": uvqk_b,
            p + "rel_pos_bias": zeros(config.max_seq_len + 1) if pos is None else pos,
            p + "time_bias": zeros(config.num_time_buckets) if ts is None else ts,
            p + "output_norm.weight": out_norm_w, p + "output_norm.bias": out_norm_b,
            p + "out_proj.weight": out_w.contiguous(), p + "out_proj.bias": out_b}


def _clone(out: dict) -> dict:
    return {k: v.clone() for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------- converters
_STU_NAMES = {"_uvqk_weight", "_uvqk_beta", "_input_norm_weight", "_input_norm_bias", "_output_weight",
              "_output_norm_weight", "_output_norm_bias"}


def from_meta_stu(layer_state_dicts, config: GRModelConfig) -> dict:
    """``layers.{l}.*`` of a :class:`GRRanker` built with ``config`` from Meta ``STULayer`` state dicts.

    ``config`` must carry :func:`meta_stu_options` (SiLU on u, ``concat_ux`` output, eps 1e-6); the STU layer has
    no relative bias, so ``rel_pos_bias`` and ``time_bias`` are zero. Exact for any ``hstu_norm`` constant the
    STU model is evaluated with.
    """
    _check_config(config, "Meta STU", dict(hstu_activation=HSTUActivation.SILU_U, hstu_output=HSTUOutput.CONCAT_UX,
                                           norm_eps=1e-6))
    d, H, D, Dv = config.hidden_dim, config.num_heads, config.head_dim, config.value_dim
    group = config.hstu_output_norm is HSTUOutputNorm.GROUP
    norm_width = H if group else H * Dv
    norm_what = f"num_heads={H} (use_group_norm)" if group else f"hidden_dim * num_heads = {Dv}*{H}"
    out = {}
    for l, sd in enumerate(_layers(layer_state_dicts, config, "Meta STU", _STU_NAMES)):
        w = _take(sd, l, "_uvqk_weight", (d, (2 * Dv + 2 * D) * H),
                  f"embedding_dim={d}, (2*hidden_dim + 2*attention_dim) * num_heads = (2*{Dv} + 2*{D}) * {H}")
        out.update(_layer_out(
            l, config, uvqk_w=w.t(),
            uvqk_b=_take(sd, l, "_uvqk_beta", ((2 * Dv + 2 * D) * H,), "(2*hidden_dim + 2*attention_dim) * num_heads"),
            in_w=_take(sd, l, "_input_norm_weight", (d,), "embedding_dim"),
            in_b=_take(sd, l, "_input_norm_bias", (d,), "embedding_dim"),
            out_norm_w=_take(sd, l, "_output_norm_weight", (norm_width,), norm_what),
            out_norm_b=_take(sd, l, "_output_norm_bias", (norm_width,), norm_what),
            out_w=_take(sd, l, "_output_weight", (3 * Dv * H, d), f"3 * hidden_dim * num_heads = 3*{Dv}*{H}, "
                                                                   f"embedding_dim={d}").t(),
            out_b=w.new_zeros(d)))
    return _clone(out)


_RESEARCH_NAMES = {"_uvqk", "_o.weight", "_o.bias", "_rel_attn_bias._pos_w", "_rel_attn_bias._ts_w",
                   "_rel_attn_bias._w"}


def _research_positions(sd: Mapping, layer: int, name: str, config: GRModelConfig) -> torch.Tensor:
    """Our ``rel_pos_bias[dist]`` from the research table ``[2N-1]``: ``_pos_w[N-1 - dist]``; distances past
    ``N - 1`` (candidates after a history of ``N`` tokens) take the farthest entry ``_pos_w[0]``. The research
    layer divides by the same ``N``, so ``config.hstu_norm`` must equal it."""
    x = sd.get(name)
    if not (isinstance(x, torch.Tensor) and x.dim() == 1 and x.numel() % 2):
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"layer {layer}: {name} must have shape [2N-1] (2 * max_seq_len - 1, an odd length), "
                         f"got {got}")
    n = (x.numel() + 1) // 2
    pos_w = _take(sd, layer, name, (2 * n - 1,), "2 * max_seq_len - 1")
    if config.hstu_norm != float(n):
        raise ValueError(f"layer {layer}: {name} has 2N-1 = {2 * n - 1} entries, so the research layer divides by "
                         f"N = {n}; config.hstu_norm must be {float(n)}, got {config.hstu_norm!r}")
    dist = torch.arange(config.max_seq_len + 1).clamp(max=n - 1)
    return pos_w[n - 1 - dist]


def from_meta_research_hstu(layer_state_dicts, config: GRModelConfig) -> dict:
    """``layers.{l}.*`` of a :class:`GRRanker` built with ``config`` from Meta research HSTU layer state dicts.

    ``config`` must carry :func:`meta_research_options` (SiLU on u, v, q, k; alpha 1; eps 1e-6; ``ln_0301`` time
    buckets with ``len(_ts_w)`` buckets; no relative bias without timestamps). The research LayerNorms have no
    affine parameters (weight 1, bias 0 here) and ``_uvqk`` no bias. ``concat_ua=True`` checkpoints (an ``_o``
    reading ``3 * linear_dim * num_heads`` features) are refused.
    """
    _check_config(config, "Meta research HSTU", dict(
        hstu_activation=HSTUActivation.SILU_UVQK, hstu_output=HSTUOutput.GATED, hstu_output_norm=HSTUOutputNorm.LAYER,
        norm_eps=1e-6, attn_alpha=1.0, time_bucket=TimeBucket.LN_0301, rab_without_time=False))
    d, H, D, Dv = config.hidden_dim, config.num_heads, config.head_dim, config.value_dim
    out = {}
    for l, sd in enumerate(_layers(layer_state_dicts, config, "Meta research HSTU", _RESEARCH_NAMES)):
        w = _take(sd, l, "_uvqk", (d, (2 * Dv + 2 * D) * H),
                  f"embedding_dim={d}, linear_dim*2*num_heads + attention_dim*2*num_heads = {Dv}*2*{H} + {D}*2*{H}")
        o_w = sd.get("_o.weight")
        if isinstance(o_w, torch.Tensor) and tuple(o_w.shape) == (d, 3 * Dv * H):
            raise ValueError(f"layer {l}: _o.weight reads 3 * linear_dim * num_heads = {3 * Dv * H} features "
                             "(concat_ua=True), which is not supported")
        pos = ts = None
        if "_rel_attn_bias._w" in sd:  # RelativePositionalBias: positions only
            pos = _research_positions(sd, l, "_rel_attn_bias._w", config)
        elif "_rel_attn_bias._pos_w" in sd or "_rel_attn_bias._ts_w" in sd:
            pos = _research_positions(sd, l, "_rel_attn_bias._pos_w", config)
            ts = _take(sd, l, "_rel_attn_bias._ts_w", (config.num_time_buckets,),
                       f"num_buckets + 1 = config.num_time_buckets {config.num_time_buckets}")
        ones, zeros = w.new_ones, w.new_zeros
        out.update(_layer_out(
            l, config, uvqk_w=w.t(), uvqk_b=zeros((2 * Dv + 2 * D) * H), in_w=ones(d), in_b=zeros(d),
            out_norm_w=ones(Dv * H), out_norm_b=zeros(Dv * H),
            out_w=_take(sd, l, "_o.weight", (d, Dv * H), f"embedding_dim={d}, linear_dim * num_heads = {Dv}*{H}"),
            out_b=_take(sd, l, "_o.bias", (d,), "embedding_dim"), pos=pos, ts=ts))
    return _clone(out)


_NVIDIA_NAMES = {"_linear_uvqk_weight", "_linear_uvqk_bias", "_linear_proj_weight", "_input_layernorm_weight",
                 "_input_layernorm_bias", "_output_layernorm_weight", "_output_layernorm_bias"}


def _per_head_to_blocks(x: torch.Tensor, H: int, Dv: int, D: int) -> torch.Tensor:
    """Columns (last dim) grouped per head ``[u_h, v_h, q_h, k_h]`` -> blocks ``[u | v | q | k]``, head-major."""
    lead = x.shape[:-1]
    u, v, q, k = x.reshape(*lead, H, 2 * Dv + 2 * D).split([Dv, Dv, D, D], dim=-1)
    return torch.cat([t.reshape(*lead, -1) for t in (u, v, q, k)], dim=-1)


def from_nvidia_hstu(layer_state_dicts, config: GRModelConfig) -> dict:
    """``layers.{l}.*`` of a :class:`GRRanker` built with ``config`` from NVIDIA recsys-examples training
    ``FusedHSTULayer`` state dicts (per-head interleaved u/v/q/k; no output bias).

    ``config`` must carry :func:`nvidia_hstu_options` (SiLU on u, v, q, k; gated output with LayerNorm). Without
    ``_input_layernorm_*`` (``learnable_input_layernorm=False``) the input LayerNorm has weight 1 and bias 0.
    """
    _check_config(config, "NVIDIA HSTU", dict(hstu_activation=HSTUActivation.SILU_UVQK, hstu_output=HSTUOutput.GATED,
                                              hstu_output_norm=HSTUOutputNorm.LAYER))
    d, H, D, Dv = config.hidden_dim, config.num_heads, config.head_dim, config.value_dim
    width = (2 * Dv + 2 * D) * H
    out = {}
    for l, sd in enumerate(_layers(layer_state_dicts, config, "NVIDIA HSTU", _NVIDIA_NAMES)):
        w = _take(sd, l, "_linear_uvqk_weight", (d, width),
                  f"hidden_size={d}, (2*kv_channels + 2*kv_channels) * num_heads = (2*{Dv} + 2*{D}) * {H}")
        learned = "_input_layernorm_weight" in sd or "_input_layernorm_bias" in sd
        in_w = _take(sd, l, "_input_layernorm_weight", (d,), "hidden_size") if learned else w.new_ones(d)
        in_b = _take(sd, l, "_input_layernorm_bias", (d,), "hidden_size") if learned else w.new_zeros(d)
        out.update(_layer_out(
            l, config, uvqk_w=_per_head_to_blocks(w, H, Dv, D).t(),
            uvqk_b=_per_head_to_blocks(_take(sd, l, "_linear_uvqk_bias", (width,), "(2*Dv + 2*Dqk) * num_heads"),
                                       H, Dv, D),
            in_w=in_w, in_b=in_b,
            out_norm_w=_take(sd, l, "_output_layernorm_weight", (Dv * H,), "kv_channels * num_heads"),
            out_norm_b=_take(sd, l, "_output_layernorm_bias", (Dv * H,), "kv_channels * num_heads"),
            out_w=_take(sd, l, "_linear_proj_weight", (Dv * H, d), f"kv_channels * num_heads = {Dv}*{H}, "
                                                                    f"hidden_size={d}").t(),
            out_b=w.new_zeros(d)))
    return _clone(out)
