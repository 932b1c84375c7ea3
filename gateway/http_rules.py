"""Pure HTTP rules of the proxy: which headers cross, which paths are allowed, what a payload
is. No I/O here, so every rule is tested without a socket (tests/test_http_rules.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Set
from urllib.parse import unquote_plus

from multidict import CIMultiDict

from fencegate.adapters.paths import escapes_base
from fencegate.adapters.preconditions import connection_listed
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.payloads import (
    StrictJsonError,
    canonical_body,
    is_json,
    no_constant,
    server_field_name,
    unique_keys,
)

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
    # One source: the conditional adapter counts only the preconditions that survive this.
    return connection_listed(headers)


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
    listed = _connection_listed(pairs)  # already as server_field_name reads them
    drop = listed | _ALWAYS_DROPPED
    drop |= {server_field_name(name) for name in identity} | {
        server_field_name(n) for n in reserved
    }
    if not forward_authorization:
        drop.add("authorization")
    # One pass: filter (as ``_without``) and collect the agent's X-Forwarded-For hops.
    out: CIMultiDict[str] = CIMultiDict()
    chain: list[str] = []
    keep_chain = "x-forwarded-for" not in listed
    for name, value in pairs:
        lower = server_field_name(name)
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
    method: str,
    headers: Iterable[tuple[str, str]],
    path_and_query: str,
    body: bytes = b"",
    *,
    approval_required: bool = False,
) -> None:
    """A safe method (forwarded without a ledger entry) must not carry a method override:
    the downstream could run it as the mutation it names, unrecorded and unfenced by the
    effect ledger. Nor may a mutation to a downstream that requires approval
    (``approval_required``): the operator approved its method, and a ``POST`` carrying
    ``X-HTTP-Method-Override: DELETE`` would delete. ``BadRequest`` if it does (any value,
    any case; ``_method`` also percent-encoded, and separated by ``&`` or ``;``, in the query
    or in a form or JSON body, where Rails and Laravel look for it; an operator sees the
    query, never the body). Other mutations are left alone: they are recorded either way."""
    if method not in SAFE_METHODS and not approval_required:
        return
    where = method if method in SAFE_METHODS else f"{method} to a downstream that requires approval"
    for name, _ in headers:
        if server_field_name(name) in METHOD_OVERRIDE_HEADERS:
            raise BadRequest(f"{name}: a method override is refused on {where}; "
                             "send the method itself")  # fmt: skip
    content_type = next((v for n, v in headers if n.lower() == "content-type"), "")
    fields = (
        ("query parameter", _form_names(path_and_query.partition("?")[2])),
        ("body field", _body_field_names(content_type, body)),
    )
    for place, names in fields:
        if any(METHOD_OVERRIDE_PARAM in (n.strip().lower(), _as_php_reads(n)) for n in names):
            raise BadRequest(f"{place} {METHOD_OVERRIDE_PARAM}: a method override is refused "
                             f"on {where}; send the method itself")  # fmt: skip


def _form_names(text: str) -> list[str]:
    """The field names of a query or urlencoded form, separated by ``&`` or ``;``."""
    return [unquote_plus(part.partition("=")[0]) for part in re.split(r"[&;]", text)]


#: A multipart part's header line that names ``_method`` in any way a parser might read
#: (quoted or not, single quotes, spaces, ``name*=``): matched loosely on purpose, since
#: parsers differ and a refused upload of a field so named costs nothing.
_PART_NAMING_METHOD = re.compile(rb"(?im)^[ \t]*content-disposition[ \t]*:[^\r\n]*_method")


def _body_field_names(content_type: str, body: bytes) -> list[str]:
    """The field names a framework may read from a body of ``content_type``: a form's
    (urlencoded, or no media type at all: Rack reads such a POST as a form; multipart:
    ``_method`` itself when a part's header names it), or a JSON object's top-level keys
    (any media type with ``json`` in it: Laravel's test is that loose); none otherwise."""
    if not body:
        return []
    media = content_type.partition(";")[0].strip().lower()
    if media in ("", "application/x-www-form-urlencoded"):
        return _form_names(body.decode("latin-1"))
    if media.startswith("multipart/"):
        return [METHOD_OVERRIDE_PARAM] if _PART_NAMING_METHOD.search(body) else []
    if "json" in media:
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return []  # not JSON (or nested past Python's parser): no framework reads it
        return [str(key) for key in parsed] if isinstance(parsed, dict) else []
    return []


def _as_php_reads(name: str) -> str:
    """A query parameter's name as PHP reads it into ``$_GET`` (Laravel and Symfony take
    ``_method`` from there): cut at a NUL, leading spaces gone, ``name[...]`` an array under
    ``name``, and a space, ``.`` or unmatched ``[`` read as ``_``; so ``.method``,
    ``[method`` and ``_method[]`` all reach the server as ``_method``. Lowercased: the check
    is in any case."""
    name = name.partition("\x00")[0].lstrip(" ")
    base, bracket, rest = name.partition("[")
    if bracket and "]" in rest:
        name = base
    return re.sub(r"[ .\[]", "_", name).lower()


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
    request targets, ``.`` and ``..`` segments in any spelling a server behind may read as
    one (``..;``, ``%2e%2e;x=1``, ``%252e%252e``, ``%u002e``, U+FF0E: ``adapters/paths.py``),
    encoded ``/`` and ``\\`` (at any depth of encoding), backslashes and NULs.
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
        if escapes_base(segment):  # ..;  %2e%2e;x=1  %252e%252e  %u002e  U+FF0E  %252f ...
            raise BadRequest(
                "path may not contain . or .. segments or encoded separators, in any spelling "
                "(after a ';', percent-encoded at any depth, %u escapes, fullwidth dots)"
            )
    if _CONTROL_OR_SPACE.search(path):
        raise BadRequest("path may not contain control characters or spaces")
    return name, tail + (sep + query if sep else "")


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
