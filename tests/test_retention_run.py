"""A run with retention at seconds through a real gateway on every store: the store's size
levels off, nothing live is removed, and late duplicates of expired effects never reach the
downstream (counted there, per Idempotency-Key).

Workers put, claim, send two proxied POSTs and commit, in a loop, while the gateway's own
retention loop (``[retention]``, 1 s settled, 3 s tombstones, a sweep every 100 ms) deletes
what settled. A checker re-sends expired tasks' calls with its old lease, and its PUT
with the same input, as a worker or scheduler waking up late would. Live records held the
whole run: a claimed task (renewed), a WAITING task and its READY dependency, a committed task
with an UNKNOWN effect, a cancelled task whose effect waits for an approval.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger.effects import EffectRequest, EffectState, Fence
from fencegate.ledger.tasks import TaskState
from tests.api import HANG_S, Api, Lease, until
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream

#: About 25 s for the three stores: with the slow tests, which `.ci/run` runs after the rest.
pytestmark = pytest.mark.slow

RUN_S = 6.0
WORKERS = 4
SLOTS = ("a", "b")


@pytest.fixture
def run_config(store_url: str, key_prefix: str, downstream: Downstream) -> Config:
    return make_config(
        store_url,
        key_prefix,
        downstreams=[{"name": "api", "url": downstream.url, "timeout_ms": 2_000}],
        proxy={"prepared_margin_ms": 4_000},
        reconciler={"enabled": False},
        retention={"settled_ms": 1_000, "tombstone_ms": 3_000, "interval_ms": 100, "batch": 20},
    )


@pytest.fixture
async def api(run_config: Config) -> AsyncIterator[Api]:
    app = create_app(run_config, store=build_test_store(run_config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


def headers(lease: Lease, slot: str) -> dict[str, str]:
    return {
        "Fence-Task": lease.task_id,
        "Fence-Attempt": lease.attempt_id,
        "Fence-Generation": str(lease.claim_generation),
        "Fence-Epoch": str(lease.scheduler_epoch),
        "Fence-Cancel": str(lease.cancel_generation),
        "Fence-Slot": slot,
    }


async def send(api: Api, lease: Lease, slot: str) -> tuple[int, Any]:
    async with api.client.post(
        f"/proxy/api/pay/{lease.task_id}/{slot}",
        json={"task": lease.task_id, "slot": slot},
        headers=headers(lease, slot),
    ) as resp:
        body = await resp.read()
        return resp.status, (await resp.json(content_type=None)) if resp.status >= 400 else body


async def hold_live_records(api: Api) -> Lease:
    """The records retention must never remove; returns the claimed task's lease."""
    store = api.store
    # One task group: on Redis Cluster a dependency across groups is refused.
    assert (await api.put("live::never")).status == 201
    assert (await api.put("live::waiting", dependsOn=["live::never"])).status == 201
    await api.put("live-claimed")
    lease = await api.claim("live-claimed", ttl_ms=30_000)
    for task_id, approval in (("live-unknown", False), ("live-approval", True)):
        await api.put(task_id, f"in-{task_id}")
        held = await api.claim(task_id, ttl_ms=30_000)
        fence = Fence(task_id, held.attempt_id, held.claim_generation, 1, 0)
        request = EffectRequest(fence, "main", "s", "api", "POST", "/x", "digest")
        prepared = await store.prepare_effect(request, 2_000, require_approval=approval)
        if approval:
            assert (await api.cancel(task_id)).status == 200
        else:
            await store.complete_effect(
                task_id, prepared.effect.effect_id, 0, held.attempt_id,
                EffectState.UNKNOWN, "timed out", None,
            )  # fmt: skip
            assert (await api.commit(held)).status == 200
    return lease


async def test_a_long_run_levels_off_and_keeps_everything_live(
    api: Api, downstream: Downstream
) -> None:
    live_lease = await hold_live_records(api)
    done: list[Lease] = []  # committed tasks, oldest first
    sampled: list[Lease] = []  # worker 0's: the ones the checker re-sends (it keeps up)
    stop = asyncio.Event()
    sizes: list[tuple[float, dict[str, Any]]] = []
    late_answers: list[tuple[str, int, str | None]] = []
    started = time.monotonic()

    async def worker(w: int) -> None:
        i = 0
        while not stop.is_set():
            task_id = f"run-{w}-{i}"
            i += 1
            assert (await api.put(task_id, f"in-{task_id}")).status == 201
            lease = await api.claim(task_id, ttl_ms=10_000)
            for slot in SLOTS:
                status, body = await send(api, lease, slot)
                # A loaded store may answer 503 (nothing sent): again, until it answers (the
                # bound only catches a store that never does).
                given_up_at = time.monotonic() + HANG_S
                while status == 503 and time.monotonic() < given_up_at:
                    await asyncio.sleep(0.05)
                    status, body = await send(api, lease, slot)
                assert status == 200, body
            assert (await api.commit(lease)).status == 200
            done.append(lease)
            if w == 0:
                sampled.append(lease)

    async def late_duplicates() -> None:
        """Worker 0's expired tasks' calls again, with their old leases; their PUTs again."""
        checked = 0
        while not stop.is_set():
            while checked < len(sampled):
                lease = sampled[checked]
                answer = await api.get(lease.task_id)
                if answer.status == 200:
                    break  # not expired yet; later ones are younger
                checked += 1
                for slot in SLOTS:
                    status, body = await send(api, lease, slot)
                    late_answers.append((lease.task_id, status, body.get("code")))
                if answer.code == "TASK_EXPIRED":  # (past its tombstone the id is new again)
                    again = await api.put(lease.task_id, lease.input_digest)
                    late_answers.append((lease.task_id, again.status, again.code))
            await asyncio.sleep(0.05)

    async def watch() -> None:
        while not stop.is_set():
            stats = await api.call("GET", "/v1/store/stats")
            assert stats.status == 200, stats.body
            sizes.append((time.monotonic() - started, stats.body))
            assert (await api.renew(live_lease, ttl_ms=30_000)).status == 200
            await asyncio.sleep(0.25)

    ran_s = 0.0

    def enough() -> bool:
        """The run lasts RUN_S at least (the soak), and on until it has what its checks
        need, however slowly a loaded machine gets there: more than 50 tasks, a late call
        refused as expired, store sizes sampled in both halves past the first settled_ms."""
        nonlocal ran_s
        ran_s = time.monotonic() - started
        half = ran_s / 2
        return (
            ran_s >= RUN_S
            and len(done) > 50
            and any(code == "TASK_EXPIRED" for _, _, code in late_answers)
            and any(1.5 <= t < half for t, _ in sizes)
            and any(t >= half for t, _ in sizes)
        )

    jobs = [asyncio.create_task(worker(w)) for w in range(WORKERS)]
    jobs += [asyncio.create_task(late_duplicates()), asyncio.create_task(watch())]
    await until(enough, "a run with enough to check", within_s=3 * HANG_S)
    stop.set()
    await asyncio.gather(*jobs)

    created = len(done)
    assert created > 50, f"only {created} tasks in {ran_s:.1f} s: the run says nothing"
    # Every effect reached the downstream exactly once, late duplicates included.
    keys = {k: n for k, n in downstream.per_key.items() if k}
    assert len(keys) == created * len(SLOTS)
    assert set(keys.values()) == {1}, {k: n for k, n in keys.items() if n != 1}
    # Late calls were refused as expired (or, past the tombstone, as unknown): never sent.
    assert late_answers, "no task expired during the run"
    codes = {code for _, _, code in late_answers}
    assert codes <= {"TASK_EXPIRED", "NO_SUCH_TASK"}, [a for a in late_answers if a[2] is None][:5]
    assert "TASK_EXPIRED" in codes
    # The size levels off: the second half never holds more tasks than the first half's peak
    # (after the first settled_ms) by more than a margin for rate changes.
    half = ran_s / 2
    early = max(s["tasks"]["total"] for t, s in sizes if 1.5 <= t < half)
    late = max(s["tasks"]["total"] for t, s in sizes if t >= half)
    assert late <= early * 1.5 + 20, (early, late, created)
    final = sizes[-1][1]
    assert final["tasks"]["total"] < created / 2
    assert final["tombstones"]["tasks"] < created
    # Nothing live was removed.
    for task_id, state in [
        ("live::never", TaskState.READY),
        ("live::waiting", TaskState.WAITING),
        ("live-claimed", TaskState.CLAIMED),
        ("live-unknown", TaskState.COMMITTED),
        ("live-approval", TaskState.CANCELLED),
    ]:
        answer = await api.get(task_id)
        assert answer.status == 200, (task_id, answer.body)
        assert answer.body["state"] == state.value
    unknown = await api.call("GET", "/v1/effects?state=UNKNOWN")
    assert [e["taskId"] for e in unknown.body["effects"]] == ["live-unknown"]
