"""The SDK's side of the MCP gateway: ``Lease.mcp_headers`` and ``fencegate.mcp_meta``.

An MCP client (the official ``mcp`` SDK) makes the requests, so what the SDK owes it is the
headers to set once on its transport and the ``_meta`` that names a call's slot. These tests run
that client for real through a gateway with ``[auth]`` (in-process, SQLite) in front of a real
MCP server: the headers are the lease's and the credential, a slot given with ``mcp_meta`` is the
effect's slot in the ledger, a second identical call is replayed without the tool running again,
and docs/sdk.md's MCP example runs as written (without ``[auth]``, and with the README's one role
per token). The SDK itself never imports ``mcp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from aiohttp.test_utils import TestServer
from mcp.client.client import Client as McpClient
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, TextContent

import fencegate
from fencegate import Client, Lease
from fencegate.errors import PayloadConflict, error_from_problem
from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from tests.conftest import build_test_store, make_config
from tests.mcp_server import EFFECT_ID_META_KEY, McpServerProcess

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

REPO = Path(__file__).parent.parent
SDK_DOC = REPO / "docs" / "sdk.md"
#: One principal with what an agent needs: create its task, hold the lease, read the ledger.
TOKEN = "tok-agent-0123456789abcdef"
AUTH = {
    "principals": [
        {
            "name": "agent",
            "roles": ["scheduler", "worker", "observer"],
            "token_sha256": token_sha256(TOKEN),
        }
    ]
}
CLAIM = {
    "taskId": "t-1",
    "attemptId": "a-1",
    "claimGeneration": 3,
    "schedulerEpoch": 2,
    "cancelGeneration": 1,
    "revision": 1,
    "inputDigest": "in-1",
    "leaseExpiresAt": 10_000,
    "grantedTtlMs": 10_000,
}


def bare_lease(client: Client) -> Lease:
    """A lease made without a gateway: ``mcp_headers`` reads only the claim and the client."""
    return Lease(client, owner="w", ttl_ms=10_000, claim=CLAIM, sent_at=0.0, guarded=False)


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, downstreams: list[dict[str, Any]], auth: dict[str, Any] | None = AUTH
) -> AsyncIterator[str]:
    """A gateway on SQLite (with ``auth`` as its ``[auth]``, or none), in-process, listening on
    loopback: its URL."""
    config = make_config(f"sqlite:///{tmp_path / 'fencegate.db'}", downstreams=downstreams,
                         auth=auth)  # fmt: skip
    server = TestServer(create_app(config, store=build_test_store(config)), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
def mcp_server() -> Iterator[McpServerProcess]:
    with McpServerProcess() as server:
        yield server


def text(result: CallToolResult) -> str:
    (content,) = result.content
    assert isinstance(content, TextContent), content
    return content.text


def replayed(result: CallToolResult) -> bool:
    return bool((result.meta or {}).get("dev.fencegate/replayed"))


# --- the API ------------------------------------------------------------------------------------


async def test_mcp_headers_are_the_fence_headers_and_the_clients_credential() -> None:
    async with Client("http://127.0.0.1:1", token=TOKEN) as client:
        lease = bare_lease(client)
        assert lease.mcp_headers() == {
            **lease.fence_headers(),
            "Fence-Authorization": f"Bearer {TOKEN}",
        }
        assert lease.mcp_headers(node="billing") == {
            **lease.fence_headers(node="billing"),
            "Fence-Authorization": f"Bearer {TOKEN}",
        }
        assert "Fence-Slot" not in lease.mcp_headers()  # each call names its own
    async with Client("http://127.0.0.1:1", token="") as client:
        assert bare_lease(client).mcp_headers() == bare_lease(client).fence_headers()
    # A credential given as a header (any case) is the one sent; other headers are the SDK's.
    given = {"fence-authorization": "Bearer given", "X-Trace": "1"}
    async with Client("http://127.0.0.1:1", headers=given, token="") as client:
        headers = bare_lease(client).mcp_headers()
        assert headers["Fence-Authorization"] == "Bearer given"
        assert "X-Trace" not in headers and "fence-authorization" not in headers


@pytest.mark.parametrize(
    "slot", ["charge-1", "a" * 200, "ns:step/2@v1.x_y", "0"], ids=["plain", "200", "all", "one"]
)
def test_mcp_meta_names_the_slot(slot: str) -> None:
    # Under both names for at least one release: a gateway before the move reads the older.
    assert fencegate.mcp_meta(slot) == {"dev.fencegate/slot": slot, "fencegate/slot": slot}


@pytest.mark.parametrize(
    "slot",
    ["", "a" * 201, "charge 1", "charge\n", "é", "a?b", "a#b", 7],
    ids=["empty", "201", "space", "newline", "non-ascii", "query", "hash", "not-a-str"],
)
def test_mcp_meta_refuses_a_slot_outside_the_grammar(slot: Any) -> None:
    with pytest.raises(ValueError, match="1 to 200 characters"):
        fencegate.mcp_meta(slot)


def test_the_sdk_does_not_import_mcp() -> None:
    """``mcp`` is the agent's dependency, not the SDK's."""
    script = (
        "import json, sys\n"
        "import fencegate\n"
        "from fencegate import Lease, mcp_meta\n"
        "mcp_meta('x'); Lease.mcp_headers\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(done.stdout)
    assert not [m for m in loaded if m.split(".")[0] in ("mcp", "mcp_types", "httpx2")], loaded


# --- through a gateway --------------------------------------------------------------------------


async def test_an_mcp_session_under_a_lease_records_its_slot_and_replays(
    tmp_path: Path, mcp_server: McpServerProcess
) -> None:
    """The official client with ``lease.mcp_headers()`` on its transport: every request carries
    exactly the lease's headers and the credential; a call with ``mcp_meta`` is the effect of
    that slot; the same call again is replayed and the tool does not run twice."""
    downstreams = [{"name": "tools", "url": mcp_server.url, "adapter": "mcp", "timeout_ms": 3000}]
    async with (
        gateway(tmp_path, downstreams) as url,
        Client(url, token=TOKEN) as client,
    ):
        await client.put_task("job-1", "sha256:in-1")
        lease = await client.acquire("job-1", owner="agent-a", ttl_ms=30_000)
        expected = {**lease.fence_headers(), "Fence-Authorization": f"Bearer {TOKEN}"}
        assert lease.mcp_headers() == expected

        sent: list[httpx2.Headers] = []

        async def seen(request: httpx2.Request) -> None:
            sent.append(request.headers)

        http = httpx2.AsyncClient(
            headers=lease.mcp_headers(), timeout=30, event_hooks={"request": [seen]}
        )
        transport = streamable_http_client(f"{url}/mcp/tools", http_client=http)
        async with http, McpClient(transport) as tools:
            first = await tools.call_tool("counter", {"label": "a"}, meta=fencegate.mcp_meta("c-1"))
            again = await tools.call_tool("counter", {"label": "a"}, meta=fencegate.mcp_meta("c-1"))
            with pytest.raises(MCPError) as refused:
                await tools.call_tool("counter", {"label": "b"}, meta=fencegate.mcp_meta("c-1"))
            derived = await tools.call_tool("counter", {"label": "a"})

        # Every request of the session (discover, tools/list, the calls) went with the lease.
        assert len(sent) >= 4
        for headers in sent:
            fence = {k: v for k, v in headers.items() if k.lower().startswith("fence-")}
            assert {k.lower(): v for k, v in fence.items()} == {
                k.lower(): v for k, v in expected.items()
            }

        assert (text(first), replayed(first)) == ("1", False)
        assert (text(again), replayed(again)) == ("1", True)
        assert mcp_server.runs("counter") == 2  # c-1 once, then the derived slot once
        assert text(derived) == "2" and not replayed(derived)

        error = refused.value.error
        assert error.code == -32000 and error.data["code"] == "PAYLOAD_CONFLICT"
        typed = error_from_problem(error.data["status"], error.data)
        assert isinstance(typed, PayloadConflict)

        effects = await client.list_effects(task_id="job-1")
        by_slot = {effect["slot"]: effect for effect in effects}
        assert set(by_slot) == {"c-1", next(s for s in by_slot if s.startswith("mcp:"))}
        record = await client.get_effect(by_slot["c-1"]["effectId"])
        assert (record["slot"], record["state"], record["node"]) == ("c-1", "COMMITTED", "main")
        assert record["path"] == "/tools/call/counter"
        assert typed.effect_id == record["effectId"]
        # The tool got the effect's identity, not the slot key the agent sent.
        run = mcp_server.executions()["counter"][0]
        assert run["meta"][EFFECT_ID_META_KEY] == record["effectId"]
        assert "fencegate/slot" not in run["meta"] and "dev.fencegate/slot" not in run["meta"]
        assert run["meta"]["dev.fencegate/effectId"] == record["effectId"]


async def test_the_credential_and_the_node_of_mcp_headers_count(
    tmp_path: Path, mcp_server: McpServerProcess
) -> None:
    """Without the credential ``mcp_headers`` adds, a gateway with ``[auth]`` refuses the
    request; ``node=`` makes the same slot another effect, recorded under that node."""
    downstreams = [{"name": "tools", "url": mcp_server.url, "adapter": "mcp", "timeout_ms": 3000}]
    async with (
        gateway(tmp_path, downstreams) as url,
        Client(url, token=TOKEN) as client,
    ):
        await client.put_task("job-2", "sha256:in-2")
        lease = await client.acquire("job-2", owner="agent-a", ttl_ms=30_000)
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        async with httpx2.AsyncClient(timeout=30) as raw:
            bare = await raw.post(f"{url}/mcp/tools", json=ping, headers=lease.fence_headers())
            assert bare.status_code == 401, bare.text

        # Both eras: the handshake's session (initialize, its GET stream, the DELETE at the end)
        # goes through with the same headers as 2026-07-28's self-contained POSTs.
        for node, count, mode in (("billing", "1", "auto"), ("refunds", "2", "legacy")):
            http = httpx2.AsyncClient(headers=lease.mcp_headers(node=node), timeout=30)
            transport = streamable_http_client(f"{url}/mcp/tools", http_client=http)
            async with http, McpClient(transport, mode=mode) as tools:
                assert (tools.protocol_version == "2026-07-28") == (mode == "auto")
                result = await tools.call_tool(
                    "counter", {"label": "n"}, meta=fencegate.mcp_meta("same-slot")
                )
                assert (text(result), replayed(result)) == (count, False)
        effects = await client.list_effects(task_id="job-2")
        assert sorted((e["node"], e["slot"]) for e in effects) == [
            ("billing", "same-slot"),
            ("refunds", "same-slot"),
        ]


# --- docs/sdk.md ----------------------------------------------------------------------------------


def doc_block(section: str, language: str, starts: str) -> str:
    doc = SDK_DOC.read_text()
    body = doc[doc.index(section) :]
    body = body[: body.index("\n## ", 1)]
    for block in re.findall(rf"```{language}\n(.*?)```", body, re.DOTALL):
        if block.startswith(starts):
            return str(block)
    raise AssertionError(f"{section}: no {language} block starting {starts!r}")


def start_tools(directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    """The doc's ``tools.py`` on ``TOOLS_PORT=0``: uvicorn binds a port the system picks and
    says which in its "running on" line, read back here (no port is picked first and bound
    later, when another program may have taken it)."""
    log = directory / "tools.log"
    with log.open("wb") as out:
        tools = subprocess.Popen(
            [sys.executable, "tools.py"], cwd=directory,
            env={**os.environ, "TOOLS_PORT": "0", "PYTHONUNBUFFERED": "1"},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        text = log.read_text(errors="replace")
        bound = re.search(r"running on http://127\.0\.0\.1:(\d+)", text, re.IGNORECASE)
        if bound is not None:
            return tools, int(bound[1])
        if tools.poll() is not None:
            raise AssertionError(f"tools.py exited with {tools.returncode}:\n{text}")
        if time.monotonic() > deadline:
            tools.kill()
            raise AssertionError(f"tools.py never said it listens:\n{text}")
        time.sleep(0.05)


def readme_principals() -> list[tuple[str, str, str]]:
    """The README's ``fencegate token new`` lines: each principal's name, its one role, and the
    variable the README exports its token in."""
    readme = (REPO / "README.md").read_text()
    found = re.findall(
        r"^fencegate token new --name (\S+) --role (\S+) >> fencegate\.toml +# export (\w+)=",
        readme, re.MULTILINE,
    )  # fmt: skip
    assert found, "the README makes no tokens"
    return [(name, role, variable) for name, role, variable in found]


def test_the_docs_mcp_example_says_what_to_install() -> None:
    """The install line of docs/sdk.md's MCP section is the range the test extra pins, the one
    these tests run the example with."""
    with open(REPO / "pyproject.toml", "rb") as file:
        extra = tomllib.load(file)["project"]["optional-dependencies"]["test"]
    (pinned,) = [spec for spec in extra if re.match(r"mcp\b", spec)]
    section = "## MCP tools through the gateway"
    assert doc_block(section, "sh", "pip install") == f"pip install '{pinned}'\n"


@pytest.mark.parametrize("with_auth", [False, True], ids=["without-auth", "role-per-token"])
async def test_the_docs_mcp_example_runs(tmp_path: Path, with_auth: bool) -> None:
    """docs/sdk.md's MCP section as a user runs it: its config, its stand-in MCP server and its
    agent (as scripts, the agent twice). Without ``[auth]`` the token variables are unset; with
    it, the README's principals, each token holding one role in the variable the README
    exports it in."""
    tokens: dict[str, str] = {}
    auth = None
    if with_auth:
        principals = []
        for name, role, variable in readme_principals():
            tokens[variable] = f"tok-{name}-{os.urandom(8).hex()}"
            principals.append(
                {"name": name, "roles": [role], "token_sha256": token_sha256(tokens[variable])}
            )
        assert sorted(p["roles"][0] for p in principals) == ["operator", "scheduler", "worker"]
        auth = {"principals": principals}
    section = "## MCP tools through the gateway"
    (downstream,) = tomllib.loads(doc_block(section, "toml", "[[downstreams]]"))["downstreams"]
    (tmp_path / "tools.py").write_text(doc_block(section, "python", '"""tools.py'))
    (tmp_path / "agent.py").write_text(doc_block(section, "python", '"""agent.py'))
    assert downstream["url"] == "http://127.0.0.1:9100/mcp"
    tools, tools_port = start_tools(tmp_path)
    downstream["url"] = f"http://127.0.0.1:{tools_port}/mcp"
    unset = {"FENCEGATE_TOKEN", *(variable for _, _, variable in readme_principals())}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env = {**env, "TOOLS_PORT": str(tools_port), **tokens}
    outputs = []
    try:
        async with gateway(tmp_path, [downstream], auth) as url:
            for _ in range(2):
                agent = await asyncio.create_subprocess_exec(
                    sys.executable, "agent.py", cwd=tmp_path, env={**env, "FENCEGATE_URL": url},
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                out, err = await asyncio.wait_for(agent.communicate(), timeout=60)
                assert agent.returncode == 0, err.decode()
                outputs.append(out.decode())
    finally:
        tools.terminate()
        tools.wait(timeout=10)
    first, second = outputs
    assert first.splitlines()[:3] == [
        "charged: charged acct-7 4200 (run 1) replayed: False",
        "retried: charged acct-7 4200 (run 1) replayed: True",
        "refused: -32000 PAYLOAD_CONFLICT",
    ], first
    assert re.search(r"^committed: [0-9a-f]{32}$", first, re.MULTILINE), first
    assert "effect: charge-1 COMMITTED /tools/call/charge" in first
    assert second.splitlines() == [
        "invoice-43 already has its commit",
        "effect: charge-1 COMMITTED /tools/call/charge",
    ], second
