"""The MCP gateway end to end: a real MCP server process (``tests/mcp_server.py``, the official
SDK), the gateway built from the config file ``fencegate serve`` reads and served over real HTTP
(in the test's process: ``tests.api.InProcessGateway``), and the official ``mcp`` client
talking streamable HTTP to ``/mcp/{downstream}`` with its lease in the ``Fence-*`` headers.

What ran is counted at the server (``McpServerProcess.executions()``), never taken from the
gateway: a gateway that says "replayed" while the tool ran twice must fail here. The ledger is
read over the gateway's own ``/v1/effects`` only to check what it recorded, never what ran.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import httpx2
import pytest
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, RequestParamsMeta, TextContent

from tests.api import InProcessGateway
from tests.mcp_server import EFFECT_ID_META_KEY, McpServerProcess
from tests.servers import write_gateway_config

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

DOWNSTREAM = "tools"
#: The forward timeout of ``sleepy`` and ``charge`` (the tools table): far below the time the
#: tests make them take, so their answers are lost, and far above a loopback call's, so the
#: server has surely started the tool before the gateway gives up on it.
TOOL_TIMEOUT_MS = 1_000
#: How long the slow tools take when a test wants their answer lost.
LOST_ANSWER_MS = 4_000
#: A worker's lease that a test lets expire, so another worker can take the task over. It must
#: outlive opening the worker's MCP session (the gateway checks a lease on every request that
#: carries one, discover and initialize included), even on a loaded machine.
ZOMBIE_TTL_MS = 1_500
#: A lease that outlives opening a session and a call whose answer is lost (the call is
#: prepared under it).
CALL_TTL_MS = TOOL_TIMEOUT_MS + 2_000
LONG_TTL_MS = 30_000

#: The SDK's own client timeouts (``create_mcp_http_client``): a long read for SSE streams.
MCP_HTTP_TIMEOUT = httpx2.Timeout(30.0, read=300.0)

REPLAYED = "dev.fencegate/replayed"
SLOT = "dev.fencegate/slot"
MODERN = "2026-07-28"

#: ``sleepy`` has no annotations (an effect: never re-sent after UNKNOWN); ``charge`` has
#: ``idempotentHint`` and the server dedupes on the effectId for a minute, so the gateway may
#: re-send it under that effectId inside this window.
TOOLS_TABLE = f"""
[downstreams.tools.sleepy]
timeout_ms = {TOOL_TIMEOUT_MS}

[downstreams.tools.charge]
dedupe_window_ms = 60000
timeout_ms = {TOOL_TIMEOUT_MS}
"""


# --- processes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcp_process() -> Iterator[McpServerProcess]:
    """One MCP server for the module (SSE answers, stateful handshake sessions): starting the
    SDK's server costs about a second; every test starts from an empty record (``mcp_server``)."""
    with McpServerProcess() as server:
        yield server


@pytest.fixture
def mcp_server(mcp_process: McpServerProcess) -> McpServerProcess:
    """The module's MCP server with nothing recorded: what a test counts, its own calls ran."""
    mcp_process.reset()
    return mcp_process


@pytest.fixture
async def gateway(
    store_url: str, key_prefix: str, tmp_path: Path, mcp_server: McpServerProcess
) -> AsyncIterator[InProcessGateway]:
    """The gateway on this test's store with the MCP downstream ``tools``, from the config file
    ``fencegate serve`` would read, served in this process (a process is not what these tests
    are about); its tools table is appended by hand (``write_gateway_config`` writes flat pairs
    only, and TOML attaches ``[downstreams.tools.NAME]`` to the last ``[[downstreams]]``
    element)."""
    config = write_gateway_config(
        tmp_path / "gw",
        store_url,
        key_prefix=key_prefix,
        downstreams=[
            {
                "name": DOWNSTREAM,
                "url": mcp_server.url,
                "adapter": "mcp",
                "timeout_ms": 10_000,
                # The module's server is the test's own: its hints (lookup's readOnlyHint,
                # charge's idempotentHint) are what several tests are about.
                "trust_annotations": True,
            }
        ],
    )
    config.config_path.write_text(config.config_path.read_text() + TOOLS_TABLE)
    gateway = await InProcessGateway(config.config_path).start()
    try:
        yield gateway
    finally:
        await gateway.stop()


# --- the scheduler's and the workers' side: /v1 over HTTP ----------------------------------------


@dataclass(frozen=True)
class Lease:
    task_id: str
    attempt_id: str
    generation: int
    epoch: int
    cancel: int

    def headers(self) -> dict[str, str]:
        return {
            "Fence-Task": self.task_id,
            "Fence-Attempt": self.attempt_id,
            "Fence-Generation": str(self.generation),
            "Fence-Epoch": str(self.epoch),
            "Fence-Cancel": str(self.cancel),
        }


class Coordinator:
    """The gateway's coordination and ledger API as a scheduler, workers and an operator use
    it (plain HTTP: the test trusts none of the gateway's Python)."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self.http = http
        self.base_url = base_url

    async def new_task(self) -> str:
        task_id = f"mcp-{uuid.uuid4().hex[:12]}"
        async with self.http.put(
            f"{self.base_url}/v1/tasks/{task_id}", json={"inputDigest": "in-1"}
        ) as resp:
            assert resp.status == 201, await resp.text()
        return task_id

    async def try_claim(self, task_id: str, owner: str, ttl_ms: int) -> Lease | None:
        """The lease, or None while another worker's lease is live."""
        async with self.http.post(
            f"{self.base_url}/v1/tasks/{task_id}/claim",
            json={"owner": owner, "ttlMs": ttl_ms, "schedulerEpoch": await self.epoch()},
        ) as resp:
            body = await resp.json()
            if resp.status == 409 and body.get("code") == "CLAIMED":
                return None
            assert resp.status == 200, body
        return Lease(
            task_id,
            body["attemptId"],
            body["claimGeneration"],
            body["schedulerEpoch"],
            body["cancelGeneration"],
        )

    async def claim(self, task_id: str, owner: str, ttl_ms: int = LONG_TTL_MS) -> Lease:
        lease = await self.try_claim(task_id, owner, ttl_ms)
        assert lease is not None, f"{task_id} is claimed already"
        return lease

    async def lease(self, ttl_ms: int = LONG_TTL_MS) -> Lease:
        """A new task and its first worker's lease."""
        return await self.claim(await self.new_task(), "worker-a", ttl_ms)

    async def take_over(self, task_id: str, owner: str = "worker-b") -> Lease:
        """Claim the task as soon as the previous worker's lease has expired (as a scheduler
        would hand it to another worker after the first one went silent)."""
        deadline = time.monotonic() + 15
        while True:
            lease = await self.try_claim(task_id, owner, LONG_TTL_MS)
            if lease is not None:
                return lease
            assert time.monotonic() < deadline, "the first lease never expired"
            await asyncio.sleep(0.05)

    async def epoch(self) -> int:
        async with self.http.get(f"{self.base_url}/v1/epoch") as resp:
            body = await resp.json()
            assert resp.status == 200, body
        epoch: int = body["schedulerEpoch"]
        return epoch

    async def bump_epoch(self) -> int:
        async with self.http.post(f"{self.base_url}/v1/epoch/bump") as resp:
            body = await resp.json()
            assert resp.status == 200, body
        epoch: int = body["schedulerEpoch"]
        return epoch

    async def effects(self, task_id: str) -> list[dict[str, Any]]:
        """The ledger's effects of a task, as an operator lists them."""
        async with self.http.get(
            f"{self.base_url}/v1/effects", params={"taskId": task_id, "limit": "100"}
        ) as resp:
            body = await resp.json()
            assert resp.status == 200, body
        effects: list[dict[str, Any]] = body["effects"]
        return effects

    async def effect(self, effect_id: str) -> dict[str, Any]:
        async with self.http.get(f"{self.base_url}/v1/effects/{effect_id}") as resp:
            body: dict[str, Any] = await resp.json()
            assert resp.status == 200, body
        return body


@pytest.fixture
async def api(gateway: InProcessGateway) -> AsyncIterator[Coordinator]:
    """The test's scheduler, workers and operator, on the test's gateway."""
    async with aiohttp.ClientSession() as http:
        yield Coordinator(http, gateway.url)


# --- the agent: the official client through the gateway ------------------------------------------


@asynccontextmanager
async def agent(
    gateway: InProcessGateway, lease: Lease | None, mode: str = "auto"
) -> AsyncIterator[Client]:
    """The official MCP client on ``/mcp/tools``, its lease set once on its HTTP client (as an
    agent framework would): every request of the session carries it."""
    headers = lease.headers() if lease is not None else {}
    async with httpx2.AsyncClient(headers=headers, timeout=MCP_HTTP_TIMEOUT) as http:
        transport = streamable_http_client(f"{gateway.url}/mcp/{DOWNSTREAM}", http_client=http)
        async with Client(transport, mode=mode) as client:
            yield client


def refusal(caught: pytest.ExceptionInfo[MCPError]) -> dict[str, Any]:
    """``error.data`` of a gateway's JSON-RPC refusal: its problem code and fence details."""
    data = caught.value.error.data
    assert isinstance(data, dict), caught.value
    return data


def slot(name: str) -> RequestParamsMeta:
    """``_meta`` naming the call's slot. ``RequestParamsMeta`` is an open TypedDict
    (``extra_items``), which mypy does not read yet: hence the cast."""
    return cast(RequestParamsMeta, {SLOT: name})


def text(result: CallToolResult) -> str:
    assert not result.is_error, result
    [content] = result.content
    assert isinstance(content, TextContent), content
    return content.text


def modern_call(request_id: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A 2026-07-28 ``tools/call`` as the official client writes it (with the envelope a modern
    server requires), for the raw requests the client cannot make."""
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {
            "name": name,
            "arguments": arguments,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": MODERN,
                "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
                "io.modelcontextprotocol/clientCapabilities": {},
            },
        },
    }


async def forwards_observed(gateway: InProcessGateway, outcome: str) -> int:
    """``fencegate_forward_seconds`` observations of the MCP downstream with ``outcome``."""
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.url}/metrics") as resp:
        text_ = await resp.text()
    prefix = "fencegate_forward_seconds_count{"
    for line in text_.splitlines():
        if (line.startswith(prefix) and f'downstream="{DOWNSTREAM}"' in line
                and f'outcome="{outcome}"' in line):  # fmt: skip
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def raw_post(
    gateway: InProcessGateway, lease: Lease, body: Any, name: str = "counter"
) -> dict[str, Any]:
    """POST one body to ``/mcp/tools`` with the modern era's headers; the JSON answer."""
    headers = {
        **lease.headers(),
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": "tools/call",
        "Mcp-Name": name,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{gateway.url}/mcp/{DOWNSTREAM}", data=json.dumps(body), headers=headers
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/json"
        answer: dict[str, Any] = await resp.json()
    return answer


# --- 1, 7: a duplicate reaches the server once, in both protocol eras ---------------------------


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_duplicate_call_runs_once_and_is_replayed_under_its_own_id(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator, mode: str
) -> None:
    """The same tool with the same arguments twice in one task revision is one effect (its
    slot is derived from the name and the arguments): an agent that re-sends after a crash or
    a retry loop must not run a non-idempotent tool again. ``auto`` negotiates 2026-07-28
    (stateless POSTs), ``legacy`` the initialize handshake with a session: the fence must not
    depend on the era."""
    lease = await api.lease()
    async with agent(gateway, lease, mode) as client:
        if mode == "auto":
            assert client.protocol_version == MODERN
        else:
            assert client.protocol_version != MODERN
        first = await client.call_tool("counter", {"label": "dup"})
        second = await client.call_tool("counter", {"label": "dup"})

    assert mcp_server.runs("counter") == 1
    assert text(first) == text(second) == "1"
    assert first.structured_content == second.structured_content == {"result": 1}
    assert REPLAYED not in (first.meta or {})
    assert second.meta is not None and second.meta[REPLAYED] is True

    # The client matched the replay to its second request, so it came under that id; a raw
    # request with an id of another type shows the id is the new request's, not the stored one.
    raw = await raw_post(gateway, lease, modern_call("raw-dup-7", "counter", {"label": "dup"}))
    assert raw["id"] == "raw-dup-7"
    assert raw["result"]["_meta"][REPLAYED] is True
    assert raw["result"]["structuredContent"] == {"result": 1}
    assert mcp_server.runs("counter") == 1
    [effect] = await api.effects(lease.task_id)
    assert effect["state"] == "COMMITTED"
    assert effect["path"] == "/tools/call/counter"
    # One forward, observed like a proxied one (the replays are not forwards).
    assert await forwards_observed(gateway, "committed") == 1


async def test_explicit_slot_with_other_arguments_is_a_payload_conflict(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """An agent that names its slot (``_meta["dev.fencegate/slot"]``) says "this is that one
    effect": other arguments under the same slot are a bug in the agent, refused before the
    server sees them rather than run as a second effect or answered with the first one's
    result."""
    lease = await api.lease()
    async with agent(gateway, lease) as client:
        first = await client.call_tool("counter", {"label": "x"}, meta=slot("s1"))
        again = await client.call_tool("counter", {"label": "x"}, meta=slot("s1"))
        with pytest.raises(MCPError) as caught:
            await client.call_tool("counter", {"label": "y"}, meta=slot("s1"))

    assert text(first) == text(again) == "1"
    assert again.meta is not None and again.meta[REPLAYED] is True
    data = refusal(caught)
    assert data["code"] == "PAYLOAD_CONFLICT", data
    runs = mcp_server.executions()["counter"]
    assert [run["args"] for run in runs] == [{"label": "x"}]
    [effect] = await api.effects(lease.task_id)
    assert effect["slot"] == "s1"


async def test_concurrent_duplicates_run_once(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """Two sessions of one worker send the same call at once (an agent's parallel tool calls,
    or a retry racing the original): one is forwarded, the other must not be, whether it comes
    while the first is in flight (refused ``EFFECT_IN_FLIGHT``) or after it (replayed)."""
    lease = await api.lease()
    arguments = {"steps": 2, "delay_ms": 300}
    async with agent(gateway, lease) as one, agent(gateway, lease) as two:
        answers = await asyncio.gather(
            one.call_tool("slow", arguments),
            two.call_tool("slow", arguments),
            return_exceptions=True,
        )
    assert mcp_server.runs("slow") == 1
    fresh = [a for a in answers if isinstance(a, CallToolResult) and REPLAYED not in (a.meta or {})]
    assert len(fresh) == 1 and text(fresh[0]) == "done 2", answers
    other = answers[1] if answers[0] is fresh[0] else answers[0]
    if isinstance(other, MCPError):
        assert isinstance(other.error.data, dict), other
        assert other.error.data["code"] == "EFFECT_IN_FLIGHT", other.error.data
    else:
        assert isinstance(other, CallToolResult), other
        assert other.meta is not None and other.meta[REPLAYED] is True


# --- 2, 9: a lease that is no longer the task's current one runs nothing --------------------------


async def test_stale_lease_after_a_takeover_is_fenced(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """The zombie case: worker A's lease expired and worker B took the task over; A, still
    running with its MCP session open, calls a tool. The gateway must refuse it (JSON-RPC error
    ``FENCED``) before the server sees it, while B's same call goes through."""
    task_id = await api.new_task()
    lease_a = await api.claim(task_id, "worker-a", ZOMBIE_TTL_MS)
    async with agent(gateway, lease_a) as zombie:
        await zombie.list_tools()
        lease_b = await api.take_over(task_id)
        assert lease_b.generation > lease_a.generation
        with pytest.raises(MCPError) as caught:
            await zombie.call_tool("counter", {"label": "stale"})
    data = refusal(caught)
    assert data["code"] == "FENCED", data
    assert mcp_server.executions() == {}
    assert await api.effects(task_id) == []

    async with agent(gateway, lease_b) as current:
        assert text(await current.call_tool("counter", {"label": "stale"})) == "1"
    assert mcp_server.runs("counter") == 1


async def test_epoch_bump_fences_the_next_call(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """An operator's epoch bump (e.g. a scheduler failover) fences every lease of the old epoch
    at once: the agent's next call in its open session is a JSON-RPC error and reaches nothing."""
    lease = await api.lease()
    async with agent(gateway, lease) as client:
        assert text(await client.call_tool("counter", {"label": "before"})) == "1"
        assert await api.bump_epoch() == lease.epoch + 1
        with pytest.raises(MCPError) as caught:
            await client.call_tool("counter", {"label": "after"})
    data = refusal(caught)
    assert data["code"] == "STALE_EPOCH", data
    runs = mcp_server.executions()["counter"]
    assert [run["args"] for run in runs] == [{"label": "before"}]


async def test_a_fenced_agents_session_end_still_reaches_the_server(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """A fenced agent's handshake-era session ends with a DELETE carrying its (now stale)
    lease, as the SDK client sends it on exit (an epoch bump fences it here: a takeover is the
    same to the fence check). Ending a session runs no tool, and the same DELETE without a
    lease is relayed anyway, so refusing it would protect nothing and only leave the session
    open at the server for good (the SDK client logs "Session termination failed: 409")."""
    lease = await api.lease()
    url = f"{gateway.url}/mcp/{DOWNSTREAM}"
    accept = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "zombie", "version": "0"},
        },
    }
    async with api.http.post(url, json=initialize, headers={**accept, **lease.headers()}) as resp:
        assert resp.status == 200, await resp.text()
        session = {**accept, "Mcp-Session-Id": resp.headers["Mcp-Session-Id"]}
        await resp.read()
    session["MCP-Protocol-Version"] = "2025-11-25"
    await api.bump_epoch()
    ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
    try:
        async with api.http.delete(url, headers={**session, **lease.headers()}) as resp:
            ended = resp.status
        async with api.http.post(url, json=ping, headers=session) as resp:
            after = resp.status  # ping is lease-free: 404 once the session is gone
        assert (ended, after) == (200, 404)
    finally:
        async with api.http.delete(url, headers=session):
            pass  # no session left open at the module's server


# --- 3: a lost answer is UNKNOWN; only an idempotent tool is re-sent -----------------------------


async def test_lost_answer_of_an_effect_is_unknown_and_never_resent(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """A call whose answer never came may have run: the gateway says UNKNOWN (it cannot know),
    and a tool without hints may not run twice, so the takeover worker's retry of the same call
    (same task revision and slot: the same effectId) is refused ``EFFECT_UNKNOWN`` and the
    server ran it once. An operator settles it, not a retry loop."""
    task_id = await api.new_task()
    lease_a = await api.claim(task_id, "worker-a", CALL_TTL_MS)
    async with agent(gateway, lease_a) as client:
        with pytest.raises(MCPError) as lost:
            await client.call_tool("sleepy", {"ms": LOST_ANSWER_MS})
    first = refusal(lost)
    assert first["code"] == "DOWNSTREAM_TIMEOUT", first
    assert first["effectState"] == "UNKNOWN", first
    assert mcp_server.runs("sleepy") == 1

    lease_b = await api.take_over(task_id)
    async with agent(gateway, lease_b) as client:
        with pytest.raises(MCPError) as retried:
            await client.call_tool("sleepy", {"ms": LOST_ANSWER_MS})
    second = refusal(retried)
    assert second["code"] == "EFFECT_UNKNOWN", second
    assert second["effectId"] == first["effectId"]
    assert mcp_server.runs("sleepy") == 1
    assert (await api.effect(first["effectId"]))["state"] == "UNKNOWN"
    assert await forwards_observed(gateway, "timeout") == 1


async def test_lost_answer_of_an_idempotent_tool_is_resent_once_under_its_effect_id(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """``charge`` (``idempotentHint``, the server dedupes on the effectId inside the configured
    ``dedupe_window_ms``) charged but its answer was lost: the takeover worker's retry is
    re-sent under the same effectId, the server answers it from its dedupe record, and the
    account was charged once, the retry getting the first run's answer."""
    task_id = await api.new_task()
    account = f"acct-{task_id}"
    arguments = {"account": account, "amount": 7, "delay_ms": LOST_ANSWER_MS}
    lease_a = await api.claim(task_id, "worker-a", CALL_TTL_MS)
    async with agent(gateway, lease_a) as client:
        with pytest.raises(MCPError) as lost:
            await client.call_tool("charge", arguments)
    first = refusal(lost)
    assert first["code"] == "DOWNSTREAM_TIMEOUT", first
    assert first["effectState"] == "UNKNOWN", first
    effect_id = first["effectId"]

    lease_b = await api.take_over(task_id)
    async with agent(gateway, lease_b) as client:
        result = await client.call_tool("charge", arguments)
    assert text(result) == f"charged {account} 7 (total 7)"

    runs = mcp_server.executions()["charge"]
    assert [(run["effect_id"], run["deduped"]) for run in runs] == [
        (effect_id, False),
        (effect_id, True),
    ]
    assert all(run["meta"][EFFECT_ID_META_KEY] == effect_id for run in runs)
    assert mcp_server.state()["balances"] == {account: 7}
    assert (await api.effect(effect_id))["state"] == "COMMITTED"


# --- a server's refusal before the tool ran is NOT_APPLIED --------------------------------------


async def test_header_mismatch_before_the_tool_ran_does_not_block_the_clients_resend(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """A 2026-07-28 client mirrors ``x-mcp-header`` arguments into ``Mcp-Param-*`` headers only
    for tools it has listed; called first, ``routed`` is refused by the server with -32020
    HEADER_MISMATCH (400) before the tool runs, and the SDK client lists the tools and re-sends
    the call once (straight to the server this call succeeds). That refusal ran nothing, so
    the gateway must let the re-send through: recording it UNKNOWN strands the task until an
    operator settles an effect that never happened. (The gateway answers a mismatch of
    Mcp-Method, Mcp-Name or the version itself, unrecorded; ``Mcp-Param-*`` needs the tool's
    input schema, so the server's refusal decides.)"""
    lease = await api.lease()
    async with agent(gateway, lease) as client:
        result = await client.call_tool("routed", {"region": "eu", "label": "first"})
    assert text(result) == "1"
    assert mcp_server.runs("routed") == 1
    [effect] = await api.effects(lease.task_id)
    assert effect["state"] == "COMMITTED"
    outcomes = [attempt["outcome"] for attempt in effect["attempts"]]
    assert outcomes == ["NOT_APPLIED", "COMMITTED"], effect["attempts"]


# --- 4, 5, 6: what is recorded, and what needs a lease ------------------------------------------


async def test_read_only_tool_is_never_recorded(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """``lookup`` (``readOnlyHint``) changes nothing, so it gets no ledger entry and is not
    deduplicated: each call reaches the server. A recorded call in the same task shows the
    listing would have found one."""
    lease = await api.lease()
    async with agent(gateway, lease) as client:
        assert text(await client.call_tool("lookup", {"key": "k1"})) == "value-of-k1"
        assert text(await client.call_tool("lookup", {"key": "k1"})) == "value-of-k1"
        await client.call_tool("counter", {"label": "recorded"})
    assert mcp_server.runs("lookup") == 2
    [effect] = await api.effects(lease.task_id)
    assert effect["path"] == "/tools/call/counter"


async def test_tools_list_needs_no_lease_but_a_call_does(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """Setting up and describing a session (discover or the handshake, ``tools/list``) is
    lease-free, so an agent can learn its tools before it has a task; ``tools/call`` without a
    lease would be an unfenced effect, so it is refused ``BAD_REQUEST`` and reaches nothing. In
    both eras."""
    lease = await api.lease()
    for mode in ("auto", "legacy"):
        async with agent(gateway, None, mode) as anonymous:
            names = {tool.name for tool in (await anonymous.list_tools()).tools}
            assert {"counter", "lookup", "charge", "sleepy", "slow"} <= names
            with pytest.raises(MCPError) as caught:
                await anonymous.call_tool("counter", {"label": f"no-lease-{mode}"})
        data = refusal(caught)
        assert data["code"] == "BAD_REQUEST", data
        async with agent(gateway, lease, mode) as leased:
            assert {tool.name for tool in (await leased.list_tools()).tools} == names
    assert mcp_server.executions() == {}
    assert await api.effects(lease.task_id) == []


class ProgressLog:
    """The progress notifications a call's ``progress_callback`` got, with when they came."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float | None, str | None]] = []
        self.at: list[float] = []

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.seen.append((progress, total, message))
        self.at.append(time.monotonic())


async def test_progress_streams_through_and_the_result_is_committed(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """A long tool's progress notifications reach the agent as they come (the SSE stream is
    relayed, not buffered until the end: the first one arrives well before the answer), while
    its final answer is written only once recorded: the ledger holds the call COMMITTED with
    its answer. In both eras."""
    lease = await api.lease()
    steps = 3
    # Other arguments in each era: two calls, two slots (else the second is a replay).
    for delay_ms, mode in ((300, "auto"), (250, "legacy")):
        progress = ProgressLog()
        async with agent(gateway, lease, mode) as client:
            result = await client.call_tool(
                "slow", {"steps": steps, "delay_ms": delay_ms}, progress_callback=progress
            )
            answered_at = time.monotonic()
        assert text(result) == f"done {steps}"
        assert progress.seen == [(float(n), float(steps), f"step {n}") for n in range(1, steps + 1)]
        # The server answers (steps - 1) * delay_ms (500 ms or more) after its first step: a
        # gateway that held the events back would deliver them together with the answer.
        assert answered_at - progress.at[0] >= 0.2, (mode, answered_at - progress.at[0])

    runs = mcp_server.executions()["slow"]
    assert [(run["args"]["delay_ms"], run["finished"]) for run in runs] == [
        (300, True),
        (250, True),
    ]
    effects = await api.effects(lease.task_id)
    assert [e["state"] for e in effects] == ["COMMITTED", "COMMITTED"]
    assert {e["path"] for e in effects} == {"/tools/call/slow"}
    for effect in effects:
        stored = effect["response"]
        assert stored is not None and stored.get("bodyBase64"), effect


# --- 8: batches -----------------------------------------------------------------------------------


async def test_batch_is_refused_and_nothing_runs(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """A JSON-RPC batch would be several effects in one request with one answer: MCP dropped
    batches, and the gateway refuses one whole (-32600) rather than run part of it."""
    lease = await api.lease()
    batch = [
        modern_call(1, "counter", {"label": "batch-1"}),
        modern_call(2, "counter", {"label": "batch-2"}),
    ]
    answer = await raw_post(gateway, lease, batch)
    assert answer["error"]["code"] == -32600, answer
    assert answer["id"] is None
    assert mcp_server.executions() == {}
    assert await api.effects(lease.task_id) == []


# --- what an adversarial pass found (docs/security.md, "MCP") ------------------------------------


async def _raw(
    gateway: InProcessGateway, method: str, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, f"{gateway.url}/mcp/{DOWNSTREAM}", data=body, headers=headers) as resp,
    ):
        return resp.status, await resp.text()


async def test_a_call_without_an_id_is_refused_and_never_reaches_the_server(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """A ``tools/call`` without an ``id`` is a notification: it would get no answer, so no
    record, and a server that runs notifications would run it every time. Refused (-32600)."""
    lease = await api.lease()
    call = modern_call(1, "counter", {"label": "no-id"})
    del call["id"]
    headers = {**lease.headers(), "Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "MCP-Protocol-Version": MODERN,
               "Mcp-Method": "tools/call", "Mcp-Name": "counter"}  # fmt: skip
    for _ in range(3):
        status, text_ = await _raw(gateway, "POST", headers, json.dumps(call).encode())
        assert status == 400, text_
        assert json.loads(text_)["error"]["code"] == -32600
    assert mcp_server.executions() == {}
    assert await api.effects(lease.task_id) == []


async def test_routing_headers_that_disagree_with_the_call_are_refused_before_it_is_recorded(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """2026-07-28: a wrong ``Mcp-Name`` is refused by the gateway itself (-32020, as the server
    would), so the call is not recorded UNKNOWN and the correct re-send runs once."""
    lease = await api.lease()
    call = modern_call(1, "counter", {"label": "routed"})
    headers = {**lease.headers(), "Accept": "application/json, text/event-stream",
               "Content-Type": "application/json", "MCP-Protocol-Version": MODERN,
               "Mcp-Method": "tools/call", "Mcp-Name": "lookup"}  # fmt: skip
    status, text_ = await _raw(gateway, "POST", headers, json.dumps(call).encode())
    assert status == 400 and json.loads(text_)["error"]["code"] == -32020, text_
    assert await api.effects(lease.task_id) == []
    answer = await raw_post(gateway, lease, call)
    assert "result" in answer, answer
    assert mcp_server.runs("counter") == 1
    assert [r["args"] for r in mcp_server.executions()["counter"]] == [{"label": "routed"}]


async def test_a_stream_needs_a_lease_and_nesting_past_any_parser_is_a_parse_error(
    gateway: InProcessGateway, mcp_server: McpServerProcess, api: Coordinator
) -> None:
    """A GET holds a pooled connection for as long as it is open: not without a lease (405, as
    a server without a stream answers: an MCP client goes on without one). JSON nested past
    what a parser follows is a parse error (-32700), never a 500."""
    status, text_ = await _raw(gateway, "GET", {"Accept": "text/event-stream"})
    assert status == 405 and json.loads(text_)["error"]["code"] == -32000, text_
    lease = await api.lease()
    deep = b"[" * 200_000 + b"]" * 200_000
    headers = {**lease.headers(), "Content-Type": "application/json",
               "Accept": "application/json, text/event-stream"}  # fmt: skip
    status, text_ = await _raw(gateway, "POST", headers, deep)
    assert status == 200 and json.loads(text_)["error"]["code"] == -32700, text_[:200]
    assert mcp_server.executions() == {}


async def test_a_failed_call_whose_answer_was_not_stored_replays_as_a_failure(
    store_url: str, key_prefix: str, tmp_path: Path, mcp_server: McpServerProcess
) -> None:
    """With ``store_response_body = false`` the record keeps no body, yet a duplicate of a
    call that failed (``isError: true``) must not be told it succeeded: the record keeps the
    error flag and the replay carries it."""
    config = write_gateway_config(
        tmp_path / "gw-unstored",
        store_url,
        key_prefix=key_prefix,
        downstreams=[
            {
                "name": DOWNSTREAM,
                "url": mcp_server.url,
                "adapter": "mcp",
                "timeout_ms": 10_000,
                "store_response_body": False,
            }
        ],
    )
    gateway = await InProcessGateway(config.config_path).start()
    try:
        async with aiohttp.ClientSession() as http:
            api = Coordinator(http, gateway.url)
            lease = await api.lease()
            call = modern_call("f-1", "fail", {"message": "card declined"})
            first = await raw_post(gateway, lease, call, name="fail")
            again = await raw_post(gateway, lease, {**call, "id": "f-2"}, name="fail")
            [effect] = await api.effects(lease.task_id)
    finally:
        await gateway.stop()

    assert mcp_server.runs("fail") == 1
    assert first["result"]["isError"] is True
    assert again["id"] == "f-2"
    assert again["result"]["isError"] is True
    assert again["result"]["_meta"] == {
        REPLAYED: True,
        "fencegate/replayed": True,
        "dev.fencegate/replayBody": "omitted",
        "fencegate/replayBody": "omitted",
    }
    assert effect["state"] == "COMMITTED"
