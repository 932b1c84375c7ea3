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

from fencegate.ledger import effects, queries, tasks
from fencegate.ledger.effects import Effect, EffectRequest, EffectState, Fence, PrepareOutcome
from fencegate.ledger.errors import (
    BadRequest,
    EventsGone,
    NoSuchEffect,
    NoSuchTask,
    StoreIncompatible,
)
from fencegate.ledger.events import Event
from fencegate.ledger.queries import Gauges, TaskFilter, page_tasks
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
)

__all__ = [
    "NOW",
    "SCHEMA_VERSION",
    "TASK_FLOW_COLUMNS",
    "TRIM_BATCH",
    "Dialect",
    "Sql",
    "Step",
    "check_schema_version",
    "run_sync",
]

T = TypeVar("T")

#: The version of the tables these steps read and write. A store finding a newer one in its
#: database refuses to start: a newer fencegate wrote rows this code may misread.
SCHEMA_VERSION = 2
#: Version 2 (task flow): tasks gained the columns ``queue``, ``priority``, ``ready_at``,
#: ``claim_epoch`` (every row of version 1 has no queue: NULLs are right for it), the tables
#: ``dependents`` and ``events`` (with triggers filling it) came new. A store opening a
#: version-1 database adds them and writes 2 (``TASK_FLOW_COLUMNS``).

#: The columns version 2 added to ``tasks`` (name, portable type).
TASK_FLOW_COLUMNS = (
    ("queue", "TEXT"),
    ("priority", "INTEGER NOT NULL DEFAULT 0"),
    ("ready_at", "BIGINT"),
    ("claim_epoch", "BIGINT"),
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
    #: overtaken by one still running (PostgreSQL: below the snapshot's xmin).
    events_visible: str
    #: SELECT of the position "after everything visible now" (two columns: xid, seq).
    events_end: str

    # SQL mirrors of the pure rules (each names the function it mirrors).
    def overdue(self) -> str:
        """``ledger.effects.is_overdue``: a PREPARED past its deadline. One ``?``: now."""
        return "(state = 'PREPARED' AND deadline_at <= ?)"

    def running(self) -> str:
        """The negation within PREPARED (``not is_overdue``). One ``?``: now."""
        return "(state = 'PREPARED' AND deadline_at > ?)"

    def awaiting(self) -> str:
        """``ledger.effects.is_awaiting_approval``: NOT_APPLIED with no attempts."""
        return f"(state = 'NOT_APPLIED' AND {self.json_text('attempt_count')} = '0')"

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
    ``start`` (breadth first, each task once, at most ``tasks.MAX_GRAPH_VISITS``)."""
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


def save_effect(effect: Effect, existed: bool) -> Step[None]:
    fields = _dumps(effects.effect_to_fields(effect))
    if existed:
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
                effect.task_id,
                effect.downstream,
                effect.state.value,
                effect.deadline_at,
                effect.created_at,
                fields,
            ),
        )


def _effects_from(rows: Iterable[Any], now: int) -> list[Effect]:
    return [effects.effective(effects.effect_from_fields(json.loads(r[0])), now) for r in rows]


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
    )
    yield from save_task(task, found is not None)
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
    return page_tasks(scanned, len(rows) > TASK_SCAN, wanted, limit)


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
    are still to be visited go to the ``cascades`` table for ``continue_cascades``."""
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
    created before a reboot whose downtime its clock lost; None where time is never lost)."""
    scheduler = yield from read_scheduler(d, deciding=True)
    task = yield from load_task(d, request.fence.task_id, lock=True)
    existing = None
    if task is not None:
        eid = effects.effect_id(task.task_id, task.revision, request.node, request.slot)
        existing = yield from load_effect(d, eid, lock=True)
    now = yield NOW
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
        yield from save_effect(outcome.effect, existing is not None)
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
        yield from save_effect(done, True)
    return done, applied


def get_effect(d: Dialect, effect_id: str) -> Step[Effect]:
    effect = yield from load_effect(d, effect_id, lock=False)
    if effect is None:
        raise NoSuchEffect()
    now = yield NOW
    return effects.effective(effect, now)


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


def find_forward(d: Dialect, task_id: str, forward_id: str) -> Step[str | None]:
    rows = yield Sql("SELECT fields FROM effects WHERE task_id = ?", (task_id,), "all")
    records = (effects.effect_from_fields(json.loads(raw)) for (raw,) in rows)
    return queries.find_forward(records, forward_id)


def gauges(d: Dialect) -> Step[Gauges]:
    """Mirrors ``ledger.queries.gauges``."""
    now = yield NOW
    (active,) = yield Sql(f"SELECT COUNT(*) FROM tasks WHERE {d.active_lease()}", (now,), "one")
    prepared, overdue = yield Sql(
        f"SELECT COUNT(*) FILTER (WHERE {d.running()}), COUNT(*) FILTER (WHERE {d.overdue()}) "
        "FROM effects WHERE state = 'PREPARED'",
        (now, now),
        "one",
    )
    (unknown,) = yield Sql("SELECT COUNT(*) FROM effects WHERE state = 'UNKNOWN'", (), "one")
    (awaiting,) = yield Sql(f"SELECT COUNT(*) FROM effects WHERE {d.awaiting()}", (), "one")
    return Gauges(int(active), int(prepared), int(unknown) + int(overdue), int(awaiting))


def update_effect(d: Dialect, effect_id: str, transition: EffectTransition) -> Step[Effect]:
    found = yield from load_effect(d, effect_id, lock=True)
    now = yield NOW
    effect = transition(found, now)
    yield from save_effect(effect, found is not None)
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
    commits; reading only transactions below the snapshot's xmin (all finished) in (xid, seq)
    order means nothing can later appear before a position already handed out."""
    if after is None:
        row = yield Sql(d.events_end, (), "one")
        return [], _position(int(row[0]), int(row[1]))
    xid, seq = _parse_position(after)
    trimmed = yield Sql("SELECT xid, seq FROM events_trimmed WHERE id = 1", (), "one")
    if trimmed is not None and (xid, seq) < (int(trimmed[0]), int(trimmed[1])):
        raise EventsGone(
            f"events up to position {_position(int(trimmed[0]), int(trimmed[1]))} were dropped "
            "(events.retain); read the current state and follow from now"
        )
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
