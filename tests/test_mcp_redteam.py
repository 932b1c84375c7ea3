"""What a black-box red-team pass at ``/mcp`` broke (issue 25, second pass), each closed.

- **Charset smuggling.** The gateway read a POST as UTF-8 and forwarded the agent's
  ``Content-Type``: a server decoding ``charset=utf-7`` ran another message than the one
  recorded. Now a Content-Type other than ``application/json`` (optionally
  ``charset=utf-8``) is refused and the server always gets ``application/json``; ``/proxy``
  refuses a JSON body declared in another charset (its digest reads UTF-8).
- **Deep nesting.** A call nested ~600 deep was a 500 after its PREPARE: refused when read.
- **Slow reader.** A write of SSE progress to an agent that does not read held the forward
  past its PREPARED deadline: every write is bounded by what the forward's window leaves.
- **Forged identity.** ``fencegate/`` ``_meta`` keys on relayed messages reached the server:
  stripped.
- **Repeated routing headers.** Refused, nothing sent.
- **Unsafe integers.** A ``tools/call`` integer outside +/-(2^53 - 1) is refused.

Every gateway test runs on every store, against a counting MCP server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from fencegate.adapters import mcp
from fencegate.gateway.app import create_app
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.payloads import MAX_JSON_DEPTH, canonical_body, json_depth
from tests.api import HANG_S, Api, ServeLikeServer, mcp_lease, mcp_post, task_effects
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import api, proxy_config, send, task_with_lease

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

__all__ = ["api", "proxy_config"]  # fixtures used here

DOWNSTREAM = "tools"
TIMEOUT_MS = 1_000
#: The forward clock stands still (``gw``), so a forward's bounds are the downstream's
#: ``timeout_ms`` in real time; the start limit (then a real-time bound on the pool wait and
#: connect) is 10 s off and the PREPARED deadline 20 s past the timeout: a loaded machine
#: neither trips the one nor lets the store's "deadline passed" overtake the gateway's record.
MARGIN_MS = 20_000
START_LIMIT_MS = 10_000
#: The flood tool's progress: far more than every buffer between the server and an agent
#: that reads nothing (its socket's, the gateway's, the kernel's).
EVENTS = 48
EVENT_BYTES = 512 * 1024


@dataclass
class RedTeamMcp:
    """An MCP server that remembers every POST (its Content-Type and body) and counts the
    runs of its tools. ``flood`` acts first, then sends ``EVENTS`` large progress events,
    then its answer."""

    posts: list[tuple[str | None, bytes]] = field(default_factory=list)
    runs: int = 0
    #: Set when a ``flood`` call's stream ends (its answer sent, or its connection gone).
    flood_over: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.posts.append((request.headers.get("Content-Type"), body))
        message = json.loads(body)
        if "id" not in message:
            return web.Response(status=202)
        params = message.get("params") or {}
        result: dict[str, Any] = {"content": [{"type": "text", "text": "ok"}]}
        if message.get("method") == "tools/call":
            self.runs += 1
            if params.get("name") == "flood":
                return await self._flood(request, message)
        if message.get("method") == "resources/read" and params.get("uri") == "big://":
            return await self._big(request, message)
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    async def _flood(self, request: web.Request, message: dict[str, Any]) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        filler = "x" * EVENT_BYTES
        try:
            for n in range(EVENTS):
                params = {"progressToken": 1, "progress": n, "message": filler}
                progress = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
                await stream.write(f"event: message\ndata: {json.dumps(progress)}\n\n".encode())
            answer = {"jsonrpc": "2.0", "id": message["id"], "result": {"content": []}}
            await stream.write(f"event: message\ndata: {json.dumps(answer)}\n\n".encode())
            await stream.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.flood_over.set()
        return stream

    async def _big(self, request: web.Request, message: dict[str, Any]) -> web.StreamResponse:
        """A relayed (unrecorded) answer far larger than every buffer, as JSON."""
        stream = web.StreamResponse(headers={"Content-Type": "application/json"})
        await stream.prepare(request)
        try:
            await stream.write(b'{"jsonrpc":"2.0","id":' + json.dumps(message["id"]).encode())
            await stream.write(b',"result":{"contents":[{"uri":"big://","text":"')
            for _ in range(EVENTS):
                await stream.write(b"x" * EVENT_BYTES)
            await stream.write(b'"}]}}')
            await stream.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.flood_over.set()
        return stream

    async def start(self) -> RedTeamMcp:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/mcp", self._post)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    def sent(self) -> list[dict[str, Any]]:
        return [json.loads(body) for _, body in self.posts]


@pytest.fixture
async def server() -> AsyncIterator[RedTeamMcp]:
    counting = await RedTeamMcp().start()
    yield counting
    assert counting.runner is not None
    await counting.runner.cleanup()


@pytest.fixture
async def gw(
    store_url: str, key_prefix: str, server: RedTeamMcp
) -> AsyncIterator[TestClient[Any, Any]]:
    tools = {"charge": {"kind": "effect"}, "flood": {"kind": "effect"},
             "lookup": {"kind": "read_only"}}  # fmt: skip
    downstream = {"name": DOWNSTREAM, "url": server.url, "adapter": "mcp",
                  "timeout_ms": TIMEOUT_MS, "tools": tools}  # fmt: skip
    config = make_config(store_url, key_prefix, downstreams=[downstream],
                         reconciler={"enabled": False},
                         proxy={"prepared_margin_ms": MARGIN_MS,
                                "forward_start_limit_ms": START_LIMIT_MS})  # fmt: skip
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(ServeLikeServer(app, host="127.0.0.1")) as client:
        yield client


async def post(
    client: TestClient[Any, Any], headers: Any, body: bytes
) -> tuple[int, dict[str, Any]]:
    return await mcp_post(client, DOWNSTREAM, headers, body)


def call(name: str, arguments: Any, request_id: Any = 7, **params: Any) -> bytes:
    message = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
               "params": {"name": name, "arguments": arguments, **params}}  # fmt: skip
    return json.dumps(message).encode()


CHARGE = call("charge", {"account": "acme", "amount": 1000})


# --- 1. charset smuggling --------------------------------------------------------------------

REFUSED_TYPES = [
    "application/json; charset=utf-7",
    "application/json;charset=UTF-16",
    'application/json; charset="utf-7"',
    "application/json; charset=utf-8; charset=utf-7",
    "application/json; boundary=x",
    "application/json; charset=utf8",
    "text/plain",
    "application/x-www-form-urlencoded",
]
ACCEPTED_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    'Application/JSON; Charset="UTF-8"',
    "application/json;charset=UTF-8;",
]


@pytest.mark.parametrize("content_type", REFUSED_TYPES)
def test_the_content_type_rule(content_type: str) -> None:
    assert mcp.content_type_refusal([content_type]) is not None
    for accepted in ACCEPTED_TYPES:
        assert mcp.content_type_refusal([accepted]) is None, accepted
    assert mcp.content_type_refusal([]) is None
    assert mcp.content_type_refusal(["application/json"] * 2) is not None


@pytest.mark.parametrize("content_type", REFUSED_TYPES)
async def test_a_message_in_another_charset_is_refused_before_anything_is_recorded(
    gw: TestClient[Any, Any], server: RedTeamMcp, content_type: str
) -> None:
    """A ``ping`` in UTF-8 may be a ``tools/call charge`` in UTF-7: neither goes out."""
    task, headers = await mcp_lease(gw)
    headers["Content-Type"] = content_type
    for body in (CHARGE, b'{"jsonrpc":"2.0","id":7,"method":"ping"}'):
        status, answer = await post(gw, headers, body)
        assert (status, answer["id"]) == (200, 7), answer
        assert answer["error"]["code"] == -32600
        assert answer["error"]["data"]["code"] == "BAD_REQUEST"
    # without an id, the refusal is the HTTP status
    status, answer = await post(gw, headers, b'{"jsonrpc":"2.0","method":"notifications/x"}')
    assert (status, answer["id"]) == (400, None)
    assert server.posts == []
    assert await task_effects(gw, task) == []


async def test_the_server_gets_application_json_and_never_the_agents_parameters(
    gw: TestClient[Any, Any], server: RedTeamMcp
) -> None:
    task, headers = await mcp_lease(gw)
    for content_type in ACCEPTED_TYPES:
        headers["Content-Type"] = content_type
        status, answer = await post(gw, headers, b'{"jsonrpc":"2.0","id":1,"method":"ping"}')
        assert status == 200 and "result" in answer, answer
    headers["Content-Type"] = 'application/json; charset="UTF-8"'
    status, answer = await post(gw, headers, CHARGE)
    assert status == 200 and "result" in answer, answer
    assert [content_type for content_type, _ in server.posts] == ["application/json"] * 5
    assert [e["state"] for e in await task_effects(gw, task)] == ["COMMITTED"]


async def test_a_body_that_is_not_utf8_is_a_parse_error(
    gw: TestClient[Any, Any], server: RedTeamMcp
) -> None:
    """``json.loads`` of bytes would read UTF-16 too; the server reads UTF-8."""
    task, headers = await mcp_lease(gw)
    for body in (CHARGE.decode().encode("utf-16"), CHARGE.decode().encode("utf-16-le")):
        status, answer = await post(gw, headers, body)
        assert (status, answer["error"]["code"]) == (200, -32700), answer
    assert server.posts == []
    assert await task_effects(gw, task) == []


def test_a_json_digest_refuses_a_body_in_another_charset() -> None:
    body = b'{"a":"+AGs-"}'
    for content_type in ("application/json; charset=utf-7", "application/merge-patch+json; "
                         "charset=UTF-16", 'application/json; charset="latin1"'):  # fmt: skip
        with pytest.raises(BadRequest, match="charset"):
            canonical_body(body, content_type)
    assert canonical_body(body, 'application/json; charset="UTF-8"') == body
    assert canonical_body(body, "text/plain; charset=utf-7") == body  # not JSON: bytes


async def test_proxy_refuses_a_json_body_declared_in_another_charset(
    api: Api, downstream: Downstream
) -> None:
    lease_ = await task_with_lease(api)
    data = b'{"amount":"+ADEAMAAw-"}'
    sent = await send(api, lease_, data=data,
                      headers={"Content-Type": "application/json; charset=utf-7"})  # fmt: skip
    assert (sent.status, sent.code) == (400, "BAD_REQUEST"), sent.body
    assert downstream.calls() == []
    assert (await api.call("GET", "/v1/effects?taskId=t1")).body["effects"] == []
    sent = await send(api, lease_, data=data,
                      headers={"Content-Type": "application/json; charset=utf-8"})  # fmt: skip
    assert sent.status == 200, sent.body
    assert len(downstream.calls()) == 1


# --- 3. deep nesting -------------------------------------------------------------------------


def _deep(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


DEEP = 600
DEEP_CASES = [
    ("arguments", '{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
                  f'"arguments":{{"a":{_deep(DEEP)}}}}}}}', 200),
    ("id", f'{{"jsonrpc":"2.0","id":{_deep(DEEP)},"method":"tools/call","params":'
           '{"name":"charge","arguments":{"a":1}}}', 400),
    ("_meta", '{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
              f'"arguments":{{"a":1}},"_meta":{{"x":{_deep(DEEP)}}}}}}}', 200),
]  # fmt: skip


@pytest.mark.parametrize(("case", "raw", "status"), DEEP_CASES, ids=[c for c, _, _ in DEEP_CASES])
async def test_a_deep_message_is_refused_before_anything_is_recorded(
    gw: TestClient[Any, Any], server: RedTeamMcp, case: str, raw: str, status: int
) -> None:
    task, headers = await mcp_lease(gw)
    got, answer = await post(gw, headers, raw.encode())
    assert got == status, (case, answer)
    assert answer["error"]["code"] == -32600
    assert answer["id"] == (7 if status == 200 else None)
    assert "deeper than 64" in answer["error"]["data"]["detail"]
    assert server.posts == []
    assert await task_effects(gw, task) == []


def test_the_depth_bound_and_a_shallow_identity() -> None:
    arguments = {"a": json.loads(_deep(MAX_JSON_DEPTH - 3))}
    at_limit = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "c", "arguments": arguments}}  # fmt: skip
    assert json_depth(at_limit) == MAX_JSON_DEPTH
    assert mcp.refusal(mcp.read_message(json.dumps(at_limit).encode())) is None
    at_limit["params"]["arguments"]["a"] = [at_limit["params"]["arguments"]["a"]]
    assert mcp.refusal(mcp.read_message(json.dumps(at_limit).encode()))[0] == -32600  # type: ignore[index]
    # with_identity copies the levels it changes, not the arguments (a deep copy recursed).
    deep = json.loads(_deep(DEEP))
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
               "params": {"name": "c", "arguments": {"a": deep}, "_meta": {"k": 1}}}  # fmt: skip
    out = json.loads(mcp.with_identity(message, "e1", "1.2"))
    assert out["params"]["_meta"] == {
        "k": 1, **mcp.both_names({mcp.META_EFFECT_ID: "e1", mcp.META_FENCING_TOKEN: "1.2"})
    }  # fmt: skip
    assert message["params"]["_meta"] == {"k": 1}  # the agent's message is not changed


# --- 2. an agent that does not read ----------------------------------------------------------


async def _silent_agent(
    client: TestClient[Any, Any], headers: dict[str, str], body: bytes
) -> socket.socket:
    """A raw connection with a tiny receive buffer that sends one POST and never reads."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", client.port))
    lines = [f"POST /mcp/{DOWNSTREAM} HTTP/1.1", f"Host: 127.0.0.1:{client.port}"]
    lines += [f"Content-Length: {len(body)}"] + [f"{k}: {v}" for k, v in headers.items()]
    await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


async def _settled(client: TestClient[Any, Any], task: str, within_s: float) -> dict[str, Any]:
    """The task's one effect once it is no longer PREPARED (fails after ``within_s``)."""
    end = time.monotonic() + within_s
    while True:
        effects = await task_effects(client, task)
        if effects and effects[0]["state"] != "PREPARED":
            return effects[0]
        assert time.monotonic() < end, f"still {effects} after {within_s} s"
        await asyncio.sleep(0.05)


async def test_an_agent_that_does_not_read_does_not_hold_the_forward_past_its_deadline(
    gw: TestClient[Any, Any], server: RedTeamMcp
) -> None:
    """The forward ends by its PREPARED deadline (recorded UNKNOWN or COMMITTED), so the
    landing rule holds: the operator's NOT_APPLIED is refused, a retry does not run."""
    task, headers = await mcp_lease(gw)
    body = call("flood", {"n": 1})
    window_s = (TIMEOUT_MS + MARGIN_MS) / 1000
    agent = await _silent_agent(gw, headers, body)
    try:
        # The server's connection is closed (the forward is over) within the window, plus
        # a generous slack; before, the gateway sat on its write to the agent for good.
        await asyncio.wait_for(server.flood_over.wait(), window_s + 5)
        effect = await _settled(gw, task, within_s=HANG_S)  # a bound on a hang only
        # The gateway recorded the forward's own outcome (not the store's "deadline passed"
        # of a PREPARED record whose forward was still running).
        assert effect["state"] in ("UNKNOWN", "COMMITTED"), effect
        assert "deadline passed" not in effect["attempts"][-1]["reason"], effect
        assert server.runs == 1
        async with gw.post(f"/v1/effects/{effect['effectId']}/resolve",
                           json={"outcome": "NOT_APPLIED", "note": "n"}) as resp:  # fmt: skip
            assert resp.status == 409, await resp.text()
        status, answer = await post(gw, headers, body)  # the retry: refused or replayed
        assert status == 200, answer
        assert server.runs == 1, answer
    finally:
        agent.close()


async def test_an_agent_that_does_not_read_a_relayed_answer_does_not_hold_the_connection(
    gw: TestClient[Any, Any], server: RedTeamMcp
) -> None:
    """A relayed answer (no ledger entry) to an agent that reads nothing: each write is
    bounded by the downstream's ``timeout_ms``, then the agent's connection is closed and the
    server's request ends (before, the pooled connection was held for as long as the agent
    stayed silent)."""
    _, headers = await mcp_lease(gw)
    body = json.dumps({"jsonrpc": "2.0", "id": 4, "method": "resources/read",
                       "params": {"uri": "big://"}}).encode()  # fmt: skip
    agent = await _silent_agent(gw, headers, body)
    try:
        await asyncio.wait_for(server.flood_over.wait(), TIMEOUT_MS / 1000 + 5)
    finally:
        agent.close()


# --- 5. forged identity on relayed messages --------------------------------------------------

FORGED = {"fencegate/effectId": "forged", "fencegate/fencingToken": "9.9",
          "fencegate/slot": "s", "progressToken": 3}  # fmt: skip


async def test_fencegate_meta_keys_never_reach_the_server_on_a_relayed_message(
    gw: TestClient[Any, Any], server: RedTeamMcp
) -> None:
    task, headers = await mcp_lease(gw)
    bodies = [
        call("lookup", {"q": 1}, _meta=FORGED),  # a read-only tool: relayed, not recorded
        json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 8,
                "method": "resources/read",
                "params": {"uri": "x://y", "_meta": FORGED},
            }
        ).encode(),
        json.dumps(
            {"jsonrpc": "2.0", "id": 9, "method": "ping", "params": {"_meta": FORGED}}
        ).encode(),
    ]
    for body in bodies:
        status, _ = await post(gw, headers, body)
        assert status == 200
    metas = [message["params"]["_meta"] for message in server.sent()]
    assert metas == [{"progressToken": 3}] * 3
    assert await task_effects(gw, task) == []


# --- 6. repeated headers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "values"),
    [("MCP-Protocol-Version", ["2026-07-28", "2025-06-18"]), ("Mcp-Method", ["ping", "ping"]),
     ("Mcp-Name", ["charge", "lookup"]), ("Mcp-Session-Id", ["a", "b"]),
     ("Content-Type", ["application/json", "application/json"])],
)  # fmt: skip
async def test_a_repeated_routing_header_is_refused_and_nothing_sent(
    gw: TestClient[Any, Any], server: RedTeamMcp, name: str, values: list[str]
) -> None:
    task, plain = await mcp_lease(gw)
    headers: CIMultiDict[str] = CIMultiDict((k, v) for k, v in plain.items() if k != name)
    for value in values:
        headers.add(name, value)
    async with gw.post(f"/mcp/{DOWNSTREAM}", data=CHARGE, headers=headers) as resp:
        status, text = resp.status, await resp.text()
    assert status == 400, text
    if name != "Content-Type":  # aiohttp's parser refuses that one itself, in plain text
        answer = json.loads(text)
        assert answer["error"]["data"]["code"] == "BAD_REQUEST"
        assert "more than once" in answer["error"]["data"]["detail"]
    assert server.posts == []
    assert await task_effects(gw, task) == []


# --- 4. integers a double does not hold ------------------------------------------------------


async def test_an_integer_outside_the_safe_range_is_refused(
    gw: TestClient[Any, Any], server: RedTeamMcp
) -> None:
    """An approved ``amount: 9007199254740993`` ran as ...992 on a Go server."""
    task, headers = await mcp_lease(gw)
    for amount in ("9007199254740993", "-9007199254740993", "1" + "0" * 30):
        body = b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",' \
               b'"arguments":{"amount":' + amount.encode() + b"}}}"  # fmt: skip
        status, answer = await post(gw, headers, body)
        assert (status, answer["error"]["code"]) == (200, -32602), answer
        assert "2^53" in answer["error"]["data"]["detail"]
    assert server.posts == []
    assert await task_effects(gw, task) == []
    status, answer = await post(gw, headers, call("charge", {"amount": 2**53 - 1}))
    assert status == 200 and "result" in answer, answer
    assert server.runs == 1
