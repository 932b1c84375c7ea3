"""One bucket of the Redis Cluster store: an unchanged ``RedisStore`` over ``RoutedRedis``.

Against the real cluster of tests.cluster_servers. A bucket view (key prefix
``<prefix>:{<prefix>.b7}``) runs the single-task flows of the store's tests (put, claim, renew,
a fenced prepare and complete, the replay, commit, cancel, a dependency chain in one group,
the change feed) with their helpers; every key it wrote hashes to the bucket's slot; a
migration of that slot under 20 concurrent fenced callers, and a manual failover of its
primary mid-load, lose no effect and run none twice (the downstream stand-in is the effect
records: one attempt each, each forwarded once); replies are parsed as redis-py parses them;
``min_replicas`` WAITs on the bucket's own node; a transaction runs on the bucket's node.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from fencegate.ledger.buckets import bucket_tag
from fencegate.ledger.cluster_client import RoutedRedis
from fencegate.ledger.cluster_router import ClusterRouter, slot_of
from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import Cancelled, StoreUnavailable
from fencegate.ledger.queries import TaskFilter
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import LeasePolicy, RenewRequest, Task, TaskState
from tests.api import until
from tests.cluster_servers import ClusterNode, ClusterServers
from tests.conftest import DEFAULT_MAX_RUNTIME_MS, MAX_TTL_MS, STORE_TIMEOUT_MS
from tests.test_task_flow import claim_as, commit_of, identity_of

POLICY = LeasePolicy(max_ttl_ms=MAX_TTL_MS, default_max_runtime_ms=DEFAULT_MAX_RUNTIME_MS)
BUCKET = 7
DEADLINE_MS = 60_000

MakeView = Callable[..., RedisStore]


@pytest.fixture
async def router(redis_cluster: ClusterServers) -> AsyncIterator[ClusterRouter]:
    the_router = ClusterRouter.from_url(redis_cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    yield the_router
    await the_router.aclose()


@pytest.fixture
async def make_view(
    redis_cluster: ClusterServers, router: ClusterRouter, key_prefix: str
) -> AsyncIterator[MakeView]:
    """Bucket views of one store (prefix ``key_prefix``) over the router; closed at the end."""
    views: list[RedisStore] = []

    def make(bucket: int = BUCKET, **options: Any) -> RedisStore:
        slot_key = "{" + bucket_tag(key_prefix, bucket) + "}"
        view = RedisStore(
            redis_cluster.url,
            POLICY,
            timeout_ms=STORE_TIMEOUT_MS,
            key_prefix=f"{key_prefix}:{slot_key}",
            client=RoutedRedis(router, slot_key),  # type: ignore[arg-type]
            cluster_slot_key=slot_key,
            **options,
        )
        views.append(view)
        return view

    yield make
    for view in views:
        await view.close()


def bucket_slot(key_prefix: str) -> int:
    return slot_of("{" + bucket_tag(key_prefix, BUCKET) + "}")


def effect_request(task: Task, slot: str) -> EffectRequest:
    assert task.attempt_id is not None and task.claim_epoch is not None
    fence = Fence(
        task.task_id, task.attempt_id, task.claim_generation, task.claim_epoch,
        task.cancel_generation,
    )  # fmt: skip
    return EffectRequest(fence, "node", slot, "pay", "POST", "/pay", "d" * 64)


def keys_of_prefix(cluster: ClusterServers, key_prefix: str) -> dict[str, int]:
    """Every key under ``key_prefix`` on every primary (SCAN each), by the port holding it."""
    found: dict[str, int] = {}
    for node in cluster.primaries():
        with node.client() as client:
            for key in client.scan_iter(match=f"{key_prefix}:*", count=1000):
                found[str(key)] = node.port
    return found


# --- the flows ----------------------------------------------------------------------------


async def test_a_bucket_view_runs_the_task_flows_and_keeps_its_keys_in_its_slot(
    make_view: MakeView, redis_cluster: ClusterServers, key_prefix: str
) -> None:
    store = make_view()
    await store.open()
    _, start = await store.read_events(None, 100)

    # put, claim, renew, a fenced call (prepare, complete, replay), commit.
    created, outcome = await store.put_task("order-1::charge", "in-1", None)
    assert created.state is TaskState.READY and str(outcome) == "CREATED"
    task = await store.claim("order-1::charge", claim_as("w1"))
    assert task.state is TaskState.CLAIMED and task.claim_generation == 1
    renewed = await store.renew(
        "order-1::charge", RenewRequest(identity=identity_of(task), ttl_ms=20_000)
    )
    assert renewed.lease_expires_at is not None
    prepared = await store.prepare_effect(effect_request(task, "s1"), DEADLINE_MS)
    assert prepared.action is Action.FORWARD
    assert task.attempt_id is not None
    done, applied = await store.complete_effect(
        "order-1::charge", prepared.effect.effect_id, prepared.seq, task.attempt_id,
        EffectState.COMMITTED, "200", '{"status":200,"headers":[],"body":"ok"}',
    )  # fmt: skip
    assert applied and done.state is EffectState.COMMITTED
    replay = await store.prepare_effect(effect_request(task, "s1"), DEADLINE_MS)
    assert replay.action is Action.REPLAY
    assert (await store.get_effect(prepared.effect.effect_id)).state is EffectState.COMMITTED
    committed, again = await store.commit("order-1::charge", commit_of(task, "out-1"))
    assert committed.state is TaskState.COMMITTED and not again
    assert (await store.commit("order-1::charge", commit_of(task, "out-1")))[1]

    # A dependency chain in one group: the dependent waits, then is READY after the commit.
    await store.put_task("order-2::charge", "in", None)
    waiting, _ = await store.put_task("order-2::email", "in", None, depends_on=("order-2::charge",))
    assert waiting.state is TaskState.WAITING
    first = await store.claim("order-2::charge", claim_as("w2"))
    await store.commit("order-2::charge", commit_of(first, "out"))
    assert (await store.get_task("order-2::email")).state is TaskState.READY

    # cancel fences the holder.
    await store.put_task("order-3", "in", None)
    held = await store.claim("order-3", claim_as("w3"))
    assert (await store.cancel("order-3")).state is TaskState.CANCELLED
    with pytest.raises(Cancelled):
        await store.commit("order-3", commit_of(held, "out"))

    # The change feed of the bucket says it all, in order; reads are parsed as redis-py's.
    events, _ = await store.read_events(start, 100)
    kinds = Counter(event.body["type"] for event in events)
    assert kinds["effect"] == 2 and kinds["task"] >= 10
    listed, _ = await store.list_tasks(TaskFilter(), 100, None)
    assert {t.task_id for t in listed} == {
        "order-1::charge", "order-2::charge", "order-2::email", "order-3",
    }  # fmt: skip
    assert isinstance(await store.now_ms(), int)
    assert await store.durability() == []

    # Every key of the view is in the bucket's slot.
    written = keys_of_prefix(redis_cluster, key_prefix)
    assert len(written) > 10
    assert {slot_of(key) for key in written} == {bucket_slot(key_prefix)}
    assert set(written.values()) == {redis_cluster.primary_of(bucket_slot(key_prefix)).port}


async def test_the_tasks_backfill_scans_every_primary_for_the_buckets_keys_only(
    make_view: MakeView, router: ClusterRouter, key_prefix: str
) -> None:
    """SCAN walks every primary (a slot being migrated has keys on two) and keeps the view's
    slot's keys: the index back-fill finds a task hash nobody indexed."""
    store = make_view()
    other = make_view(bucket=BUCKET + 1)
    await store.open()
    await store.put_task("a", "in", None)
    await other.put_task("b", "in", None)
    view = store._keys
    client = RoutedRedis(router, "{" + bucket_tag(key_prefix, BUCKET) + "}")
    await client.hset(view.task("legacy"), mapping={"task_id": "legacy"})
    seen: list[str] = []
    cursor: Any = 0
    visited = 0
    while True:
        cursor, keys = await client.scan(cursor, match=f"{key_prefix}:*", count=10)
        seen.extend(keys)
        visited += 1
        if int(cursor) == 0:
            break
    assert visited >= len(router.primaries())
    assert set(seen) >= {view.task("a"), view.task("legacy")}
    assert all(slot_of(key) == bucket_slot(key_prefix) for key in seen)
    await store._index_old_tasks()
    assert await client.zscore(view.tasks_index, "legacy") == 0


async def test_replies_are_parsed_as_redis_py_parses_them(
    make_view: MakeView, router: ClusterRouter, key_prefix: str
) -> None:
    slot_key = "{" + bucket_tag(key_prefix, BUCKET) + "}"
    client = RoutedRedis(router, slot_key)
    key = f"{key_prefix}:{slot_key}:h"
    await client.hset(key, mapping={"a": "1", "b": "2"})
    assert await client.hgetall(key) == {"a": "1", "b": "2"}
    assert await client.hmget(key, ["a", "zz"]) == ["1", None]
    sec, usec = await client.time()
    assert isinstance(sec, int) and isinstance(usec, int)
    assert (await client.info("server"))["redis_mode"] == "cluster"
    assert "appendonly" in await client.config_get("appendonly")
    assert await client.ping() is True
    zkey = f"{key_prefix}:{slot_key}:z"
    await client.zadd(zkey, {"x": 1, "y": 2})
    assert await client.zrangebyscore(zkey, "-inf", "+inf", withscores=True) == [
        ("x", 1.0),
        ("y", 2.0),
    ]
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(key)
        pipe.time()
        pipe.exists(key, zkey)
        pipe.execute_command("HGET", key, "a")
        got = await pipe.execute()
    assert got[0] == {"a": "1", "b": "2"} and isinstance(got[1], tuple)
    assert got[2:] == [2, "1"]
    pipe = client.pipeline(transaction=True)
    pipe.hincrby(key, "acks", 1)
    pipe.hdel(key, "a")
    pipe.hgetall(key)
    assert await pipe.execute() == [1, 1, {"b": "2", "acks": "1"}]
    bad = client.pipeline(transaction=False)
    bad.execute_command("HGET", key)  # wrong arity: an error reply
    with pytest.raises(Exception, match="of pipeline caused error"):
        await bad.execute()


# --- under a moving cluster ---------------------------------------------------------------


async def _fenced_load(
    store: RedisStore, callers: int, calls: int, event: asyncio.Event
) -> tuple[Counter[str], list[BaseException]]:
    """``callers`` coroutines, each with a task of its own in one group, running ``calls``
    fenced calls (prepare, then complete) on distinct effects until ``event`` is set and
    they are done; the FORWARD answers per effect id, and what failed."""
    forwarded: Counter[str] = Counter()
    errors: list[BaseException] = []

    async def caller(n: int) -> None:
        task_id = f"load::{n}"
        await store.put_task(task_id, "in", None)
        task = await store.claim(task_id, claim_as(f"w{n}"))
        assert task.attempt_id is not None
        k = 0
        while k < calls or not event.is_set():
            request = effect_request(task, f"s{k}")
            k += 1
            try:
                prepared = await store.prepare_effect(request, DEADLINE_MS)
                assert prepared.action is Action.FORWARD
                forwarded[prepared.effect.effect_id] += 1
                await store.complete_effect(
                    task_id, prepared.effect.effect_id, prepared.seq, task.attempt_id,
                    EffectState.COMMITTED, "200", None,
                )  # fmt: skip
            except StoreUnavailable as exc:
                errors.append(exc)

    await asyncio.gather(*(caller(n) for n in range(callers)))
    return forwarded, errors


async def _check_records(store: RedisStore, forwarded: Counter[str]) -> None:
    """The downstream stand-in: every effect forwarded once, recorded COMMITTED, one attempt."""
    assert forwarded and max(forwarded.values()) == 1
    for effect_id in forwarded:
        effect = await store.get_effect(effect_id)
        assert effect.state is EffectState.COMMITTED
        assert len(effect.attempts) == 1


async def test_a_migration_of_the_buckets_slot_under_load_loses_nothing_runs_nothing_twice(
    make_view: MakeView, redis_cluster: ClusterServers, router: ClusterRouter, key_prefix: str
) -> None:
    store = make_view()
    await store.open()
    slot = bucket_slot(key_prefix)
    source = redis_cluster.primary_of(slot)
    target = next(n for n in redis_cluster.primaries() if n is not source)
    done = asyncio.Event()
    load = asyncio.create_task(_fenced_load(store, 20, 5, done))
    await _until_effects(store, 40)
    migration = redis_cluster.migration(slot, target)
    await asyncio.to_thread(migration.begin)
    while await asyncio.to_thread(migration.move_keys, 5):
        await asyncio.sleep(0.01)  # the callers run between batches: ASK, TRYAGAIN
    await asyncio.to_thread(migration.finish)
    # And after it: MOVED. The callers have run on after the move (counted, not a sleep a
    # loaded machine outlasts) before they are told to stop.
    assert store.pipeline is not None
    moved_at = store.pipeline.calls
    await until(
        lambda: load.done() or store.pipeline is None or store.pipeline.calls >= moved_at + 40,
        "40 store calls after the move",
    )
    done.set()
    forwarded, errors = await load
    assert errors == []
    await _check_records(store, forwarded)
    assert router.stats.asked + router.stats.moved > 0
    assert set(keys_of_prefix(redis_cluster, key_prefix).values()) == {target.port}


async def _until_effects(store: RedisStore, count: int) -> None:
    while store.pipeline is not None and store.pipeline.calls < count:
        await asyncio.sleep(0.01)


async def test_a_manual_failover_mid_load_loses_nothing_runs_nothing_twice(
    make_view: MakeView, redis_cluster: ClusterServers, key_prefix: str
) -> None:
    store = make_view()
    await store.open()
    primary = redis_cluster.primary_of(bucket_slot(key_prefix))
    replica = redis_cluster.replica_of(primary)
    done = asyncio.Event()
    load = asyncio.create_task(_fenced_load(store, 20, 5, done))
    await _until_effects(store, 40)
    await asyncio.to_thread(redis_cluster.failover, replica)
    await asyncio.sleep(0.2)
    done.set()
    forwarded, errors = await load
    # A manual failover loses no write: a call is answered or refused "may have been
    # applied", never run twice, and every answered FORWARD is on its record.
    assert all("may" in str(exc) or "nothing was applied" in str(exc) for exc in errors)
    await _check_records(store, forwarded)
    assert redis_cluster.primary_of(bucket_slot(key_prefix)) is replica


def _waits(node: ClusterNode) -> int:
    stats = node.info("commandstats")
    entry: Any = stats.get("cmdstat_wait", {"calls": 0})
    return int(entry["calls"])


async def test_min_replicas_waits_on_the_buckets_own_node(
    make_view: MakeView, redis_cluster: ClusterServers, key_prefix: str
) -> None:
    store = make_view(min_replicas=1, replica_timeout_ms=STORE_TIMEOUT_MS // 2)
    await store.open()
    own = redis_cluster.primary_of(bucket_slot(key_prefix))
    others = [n for n in redis_cluster.primaries() if n is not own]
    before = {node.port: _waits(node) for node in redis_cluster.primaries()}
    tasks = [f"w::{uuid.uuid4().hex[:6]}" for _ in range(5)]
    await asyncio.gather(*(store.put_task(t, "in", None) for t in tasks))
    claimed = await asyncio.gather(*(store.claim(t, claim_as("w")) for t in tasks))
    assert all(task.state is TaskState.CLAIMED for task in claimed)
    assert _waits(own) > before[own.port]
    assert all(_waits(node) == before[node.port] for node in others)
