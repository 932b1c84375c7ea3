"""The app factory: one aiohttp application wired to one store.

Long-lived resources (the store connection) live in ``cleanup_ctx`` so they open with the app
and close with it, in tests as in ``fencegate serve``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from fencegate.adapters.mcp import McpToolCache
from fencegate.gateway import (
    coordination,
    events,
    ledger_api,
    openapi,
    operations,
    retention,
    tracing,
)
from fencegate.gateway.auth import auth_middleware, resource_metadata
from fencegate.gateway.config import Config
from fencegate.gateway.console import CONSOLE, new_console, sampling
from fencegate.gateway.console import views as console_views
from fencegate.gateway.downstreams import build_adapter
from fencegate.gateway.http_client import new_client_session
from fencegate.gateway.mcp import mcp_handler
from fencegate.gateway.mcp_sessions import SESSION_IDS, SessionIds, session_key, wrap_answer
from fencegate.gateway.mcp_streams import STREAMS, StreamRegistry
from fencegate.gateway.metrics import CONTENT_TYPE, Metrics
from fencegate.gateway.principals import REAL_TIME, WallClock
from fencegate.gateway.problems import error_middleware
from fencegate.gateway.proxy import proxy_answer_headers, proxy_handler
from fencegate.gateway.reconcile import Reconciler
from fencegate.gateway.request_guard import connection_vouch, request_guard
from fencegate.gateway.state import (
    ADAPTERS,
    CONFIG,
    EVENTS,
    FORWARD_CLOCK,
    HTTP_CLIENT,
    MCP_TOOLS,
    METRICS,
    PENDING_ABORTS,
    STORE,
)
from fencegate.gateway.version import gateway_version
from fencegate.ledger.errors import StoreIncompatible, StoreUnavailable
from fencegate.ledger.registry import open_store
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import LeasePolicy

__all__ = ["build_store", "create_app"]

log = structlog.get_logger("fencegate.app")


def build_store(config: Config) -> Store:
    policy = LeasePolicy(
        max_ttl_ms=config.leases.max_ttl_ms,
        default_max_runtime_ms=config.leases.default_max_runtime_ms,
    )
    return open_store(
        config.store.url,
        policy,
        timeout_ms=config.store.timeout_ms,
        sqlite_synchronous=config.store.sqlite_synchronous,
        redis_key_prefix=config.store.redis_key_prefix,
        password=config.store.password(),
        redis_max_connections=config.store.redis_max_connections,
        postgres_max_connections=config.store.postgres_max_connections,
        max_dependents=config.tasks.max_dependents,
        max_cascade=config.tasks.max_cascade,
        redis_min_replicas=config.store.redis_min_replicas,
        redis_replica_timeout_ms=config.store.redis_replica_timeout_ms,
        cluster_buckets=config.store.cluster_buckets,
        cluster_queue_rescan_ms=config.store.cluster_queue_rescan_ms,
    )


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "version": gateway_version()})


async def readyz(request: web.Request) -> web.Response:
    """Ready means one real round trip to the store succeeded just now, and (Redis) the store
    is as durable as ``store.require_durable`` asks."""
    store = request.app[STORE]
    await store.ping()
    if request.app[CONFIG].store.require_durable:
        warnings = await store.durability()
        if warnings:
            raise StoreUnavailable("the store is not durable: " + "; ".join(warnings))
    return web.json_response({"status": "ready", "store": store.kind})


async def metrics(request: web.Request) -> web.Response:
    app_metrics = request.app[METRICS]
    app_metrics.store_regressed.set(1 if request.app[STORE].regressed else 0)
    try:
        app_metrics.set_gauges(await request.app[STORE].gauges())
    except StoreUnavailable as exc:
        log.warning("metrics.gauges_unavailable", reason=exc.detail)
    body = app_metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def create_app(
    config: Config,
    store: Store | None = None,
    *,
    forward_clock: Callable[[], float] = time.monotonic,
    wall_clock: WallClock = REAL_TIME,
) -> web.Application:
    """The gateway for ``config``. Tests pass their own ``store`` to drive its test clock, and
    may pass the clock ``/proxy`` measures a forward's window on (``FORWARD_CLOCK``): one
    that stands still lets a loaded machine's slow prepare start its forward all the same,
    where the start limit is not what a test is about. ``wall_clock``: what an OAuth token's
    ``exp`` is read against and waited for (a test's stands still until it moves it)."""
    middlewares: list[Middleware] = [error_middleware]
    if config.tracing is not None:  # outermost: the request's span sees its final answer
        middlewares.insert(0, tracing.server_spans)
    middlewares.append(request_guard)  # Host, Origin, media type, body bounds
    the_console = new_console(config)
    if config.auth is not None:
        # The console's cookie stands in for the bearer credential on /console/*.
        middlewares.append(
            auth_middleware(config.auth, sessions=the_console.sessions, wall=wall_clock)
        )
    middlewares.append(connection_vouch)  # last: server.max_connections_per_peer
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_body_bytes)
    app[CONFIG] = config
    app[FORWARD_CLOCK] = forward_clock
    app[CONSOLE] = the_console
    app[STORE] = store if store is not None else build_store(config)
    app[METRICS] = Metrics()
    store_seconds = app[METRICS].store_seconds
    app[STORE].observe = lambda op, seconds: store_seconds.labels(op).observe(seconds)
    if config.tracing is not None:  # a span per answered store step, besides the metric
        app[STORE].observe = tracing.store_observer(app, app[STORE].kind, app[STORE].observe)

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        the_store = app[STORE]
        try:
            await the_store.open()
            log.info("store.opened", store=the_store.kind)
        except StoreUnavailable as exc:
            if the_store.kind == "sqlite" or isinstance(exc, StoreIncompatible):
                raise
            # A shared store may come back; /readyz reports it meanwhile, and the first call
            # that reaches it runs the start-up checks.
            log.warning("store.unavailable", store=the_store.kind, reason=exc.detail)
        yield
        await the_store.close()

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        session = new_client_session(config.proxy.max_connections)
        app[HTTP_CLIENT] = session
        yield
        await session.close()

    async def aborts_ctx(app: web.Application) -> AsyncIterator[None]:
        app[PENDING_ABORTS] = set()
        yield
        pending: set[asyncio.Task[None]] = app[PENDING_ABORTS]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def reconciler_ctx(app: web.Application) -> AsyncIterator[None]:
        reconciler = Reconciler(app)
        if config.reconciler.enabled:
            reconciler.start()
        yield
        await reconciler.stop()

    app[EVENTS] = events.EventHub(app[STORE], config.events, config.tasks)

    async def close_events(app: web.Application) -> None:
        await app[EVENTS].close()  # ends every event stream and long-poll: nothing to drain

    app.on_shutdown.append(close_events)
    app[ADAPTERS] = {d.name: build_adapter(d) for d in config.downstreams}
    if config.tracing is not None:  # first in, last out: flushed after everything stopped
        tracing.install(app, config.tracing, gateway_version())
    app.cleanup_ctx.append(store_ctx)
    # After the store: they start once it is open and stop before it closes.
    app.cleanup_ctx.append(events.trim_loop)
    app.cleanup_ctx.append(events.cascade_loop)
    app.cleanup_ctx.append(retention.retention_loop)
    app.cleanup_ctx.append(sampling)  # the console's Fleet charts
    app.cleanup_ctx.append(client_ctx)
    app.cleanup_ctx.append(reconciler_ctx)
    app.cleanup_ctx.append(aborts_ctx)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    # RFC 9728 metadata for OAuth clients ([auth.oauth]; 404 without it)
    app.router.add_get("/.well-known/oauth-protected-resource", resource_metadata)
    app.router.add_get("/.well-known/oauth-protected-resource/mcp/{downstream}", resource_metadata)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi.serve)
    app.add_routes(coordination.routes)
    app.add_routes(events.routes)
    app.add_routes(ledger_api.routes)
    app.add_routes(operations.routes)
    app.add_routes(retention.routes)
    app.router.add_route("*", "/proxy/{tail:.*}", proxy_handler)
    app[MCP_TOOLS] = McpToolCache()
    app[SESSION_IDS] = SessionIds(*session_key())
    app.on_response_prepare.append(wrap_answer)  # the server's Mcp-Session-Id, bound
    app[STREAMS] = StreamRegistry(  # MCP GET streams
        config.proxy.stream_limit, config.proxy.principal_stream_limit
    )
    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, "/mcp/{downstream}", mcp_handler)
    console_views.setup(app)
    # Refusals made before the proxy handler (the request guard's 413...) carry Fence-* too.
    app.on_response_prepare.append(proxy_answer_headers)
    return app
