"""A database written by schema version 1 (before task flow) opens, is upgraded in place to
version 2, and its tasks keep working: nothing a running deployment stored is stranded.

The version-1 tables are written here as that version created them (ledger/sql_steps.py
``SCHEMA_VERSION`` says what version 2 added).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import asyncpg
import pytest

from fencegate.ledger import sql_steps
from fencegate.ledger.postgres_store import PostgresStore
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy, TaskState
from tests.conftest import postgres_test_url
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


async def exercise_upgraded(store: Store) -> None:
    """The old task reads and claims as before; the new features work beside it."""
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
    for first in (True, False):  # the second open finds version 2 and changes nothing
        store = SQLiteStore(str(path), POLICY)
        await store.open()
        try:
            if first:
                await exercise_upgraded(store)
        finally:
            await store.close()
    with sqlite3.connect(path) as conn:
        (version,) = conn.execute("SELECT version FROM fencegate_schema").fetchone()
    assert version == sql_steps.SCHEMA_VERSION == 2


async def test_a_version_1_postgres_database_is_upgraded_in_place(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    url = postgres_test_url(postgres_server, request)
    conn = await asyncpg.connect(url)
    try:
        for statement in VERSION_1:
            await conn.execute(statement)
        await conn.execute(INSERT_OLD.replace("'{}'", "$1"), json.dumps(OLD_TASK))
    finally:
        await conn.close()
    store = PostgresStore(url, POLICY)
    await store.open()
    try:
        await exercise_upgraded(store)
    finally:
        await store.close()
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT version FROM fencegate_schema") == 2
    finally:
        await conn.close()
