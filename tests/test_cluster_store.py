"""The Redis Cluster store's coordinator (``ledger.cluster_store``): routing and merges.

Each bucket is an unchanged ``RedisStore`` under its own prefix; on one ordinary
redis-server (``SingleRedisBackend``) that is exactly the cluster store minus the routing,
so what spans buckets (listings, sums, sweeps, the feed, the scheduler copies, queue claims,
an effect by id) is tested here without a cluster. The store's clock is pinned
(``clock_pinned_ms``) where a lease must run out.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from fencegate.gateway.config import ConfigError, load_config
from fencegate.ledger import cluster_store, redis_store
from fencegate.ledger.buckets import (
    bucket_of_keyed,
    bucket_of_queue,
    bucket_of_task,
    bucket_tag,
    slot_of,
)
from fencegate.ledger.cluster_store import (
    HINT_RESCAN_MS,
    HINT_TTL_MS,
    ClusterStore,
    RoutedBackend,
    SingleRedisBackend,
    bucket_prefix,
    merge_pages,
)
from fencegate.ledger.effects import (
    Action,
    ClientKey,
    EffectRequest,
    EffectState,
    Fence,
)
from fencegate.ledger.errors import (
    BadRequest,
    ClaimsPaused,
    EffectExpired,
    NoSuchEffect,
    NoSuchTask,
    StaleEpoch,
    StoreIncompatible,
    StoreUnavailable,
)
from fencegate.ledger.keys import Keys
from fencegate.ledger.queries import TaskFilter
from fencegate.ledger.redis_store import FORMAT_VERSION
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    LeasePolicy,
    PutOutcome,
    Task,
    TaskState,
)
from tests.cluster_servers import ClusterServers
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)
BUCKETS = 8
DEADLINE = 30_000


def make_store(server: RedisServer, prefix: str, buckets: int = BUCKETS) -> ClusterStore:
    backend = SingleRedisBackend(server.url, POLICY, timeout_ms=10_000)
    return ClusterStore(POLICY, backend, buckets=buckets, key_prefix=prefix, timeout_ms=10_000)


@pytest.fixture
async def cluster(redis_server: RedisServer, key_prefix: str) -> AsyncIterator[ClusterStore]:
    store = make_store(redis_server, key_prefix)
    store.clock_pinned_ms = time.time_ns() // 1_000_000
    await store.open()
    yield store
    await store.close()


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


def ids_in_buckets(count: int, stem: str = "t") -> list[str]:
    """``count`` task ids, spread so that every bucket gets some (round-robin by bucket)."""
    by_bucket: dict[int, list[str]] = {n: [] for n in range(BUCKETS)}
    i = 0
    while sum(len(v) for v in by_bucket.values()) < count:
        task_id = f"{stem}-{i:04d}"
        bucket = bucket_of_task(task_id, BUCKETS)
        if len(by_bucket[bucket]) < -(-count // BUCKETS):
            by_bucket[bucket].append(task_id)
        i += 1
    return sorted(t for ids in by_bucket.values() for t in ids)[:count]


def other_bucket_than(bucket: int, stem: str) -> str:
    for i in range(1000):
        task_id = f"{stem}-{i}"
        if bucket_of_task(task_id, BUCKETS) != bucket:
            return task_id
    raise AssertionError("no id found")


async def put(store: ClusterStore, task_id: str, **kwargs: Any) -> Task:
    task, _ = await store.put_task(task_id, "in", None, **kwargs)
    return task


async def claimed(store: ClusterStore, task_id: str, ttl_ms: int = 10_000) -> Task:
    await put(store, task_id)
    return await store.claim(task_id, ClaimRequest("w", ttl_ms, 1))


def fence_of(task: Task) -> Fence:
    assert task.attempt_id is not None
    return Fence(task.task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)


async def leased_effect(store: ClusterStore, task_id: str, slot: str = "s") -> str:
    task = await claimed(store, task_id)
    request = EffectRequest(fence_of(task), "node", slot, "pay", "POST", "/pay", "d1")
    prepared = await store.prepare_effect(request, DEADLINE)
    assert prepared.action is Action.FORWARD
    return prepared.effect.effect_id


def keyed(key: str) -> EffectRequest:
    return EffectRequest(
        None,
        "",
        "",
        "pay",
        "POST",
        "/charges",
        "d1",
        forward_id=uuid.uuid4().hex,
        client_key=ClientKey("agent", key),
    )


# --- merging pages (pure) ------------------------------------------------------------------


def test_merge_stops_at_the_lowest_bucket_that_has_more() -> None:
    """A bucket that said "more after c" has shown nothing past c: nothing past it is
    answered yet, and the cursor is where every bucket has been read up to."""
    pages = [(["a", "d", "e"], "e"), (["b", "f"], None), ([], None)]
    assert merge_pages(pages, lambda x: x, 10) == (["a", "b", "d", "e"], "e")
    assert merge_pages(pages, lambda x: x, 2) == (["a", "b"], "b")
    assert merge_pages([(["a"], None), (["b"], None)], lambda x: x, 2) == (["a", "b"], None)
    assert merge_pages([([], "m"), ([], None)], lambda x: x, 5) == ([], "m")


# --- routing -------------------------------------------------------------------------------


async def test_a_task_lives_in_its_groups_bucket(
    cluster: ClusterStore, raw: aioredis.Redis, key_prefix: str
) -> None:
    """Every key of a task is under its group's bucket prefix, so one script's keys share
    the bucket's slot; tasks of one group share the bucket."""
    await put(cluster, "order-17::charge")
    await put(cluster, "order-17::email")
    bucket = bucket_of_task("order-17", BUCKETS)
    prefix = bucket_prefix(key_prefix, bucket)
    assert await raw.exists(f"{prefix}:{{order-17::charge}}:task")
    assert await raw.exists(f"{prefix}:{{order-17::email}}:task")
    assert (await cluster.views[bucket].get_task("order-17::email")).task_id == "order-17::email"
    other = (bucket + 1) % BUCKETS
    with pytest.raises(NoSuchTask):
        await cluster.views[other].get_task("order-17::email")
    assert (await cluster.get_task("order-17::charge")).state is TaskState.READY


async def test_a_dependency_of_another_group_is_refused_one_of_its_own_is_kept(
    cluster: ClusterStore,
) -> None:
    await put(cluster, "g1::a")
    await put(cluster, "g2::b")
    with pytest.raises(BadRequest, match="task group"):
        await cluster.put_task("g1::c", "in", None, depends_on=("g2::b",))
    with pytest.raises(NoSuchTask):
        await cluster.get_task("g1::c")
    task, outcome = await cluster.put_task("g1::c", "in", None, depends_on=("g1::a",))
    assert outcome is PutOutcome.CREATED and task.state is TaskState.WAITING
    first = await cluster.claim("g1::a", ClaimRequest("w", 10_000, 1))
    assert first.attempt_id is not None
    await cluster.commit(
        "g1::a",
        CommitRequest(
            first.attempt_id, first.claim_generation, 1, first.cancel_generation, "in", "r"
        ),
    )
    assert (await cluster.get_task("g1::c")).state is TaskState.READY


async def test_the_same_input_changes_nothing_whatever_group_its_dependencies_are_in(
    cluster: ClusterStore,
) -> None:
    """docs/PROTOCOL.md: the same ``inputDigest`` changes nothing, whatever ``dependsOn``
    says; so a dependency of another group is refused only when the put would change the
    task (a new one, or a new input)."""
    created, _ = await cluster.put_task("g1::a", "in", None)
    await put(cluster, "g2::b")
    same, outcome = await cluster.put_task("g1::a", "in", None, depends_on=("g2::b",))
    assert outcome is PutOutcome.UNCHANGED and same == created
    with pytest.raises(BadRequest, match="task group"):
        await cluster.put_task("g1::a", "in-2", None, depends_on=("g2::b",))
    assert (await cluster.get_task("g1::a")).revision == 1


async def test_the_task_limits_reach_every_bucket(cluster: ClusterStore) -> None:
    """``max_dependents`` and ``max_cascade`` set on the store (as ``[tasks]`` does at start,
    or a test later) are what every bucket's step enforces."""
    cluster.max_dependents, cluster.max_cascade = 1, 2
    assert {(v.max_dependents, v.max_cascade) for v in cluster.views} == {(1, 2)}
    for group in ("g1", "g2", "g3"):
        await put(cluster, f"{group}::hub")
        await put(cluster, f"{group}::d1", depends_on=(f"{group}::hub",))
        with pytest.raises(BadRequest, match="already has 1 dependents"):
            await put(cluster, f"{group}::d2", depends_on=(f"{group}::hub",))


async def test_the_bucket_count_is_recorded_and_a_different_one_refused(
    cluster: ClusterStore, redis_server: RedisServer, key_prefix: str
) -> None:
    other = make_store(redis_server, key_prefix, buckets=4)
    try:
        with pytest.raises(StoreIncompatible, match="cluster_buckets = 8"):
            await other.open()
    finally:
        await other.close()


# --- listings ------------------------------------------------------------------------------


async def test_tasks_are_listed_in_id_order_across_buckets_page_by_page(
    cluster: ClusterStore,
) -> None:
    ids = ids_in_buckets(29)
    assert len({bucket_of_task(t, BUCKETS) for t in ids}) == BUCKETS
    for task_id in ids:
        await put(cluster, task_id)
    await cluster.claim(ids[3], ClaimRequest("w", 10_000, 1))
    seen: list[str] = []
    after: str | None = None
    while True:
        page, after = await cluster.list_tasks(TaskFilter(), 4, after)
        assert len(page) <= 4
        seen += [t.task_id for t in page]
        if after is None:
            break
    assert seen == ids
    claimed_only, more = await cluster.list_tasks(TaskFilter(state=TaskState.CLAIMED), 10, None)
    assert [t.task_id for t in claimed_only] == [ids[3]] and more is None


async def test_effects_are_listed_in_creation_order_across_buckets(
    cluster: ClusterStore,
) -> None:
    made = [await leased_effect(cluster, task_id) for task_id in ids_in_buckets(10, "e")]
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page, cursor = await cluster.list_effects(
            state=None, task_id=None, downstream=None, limit=3, cursor=cursor
        )
        seen += [e.effect_id for e in page]
        if cursor is None:
            break
    records = [await cluster.get_effect(e) for e in made]
    assert seen == [e.effect_id for e in sorted(records, key=lambda e: (e.created_at, e.effect_id))]
    one_task, _ = await cluster.list_effects(
        state=None, task_id=records[0].task_id, downstream=None, limit=10, cursor=None
    )
    assert [e.effect_id for e in one_task] == [records[0].effect_id]
    with pytest.raises(BadRequest):
        await cluster.list_effects(
            state=None, task_id=None, downstream=None, limit=3, cursor="not-a-cursor!"
        )


# --- an effect by id alone -----------------------------------------------------------------


async def test_an_effect_is_found_by_its_id_alone_in_any_bucket(cluster: ClusterStore) -> None:
    """A leased effect's id names no bucket: it is found in its task's, wherever that is;
    a keyed one in its id's; an id nobody has is NO_SUCH_EFFECT."""
    task_ids = ids_in_buckets(BUCKETS, "f")
    leased = [await leased_effect(cluster, task_id) for task_id in task_ids]
    homes = {bucket_of_task(t, BUCKETS) for t in task_ids}
    assert homes != {bucket_of_keyed(e, BUCKETS) for e in leased}  # not by luck
    for task_id, effect_id in zip(task_ids, leased, strict=True):
        assert (await cluster.get_effect(effect_id)).task_id == task_id
    prepared = await cluster.prepare_effect(keyed("k-1"), DEADLINE)
    eid = prepared.effect.effect_id
    assert (await cluster.views[bucket_of_keyed(eid, BUCKETS)].get_effect(eid)).kind == "keyed"
    assert (await cluster.get_effect(eid)).effect_id == eid
    done, applied = await cluster.complete_effect(
        None,
        eid,
        prepared.seq,
        prepared.effect.attempts[-1].attempt_id,
        EffectState.COMMITTED,
        "ok",
        None,
    )
    assert applied and done.state is EffectState.COMMITTED
    with pytest.raises(NoSuchEffect):
        await cluster.get_effect("0" * 64)
    found = await cluster.find_effects(leased[2][:6], 10)
    assert leased[2] in found and found == sorted(found)


async def test_an_effect_is_updated_by_its_id_in_its_own_bucket(cluster: ClusterStore) -> None:
    effect_id = await leased_effect(cluster, "u-1")

    def to_unknown(record: Any, now: int) -> Any:
        assert record is not None
        from dataclasses import replace

        return replace(record, state=EffectState.UNKNOWN, deadline_at=None, updated_at=now)

    updated = await cluster.update_effect(effect_id, to_unknown)
    assert updated.state is EffectState.UNKNOWN
    assert (await cluster.get_effect(effect_id)).state is EffectState.UNKNOWN
    gauges = await cluster.gauges()
    assert gauges.unknown_effects == 1 and gauges.active_leases == 1


# --- sums and sweeps -------------------------------------------------------------------------


async def test_gauges_and_stats_are_summed_over_buckets(cluster: ClusterStore) -> None:
    task_ids = ids_in_buckets(BUCKETS, "s")
    for task_id in task_ids:
        await claimed(cluster, task_id)
    gauges = await cluster.gauges()
    assert gauges.active_leases == BUCKETS
    stats = await cluster.store_stats(1000)
    assert stats.tasks == BUCKETS and stats.claimed_tasks == BUCKETS
    assert stats.bytes is not None and stats.bytes > 0
    assert stats.events >= 2 * BUCKETS  # created + claimed, each in its bucket's stream


async def test_the_retention_sweep_goes_round_robin_over_buckets(
    cluster: ClusterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fewer buckets per call than buckets, every bucket is reached within
    ``B / SWEEP_BUCKETS`` calls, and each call does at most that many bucket steps."""
    monkeypatch.setattr(cluster_store, "SWEEP_BUCKETS", 3)
    task_ids = ids_in_buckets(BUCKETS, "r")
    for task_id in task_ids:
        await put(cluster, task_id)
        await cluster.cancel(task_id)
    cluster.clock_offset_ms += 10_000
    expired = 0
    for _ in range(-(-BUCKETS // 3)):
        report = await cluster.expire_settled(1_000, 60_000, 100)
        assert report.examined <= 3 * 100
        expired += report.expired_tasks
    assert expired == BUCKETS
    assert (await cluster.store_stats(1000)).task_tombstones == BUCKETS


# --- queue claims --------------------------------------------------------------------------


async def test_a_queue_claim_takes_the_best_task_of_every_bucket_in_queue_order(
    cluster: ClusterStore,
) -> None:
    task_ids = ids_in_buckets(BUCKETS, "q")
    priorities = {task_id: (i * 37) % 11 for i, task_id in enumerate(task_ids)}
    for task_id in task_ids:
        await put(cluster, task_id, queue="jobs", priority=priorities[task_id])
        cluster.clock_offset_ms += 1  # a distinct readyAt each
    await put(cluster, "elsewhere", queue="other")
    request = ClaimRequest("w", 10_000, 1)
    order = []
    for _ in task_ids:
        task = await cluster.claim_next("jobs", request)
        assert task is not None and task.state is TaskState.CLAIMED
        order.append(task.task_id)
    expected = sorted(task_ids, key=lambda t: (-priorities[t], task_ids.index(t)))
    assert order == expected
    assert await cluster.claim_next("jobs", request) is None


async def test_a_queue_claim_takes_back_a_lease_run_out_in_another_bucket(
    cluster: ClusterStore,
) -> None:
    first = "held-1"
    await put(cluster, first, queue="jobs")
    held = await cluster.claim_next("jobs", ClaimRequest("w", 1_000, 1))
    assert held is not None and held.task_id == first
    assert await cluster.claim_next("jobs", ClaimRequest("w", 1_000, 1)) is None
    cluster.clock_offset_ms += 2_000
    again = await cluster.claim_next("jobs", ClaimRequest("w2", 1_000, 1))
    assert again is not None and again.task_id == first and again.owner == "w2"
    assert again.claim_generation == held.claim_generation + 1


async def test_a_queue_claim_is_refused_while_paused_even_with_the_queue_empty(
    cluster: ClusterStore,
) -> None:
    await cluster.set_claims_paused(True)
    with pytest.raises(ClaimsPaused):
        await cluster.claim_next("empty", ClaimRequest("w", 1_000, 1))
    await put(cluster, other_bucket_than(0, "p"), queue="jobs")
    with pytest.raises(ClaimsPaused):
        await cluster.claim_next("jobs", ClaimRequest("w", 1_000, 1))
    await cluster.set_claims_paused(False)
    assert await cluster.claim_next("jobs", ClaimRequest("w", 1_000, 1)) is not None


# --- the queues' hints (docs/decisions.md, "Queues: an index per bucket, a hint per queue") --


def in_bucket(bucket: int, stem: str) -> str:
    for i in range(1000):
        task_id = f"{stem}-{i}"
        if bucket_of_task(task_id, BUCKETS) == bucket:
            return task_id
    raise AssertionError("no id found")


def hint_key(cluster: ClusterStore, queue: str) -> str:
    home = bucket_of_queue(queue, BUCKETS)
    return Keys(bucket_prefix(cluster.key_prefix, home)).queue_buckets(queue)


async def hinted(cluster: ClusterStore, raw: aioredis.Redis, queue: str) -> set[int]:
    """The buckets the queue's hint names, read from Redis."""
    keys = await raw.hkeys(hint_key(cluster, queue))
    return {int(field) for field in keys if field != "scanned_at"}


async def test_a_put_names_its_bucket_in_the_queues_hint_and_owes_nothing_after(
    cluster: ClusterStore, raw: aioredis.Redis
) -> None:
    first, second = in_bucket(1, "h"), in_bucket(5, "h")
    await put(cluster, first, queue="jobs")
    await put(cluster, second, queue="jobs")
    await put(cluster, in_bucket(3, "other"), queue="other")
    assert await hinted(cluster, raw, "jobs") == {1, 5}
    for n in range(BUCKETS):
        assert await raw.smembers(Keys(bucket_prefix(cluster.key_prefix, n)).queue_owed) == set()
    claimed_ids = set()
    for _ in range(2):
        task = await cluster.claim_next("jobs", ClaimRequest("w", 10_000, 1))
        assert task is not None
        claimed_ids.add(task.task_id)
    assert claimed_ids == {first, second}


async def test_hints_expire_so_claims_on_made_up_queues_leave_nothing_behind(
    cluster: ClusterStore, raw: aioredis.Redis
) -> None:
    """Queue names are the clients' to choose: every write of a hint sets its expiry, and a
    hint that expired is rebuilt by the next claim (here: deleted, as expiry would)."""
    for name in ("made-up-1", "made-up-2"):
        assert await cluster.claim_next(name, ClaimRequest("w", 60_000, 1)) is None
    task = await put(cluster, in_bucket(3, "x"), queue="made-up-1")
    for name in ("made-up-1", "made-up-2"):
        assert 0 < await raw.pttl(hint_key(cluster, name)) <= HINT_TTL_MS
    await raw.delete(hint_key(cluster, "made-up-1"))
    found = await cluster.claim_next("made-up-1", ClaimRequest("w", 60_000, 1))
    assert found is not None and found.task_id == task.task_id
    assert 0 < await raw.pttl(hint_key(cluster, "made-up-1")) <= HINT_TTL_MS


async def test_a_queue_claim_reads_only_hinted_buckets_until_its_rescan_finds_a_lost_one(
    cluster: ClusterStore, raw: aioredis.Redis
) -> None:
    """A step whose hint update was lost (its gateway died after the step; here the view's
    own put, which no coordinator follows): queue claims do not see its bucket until the
    hint is HINT_RESCAN_MS old, and then do."""
    await put(cluster, in_bucket(2, "seen"), queue="jobs")
    first = await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1))  # rescans now
    assert first is not None
    lost = in_bucket(6, "lost")
    await cluster.views[6].put_task(lost, "in", None, queue="jobs")
    assert await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1)) is None
    cluster.clock_offset_ms += HINT_RESCAN_MS - 1
    assert await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1)) is None
    cluster.clock_offset_ms += 1
    found = await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1))
    assert found is not None and found.task_id == lost
    assert await hinted(cluster, raw, "jobs") == {2, 6}


async def test_a_failed_hint_update_keeps_the_step_and_the_rescan_finds_its_task(
    cluster: ClusterStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1))  # the hint is new
    real_read = cluster._read

    async def failing(commands: Any) -> list[Any]:
        if commands[0][1][0] == "SPOP":
            raise StoreUnavailable("Redis did not answer")
        return await real_read(commands)

    monkeypatch.setattr(cluster, "_read", failing)
    task = await put(cluster, in_bucket(4, "f"), queue="jobs")
    assert task.state is TaskState.READY  # the step answered
    monkeypatch.setattr(cluster, "_read", real_read)
    assert await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1)) is None
    cluster.clock_offset_ms += HINT_RESCAN_MS
    found = await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1))
    assert found is not None and found.task_id == task.task_id


async def test_a_dependent_a_commit_made_ready_is_claimable_from_its_queue_at_once(
    cluster: ClusterStore,
) -> None:
    dependency, dependent = "order-9::charge", "order-9::email"
    await put(cluster, dependency)
    await put(cluster, dependent, queue="mail", depends_on=(dependency,))
    assert await cluster.claim_next("mail", ClaimRequest("w", 60_000, 1)) is None  # rescanned
    holder = await cluster.claim(dependency, ClaimRequest("w", 60_000, 1))
    assert holder.attempt_id is not None
    await cluster.commit(
        dependency,
        CommitRequest(holder.attempt_id, holder.claim_generation, 1, 0, "in", "r1", None),
    )
    found = await cluster.claim_next("mail", ClaimRequest("w", 60_000, 1))
    assert found is not None and found.task_id == dependent


async def test_a_rescan_drops_an_emptied_bucket_but_not_one_a_put_refilled_meanwhile(
    cluster: ClusterStore, raw: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rescan's write takes out a bucket it found empty only while the bucket's field
    holds the token read before the look: a put that lands (step and hint update) between
    the look and the write keeps its bucket."""
    for bucket in (3, 7):
        await put(cluster, in_bucket(bucket, "e"), queue="jobs")
    for _ in range(2):
        task = await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1))
        assert task is not None
        await cluster.cancel(task.task_id)  # the bucket's queue sets are empty again
    assert await hinted(cluster, raw, "jobs") == {3, 7}
    refill = in_bucket(7, "refill")
    real_read = cluster._read

    async def racing(commands: Any) -> list[Any]:
        command = commands[0][1]
        if command[0] == "EVAL" and command[1] == cluster_store._HINT_RESCAN:
            monkeypatch.setattr(cluster, "_read", real_read)
            await put(cluster, refill, queue="jobs")
        return await real_read(commands)

    monkeypatch.setattr(cluster, "_read", racing)
    cluster.clock_offset_ms += HINT_RESCAN_MS
    assert await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1)) is None  # looked first
    assert await hinted(cluster, raw, "jobs") == {7}
    found = await cluster.claim_next("jobs", ClaimRequest("w", 60_000, 1))
    assert found is not None and found.task_id == refill


@pytest.mark.parametrize("bad", [99, 60_001])
def test_the_rescan_interval_is_a_setting_bounded_and_named_when_wrong(
    tmp_path: Path, bad: int
) -> None:
    path = tmp_path / "fencegate.toml"
    path.write_text(
        f'[store]\nurl = "redis+cluster://127.0.0.1:7000"\ncluster_queue_rescan_ms = {bad}\n'
    )
    with pytest.raises(ConfigError, match=r"store\.cluster_queue_rescan_ms"):
        load_config(path)


async def test_a_longer_rescan_interval_trusts_the_hint_longer(
    redis_server: RedisServer, key_prefix: str
) -> None:
    backend = SingleRedisBackend(redis_server.url, POLICY, timeout_ms=10_000)
    store = ClusterStore(
        POLICY, backend, buckets=BUCKETS, key_prefix=key_prefix, timeout_ms=10_000,
        queue_rescan_ms=5_000,
    )  # fmt: skip
    store.clock_pinned_ms = time.time_ns() // 1_000_000
    await store.open()
    try:
        assert await store.claim_next("jobs", ClaimRequest("w", 60_000, 1)) is None
        lost = in_bucket(6, "lost")
        await store.views[6].put_task(lost, "in", None, queue="jobs")  # no hint update
        store.clock_offset_ms += 4_999
        assert await store.claim_next("jobs", ClaimRequest("w", 60_000, 1)) is None
        store.clock_offset_ms += 1
        found = await store.claim_next("jobs", ClaimRequest("w", 60_000, 1))
        assert found is not None and found.task_id == lost
    finally:
        await store.close()


# --- the scheduler copies ------------------------------------------------------------------


async def test_pause_resume_and_bump_reach_every_copy(cluster: ClusterStore) -> None:
    paused = await cluster.set_claims_paused(True)
    assert paused.claims_paused
    assert all([(await view.get_scheduler()).claims_paused for view in cluster.views])
    resumed = await cluster.set_claims_paused(False)
    assert not resumed.claims_paused and not (await cluster.get_scheduler()).claims_paused
    task_id = other_bucket_than(0, "b")
    await claimed(cluster, task_id)
    bumped = await cluster.bump_epoch()
    assert bumped.epoch == 2
    assert {(await view.get_scheduler()).epoch for view in cluster.views} == {2}
    with pytest.raises(StaleEpoch):
        await cluster.claim(task_id, ClaimRequest("w", 1_000, 1))
    again = await cluster.claim(task_id, ClaimRequest("w", 1_000, 2))
    assert again.claim_epoch == 2


async def test_a_bump_evens_out_copies_left_apart(cluster: ClusterStore) -> None:
    """A copy ahead of the others (a bump that died midway) sets the target: every copy
    ends one past the highest."""
    await cluster.views[3].bump_epoch()
    await cluster.views[3].bump_epoch()
    assert (await cluster.get_scheduler()).epoch == 3
    assert (await cluster.bump_epoch()).epoch == 4
    assert {(await view.get_scheduler()).epoch for view in cluster.views} == {4}


# --- the change feed -----------------------------------------------------------------------


async def test_the_feed_merges_every_buckets_stream_and_resumes_exactly(
    cluster: ClusterStore,
) -> None:
    _, start = await cluster.read_events(None, 10)
    assert start.startswith("c1.")
    task_ids = ids_in_buckets(12, "ev")
    for task_id in task_ids:
        await put(cluster, task_id)
        cluster.clock_offset_ms += 1
    events, end = await cluster.read_events(start, 100)
    merged = [e.body["taskId"] for e in events]
    # Every event once; each bucket's in its own order (across buckets: by stream id time).
    assert sorted(merged) == task_ids
    for n in range(BUCKETS):
        mine = [t for t in task_ids if bucket_of_task(t, BUCKETS) == n]
        assert [t for t in merged if t in mine] == mine
    assert (await cluster.read_events(end, 100))[0] == []
    # Page by page from the start, and from any event's own position: each event once.
    seen: list[str] = []
    position = start
    while True:
        page, position = await cluster.read_events(position, 5)
        if not page:
            break
        seen += [e.body["taskId"] for e in page]
    assert seen == merged
    rest, _ = await cluster.read_events(events[4].position, 100)
    assert [e.body["taskId"] for e in rest] == merged[5:]
    with pytest.raises(BadRequest, match="Last-Event-ID"):
        await cluster.read_events("1700000000000-0", 10)


async def test_a_trimmed_bucket_position_is_gone(cluster: ClusterStore) -> None:
    _, start = await cluster.read_events(None, 10)
    for task_id in ids_in_buckets(3 * BUCKETS, "tr"):
        await put(cluster, task_id)
    dropped = await cluster.trim_events(BUCKETS)
    assert dropped == 2 * BUCKETS
    from fencegate.ledger.errors import EventsGone

    with pytest.raises(EventsGone, match="bucket"):
        await cluster.read_events(start, 10)


# --- lifecycle -----------------------------------------------------------------------------


async def test_ping_durability_and_migrate_speak_for_the_whole_store(
    cluster: ClusterStore,
) -> None:
    await cluster.ping()
    warnings = await cluster.durability()
    assert warnings == [w for w in warnings if "appendfsync" in w or "maxmemory" in w]
    assert len(warnings) == len(set(warnings))  # once per primary, not once per bucket
    migration = await cluster.migrate()
    assert migration.store == "redis-cluster" and migration.found in (None, FORMAT_VERSION)
    assert migration.done == ()
    assert cluster.kind == "redis-cluster" and not cluster.regressed


async def test_an_expired_effect_is_refused_expired_by_its_id(cluster: ClusterStore) -> None:
    task = await claimed(cluster, "x-1")
    request = EffectRequest(fence_of(task), "node", "s", "pay", "POST", "/pay", "d1")
    prepared = await cluster.prepare_effect(request, DEADLINE)
    eid = prepared.effect.effect_id
    await cluster.complete_effect(
        "x-1", eid, prepared.seq, task.attempt_id or "", EffectState.COMMITTED, "ok", None
    )
    await cluster.commit(
        "x-1",
        CommitRequest(
            task.attempt_id or "", task.claim_generation, 1, task.cancel_generation, "in", "r"
        ),
    )
    cluster.clock_offset_ms += 10_000
    expired = 0
    for _ in range(BUCKETS):
        expired += (await cluster.expire_settled(1_000, 600_000, 100)).expired_effects
    assert expired == 1
    with pytest.raises(EffectExpired):
        await cluster.get_effect(eid)


# --- on a real Redis Cluster (three primaries, three replicas) -----------------------------


@pytest.fixture
async def on_cluster(redis_cluster: ClusterServers, key_prefix: str) -> AsyncIterator[ClusterStore]:
    backend = RoutedBackend(redis_cluster.url, POLICY, key_prefix=key_prefix, timeout_ms=10_000)
    store = ClusterStore(POLICY, backend, buckets=16, key_prefix=key_prefix, timeout_ms=10_000)
    store.clock_pinned_ms = time.time_ns() // 1_000_000
    await store.open()
    yield store
    await store.close()


async def test_on_a_real_cluster_buckets_spread_over_primaries_and_merge_back(
    on_cluster: ClusterStore, redis_cluster: ClusterServers
) -> None:
    """The same coordinator over routed views: the buckets land on several primaries, and
    the listing, the queue claim, an effect by id, the gauges, the feed and the scheduler
    copies span them."""
    store = on_cluster
    slots = [slot_of(bucket_tag(store.key_prefix, n)) for n in range(16)]
    assert len({redis_cluster.primary_of(slot).address for slot in slots}) > 1
    _, start = await store.read_events(None, 10)
    task_ids = [f"c-{i}" for i in range(20)]
    for i, task_id in enumerate(task_ids):
        await put(store, task_id, queue="jobs", priority=i % 3)
        store.clock_offset_ms += 1
    listed, cursor = await store.list_tasks(TaskFilter(), 100, None)
    assert [t.task_id for t in listed] == sorted(task_ids) and cursor is None
    best = await store.claim_next("jobs", ClaimRequest("w", 10_000, 1))
    assert best is not None and best.task_id == "c-2"  # priority 2, the earliest
    request = EffectRequest(fence_of(best), "node", "s", "pay", "POST", "/pay", "d1")
    prepared = await store.prepare_effect(request, DEADLINE)
    assert (await store.get_effect(prepared.effect.effect_id)).task_id == "c-2"
    gauges = await store.gauges()
    assert gauges.active_leases == 1 and gauges.prepared_effects == 1
    events, _ = await store.read_events(start, 100)
    assert sorted({e.body["taskId"] for e in events}) == sorted(task_ids)
    assert (await store.set_claims_paused(True)).claims_paused
    assert not (await store.set_claims_paused(False)).claims_paused
    assert (await store.bump_epoch()).epoch == 2
    primaries = {node.address for node in redis_cluster.primaries()}
    for warning in await store.durability():  # per primary, each named
        assert warning.split(": ", 1)[0] in primaries
    await store.ping()


async def test_a_new_effect_is_found_by_its_id_before_its_bucket_caught_up(
    cluster: ClusterStore,
    redis_server: RedisServer,
    key_prefix: str,
    raw: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Format 3: a lean prepare's directory entry waits in its bucket's list
    (``index_catch_up.lua``). A look-up by id alone through another gateway finds it all the
    same, catching up the buckets where entries wait; an unknown id stays NO_SUCH_EFFECT."""
    monkeypatch.setattr(redis_store, "_CATCH_UP_AFTER_S", 3600.0)
    task = await claimed(cluster, "y-1")
    request = EffectRequest(fence_of(task), "node", "s", "pay", "POST", "/pay", "d1")
    eid = (await cluster.prepare_effect(request, DEADLINE)).effect.effect_id
    bucket = bucket_of_task("y-1", BUCKETS)
    waiting = Keys(bucket_prefix(key_prefix, bucket)).effects_created
    assert await raw.llen(waiting) == 1
    other = make_store(redis_server, key_prefix)
    await other.open()
    try:
        assert (await other.get_effect(eid)).task_id == "y-1"
        assert await raw.llen(waiting) == 0  # the miss caught up the one bucket waiting
        with pytest.raises(NoSuchEffect):
            await other.get_effect("f" * 64)
    finally:
        await other.close()
