"""Issue 30, cheaper scripts: a new leased effect's creation-index entries wait in a list.

At format 3, ``prepare.lua``'s lean path (a new effect forwarded at once, the common case)
writes the record, the prepared index, its change-feed entry and one list push, and leaves the
three creation indexes (the effects index by creation, the effectId -> taskId directory, the
effect ids index) to ``index_catch_up.lua``, which pops many entries and adds them at once.
What a user relies on: an effect is found the moment its prepare answered, by id, by listing,
by prefix and in the stats, through any gateway; no retention run, crash or concurrent
catch-up loses or resurrects an entry; and a store still at format 2 (older gateways may be
serving) is indexed in the step, as those gateways expect, until ``store migrate`` records
format 3.

The background catch-up's lag timer is set far off in each test (``quiet``), so what the
tests see never depends on how fast this machine runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
import redis

from fencegate.ledger import redis_store
from fencegate.ledger.buckets import bucket_of_task
from fencegate.ledger.cluster_store import ClusterStore, SingleRedisBackend
from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import NoSuchEffect, StoreRegressed, StoreUnavailable
from fencegate.ledger.keys import Keys
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy, Task
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
KEYS = Keys("fg")


@pytest.fixture(autouse=True)
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """No background catch-up during a test: only readers (and explicit calls) run it."""
    monkeypatch.setattr(redis_store, "_CATCH_UP_AFTER_S", 3600.0)
    monkeypatch.setattr(redis_store, "_CATCH_UP_AFTER_EFFECTS", 10**9)


@pytest.fixture
def server(make_redis_server: Callable[..., RedisServer]) -> RedisServer:
    return make_redis_server()


@pytest.fixture
def admin(server: RedisServer) -> redis.Redis:
    return server.client()


async def _opened(server: RedisServer) -> RedisStore:
    store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    return store


@pytest.fixture
async def store(server: RedisServer) -> AsyncIterator[RedisStore]:
    the_store = await _opened(server)
    yield the_store
    await the_store.close()


async def _claimed(store: RedisStore, task_id: str) -> Task:
    await store.put_task(task_id, "in", None)
    return await store.claim(task_id, ClaimRequest("w", 60_000, 1))


async def _prepared(store: RedisStore, task: Task, slot: str) -> str:
    """A new effect through the lean path (its task's revision is known from the claim)."""
    assert task.attempt_id is not None
    fence = Fence(task.task_id, task.attempt_id, task.claim_generation, task.claim_epoch or 1, 0)
    request = EffectRequest(fence, "node", slot, "pay", "POST", "/pay", "d" * 64)
    outcome = await store.prepare_effect(request, 30_000)
    assert outcome.action is Action.FORWARD
    return outcome.effect.effect_id


def _indexed(admin: redis.Redis, effect_id: str) -> tuple[bool, bool, bool]:
    """Whether each creation index holds the effect: (by creation, directory, ids)."""
    by_creation = any(
        member.split(":")[1] == effect_id for member in admin.zrange(KEYS.effects_index, 0, -1)
    )
    return (
        by_creation,
        admin.hget(KEYS.effect_tasks, effect_id) is not None,
        admin.zscore(KEYS.effect_ids, effect_id) is not None,
    )


async def test_the_step_leaves_the_indexes_to_the_feed_and_any_reader_finds_it_at_once(
    server: RedisServer, admin: redis.Redis, store: RedisStore
) -> None:
    task = await _claimed(store, "t")
    effect_id = await _prepared(store, task, "s1")
    assert _indexed(admin, effect_id) == (False, False, False)
    (entry,) = admin.lrange(KEYS.effects_created, 0, -1)
    assert entry.split(":")[1:] == [effect_id, "t"]
    # The change feed is what it was: one PREPARED event, its one field the event.
    (event,) = [f for _, f in admin.xrange(KEYS.events) if '"effectId"' in f["e"]]
    assert set(event) == {"e"}

    # Another gateway, which made no prepare of its own, finds it every way a user looks.
    other = await _opened(server)
    try:
        assert (await other.get_effect(effect_id)).state is EffectState.PREPARED
        assert _indexed(admin, effect_id) == (True, True, True)
        listed, _ = await other.list_effects(
            state=None, task_id=None, downstream=None, limit=10, cursor=None
        )
        assert [e.effect_id for e in listed] == [effect_id]
        second = await _prepared(store, task, "s2")
        assert await other.find_effects(second[:6], 10) == [second]
        third = await _prepared(store, task, "s3")
        assert (await other.store_stats(60_000)).effects == 3
        listed, _ = await other.list_effects(
            state=EffectState.PREPARED, task_id=None, downstream=None, limit=10, cursor=None
        )
        assert {e.effect_id for e in listed} == {effect_id, second, third}
    finally:
        await other.close()


async def test_a_gateway_killed_before_its_catch_up_leaves_nothing_unfound(
    server: RedisServer, admin: redis.Redis
) -> None:
    """The feed entry is written in the step: a gateway that dies right after (no close, no
    catch-up) loses nothing; the next reader adds every entry."""
    doomed = await _opened(server)
    task = await _claimed(doomed, "t")
    made = [await _prepared(doomed, task, f"s{i}") for i in range(5)]
    await doomed._redis.aclose()  # its connections go; nothing of close() runs
    assert not any(any(_indexed(admin, e)) for e in made)

    survivor = await _opened(server)
    try:
        found = await survivor.get_effect(made[-1])
        assert found.task_id == "t"
        assert all(_indexed(admin, e) == (True, True, True) for e in made)
    finally:
        await survivor.close()


async def test_concurrent_catch_ups_index_each_effect_once(
    server: RedisServer, admin: redis.Redis, store: RedisStore
) -> None:
    tasks = [await _claimed(store, f"t{i}") for i in range(3)]
    made = [await _prepared(store, tasks[i % 3], f"s{i}") for i in range(2_500)]
    others = [await _opened(server) for _ in range(3)]
    try:
        await asyncio.gather(*(o.catch_up_indexes() for o in [store, *others]))
    finally:
        for other in others:
            await other.close()
    assert admin.zcard(KEYS.effects_index) == admin.hlen(KEYS.effect_tasks) == 2_500
    assert admin.zcard(KEYS.effect_ids) == 2_500
    assert set(admin.hkeys(KEYS.effect_tasks)) == set(made)
    assert not admin.exists(KEYS.effects_created)


async def test_an_effect_removed_before_the_catch_up_is_not_indexed_again(
    admin: redis.Redis, store: RedisStore
) -> None:
    """Retention catches up before it removes; and a record gone by any other way before its
    entry is read is skipped, so no index ever names an effect that does not exist."""
    task = await _claimed(store, "t")
    kept = await _prepared(store, task, "kept")
    gone = await _prepared(store, task, "gone")
    admin.hdel(KEYS.effects("t"), gone)
    await store.catch_up_indexes()
    assert _indexed(admin, kept) == (True, True, True)
    assert _indexed(admin, gone) == (False, False, False)
    assert await store.find_effects(gone[:8], 10) == []


async def test_a_format_2_store_is_indexed_in_the_step_until_store_migrate(
    server: RedisServer, admin: redis.Redis
) -> None:
    """Gateways of format 2 read the creation indexes without catching up: while the store
    is at format 2 (they may be serving), new effects are indexed in their step; ``store
    migrate`` records format 3 and from then on the feed carries them."""
    admin.hset(KEYS.meta, "format", "2")
    store = await _opened(server)
    try:
        task = await _claimed(store, "t")
        before = await _prepared(store, task, "s1")
        assert _indexed(admin, before) == (True, True, True)
        assert not admin.exists(KEYS.effects_created)
        migration = await store.migrate()
        assert (migration.found, migration.current) == (2, 3)
        assert any("format 2 or older must be stopped" in note for note in migration.notes)
        assert admin.hget(KEYS.meta, "format") == "3"
        after = await _prepared(store, task, "s2")
        assert _indexed(admin, after) == (False, False, False)
        assert (await store.get_effect(after)).effect_id == after
        assert _indexed(admin, after) == (True, True, True)
    finally:
        await store.close()


async def test_a_closing_gateway_leaves_no_lag_behind(
    server: RedisServer, admin: redis.Redis
) -> None:
    store = await _opened(server)
    task = await _claimed(store, "t")
    effect_id = await _prepared(store, task, "s1")
    assert _indexed(admin, effect_id) == (False, False, False)
    await store.close()
    assert _indexed(admin, effect_id) == (True, True, True)


async def test_the_lag_is_bounded_by_count_without_any_reader(
    monkeypatch: pytest.MonkeyPatch, admin: redis.Redis, store: RedisStore
) -> None:
    """Older gateways (during a roll-out to format 3 they should be stopped, but an operator
    may be late) and the size of a reader's catch-up rely on the gateway's own catch-up:
    after ``_CATCH_UP_AFTER_EFFECTS`` new effects it runs without being asked."""
    monkeypatch.setattr(redis_store, "_CATCH_UP_AFTER_EFFECTS", 4)
    task = await _claimed(store, "t")
    made = [await _prepared(store, task, f"s{i}") for i in range(4)]
    run = store._catch_up_run
    assert run is not None
    await run
    assert all(_indexed(admin, e) == (True, True, True) for e in made)


def test_every_script_reading_the_creation_indexes_is_preceded_by_a_catch_up() -> None:
    """A new reader of the three indexes must catch up first: the scripts that read them are
    listed here, each with the store method that runs it after ``catch_up_indexes``."""
    readers: dict[str, Any] = {}
    for name in redis_store._SCRIPTS:
        text = redis_store.load_script_source(name)
        if name in ("prepare", "prepare_keyed", "index_catch_up", "cas_effect"):
            continue  # writers only, or (cas_effect) keyed by a record already found
        if any(
            f"KEYS[{i}]" in text and label in text
            for i in range(1, 16)
            for label in ("effects index", "effectId -> taskId", "effect ids index")
        ):
            readers[name] = True
    assert set(readers) == {"effect_prefix", "retention", "stats"}


async def _reader(server: RedisServer, **options: Any) -> RedisStore:
    """A store as ``fencegate failover lost`` opens one: opened even while it reports lost
    writes (gateway/store_cli.py, ``_on_store``)."""
    reader = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS, **options)
    with contextlib.suppress(StoreRegressed):
        await reader.open()
    return reader


async def test_reads_go_on_while_lost_writes_are_flagged(
    server: RedisServer, admin: redis.Redis, store: RedisStore
) -> None:
    """After a failover that lost writes, writes are refused until `fencegate failover ack`,
    but reads go on (ledger.errors.StoreRegressed): they are how an operator finds out what
    was lost (`fencegate failover lost` looks every logged effect up by id). A catch-up adds
    index entries for records the store holds now and lets nothing through, so a reader's
    catch-up is no write the flag should refuse."""
    task = await _claimed(store, "t")
    made = [await _prepared(store, task, f"s{i}") for i in range(3)]
    admin.set(KEYS.settled_indexed, "1")  # as any gateway's first retention sweep leaves it
    admin.hset(KEYS.meta, "regressed", json.dumps({"highestSeen": 9, "found": 1, "by": "x"}))
    operator = await _reader(server)
    try:
        assert operator.regressed
        listed, _ = await operator.list_effects(
            state=None, task_id=None, downstream=None, limit=10, cursor=None
        )
        assert {e.effect_id for e in listed} == set(made)
        with pytest.raises(NoSuchEffect):  # a lost effect: what `failover lost` reports
            await operator.get_effect("f" * 64)
        assert (await operator.store_stats(60_000)).effects == 3
        assert await operator.find_effects(made[0][:8], 10) == [made[0]]
    finally:
        await operator.close()


async def test_a_new_effect_is_found_by_id_while_lost_writes_are_flagged(
    server: RedisServer, admin: redis.Redis, store: RedisStore
) -> None:
    task = await _claimed(store, "t")
    effect_id = await _prepared(store, task, "s1")
    admin.hset(KEYS.meta, "regressed", json.dumps({"highestSeen": 9, "found": 1, "by": "x"}))
    operator = await _reader(server)
    try:
        assert (await operator.get_effect(effect_id)).state is EffectState.PREPARED
    finally:
        await operator.close()


async def test_reads_need_no_replica_acknowledgement(
    server: RedisServer, admin: redis.Redis, store: RedisStore
) -> None:
    """With `redis_min_replicas`, a write step no replica confirmed is refused ("may have been
    applied"); reads never waited for replicas. A reader's catch-up is not a step anyone acts
    on (lost with a failover, its entries are back in the list with it), so a replica down
    must not turn a look-up, a listing or the stats into 503."""
    task = await _claimed(store, "t")
    made = [await _prepared(store, task, f"s{i}") for i in range(2)]
    admin.set(KEYS.settled_indexed, "1")  # as any gateway's first retention sweep leaves it
    reader = await _reader(server, min_replicas=1, replica_timeout_ms=50)
    try:
        assert (await reader.get_effect(made[0])).task_id == "t"
        third = await _prepared(store, task, "s3")
        listed, _ = await reader.list_effects(
            state=None, task_id=None, downstream=None, limit=10, cursor=None
        )
        assert {e.effect_id for e in listed} == {*made, third}
        await _prepared(store, task, "s4")
        assert (await reader.store_stats(60_000)).effects == 4
    finally:
        await reader.close()


# --- the cluster store: an effect by its id alone across buckets ---------------------------

BUCKETS = 8


def _cluster(server: RedisServer, prefix: str) -> ClusterStore:
    backend = SingleRedisBackend(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    return ClusterStore(
        POLICY, backend, buckets=BUCKETS, key_prefix=prefix, timeout_ms=STORE_TIMEOUT_MS
    )


async def _cluster_prepared(store: ClusterStore, task_id: str, slot: str = "s") -> str:
    await store.put_task(task_id, "in", None)
    task = await store.claim(task_id, ClaimRequest("w", 60_000, 1))
    assert task.attempt_id is not None
    fence = Fence(task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    request = EffectRequest(fence, "node", slot, "pay", "POST", "/pay", "d" * 64)
    outcome = await store.prepare_effect(request, 30_000)
    assert outcome.action is Action.FORWARD
    return outcome.effect.effect_id


async def test_a_catch_up_between_the_probes_reads_hides_no_effect_by_id(
    redis_server: RedisServer, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster store's look-up by id probes every bucket in one pipeline: whether the
    directory holds the id, and whether entries wait. Redis may run another client's command
    between two of a pipeline's (here: another gateway's catch-up of the effect's bucket,
    right after the directory was read): the probe must then still see the effect, or that
    it may be waiting, never an effect that existed before the look-up began as unknown."""
    writer, reader = _cluster(redis_server, key_prefix), _cluster(redis_server, key_prefix)
    await writer.open()
    await reader.open()
    try:
        effect_id = await _cluster_prepared(writer, "y-1")
        bucket = bucket_of_task("y-1", BUCKETS)
        plain = reader._backend.read

        async def interleaved(commands: Sequence[tuple[int, tuple[Any, ...]]]) -> list[Any]:
            replies: list[Any] = []
            for n, command in commands:
                replies += await plain([(n, command)])
                if n == bucket and command[0] == "HEXISTS":
                    await writer.views[bucket].catch_up_indexes()  # another gateway's
            return replies

        monkeypatch.setattr(reader._backend, "read", interleaved)
        assert (await reader.get_effect(effect_id)).task_id == "y-1"
    finally:
        await writer.close()
        await reader.close()


def _task_in(bucket: int, stem: str, *, other_than: int | None = None) -> str:
    for i in range(10_000):
        task_id = f"{stem}-{i}"
        n = bucket_of_task(task_id, BUCKETS)
        if (other_than is None and n == bucket) or (other_than is not None and n != other_than):
            return task_id
    raise AssertionError("no id found")


async def test_a_bucket_moving_to_another_node_hides_no_effect_of_the_others(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """While a bucket's slot moves (``store move-slot``), its catch-up is refused FROZEN (it
    reads records it does not declare), but the effect steps go on, so entries wait there.
    A look-up by id of an effect of another bucket must still find it, and a listing (the
    console, ``fencegate effects``) must not be 503 for a moving bucket with nothing waiting."""
    writer, reader = _cluster(redis_server, key_prefix), _cluster(redis_server, key_prefix)
    await writer.open()
    await reader.open()
    try:
        moving_task = _task_in(0, "moving")
        moving = bucket_of_task(moving_task, BUCKETS)
        idle_task = _task_in(0, "idle", other_than=moving)
        idle = bucket_of_task(idle_task, BUCKETS)
        await _cluster_prepared(writer, idle_task)
        assert await writer.views[idle].catch_up_indexes()
        await writer.views[idle].freeze_bucket("test: a move of an idle bucket")
        listed, _ = await reader.list_effects(
            state=None, task_id=None, downstream=None, limit=10, cursor=None
        )
        assert len(listed) == 1
        await writer.views[idle].thaw_bucket()

        waiting = await _cluster_prepared(writer, moving_task)  # in the bucket about to move
        await writer.views[moving].freeze_bucket("test: a move under load")
        elsewhere = _task_in(0, "elsewhere", other_than=moving)
        effect_id = await _cluster_prepared(writer, elsewhere)
        assert (await reader.get_effect(effect_id)).task_id == elsewhere
        with pytest.raises(StoreUnavailable):  # may be waiting there: retry, not unknown
            await reader.get_effect("f" * 64)
        with pytest.raises(StoreUnavailable):
            await reader.get_effect(waiting)
        await writer.views[moving].thaw_bucket()  # the refused catch-ups lost no entry
        assert (await reader.get_effect(waiting)).task_id == moving_task
    finally:
        await writer.close()
        await reader.close()


async def test_a_bucket_moving_under_load_stops_no_other_buckets_reconciliation(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """The reconciler's work list (overdue forwards) spans every bucket; an overdue effect of
    a moving bucket whose entry waits cannot be read by id until the move ends, but the
    overdue effects of every other bucket must still be found meanwhile."""
    writer, reader = _cluster(redis_server, key_prefix), _cluster(redis_server, key_prefix)
    now = time.time_ns() // 1_000_000
    writer.clock_pinned_ms = reader.clock_pinned_ms = now
    await writer.open()
    await reader.open()
    try:
        moving_task = _task_in(0, "moving")
        moving = bucket_of_task(moving_task, BUCKETS)
        elsewhere = _task_in(0, "elsewhere", other_than=moving)
        await _cluster_prepared(writer, moving_task)
        effect_id = await _cluster_prepared(writer, elsewhere)
        await writer.views[moving].freeze_bucket("test: a move under load")
        reader.clock_pinned_ms = now + 60_000  # both forwards are overdue
        found = await reader.unsettled_effects(10, frozenset())
        assert effect_id in {e.effect_id for e in found}
    finally:
        await writer.close()
        await reader.close()


async def test_an_effect_past_what_one_catch_up_adds_is_not_called_unknown(
    monkeypatch: pytest.MonkeyPatch, server: RedisServer, store: RedisStore
) -> None:
    """One reader's catch-up is bounded (``_CATCH_UP_RUNS`` runs of ``_CATCH_UP_BATCH``). A
    backlog longer than that (entries piled up while a moving bucket refused its catch-ups,
    the effect steps going on) must not make a look-up by id answer NO_SUCH_EFFECT for an
    effect that exists: the caller is told to retry (each try adds more)."""
    task = await _claimed(store, "t")
    made = [await _prepared(store, task, f"s{i}") for i in range(5)]
    monkeypatch.setattr(redis_store, "_CATCH_UP_BATCH", 2)
    monkeypatch.setattr(redis_store, "_CATCH_UP_RUNS", 1)
    reader = await _reader(server)
    try:
        for _ in range(5):
            try:
                found = await reader.get_effect(made[-1])
                break
            except StoreUnavailable:
                continue
        assert found.effect_id == made[-1]
    finally:
        await reader.close()
