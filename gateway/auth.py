"""Authentication and authorization: who is calling (bearer tokens) and what their roles allow.

On only when the config has ``[auth]``. Every request then carries a credential, except the
routes the role matrix opens to anyone (``/healthz``, ``/readyz``):

- ``Fence-Authorization: Bearer <token>`` on every path (the proxy never forwards ``Fence-*``);
- ``Authorization: Bearer <token>`` also on the gateway's own API (``/v1/*``, ``/metrics``)
  and on ``/mcp/*`` (an MCP client sends its OAuth token there; the MCP gateway forwards no
  ``Authorization``), never on ``/proxy/*``: there ``Authorization`` is the downstream's.
  ``Fence-Authorization`` wins when both are sent.

A token is a static principal's (``[[auth.principals]]``) or, with ``[auth.oauth]``, a JWT
access token of the configured issuer (``gateway/oauth.py``): its principal is
``oauth:<iss>#<sub>`` with the roles and scope of the profile it matches. With
``[auth.oauth]`` a 401 carries ``WWW-Authenticate: Bearer resource_metadata="..."`` (the
RFC 9728 document of the route's resource, served on the open ``/.well-known`` routes), a
token whose profile grants no role on the route is 403 with ``error="insufficient_scope"``,
and a token whose signing key cannot be fetched is 503 ``AUTH_UNAVAILABLE``. On ``/proxy``
an ``Authorization`` that would authenticate to the gateway is never forwarded, whatever the
downstream's ``forward_authorization`` (``STRIP_AUTHORIZATION``).

With ``server.tls_client_ca_file`` (mTLS) a request without a bearer credential may be
identified by its client certificate, already verified by the TLS handshake: the principal
whose ``certificate_cn`` equals the certificate's subject CN (exactly one CN, compared
exactly). A bearer credential, when sent, is what counts (a bad one is 401 even with a good
certificate).

The file holds only each token's SHA-256; a presented token is hashed once and compared with
every principal's digest in constant time (``hmac.compare_digest``, no early exit).
No credential, a malformed one or one that matches no principal: 401 ``UNAUTHENTICATED``
with ``WWW-Authenticate: Bearer``. A principal none of whose roles the matrix lists for the
route: 403 ``FORBIDDEN``. A route missing from ``ROLE_MATRIX`` is 403 for everyone (deny by
default; ``tests/test_auth.py`` fails when a registered route is missing from it). Requests
that match no route go on to their 404/405 once authenticated.

On ``/console/*`` the operator console's signed session cookie stands in for the bearer
credential (``SessionAuth``, ``gateway/console/session.py``): the same matrix, scopes and
limits, re-checked against the principals in force on every request.

The principal is left on the request (``fencegate.gateway.principals.principal_of``) for the
rules that bind actions to it. docs/security.md renders the matrix.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Final, Protocol

import structlog
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from fencegate.gateway.config import ROLES, AuthConfig, OAuthConfig, PrincipalConfig
from fencegate.gateway.http_rules import split_proxy_path
from fencegate.gateway.limits import Clock, Limits, OpenRequests, TokenBucket, retry_after_seconds
from fencegate.gateway.oauth import (
    OAuthVerifier,
    metadata_document,
    metadata_path,
    profiles_granting,
    resource_of,
)
from fencegate.gateway.principals import (
    PRINCIPAL_KEY,
    REAL_TIME,
    STRIP_AUTHORIZATION,
    Principal,
    Scope,
    WallClock,
    scope_refusal,
)
from fencegate.gateway.problems import problem_response, requested
from fencegate.ledger.errors import (
    AuthUnavailable,
    BadRequest,
    FencegateError,
    Forbidden,
    RateLimited,
    Unauthenticated,
)

__all__ = [
    "ANYONE",
    "ROLE_MATRIX",
    "AuthState",
    "Authenticator",
    "SessionAuth",
    "allowed_roles",
    "auth_middleware",
    "auth_state",
    "matrix_markdown",
    "new_token",
    "principal_from_config",
    "resource_metadata",
    "role_warnings",
    "route_key",
    "sees_stored_bodies",
    "token_sha256",
]

log = structlog.get_logger("fencegate.auth")

#: Not a role: the route needs no credential at all.
ANYONE: Final = "anyone"

_SCHEDULER, _WORKER, _OPERATOR, _OBSERVER, _CLIENT = ROLES
_EVERY_ROLE = frozenset(ROLES)
#: Every role that works with tasks: ``client`` (lease-less calls by idempotency key) has
#: no task, lease or epoch to read.
_TASK_ROLES = frozenset({_SCHEDULER, _WORKER, _OPERATOR, _OBSERVER})
_READERS = frozenset({_OPERATOR, _OBSERVER})


def _only(*roles: str) -> frozenset[str]:
    return frozenset(roles)


#: THE role matrix: (method, route pattern as aiohttp names it) -> the roles that may call it.
#: ``HEAD`` is checked as ``GET``; ``*`` is a route that takes every method. A principal may
#: call a route when any of its roles is listed. Keep docs/security.md in step (a test
#: compares them).
ROLE_MATRIX: Final[Mapping[tuple[str, str], frozenset[str]]] = MappingProxyType(
    {
        # operations
        ("GET", "/healthz"): _only(ANYONE),
        ("GET", "/readyz"): _only(ANYONE),
        # RFC 9728 protected resource metadata ([auth.oauth]; 404 without): where an OAuth
        # client learns which authorization server issues tokens for the gateway and for
        # each MCP downstream (/mcp/{name} is its own resource)
        ("GET", "/.well-known/oauth-protected-resource"): _only(ANYONE),
        ("GET", "/.well-known/oauth-protected-resource/mcp/{downstream}"): _only(ANYONE),
        ("GET", "/metrics"): _READERS,
        ("GET", "/openapi.json"): _EVERY_ROLE,  # the API description; no secrets in it
        ("GET", "/v1/rollout"): _READERS,
        ("GET", "/v1/store/stats"): _READERS,
        # tasks: schedulers create, revise and cancel; workers hold leases. The list is for
        # the people and programs that watch the queue (a worker claims what it is given).
        ("GET", "/v1/tasks"): _only(_SCHEDULER, _OPERATOR, _OBSERVER),
        ("PUT", "/v1/tasks/{task_id}"): _only(_SCHEDULER),
        ("POST", "/v1/tasks/{task_id}/cancel"): _only(_SCHEDULER),
        # The record shows attemptId and owner: worth nothing without the holder's credential
        # once leases are bound to principals (issue 11, item 2), so every role may read it.
        ("GET", "/v1/tasks/{task_id}"): _TASK_ROLES,
        ("POST", "/v1/tasks/{task_id}/claim"): _only(_WORKER),
        ("POST", "/v1/tasks/{task_id}/renew"): _only(_WORKER),
        ("POST", "/v1/tasks/{task_id}/release"): _only(_WORKER),
        ("POST", "/v1/tasks/{task_id}/commit"): _only(_WORKER),
        # a queue hands out tasks whose ids the worker does not know yet: workers only, and
        # never a principal limited to task_prefixes (the handler refuses it, 403)
        ("POST", "/v1/queues/{queue}/claim"): _only(_WORKER),
        # every task's and effect's changes, as they happen: for the same readers as the
        # task list (a worker waits on one task with GET /v1/tasks/{id}?waitFor=, which shows
        # it nothing that reading the task would not); task_prefixes filter the stream
        ("GET", "/v1/events"): _only(_SCHEDULER, _OPERATOR, _OBSERVER),
        # the scheduler epoch: everyone reads it (workers claim under it); operators move it
        ("GET", "/v1/epoch"): _TASK_ROLES,
        ("POST", "/v1/epoch/bump"): _only(_OPERATOR),
        ("POST", "/v1/claims/pause"): _only(_OPERATOR),
        ("POST", "/v1/claims/resume"): _only(_OPERATOR),
        # the ledger: observers read records without stored bodies (sees_stored_bodies). A
        # client only looks up its own keyed effect (?idempotencyKey=K: the handler refuses
        # any other query of a client, and another principal's key); it reads no record by id
        ("GET", "/v1/effects"): _READERS | {_CLIENT},
        ("GET", "/v1/effects/{effect_id}"): _READERS,
        ("POST", "/v1/effects/{effect_id}/resolve"): _only(_OPERATOR),
        ("POST", "/v1/effects/{effect_id}/approve"): _only(_OPERATOR),
        ("POST", "/v1/effects/{effect_id}/reconcile"): _only(_OPERATOR),
        # the fenced proxy and the MCP gateway: workers under a lease, clients by their
        # idempotency key without one (the handlers refuse each the other's form, 403)
        ("*", "/proxy/{tail}"): _only(_WORKER, _CLIENT),
        ("GET", "/mcp/{downstream}"): _only(_WORKER, _CLIENT),
        ("POST", "/mcp/{downstream}"): _only(_WORKER, _CLIENT),
        ("DELETE", "/mcp/{downstream}"): _only(_WORKER, _CLIENT),
        # the operator console (gateway/console, docs/console.md): its session cookie is the
        # credential. Pages for the ledger's readers, actions for the roles of the JSON
        # routes they call; the login form, logout and the console's own CSS/JS are open.
        ("GET", "/console"): _READERS,
        ("GET", "/console/login"): _only(ANYONE),
        ("POST", "/console/login"): _only(ANYONE),
        ("POST", "/console/logout"): _only(ANYONE),
        ("GET", "/console/static/{name}"): _only(ANYONE),
        ("GET", "/console/effects/{effect_id}"): _READERS,
        ("POST", "/console/effects/{effect_id}/resolve"): _only(_OPERATOR),
        ("POST", "/console/effects/{effect_id}/approve"): _only(_OPERATOR),
        ("POST", "/console/effects/{effect_id}/reconcile"): _only(_OPERATOR),
        ("GET", "/console/tasks"): _READERS,
        ("GET", "/console/fleet"): _READERS,
        ("GET", "/console/fleet/series"): _READERS,
        ("POST", "/console/fleet/bump"): _only(_OPERATOR),
        ("POST", "/console/fleet/pause"): _only(_OPERATOR),
        ("POST", "/console/fleet/resume"): _only(_OPERATOR),
    }
)

#: Where ``Authorization: Bearer`` is taken as the gateway's credential (everywhere else it
#: belongs to the downstream and only ``Fence-Authorization`` counts).
_OWN_PREFIXES = ("/v1/", "/mcp/")
_OWN_PATHS = frozenset({"/metrics"})
_PROXY_ROUTE = "/proxy/{tail}"
_MCP_ROUTE = "/mcp/{downstream}"
_MAX_TOKEN = 8192


def token_sha256(token: str) -> str:
    """What ``[[auth.principals]] token_sha256`` holds for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random bearer token (256 bits)."""
    return secrets.token_urlsafe(32)


def route_key(route: web.AbstractRoute) -> tuple[str, str] | None:
    """The matrix key of a registered route; None for aiohttp's 404/405 stand-ins."""
    if route.resource is None:
        return None
    method = hdrs.METH_GET if route.method == hdrs.METH_HEAD else route.method
    return method, route.resource.canonical


def allowed_roles(key: tuple[str, str]) -> frozenset[str]:
    """The roles the matrix lists for ``key``; none (deny) when the route is not in it."""
    return ROLE_MATRIX.get(key, frozenset())


def matrix_markdown() -> str:
    """``ROLE_MATRIX`` as the Markdown table of docs/security.md (a test keeps them equal)."""
    lines = [
        "| method | route | " + " | ".join(ROLES) + " |",
        "|---|---|" + "---|" * len(ROLES),
    ]
    for (method, path), roles in ROLE_MATRIX.items():
        if ANYONE in roles:
            cells = ["open"] * len(ROLES)
        else:
            cells = ["yes" if role in roles else "-" for role in ROLES]
        lines.append(f"| {method} | `{path}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sees_stored_bodies(principal: Principal | None) -> bool:
    """Stored downstream answers (``response.bodyBase64``) are for operators; without
    ``[auth]`` (no principal) nothing is withheld."""
    return principal is None or principal.has(_OPERATOR)


def _worker_and_client(principal: Principal) -> bool:
    return principal.has(_WORKER) and principal.has(_CLIENT)


def _profiles_with_worker_and_client(oauth: OAuthConfig | None) -> list[str]:
    """The ``[auth.oauth.profiles.NAME]`` names that grant both ``worker`` and ``client``:
    every token such a profile matches is a principal with both (issue 28's escape)."""
    if oauth is None:
        return []
    return [
        name
        for name, profile in oauth.profiles.items()
        if _WORKER in profile.roles and _CLIENT in profile.roles
    ]


def role_warnings(principals: Iterable[Principal], oauth: OAuthConfig | None = None) -> list[str]:
    """Why a principal's roles defeat a rule, one line each: a principal with both ``worker``
    and ``client`` may drop its lease and send a keyed call instead, so its fenced work is no
    longer held to its fence. Allowed (a migration may need it), but warned about at start-up
    and on a reload (``auth.worker_and_client``) and by ``serve --check``. An
    ``[auth.oauth]`` profile granting both is warned about the same way: each token it
    matches is such a principal."""
    return [
        f"principal {principal.name!r} has both roles worker and client: its calls without a "
        "lease are keyed effects, so its fenced work can escape its fence; give workers and "
        "clients separate principals"
        for principal in principals
        if _worker_and_client(principal)
    ] + [
        f"[auth.oauth.profiles.{name}] grants both roles worker and client: a token it matches "
        "may send its calls without a lease as keyed effects, so its fenced work can escape its "
        "fence; give workers and clients separate profiles"
        for name in _profiles_with_worker_and_client(oauth)
    ]


def _warn_roles(authenticator: Authenticator) -> None:
    """The start-up (and reload) form of ``role_warnings``: one warning event per principal
    and per OAuth profile."""
    for principal in authenticator.principals:
        if _worker_and_client(principal):
            log.warning(
                "auth.worker_and_client",
                principal=principal.name,
                detail="a principal with both roles worker and client may send a keyed call "
                "instead of a fenced one; give workers and clients separate principals",
            )
    oauth = authenticator.oauth.config if authenticator.oauth is not None else None
    for name in _profiles_with_worker_and_client(oauth):
        log.warning(
            "auth.worker_and_client",
            profile=name,
            detail="an [auth.oauth] profile granting both roles worker and client lets its "
            "tokens send a keyed call instead of a fenced one; give workers and clients "
            "separate profiles",
        )


def principal_from_config(config: PrincipalConfig) -> Principal:
    """The ``Principal`` one ``[[auth.principals]]`` entry describes."""
    downstreams = frozenset(config.downstreams) if config.downstreams is not None else None
    return Principal(
        config.name,
        frozenset(config.roles),
        Scope(downstreams, config.task_prefixes),
        Limits(config.rate_per_second, config.burst, config.max_open_requests),
    )


class Authenticator:
    """The configured principals, each by the SHA-256 of its token, and ``[auth.oauth]``'s
    token check (``oauth``, None without it)."""

    def __init__(self, auth: AuthConfig, *, wall: WallClock = REAL_TIME) -> None:
        self.oauth = OAuthVerifier(auth.oauth, wall=wall) if auth.oauth is not None else None
        everyone = [(p, principal_from_config(p)) for p in auth.principals]
        self._all = tuple(principal for _, principal in everyone)
        self._principals = tuple(
            (bytes.fromhex(p.token_sha256), principal)
            for p, principal in everyone
            if p.token_sha256 is not None
        )
        self._by_cn = {
            p.certificate_cn: principal for p, principal in everyone if p.certificate_cn is not None
        }

    def by_certificate(self, cn: str) -> Principal | None:
        """The principal whose ``certificate_cn`` is ``cn`` (a verified certificate's CN)."""
        return self._by_cn.get(cn)

    def principal(self, token: str) -> Principal | None:
        """The principal whose token this is. Every digest is compared (constant time, no
        early exit), so the answer's timing says nothing about which one matched."""
        return self.by_digest(hashlib.sha256(token.encode()).digest())

    def by_digest(self, digest: bytes) -> Principal | None:
        """The principal whose token has this SHA-256 (a console session carries it, so a
        revoked token ends the session at once); compared like ``principal``."""
        found: Principal | None = None
        for expected, principal in self._principals:
            if hmac.compare_digest(digest, expected):
                found = principal
        return found

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(principal.name for principal in self._all)

    @property
    def principals(self) -> tuple[Principal, ...]:
        return self._all


class _Meter:
    """One principal's rate bucket and requests in flight, in this gateway process."""

    def __init__(self, limits: Limits, clock: Clock) -> None:
        self.limits = limits
        rate = limits.rate_per_second
        burst = limits.burst or max(1, math.ceil(rate or 1))
        self.bucket = TokenBucket(rate, burst, clock) if rate is not None else None
        self.open = OpenRequests(limits.max_open_requests)


class AuthState:
    """What the middleware checks against: the principals (swapped whole by ``reload``) and
    each principal's meter (kept across a reload while its limits stay the same)."""

    def __init__(
        self, auth: AuthConfig, clock: Clock = time.monotonic, wall: WallClock = REAL_TIME
    ) -> None:
        self._clock = clock
        self._wall = wall
        self.authenticator = Authenticator(auth, wall=wall)
        self._meters: dict[str, _Meter] = {}
        #: OAuth principals' meters, least recently used first: anyone the issuer names may
        #: show up, so they are bounded (``max_principals``); a dropped one starts afresh.
        self._oauth_meters: OrderedDict[str, _Meter] = OrderedDict()
        self.oauth_changed = False
        _warn_roles(self.authenticator)

    def reload(self, auth: AuthConfig) -> None:
        """Use ``auth``'s principals from the next request on. One assignment: a request sees
        the old set or the new one, never a mix. Requests already let in finish as they are.
        ``[auth.oauth]`` reloads with it: the fetched keys are kept while the issuer and
        ``jwks_url`` stay the same; ``oauth_changed`` says whether the section changed (then
        streams opened with OAuth tokens end: their roles may have)."""
        old = self.authenticator
        authenticator = Authenticator(auth, wall=self._wall)
        if authenticator.oauth is not None and old.oauth is not None:
            authenticator.oauth.adopt_cache(old.oauth)
        self.oauth_changed = (old.oauth.config if old.oauth else None) != auth.oauth
        self.authenticator = authenticator
        _warn_roles(authenticator)
        kept = set(authenticator.names)
        self._meters = {name: m for name, m in self._meters.items() if name in kept}
        if self.oauth_changed:
            self._oauth_meters.clear()

    def meter(self, principal: Principal) -> _Meter:
        if principal.is_oauth:
            return self._oauth_meter(principal)
        meter = self._meters.get(principal.name)
        if meter is None or meter.limits != principal.limits:
            meter = self._meters[principal.name] = _Meter(principal.limits, self._clock)
        return meter

    def _oauth_meter(self, principal: Principal) -> _Meter:
        meters = self._oauth_meters
        meter = meters.get(principal.name)
        if meter is None or meter.limits != principal.limits:
            meter = meters[principal.name] = _Meter(principal.limits, self._clock)
        meters.move_to_end(principal.name)
        oauth = self.authenticator.oauth
        bound = oauth.config.max_principals if oauth is not None else 1
        while len(meters) > bound:
            meters.popitem(last=False)
        return meter


def _bearer(values: list[str], header: str) -> str:
    if len(values) != 1:
        raise Unauthenticated(f"{header} may appear once")
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token or len(token) > _MAX_TOKEN:
        raise Unauthenticated(f"{header}: expected 'Bearer <token>'")
    return token


def _takes_authorization(path: str) -> bool:
    return path in _OWN_PATHS or path.startswith(_OWN_PREFIXES)


def _credential(request: web.Request, path: str) -> str | None:
    """The bearer token the request presents to the gateway; None when it sends none; raise
    ``Unauthenticated`` for a malformed one."""
    fence = request.headers.getall("Fence-Authorization", [])
    if fence:
        return _bearer(fence, "Fence-Authorization")
    if _takes_authorization(path):
        given = request.headers.getall(hdrs.AUTHORIZATION, [])
        if given and any(v.strip().lower().startswith("bearer ") for v in given):
            return _bearer(given, "Authorization")
    return None


def _certificate_cn(request: web.Request) -> str | None:
    """The subject CN of the client certificate the TLS handshake verified (mTLS), None
    without one. A subject with several CNs identifies no one."""
    transport = request.transport
    peercert = transport.get_extra_info("peercert") if transport is not None else None
    if not peercert:
        return None
    cns = [
        value
        for rdn in peercert.get("subject", ())
        for attribute, value in rdn
        if attribute == "commonName"
    ]
    if len(cns) != 1:
        raise Unauthenticated("the client certificate's subject needs exactly one CN")
    cn: str = cns[0]
    return cn


class _NoRole(Exception):
    """A valid OAuth token whose claims match no ``[auth.oauth]`` profile: no role at all."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


async def _by_token(authenticator: Authenticator, token: str, request: web.Request) -> Principal:
    """The principal of a bearer token: a static principal's, else (``[auth.oauth]``) the
    token's own; raise ``Unauthenticated``, ``AuthUnavailable`` or ``_NoRole``."""
    principal = authenticator.principal(token)
    if principal is not None:
        return principal
    oauth = authenticator.oauth
    if oauth is None or not oauth.looks_like_jwt(token):
        raise Unauthenticated("the token matches no principal")
    verified = await oauth.verify(token, request.path)
    if verified.principal is None:
        raise _NoRole(verified.name)
    return verified.principal


async def _authenticate(authenticator: Authenticator, request: web.Request, path: str) -> Principal:
    """The principal of a bearer credential if one is sent, else of the client certificate;
    raise ``Unauthenticated`` (or, for an OAuth token, ``AuthUnavailable`` / ``_NoRole``)."""
    token = _credential(request, path)
    if token is not None:
        return await _by_token(authenticator, token, request)
    cn = _certificate_cn(request)
    if cn is None:
        raise Unauthenticated("no credential: send Fence-Authorization: Bearer <token>")
    principal = authenticator.by_certificate(cn)
    if principal is None:
        raise Unauthenticated("the client certificate's CN matches no principal")
    return principal


def _challenge(
    authenticator: Authenticator, request: web.Request, error: FencegateError
) -> str | None:
    """The ``WWW-Authenticate`` of a refusal: on every 401; with ``[auth.oauth]`` it points to
    the RFC 9728 metadata of the route's resource (the path-suffixed document on
    ``/mcp/{name}``), says ``invalid_token`` when a token was sent, and on an OAuth token's
    403 says ``insufficient_scope`` with the scopes a profile allowed there needs."""
    oauth = authenticator.oauth
    if oauth is None:
        return 'Bearer realm="fencegate"' if isinstance(error, Unauthenticated) else None
    metadata = oauth.config.resource_base_url + metadata_path(request.path)
    if isinstance(error, Unauthenticated):
        sent = "Fence-Authorization" in request.headers or hdrs.AUTHORIZATION in request.headers
        invalid = ', error="invalid_token"' if sent else ""
        return f'Bearer realm="fencegate"{invalid}, resource_metadata="{metadata}"'
    if isinstance(error, _InsufficientScope):
        scope = profiles_granting(oauth.config.profiles, error.allowed)
        scope_part = f', scope="{scope}"' if scope else ""
        return (
            f'Bearer realm="fencegate", error="insufficient_scope"{scope_part}, '
            f'resource_metadata="{metadata}"'
        )
    return None


class _InsufficientScope(Forbidden):
    """403 ``FORBIDDEN`` for an OAuth token: its profile grants no role the route allows (or
    it matches no profile); the challenge says ``insufficient_scope`` (RFC 6750 §3.1)."""

    def __init__(self, detail: str, allowed: frozenset[str]) -> None:
        super().__init__(detail)
        self.allowed = allowed


def _refusal(
    error: FencegateError,
    path: str,
    retry_after: int | None = None,
    challenge: str | None = None,
) -> web.Response:
    headers: dict[str, str] = {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if challenge is not None:
        headers["WWW-Authenticate"] = challenge
    if path.startswith("/proxy/"):
        # Like every proxied answer: nothing was recorded, nothing was forwarded.
        headers.update({"Fence-Effect-State": "NONE", "Fence-Replayed": "false"})
    return problem_response(error, headers=headers)


def _scope_target(request: web.Request, key: tuple[str, str]) -> tuple[str | None, str | None]:
    """(downstream, task id) a request acts on, for the scope check. A proxied call's
    downstream or ``Fence-Task`` that cannot be read is None here: the proxy refuses it (400)
    before anything is recorded or sent."""
    if key[1] == _PROXY_ROUTE:
        try:
            downstream: str | None = split_proxy_path(request.raw_path)[0]
        except BadRequest:
            downstream = None
        tasks = request.headers.getall("Fence-Task", [])
        return downstream, tasks[0].strip() if len(tasks) == 1 else None
    if key[1] == _MCP_ROUTE:
        tasks = request.headers.getall("Fence-Task", [])
        return request.match_info.get("downstream"), tasks[0].strip() if len(tasks) == 1 else None
    return None, request.match_info.get("task_id")


class SessionAuth(Protocol):
    """A browser session that stands in for the bearer credential on the routes it covers
    (the console's cookie, ``gateway/console``). It is judged by the same role matrix,
    scopes and limits; only where the principal comes from, and how a refusal looks (a
    login page rather than problem+json), differ."""

    def covers(self, path: str) -> bool: ...

    def principal(self, request: web.Request, authenticator: Authenticator) -> Principal:
        """The session's principal, re-checked against ``authenticator`` now; raise
        ``Unauthenticated`` when there is none or it no longer holds."""
        ...

    def refusal(self, request: web.Request, error: FencegateError) -> web.StreamResponse: ...


def _refused(
    request: web.Request,
    path: str,
    sessions: SessionAuth | None,
    error: FencegateError,
    retry_after: int | None = None,
    authenticator: Authenticator | None = None,
) -> web.StreamResponse:
    """A refusal as problem+json, or as the session's page on the routes it covers; its
    detail names the request (method and path, never the query string)."""
    error.about(requested(request))
    if sessions is None:
        challenge = (
            _challenge(authenticator, request, error)
            if authenticator is not None
            else ('Bearer realm="fencegate"' if isinstance(error, Unauthenticated) else None)
        )
        return _refusal(error, path, retry_after, challenge)
    response = sessions.refusal(request, error)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


class _AuthMiddleware:
    """The ``[auth]`` middleware; its ``state`` is what ``serve`` reloads on SIGHUP."""

    __middleware_version__ = 1  # a new-style aiohttp middleware, as @web.middleware marks it

    def __init__(self, state: AuthState, sessions: SessionAuth | None = None) -> None:
        self.state = state
        self.sessions = sessions

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = route_key(request.match_info.route)
        path = key[1] if key is not None else request.path
        allowed = allowed_roles(key) if key is not None else _EVERY_ROLE
        if ANYONE in allowed:
            return await handler(request)
        sessions = self.sessions
        if sessions is not None and not sessions.covers(request.path):
            sessions = None

        authenticator = self.state.authenticator
        try:
            if sessions is not None and "Fence-Authorization" not in request.headers:
                principal = sessions.principal(request, authenticator)
            else:
                principal = await _authenticate(authenticator, request, path)
        except Unauthenticated as exc:
            log.info("auth.unauthenticated", method=request.method, path=path, reason=exc.detail)
            return _refused(request, path, sessions, exc, authenticator=authenticator)
        except AuthUnavailable as exc:
            log.warning("auth.unavailable", method=request.method, path=path, reason=exc.detail)
            return _refused(request, path, sessions, exc, authenticator=authenticator)
        except _NoRole as exc:
            log.info("auth.insufficient_scope", principal=exc.name, method=request.method,
                     path=path)  # fmt: skip
            return _refused(
                request, path, sessions,
                _InsufficientScope(f"{exc.name!r}: the token matches no [auth.oauth] profile",
                                   allowed),
                authenticator=authenticator,
            )  # fmt: skip
        if not principal.roles & allowed:
            log.info(
                "auth.forbidden",
                principal=principal.name,
                roles=sorted(principal.roles),
                method=request.method,
                path=path,
            )
            need = ", ".join(sorted(allowed)) or "no role (not in the role matrix)"
            detail = (
                f"the route {path} needs one of: {need}; "
                f"{principal.name!r} has {', '.join(sorted(principal.roles))}"
            )
            refusal = (
                _InsufficientScope(detail, allowed) if principal.is_oauth else Forbidden(detail)
            )
            return _refused(request, path, sessions, refusal, authenticator=authenticator)
        if key is not None and key[1] == _PROXY_ROUTE and sessions is None:
            try:
                await self._strip_gateway_authorization(request, authenticator)
            except AuthUnavailable as exc:
                return _refused(request, path, sessions, exc, authenticator=authenticator)
        if key is not None:
            downstream, task_id = _scope_target(request, key)
            reason = scope_refusal(principal.scope, downstream=downstream, task_id=task_id)
            if reason is not None:
                log.info(
                    "auth.out_of_scope",
                    principal=principal.name,
                    method=request.method,
                    path=path,
                    reason=reason,
                )
                return _refused(request, path, sessions, Forbidden(f"{principal.name!r}: {reason}"))
        meter = self.state.meter(principal)
        if meter.bucket is not None:
            wait = meter.bucket.take()
            if wait > 0:
                seconds = retry_after_seconds(wait)
                log.info("auth.rate_limited", principal=principal.name, path=path, limit="rate")
                return _refused(
                    request,
                    path,
                    sessions,
                    RateLimited(
                        f"{principal.name!r} is over rate_per_second = {meter.bucket.rate} "
                        f"(burst {meter.bucket.burst})",
                        retryAfterMs=math.ceil(wait * 1000),
                    ),
                    retry_after=seconds,
                )
        if not meter.open.enter():
            log.info("auth.rate_limited", principal=principal.name, path=path, limit="open")
            return _refused(
                request,
                path,
                sessions,
                RateLimited(
                    f"{principal.name!r} has max_open_requests = {meter.open.limit} "
                    "requests in flight",
                    retryAfterMs=1000,
                ),
                retry_after=1,
            )
        request[PRINCIPAL_KEY] = principal
        try:
            return await handler(request)
        except Unauthenticated as exc:
            # A 401 the handler raised after letting the request in: a long-poll whose OAuth
            # token expired, or whose principal a reload removed (``events.EventHub``). The
            # same challenge as the 401s above (``_challenge``), judged by the ``[auth]`` of now.
            return _refused(request, path, sessions, exc, authenticator=self.state.authenticator)
        finally:
            meter.open.leave()

    @staticmethod
    async def _strip_gateway_authorization(
        request: web.Request, authenticator: Authenticator
    ) -> None:
        """On ``/proxy``: mark an ``Authorization`` that authenticates to the gateway (a static
        token, or an OAuth token of the issuer it would accept here) so the proxy drops it.
        A token of the issuer whose key cannot be fetched now may be a gateway token: refused
        (503) rather than forwarded."""
        for value in request.headers.getall(hdrs.AUTHORIZATION, []):
            scheme, _, token = value.strip().partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                continue
            if authenticator.principal(token) is None:
                oauth = authenticator.oauth
                if oauth is None or not oauth.looks_like_jwt(token):
                    continue
                try:
                    await oauth.verify(token, request.path, any_resource=True)
                except Unauthenticated:
                    continue  # not a token the gateway takes: the downstream's own
            request[STRIP_AUTHORIZATION] = True
            log.info("auth.gateway_token_withheld", method=request.method, path=_PROXY_ROUTE)
            return


def auth_middleware(
    auth: AuthConfig,
    clock: Clock = time.monotonic,
    sessions: SessionAuth | None = None,
    wall: WallClock = REAL_TIME,
) -> Middleware:
    """The middleware for ``[auth]``: authenticate, check the role matrix and the principal's
    scope, apply its limits, set the principal. ``auth_state(app)`` finds its state.
    ``sessions``: where a browser session stands in for the bearer credential (the console).
    ``wall``: the wall clock an OAuth token's ``exp`` and ``nbf`` are read against, and a
    stream opened with it waits on to end at its ``exp``."""
    return _AuthMiddleware(AuthState(auth, clock, wall), sessions)


async def resource_metadata(request: web.Request) -> web.Response:
    """RFC 9728 protected resource metadata (open routes): the root document's resource is
    ``resource_base_url``; ``/mcp/{downstream}``'s is ``<resource_base_url>/mcp/{downstream}``
    for each MCP downstream. 404 without ``[auth.oauth]`` in force (or no such MCP server)."""
    from fencegate.gateway.state import CONFIG
    from fencegate.ledger.errors import NoSuchDownstream

    state = auth_state(request.app)
    oauth = state.authenticator.oauth if state is not None else None
    if oauth is None:
        raise web.HTTPNotFound()  # no [auth.oauth]: this gateway takes no OAuth tokens
    name = request.match_info.get("downstream")
    path = "/"
    if name is not None:
        mcp = {d.name for d in request.app[CONFIG].downstreams if d.adapter == "mcp"}
        if name not in mcp:
            raise NoSuchDownstream(f"no MCP downstream {name!r}")
        path = f"/mcp/{name}"
    document = metadata_document(oauth.config, resource_of(oauth.config, path))
    return web.json_response(document, headers={"Cache-Control": "max-age=300"})


def auth_state(app: web.Application) -> AuthState | None:
    """The ``[auth]`` state of ``app`` (None without ``[auth]``): ``serve`` reloads it."""
    for middleware in app.middlewares:
        if isinstance(middleware, _AuthMiddleware):
            return middleware.state
    return None
