"""Issue 16 on Redis: what only the Redis store has to prove about task flow.

The rules themselves (queues, dependencies, WAITING, cost, discarded attempts, events) are held
to the pure model for every store by ``tests/test_stateful.py``. These tests check what the
model cannot see: ``claim_next.lua`` finds the best task from the queue's indexes without
scanning the queue (a bounded number of Redis commands however long the queue), drops a stale
index entry and goes on, finds expired and old-epoch claims again through the held and epochs
indexes; the ``discarded`` pseudo-field never reaches a task hash; the change feed is a stream
whose trimmed positions answer 410 while the newest trimmed one still resumes cleanly; and a
fenced call adds one stream entry per effect state change, nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis

from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import BadRequest, DependenciesPending, EventsGone
from fencegate.ledger.keys import Keys
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    RenewRequest,
    Task,
    TaskState,
)
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
START_MS = 1_700_000_000_000
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


def _commands(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


def _identity(task: Task) -> Identity:
    assert task.attempt_id is not None and task.owner is not None
    return Identity(task.attempt_id, task.claim_generation, task.owner, 1, task.cancel_generation)


async def _commit(store: RedisStore, task: Task, cost: tuple[tuple[str, float], ...] = ()) -> Task:
    assert task.attempt_id is not None
    request = CommitRequest(
        task.attempt_id, task.claim_generation, 1, task.cancel_generation, task.input_digest,
        "r" * 64, cost=cost,
    )  # fmt: skip
    done, replay = await store.commit(task.task_id, request)
    assert not replay
    return done


async def test_claim_next_on_a_long_queue_runs_a_bounded_number_of_commands(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    await asyncio.gather(
        *(store.put_task(f"t{i:05d}", "in", None, queue="big") for i in range(5000))
    )
    # The best one: highest priority, though created last.
    await store.put_task("urgent", "in", None, queue="big", priority=5)
    assert await store.claim_next("empty", ClaimRequest("w", 60_000, 1)) is None  # loads it
    admin.config_resetstat()
    first = await store.claim_next("big", ClaimRequest("w", 60_000, 1))
    second = await store.claim_next("big", ClaimRequest("w", 60_000, 1))
    ran = _commands(admin)
    assert first is not None and first.task_id == "urgent"
    assert second is not None and second.task_id == "t00000"  # then the oldest
    ran.pop("config|resetstat", None)
    assert ran.pop("evalsha") == 2, ran
    # Each claim's pipeline ends with the gateway's write mark and the lost-writes flag (an
    # INCR and an HMGET: docs/stores.md, "Fail closed"), outside the script.
    assert ran.pop("incr") == 2, ran
    ran["hmget"] -= 2
    # Each: TIME, HMGET scheduler, 2 ZRANGEBYSCORE, ZRANGE, HGETALL, HSET, ZADD leases,
    # ZREM ready, ZADD held, ZADD epochs, XADD. Nothing grows with the queue.
    assert sum(ran.values()) <= 2 * 12, ran
    assert not {"zscan", "scan", "keys", "zrangebylex"} & ran.keys(), ran
    assert admin.zcard(KEYS.queue_ready("big")) == 4999


async def test_a_stale_ready_entry_is_dropped_and_the_next_one_claimed(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    await store.put_task("real", "in", None, queue="q")
    await store.put_task("elsewhere", "in", None, queue="other")
    ready = KEYS.queue_ready("q")
    # Entries that sort first but are wrong: a task that does not exist, one of another
    # queue, and the real task under a stale rank (as if its priority had been 9).
    stale = [
        f"0000000:{START_MS:015d}:ghost",
        f"0000001:{START_MS:015d}:elsewhere",
        f"0999991:{START_MS:015d}:real",
    ]
    admin.zadd(ready, dict.fromkeys(stale, 0))
    claimed = await store.claim_next("q", ClaimRequest("w", 60_000, 1))
    assert claimed is not None and claimed.task_id == "real"
    assert admin.zcard(ready) == 0
    assert await store.claim_next("q", ClaimRequest("w", 60_000, 1)) is None
    # The task of the other queue is still claimable there.
    other = await store.claim_next("other", ClaimRequest("w", 60_000, 1))
    assert other is not None and other.task_id == "elsewhere"


async def test_more_stale_entries_than_tries_answer_none_and_are_cleared_over_calls(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    await store.put_task("real", "in", None, queue="q")
    ready = KEYS.queue_ready("q")
    admin.zadd(ready, {f"0000000:{i:015d}:ghost{i}": 0 for i in range(20)})
    # 16 tries per call: the first call gives up (bounded work), the second finds the task.
    assert await store.claim_next("q", ClaimRequest("w", 60_000, 1)) is None
    claimed = await store.claim_next("q", ClaimRequest("w", 60_000, 1))
    assert claimed is not None and claimed.task_id == "real"


async def test_expired_and_old_epoch_claims_are_found_again_through_their_indexes(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    await store.put_task("a", "in", None, queue="q", priority=1)
    await store.put_task("b", "in", None, queue="q")
    a = await store.claim_next("q", ClaimRequest("w1", 1_000, 1))
    b = await store.claim_next("q", ClaimRequest("w2", 60_000, 1))
    assert a is not None and a.task_id == "a" and b is not None and b.task_id == "b"
    assert await store.claim_next("q", ClaimRequest("w3", 60_000, 1)) is None
    assert admin.zcard(KEYS.queue_held("q")) == 2
    store.clock_pinned_ms = START_MS + 1_000  # a's lease ran out
    again = await store.claim_next("q", ClaimRequest("w3", 60_000, 1))
    assert again is not None and again.task_id == "a" and again.owner == "w3"
    assert [(d.attempt_id, d.reason) for d in again.discarded] == [(a.attempt_id, "expired")]
    # An epoch bump frees b at once, though its lease runs for another minute.
    await store.bump_epoch()
    taken = await store.claim_next("q", ClaimRequest("w4", 60_000, 2))
    assert taken is not None and taken.task_id in {"a", "b"}
    assert taken.discarded[0].reason == "epoch"
    other = await store.claim_next("q", ClaimRequest("w4", 60_000, 2))
    assert other is not None and {taken.task_id, other.task_id} == {"a", "b"}
    assert await store.claim_next("q", ClaimRequest("w5", 60_000, 2)) is None
    assert admin.zcard(KEYS.queue_held("q")) == 2 and admin.zcard(KEYS.queue_ready("q")) == 0


async def test_indexes_follow_release_commit_cancel_and_revisions(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    ready, held = KEYS.queue_ready("q"), KEYS.queue_held("q")
    await store.put_task("a", "in", None, queue="q")
    a = await store.claim_next("q", ClaimRequest("w", 60_000, 1))
    assert a is not None
    await store.release("a", _identity(a))
    assert admin.zcard(ready) == 1 and admin.zcard(held) == 0
    a = await store.claim_next("q", ClaimRequest("w", 60_000, 1))
    assert a is not None
    await _commit(store, a)
    assert admin.zcard(ready) == 0 and admin.zcard(held) == 0
    # A revision into another queue with a priority: indexed there, under its new rank.
    await store.put_task("a", "in2", None, queue="p", priority=-3)
    assert admin.zrange(KEYS.queue_ready("p"), 0, -1) == [f"{1_000_003:07d}:{START_MS:015d}:a"]
    await store.cancel("a")
    assert admin.zcard(KEYS.queue_ready("p")) == 0


async def test_discarded_is_answered_never_stored(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    admin, store = opened
    await store.put_task("dep", "in", None)
    await store.put_task("x", "in", None, depends_on=("dep",))
    with pytest.raises(DependenciesPending):
        await store.claim("x", ClaimRequest("w", 60_000, 1))
    dep = await store.claim("dep", ClaimRequest("w", 60_000, 1))
    await _commit(store, dep)
    x = await store.claim("x", ClaimRequest("w", 60_000, 1))
    x = await store.renew("x", RenewRequest(_identity(x), 60_000, cost=(("tokens", 0.1),)))
    x = await store.renew("x", RenewRequest(_identity(x), 60_000, cost=(("tokens", 0.2),)))
    assert x.attempt_cost == (("tokens", 0.1 + 0.2),)  # exactly the model's float sum
    revised, _ = await store.put_task("dep", "in2", None)
    assert [(d.task_id, d.reason, d.cost) for d in revised.discarded] == [
        ("x", "superseded", (("tokens", 0.1 + 0.2),))
    ]
    for task_id in ("dep", "x"):
        assert "discarded" not in admin.hkeys(KEYS.task(task_id))
    assert (await store.get_task("x")).state is TaskState.WAITING


async def test_events_past_a_trim_answer_gone_and_the_newest_trimmed_resumes(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    _, store = opened
    events, end = await store.read_events(None, 100)
    assert events == [] and end == "0-0"
    for i in range(10):
        await store.put_task(f"t{i}", "in", None)
    events, end = await store.read_events(end, 100)
    assert [e.body["taskId"] for e in events] == [f"t{i}" for i in range(10)]
    assert end == events[-1].position
    assert (await store.read_events(None, 100)) == ([], end)
    page, at = await store.read_events(events[1].position, 3)
    assert [e.position for e in page] == [e.position for e in events[2:5]]
    assert at == page[-1].position
    assert await store.trim_events(4) == 6
    assert await store.trim_events(4) == 0
    with pytest.raises(EventsGone):
        await store.read_events("0-0", 100)
    with pytest.raises(EventsGone):
        await store.read_events(events[4].position, 100)
    # A subscriber that had read everything up to the newest dropped event misses nothing.
    rest, _ = await store.read_events(events[5].position, 100)
    assert [e.position for e in rest] == [e.position for e in events[6:]]
    with pytest.raises(BadRequest):
        await store.read_events("not-a-position", 10)


async def test_trim_drops_in_batches(opened: tuple[redis.Redis, RedisStore]) -> None:
    admin, store = opened
    admin.xadd(KEYS.events, {"e": "{}"})
    for _ in range(5):
        pipe = admin.pipeline(transaction=False)
        for _ in range(600):
            pipe.xadd(KEYS.events, {"e": "{}"})
        pipe.execute()
    assert await store.trim_events(1) == 3000
    assert admin.xlen(KEYS.events) == 1


async def test_a_fenced_call_adds_one_event_per_effect_state_change(
    opened: tuple[redis.Redis, RedisStore],
) -> None:
    _, store = opened
    await store.put_task("t", "in", None)
    task = await store.claim("t", ClaimRequest("w", 60_000, 1))
    assert task.attempt_id is not None
    _, start = await store.read_events(None, 10)
    fence = Fence("t", task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    request = EffectRequest(fence, "node", "s1", "pay", "POST", "/pay", "d" * 64)
    outcome = await store.prepare_effect(request, 30_000)
    assert outcome.action is Action.FORWARD
    await store.complete_effect(
        "t", outcome.effect.effect_id, outcome.seq, task.attempt_id, EffectState.COMMITTED,
        "200", None,
    )  # fmt: skip
    events, _ = await store.read_events(start, 10)
    assert [(e.body["type"], e.body["state"], e.body["downstream"]) for e in events] == [
        ("effect", "PREPARED", "pay"),
        ("effect", "COMMITTED", "pay"),
    ]
    assert events[0].body["effectId"] == outcome.effect.effect_id


async def test_dependency_refusals_and_the_dependents_set(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server()
    store = RedisStore(server.url, POLICY, max_dependents=2, timeout_ms=STORE_TIMEOUT_MS)
    admin = server.client()
    try:
        await store.put_task("base", "in", None)
        await store.put_task("x1", "in", None, depends_on=("base",))
        await store.put_task("x2", "in", None, depends_on=("base", "x1", "base"))
        assert (await store.get_task("x2")).depends_on == ("base", "x1")
        with pytest.raises(BadRequest, match="already has 2 dependents"):
            await store.put_task("x3", "in", None, depends_on=("base",))
        with pytest.raises(BadRequest, match="no task nope"):
            await store.put_task("x3", "in", None, depends_on=("nope",))
        with pytest.raises(BadRequest, match="x2 is this task"):
            await store.put_task("x2", "in2", None, depends_on=("x2",))
        with pytest.raises(BadRequest, match=r"x2 depends on base \(a cycle\)"):
            await store.put_task("base", "in2", None, depends_on=("x2",))
        assert admin.smembers(KEYS.dependents("base")) == {"x1", "x2"}
        # A revision that drops a dependency drops the link, which frees a place.
        await store.put_task("x1", "in2", None, depends_on=())
        assert admin.smembers(KEYS.dependents("base")) == {"x2"}
        await store.put_task("x3", "in", None, depends_on=("base",))
    finally:
        admin.close()
        await store.close()
