"""Keyed effects on every store (issue 28): a lease-less client's effect, identified by its
principal, downstream and idempotency key (``effects.keyed_effect_id``), has the ledger
states, replays and UNKNOWN rules of a leased one, no task fields, and its own retention
(``effects.keyed_settled``, ``retention.why_kept_keyed``); its UNKNOWN ones are counted apart
in the gauges (``Gauges.unknown_keyed_effects``).

Each test drives a real store (SQLite file, our own redis-server, our own PostgreSQL) through
``Store``; time moves with the stores' test clock (``clock_offset_ms``), never by sleeping.
The HTTP and MCP forms (executions counted at the downstream) are the gateway's tests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest

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
from fencegate.ledger.errors import EffectExpired, NoSuchEffect
from fencegate.ledger.keys import Keys
from fencegate.ledger.queries import Gauges
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest, CommitRequest, LeasePolicy
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

SETTLED_MS = 60_000
TOMBSTONE_MS = 600_000
#: Long enough that no forward of these tests runs past its deadline (the clock moves on by
#: SETTLED_MS at a time).
DEADLINE = 10 * SETTLED_MS
RESPONSE = '{"status":201,"headers":[],"body":"paid"}'


def keyed(key: str, digest: str = "d1", principal: str = "agent") -> EffectRequest:
    """A lease-less client's POST under ``key``, a fresh forward id per call."""
    return EffectRequest(
        None,
        "",
        "",
        "pay",
        "POST",
        "/charges",
        digest,
        forward_id=uuid.uuid4().hex,
        client_key=ClientKey(principal, key),
    )


async def prepare(store: Store, request: EffectRequest, **kwargs: bool) -> PrepareOutcome:
    return await store.prepare_effect(request, DEADLINE, **kwargs)


async def complete(
    store: Store, prepared: PrepareOutcome, outcome: EffectState, response: str | None = None
) -> Effect:
    assert prepared.action is Action.FORWARD
    attempt = prepared.effect.attempts[-1]
    done, applied = await store.complete_effect(
        None,
        prepared.effect.effect_id,
        prepared.seq,
        attempt.attempt_id,
        outcome,
        "test",
        response,
    )
    assert applied
    return done


async def settled(store: Store, key: str, state: EffectState) -> Effect:
    """A keyed effect forwarded once, its outcome recorded as ``state``."""
    prepared = await prepare(store, keyed(key))
    return await complete(
        store, prepared, state, RESPONSE if state is EffectState.COMMITTED else None
    )


async def sweep(store: Store, limit: int = 100) -> tuple[int, int, dict[str, int]]:
    """Run the sweep until a step finds nothing; (examined, expired effects, kept)."""
    examined = expired = 0
    kept: dict[str, int] = {}
    for _ in range(50):
        report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, limit)
        examined += report.examined
        expired += report.expired_effects
        for reason, n in report.kept.items():
            kept[reason] = kept.get(reason, 0) + n
        if report.examined < limit:
            return examined, expired, kept
    raise AssertionError("the sweep never ran dry")


def assert_keyed(effect: Effect, key: str, principal: str = "agent") -> None:
    assert effect.kind == "keyed"
    assert (effect.task_id, effect.revision, effect.node, effect.slot) == (None,) * 4
    assert (effect.principal, effect.idempotency_key) == (principal, key)
    assert effect.effect_id == effects.keyed_effect_id(principal, "pay", key)


async def test_a_keyed_effect_forwards_once_then_replays(store: Store) -> None:
    _, start = await store.read_events(None, 10)
    first = await prepare(store, keyed("k1"))
    assert first.action is Action.FORWARD
    assert_keyed(first.effect, "k1")
    attempt = first.effect.attempts[-1]
    assert (attempt.claim_generation, attempt.attempt_id) == (0, attempt.forward_id)
    assert first.effect.requested_by == "agent"
    done = await complete(store, first, EffectState.COMMITTED, RESPONSE)
    assert done.state is EffectState.COMMITTED

    again = await prepare(store, keyed("k1"))
    assert again.action is Action.REPLAY
    assert again.effect.response_json == RESPONSE and len(again.effect.attempts) == 1

    record = await store.get_effect(first.effect.effect_id)
    assert_keyed(record, "k1")
    assert record.state is EffectState.COMMITTED
    listed, _ = await store.list_effects(
        state=None, task_id=None, downstream="pay", limit=10, cursor=None
    )
    assert [e.effect_id for e in listed] == [first.effect.effect_id]
    assert_keyed(listed[0], "k1")
    events, _ = await store.read_events(start, 10)
    assert [(e.body["effectId"], e.body["taskId"], e.body["state"]) for e in events] == [
        (first.effect.effect_id, None, "PREPARED"),
        (first.effect.effect_id, None, "COMMITTED"),
    ]


async def test_a_keyed_effect_is_not_listed_under_a_task(store: Store) -> None:
    await settled(store, "k1", EffectState.COMMITTED)
    await store.put_task("t1", "in", None)
    task = await store.claim("t1", ClaimRequest("w", 10_000, 1))
    assert task.attempt_id is not None
    listed, _ = await store.list_effects(
        state=None, task_id="t1", downstream=None, limit=10, cursor=None
    )
    assert listed == []
    await store.commit("t1", CommitRequest(task.attempt_id, task.claim_generation, 1, 0, "in", "r"))


async def test_the_same_key_with_another_payload_is_a_conflict(store: Store) -> None:
    await settled(store, "k1", EffectState.COMMITTED)
    other = await prepare(store, keyed("k1", digest="d2"))
    assert other.action is Action.REJECT
    assert other.error is not None and other.error.code == "PAYLOAD_CONFLICT"
    assert other.error.status == 422


async def test_a_duplicate_while_the_first_is_in_flight_is_refused(store: Store) -> None:
    first = await prepare(store, keyed("k1"))
    assert first.action is Action.FORWARD
    second = await prepare(store, keyed("k1"))
    assert second.action is Action.REJECT
    assert second.error is not None and second.error.code == "EFFECT_IN_FLIGHT"
    await complete(store, first, EffectState.COMMITTED, RESPONSE)
    assert (await prepare(store, keyed("k1"))).action is Action.REPLAY


async def test_concurrent_duplicates_forward_once(store: Store) -> None:
    outcomes = await asyncio.gather(*(prepare(store, keyed("k1")) for _ in range(8)))
    actions = sorted(o.action.value for o in outcomes)
    assert actions == ["FORWARD"] + ["REJECT"] * 7
    assert {o.error.code for o in outcomes if o.error is not None} == {"EFFECT_IN_FLIGHT"}


async def test_an_unknown_keyed_effect_goes_again_only_once_resolved_not_applied(
    store: Store,
) -> None:
    lost = await settled(store, "k1", EffectState.UNKNOWN)
    for _ in range(2):
        retry = await prepare(store, keyed("k1"))
        assert retry.action is Action.REJECT
        assert retry.error is not None and retry.error.code == "EFFECT_UNKNOWN"
    assert [e.effect_id for e in await store.unsettled_effects(10, frozenset({"pay"}))] == [
        lost.effect_id
    ]

    resolved = await store.update_effect(
        lost.effect_id,
        lambda record, now: effects.resolve(
            record, EffectState.NOT_APPLIED, "checked the ledger", "ops", None, now
        ),
    )
    assert resolved.state is EffectState.NOT_APPLIED
    assert_keyed(resolved, "k1")
    retry = await prepare(store, keyed("k1"))
    assert retry.action is Action.FORWARD and len(retry.effect.attempts) == 2
    await complete(store, retry, EffectState.COMMITTED, RESPONSE)
    assert (await prepare(store, keyed("k1"))).action is Action.REPLAY


async def test_two_principals_with_the_same_key_have_two_effects(store: Store) -> None:
    mine = await prepare(store, keyed("k1", principal="alice"))
    theirs = await prepare(store, keyed("k1", principal="bob", digest="d2"))
    assert (mine.action, theirs.action) == (Action.FORWARD, Action.FORWARD)
    assert mine.effect.effect_id != theirs.effect.effect_id
    assert_keyed(mine.effect, "k1", "alice")
    assert_keyed(theirs.effect, "k1", "bob")
    await complete(store, mine, EffectState.COMMITTED, RESPONSE)
    # Bob's is still in flight: Alice's outcome is not his.
    bob_again = await prepare(store, keyed("k1", principal="bob", digest="d2"))
    assert bob_again.error is not None and bob_again.error.code == "EFFECT_IN_FLIGHT"


async def test_retention_deletes_a_settled_keyed_effect_and_its_tombstone_refuses_a_duplicate(
    store: Store,
) -> None:
    done = await settled(store, "k1", EffectState.COMMITTED)
    assert await sweep(store) == (0, 0, {})  # not settled for long enough yet
    store.clock_offset_ms += SETTLED_MS
    examined, expired, kept = await sweep(store)
    assert (examined, expired, kept) == (1, 1, {})

    with pytest.raises(EffectExpired) as gone:
        await store.get_effect(done.effect_id)
    assert gone.value.status == 410 and isinstance(gone.value, NoSuchEffect)
    assert gone.value.extra["effectState"] == "COMMITTED"
    with pytest.raises(EffectExpired) as late:
        await prepare(store, keyed("k1"))
    assert late.value.code == "EFFECT_EXPIRED"
    assert late.value.extra["forgetAt"] == gone.value.extra["forgetAt"]
    stats = await store.store_stats(SETTLED_MS)
    assert (stats.effects, stats.effect_tombstones) == (0, 1)

    store.clock_offset_ms += TOMBSTONE_MS
    await sweep(store)
    fresh = await prepare(store, keyed("k1"))
    assert fresh.action is Action.FORWARD and len(fresh.effect.attempts) == 1


async def test_retention_keeps_unknown_awaiting_and_in_flight_keyed_effects(
    store: Store,
) -> None:
    unknown = await settled(store, "unknown", EffectState.UNKNOWN)
    awaiting = await prepare(store, keyed("awaiting"), require_approval=True)
    assert awaiting.action is Action.REJECT
    assert awaiting.error is not None and awaiting.error.code == "APPROVAL_REQUIRED"
    # Resolved NOT_APPLIED (settled: in the index), then forwarded again (out of it).
    again = await settled(store, "again", EffectState.UNKNOWN)
    await store.update_effect(
        again.effect_id,
        lambda record, now: effects.resolve(
            record, EffectState.NOT_APPLIED, "never arrived", "ops", None, now
        ),
    )
    in_flight = await prepare(store, keyed("again"))
    assert in_flight.action is Action.FORWARD
    not_applied = await settled(store, "failed", EffectState.NOT_APPLIED)

    store.clock_offset_ms += SETTLED_MS
    examined, expired, _ = await sweep(store)
    assert (examined, expired) == (1, 1)  # only the settled NOT_APPLIED one
    with pytest.raises(EffectExpired):
        await store.get_effect(not_applied.effect_id)
    assert (await store.get_effect(unknown.effect_id)).state is EffectState.UNKNOWN
    kept = await store.get_effect(awaiting.effect.effect_id)
    assert kept.state is EffectState.NOT_APPLIED and effects.is_awaiting_approval(kept)
    assert (await store.get_effect(again.effect_id)).state is EffectState.PREPARED

    # Settled later, it is due settled_ms after that, not after it first settled.
    await complete(store, in_flight, EffectState.COMMITTED, RESPONSE)
    assert await sweep(store) == (0, 0, {})
    store.clock_offset_ms += SETTLED_MS
    assert await sweep(store) == (1, 1, {})
    with pytest.raises(EffectExpired):
        await prepare(store, keyed("again"))


async def leased_unknown(store: Store, task_id: str) -> Effect:
    """A worker's effect on a new task, forwarded once, its outcome UNKNOWN."""
    await store.put_task(task_id, "in", None)
    task = await store.claim(task_id, ClaimRequest("w", 10_000, 1))
    assert task.attempt_id is not None
    fence = Fence(task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    request = EffectRequest(fence, "node", "s", "pay", "POST", "/pay", "d1")
    prepared = await store.prepare_effect(request, DEADLINE)
    assert prepared.action is Action.FORWARD
    done, applied = await store.complete_effect(
        task_id, prepared.effect.effect_id, 0, task.attempt_id, EffectState.UNKNOWN, "test", None
    )
    assert applied and done.state is EffectState.UNKNOWN
    return done


def unknown_gauges(gauges: Gauges) -> tuple[int, int, int]:
    """(PREPARED still running, UNKNOWN, of which keyed)."""
    return gauges.prepared_effects, gauges.unknown_effects, gauges.unknown_keyed_effects


async def test_the_gauges_count_the_keyed_unknown_effects_apart(store: Store) -> None:
    """``Gauges.unknown_keyed_effects`` (``fencegate_unknown_effects{kind="keyed"}``): the
    keyed ones of ``unknown_effects`` by the same rule, a keyed PREPARED past its deadline
    included; a leased UNKNOWN counts in the total only."""
    assert unknown_gauges(await store.gauges()) == (0, 0, 0)
    lost = await settled(store, "lost", EffectState.UNKNOWN)
    await settled(store, "done", EffectState.COMMITTED)
    brief = await store.prepare_effect(keyed("brief"), 1_000)
    assert brief.action is Action.FORWARD
    await leased_unknown(store, "t1")
    assert unknown_gauges(await store.gauges()) == (1, 2, 1)

    store.clock_offset_ms += 1_000  # the brief forward's deadline: it reads UNKNOWN
    assert unknown_gauges(await store.gauges()) == (0, 3, 2)

    await store.update_effect(
        lost.effect_id,
        lambda record, now: effects.resolve(
            record, EffectState.NOT_APPLIED, "never arrived", "ops", None, now
        ),
    )
    assert unknown_gauges(await store.gauges()) == (0, 2, 1)
    # The late answer of the overdue forward still settles it.
    await complete(store, brief, EffectState.COMMITTED, RESPONSE)
    assert unknown_gauges(await store.gauges()) == (0, 1, 0)


async def test_redis_keeps_the_keyed_gauge_indexes_for_keyed_records_only(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    """The keyed companions of the prepared and unknown indexes hold exactly the keyed
    members, and no leased step (prepare, complete, an operator's write) creates them."""
    server = make_redis_server()
    store = RedisStore(
        server.url,
        LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000),
        timeout_ms=STORE_TIMEOUT_MS,
    )
    await store.open()
    admin = server.client()
    keys = Keys()
    try:
        leased = await leased_unknown(store, "t1")
        await store.update_effect(
            leased.effect_id,
            lambda record, now: effects.resolve(
                record, EffectState.COMMITTED, "checked", "ops", None, now
            ),
        )
        await leased_unknown(store, "t2")
        assert not admin.exists(keys.keyed_prepared, keys.keyed_unknown)

        brief = await store.prepare_effect(keyed("brief"), 1_000)
        eid = brief.effect.effect_id
        assert admin.zscore(keys.keyed_prepared, eid) == admin.zscore(keys.prepared, eid)
        assert not admin.exists(keys.keyed_unknown)
        await complete(store, brief, EffectState.UNKNOWN)
        assert not admin.exists(keys.keyed_prepared)
        assert admin.smembers(keys.keyed_unknown) == {eid}
        assert admin.scard(keys.unknown) == 2
        await store.update_effect(
            eid,
            lambda record, now: effects.resolve(
                record, EffectState.NOT_APPLIED, "never arrived", "ops", None, now
            ),
        )
        assert not admin.exists(keys.keyed_prepared, keys.keyed_unknown)
        assert unknown_gauges(await store.gauges()) == (0, 1, 0)
    finally:
        admin.close()
        await store.close()
