"""The fenced proxy with real processes: gateways killed mid-effect, a store that stops
answering, and duplicates racing through two gateway processes.

Gateways are ``fencegate serve`` subprocesses configured by TOML files (``tests/servers.py``),
except the crash tests' standby, which is not what dies: it is built from the same file and
served in the test's process. Gateway processes die by SIGKILL, either at a failpoint
(``FENCEGATE_FAILPOINTS``, the process kills itself at that instant) or from the test. The
downstream (``tests/downstream.py``) is a real HTTP server on loopback running in the test's
event loop, counting calls per Idempotency-Key. The promise under test: at most one execution
per effectId, and never a lost one: whatever dies, the ledger says PREPARED, then UNKNOWN,
never COMMITTED without a response and never "nothing happened" after something did.

Both stores read time from this host's clock (the SQLite store from the gateway's own clock,
Redis from ``TIME`` on loopback), so the test may compare a record's ``deadlineAt`` with
``time.time()``. Time bounds are generous ("does not hang"), never tight.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fencegate.ledger.effects import effect_id
from tests.api import Api, InProcessGateway, Lease
from tests.downstream import Downstream
from tests.postgres_server import PostgresServer
from tests.servers import GatewayProcess, Gateways, RedisServer, write_gateway_config
from tests.test_faults import (
    NO_HANG_S,
    gateway_api,
    lease_from,
    wait_until_ready,
)
from tests.test_proxy import fence_headers

#: The downstream's timeout_ms in the crash tests; the test kills the gateway within a few
#: milliseconds of the forward's arrival, well inside it.
FORWARD_TIMEOUT_MS = 600
#: A PREPARED record's deadline is FORWARD_TIMEOUT_MS + this after the prepare: ample time
#: for the standby gateway to read the orphaned record while it is still PREPARED.
PREPARED_MARGIN_MS = 1_500
CONTENDERS = 50
#: store.timeout_ms where the store is not what is under test: generous, so a loaded machine
#: cannot turn a slow store step into a 503 the test did not ask for.
STORE_TIMEOUT_MS = 5_000


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """One client pool for proxied calls to any gateway (absolute URLs)."""
    connector = aiohttp.TCPConnector(limit=2 * CONTENDERS)
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        yield client


def api_downstream(downstream: Downstream, timeout_ms: int) -> dict[str, object]:
    return {"name": "api", "url": downstream.url, "timeout_ms": timeout_ms}


@dataclass
class Proxied:
    status: int
    headers: Any
    body: bytes
    json: Any

    @property
    def code(self) -> str | None:
        return self.json.get("code") if isinstance(self.json, dict) else None

    @property
    def replayed(self) -> str | None:
        value: str | None = self.headers.get("Fence-Replayed")
        return value


async def proxied(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess | InProcessGateway,
    lease: Lease,
    path: str,
    *,
    method: str = "POST",
    body: Any = None,
    slot: str | None = "s1",
) -> Proxied:
    """One proxied call as a worker makes it: ``{METHOD} /proxy/api{path}`` with its fence."""
    async with session.request(
        method,
        f"{gateway.url}/proxy/api{path}",
        json=body,
        headers=fence_headers(lease, slot),
        allow_redirects=False,
    ) as resp:
        raw = await resp.read()
        try:
            parsed = await resp.json(content_type=None) if raw else None
        except ValueError:
            parsed = None
        return Proxied(resp.status, resp.headers, raw, parsed)


async def claimed_task(
    api: Api, task_id: str, owner: str = "worker-a", ttl_ms: int = 30_000
) -> Lease:
    assert (await api.put(task_id, "in-1")).status == 201
    epoch = await api.epoch()
    answer = await api.try_claim(task_id, owner, ttl_ms=ttl_ms, epoch=epoch)
    assert answer.status == 200, answer.body
    return lease_from(owner, answer.body)


async def effect_record(api: Api, eid: str) -> dict[str, Any]:
    answer = await api.call("GET", f"/v1/effects/{eid}")
    assert answer.status == 200, answer.body
    record: dict[str, Any] = answer.body
    return record


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


async def sleep_past(instant_ms: int, slack_ms: int = 100) -> None:
    """Real time passes ``instant_ms`` (store time = this host's clock) by ``slack_ms``."""
    await asyncio.sleep(max(0, instant_ms + slack_ms - wall_ms()) / 1000)


@dataclass
class CrashRig:
    """A gateway process that will die mid-effect, and a standby: the gateway built from the
    same config file, on the same store, without failpoints, that reads the ledger the moment
    the first one is gone (a restart takes a second or more, and the test must not depend on
    winning a race against the PREPARED deadline). The standby is not what dies, so it is
    served in the test's process (``InProcessGateway``)."""

    gateway: GatewayProcess
    standby: InProcessGateway


@pytest.fixture
async def in_process() -> AsyncIterator[list[InProcessGateway]]:
    """In-process gateways a test starts; all are stopped when it ends (a test takes it last,
    so they stop before the stores and downstreams they use)."""
    started: list[InProcessGateway] = []
    yield started
    for standby in started:
        await standby.stop()


async def crash_rig(
    gateways: Gateways,
    in_process: list[InProcessGateway],
    store_url: str,
    key_prefix: str,
    downstream: Downstream,
    failpoint: str | None = None,
) -> CrashRig:
    gateway = write_gateway_config(
        gateways.root / "gw",
        store_url,
        timeout_ms=STORE_TIMEOUT_MS,
        key_prefix=key_prefix,
        downstreams=[api_downstream(downstream, FORWARD_TIMEOUT_MS)],
        proxy={"prepared_margin_ms": PREPARED_MARGIN_MS},
        env={"FENCEGATE_FAILPOINTS": failpoint} if failpoint else None,
    )
    standby = InProcessGateway(gateway.config_path)
    gateways.started.append(gateway)
    in_process.append(standby)
    await asyncio.gather(asyncio.to_thread(gateway.start), standby.start())
    return CrashRig(gateway, standby)


def died_by_sigkill(gateway: GatewayProcess) -> None:
    assert gateway.proc is not None
    assert gateway.proc.wait(timeout=NO_HANG_S) == -signal.SIGKILL


async def restart_without_failpoints(gateway: GatewayProcess) -> None:
    gateway.kill()  # reaps the dead process
    gateway.env.pop("FENCEGATE_FAILPOINTS", None)
    await asyncio.to_thread(gateway.start)  # the downstream keeps serving meanwhile


async def orphan_reads_prepared_then_unknown(
    session: aiohttp.ClientSession,
    rig: CrashRig,
    lease: Lease,
    path: str,
    body: Any,
    eid: str,
    executed: int,
    downstream: Downstream,
) -> None:
    """After a gateway died mid-effect: the ledger shows the orphaned forward as PREPARED (an
    identical retry is refused as in flight, not forwarded again) until its deadline, then,
    through the restarted gateway, UNKNOWN (an identical retry is EFFECT_UNKNOWN, on any
    gateway). ``executed`` is how often the downstream ran the effect; it never changes."""
    async with gateway_api(rig.standby) as api:
        record = await effect_record(api, eid)
        assert record["state"] == "PREPARED", record
        assert record["taskId"] == lease.task_id and record["slot"] == "s1"
        (attempt,) = record["attempts"]
        assert attempt["attemptId"] == lease.attempt_id
        deadline = record["deadlineAt"]
        assert deadline == attempt["startedAt"] + FORWARD_TIMEOUT_MS + PREPARED_MARGIN_MS
        assert wall_ms() < deadline - 200, "too slow to look at the record before its deadline"
        early = await proxied(session, rig.standby, lease, path, body=body)
        assert (early.status, early.code) == (409, "EFFECT_IN_FLIGHT"), early.json
        assert early.headers["Fence-Effect-Id"] == eid
        assert early.headers["Fence-Effect-State"] == "PREPARED"
        assert early.headers["Retry-After"]
        assert sum(downstream.per_key.values()) == downstream.per_key[eid] == executed

    await restart_without_failpoints(rig.gateway)
    async with gateway_api(rig.gateway) as api:
        await sleep_past(deadline)
        record = await effect_record(api, eid)
        assert record["state"] == "UNKNOWN", record
        (attempt,) = record["attempts"]
        assert attempt["outcome"] == "UNKNOWN" and attempt["endedAt"] == deadline
        assert attempt["reason"] == "deadline passed"
        assert record["response"] is None  # never COMMITTED without a response
        for gateway in (rig.gateway, rig.standby, rig.gateway):
            again = await proxied(session, gateway, lease, path, body=body)
            assert (again.status, again.code) == (409, "EFFECT_UNKNOWN"), again.json
            assert again.headers["Fence-Effect-Id"] == eid
            assert again.headers["Fence-Effect-State"] == "UNKNOWN"
            assert again.replayed == "false"
        unknown = await api.call("GET", f"/v1/effects?state=UNKNOWN&taskId={lease.task_id}")
        assert [e["effectId"] for e in unknown.body["effects"]] == [eid]
    assert sum(downstream.per_key.values()) == downstream.per_key[eid] == executed


# --- 1. kill -9 of the gateway mid-effect ------------------------------------------------------


async def test_gateway_killed_after_prepare_never_forwards_and_the_effect_turns_unknown(
    gateways: Gateways,
    store_url: str,
    key_prefix: str,
    downstream: Downstream,
    session: aiohttp.ClientSession,
    in_process: list[InProcessGateway],
) -> None:
    rig = await crash_rig(gateways, in_process, store_url, key_prefix, downstream, "after_prepare")
    gateway = rig.gateway
    async with gateway_api(gateway) as api:
        lease = await claimed_task(api, "pay-1")
    eid = effect_id("pay-1", 1, "main", "s1")
    x = {"to": "alice", "amount": 10}

    with pytest.raises(aiohttp.ClientConnectionError):
        await proxied(session, gateway, lease, "/ok/pay", body=x)
    died_by_sigkill(gateway)
    assert downstream.received == []

    await orphan_reads_prepared_then_unknown(session, rig, lease, "/ok/pay", x, eid, 0, downstream)
    assert downstream.received == []


async def test_gateway_killed_during_the_forward_leaves_one_call_and_an_unknown_effect(
    gateways: Gateways,
    store_url: str,
    key_prefix: str,
    downstream: Downstream,
    session: aiohttp.ClientSession,
    in_process: list[InProcessGateway],
) -> None:
    rig = await crash_rig(gateways, in_process, store_url, key_prefix, downstream)
    gateway = rig.gateway
    async with gateway_api(gateway) as api:
        lease = await claimed_task(api, "pay-1")
    eid = effect_id("pay-1", 1, "main", "s1")
    x = {"to": "alice", "amount": 10}
    # The downstream takes longer than the gateway lives: it is killed while waiting.
    path = f"/slow/{FORWARD_TIMEOUT_MS + 500}/pay"

    call = asyncio.create_task(proxied(session, gateway, lease, path, body=x))
    await asyncio.wait_for(downstream.arrived.wait(), NO_HANG_S)
    gateway.kill()
    with pytest.raises(aiohttp.ClientConnectionError):
        await call
    assert downstream.per_key == {eid: 1}

    await orphan_reads_prepared_then_unknown(session, rig, lease, path, x, eid, 1, downstream)
    (only,) = downstream.received
    assert only.headers["Idempotency-Key"] == eid


async def test_gateway_killed_after_the_response_keeps_the_effect_unknown_until_resolved(
    gateways: Gateways,
    store_url: str,
    key_prefix: str,
    downstream: Downstream,
    session: aiohttp.ClientSession,
    in_process: list[InProcessGateway],
) -> None:
    rig = await crash_rig(gateways, in_process, store_url, key_prefix, downstream, "after_response")
    gateway = rig.gateway
    async with gateway_api(gateway) as api:
        lease = await claimed_task(api, "pay-1")
    eid = effect_id("pay-1", 1, "main", "s1")
    x = {"to": "alice", "amount": 10}

    with pytest.raises(aiohttp.ClientConnectionError):
        await proxied(session, gateway, lease, "/ok/pay", body=x)
    died_by_sigkill(gateway)
    assert downstream.per_key == {eid: 1}  # the effect happened; its answer died with the gateway

    await orphan_reads_prepared_then_unknown(session, rig, lease, "/ok/pay", x, eid, 1, downstream)

    # An operator checks the downstream and settles it; duplicates now replay that answer.
    async with gateway_api(gateway) as api:
        resolved = await api.call(
            "POST",
            f"/v1/effects/{eid}/resolve",
            {
                "outcome": "COMMITTED",
                "note": "payment p-1 found in the downstream's console",
                "response": {"status": 201, "headers": {"X-Ref": "p-1"}, "body": '{"id":"p-1"}'},
            },
        )
        assert resolved.status == 200, resolved.body
        assert resolved.body["state"] == "COMMITTED"
        assert (await effect_record(api, eid))["state"] == "COMMITTED"
    for each in (gateway, rig.standby):
        replay = await proxied(session, each, lease, "/ok/pay", body=x)
        assert replay.status == 201, replay.json
        assert replay.body == b'{"id":"p-1"}'
        assert replay.headers["X-Ref"] == "p-1"
        assert replay.replayed == "true"
        assert replay.headers["Fence-Effect-State"] == "COMMITTED"
        assert replay.headers["Fence-Effect-Id"] == eid
    assert downstream.per_key == {eid: 1}
    assert len(downstream.received) == 1


# --- 2. the store stops answering mid-run ------------------------------------------------------


@contextlib.contextmanager
def redis_paused(server: RedisServer) -> Iterator[None]:
    server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        yield
    finally:
        server.resume()


@contextlib.contextmanager
def sqlite_locked(db: Path) -> Iterator[None]:
    locker = sqlite3.connect(db, isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")  # e.g. a backup tool or an operator's shell
        yield
    finally:
        locker.execute("ROLLBACK")
        locker.close()


@contextlib.contextmanager
def postgres_paused(server: PostgresServer) -> Iterator[None]:
    server.pause()  # SIGSTOP of the postmaster and every backend
    try:
        yield
    finally:
        server.resume()


@pytest.fixture(params=["redis-sigstop", "sqlite-locked", "postgres-sigstop"])
def store_outage(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    make_postgres_server: Callable[..., PostgresServer],
) -> tuple[str, Callable[[], contextlib.AbstractContextManager[None]]]:
    """A store URL and a way to make that store stop answering for a while."""
    if request.param == "redis-sigstop":
        server = make_redis_server()
        return server.url, lambda: redis_paused(server)
    if request.param == "postgres-sigstop":
        postgres = make_postgres_server()
        return postgres.url, lambda: postgres_paused(postgres)
    db = tmp_path / "outage.db"
    return f"sqlite:///{db}", lambda: sqlite_locked(db)


async def test_unanswering_store_refuses_proxied_calls_and_forwards_nothing(
    gateways: Gateways,
    store_outage: tuple[str, Callable[[], contextlib.AbstractContextManager[None]]],
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> None:
    store_url, outage = store_outage
    # The store timeout only has to fire during the outage, and the forward start limit only
    # bounds a hang: on a loaded machine a retry's prepare after recovery took over 500 ms.
    gateway = gateways.start(
        "gw",
        store_url,
        timeout_ms=3_000,
        downstreams=[api_downstream(downstream, 5_000)],
        proxy={"prepared_margin_ms": 4_000, "forward_start_limit_ms": 3_000},
    )
    x = {"to": "alice", "amount": 10}
    eid = effect_id("pay-1", 1, "main", "s1")
    async with gateway_api(gateway) as api:
        lease = await claimed_task(api, "pay-1")
        # Mid-run: the gateway has already forwarded a mutation and a read (on Redis, its
        # scripts are loaded), then the store stops answering.
        warm = await proxied(session, gateway, lease, "/ok/earlier", body={}, slot="s0")
        assert warm.status == 200 and warm.replayed == "false"
        read = await proxied(session, gateway, lease, "/ok/read", method="GET", slot=None)
        assert read.status == 200
        before = len(downstream.received)
        with outage():
            started = time.monotonic()
            post = await proxied(session, gateway, lease, "/ok/pay", body=x)
            assert time.monotonic() - started < NO_HANG_S
            assert (post.status, post.code) == (503, "STORE_UNAVAILABLE"), post.json
            assert post.headers["Content-Type"] == "application/problem+json"
            assert post.replayed == "false"
            started = time.monotonic()
            get = await proxied(session, gateway, lease, "/ok/read", method="GET", slot=None)
            assert time.monotonic() - started < NO_HANG_S
            assert (get.status, get.code) == (503, "STORE_UNAVAILABLE"), get.json
            assert len(downstream.received) == before  # nothing was forwarded

        await wait_until_ready(api)
        # The refused call was never forwarded; sent again, it goes through, exactly once.
        # The store may apply the unanswered prepare when it resumes; the gateway then finds
        # that record by its forward id and aborts it, so a retry may briefly meet
        # EFFECT_IN_FLIGHT (with Retry-After), as any client of a busy slot can.
        deadline = time.monotonic() + NO_HANG_S
        while True:
            again = await proxied(session, gateway, lease, "/ok/pay", body=x)
            if again.code != "EFFECT_IN_FLIGHT" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        ledger = (await api.call("GET", f"/v1/effects/{eid}")).body
        assert again.status == 200, (
            "a call answered 503 while the store did not answer was never forwarded, yet its "
            f"retry after recovery answers {again.status} {again.code}; the ledger holds "
            f"{ledger.get('state')} with attempts {ledger.get('attempts')}"
        )
        assert again.replayed == "false"
        assert again.headers["Fence-Effect-State"] == "COMMITTED"
        assert downstream.per_key[eid] == 1
        read = await proxied(session, gateway, lease, "/ok/read", method="GET", slot=None)
        assert read.status == 200
        assert [r.method for r in downstream.received[before:]] == ["POST", "GET"]
        assert ledger["state"] == "COMMITTED"
        assert [a["outcome"] for a in ledger["attempts"]][-1] == "COMMITTED"
        assert all(a["outcome"] == "NOT_APPLIED" for a in ledger["attempts"][:-1])
    # The outage is the store's, answered as 503s: nothing in the gateway went unhandled (an
    # asyncpg release once timed out in a task nobody awaited: "Task exception was never
    # retrieved").
    unhandled = [
        e for e in gateway.log_events() if e.get("event") == "python.log" and e["level"] == "error"
    ]
    assert not unhandled, unhandled


# --- 3. identical duplicates racing through gateway processes ----------------------------------


async def start_pair(gateways: Gateways, store_url: str, **config: Any) -> list[GatewayProcess]:
    """Two gateway processes on one store, as a fleet runs them (started side by side)."""
    return list(
        await asyncio.gather(
            *(
                asyncio.to_thread(gateways.start, name, store_url, **config)
                for name in ("gw1", "gw2")
            )
        )
    )


async def duplicate_race(
    session: aiohttp.ClientSession, gateways_: list[GatewayProcess], lease: Lease
) -> list[Proxied]:
    """CONTENDERS identical calls at once, spread round-robin over the gateways."""
    start = asyncio.Event()

    async def contender(i: int) -> Proxied:
        await start.wait()
        return await proxied(
            session, gateways_[i % len(gateways_)], lease, "/slow/200/pay", body={"x": 1}
        )

    racers = [asyncio.create_task(contender(i)) for i in range(CONTENDERS)]
    await asyncio.sleep(0)  # every contender is parked on the event
    start.set()
    return await asyncio.gather(*racers)


def assert_forwarded_once(answers: list[Proxied], downstream: Downstream, eid: str) -> None:
    kinds = Counter((a.status, a.code or a.replayed) for a in answers)
    assert downstream.per_key == {eid: 1}, kinds
    (first,) = [a for a in answers if a.status == 200 and a.replayed == "false"]
    for answer in answers:
        assert answer.headers["Fence-Effect-Id"] == eid
        if answer is first:
            continue
        if answer.status == 200:
            assert answer.replayed == "true", kinds
            assert answer.body == first.body, kinds  # a replay is the one real answer
            assert answer.headers["Fence-Effect-State"] == "COMMITTED"
        else:
            assert (answer.status, answer.code) == (409, "EFFECT_IN_FLIGHT"), kinds
            assert answer.replayed == "false"


async def test_fifty_duplicates_through_two_gateways_on_one_redis_forward_once(
    gateways: Gateways,
    redis_server: RedisServer,
    key_prefix: str,
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> None:
    pair = await start_pair(
        gateways,
        redis_server.url,
        timeout_ms=STORE_TIMEOUT_MS,
        key_prefix=key_prefix,
        downstreams=[api_downstream(downstream, 5_000)],
    )
    async with gateway_api(pair[0]) as api:
        lease = await claimed_task(api, "pay-1")
    answers = await duplicate_race(session, pair, lease)
    assert_forwarded_once(answers, downstream, effect_id("pay-1", 1, "main", "s1"))
    # After the race, either gateway replays the one stored answer.
    for gateway in pair:
        late = await proxied(session, gateway, lease, "/slow/200/pay", body={"x": 1})
        assert late.status == 200 and late.replayed == "true"
    assert len(downstream.received) == 1


async def test_fifty_duplicates_through_one_gateway_on_sqlite_forward_once(
    gateways: Gateways,
    tmp_path: Path,
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> None:
    gateway = gateways.start(
        "gw",
        f"sqlite:///{tmp_path / 'race.db'}",
        timeout_ms=STORE_TIMEOUT_MS,
        downstreams=[api_downstream(downstream, 5_000)],
    )
    async with gateway_api(gateway) as api:
        lease = await claimed_task(api, "pay-1")
    answers = await duplicate_race(session, [gateway], lease)
    assert_forwarded_once(answers, downstream, effect_id("pay-1", 1, "main", "s1"))
    late = await proxied(session, gateway, lease, "/slow/200/pay", body={"x": 1})
    assert late.status == 200 and late.replayed == "true"
    assert len(downstream.received) == 1


# --- 4. the lost answer, across two gateway processes ------------------------------------------


async def test_lost_answer_takeover_through_another_gateway_cannot_repeat_or_change_it(
    gateways: Gateways,
    redis_server: RedisServer,
    key_prefix: str,
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> None:
    timeout_ms = 300
    gw1, gw2 = await start_pair(
        gateways,
        redis_server.url,
        timeout_ms=STORE_TIMEOUT_MS,
        key_prefix=key_prefix,
        downstreams=[api_downstream(downstream, timeout_ms)],
        # A start limit of 1 s (not 100 ms): a loaded machine's prepare stays inside it.
        proxy={"prepared_margin_ms": 2_000},
    )
    path = f"/slow/{3 * timeout_ms}/pay"
    x = {"to": "alice", "amount": 10}
    y = {"to": "alice", "amount": 11}
    eid = effect_id("pay-1", 1, "main", "s1")
    async with gateway_api(gw1) as api1, gateway_api(gw2) as api2:
        a = await claimed_task(api1, "pay-1", owner="worker-a", ttl_ms=1_500)
        lost = await proxied(session, gw1, a, path, body=x)
        assert (lost.status, lost.code) == (504, "DOWNSTREAM_TIMEOUT"), lost.json
        assert lost.headers["Fence-Effect-State"] == "UNKNOWN"
        assert lost.headers["Fence-Effect-Id"] == eid

        await sleep_past(a.lease_expires_at)  # A's lease lapses (real time)
        taken = await api2.try_claim("pay-1", "worker-b", ttl_ms=30_000)
        assert taken.status == 200, taken.body
        b = lease_from("worker-b", taken.body)
        assert b.claim_generation == a.claim_generation + 1

        other = await proxied(session, gw2, b, path, body=y)
        assert (other.status, other.code) == (422, "PAYLOAD_CONFLICT"), other.json
        assert other.headers["Fence-Effect-Id"] == eid
        same = await proxied(session, gw2, b, path, body=x)
        assert (same.status, same.code) == (409, "EFFECT_UNKNOWN"), same.json
        # Worker A, back from its pause, is fenced on either gateway.
        for gateway in (gw1, gw2):
            stale = await proxied(session, gateway, a, path, body=x)
            assert (stale.status, stale.code) == (409, "FENCED"), stale.json

        record = await effect_record(api1, eid)
        assert record["state"] == "UNKNOWN"
        assert [at["attemptId"] for at in record["attempts"]] == [a.attempt_id]
        # Let the slow downstream finish its one call before counting.
        (arrival,) = downstream.received
        await asyncio.sleep(3 * timeout_ms / 1000)
    assert downstream.per_key == {eid: 1}
    assert arrival.headers["Fencing-Token"] == f"1.{a.claim_generation}"
    assert len(downstream.received) == 1
