"""MCP tools and approvals (issue 25): annotations are hints, ``require_approval`` is a rule.

* A tool configured ``require_approval = true`` is a recorded call that waits for an operator,
  whatever its ``kind`` or the server's ``readOnlyHint`` say (the hint used to relay it with no
  record and no approval).
* The server's annotations count only on a downstream with ``trust_annotations = true``;
  untrusted (the default), a tool without a configured ``kind`` is an effect.
* An operator can approve such a call (API, CLI): the approve endpoint used to refuse every
  MCP effect, so the call waited forever. The retry then runs exactly once at the server.

A real MCP server (``tests/mcp_server.py``, the official SDK, JSON answers) counts what ran;
the gateway runs in-process on every store, and the CLI is ``fencegate.gateway.cli.main`` in
a worker thread, speaking HTTP to it as from a terminal.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.cli import main
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.mcp_server import McpServerProcess

MODERN = "2026-07-28"
#: ``lookup`` carries ``readOnlyHint`` at the server; both downstreams configure it
#: ``require_approval`` without a kind.
APPROVAL_TTL_MS = 120_000


@pytest.fixture(scope="module")
def mcp_process() -> Iterator[McpServerProcess]:
    with McpServerProcess(json_response=True) as server:
        yield server


@pytest.fixture
def mcp_server(mcp_process: McpServerProcess) -> McpServerProcess:
    mcp_process.reset()
    return mcp_process


@dataclass
class Env:
    api: Api
    url: str
    server: McpServerProcess
    #: Where the ``late`` downstream's server will listen: bound here, so nothing else can
    #: take it, and refusing connections until a test starts the server on it.
    late: socket.socket

    async def lease(self, task_id: str) -> Lease:
        await self.api.put(task_id)
        return await self.api.claim(task_id, ttl_ms=30_000)

    async def call(
        self, lease: Lease, downstream: str, name: str, arguments: dict[str, Any], rid: int = 1
    ) -> dict[str, Any]:
        """One 2026-07-28 ``tools/call`` through ``/mcp/{downstream}``; the JSON-RPC answer."""
        message = {
            "jsonrpc": "2.0",
            "id": rid,
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
        headers = {
            "Fence-Task": lease.task_id,
            "Fence-Attempt": lease.attempt_id,
            "Fence-Generation": str(lease.claim_generation),
            "Fence-Epoch": str(lease.scheduler_epoch),
            "Fence-Cancel": str(lease.cancel_generation),
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/call",
            "Mcp-Name": name,
        }
        async with self.api.client.post(
            f"/mcp/{downstream}", data=json.dumps(message), headers=headers
        ) as resp:
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json()
        return answer

    async def effects(self, task_id: str) -> list[dict[str, Any]]:
        listed = await self.api.call("GET", f"/v1/effects?taskId={task_id}")
        assert listed.status == 200, listed.body
        effects: list[dict[str, Any]] = listed.body["effects"]
        return effects


@pytest.fixture
async def env(store_url: str, key_prefix: str, mcp_server: McpServerProcess) -> AsyncIterator[Env]:
    approval = {"require_approval": True, "approval_ttl_ms": APPROVAL_TTL_MS}
    late = socket.socket()
    late.bind(("127.0.0.1", 0))
    late_port = late.getsockname()[1]
    config = make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        downstreams=[
            # Untrusted (the default): only the tools table says what a tool is.
            {"name": "tools", "url": mcp_server.url, "adapter": "mcp",
             "tools": {"lookup": approval}},
            # Trusted: readOnlyHint counts, but never over require_approval.
            {"name": "trusted", "url": mcp_server.url, "adapter": "mcp",
             "trust_annotations": True, "tools": {"lookup": approval}},
            # No tools table: untrusted (the default) and trusted.
            {"name": "bare", "url": mcp_server.url, "adapter": "mcp"},
            {"name": "bare-trusted", "url": mcp_server.url, "adapter": "mcp",
             "trust_annotations": True},
            # A server that is not up yet: its connections are refused.
            {"name": "late", "url": f"http://127.0.0.1:{late_port}/mcp", "adapter": "mcp",
             "tools": {"lookup": approval}},
        ],
    )  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    with late:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield Env(Api(client), str(client.make_url("")).rstrip("/"), mcp_server, late)


def refusal(answer: dict[str, Any]) -> dict[str, Any]:
    assert "error" in answer, answer
    data: dict[str, Any] = answer["error"]["data"]
    return data


# --- 1: require_approval wins over the hints; untrusted hints count for nothing ------------------


@pytest.mark.parametrize("downstream", ["trusted", "tools"])
async def test_a_tool_that_requires_approval_is_recorded_and_waits_whatever_its_hints(
    env: Env, downstream: str
) -> None:
    """``lookup`` has ``readOnlyHint`` and is configured ``require_approval`` with no kind:
    it used to be relayed unrecorded and unapproved (the hint made it a read). It waits for
    an operator, recorded, and nothing ran."""
    lease = await env.lease(f"t-{downstream}")
    answer = await env.call(lease, downstream, "lookup", {"key": "k1"})
    data = refusal(answer)
    assert data["code"] == "APPROVAL_REQUIRED", data
    assert env.server.runs("lookup") == 0
    [effect] = await env.effects(lease.task_id)
    assert effect["effectId"] == data["effectId"]
    assert effect["path"] == "/tools/call/lookup" and effect["state"] == "NOT_APPLIED"
    waiting = await env.api.call("GET", "/v1/effects?awaitingApproval=true")
    assert [e["effectId"] for e in waiting.body["effects"]] == [data["effectId"]]


async def test_an_untrusted_servers_read_only_hint_does_not_skip_the_record(env: Env) -> None:
    """On a downstream without ``trust_annotations``, ``lookup``'s ``readOnlyHint`` does not
    count: it is a recorded effect (its duplicate is replayed, never run twice). On a trusted
    downstream the same hint is believed: no record, each call runs."""
    lease = await env.lease("t-hints")
    first = await env.call(lease, "bare", "lookup", {"key": "k"}, rid=1)
    again = await env.call(lease, "bare", "lookup", {"key": "k"}, rid=2)
    assert first["result"]["content"][0]["text"] == "value-of-k", first
    assert again["result"]["_meta"]["fencegate/replayed"] is True
    assert env.server.runs("lookup") == 1
    [effect] = await env.effects(lease.task_id)
    assert effect["path"] == "/tools/call/lookup" and effect["state"] == "COMMITTED"

    for rid in (3, 4):
        read = await env.call(lease, "bare-trusted", "lookup", {"key": "k"}, rid=rid)
        assert "fencegate/replayed" not in (read["result"].get("_meta") or {}), read
    assert env.server.runs("lookup") == 3
    assert len(await env.effects(lease.task_id)) == 1


# --- 2: an operator can approve an MCP call; the retry runs once ----------------------------------


async def test_an_operator_approves_an_mcp_call_over_the_api_and_the_retry_runs_once(
    env: Env,
) -> None:
    lease = await env.lease("t-api")
    data = refusal(await env.call(lease, "tools", "lookup", {"key": "k2"}))
    assert data["code"] == "APPROVAL_REQUIRED", data
    effect_id = data["effectId"]
    digest = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body["payloadDigest"]

    approved = await env.api.call(
        "POST", f"/v1/effects/{effect_id}/approve", {"payloadDigest": digest, "note": "ok"}
    )
    assert approved.status == 200, approved.body
    approval = approved.body["approval"]
    assert approval["payloadDigest"] == digest
    assert approval["expiresAt"] - approval["at"] == APPROVAL_TTL_MS  # the tool's own TTL
    assert env.server.runs("lookup") == 0

    sent = await env.call(lease, "tools", "lookup", {"key": "k2"}, rid=2)
    assert sent["result"]["content"][0]["text"] == "value-of-k2", sent
    again = await env.call(lease, "tools", "lookup", {"key": "k2"}, rid=3)
    assert again["result"]["_meta"]["fencegate/replayed"] is True
    assert env.server.runs("lookup") == 1
    record = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["state"] == "COMMITTED" and record["approval"] is None
    assert record["attempts"][-1]["approvedBy"] == "anonymous"


async def test_an_operator_approves_an_mcp_call_with_the_cli(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = await env.lease("t-cli")
    data = refusal(await env.call(lease, "trusted", "lookup", {"key": "k3"}))
    effect_id = data["effectId"]
    digest = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body["payloadDigest"]
    capsys.readouterr()
    argv = ["effects", "approve", effect_id, "--payload-digest", digest, "--note", "t 9",
            "--operator", "carol", "--url", env.url]  # fmt: skip
    code = await asyncio.to_thread(main, argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"effect {effect_id} approved" in out
    sent = await env.call(lease, "trusted", "lookup", {"key": "k3"}, rid=2)
    assert sent["result"]["content"][0]["text"] == "value-of-k3", sent
    assert env.server.runs("lookup") == 1
    record = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["attempts"][-1]["approvedBy"] == "carol"


async def test_approve_still_refuses_an_mcp_tool_that_needs_no_approval(env: Env) -> None:
    lease = await env.lease("t-plain")
    answer = await env.call(lease, "tools", "counter", {"label": "x"})
    assert "result" in answer
    [effect] = await env.effects(lease.task_id)
    refused = await env.api.call("POST", f"/v1/effects/{effect['effectId']}/approve")
    assert refused.status == 400 and "tool 'counter'" in refused.body["detail"]


# --- 4: an approved call that could not connect keeps its approval -------------------------------


async def test_an_approved_call_whose_connection_was_refused_keeps_its_approval(env: Env) -> None:
    """The server is down when the approved call goes: nothing was sent, so the approval is
    not used up; the effect stays in the approval queue, and once the server is up the agent's
    retry runs under the same approval, once."""
    lease = await env.lease("t-late")
    data = refusal(await env.call(lease, "late", "lookup", {"key": "k4"}))
    effect_id = data["effectId"]
    approved = await env.api.call("POST", f"/v1/effects/{effect_id}/approve", {"note": "ok"})
    assert approved.status == 200, approved.body

    down = refusal(await env.call(lease, "late", "lookup", {"key": "k4"}, rid=2))
    assert down["code"] == "DOWNSTREAM_UNREACHABLE", down
    record = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["state"] == "NOT_APPLIED" and record["approval"] is not None
    queue = await env.api.call("GET", "/v1/effects?awaitingApproval=true")
    assert effect_id in [e["effectId"] for e in queue.body["effects"]]

    with McpServerProcess(sock=env.late, json_response=True) as late:
        sent = await env.call(lease, "late", "lookup", {"key": "k4"}, rid=3)
        assert sent["result"]["content"][0]["text"] == "value-of-k4", sent
        again = await env.call(lease, "late", "lookup", {"key": "k4"}, rid=4)
        assert again["result"]["_meta"]["fencegate/replayed"] is True
        assert late.runs("lookup") == 1
    record = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["state"] == "COMMITTED" and record["approval"] is None
