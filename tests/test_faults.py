"""Faults with real processes: paused workers, killed gateways, killed, paused and flushed Redis,
a locked SQLite file, and the startup durability check.

Nothing here is faked: workers, gateways and redis-servers are processes that get SIGSTOP,
SIGCONT and SIGKILL. Time bounds are generous upper bounds ("does not hang"), never tight
timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from fencegate.ledger.errors import StoreUnavailable
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    RenewRequest,
    Task,
)
from tests.api import HANG_S, Answer, Api, Lease
from tests.servers import GatewayProcess, Gateways, RedisServer

WORKER_SCRIPT = Path(__file__).with_name("worker_script.py")
POLICY = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)
#: Bounds only a hang of a wait for something that happens whatever the machine's load (a
#: lease running out, a reconnect): never how soon it happens (``tests.api.HANG_S``).
NO_HANG_S = HANG_S


# --- helpers ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def gateway_api(gateway: GatewayProcess) -> AsyncIterator[Api]:
    """``tests.api.Api`` over real HTTP to a gateway process (a fresh connection pool)."""
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(base_url=gateway.url, timeout=timeout) as session:
        yield Api(cast(Any, session))


def lease_from(owner: str, body: dict[str, Any]) -> Lease:
    return Lease(
        body["taskId"],
        body["attemptId"],
        body["claimGeneration"],
        owner,
        body["schedulerEpoch"],
        body["cancelGeneration"],
        body["leaseExpiresAt"],
        body["inputDigest"],
    )


def claim_request(owner: str, *, epoch: int, ttl_ms: int = 60_000) -> ClaimRequest:
    return ClaimRequest(owner=owner, ttl_ms=ttl_ms, scheduler_epoch=epoch)


def identity(attempt_id: str, owner: str, *, epoch: int) -> Identity:
    """The first claim's identity (generation 1, never cancelled)."""
    return Identity(
        attempt_id=attempt_id,
        claim_generation=1,
        owner=owner,
        scheduler_epoch=epoch,
        cancel_generation=0,
    )


def assert_store_unavailable(answer: Answer, because: str | None = None) -> None:
    """503 ``STORE_UNAVAILABLE``; with ``because``, its detail says so (e.g. the timeout)."""
    assert answer.status == 503, (answer.status, answer.body)
    assert answer.code == "STORE_UNAVAILABLE", answer.body
    assert answer.content_type == "application/problem+json"
    if because is not None:
        assert because in answer.body["detail"], answer.body


async def wait_until_ready(api: Api, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        answer = await api.call("GET", "/readyz")
        if answer.status == 200:
            return
        assert time.monotonic() < deadline, f"gateway not ready again: {answer.body}"
        await asyncio.sleep(0.1)


async def make_records(api: Api) -> list[str]:
    """Tasks in every state a restart must keep, plus a bumped epoch; returns their ids."""
    assert (await api.call("POST", "/v1/epoch/bump")).body["schedulerEpoch"] == 2
    await api.put("ready", "in-ready")
    await api.put("runtime", "in-runtime", maxRuntimeMs=5_000)
    await api.put("claimed", "in-claimed")
    await api.claim("claimed", "holder", ttl_ms=60_000)
    await api.put("committed", "in-committed")
    lease = await api.claim("committed", "w1")
    assert (await api.commit(lease, "out-1", result={"answer": 42, "list": [1, 2]})).status == 200
    await api.put("cancelled", "in-cancelled")
    await api.claim("cancelled", "w1")
    assert (await api.cancel("cancelled")).status == 200
    await api.put("released", "in-released")
    lease = await api.claim("released", "w1")
    assert (await api.release(lease)).status == 200
    await api.put("revised", "in-1")
    lease = await api.claim("revised", "w1")
    assert (await api.commit(lease, "out-1")).status == 200
    assert (await api.put("revised", "in-2")).status == 200
    return ["ready", "runtime", "claimed", "committed", "cancelled", "released", "revised"]


async def snapshot(api: Api, task_ids: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for task_id in task_ids:
        answer = await api.get(task_id)
        assert answer.status == 200, answer.body
        out[task_id] = answer.body
    return out


def assert_same_records(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
) -> None:
    assert after.keys() == before.keys()
    for task_id, record in before.items():
        assert after[task_id].keys() == record.keys(), task_id
        for field, value in record.items():
            assert after[task_id][field] == value, (task_id, field)


# --- a. a paused worker is fenced ------------------------------------------------------------


class Worker:
    """``tests/worker_script.py`` as a subprocess, read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, gateway: GatewayProcess, task_id: str, owner: str, ttl_ms: int) -> Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER_SCRIPT),
            gateway.url,
            task_id,
            owner,
            str(ttl_ms),
            "0.05",  # heartbeat every 50 ms
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def next_event(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=10)
        assert line, f"worker exited early with {await self.proc.wait()}"
        event: dict[str, Any] = json.loads(line)
        return event

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    async def finish(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it may have just exited
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
        await self.proc.wait()


async def test_worker_stopped_past_its_ttl_is_fenced_and_the_takeover_commits(
    gateways: Gateways, any_store_url: str
) -> None:
    gateway = gateways.start("gw", any_store_url)
    async with gateway_api(gateway) as api:
        assert (await api.put("job-1", "in-1")).status == 201
        worker = await Worker.start(gateway, "job-1", "worker-a", ttl_ms=500)
        try:
            claimed = await worker.next_event()
            assert claimed["event"] == "claim" and claimed["status"] == 200, claimed
            mine = claimed["body"]
            # It heartbeats: its lease stays alive while it runs.
            for _ in range(2):
                beat = await worker.next_event()
                assert (beat["event"], beat["status"]) == ("renew", 200), beat

            worker.signal(signal.SIGSTOP)  # a GC pause, a swapped-out VM, a stuck syscall...
            deadline = time.monotonic() + NO_HANG_S
            while True:  # wait out its 500 ms lease (a renew in flight may have extended it)
                answer = await api.try_claim("job-1", "worker-b", ttl_ms=30_000, epoch=1)
                if answer.status == 200:
                    break
                assert answer.code == "CLAIMED", answer.body
                assert time.monotonic() < deadline, "the stopped worker's lease never expired"
                await asyncio.sleep(0.1)
            takeover = lease_from("worker-b", answer.body)
            assert takeover.claim_generation == mine["claimGeneration"] + 1
            assert takeover.attempt_id != mine["attemptId"]

            worker.signal(signal.SIGCONT)
            event = await worker.next_event()
            stale_beats = 0
            while event["event"] == "renew" and event["status"] == 200:
                # Only a renew sent before SIGSTOP may still have been granted.
                stale_beats += 1
                assert stale_beats <= 1, "the worker kept renewing after the takeover"
                event = await worker.next_event()
            assert event["event"] == "renew", event
            assert (event["status"], event["code"]) == (409, "FENCED"), event
            committed = await worker.next_event()
            assert committed["event"] == "commit", committed
            assert (committed["status"], committed["code"]) == (409, "FENCED"), committed
            assert await asyncio.wait_for(worker.proc.wait(), timeout=10) == 0
        finally:
            await worker.finish()

        done = await api.commit(takeover, "result-of-worker-b")
        assert done.status == 200 and done.body["outcome"] == "COMMITTED", done.body
        record = (await api.get("job-1")).body
        assert record["state"] == "COMMITTED"
        assert record["commit"]["attemptId"] == takeover.attempt_id
        assert record["commit"]["claimGeneration"] == takeover.claim_generation
        assert record["commit"]["resultDigest"] == "result-of-worker-b"


# --- b. kill -9 of the gateway ----------------------------------------------------------------


async def test_gateway_kill_9_and_restart_keeps_every_task_record(
    gateways: Gateways, any_store_url: str
) -> None:
    gateway = gateways.start("gw", any_store_url)
    async with gateway_api(gateway) as api:
        task_ids = await make_records(api)
        before = await snapshot(api, task_ids)
        assert (await api.call("POST", "/v1/claims/pause")).status == 200

    gateway.kill()  # SIGKILL: no shutdown handler runs
    gateway.start()

    async with gateway_api(gateway) as api:
        after = await snapshot(api, task_ids)
        assert_same_records(before, after)
        scheduler = (await api.call("GET", "/v1/epoch")).body
        assert scheduler == {"schedulerEpoch": 2, "claimsPaused": True}
        assert (await api.call("POST", "/v1/claims/resume")).status == 200
        # The leases work on as before: the holder still holds and commits...
        assert (await api.try_claim("claimed", "intruder", epoch=2)).code == "CLAIMED"
        holder = lease_from("holder", before["claimed"])
        assert (await api.commit(holder, "out-claimed")).status == 200
        # ...and fencing tokens continue where they were, never reused.
        again = await api.claim("released", "w2")
        assert again.claim_generation == before["released"]["claimGeneration"] + 1 == 2
        revised = await api.claim("revised", "w2")
        assert revised.claim_generation == 2


async def test_every_answered_claim_survives_gateway_kill_9_mid_stream(
    gateways: Gateways, any_store_url: str
) -> None:
    """Claims keep flowing while the gateway is SIGKILLed; each one answered 200 was kept.

    A lost claim would let the next claim reuse its generation: two holders, one token.
    """
    gateway = gateways.start("gw", any_store_url)
    answered: list[dict[str, Any]] = []

    async def stream(api: Api, lane: int) -> None:
        for n in range(10_000):
            task_id = f"burst-{lane}-{n}"
            try:
                if (await api.put(task_id)).status != 201:
                    return
                answer = await api.try_claim(task_id, f"w{lane}", epoch=1)
            except (aiohttp.ClientError, TimeoutError):
                return  # the gateway died under this request
            if answer.status != 200:
                return
            answered.append(answer.body)

    async with gateway_api(gateway) as api:
        lanes = [asyncio.create_task(stream(api, lane)) for lane in range(8)]
        deadline = time.monotonic() + 20
        while len(answered) < 40:
            assert time.monotonic() < deadline, f"only {len(answered)} claims answered"
            assert not all(lane.done() for lane in lanes), "every lane stopped early"
            await asyncio.sleep(0.01)
        gateway.kill()
        await asyncio.wait_for(asyncio.gather(*lanes), timeout=30)

    gateway.start()
    async with gateway_api(gateway) as api:
        for claim in answered:
            record = (await api.get(claim["taskId"])).body
            assert record["state"] == "CLAIMED", record
            assert record["attemptId"] == claim["attemptId"]
            assert record["claimGeneration"] == claim["claimGeneration"] == 1
            assert record["leaseExpiresAt"] == claim["leaseExpiresAt"]


# --- c. Redis restart with AOF -----------------------------------------------------------------


async def test_redis_sigkill_and_restart_with_aof_keeps_every_record(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server()  # appendonly yes, appendfsync always
    store = RedisStore(server.url, POLICY, timeout_ms=1000, key_prefix="aof")
    await store.open()
    try:
        await store.bump_epoch()
        for task_id in ("ready", "claimed", "committed", "cancelled", "released"):
            await store.put_task(task_id, f"in-{task_id}", None)
        for task_id in ("claimed", "committed", "cancelled", "released"):
            await store.claim(task_id, claim_request("w1", epoch=2))
        done = await store.get_task("committed")
        assert done.attempt_id is not None
        await store.commit(
            "committed",
            CommitRequest(
                attempt_id=done.attempt_id,
                claim_generation=1,
                scheduler_epoch=2,
                cancel_generation=0,
                input_digest="in-committed",
                result_digest="out-1",
                result_json='{"answer":42}',
            ),
        )
        await store.cancel("cancelled")
        released = await store.get_task("released")
        assert released.attempt_id is not None
        await store.release("released", identity(released.attempt_id, "w1", epoch=2))
        await store.set_claims_paused(True)
        task_ids = ["ready", "claimed", "committed", "cancelled", "released"]
        before: dict[str, Task] = {t: await store.get_task(t) for t in task_ids}

        server.kill()  # SIGKILL right after the last answered write
        server.start()  # same port, same directory: replays the AOF

        # The store that was open through the restart reconnects by itself.
        deadline = time.monotonic() + NO_HANG_S
        while True:
            try:
                await store.ping()
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the store did not reconnect"
                await asyncio.sleep(0.1)
        for task_id in task_ids:
            assert await store.get_task(task_id) == before[task_id], task_id
        scheduler = await store.get_scheduler()
        assert (scheduler.epoch, scheduler.claims_paused) == (2, True)
        await store.set_claims_paused(False)
        again = await store.claim("released", claim_request("w2", epoch=2))
        assert again.claim_generation == 2  # the fencing token was not reissued
    finally:
        await store.close()

    fresh = RedisStore(server.url, POLICY, timeout_ms=1000, key_prefix="aof")
    await fresh.open()
    try:
        assert await fresh.get_task("committed") == before["committed"]
        assert (await fresh.get_task("released")).claim_generation == 2
    finally:
        await fresh.close()


# --- d. Redis paused ---------------------------------------------------------------------------


async def test_paused_redis_answers_503_quickly_and_the_gateway_recovers(
    gateways: Gateways, make_redis_server: Callable[..., RedisServer]
) -> None:
    server = make_redis_server()
    # The store timeout only has to fire while Redis is paused (it stays paused until every
    # answer below came), so it need not be short: 3 s, which a loaded machine's ordinary
    # round trips before the pause and after it never reach (500 ms did, under four loops).
    gateway = gateways.start("gw", server.url, timeout_ms=3_000)
    task_ids = [f"t{i}" for i in range(5)]
    async with gateway_api(gateway) as api:
        for task_id in [*task_ids, "after"]:
            put = await api.put(task_id, f"in-{task_id}")
            assert put.status == 201, put.body
        assert (await api.call("GET", "/readyz")).status == 200

        # SIGSTOP: connections stay open, nothing answers. Every answer below comes while the
        # server is still paused (it resumes only after them), so the gateway gave up on its
        # own timer, whatever the time the machine took; the client's bound only ends a hang.
        server.pause()
        try:
            answer = await api.try_claim("t0", "w1", epoch=1)
            assert_store_unavailable(answer, "Redis did not answer (TimeoutError")
            ready = await api.call("GET", "/readyz")
            assert_store_unavailable(ready)
            assert (await api.call("GET", "/healthz")).status == 200  # the process is up
            # Several requests stuck on the paused server at once all answer too.
            stuck = await asyncio.gather(*(api.get(t) for t in task_ids))
            for stuck_answer in stuck:
                assert_store_unavailable(stuck_answer, "Redis did not answer (TimeoutError")
        finally:
            server.resume()

        await wait_until_ready(api)
        # Every answer after recovery is the answer to its own request: a reply that was
        # still owed to a timed-out request must not reach a later one.
        records = await asyncio.gather(*(api.get(t) for t in task_ids))
        for task_id, record in zip(task_ids, records, strict=True):
            assert record.status == 200, record.body
            assert record.body["taskId"] == task_id
            assert record.body["inputDigest"] == f"in-{task_id}"
        lease = await api.claim("after", "w1")
        assert lease.claim_generation == 1
        assert (await api.get("after")).body["attemptId"] == lease.attempt_id
        assert (await api.commit(lease)).status == 200


# --- e. SQLite locked by another process --------------------------------------------------------


async def test_locked_sqlite_answers_503_and_works_again_once_released(
    gateways: Gateways, tmp_path: Path
) -> None:
    db = tmp_path / "locked.db"
    # 3 s: it fires only while the lock is held (below); ordinary steps never reach it.
    gateway = gateways.start("gw", f"sqlite:///{db}", timeout_ms=3_000)
    async with gateway_api(gateway) as api:
        for task_id in ("t1", "t2"):
            put = await api.put(task_id)
            assert put.status == 201, put.body
        locker = sqlite3.connect(db, isolation_level=None)
        try:
            # e.g. a backup tool or an operator's shell. It holds the lock until the answers
            # below came, so they came from the gateway's own timeout (the client's bound
            # only ends a hang), however slow the machine.
            locker.execute("BEGIN EXCLUSIVE")
            answer = await api.try_claim("t1", "w1", epoch=1)
            assert_store_unavailable(answer)
            # Many requests at once: none queues behind the others until it hangs.
            answers = await asyncio.gather(
                *(api.try_claim("t1", f"w{i}", epoch=1) for i in range(5)),
                api.call("GET", "/readyz"),
            )
            for each in answers:
                assert_store_unavailable(each)
        finally:
            locker.execute("ROLLBACK")
            locker.close()

        await wait_until_ready(api)
        lease = await api.claim("t2", "w1")
        assert lease.claim_generation == 1
        record = (await api.get("t2")).body
        assert record["attemptId"] == lease.attempt_id
        assert (await api.commit(lease)).status == 200


# --- f. SCRIPT FLUSH --------------------------------------------------------------------------


async def test_redis_store_survives_script_flush_mid_run(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server()
    admin = server.client()
    store = RedisStore(server.url, POLICY, timeout_ms=1000, key_prefix="flush")
    await store.open()

    def cached_scripts() -> int:
        return int(admin.info("memory")["number_of_cached_scripts"])

    def flush() -> None:
        assert cached_scripts() > 0  # the store (re)loaded what it just ran
        admin.script_flush()
        assert cached_scripts() == 0

    try:
        await store.put_task("t1", "in-1", None)
        task = await store.claim("t1", claim_request("w1", epoch=1, ttl_ms=10_000))
        assert task.attempt_id is not None
        ident = identity(task.attempt_id, "w1", epoch=1)

        flush()
        renewed = await store.renew("t1", RenewRequest(identity=ident, ttl_ms=20_000))
        assert renewed.lease_expires_at is not None and task.lease_expires_at is not None
        assert renewed.lease_expires_at > task.lease_expires_at

        flush()
        committed, replay = await store.commit(
            "t1",
            CommitRequest(
                attempt_id=task.attempt_id,
                claim_generation=1,
                scheduler_epoch=1,
                cancel_generation=0,
                input_digest="in-1",
                result_digest="out-1",
            ),
        )
        assert not replay and committed.commit is not None

        flush()
        await store.put_task("t2", "in-2", None)
        flush()
        assert (await store.claim("t2", claim_request("w2", epoch=1))).claim_generation == 1
        flush()
        assert (await store.bump_epoch()).epoch == 2
        assert (await store.get_task("t1")).commit == committed.commit
    finally:
        await store.close()
        admin.close()


# --- g. durability warning at startup ---------------------------------------------------------


def durability_events(gateway: GatewayProcess) -> tuple[list[dict[str, object]], set[object]]:
    events = gateway.log_events()
    warnings = [e for e in events if e.get("event") == "store.durability_warning"]
    return warnings, {e.get("event") for e in events}


def test_gateway_on_redis_without_aof_logs_a_durability_warning(
    gateways: Gateways, make_redis_server: Callable[..., RedisServer]
) -> None:
    unsafe = make_redis_server(appendonly=False)
    gateway = gateways.start("unsafe", unsafe.url)
    warnings, names = durability_events(gateway)
    assert "store.opened" in names
    assert warnings, f"no store.durability_warning among {sorted(map(str, names))}"
    assert any("appendonly" in str(w.get("reason")) for w in warnings), warnings
    assert all(w.get("level") == "warning" for w in warnings), warnings


def test_gateway_on_redis_with_aof_always_and_noeviction_logs_no_durability_warning(
    gateways: Gateways, make_redis_server: Callable[..., RedisServer]
) -> None:
    safe = make_redis_server()
    gateway = gateways.start("safe", safe.url)
    warnings, names = durability_events(gateway)
    assert "store.opened" in names  # the log was written and read
    assert warnings == []
    assert "store.durability_unknown" not in names


async def test_gateway_started_before_its_redis_checks_durability_once_redis_is_up(
    gateways: Gateways, make_redis_server: Callable[..., RedisServer]
) -> None:
    """Under an orchestrator the gateway may come up first; the gateway tolerates that
    (``/readyz`` answers 503 until Redis is there), so the durability check must still
    happen once Redis is reachable, not only when it was reachable at startup."""
    unsafe = make_redis_server(appendonly=False)
    unsafe.kill()
    gateway = gateways.start("early", unsafe.url, timeout_ms=500)
    unsafe.start()  # same port and directory, still appendonly=no
    async with gateway_api(gateway) as api:
        deadline = time.monotonic() + NO_HANG_S
        while (await api.put("t1")).status != 201 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # until Redis answers
        assert (await api.try_claim("t1", "w1", epoch=1)).status == 200
        ready = await api.call("GET", "/readyz")  # reachable, but not durable: not ready
        assert ready.status == 503 and "appendonly" in ready.body["detail"]
        deadline = time.monotonic() + NO_HANG_S
        while True:
            warnings, names = durability_events(gateway)
            if warnings or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    assert any("appendonly" in str(w.get("reason")) for w in warnings), (
        "served claims on an appendonly=no Redis without a store.durability_warning; "
        f"logged events: {sorted(map(str, names))}"
    )


async def test_an_sqlite_open_answered_locked_at_once_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process holds the file, SQLite can answer an opening step "database is
    locked" without waiting its busy timeout (CI saw a gateway restarted after kill -9, beside
    a second gateway on the same file, refused 48 ms after it began). The store tries again
    until its ``timeout_ms``; past that it is unavailable, as before."""
    from fencegate.ledger import sqlite_store
    from fencegate.ledger.sqlite_store import SQLiteStore

    real = SQLiteStore._connect_once
    refusals = [2]

    def locked_at_first(self: SQLiteStore) -> None:
        if refusals[0] > 0:
            refusals[0] -= 1
            raise sqlite3.OperationalError("database is locked")
        real(self)

    monkeypatch.setattr(SQLiteStore, "_connect_once", locked_at_first)
    store = SQLiteStore(str(tmp_path / "fg.db"), POLICY, timeout_ms=2_000)
    await store.open()
    try:
        assert refusals == [0]
        await store.put_task("t1", "in", None)
    finally:
        await store.close()

    # Locked for good: the open's retry runs on a clock that moves only by its own sleeps, so
    # "until timeout_ms, then unavailable" is counted on it, not raced on a loaded machine.
    refusals[0] = 1_000_000
    clock = OpenRetryClock()
    monkeypatch.setattr(sqlite_store, "time", clock)
    stuck = SQLiteStore(str(tmp_path / "fg.db"), POLICY, timeout_ms=300)
    with pytest.raises(StoreUnavailable, match="database is locked"):
        await stuck.open()
    assert 1_000_000 - refusals[0] == clock.sleeps + 1  # a try after each pause
    assert 0.3 <= clock.now < 0.3 + clock.longest_sleep  # through timeout_ms, not past it


class OpenRetryClock:
    """Stands in for the ``time`` module of ``fencegate.ledger.sqlite_store`` while a store
    opens: ``monotonic`` moves only by what ``sleep`` is asked to wait (no real time
    passes)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0
        self.longest_sleep = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.longest_sleep = max(self.longest_sleep, seconds)
        self.now += seconds
