"""The default meaning of 429 and 503, for every adapter kind, on both stores.

429 refuses a request before it is processed: NOT_APPLIED, and the same payload may go again.
503 may come from a downstream that had already started on the request: UNKNOWN, never replayed
as if it were the answer, and never re-sent by a kind that cannot prove a re-send harmless.
A downstream's ``outcomes`` table still wins over both defaults. The downstream here counts
what it received and what it executed (a 429 executes nothing), so every test shows how many
times the effect really ran.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.ledger.effects import EffectState
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.test_proxy import Sent, fence_headers

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

#: Every adapter kind that uses the default outcomes (``HttpAdapter.default_outcome``).
KINDS = ("http", "idempotent", "probe", "conditional", "manual")


@dataclass
class Scripted:
    """Answers each request with the next status of ``script`` (201 once it is empty); every
    status but 429 counts as executed (a 503 may come after the work started)."""

    script: deque[int] = field(default_factory=deque)
    received: list[str] = field(default_factory=list)
    executed: int = 0
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        if request.path.startswith("/lookup/"):
            return web.json_response({"found": False}, status=404)
        self.received.append(request.headers.get("Idempotency-Key", ""))
        status = self.script.popleft() if self.script else 201
        if status != 429:
            self.executed += 1
        return web.json_response({"executed": self.executed}, status=status)

    async def start(self) -> Scripted:
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
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    server = await Scripted().start()
    yield server
    await server.stop()


def _downstreams(url: str) -> list[dict[str, Any]]:
    common = {"url": url, "timeout_ms": 2_000}
    extra: dict[str, dict[str, Any]] = {
        "idempotent": {"dedupe_window_ms": 60_000},
        "probe": {"probe": {"path": "/lookup/{effectId}", "settle_ms": 60_000}},
    }
    plain = [{"name": kind, "adapter": kind, **extra.get(kind, {}), **common} for kind in KINDS]
    return [
        *plain,
        # The same statuses, the other way round, by configuration.
        {"name": "tuned", "outcomes": {"committed": [503], "unknown": [429]}, **common},
        {
            "name": "tuned-idempotent",
            "adapter": "idempotent",
            "dedupe_window_ms": 60_000,
            "outcomes": {"not_applied": [503]},
            **common,
        },
    ]


@pytest.fixture
async def api(store_url: str, key_prefix: str, scripted: Scripted) -> AsyncIterator[Api]:
    config = make_config(
        store_url,
        key_prefix,
        downstreams=_downstreams(scripted.url),
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def _lease(api: Api) -> Lease:
    await api.put("t1")
    return await api.claim("t1", ttl_ms=30_000)


async def _send(api: Api, lease: Lease, downstream: str) -> Sent:
    async with api.client.post(
        f"/proxy/{downstream}/charges", json={"amount": 5}, headers=fence_headers(lease)
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def _record(api: Api, sent: Sent) -> dict[str, Any]:
    answer = await api.call("GET", f"/v1/effects/{sent.headers['Fence-Effect-Id']}")
    assert answer.status == 200, answer.body
    record: dict[str, Any] = answer.body
    return record


@pytest.mark.parametrize("kind", KINDS)
async def test_429_is_not_applied_and_the_retry_goes_through_once(
    api: Api, scripted: Scripted, kind: str
) -> None:
    scripted.script.extend([429])
    lease = await _lease(api)
    refused = await _send(api, lease, kind)
    assert refused.status == 429  # the agent sees what the downstream said
    assert refused.headers["Fence-Effect-State"] == EffectState.NOT_APPLIED.value
    assert refused.headers["Fence-Replayed"] == "false"
    record = await _record(api, refused)
    assert record["state"] == "NOT_APPLIED"
    assert record["attempts"][0]["reason"] == "status 429: refused before it was processed"

    retry = await _send(api, lease, kind)
    assert retry.status == 201 and retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert retry.headers["Fence-Replayed"] == "false"
    duplicate = await _send(api, lease, kind)
    assert duplicate.status == 201 and duplicate.headers["Fence-Replayed"] == "true"

    assert len(scripted.received) == 2 and scripted.executed == 1
    assert scripted.received[0] == scripted.received[1]  # one effect, one key
    record = await _record(api, retry)
    assert [a["outcome"] for a in record["attempts"]] == ["NOT_APPLIED", "COMMITTED"]


@pytest.mark.parametrize("kind", KINDS)
async def test_503_is_unknown_not_committed(api: Api, scripted: Scripted, kind: str) -> None:
    scripted.script.extend([503])
    lease = await _lease(api)
    busy = await _send(api, lease, kind)
    assert busy.status == 503
    assert busy.headers["Fence-Effect-State"] == EffectState.UNKNOWN.value
    record = await _record(api, busy)
    assert record["state"] == "UNKNOWN"
    assert record["attempts"][0]["reason"] == "status 503"
    assert len(scripted.received) == 1


@pytest.mark.parametrize("kind", ["http", "manual", "conditional"])
async def test_503_then_a_retry_is_effect_unknown_without_a_second_send(
    api: Api, scripted: Scripted, kind: str
) -> None:
    """Kinds that cannot prove a re-send harmless (``conditional`` without a precondition is
    one of them) never send the effect again: an operator settles it."""
    scripted.script.extend([503])
    lease = await _lease(api)
    await _send(api, lease, kind)
    retry = await _send(api, lease, kind)
    assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN", retry.body
    assert retry.headers["Fence-Effect-State"] == "UNKNOWN"
    assert len(scripted.received) == 1 and scripted.executed == 1


async def test_503_on_idempotent_is_resent_under_its_original_key(
    api: Api, scripted: Scripted
) -> None:
    """The deduplicating downstream answers the re-send with the first outcome."""
    scripted.script.extend([503])
    lease = await _lease(api)
    await _send(api, lease, "idempotent")
    retry = await _send(api, lease, "idempotent")
    assert retry.status == 201 and retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert len(scripted.received) == 2
    assert scripted.received[0] == scripted.received[1]


async def test_outcomes_override_wins_over_both_defaults(api: Api, scripted: Scripted) -> None:
    scripted.script.extend([503])
    lease = await _lease(api)
    committed = await _send(api, lease, "tuned")
    assert committed.status == 503 and committed.headers["Fence-Effect-State"] == "COMMITTED"
    replayed = await _send(api, lease, "tuned")
    assert replayed.status == 503 and replayed.headers["Fence-Replayed"] == "true"
    assert len(scripted.received) == 1
    record = await _record(api, committed)
    assert record["attempts"][0]["reason"] == "status 503 (configured outcome)"

    await api.put("t2")
    other = await api.claim("t2", ttl_ms=30_000)
    scripted.script.extend([429])
    unknown = await _send(api, other, "tuned")
    assert unknown.status == 429 and unknown.headers["Fence-Effect-State"] == "UNKNOWN"
    retry = await _send(api, other, "tuned")
    assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN"
    assert len(scripted.received) == 2


async def test_outcomes_override_on_another_kind(api: Api, scripted: Scripted) -> None:
    scripted.script.extend([503])
    lease = await _lease(api)
    refused = await _send(api, lease, "tuned-idempotent")
    assert refused.status == 503 and refused.headers["Fence-Effect-State"] == "NOT_APPLIED"
    retry = await _send(api, lease, "tuned-idempotent")
    assert retry.status == 201 and retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert len(scripted.received) == 2
