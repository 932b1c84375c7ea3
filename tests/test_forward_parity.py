"""One forward path: ``/proxy`` and ``/mcp`` come to the same outcome for every failure kind.

Issue 25 found ``/mcp`` with its own send routine and its own "client error -> outcome" map,
drifted from ``/proxy``'s (no pool-wait or refused re-send handling, no clean-up of a prepare
whose store answer was lost, a re-send window the start limit did not shorten). Both now
send through ``gateway/forward.py``; this file holds them to it, on every store:

* for each failure kind, a ``/proxy`` POST and an MCP ``tools/call`` meet the same fault at a
  raw TCP downstream that counts what it executed (a request read in full): the ledger's
  state, the agent's error code and effect state, and the executions must be the same for
  both, and the ones the table says. The agent's error never names the downstream's address;
* an idempotent call's UNKNOWN re-send is admitted for its window less the start limit, on
  both routes;
* the pure table (``failure_of``) and decision (``failure_answer``), row by row.

Faults are real where the client can meet them on loopback: a refused connect, a pool with
one connection held by another forward, a reset before anything was read, a reset after the
request was read (and executed), no answer at all. Two are injected at the one seam both
routes share: a refused re-send (``send_once`` refusing after the first send went out: aiohttp
re-sends only idempotent methods, and an MCP call is a POST) and a store whose prepare is
applied but whose answer is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import socket
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway import forward
from fencegate.gateway.app import create_app
from fencegate.gateway.forward import (
    Bound,
    Failure,
    FailureKind,
    Limits,
    Target,
    failure_answer,
    failure_of,
    resend_window,
)
from fencegate.gateway.http_client import ResendRefused
from fencegate.gateway.state import STORE
from fencegate.ledger.effects import EffectState
from fencegate.ledger.errors import StoreUnavailable
from tests.api import HANG_S, Api, Lease
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.test_proxy import fence_headers

pytestmark = pytest.mark.timeout(30)

#: The forward timeout of both downstreams: far above a loopback answer, far below the test's.
TIMEOUT_MS = 1_000
#: Room for a loaded machine's prepare (PostgreSQL takes several round trips): a forward that
#: cannot start within it is refused as too late, which is not what these tests are about.
START_LIMIT_MS = 1_500
MARGIN_MS = 3_000
#: The idempotent kinds' dedupe window (the re-send test).
WINDOW_MS = 5_000

PROXY_PATH = "/pay"
MCP_PATH = "/mcp"
HOLD_PATH = "/hold"

#: What the fault server does with a connection.
ANSWER, RESET_BEFORE, RESET_AFTER, SILENT = "answer", "reset-before", "reset-after", "silent"


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


class FaultServer:
    """An HTTP/1.1 downstream on loopback for both routes. It counts a request as executed
    once it has read it in full (per path), then, by ``mode``: answers (200, a JSON-RPC
    result), resets the connection, or says nothing. ``RESET_BEFORE`` resets every connection
    before reading a byte. ``/hold`` is never answered (it holds a pooled connection)."""

    def __init__(self) -> None:
        self.mode = ANSWER
        self.executed: Counter[str] = Counter()
        self.port = 0
        self._server: asyncio.Server | None = None
        #: Connections being served (a held or silent one waits for ``_stopping``).
        self.open = 0
        self._stopping = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FaultServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        self._stopping.set()
        async with asyncio.timeout(HANG_S):
            while self.open:
                await asyncio.sleep(0.01)
        await self._server.wait_closed()

    async def _read(self, reader: asyncio.StreamReader) -> str:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        target = head[0].split(" ")[1]
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        await reader.readexactly(length)
        return target.split("?", 1)[0]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            if self.mode == RESET_BEFORE:
                _rst(writer)
                return
            while True:
                try:
                    path = await self._read(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if path == HOLD_PATH:
                    await self._stopping.wait()
                    return
                self.executed[path] += 1  # the effect happens here, before any answer
                if self.mode == RESET_AFTER:
                    _rst(writer)
                    return
                if self.mode == SILENT:
                    await self._stopping.wait()
                    return
                body = b'{"jsonrpc":"2.0","id":1,"result":{"content":[]}}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        finally:
            self.open -= 1
            with contextlib.suppress(Exception):
                writer.close()


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port bound without listening: a connect to it is refused (ECONNREFUSED)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
    finally:
        sock.close()


@dataclass
class Gateway:
    api: Api
    fault: FaultServer
    #: The address the two downstreams are configured with (the agent must never see it).
    base: str


@contextlib.asynccontextmanager
async def gateway(
    store_url: str,
    key_prefix: str,
    fault: FaultServer,
    base: str,
    *,
    adapter: str = "http",
    tool_kind: str = "effect",
    max_connections: int = 10,
    forward_clock: Callable[[], float] = still,
) -> AsyncIterator[Gateway]:
    """The gateway in-process with ``api`` (``/proxy/api``, adapter ``adapter``) and ``tools``
    (``/mcp/tools``, its tool ``charge`` of ``tool_kind``) both at ``base``, and ``hold`` at the
    fault server. Its forward clock stands still unless a test is about the start limit in
    real time (``time.monotonic``): a loaded machine's slow prepare must not spend it."""
    api: dict[str, Any] = {"name": "api", "url": base, "timeout_ms": TIMEOUT_MS, "adapter": adapter}
    tool: dict[str, Any] = {"kind": tool_kind}
    if adapter == "idempotent":
        api["dedupe_window_ms"] = WINDOW_MS
        tool["dedupe_window_ms"] = WINDOW_MS
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            api,
            {
                "name": "tools",
                "url": base + MCP_PATH,
                "adapter": "mcp",
                "timeout_ms": TIMEOUT_MS,
                "tools": {"charge": tool},
            },
            {"name": "hold", "url": fault.url, "timeout_ms": 20_000},
        ],
        proxy={
            "prepared_margin_ms": MARGIN_MS,
            "forward_start_limit_ms": START_LIMIT_MS,
            "max_connections": max_connections,
        },
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config), forward_clock=forward_clock)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Gateway(Api(client), fault, base)


@dataclass
class Outcome:
    """What one call came to, as the agent, the ledger and the downstream saw it."""

    code: str | None
    effect_state: str | None
    ledger: list[str]
    executed: int

    def same_as(self, other: Outcome) -> bool:
        return (self.code, self.effect_state, self.ledger, self.executed) == (
            other.code,
            other.effect_state,
            other.ledger,
            other.executed,
        )


async def ledger_states(api: Api, task_id: str) -> list[str]:
    answer = await api.call("GET", f"/v1/effects?taskId={task_id}&limit=10")
    assert answer.status == 200, answer.body
    return [effect["state"] for effect in answer.body["effects"]]


def assert_no_address(text: str, g: Gateway) -> None:
    port = g.base.rsplit(":", 1)[1]
    assert "127.0.0.1" not in text and f":{port}" not in text, text


async def via_proxy(g: Gateway, lease: Lease, slot: str = "s1") -> tuple[str | None, str | None]:
    """A /proxy POST: (problem code, effect state) of its answer."""
    async with g.api.client.post(
        f"/proxy/api{PROXY_PATH}?note=1", json={"amount": 1}, headers=fence_headers(lease, slot)
    ) as resp:
        text = await resp.text()
    assert_no_address(text, g)
    body = json.loads(text)
    if resp.status == 200:
        return None, resp.headers["Fence-Effect-State"]
    assert resp.content_type == "application/problem+json", text
    assert body.get("effectState", "NONE") == resp.headers["Fence-Effect-State"], text
    if body["code"].startswith("DOWNSTREAM_"):  # the agent's own method and path
        assert body["detail"].startswith("downstream api: POST /proxy/api/pay"), text
    assert "note=1" not in body["detail"], text  # never the query string
    return body["code"], body.get("effectState")


async def via_mcp(g: Gateway, lease: Lease) -> tuple[str | None, str | None]:
    """An MCP tools/call: (data.code of its JSON-RPC error, its effect state)."""
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "charge", "arguments": {"amount": 1}},
    }
    headers = {
        **fence_headers(lease, None),
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    async with g.api.client.post("/mcp/tools", data=json.dumps(message), headers=headers) as resp:
        text = await resp.text()
    assert resp.status == 200, text
    assert_no_address(text, g)
    body = json.loads(text)
    if "result" in body:
        return None, resp.headers.get("Fence-Effect-State")
    data = body["error"]["data"]
    if data["code"].startswith("DOWNSTREAM_"):  # the agent's own method and path
        assert data["detail"].startswith("downstream tools: POST /mcp/tools (tools/call charge)"), (
            text
        )
    return data["code"], data.get("effectState")


async def both(g: Gateway) -> tuple[Outcome, Outcome]:
    """The same fault met by a /proxy call and by an MCP call, each under its own lease."""
    outcomes = []
    for route, path in (("proxy", PROXY_PATH), ("mcp", MCP_PATH)):
        task_id = f"{route}-1"
        await g.api.put(task_id)
        lease = await g.api.claim(task_id)
        code, state = await (via_proxy(g, lease) if route == "proxy" else via_mcp(g, lease))
        outcomes.append(
            Outcome(code, state, await ledger_states(g.api, task_id), g.fault.executed[path])
        )
    return outcomes[0], outcomes[1]


def assert_parity(proxy: Outcome, mcp: Outcome, expected: Outcome) -> None:
    assert proxy.same_as(expected), ("proxy", proxy, expected)
    assert mcp.same_as(expected), ("mcp", mcp, expected)


@pytest.fixture
async def fault() -> AsyncIterator[FaultServer]:
    server = await FaultServer().start()
    yield server
    await server.stop()


# --- every failure kind, both routes, every store ------------------------------------------------


async def test_connect_refused(store_url: str, key_prefix: str, fault: FaultServer) -> None:
    with refused_port() as port:
        async with gateway(store_url, key_prefix, fault, f"http://127.0.0.1:{port}") as g:
            proxy, mcp = await both(g)
    assert_parity(proxy, mcp, Outcome("DOWNSTREAM_UNREACHABLE", "NOT_APPLIED", ["NOT_APPLIED"], 0))


async def test_pool_wait_is_busy_and_sends_nothing(
    store_url: str, key_prefix: str, fault: FaultServer
) -> None:
    """One pooled connection, held by another forward that gets no answer: each call waits
    for it until its start limit, and is never sent."""
    async with gateway(
        store_url, key_prefix, fault, fault.url, max_connections=1, forward_clock=time.monotonic
    ) as g:
        await g.api.put("holder")
        holder = await g.api.claim("holder", ttl_ms=30_000)
        hold = asyncio.create_task(
            g.api.client.get(f"/proxy/hold{HOLD_PATH}", headers=fence_headers(holder, None))
        )
        try:
            async with asyncio.timeout(HANG_S):  # a bound on a hang only
                while not fault.open:
                    await asyncio.sleep(0.01)
            proxy, mcp = await both(g)
        finally:
            hold.cancel()
            with contextlib.suppress(BaseException):
                await hold
    assert_parity(proxy, mcp, Outcome("DOWNSTREAM_BUSY", "NOT_APPLIED", ["NOT_APPLIED"], 0))


async def test_reset_before_the_request_was_read(
    store_url: str, key_prefix: str, fault: FaultServer
) -> None:
    """The gateway cannot tell a reset before its request was read from one after: UNKNOWN."""
    fault.mode = RESET_BEFORE
    async with gateway(store_url, key_prefix, fault, fault.url) as g:
        proxy, mcp = await both(g)
    assert_parity(proxy, mcp, Outcome("DOWNSTREAM_TIMEOUT", "UNKNOWN", ["UNKNOWN"], 0))


async def test_reset_after_the_request_was_executed(
    store_url: str, key_prefix: str, fault: FaultServer
) -> None:
    fault.mode = RESET_AFTER
    async with gateway(store_url, key_prefix, fault, fault.url) as g:
        proxy, mcp = await both(g)
    assert_parity(proxy, mcp, Outcome("DOWNSTREAM_TIMEOUT", "UNKNOWN", ["UNKNOWN"], 1))


async def test_refused_resend(
    store_url: str, key_prefix: str, fault: FaultServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first send went out (and executed); the connection broke and aiohttp tried again:
    refused by the guard. Injected at the guard both routes share."""

    def refusing() -> tuple[aiohttp.ClientMiddlewareType, ...]:
        async def guard(
            request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
        ) -> aiohttp.ClientResponse:
            response = await handler(request)
            response.close()
            raise ResendRefused(f"{request.method} {request.url}: refused a second send")

        return (guard,)

    monkeypatch.setattr(forward, "send_once", refusing)
    async with gateway(store_url, key_prefix, fault, fault.url) as g:
        proxy, mcp = await both(g)
    assert_parity(proxy, mcp, Outcome("DOWNSTREAM_TIMEOUT", "UNKNOWN", ["UNKNOWN"], 1))


async def test_timeout(store_url: str, key_prefix: str, fault: FaultServer) -> None:
    fault.mode = SILENT
    async with gateway(store_url, key_prefix, fault, fault.url) as g:
        proxy, mcp = await both(g)
    assert_parity(proxy, mcp, Outcome("DOWNSTREAM_TIMEOUT", "UNKNOWN", ["UNKNOWN"], 1))


async def test_store_answer_lost_after_prepare(
    store_url: str, key_prefix: str, fault: FaultServer
) -> None:
    """The store applies the prepare and its answer is lost: nothing is forwarded, the agent
    gets STORE_UNAVAILABLE, and the record is found by its forward id and aborted
    (NOT_APPLIED) instead of reading UNKNOWN for good."""
    async with gateway(store_url, key_prefix, fault, fault.url) as g:
        store = g.api.client.app[STORE]  # type: ignore[index]
        applied = store.prepare_effect

        async def lossy(*args: Any, **kwargs: Any) -> Any:
            await applied(*args, **kwargs)
            raise StoreUnavailable("the store's answer was lost (injected)")

        store.prepare_effect = lossy
        proxy, mcp = await both(g)
        for task_id, outcome in (("proxy-1", proxy), ("mcp-1", mcp)):
            async with asyncio.timeout(10):
                while (states := await ledger_states(g.api, task_id)) != ["NOT_APPLIED"]:
                    assert states in (["PREPARED"], ["UNKNOWN"]), states
                    await asyncio.sleep(0.05)
            outcome.ledger = states
    assert_parity(proxy, mcp, Outcome("STORE_UNAVAILABLE", None, ["NOT_APPLIED"], 0))


async def test_idempotent_resend_window_is_shortened_by_the_start_limit(
    store_url: str, key_prefix: str, fault: FaultServer
) -> None:
    """An UNKNOWN idempotent call is re-sent under its key while its window, less the start
    limit, is open (a re-send may reach the downstream up to the start limit after it was
    admitted); later it is refused, on both routes."""
    fault.mode = SILENT
    async with gateway(
        store_url, key_prefix, fault, fault.url, adapter="idempotent", tool_kind="idempotent"
    ) as g:
        calls = []
        for route in ("proxy", "mcp"):
            await g.api.put(f"{route}-1")
            # A lease that outlives the test however slow the machine: four calls each wait
            # out the downstream's real timeout, and the store clock then moves 4 s.
            calls.append((route, await g.api.claim(f"{route}-1", ttl_ms=600_000)))

        async def call(route: str, lease: Lease) -> tuple[str | None, str | None]:
            return await (via_proxy(g, lease) if route == "proxy" else via_mcp(g, lease))

        for route, lease in calls:
            assert await call(route, lease) == ("DOWNSTREAM_TIMEOUT", "UNKNOWN")
            assert await call(route, lease) == ("DOWNSTREAM_TIMEOUT", "UNKNOWN")  # re-sent
        assert g.fault.executed == {PROXY_PATH: 2, MCP_PATH: 2}
        # Inside the window, but past the window less the start limit: not re-sent.
        g.api.advance(WINDOW_MS - START_LIMIT_MS + 500)
        for route, lease in calls:
            assert await call(route, lease) == ("EFFECT_UNKNOWN", "UNKNOWN"), route
        assert g.fault.executed == {PROXY_PATH: 2, MCP_PATH: 2}


# --- the pure table and decision ------------------------------------------------------------------

LIMITS = Limits(
    Bound.of("downstreams.payments.timeout_ms", 10_000),
    Bound(400, "proxy.forward_start_limit_ms = 1000"),
    Bound.of("downstreams.payments.connect_timeout_ms", 5_000),
    Bound.of("downstreams.payments.read_timeout_ms", 3_000),
)
ADDRESS = "http://10.9.8.7:8443/internal/pay?token=s3cret"


def connector_error(code: int) -> aiohttp.ClientConnectorError:
    key: Any = SimpleNamespace(host="10.9.8.7", port=8443, ssl=True)
    return aiohttp.ClientConnectorError(
        key, OSError(code, "Connect call failed ('10.9.8.7', 8443)")
    )


#: exception, status, waiting -> (kind, outcome, reason prefix, limit)
TABLE: list[tuple[BaseException, int | None, bool, FailureKind, EffectState, str, str | None]] = [
    (TimeoutError(), None, True, FailureKind.BUSY, EffectState.NOT_APPLIED,
     "never sent: no pooled connection in time", "proxy.forward_start_limit_ms = 1000"),
    (aiohttp.ConnectionTimeoutError(f"Connection timeout to host {ADDRESS}"), None, True,
     FailureKind.BUSY, EffectState.NOT_APPLIED, "never sent",
     "proxy.forward_start_limit_ms = 1000"),
    (connector_error(errno.ECONNREFUSED), None, False, FailureKind.CONNECT,
     EffectState.NOT_APPLIED, "connect failed: ClientConnectorError", None),
    (aiohttp.ConnectionTimeoutError(f"Connection timeout to host {ADDRESS}"), None, False,
     FailureKind.CONNECT, EffectState.NOT_APPLIED, "connect failed: ConnectionTimeoutError",
     "proxy.forward_start_limit_ms = 1000"),
    (TimeoutError(), None, False, FailureKind.TIMEOUT, EffectState.UNKNOWN,
     "timed out: TimeoutError (downstreams.payments.timeout_ms = 10000)",
     "downstreams.payments.timeout_ms = 10000"),
    (aiohttp.SocketTimeoutError("Timeout on reading data from socket"), None, False,
     FailureKind.TIMEOUT, EffectState.UNKNOWN, "timed out: SocketTimeoutError",
     "downstreams.payments.read_timeout_ms = 3000"),
    (aiohttp.ServerDisconnectedError(), None, False, FailureKind.RESET, EffectState.UNKNOWN,
     "failed after sending: ServerDisconnectedError", None),
    (aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"), None, False,
     FailureKind.RESET, EffectState.UNKNOWN, "failed after sending: ClientOSError", None),
    (ResendRefused(f"PUT {ADDRESS}: refused a second send"), None, False,
     FailureKind.RESEND_REFUSED, EffectState.UNKNOWN, "failed after sending: ResendRefused", None),
    (aiohttp.ClientPayloadError("Response payload is not completed"), 200, False,
     FailureKind.BROKE_OFF, EffectState.UNKNOWN,
     "response 200, then the body failed after sending: ClientPayloadError", None),
    (TimeoutError(), 201, False, FailureKind.BROKE_OFF, EffectState.UNKNOWN,
     "response 201, then the body timed out: TimeoutError",
     "downstreams.payments.timeout_ms = 10000"),
]  # fmt: skip


@pytest.mark.parametrize(("exc", "status", "waiting", "kind", "outcome", "reason", "limit"), TABLE)
def test_the_one_table(
    exc: BaseException,
    status: int | None,
    waiting: bool,
    kind: FailureKind,
    outcome: EffectState,
    reason: str,
    limit: str | None,
) -> None:
    failure = failure_of(exc, status=status, waiting=waiting, limits=LIMITS)
    assert (failure.kind, failure.outcome, failure.limit) == (kind, outcome, limit)
    assert failure.reason.startswith(reason), failure.reason
    assert "10.9.8.7" not in failure.reason and "8443" not in failure.reason
    metric = {EffectState.NOT_APPLIED: "unreachable"}.get(outcome)
    assert failure.metric == (metric or ("timeout" if limit else "unknown"))


def test_the_connect_errno_is_named_not_the_address() -> None:
    failure = failure_of(
        connector_error(errno.ECONNREFUSED), status=None, waiting=False, limits=LIMITS
    )
    assert failure.cause == "ClientConnectorError ECONNREFUSED"


TARGET = Target("payments", "POST", "/proxy/payments/charge", 200)
EFFECT = SimpleNamespace(effect_id="e1")


@pytest.mark.parametrize(
    ("row", "code", "recorded", "state"),
    [
        (0, "DOWNSTREAM_BUSY", EffectState.NOT_APPLIED, "NOT_APPLIED"),
        (2, "DOWNSTREAM_UNREACHABLE", EffectState.NOT_APPLIED, "NOT_APPLIED"),
        (2, "DOWNSTREAM_UNREACHABLE", EffectState.UNKNOWN, "UNKNOWN"),  # an earlier UNKNOWN
        (3, "DOWNSTREAM_UNREACHABLE", EffectState.NOT_APPLIED, "NOT_APPLIED"),
        (4, "DOWNSTREAM_TIMEOUT", EffectState.UNKNOWN, "UNKNOWN"),
        (5, "DOWNSTREAM_TIMEOUT", EffectState.UNKNOWN, "UNKNOWN"),
        (6, "DOWNSTREAM_TIMEOUT", EffectState.UNKNOWN, "UNKNOWN"),
        (8, "DOWNSTREAM_TIMEOUT", EffectState.UNKNOWN, "UNKNOWN"),
        (9, "DOWNSTREAM_TIMEOUT", EffectState.UNKNOWN, "UNKNOWN"),
    ],
)
def test_the_decision_names_the_call_and_the_limit_never_the_address(
    row: int, code: str, recorded: EffectState, state: str
) -> None:
    exc, status, waiting, *_ = TABLE[row]
    failure = failure_of(exc, status=status, waiting=waiting, limits=LIMITS)
    unrecorded = failure_answer(TARGET, failure)
    assert unrecorded.code == code and "effectState" not in unrecorded.extra
    error = failure_answer(TARGET, failure, effect=EFFECT, recorded=recorded)  # type: ignore[arg-type]
    assert error.code == code
    assert error.extra["effectId"] == "e1" and error.extra["effectState"] == state
    assert error.detail.startswith("downstream payments: POST /proxy/payments/charge"), error.detail
    if failure.limit is not None:
        assert failure.limit in error.detail, error.detail
    assert ("stays UNKNOWN" in error.detail) == (
        code != "DOWNSTREAM_TIMEOUT" and state == "UNKNOWN"
    )
    for secret in ("10.9.8.7", "8443", "internal", "s3cret"):
        assert secret not in error.detail, error.detail
    if code == "DOWNSTREAM_BUSY":
        assert "proxy.max_connections = 200" in error.detail
        assert error.extra["retryAfterMs"] == forward.BUSY_RETRY_MS


def test_a_failed_tools_list_says_the_call_was_not_sent() -> None:
    """The gateway's own tools/list before a call: whatever broke, the call never left."""
    target = Target("tools", "POST", "/mcp/tools", 200, "tools/call", "tools/list")
    for exc, status, waiting, *_ in TABLE:
        failure = failure_of(exc, status=status, waiting=waiting, limits=LIMITS)
        error = failure_answer(target, failure)
        assert error.code == "DOWNSTREAM_UNREACHABLE", (exc, error.detail)
        assert error.detail.endswith("the call itself was not sent"), error.detail


def test_the_resend_window_is_the_window_less_the_start_limit() -> None:
    assert resend_window(None, 1_000) is None
    assert resend_window(60_000, 1_000) == 59_000
    assert resend_window(500, 1_000) == 0


def test_a_failure_is_a_value() -> None:
    failure = Failure(FailureKind.TIMEOUT, EffectState.UNKNOWN, "timed out: TimeoutError", "x")
    assert failure.metric == "unknown" and failure.limit is None


def test_only_the_forward_module_sends() -> None:
    """Every request to a downstream goes through ``gateway.forward.send``: no other gateway
    module touches the pooled client (``app.py`` only creates it)."""
    gateway_dir = Path(forward.__file__).parent
    senders = sorted(
        path.name
        for path in gateway_dir.glob("*.py")
        if "HTTP_CLIENT]" in path.read_text() and path.name not in ("forward.py", "app.py")
    )
    assert senders == []
