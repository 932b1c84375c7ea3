"""Downstreams whose effects outlive the gateway's patience, on loopback, counting executions.

One aiohttp app serves three APIs. Behaviour is switched on the server object (not by query
parameters: the query is part of the payload digest, and a story's retries must be the same
payload as its first call):

* ``/charges`` (POST): a Stripe-like API that deduplicates on ``Idempotency-Key`` for a REAL,
  finite window (``dedupe_window_ms``): a repeated key inside the window gets the first answer
  (``Idempotent-Replayed: true``) and executes nothing; after the window the key is forgotten
  and a repeat executes (charges) again. ``executed`` lists the keys of every execution.
* ``/orders`` (POST) and ``/orders/by-key/{key}`` (GET): a queue-backed API. A create is
  accepted (202), and the order is created (visible to the lookup) only ``apply_after_ms``
  after the request arrived, or never (``apply_after_ms = None``: the queue lost it). Creates
  are not deduplicated: two requests that both land make two orders (``order_creates``).
* ``/docs/{name}`` (PATCH, PUT, POST; GET): a document store with real ETag preconditions
  (``If-Match: <etag>``, ``If-None-Match: *``); without a precondition every request writes
  (``doc_writes``), so a second delivery is a second write.

``answer_delay_ms`` makes every answer leave that long after the effect was applied (the lost
answer: set it past the gateway's timeout). ``unavailable`` answers 503 before doing anything.

The app state lives on this object, and ``stop_listening`` / ``listen`` close and reopen only
the TCP listener, on the same port: while it is closed, a forward gets "connection refused"
(certainly not delivered), and what the downstream remembers survives the outage.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["LateServers"]


@dataclass
class LateServers:
    #: How long ``/charges`` remembers an idempotency key, from the request that created it.
    dedupe_window_ms: int = 800
    #: Every answer leaves this long after the effect was applied.
    answer_delay_ms: int = 0
    #: ``/charges``: 503 before anything is executed (the outcomes override maps it).
    unavailable: bool = False
    #: ``/orders``: the order appears this long after the request arrived; None: never.
    apply_after_ms: int | None = 0

    #: Requests received, by route name (``charges``, ``orders``, ``docs``, ``lookup``).
    received: Counter[str] = field(default_factory=Counter)
    #: Idempotency key of every charge executed (a repeat after the window shows up twice).
    executed: list[str] = field(default_factory=list)
    #: key -> (monotonic expiry, first answer)
    _dedupe: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    order_creates: int = 0
    docs: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    doc_writes: int = 0
    #: Requests still being handled (a delayed answer counts until it is sent).
    busy: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    _pending: set[asyncio.Task[None]] = field(default_factory=set)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- what the downstream knows ------------------------------------------------------------

    def remembers(self, key: str) -> bool:
        """Is ``key`` still inside ``/charges``' deduplication window?"""
        entry = self._dedupe.get(key)
        return entry is not None and time.monotonic() < entry[0]

    async def settled(self) -> None:
        """Wait until no request is in the middle of its (delayed) answer."""
        while self.busy:
            self.idle.clear()
            await self.idle.wait()

    async def landed(self, creates: int, timeout_s: float = 5.0) -> None:
        """Wait until ``order_creates`` reaches ``creates``."""
        async with asyncio.timeout(timeout_s):
            while self.order_creates < creates:
                await asyncio.sleep(0.01)

    async def written(self, writes: int, timeout_s: float = 5.0) -> None:
        """Wait until ``doc_writes`` reaches ``writes``: on a loaded machine the gateway's
        timeout can fire before the request it sent is handled here."""
        await self.until(lambda: self.doc_writes >= writes, timeout_s)

    async def until(self, ready: Callable[[], bool], timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not ready():
                await asyncio.sleep(0.01)

    # --- the APIs -----------------------------------------------------------------------------

    async def _answer_late(self) -> None:
        if self.answer_delay_ms:
            await asyncio.sleep(self.answer_delay_ms / 1000)

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.busy += 1
        try:
            response: web.StreamResponse = await handler(request)
            return response
        finally:
            self.busy -= 1
            if not self.busy:
                self.idle.set()

    async def charge(self, request: web.Request) -> web.Response:
        self.received["charges"] += 1
        body = await request.json()
        if self.unavailable:
            return web.json_response({"error": "try again later"}, status=503)
        key = request.headers.get("Idempotency-Key", "")
        now = time.monotonic()
        entry = self._dedupe.get(key)
        if entry is not None and now < entry[0]:
            return web.json_response(entry[1], headers={"Idempotent-Replayed": "true"})
        self.executed.append(key)
        answer = {"id": f"ch_{len(self.executed)}", "amount": body.get("amount")}
        self._dedupe[key] = (now + self.dedupe_window_ms / 1000, answer)
        await self._answer_late()
        return web.json_response(answer)

    async def _create_order(self, key: str, body: Any, after_ms: int) -> None:
        await asyncio.sleep(after_ms / 1000)
        self.order_creates += 1
        self.orders[key] = {"id": f"ord_{self.order_creates}", "status": "created", **body}

    async def orders_create(self, request: web.Request) -> web.Response:
        self.received["orders"] += 1
        key = request.headers.get("Idempotency-Key", "")
        body = await request.json()
        if self.apply_after_ms is not None:
            task = asyncio.get_running_loop().create_task(
                self._create_order(key, body, self.apply_after_ms)
            )
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        await self._answer_late()
        return web.json_response({"status": "accepted"}, status=202)

    async def orders_lookup(self, request: web.Request) -> web.Response:
        self.received["lookup"] += 1
        order = self.orders.get(request.match_info["key"])
        if order is None:
            return web.json_response({"error": "no such order"}, status=404)
        return web.json_response(order)

    async def docs_write(self, request: web.Request) -> web.Response:
        self.received["docs"] += 1
        name = request.match_info["name"]
        body = await request.read()
        current = self.docs.get(name)
        if request.headers.get("If-None-Match") == "*" and current is not None:
            return web.Response(status=412, text="precondition failed: the document exists")
        if_match = request.headers.get("If-Match")
        if if_match is not None and (current is None or current[1] != if_match):
            return web.Response(status=412, text="precondition failed: ETag mismatch")
        self.doc_writes += 1
        etag = f'"{self.doc_writes}-{hashlib.sha256(body).hexdigest()[:16]}"'
        self.docs[name] = (body, etag)
        await self._answer_late()
        return web.Response(status=200, headers={"ETag": etag})

    async def docs_read(self, request: web.Request) -> web.Response:
        current = self.docs.get(request.match_info["name"])
        if current is None:
            return web.Response(status=404)
        return web.Response(body=current[0], headers={"ETag": current[1]})

    # --- the listener -------------------------------------------------------------------------

    async def listen(self) -> LateServers:
        """Start serving (again): the first time on a free port, later on the same one."""
        assert self.runner is None, "already listening"
        app = web.Application(middlewares=[self._track])
        app.router.add_post("/charges", self.charge)
        app.router.add_post("/orders", self.orders_create)
        app.router.add_get("/orders/by-key/{key}", self.orders_lookup)
        for method in ("PATCH", "PUT", "POST"):
            app.router.add_route(method, "/docs/{name}", self.docs_write)
        app.router.add_get("/docs/{name}", self.docs_read)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.runner = runner
        return self

    async def stop_listening(self) -> None:
        """Close the listener and every connection; the state (keys, orders...) stays."""
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    async def close(self) -> None:
        await self.stop_listening()
        for task in list(self._pending):
            task.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
