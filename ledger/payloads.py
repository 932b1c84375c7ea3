"""What a payload is, for the digest an effect is bound to: JSON canonicalised so that key
order and spacing do not make two identical requests differ, strictly enough that two
different payloads never share a digest (docs/decisions.md, "Strict JSON digests"). Pure; used
by the adapters (each says what its requests' payload is) and the gateway's API parsing.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

from fencegate.ledger.errors import BadRequest

__all__ = ["StrictJsonError", "canonical_body", "is_json", "no_constant", "unique_keys"]


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
