"""A real HTTP downstream on loopback that remembers every call it received.

Its behaviour is chosen by path, so one server serves every proxy test:

| path | answer |
|---|---|
| ``/ok/...`` | 200 JSON ``{"calls": n}`` (n = calls so far with this Idempotency-Key) |
| ``/slow/{ms}/...`` | sleeps ``ms`` then answers like ``/ok`` (the effect happens) |
| ``/held/...`` | waits for ``release`` (set by the test) then answers like ``/ok`` |
| ``/status/{code}`` | that status, JSON body |
| ``/big/{bytes}`` | 200 with a body of that many bytes |
| ``/reset`` | reads the request, then drops the connection without answering |
| ``/redirect`` | 302 to another host |
| ``/cookie`` | 200 with Set-Cookie and a hop-by-hop field named in Connection |
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["Downstream", "Received"]


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Downstream:
    received: list[Received] = field(default_factory=list)
    per_key: Counter[str] = field(default_factory=Counter)
    #: Set whenever a call arrives.
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    #: What a ``/held/...`` call waits for before it answers.
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def calls(self, path_prefix: str = "") -> list[Received]:
        return [r for r in self.received if r.path.startswith(path_prefix)]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = request.headers.get("Idempotency-Key", "")
        self.received.append(
            Received(request.method, request.raw_path, dict(request.headers), body)
        )
        self.per_key[key] += 1
        self.arrived.set()
        parts = request.path.strip("/").split("/")
        kind = parts[0] if parts else ""
        answer: dict[str, Any] = {"calls": self.per_key[key], "path": request.path_qs}
        if kind == "slow":
            await asyncio.sleep(int(parts[1]) / 1000)
        elif kind == "held":
            await self.release.wait()
        elif kind == "status":
            return web.json_response(answer, status=int(parts[1]))
        elif kind == "big":
            return web.Response(body=b"x" * int(parts[1]))
        elif kind == "reset":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.1)
            raise ConnectionResetError
        elif kind == "redirect":
            raise web.HTTPFound("http://127.0.0.2:1/elsewhere")
        elif kind == "cookie":
            return web.json_response(
                answer,
                headers={
                    "Set-Cookie": "session=secret",
                    "Connection": "X-Private",
                    "X-Private": "hop",
                    "X-Kept": "yes",
                    "Fence-Replayed": "true",
                },
            )
        return web.json_response(answer)

    async def start(self) -> Downstream:
        app = web.Application(client_max_size=64 * 1024 * 1024)
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
