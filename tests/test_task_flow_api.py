"""Task flow over HTTP, on every store: queues (``POST /v1/queues/{queue}/claim``, priority,
``waitMs``), dependencies (``dependsOn``, WAITING, provenance, the cancel cascade, a
dependency's new revision), ``waitFor`` long-polls, and ``cost`` with the discarded-work
metrics. Tasks that depend on one another share a task group (``flow::<name>`` ids), as
Redis Cluster requires (docs/decisions.md, "Dependencies: in one group, or refused")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from fencegate.gateway import events as events_module
from fencegate.gateway.app import build_store, create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.config import Config
from fencegate.gateway.events import Batch, EventHub
from fencegate.gateway.state import EVENTS
from fencegate.ledger.events import Event
from tests.api import HANG_S, Answer, Api, Lease, until
from tests.conftest import build_test_store, make_config

CLAIM_KEYS = {
    "taskId",
    "attemptId",
    "claimGeneration",
    "schedulerEpoch",
    "cancelGeneration",
    "leaseExpiresAt",
    "grantedTtlMs",
    "revision",
    "inputDigest",
}


def flow_config(store_url: str, key_prefix: str, **sections: Any) -> Config:
    return make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        tasks={"max_dependencies": 3, "max_wait_ms": 5_000, **sections.pop("tasks", {})},
        events={"poll_ms": 20, **sections.pop("events", {})},
        **sections,
    )


@pytest.fixture
async def api(store_url: str, key_prefix: str) -> AsyncIterator[Api]:
    config = flow_config(store_url, key_prefix)
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def claim_next(api: Api, queue: str = "q", owner: str = "w1", **extra: Any) -> Answer:
    body = {"owner": owner, "ttlMs": 10_000, "schedulerEpoch": await api.epoch(), **extra}
    return await api.call("POST", f"/v1/queues/{queue}/claim", body)


def lease_of(answer: Answer, owner: str = "w1") -> Lease:
    b = answer.body
    return Lease(
        b["taskId"],
        b["attemptId"],
        b["claimGeneration"],
        owner,
        b["schedulerEpoch"],
        b["cancelGeneration"],
        b["leaseExpiresAt"],
        b["inputDigest"],
    )


async def state(api: Api, task_id: str) -> str:
    return str((await api.get(task_id)).body["state"])


async def metric(api: Api, name: str, **labels: str) -> float:
    async with api.client.get("/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


# --- queues ---------------------------------------------------------------------------------


async def test_a_queue_hands_out_the_highest_priority_then_the_oldest(api: Api) -> None:
    assert (await api.put("low", queue="q", priority=-5)).status == 201
    assert (await api.put("old", queue="q")).status == 201
    api.advance(10)
    assert (await api.put("new", queue="q")).status == 201
    assert (await api.put("urgent", queue="q", priority=7)).status == 201
    assert (await api.put("elsewhere", queue="other", priority=100)).status == 201
    assert (await api.put("by-id-only", priority=100)).status == 201
    record = (await api.get("urgent")).body
    assert record["queue"] == "q" and record["priority"] == 7 and record["dependsOn"] == []
    order = []
    for _ in range(4):
        answer = await claim_next(api)
        assert answer.status == 200, answer.body
        assert set(answer.body) >= CLAIM_KEYS
        assert answer.body["queue"] == "q" and answer.body["dependencies"] == []
        order.append(answer.body["taskId"])
    assert order == ["urgent", "old", "new", "low"]
    empty = await claim_next(api)
    assert empty.status == 204 and empty.body is None
    assert await metric(api, "fencegate_claims_total", outcome="empty") == 1


async def test_an_expired_claim_is_found_again_and_counted_as_discarded(api: Api) -> None:
    await api.put("t1", queue="q")
    first = await claim_next(api, ttlMs=1_000)
    lease = lease_of(first)
    assert (await api.renew(lease, cost={"tokens": 40})).status == 200
    assert (await api.get("t1")).body["cost"] == {"tokens": 40}
    assert (await claim_next(api, owner="w2")).status == 204  # still held
    api.advance(20_000)
    again = await claim_next(api, owner="w2")
    assert again.status == 200 and again.body["taskId"] == "t1"
    assert again.body["claimGeneration"] == lease.claim_generation + 1
    assert (await api.get("t1")).body["cost"] == {}  # a claim starts a new attempt's tally
    assert await metric(api, "fencegate_discarded_attempts_total", reason="expired") == 1
    assert await metric(api, "fencegate_discarded_cost_total", unit="tokens") == 40
    assert await metric(api, "fencegate_reported_cost_total", unit="tokens") == 40


async def test_an_epoch_bump_frees_old_claims_of_a_queue_at_once(api: Api) -> None:
    await api.put("t1", queue="q")
    assert (await claim_next(api)).status == 200
    assert (await api.call("POST", "/v1/epoch/bump")).status == 200
    again = await claim_next(api, owner="w2")
    assert again.status == 200 and again.body["taskId"] == "t1"
    assert await metric(api, "fencegate_discarded_attempts_total", reason="epoch") == 1


async def test_queue_claims_refuse_what_a_claim_refuses(api: Api) -> None:
    await api.put("t1", queue="q")
    stale = await claim_next(api, schedulerEpoch=(await api.epoch()) + 5)
    assert stale.status == 409 and stale.code == "STALE_EPOCH"
    await api.call("POST", "/v1/claims/pause")
    assert (await claim_next(api, queue="empty")).code == "CLAIMS_PAUSED"
    await api.call("POST", "/v1/claims/resume")
    for path, body, field in [
        ("/v1/queues/bad%20name/claim", None, None),
        ("/v1/queues/q/claim", {"waitMs": -1}, "waitMs"),
        ("/v1/queues/q/claim", {"expectedRevision": 1}, "expectedRevision"),
        ("/v1/queues/q/claim", {"waitMs": "5"}, "waitMs"),
    ]:
        full = {"owner": "w", "ttlMs": 1000, "schedulerEpoch": 1, **(body or {})}
        answer = await api.call("POST", path, full)
        assert answer.status == 400 and answer.code == "BAD_REQUEST", (path, body, answer.body)
        if field:
            assert field in answer.body["detail"]
    for bad in ("has space", "x" * 101, "tab\t"):
        answer = await api.put("t9", queue=bad)
        assert answer.status == 400 and "queue" in answer.body["detail"], bad
    assert (await api.put("t9", priority=1_000_001)).status == 400
    assert (await api.put("t9", priority=True)).status == 400


async def test_a_waiting_queue_claim_gets_a_task_put_meanwhile(
    store_url: str, key_prefix: str
) -> None:
    async with flow_api(store_url, key_prefix, tasks={"max_wait_ms": 600_000}) as api:
        started = time.monotonic()
        empty = await claim_next(api, waitMs=300)
        assert empty.status == 204 and time.monotonic() - started >= 0.3
        # The wait's deadline (10 min) is far past what this test waits: an answer at all
        # means the put woke it, however slow the machine (no wall-clock race). The put
        # comes once the claim waits (the hub counts it), so it is a put made meanwhile.
        waiting = asyncio.ensure_future(claim_next(api, waitMs=600_000))
        await until(lambda: hub(api).waiters == 1, "the queue claim waits")
        assert not waiting.done()
        await api.put("late", queue="q")
        answer = await asyncio.wait_for(waiting, HANG_S)
        assert answer.status == 200 and answer.body["taskId"] == "late"


async def test_the_same_input_with_another_queue_or_dependencies_changes_nothing(
    api: Api,
) -> None:
    await api.put("dep")
    await api.put("t1", queue="q", priority=3)
    before = (await api.get("t1")).body
    again = await api.put("t1", queue="other", priority=9, dependsOn=["dep"])
    assert again.status == 200 and again.body == before
    revised = await api.put("t1", "in-2")  # absent keys keep their values on a revision
    assert revised.body["queue"] == "q" and revised.body["priority"] == 3


# --- dependencies ---------------------------------------------------------------------------


async def test_a_dependent_waits_for_the_canonical_commit_and_carries_its_provenance(
    api: Api,
) -> None:
    await api.put("flow::step1", queue="pipe")
    created = await api.put("flow::step2", queue="pipe", dependsOn=["flow::step1", "flow::step1"])
    assert created.status == 201
    assert created.body["state"] == "WAITING" and created.body["dependsOn"] == ["flow::step1"]
    pending = await api.try_claim("flow::step2")
    assert pending.status == 409 and pending.code == "DEPENDENCIES_PENDING"
    assert "flow::step1" in pending.body["detail"]
    first = await claim_next(api, queue="pipe")
    assert first.body["taskId"] == "flow::step1"
    assert (await claim_next(api, queue="pipe", owner="w2")).status == 204  # step2 waits
    done = await api.commit(lease_of(first), result_digest="sha256:one")
    assert done.status == 200
    record = (await api.get("flow::step2")).body
    assert record["state"] == "READY"
    provenance = [{"taskId": "flow::step1", "commitId": done.body["commitId"],
                   "resultDigest": "sha256:one"}]  # fmt: skip
    assert record["dependencies"] == provenance
    second = await claim_next(api, queue="pipe", owner="w2")
    assert second.status == 200 and second.body["taskId"] == "flow::step2"
    assert second.body["dependencies"] == provenance


async def test_a_fenced_first_step_keeps_the_second_waiting_until_the_takeover_commits(
    api: Api,
) -> None:
    await api.put("flow::a", queue="pipe")
    await api.put("flow::b", queue="pipe", dependsOn=["flow::a"])
    stale = lease_of(await claim_next(api, queue="pipe", ttlMs=1_000))
    api.advance(5_000)
    takeover = lease_of(await claim_next(api, queue="pipe", owner="w2"), owner="w2")
    assert takeover.task_id == "flow::a"
    refused = await api.commit(stale, result_digest="sha256:stale", cost={"seconds": 2.5})
    assert refused.code == "FENCED"
    assert await state(api, "flow::b") == "WAITING"
    # The takeover counted the stale attempt (its tally) as expired; the FENCED call's cost
    # is not counted: a forged attemptId is refused the same way.
    assert await metric(api, "fencegate_discarded_attempts_total", reason="expired") == 1
    assert await metric(api, "fencegate_discarded_attempts_total", reason="fenced") == 0
    assert await metric(api, "fencegate_discarded_cost_total", unit="seconds") == 0
    assert await metric(api, "fencegate_reported_cost_total", unit="seconds") == 0
    done = await api.commit(takeover, result_digest="sha256:good")
    record = (await api.get("flow::b")).body
    assert record["state"] == "READY"
    assert record["dependencies"][0]["commitId"] == done.body["commitId"]


async def test_dependencies_that_cannot_be_are_refused(api: Api) -> None:
    await api.put("flow::a")
    await api.put("flow::b", dependsOn=["flow::a"])
    for task_id, deps, words in [
        ("flow::c", ["flow::nobody"], "flow::nobody"),
        ("flow::c", ["flow::c"], "flow::c"),
        ("flow::a", ["flow::b"], "cycle"),
        ("flow::c", ["flow::a", "flow::b", "flow::x1", "flow::x2"], "max_dependencies"),
    ]:
        answer = await api.put(task_id, "in-9", dependsOn=deps)
        assert answer.status == 400 and answer.code == "BAD_REQUEST", (deps, answer.body)
        assert "dependsOn" in answer.body["detail"] and words in answer.body["detail"]
    assert (await api.put("flow::c", dependsOn=["bad id"])).status == 400
    assert (await api.get("flow::a")).body["revision"] == 1


async def test_cancel_cascades_to_open_dependents_only(api: Api) -> None:
    await api.put("flow::root")
    await api.put("flow::done")
    lease = await api.claim("flow::done")
    await api.commit(lease)
    await api.put("flow::mid", dependsOn=["flow::root"])
    await api.put("flow::leaf", dependsOn=["flow::mid", "flow::done"])
    await api.put("flow::kept", dependsOn=["flow::done"])
    assert (await api.cancel("flow::root")).status == 200
    assert [
        await state(api, t)
        for t in ("flow::root", "flow::mid", "flow::leaf", "flow::kept", "flow::done")
    ] == [
        "CANCELLED",
        "CANCELLED",
        "CANCELLED",
        "READY",
        "COMMITTED",
    ]
    assert (await api.get("flow::mid")).body["cancelGeneration"] == 1


async def test_a_new_revision_of_a_dependency_unwinds_open_dependents(api: Api) -> None:
    await api.put("flow::a")
    lease = await api.claim("flow::a")
    await api.commit(lease)
    await api.put("flow::open", dependsOn=["flow::a"])
    await api.put("flow::running", dependsOn=["flow::a"])
    await api.put("flow::finished", dependsOn=["flow::a"])
    running = await api.claim("flow::running", owner="w2")
    finished = await api.claim("flow::finished", owner="w3")
    await api.commit(finished)
    provenance = (await api.get("flow::finished")).body["dependencies"]
    assert (await api.put("flow::a", "in-2")).body["revision"] == 2
    assert await state(api, "flow::open") == "WAITING"
    assert (await api.get("flow::open")).body["dependencies"] == []
    assert await state(api, "flow::running") == "WAITING"
    assert (await api.renew(running)).code == "STALE_INPUT"
    assert (await api.get("flow::finished")).body["dependencies"] == provenance
    assert await metric(api, "fencegate_discarded_attempts_total", reason="superseded") == 1


# --- waitFor --------------------------------------------------------------------------------


async def test_wait_for_answers_as_soon_as_the_task_commits(
    store_url: str, key_prefix: str
) -> None:
    async with flow_api(store_url, key_prefix, tasks={"max_wait_ms": 600_000}) as api:
        await api.put("t1")
        lease = await api.claim("t1")
        # As above: the wait's deadline (10 min) is far past what the test waits for its
        # answer, so an answer means the commit woke it, not the deadline.
        waiting = asyncio.ensure_future(
            api.call("GET", "/v1/tasks/t1?waitFor=COMMITTED&waitMs=600000")
        )
        await until(lambda: hub(api).waiters == 1, "the long-poll waits")
        assert not waiting.done()
        await api.commit(lease)
        answer = await asyncio.wait_for(waiting, HANG_S)
        assert answer.status == 200 and answer.body["state"] == "COMMITTED"


async def test_wait_for_answers_the_record_as_it_is_at_the_deadline(api: Api) -> None:
    await api.put("t1")
    started = time.monotonic()
    answer = await api.call("GET", "/v1/tasks/t1?waitFor=COMMITTED&waitMs=300")
    assert answer.status == 200 and answer.body["state"] == "READY"
    assert time.monotonic() - started >= 0.3
    at_once = await api.call("GET", "/v1/tasks/t1?waitFor=READY&waitMs=3000")
    assert at_once.body["state"] == "READY"
    for query, name in [
        ("waitFor=DONE", "waitFor"),
        ("waitMs=10", "waitMs"),
        ("waitFor=READY&waitMs=-1", "waitMs"),
        ("waitFor=READY&waitFor=READY", "waitFor"),
        ("state=READY", "state"),
    ]:
        bad = await api.call("GET", f"/v1/tasks/t1?{query}")
        assert bad.status == 400 and name in bad.body["detail"], (query, bad.body)


# --- cost -----------------------------------------------------------------------------------


async def test_cost_is_added_up_per_attempt_and_checked(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    assert (await api.renew(lease, cost={"tokens": 100, "seconds": 1})).status == 200
    assert (await api.renew(lease, cost={"tokens": 50})).status == 200
    assert (await api.get("t1")).body["cost"] == {"tokens": 150, "seconds": 1}
    for cost, field in [
        ({"gpus": 1}, "cost.gpus"),
        ({"tokens": -1}, "cost.tokens"),
        ({"tokens": "5"}, "cost.tokens"),
        ({"tokens": 1e16}, "cost.tokens"),
        ({"Tokens": 1}, "cost"),
    ]:
        answer = await api.renew(lease, cost=cost)
        assert answer.status == 400 and field in answer.body["detail"], (cost, answer.body)
    done = await api.commit(lease, cost={"tokens": 10})
    assert done.status == 200
    assert (await api.get("t1")).body["cost"] == {"tokens": 160, "seconds": 1}
    assert await metric(api, "fencegate_reported_cost_total", unit="tokens") == 160
    assert await metric(api, "fencegate_discarded_cost_total", unit="tokens") == 0


async def test_a_released_attempt_is_not_discarded_a_cancelled_one_is(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    assert (await api.release(lease, cost={"tokens": 5})).status == 200
    lease = await api.claim("t1")
    await api.renew(lease, cost={"tokens": 7})
    await api.cancel("t1")
    assert await metric(api, "fencegate_discarded_attempts_total", reason="cancelled") == 1
    assert await metric(api, "fencegate_discarded_cost_total", unit="tokens") == 7
    refused = await api.renew(lease, cost={"tokens": 3})
    assert refused.code == "CANCELLED"
    assert await metric(api, "fencegate_discarded_cost_total", unit="tokens") == 10
    # Reported: what the store accepted (the release's 5, the renew's 7), not the refused 3.
    assert await metric(api, "fencegate_reported_cost_total", unit="tokens") == 12


async def test_calls_without_the_lease_add_no_cost_to_the_metrics(api: Api) -> None:
    """Anyone can send a body: a renew, release or commit whose identity is not the current
    attempt's (FENCED) counts its cost nowhere, reported or discarded."""
    await api.put("t1")
    forged = Lease("t1", "forged", 7, "x", await api.epoch(), 0, 0, "in-1")
    cost = {"tokens": 1e15, "seconds": 1e15}
    assert (await api.renew(forged, cost=cost)).code == "FENCED"
    assert (await api.release(forged, cost=cost)).code == "FENCED"
    assert (await api.commit(forged, cost=cost)).code == "FENCED"
    lease = await api.claim("t1")
    taken = dataclasses.replace(lease, attempt_id="forged")
    assert (await api.renew(taken, cost=cost)).code == "FENCED"
    for name in ("fencegate_reported_cost_total", "fencegate_discarded_cost_total"):
        for unit in ("tokens", "seconds"):
            assert await metric(api, name, unit=unit) == 0, (name, unit)
    assert await metric(api, "fencegate_discarded_attempts_total", reason="fenced") == 0
    # The holder's own refused call (after its identity matched) still counts.
    api.advance(60_000)
    assert (await api.renew(lease, cost={"tokens": 4})).code == "LEASE_EXPIRED"
    assert await metric(api, "fencegate_discarded_cost_total", unit="tokens") == 4
    assert await metric(api, "fencegate_reported_cost_total", unit="tokens") == 0


# --- bounds on long-polls, shutdown ---------------------------------------------------------


@contextlib.asynccontextmanager
async def flow_api(store_url: str, key_prefix: str, **sections: Any) -> AsyncIterator[Api]:
    config = flow_config(store_url, key_prefix, **sections)
    app = create_app(config, store=build_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


def hub(api: Api) -> EventHub:
    return api.client.app[EVENTS]  # type: ignore[no-any-return]


async def test_past_the_waiter_bounds_a_long_poll_is_503_not_an_early_answer(
    store_url: str, key_prefix: str
) -> None:
    # The hog may wait 10 min, far past the test: it still waits whatever the steps between
    # took on a loaded machine.
    tasks = {"max_waiters": 3, "max_waiters_per_principal": 1, "max_wait_ms": 600_000}
    async with flow_api(store_url, key_prefix, tasks=tasks) as api:
        await api.put("hog")
        await api.put("victim")
        hogging = asyncio.ensure_future(
            api.call("GET", "/v1/tasks/hog?waitFor=COMMITTED&waitMs=600000")
        )
        await until(lambda: hub(api).waiters == 1, "the first long-poll waits")
        # Every anonymous caller is one principal: its one long-poll is taken.
        async with api.client.get("/v1/tasks/victim?waitFor=COMMITTED&waitMs=5000") as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            problem = await resp.json(content_type=None)
            assert problem["code"] == "TOO_MANY_CONNECTIONS"
            assert "tasks.max_waiters_per_principal" in problem["detail"]
        body = {"owner": "w", "ttlMs": 1_000, "schedulerEpoch": await api.epoch(), "waitMs": 5_000}
        async with api.client.post("/v1/queues/q/claim", json=body) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        # What needs no waiting is answered as before.
        assert (await claim_next(api)).status == 204  # no waitMs
        at_once = await api.call("GET", "/v1/tasks/victim?waitFor=READY&waitMs=5000")
        assert at_once.status == 200 and at_once.body["state"] == "READY"
        await api.put("ready", queue="q")
        assert (await claim_next(api, waitMs=5_000)).body["taskId"] == "ready"
        assert not hogging.done()
        lease = await api.claim("hog")
        await api.commit(lease)
        assert (await hogging).body["state"] == "COMMITTED"
        assert hub(api).waiters == 0


async def test_each_principal_has_its_own_waiters_within_the_gateways(
    store_url: str, key_prefix: str
) -> None:
    names = {"sched-a": "tok-sched-a-0123456789", "sched-b": "tok-sched-b-0123456789"}
    auth = {
        "principals": [
            {"name": name, "roles": ["scheduler"], "token_sha256": token_sha256(token)}
            for name, token in names.items()
        ]
    }
    # Waits of 10 min: both still wait when the hub closes, however slow the steps between.
    tasks = {"max_waiters": 2, "max_waiters_per_principal": 1, "max_wait_ms": 600_000}
    async with flow_api(store_url, key_prefix, tasks=tasks, auth=auth) as api:

        def wait(who: str) -> Any:
            return api.client.get(
                "/v1/tasks/t1?waitFor=COMMITTED&waitMs=600000",
                headers={"Authorization": f"Bearer {names[who]}"},
            )

        put = await api.client.put(
            "/v1/tasks/t1",
            json={"inputDigest": "in-1"},
            headers={"Authorization": f"Bearer {names['sched-a']}"},
        )
        assert put.status == 201
        first = asyncio.ensure_future(wait("sched-a"))
        await until(lambda: hub(api).waiters == 1, "sched-a waits")
        async with wait("sched-a") as refused:
            assert refused.status == 503
        second = asyncio.ensure_future(wait("sched-b"))  # b has its own
        await until(lambda: hub(api).waiters == 2, "sched-b waits")
        await hub(api).close()
        for answer in await asyncio.gather(first, second):
            assert answer.status == 200
            answer.close()


async def test_on_shutdown_every_long_poll_answers_at_once(store_url: str, key_prefix: str) -> None:
    async with flow_api(store_url, key_prefix, tasks={"max_wait_ms": 600_000}) as api:
        await api.put("t1")
        body = {"owner": "w", "ttlMs": 1_000, "schedulerEpoch": await api.epoch()}
        wait_for = api.call("GET", "/v1/tasks/t1?waitFor=COMMITTED&waitMs=600000")
        queue = api.call("POST", "/v1/queues/q/claim", {**body, "waitMs": 600_000})
        polls = [asyncio.ensure_future(wait_for), asyncio.ensure_future(queue)]
        await until(lambda: hub(api).waiters == 2, "both long-polls wait")
        await api.client.app.shutdown()  # what `fencegate serve` runs on SIGTERM first
        waited_for, queued = await asyncio.wait_for(asyncio.gather(*polls), HANG_S)
        assert waited_for.status == 200 and waited_for.body["state"] == "READY"
        assert queued.status == 204
        # One that comes in while the gateway drains does not wait either.
        late = await api.call("GET", "/v1/tasks/t1?waitFor=COMMITTED&waitMs=600000")
        assert late.status == 200 and late.body["state"] == "READY"


async def test_a_queue_claim_is_woken_only_by_its_own_queue(api: Api) -> None:
    """A READY event naming another queue wakes no one; one without ``queue`` (a store that
    does not say) wakes every queue's claims; one of the queue wakes its claims."""
    events = hub(api)

    def ready(**extra: Any) -> Batch:
        body = {"type": "task", "taskId": "x", "state": "READY", **extra}
        return Batch("0-0", (Event("0-1", body),), "0-1")

    with (
        events.waiting(principal=None, queue="a") as on_a,
        events.waiting(principal=None, queue="b") as on_b,
        events.waiting(principal=None, task_id="x") as on_x,
    ):
        events._publish(ready(queue="b"))
        assert (on_a.woken, on_b.woken, on_x.woken) == (False, True, True)
        await on_b.wait(0)
        await on_x.wait(0)
        events._publish(ready(queue=None))  # a task in no queue
        events._publish(ready(state="CLAIMED", queue="a"))  # not claimable
        assert (on_a.woken, on_b.woken) == (False, False)
        events._publish(ready())
        assert (on_a.woken, on_b.woken) == (True, True)
    assert events.waiters == 0


# --- cancel cascades larger than max_cascade ------------------------------------------------


async def test_a_cascade_past_max_cascade_is_finished_by_the_background_loop(
    store_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_module, "CASCADE_IDLE_S", 0.05)
    monkeypatch.setattr(events_module, "CASCADE_BUSY_S", 0.05)
    async with flow_api(store_url, key_prefix, tasks={"max_cascade": 2}) as api:
        assert api.store.max_cascade == 2
        limits: list[int] = []
        continue_cascades = api.store.continue_cascades

        async def spy(limit: int) -> int:
            limits.append(limit)
            return await continue_cascades(limit)

        monkeypatch.setattr(api.store, "continue_cascades", spy)
        await api.put("flow::root")
        dependents = [f"flow::d{i}" for i in range(4)] + [f"flow::d0/e{i}" for i in range(4)]
        for task_id in dependents[:4]:
            await api.put(task_id, dependsOn=["flow::root"], queue="q")
        for task_id in dependents[4:]:
            await api.put(task_id, dependsOn=["flow::d0"], queue="q")
        assert (await api.cancel("flow::root")).status == 200
        # Until the loop reaches them, the dependents not yet cancelled cannot be claimed.
        assert (await claim_next(api)).status == 204

        async def all_cancelled() -> bool:
            states = {await state(api, task_id) for task_id in dependents}
            assert states <= {"WAITING", "CANCELLED"}, states
            return states == {"CANCELLED"}

        await until(all_cancelled, "the cascade reaches every dependent")
        assert limits and set(limits) == {2}
