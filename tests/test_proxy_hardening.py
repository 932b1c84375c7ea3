"""The proxy side of issue 11's red-team findings, through the gateway, on both stores.

The downstream here records every request exactly as it arrived (method, raw path, raw header
list, body), so a test can say what the downstream saw and what it never saw:

| path | answer |
|---|---|
| ``/fail/...`` | 500 (the effect reads UNKNOWN) |
| ``/hold/...`` | waits until the test releases it, then 200 |
| anything else | 200 JSON |
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.adapters import http as http_adapter
from fencegate.gateway import proxy
from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.gateway.proxy import proxy_answer_headers
from fencegate.ledger.effects import effect_id
from tests.api import Api, Lease
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.test_proxy import Sent, fence_headers

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

HOSTILE = "../../../../admin/wipe-all"


@dataclass
class Seen:
    method: str
    raw_path: str
    headers: list[tuple[str, str]]
    body: bytes

    def names(self) -> set[str]:
        return {name.lower() for name, _ in self.headers}

    def get(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name.lower()]


@dataclass
class Recorder:
    seen: list[Seen] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers]
        self.seen.append(Seen(request.method, request.raw_path, raw, body))
        if request.path.startswith("/fail/"):
            return web.json_response({"error": "boom"}, status=500)
        if request.path.startswith("/hold/"):
            self.holding.set()
            await self.release.wait()
        return web.json_response({"ok": True})

    async def start(self) -> Recorder:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    server = await Recorder().start()
    yield server
    await server.stop()


def hardening_config(store_url: str, key_prefix: str, recorder: Recorder, **proxy: Any) -> Config:
    common = {"url": recorder.url, "timeout_ms": 2_000}
    return make_config(
        store_url,
        key_prefix,
        downstreams=[  # type: ignore[arg-type]
            {"name": "api", **common},
            {
                "name": "custom",
                "idempotency_key_header": "X-Request-Key",
                "fencing_token_header": "X-Fence",
                **common,
            },
            {
                "name": "orders",
                "adapter": "probe",
                "probe": {"path": "/orders/by-key/{slot}", "settle_ms": 0, "interval_ms": 50},
                **common,
            },
            {"name": "quick", "connect_timeout_ms": 300, **common},
        ],
        server={"max_body_bytes": 4096},
        # The forward clock stands still (``gateway``) and the start limit (then a real-time
        # bound on the pool wait and connect) is 10 s off: a loaded machine cannot trip it.
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000, **proxy},
        reconciler={"enabled": False},
    )


@contextlib.asynccontextmanager
async def gateway(config: Config) -> AsyncIterator[Api]:
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    if proxy_answer_headers not in app.on_response_prepare:
        # Wired by gateway/app.py once its owner registers the hook; until then the test
        # registers it, and test_the_hook_is_wired_in_the_app_factory says it is missing.
        app.on_response_prepare.append(proxy_answer_headers)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


@pytest.fixture
async def api(store_url: str, key_prefix: str, recorder: Recorder) -> AsyncIterator[Api]:
    async with gateway(hardening_config(store_url, key_prefix, recorder)) as the_api:
        yield the_api


async def send(
    api: Api,
    lease: Lease,
    target: str,
    *,
    method: str = "POST",
    slot: str | None = "s1",
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    skip: tuple[str, ...] = (),
) -> Sent:
    all_headers = {**fence_headers(lease, slot), **(headers or {})}
    async with api.client.request(
        method,
        f"/proxy/{target}",
        data=data,
        headers=all_headers,
        skip_auto_headers=skip,
        allow_redirects=False,
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def leased(api: Api, task_id: str = "t1") -> Lease:
    await api.put(task_id)
    return await api.claim(task_id, ttl_ms=30_000)


def assert_problem(sent: Sent, status: int, code: str, state: str = "NONE") -> None:
    assert sent.status == status, sent.body
    assert sent.headers["Content-Type"].startswith("application/problem+json")
    assert sent.code == code, sent.body
    assert sent.headers["Fence-Effect-State"] == state
    assert sent.headers["Fence-Replayed"] == "false"


# --- a. probe templates --------------------------------------------------------------------


async def test_a_hostile_slot_is_never_probed_and_stays_unknown(
    api: Api, recorder: Recorder
) -> None:
    """Encoded, ``../../admin`` is one segment, ``..%2F..%2Fadmin``; but a server that decodes
    ``%2F`` before normalising (nginx) climbs out with it, so it is not sent (issue 25)."""
    lease = await leased(api)
    sent = await send(api, lease, "orders/fail/create", slot=HOSTILE, data=b"{}")
    assert sent.status == 500 and sent.headers["Fence-Effect-State"] == "UNKNOWN"
    eid = sent.headers["Fence-Effect-Id"]
    before = len(recorder.seen)
    answer = await api.call("POST", f"/v1/effects/{eid}/reconcile")
    assert answer.status == 200, answer.body
    assert answer.body["state"] == "UNKNOWN"
    assert answer.body["actions"][-1]["verdict"] == "inconclusive"
    assert len(recorder.seen) == before  # nothing was sent
    assert not [s for s in recorder.seen if "admin" in s.raw_path]


async def test_a_dot_slot_is_never_probed_and_stays_unknown(api: Api, recorder: Recorder) -> None:
    lease = await leased(api)
    sent = await send(api, lease, "orders/fail/create", slot="..", data=b"{}")
    eid = sent.headers["Fence-Effect-Id"]
    before = len(recorder.seen)
    answer = await api.call("POST", f"/v1/effects/{eid}/reconcile")
    assert answer.status == 200, answer.body
    assert answer.body["state"] == "UNKNOWN"
    assert answer.body["actions"][-1]["verdict"] == "inconclusive"
    assert len(recorder.seen) == before  # nothing was sent


# --- b. strict JSON digests ----------------------------------------------------------------


@pytest.mark.parametrize(
    "body", [b'{"amount":1,"amount":5000}', b'{"amount":NaN}', b'{"to":"\\ud800"}']
)
async def test_ambiguous_json_is_refused_before_anything(
    api: Api, recorder: Recorder, body: bytes
) -> None:
    lease = await leased(api)
    sent = await send(api, lease, "api/pay", data=body,
                      headers={"Content-Type": "application/json"})  # fmt: skip
    assert_problem(sent, 400, "BAD_REQUEST")
    assert recorder.seen == []
    missing = await api.call("GET", f"/v1/effects/{effect_id('t1', 1, 'main', 's1')}")
    assert missing.status == 404


async def test_a_rounded_number_is_another_payload_not_a_replay(
    api: Api, recorder: Recorder
) -> None:
    lease = await leased(api)
    json_type = {"Content-Type": "application/json"}
    first = await send(api, lease, "api/pay", data=b'{"amount":100.000000000000000001}',
                       headers=json_type)  # fmt: skip
    assert first.status == 200
    other = await send(api, lease, "api/pay", data=b'{"amount":100.0}', headers=json_type)
    assert_problem(other, 422, "PAYLOAD_CONFLICT", state="COMMITTED")
    same = await send(api, lease, "api/pay", data=b'{"amount":100.000000000000000001}',
                      headers=json_type)  # fmt: skip
    assert same.status == 200 and same.headers["Fence-Replayed"] == "true"
    assert len(recorder.seen) == 1


# --- c. safe methods -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
async def test_the_agents_identity_headers_never_reach_the_downstream_on_a_safe_method(
    api: Api, recorder: Recorder, method: str
) -> None:
    lease = await leased(api)
    mine = {"Idempotency-Key": "mine", "Fencing-Token": "99.99", "X-Request-Key": "mine",
            "X-Fence": "99.99"}  # fmt: skip
    assert (
        await send(api, lease, "api/items", method=method, slot=None, headers=mine)
    ).status == 200
    got = recorder.seen[-1].names()
    assert "idempotency-key" not in got and "fencing-token" not in got
    assert "x-request-key" in got and "x-fence" in got  # not this downstream's names
    sent = await send(api, lease, "custom/items", method=method, slot=None, headers=mine)
    assert sent.status == 200
    got = recorder.seen[-1].names()
    assert "x-request-key" not in got and "x-fence" not in got


@pytest.mark.parametrize(
    ("target", "headers"),
    [
        ("api/items/1", {"X-HTTP-Method-Override": "DELETE"}),
        ("api/items/1", {"X-HTTP-Method": "DELETE"}),
        ("api/items/1", {"X-Method-Override": "DELETE"}),
        ("api/items/1?_method=DELETE", {}),
    ],
)
async def test_a_method_override_on_a_safe_method_is_refused(
    api: Api, recorder: Recorder, target: str, headers: dict[str, str]
) -> None:
    lease = await leased(api)
    sent = await send(api, lease, target, method="GET", slot=None, headers=headers)
    assert_problem(sent, 400, "BAD_REQUEST")
    assert "method override" in sent.json["detail"]
    assert recorder.seen == []


# --- d. what the downstream sees -----------------------------------------------------------


async def test_no_content_type_or_accept_is_invented(api: Api, recorder: Recorder) -> None:
    lease = await leased(api)
    skip = ("Content-Type", "Accept", "Accept-Encoding", "User-Agent")
    assert (await send(api, lease, "api/a", data=b"", skip=skip)).status == 200
    assert (await send(api, lease, "api/b", data=b"raw", slot="s2", skip=skip)).status == 200
    assert (await send(api, lease, "api/c", method="GET", slot=None, skip=skip)).status == 200
    for seen in recorder.seen:
        assert "content-type" not in seen.names(), seen
        assert "accept" not in seen.names(), seen
        assert "user-agent" not in seen.names() and "accept-encoding" not in seen.names()
    typed = {"Content-Type": "text/csv", "Accept": "text/csv"}
    assert (await send(api, lease, "api/d", data=b"a,b", slot="s3", headers=typed)).status == 200
    assert recorder.seen[-1].get("Content-Type") == ["text/csv"]
    assert recorder.seen[-1].get("Accept") == ["text/csv"]


async def test_forwarded_for_gets_the_peer_and_client_claims_are_dropped(
    api: Api, recorder: Recorder
) -> None:
    lease = await leased(api)
    claims = {"X-Forwarded-For": "203.0.113.7", "Forwarded": "for=203.0.113.8",
              "X-Real-IP": "203.0.113.9"}  # fmt: skip
    for method, slot in (("GET", None), ("POST", "s1")):
        sent = await send(api, lease, "api/who", method=method, slot=slot, data=b"x",
                          headers=claims)  # fmt: skip
        assert sent.status == 200
        seen = recorder.seen[-1]
        assert seen.get("X-Forwarded-For") == ["203.0.113.7, 127.0.0.1"]
        assert "forwarded" not in seen.names() and "x-real-ip" not in seen.names()


# --- e. a call that never got a pooled connection ------------------------------------------


async def test_a_call_that_never_got_a_pooled_connection_is_busy_and_not_applied(
    store_url: str, key_prefix: str, recorder: Recorder
) -> None:
    # The start limit bounds the recorded call's wait for the pool (the held call keeps the
    # one connection, so the wait ends only by this bound, however loaded the machine).
    config = hardening_config(
        store_url, key_prefix, recorder, max_connections=1, forward_start_limit_ms=250
    )
    async with gateway(config) as api:
        lease = await leased(api)
        holder = asyncio.create_task(send(api, lease, "api/hold/1", method="GET", slot=None))
        await recorder.holding.wait()

        busy = await send(api, lease, "api/pay", data=b"{}")
        assert_problem(busy, 503, "DOWNSTREAM_BUSY", state="NOT_APPLIED")
        assert busy.headers["Retry-After"] == "1"
        eid = busy.headers["Fence-Effect-Id"]
        record = (await api.call("GET", f"/v1/effects/{eid}")).body
        assert record["state"] == "NOT_APPLIED"
        (attempt,) = record["attempts"]
        assert attempt["outcome"] == "NOT_APPLIED"
        assert attempt["reason"].startswith("never sent: no pooled connection"), attempt

        # A safe method waits at most the downstream's connect_timeout_ms for the pool.
        safe = await send(api, lease, "quick/items", method="GET", slot=None)
        assert_problem(safe, 503, "DOWNSTREAM_BUSY")
        assert [s.raw_path for s in recorder.seen] == ["/hold/1"]

        recorder.release.set()
        assert (await holder).status == 200
        again = await send(api, lease, "api/pay", data=b"{}")
        assert again.status == 200 and again.headers["Fence-Effect-State"] == "COMMITTED"
        assert [s.raw_path for s in recorder.seen] == ["/hold/1", "/pay"]


# --- f. refusals the proxy did not plan ----------------------------------------------------


async def test_a_body_over_the_server_limit_is_413_with_fence_headers(
    api: Api, recorder: Recorder
) -> None:
    lease = await leased(api)
    sized = await send(api, lease, "api/pay", data=b"x" * 5000)
    assert_problem(sized, 413, "PAYLOAD_TOO_LARGE")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"x" * 1000

    async with api.client.post("/proxy/api/pay", data=chunks(),
                               headers=fence_headers(lease)) as resp:  # fmt: skip
        chunked = Sent(resp.status, resp.headers, await resp.read())
    assert_problem(chunked, 413, "PAYLOAD_TOO_LARGE")
    assert recorder.seen == []


async def test_trace_is_405_with_fence_headers(api: Api, recorder: Recorder) -> None:
    lease = await leased(api)
    sent = await send(api, lease, "api/x", method="TRACE", slot=None)
    assert_problem(sent, 405, "METHOD_NOT_ALLOWED")
    assert "POST" in sent.headers["Allow"]


async def test_an_unexpected_failure_is_500_with_what_the_gateway_knows(
    api: Api, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = await leased(api)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(http_adapter, "canonical_body", broken)  # before anything was prepared
        sent = await send(api, lease, "api/pay", data=b"{}")
    assert_problem(sent, 500, "INTERNAL", state="NONE")
    assert recorder.seen == []

    with monkeypatch.context() as patch:
        patch.setattr(proxy, "stored_response_headers", broken)  # after the forward
        sent = await send(api, lease, "api/pay", data=b"{}")
    assert_problem(sent, 500, "INTERNAL", state="UNKNOWN")
    assert sent.headers["Fence-Effect-Id"] == effect_id("t1", 1, "main", "s1")
    assert json.loads(sent.body)["effectState"] == "UNKNOWN"


def test_the_hook_is_wired_in_the_app_factory(store_url: str, key_prefix: str) -> None:
    """Refusals made before the proxy handler runs (request_guard's 413/408/421/403/505 on a
    /proxy path) carry Fence-Effect-State only when the app factory registers the hook."""
    config = make_config(store_url, key_prefix)
    app = create_app(config, store=build_test_store(config))
    assert proxy_answer_headers in app.on_response_prepare
