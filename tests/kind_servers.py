"""Downstreams that really behave like the kinds of API the adapters are for, on loopback.

One aiohttp app serves four APIs, each counting what it actually *executed*:

* ``/stripe/charges`` (POST): deduplicates on ``Idempotency-Key`` like Stripe: a repeated
  key gets the first answer back, marked ``Idempotent-Replayed: true``, and executes nothing.
* ``/orders`` (POST) and ``/orders/by-key/{key}`` (GET): creates an order under the request's
  key; the lookup answers 200 ``{"status": "created"}`` or 404.
* ``/s3/{bucket}/{name}`` (PUT, GET): an object store with real ETag preconditions:
  ``If-None-Match: *`` fails with 412 when the object exists, ``If-Match: <etag>`` fails with
  412 unless the current ETag matches.
* ``/mail/send`` (POST): sends (records) every message; no key, no lookup, no conditions.

``?delay_ms=N`` makes any of them apply the effect first and answer N ms later;
``?hold=1`` makes them apply it and answer only once ``release`` is set (the lost answer:
the gateway's timer ends the call, however slow the machine); ``?apply=0`` on ``/orders``
makes the create fail before applying (500 after the delay or hold). ``?status=N`` on
``/mail/send`` answers N after sending.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["KindServers"]


@dataclass
class KindServers:
    charges: Counter[str] = field(default_factory=Counter)
    charge_answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    order_creates: int = 0
    probes: int = 0
    objects: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    object_writes: int = 0
    sent: list[bytes] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    #: Requests still being handled (a delayed answer counts until it is sent).
    busy: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: ``?hold=1`` requests that got as far as their answer (held until ``release``).
    held: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    _held_more: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def settled(self) -> None:
        """Wait until no request is in the middle of its (delayed) answer."""
        while self.busy:
            self.idle.clear()
            await self.idle.wait()

    async def holding(self, count: int) -> None:
        """Wait until ``count`` held requests got as far as their answer."""
        while self.held < count:
            self._held_more.clear()
            await self._held_more.wait()

    async def _delay(self, request: web.Request) -> None:
        if request.query.get("hold") == "1":
            self.held += 1
            self._held_more.set()
            await self.release.wait()
        delay = int(request.query.get("delay_ms", "0"))
        if delay:
            await asyncio.sleep(delay / 1000)

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.busy += 1
        self.headers_seen.append(dict(request.headers))
        try:
            response: web.StreamResponse = await handler(request)
            return response
        finally:
            self.busy -= 1
            if not self.busy:
                self.idle.set()

    async def stripe_charge(self, request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key", "")
        body = await request.json()
        if key and key in self.charge_answers:
            answer = self.charge_answers[key]
            return web.json_response(answer, headers={"Idempotent-Replayed": "true"})
        self.charges[key] += 1
        answer = {"id": f"ch_{sum(self.charges.values())}", "amount": body.get("amount")}
        if key:
            self.charge_answers[key] = answer
        await self._delay(request)
        return web.json_response(answer, status=200)

    async def orders_create(self, request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key", "")
        body = await request.json()
        if request.query.get("apply") == "0":
            await self._delay(request)
            return web.json_response({"error": "failed before applying"}, status=500)
        self.order_creates += 1
        self.orders[key] = {"id": f"ord_{self.order_creates}", "status": "created", **body}
        await self._delay(request)
        return web.json_response(self.orders[key], status=201)

    async def orders_lookup(self, request: web.Request) -> web.Response:
        self.probes += 1
        order = self.orders.get(request.match_info["key"])
        if order is None:
            return web.json_response({"error": "no such order"}, status=404)
        return web.json_response(order)

    async def s3_put(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = await request.read()
        current = self.objects.get(name)
        if request.headers.get("If-None-Match") == "*" and current is not None:
            return web.Response(status=412, text="PreconditionFailed: object exists")
        if_match = request.headers.get("If-Match")
        if if_match is not None and (current is None or current[1] != if_match):
            return web.Response(status=412, text="PreconditionFailed: ETag mismatch")
        etag = '"' + hashlib.md5(body).hexdigest() + '"'
        self.objects[name] = (body, etag)
        self.object_writes += 1
        await self._delay(request)
        return web.Response(status=200, headers={"ETag": etag})

    async def s3_get(self, request: web.Request) -> web.Response:
        current = self.objects.get(request.match_info["name"])
        if current is None:
            return web.Response(status=404)
        return web.Response(body=current[0], headers={"ETag": current[1]})

    async def mail_send(self, request: web.Request) -> web.Response:
        self.sent.append(await request.read())
        await self._delay(request)
        status = int(request.query.get("status", "202"))
        return web.json_response({"queued": len(self.sent)}, status=status)

    async def start(self) -> KindServers:
        app = web.Application(middlewares=[self._track])
        app.router.add_post("/stripe/charges", self.stripe_charge)
        app.router.add_post("/orders", self.orders_create)
        app.router.add_get("/orders/by-key/{key}", self.orders_lookup)
        app.router.add_put("/s3/{bucket}/{name}", self.s3_put)
        app.router.add_get("/s3/{bucket}/{name}", self.s3_get)
        app.router.add_post("/mail/send", self.mail_send)
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


def json_body(raw: bytes) -> Any:
    return json.loads(raw)
