"""One user's behavior sequence."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

__all__ = ["Behaviors"]


def _long_1d(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a 1-D int64 torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    if x.dtype != torch.long:
        raise ValueError(f"{name} must be int64 (torch.long), got {x.dtype}")


@dataclass(frozen=True, eq=False)
class Behaviors:
    """One user's behaviors, oldest first.

    Parameters
    ----------
    item_ids : LongTensor [L]
        Items the user interacted with.
    action_ids : LongTensor [L], optional
        The action of each interaction (click, like, ...). Without it the action embedding is left out.
    timestamps : LongTensor [L], optional
        Interaction times in seconds (int64, >= 0). Without them the HSTU time bias is left out.
    context_ids : LongTensor [num_context_tokens], optional
        Contextual user-feature tokens placed before the behaviors; required exactly when the model has
        ``num_context_tokens > 0``.

    Notes
    -----
    Structure (1-D, int64, equal lengths, one device) is checked here; id ranges and lengths against a model are
    checked by :meth:`GRRanker.check_inputs`.

    Tokens: the ``len(context_ids)`` contextual tokens come first, then the behaviors; history token ``t`` sits at
    position ``t`` (:attr:`num_tokens` in all). :meth:`token_keys` says what each token is, for prefix fingerprints.
    """

    item_ids: torch.Tensor
    action_ids: Optional[torch.Tensor] = None
    timestamps: Optional[torch.Tensor] = None
    context_ids: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        _long_1d("item_ids", self.item_ids)
        n, dev = self.item_ids.numel(), self.item_ids.device
        for name in ("action_ids", "timestamps", "context_ids"):
            x = getattr(self, name)
            if x is None:
                continue
            _long_1d(name, x)
            if x.device != dev:
                raise ValueError(f"{name} must be on {dev} (the device of item_ids), got {x.device}")
            if name != "context_ids" and x.numel() != n:
                raise ValueError(f"{name} must have {n} entries (len(item_ids)), got {x.numel()}")

    def __len__(self) -> int:
        return self.item_ids.numel()

    def __repr__(self) -> str:
        parts = [f"len={len(self)}"]
        parts += [name for name in ("action_ids", "timestamps", "context_ids") if getattr(self, name) is not None]
        return f"Behaviors({', '.join(parts)}, device={self.device})"

    @property
    def device(self) -> torch.device:
        return self.item_ids.device

    @property
    def num_context_tokens(self) -> int:
        """Contextual tokens before the behaviors (``len(context_ids)``, 0 without them)."""
        return 0 if self.context_ids is None else self.context_ids.numel()

    @property
    def num_tokens(self) -> int:
        """History tokens ``T``: contextual tokens plus behaviors."""
        return self.num_context_tokens + len(self)

    def token_timestamps(self) -> Optional[torch.Tensor]:
        """Timestamps of the ``T`` history tokens (contextual tokens take the first behavior's), or None."""
        ts, U = self.timestamps, self.num_context_tokens
        if ts is None:
            return None
        return torch.cat([ts[:1].expand(U), ts]) if U else ts

    def arrays(self) -> tuple:
        """The tensors as host numpy arrays ``(item_ids, action_ids, timestamps, context_ids)`` (None stays None).

        For a CPU history these are views of the tensors' memory, made once per history and kept (validation,
        fingerprints and the batch rows all read them: one conversion per request); elsewhere host copies, made
        on every call.
        """
        kept = self.__dict__.get("_arrays")
        if kept is not None:
            return kept
        fields = (self.item_ids, self.action_ids, self.timestamps, self.context_ids)
        if self.item_ids.device.type != "cpu":
            return tuple(None if x is None else x.cpu().numpy() for x in fields)
        out = self.__dict__["_arrays"] = tuple(None if x is None else x.numpy() for x in fields)
        return out

    def token_keys(self, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """What each history token is, for prefix fingerprints: int64 ``[stop - start, 4]`` rows ``(kind, id, action,
        time)`` of tokens ``start .. stop - 1`` (default: all ``T``).

        ``kind`` is 0 for a contextual token, 1 for a behavior; ``action`` is -1 without action ids; ``time`` is 0
        without timestamps. Two histories whose first ``n`` rows agree give identical K/V for their first ``n``
        tokens in a prefix-stable model (with equal weights and the same presence of action ids and timestamps).
        Rows of a range equal the same rows of the whole table (a ranking builds the rows of its new tokens only).

        Raises
        ------
        ValueError
            ``start``/``stop`` not integers with ``0 <= start <= stop <= T``.
        """
        U, T = self.num_context_tokens, self.num_tokens
        stop = T if stop is None else stop
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= T):
            raise ValueError(f"start and stop must be integers with 0 <= start <= stop <= {T}, got {start!r} and "
                             f"{stop!r}")
        items, actions, times, context = self.arrays()
        keys = np.empty((stop - start, 4), dtype=np.int64)  # (every entry written below)
        c0, c1 = min(start, U), min(stop, U)                # contextual tokens in the range
        b0, b1 = max(start, U) - U, max(stop, U) - U        # behaviors in the range
        ctx, beh = keys[:c1 - c0], keys[c1 - c0:]
        ctx[:, 0], beh[:, 0] = 0, 1
        if c1 > c0:
            ctx[:, 1] = context[c0:c1]
        beh[:, 1] = items[b0:b1]
        ctx[:, 2], beh[:, 2] = -1, (-1 if actions is None else actions[b0:b1])
        if times is None:
            keys[:, 3] = 0
        else:
            beh[:, 3] = times[b0:b1]
            if c1 > c0:
                ctx[:, 3] = times[0]  # contextual tokens take the first behavior's time (token_timestamps)
        return keys

    def prefix(self, n: int) -> "Behaviors":
        """The first ``n`` behaviors (contextual tokens kept)."""
        if not isinstance(n, int) or not 0 <= n <= len(self):
            raise ValueError(f"n must be an integer in [0, {len(self)}], got {n!r}")
        cut = (lambda x: None if x is None else x[:n])
        return Behaviors(self.item_ids[:n], cut(self.action_ids), cut(self.timestamps), self.context_ids)

    def to(self, device) -> "Behaviors":
        """A copy on ``device``."""
        mv = (lambda x: None if x is None else x.to(device))
        return Behaviors(mv(self.item_ids), mv(self.action_ids), mv(self.timestamps), mv(self.context_ids))
