"""A claim on the cluster store that meets an epoch bump's barrier waits for it, inside the
store, and is never answered CLAIMS_PAUSED (issue 30; docs/decisions.md, "The scheduler: a
copy per bucket, bumped behind a barrier").

The barrier is set with the bucket's own copy step, as a bump's phase 2 sets it; the claim is
seen to have met it (the view's claim refused at least twice) before the barrier is lifted,
so nothing here races a clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from fencegate.ledger.buckets import bucket_of_task
from fencegate.ledger.cluster_store import ClusterStore, SingleRedisBackend
from fencegate.ledger.errors import BumpBarrier, ClaimsPaused, StoreUnavailable
from fencegate.ledger.tasks import ClaimRequest
from tests.api import until
from tests.servers import RedisServer
from tests.test_cluster_store import BUCKETS, POLICY, make_store, put

#: Store time far past the test: the barrier holds until lifted.
HOLD_MS = 3_600_000


@pytest.fixture
async def cluster(redis_server: RedisServer, key_prefix: str) -> AsyncIterator[ClusterStore]:
    store = make_store(redis_server, key_prefix)
    await store.open()
    yield store
    await store.close()


def count_barrier_refusals(store: ClusterStore, bucket: int) -> list[int]:
    """How often the bucket's view refused a claim with the barrier (wrapping its steps)."""
    seen = [0]
    view = store.views[bucket]
    claim, claim_next = view.claim, view.claim_next

    async def counted_claim(*args: object, **kwargs: object) -> object:
        try:
            return await claim(*args, **kwargs)  # type: ignore[arg-type]
        except BumpBarrier:
            seen[0] += 1
            raise

    async def counted_next(*args: object, **kwargs: object) -> object:
        try:
            return await claim_next(*args, **kwargs)  # type: ignore[arg-type]
        except BumpBarrier:
            seen[0] += 1
            raise

    view.claim = counted_claim  # type: ignore[method-assign]
    view.claim_next = counted_next  # type: ignore[method-assign]
    return seen


async def test_a_claim_behind_a_barrier_waits_and_is_granted_once_it_lifts(
    cluster: ClusterStore,
) -> None:
    await put(cluster, "job-1")
    bucket = bucket_of_task("job-1", BUCKETS)
    now = await cluster.now_ms()
    await cluster.views[bucket].scheduler_copy("barrier", 2, now + HOLD_MS)
    refused = count_barrier_refusals(cluster, bucket)
    waiting = asyncio.create_task(cluster.claim("job-1", ClaimRequest("w", 10_000, 1)))
    await until(lambda: refused[0] >= 2, "the claim met the barrier and tried again")
    assert not waiting.done()
    await cluster.views[bucket].scheduler_copy("clear", 2)
    granted = await asyncio.wait_for(waiting, 30)
    assert granted.state.value == "CLAIMED" and granted.claim_generation == 1


async def test_a_queue_claim_behind_a_barrier_waits_too(cluster: ClusterStore) -> None:
    await put(cluster, "q-1", queue="reports")
    bucket = bucket_of_task("q-1", BUCKETS)
    now = await cluster.now_ms()
    await cluster.views[bucket].scheduler_copy("barrier", 2, now + HOLD_MS)
    refused = count_barrier_refusals(cluster, bucket)
    waiting = asyncio.create_task(cluster.claim_next("reports", ClaimRequest("w", 10_000, 1)))
    await until(lambda: refused[0] >= 2, "the queue claim met the barrier and tried again")
    await cluster.views[bucket].scheduler_copy("clear", 2)
    granted = await asyncio.wait_for(waiting, 30)
    assert granted is not None and granted.task_id == "q-1"


async def test_a_barrier_that_outlasts_the_timeout_is_unavailable_never_paused(
    redis_server: RedisServer, key_prefix: str
) -> None:
    backend = SingleRedisBackend(redis_server.url, POLICY, timeout_ms=10_000)
    store = ClusterStore(POLICY, backend, buckets=BUCKETS, key_prefix=key_prefix, timeout_ms=50)
    await store.open()
    try:
        await put(store, "job-2")
        bucket = bucket_of_task("job-2", BUCKETS)
        now = await store.now_ms()
        await store.views[bucket].scheduler_copy("barrier", 2, now + HOLD_MS)
        with pytest.raises(StoreUnavailable, match="epoch bump is in progress") as refused:
            await store.claim("job-2", ClaimRequest("w", 10_000, 1))
        assert not isinstance(refused.value, (ClaimsPaused, BumpBarrier))
        # The operator's pause, set during the barrier, is what answers CLAIMS_PAUSED.
        await store.set_claims_paused(True)
        with pytest.raises(ClaimsPaused):
            await store.claim("job-2", ClaimRequest("w", 10_000, 1))
    finally:
        await store.close()
