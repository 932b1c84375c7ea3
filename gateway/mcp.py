"""The MCP gateway: ``/mcp/{downstream}``, MCP's streamable-HTTP transport, fenced.

An agent's MCP client talks to the gateway as it would to the server (POST of one JSON-RPC
message, answered as JSON or as an SSE stream; GET for the server's stream; DELETE to end the
session), with the lease in the same ``Fence-*`` headers as ``/proxy``. A lease-less client
(role ``client``) names each call by its idempotency key instead, in
``params._meta["dev.fencegate/idempotencyKey"]`` (never the ``Idempotency-Key`` header here):
a keyed effect, under the downstream's ``client_idempotency_keys`` as on ``/proxy``; its
session has no server stream (``GET`` is 405, and MCP clients carry on without one).
``tools/call`` is the effect, with the ledger's two store steps around one forward exactly
as for ``/proxy`` (``prepare_effect``, forward, ``complete_effect``): nothing reaches the
server without a PREPARED record, and the answer reaches the agent only once its outcome is
recorded (an SSE stream's progress events go through as they come; its final answer waits
for the record).
What a message means for the ledger is decided in ``adapters.mcp`` (pure).

Refusals are JSON-RPC error answers with HTTP 200 (``adapters.mcp.error_message``): an MCP
client reads those, not problem+json. The gateway keeps no session state another gateway
lacks: the tools' annotations are cached per (downstream, session) and fetched from the
server (``tools/list`` under the session's id) by whichever gateway misses them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from fencegate.adapters import mcp
from fencegate.adapters.base import Answer, Outgoing
from fencegate.adapters.mcp import McpAdapter, ToolKind, ToolPolicy
from fencegate.gateway import effect_waiters, mcp_sessions, mcp_streams, tracing
from fencegate.gateway.config import DownstreamConfig
from fencegate.gateway.forward import (
    ForwardFailed,
    ForwardWindow,
    Limits,
    Target,
    downstream_limits,
    failure_answer,
    forward_window,
    kept_request,
    prepare_effect,
    resend_window,
    send,
)
from fencegate.gateway.http_rules import canonical_body
from fencegate.gateway.principals import caller_name, may_key, may_lease, principal_of
from fencegate.gateway.proxy import (
    account,
    counter_header,
    id_header,
    record_outcome,
    start_too_late,
)
from fencegate.gateway.proxy_decisions import (
    Forward,
    PassThrough,
    Refuse,
    Replay,
    ShadowForward,
    Subject,
    call_fields,
    decide_effect,
    keyed_call_fields,
)
from fencegate.gateway.state import ADAPTERS, CONFIG, FORWARD_CLOCK, MCP_TOOLS, METRICS, STORE
from fencegate.ledger.effects import (
    ClientKey,
    Effect,
    EffectRequest,
    EffectState,
    Fence,
    PrepareOutcome,
)
from fencegate.ledger.errors import (
    BadRequest,
    DownstreamUnreachable,
    FencegateError,
    Forbidden,
    IdempotencyKeyRequired,
    NoSuchDownstream,
    PayloadTooLarge,
    StoreUnavailable,
)
from fencegate.ledger.responses import response_json
from fencegate.ledger.store import new_id

__all__ = ["KNOWN_PROTOCOL_VERSIONS", "mcp_handler"]

log = structlog.get_logger("fencegate.mcp")

#: Request headers of the agent that the server gets (the transport's own); everything else
#: stays here (the gateway's credential, Fence-*, cookies).
_PASSED_REQUEST_HEADERS = frozenset(
    {
        "accept",
        "content-type",
        "mcp-session-id",
        "mcp-protocol-version",
        "mcp-method",
        "mcp-name",
        "last-event-id",
    }
)
#: 2026-07-28's routing headers for a tool's arguments (``Mcp-Param-<name>``).
_PASSED_REQUEST_PREFIX = "mcp-param-"
#: Response headers of the server that the agent gets.
_PASSED_RESPONSE_HEADERS = ("content-type", "mcp-session-id", "cache-control", "allow")
#: Revisions whose messages the gateway understands (docs/PROTOCOL.md, "MCP"): the
#: ``initialize`` handshake revisions, and 2026-07-28's stateless per-request envelope.
KNOWN_PROTOCOL_VERSIONS = frozenset(
    {"2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"}
)
#: The per-request envelope's ``_meta`` keys (2026-07-28), copied onto the gateway's own
#: ``tools/list``.
_ENVELOPE = "io.modelcontextprotocol/"
_SSE = "text/event-stream"
#: Largest SSE event the gateway reads from a server (a larger one: the stream fails).
_MAX_EVENT_BYTES = 16 * 1024 * 1024


# --- answers -----------------------------------------------------------------------------------


def _jsonrpc(message: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=200,
        body=json.dumps(message, separators=(",", ":")).encode(),
        content_type="application/json",
        headers=headers,
    )


def _refuse(
    request_id: Any, error: FencegateError, *, has_id: bool = True, code: int | None = None
) -> web.Response:
    """A refusal: a JSON-RPC error answer to that request (HTTP 200); a message without an id
    (a notification, a response) cannot be answered in JSON-RPC, so its HTTP status says it.
    ``code``: the JSON-RPC code when the refusal has its own (``mcp.error_message``)."""
    tracing.refused(error)  # the problem code on the request's span
    message = mcp.error_message(request_id if has_id else None, error, code)
    if has_id:
        return _jsonrpc(message)
    return web.Response(
        status=error.status,
        body=json.dumps(message).encode(),
        content_type="application/json",
    )


# --- the request -------------------------------------------------------------------------------


def _downstream(request: web.Request) -> tuple[DownstreamConfig, McpAdapter]:
    name = request.match_info["downstream"]
    downstream = request.app[CONFIG].downstream(name)
    adapter = request.app[ADAPTERS].get(name) if downstream is not None else None
    if downstream is None or not isinstance(adapter, McpAdapter):
        raise NoSuchDownstream(f"no MCP downstream named {name!r} is configured")
    return downstream, adapter


def _fence(request: web.Request) -> Fence | None:
    """The lease of the ``Fence-*`` headers, None when the request carries none."""
    if not request.headers.getall("Fence-Task", []):
        return None
    task_id = id_header(request, "Fence-Task")
    attempt_id = id_header(request, "Fence-Attempt")
    assert task_id is not None and attempt_id is not None
    principal = principal_of(request)
    return Fence(
        task_id=task_id,
        attempt_id=attempt_id,
        claim_generation=counter_header(request, "Fence-Generation"),
        scheduler_epoch=counter_header(request, "Fence-Epoch"),
        cancel_generation=counter_header(request, "Fence-Cancel"),
        principal=principal.name if principal is not None else None,
    )


def _may_lease(request: web.Request) -> None:
    """Forbidden for a ``client`` (a principal without ``worker``) that sends any of a lease's
    ``Fence-*`` headers (its credential, ``Fence-Authorization``, is none): a client calls by
    idempotency key, never under a lease. Before anything is read or recorded."""
    principal = principal_of(request)
    if may_lease(principal):
        return
    assert principal is not None
    lease = sorted(
        {name for name in request.headers if name.lower().startswith("fence-")}
        - {name for name in request.headers if name.lower() == "fence-authorization"}
    )
    if lease:
        log.info("mcp.role_refused", principal=principal.name, reason="lease_headers_from_client",
                 headers=lease, downstream=request.match_info.get("downstream"))  # fmt: skip
        raise Forbidden(
            f"{principal.name!r} has the role client: it calls without a lease and may not "
            f"send {', '.join(lease)} (a worker's lease); it names a tools/call by "
            f'params._meta["{mcp.META_IDEMPOTENCY_KEY}"]'
        )


def _needs_lease(what: str) -> BadRequest:
    return BadRequest(
        f"{what} needs a lease: send the Fence-Task, Fence-Attempt, Fence-Generation, "
        "Fence-Epoch and Fence-Cancel headers"
    )


#: A refusal of a lease-less ``tools/call`` and its JSON-RPC code (None: ``error_message``'s).
_Refusal = tuple[FencegateError, int | None]


def _lease_less(
    request: web.Request, downstream: DownstreamConfig, key: str | None
) -> _Refusal | None:
    """Why a lease-less ``tools/call`` is refused whatever its tool, or None, by the rules of
    ``/proxy``: a key from a principal that is no ``client`` (a worker cannot drop its lease
    and send a keyed call instead), a key to a downstream with ``client_idempotency_keys =
    "off"``; no key from a principal that is no client or to such a downstream (as before
    keys: it needs a lease, -32602). The refusals of ``client_idempotency_keys`` are JSON-RPC
    -32000 with their problem code (``/proxy``'s are 400s). Without a key, a read-only
    tool's call goes on unrecorded, any other is refused after the tool's policy is known
    (``_key_missing``)."""
    principal = principal_of(request)
    if key is None:
        if may_key(principal) and downstream.client_idempotency_keys != "off":
            return None
        return _needs_lease("tools/call"), None
    if not may_key(principal):
        assert principal is not None
        log.info("mcp.role_refused", principal=principal.name, downstream=downstream.name,
                 reason="key_without_lease_from_worker")  # fmt: skip
        forbidden = Forbidden(
            f"{principal.name!r} is a worker: its tools/call carries its lease (the Fence-* "
            f'headers); one by params._meta["{mcp.META_IDEMPOTENCY_KEY}"] without a lease is '
            "a client's (role client)"
        )
        return forbidden, None
    if downstream.client_idempotency_keys == "off":
        off = BadRequest(
            f'params._meta["{mcp.META_IDEMPOTENCY_KEY}"]: downstream {downstream.name!r} takes '
            f"no calls without a lease (downstreams.{downstream.name}.client_idempotency_keys "
            '= "off"); send it under a lease'
        )
        return off, mcp.REFUSAL_CODE
    return None


def _key_missing(downstream: DownstreamConfig) -> _Refusal:
    """A lease-less client's call of a recorded tool without a key: ``IDEMPOTENCY_KEY_REQUIRED``
    where the downstream requires keys, else as before keys (it needs a lease)."""
    if downstream.client_idempotency_keys == "required":
        error = IdempotencyKeyRequired(
            f'downstreams.{downstream.name}.client_idempotency_keys is "required": a '
            f'tools/call without a lease carries params._meta["{mcp.META_IDEMPOTENCY_KEY}"]'
        )
        return error, mcp.REFUSAL_CODE
    return _needs_lease("tools/call"), None


def _no_stream() -> web.Response:
    """A lease-less session's ``GET``: 405, what an MCP server without a stream of its own
    answers (the client then goes on without one). A stream holds a pooled connection for
    as long as it is open, so only a lease (which ends it) opens one."""
    message = {
        "jsonrpc": "2.0",
        "id": None,
        "error": {
            "code": mcp.REFUSAL_CODE,
            "message": "Method Not Allowed: the server's stream (GET) is opened only under a "
            "lease (the Fence-* headers); a lease-less session goes on without one",
        },
    }
    return web.Response(
        status=405,
        body=json.dumps(message, separators=(",", ":")).encode(),
        content_type="application/json",
        headers={"Allow": "POST, DELETE"},
    )


#: Headers the gateway reads (or the server routes by) that may appear once: with two, the
#: gateway would read one and the server perhaps the other.
_SINGLE_HEADERS = ("MCP-Protocol-Version", "Mcp-Method", "Mcp-Name", "Mcp-Session-Id",
                   "Content-Type")  # fmt: skip


def _protocol_version(request: web.Request) -> None:
    for name in _SINGLE_HEADERS:
        if len(request.headers.getall(name, [])) > 1:
            raise BadRequest(f"{name} sent more than once; nothing was sent to the server")
    version = request.headers.get("MCP-Protocol-Version")
    if version is not None and version not in KNOWN_PROTOCOL_VERSIONS:
        raise BadRequest(
            f"MCP-Protocol-Version {version!r} is not one this gateway speaks "
            f"({', '.join(sorted(KNOWN_PROTOCOL_VERSIONS))})"
        )


def _outbound(
    request: web.Request, adapter: McpAdapter, identity: Mapping[str, str]
) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        lower = name.lower()
        if lower == "content-type":
            continue  # the server always gets application/json (below), never a charset
        if lower in _PASSED_REQUEST_HEADERS or lower.startswith(_PASSED_REQUEST_PREFIX):
            if lower == "mcp-session-id":  # the server's own id (gateway/mcp_sessions.py)
                value = mcp_sessions.to_server(request, value)
            headers.add(name, value)
    if request.method == "POST":
        headers["Content-Type"] = "application/json"
    headers.update(identity)
    return headers


def _answer_headers(resp: aiohttp.ClientResponse) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name in _PASSED_RESPONSE_HEADERS:
        for value in resp.headers.getall(name, []):
            headers.add(name, value)
    return headers


async def mcp_handler(request: web.Request) -> web.StreamResponse:
    """POST (one JSON-RPC message), GET (the server's stream), DELETE (end the session)."""
    try:
        downstream, adapter = _downstream(request)
        _protocol_version(request)
        _may_lease(request)
        fence = _fence(request)
    except FencegateError as exc:
        return _refuse(None, exc, has_id=False)
    # Another principal's session id is 404, as an unknown session (gateway/mcp_sessions.py).
    if (not_found := mcp_sessions.check_session(request)) is not None:
        return not_found
    if request.method == "POST":
        return await _post(request, downstream, adapter, fence)
    if request.method in ("GET", "DELETE"):
        if fence is None and request.method == "GET":
            # A stream holds a pooled connection for as long as it is open: only under a lease.
            # A lease-less session has none: 405, which MCP clients take for "no stream here".
            return _no_stream()
        if fence is not None and request.method == "GET":
            try:
                await request.app[STORE].check_fence(fence)
            except FencegateError as exc:
                return _refuse(None, exc, has_id=False)
        # Ending a session runs no tool: relayed whatever the lease (a fenced agent's client
        # still ends its session on exit, and refusing it would only leave it open).
        if request.method == "DELETE":
            session = request.headers.get("Mcp-Session-Id")
            if session is not None:
                request.app[MCP_TOOLS].drop(downstream.name, session)
        if request.method == "GET":  # bounded in number, ends with its lease (mcp_streams.py)
            assert fence is not None
            relay = lambda: _relay(request, downstream, adapter, None)  # noqa: E731
            return await mcp_streams.hold(request, downstream.name, fence, relay)
        return await _relay(request, downstream, adapter, None)
    raise web.HTTPMethodNotAllowed(request.method, ("GET", "POST", "DELETE"))


async def _post(
    request: web.Request, downstream: DownstreamConfig, adapter: McpAdapter, fence: Fence | None
) -> web.StreamResponse:
    limit = downstream.max_body_bytes
    body = await request.read()
    if limit is not None and len(body) > limit:
        return _refuse(
            None,
            PayloadTooLarge(
                f"{request.method} {request.rel_url.raw_path}: a body of {len(body)} bytes is "
                f"over downstreams.{downstream.name}.max_body_bytes = {limit}"
            ),
            has_id=False,
        )
    try:
        parsed = mcp.read_message(body)  # strict JSON, noted (not raised) for ``refused``
        refused = mcp.refusal(parsed)
        if refused is None:
            canonical_body(body, "application/json")  # a lone surrogate: not Unicode
    except BadRequest as exc:
        return _refuse(None, exc, has_id=False)
    except (ValueError, RecursionError):  # not JSON, or nested past what a parser follows
        return _jsonrpc(
            {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}
        )
    message = parsed.message
    if isinstance(message, list):
        return _jsonrpc(
            {
                "jsonrpc": "2.0",
                "id": None,
                "error": {
                    "code": -32600,
                    "message": "Invalid Request: JSON-RPC batches are not supported (MCP "
                    "2025-06-18 dropped them); send one message per POST",
                },
            }
        )
    if not isinstance(message, dict):
        return _jsonrpc(
            {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "Invalid Request"}}
        )
    params = message.get("params")
    if isinstance(params, dict):  # MCP's trace context: the request span's parent
        tracing.mcp_context(params.get("_meta"))
    if refused is None:  # read as UTF-8 JSON: a charset would make it another message
        bad_type = mcp.content_type_refusal(request.headers.getall("Content-Type", []))
        refused = None if bad_type is None else (-32600, f"Invalid Request: {bad_type}")
    if refused is not None:  # before any member is read: nothing recorded, nothing sent
        has_id = mcp.answerable_id(message)
        error = BadRequest(refused[1])
        return _refuse(message.get("id"), error, has_id=has_id, code=refused[0])
    method = message.get("method")
    has_id = "id" in message
    request_id = message.get("id")
    shape = mcp.message_shape(message)
    if shape is not None:
        # A request without an id is a notification: only notifications/* may go without
        # one (a tools/call without an id would otherwise reach the server unrecorded).
        return _refuse(
            request_id, BadRequest(shape), has_id=has_id and isinstance(method, str), code=-32600
        )
    if fence is None and method not in mcp.LEASE_FREE_METHODS and method != mcp.CALL:
        what = f"{method}" if isinstance(method, str) else "a response to the server"
        return _refuse(request_id, _needs_lease(what), has_id=has_id and isinstance(method, str))
    if method == mcp.CALL and has_id:
        # Lease-less: a keyed call, a read, or refused (``_lease_less``).
        return await _tool_call(request, downstream, adapter, fence, message, body)
    if fence is not None:
        try:
            await request.app[STORE].check_fence(fence)
        except FencegateError as exc:
            return _refuse(request_id, exc, has_id=has_id and isinstance(method, str))
    if (stripped := mcp.without_ours(message)) is not None:  # only the gateway names effects
        message, body = stripped, json.dumps(stripped).encode()
    return await _relay(request, downstream, adapter, body, message)


# --- tools/call ----------------------------------------------------------------------------


async def _tool_policy(
    request: web.Request,
    downstream: DownstreamConfig,
    adapter: McpAdapter,
    fence: Fence | None,
    tool: str,
    envelope: Mapping[str, Any],
) -> ToolPolicy:
    """The tool's policy: its configured kind, else its annotations when trusted (cached per
    session; fetched with the session's own ``tools/list`` on a miss), else an effect.
    ``fence``: the call's lease, None for a lease-less call."""
    if not adapter.needs_annotations(tool):
        return adapter.policy(tool, None)
    session = request.headers.get("Mcp-Session-Id", "")
    cache = request.app[MCP_TOOLS]
    tools = cache.get(downstream.name, session)
    if tools is None or tool not in tools:
        # Before asking the server anything for this call, refuse a stale agent (the prepare
        # checks the fence again, atomically, before anything is forwarded).
        if fence is not None:
            await request.app[STORE].check_fence(fence)
        tools = await _list_tools(request, downstream, adapter, envelope)
        cache.put(downstream.name, session, tools)
    return adapter.policy(tool, tools.get(tool))


async def _list_tools(
    request: web.Request,
    downstream: DownstreamConfig,
    adapter: McpAdapter,
    envelope: Mapping[str, Any],
) -> dict[str, dict[str, Any]]:
    """Every tool's annotations, as the server lists them to this session (all pages): sent
    with the session's id and protocol version, and (2026-07-28) the call's envelope."""
    tools: dict[str, dict[str, Any]] = {}
    cursor: str | None = None
    for page in range(100):
        params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
        if envelope:
            params["_meta"] = dict(envelope)
        message = {
            "jsonrpc": "2.0",
            "id": f"fencegate-tools-{page}",
            "method": "tools/list",
            "params": params,
        }
        headers = _outbound(request, adapter, adapter.outbound_headers(None, None))
        headers["Accept"] = f"application/json, {_SSE}"
        headers["Content-Type"] = "application/json"
        headers.popall("Mcp-Name", None)
        for name in [n for n in headers if n.lower().startswith(_PASSED_REQUEST_PREFIX)]:
            headers.popall(name, None)
        if "Mcp-Method" in headers:
            headers["Mcp-Method"] = "tools/list"
        target = _where(request, downstream, "tools/call", _LIST_TOOLS)
        try:
            async with send(
                request.app,
                downstream.name,
                "POST",
                downstream.url,
                downstream_limits(downstream),
                headers=headers,
                data=json.dumps(message).encode(),
                purpose="tools_list",
                mcp_meta=True,
            ) as resp:
                answer = await _one_answer(resp, message["id"])
        except ForwardFailed as failed:
            raise failure_answer(target, failed.failure) from failed.cause
        result = answer.get("result") if answer else None
        if not isinstance(result, dict):
            raise DownstreamUnreachable(
                f"{target.where()}: {_LIST_TOOLS} got no result; the call itself was not sent"
            )
        tools.update(_annotations(result))
        cursor = result.get("nextCursor")
        if not isinstance(cursor, str):
            break
    return tools


#: The gateway's own request before a call whose tool it does not know yet.
_LIST_TOOLS = "tools/list (to learn the tool's annotations)"


def _where(
    request: web.Request,
    downstream: DownstreamConfig,
    call: str | None,
    preliminary: str | None = None,
) -> Target:
    """The call as the agent's error names it (``forward.failure_answer``): the downstream's
    name, the agent's method and path, the message (``tools/call charge``); never the
    server's address."""
    return Target(
        downstream.name,
        request.method,
        request.rel_url.raw_path,
        request.app[CONFIG].proxy.max_connections,
        call,
        preliminary,
    )


async def _one_answer(resp: aiohttp.ClientResponse, request_id: Any) -> dict[str, Any] | None:
    """The JSON-RPC answer to ``request_id`` in a JSON or SSE response."""
    if resp.status != 200:
        return None
    if resp.content_type == _SSE:
        async for _raw, data in _sse_events(resp.content):
            if isinstance(data, dict) and data.get("id") == request_id and "method" not in data:
                return data
        return None
    return _message(await _bounded_body(resp))


async def _bounded_body(resp: aiohttp.ClientResponse) -> bytes:
    """A JSON answer, read whole up to ``_MAX_EVENT_BYTES`` (a larger one fails the call as
    a body that broke off would: the server is configured, but its answers are bounded)."""
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > _MAX_EVENT_BYTES:
            raise aiohttp.ClientPayloadError("an answer over 16 MiB")
    return bytes(body)


async def _tool_call(
    request: web.Request,
    downstream: DownstreamConfig,
    adapter: McpAdapter,
    fence: Fence | None,
    message: dict[str, Any],
    body: bytes,
) -> web.StreamResponse:
    """A ``tools/call``: under a lease (``fence``), or lease-less, where it is a keyed effect
    (its ``dev.fencegate/idempotencyKey``), a read-only tool's unrecorded call, or refused
    (``_lease_less``, ``_key_missing``): all before anything is recorded. A recorded call,
    leased or keyed, takes the one path: prepare, forward, record."""
    request_id = message.get("id")
    key: str | None = None
    outgoing = Outgoing("POST", downstream.name, "/", tuple(request.headers.items()), body)
    try:
        shape = adapter.effect_of(outgoing)  # the effect: slot and payload digest
        call = mcp.parse_tool_call(message.get("params"))
        routing = {
            name: request.headers.getall(name, [])
            for name in ("mcp-method", "mcp-name", "mcp-protocol-version")
        }
        mismatch = mcp.routing_mismatch(
            request.headers.get("MCP-Protocol-Version"), routing, message
        )
        if mismatch is not None:
            # As the server would answer it (400), before anything is recorded or sent.
            refusal = mcp.error_message(request_id, BadRequest(mismatch), mcp.HEADER_MISMATCH)
            return web.Response(
                status=400, body=json.dumps(refusal).encode(), content_type="application/json"
            )
        meta = message["params"].get("_meta") or {}
        if fence is None:
            key = mcp.idempotency_key(meta)  # -32602 for one outside the grammar
            if (refused := _lease_less(request, downstream, key)) is not None:
                return _refuse(request_id, refused[0], code=refused[1])
        envelope = {k: v for k, v in meta.items() if k.startswith(_ENVELOPE)}
        policy = await _tool_policy(request, downstream, adapter, fence, call.name, envelope)
    except FencegateError as exc:
        return _refuse(request_id, exc)
    if policy.timeout_ms is not None:
        downstream = downstream.model_copy(update={"timeout_ms": policy.timeout_ms})
    if policy.kind is ToolKind.READ_ONLY:
        # Unrecorded, under a lease (fence-checked) or without one (a client's read needs
        # no key; one it sends anyway is dropped with the other fencegate keys).
        if fence is not None:
            try:
                await request.app[STORE].check_fence(fence)
            except FencegateError as exc:
                return _refuse(request_id, exc)
        return await _relay(request, downstream, adapter, _relayed(message), message)

    client_key: ClientKey | None = None
    if fence is None:
        if key is None:
            refused = _key_missing(downstream)
            return _refuse(request_id, refused[0], code=refused[1])
        client_key = ClientKey(caller_name(principal_of(request)), key)
    try:
        # A keyed effect's identity is its principal, downstream and key: no node, and its
        # slot is only the call's name in the record.
        node = (id_header(request, "Fence-Node", required=False) if fence else None) or "main"
    except FencegateError as exc:
        return _refuse(request_id, exc)
    effect_request = EffectRequest(
        fence=fence,
        node=node,
        slot=shape.slot,
        downstream=downstream.name,
        method=shape.method,
        path=shape.path,
        payload_digest=shape.payload_digest,
        forward_id=new_id(),
        request_json=_kept(request, downstream, adapter, fence, body),
        client_key=client_key,
    )
    config = request.app[CONFIG]
    deadline_ms = downstream.timeout_ms + config.proxy.prepared_margin_ms
    about = {"payload_digest": effect_request.payload_digest, "tool": call.name}
    if client_key is not None:
        fields = keyed_call_fields(client_key.principal, downstream.name, "POST",
                                   effect_request.effect_id, **about)  # fmt: skip
    else:
        assert fence is not None
        fields = call_fields(fence, downstream.name, "POST", node=node, slot=shape.slot, **about)
    enforcement = downstream.enforcement or config.proxy.enforcement
    subject = Subject(downstream.name, fields, enforcement == "shadow", adapter.kind)
    sent_at = 0.0

    async def prepare() -> PrepareOutcome:
        nonlocal sent_at
        sent_at = request.app[FORWARD_CLOCK]()  # the window's clock (gateway/forward.py)
        # As /proxy's: a lost answer is cleaned up by its forward id, and a re-send window
        # is shortened by the start limit (gateway/forward.py).
        return await prepare_effect(
            request.app,
            effect_request,
            deadline_ms,
            resend_window_ms=resend_window(policy.resend_window_ms, config.proxy.start_limit_ms),
            require_approval=policy.require_approval,
        )

    prepared: PrepareOutcome | FencegateError
    try:
        # A duplicate of a call in flight may wait for its outcome (``effect_waiters``).
        wait = None if enforcement == "shadow" else effect_waiters.mcp_wait(request, meta)
        prepared = await effect_waiters.wait_out(request, wait, await prepare(), prepare)
    except FencegateError as exc:
        prepared = exc
    decision = decide_effect(subject, prepared)
    account(request, decision)
    match decision.act:
        case Refuse(error):
            # Every refusal of the prepare, a duplicate still in flight (EFFECT_IN_FLIGHT)
            # after any wait it asked for included.
            return _refuse(request_id, error)
        case Replay(effect):
            return _replay(adapter.replay(effect, outgoing), effect)
        case ShadowForward() | PassThrough():
            return await _relay(request, downstream, adapter, _relayed(message), message)
        case Forward() as forward:
            window = forward_window(request, sent_at, deadline_ms)
            if window.start_left_ms() <= 0:
                error = await start_too_late(request, forward, effect_request, window)
                return _refuse(request_id, error)
            return await _forward_call(
                request, downstream, adapter, effect_request, forward, window, message, body
            )
    raise AssertionError(decision.act)  # pragma: no cover


def _token(fence: Fence | None) -> str | None:
    """The fencing token the server gets: none for a keyed call (it has no lease)."""
    return None if fence is None else f"{fence.scheduler_epoch}.{fence.claim_generation}"


def _kept(
    request: web.Request,
    downstream: DownstreamConfig,
    adapter: McpAdapter,
    fence: Fence | None,
    body: bytes,
) -> str | None:
    """The call as the record keeps it (``forward.kept_request``), as ``/proxy`` keeps its
    requests: the headers ``_forward_call`` sends (but the effectId's) and the JSON-RPC
    message as the agent sent it (the server's also holds the effect's identity in
    ``params._meta``); None, with no work done, unless the downstream keeps request bodies."""
    if not downstream.keep_request_bodies:
        return None
    credentials = adapter.outbound_headers(None, None).values()
    headers = _outbound(request, adapter, adapter.outbound_headers(None, _token(fence)))
    return kept_request(downstream, headers.items(), body, credentials)


def _relayed(message: dict[str, Any]) -> bytes:
    """An unrecorded call's body as the server gets it: without the agent's ``dev.fencegate/``
    and ``fencegate/`` ``_meta`` keys (``mcp.without_ours``)."""
    return json.dumps(mcp.without_ours(message) or message).encode()


def _replay(answer: Answer, effect: Effect) -> web.Response:
    """A duplicate: the stored answer under this request's id, marked replayed
    (``McpAdapter.replay``), with the Fence-* headers."""
    headers = {
        "Fence-Effect-Id": effect.effect_id,
        "Fence-Replayed": "true",
        "Fence-Effect-State": effect.state.value,
    }
    return web.Response(status=answer.status, body=answer.body, headers=dict(answer.headers)
                        | headers)  # fmt: skip


def _event_data(event: bytes) -> Any:
    """One SSE event's ``data`` lines, parsed as JSON (None: no data, or not JSON)."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    if not lines:
        return None
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None


async def _sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[bytes, Any]]:
    """The events of an SSE body as they arrive: (the event's bytes, its ``data`` parsed as
    JSON or None)."""
    buffer = b""
    async for chunk in content.iter_any():
        buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            yield raw + b"\n\n", _event_data(raw)
        if len(buffer) > _MAX_EVENT_BYTES:
            raise aiohttp.ClientPayloadError("an SSE event over 16 MiB")


def _message(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _finish(
    request: web.Request, stream: web.StreamResponse, last: bytes, seconds: float = 1.0
) -> None:
    """Write a stream's last event and end it, within ``seconds`` (an agent that does not
    read must not hold the server's connection). An MCP client closes the stream as soon as
    it has read its answer, so a close on the way is normal, not a failure: the outcome is
    recorded already."""
    try:
        async with asyncio.timeout(seconds):
            await stream.write(last)
            await stream.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass
    except TimeoutError:
        _drop_agent(request)


def _run_end(window: ForwardWindow, limits: Limits) -> float:
    """When (the gateway's monotonic clock) a forward starting now must be over: its
    ``total`` bound (the downstream's timeout cut to the PREPARED deadline), which leaves
    the window's margin to record the outcome before that deadline."""
    left_ms = window.deadline_ms - window.elapsed_ms()
    if limits.total is not None:
        left_ms = min(left_ms, limits.total.ms)
    return time.monotonic() + max(left_ms, 1.0) / 1000


def _left_s(end: float) -> float:
    """Seconds until ``end`` (at least 1 ms)."""
    return max(end - time.monotonic(), 0.001)


def _drop_agent(request: web.Request) -> None:
    """Close the agent's connection at once (``abort``: ``close`` would wait for it to read
    what is buffered)."""
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _write_within(
    request: web.Request, stream: web.StreamResponse, data: bytes, seconds: float
) -> bool:
    """Write ``data`` to the agent within ``seconds``. False when the agent is gone: its
    connection closed, or it did not take the bytes in time (its connection is then
    closed, ``_drop_agent``). A write that waits on the agent's socket is bounded by no
    client timeout (aiohttp's ``total`` fires only inside reads of the server's answer)."""
    try:
        async with asyncio.timeout(seconds):
            await stream.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        return False
    except TimeoutError:
        log.info("mcp.agent_not_reading", path=request.path, seconds=round(seconds, 3))
        _drop_agent(request)
        return False
    return True


async def _forward_call(
    request: web.Request,
    downstream: DownstreamConfig,
    adapter: McpAdapter,
    effect_request: EffectRequest,
    forward: Forward,
    window: ForwardWindow,
    message: dict[str, Any],
    body: bytes,
) -> web.StreamResponse:
    """Forward the prepared call (with its identity in ``params._meta``), record the answer's
    outcome, then answer: a JSON answer whole, an SSE stream event by event with the final
    answer written only after it is recorded. What the answer means is the adapter's
    (``McpAdapter.outcome``); ``body`` is the agent's message, as it was sent."""
    effect, seq = forward.effect, forward.seq
    request_id = message.get("id")
    token = _token(effect_request.fence)  # a keyed call's server gets no fencing token
    data = adapter.outbound_body(body, effect.effect_id, token)
    headers = _outbound(request, adapter, adapter.outbound_headers(effect.effect_id, token))
    recorded = False
    agent_gone = False
    stream: web.StreamResponse | None = None
    started = time.monotonic()
    seconds = request.app[METRICS].forward_seconds

    def observe(outcome: str) -> None:
        """``fencegate_forward_seconds``, as for ``/proxy``: until the answer, or the failure."""
        seconds.labels(downstream.name, outcome, effect.kind).observe(time.monotonic() - started)

    async def record(state: EffectState, reason: str, answer: dict[str, Any] | None) -> Effect:
        nonlocal recorded
        recorded = True
        if answer is not None or reason.startswith("status "):
            observe(state.value.lower())
        stored = None
        if answer is not None:
            raw = json.dumps(answer, separators=(",", ":")).encode()
            kept = (
                raw
                if len(raw) <= downstream.replay_max_bytes and downstream.store_response_body
                else None
            )
            # A body not kept still replays its error flag (``mcp.answer_summary``).
            stored = response_json(
                200,
                [("Content-Type", "application/json")],
                kept,
                omitted_reason=None if kept is not None else "not stored",
                summary=mcp.answer_summary(answer) if kept is None else None,
            )
        return await record_outcome(
            request, effect_request.fence, downstream.name, effect, seq, state, reason, stored,
            forward.fields,
        )  # fmt: skip

    limits = window.limits(downstream)
    run_end = _run_end(window, limits)  # every write to the agent ends by then, too
    try:
        async with send(
            request.app,
            downstream.name,
            "POST",
            downstream.url,
            limits,
            headers=headers,
            data=data,
            effect_id=effect.effect_id,
            mcp_meta=True,  # the trace context in params._meta, as the MCP spec reserves
        ) as resp:
            live = _answer_headers(resp)
            if resp.status != 200:
                # 2026-07-28 servers answer some JSON-RPC errors with 400/404: the body says
                # what happened when it is the answer to this call; else the status does.
                raw = await _bounded_body(resp)
                answer = _message(raw) if resp.content_type == "application/json" else None
                if answer is None or answer.get("id") != request_id or "error" not in answer:
                    answer = None  # not this call's answer (a session refused, a proxy's page)
                state, reason = adapter.outcome(resp.status, raw if answer else None, effect)
                done = await record(state, reason, answer)
                live.update(
                    {"Fence-Effect-Id": effect.effect_id, "Fence-Effect-State": done.state.value}
                )
                return web.Response(status=resp.status, body=raw, headers=live)
            if resp.content_type != _SSE:
                raw = await _bounded_body(resp)
                answer = _message(raw)
                if answer is None:
                    raise aiohttp.ClientPayloadError("the answer is not one JSON-RPC message")
                state, reason = adapter.outcome(200, raw, effect)
                done = await record(state, reason, answer)
                live.update(
                    {
                        "Fence-Effect-Id": effect.effect_id,
                        "Fence-Effect-State": done.state.value,
                        "Fence-Replayed": "false",
                    }
                )
                live.popall("Content-Type", None)
                return _jsonrpc(answer, live)
            live["Fence-Effect-Id"] = effect.effect_id
            stream = web.StreamResponse(status=200, headers=live)
            await stream.prepare(request)
            async for raw, event in _sse_events(resp.content):
                if (
                    isinstance(event, dict)
                    and event.get("id") == request_id
                    and "method" not in event
                ):
                    state, reason = adapter.outcome(200, json.dumps(event).encode(), effect)
                    await record(state, reason, event)
                    if not agent_gone:
                        await _finish(request, stream, raw, max(_left_s(run_end), 1.0))
                    return stream
                # An agent that left, or does not read within what the window leaves (a
                # write blocked on it is bounded by nothing else), is gone; the call goes on:
                # read the server's answer under the window's bounds and record it (a retry
                # then gets it replayed).
                if not agent_gone:
                    agent_gone = not await _write_within(request, stream, raw, _left_s(run_end))
            raise aiohttp.ClientPayloadError("the stream ended without the call's answer")
    except ForwardFailed as failed:
        if recorded:
            raise
        # The one table's outcome, recorded; then the one decision of what the agent gets
        # (gateway/forward.py), as /proxy's: a record the store refused is that refusal.
        failure = failed.failure
        observe(failure.metric)
        error: FencegateError
        try:
            done = await record(failure.outcome, failure.reason, None)
        except FencegateError as exc:
            error = exc
        else:
            target = _where(request, downstream, f"tools/call {forward.fields.get('tool')}")
            error = failure_answer(target, failure, effect=effect, recorded=done.state)
        return await _call_refused(request, stream, request_id, error)
    except StoreUnavailable as exc:
        return await _call_refused(request, stream, request_id, exc)


async def _call_refused(
    request: web.Request,
    stream: web.StreamResponse | None,
    request_id: Any,
    error: FencegateError,
) -> web.StreamResponse:
    """A tool call's refusal: a JSON-RPC error answer, or, when the agent already has the
    call's SSE stream (or had it), that stream's last event."""
    if stream is None:
        return _refuse(request_id, error)
    refusal = json.dumps(mcp.error_message(request_id, error), separators=(",", ":"))
    await _finish(request, stream, f"event: message\ndata: {refusal}\n\n".encode())
    return stream


# --- everything else: fence-checked (above), relayed as it is ----------------------------------


async def _copy(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    answer: web.StreamResponse,
    write_s: float,
    kept: bytearray | None = None,
) -> None:
    """Pass the body through; ``kept`` also gets a copy of it, up to ``_MAX_KEPT_BYTES``.
    An agent that does not take a chunk within ``write_s`` is gone (``_write_within``): a
    blocked write would hold a pooled connection for as long as the agent stays silent."""
    async for chunk in resp.content.iter_any():
        if kept is not None and len(kept) + len(chunk) <= _MAX_KEPT_BYTES:
            kept += chunk
        if not await _write_within(request, answer, chunk, write_s):
            return
    await answer.write_eof()


#: Largest ``tools/list`` answer of an agent the gateway reads for the tools' annotations.
_MAX_KEPT_BYTES = 1024 * 1024


def _tools_of(body: bytes, request_id: Any) -> dict[str, dict[str, Any]] | None:
    """The annotations in an agent's own ``tools/list`` answer (JSON or one SSE stream), when
    it is the whole list (no next page): the gateway then needs no ``tools/list`` of its own."""
    answer = _message(body)
    if answer is None:
        for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
            candidate = _event_data(event)
            if isinstance(candidate, dict) and candidate.get("id") == request_id:
                answer = candidate
    result = answer.get("result") if answer is not None else None
    if not isinstance(result, dict) or result.get("nextCursor") is not None:
        return None
    return _annotations(result)


def _annotations(result: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Tool name -> annotations (``{}`` when it has none) of one ``tools/list`` result."""
    tools: dict[str, dict[str, Any]] = {}
    for tool in result.get("tools") or []:
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            hints = tool.get("annotations")
            tools[tool["name"]] = hints if isinstance(hints, dict) else {}
    return tools


#: How often a relayed stream looks whether its agent is still connected.
_GONE_POLL_S = 1.0


async def _until_gone(request: web.Request) -> None:
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(_GONE_POLL_S)


async def _relay(
    request: web.Request,
    downstream: DownstreamConfig,
    adapter: McpAdapter,
    body: bytes | None,
    message: Mapping[str, Any] | None = None,
) -> web.StreamResponse:
    """Forward one HTTP request of the session without a ledger entry and pass the answer
    through as it comes (a JSON body, an SSE stream, a 202)."""
    headers = _outbound(request, adapter, adapter.outbound_headers(None, None))
    streaming = request.method == "GET"
    limits = downstream_limits(downstream, streaming=streaming)
    answer: web.StreamResponse | None = None
    try:
        async with send(
            request.app,
            downstream.name,
            request.method,
            downstream.url,
            limits,
            headers=headers,
            data=body,
            purpose="relay",
            mcp_meta=True,
        ) as resp:
            # Passed through as it comes, whatever its type: nothing here is kept.
            answer = web.StreamResponse(status=resp.status, headers=_answer_headers(resp))
            await answer.prepare(request)
            params = message.get("params") if message is not None else None
            listing = (
                message is not None
                and message.get("method") == "tools/list"
                and not (isinstance(params, dict) and params.get("cursor"))
                and resp.status == 200
            )
            kept = bytearray() if listing else None
            write_s = downstream.timeout_ms / 1000  # per write to the agent
            copy = asyncio.ensure_future(_copy(request, resp, answer, write_s, kept))
            if streaming:
                # A silent stream would notice an agent that left only at its next byte:
                # watch the agent's connection, and end the server's stream with it.
                # Also its lease ending, or a reload ending it (gateway/mcp_streams.py).
                gone = asyncio.ensure_future(mcp_streams.until_over(request, _until_gone(request)))
                await asyncio.wait({copy, gone}, return_when=asyncio.FIRST_COMPLETED)
                gone.cancel()
                if not copy.done():
                    copy.cancel()
                    return answer
            await copy
            if kept is not None and message is not None:
                tools = _tools_of(bytes(kept), message.get("id"))
                if tools is not None:
                    session = request.headers.get("Mcp-Session-Id", "")
                    request.app[MCP_TOOLS].put(downstream.name, session, tools)
            return answer
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        if answer is None:
            raise
        return answer  # the agent went away: the upstream request ends with this handler
    except ForwardFailed as failed:
        if answer is not None and answer.prepared:
            return answer  # broke off mid-stream: the agent sees its stream end
        # The one table and the one decision (gateway/forward.py), as for /proxy's GET.
        method = message.get("method") if message is not None else None
        target = _where(request, downstream, method if isinstance(method, str) else None)
        error = failure_answer(target, failed.failure)
        has_id = message is not None and "id" in message and "method" in message
        return _refuse(message.get("id") if message else None, error, has_id=has_id)
