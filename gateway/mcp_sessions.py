"""MCP session ids bound to the principal that opened the session (with ``[auth]``).

An MCP server's ``Mcp-Session-Id`` is a bearer secret of the session: whoever presents it
acts in the session (calls tools in it, reads its stream, ends it). Behind the gateway every
agent is authenticated, so the gateway binds each session to its principal without keeping
any state: the agent gets ``<mac>.<server's id>``, where ``mac`` is an HMAC-SHA256 of the
principal, the downstream and the server's id under a key from ``FENCEGATE_SESSION_SECRET``.
Any gateway with the same key checks it (``unwrap``) and sends the server its own id; a
session id presented by another principal (or forged, or made under another key) is answered
404, which is what an MCP server answers for a session it does not know (the client then
opens a new one), and logged ``auth.session_mismatch``.

Without ``[auth]`` there is no principal to bind to: ids are relayed unchanged.

The key: ``FENCEGATE_SESSION_SECRET`` (32 characters or more, hashed to the HMAC key); unset,
each process draws a random one at start (``serve --workers`` workers share their
supervisor's, ``gateway/workers.py``), so sessions then neither survive a restart nor span
gateways (``serve --check`` warns).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any, Final

import structlog
from aiohttp import web

from fencegate.gateway import env_secrets
from fencegate.gateway.principals import principal_of

__all__ = [
    "SECRET_ENV",
    "SESSION_IDS",
    "SessionIds",
    "check_session",
    "secret_problem",
    "session_key",
    "to_server",
    "wrap_answer",
]

log = structlog.get_logger("fencegate.auth")

#: The environment variable that holds the session-binding key (any string, 32+ characters).
SECRET_ENV: Final = "FENCEGATE_SESSION_SECRET"
#: The shortest secret taken: anyone holding a session id of their own can try keys offline.
MIN_SECRET: Final = env_secrets.MIN_SECRET
_HEADER: Final = "Mcp-Session-Id"
_MCP_ROUTE: Final = "/mcp/{downstream}"
#: base64url of a SHA-256 digest, unpadded.
_MAC_CHARS: Final = 43
_REQUEST_KEY: Any = getattr(web, "RequestKey", None)
#: Where ``check_session`` leaves the server's own id of a verified session.
_SERVER_ID: Any = (
    _REQUEST_KEY("fencegate.mcp_server_session", str) if _REQUEST_KEY else "fencegate.mcp_session"
)


_PURPOSE = "it binds MCP sessions to their principal"


def secret_problem(environ: Mapping[str, str]) -> str | None:
    """Why ``FENCEGATE_SESSION_SECRET`` cannot be used, or None (unset is fine: random)."""
    return env_secrets.secret_problem(SECRET_ENV, _PURPOSE, environ)


def session_key(environ: Mapping[str, str] | None = None) -> tuple[bytes, bool]:
    """The HMAC key and whether it came from the environment (False: random, this process
    only). ValueError for a secret too short."""
    return env_secrets.env_key(SECRET_ENV, _PURPOSE, b"fencegate mcp session\0", environ)


class SessionIds:
    """Wraps a server's session id for one principal and checks it back. Pure: the key in,
    strings out."""

    def __init__(self, key: bytes, shared: bool = True) -> None:
        self._key = key
        #: False: the key is this process's own (no ``FENCEGATE_SESSION_SECRET``).
        self.shared = shared

    def _mac(self, principal: str, downstream: str, server_id: str) -> str:
        # JSON: an unambiguous encoding of the three strings, whatever they contain.
        message = json.dumps([principal, downstream, server_id]).encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def wrap(self, principal: str, downstream: str, server_id: str) -> str:
        """The id the agent gets for the server's ``server_id``: ``<mac>.<server_id>``."""
        return f"{self._mac(principal, downstream, server_id)}.{server_id}"

    def unwrap(self, principal: str, downstream: str, presented: str) -> str | None:
        """The server's id in ``presented`` when ``principal`` was given it for
        ``downstream`` under this key; None otherwise (compared in constant time)."""
        mac, dot, server_id = presented.partition(".")
        if not dot or not server_id or len(mac) != _MAC_CHARS:
            return None
        expected = self._mac(principal, downstream, server_id)
        given = mac.encode("utf-8", "surrogateescape")
        return server_id if hmac.compare_digest(given, expected.encode()) else None


#: The app's ``SessionIds`` (``create_app``).
SESSION_IDS = web.AppKey("mcp_session_ids", SessionIds)

#: What an MCP server answers for a session it does not know (MCP: "404 Not Found"; the
#: client starts a new session). The same for a session that is someone else's.
_NOT_FOUND = {
    "jsonrpc": "2.0",
    "id": None,
    "error": {"code": -32600, "message": "Session not found"},
}


def check_session(request: web.Request) -> web.Response | None:
    """With ``[auth]``: check the request's ``Mcp-Session-Id`` against its principal and keep
    the server's own id for ``to_server``; a 404 answer when it is not this principal's (or
    not one this gateway's key made). None: go on (no ``[auth]``, no session id, or it is
    the principal's own)."""
    principal = principal_of(request)
    presented = request.headers.getall(_HEADER, [])
    if principal is None or not presented:
        return None
    downstream = request.match_info.get("downstream", "")
    server_id = (
        request.app[SESSION_IDS].unwrap(principal.name, downstream, presented[0])
        if len(presented) == 1
        else None
    )
    if server_id is not None:
        request[_SERVER_ID] = server_id
        return None
    # Never the presented id, nor the key: the id is the session's bearer secret.
    log.info(
        "auth.session_mismatch",
        principal=principal.name,
        downstream=downstream,
        method=request.method,
        reason="several Mcp-Session-Id headers"
        if len(presented) > 1
        else "not a session id this principal was given",
    )
    return web.Response(
        status=404,
        body=json.dumps(_NOT_FOUND, separators=(",", ":")).encode(),
        content_type="application/json",
    )


def to_server(request: web.Request, presented: str) -> str:
    """The ``Mcp-Session-Id`` to send the server for the agent's ``presented`` one: the
    server's own id once ``check_session`` verified it; unchanged without ``[auth]``."""
    server_id: str | None = request.get(_SERVER_ID)
    return server_id if server_id is not None else presented


async def wrap_answer(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: an MCP server's ``Mcp-Session-Id`` answer header (on
    ``initialize``) reaches the agent wrapped for its principal (``SessionIds.wrap``), on
    every path an answer of ``/mcp`` takes. The gateway's own answers carry none."""
    principal = principal_of(request)
    if principal is None or _HEADER not in response.headers:
        return
    route = request.match_info.route.resource
    if route is None or route.canonical != _MCP_ROUTE:
        return
    downstream = request.match_info.get("downstream", "")
    ids = request.app[SESSION_IDS]
    values = response.headers.getall(_HEADER)
    response.headers.popall(_HEADER)
    for value in values:
        response.headers.add(_HEADER, ids.wrap(principal.name, downstream, value))
