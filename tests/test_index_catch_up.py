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
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from fencegate.ledger import redis_store
from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
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
