"""``server.max_connections_per_peer`` (issue 25): one client may not hold every connection
slot with connections that never authenticate.

Before, a single unauthenticated client could open ``server.max_connections`` idle
connections (or keep-alive ``GET /healthz`` ones, which ``[auth]`` leaves open) and every
other client got ``503 TOO_MANY_CONNECTIONS``. Now the connections from one peer address that
have not yet carried an authenticated request (without ``[auth]``: a complete request) are
bounded; one more from that address is 503 with ``Retry-After`` and a detail naming the
per-peer limit, while other addresses, and connections that did authenticate, are not held to
it. The bookkeeping (``ConnectionSlots``) is checked alone; the rest against a real ``fencegate
serve`` over raw sockets (the bound lives in its listener, not in the app).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fencegate.gateway.auth import token_sha256
from fencegate.gateway.config import ConfigError, load_config
from fencegate.gateway.request_guard import ConnectionSlots, peer_group
from tests.servers import GatewayProcess

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

PER_PEER = 3
PER_PRINCIPAL = 4
TOKEN = "tok-peer-observer-0123456789"
OTHER_TOKEN = "tok-peer-other-0123456789ab"
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
EPOCH = (
    b"GET /v1/epoch HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    + f"Fence-Authorization: Bearer {TOKEN}\r\n\r\n".encode()
)


# --- the bookkeeping ----------------------------------------------------------------------


def test_slots_count_unvouched_connections_per_peer() -> None:
    slots = ConnectionSlots(100, 2)
    assert slots.admit("10.0.0.1") and slots.admit("10.0.0.1")
    assert not slots.admit("10.0.0.1")  # the third unvouched one from that address
    assert slots.admit("10.0.0.2")  # another address has its own bound
    slots.vouched("10.0.0.1")
    assert slots.admit("10.0.0.1")
    assert slots.admit(None)  # no address (a Unix socket): not bounded per peer
    for _ in range(2):
        slots.vouched("10.0.0.1")
    slots.vouched("10.0.0.2")
    assert slots.unvouched == {}  # nothing left behind for addresses that went away


@pytest.mark.parametrize(
    ("address", "peer"),
    [
        ("127.0.0.1", "loopback"),
        ("127.3.2.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.9", "loopback"),
        ("10.0.0.1", "10.0.0.1"),
        ("::ffff:10.0.0.1", "10.0.0.1"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_a_peer_is_an_address_all_of_loopback_or_an_ipv6_64(address: str, peer: str) -> None:
    """What a local process or an IPv6 host can pick freely counts as one peer."""
    assert peer_group(address) == peer


@pytest.mark.parametrize("authenticated", [True, False])
def test_the_refusal_names_the_per_peer_limit(authenticated: bool) -> None:
    head, _, body = ConnectionSlots(10, 7, authenticated=authenticated).peer_busy.partition(
        b"\r\n\r\n"
    )
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1" in head
    problem = json.loads(body)
    assert problem["code"] == "TOO_MANY_CONNECTIONS" and problem["status"] == 503
    assert "server.max_connections_per_peer = 7" in problem["detail"]
    assert ("authenticated" in problem["detail"]) is authenticated


# --- a real gateway -----------------------------------------------------------------------


def _gateway(tmp_path: Path, auth: bool) -> GatewayProcess:
    port = 0  # the system picks it when the gateway binds; GatewayProcess reads it back
    path = tmp_path / "fencegate.toml"
    text = (
        f'[server]\nlisten = "127.0.0.1:{port}"\nmax_connections = 50\n'
        f"max_connections_per_peer = {PER_PEER}\nidle_timeout_ms = 60000\n"
        f"max_connections_per_principal = {PER_PRINCIPAL}\n"
        f'[store]\nurl = "sqlite:///{tmp_path / "gw.db"}"\n'
    )
    if auth:
        text += (
            '[[auth.principals]]\nname = "watcher"\nroles = ["observer", "operator"]\n'
            f'token_sha256 = "{token_sha256(TOKEN)}"\n'
            '[[auth.principals]]\nname = "other"\nroles = ["observer"]\n'
            f'token_sha256 = "{token_sha256(OTHER_TOKEN)}"\n'
        )
    path.write_text(text)
    return GatewayProcess(path, port).start()


@pytest.fixture
def authed(tmp_path: Path) -> Iterator[GatewayProcess]:
    process = _gateway(tmp_path, auth=True)
    yield process
    process.stop()


@pytest.fixture
def open_gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    process = _gateway(tmp_path, auth=False)
    yield process
    process.stop()


class Connections:
    """Raw client connections, closed at the end."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.held: list[socket.socket] = []

    def open(self, source: str = "127.0.0.1") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5,
                                        source_address=(source, 0))  # fmt: skip
        self.held.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.held:
            sock.close()


@pytest.fixture
def connections() -> Iterator[Any]:
    made: list[Connections] = []

    def make(port: int) -> Connections:
        made.append(Connections(port))
        return made[-1]

    yield make
    for group in made:
        group.close()


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer (head and Content-Length bytes of body) from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _ask(sock: socket.socket, request: bytes) -> int:
    sock.sendall(request)
    return _answer(sock)[0]


def _refused(sock: socket.socket) -> str:
    """The detail of the 503 a refused connection is sent at once (before any request)."""
    status, headers, body = _answer(sock)
    assert status == 503 and headers["retry-after"] == "1", (status, headers, body)
    problem = json.loads(body)
    assert problem["code"] == "TOO_MANY_CONNECTIONS"
    detail: str = problem["detail"]
    return detail


def _admitted_within(group: Connections, seconds: float = 10.0) -> socket.socket:
    """A new connection that is served (the gateway sees a closed one go asynchronously):
    tried again until one is, within a bounded wait."""
    deadline = time.monotonic() + seconds
    while True:
        sock = group.open()
        try:
            sock.sendall(HEALTHZ)
            status = _answer(sock)[0]
        except OSError:  # refused and closed before the request went out
            status = 503
        if status == 200 or time.monotonic() > deadline:
            assert status == 200
            return sock
        time.sleep(0.05)


def test_idle_healthz_connections_of_one_client_cannot_hold_every_slot(
    authed: GatewayProcess, connections: Any
) -> None:
    """The red-team's attack: keep-alive ``GET /healthz`` connections (open without a token
    under ``[auth]``). The fourth from one address is refused, naming the per-peer limit."""
    group: Connections = connections(authed.port)
    held = [group.open() for _ in range(PER_PEER)]
    for sock in held:
        assert _ask(sock, HEALTHZ) == 200  # answered, and kept open
    detail = _refused(group.open())
    assert "server.max_connections_per_peer = 3" in detail and "authenticated" in detail
    # Another loopback address is the same peer: any local process may bind all of 127/8
    # (the second red-team pass held 550 connections from 127.0.0.2-12) ...
    for source in ("127.0.0.2", "127.255.255.254"):
        assert _refused(group.open(source=source))
    # ... and a connection that carried an authenticated request no longer counts: the
    # address may open one more.
    assert _ask(held[0], EPOCH) == 200
    fresh = group.open()
    assert _ask(fresh, HEALTHZ) == 200
    assert _refused(group.open())  # full again: held[1], held[2] and fresh are unvouched
    # An authenticated connection stays vouched for whatever it sends next.
    assert _ask(held[0], HEALTHZ) == 200
    # Closing an unvouched connection frees its place.
    held[1].close()
    _admitted_within(group)
    events = [e for e in authed.log_events() if e["event"] == "http.peer_connections_refused"]
    assert events and events[0]["limit"] == PER_PEER and events[0]["peer"] == "loopback"


def test_without_auth_a_complete_request_vouches_for_its_connection(
    open_gateway: GatewayProcess, connections: Any
) -> None:
    group: Connections = connections(open_gateway.port)
    idle = [group.open() for _ in range(PER_PEER)]  # no request at all: never vouched for
    detail = _refused(group.open())
    assert "complete request" in detail and "server.max_connections_per_peer" in detail
    assert _ask(idle[0], HEALTHZ) == 200  # a complete request: vouched for
    assert _ask(group.open(), HEALTHZ) == 200  # so one more is served (and vouched for)
    group.open()  # idle: idle[1], idle[2] and this one are the three unvouched
    # A request whose headers never finish does not vouch.
    idle[1].sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert _refused(group.open())


def _epoch(token: str) -> bytes:
    return (
        b"GET /v1/epoch HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Fence-Authorization: Bearer {token}\r\n\r\n".encode()
    )


def test_one_principal_cannot_hold_every_slot_with_authenticated_connections(
    authed: GatewayProcess, connections: Any
) -> None:
    """The second red-team pass: one worker token opened 500 keep-alive connections, one
    authenticated request on each, and every other client (even ``/healthz``) got 503 until
    they idled out. Now a principal's requests ride at most
    ``server.max_connections_per_principal`` open connections: one more connection carrying
    its request is answered 503 (naming the limit) and closed; others are not held to it."""
    group: Connections = connections(authed.port)
    # One at a time: each is vouched for before the next opens (PER_PEER < PER_PRINCIPAL).
    held = _opened_and_asked(group, EPOCH, PER_PRINCIPAL)
    assert [status for status, _ in held] == [200] * PER_PRINCIPAL
    extra = group.open()
    extra.sendall(EPOCH)
    status, headers, body = _answer(extra)
    assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
    problem = json.loads(body)
    assert problem["code"] == "TOO_MANY_CONNECTIONS"
    assert f"server.max_connections_per_principal = {PER_PRINCIPAL}" in problem["detail"]
    assert extra.recv(1) == b""  # closed
    # Another principal, and the held connections themselves, are served as before.
    assert _ask(group.open(), _epoch(OTHER_TOKEN)) == 200
    assert _ask(held[0][1], EPOCH) == 200
    # A connection that carried another principal's request counts for the one it carries
    # now: watcher's bound is full, so it is refused too.
    switching = group.open()
    assert _ask(switching, _epoch(OTHER_TOKEN)) == 200
    switching.sendall(EPOCH)
    assert _answer(switching)[0] == 503
    # Closing one of them frees its place (the gateway sees the close asynchronously).
    held[1][1].close()
    deadline = time.monotonic() + 10
    while True:
        ((status, _),) = _opened_and_asked(group, EPOCH, 1)
        if status == 200 or time.monotonic() > deadline:
            assert status == 200
            break
        time.sleep(0.05)
    events = [e for e in authed.log_events() if e["event"] == "http.principal_connections_refused"]
    assert events and events[0]["principal"] == "watcher"
    assert events[0]["limit"] == PER_PRINCIPAL


def test_the_per_principal_bound_is_checked_at_start_up(tmp_path: Path) -> None:
    path = tmp_path / "fencegate.toml"
    path.write_text(
        "[server]\nmax_connections = 10\nmax_connections_per_principal = 11\n"
        f'[store]\nurl = "sqlite:///{tmp_path / "gw.db"}"\n'
    )
    with pytest.raises(ConfigError, match="max_connections_per_principal"):
        load_config(path)
    path.write_text(f'[server]\nmax_connections = 10\n[store]\nurl = "sqlite:///{tmp_path}/g.db"\n')
    assert load_config(path).server.principal_connection_limit == 5  # half, by default


def _opened_and_asked(
    group: Connections, request: bytes, count: int
) -> list[tuple[int, socket.socket]]:
    """``count`` new connections, each asked ``request`` before the next opens: the status
    (503 for one refused, and closed, before its request went out) and the socket."""
    answered = []
    for _ in range(count):
        sock = group.open()
        try:
            status = _ask(sock, request)
        except OSError:  # refused at connect (a bound that counts closes not yet seen)
            status = 503
        answered.append((status, sock))
    return answered


def _holds_all_its_places(group: Connections, token: str, seconds: float = 10.0) -> bool:
    """Whether the principal can hold PER_PRINCIPAL connections at once, within a bounded
    wait (the gateway sees closed connections asynchronously)."""
    deadline = time.monotonic() + seconds
    while True:
        answered = _opened_and_asked(group, _epoch(token), PER_PRINCIPAL)
        statuses = [status for status, _ in answered]
        for _, sock in answered:
            sock.close()
        if statuses == [200] * PER_PRINCIPAL:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_a_request_pipelined_behind_a_close_counts_for_nobody(
    authed: GatewayProcess, connections: Any
) -> None:
    """The third red-team pass: a request whose body is still due, then the body's tail, a
    pipelined request of the principal and the FIN in one write. aiohttp started the second
    request after the connection was lost, and the principal was counted on a closed
    connection for good: a few rounds locked it out of the gateway with nothing open."""
    group: Connections = connections(authed.port)
    for _ in range(2 * PER_PRINCIPAL):
        sock = group.open()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\n")
        time.sleep(0.05)  # (to make the race likely: the test passes either way with the fix)
        sock.sendall(b"hello" + EPOCH)
        sock.close()
    assert _holds_all_its_places(group, TOKEN)
