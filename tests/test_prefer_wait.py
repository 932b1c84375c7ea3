"""Wait instead of 409 (``gateway/effect_waiters.py``): a duplicate of an in-flight effect that
sends ``Prefer: wait=N`` (on MCP ``_meta["dev.fencegate/wait"]``) gets the first call's outcome.

The downstream is a real server on loopback that holds each of its first calls until the test
lets it go (``Held``), so "the first call is still in flight" is something the test sets up,
never a race with the clock; what ran is counted there. The store's clock stands still (only
``Api.advance`` moves it): a PREPARED record's deadline passes only when a test says so. The
only real-time waits are the ones whose end is the point (``wait=1`` running out while the
first call is certainly still held).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDictProxy

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.gateway.state import EVENTS
from tests.api import HANG_S, Api, Lease, serve_app, until
from tests.clocks import freeze_store_clock, still
from tests.conftest import build_test_store, make_config

#: The forward's timeout and the PREPARED margin: the record's deadline is their sum
#: (``proxy.prepared_margin_ms``), far past anything a test waits for unless it moves the
#: store's clock.
TIMEOUT_MS = 10_000
MARGIN_MS = 20_000
DEADLINE_MS = TIMEOUT_MS + MARGIN_MS
BODY = b'{"amount": 5}'


@dataclass
class Held:
    """A downstream (HTTP ``/pay``, MCP ``/mcp``) whose first ``hold`` calls wait until the
    test lets them go (``release``); each answers the next status of ``answers`` (200 when
    none is left). A call answered 200 executed (``executed``); a 429 refused it."""

    hold: int = 1
    answers: deque[int] = field(default_factory=deque)
    gates: list[asyncio.Event] = field(default_factory=list)
    executed: int = 0
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> Held:
        app = web.Application()
        app.router.add_post("/pay", self._pay)
        app.router.add_post("/mcp", self._mcp)
        self.runner, self.url = await serve_app(app)
        return self

    @property
    def calls(self) -> int:
        return len(self.gates)

    def release(self, index: int = 0) -> None:
        self.gates[index].set()

    async def _run(self) -> int:
        gate = asyncio.Event()
        self.gates.append(gate)
        if len(self.gates) > self.hold:
            gate.set()
        await gate.wait()
        status = self.answers.popleft() if self.answers else 200
        if status == 200:
            self.executed += 1
        return status

    async def _pay(self, request: web.Request) -> web.Response:
        await request.read()
        status = await self._run()
        return web.json_response({"executed": self.executed}, status=status)

    async def _mcp(self, request: web.Request) -> web.Response:
        message = await request.json()
        if message.get("method") != "tools/call":
            return web.json_response({"jsonrpc": "2.0", "id": message.get("id"), "result": {}})
        await self._run()
        text = f"paid {self.executed}"
        result = {"content": [{"type": "text", "text": text}], "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})


@pytest.fixture
async def held() -> AsyncIterator[Held]:
    server = await Held().start()
    yield server
    for gate in server.gates:
        gate.set()  # nothing stays held past the test
    assert server.runner is not None
    await server.runner.cleanup()


def wait_config(store_url: str, key_prefix: str, held: Held, **sections: Any) -> Config:
    proxy = {"prepared_margin_ms": MARGIN_MS, "forward_start_limit_ms": 10_000}
    proxy.update(sections.pop("proxy", {}))
    return make_config(
        store_url,
        key_prefix,
        downstreams=[
            {
                "name": "pay",
                "url": held.url,
                "timeout_ms": TIMEOUT_MS,
                "client_idempotency_keys": "optional",
            },
            {
                "name": "tools",
                "url": f"{held.url}/mcp",
                "adapter": "mcp",
                "timeout_ms": TIMEOUT_MS,
            },
        ],
        proxy=proxy,
        events={"poll_ms": 20},
        **sections,
    )


@asynccontextmanager
async def gateway(config: Config) -> AsyncIterator[TestClient[Any, Any]]:
    """A gateway on the test's store, its clock standing still (``freeze_store_clock``)."""
    store = freeze_store_clock(build_test_store(config))
    app = create_app(config, store=store, forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


@dataclass
class Sent:
    status: int
    headers: CIMultiDictProxy[str]
    body: Any

    @property
    def code(self) -> str | None:
        return self.body.get("code") if isinstance(self.body, dict) else None


async def pay(client: TestClient[Any, Any], lease: Lease, prefer: str | None = None) -> Sent:
    headers = {**lease.fence_headers(), "Fence-Slot": "pay", "Content-Type": "application/json"}
    if prefer is not None:
        headers["Prefer"] = prefer
    async with asyncio.timeout(HANG_S):
        async with client.post("/proxy/pay/pay", data=BODY, headers=headers) as resp:
            return Sent(resp.status, resp.headers, await resp.json(content_type=None))


async def leased(client: TestClient[Any, Any]) -> tuple[Api, Lease]:
    api = Api(client)
    assert (await api.put("t-1")).status == 201
    return api, await api.claim("t-1", ttl_ms=60_000)


async def first_in_flight(
    client: TestClient[Any, Any], lease: Lease, held: Held
) -> asyncio.Task[Sent]:
    """The first call, sent and held at the downstream."""
    first = asyncio.create_task(pay(client, lease))
    await until(lambda: held.calls == 1, "the first call reached the downstream")
    return first


async def waiting(client: TestClient[Any, Any], count: int = 1) -> None:
    await until(lambda: client.app[EVENTS].waiters == count, f"{count} waiter(s) waiting")


async def test_a_waiting_duplicate_gets_the_replay(
    store_url: str, key_prefix: str, held: Held
) -> None:
    async with gateway(wait_config(store_url, key_prefix, held)) as client:
        _, lease = await leased(client)
        first = await first_in_flight(client, lease, held)
        duplicate = asyncio.create_task(pay(client, lease, prefer="respond-async, wait=10"))
        await waiting(client)
        held.release()
        one, two = await first, await duplicate
    assert one.status == 200 and one.headers["Fence-Replayed"] == "false"
    assert "Preference-Applied" not in one.headers
    assert two.status == 200, two.body
    assert two.headers["Fence-Replayed"] == "true"
    assert two.headers["Preference-Applied"] == "wait=10"
    assert two.body == one.body == {"executed": 1}
    assert (held.calls, held.executed) == (1, 1)


async def test_after_a_not_applied_first_call_the_waiter_goes_on_as_a_fresh_attempt(
    store_url: str, key_prefix: str, held: Held
) -> None:
    held.answers.append(429)  # the first call is refused: nothing happened
    async with gateway(wait_config(store_url, key_prefix, held)) as client:
        _, lease = await leased(client)
        first = await first_in_flight(client, lease, held)
        duplicate = asyncio.create_task(pay(client, lease, prefer="wait=10"))
        await waiting(client)
        held.release()
        one, two = await first, await duplicate
    assert one.status == 429
    assert two.status == 200, two.body
    assert two.headers["Fence-Replayed"] == "false"
    assert two.headers["Fence-Effect-State"] == "COMMITTED"
    assert two.headers["Preference-Applied"] == "wait=10"
    assert (held.calls, held.executed) == (2, 1)


async def test_a_wait_that_runs_out_is_in_flight(
    store_url: str, key_prefix: str, held: Held
) -> None:
    async with gateway(wait_config(store_url, key_prefix, held)) as client:
        _, lease = await leased(client)
        first = await first_in_flight(client, lease, held)
        # Held by the test: the first call's outcome certainly comes after the 1 s.
        two = await pay(client, lease, prefer="wait=1")
        held.release()
        one = await first
    assert two.status == 409 and two.code == "EFFECT_IN_FLIGHT"
    assert two.headers["Preference-Applied"] == "wait=1"
    assert "Retry-After" in two.headers
    assert one.status == 200
    assert (held.calls, held.executed) == (1, 1)


async def test_a_wait_is_bounded_by_max_prefer_wait_ms(
    store_url: str, key_prefix: str, held: Held
) -> None:
    config = wait_config(store_url, key_prefix, held, proxy={"max_prefer_wait_ms": 1_000})
    async with gateway(config) as client:
        _, lease = await leased(client)
        first = await first_in_flight(client, lease, held)
        two = await pay(client, lease, prefer="wait=3600")
        held.release()
        await first
    assert two.status == 409 and two.code == "EFFECT_IN_FLIGHT"
    assert two.headers["Preference-Applied"] == "wait=1"


@pytest.mark.one_store
@pytest.mark.parametrize("prefer", ["wait", "wait=-1", "wait=abc", "wait=1.5", "wait=0"])
async def test_no_wait_answers_at_once(
    store_url: str, key_prefix: str, held: Held, prefer: str
) -> None:
    """A malformed ``wait`` is ignored (RFC 7240); ``wait=0`` applies, and waits not at all."""
    async with gateway(wait_config(store_url, key_prefix, held)) as client:
        _, lease = await leased(client)
        first = await first_in_flight(client, lease, held)
        two = await pay(client, lease, prefer=prefer)
        held.release()
        await first
    assert two.status == 409 and two.code == "EFFECT_IN_FLIGHT"
    applied = two.headers.get("Preference-Applied")
    assert applied == ("wait=0" if prefer == "wait=0" else None)


async def test_waiters_count_against_the_waiter_limit(
    store_url: str, key_prefix: str, held: Held
) -> None:
    tasks = {"max_waiters": 10, "max_waiters_per_principal": 1}
    async with gateway(wait_config(store_url, key_prefix, held, tasks=tasks)) as client:
        _, lease = await leased(client)
        first = await first_in_flight(client, lease, held)
        duplicate = asyncio.create_task(pay(client, lease, prefer="wait=10"))
        await waiting(client)
        refused = await pay(client, lease, prefer="wait=10")
        plain = await pay(client, lease)  # asks for no wait: not a waiter
        held.release()
        one, two = await first, await duplicate
    assert refused.status == 503 and refused.code == "TOO_MANY_CONNECTIONS", refused.body
    assert "Retry-After" in refused.headers
    assert "Preference-Applied" not in refused.headers
    assert plain.status == 409 and plain.code == "EFFECT_IN_FLIGHT"
    assert two.status == 200 and two.headers["Fence-Replayed"] == "true"
    assert one.body == two.body
    assert (held.calls, held.executed) == (1, 1)


async def test_an_outcome_recorded_by_another_gateway_wakes_the_waiter_through_the_feed(
    store_url: str, key_prefix: str, held: Held
) -> None:
    """Two gateways on one store: the first call goes through ``a``, the waiting duplicate
    through ``b``, which learns the outcome from the store's change feed. The record's
    deadline is far off and the store's clock stands still: only an event can wake it
    before ``HANG_S`` (``pay``) gives up."""
    proxy = {"max_prefer_wait_ms": 600_000, "prepared_margin_ms": 300_000}
    config = wait_config(store_url, key_prefix, held, proxy=proxy)
    async with gateway(config) as a, gateway(config) as b:
        _, lease = await leased(a)
        first = await first_in_flight(a, lease, held)
        duplicate = asyncio.create_task(pay(b, lease, prefer="wait=600"))
        await waiting(b)
        held.release()
        one, two = await first, await duplicate
    assert two.status == 200, two.body
    assert two.headers["Fence-Replayed"] == "true"
    assert two.headers["Preference-Applied"] == "wait=600"
    assert one.body == two.body
    assert (held.calls, held.executed) == (1, 1)


async def test_a_first_call_past_its_deadline_ends_the_wait_unknown(
    store_url: str, key_prefix: str, held: Held
) -> None:
    """The first gateway went quiet (its call is held and never recorded): the waiter wakes
    at the record's deadline, not at the end of its wait, and the record reads UNKNOWN."""
    config = wait_config(store_url, key_prefix, held, proxy={"max_prefer_wait_ms": 600_000})
    async with gateway(config) as client:
        api, lease = await leased(client)
        first = await first_in_flight(client, lease, held)
        api.advance(DEADLINE_MS - 200)  # the deadline is 200 ms of store time away
        duplicate = asyncio.create_task(pay(client, lease, prefer="wait=600"))
        await waiting(client)
        api.advance(1_000)  # and now past
        two = await duplicate
        held.release()
        await first
    assert two.status == 409 and two.code == "EFFECT_UNKNOWN", two.body
    assert two.headers["Preference-Applied"] == "wait=600"
    assert held.executed == 1


async def pay_keyed(client: TestClient[Any, Any], prefer: str | None = None) -> Sent:
    """A lease-less client's call with its ``Idempotency-Key`` (a keyed effect)."""
    headers = {"Idempotency-Key": '"order-7"', "Content-Type": "application/json"}
    if prefer is not None:
        headers["Prefer"] = prefer
    async with asyncio.timeout(HANG_S):
        async with client.post("/proxy/pay/pay", data=BODY, headers=headers) as resp:
            return Sent(resp.status, resp.headers, await resp.json(content_type=None))


async def test_a_keyed_duplicate_waits_too(store_url: str, key_prefix: str, held: Held) -> None:
    async with gateway(wait_config(store_url, key_prefix, held)) as client:
        first = asyncio.create_task(pay_keyed(client))
        await until(lambda: held.calls == 1, "the first call reached the downstream")
        duplicate = asyncio.create_task(pay_keyed(client, prefer="wait=10"))
        await waiting(client)
        held.release()
        one, two = await first, await duplicate
    assert one.status == 200, one.body
    assert two.status == 200, two.body
    assert two.headers["Fence-Replayed"] == "true"
    assert two.headers["Preference-Applied"] == "wait=10"
    assert two.body == one.body
    assert (held.calls, held.executed) == (1, 1)


def tool_call(request_id: int, wait: float | None = None) -> bytes:
    meta: dict[str, Any] = {"dev.fencegate/slot": "charge-1"}
    if wait is not None:
        meta["dev.fencegate/wait"] = wait
    params = {"name": "charge", "arguments": {"amount": 5}, "_meta": meta}
    message = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
    return json.dumps(message).encode()


async def mcp_call(client: TestClient[Any, Any], lease: Lease, body: bytes) -> Sent:
    headers = {
        **lease.fence_headers(),
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
    }
    async with asyncio.timeout(HANG_S):
        async with client.post("/mcp/tools", data=body, headers=headers) as resp:
            return Sent(resp.status, resp.headers, await resp.json(content_type=None))


async def test_mcp_waits_through_meta(store_url: str, key_prefix: str, held: Held) -> None:
    async with gateway(wait_config(store_url, key_prefix, held)) as client:
        _, lease = await leased(client)
        first = asyncio.create_task(mcp_call(client, lease, tool_call(1)))
        await until(lambda: held.calls == 1, "the first call reached the server")
        duplicate = asyncio.create_task(mcp_call(client, lease, tool_call(2, wait=2.5)))
        await waiting(client)
        held.release()
        one, two = await first, await duplicate
    assert one.body["result"]["content"] == [{"type": "text", "text": "paid 1"}], one.body
    assert two.body["id"] == 2 and "error" not in two.body, two.body
    assert two.body["result"]["content"] == one.body["result"]["content"]
    assert two.headers["Fence-Replayed"] == "true"
    assert two.headers["Preference-Applied"] == "wait=3"
    assert (held.calls, held.executed) == (1, 1)
