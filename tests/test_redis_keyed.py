"""Issue 28 on Redis: what only the Redis store has to prove about keyed effects.

The rules (replays, conflicts, UNKNOWN, retention, tombstones) are held to the model for
every store by ``tests/test_keyed_store.py``. These check what that cannot see: a keyed
effect lives under its own key and touches no task's keys, its prepare reads no task and no
scheduler, a leased effect never enters the keyed-settled index, that index follows the
record (``effects.keyed_settled``: due from when it entered), the keyed part of
``retention.lua`` leaves nothing naming an expired effect but its tombstone (which an older
gateway still reads), moves a kept one to the back and drops a stale entry; and the readers
(prefix, reconciler, approvals, listing in creation order) find keyed and leased alike.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from fencegate.ledger import effects
from fencegate.ledger.effects import (
    Action,
    ClientKey,
    Effect,
    EffectRequest,
    EffectState,
    Fence,
    PrepareOutcome,
)
from fencegate.ledger.errors import EffectExpired
from fencegate.ledger.keys import Keys
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
#: Before Redis's own clock: a pinned test clock in Redis's past.
START_MS = 1_700_000_000_000
SETTLED_MS = 60_000
TOMBSTONE_MS = 600_000
DEADLINE_MS = 30_000
KEYS = Keys()


@pytest.fixture
async def opened(
    make_redis_server: Callable[..., RedisServer],
) -> AsyncIterator[tuple[redis.Redis, RedisStore]]:
    """A store on its own redis-server, its clock pinned, and an admin client."""
    server = make_redis_server()
    store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    store.clock_pinned_ms = START_MS
    await store.open()
    admin = server.client()
    try:
        yield admin, store
    finally:
        admin.close()
        await store.close()


def keyed(key: str, digest: str = "d1") -> EffectRequest:
    return EffectRequest(
        None, "", "", "pay", "POST", "/charges", digest,
        forward_id=uuid.uuid4().hex, client_key=ClientKey("agent", key),
    )  # fmt: skip


async def forward(store: RedisStore, key: str, **kwargs: bool) -> PrepareOutcome:
    return await store.prepare_effect(keyed(key), DEADLINE_MS, **kwargs)


async def complete(store: RedisStore, prepared: PrepareOutcome, state: EffectState) -> Effect:
    assert prepared.action is Action.FORWARD
    attempt = prepared.effect.attempts[-1]
    done, applied = await store.complete_effect(
        None, prepared.effect.effect_id, prepared.seq, attempt.attempt_id, state, "test", None
    )
    assert applied
    return done


def at(store: RedisStore, ms: int) -> None:
    store.clock_pinned_ms = START_MS + ms


def _commands(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


def _keys(admin: redis.Redis) -> set[str]:
    """Every key but the ones each gateway keeps whatever it does (format, write marks)."""
    return {
        str(k) for k in admin.keys("*")
        if k != KEYS.meta and not str(k).startswith(f"{KEYS.prefix}:write-mark:")
    }  # fmt: skip


async def test_a_keyed_effect_lives_under_its_own_key_and_reads_no_task(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    admin.config_resetstat()
    prepared = await forward(store, "k1")
    ran = _commands(admin)
    # No task and no scheduler read (prepare.lua's load_fields and scheduler are HMGETs; the
    # only ones here are each write batch's read of the regressed flag, after its INCR).
    assert ran.get("hmget", 0) == ran["incr"], ran
    eid = prepared.effect.effect_id
    assert eid == effects.keyed_effect_id("agent", "pay", "k1")
    at(store, 5)
    await complete(store, prepared, EffectState.COMMITTED)

    assert _keys(admin) == {
        KEYS.keyed_effect(eid), KEYS.effects_index, KEYS.effect_ids, KEYS.events,
        KEYS.keyed_settled,
    }  # fmt: skip
    record = admin.hgetall(KEYS.keyed_effect(eid))
    assert list(record) == [eid]
    assert effects.effect_from_fields(json.loads(record[eid])).kind == "keyed"
    # What an older gateway looks for finds nothing (so it answers NO_SUCH_EFFECT or skips
    # the entry, never misreads it): no effectId -> taskId entry, and the creation-order
    # member's empty task id names an effects hash that holds nothing.
    assert admin.zrange(KEYS.effects_index, 0, -1) == [f"{START_MS:015d}:{eid}:"]
    assert admin.hget(KEYS.effect_tasks, eid) is None
    assert not admin.exists(KEYS.effects(""))
    assert admin.zscore(KEYS.keyed_settled, eid) == START_MS + 5


async def test_a_leased_effect_never_enters_the_keyed_settled_index(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    await store.put_task("t1", "in", None)
    task = await store.claim("t1", ClaimRequest("w", 60_000, 1))
    assert task.attempt_id is not None
    fence = Fence("t1", task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    request = EffectRequest(fence, "node", "s", "pay", "POST", "/pay", "d1")
    prepared = await store.prepare_effect(request, DEADLINE_MS)
    await store.complete_effect(
        "t1", prepared.effect.effect_id, 0, task.attempt_id, EffectState.COMMITTED, "200", None
    )
    await store.update_effect(
        prepared.effect.effect_id, lambda e, now: dataclasses.replace(e, updated_at=now)
    )
    assert not admin.exists(KEYS.keyed_settled)
    assert not any(":keyed-effect" in k for k in _keys(admin))


async def test_the_keyed_settled_index_follows_the_record(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    first = await forward(store, "k1")
    eid = first.effect.effect_id
    assert admin.zscore(KEYS.prepared, eid) == START_MS + DEADLINE_MS
    at(store, 10)
    await complete(store, first, EffectState.UNKNOWN)
    assert admin.sismember(KEYS.unknown, eid) and admin.zscore(KEYS.probe_due, eid) == 0
    assert admin.zscore(KEYS.keyed_settled, eid) is None

    at(store, 20)  # resolved NOT_APPLIED: settled from now
    await store.update_effect(
        eid,
        lambda e, now: effects.resolve(e, EffectState.NOT_APPLIED, "checked", "ops", None, now),
    )
    assert admin.zscore(KEYS.keyed_settled, eid) == START_MS + 20
    assert not admin.sismember(KEYS.unknown, eid) and admin.zscore(KEYS.probe_due, eid) is None

    at(store, 30)  # forwarded again: out of the index
    again = await forward(store, "k1")
    assert again.action is Action.FORWARD
    assert admin.zscore(KEYS.keyed_settled, eid) is None
    at(store, 40)
    await complete(store, again, EffectState.COMMITTED)
    assert admin.zscore(KEYS.keyed_settled, eid) == START_MS + 40

    at(store, 50)  # a write that leaves it settled keeps when it entered
    await store.update_effect(eid, lambda e, now: dataclasses.replace(e, updated_at=now))
    assert admin.zscore(KEYS.keyed_settled, eid) == START_MS + 40

    waiting = await forward(store, "k2", require_approval=True)
    assert waiting.action is Action.REJECT
    assert admin.sismember(KEYS.awaiting, waiting.effect.effect_id)
    assert admin.zscore(KEYS.keyed_settled, waiting.effect.effect_id) is None


async def test_the_keyed_sweep_expires_keeps_and_forgets(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    done = await complete(store, await forward(store, "done"), EffectState.COMMITTED)
    unknown = await complete(store, await forward(store, "lost"), EffectState.UNKNOWN)
    # An entry the records do not justify (drift) and one whose record is gone.
    admin.zadd(KEYS.keyed_settled, {unknown.effect_id: START_MS, "f" * 64: START_MS})

    at(store, SETTLED_MS)
    report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    assert (report.examined, report.expired_effects) == (3, 1)
    assert report.kept == {"unsettled_effect": 1}
    # The kept one moved to the back; the stale entry went.
    assert admin.zrange(KEYS.keyed_settled, 0, -1, withscores=True) == [
        (unknown.effect_id, START_MS + SETTLED_MS)
    ]

    # Nothing names the expired effect but its tombstone (the feed's events aside).
    eid = done.effect_id
    assert {k for k in _keys(admin) if eid in k} == {KEYS.effect_tombstone(eid)}
    for index in (KEYS.effects_index, KEYS.effect_ids, KEYS.prepared, KEYS.probe_due):
        assert not [m for m in admin.zrange(index, 0, -1) if eid in m], index
    assert not admin.sismember(KEYS.unknown, eid) and not admin.sismember(KEYS.awaiting, eid)
    stone = admin.hgetall(KEYS.effect_tombstone(eid))
    assert stone == {
        "effect_id": eid, "task_id": "", "state": "COMMITTED",
        "expired_at": str(START_MS + SETTLED_MS),
        "forget_at": str(START_MS + SETTLED_MS + TOMBSTONE_MS),
    }  # fmt: skip
    assert await store.find_effects(eid[:8], 10) == []
    with pytest.raises(EffectExpired):
        await forward(store, "done")

    at(store, SETTLED_MS + TOMBSTONE_MS)
    report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    assert report.forgotten == 1
    assert not admin.exists(KEYS.effect_tombstone(eid))
    fresh = await forward(store, "done")
    assert fresh.action is Action.FORWARD and len(fresh.effect.attempts) == 1


async def test_the_readers_find_keyed_and_leased_effects_alike(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    _, store = opened
    lost = await complete(store, await forward(store, "lost"), EffectState.UNKNOWN)
    at(store, 1)
    await store.put_task("t1", "in", None)
    task = await store.claim("t1", ClaimRequest("w", 60_000, 1))
    assert task.attempt_id is not None
    fence = Fence("t1", task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    leased = await store.prepare_effect(
        EffectRequest(fence, "node", "s", "pay", "POST", "/pay", "d1"), DEADLINE_MS
    )
    at(store, 2)
    waiting = await forward(store, "waiting", require_approval=True)

    assert await store.find_effects(lost.effect_id[:6], 10) == [lost.effect_id]
    gauges = await store.gauges()
    assert (gauges.prepared_effects, gauges.unknown_effects, gauges.awaiting_approval) == (
        1, 1, 1,
    )  # fmt: skip
    unsettled = await store.unsettled_effects(10, frozenset({"pay"}))
    assert [e.effect_id for e in unsettled] == [lost.effect_id]
    assert [e.effect_id for e in await store.awaiting_approval(10)] == [waiting.effect.effect_id]

    order = [lost.effect_id, leased.effect.effect_id, waiting.effect.effect_id]
    page, cursor = await store.list_effects(
        state=None, task_id=None, downstream=None, limit=2, cursor=None
    )
    rest, end = await store.list_effects(
        state=None, task_id=None, downstream=None, limit=2, cursor=cursor
    )
    assert [e.effect_id for e in page + rest] == order and end is None
    assert [e.kind for e in page + rest] == ["keyed", "leased", "keyed"]
    stats = await store.store_stats(SETTLED_MS)
    assert (stats.effects, stats.unknown_effects, stats.awaiting_approval) == (3, 1, 1)
