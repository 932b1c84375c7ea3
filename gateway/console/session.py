"""Console sessions: a pasted bearer token becomes a signed, expiring cookie.

The cookie carries the principal's name, roles, the SHA-256 of its token (what the config
already holds, never the token), an expiry and a per-session CSRF token, signed with
HMAC-SHA256. Signed, not encrypted: nothing in it is a secret the config does not show.
Every request re-checks it against the principals in force (``Authenticator.by_digest``):
a revoked token, a renamed principal or changed roles end the session at once, however long
the cookie has left. A session logged in with an OAuth token (``[auth.oauth]``) carries no
digest but its profile (name and digest of its configuration): it ends at the token's
``exp`` (plus leeway) at the latest, and at once when a reload changes that profile.

The key comes from ``FENCEGATE_CONSOLE_SECRET`` (never the config file); unset, a random key
per process, so sessions do not survive a restart nor span ``serve --workers`` processes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from aiohttp import web

from fencegate.gateway import env_secrets
from fencegate.gateway.auth import Authenticator
from fencegate.gateway.principals import Principal
from fencegate.ledger.errors import FencegateError, Unauthenticated

__all__ = [
    "COOKIE",
    "SECRET_ENV",
    "SESSION_KEY",
    "ConsoleSessions",
    "Session",
    "SessionCodec",
    "console_key",
    "login_redirect",
    "secret_problem",
]

#: The environment variable that holds the cookie-signing key (any string, 32+ bytes).
SECRET_ENV: Final = "FENCEGATE_CONSOLE_SECRET"
COOKIE: Final = "fencegate_console"
PREFIX: Final = "/console"
_MAX_COOKIE = 4096
_NAME = re.compile(r"[A-Za-z0-9._:@/ -]{1,200}")
#: An OAuth principal's name: ``oauth:<iss>#<sub>`` (gateway/oauth.py bounds both parts).
_OAUTH_NAME = re.compile(r"oauth:[\x21-\x7e]{1,800}")
_PROFILE = re.compile(r"[A-Za-z0-9_.-]{1,64}:[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_REQUEST_KEY: Any = getattr(web, "RequestKey", None)
#: Where a checked session is left on the request (a ``web.RequestKey`` where aiohttp has it).
SESSION_KEY: Any = (
    _REQUEST_KEY("fencegate.console_session", object)
    if _REQUEST_KEY
    else "fencegate.console_session"
)


MIN_SECRET = env_secrets.MIN_SECRET
_PURPOSE = "it signs console sessions"


def secret_problem(environ: Mapping[str, str]) -> str | None:
    """Why ``FENCEGATE_CONSOLE_SECRET`` cannot be used, or None (unset is fine: random)."""
    return env_secrets.secret_problem(SECRET_ENV, _PURPOSE, environ)


def console_key(environ: Mapping[str, str] | None = None) -> tuple[bytes, bool]:
    """The signing key and whether it came from the environment (False: random, this
    process only). ValueError for a secret too short to sign with."""
    return env_secrets.env_key(SECRET_ENV, _PURPOSE, environ=environ)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Session:
    #: Who acts: the principal's name (without ``[auth]``, the label typed at login).
    name: str
    #: SHA-256 (hex) of the token logged in with; None without ``[auth]``.
    token_sha256: str | None
    roles: tuple[str, ...]
    #: Wall-clock ms after which the cookie is refused.
    expires_at: int
    #: Compared with every form's hidden ``csrf`` field.
    csrf: str
    #: An OAuth login's ``<profile>:<digest>`` (``oauth.profile_digest``); None otherwise.
    profile: str | None = None


class SessionCodec:
    """Signs and checks session cookies with one key."""

    def __init__(self, key: bytes, ttl_ms: int, clock: Callable[[], float] = time.time) -> None:
        self._key = key
        self.ttl_ms = ttl_ms
        self._clock = clock

    def now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())

    def issue(
        self,
        name: str,
        token_sha256: str | None,
        roles: tuple[str, ...],
        *,
        profile: str | None = None,
        until_ms: int | None = None,
    ) -> tuple[str, Session]:
        """A session cookie; ``until_ms``: it ends then if that comes before the console's
        own ``ttl_ms`` (an OAuth token's expiry)."""
        expires_at = self.now_ms() + self.ttl_ms
        if until_ms is not None:
            expires_at = min(expires_at, until_ms)
        session = Session(
            name, token_sha256, tuple(sorted(roles)), expires_at, secrets.token_urlsafe(24),
            profile,
        )  # fmt: skip
        body = {"n": session.name, "d": session.token_sha256, "r": list(session.roles),
                "e": session.expires_at, "c": session.csrf}  # fmt: skip
        if profile is not None:
            body["o"] = profile
        payload = _b64(json.dumps(body, separators=(",", ":")).encode())
        return f"{payload}.{self._mac(payload)}", session

    def read(self, value: str | None) -> Session | None:
        """The session in ``value``, or None: missing, malformed, not signed with this key,
        or expired."""
        if not value or len(value) > _MAX_COOKIE or value.count(".") != 1:
            return None
        payload, mac = value.split(".")
        if not hmac.compare_digest(mac.encode(), self._mac(payload).encode()):
            return None
        try:
            body = json.loads(_unb64(payload))
        except (ValueError, binascii.Error):
            return None
        if not isinstance(body, dict):
            return None
        name, digest, roles = body.get("n"), body.get("d"), body.get("r")
        expires_at, csrf, profile = body.get("e"), body.get("c"), body.get("o")
        if not (
            isinstance(name, str)
            and (
                _NAME.fullmatch(name) or (isinstance(profile, str) and _OAUTH_NAME.fullmatch(name))
            )
            and (profile is None or (isinstance(profile, str) and _PROFILE.fullmatch(profile)))
            and (digest is None or (isinstance(digest, str) and _HEX64.fullmatch(digest)))
            and isinstance(roles, list)
            and all(isinstance(r, str) for r in roles)
            and isinstance(expires_at, int)
            and isinstance(csrf, str)
            and csrf
        ):
            return None
        if expires_at <= self.now_ms():
            return None
        return Session(name, digest, tuple(roles), expires_at, csrf, profile)


class ConsoleSessions:
    """The console's ``SessionAuth`` for the ``[auth]`` middleware: the cookie is the
    credential on ``/console/*``; a refusal is the login page (GET) or an HTML error page."""

    def __init__(
        self,
        codec: SessionCodec,
        refuse: Callable[[web.Request, FencegateError], web.StreamResponse],
    ) -> None:
        self.codec = codec
        self._refuse = refuse

    def covers(self, path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    def principal(self, request: web.Request, authenticator: Authenticator) -> Principal:
        session = self.codec.read(request.cookies.get(COOKIE))
        if session is None:
            raise Unauthenticated("no console session, or it expired: log in")
        if session.profile is not None:
            oauth = authenticator.oauth
            principal = (
                oauth.session_principal(session.name, session.profile, session.expires_at / 1000)
                if oauth is not None
                else None
            )
            if principal is None:
                raise Unauthenticated("the OAuth profile of the session changed: log in")
        elif session.token_sha256 is None:
            raise Unauthenticated("the console session was made without [auth]: log in")
        else:
            principal = authenticator.by_digest(bytes.fromhex(session.token_sha256))
        if principal is None:
            raise Unauthenticated("the session's token was revoked: log in")
        if principal.name != session.name or tuple(sorted(principal.roles)) != session.roles:
            raise Unauthenticated("the principal's name or roles changed since login: log in")
        request[SESSION_KEY] = session
        return principal

    def refusal(self, request: web.Request, error: FencegateError) -> web.StreamResponse:
        return self._refuse(request, error)


def login_redirect(request: web.Request, ended: bool = False) -> web.Response:
    """303 to the login page, coming back to this page after it. ``ended``: a session was
    sent and no longer holds (the page says so in fixed words: nothing of the request is
    echoed on the login page)."""
    target = f"{PREFIX}/login?next={quote(request.path_qs, safe='')}"
    if ended:
        target += "&ended=1"
    response = web.Response(status=303, headers={"Location": target})
    response.del_cookie(COOKIE, path=PREFIX)
    return response
