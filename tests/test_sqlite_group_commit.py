"""Group commit on the embedded store: steps issued together share one transaction and one
fsync, each in its own SAVEPOINT, and each caller is answered only after the COMMIT that holds
its step.

How many transactions were committed is read from the database's own write-ahead log (every
commit ends with a frame that carries the database size; `sqlite.org/fileformat.html`), so
the tests count fsyncs without asking the store. Nothing is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import struct
import time
from pathlib import Path
from typing import Any

import aiohttp

from fencegate.ledger.clock import AHEAD_MS
from fencegate.ledger.effects import Fence
from fencegate.ledger.errors import FencegateError
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy, Task
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import Gateways
from tests.test_store_clock import HOUR_MS, FakeHost

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
TTL_MS = 600_000
#: Steps sent at once: enough that one transaction per step is unmistakable.
BURST = 40


def wal_commits(db: Path) -> tuple[int, int]:
    """(salt of the log's current generation, commit frames in it)."""
    raw = (db.parent / (db.name + "-wal")).read_bytes()
    if len(raw) < 32:
        return 0, 0
    page_size = struct.unpack(">I", raw[8:12])[0]
    salts = raw[16:24]
    commits = 0
    offset = 32
    while offset + 24 + page_size <= len(raw):
        header = raw[offset : offset + 24]
        if header[8:16] != salts:  # a frame left over from an earlier generation
            break
        if struct.unpack(">I", header[4:8])[0] != 0:
            commits += 1
        offset += 24 + page_size
    return struct.unpack(">I", salts[:4])[0], commits


def claim(owner: str) -> ClaimRequest:
    return ClaimRequest(owner=owner, ttl_ms=TTL_MS, scheduler_epoch=1)


async def test_concurrent_steps_share_commits_and_each_keeps_its_own_instant(
    tmp_path: Path,
) -> None:
    """BURST claims at once take fewer than BURST commits; every answer is durable (a store
    reopened after a "kill -9", i.e. no close, and a reboot with the wall clock an hour behind
    holds every claim), and store time never runs back before any instant a step answered,
    although the clock's new ceiling was written by a step inside the batch."""
    host = FakeHost()
    db = tmp_path / "batch.db"
    store = SQLiteStore(str(db), POLICY, clock_sources=host.sources(), timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    ids = [f"t{n}" for n in range(BURST)]
    for task_id in ids:
        await store.put_task(task_id, "in", None)
    host.run(AHEAD_MS)  # past the ceiling's headroom: the batch must persist a new one
    salt, before = wal_commits(db)

    commits, steps = store.commits, store.committed_steps
    claims = await asyncio.gather(*(store.claim(task_id, claim(task_id)) for task_id in ids))
    # The store's own count, and the log's (below), must both show shared commits.
    assert store.committed_steps - steps == BURST
    assert 1 <= store.commits - commits < BURST, f"{store.commits - commits} COMMITs"

    salt_after, after = wal_commits(db)
    assert salt_after == salt, "the log restarted: the count would mean nothing"
    assert 1 <= after - before < BURST, f"{after - before} commits for {BURST} claims"
    latest = max(task.lease_expires_at or 0 for task in claims) - TTL_MS
    rebooted = FakeHost(wall=host.wall - HOUR_MS, boot=10, boot_id="boot-2")
    again = SQLiteStore(
        str(db), POLICY, clock_sources=rebooted.sources(), timeout_ms=STORE_TIMEOUT_MS
    )
    await again.open()
    try:
        assert await again.now_ms() >= latest
        for task in claims:
            stored = await again.get_task(task.task_id)
            assert stored.attempt_id == task.attempt_id and stored.claim_generation == 1
            assert stored.lease_expires_at == task.lease_expires_at
    finally:
        await again.close()
        await store.close()


async def test_a_step_that_fails_inside_a_batch_undoes_only_its_own_writes(
    tmp_path: Path,
) -> None:
    """Refusals and a step that writes and then fails share batches with good steps: each
    caller gets its own answer, the failed step's write is gone, the others' are kept."""
    db = tmp_path / "mixed.db"
    store = SQLiteStore(str(db), POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    ids = [f"ok{n}" for n in range(BURST)]
    for task_id in [*ids, "held"]:
        await store.put_task(task_id, "in", None)
    await store.claim("held", claim("holder"))

    def write_then_fail(conn: sqlite3.Connection, now: int) -> None:
        # What a driver error halfway through a step looks like: a row written, then a raise.
        conn.execute(
            "INSERT INTO tasks (task_id, state, lease_expires_at, fields) "
            "VALUES ('phantom', 'READY', NULL, '{}')"
        )
        raise ValueError("failed halfway")

    salt, before = wal_commits(db)
    calls: list[Any] = []
    for n, task_id in enumerate(ids):
        calls.append(store.claim(task_id, claim(f"w{n}")))
        if n % 8 == 0:
            calls.append(store.claim("held", claim("intruder")))
            calls.append(store.check_fence(Fence("ghost", "a", 1, 1, 0)))
            calls.append(store._run(write_then_fail, "test"))
    answers = await asyncio.gather(*calls, return_exceptions=True)

    salt_after, after = wal_commits(db)
    assert salt_after == salt
    granted = [a for a in answers if isinstance(a, Task)]
    assert sorted(task.task_id for task in granted) == sorted(ids)
    refused = [a for a in answers if isinstance(a, FencegateError)]
    assert len(refused) == 10
    assert sorted(a.code for a in refused) == ["CLAIMED"] * 5 + ["NO_SUCH_TASK"] * 5
    failed = [a for a in answers if isinstance(a, ValueError)]
    assert len(failed) == 5 and all(str(a) == "failed halfway" for a in failed)
    assert after - before < len(calls), "the steps did not share transactions"
    # What a fresh connection sees: every granted claim, no phantom row.
    reader = sqlite3.connect(db)
    try:
        rows = dict(reader.execute("SELECT task_id, state FROM tasks").fetchall())
    finally:
        reader.close()
    assert "phantom" not in rows
    assert all(rows[task_id] == "CLAIMED" for task_id in ids)
    held = await store.get_task("held")
    assert held.owner == "holder" and held.claim_generation == 1
    await store.close()


async def test_kill_9_mid_batch_loses_no_answered_step(gateways: Gateways, tmp_path: Path) -> None:
    """16 lanes create and claim tasks through a real gateway process, which is SIGKILLed
    while they run (so while batches are open or committing). Every PUT and claim that was
    answered is there after a restart, and the answered writes took fewer commits than there
    were writes (a reader holds the log's generation so all of them can be counted)."""
    db = tmp_path / "killed.db"
    gateway = gateways.start("gw", f"sqlite:///{db}", timeout_ms=2000)
    timeout = aiohttp.ClientTimeout(total=20)
    answered: list[dict[str, Any]] = []
    writes = 0

    async def lane(session: aiohttp.ClientSession, lane: int) -> None:
        nonlocal writes
        for n in range(10_000):
            task_id = f"k{lane}-{n}"
            try:
                async with session.put(f"/v1/tasks/{task_id}", json={"inputDigest": "in"}) as put:
                    if put.status != 201:
                        return
                writes += 1
                async with session.post(
                    f"/v1/tasks/{task_id}/claim",
                    json={"owner": f"w{lane}", "ttlMs": 60_000, "schedulerEpoch": 1},
                ) as claimed:
                    if claimed.status != 200:
                        return
                    answered.append(await claimed.json())
                writes += 1
            except (aiohttp.ClientError, TimeoutError):
                return  # the gateway died under this request

    async with aiohttp.ClientSession(base_url=gateway.url, timeout=timeout) as session:
        async with session.put("/v1/tasks/first", json={"inputDigest": "in"}) as first:
            assert first.status == 201
        # A read transaction from here on keeps the log from restarting (the writer may not
        # reuse it while a reader needs its frames), so every commit stays countable.
        reader = sqlite3.connect(db, isolation_level=None)
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM tasks").fetchone()
        salt, before = wal_commits(db)
        lanes = [asyncio.create_task(lane(session, n)) for n in range(16)]
        deadline = time.monotonic() + 30
        while writes < 300:
            assert time.monotonic() < deadline, f"only {writes} writes answered"
            assert not all(each.done() for each in lanes), "every lane stopped early"
            await asyncio.sleep(0.005)
        gateway.kill()
        await asyncio.wait_for(asyncio.gather(*lanes), timeout=30)

    salt_after, after = wal_commits(db)
    with contextlib.suppress(sqlite3.Error):
        reader.execute("ROLLBACK")
    reader.close()
    assert salt_after == salt
    assert after - before < writes, f"{after - before} commits for {writes} answered writes"

    gateway.start()
    async with aiohttp.ClientSession(base_url=gateway.url, timeout=timeout) as session:
        for body in answered:
            async with session.get(f"/v1/tasks/{body['taskId']}") as got:
                record = await got.json()
            assert record["state"] == "CLAIMED", record
            assert record["attemptId"] == body["attemptId"]
            assert record["claimGeneration"] == body["claimGeneration"] == 1
            assert record["leaseExpiresAt"] == body["leaseExpiresAt"]
