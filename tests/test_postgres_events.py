"""The PostgreSQL change feed and the transactions of the rest of the server (issue 26).

Events are read only below a horizon: no transaction that may still write one runs below it
(``ledger.postgres_store._EVENTS_HORIZON``). A transaction id is cluster-wide, so a horizon
taken from the snapshot's xmin alone was held back by any transaction holding an id anywhere
on the server: another application's database, or, in the suite, another test's database on
the worker's shared session server. A gateway's streams and long-polls then stalled until it
ended. Only transactions of the store's own database hold the feed back now.

A neighbour here is a session that holds a transaction id (``pg_current_xact_id()`` assigns
one) and does not end its transaction until the test says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest

from fencegate.gateway.config import EventsConfig, TasksConfig
from fencegate.gateway.events import EventHub
from fencegate.ledger.errors import EventsGone
from fencegate.ledger.postgres_store import PostgresStore
from fencegate.ledger.tasks import LeasePolicy
from tests.api import until
from tests.conftest import STORE_TIMEOUT_MS, postgres_test_url
from tests.postgres_server import PostgresServer

POLICY = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)


@contextlib.asynccontextmanager
async def holding_a_transaction(url: str) -> AsyncIterator[asyncpg.Connection]:
    """A session of ``url`` in a transaction that holds an id, rolled back on exit."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("BEGIN")
        await conn.fetchval("SELECT pg_current_xact_id()")
        yield conn
        await conn.execute("ROLLBACK")
    finally:
        await conn.close()


@pytest.fixture
async def store(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> AsyncIterator[PostgresStore]:
    the_store = PostgresStore(
        postgres_test_url(postgres_server, request), POLICY, timeout_ms=STORE_TIMEOUT_MS
    )
    await the_store.open()
    yield the_store
    await the_store.close()


async def test_a_transaction_of_another_database_holds_no_event_back(
    store: PostgresStore, postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    neighbour = postgres_test_url(postgres_server, request)
    async with holding_a_transaction(neighbour):
        _, start = await store.read_events(None, 1)
        await store.put_task("a", "in-1", None, queue="q")
        events, _ = await store.read_events(start, 10)
        assert [(e.body["taskId"], e.body["state"]) for e in events] == [("a", "READY")]


async def test_a_long_poll_is_woken_while_another_database_holds_a_transaction(
    store: PostgresStore, postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    """The flake of issue 26 (``test_a_long_poll_whose_client_left_claims_nothing[postgres]``
    waited 10 s for an event): the hub's wake-up, with a neighbour that holds a transaction
    for longer than the wait."""
    hub = EventHub(store, EventsConfig(poll_ms=20), TasksConfig())
    async with holding_a_transaction(postgres_test_url(postgres_server, request)):
        try:
            with hub.waiting(principal=None, queue="q") as waiter:
                await until(lambda: hub._cursor is not None, "the hub read where the feed ends")
                await store.put_task("a", "in-1", None, queue="q")
                await until(lambda: waiter.woken, "the task's event woke the long-poll")
        finally:
            await hub.close()


async def test_a_transaction_of_the_same_database_holds_events_back_until_it_ends(
    store: PostgresStore,
) -> None:
    """What stays (docs/stores.md): a session of the store's own database that holds a
    transaction id may still write an event below any later one, so the feed waits for it;
    nothing is skipped once it ends."""
    _, start = await store.read_events(None, 1)
    async with holding_a_transaction(store.url):
        await store.put_task("a", "in-1", None)
        assert (await store.read_events(start, 10))[0] == []
    events, _ = await store.read_events(start, 10)
    assert [e.body["taskId"] for e in events] == ["a"]


async def test_the_newest_position_is_bounded_by_the_transaction_id_counter(
    store: PostgresStore,
) -> None:
    """A position ahead of the newest the store issued is 410 (the store lost events: a
    restore of an older copy, a failover that lost commits). On PostgreSQL the bound is the
    transaction id counter (the snapshot's xmax), not the horizon: an end handed out while a
    transaction of the store's own database held the horizon back stays good, and so does the
    end after it; an xid no transaction has had yet is 410."""
    async with holding_a_transaction(store.url):
        await store.put_task("a", "in-1", None)
        _, held_back = await store.read_events(None, 1)
        assert await store.read_events(held_back, 10) == ([], held_back)
    events, at_a = await store.read_events(held_back, 10)
    assert [e.body["taskId"] for e in events] == ["a"]
    assert await store.read_events(at_a, 10) == ([], at_a)
    _, newest = await store.read_events(None, 1)
    assert await store.read_events(newest, 10) == ([], newest)
    conn = await asyncpg.connect(store.url)
    try:
        xmax = int(await conn.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text"))
    finally:
        await conn.close()
    for ahead in (f"{xmax + 1000}-0", f"{xmax + 1000}-{2**62}"):
        with pytest.raises(EventsGone, match="ahead of the newest event this store has issued"):
            await store.read_events(ahead, 10)
