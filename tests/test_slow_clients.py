"""Slow and broken clients (issue 11, item 5): bodies that stop arriving, bodies announced too
large, clients that go away, too many connections, malformed requests, and a log that stays
one JSON object per line through all of it.

The middleware's rules run against the in-process app; the connection-level ones (the limit,
parser errors, the idle timeout, stderr) need ``fencegate serve`` itself, so those tests run a
real gateway process and talk to it over raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from tests.api import HANG_S, until
from tests.conftest import build_test_store, make_config
from tests.servers import GatewayProcess

BODY_TIMEOUT_MS = 300
#: A body timeout far past anything the test waits: a test that must not meet the body
#: timeout uses it, so that a slow machine cannot turn its scenario into a 408.
NEVER_MS = 600_000


@contextlib.asynccontextmanager
async def gateway_client(
    tmp_path: Path, body_timeout_ms: int
) -> AsyncIterator[TestClient[Any, Any]]:
    config = make_config(
        f"sqlite:///{tmp_path / 'slow.db'}",
        server={"body_timeout_ms": body_timeout_ms, "max_body_bytes": 4096},
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as test_client:
        yield test_client


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    async with gateway_client(tmp_path, BODY_TIMEOUT_MS) as test_client:
        yield test_client


@pytest.fixture
async def patient_client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    """The gateway with a body timeout of ``NEVER_MS``."""
    async with gateway_client(tmp_path, NEVER_MS) as test_client:
        yield test_client


def _head(path: str, port: int, length: int, method: str = "POST") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


async def _exchange(
    port: int, data: bytes, wait: float = HANG_S
) -> tuple[int, dict[str, str], bytes]:
    """Send ``data``, then read one answer (its head and Content-Length bytes of body);
    ``wait`` only bounds a hang."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
        status, headers, _ = _parse(head)
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), wait)
        return status, headers, body
    finally:
        writer.close()


# --- in the middleware --------------------------------------------------------------------


async def test_a_body_that_stops_arriving_is_408(client: TestClient[Any, Any]) -> None:
    port = client.server.port
    started = time.monotonic()
    status, headers, body = await _exchange(
        port, _head("/v1/tasks/t1/claim", port, 100) + b'{"owner": "w'
    )
    elapsed = time.monotonic() - started
    problem = json.loads(body)
    assert status == 408 and problem["code"] == "REQUEST_TIMEOUT"
    # The body timeout answered (the one configured), and not before it ran out.
    assert f"within server.body_timeout_ms = {BODY_TIMEOUT_MS}" in problem["detail"], problem
    assert headers["content-type"] == "application/problem+json"
    assert headers["connection"] == "close"
    assert elapsed >= BODY_TIMEOUT_MS / 1000


async def test_a_content_length_over_the_limit_is_413_before_reading(
    patient_client: TestClient[Any, Any],
) -> None:
    """The body never comes and the gateway would wait ``NEVER_MS`` for it: an answer within
    the test's own wait means it was refused before reading."""
    port = patient_client.server.port
    for path in ("/v1/tasks/t1/claim", "/proxy/any/where"):
        status, headers, body = await _exchange(port, _head(path, port, 10**9))
        assert status == 413 and json.loads(body)["code"] == "PAYLOAD_TOO_LARGE"
        assert headers["connection"] == "close"


async def test_a_chunked_body_over_the_limit_is_413(client: TestClient[Any, Any]) -> None:
    port = client.server.port
    chunk = b"x" * 5000
    data = (
        (
            f"POST /v1/epoch/bump HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            f"{len(chunk):x}\r\n"
        ).encode()
        + chunk
        + b"\r\n0\r\n\r\n"
    )
    status, _, body = await _exchange(port, data)
    assert status == 413 and json.loads(body)["code"] == "PAYLOAD_TOO_LARGE"


async def test_a_client_gone_mid_body_is_one_info_event(
    patient_client: TestClient[Any, Any],
) -> None:
    """The client goes once the gateway has its request and waits for the rest of the body
    (which it would wait ``NEVER_MS`` for: never a 408 here, however slow the machine)."""
    client = patient_client
    port = client.server.port
    handled = client.server.handler.requests_count
    with capture_logs() as logs:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_head("/v1/tasks/t1/claim", port, 100) + b'{"owner"')
        await writer.drain()
        await until(
            lambda: client.server.handler.requests_count > handled, "the gateway has the request"
        )
        writer.transport.abort()
        await until(lambda: any(e["event"] == "http.client_gone" for e in logs), "http.client_gone")
    gone = [e for e in logs if e["event"] == "http.client_gone"]
    assert len(gone) == 1 and gone[0]["log_level"] == "info", logs
    assert gone[0]["path"] == "/v1/tasks/t1/claim"
    assert not [e for e in logs if e["log_level"] in ("error", "critical") or "exc_info" in e]
    async with client.get("/healthz") as resp:
        assert resp.status == 200


# --- a real gateway process ---------------------------------------------------------------


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    port = 0  # the system picks it when the gateway binds; GatewayProcess reads it back
    path = tmp_path / "fencegate.toml"
    path.write_text(
        "[server]\n"
        f'listen = "127.0.0.1:{port}"\n'
        f"body_timeout_ms = {BODY_TIMEOUT_MS}\n"
        "idle_timeout_ms = 1000\n"
        "max_connections = 4\n"
        "[store]\n"
        f'url = "sqlite:///{tmp_path / "gw.db"}"\n'
    )
    process = GatewayProcess(path, port).start()
    try:
        yield process
    finally:
        process.stop()


def _send(port: int, data: bytes, wait: float = HANG_S) -> bytes:
    """Blocking raw exchange (the gateway is another process): everything until it closes
    (``wait`` only bounds a hang)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


MALFORMED = [
    b"GET /v1/epoch HTTP/1.1\r\nHo st: x\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b"GET /v1/epoch HTTP/3.0\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /v1/epoch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"GET /v1/epoch HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,  # a TLS hello
]


def test_every_stderr_line_is_json_through_malformed_slow_and_vanishing_clients(
    gateway: GatewayProcess,
) -> None:
    port = gateway.port
    for data in MALFORMED:
        status, headers, body = _parse(_send(port, data))
        assert status in (400, 505), data[:40]
        assert headers["content-type"] == "application/problem+json", data[:40]
        assert json.loads(body)["status"] == status
    status, _, body = _parse(_send(port, b"GET /v1/epoch HTTP/3.0\r\nHost: 127.0.0.1\r\n\r\n"))
    assert status == 505 and json.loads(body)["code"] == "HTTP_VERSION_NOT_SUPPORTED"
    status, _, body = _parse(_send(port, _head("/v1/epoch/bump", port, 50) + b"{"))
    assert status == 408
    # Gone mid-body, at once: the gateway still takes the request it parsed, and finds the
    # client gone when it reads the body (a pause here would only let the body timeout win).
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_head("/v1/epoch/bump", port, 50) + b"{")
    status, _, _ = _parse(_send(port, b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"))
    assert status == 404
    _poll(lambda: "http.client_gone" in _event_names(gateway), "http.client_gone is logged")
    gateway.stop()
    lines = gateway.log_path.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # every line, or this raises
    names = [e["event"] for e in events]
    assert "gateway.unauthenticated" in names
    assert names.count("http.malformed_request") >= len(MALFORMED)
    assert "http.body_timeout" in names and "http.client_gone" in names
    assert not [e for e in events if e["level"] == "error"], events


def test_connections_over_the_limit_are_503_and_closed(gateway: GatewayProcess) -> None:
    port = gateway.port
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    held = []
    for _ in range(4):  # the limit: each answers once and stays open (keep-alive)
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        held.append(sock)
    try:
        status, headers, body = _parse(_send(port, b""))
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["code"] == "TOO_MANY_CONNECTIONS"
        held.pop().close()
        answers: list[bytes] = []

        def admitted() -> bool:  # the slot frees when the gateway sees the close
            answers.append(_send(port, request.replace(b"1.1", b"1.0")))
            return answers[-1].startswith(b"HTTP/1.0 200")

        _poll(admitted, f"a freed slot admits a connection; last answer {answers[-1:]}")
    finally:
        for sock in held:
            sock.close()
    events = gateway.log_events()
    assert any(e["event"] == "http.connections_refused" for e in events)


def test_a_connection_that_never_finishes_its_headers_is_closed(gateway: GatewayProcess) -> None:
    """Closed by the configured idle timeout (1 s): not at once, and within the test's own
    wait, which is shorter than aiohttp's default keep-alive (75 s)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=HANG_S) as sock:
        sock.sendall(b"GET /v1/epoch HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert sock.recv(65536) == b""  # closed by the gateway, not by the timeout here
    assert time.monotonic() - started > 0.5


def _event_names(gateway: GatewayProcess) -> list[object]:
    return [e.get("event") for e in gateway.log_events()]


def _poll(check: Callable[[], bool], what: str) -> None:
    """``tests.api.until`` for a test that talks to a gateway process with blocking sockets:
    the bound only catches a hang."""
    deadline = time.monotonic() + HANG_S
    while not check():
        assert time.monotonic() < deadline, f"never, within {HANG_S} s: {what}"
        time.sleep(0.05)
