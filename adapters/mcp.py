"""The ``mcp`` adapter: what a JSON-RPC message through ``/mcp/{downstream}`` means for the
ledger (docs/PROTOCOL.md, "MCP"). Pure functions, so every rule is tested without a network.

``tools/call`` is the effect. Its slot is ``params._meta["dev.fencegate/slot"]`` or, when absent,
derived from the tool name and the canonical arguments (two identical calls in one task
revision are then one effect); its payload is the tool name and the canonical arguments, never
the JSON-RPC ``id``. What a call is comes from the downstream's ``tools`` table (``kind``);
without one, from the tool's annotations in ``tools/list`` only when the downstream sets
``trust_annotations`` (they are the server's hints, which the MCP specification says a client
must not trust from an untrusted server), else it is an effect. ``require_approval`` always
makes a recorded, approved call, whatever the kind or the hints:

* ``readOnlyHint``: fence-checked, no ledger entry (like a GET);
* ``idempotentHint``: re-sent under the same effectId after UNKNOWN only within a configured
  ``dedupe_window_ms`` (like the ``idempotent`` adapter), else never;
* anything else: never re-sent; an operator settles it (like ``manual``'s UNKNOWNs).

A result (``isError: true`` included: the tool ran) is COMMITTED, except 2026-07-28's
``resultType: "input_required"`` (the server asks the client for input and the call goes on in
the client's next request: NOT_APPLIED, so that request is forwarded); the JSON-RPC errors
``-32601`` (no such method) and ``-32602`` (invalid params) are NOT_APPLIED (refused before
the tool ran); any other error is UNKNOWN.

The gateway's ``_meta`` names carry the reverse-DNS prefix ``dev.fencegate/`` (the MCP
specification recommends one). The older ``fencegate/`` names are still read and still sent
beside the new ones for at least one release (``ours``, ``both_names``): a message that gives
one name in both forms with different values is refused (-32602), and every key under either
prefix is the gateway's alone on the way to the server (``with_identity``, ``without_ours``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fencegate.adapters.base import Answer, EffectShape, Outgoing
from fencegate.adapters.http import HttpAdapter
from fencegate.ledger.effects import Effect, EffectState, payload_digest
from fencegate.ledger.errors import BadRequest, FencegateError
from fencegate.ledger.payloads import (
    MAX_JSON_DEPTH,
    MAX_SAFE_INTEGER,
    canonical_body,
    content_type_parts,
    json_depth,
    unsafe_integer,
)

__all__ = [
    "CALL",
    "HEADER_MISMATCH",
    "LEASE_FREE_METHODS",
    "LEGACY_PREFIX",
    "META_EFFECT_ID",
    "META_FENCING_TOKEN",
    "META_IDEMPOTENCY_KEY",
    "META_REPLAYED",
    "META_REPLAY_BODY",
    "META_SLOT",
    "META_WAIT",
    "NOT_APPLIED_CODES",
    "PREFIX",
    "READ_MEMBERS",
    "REFUSAL_CODE",
    "McpAdapter",
    "McpToolCache",
    "Parsed",
    "ToolCall",
    "ToolKind",
    "ToolOverride",
    "ToolPolicy",
    "answer_summary",
    "answerable_id",
    "both_names",
    "classify",
    "content_type_refusal",
    "error_message",
    "fold",
    "idempotency_key",
    "legacy",
    "member_collision",
    "message_shape",
    "meta_conflict",
    "omitted_answer",
    "ours",
    "parse_tool_call",
    "policy_for",
    "read_message",
    "refusal",
    "replay",
    "routing_mismatch",
    "with_identity",
    "without_ours",
]

CALL = "tools/call"
#: Methods that set up or describe a session: a credential, no lease (docs/PROTOCOL.md).
LEASE_FREE_METHODS = frozenset(
    {"initialize", "notifications/initialized", "ping", "tools/list", "server/discover"}
)
#: The prefix of the gateway's ``_meta`` names (reverse DNS, as the MCP specification
#: recommends), and the one they had before (still read and sent: ``LEGACY_PREFIX``).
PREFIX = "dev.fencegate/"
#: Read beside ``PREFIX`` and sent beside it for at least one release after the move.
LEGACY_PREFIX = "fencegate/"
_PREFIXES = (PREFIX, LEGACY_PREFIX)
META_SLOT = PREFIX + "slot"
META_EFFECT_ID = PREFIX + "effectId"
META_FENCING_TOKEN = PREFIX + "fencingToken"
META_REPLAYED = PREFIX + "replayed"
#: On a replayed result whose answer was not stored: ``"omitted"``.
META_REPLAY_BODY = PREFIX + "replayBody"
#: A lease-less client's idempotency key: its ``tools/call`` is a keyed effect.
META_IDEMPOTENCY_KEY = PREFIX + "idempotencyKey"
#: How long a duplicate of an in-flight call may wait for its outcome (seconds).
META_WAIT = PREFIX + "wait"
#: An idempotency key: 1 to 255 visible ASCII characters (as ``/proxy``'s header).
_KEY = re.compile(r"[\x21-\x7e]{1,255}")

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
    trust_annotations: bool = False,
) -> ToolPolicy:
    """The policy of a tool: the configured ``kind`` wins over the server's hints, which
    count only when the downstream says the server is trusted (``trust_annotations``: the MCP
    specification says a client must not trust annotations from an untrusted server, and a
    ``readOnlyHint`` means no record at all). Untrusted, a tool without a ``kind`` is an
    effect (source ``default``). ``require_approval`` always means a recorded, approved call:
    a read-only kind (configured or hinted) is then an effect."""
    source = "config"
    if kind is None:
        source = "annotations" if trust_annotations else "default"
        hints = (annotations or {}) if trust_annotations else {}
        if hints.get("readOnlyHint") is True:
            kind = ToolKind.READ_ONLY
        elif hints.get("idempotentHint") is True:
            kind = ToolKind.IDEMPOTENT
        else:
            kind = ToolKind.EFFECT
    tool_kind = ToolKind(kind)
    if require_approval and tool_kind is ToolKind.READ_ONLY:
        tool_kind = ToolKind.EFFECT
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


def legacy(name: str) -> str:
    """The older spelling of one of the gateway's ``_meta`` names: ``dev.fencegate/slot`` ->
    ``fencegate/slot``."""
    return LEGACY_PREFIX + name.removeprefix(PREFIX)


def both_names(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (under the new names) under both spellings, as the gateway sends its own
    ``_meta`` for at least one release after the move: a server or client that reads only
    the older names goes on working."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        out[name] = value
        out[legacy(name)] = value
    return out


def _is_ours(name: str) -> bool:
    return name.startswith(_PREFIXES)


def meta_conflict(meta: Mapping[str, Any]) -> str | None:
    """Why ``meta`` cannot be read as one set of the gateway's names, or None: a name given in
    both spellings with different values (which one did the client mean?). The same value in
    both is one name, as a client that sends both for older gateways does."""
    for name, value in meta.items():
        if not name.startswith(PREFIX):
            continue
        old = legacy(name)
        if old in meta and _canonical(meta[old]) != _canonical(value):
            return (
                f"Invalid params: params._meta gives {name[:100]!r} and {old[:100]!r} different "
                "values; send one of them, or both alike"
            )
    return None


def ours(meta: Mapping[str, Any], name: str) -> Any:
    """The value of the gateway's ``_meta`` name ``name`` (its ``dev.fencegate/`` spelling)
    under either spelling, None when neither is given. Two that differ never get here
    (``refusal``)."""
    if name in meta:
        return meta[name]
    return meta.get(legacy(name))


def idempotency_key(meta: Mapping[str, Any]) -> str | None:
    """A ``tools/call``'s idempotency key (``META_IDEMPOTENCY_KEY``, either spelling), None
    when it has none; BadRequest (-32602) for anything else than a string of 1 to 255 visible
    ASCII characters (``null`` included), the grammar of ``/proxy``'s ``Idempotency-Key``."""
    if META_IDEMPOTENCY_KEY not in meta and legacy(META_IDEMPOTENCY_KEY) not in meta:
        return None
    key = ours(meta, META_IDEMPOTENCY_KEY)  # given as null: no key either, and refused
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise BadRequest(
            f'tools/call: params._meta["{META_IDEMPOTENCY_KEY}"] must be a string of 1 to 255 '
            "visible ASCII characters (! to ~)"
        )
    return key


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
    slot = ours(meta, META_SLOT)
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


# --- member names: what a case-insensitive parser reads (docs/decisions.md, "Member folding") ---

#: The member names the gateway reads in a message, in ``params`` and in ``params._meta``. A
#: server whose JSON decoder matches names case-insensitively (Go's ``encoding/json``, under
#: mcp-go) reads ``Arguments`` where the gateway read ``arguments``: the gateway would record
#: one call and the server run another.
READ_MEMBERS = frozenset(
    {"jsonrpc", "id", "method", "params", "name", "arguments", "_meta", "cursor"}
)
#: ``params._meta`` keys the gateway reads or writes (its own ``dev.fencegate/`` and
#: ``fencegate/`` keys, the 2026-07-28 envelope): a key that folds into one of these prefixes
#: without having it is refused too.
_META_PREFIXES = (*_PREFIXES, "io.modelcontextprotocol/")
#: Unicode simple case foldings (CaseFolding.txt status S) that neither ``str.casefold`` (full
#: folding, where it maps one character to several) nor ``str.lower`` gives.
_SIMPLE_ONLY = {"\u1fd3": "\u0390", "\u1fe3": "\u03b0", "\ufb05": "\ufb06"}


@functools.lru_cache(maxsize=4096)
def _fold_char(char: str) -> str:
    """One character's simple case folding (one character, never several): ``casefold`` where
    it maps one to one (U+212A KELVIN SIGN -> ``k``, U+017F LONG S -> ``s``, final sigma ->
    sigma), else the folding of its lower case (U+1E9E CAPITAL SHARP S -> U+00DF), else itself
    (U+00DF stays: Go's ``EqualFold`` never matches it with ``ss``)."""
    folded = char.casefold()
    if len(folded) == 1:
        return folded
    if char in _SIMPLE_ONLY:
        return _SIMPLE_ONLY[char]
    lower = char.lower()
    if len(lower) == 1 and lower != char:
        return _fold_char(lower)
    return char


def fold(name: str) -> str:
    """``name`` under Unicode simple case folding, character by character: two names fold
    equal exactly when Go's ``strings.EqualFold`` (what ``encoding/json`` matches struct fields
    with) calls them equal, up to the Unicode version of each side's tables."""
    if name.isascii():
        return name.lower()
    return "".join(_fold_char(char) for char in name)


class _Repeated(dict[str, Any]):
    """A JSON object that named a member more than once (``json`` keeps the last value):
    ``repeated`` says which, so ``member_collision`` refuses it like any other collision."""

    repeated: tuple[str, ...] = ()


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a plain dict, or a ``_Repeated`` one naming its duplicates."""
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    seen: set[str] = set()
    repeated: dict[str, None] = {}
    for name, _ in pairs:
        if name in seen:
            repeated[name] = None
        seen.add(name)
    out = _Repeated(result)
    out.repeated = tuple(repeated)
    return out


def _collision(
    members: Mapping[str, Any], read: frozenset[str], prefixes: tuple[str, ...]
) -> str | None:
    """Why one object's member names are not one meaning to every parser, or None."""
    repeated = getattr(members, "repeated", ())
    if repeated:
        return f"member {repeated[0][:100]!r} appears twice"
    seen: dict[str, str] = {}
    folded_read = {fold(name): name for name in read}
    for name in members:
        key = fold(name)
        if key in seen:
            return (
                f"members {seen[key][:100]!r} and {name[:100]!r} are one name to a "
                "case-insensitive JSON parser"
            )
        seen[key] = name
        if key in folded_read and name != folded_read[key]:
            return (
                f"member {name[:100]!r} would be read as {folded_read[key]!r} by a "
                "case-insensitive JSON parser (the gateway reads names exactly)"
            )
        for prefix in prefixes:
            if key.startswith(fold(prefix)) and not name.startswith(prefix):
                return (
                    f"member {name[:100]!r} would be read as a {prefix!r} key by a "
                    "case-insensitive JSON parser (the gateway reads names exactly)"
                )
    return None


def member_collision(message: Mapping[str, Any]) -> str | None:
    """Why a message's member names could mean one thing to the gateway and another to the
    server (None: they cannot). The gateway reads members by their exact spelling; a server
    that matches them case-insensitively, or under Unicode simple folding (Go's
    ``encoding/json``), reads ``Arguments``, ``Name`` and ``params`` spelt with U+017F LONG S
    as ``arguments``, ``name`` and ``params``.

    So at the top level, in ``params`` and in ``params._meta``, two members that fold equal
    (an exact duplicate included), or a member that folds to a name the gateway reads
    (``READ_MEMBERS``; in ``_meta`` also its ``dev.fencegate/``, ``fencegate/`` and envelope
    prefixes) without being it, refuse the message; in ``params.arguments`` (which a tool
    may decode into a struct), two members that fold equal do. A duplicate deeper in the
    body is refused too (``Parsed.repeated``, ``refusal``)."""
    levels: list[tuple[str, Mapping[str, Any], frozenset[str], tuple[str, ...]]] = [
        ("the message", message, READ_MEMBERS, ())
    ]
    params = message.get("params")
    if isinstance(params, dict):
        levels.append(("params", params, READ_MEMBERS, ()))
        meta = params.get("_meta")
        if isinstance(meta, dict):
            levels.append(("params._meta", meta, READ_MEMBERS, _META_PREFIXES))
        arguments = params.get("arguments")
        if isinstance(arguments, dict):
            levels.append(("params.arguments", arguments, frozenset(), ()))
    for where, members, read, prefixes in levels:
        found = _collision(members, read, prefixes)
        if found is not None:
            return f"Invalid Request: {where}: {found}"
    return None


@dataclass(frozen=True, slots=True)
class Parsed:
    """One POSTed body as ``read_message`` read it."""

    #: The JSON value; objects that repeat a member keep its last value (as ``json.loads``)
    #: and say so (``member_collision``).
    message: Any
    #: Some object anywhere in the body repeats a member name.
    repeated: bool
    #: The body holds ``NaN``, ``Infinity``, ``-Infinity`` or a number past a float's range
    #: (``1e400``): not JSON numbers, and served back as ``Infinity``.
    non_finite: bool
    #: How deep the message nests (``ledger.payloads.json_depth``, counted up to one past
    #: ``MAX_JSON_DEPTH``).
    depth: int = 0


def read_message(body: bytes) -> Parsed:
    """Parse one ``/mcp`` POST body, noting instead of raising what the strict JSON rules
    (``ledger.payloads.strict_loads``) refuse, so the refusal can answer the message's own id
    (``refusal``). ``ValueError`` / ``RecursionError`` for a body that is not JSON."""
    found = {"repeated": False, "non_finite": False}

    def members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = _members(pairs)
        if isinstance(value, _Repeated):
            found["repeated"] = True
        return value

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            found["non_finite"] = True
        return value

    # UTF-8 only (``json.loads`` of bytes would also take UTF-16 and UTF-32): the server gets
    # ``Content-Type: application/json``, which is UTF-8, so it reads what the gateway read.
    text = body.decode("utf-8")
    message = json.loads(text, object_pairs_hook=members, parse_float=number, parse_constant=number)
    return Parsed(message, found["repeated"], found["non_finite"], json_depth(message))


def _non_finite(value: Any) -> bool:
    """Does ``value`` hold a non-finite number (walked without recursion: it parsed, so it may
    nest as deep as the parser follows)?"""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def answerable_id(message: Mapping[str, Any]) -> bool:
    """Has the message an id its refusal can answer under? Not when it has none, when ``id``
    is repeated (which one?) or holds a non-finite number (an answer cannot carry it as JSON):
    such a message is refused with HTTP 400 and ``id: null``."""
    if "id" not in message or "id" in getattr(message, "repeated", ()):
        return False
    # An id nested past the depth bound is not echoed either (the message is refused as too
    # deep, and its answer would be as deep).
    return not _non_finite(message["id"]) and json_depth(message["id"]) < MAX_JSON_DEPTH


def refusal(parsed: Parsed) -> tuple[int, str] | None:
    """Why the gateway refuses a message whatever its method, as (JSON-RPC code, detail), or
    None. Member names that may read otherwise to the server, or a repeated member anywhere:
    -32600 (Invalid Request; ``member_collision``). A non-finite number: -32602 (Invalid
    params: the message is JSON-RPC, its values are not JSON). A message nested deeper than
    ``MAX_JSON_DEPTH`` levels: -32600 (checked first: nothing else walks it). One of the
    gateway's ``_meta`` names given in both spellings with different values: -32602
    (``meta_conflict``)."""
    message = parsed.message
    if parsed.depth > MAX_JSON_DEPTH:
        return -32600, (
            f"Invalid Request: the message nests deeper than {MAX_JSON_DEPTH} levels "
            "(objects and arrays in one another)"
        )
    if isinstance(message, dict):
        collision = member_collision(message)
        if collision is not None:
            return -32600, collision
    if parsed.repeated:
        return -32600, "Invalid Request: an object in the message names a member twice"
    if parsed.non_finite:
        return -32602, (
            "Invalid params: NaN, Infinity and numbers past a float's range (1e400) are not "
            "JSON numbers; send such a value as a string"
        )
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    if isinstance(meta, dict) and (conflict := meta_conflict(meta)) is not None:
        return -32602, conflict
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


def with_identity(message: Mapping[str, Any], effect_id: str, fencing_token: str | None) -> bytes:
    """The message as the server gets it: the effect's identity in ``params._meta``, under
    both spellings (``both_names``); every key the client sent under either prefix is
    dropped: only the gateway names effects. A keyed call (``fencing_token`` None) has no
    fencing token. Only the levels it changes are copied (the message, ``params``,
    ``_meta``): the arguments go out as they came, never walked (a deep copy recursed once
    per level)."""
    out = dict(message)
    raw_params = out.get("params")
    params = dict(raw_params) if isinstance(raw_params, dict) else {}
    raw_meta = params.get("_meta")
    meta = raw_meta if isinstance(raw_meta, dict) else {}
    meta = {k: v for k, v in meta.items() if not _is_ours(k)}
    identity = {META_EFFECT_ID: effect_id}
    if fencing_token is not None:
        identity[META_FENCING_TOKEN] = fencing_token
    meta.update(both_names(identity))
    params["_meta"] = meta
    out["params"] = params
    return json.dumps(out, separators=(",", ":")).encode()


def without_ours(message: Mapping[str, Any]) -> dict[str, Any] | None:
    """A relayed message (anything but a recorded ``tools/call``) without the
    ``dev.fencegate/`` and ``fencegate/`` keys of its ``params._meta``, or None when it has
    none. Only the gateway names effects: a forged ``dev.fencegate/effectId`` on a read-only
    call or a ``resources/read`` would make the server believe the ledger vouched for it."""
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    if not isinstance(params, dict) or not isinstance(meta, dict):
        return None
    if not any(_is_ours(key) for key in meta):
        return None
    kept = {k: v for k, v in meta.items() if not _is_ours(k)}
    return {**message, "params": {**params, "_meta": kept}}


def content_type_refusal(values: Sequence[str]) -> str | None:
    """Why the ``Content-Type`` header(s) of an ``/mcp`` POST are refused, or None. The
    gateway reads the message as UTF-8 JSON; a server that decodes by the declared charset
    (``application/json; charset=utf-7``) would read another message. So: at most one
    header, whose media type is ``application/json`` and whose only parameter, if any, is
    ``charset=utf-8`` (any case, quoted or not). No header is accepted: the server always
    gets ``Content-Type: application/json``, never the agent's."""
    if len(values) > 1:
        return "Content-Type sent more than once"
    if not values:
        return None
    media, params = content_type_parts(values[0])
    if media != "application/json":
        return f"Content-Type {values[0][:80]!r}: a message is application/json"
    for name, value in params:
        if name != "charset" or value.lower() != "utf-8":
            return (
                f"Content-Type {values[0][:80]!r}: the only parameter a message may carry is "
                "charset=utf-8"
            )
    return None


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


def answer_summary(answer: Mapping[str, Any]) -> dict[str, Any]:
    """What a replay must still say of an answer whose body is not stored (too large for
    ``replay_max_bytes``, or ``store_response_body = false``): the result's ``isError`` and
    ``resultType``. Without it a failed call would replay as an empty success."""
    result = answer.get("result")
    if not isinstance(result, dict):
        return {}
    summary: dict[str, Any] = {"isError": result.get("isError") is True}
    if isinstance(result.get("resultType"), str):
        summary["resultType"] = result["resultType"]
    return summary


def omitted_answer(summary: Mapping[str, Any] | None) -> dict[str, Any]:
    """The answer a duplicate gets when the stored record has no body: no content, the
    ``summary``'s flags (``answer_summary``), and ``dev.fencegate/replayBody: omitted`` (both
    spellings)."""
    result: dict[str, Any] = {"content": [], "_meta": both_names({META_REPLAY_BODY: "omitted"})}
    for key in ("isError", "resultType"):
        if summary and key in summary:
            result[key] = summary[key]
    return {"jsonrpc": "2.0", "result": result}


def replay(stored: Mapping[str, Any], request_id: Any) -> dict[str, Any]:
    """A stored answer for a duplicate: under the new request's ``id``, marked replayed
    (``dev.fencegate/replayed``, both spellings)."""
    out = dict(stored)  # only the levels it changes are copied (``with_identity``)
    out["id"] = request_id
    result = out.get("result")
    if isinstance(result, dict):
        meta = result.get("_meta")
        out["result"] = {
            **result,
            "_meta": {
                **(meta if isinstance(meta, dict) else {}),
                **both_names({META_REPLAYED: True}),
            },
        }
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
    #: How long an operator's approval of a call stays usable (``require_approval``).
    approval_ttl_ms: int = 3600 * 1000
    #: How long a call may still land after the gateway stopped waiting (None: the
    #: downstream's ``settle_ms``).
    settle_ms: int | None = None


@dataclass(frozen=True)
class McpAdapter(HttpAdapter):
    """An MCP server's streamable-HTTP endpoint, served at ``/mcp/{downstream}``."""

    tools: Mapping[str, ToolOverride] = field(default_factory=dict)
    #: Believe the server's tool annotations (``readOnlyHint``, ``idempotentHint``)?
    trust_annotations: bool = False

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
        if (big := unsafe_integer(message)) is not None:
            # A server decoding numbers as doubles runs another amount than the one recorded
            # and approved (9007199254740993 -> ...992).
            raise BadRequest(
                f"tools/call: the integer {str(big)[:40]} is outside +/-{MAX_SAFE_INTEGER} "
                "(2^53 - 1), which not every JSON parser reads exactly; send it as a string"
            )
        if not isinstance(message, dict) or message.get("method") != CALL:
            raise BadRequest("not a tools/call")
        call = parse_tool_call(message.get("params"))
        path = f"/tools/call/{call.name}"
        digest = payload_digest("POST", request.downstream, path, call.payload)
        return EffectShape(call.slot, "POST", path, digest)

    def outbound_body(self, body: bytes, effect_id: str, fencing_token: str | None) -> bytes:
        """The call with its identity in ``params._meta`` (``with_identity``); a keyed call's
        (``fencing_token`` None) has no fencing token."""
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
        not stored replays as an empty result saying so (``dev.fencegate/replayBody``)."""
        request_id = (_json_object(request.body) or {}).get("id")
        stored = json.loads(effect.response_json) if effect.response_json else None
        body = stored.get("bodyBase64") if stored else None
        answer = _json_object(base64.b64decode(body)) if body is not None else None
        if answer is None:
            answer = omitted_answer(stored.get("summary") if stored else None)
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
            trust_annotations=self.trust_annotations,
        )

    def needs_annotations(self, tool: str) -> bool:
        """Does this tool's policy depend on the server's annotations (so the gateway must
        learn them, from ``tools/list``)? Only when they are trusted and no kind is set."""
        return self.trust_annotations and self.tools.get(tool, ToolOverride()).kind is None

    def approval_ttl(self, path: str) -> int | None:
        """A tool configured ``require_approval``: how long an approval of its call stays
        usable (``path`` is the effect's, ``/tools/call/NAME``); None for any other tool."""
        override = self.tools.get(path.removeprefix("/tools/call/"))
        if override is None or not override.require_approval:
            return None
        return override.approval_ttl_ms

    def settle_ms_for(self, path: str) -> int:
        """The tool's ``settle_ms`` (``path`` is the effect's, ``/tools/call/NAME``), else the
        downstream's."""
        override = self.tools.get(path.removeprefix("/tools/call/"))
        if override is None or override.settle_ms is None:
            return self.settle_ms
        return override.settle_ms


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
