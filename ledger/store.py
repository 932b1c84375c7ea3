"""The one interface every store implements, and what a store module declares about itself.

The factory that picks a store from a URL lives in ``ledger.registry``: store modules depend
on this interface, never the other way round.

A store owns time (``now`` is read from the store, never from a worker) and atomicity: each
method is one atomic step that reads what it needs, applies a pure transition from
``ledger.tasks`` and writes the result, or writes nothing and raises a ``FencegateError``.
Any failure to reach the store surfaces as ``StoreUnavailable``, never as a driver exception.
"""

from __future__ import annotations

import abc
import base64
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fencegate.ledger.effects import Effect, EffectRequest, EffectState, Fence, PrepareOutcome
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.events import Event
from fencegate.ledger.queries import Gauges, TaskFilter
from fencegate.ledger.retention import ExpiryReport, StoreStats
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    PutOutcome,
    RenewRequest,
    Scheduler,
    Task,
)

__all__ = [
    "EffectTransition",
    "Gauges",
    "Migration",
    "Store",
    "StoreKind",
    "StoreOptions",
    "decode_cursor",
    "decode_task_cursor",
    "encode_cursor",
    "encode_task_cursor",
    "new_id",
]

#: An operator or reconciler step over one effect record: (record or None, now) -> new record.
EffectTransition = Callable[[Effect | None, int], Effect]


#: The contract's task id grammar (a cursor must decode to one).
_TASK_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")


def new_id() -> str:
    """Opaque ids for attempts and commits: random, so a restarted gateway never reuses one."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """The ``[store]`` settings a store may use besides its URL (each store reads its own)."""

    timeout_ms: int
    sqlite_synchronous: str = "FULL"
    redis_key_prefix: str = "fg"
    #: The store's password (Redis, PostgreSQL), from the environment (``store.password_env``).
    password: str | None = None
    redis_max_connections: int = 200
    postgres_max_connections: int = 20
    #: Most dependents one task may have (``[tasks] max_dependents``).
    max_dependents: int = 1_000
    #: Most dependents one cancel cascades to in its own step (``[tasks] max_cascade``).
    max_cascade: int = 1_000
    #: Redis: replicas that must acknowledge every write step (``WAIT``); 0: none.
    redis_min_replicas: int = 0
    #: Redis: how long that ``WAIT`` waits, below ``timeout_ms``.
    redis_replica_timeout_ms: int = 500
    #: Redis Cluster: the buckets the keys are spread over (``[store] cluster_buckets``).
    cluster_buckets: int = 256
    #: Redis Cluster: the age of a queue's hint that makes a claim rescan every bucket
    #: (``[store] cluster_queue_rescan_ms``).
    cluster_queue_rescan_ms: int = 1_000


@dataclass(frozen=True, slots=True)
class Migration:
    """What ``Store.migrate`` found and did, for a person reading it."""

    store: str
    #: The format the store was in (None: a store nothing had written yet).
    found: int | None
    #: The format it is in now: this code's.
    current: int
    #: What was done, one line each (empty: it was already current).
    done: tuple[str, ...] = ()
    #: What may run beside it, and what to do after (the upgrade rule for this store).
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        found = "empty" if self.found is None else f"format {self.found}"
        head = (
            f"already in format {self.current}: nothing to do"
            if not self.done
            else f"migrated from {found} to format {self.current}"
        )
        return [head, *(f"  {line}" for line in self.done), *self.notes]


@dataclass(frozen=True, slots=True)
class StoreKind:
    """What a store module declares about itself (its module-level ``STORE_KIND``), for
    ``ledger.registry``: the URL schemes it serves, how to check such a URL at start-up, and
    how to build the store (not yet open)."""

    schemes: tuple[str, ...]
    #: The URL form(s) to show in errors, e.g. ``sqlite:///PATH``.
    example: str
    #: Raises ValueError (with what to write instead) for a URL of its schemes it cannot use.
    check_url: Callable[[str], None]
    create: Callable[[str, LeasePolicy, StoreOptions], Store]


def encode_cursor(created_at: int, effect_id: str) -> str:
    """Position after one effect in (createdAt, effectId) order, opaque to clients."""
    raw = f"{created_at}:{effect_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


#: What ``encode_cursor`` writes: a creation time in milliseconds (ASCII digits, at most 15,
#: which Redis' index pads to and every SQL integer holds) and an effect id.
_EFFECT_CURSOR = re.compile(r"([0-9]{1,15}):([0-9a-f]{64})")


def _cursor_text(cursor: str) -> str:
    """The text inside a cursor, only if ``cursor`` is exactly what this gateway writes for it
    (unpadded URL-safe base64 of UTF-8): the decoder alone skips stray characters and takes
    padding, and a cursor that decodes but does not round-trip was not issued here."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except ValueError as exc:  # binascii.Error, non-ASCII input, not UTF-8
        raise BadRequest("cursor: not a cursor this gateway issued") from exc
    if base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=") != cursor:
        raise BadRequest("cursor: not a cursor this gateway issued")
    return raw


def decode_cursor(cursor: str) -> tuple[int, str]:
    """The (createdAt, effectId) a cursor continues after. Anything else is 400 before a
    store sees it: a number past a SQL integer (SQLite's driver raised OverflowError, a 500)
    or an effect id with a NUL (PostgreSQL refuses it) never reaches a query."""
    match = _EFFECT_CURSOR.fullmatch(_cursor_text(cursor))
    if match is None:
        raise BadRequest("cursor: not a cursor this gateway issued")
    return int(match[1]), match[2]


#: Most task records one ``list_tasks`` call reads before it answers (with a cursor).
TASK_SCAN = 1000
_TASK_CURSOR = "task:"


def encode_task_cursor(task_id: str) -> str:
    """Position after one task in task id order, opaque to clients."""
    return base64.urlsafe_b64encode((_TASK_CURSOR + task_id).encode()).decode().rstrip("=")


def decode_task_cursor(cursor: str) -> str:
    """The task id a cursor continues after; a cursor this gateway did not issue is 400."""
    raw = _cursor_text(cursor)
    task_id = raw.removeprefix(_TASK_CURSOR)
    if task_id == raw or not _TASK_ID.fullmatch(task_id):
        raise BadRequest("cursor: not a cursor this gateway issued")
    return task_id


class Store(abc.ABC):
    """Durable lease state. ``clock_offset_ms`` exists for tests only (see ``tests/``): it is
    added to the store's time source so expiry can be driven without sleeping, and no config
    key reaches it."""

    clock_offset_ms: int = 0
    #: Most dependents one task may have (``[tasks] max_dependents``, via ``StoreOptions``):
    #: a commit rewrites up to that many in its step.
    max_dependents: int = 1_000
    #: Most tasks one cancel step cascades to (``[tasks] max_cascade``); the rest is left to
    #: ``continue_cascades``.
    max_cascade: int = 1_000

    def __init__(self, policy: LeasePolicy) -> None:
        self.policy = policy
        #: Called with (operation, seconds) after every answered store call; metrics hook it.
        self.observe: Callable[[str, float], None] = lambda op, seconds: None

    @property
    def regressed(self) -> bool:
        """Has the store lost writes this gateway saw acknowledged (so writes are refused
        until ``acknowledge_failover``)? Only a store that can fail over without its writes
        (Redis) ever says so."""
        return False

    async def acknowledge_failover(self) -> Scheduler:
        """An operator's acknowledgement of lost writes (``fencegate failover ack``): fence
        every claim granted before and let writes go on. Stores that cannot lose acknowledged
        writes this way have nothing to acknowledge."""
        raise BadRequest(
            f"the {self.kind} store does not detect lost writes: there is nothing to acknowledge"
        )

    async def durability(self) -> list[str]:
        """What an answered transition could lose under the store's current settings."""
        return []

    @property
    @abc.abstractmethod
    def kind(self) -> str:
        """``sqlite``, ``redis`` or ``postgres``: a label for logs and metrics."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and prepare (schema, scripts, durability checks)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def ping(self) -> None:
        """One round trip; raises StoreUnavailable when the store cannot answer."""

    @abc.abstractmethod
    async def now_ms(self) -> int:
        """The store's clock, the only clock leases are measured against."""

    @abc.abstractmethod
    async def put_task(
        self,
        task_id: str,
        input_digest: str,
        max_runtime_ms: int | None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        depends_on: tuple[str, ...] | None = None,
    ) -> tuple[Task, PutOutcome]:
        """``ledger.tasks.put`` plus the dependency rules, in one atomic step: the new
        dependencies are checked (unknown ids, cycles: ``tasks.MAX_GRAPH_VISITS``, at most
        ``max_dependents`` dependents per task), and a new revision of a committed task sends
        its open dependents back to WAITING (``tasks.dependency_revised``)."""

    @abc.abstractmethod
    async def get_task(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def list_tasks(
        self, wanted: TaskFilter, limit: int, after: str | None
    ) -> tuple[list[Task], str | None]:
        """Tasks in task id order after ``after``, filtered (``ledger.queries.page_tasks``),
        and the task id to continue after (None at the end). Reads at most ``TASK_SCAN``
        records per call, so a page may be short while the answer says to go on.
        ``wanted.lease_expired`` is judged by the store's clock, read once per call."""

    @abc.abstractmethod
    async def claim(self, task_id: str, request: ClaimRequest) -> Task: ...

    @abc.abstractmethod
    async def claim_next(self, queue: str, request: ClaimRequest) -> Task | None:
        """``ledger.tasks.claim_next`` over the queue's tasks, from the store's own index
        (never a scan of the queue): the best claimable task, claimed, or None."""

    @abc.abstractmethod
    async def renew(self, task_id: str, request: RenewRequest) -> Task: ...

    @abc.abstractmethod
    async def release(self, task_id: str, identity: Identity) -> Task: ...

    @abc.abstractmethod
    async def commit(self, task_id: str, request: CommitRequest) -> tuple[Task, bool]:
        """Returns the task and True when this was a replay of an earlier identical commit.
        A first commit also records itself in its open dependents
        (``tasks.dependency_committed``) in the same step."""

    @abc.abstractmethod
    async def cancel(self, task_id: str) -> Task:
        """Cancel, and cascade to the open dependents, transitively (``tasks.cancel_dependent``),
        breadth first: in the same step until ``max_cascade`` tasks were cancelled, then the
        tasks whose dependents are still to be visited are recorded for
        ``continue_cascades``. Every open dependent of a cancelled task is WAITING (it lacks
        that task's commit), so the ones not reached yet cannot be claimed meanwhile."""

    @abc.abstractmethod
    async def continue_cascades(self, limit: int) -> int:
        """Carry recorded cascades on: one atomic step cancelling up to about ``limit``
        tasks; returns how many records and tasks it handled (0: nothing was pending, so
        the caller may wait longer before it asks again). A recorded task that is no longer
        CANCELLED (revised since) stops its cascade."""

    # --- the change feed (ledger.events) ------------------------------------------------------

    @abc.abstractmethod
    async def read_events(self, after: str | None, limit: int) -> tuple[list[Event], str]:
        """Up to ``limit`` events after position ``after``, oldest first, and the position to
        go on from. ``after`` None: from the current end (no events, just the position).
        Raises ``EventsGone`` for a position older than the retained history or ahead of the
        newest this store issued (``events.gone``), ``BadRequest`` for one this store cannot
        have issued (malformed, out of its range)."""

    @abc.abstractmethod
    async def trim_events(self, keep: int) -> int:
        """Drop all but (about) the newest ``keep`` events; returns how many went."""

    @abc.abstractmethod
    async def get_scheduler(self) -> Scheduler: ...

    @abc.abstractmethod
    async def bump_epoch(self) -> Scheduler: ...

    @abc.abstractmethod
    async def set_claims_paused(self, paused: bool) -> Scheduler: ...

    # --- the idempotency ledger ---------------------------------------------------------------

    @abc.abstractmethod
    async def check_fence(self, fence: Fence) -> Task:
        """Validate a claim without recording anything (safe methods)."""

    @abc.abstractmethod
    async def prepare_effect(
        self,
        request: EffectRequest,
        forward_deadline_ms: int,
        *,
        resend_window_ms: int | None = None,
        require_approval: bool = False,
    ) -> PrepareOutcome:
        """Step one of a proxied mutation: validate the claim and decide, in one atomic step.

        Raises when the claim is refused; returns REJECT outcomes (with their error) when the
        effect record refuses, after writing any deadline conversion the decision made.
        A keyed request (``request.fence`` None: a lease-less client's, by its idempotency
        key) reads no task and no scheduler: its record is ``request.effect_id``'s, and an
        unforgotten tombstone of that id refuses it ``EFFECT_EXPIRED``."""

    @abc.abstractmethod
    async def complete_effect(
        self,
        task_id: str | None,
        effect_id: str,
        seq: int,
        attempt_id: str,
        outcome: EffectState,
        reason: str,
        response_json: str | None,
    ) -> tuple[Effect, bool]:
        """Step two: record forward ``seq``'s outcome unless the record has moved on."""

    @abc.abstractmethod
    async def get_effect(self, effect_id: str) -> Effect:
        """The record as of now (a PREPARED past its deadline reads as UNKNOWN)."""

    async def get_keyed_effect(self, effect_id: str) -> Effect:
        """``get_effect`` of an id that can only be a keyed effect's
        (``effects.keyed_effect_id``): a store that places keyed effects by their id (Redis
        Cluster) reads only that place, so a client's look-up by its own idempotency key
        costs one read, never a search of the store."""
        return await self.get_effect(effect_id)

    @abc.abstractmethod
    async def find_effects(self, prefix: str, limit: int) -> list[str]:
        """The ids of up to ``limit`` live effects whose id starts with ``prefix`` (lowercase
        hex), in id order, from the store's own index: never a scan of the ledger
        (``ledger.queries.effects_with_prefix``). An expired effect is not found by a
        prefix (its full id still answers ``EFFECT_EXPIRED``)."""

    @abc.abstractmethod
    async def list_effects(
        self,
        *,
        state: EffectState | None,
        task_id: str | None,
        downstream: str | None,
        limit: int,
        cursor: str | None,
    ) -> tuple[list[Effect], str | None]:
        """Effects in creation order, filtered; ``nextCursor`` is None at the end.

        A page may hold fewer than ``limit`` records while ``nextCursor`` is set (the store
        bounds how much it scans per call); keep following the cursor."""

    @abc.abstractmethod
    async def unsettled_effects(
        self, limit: int, probe_downstreams: frozenset[str]
    ) -> list[Effect]:
        """The reconciler's work list, from the store's own indexes (never a scan of the
        whole ledger): up to ``limit`` PREPARED effects past their deadline, and up to
        ``limit`` UNKNOWN effects of ``probe_downstreams`` whose next probe is due, in the
        order they fall due, so every probe effect makes progress however many UNKNOWN
        effects wait for an operator."""

    @abc.abstractmethod
    async def awaiting_approval(self, limit: int) -> list[Effect]:
        """Up to ``limit`` effects waiting for an operator's approval
        (``effects.is_awaiting_approval``), oldest first, from the store's own index: the
        operator's queue, which a scan of every NOT_APPLIED record cannot keep complete once
        retention holds many of them."""

    @abc.abstractmethod
    async def find_forward(self, task_id: str, forward_id: str) -> str | None:
        """The effectId whose last forward is ``forward_id``, if the store has it."""

    @abc.abstractmethod
    async def gauges(self) -> Gauges:
        """Counts kept cheap by the store's own indexes (one round trip)."""

    # --- retention (ledger.retention) --------------------------------------------------------

    @abc.abstractmethod
    async def expire_settled(self, settled_ms: int, tombstone_ms: int, limit: int) -> ExpiryReport:
        """One atomic step of the retention sweep. Reads up to ``limit`` tasks from the
        settled index whose ``due_at`` is at or before now - ``settled_ms``, oldest first;
        each one ``retention.why_kept`` lets go is deleted with its effects, its dependents
        record and every index entry, and leaves a task tombstone and one effect tombstone
        per effect (``forget_at`` = now + ``tombstone_ms``); each one still needed gets
        ``due_at`` = now (looked at again ``settled_ms`` later). Also removes up to ``limit``
        tombstones past their ``forget_at``. Several gateways may sweep at once.

        Keyed effects (no task) have their own index of the settled ones
        (``effects.keyed_settled``, due from when they settled): the same step reads up to
        ``limit`` of them due at now - ``settled_ms`` and deletes each one
        ``retention.why_kept_keyed`` lets go, leaving an effect tombstone without a task."""

    @abc.abstractmethod
    async def migrate(self) -> Migration:
        """Bring a store written by an older fencegate to this code's format (every step
        idempotent: an interrupted run is finished by running it again) and say what was
        found and done. A newer format raises ``StoreIncompatible``."""

    @abc.abstractmethod
    async def store_stats(self, settled_ms: int) -> StoreStats:
        """Sizes from the store's own indexes and counters, never a scan of the records."""

    @abc.abstractmethod
    async def update_effect(self, effect_id: str, transition: EffectTransition) -> Effect:
        """Apply an operator or reconciler transition (``ledger.effects.resolve``, ``approve``,
        ``begin_probe``...) atomically: ``transition(record, now)`` returns the new record or
        raises, and the store writes it only if the record did not change meanwhile."""
