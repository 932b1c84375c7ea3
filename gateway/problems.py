"""The one place errors become HTTP answers: RFC 9457 problem+json with a stable ``code``.

The middleware turns every ``FencegateError`` into its problem, aiohttp's own HTTP errors
(unknown route, wrong method, body too large) into the matching problem, and anything else into
a logged 500 without a stack trace on the wire.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from fencegate.ledger.errors import FencegateError, PayloadTooLarge

__all__ = ["PROBLEM_TYPE_BASE", "error_middleware", "problem_body", "problem_response"]

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


def problem_response(error: FencegateError, headers: dict[str, str] | None = None) -> web.Response:
    body = problem_body(error.status, error.code, error.title, error.detail, **error.extra)
    return web.Response(
        status=error.status,
        body=json.dumps(body).encode(),
        content_type="application/problem+json",
        headers=headers,
    )


def _from_http(exc: web.HTTPException) -> web.Response:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return problem_response(PayloadTooLarge(f"body over the limit: {exc.text}"))
    if exc.status == 404:
        code, title = "NOT_FOUND", "No such resource"
    elif exc.status == 405:
        code, title = "METHOD_NOT_ALLOWED", "Method not allowed"
    else:
        code, title = "BAD_REQUEST" if exc.status < 500 else "INTERNAL", exc.reason
    body = problem_body(exc.status, code, title, exc.reason)
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
        return problem_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _from_http(exc)
    except Exception:
        log.exception("http.internal_error", method=request.method, path=request.path)
        body = problem_body(500, "INTERNAL", "Internal error", "see the gateway's log")
        return web.Response(
            status=500, body=json.dumps(body).encode(), content_type="application/problem+json"
        )
