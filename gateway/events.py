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

A long-poll re-reads what it waits for when an event about it arrives (a ``waitFor``: any
event of its task; a queue claim: a task of its queue becoming READY), and at least every
``RECHECK_S`` (a lease running out, an epoch bump: no event says the task became claimable).
Long-polls and streams are bounded per process and per principal (``tasks.max_waiters``,
``tasks.max_waiters_per_principal``, ``events.max_subscribers``,
``events.max_subscribers_per_principal``; every anonymous caller is one principal); past a
bound the request is 503 ``TOO_MANY_CONNECTIONS`` with ``Retry-After``. On shutdown every
long-poll answers at once and every stream ends (``EventHub.close``).

``cascade_loop`` carries on the cancel cascades larger than ``tasks.max_cascade``
(``Store.continue_cascades``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from fencegate.gateway.auth import allowed_roles
from fencegate.gateway.config import EventsConfig, TasksConfig
from fencegate.gateway.principals import (
    Principal,
    at_expiry,
    is_oauth_name,
    principal_of,
    scope_refusal,
)
from fencegate.gateway.state import CONFIG, EVENTS, STORE
from fencegate.ledger.errors import (
    BadRequest,
    EventsGone,
    FencegateError,
    Forbidden,
    StoreUnavailable,
    TooManyConnections,
    Unauthenticated,
)
from fencegate.ledger.events import Event
from fencegate.ledger.store import Store

__all__ = [
    "CASCADE_BUSY_S",
    "CASCADE_IDLE_S",
    "RECHECK_S",
    "Batch",
    "EventHub",
    "Subscription",
    "Waiter",
    "after_reload",
    "cascade_loop",
    "routes",
    "trim_loop",
]

log = structlog.get_logger("fencegate.events")

routes = web.RouteTableDef()

#: A long-poll looks again at least this often, events or not.
RECHECK_S = 1.0
#: Batches a stream holds for its client; past it the oldest go and it reads the store itself.
_QUEUED = 64
#: A position a client may send back (``Last-Event-ID``, ``after``): what every store gives
#: out, two runs of ASCII digits (``str.isdigit`` would take other scripts' digits too), or
#: the cluster store's vector (``ledger.cluster_feed``: ``c1.`` and base64url), bounded here
#: by what one header line may carry; the store checks it exactly against its bucket count.
_POSITION = re.compile(r"[0-9]{1,20}-[0-9]{1,20}|c1\.[A-Za-z0-9_-]{1,8000}")
#: Seconds a refused long-poll or stream is told to wait (``Retry-After``).
_RETRY_AFTER_MS = 1_000
#: ``cascade_loop``: the pause after a step that cancelled a full batch (more may be left),
#: and after one that did not (nothing was pending, or it finished).
CASCADE_BUSY_S = 1.0
CASCADE_IDLE_S = 3.0
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

    def __init__(
        self, principal: str | None = None, prefixes: tuple[str, ...] | None = None
    ) -> None:
        #: Whose stream it is (None: an anonymous caller), for the per-principal bound.
        self.principal = principal
        #: The principal's ``task_prefixes`` (None: every task): what the stream may show,
        #: replaced by a reload (``EventHub.reload``) from the next event on.
        self.prefixes = prefixes
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

    def catch_up(self) -> None:
        """The hub (re)started its cursor: what came between the stream's own position and
        it is in no batch, so the stream reads the store itself once."""
        self.dropped = True
        self._wake.set()

    async def wait(self, seconds: float) -> None:
        """Until a batch is queued (or the stream must catch up), the hub closes, or
        ``seconds`` passed."""
        if self.batches or self.dropped or self.closed:
            return
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()


class Waiter:
    """One long-poll: woken by an event about its task (``task_id``) or, for a queue claim
    (``queue``), by a task of that queue becoming READY; or a duplicate waiting for an
    in-flight effect (``effect_id``, ``gateway.effect_waiters``), by an event of that effect.
    ``closed``: the gateway is shutting down, the long-poll must answer now."""

    def __init__(
        self,
        task_id: str | None,
        queue: str | None = None,
        principal: str | None = None,
        effect_id: str | None = None,
    ) -> None:
        self.task_id = task_id
        self.queue = queue
        self.principal = principal
        self.effect_id = effect_id
        self.closed = False
        #: Why the long-poll must be refused now (a reload removed or narrowed its principal).
        self.refusal: FencegateError | None = None
        self._wake = asyncio.Event()

    @property
    def woken(self) -> bool:
        """Woken since it last waited (or closed)."""
        return self._wake.is_set()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    def refuse(self, error: FencegateError) -> None:
        """End the long-poll with ``error`` (``check`` raises it once it wakes)."""
        self.refusal = error
        self.close()

    def check(self) -> None:
        """Raise the refusal a reload left (``refuse``); the long-poll calls it after every
        wait, before it reads or claims anything more."""
        if self.refusal is not None:
            raise self.refusal

    async def wait(self, seconds: float) -> bool:
        """Until woken or ``seconds`` (at most ``RECHECK_S``, but for an effect's waiter:
        only an event tells it something) passed; then re-arm. Returns at once once
        ``closed``; whether it was woken."""
        if self.closed:
            return True
        if self.effect_id is None:
            seconds = min(seconds, RECHECK_S)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(seconds, 0)):
                await self._wake.wait()
        woken = self._wake.is_set()
        self._wake.clear()
        return woken


class EventHub:
    """Reads the store's events while anyone listens and hands them out."""

    def __init__(self, store: Store, config: EventsConfig, tasks: TasksConfig) -> None:
        self._store = store
        self._config = config
        self._tasks = tasks
        self._subscriptions: set[Subscription] = set()
        self._subscribed: dict[str | None, int] = {}
        self._by_task: dict[str, set[Waiter]] = {}
        self._by_queue: dict[str, set[Waiter]] = {}
        self._by_effect: dict[str, set[Waiter]] = {}
        self._waiters = 0
        self._waiting: dict[str | None, int] = {}
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

    def subscribe(
        self, principal: str | None = None, prefixes: tuple[str, ...] | None = None
    ) -> Subscription:
        """A new stream's subscription for ``principal`` (None: anonymous) limited to
        ``prefixes``;
        ``TooManyConnections`` past ``events.max_subscribers`` or
        ``events.max_subscribers_per_principal``."""
        limit = self._config.max_subscribers
        if len(self._subscriptions) >= limit:
            refusal = (f"events.max_subscribers ({limit}) event streams are open in this "
                       "gateway")  # fmt: skip
            self._refuse("events.max_subscribers", refusal, principal=principal)
        own = self._config.max_subscribers_per_principal
        if self._subscribed.get(principal, 0) >= own:
            refusal = (f"events.max_subscribers_per_principal ({own}) event streams of "
                       f"{_whose(principal)} are open in this gateway")  # fmt: skip
            self._refuse("events.max_subscribers_per_principal", refusal, principal=principal)
        subscription = Subscription(principal, prefixes)
        if self._closed:
            subscription.close()
        self._subscriptions.add(subscription)
        self._subscribed[principal] = self._subscribed.get(principal, 0) + 1
        self._listen()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        if subscription not in self._subscriptions:
            return
        self._subscriptions.discard(subscription)
        _leave(self._subscribed, subscription.principal)

    @contextlib.contextmanager
    def waiting(
        self,
        *,
        principal: str | None,
        task_id: str | None = None,
        queue: str | None = None,
        effect_id: str | None = None,
        holder: Principal | None = None,
    ) -> Iterator[Waiter]:
        """A ``Waiter`` for the duration of the block: a ``waitFor`` of ``task_id``, a
        claim from ``queue`` or a duplicate waiting for ``effect_id``'s outcome
        (``gateway.effect_waiters``), by ``principal`` (None: anonymous). ``TooManyConnections``
        (logged ``wait.refused``) past ``tasks.max_waiters`` or
        ``tasks.max_waiters_per_principal``. Once the hub is closed the waiter is too: the
        long-poll answers at once. ``holder``: the principal, whose OAuth token's ``exp``
        refuses the long-poll (401) if it comes first."""
        assert [task_id, queue, effect_id].count(None) == 2
        limit = self._tasks.max_waiters
        target = (
            {"task": task_id}
            if task_id is not None
            else {"queue": queue}
            if queue is not None
            else {"effect_id": effect_id}
        )
        if self._waiters >= limit:
            refusal = f"tasks.max_waiters ({limit}) long-polls are waiting in this gateway"
            self._refuse("tasks.max_waiters", refusal, principal=principal, **target)
        own = self._tasks.max_waiters_per_principal
        if self._waiting.get(principal, 0) >= own:
            refusal = (f"tasks.max_waiters_per_principal ({own}) long-polls of "
                       f"{_whose(principal)} are waiting in this gateway")  # fmt: skip
            self._refuse("tasks.max_waiters_per_principal", refusal, principal=principal,
                         **target)  # fmt: skip
        waiter = Waiter(task_id, queue, principal, effect_id)
        if task_id is not None:
            groups, key = self._by_task, task_id
        elif queue is not None:
            groups, key = self._by_queue, queue
        else:
            assert effect_id is not None
            groups, key = self._by_effect, effect_id
        group = groups.setdefault(key, set())
        group.add(waiter)
        self._waiters += 1
        self._waiting[principal] = self._waiting.get(principal, 0) + 1
        if self._closed:
            waiter.close()
        else:
            self._listen()
        expiry = at_expiry(
            holder, lambda: waiter.refuse(Unauthenticated("the token expired while waiting"))
        )
        try:
            yield waiter
        finally:
            if expiry is not None:
                expiry.cancel()
            self._waiters -= 1
            _leave(self._waiting, principal)
            group.discard(waiter)
            if not group and groups.get(key) is group:
                del groups[key]

    @staticmethod
    def _refuse(limit: str, refusal: str, **fields: Any) -> None:
        kind = "events.refused" if limit.startswith("events.") else "wait.refused"
        log.info(kind, limit=limit, **fields)
        raise TooManyConnections(f"{refusal}; try again later", retryAfterMs=_RETRY_AFTER_MS)

    def wake_effect(self, effect_id: str) -> None:
        """Wake the waiters of ``effect_id``: this process recorded its outcome (no need to
        wait for the event to come round)."""
        for waiter in self._by_effect.get(effect_id, ()):
            waiter.wake()

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
                # Events before this end were not seen: each effect's waiter reads its record
                # once (long-polls read theirs every RECHECK_S anyway).
                for group in self._by_effect.values():
                    for waiter in group:
                        waiter.wake()
                # Nor by the streams, each of which read its own start before: an event
                # between that and this end would otherwise wait for the next one.
                for subscription in self._subscriptions:
                    subscription.catch_up()
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
            # This gateway fell behind the retained history, or its position is ahead of what
            # the store now has (it lost events it had issued): go on from the end. Streams
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
            if body.get("type") == "effect":
                for waiter in self._by_effect.get(str(body.get("effectId")), ()):
                    waiter.wake()
            if body.get("type") != "task":
                continue
            for waiter in self._by_task.get(str(body.get("taskId")), ()):
                waiter.wake()
            if body.get("state") != "READY":
                continue
            # A queue claim is woken by a task of its queue becoming READY. An event without
            # the ``queue`` key (a store that does not say) wakes every queue's claims.
            if "queue" not in body:
                for group in self._by_queue.values():
                    for waiter in group:
                        waiter.wake()
                continue
            queue = body["queue"]
            for waiter in self._by_queue.get(queue, ()) if isinstance(queue, str) else ():
                waiter.wake()

    def reload(self, principals: Iterable[Principal], *, keep_oauth: bool = False) -> None:
        """The ``[auth]`` principals changed (SIGHUP, ``cli.reload_auth``): every stream and
        long-poll is judged again as a new request would be (``after_reload``). A stream of
        a principal that is gone (or may no longer read events) ends; the others show what
        the new ``task_prefixes`` allow from the next event on. A long-poll that would now be
        refused answers that refusal at once (401 for a principal that is gone). OAuth
        principals are in no list: ``keep_oauth`` (``[auth.oauth]`` unchanged) keeps theirs,
        else they end as a removed principal's (the client comes back with its token)."""
        by_name = {principal.name: principal for principal in principals}
        ended = refused = 0
        for subscription in self._subscriptions:
            if subscription.principal is None:
                continue
            if keep_oauth and is_oauth_name(subscription.principal):
                continue
            verdict = after_reload(by_name, subscription.principal, route=_EVENTS_ROUTE)
            if isinstance(verdict, FencegateError):
                subscription.close()
                ended += 1
            else:
                subscription.prefixes = verdict.scope.task_prefixes
        for group in (*self._by_task.values(), *self._by_queue.values()):
            for waiter in group:
                if waiter.principal is None or waiter.closed:
                    continue
                if keep_oauth and is_oauth_name(waiter.principal):
                    continue
                route = _WAIT_ROUTE if waiter.task_id is not None else _QUEUE_ROUTE
                verdict = after_reload(by_name, waiter.principal, route=route,
                                       task_id=waiter.task_id)  # fmt: skip
                if isinstance(verdict, FencegateError):
                    waiter.refuse(verdict)
                    refused += 1
        if ended or refused:
            log.info("events.reloaded", streams_ended=ended, long_polls_refused=refused)

    async def close(self) -> None:
        """Stop polling and end every stream (the gateway is shutting down)."""
        self._closed = True
        for subscription in self._subscriptions:
            subscription.close()
        for group in (*self._by_task.values(), *self._by_queue.values(),
                      *self._by_effect.values()):  # fmt: skip
            for waiter in group:
                waiter.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


_EVENTS_ROUTE = ("GET", "/v1/events")
_WAIT_ROUTE = ("GET", "/v1/tasks/{task_id}")
_QUEUE_ROUTE = ("POST", "/v1/queues/{queue}/claim")


def after_reload(
    principals: Mapping[str, Principal],
    name: str,
    *,
    route: tuple[str, str],
    task_id: str | None = None,
    downstream: str | None = None,
) -> Principal | FencegateError:
    """What a reload of ``principals`` means for a stream or long-poll that ``name`` opened
    on ``route`` (for ``task_id``, on ``downstream``): the principal as it now stands, or the
    refusal a new request of it would get (401 gone, 403 its roles or scope no longer allow
    it; a queue claim is not for a principal limited to ``task_prefixes``, as ``claim_next``
    says)."""
    principal = principals.get(name)
    if principal is None:
        return Unauthenticated(f"principal {name!r} was removed from [auth] by a reload")
    if not principal.roles & allowed_roles(route):
        return Forbidden(f"{name!r} may no longer call {route[0]} {route[1]} (reloaded [auth])")
    reason = scope_refusal(principal.scope, downstream=downstream, task_id=task_id)
    if reason is None and route == _QUEUE_ROUTE and principal.scope.task_prefixes is not None:
        reason = "a principal limited to task_prefixes cannot claim from a queue"
    if reason is not None:
        return Forbidden(f"{name!r}: {reason} (reloaded [auth])")
    return principal


def _whose(principal: str | None) -> str:
    return repr(principal) if principal is not None else "anonymous callers"


def _leave(counts: dict[str | None, int], principal: str | None) -> None:
    left = counts.get(principal, 0) - 1
    if left > 0:
        counts[principal] = left
    else:
        counts.pop(principal, None)


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


async def cascade_loop(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: carry on the cancel cascades larger than ``tasks.max_cascade``
    (``Store.continue_cascades``, one atomic step of up to that many tasks at a time): again
    after ``CASCADE_BUSY_S`` while a step cancels a full batch, else after
    ``CASCADE_IDLE_S``. Every gateway on a store runs it; the store's steps are atomic."""
    limit = app[CONFIG].tasks.max_cascade
    stopping = asyncio.Event()

    async def run() -> None:
        pause = CASCADE_IDLE_S
        failing = False
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await stopping.wait()
            if stopping.is_set():
                return
            pause = CASCADE_IDLE_S
            try:
                cancelled = await app[STORE].continue_cascades(limit)
            except FencegateError as exc:
                if not failing:
                    failing = True
                    log.warning("tasks.cascade_failed", code=exc.code, reason=exc.detail)
                continue
            except Exception:
                log.exception("tasks.cascade_crashed")
                continue
            failing = False
            if cancelled:
                log.info("tasks.cascade_continued", cancelled=cancelled, limit=limit)
            if cancelled >= limit:
                pause = CASCADE_BUSY_S

    task = asyncio.get_running_loop().create_task(run(), name="fencegate-cascades")
    yield
    stopping.set()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
        async with asyncio.timeout(5):
            await task


# --- GET /v1/events -----------------------------------------------------------------------


def _position(raw: str, name: str) -> str:
    if not _POSITION.fullmatch(raw):
        raise BadRequest(
            f"{name}: not an event position this gateway gave out "
            "(two runs of 1 to 20 digits 0-9 joined by '-', or 'c1.' and base64url)",
            fields=[name],
        )
    return raw


def _resume_from(request: web.Request) -> tuple[str | None, str]:
    """Where the stream starts: ``Last-Event-ID`` (a reconnecting ``EventSource`` sends it,
    and it is newer than the URL's ``after``), else ``?after=``, else None (from now); and
    the name of where it came from (for a refusal)."""
    unknown = set(request.query) - {"after"}
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(sorted(unknown))}")
    if len(request.query.getall("after", [])) > 1:
        raise BadRequest("after: given more than once")
    header = request.headers.getall("Last-Event-ID", [])
    if len(header) > 1:
        raise BadRequest("Last-Event-ID: given more than once")
    if header and header[0].strip():
        return _position(header[0].strip(), "Last-Event-ID"), "Last-Event-ID"
    after = request.query.get("after")
    return (_position(after, "after") if after is not None else None), "after"


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


class _Stalled(Exception):
    """A write to a stream did not complete within ``events.write_timeout_ms``."""


class _Stream:
    """One client's stream: its position, and how it writes."""

    def __init__(self, response: web.StreamResponse, position: str,
                 subscription: Subscription, write_timeout_s: float) -> None:  # fmt: skip
        self.response = response
        self.position = position
        #: Its ``prefixes`` are read at every send: a reload's apply from the next event.
        self.subscription = subscription
        self.write_timeout_s = write_timeout_s

    async def write(self, data: bytes) -> None:
        """Write ``data``; ``_Stalled`` when the client does not take it in time (it stopped
        reading: its socket's buffers are full)."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self.response.write(data)
        except TimeoutError:
            raise _Stalled from None

    async def send(self, events: Iterable[Event], following: str) -> None:
        out = bytearray()
        prefixes = self.subscription.prefixes
        for event in events:
            if _visible(event.body, prefixes):
                out += _frame(event)
        if following != self.position and not out:
            # Nothing this client may see moved it: still hand it the position to resume at.
            out += f"id: {following}\n\n".encode()
        if out:
            await self.write(bytes(out))
        self.position = following


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
    after, source = _resume_from(request)
    principal = principal_of(request)
    prefixes = principal.scope.task_prefixes if principal is not None else None
    name = principal.name if principal is not None else None
    if after is None:
        _, start = await store.read_events(None, 1)
        first: list[Event] = []
    else:
        # Read once before answering, so a position past the history is a 410, not a stream.
        try:
            first, start = await store.read_events(after, config.batch)
        except BadRequest as exc:  # well formed, but out of the store's range
            detail = f"{source}: not an event position this store gave out (out of its range)"
            raise BadRequest(detail, fields=[source]) from exc
    subscription = hub.subscribe(name, prefixes)
    expiry = at_expiry(principal, subscription.close)  # an OAuth token's exp ends the stream
    try:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        position = after if after is not None else start
        stream = _Stream(response, position, subscription, config.write_timeout_ms / 1000)
        try:
            await stream.write(b"retry: 1000\n\n")
            await stream.send(first, start)
            if after is None:
                await stream.write(f"id: {start}\n\n".encode())
            elif len(first) >= config.batch:
                await _catch_up(store, stream, config.batch)
            with contextlib.suppress(ConnectionResetError):
                await _follow(request, stream, subscription)
        except _Stalled:
            # The client stopped reading: drop the connection (what it was sent stays in
            # its buffers; it resumes from the last id it read).
            log.info("events.stream_stalled", principal=name, position=stream.position,
                     write_timeout_ms=config.write_timeout_ms)  # fmt: skip
            hub.unsubscribe(subscription)
            if request.transport is not None:
                request.transport.abort()
        return response
    finally:
        if expiry is not None:
            expiry.cancel()
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
                await stream.write(b": keep-alive\n\n")
        except EventsGone:
            return  # the client reconnects from its Last-Event-ID and is told 410
        except StoreUnavailable:
            subscription.dropped = True  # try again on the next wake
