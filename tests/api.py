"""A thin test helper over the coordination API: call it the way a worker would."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import load_config
from fencegate.gateway.state import STORE
from fencegate.ledger.store import Store

__all__ = ["HANG_S", "Answer", "Api", "InProcessGateway", "Lease", "until"]

#: How long ``until`` waits before it calls the wait a hang: far past anything a loaded
#: machine needs, and inside the per-test timeout.
HANG_S = 30.0


async def until(
    check: Callable[[], Awaitable[bool] | bool], what: str, *, within_s: float = HANG_S
) -> None:
    """Return once ``check`` holds (polled); fail naming ``what`` after ``within_s``.

    For a test that must wait for something another task, thread or process does: the bound
    only catches a hang, and nothing asserts how soon the condition came, so a busy machine
    makes the test slower, never red (a fixed sleep would make it red)."""
    deadline = time.monotonic() + within_s
    while True:
        done = check()
        if done if isinstance(done, bool) else await done:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"never, within {within_s} s: {what}")
        await asyncio.sleep(0.02)


def claim_fence(claim: dict[str, Any], slot: str) -> dict[str, str]:
    """The ``Fence-*`` headers of a claim's JSON answer, for tests that talk raw HTTP to
    gateway processes (``fencegate.Lease.fence_headers`` is the SDK's)."""
    return {
        "Fence-Task": claim["taskId"],
        "Fence-Attempt": claim["attemptId"],
        "Fence-Generation": str(claim["claimGeneration"]),
        "Fence-Epoch": str(claim["schedulerEpoch"]),
        "Fence-Cancel": str(claim["cancelGeneration"]),
        "Fence-Slot": slot,
    }


@dataclass
class Answer:
    status: int
    body: Any
    content_type: str

    @property
    def code(self) -> str | None:
        return self.body.get("code") if isinstance(self.body, dict) else None


@dataclass
class Lease:
    task_id: str
    attempt_id: str
    claim_generation: int
    owner: str
    scheduler_epoch: int
    cancel_generation: int
    lease_expires_at: int
    input_digest: str

    def fence_headers(self) -> dict[str, str]:
        """The ``Fence-*`` headers of a call under this lease."""
        return {
            "Fence-Task": self.task_id,
            "Fence-Attempt": self.attempt_id,
            "Fence-Generation": str(self.claim_generation),
            "Fence-Epoch": str(self.scheduler_epoch),
            "Fence-Cancel": str(self.cancel_generation),
        }

    def identity(self, **override: Any) -> dict[str, Any]:
        ident = {
            "attemptId": self.attempt_id,
            "claimGeneration": self.claim_generation,
            "owner": self.owner,
            "schedulerEpoch": self.scheduler_epoch,
            "cancelGeneration": self.cancel_generation,
        }
        ident.update(override)
        return ident


class Api:
    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.client = client

    @property
    def store(self) -> Store:
        return self.client.app[STORE]  # type: ignore[index]

    def advance(self, ms: int) -> None:
        """Move the store's clock forward (the test-only offset)."""
        self.store.clock_offset_ms += ms

    async def call(self, method: str, path: str, json: Any = None, data: Any = None) -> Answer:
        async with self.client.request(method, path, json=json, data=data) as resp:
            content_type = resp.content_type
            body = await resp.json(content_type=None) if await resp.read() else None
            return Answer(resp.status, body, content_type)

    async def put(self, task_id: str, input_digest: str = "in-1", **extra: Any) -> Answer:
        body = {"inputDigest": input_digest, **extra}
        return await self.call("PUT", f"/v1/tasks/{task_id}", body)

    async def get(self, task_id: str) -> Answer:
        return await self.call("GET", f"/v1/tasks/{task_id}")

    async def epoch(self) -> int:
        answer = await self.call("GET", "/v1/epoch")
        return int(answer.body["schedulerEpoch"])

    async def try_claim(
        self,
        task_id: str,
        owner: str = "w1",
        ttl_ms: int = 10_000,
        epoch: int | None = None,
        **extra: Any,
    ) -> Answer:
        body = {
            "owner": owner,
            "ttlMs": ttl_ms,
            "schedulerEpoch": await self.epoch() if epoch is None else epoch,
            **extra,
        }
        return await self.call("POST", f"/v1/tasks/{task_id}/claim", body)

    async def claim(
        self, task_id: str, owner: str = "w1", ttl_ms: int = 10_000, **extra: Any
    ) -> Lease:
        answer = await self.try_claim(task_id, owner, ttl_ms, **extra)
        assert answer.status == 200, answer.body
        b = answer.body
        return Lease(
            task_id,
            b["attemptId"],
            b["claimGeneration"],
            owner,
            b["schedulerEpoch"],
            b["cancelGeneration"],
            b["leaseExpiresAt"],
            b["inputDigest"],
        )

    async def renew(self, lease: Lease, ttl_ms: int = 10_000, **override: Any) -> Answer:
        return await self.call(
            "POST",
            f"/v1/tasks/{lease.task_id}/renew",
            {**lease.identity(**override), "ttlMs": ttl_ms},
        )

    async def release(self, lease: Lease, **override: Any) -> Answer:
        return await self.call(
            "POST", f"/v1/tasks/{lease.task_id}/release", lease.identity(**override)
        )

    async def commit(self, lease: Lease, result_digest: str = "out-1", **override: Any) -> Answer:
        body = lease.identity()
        body.pop("owner")
        body.update(inputDigest=lease.input_digest, resultDigest=result_digest)
        body.update(override)
        return await self.call("POST", f"/v1/tasks/{lease.task_id}/commit", body)

    async def cancel(self, task_id: str) -> Answer:
        return await self.call("POST", f"/v1/tasks/{task_id}/cancel")


async def mcp_lease(client: TestClient[Any, Any]) -> tuple[str, dict[str, str]]:
    """A claimed task and the headers of a raw ``/mcp`` call under its lease."""
    api = Api(client)
    task = f"t-{os.urandom(4).hex()}"
    assert (await api.put(task)).status == 201
    lease = await api.claim(task)
    return task, {
        **lease.fence_headers(),
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
    }


async def mcp_post(
    client: TestClient[Any, Any], downstream: str, headers: Any, body: bytes
) -> tuple[int, dict[str, Any]]:
    """One raw POST to ``/mcp/{downstream}``: its status and JSON answer."""
    async with client.post(f"/mcp/{downstream}", data=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def task_effects(client: TestClient[Any, Any], task: str) -> list[dict[str, Any]]:
    """The ledger's effects of a task, as an operator lists them."""
    async with client.get("/v1/effects", params={"taskId": task, "limit": "100"}) as resp:
        assert resp.status == 200
        effects: list[dict[str, Any]] = (await resp.json())["effects"]
        return effects


async def serve_app(app: web.Application, **runner: Any) -> tuple[web.AppRunner, str]:
    """A small aiohttp downstream on a port the system picks: its runner (clean it up) and
    its base URL."""
    started = web.AppRunner(app, access_log=None, **runner)
    await started.setup()
    site = web.TCPSite(started, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return started, f"http://127.0.0.1:{port}"


class ServeLikeServer(TestServer):
    """A test server that, as ``fencegate serve`` (``web.AppRunner`` in ``cli._run``), does
    not cancel a handler whose client left (``TestServer`` does): the handler sees it go, and
    a forward it started goes on and is recorded."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = False
        return await super()._make_runner(**kwargs)


class InProcessGateway:
    """``fencegate serve``'s app, built from its config file as ``serve`` builds it, served in
    the test's own process on a port the system picks (``ServeLikeServer``). For tests where a
    real process is not the point (no kill -9, no signals, no start-up or log lines): it costs
    no interpreter start-up and import. ``url`` as ``GatewayProcess.url``; ``stop`` it."""

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.server: ServeLikeServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None and self.server.port is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> InProcessGateway:
        app = create_app(load_config(self.config_path))
        self.server = ServeLikeServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
