"""What a payload is, for the digest an effect is bound to: JSON canonicalised so that key
order and spacing do not make two identical requests differ, strictly enough that two
different payloads never share a digest (docs/decisions.md, "Strict JSON digests"). Pure; used
by the adapters (each says what its requests' payload is) and the gateway's API parsing.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Any

from fencegate.ledger.errors import BadRequest

_NOT_ALNUM = re.compile(r"[^a-z0-9]")


def server_field_name(name: str) -> str:
    """A header field name as some server behind the gateway may read it: case, and which
    character separates its words, do not count. CGI, WSGI, PHP and Rack read ``If_Match`` as
    ``If-Match`` (``HTTP_IF_MATCH``); lighttpd's CGI turns every character but a letter or a
    digit into ``_``, and PHP a ``.``. So every such character is ``-`` here, wherever the
    gateway asks "is this that field?" (what it drops, a method override, what an approval
    covers, a ``Connection`` nomination): two red-team passes got past each narrower rule."""
    return _NOT_ALNUM.sub("-", name.lower())


__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_SAFE_INTEGER",
    "StrictJsonError",
    "canonical_body",
    "content_type_parts",
    "finite_float",
    "is_json",
    "json_depth",
    "no_constant",
    "non_utf8_charset",
    "server_field_name",
    "strict_loads",
    "unique_keys",
    "unsafe_integer",
]


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


def finite_float(literal: str) -> float:
    """``parse_float`` for strict JSON: a literal past a float's range (``1e400``) would be
    read as infinity and written back as ``Infinity``, which is not JSON (a stored result or
    payload holding one makes every listing that includes it unreadable)."""
    value = float(literal)
    if not math.isfinite(value):
        raise StrictJsonError(f"{literal[:40]} is beyond a JSON number's range (a float's)")
    return value


#: Built once: ``json.loads`` with hooks builds a new decoder (and its scanner) on every call,
#: which was a quarter of what parsing a claim or commit body cost.
_STRICT_DECODER = json.JSONDecoder(
    object_pairs_hook=unique_keys, parse_constant=no_constant, parse_float=finite_float
)


def strict_loads(raw: bytes) -> Any:
    """The one strict reader of the bodies the gateway parses itself (the ``/v1`` API): what
    ``json.loads(raw)`` does with bytes (the same encoding detection, so the same errors),
    except that duplicate keys, ``NaN`` / ``Infinity`` / ``-Infinity`` and numbers beyond a
    float's range raise ``StrictJsonError``. ``/mcp`` reads its messages with the same rules
    (``adapters.mcp.read_message``, which says why a message is refused instead of raising);
    ``/proxy`` bodies are not parsed (``canonical_body`` digests them byte for byte)."""
    return _STRICT_DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))


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
    charset = non_utf8_charset(content_type)
    if charset is not None:
        # The digest reads the bytes as UTF-8; a downstream decoding them as UTF-7 or
        # UTF-16 would run another message than the one approved (docs/security.md).
        raise BadRequest(
            f"JSON body: charset={charset[:40]!r}; JSON bodies are UTF-8 (send no charset, "
            "or charset=utf-8)"
        )
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


def content_type_parts(content_type: str) -> tuple[str, list[tuple[str, str]]]:
    """A ``Content-Type`` value as (media type, [(parameter name, value)]): lower-case names,
    values unquoted (``charset="UTF-8"`` -> ``("charset", "UTF-8")``); empty segments (a
    trailing ``;``) dropped. A segment without ``=`` is a parameter with an empty value."""
    media, *rest = content_type.split(";")
    params: list[tuple[str, str]] = []
    for segment in rest:
        if not segment.strip():
            continue
        name, _, value = segment.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        params.append((name.strip().lower(), value))
    return media.strip().lower(), params


def non_utf8_charset(content_type: str) -> str | None:
    """The ``charset`` parameter of a content type when it names anything but UTF-8 (any
    case, quoted or not), else None. The gateway reads JSON as UTF-8; a downstream that
    decodes by the declared charset reads other characters (``+AGs-`` in UTF-7 is ``k``)."""
    for name, value in content_type_parts(content_type)[1]:
        if name == "charset" and value.lower() != "utf-8":
            return value
    return None


#: How deep a JSON value the gateway reads for a message may nest (an object or array in
#: an object or array...; the message itself is level 1). Deeper bodies are refused before
#: anything is recorded: copying or encoding one recurses once per level, and past
#: Python's recursion limit that is a 500 after the PREPARE.
MAX_JSON_DEPTH = 64
#: The largest integer every JSON parser reads exactly (2^53 - 1): a server decoding numbers
#: as doubles (JavaScript, Go's ``interface{}``) runs ``9007199254740993`` as ...992.
MAX_SAFE_INTEGER = 2**53 - 1


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``value`` nests (a scalar: 0, ``{}``: 1), counted without recursion and
    only up to ``limit + 1`` (the walk stops there: that is enough to refuse it)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            items: Any = item.values()
        elif isinstance(item, list):
            items = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in items)
    return deepest


def unsafe_integer(value: Any) -> int | None:
    """The first integer in ``value`` (walked without recursion) outside
    ±``MAX_SAFE_INTEGER``, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if abs(item) > MAX_SAFE_INTEGER:
                return item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None
