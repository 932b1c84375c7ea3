"""Downstreams whose effects outlive the gateway's patience, on loopback, counting executions.

One aiohttp app serves three APIs. Behaviour is switched on the server object (not by query
parameters: the query is part of the payload digest, and a story's retries must be the same
payload as its first call):

* ``/charges`` (POST): a Stripe-like API that deduplicates on ``Idempotency-Key`` for a
  finite window (``dedupe_window_ms``, on the server's own ``clock``, which only the test
  moves): a repeated key inside the window gets the first answer (``Idempotent-Replayed:
  true``) and executes nothing; after the window the key is forgotten and a repeat executes
  (charges) again. ``executed`` lists the keys of every execution.
* ``/orders`` (POST) and ``/orders/by-key/{key}`` (GET): a queue-backed API. A create is
  accepted (202); the order is created (visible to the lookup) at once (``queue = "apply"``),
  when the test calls ``release_orders`` (``"hold"``: it sits in the queue), or never
  (``"drop"``: the queue lost it). Creates are not deduplicated: two requests that both land
  make two orders (``order_creates``).
* ``/docs/{name}`` (PATCH, PUT, POST; GET): a document store with real ETag preconditions
  (``If-Match: <etag>``, ``If-None-Match: *``); without a precondition every request writes
  (``doc_writes``), so a second delivery is a second write.

``lose_answers`` makes every write apply its effect and then close the connection before any
answer leaves: the gateway certainly delivered the request and gets no answer (UNKNOWN) at
once. That is the lost answer whatever the load; a late answer raced the gateway's timer,
which on a loaded machine could fire before the request even arrived. ``unavailable``
answers 503 before doing anything.

The app state lives on this object, and ``stop_listening`` / ``listen`` close and reopen only
the TCP listener, on the same port: while it is closed, a forward gets "connection refused"
(certainly not delivered), and what the downstream remembers survives the outage. The port
stays ours meanwhile: a second socket holds it bound, never listening (``SO_REUSEPORT`` on
both, which Linux grants only to sockets of one user), so a connection to it is refused and no
other process's bind or outgoing connection can take it before ``listen`` binds it again. Every
answer closes its connection, so the gateway never holds an idle pooled connection that the
outage would break under a later forward.
"""

from __future__ import annotations

import hashlib
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from tests.clocks import ManualClock

__all__ = ["LateServers"]


@dataclass
class LateServers:
    #: How long ``/charges`` remembers an idempotency key, from the request that created it,
    #: on ``clock``.
    dedupe_window_ms: int = 800
    #: The clock of the deduplication window: it moves only when the test advances it.
    clock: ManualClock = field(default_factory=ManualClock)
    #: Every write applies its effect, then its connection closes before any answer.
    lose_answers: bool = False
    #: ``/charges``: 503 before anything is executed (the outcomes override maps it).
    unavailable: bool = False
    #: ``/orders``: create the order at once, hold it until ``release_orders``, or drop it.
    queue: Literal["apply", "hold", "drop"] = "apply"

    #: Requests received, by route name (``charges``, ``orders``, ``docs``, ``lookup``).
    received: Counter[str] = field(default_factory=Counter)
    #: Idempotency key of every charge executed (a repeat after the window shows up twice).
    executed: list[str] = field(default_factory=list)
    #: key -> (expiry on ``clock``, first answer)
    _dedupe: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    order_creates: int = 0
    #: Orders accepted while ``queue`` was ``"hold"``: (key, body), not created yet.
    held: list[tuple[str, Any]] = field(default_factory=list)
    docs: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    doc_writes: int = 0
    runner: web.AppRunner | None = None
    port: int = 0
    #: Bound to ``port`` and never listening, from the first ``listen`` to ``close``.
    _holder: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- what the downstream knows ------------------------------------------------------------

    def remembers(self, key: str) -> bool:
        """Is ``key`` still inside ``/charges``' deduplication window?"""
        entry = self._dedupe.get(key)
        return entry is not None and self.clock.now() < entry[0]

    def release_orders(self) -> None:
        """The queue gets to the held orders: each is created now."""
        held, self.held = self.held, []
        for key, body in held:
            self._create_order(key, body)

    # --- the APIs -----------------------------------------------------------------------------

    def _answer(self, request: web.Request, response: web.Response) -> web.Response:
        """``response``, or with ``lose_answers`` nothing: the effect is applied, and the
        connection closes before the answer can leave (aiohttp refuses to write it)."""
        if self.lose_answers:
            assert request.transport is not None
            request.transport.close()
        return response

    @web.middleware
    async def _close_after(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response: web.StreamResponse = await handler(request)
        response.force_close()
        return response

    async def charge(self, request: web.Request) -> web.Response:
        self.received["charges"] += 1
        body = await request.json()
        if self.unavailable:
            return web.json_response({"error": "try again later"}, status=503)
        key = request.headers.get("Idempotency-Key", "")
        now = self.clock.now()
        entry = self._dedupe.get(key)
        if entry is not None and now < entry[0]:
            return web.json_response(entry[1], headers={"Idempotent-Replayed": "true"})
        self.executed.append(key)
        answer = {"id": f"ch_{len(self.executed)}", "amount": body.get("amount")}
        self._dedupe[key] = (now + self.dedupe_window_ms / 1000, answer)
        return self._answer(request, web.json_response(answer))

    def _create_order(self, key: str, body: Any) -> None:
        self.order_creates += 1
        self.orders[key] = {"id": f"ord_{self.order_creates}", "status": "created", **body}

    async def orders_create(self, request: web.Request) -> web.Response:
        self.received["orders"] += 1
        key = request.headers.get("Idempotency-Key", "")
        body = await request.json()
        if self.queue == "apply":
            self._create_order(key, body)
        elif self.queue == "hold":
            self.held.append((key, body))
        return self._answer(request, web.json_response({"status": "accepted"}, status=202))

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
        return self._answer(request, web.Response(status=200, headers={"ETag": etag}))

    async def docs_read(self, request: web.Request) -> web.Response:
        current = self.docs.get(request.match_info["name"])
        if current is None:
            return web.Response(status=404)
        return web.Response(body=current[0], headers={"ETag": current[1]})

    # --- the listener -------------------------------------------------------------------------

    async def listen(self) -> LateServers:
        """Start serving (again): the first time on a port the system picks, later on the
        same one, which ``_holder`` kept meanwhile."""
        assert self.runner is None, "already listening"
        app = web.Application(middlewares=[self._close_after])
        app.router.add_post("/charges", self.charge)
        app.router.add_post("/orders", self.orders_create)
        app.router.add_get("/orders/by-key/{key}", self.orders_lookup)
        for method in ("PATCH", "PUT", "POST"):
            app.router.add_route(method, "/docs/{name}", self.docs_write)
        app.router.add_get("/docs/{name}", self.docs_read)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        listener = _reuseport_socket(self.port)
        self.port = listener.getsockname()[1]
        if self._holder is None:
            self._holder = _reuseport_socket(self.port)
        listener.listen()
        await web.SockSite(runner, listener).start()
        self.runner = runner
        return self

    async def stop_listening(self) -> None:
        """Close the listener and every connection; the state (keys, orders...) stays."""
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    async def close(self) -> None:
        await self.stop_listening()
        if self._holder is not None:
            self._holder.close()
            self._holder = None


def _reuseport_socket(port: int) -> socket.socket:
    """A TCP socket bound to 127.0.0.1:``port`` (0: one the system picks) with
    ``SO_REUSEPORT``, not listening yet."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock
