"""Probe answers are read to the end (issue 25, "probe answers cut short").

The prober read a probe's answer with one ``read(65536)``: an answer that arrives in pieces
was stored cut short and replayed to every duplicate (or, with a ``json_field``, read as
inconclusive for good). Now it is read to the end within the same 64 KiB bound
(``forward.read_up_to``); a longer answer is judged by its status alone (a ``json_field``
cannot be read, so that is inconclusive) and stored without a body, never cut short.

The downstream answers the order itself 500 (UNKNOWN, deterministically) and its lookup in
pieces, each written and flushed before a pause, so one read gets the first piece only. What
ran is counted there. Every store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.reconcile import _PROBE_BODY_LIMIT
from tests.api import Api
from tests.conftest import build_test_store, make_config
from tests.test_adapters import call, record

pytestmark = pytest.mark.timeout(30)

#: The pieces of a lookup's answer are this far apart: one read of the old prober got one.
PIECE_GAP_S = 0.05


class Orders:
    """``POST /orders``: the order is created (counted), then the answer is a 500. ``GET
    /orders/by-key/{key}``: 200 with ``answer`` (JSON), sent in ``pieces`` flushed pieces."""

    def __init__(self) -> None:
        self.creates = 0
        self.lookups = 0
        self.answer: bytes = b""
        self.pieces = 4
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def create(self, request: web.Request) -> web.Response:
        await request.read()
        self.creates += 1
        return web.json_response({"error": "lost"}, status=500)

    async def lookup(self, request: web.Request) -> web.StreamResponse:
        self.lookups += 1
        answer = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        answer.enable_chunked_encoding()
        await answer.prepare(request)
        size = -(-len(self.answer) // self.pieces)
        with contextlib.suppress(ConnectionResetError):  # a prober that read enough leaves
            for start in range(0, len(self.answer), size):
                await answer.write(self.answer[start : start + size])
                await asyncio.sleep(PIECE_GAP_S)
            await answer.write_eof()
        return answer

    async def start(self) -> Orders:
        app = web.Application()
        app.router.add_post("/orders", self.create)
        app.router.add_get("/orders/by-key/{key}", self.lookup)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def orders() -> AsyncIterator[Orders]:
    server = await Orders().start()
    yield server
    await server.stop()


@pytest.fixture
async def api(store_url: str, key_prefix: str, orders: Orders) -> AsyncIterator[Api]:
    def probe(name: str, **json_field: Any) -> dict[str, Any]:
        return {
            "name": name,
            "url": orders.url,
            "adapter": "probe",
            "probe": {"path": "/orders/by-key/{effectId}", "settle_ms": 0, **json_field},
        }

    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            probe("orders"),
            probe("orders-json", json_field="status", found_values=["created"]),
        ],
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def unknown_order(api: Api, orders: Orders, downstream: str) -> tuple[Any, str]:
    await api.put("t1")
    lease = await api.claim("t1")
    lost = await call(api, lease, "POST", f"{downstream}/orders", body={"item": "book"})
    assert lost.status == 500 and lost.headers["Fence-Effect-State"] == "UNKNOWN", lost.body
    return lease, lost.headers["Fence-Effect-Id"]


async def reconcile(api: Api, effect_id: str) -> dict[str, Any]:
    answer = await api.call("POST", f"/v1/effects/{effect_id}/reconcile")
    assert answer.status == 200, answer.body
    body: dict[str, Any] = answer.body
    return body


def lookup_answer(size: int) -> bytes:
    """A JSON answer of about ``size`` bytes that says the order was created."""
    padding = max(size - 40, 0)
    return json.dumps({"status": "created", "note": "x" * padding}).encode()


@pytest.mark.parametrize("downstream", ["orders", "orders-json"])
async def test_an_answer_in_pieces_is_stored_whole_and_replayed_whole(
    api: Api, orders: Orders, downstream: str
) -> None:
    orders.answer = lookup_answer(20_000)
    lease, effect_id = await unknown_order(api, orders, downstream)
    settled = await reconcile(api, effect_id)
    assert settled["state"] == "COMMITTED", settled
    assert orders.lookups == 1 and orders.creates == 1

    replay = await call(api, lease, "POST", f"{downstream}/orders", body={"item": "book"})
    assert replay.status == 200 and replay.headers["Fence-Replayed"] == "true"
    assert replay.body == orders.answer  # whole, not the first piece
    assert orders.creates == 1


async def test_an_answer_over_the_bound_is_judged_by_its_status_and_stored_without_a_body(
    api: Api, orders: Orders
) -> None:
    orders.answer = lookup_answer(_PROBE_BODY_LIMIT + 10_000)
    lease, effect_id = await unknown_order(api, orders, "orders")
    settled = await reconcile(api, effect_id)
    assert settled["state"] == "COMMITTED", settled
    response = (await record(api, effect_id))["response"]
    assert response["bodyOmitted"] is True and response["source"] == "probe", response
    assert response["bodyOmittedReason"] == f"probe answer over {_PROBE_BODY_LIMIT} bytes"

    replay = await call(api, lease, "POST", "orders/orders", body={"item": "book"})
    assert replay.status == 200 and replay.headers["Fence-Replayed"] == "true"
    assert replay.headers["Fence-Replay-Body"] == "omitted"
    assert replay.body == b""  # never a body cut short
    assert orders.creates == 1


async def test_an_answer_over_the_bound_cannot_show_its_json_field(
    api: Api, orders: Orders
) -> None:
    """With a ``json_field`` the verdict needs the body: past the bound it is inconclusive
    (the effect stays UNKNOWN), never read from a piece of it."""
    orders.answer = lookup_answer(_PROBE_BODY_LIMIT + 10_000)
    _, effect_id = await unknown_order(api, orders, "orders-json")
    settled = await reconcile(api, effect_id)
    assert settled["state"] == "UNKNOWN", settled
    assert orders.lookups == 1 and orders.creates == 1
