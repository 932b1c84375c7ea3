"""MCP ``GET`` streams end with their lease and their principal, and never hold the whole
pool (issue 25, "Streams"): a real MCP server (``tests/mcp_server.py``), an in-process
gateway with ``[auth]``, the reload SIGHUP runs (``cli.reload_auth``).

Nothing races the wall clock: each test waits for the stream to end (its body read to the
end) within a generous bound; the gateway re-checks a lease every ``LEASE_CHECK_S``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.cli import reload_auth
from fencegate.gateway.mcp_streams import STREAMS
from fencegate.ledger.store import Store
from tests.conftest import build_test_store, make_config
from tests.mcp_server import McpServerProcess
from tests.test_mcp_sessions import TOKENS, answer_of, bearer, in_session, initialize

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

DOWNSTREAM = "tools"
OPERATOR = "tok-operator-0123456789abcdef"
BOUND_S = 10.0


def principals_toml(names: tuple[str, ...] = ("agent-a", "agent-b")) -> str:
    out = "[auth]\n"
    for name in names:
        out += (f'[[auth.principals]]\nname = "{name}"\nroles = ["scheduler", "worker"]\n'
                f'token_sha256 = "{token_sha256(TOKENS[name])}"\n')  # fmt: skip
    return (
        out + f'[[auth.principals]]\nname = "op"\nroles = ["operator"]\n'
        f'token_sha256 = "{token_sha256(OPERATOR)}"\n'
    )


@pytest.fixture(scope="module")
def mcp_process() -> Iterator[McpServerProcess]:
    with McpServerProcess() as server:
        yield server


@dataclass
class Env:
    app: web.Application
    base: str
    http: aiohttp.ClientSession
    config_path: Path
    store: Store

    async def lease(self, who: str, task: str, ttl_ms: int = 60_000) -> dict[str, str]:
        async with self.http.put(f"{self.base}/v1/tasks/{task}", json={"inputDigest": "i"},
                                 headers=bearer(who)) as resp:  # fmt: skip
            assert resp.status in (200, 201), await resp.text()
        async with self.http.get(f"{self.base}/v1/epoch", headers=bearer(who)) as resp:
            epoch = (await resp.json())["schedulerEpoch"]
        body = {"owner": who, "ttlMs": ttl_ms, "schedulerEpoch": epoch}
        async with self.http.post(f"{self.base}/v1/tasks/{task}/claim", json=body,
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

    async def stream(self, who: str, fence: dict[str, str]) -> aiohttp.ClientResponse:
        """A new session of ``who`` and its GET stream, open (200)."""
        session = await initialize(self.http, self.base, who)
        resp = await self.http.get(f"{self.base}/mcp/{DOWNSTREAM}",
                                   headers=in_session(who, session, fence))  # fmt: skip
        assert resp.status == 200, await resp.text()
        return resp


@pytest.fixture
async def env(tmp_path: Path, mcp_process: McpServerProcess) -> AsyncIterator[Env]:
    mcp_process.reset()
    config = make_config(
        f"sqlite:///{tmp_path / 'fg.db'}",
        auth={"principals": [
            {"name": n, "roles": ["scheduler", "worker"], "token_sha256": token_sha256(t)}
            for n, t in TOKENS.items()
        ] + [{"name": "op", "roles": ["operator"], "token_sha256": token_sha256(OPERATOR)}]},
        reconciler={"enabled": False},
        proxy={"max_connections": 4},
        downstreams=[{"name": DOWNSTREAM, "url": mcp_process.url, "adapter": "mcp",
                      "timeout_ms": 10_000}],
    )  # fmt: skip
    path = tmp_path / "fencegate.toml"
    path.write_text(principals_toml())
    store = build_test_store(config)
    server = TestServer(create_app(config, store=store), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            yield Env(server.app, str(server.make_url("")).rstrip("/"), http, path, store)
    finally:
        await server.close()


async def ended(resp: aiohttp.ClientResponse) -> None:
    """Read the stream to its end (the gateway ended it), within the bound."""
    async with asyncio.timeout(BOUND_S):
        await resp.content.read()
    assert resp.content.at_eof()
    resp.close()


@pytest.mark.parametrize("how", ["epoch bump", "cancel", "expiry"])
async def test_a_stream_ends_when_its_lease_does(env: Env, how: str) -> None:
    fence = await env.lease("agent-a", f"s-{how.replace(' ', '-')}", ttl_ms=60_000)
    resp = await env.stream("agent-a", fence)
    with capture_logs() as logs:
        if how == "expiry":  # the store's clock moves past the lease, not the test's
            env.store.clock_offset_ms += 61_000
        elif how == "epoch bump":
            headers = {"Authorization": f"Bearer {OPERATOR}"}
            async with env.http.post(f"{env.base}/v1/epoch/bump", headers=headers) as done:
                assert done.status == 200
        elif how == "cancel":
            async with env.http.post(f"{env.base}/v1/tasks/{fence['Fence-Task']}/cancel",
                                     headers=bearer("agent-a")) as done:  # fmt: skip
                assert done.status == 200
        await ended(resp)
    reasons = [e["reason"] for e in logs if e["event"] == "mcp.stream_ended"]
    expected = {"epoch bump": "STALE_EPOCH", "cancel": "CANCELLED", "expiry": "LEASE_EXPIRED"}
    assert reasons == [expected[how]], logs
    assert env.app[STREAMS].count == 0


async def test_the_reload_that_removes_its_principal_ends_a_stream(env: Env) -> None:
    resp_a = await env.stream("agent-a", await env.lease("agent-a", "r-a"))
    resp_b = await env.stream("agent-b", await env.lease("agent-b", "r-b"))
    env.config_path.write_text(principals_toml(("agent-b",)))
    with capture_logs() as logs:
        assert reload_auth(env.app, str(env.config_path))
        await ended(resp_a)
    assert [(e["principal"], e["reason"]) for e in logs if e["event"] == "mcp.stream_ended"] == [
        ("agent-a", "reload")
    ]
    assert not resp_b.content.at_eof() and env.app[STREAMS].count == 1
    resp_b.close()


async def test_streams_hold_at_most_their_share_of_the_pool(env: Env) -> None:
    """``proxy.max_connections = 4``: at most 2 streams; the third is 503 DOWNSTREAM_BUSY
    with Retry-After and never reaches the server, and calls still go through."""
    fence = await env.lease("agent-a", "p-1")
    # One each: a principal holds at most half of the places (max_streams_per_principal).
    streams = [await env.stream("agent-b", await env.lease("agent-b", "p-2")),
               await env.stream("agent-a", fence)]  # fmt: skip
    session = await initialize(env.http, env.base, "agent-a")
    headers = in_session("agent-a", session, fence)
    async with env.http.get(f"{env.base}/mcp/{DOWNSTREAM}", headers=headers) as resp:
        assert resp.status == 503, await resp.text()
        assert resp.headers["Retry-After"] == "1"
        error = answer_of(await resp.read())["error"]
        assert error["data"]["code"] == "DOWNSTREAM_BUSY", error
        assert "proxy.max_stream_connections = 2" in error["data"]["detail"], error
    message = {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
               "params": {"name": "counter", "arguments": {"label": "busy"}}}  # fmt: skip
    async with env.http.post(f"{env.base}/mcp/{DOWNSTREAM}", json=message,
                             headers=headers) as resp:  # fmt: skip
        assert resp.status == 200 and "result" in answer_of(await resp.read())
    streams.pop().close()  # agent-a's
    async with asyncio.timeout(BOUND_S):
        while env.app[STREAMS].count > 1:
            await asyncio.sleep(0.01)
    async with env.http.get(f"{env.base}/mcp/{DOWNSTREAM}", headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    for stream in streams:
        stream.close()


def test_the_stream_limit_defaults_to_half_the_pool_and_never_exceeds_it() -> None:
    from fencegate.gateway.config import ProxyConfig

    assert ProxyConfig().stream_limit == 100
    assert ProxyConfig(max_connections=1).stream_limit == 1
    assert ProxyConfig(max_connections=10, max_stream_connections=10).stream_limit == 10
    with pytest.raises(ValueError, match="max_stream_connections"):
        ProxyConfig(max_connections=10, max_stream_connections=11)
    assert ProxyConfig().principal_stream_limit == 50
    assert ProxyConfig(max_connections=2).principal_stream_limit == 1
    with pytest.raises(ValueError, match="max_streams_per_principal"):
        ProxyConfig(max_connections=10, max_streams_per_principal=6)


async def test_one_principal_cannot_take_every_stream_place(env: Env) -> None:
    """``proxy.max_connections = 4``: 2 stream places, at most 1 per principal (the default,
    half). agent-a's second stream is 503 and never reaches the server; agent-b still gets
    the other place (before: agent-a took both and agent-b got 503)."""
    first = await env.stream("agent-a", await env.lease("agent-a", "q-1"))
    fence = await env.lease("agent-a", "q-2")
    session = await initialize(env.http, env.base, "agent-a")
    with capture_logs() as logs:
        async with env.http.get(f"{env.base}/mcp/{DOWNSTREAM}",
                                headers=in_session("agent-a", session, fence)) as resp:  # fmt: skip
            assert resp.status == 503, await resp.text()
            assert resp.headers["Retry-After"] == "1"
            error = answer_of(await resp.read())["error"]
    assert error["data"]["code"] == "DOWNSTREAM_BUSY", error
    assert "proxy.max_streams_per_principal = 1" in error["data"]["detail"], error
    assert [e["principal"] for e in logs if e["event"] == "mcp.stream_refused"] == ["agent-a"]
    assert env.app[STREAMS].count == 1
    other = await env.stream("agent-b", await env.lease("agent-b", "q-3"))
    assert env.app[STREAMS].count == 2
    first.close()
    other.close()
