"""The HTTP endpoints of a relay replica: ``POST .../prefill``, ``POST .../rank``, ``GET .../stats``.

:func:`handle` is :meth:`RelayReplica.__call__ <relaygr_engine.serving.ray_serve.RelayReplica.__call__>`. A body is
read within the replica's :class:`~relaygr_engine.serving.wire.RequestLimits` (a declared or streamed size past
``max_body_bytes`` stops the read: 413) and parsed once, here; a small request may come in the
:data:`BODY_HEADER` header instead, held to the same limits. Errors are JSON ``{"error": ...}``: 413 (body past
``max_body_bytes``), 409 with ``"need_full_history": true`` (a ranking by difference whose prefix the replica does
not hold: nothing changed, send the whole history), 400 (other bad input, limits included) or 404 (unknown path).

Every reply to ``prefill`` and ``rank`` carries a ``Server-Timing`` header (W3C Server Timing) with the
milliseconds the replica spent on it: ``read`` (the body; under Ray Serve the replica fetches it from the proxy),
``parse`` (JSON and tensors), ``queue`` (waiting for the engine), ``engine``, ``reply`` (encoding the reply) and
``total``; a client subtracts ``total`` from what it measured to get the time outside the replica (proxy, router,
network, its own encoding).
"""
from __future__ import annotations

import time
from typing import Any

from . import wire

__all__ = ["BODY_HEADER", "BODY_HEADER_MAX_BYTES", "handle", "read_json", "server_timing"]


BODY_HEADER = "x-relaygr-body"
"""A request may carry its JSON body in this header instead (at most :data:`BODY_HEADER_MAX_BYTES`, the body then
empty): under Ray Serve a header reaches the replica with the request, while a body is fetched from the proxy by a
second call (about 2 ms on a shared 2-core machine)."""

BODY_HEADER_MAX_BYTES = 16384


async def read_json(replica, request) -> Any:
    """The request's JSON body (or :data:`BODY_HEADER`), within ``replica.limits``: a declared or streamed size
    past ``max_body_bytes`` stops the read (:class:`~relaygr_engine.serving.wire.RequestTooLarge`)."""
    limits = replica.limits
    inline = request.headers.get(BODY_HEADER)
    if inline is not None:
        return _inline_json(inline, request, limits)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ValueError(f"Content-Length must be a byte count, got {declared!r}")
        limits.check_body_size(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        limits.check_body_size(size)
        chunks.append(chunk)
    return wire.parse_body(b"".join(chunks), limits)


def _inline_json(text: str, request, limits: wire.RequestLimits) -> Any:
    """The JSON of :data:`BODY_HEADER` (its size checked like a body's, and against its own bound); a request
    with both the header and a body is refused."""
    raw = text.encode("latin-1")
    limits.check_body_size(len(raw))
    if len(raw) > BODY_HEADER_MAX_BYTES:
        raise wire.RequestTooLarge(f"{BODY_HEADER} must be at most {BODY_HEADER_MAX_BYTES} bytes, got {len(raw)}: "
                                   "send a larger request as the body")
    declared = (request.headers.get("content-length") or "0").strip()
    if declared != "0" or request.headers.get("transfer-encoding"):
        raise ValueError(f"a request with {BODY_HEADER} must have an empty body, got Content-Length "
                         f"{declared!r}")
    return wire.parse_body(raw, limits)


def server_timing(stages: dict) -> str:
    """A ``Server-Timing`` header value from ``{stage: seconds}`` (durations in ms)."""
    return ", ".join(f"{name};dur={seconds * 1e3:.3f}" for name, seconds in stages.items())


async def handle(replica, request):
    """Answer one HTTP request to ``replica`` (a :class:`~relaygr_engine.serving.ray_serve.RelayReplica`)."""
    from starlette.responses import JSONResponse

    endpoint = request.url.path.rstrip("/").rsplit("/", 1)[-1]
    try:
        if endpoint == "stats" and request.method == "GET":
            return JSONResponse(await replica.stats())
        if endpoint in ("prefill", "rank") and request.method == "POST":
            t0 = time.perf_counter()
            body = await read_json(replica, request)
            timing = {"read": time.perf_counter() - t0}
            call = replica.prefill if endpoint == "prefill" else replica.rank
            out = await call(body, timing=timing)
            t1 = time.perf_counter()
            response = JSONResponse(out)
            timing.update(reply=time.perf_counter() - t1, total=time.perf_counter() - t0)
            response.headers["server-timing"] = server_timing(timing)
            return response
    except wire.NeedFullHistory as e:
        return JSONResponse({"error": str(e), "need_full_history": True, "reason": e.reason,
                             "replica": replica.replica_id}, status_code=409)
    except ValueError as e:
        status = 413 if isinstance(e, wire.RequestTooLarge) else 400
        return JSONResponse({"error": str(e), "replica": replica.replica_id}, status_code=status)
    return JSONResponse({"error": f"unknown endpoint {request.method} {request.url.path}; valid: POST /prefill, "
                                  "POST /rank, GET /stats"}, status_code=404)
