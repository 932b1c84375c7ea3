"""The embedded store: one SQLite file, one gateway process, zero set-up.

Every transition runs as read -> pure function -> write inside ``BEGIN IMMEDIATE`` ...
``COMMIT`` on one connection owned by one writer thread, so transitions are serialised and a
crash at any point leaves either the old record or the new one. Transitions queued together
share one transaction and one fsync (group commit, ``SQLiteStore._batch``), each in its own
SAVEPOINT, and each caller is answered only after the COMMIT that holds its step. The journal
is WAL with ``synchronous=FULL`` by default: a transition answered to a client survives power loss.
``NORMAL`` is offered for hosts that accept losing the last transactions on power loss (not on
a process crash) in exchange for fewer fsyncs; see docs/stores.md.

The store's clock (``ledger.clock``) runs on the host's monotonic boot clock from a persisted
high-water mark: it never runs backwards and ignores steps of the wall clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from fencegate.ledger import sql_steps
from fencegate.ledger.clock import ClockMark, ClockSources, StoreClock
from fencegate.ledger.errors import FencegateError, StoreUnavailable
from fencegate.ledger.sql_store import SqlStore
from fencegate.ledger.store import (
    Store,
    StoreKind,
    StoreOptions,
)
from fencegate.ledger.tasks import (
    LeasePolicy,
)

__all__ = ["STORE_KIND", "SQLiteStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id          TEXT PRIMARY KEY,
    state            TEXT NOT NULL,
    lease_expires_at INTEGER,
    fields           TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_leases ON tasks (state, lease_expires_at);
CREATE TABLE IF NOT EXISTS dependents (
    task_id      TEXT NOT NULL,
    dependent_id TEXT NOT NULL,
    PRIMARY KEY (task_id, dependent_id)
);
CREATE TABLE IF NOT EXISTS events (
    xid  INTEGER NOT NULL DEFAULT 0,
    seq  INTEGER PRIMARY KEY AUTOINCREMENT,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS cascades (
    task_id TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS events_trimmed (
    id  INTEGER PRIMARY KEY CHECK (id = 1),
    xid INTEGER NOT NULL,
    seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS scheduler (
    id     INTEGER PRIMARY KEY CHECK (id = 1),
    epoch  INTEGER NOT NULL,
    paused INTEGER NOT NULL
);
INSERT OR IGNORE INTO scheduler (id, epoch, paused) VALUES (1, 1, 0);
CREATE TABLE IF NOT EXISTS effects (
    effect_id   TEXT PRIMARY KEY,
    task_id     TEXT NOT NULL,
    downstream  TEXT NOT NULL,
    state       TEXT NOT NULL,
    deadline_at INTEGER,
    created_at  INTEGER NOT NULL,
    fields      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS effects_order ON effects (created_at, effect_id);
CREATE INDEX IF NOT EXISTS effects_task ON effects (task_id, created_at, effect_id);
CREATE INDEX IF NOT EXISTS effects_state ON effects (state, created_at, effect_id);
CREATE TABLE IF NOT EXISTS fencegate_schema (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS clock (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    now_ms       INTEGER NOT NULL,
    boot_id      TEXT,
    boot_ms      INTEGER NOT NULL,
    ceiling_ms   INTEGER NOT NULL,
    windows_from INTEGER NOT NULL
);
"""


#: Run after ``_SCHEMA`` and the version-2 columns: the queue index and the change feed's
#: triggers (ledger.events): every task state/revision/generation change and every effect
#: state change appends one event in the transaction that made it.
_TASK_EVENT = """json_object('type', 'task', 'taskId', NEW.task_id, 'state', NEW.state,
    'queue', NEW.queue,
    'revision', CAST(json_extract(NEW.fields, '$.revision') AS INTEGER),
    'claimGeneration', CAST(json_extract(NEW.fields, '$.claim_generation') AS INTEGER),
    'at', CAST(json_extract(NEW.fields, '$.updated_at') AS INTEGER))"""
#: A keyed effect's row holds ``sql_steps.NO_TASK`` as its task: its event says null.
_EFFECT_EVENT = f"""json_object('type', 'effect', 'effectId', NEW.effect_id,
    'taskId', NULLIF(NEW.task_id, '{sql_steps.NO_TASK}'), 'state', NEW.state,
    'downstream', NEW.downstream,
    'at', CAST(json_extract(NEW.fields, '$.updated_at') AS INTEGER))"""
_EFFECT_TRIGGERS = f"""
CREATE TRIGGER IF NOT EXISTS effects_event_insert AFTER INSERT ON effects BEGIN
    INSERT INTO events (body) VALUES ({_EFFECT_EVENT});
END;
CREATE TRIGGER IF NOT EXISTS effects_event_update AFTER UPDATE ON effects
WHEN OLD.state IS NOT NEW.state BEGIN
    INSERT INTO events (body) VALUES ({_EFFECT_EVENT});
END;
"""
_FLOW_SCHEMA = f"""
CREATE INDEX IF NOT EXISTS tasks_queue ON tasks (queue, state, priority DESC, ready_at, task_id);
CREATE INDEX IF NOT EXISTS tasks_queue_expiry ON tasks (queue, state, lease_expires_at);
CREATE INDEX IF NOT EXISTS tasks_queue_epoch ON tasks (queue, state, claim_epoch);
CREATE TRIGGER IF NOT EXISTS tasks_event_insert AFTER INSERT ON tasks BEGIN
    INSERT INTO events (body) VALUES ({_TASK_EVENT});
END;
CREATE TRIGGER IF NOT EXISTS tasks_event_update AFTER UPDATE ON tasks
WHEN OLD.state IS NOT NEW.state
  OR json_extract(OLD.fields, '$.revision') IS NOT json_extract(NEW.fields, '$.revision')
  OR json_extract(OLD.fields, '$.claim_generation')
     IS NOT json_extract(NEW.fields, '$.claim_generation')
BEGIN
    INSERT INTO events (body) VALUES ({_TASK_EVENT});
END;
{_EFFECT_TRIGGERS}"""


#: Schema version 3 (retention, ``sql_steps.RETENTION_TABLES``): the triggers that keep the
#: settled index. A task entering COMMITTED or CANCELLED gets its entry, due from the
#: ``updated_at`` it settled at; one going back to an open state (a new revision) loses it; a
#: write that leaves it settled (a commit replay, a cancel of a cancelled task) does not touch
#: it, so its ``due_at`` stays. In the statement that writes the task: no step says more.
_SETTLED = sql_steps.SETTLED_STATES_SQL
_RETENTION_SCHEMA = f"""
CREATE TRIGGER IF NOT EXISTS tasks_settled_insert AFTER INSERT ON tasks
WHEN NEW.state IN {_SETTLED} BEGIN
    INSERT OR REPLACE INTO settled (task_id, due_at)
    VALUES (NEW.task_id, CAST(json_extract(NEW.fields, '$.updated_at') AS INTEGER));
END;
CREATE TRIGGER IF NOT EXISTS tasks_settled_enter AFTER UPDATE OF state ON tasks
WHEN NEW.state IN {_SETTLED} AND OLD.state NOT IN {_SETTLED} BEGIN
    INSERT OR REPLACE INTO settled (task_id, due_at)
    VALUES (NEW.task_id, CAST(json_extract(NEW.fields, '$.updated_at') AS INTEGER));
END;
CREATE TRIGGER IF NOT EXISTS tasks_settled_leave AFTER UPDATE OF state ON tasks
WHEN OLD.state IN {_SETTLED} AND NEW.state NOT IN {_SETTLED} BEGIN
    DELETE FROM settled WHERE task_id = OLD.task_id;
END;
"""


#: Schema version 4 (keyed effects, ``sql_steps.KEYED_TABLES``): the effect events'
#: triggers written again (a version-2 or -3 file has them without the ``NULLIF``).
_KEYED_SCHEMA = f"""
DROP TRIGGER IF EXISTS effects_event_insert;
DROP TRIGGER IF EXISTS effects_event_update;
{_EFFECT_TRIGGERS}"""


def _statements(script: str) -> list[str]:
    """A script's statements, one by one (a trigger's body keeps its semicolons), so they can
    run inside one transaction (``executescript`` would commit first)."""
    out: list[str] = []
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            out.append(pending.strip())
            pending = ""
    if pending.strip():
        raise ValueError(f"incomplete SQL statement: {pending!r}")
    return out


def _schema_version(conn: sqlite3.Connection) -> int | None:
    """The file's schema version, None for a new file (or one from before versions)."""
    try:
        row = conn.execute("SELECT version FROM fencegate_schema WHERE id = 1").fetchone()
    except sqlite3.OperationalError:  # no such table: a new file
        return None
    return None if row is None else int(row[0])


def _add_flow_columns(conn: sqlite3.Connection) -> None:
    """Schema version 2 on a file of version 1 (or new): the columns ``tasks`` gained."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(tasks)")}
    for name, sql_type in sql_steps.TASK_FLOW_COLUMNS:
        if name not in have:
            conn.execute(f"ALTER TABLE tasks ADD COLUMN {name} {sql_type}")


class _Job:
    """One caller's step, queued for the writer thread; its answer goes to ``future``."""

    __slots__ = ("deadline", "fn", "future", "loop")

    def __init__(
        self,
        fn: Callable[[sqlite3.Connection, int], object],
        deadline: float,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[object],
    ) -> None:
        self.fn = fn
        self.deadline = deadline
        self.loop = loop
        self.future = future


#: (job, result, error): what one step answers, delivered only once its batch is settled.
_Answer = tuple[_Job, object, BaseException | None]

#: Most steps one transaction (one fsync) holds. The first caller of a batch waits for the
#: steps that joined it, so this bounds that wait (a step runs in tens of microseconds).
BATCH_MAX_STEPS = 64
#: A batch stops taking new steps once it has been running steps for this long, for the
#: same reason; steps left over start the next batch right after the COMMIT.
BATCH_MAX_SECONDS = 0.002


_NOTHING = "nothing was applied"
_BUSY = f"SQLite store busy: waited longer than store.timeout_ms; {_NOTHING}"


def _undone(answers: list[_Answer], why: str) -> list[_Answer]:
    """The answers of a transaction that was rolled back: none of its steps happened."""
    gone = StoreUnavailable(f"SQLite store: {why}; {_NOTHING}")
    return [(job, None, gone) for job, _, _ in answers]


def _settle(answers: list[_Answer]) -> None:
    for job, result, error in answers:
        if job.future.done():  # its caller gave up (timeout, cancelled)
            continue
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)


#: The newest event position issued, which is also the end (every event is visible at once):
#: AUTOINCREMENT's high-water mark in ``sqlite_sequence``, which no DELETE lowers (a trim of
#: every event keeps it; ``MAX(seq)`` would fall back to 0, below ``events_trimmed``), and only
#: a restore of an older copy of the file takes back.
_EVENTS_NEWEST = (
    "SELECT 0 AS xid, COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0) AS seq"
)

#: SQLite's fragments: steps run one at a time in the writer thread, so nothing is locked.
_SQLITE = sql_steps.Dialect(
    for_update="",
    lock_scheduler_shared="",
    lock_scheduler_exclusive="",
    json_text=lambda key: f"json_extract(fields, '$.{key}')",
    json_int=lambda key: f"(json_extract(fields, '$.{key}') + 0)",
    for_update_skip_locked="",
    lock_dependency_graph="",
    events_visible="1 = 1",
    events_end=_EVENTS_NEWEST,
    events_newest=_EVENTS_NEWEST,
    # Per table would need the dbstat table, which reads every page: the file's used pages.
    table_bytes="",
    store_bytes="SELECT ((SELECT page_count FROM pragma_page_count()) "
    "- (SELECT freelist_count FROM pragma_freelist_count())) "
    "* (SELECT page_size FROM pragma_page_size())",
)


class SQLiteStore(SqlStore):
    dialect = _SQLITE

    def __init__(
        self,
        path: str,
        policy: LeasePolicy,
        *,
        timeout_ms: int = 2000,
        synchronous: str = "FULL",
        clock_sources: ClockSources | None = None,
    ) -> None:
        super().__init__(policy)
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError("synchronous must be FULL or NORMAL")
        self.path = path
        self._timeout_s = timeout_ms / 1000
        self._synchronous = synchronous
        # One thread owns the connection: sqlite3 objects must not be shared across threads,
        # and one writer at a time is all SQLite offers anyway. Callers queue their steps for
        # it; it runs whatever is queued as one transaction (group commit, ``_batch``).
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._closing = False
        self._stop_taken = False  # touched by the writer thread only
        #: COMMITs done and the steps they held, written by the writer thread: how much group
        #: commit saves (steps per fsync), for tests and operators.
        self.commits = 0
        self.committed_steps = 0
        self._conn: sqlite3.Connection | None = None
        self._clock_sources = clock_sources
        self._store_clock: StoreClock | None = None
        #: A mark was written in a transaction that did not commit: the persisted ceiling may
        #: be older than the clock believes, so the next step writes one before its instant.
        self._mark_unsaved = False

    @property
    def kind(self) -> str:
        return "sqlite"

    # --- plumbing ---------------------------------------------------------------------------

    def _connect(self) -> None:
        """Open the file, retrying "database is locked" until ``timeout_ms``: while another
        process holds the file (a gateway beside this one, or one restarting after kill -9),
        SQLite answers some of the opening steps busy at once, without waiting its busy
        timeout (seen in CI: a restart refused 48 ms after it began)."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            try:
                self._connect_once()
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    def _connect_once(self) -> None:
        conn = sqlite3.connect(
            self.path, timeout=self._timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            self._open_on(conn)
        except BaseException:
            conn.close()
            raise

    def _open_on(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        self.schema_found = _schema_version(conn)
        if self.schema_found != sql_steps.SCHEMA_VERSION:  # else: no write at open
            self._create_or_upgrade(conn)
        row = conn.execute(
            "SELECT now_ms, boot_id, boot_ms, ceiling_ms, windows_from FROM clock WHERE id = 1"
        ).fetchone()
        mark = (
            ClockMark(int(row[0]), row[1], int(row[2]), int(row[3]), int(row[4])) if row else None
        )
        self._store_clock = StoreClock(mark, self._clock_sources)
        self._save_clock(conn)
        self._conn = conn

    def _create_or_upgrade(self, conn: sqlite3.Connection) -> None:
        """Create the schema (a new file) or upgrade an older one, as one transaction (one
        fsync, and a second process opening the file at the same time waits for it and
        then finds it done). A schema newer than this code is refused."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(_SCHEMA):
                conn.execute(statement)
            found = _schema_version(conn)
            if found is not None:
                sql_steps.check_schema_version(found, f"SQLite file {self.path!r}")
            if found is None or found < sql_steps.SCHEMA_VERSION:
                # Every statement idempotent, the version row last: a file of any older
                # version (or a new one) ends up the same.
                _add_flow_columns(conn)
                for statement in _statements(_FLOW_SCHEMA):
                    conn.execute(statement)
                if found is None or found < 3:
                    for statement in sql_steps.RETENTION_TABLES:
                        conn.execute(statement)
                    for statement in _statements(_RETENTION_SCHEMA):
                        conn.execute(statement)
                    conn.execute(sql_steps.backfill_settled(_SQLITE))
                for statement in sql_steps.KEYED_TABLES:
                    conn.execute(statement)
                for statement in _statements(_KEYED_SCHEMA):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO fencegate_schema (id, version) VALUES (1, ?) "
                    "ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                    (sql_steps.SCHEMA_VERSION,),
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _save_clock(self, conn: sqlite3.Connection) -> None:
        """Persist the clock's high-water mark (inside the caller's transaction, if any)."""
        assert self._store_clock is not None
        mark = self._store_clock.mark()
        conn.execute(
            "INSERT INTO clock (id, now_ms, boot_id, boot_ms, ceiling_ms, windows_from) "
            "VALUES (1, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET now_ms = excluded.now_ms, "
            "boot_id = excluded.boot_id, boot_ms = excluded.boot_ms, "
            "ceiling_ms = excluded.ceiling_ms, windows_from = excluded.windows_from",
            (mark.now_ms, mark.boot_id, mark.boot_ms, mark.ceiling_ms, mark.windows_from),
        )

    def _serve(self, ready: concurrent.futures.Future[None]) -> None:
        """The writer thread: open, then run batches until ``close`` queues the stop mark."""
        try:
            self._connect()
        except BaseException as exc:
            ready.set_exception(exc)
            self._stopped.set_result(None)
            return
        ready.set_result(None)
        while not self._stop_taken:
            first = self._queue.get()
            if first is None:
                self._stop_taken = True
                break
            jobs = [first]
            self._take(jobs)
            try:
                self._batch(jobs)
            except Exception as exc:  # a bug here must not strand every later caller
                self._mark_unsaved = True
                if self._conn is not None and self._conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                unknown = StoreUnavailable(
                    f"SQLite store failed: {exc!r}; the step may or may not have been applied"
                )
                self._answer([(job, None, unknown) for job in jobs])
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._stopped.set_result(None)

    def _take(self, jobs: list[_Job]) -> None:
        """Add the steps already queued (never waits for more: a lone caller is not delayed),
        up to the batch bound, and none after the stop mark."""
        while len(jobs) < BATCH_MAX_STEPS and not self._stop_taken:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._stop_taken = True
            else:
                jobs.append(job)

    def _batch(self, jobs: list[_Job]) -> None:
        """Group commit: the queued steps share one ``BEGIN IMMEDIATE`` ... ``COMMIT`` (one
        fsync), each in its own SAVEPOINT so a step that raises undoes only its own writes.

        Every answer, a refusal's included, waits for the COMMIT: a step may have read what an
        earlier step of the batch wrote, so its answer is only true once that is durable.
        Steps that arrive while the batch runs join it, within the bounds.
        """
        conn = self._conn
        assert conn is not None and self._store_clock is not None
        clock = self._store_clock
        answers: list[_Answer] = []
        in_tx: list[_Answer] = []  # answers that hold only if the open transaction commits
        marked = False  # this transaction wrote a clock mark
        started = time.monotonic()
        i = 0
        while i < len(jobs):
            job = jobs[i]
            i += 1
            if time.monotonic() > job.deadline:
                # Queued behind other steps for longer than the timeout: give up before
                # touching anything, so this 503 certainly changed nothing.
                answers.append((job, None, StoreUnavailable(_BUSY)))
            else:
                if not conn.in_transaction:
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                    except sqlite3.Error as exc:
                        # Locked by another process past the timeout: nothing of this batch
                        # ran, and the steps still queued would wait for the same lock.
                        gone = StoreUnavailable(f"SQLite store unavailable ({exc}); {_NOTHING}")
                        answers += [(each, None, gone) for each in jobs[i - 1 :]]
                        break
                now = clock.now_ms()
                # No instant is handed out (a refusal's included) unless the persisted
                # ceiling is above it: store time then never runs back across a reboot
                # (ledger/clock.py). The mark is written outside the step's savepoint, so it
                # commits with the batch even when the step is undone.
                if self._mark_unsaved or clock.needs_mark(now):
                    self._save_clock(conn)
                    self._mark_unsaved = False
                    marked = True
                answer = self._step(conn, job, now + self.clock_offset_ms)
                if conn.in_transaction:
                    in_tx.append(answer)
                else:
                    # SQLite rolled the whole transaction back (it does on some I/O errors):
                    # the earlier steps of the batch are undone too. Say so, and start over;
                    # the step that failed keeps its own error.
                    answers += _undone(in_tx, "the transaction was rolled back")
                    answers.append(answer)
                    in_tx = []
                    self._mark_unsaved = self._mark_unsaved or marked
                    marked = False
            if i == len(jobs) and time.monotonic() - started < BATCH_MAX_SECONDS:
                self._take(jobs)
        if conn.in_transaction:
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._mark_unsaved = self._mark_unsaved or marked
                if conn.in_transaction:
                    # The COMMIT did not happen (e.g. busy): undo it ourselves, certainly
                    # unapplied.
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    answers += _undone(in_tx, f"COMMIT failed ({exc})")
                else:
                    # SQLite gave up on the COMMIT itself (an I/O error): the WAL may hold it
                    # all the same, so after a restart it may show up.
                    unknown = StoreUnavailable(
                        f"SQLite COMMIT failed ({exc}); the step may or may not have been applied"
                    )
                    answers += [(job, None, unknown) for job, _, _ in in_tx]
                in_tx = []
            else:
                self.commits += 1
                self.committed_steps += len(in_tx)
        answers += in_tx
        self._answer(answers)

    @staticmethod
    def _step(conn: sqlite3.Connection, job: _Job, now: int) -> _Answer:
        conn.execute("SAVEPOINT step")
        try:
            result = job.fn(conn, now)
        except Exception as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK TO step")
                conn.execute("RELEASE step")
            return job, None, exc
        conn.execute("RELEASE step")
        return job, result, None

    @staticmethod
    def _answer(answers: list[_Answer]) -> None:
        """Hand the answers to their event loops: one wake-up per loop and batch."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Answer]] = {}
        for answer in answers:
            by_loop.setdefault(answer[0].loop, []).append(answer)
        for loop, settled in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, settled)

    async def _run(self, fn: Callable[[sqlite3.Connection, int], T], op: str = "other") -> T:
        """One atomic step, run by the writer thread (in a batch with the steps queued with it).

        ``store.timeout_ms`` bounds the wait in the queue and for SQLite's write lock; both
        give up before applying anything. The outer guard only catches a hung disk, and its
        503 says the outcome is unknown.
        """
        if self._thread is None or self._closing:
            raise StoreUnavailable("the SQLite store is not open")
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        future: asyncio.Future[object] = loop.create_future()
        self._queue.put(_Job(fn, started + self._timeout_s, loop, future))
        try:
            async with asyncio.timeout(4 * self._timeout_s + 5):
                result = cast(T, await future)
            self.observe(op, time.monotonic() - started)
            return result
        except FencegateError:
            raise
        except TimeoutError as exc:
            raise StoreUnavailable(
                "SQLite store hung past its timeout; the step may or may not have been applied"
            ) from exc
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"SQLite store unavailable ({exc}); {_NOTHING}") from exc
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"SQLite store failed: {exc!r}") from exc

    async def open(self) -> None:
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        thread = threading.Thread(
            target=self._serve, args=(ready,), name="fencegate-sqlite", daemon=True
        )
        thread.start()
        try:
            await asyncio.wrap_future(ready)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"cannot open SQLite store {self.path!r}: {exc}") from exc
        self._thread = thread

    async def close(self) -> None:
        if self._thread is None or self._closing:
            return
        self._closing = True
        self._queue.put(None)  # after every step already queued
        await asyncio.wrap_future(self._stopped)

    async def ping(self) -> None:
        await self._run(lambda conn, now: conn.execute("SELECT 1").fetchone(), "ping")

    async def now_ms(self) -> int:
        return await self._run(lambda conn, now: now, "now")

    async def _steps(self, make: Callable[[], sql_steps.Step[T]], op: str) -> T:
        """Run a shared SQL step (``ledger.sql_steps``) in the writer thread; ``make`` builds
        it there, so whatever it reads of the store (its clock) is read at step time."""
        return await self._run(
            lambda conn, now: sql_steps.run_sync(_executor(conn), make(), now),
            op,
        )

    def _windows_from(self) -> int:
        # Records created before a reboot whose downtime the clock lost get no window (read
        # in the writer thread, when the step runs).
        assert self._store_clock is not None
        return int(self._store_clock.windows_from) + self.clock_offset_ms


def _executor(conn: sqlite3.Connection) -> Callable[[sql_steps.Sql], Any]:
    def execute(sql: sql_steps.Sql) -> Any:
        cursor = conn.execute(sql.text, sql.args)
        if sql.rows == "one":
            return cursor.fetchone()
        if sql.rows == "all":
            return cursor.fetchall()
        return None

    return execute


def _check_url(url: str) -> None:
    if not url.startswith("sqlite:///") or len(url) == len("sqlite:///"):
        raise ValueError("sqlite URL needs a path, e.g. sqlite:///fencegate.db")


def _create(url: str, policy: LeasePolicy, options: StoreOptions) -> Store:
    path = url[len("sqlite:///") :]  # relative to the working directory, or absolute
    store = SQLiteStore(
        path, policy, timeout_ms=options.timeout_ms, synchronous=options.sqlite_synchronous
    )
    store.max_dependents = options.max_dependents
    store.max_cascade = options.max_cascade
    return store


#: ``sqlite:///rel.db`` or ``sqlite:////abs.db`` (ledger.registry).
STORE_KIND = StoreKind(
    schemes=("sqlite",), example="sqlite:///PATH", check_url=_check_url, create=_create
)
