"""Task and effect events: one hub per gateway process, ``GET /v1/events`` (server-sent
events), and the long-polls that wait on them (``waitFor``, a queue claim's ``waitMs``).

The store appends one event per change of a task's state or revision and of an effect's state,
in the same atomic step as the change, at an opaque position (``Store.read_events``). The hub
reads the events after its position every ``events.poll_ms``, only while someone listens, and
hands each batch to every subscriber and long-poll of this process. Several gateways on one
store each read the store, so every one of them sees every event.

A stream delivers a chain of positions from where it started: a batch whose ``after`` is the
stream's position continues it; any other batch only wakes it, and it reads the store itself
from its own position (catching up after a ``Last-Event-ID``, after a batch it missed while its
client was slow, or after the hub restarted). Positions are compared for equality only: a
stream never skips or repeats an event, whatever the hub did.

A long-poll re-reads what it waits for when an event about it arrives, and at least every
``_RECHECK_S`` (a lease running out, an epoch bump: no event says the task became claimable).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from fencegate.gateway.config import EventsConfig
from fencegate.gateway.principals import principal_of
from fencegate.gateway.state import CONFIG, EVENTS, STORE
from fencegate.ledger.errors import (
    BadRequest,
    EventsGone,
    FencegateError,
    StoreUnavailable,
    TooManyConnections,
)
from fencegate.ledger.events import Event
from fencegate.ledger.store import Store

__all__ = ["RECHECK_S", "Batch", "EventHub", "Subscription", "Waiter", "routes", "trim_loop"]

log = structlog.get_logger("fencegate.events")

routes = web.RouteTableDef()

#: A long-poll looks again at least this often, events or not.
RECHECK_S = 1.0
#: Batches a stream holds for its client; past it the oldest go and it reads the store itself.
_QUEUED = 64
#: Most characters of a position a client may send back (``Last-Event-ID``, ``after``).
_MAX_POSITION = 200
#: Event types a stream may carry (``event:`` of the SSE frame).
_TYPES = frozenset({"task", "effect"})


@dataclass(frozen=True, slots=True)
class Batch:
    """Events the hub read: those after ``after``, oldest first; ``next`` continues them."""

    after: str
    events: tuple[Event, ...]
    next: str


class Subscription:
    """One ``GET /v1/events`` stream's share of the hub's batches."""

    def __init__(self) -> None:
        self.batches: deque[Batch] = deque()
        #: Batches dropped for a slow client: the stream must read the store itself.
        self.dropped = False
        self.closed = False
        self._wake = asyncio.Event()

    def push(self, batch: Batch) -> None:
        if len(self.batches) >= _QUEUED:
            self.batches.popleft()
            self.dropped = True
        self.batches.append(batch)
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def wait(self, seconds: float) -> None:
        """Until a batch is queued, the hub closes, or ``seconds`` passed."""
        if self.batches or self.closed:
            return
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()


class Waiter:
    """One long-poll: woken by an event about its task (``task_id``) or, with ``task_id``
    None, by any task becoming READY (a queue claim: events do not name the queue)."""

    def __init__(self, task_id: str | None) -> None:
        self.task_id = task_id
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def wait(self, seconds: float) -> None:
        """Until woken or ``seconds`` (at most ``RECHECK_S``) passed; then re-arm."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(min(seconds, RECHECK_S), 0)):
                await self._wake.wait()
        self._wake.clear()


class EventHub:
    """Reads the store's events while anyone listens and hands them out."""

    def __init__(self, store: Store, config: EventsConfig, max_waiters: int) -> None:
        self._store = store
        self._config = config
        self._max_waiters = max_waiters
        self._subscriptions: set[Subscription] = set()
        self._by_task: dict[str, set[Waiter]] = {}
        self._for_ready: set[Waiter] = set()
        self._waiters = 0
        self._cursor: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failing = False

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    @property
    def waiters(self) -> int:
        return self._waiters

    # --- listeners ------------------------------------------------------------------------

    def subscribe(self) -> Subscription:
        """A new stream's subscription; ``TooManyConnections`` past ``max_subscribers``."""
        limit = self._config.max_subscribers
        if len(self._subscriptions) >= limit:
            raise TooManyConnections(
                f"events.max_subscribers ({limit}) event streams are open in this gateway; "
                "try again later",
                retryAfterMs=1000,
            )
        subscription = Subscription()
        if self._closed:
            subscription.close()
        self._subscriptions.add(subscription)
        self._listen()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)

    @contextlib.contextmanager
    def waiting(self, task_id: str | None) -> Iterator[Waiter | None]:
        """A ``Waiter`` for the duration of the block, or None past ``tasks.max_waiters``
        (the long-poll then answers at once)."""
        if self._waiters >= self._max_waiters or self._closed:
            yield None
            return
        waiter = Waiter(task_id)
        group = self._for_ready if task_id is None else self._by_task.setdefault(task_id, set())
        group.add(waiter)
        self._waiters += 1
        self._listen()
        try:
            yield waiter
        finally:
            self._waiters -= 1
            group.discard(waiter)
            if task_id is not None and not group:
                self._by_task.pop(task_id, None)

    def _listening(self) -> bool:
        return bool(self._subscriptions) or self._waiters > 0

    def _listen(self) -> None:
        if self._closed or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fencegate-events")

    # --- the poll loop --------------------------------------------------------------------

    async def _run(self) -> None:
        interval = self._config.poll_ms / 1000
        try:
            while self._listening() and not self._closed:
                await self._poll()
                await asyncio.sleep(interval)
        finally:
            self._cursor = None  # the next listener starts from the end, as it was then

    async def _poll(self) -> None:
        try:
            if self._cursor is None:
                _, self._cursor = await self._store.read_events(None, 1)
            while True:
                after = self._cursor
                events, following = await self._store.read_events(after, self._config.batch)
                self._cursor = following
                if events:
                    self._publish(Batch(after, tuple(events), following))
                if len(events) < self._config.batch:
                    break
            if self._failing:
                self._failing = False
                log.info("events.poll_recovered")
        except EventsGone:
            # This gateway fell behind the retained history: go on from the end. Streams
            # notice the gap (the next batch does not continue them) and read for themselves.
            self._cursor = None
        except FencegateError as exc:
            if not self._failing:
                self._failing = True
                log.warning("events.poll_failed", code=exc.code, reason=exc.detail)
        except Exception:
            log.exception("events.poll_crashed")

    def _publish(self, batch: Batch) -> None:
        for subscription in self._subscriptions:
            subscription.push(batch)
        for event in batch.events:
            body = event.body
            if body.get("type") != "task":
                continue
            for waiter in self._by_task.get(str(body.get("taskId")), ()):
                waiter.wake()
            if body.get("state") == "READY":
                for waiter in self._for_ready:
                    waiter.wake()

    async def close(self) -> None:
        """Stop polling and end every stream (the gateway is shutting down)."""
        self._closed = True
        for subscription in self._subscriptions:
            subscription.close()
        for group in (*self._by_task.values(), self._for_ready):
            for waiter in group:
                waiter.wake()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def trim_loop(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: trim the store's event history to ``events.retain`` every
    ``events.trim_interval_ms`` (never with 0)."""
    config = app[CONFIG].events
    stopping = asyncio.Event()

    async def run() -> None:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(config.trim_interval_ms / 1000):
                    await stopping.wait()
            if stopping.is_set():
                return
            try:
                removed = await app[STORE].trim_events(config.retain)
            except FencegateError as exc:
                log.warning("events.trim_failed", code=exc.code, reason=exc.detail)
                continue
            except Exception:
                log.exception("events.trim_crashed")
                continue
            if removed:
                log.info("events.trimmed", removed=removed, retain=config.retain)

    task = asyncio.get_running_loop().create_task(run()) if config.trim_interval_ms else None
    yield
    stopping.set()
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            async with asyncio.timeout(5):
                await task


# --- GET /v1/events -----------------------------------------------------------------------


def _position(raw: str, name: str) -> str:
    if not raw or len(raw) > _MAX_POSITION or not raw.isprintable():
        raise BadRequest(f"{name}: not an event position this gateway gave out")
    return raw


def _resume_from(request: web.Request) -> str | None:
    """Where the stream starts: ``Last-Event-ID`` (a reconnecting ``EventSource`` sends it,
    and it is newer than the URL's ``after``), else ``?after=``, else None (from now)."""
    unknown = set(request.query) - {"after"}
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(sorted(unknown))}")
    if len(request.query.getall("after", [])) > 1:
        raise BadRequest("after: given more than once")
    header = request.headers.getall("Last-Event-ID", [])
    if len(header) > 1:
        raise BadRequest("Last-Event-ID: given more than once")
    if header and header[0].strip():
        return _position(header[0].strip(), "Last-Event-ID")
    after = request.query.get("after")
    return _position(after, "after") if after is not None else None


def _frame(event: Event) -> bytes:
    kind = event.body.get("type")
    name = kind if isinstance(kind, str) and kind in _TYPES else "message"
    data = json.dumps(event.body, separators=(",", ":"))
    return f"id: {event.position}\nevent: {name}\ndata: {data}\n\n".encode()


def _visible(body: Mapping[str, Any], prefixes: tuple[str, ...] | None) -> bool:
    if prefixes is None:
        return True
    task_id = body.get("taskId")
    return isinstance(task_id, str) and task_id.startswith(prefixes)


class _Stream:
    """One client's stream: its position, and how it writes."""

    def __init__(self, response: web.StreamResponse, position: str,
                 prefixes: tuple[str, ...] | None) -> None:  # fmt: skip
        self.response = response
        self.position = position
        self.prefixes = prefixes

    async def send(self, events: Iterable[Event], following: str) -> None:
        out = bytearray()
        for event in events:
            if _visible(event.body, self.prefixes):
                out += _frame(event)
        if following != self.position and not out:
            # Nothing this client may see moved it: still hand it the position to resume at.
            out += f"id: {following}\n\n".encode()
        self.position = following
        if out:
            await self.response.write(bytes(out))


async def _catch_up(store: Store, stream: _Stream, batch: int) -> None:
    """Read the store from the stream's own position until nothing is left."""
    while True:
        events, following = await store.read_events(stream.position, batch)
        await stream.send(events, following)
        if len(events) < batch:
            return


@routes.get("/v1/events")
async def events_stream(request: web.Request) -> web.StreamResponse:
    """Task and effect events as server-sent events (docs/PROTOCOL.md, "Events")."""
    config = request.app[CONFIG].events
    store = request.app[STORE]
    hub = request.app[EVENTS]
    after = _resume_from(request)
    principal = principal_of(request)
    prefixes = principal.scope.task_prefixes if principal is not None else None
    if after is None:
        _, start = await store.read_events(None, 1)
        first: list[Event] = []
    else:
        # Read once before answering, so a position past the history is a 410, not a stream.
        first, start = await store.read_events(after, config.batch)
    subscription = hub.subscribe()
    try:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        stream = _Stream(response, after if after is not None else start, prefixes)
        await response.write(b"retry: 1000\n\n")
        await stream.send(first, start)
        if after is None:
            await response.write(f"id: {start}\n\n".encode())
        elif len(first) >= config.batch:
            await _catch_up(store, stream, config.batch)
        with contextlib.suppress(ConnectionResetError):
            await _follow(request, stream, subscription)
        return response
    finally:
        hub.unsubscribe(subscription)


async def _follow(request: web.Request, stream: _Stream, subscription: Subscription) -> None:
    config = request.app[CONFIG].events
    store = request.app[STORE]
    heartbeat = config.heartbeat_ms / 1000
    while not subscription.closed:
        await subscription.wait(heartbeat)
        if subscription.closed:
            return
        woken = bool(subscription.batches) or subscription.dropped
        behind = subscription.dropped
        subscription.dropped = False
        while subscription.batches:
            batch = subscription.batches.popleft()
            if batch.after == stream.position:
                await stream.send(batch.events, batch.next)
            else:
                behind = True
        try:
            if behind:
                await _catch_up(store, stream, config.batch)
            elif not woken:
                await stream.response.write(b": keep-alive\n\n")
        except EventsGone:
            return  # the client reconnects from its Last-Event-ID and is told 410
        except StoreUnavailable:
            subscription.dropped = True  # try again on the next wake
