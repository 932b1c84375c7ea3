"""The MCP side of ``fencegate demo``: a minimal MCP tool server, and the agents that call it
through the gateway, both in plain aiohttp (the demo needs nothing the gateway does not).

The server is also a picture of what an MCP tool server sees behind the gateway. It speaks
MCP's streamable HTTP with JSON answers, handshake era (``initialize``, revision 2025-06-18):

* ``POST /mcp`` with one JSON-RPC message: ``initialize`` (hands out an ``Mcp-Session-Id``),
  ``notifications/initialized`` (202, as every notification), ``ping``, ``tools/list`` (two
  tools) and ``tools/call``;
* ``GET /mcp`` is 405: this server has no stream of its own to offer.

Its two tools: ``send_invoice`` has no annotations, so the gateway treats every call of it as
an effect (once in the ledger, never sent twice); ``get_invoice`` is ``readOnlyHint``, so the
gateway fence-checks it and relays it without a ledger entry. Every tool the server runs is
kept in ``runs`` with what identifies it: ``params._meta["dev.fencegate/effectId"]`` and
``["dev.fencegate/fencingToken"]``, which the gateway adds to each recorded call (a read has
none; it also sends them under their older ``fencegate/`` names, for at least one release).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from fencegate.lease import Lease

__all__ = ["PROTOCOL_VERSION", "McpAgent", "McpAnswer", "McpRun", "McpToolServer"]

PROTOCOL_VERSION = "2025-06-18"
EFFECT_ID = "dev.fencegate/effectId"
FENCING_TOKEN = "dev.fencegate/fencingToken"
REPLAYED = "dev.fencegate/replayed"

TOOLS: list[dict[str, Any]] = [
    {
        "name": "send_invoice",
        "description": "Email an invoice to a customer.",
        "inputSchema": {
            "type": "object",
            "properties": {"customer": {"type": "string"}, "amount": {"type": "integer"}},
            "required": ["customer", "amount"],
        },
        # No annotations: the gateway takes it for an effect (never sent twice).
    },
    {
        "name": "get_invoice",
        "description": "Look an invoice up.",
        "inputSchema": {
            "type": "object",
            "properties": {"invoice": {"type": "string"}},
            "required": ["invoice"],
        },
        "annotations": {"readOnlyHint": True},
    },
]


@dataclass
class McpRun:
    """One run of a tool, as the server saw it."""

    tool: str
    arguments: dict[str, Any]
    #: ``params._meta["dev.fencegate/effectId"]``: None for a call the gateway did not record.
    effect_id: str | None
    #: ``params._meta["dev.fencegate/fencingToken"]``: "{schedulerEpoch}.{claimGeneration}"
    #: (None for a keyed call: it has no lease).
    fencing_token: str | None


@dataclass
class McpToolServer:
    """A tool server for invoices. ``send_invoice`` takes ``send_delay_s`` to answer."""

    send_delay_s: float = 0.0
    runs: list[McpRun] = field(default_factory=list)
    invoices: dict[str, dict[str, Any]] = field(default_factory=dict)
    sessions: set[str] = field(default_factory=set)
    #: Every message received: (method, JSON-RPC id), in order.
    received: list[tuple[str, Any]] = field(default_factory=list)
    #: Set when a tool starts to run (before ``send_delay_s``): a call the gateway records
    #: reaches the server only once it is in the ledger, so from then on an agent that gives
    #: up has lost only the answer, never the call.
    started: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    url: str = ""

    async def _post(self, request: web.Request) -> web.Response:
        try:
            message = json.loads(await request.read())
        except ValueError:
            return _error(None, -32700, "Parse error", status=400)
        if not isinstance(message, dict):
            return _error(None, -32600, "Invalid Request: one JSON-RPC message per POST", 400)
        method, params = message.get("method"), message.get("params") or {}
        self.received.append((str(method), message.get("id")))
        if "id" not in message:  # a notification (notifications/initialized...): no answer
            return web.Response(status=202)
        request_id = message["id"]
        if method == "initialize":
            session = uuid.uuid4().hex
            self.sessions.add(session)
            result = {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "demo-invoices", "version": "1.0"},
            }
            return _answer(request_id, result, {"Mcp-Session-Id": session})
        session = request.headers.get("Mcp-Session-Id", "")
        if session not in self.sessions:
            return _error(request_id, -32600, "Session not found", status=404)
        if method == "ping":
            return _answer(request_id, {})
        if method == "tools/list":
            return _answer(request_id, {"tools": TOOLS})
        if method == "tools/call":
            return _answer(request_id, await self._call(params))
        return _error(request_id, -32601, f"Method not found: {method}")

    async def _call(self, params: Mapping[str, Any]) -> dict[str, Any]:
        name, arguments = params.get("name"), params.get("arguments") or {}
        meta = params.get("_meta") or {}
        if name not in ("send_invoice", "get_invoice"):
            return {"content": [_text(f"Unknown tool: {name}")], "isError": True}
        self.runs.append(McpRun(name, arguments, meta.get(EFFECT_ID), meta.get(FENCING_TOKEN)))
        self.started.set()
        if name == "send_invoice":
            number = f"inv-{len(self.invoices) + 1}"
            invoice = {"invoice": number, **arguments, "status": "sent"}
            self.invoices[number] = invoice
            await asyncio.sleep(self.send_delay_s)
        else:
            invoice = self.invoices.get(str(arguments.get("invoice")), {"status": "no such"})
        return {"content": [_text(json.dumps(invoice))], "structuredContent": invoice}

    async def _get(self, request: web.Request) -> web.Response:
        return web.Response(status=405, headers={"Allow": "POST"})

    def runs_of(self, tool: str) -> list[McpRun]:
        return [run for run in self.runs if run.tool == tool]

    async def start(self) -> McpToolServer:
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        app.router.add_get("/mcp", self._get)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        port: int = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{port}/mcp"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _answer(request_id: Any, result: Any, headers: Mapping[str, str] | None = None) -> web.Response:
    answer = {"jsonrpc": "2.0", "id": request_id, "result": result}
    return web.json_response(answer, headers=headers)


def _error(request_id: Any, code: int, message: str, status: int = 200) -> web.Response:
    error = {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}
    return web.json_response(error, status=status)


# --- the agents' side: an MCP client in a few lines ----------------------------------------------


@dataclass
class McpAnswer:
    """One JSON-RPC answer, and the gateway's headers around it."""

    status: int
    headers: Mapping[str, str]
    message: dict[str, Any]

    @property
    def id(self) -> Any:
        return self.message.get("id")

    @property
    def result(self) -> dict[str, Any]:
        result = self.message.get("result")
        return result if isinstance(result, dict) else {}

    @property
    def error(self) -> dict[str, Any] | None:
        error = self.message.get("error")
        return error if isinstance(error, dict) else None

    @property
    def problem(self) -> str | None:
        """A gateway refusal's problem code (``error.data.code``: FENCED...)."""
        data = (self.error or {}).get("data")
        code = data.get("code") if isinstance(data, dict) else None
        return code if isinstance(code, str) else None

    @property
    def replayed(self) -> bool:
        meta = self.result.get("_meta")
        return isinstance(meta, dict) and meta.get(REPLAYED) is True

    @property
    def content(self) -> Any:
        return self.result.get("structuredContent")


@dataclass
class McpAgent:
    """An agent's MCP client: one session with the server through the gateway's
    ``/mcp/{downstream}``. Under a lease, every request carries ``lease.mcp_headers()``."""

    http: aiohttp.ClientSession
    url: str
    lease: Lease | None = None
    session: str | None = None
    protocol: str | None = None
    last_id: int = 0
    #: The HTTP status of ``notifications/initialized`` (202: accepted, no answer).
    initialized: int = 0

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json, text/event-stream"}
        if self.session is not None:
            headers["Mcp-Session-Id"] = self.session
        if self.protocol is not None:
            headers["MCP-Protocol-Version"] = self.protocol
        if self.lease is not None:
            headers.update(self.lease.mcp_headers())
        return headers

    async def _post(self, message: dict[str, Any]) -> tuple[int, Any, bytes]:
        async with self.http.post(self.url, json=message, headers=self.headers()) as resp:
            return resp.status, resp.headers, await resp.read()

    async def request(self, method: str, params: dict[str, Any] | None = None) -> McpAnswer:
        """One JSON-RPC request (ids 1, 2, 3... in this session), and its answer."""
        self.last_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": self.last_id, "method": method}
        if params is not None:
            message["params"] = params
        status, headers, body = await self._post(message)
        answer = json.loads(body) if body else {}
        return McpAnswer(status, headers, answer if isinstance(answer, dict) else {})

    async def notify(self, method: str) -> int:
        status, _, _ = await self._post({"jsonrpc": "2.0", "method": method})
        return status

    async def initialize(self) -> McpAnswer:
        """The handshake: ``initialize``, then ``notifications/initialized``."""
        answer = await self.request(
            "initialize",
            {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "fencegate-demo", "version": "1.0"},
            },
        )
        self.session = answer.headers.get("Mcp-Session-Id")
        self.protocol = answer.result.get("protocolVersion")
        self.initialized = await self.notify("notifications/initialized")
        return answer

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> McpAnswer:
        return await self.request("tools/call", {"name": name, "arguments": arguments})
