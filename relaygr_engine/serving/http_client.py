"""A client of ``relaygr serve`` over HTTP: pre-infers forwarded on rejection, rankings by difference.

:class:`RelayHTTPClient` talks to the Serve app's HTTP endpoints (``POST {url}prefill``, ``POST {url}rank``) with
the route key in the ``x-session-id`` header, as a gateway would (:mod:`relaygr_engine.serving.route_key`); the
Serve proxy's request router places each request (affinity, bounded load, a ticket's replica). It is thread-safe:
each thread keeps its own keep-alive connection.

* **Pre-infer**: sent with route key ``u;prefill``; a ``rejected`` reply is sent again with that replica skipped,
  until one takes it, no replica is left, or ``forward_deadline_s`` passes (P/D-Serve's forwarding).
* **Ranking**: with an admitted ticket, sent to the ticket's replica (``u;at=R``) *by difference*: the ticket's
  prefix as ``{"num_tokens", "digest"}`` (:func:`~relaygr_engine.serving.wire.history_digest` of this history's
  first tokens) and only the behaviors after it. A replica that no longer holds that prefix, or holds another one,
  answers 409 before anything changes, and the ranking is sent again with the whole history (counted as
  ``rank_full_resends``): the scores are exact either way.
* **Encoding**: ``b64le`` (default) sends id lists as base64 little-endian int64 and receives scores as base64
  float32; ``json`` uses JSON lists (:mod:`~relaygr_engine.serving.wire`).

Every reply carries the replica's ``Server-Timing`` stages (:mod:`~relaygr_engine.serving.http_ingress`) and the
client's own round-trip time, so a caller can tell the time in the replica from the time outside it.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from ..models import Behaviors
from ..policy import _checks
from . import wire
from .http_ingress import BODY_HEADER, BODY_HEADER_MAX_BYTES
from .route_key import SESSION_HEADER, RouteKey, parse_user_id

__all__ = ["RelayHTTPClient", "HTTPPrefillReply", "HTTPRankReply", "HTTPError"]


class HTTPError(RuntimeError):
    """A reply with a status other than 200 (and, for a ranking by difference, 409), or no reply at all."""

    def __init__(self, status: Optional[int], message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status is not None else message)
        self.status = status


@dataclass(frozen=True)
class HTTPPrefillReply:
    """Outcome of :meth:`RelayHTTPClient.prefill`: ``admitted`` with its JSON ``ticket`` (present it to
    :meth:`RelayHTTPClient.rank`), the last replica's ``reason``, ``attempts`` and the replicas that ``rejected``
    it; ``timing`` holds ``client_ms`` and the replica's stages (ms) of the last attempt."""

    user_id: int
    admitted: bool
    reason: Optional[str]
    replica: Optional[str]
    ticket: Optional[dict]
    attempts: int = 0
    rejected: tuple = ()
    timing: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class HTTPRankReply:
    """Outcome of :meth:`RelayHTTPClient.rank`: float32 ``scores [C, num_tasks]``, where the prefix came from
    (``source``), the ``replica``; ``by_difference`` (sent by difference and served so), ``resent_full`` (the
    replica asked for the whole history: 409); ``timing``: ``client_ms`` and the replica's stages (ms) of the
    answered send."""

    scores: torch.Tensor
    source: str
    cached_tokens: int
    computed_tokens: int
    replica: str
    ticket_used: bool
    by_difference: bool = False
    resent_full: bool = False
    timing: dict = field(default_factory=dict)


class RelayHTTPClient:
    """Pre-infer and rank through ``relaygr serve``'s HTTP endpoints (see the module doc).

    Parameters
    ----------
    url : str
        The app's base URL, e.g. ``http://127.0.0.1:8000/``.
    encoding : Encoding or str
        How id lists and scores travel (``b64le`` or ``json``).
    by_difference : bool
        Send rankings that present a ticket by difference (default True).
    inline_max_bytes : int
        Requests whose JSON is at most this long (0 to
        :data:`~relaygr_engine.serving.http_ingress.BODY_HEADER_MAX_BYTES`) travel in the ``x-relaygr-body``
        header, which the replica receives with the request instead of fetching the body from the proxy (default
        8192; 0: always a body).
    forward_deadline_s : float
        Time budget (> 0) of a pre-infer's forwarding.
    timeout_s : float
        Socket timeout (> 0) of one request.
    clock : callable
        Seconds clock of the deadline (``time.monotonic``).
    """

    def __init__(self, url: str, *, encoding=wire.Encoding.B64LE, by_difference: bool = True,
                 inline_max_bytes: int = 8192, forward_deadline_s: float = 1.0, timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must be an http:// URL of relaygr serve, got {url!r}")
        self.url = url
        self._host, self._port = parts.hostname, parts.port or 80
        self._prefix = (parts.path or "/").rstrip("/") + "/"
        self.encoding = wire.Encoding(encoding)
        self.by_difference = bool(by_difference)
        self.inline_max_bytes = _checks.count("inline_max_bytes", inline_max_bytes, 0, BODY_HEADER_MAX_BYTES + 1)
        self._deadline_s = _checks.number("forward_deadline_s", forward_deadline_s, low=0.0, low_open=True)
        self._timeout_s = _checks.number("timeout_s", timeout_s, low=0.0, low_open=True)
        self._clock = clock
        self._local = threading.local()
        self._lock = threading.Lock()
        self._c = {"prefills": 0, "prefill_admitted": 0, "prefill_forwarded": 0, "prefill_rejections": 0,
                   "prefill_not_landed": 0, "ranks": 0, "rank_by_difference": 0, "rank_full_resends": 0,
                   "rank_ticket_hits": 0, "reconnects": 0}

    # ------------------------------------------------------------------------------------------ plumbing
    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._c[k] += v

    def _conn(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        return conn

    def post(self, endpoint: str, body: Mapping, key: RouteKey) -> tuple[int, dict, dict]:
        """``POST {url}{endpoint}`` with the route key; ``(status, JSON reply, timing ms)``. A body of at most
        ``inline_max_bytes`` travels in the ``x-relaygr-body`` header. A dropped keep-alive connection is reopened
        once."""
        raw = json.dumps(body, separators=(",", ":")).encode()
        headers = {"content-type": "application/json", SESSION_HEADER: key.encode()}
        if len(raw) <= self.inline_max_bytes:
            headers[BODY_HEADER], raw = raw.decode("ascii"), b""
        for attempt in (0, 1):
            t0 = time.perf_counter()
            try:
                conn = self._conn(fresh=attempt > 0)
                conn.request("POST", self._prefix + endpoint, raw, headers)
                resp = conn.getresponse()
                data = resp.read()
            except (http.client.HTTPException, ConnectionError) as e:
                if attempt:
                    raise HTTPError(None, f"no reply from {self.url}{endpoint}: {e!r}") from e
                self._count(reconnects=1)
                continue
            timing = _server_timing(resp.getheader("server-timing"))
            timing["client_ms"] = (time.perf_counter() - t0) * 1e3
            try:
                reply = json.loads(data)
            except ValueError:
                raise HTTPError(resp.status, f"reply is not JSON: {data[:200]!r}") from None
            return resp.status, reply, timing
        raise AssertionError("unreachable")

    def _ok(self, status: int, reply: dict) -> dict:
        if status == 200:
            return reply
        if status in (400, 404, 413):
            raise ValueError(reply.get("error", f"HTTP {status}"))
        raise HTTPError(status, reply.get("error", str(reply)[:200]))

    # ------------------------------------------------------------------------------------------ API
    def prefill(self, user_id, history: Behaviors, *, deadline_s: Optional[float] = None) -> HTTPPrefillReply:
        """Pre-infer ``history`` for the user, forwarded past replicas that reject it (ValueError on bad input)."""
        u = parse_user_id(user_id)
        body = {"user_id": u, **wire.behaviors_to_json(history, self.encoding)}
        end = self._clock() + (self._deadline_s if deadline_s is None else deadline_s)
        skip: list = []
        reply, timing, attempts, landed = None, {}, 0, None
        while self._clock() < end:
            status, reply, timing = self.post("prefill", body, RouteKey(u, prefill=True, skip=tuple(skip)))
            reply = self._ok(status, reply)
            attempts += 1
            if not reply["rejected"]:
                landed = reply["replica"]
                break
            if reply["replica"] in skip:  # the router had no replica left to offer it to
                break
            skip.append(reply["replica"])
        admitted = landed is not None and bool(reply["admitted"])
        self._count(prefills=1, prefill_admitted=int(admitted), prefill_forwarded=int(bool(skip)),
                    prefill_rejections=len(skip), prefill_not_landed=int(landed is None))
        return HTTPPrefillReply(u, admitted, None if reply is None else reply["reason"], landed,
                                reply["ticket"] if admitted else None, attempts, tuple(skip), timing)

    def rank(self, user_id, history: Behaviors, candidates: torch.Tensor, ticket=None,
             request_time: Optional[int] = None, full_inference: bool = False) -> HTTPRankReply:
        """Score ``candidates`` (exact whatever the replica holds); with an admitted ``ticket`` (an
        :class:`HTTPPrefillReply` or its JSON ticket) on its replica, by difference unless disabled; with
        ``full_inference`` by full inference, the cache untouched (no ticket)."""
        u = parse_user_id(user_id)
        if isinstance(ticket, HTTPPrefillReply):
            ticket = ticket.ticket
        if ticket is not None and not isinstance(ticket, Mapping):
            raise ValueError(f"ticket must be an HTTPPrefillReply, a JSON ticket dict or None, got "
                             f"{type(ticket).__name__}")
        ticket = ticket if ticket is not None and ticket.get("admitted") else None
        if full_inference and ticket is not None:
            raise ValueError("full_inference ranks without the cache: give no ticket")
        common = {"user_id": u, "candidates": wire.ids_to_json(candidates, self.encoding),
                  "encoding": self.encoding.value}
        if request_time is not None:
            common["request_time"] = _checks.count("request_time", request_time)
        if full_inference:
            common["full_inference"] = True
        key = RouteKey(u, at=None if ticket is None else ticket.get("replica"))
        whole = dict(common, **wire.behaviors_to_json(history, self.encoding))
        if ticket is not None:
            whole["ticket"] = dict(ticket)
        delta = self._difference(history, ticket, common) if self.by_difference else None
        resent = False
        if delta is not None:
            status, reply, timing = self.post("rank", delta, key)
            if status == 409 and reply.get("need_full_history"):
                resent = True
            else:
                reply = self._ok(status, reply)
        if delta is None or resent:
            status, reply, timing = self.post("rank", whole, key)
            reply = self._ok(status, reply)
        hit = ticket is not None and reply["replica"] == ticket.get("replica")
        self._count(ranks=1, rank_by_difference=int(delta is not None and not resent),
                    rank_full_resends=int(resent), rank_ticket_hits=int(hit))
        return HTTPRankReply(wire.scores_from_json(reply), reply["source"], int(reply["cached_tokens"]),
                             int(reply["computed_tokens"]), reply["replica"], bool(reply["ticket_used"]),
                             delta is not None and not resent, resent, timing)

    def _difference(self, history: Behaviors, ticket: Optional[Mapping], common: dict) -> Optional[dict]:
        """The body of a ranking by difference, or None when it cannot be one (no ticket, a history not longer
        than the ticket's prefix)."""
        if ticket is None:
            return None
        n = int(ticket.get("num_tokens", 0))
        behaviors = n - history.num_context_tokens   # behaviors in the prefix
        if n < 1 or behaviors < 0 or behaviors >= len(history):
            return None
        tail = Behaviors(*(None if x is None else x[behaviors:]
                           for x in (history.item_ids, history.action_ids, history.timestamps)))
        fields = wire.behaviors_to_json(tail, self.encoding)
        return dict(common, **fields, ticket=dict(ticket),
                    prefix={"num_tokens": n, "digest": wire.history_digest(history, n)})

    def stats(self) -> dict:
        """Counters: ``prefills``, ``prefill_admitted``, ``prefill_forwarded``, ``prefill_rejections``,
        ``prefill_not_landed``, ``ranks``, ``rank_by_difference``, ``rank_full_resends`` (409: sent again whole),
        ``rank_ticket_hits``, ``reconnects``."""
        with self._lock:
            return dict(self._c)

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def _server_timing(header: Optional[str]) -> dict:
    """``{stage: ms}`` of a ``Server-Timing`` header (``name;dur=1.2, ...``); entries without a duration skipped."""
    out = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        if rest.startswith("dur="):
            try:
                out[name] = float(rest[4:])
            except ValueError:
                continue
    return out
