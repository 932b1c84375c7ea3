"""The stored response record: what duplicates of a COMMITTED effect are answered with.

Three writers store one (the proxy, from a forward's answer; the probe, when it finds the
effect; an operator resolving COMMITTED with a response); this module is the one place the
record is built. Each writer decides which headers a replay may repeat and whether the body
is small enough to keep; the record's shape is decided here.

The record, as JSON (``Effect.response_json``), in this key order::

    status       the downstream's status code
    headers      [[name, value], ...] as the writer kept them
    bodySize     \\
    bodyDigest    } the body kept for replay: its length, lowercase hex SHA-256, base64
    bodyBase64   /
    bodyOmitted  true instead of the three above when the body was not kept
    bodyOmittedReason  why (too large for replay_max_bytes, or store_response_body = false)
    source       who produced the answer, when not the forward itself ("probe")
    summary      what a replay must keep when the body was not kept (MCP: the result's
                 ``isError`` and ``resultType``), so a failed call never replays as a success
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["OMITTED_BY_CONFIG", "OMITTED_TOO_LARGE", "response_json", "response_record"]

#: ``bodyOmittedReason`` values the proxy writes.
OMITTED_TOO_LARGE = "larger than replay_max_bytes"
OMITTED_BY_CONFIG = "store_response_body = false"


def response_record(
    status: int,
    headers: Iterable[Sequence[str]],
    body: bytes | None,
    *,
    source: str | None = None,
    omitted_reason: str | None = None,
    summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The record for one answer; ``body`` None: not kept (``bodyOmitted``, with
    ``omitted_reason`` as ``bodyOmittedReason`` when given, and ``summary`` when the writer
    knows what a replay of it must still say)."""
    record: dict[str, Any] = {
        "status": status,
        "headers": [[name, value] for name, value in headers],
    }
    if body is None:
        record["bodyOmitted"] = True
        if omitted_reason is not None:
            record["bodyOmittedReason"] = omitted_reason
        if summary:
            record["summary"] = summary
    else:
        record.update(
            bodySize=len(body),
            bodyDigest=hashlib.sha256(body).hexdigest(),
            bodyBase64=base64.b64encode(body).decode(),
        )
    if source is not None:
        record["source"] = source
    return record


def response_json(
    status: int,
    headers: Iterable[Sequence[str]],
    body: bytes | None,
    *,
    source: str | None = None,
    omitted_reason: str | None = None,
    summary: dict[str, Any] | None = None,
) -> str:
    """``response_record`` as the JSON the stores keep in ``response_json``."""
    record = response_record(
        status, headers, body, source=source, omitted_reason=omitted_reason, summary=summary
    )
    return json.dumps(record)
