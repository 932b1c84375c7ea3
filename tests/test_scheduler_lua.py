"""The Lua side of a bucket's two safety mechanisms on the Redis Cluster store, on one real
redis-server (a bucket is a one-Redis store under a longer prefix, so one Redis runs the very
scripts a bucket runs).

- **The bump barrier** (``ledger.scheduler_copies``): scheduler.lua's copy steps, through
  ``RedisStore.scheduler_copy``, answer what the pure functions answer, step after step, on
  random sequences (hypothesis, deterministic as ``tests/test_scheduler_copies.py``), and a
  claim (by id and from a queue) meets the copy as ``claim_admission`` says: the operator's
  pause first (CLAIMS_PAUSED), then a live barrier (``BumpBarrier``, never a client's
  answer), else admitted under the copy's epoch.
- **The freeze** (a bucket whose slot moves to another node): every task script refuses,
  having written nothing at all under the store's prefix, until the bucket is thawed.

One Redis never sets either (``tests/test_stateful.py`` and the conformance tests hold its
scheduler to the one-record model unchanged).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import Phase as Search

from fencegate.ledger import scheduler_copies as sc
from fencegate.ledger.effects import Fence
from fencegate.ledger.errors import BumpBarrier, ClaimsPaused, NoSuchTask, StoreUnavailable
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.scheduler_copies import Copy, Intent
from fencegate.ledger.tasks import ClaimRequest, CommitRequest, Identity, LeasePolicy, RenewRequest
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

NOW = 1_800_000_000_000
POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)


def _store(url: str) -> RedisStore:
    store = RedisStore(
        url, POLICY, key_prefix=f"s{uuid.uuid4().hex[:10]}", timeout_ms=STORE_TIMEOUT_MS
    )
    store.clock_pinned_ms = NOW  # the scripts never read TIME
    return store


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    opened = _store(redis_server.url)
    yield opened
    await opened.close()


# --- the copy steps against the pure functions ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One copy step (``RedisStore.scheduler_copy``'s names and arguments) or a claim at an
    offset from ``NOW``."""

    op: str
    args: tuple[int, ...] = ()


TARGETS = st.integers(1, 6)
TIMES = st.integers(0, 8).map(lambda n: NOW + 250 * n)
STEPS = st.one_of(
    st.just(Step("read")),
    st.builds(lambda p: Step("begin_pause", (p,)), st.integers(0, 1)),
    st.builds(lambda p, g: Step("paused", (p, g)), st.integers(0, 1), st.integers(0, 6)),
    st.builds(lambda t, d: Step("begin_bump", (t, d)), TARGETS, TIMES),
    st.builds(lambda t, u: Step("barrier", (t, u)), TARGETS, TIMES),
    st.builds(lambda t: Step("bump", (t,)), TARGETS),
    st.builds(lambda t: Step("clear", (t,)), TARGETS),
    st.builds(lambda t: Step("end_bump", (t,)), TARGETS),
    st.builds(lambda at: Step("claim", (at,)), TIMES),
)


def _model(copy: Copy, intent: Intent | None, step: Step) -> tuple[Copy, Intent | None]:
    """The step on the pure model: the function of ``scheduler_copies`` it is named after."""
    a = step.args
    match step.op:
        case "begin_pause":
            return sc.begin_pause(copy, bool(a[0])), intent
        case "paused":
            return sc.with_paused(copy, bool(a[0]), a[1]), intent
        case "begin_bump":
            return copy, sc.begin_bump(intent, copy, a[0], a[1])
        case "barrier":
            return sc.with_barrier(copy, a[0], a[1]), intent
        case "bump":
            return sc.bumped(copy, a[0]), intent
        case "clear":
            return sc.without_barrier(copy, a[0]), intent
        case "end_bump":
            return copy, sc.end_bump(intent, a[0])
    return copy, intent


async def _claim_admission(store: RedisStore, at: int) -> sc.Admission | None:
    """A claim of a task that does not exist, at store time ``at``: what claim.lua's
    admission decided, as ``scheduler_copies.claim_admission`` would say it (Admit: the
    claim went on and found no task). None for an answer the admission cannot give."""
    store.clock_pinned_ms = at
    try:
        await store.claim("no-such-task", ClaimRequest("w", 60_000, 1))
    except ClaimsPaused:
        return sc.Paused(sc.scheduler_of(Copy(paused=True)))
    except BumpBarrier as barred:
        return sc.Barrier(barred.target, barred.retry_after_ms)
    except NoSuchTask:
        return sc.Admit(sc.scheduler_of(Copy()))
    return None


def _admission_kind(admission: sc.Admission) -> sc.Admission:
    """What the Lua answer shows of an admission: Paused and Admit carry no more than that
    (the epoch is checked by the claim itself), Barrier its target and wait."""
    if isinstance(admission, sc.Paused):
        return sc.Paused(sc.scheduler_of(Copy(paused=True)))
    if isinstance(admission, sc.Admit):
        return sc.Admit(sc.scheduler_of(Copy()))
    return admission


async def _replay(url: str, steps: list[Step]) -> None:
    store = _store(url)
    copy, intent = Copy(), None
    try:
        for step in steps:
            if step.op == "claim":
                at = step.args[0]
                got = await _claim_admission(store, at)
                event(f"claim: {type(got).__name__}")
                assert got == _admission_kind(sc.claim_admission(copy, at)), (step, copy)
                continue
            copy, intent = _model(copy, intent, step)
            assert await store.scheduler_copy(step.op, *step.args) == (copy, intent), step
        assert await store.scheduler_copy("read") == (copy, intent)
        scheduler = await store.get_scheduler()
        assert (scheduler.epoch, scheduler.claims_paused) == (copy.epoch, copy.paused)
    finally:
        await store.close()


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Search.explicit, Search.generate, Search.shrink],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=st.lists(STEPS, min_size=10, max_size=40))
def test_the_lua_copy_steps_answer_what_the_pure_functions_answer(
    redis_server: RedisServer, steps: list[Step]
) -> None:
    asyncio.run(_replay(redis_server.url, steps))


async def test_an_unknown_copy_step_is_refused_before_redis(store: RedisStore) -> None:
    with pytest.raises(ValueError):
        await store.scheduler_copy("bump")  # a target is required
    with pytest.raises(ValueError):
        await store.scheduler_copy("pause", 1)
    assert await store.scheduler_copy("read") == (Copy(), None)


# --- a claim meets the copy -----------------------------------------------------------------


async def test_a_claim_under_a_live_barrier_is_barred_until_the_barrier_is_cleared(
    store: RedisStore,
) -> None:
    await store.put_task("t1", "in", None, queue="q")
    await store.scheduler_copy("barrier", 2, NOW + 1_000)
    with pytest.raises(BumpBarrier) as barred:
        await store.claim("t1", ClaimRequest("w", 60_000, 1))
    assert (barred.value.target, barred.value.retry_after_ms) == (2, 1_000)
    assert barred.value.code == "STORE_UNAVAILABLE"  # should it ever escape: retryable
    with pytest.raises(BumpBarrier):
        await store.claim_next("q", ClaimRequest("w", 60_000, 1))
    assert (await store.get_task("t1")).state == "READY"  # nothing was applied

    await store.scheduler_copy("clear", 2)
    task = await store.claim("t1", ClaimRequest("w", 60_000, 1))
    assert task.state == "CLAIMED" and task.claim_epoch == 1


async def test_a_barrier_past_its_deadline_no_longer_holds_claims(store: RedisStore) -> None:
    await store.put_task("t1", "in", None, queue="q")
    await store.scheduler_copy("barrier", 2, NOW + 1_000)
    store.clock_pinned_ms = NOW + 999
    with pytest.raises(BumpBarrier) as barred:
        await store.claim_next("q", ClaimRequest("w", 60_000, 1))
    assert barred.value.retry_after_ms == 1
    store.clock_pinned_ms = NOW + 1_000
    task = await store.claim_next("q", ClaimRequest("w", 60_000, 1))
    assert task is not None and task.claim_epoch == 1  # under the copy's own epoch


async def test_a_barrier_never_reaches_renew_or_commit(store: RedisStore) -> None:
    """Renew, prepare and commit are checked against the copy's epoch, which the barrier
    has not moved: a claim granted before it goes on to its commit."""
    await store.put_task("t1", "in", None)
    task = await store.claim("t1", ClaimRequest("w", 60_000, 1))
    assert task.attempt_id is not None
    await store.scheduler_copy("barrier", 2, NOW + 1_000)
    ident = Identity(task.attempt_id, 1, "w", 1, 0)
    await store.renew("t1", RenewRequest(ident, 60_000))
    done, _ = await store.commit("t1", CommitRequest(task.attempt_id, 1, 1, 0, "in", "r"))
    assert done.state == "COMMITTED"


async def test_pause_then_bump_keeps_claims_paused_through_every_phase(store: RedisStore) -> None:
    """The rollback runbook on one bucket: pause, bump (five phases), check: CLAIMS_PAUSED at
    every phase, never the barrier's answer, and still paused at the new epoch."""
    await store.put_task("t1", "in", None)
    copy, _ = await store.scheduler_copy("begin_pause", 1)
    assert copy.paused and copy.pause_generation == 1
    target = sc.bump_target([copy])
    phases: list[tuple[str, tuple[int, ...]]] = [
        ("begin_bump", (target, NOW + sc.BARRIER_MS)),
        ("barrier", (target, NOW + sc.BARRIER_MS)),
        ("bump", (target,)),
        ("clear", (target,)),
        ("end_bump", (target,)),
    ]
    for op, args in phases:
        await store.scheduler_copy(op, *args)
        for epoch in (1, target):
            with pytest.raises(ClaimsPaused, match="paused by an operator"):
                await store.claim("t1", ClaimRequest("w", 60_000, epoch))
    assert await store.scheduler_copy("read") == (
        Copy(epoch=target, paused=True, pause_generation=1),
        None,
    )
    scheduler = await store.get_scheduler()
    assert scheduler.epoch == target and scheduler.claims_paused


# --- the freeze -----------------------------------------------------------------------------


def _snapshot(url: str, prefix: str) -> dict[bytes, bytes | None]:
    """Every key under the store's prefix, as DUMP serializes it (its whole value), but the
    gateways' write marks (``Keys.write_mark``: counters of the batches a gateway sent, not
    store data)."""
    client = redis.Redis.from_url(url)
    try:
        found = sorted(client.scan_iter(match=f"{prefix}:*", count=1000))
        marks = f"{prefix}:write-mark:".encode()
        return {key: client.dump(key) for key in found if not key.startswith(marks)}
    finally:
        client.close()


async def test_every_task_script_refuses_a_frozen_bucket_having_written_nothing(
    store: RedisStore, redis_server: RedisServer
) -> None:
    prefix = store._keys.prefix
    # A store with a bit of everything the task scripts touch: a claimed task in a queue, its
    # open dependent, a committed (settled) task, a cancelled chain with a recorded cascade.
    await store.put_task("a", "in", None, queue="q")
    await store.put_task("b", "in", None, queue="q", depends_on=("a",))
    held = await store.claim("a", ClaimRequest("w", 60_000, 1))
    assert held.attempt_id is not None
    await store.put_task("c", "in", None)
    c = await store.claim("c", ClaimRequest("w", 60_000, 1))
    assert c.attempt_id is not None
    await store.commit("c", CommitRequest(c.attempt_id, 1, 1, 0, "in", "r"))
    store.max_cascade = 0
    await store.put_task("d", "in", None)
    await store.put_task("e", "in", None, depends_on=("d",))
    await store.cancel("d")  # e's cancel is left to the recorded cascade
    await store.put_task("f", "in", None, queue="q")
    await store.migrate()  # a new store's format: retention runs
    assert (await store.expire_settled(10**9, 1_000, 10)).expired_tasks == 0

    await store.freeze_bucket("slot 1234 to node 7")
    assert await store.bucket_frozen() == "slot 1234 to node 7"
    before = _snapshot(redis_server.url, prefix)
    ident = Identity(held.attempt_id, 1, "w", 1, 0)
    steps: dict[str, Callable[[], Awaitable[object]]] = {
        "put (create)": lambda: store.put_task("g", "in", None, depends_on=("a",)),
        "put (revise)": lambda: store.put_task("c", "in-2", None),
        "claim": lambda: store.claim("f", ClaimRequest("w", 60_000, 1)),
        "claim_next": lambda: store.claim_next("q", ClaimRequest("w", 60_000, 1)),
        "renew": lambda: store.renew("a", RenewRequest(ident, 60_000)),
        "release": lambda: store.release("a", ident),
        "commit": lambda: store.commit("a", CommitRequest(held.attempt_id, 1, 1, 0, "in", "r")),
        "cancel": lambda: store.cancel("b"),
        "cascade": lambda: store.continue_cascades(10),
        "retention": lambda: store.expire_settled(0, 1_000, 10),
        "settled_index": lambda: store._index_settled(again=True),
    }
    for name, step in steps.items():
        with pytest.raises(StoreUnavailable) as refused:
            await step()
        assert "nothing was applied; the bucket is moving" in str(refused.value), name
        assert _snapshot(redis_server.url, prefix) == before, name

    # The effect steps declare every key they touch: a frozen bucket does not stop them
    # (a fence check, read-only, here).
    await store.check_fence(Fence("a", held.attempt_id, 1, 1, 0))
    # The prefix search reads keyed records it does not declare: refused while frozen (its
    # catch-up first, index_catch_up.lua, finds nothing waiting and refuses nothing).
    with pytest.raises(StoreUnavailable, match="nothing was read; the bucket is moving"):
        await store.find_effects("ab", 10)

    await store.thaw_bucket()
    assert await store.bucket_frozen() is None
    assert await store.find_effects("ab", 10) == []
    await store.release("a", ident)
    assert await store.continue_cascades(10) == 2  # the record and e's cancel
    assert (await store.get_task("e")).state == "CANCELLED"


async def test_a_paused_store_answers_claims_paused_while_frozen(store: RedisStore) -> None:
    """The operator's pause is the answer a caller acts on, frozen or not."""
    await store.put_task("t1", "in", None)
    await store.set_claims_paused(True)
    await store.freeze_bucket("moving")
    with pytest.raises(ClaimsPaused):
        await store.claim("t1", ClaimRequest("w", 60_000, 1))
    await store.set_claims_paused(False)
    with pytest.raises(StoreUnavailable, match="moving to another node"):
        await store.claim("t1", ClaimRequest("w", 60_000, 1))
    with pytest.raises(ValueError):
        await store.freeze_bucket("")
