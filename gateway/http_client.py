"""The one client every request to a downstream goes through, and the rule that nothing below
the ledger ever sends a request twice.

aiohttp re-sends a request by itself when a connection breaks (``ServerDisconnectedError``,
``ClientOSError``) and the method is one it calls idempotent (GET, HEAD, OPTIONS, TRACE, PUT,
DELETE). A downstream that applied a PUT and then reset the connection would execute it
twice while the ledger records one attempt. aiohttp has no public switch for that retry, so
every request carries a per-request client middleware (public since aiohttp 3.12) that lets
exactly one send through: the retry reaches the middleware again and is refused before it
connects. ``tests/test_send_once.py`` proves it on the aiohttp that is installed, and the
slow ``tests/test_aiohttp_versions.py`` on each minor version pyproject.toml allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp

__all__ = ["PoolWait", "ResendRefused", "new_client_session", "send_once"]


class ResendRefused(Exception):
    """aiohttp tried to send a request a second time after the first send failed; the first
    may have reached the downstream, so its outcome is unknown. Deliberately not a
    ``ClientError``: aiohttp's retry loop must not catch it."""


def send_once() -> tuple[aiohttp.ClientMiddlewareType, ...]:
    """A fresh guard for one request: the first call goes through, any later one raises."""
    sent = False

    async def guard(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        nonlocal sent
        if sent:
            raise ResendRefused(f"{request.method} {request.url}: refused a second send")
        sent = True
        return await handler(request)

    return (guard,)


#: Idle pooled connections are closed after this long, below the idle timeouts common servers
#: use (Node's 5 s), so a forward rarely meets a connection the downstream is closing: with
#: re-sends refused, such a forward would read UNKNOWN although it never arrived.
IDLE_CONNECTION_S = 4.0


@dataclass
class PoolWait:
    """Pass one as a request's ``trace_request_ctx``: ``waiting`` is true while the request
    waits for a free connection of the pool (``proxy.max_connections``). A request that
    failed while still waiting never got a connection, so it was certainly never sent."""

    waiting: bool = False


async def _queued_start(
    session: aiohttp.ClientSession,
    context: SimpleNamespace,
    params: aiohttp.TraceConnectionQueuedStartParams,
) -> None:
    if isinstance(context.trace_request_ctx, PoolWait):
        context.trace_request_ctx.waiting = True


async def _queued_end(
    session: aiohttp.ClientSession,
    context: SimpleNamespace,
    params: aiohttp.TraceConnectionQueuedEndParams,
) -> None:
    if isinstance(context.trace_request_ctx, PoolWait):
        context.trace_request_ctx.waiting = False


def new_client_session(max_connections: int) -> aiohttp.ClientSession:
    """One pool for every forward. No cookie jar (the gateway must not carry one agent's
    session into another's call), no proxy settings from the environment, bodies passed
    through as they are (no transparent decompression), and no header the agent did not send
    invented for the downstream: aiohttp's ``User-Agent``, ``Accept: */*``,
    ``Accept-Encoding`` and ``Content-Type: application/octet-stream`` (which it adds to any
    bytes body, ``b""`` included) are all skipped. Pool waits are traced (``PoolWait``)."""
    pool_wait = aiohttp.TraceConfig()
    pool_wait.on_connection_queued_start.append(_queued_start)
    pool_wait.on_connection_queued_end.append(_queued_end)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=IDLE_CONNECTION_S),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        trust_env=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        trace_configs=[pool_wait],
    )
