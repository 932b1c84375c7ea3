"""Streams and long-polls across an ``[auth]`` reload, and queue long-polls whose client left
(issue 25, "Events on reload" and "Queue long-poll for nobody"), on every store.

The reload is the one SIGHUP runs (``cli.reload_auth`` on the config file); nothing here
waits on the wall clock: every step waits for a condition the gateway shows (a waiter
registered, a connection gone, a long-poll ended) within a generous bound.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from fencegate.gateway import events
from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.cli import reload_auth
from fencegate.gateway.state import EVENTS
from fencegate.ledger.store import Store
from tests.api import ServeLikeServer
from tests.conftest import build_test_store, make_config

#: name -> (roles, token, task_prefixes or None)
PRINCIPALS: dict[str, tuple[list[str], str, list[str] | None]] = {
    "sched": (["scheduler"], "tok-sched-0123456789abcdef", None),
    "leaver": (["scheduler", "worker"], "tok-leaver-0123456789abcdef", None),
    "watcher": (["observer"], "tok-watcher-0123456789abcdef", ["a-"]),
    "worker-1": (["worker"], "tok-worker-1-0123456789abcdef", None),
    "worker-2": (["worker"], "tok-worker-2-0123456789abcdef", None),
}
#: Far longer than any test step: a long-poll that answers, answered for a reason.
LONG_WAIT_MS = 120_000
BOUND_S = 10.0


def auth_toml(principals: dict[str, tuple[list[str], str, list[str] | None]]) -> str:
    out = ["[auth]"]
    for name, (roles, token, prefixes) in principals.items():
        digest = token_sha256(token)
        out += ["[[auth.principals]]", f"name = {json.dumps(name)}",
                f"roles = {json.dumps(roles)}", f'token_sha256 = "{digest}"']  # fmt: skip
        if prefixes is not None:
            out.append(f"task_prefixes = {json.dumps(prefixes)}")
    return "\n".join(out) + "\n"


def auth_section() -> dict[str, Any]:
    return {
        "principals": [
            {"name": name, "roles": roles, "token_sha256": token_sha256(token)}
            | ({"task_prefixes": prefixes} if prefixes is not None else {})
            for name, (roles, token, prefixes) in PRINCIPALS.items()
        ]
    }


@dataclass
class Env:
    app: web.Application
    server: TestServer
    store: Store
    config_path: Path
    http: aiohttp.ClientSession

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    def reload(self, principals: dict[str, tuple[list[str], str, list[str] | None]]) -> None:
        self.config_path.write_text(auth_toml(principals))
        assert reload_auth(self.app, str(self.config_path))

    async def send(
        self, method: str, path: str, who: str, body: Any = None,
        http: aiohttp.ClientSession | None = None,
    ) -> tuple[int, Any]:  # fmt: skip
        headers = {"Authorization": f"Bearer {PRINCIPALS[who][1]}"}
        async with (http or self.http).request(
            method, self.url(path), json=body, headers=headers
        ) as resp:
            raw = await resp.read()
            return resp.status, (json.loads(raw) if raw else None)

    async def put(self, task_id: str, **extra: Any) -> None:
        status, body = await self.send(
            "PUT", f"/v1/tasks/{task_id}", "sched", {"inputDigest": "in-1", **extra}
        )
        assert status in (200, 201), body

    async def queue_claim(
        self, who: str, wait_ms: int = 0, http: aiohttp.ClientSession | None = None
    ) -> tuple[int, Any]:
        _, epoch = await self.send("GET", "/v1/epoch", who)
        body = {"owner": who, "ttlMs": 60_000, "schedulerEpoch": epoch["schedulerEpoch"],
                "waitMs": wait_ms}  # fmt: skip
        return await self.send("POST", "/v1/queues/q/claim", who, body, http=http)

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """Until ``condition()`` holds (a state of the gateway, not a time)."""
        async with asyncio.timeout(BOUND_S):
            while not condition():
                await asyncio.sleep(0.01)
        assert condition(), what


@pytest.fixture
async def env(store_url: str, key_prefix: str, tmp_path: Path) -> AsyncIterator[Env]:
    config = make_config(
        store_url,
        key_prefix,
        auth=auth_section(),
        reconciler={"enabled": False},
        events={"poll_ms": 20, "heartbeat_ms": 200},
        tasks={"max_wait_ms": LONG_WAIT_MS},
    )
    path = tmp_path / "fencegate.toml"
    path.write_text(auth_toml(PRINCIPALS))
    store = build_test_store(config)
    app = create_app(config, store=store)
    server = ServeLikeServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            yield Env(app, server, store, path, http)
    finally:
        await server.close()


async def task_ids(response: aiohttp.ClientResponse, count: int) -> list[str]:
    """The next ``count`` task events' task ids of an event stream."""
    out: list[str] = []
    async with asyncio.timeout(BOUND_S):
        while len(out) < count:
            line = (await response.content.readline()).decode()
            assert line, "the stream ended"
            if line.startswith("data: "):
                data = json.loads(line[6:])
                if data.get("type") == "task":
                    out.append(data["taskId"])
    return out


# --- events on reload -------------------------------------------------------------------------


async def test_a_reload_that_removes_a_principal_ends_its_streams_and_long_polls(
    env: Env,
) -> None:
    await env.put("w-1")
    headers = {"Authorization": f"Bearer {PRINCIPALS['leaver'][1]}"}
    stream = await env.http.get(env.url("/v1/events"), headers=headers)
    assert stream.status == 200
    wait_for = asyncio.ensure_future(
        env.send("GET", f"/v1/tasks/w-1?waitFor=COMMITTED&waitMs={LONG_WAIT_MS}", "leaver")
    )
    claim = asyncio.ensure_future(env.queue_claim("leaver", LONG_WAIT_MS))
    hub = env.app[EVENTS]
    await env.until(lambda: hub.waiters == 2 and hub.subscribers == 1, "all three waiting")

    with capture_logs() as logs:
        env.reload({k: v for k, v in PRINCIPALS.items() if k != "leaver"})
        async with asyncio.timeout(BOUND_S):
            answers = await asyncio.gather(wait_for, claim)
            assert await stream.content.read() is not None  # to its end
    assert stream.content.at_eof()
    for status, body in answers:
        assert (status, body["code"]) == (401, "UNAUTHENTICATED"), body
        assert "leaver" in body["detail"]
    assert any(e["event"] == "events.reloaded" and e["streams_ended"] == 1
               and e["long_polls_refused"] == 2 for e in logs), logs  # fmt: skip
    # The refused queue claim took nothing: the next task is there for another worker.
    await env.put("q-1", queue="q")
    status, claimed = await env.queue_claim("worker-2")
    assert status == 200 and claimed["taskId"] == "q-1", claimed
    status, again = await env.send("GET", "/v1/events", "leaver")
    assert status == 401, again


async def test_changed_task_prefixes_apply_to_an_open_stream_from_the_next_event(
    env: Env,
) -> None:
    headers = {"Authorization": f"Bearer {PRINCIPALS['watcher'][1]}"}
    stream = await env.http.get(env.url("/v1/events"), headers=headers)
    assert stream.status == 200
    for task in ("b-1", "a-1"):
        await env.put(task)
    assert await task_ids(stream, 1) == ["a-1"]

    env.reload({**PRINCIPALS, "watcher": (["observer"], PRINCIPALS["watcher"][1], ["b-"])})
    for task in ("a-2", "b-2"):
        await env.put(task)
    assert await task_ids(stream, 1) == ["b-2"]
    stream.close()


def test_after_reload_judges_as_a_new_request_would() -> None:
    from fencegate.gateway.auth import principal_from_config
    from fencegate.gateway.config import AuthConfig

    principals = {
        p.name: principal_from_config(p)
        for p in AuthConfig.model_validate(auth_section()).principals
    }
    events_route = ("GET", "/v1/events")
    wait = ("GET", "/v1/tasks/{task_id}")
    queue = ("POST", "/v1/queues/{queue}/claim")
    assert events.after_reload(principals, "gone", route=events_route).code == "UNAUTHENTICATED"  # type: ignore[union-attr]
    assert events.after_reload(principals, "worker-1", route=events_route).code == "FORBIDDEN"  # type: ignore[union-attr]
    assert events.after_reload(principals, "watcher", route=wait, task_id="b-1").code == "FORBIDDEN"  # type: ignore[union-attr]
    assert (
        events.after_reload(principals, "watcher", route=wait, task_id="a-1")
        is principals["watcher"]
    )
    assert events.after_reload(principals, "worker-1", route=queue) is principals["worker-1"]


# --- queue long-poll for nobody ---------------------------------------------------------------


async def long_poll_of_a_client_that_leaves(env: Env) -> Callable[[], Awaitable[None]]:
    """worker-1 long-polls the empty queue on its own connection; the returned function
    closes that connection and waits until the gateway has seen it go.

    Waiting means both of its claims found nothing: the one before it waits and the one
    made once it is registered (``hub.waiters``), so a task put next only wakes it. (A
    claim still in flight could take that task, which is the next test's story; on a store
    with many buckets a claim takes longer, and the window is wider.)"""
    empty_claims = 0
    claim_next = env.store.claim_next

    async def counted(queue: str, request: Any) -> Any:
        nonlocal empty_claims
        task = await claim_next(queue, request)
        empty_claims += task is None
        return task

    env.store.claim_next = counted  # type: ignore[method-assign]
    http = aiohttp.ClientSession()
    poll = asyncio.ensure_future(env.queue_claim("worker-1", LONG_WAIT_MS, http=http))
    hub = env.app[EVENTS]
    await env.until(lambda: hub.waiters == 1 and empty_claims >= 2, "worker-1's long-poll waits")
    runner = env.server.runner
    assert runner is not None and runner.server is not None
    server = runner.server

    def lost() -> int:
        """Connections the gateway saw close whose handler still runs (the long-poll's)."""
        return sum(1 for handler in server.connections if handler.transport is None)

    async def leave() -> None:
        before = lost()
        poll.cancel()
        await http.close()
        await env.until(lambda: lost() > before, "the gateway saw worker-1 go")

    return leave


def gone_logged(logs: list[dict[str, Any]]) -> bool:
    return any(e["event"] == "claim.client_gone" for e in logs)


async def task_record(env: Env, task_id: str) -> dict[str, Any]:
    status, task = await env.send("GET", f"/v1/tasks/{task_id}", "sched")
    assert status == 200, task
    record: dict[str, Any] = task
    return record


async def test_a_long_poll_whose_client_left_claims_nothing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task's event wakes the long-poll of a client that is gone: it makes no claim, so
    another worker claims the task at once (generation 1: nobody held it before)."""
    monkeypatch.setattr(events, "RECHECK_S", 600.0)  # only the task's event wakes it
    leave = await long_poll_of_a_client_that_leaves(env)
    await leave()
    hub = env.app[EVENTS]
    assert hub.waiters == 1  # still waiting: nothing woke it yet
    with capture_logs() as logs:
        await env.put("q-1", queue="q")
        await env.until(lambda: gone_logged(logs), "the woken long-poll ended")
    assert hub.waiters == 0
    status, claimed = await env.queue_claim("worker-2")
    assert status == 200 and claimed["taskId"] == "q-1", claimed
    task = await task_record(env, "q-1")
    assert (task["owner"], task["claimGeneration"]) == ("worker-2", 1), task
    gone = [e for e in logs if e["event"] == "claim.client_gone"]
    assert [e["claimed"] for e in gone] == [False], logs


async def test_a_claim_made_as_its_client_left_is_released_at_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client leaves while the store claims for it: the claim is released at once, so
    another worker claims the task without waiting for a lease to run out."""
    claimed_for_nobody = asyncio.Event()
    go_on = asyncio.Event()
    claim_next = env.store.claim_next

    async def gated(queue: str, request: Any) -> Any:
        task = await claim_next(queue, request)
        if task is not None and request.owner == "worker-1":
            claimed_for_nobody.set()
            await go_on.wait()
        return task

    monkeypatch.setattr(env.store, "claim_next", gated)
    leave = await long_poll_of_a_client_that_leaves(env)
    hub = env.app[EVENTS]
    with capture_logs() as logs:
        await env.put("q-1", queue="q")
        async with asyncio.timeout(BOUND_S):
            await claimed_for_nobody.wait()
        held = await task_record(env, "q-1")
        assert (held["state"], held["owner"]) == ("CLAIMED", "worker-1"), held
        await leave()
        go_on.set()
        # The release comes after the long-poll stopped waiting: its event is what ends it.
        await env.until(lambda: gone_logged(logs), "the claim was given back")
    assert hub.waiters == 0
    status, claimed = await env.queue_claim("worker-2")
    assert status == 200 and claimed["taskId"] == "q-1", claimed
    task = await task_record(env, "q-1")
    assert (task["owner"], task["claimGeneration"]) == ("worker-2", 2), task
    gone = [e for e in logs if e["event"] == "claim.client_gone"]
    assert [(e["claimed"], e["released"]) for e in gone] == [(True, True)], logs
