"""``Store.awaiting_approval``: the operator's approval queue from each store's own index
(SQL condition, Redis set), on every store: only effects that wait for an approval, oldest
first, bounded; not a scan of NOT_APPLIED records, which retention may keep by the thousand
(the console's "Needs attention" page reads it)."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.state import STORE
from fencegate.ledger import effects
from fencegate.ledger.effects import Action, EffectState
from fencegate.ledger.store import Store
from tests.api import Api
from tests.conftest import build_test_store, make_config
from tests.test_retention import DEADLINE, claim_as, effect_done, request


async def test_only_effects_awaiting_approval_are_listed_oldest_first(store: Store) -> None:
    waiting: list[str] = []
    for n in range(4):
        await store.put_task(f"t{n}", "in", None)
        task = await store.claim(f"t{n}", claim_as("w"))
        # Settled NOT_APPLIED after a forward: not waiting for anyone.
        await effect_done(store, task, "done", EffectState.NOT_APPLIED)
        await effect_done(store, task, "sent", EffectState.COMMITTED)
        held = await store.prepare_effect(request(task, "mail"), DEADLINE, require_approval=True)
        assert held.action is Action.REJECT
        waiting.append(held.effect.effect_id)
        store.clock_offset_ms += 1_000  # each later than the one before
    assert [e.effect_id for e in await store.awaiting_approval(10)] == waiting
    assert [e.effect_id for e in await store.awaiting_approval(2)] == waiting[:2]
    assert await store.awaiting_approval(0) == []

    # Approved and sent: no longer waiting.
    await store.update_effect(
        waiting[0], lambda e, now: effects.approve(e, "alice", "ok", None, 60_000, now)
    )
    task = await store.get_task("t0")
    sent = await store.prepare_effect(request(task, "mail"), DEADLINE, require_approval=True)
    assert sent.action is Action.FORWARD
    assert [e.effect_id for e in await store.awaiting_approval(10)] == waiting[1:]


async def test_the_api_lists_them_and_refuses_other_filters_with_them(
    store_url: str, key_prefix: str
) -> None:
    """``GET /v1/effects?awaitingApproval=true``: the same list, oldest first, one page."""
    config = make_config(store_url, key_prefix, reconciler={"enabled": False})
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        store = client.app[STORE]
        waiting: list[str] = []
        for n in range(3):
            await store.put_task(f"t{n}", "in", None)
            task = await store.claim(f"t{n}", claim_as("w"))
            await effect_done(store, task, "done", EffectState.NOT_APPLIED)
            held = await store.prepare_effect(
                request(task, "mail"), DEADLINE, require_approval=True
            )
            waiting.append(held.effect.effect_id)
            store.clock_offset_ms += 1_000
        api = Api(client)
        listed = await api.call("GET", "/v1/effects?awaitingApproval=true&limit=2")
        assert listed.status == 200, listed.body
        assert [e["effectId"] for e in listed.body["effects"]] == waiting[:2]
        assert listed.body["nextCursor"] is None
        every = await api.call("GET", "/v1/effects?awaitingApproval=false&state=NOT_APPLIED")
        assert len(every.body["effects"]) == 6  # the filter off: the usual listing
        for extra in ("state=UNKNOWN", "taskId=t1", "downstream=api", "cursor=x"):
            refused = await api.call("GET", f"/v1/effects?awaitingApproval=true&{extra}")
            assert (refused.status, refused.code) == (400, "BAD_REQUEST"), extra
        bad = await api.call("GET", "/v1/effects?awaitingApproval=yes")
        assert (bad.status, bad.code) == (400, "BAD_REQUEST")
