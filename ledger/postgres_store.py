"""The PostgreSQL store: many gateway processes, synchronous replication, managed failover.

Every transition is one READ COMMITTED transaction that runs the shared step of
``ledger.sql_steps`` (the same text SQLite runs): the rows it writes are locked ``FOR UPDATE``
as they are read, and the scheduler epoch is read under a *shared* advisory lock that only an
epoch bump or a claims pause takes exclusively, so claims and fenced calls never queue behind
each other for the epoch (docs/stores.md, "The epoch without a global lock"). A step that
raced another for a row that did not exist yet (a unique violation), or a deadlock, is run
again from the start: nothing of it was committed.

Time is the database's ``clock_timestamp()``, read after the step holds its locks, never the
gateway's. A store that does not answer within ``store.timeout_ms`` is 503
``STORE_UNAVAILABLE``: "nothing was applied" when the COMMIT was never sent, "may or may not
have been applied" when it was (the proxy then treats the step like any unanswered one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar
from urllib.parse import parse_qsl

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from fencegate.ledger import sql_steps
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

__all__ = ["STORE_KIND", "PostgresStore", "durability_warnings"]

log = structlog.get_logger("fencegate.store")

T = TypeVar("T")
R = TypeVar("R")
#: A pooled connection, as the pool hands it out.
_Conn: TypeAlias = "PoolConnectionProxy[asyncpg.Record]"

#: Advisory lock keys (per database): the scheduler row's readers/writers, schema set-up, and
#: puts that change the dependency graph.
_SCHEDULER_LOCK = 0x66656E6365  # "fence"
_SCHEMA_LOCK = 0x666E636573  # "fnces"
_GRAPH_LOCK = 0x6772617068  # "graph"

#: A step that lost a race for a new row (or a deadlock) is run again, this many times at most.
_RETRIES = 8

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS fencegate_schema (
        id      INTEGER PRIMARY KEY CHECK (id = 1),
        version INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS tasks (
        task_id          TEXT PRIMARY KEY,
        state            TEXT NOT NULL,
        lease_expires_at BIGINT,
        fields           TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS tasks_leases ON tasks (state, lease_expires_at)",
    """CREATE TABLE IF NOT EXISTS scheduler (
        id     INTEGER PRIMARY KEY CHECK (id = 1),
        epoch  BIGINT NOT NULL,
        paused INTEGER NOT NULL
    )""",
    "INSERT INTO scheduler (id, epoch, paused) VALUES (1, 1, 0) ON CONFLICT (id) DO NOTHING",
    """CREATE TABLE IF NOT EXISTS effects (
        effect_id   TEXT PRIMARY KEY,
        task_id     TEXT NOT NULL,
        downstream  TEXT NOT NULL,
        state       TEXT NOT NULL,
        deadline_at BIGINT,
        created_at  BIGINT NOT NULL,
        fields      TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS effects_order ON effects (created_at, effect_id)",
    "CREATE INDEX IF NOT EXISTS effects_task ON effects (task_id, created_at, effect_id)",
    "CREATE INDEX IF NOT EXISTS effects_state ON effects (state, created_at, effect_id)",
)

#: Schema version 2 (task flow, ``sql_steps.SCHEMA_VERSION``), run on a new database or one
#: of version 1 (before version 3's ``_RETENTION_SCHEMA``), each statement idempotent: queue
#: columns, dependents, and the change feed. An event row's ``xid`` is its transaction's
#: (``ledger.sql_steps.read_events`` says why).
_TASK_EVENT = """json_build_object('type', 'task', 'taskId', NEW.task_id, 'state', NEW.state,
        'queue', NEW.queue,
        'revision', (NEW.fields::jsonb ->> 'revision')::bigint,
        'claimGeneration', (NEW.fields::jsonb ->> 'claim_generation')::bigint,
        'at', (NEW.fields::jsonb ->> 'updated_at')::bigint)::text"""
#: A keyed effect's row holds ``sql_steps.NO_TASK`` as its task: its event says null.
_EFFECT_EVENT = f"""json_build_object('type', 'effect', 'effectId', NEW.effect_id,
        'taskId', NULLIF(NEW.task_id, '{sql_steps.NO_TASK}'), 'state', NEW.state,
        'downstream', NEW.downstream,
        'at', (NEW.fields::jsonb ->> 'updated_at')::bigint)::text"""
_EFFECT_EVENT_FUNCTION = f"""CREATE OR REPLACE FUNCTION fencegate_effect_event() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' OR OLD.state IS DISTINCT FROM NEW.state THEN
            INSERT INTO events (body) VALUES ({_EFFECT_EVENT});
        END IF;
        RETURN NULL;
    END $$"""
_FLOW_SCHEMA = (
    *(
        f"ALTER TABLE tasks ADD COLUMN IF NOT EXISTS {name} {sql_type}"
        for name, sql_type in sql_steps.TASK_FLOW_COLUMNS
    ),
    "CREATE INDEX IF NOT EXISTS tasks_queue "
    "ON tasks (queue, state, priority DESC, ready_at, task_id)",
    "CREATE INDEX IF NOT EXISTS tasks_queue_expiry ON tasks (queue, state, lease_expires_at)",
    "CREATE INDEX IF NOT EXISTS tasks_queue_epoch ON tasks (queue, state, claim_epoch)",
    "CREATE TABLE IF NOT EXISTS cascades (task_id TEXT PRIMARY KEY)",
    """CREATE TABLE IF NOT EXISTS dependents (
        task_id      TEXT NOT NULL,
        dependent_id TEXT NOT NULL,
        PRIMARY KEY (task_id, dependent_id)
    )""",
    """CREATE TABLE IF NOT EXISTS events (
        xid  BIGINT NOT NULL DEFAULT (pg_current_xact_id()::text::bigint),
        seq  BIGSERIAL PRIMARY KEY,
        body TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS events_order ON events (xid, seq)",
    """CREATE TABLE IF NOT EXISTS events_trimmed (
        id  INTEGER PRIMARY KEY CHECK (id = 1),
        xid BIGINT NOT NULL,
        seq BIGINT NOT NULL
    )""",
    f"""CREATE OR REPLACE FUNCTION fencegate_task_event() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' OR OLD.state IS DISTINCT FROM NEW.state
           OR (OLD.fields::jsonb ->> 'revision') IS DISTINCT FROM (NEW.fields::jsonb ->> 'revision')
           OR (OLD.fields::jsonb ->> 'claim_generation')
              IS DISTINCT FROM (NEW.fields::jsonb ->> 'claim_generation') THEN
            INSERT INTO events (body) VALUES ({_TASK_EVENT});
        END IF;
        RETURN NULL;
    END $$""",
    _EFFECT_EVENT_FUNCTION,
    "DROP TRIGGER IF EXISTS tasks_event ON tasks",
    "CREATE TRIGGER tasks_event AFTER INSERT OR UPDATE ON tasks "
    "FOR EACH ROW EXECUTE FUNCTION fencegate_task_event()",
    "DROP TRIGGER IF EXISTS effects_event ON effects",
    "CREATE TRIGGER effects_event AFTER INSERT OR UPDATE ON effects "
    "FOR EACH ROW EXECUTE FUNCTION fencegate_effect_event()",
)

#: Schema version 3 (retention): ``sql_steps.RETENTION_TABLES`` and the triggers that keep
#: the settled index. A task entering COMMITTED or CANCELLED gets its entry, due from the
#: ``updated_at`` it settled at; one going back to an open state (a new revision) loses it; a
#: write that leaves it settled (a commit replay, a cancel of a cancelled task) does not touch
#: it. The triggers' WHEN clauses are checked without calling the function, so a claim, a
#: renew or a prepare pays nothing for them, and a commit writes its entry within its UPDATE:
#: no step takes a round trip more. Then the backfill of tasks already settled.
_SETTLED = sql_steps.SETTLED_STATES_SQL
_RETENTION_SCHEMA = (
    *sql_steps.RETENTION_TABLES,
    f"""CREATE OR REPLACE FUNCTION fencegate_task_settled() RETURNS trigger
    LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.state IN {_SETTLED} THEN
            INSERT INTO settled (task_id, due_at)
            VALUES (NEW.task_id, (NEW.fields::jsonb ->> 'updated_at')::bigint)
            ON CONFLICT (task_id) DO UPDATE SET due_at = excluded.due_at;
        ELSE
            DELETE FROM settled WHERE task_id = NEW.task_id;
        END IF;
        RETURN NULL;
    END $$""",
    "DROP TRIGGER IF EXISTS tasks_settled_insert ON tasks",
    "CREATE TRIGGER tasks_settled_insert AFTER INSERT ON tasks FOR EACH ROW "
    f"WHEN (NEW.state IN {_SETTLED}) EXECUTE FUNCTION fencegate_task_settled()",
    "DROP TRIGGER IF EXISTS tasks_settled_update ON tasks",
    "CREATE TRIGGER tasks_settled_update AFTER UPDATE OF state ON tasks FOR EACH ROW "
    f"WHEN ((OLD.state IN {_SETTLED}) IS DISTINCT FROM (NEW.state IN {_SETTLED})) "
    "EXECUTE FUNCTION fencegate_task_settled()",
)

#: Schema version 4 (keyed effects): ``sql_steps.KEYED_TABLES``, and the effect events'
#: function replaced (a version-2 or -3 database has it without the ``NULLIF``).
_KEYED_SCHEMA = (*sql_steps.KEYED_TABLES, _EFFECT_EVENT_FUNCTION)

#: The database's time in ms. ``clock_timestamp()`` (not ``now()``, fixed at BEGIN): read
#: after the step's locks are held.
_NOW_SQL = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

_NOTHING = "nothing was applied"
_MAYBE = "the step may or may not have been applied"

#: Driver errors that mean "the database did not do it, and may not be reachable": a lost
#: connection, a standby that cannot write (during a failover), a timeout set below.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    TimeoutError,
    OSError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.QueryCanceledError,
    asyncpg.LockNotAvailableError,
    asyncpg.TooManyConnectionsError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidPasswordError,
    asyncpg.InvalidCatalogNameError,
    # The driver's own state errors: every host reached is read-only (the old primary fenced,
    # the standby not promoted yet: TargetServerAttributeNotMatched), or a connection the
    # server ended between two calls ("cannot switch to state ...").
    asyncpg.InternalClientError,
)
#: Errors after which the whole step is run again (its transaction was rolled back).
_RETRY: tuple[type[BaseException], ...] = (
    asyncpg.UniqueViolationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
)


@functools.lru_cache(maxsize=512)
def _numbered(text: str) -> str:
    """``?`` placeholders (the shared steps' form) as PostgreSQL's ``$1, $2...``."""
    count = iter(range(1, 10_000))
    return re.sub(r"\?", lambda _: f"${next(count)}", text)


#: The first transaction id whose events may still be written (``sql_steps.read_events``
#: reads only below it): the oldest transaction the statement's snapshot sees running, left
#: out those known to run in another database of the server (a session is bound to one
#: database for life, so they cannot write this database's ``events``), else the snapshot's
#: xmax. A transaction of another database (another application's long write, a forgotten
#: prepared transaction, a neighbouring test's) no longer holds this store's events back;
#: one of this database still does (docs/stores.md, "The change feed"). A running id the
#: activity views do not show (it ended meanwhile, or they hide it) counts as this database's:
#: a later read goes on. The views are read only when the snapshot shows something running.
_EVENTS_HORIZON = """(SELECT COALESCE(
        (SELECT min(x) FROM pg_snapshot_xip(snap.s) AS x
          WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity AS a
                            WHERE a.backend_xid = xid(x) AND a.datname <> current_database())
            AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts AS p
                            WHERE p.transaction = xid(x) AND p.database <> current_database())),
        pg_snapshot_xmax(snap.s))::text::bigint
    FROM (SELECT pg_current_snapshot() AS s) AS snap)"""

#: The newest position issued, as a bound: every position handed out (an event's, or the end
#: ``events_end`` names, ``(horizon - 1, 2**62)``) has its xid below the horizon of its read,
#: which is at most that snapshot's xmax (one past the newest finished transaction id), and
#: xmax only grows; so ``(xmax - 1, 2**62)`` is at or above all of them. Only a restore of an
#: older copy or a failover that lost commits takes the transaction ids back below a position
#: handed out. Not the horizon itself: a read's horizon may be below an earlier one's (a
#: running transaction of another database that the activity views show to one read and not
#: to the next), and a position handed out must never be refused.
_EVENTS_NEWEST = (
    f"SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint - 1 AS xid, {2**62} AS seq"
)

#: PostgreSQL's fragments for the shared steps (``ledger.sql_steps.Dialect``).
_POSTGRES = sql_steps.Dialect(
    for_update=" FOR UPDATE",
    lock_scheduler_shared=f"SELECT pg_advisory_xact_lock_shared({_SCHEDULER_LOCK})",
    lock_scheduler_exclusive=f"SELECT pg_advisory_xact_lock({_SCHEDULER_LOCK})",
    json_text=lambda key: f"(fields::jsonb ->> '{key}')",
    json_int=lambda key: f"((fields::jsonb ->> '{key}')::bigint)",
    for_update_skip_locked=" FOR UPDATE SKIP LOCKED",
    lock_dependency_graph=f"SELECT pg_advisory_xact_lock({_GRAPH_LOCK})",
    events_visible=f"xid < {_EVENTS_HORIZON}",
    events_end=f"SELECT {_EVENTS_HORIZON} - 1, {2**62}",
    events_newest=_EVENTS_NEWEST,
    # Each table with its indexes and TOAST, found on the search path like every statement.
    table_bytes="SELECT name, COALESCE(pg_total_relation_size(to_regclass(name)), 0) "
    f"FROM unnest(ARRAY[{', '.join(repr(t) for t in sql_steps.STORE_TABLES)}]::text[]) AS name",
    store_bytes="",
)


def durability_warnings(settings: dict[str, str], standbys: int) -> list[str]:
    """What an answered transition could lose with these server settings (``SHOW``) and
    ``standbys`` connected standbys. Pure, so every combination is tested without a server."""
    warnings: list[str] = []
    if settings.get("fsync") != "on":
        warnings.append("fsync is off: a crash of the database host can lose or corrupt data")
    commit = settings.get("synchronous_commit", "on")
    if commit == "off":
        warnings.append(
            "synchronous_commit=off: a crash of the database can lose the last answered steps"
        )
    names = settings.get("synchronous_standby_names", "")
    if names and commit == "local":
        warnings.append(
            "synchronous_commit=local: a failover to a standby can lose answered steps "
            "(use on, remote_write or remote_apply)"
        )
    if standbys and not names:
        warnings.append(
            "standbys replicate asynchronously (synchronous_standby_names is empty): a "
            "failover can lose answered steps"
        )
    return warnings


class _Sent:
    """Whether a step's COMMIT went out: after that, a lost answer may hide an applied step."""

    __slots__ = ("commit",)

    def __init__(self) -> None:
        self.commit = False


async def _keep_as_it_is(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    """What a connection needs on its way back to the pool beyond asyncpg's own clean-up (a
    ROLLBACK, only if a transaction is open): nothing. The store keeps no session state (no
    LISTEN, advisory lock, cursor or SET), and a connection that failed mid-step is terminated
    before it is released (``_with_connection``). asyncpg's default reset is a round trip
    (``UNLISTEN``, ``RESET ALL``...) that, with the server frozen, timed out in a task nobody
    awaited: "Task exception was never retrieved" in the gateway's log."""


class PostgresStore(SqlStore):
    dialect = _POSTGRES

    #: Tests only: when set, store time stands at this instant (plus ``clock_offset_ms``)
    #: instead of the database's clock. Production never sets it; no config key reaches it.
    clock_pinned_ms: int | None = None

    def __init__(
        self,
        url: str,
        policy: LeasePolicy,
        *,
        timeout_ms: int = 2000,
        password: str | None = None,
        max_connections: int = 20,
    ) -> None:
        super().__init__(policy)
        self.url = url
        self._timeout_s = timeout_ms / 1000
        self._password = password
        self._max_connections = max_connections
        self._pool: asyncpg.Pool | None = None
        self._ready = False  # the schema is known to be there and of a version we read
        self._setup = asyncio.Lock()
        self._closed = False

    @property
    def kind(self) -> str:
        return "postgres"

    # --- plumbing ---------------------------------------------------------------------------

    async def open(self) -> None:
        timeout_ms = max(1, int(self._timeout_s * 1000))
        self._pool = asyncpg.create_pool(
            self.url,
            password=self._password,
            min_size=0,
            max_size=self._max_connections,
            timeout=self._timeout_s,  # connecting
            command_timeout=self._timeout_s,
            reset=_keep_as_it_is,
            # Bounded server-side too: a lock wait or a statement never outlives the caller.
            server_settings={
                "application_name": "fencegate",
                "lock_timeout": str(timeout_ms),
                "statement_timeout": str(timeout_ms),
                "idle_in_transaction_session_timeout": str(4 * timeout_ms + 5000),
            },
        )
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._pool
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"PostgreSQL did not answer ({_reason(exc)})") from exc
        await self._ensure_schema()

    async def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout_s):
                    await self._pool.close()
            self._pool.terminate()

    async def _ensure_schema(self) -> None:
        """Create the tables on first start, under a lock (two gateways may start at once),
        and refuse a database whose schema is newer than this code knows."""
        if self._ready:
            return
        async with self._setup:
            if self._ready:
                return

            async def create(conn: _Conn) -> int:
                async with conn.transaction():
                    # One round trip per script (the simple query protocol takes several
                    # statements): a new database is set up in three.
                    await conn.execute(
                        ";\n".join((f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK})", *_SCHEMA))
                    )
                    found: int | None = await conn.fetchval(
                        "SELECT version FROM fencegate_schema WHERE id = 1"
                    )
                    self.schema_found = found
                    if found is not None and found >= sql_steps.SCHEMA_VERSION:
                        return found
                    # New, or written by an older fencegate: upgrade (idempotent steps, the
                    # version row last), one script.
                    upgrade = list(_KEYED_SCHEMA)
                    if found is None or found < 3:
                        upgrade[:0] = [*_RETENTION_SCHEMA, sql_steps.backfill_settled(_POSTGRES)]
                    if found is None or found < 2:
                        upgrade[:0] = _FLOW_SCHEMA
                    await conn.execute(";\n".join(upgrade))
                    await conn.execute(
                        "INSERT INTO fencegate_schema (id, version) VALUES (1, $1) "
                        "ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                        sql_steps.SCHEMA_VERSION,
                    )
                    return sql_steps.SCHEMA_VERSION

            version = await self._with_connection(create)
            sql_steps.check_schema_version(version, f"PostgreSQL database {_public(self.url)}")
            self._ready = True
            # Once per start (or per first contact, for a database that was down): say what
            # an answered step could lose under the server's settings (docs/stores.md).
            for warning in await self.durability():
                log.warning("store.durability_warning", store="postgres", reason=warning)

    async def _with_connection(
        self, use: Callable[[_Conn], Awaitable[R]], sent: _Sent | None = None
    ) -> R:
        """Run ``use`` on a pooled connection within ``store.timeout_ms``; driver failures
        become ``StoreUnavailable``, saying "may or may not have been applied" once ``sent``
        records that a COMMIT went out."""
        if self._pool is None or self._closed:
            raise StoreUnavailable("the PostgreSQL store is not open")
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._pool.acquire() as conn:
                    try:
                        return await use(conn)
                    except FencegateError:
                        raise  # a refusal: its transaction was rolled back, the connection is fine
                    except BaseException:
                        # Mid-transaction, mid-reply or broken: never handed out again.
                        if not conn.is_closed():
                            conn.terminate()
                        raise
        except FencegateError:
            raise
        except _UNAVAILABLE as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            outcome = _MAYBE if sent is not None and sent.commit else _NOTHING
            raise StoreUnavailable(
                f"PostgreSQL did not answer ({_reason(exc)}); {outcome}"
            ) from exc
        except asyncpg.PostgresError as exc:
            outcome = _MAYBE if sent is not None and sent.commit else _NOTHING
            raise StoreUnavailable(
                f"PostgreSQL refused the step ({_reason(exc)}); {outcome}"
            ) from exc

    async def _now(self, conn: _Conn) -> int:
        if self.clock_pinned_ms is not None:
            return self.clock_pinned_ms + self.clock_offset_ms
        now: int = await conn.fetchval(_NOW_SQL)
        return now + self.clock_offset_ms

    async def _drive(self, conn: _Conn, step: sql_steps.Step[T]) -> T:
        """Open the transaction and run ``step`` in it. ``BEGIN`` goes out with the step's
        first statement when that one takes no argument (the scheduler lock of claims, renews,
        commits and prepares): one round trip fewer, on the simple query protocol, which runs
        several statements in order as one message."""
        reply: Any = None
        begun = False
        while True:
            try:
                sql = step.send(reply)
            except StopIteration as done:
                if not begun:
                    await conn.execute("BEGIN")
                return done.value  # type: ignore[no-any-return]
            if not begun:
                begun = True
                if sql.rows == "none" and not sql.args:
                    await conn.execute(f"BEGIN; {sql.text}")
                    reply = None
                    continue
                await conn.execute("BEGIN")
            if sql.rows == "now":
                reply = await self._now(conn)
            elif sql.rows == "one":
                reply = await conn.fetchrow(_numbered(sql.text), *sql.args)
            elif sql.rows == "all":
                reply = await conn.fetch(_numbered(sql.text), *sql.args)
            else:
                await conn.execute(_numbered(sql.text), *sql.args)
                reply = None

    async def _steps(self, make: Callable[[], sql_steps.Step[T]], op: str) -> T:
        """One transition: BEGIN, the shared step, COMMIT (``_drive``); run again (from a fresh
        step) when it lost a race its transaction could not see coming."""
        await self._ensure_schema()
        started = time.monotonic()

        sent = _Sent()

        async def transaction(conn: _Conn) -> T:
            for attempt in range(_RETRIES):
                try:
                    result = await self._drive(conn, make())
                except _RETRY:
                    await conn.execute("ROLLBACK")
                    await asyncio.sleep(0.001 * attempt)
                    continue
                except FencegateError:
                    if conn.is_in_transaction():
                        await conn.execute("ROLLBACK")
                    raise
                sent.commit = True
                await conn.execute("COMMIT")
                return result
            raise StoreUnavailable(f"PostgreSQL: the step kept conflicting; {_NOTHING}")

        result = await self._with_connection(transaction, sent)
        self.observe(op, time.monotonic() - started)
        return result

    async def durability(self) -> list[str]:
        async def read(conn: _Conn) -> tuple[dict[str, str], int]:
            settings = {
                name: await conn.fetchval(f"SHOW {name}")
                for name in ("fsync", "synchronous_commit", "synchronous_standby_names")
            }
            standbys: int = await conn.fetchval("SELECT count(*) FROM pg_stat_replication")
            return settings, standbys

        settings, standbys = await self._with_connection(read)
        return durability_warnings(settings, standbys)

    async def ping(self) -> None:
        await self._ensure_schema()
        await self._with_connection(lambda conn: conn.fetchval("SELECT 1"))

    async def now_ms(self) -> int:
        await self._ensure_schema()
        now: int = await self._with_connection(self._now)
        return now


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _public(url: str) -> str:
    """The URL without its query (which may name hosts' options, never a secret here)."""
    return url.split("?", 1)[0]


def _check_url(url: str) -> None:
    """Refuse a password in the URL (it would sit in the config file and in logs): it comes
    from the environment variable ``store.password_env`` names."""
    rest = url.split("://", 1)[1]
    authority, _, path_query = rest.partition("/")
    userinfo, at, _hosts = authority.rpartition("@")
    if at and ":" in userinfo:
        raise ValueError(
            "a password in the PostgreSQL URL is refused: set store.password_env to the name "
            "of an environment variable that holds it, and write postgresql://USER@HOST:PORT/DB"
        )
    query = path_query.partition("?")[2]
    if any(key.lower() in ("password", "passfile") for key, _ in parse_qsl(query)):
        raise ValueError(
            "a password in the PostgreSQL URL's query is refused: set store.password_env instead"
        )
    if not _hosts:
        raise ValueError("PostgreSQL URL needs a host, e.g. postgresql://USER@HOST:5432/DB")


def _create(url: str, policy: LeasePolicy, options: StoreOptions) -> Store:
    store = PostgresStore(
        url,
        policy,
        timeout_ms=options.timeout_ms,
        password=options.password,
        max_connections=options.postgres_max_connections,
    )
    store.max_dependents = options.max_dependents
    store.max_cascade = options.max_cascade
    return store


#: ``postgresql://USER@HOST:PORT/DB`` (several ``HOST:PORT`` separated by commas, with
#: ``?target_session_attrs=read-write``, for a failover pair) (ledger.registry).
STORE_KIND = StoreKind(
    schemes=("postgresql", "postgres"),
    example="postgresql://USER@HOST:PORT/DB",
    check_url=_check_url,
    create=_create,
)
