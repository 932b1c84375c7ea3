"""What only the PostgreSQL store has: its URL rules, its durability report, its schema version,
and the races its row locks and retries settle (the contract itself runs on every store
through the ``store_url`` fixtures).
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest

from fencegate.gateway.config import ConfigError, load_config
from fencegate.ledger import sql_steps
from fencegate.ledger.errors import StoreIncompatible, StoreUnavailable
from fencegate.ledger.postgres_store import PostgresStore, durability_warnings
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy, PutOutcome
from tests.conftest import STORE_TIMEOUT_MS, postgres_test_url
from tests.postgres_server import PostgresServer

POLICY = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)


def _config_file(tmp_path: Path, store: str) -> Path:
    path = tmp_path / "fencegate.toml"
    path.write_text(f"[store]\n{store}\n")
    return path


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cret@db:5432/fencegate",
        "postgresql://app@db:5432/fencegate?password=s3cret",
        "postgres://app:s3cret@db1:5432,db2:5432/fencegate",
    ],
)
def test_a_password_in_the_url_is_refused_naming_the_key(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(_config_file(tmp_path, f'url = "{url}"'))
    message = str(refused.value)
    assert "store.url" in message and "password_env" in message
    assert "s3cret" not in message


def test_a_multi_host_url_with_its_password_from_the_environment_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FG_PG_PASSWORD", "s3cret")
    url = "postgresql://app@db1:5432,db2:5432/fencegate?target_session_attrs=read-write"
    config = load_config(_config_file(tmp_path, f'url = "{url}"\npassword_env = "FG_PG_PASSWORD"'))
    assert config.store.url == url and config.store.password() == "s3cret"


@pytest.mark.parametrize(
    ("settings", "standbys", "expected"),
    [
        ({"fsync": "on", "synchronous_commit": "on", "synchronous_standby_names": ""}, 0, []),
        (
            {"fsync": "on", "synchronous_commit": "on", "synchronous_standby_names": "s1"},
            1,
            [],
        ),
        ({"fsync": "off", "synchronous_commit": "on"}, 0, ["fsync is off"]),
        ({"fsync": "on", "synchronous_commit": "off"}, 0, ["synchronous_commit=off"]),
        (
            {"fsync": "on", "synchronous_commit": "local", "synchronous_standby_names": "s1"},
            1,
            ["synchronous_commit=local"],
        ),
        (
            {"fsync": "on", "synchronous_commit": "on", "synchronous_standby_names": ""},
            2,
            ["standbys replicate asynchronously"],
        ),
    ],
)
def test_durability_warnings_name_what_a_failover_or_crash_could_lose(
    settings: dict[str, str], standbys: int, expected: list[str]
) -> None:
    warnings = durability_warnings(settings, standbys)
    assert len(warnings) == len(expected), warnings
    for warning, start in zip(warnings, expected, strict=True):
        assert warning.startswith(start), warning


async def test_readyz_reports_a_server_that_could_lose_answered_steps(
    make_postgres_server: Callable[..., PostgresServer],
) -> None:
    server = make_postgres_server({"synchronous_commit": "off"})
    store = PostgresStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    try:
        assert [w.split(":")[0] for w in await store.durability()] == ["synchronous_commit=off"]
    finally:
        await store.close()


async def _open_then_close(store: Store) -> None:
    await store.open()
    await store.close()


async def test_a_newer_schema_refuses_to_start_on_postgres(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    url = postgres_test_url(postgres_server, request)
    await _open_then_close(
        PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    )  # creates the schema
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE fencegate_schema SET version = $1", sql_steps.SCHEMA_VERSION + 1)
    finally:
        await conn.close()
    newer = sql_steps.SCHEMA_VERSION + 1
    expected = f"schema version {newer}, newer than this gateway's {sql_steps.SCHEMA_VERSION}"
    with pytest.raises(StoreIncompatible, match=expected):
        await _open_then_close(PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS))


async def test_a_newer_schema_refuses_to_start_on_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "fencegate.db"
    await _open_then_close(SQLiteStore(str(path), POLICY, timeout_ms=STORE_TIMEOUT_MS))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE fencegate_schema SET version = ?", (sql_steps.SCHEMA_VERSION + 1,))
    with pytest.raises(StoreIncompatible, match=f"schema version {sql_steps.SCHEMA_VERSION + 1}"):
        await _open_then_close(SQLiteStore(str(path), POLICY, timeout_ms=STORE_TIMEOUT_MS))


def test_a_gateway_on_a_newer_schema_exits_with_the_reason(
    postgres_server: PostgresServer, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Unlike an unreachable store (the gateway starts and waits, /readyz says why), a newer
    schema will not fix itself: ``serve`` exits 1 and says which version to run."""
    url = postgres_test_url(postgres_server, request)
    asyncio.run(_open_then_close(PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS)))
    postgres_server.psql("UPDATE fencegate_schema SET version = 99", url.rsplit("/", 1)[1])
    config = _config_file(tmp_path, f'url = "{url}"')
    done = subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--config", str(config),
         "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"schema version 99, newer than this gateway's {sql_steps.SCHEMA_VERSION}" in done.stderr
    assert "Traceback" not in done.stderr


async def test_gateways_starting_together_create_the_schema_once(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    url = postgres_test_url(postgres_server, request)
    stores = [PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS) for _ in range(6)]
    await asyncio.gather(*(store.open() for store in stores))
    try:
        await asyncio.gather(*(store.ping() for store in stores))
        assert (await stores[0].get_scheduler()).epoch == 1
    finally:
        await asyncio.gather(*(store.close() for store in stores))


async def test_concurrent_creates_of_one_task_make_one_task(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    """Two steps that both find no row cannot both create it: the second INSERT fails on the
    key and its step runs again, now seeing (and locking) the row."""
    url = postgres_test_url(postgres_server, request)
    stores = [
        PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS) for _ in range(4)
    ]  # separate pools: real races
    await asyncio.gather(*(store.open() for store in stores))
    try:
        for round_ in range(5):
            task_id = f"t-{round_}"
            answers = await asyncio.gather(
                *(stores[i % len(stores)].put_task(task_id, f"in-{i}", None) for i in range(12))
            )
            outcomes = Counter(outcome for _, outcome in answers)
            assert outcomes[PutOutcome.CREATED] == 1, outcomes
            task = await stores[0].get_task(task_id)
            # Every REVISED answer opened one revision after the creation.
            assert task.revision == 1 + outcomes[PutOutcome.REVISED]
    finally:
        await asyncio.gather(*(store.close() for store in stores))


async def test_an_epoch_bump_answers_only_after_the_claims_that_read_the_old_epoch(
    postgres_server: PostgresServer, request: pytest.FixtureRequest
) -> None:
    """Claims read the epoch under a shared lock that a bump takes exclusively. Here a claim
    has read epoch 1 and waits for its task's row (held by another session): the bump must
    wait for it, or it would answer epoch 2 while a lease of epoch 1 is still to be granted."""
    url = postgres_test_url(postgres_server, request)
    claimer, bumper = (
        PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS),
        PostgresStore(url, POLICY, timeout_ms=STORE_TIMEOUT_MS),
    )
    await asyncio.gather(claimer.open(), bumper.open())
    blocker = await asyncpg.connect(url)
    try:
        await claimer.put_task("x", "in", None)
        held = blocker.transaction()
        await held.start()
        await blocker.execute("SELECT 1 FROM tasks WHERE task_id = 'x' FOR UPDATE")
        claim = asyncio.create_task(
            claimer.claim("x", ClaimRequest(owner="w", ttl_ms=30_000, scheduler_epoch=1))
        )
        # The claim has read epoch 1 and waits for the row: seen in PostgreSQL, not guessed.
        async with asyncio.timeout(30):
            while not await blocker.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ):
                await asyncio.sleep(0.01)
        bump = asyncio.create_task(bumper.bump_epoch())
        await asyncio.sleep(0.3)
        assert not bump.done(), "the bump answered while a claim of the old epoch was pending"
        await held.rollback()
        granted = await claim
        assert (granted.claim_epoch, granted.claim_generation) == (1, 1)
        assert (await bump).epoch == 2
    finally:
        await blocker.close()
        await asyncio.gather(claimer.close(), bumper.close())


async def test_an_unanswering_database_is_503_within_the_timeout(
    make_postgres_server: Callable[..., PostgresServer],
) -> None:
    server = make_postgres_server()
    store = PostgresStore(server.url, POLICY, timeout_ms=300)
    await store.open()
    try:
        await store.put_task("t", "in", None)
        server.pause()
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(StoreUnavailable) as refused:
                await store.put_task("t", "in-2", None)
            assert asyncio.get_running_loop().time() - started < 3
            assert re.search("did not answer", refused.value.detail or "")
        finally:
            server.resume()
        # Back: the step either happened or not, and the store answers again.
        task, _ = await store.put_task("t", "in-2", None)
        assert task.input_digest == "in-2"
    finally:
        await store.close()
