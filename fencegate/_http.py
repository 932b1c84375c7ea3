"""The SDK's HTTP layer: reading the gateway's answers, and what a lease needs of a client.

``RawAnswer`` is one answer as read; ``gateway_problem`` tells the gateway's own problems from
whatever a downstream said; ``Transport`` is the part of ``fencegate.client.Client`` a lease
uses, so that ``fencegate.lease`` never imports the client (the client imports the lease).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, unquote

from multidict import CIMultiDictProxy

from fencegate.errors import PROBLEM_TYPE_PREFIX, ProblemError, error_from_problem

__all__ = [
    "RawAnswer",
    "Transport",
    "describe_exception",
    "gateway_problem",
    "proxied_downstream",
    "task_path",
]

#: Characters of the id grammar, left as they are in paths (``/`` included, as the contract says).
_ID_SAFE = "/:@._-"


@dataclass(frozen=True, slots=True)
class RawAnswer:
    """One HTTP answer as the SDK read it (``reason``: the status line's reason phrase)."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    reason: str = ""

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def gateway_problem(answer: RawAnswer) -> ProblemError | None:
    """The typed error if ``answer`` is the gateway's own problem (not a downstream's)."""
    if answer.status < 400:
        return None
    content_type = answer.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if content_type != "application/problem+json":
        return None
    try:
        body = answer.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or not str(body.get("type", "")).startswith(PROBLEM_TYPE_PREFIX):
        return None
    return error_from_problem(answer.status, body, answer.headers)


def task_path(task_id: str, action: str = "") -> str:
    """``/v1/tasks/{taskId}`` (or ``.../{action}``), the id percent-encoded as the contract says."""
    return f"/v1/tasks/{quote(task_id, safe=_ID_SAFE)}" + (f"/{action}" if action else "")


def describe_exception(exc: BaseException) -> str:
    """``exc`` as a reason an operator can act on: its class, and its text when it has one.
    Many transport errors (``TimeoutError()``, a bare ``ServerDisconnectedError``) have an
    empty ``str()``, which used to end messages in ``(timed out: )``."""
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def proxied_downstream(path: str) -> str | None:
    """The downstream a ``/proxy/{downstream}/...`` path goes to (None: not a proxied call)."""
    if not path.startswith("/proxy/"):
        return None
    name = path.removeprefix("/proxy/").split("/", 1)[0].split("?", 1)[0]
    return unquote(name) or None


class Transport(Protocol):
    """What a lease needs of the client that made it: one HTTP exchange, one JSON call, and
    the headers that go with every call (the gateway credential among them)."""

    @property
    def headers(self) -> Mapping[str, str]:
        """Headers sent with every call (``Fence-Authorization`` when the client has a token)."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds one call may take unless it says otherwise (``send``'s ``timeout_s``)."""
        ...

    async def send(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> RawAnswer:
        """One HTTP exchange with the gateway; ``path`` is sent as given (already encoded)."""
        ...

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """A JSON call of the coordination or ledger API: (status, decoded body), or raise."""
        ...
