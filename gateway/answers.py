"""The JSON answers of the HTTP API, as pydantic models: one source for what a handler sends
and for the answer schemas of the OpenAPI document (``gateway/openapi.py`` generates them
from these classes, as it does the request schemas from ``api_models``), so a member, a
bound or an enum cannot be written one way in a handler and another in the document.

How an answer is built and sent:

* ``Model.of(record)`` maps a ledger record to its answer with ``model_construct``: the
  records are already checked by the ledger, and no answer should cost a validation (claims,
  renewals and commits are the hot path) nor turn a granted claim into a 500.
* ``wire()`` dumps what was set, in declaration order, so the bytes are what the handlers
  sent as dicts (docs/PROTOCOL.md is the contract). A member with a default is one a client
  must do without (a v1 addition, marked + in PROTOCOL.md): the document does not require it
  and does not show the default, which is never sent.
* What the ledger stores as JSON (an effect's stored response and its action trail) is
  validated on the way out instead, and carried as stored when it does not fit these models
  (a newer gateway may share the store during a rolling upgrade): an operator's read never
  fails on a record, nor drops a member of it.
* Enums are the ledger's (``TaskState``, ``EffectState``, ``ProbeVerdict``), never retyped
  lists.

The models carry comments, not docstrings: pydantic makes a class docstring the schema's
description in the published document.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Self

from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
)

from fencegate.gateway.api_models import MAX_SAFE_INT, Priority, Queue
from fencegate.ledger import effects as ledger_effects
from fencegate.ledger import queries
from fencegate.ledger import retention as ledger_retention
from fencegate.ledger import tasks as ledger_tasks
from fencegate.ledger.effects import EffectState, ProbeVerdict
from fencegate.ledger.tasks import TaskState

__all__ = [
    "Answer",
    "Approval",
    "ApproveAction",
    "Cancelled",
    "ClaimGranted",
    "CommitRecord",
    "Committed",
    "DependencyCommit",
    "Effect",
    "EffectAction",
    "EffectAttempt",
    "EffectEvent",
    "EffectPage",
    "Event",
    "KeptRequest",
    "Probes",
    "ReconcileAction",
    "Released",
    "Renewed",
    "ResolveAction",
    "Resolved",
    "Rollout",
    "RolloutBlocker",
    "Scheduler",
    "StoreEffectCounts",
    "StoreRetention",
    "StoreStats",
    "StoreTaskCounts",
    "StoreTombstones",
    "StoredResponse",
    "Task",
    "TaskEvent",
    "TaskPage",
    "reply",
]

Counter = Annotated[int, Field(ge=0, le=MAX_SAFE_INT)]
Time = Annotated[int, Field(description="ms since the Unix epoch, store time")]
Revision = Annotated[int, Field(ge=1)]
Hex64 = Annotated[str, Field(pattern="^[0-9a-f]{64}$")]


class Answer(BaseModel):
    model_config = ConfigDict(frozen=True)

    def wire(self) -> dict[str, Any]:
        """The answer as JSON-ready data: the members that were set, in declaration order."""
        return self.model_dump(mode="json", exclude_unset=True)


def reply(answer: Answer, status: int = 200) -> web.Response:
    return web.json_response(answer.wire(), status=status)


#: A stored JSON record keeps members this gateway does not know (a newer one wrote them).
_STORED = ConfigDict(extra="allow", frozen=True)


class _AsStored(BaseModel):
    """A stored JSON record that does not fit its model, sent as it was stored (never in a
    schema: the document describes what this gateway writes)."""

    model_config = _STORED


def _stored(adapter: TypeAdapter[Any], record: dict[str, Any]) -> BaseModel:
    try:
        model: BaseModel = adapter.validate_python(record)
    except ValidationError:
        return _AsStored.model_construct(**record)
    return model


# --- tasks ------------------------------------------------------------------------------


class CommitRecord(Answer):
    commitId: str
    attemptId: str
    claimGeneration: Counter
    resultDigest: str
    committedAt: Time
    #: The ``result`` the commit carried (any JSON), absent when it carried none.
    result: Any = None

    @classmethod
    def of(cls, commit: ledger_tasks.Commit) -> Self:
        values: dict[str, Any] = {
            "commitId": commit.commit_id,
            "attemptId": commit.attempt_id,
            "claimGeneration": commit.claim_generation,
            "resultDigest": commit.result_digest,
            "committedAt": commit.committed_at,
        }
        if commit.result_json is not None:
            values["result"] = json.loads(commit.result_json)
        return cls.model_construct(**values)


class DependencyCommit(Answer):
    taskId: str
    commitId: str
    resultDigest: str


Provenance = Annotated[
    list[DependencyCommit],
    Field(
        description="the canonical commit of each dependency this revision builds on, in "
        "dependsOn order (shorter than dependsOn while the task is WAITING)"
    ),
]


def _provenance(task: ledger_tasks.Task) -> list[DependencyCommit]:
    return [
        DependencyCommit.model_construct(
            taskId=dep.task_id, commitId=dep.commit_id, resultDigest=dep.result_digest
        )
        for dep in task.dep_commits
    ]


# The task record (``GET /v1/tasks/{id}``). ``schedulerEpoch`` is the epoch the current claim
# was granted under (null before the first claim); the global one is ``GET /v1/epoch``.
class Task(Answer):
    taskId: str
    state: TaskState
    revision: Revision
    inputDigest: str
    maxRuntimeMs: Annotated[int, Field(ge=1)] | None = None
    claimGeneration: Counter
    attemptId: str | None
    owner: str | None
    principal: str | None = None
    leaseExpiresAt: Time | None
    attemptStartedAt: Time | None = None
    cancelGeneration: Counter
    schedulerEpoch: Counter | None
    commit: CommitRecord | None
    createdAt: Time = 0
    updatedAt: Time = 0
    queue: Queue | None = None
    priority: Priority = 0
    dependsOn: list[str] = Field(default_factory=list)
    dependencies: Provenance = Field(default_factory=list)
    cost: Annotated[
        dict[str, Annotated[float, Field(ge=0)]],
        Field(description="what the current (or last) attempt reported spending, per unit"),
    ] = Field(default_factory=dict)

    @classmethod
    def of(cls, task: ledger_tasks.Task) -> Self:
        return cls.model_construct(
            taskId=task.task_id,
            state=task.state,
            revision=task.revision,
            inputDigest=task.input_digest,
            maxRuntimeMs=task.max_runtime_ms,
            claimGeneration=task.claim_generation,
            attemptId=task.attempt_id,
            owner=task.owner,
            principal=task.principal,
            leaseExpiresAt=task.lease_expires_at,
            attemptStartedAt=task.attempt_started_at,
            cancelGeneration=task.cancel_generation,
            schedulerEpoch=task.claim_epoch,
            commit=CommitRecord.of(task.commit) if task.commit is not None else None,
            createdAt=task.created_at,
            updatedAt=task.updated_at,
            queue=task.queue,
            priority=task.priority,
            dependsOn=list(task.depends_on),
            dependencies=_provenance(task),
            cost=dict(task.attempt_cost),
        )


class TaskPage(Answer):
    tasks: list[Task]
    nextCursor: str | None


# A granted claim, by id or from a queue (the same answer).
class ClaimGranted(Answer):
    taskId: str
    attemptId: str
    claimGeneration: Counter
    schedulerEpoch: Counter
    cancelGeneration: Counter
    leaseExpiresAt: Time
    grantedTtlMs: Annotated[int, Field(ge=0)]
    revision: Revision
    inputDigest: str
    queue: Queue | None = None
    dependencies: Provenance = Field(default_factory=list)

    @classmethod
    def of(cls, task: ledger_tasks.Task) -> Self:
        assert task.lease_expires_at is not None and task.attempt_started_at is not None
        return cls.model_construct(
            taskId=task.task_id,
            attemptId=task.attempt_id,
            claimGeneration=task.claim_generation,
            schedulerEpoch=task.claim_epoch,
            cancelGeneration=task.cancel_generation,
            leaseExpiresAt=task.lease_expires_at,
            grantedTtlMs=task.lease_expires_at - task.attempt_started_at,
            revision=task.revision,
            inputDigest=task.input_digest,
            queue=task.queue,
            dependencies=_provenance(task),
        )


class Renewed(Answer):
    leaseExpiresAt: Time


class Released(Answer):
    taskId: str
    state: Literal[TaskState.READY, TaskState.WAITING]


class Committed(Answer):
    outcome: Literal["COMMITTED"]
    commitId: str


class Cancelled(Answer):
    cancelGeneration: Counter


class Scheduler(Answer):
    schedulerEpoch: Counter
    claimsPaused: bool

    @classmethod
    def of(cls, scheduler: ledger_tasks.Scheduler) -> Self:
        return cls.model_construct(
            schedulerEpoch=scheduler.epoch, claimsPaused=scheduler.claims_paused
        )


# --- events (the store writes them, ledger.events; the gateway relays them as written) ----


class TaskEvent(Answer):
    type: Literal["task"]
    taskId: str
    state: TaskState
    queue: str | None
    revision: Revision
    claimGeneration: Counter
    at: Time


class EffectEvent(Answer):
    type: Literal["effect"]
    effectId: Hex64
    #: null for a keyed effect (a lease-less client's: no task).
    taskId: str | None
    state: EffectState
    downstream: str
    at: Time


# One event's data (the stream relays each event as its store wrote it, ledger.events).
class Event(RootModel[Annotated[TaskEvent | EffectEvent, Field(discriminator="type")]]):
    model_config = ConfigDict(
        json_schema_extra={
            "description": "the data of one server-sent event of GET /v1/events (its id is "
            "the event's position, its event name the type)"
        }
    )


# --- effects ----------------------------------------------------------------------------


# What duplicates of a COMMITTED effect are answered with (``ledger.responses`` writes it, in
# this member order; unknown members are kept).
class StoredResponse(Answer):
    model_config = _STORED

    status: Annotated[int, Field(ge=100, le=599)]
    headers: list[tuple[str, str]]
    bodySize: Annotated[int, Field(ge=0)] = 0
    bodyDigest: Hex64 = ""
    bodyBase64: Annotated[str, Field(json_schema_extra={"contentEncoding": "base64"})] = ""
    bodyOmitted: Literal[True] = True
    bodyOmittedReason: str = ""
    #: An MCP tool's result whose body was not kept: what its replay still says.
    summary: dict[str, Any] = Field(default_factory=dict)
    source: str = ""
    #: The reader may not see stored bodies: ``bodyBase64`` and ``bodyDigest`` are left out.
    bodyWithheld: Literal[True] = True


_RESPONSE: TypeAdapter[StoredResponse] = TypeAdapter(StoredResponse)
#: What a reader without the operator role does not see of a stored answer: the body, and its
#: digest (a short secret could be guessed from it). ``bodySize`` stays.
_WITHHELD = ("bodyBase64", "bodyDigest")


# The request an effect's last forward sent (``ledger.requests`` writes it, in this member
# order; unknown members are kept): for downstreams with ``keep_request_bodies``.
class KeptRequest(Answer):
    model_config = _STORED

    headers: Annotated[
        list[tuple[str, str]],
        Field(
            description="as forwarded, without Fence-*, Authorization, Proxy-Authorization, "
            "Cookie and the downstream's headers_from_env and never_store_headers names; its "
            'redact_headers show as "<redacted>"; the idempotency key header is shown with '
            "the effectId"
        ),
    ]
    body: Annotated[
        str, Field(description="the kept body, when it is UTF-8 text (after redaction)")
    ] = ""
    bodyBase64: Annotated[str, Field(json_schema_extra={"contentEncoding": "base64"})] = ""
    bodySize: Annotated[int, Field(ge=0, description="the whole body's size in bytes")] = 0
    truncated: Annotated[
        bool, Field(description="true: the body is cut to keep_request_max_bytes")
    ] = False
    #: Why no body was kept (redact_json_fields could not be applied: not JSON).
    bodyOmittedReason: str = ""
    #: The reader may not see kept bodies: ``body`` and ``bodyBase64`` are left out.
    bodyWithheld: Literal[True] = True


_REQUEST: TypeAdapter[KeptRequest] = TypeAdapter(KeptRequest)
#: What a reader without the operator role does not see of a kept request.
_REQUEST_WITHHELD = ("body", "bodyBase64")


class EffectAttempt(Answer):
    attemptId: str
    claimGeneration: Counter
    startedAt: Time
    endedAt: Time | None
    outcome: str | None
    reason: str | None = None
    approvedBy: str | None = None


class Approval(Answer):
    approvalDigest: str
    payloadDigest: str | None
    by: str
    at: Time
    expiresAt: Time


class Probes(Answer):
    count: Counter
    nextAt: Time | None


# The action trail: one model per kind, members in the order ledger.effects writes them.
class ResolveAction(Answer):
    model_config = _STORED

    action: Literal["resolve"]
    by: str
    at: Time
    note: str = ""
    outcome: EffectState = EffectState.COMMITTED
    #: A digest of the response the operator supplied; null for none.
    response: str | None = None
    force: Annotated[
        Literal[True], Field(description="resolve: NOT_APPLIED forced before landingUntil")
    ] = True
    landingUntil: Time = 0


class ApproveAction(Answer):
    model_config = _STORED

    action: Literal["approve"]
    by: str
    at: Time
    note: str = ""
    payloadDigest: str = ""
    approvalDigest: str = ""
    expiresAt: Time = 0


class ReconcileAction(Answer):
    model_config = _STORED

    action: Literal["reconcile"]
    by: str
    at: Time
    verdict: ProbeVerdict = ProbeVerdict.INCONCLUSIVE
    #: When the probe was sent (its verdict is judged by it; ``at``: when it was recorded).
    askedAt: Time = 0
    #: An "absent" that came before an earlier forward could no longer land: inconclusive.
    waitUntil: Time = 0
    #: When the probe settled the effect.
    outcome: EffectState = EffectState.COMMITTED


EffectAction = Annotated[
    ResolveAction | ApproveAction | ReconcileAction, Field(discriminator="action")
]
_ACTION: TypeAdapter[ResolveAction | ApproveAction | ReconcileAction] = TypeAdapter(EffectAction)


# The ledger record (``GET /v1/effects/{effectId}``), with the approval waiting to be used,
# the probe state and the operator actions.
class Effect(Answer):
    effectId: Hex64
    kind: Annotated[
        Literal["leased", "keyed"],
        Field(
            description="leased: a worker's, under a lease (effectId from task, revision, node "
            "and slot); keyed: a lease-less client's, by its Idempotency-Key (taskId, revision, "
            "node and slot are null)"
        ),
    ] = "leased"
    taskId: str | None
    revision: Revision | None
    node: str | None
    slot: str | None
    principal: Annotated[
        str | None,
        Field(description="keyed: the principal the idempotency key belongs to; else null"),
    ] = None
    idempotencyKey: Annotated[
        str | None, Field(description="keyed: the client's Idempotency-Key; else null")
    ] = None
    downstream: str
    method: str
    path: str
    payloadDigest: str
    approvalDigest: Annotated[
        str,
        Field(
            description="what an approval names: SHA-256 of payloadDigest and the request's "
            "Content-Type, Content-Encoding and preconditions (payloadDigest when none was "
            "sent)"
        ),
    ]
    requestedBy: str | None = None
    state: EffectState
    deadlineAt: Time | None = None
    attempts: list[EffectAttempt]
    response: SerializeAsAny[StoredResponse] | None
    request: Annotated[
        SerializeAsAny[KeptRequest] | None,
        Field(description="the last forward's request (keep_request_bodies); absent: not kept"),
    ] = None
    lookUp: Annotated[
        str,
        Field(
            description="UNKNOWN only: what to look up at the downstream to settle it (the "
            "idempotency key it received and the call)"
        ),
    ] = ""
    approval: Approval | None = None
    probes: Probes = Probes(count=0, nextAt=None)
    actions: list[SerializeAsAny[EffectAction]] = Field(default_factory=list)
    createdAt: Time
    updatedAt: Time

    @classmethod
    def of(
        cls,
        effect: ledger_effects.Effect,
        *,
        withhold_body: bool = False,
        key_header: str | None = None,
        look_up: str | None = None,
        **more: Any,
    ) -> Self:
        """The record of ``effect``; ``withhold_body``: without the stored answer's body and
        its digest, nor the kept request's body (``bodyWithheld: true``), for a reader who
        may not see stored bodies. ``key_header``: the downstream's idempotency key header,
        shown in the kept request's headers with the effectId; ``look_up``: the ``lookUp``
        text (``forward.look_up``). ``more``: the members of a subclass."""
        wanted = ledger_effects.wanted_approval(effect)
        approval = None
        if effect.approval_digest is not None:
            approval = Approval.model_construct(
                approvalDigest=effect.approval_digest,
                # The payload it covers: the record's, while the approval is for its request
                # (a record rebound to another request keeps the approval, for that one only).
                payloadDigest=effect.payload_digest if effect.approval_digest == wanted else None,
                by=effect.approval_by,
                at=effect.approval_at,
                expiresAt=effect.approval_expires_at,
            )
        response = None
        if effect.response_json:
            record = json.loads(effect.response_json)
            if withhold_body:
                for name in _WITHHELD:
                    record.pop(name, None)
                record["bodyWithheld"] = True
            response = _stored(_RESPONSE, record)
        if effect.request_json:
            more["request"] = _kept_request(effect, withhold_body, key_header)
        if look_up:
            more["lookUp"] = look_up
        actions = json.loads(effect.actions_json) if effect.actions_json else []
        return cls.model_construct(
            effectId=effect.effect_id,
            kind=effect.kind,
            taskId=effect.task_id,
            revision=effect.revision,
            node=effect.node,
            slot=effect.slot,
            principal=effect.principal,
            idempotencyKey=effect.idempotency_key,
            downstream=effect.downstream,
            method=effect.method,
            path=effect.path,
            payloadDigest=effect.payload_digest,
            approvalDigest=wanted,
            requestedBy=effect.requested_by,
            state=effect.state,
            deadlineAt=effect.deadline_at,
            attempts=[
                EffectAttempt.model_construct(
                    attemptId=a.attempt_id,
                    claimGeneration=a.claim_generation,
                    startedAt=a.started_at,
                    endedAt=a.ended_at,
                    outcome=a.outcome,
                    reason=a.reason,
                    approvedBy=a.approved_by,
                )
                for a in effect.attempts
            ],
            response=response,
            approval=approval,
            probes=Probes.model_construct(count=effect.probe_count, nextAt=effect.next_probe_at),
            actions=[_stored(_ACTION, action) for action in actions],
            createdAt=effect.created_at,
            updatedAt=effect.updated_at,
            **more,
        )


def _kept_request(
    effect: ledger_effects.Effect, withhold_body: bool, key_header: str | None
) -> BaseModel:
    assert effect.request_json is not None
    record = json.loads(effect.request_json)
    if key_header is not None and isinstance(record.get("headers"), list):
        # The prepare kept the request before the effectId was decided: it went out with it.
        record["headers"] = [*record["headers"], [key_header, effect.effect_id]]
    if withhold_body:
        for name in _REQUEST_WITHHELD:
            record.pop(name, None)
        record["bodyWithheld"] = True
    return _stored(_REQUEST, record)


class Resolved(Effect):
    unchanged: Annotated[
        bool,
        Field(
            description="true: this repeated the resolution that settled the effect; nothing "
            "was recorded"
        ),
    ]
    warnings: Annotated[
        list[str],
        Field(
            description="what duplicates of the call will be answered, when the operator "
            "should know (no response stored: an empty 204)"
        ),
    ]


class EffectPage(Answer):
    effects: list[Effect]
    nextCursor: str | None


# --- operations -------------------------------------------------------------------------


_Gauge = Literal["activeLeases", "preparedEffects", "unknownEffects", "awaitingApproval"]
#: The ``Rollout`` member each gauge of the checklist (``ledger.queries.Gauges``) is sent as.
_ROLLOUT_MEMBERS: dict[str, _Gauge] = {
    "active_leases": "activeLeases",
    "prepared_effects": "preparedEffects",
    "unknown_effects": "unknownEffects",
    "awaiting_approval": "awaitingApproval",
}


# One condition of the rollout checklist that fails: a count that is not zero yet.
class RolloutBlocker(Answer):
    member: Annotated[
        _Gauge, Field(description="the rollout answer's member whose count is not zero")
    ]
    count: Annotated[int, Field(ge=1, le=MAX_SAFE_INT)]
    reason: Annotated[
        str, Field(description="the condition in words, with its count: '2 leases held'")
    ]


# Is it safe to switch worker pools (the rollback procedure of the rollout notes)?
class Rollout(Answer):
    schedulerEpoch: Counter
    claimsPaused: bool
    activeLeases: Counter
    preparedEffects: Counter
    unknownEffects: Counter
    awaitingApproval: Counter
    safeToSwitchPools: bool
    blockers: list[RolloutBlocker] = Field(
        default_factory=list,
        description="why safeToSwitchPools is false: each count that is not zero, in "
        "checklist order (empty when it is true)",
    )

    @classmethod
    def of(cls, scheduler: ledger_tasks.Scheduler, gauges: queries.Gauges) -> Self:
        blockers = queries.switch_blockers(gauges)
        return cls.model_construct(
            schedulerEpoch=scheduler.epoch,
            claimsPaused=scheduler.claims_paused,
            activeLeases=gauges.active_leases,
            preparedEffects=gauges.prepared_effects,
            unknownEffects=gauges.unknown_effects,
            awaitingApproval=gauges.awaiting_approval,
            safeToSwitchPools=not blockers,
            blockers=[
                RolloutBlocker.model_construct(
                    member=_ROLLOUT_MEMBERS[b.gauge], count=b.count, reason=b.reason
                )
                for b in blockers
            ],
        )


class StoreTaskCounts(Answer):
    total: Counter
    claimed: Counter
    settled: Counter
    dueToExpire: Counter


class StoreEffectCounts(Answer):
    total: Counter
    prepared: Counter
    unknown: Counter
    awaitingApproval: Counter


class StoreTombstones(Answer):
    tasks: Counter
    effects: Counter


class StoreRetention(Answer):
    enabled: bool
    settledMs: Counter


# The store's sizes (``GET /v1/store/stats``, what ``fencegate store stats`` prints).
class StoreStats(Answer):
    tasks: StoreTaskCounts
    effects: StoreEffectCounts
    tombstones: StoreTombstones
    events: Counter
    bytes: Counter | None
    bytesDetail: dict[str, Counter]
    retention: StoreRetention

    @classmethod
    def of(cls, stats: ledger_retention.StoreStats, settled_ms: int, enabled: bool) -> Self:
        return cls.model_construct(
            tasks=StoreTaskCounts.model_construct(
                total=stats.tasks,
                claimed=stats.claimed_tasks,
                settled=stats.settled_tasks,
                dueToExpire=stats.due_tasks,
            ),
            effects=StoreEffectCounts.model_construct(
                total=stats.effects,
                prepared=stats.prepared_effects,
                unknown=stats.unknown_effects,
                awaitingApproval=stats.awaiting_approval,
            ),
            tombstones=StoreTombstones.model_construct(
                tasks=stats.task_tombstones, effects=stats.effect_tombstones
            ),
            events=stats.events,
            bytes=stats.bytes,
            bytesDetail=stats.bytes_detail,
            retention=StoreRetention.model_construct(enabled=enabled, settledMs=settled_ms),
        )
