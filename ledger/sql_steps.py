"""The SQL stores' transitions, written once for SQLite and PostgreSQL.

Each transition is load -> decide (a pure function of ``ledger.tasks`` / ``ledger.effects``)
-> save, written as a generator that yields the statements it needs (``Sql``) and receives
their rows. The generator does no I/O itself, so one text serves a synchronous driver (the
SQLite writer thread, ``run_sync``) and an asynchronous one (asyncpg, ``PostgresStore``): each
store supplies only its ``Dialect`` (SQL fragments that differ), its locking and its
connection handling. A step asks for the store's time with ``NOW`` after it holds its locks,
so a step that waited for a lock never decides with an instant older than the step it waited
for.

Locking (PostgreSQL; SQLite runs one step at a time and its fragments are empty): a writing
step loads the rows it will write ``FOR UPDATE`` (the task, then the effect: one order, no
deadlock), and a step that reads the scheduler epoch to decide takes the dialect's *shared*
scheduler lock first, while ``bump_epoch`` and ``set_claims_paused`` take it *exclusively*
(docs/stores.md, "The epoch without a global lock"). A row that does not exist yet cannot be
locked: the step INSERTs it without ``ON CONFLICT``, so of two steps that both saw no row one
fails with a unique violation and its driver runs the step again from the start.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from fencegate.ledger import effects, events, queries, retention, tasks
from fencegate.ledger.effects import Effect, EffectRequest, EffectState, Fence, PrepareOutcome
from fencegate.ledger.errors import (
    BadRequest,
    EffectExpired,
    FencegateError,
    NoSuchEffect,
    NoSuchTask,
    StoreIncompatible,
    StoreUnavailable,
    TaskExpired,
)
from fencegate.ledger.events import Event
from fencegate.ledger.queries import Gauges, TaskFilter, effect_prefix_bounds, page_tasks
from fencegate.ledger.retention import EffectTombstone, ExpiryReport, StoreStats
from fencegate.ledger.store import TASK_SCAN, EffectTransition, encode_cursor
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    PutOutcome,
    RenewRequest,
    Scheduler,
    Task,
    TaskState,
    Tombstone,
)

__all__ = [
    "KEYED_TABLES",
    "NOW",
    "RETENTION_TABLES",
    "SCHEMA_VERSION",
    "SETTLED_STATES_SQL",
    "STORE_TABLES",
    "TASK_FLOW_COLUMNS",
    "TRIM_BATCH",
    "Dialect",
    "Sql",
    "Step",
    "backfill_settled",
    "check_schema_version",
    "expired_refusal",
    "run_sync",
]

T = TypeVar("T")

#: The version of the tables these steps read and write. A store finding a newer one in its
#: database refuses to start: a newer fencegate wrote rows this code may misread.
SCHEMA_VERSION = 4
#: Version 2 (task flow): tasks gained the columns ``queue``, ``priority``, ``ready_at``,
#: ``claim_epoch`` (every row of version 1 has no queue: NULLs are right for it), the tables
#: ``dependents`` and ``events`` (with triggers filling it) came new. A store opening a
#: version-1 database adds them and writes 2 (``TASK_FLOW_COLUMNS``).
#: Version 3 (retention): the tables ``settled`` (kept by triggers on ``tasks``),
#: ``task_tombstones`` and ``effect_tombstones`` (``RETENTION_TABLES``). A store opening a
#: version-1 or -2 database adds them (and version 2's), fills ``settled`` from the tasks
#: already settled (``backfill_settled``) and writes 3, in one transaction.
#: Version 4 (keyed effects, a lease-less client's, ``effects.Effect.kind``): the table
#: ``keyed_settled`` (``KEYED_TABLES``), and the effect events' ``taskId`` null for a keyed
#: effect (its row holds ``''`` in ``effects.task_id``: ``NO_TASK``). Nothing to backfill: no
#: older gateway wrote a keyed effect.

#: What a keyed effect's row holds in the columns ``effects.task_id`` and
#: ``effect_tombstones.task_id`` (NOT NULL since version 1; a task id is never empty). Its
#: record says None (the JSON ``fields`` leave the task fields out), and so do the change
#: feed's triggers (``NULLIF``).
NO_TASK = ""

#: The columns version 2 added to ``tasks`` (name, portable type).
TASK_FLOW_COLUMNS = (
    ("queue", "TEXT"),
    ("priority", "INTEGER NOT NULL DEFAULT 0"),
    ("ready_at", "BIGINT"),
    ("claim_epoch", "BIGINT"),
)


#: The tables version 3 added, portable DDL (each statement idempotent). ``settled`` is the
#: settled index: one row per COMMITTED or CANCELLED task, ``due_at`` its ``updated_at`` when
#: it settled (or when a sweep last kept it). The tombstones hold every field of
#: ``tasks.Tombstone`` and ``retention.EffectTombstone``; ``forget_at`` is indexed for the
#: sweep that forgets them and for counting the live ones.
RETENTION_TABLES = (
    """CREATE TABLE IF NOT EXISTS settled (
        task_id TEXT PRIMARY KEY,
        due_at  BIGINT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS settled_due ON settled (due_at, task_id)",
    """CREATE TABLE IF NOT EXISTS task_tombstones (
        task_id           TEXT PRIMARY KEY,
        revision          BIGINT NOT NULL,
        claim_generation  BIGINT NOT NULL,
        cancel_generation BIGINT NOT NULL,
        input_digest      TEXT NOT NULL,
        state             TEXT NOT NULL,
        expired_at        BIGINT NOT NULL,
        forget_at         BIGINT NOT NULL,
        effects           BIGINT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS task_tombstones_forget ON task_tombstones (forget_at)",
    """CREATE TABLE IF NOT EXISTS effect_tombstones (
        effect_id  TEXT PRIMARY KEY,
        task_id    TEXT NOT NULL,
        state      TEXT NOT NULL,
        expired_at BIGINT NOT NULL,
        forget_at  BIGINT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS effect_tombstones_forget ON effect_tombstones (forget_at)",
)

#: The table version 4 added, portable DDL (each statement idempotent): the keyed index, one
#: row per keyed effect ``effects.keyed_settled`` holds, ``due_at`` the ``updated_at`` at which
#: it entered the set (or when a sweep last kept it). Kept by the steps that write effects
#: (``save_effect``), in their transaction: the rule reads the record's JSON, which the
#: triggers of two dialects would each have to mirror.
KEYED_TABLES = (
    """CREATE TABLE IF NOT EXISTS keyed_settled (
        effect_id TEXT PRIMARY KEY,
        due_at    BIGINT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS keyed_settled_due ON keyed_settled (due_at, effect_id)",
)

#: Every table of fencegate's schema (what ``store_stats`` sizes, where a store can tell).
STORE_TABLES = (
    "tasks",
    "effects",
    "dependents",
    "cascades",
    "events",
    "events_trimmed",
    "scheduler",
    "settled",
    "task_tombstones",
    "effect_tombstones",
    "keyed_settled",
    "fencegate_schema",
)

#: The task states the settled index holds, as a SQL list (``retention.SETTLED_TASK_STATES``;
#: the stores' triggers use the same list).
SETTLED_STATES_SQL = "('COMMITTED', 'CANCELLED')"


def backfill_settled(d: Dialect) -> str:
    """The upgrade to version 3's one data step: an entry in ``settled`` for every task
    already settled, due from its ``updated_at`` (the instant it settled: nothing changes a
    settled task's record but a new revision, which opens it). Idempotent."""
    return (
        "INSERT INTO settled (task_id, due_at) "
        f"SELECT task_id, {d.json_int('updated_at')} FROM tasks "
        f"WHERE state IN {SETTLED_STATES_SQL} ON CONFLICT (task_id) DO NOTHING"
    )


def check_schema_version(found: int, where: str) -> None:
    """Refuse a schema newer than this code (written by a newer fencegate): reading its rows
    with older rules could misjudge a lease or an effect."""
    if found > SCHEMA_VERSION:
        raise StoreIncompatible(
            f"{where} holds fencegate schema version {found}, newer than this gateway's "
            f"{SCHEMA_VERSION}: run the fencegate version that wrote it (or newer)"
        )


@dataclass(frozen=True, slots=True)
class Sql:
    """One statement a step needs: ``?`` placeholders, portable SQL, and what it answers
    (``one`` row or None, ``all`` rows, ``none``; ``now`` is ``NOW``)."""

    text: str
    args: tuple[Any, ...] = ()
    rows: Literal["one", "all", "none", "now"] = "none"


#: Yielded by a step for the store's time (an int, ms); the driver answers it.
NOW = Sql("", (), "now")

#: A transition: yields statements, receives rows (a row is indexable), returns the answer.
Step = Generator[Sql, Any, T]


@dataclass(frozen=True, slots=True)
class Dialect:
    """What differs between the SQL stores, as fragments the steps splice in."""

    #: Appended to a SELECT of a row the step will write (``" FOR UPDATE"`` or empty).
    for_update: str
    #: Run before reading the scheduler to decide (shared) or to change it (exclusive);
    #: empty where steps never run concurrently.
    lock_scheduler_shared: str
    lock_scheduler_exclusive: str
    #: SQL giving the text of key ``k`` of the JSON in column ``fields``.
    json_text: Callable[[str], str]
    #: SQL giving key ``k`` of the JSON in column ``fields`` as an integer (NULL if absent).
    json_int: Callable[[str], str]
    #: Appended to the SELECT that picks a queue's next task (``" FOR UPDATE SKIP LOCKED"``:
    #: concurrent claimers each take a different row instead of queueing on one).
    for_update_skip_locked: str
    #: Run before a put that changes a task's dependencies (exclusive): such puts happen one
    #: at a time, so the cycle check walks a graph no concurrent put is changing.
    lock_dependency_graph: str
    #: SQL condition an ``events`` row must meet to be read: its transaction can no longer be
    #: overtaken by one still running (PostgreSQL: ``postgres_store._EVENTS_HORIZON``).
    events_visible: str
    #: SELECT of the position "after everything visible now" (two columns: xid, seq).
    events_end: str
    #: SELECT of the newest position this store has issued, an event's or ``events_end``'s
    #: (two columns named ``xid`` and ``seq``): a high-water mark that no trim lowers, and
    #: only a loss of what the store had issued (a restore of an older copy, a failover that
    #: lost commits) takes back. A position above it is ``EventsGone`` (``events.gone``).
    events_newest: str
    #: SELECT of (table, bytes) rows, one per table of ``STORE_TABLES`` (tables and their
    #: indexes), or empty where that is not cheap to tell (``store_stats``).
    table_bytes: str
    #: SELECT of the whole store's size in bytes (one value), used when ``table_bytes`` is
    #: empty; empty where the store cannot tell.
    store_bytes: str

    # SQL mirrors of the pure rules (each names the function it mirrors).
    def overdue(self) -> str:
        """``ledger.effects.is_overdue``: a PREPARED past its deadline. One ``?``: now."""
        return "(state = 'PREPARED' AND deadline_at <= ?)"

    def running(self) -> str:
        """The negation within PREPARED (``not is_overdue``). One ``?``: now."""
        return "(state = 'PREPARED' AND deadline_at > ?)"

    def awaiting(self) -> str:
        """``ledger.effects.is_awaiting_approval``: NOT_APPLIED with no attempts, or holding
        an approval."""
        return (
            f"(state = 'NOT_APPLIED' AND ({self.json_text('attempt_count')} = '0' "
            f"OR {self.json_text('approval_digest')} IS NOT NULL))"
        )

    def active_lease(self) -> str:
        """``ledger.queries.is_lease_active``: CLAIMED, unexpired. One ``?``: now."""
        return "(state = 'CLAIMED' AND lease_expires_at > ?)"

    def probe_due_at(self) -> str:
        """When an UNKNOWN effect is next due for a probe (``ledger.queries.is_probe_due``)."""
        return f"COALESCE({self.json_int('next_probe_at')}, 0)"


def run_sync(execute: Callable[[Sql], Any], step: Step[T], now: int) -> T:
    """Drive ``step`` with a synchronous ``execute`` (answers one statement) and a fixed
    ``now`` (the SQLite writer thread: steps run one at a time, so no lock is ever waited)."""
    reply: Any = None
    try:
        while True:
            sql = step.send(reply)
            reply = now if sql.rows == "now" else execute(sql)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


# --- rows ---------------------------------------------------------------------------------


def _dumps(fields: dict[str, str]) -> str:
    return json.dumps(fields, separators=(",", ":"))


def load_task(d: Dialect, task_id: str, *, lock: bool) -> Step[Task | None]:
    row = yield Sql(
        f"SELECT fields FROM tasks WHERE task_id = ?{d.for_update if lock else ''}",
        (task_id,),
        "one",
    )
    return tasks.task_from_fields(json.loads(row[0])) if row else None


def save_task(task: Task, existed: bool) -> Step[None]:
    """UPDATE a row the step loaded (and locked), INSERT one it saw absent (a concurrent
    INSERT of the same task then fails, and that step is run again)."""
    fields = _dumps(tasks.task_to_fields(task))
    columns = (
        task.state.value,
        task.lease_expires_at,
        task.queue,
        task.priority,
        task.ready_at,
        task.claim_epoch,
        fields,
    )
    if existed:
        yield Sql(
            "UPDATE tasks SET state = ?, lease_expires_at = ?, queue = ?, priority = ?, "
            "ready_at = ?, claim_epoch = ?, fields = ? WHERE task_id = ?",
            (*columns, task.task_id),
        )
    else:
        yield Sql(
            "INSERT INTO tasks (state, lease_expires_at, queue, priority, ready_at, claim_epoch, "
            "fields, task_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (*columns, task.task_id),
        )


def _task_of(row: Any) -> Task:
    return tasks.task_from_fields(json.loads(row[0]))


def dependents_of(task_id: str) -> Step[list[str]]:
    rows = yield Sql(
        "SELECT dependent_id FROM dependents WHERE task_id = ? ORDER BY dependent_id",
        (task_id,),
        "all",
    )
    return [str(r[0]) for r in rows]


def _walk_for_cycle(d: Dialect, task_id: str, start: tuple[str, ...]) -> Step[None]:
    """Would ``task_id`` depending on ``start`` close a cycle? Follows ``depends_on`` from
    ``start`` (breadth first, each task once, at most ``tasks.MAX_GRAPH_VISITS``): the mirror
    of ``ledger.task_graph.check_no_cycle``, reading the records one by one."""
    seen: set[str] = set()
    frontier = list(start)
    while frontier:
        current = frontier.pop(0)
        if current in seen:
            continue
        seen.add(current)
        if len(seen) > tasks.MAX_GRAPH_VISITS:
            raise tasks.graph_too_large()
        found = yield from load_task(d, current, lock=False)
        if found is None:
            continue
        for dep in found.depends_on:
            if dep == task_id:
                raise tasks.cycle(task_id, current)
            frontier.append(dep)


def read_scheduler(d: Dialect, *, deciding: bool) -> Step[Scheduler]:
    """The scheduler row; ``deciding``: under the shared lock, so no epoch bump commits
    between this read and the end of the step (a bump waits for it, and it for a bump)."""
    if deciding and d.lock_scheduler_shared:
        yield Sql(d.lock_scheduler_shared, (), "none")
    row = yield Sql("SELECT epoch, paused FROM scheduler WHERE id = 1", (), "one")
    return Scheduler(epoch=int(row[0]), claims_paused=bool(row[1]))


def change_scheduler(d: Dialect, change: Callable[[Scheduler], Scheduler]) -> Step[Scheduler]:
    if d.lock_scheduler_exclusive:
        yield Sql(d.lock_scheduler_exclusive, (), "none")
    current = yield from read_scheduler(d, deciding=False)
    scheduler = change(current)
    yield Sql(
        "UPDATE scheduler SET epoch = ?, paused = ? WHERE id = 1",
        (scheduler.epoch, int(scheduler.claims_paused)),
    )
    return scheduler


def load_effect(d: Dialect, effect_id: str, *, lock: bool) -> Step[Effect | None]:
    row = yield Sql(
        f"SELECT fields FROM effects WHERE effect_id = ?{d.for_update if lock else ''}",
        (effect_id,),
        "one",
    )
    return effects.effect_from_fields(json.loads(row[0])) if row else None


def save_effect(effect: Effect, before: Effect | None) -> Step[None]:
    """UPDATE the row the step loaded as ``before`` (and locked), or INSERT one it saw absent
    (None). Keeps the keyed index in the same transaction (``_index_keyed``)."""
    fields = _dumps(effects.effect_to_fields(effect))
    if before is not None:
        yield Sql(
            "UPDATE effects SET downstream = ?, state = ?, deadline_at = ?, fields = ? "
            "WHERE effect_id = ?",
            (effect.downstream, effect.state.value, effect.deadline_at, fields, effect.effect_id),
        )
    else:
        yield Sql(
            "INSERT INTO effects (effect_id, task_id, downstream, state, deadline_at, "
            "created_at, fields) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                effect.effect_id,
                NO_TASK if effect.task_id is None else effect.task_id,
                effect.downstream,
                effect.state.value,
                effect.deadline_at,
                effect.created_at,
                fields,
            ),
        )
    yield from _index_keyed(effect, before)


def _index_keyed(effect: Effect, before: Effect | None) -> Step[None]:
    """The keyed index after a write of ``effect`` (``before``: the record it replaced):
    an entry due from the ``updated_at`` at which the effect entered ``effects.keyed_settled``;
    a write that leaves it in the set keeps the entry's due time (a sweep may have moved it
    to the back); one leaving the set removes it. A leased effect costs no statement."""
    settled = effects.keyed_settled(effect)
    was = before is not None and effects.keyed_settled(before)
    if settled and not was:
        yield Sql(
            "INSERT INTO keyed_settled (effect_id, due_at) VALUES (?, ?) "
            "ON CONFLICT (effect_id) DO UPDATE SET due_at = excluded.due_at",
            (effect.effect_id, effect.updated_at),
        )
    elif was and not settled:
        yield Sql("DELETE FROM keyed_settled WHERE effect_id = ?", (effect.effect_id,))


def _effects_from(rows: Iterable[Any], now: int) -> list[Effect]:
    return [effects.effective(effects.effect_from_fields(json.loads(r[0])), now) for r in rows]


_TASK_STONE_COLUMNS = (
    "revision, claim_generation, cancel_generation, input_digest, state, expired_at, "
    "forget_at, effects"
)


def load_task_tombstone(task_id: str) -> Step[Tombstone | None]:
    """The task's tombstone row, live or not (the caller compares ``forget_at`` with its
    ``now``: one past it counts as absent, swept or not)."""
    row = yield Sql(
        f"SELECT {_TASK_STONE_COLUMNS} FROM task_tombstones WHERE task_id = ?", (task_id,), "one"
    )
    if row is None:
        return None
    return Tombstone(
        task_id=task_id,
        revision=int(row[0]),
        claim_generation=int(row[1]),
        cancel_generation=int(row[2]),
        input_digest=str(row[3]),
        state=TaskState(row[4]),
        expired_at=int(row[5]),
        forget_at=int(row[6]),
        effects=int(row[7]),
    )


def load_effect_tombstone(effect_id: str) -> Step[EffectTombstone | None]:
    row = yield Sql(
        "SELECT task_id, state, expired_at, forget_at FROM effect_tombstones WHERE effect_id = ?",
        (effect_id,),
        "one",
    )
    if row is None:
        return None
    return EffectTombstone(
        effect_id=effect_id,
        task_id=None if row[0] == NO_TASK else str(row[0]),
        state=EffectState(row[1]),
        expired_at=int(row[2]),
        forget_at=int(row[3]),
    )


def expired_refusal(
    step: Step[T], *, task_id: str | None = None, effect_id: str | None = None
) -> Step[T]:
    """``step``, with its NO_SUCH_TASK for ``task_id`` (NO_SUCH_EFFECT for ``effect_id``)
    turned into TASK_EXPIRED (EFFECT_EXPIRED) when a live tombstone remembers that id.

    The one place the SQL stores refine that refusal, in the same transaction as the step:
    the tombstone is read only after the step refused (one more statement on that path, none
    on any other), and it changes only which refusal is given, never whether one is.

    Also the one place a refusal of such a step is named by its task (effect):
    ``FencegateError.about``, as ``RedisStore._refusal`` names it."""
    try:
        try:
            return (yield from step)
        except (TaskExpired, EffectExpired):
            raise
        except NoSuchTask:
            if task_id is None:
                raise
            stone = yield from load_task_tombstone(task_id)
            now = yield NOW
            if stone is None or stone.forget_at <= now:
                raise
            raise tasks.expired_task(stone) from None
        except NoSuchEffect:
            if effect_id is None:
                raise
            effect_stone = yield from load_effect_tombstone(effect_id)
            now = yield NOW
            if effect_stone is None or effect_stone.forget_at <= now:
                raise
            raise retention.expired_effect(effect_stone) from None
    except StoreUnavailable:
        raise
    except FencegateError as exc:
        if effect_id is not None:
            exc.about_effect(effect_id)
        elif task_id is not None:
            exc.about_task(task_id)
        raise


# --- tasks ----------------------------------------------------------------------------------


def put_task(
    d: Dialect,
    task_id: str,
    input_digest: str,
    max_runtime_ms: int | None,
    *,
    queue: str | None = None,
    priority: int | None = None,
    depends_on: tuple[str, ...] | None = None,
    max_dependents: int = 1_000,
) -> Step[tuple[Task, PutOutcome]]:
    found = yield from load_task(d, task_id, lock=True)
    if found is not None and found.input_digest == input_digest:
        return found, PutOutcome.UNCHANGED
    # No record: an expired task leaves a tombstone. The same input is refused before any
    # dependency check, as ``tasks.put`` orders it; a new one continues its revision.
    stone = None if found is not None else (yield from load_task_tombstone(task_id))
    if stone is not None and stone.input_digest == input_digest:
        now = yield NOW
        if stone.forget_at > now:
            raise tasks.expired_task(stone)
    wanted = tuple(dict.fromkeys(depends_on)) if depends_on is not None else None
    before = found.depends_on if found is not None else ()
    deps_now = wanted if wanted is not None else before
    added = [dep for dep in deps_now if dep not in before]
    if added and d.lock_dependency_graph:
        yield Sql(d.lock_dependency_graph, (), "none")
    deps: dict[str, Task | None] = {}
    for dep in deps_now:
        # FOR UPDATE: a dependency committing at the same time either sees this task among
        # its dependents or is seen here as committed, never neither.
        deps[dep] = None if dep == task_id else (yield from load_task(d, dep, lock=True))
    tasks.check_dependencies(task_id, deps_now, deps)
    if added and found is not None:
        yield from _walk_for_cycle(d, task_id, tuple(added))
    for dep in added:
        (count,) = yield Sql("SELECT COUNT(*) FROM dependents WHERE task_id = ?", (dep,), "one")
        if int(count) >= max_dependents:
            raise BadRequest(f"dependsOn: {dep} already has {max_dependents} dependents")
    now = yield NOW
    task, outcome = tasks.put(
        found,
        task_id,
        input_digest,
        max_runtime_ms,
        now,
        queue=queue,
        priority=priority,
        depends_on=wanted,
        deps=deps,
        tombstone=stone if stone is not None and stone.forget_at > now else None,
    )
    yield from save_task(task, found is not None)
    if stone is not None:
        # Created again (from the tombstone, or afresh past its forget_at): the record speaks
        # for the task id from now on.
        yield Sql("DELETE FROM task_tombstones WHERE task_id = ?", (task_id,))
    for dep in before:
        if dep not in deps_now:
            yield Sql(
                "DELETE FROM dependents WHERE task_id = ? AND dependent_id = ?", (dep, task_id)
            )
    for dep in added:
        yield Sql("INSERT INTO dependents (task_id, dependent_id) VALUES (?, ?)", (dep, task_id))
    if found is not None and found.state is TaskState.COMMITTED:
        discarded = list(task.discarded)
        for dependent_id in (yield from dependents_of(task_id)):
            dependent = yield from load_task(d, dependent_id, lock=True)
            changed = dependent and tasks.dependency_revised(dependent, task_id, now)
            if changed:
                yield from save_task(changed, True)
                discarded += changed.discarded
        task = replace(task, discarded=tuple(discarded))
    return task, outcome


def get_task(d: Dialect, task_id: str) -> Step[Task]:
    task = yield from load_task(d, task_id, lock=False)
    if task is None:
        raise NoSuchTask()
    return task


def list_tasks(
    d: Dialect, wanted: TaskFilter, limit: int, after: str | None
) -> Step[tuple[list[Task], str | None]]:
    # Keyset pagination on the primary key: at most TASK_SCAN rows read per call, however
    # little the filter matches (ledger.queries.page_tasks decides the page).
    rows = yield Sql(
        "SELECT task_id, fields FROM tasks WHERE task_id > ? ORDER BY task_id LIMIT ?",
        ("" if after is None else after, TASK_SCAN + 1),
        "all",
    )
    scanned = [
        (task_id, tasks.task_from_fields(json.loads(raw))) for task_id, raw in rows[:TASK_SCAN]
    ]
    # The store's clock, in the same transaction: "lease expired" is its decision.
    now = (yield NOW) if wanted.lease_expired is not None else 0
    return page_tasks(scanned, len(rows) > TASK_SCAN, wanted, limit, now)


def claim(
    d: Dialect, task_id: str, request: ClaimRequest, policy: LeasePolicy, attempt_id: str
) -> Step[Task]:
    scheduler = yield from read_scheduler(d, deciding=True)
    found = yield from load_task(d, task_id, lock=True)
    now = yield NOW
    task = tasks.claim(found, scheduler, request, policy, now, attempt_id)
    yield from save_task(task, found is not None)
    return task


def claim_next(
    d: Dialect, queue: str, request: ClaimRequest, policy: LeasePolicy, attempt_id: str
) -> Step[Task | None]:
    """The queue's best READY task, its best CLAIMED one whose lease ran out and its best
    CLAIMED one of an older epoch, each locked; the model picks among the three. Each query
    reads one index range (``tasks_queue``, ``tasks_queue_expiry``, ``tasks_queue_epoch``),
    never the rest of the queue."""
    scheduler = yield from read_scheduler(d, deciding=True)
    now = yield NOW
    tasks.claim_next(queue, (), scheduler, request, policy, now, attempt_id)  # refusals first
    order = "ORDER BY priority DESC, ready_at, task_id LIMIT 1"
    ready = yield Sql(
        f"SELECT fields FROM tasks WHERE queue = ? AND state = 'READY' {order}"
        f"{d.for_update_skip_locked}",
        (queue,),
        "one",
    )
    # Claims that can be taken over: each query reads only such claims (their index range),
    # never the queue's live ones.
    expired = yield Sql(
        "SELECT fields FROM tasks WHERE queue = ? AND state = 'CLAIMED' "
        f"AND lease_expires_at <= ? {order}{d.for_update_skip_locked}",
        (queue, now),
        "one",
    )
    old_epoch = yield Sql(
        "SELECT fields FROM tasks WHERE queue = ? AND state = 'CLAIMED' "
        f"AND claim_epoch < ? {order}{d.for_update_skip_locked}",
        (queue, scheduler.epoch),
        "one",
    )
    candidates = [_task_of(row) for row in (ready, expired, old_epoch) if row]
    if not candidates:
        return None
    now = yield NOW
    task = tasks.claim_next(queue, candidates, scheduler, request, policy, now, attempt_id)
    if task is not None:
        yield from save_task(task, True)
    return task


def renew(d: Dialect, task_id: str, request: RenewRequest, policy: LeasePolicy) -> Step[Task]:
    scheduler = yield from read_scheduler(d, deciding=True)
    found = yield from load_task(d, task_id, lock=True)
    now = yield NOW
    task = tasks.renew(found, scheduler, request, policy, now)
    yield from save_task(task, found is not None)
    return task


def release(d: Dialect, task_id: str, identity: Identity) -> Step[Task]:
    found = yield from load_task(d, task_id, lock=True)
    now = yield NOW
    task = tasks.release(found, identity, now)
    yield from save_task(task, found is not None)
    return task


def commit(
    d: Dialect, task_id: str, request: CommitRequest, commit_id: str
) -> Step[tuple[Task, bool]]:
    scheduler = yield from read_scheduler(d, deciding=True)
    found = yield from load_task(d, task_id, lock=True)
    now = yield NOW
    task, replay = tasks.commit(found, scheduler, request, now, commit_id)
    if not replay:
        yield from save_task(task, found is not None)
        for dependent_id in (yield from dependents_of(task_id)):
            dependent = yield from load_task(d, dependent_id, lock=True)
            changed = dependent and tasks.dependency_committed(dependent, task, now)
            if changed:
                yield from save_task(changed, True)
    return task, replay


def cancel(d: Dialect, task_id: str, max_cascade: int = 1_000) -> Step[Task]:
    """Cancel, then the open dependents, breadth first (``_cascade``)."""
    found = yield from load_task(d, task_id, lock=True)
    now = yield NOW
    task = tasks.cancel(found, now)
    if found is not None and found.state is TaskState.CANCELLED:
        return task
    yield from save_task(task, found is not None)
    discarded, _ = yield from _cascade(d, [task_id], max_cascade, now)
    return replace(task, discarded=tuple(task.discarded) + discarded)


def _cascade(
    d: Dialect, frontier: list[str], limit: int, now: int
) -> Step[tuple[tuple[tasks.Discard, ...], int]]:
    """Cancel the open dependents of the (cancelled) tasks in ``frontier``, transitively: a
    dependent that changed passes the cancel on to its own dependents, a committed or already
    cancelled one stops it. Once ``limit`` tasks were cancelled, the tasks whose dependents
    are still to be visited go to the ``cascades`` table for ``continue_cascades``. The
    mirror of ``ledger.task_graph.cancel_cascade``."""
    discarded: list[tasks.Discard] = []
    cancelled = 0
    queue = list(frontier)
    while queue and cancelled < limit:
        current = queue.pop(0)
        for dependent_id in (yield from dependents_of(current)):
            dependent = yield from load_task(d, dependent_id, lock=True)
            changed = dependent and tasks.cancel_dependent(dependent, now)
            if changed:
                yield from save_task(changed, True)
                discarded += changed.discarded
                cancelled += 1
                queue.append(dependent_id)
    for pending in dict.fromkeys(queue):
        yield Sql(
            "INSERT INTO cascades (task_id) VALUES (?) ON CONFLICT (task_id) DO NOTHING",
            (pending,),
        )
    return tuple(discarded), cancelled


def continue_cascades(d: Dialect, limit: int) -> Step[int]:
    """One step of the recorded cascades: recorded tasks taken one by one (each locked and
    removed) until ``limit`` tasks were cancelled or ``limit`` records were taken. Returns how
    many records and cancels it handled (0: nothing is pending)."""
    now = yield NOW
    handled = cancelled = 0
    while handled < limit and cancelled < limit:
        row = yield Sql(
            f"SELECT task_id FROM cascades ORDER BY task_id LIMIT 1{d.for_update_skip_locked}",
            (),
            "one",
        )
        if row is None:
            break
        task_id = str(row[0])
        handled += 1
        yield Sql("DELETE FROM cascades WHERE task_id = ?", (task_id,))
        origin = yield from load_task(d, task_id, lock=True)
        if origin is not None and origin.state is TaskState.CANCELLED:
            _, more = yield from _cascade(d, [task_id], limit - cancelled, now)
            cancelled += more
    return handled + cancelled


def get_scheduler(d: Dialect) -> Step[Scheduler]:
    return (yield from read_scheduler(d, deciding=False))


def bump_epoch(d: Dialect) -> Step[Scheduler]:
    return (yield from change_scheduler(d, tasks.bump_epoch))


def set_claims_paused(d: Dialect, paused: bool) -> Step[Scheduler]:
    return (yield from change_scheduler(d, lambda s: tasks.set_claims_paused(s, paused)))


# --- the idempotency ledger -------------------------------------------------------------------


#: What a keyed prepare passes ``effects.prepare`` for the scheduler it never reads (only a
#: fence is checked against the scheduler).
_NO_SCHEDULER = Scheduler()


def check_fence(d: Dialect, fence: Fence) -> Step[Task]:
    """Read-only: answered as of one consistent moment, no lock needed."""
    scheduler = yield from read_scheduler(d, deciding=False)
    task = yield from load_task(d, fence.task_id, lock=False)
    now = yield NOW
    return effects.check_fence(task, scheduler, fence, now)


def prepare_effect(
    d: Dialect,
    request: EffectRequest,
    forward_deadline_ms: int,
    *,
    resend_window_ms: int | None,
    require_approval: bool,
    windows_from: int | None,
) -> Step[PrepareOutcome]:
    """``windows_from``: records created before this instant get no resend window (SQLite:
    created before a reboot whose downtime its clock lost; None where time is never lost).

    A keyed request (``request.fence`` None) reads no task and no scheduler: its effect is
    found by its id (``request.effect_id``), and an effect tombstone still live for that id
    refuses it (a late duplicate of an expired keyed effect, ``retention.expired_effect``);
    one past its ``forget_at`` is dropped as the key starts afresh."""
    fence = request.fence
    task = None
    scheduler = _NO_SCHEDULER
    stone = None
    if fence is not None:
        scheduler = yield from read_scheduler(d, deciding=True)
        task = yield from load_task(d, fence.task_id, lock=True)
        existing = None
        if task is not None:
            eid = effects.effect_id(task.task_id, task.revision, request.node, request.slot)
            existing = yield from load_effect(d, eid, lock=True)
    else:
        assert request.effect_id is not None
        existing = yield from load_effect(d, request.effect_id, lock=True)
        if existing is None:
            stone = yield from load_effect_tombstone(request.effect_id)
    now = yield NOW
    if stone is not None:
        if stone.forget_at > now:
            raise retention.expired_effect(stone)
        yield Sql("DELETE FROM effect_tombstones WHERE effect_id = ?", (stone.effect_id,))
    window = resend_window_ms
    if existing is not None and windows_from is not None and existing.created_at < windows_from:
        window = None
    outcome = effects.prepare(
        task,
        scheduler,
        existing,
        request,
        now,
        forward_deadline_ms,
        resend_window_ms=window,
        require_approval=require_approval,
    )
    if outcome.write:
        yield from save_effect(outcome.effect, existing)
    return outcome


def complete_effect(
    d: Dialect,
    effect_id: str,
    seq: int,
    attempt_id: str,
    outcome: EffectState,
    reason: str,
    response_json: str | None,
) -> Step[tuple[Effect, bool]]:
    effect = yield from load_effect(d, effect_id, lock=True)
    if effect is None:
        raise NoSuchEffect()
    now = yield NOW
    done, applied = effects.complete(effect, seq, attempt_id, outcome, reason, response_json, now)
    if applied:
        yield from save_effect(done, effect)
    return done, applied


def get_effect(d: Dialect, effect_id: str) -> Step[Effect]:
    effect = yield from load_effect(d, effect_id, lock=False)
    if effect is None:
        raise NoSuchEffect()
    now = yield NOW
    return effects.effective(effect, now)


def find_effects(prefix: str, limit: int) -> Step[list[str]]:
    """``ledger.queries.effects_with_prefix``: a range of the effects' primary key."""
    low, high = effect_prefix_bounds(prefix)
    rows = yield Sql(
        "SELECT effect_id FROM effects WHERE effect_id >= ? AND effect_id < ? "
        "ORDER BY effect_id LIMIT ?",
        (low, high, limit),
        "all",
    )
    return [str(row[0]) for row in rows]


def list_effects(
    d: Dialect,
    *,
    state: EffectState | None,
    task_id: str | None,
    downstream: str | None,
    limit: int,
    after: tuple[int, str],
) -> Step[tuple[list[Effect], str | None]]:
    now = yield NOW
    where = ["(created_at, effect_id) > (?, ?)"]
    args: list[object] = [after[0], after[1]]
    if task_id is not None:
        where.append("task_id = ?")
        args.append(task_id)
    if downstream is not None:
        where.append("downstream = ?")
        args.append(downstream)
    if state is EffectState.UNKNOWN:
        where.append(f"(state = 'UNKNOWN' OR {d.overdue()})")
        args.append(now)
    elif state is EffectState.PREPARED:
        where.append(d.running())
        args.append(now)
    elif state is not None:
        where.append("state = ?")
        args.append(state.value)
    rows = yield Sql(
        f"SELECT fields FROM effects WHERE {' AND '.join(where)} "
        "ORDER BY created_at, effect_id LIMIT ?",
        (*args, limit + 1),
        "all",
    )
    found = _effects_from(rows[:limit], now)
    more = len(rows) > limit
    next_cursor = encode_cursor(found[-1].created_at, found[-1].effect_id) if more else None
    return found, next_cursor


def unsettled_effects(
    d: Dialect, limit: int, probe_downstreams: frozenset[str]
) -> Step[list[Effect]]:
    """Mirrors ``ledger.queries.unsettled_effects``."""
    names = sorted(probe_downstreams)
    now = yield NOW
    rows = list(
        (
            yield Sql(
                f"SELECT fields FROM effects WHERE {d.overdue()} ORDER BY deadline_at LIMIT ?",
                (now, limit),
                "all",
            )
        )
    )
    if names:
        due = d.probe_due_at()
        rows += yield Sql(
            f"SELECT fields FROM effects WHERE state = 'UNKNOWN' "
            f"AND downstream IN ({','.join('?' * len(names))}) AND {due} <= ? "
            f"ORDER BY {due}, created_at, effect_id LIMIT ?",
            (*names, now, limit),
            "all",
        )
    return _effects_from(rows, now)


def awaiting_approval(d: Dialect, limit: int) -> Step[list[Effect]]:
    """Mirrors ``ledger.effects.is_awaiting_approval``, oldest first."""
    now = yield NOW
    rows = yield Sql(
        f"SELECT fields FROM effects WHERE {d.awaiting()} ORDER BY created_at, effect_id LIMIT ?",
        (limit,),
        "all",
    )
    return _effects_from(rows, now)


def find_forward(d: Dialect, task_id: str, forward_id: str) -> Step[str | None]:
    rows = yield Sql("SELECT fields FROM effects WHERE task_id = ?", (task_id,), "all")
    records = (effects.effect_from_fields(json.loads(raw)) for (raw,) in rows)
    return queries.find_forward(records, forward_id)


def gauges(d: Dialect) -> Step[Gauges]:
    """Mirrors ``ledger.queries.gauges``. Each count reads only the rows of one state through
    the ``effects_state`` index (PREPARED and UNKNOWN rows are the few in flight), and the
    keyed subset of UNKNOWN (incl. overdue PREPARED) is a condition on those same rows: a
    keyed effect's row holds ``NO_TASK`` as its task."""
    now = yield NOW
    (active,) = yield Sql(f"SELECT COUNT(*) FROM tasks WHERE {d.active_lease()}", (now,), "one")
    prepared, overdue, overdue_keyed = yield Sql(
        f"SELECT COUNT(*) FILTER (WHERE {d.running()}), COUNT(*) FILTER (WHERE {d.overdue()}), "
        f"COUNT(*) FILTER (WHERE {d.overdue()} AND task_id = ?) "
        "FROM effects WHERE state = 'PREPARED'",
        (now, now, now, NO_TASK),
        "one",
    )
    keyed = "COUNT(*) FILTER (WHERE task_id = ?)"
    unknown, unknown_keyed = yield Sql(
        f"SELECT COUNT(*), {keyed} FROM effects WHERE state = 'UNKNOWN'", (NO_TASK,), "one"
    )
    (awaiting,) = yield Sql(f"SELECT COUNT(*) FROM effects WHERE {d.awaiting()}", (), "one")
    return Gauges(
        active_leases=int(active),
        prepared_effects=int(prepared),
        unknown_effects=int(unknown) + int(overdue),
        awaiting_approval=int(awaiting),
        unknown_keyed_effects=int(unknown_keyed) + int(overdue_keyed),
    )


# --- retention (ledger.retention) ------------------------------------------------------------


def expire_settled(
    d: Dialect, settled_ms: int, tombstone_ms: int, limit: int
) -> Step[ExpiryReport]:
    """One step of the retention sweep (``Store.expire_settled``), mirroring
    ``retention.why_kept`` for each settled task due.

    Locking (PostgreSQL): the due entries are taken with their task rows in one
    ``FOR UPDATE SKIP LOCKED`` read, so two sweepers take different tasks and neither waits
    for the other, and a task some step holds (a put of a new revision, a commit replay) is
    left for a later sweep instead of waited for: the triggers that keep ``settled`` lock its
    row after the task's, so waiting here for a task while holding its entry could deadlock.
    The effects are then read ``FOR UPDATE`` (task, then effect: the order every step uses),
    so an operator's transition in flight is waited for and judged as it ends.

    ``now`` is read once, first (the cutoff needs it): what the rules read of it
    (``effects.effective``) only tells a running PREPARED from an overdue one, and both
    keep the task.

    Then the keyed index (``_expire_keyed``: up to ``limit`` more entries, counted in the
    same report), then the tombstones past ``forget_at``."""
    now = yield NOW
    rows = yield Sql(
        "SELECT tasks.fields FROM settled JOIN tasks ON tasks.task_id = settled.task_id "
        "WHERE settled.due_at <= ? ORDER BY settled.due_at, settled.task_id LIMIT ?"
        f"{d.for_update_skip_locked}",
        (now - settled_ms, limit),
        "all",
    )
    kept: dict[str, int] = {}
    expired_tasks = expired_effects = 0
    for row in rows:
        task = _task_of(row)
        effect_rows = yield Sql(
            "SELECT fields FROM effects WHERE task_id = ? ORDER BY created_at, effect_id"
            f"{d.for_update}",
            (task.task_id,),
            "all",
        )
        records = [effects.effect_from_fields(json.loads(r[0])) for r in effect_rows]
        dependent = yield Sql(
            "SELECT 1 FROM dependents JOIN tasks ON tasks.task_id = dependents.dependent_id "
            "WHERE dependents.task_id = ? LIMIT 1",
            (task.task_id,),
            "one",
        )
        reason = retention.why_kept(task, records, dependent is not None, now)
        if reason == "open":  # the triggers make this impossible; an entry too many goes
            yield Sql("DELETE FROM settled WHERE task_id = ?", (task.task_id,))
        elif reason is not None:
            kept[reason] = kept.get(reason, 0) + 1
            yield Sql("UPDATE settled SET due_at = ? WHERE task_id = ?", (now, task.task_id))
        else:
            yield from _expire_task(d, task, records, now, tombstone_ms)
            expired_tasks += 1
            expired_effects += len(records)
    keyed = yield from _expire_keyed(d, settled_ms, tombstone_ms, limit, now, kept)
    forgotten = 0
    for table, key in (("task_tombstones", "task_id"), ("effect_tombstones", "effect_id")):
        gone = yield Sql(
            f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} "
            f"WHERE forget_at <= ? ORDER BY forget_at LIMIT ?{d.for_update_skip_locked}) "
            f"RETURNING {key}",
            (now, limit),
            "all",
        )
        forgotten += len(gone)
    return ExpiryReport(
        examined=len(rows) + keyed[0],
        expired_tasks=expired_tasks,
        expired_effects=expired_effects + keyed[1],
        kept=kept,
        forgotten=forgotten,
    )


def _expire_keyed(
    d: Dialect, settled_ms: int, tombstone_ms: int, limit: int, now: int, kept: dict[str, int]
) -> Step[tuple[int, int]]:
    """The keyed part of a sweep step: up to ``limit`` due entries of the keyed index, with
    their effects, taken ``FOR UPDATE SKIP LOCKED`` (an effect some step holds is left for a
    later sweep, never waited for: the steps lock the effect, then its entry). Each one
    ``retention.why_kept_keyed`` lets go is deleted with its entry and leaves an effect
    tombstone (``NO_TASK``); each one still needed is moved to the back (counted in
    ``kept``). Returns (examined, expired)."""
    rows = yield Sql(
        "SELECT effects.fields FROM keyed_settled "
        "JOIN effects ON effects.effect_id = keyed_settled.effect_id "
        "WHERE keyed_settled.due_at <= ? "
        "ORDER BY keyed_settled.due_at, keyed_settled.effect_id LIMIT ?"
        f"{d.for_update_skip_locked}",
        (now - settled_ms, limit),
        "all",
    )
    expired = 0
    for row in rows:
        effect = effects.effect_from_fields(json.loads(row[0]))
        reason = retention.why_kept_keyed(effect, now)
        if reason is not None:
            kept[reason] = kept.get(reason, 0) + 1
            yield Sql(
                "UPDATE keyed_settled SET due_at = ? WHERE effect_id = ?", (now, effect.effect_id)
            )
            continue
        yield Sql("DELETE FROM effects WHERE effect_id = ?", (effect.effect_id,))
        yield Sql("DELETE FROM keyed_settled WHERE effect_id = ?", (effect.effect_id,))
        yield from _save_effect_tombstones([effect], now, tombstone_ms)
        expired += 1
    return len(rows), expired


def _save_effect_tombstones(records: list[Effect], now: int, tombstone_ms: int) -> Step[None]:
    for effect_stone in retention.effect_tombstones(records, now, tombstone_ms):
        yield Sql(
            "INSERT INTO effect_tombstones (effect_id, task_id, state, expired_at, forget_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (effect_id) DO UPDATE SET "
            "task_id = excluded.task_id, state = excluded.state, "
            "expired_at = excluded.expired_at, forget_at = excluded.forget_at",
            (
                effect_stone.effect_id,
                NO_TASK if effect_stone.task_id is None else effect_stone.task_id,
                effect_stone.state.value,
                effect_stone.expired_at,
                effect_stone.forget_at,
            ),
        )


def _expire_task(
    d: Dialect, task: Task, records: list[Effect], now: int, tombstone_ms: int
) -> Step[None]:
    """Delete ``task`` (held by the caller) with everything naming it, and leave its
    tombstones. The SQL indexes (queue, leases, effect order) are the tables' own, so the rows
    take them along; the feed's events stay (trimmed by count, ``events.retain``)."""
    task_id = task.task_id
    yield Sql("DELETE FROM effects WHERE task_id = ?", (task_id,))
    yield Sql("DELETE FROM tasks WHERE task_id = ?", (task_id,))
    yield Sql("DELETE FROM settled WHERE task_id = ?", (task_id,))
    # Its dependents record: why_kept saw none of those tasks exist, so the rows are stale.
    yield Sql("DELETE FROM dependents WHERE task_id = ?", (task_id,))
    if task.depends_on:
        # Its entries in its dependencies' records: the primary key's own lookups, no scan.
        yield Sql(
            "DELETE FROM dependents WHERE dependent_id = ? "
            f"AND task_id IN ({','.join('?' * len(task.depends_on))})",
            (task_id, *task.depends_on),
        )
    # A cascade still recorded for it (its dependents are gone, so nothing is left to do). A
    # row ``continue_cascades`` holds is left to it: it drops the row itself, and waiting
    # for it here could deadlock (it locks the row, then the task this step holds).
    yield Sql(
        "DELETE FROM cascades WHERE task_id IN "
        f"(SELECT task_id FROM cascades WHERE task_id = ?{d.for_update_skip_locked})",
        (task_id,),
    )
    stone = retention.tombstone(task, len(records), now, tombstone_ms)
    yield Sql(
        f"INSERT INTO task_tombstones (task_id, {_TASK_STONE_COLUMNS}) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET "
        "revision = excluded.revision, claim_generation = excluded.claim_generation, "
        "cancel_generation = excluded.cancel_generation, input_digest = excluded.input_digest, "
        "state = excluded.state, expired_at = excluded.expired_at, "
        "forget_at = excluded.forget_at, effects = excluded.effects",
        (
            task_id,
            stone.revision,
            stone.claim_generation,
            stone.cancel_generation,
            stone.input_digest,
            stone.state.value,
            stone.expired_at,
            stone.forget_at,
            stone.effects,
        ),
    )
    yield from _save_effect_tombstones(records, now, tombstone_ms)


def store_stats(d: Dialect, settled_ms: int) -> Step[StoreStats]:
    """``Store.store_stats``: counts over indexed columns (one statement) and the store's
    size (``Dialect.table_bytes`` / ``store_bytes``). Effects count as ``gauges`` counts
    them (``effects.effective``): a PREPARED past its deadline is UNKNOWN."""
    now = yield NOW
    counts = yield Sql(
        "SELECT (SELECT COUNT(*) FROM tasks), "
        "(SELECT COUNT(*) FROM tasks WHERE state = 'CLAIMED'), "
        "(SELECT COUNT(*) FROM settled), "
        "(SELECT COUNT(*) FROM settled WHERE due_at <= ?), "
        "(SELECT COUNT(*) FROM effects), "
        f"(SELECT COUNT(*) FROM effects WHERE {d.running()}), "
        "(SELECT COUNT(*) FROM effects WHERE state = 'UNKNOWN'), "
        f"(SELECT COUNT(*) FROM effects WHERE {d.overdue()}), "
        f"(SELECT COUNT(*) FROM effects WHERE {d.awaiting()}), "
        "(SELECT COUNT(*) FROM task_tombstones WHERE forget_at > ?), "
        "(SELECT COUNT(*) FROM effect_tombstones WHERE forget_at > ?), "
        "(SELECT COUNT(*) FROM events)",
        (now - settled_ms, now, now, now, now),
        "one",
    )
    n = [int(c) for c in counts]
    detail: dict[str, int] = {}
    size: int | None = None
    if d.table_bytes:
        for name, value in (yield Sql(d.table_bytes, (), "all")):
            detail[str(name)] = int(value or 0)
        size = sum(detail.values())
    elif d.store_bytes:
        row = yield Sql(d.store_bytes, (), "one")
        size = None if row is None or row[0] is None else int(row[0])
    return StoreStats(
        tasks=n[0],
        claimed_tasks=n[1],
        settled_tasks=n[2],
        due_tasks=n[3],
        effects=n[4],
        prepared_effects=n[5],
        unknown_effects=n[6] + n[7],
        awaiting_approval=n[8],
        task_tombstones=n[9],
        effect_tombstones=n[10],
        events=n[11],
        bytes=size,
        bytes_detail=detail,
    )


def update_effect(d: Dialect, effect_id: str, transition: EffectTransition) -> Step[Effect]:
    found = yield from load_effect(d, effect_id, lock=True)
    now = yield NOW
    effect = transition(found, now)
    yield from save_effect(effect, found)
    return effect


# --- the change feed (ledger.events) --------------------------------------------------------

#: A position "after everything with this xid and seq": xid is 0 on SQLite.
_MAX_SEQ = 2**62


def _position(xid: int, seq: int) -> str:
    return f"{xid}-{seq}"


_POSITION = re.compile(r"([0-9]{1,19})-([0-9]{1,19})")
_MAX_INT = 2**63 - 1


def _parse_position(position: str) -> tuple[int, int]:
    match = _POSITION.fullmatch(position)
    if match is None or max(int(match[1]), int(match[2])) > _MAX_INT:
        raise BadRequest("Last-Event-ID: not an event position this store issued")
    return int(match[1]), int(match[2])


def read_events(d: Dialect, after: str | None, limit: int) -> Step[tuple[list[Event], str]]:
    """Events in (xid, seq) order. On PostgreSQL a sequence number is drawn before its
    transaction commits, so seq order alone could show a later event before an earlier one
    commits; reading in (xid, seq) order only below a horizon under which every transaction
    that could write an event has finished means nothing can later appear before a position
    already handed out. A position below the last trimmed one (``events_trimmed``) or above
    the newest issued (``Dialect.events_newest``) is ``EventsGone`` (``events.gone``)."""
    if after is None:
        row = yield Sql(d.events_end, (), "one")
        return [], _position(int(row[0]), int(row[1]))
    xid, seq = _parse_position(after)
    ends = yield Sql(
        f"SELECT newest.xid, newest.seq, trimmed.xid, trimmed.seq FROM ({d.events_newest}) "
        "AS newest LEFT JOIN events_trimmed AS trimmed ON trimmed.id = 1",
        (),
        "one",
    )
    refused = events.gone(
        (xid, seq),
        dropped=None if ends[2] is None else (int(ends[2]), int(ends[3])),
        newest=(int(ends[0]), int(ends[1])),
    )
    if refused is not None:
        raise refused
    rows = yield Sql(
        f"SELECT xid, seq, body FROM events WHERE (xid, seq) > (?, ?) AND {d.events_visible} "
        "ORDER BY xid, seq LIMIT ?",
        (xid, seq, limit),
        "all",
    )
    found = [Event(_position(int(x), int(q)), json.loads(body)) for x, q, body in rows]
    return found, (found[-1].position if found else after)


#: Most events one ``trim_events`` call deletes (the background loop comes back for more).
TRIM_BATCH = 10_000


def trim_events(d: Dialect, keep: int) -> Step[int]:
    newest_dropped = yield Sql(
        f"SELECT xid, seq FROM events WHERE {d.events_visible} "
        "ORDER BY xid DESC, seq DESC LIMIT 1 OFFSET ?",
        (keep,),
        "one",
    )
    if newest_dropped is None:
        return 0
    oldest = yield Sql(
        "SELECT xid, seq FROM events ORDER BY xid, seq LIMIT 1 OFFSET ?", (TRIM_BATCH - 1,), "one"
    )
    through = (int(newest_dropped[0]), int(newest_dropped[1]))
    if oldest is not None:
        through = min(through, (int(oldest[0]), int(oldest[1])))
    rows = yield Sql("SELECT COUNT(*) FROM events WHERE (xid, seq) <= (?, ?)", through, "one")
    yield Sql("DELETE FROM events WHERE (xid, seq) <= (?, ?)", through)
    yield Sql(
        "INSERT INTO events_trimmed (id, xid, seq) VALUES (1, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET xid = excluded.xid, seq = excluded.seq "
        "WHERE (events_trimmed.xid, events_trimmed.seq) < (excluded.xid, excluded.seq)",
        through,
    )
    return int(rows[0])
