"""Pure HTTP rules of the proxy: which headers cross, which paths are allowed, what a payload
is. No I/O here, so every rule is tested without a socket (tests/test_http_rules.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Set
from urllib.parse import unquote

from multidict import CIMultiDict

from fencegate.ledger.errors import BadRequest

__all__ = [
    "HOP_BY_HOP",
    "SAFE_METHODS",
    "canonical_body",
    "downstream_request_headers",
    "is_json",
    "split_proxy_path",
    "stored_response_headers",
    "upstream_response_headers",
]

#: RFC 9110 7.6.1 connection-specific fields, plus the de-facto Proxy-Connection and Keep-Alive.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DOWNSTREAM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FORBIDDEN_ESCAPES = re.compile(r"%(2f|5c|00)", re.IGNORECASE)


def _connection_listed(headers: Iterable[tuple[str, str]]) -> set[str]:
    listed: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            listed.update(token.strip().lower() for token in value.split(",") if token.strip())
    return listed


def _without(
    headers: Iterable[tuple[str, str]], drop: Set[str], drop_prefixes: tuple[str, ...] = ()
) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers:
        lower = name.lower()
        if lower in drop or lower.startswith(drop_prefixes):
            continue
        out.add(name, value)
    return out


def downstream_request_headers(
    agent_headers: Iterable[tuple[str, str]],
    identity: dict[str, str],
    *,
    forward_authorization: bool,
) -> CIMultiDict[str]:
    """The agent's headers as the downstream sees them.

    Removed: hop-by-hop fields and any field the agent's ``Connection`` lists, the gateway's
    own ``Fence-*``, ``Host`` and ``Content-Length`` (the client sets both), ``Expect``, any
    identity header the agent tried to set itself, and ``Authorization`` unless the downstream
    opts in. Added: the adapter's identity headers (idempotency key, fencing token).
    """
    pairs = list(agent_headers)
    drop = set(HOP_BY_HOP) | _connection_listed(pairs) | {"host", "content-length", "expect"}
    drop |= {name.lower() for name in identity}
    if not forward_authorization:
        drop.add("authorization")
    out = _without(pairs, drop, ("fence-",))
    for name, value in identity.items():
        out[name] = value
    return out


def upstream_response_headers(downstream_headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The downstream's answer headers as the agent sees them (live, not replayed).

    Hop-by-hop fields go, so does ``Content-Length`` (aiohttp sets it for the body it
    sends) and any ``Fence-*`` field: only the gateway speaks that vocabulary.
    """
    pairs = list(downstream_headers)
    drop = HOP_BY_HOP | _connection_listed(pairs) | {"content-length"}
    return _without(pairs, drop, ("fence-",))


def stored_response_headers(downstream_headers: Iterable[tuple[str, str]]) -> list[list[str]]:
    """What a replay may repeat: the live headers minus ``Set-Cookie`` (a session must not be
    handed to whoever sends the duplicate)."""
    kept = upstream_response_headers(downstream_headers)
    return [[name, value] for name, value in kept.items() if name.lower() != "set-cookie"]


def split_proxy_path(raw_path: str) -> tuple[str, str]:
    """``/proxy/{downstream}{tail}?{query}`` (still percent-encoded) -> (downstream, tail+query).

    Refuses what could leave the downstream's base path or reach another host: absolute-form
    request targets, ``.`` and ``..`` segments (also percent-encoded), encoded ``/`` and
    ``\\``, backslashes and NULs.
    """
    if not raw_path.startswith("/proxy/"):
        raise BadRequest("request target must be origin-form /proxy/{downstream}/...")
    path, sep, query = raw_path.partition("?")
    rest = path[len("/proxy/") :]
    name, slash, tail = rest.partition("/")
    if not _DOWNSTREAM_NAME.fullmatch(name):
        raise BadRequest("downstream name must be 1 to 64 characters of A-Z a-z 0-9 _ . -")
    tail = slash + tail
    if "\\" in tail or _FORBIDDEN_ESCAPES.search(tail):
        raise BadRequest("path may not contain backslashes, NULs or encoded separators")
    for segment in tail.split("/"):
        if unquote(segment) in (".", ".."):
            raise BadRequest("path may not contain . or .. segments")
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in path):
        raise BadRequest("path may not contain control characters or spaces")
    return name, tail + (sep + query if sep else "")


def is_json(content_type: str) -> bool:
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (
        main.startswith("application/") and main.endswith("+json")
    )


def canonical_body(body: bytes, content_type: str) -> bytes:
    """JSON bodies with sorted keys and no insignificant whitespace; any other body as is.

    A body that claims to be JSON but does not parse is digested as is, byte for byte.
    """
    if not body or not is_json(content_type):
        return body
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return body
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
