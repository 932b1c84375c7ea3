"""Fail closed when acknowledged writes are gone (issue 18): a Redis that comes back without
writes the gateways acknowledged (here: an older copy of its AOF restored after kill -9, as
a failover to a replica that lacked the last writes would leave it) makes the gateways refuse
claims and effects until an operator runs `fencegate failover ack`, which fences every claim
granted before. A restart that loses nothing blocks nobody.

Two gateways (in-process apps on separate store objects, as two processes would have) share
our own redis-server (AOF, fsync always).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.ledger.errors import StoreRegressed
from tests.api import HANG_S, Answer, Api
from tests.conftest import build_test_store, make_config
from tests.servers import RedisServer


@pytest.fixture
def server(make_redis_server: Callable[..., RedisServer]) -> RedisServer:
    return make_redis_server()


@pytest.fixture
async def gateways(server: RedisServer, key_prefix: str) -> AsyncIterator[tuple[Api, Api]]:
    config = make_config(server.url, key_prefix, reconciler={"enabled": False})
    one = create_app(config, store=build_test_store(config))
    two = create_app(config, store=build_test_store(config))
    async with (
        TestClient(TestServer(one, host="127.0.0.1")) as a,
        TestClient(TestServer(two, host="127.0.0.1")) as b,
    ):
        yield Api(a), Api(b)


def restart(server: RedisServer, aof: Path | None = None) -> None:
    """kill -9, then start again on the same port, from ``aof`` (an older copy) if given."""
    server.kill()
    if aof is not None:
        shutil.rmtree(server.directory / "appendonlydir")
        shutil.copytree(aof, server.directory / "appendonlydir")
    server.start()


async def until(check: Callable[[], object], seconds: float = HANG_S) -> None:
    """Until ``check()`` holds; ``seconds`` bounds a hang only (a loaded machine is slow)."""
    deadline = time.monotonic() + seconds
    while not await check():  # type: ignore[misc]
        if time.monotonic() > deadline:
            raise AssertionError("not within the time")
        await asyncio.sleep(0.1)


async def after_restart(api: Api, method: str, path: str, body: object = None) -> Answer:
    """A call's answer, retried while the store answers "did not answer" (the restart
    dropped the pooled connections: a connection error, not the refusal under test). The
    deadline bounds a hang only: a loaded machine may take seconds to reconnect."""
    deadline = time.monotonic() + HANG_S
    while True:
        answer = await api.call(method, path, body)
        if answer.status != 503 or "did not answer" not in str(answer.body):
            return answer
        if time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.1)


async def first_answer(api: Api, method: str, path: str, body: object = None) -> int:
    return (await after_restart(api, method, path, body)).status


async def test_lost_writes_stop_claims_and_effects_until_acknowledged(
    server: RedisServer, gateways: tuple[Api, Api], key_prefix: str, tmp_path: Path
) -> None:
    a, b = gateways
    assert (await a.put("t1")).status == 201
    before = await a.claim("t1", ttl_ms=60_000)  # a claim the restored copy keeps
    assert (await b.put("t2")).status == 201
    snapshot = tmp_path / "aof-before"
    shutil.copytree(server.directory / "appendonlydir", snapshot)
    # Acknowledged after the copy: lost by the restore.
    assert (await a.put("t3")).status == 201
    assert (await a.put("t3-2")).status == 201
    assert (await a.commit(before)).status == 200
    restart(server, snapshot)

    # Gateway a finds its own writes gone: it refuses writes and says why, /readyz is false.
    refused = await after_restart(a, "PUT", "/v1/tasks/t4", {"inputDigest": "x"})
    assert refused.status == 503 and refused.code == "STORE_UNAVAILABLE"
    assert "lost writes" in refused.body["detail"]
    assert "fencegate failover ack" in refused.body["detail"]
    assert (await a.call("GET", "/readyz")).status == 503
    # Gateway b lost nothing of its own, but learns it from the store-wide flag: at once on
    # /readyz, and by the answer to its next write at the latest.
    assert (await after_restart(b, "GET", "/readyz")).status == 503
    second = await after_restart(b, "POST", "/v1/tasks/t2/cancel")
    assert second.status == 503 and "lost writes" in second.body["detail"]
    # Reads go on: the commit is gone (the task is CLAIMED again), the claim is back.
    record = await a.get("t1")
    assert (record.status, record.body["state"]) == (200, "CLAIMED")
    metrics = await a.client.get("/metrics")
    assert "fencegate_store_regressed 1.0" in await metrics.text()

    config = tmp_path / "fencegate.toml"
    config.write_text(
        f"[store]\nurl = {json.dumps(server.url)}\nredis_key_prefix = {json.dumps(key_prefix)}\n"
    )
    acked = subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", "failover", "ack", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert acked.returncode == 0, acked.stderr
    assert "scheduler epoch is now 2" in acked.stdout

    async def ready(api: Api) -> bool:
        return (await api.call("GET", "/readyz")).status == 200

    await until(lambda: ready(a))
    await until(lambda: ready(b))
    # Every claim granted before the acknowledgement is fenced; new claims go on.
    stale = await a.renew(before)
    assert (stale.status, stale.code) == (409, "STALE_EPOCH")
    again = await a.claim("t1")
    assert again.scheduler_epoch == 2 and again.claim_generation == before.claim_generation + 1
    assert (await b.put("t5")).status == 201


async def test_a_restart_that_loses_nothing_blocks_nobody(
    server: RedisServer, gateways: tuple[Api, Api]
) -> None:
    a, b = gateways
    assert (await a.put("t1")).status == 201
    lease = await a.claim("t1", ttl_ms=60_000)
    restart(server)  # kill -9; the AOF (fsync always) has every acknowledged write
    assert await first_answer(a, "PUT", "/v1/tasks/t2", {"inputDigest": "x"}) == 201
    assert await first_answer(b, "PUT", "/v1/tasks/t3", {"inputDigest": "x"}) == 201
    assert (await a.renew(lease)).status == 200
    assert (await a.call("GET", "/readyz")).status == 200
    assert (await b.call("GET", "/readyz")).status == 200


async def test_an_acknowledgement_covers_a_loss_found_after_it(
    server: RedisServer, gateways: tuple[Api, Api], tmp_path: Path, key_prefix: str
) -> None:
    """Gateway b writes for the first time after the operator acknowledged: its own lost
    write is one the acknowledgement already fenced, so it does not stop everyone again."""
    a, b = gateways
    assert (await a.put("t1")).status == 201
    assert (await b.put("t2")).status == 201
    snapshot = tmp_path / "aof-before"
    shutil.copytree(server.directory / "appendonlydir", snapshot)
    # Lost by the restore: three writes of each gateway (a batch whose answer the restart cut
    # off may still have run on the restored copy and hide one: docs/stores.md).
    for n in range(3):
        assert (await a.put(f"t3-{n}")).status == 201
        assert (await b.put(f"t4-{n}")).status == 201
    restart(server, snapshot)
    assert (await first_answer(a, "PUT", "/v1/tasks/t5", {"inputDigest": "x"})) == 503
    operator = build_test_store(make_config(server.url, key_prefix))  # as the CLI does
    with contextlib.suppress(StoreRegressed):
        await operator.open()
    try:
        await operator.acknowledge_failover()
    finally:
        await operator.close()
    assert await first_answer(b, "PUT", "/v1/tasks/t6", {"inputDigest": "x"}) == 201
    assert (await b.put("t7")).status == 201
    await until(lambda: _ready(a))


async def _ready(api: Api) -> bool:
    return (await api.call("GET", "/readyz")).status == 200


async def test_writes_no_replica_confirmed_never_count_as_acknowledged(
    server: RedisServer, key_prefix: str, tmp_path: Path
) -> None:
    """With ``redis_min_replicas``, a batch that ``WAIT`` did not confirm is answered 503: its
    write mark is no acknowledged write, so losing it (a failover to a replica it never
    reached; here an older AOF) must not be taken for lost writes and stop the fleet."""
    from fencegate.gateway.app import build_store

    config = make_config(
        server.url,
        key_prefix,
        reconciler={"enabled": False},
        store={"redis_min_replicas": 1, "redis_replica_timeout_ms": 50},
    )
    app = create_app(config, store=build_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        assert (await api.call("GET", "/v1/tasks/none")).status == 404
        snapshot = tmp_path / "aof-before"
        shutil.copytree(server.directory / "appendonlydir", snapshot)
        for n in range(3):  # no replica: applied on the master, never answered
            refused = await api.put(f"t{n}")
            assert refused.status == 503 and "not confirmed by 1" in refused.body["detail"]
        restart(server, snapshot)
        again = await after_restart(api, "PUT", "/v1/tasks/t9", {"inputDigest": "x"})
        assert again.status == 503
        assert "not confirmed by 1" in again.body["detail"], again.body
        assert (await api.call("GET", "/readyz")).status == 200


async def test_a_flag_gone_without_an_acknowledgement_stops_nobody_from_refusing(
    server: RedisServer, gateways: tuple[Api, Api], key_prefix: str, tmp_path: Path
) -> None:
    """Only ``fencegate failover ack`` ends the refusal. A flag that disappears without one
    (a resync or a second failover lost it) is raised again, and the gateways go on refusing."""
    import redis as redis_sync

    a, b = gateways
    assert (await a.put("t1")).status == 201
    snapshot = tmp_path / "aof-before"
    shutil.copytree(server.directory / "appendonlydir", snapshot)
    for n in range(3):
        assert (await a.put(f"t2-{n}")).status == 201
    restart(server, snapshot)
    assert (await first_answer(a, "PUT", "/v1/tasks/t3", {"inputDigest": "x"})) == 503
    assert (await after_restart(b, "GET", "/readyz")).status == 503
    meta = f"{key_prefix}:meta"
    with redis_sync.Redis(port=server.port, decode_responses=True) as direct:
        assert direct.hget(meta, "regressed") is not None
        direct.hdel(meta, "regressed")
        await asyncio.sleep(1.2)  # a refusing gateway looks for the flag once a second
        for api in (a, b):
            refused = await api.call("PUT", "/v1/tasks/t4", {"inputDigest": "x"})
            assert refused.status == 503 and "lost writes" in refused.body["detail"]
            assert (await api.call("GET", "/readyz")).status == 503
        assert direct.hget(meta, "regressed") is not None  # raised again
    operator = build_test_store(make_config(server.url, key_prefix))
    with contextlib.suppress(StoreRegressed):
        await operator.open()
    try:
        await operator.acknowledge_failover()
    finally:
        await operator.close()
    await until(lambda: _ready(a))
    await until(lambda: _ready(b))
    assert (await b.put("t5")).status == 201


async def test_a_transport_closed_under_a_write_is_store_unavailable_not_a_500() -> None:
    """uvloop's "unable to perform operation on <TCPTransport closed=True ...>" came through
    redis-py while it reconnected to a Sentinel's new primary (a failover test answered 500
    INTERNAL): it means the store did not answer. Any other RuntimeError is a bug and stays
    one. No server is needed: the store maps what its driver raised."""
    from fencegate.ledger.errors import StoreUnavailable
    from fencegate.ledger.redis_store import RedisStore
    from fencegate.ledger.tasks import LeasePolicy

    policy = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)
    store = RedisStore("redis://127.0.0.1:1/0", policy, timeout_ms=1000)

    async def closed() -> None:
        raise RuntimeError(
            "unable to perform operation on <TCPTransport closed=True reading=False "
            "0x5581f34dfd40>; the handler is closed"
        )

    async def bug() -> None:
        raise RuntimeError("dictionary changed size during iteration")

    with pytest.raises(StoreUnavailable, match="may or may not have been applied"):
        await store._call(closed)
    with pytest.raises(RuntimeError, match="dictionary changed size"):
        await store._call(bug)
