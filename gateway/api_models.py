"""Request bodies of the coordination API, and the one function that parses them.

Every model forbids unknown fields and is strict about types (``"5"`` is not an int, ``true``
is not an int), and every number has bounds, so nothing half-valid reaches the store. A bad
body becomes one 400 BAD_REQUEST whose detail names each offending field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt, StrictStr, ValidationError

from fencegate.ledger.errors import BadRequest
from fencegate.ledger.payloads import StrictJsonError, strict_loads

__all__ = [
    "TASK_ID_PATTERN",
    "ApiBody",
    "ClaimBody",
    "CommitBody",
    "IdentityBody",
    "PutTaskBody",
    "QueueClaimBody",
    "ReleaseBody",
    "RenewBody",
    "check_queue",
    "check_task_id",
    "parse_body",
]

#: The id grammar of the contract.
TASK_ID_PATTERN = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")
#: The queue name grammar (``queue`` of a task, ``/v1/queues/{queue}/claim``).
QUEUE_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,100}")
#: Largest integer JSON clients in every language read exactly (2**53 - 1).
MAX_SAFE_INT = 2**53 - 1
#: A task's ``priority`` range (higher is claimed first).
MAX_PRIORITY = 1_000_000
#: Most ``dependsOn`` ids a body may carry at all (the configured limit is lower).
MAX_DEPENDS_ON = 1_000
#: The largest value one cost unit may report at once.
MAX_COST = 1e15
#: The longest ``waitMs`` any body may carry (the configured limit is lower).
MAX_WAIT_MS = 600_000

Text = Annotated[StrictStr, Field(min_length=1, max_length=200)]
Counter = Annotated[StrictInt, Field(ge=0, le=MAX_SAFE_INT)]
Duration = Annotated[StrictInt, Field(ge=1, le=MAX_SAFE_INT)]
TaskId = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._:@/-]{1,200}$")]
Queue = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9._:-]{1,100}$")]
Priority = Annotated[StrictInt, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)]
#: ``cost``: what the attempt spent since its last report, per unit (the units come from the
#: config, checked by the handler): finite, non-negative numbers.
Cost = Annotated[
    dict[
        Annotated[StrictStr, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")],
        Annotated[float, Field(ge=0, le=MAX_COST, allow_inf_nan=False)],
    ],
    Field(max_length=16),
]
WaitMs = Annotated[StrictInt, Field(ge=0, le=MAX_WAIT_MS)]

M = TypeVar("M", bound=BaseModel)


class ApiBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PutTaskBody(ApiBody):
    inputDigest: Text
    maxRuntimeMs: Duration | None = None
    #: The queue the task is claimed from (``POST /v1/queues/{queue}/claim``); absent: none
    #: on create, unchanged on a revision.
    queue: Queue | None = None
    #: Higher is claimed first within the queue; absent: 0 on create, unchanged on a revision.
    priority: Priority | None = None
    #: Tasks that must be COMMITTED before this one is READY; absent: none on create,
    #: unchanged on a revision.
    dependsOn: Annotated[list[TaskId], Field(max_length=MAX_DEPENDS_ON)] | None = None


class ClaimBody(ApiBody):
    owner: Text
    ttlMs: Duration
    schedulerEpoch: Counter
    expectedRevision: Annotated[StrictInt, Field(ge=1, le=MAX_SAFE_INT)] | None = None


class QueueClaimBody(ApiBody):
    owner: Text
    ttlMs: Duration
    schedulerEpoch: Counter
    #: Wait up to this long for a claimable task (bounded by ``tasks.max_wait_ms``); 0 or
    #: absent: answer at once.
    waitMs: WaitMs | None = None


class IdentityBody(ApiBody):
    attemptId: Text
    claimGeneration: Counter
    owner: Text
    schedulerEpoch: Counter
    cancelGeneration: Counter


class ReleaseBody(IdentityBody):
    cost: Cost | None = None


class RenewBody(IdentityBody):
    ttlMs: Duration
    cost: Cost | None = None


class CommitBody(ApiBody):
    attemptId: Text
    claimGeneration: Counter
    schedulerEpoch: Counter
    cancelGeneration: Counter
    inputDigest: Text
    resultDigest: Text
    result: JsonValue = None
    cost: Cost | None = None


def check_task_id(task_id: str) -> str:
    if not TASK_ID_PATTERN.fullmatch(task_id):
        raise BadRequest("taskId must be 1 to 200 characters of A-Z a-z 0-9 . _ : @ / -")
    return task_id


def check_queue(queue: str) -> str:
    if not QUEUE_PATTERN.fullmatch(queue):
        raise BadRequest("queue must be 1 to 100 characters of A-Z a-z 0-9 . _ : -")
    return queue


def _field(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "body"


def parse_body(raw: bytes, model: type[M]) -> M:
    """Decode a JSON object body into ``model`` or raise one BadRequest naming the fields."""
    try:
        # One strict reader (ledger.payloads): no duplicate keys, no NaN / Infinity, nothing
        # past a float's range (1e400 would be stored, and served, as Infinity).
        data: Any = strict_loads(raw) if raw.strip() else None
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
