"""A lease: one claim of one task, and everything a worker does under it.

Two forms, one class:

* **guarded** (``async with client.claim(...) as lease:``): renewed in the background every
  third of the granted TTL (with jitter, never later). When a renewal is refused (``Fenced``,
  ``StaleEpoch``, ``Cancelled``...) or no renewal got through before the lease would run out,
  the lease is lost: the body is cancelled, every later ``request`` is refused locally without
  a byte leaving the worker, and ``LeaseLost`` is raised at the ``async with``. A worker that
  cannot renew stops producing effects.
* **bare** (``lease = await client.acquire(...)``): nothing renews it and nothing stops its
  calls locally; you call ``renew()`` yourself. The gateway still fences every call.

The local clock only ever makes a lease end *sooner*: its expiry is estimated from the moment
the claim (or renewal) was *sent*, minus a small margin, so the worker stops before the store
would let anyone else in.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, TypeVar
from urllib.parse import quote, urlencode

from multidict import CIMultiDictProxy

from fencegate._http import RawAnswer, Transport, gateway_problem, task_path
from fencegate.errors import (
    LEASE_ENDING_CODES,
    EffectInFlight,
    FencegateError,
    GatewayUnreachable,
    LeaseLost,
    ProblemError,
    StoreUnavailable,
)

__all__ = [
    "ClaimScope",
    "Clock",
    "Commit",
    "Lease",
    "MonotonicClock",
    "ProxyResponse",
    "canonical_json",
    "mcp_meta",
    "prefer_wait",
    "proxy_call",
    "result_digest",
    "wait_out_in_flight",
]

T = TypeVar("T")

#: Methods the gateway forwards without a ledger entry (no ``slot`` needed).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Characters left as they are in a proxied path (anything else is percent-encoded).
_PATH_SAFE = "/?&=%:@!$'()*+,;~[]-._"
_NO_JSON: Any = object()
#: The slot grammar of the contract (docs/PROTOCOL.md): what the gateway accepts as a slot.
_SLOT = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")
#: Where an MCP ``tools/call`` names its side effect: a key of ``params._meta``. Sent under
#: the reverse-DNS name and the older one alike, for at least one release (a gateway before
#: the move reads only the older name; a newer one takes both when they agree).
_MCP_SLOT_META = ("dev.fencegate/slot", "fencegate/slot")
#: The gateway credential header (``Client(token=...)``), lower-cased for comparison.
_CREDENTIAL = "fence-authorization"


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no insignificant whitespace, UTF-8: the same value, the same bytes."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def result_digest(value: Any) -> str:
    """The ``resultDigest`` of a result: ``sha256:`` + hex SHA-256 of its canonical JSON."""
    return "sha256:" + hashlib.sha256(canonical_json(value)).hexdigest()


_result_digest = result_digest


def mcp_meta(slot: str) -> dict[str, str]:
    """The ``_meta`` of an MCP ``tools/call`` that names its side effect ``slot``, as ``slot=``
    does for ``Lease.request``: ``await mcp.call_tool(name, args, meta=mcp_meta("charge-1"))``.

    Without it the gateway derives the slot from the tool name and the arguments, so a second
    call meant as a new effect (another charge of the same amount) would be replayed instead;
    a named slot also makes a retry with changed arguments ``PAYLOAD_CONFLICT`` rather than a
    second effect. A slot outside the contract's grammar (1 to 200 of ``A-Z a-z 0-9 . _ : @ /
    -``) raises ``ValueError`` here, before the MCP client sends anything.
    """
    if not isinstance(slot, str) or not _SLOT.fullmatch(slot):
        raise ValueError(f"slot {slot!r}: expected 1 to 200 characters of A-Z a-z 0-9 . _ : @ / -")
    return dict.fromkeys(_MCP_SLOT_META, slot)


@dataclass(frozen=True, slots=True)
class Commit:
    """The task's canonical commit, made by this lease."""

    commit_id: str
    result_digest: str
    outcome: str = "COMMITTED"


@dataclass(frozen=True, slots=True)
class ProxyResponse:
    """A downstream's answer through the gateway, or the ledger's replay of it.

    ``effect_state`` is ``COMMITTED`` (recorded; duplicates replay it), ``UNKNOWN`` (the
    downstream answered 500/502/504: the effect may or may not have happened) or ``NONE``
    (safe methods: no ledger entry). ``replayed`` is True when the gateway answered from the
    ledger without calling the downstream.
    """

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    effect_id: str | None
    effect_state: str
    replayed: bool

    @classmethod
    def of(cls, answer: RawAnswer) -> ProxyResponse:
        """The downstream's answer (or its replay) as the gateway relayed it. A replay is
        marked ``Fence-Replayed: true``, and a keyed effect's also ``Idempotent-Replayed:
        true`` (the header of the IETF httpapi draft). ``Fence-Replayed`` is the gateway's
        own word and wins: a deduplicating downstream may say ``Idempotent-Replayed`` on a
        first forward, which the gateway did not replay."""
        headers = answer.headers
        said = headers.get("Fence-Replayed")
        if said is None:
            said = headers.get("Idempotent-Replayed")
        return cls(
            status=answer.status,
            headers=headers,
            body=answer.body,
            effect_id=headers.get("Fence-Effect-Id"),
            effect_state=headers.get("Fence-Effect-State", "NONE"),
            replayed=said == "true",
        )

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400

    def json(self) -> Any:
        return json.loads(self.body)

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def prefer_wait(seconds: float) -> str:
    """The ``Prefer`` value that asks the gateway to wait up to ``seconds`` for an in-flight
    duplicate's outcome instead of answering ``EFFECT_IN_FLIGHT`` at once (RFC 7240 ``wait``:
    whole seconds, rounded up; the gateway bounds it by its ``proxy.max_prefer_wait_ms``)."""
    if not seconds >= 0:  # NaN too
        raise ValueError(f"wait={seconds!r}: expected seconds >= 0")
    return f"wait={math.ceil(seconds)}"


@dataclass(frozen=True, slots=True)
class ProxyCall:
    """One call to send through ``/proxy``, built once so that every retry sends the same
    bytes: ``target`` (the encoded path), ``body``, and the caller's headers (the ``Fence-*``
    or ``Idempotency-Key`` headers are added by whoever sends it)."""

    verb: str
    target: str
    body: bytes | None
    headers: dict[str, str]


def proxy_call(
    downstream: str,
    method: str,
    path: str,
    *,
    json: Any = _NO_JSON,
    data: bytes | str | None = None,
    headers: Mapping[str, str] | None = None,
    params: Mapping[str, str] | None = None,
) -> ProxyCall:
    """``method path`` to ``downstream`` as the gateway's ``/proxy/{downstream}{path}``:
    ``json`` as canonical JSON (so a retry's payload digest is the same), or ``data`` as it
    is. Shared by ``Lease.request`` and ``Client.request``."""
    if json is not _NO_JSON and data is not None:
        raise ValueError("pass json= or data=, not both")
    all_headers = dict(headers or {})
    body: bytes | None
    if json is not _NO_JSON:
        body = canonical_json(json)
        all_headers.setdefault("Content-Type", "application/json")
    else:
        body = data.encode() if isinstance(data, str) else data
    target = (
        "/proxy/"
        + quote(downstream, safe="")
        + quote(path if path.startswith("/") else "/" + path, safe=_PATH_SAFE)
    )
    if params:
        target += ("&" if "?" in target else "?") + urlencode(params)
    return ProxyCall(method.upper(), target, body, all_headers)


class Clock(Protocol):
    """Where a lease reads the time and waits: ``now()`` in seconds on a clock that never
    steps back, and ``sleep(seconds)`` on that same clock. A guarded lease's renewal period
    and its local expiry are measured on it; the default is the monotonic clock asyncio
    sleeps on. A test passes a clock it moves by hand (``Client(url, clock=...)``), so "within
    one renewal period" is a fact it sets up, not a race against a loaded machine."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


#: The clock of every lease that is not given one.
MONOTONIC = MonotonicClock()


async def wait_out_in_flight(
    send: Callable[[], Awaitable[T]],
    *,
    max_wait_s: float,
    first_delay_s: float = 0.05,
    max_delay_s: float = 2.0,
) -> T:
    """Call ``send()``; while it raises ``EffectInFlight``, wait and call it again.

    Waits grow from ``first_delay_s`` (doubling, with jitter) up to ``max_delay_s`` and never
    past the refusal's ``retry_after``; after ``max_wait_s`` in all the last
    ``EffectInFlight`` is raised. The retry gets the forward's outcome: a replay of its answer,
    ``EffectUnknown``, or a new forward if it was certainly not delivered.
    """
    deadline = time.monotonic() + max_wait_s
    delay = first_delay_s
    while True:
        try:
            return await send()
        except EffectInFlight as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            wait = min(delay, left)
            if exc.retry_after is not None:
                wait = min(wait, max(exc.retry_after, 0.01))
            await asyncio.sleep(wait * random.uniform(0.8, 1.0))
            delay = min(delay * 2, max_delay_s)


class Lease:
    """One claim of ``task_id``: its identity, and the calls made under it.

    Built by ``Client.acquire`` (bare) or ``Client.claim`` (guarded); see the module docstring.
    ``client`` is the ``Client`` that claimed it (anything with its ``send`` and ``call``);
    ``clock`` is the one ``sent_at`` was read on (the client's).
    """

    def __init__(
        self,
        client: Transport,
        *,
        owner: str,
        ttl_ms: int,
        claim: Mapping[str, Any],
        sent_at: float,
        guarded: bool,
        clock: Clock = MONOTONIC,
    ) -> None:
        self._client = client
        self._clock = clock
        self.owner = owner
        #: The TTL asked for at every renewal.
        self.ttl_ms = ttl_ms
        self.guarded = guarded
        self.task_id: str = claim["taskId"]
        self.attempt_id: str = claim["attemptId"]
        self.claim_generation: int = claim["claimGeneration"]
        self.scheduler_epoch: int = claim["schedulerEpoch"]
        self.cancel_generation: int = claim["cancelGeneration"]
        self.revision: int = claim["revision"]
        self.input_digest: str = claim["inputDigest"]
        #: Store time (ms) the lease runs out, as the last claim or renewal answered.
        self.lease_expires_at: int = claim["leaseExpiresAt"]
        #: What the claim granted (``ttlMs`` clamped by the gateway's maximum).
        self.granted_ttl_ms: int = int(claim.get("grantedTtlMs", ttl_ms))
        #: The queue it was claimed from, if any.
        self.queue: str | None = claim.get("queue")
        #: Provenance: ``{taskId, commitId, resultDigest}`` of each dependency's canonical
        #: commit this revision builds on, in ``dependsOn`` order.
        self.dependencies: list[dict[str, Any]] = [dict(d) for d in claim.get("dependencies") or ()]
        # Cost added with add_cost, sent with the next renew, release or commit.
        self._pending_cost: dict[str, float] = {}
        # Store time at the claim, seen from the local monotonic clock at the moment the claim
        # was sent (the store decided later, so local estimates err on the short side).
        self._store_t0 = self.lease_expires_at - self.granted_ttl_ms
        self._mono_t0 = sent_at
        self._deadline = sent_at + self.granted_ttl_ms / 1000
        self._margin = min(0.2, self.granted_ttl_ms / 10_000)
        self._lost: LeaseLost | None = None
        self._commit: Commit | None = None
        self._released = False
        # Guarded form only.
        self._owner: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cancel_requested = False
        self._in_body = False
        self._committing = 0
        self._keeper: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (
            f"<Lease {self.task_id!r} gen={self.claim_generation} epoch={self.scheduler_epoch} "
            f"owner={self.owner!r}{' lost' if self._lost else ''}>"
        )

    # --- state ----------------------------------------------------------------------------

    @property
    def renew_interval(self) -> float:
        """Seconds between background renewals at most (a third of the granted TTL)."""
        return self.granted_ttl_ms / 3000

    @property
    def expires_in(self) -> float:
        """Seconds this worker may still act, by its own (pessimistic) clock."""
        return self._deadline - self._margin - self._clock.now()

    @property
    def lost(self) -> LeaseLost | None:
        """Why the lease is gone (``None`` while it is not known to be)."""
        return self._lost

    @property
    def committed(self) -> Commit | None:
        return self._commit

    def fence_headers(self, *, slot: str | None = None, node: str | None = None) -> dict[str, str]:
        """The ``Fence-*`` headers of this claim, for callers building requests themselves."""
        headers = {
            "Fence-Task": self.task_id,
            "Fence-Attempt": self.attempt_id,
            "Fence-Generation": str(self.claim_generation),
            "Fence-Epoch": str(self.scheduler_epoch),
            "Fence-Cancel": str(self.cancel_generation),
        }
        if node is not None:
            headers["Fence-Node"] = node
        if slot is not None:
            headers["Fence-Slot"] = slot
        return headers

    def mcp_headers(self, *, node: str | None = None) -> dict[str, str]:
        """The headers an MCP client sets once on its transport to call tools through
        ``/mcp/{downstream}`` under this lease, e.g. ``httpx2.AsyncClient(headers=...)``.

        The ``Fence-*`` headers of the claim (``Fence-Node`` when ``node`` is given; no slot:
        each ``tools/call`` names its own with ``mcp_meta``), plus the gateway credential the
        SDK client sends (``Fence-Authorization``, when it has one), because here the MCP
        client makes the requests, not this SDK. Renewals change none of them, so they hold
        for the lease's whole life. Nothing stops the MCP client's calls locally once the
        lease is lost (as with a bare lease): the gateway refuses each of them (``FENCED``,
        ``STALE_EPOCH``...), and a guarded lease still cancels its body.
        """
        headers = self.fence_headers(node=node)
        credential = next(
            (value for name, value in self._client.headers.items() if name.lower() == _CREDENTIAL),
            None,
        )
        if credential is not None:
            headers["Fence-Authorization"] = credential
        return headers

    def add_cost(self, **spent: float) -> None:
        """Note what this attempt spent (``tokens=1200, seconds=3.5``: units the gateway's
        ``tasks.cost_units`` lists); it goes with the next renew (the background ones of a
        guarded lease too), release or commit. An attempt that ends fenced, expired,
        cancelled or superseded counts it as discarded work (docs/operations.md)."""
        for unit, amount in spent.items():
            self._pending_cost[unit] = self._pending_cost.get(unit, 0.0) + amount

    def _take_cost(self, cost: Mapping[str, float] | None) -> dict[str, float]:
        """The cost to send: pending plus ``cost`` (not yet cleared: see ``_sent_cost``)."""
        total = dict(self._pending_cost)
        for unit, amount in (cost or {}).items():
            total[unit] = total.get(unit, 0.0) + amount
        return total

    def _sent_cost(self, sent: Mapping[str, float]) -> None:
        """The gateway answered (granted or refused): what was sent is reported."""
        for unit, amount in sent.items():
            left = self._pending_cost.get(unit, 0.0) - amount
            if left > 0:
                self._pending_cost[unit] = left
            else:
                self._pending_cost.pop(unit, None)

    def hold(self) -> ClaimScope:
        """Guard this bare lease (``claim_next``'s) for an ``async with`` body, as
        ``Client.claim`` does: renewed in the background, the body cancelled and
        ``LeaseLost`` raised when it is lost, released when the body ends uncommitted."""
        self.guarded = True

        async def itself() -> Lease:
            return self

        return ClaimScope(itself)

    def _identity(self) -> dict[str, Any]:
        return {
            "attemptId": self.attempt_id,
            "claimGeneration": self.claim_generation,
            "owner": self.owner,
            "schedulerEpoch": self.scheduler_epoch,
            "cancelGeneration": self.cancel_generation,
        }

    def _lose(self, reason: str, cause: ProblemError | None = None) -> None:
        """Mark the lease lost; a guarded body that is not committing is cancelled."""
        if self._lost is not None or self._commit is not None:
            return
        lost = LeaseLost(self.task_id, reason, cause)
        lost.__cause__ = cause
        self._lost = lost
        current = asyncio.current_task()
        owner = self._owner
        if (
            self.guarded
            and self._in_body
            and not self._committing
            and owner is not None
            and owner is not current
            and not owner.done()
        ):
            self._cancel_requested = True
            owner.cancel(msg=f"fencegate: {lost}")
        if self._keeper is not None and self._keeper is not current:
            self._keeper.cancel()

    def _refused(self, exc: ProblemError, what: str) -> None:
        if exc.code in LEASE_ENDING_CODES:
            self._lose(f"{what} refused: {exc.code}", exc)

    def _guard(self) -> None:
        """A guarded lease sends nothing once it is lost, released or run out."""
        if not self.guarded:
            return
        if self._released:
            raise LeaseLost(self.task_id, "the lease was released")
        if self._lost is None and self._commit is None and self.expires_in <= 0:
            self._lose("the lease ran out before a renewal got through")
        if self._lost is not None:
            raise LeaseLost(self.task_id, self._lost.reason, self._lost.cause) from self._lost.cause

    # --- coordination calls -----------------------------------------------------------------

    async def renew(
        self, ttl_ms: int | None = None, *, cost: Mapping[str, float] | None = None
    ) -> int:
        """Extend the lease by ``ttl_ms`` (default: the claim's); answers ``leaseExpiresAt``.
        ``cost``: what the attempt spent since its last report (with ``add_cost``'s).

        Raises ``Fenced``, ``LeaseExpired``, ``StaleEpoch``, ``Cancelled``, ``StaleInput`` or
        ``RuntimeExceeded`` when the lease is over (and marks it lost).
        """
        self._guard()
        ttl = ttl_ms or self.ttl_ms
        sent = self._clock.now()
        spent = self._take_cost(cost)
        body: dict[str, Any] = {**self._identity(), "ttlMs": ttl}
        if spent:
            body["cost"] = spent
        try:
            _, answer = await self._client.call("POST", task_path(self.task_id, "renew"), body)
        except ProblemError as exc:
            self._sent_cost(spent)
            self._refused(exc, "renew")
            raise
        self._sent_cost(spent)
        expires = int(answer["leaseExpiresAt"])
        self.lease_expires_at = expires
        mapped = self._mono_t0 + (expires - self._store_t0) / 1000
        self._deadline = min(mapped, sent + ttl / 1000)
        return expires

    async def release(self, *, cost: Mapping[str, float] | None = None) -> None:
        """Hand the task back (READY again). The lease cannot be used afterwards. ``cost``:
        what the attempt spent since its last report (handed back on purpose: not counted as
        discarded)."""
        self._released = True
        self._stop_keeper_soon()
        spent = self._take_cost(cost)
        body = {**self._identity(), **({"cost": spent} if spent else {})}
        try:
            await self._client.call("POST", task_path(self.task_id, "release"), body)
        except ProblemError:
            self._sent_cost(spent)
            raise
        self._sent_cost(spent)

    async def commit(
        self,
        result: Any = None,
        *,
        result_digest: str | None = None,
        store_result: bool = True,
        cost: Mapping[str, float] | None = None,
    ) -> Commit:
        """Commit the task's result: the one canonical commit of this revision.

        ``resultDigest`` is ``result_digest(result)`` (canonical JSON) unless given; the
        result itself is stored with the commit when ``store_result`` (and not None). Answers
        the ``Commit`` (COMMITTED); raises ``Fenced``, ``StaleInput``, ``Cancelled``,
        ``StaleEpoch`` (or ``AlreadyCommitted``) otherwise. A commit whose answer was lost is
        sent again with the same digest: the gateway answers the recorded commit (and counts
        its ``cost`` again: cost is an increment). ``cost``: what the attempt spent since its
        last report (with ``add_cost``'s).
        """
        digest = result_digest or _result_digest(result)
        body: dict[str, Any] = {
            "attemptId": self.attempt_id,
            "claimGeneration": self.claim_generation,
            "schedulerEpoch": self.scheduler_epoch,
            "cancelGeneration": self.cancel_generation,
            "inputDigest": self.input_digest,
            "resultDigest": digest,
        }
        if store_result and result is not None:
            body["result"] = result
        spent = self._take_cost(cost)
        if spent:
            body["cost"] = spent
        path = task_path(self.task_id, "commit")
        self._committing += 1
        try:
            for attempt in range(3):
                try:
                    _, answer = await self._client.call("POST", path, body)
                    break
                except (GatewayUnreachable, StoreUnavailable):
                    if attempt == 2:
                        raise
                    await asyncio.sleep(0.1 * 2**attempt)
                except ProblemError as exc:
                    self._sent_cost(spent)
                    self._refused(exc, "commit")
                    raise
        finally:
            self._committing -= 1
        self._sent_cost(spent)
        self._commit = Commit(str(answer["commitId"]), digest, str(answer["outcome"]))
        self._lost = None  # lost meanwhile (it ran out locally) but committed: it won
        self._stop_keeper_soon()
        return self._commit

    # --- proxied calls ----------------------------------------------------------------------

    async def request(
        self,
        downstream: str,
        method: str,
        path: str,
        *,
        slot: str | None = None,
        node: str | None = None,
        json: Any = _NO_JSON,
        data: bytes | str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        wait_in_flight: float = 0.0,
        timeout_s: float | None = None,
        wait: float | None = None,
    ) -> ProxyResponse:
        """Send one call to ``downstream`` through the gateway, under this lease.

        ``slot`` names the side effect (required for anything but GET/HEAD/OPTIONS): the same
        task, revision, node and slot is the same effect, sent at most once. Returns the
        downstream's answer (or the ledger's replay of it: ``replayed``), whatever its status.
        Raises the gateway's refusals as typed errors: ``Fenced`` / ``LeaseExpired`` /
        ``StaleEpoch`` / ``Cancelled`` (nothing was forwarded), ``PayloadConflict``,
        ``EffectUnknown``, ``EffectInFlight`` (``retry_after``), ``ApprovalRequired``,
        ``DownstreamTimeout`` (the effect is now UNKNOWN), ``DownstreamUnreachable``...
        With ``wait_in_flight`` > 0, ``EffectInFlight`` is waited out for up to that many
        seconds (``wait_out_in_flight``). ``timeout_s`` bounds the call (default: the
        client's timeout; keep it above the downstream's ``timeout_ms``). ``wait`` (seconds)
        sends ``Prefer: wait=N``: a duplicate of an effect in flight waits at the gateway for
        its outcome (the replay, ``EffectUnknown``, or a fresh forward after NOT_APPLIED)
        instead of being refused ``EffectInFlight`` at once; ``timeout_s`` grows by as much.
        """
        call = proxy_call(
            downstream, method, path, json=json, data=data, headers=headers, params=params
        )
        if slot is None and call.verb not in SAFE_METHODS:
            raise ValueError(f"{call.verb} changes something: name its side effect with slot=...")
        all_headers = {**call.headers, **self.fence_headers(slot=slot, node=node)}
        if wait is not None:
            all_headers["Prefer"] = prefer_wait(wait)
            timeout_s = (timeout_s or self._client.timeout) + wait

        async def once() -> ProxyResponse:
            self._guard()
            answer = await self._client.send(
                call.verb, call.target, body=call.body, headers=all_headers, timeout_s=timeout_s
            )
            problem = gateway_problem(answer)
            if problem is not None:
                self._refused(problem, f"{call.verb} {downstream}")
                raise problem
            return ProxyResponse.of(answer)

        if wait_in_flight > 0:
            return await wait_out_in_flight(once, max_wait_s=wait_in_flight)
        return await once()

    # --- the guarded form -------------------------------------------------------------------

    def _enter(self) -> None:
        owner = asyncio.current_task()
        if owner is None:
            raise RuntimeError("a guarded lease needs a running asyncio task")
        self._owner = owner
        self._cancelling = owner.cancelling()
        self._in_body = True
        self._keeper = asyncio.create_task(
            self._keep_alive(), name=f"fencegate-renew:{self.task_id}"
        )

    async def _keep_alive(self) -> None:
        period = self.renew_interval
        failures = 0
        while self._lost is None and self._commit is None and not self._released:
            if failures:
                delay = period / 4 * random.uniform(0.5, 1.0)
            else:
                delay = period * random.uniform(0.75, 1.0)
            # Wake no later than the moment the lease would run out.
            await self._clock.sleep(max(min(delay, self.expires_in + 0.001), 0))
            if self._lost is not None or self._commit is not None or self._released:
                return
            left = self.expires_in
            if left <= 0:
                self._lose("the lease ran out before a renewal got through")
                return
            try:
                async with asyncio.timeout(left):
                    await self.renew()
                failures = 0
            except ProblemError as exc:
                if exc.code in LEASE_ENDING_CODES:
                    return  # renew() marked the lease lost and cancelled the body
                if exc.status < 500:
                    self._lose(f"renew refused: {exc.code}", exc)
                    return
                failures += 1  # STORE_UNAVAILABLE and friends: try again while time is left
            except (GatewayUnreachable, TimeoutError):
                failures += 1
            except FencegateError:
                return  # LeaseLost from the guard: already lost
            except Exception as exc:  # a bug must not leave the body running unrenewed
                self._lose(f"renewal failed: {exc!r}")
                return

    def _stop_keeper_soon(self) -> None:
        keeper = self._keeper
        if keeper is not None and keeper is not asyncio.current_task() and not keeper.done():
            keeper.cancel()

    async def _stop_keeper(self) -> None:
        keeper = self._keeper
        if keeper is None:
            return
        self._stop_keeper_soon()
        if keeper is not asyncio.current_task():
            await asyncio.wait([keeper])

    async def _exit(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> bool:
        self._in_body = False
        ours = False
        if self._cancel_requested and self._owner is not None:
            self._cancel_requested = False
            remaining = self._owner.uncancel()
            ours = remaining <= self._cancelling and exc_type is asyncio.CancelledError
        await self._stop_keeper()
        lost = self._lost
        if self._commit is None and lost is not None and not self._released:
            ending = isinstance(exc, LeaseLost) or (
                isinstance(exc, ProblemError) and exc.code in LEASE_ENDING_CODES
            )
            if exc is None or ours or ending:
                raise LeaseLost(self.task_id, lost.reason, lost.cause) from lost.cause
            return False  # an unrelated error of the body goes on as it is
        if ours:
            return True  # the body caught our cancellation and still committed
        if self._commit is None and not self._released and lost is None:
            with contextlib.suppress(FencegateError):  # else it runs out on its own
                await self.release()
        return False


class ClaimScope:
    """``async with client.claim(...) as lease:`` (see ``Client.claim``).

    ``acquire`` claims the task and answers the guarded lease; it runs on entry.
    """

    def __init__(self, acquire: Callable[[], Awaitable[Lease]]) -> None:
        self._acquire = acquire
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        lease = await self._acquire()
        lease._enter()
        self._lease = lease
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._lease is not None
        return await self._lease._exit(exc_type, exc)
