"""Pure HTTP rules of the proxy: which headers cross, which paths are allowed, what a payload
is. No I/O here, so every rule is tested without a socket (tests/test_http_rules.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Set
from decimal import Decimal
from typing import Any
from urllib.parse import unquote, unquote_plus

from multidict import CIMultiDict

from fencegate.ledger.errors import BadRequest

__all__ = [
    "CLIENT_CLAIMS",
    "HOP_BY_HOP",
    "METHOD_OVERRIDE_HEADERS",
    "METHOD_OVERRIDE_PARAM",
    "NEVER_STORED",
    "SAFE_METHODS",
    "StrictJsonError",
    "canonical_body",
    "downstream_request_headers",
    "is_json",
    "no_constant",
    "refuse_method_override",
    "split_proxy_path",
    "stored_response_headers",
    "unique_keys",
    "upstream_response_headers",
    "without_secret_values",
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
#: What ``upstream_response_headers`` drops whatever the answer (built once).
_RESPONSE_DROPPED = HOP_BY_HOP | {"content-length"}
_DOWNSTREAM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FORBIDDEN_ESCAPES = re.compile(r"%(2f|5c|00)", re.IGNORECASE)
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")


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


#: Agent-sent fields that claim to say who the client is. There is no trusted-proxy list (yet),
#: so the gateway believes none of them: they are dropped, and X-Forwarded-For gets the peer.
CLIENT_CLAIMS = frozenset({"forwarded", "x-real-ip"})
#: What ``downstream_request_headers`` drops whatever the call (built once, not per call).
_ALWAYS_DROPPED = HOP_BY_HOP | CLIENT_CLAIMS | {"host", "content-length", "expect",
                                               "x-forwarded-for"}  # fmt: skip


def downstream_request_headers(
    agent_headers: Iterable[tuple[str, str]],
    identity: dict[str, str],
    *,
    forward_authorization: bool,
    reserved: Iterable[str],
    peer: str | None,
) -> CIMultiDict[str]:
    """The agent's headers as the downstream sees them.

    Removed: hop-by-hop fields and any field the agent's ``Connection`` lists, the gateway's
    own ``Fence-*``, ``Host`` and ``Content-Length`` (the client sets both), ``Expect``,
    ``Forwarded`` and ``X-Real-IP`` (``CLIENT_CLAIMS``), any identity header the agent tried
    to set itself, the ``reserved`` names (the downstream's idempotency-key and fencing-token
    headers: on every method, also where the gateway sets no identity, a safe method), and
    ``Authorization`` unless the downstream opts in. Added: the adapter's identity headers
    (credentials, idempotency key, fencing token) and ``X-Forwarded-For``: the agent's
    values (joined) with ``peer`` appended (``unknown`` when the peer has no address).
    """
    pairs = list(agent_headers)
    listed = _connection_listed(pairs)
    drop = listed | _ALWAYS_DROPPED
    drop |= {name.lower() for name in identity} | {name.lower() for name in reserved}
    if not forward_authorization:
        drop.add("authorization")
    # One pass: filter (as ``_without``) and collect the agent's X-Forwarded-For hops.
    out: CIMultiDict[str] = CIMultiDict()
    chain: list[str] = []
    keep_chain = "x-forwarded-for" not in listed
    for name, value in pairs:
        lower = name.lower()
        if lower == "x-forwarded-for":
            if keep_chain:
                chain.extend(hop.strip() for hop in value.split(",") if hop.strip())
            continue
        if lower in drop or lower.startswith("fence-"):
            continue
        out.add(name, value)
    chain.append(peer or "unknown")
    out["X-Forwarded-For"] = ", ".join(chain)
    for name, value in identity.items():
        out[name] = value
    return out


#: Fields that ask a server to treat a request as another method (Rails, Express's
#: method-override, Google APIs, ...), and the query parameter that does the same.
METHOD_OVERRIDE_HEADERS = frozenset({"x-http-method-override", "x-http-method",
                                     "x-method-override"})  # fmt: skip
METHOD_OVERRIDE_PARAM = "_method"


def refuse_method_override(
    method: str, headers: Iterable[tuple[str, str]], path_and_query: str
) -> None:
    """A safe method (forwarded without a ledger entry) must not carry a method override:
    the downstream could run it as the mutation it names, unrecorded and unfenced by the
    effect ledger. ``BadRequest`` if it does (any value, any case; ``_method`` also
    percent-encoded, and separated by ``&`` or ``;``). Mutations are left alone: they are
    recorded either way."""
    if method not in SAFE_METHODS:
        return
    for name, _ in headers:
        if name.lower() in METHOD_OVERRIDE_HEADERS:
            raise BadRequest(f"{name}: a method override is refused on {method}; "
                             "send the method itself")  # fmt: skip
    query = path_and_query.partition("?")[2]
    for part in re.split(r"[&;]", query):
        name = unquote_plus(part.partition("=")[0]).strip().lower()
        if name == METHOD_OVERRIDE_PARAM:
            raise BadRequest(f"query parameter {METHOD_OVERRIDE_PARAM}: a method override is "
                             f"refused on {method}; send the method itself")  # fmt: skip


def upstream_response_headers(downstream_headers: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The downstream's answer headers as the agent sees them (live, not replayed).

    Hop-by-hop fields go, so does ``Content-Length`` (aiohttp sets it for the body it
    sends) and any ``Fence-*`` field: only the gateway speaks that vocabulary.
    """
    pairs = list(downstream_headers)
    return _without(pairs, _connection_listed(pairs) | _RESPONSE_DROPPED, ("fence-",))


#: Response fields no stored record keeps, whatever the downstream's config: a session must
#: not be handed to whoever sends the duplicate, and a credential echoed back by the
#: downstream must not be written to the store (docs/security.md, "Secrets at rest").
NEVER_STORED = frozenset({"set-cookie", "set-cookie2", "authorization", "proxy-authorization"})


def stored_response_headers(
    downstream_headers: Iterable[tuple[str, str]],
    never_store: Iterable[str] = (),
    secret_values: Iterable[str] = (),
    *,
    live: bool = False,
) -> list[list[str]]:
    """What a replay may repeat: the live headers minus ``NEVER_STORED`` and the
    ``never_store`` names (the downstream's ``never_store_headers`` and every header its
    ``headers_from_env`` sets; any case), and minus any field that echoes one of
    ``secret_values`` (``without_secret_values``). ``live``: ``downstream_headers`` are the
    live answer's already (the proxy built them for the agent), so that filtering is not
    done twice per forward."""
    if not live:
        downstream_headers = without_secret_values(
            upstream_response_headers(downstream_headers), secret_values
        ).items()
    drop = NEVER_STORED | {name.lower() for name in never_store}
    return [[name, value] for name, value in downstream_headers if name.lower() not in drop]


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
        # unquote only what could decode to a dot segment (same answer, less work per call)
        if segment in (".", "..") or ("%" in segment and unquote(segment) in (".", "..")):
            raise BadRequest("path may not contain . or .. segments")
    if _CONTROL_OR_SPACE.search(path):
        raise BadRequest("path may not contain control characters or spaces")
    return name, tail + (sep + query if sep else "")


def is_json(content_type: str) -> bool:
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (
        main.startswith("application/") and main.endswith("+json")
    )


class StrictJsonError(Exception):
    """JSON that Python's parser accepts and fencegate does not: duplicate keys (parsers
    disagree on which one wins) and NaN / Infinity (not JSON). Not a ValueError, so ``json``
    does not swallow it."""


def unique_keys(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for strict JSON: two values for one key is an error. The dict is
    built in C; keys are walked in Python only when it came out shorter than ``items``."""
    result = dict(items)
    if len(result) != len(items):
        seen: set[str] = set()
        for key, _ in items:
            if key in seen:
                raise StrictJsonError(f"duplicate key {key[:100]!r} in an object")
            seen.add(key)
    return result


def no_constant(name: str) -> Any:
    """``parse_constant`` for strict JSON."""
    raise StrictJsonError(f"{name} is not a JSON number")


#: Integer literals longer than this are not converted (Python refuses over 4300 digits);
#: a body holding one is digested byte for byte.
_MAX_INT_DIGITS = 4000
#: The canonical form's encoder, built once (``json.dumps`` with options builds one per call).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_body(body: bytes, content_type: str) -> bytes:
    """The body as the payload digest takes it: for a JSON body (``is_json``) that parses,
    sorted keys and no insignificant whitespace; any other body byte for byte.

    Two different payloads never share the result (docs/decisions.md, "Strict JSON
    digests"):

    * duplicate keys in an object (parsers disagree on which one wins), ``NaN``,
      ``Infinity`` and ``-Infinity`` (not JSON), and strings with a lone surrogate (not
      Unicode) raise ``BadRequest``;
    * a number is kept as Python reads it only when that loses nothing: a float literal whose
      exact decimal value equals the shortest repr of the float it parses to (``1.50`` and
      ``1.5`` are one value; ``100.000000000000000001`` and ``1e400`` are not what the float
      says), an integer literal other than ``-0``. A body with any other number is digested
      byte for byte (key order and spacing then count);
    * a body that claims to be JSON but does not parse (or nests too deeply to parse) is
      digested byte for byte. Such bytes never equal a canonical form, which is valid JSON
      whose every number is canonical.
    """
    if not body or not is_json(content_type):
        return body
    lossy = False

    def number(literal: str) -> float:
        nonlocal lossy
        value = float(literal)
        if not math.isfinite(value) or Decimal(repr(value)) != Decimal(literal):
            lossy = True
        return value

    def integer(literal: str) -> int:
        nonlocal lossy
        if literal == "-0" or len(literal) > _MAX_INT_DIGITS:
            lossy = True
            return 0
        return int(literal)

    try:
        value = json.loads(
            body,
            object_pairs_hook=unique_keys,
            parse_float=number,
            parse_int=integer,
            parse_constant=no_constant,
        )
    except StrictJsonError as exc:
        raise BadRequest(f"JSON body: {exc}") from None
    except (ValueError, RecursionError):
        return body
    try:
        encoded = _CANONICAL.encode(value).encode()
    except UnicodeEncodeError:
        raise BadRequest("JSON body: a string holds a lone surrogate (not Unicode)") from None
    return body if lossy else encoded


def without_secret_values(headers: CIMultiDict[str], secrets: Iterable[str]) -> CIMultiDict[str]:
    """``headers`` less every field whose value contains one of ``secrets`` (the credential
    values the gateway adds for this downstream): a downstream that echoes its request
    headers must not hand the gateway's credential to the agent, nor into the store."""
    needles = [secret for secret in secrets if secret]
    if not needles:
        return headers
    kept: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if not any(needle in value for needle in needles):
            kept.add(name, value)
    return kept
