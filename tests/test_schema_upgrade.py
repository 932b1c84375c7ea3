"""A database written by an older schema version opens, is upgraded in place to the current
one, and its tasks keep working: nothing a running deployment stored is stranded.

Version 1 (before task flow) is written here as that version created it; version 2 (before
retention) by the stores' own version-2 DDL, which version 3 only adds to (``_SCHEMA`` and
``_FLOW_SCHEMA`` of each SQL store; ledger/sql_steps.py ``SCHEMA_VERSION`` says what each
version added). Version 3's upgrade fills the settled index from the tasks already settled,
so they expire like any other. Version 4 (keyed effects) adds the keyed index and writes the
effect events' trigger again, so a keyed effect's event says ``taskId`` null; a version-3
database is written here with that trigger as version 3 had it.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from fencegate.ledger import effects, postgres_store, sql_steps, sqlite_store, tasks
from fencegate.ledger.effects import Effect, EffectState
from fencegate.ledger.errors import EffectExpired, TaskExpired
from fencegate.ledger.postgres_store import PostgresStore
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import (
    ClaimRequest,
    Commit,
    DepCommit,
    LeasePolicy,
    PutOutcome,
    Task,
    TaskState,
)
from tests.conftest import STORE_TIMEOUT_MS, postgres_test_url
from tests.postgres_server import PostgresServer

POLICY = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)

#: The tables of schema version 1, as both SQL stores created them.
VERSION_1 = (
    "CREATE TABLE fencegate_schema (id INTEGER PRIMARY KEY CHECK (id = 1), "
    "version INTEGER NOT NULL)",
    "CREATE TABLE tasks (task_id TEXT PRIMARY KEY, state TEXT NOT NULL, "
    "lease_expires_at BIGINT, fields TEXT NOT NULL)",
    "CREATE INDEX tasks_leases ON tasks (state, lease_expires_at)",
    "CREATE TABLE scheduler (id INTEGER PRIMARY KEY CHECK (id = 1), epoch BIGINT NOT NULL, "
    "paused INTEGER NOT NULL)",
    "INSERT INTO scheduler (id, epoch, paused) VALUES (1, 1, 0)",
    "CREATE TABLE effects (effect_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, "
    "downstream TEXT NOT NULL, state TEXT NOT NULL, deadline_at BIGINT, "
    "created_at BIGINT NOT NULL, fields TEXT NOT NULL)",
    "INSERT INTO fencegate_schema (id, version) VALUES (1, 1)",
)
#: A READY task as version 1 stored it.
OLD_TASK = {
    "state": "READY",
    "task_id": "old-task",
    "input_digest": "in-1",
    "revision": "1",
    "created_at": "1000",
    "updated_at": "1000",
    "ready_at": "1000",
    "claim_generation": "0",
    "cancel_generation": "0",
}
INSERT_OLD = (
    "INSERT INTO tasks (task_id, state, lease_expires_at, fields) "
    "VALUES ('old-task', 'READY', NULL, '{}')"
)
#: A task version 1 cancelled: the upgrade to version 3 puts it in the settled index.
OLD_CANCELLED = {
    **OLD_TASK,
    "state": "CANCELLED",
    "task_id": "old-cancelled",
    "cancel_generation": "1",
    "updated_at": "1500",
}
INSERT_CANCELLED = (
    "INSERT INTO tasks (task_id, state, lease_expires_at, fields) "
    "VALUES ('old-cancelled', 'CANCELLED', NULL, '{}')"
)


async def exercise_upgraded(store: Store) -> None:
    """The old task reads and claims as before; the new features work beside it."""
    stats = await store.store_stats(0)
    assert (stats.tasks, stats.settled_tasks, stats.due_tasks) == (2, 1, 1)
    old = await store.get_task("old-task")
    assert old.state is TaskState.READY and old.queue is None and old.depends_on == ()
    _, start = await store.read_events(None, 10)
    claimed = await store.claim("old-task", ClaimRequest("w", 10_000, 1))
    assert claimed.claim_generation == 1
    await store.put_task("new-task", "in", None, queue="q", depends_on=("old-task",))
    assert (await store.get_task("new-task")).state is TaskState.WAITING
    assert await store.claim_next("q", ClaimRequest("w", 10_000, 1)) is None
    events, _ = await store.read_events(start, 10)
    assert [(e.body["taskId"], e.body["state"]) for e in events] == [
        ("old-task", "CLAIMED"),
        ("new-task", "WAITING"),
    ]


async def test_a_version_1_sqlite_file_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    with sqlite3.connect(path) as conn:
        for statement in VERSION_1:
            conn.execute(statement)
        conn.execute(INSERT_OLD.replace("'{}'", "?"), (json.dumps(OLD_TASK),))
        conn.execute(INSERT_CANCELLED.replace("'{}'", "?"), (json.dumps(OLD_CANCELLED),))
    for first in (True, False):  # the second open finds version 2 and changes nothing
        store = SQLiteStore(str(path), POLICY, timeout_ms=STORE_TIMEOUT_MS)
        await store.open()
        try:
            if first:
                await exercise_upgraded(store)
        finally:
            await store.close()
    with sqlite3.connect(path) as conn:
        (version,) = conn.execute("SELECT version FROM fencegate_schema").fetchone()
    assert version == sql_steps.SCHEMA_VERSION == 4


async def test_a_version_1_postgres_database_is_upgraded_in_place(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    url = postgres_test_url(postgres_server, request)
    conn = await asyncpg.connect(url)
    try:
        for statement in VERSION_1:
            await conn.execute(statement)
        await conn.execute(INSERT_OLD.replace("'{}'", "$1"), json.dumps(OLD_TASK))
        await conn.execute(INSERT_CANCELLED.replace("'{}'", "$1"), json.dumps(OLD_CANCELLED))
    finally:
        await conn.close()
    store = PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    try:
        await exercise_upgraded(store)
    finally:
        await store.close()
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT version FROM fencegate_schema") == 4
    finally:
        await conn.close()


# --- version 2 -> 3 (retention) -------------------------------------------------------------


def _done(task_id: str, updated_at: int, **more: Any) -> Task:
    """A task committed at ``updated_at`` by its first claim."""
    return Task(
        task_id=task_id,
        state=TaskState.COMMITTED,
        revision=1,
        input_digest=f"in-{task_id}",
        created_at=1_000,
        updated_at=updated_at,
        ready_at=1_000,
        claim_generation=1,
        attempt_id="a1",
        owner="w",
        claim_epoch=1,
        claim_revision=1,
        attempt_started_at=1_000,
        lease_expires_at=11_000,
        commit=Commit("c1", "a1", 1, "r", updated_at),
        **more,
    )


#: What a version-2 gateway left behind: a committed task with a committed effect, a cancelled
#: one, an open one, and a committed dependency with an open dependent.
V2_TASKS = (
    _done("done", 2_000),
    Task("dropped", TaskState.CANCELLED, 1, "in-dropped", 1_000, 3_000, cancel_generation=1),
    Task("open", TaskState.READY, 1, "in-open", 1_000, 1_000, ready_at=1_000, queue="q"),
    _done("base", 4_000),
    Task(
        "child",
        TaskState.READY,
        1,
        "in-child",
        1_000,
        4_000,
        ready_at=4_000,
        depends_on=("base",),
        dep_commits=(DepCommit("base", "c1", "r"),),
    ),
)
V2_EFFECT = Effect(
    effect_id=effects.effect_id("done", 1, "main", "s1"),
    task_id="done",
    revision=1,
    node="main",
    slot="s1",
    downstream="api",
    method="POST",
    path="/x",
    payload_digest="d1",
    state=EffectState.COMMITTED,
    created_at=1_500,
    updated_at=1_600,
)


def v2_rows() -> list[tuple[str, tuple[Any, ...]]]:
    """The rows as a version-2 store wrote them (``?`` placeholders)."""
    out: list[tuple[str, tuple[Any, ...]]] = []
    for task in V2_TASKS:
        out.append(
            (
                "INSERT INTO tasks (task_id, state, lease_expires_at, queue, priority, ready_at, "
                "claim_epoch, fields) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    task.task_id,
                    task.state.value,
                    task.lease_expires_at,
                    task.queue,
                    task.priority,
                    task.ready_at,
                    task.claim_epoch,
                    json.dumps(tasks.task_to_fields(task)),
                ),
            )
        )
    out.append(("INSERT INTO dependents (task_id, dependent_id) VALUES (?, ?)", ("base", "child")))
    e = V2_EFFECT
    out.append(
        (
            "INSERT INTO effects (effect_id, task_id, downstream, state, deadline_at, created_at, "
            "fields) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                e.effect_id,
                e.task_id,
                e.downstream,
                e.state.value,
                e.deadline_at,
                e.created_at,
                json.dumps(effects.effect_to_fields(e)),
            ),
        )
    )
    return out


def numbered(text: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1, $2...``."""
    count = iter(range(1, 100))
    return re.sub(r"\?", lambda _: f"${next(count)}", text)


async def exercise_upgraded_v2(store: Store) -> None:
    """The settled tasks were put in the settled index (due from when they settled) and
    expire; the open ones and a needed dependency stay."""
    stats = await store.store_stats(0)
    assert (stats.tasks, stats.settled_tasks, stats.due_tasks) == (5, 3, 3)
    report = await store.expire_settled(0, 600_000, 100)
    assert (report.examined, report.expired_tasks, report.expired_effects) == (3, 2, 1)
    assert report.kept == {"dependents": 1}
    with pytest.raises(TaskExpired):
        await store.get_task("done")
    with pytest.raises(TaskExpired):
        await store.get_task("dropped")
    with pytest.raises(EffectExpired):
        await store.get_effect(V2_EFFECT.effect_id)
    assert (await store.get_task("base")).state is TaskState.COMMITTED
    claimed = await store.claim_next("q", ClaimRequest("w", 10_000, 1))
    assert claimed is not None and claimed.task_id == "open"
    again, outcome = await store.put_task("done", "in-2", None)
    assert (outcome, again.revision, again.claim_generation) == (PutOutcome.CREATED, 2, 1)


async def test_a_version_2_sqlite_file_is_upgraded_and_its_settled_tasks_expire(
    tmp_path: Path,
) -> None:
    path = tmp_path / "v2.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for statement in sqlite_store._statements(sqlite_store._SCHEMA):
            conn.execute(statement)
        for name, sql_type in sql_steps.TASK_FLOW_COLUMNS:
            conn.execute(f"ALTER TABLE tasks ADD COLUMN {name} {sql_type}")
        for statement in sqlite_store._statements(sqlite_store._FLOW_SCHEMA):
            conn.execute(statement)
        conn.execute("INSERT INTO fencegate_schema (id, version) VALUES (1, 2)")
        for text, args in v2_rows():
            conn.execute(text, args)
        conn.commit()
    for first in (True, False):  # the second open finds version 4 and changes nothing
        store = SQLiteStore(str(path), POLICY, timeout_ms=STORE_TIMEOUT_MS)
        await store.open()
        try:
            if first:
                with contextlib.closing(sqlite3.connect(path)) as conn:
                    settled = dict(conn.execute("SELECT task_id, due_at FROM settled"))
                assert settled == {"done": 2_000, "dropped": 3_000, "base": 4_000}
                await exercise_upgraded_v2(store)
        finally:
            await store.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        (version,) = conn.execute("SELECT version FROM fencegate_schema").fetchone()
    assert version == sql_steps.SCHEMA_VERSION == 4


async def test_a_version_2_postgres_database_is_upgraded_and_its_settled_tasks_expire(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    url = postgres_test_url(postgres_server, request)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(";\n".join((*postgres_store._SCHEMA, *postgres_store._FLOW_SCHEMA)))
        await conn.execute("INSERT INTO fencegate_schema (id, version) VALUES (1, 2)")
        for text, args in v2_rows():
            await conn.execute(numbered(text), *args)
    finally:
        await conn.close()
    store = PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    try:
        conn = await asyncpg.connect(url)
        try:
            settled = dict(await conn.fetch("SELECT task_id, due_at FROM settled"))
            assert settled == {"done": 2_000, "dropped": 3_000, "base": 4_000}
            assert await conn.fetchval("SELECT version FROM fencegate_schema") == 4
        finally:
            await conn.close()
        await exercise_upgraded_v2(store)
    finally:
        await store.close()


# --- version 3 -> 4 (keyed effects) --------------------------------------------------------

#: The effect events as version 3 wrote them: ``taskId`` straight from the column.
V3_SQLITE_EFFECT_EVENT = """json_object('type', 'effect', 'effectId', NEW.effect_id,
    'taskId', NEW.task_id, 'state', NEW.state, 'downstream', NEW.downstream,
    'at', CAST(json_extract(NEW.fields, '$.updated_at') AS INTEGER))"""
V3_SQLITE_EFFECT_TRIGGERS = (
    "DROP TRIGGER effects_event_insert",
    "DROP TRIGGER effects_event_update",
    "CREATE TRIGGER effects_event_insert AFTER INSERT ON effects BEGIN "
    f"INSERT INTO events (body) VALUES ({V3_SQLITE_EFFECT_EVENT}); END",
    "CREATE TRIGGER effects_event_update AFTER UPDATE ON effects "
    "WHEN OLD.state IS NOT NEW.state BEGIN "
    f"INSERT INTO events (body) VALUES ({V3_SQLITE_EFFECT_EVENT}); END",
)
V3_POSTGRES_EFFECT_FUNCTION = """CREATE OR REPLACE FUNCTION fencegate_effect_event()
    RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' OR OLD.state IS DISTINCT FROM NEW.state THEN
            INSERT INTO events (body) VALUES (json_build_object('type', 'effect',
                'effectId', NEW.effect_id, 'taskId', NEW.task_id, 'state', NEW.state,
                'downstream', NEW.downstream,
                'at', (NEW.fields::jsonb ->> 'updated_at')::bigint)::text);
        END IF;
        RETURN NULL;
    END $$"""


async def exercise_upgraded_v3(store: Store) -> None:
    """The version-3 effect (leased) still reads and its events name its task; a keyed
    effect's name none, and it expires through the keyed index."""
    old = await store.get_effect(V2_EFFECT.effect_id)
    assert (old.kind, old.task_id) == ("leased", "done")
    _, start = await store.read_events(None, 10)
    request = effects.EffectRequest(
        None,
        "",
        "",
        "api",
        "POST",
        "/x",
        "d1",
        forward_id="f1",
        client_key=effects.ClientKey("agent", "k1"),
    )
    prepared = await store.prepare_effect(request, 10_000)
    assert prepared.action is effects.Action.FORWARD
    await store.complete_effect(
        None, prepared.effect.effect_id, 0, "f1", EffectState.COMMITTED, "test", None
    )
    events, _ = await store.read_events(start, 10)
    assert [(e.body["taskId"], e.body["state"]) for e in events] == [
        (None, "PREPARED"),
        (None, "COMMITTED"),
    ]
    report = await store.expire_settled(0, 600_000, 100)
    # The settled tasks as in version 3 ("done" with its effect, "dropped"), and the keyed one.
    assert (report.expired_tasks, report.expired_effects) == (2, 2)
    with pytest.raises(EffectExpired):
        await store.get_effect(prepared.effect.effect_id)


async def test_a_version_3_sqlite_file_is_upgraded_and_serves_keyed_effects(
    tmp_path: Path,
) -> None:
    path = tmp_path / "v3.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for statement in sqlite_store._statements(sqlite_store._SCHEMA):
            conn.execute(statement)
        for name, sql_type in sql_steps.TASK_FLOW_COLUMNS:
            conn.execute(f"ALTER TABLE tasks ADD COLUMN {name} {sql_type}")
        for statement in sqlite_store._statements(sqlite_store._FLOW_SCHEMA):
            conn.execute(statement)
        for statement in V3_SQLITE_EFFECT_TRIGGERS:
            conn.execute(statement)
        for statement in sql_steps.RETENTION_TABLES:
            conn.execute(statement)
        for statement in sqlite_store._statements(sqlite_store._RETENTION_SCHEMA):
            conn.execute(statement)
        conn.execute("INSERT INTO fencegate_schema (id, version) VALUES (1, 3)")
        for text, args in v2_rows():
            conn.execute(text, args)
        conn.commit()
    for first in (True, False):  # the second open finds version 4 and changes nothing
        store = SQLiteStore(str(path), POLICY, timeout_ms=STORE_TIMEOUT_MS)
        await store.open()
        try:
            migration = await store.migrate()
            assert (migration.found, migration.current) == ((3, 4) if first else (4, 4))
            if first:
                await exercise_upgraded_v3(store)
        finally:
            await store.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        (version,) = conn.execute("SELECT version FROM fencegate_schema").fetchone()
        assert conn.execute("SELECT COUNT(*) FROM keyed_settled").fetchone() == (0,)
    assert version == sql_steps.SCHEMA_VERSION == 4


async def test_a_version_3_postgres_database_is_upgraded_and_serves_keyed_effects(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    url = postgres_test_url(postgres_server, request)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            ";\n".join(
                (
                    *postgres_store._SCHEMA,
                    *postgres_store._FLOW_SCHEMA,
                    V3_POSTGRES_EFFECT_FUNCTION,
                    *postgres_store._RETENTION_SCHEMA,
                )
            )
        )
        await conn.execute("INSERT INTO fencegate_schema (id, version) VALUES (1, 3)")
        for text, args in v2_rows():
            await conn.execute(numbered(text), *args)
    finally:
        await conn.close()
    store = PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    try:
        migration = await store.migrate()
        assert (migration.found, migration.current) == (3, 4)
        await exercise_upgraded_v3(store)
        conn = await asyncpg.connect(url)
        try:
            assert await conn.fetchval("SELECT version FROM fencegate_schema") == 4
            assert await conn.fetchval("SELECT COUNT(*) FROM keyed_settled") == 0
        finally:
            await conn.close()
    finally:
        await store.close()
