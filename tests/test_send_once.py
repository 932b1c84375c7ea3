"""At most once below the ledger: nothing re-sends a request the downstream may have applied.

aiohttp re-sends a request by itself when the connection breaks and the method is one it
calls idempotent (GET HEAD OPTIONS TRACE PUT DELETE). The downstream here is a raw TCP server
on loopback that APPLIES every request it reads in full (it counts it, per method and path and
per Idempotency-Key) and then drops the connection without a byte of answer: with a FIN, or
with a RST (SO_LINGER 0). The counts are taken where the effect lands, at the downstream.

* straight on ``gateway.http_client``: with ``send_once()`` a PUT or DELETE is executed once
  and the re-send is refused; without it (the control) aiohttp executes it twice, so these
  tests can fail and it is the guard that stops the second send;
* through the gateway, for every adapter kind and both stores: the downstream executes the
  PUT or DELETE once, the agent gets 504 DOWNSTREAM_TIMEOUT with ``Fence-Effect-State:
  UNKNOWN``, the ledger shows one UNKNOWN attempt, and a retry by the same lease reaches the
  downstream again only for the kinds that may re-send (idempotent, conditional with a
  precondition), and then under the SAME Idempotency-Key;
* the forwards without a ledger entry (a GET; a shadow-mode PUT) and the probe are sent once.

``tests/test_aiohttp_versions.py`` (slow) runs this file on each aiohttp minor version that
pyproject.toml allows; ``FENCEGATE_EXPECT_AIOHTTP`` then names the version it must run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.http_client import ResendRefused, new_client_session, send_once
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.test_proxy import Sent, fence_headers

#: The guard is the client's, the same on every store: SQLite only (docs/stores.md).
pytestmark = [pytest.mark.timeout(10), pytest.mark.one_store]

#: How the downstream ends a connection after applying the request, or that it answers.
FIN, RST, ANSWER = "fin", "rst", "answer"
#: What aiohttp raises when the connection breaks after the request was sent.
BROKEN = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
#: Generous for loopback; the resets themselves take a millisecond.
TIMEOUT_MS = 1_500


class ApplyThenDrop:
    """An HTTP/1.1 downstream that executes whatever it receives in full and, unless it is an
    ``ANSWER`` server, then drops the connection without answering."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        #: Executed requests per (method, path without query).
        self.requests: Counter[tuple[str, str]] = Counter()
        #: Executed requests per Idempotency-Key header value (requests without one: not here).
        self.keys: Counter[str] = Counter()
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> ApplyThenDrop:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[str, str, str | None]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await reader.readexactly(int(headers.get("content-length", "0")))
        return method, target.split("?", 1)[0], headers.get("idempotency-key")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    method, path, key = await self._read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client went away before sending a whole request
                # The request is in: the effect happens here, before any answer.
                self.requests[(method, path)] += 1
                if key is not None:
                    self.keys[key] += 1
                if self.mode != ANSWER:
                    if self.mode == RST:
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@pytest.fixture(params=[FIN, RST])
async def dropper(request: pytest.FixtureRequest) -> AsyncIterator[ApplyThenDrop]:
    server = await ApplyThenDrop(request.param).start()
    yield server
    await server.stop()


def test_the_installed_aiohttp_is_the_one_under_test() -> None:
    """The version matrix sets FENCEGATE_EXPECT_AIOHTTP: this run must use that aiohttp."""
    expected = os.environ.get("FENCEGATE_EXPECT_AIOHTTP")
    print(f"aiohttp {aiohttp.__version__} from {aiohttp.__file__}")
    if expected is not None:
        assert aiohttp.__version__ == expected
    assert hasattr(aiohttp, "ClientMiddlewareType"), "client middlewares need aiohttp >= 3.12"


# --- gateway.http_client, straight ------------------------------------------------------------


async def _send(server: ApplyThenDrop, method: str, *, guarded: bool, key: str = "k1") -> None:
    async with new_client_session(4) as session:
        kwargs: dict[str, Any] = {"middlewares": send_once()} if guarded else {}
        async with session.request(
            method,
            f"{server.url}/things/1",
            data=b'{"n": 1}' if method in ("PUT", "POST") else None,
            headers={"Idempotency-Key": key},
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_MS / 1000),
            **kwargs,
        ) as resp:
            await resp.read()


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
async def test_send_once_refuses_the_resend(dropper: ApplyThenDrop, method: str) -> None:
    with pytest.raises(ResendRefused):
        await _send(dropper, method, guarded=True)
    assert dropper.requests == {(method, "/things/1"): 1}
    assert dropper.keys == {"k1": 1}


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
async def test_without_the_guard_aiohttp_executes_it_twice(
    dropper: ApplyThenDrop, method: str
) -> None:
    """The control: what the guard is there for. If aiohttp ever stops re-sending, this fails
    and says so (the guard is then harmless, and this test is to be revisited)."""
    with pytest.raises(BROKEN):
        await _send(dropper, method, guarded=False)
    assert dropper.requests == {(method, "/things/1"): 2}
    assert dropper.keys == {"k1": 2}


async def test_aiohttp_does_not_resend_a_post_even_without_the_guard(
    dropper: ApplyThenDrop,
) -> None:
    with pytest.raises(BROKEN):
        await _send(dropper, "POST", guarded=False)
    assert dropper.requests == {("POST", "/things/1"): 1}


async def test_send_once_is_per_request_and_lets_answered_requests_through() -> None:
    server = await ApplyThenDrop(ANSWER).start()
    try:
        async with new_client_session(1) as session:
            for n in range(3):  # one pooled keep-alive connection, a fresh guard each time
                async with session.put(
                    f"{server.url}/things/{n}", data=b"x", middlewares=send_once()
                ) as resp:
                    assert resp.status == 200 and await resp.read() == b"ok"
            # One guard for two requests: the second is refused before it is sent.
            guard = send_once()
            async with session.put(f"{server.url}/a", data=b"x", middlewares=guard) as resp:
                assert resp.status == 200
            with pytest.raises(ResendRefused):
                await session.put(f"{server.url}/b", data=b"x", middlewares=guard)
    finally:
        await server.stop()
    assert server.requests == {("PUT", "/things/0"): 1, ("PUT", "/things/1"): 1,
                               ("PUT", "/things/2"): 1, ("PUT", "/a"): 1}  # fmt: skip


# --- through the gateway, every adapter kind ---------------------------------------------------

PROBE_PATH = "/orders/by-key/{effectId}"
#: downstream name -> its adapter options.
KINDS: dict[str, dict[str, Any]] = {
    "plain": {"adapter": "http"},
    "stripe": {"adapter": "idempotent", "dedupe_window_ms": 60_000},
    "orders": {
        "adapter": "probe",
        # The probe goes to the same dropping server: it fails, so the verdict is
        # inconclusive (and the probe itself must be sent once).
        "probe": {
            "path": PROBE_PATH,
            "timeout_ms": TIMEOUT_MS,
            "interval_ms": 50,
            "max_interval_ms": 200,
            "settle_ms": 0,
        },
    },
    "s3": {"adapter": "conditional"},
    "mail": {"adapter": "manual"},
    "mail-approved": {"adapter": "manual", "require_approval": True},
}
#: test case -> (downstream, request headers).
CASES: dict[str, tuple[str, dict[str, str]]] = {
    "http": ("plain", {}),
    "idempotent": ("stripe", {}),
    "probe": ("orders", {}),
    "conditional-if-match": ("s3", {"If-Match": '"v1"'}),
    "conditional-bare": ("s3", {}),
    "manual": ("mail", {}),
    "manual-approval": ("mail-approved", {}),
}
#: Cases whose UNKNOWN effect the gateway forwards again by itself (same payload): the
#: downstream deduplicates on the key, or the precondition refuses a second application.
RESENDING = frozenset({"idempotent", "conditional-if-match"})


@pytest.fixture
async def api(store_url: str, key_prefix: str, dropper: ApplyThenDrop) -> AsyncIterator[Api]:
    common = {"url": dropper.url, "timeout_ms": TIMEOUT_MS}
    downstreams = [{"name": name, **options, **common} for name, options in KINDS.items()]
    downstreams.append({"name": "shadowed", "enforcement": "shadow", **common})
    config = make_config(
        store_url,
        key_prefix,
        downstreams=downstreams,
        # Room for a loaded machine: a forward that cannot start within the start limit is
        # refused (503) and never sent, which is not what these tests are about.
        proxy={"prepared_margin_ms": 10_000, "forward_start_limit_ms": 5_000},
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def call(
    api: Api,
    lease: Lease,
    method: str,
    target: str,
    *,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Sent:
    all_headers = {**fence_headers(lease), **(headers or {})}
    async with api.client.request(
        method, f"/proxy/{target}", data=data, headers=all_headers
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def record(api: Api, effect_id: str) -> Any:
    answer = await api.call("GET", f"/v1/effects/{effect_id}")
    assert answer.status == 200, answer.body
    return answer.body


def assert_unknown_504(sent: Sent) -> str:
    assert sent.status == 504, (sent.status, sent.body)
    assert sent.headers["Content-Type"].startswith("application/problem+json")
    assert sent.code == "DOWNSTREAM_TIMEOUT"
    assert sent.headers["Fence-Effect-State"] == "UNKNOWN"
    return str(sent.headers["Fence-Effect-Id"])


async def approve(api: Api, lease: Lease, method: str, target: str, data: bytes | None) -> None:
    """A manual downstream with require_approval: the first call waits, an operator approves
    its exact request (nothing reaches the downstream meanwhile)."""
    waiting = await call(api, lease, method, target, data=data)
    assert waiting.status == 409 and waiting.code == "APPROVAL_REQUIRED", waiting.body
    effect_id = waiting.headers["Fence-Effect-Id"]
    digest = (await record(api, effect_id))["approvalDigest"]
    approved = await api.client.post(
        f"/v1/effects/{effect_id}/approve",
        json={"approvalDigest": digest},
        headers={"Fence-Operator": "carol"},
    )
    assert approved.status == 200, await approved.text()


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
@pytest.mark.parametrize("case", list(CASES))
async def test_gateway_forwards_once_and_records_unknown(
    api: Api, dropper: ApplyThenDrop, case: str, method: str
) -> None:
    downstream, headers = CASES[case]
    await api.put("t1")
    lease = await api.claim("t1")
    path = f"/things/{case}"
    target = f"{downstream}{path}"
    data = b'{"n": 1}' if method == "PUT" else None
    if downstream == "mail-approved":
        await approve(api, lease, method, target, data)
        assert not dropper.requests

    sent = await call(api, lease, method, target, data=data, headers=headers)
    effect_id = assert_unknown_504(sent)
    assert dropper.requests == {(method, path): 1}
    assert dropper.keys == {effect_id: 1}
    rec = await record(api, effect_id)
    assert rec["state"] == "UNKNOWN"
    assert len(rec["attempts"]) == 1
    first = rec["attempts"][0]
    assert first["outcome"] == "UNKNOWN"
    assert first["reason"].startswith("failed after sending"), first["reason"]
    if downstream == "mail-approved":
        assert first["approvedBy"] == "carol"

    # The same call again, by the same lease.
    retry = await call(api, lease, method, target, data=data, headers=headers)
    rec = await record(api, effect_id)
    probe = ("GET", f"/orders/by-key/{effect_id}")
    if case in RESENDING:
        # Sent again by design, once, and under the SAME Idempotency-Key.
        assert assert_unknown_504(retry) == effect_id
        assert dropper.requests == {(method, path): 2}
        assert dropper.keys == {effect_id: 2}
        assert [a["outcome"] for a in rec["attempts"]] == ["UNKNOWN", "UNKNOWN"]
    elif downstream == "orders":
        # The retry probed once, inline (the probe carries the key too); the probe failed,
        # so the verdict is inconclusive and the effect stays UNKNOWN: not forwarded again.
        assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN", retry.body
        assert dropper.requests == {(method, path): 1, probe: 1}
        assert dropper.keys == {effect_id: 2}
        assert rec["probes"]["count"] == 1
        assert rec["actions"][-1]["verdict"] == "inconclusive"
    else:
        assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN", retry.body
        assert dropper.requests == {(method, path): 1}
        assert dropper.keys == {effect_id: 1}
    if case not in RESENDING:
        assert retry.headers["Fence-Effect-State"] == "UNKNOWN"
        assert retry.headers["Fence-Effect-Id"] == effect_id
        assert rec["state"] == "UNKNOWN" and len(rec["attempts"]) == 1


async def test_reconcile_probe_is_sent_once(api: Api, dropper: ApplyThenDrop) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    effect_id = assert_unknown_504(await call(api, lease, "PUT", "orders/things/1", data=b"x"))
    answer = await api.call("POST", f"/v1/effects/{effect_id}/reconcile")
    assert answer.status == 200 and answer.body["state"] == "UNKNOWN", answer.body
    assert dropper.requests == {("PUT", "/things/1"): 1, ("GET", f"/orders/by-key/{effect_id}"): 1}


async def test_safe_method_forward_is_sent_once(api: Api, dropper: ApplyThenDrop) -> None:
    """GET is forwarded without a ledger entry, and aiohttp would re-send it too."""
    await api.put("t1")
    lease = await api.claim("t1")
    sent = await call(api, lease, "GET", "plain/things/1")
    assert sent.status == 504 and sent.code == "DOWNSTREAM_TIMEOUT", sent.body
    assert sent.headers["Fence-Effect-State"] == "NONE"
    assert dropper.requests == {("GET", "/things/1"): 1}


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
async def test_shadow_mode_forward_is_sent_once(
    api: Api, dropper: ApplyThenDrop, method: str
) -> None:
    """Shadow mode forwards a refused call without a ledger entry: a PUT there must not be
    re-sent either."""
    await api.put("t1")
    stale = await api.claim("t1", ttl_ms=1_000)
    api.advance(1_000)
    await api.claim("t1", "B")
    data = b"x" if method == "PUT" else None
    sent = await call(api, stale, method, "shadowed/things/1", data=data)
    assert sent.status == 504 and sent.code == "DOWNSTREAM_TIMEOUT", sent.body
    assert dropper.requests == {(method, "/things/1"): 1}
