"""OpenTelemetry traces: the one module that knows OpenTelemetry (docs/operations.md,
"Tracing").

With ``[tracing]`` the gateway records one SERVER span per request (HTTP semantic
conventions and the ``fencegate.*`` attributes of the call: effect, task, generation,
decision, outcome, problem), a child span per answered store step (``Store.observe``, the one
point every store already reports each step to), and one CLIENT span per send to a downstream
(``forward.send``: forwards, relays, probes), whose W3C context goes out with the send: the
``traceparent`` / ``tracestate`` headers, and on ``/mcp`` also ``params._meta`` (the MCP
specification reserves those names there), so the downstream's own spans join the agent's
trace. The incoming context is the request's ``traceparent`` header or, on ``/mcp``,
``params._meta.traceparent`` (``mcp_context``). The context is added to what is sent only,
after the payload and approval digests were computed and the kept request was built: it never
enters a digest nor a record. Log lines carry ``trace_id`` / ``span_id`` while a span is
active (``log_ids``, a structlog processor).

Without ``[tracing]`` nothing of ``opentelemetry`` is imported (the SDK is the optional extra
``fencegate[otel]``, and a gateway runs without it): every function here then answers at the
cost of a dictionary or context-variable look-up. The server span is created lazily, at its
first use, so ``/mcp`` can still choose its parent from the message (``mcp_context``) after
the middleware ran; its start time is the middleware's.

The spans of a request hang off ``_CURRENT`` (a context variable the middleware sets; tasks
the handler starts inherit it), not off OpenTelemetry's own context, so no other code's span
becomes a parent by accident and the middleware stays the one place a request span starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
    MutableMapping,
)
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from multidict import CIMultiDict

if TYPE_CHECKING:
    from aiohttp.typedefs import LooseHeaders
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from fencegate.gateway.config import TracingConfig
    from fencegate.ledger.errors import FencegateError

__all__ = [
    "EXTRA",
    "TRACING",
    "Tracing",
    "enabled",
    "install",
    "log_ids",
    "mcp_context",
    "missing_extra",
    "note",
    "noted_decision",
    "refused",
    "server_spans",
    "start_client",
    "step",
    "store_observer",
]

log = structlog.get_logger("fencegate.tracing")

#: What to install for ``[tracing]``.
EXTRA = "fencegate[otel]"
#: The modules ``[tracing]`` needs (the extra's packages).
_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")
#: The W3C trace-context names, as headers and as MCP ``_meta`` keys.
_TRACE_KEYS = ("traceparent", "tracestate")


def missing_extra() -> str | None:
    """Why ``[tracing]`` cannot start here (the extra is not installed), or None. Looks the
    modules up without importing them."""
    for name in _MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return (
                f"[tracing] needs the OpenTelemetry SDK, which is not installed ({name} "
                f"cannot be imported): pip install '{EXTRA}', or remove [tracing]"
            )
    return None


class Tracing:
    """One gateway's tracer provider (never the process-wide one: each app, a test's too,
    exports to its own collector), its tracer and the W3C propagator."""

    def __init__(self, config: TracingConfig, version: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, StatusCode, get_current_span, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create(
            {"service.name": config.service_name, "service.version": version}
        )
        self.provider: TracerProvider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio))
        )
        headers = {name: os.environ[variable] for name, variable in config.headers_from_env.items()}
        exporter = OTLPSpanExporter(
            endpoint=config.otlp_endpoint + "/v1/traces",
            headers=headers,
            timeout=config.export_timeout_ms / 1000,
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                schedule_delay_millis=config.export_delay_ms,
                export_timeout_millis=config.export_timeout_ms,
            )
        )
        self.tracer: Tracer = self.provider.get_tracer("fencegate.gateway", version)
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()
        self.kinds = SpanKind
        self.codes = StatusCode
        self.in_context = set_span_in_context
        self.span_in = get_current_span

    def extract(self, carrier: Mapping[str, Any]) -> Context | None:
        """The W3C context ``carrier`` holds, or None when it holds no valid one."""
        context = self.propagator.extract(carrier)
        return context if self.span_in(context).get_span_context().is_valid else None

    def carrier(self, span: Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span`` as the parent."""
        out: dict[str, str] = {}
        self.propagator.inject(out, context=self.in_context(span))
        return out

    async def shutdown(self) -> None:
        """Export what is left and stop; in a thread, so a slow collector (bounded by
        ``export_timeout_ms``) never holds the event loop."""
        await asyncio.to_thread(self.provider.shutdown)


class _Slot:
    """Where an app with ``[tracing]`` holds its ``Tracing`` while it runs (an app's own
    state cannot change once it started)."""

    __slots__ = ("tracing",)

    def __init__(self) -> None:
        self.tracing: Tracing | None = None


TRACING: web.AppKey[_Slot] = web.AppKey("tracing", _Slot)


def _of(app: web.Application) -> Tracing | None:
    slot = app.get(TRACING)
    return slot.tracing if slot is not None else None


def enabled(app: web.Application) -> bool:
    """Does ``app`` record spans now (``[tracing]``, started)? For a caller that would
    compute a span's attributes: without tracing it computes nothing."""
    return _of(app) is not None


class _Node:
    """The span a request's (or a reconcile's) children hang off. A request's server span
    is made at its first use (``span``), from the middleware's start time and the parent
    known by then; attributes noted before are given to it then."""

    __slots__ = ("attributes", "kind", "name", "parent", "span", "start_ns", "tracing")

    def __init__(
        self,
        tracing: Tracing,
        name: str,
        kind: Any,
        parent: Context | None,
        attributes: dict[str, Any],
    ) -> None:
        self.tracing = tracing
        self.name = name
        self.kind = kind
        self.parent = parent
        self.attributes = attributes
        self.start_ns = time.time_ns()
        self.span: Span | None = None

    def get(self) -> Span:
        if self.span is None:
            self.span = self.tracing.tracer.start_span(
                self.name,
                context=self.parent,
                kind=self.kind,
                attributes=self.attributes,
                start_time=self.start_ns,
            )
        return self.span

    def set(self, attributes: Mapping[str, Any]) -> None:
        if self.span is None:
            self.attributes.update(attributes)
        else:
            self.span.set_attributes(attributes)


_CURRENT: ContextVar[_Node | None] = ContextVar("fencegate_span", default=None)


# --- start and stop -----------------------------------------------------------------------------


def install(app: web.Application, config: TracingConfig, version: str) -> None:
    """``[tracing]`` for ``app`` (``create_app``, before the other contexts): the provider
    opens with the app and is flushed and shut down with it, after everything else stopped
    (the spans of the last requests are exported)."""
    slot = app[TRACING] = _Slot()

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        slot.tracing = Tracing(config, version)
        log.info("tracing.started", endpoint=config.otlp_endpoint,
                 service=config.service_name, sample_ratio=config.sample_ratio)  # fmt: skip
        yield
        tracing, slot.tracing = slot.tracing, None
        await tracing.shutdown()

    app.cleanup_ctx.append(ctx)


# --- the server span ----------------------------------------------------------------------------


def _route(request: web.Request) -> str | None:
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else None


@web.middleware
async def server_spans(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """One SERVER span per request (the outermost middleware with ``[tracing]``): from the
    request's ``traceparent`` header, or (``/mcp``) its message's ``_meta``."""
    tracing = _of(request.app)
    if tracing is None:  # not started (yet), or stopping
        return await handler(request)
    route = _route(request)
    attributes: dict[str, Any] = {
        "http.request.method": request.method,
        "url.path": request.path,
        "url.scheme": request.scheme,
    }
    if route is not None:
        attributes["http.route"] = route
    if request.remote:
        attributes["client.address"] = request.remote
    name = f"{request.method} {route}" if route is not None else request.method
    node = _Node(tracing, name, tracing.kinds.SERVER, tracing.extract(request.headers), attributes)
    token = _CURRENT.set(node)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except BaseException as exc:
        node.get().record_exception(exc)
        node.set({"error.type": type(exc).__name__})
        raise
    finally:
        _CURRENT.reset(token)
        span = node.get()
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(tracing.codes.ERROR)
        span.end()


def mcp_context(meta: Any) -> None:
    """An ``/mcp`` message's ``params._meta`` (the MCP specification's trace context):
    its ``traceparent`` becomes the request span's parent when the span was not used yet
    (nothing else ran before the message was read); it wins over the header."""
    node = _CURRENT.get()
    if node is None or node.span is not None or not isinstance(meta, dict):
        return
    if not isinstance(meta.get("traceparent"), str):
        return
    carrier = {k: v for k in _TRACE_KEYS if isinstance(v := meta.get(k), str)}
    context = node.tracing.extract(carrier)
    if context is not None:
        node.parent = context


def note(**attributes: Any) -> None:
    """Attributes of the current request's span (``fencegate.*`` names); None values are
    left out. Free without a span."""
    node = _CURRENT.get()
    if node is not None:
        node.set({k: v for k, v in attributes.items() if v is not None})


#: ``call_fields`` names -> span attributes.
_FIELDS = {
    "effect_id": "fencegate.effect_id",
    "task": "fencegate.task_id",
    "generation": "fencegate.generation",
    "downstream": "fencegate.downstream",
    "kind": "fencegate.kind",
}
#: Decision act class -> ``fencegate.decision``.
_DECISIONS = {
    "Refuse": "refuse",
    "Replay": "replay",
    "PassThrough": "pass_through",
    "ShadowForward": "shadow_forward",
    "Forward": "forward",
}


def noted_decision(act: Any, fields: Mapping[str, Any]) -> None:
    """The proxy's decision (``proxy_decisions``) on the request's span: what was decided,
    about which call and effect (``fields``: the call's log fields)."""
    node = _CURRENT.get()
    if node is None:
        return
    attributes = {_FIELDS[k]: v for k, v in fields.items() if k in _FIELDS and v is not None}
    attributes["fencegate.decision"] = _DECISIONS.get(type(act).__name__, type(act).__name__)
    effect = getattr(act, "effect", None)
    if effect is not None:
        attributes["fencegate.effect_id"] = effect.effect_id
        attributes["fencegate.kind"] = effect.kind
    node.set(attributes)


def refused(error: FencegateError) -> None:
    """A refusal's problem code on the request's span, and an error status for a 5xx one
    (also on ``/mcp``, whose refusals are JSON-RPC answers with HTTP 200)."""
    node = _CURRENT.get()
    if node is None:
        return
    attributes: dict[str, Any] = {"fencegate.problem": error.code}
    effect_id = error.extra.get("effectId")
    if isinstance(effect_id, str):
        attributes["fencegate.effect_id"] = effect_id
    node.set(attributes)
    if error.status >= 500:
        node.get().set_status(node.tracing.codes.ERROR, error.code)


@contextlib.contextmanager
def _step(tracing: Tracing, name: str, attributes: dict[str, Any]) -> Iterator[None]:
    parent = _CURRENT.get()
    context = tracing.in_context(parent.get()) if parent is not None else None
    node = _Node(tracing, name, tracing.kinds.INTERNAL, context, attributes)
    span = node.get()
    token = _CURRENT.set(node)
    try:
        yield
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(tracing.codes.ERROR, type(exc).__name__)
        raise
    finally:
        _CURRENT.reset(token)
        span.end()


_NOTHING: contextlib.nullcontext[None] = contextlib.nullcontext()


def step(
    app: web.Application, name: str, **attributes: Any
) -> contextlib.AbstractContextManager[None]:
    """An INTERNAL span around a piece of work (a reconcile: its store steps and probe
    hang off it), the current request's child when there is one; a shared no-op without
    ``[tracing]``."""
    tracing = _of(app)
    if tracing is None:
        return _NOTHING
    return _step(tracing, name, {k: v for k, v in attributes.items() if v is not None})


# --- store steps --------------------------------------------------------------------------------


#: A store's ``kind`` -> ``db.system.name`` (OpenTelemetry's names).
_DB_SYSTEMS = {"postgres": "postgresql"}


def store_observer(
    app: web.Application, system: str, then: Callable[[str, float], None]
) -> Callable[[str, float], None]:
    """``Store.observe`` with a child span per answered store step (ending now, as long as
    the step took), after ``then`` (the metrics). A step outside any request or reconcile
    (the trim and retention loops) records no span."""

    system = _DB_SYSTEMS.get(system, system)

    def observe(op: str, seconds: float) -> None:
        then(op, seconds)
        node = _CURRENT.get()
        if node is None:
            return
        tracing = node.tracing
        end = time.time_ns()
        span = tracing.tracer.start_span(
            f"store {op}",
            context=tracing.in_context(node.get()),
            kind=tracing.kinds.INTERNAL,
            attributes={"db.system.name": system, "fencegate.store.op": op},
            start_time=end - int(seconds * 1e9),
        )
        span.end(end_time=end)

    return observe


# --- client spans -------------------------------------------------------------------------------


class ClientSpan:
    """One send to a downstream: its CLIENT span and the context it carries out."""

    __slots__ = ("span", "tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span

    def inject(
        self, headers: LooseHeaders | None, data: bytes | None, *, mcp_meta: bool
    ) -> tuple[CIMultiDict[str], bytes | None]:
        """The send's headers with this span's ``traceparent`` / ``tracestate`` (the agent's
        own are replaced: the downstream's parent is this span) and, for an MCP message
        (``mcp_meta``), its body with them in ``params._meta``."""
        carrier = self.tracing.carrier(self.span)
        out: CIMultiDict[str] = CIMultiDict(headers or {})
        for key in _TRACE_KEYS:
            out.popall(key, None)
        out.update(carrier)
        if mcp_meta and data:
            data = _into_meta(data, carrier)
        return out, data

    def answered(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(self.tracing.codes.ERROR)

    def failed(self, kind: str, outcome: str) -> None:
        """A send that got no answer (``forward.failure_of``): how, and what it means."""
        self.span.set_attributes({"error.type": kind, "fencegate.outcome": outcome.lower()})
        self.span.set_status(self.tracing.codes.ERROR, kind)

    def end(self) -> None:
        self.span.end()


def _into_meta(data: bytes, carrier: Mapping[str, str]) -> bytes:
    """A JSON-RPC request or notification with ``carrier`` in ``params._meta`` (the
    agent's ``traceparent`` / ``tracestate`` replaced); anything else (a response, not
    JSON) unchanged."""
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        return data
    if not isinstance(message, dict) or not isinstance(message.get("method"), str):
        return data
    params = message.get("params", {})
    meta = params.get("_meta", {}) if isinstance(params, dict) else None
    if not isinstance(meta, dict):
        return data
    meta = {k: v for k, v in meta.items() if k not in _TRACE_KEYS}
    meta.update(carrier)
    message["params"] = {**params, "_meta": meta}
    return json.dumps(message, separators=(",", ":")).encode()


def start_client(
    app: web.Application,
    downstream: str,
    method: str,
    url: str,
    *,
    purpose: str,
    effect_id: str | None = None,
    address: tuple[str | None, int | None] = (None, None),
) -> ClientSpan | None:
    """A CLIENT span for one send (``forward.send``), the current request's (or
    reconcile's) child; None without ``[tracing]``. ``purpose``: forward, relay, probe,
    tools_list. ``url``: the address as the log shows it (no user info, no query)."""
    tracing = _of(app)
    if tracing is None:
        return None
    node = _CURRENT.get()
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.full": url,
        "fencegate.downstream": downstream,
        "fencegate.send": purpose,
    }
    host, port = address
    if host is not None:
        attributes["server.address"] = host
    if port is not None:
        attributes["server.port"] = port
    if effect_id is not None:
        attributes["fencegate.effect_id"] = effect_id
    span = tracing.tracer.start_span(
        method,
        context=tracing.in_context(node.get()) if node is not None else None,
        kind=tracing.kinds.CLIENT,
        attributes=attributes,
    )
    return ClientSpan(tracing, span)


# --- logs -------------------------------------------------------------------------------------


def log_ids(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: ``trace_id`` and ``span_id`` (lowercase hex, as W3C writes
    them) on every line logged while a span is active."""
    node = _CURRENT.get()
    if node is None:
        return event
    context = node.get().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event
