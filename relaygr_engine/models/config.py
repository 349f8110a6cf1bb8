"""The ranker's configuration."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from ..config import check_int, parse_choice
from ..ops import AttentionMode

__all__ = ["GRModelConfig"]


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
        HSTU time-bias buckets ``NB`` in ``[1, 64]``; bucket of a time difference ``d`` seconds is
        ``min(bit_length(max(d, 0)), NB - 1)``. The default 32 separates gaps up to ~34 years.
    num_context_tokens : int
        Contextual user tokens (user features) placed before the behaviors; 0 turns them off.
    context_vocab_size : int
        Vocabulary of the contextual token ids (needed when ``num_context_tokens > 0``).
    ffn_dim : int, optional
        softmax layers: width of the feed-forward block (default ``4 * hidden_dim``).
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", parse_choice(AttentionMode, self.attention, "attention"))
        for name in ("num_layers", "hidden_dim", "num_heads", "head_dim", "num_items", "num_actions",
                     "max_seq_len", "num_tasks", "num_time_buckets"):
            object.__setattr__(self, name, _int(name, getattr(self, name), 1))
        if self.num_time_buckets > 64:
            raise ValueError(f"num_time_buckets must be in [1, 64], got {self.num_time_buckets}")
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
        """softmax: the logit scale; hstu: ``alpha``. Both ``1 / sqrt(head_dim)``."""
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def hstu_norm(self) -> float:
        """HSTU's constant normaliser ``N = max_seq_len``."""
        return float(self.max_seq_len)
