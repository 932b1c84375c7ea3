"""MCP sessions bound to the principal that opened them (issue 25, "Sessions").

With ``[auth]`` an agent gets ``<mac>.<server's id>`` (``gateway/mcp_sessions.py``); another
principal presenting it (or the server's bare id) is answered 404, as an unknown session, and
nothing of it reaches the server. What the server got is recorded by a relay in front of the
real MCP server (``tests/mcp_server.py``), never taken from the gateway.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.mcp_sessions import SECRET_ENV, SessionIds, secret_problem, session_key
from tests.conftest import build_test_store, make_config
from tests.mcp_server import McpServerProcess
from tests.servers import GatewayProcess, RedisServer
from tests.test_workers import start, started, workers_that_served, write_config

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

__all__ = ["started"]  # a fixture of tests/test_workers.py, used here

DOWNSTREAM = "tools"
TOKENS = {"agent-a": "tok-agent-a-0123456789abcdef", "agent-b": "tok-agent-b-0123456789abcdef"}
AUTH = {
    "principals": [
        {"name": name, "roles": ["scheduler", "worker"], "token_sha256": token_sha256(token)}
        for name, token in TOKENS.items()
    ]
}
SECRET = "a-shared-session-secret-of-32-characters-or-more"
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
VERSION = "2025-11-25"


# --- the pure part ------------------------------------------------------------------------------


def test_a_wrapped_id_unwraps_only_for_its_principal_downstream_and_key() -> None:
    ids = SessionIds(b"k" * 32)
    wrapped = ids.wrap("agent-a", "tools", "srv-1")
    mac, _, server_id = wrapped.partition(".")
    assert server_id == "srv-1" and len(mac) == 43
    assert ids.unwrap("agent-a", "tools", wrapped) == "srv-1"
    assert SessionIds(b"k" * 32).unwrap("agent-a", "tools", wrapped) == "srv-1"
    assert ids.unwrap("agent-b", "tools", wrapped) is None
    assert ids.unwrap("agent-a", "other", wrapped) is None
    assert SessionIds(b"x" * 32).unwrap("agent-a", "tools", wrapped) is None
    for forged in ("srv-1", f".{server_id}", f"{mac}.", f"{mac}.srv-2", f"{mac[:-1]}é.srv-1"):
        assert ids.unwrap("agent-a", "tools", forged) is None
    # A server id with dots in it survives the round trip.
    assert ids.unwrap("agent-a", "tools", ids.wrap("agent-a", "tools", "a.b.c")) == "a.b.c"


def test_the_key_comes_from_the_environment_or_is_this_processes_own() -> None:
    one, shared = session_key({SECRET_ENV: SECRET})
    assert shared and one == session_key({SECRET_ENV: SECRET})[0]
    own, shared = session_key({})
    assert not shared and own != session_key({})[0]
    assert secret_problem({SECRET_ENV: "short"}) is not None
    with pytest.raises(ValueError, match=SECRET_ENV):
        session_key({SECRET_ENV: "short"})


# --- end to end ---------------------------------------------------------------------------------


@dataclass
class Seen:
    """One request the MCP server got: its method, session id and JSON-RPC method."""

    method: str
    session: str | None
    rpc: str | None


@dataclass
class Relay:
    """A pass-through in front of the MCP server that records every request it forwards."""

    target: str
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rpc = None
        if body:
            with contextlib.suppress(ValueError, AttributeError):
                rpc = json.loads(body).get("method")
        self.seen.append(Seen(request.method, request.headers.get("Mcp-Session-Id"), rpc))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with (
            aiohttp.ClientSession(auto_decompress=False) as http,
            http.request(request.method, self.target, data=body, headers=headers) as resp,
        ):
            answer = web.StreamResponse(status=resp.status)
            for name in ("Content-Type", "Mcp-Session-Id", "Cache-Control"):
                if name in resp.headers:
                    answer.headers[name] = resp.headers[name]
            await answer.prepare(request)
            with contextlib.suppress(ConnectionResetError):
                async for chunk in resp.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
            return answer


@pytest.fixture(scope="module")
def mcp_process() -> Iterator[McpServerProcess]:
    with McpServerProcess() as server:
        yield server


@pytest.fixture
async def relay(mcp_process: McpServerProcess) -> AsyncIterator[Relay]:
    mcp_process.reset()
    recorder = Relay(mcp_process.url)
    app = web.Application()
    app.router.add_route("*", "/mcp", recorder.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    recorder.url = str(server.make_url("/mcp"))
    try:
        yield recorder
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def gateway(db: Path, relay: Relay, auth: bool = True) -> AsyncIterator[str]:
    """An in-process gateway on its own SQLite file, with the relay as MCP downstream."""
    sections: dict[str, Any] = {"auth": AUTH} if auth else {}
    config = make_config(
        f"sqlite:///{db}",
        downstreams=[{"name": DOWNSTREAM, "url": relay.url, "adapter": "mcp",
                      "timeout_ms": 10_000}],
        **sections,
    )  # fmt: skip
    server = TestServer(create_app(config, store=build_test_store(config)), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def bearer(who: str) -> dict[str, str]:
    return {"Fence-Authorization": f"Bearer {TOKENS[who]}"}


async def lease(http: aiohttp.ClientSession, base: str, who: str) -> dict[str, str]:
    """A task of ``who``'s own, claimed by ``who``: its Fence-* headers."""
    task = f"t-{who}"
    async with http.put(f"{base}/v1/tasks/{task}", json={"inputDigest": "i"},
                        headers=bearer(who)) as resp:  # fmt: skip
        assert resp.status in (200, 201), await resp.text()
    async with http.get(f"{base}/v1/epoch", headers=bearer(who)) as resp:
        epoch = (await resp.json())["schedulerEpoch"]
    body = {"owner": who, "ttlMs": 60_000, "schedulerEpoch": epoch}
    async with http.post(f"{base}/v1/tasks/{task}/claim", json=body,
                         headers=bearer(who)) as resp:  # fmt: skip
        claim = await resp.json()
        assert resp.status == 200, claim
    return {
        "Fence-Task": task,
        "Fence-Attempt": claim["attemptId"],
        "Fence-Generation": str(claim["claimGeneration"]),
        "Fence-Epoch": str(claim["schedulerEpoch"]),
        "Fence-Cancel": str(claim["cancelGeneration"]),
    }


def answer_of(raw: bytes) -> dict[str, Any]:
    """The JSON-RPC answer in a JSON body or an SSE stream."""
    text = raw.decode().replace("\r\n", "\n")
    if text.lstrip().startswith("{"):
        answer: dict[str, Any] = json.loads(text)
        return answer
    for event in text.split("\n\n"):
        data = [line[5:].strip() for line in event.split("\n") if line.startswith("data:")]
        if data and data[0]:
            found: dict[str, Any] = json.loads("\n".join(data))
            if "id" in found:
                return found
    raise AssertionError(text)


async def initialize(http: aiohttp.ClientSession, base: str, who: str) -> str:
    """Open a handshake-era session as ``who``: the Mcp-Session-Id the agent is given."""
    message = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": VERSION, "capabilities": {},
        "clientInfo": {"name": who, "version": "0"}}}  # fmt: skip
    async with http.post(f"{base}/mcp/{DOWNSTREAM}", json=message,
                         headers={**ACCEPT, **bearer(who)}) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
        session = resp.headers["Mcp-Session-Id"]
        await resp.read()
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    async with http.post(f"{base}/mcp/{DOWNSTREAM}", json=note,
                         headers=in_session(who, session)) as resp:  # fmt: skip
        assert resp.status == 202, await resp.text()
    return session


def in_session(who: str, session: str, fence: dict[str, str] | None = None) -> dict[str, str]:
    return {**ACCEPT, **bearer(who), **(fence or {}), "Mcp-Session-Id": session,
            "MCP-Protocol-Version": VERSION}  # fmt: skip


async def call(
    http: aiohttp.ClientSession, base: str, headers: dict[str, str], label: str, rpc_id: int
) -> tuple[int, bytes]:
    message = {"jsonrpc": "2.0", "id": rpc_id, "method": "tools/call",
               "params": {"name": "counter", "arguments": {"label": label}}}  # fmt: skip
    async with http.post(f"{base}/mcp/{DOWNSTREAM}", json=message, headers=headers) as resp:
        return resp.status, await resp.read()


async def test_another_principal_cannot_use_a_session_and_the_server_never_hears_of_it(
    tmp_path: Path, relay: Relay, mcp_process: McpServerProcess
) -> None:
    """B presenting A's session id, wrapped or bare, is 404 on POST, GET and DELETE; none of
    it reaches the server, and A's session goes on (B's DELETE did not end it)."""
    async with gateway(tmp_path / "gw.db", relay) as base, aiohttp.ClientSession() as http:
        fence_a = await lease(http, base, "agent-a")
        fence_b = await lease(http, base, "agent-b")
        session = await initialize(http, base, "agent-a")
        mac, _, server_id = session.partition(".")
        assert len(mac) == 43 and server_id
        # The server got and gave its own id; the agent never sees it bare.
        assert relay.seen[-1] == Seen("POST", server_id, "notifications/initialized")
        status, raw = await call(http, base, in_session("agent-a", session, fence_a), "a", 2)
        assert status == 200 and answer_of(raw)["result"]["isError"] is False, raw

        heard = len(relay.seen)
        url = f"{base}/mcp/{DOWNSTREAM}"
        with capture_logs() as logs:
            for presented in (session, server_id):
                headers = in_session("agent-b", presented, fence_b)
                status, raw = await call(http, base, headers, "b", 3)
                assert status == 404 and answer_of(raw)["error"]["message"] == "Session not found"
                async with http.get(url, headers=headers) as resp:
                    assert resp.status == 404, await resp.text()
                async with http.delete(url, headers=headers) as resp:
                    assert resp.status == 404, await resp.text()
        assert len(relay.seen) == heard, relay.seen[heard:]
        assert [run["args"] for run in mcp_process.executions()["counter"]] == [{"label": "a"}]
        mismatches = [e for e in logs if e["event"] == "auth.session_mismatch"]
        assert len(mismatches) == 6
        assert {(e["principal"], e["downstream"]) for e in mismatches} == {("agent-b", "tools")}
        assert not any(server_id in repr(e) or TOKENS["agent-b"] in repr(e) for e in logs)

        # A's session is alive and still A's: a call, its stream, its end.
        status, raw = await call(http, base, in_session("agent-a", session, fence_a), "a2", 4)
        assert status == 200 and "error" not in answer_of(raw), raw
        async with http.get(url, headers=in_session("agent-a", session, fence_a)) as resp:
            assert resp.status == 200, await resp.text()
        async with http.delete(url, headers=in_session("agent-a", session, fence_a)) as resp:
            assert resp.status == 200, await resp.text()
        assert [s.session for s in relay.seen[heard:]] == [server_id] * 3
        assert [run["args"] for run in mcp_process.executions()["counter"]] == [
            {"label": "a"},
            {"label": "a2"},
        ]


async def test_gateways_sharing_the_secret_accept_each_others_session_ids(
    tmp_path: Path, relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any gateway checks a session id without store state: one with the same
    ``FENCEGATE_SESSION_SECRET`` takes it, one with another secret answers 404."""
    ping = {"jsonrpc": "2.0", "id": 7, "method": "ping"}
    monkeypatch.setenv(SECRET_ENV, SECRET)
    async with (
        gateway(tmp_path / "one.db", relay) as one,
        gateway(tmp_path / "two.db", relay) as two,
        aiohttp.ClientSession() as http,
    ):
        monkeypatch.setenv(SECRET_ENV, "another-secret-of-at-least-32-characters!!")
        async with gateway(tmp_path / "three.db", relay) as three:
            session = await initialize(http, one, "agent-a")
            headers = in_session("agent-a", session)
            async with http.post(f"{two}/mcp/{DOWNSTREAM}", json=ping, headers=headers) as resp:
                assert resp.status == 200 and answer_of(await resp.read())["result"] == {}
            async with http.post(f"{three}/mcp/{DOWNSTREAM}", json=ping, headers=headers) as resp:
                assert resp.status == 404, await resp.text()
            async with http.delete(f"{two}/mcp/{DOWNSTREAM}", headers=headers) as resp:
                assert resp.status == 200, await resp.text()


async def test_without_auth_session_ids_are_relayed_unchanged(tmp_path: Path, relay: Relay) -> None:
    async with (
        gateway(tmp_path / "gw.db", relay, auth=False) as base,
        aiohttp.ClientSession() as http,
    ):
        message = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": VERSION, "capabilities": {},
            "clientInfo": {"name": "anon", "version": "0"}}}  # fmt: skip
        async with http.post(f"{base}/mcp/{DOWNSTREAM}", json=message, headers=ACCEPT) as resp:
            session = resp.headers["Mcp-Session-Id"]
            await resp.read()
        async with http.delete(f"{base}/mcp/{DOWNSTREAM}",
                               headers={**ACCEPT, "Mcp-Session-Id": session}) as resp:  # fmt: skip
            assert resp.status == 200
        assert "." not in session
        assert relay.seen[-1] == Seen("DELETE", session, None)


# --- serve: --check and --workers -----------------------------------------------------------------


def principals_toml() -> str:
    return "".join(
        f'\n[[auth.principals]]\nname = "{name}"\nroles = ["scheduler", "worker"]\n'
        f'token_sha256 = "{token_sha256(token)}"\n'
        for name, token in TOKENS.items()
    )


def test_check_warns_that_sessions_are_this_processes_own_without_the_secret(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fencegate.toml"
    path.write_text(
        f'[store]\nurl = "sqlite:///{tmp_path / "fg.db"}"\n'
        f'\n[[downstreams]]\nname = "tools"\nurl = "http://127.0.0.1:9/mcp"\nadapter = "mcp"\n'
        + principals_toml()
    )
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}

    def check(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--check", "--config",
             str(path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, env={**env, **extra},
        )  # fmt: skip

    done = check()
    assert done.returncode == 0, done.stderr
    warning = f"warning: {SECRET_ENV} is not set"
    assert warning in done.stdout and "will not survive a restart" in done.stdout, done.stdout
    done = check(**{SECRET_ENV: SECRET})
    assert done.returncode == 0 and warning not in done.stdout, done.stdout
    done = check(**{SECRET_ENV: "short"})
    assert done.returncode == 2, done
    assert f"{SECRET_ENV}: at least 32 characters" in done.stderr, done.stderr
    assert "short" not in done.stderr.replace(f"{SECRET_ENV}: at least", "")


async def test_every_worker_accepts_a_session_opened_on_another_without_the_secret(
    tmp_path: Path,
    redis_server: RedisServer,
    key_prefix: str,
    started: list[GatewayProcess],
    mcp_process: McpServerProcess,
) -> None:
    """No FENCEGATE_SESSION_SECRET: the supervisor draws one key for all its workers, so a
    session opened through one worker goes on through the other."""
    downstream = (
        f'\n[[downstreams]]\nname = "{DOWNSTREAM}"\nurl = "{mcp_process.url}"\nadapter = "mcp"\n'
    )
    config = write_config(
        tmp_path / "g", redis_server.url, key_prefix=key_prefix, auth=downstream + principals_toml()
    )
    config.env.pop(SECRET_ENV, None)
    gateway = start(started, config)
    connector = aiohttp.TCPConnector(force_close=True)  # each request: a new connection
    async with aiohttp.ClientSession(connector=connector) as http:
        session = await initialize(http, gateway.url, "agent-a")
        ping = {"jsonrpc": "2.0", "id": 9, "method": "ping"}
        for _ in range(12):
            async with http.post(f"{gateway.url}/mcp/{DOWNSTREAM}", json=ping,
                                 headers=in_session("agent-a", session)) as resp:  # fmt: skip
                assert resp.status == 200, await resp.text()
        async with http.delete(f"{gateway.url}/mcp/{DOWNSTREAM}",
                               headers=in_session("agent-a", session)) as resp:  # fmt: skip
            assert resp.status == 200, await resp.text()
    assert workers_that_served(gateway.log_events(), f"/mcp/{DOWNSTREAM}") == {0, 1}
