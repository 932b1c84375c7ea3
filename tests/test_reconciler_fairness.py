"""Item 7 of the at-most-once issue: the reconciler makes progress on every probe effect,
however many UNKNOWN effects wait for an operator, on both stores.

Before, SQLite listed UNKNOWN effects oldest first under one LIMIT (older effects waiting for
an operator hid every newer probe effect for ever) and Redis picked at random.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger import effects
from fencegate.ledger.effects import EffectRequest, EffectState, Fence, ProbeVerdict
from fencegate.ledger.keys import Keys
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest
from tests.api import until
from tests.conftest import build_test_store, make_config
from tests.servers import RedisServer

PROBED = frozenset({"orders"})


async def unknown_effects(store: Store, task_id: str, downstream: str, count: int) -> list[str]:
    """``count`` UNKNOWN effects of ``downstream`` (one task, one slot each)."""
    await store.put_task(task_id, "in-1", None)
    task = await store.claim(task_id, ClaimRequest(owner="w", ttl_ms=60_000, scheduler_epoch=1))
    assert task.attempt_id is not None
    fence = Fence(task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    ids = []
    for i in range(count):
        request = EffectRequest(fence, "main", f"s{i}", downstream, "POST", "/x", f"d{i}")
        prepared = await store.prepare_effect(request, 30_000)
        await store.complete_effect(
            task_id, prepared.effect.effect_id, 0, fence.attempt_id, EffectState.UNKNOWN,
            "timed out", None,
        )  # fmt: skip
        ids.append(prepared.effect.effect_id)
    return ids


async def test_probe_effects_are_listed_before_any_number_waiting_for_an_operator(
    store: Store,
) -> None:
    waiting = await unknown_effects(store, "mail-task", "mail", 30)
    probed = await unknown_effects(store, "order-task", "orders", 2)
    listed: set[str] = set()
    for _ in range(3):  # a few sweeps' worth at most
        listed |= {e.effect_id for e in await store.unsettled_effects(5, PROBED)}
        if set(probed) <= listed:
            break
    assert set(probed) <= listed
    assert not listed & set(waiting)


async def test_every_probe_effect_gets_its_turn_while_probes_stay_inconclusive(
    store: Store,
) -> None:
    """Ten probe effects, three per sweep, every probe inconclusive: each is probed within
    four sweeps, because an inconclusive probe moves the effect behind the others."""
    probed = await unknown_effects(store, "order-task", "orders", 10)
    seen: set[str] = set()
    for sweep in range(4):
        batch = await store.unsettled_effects(3, PROBED)
        assert len(batch) == min(3, 10 - len(seen)), sweep
        for effect in batch:
            seen.add(effect.effect_id)
            holder = f"r{sweep}"
            await store.update_effect(
                effect.effect_id, lambda e, now, h=holder: effects.begin_probe(e, h, 5_000, now)
            )
            await store.update_effect(
                effect.effect_id,
                lambda e, now, h=holder: effects.finish_probe(
                    e, h, ProbeVerdict.INCONCLUSIVE, None, 60_000, "test", now
                ),
            )
    assert seen == set(probed)
    # None is due now: all were probed, and their next probes are a minute away.
    assert await store.unsettled_effects(3, PROBED) == []
    store.clock_offset_ms += 61_000
    assert len(await store.unsettled_effects(20, PROBED)) == 10


@pytest.fixture
async def lookup() -> AsyncIterator[str]:
    """A downstream whose lookup says every order exists."""

    async def found(request: web.Request) -> web.Response:
        return web.json_response({"status": "created"})

    app = web.Application()
    app.router.add_get("/orders/by-key/{key}", found)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def fair_config(store_url: str, key_prefix: str, url: str) -> Config:
    return make_config(
        store_url,
        key_prefix,
        downstreams=[
            {"name": "mail", "adapter": "manual", "url": url},
            {
                "name": "orders",
                "adapter": "probe",
                "url": url,
                "probe": {"path": "/orders/by-key/{effectId}", "interval_ms": 50},
            },
        ],
        reconciler={"enabled": True, "interval_ms": 50, "max_effects_per_sweep": 3},
    )


async def test_the_background_reconciler_settles_a_probe_effect_behind_many_manual_ones(
    store_url: str, key_prefix: str, lookup: str
) -> None:
    config = fair_config(store_url, key_prefix, lookup)
    store = build_test_store(config)
    app = create_app(config, store=store)
    async with TestClient(TestServer(app, host="127.0.0.1")):
        waiting = await unknown_effects(store, "mail-task", "mail", 20)
        (probed,) = await unknown_effects(store, "order-task", "orders", 1)

        async def settled() -> bool:
            return (await store.get_effect(probed)).state is EffectState.COMMITTED

        # However slowly a loaded machine runs the sweeps (a bound on a hang, not a timing):
        # an unfair reconciler never settles it, the manual effects never leave.
        await until(settled, "the background reconciler settles the probe effect")
        assert (await store.get_effect(probed)).state is EffectState.COMMITTED
        # The manual effects still wait for an operator.
        for effect_id in waiting[:3]:
            assert (await store.get_effect(effect_id)).state is EffectState.UNKNOWN


async def test_redis_fills_the_probe_index_with_unknown_effects_it_lacks(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """A ledger written before the probe-due index existed (or by an older gateway on the
    same Redis) has UNKNOWN effects the index lacks; the next sweep adds them."""
    config = make_config(redis_server.url, key_prefix)
    store = build_test_store(config)
    await store.open()
    try:
        probed = await unknown_effects(store, "order-task", "orders", 3)
        client = redis_server.client()
        client.delete(Keys(key_prefix).probe_due)  # as an older version left it
        client.close()
        listed = {e.effect_id for e in await store.unsettled_effects(10, PROBED)}
        assert listed == set(probed)
    finally:
        await store.close()
