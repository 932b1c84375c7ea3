"""Concurrency through real gateway processes: one winner per claim race, never a reused token.

The gateways are ``fencegate serve`` subprocesses (``tests/servers.py``) configured by TOML
files, as an operator runs them; two of them share one Redis or one PostgreSQL, the way a
fleet does. Lease expiry here is real store time (short TTLs), since a separate process has
no test clock to advance: a worker paused past its lease sleeps longer than the TTL (a sleep
only ever runs long), or waits until another worker took its task over.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from tests.api import Api, Lease
from tests.cluster_servers import ClusterServers
from tests.postgres_server import PostgresServer
from tests.servers import GatewayProcess, Gateways, RedisServer

CONTENDERS = 50
#: store.timeout_ms of the gateways: generous, so that fifty claims queued for a loaded
#: store's connections are answered, never 503 by the clock alone.
STORE_TIMEOUT_MS = 20_000


@pytest.fixture(
    scope="module",
    # The cluster (three primaries, three replicas; its queue claims go through the queues'
    # hints, ledger/cluster_store.py) is in the slow set: the default suite has no time left.
    params=["redis", "postgres", pytest.param("cluster", marks=pytest.mark.slow)],
)
def shared_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    """Two gateways on one shared store (the session Redis or Redis Cluster under a fresh key
    prefix, or a fresh database on the session PostgreSQL); each test uses its own task."""
    group = Gateways(tmp_path_factory.mktemp("pair"))
    prefix = f"t{uuid.uuid4().hex[:12]}"
    if request.param == "redis":
        url = cast(RedisServer, request.getfixturevalue("redis_server")).url
    elif request.param == "cluster":
        url = cast(ClusterServers, request.getfixturevalue("redis_cluster")).url
    else:
        postgres = cast(PostgresServer, request.getfixturevalue("postgres_server"))
        url = postgres.create_database(prefix)
    try:
        yield (
            group.start("gw1", url, key_prefix=prefix, timeout_ms=STORE_TIMEOUT_MS),
            group.start("gw2", url, key_prefix=prefix, timeout_ms=STORE_TIMEOUT_MS),
        )
    finally:
        group.stop_all()
        if request.param == "postgres":
            postgres.drop_database(prefix)


def http_api(session: aiohttp.ClientSession) -> Api:
    """``tests.api.Api`` over a plain client session (``base_url`` = one gateway)."""
    return Api(cast(Any, session))


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


async def claim_race(
    session: aiohttp.ClientSession, urls: list[str], task_id: str, epoch: int
) -> list[tuple[str, int, dict[str, Any]]]:
    """CONTENDERS claims at once, spread round-robin over ``urls``: (owner, status, body)."""
    start = asyncio.Event()
    parked: list[int] = []
    all_parked = asyncio.Event()

    async def contender(i: int) -> tuple[str, int, dict[str, Any]]:
        owner = f"worker-{i}"
        body = {"owner": owner, "ttlMs": 30_000, "schedulerEpoch": epoch}
        parked.append(i)
        if len(parked) == CONTENDERS:
            all_parked.set()
        await start.wait()
        async with session.post(f"{urls[i % len(urls)]}/v1/tasks/{task_id}/claim", json=body) as r:
            return owner, r.status, await r.json(content_type=None)

    racers = [asyncio.create_task(contender(i)) for i in range(CONTENDERS)]
    await all_parked.wait()  # every contender is parked on the event
    start.set()
    return await asyncio.gather(*racers)


def assert_one_winner(
    answers: list[tuple[str, int, dict[str, Any]]],
) -> tuple[str, dict[str, Any]]:
    statuses = Counter(status for _, status, _ in answers)
    assert statuses == {200: 1, 409: CONTENDERS - 1}, statuses
    refused = Counter(body["code"] for _, status, body in answers if status == 409)
    assert refused == {"CLAIMED": CONTENDERS - 1}, refused
    ((owner, _, body),) = [a for a in answers if a[1] == 200]
    return owner, body


async def test_fifty_claims_through_two_gateways_on_one_shared_store_have_one_winner(
    shared_pair: tuple[GatewayProcess, GatewayProcess],
) -> None:
    gw1, gw2 = shared_pair
    connector = aiohttp.TCPConnector(limit=2 * CONTENDERS)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.put(f"{gw1.url}/v1/tasks/race-1", json={"inputDigest": "in-1"}) as r:
            assert r.status == 201
        answers = await claim_race(session, [gw1.url, gw2.url], "race-1", epoch=1)
        owner, won = assert_one_winner(answers)
        assert won["claimGeneration"] == 1
        # Both gateways see the same single holder.
        for url in (gw1.url, gw2.url):
            async with session.get(f"{url}/v1/tasks/race-1") as r:
                record = await r.json()
            assert record["state"] == "CLAIMED"
            assert record["owner"] == owner
            assert record["attemptId"] == won["attemptId"]
            assert record["claimGeneration"] == 1


async def test_generations_strictly_increase_across_two_gateways(
    shared_pair: tuple[GatewayProcess, GatewayProcess],
) -> None:
    gw1, gw2 = shared_pair
    async with (
        aiohttp.ClientSession(base_url=gw1.url) as s1,
        aiohttp.ClientSession(base_url=gw2.url) as s2,
    ):
        apis = [http_api(s1), http_api(s2)]
        assert (await apis[0].put("gen-1")).status == 201
        leases: list[Lease] = []
        for i in range(8):
            here, there = apis[i % 2], apis[(i + 1) % 2]
            by_expiry = i % 2 == 1
            answer = await here.try_claim(
                "gen-1", owner=f"w{i}", ttl_ms=200 if by_expiry else 30_000, epoch=1
            )
            assert answer.status == 200, answer.body
            leases.append(lease_from(f"w{i}", answer.body))
            if by_expiry:
                # The worker pauses past its 200 ms lease (the scenario, in store time: the
                # lease started before this sleep did, and a sleep only ever runs long).
                await asyncio.sleep(0.3)
            else:
                # The other gateway sees this claim at once: the task is held...
                refused = await there.try_claim("gen-1", owner="intruder", epoch=1)
                assert refused.status == 409 and refused.code == "CLAIMED", refused.body
                # ...and the holder can hand it back through it.
                assert (await there.release(leases[-1])).status == 200
        generations = [lease.claim_generation for lease in leases]
        assert generations == list(range(1, len(leases) + 1)), generations
        assert len({lease.attempt_id for lease in leases}) == len(leases)
        # Every earlier attempt is fenced on both gateways; the latest one commits.
        for lease in leases[:-1]:
            for api in apis:
                assert (await api.commit(lease)).code == "FENCED"
                assert (await api.renew(lease)).code == "FENCED"
        # The last claim was by expiry (i = 7), so its lease has run out: commit ignores the
        # clock as long as nobody claimed since.
        done = await apis[0].commit(leases[-1])
        assert done.status == 200 and done.body["outcome"] == "COMMITTED"
        record = (await apis[1].get("gen-1")).body
        assert record["commit"]["claimGeneration"] == len(leases)
        assert record["commit"]["attemptId"] == leases[-1].attempt_id


async def test_fifty_claims_through_one_gateway_on_sqlite_have_one_winner(
    gateways: Gateways, tmp_path: Path
) -> None:
    gw = gateways.start("gw", f"sqlite:///{tmp_path / 'race.db'}", timeout_ms=STORE_TIMEOUT_MS)
    connector = aiohttp.TCPConnector(limit=2 * CONTENDERS)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.put(f"{gw.url}/v1/tasks/race-1", json={"inputDigest": "in-1"}) as r:
            assert r.status == 201
        answers = await claim_race(session, [gw.url], "race-1", epoch=1)
        owner, won = assert_one_winner(answers)
        assert won["claimGeneration"] == 1
        async with session.get(f"{gw.url}/v1/tasks/race-1") as r:
            record = await r.json()
        assert record["owner"] == owner
        assert record["attemptId"] == won["attemptId"]
        assert record["claimGeneration"] == 1


async def test_twenty_workers_drain_one_queue_through_two_gateways(
    shared_pair: tuple[GatewayProcess, GatewayProcess],
) -> None:
    """200 tasks in one queue, 20 workers on two gateways. Every 7th claim a worker pauses
    past its lease before committing: until the lease ran out and another worker took the
    task over and committed it (at most half the workers pause at once, so the others are
    there to take over). Each task ends with exactly one accepted commit, every paused
    worker's commit is fenced, and no two claims of one task were ever live at the same time
    (store time: a claim starts after the previous one's lease ran out)."""
    gw1, gw2 = shared_pair
    queue = f"drain-{uuid.uuid4().hex[:8]}"
    ttl = 1_500
    tasks = [f"{queue}-{i:03d}" for i in range(200)]
    claims: dict[str, list[dict[str, Any]]] = {t: [] for t in tasks}
    accepted: Counter[str] = Counter()
    fenced = 0
    pauses = 0  # pauses that ended in a takeover
    pausing = 0  # workers paused now
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i, task_id in enumerate(tasks):
            url = (gw1.url, gw2.url)[i % 2]
            body = {"inputDigest": "in", "queue": queue, "priority": i % 4}
            async with session.put(f"{url}/v1/tasks/{task_id}", json=body) as r:
                assert r.status == 201, await r.text()

        async def taken_over_and_committed(url: str, claim: dict[str, Any]) -> None:
            """Return once another claim of ``claim``'s task committed it (long-polls)."""
            while True:
                async with session.get(
                    f"{url}/v1/tasks/{claim['taskId']}", params={"waitFor": "COMMITTED"}
                ) as r:
                    assert r.status == 200, await r.text()
                    record = await r.json()
                if record["state"] == "COMMITTED":
                    assert record["commit"]["claimGeneration"] > claim["claimGeneration"]
                    return

        async def worker(n: int) -> None:
            nonlocal fenced, pauses, pausing
            url = (gw1.url, gw2.url)[n % 2]
            mine = 0
            while sum(accepted.values()) < len(tasks):
                body = {"owner": f"w{n}", "ttlMs": ttl, "schedulerEpoch": 1}
                async with session.post(f"{url}/v1/queues/{queue}/claim", json=body) as r:
                    if r.status == 204:
                        # The rest are held, some by paused workers: ask again (a poll's
                        # interval; the loop ends on the commits, not on a time).
                        await asyncio.sleep(0.1)
                        continue
                    assert r.status == 200, await r.text()
                    claim = await r.json()
                claims[claim["taskId"]].append(claim)
                mine += 1
                if mine % 7 == 0 and pausing < 10:
                    # Paused past the lease until the store let another worker take the task
                    # over, and that one committed it.
                    pausing += 1
                    try:
                        await taken_over_and_committed(url, claim)
                    finally:
                        pausing -= 1
                    pauses += 1
                commit = {
                    "attemptId": claim["attemptId"],
                    "claimGeneration": claim["claimGeneration"],
                    "schedulerEpoch": claim["schedulerEpoch"],
                    "cancelGeneration": claim["cancelGeneration"],
                    "inputDigest": "in",
                    "resultDigest": f"by-w{n}",
                }
                async with session.post(
                    f"{url}/v1/tasks/{claim['taskId']}/commit", json=commit
                ) as r:
                    answer = await r.json()
                    if r.status == 200:
                        assert answer["outcome"] != "REPLAYED"
                        accepted[claim["taskId"]] += 1
                    else:
                        assert (r.status, answer["code"]) == (409, "FENCED"), answer
                        fenced += 1

        async with asyncio.timeout(120):
            await asyncio.gather(*(worker(n) for n in range(20)))
        assert set(accepted) == set(tasks) and set(accepted.values()) == {1}
        taken_over = 0
        for task_id, held in claims.items():
            held.sort(key=lambda c: c["claimGeneration"])
            assert [c["claimGeneration"] for c in held] == list(range(1, len(held) + 1))
            for before, after in itertools.pairwise(held):
                started = after["leaseExpiresAt"] - after["grantedTtlMs"]
                assert started >= before["leaseExpiresAt"], (task_id, before, after)
                taken_over += 1
        # Every pause lost its lease (the first worker to reach its 7th claim, at the least,
        # found nobody paused).
        assert taken_over >= fenced >= pauses > 0
