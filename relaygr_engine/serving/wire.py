"""JSON form of requests, tickets and replies (shared by the Python handle and the HTTP endpoints).

Request (``POST /prefill`` and ``POST /rank``, or ``handle.prefill.remote(body)`` / ``handle.rank.remote(body)``)::

    {"user_id": 7,                      # int in [0, 2**64) (or its decimal string)
     "item_ids": [3, 14, ...],          # the history, oldest first
     "action_ids": [0, 1, ...],         # optional, same length
     "timestamps": [1700000000, ...],   # optional, seconds, same length
     "context_ids": [5, 9],             # optional, the model's contextual tokens
     "candidates": [11, 42, ...],       # /rank only: item ids to score
     "request_time": 1700000100,        # /rank only, optional: the candidates' timestamp
     "ticket": {...}}                   # /rank only, optional: the "ticket" of a /prefill reply

Prefill reply::

    {"replica": "ab12", "admitted": true, "rejected": false, "reason": "admitted",
     "route_key": "7;at=ab12", "cached_tokens": 0, "computed_tokens": 600,
     "ticket": {"admitted": true, "reason": "admitted", "user_id": 7, "fingerprint": "1234...",
                "num_tokens": 600, "expires_at": 812.5, "cached_tokens": 0, "computed_tokens": 600,
                "replica": "ab12"}}

``rejected`` is true when the replica could not take the pre-infer now (its pool or the trigger's footprint or
load bound declined it, or its pending pre-infers are at their bound): the caller should forward it to the user's
next replica. A decline that no replica would overturn (``trigger:not_at_risk``, ``budget``) is not a rejection.
The fingerprint is a decimal string (64-bit values do not survive JSON numbers in every language).

Rank reply::

    {"replica": "ab12", "scores": [[0.1, -0.3], ...], "source": "hbm", "cached_tokens": 600,
     "computed_tokens": 264, "ticket_used": true}

``scores`` is ``[C][num_tasks]`` (fp32 values as JSON numbers); ``source`` is ``"hbm"``, ``"dram"`` or
``"recompute"``; ``ticket_used`` is false when no ticket came or it was issued by another replica (the user was
re-routed, e.g. after a replica failure): that ranking computes what this replica does not hold.

Compact arrays: with ``"encoding": "b64le"`` every id list of the request (``item_ids``, ``action_ids``,
``timestamps``, ``context_ids``, ``candidates``) is instead a base64 string of little-endian int64 values, and the
rank reply's ``scores`` is a base64 string of little-endian float32 values, row-major ``[C, num_tasks]``, with
``"scores_shape": [C, num_tasks]``. Without ``encoding`` (or ``"json"``) everything is JSON lists, as above.

Ranking by difference (:mod:`~relaygr_engine.serving.prefix_store`): a ranking that presents an admitted ticket
may send, instead of its whole history, ``"prefix": {"num_tokens": N, "digest": "..."}`` (the ticket's
``num_tokens`` and :func:`history_digest` of the history's first ``N`` tokens) with ``item_ids`` / ``action_ids`` /
``timestamps`` holding only the behaviors after that prefix (no ``context_ids``: they belong to the prefix). The
replica rebuilds the history from the prefix it pre-inferred; when it no longer holds that prefix or the digest
differs it answers HTTP 409 with ``"need_full_history": true`` before anything changes, and the caller sends the
whole history.

Limits (:class:`RequestLimits`): an HTTP body is refused past ``max_body_bytes`` (from its Content-Length, or while
it is read) and past ``max_json_depth`` nested arrays and objects (counted on the raw bytes) before it is parsed as
JSON; a history list past ``max_history`` entries and candidates past ``max_candidates`` are refused before any
tensor is made. Each refusal is a :class:`RequestTooLarge` (HTTP 413) or another ``ValueError`` (HTTP 400) that
names the limit.
"""
from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np
import torch

from ..config import check_int
from ..engine import PrefixTicket, RankResult
from ..models import Behaviors
from .route_key import RouteKey, parse_user_id

__all__ = ["REJECT_REASONS", "Encoding", "RequestLimits", "RequestTooLarge", "NeedFullHistory",
           "behaviors_to_json", "behaviors_from_json", "ids_to_json", "ticket_to_json", "ticket_from_json",
           "candidates_from_json", "history_digest", "prefix_ref_from_json", "json_depth", "parse_body",
           "prefill_reply", "rank_reply", "scores_from_json"]

MAX_JSON_DEPTH = 256
"""The most nesting :class:`RequestLimits` may allow (Python's JSON parser recurses once per level)."""


class RequestTooLarge(ValueError):
    """A request body past ``RequestLimits.max_body_bytes`` (HTTP 413)."""


class NeedFullHistory(ValueError):
    """A ranking by difference whose prefix this replica does not hold, or holds with another digest (HTTP 409):
    nothing changed; send the whole history. ``reason``: ``"unknown_ticket"`` or ``"digest_mismatch"``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Encoding(str, enum.Enum):
    """How a request's id lists (and a rank reply's scores) are written."""

    JSON = "json"      # JSON lists of numbers
    B64LE = "b64le"    # base64 of little-endian int64 ids / float32 scores


@dataclass(frozen=True)
class RequestLimits:
    """Bounds every request is held to before it is parsed into tensors.

    Parameters
    ----------
    max_body_bytes : int
        HTTP request body, in bytes (default 1 MiB): a larger Content-Length is refused before the body is read, a
        body that grows past it while read is refused there (413).
    max_json_depth : int
        Nested JSON arrays and objects in ``[1, 256]`` (default 8; a request needs 3).
    max_candidates : int
        Candidates of a ranking (default 4096).
    max_history : int, optional
        Entries of each history list (``item_ids``, ``action_ids``, ``timestamps``, ``context_ids``); None (default)
        takes the model's ``max_seq_len``.
    """

    max_body_bytes: int = 1 << 20
    max_json_depth: int = 8
    max_candidates: int = 4096
    max_history: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_candidates"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        if self.max_json_depth > MAX_JSON_DEPTH:
            raise ValueError(f"max_json_depth must be in [1, {MAX_JSON_DEPTH}], got {self.max_json_depth}")
        if self.max_history is not None:
            object.__setattr__(self, "max_history", check_int("max_history", self.max_history, 1))

    def check_body_size(self, num_bytes: int) -> None:
        """RequestTooLarge when a body of ``num_bytes`` bytes (declared or read so far) is past the limit."""
        if num_bytes > self.max_body_bytes:
            raise RequestTooLarge(f"request body must be at most max_body_bytes={self.max_body_bytes} bytes, got "
                                  f"{num_bytes} bytes or more")


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays and objects in JSON text ``raw`` (brackets inside strings do not count).

    Linear in ``len(raw)``, no recursion: safe to run on any body before it is parsed.
    """
    b = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    step = ((b == ord("[")) | (b == ord("{"))).astype(np.int32) - ((b == ord("]")) | (b == ord("}")))
    return int(np.cumsum(step).max(initial=0))


def parse_body(raw: bytes, limits: RequestLimits) -> Any:
    """The JSON value of a request body, after its size and nesting are checked against ``limits``.

    Raises
    ------
    RequestTooLarge
        More than ``max_body_bytes`` bytes.
    ValueError
        Nested deeper than ``max_json_depth``, or not JSON.
    """
    limits.check_body_size(len(raw))
    openers = raw.count(b"[") + raw.count(b"{")   # the depth is at most this: scanned only when it could pass
    depth = json_depth(raw) if openers > limits.max_json_depth else openers
    if depth > limits.max_json_depth:
        raise ValueError(f"request body must nest JSON arrays and objects at most max_json_depth="
                         f"{limits.max_json_depth} deep, got {depth}")
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers past Python's digit limit
        raise ValueError(f"request body must be JSON: {e}") from None

REJECT_REASONS = frozenset({"pool_full", "trigger:footprint", "trigger:load", "replica:busy"})
"""Prefill reasons that mean "not now, try the next replica" (``replica:busy``: pending pre-infers at the bound)."""


def encoding_of(body: Mapping[str, Any]) -> Encoding:
    """The ``encoding`` of a request body (default JSON lists); ValueError for another value."""
    value = body.get("encoding", Encoding.JSON.value)
    try:
        return Encoding(value)
    except ValueError:
        raise ValueError(f"encoding must be one of {', '.join(e.value for e in Encoding)}, got {value!r}") from None


def _ids(name: str, value, limit: Optional[int] = None, limit_name: str = "",
         encoding: Encoding = Encoding.JSON) -> torch.Tensor:
    if encoding is Encoding.B64LE:
        return _b64_ids(name, value, limit, limit_name)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise ValueError(f"{name} must hold at most {limit_name}={limit} entries, got {len(value)}")
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in value):
        bad = next(v for v in value if isinstance(v, bool) or not isinstance(v, (int, np.integer)))
        raise ValueError(f"{name} must be a list of integers, got an element {bad!r}")
    try:
        return torch.tensor(value, dtype=torch.long)
    except (OverflowError, RuntimeError):
        raise ValueError(f"{name} must hold int64 values") from None


def _b64_ids(name: str, value, limit: Optional[int], limit_name: str) -> torch.Tensor:
    """Ids from a base64 string of little-endian int64; the entry count is checked on the string's length, before
    it is decoded."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a base64 string of little-endian int64 (encoding b64le), got "
                         f"{type(value).__name__}")
    if limit is not None and len(value) > 4 * -(-8 * limit // 3):  # base64 of `limit` int64 values at most
        raise ValueError(f"{name} must hold at most {limit_name}={limit} entries, got a {len(value)}-character "
                         "string (more)")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} must be a base64 string of little-endian int64 (encoding b64le)") from None
    if len(raw) % 8:
        raise ValueError(f"{name} must hold whole int64 values (a multiple of 8 bytes), got {len(raw)} bytes")
    if limit is not None and len(raw) // 8 > limit:
        raise ValueError(f"{name} must hold at most {limit_name}={limit} entries, got {len(raw) // 8}")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i8").astype(np.int64))


def ids_to_json(x: torch.Tensor, encoding: Encoding = Encoding.JSON):
    """Ids ``[n]`` as a JSON list, or (``b64le``) a base64 string of little-endian int64."""
    x = x.detach().cpu()
    if Encoding(encoding) is Encoding.B64LE:
        return base64.b64encode(x.numpy().astype("<i8", copy=False).tobytes()).decode("ascii")
    return x.tolist()


def behaviors_to_json(history: Behaviors, encoding: Encoding = Encoding.JSON) -> dict:
    """The ``item_ids`` / ``action_ids`` / ``timestamps`` / ``context_ids`` fields of a request (``b64le``: with
    ``"encoding"``)."""
    if not isinstance(history, Behaviors):
        raise ValueError(f"history must be a Behaviors, got {type(history).__name__}")
    encoding = Encoding(encoding)
    out = {"item_ids": ids_to_json(history.item_ids, encoding)}
    for name in ("action_ids", "timestamps", "context_ids"):
        v = getattr(history, name)
        if v is not None:
            out[name] = ids_to_json(v, encoding)
    if encoding is not Encoding.JSON:
        out["encoding"] = encoding.value
    return out


def behaviors_from_json(body: Mapping[str, Any], device="cpu", max_history: Optional[int] = None) -> Behaviors:
    """The history of a request body; ValueError naming the field when it is malformed or a list holds more than
    ``max_history`` entries (checked before any tensor is made)."""
    if not isinstance(body, Mapping):
        raise ValueError(f"request body must be a JSON object, got {type(body).__name__}")
    if "item_ids" not in body:
        raise ValueError("request body must have item_ids (the history, oldest first)")
    encoding = encoding_of(body)
    fields = {}
    for name in ("item_ids", "action_ids", "timestamps", "context_ids"):
        if body.get(name) is not None:
            fields[name] = _ids(name, body[name], max_history, "max_history", encoding).to(device)
    return Behaviors(**fields)


def candidates_from_json(body: Mapping[str, Any], device="cpu", max_candidates: Optional[int] = None) -> torch.Tensor:
    """The candidates of a rank request body (at most ``max_candidates``, checked before the tensor is made)."""
    if body.get("candidates") is None:
        raise ValueError("a rank request must have candidates (a list of item ids)")
    return _ids("candidates", body["candidates"], max_candidates, "max_candidates", encoding_of(body)).to(device)


def history_digest(history: Behaviors, num_tokens: Optional[int] = None) -> str:
    """A digest of the first ``num_tokens`` history tokens (default all): 32 hex digits of BLAKE2b-128 over their
    :meth:`~relaygr_engine.models.Behaviors.token_keys` as little-endian int64 (what a token is: contextual or
    behavior, id, action, time), so two histories have equal digests exactly when those tokens agree."""
    keys = history.token_keys()
    n = keys.shape[0] if num_tokens is None else num_tokens
    if not isinstance(n, int) or not 0 <= n <= keys.shape[0]:
        raise ValueError(f"num_tokens must be an integer in [0, {keys.shape[0]}], got {num_tokens!r}")
    return hashlib.blake2b(keys[:n].astype("<i8", copy=False).tobytes(), digest_size=16).hexdigest()


_DIGEST = re.compile(r"^[0-9a-f]{32}$")


def prefix_ref_from_json(body: Mapping[str, Any]) -> Optional[tuple[int, str]]:
    """``(num_tokens, digest)`` of a ranking by difference (its ``"prefix"``), or None for a whole history."""
    ref = body.get("prefix")
    if ref is None:
        return None
    if not isinstance(ref, Mapping) or set(ref) != {"num_tokens", "digest"}:
        raise ValueError(f"prefix must be an object with num_tokens and digest, got {ref!r:.200}")
    n, digest = ref["num_tokens"], ref["digest"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"prefix.num_tokens must be an integer >= 1, got {n!r}")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ValueError(f"prefix.digest must be 32 lowercase hex digits, got {digest!r:.80}")
    if body.get("ticket") is None:
        raise ValueError("a ranking with a prefix must present the ticket of that prefix")
    if body.get("context_ids") is not None:
        raise ValueError("a ranking with a prefix must not send context_ids (they belong to the prefix)")
    return n, digest


def ticket_to_json(ticket: PrefixTicket, replica: str) -> dict:
    """A :class:`PrefixTicket` as JSON, with the id of the replica that holds the prefix."""
    return {"admitted": ticket.admitted, "reason": ticket.reason, "user_id": ticket.user_id,
            "fingerprint": str(ticket.fingerprint), "num_tokens": ticket.num_tokens, "expires_at": ticket.expires_at,
            "cached_tokens": ticket.cached_tokens, "computed_tokens": ticket.computed_tokens, "replica": replica}


def ticket_from_json(data: Mapping[str, Any]) -> tuple[PrefixTicket, Optional[str]]:
    """Inverse of :func:`ticket_to_json`: the ticket and the replica that issued it."""
    if not isinstance(data, Mapping):
        raise ValueError(f"ticket must be a JSON object, got {type(data).__name__}")
    try:
        fp = int(data["fingerprint"])
        ticket = PrefixTicket(admitted=bool(data["admitted"]), reason=str(data["reason"]),
                              user_id=parse_user_id(data["user_id"]), fingerprint=fp,
                              num_tokens=int(data["num_tokens"]),
                              expires_at=None if data.get("expires_at") is None else float(data["expires_at"]),
                              cached_tokens=int(data.get("cached_tokens", 0)),
                              computed_tokens=int(data.get("computed_tokens", 0)))
    except KeyError as e:
        raise ValueError(f"ticket must have the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"ticket is malformed: {e}") from None
    if not 0 <= fp < 1 << 64:
        raise ValueError(f"ticket fingerprint must be in [0, 2**64), got {fp}")
    replica = data.get("replica")
    return ticket, None if replica is None else str(replica)


def prefill_reply(ticket: Optional[PrefixTicket], replica: str, user_id: int, reason: Optional[str] = None) -> dict:
    """The reply to a pre-infer (``ticket`` None: rejected before reaching the engine, with ``reason``)."""
    reason = ticket.reason if ticket is not None else reason
    admitted = ticket is not None and ticket.admitted
    return {"replica": replica, "admitted": admitted, "rejected": (not admitted) and reason in REJECT_REASONS,
            "reason": reason,
            "route_key": RouteKey(user_id, at=replica).encode() if admitted else RouteKey(user_id).encode(),
            "cached_tokens": 0 if ticket is None else ticket.cached_tokens,
            "computed_tokens": 0 if ticket is None else ticket.computed_tokens,
            "ticket": ticket_to_json(ticket, replica) if admitted else None}


def rank_reply(result: RankResult, replica: str, ticket_used: bool, encoding: Encoding = Encoding.JSON) -> dict:
    """The reply to a ranking (``b64le``: scores as base64 float32 with ``scores_shape``)."""
    scores = result.scores.detach().float().cpu()
    out = {"replica": replica, "source": result.source, "cached_tokens": result.cached_tokens,
           "computed_tokens": result.computed_tokens, "ticket_used": ticket_used}
    if Encoding(encoding) is Encoding.B64LE:
        out["scores"] = base64.b64encode(scores.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
        out["scores_shape"] = list(scores.shape)
    else:
        out["scores"] = scores.tolist()
    return out


def scores_from_json(reply: Mapping[str, Any]) -> torch.Tensor:
    """The float32 ``[C, num_tasks]`` scores of a rank reply (JSON lists, or base64 with ``scores_shape``)."""
    scores = reply["scores"]
    if isinstance(scores, str):
        rows, cols = (int(v) for v in reply["scores_shape"])
        flat = np.frombuffer(base64.b64decode(scores, validate=True), dtype="<f4")
        return torch.from_numpy(flat.astype(np.float32).reshape(rows, cols))
    return torch.tensor(scores, dtype=torch.float32)
