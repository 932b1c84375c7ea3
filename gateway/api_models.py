"""Request bodies of the coordination API, and the one function that parses them.

Every model forbids unknown fields and is strict about types (``"5"`` is not an int, ``true``
is not an int), and every number has bounds, so nothing half-valid reaches the store. A bad
body becomes one 400 BAD_REQUEST whose detail names each offending field.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt, StrictStr, ValidationError

from fencegate.gateway.http_rules import StrictJsonError, no_constant, unique_keys
from fencegate.ledger.errors import BadRequest

__all__ = [
    "TASK_ID_PATTERN",
    "ApiBody",
    "ClaimBody",
    "CommitBody",
    "IdentityBody",
    "PutTaskBody",
    "RenewBody",
    "check_task_id",
    "parse_body",
]

#: The id grammar of the contract.
TASK_ID_PATTERN = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")
#: Largest integer JSON clients in every language read exactly (2**53 - 1).
MAX_SAFE_INT = 2**53 - 1

Text = Annotated[StrictStr, Field(min_length=1, max_length=200)]
Counter = Annotated[StrictInt, Field(ge=0, le=MAX_SAFE_INT)]
Duration = Annotated[StrictInt, Field(ge=1, le=MAX_SAFE_INT)]

M = TypeVar("M", bound=BaseModel)


class ApiBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PutTaskBody(ApiBody):
    inputDigest: Text
    maxRuntimeMs: Duration | None = None


class ClaimBody(ApiBody):
    owner: Text
    ttlMs: Duration
    schedulerEpoch: Counter
    expectedRevision: Annotated[StrictInt, Field(ge=1, le=MAX_SAFE_INT)] | None = None


class IdentityBody(ApiBody):
    attemptId: Text
    claimGeneration: Counter
    owner: Text
    schedulerEpoch: Counter
    cancelGeneration: Counter


class RenewBody(IdentityBody):
    ttlMs: Duration


class CommitBody(ApiBody):
    attemptId: Text
    claimGeneration: Counter
    schedulerEpoch: Counter
    cancelGeneration: Counter
    inputDigest: Text
    resultDigest: Text
    result: JsonValue = None


def check_task_id(task_id: str) -> str:
    if not TASK_ID_PATTERN.fullmatch(task_id):
        raise BadRequest("taskId must be 1 to 200 characters of A-Z a-z 0-9 . _ : @ / -")
    return task_id


def _field(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "body"


#: Built once: ``json.loads`` with hooks builds a new decoder (and its scanner) on every call,
#: which was a quarter of what parsing a claim or commit body cost.
_STRICT_DECODER = json.JSONDecoder(object_pairs_hook=unique_keys, parse_constant=no_constant)


def _strict_loads(raw: bytes) -> Any:
    """What ``json.loads(raw, object_pairs_hook=unique_keys, parse_constant=no_constant)``
    does with bytes (the same encoding detection, so the same errors), on the shared
    decoder."""
    return _STRICT_DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))


def parse_body(raw: bytes, model: type[M]) -> M:
    """Decode a JSON object body into ``model`` or raise one BadRequest naming the fields."""
    try:
        data: Any = _strict_loads(raw) if raw.strip() else None
    except StrictJsonError as exc:
        raise BadRequest(f"body: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
            problems.append(f"{_field(error['loc'])}: {message}")
        raise BadRequest(
            "; ".join(problems), fields=[_field(e["loc"]) for e in exc.errors()]
        ) from exc
