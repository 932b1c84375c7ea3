"""Who is calling: the authenticated principal of a request, when ``[auth]`` is on.

The authentication middleware (``gateway/auth.py``) sets it on every request it lets through;
handlers and the proxy read it with ``principal_of``. Without ``[auth]`` there is none, and
every rule that binds an action to a principal is off (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["PRINCIPAL_KEY", "Principal", "principal_of"]

#: Where the middleware leaves the principal on the request: a ``web.RequestKey`` where
#: aiohttp has them (3.14: a plain string key warns), else the string.
_REQUEST_KEY: Any = getattr(web, "RequestKey", None)
PRINCIPAL_KEY: Any = (
    _REQUEST_KEY("fencegate.principal", object) if _REQUEST_KEY else "fencegate.principal"
)


@dataclass(frozen=True, slots=True)
class Principal:
    """A configured identity: its name (unique), its roles, and what it may reach."""

    name: str
    roles: frozenset[str]

    def has(self, role: str) -> bool:
        return role in self.roles


def principal_of(request: web.Request) -> Principal | None:
    """The request's authenticated principal, or None when authentication is off."""
    value = request.get(PRINCIPAL_KEY)
    return value if isinstance(value, Principal) else None
