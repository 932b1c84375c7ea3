"""Retention on the SQL stores (SQLite and PostgreSQL, schema version 3): what their tables hold.

The behaviour every store shares is ``tests/test_retention.py``; here the rows themselves are
read beside the store: the settled index the triggers keep, that an expired task leaves no row
naming it, the tombstone tables, the sizes ``store_stats`` reads, and what only PostgreSQL
has (sweepers and puts running at once, the hot path's statements). The upgrade of an older
database is ``tests/test_schema_upgrade.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest

from fencegate.ledger import effects, sql_steps
from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import EffectExpired, NoSuchTask, TaskExpired
from fencegate.ledger.postgres_store import PostgresStore
from fencegate.ledger.sql_store import SqlStore
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    PutOutcome,
    RenewRequest,
    Task,
    TaskState,
)
from tests.conftest import STORE_TIMEOUT_MS, postgres_test_url
from tests.postgres_server import PostgresServer

T = TypeVar("T")

POLICY = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)
SETTLED_MS = 60_000
TOMBSTONE_MS = 600_000
TTL = 10_000


@dataclass
class Sql:
    """A SQL store and a way to read its tables directly (``?`` placeholders on both)."""

    store: SqlStore
    url: str

    async def rows(self, text: str, *args: Any) -> list[tuple[Any, ...]]:
        if isinstance(self.store, SQLiteStore):
            with contextlib.closing(sqlite3.connect(self.store.path)) as conn:
                return [tuple(r) for r in conn.execute(text, args).fetchall()]
        conn = await asyncpg.connect(self.url)
        try:
            return [tuple(r) for r in await conn.fetch(numbered(text), *args)]
        finally:
            await conn.close()

    async def value(self, text: str, *args: Any) -> Any:
        found = await self.rows(text, *args)
        return found[0][0] if found else None

    async def naming(self, task_id: str) -> dict[str, int]:
        """How many rows of each table that can name a task name ``task_id``."""
        counts = {}
        for table, where in (
            ("tasks", "task_id = ?"),
            ("effects", "task_id = ?"),
            ("settled", "task_id = ?"),
            ("cascades", "task_id = ?"),
            ("dependents", "task_id = ? OR dependent_id = ?"),
        ):
            args = (task_id,) * where.count("?")
            counts[table] = int(
                await self.value(f"SELECT COUNT(*) FROM {table} WHERE {where}", *args)
            )
        return counts


def numbered(text: str) -> str:
    count = iter(range(1, 1000))
    return re.sub(r"\?", lambda _: f"${next(count)}", text)


@pytest.fixture(params=["sqlite", "postgres"])
async def sql(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Sql]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'fencegate.db'}"
        store: SqlStore = SQLiteStore(
            str(tmp_path / "fencegate.db"), POLICY, timeout_ms=STORE_TIMEOUT_MS
        )
    else:
        url = postgres_test_url(request.getfixturevalue("postgres_server"), request)
        store = PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    try:
        yield Sql(store, url)
    finally:
        await store.close()


def claim_as(owner: str) -> ClaimRequest:
    return ClaimRequest(owner=owner, ttl_ms=TTL, scheduler_epoch=1)


def commit_of(task: Task, result: str = "r") -> CommitRequest:
    assert task.attempt_id is not None
    return CommitRequest(
        task.attempt_id, task.claim_generation, 1, task.cancel_generation, task.input_digest, result
    )


def fence_of(task: Task) -> Fence:
    assert task.attempt_id is not None
    return Fence(task.task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)


def effect_request(task: Task, slot: str) -> EffectRequest:
    return EffectRequest(fence_of(task), "main", slot, "api", "POST", "/x", "d1")


async def committed(store: SqlStore, task_id: str, *, effect_slots: int = 0) -> Task:
    await store.put_task(task_id, f"in-{task_id}", None)
    task = await store.claim(task_id, claim_as("w"))
    assert task.attempt_id is not None
    for i in range(effect_slots):
        prepared = await store.prepare_effect(effect_request(task, f"s{i}"), 5_000)
        await store.complete_effect(
            task_id, prepared.effect.effect_id, 0, task.attempt_id, EffectState.COMMITTED, "", None
        )
    done, _ = await store.commit(task_id, commit_of(task))
    return done


async def test_the_triggers_keep_the_settled_index(sql: Sql) -> None:
    """An entry when a task settles (due from the updated_at it settled at), none while it is
    open, and a write that leaves it settled keeps the entry's due_at."""
    store = sql.store
    due = "SELECT due_at FROM settled WHERE task_id = ?"
    await store.put_task("a", "in-1", None)
    claimed = await store.claim("a", claim_as("w"))
    assert await sql.value(due, "a") is None
    done, _ = await store.commit("a", commit_of(claimed))
    assert await sql.value(due, "a") == done.updated_at
    store.clock_offset_ms += 1_000
    _, replay = await store.commit("a", commit_of(claimed))
    assert replay and await sql.value(due, "a") == done.updated_at
    await store.put_task("a", "in-2", None)  # a new revision opens it again
    assert await sql.value(due, "a") is None

    await store.put_task("b", "in", None)
    cancelled = await store.cancel("b")
    assert await sql.value(due, "b") == cancelled.updated_at
    store.clock_offset_ms += 1_000
    await store.cancel("b")  # cancelling a cancelled task changes nothing
    assert await sql.value(due, "b") == cancelled.updated_at

    # A cascade settles the dependents in the same step.
    await store.put_task("root", "in", None)
    await store.put_task("leaf", "in", None, depends_on=("root",))
    await store.cancel("root")
    leaf = await store.get_task("leaf")
    assert leaf.state is TaskState.CANCELLED
    assert await sql.value(due, "leaf") == leaf.updated_at
    assert {r[0] for r in await sql.rows("SELECT task_id FROM settled")} == {"b", "root", "leaf"}


async def test_an_expired_task_leaves_no_row_naming_it_only_its_tombstones(sql: Sql) -> None:
    store = sql.store
    base = await committed(store, "base")
    await store.put_task("mid", "in-mid", None, depends_on=("base",))
    mid = await store.claim("mid", claim_as("w"))
    assert mid.attempt_id is not None
    ids = []
    for slot in ("s0", "s1"):
        prepared = await store.prepare_effect(effect_request(mid, slot), 5_000)
        outcome = EffectState.COMMITTED if slot == "s0" else EffectState.NOT_APPLIED
        await store.complete_effect(
            "mid", prepared.effect.effect_id, 0, mid.attempt_id, outcome, "", None
        )
        ids.append(prepared.effect.effect_id)
    mid, _ = await store.commit("mid", commit_of(mid))
    # A cascade record left behind for it must go too (one the sweep finds stale).
    await sql.rows("INSERT INTO cascades (task_id) VALUES (?)", "mid")
    events = await sql.value("SELECT COUNT(*) FROM events")
    assert (await sql.naming("mid"))["dependents"] == 1

    store.clock_offset_ms += SETTLED_MS
    now = await store.now_ms()
    report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 10)
    # base is older, so looked at first: mid still existed, so base is kept (moved back).
    assert (report.examined, report.expired_tasks, report.expired_effects) == (2, 1, 2)
    assert report.kept == {"dependents": 1}
    assert await sql.naming("mid") == {
        "tasks": 0,
        "effects": 0,
        "settled": 0,
        "cascades": 0,
        "dependents": 0,
    }
    due_base = await sql.value("SELECT due_at FROM settled WHERE task_id = ?", "base")
    assert due_base >= now > base.updated_at
    assert await sql.value("SELECT COUNT(*) FROM events") == events  # the feed keeps them

    stone = await sql.rows(
        "SELECT revision, claim_generation, cancel_generation, input_digest, state, "
        "expired_at, forget_at, effects FROM task_tombstones WHERE task_id = ?",
        "mid",
    )
    assert len(stone) == 1
    revision, generation, cancels, digest, state, expired_at, forget_at, count = stone[0]
    assert (revision, generation, cancels, digest, state, count) == (
        1,
        mid.claim_generation,
        0,
        "in-mid",
        "COMMITTED",
        2,
    )
    assert forget_at - expired_at == TOMBSTONE_MS and expired_at >= now
    effect_stones = await sql.rows(
        "SELECT effect_id, task_id, state, forget_at FROM effect_tombstones ORDER BY effect_id"
    )
    assert effect_stones == sorted(
        [
            (ids[0], "mid", "COMMITTED", forget_at),
            (ids[1], "mid", "NOT_APPLIED", forget_at),
        ]
    )
    # Every step naming them refuses with the expired codes, from the tombstones.
    with pytest.raises(TaskExpired):
        await store.check_fence(fence_of(mid))
    with pytest.raises(TaskExpired):
        await store.prepare_effect(effect_request(mid, "s9"), 5_000)
    with pytest.raises(TaskExpired):
        await store.renew("mid", RenewRequest(Identity(mid.attempt_id or "", 1, "w", 1, 0), TTL))
    with pytest.raises(TaskExpired):
        await store.release("mid", Identity(mid.attempt_id or "", 1, "w", 1, 0))
    with pytest.raises(TaskExpired):
        await store.commit("mid", commit_of(mid))
    with pytest.raises(TaskExpired):
        await store.cancel("mid")
    with pytest.raises(EffectExpired):
        await store.complete_effect(
            "mid", ids[0], 0, mid.attempt_id or "", EffectState.COMMITTED, "", None
        )
    with pytest.raises(EffectExpired) as refused:
        await store.update_effect(
            ids[1],
            lambda record, now: effects.resolve(
                record, EffectState.COMMITTED, "late", "op", None, now
            ),
        )
    assert refused.value.extra["effectState"] == "NOT_APPLIED"
    # A refusal with nothing to refine stays what it was.
    with pytest.raises(NoSuchTask) as missing:
        await store.get_task("never-was")
    assert not isinstance(missing.value, TaskExpired)


async def test_tombstones_are_forgotten_a_bounded_batch_at_a_time(sql: Sql) -> None:
    store = sql.store
    for i in range(3):
        await store.put_task(f"c{i}", "in", None)
        await store.cancel(f"c{i}")
    await committed(store, "e", effect_slots=1)
    report = await store.expire_settled(0, TOMBSTONE_MS, 10)
    assert (report.expired_tasks, report.expired_effects, report.forgotten) == (4, 1, 0)
    store.clock_offset_ms += TOMBSTONE_MS
    # Past forget_at a tombstone counts as absent before any sweep removed it: the id is new.
    fresh, outcome = await store.put_task("c0", "in", None)
    assert (outcome, fresh.revision) == (PutOutcome.CREATED, 1)
    assert await sql.value("SELECT COUNT(*) FROM task_tombstones WHERE task_id = 'c0'") == 0
    assert (await store.store_stats(0)).task_tombstones == 0
    # At most `limit` task tombstones and `limit` effect tombstones per step.
    first = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 2)
    assert first.forgotten == 2 + 1
    second = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 2)
    assert second.forgotten == 1
    assert not (await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 2)).busy
    assert await sql.value("SELECT COUNT(*) FROM task_tombstones") == 0
    assert await sql.value("SELECT COUNT(*) FROM effect_tombstones") == 0


async def test_a_put_over_a_tombstone_continues_it_and_removes_it(sql: Sql) -> None:
    store = sql.store
    done = await committed(store, "t")
    await store.expire_settled(0, TOMBSTONE_MS, 10)
    with pytest.raises(TaskExpired):
        await store.put_task("t", "in-t", None)
    assert await sql.value("SELECT COUNT(*) FROM task_tombstones") == 1  # refused: unchanged
    again, outcome = await store.put_task("t", "in-t2", None, queue="q")
    assert outcome is PutOutcome.CREATED
    assert (again.revision, again.claim_generation) == (2, done.claim_generation)
    assert await sql.value("SELECT COUNT(*) FROM task_tombstones") == 0
    assert await sql.value("SELECT COUNT(*) FROM settled") == 0
    claimed = await store.claim_next("q", claim_as("w"))
    assert claimed is not None and claimed.claim_generation == done.claim_generation + 1


async def test_store_stats_reads_the_store_size(sql: Sql) -> None:
    store = sql.store
    await committed(store, "a", effect_slots=1)
    stats = await store.store_stats(SETTLED_MS)
    assert stats.bytes is not None and stats.bytes > 0
    if isinstance(store, SQLiteStore):
        pages = await sql.value("PRAGMA page_count")
        free = await sql.value("PRAGMA freelist_count")
        size = await sql.value("PRAGMA page_size")
        assert stats.bytes == (pages - free) * size
        assert stats.bytes_detail == {}
    else:
        assert set(stats.bytes_detail) == set(sql_steps.STORE_TABLES)
        assert stats.bytes == sum(stats.bytes_detail.values())
        assert all(size > 0 for size in stats.bytes_detail.values())


# --- PostgreSQL only ----------------------------------------------------------------------


class CountingStore(PostgresStore):
    """Records every statement (and every read of the clock) each step sends."""

    statements: list[str]

    async def _drive(self, conn: Any, step: sql_steps.Step[T]) -> T:
        return await super()._drive(conn, self._counted(step))

    def _counted(self, step: sql_steps.Step[T]) -> Generator[sql_steps.Sql, Any, T]:
        reply: Any = None
        try:
            while True:
                sql = step.send(reply)
                self.statements.append(sql.text or "NOW")
                reply = yield sql
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def test_postgres_hot_path_sends_no_statement_more(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    """Claim, renew, prepare, complete and commit send what they sent before retention (the
    triggers keep the settled index inside the UPDATE that settles a task): one round trip
    per statement, the BEGIN riding on the first and the COMMIT after."""
    url = postgres_test_url(postgres_server, request)
    store = CountingStore(url, POLICY)
    store.statements = []
    await store.open()
    try:
        await store.put_task("t", "in", None)
        counts: dict[str, int] = {}

        async def counted(name: str, call: Any) -> Any:
            store.statements.clear()
            result = await call
            counts[name] = len(store.statements)
            assert not any(
                word in text for text in store.statements for word in ("settled", "tombstone")
            ), store.statements
            return result

        task = await counted("claim", store.claim("t", claim_as("w")))
        assert task.attempt_id is not None
        identity = Identity(task.attempt_id, task.claim_generation, "w", 1, 0)
        await counted("renew", store.renew("t", RenewRequest(identity, TTL)))
        prepared = await counted("prepare", store.prepare_effect(effect_request(task, "s"), 5_000))
        assert prepared.action is Action.FORWARD
        await counted(
            "complete",
            store.complete_effect(
                "t", prepared.effect.effect_id, 0, task.attempt_id, EffectState.COMMITTED, "", None
            ),
        )
        done, _ = await counted("commit", store.commit("t", commit_of(task)))
        assert counts == {"claim": 5, "renew": 5, "prepare": 6, "complete": 3, "commit": 6}
        conn = await asyncpg.connect(url)
        try:
            due = await conn.fetchval("SELECT due_at FROM settled WHERE task_id = 't'")
        finally:
            await conn.close()
        assert due == done.updated_at
    finally:
        await store.close()


async def cancelled_tasks(store: SqlStore, n: int) -> list[str]:
    ids = [f"t{i:03d}" for i in range(n)]
    for task_id in ids:
        await store.put_task(task_id, "in-1", None)
        await store.cancel(task_id)
    return ids


async def test_postgres_a_sweep_skips_what_another_step_holds(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    """Entries another sweeper holds, and settled tasks a step holds, are passed over at
    once (``FOR UPDATE SKIP LOCKED``): a sweep never waits (waiting would run into the
    store's lock_timeout and fail), and takes the next ones instead."""
    url = postgres_test_url(postgres_server, request)
    store = PostgresStore(url, POLICY, timeout_ms=1_000)
    await store.open()
    other = await asyncpg.connect(url)
    try:
        ids = await cancelled_tasks(store, 12)
        async with other.transaction():
            # Another sweeper in the middle of its step holds the five oldest entries...
            await other.execute(
                "SELECT task_id FROM settled ORDER BY due_at, task_id LIMIT 5 FOR UPDATE"
            )
            # ...and a step holds a settled task (a put of its next revision, say).
            await other.execute(f"SELECT 1 FROM tasks WHERE task_id = '{ids[-1]}' FOR UPDATE")
            report = await store.expire_settled(0, TOMBSTONE_MS, 100)
            assert (report.examined, report.expired_tasks) == (6, 6)
            gone = await store.expire_settled(0, TOMBSTONE_MS, 100)
            assert gone.examined == 0
        report = await store.expire_settled(0, TOMBSTONE_MS, 100)
        assert (report.examined, report.expired_tasks) == (6, 6)
        for task_id in ids:
            with pytest.raises(TaskExpired):
                await store.get_task(task_id)
    finally:
        await other.close()
        await store.close()


async def test_postgres_sweepers_and_puts_at_once_lose_and_repeat_nothing(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    """Two gateways sweep while a third puts a new input for every settled task: each task is
    expired at most once, and each put finds either the task (a new revision) or its
    tombstone (created again): revision 2 either way, never 1."""
    url = postgres_test_url(postgres_server, request)
    stores = [PostgresStore(url, POLICY, timeout_ms=5_000) for _ in range(3)]
    for store in stores:
        await store.open()
    try:
        ids = await cancelled_tasks(stores[0], 40)

        async def sweeper(store: PostgresStore) -> int:
            expired = 0
            for _ in range(200):
                report = await store.expire_settled(0, TOMBSTONE_MS, 7)
                expired += report.expired_tasks
                if not report.examined:
                    return expired
            raise AssertionError("the sweep never ran dry")

        async def putter() -> list[tuple[Task, PutOutcome]]:
            out = []
            for task_id in reversed(ids):  # the newest first: the sweepers start at the oldest
                out.append(await stores[2].put_task(task_id, "in-2", None))
                await asyncio.sleep(0)
            return out

        first, second, puts = await asyncio.gather(sweeper(stores[0]), sweeper(stores[1]), putter())
        created = sum(outcome is PutOutcome.CREATED for _, outcome in puts)
        assert first + second == created
        assert all(task.revision == 2 for task, _ in puts)
        assert all(task.cancel_generation == 1 for task, _ in puts)
        stats = await stores[0].store_stats(0)
        assert (stats.tasks, stats.settled_tasks, stats.task_tombstones) == (40, 0, 0)
    finally:
        for store in stores:
            await store.close()
