"""Who is calling: the authenticated principal of a request, when ``[auth]`` is on.

A principal is a configured one (``[[auth.principals]]``, by token or certificate) or the
principal of an OAuth access token (``[auth.oauth]``, ``gateway/oauth.py``): ``oauth:<iss>#<sub>``
with the roles and scope of the profile the token matches.

The authentication middleware (``gateway/auth.py``) sets it on every request it lets through;
handlers and the proxy read it with ``principal_of``. Without ``[auth]`` there is none, and
every rule that binds an action to a principal is off (docs/security.md).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from aiohttp import web

from fencegate.gateway.config import OAUTH_PREFIX
from fencegate.gateway.limits import NO_LIMITS, Limits
from fencegate.ledger.errors import BadRequest

__all__ = [
    "ANONYMOUS",
    "OAUTH_PREFIX",
    "PRINCIPAL_KEY",
    "REAL_TIME",
    "STRIP_AUTHORIZATION",
    "Principal",
    "Scope",
    "WallClock",
    "acting_operator",
    "at_expiry",
    "caller_name",
    "is_oauth_name",
    "may_key",
    "may_lease",
    "oauth_name",
    "operator_label",
    "principal_of",
    "scope_refusal",
]

#: Where the middleware leaves the principal on the request: a ``web.RequestKey`` where
#: aiohttp has them (3.14: a plain string key warns), else the string.
_REQUEST_KEY: Any = getattr(web, "RequestKey", None)
PRINCIPAL_KEY: Any = (
    _REQUEST_KEY("fencegate.principal", object) if _REQUEST_KEY else "fencegate.principal"
)

#: Set on a ``/proxy`` request whose ``Authorization`` authenticates to the gateway (a static
#: principal's token, or an OAuth token it would accept): the proxy drops that header even
#: when the downstream has ``forward_authorization``: no gateway token reaches a downstream.
STRIP_AUTHORIZATION: Any = (
    _REQUEST_KEY("fencegate.strip_authorization", bool)
    if _REQUEST_KEY
    else "fencegate.strip_authorization"
)


@dataclass(frozen=True, slots=True)
class Scope:
    """What a principal may reach. None: unlimited (the key is absent from its config)."""

    #: The downstreams it may call through ``/proxy/{downstream}/...``.
    downstreams: frozenset[str] | None = None
    #: The task ids it may act on (``/v1/tasks/{id}``, a proxied call's ``Fence-Task``) start
    #: with one of these.
    task_prefixes: tuple[str, ...] | None = None


#: No limit at all: every principal without ``downstreams`` / ``task_prefixes``.
UNSCOPED = Scope()


def scope_refusal(scope: Scope, *, downstream: str | None, task_id: str | None) -> str | None:
    """Why a call on ``downstream`` and ``task_id`` is outside ``scope``, or None when it is
    inside. A None argument is not part of the call (``/v1/tasks/{id}`` names no downstream)
    and is not checked. Pure: ``gateway/auth.py`` turns a reason into 403 ``FORBIDDEN``."""
    downstreams, prefixes = scope.downstreams, scope.task_prefixes
    if downstream is not None and downstreams is not None and downstream not in downstreams:
        allowed = ", ".join(sorted(downstreams)) or "none"
        return f"downstream {downstream!r} is outside its scope (downstreams: {allowed})"
    if task_id is not None and prefixes is not None and not task_id.startswith(prefixes):
        allowed = ", ".join(repr(p) for p in prefixes) or "none"
        return f"task {task_id!r} is outside its scope (task_prefixes: {allowed})"
    return None


class WallClock(Protocol):
    """Unix seconds and a sleep on the same time line: what an OAuth token's ``exp`` and
    ``nbf`` are read against (``oauth.OAuthVerifier``) and what ``at_expiry`` waits on, so the
    check at the door and the end of a stream opened with the token can never disagree. In
    production ``REAL_TIME``; a test's stands still until it moves it (``tests/clocks.py``)."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class _RealTime:
    def now(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


#: The system's wall clock, and the event loop's sleep.
REAL_TIME: Final[WallClock] = _RealTime()


@dataclass(frozen=True, slots=True)
class Principal:
    """A configured identity: its name (unique), its roles, and what it may reach."""

    name: str
    roles: frozenset[str]
    scope: Scope = UNSCOPED
    #: Rate and requests in flight (``gateway/limits.py``); the default is unlimited.
    limits: Limits = NO_LIMITS
    #: When its credential stops being accepted (Unix seconds): an OAuth token's ``exp`` plus
    #: ``leeway_ms``. None: a static principal, good until a reload removes it. A stream or
    #: long-poll opened with it ends then, as a console session does.
    expires_at: float | None = None
    #: The clock ``expires_at`` is read on: the token check's (``at_expiry`` waits on it).
    clock: WallClock = field(default=REAL_TIME, compare=False, repr=False)

    def has(self, role: str) -> bool:
        return role in self.roles

    @property
    def is_oauth(self) -> bool:
        """An OAuth token's principal (``oauth:<iss>#<sub>``), not a configured one."""
        return is_oauth_name(self.name)


# An OAuth principal's name is ``oauth:<iss>#<sub>`` (OAUTH_PREFIX). A static principal's
# name holds no ``#`` and may not start with ``oauth:`` (``config.AuthConfig``): never equal.


def oauth_name(issuer: str, subject: str) -> str:
    """The principal name of the token ``issuer`` issued for ``subject``."""
    return f"{OAUTH_PREFIX}{issuer}#{subject}"


def is_oauth_name(name: str) -> bool:
    return name.startswith(OAUTH_PREFIX) and "#" in name


def at_expiry(principal: Principal | None, then: Callable[[], None]) -> asyncio.Task[None] | None:
    """Call ``then`` when ``principal``'s credential stops being accepted (an OAuth token's
    ``exp`` plus leeway, on the clock the token was checked on): a stream or long-poll opened
    with it ends then. None (nothing scheduled) for a principal whose credential does not
    expire. Cancel it when done (and hold it until then: the loop keeps no task alive)."""
    if principal is None or principal.expires_at is None:
        return None
    clock, expires_at = principal.clock, principal.expires_at

    async def expire() -> None:
        await clock.sleep(max(0.0, expires_at - clock.now()))
        then()

    return asyncio.get_running_loop().create_task(expire(), name="principal.at_expiry")


def principal_of(request: web.Request) -> Principal | None:
    """The request's authenticated principal, or None when authentication is off."""
    value = request.get(PRINCIPAL_KEY)
    return value if isinstance(value, Principal) else None


#: Without ``[auth]`` every caller is this one principal: it may call under a lease and by
#: idempotency key alike (docs/security.md), and its keyed effects are all its own.
ANONYMOUS = "anonymous"


def caller_name(principal: Principal | None) -> str:
    """Whose keyed effects a caller's are: its principal's name, ``ANONYMOUS`` without
    ``[auth]``."""
    return principal.name if principal is not None else ANONYMOUS


def may_lease(principal: Principal | None) -> bool:
    """May this caller send a fenced call (``worker``)? Everyone without ``[auth]``."""
    return principal is None or principal.has("worker")


def may_key(principal: Principal | None) -> bool:
    """May this caller send a lease-less call by idempotency key (``client``)? Everyone
    without ``[auth]``."""
    return principal is None or principal.has("client")


_OPERATOR = re.compile(r"[A-Za-z0-9._:@/ -]{1,200}")


def operator_label(name: str, field: str = "Fence-Operator") -> str:
    """A free-text operator label (without ``[auth]`` the only name an action carries),
    bounded and plain so it cannot forge a log line or a trail entry."""
    name = name.strip()
    if not _OPERATOR.fullmatch(name):
        raise BadRequest(f"{field}: 1 to 200 letters, digits, spaces or . _ : @ / -")
    return name


def acting_operator(request: web.Request) -> str:
    """Who acts: the credential's principal when there is one (``Fence-Operator`` is then
    ignored), else the free-text ``Fence-Operator`` label."""
    principal = principal_of(request)
    if principal is not None:
        return principal.name
    return operator_label(request.headers.get("Fence-Operator", "anonymous"))
