"""The ranker's configuration and the choices of its HSTU layer variants."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Union

from ..config import AttentionMode, TimeBucket, check_int, parse_choice
from ..kernels._common import check_scalar
from ..attention.time_buckets import check_time_buckets

__all__ = ["GRModelConfig", "HSTUActivation", "HSTUOutput", "HSTUOutputNorm"]


class HSTUActivation(str, enum.Enum):
    """Where an HSTU layer applies SiLU to its fused projection ``[u | v | q | k]``."""

    SILU_U = "silu_u"        # u only (Meta's production STU)
    SILU_UVQK = "silu_uvqk"  # all of u, v, q, k (Meta's research HSTU, NVIDIA recsys-examples)


class HSTUOutput(str, enum.Enum):
    """What an HSTU layer's output projection reads (``a = A V``, ``n = norm(a)``, ``u`` after its activation)."""

    GATED = "gated"          # u * n                              (out_proj: [d, H*Dv])
    CONCAT_UX = "concat_ux"  # concat(u, a, u * n), a un-normalised (out_proj: [d, 3*H*Dv]; Meta's STU)


class HSTUOutputNorm(str, enum.Enum):
    """How an HSTU layer normalises its attention output ``a [T, H, Dv]``."""

    LAYER = "layer"  # LayerNorm over all H*Dv features (weight, bias [H*Dv])
    GROUP = "group"  # per-head group norm over each head's Dv features (weight, bias [H]; STU use_group_norm)


_HSTU_ONLY = dict(hstu_activation=HSTUActivation.SILU_U, hstu_output=HSTUOutput.GATED,
                  hstu_output_norm=HSTUOutputNorm.LAYER, time_bucket=TimeBucket.LOG2, rab_without_time=True)


def _int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int >= ``minimum`` (numpy integers accepted, bools refused)."""
    return check_int(name, value, minimum)


@dataclass(frozen=True)
class GRModelConfig:
    """Shape and vocabulary of a generative-recommendation ranker.

    Parameters
    ----------
    attention : {"hstu", "softmax"}
        ``"hstu"``: HSTU layers (pointwise SiLU attention with relative position and time biases);
        ``"softmax"``: pre-LN transformer layers.
    num_layers : int
    hidden_dim : int
        Width of the residual stream (token embeddings).
    num_heads, head_dim : int
        Attention heads and their width; the cache stores ``num_heads x head_dim`` K and V per token and layer.
    num_items : int
        Item vocabulary: item ids (history and candidates) are in ``[0, num_items)``.
    num_actions : int
        Action vocabulary: action ids are in ``[0, num_actions)``.
    max_seq_len : int
        Most history tokens (contextual tokens + behaviors) a request may hold. Also HSTU's normaliser ``N`` and
        the size - 1 of the position tables (candidates sit at position ``max_seq_len`` at most).
    num_tasks : int
        Scores per candidate (multi-task heads, e.g. click, like, ...).
    num_time_buckets : int
        HSTU time-bias buckets ``NB``: ``[1, 64]`` for ``time_bucket="log2"``, ``[1, 4096]`` otherwise; a time
        difference falls in ``min(time_bucket(d), NB - 1)``. The default 32 separates log2 gaps up to ~34 years.
    num_context_tokens : int
        Contextual user tokens (user features) placed before the behaviors; 0 turns them off.
    context_vocab_size : int
        Vocabulary of the contextual token ids (needed when ``num_context_tokens > 0``).
    ffn_dim : int, optional
        softmax layers: width of the feed-forward block (default ``4 * hidden_dim``).
    value_dim : int, optional
        Width ``Dv`` per head of ``v`` (and of HSTU's ``u``), default ``head_dim`` (the q/k width). The cache
        stores ``max(head_dim, value_dim)`` per head.
    norm_eps : float
        eps of every LayerNorm / group norm of the model (default 1e-5; Meta's HSTU implementations use 1e-6).
    attn_alpha : float, optional
        The scale of ``q.k`` (HSTU's ``alpha``, softmax's logit scale); default ``1 / sqrt(head_dim)``. Meta's
        research HSTU uses 1.0.
    hstu_norm : float or "batch", optional
        HSTU's normaliser ``N`` (the sum over keys is divided by it); default ``max_seq_len``. ``"batch"`` divides
        by the batch's longest sequence (rows of one user), as Meta's STU trains: the dense forward reproduces
        such a model exactly, but it is not prefix-stable, so a relay engine refuses it.
    hstu_activation : {"silu_u", "silu_uvqk"}
        Where SiLU applies to the fused projection (:class:`HSTUActivation`).
    hstu_output : {"gated", "concat_ux"}
        What the output projection reads (:class:`HSTUOutput`).
    hstu_output_norm : {"layer", "group"}
        LayerNorm of the attention output, or a per-head group norm (:class:`HSTUOutputNorm`).
    time_bucket : {"log2", "ln_0301", "sqrt_60"}
        The time-bias bucket function (:class:`~relaygr_engine.config.TimeBucket`).
    rab_without_time : bool
        Keep the position bias for requests without timestamps (default True); False drops the whole relative
        bias then, as Meta's research HSTU does.

    The HSTU-only options (``hstu_*``, ``time_bucket``, ``rab_without_time``) must keep their defaults with
    ``attention="softmax"``. Every option keeps cached prefixes exact except ``hstu_norm="batch"``.
    """

    attention: Union[str, AttentionMode] = AttentionMode.HSTU
    num_layers: int = 2
    hidden_dim: int = 64
    num_heads: int = 2
    head_dim: int = 32
    num_items: int = 1000
    num_actions: int = 4
    max_seq_len: int = 1024
    num_tasks: int = 2
    num_time_buckets: int = 32
    num_context_tokens: int = 0
    context_vocab_size: int = 0
    ffn_dim: Optional[int] = None
    value_dim: Optional[int] = None
    norm_eps: float = 1e-5
    attn_alpha: Optional[float] = None
    hstu_norm: Union[None, float, str] = None
    hstu_activation: Union[str, HSTUActivation] = HSTUActivation.SILU_U
    hstu_output: Union[str, HSTUOutput] = HSTUOutput.GATED
    hstu_output_norm: Union[str, HSTUOutputNorm] = HSTUOutputNorm.LAYER
    time_bucket: Union[str, TimeBucket] = TimeBucket.LOG2
    rab_without_time: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", parse_choice(AttentionMode, self.attention, "attention"))
        for name, cls in (("hstu_activation", HSTUActivation), ("hstu_output", HSTUOutput),
                          ("hstu_output_norm", HSTUOutputNorm), ("time_bucket", TimeBucket)):
            object.__setattr__(self, name, parse_choice(cls, getattr(self, name), name))
        if not isinstance(self.rab_without_time, bool):
            raise ValueError(f"rab_without_time must be a bool, got {self.rab_without_time!r}")
        if self.attention is AttentionMode.SOFTMAX:
            for name, default in _HSTU_ONLY.items():
                if getattr(self, name) != default:
                    raise ValueError(f"{name} applies to attention='hstu' only, got {name}="
                                     f"{getattr(self, name)!r} with attention='softmax'")
            if self.hstu_norm is not None:
                raise ValueError(f"hstu_norm applies to attention='hstu' only, got hstu_norm={self.hstu_norm!r} "
                                 "with attention='softmax'")
        for name in ("num_layers", "hidden_dim", "num_heads", "head_dim", "num_items", "num_actions",
                     "max_seq_len", "num_tasks", "num_time_buckets"):
            object.__setattr__(self, name, _int(name, getattr(self, name), 1))
        check_time_buckets("num_time_buckets", self.num_time_buckets, self.time_bucket)
        if self.value_dim is None:
            object.__setattr__(self, "value_dim", self.head_dim)
        object.__setattr__(self, "value_dim", _int("value_dim", self.value_dim, 1))
        object.__setattr__(self, "norm_eps", check_scalar("norm_eps", self.norm_eps, positive=True))
        if self.attn_alpha is not None:
            object.__setattr__(self, "attn_alpha", check_scalar("attn_alpha", self.attn_alpha))
        if self.hstu_norm is None and self.attention is AttentionMode.HSTU:
            object.__setattr__(self, "hstu_norm", float(self.max_seq_len))
        elif self.hstu_norm is not None and self.hstu_norm != "batch":
            object.__setattr__(self, "hstu_norm", check_scalar("hstu_norm (a number or 'batch')", self.hstu_norm,
                                                               positive=True))
        object.__setattr__(self, "num_context_tokens", _int("num_context_tokens", self.num_context_tokens, 0))
        object.__setattr__(self, "context_vocab_size", _int("context_vocab_size", self.context_vocab_size,
                                                            1 if self.num_context_tokens else 0))
        if self.num_context_tokens >= self.max_seq_len:
            raise ValueError(f"num_context_tokens must be < max_seq_len ({self.max_seq_len}) to leave room for a "
                             f"behavior, got {self.num_context_tokens}")
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.hidden_dim)
        object.__setattr__(self, "ffn_dim", _int("ffn_dim", self.ffn_dim, 1))

    @property
    def attention_scale(self) -> float:
        """softmax: the logit scale; hstu: ``alpha``. ``attn_alpha``, by default ``1 / sqrt(head_dim)``."""
        return 1.0 / math.sqrt(self.head_dim) if self.attn_alpha is None else self.attn_alpha
