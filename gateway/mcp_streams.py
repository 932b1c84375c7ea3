"""MCP ``GET`` streams: bounded in number, and no longer than their lease and principal.

A ``GET /mcp/{downstream}`` is the server's stream of the session: it holds one pooled
connection for as long as it is open. Two rules keep it from outliving what let it in and from
starving the forwards:

- **It ends with its lease.** The stream re-checks its lease in the store every
  ``LEASE_CHECK_S`` (``Store.check_fence``: fenced by a takeover or an epoch bump, cancelled,
  expired unrenewed, committed) and ends within that plus one store round trip of the lease
  ending; it ends too on the reload that removes its principal (or narrows it so that a new
  ``GET`` would be refused: ``events.after_reload``). Ending it is the agent's stream ending:
  its MCP client opens a new one under its current lease.
- **At most ``proxy.max_stream_connections``** (default half of ``proxy.max_connections``)
  are open in a gateway process; one more is ``503 DOWNSTREAM_BUSY`` with ``Retry-After``
  (a JSON-RPC error body, as every ``/mcp`` refusal), so streams never hold the whole pool.
- **At most ``proxy.max_streams_per_principal``** of them (default half of the stream
  places) belong to one principal, so one worker cannot take every place and deny the
  others (docs/decisions.md). Without ``[auth]`` there are no principals to tell apart.

``hold`` wraps the relay of a ``GET`` (``gateway/mcp.py``); ``until_over`` is what the relay's
copy loop waits on beside the agent leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final

import structlog
from aiohttp import web

from fencegate.adapters import mcp
from fencegate.gateway.events import after_reload
from fencegate.gateway.principals import Principal, at_expiry, is_oauth_name, principal_of
from fencegate.gateway.state import STORE
from fencegate.ledger.effects import Fence
from fencegate.ledger.errors import ClaimRefused, DownstreamBusy, FencegateError

__all__ = ["LEASE_CHECK_S", "STREAMS", "OpenStream", "StreamRegistry", "hold", "until_over"]

log = structlog.get_logger("fencegate.mcp")

#: How often an open stream re-checks its lease (it ends within this plus one store round
#: trip of the lease being fenced, cancelled or running out).
LEASE_CHECK_S: Final = 0.5
#: What a refused stream is told to wait (``Retry-After``, seconds).
_RETRY_AFTER_S: Final = 1
_MCP_ROUTE: Final = ("GET", "/mcp/{downstream}")
_REQUEST_KEY: Any = getattr(web, "RequestKey", None)
_STREAM_KEY: Any = (
    _REQUEST_KEY("fencegate.mcp_stream", object) if _REQUEST_KEY else "fencegate.mcp_stream"
)


class OpenStream:
    """One relayed ``GET`` stream: whose, under which lease, and whether it must end."""

    def __init__(self, principal: str | None, downstream: str, fence: Fence) -> None:
        self.principal = principal
        self.downstream = downstream
        self.fence = fence
        #: Why it must end (a problem code, or ``reload``); None while it may go on.
        self.reason: str | None = None
        self.over = asyncio.Event()

    def end(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.over.set()


class StreamRegistry:
    """The ``GET`` streams open in this gateway process, at most ``limit``."""

    def __init__(self, limit: int, per_principal: int | None = None) -> None:
        self.limit = limit
        #: Most streams one principal may hold (None: no share).
        self.per_principal = per_principal
        self._open: set[OpenStream] = set()

    @property
    def count(self) -> int:
        return len(self._open)

    def full(self, principal: str | None) -> str | None:
        """Which bound a new stream of ``principal`` would pass (its key, value and what is
        open), or None when it has a place."""
        if len(self._open) >= self.limit:
            return (
                f"proxy.max_stream_connections = {self.limit} MCP streams are open in this gateway"
            )
        if principal is not None and self.per_principal is not None:
            held = sum(1 for stream in self._open if stream.principal == principal)
            if held >= self.per_principal:
                return (
                    f"proxy.max_streams_per_principal = {self.per_principal} MCP streams of "
                    "this principal are open in this gateway"
                )
        return None

    def open(self, principal: str | None, downstream: str, fence: Fence) -> OpenStream | None:
        """A new stream's place; None when ``full``."""
        if self.full(principal) is not None:
            return None
        stream = OpenStream(principal, downstream, fence)
        self._open.add(stream)
        return stream

    def close(self, stream: OpenStream) -> None:
        self._open.discard(stream)

    def reload(self, principals: Iterable[Principal], *, keep_oauth: bool = False) -> int:
        """End the streams a reload of ``principals`` would refuse now (``after_reload``);
        how many. OAuth principals' streams are kept when ``keep_oauth`` (``[auth.oauth]``
        unchanged), else ended."""
        by_name = {principal.name: principal for principal in principals}
        ended = 0
        for stream in self._open:
            if stream.principal is None:
                continue
            if keep_oauth and is_oauth_name(stream.principal):
                continue
            verdict = after_reload(by_name, stream.principal, route=_MCP_ROUTE,
                                   task_id=stream.fence.task_id,
                                   downstream=stream.downstream)  # fmt: skip
            if isinstance(verdict, FencegateError):
                stream.end("reload")
                ended += 1
        return ended


#: The app's streams (``create_app``).
STREAMS = web.AppKey("mcp_streams", StreamRegistry)


def _busy(why: str, downstream: str) -> web.Response:
    error = DownstreamBusy(
        f"downstream {downstream}: {why}; nothing was sent, retry after a pause",
        retryAfterMs=_RETRY_AFTER_S * 1000,
    )
    return web.Response(
        status=error.status,
        body=json.dumps(mcp.error_message(None, error), separators=(",", ":")).encode(),
        content_type="application/json",
        headers={"Retry-After": str(_RETRY_AFTER_S)},
    )


async def hold(
    request: web.Request,
    downstream: str,
    fence: Fence,
    relay: Callable[[], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Relay a ``GET`` stream (``relay``) in one of the process's stream places, or refuse
    it (503) when none is free."""
    registry = request.app[STREAMS]
    principal = principal_of(request)
    name = principal.name if principal is not None else None
    stream = registry.open(name, downstream, fence)
    if stream is None:
        why = registry.full(name) or "no stream place is free"
        log.info("mcp.stream_refused", downstream=downstream, principal=name,
                 limit=registry.limit, per_principal=registry.per_principal)  # fmt: skip
        return _busy(why, downstream)
    request[_STREAM_KEY] = stream
    expiry = at_expiry(principal, lambda: stream.end("token_expired"))  # an OAuth token's exp
    try:
        return await relay()
    finally:
        if expiry is not None:
            expiry.cancel()
        registry.close(stream)


async def _lease_ended(request: web.Request, stream: OpenStream) -> None:
    """Until the stream's lease no longer holds (the store says so). A store that does not
    answer keeps the stream: it ends on the first answer that refuses the lease."""
    store = request.app[STORE]
    while True:
        await asyncio.sleep(LEASE_CHECK_S)
        try:
            await store.check_fence(stream.fence)
        except ClaimRefused as exc:
            stream.end(exc.code)
            return
        except FencegateError:
            continue


async def until_over(request: web.Request, agent_gone: Awaitable[None]) -> None:
    """Until the agent left (``agent_gone``) or, for a stream ``hold`` let in, its lease
    ended or a reload ended it (logged ``mcp.stream_ended``)."""
    stream: OpenStream | None = request.get(_STREAM_KEY)
    gone = asyncio.ensure_future(agent_gone)
    if stream is None:
        await gone
        return
    waits = {gone, asyncio.ensure_future(stream.over.wait()),
             asyncio.ensure_future(_lease_ended(request, stream))}  # fmt: skip
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        for wait in waits:
            with contextlib.suppress(asyncio.CancelledError):
                await wait
    if stream.reason is not None:
        log.info("mcp.stream_ended", downstream=stream.downstream, principal=stream.principal,
                 task=stream.fence.task_id, reason=stream.reason)  # fmt: skip
