"""A real MCP server (the official ``mcp`` SDK, 2.x ``MCPServer``) for the MCP gateway tests.

Run it as a process::

    python -m tests.mcp_server --port P [--json-response] [--stateless] [--event-store]
        [--retry-ms MS] [--host 127.0.0.1]

It serves streamable HTTP at ``http://127.0.0.1:P/mcp`` (the SDK's default path). Both protocol
eras answer on that one endpoint, as the SDK routes them: a request carrying
``MCP-Protocol-Version: 2026-07-28`` takes the stateless per-request path (no ``initialize``, no
session id); anything else takes the handshake path, which is stateful (``Mcp-Session-Id``,
GET stream, DELETE) unless ``--stateless`` is given; ``--event-store`` adds SSE ``id:``s and
``Last-Event-ID`` resumption there (``--retry-ms`` sets the ``retry:`` hint). SSE answers by
default; ``--json-response`` makes plain JSON answers (then progress notifications are dropped).
DNS-rebinding protection (a ``Host`` allow-list) is off, so a gateway may forward any ``Host``.

Tools:

* ``counter(label) -> int``: no annotations; counts per label and returns the new count.
* ``lookup(key) -> str``: ``readOnlyHint``; returns ``"value-of-<key>"``.
* ``slow(steps, delay_ms) -> str``: ``steps`` progress notifications ``delay_ms`` apart (sent
  only when the request carries ``_meta.progressToken``), then ``"done <steps>"``.
* ``charge(account, amount, delay_ms=0) -> str``: ``idempotentHint``; dedupes on
  ``params._meta["fencegate/effectId"]``: one effect id charges once and answers the same text.
  ``delay_ms`` delays the answer of a first (charging) run only, after the charge is made, so a
  gateway timeout can lose the answer of a charge that happened while its re-send is answered at
  once from the dedupe record.
* ``sleepy(ms) -> str``: sleeps, then ``"slept <ms>"``.
* ``routed(region, label) -> int``: no annotations; counts like ``counter`` (its own labels).
  ``region`` is marked ``x-mcp-header: Region``, so a 2026-07-28 client mirrors it into an
  ``Mcp-Param-Region`` header, which it can only do once it has listed the tool: called before,
  the server refuses it with -32020 HEADER_MISMATCH (the tool does not run) and the SDK client
  lists the tools and re-sends the call once.
* ``drop(ms) -> str``: closes its own SSE response stream at once (handshake era, needs
  ``--event-store``; a no-op otherwise), then answers ``"dropped <ms>"`` after ``ms``, which the
  client gets by resuming with ``GET`` + ``Last-Event-ID``.
* ``fail(message) -> str``: raises ``ToolError``, so the answer is a result with ``isError: true``.
* ``reject(code, message) -> str``: raises ``MCPError``, so the answer is a JSON-RPC error with
  ``data = {"tool": "reject"}``.

What ran is counted at the server, never trusting a gateway:

* ``GET /executions``: ``{tool: [{"args": {...}, "meta": {...} | null, ...}, ...]}``, one entry per
  run of a tool body, in order, recorded when the body starts (``charge`` entries add
  ``effect_id`` and ``deduped``; ``counter`` adds ``result``; ``slow`` and ``sleepy`` add
  ``finished``, false until the body returns, so a cancelled run stays false).
* ``GET /state``: ``{"counters": {label: n}, "balances": {account: total charged}}``.
* ``DELETE /executions``: forget executions, counters, balances and effect ids.

``McpServerProcess`` starts it as a subprocess on a free port (no pytest needed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, cast

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import JSONRPCMessage, ToolAnnotations
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = ["EFFECT_ID_META_KEY", "McpServerProcess", "MemoryEventStore", "build_server", "main"]

#: The ``_meta`` key on ``tools/call`` params that carries the gateway's effect id.
EFFECT_ID_META_KEY = "fencegate/effectId"

_REPO = Path(__file__).resolve().parent.parent

_Handler = Callable[[Request], Awaitable[Response]]
_RouteDecorator = Callable[[_Handler], _Handler]


class _Record:
    """Everything the tools did, as the server saw it."""

    def __init__(self) -> None:
        self.executions: dict[str, list[dict[str, Any]]] = {}
        self.counters: dict[str, int] = {}
        self.balances: dict[str, int] = {}
        self.charges: dict[str, str] = {}  # effect id -> the answer it got

    def add(self, tool: str, args: dict[str, Any], ctx: Context, **extra: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {"args": args, "meta": _meta(ctx), **extra}
        self.executions.setdefault(tool, []).append(entry)
        return entry

    def clear(self) -> None:
        self.executions.clear()
        self.counters.clear()
        self.balances.clear()
        self.charges.clear()


def _meta(ctx: Context) -> dict[str, Any] | None:
    """The request's ``params._meta`` as sent (progress token under its wire name)."""
    params = ctx.request_context.params
    raw = params.get("_meta") if params is not None else None
    return dict(raw) if isinstance(raw, dict) else None


class MemoryEventStore(EventStore):
    """Every SSE event kept in memory, so a client can resume with ``Last-Event-ID``."""

    def __init__(self) -> None:
        self._events: list[tuple[StreamId, EventId, JSONRPCMessage | None]] = []

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = str(len(self._events) + 1)
        self._events.append((stream_id, event_id, message))
        return event_id

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        found = [i for i, (_, event_id, _) in enumerate(self._events) if event_id == last_event_id]
        if not found:
            return None
        stream_id = self._events[found[0]][0]
        for sid, event_id, message in self._events[found[0] + 1 :]:
            if sid == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream_id


def build_server(record: _Record | None = None) -> tuple[MCPServer, _Record]:
    rec = record if record is not None else _Record()
    mcp: MCPServer = MCPServer("fencegate-test-mcp", version="1.0.0", log_level="WARNING")

    @mcp.tool()
    async def counter(label: str, ctx: Context) -> int:
        """Count one more for label and return the new count (not idempotent)."""
        rec.counters[label] = rec.counters.get(label, 0) + 1
        rec.add("counter", {"label": label}, ctx, result=rec.counters[label])
        return rec.counters[label]

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def lookup(key: str, ctx: Context) -> str:
        """Read a value (read-only)."""
        rec.add("lookup", {"key": key}, ctx)
        return f"value-of-{key}"

    @mcp.tool()
    async def slow(steps: int, delay_ms: int, ctx: Context) -> str:
        """Report progress steps times, delay_ms apart, then answer."""
        entry = rec.add("slow", {"steps": steps, "delay_ms": delay_ms}, ctx, finished=False)
        for step in range(1, steps + 1):
            await anyio.sleep(delay_ms / 1000)
            await ctx.report_progress(step, steps, f"step {step}")
        entry["finished"] = True
        return f"done {steps}"

    @mcp.tool(annotations=ToolAnnotations(idempotent_hint=True))
    async def charge(account: str, amount: int, ctx: Context, delay_ms: int = 0) -> str:
        """Charge account once per effect id (params._meta["fencegate/effectId"]); a first run
        answers delay_ms after charging."""
        meta = _meta(ctx) or {}
        effect_id = meta.get(EFFECT_ID_META_KEY)
        args: dict[str, Any] = {"account": account, "amount": amount}
        if delay_ms:
            args["delay_ms"] = delay_ms
        if isinstance(effect_id, str) and effect_id in rec.charges:
            rec.add("charge", args, ctx, effect_id=effect_id, deduped=True)
            return rec.charges[effect_id]
        rec.balances[account] = rec.balances.get(account, 0) + amount
        answer = f"charged {account} {amount} (total {rec.balances[account]})"
        if isinstance(effect_id, str):
            rec.charges[effect_id] = answer
        rec.add("charge", args, ctx, effect_id=effect_id, deduped=False)
        if delay_ms:
            await anyio.sleep(delay_ms / 1000)
        return answer

    @mcp.tool()
    async def sleepy(ms: int, ctx: Context) -> str:
        """Sleep ms milliseconds, then answer."""
        entry = rec.add("sleepy", {"ms": ms}, ctx, finished=False)
        await anyio.sleep(ms / 1000)
        entry["finished"] = True
        return f"slept {ms}"

    @mcp.tool()
    async def routed(
        region: Annotated[str, Field(json_schema_extra={"x-mcp-header": "Region"})],
        label: str,
        ctx: Context,
    ) -> int:
        """Count one more for label (not idempotent); region goes in a Mcp-Param header."""
        key = f"{region}/{label}"
        rec.counters[key] = rec.counters.get(key, 0) + 1
        rec.add("routed", {"region": region, "label": label}, ctx, result=rec.counters[key])
        return rec.counters[key]

    @mcp.tool()
    async def fail(message: str, ctx: Context) -> str:
        """Fail as a tool: the result has isError true."""
        rec.add("fail", {"message": message}, ctx)
        raise ToolError(message)

    @mcp.tool()
    async def reject(code: int, message: str, ctx: Context) -> str:
        """Fail as a protocol error: a JSON-RPC error with data {"tool": "reject"}."""
        rec.add("reject", {"code": code, "message": message}, ctx)
        raise MCPError(code=code, message=message, data={"tool": "reject"})

    @mcp.tool()
    async def drop(ms: int, ctx: Context) -> str:
        """Close this call's SSE stream (resumable with --event-store), then answer after ms."""
        entry = rec.add("drop", {"ms": ms}, ctx, finished=False)
        await ctx.close_sse_stream()
        await anyio.sleep(ms / 1000)
        entry["finished"] = True
        return f"dropped {ms}"

    # custom_route is untyped in the SDK; cast it so the handlers stay typed.
    executions_route = cast(_RouteDecorator, mcp.custom_route("/executions", ["GET", "DELETE"]))
    state_route = cast(_RouteDecorator, mcp.custom_route("/state", ["GET"]))

    @executions_route
    async def executions(request: Request) -> Response:
        if request.method == "DELETE":
            rec.clear()
        return JSONResponse(rec.executions)

    @state_route
    async def state(request: Request) -> Response:
        return JSONResponse({"counters": rec.counters, "balances": rec.balances})

    return mcp, rec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.mcp_server")
    parser.add_argument("--port", type=int, default=0, help="0: a free port the system picks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port-file", help="write the bound port here once bound")
    parser.add_argument("--fd", type=int, help="serve on this bound socket (inherited)")
    parser.add_argument("--json-response", action="store_true", help="JSON answers, not SSE")
    parser.add_argument("--stateless", action="store_true", help="no handshake sessions")
    parser.add_argument("--event-store", action="store_true", help="SSE ids, Last-Event-ID resume")
    parser.add_argument("--retry-ms", type=int, default=None, help="SSE retry: on priming events")
    args = parser.parse_args(argv)

    import uvicorn

    mcp, _ = build_server()
    app = mcp.streamable_http_app(
        json_response=args.json_response,
        stateless_http=args.stateless,
        event_store=MemoryEventStore() if args.event_store else None,
        retry_interval=args.retry_ms,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        host=args.host,
    )
    if args.fd is not None:  # bound by the parent: the port was never free to take
        sock = socket.socket(fileno=args.fd)
    else:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    if args.port_file:
        written = f"{args.port_file}.tmp"
        with open(written, "w") as file:
            file.write(str(sock.getsockname()[1]))
        os.replace(written, args.port_file)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


class McpServerProcess:
    """``python -m tests.mcp_server`` as a child process on a loopback port: one it binds
    (port 0) and reports in a port file, or the socket ``sock`` the test bound (and keeps
    refusing connections until the server starts: an address a config may name first)."""

    def __init__(
        self,
        *,
        json_response: bool = False,
        stateless: bool = False,
        event_store: bool = False,
        sock: socket.socket | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1] if sock is not None else 0
        self.json_response = json_response
        self.stateless = stateless
        self.event_store = event_store
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The streamable-HTTP MCP endpoint."""
        return f"{self.base_url}/mcp"

    def start(self, timeout: float = 20.0) -> McpServerProcess:
        from tests.servers import dies_with_us  # the test side only: not the server's imports

        port_dir = tempfile.TemporaryDirectory(prefix="mcp-server-")
        port_file = Path(port_dir.name) / "port"
        cmd = [sys.executable, "-m", "tests.mcp_server", "--port-file", str(port_file)]
        if self.sock is not None:
            cmd += ["--fd", str(self.sock.fileno())]
        if self.json_response:
            cmd.append("--json-response")
        if self.stateless:
            cmd.append("--stateless")
        if self.event_store:
            cmd.append("--event-store")
        out = self.log_path.open("ab") if self.log_path is not None else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                dies_with_us(cmd),
                cwd=_REPO,
                stdout=out,
                stderr=out,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                pass_fds=() if self.sock is None else (self.sock.fileno(),),
            )
        finally:
            if self.log_path is not None and not isinstance(out, int):
                out.close()
        deadline = time.monotonic() + timeout
        with port_dir:
            while not port_file.exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the MCP server did not bind a port")
                time.sleep(0.02)
            self.port = int(port_file.read_text())
        while True:  # the port opens before the lifespan (session manager) has started
            try:
                self.executions()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.05)

    def _get(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(self.base_url + path, method=method)
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def executions(self) -> dict[str, list[dict[str, Any]]]:
        """``{tool: [{"args", "meta", ...}]}``: each run of a tool body, counted at the server."""
        result: dict[str, list[dict[str, Any]]] = self._get("/executions")
        return result

    def runs(self, tool: str) -> int:
        return len(self.executions().get(tool, []))

    def state(self) -> dict[str, dict[str, int]]:
        result: dict[str, dict[str, int]] = self._get("/state")
        return result

    def reset(self) -> None:
        self._get("/executions", method="DELETE")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> McpServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()
