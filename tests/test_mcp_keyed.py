"""Keyed MCP calls: a lease-less ``client`` names a ``tools/call`` by its idempotency key
(``params._meta["dev.fencegate/idempotencyKey"]``) and gets at-most-once through ``/mcp``
with only its bearer token (issue 28, docs/PROTOCOL.md "MCP").

The official ``mcp`` client talks streamable HTTP through a gateway with ``[auth]`` (in this
process) to a real MCP server (``tests/mcp_server.py``) behind three downstreams that differ
only in ``client_idempotency_keys``. What ran is counted at the server, never taken from the
gateway; the ledger is read over ``/v1/effects`` only to check what it recorded. The
gateway's ``_meta`` names moved to ``dev.fencegate/``: the older ``fencegate/`` names are
still read and sent, and a message giving one name twice with different values is -32602.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import httpx2
import pytest
from aiohttp.test_utils import TestServer
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, RequestParamsMeta

from fencegate.adapters import mcp
from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.ledger.effects import keyed_effect_id
from fencegate.ledger.errors import BadRequest
from tests.conftest import build_test_store, make_config
from tests.mcp_server import McpServerProcess
from tests.test_mcp import MCP_HTTP_TIMEOUT, MODERN, modern_call, text

KEY = "dev.fencegate/idempotencyKey"
OLD_KEY = "fencegate/idempotencyKey"
#: The three downstreams (one server): keys optional, required, and off (the default).
OPTIONAL, REQUIRED, OFF = "opt", "req", "off"

TOKENS = {name: f"tok-{name}-0123456789abcdef" for name in ("alice", "bob", "wendy", "ops")}
AUTH = {
    "principals": [
        {"name": "alice", "roles": ["client"], "token_sha256": token_sha256(TOKENS["alice"])},
        {"name": "bob", "roles": ["client"], "token_sha256": token_sha256(TOKENS["bob"])},
        {"name": "wendy", "roles": ["worker"], "token_sha256": token_sha256(TOKENS["wendy"])},
        {"name": "ops", "roles": ["operator"], "token_sha256": token_sha256(TOKENS["ops"])},
    ]
}


# --- processes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcp_process() -> Iterator[McpServerProcess]:
    """One MCP server for the module (SSE answers, stateful handshake sessions, GET stream)."""
    with McpServerProcess() as server:
        yield server


@pytest.fixture
def mcp_server(mcp_process: McpServerProcess) -> McpServerProcess:
    mcp_process.reset()
    return mcp_process


@pytest.fixture
async def gateway(
    store_url: str, key_prefix: str, mcp_server: McpServerProcess
) -> AsyncIterator[str]:
    """A gateway with ``[auth]`` on the test's store, in this process: its URL."""
    downstreams: list[dict[str, Any]] = [
        {
            "name": name,
            "url": mcp_server.url,
            "adapter": "mcp",
            "timeout_ms": 10_000,
            # lookup's readOnlyHint is what the read-only story is about.
            "trust_annotations": True,
            **({"client_idempotency_keys": keys} if keys else {}),
        }
        for name, keys in ((OPTIONAL, "optional"), (REQUIRED, "required"), (OFF, None))
    ]
    config = make_config(
        store_url,
        key_prefix,
        downstreams=downstreams,
        auth=AUTH,
        # A busy machine may take over the default second between a prepare and its forward:
        # the start limit is not what these tests are about (tests/test_forward_window.py).
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
    )
    server = TestServer(create_app(config, store=build_test_store(config)), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


# --- the clients -----------------------------------------------------------------------------


def credential(who: str) -> dict[str, str]:
    """On ``/mcp`` the gateway's credential is ``Fence-Authorization`` (``Authorization`` is
    the server's)."""
    return {"Fence-Authorization": f"Bearer {TOKENS[who]}"}


@asynccontextmanager
async def client_session(
    url: str, downstream: str, who: str = "alice", mode: str = "auto"
) -> AsyncIterator[Client]:
    """The official MCP client with only a bearer token: no lease."""
    async with httpx2.AsyncClient(headers=credential(who), timeout=MCP_HTTP_TIMEOUT) as http:
        transport = streamable_http_client(f"{url}/mcp/{downstream}", http_client=http)
        async with Client(transport, mode=mode) as client:
            yield client


def meta(values: dict[str, Any]) -> RequestParamsMeta:
    """``RequestParamsMeta`` is an open TypedDict, which mypy does not read yet: the cast."""
    return cast(RequestParamsMeta, values)


def keyed(key: str) -> RequestParamsMeta:
    return meta({KEY: key})


def replayed(result: CallToolResult) -> bool:
    """Marked replayed, under both names."""
    marks = result.meta or {}
    assert marks.get("dev.fencegate/replayed") == marks.get("fencegate/replayed"), marks
    return bool(marks.get("dev.fencegate/replayed"))


def refused(caught: pytest.ExceptionInfo[MCPError]) -> tuple[int, str]:
    """The JSON-RPC code and ``data.code`` of a gateway's refusal."""
    data = caught.value.error.data
    assert isinstance(data, dict), caught.value
    return caught.value.error.code, data["code"]


async def ledger(url: str, downstream: str) -> list[dict[str, Any]]:
    """The downstream's effects, as an operator lists them."""
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKENS['ops']}"}) as http,
        http.get(f"{url}/v1/effects", params={"downstream": downstream}) as resp,
    ):
        body = await resp.json()
        assert resp.status == 200, body
    effects: list[dict[str, Any]] = body["effects"]
    return effects


async def effect(url: str, effect_id: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKENS['ops']}"}) as http,
        http.get(f"{url}/v1/effects/{effect_id}") as resp,
    ):
        body: dict[str, Any] = await resp.json()
        assert resp.status == 200, body
    return body


async def raw(
    url: str, method: str, downstream: str, headers: dict[str, str], body: Any = None
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One request to ``/mcp/{downstream}`` as given: status, headers, JSON body."""
    data = json.dumps(body).encode() if body is not None else None
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, f"{url}/mcp/{downstream}", data=data, headers=headers) as resp,
    ):
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


def modern_headers(who: str, name: str = "counter") -> dict[str, str]:
    return {**credential(who), "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json", "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/call", "Mcp-Name": name}  # fmt: skip


def with_meta(call: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    call["params"]["_meta"].update(values)
    return call


# --- on every store: at most once, by key ------------------------------------------------------


async def test_a_keyed_call_runs_once_across_a_duplicate_and_keys_are_the_principals(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    """The same key and call from a new session (the retry after a lost answer) replays the
    stored answer, marked replayed: the tool ran once. The server got the keyed effect's id as
    its identity under both names and no fencing token (there is no lease); another
    principal's equal key is another effect."""
    async with client_session(gateway, OPTIONAL) as client:
        first = await client.call_tool("counter", {"label": "pay"}, meta=keyed("order-1"))
    async with client_session(gateway, OPTIONAL) as client:
        again = await client.call_tool("counter", {"label": "pay"}, meta=keyed("order-1"))
    assert text(first) == text(again) == "1"
    assert not replayed(first) and replayed(again)
    [run] = mcp_server.executions()["counter"]
    effect_id = keyed_effect_id("alice", OPTIONAL, "order-1")
    assert run["meta"]["dev.fencegate/effectId"] == run["meta"]["fencegate/effectId"] == effect_id
    assert not [name for name in run["meta"] if "fencingToken" in name or "Key" in name], run
    record = await effect(gateway, effect_id)
    assert record["state"] == "COMMITTED" and record["path"] == "/tools/call/counter", record

    async with client_session(gateway, OPTIONAL, "bob") as client:
        bobs = await client.call_tool("counter", {"label": "pay"}, meta=keyed("order-1"))
    assert text(bobs) == "2" and not replayed(bobs)
    runs = mcp_server.executions()["counter"]
    assert [r["meta"]["dev.fencegate/effectId"] for r in runs] == [
        effect_id,
        keyed_effect_id("bob", OPTIONAL, "order-1"),
    ]


async def test_the_same_key_with_other_arguments_is_a_conflict_and_does_not_run(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    async with client_session(gateway, REQUIRED) as client:
        await client.call_tool("counter", {"label": "a"}, meta=keyed("k-conflict"))
        with pytest.raises(MCPError) as caught:
            await client.call_tool("counter", {"label": "b"}, meta=keyed("k-conflict"))
    assert refused(caught) == (mcp.REFUSAL_CODE, "PAYLOAD_CONFLICT")
    assert [r["args"] for r in mcp_server.executions()["counter"]] == [{"label": "a"}]


# --- the rules of client_idempotency_keys and roles (one store) --------------------------------


@pytest.mark.one_store
async def test_client_idempotency_keys_decides_a_lease_less_call(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    """``required`` without a key: -32000 ``IDEMPOTENCY_KEY_REQUIRED``; ``off`` with a key:
    -32000 ``BAD_REQUEST``; ``optional`` without one: as before keys (it needs a lease,
    -32602). A key outside the grammar is -32602. None of them is recorded or runs."""
    async with client_session(gateway, REQUIRED) as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool("counter", {"label": "no-key"})
        assert refused(caught) == (mcp.REFUSAL_CODE, "IDEMPOTENCY_KEY_REQUIRED")
        for bad in ("", "a b", "k" * 256, "caf\u00e9", 7, ["k"]):
            with pytest.raises(MCPError) as caught:
                await client.call_tool("counter", {"label": "bad"}, meta=meta({KEY: bad}))
            assert refused(caught) == (-32602, "BAD_REQUEST"), bad
    async with client_session(gateway, OFF) as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool("counter", {"label": "off"}, meta=keyed("k-off"))
        assert refused(caught) == (mcp.REFUSAL_CODE, "BAD_REQUEST")
        assert "client_idempotency_keys" in caught.value.error.message
    async with client_session(gateway, OPTIONAL) as client:
        with pytest.raises(MCPError) as caught:
            await client.call_tool("counter", {"label": "optional"})
        assert refused(caught) == (-32602, "BAD_REQUEST")
        assert "needs a lease" in caught.value.error.message
    assert mcp_server.executions() == {}
    for name in (OPTIONAL, REQUIRED, OFF):
        assert await ledger(gateway, name) == []


@pytest.mark.one_store
async def test_a_read_only_tool_without_a_key_goes_unrecorded(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    """``lookup`` is ``readOnlyHint`` (trusted): a lease-less call of it needs no key, even
    where keys are required, reaches the server each time and is recorded nowhere; a
    ``fencegate`` key the client put in its ``_meta`` never reaches the server."""
    smuggled = {"dev.fencegate/effectId": "forged", "fencegate/fencingToken": "9.9"}
    async with client_session(gateway, REQUIRED) as client:
        assert text(await client.call_tool("lookup", {"key": "k1"})) == "value-of-k1"
        assert text(await client.call_tool("lookup", {"key": "k1"}, meta=meta(smuggled))) == (
            "value-of-k1"
        )
    runs = mcp_server.executions()["lookup"]
    assert len(runs) == 2
    assert not [k for r in runs for k in (r["meta"] or {}) if "fencegate/" in k], runs
    assert await ledger(gateway, REQUIRED) == []


@pytest.mark.one_store
async def test_a_lease_less_session_works_and_its_stream_is_405(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    """A handshake-era session (the SDK opens the server's ``GET`` stream after
    ``initialize``) without a lease: the gateway answers the ``GET`` 405, what a server
    without a stream answers, and the client goes on: it lists the tools and calls one."""
    status, headers, body = await raw(
        gateway, "GET", OPTIONAL, {**credential("alice"), "Accept": "text/event-stream"}
    )
    assert status == 405 and headers["Allow"] == "POST, DELETE", (status, body)
    assert body["error"]["code"] == mcp.REFUSAL_CODE
    async with client_session(gateway, OPTIONAL, mode="legacy") as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        assert {"counter", "lookup"} <= names
        result = await client.call_tool("counter", {"label": "session"}, meta=keyed("s-1"))
        assert text(result) == "1"
    assert mcp_server.runs("counter") == 1


@pytest.mark.one_store
async def test_the_older_meta_names_are_read_and_both_differing_is_invalid_params(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    """``fencegate/idempotencyKey`` is the same name as ``dev.fencegate/idempotencyKey``: a
    call under the older name is replayed under the newer one and under both alike; both
    with different values is -32602 naming both, and runs nothing."""
    async with client_session(gateway, OPTIONAL) as client:
        first = await client.call_tool("counter", {"label": "old"}, meta=meta({OLD_KEY: "k-o"}))
        new = await client.call_tool("counter", {"label": "old"}, meta=keyed("k-o"))
        both = await client.call_tool(
            "counter", {"label": "old"}, meta=meta({KEY: "k-o", OLD_KEY: "k-o"})
        )
        assert not replayed(first) and replayed(new) and replayed(both)
        with pytest.raises(MCPError) as caught:
            await client.call_tool(
                "counter", {"label": "old"}, meta=meta({KEY: "k-o", OLD_KEY: "k-other"})
            )
    assert caught.value.error.code == -32602
    assert KEY in caught.value.error.message and OLD_KEY in caught.value.error.message
    assert mcp_server.runs("counter") == 1


@pytest.mark.one_store
async def test_every_key_under_either_prefix_is_the_gateways_downstream(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    """A client cannot smuggle its own identity to the server under either prefix: the server
    gets the keyed effect's id under both names and nothing else of the gateway's (no
    fencing token, no key, no made-up name); other ``_meta`` keys go through."""
    forged = {"dev.fencegate/effectId": "forged", "fencegate/effectId": "forged",
              "dev.fencegate/fencingToken": "9.9", "fencegate/fencingToken": "9.9",
              "dev.fencegate/anything": 1, "fencegate/replayed": True, "trace": "t-1"}  # fmt: skip
    call = with_meta(modern_call(1, "counter", {"label": "smuggle"}), {KEY: "k-s", **forged})
    status, _, answer = await raw(gateway, "POST", OPTIONAL, modern_headers("alice"), call)
    assert status == 200 and "result" in answer, answer
    [run] = mcp_server.executions()["counter"]
    ours = {k: v for k, v in run["meta"].items() if "fencegate/" in k}
    effect_id = keyed_effect_id("alice", OPTIONAL, "k-s")
    assert ours == {"dev.fencegate/effectId": effect_id, "fencegate/effectId": effect_id}
    assert run["meta"]["trace"] == "t-1"


@pytest.mark.one_store
async def test_a_worker_sends_no_key_and_a_client_no_lease(
    gateway: str, mcp_server: McpServerProcess
) -> None:
    """Roles, before anything is recorded: a ``worker``'s lease-less call by key is
    -32000 ``FORBIDDEN`` (it cannot drop its lease and escape its fence); a ``client``'s
    request carrying ``Fence-*`` headers is 403 ``FORBIDDEN``, whatever the method."""
    call = with_meta(modern_call(1, "counter", {"label": "roles"}), {KEY: "k-r"})
    status, _, answer = await raw(gateway, "POST", OPTIONAL, modern_headers("wendy"), call)
    assert status == 200 and answer["error"]["code"] == mcp.REFUSAL_CODE, answer
    assert answer["error"]["data"]["code"] == "FORBIDDEN"
    lease = {"Fence-Task": "t-1", "Fence-Attempt": "a-1", "Fence-Generation": "1",
             "Fence-Epoch": "1", "Fence-Cancel": "0"}  # fmt: skip
    for method, body in (("POST", call), ("GET", None), ("DELETE", None)):
        headers = {**modern_headers("alice"), **lease}
        status, _, answer = await raw(gateway, method, OPTIONAL, headers, body)
        assert status == 403 and answer["error"]["data"]["code"] == "FORBIDDEN", answer
    assert mcp_server.executions() == {}
    assert await ledger(gateway, OPTIONAL) == []


# --- pure rules of the names ---------------------------------------------------------------------


def test_the_names_moved_and_the_older_ones_are_read() -> None:
    assert mcp.META_SLOT == "dev.fencegate/slot" and mcp.legacy(mcp.META_SLOT) == "fencegate/slot"
    assert mcp.ours({"fencegate/slot": "s"}, mcp.META_SLOT) == "s"
    assert mcp.ours({"dev.fencegate/slot": "s", "fencegate/slot": "s"}, mcp.META_SLOT) == "s"
    assert mcp.parse_tool_call({"name": "t", "_meta": {"fencegate/slot": "s"}}).slot == "s"
    assert mcp.idempotency_key({OLD_KEY: "k"}) == mcp.idempotency_key({KEY: "k"}) == "k"
    assert mcp.idempotency_key({}) is None
    with pytest.raises(BadRequest, match="idempotencyKey"):
        mcp.idempotency_key({OLD_KEY: None})  # given, as null: not a key
    assert mcp.idempotency_key({KEY: "!" + "~" * 254}) == "!" + "~" * 254
    # Equal values in both spellings are one name; JSON's true is not 1.
    assert mcp.meta_conflict({KEY: "k", OLD_KEY: "k"}) is None
    assert mcp.meta_conflict({"dev.fencegate/wait": True, "fencegate/wait": 1}) is not None
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list",
               "params": {"_meta": {"dev.fencegate/x": 1, "fencegate/x": 2}}}  # fmt: skip
    refusal = mcp.refusal(mcp.read_message(json.dumps(message).encode()))
    assert refusal is not None and refusal[0] == -32602
    # A name that folds into the new prefix without having it reads otherwise to some servers.
    folded = {**message, "params": {"_meta": {"Dev.Fencegate/idempotencyKey": "k"}}}
    assert mcp.member_collision(folded) is not None
