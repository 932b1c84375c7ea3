"""At most once (issue 9, item 5): a probe's "absent" only counts once no earlier forward can
still land at the downstream.

A forward the gateway gave up on (timeout, PREPARED deadline) may sit in the downstream's
queue and apply later. Until ``probe.settle_ms`` after the gateway stopped waiting for it, a
lookup that finds nothing proves nothing: the verdict is recorded as inconclusive (the
reconcile action carries ``waitUntil``), the effect stays UNKNOWN, and the next probe waits
for that instant. "Found" always counts at once.

The downstream (``tests/late_servers.py``) accepts an order, loses its answer (the connection
closes before it leaves: UNKNOWN however loaded the machine), and creates it only when the test
releases its queue (or never); every story counts creates there. Time is the store's, moved by
the test (``clock_offset_ms``), never waited out. Every store.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger import effects
from fencegate.ledger.effects import Effect, EffectAttempt, EffectState, ProbeVerdict
from tests.api import Api, Lease
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.late_servers import LateServers
from tests.test_adapters import call, record

#: Only bounds a hang: the downstream loses its answers by closing the connection at once.
TIMEOUT_MS = 10_000
#: ``orders``: store time, which the test moves; far longer than any test runs in real time.
SETTLE_MS = 20_000
#: ``orders-quick``: another settle time, so the stories tell which one was applied.
QUICK_SETTLE_MS = 10_000
#: The leases outlive every move of the store's clock.
TTL_MS = 60_000
#: Past the probe's backoff (``max_interval_ms``): the next inline probe is due.
BACKOFF_MS = 1_000
ORDER = {"item": "book"}


def probe_config(
    store_url: str, key_prefix: str, late: LateServers, **sections: Any
) -> Config:  # fmt: skip
    def orders(name: str, settle_ms: int) -> dict[str, Any]:
        return {
            "name": name,
            "url": late.url,
            "timeout_ms": TIMEOUT_MS,
            "adapter": "probe",
            "probe": {
                "path": "/orders/by-key/{effectId}",
                "json_field": "status",
                "found_values": ["created"],
                "timeout_ms": 1_000,
                "interval_ms": 50,
                "max_interval_ms": 200,
                "settle_ms": settle_ms,
            },
        }

    sections.setdefault("reconciler", {"enabled": False})
    return make_config(
        store_url,
        key_prefix,
        downstreams=[orders("orders", SETTLE_MS), orders("orders-quick", QUICK_SETTLE_MS)],
        # Not about the start limit: wide, and the forward clock stands still (``api``).
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        **sections,
    )


@pytest.fixture
async def late() -> AsyncIterator[LateServers]:
    server = await LateServers().listen()
    yield server
    await server.close()


@pytest.fixture
async def api(store_url: str, key_prefix: str, late: LateServers) -> AsyncIterator[Api]:
    config = probe_config(store_url, key_prefix, late)
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def lost_order(api: Api, late: LateServers, downstream: str) -> tuple[Lease, str]:
    """A's order is accepted and its answer lost; it lands when the test releases the queue
    (``late.queue = "hold"``) or never (``"drop"``)."""
    await api.put("t1")
    a = await api.claim("t1", "A", ttl_ms=TTL_MS)
    late.lose_answers = True
    lost = await call(api, a, "POST", f"{downstream}/orders", body=ORDER)
    late.lose_answers = False
    assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    assert late.received["orders"] == 1  # counted before the connection closed
    return a, lost.headers["Fence-Effect-Id"]


async def take_over(api: Api, lease: Lease) -> Lease:
    """B takes the task over at once."""
    assert (await api.release(lease)).status == 200
    return await api.claim(lease.task_id, "B", ttl_ms=TTL_MS)


def reconciles(rec: dict[str, Any]) -> list[dict[str, Any]]:
    return [x for x in rec["actions"] if x["action"] == "reconcile"]


async def record_once(api: Api, effect_id: str, ready: Callable[[Any], bool]) -> Any:
    """The effect's record once ``ready`` holds for it (the background reconciler got there);
    the deadline only bounds a hang."""
    async with asyncio.timeout(30):
        while not ready(rec := await record(api, effect_id)):
            await asyncio.sleep(0.02)
    return rec


async def early_retry_is_refused(api: Api, late: LateServers, b: Lease, downstream: str,
                                 effect_id: str, settle_ms: int) -> int:  # fmt: skip
    """B retries at once: the inline probe finds nothing yet, and that must not count.
    Returns the instant from which "absent" is believed."""
    early = await call(api, b, "POST", f"{downstream}/orders", body=ORDER)
    assert early.status == 409 and early.code == "EFFECT_UNKNOWN", (early.status, early.body)
    assert early.headers["Fence-Effect-State"] == "UNKNOWN"
    assert late.received["lookup"] == 1 and late.received["orders"] == 1
    rec = await record(api, effect_id)
    assert rec["state"] == "UNKNOWN" and len(rec["attempts"]) == 1
    (probe,) = reconciles(rec)
    assert probe["verdict"] == "absent" and "outcome" not in probe
    assert probe["by"] == "gateway:inline"
    wait_until: int = probe["waitUntil"]
    assert wait_until == rec["attempts"][0]["endedAt"] + settle_ms
    # Probing goes on with the backoff ("found" would count at once), not only after it.
    assert probe["at"] < rec["probes"]["nextAt"] < wait_until
    return wait_until


async def test_absent_before_the_settle_time_does_not_let_the_order_go_again(
    api: Api, late: LateServers
) -> None:
    late.queue = "hold"
    a, effect_id = await lost_order(api, late, "orders")
    b = await take_over(api, a)
    wait_until = await early_retry_is_refused(api, late, b, "orders", effect_id, SETTLE_MS)
    # The order lands (the queue got to it); the next retry's probe (due after the backoff)
    # finds it, long before the settle time is over: "found" counts at once.
    late.release_orders()
    assert late.order_creates == 1
    api.advance(BACKOFF_MS)
    found = await call(api, b, "POST", "orders/orders", body=ORDER)
    assert found.status == 200 and found.headers["Fence-Replayed"] == "true"
    assert found.headers["Fence-Effect-State"] == "COMMITTED"
    assert json.loads(found.body)["status"] == "created"
    rec = await record(api, effect_id)
    assert rec["state"] == "COMMITTED"
    last = reconciles(rec)[-1]
    assert last["verdict"] == "found" and last["outcome"] == "COMMITTED"
    assert last["at"] < wait_until
    assert late.order_creates == 1 and late.received["orders"] == 1


async def test_a_retry_meeting_another_reconcilers_probe_is_told_unknown(
    api: Api, late: LateServers
) -> None:
    """B retries while another reconciler (the background one, another gateway's) holds the
    probe: the answer is EFFECT_UNKNOWN, retry later, never EFFECT_IN_FLIGHT (nothing is being
    forwarded), and this retry sends no second lookup. A demo run under load met this race."""
    late.queue = "hold"
    a, effect_id = await lost_order(api, late, "orders")
    b = await take_over(api, a)
    await api.store.update_effect(
        effect_id, lambda record, now: effects.begin_probe(record, "other", 60_000, now)
    )
    retry = await call(api, b, "POST", "orders/orders", body=ORDER)
    assert (retry.status, retry.code) == (409, "EFFECT_UNKNOWN"), (retry.status, retry.body)
    assert retry.headers["Fence-Effect-State"] == "UNKNOWN"
    assert late.received["lookup"] == 0 and late.received["orders"] == 1
    late.release_orders()


async def test_absent_after_the_settle_time_lets_the_order_go_once(
    api: Api, late: LateServers
) -> None:
    late.queue = "drop"  # the queue loses it: the order never lands
    a, effect_id = await lost_order(api, late, "orders-quick")
    b = await take_over(api, a)
    wait_until = await early_retry_is_refused(
        api, late, b, "orders-quick", effect_id, QUICK_SETTLE_MS
    )
    # An operator's reconcile before the settle time does not settle it either.
    too_soon = await api.call("POST", f"/v1/effects/{effect_id}/reconcile")
    assert too_soon.status == 200 and too_soon.body["state"] == "UNKNOWN"
    assert reconciles(too_soon.body)[-1]["waitUntil"] == wait_until
    api.advance(QUICK_SETTLE_MS)
    assert await api.store.now_ms() >= wait_until
    settled = await api.call("POST", f"/v1/effects/{effect_id}/reconcile")
    assert settled.status == 200 and settled.body["state"] == "NOT_APPLIED"
    last = reconciles(settled.body)[-1]
    assert last["verdict"] == "absent" and last["outcome"] == "NOT_APPLIED"
    assert "waitUntil" not in last
    # The probe's settlement starts the history anew: a refused connect now leaves the
    # effect NOT_APPLIED (it may still go), not UNKNOWN.
    late.queue = "apply"
    await late.stop_listening()
    refused = await call(api, b, "POST", "orders-quick/orders", body=ORDER)
    assert refused.status == 502 and refused.headers["Fence-Effect-State"] == "NOT_APPLIED"
    await late.listen()
    sent = await call(api, b, "POST", "orders-quick/orders", body=ORDER)
    assert sent.status == 202 and sent.headers["Fence-Effect-State"] == "COMMITTED"
    assert sent.headers["Fence-Replayed"] == "false"
    assert late.order_creates == 1
    again = await call(api, b, "POST", "orders-quick/orders", body=ORDER)
    assert again.status == 202 and again.headers["Fence-Replayed"] == "true"
    assert late.order_creates == 1 and late.received["orders"] == 2


@pytest.mark.parametrize("lands", [True, False], ids=["lands-late", "never-lands"])
async def test_background_reconciler_waits_for_the_settle_time(
    store_url: str, key_prefix: str, late: LateServers, lands: bool
) -> None:
    downstream, settle_ms = ("orders", SETTLE_MS) if lands else ("orders-quick", QUICK_SETTLE_MS)
    config = probe_config(
        store_url, key_prefix, late, reconciler={"enabled": True, "interval_ms": 50}
    )
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        late.queue = "hold" if lands else "drop"
        _, effect_id = await lost_order(api, late, downstream)
        # The reconciler's first probe (due at once) finds nothing and must not believe it.
        rec = await record_once(api, effect_id, lambda rec: bool(reconciles(rec)))
        wait_until = rec["attempts"][0]["endedAt"] + settle_ms
        assert rec["state"] == "UNKNOWN", rec
        first = rec["actions"][-1]
        assert first["action"] == "reconcile" and first["by"].startswith("reconciler:")
        assert first["verdict"] == "absent" and first["waitUntil"] == wait_until
        # It is probed again with the backoff; every "absent" before then is inconclusive.
        # Then the order lands (the queue gets to it), or the settle time passes.
        if lands:
            late.release_orders()
        else:
            api.advance(settle_ms)
        rec = await record_once(api, effect_id, lambda rec: rec["state"] != "UNKNOWN")
        probes = reconciles(rec)
        settled = probes[-1]
        for early in probes[:-1]:
            assert "outcome" not in early
            if early["verdict"] == "absent":
                # Judged by when the probe was sent; its answer may be recorded later.
                assert early["askedAt"] < wait_until and early["waitUntil"] == wait_until
        if lands:
            assert rec["state"] == "COMMITTED" and settled["verdict"] == "found"
            assert late.order_creates == 1
        else:
            assert rec["state"] == "NOT_APPLIED" and settled["verdict"] == "absent"
            assert settled["at"] >= settled["askedAt"] >= wait_until
            assert late.order_creates == 0
        assert late.received["orders"] == 1


# --- the pure model: landing_until and finish_probe -------------------------------------------


def _attempt(started: int, ended: int | None, outcome: str | None) -> EffectAttempt:
    return EffectAttempt("att", 1, started, ended_at=ended, outcome=outcome, reason="test")


def _unknown(*attempts: EffectAttempt, settled: int = 0, holder: str | None = "p") -> Effect:
    return Effect(
        effect_id="e" * 64,
        task_id="t1",
        revision=1,
        node="main",
        slot="s1",
        downstream="orders",
        method="POST",
        path="/orders",
        payload_digest="d",
        state=EffectState.UNKNOWN,
        created_at=1_000,
        updated_at=1_000,
        attempts=attempts,
        settled_attempts=settled,
        probe_holder=holder,
        probe_until=None if holder is None else 1_000_000,
    )


def _finish(effect: Effect, verdict: ProbeVerdict, now: int, settle_ms: int,
            retry_in_ms: int = 50) -> Effect:  # fmt: skip
    return effects.finish_probe(
        effect, "p", verdict, '{"status": 200}', retry_in_ms, "test", now, settle_ms
    )


def _last_action(effect: Effect) -> dict[str, Any]:
    assert effect.actions_json is not None
    action: dict[str, Any] = json.loads(effect.actions_json)[-1]
    return action


def test_landing_until_counts_from_the_end_of_each_attempt_that_may_have_executed() -> None:
    lost = _attempt(1_000, 1_300, "UNKNOWN")
    assert effects.landing_until(_unknown(lost), 500) == 1_800  # from ended_at, not started_at
    assert effects.landing_until(_unknown(lost), 0) == 1_300
    # Attempts that certainly did nothing, or that committed, cannot land later.
    refused = _attempt(2_000, 2_010, "NOT_APPLIED")
    committed = _attempt(3_000, 3_100, "COMMITTED")
    assert effects.landing_until(_unknown(refused), 500) is None
    assert effects.landing_until(_unknown(committed), 500) is None
    assert effects.landing_until(_unknown(lost, refused), 500) == 1_800
    # The latest one that may have executed decides.
    later = _attempt(4_000, 4_300, "UNKNOWN")
    assert effects.landing_until(_unknown(lost, refused, later), 500) == 4_800
    # A forward still in flight (no end yet) is counted from its start.
    assert effects.landing_until(_unknown(_attempt(5_000, None, None)), 500) == 5_500
    # Attempts an operator or a probe already settled NOT_APPLIED are not counted.
    assert effects.landing_until(_unknown(lost, settled=1), 500) is None
    assert effects.landing_until(_unknown(lost, refused, later, settled=2), 500) == 4_800
    assert effects.landing_until(_unknown(lost, refused, settled=1), 10**6) is None


def test_absent_before_landing_until_is_inconclusive() -> None:
    effect = _unknown(_attempt(1_000, 1_300, "UNKNOWN"))
    waiting = _finish(effect, ProbeVerdict.ABSENT, now=1_400, settle_ms=1_000)
    assert waiting.state is EffectState.UNKNOWN
    assert waiting.probe_holder is None and waiting.probe_count == 1
    assert waiting.next_probe_at == 1_450  # the backoff goes on: "found" counts at once
    action = _last_action(waiting)
    assert action["verdict"] == "absent" and action["waitUntil"] == 2_300
    assert "outcome" not in action
    assert waiting.settled_attempts == 0
    # One millisecond before: still waiting.
    assert _finish(effect, ProbeVerdict.ABSENT, 2_299, 1_000).state is EffectState.UNKNOWN


def test_absent_from_landing_until_on_settles_not_applied() -> None:
    effect = _unknown(_attempt(1_000, 1_300, "UNKNOWN"), _attempt(2_000, 2_010, "NOT_APPLIED"))
    settled = _finish(effect, ProbeVerdict.ABSENT, now=2_300, settle_ms=1_000)
    assert settled.state is EffectState.NOT_APPLIED
    assert settled.response_json is None and settled.next_probe_at is None
    assert settled.settled_attempts == 2  # the history so far is settled
    action = _last_action(settled)
    assert action["outcome"] == "NOT_APPLIED" and "waitUntil" not in action
    # Without a settle time (the default), absent counts at once.
    at_once = effects.finish_probe(effect, "p", ProbeVerdict.ABSENT, None, 50, "test", 1_400)
    assert at_once.state is EffectState.NOT_APPLIED


def test_found_counts_at_once() -> None:
    effect = _unknown(_attempt(1_000, 1_300, "UNKNOWN"))
    found = _finish(effect, ProbeVerdict.FOUND, now=1_301, settle_ms=60_000)
    assert found.state is EffectState.COMMITTED
    assert found.response_json == '{"status": 200}'
    assert found.settled_attempts == 0  # COMMITTED does not open the effect for a re-send
    action = _last_action(found)
    assert action["verdict"] == "found" and action["outcome"] == "COMMITTED"
    assert "waitUntil" not in action


def test_inconclusive_is_unchanged_by_the_settle_time() -> None:
    effect = _unknown(_attempt(1_000, 1_300, "UNKNOWN"))
    probed = _finish(effect, ProbeVerdict.INCONCLUSIVE, now=1_400, settle_ms=1_000)
    assert probed.state is EffectState.UNKNOWN and probed.next_probe_at == 1_450
    assert "waitUntil" not in _last_action(probed)


def test_settle_time_counts_from_the_prepared_deadline() -> None:
    """A forward whose gateway died is UNKNOWN from its PREPARED deadline: the gateway stopped
    waiting then, so that is when the settle time starts."""
    attempt = _attempt(1_000, None, None)
    prepared = replace(
        _unknown(attempt, holder=None), state=EffectState.PREPARED, deadline_at=4_000
    )
    probing = effects.begin_probe(prepared, "p", 10_000, 4_500)
    assert probing.attempts[0].ended_at == 4_000
    waiting = _finish(probing, ProbeVerdict.ABSENT, now=4_900, settle_ms=1_000)
    assert waiting.state is EffectState.UNKNOWN
    assert _last_action(waiting)["waitUntil"] == 5_000
    assert _finish(probing, ProbeVerdict.ABSENT, 5_000, 1_000).state is EffectState.NOT_APPLIED


def test_after_a_probe_settles_only_later_attempts_count() -> None:
    first = _attempt(1_000, 1_300, "UNKNOWN")
    settled = _finish(_unknown(first), ProbeVerdict.ABSENT, now=2_300, settle_ms=1_000)
    assert settled.settled_attempts == 1
    # The effect goes again and is lost again: only that attempt's end counts now.
    again = _attempt(3_000, 3_300, "UNKNOWN")
    lost = replace(settled, state=EffectState.UNKNOWN, attempts=(first, again), probe_holder="p")
    assert effects.landing_until(lost, 1_000) == 4_300
    waiting = _finish(lost, ProbeVerdict.ABSENT, now=4_000, settle_ms=1_000)
    assert _last_action(waiting)["waitUntil"] == 4_300


def test_a_slow_absent_answer_is_judged_by_when_the_probe_was_sent() -> None:
    """The probe left before the settle instant and its answer came back after it: the
    lookup saw the downstream before a late forward could have landed, so it proves nothing."""
    effect = _unknown(_attempt(1_000, 1_300, "UNKNOWN"))
    slow = effects.finish_probe(
        effect, "p", ProbeVerdict.ABSENT, None, 50, "test", 2_400, 1_000, asked_at=2_250
    )
    assert slow.state is EffectState.UNKNOWN
    assert _last_action(slow)["waitUntil"] == 2_300
    sent_after = effects.finish_probe(
        effect, "p", ProbeVerdict.ABSENT, None, 50, "test", 2_400, 1_000, asked_at=2_300
    )
    assert sent_after.state is EffectState.NOT_APPLIED
