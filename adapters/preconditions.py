"""When does a request's precondition make a second delivery of it harmless?

The ``conditional`` kind re-sends an UNKNOWN effect under its original key because the
downstream evaluates the precondition again (RFC 9110 13.2) and refuses a second application
with 412. That holds only for preconditions that change their answer once the request has
been applied:

* ``If-Match`` with strong entity-tags only (``"abc"``, or a list ``"a", "b"`` where every
  member is one): the request changes the representation, so its entity-tag, and the second
  delivery no longer matches. ``If-Match: *`` matches any current representation (the first
  delivery leaves one behind), and a weak tag (``W/"abc"``) never matches under the strong
  comparison If-Match uses, so a downstream that accepts one compares in its own way: neither
  is trusted.
* ``If-None-Match: *``: the first delivery created the resource, the second finds it. A list
  of tags (``If-None-Match: "x"``) still passes after the first delivery (the new tag is
  another one).

Either is enough (a request carrying both is refused by whichever fails). And a precondition
only counts if it reaches the downstream: a field that the agent's own ``Connection`` header
nominates is hop-by-hop (RFC 9110 7.6.1) and is removed before the forward
(``gateway/http_rules.py`` uses ``connection_listed`` from here), as is any field the gateway
sets itself. Pure: ``tests/test_conditional_preconditions.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from fencegate.ledger.payloads import server_field_name

__all__ = ["connection_listed", "makes_resend_safe", "reaching"]

#: ``entity-tag`` characters (RFC 9110 8.8.3: ``%x21 / %x23-7E / obs-text``); no DQUOTE.
_ETAGC = r"[\x21\x23-\x7e\x80-\U0010ffff]"
#: One field line of If-Match: a non-empty list of strong entity-tags, nothing else.
_STRONG_TAGS = re.compile(rf'[ \t]*"{_ETAGC}*"(?:[ \t]*,[ \t]*"{_ETAGC}*")*[ \t]*')


def connection_listed(headers: Iterable[tuple[str, str]]) -> set[str]:
    """The names (``server_field_name``) the request's ``Connection`` field(s) nominate:
    hop-by-hop, removed before the request goes on (with ``Connection`` itself)."""
    listed: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            listed.update(
                server_field_name(token.strip()) for token in value.split(",") if token.strip()
            )
    return listed


def reaching(
    pairs: Sequence[tuple[str, str]],
    headers: Iterable[tuple[str, str]],
    replaced: Iterable[str] = (),
) -> tuple[tuple[str, str], ...]:
    """The ``pairs`` (name, value) of a request with ``headers`` that reach the downstream:
    not nominated by its ``Connection``, not one of the ``replaced`` names the gateway sets
    itself (credentials, the idempotency key and fencing token headers)."""
    gone = connection_listed(headers) | {server_field_name(n) for n in replaced} | {"connection"}
    return tuple((name, value) for name, value in pairs if server_field_name(name) not in gone)


def makes_resend_safe(preconditions: Sequence[tuple[str, str]]) -> bool:
    """Would the downstream refuse (412) a second delivery of a request carrying exactly these
    preconditions (as they reach it) once the first has been applied? True for ``If-Match``
    with strong entity-tags only (on every field line: a second ``If-Match: *`` line spoils
    the first's tags) and for one ``If-None-Match: *`` line alone (``*`` with anything else is
    no valid field value, and a downstream may read it either way)."""
    if_match = [v for n, v in preconditions if n.lower() == "if-match"]
    if_none_match = [v for n, v in preconditions if n.lower() == "if-none-match"]
    if if_match and all(_STRONG_TAGS.fullmatch(value) for value in if_match):
        return True
    return len(if_none_match) == 1 and if_none_match[0].strip(" \t") == "*"
