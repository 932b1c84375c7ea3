"""The Redis Cluster rig (tests.cluster_servers) is a real cluster: keys spread over three
primaries, a replica takes over from a killed (or frozen) primary and redis-py's asyncio
``RedisCluster`` follows it, and a slot migration moves keys that a client reads through
``ASK`` while it runs and through ``MOVED`` after.

The failover checks start a cluster of their own (the session's stays as the other tests
expect it) and wait for the cluster's own failure detection: they are in the slow set.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import MovedError

from tests.cluster_servers import ClusterServers


def cluster_client(cluster: ClusterServers) -> RedisCluster:
    return RedisCluster(
        startup_nodes=[AsyncClusterNode(host, port) for host, port in cluster.startup_nodes],
        decode_responses=True,
    )


@pytest.fixture
async def client(redis_cluster: ClusterServers) -> AsyncIterator[RedisCluster]:
    the_client = cluster_client(redis_cluster)
    yield the_client
    await the_client.aclose()


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[ClusterServers]:
    cluster = ClusterServers(tmp_path / "cluster").start()
    yield cluster
    cluster.stop()


def test_the_rig_is_three_primaries_each_with_a_replica(redis_cluster: ClusterServers) -> None:
    primaries = redis_cluster.primaries()
    assert len(primaries) == 3
    for primary in primaries:
        replica = redis_cluster.replica_of(primary)
        assert replica.info("replication")["master_port"] == primary.port
        assert primary.info("persistence")["aof_enabled"] == 1
    for node in redis_cluster.nodes:
        assert node.cluster_info()["cluster_state"] == "ok"
        assert node.cluster_info()["cluster_slots_ok"] == "16384"
        with node.client() as plain:
            # The bus is on the port the rig picked, not on port + 10000.
            assert plain.config_get("cluster-port")["cluster-port"] == str(node.bus_port)
    assert redis_cluster.url == "redis+cluster://" + ",".join(
        f"127.0.0.1:{node.port}" for node in redis_cluster.nodes
    )


async def test_keys_land_on_every_primary(
    redis_cluster: ClusterServers, client: RedisCluster
) -> None:
    prefix = uuid.uuid4().hex[:12]
    keys = [f"{prefix}:{n}" for n in range(300)]
    for key in keys:
        await client.set(key, key)
    where: dict[str, int] = {}
    for key in keys:
        primary = redis_cluster.primary_for_key(key)
        with primary.client() as plain:
            assert plain.get(key) == key  # held by the primary of its slot, not just anywhere
        where[primary.name] = where.get(primary.name, 0) + 1
    assert len(where) == 3 and min(where.values()) > 50, where
    assert [await client.get(key) for key in keys] == keys


async def test_a_slot_migration_moves_keys_that_a_client_reads_throughout(
    redis_cluster: ClusterServers, client: RedisCluster
) -> None:
    """Half moved, a key still on the source is read there and a moved one through ``ASK``
    (and a new key lands on the target); moved, every key is read through ``MOVED`` by a
    client whose slot table is stale. The slot goes back afterwards."""
    tag = uuid.uuid4().hex[:12]
    keys = [f"{{{tag}}}:{n}" for n in range(250)]
    for key in keys:
        await client.set(key, key)
    slot = redis_cluster.keyslot(keys[0])
    source = redis_cluster.primary_of(slot)
    target = next(node for node in redis_cluster.primaries() if node is not source)

    migration = redis_cluster.migration(slot, target).begin()
    with source.client() as plain:  # earlier tests' keys may share the slot: move ours
        for key in keys[:100]:
            plain.execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 10_000)
        on_source = set(plain.execute_command("CLUSTER GETKEYSINSLOT", slot, 100_000))
    assert on_source & set(keys) == set(keys[100:])
    assert [await client.get(key) for key in keys] == keys
    new = f"{{{tag}}}:new"
    await client.set(new, new)  # not on the source: ASK sends it to the target
    with target.client() as plain:
        assert plain.execute_command("ASKING") and plain.get(new) == new
    keys.append(new)

    while migration.move_keys():
        pass
    migration.finish()
    assert redis_cluster.primary_of(slot) is target
    with target.client() as plain:
        assert set(keys) <= set(plain.execute_command("CLUSTER GETKEYSINSLOT", slot, 100_000))
    with source.client() as plain:
        assert not set(keys) & set(plain.execute_command("CLUSTER GETKEYSINSLOT", slot, 100_000))
    assert [await client.get(key) for key in keys] == keys

    assert redis_cluster.migrate_slot(slot, source) >= len(keys)
    redis_cluster.wait_ok()
    assert [await client.get(key) for key in keys] == keys


async def test_a_manual_failover_swaps_a_primary_and_its_replica(
    redis_cluster: ClusterServers, client: RedisCluster
) -> None:
    """``CLUSTER FAILOVER`` on a replica (no write lost): the client follows the ``MOVED``
    to the new primary; failing over back leaves the rig as it was."""
    key = f"{uuid.uuid4().hex[:12]}:manual"
    await client.set(key, "before")
    primary = redis_cluster.primary_for_key(key)
    replica = redis_cluster.replica_of(primary)
    assert redis_cluster.failover(replica) is primary
    assert redis_cluster.primary_for_key(key) is replica
    assert await client.get(key) == "before"
    await client.set(key, "after")
    with replica.client() as plain:
        assert plain.get(key) == "after"
    assert redis_cluster.failover(primary) is replica
    assert redis_cluster.primary_for_key(key) is primary
    assert await client.get(key) == "after"


@pytest.mark.slow
async def test_a_killed_primary_is_replaced_by_its_replica_and_comes_back_as_one(
    private_cluster: ClusterServers,
) -> None:
    """SIGKILL a primary: its replica takes over its slots, a client made before reads every
    key (written with ``WAIT``, so the replica had them) and writes again; restarted, the old
    primary rejoins as the new primary's replica."""
    cluster = private_cluster
    client = cluster_client(cluster)
    try:
        old = cluster.primaries()[0]
        keys = [f"k{n}" for n in range(300)]
        for key in keys:
            await client.set(key, key)
        for primary in cluster.primaries():
            with primary.client() as plain:
                assert plain.wait(1, 10_000) == 1
        mine = [key for key in keys if cluster.primary_for_key(key) is old]
        assert mine

        assert cluster.kill_primary(old) is old
        new = cluster.wait_promoted(old)
        assert new is not old and new in cluster.primaries()
        assert all(cluster.primary_for_key(key) is new for key in mine)
        assert [await client.get(key) for key in keys] == keys
        await client.set(mine[0], "written after the failover")
        with new.client() as plain:
            assert plain.get(mine[0]) == "written after the failover"

        cluster.restart(old)
        assert old not in cluster.primaries()
        assert cluster.replica_of(new) is old
        with old.client() as plain:
            plain.execute_command("READONLY")
            assert plain.get(mine[0]) == "written after the failover"
    finally:
        await client.aclose()


@pytest.mark.slow
def test_a_frozen_primary_is_failed_over_and_rejoins_when_thawed(
    private_cluster: ClusterServers,
) -> None:
    """SIGSTOP past ``cluster-node-timeout`` is a dead primary to the others; thawed, it
    learns it was replaced and follows its former replica."""
    cluster = private_cluster
    frozen = cluster.primaries()[1]
    heir = cluster.replica_of(frozen)
    frozen.pause()
    try:
        cluster.wait_until(
            lambda: heir.info("replication")["role"] == "master", "the replica to take over"
        )
    finally:
        frozen.resume()
    cluster.wait_ok()
    assert heir in cluster.primaries() and frozen not in cluster.primaries()
    assert cluster.replica_of(heir) is frozen
    with pytest.raises(MovedError), frozen.client() as plain:  # a replica now
        plain.set("x", "1")
