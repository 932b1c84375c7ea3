"""Safe by default (issue 11, item 3): what the gateway refuses before any handler runs.

Browser attacks (a page posting ``text/plain`` to ``/v1/epoch/bump``, DNS rebinding) and the
start-up rules (no non-loopback listener without ``[auth]`` unless the config says so). The
refusals are the same with and without ``[auth]`` (gateway/request_guard.py); nothing here
touches a store's rules, so one store (SQLite) is enough.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config, ConfigError, load_config, with_listen
from fencegate.gateway.request_guard import host_allowed, origin_allowed
from tests.api import HANG_S
from tests.conftest import build_test_store, make_config


async def _client(tmp_path: Path, **server: object) -> TestClient[Any, Any]:
    config = make_config(f"sqlite:///{tmp_path / 'guard.db'}", server=server)
    app = create_app(config, store=build_test_store(config))
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    test_client = await _client(tmp_path)
    yield test_client
    await test_client.close()


async def _epoch(client: TestClient[Any, Any]) -> int:
    async with client.get("/v1/epoch") as resp:
        assert resp.status == 200
        return int((await resp.json())["schedulerEpoch"])


async def _problem(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/problem+json"
    body: dict[str, Any] = await resp.json()
    assert body["code"] == code and body["status"] == status
    return body


async def raw(port: int, data: bytes, *, wait: float = HANG_S) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` as is over a new connection; the status, headers and body of the answer
    (``wait`` bounds a hang only)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(length), wait)
        return int(lines[0].split()[1]), headers, body
    finally:
        writer.close()


# --- CSRF: media type and Origin ----------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ],
)
async def test_a_non_json_body_on_v1_is_415_and_does_nothing(
    client: TestClient[Any, Any], content_type: str | None
) -> None:
    before = await _epoch(client)
    headers = {"Content-Type": content_type} if content_type else {}
    skip = () if content_type else ("Content-Type",)
    async with client.post(
        "/v1/epoch/bump", data=b"{}", headers=headers, skip_auto_headers=skip
    ) as resp:
        await _problem(resp, 415, "UNSUPPORTED_MEDIA_TYPE")
    assert await _epoch(client) == before


@pytest.mark.parametrize("content_type", ["application/json", "application/merge-patch+json"])
async def test_json_bodies_and_empty_bodies_pass(
    client: TestClient[Any, Any], content_type: str
) -> None:
    before = await _epoch(client)
    async with client.post(
        "/v1/epoch/bump", data=b"{}", headers={"Content-Type": content_type}
    ) as resp:
        assert resp.status == 200
    async with client.post("/v1/epoch/bump", skip_auto_headers=("Content-Type",)) as resp:
        assert resp.status == 200  # no body: no type needed
    assert await _epoch(client) == before + 2


async def test_proxy_bodies_are_not_checked(client: TestClient[Any, Any]) -> None:
    async with client.post(
        "/proxy/nowhere/x", data=b"a=1", headers={"Content-Type": "text/plain"}
    ) as resp:
        assert resp.status != 415  # refused by the proxy for its own reasons, if at all


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1", "x"]
)
async def test_a_foreign_origin_is_403_even_with_a_json_body(
    client: TestClient[Any, Any], origin: str
) -> None:
    before = await _epoch(client)
    async with client.post("/v1/epoch/bump", json={}, headers={"Origin": origin}) as resp:
        body = await _problem(resp, 403, "FORBIDDEN")
        assert "allowed_origins" in body["detail"]
    async with client.get("/v1/effects", headers={"Origin": origin}) as resp:
        await _problem(resp, 403, "FORBIDDEN")  # reads too: answers must not leak to a page
    assert await _epoch(client) == before


async def test_the_gateways_own_origins_pass(client: TestClient[Any, Any]) -> None:
    port = client.server.port
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"):
        async with client.get("/v1/epoch", headers={"Origin": origin}) as resp:
            assert resp.status == 200, origin


async def test_configured_origins_replace_the_defaults(tmp_path: Path) -> None:
    client = await _client(tmp_path, allowed_origins=["https://console.example"])
    try:
        async with client.get("/v1/epoch", headers={"Origin": "https://console.example"}) as resp:
            assert resp.status == 200
        own = f"http://127.0.0.1:{client.server.port}"
        async with client.get("/v1/epoch", headers={"Origin": own}) as resp:
            await _problem(resp, 403, "FORBIDDEN")
    finally:
        await client.close()


# --- DNS rebinding: Host ------------------------------------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8700", "127.0.0.1.nip.io", "[::2]"])
async def test_a_foreign_host_is_421(client: TestClient[Any, Any], host: str) -> None:
    before = await _epoch(client)
    async with client.post("/v1/epoch/bump", json={}, headers={"Host": host}) as resp:
        body = await _problem(resp, 421, "MISDIRECTED_REQUEST")
        assert "allowed_hosts" in body["detail"]
    assert await _epoch(client) == before


async def test_loopback_names_pass_on_any_port_and_health_on_any_host(
    client: TestClient[Any, Any],
) -> None:
    for host in ("127.0.0.1", "localhost:1234", "LOCALHOST", "[::1]:8700", "127.0.0.1:9"):
        async with client.get("/v1/epoch", headers={"Host": host}) as resp:
            assert resp.status == 200, host
    for path in ("/healthz", "/readyz"):
        async with client.get(path, headers={"Host": "10.1.2.3:8700"}) as resp:
            assert resp.status == 200, path
    async with client.get("/metrics", headers={"Host": "10.1.2.3:8700"}) as resp:
        assert resp.status == 421


async def test_a_request_without_host_is_refused(client: TestClient[Any, Any]) -> None:
    status, _, body = await raw(client.server.port, b"GET /v1/epoch HTTP/1.0\r\n\r\n")
    assert status == 421
    assert json.loads(body)["detail"] == "GET /v1/epoch: a Host header is required"


def test_host_and_origin_rules() -> None:
    default = Config().server
    assert host_allowed(default, "127.0.0.1:8700") and host_allowed(default, "[::1]")
    assert not host_allowed(default, "localhost.:8700")
    assert not host_allowed(default, "127.0.0.1:87000") and not host_allowed(default, None)
    explicit = make_config("sqlite:///x.db", server={"allowed_hosts": ["GW.example:8700", "gw"]})
    server = explicit.server
    assert host_allowed(server, "gw.example:8700") and not host_allowed(server, "gw.example:1")
    assert host_allowed(server, "gw:1") and not host_allowed(server, "127.0.0.1:8700")
    assert origin_allowed(default, "http://localhost:8700")
    assert origin_allowed(default, "http://localhost:5555", local_port=5555)
    assert not origin_allowed(default, "http://localhost:5555", local_port=8700)
    assert not origin_allowed(default, "http://localhost:8700/path")
    assert not origin_allowed(default, "http://user@localhost:8700")


# --- parser-level and method refusals -----------------------------------------------------


async def test_limit_with_a_non_ascii_digit_is_400(client: TestClient[Any, Any]) -> None:
    for limit in ("%C2%B2", "%D9%A3", "1%C2%B2", "-1", "+5", " 5"):
        async with client.get(f"/v1/effects?limit={limit}") as resp:
            await _problem(resp, 400, "BAD_REQUEST")


async def test_connect_is_405_and_http2_request_line_is_505(client: TestClient[Any, Any]) -> None:
    port = client.server.port
    host = f"127.0.0.1:{port}"
    for target in (host, "/proxy/x/y", "/v1/epoch"):
        status, headers, body = await raw(
            port, f"CONNECT {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        )
        assert status == 405, target
        assert headers["content-type"] == "application/problem+json"
        assert json.loads(body)["code"] == "METHOD_NOT_ALLOWED"
    status, headers, body = await raw(
        port, f"GET /v1/epoch HTTP/2.0\r\nHost: {host}\r\n\r\n".encode()
    )
    assert status == 505 and json.loads(body)["code"] == "HTTP_VERSION_NOT_SUPPORTED"


# --- start-up: safe by default ------------------------------------------------------------


def _write(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "fencegate.toml"
    path.write_text(f'[server]\n{server}\n[store]\nurl = "sqlite:///x.db"\n')
    return path


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ('listen = "0.0.0.0:8700"\nallowed_hosts = ["gw.example"]', "server.listen (0.0.0.0:8700)"),
        ('listen = "[::]:8700"\nallowed_hosts = ["gw.example"]', "no [auth] section"),
        ('listen = "10.0.0.5:8700"\nallowed_hosts = ["gw"]', "allow_unauthenticated = true"),
        ('listen = "0.0.0.0:8700"\nallow_unauthenticated = true', "allowed_hosts is required"),
        ('allowed_hosts = ["gw.example/x"]', "server.allowed_hosts"),
        ('allowed_origins = ["http://a.example/path"]', "server.allowed_origins"),
        ("body_timeout_ms = 10", "server.body_timeout_ms"),
        ("max_connections = 0", "server.max_connections"),
    ],
)
def test_unsafe_or_wrong_server_configs_refuse_to_load(
    tmp_path: Path, server: str, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(_write(tmp_path, server))
    assert message in str(raised.value)


def test_beyond_loopback_loads_when_the_config_says_so(tmp_path: Path) -> None:
    for listen in ("127.0.0.1:8700", "localhost:8700", "[::1]:8700", "127.0.0.2:8700"):
        assert load_config(_write(tmp_path, f'listen = "{listen}"')).server.listen == listen
    config = load_config(
        _write(
            tmp_path,
            'listen = "0.0.0.0:8700"\nallow_unauthenticated = true\nallowed_hosts = ["gw"]',
        )
    )
    assert config.server.allowed_hosts == ("gw",)


def test_serve_listen_override_is_validated_like_the_file(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, 'listen = "127.0.0.1:8700"'))
    assert with_listen(config, "127.0.0.1:9999").server.listen == "127.0.0.1:9999"
    with pytest.raises(ConfigError, match="allowed_hosts is required"):
        with_listen(config, "0.0.0.0:8700")


# --- the operator CLI never prints raw control characters ---------------------------------

HOSTILE = "ok\x1b[2J\x1b]0;pwned\x07\r\nFAKE LINE\u202eevil\u200b\x00\x7f"


def test_cli_rendering_escapes_control_characters_from_the_store() -> None:
    from fencegate.gateway import ops_render

    effect = {
        "effectId": "e" * 64,
        "state": "UNKNOWN",
        "taskId": HOSTILE,
        "downstream": HOSTILE,
        "method": "POST",
        "path": "/x" + HOSTILE,
        "attempts": [{"attemptId": HOSTILE, "reason": HOSTILE, "approvedBy": HOSTILE}],
        "actions": [{"action": "resolve", "by": HOSTILE, "outcome": HOSTILE, "note": HOSTILE}],
        "approval": {"payloadDigest": "d", "by": HOSTILE},
        "response": {"status": 200, "source": HOSTILE, "bodyBase64": ""},
    }
    task = {"taskId": HOSTILE, "owner": HOSTILE, "attemptId": HOSTILE, "state": "CLAIMED"}
    outputs = [
        ops_render.effect(effect),
        ops_render.effects_table([effect]),
        ops_render.task(task),
        ops_render.resolved(HOSTILE, {"state": HOSTILE}),
        ops_render.approved(HOSTILE, {"downstream": HOSTILE, "approval": {"by": HOSTILE}}),
        ops_render.reconciled(HOSTILE, {"state": HOSTILE, "actions": []}),
    ]
    for text in outputs:
        lines = text.split("\n")  # the renderers' own line breaks only
        assert all(line.isprintable() for line in lines), text
        assert "FAKE LINE" not in [line.strip() for line in lines]
    assert "\\x1b[2J" in ops_render.task(task)
    assert ops_render.printable(HOSTILE).startswith("ok\\x1b[2J\\x1b]0;pwned\\x07\\r\\nFAKE")
    assert "\\u202e" in ops_render.printable(HOSTILE)
    assert ops_render.cell("plain text: ünïcode ok") == "plain text: ünïcode ok"
