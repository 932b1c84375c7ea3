"""Issue 17 on Redis: what only the Redis store has to prove about retention.

The rules (what expires, what is kept and why, what a tombstone refuses) are held to
``ledger.retention`` for every store by ``tests/test_retention.py``. These tests check what
that cannot see: the settled index is backfilled once for tasks settled before it existed;
the sweep reads the index and never SCANs or KEYSes the store; an expiry leaves nothing in
Redis naming the task or its effects but its tombstones (and the feed's events); tombstone
keys really go by themselves (and not early under a test clock in Redis's past); the refusal
``put.lua`` answers is the model's, word for word; sweeping gateways never expire a task twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import EffectExpired, NoSuchTask, TaskExpired
from fencegate.ledger.keys import Keys
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    LeasePolicy,
    Task,
    TaskState,
    Tombstone,
    expired_task,
)
from tests.api import until
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
#: Before Redis's own clock: a pinned test clock in Redis's past.
START_MS = 1_700_000_000_000
SETTLED_MS = 60_000
TOMBSTONE_MS = 600_000
KEYS = Keys()


@pytest.fixture
async def opened(
    make_redis_server: Callable[..., RedisServer],
) -> AsyncIterator[tuple[RedisServer, redis.Redis, RedisStore]]:
    """A store on its own redis-server, its clock pinned, and an admin client."""
    server = make_redis_server()
    store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    store.clock_pinned_ms = START_MS
    await store.open()
    admin = server.client()
    try:
        yield server, admin, store
    finally:
        admin.close()
        await store.close()


def _commands(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


async def _settled(
    store: RedisStore,
    task_id: str,
    *,
    effects: int = 0,
    queue: str | None = None,
    depends_on: tuple[str, ...] | None = None,
) -> list[str]:
    """A task committed with ``effects`` COMMITTED effects; returns their ids."""
    await store.put_task(task_id, f"in-{task_id}", None, queue=queue, depends_on=depends_on)
    task = await store.claim(task_id, ClaimRequest("w", 60_000, 1))
    assert task.attempt_id is not None
    fence = Fence(task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    ids = []
    for i in range(effects):
        request = EffectRequest(fence, "node", f"s{i}", "pay", "POST", "/pay", "d" * 64)
        outcome = await store.prepare_effect(request, 30_000)
        assert outcome.action is Action.FORWARD
        await store.complete_effect(
            task_id, outcome.effect.effect_id, 0, task.attempt_id, EffectState.COMMITTED, "200",
            None,
        )  # fmt: skip
        ids.append(outcome.effect.effect_id)
    await _commit(store, task)
    return ids


async def _commit(store: RedisStore, task: Task) -> None:
    assert task.attempt_id is not None
    request = CommitRequest(
        task.attempt_id, task.claim_generation, 1, task.cancel_generation, task.input_digest,
        "r" * 64,
    )  # fmt: skip
    await store.commit(task.task_id, request)


async def test_tasks_settled_before_the_index_existed_are_backfilled_once(
    opened: tuple[RedisServer, redis.Redis, RedisStore],
) -> None:
    server, admin, store = opened
    await _settled(store, "old-committed", effects=1)
    await store.put_task("old-cancelled", "in", None)
    await store.cancel("old-cancelled")
    await store.put_task("old-open", "in", None)
    # A store an older fencegate wrote: no settled index, no task index, no markers.
    admin.delete(KEYS.settled, KEYS.settled_indexed, KEYS.tasks_index, KEYS.tasks_indexed)

    later = RedisStore(
        server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS
    )  # a gateway of this version, started on it
    later.clock_pinned_ms = START_MS + SETTLED_MS
    try:
        stats = await later.store_stats(SETTLED_MS)
        assert (stats.tasks, stats.settled_tasks, stats.due_tasks) == (3, 2, 2)
        # due_at is when each settled: its updated_at.
        assert admin.zscore(KEYS.settled, "old-cancelled") == START_MS
        assert admin.get(KEYS.settled_indexed) == "1"
        report = await later.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
        assert (report.examined, report.expired_tasks, report.expired_effects) == (2, 2, 1)
        assert (await later.get_task("old-open")).state is TaskState.READY
        with pytest.raises(TaskExpired):
            await later.get_task("old-committed")

        # Done once: another gateway only looks at the marker.
        admin.config_resetstat()
        again = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
        again.clock_pinned_ms = START_MS + SETTLED_MS
        try:
            await again.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
        finally:
            await again.close()
        ran = _commands(admin)
        assert "scan" not in ran and "zrangebylex" not in ran, ran
    finally:
        await later.close()


async def test_the_sweep_never_scans_the_store(
    opened: tuple[RedisServer, redis.Redis, RedisStore],
) -> None:
    """Every lookup of the sweep goes through an index: the cost of a step is bounded by its
    batch, however many records the store holds."""
    server, admin, store = opened
    await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 10)  # the one-time backfill
    for i in range(30):
        await store.put_task(f"open-{i}", "in", None)
    for i in range(6):
        await _settled(store, f"done-{i}", effects=2)
    store.clock_offset_ms = SETTLED_MS
    await store.catch_up_indexes()  # as a gateway's own catch-up does within its lag bound
    admin.config_resetstat()
    first = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 4)
    ran = _commands(admin)
    assert (first.examined, first.expired_tasks, first.expired_effects) == (4, 4, 8)
    for listing in ("scan", "keys", "hscan", "sscan", "zscan"):
        assert listing not in ran, ran
    # The marker was seen by this store: the creation indexes' catch-up (one LLEN: nothing
    # waits here), then the one retention script, no more.
    assert ran["evalsha"] == 2 and ran["llen"] == 1 and "lpop" not in ran, ran
    # Per expired task: its fields, dependents, effects, then the deletions and tombstones;
    # nothing grows with the 30 open tasks.
    assert sum(ran.values()) < 4 * 30, ran

    # A new gateway's first step: the marker, then the same script.
    admin.config_resetstat()
    other = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    other.clock_pinned_ms = START_MS + SETTLED_MS
    try:
        rest = await other.expire_settled(SETTLED_MS, TOMBSTONE_MS, 4)
    finally:
        await other.close()
    assert (rest.examined, rest.expired_tasks) == (2, 2)
    ran = _commands(admin)
    assert not {"scan", "keys"} & set(ran), ran


async def test_an_expired_task_leaves_nothing_behind_but_its_tombstones(
    opened: tuple[RedisServer, redis.Redis, RedisStore],
) -> None:
    """Every key, member and field that named the task or its effects goes; what is left is
    the tombstones, their indexes and the feed's events (trimmed by count, not by retention)."""
    _, admin, store = opened
    first_effects = await _settled(store, "first", effects=1, queue="q")
    second_effects = await _settled(store, "second", effects=2, queue="q", depends_on=("first",))
    await store.put_task("keep", "in", None, queue="q")  # live: must not be touched
    before = set(admin.keys("*"))
    store.clock_offset_ms = SETTLED_MS
    report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    assert (report.expired_tasks, report.kept) == (1, {"dependents": 1})
    assert admin.smembers(KEYS.dependents("first")) == set()  # "second" took itself out
    store.clock_offset_ms = 2 * SETTLED_MS
    report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    assert report.expired_tasks == 1

    gone_ids = {"first", "second", *first_effects, *second_effects}
    stones = {
        KEYS.tombstone("first"),
        KEYS.tombstone("second"),
        *(KEYS.effect_tombstone(e) for e in first_effects + second_effects),
    }
    remembering = {KEYS.task_tombstones, KEYS.effect_tombstones, KEYS.events, *stones}
    for key in admin.keys("*"):
        if key in remembering:
            continue
        assert not any(i in key for i in gone_ids), key
        kind = admin.type(key)
        if kind == "zset":
            content = " ".join(admin.zrange(key, 0, -1))
        elif kind == "set":
            content = " ".join(admin.smembers(key))
        elif kind == "hash":
            content = " ".join(f"{k} {v}" for k, v in admin.hgetall(key).items())
        else:
            content = str(admin.get(key)) if kind == "string" else ""
        assert not any(i in content for i in gone_ids), (key, content)
    assert stones <= set(admin.keys("*"))
    assert set(admin.keys("*")) - before <= stones | {
        KEYS.task_tombstones,
        KEYS.effect_tombstones,
        KEYS.settled_indexed,
        KEYS.tasks_indexed,
    }
    assert (await store.get_task("keep")).state is TaskState.READY
    assert admin.zrange(KEYS.queue_ready("q"), 0, -1) != []


async def test_tombstone_keys_go_by_themselves(
    opened: tuple[RedisServer, redis.Redis, RedisStore],
) -> None:
    """Redis expires a tombstone's key at its forget_at (the production clock: Redis's own),
    without a sweep; the sweep only clears the counting indexes then."""
    server, admin, _ = opened
    live = RedisStore(
        server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS
    )  # Redis's own clock, as in production
    try:
        effect_ids = await _settled(live, "brief", effects=1)
        live.clock_offset_ms = SETTLED_MS  # settled long enough; tombstones live 300 ms
        report = await live.expire_settled(SETTLED_MS, 300, 100)
        assert report.expired_tasks == 1
        keys_ = [KEYS.tombstone("brief"), KEYS.effect_tombstone(effect_ids[0])]
        assert admin.exists(*keys_) == 2
        assert all(0 < admin.pttl(key) <= 300 for key in keys_)
        with pytest.raises(EffectExpired):
            await live.get_effect(effect_ids[0])
        # Nobody sweeps: Redis expires them, by its own clock (which no test moves).
        await until(lambda: admin.exists(*keys_) == 0, "Redis expires the tombstone keys")
        assert admin.zcard(KEYS.task_tombstones) == 1  # counted until the sweep says not
        assert (await live.store_stats(SETTLED_MS)).task_tombstones == 0  # past forget_at
        with pytest.raises(NoSuchTask) as missing:
            await live.get_task("brief")
        assert not isinstance(missing.value, TaskExpired)
        live.clock_offset_ms = SETTLED_MS + 400
        report = await live.expire_settled(SETTLED_MS, 300, 100)
        assert report.forgotten == 2
        assert admin.zcard(KEYS.task_tombstones) == admin.zcard(KEYS.effect_tombstones) == 0
    finally:
        await live.close()


async def test_a_test_clock_in_redis_past_does_not_expire_tombstones_early(
    opened: tuple[RedisServer, redis.Redis, RedisStore],
) -> None:
    """forget_at on a clock pinned years back lies in Redis's past: the key must still live
    tombstone_ms (the store's clock decides what counts as live, Redis only frees memory)."""
    _, admin, store = opened
    await _settled(store, "t")
    store.clock_pinned_ms = START_MS + SETTLED_MS
    await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    assert 0 < admin.pttl(KEYS.tombstone("t")) <= TOMBSTONE_MS
    with pytest.raises(TaskExpired):
        await store.put_task("t", "in-t", None)


async def test_put_of_the_same_input_answers_the_models_refusal(
    opened: tuple[RedisServer, redis.Redis, RedisStore],
) -> None:
    """put.lua answers the tombstone's fields; the gateway words the refusal with
    ``ledger.tasks.expired_task``, so no Lua text can drift from the model's."""
    _, admin, store = opened
    await _settled(store, "t", effects=2)
    store.clock_pinned_ms = START_MS + SETTLED_MS
    await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    now = START_MS + SETTLED_MS
    model = expired_task(
        Tombstone("t", 1, 1, 0, "in-t", TaskState.COMMITTED, now, now + TOMBSTONE_MS, 2)
    )
    with pytest.raises(TaskExpired) as refused:
        await store.put_task("t", "in-t", None)
    assert (refused.value.detail, refused.value.extra) == (model.detail, model.extra)
    with pytest.raises(TaskExpired) as claimed:
        await store.claim("t", ClaimRequest("w", 60_000, 1))
    assert (claimed.value.detail, claimed.value.extra) == (model.detail, model.extra)
    # A new input consumes the tombstone.
    again, _ = await store.put_task("t", "in-2", None)
    assert (again.revision, again.claim_generation) == (2, 1)
    assert admin.exists(KEYS.tombstone("t")) == 0
    assert admin.zscore(KEYS.task_tombstones, "t") is None


async def test_gateways_sweeping_at_once_expire_each_task_once(
    opened: tuple[RedisServer, redis.Redis, RedisStore],
) -> None:
    server, admin, store = opened
    for i in range(20):
        await _settled(store, f"t{i:02d}", effects=1)
    sweepers = [RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS) for _ in range(3)]
    try:
        for sweeper in sweepers:
            sweeper.clock_pinned_ms = START_MS + SETTLED_MS
        reports = await asyncio.gather(
            *(s.expire_settled(SETTLED_MS, TOMBSTONE_MS, 5) for s in sweepers for _ in range(3))
        )
    finally:
        for sweeper in sweepers:
            await sweeper.close()
    assert sum(r.expired_tasks for r in reports) == 20
    assert sum(r.expired_effects for r in reports) == 20
    assert admin.zcard(KEYS.task_tombstones) == 20
    assert admin.zcard(KEYS.settled) == 0
