"""Typed keys for what the app holds for its lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from fencegate.adapters import Adapter
from fencegate.adapters.mcp import McpToolCache
from fencegate.gateway.config import Config
from fencegate.gateway.metrics import Metrics
from fencegate.ledger.store import Store

if TYPE_CHECKING:
    from fencegate.gateway.events import EventHub

__all__ = [
    "ADAPTERS",
    "CONFIG",
    "EVENTS",
    "FORWARD_CLOCK",
    "HTTP_CLIENT",
    "MCP_TOOLS",
    "METRICS",
    "PENDING_ABORTS",
    "STORE",
]

CONFIG = web.AppKey("config", Config)
STORE = web.AppKey("store", Store)
#: downstream name -> its adapter, built once at start-up.
ADAPTERS = web.AppKey("adapters", Mapping[str, Adapter])
#: The one pooled client session every forward goes through.
HTTP_CLIENT = web.AppKey("http_client", aiohttp.ClientSession)
#: The app's Prometheus metrics.
METRICS = web.AppKey("metrics", Metrics)
#: Background aborts of prepares the store did not answer (cancelled at shutdown).
PENDING_ABORTS = web.AppKey("pending_aborts", set[asyncio.Task[None]])
#: MCP tools' annotations per (downstream, session): a cache (``gateway/mcp.py``).
MCP_TOOLS = web.AppKey("mcp_tools", McpToolCache)
#: The process's event hub (``gateway/events.py``): SSE streams and long-polls.
EVENTS: web.AppKey[EventHub] = web.AppKey("events")
#: The clock ``/proxy`` measures a forward's window on (``forward.ForwardWindow``): seconds,
#: never stepping back. ``time.monotonic``; a test passes its own to ``create_app``.
FORWARD_CLOCK: web.AppKey[Callable[[], float]] = web.AppKey("forward_clock")
