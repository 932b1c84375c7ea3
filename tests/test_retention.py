"""Retention on every store (ledger.retention): settled tasks and their effects expire, live
ones never do, and what expired cannot come back as new work.

Each test drives a real store (SQLite file, our own redis-server, our own PostgreSQL) through
``Store``; time moves with the stores' test clock (``clock_offset_ms``), never by sleeping.
"""

from __future__ import annotations

import pytest

from fencegate.ledger import effects
from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import EffectExpired, NoSuchEffect, NoSuchTask, TaskExpired
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    PutOutcome,
    Task,
    TaskState,
)

SETTLED_MS = 60_000
TOMBSTONE_MS = 600_000
TTL = 10_000
DEADLINE = 5_000


def claim_as(owner: str) -> ClaimRequest:
    return ClaimRequest(owner=owner, ttl_ms=TTL, scheduler_epoch=1)


def fence_of(task: Task) -> Fence:
    assert task.attempt_id is not None
    return Fence(task.task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)


def request(task: Task, slot: str, digest: str = "d1") -> EffectRequest:
    return EffectRequest(fence_of(task), "main", slot, "api", "POST", "/x", digest)


async def effect_done(store: Store, task: Task, slot: str, state: EffectState) -> str:
    """A forwarded effect whose outcome is recorded as ``state``; returns its id."""
    prepared = await store.prepare_effect(request(task, slot), DEADLINE)
    assert prepared.action is Action.FORWARD
    assert task.attempt_id is not None
    await store.complete_effect(
        task.task_id, prepared.effect.effect_id, 0, task.attempt_id, state, "test", None
    )
    return prepared.effect.effect_id


async def commit(store: Store, task: Task, input_digest: str) -> Task:
    assert task.attempt_id is not None
    done, _ = await store.commit(
        task.task_id,
        CommitRequest(
            task.attempt_id, task.claim_generation, 1, task.cancel_generation, input_digest, "r"
        ),
    )
    return done


async def committed_with_effects(store: Store, task_id: str, slots: int = 2) -> list[str]:
    await store.put_task(task_id, f"in-{task_id}", None)
    task = await store.claim(task_id, claim_as("w"))
    ids = [await effect_done(store, task, f"s{i}", EffectState.COMMITTED) for i in range(slots)]
    await commit(store, task, f"in-{task_id}")
    return ids


async def sweep(store: Store, limit: int = 100) -> tuple[int, int, dict[str, int]]:
    """Run the sweep until a step finds nothing; (tasks, effects, kept) expired/kept."""
    tasks = effs = 0
    kept: dict[str, int] = {}
    for _ in range(50):
        report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, limit)
        tasks += report.expired_tasks
        effs += report.expired_effects
        for reason, n in report.kept.items():
            kept[reason] = kept.get(reason, 0) + n
        if report.examined < limit:
            return tasks, effs, kept
    raise AssertionError("the sweep never ran dry")


async def test_a_settled_task_expires_with_its_effects_and_leaves_tombstones(
    store: Store,
) -> None:
    effect_ids = await committed_with_effects(store, "done")
    assert await sweep(store) == (0, 0, {})  # not settled for long enough yet
    store.clock_offset_ms += SETTLED_MS
    tasks, effs, _ = await sweep(store)
    assert (tasks, effs) == (1, 2)

    with pytest.raises(TaskExpired) as gone:
        await store.get_task("done")
    assert gone.value.status == 410 and isinstance(gone.value, NoSuchTask)
    assert gone.value.extra["revision"] == 1
    with pytest.raises(TaskExpired):
        await store.claim("done", claim_as("late"))
    with pytest.raises(EffectExpired) as effect_gone:
        await store.get_effect(effect_ids[0])
    assert effect_gone.value.extra["effectState"] == "COMMITTED"
    assert isinstance(effect_gone.value, NoSuchEffect)
    listed, _ = await store.list_effects(
        state=None, task_id="done", downstream=None, limit=10, cursor=None
    )
    assert listed == []
    stats = await store.store_stats(SETTLED_MS)
    assert (stats.tasks, stats.effects, stats.settled_tasks) == (0, 0, 0)
    assert (stats.task_tombstones, stats.effect_tombstones) == (1, 2)


async def test_the_same_input_again_is_refused_and_a_new_one_continues_the_numbers(
    store: Store,
) -> None:
    await store.put_task("t", "in-1", None)
    first = await store.claim("t", claim_as("a"))
    await store.release("t", Identity(first.attempt_id or "", first.claim_generation, "a", 1, 0))
    second = await store.claim("t", claim_as("b"))
    old_effect = await effect_done(store, second, "send", EffectState.COMMITTED)
    await commit(store, second, "in-1")
    store.clock_offset_ms += SETTLED_MS
    assert (await sweep(store))[0] == 1

    # A scheduler re-sending yesterday's PUT: the work was done, it is not run again.
    with pytest.raises(TaskExpired):
        await store.put_task("t", "in-1", None)
    # New input: the task is created again, after the old revision and generations.
    again, outcome = await store.put_task("t", "in-2", None)
    assert outcome is PutOutcome.CREATED
    assert (again.revision, again.claim_generation) == (2, second.claim_generation)
    claimed = await store.claim("t", claim_as("c"))
    assert claimed.claim_generation == second.claim_generation + 1
    # Same slot, new revision: a different effect, so nothing of the old one is replayed.
    prepared = await store.prepare_effect(request(claimed, "send"), DEADLINE)
    assert prepared.action is Action.FORWARD
    assert prepared.effect.effect_id != old_effect
    assert (await store.store_stats(SETTLED_MS)).task_tombstones == 0


async def test_live_tasks_and_unsettled_effects_are_never_removed(store: Store) -> None:
    await store.put_task("ready", "in", None)
    await store.put_task("claimed", "in", None)
    await store.claim("claimed", claim_as("w"))
    await store.put_task("keep::never", "in", None)
    await store.put_task("keep::waiting", "in", None, depends_on=("keep::never",))
    # Committed, but one effect's outcome is unknown: an operator still has to look at it.
    await store.put_task("unknown", "in-unknown", None)
    task = await store.claim("unknown", claim_as("w"))
    unknown = await effect_done(store, task, "s", EffectState.UNKNOWN)
    await commit(store, task, "in-unknown")
    # Committed while a forward is still in flight (PREPARED, its deadline far away).
    await store.put_task("inflight", "in-inflight", None)
    task = await store.claim("inflight", claim_as("w"))
    in_flight = await store.prepare_effect(request(task, "s"), 10 * SETTLED_MS)
    await commit(store, task, "in-inflight")
    # Cancelled while its effect waits for an operator's approval.
    await store.put_task("approval", "in", None)
    task = await store.claim("approval", claim_as("w"))
    waiting = await store.prepare_effect(request(task, "s"), DEADLINE, require_approval=True)
    assert waiting.action is Action.REJECT
    await store.cancel("approval")

    store.clock_offset_ms += 5 * SETTLED_MS
    tasks, _, kept = await sweep(store)
    assert tasks == 0
    assert kept == {"unsettled_effect": 2, "awaiting_approval": 1}
    for task_id, state in [
        ("ready", TaskState.READY),
        ("claimed", TaskState.CLAIMED),
        ("keep::waiting", TaskState.WAITING),
        ("keep::never", TaskState.READY),
        ("unknown", TaskState.COMMITTED),
        ("inflight", TaskState.COMMITTED),
        ("approval", TaskState.CANCELLED),
    ]:
        assert (await store.get_task(task_id)).state is state
    assert (await store.get_effect(unknown)).state is EffectState.UNKNOWN
    assert (await store.get_effect(in_flight.effect.effect_id)).state is EffectState.PREPARED

    # Once the operator settles it, the task goes at the next due time (settled_ms later).
    await store.update_effect(
        unknown,
        lambda record, now: effects.resolve(
            record, EffectState.NOT_APPLIED, "checked", "op", None, now
        ),
    )
    assert (await sweep(store))[0] == 0  # moved to the back when it was found needed
    store.clock_offset_ms += SETTLED_MS
    assert (await sweep(store))[0] == 1
    with pytest.raises(TaskExpired):
        await store.get_task("unknown")


async def test_a_dependency_stays_while_a_task_that_depends_on_it_exists(store: Store) -> None:
    await store.put_task("keep::first", "in-first", None)
    task = await store.claim("keep::first", claim_as("w"))
    await commit(store, task, "in-first")
    await store.put_task("keep::second", "in-second", None, depends_on=("keep::first",))
    task = await store.claim("keep::second", claim_as("w"))
    store.clock_offset_ms += SETTLED_MS
    assert (await sweep(store))[2] == {"dependents": 1}
    await commit(store, task, "in-second")
    store.clock_offset_ms += SETTLED_MS
    # The dependent goes first; its dependency when next due.
    assert (await sweep(store))[0] == 1
    with pytest.raises(TaskExpired):
        await store.get_task("keep::second")
    store.clock_offset_ms += SETTLED_MS
    assert (await sweep(store))[0] == 1
    with pytest.raises(TaskExpired):
        await store.get_task("keep::first")


async def test_a_held_task_does_not_stop_the_sweep(store: Store) -> None:
    """The oldest settled task is still needed: it moves to the back, and a sweep of one
    task per step still reaches the ones behind it."""
    await store.put_task("held", "in-held", None)
    task = await store.claim("held", claim_as("w"))
    await effect_done(store, task, "s", EffectState.UNKNOWN)
    await commit(store, task, "in-held")
    store.clock_offset_ms += 1
    for i in range(3):
        await committed_with_effects(store, f"free{i}", slots=1)
    store.clock_offset_ms += SETTLED_MS
    tasks, effs, kept = await sweep(store, limit=1)
    assert (tasks, effs, kept) == (3, 3, {"unsettled_effect": 1})
    assert (await store.get_task("held")).state is TaskState.COMMITTED


async def test_a_cancelled_task_expires_and_tombstones_are_forgotten(store: Store) -> None:
    await store.put_task("c", "in", None)
    await store.cancel("c")
    store.clock_offset_ms += SETTLED_MS
    assert (await sweep(store))[0] == 1
    with pytest.raises(TaskExpired):
        await store.get_task("c")
    # Past tombstone_ms nothing is remembered: the id is new again (the documented bound:
    # keep tombstones longer than any downstream's deduplication window).
    store.clock_offset_ms += TOMBSTONE_MS
    with pytest.raises(NoSuchTask) as missing:
        await store.get_task("c")
    assert not isinstance(missing.value, TaskExpired)
    report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    assert report.forgotten >= 1
    assert (await store.store_stats(SETTLED_MS)).task_tombstones == 0
    fresh, outcome = await store.put_task("c", "in", None)
    assert (outcome, fresh.revision, fresh.claim_generation) == (PutOutcome.CREATED, 1, 0)


async def test_stats_count_what_is_there_and_what_is_due(store: Store) -> None:
    await committed_with_effects(store, "a", slots=2)
    await store.put_task("b", "in", None)
    await store.claim("b", claim_as("w"))
    stats = await store.store_stats(SETTLED_MS)
    assert (stats.tasks, stats.claimed_tasks, stats.settled_tasks, stats.due_tasks) == (2, 1, 1, 0)
    assert stats.effects == 2
    assert stats.events > 0
    assert stats.bytes is None or stats.bytes > 0
    store.clock_offset_ms += SETTLED_MS
    assert (await store.store_stats(SETTLED_MS)).due_tasks == 1


def test_why_kept_names_the_unsettled_effect_before_an_approval_whatever_the_order() -> None:
    """Pure: the reason does not depend on the order a store lists the effects in."""
    from dataclasses import replace

    from fencegate.ledger.effects import Effect, EffectAttempt
    from fencegate.ledger.retention import why_kept

    task = Task("t", TaskState.COMMITTED, 1, "in", 0, 0)
    base = Effect(
        "e" * 64, "t", 1, "main", "s", "api", "POST", "/x", "d", EffectState.UNKNOWN, 0, 0
    )
    unknown = replace(base, attempts=(EffectAttempt("a", 1, 0),))
    waiting = replace(base, effect_id="f" * 64, state=EffectState.NOT_APPLIED)  # no attempt
    done = replace(base, effect_id="0" * 64, state=EffectState.COMMITTED)
    assert why_kept(task, [waiting, unknown], False, 10) == "unsettled_effect"
    assert why_kept(task, [unknown, waiting], False, 10) == "unsettled_effect"
    assert why_kept(task, [done, waiting], False, 10) == "awaiting_approval"
    assert why_kept(task, [done], True, 10) == "dependents"
    assert why_kept(task, [done], False, 10) is None
    assert why_kept(replace(task, state=TaskState.READY), [], False, 10) == "open"
