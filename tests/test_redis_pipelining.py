"""Issue 13, auto-pipelining of the Redis store's calls (``ledger.redis_store._AutoPipeline``).

The store calls issued in one event-loop turn (scripts, and the plain commands of the hot
path) go to Redis as one non-transactional pipeline: one write, one read, one pooled
connection. Against a real redis-server, these hold: many concurrent callers each get their
own answer (from one flush, on one connection); a Lua error reply goes to its caller only; a
NOSCRIPT after SCRIPT FLUSH is loaded and re-sent inside the pipeline; a batch in flight when
Redis is killed (or stops answering) fails every caller with the store's usual
``StoreUnavailable`` and nothing hangs; a caller cancelled mid-flight leaves the others
answered; a batch is bounded; ``?pipeline=0`` switches it off. Every test counts flushes, so
none passes on a store that sends one command per round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis

from fencegate.ledger import effects, registry
from fencegate.ledger.effects import Action, EffectRequest, Fence
from fencegate.ledger.errors import StoreUnavailable
from fencegate.ledger.keys import Keys
from fencegate.ledger.redis_store import PIPELINE_BATCH_MAX, RedisStore
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy
from tests.api import until
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
#: Guard against a hang only; every wait below ends long before it.
NO_HANG_S = 20.0


#: Opens a store on a private redis-server: (server, an admin client, the store).
OpenStore = Callable[..., Awaitable[tuple[RedisServer, redis.Redis, RedisStore]]]


@pytest.fixture
async def open_store(
    make_redis_server: Callable[..., RedisServer],
) -> AsyncIterator[OpenStore]:
    """A store on its own redis-server (the tests kill, pause and flush it), closed with its
    admin client when the test ends."""
    opened: list[tuple[redis.Redis, RedisStore]] = []

    async def open_(
        *, timeout_ms: int = 5000, query: str = ""
    ) -> tuple[RedisServer, redis.Redis, RedisStore]:
        server = make_redis_server()
        store = RedisStore(server.url + query, POLICY, timeout_ms=timeout_ms)
        await store.open()  # the durability check: later calls are only the ones a test makes
        admin = server.client()
        opened.append((admin, store))
        return server, admin, store

    yield open_
    for admin, store in opened:
        admin.close()
        await store.close()


def _flushes(store: RedisStore) -> int:
    assert store.pipeline is not None
    return store.pipeline.flushes


def _calls(store: RedisStore) -> int:
    assert store.pipeline is not None
    return store.pipeline.calls


def _stat(client: redis.Redis, section: str, name: str) -> int:
    info: dict[str, Any] = client.info(section)
    return int(info[name])


def _evalsha_calls(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_concurrent_callers_share_one_pipeline_and_each_gets_its_own_answer(
    open_store: OpenStore,
) -> None:
    _server, admin, store = await open_store()
    n = 60
    ids = [f"t{i}" for i in range(n)]
    connections = _stat(admin, "stats", "total_connections_received")
    before = _flushes(store)
    put = await asyncio.gather(*(store.put_task(t, f"in-{t}", None) for t in ids))
    assert _flushes(store) == before + 1
    assert [(task.task_id, task.input_digest) for task, _ in put] == [(t, f"in-{t}") for t in ids]

    claims = await asyncio.gather(
        *(store.claim(t, ClaimRequest(f"w-{t}", 60_000 + i, 1)) for i, t in enumerate(ids))
    )
    assert [(c.task_id, c.owner, c.claim_generation) for c in claims] == [
        (t, f"w-{t}", 1) for t in ids
    ]
    attempts = {c.task_id: c.attempt_id for c in claims}
    assert len(set(attempts.values())) == n

    # Scripts and plain commands (HGETALL, TIME) mixed in one turn.
    read = await asyncio.gather(*(store.get_task(t) for t in ids), store.now_ms())
    *tasks, now = read
    assert [(t.task_id, t.attempt_id) for t in tasks] == [(t, attempts[t]) for t in ids]
    assert isinstance(now, int) and now > 0

    # The hot path: one prepare per task, each with its own effectId and record.
    requests = [
        EffectRequest(
            Fence(c.task_id, c.attempt_id or "", c.claim_generation, 1, 0),
            "node",
            f"slot-{c.task_id}",
            "pay",
            "POST",
            "/pay",
            "d" * 64,
        )
        for c in claims
    ]
    prepared = await asyncio.gather(*(store.prepare_effect(r, 30_000) for r in requests))
    for claim, outcome in zip(claims, prepared, strict=True):
        assert outcome.action is Action.FORWARD
        assert outcome.effect.task_id == claim.task_id
        assert outcome.effect.effect_id == effects.effect_id(
            claim.task_id, claim.revision, "node", f"slot-{claim.task_id}"
        )
    assert _flushes(store) == before + 4
    assert store.pipeline is not None and store.pipeline.calls >= 4 * n
    # One connection carried all of it: a call per round trip would have opened ~n.
    assert _stat(admin, "stats", "total_connections_received") - connections <= 1


async def test_a_lua_error_goes_only_to_its_caller(
    open_store: OpenStore,
) -> None:
    _server, admin, store = await open_store()
    for t in ("a", "b"):
        await store.put_task(t, f"in-{t}", None)
    admin.set(Keys("fg").task("bad"), "not a hash")  # the script's HMGET fails: WRONGTYPE
    before = _flushes(store)
    good_a, bad, good_b, scheduler = await asyncio.gather(
        store.claim("a", ClaimRequest("w", 60_000, 1)),
        store.claim("bad", ClaimRequest("w", 60_000, 1)),
        store.claim("b", ClaimRequest("w", 60_000, 1)),
        store.get_scheduler(),
        return_exceptions=True,
    )
    assert _flushes(store) == before + 1
    assert isinstance(bad, StoreUnavailable), bad
    assert "Redis refused the operation" in bad.detail and "WRONGTYPE" in bad.detail
    assert not isinstance(good_a, BaseException) and good_a.task_id == "a"
    assert not isinstance(good_b, BaseException) and good_b.task_id == "b"
    assert not isinstance(scheduler, BaseException) and scheduler.epoch == 1


async def test_noscript_after_script_flush_is_loaded_and_resent_in_the_pipeline(
    open_store: OpenStore,
) -> None:
    _server, admin, store = await open_store()
    await store.put_task("warm", "in", None)
    await store.claim("warm", ClaimRequest("w", 60_000, 1))
    admin.script_flush()
    assert _stat(admin, "memory", "number_of_cached_scripts") == 0
    admin.config_resetstat()
    before = _flushes(store)
    put_a, put_b, scheduler, again = await asyncio.gather(
        store.put_task("a", "in-a", None),
        store.put_task("b", "in-b", None),
        store.get_scheduler(),
        store.put_task("warm", "in", None),
    )
    assert _flushes(store) == before + 1
    assert (put_a[0].task_id, put_b[0].task_id, again[0].task_id) == ("a", "b", "warm")
    assert scheduler.epoch == 1
    assert _stat(admin, "memory", "number_of_cached_scripts") == 2  # put, scheduler
    # Four EVALSHA refused (NOSCRIPT: nothing ran), then the same four ran once each.
    assert _evalsha_calls(admin) == 8
    assert (await store.get_task("a")).input_digest == "in-a"


async def test_a_batch_in_flight_when_redis_is_killed_fails_every_caller_and_nothing_hangs(
    open_store: OpenStore,
) -> None:
    server, admin, store = await open_store(timeout_ms=10_000)
    ids = [f"t{i}" for i in range(8)]
    for t in ids:
        await store.put_task(t, f"in-{t}", None)
    admin.execute_command("CLIENT", "PAUSE", "30000", "ALL")  # the batch waits in Redis
    before, carried = _flushes(store), _calls(store)
    calls = asyncio.gather(
        *(store.claim(t, ClaimRequest("w", 60_000, 1)) for t in ids),
        store.get_task(ids[0]),
        return_exceptions=True,
    )
    await until(lambda: _flushes(store) > before, "the batch is sent", within_s=NO_HANG_S)
    # One batch, all nine calls in it, sent and unanswered.
    assert (_flushes(store), _calls(store)) == (before + 1, carried + len(ids) + 1)
    assert not calls.done()
    server.kill()
    answers = await asyncio.wait_for(calls, NO_HANG_S)
    for answer in answers:
        assert isinstance(answer, StoreUnavailable), answer
        assert "may or may not have been applied" in answer.detail
    # Redis back (its AOF kept every task): the store answers again.
    server.start()
    await store.ping()
    assert (await store.get_task(ids[1])).input_digest == f"in-{ids[1]}"


async def test_a_batch_that_times_out_fails_every_caller_and_later_answers_are_their_own(
    open_store: OpenStore,
) -> None:
    # It fires only while the server is paused; ordinary round trips never reach 3 s.
    server, _admin, store = await open_store(timeout_ms=3_000)
    ids = [f"t{i}" for i in range(6)]
    for t in ids:
        await store.put_task(t, f"in-{t}", None)
    server.pause()  # SIGSTOP: the connection stays open, nothing answers
    try:
        stuck = await asyncio.wait_for(
            asyncio.gather(*(store.get_task(t) for t in ids), return_exceptions=True),
            NO_HANG_S,
        )
    finally:
        server.resume()
    for answer in stuck:
        assert isinstance(answer, StoreUnavailable), answer
        assert "may or may not have been applied" in answer.detail
    # A reply still owed to the timed-out batch must not reach a later caller.
    before = _flushes(store)
    later = await asyncio.gather(*(store.get_task(t) for t in reversed(ids)))
    assert [(t.task_id, t.input_digest) for t in later] == [(t, f"in-{t}") for t in reversed(ids)]
    assert _flushes(store) == before + 1


async def test_a_caller_cancelled_while_its_batch_is_in_flight_does_not_break_the_others(
    open_store: OpenStore,
) -> None:
    server, _admin, store = await open_store(timeout_ms=10_000)
    ids = [f"t{i}" for i in range(10)]
    for t in ids:
        await store.put_task(t, f"in-{t}", None)
    server.pause()
    try:
        before, carried = _flushes(store), _calls(store)
        calls = [asyncio.create_task(store.get_task(t)) for t in ids]
        await until(lambda: _flushes(store) > before, "the batch is sent", within_s=NO_HANG_S)
        # One batch, in flight, with every call in it.
        assert (_flushes(store), _calls(store)) == (before + 1, carried + len(ids))
        for call in calls[::3]:
            call.cancel()
        await asyncio.wait(calls[::3])  # the cancellations landed before Redis answers
    finally:
        server.resume()
    done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), NO_HANG_S)
    for i, (t, answer) in enumerate(zip(ids, done, strict=True)):
        if i % 3 == 0:
            assert isinstance(answer, asyncio.CancelledError), answer
        else:
            assert not isinstance(answer, BaseException), answer
            assert (answer.task_id, answer.input_digest) == (t, f"in-{t}")
    again = await asyncio.gather(*(store.get_task(t) for t in ids))
    assert [t.task_id for t in again] == ids


async def test_a_batch_is_bounded_and_a_lone_call_goes_alone(
    open_store: OpenStore,
) -> None:
    _server, _admin, store = await open_store()
    n = 2 * PIPELINE_BATCH_MAX + 44
    await store.put_task("t", "in-t", None)
    before = _flushes(store)
    many = await asyncio.gather(*(store.get_task("t") for _ in range(n)), store.now_ms())
    assert _flushes(store) == before + 3  # 128 + 128 + 45
    assert all(t.task_id == "t" for t in many[:n])
    assert store.pipeline is not None
    calls = store.pipeline.calls
    assert (await store.get_task("t")).input_digest == "in-t"
    assert (_flushes(store), store.pipeline.calls) == (before + 4, calls + 1)


async def test_pipelining_is_switched_off_by_the_store_url(
    open_store: OpenStore,
) -> None:
    server, admin, store = await open_store(query="?pipeline=0")
    assert store.pipeline is None
    connections = _stat(admin, "stats", "total_connections_received")
    put = await asyncio.gather(*(store.put_task(f"t{i}", "in", None) for i in range(10)))
    assert [task.task_id for task, _ in put] == [f"t{i}" for i in range(10)]
    # Today's path: one pooled connection per concurrent call.
    assert _stat(admin, "stats", "total_connections_received") - connections >= 5
    on = RedisStore(server.url + "?pipeline=1", POLICY, timeout_ms=STORE_TIMEOUT_MS)
    assert on.pipeline is not None
    await on.close()
    registry.check_url("redis://127.0.0.1:6379/0?pipeline=0")
    with pytest.raises(ValueError, match="pipeline"):
        registry.check_url("redis://127.0.0.1:6379/0?pipeline=yes")
