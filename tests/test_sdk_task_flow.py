"""The SDK's task flow: ``claim_next``, ``wait_committed``, ``events()`` (and its reconnect
with ``Last-Event-ID``), and ``cost=`` on renew, release and commit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import fencegate
from fencegate import Client
from fencegate.client import MIN_POLL_S
from tests.api import HANG_S
from tests.conftest import make_config
from tests.downstream import Downstream
from tests.test_sdk import Env, env, gateway_config, running_gateway

__all__ = ["env"]


async def test_claim_next_hands_out_a_queue_in_order_and_none_when_empty(env: Env) -> None:
    client = env.client
    await client.put_task("low", "in-1", queue="q", priority=-1)
    await client.put_task("high", "in-1", queue="q", priority=5)
    record = await client.get_task("high")
    assert record.queue == "q" and record.priority == 5 and record.depends_on == ()
    first = await client.claim_next("q", owner="w1", ttl_ms=10_000)
    assert first is not None and first.task_id == "high" and first.queue == "q"
    async with first.hold() as lease:
        lease.add_cost(tokens=10)
        await lease.renew(cost={"tokens": 5, "seconds": 1})
        assert (await client.get_task("high")).cost == {"tokens": 15, "seconds": 1}
        await lease.commit({"ok": True}, cost={"tokens": 1})
    assert (await client.get_task("high")).cost == {"tokens": 16, "seconds": 1}
    second = await client.claim_next("q", owner="w1", ttl_ms=10_000)
    assert second is not None and second.task_id == "low"
    await second.release(cost={"seconds": 2})
    again = await client.claim_next("q", owner="w1", ttl_ms=10_000)
    assert again is not None and again.task_id == "low"
    assert await client.claim_next("q", owner="w1", ttl_ms=10_000, wait_ms=200) is None


async def test_a_pipeline_step_waits_for_the_first_commit(env: Env) -> None:
    client = env.client
    await client.put_task("pipe::step1", "in-1", queue="pipe")
    await client.put_task("pipe::step2", "in-1", queue="pipe", depends_on=["pipe::step1"])
    with pytest.raises(fencegate.DependenciesPending):
        await client.acquire("pipe::step2", owner="w1", ttl_ms=10_000)
    with pytest.raises(TimeoutError):
        await client.wait_committed("pipe::step1", timeout=0.3)
    # Bounds on a hang only: the claim and commit below may take long on a loaded machine.
    waiting = asyncio.ensure_future(client.wait_committed("pipe::step1", timeout=HANG_S))
    lease = await client.claim_next("pipe", owner="w1", ttl_ms=10_000)
    assert lease is not None and lease.task_id == "pipe::step1"
    done = await lease.commit({"rows": 3})
    record = await asyncio.wait_for(waiting, HANG_S)
    assert record.state == "COMMITTED" and record.commit is not None
    step2 = await client.claim_next("pipe", owner="w2", ttl_ms=10_000)
    assert step2 is not None and step2.task_id == "pipe::step2"
    assert step2.dependencies == [
        {"taskId": "pipe::step1", "commitId": done.commit_id, "resultDigest": done.result_digest}
    ]


async def test_events_follow_the_gateway(env: Env) -> None:
    """A stream opened "from now" gets every change made after it opened, in order per task.
    When it opened is learnt from the stream itself (the first marker task it shows), not
    from a sleep, which a loaded machine outlasts."""
    client = env.client
    seen: list[tuple[str, str]] = []
    opened = asyncio.Event()
    done = asyncio.Event()

    async def follow() -> None:
        async for event in client.events():
            if event.type != "task":
                continue
            task_id, state = event.data["taskId"], event.data["state"]
            if task_id.startswith("mark-"):
                opened.set()
                continue
            seen.append((task_id, state))
            if len(seen) == 2:
                done.set()
                return

    following = asyncio.ensure_future(follow())
    try:
        for n in range(300):  # a minute at most
            await client.put_task(f"mark-{n}", "in-1")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(opened.wait(), 0.2)
                break
        else:
            pytest.fail("the stream showed none of 300 tasks put after it was asked for")
        await client.put_task("t1", "in-1")
        await client.cancel_task("t1")
        await asyncio.wait_for(done.wait(), 60)
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
    assert seen == [("t1", "READY"), ("t1", "CANCELLED")]


# --- the reconnect, against a stream that drops ---------------------------------------------


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[str, list[str | None]]]:
    """An SSE server that sends two events per connection and drops it, resuming after the
    ``Last-Event-ID`` it is sent; the second connection is cut in the middle of a frame."""
    asked: list[str | None] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        last = request.headers.get("Last-Event-ID")
        asked.append(last)
        start = int(last) if last else 0
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"retry: 10\n: hello\n\n")
        for n in range(start + 1, start + 3):
            body = f'{{"type":"task","taskId":"t{n}","state":"READY"}}'
            await response.write(f"id: {n}\r\nevent: task\r\ndata: {body}\r\n\r\n".encode())
        if len(asked) == 2:
            await response.write(b"id: 999\ndata: {}\n")  # cut before the blank line
        return response

    app = web.Application()
    app.router.add_get("/v1/events", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), asked
    await server.close()


async def test_events_reconnect_from_the_last_position_seen(
    flaky: tuple[str, list[str | None]],
) -> None:
    url, asked = flaky
    async with Client(url, token="") as client:
        ids = []
        async for event in client.events(after="0"):
            ids.append(event.position)
            assert event.data["taskId"] == f"t{event.position}"
            if len(ids) == 6:
                break
    assert ids == ["1", "2", "3", "4", "5", "6"]
    assert asked == ["0", "2", "4"]  # the cut frame (id 999) never counted


async def test_a_position_past_the_history_raises_events_gone(env: Env) -> None:
    _, old = await env.store.read_events(None, 1)
    for n in range(3):  # one task group: on Redis Cluster one bucket's stream, trimmed to 1
        await env.client.put_task(f"feed::t{n}", "in-1")
    await env.store.trim_events(1)
    with pytest.raises(fencegate.EventsGone):
        async for _ in env.client.events(after=old):
            pass


def test_downstream_fixture_is_shared(downstream: Downstream) -> None:
    assert gateway_config is not None and running_gateway is not None and downstream.url


# --- long-polls back off ---------------------------------------------------------------------


def sqlite_url(tmp_path: Path) -> str:
    """The SDK's pacing does not depend on the store: these run on SQLite only."""
    return f"sqlite:///{tmp_path / 'fencegate.db'}"


@contextlib.asynccontextmanager
async def counting_client(
    store_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch, **tasks: int
) -> AsyncIterator[tuple[Client, list[str]]]:
    """A client of a gateway with these ``[tasks]`` settings, and the paths it sent."""
    config = make_config(store_url, key_prefix, reconciler={"enabled": False}, tasks=tasks)
    sent: list[str] = []
    send = Client.send

    async def counting(self: Client, method: str, path: str, **kwargs: Any) -> Any:
        if path != "/v1/epoch":
            sent.append(f"{method} {path}")
        return await send(self, method, path, **kwargs)

    monkeypatch.setattr(Client, "send", counting)
    async with running_gateway(config) as (url, _, _), Client(url, token="") as client:
        yield client, sent


async def test_wait_committed_backs_off_when_the_gateway_refuses_long_polls(
    tmp_path: Path, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At its bound of long-polls the gateway answers 503 with Retry-After: 1; the SDK asks
    again after that, never at once (an upper bound on calls, whatever the machine's speed)."""
    async with counting_client(
        sqlite_url(tmp_path), key_prefix, monkeypatch, max_waiters_per_principal=0
    ) as (
        client,
        sent,
    ):
        await client.put_task("t1", "in-1")
        sent.clear()
        with pytest.raises(TimeoutError):
            await client.wait_committed("t1", timeout=2.5)
        assert 1 <= len(sent) <= 3, sent  # at 0 s, then no sooner than 1 s and 2 s
        sent.clear()
        assert await client.claim_next("q", owner="w", ttl_ms=1_000, wait_ms=2_500) is None
        # Long-polls at 0, >= 1 and >= 2 s, and one claim without waiting at the end.
        assert 2 <= len(sent) <= 4, sent
        await client.put_task("t2", "in-1", queue="q")
        lease = await client.claim_next("q", owner="w", ttl_ms=1_000, wait_ms=2_500)
        assert lease is not None and lease.task_id == "t2"


async def test_wait_for_spaces_its_polls_when_the_gateway_does_not_wait(
    tmp_path: Path, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tasks.max_wait_ms = 0 every long-poll answers at once: MIN_POLL_S apart."""
    async with counting_client(sqlite_url(tmp_path), key_prefix, monkeypatch, max_wait_ms=0) as (
        client,
        sent,
    ):
        await client.put_task("t1", "in-1")
        sent.clear()
        with pytest.raises(TimeoutError):
            await client.wait_committed("t1", timeout=1.0)
        assert 1 <= len(sent) <= 1 + 1.0 / MIN_POLL_S, sent
        sent.clear()
        assert await client.claim_next("q", owner="w", ttl_ms=1_000, wait_ms=1_000) is None
        assert 1 <= len(sent) <= 2 + 1.0 / MIN_POLL_S, sent
