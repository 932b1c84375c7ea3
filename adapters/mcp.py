"""The ``mcp`` adapter: what a JSON-RPC message through ``/mcp/{downstream}`` means for the
ledger (docs/PROTOCOL.md, "MCP"). Pure functions, so every rule is tested without a network.

``tools/call`` is the effect. Its slot is ``params._meta["fencegate/slot"]`` or, when absent,
derived from the tool name and the canonical arguments (two identical calls in one task
revision are then one effect); its payload is the tool name and the canonical arguments, never
the JSON-RPC ``id``. What an UNKNOWN call may do comes from the tool's annotations in
``tools/list`` (hints from the server) unless the downstream's ``tools`` table says otherwise:

* ``readOnlyHint``: fence-checked, no ledger entry (like a GET);
* ``idempotentHint``: re-sent under the same effectId after UNKNOWN only within a configured
  ``dedupe_window_ms`` (like the ``idempotent`` adapter), else never;
* anything else: never re-sent; an operator settles it (like ``manual``'s UNKNOWNs).

A result (``isError: true`` included: the tool ran) is COMMITTED, except 2026-07-28's
``resultType: "input_required"`` (the server asks the client for input and the call goes on in
the client's next request: NOT_APPLIED, so that request is forwarded); the JSON-RPC errors
``-32601`` (no such method) and ``-32602`` (invalid params) are NOT_APPLIED (refused before
the tool ran); any other error is UNKNOWN.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fencegate.adapters.base import Answer, EffectShape, Outgoing
from fencegate.adapters.http import HttpAdapter
from fencegate.ledger.effects import Effect, EffectState, payload_digest
from fencegate.ledger.errors import BadRequest, FencegateError
from fencegate.ledger.payloads import canonical_body

__all__ = [
    "CALL",
    "HEADER_MISMATCH",
    "LEASE_FREE_METHODS",
    "META_EFFECT_ID",
    "META_FENCING_TOKEN",
    "META_REPLAYED",
    "META_REPLAY_BODY",
    "META_SLOT",
    "NOT_APPLIED_CODES",
    "REFUSAL_CODE",
    "McpAdapter",
    "McpToolCache",
    "ToolCall",
    "ToolKind",
    "ToolOverride",
    "ToolPolicy",
    "classify",
    "error_message",
    "message_shape",
    "parse_tool_call",
    "policy_for",
    "replay",
    "routing_mismatch",
    "with_identity",
]

CALL = "tools/call"
#: Methods that set up or describe a session: a credential, no lease (docs/PROTOCOL.md).
LEASE_FREE_METHODS = frozenset(
    {"initialize", "notifications/initialized", "ping", "tools/list", "server/discover"}
)
META_SLOT = "fencegate/slot"
META_EFFECT_ID = "fencegate/effectId"
META_FENCING_TOKEN = "fencegate/fencingToken"
META_REPLAYED = "fencegate/replayed"
#: On a replayed result whose answer was not stored: ``"omitted"``.
META_REPLAY_BODY = "fencegate/replayBody"
_OURS = "fencegate/"

#: The JSON-RPC errors that refuse a call before the tool ran, unless a tool's table says
#: otherwise (``not_applied_codes``: a tool that may raise one of these after acting):
#: no such method, invalid params, and 2026-07-28's routing-header mismatch (checked by the
#: transport before the tool is dispatched; the SDK client re-sends once after it).
NOT_APPLIED_CODES: frozenset[int] = frozenset({-32601, -32602, -32020})
#: The JSON-RPC error code of every fencegate refusal (the implementation-defined server
#: error range); ``error.data.code`` says which (``FENCED``, ``EFFECT_UNKNOWN``...).
REFUSAL_CODE = -32000
_SLOT = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")
_MAX_TOOL_NAME = 200


class ToolKind(StrEnum):
    READ_ONLY = "read_only"
    IDEMPOTENT = "idempotent"
    EFFECT = "effect"


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """What a call of one tool is: recorded or not, re-sendable after UNKNOWN for how long."""

    kind: ToolKind
    #: How long after its first forward an UNKNOWN call may go again under its effectId.
    resend_window_ms: int | None = None
    require_approval: bool = False
    #: The tool's own forward timeout (None: the downstream's).
    timeout_ms: int | None = None
    #: Where the kind came from: ``config`` (the tools table) or ``annotations``.
    source: str = "annotations"
    #: JSON-RPC error codes that mean the tool did not run (``classify``).
    not_applied_codes: frozenset[int] = NOT_APPLIED_CODES


def policy_for(
    annotations: Mapping[str, Any] | None,
    kind: str | None = None,
    *,
    dedupe_window_ms: int | None = None,
    require_approval: bool = False,
    timeout_ms: int | None = None,
    not_applied_codes: frozenset[int] = NOT_APPLIED_CODES,
) -> ToolPolicy:
    """The policy of a tool: the configured ``kind`` wins over the server's hints."""
    source = "config"
    if kind is None:
        source = "annotations"
        hints = annotations or {}
        if hints.get("readOnlyHint") is True:
            kind = ToolKind.READ_ONLY
        elif hints.get("idempotentHint") is True:
            kind = ToolKind.IDEMPOTENT
        else:
            kind = ToolKind.EFFECT
    tool_kind = ToolKind(kind)
    window = dedupe_window_ms if tool_kind is ToolKind.IDEMPOTENT else None
    return ToolPolicy(tool_kind, window, require_approval, timeout_ms, source, not_applied_codes)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    slot: str
    #: The payload: canonical JSON of ``{"arguments": ..., "name": ...}``.
    payload: bytes


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def parse_tool_call(params: Any) -> ToolCall:
    """The effect a ``tools/call`` asks for; BadRequest (answered as -32602) for params that
    name no tool, carry non-object arguments or a slot outside the contract's grammar."""
    if not isinstance(params, dict):
        raise BadRequest("tools/call: params must be an object")
    name = params.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= _MAX_TOOL_NAME:
        raise BadRequest(f"tools/call: params.name must be a string of 1 to {_MAX_TOOL_NAME}")
    arguments = params.get("arguments", {})
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadRequest("tools/call: params.arguments must be an object")
    meta = params.get("_meta") or {}
    if not isinstance(meta, dict):
        raise BadRequest("tools/call: params._meta must be an object")
    payload = _canonical({"arguments": arguments, "name": name})
    slot = meta.get(META_SLOT)
    if slot is None:
        # Derived: the same tool with the same arguments in one task revision is one effect.
        slot = "mcp:" + hashlib.sha256(payload).hexdigest()[:32]
    elif not isinstance(slot, str) or not _SLOT.fullmatch(slot):
        raise BadRequest(
            f'tools/call: params._meta["{META_SLOT}"] must be 1 to 200 characters of '
            "A-Z a-z 0-9 . _ : @ / -"
        )
    return ToolCall(name, slot, payload)


def message_shape(message: Mapping[str, Any]) -> str | None:
    """Why one JSON-RPC message is not one the gateway relays (None: it is): a request needs
    a string method and, unless it is a ``notifications/`` one, an id; a message without a
    method is a response (``result`` or ``error``) to a request of the server."""
    method = message.get("method")
    if method is None:
        if "id" in message and ("result" in message or "error" in message):
            return None
        return "Invalid Request: a message needs a method, or an id with a result or an error"
    if not isinstance(method, str):
        return "Invalid Request: method must be a string"
    if "id" not in message and not method.startswith("notifications/"):
        return (
            f"Invalid Request: {method} without an id; only notifications/* go without one "
            "(a call without an id would get no answer and no ledger record)"
        )
    return None


#: 2026-07-28's routing-header mismatch (the server refuses such a request before it runs).
HEADER_MISMATCH = -32020
_STATELESS_VERSIONS = frozenset({"2026-07-28"})
_ENVELOPE_VERSION = "io.modelcontextprotocol/protocolVersion"


def routing_mismatch(
    version: str | None, headers: Mapping[str, Sequence[str]], message: Mapping[str, Any]
) -> str | None:
    """2026-07-28 requests repeat their method, tool name and version in headers, and the
    server refuses a request whose headers disagree with its body. Checked here, before the
    call is recorded: a refusal by the server would leave the call UNKNOWN (a tool may raise
    the same code after running), and the SDK client re-sends once after it. ``headers``:
    lower-case name -> every value sent."""
    if version not in _STATELESS_VERSIONS:
        return None
    for name in ("mcp-method", "mcp-name", "mcp-protocol-version"):
        if len(headers.get(name, ())) > 1:
            return f"{name} sent more than once"
    raw_params = message.get("params")
    params: Mapping[str, Any] = raw_params if isinstance(raw_params, dict) else {}
    raw_meta = params.get("_meta")
    meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    if list(headers.get("mcp-method", ())) != [message.get("method")]:
        return "Mcp-Method does not match the request body's method"
    if list(headers.get("mcp-name", ())) != [params.get("name")]:
        return "Mcp-Name does not match params.name"
    if meta.get(_ENVELOPE_VERSION) != version:
        return f"MCP-Protocol-Version does not match params._meta[{_ENVELOPE_VERSION!r}]"
    return None


def with_identity(message: Mapping[str, Any], effect_id: str, fencing_token: str) -> bytes:
    """The message as the server gets it: the effect's identity in ``params._meta`` (any
    ``fencegate/`` key the client sent is replaced: only the gateway names effects)."""
    out = copy.deepcopy(dict(message))
    params = out.setdefault("params", {})
    meta = {k: v for k, v in (params.get("_meta") or {}).items() if not k.startswith(_OURS)}
    meta[META_EFFECT_ID] = effect_id
    meta[META_FENCING_TOKEN] = fencing_token
    params["_meta"] = meta
    return json.dumps(out, separators=(",", ":")).encode()


def classify(
    message: Mapping[str, Any], not_applied_codes: frozenset[int] = NOT_APPLIED_CODES
) -> tuple[EffectState, str]:
    """What the server's answer to a ``tools/call`` means for the effect."""
    if "result" in message:
        result = message["result"]
        if isinstance(result, dict) and result.get("resultType") == "input_required":
            # 2026-07-28: the server needs input first; the client sends the call again with
            # it, and that request carries on (or finishes) the call.
            return EffectState.NOT_APPLIED, "input_required: the call goes on in a later request"
        if isinstance(result, dict) and result.get("isError") is True:
            return EffectState.COMMITTED, "result with isError: the tool ran"
        return EffectState.COMMITTED, "result"
    error = message.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and code in not_applied_codes:
        return EffectState.NOT_APPLIED, f"JSON-RPC error {code}: refused before the tool ran"
    return EffectState.UNKNOWN, f"JSON-RPC error {code}: the tool may have run"


def replay(stored: Mapping[str, Any], request_id: Any) -> dict[str, Any]:
    """A stored answer for a duplicate: under the new request's ``id``, marked replayed."""
    out = copy.deepcopy(dict(stored))
    out["id"] = request_id
    result = out.get("result")
    if isinstance(result, dict):
        meta = result.get("_meta")
        result["_meta"] = {**(meta if isinstance(meta, dict) else {}), META_REPLAYED: True}
    return out


def error_message(
    request_id: Any, error: FencegateError, code: int | None = None
) -> dict[str, Any]:
    """A refusal as a JSON-RPC error answer (HTTP 200): ``error.data`` holds the problem code,
    its detail and what the problem+json body would hold (``effectId``, ``effectState``...).
    ``code``: the JSON-RPC code, when the refusal has its own (-32600, -32020)."""
    if code is None:
        code = -32602 if isinstance(error, BadRequest) else REFUSAL_CODE
    data: dict[str, Any] = {"code": error.code, "status": error.status, "detail": error.detail}
    data.update(error.extra)
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "error": {"code": code, "message": f"{error.title}: {error.detail}", "data": data},
    }


@dataclass(frozen=True, slots=True)
class ToolOverride:
    """A ``[downstreams.tools.NAME]`` table: annotations come from the server and are only
    hints, so the operator may say what a tool is."""

    kind: str | None = None
    dedupe_window_ms: int | None = None
    require_approval: bool = False
    timeout_ms: int | None = None
    not_applied_codes: frozenset[int] = NOT_APPLIED_CODES


@dataclass(frozen=True)
class McpAdapter(HttpAdapter):
    """An MCP server's streamable-HTTP endpoint, served at ``/mcp/{downstream}``."""

    tools: Mapping[str, ToolOverride] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "mcp"

    def effect_of(self, request: Outgoing) -> EffectShape:
        """A ``tools/call``: the slot of its ``_meta`` (or derived), the payload its tool name
        and canonical arguments; ``BadRequest`` for a message that is no such call, or holds a
        number that does not survive a round trip through a float."""
        canonical = canonical_body(request.body, "application/json")
        try:
            message = json.loads(canonical)
        except (ValueError, RecursionError):
            raise BadRequest("tools/call: the body is not one JSON-RPC message") from None
        if canonical is request.body:
            raise BadRequest(
                "tools/call: a number in the message does not survive a round trip through a "
                "float (or is -0); send it as a string"
            )
        if not isinstance(message, dict) or message.get("method") != CALL:
            raise BadRequest("not a tools/call")
        call = parse_tool_call(message.get("params"))
        path = f"/tools/call/{call.name}"
        digest = payload_digest("POST", request.downstream, path, call.payload)
        return EffectShape(call.slot, "POST", path, digest)

    def outbound_body(self, body: bytes, effect_id: str, fencing_token: str) -> bytes:
        return with_identity(json.loads(body), effect_id, fencing_token)

    def outcome(self, status: int, body: bytes | None, effect: Effect) -> tuple[EffectState, str]:
        """From the body when it is the call's JSON-RPC answer (2026-07-28 servers answer some
        errors with 400/404, older ones with 200), else from the status: 4xx refused before
        anything ran, 5xx (or a 200 that is no answer) may have run."""
        answer = _json_object(body) if body is not None else None
        if answer is not None and ("result" in answer or "error" in answer):
            tool = effect.path.removeprefix("/tools/call/")
            codes = self.tools.get(tool, ToolOverride()).not_applied_codes
            state, reason = classify(answer, codes)
            return state, reason if status == 200 else f"{reason} (status {status})"
        if 400 <= status < 500:
            return EffectState.NOT_APPLIED, f"status {status}"
        return EffectState.UNKNOWN, f"status {status}: no answer to the call"

    def replay(self, effect: Effect, request: Outgoing) -> Answer:
        """The stored answer under the new request's id, marked replayed; an answer that was
        not stored replays as an empty result saying so (``fencegate/replayBody``)."""
        request_id = (_json_object(request.body) or {}).get("id")
        stored = json.loads(effect.response_json) if effect.response_json else None
        body = stored.get("bodyBase64") if stored else None
        answer = _json_object(base64.b64decode(body)) if body is not None else None
        if answer is None:
            omitted = {"content": [], "_meta": {META_REPLAY_BODY: "omitted"}}
            answer = {"jsonrpc": "2.0", "result": omitted}
        replayed = json.dumps(replay(answer, request_id), separators=(",", ":")).encode()
        return Answer(200, (("Content-Type", "application/json"),), replayed)

    def policy(self, tool: str, annotations: Mapping[str, Any] | None) -> ToolPolicy:
        override = self.tools.get(tool, ToolOverride())
        return policy_for(
            annotations,
            override.kind,
            dedupe_window_ms=override.dedupe_window_ms,
            require_approval=override.require_approval,
            timeout_ms=override.timeout_ms,
            not_applied_codes=override.not_applied_codes,
        )


class McpToolCache:
    """Tool annotations per (downstream, session id), bounded: a cache, never the truth (a
    gateway that misses asks the server)."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self._by_session: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        self._max = max_sessions

    def get(self, downstream: str, session: str) -> dict[str, dict[str, Any]] | None:
        return self._by_session.get((downstream, session))

    def put(self, downstream: str, session: str, tools: dict[str, dict[str, Any]]) -> None:
        if len(self._by_session) >= self._max:
            self._by_session.pop(next(iter(self._by_session)))
        self._by_session[(downstream, session)] = tools

    def drop(self, downstream: str, session: str) -> None:
        self._by_session.pop((downstream, session), None)
