"""The cluster store's connection layer (``ledger.cluster_router``) against a real cluster.

The URL parser is pure. Everything else runs on the rig of tests.cluster_servers: keys of many
slots land on their primaries; a slot migration driven step by step under 50 concurrent
script callers loses no increment and runs none twice (the counters in Redis equal the calls
answered); ASK is followed on one connection even when the importing node has idle pooled
connections (redis-py's ``RedisCluster`` fails that case); TRYAGAIN is waited out within the
timeout; a manual failover is followed (MOVED, then NOSCRIPT on the promoted replica, which
the caller's reload answers); ``each_primary`` reaches every primary. The kill -9 failover
starts a cluster of its own and waits for the cluster's failure detection: it is slow.

The session cluster is left whole: a migrated slot stays with its new primary and a manual
failover swaps roles, which every test reads from the rig rather than assuming.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fencegate.ledger.cluster_router import (
    ClusterOptions,
    ClusterRouter,
    ClusterUnavailable,
    Routed,
    parse_cluster_url,
    slot_of,
)
from tests.cluster_servers import ClusterNode, ClusterServers
from tests.conftest import STORE_TIMEOUT_MS

INCR = "return redis.call('INCR', KEYS[1])"
INCR_SHA = hashlib.sha1(INCR.encode()).hexdigest()
INCR_BOTH = "return {redis.call('INCR', KEYS[1]), redis.call('INCR', KEYS[2])}"


# --- the URL (pure) ---------------------------------------------------------------------------


def test_a_cluster_url_names_its_nodes_user_and_options() -> None:
    nodes, user, options = parse_cluster_url(
        "redis+cluster://fencegate@10.0.0.1:7000,node-b.internal:7001,[::1]:7002,node-c?pipeline=0"
    )
    assert nodes == [
        ("10.0.0.1", 7000),
        ("node-b.internal", 7001),
        ("::1", 7002),
        ("node-c", 6379),
    ]
    assert user == "fencegate"
    assert options == ClusterOptions(tls=False, ssl={}, pipeline=False)
    for database_zero in ("redis+cluster://h:1/", "redis+cluster://h:1/0"):
        assert parse_cluster_url(database_zero) == ([("h", 1)], None, ClusterOptions())


def test_tls_is_rediss_cluster_with_redis_pys_settings() -> None:
    _, _, options = parse_cluster_url(
        "rediss+cluster://h:1?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem&ssl_check_hostname=true"
    )
    assert options.tls
    assert options.connection_kwargs() == {
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": "/etc/ca.pem",
        "ssl_check_hostname": True,
    }


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://h:1", "not a redis+cluster:// url"),
        ("redis+cluster://h:1/1", "a Redis Cluster has only database 0"),
        ("redis+cluster://h:1/0/x", "a Redis Cluster has only database 0"),
        ("redis+cluster://u:secret@h:1", "store.password_env"),
        ("redis+cluster://:secret@h:1", "store.password_env"),
        ("redis+cluster://bad user@h:1", "is not a user name"),
        ("redis+cluster://", "no node is named"),
        ("redis+cluster://h:1,,h2:2", "'' is not HOST:PORT"),
        ("redis+cluster://h:0", "has no valid port"),
        ("redis+cluster://h:65536", "has no valid port"),
        ("redis+cluster://h:port", "has no valid port"),
        ("redis+cluster://h:", "has no valid port"),
        ("redis+cluster://h/x:1", "only database 0"),
        ("redis+cluster://[::1:7000", "is not HOST:PORT"),
        ("redis+cluster://[::1]7000", "is not HOST:PORT"),
        ("redis+cluster://h%20x:1", "is not HOST:PORT"),
        ("redis+cluster://h:1,h:1", "listed twice"),
        ("redis+cluster://h:1?pipeline=2", "pipeline is 0 or 1"),
        ("redis+cluster://h:1?pipeline=1&pipeline=0", "given twice"),
        ("redis+cluster://h:1?db=0", "unknown query parameter 'db'"),
        ("redis+cluster://h:1?ssl_ca_certs=/ca.pem", "use rediss+cluster:// for TLS"),
        ("rediss+cluster://h:1?ssl_cert_reqs=maybe", "ssl_cert_reqs is one of"),
        ("redis+cluster://h:1#frag", "fragment"),
    ],
)
def test_a_malformed_cluster_url_is_refused_saying_why(url: str, says: str) -> None:
    with pytest.raises(ValueError, match="expected redis\\+cluster://") as caught:
        parse_cluster_url(url)
    assert says in str(caught.value)


# --- helpers ----------------------------------------------------------------------------------


@pytest.fixture
async def router(redis_cluster: ClusterServers) -> AsyncIterator[ClusterRouter]:
    the_router = ClusterRouter.from_url(redis_cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    yield the_router
    await the_router.aclose()


def address(node: ClusterNode) -> tuple[str, int]:
    return ("127.0.0.1", node.port)


def tagged(tag: str, count: int) -> list[str]:
    """``count`` keys of one slot (one hash tag)."""
    return [f"{{{tag}}}:{n}" for n in range(count)]


def tag_on(cluster: ClusterServers, node: ClusterNode, name: str) -> str:
    """A fresh hash tag whose slot ``node`` serves now."""
    for n in range(10_000):
        tag = f"{name}-{uuid.uuid4().hex[:8]}-{n}"
        if cluster.primary_of(slot_of(f"{{{tag}}}")) is node:
            return tag
    raise AssertionError(f"no tag found on {node.name}")


class Scripted:
    """INCR by EVALSHA of a script registered with the router, as the store sends its
    scripts: a node that lacks it (a promoted replica) gets it loaded by the router."""

    def __init__(self, router: ClusterRouter) -> None:
        self.router = router
        assert router.register_script(INCR) == INCR_SHA

    async def incr(self, key: str) -> int:
        return int(await self.router.call(key, "EVALSHA", INCR_SHA, 1, key))


class Load:
    """Callers running ``step`` over and over until ``stop``: each answer counted per key,
    each error kept; ``beyond(n)`` waits until ``n`` more calls have been answered."""

    def __init__(self) -> None:
        self.answered: Counter[str] = Counter()
        self.errors: list[BaseException] = []
        self.total = 0
        self._changed = asyncio.Condition()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, callers: int, step: Callable[[int, int], Awaitable[list[str]]]) -> None:
        for caller in range(callers):
            self._tasks.append(asyncio.create_task(self._run(caller, step)))

    async def _run(self, caller: int, step: Callable[[int, int], Awaitable[list[str]]]) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                keys = await step(caller, n)
            except Exception as exc:  # every error is a finding: the test lists them
                self.errors.append(exc)
                keys = []
            async with self._changed:
                self.answered.update(keys)
                self.total += 1
                self._changed.notify_all()
            n += 1

    async def beyond(self, calls: int) -> None:
        target = self.total + calls
        async with self._changed:
            await self._changed.wait_for(lambda: self.total >= target or bool(self.errors))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


# --- routing ----------------------------------------------------------------------------------


async def test_keys_of_many_slots_reach_their_primaries(
    router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    run = uuid.uuid4().hex[:8]
    keys = [f"route-{run}-{n}" for n in range(300)]
    assert len({slot_of(key) for key in keys}) > 250
    for key in keys[:150]:
        assert await router.call(key, "SET", key, key) is True
    replies = await router.pipeline([(key, ("SET", key, key)) for key in keys[150:]])
    assert replies.results == [True] * 150
    assert replies.acked == [None] * 150
    # Each key is on the primary the cluster itself names for its slot: a plain client of
    # that node alone reads it (any other node would answer MOVED).
    primaries = redis_cluster.primaries()
    assert set(router.primaries()) == {address(node) for node in primaries}
    by_node: dict[int, list[str]] = {}
    for key in keys:
        owner = router.primary_of(slot_of(key))
        assert owner is not None
        by_node.setdefault(owner[1], []).append(key)
    assert {port for port in by_node} == {node.port for node in primaries}
    for node in primaries:
        with node.client() as plain:
            assert [plain.get(key) for key in by_node[node.port]] == by_node[node.port]
    for key in keys[:20]:
        assert slot_of(key) == redis_cluster.keyslot(key)
    assert slot_of("{tag}x") == slot_of("{tag}y") == slot_of("tag")
    # Results come back in the order given, across nodes, error replies as values.
    mixed = await router.pipeline(
        [(keys[0], ("GET", keys[0])), (keys[1], ("INCR", keys[1])), (keys[2], ("GET", keys[2]))]
    )
    assert mixed.results[0] == keys[0] and mixed.results[2] == keys[2]
    assert isinstance(mixed.results[1], ResponseError)
    with pytest.raises(ResponseError, match="not an integer"):
        await router.call(keys[1], "INCR", keys[1])


async def test_each_primary_answers_info_and_loads_scripts(
    router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    assert await router.each_primary("CONFIG", "RESETSTAT") == {
        node.address: "OK" for node in redis_cluster.primaries()
    }
    loaded = await router.each_primary("SCRIPT", "LOAD", INCR)
    assert set(loaded.values()) == {INCR_SHA}
    key = f"stats-{uuid.uuid4().hex}"
    for _ in range(3):
        await router.call(key, "EVALSHA", INCR_SHA, 1, key)
    stats = await router.each_primary("INFO", "commandstats")
    owner = redis_cluster.primary_for_key(key)
    assert set(stats) == {node.address for node in redis_cluster.primaries()}
    assert stats[owner.address]["cmdstat_evalsha"]["calls"] == 3
    assert all(
        "cmdstat_evalsha" not in info for node, info in stats.items() if node != owner.address
    )


async def test_noscript_loads_a_registered_script_on_the_node_that_lacks_it(
    router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    node = redis_cluster.primaries()[0]
    keys = tagged(tag_on(redis_cluster, node, "noscript"), 3)
    source = f"return redis.call('INCRBY', KEYS[1], {len(uuid.uuid4().hex)})"  # 32
    sha = hashlib.sha1(source.encode()).hexdigest()
    # Not registered: NOSCRIPT is the caller's (it did not run).
    with pytest.raises(NoScriptError):
        await router.call(keys[0], "EVALSHA", sha, 1, keys[0])
    assert router.register_script(source) == sha
    assert await router.call(keys[0], "EVALSHA", sha, 1, keys[0]) == 32
    assert router.stats.noscript == 1
    await router.each_primary("SCRIPT", "LOAD", source)
    with node.client() as plain:
        plain.script_flush()
    other = f"{{{tag_on(redis_cluster, redis_cluster.primaries()[1], 'other')}}}"
    replies = await router.pipeline(
        [
            (keys[1], ("EVALSHA", sha, 1, keys[1])),
            (other, ("EVALSHA", sha, 1, other)),
            (keys[2], ("GET", keys[2])),
            (keys[1], ("EVALSHA", sha, 1, keys[1])),
        ]
    )
    # Both EVALSHAs to the flushed node got NOSCRIPT in the node's pipeline and were sent
    # again in order, each with its own SCRIPT LOAD; none ran twice.
    assert replies.results == [32, 32, None, 64]
    assert router.stats.noscript == 3
    assert await router.call(keys[0], "GET", keys[0]) == "32"


async def test_a_waited_pipeline_ends_each_written_node_with_wait(
    router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    primaries = redis_cluster.primaries()
    keys = [f"{{{tag_on(redis_cluster, node, 'wait')}}}" for node in primaries]
    replies = await router.pipeline(
        [
            Routed(keys[0], ("SET", keys[0], "1"), writes=True),
            Routed(keys[1], ("GET", keys[1])),
            Routed(keys[2], ("SET", keys[2], "1"), writes=True),
            Routed(keys[2], ("GET", keys[2])),
        ],
        wait=(1, STORE_TIMEOUT_MS),
    )
    assert replies.results == [True, None, True, "1"]
    # Every primary has one replica: WAIT 1 on the connection of the writes answers 1. The
    # node that only read got no WAIT.
    assert replies.acked == [1, None, 1, None]


async def test_a_reply_that_never_came_is_raised_as_may_have_run(
    redis_cluster: ClusterServers,
) -> None:
    """A primary that stops answering (frozen, here for less than the node timeout: no
    failover) with the command sent: the driver's TimeoutError reaches the caller, nothing
    is sent again, and the map is read again before the next call."""
    node = redis_cluster.primaries()[0]
    key = f"{{{tag_on(redis_cluster, node, 'frozen')}}}"
    router = ClusterRouter.from_url(redis_cluster.url, timeout_ms=300)
    try:
        assert await router.call(key, "SET", key, 0) is True  # the connection is open
        refreshes = router.stats.refreshes
        node.pause()
        try:
            with pytest.raises(RedisTimeoutError):
                await router.call(key, "INCR", key)
        finally:
            node.resume()
        # The INCR was in the node's socket: it ran once the node woke up. The router did
        # not send it again (which would make it 2).
        assert await router.call(key, "GET", key) == "1"
        assert router.stats.refreshes == refreshes + 1
    finally:
        await router.aclose()
    redis_cluster.wait_ok()


# --- slot migration ---------------------------------------------------------------------------


async def test_a_slot_migration_under_load_loses_nothing_and_runs_nothing_twice(
    router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    tag = f"mig-{uuid.uuid4().hex[:8]}"
    singles = tagged(tag, 40)
    pairs = [(f"{{{tag}}}:pa{n}", f"{{{tag}}}:pb{n}") for n in range(10)]
    slot = slot_of(singles[0])
    source = redis_cluster.primary_of(slot)
    target = next(node for node in redis_cluster.primaries() if node is not source)
    await router.pipeline([(key, ("SET", key, 0)) for key in [*singles, *sum(pairs, ())]])
    await router.each_primary("SCRIPT", "LOAD", INCR)
    scripted = Scripted(router)

    async def step(caller: int, n: int) -> list[str]:
        if caller < 5:  # a two-key script: TRYAGAIN while the migration splits its keys
            first, second = pairs[(caller * 7 + n) % len(pairs)]
            got = await router.call(first, "EVAL", INCR_BOTH, 2, first, second)
            assert len(got) == 2
            return [first, second]
        key = singles[(caller * 13 + n) % len(singles)]
        await scripted.incr(key)
        return [key]

    load = Load()
    load.start(50, step)
    await load.beyond(200)
    migration = redis_cluster.migration(slot, target)
    await asyncio.to_thread(migration.begin)
    await load.beyond(100)
    while await asyncio.to_thread(migration.move_keys, 7):
        await load.beyond(100)  # keys moved are answered ASK, the others run on the source
    await asyncio.to_thread(migration.finish)
    await load.beyond(200)  # the old map now gets MOVED
    await load.stop()

    assert load.errors == []
    final = await router.pipeline([(key, ("GET", key)) for key in load.answered])
    assert dict(zip(load.answered, map(int, final.results), strict=True)) == dict(load.answered)
    assert router.stats.asked > 0
    assert router.stats.moved > 0
    await router.refresh()
    assert router.primary_of(slot) == address(target)
    ours = {*singles, *sum(pairs, ())}  # earlier tests' keys may share the slot: count ours
    with target.client() as plain:  # every key is on the target, none left behind
        assert ours <= set(plain.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000))
    with source.client() as plain:
        assert not ours & set(plain.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000))


async def test_ask_goes_with_its_command_though_the_target_has_idle_connections(
    router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    """redis-py's ``RedisCluster`` sends ASKING and the command on two checkouts: with two
    idle connections to the target, the command goes without ASKING and never runs."""
    source = redis_cluster.primaries()[0]
    target = redis_cluster.primaries()[1]
    keys = tagged(tag_on(redis_cluster, source, "ask"), 5)
    slot = slot_of(keys[0])
    busy = f"{{{tag_on(redis_cluster, target, 'busy')}}}"
    for key in keys:
        await router.call(key, "SET", key, 0)
    # Open several connections to the target: concurrent calls each take their own.
    await asyncio.gather(*(router.call(busy, "INCR", busy) for _ in range(10)))
    idle = router.client(address(target)).connection_pool._available_connections  # type: ignore[attr-defined]
    assert len(idle) >= 2

    migration = redis_cluster.migration(slot, target)
    await asyncio.to_thread(migration.begin)
    while await asyncio.to_thread(migration.move_keys):  # ours, and any earlier test's
        pass
    with source.client() as plain:
        assert not set(keys) & set(plain.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10_000))
    scripted = Scripted(router)
    for round_ in range(1, 5):
        for key in keys:
            assert await scripted.incr(key) == round_
    assert router.stats.asked == 20
    # The same inside a pipeline, among commands for other nodes and for the source.
    elsewhere = f"{{{tag_on(redis_cluster, redis_cluster.primaries()[2], 'else')}}}"
    replies = await router.pipeline(
        [
            (keys[0], ("INCR", keys[0])),
            (elsewhere, ("SET", elsewhere, "x")),
            (keys[1], ("EVAL", INCR, 1, keys[1])),
            (elsewhere, ("GET", elsewhere)),
        ]
    )
    assert replies.results == [5, True, 5, "x"]
    await asyncio.to_thread(migration.finish)
    assert await scripted.incr(keys[2]) == 5
    assert router.stats.moved >= 1
    assert router.primary_of(slot) == address(target)


async def test_tryagain_is_waited_out_while_a_migration_splits_a_scripts_keys(
    redis_cluster: ClusterServers,
) -> None:
    source = redis_cluster.primaries()[0]
    target = redis_cluster.primaries()[2]
    first, second = tagged(tag_on(redis_cluster, source, "split"), 2)
    slot = slot_of(first)
    router = ClusterRouter.from_url(redis_cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    impatient = ClusterRouter.from_url(redis_cluster.url, timeout_ms=200)
    try:
        await router.pipeline([(first, ("SET", first, 0)), (second, ("SET", second, 0))])
        migration = redis_cluster.migration(slot, target)
        await asyncio.to_thread(migration.begin)
        assert await asyncio.to_thread(migration.move_keys, 1) == 1  # one key of the two
        # Split for longer than its timeout: it gives up, and the script did not run.
        with pytest.raises(ClusterUnavailable, match=r"TRYAGAIN.*did not run"):
            await impatient.call(first, "EVAL", INCR_BOTH, 2, first, second)
        call = asyncio.create_task(router.call(first, "EVAL", INCR_BOTH, 2, first, second))
        while router.stats.tryagain == 0:  # until the call has met the split
            await asyncio.sleep(0.01)
        assert not call.done()
        assert await asyncio.to_thread(migration.move_keys, 1) == 1
        assert await call == [1, 1]
        await asyncio.to_thread(migration.finish)
        assert await router.call(first, "MGET", first, second) == ["1", "1"]  # once, not twice
    finally:
        await router.aclose()
        await impatient.aclose()


# --- failover ---------------------------------------------------------------------------------


async def test_a_manual_failover_is_followed(
    router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    primary = redis_cluster.primaries()[1]
    keys = tagged(tag_on(redis_cluster, primary, "failover"), 20)
    await router.pipeline([(key, ("SET", key, 0)) for key in keys])
    await router.each_primary("SCRIPT", "LOAD", INCR)
    scripted = Scripted(router)

    async def step(caller: int, n: int) -> list[str]:
        key = keys[(caller + n) % len(keys)]
        await scripted.incr(key)
        return [key]

    load = Load()
    load.start(20, step)
    await load.beyond(200)
    replica = redis_cluster.replica_of(primary)
    await asyncio.to_thread(redis_cluster.failover, replica)
    await load.beyond(200)
    await load.stop()

    assert load.errors == []
    final = await router.pipeline([(key, ("GET", key)) for key in keys])
    assert [int(value) for value in final.results] == [load.answered[key] for key in keys]
    assert router.stats.moved > 0
    # Scripts are not replicated: the promoted replica answered NOSCRIPT, and the router
    # loaded the script there (a SCRIPT LOAD of the caller's, having no key to be redirected
    # by, could still reach the former primary while the map was stale).
    assert router.stats.noscript > 0
    assert router.primary_of(slot_of(keys[0])) == address(replica)


@pytest.fixture
def private_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    cluster = ClusterServers(tmp_path / "cluster", full_coverage=request.param).start()
    yield cluster
    cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("private_cluster", [False, True], indirect=True, ids=["partial", "full"])
async def test_a_killed_primary_fails_fast_until_its_replica_takes_over(
    private_cluster: ClusterServers,
) -> None:
    """kill -9 of a primary: its slots answer ``ClusterUnavailable`` (nothing was sent: the
    node refuses connections) until its replica is promoted, then work. The other
    primaries' slots keep working with ``cluster-require-full-coverage no``; with the
    default (yes) they answer ``ClusterUnavailable`` (CLUSTERDOWN, not run) while the
    cluster is in the fail state, and nothing else."""
    cluster = private_cluster
    full_coverage = cluster.nodes[0].full_coverage
    doomed, *others = cluster.primaries()
    dead_key = f"{{{tag_on(cluster, doomed, 'dead')}}}"
    live_keys = [f"{{{tag_on(cluster, node, 'live')}}}" for node in others]
    router = ClusterRouter.from_url(cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    try:
        for key in [dead_key, *live_keys]:
            assert await router.call(key, "INCR", key) == 1
        old = await asyncio.to_thread(cluster.kill_primary, doomed)
        promoted = asyncio.create_task(asyncio.to_thread(cluster.wait_promoted, old))
        dead: list[object] = []
        live: list[object] = []
        while not promoted.done():
            for outcomes, key in [(dead, dead_key), *((live, key) for key in live_keys)]:
                try:
                    outcomes.append(await router.call(key, "INCR", key))
                except (ClusterUnavailable, RedisConnectionError, TimeoutError) as exc:
                    outcomes.append(exc)
            await asyncio.sleep(0.02)  # pacing only: the loop ends on the promotion
        heir = await promoted

        failures = [o for o in dead if isinstance(o, BaseException)]
        assert failures, "the dead primary's slot never failed"
        assert all(isinstance(o, ClusterUnavailable) for o in failures), failures
        assert "did not run" in str(failures[0])
        assert await router.call(dead_key, "INCR", dead_key) >= 2
        assert router.primary_of(slot_of(dead_key)) == address(heir)
        live_failures = [o for o in live if isinstance(o, BaseException)]
        if full_coverage:
            assert all(isinstance(o, ClusterUnavailable) for o in live_failures), live_failures
        else:
            assert live_failures == []
        for key in live_keys:
            assert isinstance(await router.call(key, "INCR", key), int)
    finally:
        await router.aclose()
