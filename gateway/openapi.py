"""The OpenAPI 3.1 document of the gateway's HTTP API, served at ``GET /openapi.json``.

Request bodies come from the pydantic models the handlers parse with (``api_models``,
``ledger_api``), and answers from the models the handlers build them with (``answers``), so
the document cannot drift from what is accepted or sent; the enums in it are the ledger's.
Written out here: the paths and operations, problem+json (which codes each answer may carry)
and the two probes' answers. ``docs/openapi.json`` is this document, rendered by
``python -m fencegate.gateway.openapi > docs/openapi.json``; ``tests/test_openapi.py`` checks
that the file, the served document and the app's routes agree, and that real answers validate.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from fencegate.gateway import answers
from fencegate.gateway.api_models import (
    QUEUE_PATTERN,
    ClaimBody,
    CommitBody,
    PutTaskBody,
    QueueClaimBody,
    ReleaseBody,
    RenewBody,
)
from fencegate.gateway.coordination import MAX_TASK_PAGE
from fencegate.gateway.ledger_api import MAX_PAGE, ApproveBody, ResolveBody
from fencegate.ledger.effects import EffectState

__all__ = ["document", "document_bytes", "serve"]

Schema = dict[str, Any]

_REF = "#/components/schemas/{model}"
PROBLEM = "application/problem+json"


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


_TIME: Schema = {"type": "integer", "description": "ms since the Unix epoch, store time"}
_TEXT: Schema = {"type": "string"}
_HEX64: Schema = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_QUEUE: Schema = {"type": "string", "pattern": f"^{QUEUE_PATTERN.pattern}$"}


def _object(required: dict[str, Schema], optional: dict[str, Schema] | None = None) -> Schema:
    """An answer object: ``required`` members always present; unknown members allowed (the
    contract tells clients to ignore fields they do not know)."""
    return {
        "type": "object",
        "required": list(required),
        "properties": {**required, **(optional or {})},
    }


_PROBLEM: Schema = _object(
    {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "detail": {"type": "string"},
        "code": {"type": "string", "pattern": "^[A-Z_]+$"},
    },
    {
        "effectId": {"type": "string"},
        "effectState": {"type": "string"},
        "retryAfterMs": {"type": "integer", "minimum": 0},
        "fields": {"type": "array", "items": {"type": "string"}},
        "matches": {
            "type": "array",
            "items": _HEX64,
            "maxItems": 10,
            "description": "BAD_REQUEST of GET /v1/effects/{prefix}: effect ids the "
            "ambiguous prefix starts (the first 10, in id order)",
        },
        "leaseExpiresAt": {**_TIME, "description": "CLAIMED, LEASE_EXPIRED: the lease's end"},
        "runtimeEndsAt": {**_TIME, "description": "RUNTIME_EXCEEDED: the attempt's last instant"},
        "probeUntil": {**_TIME, "description": "EFFECT_IN_FLIGHT: another reconciler's probe"},
        "landingUntil": {
            **_TIME,
            "description": "EFFECT_IN_FLIGHT (resolve NOT_APPLIED): until when an earlier "
            "forward may still land at the downstream (settle_ms)",
        },
        "resolvedAt": {**_TIME, "description": "EFFECT_SETTLED: when an operator resolved it"},
    },
)

#: The answers written out here rather than generated: problem+json (``gateway/problems.py``
#: builds it from each error's own members) and the two probes (``gateway/app.py``).
_WRITTEN: dict[str, Schema] = {
    "Problem": _PROBLEM,
    "Health": _object({"status": {"const": "ok"}, "version": _TEXT}),
    "Ready": _object(
        {"status": {"const": "ready"}, "store": {"enum": ["sqlite", "redis", "postgres"]}}
    ),
}

#: The answers of the JSON API, generated from the models the handlers build them with;
#: the schemas they refer to (nested records, the ledger's enums) come along.
_ANSWERS: tuple[type[BaseModel], ...] = (
    answers.CommitRecord,
    answers.Task,
    answers.ClaimGranted,
    answers.Renewed,
    answers.Released,
    answers.Event,
    answers.Committed,
    answers.Cancelled,
    answers.Scheduler,
    answers.Rollout,
    answers.StoreStats,
    answers.StoredResponse,
    answers.Effect,
    answers.EffectPage,
    answers.TaskPage,
    answers.Resolved,
)


class _AnswerSchema(GenerateJsonSchema):
    """An answer's schema says what is sent. A model's default is never sent (an answer holds
    what its handler set; a member with a default is one clients must do without), so it is
    left out rather than promised."""

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])


def _add_answer_schemas(schemas: dict[str, Schema]) -> None:
    """The answers' schemas into ``schemas``; a name that two different schemas would take
    (two models of one name) fails the document rather than losing one of them."""

    def add(name: str, schema: Schema) -> None:
        if schemas.setdefault(name, schema) != schema:
            raise RuntimeError(f"two schemas are named {name}")

    for answer in _ANSWERS:
        generated = answer.model_json_schema(
            ref_template=_REF, mode="serialization", schema_generator=_AnswerSchema
        )
        defs = generated.pop("$defs", {})
        add(answer.__name__, generated)
        for def_name, schema in defs.items():
            add(def_name, schema)


_REQUESTS: tuple[type[BaseModel], ...] = (
    PutTaskBody,
    ClaimBody,
    QueueClaimBody,
    ReleaseBody,
    RenewBody,
    CommitBody,
    ResolveBody,
    ApproveBody,
)

#: Problem codes per status that any gateway route may answer (docs/PROTOCOL.md, "Errors").
_COMMON: dict[int, tuple[str, ...]] = {
    400: ("BAD_REQUEST",),
    401: ("UNAUTHENTICATED",),
    403: ("FORBIDDEN",),
    408: ("REQUEST_TIMEOUT",),
    413: ("PAYLOAD_TOO_LARGE",),
    415: ("UNSUPPORTED_MEDIA_TYPE",),
    421: ("MISDIRECTED_REQUEST",),
    429: ("RATE_LIMITED",),
    503: ("STORE_UNAVAILABLE", "TOO_MANY_CONNECTIONS"),
}
_LEASE_CODES = (
    "CLAIMED",
    "FENCED",
    "LEASE_EXPIRED",
    "STALE_EPOCH",
    "CANCELLED",
    "STALE_INPUT",
    "ALREADY_COMMITTED",
    "RUNTIME_EXCEEDED",
)
_EFFECT_CODES = ("EFFECT_IN_FLIGHT", "EFFECT_UNKNOWN", "EFFECT_SETTLED", "APPROVAL_REQUIRED")


#: The problem answers the document uses, by name (``components.responses``), filled as
#: operations are built.
_PROBLEM_ANSWERS: dict[str, Any] = {}
_PROXY_HEADERS: dict[str, Any] = {
    "Fence-Effect-Id": {"schema": {"type": "string"}},
    "Fence-Effect-State": {"schema": {"enum": ["NONE", *(state.value for state in EffectState)]}},
    "Fence-Replayed": {"schema": {"enum": ["true", "false"]}},
}


def _problem_answer(status: int, codes: tuple[str, ...], proxied: bool) -> dict[str, Any]:
    """A ``$ref`` to the shared answer for ``status`` with one of ``codes``."""
    name = "".join(code.title().replace("_", "") for code in codes) + ("Proxied" if proxied else "")
    if name not in _PROBLEM_ANSWERS:
        headers: dict[str, Any] = {}
        if status == 401:
            headers["WWW-Authenticate"] = {"schema": {"type": "string"}}
        if status in (409, 429, 503):
            headers["Retry-After"] = {"schema": {"type": "string"}}
        if proxied:
            headers.update(_PROXY_HEADERS)
        _PROBLEM_ANSWERS[name] = {
            "description": ", ".join(codes),
            **({"headers": headers} if headers else {}),
            "content": {
                PROBLEM: {
                    "schema": {
                        "allOf": [
                            _ref("Problem"),
                            {"properties": {"code": {"enum": list(codes)}}},
                        ]
                    }
                }
            },
        }
    return {"$ref": f"#/components/responses/{name}"}


def _problems(
    extra: dict[int, tuple[str, ...]] | None = None, proxied: bool = False
) -> dict[str, Any]:
    by_status: dict[int, tuple[str, ...]] = dict(_COMMON)
    for status, codes in (extra or {}).items():
        by_status[status] = by_status.get(status, ()) + codes
    if 404 in by_status and "NOT_FOUND" not in by_status[404]:
        # A path parameter the router cannot match (a control character, say) is the
        # router's own 404 before any handler runs.
        by_status[404] += ("NOT_FOUND",)
    return {
        str(status): _problem_answer(status, by_status[status], proxied)
        for status in sorted(by_status)
    }


def _json(schema_name: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref(schema_name)}},
    }


def _body(model: type[BaseModel] | None, *, required: bool = True) -> dict[str, Any]:
    schema: Schema = _ref(model.__name__) if model is not None else {"type": "object"}
    if model is None:
        schema = {"type": "object", "maxProperties": 0}
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _op(
    op_id: str,
    summary: str,
    tag: str,
    answers: dict[str, Any],
    *,
    body: dict[str, Any] | None = None,
    params: list[Any] | None = None,
    extra: dict[int, tuple[str, ...]] | None = None,
    open_route: bool = False,
    proxied: bool = False,
) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "tags": [tag]}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = body
    op["responses"] = {**answers, **_problems(extra, proxied)}
    if open_route:
        op["security"] = [{}]
    return op


_TASK_ID = {"$ref": "#/components/parameters/taskId"}
_EFFECT_ID = {"$ref": "#/components/parameters/effectId"}
_EFFECT_ID_OR_PREFIX = {"$ref": "#/components/parameters/effectIdOrPrefix"}
_OPERATOR_HEADER = {"$ref": "#/components/parameters/operator"}
_OK_TASK = {404: ("NO_SUCH_TASK",), 409: _LEASE_CODES, 410: ("TASK_EXPIRED",)}
_WAIT_QUERY = [
    {
        "name": "waitFor",
        "in": "query",
        "description": "answer as soon as the task is in this state (a long-poll)",
        "schema": _ref("TaskState"),
    },
    {
        "name": "waitMs",
        "in": "query",
        "description": "with waitFor: the longest wait (clamped to tasks.max_wait_ms, its "
        "default); at the deadline the answer is the record as it is. Past "
        "tasks.max_waiters(_per_principal): 503 TOO_MANY_CONNECTIONS with Retry-After",
        "schema": {"type": "integer", "minimum": 0, "maximum": 999999},
    },
]
_OK_EFFECT = {
    404: ("NO_SUCH_EFFECT", "NO_SUCH_DOWNSTREAM"),
    409: _EFFECT_CODES,
    410: ("EFFECT_EXPIRED",),
}


def _task_paths() -> dict[str, Any]:
    ident = {"parameters": [_TASK_ID]}
    query = [
        {"name": "state", "in": "query", "schema": _ref("TaskState")},
        {"name": "owner", "in": "query", "schema": {"type": "string", "minLength": 1,
                                                    "maxLength": 200}},
        {
            "name": "leaseExpired",
            "in": "query",
            "description": "true: only CLAIMED tasks whose lease has run out (leaseExpiresAt "
            "reached by the store's clock); false: every other task",
            "schema": {"type": "boolean"},
        },
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TASK_PAGE,
                       "default": 100},
        },
        {"name": "cursor", "in": "query", "schema": {"type": "string", "maxLength": 400}},
    ]  # fmt: skip
    return {
        "/v1/tasks": {
            "get": _op(
                "listTasks",
                "Page through tasks in task id order (a short page may still have a "
                "nextCursor); scoped principals see only their task prefixes",
                "coordination",
                {"200": _json("TaskPage", "one page")},
                params=query,
            )
        },
        "/v1/tasks/{task_id}": {
            **ident,
            "put": _op(
                "putTask",
                "Create a task, or make a new revision when inputDigest changes",
                "coordination",
                {"200": _json("Task", "existing task"), "201": _json("Task", "new task")},
                body=_body(PutTaskBody),
            ),
            "get": _op(
                "getTask",
                "Read a task record; with waitFor, once it is in that state (or at waitMs)",
                "coordination",
                {"200": _json("Task", "the task record")},
                params=_WAIT_QUERY,
                extra={404: ("NO_SUCH_TASK",), 410: ("TASK_EXPIRED",)},
            ),
        },
        "/v1/tasks/{task_id}/claim": {
            **ident,
            "post": _op(
                "claimTask",
                "Claim a task (one atomic step in the store)",
                "coordination",
                {"200": _json("ClaimGranted", "the lease")},
                body=_body(ClaimBody),
                extra={
                    404: ("NO_SUCH_TASK",),
                    409: (*_LEASE_CODES, "DEPENDENCIES_PENDING"),
                    410: ("TASK_EXPIRED",),
                    503: ("CLAIMS_PAUSED",),
                },
            ),
        },
        "/v1/queues/{queue}/claim": {
            "parameters": [{"name": "queue", "in": "path", "required": True, "schema": _QUEUE}],
            "post": _op(
                "claimNext",
                "Claim the best claimable task of a queue (highest priority, then oldest); "
                "204 when there is none, after up to waitMs (503 TOO_MANY_CONNECTIONS past "
                "tasks.max_waiters(_per_principal))",
                "coordination",
                {
                    "200": _json("ClaimGranted", "the lease"),
                    "204": {"description": "no claimable task in the queue"},
                },
                body=_body(QueueClaimBody),
                extra={409: ("STALE_EPOCH",), 503: ("CLAIMS_PAUSED",)},
            ),
        },
        "/v1/tasks/{task_id}/renew": {
            **ident,
            "post": _op(
                "renewLease",
                "Extend the current lease",
                "coordination",
                {"200": _json("Renewed", "the new lease end")},
                body=_body(RenewBody),
                extra=_OK_TASK,
            ),
        },
        "/v1/tasks/{task_id}/release": {
            **ident,
            "post": _op(
                "releaseLease",
                "Give the lease back; the task is READY again",
                "coordination",
                {"200": _json("Released", "released")},
                body=_body(ReleaseBody),
                extra=_OK_TASK,
            ),
        },
        "/v1/tasks/{task_id}/commit": {
            **ident,
            "post": _op(
                "commitTask",
                "Commit the attempt's result (at most one canonical commit per revision)",
                "coordination",
                {"200": _json("Committed", "committed, or the same commit repeated")},
                body=_body(CommitBody),
                extra={**_OK_TASK, 413: ("PAYLOAD_TOO_LARGE",)},
            ),
        },
        "/v1/tasks/{task_id}/cancel": {
            **ident,
            "post": _op(
                "cancelTask",
                "Cancel the task until a new revision",
                "coordination",
                {"200": _json("Cancelled", "the new cancelGeneration")},
                body=_body(None, required=False),
                extra={
                    404: ("NO_SUCH_TASK",),
                    409: ("ALREADY_COMMITTED",),
                    410: ("TASK_EXPIRED",),
                },
            ),
        },
    }


#: An event position as a client may send it back (gateway/events.py).
_POSITION = "^[0-9]{1,20}-[0-9]{1,20}$"


def _events_path() -> dict[str, Any]:
    stream = {
        "description": "server-sent events: `id:` the position, `event:` task or effect, "
        "`data:` the event's JSON (the Event schema); comment lines are heartbeats",
        # OpenAPI 3.1: for an event stream, ``schema`` describes one event (its fields).
        "content": {"text/event-stream": {"schema": {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": _POSITION},
                "event": {"enum": ["task", "effect"]},
                "data": {"type": "string", "contentMediaType": "application/json",
                         "contentSchema": _ref("Event")},
                "retry": {"type": "integer", "minimum": 0},
            },
        }}},
    }  # fmt: skip
    params = [
        {
            "name": "after",
            "in": "query",
            "description": "a position to resume after (Last-Event-ID wins when both are "
            "sent); neither: from now",
            "schema": {"type": "string", "pattern": _POSITION},
        },
        {
            "name": "Last-Event-ID",
            "in": "header",
            "required": False,
            "description": "the last position the client saw (what EventSource sends): "
            f"{_POSITION}; a blank one counts as absent",
            "schema": {"type": "string", "maxLength": 41},
        },
    ]
    return {
        "/v1/events": {
            "get": _op(
                "events",
                "Task and effect changes as server-sent events, resumable",
                "coordination",
                {"200": stream},
                params=params,
                extra={410: ("EVENTS_GONE",)},
            )
        }
    }


def _scheduler_paths() -> dict[str, Any]:
    def post(op_id: str, summary: str) -> dict[str, Any]:
        return {
            "post": _op(
                op_id, summary, "coordination", {"200": _json("Scheduler", "the scheduler")}
            )
        }

    return {
        "/v1/epoch": {
            "get": _op(
                "getEpoch",
                "The global scheduler epoch",
                "coordination",
                {"200": _json("Scheduler", "the scheduler")},
            )
        },
        "/v1/epoch/bump": post("bumpEpoch", "Bump the epoch: fences every older claim"),
        "/v1/claims/pause": post("pauseClaims", "Refuse new claims (503 CLAIMS_PAUSED)"),
        "/v1/claims/resume": post("resumeClaims", "Accept claims again"),
    }


def _ledger_paths() -> dict[str, Any]:
    query = [
        {"name": "state", "in": "query", "schema": _ref("EffectState")},
        {
            "name": "taskId",
            "in": "query",
            "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:@/-]{1,200}$"},
        },
        {"name": "downstream", "in": "query", "schema": {"type": "string"}},
        {
            "name": "limit",
            "in": "query",
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 100},
        },
        {"name": "cursor", "in": "query", "schema": {"type": "string", "maxLength": 200}},
        {
            "name": "awaitingApproval",
            "in": "query",
            "description": "true: the effects waiting for an operator's approval, oldest first, "
            "one page from the store's index (only limit may go with it)",
            "schema": {"type": "boolean", "default": False},
        },
        {
            "name": "idempotencyKey",
            "in": "query",
            "description": "a keyed effect by its client's Idempotency-Key (decoded): one "
            "record per downstream that has one, from their ids, no cursor; only principal "
            "and downstream may go with it. The one form a client may use, for its own keys",
            "schema": {"type": "string", "minLength": 1, "maxLength": 255,
                       "pattern": "^[\\x20-\\x7e]+$"},
        },
        {
            "name": "principal",
            "in": "query",
            "description": "with idempotencyKey: whose key (default: the caller's own "
            "principal, anonymous without [auth])",
            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
        },
    ]  # fmt: skip
    one = {"parameters": [_EFFECT_ID]}
    acting = [_OPERATOR_HEADER]
    return {
        "/v1/effects": {
            "get": _op(
                "listEffects",
                "Page through effect records, oldest first; or look up keyed effects by "
                "idempotencyKey",
                "ledger",
                {"200": _json("EffectPage", "one page")},
                params=query,
            )
        },
        "/v1/effects/{effect_id}": {
            "parameters": [_EFFECT_ID_OR_PREFIX],
            "get": _op(
                "getEffect",
                "Read one effect record, by its id or a unique prefix of at least 6 "
                "(observers: stored body withheld); an ambiguous prefix is 400 naming up to "
                "10 matches",
                "ledger",
                {"200": _json("Effect", "the record")},
                extra={404: ("NO_SUCH_EFFECT",), 410: ("EFFECT_EXPIRED",)},
            ),
        },
        "/v1/effects/{effect_id}/resolve": {
            **one,
            "post": _op(
                "resolveEffect",
                "Settle an UNKNOWN effect by hand (once: an identical repeat is a no-op)",
                "ledger",
                {"200": _json("Resolved", "the record, whether this changed it, warnings")},
                body=_body(ResolveBody),
                params=acting,
                extra=_OK_EFFECT,
            ),
        },
        "/v1/effects/{effect_id}/approve": {
            **one,
            "post": _op(
                "approveEffect",
                "Let a waiting non-replayable effect go once",
                "ledger",
                {"200": _json("Effect", "the record")},
                body=_body(ApproveBody, required=False),
                params=acting,
                extra=_OK_EFFECT,
            ),
        },
        "/v1/effects/{effect_id}/reconcile": {
            **one,
            "post": _op(
                "reconcileEffect",
                "Run the downstream adapter's probe on an UNKNOWN effect",
                "ledger",
                {"200": _json("Effect", "the record")},
                body=_body(None, required=False),
                params=acting,
                extra=_OK_EFFECT,
            ),
        },
    }


def _operation_paths() -> dict[str, Any]:
    text = {"text/plain": {"schema": {"type": "string"}}}
    metadata = {
        "description": "the metadata document",
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
    return {
        "/healthz": {
            "get": _op(
                "healthz",
                "The process is up",
                "operations",
                {"200": _json("Health", "up")},
                open_route=True,
            )
        },
        "/.well-known/oauth-protected-resource": {
            "get": _op(
                "oauthProtectedResource",
                "RFC 9728 protected resource metadata of the gateway ([auth.oauth]; 404 "
                "without): its authorization server and scopes",
                "operations",
                {"200": metadata},
                open_route=True,
            )
        },
        "/.well-known/oauth-protected-resource/mcp/{downstream}": {
            "parameters": [
                {
                    "name": "downstream",
                    "in": "path",
                    "required": True,
                    "description": 'a downstream with adapter = "mcp"',
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                }
            ],
            "get": _op(
                "oauthProtectedResourceMcp",
                "RFC 9728 metadata of an MCP downstream's resource (<resource_base_url>/mcp/"
                "{downstream}) ([auth.oauth]; 404 without)",
                "mcp",
                {"200": metadata},
                extra={404: ("NO_SUCH_DOWNSTREAM",)},
                open_route=True,
            ),
        },
        "/readyz": {
            "get": _op(
                "readyz",
                "The store answered a round trip just now",
                "operations",
                {"200": _json("Ready", "ready")},
                open_route=True,
            )
        },
        "/metrics": {
            "get": _op(
                "metrics",
                "Prometheus metrics (text exposition format)",
                "operations",
                {"200": {"description": "metrics", "content": text}},
            )
        },
        "/openapi.json": {
            "get": _op(
                "openapi",
                "This document",
                "operations",
                {
                    "200": {
                        "description": "the OpenAPI document",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            )
        },
        "/v1/rollout": {
            "get": _op(
                "rollout",
                "Is it safe to switch worker pools (no lease held, nothing in flight)?",
                "operations",
                {"200": _json("Rollout", "the checklist")},
            )
        },
        "/v1/store/stats": {
            "get": _op(
                "storeStats",
                "The store's sizes, from its indexes: records by kind, what is due to expire, "
                "tombstones, bytes",
                "operations",
                {"200": _json("StoreStats", "the sizes")},
            )
        },
    }


def _proxy_path() -> dict[str, Any]:
    def header(name: str, required: bool, description: str, **schema: Any) -> dict[str, Any]:
        return {
            "name": name,
            "in": "header",
            "required": required,
            "description": description,
            "schema": {"type": "string", **schema},
        }

    params = [
        {
            "name": "tail",
            "in": "path",
            "required": True,
            "description": "{downstream}/{path}: forwarded to the downstream's base URL + /{path}",
            "schema": {"type": "string"},
        },
        header("Fence-Task", True, "taskId"),
        header("Fence-Attempt", True, "attemptId"),
        header("Fence-Generation", True, "claimGeneration", pattern="^[0-9]+$"),
        header("Fence-Epoch", True, "schedulerEpoch", pattern="^[0-9]+$"),
        header("Fence-Cancel", True, "the cancelGeneration the worker observed"),
        header("Fence-Node", False, "node, default main"),
        header("Fence-Slot", False, "the effect slot; required for unsafe methods"),
    ]
    passthrough = {
        "description": "the downstream's own answer (or its stored answer, replayed), "
        "any status, any body; Fence-Effect-State says what the ledger recorded",
        "headers": _PROXY_HEADERS,
    }
    extra = {
        404: ("NO_SUCH_DOWNSTREAM", "NO_SUCH_TASK"),
        409: (*_LEASE_CODES, *_EFFECT_CODES),
        410: ("TASK_EXPIRED",),
        422: ("PAYLOAD_CONFLICT",),
        502: ("DOWNSTREAM_UNREACHABLE",),
        503: ("CLAIMS_PAUSED", "DOWNSTREAM_BUSY"),
        504: ("DOWNSTREAM_TIMEOUT",),
    }
    operations: dict[str, Any] = {"parameters": params}
    for method in ("get", "head", "options", "post", "put", "patch", "delete"):
        op = _op(
            f"proxy{method.capitalize()}",
            "Fenced pass-through to a downstream (body is the downstream's business)",
            "proxy",
            {"default": passthrough},
            extra=extra,
            proxied=True,
        )
        operations[method] = op
    return {"/proxy/{tail}": operations}


def _console_paths() -> dict[str, Any]:
    """The operator console (docs/console.md): HTML pages and form posts for browsers, not
    part of the JSON API. Listed so the document names every route; the console's own
    session cookie is its credential (or ``Fence-Authorization``)."""
    from fencegate.gateway.console import ROUTES

    html = {"text/html": {"schema": {"type": "string"}}}
    form = {
        "required": False,
        "content": {"application/x-www-form-urlencoded": {"schema": {"type": "object"}}},
    }
    paths: dict[str, Any] = {}
    for method, path, summary in ROUTES:
        params: list[Any] = []
        if "{effect_id}" in path:
            params.append(_EFFECT_ID_OR_PREFIX if method == "GET" else _EFFECT_ID)
        if "{name}" in path:
            params.append({"name": "name", "in": "path", "required": True,
                           "schema": {"type": "string"}})  # fmt: skip
        answers: dict[str, Any] = {
            "200": {"description": "an HTML page (JSON for the chart samples)", "content": html},
            "303": {"description": "to the login page (no session), or on after a login"},
            "400": {"description": "an HTML page: the input was refused", "content": html},
            "401": {"description": "an HTML page: no session", "content": html},
            "403": {"description": "an HTML page: the role, the CSRF token or the origin",
                    "content": html},
            "404": {"description": "an HTML page: no such record", "content": html},
        }  # fmt: skip
        op_id = "console" + "".join(
            part.strip("{}").replace("_", " ").title().replace(" ", "")
            for part in path.split("/")[2:]
        )
        op: dict[str, Any] = {
            "operationId": f"{op_id or 'consoleQueue'}{method.title()}",
            "summary": summary,
            "tags": ["console"],
        }
        if params:
            op["parameters"] = params
        if method == "POST":
            op["requestBody"] = form
        op["responses"] = answers
        paths.setdefault(path, {})[method.lower()] = op
    return paths


def _mcp_path() -> dict[str, Any]:
    """The MCP gateway (docs/PROTOCOL.md, "MCP"): the bodies are MCP's JSON-RPC messages, and
    its refusals are JSON-RPC errors, not problem+json (authentication's 401/403 aside)."""
    params = [
        {
            "name": "downstream",
            "in": "path",
            "required": True,
            "description": "a downstream with adapter = \"mcp\"",
            "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        },
        *(
            {"name": name, "in": "header", "required": False, "description": what,
             "schema": {"type": "string"}}
            for name, what in (
                ("Fence-Task", "taskId (every method but the lease-free ones)"),
                ("Fence-Attempt", "attemptId"),
                ("Fence-Generation", "claimGeneration"),
                ("Fence-Epoch", "schedulerEpoch"),
                ("Fence-Cancel", "the cancelGeneration the worker observed"),
                ("Fence-Node", "node, default main"),
                ("Mcp-Session-Id", "the MCP session (handshake revisions); with [auth] the id "
                 "this gateway handed out, bound to the principal: another's is 404"),
                ("MCP-Protocol-Version", "the MCP revision the session speaks"),
            )
        ),
    ]  # fmt: skip
    relayed = {
        "description": "the MCP server's answer (JSON or text/event-stream), a replayed "
        "answer, or a JSON-RPC error naming the refusal in error.data.code",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
    operations: dict[str, Any] = {"parameters": params}
    for method, summary in (
        ("get", "The server's stream of the session (relayed)"),
        ("post", "One JSON-RPC message; tools/call is a fenced, recorded effect"),
        ("delete", "End the session (relayed)"),
    ):
        operations[method] = {
            "operationId": f"mcp{method.capitalize()}",
            "summary": summary,
            "tags": ["mcp"],
            "responses": {"default": relayed},
        }
    return {"/mcp/{downstream}": operations}


def _router_not_found(paths: dict[str, Any]) -> None:
    """Every operation under a path with a parameter may answer the router's own 404
    (``NOT_FOUND``: a value it cannot match, a control character say) before any handler
    runs, whatever the handler itself answers."""
    for path, item in paths.items():
        if "{" not in path:
            continue
        for method, operation in item.items():
            if method == "parameters" or not isinstance(operation, dict):
                continue
            responses = operation.setdefault("responses", {})
            if "404" not in responses:
                responses["404"] = _problem_answer(404, ("NOT_FOUND",), proxied=False)


@cache
def document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document (the same object on every call: do not mutate it)."""
    schemas: dict[str, Schema] = {}
    for model in _REQUESTS:
        generated = model.model_json_schema(ref_template=_REF, mode="validation")
        schemas.update(generated.pop("$defs", {}))
        schemas[model.__name__] = generated
    schemas.update(_WRITTEN)
    _add_answer_schemas(schemas)
    paths: dict[str, Any] = {
        **_operation_paths(),
        **_task_paths(),
        **_events_path(),
        **_scheduler_paths(),
        **_ledger_paths(),
        **_proxy_path(),
        **_mcp_path(),
        **_console_paths(),
    }
    _router_not_found(paths)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "fencegate",
            "version": "1",
            "description": "Fencing gateway and idempotency ledger. The contract in prose is "
            "docs/PROTOCOL.md; every error is application/problem+json (RFC 9457) with a "
            "machine-readable code, except on /mcp, whose refusals are JSON-RPC errors. "
            "Authentication applies only when the gateway's config has "
            "[auth] (docs/security.md).",
        },
        "servers": [{"url": "http://127.0.0.1:8700"}],
        "security": [{"fenceBearer": []}, {"bearer": []}],
        "tags": [
            {"name": "coordination"},
            {"name": "ledger"},
            {"name": "operations"},
            {"name": "proxy"},
            {"name": "mcp"},
            {"name": "console"},
        ],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "fenceBearer": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Fence-Authorization",
                    "description": "Bearer <token>; on every path",
                },
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Authorization: Bearer <token>; on /v1/* and /metrics only",
                },
            },
            "parameters": {
                "taskId": {
                    "name": "task_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:@/-]{1,200}$"},
                },
                "effectId": {
                    "name": "effect_id",
                    "in": "path",
                    "required": True,
                    "schema": _HEX64,
                },
                "effectIdOrPrefix": {
                    "name": "effect_id",
                    "in": "path",
                    "required": True,
                    "description": "an effectId, or a prefix of at least 6 characters that "
                    "starts exactly one live effect's id",
                    "schema": {"type": "string", "pattern": "^[0-9a-f]{6,64}$"},
                },
                "operator": {
                    "name": "Fence-Operator",
                    "in": "header",
                    "required": False,
                    "description": "who acts, without [auth] (with it: the principal)",
                    "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:@/ -]{1,200}$"},
                },
            },
            "responses": dict(sorted(_PROBLEM_ANSWERS.items())),
            "schemas": schemas,
        },
    }


@cache
def document_bytes() -> bytes:
    """The document as served and as kept in docs/openapi.json."""
    return (json.dumps(document(), indent=2) + "\n").encode()


async def serve(request: web.Request) -> web.Response:
    """``GET /openapi.json``."""
    return web.Response(body=document_bytes(), content_type="application/json")


if __name__ == "__main__":
    sys.stdout.buffer.write(document_bytes())
