"""The kept request record: what an operator sees of the call an effect forwarded.

Kept only for a downstream with ``keep_request_bodies = true``, written by the prepare that
opens the forward (in the same atomic step, on every store), replaced by the next forward's,
and gone with the effect record (retention). The gateway decides which headers may be kept
(``gateway.forward.kept_request``); what the body may keep is decided here: the values at the
downstream's ``redact_json_fields`` (JSON pointers, RFC 6901) are replaced by ``"<redacted>"``
first, then the body is cut to ``keep_request_max_bytes``. A body those pointers cannot be
applied to (not JSON) is not kept at all: a secret the operator asked to redact is never
stored because the body had another shape.

The record, as JSON (``Effect.request_json``), in this key order::

    headers      [[name, value], ...] as forwarded, less what no record keeps
    body         the kept body as text, when it is UTF-8 ...
    bodyBase64   ... else base64
    bodySize     the whole body's length in bytes (before redaction)
    truncated    true when the kept body is cut short (keep_request_max_bytes)
    bodyOmittedReason  instead of a body: why none was kept
"""

from __future__ import annotations

import base64
import codecs
import json
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "MAX_KEEP_BYTES",
    "NOT_JSON",
    "REDACTED",
    "Pointer",
    "parse_pointer",
    "redact",
    "request_json",
]

#: What a redacted value (a header's, a JSON field's) is stored as.
REDACTED = "<redacted>"
#: The largest ``keep_request_max_bytes`` (a record is read on every prepare of its effect).
MAX_KEEP_BYTES = 64 * 1024
#: ``bodyOmittedReason`` when ``redact_json_fields`` could not be applied.
NOT_JSON = "not JSON: redact_json_fields could not be applied, so no body was kept"

#: A parsed JSON pointer: its reference tokens, unescaped.
Pointer = tuple[str, ...]


def parse_pointer(text: str) -> Pointer:
    """The reference tokens of a JSON pointer (RFC 6901): ``/a/b~1c/0`` -> ("a", "b/c", "0").
    ValueError, in words, for anything else (the empty pointer names the whole body: that
    is ``keep_request_bodies = false``)."""
    if not text.startswith("/"):
        raise ValueError(f"{text!r} is not a JSON pointer: it must start with /")
    tokens = []
    for raw in text[1:].split("/"):
        rest = raw.replace("~0", "").replace("~1", "")
        if "~" in rest:
            raise ValueError(f"{text!r} is not a JSON pointer: ~ must be followed by 0 or 1")
        tokens.append(raw.replace("~1", "/").replace("~0", "~"))
    return tuple(tokens)


def _redact_at(node: Any, tokens: Pointer) -> None:
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        if isinstance(node, dict):
            if token not in node:
                return
            if last:
                node[token] = REDACTED
                return
            node = node[token]
        elif isinstance(node, list):
            if not token.isdigit() or (len(token) > 1 and token[0] == "0"):
                return
            index = int(token)
            if index >= len(node):
                return
            if last:
                node[index] = REDACTED
                return
            node = node[index]
        else:
            return


def redact(body: bytes, pointers: Sequence[Pointer]) -> bytes | None:
    """``body`` with the value at each pointer replaced by ``"<redacted>"`` (a pointer to
    nothing changes nothing), written out again as compact JSON; None when the body is not
    JSON (then nothing of it may be kept)."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    for tokens in pointers:
        _redact_at(document, tokens)
    try:
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    except (ValueError, RecursionError):  # pragma: no cover - what loads read, dumps writes
        return None


def request_json(
    headers: Iterable[Sequence[str]],
    body: bytes,
    *,
    max_bytes: int,
    pointers: Sequence[Pointer] = (),
) -> str:
    """The record for one forwarded request (``headers`` already filtered and redacted)."""
    record: dict[str, Any] = {"headers": [[name, value] for name, value in headers]}
    kept: bytes | None = body
    if pointers and body:
        kept = redact(body, pointers)
    if kept is None:
        record.update(bodySize=len(body), truncated=False, bodyOmittedReason=NOT_JSON)
        return json.dumps(record)
    truncated = len(kept) > max_bytes
    cut = kept[:max_bytes]
    try:
        record["body"] = cut.decode("utf-8")
    except UnicodeDecodeError:
        text = None
        if truncated:
            # The cut may split a character: that alone is no sign of binary.
            try:
                text = codecs.getincrementaldecoder("utf-8")().decode(cut, final=False)
            except UnicodeDecodeError:
                text = None
        if text is not None:
            record["body"] = text
        else:
            record["bodyBase64"] = base64.b64encode(cut).decode()
    record.update(bodySize=len(body), truncated=truncated)
    return json.dumps(record)
