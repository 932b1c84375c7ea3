"""The one place errors become HTTP answers: RFC 9457 problem+json with a stable ``code``.

The middleware turns every ``FencegateError`` into its problem, aiohttp's own HTTP errors
(unknown route, wrong method, body too large) into the matching problem, and anything else into
a logged 500 without a stack trace on the wire.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from fencegate.ledger.clock import iso_utc
from fencegate.ledger.errors import FencegateError, PayloadTooLarge

__all__ = [
    "PROBLEM_TYPE_BASE",
    "ROUTING_PROBLEMS",
    "TIME_MEMBERS",
    "error_middleware",
    "http_detail",
    "problem_body",
    "problem_response",
    "readable_detail",
    "requested",
    "retry_after",
]

log = structlog.get_logger("fencegate.http")

PROBLEM_TYPE_BASE = "urn:fencegate:problem:"


def problem_body(status: int, code: str, title: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": PROBLEM_TYPE_BASE + code.lower().replace("_", "-"),
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
        **extra,
    }


#: Problem members that hold a store time (ms since the Unix epoch). A detail names such a
#: time as ``<member> <ms>``; the answer shows it as ``<ISO 8601> (<member> <ms>)``. The
#: stores (Python and Lua alike) write only the number, so their texts cannot drift.
TIME_MEMBERS = (
    "leaseExpiresAt",
    "runtimeEndsAt",
    "probeUntil",
    "resolvedAt",
    "expiredAt",
)


def readable_detail(detail: str, extra: Mapping[str, Any]) -> str:
    """``detail`` with every store time it names (``TIME_MEMBERS``) also in ISO 8601 UTC:
    ``held until leaseExpiresAt 1796041642452`` becomes ``held until
    2026-11-30T12:27:22.452Z (leaseExpiresAt 1796041642452)``."""
    for name in TIME_MEMBERS:
        value = extra.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            named = f"{name} {value}"
            detail = detail.replace(named, f"{iso_utc(value)} ({named})")
    return detail


def retry_after(retry_after_ms: int) -> str:
    """``Retry-After`` for a wait of ``retry_after_ms``: whole seconds, rounded up, at least
    1 (``0`` would invite a client to hammer)."""
    return str(max(1, -(-retry_after_ms // 1000)))


def problem_response(error: FencegateError, headers: dict[str, str] | None = None) -> web.Response:
    """The problem for ``error``. A ``retryAfterMs`` member sets ``Retry-After`` unless the
    caller set it (the proxy bounds its own)."""
    detail = readable_detail(error.detail, error.extra)
    body = problem_body(error.status, error.code, error.title, detail, **error.extra)
    retry_ms = error.extra.get("retryAfterMs")
    if isinstance(retry_ms, int) and not (headers and "Retry-After" in headers):
        headers = {**(headers or {}), "Retry-After": retry_after(retry_ms)}
    return web.Response(
        status=error.status,
        body=json.dumps(body).encode(),
        content_type="application/problem+json",
        headers=headers,
    )


#: The codes the gateway answers that are no ``FencegateError``: aiohttp's routing refusals
#: (status -> code, title). With ``ledger.errors.ERRORS_BY_CODE`` the whole wire table, which
#: the SDK's own copy is held to (tests/test_sdk_errors.py).
ROUTING_PROBLEMS: dict[int, tuple[str, str]] = {
    404: ("NOT_FOUND", "No such resource"),
    405: ("METHOD_NOT_ALLOWED", "Method not allowed"),
}


def requested(request: web.BaseRequest) -> str:
    """The agent's request as a detail names it: its method and path, never the query string
    (an agent's query may hold its own secrets)."""
    return f"{request.method} {request.rel_url.raw_path}"


def http_detail(request: web.BaseRequest, exc: web.HTTPException) -> str:
    """The detail of one of aiohttp's own refusals, naming the request it refuses."""
    if exc.status == 404:
        return f"{requested(request)}: no such route"
    if exc.status == 405:
        allowed = exc.headers.get("Allow")
        return f"{requested(request)}: method not allowed" + (
            f" (Allow: {allowed})" if allowed else ""
        )
    return f"{requested(request)}: {exc.reason}"


def _from_http(request: web.Request, exc: web.HTTPException) -> web.Response:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return problem_response(
            PayloadTooLarge(f"{requested(request)}: body over server.max_body_bytes: {exc.text}")
        )
    if exc.status in ROUTING_PROBLEMS:
        code, title = ROUTING_PROBLEMS[exc.status]
    else:
        code, title = "BAD_REQUEST" if exc.status < 500 else "INTERNAL", exc.reason
    body = problem_body(exc.status, code, title, http_detail(request, exc))
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return web.Response(
        status=exc.status,
        body=json.dumps(body).encode(),
        content_type="application/problem+json",
        headers=headers,
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except FencegateError as exc:
        if exc.about_request:
            exc.about(requested(request))
        return problem_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http(request, exc)
    except Exception:
        log.exception("http.internal_error", method=request.method, path=request.path)
        detail = f"{requested(request)} failed: see the gateway's log"
        body = problem_body(500, "INTERNAL", "Internal error", detail)
        return web.Response(
            status=500, body=json.dumps(body).encode(), content_type="application/problem+json"
        )
