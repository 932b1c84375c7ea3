"""The client: one connection pool to one gateway, for schedulers, workers and operators.

Scheduler side: ``put_task`` (create or revise; ``queue``, ``priority``, ``depends_on``),
``get_task``, ``wait_committed``, ``cancel_task``, ``get_epoch``, ``bump_epoch``,
``pause_claims``, ``resume_claims``, ``events`` (task and effect changes as they happen).
Worker side: ``claim`` (a guarded lease as an ``async with``: renewed in the background,
the body cancelled when it is lost), ``acquire`` (a bare lease you renew yourself) and
``claim_next`` (the best task of a queue, as a bare lease; ``lease.hold()`` guards it).
Client side (no task queue, no lease): ``request`` sends one call through ``/proxy`` with an
``Idempotency-Key``, so that it happens at most once whatever the retries (a keyed effect).
Operator side: ``list_effects`` / ``iter_effects``, ``get_effect``, ``resolve_effect``,
``approve_effect``, ``reconcile_effect``, ``get_rollout``, ``get_store_stats``.

Every refusal of the gateway is raised as its typed exception (``fencegate.errors``);
a gateway that does not answer is ``GatewayUnreachable`` (``ClientTimeout`` when the SDK's
own timeout fired first).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import quote, urlencode

import aiohttp
from yarl import URL

from fencegate._http import (
    RawAnswer,
    describe_exception,
    gateway_problem,
    proxied_downstream,
    task_path,
)
from fencegate.errors import ClientTimeout, GatewayUnreachable, ProblemError, TooManyConnections
from fencegate.lease import (
    _NO_JSON,
    MONOTONIC,
    SAFE_METHODS,
    ClaimScope,
    Clock,
    Lease,
    ProxyResponse,
    prefer_wait,
    proxy_call,
)

__all__ = ["TOKEN_ENV", "Client", "Epoch", "StreamEvent", "TaskRecord", "idempotency_key_header"]

#: Where ``Client`` (and the operator CLI) find the gateway credential when none is given.
TOKEN_ENV = "FENCEGATE_TOKEN"
#: Least seconds between the starts of two long-polls of one ``wait_for`` or ``claim_next``
#: (a gateway that answers at once, e.g. with ``tasks.max_wait_ms = 0``, is not hammered).
MIN_POLL_S = 0.25
#: Seconds to back off after a ``TOO_MANY_CONNECTIONS`` that says no ``Retry-After``.
_BUSY_S = 1.0
#: The longest idempotency key the gateway accepts (docs/PROTOCOL.md, "Keyed effects").
MAX_KEY_CHARS = 255


def idempotency_key_header(key: str) -> str:
    """``key`` as the value of the ``Idempotency-Key`` header: a Structured-Field string
    (RFC 8941: quoted, ``\\`` and ``"`` escaped), which the gateway reads back as ``key``
    exactly. A key the gateway would refuse (empty, longer than 255 characters, or with a
    character outside printable ASCII: letters, digits, punctuation and space) raises
    ``ValueError`` here, before anything is sent."""
    if (
        not isinstance(key, str)
        or not 1 <= len(key) <= MAX_KEY_CHARS
        or not all(" " <= c <= "~" for c in key)
    ):
        raise ValueError(
            f"idempotency_key {key!r}: expected 1 to {MAX_KEY_CHARS} printable ASCII characters"
        )
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _busy_pause(exc: TooManyConnections) -> float:
    """How long to wait after the gateway refused a long-poll: its ``Retry-After`` (never
    less), plus up to a quarter more so refused clients do not all come back at once."""
    after = exc.retry_after
    return (after if after is not None and after > 0 else _BUSY_S) * random.uniform(1.0, 1.25)


async def _pause(seconds: float, deadline: float) -> None:
    """Sleep ``seconds``, but not past ``deadline`` (the loop's clock)."""
    loop = asyncio.get_running_loop()
    wait = min(seconds, deadline - loop.time())
    if wait > 0:
        await asyncio.sleep(wait)


@dataclass(frozen=True, slots=True)
class Epoch:
    """``GET /v1/epoch``: the global scheduler epoch and whether claims are paused.
    ``raw`` is the whole answer (newer fields too)."""

    scheduler_epoch: int
    claims_paused: bool
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Epoch:
        return cls(int(body["schedulerEpoch"]), bool(body["claimsPaused"]), dict(body))


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """The task record of the contract. ``raw`` is the whole answer (newer fields too);
    ``created`` is True only on the ``put_task`` that created the task."""

    task_id: str
    state: str
    revision: int
    input_digest: str
    claim_generation: int
    attempt_id: str | None
    owner: str | None
    lease_expires_at: int | None
    cancel_generation: int
    scheduler_epoch: int | None
    commit: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    created: bool = False

    @property
    def queue(self) -> str | None:
        """The queue ``claim_next`` finds the task in (None: claimed by id only)."""
        value = self.raw.get("queue")
        return value if isinstance(value, str) else None

    @property
    def priority(self) -> int:
        return int(self.raw.get("priority") or 0)

    @property
    def depends_on(self) -> tuple[str, ...]:
        return tuple(self.raw.get("dependsOn") or ())

    @property
    def dependencies(self) -> list[dict[str, Any]]:
        """Provenance: ``{taskId, commitId, resultDigest}`` of each dependency's commit the
        current revision builds on (all of them unless the task is WAITING)."""
        return [dict(dep) for dep in self.raw.get("dependencies") or ()]

    @property
    def cost(self) -> dict[str, float]:
        """What the current (or last) attempt reported spending so far, per unit."""
        return dict(self.raw.get("cost") or {})

    @classmethod
    def from_json(cls, body: Mapping[str, Any], created: bool = False) -> TaskRecord:
        return cls(
            task_id=body["taskId"],
            state=body["state"],
            revision=body["revision"],
            input_digest=body["inputDigest"],
            claim_generation=body["claimGeneration"],
            attempt_id=body.get("attemptId"),
            owner=body.get("owner"),
            lease_expires_at=body.get("leaseExpiresAt"),
            cancel_generation=body["cancelGeneration"],
            scheduler_epoch=body.get("schedulerEpoch"),
            commit=body.get("commit"),
            raw=dict(body),
            created=created,
        )


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of ``GET /v1/events``: ``position`` (resume after it), ``type`` (``task`` or
    ``effect``) and ``data``, the event's JSON (``taskId``, ``state``, ...)."""

    position: str
    type: str
    data: dict[str, Any]


class _SseParser:
    """Server-sent events, line by line (the WHATWG rules fencegate's stream needs)."""

    def __init__(self, last_id: str | None) -> None:
        #: The position to resume after: set when a frame ends (a frame cut off by a dropped
        #: connection does not count), data or not.
        self.last_id = last_id
        self.retry_ms: int | None = None
        self._id = last_id
        self._event = ""
        self._data: list[str] = []

    def line(self, text: str) -> StreamEvent | None:
        if not text:
            return self._dispatch()
        if text.startswith(":"):
            return None
        name, _, value = text.partition(":")
        value = value.removeprefix(" ")
        if name == "id" and "\0" not in value:
            self._id = value
        elif name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None

    def cut(self) -> None:
        """The connection dropped: a frame not yet ended is forgotten."""
        self._id, self._event, self._data = self.last_id, "", []

    def _dispatch(self) -> StreamEvent | None:
        data, kind = self._data, self._event or "message"
        self._data, self._event = [], ""
        self.last_id = self._id
        if not data or self.last_id is None:
            return None
        try:
            body = json.loads("\n".join(data))
        except ValueError:
            return None
        return StreamEvent(self.last_id, kind, body if isinstance(body, dict) else {})


class Client:
    """A fencegate gateway at ``url`` (``http://127.0.0.1:8700``).

    Use it as ``async with Client(url) as client:`` (or call ``close()``). Pass ``session``
    to share your own ``aiohttp.ClientSession`` (the client then does not close it);
    ``headers`` go with every call; ``token`` is the gateway credential of a gateway with
    ``[auth]``, sent as ``Fence-Authorization: Bearer <token>`` with every call, proxied calls
    included (``Fence-*`` never reaches a downstream); it defaults to ``$FENCEGATE_TOKEN``
    (pass ``token=""`` to send none). ``timeout`` bounds each call in seconds, proxied calls
    included (keep it above the downstreams' ``timeout_ms``: the SDK cannot see them, and
    ``ClientTimeout`` says so when it fires first); ``operator`` is sent as
    ``Fence-Operator`` on operator calls. ``clock`` is where its leases read the time and
    wait (the renewal period, the local expiry): the monotonic clock unless a test passes
    one it moves by hand (``fencegate.lease.Clock``).
    """

    def __init__(
        self,
        url: str,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        operator: str | None = None,
        token: str | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.url = url.rstrip("/")
        self.clock = clock
        self.timeout = timeout
        self.headers = dict(headers or {})
        if token is None:
            token = os.environ.get(TOKEN_ENV, "")
        token = token.strip()
        if token:
            self.headers.setdefault("Fence-Authorization", f"Bearer {token}")
        self.operator = operator
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    # --- plumbing -----------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

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
        all_headers = {**self.headers, **(headers or {})}
        seconds = timeout_s or self.timeout
        try:
            async with self._http().request(
                method,
                URL(self.url + path, encoded=True),
                data=body,
                headers=all_headers,
                allow_redirects=False,
                timeout=self._timeout(seconds),
            ) as resp:
                raw = await resp.read()
                return RawAnswer(resp.status, resp.headers, raw, resp.reason or "")
        except TimeoutError as exc:  # aiohttp's own timeout errors are TimeoutErrors too
            raise ClientTimeout(
                method,
                path,
                url=self.url,
                timeout_s=seconds,
                downstream=proxied_downstream(path),
            ) from exc
        except aiohttp.ClientError as exc:
            raise GatewayUnreachable(
                f"{method} {path}: no answer from the gateway at {self.url} "
                f"({describe_exception(exc)})"
            ) from exc

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Any]:
        """A JSON call of the coordination or ledger API: (status, decoded body), or raise."""
        data = None if body is None else json.dumps(body).encode()
        all_headers = dict(headers or {})
        if data is not None:
            all_headers["Content-Type"] = "application/json"
        answer = await self.send(method, path, body=data, headers=all_headers)
        return answer.status, self._read_answer(method, path, answer)

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        """The aiohttp timeout of one exchange: ``seconds`` for all of it."""
        return aiohttp.ClientTimeout(total=seconds)

    def _read_answer(self, method: str, path: str, answer: RawAnswer) -> Any:
        """The decoded JSON of a ``call``'s answer, or raise: the gateway's problem as its
        typed error, ``GatewayUnreachable`` for a 502/503/504 of something in between, a
        ``ProblemError`` (code ``HTTP_<status>``) for any other error answer."""
        if answer.status >= 400:
            problem = gateway_problem(answer)
            if problem is not None:
                raise problem
            # Not the gateway's own answer: something in between (a load balancer...).
            if answer.status in (502, 503, 504):
                raise GatewayUnreachable(f"{method} {path}: HTTP {answer.status} from in between")
            raise ProblemError(
                f"{method} {path}: HTTP {answer.status} (not a fencegate problem)",
                status=answer.status,
                code=f"HTTP_{answer.status}",
                headers=answer.headers,
            )
        return answer.json()

    @staticmethod
    def task_path(task_id: str, action: str = "") -> str:
        return task_path(task_id, action)

    def _operator_headers(self, operator: str | None) -> dict[str, str]:
        name = operator or self.operator
        return {"Fence-Operator": name} if name else {}

    # --- scheduler ----------------------------------------------------------------------------

    async def put_task(
        self,
        task_id: str,
        input_digest: str,
        *,
        max_runtime_ms: int | None = None,
        queue: str | None = None,
        priority: int | None = None,
        depends_on: Sequence[str] | None = None,
    ) -> TaskRecord:
        """Create the task, or revise it: a new ``input_digest`` opens a new revision (the
        same one changes nothing, whatever else is passed). ``queue`` and ``priority`` make it
        claimable with ``claim_next``; ``depends_on`` keeps it WAITING until each of those
        tasks has its canonical commit. None leaves them as they are (on a new task: no queue,
        priority 0, no dependencies)."""
        body: dict[str, Any] = {"inputDigest": input_digest}
        if max_runtime_ms is not None:
            body["maxRuntimeMs"] = max_runtime_ms
        if queue is not None:
            body["queue"] = queue
        if priority is not None:
            body["priority"] = priority
        if depends_on is not None:
            body["dependsOn"] = list(depends_on)
        status, answer = await self.call("PUT", self.task_path(task_id), body)
        return TaskRecord.from_json(answer, created=status == 201)

    async def get_task(self, task_id: str) -> TaskRecord:
        _, answer = await self.call("GET", self.task_path(task_id))
        return TaskRecord.from_json(answer)

    async def wait_for(
        self,
        task_id: str,
        state: str,
        timeout: float,  # noqa: ASYNC109 - a deadline over many long-polls, not one call's
    ) -> TaskRecord:
        """The task's record as soon as it is in ``state`` (one long-poll after another, each
        bounded by the gateway's ``tasks.max_wait_ms``, at least ``MIN_POLL_S`` apart; a
        gateway at its bound of long-polls, ``TOO_MANY_CONNECTIONS``, is asked again after its
        ``Retry-After``); ``TimeoutError`` after ``timeout`` seconds without it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        path = self.task_path(task_id)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"task {task_id!r} was not {state} within {timeout} s")
            query = urlencode({"waitFor": state, "waitMs": str(max(int(left * 1000), 1))})
            polled_at = loop.time()
            answer = await self.send("GET", f"{path}?{query}", timeout_s=left + self.timeout)
            try:
                record = TaskRecord.from_json(self._read_answer("GET", path, answer))
            except TooManyConnections as exc:
                await _pause(_busy_pause(exc), deadline)
                continue
            if record.state == state:
                return record
            await _pause(MIN_POLL_S - (loop.time() - polled_at), deadline)

    async def wait_committed(self, task_id: str, timeout: float) -> TaskRecord:  # noqa: ASYNC109
        """The task's record once it has its canonical commit (``record.commit``);
        ``TimeoutError`` after ``timeout`` seconds without one."""
        return await self.wait_for(task_id, "COMMITTED", timeout)

    async def events(
        self, after: str | None = None, *, idle_timeout: float = 60.0
    ) -> AsyncGenerator[StreamEvent, None]:
        """Task and effect events as they happen (``GET /v1/events``), for as long as you
        iterate. ``after``: a ``StreamEvent.position`` to resume after (None: from now). A
        dropped connection is reopened from the last position seen (``Last-Event-ID``), so
        nothing is missed or repeated; ``EventsGone`` when that position is older than the
        history the store keeps. ``idle_timeout``: seconds without a byte (the gateway sends
        a heartbeat every ``events.heartbeat_ms``) before the connection counts as dropped."""
        parser = _SseParser(after)
        failures = 0
        while True:
            headers = {**self.headers, "Accept": "text/event-stream"}
            if parser.last_id is not None:
                headers["Last-Event-ID"] = parser.last_id
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=self.timeout, sock_read=idle_timeout
            )
            try:
                async with self._http().get(
                    URL(self.url + "/v1/events", encoded=True),
                    headers=headers,
                    allow_redirects=False,
                    timeout=timeout,
                ) as resp:
                    if resp.status != 200:
                        raw = await resp.read()
                        answer = RawAnswer(resp.status, resp.headers, raw, resp.reason or "")
                        self._read_answer("GET", "/v1/events", answer)
                        raise GatewayUnreachable(f"GET /v1/events: HTTP {resp.status}")
                    failures = 0
                    async for raw_line in _lines(resp.content):
                        event = parser.line(raw_line)
                        if event is not None:
                            yield event
            except (aiohttp.ClientError, TimeoutError, GatewayUnreachable):
                failures += 1
            parser.cut()
            delay = (parser.retry_ms or 1000) / 1000 * min(2 ** max(failures - 1, 0), 16)
            await asyncio.sleep(delay)

    async def list_tasks(
        self,
        *,
        state: str | None = None,
        owner: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        lease_expired: bool | None = None,
    ) -> dict[str, Any]:
        """One page of ``GET /v1/tasks``, in taskId order: ``{"tasks": [...], "nextCursor"}``.
        Pass ``nextCursor`` back as ``cursor`` for the next page (None: that was the last).
        ``lease_expired``: only CLAIMED tasks whose lease ran out (False: all the others)."""
        query = {
            "state": state,
            "owner": owner,
            "leaseExpired": None if lease_expired is None else str(lease_expired).lower(),
            "cursor": cursor,
            "limit": str(limit),
        }
        params = {name: value for name, value in query.items() if value is not None}
        _, answer = await self.call("GET", "/v1/tasks?" + urlencode(params))
        return dict(answer)

    async def cancel_task(self, task_id: str) -> int:
        """Cancel the task; answers its new ``cancelGeneration``."""
        _, answer = await self.call("POST", self.task_path(task_id, "cancel"))
        return int(answer["cancelGeneration"])

    async def get_epoch(self) -> Epoch:
        _, answer = await self.call("GET", "/v1/epoch")
        return Epoch.from_json(answer)

    async def bump_epoch(self) -> Epoch:
        """Fence every claim made under the current epoch."""
        _, answer = await self.call("POST", "/v1/epoch/bump", headers=self._operator_headers(None))
        return Epoch.from_json(answer)

    async def pause_claims(self) -> Epoch:
        _, answer = await self.call(
            "POST", "/v1/claims/pause", headers=self._operator_headers(None)
        )
        return Epoch.from_json(answer)

    async def resume_claims(self) -> Epoch:
        _, answer = await self.call(
            "POST", "/v1/claims/resume", headers=self._operator_headers(None)
        )
        return Epoch.from_json(answer)

    # --- workers ------------------------------------------------------------------------------

    def claim(
        self,
        task_id: str,
        *,
        owner: str,
        ttl_ms: int,
        scheduler_epoch: int | None = None,
        expected_revision: int | None = None,
    ) -> ClaimScope:
        """A guarded lease: ``async with client.claim(...) as lease:``.

        Claims on entry (``Claimed``, ``AlreadyCommitted``, ``StaleEpoch``, ``ClaimsPaused``
        ... when it cannot), renews every third of the granted TTL (with jitter) while the
        body runs, and when the lease is lost (a renewal refused, or no renewal got through
        before it would expire) cancels the body and raises ``LeaseLost`` at the ``async with``.
        A body that ends without committing hands the task back (release).
        ``scheduler_epoch`` defaults to the current one (one ``GET /v1/epoch``).
        """
        return ClaimScope(
            functools.partial(
                self.acquire,
                task_id,
                owner=owner,
                ttl_ms=ttl_ms,
                scheduler_epoch=scheduler_epoch,
                expected_revision=expected_revision,
                guarded=True,
            )
        )

    async def acquire(
        self,
        task_id: str,
        *,
        owner: str,
        ttl_ms: int,
        scheduler_epoch: int | None = None,
        expected_revision: int | None = None,
        guarded: bool = False,
    ) -> Lease:
        """Claim ``task_id`` and return a bare lease: nothing renews it, nothing stops its
        calls; the gateway still fences every one of them. ``claim`` is the guarded form."""
        if scheduler_epoch is None:
            scheduler_epoch = (await self.get_epoch()).scheduler_epoch
        body: dict[str, Any] = {"owner": owner, "ttlMs": ttl_ms, "schedulerEpoch": scheduler_epoch}
        if expected_revision is not None:
            body["expectedRevision"] = expected_revision
        sent_at = self.clock.now()
        _, answer = await self.call("POST", self.task_path(task_id, "claim"), body)
        return Lease(self, owner=owner, ttl_ms=ttl_ms, claim=answer, sent_at=sent_at,
                     guarded=guarded, clock=self.clock)  # fmt: skip

    async def claim_next(
        self,
        queue: str,
        *,
        owner: str,
        ttl_ms: int,
        scheduler_epoch: int | None = None,
        wait_ms: int = 0,
    ) -> Lease | None:
        """Claim the best claimable task of ``queue`` (highest priority, then the longest
        READY; an expired or old-epoch claim counts as claimable) and return it as a bare
        lease (``async with lease.hold():`` renews it in the background), or None when the
        queue has none, after waiting up to ``wait_ms`` for one: one long-poll after another
        (each bounded by the gateway's ``tasks.max_wait_ms``, at least ``MIN_POLL_S`` apart);
        a gateway at its bound of long-polls (``TOO_MANY_CONNECTIONS``) is asked again after
        its ``Retry-After``, and once more without waiting when ``wait_ms`` ran out.
        ``lease.dependencies`` is the provenance of its inputs."""
        if scheduler_epoch is None:
            scheduler_epoch = (await self.get_epoch()).scheduler_epoch
        path = f"/v1/queues/{quote(queue, safe='')}/claim"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000
        while True:
            left_ms = int((deadline - loop.time()) * 1000) if wait_ms else 0
            body: dict[str, Any] = {
                "owner": owner,
                "ttlMs": ttl_ms,
                "schedulerEpoch": scheduler_epoch,
            }
            if left_ms > 0:
                body["waitMs"] = left_ms
            sent_at = self.clock.now()
            polled_at = loop.time()
            answer = await self.send(
                "POST",
                path,
                body=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
                timeout_s=self.timeout + max(left_ms, 0) / 1000,
            )
            if answer.status == 204:
                if left_ms <= 0 or loop.time() >= deadline:
                    return None
                await _pause(MIN_POLL_S - (loop.time() - polled_at), deadline)
                continue
            try:
                claim = self._read_answer("POST", path, answer)
            except TooManyConnections as exc:
                if left_ms <= 0:
                    raise
                await _pause(_busy_pause(exc), deadline)
                continue
            return Lease(self, owner=owner, ttl_ms=ttl_ms, claim=claim, sent_at=sent_at,
                         guarded=False, clock=self.clock)  # fmt: skip

    # --- clients (no lease) --------------------------------------------------------------------

    async def request(
        self,
        downstream: str,
        method: str,
        path: str,
        *,
        idempotency_key: str | None,
        json: Any = _NO_JSON,
        data: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        wait: float | None = None,
        timeout_s: float | None = None,
    ) -> ProxyResponse:
        """Send one call to ``downstream`` through the gateway without a lease, as a keyed
        effect: the ``Idempotency-Key`` is the effect's identity (scoped to this client's
        principal and the downstream), so the call happens at most once however often it is
        sent. For a chat agent or any caller with no task queue; the token must hold the
        ``client`` role (a gateway without ``[auth]`` lets anyone), and the downstream must
        have ``client_idempotency_keys`` on.

        Returns the downstream's answer whatever its status, or the ledger's replay of it
        (``replayed``: ``Idempotent-Replayed`` or ``Fence-Replayed``). Retry a call whose
        answer was lost with the same key and payload. Raises the gateway's refusals:
        ``PayloadConflict`` (the key was used with another payload), ``EffectInFlight``
        (``retry_after``; or pass ``wait``), ``EffectUnknown`` (an earlier forward's outcome
        is unknown: nothing is sent until an operator or the downstream's probe settles it),
        ``DownstreamTimeout`` (this call made it UNKNOWN), ``EffectExpired`` (the key's
        settled record went with retention; later the key is new), ``IdempotencyKeyRequired``,
        ``BadRequest``, ``Forbidden`` (a worker's token, or no ``client`` role).

        ``idempotency_key`` may be None only for GET, HEAD and OPTIONS (relayed unrecorded).
        ``wait`` (seconds) sends ``Prefer: wait=N``: a duplicate of a call still in flight
        waits at the gateway for its outcome instead of ``EffectInFlight``; ``timeout_s``
        (default: the client's timeout; keep it above the downstream's ``timeout_ms``) grows
        by as much.
        """
        call = proxy_call(
            downstream, method, path, json=json, data=data, headers=headers, params=params
        )
        all_headers = dict(call.headers)
        if idempotency_key is not None:
            all_headers["Idempotency-Key"] = idempotency_key_header(idempotency_key)
        elif call.verb not in SAFE_METHODS:
            raise ValueError(
                f"{call.verb} changes something: pass idempotency_key=... (the same one on "
                "every retry of this call)"
            )
        if wait is not None:
            all_headers["Prefer"] = prefer_wait(wait)
            timeout_s = (timeout_s or self.timeout) + wait
        answer = await self.send(
            call.verb, call.target, body=call.body, headers=all_headers, timeout_s=timeout_s
        )
        problem = gateway_problem(answer)
        if problem is not None:
            raise problem
        return ProxyResponse.of(answer)

    # --- operators ----------------------------------------------------------------------------

    async def get_effect(self, effect_id: str) -> dict[str, Any]:
        _, answer = await self.call("GET", f"/v1/effects/{quote(effect_id, safe='')}")
        return dict(answer)

    async def list_effects(
        self,
        *,
        state: str | None = None,
        task_id: str | None = None,
        downstream: str | None = None,
        page_size: int = 100,
        idempotency_key: str | None = None,
        principal: str | None = None,
    ) -> list[dict[str, Any]]:
        """Every matching effect record, following ``nextCursor`` to the end."""
        found = self.iter_effects(
            state=state,
            task_id=task_id,
            downstream=downstream,
            page_size=page_size,
            idempotency_key=idempotency_key,
            principal=principal,
        )
        return [record async for record in found]

    async def iter_effects(
        self,
        *,
        state: str | None = None,
        task_id: str | None = None,
        downstream: str | None = None,
        page_size: int = 100,
        limit: int | None = None,
        awaiting_approval: bool = False,
        idempotency_key: str | None = None,
        principal: str | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Matching effect records in creation order, a page (``page_size``) at a time,
        following ``nextCursor``; at most ``limit`` of them (None: to the end).
        ``awaiting_approval``: the effects waiting for an operator's approval instead, oldest
        first, one page (no other filter goes with it). ``idempotency_key``: the keyed
        effects of ``principal``'s key (default: the caller's own principal; a ``client``
        token may look up only its own), one per downstream it was sent to (or only
        ``downstream``'s), looked up by their ids in one call; ``state`` and ``task_id`` do
        not go with it."""
        if idempotency_key is not None:
            if state is not None or task_id is not None or awaiting_approval:
                raise ValueError("idempotency_key goes with principal and downstream only")
            lookup = {"idempotencyKey": idempotency_key, "principal": principal,
                      "downstream": downstream}  # fmt: skip
            asked = {k: v for k, v in lookup.items() if v is not None}
            _, answer = await self.call("GET", "/v1/effects?" + urlencode(asked))
            for record in answer["effects"][:limit]:
                yield dict(record)
            return
        if principal is not None:
            raise ValueError("principal goes with idempotency_key")
        query = {
            "state": state,
            "taskId": task_id,
            "downstream": downstream,
            "awaitingApproval": "true" if awaiting_approval else None,
        }
        params = {k: v for k, v in query.items() if v is not None}
        left = limit
        cursor: str | None = None
        while left is None or left > 0:
            page = dict(params, limit=str(page_size if left is None else min(left, page_size)))
            if cursor:
                page["cursor"] = cursor
            _, answer = await self.call("GET", "/v1/effects?" + urlencode(page))
            found: list[dict[str, Any]] = answer["effects"]
            for record in found if left is None else found[:left]:
                yield dict(record)
            if left is not None:
                left -= len(found)
            cursor = answer.get("nextCursor")
            if not cursor:
                return

    async def resolve_effect(
        self,
        effect_id: str,
        outcome: Literal["COMMITTED", "NOT_APPLIED"],
        note: str,
        *,
        response: Mapping[str, Any] | None = None,
        operator: str | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        """Settle an UNKNOWN effect. With ``COMMITTED``, ``response`` (``{"status", "headers",
        "body"}``) is what duplicates will replay. ``NOT_APPLIED`` raises ``EffectInFlight``
        (``retry_after``; ``problem["landingUntil"]``) while an earlier forward may still land
        at the downstream; ``force`` settles it anyway (recorded on the effect)."""
        body: dict[str, Any] = {"outcome": outcome, "note": note}
        if response is not None:
            body["response"] = dict(response)
        if force:
            body["force"] = True
        _, answer = await self.call(
            "POST",
            f"/v1/effects/{quote(effect_id, safe='')}/resolve",
            body,
            headers=self._operator_headers(operator),
        )
        return dict(answer)

    async def approve_effect(
        self,
        effect_id: str,
        note: str = "",
        *,
        payload_digest: str | None = None,
        operator: str | None = None,
        approval_digest: str | None = None,
    ) -> dict[str, Any]:
        """Let a waiting non-replayable effect go once (``approval_digest``: only if it still
        waits for exactly that request, its payload and effect-changing headers;
        ``payload_digest``: that payload, enough alone only for a request without such
        headers)."""
        body: dict[str, Any] = {"note": note}
        if payload_digest is not None:
            body["payloadDigest"] = payload_digest
        if approval_digest is not None:
            body["approvalDigest"] = approval_digest
        _, answer = await self.call(
            "POST",
            f"/v1/effects/{quote(effect_id, safe='')}/approve",
            body,
            headers=self._operator_headers(operator),
        )
        return dict(answer)

    async def reconcile_effect(
        self, effect_id: str, *, operator: str | None = None
    ) -> dict[str, Any]:
        """Run the downstream adapter's probe on an UNKNOWN effect; answers the record
        (``EffectUnknown`` when the downstream has no probe: resolve it by hand)."""
        _, answer = await self.call(
            "POST",
            f"/v1/effects/{quote(effect_id, safe='')}/reconcile",
            headers=self._operator_headers(operator),
        )
        return dict(answer)

    async def get_rollout(self) -> dict[str, Any]:
        """``GET /v1/rollout``: the rollback checklist (``safeToSwitchPools`` and its counts)."""
        _, answer = await self.call("GET", "/v1/rollout")
        return dict(answer)

    async def get_store_stats(self) -> dict[str, Any]:
        """``GET /v1/store/stats``: the store's sizes (records by kind, what is due to expire,
        tombstones, bytes)."""
        _, answer = await self.call("GET", "/v1/store/stats")
        return dict(answer)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The stream's lines without their line ends (CRLF, LF or CR alone, as SSE allows)."""
    pending = b""
    async for chunk in content.iter_any():
        pending += chunk
        while True:
            cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0),
                      default=-1)  # fmt: skip
            if cut < 0:
                break
            if pending[cut : cut + 2] == b"\r\n":
                line, pending = pending[:cut], pending[cut + 2 :]
            elif pending[cut : cut + 1] == b"\r" and cut + 1 == len(pending):
                break  # a CR at the end of a chunk may be half of CRLF: wait for more
            else:
                line, pending = pending[:cut], pending[cut + 1 :]
            yield line.decode("utf-8", errors="replace")
